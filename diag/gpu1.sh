set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 ASYNCMETAL_CACHE_DIR=/tmp/amcache
python3 -c "from asyncmetal import _native; _native.runtime(); print('ext', _native.extension() is not None, _native.extension_error)"
timeout 150 python3 -m pytest tests/backends/cuda/test_cuda.py -q -x -p no:cacheprovider --timeout 60 2>&1 | tail -5
timeout 60 python3 benchmarks/signal_latency.py --parks-ms 1 10 100 1000 --json $OUT/signal.json 2>&1 | tail -9
timeout 100 python3 benchmarks/loop_lag.py --tasks 1 --queues 1 --kernel-us 200 1000 10000 --json $OUT/lag_n1.json 2>&1 | grep -v "^\[" | tail -30
for cfg in "32 64" "16 32" "8 16"; do timeout 60 python3 diag/sweep_lag.py $cfg --tasks 64 1024 --kernel-us 10 --queues 1 4 --peers 2>&1 | grep -v "^\[" | tail -14; done
timeout 80 python3 diag/interop_diag.py 2>&1 | tail -12

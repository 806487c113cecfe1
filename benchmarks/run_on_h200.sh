#!/usr/bin/env bash
# What runs on the GPU machine (device tool), from the repository root:
#   bash benchmarks/run_on_h200.sh     (with the test wheels carried in .whl/)
# Writes the test log and the benchmark JSON under $OUT.
# RUN_PEERS=0 skips cuda_peers + the probe, RUN_SIGNAL=0 the host-signal latency (~1 min),
# RUN_INTEROP=0 the PyTorch interop benchmark, RUN_TESTS=0 the tests (RUN_TESTS_ONE_GPU=1 adds
# them with one GPU visible; RUN_ELSEWHERE=0 leaves out the cuda-marked tests outside
# tests/backends/cuda and tests/native, ~3 min, for a second command: the first part takes
# ~8 min on one H100). RUN_LOOP_LAG=1 adds the loop-lag grid (~9 min in all: run it
# with RUN_PEERS=0 RUN_SIGNAL=0 RUN_TESTS=0 RUN_INTEROP=0, in two commands split by
# LOOP_LAG_ARGS, e.g. "--tasks 1 64" then "--tasks 1024", to stay within one command's 10 min).
# RUN_LOOP_PROFILE=1 adds the loop thread's profile (cProfile) in the cells of 64 tasks of 10 us
# kernels on 1 and 4 queues, beside the CuPy poller (~30 s; .pstats files under $OUT/profiles).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 ASYNCMETAL_CACHE_DIR=/tmp/amcache
nvidia-smi -L | tee "$OUT/gpus.txt"
python3 -c "import cuda.bindings, cupy, torch, numpy, anyio; print('cuda-bindings', cuda.bindings.__version__, 'cupy', cupy.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpus.txt"
{ date -u; uname -m; } >> "$OUT/gpus.txt"
python3 -c "from asyncmetal import _native; _native.runtime(); print('native extension module:', _native.extension() is not None, _native.extension_error or '')" | tee -a "$OUT/gpus.txt"
if [ "${RUN_PEERS:-1}" = 1 ]; then
    timeout 320 python3 benchmarks/cuda_peers.py --json "$OUT/cuda_peers.json" 2>&1 | tee "$OUT/bench.txt"
    (cd benchmarks && timeout 60 python3 cuda_submit_probe.py --json "$OUT/cuda_submit_probe.json") 2>&1 | tee "$OUT/probe.txt"
fi
[ "${RUN_SIGNAL:-1}" = 1 ] && timeout 150 python3 benchmarks/signal_latency.py --json "$OUT/signal_latency.json" 2>&1 | tee "$OUT/signal_latency.txt"
[ "${RUN_LOOP_LAG:-0}" = 1 ] && timeout 540 python3 benchmarks/loop_lag.py ${LOOP_LAG_ARGS:-} --json "$OUT/loop_lag.json" 2>&1 | tee "$OUT/loop_lag.txt"
[ "${RUN_LOOP_PROFILE:-0}" = 1 ] && timeout 120 python3 benchmarks/loop_lag.py --tasks 64 --kernel-us 10 \
    --queues 1 4 --peers cupy_poll --profile "$OUT/profiles" --json "$OUT/loop_lag_profile.json" 2>&1 | tee "$OUT/loop_lag_profile.txt"
[ "${RUN_INTEROP:-1}" = 1 ] && timeout 120 python3 benchmarks/interop.py --json "$OUT/interop.json" 2>&1 | tee "$OUT/interop.txt"
GPU_TESTS=(tests/backends/cuda tests/native tests/contracts/test_contract7_compile_pool.py
    tests/api/test_interop_service.py --ignore=tests/native/test_wheel.py -m "cuda or not cuda"
    -q -p no:cacheprovider -rs --timeout 60 -o faulthandler_timeout=120)
[ "${RUN_TESTS:-1}" = 1 ] && timeout 540 python3 -m pytest "${GPU_TESTS[@]}" 2>&1 | tee "$OUT/cuda_tests.txt"
# The tests marked cuda in the other folders (reliability, contracts, api)
[ "${RUN_ELSEWHERE:-${RUN_TESTS:-1}}" = 1 ] && timeout 300 python3 -m pytest tests -m cuda --ignore=tests/backends/cuda \
    --ignore=tests/native -q -p no:cacheprovider -rs --timeout 60 2>&1 | tee "$OUT/cuda_tests_elsewhere.txt"
# RUN_TESTS_ONE_GPU=1: the same tests again with one GPU visible (on a machine with two)
[ "${RUN_TESTS_ONE_GPU:-0}" = 1 ] && CUDA_VISIBLE_DEVICES=0 timeout 420 python3 -m pytest "${GPU_TESTS[@]}" 2>&1 | tee "$OUT/cuda_tests_one_gpu.txt"

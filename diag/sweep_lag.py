"""GPU diagnostic (not for main): loop_lag's saturated cells under other CROWD / WAKE_SLICE."""
import sys, runpy
from asyncmetal import _bridge, _timeline
slice_, crowd = int(sys.argv[1]), int(sys.argv[2])
_bridge.WAKE_SLICE, _timeline.CROWD = slice_, crowd
print(f"=== WAKE_SLICE {slice_} CROWD {crowd}", flush=True)
sys.argv = ["loop_lag.py"] + sys.argv[3:]
sys.path.insert(0, "benchmarks")
runpy.run_path("benchmarks/loop_lag.py", run_name="__main__")

"""Diagnostic: where a device -> device copy's time goes (not a benchmark; no competitor).

    PYTHONPATH=. python benchmarks/diagnostics/d2d_parts.py     (OUT=dir for d2d.json)

Per copy of 4 KiB and of 1 GiB on the default queue: Python before the backend's copy
hook, the hook (native call), Python after it, the wait until the host timeline is
confirmed, and an awaited ``am.copy``. Ran as run 34 at 0d72042 and run 35 at 0192eed
(benchmarks/results/h200/d2d_diag-run3*.json), with the submit-and-confirm loop inline
(now ``_common.copy_timestamps_ns``).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, "benchmarks")
import numpy as np
from _common import copy_timestamps_ns

import asyncmetal as am
from asyncmetal.backends import cuda as cb


async def main():
    out = {}
    async with am.open_device("cuda:0") as dev:
        for n in (4096, 1 << 30):
            a, b = await dev.alloc(n), await dev.alloc(n)
            await a.write(np.zeros(n, np.uint8))
            marks = []
            orig = cb.CUDAQueue.copy

            def wrapped(self, *args, orig=orig, marks=marks, **kw):
                t = time.perf_counter_ns()
                orig(self, *args, **kw)
                marks.append((t, time.perf_counter_ns()))

            cb.CUDAQueue.copy = wrapped
            rows = {k: [] for k in ("py_before", "native_copy", "py_after", "wait", "await_total")}
            for _ in range(12):
                t0, t1, t2 = await copy_timestamps_ns(dev.queue, b, a)
                ci, co = marks[-1]
                rows["py_before"].append(ci - t0)
                rows["native_copy"].append(co - ci)
                rows["py_after"].append(t1 - co)
                rows["wait"].append(t2 - t1)
                t0 = time.perf_counter_ns()
                await am.copy(b, a)
                rows["await_total"].append(time.perf_counter_ns() - t0)
            cb.CUDAQueue.copy = orig
            out[n] = {k: statistics.median(v) / 1e3 for k, v in rows.items()}
            out[f"{n}_min"] = {k: min(v) / 1e3 for k, v in rows.items()}
            print(n, out[n], flush=True)
            await a.free()
            await b.free()
        print("stats", dev.queue._native.stats())
    return out


result = asyncio.run(main())
with open(os.environ.get("OUT", "/tmp") + "/d2d.json", "w") as f:
    json.dump(result, f, indent=1)

"""Diagnostic: pageable 1 GiB host -> H200 copies on the default queue and two fresh
queues, alternated with raw pinned copies over six rounds (is one queue slower?).

    PYTHONPATH=. python benchmarks/diagnostics/h2d_queues_alternated.py  (OUT=dir)

Ran as run 44 at 5b7fdac and as run 57 at ef52359, chunks split among the threads
(benchmarks/results/h200/h2d_queues_alternated-run{44,57}.json).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import time

import numpy as np

import asyncmetal as am
from asyncmetal.backends.cuda import check, cu


async def main():
    n = 1 << 30
    host = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    out = {"raw": [], "default": [], "fresh": [], "fresh2": []}
    async with am.open_device("cuda:0") as dev:
        a, b = await dev.alloc(n), await dev.alloc(n)
        dev._backend.make_current()
        stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "s")
        pinned = int(check(cu.cuMemHostAlloc(n, 0), "h"))
        ctypes.memmove(pinned, host.ctypes.data, n)
        fresh, fresh2 = dev.new_queue(), dev.new_queue()
        for rnd in range(6):
            t0 = time.perf_counter()
            check(cu.cuMemcpyHtoDAsync(a._allocation.handle, pinned, n, stream), "h2d")
            check(cu.cuStreamSynchronize(stream), "sync")
            out["raw"].append(n / (time.perf_counter() - t0) / 1e9)
            order = [("default", dev.queue), ("fresh", fresh), ("fresh2", fresh2)]
            if rnd % 2:
                order.reverse()
            for name, q in order:
                t0 = time.perf_counter()
                await q.copy(b, host)
                out[name].append(n / (time.perf_counter() - t0) / 1e9)
            print(rnd, {k: round(v[-1], 1) for k, v in out.items()}, flush=True)
        out["stats"] = {"default": dev.queue._native.stats(), "fresh": fresh._native.stats()}
        check(cu.cuMemFreeHost(pinned), "f")
    return out


result = asyncio.run(main())
with open(os.environ.get("OUT", "/tmp") + "/h2d2.json", "w") as f:
    json.dump(result, f, indent=1)

"""Diagnostic: staging's host copies, a chunk split among all host-copy threads against a
whole chunk per thread (round robin, as through session 4 and run 52).

    PYTHONPATH=. python benchmarks/diagnostics/h2d_split_parts.py  (OUT=dir for split_parts.json)

With a chunk per thread, the first chunk a copy's DMA needs is ready only when one
thread alone has copied all of it, while the other threads copy later chunks; split,
every chunk is ready about as soon as all threads together can copy it. The whole-chunk
variant is the library's own ``_HostCopier.copy`` with one part on the next thread,
patched in. Per round (order alternating): raw pinned cuMemcpyHtoDAsync of 1 GiB three
times, then per variant a fresh queue, three 1 GiB pageable copies in and three out.

Ran as run 55 (results/h200/h2d_split_parts-run55.json).
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import json
import os
import statistics
import sys
from typing import Any

import numpy as np

sys.path.insert(0, "benchmarks")
from _common import gbps_best_median, pageable_gib, raw_h2d_seconds, staged_round_trip
from cuda.bindings import driver as cu

import asyncmetal as am
from asyncmetal.backends import cuda as cb

SPLIT = cb._HostCopier.copy
_next = itertools.count()


def whole_chunks(
    self: Any, dst: int, src: int, nbytes: int, keep: object, chunk: Any, after: Any
) -> Any:
    if chunk.ready is None:
        chunk.ready = cb.CUDATimeline(self._backend)
    chunk.generation = generation = chunk.generation + 1
    chunk.parts += 1
    i = next(_next) % len(self.queues)
    self.submitted[i] += 1
    self.queues[i].copy_part(
        dst,
        src,
        nbytes,
        self.submitted[i],
        keep,
        (0, 0) if after is None else (after[0].c_timeline, after[1]),
        (chunk.count_address, chunk.parts),
        (chunk.ready.address, generation),
    )
    return chunk.ready, generation


VARIANTS = {"split": SPLIT, "whole_chunks": whole_chunks}


async def main() -> dict[str, Any]:
    n, host = pageable_gib()
    back = np.zeros_like(host)
    h2d: dict[str, list[float]] = {k: [] for k in VARIANTS}
    d2h: dict[str, list[float]] = {k: [] for k in VARIANTS}
    raw: list[float] = []
    correct = True
    async with am.open_device("cuda:0") as dev:
        a, b = await dev.alloc(n), await dev.alloc(n)
        pinned = int(cb.check(cu.cuMemHostAlloc(n, 0), "cuMemHostAlloc"))
        ctypes.memmove(pinned, host.ctypes.data, n)
        stream = dev.queue._native.stream  # type: ignore[attr-defined]
        for rnd in range(4):
            raw += raw_h2d_seconds(a._allocation.handle, pinned, n, stream, 3)
            names = list(VARIANTS) if rnd % 2 == 0 else list(reversed(VARIANTS))
            for name in names:
                cb._HostCopier.copy = VARIANTS[name]  # type: ignore[method-assign]
                q, ok = await staged_round_trip(dev, b, host, back, h2d[name], d2h[name])
                correct = correct and ok
                q._native.close()  # type: ignore[attr-defined]
                print(
                    rnd,
                    name,
                    "raw",
                    round(n / min(raw[-3:]) / 1e9, 1),
                    "h2d",
                    round(n / min(h2d[name][-3:]) / 1e9, 1),
                    "d2h",
                    round(n / min(d2h[name][-3:]) / 1e9, 1),
                    flush=True,
                )
        cb._HostCopier.copy = SPLIT  # type: ignore[method-assign]
        cu.cuMemFreeHost(pinned)

    return {
        "raw_pinned_gbps_best": n / min(raw) / 1e9,
        "raw_pinned_gbps_median": n / statistics.median(raw) / 1e9,
        **gbps_best_median(n, h2d=h2d, d2h=d2h),
        "correct": correct,
    }


result = asyncio.run(main())
print(json.dumps(result, indent=1))
with open(os.environ.get("OUT", "/tmp") + "/split_parts.json", "w") as f:
    json.dump(result, f, indent=1)

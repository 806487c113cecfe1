"""Diagnostic: staging's host copies, a chunk's parts taken one at a time by whichever
host-copy thread is free (the library's way since this diagnostic) against a fixed share
per thread (as in runs 55-59); and pooled chunks against chunks made new for the queue.

    PYTHONPATH=. python benchmarks/diagnostics/h2d_shared_parts.py  (OUT=dir for shared_parts.json)

Pageable 1 GiB H2D copies took one of two speeds from run to run and copy to copy
(about 33 or 44 GB/s, runs 53-59). With a fixed share per thread a chunk is ready only
when its slowest thread is done: one descheduled or slow-to-wake thread holds every
chunk back. A fresh queue with fresh chunks also started slowly (run 60: 15-24, then
28-46, then 36-48 GB/s). Variants, each on its own pool of chunks:

* ``fixed``: a fixed share of each chunk per thread (emulated on the C command: each
  thread's share is one part on a claim counter of its own);
* ``shared_256k`` (the library's default) and ``shared_64k``: parts of that size taken
  from one claim counter per chunk;
* ``shared_256k_new_chunks``: the same, its chunks freed and made again every round.

Per round (order rotating): raw pinned cuMemcpyHtoDAsync of 1 GiB three times, then per
variant a fresh queue, a 64 MiB copy, five 1 GiB pageable copies in and three out
(every byte checked). Round 0 makes every pool's chunks and is left out of the medians.

Ran as run 61 at 339dd86 on two H200s (results/h200/h2d_shared_parts-run61-x2.json).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import statistics
import sys
from typing import Any

import numpy as np

sys.path.insert(0, "benchmarks")
from _common import pageable_gib, raw_h2d_seconds, seconds_each
from cuda.bindings import driver as cu

import asyncmetal as am
from asyncmetal.backends import cuda as cb

SHARED = cb._HostCopier.copy


def fixed_shares(
    self: Any, dst: int, src: int, nbytes: int, keep: object, chunk: Any, after: Any
) -> Any:
    if chunk.ready is None:
        chunk.ready = cb.CUDATimeline(self._backend)
    if not hasattr(chunk, "own_claims"):  # per thread: its claim word, its next number
        chunk.own_claims, chunk.own_firsts = (ctypes.c_uint64 * 64)(), [0] * 64
    chunk.generation = generation = chunk.generation + 1
    size = -(-nbytes // max(1, min(len(self.queues), nbytes // (256 << 10))))
    size = -(-size // 4096) * 4096
    parts = -(-nbytes // size)
    chunk.parts += parts
    waits = (0, 0) if after is None else (after[0].c_timeline, after[1])
    for i in range(parts):
        offset = i * size
        claim = ctypes.addressof(chunk.own_claims) + 8 * i
        n = min(size, nbytes - offset)
        self.submitted[i] += 1
        self.queues[i].copy_part(
            dst + offset,
            src + offset,
            n,
            n,
            self.submitted[i],
            keep,
            waits,
            (claim, chunk.own_firsts[i]),
            (chunk.count_address, chunk.parts),
            (chunk.ready.address, generation),
        )
        chunk.own_firsts[i] += 1
    return chunk.ready, generation


VARIANTS: dict[str, tuple[Any, int, bool]] = {  # copy, part size, new chunks every round
    "fixed": (fixed_shares, 256 << 10, False),
    "shared_256k": (SHARED, 256 << 10, False),
    "shared_64k": (SHARED, 64 << 10, False),
    "shared_256k_new_chunks": (SHARED, 256 << 10, True),
}


async def main() -> dict[str, Any]:
    n, host = pageable_gib()
    back = np.zeros_like(host)
    h2d: dict[str, list[list[float]]] = {k: [] for k in VARIANTS}
    d2h: dict[str, list[list[float]]] = {k: [] for k in VARIANTS}
    raw: list[float] = []
    correct = True
    async with am.open_device("cuda:0") as dev:
        backend = dev._backend
        pools: dict[str, list[Any]] = {k: [] for k in VARIANTS}
        a, b = await dev.alloc(n), await dev.alloc(n)
        pinned = int(cb.check(cu.cuMemHostAlloc(n, 0), "cuMemHostAlloc"))
        ctypes.memmove(pinned, host.ctypes.data, n)
        stream = dev.queue._native.stream  # type: ignore[attr-defined]
        names = list(VARIANTS)
        for rnd in range(5):
            raw += raw_h2d_seconds(a._allocation.handle, pinned, n, stream, 3)
            for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                copy, part, new_chunks = VARIANTS[name]
                cb._HostCopier.copy = copy  # type: ignore[method-assign]
                cb.STAGE_PART = part
                if new_chunks:
                    for chunk in pools[name]:
                        chunk.free()
                    pools[name].clear()
                backend._chunks = pools[name]  # the queue takes and gives back these
                q = dev.new_queue()
                await q.copy(b, host[: 64 << 20], 64 << 20)
                h2d[name].append(await seconds_each(lambda q=q: q.copy(b, host), 5))
                d2h[name].append(await seconds_each(lambda q=q: q.copy(back, b), 3))
                correct = correct and bool((back == host).all())
                back[:] = 0
                q._native.close()  # type: ignore[attr-defined]
                print(
                    rnd,
                    name,
                    "h2d",
                    [round(n / t / 1e9, 1) for t in h2d[name][-1]],
                    "d2h",
                    [round(n / t / 1e9, 1) for t in d2h[name][-1]],
                    flush=True,
                )
        cb._HostCopier.copy = SHARED  # type: ignore[method-assign]
        cu.cuMemFreeHost(pinned)

    def gbps(rounds: list[list[float]], pick: Any) -> float:
        return n / pick([t for r in rounds[1:] for t in r]) / 1e9

    return {
        "raw_pinned_gbps_median": n / statistics.median(raw) / 1e9,
        "h2d_gbps_median": {k: gbps(v, statistics.median) for k, v in h2d.items()},
        "h2d_gbps_best": {k: gbps(v, min) for k, v in h2d.items()},
        "d2h_gbps_median": {k: gbps(v, statistics.median) for k, v in d2h.items()},
        "h2d_gbps_by_copy": {k: [[n / t / 1e9 for t in r] for r in v] for k, v in h2d.items()},
        "d2h_gbps_by_copy": {k: [[n / t / 1e9 for t in r] for r in v] for k, v in d2h.items()},
        "raw_gbps": [n / t / 1e9 for t in raw],
        "correct": correct,
    }


result = asyncio.run(main())
print(json.dumps({k: v for k, v in result.items() if "by_copy" not in k}, indent=1))
with open(os.environ.get("OUT", "/tmp") + "/shared_parts.json", "w") as f:
    json.dump(result, f, indent=1)

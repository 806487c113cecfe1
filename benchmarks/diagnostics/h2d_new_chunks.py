"""Diagnostic: why a fresh queue with new pinned chunks copies slowly at first (run 61:
1 GiB pageable H2D at 16-17, then 30-35, then 48 GB/s; pooled chunks 45-49 at once).

    PYTHONPATH=. python benchmarks/diagnostics/h2d_new_chunks.py  (OUT=dir for new_chunks.json)

A queue's ring grows one chunk at a time while its first copies run, each new chunk
made by cuMemHostAlloc on the submitting thread. Does that call wait for work in flight
on the device (so every new chunk drains the pipeline), or are new chunks slow to use?

* cuMemHostAlloc of 8 MiB (and of 128 MiB) alone, and while a 1 GiB copy is in flight
  on a stream (does it return before the copy ends?);
* a fresh queue's five 1 GiB copies with: its chunks made during the copies (pool
  emptied: the library's way for a queue after the first); the same number of chunks
  made beforehand, unused (pool refilled with new chunks); pooled chunks used before.
Three rounds, order rotating.

Ran as run 63 at 5fa792b (results/h200/h2d_new_chunks-run63-x2.json), and as runs
64 and 65 with background spare chunks (reverted; ``made_during_copies`` then meant a
ring waiting for spares) and 68 with registered chunks (h2d_new_chunks-run{64,65,68}*).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, "benchmarks")
from _common import pageable_gib, seconds_each
from cuda.bindings import driver as cu

import asyncmetal as am
from asyncmetal.backends import cuda as cb


def alloc_ms(nbytes: int) -> float:
    t0 = time.perf_counter()
    address = int(cb.check(cu.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc"))
    took = (time.perf_counter() - t0) * 1e3
    cu.cuMemFreeHost(address)
    return took


async def main() -> dict[str, Any]:
    n, host = pageable_gib()
    out: dict[str, Any] = {}
    async with am.open_device("cuda:0") as dev:
        backend = dev._backend
        a, b = await dev.alloc(n), await dev.alloc(n)
        pinned = int(cb.check(cu.cuMemHostAlloc(n, 0), "cuMemHostAlloc"))
        stream = dev.queue._native.stream  # type: ignore[attr-defined]
        backend.make_current()
        out["alloc_8m_idle_ms"] = [alloc_ms(cb.STAGE_CHUNK) for _ in range(5)]
        out["alloc_128m_idle_ms"] = [alloc_ms(16 * cb.STAGE_CHUNK) for _ in range(3)]
        busy = []
        for _ in range(3):
            t0 = time.perf_counter()
            cb.check(cu.cuMemcpyHtoDAsync(a._allocation.handle, pinned, n, stream), "HtoD")
            took = alloc_ms(cb.STAGE_CHUNK)
            returned = (time.perf_counter() - t0) * 1e3
            cb.check(cu.cuStreamSynchronize(stream), "sync")
            busy.append(
                {
                    "alloc_ms": took,
                    "returned_at_ms": returned,
                    "copy_done_at_ms": (time.perf_counter() - t0) * 1e3,
                }
            )
        out["alloc_8m_during_1gib_copy"] = busy
        print(json.dumps(out, indent=1), flush=True)
        pooled: list[Any] = []
        variants = ["made_during_copies", "made_beforehand", "pooled_used"]
        h2d: dict[str, list[list[float]]] = {k: [] for k in variants}
        for rnd in range(4):
            for name in variants[rnd % 3 :] + variants[: rnd % 3]:
                if name == "pooled_used":
                    backend._chunks = pooled
                else:
                    backend._chunks = []
                    if name == "made_beforehand":
                        backend._chunks = [cb._Chunk(cb.STAGE_CHUNK) for _ in range(cb.STAGE_RING)]
                q = dev.new_queue()
                await q.copy(b, host[: 64 << 20], 64 << 20)
                h2d[name].append(await seconds_each(lambda q=q: q.copy(b, host), 5))
                q._native.close()  # type: ignore[attr-defined]
                if name == "pooled_used" or not pooled:
                    pooled = backend._chunks
                print(rnd, name, [round(n / t / 1e9, 1) for t in h2d[name][-1]], flush=True)
        cu.cuMemFreeHost(pinned)
    out["h2d_gbps_by_copy"] = {k: [[n / t / 1e9 for t in r] for r in v] for k, v in h2d.items()}
    out["h2d_gbps_median_rounds_1_3"] = {
        k: n / statistics.median([t for r in v[1:] for t in r]) / 1e9 for k, v in h2d.items()
    }
    return out


result = asyncio.run(main())
print(json.dumps(result["h2d_gbps_median_rounds_1_3"], indent=1))
with open(os.environ.get("OUT", "/tmp") + "/new_chunks.json", "w") as f:
    json.dump(result, f, indent=1)

"""Diagnostic: how staging's host-copy threads learn that the stream is done with a chunk.

    PYTHONPATH=. python benchmarks/diagnostics/h2d_mark_waits.py  (OUT=dir for mark_waits.json)

"events": session 4's staging -- each chunk's mark is a queue command with an event; the
completion thread confirms it and raises the marks timeline, whose condition variable
wakes the host-copy thread. "words": the host-copy threads poll the marks' device word,
which the stream writes behind the chunk's DMA; no event per chunk (the code since this
diagnostic). The "events" variant is rebuilt here from session 4's code, patched in.

1 GiB pageable numpy -> H200 and back, on a fresh queue per variant and round (order
reversed every other round), three copies each; also chunk sizes and ring lengths with
word waits. Best and median GB/s per variant, and the completion thread's statistics.

Ran as run 52 at 88b6e03 (results/h200/h2d_mark_waits-run52-x2.json). Needs that commit
to run as written: it patches ``_HostCopier.wait`` and ``memmove``, gone since chunks are
split among the host-copy threads.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import numpy as np

sys.path.insert(0, "benchmarks")
from _common import gbps_best_median, pageable_gib, staged_round_trip
from cuda.bindings import driver as cu

import asyncmetal as am
from asyncmetal._backend import host_address
from asyncmetal.backends import cuda as cb

NEW = cb.CUDAQueue.copyin, cb.CUDAQueue.copyout, cb._Staging.acquire, cb._HostCopier.wait


def events_acquire(self: Any) -> Any:  # session 4: the marks' host value, confirmed
    ring = self._ring
    if ring and (ring[0][1].value >= ring[0][2] or self._count >= cb.STAGE_RING):
        chunk, timeline, value = ring.popleft()
        return chunk, (timeline, value) if timeline.value < value else None
    self._count += 1
    return self._backend.take_chunk(), None


def events_wait(self: Any, timeline: Any, target: int) -> None:  # a condition variable
    i = (self._next + 1) % len(self.queues)
    self.submitted[i] += 1
    self.queues[i].wait(timeline, target, self.submitted[i], cb.Record(self.submitted[i]))


def events_mark(q: Any, timeline: Any, target: int, reached: int) -> None:
    q._write(timeline, target)
    q._finish(reached, extra=timeline, target=target)


def events_copyin(self: Any, dst: Any, src: Any, value: int, record: Any) -> None:
    self._backend.make_current()
    address = host_address(src)[0]
    base = dst.handle + dst.offset
    staging = self._staging_for()
    for offset in range(0, src.nbytes, cb.STAGE_CHUNK):
        n = min(cb.STAGE_CHUNK, src.nbytes - offset)
        chunk, busy = staging.acquire()
        if busy is not None:
            staging.copier.wait(*busy)
        filled = staging.copier.memmove(chunk.address, address + offset, n, src)
        self._wait_value(*filled)
        cb.check(cu.cuMemcpyHtoDAsync(base + offset, chunk.address, n, self.stream), "HtoD")
        mark = staging.next_mark()
        events_mark(self, *mark, value - 1)
        staging.release_after(chunk, *mark)
    self._finish(value, (dst, src))


def events_copyout(self: Any, dst: Any, src: Any, value: int, record: Any) -> None:
    self._backend.make_current()
    address = host_address(dst)[0]
    base = src.handle + src.offset
    staging = self._staging_for()
    last = None
    for offset in range(0, dst.nbytes, cb.STAGE_CHUNK):
        n = min(cb.STAGE_CHUNK, dst.nbytes - offset)
        chunk, busy = staging.acquire()
        if busy is not None:
            self._wait_value(*busy)
        cb.check(cu.cuMemcpyDtoHAsync(chunk.address, base + offset, n, self.stream), "DtoH")
        mark = staging.next_mark()
        events_mark(self, *mark, value - 1)
        staging.copier.wait(*mark)
        last = staging.copier.memmove(address + offset, chunk.address, n, dst)
        staging.release_after(chunk, *last)
    if last is not None:
        self._wait_value(*last)
    self._finish(value, (dst, src))


OLD = events_copyin, events_copyout, events_acquire, events_wait

# name: (word waits?, chunk bytes, ring length)
VARIANTS = {
    "events": (False, 8 << 20, 16),
    "words": (True, 8 << 20, 16),
    "words_chunk4_ring32": (True, 4 << 20, 32),
    "words_chunk2_ring32": (True, 2 << 20, 32),
    "words_chunk8_ring32": (True, 8 << 20, 32),
}


def use(words: bool, chunk: int, ring: int) -> None:
    (
        cb.CUDAQueue.copyin,
        cb.CUDAQueue.copyout,
        cb._Staging.acquire,
        cb._HostCopier.wait,
    ) = NEW if words else OLD
    cb.STAGE_CHUNK, cb.STAGE_RING = chunk, ring


async def main() -> dict[str, Any]:
    n, host = pageable_gib()
    back = np.empty_like(host)
    h2d: dict[str, list[float]] = {name: [] for name in VARIANTS}
    d2h: dict[str, list[float]] = {name: [] for name in VARIANTS}
    stats: dict[str, Any] = {}
    saved = cb.STAGE_CHUNK, cb.STAGE_RING
    correct = True
    async with am.open_device("cuda:0") as dev:
        b = await dev.alloc(n)
        for rnd in range(2):
            names = list(VARIANTS) if rnd % 2 == 0 else list(reversed(VARIANTS))
            for name in names:
                use(*VARIANTS[name])
                dev._backend._chunks.clear()  # no pooled chunk of another size (leaks them)
                q, ok = await staged_round_trip(dev, b, host, back, h2d[name], d2h[name])
                correct = correct and ok
                stats[f"{name}_round{rnd}"] = q._native.stats()  # type: ignore[attr-defined]
                print(
                    rnd,
                    name,
                    "h2d",
                    round(n / min(h2d[name][-3:]) / 1e9, 1),
                    "d2h",
                    round(n / min(d2h[name][-3:]) / 1e9, 1),
                    flush=True,
                )
        use(True, *saved)

    return {
        **gbps_best_median(n, h2d=h2d, d2h=d2h),
        "completion_stats": stats,
        "correct": correct,
    }


result = asyncio.run(main())
print(json.dumps(result, indent=1))
with open(os.environ.get("OUT", "/tmp") + "/mark_waits.json", "w") as f:
    json.dump(result, f, indent=1)

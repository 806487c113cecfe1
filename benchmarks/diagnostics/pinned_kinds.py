"""Diagnostic: what pinned staging memory costs to make, and how fast it copies, made by
cuMemHostAlloc (the library's way) or as anonymous memory -- 4 KiB pages or transparent
huge pages -- touched and then registered with cuMemHostRegister.

    PYTHONPATH=. python benchmarks/diagnostics/pinned_kinds.py  (OUT=dir for pinned_kinds.json)

cuMemHostAlloc takes ~3.2 ms per 8 MiB chunk on the H200 machine and holds up other
threads' driver calls meanwhile (runs 63-65): a fresh queue's ring costs ~50 ms. Per kind:
the time to make (and touch) 16 chunks of 8 MiB, the time to free them, raw H2D from
them (1 GiB as 128 copies of 8 MiB), and asyncmetal's 1 GiB pageable H2D on a fresh queue
whose 16 chunks are of that kind (five copies; three rounds, order rotating). The kind
``library`` is the library's own ``_Chunk``.

Ran as run 66 (results/h200/pinned_kinds-run66-x2.json), before ``library`` was added,
and as run 68 at 4afd245 (pinned_kinds-run68-x2.json).
"""

from __future__ import annotations

import asyncio
import ctypes
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

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
HUGE = 2 << 20
THP = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15
FLAGS = cu.CU_MEMHOSTREGISTER_PORTABLE | cu.CU_MEMHOSTREGISTER_DEVICEMAP


def anon_huge_kib() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return -1


class Registered:
    """Anonymous memory, 2 MiB aligned, advised, touched, then cuMemHostRegister'ed."""

    def __init__(self, nbytes: int, advice: int) -> None:
        self.span = nbytes + HUGE
        self.base = libc.mmap(None, self.span, 3, 0x22, -1, 0)  # RW, PRIVATE|ANONYMOUS
        self.address = (self.base + HUGE - 1) // HUGE * HUGE
        self.nbytes = nbytes
        libc.madvise(self.address, nbytes, advice)
        ctypes.memset(self.address, 0, nbytes)
        cb.check(cu.cuMemHostRegister(self.address, nbytes, FLAGS), "cuMemHostRegister")

    def free(self) -> None:
        cu.cuMemHostUnregister(self.address)
        libc.munmap(self.base, self.span)


class HostAlloc:
    def __init__(self, nbytes: int) -> None:
        self.address = int(cb.check(cu.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc"))
        self.nbytes = nbytes
        ctypes.memset(self.address, 0, nbytes)

    def free(self) -> None:
        cu.cuMemFreeHost(self.address)


KINDS: dict[str, Any] = {
    "hostalloc": HostAlloc,
    "register_4k": lambda n: Registered(n, MADV_NOHUGEPAGE),
    "register_thp": lambda n: Registered(n, MADV_HUGEPAGE),
    "library": cb._Chunk,  # what staging uses now (since run 66: register_thp, untouched)
}


async def main() -> dict[str, Any]:
    n, host = pageable_gib()
    chunk = cb.STAGE_CHUNK
    out: dict[str, Any] = {"thp": THP}
    async with am.open_device("cuda:0") as dev:
        backend = dev._backend
        buf = await dev.alloc(n)
        stream = dev.queue._native.stream  # type: ignore[attr-defined]
        backend.make_current()
        for name, make in KINDS.items():
            before = anon_huge_kib()
            t0 = time.perf_counter()
            ring = [make(chunk) for _ in range(16)]
            made = time.perf_counter() - t0
            huge = anon_huge_kib() - before
            dma = []
            for _ in range(3):
                t0 = time.perf_counter()
                for i in range(128):
                    cb.check(
                        cu.cuMemcpyHtoDAsync(
                            buf._allocation.handle + i * chunk, ring[i % 16].address, chunk, stream
                        ),
                        "HtoD",
                    )
                cb.check(cu.cuStreamSynchronize(stream), "sync")
                dma.append(n / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            for c in ring:
                c.free()
            out[name] = {
                "make_16_ms": made * 1e3,
                "free_16_ms": (time.perf_counter() - t0) * 1e3,
                "anon_huge_kib": huge,
                "raw_h2d_gbps": dma,
            }
            print(name, out[name], flush=True)
        h2d: dict[str, list[float]] = {k: [] for k in KINDS}
        names = list(KINDS)
        for rnd in range(3):
            for name in names[rnd:] + names[:rnd]:
                chunks = []
                for _ in range(16):
                    c = object.__new__(cb._Chunk)
                    mem = KINDS[name](chunk)
                    c.address, c.nbytes, c.free = mem.address, chunk, mem.free  # type: ignore[method-assign]
                    c.track_uses()
                    chunks.append(c)
                backend._chunks = chunks
                q = dev.new_queue()
                await q.copy(buf, host[: 64 << 20], 64 << 20)
                times = await seconds_each(lambda q=q: q.copy(buf, host), 5)
                h2d[name] += times
                q._native.close()  # type: ignore[attr-defined]
                for c in backend._chunks:
                    c.free()
                backend._chunks = []
                print(rnd, name, [round(n / t / 1e9, 1) for t in times], flush=True)
        out["h2d_gbps_median"] = {k: n / statistics.median(v) / 1e9 for k, v in h2d.items()}
        out["h2d_gbps_by_copy"] = {k: [n / t / 1e9 for t in v] for k, v in h2d.items()}
    return out


result = asyncio.run(main())
print(json.dumps(result["h2d_gbps_median"], indent=1))
with open(os.environ.get("OUT", "/tmp") + "/pinned_kinds.json", "w") as f:
    json.dump(result, f, indent=1)

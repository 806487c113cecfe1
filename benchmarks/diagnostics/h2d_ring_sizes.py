"""Diagnostic: staging's ring size -- does a ring small enough to stay in the host's last-
level cache make pageable copies cheaper in memory traffic, and so faster?

    PYTHONPATH=. python benchmarks/diagnostics/h2d_ring_sizes.py  (OUT=dir for ring_sizes.json)

A staged copy moves each byte through host memory three times (read the pageable source,
write the pinned chunk, DMA reads the chunk) unless the chunk is still in the cache when
the DMA engine reads it. Per round, in alternating order: raw pinned cuMemcpyHtoDAsync of
1 GiB, then asyncmetal's 1 GiB pageable copy on a fresh queue per (chunk, ring), three
each; and the host half alone (host-copy threads into the ring, no DMA). Also what the
host is: CPU model, cache sizes, transparent huge pages, glibc.

Ran as run 53 at 88b6e03 (results/h200/h2d_ring_sizes-run53.json). Needs that commit to
run as written (``_HostCopier.memmove``, gone since chunks are split among the threads).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, "benchmarks")
from _common import raw_h2d_seconds, seconds_each
from cuda.bindings import driver as cu

import asyncmetal as am
from asyncmetal.backends import cuda as cb

MiB = 1 << 20
CONFIGS = {  # name: (chunk bytes, ring length)
    "chunk8_ring16": (8 * MiB, 16),
    "chunk4_ring16": (4 * MiB, 16),
    "chunk2_ring16": (2 * MiB, 16),
    "chunk1_ring16": (1 * MiB, 16),
    "chunk2_ring8": (2 * MiB, 8),
    "chunk4_ring8": (4 * MiB, 8),
    "chunk1_ring32": (1 * MiB, 32),
}


def host_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {"glibc": platform.libc_ver()[1], "cpus": os.cpu_count()}
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith(("model name", "cache size")):
                key, _, val = line.partition(":")
                facts[key.strip()] = val.strip()
    for name in ("index2", "index3"):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/{name}/size") as f:
                facts[f"cache_{name}"] = f.read().strip()
        except OSError:
            pass
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            facts["thp"] = f.read().strip()
    except OSError:
        pass
    return facts


def free_pool(backend: Any) -> None:
    with backend._chunk_lock:
        for chunk in backend._chunks:
            chunk.free()
        backend._chunks.clear()


def host_half(backend: Any, host: np.ndarray, chunk: int, ring_len: int) -> float:
    """GB/s of the host-copy threads alone filling a ring, chunk by chunk."""
    copier = cb._HostCopier(backend, cb.HOST_COPY_THREADS)
    ring = [cb._Pinned(chunk) for _ in range(ring_len)]
    t0 = time.perf_counter()
    ends = {}
    for k, offset in enumerate(range(0, len(host), chunk)):
        n = min(chunk, len(host) - offset)
        dst = ring[k % ring_len].address
        timeline, value = copier.memmove(dst, host.ctypes.data + offset, n, host)
        ends[id(timeline)] = (timeline, value)
    for timeline, value in ends.values():
        while timeline.value < value:
            time.sleep(0.00005)
    took = time.perf_counter() - t0
    copier.close(False)
    for c in ring:
        c.free()
    return len(host) / took / 1e9


async def main() -> dict[str, Any]:
    n = 1 << 30
    host = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    ours: dict[str, list[float]] = {name: [] for name in CONFIGS}
    half: dict[str, list[float]] = {name: [] for name in CONFIGS}
    raw: list[float] = []
    saved = cb.STAGE_CHUNK, cb.STAGE_RING
    async with am.open_device("cuda:0") as dev:
        backend = dev._backend
        a, b = await dev.alloc(n), await dev.alloc(n)
        pinned = int(cb.check(cu.cuMemHostAlloc(n, 0), "cuMemHostAlloc"))
        ctypes.memmove(pinned, host.ctypes.data, n)
        stream = dev.queue._native.stream  # type: ignore[attr-defined]
        for rnd in range(3):
            names = list(CONFIGS) if rnd % 2 == 0 else list(reversed(CONFIGS))
            raw += raw_h2d_seconds(a._allocation.handle, pinned, n, stream, 3)
            for name in names:
                chunk, ring_len = cb.STAGE_CHUNK, cb.STAGE_RING = CONFIGS[name]
                free_pool(backend)
                q = dev.new_queue()
                await q.copy(b, host[: 64 * MiB], 64 * MiB)  # the ring and threads made
                ours[name] += await seconds_each(lambda q=q: q.copy(b, host), 3)
                q._native.close()  # type: ignore[attr-defined]
                half[name].append(host_half(backend, host, chunk, ring_len))
                print(
                    rnd,
                    name,
                    "raw",
                    round(n / min(raw[-3:]) / 1e9, 1),
                    "ours",
                    round(n / min(ours[name][-3:]) / 1e9, 1),
                    "host half",
                    round(half[name][-1], 1),
                    flush=True,
                )
        free_pool(backend)
        cb.STAGE_CHUNK, cb.STAGE_RING = saved
        correct = bool(np.array_equal(await b.read(), host))
        cu.cuMemFreeHost(pinned)
    return {
        "host": host_facts(),
        "raw_pinned_gbps_best": n / min(raw) / 1e9,
        "raw_pinned_gbps_median": n / statistics.median(raw) / 1e9,
        "gbps_best": {k: n / min(v) / 1e9 for k, v in ours.items()},
        "gbps_median": {k: n / statistics.median(v) / 1e9 for k, v in ours.items()},
        "host_half_gbps_best": {k: max(v) for k, v in half.items()},
        "correct": correct,
    }


result = asyncio.run(main())
print(json.dumps(result, indent=1))
with open(os.environ.get("OUT", "/tmp") + "/ring_sizes.json", "w") as f:
    json.dump(result, f, indent=1)

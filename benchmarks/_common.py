"""Helpers the benchmark scripts share (each script runs as ``python benchmarks/x.py``)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio

import asyncmetal as am
from asyncmetal._cache import CompileCache
from asyncmetal._compile import Compiler
from asyncmetal._pool import CompilePool


def pageable_gib() -> tuple[int, Any]:
    """1 GiB of random bytes in a pageable numpy array (the host copies' source)."""
    import numpy as np

    n = 1 << 30
    return n, np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)


def gbps_best_median(nbytes: int, **times: dict[str, list[float]]) -> dict[str, Any]:
    """``<name>_gbps_best`` and ``<name>_gbps_median`` per variant for each named set of
    copy times in seconds (``h2d={"variant": [...]}``), copies of ``nbytes``."""
    out: dict[str, Any] = {}
    for name, per_variant in times.items():
        for pick, how in ((min, "best"), (statistics.median, "median")):
            out[f"{name}_gbps_{how}"] = {k: nbytes / pick(v) / 1e9 for k, v in per_variant.items()}
    return out


def raw_h2d_seconds(dst: int, pinned: int, nbytes: int, stream: Any, n: int) -> list[float]:
    """Seconds of ``n`` raw ``cuMemcpyHtoDAsync`` + ``cuStreamSynchronize`` copies of
    ``nbytes`` from pinned memory (the floor staged copies are measured against)."""
    from asyncmetal.backends.cuda import check, cu

    seconds = []
    for _ in range(n):
        t0 = time.perf_counter()
        check(cu.cuMemcpyHtoDAsync(dst, pinned, nbytes, stream), "cuMemcpyHtoDAsync")
        check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
        seconds.append(time.perf_counter() - t0)
    return seconds


async def staged_round_trip(
    dev: am.Device, buf: am.Buffer, host: Any, back: Any, h2d: list[float], d2h: list[float]
) -> tuple[am.Queue, bool]:
    """On a fresh queue (its staging made first by a 64 MiB copy): three pageable copies of
    ``host`` into ``buf`` and three back into ``back``, their seconds appended to ``h2d``
    and ``d2h``. Returns the queue and whether every byte came back (``back`` is zeroed)."""
    q = dev.new_queue()
    await q.copy(buf, host[: 64 << 20], 64 << 20)
    h2d += await seconds_each(lambda: q.copy(buf, host), 3)
    d2h += await seconds_each(lambda: q.copy(back, buf), 3)
    correct = bool((back == host).all())
    back[:] = 0
    return q, correct


async def median_us(fn: Callable[[], Awaitable[Any]], n: int, warmup: int = 0) -> float:
    """The median time of ``await fn()`` in microseconds, over ``n`` runs."""
    for _ in range(warmup):
        await fn()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        await fn()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1e3


async def seconds_each(fn: Callable[[], Awaitable[Any]], n: int) -> list[float]:
    """The seconds each of ``n`` runs of ``await fn()`` took."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return times


async def copy_timestamps_ns(queue: am.Queue, dst: Any, src: Any) -> tuple[int, int, int]:
    """``perf_counter_ns`` before a copy's submission, after it, and once its queue's host
    timeline is confirmed (read here in a loop, no await); the completion is awaited
    after."""
    native = queue.timeline.native
    t0 = time.perf_counter_ns()
    done = queue.copy(dst, src)
    t1 = time.perf_counter_ns()
    while native.value < done.value:
        pass
    t2 = time.perf_counter_ns()
    await done
    return t0, t1, t2


async def pool_vs_serial(
    compiler: Compiler, serial: Sequence[str], pooled: Sequence[str], workers: int
) -> dict[str, Any]:
    """Compile ``serial`` one by one in this process, then ``pooled`` in a pool of
    ``workers`` whose every worker was started and warmed first."""
    compiler.compile(serial[0] + "\n// warm\n")  # the compiler's libraries loaded here too
    t0 = time.perf_counter()
    for src in serial:
        compiler.compile(src)
    serial_s = time.perf_counter() - t0
    pool = CompilePool(workers, cache=CompileCache(disk=False))
    try:
        pool.prestart()
        for round_ in range(3):  # concurrent warm-ups land on every worker
            async with anyio.create_task_group() as tg:
                for w in range(workers):
                    tg.start_soon(pool.compile, compiler, f"{pooled[w]}\n// warm {round_}\n")
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for src in pooled:
                tg.start_soon(pool.compile, compiler, src)
        pool_s = time.perf_counter() - t0
    finally:
        await pool.aclose()
    return {
        "kernels": len(pooled),
        "workers": workers,
        "serial_s": serial_s,
        "pool_s": pool_s,
        "speedup": serial_s / pool_s,
        "cpus": os.cpu_count(),
    }


async def alloc_round_trip(
    dev: am.Device, nbytes: int, n: int, native: Callable[[], None]
) -> dict[str, Any]:
    """Median cached ``await alloc`` + ``await free`` against ``native()`` (one native
    allocation and release of the same size)."""
    await (await dev.alloc(nbytes)).free()  # one block in the cache

    async def cached() -> None:
        buf = await dev.alloc(nbytes)
        await buf.free()

    async def fresh() -> None:
        native()

    c = await median_us(cached, n)
    f = await median_us(fresh, n)
    return {"bytes": nbytes, "cached_us": c, "native_us": f, "ratio": c / f}


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """Write ``result`` with the date, Python and machine, if a path was given."""
    if not path:
        return
    result["meta"] = {
        "date": time.strftime("%Y-%m-%d"),
        "python": sys.version.split()[0],
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
    }
    with open(path, "w") as f:
        json.dump(result, f, indent=2)

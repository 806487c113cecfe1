"""asyncmetal's cuda device against its peers, in one process and one run.

    python benchmarks/cuda_peers.py --json out.json [--loop asyncio|uvloop|both]

The same empty kernel, awaited five ways: raw driver calls + blocking
``cuStreamSynchronize`` (the floor), CuPy ``launch_host_func`` -> asyncio future, a CuPy
event polled from the loop, a PyTorch ``Event.query()`` polled from the loop, and
asyncmetal (and asyncmetal through ctypes, where its extension module is in use),
measured in alternating rounds. Then: 64 tasks on one stream, CPU time while awaiting
a 100 ms kernel, 1 GiB host -> device copies, device -> device copies and NVRTC
compiles in the pool.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from _common import (
    alloc_round_trip,
    copy_timestamps_ns,
    pool_vs_serial,
    raw_h2d_seconds,
    seconds_each,
    write_json,
)

import asyncmetal as am
from asyncmetal import _native
from asyncmetal.backends.cuda import CUDACompiler, check, cu

EMPTY = 'extern "C" __global__ void empty() {}'
SLEEP = r"""
extern "C" __global__ void sleep_ms(int ms) {
    for (int i = 0; i < ms; i++) __nanosleep(1000000);
}
"""
N_LAT = 3000
TASK_ROUNDS = 3


def progress(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", flush=True)


async def interleaved_medians_us(
    fns: list[Callable[[], Awaitable[Any]]], rounds: int = 10, per_round: int = N_LAT // 10
) -> dict[str, float]:
    """Median of ``await fn()`` for each fn (by name), measured in alternating rounds so
    that a machine's drift over the run hits every competitor alike."""
    progress("latencies: " + ", ".join(fn.__name__ for fn in fns))
    samples: dict[str, list[int]] = {fn.__name__: [] for fn in fns}
    for fn in fns:
        for _ in range(200):
            await fn()
    for _ in range(rounds):
        for fn in fns:
            times = samples[fn.__name__]
            for _ in range(per_round):
                t0 = time.perf_counter_ns()
                await fn()
                times.append(time.perf_counter_ns() - t0)
    return {name: statistics.median(times) / 1e3 for name, times in samples.items()}


async def run(loop_name: str) -> dict[str, Any]:
    import cupy
    import torch

    out: dict[str, Any] = {"loop": loop_name}
    async with am.open_device("cuda:0") as dev:
        empty = await dev.compile(EMPTY, "empty")
        q = dev.new_queue()
        backend = dev._backend
        backend.make_current()
        # -- raw driver: launch + blocking synchronize, and launch-only rate -------------
        stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "stream")
        fn = empty.native

        def raw_sync() -> None:
            check(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, 0, 0), "launch")
            check(cu.cuStreamSynchronize(stream), "sync")

        async def raw() -> None:
            raw_sync()  # blocks the loop: this is the floor, not a way to write async code

        warm_until = time.perf_counter() + 1.0  # see warm_up in the probe
        while time.perf_counter() < warm_until:
            raw_sync()

        def raw_launch_only_rate(n: int = 20000) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                check(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, 0, 0), "launch")
            check(cu.cuStreamSynchronize(stream), "sync")
            return n / (time.perf_counter() - t0)

        # -- CuPy ---------------------------------------------------------------------
        cupy.cuda.Device(0).use()
        ck = cupy.RawKernel(EMPTY, "empty")
        cstream = cupy.cuda.Stream(non_blocking=True)
        loop = asyncio.get_running_loop()

        async def cupy_hostfunc() -> None:
            fut = loop.create_future()
            ck((1,), (1,), (), stream=cstream)
            cstream.launch_host_func(
                lambda _: loop.call_soon_threadsafe(fut.set_result, None), None
            )
            await fut

        async def cupy_poll() -> None:
            ck((1,), (1,), (), stream=cstream)
            ev = cstream.record()
            while not ev.done:
                await asyncio.sleep(0)

        # -- PyTorch --------------------------------------------------------------------
        tstream = torch.cuda.Stream()

        async def torch_poll() -> None:
            with torch.cuda.stream(tstream):
                torch.cuda._sleep(0)
                ev = torch.cuda.Event()
                ev.record(tstream)
            while not ev.query():
                await asyncio.sleep(0)

        # -- asyncmetal ------------------------------------------------------------------
        async def asyncmetal() -> None:
            await q.launch(empty)

        # Where the runtime's extension module is in use (asyncmetal: Queue.launch's
        # common case in C), the same with Queue.launch's Python checks then the
        # backend's extension call, and through ctypes (the launch path a machine
        # without Python's headers takes): a queue each.
        q_python, q_ctypes = dev.new_queue(), dev.new_queue()
        # (Not q._fast_launch: the device lets go of a queue idle a while, which turns
        # its native launch path off until its next launch; _launch_target stays, and
        # is what a queue taken back turns the path on from.)
        out["extension"] = q._launch_target is not None and _native.extension() is not None
        q_python._fast_launch = q_ctypes._fast_launch = None
        q_python._launch_target = q_ctypes._launch_target = None
        q_ctypes._native._fast_launch = None  # type: ignore[attr-defined]

        async def asyncmetal_python_launch() -> None:
            await q_python.launch(empty)

        async def asyncmetal_ctypes() -> None:
            await q_ctypes.launch(empty)

        competitors = [raw, cupy_hostfunc, cupy_poll, torch_poll, asyncmetal]
        if out["extension"]:
            competitors += [asyncmetal_python_launch, asyncmetal_ctypes]
        medians = await interleaved_medians_us(competitors)
        out["raw_sync_us"] = medians["raw"]
        out["cupy_hostfunc_us"] = medians["cupy_hostfunc"]
        out["cupy_event_poll_us"] = medians["cupy_poll"]
        out["torch_event_poll_us"] = medians["torch_poll"]
        out["asyncmetal_us"] = medians["asyncmetal"]
        out["latency_ratio"] = out["asyncmetal_us"] / out["raw_sync_us"]
        if out["extension"]:
            out["asyncmetal_python_launch_us"] = medians["asyncmetal_python_launch"]
            out["asyncmetal_ctypes_us"] = medians["asyncmetal_ctypes"]
            out["latency_ratio_ctypes"] = out["asyncmetal_ctypes_us"] / out["raw_sync_us"]
        raw_parts = (
            lambda: check(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, 0, 0), "launch"),
            lambda: check(cu.cuStreamSynchronize(stream), "sync"),
        )
        out["asyncmetal_parts_us"] = latency_parts(q, empty, raw_parts)
        out["asyncmetal_completion_stats_after_latencies"] = q._native.stats()  # type: ignore[attr-defined]
        if out["extension"]:
            out["asyncmetal_ctypes_parts_us"] = latency_parts(q_ctypes, empty)
        out["asyncmetal_await_parts_us"] = await await_parts(q, empty)

        progress(f"latencies done: {out}")

        # -- 64 tasks awaiting launches on one stream ----------------------------------
        async def worker() -> None:
            for _ in range(300):
                await q.launch(empty)

        async def tasks64() -> float:
            t0 = time.perf_counter()
            async with asyncio.TaskGroup() as tg:
                for _ in range(64):
                    tg.create_task(worker())
            return 64 * 300 / (time.perf_counter() - t0)

        from asyncmetal import _timeline

        raw_rates, rates, no_spin_rates = [], [], []
        before = am.loop_statistics()
        for _ in range(TASK_ROUNDS):  # alternated: drift in the machine hits both alike
            raw_rates.append(raw_launch_only_rate())
            rates.append(await tasks64())
            # Diagnostic: the same without reading the timeline in C between yields.
            slice_ns, _timeline.SLICE_NS = _timeline.SLICE_NS, 0
            no_spin_rates.append(await tasks64())
            _timeline.SLICE_NS = slice_ns
        after = am.loop_statistics()
        out["tasks64_parks_woken_per_completion"] = (after.resolved - before.resolved) / (
            2 * TASK_ROUNDS * 64 * 300
        )
        out["raw_launch_only_per_s"] = statistics.median(raw_rates)
        out["tasks64_per_s"] = statistics.median(rates)
        out["tasks64_no_c_spin_per_s"] = statistics.median(no_spin_rates)
        out["tasks64_rounds"] = {
            "raw_launch_only_per_s": raw_rates,
            "tasks64_per_s": rates,
            "tasks64_no_c_spin_per_s": no_spin_rates,
        }
        out["tasks64_fraction_of_raw"] = out["tasks64_per_s"] / out["raw_launch_only_per_s"]
        out["asyncmetal_completion_stats_after_tasks64"] = q._native.stats()  # type: ignore[attr-defined]

        progress("64 tasks done")
        # -- CPU while awaiting a 100 ms kernel ---------------------------------------
        sleeper = await dev.compile(SLEEP, "sleep_ms")
        await q.launch(sleeper, vals=(1,))
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await q.launch(sleeper, vals=(100,))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        out["wait_100ms"] = {"wall_s": wall, "cpu_s": cpu, "cpu_fraction": cpu / wall}

        # -- copies and the allocator ----------------------------------------------------
        if loop_name == "asyncio":
            out["copies"] = await copies(dev, stream)
            out["alloc"] = await allocations(dev)
        check(cu.cuStreamDestroy(stream), "destroy")
    return out


async def await_parts(q: am.Queue, empty: am.Program, n: int = 2000) -> dict[str, float]:
    """Where an awaited launch's time goes on the loop. Per launch, from its start: the
    submission returned; the loop came back after one yield (what ``await`` does
    first); the host timeline was seen reached (read in C, as ``await`` does next);
    then the cost of awaiting the finished Completion (a yield and its checks). Also a
    bare yield, and plain awaited launches alternated with the stepped ones."""
    from asyncmetal import _bridge, _native

    native = q.timeline.native
    c_timeline, spin = native.c_timeline, _native.spin
    assert spin is not None
    rows: dict[str, list[int]] = {
        k: [] for k in ("submit", "yielded", "seen", "await_done", "awaited", "bare_yield")
    }
    for _ in range(n):
        t0 = time.perf_counter_ns()
        done = q.launch(empty)
        t1 = time.perf_counter_ns()
        await _bridge.checkpoint()
        t2 = time.perf_counter_ns()
        while not spin(c_timeline, done.value, 5000):
            pass
        t3 = time.perf_counter_ns()
        await done
        t4 = time.perf_counter_ns()
        await _bridge.checkpoint()
        t5 = time.perf_counter_ns()
        await q.launch(empty)
        t6 = time.perf_counter_ns()
        rows["submit"].append(t1 - t0)
        rows["yielded"].append(t2 - t0)
        rows["seen"].append(t3 - t0)
        rows["await_done"].append(t4 - t3)
        rows["bare_yield"].append(t5 - t4)
        rows["awaited"].append(t6 - t5)
    return {k: statistics.median(v) / 1e3 for k, v in rows.items()}


def latency_parts(
    q: am.Queue,
    empty: am.Program,
    raw: tuple[Callable[[], Any], Callable[[], Any]] | None = None,
    n: int = 2000,
) -> dict[str, float]:
    """Where an awaited launch's time goes, without the loop: the submission call, then
    (spinning here) until the host timeline reports the command confirmed. With ``raw``
    (launch, synchronize): the floor's launch alone, on an idle stream, and its wait."""
    native = q.timeline.native
    submit, verified = [], []
    raw_launch, raw_wait = [], []
    for _ in range(n if raw else 0):
        t0 = time.perf_counter_ns()
        raw[0]()  # type: ignore[index]
        t1 = time.perf_counter_ns()
        raw[1]()  # type: ignore[index]
        raw_wait.append(time.perf_counter_ns() - t1)
        raw_launch.append(t1 - t0)
    for _ in range(n):
        t0 = time.perf_counter_ns()
        done = q.launch(empty)
        t1 = time.perf_counter_ns()
        while native.value < done.value:
            pass
        t2 = time.perf_counter_ns()
        submit.append(t1 - t0)
        verified.append(t2 - t0)
    t0 = time.perf_counter_ns()
    for _ in range(n):
        done = q.launch(empty)
    submit_only = (time.perf_counter_ns() - t0) / n
    while native.value < done.value:
        pass
    med = statistics.median
    parts = {
        "submit_back_to_back": submit_only / 1e3,
        "submit": med(submit) / 1e3,
        "verified": med(verified) / 1e3,
    }
    if raw:
        parts["raw_launch"] = med(raw_launch) / 1e3
        parts["raw_synchronize"] = med(raw_wait) / 1e3
    return parts


async def copies(dev: am.Device, stream: Any) -> dict[str, Any]:
    n = 1 << 30
    host = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    a, b = await dev.alloc(n), await dev.alloc(n)
    pinned = int(check(cu.cuMemHostAlloc(n, 0), "cuMemHostAlloc"))
    ctypes.memmove(pinned, host.ctypes.data, n)
    result: dict[str, Any] = {}
    raw, ours = [], []
    for _ in range(5):
        raw += raw_h2d_seconds(a._allocation.handle, pinned, n, stream, 1)
        t0 = time.perf_counter()
        await b.write(host)  # pageable numpy, staged by asyncmetal
        ours.append(time.perf_counter() - t0)
    result["h2d_raw_pinned_gbps"] = n / min(raw) / 1e9
    result["h2d_asyncmetal_pageable_gbps"] = n / min(ours) / 1e9
    result["h2d_ratio"] = result["h2d_asyncmetal_pageable_gbps"] / result["h2d_raw_pinned_gbps"]
    # Every copy, in the order they ran (raw, ours, raw, ...): how much the host varied.
    result["h2d_pairs_gbps"] = [(n / r / 1e9, n / o / 1e9) for r, o in zip(raw, ours, strict=True)]
    result["h2d_ratio_median_of_pairs"] = statistics.median(
        r / o for r, o in zip(raw, ours, strict=True)
    )
    progress(f"h2d: {result}")
    # Context: the driver's own pageable copy, host memcpy into pinned memory by N
    # threads (the staging bound), and asyncmetal with N host-copy threads per queue.
    t0 = time.perf_counter()
    check(cu.cuMemcpyHtoDAsync(a._allocation.handle, host.ctypes.data, n, stream), "HtoD")
    check(cu.cuStreamSynchronize(stream), "sync")
    result["h2d_driver_pageable_gbps"] = n / (time.perf_counter() - t0) / 1e9
    pinned_view = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(pinned))
    for threads in (1, 4, 8, 12):
        result[f"host_memcpy_{threads}_threads_gbps"] = memcpy_threads(pinned_view, host, threads)
    from asyncmetal.backends.cuda import _staging as cuda_staging

    default_threads = cuda_staging.HOST_COPY_THREADS
    for threads in (4, 8, 12):
        cuda_staging.HOST_COPY_THREADS = threads  # read when a queue first stages
        q = dev.new_queue()
        times = await seconds_each(lambda q=q: q.copy(b, host), 3)
        result[f"h2d_asyncmetal_{threads}_threads_gbps"] = n / min(times) / 1e9
    cuda_staging.HOST_COPY_THREADS = default_threads
    # The host half alone: asyncmetal's host-copy threads filling a ring of 16 pinned
    # chunks from the pageable array.
    for threads in (8, 12, 16):
        best = max(host_staging(dev, host, threads) for _ in range(2))
        result[f"host_stage_{threads}_threads_gbps"] = best
    progress(f"h2d context: {result}")
    back = np.empty_like(host)
    t0 = time.perf_counter()
    await am.copy(back, b)
    # The first copy into a new array also pays its page faults: then two more into it.
    result["d2h_asyncmetal_pageable_new_array_gbps"] = n / (time.perf_counter() - t0) / 1e9
    times = await seconds_each(lambda: am.copy(back, b), 2)
    result["d2h_asyncmetal_pageable_gbps"] = n / min(times) / 1e9
    result["round_trip_correct"] = bool(np.array_equal(back, host))
    raw, ours = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        check(cu.cuMemcpyDtoDAsync(b._allocation.handle, a._allocation.handle, n, stream), "DtoD")
        check(cu.cuStreamSynchronize(stream), "sync")
        raw.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await am.copy(b, a)
        ours.append(time.perf_counter() - t0)
    # Where the time goes: the submission call, and the wait after it (raw: the
    # synchronize; asyncmetal: until the host timeline is confirmed, read here).
    parts: dict[str, list[int]] = {k: [] for k in ("raw_submit", "raw_wait", "submit", "wait")}
    for _ in range(5):
        t0 = time.perf_counter_ns()
        check(cu.cuMemcpyDtoDAsync(b._allocation.handle, a._allocation.handle, n, stream), "DtoD")
        t1 = time.perf_counter_ns()
        check(cu.cuStreamSynchronize(stream), "sync")
        parts["raw_submit"].append(t1 - t0)
        parts["raw_wait"].append(time.perf_counter_ns() - t1)
        t0, t1, t2 = await copy_timestamps_ns(dev.queue, b, a)
        parts["submit"].append(t1 - t0)
        parts["wait"].append(t2 - t1)
    result["d2d_parts_us"] = {k: statistics.median(v) / 1e3 for k, v in parts.items()}
    # Diagnostic: the device's default queue (which staged the pageable copies above)
    # against a fresh queue, alternated with the raw copy.
    result["d2d_default_queue_stats"] = dev.queue._native.stats()  # type: ignore[attr-defined]
    fresh = dev.new_queue()
    raw_d, default_d, fresh_d = [], [], []
    for _ in range(5):
        t0 = time.perf_counter()
        check(cu.cuMemcpyDtoDAsync(b._allocation.handle, a._allocation.handle, n, stream), "DtoD")
        check(cu.cuStreamSynchronize(stream), "sync")
        t1 = time.perf_counter()
        await dev.queue.copy(b, a)
        t2 = time.perf_counter()
        await fresh.copy(b, a)
        raw_d.append(t1 - t0)
        default_d.append(t2 - t1)
        fresh_d.append(time.perf_counter() - t2)
    result["d2d_default_queue_ratio"] = min(raw_d) / min(default_d)
    result["d2d_fresh_queue_ratio"] = min(raw_d) / min(fresh_d)
    result["d2d_raw_tbps"] = 2 * n / min(raw) / 1e12  # bytes read + written
    result["d2d_asyncmetal_tbps"] = 2 * n / min(ours) / 1e12
    result["d2d_ratio"] = result["d2d_asyncmetal_tbps"] / result["d2d_raw_tbps"]
    t0 = time.perf_counter()
    done = dev.queue.copy(b, a)
    result["d2d_submit_us"] = (time.perf_counter() - t0) * 1e6
    await done
    check(cu.cuMemFreeHost(pinned), "free")
    await a.free()
    await b.free()
    return result


def host_staging(dev: am.Device, host: np.ndarray, threads: int) -> float:
    """GB/s of the staging path's host copies alone (no DMA): ``threads`` host-copy
    threads copying ``host`` chunk by chunk (each split among them) into a ring of 16
    pinned chunks."""
    from asyncmetal.backends.cuda._staging import STAGE_CHUNK, _HostCopier

    backend = dev._backend
    copier = _HostCopier(backend, threads)  # type: ignore[arg-type]
    ring = [backend.take_chunk() for _ in range(16)]  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    for k, offset in enumerate(range(0, len(host), STAGE_CHUNK)):
        n = min(STAGE_CHUNK, len(host) - offset)
        copier.copy(ring[k % 16].address, host.ctypes.data + offset, n, host, ring[k % 16], None)
    for q, value in zip(copier.queues, copier.submitted, strict=True):
        while q._timeline.value < value:
            time.sleep(0.00005)
    took = time.perf_counter() - t0
    copier.close(False)
    for chunk in ring:
        backend.give_chunk(chunk)  # type: ignore[attr-defined]
    return len(host) / took / 1e9


def memcpy_threads(dst: np.ndarray, src: np.ndarray, threads: int) -> float:
    """GB/s of numpy copies (which release the GIL) from ``src`` into ``dst`` by
    ``threads`` threads, each a contiguous share."""
    import concurrent.futures

    share = -(-len(src) // threads)
    parts = [(dst[i : i + share], src[i : i + share]) for i in range(0, len(src), share)]
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            list(pool.map(lambda p: np.copyto(p[0], p[1]), parts))
            best = min(best, time.perf_counter() - t0)
    return len(src) / best / 1e9


async def allocations(dev: am.Device, nbytes: int = 1 << 20, n: int = 2000) -> dict[str, Any]:
    """Cached await alloc + await free against cuMemAlloc + cuMemFree of 1 MiB; and, for
    the choice of allocator, the stream-ordered pool (cuMemAllocAsync + cuMemFreeAsync)
    and what a plain cuMemFree costs while a 5 ms kernel runs (it synchronizes)."""

    def native() -> None:
        check(cu.cuMemFree(check(cu.cuMemAlloc(nbytes), "cuMemAlloc")), "cuMemFree")

    result = await alloc_round_trip(dev, nbytes, n, native)
    stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "stream")
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        pointer = check(cu.cuMemAllocAsync(nbytes, stream), "cuMemAllocAsync")
        check(cu.cuMemFreeAsync(pointer, stream), "cuMemFreeAsync")
        times.append(time.perf_counter_ns() - t0)
    check(cu.cuStreamSynchronize(stream), "sync")
    result["stream_ordered_pool_us"] = statistics.median(times) / 1e3
    sleeper = await dev.compile(SLEEP, "sleep_ms")
    pointer = check(cu.cuMemAlloc(nbytes), "cuMemAlloc")
    done = dev.queue.launch(sleeper, vals=(5,))
    t0 = time.perf_counter_ns()
    check(cu.cuMemFree(pointer), "cuMemFree")
    result["cuMemFree_during_5ms_kernel_us"] = (time.perf_counter_ns() - t0) / 1e3
    await done
    check(cu.cuStreamDestroy(stream), "destroy")
    return result


async def compiles(workers: int, n: int = 64) -> dict[str, Any]:
    tag = time.time_ns()

    def src(i: int, label: str) -> str:
        return (
            f'extern "C" __global__ void k{i}(float* x, int n) {{ int j = blockIdx.x * '
            f"blockDim.x + threadIdx.x; if (j < n) x[j] = x[j] * {i}.5f + sinf(x[j]); }}"
            f"\n// {label} {tag}\n"
        )

    serial = [src(i, "serial") for i in range(n)]
    pooled = [src(i, "pool") for i in range(n)]
    return await pool_vs_serial(CUDACompiler("sm_90"), serial, pooled, workers)


async def peer_copy(n: int = 1 << 30, rounds: int = 5) -> dict[str, Any]:
    """1 GiB cuda:0 -> cuda:1: raw ``cuMemcpyPeerAsync`` + synchronize, and ``am.copy``
    (ordered on cuda:1's queue by timelines), alternated."""
    async with am.open_device("cuda:0") as d0, am.open_device("cuda:1") as d1:
        a, b = await d0.alloc(n), await d1.alloc(n)
        await a.write(np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8))
        b0, b1 = d0._backend, d1._backend
        b1.make_current()
        stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "stream")
        can = check(cu.cuDeviceCanAccessPeer(b1.device, b0.device), "cuDeviceCanAccessPeer")
        raw, ours = [], []
        for _ in range(rounds):
            b1.make_current()
            t0 = time.perf_counter()
            check(
                cu.cuMemcpyPeerAsync(
                    b._allocation.handle, b1.context, a._allocation.handle, b0.context, n, stream
                ),
                "cuMemcpyPeerAsync",
            )
            check(cu.cuStreamSynchronize(stream), "sync")
            raw.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await am.copy(b, a)
            ours.append(time.perf_counter() - t0)
        same = bool(np.array_equal(await a.read(), await b.read()))
        check(cu.cuStreamDestroy(stream), "destroy")
    return {
        "bytes": n,
        "can_access_peer": bool(can),
        "raw_gbps": n / min(raw) / 1e9,
        "asyncmetal_gbps": n / min(ours) / 1e9,
        "ratio": min(raw) / min(ours),
        "correct": same,
    }


def main() -> None:
    import faulthandler

    faulthandler.dump_traceback_later(300, exit=True)
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--loop", default="both")
    args = parser.parse_args()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "python": sys.version.split()[0],
        "machine": platform.platform(),
    }
    loops = ["asyncio", "uvloop"] if args.loop == "both" else [args.loop]
    for name in loops:
        if name == "uvloop":
            import uvloop

            results[name] = uvloop.run(run(name))
        else:
            results[name] = asyncio.run(run(name))
        print(json.dumps(results[name], indent=1), flush=True)
    if len([d for d in am.devices() if d.startswith("cuda:")]) >= 2:
        results["peer_copy"] = asyncio.run(peer_copy())
        print(json.dumps(results["peer_copy"], indent=1), flush=True)
    results["nvrtc"] = asyncio.run(compiles(8))
    print(json.dumps(results["nvrtc"], indent=1), flush=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()

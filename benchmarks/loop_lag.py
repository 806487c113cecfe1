"""The event loop's own lag while many tasks launch and await kernels (README: "Nothing
blocks the loop").

    python benchmarks/loop_lag.py [--device cuda:0|cpu] [--loop asyncio|uvloop]
        [--tasks 1 64 1024] [--kernel-us 10 200 1000 10000] [--queues 1 4]
        [--peers cupy_poll cupy_executor torch_thread torch_poll] [--window 1.0]
        [--json out.json] [--profile DIR]

A ticker task sleeps 1 ms at a time on the same loop; its lag is each interval it
actually got minus 1 ms. Meanwhile N tasks each launch a kernel that busy-waits D us and
await it, in a loop; task i uses queue (stream) i % Q. Per cell (N, D, Q) and competitor:
the ticker's lag p50/p99/max, kernels completed per second, and the time of each launch
call itself on the loop (a submit that takes > 1 ms is a driver call blocking the loop).

Competitors, in one process, cell by cell, with the same kernel:
  asyncmetal      ``await q.launch(...)`` (dev.queue + dev.new_queue()...)
  cupy_poll       CuPy RawKernel, then an event recorded, polled with ``asyncio.sleep(0)``
  cupy_executor   the same event, ``loop.run_in_executor(None, event.synchronize)``
  torch_thread    launched on a torch stream (via cupy.cuda.ExternalStream), a
                  torch.cuda.Event recorded, ``asyncio.to_thread(event.synchronize)``
  torch_poll      the same, ``Event.query()`` polled with ``asyncio.sleep(0)``
On the cpu device the kernel is C; the peer is ``executor``: the same C function through
ctypes in ``loop.run_in_executor``, one single-thread executor per "queue" (as the cpu
device runs one thread per queue).

The kernel watches a stop word in host memory (its address passed as two ints, since
launches take int32 values): when a cell's window ends the word is set and the kernels
still queued end at once, so draining N queued launches of 10 ms does not take N x 10 ms
of device time. Within the window the word is 0 and every kernel spins its full D.

A probe thread also asks the loop to run a callback every 1 ms (call_soon_threadsafe,
as a socket or another thread would) and records how long each waited: the loop's
responsiveness, free of timer granularity. It runs after the ticker, for half as long
(kernels still running), not beside it: asyncio's and trio's epoll sleep in whole
milliseconds, rounded up, so a loop woken by the probe 0.3 ms before the ticker's timer
is due sleeps a full millisecond and the tick comes 0.7 ms late. Side by side, the
probe alone took the idle ticker's p99 from ~0.2 ms to ~1.1 ms on the H200 machine.
(asyncmetal keeps the loop polling up to a timer due within that millisecond after
the wake-ups it causes itself; see asyncmetal/_bridge.py.) Throughput is counted over
both parts.

Target (asyncmetal row): lag p99 <= 1 ms, max <= 5 ms, and throughput >= the best peer's
(within 2 %: cells the device bounds tie). The probe's p99 and max are reported beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import cProfile
import ctypes
import io
import json
import os
import platform
import pstats
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import asyncmetal as am

CUDA_SRC = r"""
extern "C" __global__ void spin_us(int us, int lo, int hi) {
    // The stop word's address, split in two ints (launch values are int32).
    const volatile int* stop = (const volatile int*)
        (((unsigned long long)(unsigned)hi << 32) | (unsigned long long)(unsigned)lo);
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    const unsigned long long end = t0 + 1000ull * (unsigned)us;
    do {
        if (stop && *stop) return;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t < end);
}
"""

CPU_SRC = r"""
#include <stdint.h>
#include <time.h>
void spin_us(int us, int lo, int hi) {
    const volatile int* stop = (const volatile int*)(uintptr_t)
        (((unsigned long long)(unsigned)hi << 32) | (unsigned long long)(unsigned)lo);
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    long long end = ts.tv_sec * 1000000000LL + ts.tv_nsec + 1000LL * us;
    for (;;) {
        if (stop && *stop) return;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        if (ts.tv_sec * 1000000000LL + ts.tv_nsec >= end) return;
    }
}
"""

CUDA_PEERS = ["cupy_poll", "cupy_executor", "torch_thread", "torch_poll"]
CPU_PEERS = ["executor"]
MAX_QUEUES = 4
TICK = 0.001
PROBE_SHARE = 0.5  # the probe's part of the window, after the ticker's (the window)
PROFILE_TOP = 25  # functions printed per profiled cell


def progress(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", flush=True)


def split_address(address: int) -> tuple[int, int]:
    """``address`` as two int32 launch values (low, high), each taken as a signed int."""

    def s32(x: int) -> int:
        return x - (1 << 32) if x >= 1 << 31 else x

    return s32(address & 0xFFFFFFFF), s32((address >> 32) & 0xFFFFFFFF)


class StopWord:
    """An int in host memory the kernels read: 1 ends every spinning kernel at once.

    On cuda: pinned, portable and mapped (under unified addressing the device sees it at
    its host address). On cpu: a ctypes int.
    ``address`` is 0 when none could be made (the kernels then always spin their D)."""

    def __init__(self, device: am.Device) -> None:
        self.host = 0
        self.address = 0
        self._word: ctypes.c_int | None = None
        self._free: Callable[[], Any] | None = None
        if device.name.startswith("cuda"):
            try:
                from asyncmetal.backends.cuda import check, cu

                device._backend.make_current()  # type: ignore[attr-defined]
                flags = cu.CU_MEMHOSTALLOC_PORTABLE | cu.CU_MEMHOSTALLOC_DEVICEMAP
                self.host = int(check(cu.cuMemHostAlloc(4, flags), "cuMemHostAlloc"))
                # Unified addressing: the device reads it at its host address (as the
                # library's own timeline words are read).
                self.address = self.host
                self._free = lambda: cu.cuMemFreeHost(self.host)
            except Exception as exc:
                print(f"no stop word ({exc!r}): drains run every queued kernel in full")
                self.host = self.address = 0
        else:
            self._word = ctypes.c_int(0)
            self.host = self.address = ctypes.addressof(self._word)
        self.set(0)

    def set(self, value: int) -> None:
        if self.host:
            ctypes.c_int.from_address(self.host).value = value

    def close(self) -> None:
        if self._free is not None:
            self._free()
            self._free = None


# -- competitors ---------------------------------------------------------------------------
# Each has submit(queue_index, vals) -> handle (the launch call, timed on the loop),
# wait(handle) -> awaitable (what a user awaits), and drain() (every queue idle).


class Asyncmetal:
    name = "asyncmetal"

    def __init__(self, dev: am.Device, prog: am.Program) -> None:
        self.queues = [dev.queue] + [dev.new_queue() for _ in range(MAX_QUEUES - 1)]
        self.prog = prog

    def submit(self, qi: int, vals: tuple[int, int, int]) -> Any:
        return self.queues[qi].launch(self.prog, vals=vals)  # one thread: the default sizes

    @staticmethod
    def wait(done: Any) -> Any:
        return done  # the Completion itself is awaited

    async def drain(self) -> None:
        for q in self.queues:
            await q.synchronize()

    @staticmethod
    def stats() -> dict[str, int]:
        """The loop's bridge counters: wake-ups, and tasks woken by them."""
        st = am.loop_statistics()
        return {"wakeups": st.wakeups, "woken": st.resolved}

    def completion_stats(self) -> dict[str, int]:
        """The cuda queues' completion threads, summed: event queries, waits blocked on a
        blocking-sync event or napping on a plain one after polling found a command
        unfinished, naps cut short by a host signal (none on other devices)."""
        total: dict[str, int] = {}
        for q in self.queues:
            stats = getattr(q._native, "stats", None)
            for key, value in (stats() if stats else {}).items():
                if key in ("queries", "blocking_waits", "napping_waits", "kicked"):
                    total[key] = total.get(key, 0) + value
        return total

    def close(self) -> None:
        pass


class CpuExecutor:
    """The same C function through ctypes (which drops the GIL for the call) in
    ``run_in_executor``: one single-thread executor per queue index."""

    name = "executor"

    def __init__(self, prog: am.Program) -> None:
        c_int = ctypes.c_int
        self.fn = ctypes.CFUNCTYPE(None, c_int, c_int, c_int)(prog.native)  # type: ignore[arg-type]
        self.pools = [concurrent.futures.ThreadPoolExecutor(1) for _ in range(MAX_QUEUES)]
        self.loop = asyncio.get_running_loop()

    def submit(self, qi: int, vals: tuple[int, int, int]) -> Any:
        return self.loop.run_in_executor(self.pools[qi], self.fn, *vals)

    @staticmethod
    def wait(fut: Any) -> Any:
        return fut

    async def drain(self) -> None:
        for pool in self.pools:
            await asyncio.wrap_future(pool.submit(lambda: None))

    def close(self) -> None:
        for pool in self.pools:
            pool.shutdown(wait=True)


class _CupyKernel:
    def __init__(self, device_index: int) -> None:
        import cupy
        import numpy as np

        self.cupy, self.np = cupy, np
        cupy.cuda.Device(device_index).use()
        self.kernel = cupy.RawKernel(CUDA_SRC, "spin_us")
        self._args: dict[tuple[int, int, int], tuple[Any, ...]] = {}

    def args(self, vals: tuple[int, int, int]) -> tuple[Any, ...]:
        """The launch values as int32 scalars (CuPy passes a Python int as 64 bits)."""
        got = self._args.get(vals)
        if got is None:
            got = self._args[vals] = tuple(self.np.int32(v) for v in vals)
        return got


class CupyPeer:
    def __init__(self, name: str, device_index: int) -> None:
        self.name = name
        self.k = _CupyKernel(device_index)
        self.streams = [self.k.cupy.cuda.Stream(non_blocking=True) for _ in range(MAX_QUEUES)]
        self.loop = asyncio.get_running_loop()
        self.wait = self._poll if name == "cupy_poll" else self._executor
        s = self.streams[0]  # compile and load the kernel now, not in a cell
        self.k.kernel((1,), (1,), self.k.args((1, 0, 0)), stream=s)
        s.synchronize()

    def submit(self, qi: int, vals: tuple[int, int, int]) -> Any:
        s = self.streams[qi]
        self.k.kernel((1,), (1,), self.k.args(vals), stream=s)
        return s.record()

    @staticmethod
    async def _poll(ev: Any) -> None:
        while not ev.done:
            await asyncio.sleep(0)

    def _executor(self, ev: Any) -> Any:
        return self.loop.run_in_executor(None, ev.synchronize)

    async def drain(self) -> None:
        for s in self.streams:
            await asyncio.to_thread(s.synchronize)

    def close(self) -> None:
        pass


class TorchPeer:
    """The kernel launched by CuPy on a torch stream; completion through a
    torch.cuda.Event recorded after it, as torch code awaits its own work."""

    def __init__(self, name: str, device_index: int) -> None:
        import torch

        self.name = name
        self.torch = torch
        torch.cuda.set_device(device_index)
        self.k = _CupyKernel(device_index)
        self.streams = []
        for _ in range(MAX_QUEUES):
            ts = torch.cuda.Stream(device=device_index)
            self.streams.append((ts, self.k.cupy.cuda.ExternalStream(ts.cuda_stream)))
        self.wait = self._poll if name == "torch_poll" else self._thread
        ts, xs = self.streams[0]
        self.k.kernel((1,), (1,), self.k.args((1, 0, 0)), stream=xs)
        ts.synchronize()

    def submit(self, qi: int, vals: tuple[int, int, int]) -> Any:
        ts, xs = self.streams[qi]
        self.k.kernel((1,), (1,), self.k.args(vals), stream=xs)
        ev = self.torch.cuda.Event()
        ev.record(ts)
        return ev

    @staticmethod
    async def _poll(ev: Any) -> None:
        while not ev.query():
            await asyncio.sleep(0)

    @staticmethod
    def _thread(ev: Any) -> Any:
        return asyncio.to_thread(ev.synchronize)

    async def drain(self) -> None:
        for ts, _ in self.streams:
            await asyncio.to_thread(ts.synchronize)

    def close(self) -> None:
        pass


def make_peer(name: str, dev: am.Device, prog: am.Program) -> Any:
    if dev.name.startswith("cpu"):
        if name == "executor":
            return CpuExecutor(prog)
        raise ValueError(f"{name} needs a cuda device")
    index = int(dev.name.partition(":")[2] or 0)
    if name.startswith("cupy"):
        return CupyPeer(name, index)
    if name.startswith("torch"):
        return TorchPeer(name, index)
    raise ValueError(f"unknown peer {name}")


# -- one cell --------------------------------------------------------------------------------


def pct(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (nan if empty)."""
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def summary_ms(values_s: list[float]) -> dict[str, float | int]:
    s = sorted(values_s)
    return {
        "p50": pct(s, 0.50) * 1e3,
        "p99": pct(s, 0.99) * 1e3,
        "max": (s[-1] if s else float("nan")) * 1e3,
        "count": len(s),
    }


async def ticker(state: dict[str, bool], lags: list[float]) -> None:
    """Sleep 1 ms at a time while ticking; record each interval minus 1 ms."""
    prev = time.perf_counter()
    while state["ticking"]:
        await asyncio.sleep(TICK)
        now = time.perf_counter()
        lags.append(now - prev - TICK)
        prev = now


def probe(loop: asyncio.AbstractEventLoop, state: dict[str, bool], waits: list[float]) -> None:
    """Every 1 ms while measuring, from a thread: how long a callback waits for the loop."""

    def arrived(sent: float) -> None:
        waits.append(time.perf_counter() - sent)

    while state["measuring"]:
        loop.call_soon_threadsafe(arrived, time.perf_counter())
        time.sleep(TICK)


async def run_cell(
    runner: Any,
    tasks: int,
    kernel_us: int,
    queues: int,
    stop: StopWord,
    warmup: float,
    window: float,
    drain_timeout: float,
    profile: str | None = None,
) -> dict[str, Any]:
    state = {"running": True, "measuring": False, "ticking": False}
    per_task = [0] * tasks
    in_window = [0] * tasks
    submits: list[int] = []
    latencies: list[int] = []  # each command's launch to its task's resumption
    lags: list[float] = []
    counts = {"launched": 0}
    lo, hi = split_address(stop.address)
    vals = (kernel_us, lo, hi)

    async def worker(i: int) -> None:
        qi = i % queues
        submit, wait = runner.submit, runner.wait
        ns = time.perf_counter_ns
        # No launch once the window has closed: at most one launch per task is left.
        while state["running"]:
            t0 = ns()
            handle = submit(qi, vals)
            t1 = ns()
            counts["launched"] += 1
            if state["measuring"]:
                submits.append(t1 - t0)
            await wait(handle)
            per_task[i] += 1
            if state["measuring"]:
                in_window[i] += 1
                latencies.append(ns() - t0)

    stop.set(0)
    workers = [asyncio.ensure_future(worker(i)) for i in range(tasks)]
    await asyncio.sleep(warmup)
    stats = getattr(runner, "stats", None)
    stats0 = stats() if stats else {}
    completion = getattr(runner, "completion_stats", None)
    completion0 = completion() if completion else {}
    profiler = cProfile.Profile() if profile else None
    state["measuring"] = state["ticking"] = True
    t_start = time.perf_counter()
    # The loop thread's own CPU time over the window: what each awaited kernel costs it.
    cpu_start, process_start = time.thread_time(), time.process_time()
    if profiler:
        profiler.enable()  # this thread's: the loop's
    # The ticker first, then the probe: each wake-up the probe causes a hair before a
    # ticker's timer is due makes that tick a millisecond late (see the docstring).
    tick = asyncio.ensure_future(ticker(state, lags))
    await asyncio.sleep(window)
    state["ticking"] = False
    await tick
    probes: list[float] = []
    prober = threading.Thread(target=probe, args=(asyncio.get_running_loop(), state, probes))
    prober.start()
    await asyncio.sleep(window * PROBE_SHARE)
    state["measuring"] = state["running"] = False
    await asyncio.to_thread(prober.join)
    t_end = time.perf_counter()
    if profiler:
        profiler.disable()
    loop_cpu = time.thread_time() - cpu_start
    process_cpu = time.process_time() - process_start
    stop.set(1)  # the kernels still queued end at once
    stats1 = stats() if stats else {}
    completion1 = completion() if completion else {}
    drain0 = time.perf_counter()
    error = None
    if workers:
        _, pending = await asyncio.wait(workers, timeout=drain_timeout)
        if pending:
            error = f"{len(pending)} tasks still waiting after {drain_timeout} s: cancelled"
            for t in pending:
                t.cancel()
            await asyncio.wait(pending)
        for t in workers:
            if not t.cancelled() and t.exception() is not None and error is None:
                error = repr(t.exception())
    if runner is not None:
        await asyncio.wait_for(runner.drain(), drain_timeout)
    stop.set(0)
    drain_s = time.perf_counter() - drain0
    span = t_end - t_start
    done_in_window = sum(in_window)
    row: dict[str, Any] = {}
    if stats:
        # Diagnostic: how many tasks each wake-up of the loop resumed in the window (a
        # large batch is a long loop iteration, which is what the ticker feels).
        row["loop_bridge"] = {k: stats1[k] - stats0[k] for k in stats0}
    if completion0:
        row["completion_threads"] = {k: completion1[k] - completion0[k] for k in completion0}
    if profiler and profile:
        profiler.dump_stats(profile)
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(PROFILE_TOP)
        row["profile_top"] = out.getvalue()
    return row | {
        "lag_ms": summary_ms(lags),
        "probe_ms": summary_ms(probes),
        "throughput_per_s": done_in_window / span,
        "completed_in_window": done_in_window,
        "window_s": span,
        "submit_ms": summary_ms([x / 1e9 for x in submits]),
        "latency_ms": summary_ms([x / 1e9 for x in latencies]),
        "submits_over_1ms": sum(1 for x in submits if x > 1_000_000),
        # The loop thread's CPU per kernel completed, and its share of the window (1.0: the
        # loop never slept); the process's, completion and driver threads included.
        "loop_cpu_us_per_kernel": loop_cpu * 1e6 / max(done_in_window, 1),
        "loop_busy": loop_cpu / span,
        "process_cpu_us_per_kernel": process_cpu * 1e6 / max(done_in_window, 1),
        "launched": counts["launched"],
        "completed": sum(per_task),
        "per_task_min": min(per_task) if per_task else 0,
        "tasks_done_in_window": sum(1 for x in in_window if x),
        "drain_s": drain_s,
        "error": error,
    }


def target(row: dict[str, Any], best_peer: float | None) -> tuple[bool, str]:
    """Whether asyncmetal's row meets the target, and what missed."""
    missed = []
    lag = row["lag_ms"]
    if not lag["p99"] <= 1.0:
        missed.append("p99")
    if not lag["max"] <= 5.0:
        missed.append("max")
    if best_peer is not None and not row["throughput_per_s"] >= 0.98 * best_peer:
        missed.append("throughput")
    if row.get("error"):
        missed.append("error")
    return not missed, ",".join(missed)


def print_cell(cell: dict[str, Any]) -> None:
    print(
        f"\n== N={cell['tasks']} tasks, D={cell['kernel_us']} us, Q={cell['queues']} "
        f"queue{'s' if cell['queues'] > 1 else ''} =="
    )
    print(
        f"{'':15}{'lag p50':>9}{'p99':>9}{'max':>9}{'probe p99':>10}{'max':>8}"
        f"{'kernels/s':>11}{'submit p99':>12}{'max':>9}{'>1ms':>6}{'latency p99':>12}{'max':>9}"
        f"{'loop us/k':>10}{'busy':>6}  target"
    )
    for name, r in cell["results"].items():
        if "skipped" in r:
            print(f"{name:15}  skipped: {r['skipped']}")
            continue
        lag, sub, pr, lat = r["lag_ms"], r["submit_ms"], r["probe_ms"], r["latency_ms"]
        verdict = ""
        if name == "asyncmetal":
            verdict = "PASS" if cell["target_met"] else f"MISS ({cell['target_missed']})"
        if r.get("error"):
            verdict += f" error: {r['error']}"
        print(
            f"{name:15}{lag['p50']:9.3f}{lag['p99']:9.3f}{lag['max']:9.2f}"
            f"{pr['p99']:10.3f}{pr['max']:8.2f}{r['throughput_per_s']:11.0f}{sub['p99']:12.3f}{sub['max']:9.2f}"
            f"{r['submits_over_1ms']:6d}{lat['p99']:12.2f}{lat['max']:9.2f}"
            f"{r['loop_cpu_us_per_kernel']:10.1f}{r['loop_busy']:6.2f}  {verdict}"
        )
        if "profile_top" in r:
            print(r["profile_top"])
    print(
        "(in ms; latency: a command's launch to its task's resumption; loop us/k: the loop "
        "thread's CPU per kernel completed, busy: its share of the window)",
        flush=True,
    )


# -- the run ---------------------------------------------------------------------------------


def machine_info(dev_name: str, loop_name: str) -> dict[str, Any]:
    from asyncmetal import _native

    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": sys.version.split()[0],
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "loop": loop_name,
        "device": dev_name,
        "asyncmetal": am.__version__,
    }
    with contextlib.suppress(Exception):
        info["native_extension"] = _native.extension() is not None
    if loop_name == "uvloop":
        import uvloop

        info["uvloop"] = uvloop.__version__
    if dev_name.startswith("cuda"):
        with contextlib.suppress(Exception):
            import cuda.bindings

            info["cuda_bindings"] = cuda.bindings.__version__
        with contextlib.suppress(Exception):
            from asyncmetal.backends.cuda import check, cu

            index = int(dev_name.partition(":")[2] or 0)
            device = check(cu.cuDeviceGet(index), "cuDeviceGet")
            name = check(cu.cuDeviceGetName(256, device), "cuDeviceGetName")
            info["gpu"] = bytes(name).split(b"\0")[0].decode()
            info["driver_version"] = check(cu.cuDriverGetVersion(), "cuDriverGetVersion")
        for mod in ("cupy", "torch", "numpy"):
            with contextlib.suppress(Exception):
                info[mod] = __import__(mod).__version__
    return info


async def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"cells": []}
    result["args"] = {k: v for k, v in vars(args).items() if k != "json"}
    t_run = time.perf_counter()
    async with am.open_device(args.device) as dev:
        result["meta"] = machine_info(dev.name, args.loop)  # the driver is initialized now
        src = CPU_SRC if dev.name.startswith("cpu") else CUDA_SRC
        prog = await dev.compile(src, "spin_us")
        stop = StopWord(dev)
        result["meta"]["stop_word"] = bool(stop.address)
        runners: list[Any] = [Asyncmetal(dev, prog)]
        skipped: dict[str, str] = {}
        for name in args.peers:
            try:
                runners.append(make_peer(name, dev, prog))
            except ImportError as exc:
                skipped[name] = f"not installed ({exc})"
            except Exception as exc:
                skipped[name] = f"could not start: {exc!r}"
        for name, why in skipped.items():
            print(f"peer {name} skipped: {why}", flush=True)
        # Warm every competitor's path once.
        for r in runners:
            await run_cell(r, 4, 10, 1, stop, 0.05, 0.05, args.drain_timeout)
        # The kernel's length as awaited alone (launch and wake-up included): a check that
        # its timer spins D, not a multiple of it.
        lo, hi = split_address(stop.address)
        check = {}
        for d in args.kernel_us:
            took = []
            for _ in range(3):
                t0 = time.perf_counter()
                await runners[0].submit(0, (d, lo, hi))
                took.append((time.perf_counter() - t0) * 1e6)
            check[str(d)] = sorted(took)[1]
        result["kernel_check_us"] = check
        progress(f"one awaited kernel of D us, median of 3 (us): {check}")
        idle = await run_cell(None, 0, 0, 1, stop, 0.0, args.window, args.drain_timeout)
        result["idle_lag_ms"] = idle["lag_ms"]
        result["idle_probe_ms"] = idle["probe_ms"]
        lag, pr = idle["lag_ms"], idle["probe_ms"]
        progress(
            f"idle loop (the ticker alone): lag p50 {lag['p50']:.3f} p99 {lag['p99']:.3f} "
            f"max {lag['max']:.2f} ms; probe p99 {pr['p99']:.3f} max {pr['max']:.2f} ms"
        )
        try:
            for n in args.tasks:
                for d in args.kernel_us:
                    for q in args.queues:
                        cell: dict[str, Any] = {
                            "tasks": n,
                            "kernel_us": d,
                            "queues": q,
                            "results": {},
                        }
                        for r in runners:
                            profile = None
                            if args.profile and r.name == "asyncmetal":
                                os.makedirs(args.profile, exist_ok=True)
                                profile = os.path.join(args.profile, f"N{n}_D{d}_Q{q}.pstats")
                            try:
                                row = await run_cell(
                                    r,
                                    n,
                                    d,
                                    q,
                                    stop,
                                    args.warmup,
                                    args.window,
                                    args.drain_timeout,
                                    profile,
                                )
                            except Exception as exc:  # one competitor's failure ends its cell
                                row = {"skipped": f"failed: {exc!r}"}
                            cell["results"][r.name] = row
                        for name, why in skipped.items():
                            cell["results"][name] = {"skipped": why}
                        peers = [
                            row["throughput_per_s"]
                            for name, row in cell["results"].items()
                            if name != "asyncmetal" and "skipped" not in row and not row["error"]
                        ]
                        ours = cell["results"]["asyncmetal"]
                        if "skipped" in ours:
                            cell["target_met"], cell["target_missed"] = False, "failed"
                        else:
                            cell["target_met"], cell["target_missed"] = target(
                                ours, max(peers) if peers else None
                            )
                        result["cells"].append(cell)
                        print_cell(cell)
                        if args.json:  # written after every cell: a cut-short run keeps data
                            write(args.json, result)
        finally:
            for r in runners:
                r.close()
            stop.close()
    result["seconds"] = time.perf_counter() - t_run
    met = sum(1 for c in result["cells"] if c["target_met"])
    result["target_met_cells"] = f"{met}/{len(result['cells'])}"
    progress(f"target met in {met} of {len(result['cells'])} cells ({result['seconds']:.0f} s)")
    return result


def write(path: str, result: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def main() -> None:
    import faulthandler

    faulthandler.dump_traceback_later(600, exit=True)
    default_device = "cuda:0" if "cuda:0" in am.devices() else "cpu"
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--device", default=default_device)
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    parser.add_argument("--tasks", type=int, nargs="+", default=[1, 64, 1024])
    parser.add_argument("--kernel-us", type=int, nargs="+", default=[10, 200, 1000, 10000])
    parser.add_argument("--queues", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--peers", nargs="*", help="default: all for the device; none: --peers")
    parser.add_argument("--window", type=float, default=1.0, help="seconds measured per cell")
    parser.add_argument("--warmup", type=float, default=0.25, help="seconds before the window")
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="profile the loop thread in asyncmetal's windows (cProfile): a .pstats file per "
        "cell in DIR, its top functions printed (slows the loop: not for the targets)",
    )
    args = parser.parse_args()
    if any(not 1 <= q <= MAX_QUEUES for q in args.queues):
        parser.error(f"--queues must be 1..{MAX_QUEUES}")
    if args.peers is None:
        args.peers = CPU_PEERS if args.device.startswith("cpu") else CUDA_PEERS
    progress(f"device {args.device}, loop {args.loop}, peers {args.peers}")
    if args.loop == "uvloop":
        import uvloop

        result = uvloop.run(run(args))
    else:
        result = asyncio.run(run(args))
    if args.json:
        write(args.json, result)


if __name__ == "__main__":
    main()

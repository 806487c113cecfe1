"""Awaiting cpu-device launches against thread hand-offs, side by side, on asyncio and trio.

    python benchmarks/cpu_await.py [--json out.json]

It needs trio (the test extra brings it).

Competitors, in one process and one run:
  * asyncmetal: ``await queue.launch(empty)``
  * the way a user would write it instead: the same ctypes function through
    ``loop.run_in_executor(None, f)`` (asyncio) or ``trio.to_thread.run_sync(f)`` (trio).
Targets: latency ratio <= 0.5x, 1000-task throughput ratio >= 4x, CPU time
while awaiting a 200 ms kernel < 5 % of a core.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import trio
from _common import median_us, write_json

import asyncmetal as am

SRC = r"""
void empty(void) {}
#include <time.h>
void sleep_ms(int ms) {
    struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };
    nanosleep(&ts, 0);
}
"""
LATENCY_N = 3000
TASKS, PER_TASK = 1000, 20


def thread_handoff(backend: str) -> Callable[[Callable[[], Any]], Awaitable[Any]]:
    if backend == "asyncio":

        async def run(f: Callable[[], Any]) -> Any:
            return await asyncio.get_running_loop().run_in_executor(None, f)

        return run
    return trio.to_thread.run_sync


async def latency(run: Callable[[], Awaitable[Any]], n: int = LATENCY_N) -> float:
    return await median_us(run, n)


async def throughput(run: Callable[[], Awaitable[Any]]) -> float:
    async def worker() -> None:
        for _ in range(PER_TASK):
            await run()

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(TASKS):
            tg.start_soon(worker)
    return TASKS * PER_TASK / (time.perf_counter() - t0)


async def bench(backend: str) -> dict[str, Any]:
    async with am.open_device("cpu") as dev:
        empty = await dev.compile(SRC, "empty")
        sleeper = await dev.compile(SRC, "sleep_ms")
        f = ctypes.CFUNCTYPE(None)(empty.native)  # the very function the queue calls
        q = dev.queue
        handoff = thread_handoff(backend)

        async def am_launch() -> None:
            await q.launch(empty)

        async def thread_launch() -> None:
            await handoff(f)

        for run in (am_launch, thread_launch):  # warm up both
            await latency(run, 200)
        lat_am, lat_th = [], []
        for _ in range(3):  # interleave rounds so drift hits both alike
            lat_am.append(await latency(am_launch))
            lat_th.append(await latency(thread_launch))
        tput_am, tput_th = [], []
        for _ in range(2):
            tput_am.append(await throughput(am_launch))
            tput_th.append(await throughput(thread_launch))
        # CPU time used by the whole process while one task awaits a 200 ms kernel.
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await q.launch(sleeper, vals=(200,))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    result = {
        "backend": backend,
        "latency_us": {
            "asyncmetal": statistics.median(lat_am),
            "thread": statistics.median(lat_th),
        },
        "throughput_per_s": {"asyncmetal": max(tput_am), "thread": max(tput_th)},
        "wait_200ms": {"wall_s": wall, "cpu_s": cpu, "cpu_fraction": cpu / wall},
    }
    result["latency_ratio"] = result["latency_us"]["asyncmetal"] / result["latency_us"]["thread"]
    result["throughput_ratio"] = (
        result["throughput_per_s"]["asyncmetal"] / result["throughput_per_s"]["thread"]
    )
    return result


def report(r: dict[str, Any]) -> None:
    name = "run_in_executor" if r["backend"] == "asyncio" else "trio.to_thread"
    lat, tput, wait = r["latency_us"], r["throughput_per_s"], r["wait_200ms"]
    print(f"\n== {r['backend']} ==")
    print(f"{'':34}{'asyncmetal':>12}{name:>18}{'ratio':>8}  target")
    print(
        f"{'one awaited launch, median (us)':34}{lat['asyncmetal']:12.1f}{lat['thread']:18.1f}"
        f"{r['latency_ratio']:8.2f}  <= 0.50 {'met' if r['latency_ratio'] <= 0.5 else 'MISSED'}"
    )
    print(
        f"{'1000 tasks, completions/s':34}{tput['asyncmetal']:12.0f}{tput['thread']:18.0f}"
        f"{r['throughput_ratio']:8.2f}  >= 4.00 {'met' if r['throughput_ratio'] >= 4 else 'MISSED'}"
    )
    frac = wait["cpu_fraction"]
    print(
        f"{'awaiting a 200 ms kernel: CPU':34}{frac * 100:11.2f}%{'':18}{'':8}  < 5 %   "
        f"{'met' if frac < 0.05 else 'MISSED'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = [asyncio.run(bench("asyncio")), trio.run(bench, "trio")]
    for r in results:
        report(r)
    write_json(args.json, {"results": results})


if __name__ == "__main__":
    main()

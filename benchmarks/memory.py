"""The allocator and host <-> device copies on the cpu device, side by side.

  python benchmarks/memory.py [--json out.json] [--gib 1]

* cached ``alloc`` + ``free`` round trip (awaited, both checkpoints included) against
  a fresh native allocation and release of the same size (1 MiB): target <= 0.2x;
* 1 GiB numpy -> cpu device and back, throughput against ``numpy.copyto`` of the same
  bytes: target >= 0.8x;
* 200 tasks allocating 1 MiB each under a budget that fits 10: no error, and the peak
  held never above the budget;
* the cached round trip again with 1,000 and 5,000 frees pending behind a queue held on a
  wait (each free waits for a command using its buffer): what a deep queue's frees add
  to each allocation.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import anyio
import numpy as np
from _common import alloc_round_trip as common_alloc_round_trip
from _common import write_json

import asyncmetal as am

MiB = 1 << 20
SRC = "void touch(unsigned char* x, int n) { for (int i = 0; i < n; i += 4096) x[i] += 1; }"


async def alloc_round_trip(dev: am.Device, nbytes: int, n: int = 3000) -> dict[str, Any]:
    backend = dev._backend

    def native() -> None:
        backend.free(backend.allocate(nbytes))  # released when its last reference goes

    return await common_alloc_round_trip(dev, nbytes, n, native)


async def host_round_trip(dev: am.Device, nbytes: int) -> dict[str, float]:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    back = np.empty_like(src)
    scratch = np.empty_like(src)
    buf = await dev.alloc(nbytes)
    await buf.write(src)  # first touch of the device pages, not timed
    np.copyto(scratch, src)
    np.copyto(back, scratch)
    ours, theirs = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        await buf.write(src)
        await am.copy(back, buf)
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        np.copyto(scratch, src)
        np.copyto(back, scratch)
        theirs.append(time.perf_counter() - t0)
    assert np.array_equal(back, src)
    await buf.free()
    a, b = min(ours), min(theirs)
    return {
        "bytes": nbytes,
        "asyncmetal_gbps": 2 * nbytes / a / 1e9,
        "copyto_gbps": 2 * nbytes / b / 1e9,
        "ratio": b / a,
    }


async def backpressure(dev: am.Device) -> dict[str, Any]:
    touch = await dev.compile(SRC, "touch")
    dev.memory_budget = 10 * MiB
    dev._allocator.peak = 0
    errors: list[BaseException] = []
    samples: list[int] = []

    async def task() -> None:
        try:
            buf = await dev.alloc(MiB)
            await dev.queue.launch(touch, buf, vals=(MiB,))
            stats = dev.memory_statistics()
            samples.append(stats.in_use + stats.cached)
            await buf.free()
        except BaseException as exc:
            errors.append(exc)

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(200):
            tg.start_soon(task)
    stats = dev.memory_statistics()
    return {
        "tasks": 200,
        "budget": stats.budget,
        "peak": stats.peak,
        "max_sampled": max(samples),
        "errors": len(errors),
        "seconds": time.perf_counter() - t0,
    }


async def behind_pending(
    dev: am.Device, counts: tuple[int, ...] = (0, 1000, 5000)
) -> dict[str, Any]:
    """The median cached 1 MiB ``alloc`` + ``free`` round trip while ``n`` frees wait for
    commands held behind a device wait, for each ``n`` of ``counts``."""
    touch = await dev.compile(SRC, "touch")
    out: dict[str, Any] = {}
    for n in counts:
        gate = dev.timeline()
        queue = dev.new_queue()
        queue.wait(gate, 1)
        buffers = [await dev.alloc(256) for _ in range(n)]
        for buf in buffers:
            queue.launch(touch, buf, vals=(256,))
        async with anyio.create_task_group() as tg:
            for buf in buffers:
                tg.start_soon(buf.free)
            await anyio.sleep(0.1)  # (every free pending)
            times = []
            for _ in range(500):
                t0 = time.perf_counter_ns()
                await (await dev.alloc(MiB)).free()
                times.append(time.perf_counter_ns() - t0)
            gate.signal(1)
        await queue.close()
        out[str(n)] = statistics.median(times) / 1e3
    return {"round_trip_us_by_pending": out}


async def main(gib: float) -> dict[str, Any]:
    async with am.open_device("cpu") as dev:
        result = {
            "alloc": await alloc_round_trip(dev, MiB),
            "host_copy": await host_round_trip(dev, int(gib * (1 << 30))),
        }
    async with am.open_device("cpu:1") as dev:
        result["backpressure"] = await backpressure(dev)
    async with am.open_device("cpu:2") as dev:
        result["pending"] = await behind_pending(dev)
    return result


def report(r: dict[str, Any]) -> None:
    a, h, b, p = r["alloc"], r["host_copy"], r["backpressure"], r["pending"]
    print(
        f"1 MiB alloc+free: cached {a['cached_us']:.2f} us vs native {a['native_us']:.2f} us"
        f" -> {a['ratio']:.2f}x (<= 0.2)"
    )
    print(
        f"{h['bytes'] / (1 << 30):.1f} GiB numpy -> device -> numpy: "
        f"{h['asyncmetal_gbps']:.1f} GB/s vs numpy.copyto {h['copyto_gbps']:.1f} GB/s"
        f" -> {h['ratio']:.2f}x (>= 0.8)"
    )
    print(
        f"200 tasks, budget {b['budget'] // MiB} MiB: {b['errors']} errors, peak "
        f"{b['peak'] / MiB:.1f} MiB (max sampled {b['max_sampled'] / MiB:.1f} MiB) in "
        f"{b['seconds']:.2f} s"
    )
    by = p["round_trip_us_by_pending"]
    print(
        "1 MiB alloc+free with frees pending: "
        + ", ".join(f"{n}: {us:.2f} us" for n, us in by.items())
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    result = anyio.run(main, args.gib)
    report(result)
    write_json(args.json, result)

"""Host-signal latency: from ``tl.signal(v)`` on the host to the resumption of the task
awaiting a launch held on the device behind ``q.wait(tl, v)``, after parks of 1 ms to 10 s.

    python benchmarks/signal_latency.py [--device cuda:0|cpu] [--loop asyncio|uvloop]
        [--parks-ms 1 10 100 1000 10000] [--json out.json]

Per sample: ``q.wait(tl, v)``, ``done = q.launch(empty)``, a task awaiting ``done``; the
main task sleeps P (the park: nothing happens anywhere), then notes the time and calls
``tl.signal(v)`` and awaits the task, which notes the time it resumed. Also the process
CPU time used during the park, as % of one core (what the completion path spends while
it waits for a value nobody has signalled yet), and the loop thread's own share of it.
Fewer samples for long parks; about 30 s in all with the defaults.

Context, for short parks only: the same latency for a task awaiting ``tl.wait(v)`` on the
host (no device in the path), and for a task awaiting an ``asyncio.Event`` set after the
same park (no asyncmetal at all: the machine's and the loop's own floor -- a CPU left
idle for milliseconds runs the first microseconds of Python after it several times
slower than a busy one).

The floor, on cuda, for parks up to 1 s: the same wait and launch made with the driver
directly (cuda-bindings: ``cuStreamWaitValue64`` on a word of pinned memory, the kernel,
an event), the host storing the word, and a thread spinning on ``cuEventQuery`` -- no
event loop, no wake-up, a core polled throughout; and the other way round, the launch
made only at the signal (nothing held on the device during the park), spun on alike.

Target: p50 <= 50 us for every P, without polling a core during the park (here: a
median < 5 % of a core, judged for parks of 10 ms and more: a 1 ms park's CPU time is
mostly the loop's own timer wake-up and the sample's submissions, not polling).

A script of its own rather than part of cuda_peers.py: its parks are mostly idle time
that would crowd cuda_peers' time budget, and it runs unchanged on the cpu device.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from typing import Any

from _common import write_json

import asyncmetal as am

KERNELS = {
    "cuda": 'extern "C" __global__ void empty() {}',
    "cpu": "void empty(void) {}",
}
SAMPLES_MS = {1: 20, 10: 20, 100: 10, 1000: 5, 10000: 2}  # fewer for long parks
HOST_WAIT_PARKS_MS = (1, 10, 100)
DRIVER_PARKS_MS = (1, 10, 100, 1000)  # the driver floor (cuda): at most 10 samples each
TARGET_P50_US = 50.0
IDLE_CPU_LIMIT = 0.05
IDLE_CPU_FROM_MS = 10  # shorter parks: reported, not judged (see the docstring)


def samples_for(park_ms: float) -> int:
    return SAMPLES_MS.get(int(park_ms), max(2, min(20, int(5000 / park_ms))))


def progress(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", flush=True)


async def device_sample(
    q: am.Queue, tl: am.Timeline, prog: am.Program, v: int, park_s: float
) -> tuple[float, float, float, float]:
    """One sample: (signal -> resumption in us, CPU during the park as a fraction of a
    core, the ``tl.signal`` call itself in us, the loop thread's own share of that CPU)."""
    q.wait(tl, v)
    done = q.launch(prog)
    resumed: list[int] = []

    async def waiter() -> None:
        await done
        resumed.append(time.perf_counter_ns())

    task = asyncio.ensure_future(waiter())
    await asyncio.sleep(0)  # the waiter is parked on the completion before the park starts
    cpu0, loop0, wall0 = time.process_time(), time.thread_time(), time.perf_counter()
    await asyncio.sleep(park_s)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    loop = time.thread_time() - loop0
    t0 = time.perf_counter_ns()
    tl.signal(v)
    t1 = time.perf_counter_ns()
    await task
    return (resumed[0] - t0) / 1e3, cpu / wall, (t1 - t0) / 1e3, loop / wall


async def host_sample(tl: am.Timeline, v: int, park_s: float) -> float:
    """signal -> resumption in us of a task awaiting ``tl.wait(v)`` on the host."""
    resumed: list[int] = []

    async def waiter() -> None:
        await tl.wait(v)
        resumed.append(time.perf_counter_ns())

    task = asyncio.ensure_future(waiter())
    await asyncio.sleep(0)
    await asyncio.sleep(park_s)
    t0 = time.perf_counter_ns()
    tl.signal(v)
    await task
    return (resumed[0] - t0) / 1e3


async def event_sample(park_s: float) -> float:
    """set -> resumption in us of a task awaiting an ``asyncio.Event`` (no asyncmetal)."""
    event = asyncio.Event()
    resumed: list[int] = []

    async def waiter() -> None:
        await event.wait()
        resumed.append(time.perf_counter_ns())

    task = asyncio.ensure_future(waiter())
    await asyncio.sleep(0)
    await asyncio.sleep(park_s)
    t0 = time.perf_counter_ns()
    event.set()
    await task
    return (resumed[0] - t0) / 1e3


def driver_floor(parks_ms: list[float]) -> dict[str, dict[str, float]]:
    """The driver's own latency (cuda-bindings, no asyncmetal, no loop): per park, p50 of
    the host's store of the word -> the kernel's event seen done by a thread spinning on
    ``cuEventQuery`` (``device_wait``), and of the launch made at that moment instead
    (``launch_at_signal``)."""
    import ctypes

    from cuda.bindings import driver as cu

    from asyncmetal.backends.cuda._compiler import CUDACompiler

    def ok(result: Any) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"driver call failed: {err}")
        return rest[0] if len(rest) == 1 else rest

    ok(cu.cuInit(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(0))))
    ok(cu.cuCtxSetCurrent(ctx))
    module = ok(cu.cuModuleLoadData(CUDACompiler().compile(KERNELS["cuda"])))
    kernel = ok(cu.cuModuleGetFunction(module, b"empty"))
    pinned = ok(cu.cuMemHostAlloc(8, cu.CU_MEMHOSTALLOC_PORTABLE | cu.CU_MEMHOSTALLOC_DEVICEMAP))
    word = ctypes.c_uint64.from_address(int(pinned))
    word.value = 0
    device_word = ok(cu.cuMemHostGetDevicePointer(pinned, 0))
    stream = ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    event = ok(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
    not_ready = cu.CUresult.CUDA_ERROR_NOT_READY

    def launch() -> None:
        ok(cu.cuLaunchKernel(kernel, 1, 1, 1, 1, 1, 1, 0, stream, 0, 0))
        ok(cu.cuEventRecord(event, stream))

    def done_after(t0: int) -> float:
        while cu.cuEventQuery(event)[0] == not_ready:
            pass
        return (time.perf_counter_ns() - t0) / 1e3

    out: dict[str, dict[str, float]] = {}
    v = 0
    try:
        for park_ms in [p for p in parks_ms if p in DRIVER_PARKS_MS]:
            n = min(10, samples_for(park_ms))
            held, at_signal = [], []
            for _ in range(n):
                v += 1
                ok(cu.cuStreamWaitValue64(stream, device_word, v, 0))  # (>=)
                launch()
                time.sleep(park_ms / 1e3)
                t0 = time.perf_counter_ns()
                word.value = v
                held.append(done_after(t0))
                time.sleep(park_ms / 1e3)
                t0 = time.perf_counter_ns()
                launch()
                at_signal.append(done_after(t0))
            out[str(park_ms)] = {
                "device_wait_p50_us": statistics.median(held),
                "launch_at_signal_p50_us": statistics.median(at_signal),
            }
            progress(f"  driver floor, park {park_ms} ms: {out[str(park_ms)]}")
    finally:
        cu.cuStreamSynchronize(stream)
        cu.cuEventDestroy(event)
        cu.cuStreamDestroy(stream)
        cu.cuMemFreeHost(pinned)
        cu.cuModuleUnload(module)
        cu.cuDevicePrimaryCtxRelease(ok(cu.cuDeviceGet(0)))
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    kind = "cpu" if args.device.startswith("cpu") else "cuda"
    out: dict[str, Any] = {"device": args.device, "loop": args.loop, "parks": []}
    async with am.open_device(args.device) as dev:
        prog = await dev.compile(KERNELS[kind], "empty")
        q = dev.new_queue()
        tl = dev.timeline()
        v = 0
        for _ in range(20):  # warm the path (no park)
            v += 1
            await device_sample(q, tl, prog, v, 0.0)
        for park_ms in args.parks_ms:
            n = samples_for(park_ms)
            progress(f"park {park_ms} ms x {n}")
            lat, cpu, sig, loop = [], [], [], []
            for _ in range(n):
                v += 1
                a, b, c, d = await device_sample(q, tl, prog, v, park_ms / 1e3)
                lat.append(a)
                cpu.append(b)
                sig.append(c)
                loop.append(d)
            row = {
                "park_ms": park_ms,
                "samples": n,
                "p50_us": statistics.median(lat),
                "max_us": max(lat),
                "all_us": lat,
                "park_cpu_pct_median": 100 * statistics.median(cpu),
                "park_cpu_pct_max": 100 * max(cpu),
                "park_loop_thread_cpu_pct_median": 100 * statistics.median(loop),
                "signal_call_us_median": statistics.median(sig),
            }
            row["target_met"] = row["p50_us"] <= TARGET_P50_US and (
                park_ms < IDLE_CPU_FROM_MS or max(cpu) < IDLE_CPU_LIMIT
            )
            out["parks"].append(row)
            progress(
                f"  p50 {row['p50_us']:.1f} us, max {row['max_us']:.1f} us, park CPU "
                f"{row['park_cpu_pct_median']:.2f} % (max {row['park_cpu_pct_max']:.2f} %; "
                f"the loop thread's {row['park_loop_thread_cpu_pct_median']:.2f} %)"
            )
        host = {}
        htl = dev.timeline()
        hv = 0
        for park_ms in HOST_WAIT_PARKS_MS:
            lat = []
            for _ in range(10):
                hv += 1
                lat.append(await host_sample(htl, hv, park_ms / 1e3))
            host[str(park_ms)] = {"p50_us": statistics.median(lat), "max_us": max(lat)}
        out["host_wait_us"] = host
        floor = {}
        for park_ms in HOST_WAIT_PARKS_MS:
            lat = [await event_sample(park_ms / 1e3) for _ in range(10)]
            floor[str(park_ms)] = {"p50_us": statistics.median(lat), "max_us": max(lat)}
        out["asyncio_event_us"] = floor
    if kind == "cuda":
        progress("driver floor (cuda-bindings, a core spinning on the event)")
        out["driver_floor_us"] = driver_floor(args.parks_ms)
    out["target_met"] = all(r["target_met"] for r in out["parks"])
    return out


def report(r: dict[str, Any]) -> None:
    print(f"\n== {r['device']}, {r['loop']}: tl.signal -> await done resumed ==")
    print(f"{'park':>9}{'n':>4}{'p50 us':>10}{'max us':>10}{'CPU % p50':>11}{'max':>7}  target")
    for row in r["parks"]:
        verdict = "met" if row["target_met"] else "MISSED"
        print(
            f"{row['park_ms']:>7g}ms{row['samples']:>4}{row['p50_us']:10.1f}{row['max_us']:10.1f}"
            f"{row['park_cpu_pct_median']:11.2f}{row['park_cpu_pct_max']:7.2f}  {verdict}"
        )
    print(
        f"target: p50 <= {TARGET_P50_US:g} us; park CPU median < {100 * IDLE_CPU_LIMIT:g} % of "
        f"a core for parks >= {IDLE_CPU_FROM_MS} ms"
    )
    host = ", ".join(
        f"{p} ms: p50 {h['p50_us']:.1f} max {h['max_us']:.1f}" for p, h in r["host_wait_us"].items()
    )
    print(f"context, await tl.wait(v) on the host (us): {host}")
    floor = ", ".join(
        f"{p} ms: p50 {h['p50_us']:.1f} max {h['max_us']:.1f}"
        for p, h in r.get("asyncio_event_us", {}).items()
    )
    print(f"floor, await asyncio.Event().wait() after the same park (us): {floor}")
    for p, d in r.get("driver_floor_us", {}).items():
        print(
            f"driver floor, park {p} ms (us): a device wait released by a store "
            f"{d['device_wait_p50_us']:.1f}, the launch made at the signal "
            f"{d['launch_at_signal_p50_us']:.1f}"
        )


def main() -> None:
    import faulthandler

    faulthandler.dump_traceback_later(300, exit=True)
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--device", default="cuda:0" if "cuda:0" in am.devices() else "cpu")
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    parser.add_argument("--parks-ms", type=float, nargs="+", default=[1, 10, 100, 1000, 10000])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.loop == "uvloop":
        import uvloop

        result = uvloop.run(run(args))
    else:
        result = asyncio.run(run(args))
    report(result)
    result.update(
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        python=sys.version.split()[0],
        machine=platform.platform(),
        cpus=os.cpu_count(),
    )
    write_json(args.json, result)


if __name__ == "__main__":
    main()

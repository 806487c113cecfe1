"""What one cuda submission costs, call by call (a probe behind BENCHMARKS.md's notes).

    python benchmarks/cuda_submit_probe.py --json out.json

Times, per call, back to back on one stream: each driver function asyncmetal's native
submission makes (called through ctypes on the pointers cuGetProcAddress returns), the
native submission call, the backend hook and ``Queue.launch``; the same launch through
cuda-bindings for comparison. Then the same from C (``native_probe.c``, ``c_*`` keys): no
Python or ctypes per call, and a launch while another thread polls an event.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

from _common import write_json

import asyncmetal as am
from asyncmetal._backend import Record
from asyncmetal.backends.cuda import check, cu
from asyncmetal.backends.cuda._queue import MAX_IN_FLIGHT

EMPTY = 'extern "C" __global__ void empty() {}'


def per_call_us(fn: Callable[[], Any], sync: Callable[[], None], n: int = 5000) -> float:
    for _ in range(200):
        fn()
    sync()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / n / 1e3)
        sync()
    return best


def warm_up(fn: int, stream: Any, seconds: float = 1.0) -> None:
    """Launch for a while first: the first seconds on a fresh machine measure slower
    (3-8x the later figures, seen in this probe)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(100):
            check(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, 0, 0), "launch")
        check(cu.cuStreamSynchronize(stream), "sync")


def pointer(name: str, version: int = 12000, flags: int = 0) -> int:
    pfn = check(cu.cuGetProcAddress(name.encode(), version, flags), name)
    return int(pfn[0] if isinstance(pfn, tuple) else pfn)


async def main() -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with am.open_device("cuda:0") as dev:
        empty = await dev.compile(EMPTY, "empty")
        q = dev.new_queue()
        # The raw driver calls below run in the device's context: asyncmetal's calls give
        # the thread back the context it had (none, here).
        dev._backend.make_current()  # type: ignore[attr-defined]
        native = q._native
        stream = native.stream  # type: ignore[attr-defined]
        s = int(stream)

        def sync() -> None:
            check(cu.cuStreamSynchronize(stream), "sync")

        warm_up(empty.native, stream)

        u = ctypes.c_uint
        launch_type = ctypes.CFUNCTYPE(
            ctypes.c_int,
            ctypes.c_void_p,
            u,
            u,
            u,
            u,
            u,
            u,
            u,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
        )
        launch = launch_type(pointer("cuLaunchKernel"))
        write = ctypes.CFUNCTYPE(
            ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, u
        )(pointer("cuStreamWriteValue64"))
        record = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(
            pointer("cuEventRecord")
        )
        query = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(pointer("cuEventQuery"))
        word = q.timeline.native.address  # type: ignore[attr-defined]
        flags = cu.CUevent_flags
        ev_block = int(
            check(
                cu.cuEventCreate(flags.CU_EVENT_BLOCKING_SYNC | flags.CU_EVENT_DISABLE_TIMING), "ev"
            )
        )
        ev_plain = int(check(cu.cuEventCreate(flags.CU_EVENT_DISABLE_TIMING), "ev"))
        fn = empty.native
        out["ctypes_noop_call"] = per_call_us(lambda: query(ev_plain), sync)
        out["cuLaunchKernel"] = per_call_us(
            lambda: launch(fn, 1, 1, 1, 1, 1, 1, 0, s, None, None), sync
        )
        driver = int(check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
        out["driver_version"] = driver
        for version in (12000, driver):
            for flags in (0, 2):  # default / per-thread default stream variants
                f = launch_type(pointer("cuLaunchKernel", version, flags))
                out[f"cuLaunchKernel_v{version}_flags{flags}"] = per_call_us(
                    lambda f=f: f(fn, 1, 1, 1, 1, 1, 1, 0, s, None, None), sync
                )
        out["cuStreamWriteValue64"] = per_call_us(lambda: write(s, word, 0, 0), sync)
        out["cuEventRecord_blocking_sync"] = per_call_us(lambda: record(ev_block, s), sync)
        out["cuEventRecord_plain"] = per_call_us(lambda: record(ev_plain, s), sync)
        out["launch_write_record"] = per_call_us(
            lambda: (
                launch(fn, 1, 1, 1, 1, 1, 1, 0, s, None, None),
                write(s, word, 0, 0),
                record(ev_block, s),
            ),
            sync,
        )
        out["cuda_bindings_launch"] = per_call_us(
            lambda: cu.cuLaunchKernel(cu.CUfunction(fn), 1, 1, 1, 1, 1, 1, 0, stream, 0, 0), sync
        )
        # asyncmetal's layers (values must rise: count them)
        counter = [q.submitted]
        lib = native._lib  # type: ignore[attr-defined]
        handle = native._q  # type: ignore[attr-defined]
        ptrs = native._pointers_address  # type: ignore[attr-defined]
        dims = native._launch_dims((1, 1, 1), (1, 1, 1))  # type: ignore[attr-defined]

        def native_call() -> None:
            counter[0] += 1
            lib.am_cuq_launch(handle, fn, dims, ptrs, 0, counter[0])

        def hook() -> None:
            counter[0] += 1
            native.launch(fn, [], (1, 1, 1), (1, 1, 1), counter[0], Record(counter[0]))

        def wait_all() -> None:
            sync()
            while q.timeline.value < counter[0]:
                time.sleep(0.0001)

        out["am_cuq_launch"] = per_call_us(native_call, wait_all)
        fast = native._fast_launch  # type: ignore[attr-defined]
        if fast is not None:  # the extension module's path, then ctypes' for comparison

            def extension_call() -> None:
                counter[0] += 1
                fast(handle, fn, (1, 1, 1), (1, 1, 1), [], counter[0])

            out["extension_cuq_launch"] = per_call_us(extension_call, wait_all)
        out["backend_launch_hook"] = per_call_us(hook, wait_all)
        q._submitted = counter[0]
        out["Queue_launch"] = per_call_us(lambda: q.launch(empty), lambda: None, n=3000)
        queue_fast, q._fast_launch = q._fast_launch, None  # Python's checks, then the hook
        out["Queue_launch_python"] = per_call_us(lambda: q.launch(empty), lambda: None, n=3000)
        if fast is not None:
            native._fast_launch = None  # type: ignore[attr-defined]
            counter[0] = q.submitted
            out["backend_launch_hook_ctypes"] = per_call_us(hook, wait_all)
            q._submitted = counter[0]
            out["Queue_launch_ctypes"] = per_call_us(lambda: q.launch(empty), lambda: None, n=3000)
            native._fast_launch = fast  # type: ignore[attr-defined]
        q._fast_launch = queue_fast
        await q.synchronize()
        counter[0] = q.submitted
        out.update(native_probe(q, fn, dims, counter, ev_block, ev_plain, sync))
        q._submitted = counter[0]
        await q.synchronize()
        out["copy_1GiB"] = await copy_probe(dev, q, ev_plain)
    return out


async def copy_probe(dev: am.Device, q: am.Queue, event: int, rounds: int = 7) -> dict[str, Any]:
    """1 GiB device -> device copies timed in C, the waits alternated round by round:
    cuStreamSynchronize; an event queried every gap ns (does polling slow the copy?);
    asyncmetal's native copy + its timeline. Best and median microseconds, total and
    the copy call alone."""
    n = 1 << 30
    a, b = await dev.alloc(n), await dev.alloc(n)
    lib, native, stream = probe_handles(q)
    p = ctypes.c_void_p
    copy, record = p(pointer("cuMemcpyDtoDAsync")), p(pointer("cuEventRecord"))
    sync, query = p(pointer("cuStreamSynchronize")), p(pointer("cuEventQuery"))
    am_copy = ctypes.cast(native._lib.am_cuq_copy, p)  # type: ignore[attr-defined]
    am_spin = ctypes.cast(native._lib.am_timeline_spin, p)  # type: ignore[attr-defined]
    dst, src = ctypes.c_uint64(b._allocation.handle), ctypes.c_uint64(a._allocation.handle)
    size = ctypes.c_size_t(n)
    modes: list[str] = ["synchronize", "poll_500ns", "poll_2us", "poll_10us", "poll_50us"]
    modes.append("asyncmetal_native")
    totals: dict[str, list[float]] = {m: [] for m in modes}
    submits: dict[str, list[float]] = {m: [] for m in modes}
    submit = ctypes.c_double()
    gaps = {"synchronize": -1, "poll_500ns": 500, "poll_2us": 2000, "poll_10us": 10000}
    gaps["poll_50us"] = 50000
    for _ in range(rounds):
        for mode in modes:
            if mode == "asyncmetal_native":
                q._submitted += 1
                total = lib.probe_am_copy(
                    am_copy,
                    am_spin,
                    p(native._q),  # type: ignore[attr-defined]
                    p(q.timeline.native.c_timeline),
                    dst,
                    src,
                    size,
                    ctypes.c_uint64(q._submitted),
                    ctypes.c_long(min(n // 1000, 2_000_000)),
                    ctypes.byref(submit),
                )
            else:
                total = lib.probe_copy(
                    copy, record, p(event), sync, query, stream, dst, src, size,
                    ctypes.c_long(gaps[mode]), ctypes.byref(submit),
                )  # fmt: skip
            if total < 0:
                raise RuntimeError(f"CUresult {-total} in {mode}")
            totals[mode].append(total / 1e3)
            submits[mode].append(submit.value / 1e3)
    await a.free()
    await b.free()
    return {
        m: {
            "best_us": min(totals[m]),
            "median_us": statistics.median(totals[m]),
            "copy_call_median_us": statistics.median(submits[m]),
        }
        for m in modes
    }


def probe_handles(q: am.Queue) -> tuple[ctypes.CDLL, Any, ctypes.c_void_p]:
    """native_probe.c's library, the queue's backend queue and its stream."""
    native = q._native
    return native_library(), native, ctypes.c_void_p(int(native.stream))  # type: ignore[attr-defined]


def native_library() -> ctypes.CDLL:
    """native_probe.c, built once."""
    global _probe_lib
    if _probe_lib is None:
        here = os.path.dirname(os.path.abspath(__file__))
        target = os.path.join(tempfile.mkdtemp(), "native_probe.so")
        source = os.path.join(here, "native_probe.c")
        cmd = ["cc", "-O2", "-shared", "-fPIC", "-pthread", source, "-o", target]
        subprocess.run(cmd, check=True)
        _probe_lib = ctypes.CDLL(target)
        for name in ("probe_ctx_get", "probe_launch", "probe_am_launch", "probe_launch_polled"):
            getattr(_probe_lib, name).restype = ctypes.c_double
        for name in ("probe_launch_rotating", "probe_copy", "probe_am_copy"):
            getattr(_probe_lib, name).restype = ctypes.c_double
    return _probe_lib


_probe_lib: ctypes.CDLL | None = None


def native_probe(
    q: am.Queue,
    fn: int,
    dims: int,
    counter: list[int],
    event: int,
    done_event: int,
    sync: Callable[[], None],
) -> dict[str, float]:
    """The same calls timed in C (native_probe.c), with no Python or ctypes per call."""
    lib, native, stream = probe_handles(q)
    p = ctypes.c_void_p
    launch, record = p(pointer("cuLaunchKernel")), p(pointer("cuEventRecord"))
    sync_ptr, query = p(pointer("cuStreamSynchronize")), p(pointer("cuEventQuery"))
    ctx_set = p(pointer("cuCtxSetCurrent"))
    ctx = p(q.device._backend.context_address)  # type: ignore[attr-defined]
    am_launch = ctypes.cast(native._lib.am_cuq_launch, p)  # type: ignore[attr-defined]
    n = ctypes.c_long(5000)
    out: dict[str, float] = {}

    def best(f: Callable[[], float]) -> float:
        values = [f() for _ in range(3)]
        if min(values) < 0:
            raise RuntimeError(f"CUresult {-min(values)}")
        return min(values) / 1e3

    out["c_cuCtxGetCurrent"] = best(
        lambda: lib.probe_ctx_get(p(pointer("cuCtxGetCurrent")), ctypes.c_long(100000))
    )
    fnp = p(fn)
    out["c_cuLaunchKernel"] = best(
        lambda: lib.probe_launch(launch, None, None, sync_ptr, fnp, stream, n)
    )
    out["c_launch_and_record"] = best(  # a blocking-sync event
        lambda: lib.probe_launch(launch, record, p(event), sync_ptr, fnp, stream, n)
    )
    out["c_launch_and_record_plain_event"] = best(
        lambda: lib.probe_launch(launch, record, p(done_event), sync_ptr, fnp, stream, n)
    )
    for gap in (2000, 5000):
        out[f"c_launch_and_record_polled_every_{gap}ns"] = best(
            lambda gap=gap: lib.probe_launch_polled(
                launch,
                record,
                p(event),
                sync_ptr,
                query,
                p(done_event),
                ctx_set,
                ctx,
                ctypes.c_long(gap),
                fnp,
                stream,
                n,
            )
        )

    flags = cu.CUevent_flags
    events = (ctypes.c_void_p * 64)(
        *(
            int(
                check(
                    cu.cuEventCreate(flags.CU_EVENT_BLOCKING_SYNC | flags.CU_EVENT_DISABLE_TIMING),
                    "ev",
                )
            )
            for _ in range(64)
        )
    )
    for gap in (0, 2000, 10000):
        out[f"c_launch_and_record_64_events_polled_every_{gap}ns"] = best(
            lambda gap=gap: lib.probe_launch_rotating(
                launch,
                record,
                events,
                ctypes.c_long(64),
                sync_ptr,
                query,
                ctx_set,
                ctx,
                ctypes.c_long(gap),
                fnp,
                stream,
                n,
            )
        )

    # In batches below the queue's bound of commands in flight, each one done before the
    # next: past the bound the queue holds launches on the host, and a call then costs
    # what holding one does (~0.5 us), not a submission to the driver.
    batch = MAX_IN_FLIGHT // 2

    def am_run() -> float:
        took = 0.0
        for _ in range(n.value // batch):
            first = counter[0] + 1
            counter[0] += batch
            per = float(
                lib.probe_am_launch(
                    am_launch,
                    p(native._q),
                    fnp,
                    p(dims),  # type: ignore[attr-defined]
                    ctypes.c_uint64(first),
                    ctypes.c_long(batch),
                )
            )
            if per < 0:
                return per
            took += per * batch
            sync()
            while q.timeline.value < counter[0]:
                time.sleep(0.0001)
        return took / (n.value // batch * batch)

    out["c_am_cuq_launch"] = best(am_run)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    result = asyncio.run(main())
    for k, v in result.items():
        print(f"{k:32s} {v:8.2f} us" if isinstance(v, float) else f"{k:32s} {v}")
    write_json(args.json, {"date": time.strftime("%Y-%m-%d"), "per_call_us": result})

"""Awaiting PyTorch work with asyncmetal against the usual ways, and DLPack exchange.

    python benchmarks/interop.py --json out.json

A small PyTorch model's forward pass (its GPU time is printed, ~50 us wanted) on one
stream, awaited four ways, measured in the same run:

* ``synchronize``: ``torch.cuda.synchronize()``, blocking the loop (the latency floor);
* ``event_poll``: a ``torch.cuda.Event`` recorded behind it, ``query()`` polled from the
  loop with ``asyncio.sleep(0)``;
* ``to_thread``: ``await asyncio.to_thread(torch.cuda.synchronize)``;
* ``asyncmetal``: the stream adopted (``dev.adopt_stream``), ``await queue.marker()``.

For each: the p50 latency of one request at a time; requests/s of 64 concurrent tasks,
each submitting and awaiting in a loop (the median of three 1 s windows, the ways
alternating, with each window's rate and the median time of a PyTorch submission in the
JSON); and the loop's lag meanwhile (a 1 ms ticker's lateness, p99). Targets: p50 <=
1.25x the floor, requests/s >= 1.5x the best non-blocking peer (event_poll, to_thread),
lag p99 <= 1 ms. Flat out, the requests' own
Python (PyTorch submitting each pass on the loop) saturates the loop whichever way they
are awaited; so the lag is also measured paced, as a service sees it: requests arriving
at half the best peer's flat-out rate (at most 64 in flight), with each request's time
from arrival to done. Then
``torch.from_dlpack(buffer)`` and ``am.from_dlpack(tensor)``: the same data pointer (no
copy), and the median time of each call (target: <= 20 us), ``am.from_dlpack``'s split
into the producer's own ``__dlpack__`` (measured alone: ``stream=-1`` for a PyTorch
tensor, whose stream the default queue waits for itself) and the rest (asyncmetal's:
taking the capsule, the buffer, the ordering command; of it, the tensor's stream looked
up and the default queue's wait for that stream, each timed alone); and the same through the
protocol alone (the tensor behind a plain DLPack object: PyTorch orders its stream
before the default queue's, ``__dlpack__(stream=...)``, and a marker follows).

Flat out, no way exceeds what the one stream runs, 1 / (GPU time per pass): the JSON's
``ratios`` give each rate as a share of that ceiling. Each measurement also records the
garbage collector's pauses (``gc_count``, ``gc_max_ms``) and, paced, how long each
PyTorch submission held the loop: stalls that no way of awaiting causes or prevents.
``--gc-freeze`` calls ``gc.freeze()`` once set up, as a tuned service does.

    python benchmarks/interop.py --cpu --json out.json

runs only that split, with a numpy array on the cpu device (any machine), and the other
way, ``np.from_dlpack`` of a cpu buffer (its ``__dlpack__`` and numpy's import).

    python benchmarks/interop.py --simulated --json out.json

runs the cuda split without a GPU: over the test suite's simulated CUDA driver
(``tests/support/native/simulated_cuda.py``: the native runtime submits to it; needs a
C compiler), with a stand-in for a PyTorch CUDA tensor -- of the type ``torch.Tensor``
to asyncmetal's look-ups, its ``__dlpack__`` a capsule over simulated device memory
made at once -- so that what is left is asyncmetal's own part, as on the GPU run
with PyTorch's ``__dlpack__`` subtracted. Every mode also times asyncmetal's side of
the export, alone: ``buf.typed(...)``, its ``__dlpack_device__`` and its ``__dlpack__``
(the capsule dropped at once, so the loan ends as a consumer's would).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from _common import write_json

import asyncmetal as am

CONCURRENT = 64
LATENCY_SAMPLES = 2000
THROUGHPUT_SECONDS = 2.0  # paced, per way
ROUNDS = 3  # flat out: windows per way, the ways alternating
ROUND_SECONDS = 1.0
TARGET_GPU_US = 50
PACED_FRACTION = 0.5


def progress(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Model:
    """A small MLP's forward pass, submitted on ``stream`` (no host wait): the first of
    the widths whose pass takes at least ``TARGET_GPU_US`` of GPU time."""

    def __init__(self, torch: Any, stream: Any) -> None:
        self.torch = torch
        self.stream = stream
        self.submit_ms: list[float] = []  # how long each submission held the loop
        for width in (512, 1024, 1536, 2048, 3072, 4096):
            torch.manual_seed(0)
            self.width = width
            self.net = torch.nn.Sequential(
                torch.nn.Linear(width, 2 * width),
                torch.nn.ReLU(),
                torch.nn.Linear(2 * width, width),
            ).cuda()
            self.x = torch.randn(128, width, device="cuda")
            self.gpu_us = self._gpu_us()
            if self.gpu_us >= TARGET_GPU_US:
                break

    def submit(self) -> Any:
        t0 = time.perf_counter()
        with self.torch.cuda.stream(self.stream), self.torch.no_grad():
            out = self.net(self.x)
        self.submit_ms.append((time.perf_counter() - t0) * 1e3)
        return out

    def _gpu_us(self) -> float:
        """GPU time per pass: 100 passes queued behind a sleep, so none waits for the CPU."""
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(10):
            self.submit()
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(100_000_000)
            start.record()
            for _ in range(100):
                self.submit()
            end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) * 1e3 / 100


class Collections:
    """The garbage collector's pauses while in use (``gc.callbacks``): a full collection
    of a process holding PyTorch stops the loop like any long step does."""

    def __init__(self) -> None:
        self.pauses_ms: list[float] = []
        self._began = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.pauses_ms.append((time.perf_counter() - self._began) * 1e3)

    def __enter__(self) -> Collections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, float]:
        return {"gc_count": len(self.pauses_ms), "gc_max_ms": max(self.pauses_ms, default=0.0)}


def ways(model: Model, queue: am.Queue) -> dict[str, Callable[[], Awaitable[None]]]:
    torch = model.torch

    async def synchronize() -> None:
        model.submit()
        torch.cuda.synchronize()

    async def event_poll() -> None:
        model.submit()
        event = torch.cuda.Event()
        event.record(model.stream)
        while not event.query():
            await asyncio.sleep(0)

    async def to_thread() -> None:
        model.submit()
        await asyncio.to_thread(torch.cuda.synchronize)

    async def asyncmetal() -> None:
        model.submit()
        await queue.marker()

    return {
        "synchronize": synchronize,
        "event_poll": event_poll,
        "to_thread": to_thread,
        "asyncmetal": asyncmetal,
    }


async def latencies_us(fns: dict[str, Callable[[], Awaitable[None]]]) -> dict[str, float]:
    """p50 of one request at a time, in alternating rounds (drift hits all alike)."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(100):
            await fn()
    for _ in range(10):
        for name, fn in fns.items():
            for _ in range(LATENCY_SAMPLES // 10):
                t0 = time.perf_counter_ns()
                await fn()
                samples[name].append((time.perf_counter_ns() - t0) / 1e3)
    return {name: statistics.median(times) for name, times in samples.items()}


async def concurrent(
    model: Model, fn: Callable[[], Awaitable[None]]
) -> tuple[float, list[float], list[float], list[float]]:
    """One window of CONCURRENT tasks awaiting ``fn`` in a loop: requests/s, the loop's
    lag (a 1 ms ticker's lateness, ms), the garbage collector's pauses (ms) and each
    PyTorch submission's time (ms)."""
    lags: list[float] = []
    count = 0
    stop = time.perf_counter() + ROUND_SECONDS

    async def worker() -> None:
        nonlocal count
        while time.perf_counter() < stop:
            await fn()
            count += 1

    async def ticker() -> None:
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(max(0.0, time.perf_counter() - t0 - 0.001) * 1e3)

    model.submit_ms.clear()
    start = time.perf_counter()
    with Collections() as collections:
        await asyncio.gather(ticker(), *(worker() for _ in range(CONCURRENT)))
    elapsed = time.perf_counter() - start
    return count / elapsed, lags, collections.pauses_ms, list(model.submit_ms)


async def concurrent_rounds(
    model: Model,
    fns: dict[str, Callable[[], Awaitable[None]]],
    counters: dict[str, Callable[[], dict[str, int]]],
) -> dict[str, dict[str, Any]]:
    """Each way flat out in ROUNDS windows, the ways alternating (a machine's drift
    within the run hits all alike): requests/s of each window and their median; the
    lag, the collections and the submissions over all of its windows; for a way with
    ``counters`` (asyncmetal's adopted queue: its completion thread's), what they
    counted over its windows."""
    raw: dict[str, list[tuple[float, list[float], list[float], list[float]]]] = {
        name: [] for name in fns
    }
    counted: dict[str, dict[str, int]] = {name: {} for name in counters}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            before = counters[name]() if name in counters else {}
            raw[name].append(await concurrent(model, fn))
            for key, value in (counters[name]() if name in counters else {}).items():
                counted[name][key] = counted[name].get(key, 0) + value - before[key]
    out = {}
    for name, windows in raw.items():
        rates = [w[0] for w in windows]
        lags = [x for w in windows for x in w[1]]
        pauses = [x for w in windows for x in w[2]]
        submits = [x for w in windows for x in w[3]]
        out[name] = {
            "gc_count": len(pauses),
            "gc_max_ms": max(pauses, default=0.0),
            "requests_per_s": statistics.median(rates),
            "requests_per_s_rounds": rates,
            "submit_p50_us": percentile(submits, 0.5) * 1e3,
            "lag_p50_ms": percentile(lags, 0.5),
            "lag_p99_ms": percentile(lags, 0.99),
            "lag_max_ms": max(lags),
        }
        if name in counted:
            out[name]["completion_thread"] = counted[name]
    return out


def completion_counters(queue: am.Queue) -> Callable[[], dict[str, int]]:
    """The counters of ``queue``'s completion thread (a cuda queue's): event queries,
    waits blocked on a blocking-sync event or napping on a plain one, events made."""
    stats = queue._native.stats  # type: ignore[attr-defined]
    keys = ("queries", "blocking_waits", "napping_waits", "events_made")

    def read() -> dict[str, int]:
        now = stats()
        return {key: int(now[key]) for key in keys}

    return read


async def paced(model: Model, fn: Callable[[], Awaitable[None]], rate: float) -> dict[str, float]:
    """Requests arriving at ``rate`` per second (at most CONCURRENT in flight; an arrival
    finding them all busy is dropped and counted), as a service sees them: the loop's lag
    (a 1 ms ticker) and each request's time from arrival to done. The arrivals come as a
    socket's would, from outside the loop: a thread hands each to the loop
    (``call_soon_threadsafe``) at its time, evenly spaced. (Made on the loop by a task
    sleeping between them, they would come in bursts wherever the loop sleeps in
    whole milliseconds, as asyncio's epoll rounds a sleep up: a 0.5 ms sleep's arrivals
    came six at a time, their submissions one iteration of 0.5 ms.)"""
    lags: list[float] = []
    latencies: list[float] = []
    dropped = 0
    in_flight = 0
    start = time.perf_counter()
    stop = start + THROUGHPUT_SECONDS

    async def request(arrived: float) -> None:
        nonlocal in_flight
        try:
            await fn()
            latencies.append((time.perf_counter() - arrived) * 1e3)
        finally:
            in_flight -= 1

    async def ticker() -> None:
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(max(0.0, time.perf_counter() - t0 - 0.001) * 1e3)

    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = []

    def arrive(arrived: float) -> None:
        nonlocal dropped, in_flight
        if in_flight >= CONCURRENT:
            dropped += 1
            return
        in_flight += 1
        tasks.append(loop.create_task(request(arrived)))

    def arrivals() -> None:
        n = 0
        while (at := start + n / rate) < stop:
            ahead = at - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)
            loop.call_soon_threadsafe(arrive, at)
            n += 1

    model.submit_ms.clear()
    with Collections() as collections:
        await asyncio.gather(ticker(), asyncio.to_thread(arrivals))
        await asyncio.gather(*tasks)
    return {
        **collections.summary(),
        # the requests' own PyTorch submissions, on the loop, and the garbage
        # collector's pauses: stalls of the loop that no way of awaiting causes or prevents
        "submit_p99_ms": percentile(model.submit_ms, 0.99),
        "submit_max_ms": max(model.submit_ms),
        "offered_per_s": rate,
        "completed_per_s": len(latencies) / (time.perf_counter() - start),
        "dropped": dropped,
        "latency_p50_ms": percentile(latencies, 0.5),
        "latency_p99_ms": percentile(latencies, 0.99),
        "lag_p50_ms": percentile(lags, 0.5),
        "lag_p99_ms": percentile(lags, 0.99),
        "lag_max_ms": max(lags),
    }


def median_call_us(fn: Callable[[], Any], n: int = 2000) -> float:
    for _ in range(100):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


class _Protocol:
    """``array`` seen through the DLPack protocol alone (no longer a PyTorch tensor):
    ``am.from_dlpack`` then asks the producer to order its work itself."""

    def __init__(self, array: Any) -> None:
        self.array = array

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self.array.__dlpack_device__()


def from_dlpack_split(dev: am.Device, array: Any, n: int = 2000) -> dict[str, float]:
    """The median time of ``am.from_dlpack(array)`` on ``dev``, of the producer's own
    ``__dlpack__`` as it is called there (on cuda: with ``stream=-1`` for a PyTorch
    tensor, whose stream the default queue then waits for itself; else the stream of
    ``dev``'s default queue, for the producer to order. The capsule then dropped, so
    its deleter runs as the buffer's does), and the rest. For a PyTorch tensor also the
    protocol's own way, measured the same: ``am.from_dlpack`` of the tensor behind a
    plain DLPack object, and its ``__dlpack__(stream=<the default queue's>)``."""
    torch = sys.modules.get("torch")
    is_torch = dev.kind == "cuda" and torch is not None and isinstance(array, torch.Tensor)

    def produce(stream: int | None) -> Callable[[], Any]:
        def call() -> Any:
            try:
                return array.__dlpack__(stream=stream, max_version=(1, 1))
            except TypeError:  # a producer before max_version: as am.from_dlpack calls it
                return array.__dlpack__(stream=stream)

        return call

    ordered = dev.queue.handle if dev.kind == "cuda" else None
    producer = median_call_us(produce(-1 if is_torch else ordered), n)
    total = median_call_us(lambda: am.from_dlpack(array), n)
    out = {"am_from_dlpack_us": total, "producer_dlpack_us": producer, "rest_us": total - producer}
    if is_torch:
        # Its other parts, alone: the tensor's stream looked up, and the default queue's
        # wait for that stream (an event recorded there, waited for in the queue's order).
        from asyncmetal import _interop

        handle = _interop._torch_stream(array)
        out["stream_lookup_us"] = median_call_us(lambda: _interop._torch_stream(array), n)
        if handle is not None:
            out["queue_wait_us"] = median_call_us(lambda: dev.queue._after_stream(handle), n)
            # What is left: asyncmetal's own bookkeeping (the capsule taken, the record of
            # uses found, the buffer made, its device looked up; the buffer then dropped).
            out["bookkeeping_us"] = out["rest_us"] - out["stream_lookup_us"] - out["queue_wait_us"]
        plain = _Protocol(array)
        protocol = median_call_us(lambda: am.from_dlpack(plain), n)
        protocol_producer = median_call_us(produce(ordered), n)
        out.update(
            protocol_am_from_dlpack_us=protocol,
            protocol_producer_dlpack_us=protocol_producer,
            protocol_rest_us=protocol - protocol_producer,
        )
    return out


def export_split(typed: Any, stream: int | None, n: int = 2000) -> dict[str, float]:
    """asyncmetal's side of an export of ``typed`` (a buffer's typed view), each part
    alone, as a consumer calls them: the view made, its ``__dlpack_device__``, its
    ``__dlpack__(stream=stream, max_version=(1, 1))`` (the capsule dropped at once, so
    that the loan ends as it does once a consumer lets go)."""
    buf, dtype = typed.buffer, typed.dtype
    return {
        "typed_view_us": median_call_us(lambda: buf.typed(dtype), n),
        "export_dlpack_device_us": median_call_us(typed.__dlpack_device__, n),
        "export_dlpack_us": median_call_us(
            lambda: typed.__dlpack__(stream=stream, max_version=(1, 1)), n
        ),
    }


async def dlpack(dev: am.Device, torch: Any) -> dict[str, Any]:
    buf = await dev.alloc(4 << 20)
    typed = buf.typed(np.float32)
    address = buf.__cuda_array_interface__["data"][0]
    tensor = torch.from_dlpack(typed)
    tensor_in = torch.ones(1 << 20, device="cuda:0")
    wrapped = am.from_dlpack(tensor_in)
    consumer = torch.cuda.current_stream().cuda_stream or 1  # (as torch.from_dlpack asks)
    out = {
        "torch_from_dlpack_same_pointer": tensor.data_ptr() == address,
        "am_from_dlpack_same_pointer": (
            wrapped.__cuda_array_interface__["data"][0] == tensor_in.data_ptr()
        ),
        "torch_from_dlpack_us": median_call_us(lambda: torch.from_dlpack(typed)),
        **export_split(typed, consumer),
        **from_dlpack_split(dev, tensor_in),
    }
    await dev.synchronize()
    return out


async def run(gc_freeze: bool = False) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "concurrent": CONCURRENT}
    async with am.open_device("cuda:0") as dev:
        stream = torch.cuda.Stream()
        model = Model(torch, stream)
        queue = dev.adopt_stream(stream)
        if gc_freeze:  # what a tuned service does once set up: no full collection
            gc.collect()  # walks PyTorch's and CuPy's objects again and again
            gc.freeze()
        out["gc_frozen"] = gc_freeze
        out["forward_gpu_us"], out["model_width"] = model.gpu_us, model.width
        progress(f"forward pass (width {model.width}): {model.gpu_us:.1f} us of GPU time")
        fns = ways(model, queue)
        out["p50_us"] = await latencies_us(fns)
        progress(f"p50 us: {out['p50_us']}")
        counters = {"asyncmetal": completion_counters(queue)}
        out["concurrent_results"] = await concurrent_rounds(model, fns, counters)
        for name, result in out["concurrent_results"].items():
            progress(f"{name}: {result}")
        p50, conc = out["p50_us"], out["concurrent_results"]
        best_peer = max(conc["event_poll"]["requests_per_s"], conc["to_thread"]["requests_per_s"])
        # The same offered load for every way: half what the best non-blocking peer
        # sustains flat out, so that the loop is not saturated by the requests' own Python.
        rate = PACED_FRACTION * best_peer
        out["paced_results"] = {}
        for name, fn in fns.items():
            if name != "synchronize":  # it blocks the loop: nothing to pace
                out["paced_results"][name] = result = await paced(model, fn, rate)
                progress(f"paced {name}: {result}")
        paced_results = out["paced_results"]
        out["ratios"] = {
            "p50_vs_synchronize": p50["asyncmetal"] / p50["synchronize"],
            "requests_per_s_vs_best_nonblocking_peer": conc["asyncmetal"]["requests_per_s"]
            / best_peer,
            # One stream runs the passes one after another: no way exceeds this rate.
            "best_peer_vs_gpu_bound": best_peer * model.gpu_us / 1e6,
            "requests_per_s_vs_gpu_bound": conc["asyncmetal"]["requests_per_s"]
            * model.gpu_us
            / 1e6,
            "lag_p99_ms": conc["asyncmetal"]["lag_p99_ms"],
            "to_thread_lag_p99_ms": conc["to_thread"]["lag_p99_ms"],
            "paced_lag_p99_ms": paced_results["asyncmetal"]["lag_p99_ms"],
            "paced_to_thread_lag_p99_ms": paced_results["to_thread"]["lag_p99_ms"],
            "paced_event_poll_lag_p99_ms": paced_results["event_poll"]["lag_p99_ms"],
        }
        out["dlpack"] = await dlpack(dev, torch)
        progress(f"ratios: {out['ratios']}")
        progress(f"dlpack: {out['dlpack']}")
    return out


async def run_cpu() -> dict[str, Any]:
    """``am.from_dlpack``'s split with a numpy array on the cpu device, and
    ``np.from_dlpack`` of a cpu buffer; then ``am.from_dlpack`` of a new array each
    call beside many buffers (``crowded``)."""
    async with am.open_device("cpu") as dev:
        split = from_dlpack_split(dev, np.zeros((64, 64), np.float32))
        buf = await dev.alloc(64 * 64 * 4)
        typed = buf.typed(np.float32, (64, 64))
        split["np_from_dlpack_us"] = median_call_us(lambda: np.from_dlpack(typed))
        split.update(export_split(typed, None))
        await buf.free()
        progress(f"dlpack: {split}")
        crowd = await crowded(dev)
    progress(f"crowded: {crowd}")
    return {"device": "cpu", "dlpack": split, "crowded": crowd}


async def crowded(dev: am.Device, sizes: tuple[int, ...] = (0, 1000, 5000)) -> dict[str, Any]:
    """The median time of ``am.from_dlpack`` of a new numpy array each call (the buffer
    then dropped), beside N buffers whose memory went out (``np.from_dlpack`` of each,
    the arrays kept: memory coming back is looked up among them), and beside N
    buffers over small arrays and one over a 256 MiB array (the records of foreign
    memory a new array's is looked up among)."""
    fresh = [np.zeros(64, np.float32) for _ in range(2000)]

    def imports() -> float:
        times = []
        for array in fresh:
            t0 = time.perf_counter_ns()
            am.from_dlpack(array)
            times.append(time.perf_counter_ns() - t0)
        return statistics.median(times) / 1e3

    out: dict[str, Any] = {"lent_out_us": {}, "imported_beside_a_large_one_us": {}}
    for n in sizes:
        buffers = [await dev.alloc(256) for _ in range(n)]
        arrays = [np.from_dlpack(b.typed(np.uint8)) for b in buffers]
        out["lent_out_us"][n] = imports()
        del arrays
        for b in buffers:
            await b.free()
        small = [np.zeros(64, np.float32) for _ in range(n)]
        large = np.zeros(1 << 28, np.uint8)
        kept = [am.from_dlpack(a) for a in (large, *small)]
        out["imported_beside_a_large_one_us"][n] = imports()
        del kept, large, small
    return out


def run_simulated() -> dict[str, Any]:
    """The cuda split (``dlpack``'s, less PyTorch's own calls) over the simulated CUDA
    driver, with a stand-in for a PyTorch CUDA tensor (see the module's docstring)."""
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (the tests' support)
    from tests.support.native.simulated_cuda import _install, _Simulated

    with tempfile.TemporaryDirectory(prefix="asyncmetal-interop-") as tmp:
        sim = _Simulated(Path(tmp))
        _install(sim)
        stream = sim.fake.stream_new()  # the stand-in tensor's current stream
        kept = sys.modules.get("torch")
        sys.modules["torch"] = _stand_in_torch(stream)
        try:
            return asyncio.run(_simulated(sim))
        finally:
            if kept is None:
                sys.modules.pop("torch", None)
            else:
                sys.modules["torch"] = kept
            sim.fake.stream_free(stream, 0)


def _stand_in_torch(stream: int) -> Any:
    """A module ``torch`` with what asyncmetal's import asks of a CUDA tensor: its type
    ``Tensor`` (``is_cuda``, ``get_device()``, DLPack's methods: a capsule over its
    memory on cuda:0, made at once, no ordering of its own), ``version.hip`` and the
    current stream's raw handle (``stream``)."""
    import types

    from asyncmetal import _dlpack

    make = _dlpack._maker()  # (the extension's, once a device has loaded the runtime)

    class Tensor:
        is_cuda = True
        device = "cuda:0"

        def __init__(self, address: int, count: int) -> None:
            self.address, self.count = address, count

        def get_device(self) -> int:
            return 0

        def __dlpack_device__(self) -> tuple[int, int]:
            return (_dlpack.KDLCUDA, 0)

        def __dlpack__(self, stream: Any = None, max_version: Any = None) -> object:
            versioned = max_version is not None and tuple(max_version) >= (1, 0)
            return make(
                self.address, 0, _dlpack.KDLCUDA, 0, 2, 32, (self.count,), versioned, 0, _kept
            )

    torch = types.ModuleType("torch")
    torch.Tensor = Tensor  # type: ignore[attr-defined]
    torch.version = types.SimpleNamespace(hip=None)  # type: ignore[attr-defined]
    torch._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda index: stream)  # type: ignore[attr-defined]
    torch.__version__ = "stand-in"
    return torch


def _kept(*held: object) -> None:
    """A stand-in tensor's capsule's release: its memory is the benchmark's."""


async def _simulated(sim: Any) -> dict[str, Any]:
    torch = sys.modules["torch"]
    count = 1 << 20
    async with am.open_device("cuda:0") as dev:
        # As ``dlpack``: a buffer lent out (a consumer holds its capsule), and the first
        # import of the tensor kept, as an application's would be.
        buf = await dev.alloc(4 * count)
        typed = buf.typed(np.float32)
        lent = typed.__dlpack__(stream=1, max_version=(1, 1))
        address = sim.fake.fake_mem_alloc(4 * count)
        tensor_in = torch.Tensor(address, count)
        wrapped = am.from_dlpack(tensor_in)
        out = {
            "torch": torch.__version__,
            "am_from_dlpack_same_pointer": (wrapped.__cuda_array_interface__["data"][0] == address),
            **export_split(typed, 1),
            **from_dlpack_split(dev, tensor_in),
        }
        progress(f"dlpack (simulated cuda): {out}")
        await dev.synchronize()
        del lent, wrapped
        await buf.free()
    sim.fake.fake_mem_free(address)
    return {"device": "cuda:0 (simulated driver)", "dlpack": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--cpu", action="store_true", help="only from_dlpack's split, on cpu")
    parser.add_argument(
        "--simulated",
        action="store_true",
        help="only the cuda DLPack split, over the simulated CUDA driver (no GPU)",
    )
    parser.add_argument(
        "--gc-freeze", action="store_true", help="gc.freeze() once set up (no full collections)"
    )
    args = parser.parse_args()
    if args.simulated:
        result = run_simulated()
    else:
        result = asyncio.run(run_cpu() if args.cpu else run(args.gc_freeze))
    write_json(args.json, result)


if __name__ == "__main__":
    main()

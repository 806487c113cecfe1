"""Interop on an NVIDIA GPU (`pytest -m cuda`): PyTorch and CuPy share buffers with
asyncmetal both ways (the same memory, ordered on the device), their streams adopted
and awaited, and the calling thread's current CUDA context left as it was after every
public call."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am

GPUS = [d for d in am.devices() if d.startswith("cuda:")]
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.anyio,
    pytest.mark.skipif(not GPUS, reason="no NVIDIA GPU with cuda-bindings on this machine"),
]


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


needs_torch = pytest.mark.skipif(not _importable("torch"), reason="needs PyTorch")
needs_cupy = pytest.mark.skipif(not _importable("cupy"), reason="needs CuPy")

KERNELS = r"""
extern "C" __global__ void fill(int* out, int value, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}
extern "C" __global__ void sleep_us(int us) {
    long long start = clock64();
    long long cycles = (long long)us * 1800;  // ~1.8 GHz
    while (clock64() - start < cycles) {}
}
"""
N = 1 << 16
GRID = {"global_size": N, "local_size": 256}
SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep: ~100 ms on an H200


async def _await(completion: am.Completion) -> None:
    await completion


async def _kernels(dev: am.Device) -> tuple[am.Program, am.Program]:
    return await dev.compile(KERNELS, "fill"), await dev.compile(KERNELS, "sleep_us")


def _address(buf: Any) -> int:
    return int(buf.__cuda_array_interface__["data"][0])


@needs_torch
async def test_torch_shares_a_buffer_both_ways(anyio_backend: object) -> None:
    import torch

    async with am.open_device("cuda:0") as dev:
        fill, sleep = await _kernels(dev)
        buf = await dev.alloc(4 * N)
        torch.from_dlpack(buf)  # the first export: done before timing
        dev.queue.launch(sleep, vals=(50_000,))
        dev.queue.launch(fill, buf, vals=(7, N), **GRID)  # not awaited: torch's stream waits
        start = time.perf_counter()
        tensor = torch.from_dlpack(buf.typed(np.int32))
        assert time.perf_counter() - start < 0.02  # ordered on the device, no host block
        assert tensor.data_ptr() == _address(buf) and tensor.dtype == torch.int32
        assert int(tensor.sum()) == 7 * N  # torch read what asyncmetal wrote
        tensor.fill_(3)  # torch writes on its stream; asyncmetal awaits that stream
        await dev.adopt_stream(torch.cuda.current_stream()).marker()
        assert (await buf.read(np.int32) == 3).all()
        raw = torch.from_dlpack(buf)
        assert raw.dtype == torch.uint8 and raw.numel() == 4 * N
        # The tensor holds the memory: freed and allocated again, it is not reused.
        await buf.free()
        again = await dev.alloc(4 * N)
        await dev.queue.launch(fill, again, vals=(0, N), **GRID)
        assert int(tensor.sum()) == 3 * N
        del tensor, raw
        gc.collect()
        assert dev.memory_statistics().in_use == 4 * N  # returned once torch let go


@needs_torch
async def test_a_round_trip_through_torch_is_ordered_with_its_buffer(
    anyio_backend: object,
) -> None:
    """A buffer's memory back from PyTorch shares the buffer's record of uses: a read of
    the buffer comes after a long write of the alias on another queue."""
    import torch

    async with am.open_device("cuda:0") as dev:
        fill, sleep = await _kernels(dev)
        buf = await dev.alloc(4 * N)
        await dev.queue.launch(fill, buf, vals=(1, N), **GRID)
        alias = am.from_dlpack(torch.from_dlpack(buf.typed(np.int32)))
        assert _address(alias) == _address(buf)
        queue = dev.new_queue()
        queue.launch(sleep, vals=(50_000,))  # ~50 ms
        queue.launch(fill, alias, vals=(2, N), **GRID)
        assert (await buf.read(np.int32) == 2).all()


@needs_torch
async def test_a_torch_tensor_comes_in_without_a_copy(anyio_backend: object) -> None:
    import torch

    async with am.open_device("cuda:0") as dev:
        fill, _ = await _kernels(dev)
        tensor = torch.empty(N, dtype=torch.int32, device="cuda:0")
        tensor.fill_(0)
        am.from_dlpack(tensor)  # the first import: done before timing
        torch.cuda._sleep(SLEEP_CYCLES)  # the producer's work is still running ...
        tensor.fill_(5)
        start = time.perf_counter()
        buf = am.from_dlpack(tensor)
        elapsed = time.perf_counter() - start
        assert elapsed < 0.02, elapsed  # ... and nothing waited for it on the host
        assert _address(buf) == tensor.data_ptr() and buf.nbytes == 4 * N
        assert (await buf.read(np.int32) == 5).all()  # ordered after torch's fill
        await dev.queue.launch(fill, buf, vals=(9, N), **GRID)
        assert int(tensor.sum()) == 9 * N
        view = am.from_dlpack(tensor[1024:2048])
        assert _address(view) == tensor.data_ptr() + 4096
        del tensor
        gc.collect()
        assert (await buf.read(np.int32) == 9).all()  # the buffer keeps the tensor alive


@needs_torch
async def test_a_dropped_tensor_buffer_keeps_the_memory_from_torch_until_its_kernel_ran(
    anyio_backend: object,
) -> None:
    """A buffer over a tensor, dropped with the tensor while a kernel writing it is still
    to run: PyTorch does not hand the memory out again until the kernel ran -- a tensor
    made meanwhile is elsewhere, and the kernel's writes land in the old memory only."""
    import torch

    async with am.open_device("cuda:0") as dev:
        fill, _ = await _kernels(dev)
        tensor = torch.zeros(N, dtype=torch.int32, device="cuda:0")
        address = tensor.data_ptr()
        buf = am.from_dlpack(tensor)
        queue = dev.new_queue()
        gate = dev.timeline()
        queue.wait(gate, 1)
        queue.launch(fill, buf, vals=(7, N), **GRID)
        del buf, tensor
        gc.collect()
        again = torch.zeros(N, dtype=torch.int32, device="cuda:0")
        assert again.data_ptr() != address  # the memory is still the kernel's
        held = torch.cuda.memory_allocated()
        gate.signal(1)
        await queue.synchronize()
        assert int(again.sum()) == 0
        await (await dev.alloc(64)).free()  # (an allocation lets go of what ran)
        gc.collect()
        assert torch.cuda.memory_allocated() == held - 4 * N  # PyTorch has it back


@needs_torch
async def test_producer_streams_are_waited_for_without_adopting_them(
    anyio_backend: object,
) -> None:
    """A tensor made on a torch stream of its own (current while it is imported), and
    an ``__cuda_array_interface__`` object naming its stream: the default queue waits
    for each on the device, the host does not, and neither stream becomes a queue."""
    import torch

    stream = torch.cuda.Stream()
    async with am.open_device("cuda:0") as dev:
        tensor = torch.zeros(N, dtype=torch.int32, device="cuda:0")
        with torch.cuda.stream(stream):  # the first import and read: before counting
            await am.from_dlpack(tensor).read(np.int32)
        threads = _threads()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            tensor.fill_(5)
            start = time.perf_counter()
            buf = am.from_dlpack(tensor)
            assert time.perf_counter() - start < 0.02  # nothing waited on the host
        assert (await buf.read(np.int32) == 5).all()  # ordered after the fill on `stream`
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            tensor.fill_(7)

        class Interface:
            def __init__(self) -> None:
                self.__cuda_array_interface__ = {
                    **tensor.__cuda_array_interface__,
                    "stream": stream.cuda_stream,
                }
                self.tensor = tensor

        wrapped = am.from_dlpack(Interface())
        assert _address(wrapped) == tensor.data_ptr()
        assert (await wrapped.read(np.int32) == 7).all()
        assert not dev._adopted and _threads() == threads


def _threads() -> int:
    """The process's threads (a completion thread is one of them)."""
    return len(os.listdir("/proc/self/task"))


async def _consumed_on_own_streams(
    dev: am.Device, on_stream: Callable[[int], Any], take: Callable[[Any], Any], rounds: int = 4
) -> None:
    """Before each of ``rounds`` consumers, on a stream of its own (``with on_stream(i)``
    makes stream ``i`` current; ``take`` is the library's from_dlpack, which passes that
    stream), a long kernel then a fill write the buffer: the first round's fill is
    submitted at once, later rounds' are held on the host behind more than MAX_IN_FLIGHT
    long kernels. Each consumer sees its fill's values, taking the buffer blocks nothing
    on the host, and no queue or thread is made per consumer stream."""
    fill, sleep = await _kernels(dev)
    buf = await dev.alloc(4 * N)
    view = buf.typed(np.int32)

    def consume(i: int) -> int:
        with on_stream(i):
            start = time.perf_counter()
            array = take(view)
            assert time.perf_counter() - start < 0.02  # ordered on the device
            return int(array.sum())  # reading the sum waits for it

    consume(rounds)  # the consumer library's start-up (its threads): before counting
    await dev.queue.marker()
    queues, threads = len(dev._queues), _threads()
    for i in range(rounds):
        if i == 0:
            dev.queue.launch(sleep, vals=(50_000,))  # ~50 ms
        else:
            for _ in range(40):  # > MAX_IN_FLIGHT: the fill waits on the host
                dev.queue.launch(sleep, vals=(1_000,))
        dev.queue.launch(fill, buf, vals=(i + 1, N), **GRID)
        assert consume(i) == (i + 1) * N, i
    assert len(dev._queues) == queues  # no queue per consumer stream ...
    assert _threads() == threads  # ... and no completion thread
    await dev.queue.marker()


@needs_torch
async def test_torch_consumes_on_its_own_streams_after_a_long_kernel(anyio_backend: object) -> None:
    import torch

    streams = [torch.cuda.Stream() for _ in range(5)]
    async with am.open_device("cuda:0") as dev:
        await _consumed_on_own_streams(
            dev, lambda i: torch.cuda.stream(streams[i]), torch.from_dlpack
        )


@needs_cupy
async def test_cupy_consumes_on_its_own_streams_after_a_long_kernel(anyio_backend: object) -> None:
    import cupy

    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(5)]
    async with am.open_device("cuda:0") as dev:
        await _consumed_on_own_streams(dev, lambda i: streams[i], cupy.from_dlpack)


class _InterfaceOnly:
    """A producer of ``__cuda_array_interface__`` alone."""

    def __init__(self, array: Any) -> None:
        self.__cuda_array_interface__ = array.__cuda_array_interface__
        self.array = array


@needs_cupy
async def test_cupy_shares_buffers_both_ways(anyio_backend: object) -> None:
    import cupy

    async with am.open_device("cuda:0") as dev:
        fill, _ = await _kernels(dev)
        buf = await dev.alloc(4 * N)
        dev.queue.launch(fill, buf, vals=(4, N), **GRID)
        through_dlpack = cupy.from_dlpack(buf.typed(np.int32))
        assert through_dlpack.data.ptr == _address(buf)
        assert int(through_dlpack.sum()) == 4 * N
        await dev.queue.marker()
        through_interface = cupy.asarray(buf.typed(np.int32, (N // 256, 256)))
        assert through_interface.data.ptr == _address(buf)
        assert through_interface.shape == (N // 256, 256)
        through_interface[0, :] = -1
        cupy.cuda.get_current_stream().synchronize()
        assert (await buf.read(np.int32))[:256].tolist() == [-1] * 256

        array = cupy.arange(N, dtype=cupy.int32)
        wrapped = am.from_dlpack(array)
        assert _address(wrapped) == array.data.ptr
        assert (await wrapped.read(np.int32)).tolist() == list(range(N))

        second = cupy.full(N, 6, dtype=cupy.int32)
        wrapped = am.from_dlpack(_InterfaceOnly(second))
        assert _address(wrapped) == second.data.ptr
        await dev.queue.launch(fill, wrapped, vals=(8, N), **GRID)
        assert int(second.sum()) == 8 * N


@needs_torch
async def test_an_adopted_torch_stream_is_awaited(anyio_backend: object) -> None:
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # torch's kernels loaded before the timing
        out = torch.ones(N, device="cuda:0") * 2
    stream.synchronize()
    async with am.open_device("cuda:0") as dev:
        queue = dev.adopt_stream(stream)
        assert dev.adopt_stream(stream) is queue and queue.handle == stream.cuda_stream
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            out = torch.ones(N, device="cuda:0") * 2
        # The marker is held behind a wait the test signals once it saw what it checks
        # (held on the host: torch's stream goes on), not behind the sleep's length.
        gate = dev.timeline()
        queue.wait(gate, 1)
        marker = queue.marker()
        assert not marker.done()
        by_watchdog = threading.Event()

        def watchdog() -> None:  # (an await blocking the loop would wait for good)
            by_watchdog.set()
            gate.signal(1)

        timer = threading.Timer(60, watchdog)
        timer.start()
        try:
            ticks = 0
            async with anyio.create_task_group() as tg:
                with anyio.move_on_after(0.002):  # cancelled: detaches this waiter only
                    await marker
                tg.start_soon(_await, marker)
                while ticks < 5:  # the loop runs while a task awaits the marker
                    await anyio.sleep(0.001)
                    ticks += 1
                assert not marker.done()
                gate.signal(1)
        finally:
            timer.cancel()
            if not gate.value:
                gate.signal(1)  # (a failed check leaves nothing held)
        assert not by_watchdog.is_set()
        assert stream.query()  # the marker covered torch's work before it
        assert float(out.sum()) == 2 * N
        # asyncmetal's commands on the adopted stream run in its order
        fill, _ = await _kernels(dev)
        buf = am.from_dlpack(out)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            out.fill_(1)
        done = queue.after(buf).launch(fill, buf, vals=(0, N), **GRID)
        await done
        assert float(out.sum()) == 0
    # closing the device left the stream to torch
    with torch.cuda.stream(stream):
        out.fill_(4)
    stream.synchronize()
    assert float(out.sum()) == 4 * N


@needs_cupy
async def test_an_adopted_cupy_stream_is_awaited(anyio_backend: object) -> None:
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    async with am.open_device("cuda:0") as dev:
        queue = dev.adopt_stream(stream)
        with stream:
            big = cupy.ones((4096, 4096), dtype=cupy.float32)
            for _ in range(4):
                big = big @ big / 4096
        await queue.marker()
        assert stream.done
        assert float(big[0, 0]) == pytest.approx(1.0)


async def test_what_adopt_stream_refuses(anyio_backend: object) -> None:
    async with am.open_device("cuda:0") as dev:
        with pytest.raises(am.InvalidArgumentError, match="per-thread"):
            dev.adopt_stream(2)
        with pytest.raises(am.ArgumentTypeError, match="adopt_stream takes"):
            dev.adopt_stream("stream")
        legacy = dev.adopt_stream(1)
        await legacy.marker()


async def test_memory_lent_out_past_a_close_is_freed_when_the_consumer_lets_go(
    anyio_backend: object,
) -> None:
    """A buffer exported (an unconsumed DLPack capsule) as its device closes stays
    allocated while the capsule lives, and is freed (cuMemFree, on a thread of its own:
    the device's freer has stopped) once it goes: the GPU's free memory comes back
    (before, it stayed allocated until the process exited)."""
    from cuda.bindings import driver as cu

    size = 512 << 20
    gpu = cu.cuDeviceGet(0)[1]
    context = cu.cuDevicePrimaryCtxRetain(gpu)[1]
    (err,) = cu.cuCtxPushCurrent(context)  # (for cuMemGetInfo; taken off below)
    assert int(err) == 0
    try:
        dev = await am.open_device("cuda:0")
        buf = await dev.alloc(size)
        capsule = buf.__dlpack__(stream=-1)
        await dev.close()
        held = int(cu.cuMemGetInfo()[1])
        del capsule, buf
        gc.collect()
        with anyio.fail_after(10):
            while int(cu.cuMemGetInfo()[1]) < held + size // 2:
                await anyio.sleep(0.01)
        assert dev._backend.live_allocations == 0
    finally:
        cu.cuCtxPopCurrent()
        cu.cuDevicePrimaryCtxRelease(gpu)


def _current() -> int:
    from cuda.bindings import driver as cu

    return int(cu.cuCtxGetCurrent()[1])


def _set_current(context: Any) -> None:
    """Make ``context`` (or, CUcontext(0), none at all) the thread's only context: the
    thread's context stack emptied first (setting NULL pops one off it)."""
    from cuda.bindings import driver as cu

    while _current():
        (err, _) = cu.cuCtxPopCurrent()
        assert int(err) == 0
    if int(context):
        (err,) = cu.cuCtxPushCurrent(context)
        assert int(err) == 0
    assert _current() == int(context)


def _other_context() -> Any:
    """A context of cuda:0 that is not its primary one (current on this thread)."""
    from cuda.bindings import driver as cu

    device = cu.cuDeviceGet(0)[1]
    try:
        err, context = cu.cuCtxCreate(None, 0, device)  # CUDA 13
    except TypeError:
        err, context = cu.cuCtxCreate(0, device)  # CUDA 12
    assert int(err) == 0
    return context


async def test_a_producer_stream_of_another_context_is_refused(anyio_backend: object) -> None:
    """An array whose ``__cuda_array_interface__`` names a stream of a context of cuda:0
    that is not its primary one: the import is refused before anything is submitted (the
    native wait asks the driver, cuStreamGetCtx -- the three-argument version of CUDA 12.5
    on), and one naming a stream of the primary context is waited for as before."""
    from cuda.bindings import driver as cu

    async with am.open_device("cuda:0") as dev:
        buf = await dev.alloc(4 * N)
        interface = buf.typed(np.int32).__cuda_array_interface__
        other = _other_context()  # (current: its stream is made in it)
        try:
            err, theirs = cu.cuStreamCreate(0)
            assert int(err) == 0
            _set_current(cu.CUcontext(0))

            class Interface:
                def __init__(self, stream: int) -> None:
                    self.__cuda_array_interface__ = {**interface, "stream": stream}

            submitted = dev.queue.submitted
            with pytest.raises(am.InvalidArgumentError, match="another CUDA context"):
                am.from_dlpack(Interface(int(theirs)))
            with pytest.raises(am.InvalidArgumentError, match="another CUDA context"):
                dev.queue._after_stream(int(theirs))
            assert dev.queue.submitted == submitted
            assert _current() == 0
            own = dev.new_queue()
            wrapped = am.from_dlpack(Interface(own.handle))
            assert dev.queue.submitted == submitted + 1
            await dev.queue.marker()
            assert _address(wrapped) == _address(buf)
        finally:  # (its stream goes with it)
            _set_current(cu.CUcontext(0))
            cu.cuCtxDestroy(other)


async def _calls_keep(expected: int, interface: Any) -> None:
    """Every public call, each checked to leave context ``expected`` current."""

    async def run(what: str, call: Callable[[], Any]) -> Any:
        result = call()
        if hasattr(result, "__await__"):
            result = await result
        assert _current() == expected, f"{what} left another context current"
        return result

    dev = await run("open_device", lambda: am.open_device("cuda:0"))
    fill = await run("compile", lambda: dev.compile(KERNELS, "fill"))
    buf = await run("alloc", lambda: dev.alloc(4 * N))
    await run("write", lambda: buf.write(np.zeros(N, np.int32)))
    done = await run("launch", lambda: dev.queue.launch(fill, buf, vals=(1, N), **GRID))
    await run("await", lambda: done)
    await run("read", lambda: buf.read(np.int32))
    other_buf = await run("alloc", lambda: dev.alloc(4 * N))
    await run("copy", lambda: am.copy(other_buf, buf))
    queue = await run("new_queue", dev.new_queue)
    timeline = await run("timeline", dev.timeline)
    await run("signal", lambda: queue.signal(timeline, 1))
    await run("wait", lambda: dev.queue.wait(timeline, 1))
    await run("marker", lambda: dev.queue.marker())
    adopted = await run("adopt_stream", lambda: dev.adopt_stream(1))
    await run("adopted marker", lambda: adopted.marker())
    await run("__dlpack__", lambda: buf.__dlpack__(stream=1, max_version=(1, 0)))
    await run("__cuda_array_interface__", lambda: buf.__cuda_array_interface__)
    await run("from_dlpack", lambda: am.from_dlpack(interface))
    await run("free", lambda: other_buf.free())
    await run("synchronize", dev.synchronize)
    await run("close", dev.close)


@needs_torch
async def test_every_call_leaves_the_current_context_as_it_was(anyio_backend: object) -> None:
    import torch
    from cuda.bindings import driver as cu

    # torch's own calls make its context current: made before, given as the interface
    tensor = torch.ones(N, dtype=torch.int32, device="cuda:0")
    torch.cuda.synchronize()
    interface = _InterfaceOnly(tensor)
    other = _other_context()
    try:
        for context in (cu.CUcontext(0), other):  # none current, and another one
            _set_current(context)
            await _calls_keep(int(context), interface)
    finally:
        _set_current(cu.CUcontext(0))
        cu.cuCtxDestroy(other)

"""A cuda device over a simulated driver, for a child process: the real native runtime
and extension module submit to tests/support/fakes/fake_cuda_driver.c (built here as a
shared library, its functions installed with ``am_cuda_set``), and the backend's own
driver calls go to the fake cuda-bindings module of tests/reliability/test_cuda_faults.py
(``_Driver``), whose streams, kernels and current context are the simulated driver's.

The runtime's driver table is process-wide: it is never set in the pytest process, which
on a GPU machine uses the real driver. :func:`run_child` runs a scenario of this module
in a child process and returns what it saw, for each launch path
(tests/support/launch_paths.py) -- or, for the copies' scenarios (simulated_copies.py,
over two simulated GPUs), once; ``python -m tests.support.native.simulated_cuda
SCENARIO LOOP`` is that child. Where no C compiler is found the caller skips, saying so.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import re
import subprocess
import sys
import tempfile
import types
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[3]
THEIRS = 0xC0FFEE  # another library's context, current on the calling thread
# Stream handles up to this one are default streams, of the calling thread's current
# context: 0 (the NULL stream) and 1 (CU_STREAM_LEGACY) its legacy stream, 2
# (CU_STREAM_PER_THREAD) that thread's own (fake_cuda_driver.c: fake_stream_of).
DEFAULT_STREAMS = 2
Seen = dict[str, Any]


def run_child(
    scenario: str,
    loop: str,
    timeout: float = 120,
    args: tuple[str, ...] = (),
    module: str = "tests.support.native.simulated_cuda",
) -> dict[str, Seen]:
    """What ``scenario`` saw through each launch path in a child process (on event loop
    ``loop``): by path, a dict of observations (or ``{"skipped": why}``); a sweep's
    (``discard_sweep``, ``args``: how many failing calls per error), under "sweep"; a
    copies' scenario's (simulated_copies.py), its own. ``module``: the one whose main
    runs the scenario (simulated_lifecycle.py's: what its scenario saw)."""
    child = subprocess.run(
        [sys.executable, "-m", module, scenario, loop, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-6000:] + child.stdout[-2000:]
    seen: dict[str, Seen] = json.loads(child.stdout.splitlines()[-1])
    return seen


class _Kernel(ctypes.Structure):
    """A fake_cuda_driver.h kernel, as the simulated driver runs it."""

    _fields_ = [
        ("fault", ctypes.c_int),
        ("duration_ns", ctypes.c_long),  # 0: a few us
        ("check", ctypes.c_void_p),
        ("at_least", ctypes.c_long),
        ("max_threads", ctypes.c_uint),  # per block (0: the device's)
    ]


BOUNDED_THREADS = 256
BOUNDED_SRC = "void bounded(int* x) { x[0] = 1; }"  # parsed for its parameters only


class _Simulated:
    """The simulated driver's shared library, loaded, its functions installed."""

    def __init__(self, out_dir: Path) -> None:
        from asyncmetal import _native
        from tests.support.native import harness

        _native.runtime()  # loaded first: the driver library links against that file
        cc = harness._compiler()
        if cc is None:
            raise RuntimeError("no C compiler")
        native = Path(_native.__file__).parent / "native"
        fakes = harness.SUPPORT / "fakes"
        path = out_dir / "fake_cuda_driver.so"
        subprocess.run(
            [
                cc,
                *("-O1", "-shared", "-fPIC", "-pthread", "-I", str(native), "-I", str(fakes)),
                str(fakes / "fake_cuda_driver.c"),
                str(_native.origin_path),  # the loaded runtime (the same file: one copy)
                "-o",
                str(path),
            ],
            check=True,
        )
        self.fake = fake = ctypes.CDLL(str(path))
        fake.stream_new.restype = ctypes.c_void_p
        fake.stream_free.argtypes = [ctypes.c_void_p, ctypes.c_int]
        fake.stream_destroy.argtypes = [ctypes.c_void_p]
        fake.fake_ctx_set_current.argtypes = [ctypes.c_void_p]
        fake.fake_ctx_current.restype = ctypes.c_void_p
        fake.fake_ctx_synchronize.argtypes = [ctypes.c_void_p]
        # Into the loaded runtime's table (a second copy's would leave it empty, and the
        # first queue would not start).
        fake.fake_driver_install()
        self.refuse_records = ctypes.c_void_p.in_dll(fake, "refuse_records")
        self.refuse_more = ctypes.c_int.in_dll(fake, "refuse_more")
        self.refuse_code = ctypes.c_int.in_dll(fake, "refuse_code")
        self.refuse_more_code = ctypes.c_int.in_dll(fake, "refuse_more_code")
        self.records_refused = ctypes.c_int.in_dll(fake, "records_refused")
        self.fault_code = ctypes.c_int.in_dll(fake, "fault_code")
        self.counted = ctypes.c_long.in_dll(fake, "counted_calls")
        self.fail_at = ctypes.c_long.in_dll(fake, "fail_at")
        self.fail_code = ctypes.c_int.in_dll(fake, "fail_code")
        self.count_all = ctypes.c_int.in_dll(fake, "count_all")
        self.counted_kinds = ctypes.c_uint.in_dll(fake, "counted_kinds")
        self.counted_order = (ctypes.c_char * 256).in_dll(fake, "counted_order")
        self.events_made = ctypes.c_long.in_dll(fake, "events_made")
        self.events_destroyed = ctypes.c_long.in_dll(fake, "events_destroyed")
        fake.fake_count_calls.argtypes = [ctypes.c_int]
        fake.stream_ran.argtypes = [ctypes.c_void_p]  # (a handle: a default stream's too)
        fake.stream_ran.restype = ctypes.c_long
        self.refuse_ctx = ctypes.c_void_p.in_dll(fake, "refuse_ctx")
        # The context of every stream, asked by the runtime and the backend alike (cuda:0's
        # primary one: each simulated GPU's streams are taken as its own).
        self.stream_context = ctypes.c_void_p.in_dll(fake, "stream_context")
        self.stream_context.value = 0x100
        # Set: every stream is of this green context of cuda:0 (cuStreamGetCtx_v2 gives the
        # primary context and it; the bindings' cuStreamGetCtx, the version of CUDA 9.2,
        # the context cuCtxFromGreenCtx makes of it -- modelled here as the same address).
        self.stream_green = ctypes.c_void_p.in_dll(fake, "stream_green")
        self.stream_context_error = ctypes.c_int.in_dll(fake, "stream_context_error")
        fake.fake_mem_alloc.restype = ctypes.c_void_p
        fake.fake_mem_alloc.argtypes = [ctypes.c_size_t]
        fake.fake_mem_free.argtypes = [ctypes.c_void_p]
        fake.fake_copy_busy.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        fake.fake_host_register.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        fake.fake_host_unregister.argtypes = [ctypes.c_void_p]
        self.copy_ns = ctypes.c_long.in_dll(fake, "copy_ns")
        self.copies_started = ctypes.c_long.in_dll(fake, "copies_started")
        self.hold_after = ctypes.c_long.in_dll(fake, "hold_after")
        self.torn_copies = ctypes.c_long.in_dll(fake, "torn_copies")
        self.freed_busy = ctypes.c_long.in_dll(fake, "freed_busy")
        self.unregistered_busy = ctypes.c_long.in_dll(fake, "unregistered_busy")
        self.kernel = _Kernel()  # runs a few us (duration_ns 0)
        self.duration_ns = ctypes.c_long.from_buffer(self.kernel, _Kernel.duration_ns.offset)
        # Kernel "bounded": at most BOUNDED_THREADS threads per block (a kernel of many
        # registers, or a __launch_bounds__).
        self.bounded = _Kernel(max_threads=BOUNDED_THREADS)
        self.oversized = ctypes.c_long.in_dll(fake, "oversized_launches")

    def current(self) -> int:
        return int(self.fake.fake_ctx_current() or 0)


def _driver_module(sim: _Simulated, gpus: int = 1) -> Any:
    """The fake cuda-bindings module, with the simulated driver's streams, kernels,
    current context (one per thread, shared with the runtime's calls), device memory
    (host memory: a device pointer is an address) and host registrations (what its
    copies from and to host memory look at)."""
    from tests.reliability.test_cuda_faults import CUresult, _Driver

    class Driver(_Driver):
        CUpointer_attribute = types.SimpleNamespace(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL=9)

        def cuPointerGetAttribute(self, attribute: int, address: int) -> tuple[Any, ...]:
            return self._result("cuPointerGetAttribute", 0)  # (every pointer: cuda:0's)

        def cuMemAlloc(self, nbytes: int) -> tuple[Any, ...]:
            result = self._result("cuMemAlloc", 0)
            if result[0]:
                return result
            pointer = sim.fake.fake_mem_alloc(nbytes)
            if not pointer:
                return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
            return (CUresult.CUDA_SUCCESS, pointer)

        def cuMemFree(self, pointer: int) -> tuple[Any, ...]:
            # Waits for no stream: the driver's "may" synchronize (memory of cuMemAlloc),
            # which nothing can count on, and a peer's streams reading it are not its
            # context's. A free while a copy still uses the memory is counted (freed_busy).
            if sim.fault_code.value:  # (a faulted context frees nothing: as the driver's)
                return (CUresult(sim.fault_code.value),)
            sim.fake.fake_mem_free(int(pointer))
            return self._result("cuMemFree")

        def cuMemHostAlloc(self, nbytes: int, flags: int) -> tuple[Any, ...]:
            result = super().cuMemHostAlloc(nbytes, flags)
            if result[0] == 0:
                sim.fake.fake_host_register(result[1], nbytes)
            return result

        def cuMemHostRegister(self, address: int, nbytes: int, flags: int) -> tuple[Any, ...]:
            result = super().cuMemHostRegister(address, nbytes, flags)
            if result[0] == 0:
                sim.fake.fake_host_register(address, nbytes)
            return result

        def cuMemHostUnregister(self, address: int) -> tuple[Any, ...]:
            sim.fake.fake_host_unregister(address)
            return super().cuMemHostUnregister(address)

        def cuCtxGetCurrent(self) -> tuple[Any, ...]:
            return self._result("cuCtxGetCurrent", sim.current())

        def cuCtxSetCurrent(self, context: int) -> tuple[Any, ...]:
            if int(context) and int(context) == (sim.refuse_ctx.value or 0):
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            sim.fake.fake_ctx_set_current(int(context))
            return self._result("cuCtxSetCurrent")

        def cuCtxSynchronize(self) -> tuple[Any, ...]:
            # As the driver's: returns once every stream of the current context ran out of
            # work (fake_ctx_synchronize), destroyed ones too -- a device's close lets its
            # streams run what its queues abandoned, and frees what they read after this.
            result = self._result("cuCtxSynchronize")
            if result[0]:
                return result
            code = sim.fake.fake_ctx_synchronize(sim.current())
            return (CUresult(code),) if code else result

        def cuStreamCreate(self, flags: int) -> tuple[Any, ...]:
            return self._result("cuStreamCreate", sim.fake.stream_new())

        def cuStreamDestroy(self, stream: int) -> tuple[Any, ...]:
            # Returns at once, as the driver's: a stream abandoned inside a device wait
            # that nothing raises keeps its work until the context is released.
            sim.fake.stream_destroy(int(stream))
            return self._result("cuStreamDestroy")

        def cuDevicePrimaryCtxRelease(self, device: int) -> tuple[Any, ...]:
            sim.fake.streams_release()
            return super().cuDevicePrimaryCtxRelease(device)

        def cuStreamGetCtx(self, stream: int) -> tuple[Any, ...]:
            if int(stream) <= DEFAULT_STREAMS:  # (the current context's, as the driver's)
                if not sim.current():
                    return (CUresult.CUDA_ERROR_INVALID_CONTEXT, None)
                return self._result("cuStreamGetCtx", sim.current())
            return self._result(
                "cuStreamGetCtx", sim.stream_green.value or sim.stream_context.value
            )

        def cuModuleGetFunction(self, module: int, name: bytes) -> tuple[Any, ...]:
            spec = sim.bounded if name == b"bounded" else sim.kernel
            return self._result("cuModuleGetFunction", ctypes.addressof(spec))

        def cuFuncGetAttribute(self, attribute: int, function: int) -> tuple[Any, ...]:
            threads = self.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK
            most = _Kernel.from_address(int(function)).max_threads
            return self._result("cuFuncGetAttribute", most or self.ATTRIBUTES[threads])

    return Driver(gpus=gpus)


def _install(sim: _Simulated, gpus: int = 1) -> None:
    """The fake module as the cuda backend's ``cu``; the runtime's driver functions are
    the simulated driver's already."""
    from asyncmetal import _device
    from asyncmetal.backends import cuda

    driver = _driver_module(sim, gpus)
    for name, module in list(sys.modules.items()):
        if name.startswith(f"{cuda.__name__}."):
            if hasattr(module, "cu"):
                module.cu = driver  # type: ignore[attr-defined]
            if hasattr(module, "install_driver"):
                module.install_driver = lambda lib: None  # type: ignore[attr-defined]
    _device.REAP_S = 1e6  # no queue let go of (it would take the Python launch path)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


async def _awaited(done: Any) -> str:
    """ "done", or the error awaiting ``done`` raised."""
    try:
        with anyio.fail_after(20):
            await done
        return "done"
    except Exception as exc:
        return _error(exc)


async def _refused_end(sim: _Simulated, queue: Any, kernel: Any, buf: Any) -> Seen:
    """A launch whose kernel reached the driver and whose end (its event record) was
    refused: what its submission, its completion and the next launch did."""
    seen: Seen = {}
    await queue.launch(kernel, buf)  # one that runs
    sim.refuse_records.value = queue._native.handle  # the next record on its stream
    done = None
    try:
        done = queue.launch(kernel, buf)
        seen["value"] = done.value
    except Exception as exc:
        seen["raised"] = _error(exc)
    seen["numbered"] = queue.submitted
    seen["last_use"] = buf._allocation.last_use.get(queue)
    if done is not None:
        seen["awaited"] = await _awaited(done)
    try:
        queue.launch(kernel, buf)
        seen["later"] = "submitted"
    except Exception as exc:
        seen["later"] = _error(exc)
    seen["numbered_after"] = queue.submitted
    return seen


async def _unrestored(sim: _Simulated, queue: Any, kernel: Any, buf: Any) -> Seen:
    """A launch, a marker and a wait for another library's stream, each called with
    another library's context current, which the driver refuses to make current again
    after the native call: what each warned."""
    seen: Seen = {}
    await queue.launch(kernel, buf)
    theirs = sim.fake.stream_new()
    submissions = {
        "launch": lambda: queue.launch(kernel, buf),
        "marker": queue.marker,
        "wait_stream": lambda: queue._after_stream(theirs),
    }
    for name, submit in submissions.items():
        sim.fake.fake_ctx_set_current(THEIRS)
        sim.refuse_ctx.value = THEIRS
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                done = submit()
        finally:
            sim.refuse_ctx.value = None
        seen[name] = [_error(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        seen[f"{name}_current"] = sim.current()
        with anyio.fail_after(20):
            await done
        seen[f"{name}_awaited"] = "done"
    sim.fake.fake_ctx_set_current(0)
    sim.fake.stream_free(theirs, 0)
    return seen


@contextlib.contextmanager
def _stream_and_array(sim: _Simulated) -> Iterator[tuple[int, Any]]:
    """Within: another library's stream, and an array over simulated device memory whose
    ``__cuda_array_interface__`` names that stream; both freed after."""
    theirs = sim.fake.stream_new()
    address = sim.fake.fake_mem_alloc(64)
    interface = {
        "shape": (16,),
        "typestr": "<i4",
        "data": (address, False),
        "version": 3,
        "stream": theirs,
    }
    try:
        yield theirs, types.SimpleNamespace(__cuda_array_interface__=interface)
    finally:
        sim.fake.stream_free(theirs, 0)
        sim.fake.fake_mem_free(address)


def _refusals(queue: Any, theirs: int, array: Any, says: Any, value: Any, seen: Seen) -> None:
    """With the simulated driver's ``says`` (a ctypes value of it) set to ``value``, what
    the queue's own wait for stream ``theirs`` and the import of ``array`` raised -- and,
    where ``seen["adopt"]`` is asked for (present), what adopting the stream raised, each
    error's type alone then -- into ``seen``, and how many values they numbered on
    ``queue`` and on its device's default queue (``seen["numbered"]``)."""
    import asyncmetal as am

    calls: dict[str, Callable[[], object]] = {
        "wait": lambda: queue._after_stream(theirs),
        "import": lambda: am.from_dlpack(array),
    }
    types_only = "adopt" in seen
    if types_only:
        calls["adopt"] = lambda: queue.device.adopt_stream(theirs)
    default = queue.device.queue
    before, default_before = queue.submitted, default.submitted
    kept, says.value = says.value, value
    try:
        for name, call in calls.items():
            try:
                call()
                seen[name] = "not refused"
            except Exception as exc:
                seen[name] = type(exc).__name__ if types_only else _error(exc)
    finally:
        says.value = kept
    seen["numbered"] = queue.submitted - before + default.submitted - default_before


async def _other_context_stream(sim: _Simulated, queue: Any, kernel: Any, buf: Any) -> Seen:
    """Waits for another library's stream while the driver says it is of another context
    (0x200: another GPU's, say) -- the queue's own ``_after_stream``, and the import of an
    array whose ``__cuda_array_interface__`` names that stream --, then one of cuda:0's:
    what the refused ones raised, how many values they numbered, and whether the wait
    for the device's stream (and a launch behind it) ran."""
    import asyncmetal as am

    seen: Seen = {}
    with _stream_and_array(sim) as (theirs, array):
        _refusals(queue, theirs, array, sim.stream_context, 0x200, seen)
        before = queue.submitted
        done = queue._after_stream(theirs)
        seen["value"] = done.value - before
        seen["awaited"] = await _awaited(done)
        seen["after"] = await _awaited(queue.launch(kernel, buf))
        imported = am.from_dlpack(array)
        seen["imported_awaited"] = await _awaited(queue.device.queue.marker())
        await imported.free()
        await queue.device.synchronize()
    return seen


async def _green_context_stream(sim: _Simulated, queue: Any, kernel: Any, buf: Any) -> Seen:
    """A wait for another library's stream that the driver says is of a green context of
    cuda:0 (cuStreamGetCtx_v2: the primary context 0x100 in the second pointer, the green
    context 0x300 in the third): what the queue's own ``_after_stream``, the import of
    an array naming that stream and adopting it did (the bindings' older cuStreamGetCtx,
    which adopt_stream's Python check asks, gives the green context's own CUcontext:
    refused there), and how many values they numbered."""
    seen: Seen = {"adopt": None}
    with _stream_and_array(sim) as (theirs, array):
        _refusals(queue, theirs, array, sim.stream_green, 0x300, seen)
        await queue.device.synchronize()
    return seen


async def _default_streams(sim: _Simulated, queue: Any, kernel: Any, buf: Any) -> Seen:
    """Another library's default streams by their handles: the queue's wait for the
    legacy stream (1, and 0, the NULL stream, the same one), an import of an array whose
    ``__cuda_array_interface__`` names it, a queue adopting it (a launch on it, then its
    close) and one adopting the per-thread stream (2): what each did, whether the
    adopted legacy stream ran the launch, and whether the device's synchronize
    returned."""
    import asyncmetal as am

    seen: Seen = {}
    device = queue.device
    for handle in (0, 1):
        seen[f"wait_{handle}"] = await _awaited(queue._after_stream(handle))
    address = sim.fake.fake_mem_alloc(64)
    interface = {"shape": (16,), "typestr": "<i4", "data": (address, False), "version": 3}
    array = types.SimpleNamespace(__cuda_array_interface__={**interface, "stream": 1})
    try:
        imported = am.from_dlpack(array)
        seen["import"] = await _awaited(device.queue.marker())
        await imported.free()
    finally:
        sim.fake.fake_mem_free(address)
    adopted = device.adopt_stream(1)
    try:
        sim.fake.fake_ctx_set_current(0x100)  # (stream_ran's legacy stream: cuda:0's)
        ran = sim.fake.stream_ran(1)
        seen["adopted"] = await _awaited(adopted.launch(kernel, buf))
        seen["adopted_ran"] = sim.fake.stream_ran(1) - ran
    finally:
        sim.fake.fake_ctx_set_current(0)
        await adopted.close()
    try:
        device.adopt_stream(2)
        seen["per_thread"] = "adopted"
    except Exception as exc:
        seen["per_thread"] = type(exc).__name__
    with anyio.move_on_after(20) as scope:
        await device.synchronize()
    seen["synchronized"] = not scope.cancelled_caught
    return seen


async def _stream_context_refused(sim: _Simulated, queue: Any, kernel: Any, buf: Any) -> Seen:
    """A wait for another library's stream whose context the driver will not tell
    (cuStreamGetCtx fails: an invalid handle): what it raised, how many values it
    numbered, whether it made an event or changed the current context, and whether the
    queue went on (a launch, and a wait for the same stream once the driver answers)."""
    seen: Seen = {}
    theirs = sim.fake.stream_new()
    sim.fake.fake_ctx_set_current(THEIRS)
    before, made = queue.submitted, sim.events_made.value
    sim.stream_context_error.value = 400  # CUDA_ERROR_INVALID_HANDLE
    try:
        queue._after_stream(theirs)
        seen["wait"] = "not refused"
    except Exception as exc:
        seen["wait"] = _error(exc)
    finally:
        sim.stream_context_error.value = 0
    seen["numbered"] = queue.submitted - before
    seen["events_made"] = sim.events_made.value - made
    seen["current"] = sim.current()
    sim.fake.fake_ctx_set_current(0)
    seen["after"] = await _awaited(queue.launch(kernel, buf))
    seen["again"] = await _awaited(queue._after_stream(theirs))
    await queue.device.synchronize()
    sim.fake.stream_free(theirs, 0)
    return seen


@contextlib.asynccontextmanager
async def _kernels_of_200_ms(
    sim: _Simulated, queue: Any, kernel: Any, buf: Any
) -> AsyncIterator[Callable[[], int]]:
    """Within: a launch that ran first, then kernels that run 200 ms, and the driver's
    refusals of event records undone after. Gives how many kernels the queue's stream
    has run since the first."""
    await queue.launch(kernel, buf)  # one that runs
    stream = queue._native.handle
    ran = sim.fake.stream_ran(stream)
    sim.duration_ns.value = 200_000_000
    try:
        yield lambda: int(sim.fake.stream_ran(stream) - ran)
    finally:
        sim.duration_ns.value = 0
        sim.refuse_records.value = None
        sim.refuse_more.value = 0
        sim.refuse_code.value = sim.refuse_more_code.value = 0


# A fence refused with CUDA_ERROR_INVALID_VALUE is tried again (the stream's work may
# still run); one refused with CUDA_ERROR_CONTEXT_IS_DESTROYED is not: nothing of the
# context runs any more (cu_fence_final, native/cuda_stream.h).
CONTEXT_IS_DESTROYED = 709


def _refuse_records(sim: _Simulated, queue: Any, more: int) -> None:
    """The driver refuses the next event record on ``queue``'s stream (a command's end:
    CUDA_ERROR_INVALID_VALUE), and ``more`` after (its fence's, refused alike)."""
    sim.records_refused.value = 0
    sim.refuse_more_code.value = 0
    sim.refuse_more.value = more
    sim.refuse_records.value = queue._native.handle


def _refusals_left(sim: _Simulated) -> int:
    return int(sim.refuse_more.value) if sim.refuse_records.value else 0


async def _unfenced(sim: _Simulated, queue: Any, kernel: Any, buf: Any) -> Seen:
    """A launch of a kernel that runs 200 ms, whose end (its event record) the driver
    refused once the kernel reached it, and then the queue's fence behind it three times
    more: whether the launch's await came back (the queue settled,
    its buffer free to go) only once the stream was past the kernel."""
    seen: Seen = {}
    async with _kernels_of_200_ms(sim, queue, kernel, buf) as ran:
        _refuse_records(sim, queue, 3)
        done = queue.launch(kernel, buf)
        seen["value"] = done.value
        seen["awaited"] = await _awaited(done)
        seen["ran_when_settled"] = ran()
        seen["refusals_left"] = _refusals_left(sim)
    return seen


async def _unfenced_signal(sim: _Simulated, queue: Any, kernel: Any, buf: Any) -> Seen:
    """A kernel that runs 200 ms, then a signal of a timeline whose end (its event
    record) the driver refused once its word write, behind the kernel, reached the
    driver, and then the queue's fence behind it twice more: what a
    wait on the timeline raised, and whether the stream had run the kernel (so the
    write had landed) when it did."""
    seen: Seen = {}
    timeline = queue._device.timeline()
    async with _kernels_of_200_ms(sim, queue, kernel, buf) as ran:
        queue.launch(kernel, buf)
        _refuse_records(sim, queue, 2)
        try:
            done = queue.signal(timeline, 1)
            seen["value"] = done.value
        except Exception as exc:
            seen["raised"] = _error(exc)
        seen["waited"] = await _awaited(timeline.wait(1))
        seen["ran_when_failed"] = ran()
        seen["refusals_left"] = _refusals_left(sim)
    return seen


async def _fence_gone(sim: _Simulated, queue: Any, kernel: Any, buf: Any) -> Seen:
    """A kernel that runs 200 ms, then a signal of a timeline whose end (its event
    record) the driver refused once its word write, behind the kernel, reached the
    driver, and then every fence the queue puts behind it, as a destroyed context does:
    what the signal's completion and a wait on the timeline raised. (The queue's close
    then returns: ``_main``.)"""
    seen: Seen = {}
    timeline = queue._device.timeline()
    async with _kernels_of_200_ms(sim, queue, kernel, buf):
        queue.launch(kernel, buf)
        sim.records_refused.value = 0
        sim.refuse_code.value = sim.refuse_more_code.value = CONTEXT_IS_DESTROYED
        sim.refuse_more.value = 1 << 30
        sim.refuse_records.value = queue._native.handle
        try:
            done = queue.signal(timeline, 1)
            seen["value"] = done.value
            seen["awaited"] = await _awaited(done)
        except Exception as exc:
            seen["raised"] = _error(exc)
        seen["waited"] = await _awaited(timeline.wait(1))
    return seen


async def _late_wait_on_closed(sim: _Simulated, queue: Any, kernel: Any, buf: Any) -> Seen:
    """Another queue's device wait on a closed queue's timeline for more than that
    queue's last command, reaching the backend once the closed queue was released -- as
    when ``Queue.wait``'s check of the timeline ran in another thread before the close:
    what the wait raised and left numbered, and what a launch behind it and a host wait
    for that value did."""
    seen: Seen = {}
    device = queue.device
    closing, waiting = device.new_queue(), device.new_queue()
    await closing.launch(kernel, buf)
    timeline, last = closing.timeline, closing.submitted
    await closing.close()
    try:
        waiting._wait(timeline, last + 1, False)  # (Queue.wait after its check)
        seen["wait"] = "submitted"
    except Exception as exc:
        seen["wait"] = _error(exc)
    seen["numbered"] = waiting.submitted
    behind = waiting.launch(kernel, buf)
    with anyio.move_on_after(5):
        seen["behind"] = await _awaited(behind)
    seen["host"] = await _awaited(timeline.wait(last + 1))
    await waiting.close(discard=True)
    return seen


async def _no_context(sim: _Simulated, queue: Any, kernel: Any, buf: Any) -> Seen:
    """A queue whose completion thread the driver refused to make the device's context
    current (refused from before the queue was made; the calling thread has that context
    current, so its own calls need no such call): what a launch raised once the queue
    failed, and whether its timeline settled. The queue's close then ends (``_main``)."""
    seen: Seen = {}
    native = queue._native
    try:
        with anyio.fail_after(10):  # its thread fails the queue as it starts
            while not native._error.value:
                await anyio.sleep(0.001)
        try:
            queue.launch(kernel, buf)
            seen["launch"] = "submitted"
        except Exception as exc:
            seen["launch"] = _error(exc)
        seen["settled"] = native._timeline.value == (1 << 64) - 1
    finally:
        sim.refuse_ctx.value = None
        sim.fake.fake_ctx_set_current(0)
    return seen


# Launches beyond the simulated H200's limits (fake_cuda_driver.h) or kernel "bounded"'s:
# the kernel's name, global_size, local_size, and what the launch raises.
OVERSIZED: list[tuple[str, Any, Any, str]] = [
    (
        "k",
        2048,
        2048,
        "launch of kernel 'k' on cuda:0: local_size (2048, 1, 1) has 2048 threads in x; a "
        "block takes at most 1024 (CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X)",
    ),
    (
        "k",
        (1, 1, 128),
        (1, 1, 128),
        "launch of kernel 'k' on cuda:0: local_size (1, 1, 128) has 128 threads in z; a "
        "block takes at most 64 (CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z)",
    ),
    (
        "k",
        (32, 32, 2),
        (32, 32, 2),
        "launch of kernel 'k' on cuda:0: local_size (32, 32, 2) makes 2048 threads per "
        "block; a block takes at most 1024 (CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)",
    ),
    (
        "bounded",
        512,
        512,
        "launch of kernel 'bounded' on cuda:0: local_size (512, 1, 1) makes 512 threads per "
        "block; the kernel takes at most 256 (its CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, "
        "which its registers per thread or its __launch_bounds__ set)",
    ),
    (
        "k",
        (1 << 32) - 1,
        1,
        "launch of kernel 'k' on cuda:0: global_size (4294967295, 1, 1) in blocks of "
        "(1, 1, 1) makes 4294967295 blocks in x; a grid takes at most 2147483647 "
        "(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)",
    ),
    (
        "k",
        (1, 65536),
        1,
        "launch of kernel 'k' on cuda:0: global_size (1, 65536, 1) in blocks of (1, 1, 1) "
        "makes 65536 blocks in y; a grid takes at most 65535 "
        "(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y)",
    ),
    (
        "k",
        (1, 1, 2 * 65536),
        (1, 1, 2),
        "launch of kernel 'k' on cuda:0: global_size (1, 1, 131072) in blocks of (1, 1, 2) "
        "makes 65536 blocks in z; a grid takes at most 65535 "
        "(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z)",
    ),
]
# Launches at the limits, which run.
AT_LIMITS: list[tuple[str, Any, Any]] = [
    ("k", 1024, 1024),
    ("k", (32, 32), (32, 32)),
    ("k", (1, 1, 64), (1, 1, 64)),
    ("bounded", 256, 256),
    ("k", (1 << 31) - 1, 1),
    ("k", (1, 65535, 65535), 1),
]
_kept: list[Any] = []  # programs kept for the child's life (one load each)


async def _program_bounded(queue: Any) -> Any:
    """Kernel "bounded" on ``queue``'s device, loaded once: the simulated driver gives
    every load of it one function, which a second load's unload would take away."""
    if not _kept:
        dev = queue._device
        params = await dev._params(BOUNDED_SRC, "bounded")
        compiler = dev._backend.compiler
        _kept.append(
            await dev._program(("key", "bounded"), params, b"cubin", BOUNDED_SRC, compiler, None)
        )
    return _kept[0]


@contextlib.contextmanager
def _python_path_allowed(queue: Any) -> Iterator[None]:
    """Within: the "queue" path may fall back to the Python path (the native one
    declines a launch to have it explained), whose backend launch _main replaced."""
    native = queue._native
    guard = vars(native).pop("launch", None)
    try:
        yield
    finally:
        if guard is not None:
            native.launch = guard


def _oversized(sim: _Simulated, queue: Any, programs: dict[str, Any], buf: Any) -> list[Seen]:
    """Each OVERSIZED launch: what it raised, and whether anything of it was numbered,
    held or handed to the driver."""
    out = []
    for name, global_size, local_size, _ in OVERSIZED:
        seen: Seen = {}
        numbered, held = queue.submitted, queue._native.stats()["held_now"]
        oversized = sim.oversized.value
        with _python_path_allowed(queue):
            try:
                queue.launch(programs[name], buf, global_size=global_size, local_size=local_size)
                seen["raised"] = "nothing"
            except Exception as exc:
                seen["raised"] = _error(exc)
        seen["numbered"] = queue.submitted - numbered
        seen["held"] = queue._native.stats()["held_now"] - held
        seen["refused_by_driver"] = sim.oversized.value - oversized
        out.append(seen)
    return out


async def _launch_limits(sim: _Simulated, queue: Any, kernel: Any, buf: Any) -> Seen:
    """Launches beyond the device's limits or their kernel's, on an idle queue and on
    one holding commands on the host (past its bound in flight): what each raised, and
    whether anything of it was numbered, held or reached the driver; then whether the
    queue's commands before them ran, and launches at the limits after them."""
    programs = {"k": kernel, "bounded": await _program_bounded(queue)}
    refused = sim.oversized.value
    seen: Seen = {"idle": _oversized(sim, queue, programs, buf)}
    sim.duration_ns.value = 5_000_000
    try:
        before = [queue.launch(kernel, buf) for _ in range(40)]
        seen["held_before"] = queue._native.stats()["held_now"]
        seen["deep"] = _oversized(sim, queue, programs, buf)
    finally:
        sim.duration_ns.value = 0
    seen["before"] = [await _awaited(done) for done in before]
    seen["after"] = []
    for name, global_size, local_size in AT_LIMITS:
        try:
            done = queue.launch(programs[name], buf, global_size=global_size, local_size=local_size)
            seen["after"].append(await _awaited(done))
        except Exception as exc:
            seen["after"].append(_error(exc))
    seen["refused_by_driver"] = sim.oversized.value - refused
    return seen


def _refuse_context(sim: _Simulated) -> None:
    """cuda:0's context (0x100) current on this thread, and refused to any other."""
    sim.fake.fake_ctx_set_current(0x100)
    sim.refuse_ctx.value = 0x100


async def _gated_discard(sim: _Simulated, queue: Any, kernel: Any, buf: Any) -> Seen:
    """A queue whose stream waits, on the device, for a value of a timeline only the host
    signals (a device wait handed to the driver at once), with more launches behind it
    than the queue hands over: what ``close(discard=True)`` did (whether it returned
    within 5 s), what the launches behind the wait raised once it returned (those the
    driver has run once the value is signalled, the rest were dropped), and whether a
    second such close returned."""
    seen: Seen = {}
    device = queue.device
    held, gate = device.new_queue(), device.timeline()
    gate.signal(1)  # (only ever signalled by the host: its waits go to the driver at once)
    held.wait(gate, 2)
    behind = [held.launch(kernel, buf) for _ in range(DISCARD_LAUNCHES)]
    with anyio.move_on_after(5) as scope:
        await held.close(discard=True)
    seen["returned"] = not scope.cancelled_caught
    seen["done_at_close"] = sum(done.done() for done in behind)
    with anyio.move_on_after(5) as scope:
        await held.close(discard=True)
    seen["again"] = not scope.cancelled_caught
    gate.signal(2)
    awaited = [re.sub(r"command \d+", "command N", await _awaited(done)) for done in behind]
    seen["behind"] = {what: awaited.count(what) for what in awaited}
    return seen


async def _collected_launch(sim: _Simulated, queue: Any, kernel: Any, buf: Any) -> Seen:
    """Another library's array over device memory (``__cuda_array_interface__``) that
    keeps the buffer made of it (a cycle), reached through a weak reference as a
    collection starts -- once its callback looked at the buffers' uses and let go of
    those idle (code another thread, or a callback after it, runs) --, a launch on that
    buffer held on the device (behind a wait for a value only the host signals), the
    array dropped again: whether the collection ran the array's finalizer under the
    held launch, and whether it ran once the launch did; ``let_go``: the callback had
    let go of the buffer's block (no command used it as it looked)."""
    import gc
    import weakref

    import asyncmetal as am
    from asyncmetal import _allocator

    seen: Seen = {}
    device = queue.device
    address = sim.fake.fake_mem_alloc(64)

    class Producer:
        buffer: Any = None

        def __init__(self) -> None:
            self.__cuda_array_interface__ = {
                "shape": (16,),
                "typestr": "<i4",
                "data": (address, False),
                "version": 3,
            }

    gc.disable()  # (the collection looked at is this one: none before it)
    try:
        producer = Producer()
        producer.buffer = am.from_dlpack(producer)
        await device.synchronize()  # (the import's wait for the array's stream ran)
        gate = device.timeline()
        gate.signal(1)  # (only ever signalled by the host: its waits go to the driver at once)
        queue.wait(gate, 2)
        released: list[bool] = []
        weakref.finalize(producer, released.append, True)
        ref = weakref.ref(producer)
        del producer
        launched: list[Any] = []

        def launch(phase: str, info: dict[str, int]) -> None:
            found = ref()
            if phase == "start" and found is not None and not launched:
                seen["let_go"] = found.buffer._allocation.block not in _allocator.imported
                launched.append(queue.launch(kernel, found.buffer))

        gc.callbacks.append(launch)  # (after the allocator's, added at the first import)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(launch)
    finally:
        gc.enable()
    seen["launched"] = len(launched)
    seen["released_under_launch"] = bool(released)
    gate.signal(2)
    seen["awaited"] = await _awaited(launched[0]) if launched else None
    await (await device.alloc(64)).free()  # a look: lets go of what waited
    gc.collect()
    seen["released_after"] = bool(released)
    sim.fake.fake_mem_free(address)
    return seen


async def _failed_own_timeline(sim: _Simulated, queue: Any, kernel: Any, buf: Any) -> Seen:
    """A queue whose device wait ended on a value never produced (``fail_for_good``):
    what a host wait on its own timeline for more than it was given, parked before the
    failure, and one made after raised, its timeline's value once the parked one ended,
    and what a launch submitted later raised."""
    from tests.support.queues import fail_for_good

    seen: Seen = {}
    ended = anyio.Event()

    async def park() -> None:
        seen["parked"] = await _awaited(queue.timeline.wait(1000))
        ended.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(park)
        await anyio.lowlevel.checkpoint()
        await fail_for_good(queue.device, queue)
        with anyio.move_on_after(10):
            await ended.wait()
        tg.cancel_scope.cancel()
    seen["value"] = queue.timeline.value
    with anyio.move_on_after(10):
        seen["after"] = await _awaited(queue.timeline.wait(queue.submitted + 1))
    try:
        later = queue.launch(kernel, buf)
    except Exception as exc:  # (refused at once)
        seen["later"] = _error(exc)
    else:
        with anyio.move_on_after(10):
            seen["later"] = await _awaited(later)
    return seen


async def _wait_on_settled_failure(sim: _Simulated, queue: Any, kernel: Any, buf: Any) -> Seen:
    """A queue failed for good (``fail_for_good``) with a signal of a new timeline
    submitted behind its failing copy, and settled (its timeline at 2**64 - 1): what a
    launch on a new queue raised behind a device wait for the failed copy's value of
    the queue's own timeline, behind one for the failed signal's value, and behind one
    for the value of the queue's launch that ran before the failure; then the same
    waits on its own timeline once the failed queue was closed."""
    from tests.support.queues import fail_for_good

    dev = queue.device
    seen: Seen = {}
    signalled = dev.timeline()
    await _awaited(queue.launch(kernel, buf))
    ran = queue.submitted
    await fail_for_good(dev, queue, lambda: queue.signal(signalled, 1))
    with anyio.move_on_after(10):
        while queue.timeline.value != (1 << 64) - 1:
            await anyio.sleep(0.005)
    seen["settled"] = queue.timeline.value == (1 << 64) - 1
    failed = queue.submitted - 1  # (the copy's; the signal's is the last)

    async def behind(name: str, timeline: Any, value: int) -> None:
        other = dev.new_queue()
        other.wait(timeline, value)
        try:
            seen[name] = await _awaited(other.launch(kernel, buf))
        except Exception as exc:  # (refused at once, its queue known failed by then)
            seen[name] = _error(exc)
        with anyio.fail_after(20):
            await other.close()

    await behind("own", queue.timeline, failed)
    await behind("signal", signalled, 1)
    await behind("ran", queue.timeline, ran)
    with anyio.fail_after(20):
        await queue.close()  # (failed: the waits below find its native queue gone)
    await behind("closed", queue.timeline, failed)
    await behind("closed ran", queue.timeline, ran)
    return seen


SCENARIOS: dict[str, Callable[[_Simulated, Any, Any, Any], Awaitable[Seen]]] = {
    "gated_discard": _gated_discard,
    "refused_end": _refused_end,
    "unrestored": _unrestored,
    "unfenced": _unfenced,
    "no_context": _no_context,
    "unfenced_signal": _unfenced_signal,
    "launch_limits": _launch_limits,
    "fence_gone": _fence_gone,
    "late_wait_on_closed": _late_wait_on_closed,
    "collected_launch": _collected_launch,
    "other_context_stream": _other_context_stream,
    "green_context_stream": _green_context_stream,
    "stream_context_refused": _stream_context_refused,
    "default_streams": _default_streams,
    "failed_own_timeline": _failed_own_timeline,
    "wait_on_settled_failure": _wait_on_settled_failure,
}
# What a scenario sets up before its queue is made.
BEFORE_QUEUE: dict[str, Callable[[_Simulated], None]] = {"no_context": _refuse_context}


async def _main(sim: _Simulated, scenario: str) -> dict[str, Seen]:
    import asyncmetal as am
    from asyncmetal import _native
    from tests.reliability.test_cuda_faults import SRC
    from tests.support.launch_paths import PATHS

    out: dict[str, Seen] = {}
    dev = await am.open_device("cuda:0")
    try:
        params = await dev._params(SRC, "k")
        kernel = await dev._program(
            ("key", "k"), params, b"cubin", SRC, dev._backend.compiler, None
        )
        buf = await dev.alloc(64)
        for path in PATHS:
            if path != "ctypes" and _native.extension() is None:
                out[path] = {"skipped": f"no extension module: {_native.extension_error}"}
                continue
            if scenario in BEFORE_QUEUE:
                BEFORE_QUEUE[scenario](sim)
            queue = dev.new_queue()
            assert queue._fast_launch is not None and queue._native._fast_launch is not None
            if path != "queue":
                queue._fast_launch = None
            if path == "ctypes":  # (and its other submissions: no extension call)
                queue._native._fast_launch = queue._native._wait_stream = None
            if path == "queue":  # never falls back to Python's: its backend launch fails

                def python_path(*args: object) -> None:
                    raise AssertionError("the launch took the Python path")

                queue._native.launch = python_path
            out[path] = await SCENARIOS[scenario](sim, queue, kernel, buf)
            with anyio.fail_after(20):
                await queue.close()
    finally:
        with anyio.fail_after(20):
            await dev.close()
    return out


async def _gated_closes(sim: _Simulated) -> Seen:
    """A device with a queue whose stream waits, on the device, for a value only the
    host would signal (as in ``_gated_discard``), closed -- plainly, then with
    ``discard=True`` -- and then one left open, with such a queue closed with
    ``discard=True`` and another left open, for the interpreter's exit to close: whether
    each close returned within 10 s, and what the launches behind the waits raised."""
    import asyncmetal as am
    from tests.reliability.test_cuda_faults import SRC

    seen: Seen = {}
    for how in ("close", "discard", "exit"):
        dev = await am.open_device("cuda:0")
        params = await dev._params(SRC, "k")
        compiler = dev._backend.compiler
        kernel = await dev._program(("key", "k"), params, b"cubin", SRC, compiler, None)
        buf = await dev.alloc(64)
        behind = []
        for _ in range(2):
            held, gate = dev.new_queue(), dev.timeline()
            gate.signal(1)
            held.wait(gate, 2)
            behind += [held.launch(kernel, buf) for _ in range(DISCARD_LAUNCHES)]
        with anyio.move_on_after(10) as scope:
            if how == "exit":
                await held.close(discard=True)  # (the first queue is left open)
            else:
                await dev.close(discard=how == "discard")
        seen[how] = {"returned": not scope.cancelled_caught}
        if how != "exit":
            awaited = [re.sub(r"\d+", "N", await _awaited(done)) for done in behind]
            seen[how]["behind"] = sorted(set(awaited))
    return seen


async def _signal_outliving(sim: _Simulated, a: Any, b: Any) -> tuple[int, int, Any]:
    """A timeline signalled by queue a, whose command a's completion thread sees
    unfinished (its event held) while queue b, which waited for it, confirms it and
    raises a's timeline past it: a's keep-alive lets go of the timeline, collected then
    -- while a's ring entry still holds it, and a's thread has yet to raise it. Returns
    its slot and native timeline, and a's next command's Completion, done once a's
    thread is past it (after ``held`` is cleared)."""
    import gc
    import weakref

    from asyncmetal._backend import let_go_everywhere

    device = a.device
    hold_records_on = ctypes.c_void_p.in_dll(sim.fake, "hold_records_on")
    signalled, later = device.timeline(), device.timeline()
    native = signalled.native
    slot, c_timeline, gone = native.address, native.c_timeline, weakref.ref(native)
    hold_records_on.value = a._native.handle  # the signal's end
    a.signal(signalled, 1)
    if ctypes.c_void_p.in_dll(sim.fake, "held").value is None:
        raise AssertionError("(setup) the signal's end was not held")
    with anyio.fail_after(20):
        await b.wait(a.timeline, a.submitted)  # confirms a's signal: a's timeline past it
    after = a.signal(later, 1)  # (a's queue lets go of what the signal kept)
    del signalled, native
    let_go_everywhere()
    gc.collect()
    if gone() is not None:
        raise AssertionError("(setup) the signalled timeline was not collected")
    return slot, c_timeline, after


async def _retired_slot(sim: _Simulated) -> Seen:
    """``_signal_outliving``: what the runtime held of the timeline after its owner let
    go, whether timelines made then got its slot, and, a's thread past it, whether a
    timeline made then did. Then once more, the device closed with the timeline still
    retired (no slot taken since): what is retired before and after the close."""
    import asyncmetal as am

    seen: Seen = {}
    held = ctypes.c_void_p.in_dll(sim.fake, "held")
    dev = await am.open_device("cuda:0")
    try:
        backend = dev._backend
        a, b = dev.new_queue(), dev.new_queue()
        slot, c_timeline, after = await _signal_outliving(sim, a, b)
        seen["refs_after_owner"] = backend.lib.am_timeline_refs(c_timeline)
        made = [dev.timeline() for _ in range(4)]
        seen["slot_taken_while_held"] = any(t.native.address == slot for t in made)
        held.value = None  # a's thread sees the signal's end
        with anyio.fail_after(20):
            await after
        seen["slot_taken_after"] = dev.timeline().native.address == slot
        seen["retired_after"] = len(backend._retired)
        _, _, after = await _signal_outliving(sim, a, b)
        held.value = None
        with anyio.fail_after(20):
            await after
        seen["retired_before_close"] = len(backend._retired)
    finally:
        held.value = None
        ctypes.c_void_p.in_dll(sim.fake, "hold_records_on").value = None
        with anyio.fail_after(20):
            await dev.close()
    seen["retired_at_close"] = len(backend._retired)
    return seen


STICKY = 700  # CUDA_ERROR_ILLEGAL_ADDRESS: the context faulted (fake_cuda_driver.c)
DISCARD_LAUNCHES = 40  # launches of 1 ms on one queue: its bound (32) in flight, the rest held
DISCARD_SHAPE_MS = 25  # each launch's time in the run that checks what the close met


async def left_behind(sim: _Simulated, threads: set[Any], made: int) -> list[str]:
    """What a run left that it found not there before it: device threads still running
    10 s after it (``threads``: those of before), events made and not destroyed
    (``made``: the count of before)."""
    from tests.support.faults import device_threads

    problems = []
    deadline = anyio.current_time() + 10
    while device_threads() - threads and anyio.current_time() < deadline:
        await anyio.sleep(0.005)
    if device_threads() - threads:
        problems.append(f"threads left: {sorted(t.name for t in device_threads() - threads)}")
    if sim.events_made.value - sim.events_destroyed.value != made:
        problems.append("events never destroyed")
    return problems


async def _discard_run(
    sim: _Simulated, fail_at: int, code: int, seen: Seen | None = None, launch_ms: int = 1
) -> tuple[int, list[str]]:
    """One run of the discard workload with driver call number ``fail_at`` failing with
    ``code`` (0: none): a queue given more 1 ms launches than its bound on commands in
    flight (the rest held on the host), a fill, a signal of a timeline that a second
    queue waits for and then launches behind, each submitted with another library's
    context current (the submitting thread's calls counted); then, once the first launch
    is done (the completion thread's hand-overs counted meanwhile),
    ``Device.close(discard=True)``, and every command awaited. Returns the calls counted
    and what broke the contracts; ``seen`` gets what the close met: commands held,
    commands that ran and that failed. Each launch takes ``launch_ms``."""
    import asyncmetal as am
    from asyncmetal import DeviceLostError
    from asyncmetal.backends.cuda import _driver
    from tests.reliability.test_cuda_faults import SRC
    from tests.support.faults import device_threads

    problems: list[str] = []
    _driver.lost_first = None  # (each run in a process whose CUDA state is not lost)
    sim.fault_code.value = 0
    sim.counted.value, sim.fail_at.value, sim.fail_code.value = 0, fail_at, code
    threads, made = device_threads(), sim.events_made.value - sim.events_destroyed.value
    error: BaseException | None = None
    done: list[Any] = []
    with anyio.fail_after(30):
        dev = await am.open_device("cuda:0")
        params = await dev._params(SRC, "k")
        compiler = dev._backend.compiler
        kernel = await dev._program(("key", "k"), params, b"cubin", SRC, compiler, None)
        buf, other = await dev.alloc(64), await dev.alloc(4096)
        q, q2, tl = dev.new_queue(), dev.new_queue(), dev.timeline()
        submissions: list[Callable[[], Any]] = [
            *(functools.partial(q.launch, kernel, buf) for _ in range(DISCARD_LAUNCHES)),
            lambda: q.fill(other, 7),
            lambda: q.signal(tl, 1),
            lambda: q2.wait(tl, 1),
            functools.partial(q2.launch, kernel, buf),
        ]
        sim.duration_ns.value = launch_ms * 1_000_000
        sim.fake.fake_count_calls(1)
        try:
            for submit in submissions:
                sim.fake.fake_ctx_set_current(THEIRS)
                try:
                    got = submit()
                finally:
                    if sim.current() != THEIRS:
                        problems.append("a submission left the thread's context changed")
                if got is not None:
                    done.append(got)
        except Exception as exc:
            error = exc
        finally:
            sim.fake.fake_count_calls(0)
            sim.fake.fake_ctx_set_current(0)
            sim.duration_ns.value = 0
        held = q._native.stats()["held_now"]
        # Then, the first launch awaited (the completion thread handing held commands
        # over as others are confirmed: the only thread making driver calls now, so
        # counted), the close discards what is still held.
        sim.count_all.value = 1
        try:
            if done and error is None:
                with contextlib.suppress(am.AsyncMetalError):
                    await done[0]
            await dev.close(discard=True)
        except Exception as exc:
            problems.append(f"close raised {_error(exc)}")
        finally:
            sim.count_all.value = 0
        ran = failed = 0
        for completion in done:
            try:
                await completion
                ran += 1
            except am.AsyncMetalError:
                failed += 1
            except Exception as exc:
                problems.append(f"a command's await raised {_error(exc)}")
        if seen is not None:
            seen.update(held=held, ran=ran, failed=failed)
    if error is not None and not isinstance(error, am.AsyncMetalError):
        problems.append(f"a submission raised {_error(error)}")
    elif code == STICKY and error is not None and not isinstance(error, DeviceLostError):
        problems.append(f"a submission raised {_error(error)}, not DeviceLostError")
    if code and code != STICKY:  # the device still works
        _driver.lost_first = None
        with anyio.fail_after(30):
            try:
                dev = await am.open_device("cuda:0")
                kernel = await dev._program(
                    ("key", "k"), params, b"cubin", SRC, dev._backend.compiler, None
                )
                buf = await dev.alloc(64)
                await dev.queue.launch(kernel, buf)
                await dev.close()
            except Exception as exc:
                problems.append(f"the device failed after: {_error(exc)}")
    problems += await left_behind(sim, threads, made)
    return sim.counted.value, problems


async def _discard_sweep(sim: _Simulated, samples: int) -> Seen:
    """The discard workload once clean, counting the submitting thread's driver calls,
    then for each sampled N with call N failing, not sticky (an invalid value) and
    sticky (the context faulted)."""
    from tests.support.faults import sampled

    clean: Seen = {}
    total, problems = await _discard_run(sim, 0, 0)
    found = [f"clean: {p}" for p in problems]
    # What the close met, with launches long enough that a loop slow to resume after the
    # first (a loaded machine) still closes with commands held and running.
    _, problems = await _discard_run(sim, 0, 0, clean, launch_ms=DISCARD_SHAPE_MS)
    found += [f"clean, {DISCARD_SHAPE_MS} ms launches: {p}" for p in problems]
    for code in (1, STICKY):
        for n in sampled(total, samples):
            _, problems = await _discard_run(sim, n, code)
            found += [f"call {n} failing with {code}: {p}" for p in problems]
    return {"calls": total, "found": found, "clean": clean}


def child_main(scenarios: dict[str, Callable[[_Simulated], Awaitable[Seen]]]) -> None:
    """A child process's main (``run_child(..., module=...)``) for a module of scenarios,
    each run on one simulated GPU: the scenario and loop named on its command line, what
    it saw printed as JSON on the last line."""
    scenario, loop = sys.argv[1:3]
    with tempfile.TemporaryDirectory(prefix="asyncmetal-simcuda-") as tmp:
        sim = _Simulated(Path(tmp))
        _install(sim)
        seen = anyio.run(scenarios[scenario], sim, backend=loop)
    print(json.dumps(seen))


def main(scenario: str, loop: str, *args: str) -> None:
    from tests.support.native import simulated_copies

    with tempfile.TemporaryDirectory(prefix="asyncmetal-simcuda-") as tmp:
        sim = _Simulated(Path(tmp))
        copies = scenario in simulated_copies.SCENARIOS or scenario == "copy_sweep"
        _install(sim, simulated_copies.GPUS if copies else 1)
        if copies:
            seen = simulated_copies.run(sim, scenario, loop, args)
        elif scenario == "retired_slot":
            seen = {"slots": anyio.run(_retired_slot, sim, backend=loop)}
        elif scenario == "gated_closes":  # (the last device left open: the exit closes it)
            seen = {"closes": anyio.run(_gated_closes, sim, backend=loop)}
        elif scenario == "discard_sweep":
            run = functools.partial(_discard_sweep, sim, int(args[0]))
            seen: Any = {"sweep": anyio.run(run, backend=loop)}
        else:
            seen = anyio.run(functools.partial(_main, sim, scenario), backend=loop)
    print(json.dumps(seen))


if __name__ == "__main__":
    main(*sys.argv[1:])

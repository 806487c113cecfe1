"""Faults of the cuda backend without a GPU: a fake of cuda-bindings' driver module
(``_Driver``, monkeypatched in as ``asyncmetal.backends.cuda.cu``) that answers every
call the backend makes, and whose calls can be made to fail as the real driver's do.

* A staging chunk whose registration fails unmaps its memory and raises the driver's
  error -- never ``BufferError`` (a ctypes view of the map kept alive by the failing
  ``__init__``'s frame once made ``mmap.close`` refuse, masking the real error).
* A sticky error (an illegal address, a failed launch, ...) loses the process's CUDA
  state, every device's: once any call or command saw one, every cuda device of the
  process reports ``DeviceLostError`` saying so -- alloc, load, new queues, submissions,
  completions not confirmed before, opening a device -- while other errors (no memory,
  an invalid value) stay what they are.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import gc
import itertools
import re
import sys
import threading
import types
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import DeviceLostError, _native
from asyncmetal._timeline import LATER_FAIL
from asyncmetal.backends import cuda as cb
from asyncmetal.backends.cuda import _backend as cuda_backend
from asyncmetal.backends.cuda import _queue as cuda_queue
from asyncmetal.backends.cuda import _staging
from tests.support.interrupts import check_queue_making_interrupted
from tests.support.threads import closed_while_making, submitted_while_making

MAX = (1 << 64) - 1
# What every process-wide report says: that the state is lost, that the process must
# restart, and that separate processes contain such faults.
PROCESS_LOST = r"(?s)the process's CUDA state is lost.*restart the process.*Separate processes"
SRC = "void k(int* x) { x[0] = 1; }"  # parsed for its parameters only: never compiled


class CUresult(enum.IntEnum):
    """The driver's result codes the backend meets (the real values)."""

    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
    CUDA_ERROR_CONTEXT_IS_DESTROYED = 709
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
    CUDA_ERROR_LAUNCH_FAILED = 719
    CUDA_ERROR_NOT_SUPPORTED = 801


_host_memory: list[Any] = []  # "pinned" memory: timeline words may outlive a test


class _Driver:
    """What the backend calls of cuda-bindings' ``driver`` module, for GPUs that do
    nothing. Each call returns a result tuple as cuda-bindings does; ``fail[name]`` makes
    call ``name`` return that error instead (and do nothing); ``calls`` lists every call
    made, by name."""

    CUresult = CUresult
    CU_MEMHOSTREGISTER_PORTABLE = 1
    CU_MEMHOSTREGISTER_DEVICEMAP = 2
    CU_MEMHOSTALLOC_PORTABLE = 1
    CU_MEMHOSTALLOC_DEVICEMAP = 2
    CUstream_flags = types.SimpleNamespace(CU_STREAM_NON_BLOCKING=1)
    CUstream = int  # a handle, as the bindings' CUstream(handle) wraps one
    CUdevice_attribute = types.SimpleNamespace(
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR=75,
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR=76,
        CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS=111,
        CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING=41,
        CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK=1,
        CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X=2,
        CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y=3,
        CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z=4,
        CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X=5,
        CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y=6,
        CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z=7,
    )
    # Then an H200's launch limits: a block's threads, in all and per dimension; a
    # grid's blocks per dimension.
    ATTRIBUTES: ClassVar[dict[int, int]] = {75: 9, 76: 0, 111: 1, 41: 1} | {
        1: 1024,
        2: 1024,
        3: 1024,
        4: 64,
        5: (1 << 31) - 1,
        6: 65535,
        7: 65535,
    }
    CUfunction_attribute = types.SimpleNamespace(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK=0)

    def __init__(self, gpus: int = 2) -> None:
        self.gpus = gpus
        self.fail: dict[str, CUresult] = {}
        self.calls: list[str] = []
        self.registered: set[int] = set()
        self.current = 0
        self.runtime: _Runtime | None = None  # the simulated native runtime, once made
        self._handles = iter(range(0x1000, 1 << 40, 0x1000))
        # Streams it makes (new queues'), apart from the handles tests give as other
        # libraries' streams (0x5000...): two live streams never share a handle.
        self._streams = iter(range(1 << 40, 1 << 44, 0x1000))
        # Each stream's id (cuStreamGetId), by handle: a stream of another library,
        # adopted by its handle alone, gets one when first asked; a destroyed stream's
        # goes, and the next stream given that handle gets another.
        self.stream_ids: dict[int, int] = {}
        self._ids = itertools.count(1)
        # The most threads per block of each kernel, by name, where below the device's
        # (a kernel of many registers); each function's name.
        self.kernel_threads: dict[bytes, int] = {}
        self.functions: dict[int, bytes] = {}
        # Each kernel's parameter sizes, by name, as cuFuncGetParamInfo gives them (a
        # kernel not named here: CUDA_ERROR_NOT_SUPPORTED, as a driver before 12.4).
        self.param_sizes: dict[bytes, tuple[int, ...]] = {}

    def _result(self, name: str, *values: Any) -> tuple[Any, ...]:
        self.calls.append(name)
        if name in self.fail:
            return (self.fail[name], *(None for _ in values))
        return (CUresult.CUDA_SUCCESS, *values)

    def cuInit(self, flags: int) -> tuple[Any, ...]:
        return self._result("cuInit")

    def cuDeviceGetCount(self) -> tuple[Any, ...]:
        return self._result("cuDeviceGetCount", self.gpus)

    def cuDeviceGet(self, index: int) -> tuple[Any, ...]:
        return self._result("cuDeviceGet", index)

    def cuDevicePrimaryCtxRetain(self, device: int) -> tuple[Any, ...]:
        return self._result("cuDevicePrimaryCtxRetain", 0x100 + device)

    def cuDevicePrimaryCtxRelease(self, device: int) -> tuple[Any, ...]:
        return self._result("cuDevicePrimaryCtxRelease")

    def cuCtxGetCurrent(self) -> tuple[Any, ...]:
        return self._result("cuCtxGetCurrent", self.current)

    def cuCtxSetCurrent(self, context: int) -> tuple[Any, ...]:
        result = self._result("cuCtxSetCurrent")
        if result[0] == 0:
            self.current = context
        return result

    def cuCtxSynchronize(self) -> tuple[Any, ...]:
        # Nothing to wait for: nothing runs on its streams (_Runtime refuses every
        # submission). The fakes whose streams run wait for them (simulated_cuda.py's,
        # test_fault_sweep_cuda.py's).
        return self._result("cuCtxSynchronize")

    def cuDeviceGetAttribute(self, attribute: int, device: int) -> tuple[Any, ...]:
        return self._result("cuDeviceGetAttribute", self.ATTRIBUTES[attribute])

    def cuDeviceGetName(self, length: int, device: int) -> tuple[Any, ...]:
        return self._result("cuDeviceGetName", b"Fake GPU\0")

    def cuDeviceTotalMem(self, device: int) -> tuple[Any, ...]:
        return self._result("cuDeviceTotalMem", 1 << 30)

    def cuDeviceCanAccessPeer(self, device: int, peer: int) -> tuple[Any, ...]:
        return self._result("cuDeviceCanAccessPeer", 0)

    def cuMemHostAlloc(self, nbytes: int, flags: int) -> tuple[Any, ...]:
        memory = (ctypes.c_uint8 * nbytes)()
        result = self._result("cuMemHostAlloc", ctypes.addressof(memory))
        if result[0] == 0:
            _host_memory.append(memory)
        return result

    def cuMemHostRegister(self, address: int, nbytes: int, flags: int) -> tuple[Any, ...]:
        result = self._result("cuMemHostRegister")
        if result[0] == 0:
            self.registered.add(address)
        return result

    def cuMemHostUnregister(self, address: int) -> tuple[Any, ...]:
        self.registered.discard(address)
        return self._result("cuMemHostUnregister")

    def cuMemAlloc(self, nbytes: int) -> tuple[Any, ...]:
        return self._result("cuMemAlloc", next(self._handles))

    def cuMemFree(self, pointer: int) -> tuple[Any, ...]:
        return self._result("cuMemFree")

    def cuModuleLoadData(self, binary: bytes) -> tuple[Any, ...]:
        return self._result("cuModuleLoadData", next(self._handles))

    def cuModuleGetFunction(self, module: int, name: bytes) -> tuple[Any, ...]:
        result = self._result("cuModuleGetFunction", next(self._handles))
        if result[0] == 0:
            self.functions[result[1]] = name
        return result

    def cuFuncGetAttribute(self, attribute: int, function: int) -> tuple[Any, ...]:
        assert attribute == self.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK
        name = self.functions.get(int(function), b"")
        return self._result("cuFuncGetAttribute", self.kernel_threads.get(name, 1024))

    def cuFuncGetParamInfo(self, function: int, index: int) -> tuple[Any, ...]:
        sizes = self.param_sizes.get(self.functions.get(int(function), b""))
        if sizes is None:
            return (CUresult.CUDA_ERROR_NOT_SUPPORTED, None, None)
        if index >= len(sizes):
            return (CUresult.CUDA_ERROR_INVALID_VALUE, None, None)
        return self._result("cuFuncGetParamInfo", 8 * index, sizes[index])

    def cuModuleUnload(self, module: int) -> tuple[Any, ...]:
        return self._result("cuModuleUnload")

    def cuStreamCreate(self, flags: int) -> tuple[Any, ...]:
        result = self._result("cuStreamCreate", next(self._streams))
        if result[0] == 0:
            self.stream_ids[result[1]] = next(self._ids)
        return result

    def cuStreamSynchronize(self, stream: int) -> tuple[Any, ...]:
        return self._result("cuStreamSynchronize")

    def cuStreamDestroy(self, stream: int) -> tuple[Any, ...]:
        result = self._result("cuStreamDestroy")
        if result[0] == 0:
            self.stream_ids.pop(int(stream), None)
        return result

    def cuStreamGetId(self, stream: int) -> tuple[Any, ...]:
        handle = int(stream)
        if handle not in self.stream_ids:
            self.stream_ids[handle] = next(self._ids)
        return self._result("cuStreamGetId", self.stream_ids[handle])

    def cuStreamGetCtx(self, stream: int) -> tuple[Any, ...]:
        return self._result("cuStreamGetCtx", 0x100)  # (cuda:0's primary context)

    def cuMemcpyHtoDAsync(self, dst: int, src: int, nbytes: int, stream: int) -> tuple[Any, ...]:
        return self._result("cuMemcpyHtoDAsync")


class _NativeQueue(ctypes.Structure):
    """am_cuq's first members, as CUDAQueue reads them (its error in place)."""

    _fields_ = [
        ("error", ctypes.c_int),
        ("failed_call", ctypes.c_int),
        ("error_value", ctypes.c_uint64),
    ]


class _Runtime:
    """The native runtime with its CUDA queues simulated: timelines are the real ones;
    a queue is a ``_NativeQueue`` whose error a test sets, as the completion thread sets
    it when an event reports a fault. Submitting to one fails the test: every
    submission here must be refused before it gets to native code."""

    def __init__(self) -> None:
        self._real = _native.runtime()
        self.queues: dict[int, _NativeQueue] = {}
        # A queue whose error is WAITED_FAILED: (timeline, error, value) of what failed.
        self.causes: dict[int, tuple[int, int, int]] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("am_cuq_"):
            return functools.partial(self._submitted, name)
        return getattr(self._real, name)

    def _submitted(self, name: str, *args: Any) -> None:
        raise AssertionError(f"{name} was called: a submission got to native code")

    def am_cuq_new(
        self, context: int, stream: int, timeline: int, spin_ns: int, max_inflight: int
    ) -> int:
        q = _NativeQueue()
        self.queues[ctypes.addressof(q)] = q
        return ctypes.addressof(q)

    def am_cuq_set_shared(self, q: int) -> None:
        self.queues[q].shared = True

    def am_cuq_error(self, q: int, value: Any) -> int:
        value._obj.value = self.queues[q].error_value  # value: ctypes.byref(a c_uint64)
        return int(self.queues[q].error)

    def am_cuq_failed_call(self, q: int) -> int:
        return int(self.queues[q].failed_call)

    def am_cuq_cause(self, q: int, error: Any, value: Any) -> int:
        timeline, error._obj.value, value._obj.value = self.causes.get(q, (0, 0, 0))
        return timeline

    def am_cuq_close(self, q: int, abandon: int) -> None:
        del self.queues[q]


def _bind(monkeypatch: pytest.MonkeyPatch, name: str, value: object) -> None:
    """Set ``name`` in every module of the cuda backend that binds it (each imports the
    names it uses, the driver bindings included)."""
    prefix = f"{cb.__name__}."
    modules = [m for n, m in sys.modules.items() if n.startswith(prefix) and hasattr(m, name)]
    assert modules, f"no module of {cb.__name__} binds {name}"
    for module in modules:
        monkeypatch.setattr(module, name, value)


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Driver]:
    """The fake driver as ``cu``, in a process whose CUDA state is not lost (restored
    afterwards: the state is the module's, for the life of the process)."""
    yield from fake_driver(monkeypatch)


def fake_driver(monkeypatch: pytest.MonkeyPatch, fake: _Driver | None = None) -> Iterator[_Driver]:
    """What the ``driver`` fixture does, for a script that is no test (a forked child's
    parent: tests/reliability/test_fork.py) or another fake (``fake``, with its runtime
    where it has one): yields the fake, cleans up when resumed."""
    fake = _Driver() if fake is None else fake
    runtime = fake.runtime = fake.runtime or _Runtime()
    _bind(monkeypatch, "cu", fake)
    native = types.SimpleNamespace(
        runtime=lambda: runtime,
        extension=lambda: None,
        timeline_reader=lambda address: ctypes.c_uint64.from_address(address),
        # (the fake runtime reports a failure through a queue's error alone)
        failed_from=lambda address: ctypes.c_uint64(0),
    )
    _bind(monkeypatch, "_native", native)
    _bind(monkeypatch, "install_driver", lambda lib: None)
    _bind(monkeypatch, "_opened", {})
    _bind(monkeypatch, "_peers_done", set())
    _bind(monkeypatch, "_listed", [])
    _bind(monkeypatch, "STAGE_RING", 2)
    _bind(monkeypatch, "STAGE_CHUNK", 1 << 20)
    _bind(monkeypatch, "lost_first", None)
    _bind(monkeypatch, "live_queues", weakref.WeakSet())
    kept = set(_staging._MAPPED)
    yield fake
    leaked = set(_staging._MAPPED) - kept
    for address in leaked:  # unmapped here, so one failing test does not leak into others
        mapped, view = _staging._MAPPED.pop(address)
        del view
        mapped.close()


@pytest.mark.parametrize(
    "error", [CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, CUresult.CUDA_ERROR_OUT_OF_MEMORY]
)
def test_a_chunk_whose_registration_fails_raises_the_drivers_error(
    driver: _Driver, error: CUresult
) -> None:
    """cuMemHostRegister fails (a sticky error left by a fault, or no memory): the
    driver's error comes out, as the asyncmetal error it maps to, and the chunk's memory
    is unmapped -- nothing is left in ``_MAPPED``, nothing registered."""
    kept = set(_staging._MAPPED)
    driver.fail["cuMemHostRegister"] = error
    expected = DeviceLostError if error in (700, 719) else MemoryError
    for _ in range(3):
        with pytest.raises(expected, match=error.name) as caught:
            _staging.Chunk(1 << 20)
        assert not isinstance(caught.value.__context__, BufferError)
        del caught
        assert set(_staging._MAPPED) == kept and not driver.registered
    driver.fail.clear()
    chunk = _staging.Chunk(1 << 20)  # and the next one maps and registers as usual
    assert chunk.address in driver.registered
    ctypes.memset(chunk.address, 1, chunk.nbytes)
    chunk.free()
    assert set(_staging._MAPPED) == kept and not driver.registered
    gc.collect()


@pytest.mark.parametrize(
    "sticky", [CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, CUresult.CUDA_ERROR_LAUNCH_FAILED]
)
def test_a_sticky_error_loses_the_process_and_other_errors_do_not(
    driver: _Driver, sticky: CUresult
) -> None:
    """No memory and an invalid value stay what they are, and lose nothing; a sticky
    error is reported as the process's CUDA state lost, naming it and who saw it, and
    from then on every error of any device is reported as that loss."""
    for _ in range(2):
        oom = cb.driver_error("cuMemAlloc", CUresult.CUDA_ERROR_OUT_OF_MEMORY)
        assert isinstance(oom, MemoryError) and not isinstance(oom, DeviceLostError)
        assert str(oom) == "cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY"
        invalid = cb.driver_error("cuModuleLoadData", CUresult.CUDA_ERROR_INVALID_VALUE)
        assert type(invalid) is am.AsyncMetalError
        assert str(invalid) == "cuModuleLoadData failed: CUDA_ERROR_INVALID_VALUE"

    lost = cb.driver_error("the command at value 3 on a stream of cuda:1", sticky)
    assert isinstance(lost, DeviceLostError)
    message = str(lost)
    assert re.search(PROCESS_LOST, message), message
    assert message.startswith(
        f"the command at value 3 on a stream of cuda:1 failed with {sticky.name}: "
    )
    assert f"({sticky.name}, first seen by the command at value 3 on a stream of cuda:1)" in message

    later = cb.driver_error("cuMemAlloc", CUresult.CUDA_ERROR_OUT_OF_MEMORY, "cuda:0")
    assert isinstance(later, DeviceLostError) and not isinstance(later, MemoryError)
    assert str(later).startswith("cuMemAlloc on cuda:0 failed with CUDA_ERROR_OUT_OF_MEMORY: ")
    assert "first seen by the command at value 3 on a stream of cuda:1" in str(later)


def numbered_only(value: int, done: am.Completion) -> None:
    """A backend hook that hands nothing over: ``queue._submit(numbered_only)`` numbers a
    command and returns its Completion, which the simulated driver then settles."""


def _fault(queue: am.Queue, runtime: _Runtime, error: CUresult) -> am.Completion:
    """A command on ``queue`` whose event reported ``error``, as the completion thread
    records it (``_failed``)."""
    done = queue._submit(numbered_only)
    _failed(queue, runtime, done.value, error)
    return done


def _failed(queue: am.Queue, runtime: _Runtime, value: int, error: CUresult) -> None:
    """``queue``'s command ``value`` failed with ``error``, and the queue settles, as its
    completion thread does it (native/cuda_completion.c): the queue's first error; its
    timeline failed from that value, with it as the cause (what a wait on it by another
    kind's queue reads); then the timeline raised for good, waking the waiters."""
    native = runtime.queues[queue._native._q]  # type: ignore[attr-defined]
    native.error, native.error_value = int(error), value
    c_timeline = queue.timeline.native.c_timeline
    runtime.am_timeline_fail_from(c_timeline, value, int(error), value, c_timeline)
    queue.timeline.native.signal(MAX)


def _confirmed(queue: am.Queue) -> am.Completion:
    """A command on ``queue`` its completion thread confirmed."""
    done = queue._submit(numbered_only)
    queue.timeline.native.signal(done.value)
    return done


async def _failed_from_a_wait(
    queue: am.Queue, error: int, cause: tuple[int, int, int]
) -> am.Completion:
    """A command on ``queue`` (after one confirmed) that the simulated runtime fails
    with ``error`` from a wait whose timeline failed for ``cause`` (the failed timeline,
    its error, its value), the queue's timeline then settled: the command's completion."""
    runtime = cuda_backend._native.runtime()
    before = _confirmed(queue)
    waited = queue._submit(numbered_only)
    native = runtime.queues[queue._native._q]  # type: ignore[attr-defined]
    native.error, native.error_value = error, waited.value
    runtime.causes[queue._native._q] = cause  # type: ignore[attr-defined]
    queue.timeline.native.signal(MAX)
    await before
    return waited


async def _raised_twice(
    queue: am.Queue, waited: am.Completion, code: int, kind: type[Exception]
) -> BaseException:
    """What awaiting ``waited`` raises (of ``kind``), checked to be what a submission
    to ``queue`` now raises too: its native check refusing with ``code``."""
    with pytest.raises(kind) as caught:
        await waited
    with pytest.raises(kind) as refused:
        queue._native._check(code)
    assert str(refused.value) == str(caught.value)
    return caught.value


async def _now(call: Any, *args: Any) -> Any:
    """``call(*args)`` from a coroutine: what it raises is raised when awaited."""
    return call(*args)


@pytest.mark.anyio
async def test_a_fault_on_one_gpu_loses_every_cuda_device_of_the_process(
    anyio_backend: object, driver: _Driver
) -> None:
    """Two GPUs open; a kernel on cuda:1 faults (illegal address). Its completion raises
    DeviceLostError saying the process's CUDA state is lost -- and from then on cuda:0,
    opened before, says so too, before calling the driver: its alloc, kernel load, new
    queue, launch and copies, its commands not confirmed before, and opening cuda:0
    again (whose staging chunks the driver would now refuse to register). What cuda:0
    finished before stays finished; closing both devices still works."""
    runtime = cuda_backend._native.runtime()
    dev0 = await am.open_device("cuda:0")
    dev1 = await am.open_device("cuda:1")
    try:
        params = await dev0._params(SRC, "k")
        assert isinstance(params, tuple)
        kernel = await dev0._program(
            ("key", "k"), params, b"cubin", SRC, dev0._backend.compiler, None
        )
        buf, other = await dev0.alloc(64), await dev0.alloc(64)
        driver.fail["cuMemAlloc"] = CUresult.CUDA_ERROR_OUT_OF_MEMORY  # not sticky:
        with pytest.raises(am.OutOfMemoryError):  # the device is full, nothing more
            await dev0.alloc(128, timeout=0)
        del driver.fail["cuMemAlloc"]
        await (await dev0.alloc(64)).free()  # a block of 64 bytes in the cache
        before = _confirmed(dev0.queue)

        bad = _fault(dev1.queue, runtime, CUresult.CUDA_ERROR_ILLEGAL_ADDRESS)
        with pytest.raises(DeviceLostError, match=PROCESS_LOST) as caught:
            await bad
        first = (
            "CUDA_ERROR_ILLEGAL_ADDRESS, first seen by the command at value 1 on a stream of cuda:1"
        )
        assert first in str(caught.value)

        # The driver now fails these with the fault's error; none gets that far.
        for call in (
            "cuInit",
            "cuMemAlloc",
            "cuModuleLoadData",
            "cuStreamCreate",
            "cuMemHostRegister",
            "cuMemcpyHtoDAsync",
        ):
            driver.fail[call] = CUresult.CUDA_ERROR_ILLEGAL_ADDRESS
        calls = len(driver.calls)
        await before  # confirmed before the fault: it ran
        after = _confirmed(dev0.queue)  # a command the driver confirmed after it
        with pytest.raises(DeviceLostError, match=PROCESS_LOST):
            await after
        refused: list[tuple[str, Any]] = [
            ("allocating 256 bytes on cuda:0", lambda: dev0.alloc(256)),
            ("allocating 64 bytes on cuda:0", lambda: dev0.alloc(64)),  # a cached size
            ("compiling 'k' on cuda:0", lambda: dev0.compile(SRC, "k")),  # a loaded one
            (
                "loading kernel 'k' on cuda:0",
                lambda: dev0._program(
                    ("other", "k"), params, b"", SRC, dev0._backend.compiler, None
                ),
            ),
            ("a new queue on cuda:0", lambda: _now(dev0.new_queue)),
            ("a launch on cuda:0", lambda: _now(dev0.queue.launch, kernel, buf)),
            ("a copy from the host on cuda:0", lambda: dev0.queue.copy(buf, np.zeros(8))),
            ("a copy to the host on cuda:0", lambda: dev0.queue.copy(np.zeros(8), buf)),
            ("a copy on cuda:0", lambda: dev0.queue.copy(other, buf)),
            ("a new queue on cuda:1", lambda: _now(dev1.new_queue)),
            ("opening cuda:0", lambda: am.open_device("cuda:0")),
        ]
        for what, call in refused:
            with pytest.raises(DeviceLostError, match=PROCESS_LOST) as caught:
                await call()
            assert str(caught.value).startswith(f"{what}: "), str(caught.value)
            assert first in str(caught.value)
        assert driver.calls[calls:] == [], "a refused call got to the driver"
        assert dev0.queue.submitted == after.value  # nothing refused was numbered
        assert "cuda:0" in am.devices()  # listed still: opening it says why it fails
    finally:
        await dev1.close()
        await dev0.close()


@pytest.mark.anyio
async def test_opening_a_gpu_after_a_fault_nobody_saw_raises_device_lost(
    anyio_backend: object, driver: _Driver
) -> None:
    """A fault on cuda:1 no completion reported yet; cuda:0 is opened afresh and the
    driver refuses to register its staging chunks with the fault's error. The open
    raises DeviceLostError saying the process is lost -- not BufferError from the
    chunk's cleanup, not the bare driver error -- and cuda:1 reports it from then on."""
    dev1 = await am.open_device("cuda:1")
    try:
        driver.fail["cuMemHostRegister"] = CUresult.CUDA_ERROR_ILLEGAL_ADDRESS
        with pytest.raises(DeviceLostError, match=PROCESS_LOST) as caught:
            await am.open_device("cuda:0")
        assert "first seen by cuMemHostRegister on cuda:0" in str(caught.value)
        with pytest.raises(DeviceLostError, match="first seen by cuMemHostRegister on cuda:0"):
            await dev1.alloc(64)
        with pytest.raises(DeviceLostError, match=PROCESS_LOST):
            await am.open_device("cuda:0")
    finally:
        await dev1.close()


@pytest.mark.anyio
async def test_a_fault_first_seen_by_the_listing_of_gpus_raises_device_lost(
    anyio_backend: object, driver: _Driver
) -> None:
    """A sticky error no call noted yet (a context query that swallowed it) is first
    seen by the listing of GPUs at the next open: that open raises DeviceLostError
    saying the process is lost, naming cuda:1 still -- not DeviceNotFoundError, as if the
    GPU were gone. Checked: before, the listing came back empty and the open said
    "device 'cuda:1' is not available here" (the fault sweep met it now and then)."""
    dev0 = await am.open_device("cuda:0")
    try:
        driver.fail["cuInit"] = CUresult.CUDA_ERROR_ILLEGAL_ADDRESS
        with pytest.raises(DeviceLostError, match=PROCESS_LOST) as caught:
            await am.open_device("cuda:1")
        assert "first seen by cuInit" in str(caught.value)
        assert "cuda:1" in am.devices()
    finally:
        await dev0.close()


async def test_driver_calls_give_the_thread_its_current_context_back(
    anyio_backend: object, driver: _Driver
) -> None:
    """The current context is per thread and shared with other libraries: after opening
    a device, allocating, making queues and timelines, and closing, the calling thread
    has the context it had before -- none, or another library's -- though each of those
    made the device's current while it called the driver."""
    local = threading.local()  # the fake's current context, per thread as the driver's

    def get_current() -> tuple[Any, ...]:
        return driver._result("cuCtxGetCurrent", getattr(local, "current", 0))

    def set_current(context: int) -> tuple[Any, ...]:
        result = driver._result("cuCtxSetCurrent")
        if result[0] == 0:
            local.current = int(context)
        return result

    driver.cuCtxGetCurrent = get_current  # type: ignore[method-assign]
    driver.cuCtxSetCurrent = set_current  # type: ignore[method-assign]
    for theirs in (0, 0xC0FFEE):
        local.current = theirs
        dev = await am.open_device("cuda:0")
        assert local.current == theirs, "open_device"
        await dev.alloc(256)
        assert local.current == theirs, "alloc"
        dev.new_queue()
        assert local.current == theirs, "new_queue"
        for _ in range(600):  # past the first arena of timeline slots: more are pinned
            dev.timeline()
        assert local.current == theirs, "timeline"
        await dev.close()
        assert local.current == theirs, "close"


async def test_a_lone_marker_is_polled_and_one_behind_others_is_not(
    anyio_backend: object, driver: _Driver
) -> None:
    """A marker with everything before it confirmed (one request awaited at a time) asks
    the completion thread to poll it for MARKER_POLL_NS rather than block on it after
    the usual short poll, and its awaiting task to check for it until then rather than
    park; one submitted behind unconfirmed commands asks for neither (with many in
    flight the thread's queries would contend with the submitting library's). Checked:
    fails with every marker finished alike."""
    from asyncmetal.backends.cuda import _queue as cuda_queue

    assert driver.runtime is not None
    finished: list[tuple[int, int]] = []  # (value, expected ns) of each command ended

    def am_cuq_finish(q: int, value: int, extra: Any, target: int, ns: int, flags: int) -> int:
        finished.append((value, ns))
        return 0

    driver.runtime.am_cuq_finish = am_cuq_finish  # type: ignore[attr-defined]
    dev = await am.open_device("cuda:0")
    queue = dev.new_queue()
    word = queue._native._timeline._value  # the queue's own timeline, as the stream writes it
    markers = [queue.marker()]  # nothing before it
    markers.append(queue.marker())  # behind the first, unconfirmed
    word.value = 2  # both confirmed
    markers.append(queue.marker())
    assert finished == [(1, cuda_queue.MARKER_POLL_NS), (2, 0), (3, cuda_queue.MARKER_POLL_NS)]
    # ... and its awaiting task reads for it until then (due), not for the other
    assert [m._due_ns > 0 for m in markers] == [True, False, True]
    word.value = 3
    await dev.close()


async def test_a_device_wait_on_a_timeline_no_queue_owns_is_confirmed_by_its_value(
    anyio_backend: object, driver: _Driver
) -> None:
    """A queue's device wait on a timeline no queue owns ends with that timeline and
    FINISH_WAITED: its completion thread confirms it once the timeline's value got there
    (not when the word did: a signal that failed may have written it, or the timeline
    settled), and fails the queue from that wait on if the timeline failed instead
    (native/cuda_completion.c; the runtime's side is fake_cuda.c's 'signal' check). A
    wait on a queue's own timeline does not. Checked: the wait ended without the
    timeline before."""
    from asyncmetal.backends.cuda import _queue as cuda_queue

    assert driver.runtime is not None
    finished: list[tuple[int, int | None, int, int]] = []

    def am_cuq_finish(q: int, value: int, extra: Any, target: int, ns: int, flags: int) -> int:
        finished.append((value, extra, target, flags))
        return 0

    runtime: Any = driver.runtime
    runtime.am_cuq_finish = am_cuq_finish
    runtime.am_cuq_wait_timeline = lambda q, timeline, target, value: 0
    runtime.am_cuq_wait_queue = lambda q, other, target, value: 0
    dev = await am.open_device("cuda:0")
    try:
        timeline, queue, other = dev.timeline(), dev.new_queue(), dev.new_queue()
        queue.wait(timeline, 3)
        queue.wait(other.timeline, 1)
        plain, waited = cuda_queue.FINISH_PLAIN, cuda_queue.FINISH_WAITED
        assert finished == [
            (1, timeline.native.c_timeline, 3, plain | waited),
            (2, other.timeline.native.c_timeline, 1, plain),
        ]
        queue._native._timeline._value.value = 2  # both confirmed
    finally:
        await dev.close()


async def test_the_null_stream_is_the_legacy_one_and_a_consumer_gets_buffer_errors(
    anyio_backend: object, driver: _Driver
) -> None:
    """Adopting stream 0 (the NULL stream) and stream 1 (CU_STREAM_LEGACY) gives one
    queue: both are the legacy default stream (two queues ordered it on two timelines).
    A DLPack consumer whose stream cannot be ordered on (the per-thread default stream,
    2) gets the protocol's BufferError. Checked: two queues, and InvalidArgumentError,
    before."""
    dev = await am.open_device("cuda:0")
    try:
        assert dev.adopt_stream(0) is dev.adopt_stream(1)
        buf = await dev.alloc(256)
        with pytest.raises(BufferError, match="per-thread default stream"):
            buf.__dlpack__(stream=2)
    finally:
        await dev.close()


async def test_a_stream_handle_is_any_integer_and_one_past_64_bits_is_refused(
    anyio_backend: object, driver: _Driver
) -> None:
    """adopt_stream takes a raw handle as any integer with ``__index__`` (a numpy
    scalar: the same stream, so the same queue), not a bool; a handle that is no 64-bit
    address is InvalidArgumentError, before any driver call. Checked: fails without the
    fix (numpy's integers were ArgumentTypeError, and 2**64 was adopted: with the real
    bindings, an OverflowError)."""
    dev = await am.open_device("cuda:0")
    try:
        queue = dev.adopt_stream(0x5000)
        assert dev.adopt_stream(np.int64(0x5000)) is queue
        assert dev.adopt_stream(np.uint64(0x5000)) is queue
        with pytest.raises(am.ArgumentTypeError, match="adopt_stream takes a stream"):
            dev.adopt_stream(np.True_)  # (True is an int to the fake's CUstream)
        for handle in (1 << 64, np.int64(-0x5000), -1):
            calls = len(driver.calls)
            with pytest.raises(am.InvalidArgumentError, match="from 0 to 2\\*\\*64-1"):
                dev.adopt_stream(handle)
            assert driver.calls[calls:] == []
    finally:
        await dev.close()


class _ProtocolStream:
    """A stream of the CUDA stream protocol whose ``__cuda_stream__`` gives ``value``."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __cuda_stream__(self) -> object:
        return self.value


async def test_a_protocol_streams_handle_is_an_integer_as_a_raw_one_is(
    anyio_backend: object, driver: _Driver
) -> None:
    """``__cuda_stream__``'s handle is taken as a raw handle is -- any integer with
    ``__index__``, not a bool -- for adopt_stream and for a DLPack consumer alike; a
    float, a string, a bool or None is refused naming the protocol, before any driver
    call. Checked: fails without the fix (1.9 and True adopted the legacy stream,
    "20480" stream 0x5000, and None raised int()'s own TypeError)."""
    dev = await am.open_device("cuda:0")
    try:
        queue = dev.adopt_stream(0x5000)
        assert dev.adopt_stream(_ProtocolStream((0, np.uint64(0x5000)))) is queue
        buf = await dev.alloc(256)
        for value in ((0, 1.9), (0, "20480"), (0, True), (0, None), (False, 0x5000), (0.0, 1)):
            calls = len(driver.calls)
            with pytest.raises(am.InvalidArgumentError, match="__cuda_stream__ must give"):
                dev.adopt_stream(_ProtocolStream(value))
            with pytest.raises(am.ExchangeError, match="__cuda_stream__ must give"):
                buf.__dlpack__(stream=_ProtocolStream(value))
            assert driver.calls[calls:] == []
    finally:
        await dev.close()


async def test_a_new_stream_given_a_destroyed_streams_handle_gets_a_new_queue(
    anyio_backend: object, driver: _Driver
) -> None:
    """Another library destroys a stream whose adopted queue still lives, and its next
    stream gets the same handle: adopting that stream gives a new queue (the driver's
    id of it, cuStreamGetId, is another), and adopting it again that one. Where the
    driver has no cuStreamGetId (the bindings raise RuntimeError), streams are known by
    their handles alone, the driver asked once. Checked: fails without the fix (the old
    stream's queue was given for the new stream)."""
    dev = await am.open_device("cuda:0")
    try:
        old = dev.adopt_stream(0x5000)
        assert dev.adopt_stream(0x5000) is old
        driver.cuStreamDestroy(0x5000)  # their stream goes; their next one is 0x5000 too
        new = dev.adopt_stream(0x5000)
        assert new is not old and not old.closed
        assert dev.adopt_stream(0x5000) is new
        assert dev.adopt_stream(1) is dev.adopt_stream(0)  # (the legacy stream: no id)

        def no_such_function(stream: int) -> tuple[Any, ...]:
            driver.calls.append("cuStreamGetId")
            raise RuntimeError('Function "cuStreamGetId" not found')

        driver.cuStreamGetId = no_such_function  # type: ignore[method-assign]
        asked = driver.calls.count("cuStreamGetId")
        known = dev.adopt_stream(0x6000)
        driver.cuStreamDestroy(0x6000)
        assert dev.adopt_stream(0x6000) is known  # (the handle is all there is to go by)
        assert driver.calls.count("cuStreamGetId") == asked + 1
    finally:
        await dev.close()


async def test_the_stream_of_one_of_the_devices_own_queues_is_refused_for_adoption(
    anyio_backend: object, driver: _Driver
) -> None:
    """``dev.adopt_stream(q.handle)`` (``torch.cuda.ExternalStream(q.handle)``, say) is
    refused, naming the queue to submit to: a second queue over the stream would number
    its commands apart from q's, and q's close destroys the stream under it. A closed
    queue's stream is not refused (its handle may be another stream's by then), nor
    another library's. Checked: fails without the fix (a second queue was made)."""
    dev = await am.open_device("cuda:0")
    try:
        own = dev.new_queue()
        for queue in (dev.queue, own):
            assert queue.handle is not None
            with pytest.raises(am.InvalidArgumentError, match="submit to that queue itself"):
                dev.adopt_stream(queue.handle)
        handle = own.handle
        await own.close()
        driver.cuStreamDestroy(handle)  # (the fake's next stream of that handle is new)
        assert dev.adopt_stream(handle) is dev.adopt_stream(handle)
        assert dev.adopt_stream(0x5000) is dev.adopt_stream(0x5000)
    finally:
        await dev.close()


async def test_closing_a_cuda_queue_releases_its_stream_and_leaves_an_adopted_one_to_its_owner(
    anyio_backend: object, driver: _Driver
) -> None:
    """Queue.close releases a queue's native side (its completion thread: am_cuq_close)
    and destroys the stream it made; an adopted stream's queue releases asyncmetal's
    side only, and adopting the stream again gives a new queue."""
    assert driver.runtime is not None
    dev = await am.open_device("cuda:0")
    try:
        kept = len(driver.runtime.queues)
        made, adopted = dev.new_queue(), dev.adopt_stream(1)
        assert len(driver.runtime.queues) == kept + 2
        await made.close()
        assert len(driver.runtime.queues) == kept + 1
        assert driver.calls.count("cuStreamDestroy") == 1
        await adopted.close()
        assert len(driver.runtime.queues) == kept
        assert driver.calls.count("cuStreamDestroy") == 1  # the stream stays its owner's
        with pytest.raises(am.ClosedResourceError):
            adopted.marker()
        again = dev.adopt_stream(1)
        assert again is not adopted and not again.closed
    finally:
        await dev.close()
    assert driver.calls.count("cuStreamDestroy") == 2  # the default queue's: none twice


async def test_adopting_a_stream_whose_queue_is_closing_gives_a_new_queue(
    anyio_backend: object, driver: _Driver
) -> None:
    """An adopted stream's queue whose close waits for its commands refuses every
    command from the close on; adopting the stream meanwhile gives a new queue, usable
    at once, which that close then leaves alone. Checked: fails without the fix (the
    closing queue was given again, and its marker raised ClosedResourceError)."""
    assert driver.runtime is not None
    runtime: Any = driver.runtime
    runtime.am_cuq_finish = lambda q, value, extra, target, ns, flags: 0  # (confirmed below)
    dev = await am.open_device("cuda:0")
    adopted = dev.adopt_stream(1)
    pending = adopted.marker()  # unconfirmed: the close waits for it
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(adopted.close)
                while not adopted.closed:
                    await anyio.lowlevel.checkpoint()  # (its task seals it first thing)
                again = dev.adopt_stream(1)
                assert again is not adopted and not again.closed
                marker = again.marker()  # not refused
                assert dev.adopt_stream(1) is again
                adopted.timeline.native.signal(pending.value)
            assert dev.adopt_stream(1) is again and not again.closed  # the close left it
            again.timeline.native.signal(marker.value)
            await marker
    finally:
        adopted.timeline.native.signal(pending.value)  # (the fake confirms nothing)
        await dev.close()


async def test_a_dropped_cuda_queue_releases_its_stream_once_its_commands_ran(
    anyio_backend: object, driver: _Driver
) -> None:
    """A queue dropped with a command its completion thread has not confirmed keeps its
    stream; once it is confirmed, the queue is released (am_cuq_close, the stream
    destroyed) on another thread, with no new_queue() after the drop (which alone
    released it before) and no close."""
    assert driver.runtime is not None
    dev = await am.open_device("cuda:0")
    try:
        kept = len(driver.runtime.queues)
        queue = dev.new_queue()
        timeline = queue.timeline
        value = queue._submit(numbered_only).value  # in flight until confirmed
        del queue
        gc.collect()
        await anyio.sleep(0.2)  # (the device looks for idle queues meanwhile)
        assert len(driver.runtime.queues) == kept + 1
        assert driver.calls.count("cuStreamDestroy") == 0
        timeline.native.signal(value)  # its completion thread confirms it
        with anyio.fail_after(10):
            while len(driver.runtime.queues) > kept or "cuStreamDestroy" not in driver.calls:
                await anyio.sleep(0.01)
        assert driver.calls.count("cuStreamDestroy") == 1
    finally:
        await dev.close()
    assert driver.calls.count("cuStreamDestroy") == 2  # the default queue's: none twice


ADOPTED = 64  # streams adopted one after another, each queue dropped once its work ran


async def test_queues_of_adopted_streams_dropped_once_their_work_ran_are_released(
    anyio_backend: object, driver: _Driver
) -> None:
    """A stream adopted per request, its queue dropped once its marker (and a command
    using a buffer, on the buffer's record of uses) was awaited, is released as a
    new_queue() is: its native queue (its completion thread, am_cuq_close) goes, the
    stream stays its owner's; so ADOPTED streams leave no native queue each. A queue
    still held, let go of by the device meanwhile, is still the one adopting its
    stream gives, and takes commands. Checked: fails without the fix (every adopted
    queue was kept until the device's close)."""
    assert driver.runtime is not None
    runtime: Any = driver.runtime
    runtime.am_cuq_finish = lambda q, value, extra, target, ns, flags: 0  # (confirmed below)
    dev = await am.open_device("cuda:0")
    try:
        buf = await dev.alloc(256)
        kept = len(runtime.queues)
        held = dev.adopt_stream(0x7000_0000)
        for i in range(ADOPTED):
            queue = dev.adopt_stream(0x8000_0000 + 0x1000 * i)
            assert dev.adopt_stream(0x8000_0000 + 0x1000 * i) is queue
            queue._submit(numbered_only, uses=[buf])
            marker = queue.marker()
            queue.timeline.native.signal(marker.value)  # its completion thread confirms it
            with anyio.fail_after(10):
                await marker
            del queue, marker
        with anyio.fail_after(20):
            while len(runtime.queues) > kept + 1:  # (released by the reaper, on threads)
                await anyio.sleep(0.01)
        assert dev.adopt_stream(0x7000_0000) is held
        marker = held.marker()
        held.timeline.native.signal(marker.value)
        with anyio.fail_after(10):
            await marker
        assert len(runtime.queues) == kept + 1
        assert driver.calls.count("cuStreamDestroy") == 0  # the streams stay their owners'
    finally:
        await dev.close()
    assert not runtime.queues


class _Confirming:
    """A queue whose marker the fake's completion thread confirms at once (for
    check_queue_making_interrupted, which awaits one)."""

    def __init__(self, queue: am.Queue) -> None:
        self.queue = queue

    def marker(self) -> am.Completion:
        marker = self.queue.marker()
        self.queue.timeline.native.signal(marker.value)
        return marker


async def test_a_keyboard_interrupt_as_a_stream_is_adopted_leaves_none_unreleased(
    anyio_backend: object, driver: _Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt wherever CPython delivers one in adopt_stream (and the
    Queue's making and recording, as new_queue's) either comes after the caller got the
    queue, or leaves nothing of it: every native queue made over the stream is released
    by the device's close at the latest, and adopting the stream again works."""
    assert driver.runtime is not None
    runtime: Any = driver.runtime
    runtime.am_cuq_finish = lambda q, value, extra, target, ns, flags: 0  # (confirmed above)
    at = await check_queue_making_interrupted(
        monkeypatch,
        "cuda:0",
        "adopt_queue",
        cuda_queue.CUDAQueue,
        lambda device: _Confirming(device.adopt_stream(0x5000)),
    )
    assert at >= 8


@pytest.mark.anyio
@pytest.mark.parametrize("held", [False, True], ids=["ran", "held"])
async def test_a_command_that_waited_for_a_failed_commands_value_names_it(
    anyio_backend: object, driver: _Driver, held: bool
) -> None:
    """A queue of cuda:1 waited on the device for a value of cuda:0's default queue,
    whose command at value 7 the driver refused (native/cuda_completion.c then fails the
    waiting queue's commands from the wait on: they ran on data never produced) -- or,
    its wait held on the host until that refusal was known, never handed to the stream
    (HELD_FAILED: native/cuda_submit.c, stream_wait_queue). Its completions, and a
    submission to it, raise an error naming that command and its device, not a CUDA
    error of their own, saying whether they ran; not DeviceLostError (nothing sticky).
    Checked (held): named as a cpu queue's failure (an error number) before."""
    from asyncmetal.backends.cuda import _queue as cuda_queue

    dev0 = await am.open_device("cuda:0")
    dev1 = await am.open_device("cuda:1")
    try:
        queue = dev1.new_queue()
        failed = (dev0.queue.timeline.native.c_timeline, CUresult.CUDA_ERROR_INVALID_VALUE, 7)
        code = cuda_queue.HELD_FAILED if held else cuda_queue.WAITED_FAILED
        waited = await _failed_from_a_wait(queue, code, failed)
        ran = "did not run: it follows" if held else "ran after"
        expected = (
            f"the command at value {waited.value} on a stream of cuda:1 {ran} a "
            "device-side wait for a value that was never produced: the command at value 7 "
            "on a stream of cuda:0 failed: CUDA_ERROR_INVALID_VALUE" + LATER_FAIL
        )
        error = await _raised_twice(queue, waited, code, am.AsyncMetalError)
        assert str(error) == expected and not isinstance(error, DeviceLostError)
    finally:
        await dev0.close()
        await dev1.close()


@pytest.mark.anyio
async def test_a_cuda_command_held_behind_a_failed_cpu_timeline_did_not_run(
    anyio_backend: object, driver: _Driver
) -> None:
    """A cuda queue's wait held on the host for a cpu queue's timeline, which failed
    instead (its command 3 was discarded): the native runtime hands nothing from that
    wait on to the stream and fails the queue from there (HELD_FAILED: no kernel
    launched, tests/support/native/fake_cuda.c, hostfailed). Its completions, and a
    submission to it, raise what a cpu command behind a failed wait raises -- that it
    did not run, naming the command where the failure began -- not that it ran after
    the wait."""
    from asyncmetal.backends.cuda import _queue as cuda_queue

    dev = await am.open_device("cuda:0")
    cpu = await am.open_device("cpu")
    try:
        queue = dev.new_queue()
        failed = (cpu.queue.timeline.native.c_timeline, _native.DISCARDED, 3)
        waited = await _failed_from_a_wait(queue, cuda_queue.HELD_FAILED, failed)
        expected = (
            "this command did not run: it follows a device-side wait for a value that "
            "command 3 of a queue of cpu never produced: it was discarded, not started when "
            # (made up here: no close of the queue or device recorded it)
            "its queue (or its device) was closed with discard=True" + LATER_FAIL
        )
        error = await _raised_twice(queue, waited, cuda_queue.HELD_FAILED, am.ClosedResourceError)
        assert str(error) == expected
    finally:
        await cpu.close()
        await dev.close()


@pytest.mark.anyio
async def test_a_cpu_command_after_a_failed_cuda_command_names_it(
    anyio_backend: object, driver: _Driver
) -> None:
    """A cpu write of a buffer waits, on the device, for a cuda command's pending use of
    it (a copy between kinds reading it in place), whose kernel then faults: the cpu
    queue's wait on the cuda queue's timeline fails the write (it never runs), and its
    error names the cuda command and its fault (DeviceLostError: the fault is sticky),
    as for a wait on a failed command of the cpu's own kind. The cuda command's own
    completion still raises the cuda error it did, from its queue's error. (That the
    completion thread fails the timeline it settles: tests/support/native/fake_cuda.c,
    hostwait.)"""
    from asyncmetal._buffer import record_uses

    runtime = cuda_backend._native.runtime()
    dev = await am.open_device("cuda:0")
    cpu = await am.open_device("cpu")
    try:
        buf = await cpu.alloc(64)
        await cpu.queue.copy(buf, np.zeros(16, np.int32))
        use = dev.queue._submit(numbered_only)
        record_uses([buf], dev.queue, use.value)
        write = cpu.queue.copy(buf, np.full(16, 7, np.int32))  # after the use, on the device
        _failed(dev.queue, runtime, use.value, CUresult.CUDA_ERROR_ILLEGAL_ADDRESS)
        with pytest.raises(DeviceLostError, match=PROCESS_LOST) as caught:
            with anyio.fail_after(10):
                await write
        message = str(caught.value)
        assert message.startswith(
            "this command did not run: it follows a device-side wait for a value that "
            f"command {use.value} of a queue of cuda:0 never produced: the command at value "
            f"{use.value} on a stream of cuda:0 failed with CUDA_ERROR_ILLEGAL_ADDRESS"
        ), message
        assert LATER_FAIL in message
        out = np.ones(16, np.int32)
        await cpu.new_queue().copy(out, buf)
        assert not out.any()  # the write never ran
        with pytest.raises(DeviceLostError, match=PROCESS_LOST) as caught:
            await use
        assert str(caught.value).startswith(
            f"the command at value {use.value} on a stream of cuda:0 failed with "
            "CUDA_ERROR_ILLEGAL_ADDRESS"
        )
    finally:
        await cpu.close()
        await dev.close()


@pytest.mark.anyio
async def test_a_cuda_queue_waits_for_a_cpu_queues_pending_use_of_a_buffer(
    anyio_backend: object, driver: _Driver
) -> None:
    """A cpu write of a buffer is held (its queue behind a timeline not signalled yet);
    a cuda queue ordered after that buffer (``after``, as a copy of lent memory of it
    is) submits a device wait on the cpu queue's timeline for the write -- which the
    native runtime holds on the host until the cpu queue's thread raised it
    (tests/support/native/fake_cuda.c, hostheld) -- confirmed by that timeline's value,
    and failed if it fails. Before, a cuda queue skipped another kind's uses: nothing
    ordered it after the write."""
    from asyncmetal.backends.cuda import _queue as cuda_queue
    from tests.support.queues import held_queue

    runtime: Any = driver.runtime
    waits: list[tuple[int, int, int]] = []
    finishes: list[tuple[int, int, int, int]] = []
    runtime.am_cuq_wait_timeline = lambda q, t, target, value: waits.append((t, target, value)) or 0
    runtime.am_cuq_finish = lambda q, value, extra, target, ns, flags: (
        finishes.append((value, extra, target, flags)) or 0
    )
    dev = await am.open_device("cuda:0")
    cpu = await am.open_device("cpu")
    try:
        buf = await cpu.alloc(64)
        held, gate = held_queue(cpu)
        write = held.copy(buf, np.full(16, 7, np.int32))
        queue = dev.new_queue()
        queue.after(buf)
        c_timeline = held.timeline.native.c_timeline
        assert waits == [(c_timeline, write.value, queue.submitted)]
        flags = cuda_queue.FINISH_PLAIN | cuda_queue.FINISH_WAITED
        assert finishes == [(queue.submitted, c_timeline, write.value, flags)]
        gate.signal(1)
        with anyio.fail_after(10):
            await write
        queue.timeline.native.signal(queue.submitted)  # its completion thread confirms it
    finally:
        await cpu.close()
        await dev.close()


@pytest.mark.anyio
async def test_a_staged_copy_behind_a_wait_on_a_cpu_queue_reads_its_source_after_it(
    anyio_backend: object, driver: _Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cuda queue holds a wait for a cpu queue's pending write (``after``), then copies
    from pageable host memory through staging chunks: the host threads that fill each
    chunk read the source only once the stream wrote a mark behind that wait (held on
    the host until the cpu write ran) -- not as soon as the chunk is free, which would
    read the source (lent memory the cpu write writes, say) before the write ran."""
    from asyncmetal.backends.cuda import _timeline
    from tests.support.queues import held_queue

    runtime: Any = driver.runtime
    calls: list[tuple[Any, ...]] = []

    def record(name: str) -> Any:
        return lambda q, *args: calls.append((name, *args)) or 0

    for name in ("wait_timeline", "finish", "wait", "mark", "memcpy"):
        setattr(runtime, f"am_cuq_{name}", record(name))

    def fill(
        copier: Any, dst: int, src: int, n: int, keep: object, chunk: Any, after: Any
    ) -> tuple[Any, int]:
        calls.append(("fill", None if after is None else (after[0].c_timeline, after[1])))
        if chunk.ready is None:
            chunk.ready = _timeline.CUDATimeline(copier._backend)
        return chunk.ready, 1

    monkeypatch.setattr(_staging._HostCopier, "copy", fill)
    dev = await am.open_device("cuda:0")
    cpu = await am.open_device("cpu")
    try:
        buf = await cpu.alloc(64)
        held, gate = held_queue(cpu)
        write = held.copy(buf, np.full(16, 7, np.int32))
        queue = dev.new_queue()
        queue.after(buf)
        assert calls[0][:2] == ("wait_timeline", held.timeline.native.c_timeline)
        del calls[:]
        dst = await dev.alloc(3 * _staging.STAGE_CHUNK)
        queue.copy(dst, np.zeros(3 * _staging.STAGE_CHUNK, np.uint8))  # 3 chunks
        gate.signal(1)
        with anyio.fail_after(10):
            await write
        queue.timeline.native.signal(queue.submitted)  # its completion thread confirms it
        fills = [i for i, call in enumerate(calls) if call[0] == "fill"]
        assert len(fills) == 3
        for i in fills:  # each after a mark the stream writes (behind the wait) just before
            assert calls[i][1] is not None, "a chunk is filled before the held wait ended"
            assert calls[i - 1][0] == "mark" and calls[i - 1][1:3] == calls[i][1], calls
    finally:
        await cpu.close()
        await dev.close()


async def test_a_submission_out_of_host_memory_raises_memory_error(
    anyio_backend: object, driver: _Driver
) -> None:
    """A submission the native runtime had no host memory for (-1, native/cuda_submit.c:
    cuq_no_memory) raises MemoryError, an AsyncMetalError: nothing of it was submitted,
    and its value is given back; or, where part of it had reached the driver (the
    queue's error is then -1 from that command on), saying that the queue fails from that
    command on -- as do the submissions after it. Checked: before, both raised
    MemoryError saying the completion ring could not grow."""
    assert driver.runtime is not None
    runtime: Any = driver.runtime
    runtime.am_cuq_finish = lambda q, value, extra, target, ns, flags: -1
    dev = await am.open_device("cuda:0")
    try:
        queue = dev.new_queue()
        with pytest.raises(MemoryError, match="nothing of it was submitted") as caught:
            queue.marker()
        assert isinstance(caught.value, am.AsyncMetalError)
        assert queue.submitted == 0  # the value given back
        native = runtime.queues[queue._native._q]  # type: ignore[attr-defined]
        native.error, native.error_value = -1, 1
        failed = (
            "out of host memory for the command at value 1 on a stream of cuda:0, after part "
            "of it was handed to the driver: the queue fails from that command on"
        )
        for _ in range(2):
            with pytest.raises(MemoryError, match=re.escape(failed)):
                queue.marker()
        assert queue.submitted == 0
    finally:
        await dev.close()


@pytest.mark.anyio
async def test_a_timeline_collected_while_its_backend_makes_slots_does_not_deadlock(
    anyio_backend: object, driver: _Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collection can run inside ``_timeline_slot`` (it allocates an arena, holding
    the slot lock) and finalize a dropped timeline there, on the same thread; the
    finalizer gives its slot back. That took the slot lock, and the thread waited for
    itself for good (seen on the H200 as a new_queue hanging once the device's reaper
    made dropped queues garbage)."""
    dev = await am.open_device("cuda:0")
    try:
        timeline = dev.timeline()
        backend = timeline.native._backend
        real = cuda_backend.Pinned

        def collecting(*args: Any) -> Any:
            gc.collect()  # (the dropped timeline's finalizer runs here)
            return real(*args)

        gc.disable()
        try:
            cycle: list[Any] = [timeline]
            cycle.append(cycle)
            del timeline, cycle
            backend._free_slots.clear()  # the next slot makes an arena
            monkeypatch.setattr(cuda_backend, "Pinned", collecting)
            taker = threading.Thread(target=backend._timeline_slot, daemon=True)
            taker.start()
            taker.join(10)
            assert not taker.is_alive(), "the slot's taker waited for itself"
        finally:
            gc.enable()
    finally:
        await dev.close()


async def test_a_failing_context_query_raises_a_driver_error_and_loses_nothing(
    anyio_backend: object, driver: _Driver
) -> None:
    """cuCtxGetCurrent fails (the driver deinitialized, say). Where it fails before an
    allocation, the allocation raises the driver's error as an AsyncMetalError, having
    done nothing; where only the query after it fails, the allocation stands and the
    context that was current is set back. Checked: TypeError (int(None)) before, and
    the allocation's memory lost with it."""
    dev = await am.open_device("cuda:0")
    try:
        driver.fail["cuCtxGetCurrent"] = CUresult.CUDA_ERROR_INVALID_VALUE
        allocs = driver.calls.count("cuMemAlloc")
        with pytest.raises(am.AsyncMetalError, match="cuCtxGetCurrent failed"):
            await dev.alloc(1 << 20)
        assert driver.calls.count("cuMemAlloc") == allocs
        del driver.fail["cuCtxGetCurrent"]

        queries = 0
        real = driver.cuCtxGetCurrent

        def second_fails() -> tuple[Any, ...]:
            nonlocal queries
            queries += 1
            if queries == 3:  # the query after the allocation (2: make_current's)
                return (CUresult.CUDA_ERROR_INVALID_VALUE, None)
            return real()

        driver.cuCtxGetCurrent = second_fails  # type: ignore[method-assign]
        driver.current = 0xC0FFEE  # another library's
        buf = await dev.alloc(1 << 20)
        assert driver.calls.count("cuMemAlloc") == allocs + 1
        assert driver.current == 0xC0FFEE
        driver.cuCtxGetCurrent = real  # type: ignore[method-assign]
        await buf.free()
    finally:
        await dev.close()


@pytest.mark.parametrize(
    ("to_device", "refused"),
    [
        (True, "am_cuq_memcpy"),
        (True, "am_cuq_mark"),
        (True, "am_cuq_wait"),  # (its wait for the chunk's fill)
        (False, "am_cuq_memcpy"),
        (False, "am_cuq_mark"),
    ],
    ids=["write-dma", "write-mark", "write-wait", "read-dma", "read-mark"],
)
async def test_a_staged_copy_the_driver_refuses_part_of_gives_its_chunk_back(
    anyio_backend: object,
    driver: _Driver,
    monkeypatch: pytest.MonkeyPatch,
    refused: str,
    to_device: bool,
) -> None:
    """A pageable copy through three staging chunks whose second chunk's DMA, mark or
    wait the driver refuses raises the driver's error; the chunk it was staging through
    is not lost: the queue's close gives it back to the device's pool (and the
    device's close unmaps it). Checked: before, the chunk was in neither the queue's
    ring nor the pool, left pinned and mapped for good."""
    runtime: Any = driver.runtime
    calls = {"n": 0}

    def submitted(name: str) -> Any:
        def call(q: int, *args: Any) -> int:
            if name != refused:
                return 0
            calls["n"] += 1
            if calls["n"] < (2 if name != "am_cuq_wait" else 3):
                return 0
            runtime.queues[q].failed_call = 0
            return int(CUresult.CUDA_ERROR_INVALID_VALUE)

        return call

    for name in ("am_cuq_memcpy", "am_cuq_mark", "am_cuq_wait", "am_cuq_finish"):
        setattr(runtime, name, submitted(name))

    def fill(
        copier: Any, dst: int, src: int, n: int, keep: object, chunk: Any, after: Any
    ) -> tuple[Any, int]:
        if chunk.ready is None:
            chunk.ready = cuda_backend.CUDATimeline(copier._backend)
        return chunk.ready, 1

    monkeypatch.setattr(_staging._HostCopier, "copy", fill)
    mapped = set(_staging._MAPPED)
    dev = await am.open_device("cuda:0")
    try:
        pool = len(dev._backend._chunks)  # type: ignore[attr-defined]
        buf = await dev.alloc(3 * _staging.STAGE_CHUNK)
        host = np.zeros(3 * _staging.STAGE_CHUNK, np.uint8)
        queue = dev.new_queue()
        with pytest.raises(am.AsyncMetalError, match="CUDA_ERROR_INVALID_VALUE"):
            queue.copy(buf, host) if to_device else queue.copy(host, buf)
        await queue.close()
        assert len(dev._backend._chunks) == pool  # type: ignore[attr-defined]
    finally:
        await dev.close()
    assert set(_staging._MAPPED) == mapped


@pytest.mark.parametrize(
    "error", [CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, CUresult.CUDA_ERROR_INVALID_VALUE]
)
async def test_importing_cuda_memory_after_a_fault_raises_device_lost(
    anyio_backend: object, driver: _Driver, error: CUresult
) -> None:
    """from_dlpack of an array with ``__cuda_array_interface__`` asks the driver which
    GPU holds its memory. Where the driver answers with a sticky error, the import
    raises DeviceLostError saying the process is lost -- not that no open device holds
    the memory (the driver's answer to memory it does not know, which stays
    InvalidArgumentError). Checked: InvalidArgumentError for both before."""
    driver.CUpointer_attribute = types.SimpleNamespace(  # type: ignore[attr-defined]
        CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL=9
    )
    driver.cuPointerGetAttribute = lambda attribute, address: (error, None)  # type: ignore[attr-defined]

    class Producer:
        __cuda_array_interface__: ClassVar[dict[str, Any]] = {
            "shape": (16,),
            "typestr": "<i4",
            "data": (0x7000_0000, False),
            "version": 3,
        }

    dev = await am.open_device("cuda:0")
    try:
        if error == CUresult.CUDA_ERROR_INVALID_VALUE:
            with pytest.raises(am.InvalidArgumentError, match="no open device holds"):
                am.from_dlpack(Producer())
        else:
            with pytest.raises(DeviceLostError, match=PROCESS_LOST):
                am.from_dlpack(Producer())
    finally:
        await dev.close()


@pytest.mark.anyio
async def test_a_context_that_cannot_be_made_current_again_is_warned_of(
    anyio_backend: object, driver: _Driver
) -> None:
    """The driver refuses to make the caller's context current again after a call: the
    call's result is kept (the queue it made works and closes) and so is its error
    (a stream the driver would not make), and each time a RuntimeWarning names the
    context left unrestored -- never silence, with the thread left on the device's.
    Checked: before, nothing was said."""
    theirs = 0xC0FFEE

    def set_current(context: int) -> tuple[Any, ...]:
        if int(context) == theirs:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        driver.current = int(context)
        return (CUresult.CUDA_SUCCESS,)

    dev = await am.open_device("cuda:0")
    try:
        driver.current = theirs
        driver.cuCtxSetCurrent = set_current  # type: ignore[method-assign]
        unrestored = r"context \(0xc0ffee\) could not be made current again.*INVALID_VALUE"
        with pytest.warns(RuntimeWarning, match=unrestored):
            queue = dev.new_queue()
        assert driver.current != theirs  # (what the warning is about)
        driver.current = theirs
        driver.fail["cuStreamCreate"] = CUresult.CUDA_ERROR_OUT_OF_MEMORY
        with (
            pytest.warns(RuntimeWarning, match=unrestored),
            pytest.raises(MemoryError, match="cuStreamCreate"),
        ):
            dev.new_queue()
        del driver.fail["cuStreamCreate"]
        del driver.cuCtxSetCurrent
        await queue.close()
    finally:
        await dev.close()


@pytest.mark.parametrize("make", ["new_queue", "adopt_stream"])
async def test_a_stream_being_made_or_adopted_holds_no_submission_lock(
    anyio_backend: object, driver: _Driver, monkeypatch: pytest.MonkeyPatch, make: str
) -> None:
    """new_queue (cuStreamCreate, the completion thread: am_cuq_new) and adopt_stream
    make their native queue outside the device's submission lock: another thread's
    submissions go on meanwhile (a timeline made here takes that lock). Two threads
    adopting one stream at once get one queue; the other's native queue is released.
    Checked failing before: the lock was held for the whole making."""
    assert driver.runtime is not None
    runtime = driver.runtime
    real_new = runtime.am_cuq_new
    making, made = threading.Semaphore(0), threading.Event()

    def slow_new(*args: Any) -> int:
        making.release()
        made.wait(10)
        return real_new(*args)

    dev = await am.open_device("cuda:0")
    try:
        kept = len(runtime.queues)
        monkeypatch.setattr(runtime, "am_cuq_new", slow_new)
        makers = 2 if make == "adopt_stream" else 1
        maker = dev.new_queue if make == "new_queue" else lambda: dev.adopt_stream(1)
        took, got = submitted_while_making([maker] * makers, making, made, dev.timeline)
        assert took < 0.5, f"the submission lock was held {took:.3f} s by the making"
        assert len(got) == makers and all(q is got[0] for q in got)
        with anyio.fail_after(10):
            while len(runtime.queues) != kept + 1:  # (the other released on a thread)
                await anyio.sleep(0.01)
    finally:
        await dev.close()
    assert len(runtime.queues) == kept - 1  # (the default queue's, closed with the device)


async def test_a_close_as_a_stream_is_adopted_releases_its_queue_and_says_so(
    anyio_backend: object, driver: _Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close that seals the device while another thread's adopt_stream makes its
    native queue (outside the submission lock) waits for that making; adopt_stream
    raises ClosedResourceError, and the queue made over the stream is released
    (am_cuq_close) with the stream left to its owner."""
    assert driver.runtime is not None
    runtime = driver.runtime
    real_new = runtime.am_cuq_new
    making, made = threading.Event(), threading.Event()

    def slow_new(*args: Any) -> int:
        making.set()
        made.wait(10)
        return real_new(*args)

    dev = await am.open_device("cuda:0")
    monkeypatch.setattr(runtime, "am_cuq_new", slow_new)
    got = await closed_while_making(dev, lambda: dev.adopt_stream(1), making, made)
    assert isinstance(got, am.ClosedResourceError), got
    assert "device cuda:0 is closed" in str(got)
    assert not runtime.queues  # every native queue released, the adopted one's too
    assert driver.calls.count("cuStreamDestroy") == 1  # the default queue's stream only


async def test_a_launch_beyond_the_limits_is_refused_before_native_code(
    anyio_backend: object, driver: _Driver
) -> None:
    """Launches beyond the device's limits on a block or a grid (read when it opened),
    or beyond the kernel's most threads per block (read when it loaded), raise
    InvalidArgumentError naming the limit and the kernel, before native code (which
    fails the test: ``_Runtime``), nothing numbered. Checked: fails without the fix (each
    got to am_cuq_launch)."""
    from tests.support.native.simulated_cuda import BOUNDED_SRC, BOUNDED_THREADS, OVERSIZED

    driver.kernel_threads[b"bounded"] = BOUNDED_THREADS
    dev = await am.open_device("cuda:0")
    try:
        programs = {}
        for src, name in ((SRC, "k"), (BOUNDED_SRC, "bounded")):
            params = await dev._params(src, name)
            assert isinstance(params, tuple)
            compiler = dev._backend.compiler
            programs[name] = await dev._program(("key", name), params, b"", src, compiler, None)
        buf = await dev.alloc(64)
        attributes = (
            driver.calls.count("cuFuncGetAttribute"),
            driver.calls.count("cuDeviceGetAttribute"),
        )
        assert attributes[0] == 2  # once per kernel, when it loaded
        queue = dev.new_queue()
        for name, global_size, local_size, message in OVERSIZED * 2:  # (the second: checked)
            with pytest.raises(am.InvalidArgumentError) as caught:
                queue.launch(programs[name], buf, global_size=global_size, local_size=local_size)
            assert str(caught.value) == message
            assert queue.submitted == 0 and queue not in buf._allocation.last_use
        assert attributes == (  # ... and the device's when it opened: never since
            driver.calls.count("cuFuncGetAttribute"),
            driver.calls.count("cuDeviceGetAttribute"),
        )
    finally:
        await dev.close()


async def test_a_kernel_whose_limit_the_driver_refuses_does_not_load(
    anyio_backend: object, driver: _Driver
) -> None:
    """cuFuncGetAttribute refused as a kernel loads (out of memory): the load raises the
    driver's error, and the kernel's module is unloaded."""
    dev = await am.open_device("cuda:0")
    try:
        driver.fail["cuFuncGetAttribute"] = CUresult.CUDA_ERROR_OUT_OF_MEMORY
        params = await dev._params(SRC, "k")
        assert isinstance(params, tuple)
        with pytest.raises(MemoryError, match="cuFuncGetAttribute"):
            await dev._program(("key", "k"), params, b"", SRC, dev._backend.compiler, None)
        assert driver.calls.count("cuModuleUnload") == driver.calls.count("cuModuleLoadData")
    finally:
        await dev.close()


@pytest.mark.anyio
async def test_a_host_signal_on_the_loop_of_a_cuda_timeline_leaves_its_own_pipe_out(
    anyio_backend: object, driver: _Driver
) -> None:
    """A cuda timeline's host signal from a task of a loop waiting on it: the native
    signal (the word, the value, the completion threads' kick) leaves that loop's own
    pipe out, as the cpu device's does -- the task is woken by the call, and no wake-up
    through the pipe follows. Checked failing without (one wake-up through the pipe)."""
    woken: list[int] = []
    async with am.open_device("cuda:0") as dev:
        tl = dev.timeline()

        async def waiter() -> None:
            await tl.wait(1)
            woken.append(1)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await anyio.wait_all_tasks_blocked()
                before = am.loop_statistics().wakeups
                tl.signal(1)
                while not woken:
                    await anyio.lowlevel.checkpoint()
                for _ in range(10):  # (where a byte was written, the loop has read it)
                    await anyio.lowlevel.checkpoint()
                assert am.loop_statistics().wakeups == before
        assert tl.native.reached(1)  # (the word, which streams wait on, raised too)

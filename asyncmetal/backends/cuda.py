"""The ``cuda:N`` devices, through NVIDIA's cuda-bindings (driver API and NVRTC).

* Queues are non-blocking streams. After each command the stream writes the queue's
  timeline value (``cuStreamWriteValue64``) and records a blocking-sync event; a native
  thread per stream (``native/amrt.c``) waits on those events without the GIL and wakes
  the loops. Nothing runs inside a driver callback.
* Timelines are 64-bit words in pinned, device-mapped host memory, laid out as the
  native runtime's timelines: streams wait on them with ``cuStreamWaitValue64`` (GEQ)
  before anyone signals, from the host, another stream or another GPU; the host reads
  and writes them in place.
* Kernels are CUDA C compiled by NVRTC for the device's own architecture into a cubin,
  in the compile pool. ``global_size`` is the number of threads per dimension and
  ``local_size`` the block: the grid is ``ceil(global / local)``.
* Host copies of pageable memory are staged through pinned chunks: native host-copy
  threads fill a chunk while the DMA engine moves the previous one.
"""

from __future__ import annotations

import collections
import ctypes
import os
import queue as queue_module
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .. import _native
from .._backend import (
    Arg,
    Backend,
    DeviceInfo,
    KeepAlive,
    NativeQueue,
    NativeTimeline,
    Record,
    host_address,
)
from .._compile import Compiler
from .._errors import AsyncMetalError, CompileError, DeviceLostError
from .cpu import CPUQueue

try:
    from cuda.bindings import driver as cu
    from cuda.bindings import nvrtc
except ImportError:  # pragma: no cover - without cuda-bindings there is no cuda device
    cu = nvrtc = None

MAX_PARAMS = 64
STAGE_CHUNK = 8 << 20  # bytes per pinned staging chunk
STAGE_DIRECT = 64 << 10  # smaller host copies go straight from pageable memory
HOST_COPY_THREADS = max(2, min(4, (os.cpu_count() or 2) // 2))  # 8 measured slower
COMPLETION_SPIN_NS = 30_000  # the completion thread polls this long before blocking

_LOST = {
    "CUDA_ERROR_ILLEGAL_ADDRESS",
    "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_MISALIGNED_ADDRESS",
    "CUDA_ERROR_HARDWARE_STACK_ERROR",
    "CUDA_ERROR_INVALID_ADDRESS_SPACE",
    "CUDA_ERROR_INVALID_PC",
    "CUDA_ERROR_ASSERT",
    "CUDA_ERROR_LAUNCH_TIMEOUT",
    "CUDA_ERROR_ECC_UNCORRECTABLE",
}


def _error_name(err: Any) -> str:
    try:
        return str(cu.CUresult(int(err)).name)
    except Exception:
        return f"CUDA error {int(err)}"


def driver_error(call: str, err: Any) -> AsyncMetalError:
    """The asyncmetal exception for CUDA result ``err`` of driver ``call``."""
    name = _error_name(err)
    if name in _LOST:
        return DeviceLostError(f"{call} failed: {name}: the device context is lost")
    if name == "CUDA_ERROR_OUT_OF_MEMORY":
        return _CudaOutOfMemory(f"{call} failed: {name}")
    return AsyncMetalError(f"{call} failed: {name}")


class _CudaOutOfMemory(AsyncMetalError, MemoryError):
    """The driver had no memory left (the allocator empties its cache and retries)."""


def check(result: Any, call: str) -> Any:
    """Unpack a cuda-bindings result tuple, raising on an error."""
    err, *values = result
    if int(err) != 0:
        raise driver_error(call, err)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


class CUDACompiler(Compiler):
    """CUDA C -> cubin with NVRTC for one architecture. Pickles as (arch, flags); the
    NVRTC program is made inside the process that compiles."""

    name = "nvrtc"

    def __init__(self, arch: str = "sm_90", flags: Sequence[str] = ("-default-device",)) -> None:
        self.arch = arch
        self.flags = tuple(flags)

    def config(self) -> tuple[Any, ...]:
        return (self.arch, self.flags)

    def version(self) -> str:
        major, minor = check(nvrtc.nvrtcVersion(), "nvrtcVersion")
        return f"nvrtc {major}.{minor}"

    def compile(self, src: str) -> bytes:
        prog = check(nvrtc.nvrtcCreateProgram(src.encode(), b"kernel.cu", 0, [], []), "nvrtc")
        try:
            options = [
                f"--gpu-architecture={self.arch}".encode(),
                *(f.encode() for f in self.flags),
            ]
            (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
            if int(err) != 0:
                size = check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
                log = b" " * size
                check(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
                raise CompileError(
                    f"NVRTC failed ({_nvrtc_name(err)})", log.decode(errors="replace")
                )
            size = check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            cubin = b" " * size
            check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            return bytes(cubin)
        finally:
            nvrtc.nvrtcDestroyProgram(prog)


def _nvrtc_name(err: Any) -> str:
    try:
        return str(nvrtc.nvrtcResult(int(err)).name)
    except Exception:
        return str(err)


class _Pinned:
    """Pinned, device-mapped, portable host memory."""

    def __init__(self, nbytes: int) -> None:
        flags = cu.CU_MEMHOSTALLOC_PORTABLE | cu.CU_MEMHOSTALLOC_DEVICEMAP
        self.address = int(check(cu.cuMemHostAlloc(nbytes, flags), "cuMemHostAlloc"))
        self.nbytes = nbytes
        ctypes.memset(self.address, 0, nbytes)

    def free(self) -> None:
        if self.address:
            cu.cuMemFreeHost(self.address)
            self.address = 0


class CUDATimeline(NativeTimeline):
    """A native-runtime timeline placed in pinned memory: streams write and wait on its
    first 8 bytes; host threads signal it; its watches wake the loops."""

    def __init__(self, backend: CUDABackend) -> None:
        self._backend = backend
        self._slot = backend._timeline_slot()
        self.c_timeline: int = backend.lib.am_timeline_init_at(self._slot)
        self.address = self._slot  # unified addressing: the same pointer on every GPU
        self._value = ctypes.c_uint64.from_address(self._slot)

    @property
    def value(self) -> int:
        return self._value.value

    def signal(self, value: int) -> None:
        self._backend.lib.am_timeline_signal(self.c_timeline, value)

    def __del__(self) -> None:
        backend = getattr(self, "_backend", None)
        if backend is not None and backend.lib is not None:
            backend.lib.am_timeline_fini(self.c_timeline)
            backend._release_slot(self._slot)


class _Staging:
    """A pool of pinned chunks, each returned once the command using it completed."""

    def __init__(self, chunks: int) -> None:
        self._free = [_Pinned(STAGE_CHUNK) for _ in range(chunks)]
        self._busy: collections.deque[tuple[_Pinned, NativeTimeline, int]] = collections.deque()

    def acquire(self) -> _Pinned:
        busy = self._busy  # released in submission order: reclaim from the front
        while busy and busy[0][1].value >= busy[0][2]:
            self._free.append(busy.popleft()[0])
        if not self._free:  # rare: a burst of huge synchronous submissions
            return _Pinned(STAGE_CHUNK)
        return self._free.pop()

    def release_after(self, chunk: _Pinned, timeline: NativeTimeline, value: int) -> None:
        self._busy.append((chunk, timeline, value))

    def close(self) -> None:
        for chunk in self._free:
            chunk.free()
        for chunk, _, _ in self._busy:
            chunk.free()
        self._free.clear()
        self._busy.clear()


class _HostCopier:
    """Native threads that memmove between pageable and pinned memory, each with a
    timeline in pinned memory that streams can wait on."""

    def __init__(self, backend: CUDABackend, threads: int) -> None:
        self.timelines = [CUDATimeline(backend) for _ in range(threads)]
        self.queues = [CPUQueue(backend.lib, tl) for tl in self.timelines]
        self.submitted = [0] * threads
        self._next = 0

    def memmove(self, dst: int, src: int, nbytes: int, keep: object) -> tuple[CUDATimeline, int]:
        i = self._next = (self._next + 1) % len(self.queues)
        self.submitted[i] += 1
        value = self.submitted[i]
        self.queues[i].memmove(dst, src, nbytes, value, Record(value), keep)
        return self.timelines[i], value

    def wait(self, timeline: CUDATimeline, target: int) -> tuple[CUDATimeline, int]:
        """Hold the next host copy until a stream raised ``timeline`` to ``target``."""
        i = (self._next + 1) % len(self.queues)
        self.submitted[i] += 1
        value = self.submitted[i]
        self.queues[i].wait(timeline, target, value, Record(value))
        return self.timelines[i], value

    def close(self, abandon: bool) -> None:
        for q in self.queues:
            q.close(abandon)


class CUDAQueue(NativeQueue):
    def __init__(self, backend: CUDABackend, timeline: CUDATimeline) -> None:
        self._backend = backend
        self._timeline = timeline
        backend.make_current()
        flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        self.stream = check(cu.cuStreamCreate(flags), "cuStreamCreate")
        self._waiter: int | None = backend.lib.am_cuwaiter_new(
            backend.context_address, timeline.c_timeline, COMPLETION_SPIN_NS
        )
        if not self._waiter:
            raise AsyncMetalError("could not start the CUDA completion thread (libcuda.so.1)")
        self._events: list[Any] = []
        self._reclaimed = (ctypes.c_void_p * 256)()
        self._keep = KeepAlive(timeline)
        self._slots = (ctypes.c_uint64 * MAX_PARAMS)()
        base = ctypes.addressof(self._slots)
        self._pointers = (ctypes.c_void_p * MAX_PARAMS)(*(base + 8 * i for i in range(MAX_PARAMS)))
        self._pointers_address = ctypes.addressof(self._pointers)
        self._write_flags = cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        self._wait_flags = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ

    def _event(self) -> Any:
        if not self._events:
            n = self._backend.lib.am_cuwaiter_reclaim(self._waiter, self._reclaimed, 256)
            self._events = [cu.CUevent(self._reclaimed[i]) for i in range(n)]
        if self._events:
            return self._events.pop()
        flags = cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC | cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        return check(cu.cuEventCreate(flags), "cuEventCreate")

    def _finish(
        self,
        value: int,
        keep: object = None,
        extra: CUDATimeline | None = None,
        target: int = 0,
        expected_ns: int = 0,
    ) -> None:
        """End a command: write the queue's value on the device, then hand an event to
        the completion thread."""
        check(
            cu.cuStreamWriteValue64(self.stream, self._timeline.address, value, self._write_flags),
            "cuStreamWriteValue64",
        )
        event = self._event()
        check(cu.cuEventRecord(event, self.stream), "cuEventRecord")
        # A command expected to take at most ~2 ms (a copy of known size) is polled
        # for through its end: blocking would add an interrupt and a thread wake-up.
        spin = min(expected_ns, 2_000_000)
        status = self._backend.lib.am_cuwaiter_push(
            self._waiter, int(event), value, extra.c_timeline if extra else None, target, spin
        )
        if status:
            raise MemoryError("the CUDA completion ring could not grow")
        self._keep.add(value, keep)

    def _mark(self, timeline: CUDATimeline, target: int, reached: int) -> None:
        """Raise ``timeline`` to ``target`` on the device mid-command. A GPU write wakes
        no host thread by itself: the completion thread pokes the timeline after it."""
        check(
            cu.cuStreamWriteValue64(self.stream, timeline.address, target, self._write_flags),
            "cuStreamWriteValue64",
        )
        event = self._event()
        check(cu.cuEventRecord(event, self.stream), "cuEventRecord")
        if self._backend.lib.am_cuwaiter_push(
            self._waiter, int(event), reached, timeline.c_timeline, target, 0
        ):
            raise MemoryError("the CUDA completion ring could not grow")

    def failure(self, value: int) -> BaseException | None:
        first = ctypes.c_uint64()
        code = self._backend.lib.am_cuwaiter_error(self._waiter, ctypes.byref(first))
        if code and value >= first.value:
            return driver_error(f"the command at value {first.value} on this stream", code)
        return None

    def launch(
        self,
        program: Any,
        args: Sequence[Arg],
        global_size: tuple[int, int, int],
        local_size: tuple[int, int, int],
        value: int,
        record: Record,
    ) -> None:
        if len(args) > MAX_PARAMS:
            raise AsyncMetalError(f"cuda kernels take at most {MAX_PARAMS} parameters here")
        self._backend.make_current()
        slots = self._slots
        for i, (handle, offset, val) in enumerate(args):
            slots[i] = (handle + offset) if val is None else (val & 0xFFFFFFFF)
        grid = [-(-g // b) for g, b in zip(global_size, local_size, strict=True)]
        check(
            cu.cuLaunchKernel(
                program, *grid, *local_size, 0, self.stream, self._pointers_address, 0
            ),
            "cuLaunchKernel",
        )
        self._finish(value)

    def signal(self, timeline: NativeTimeline, target: int, value: int, record: Record) -> None:
        assert isinstance(timeline, CUDATimeline)
        self._backend.make_current()
        check(
            cu.cuStreamWriteValue64(self.stream, timeline.address, target, self._write_flags),
            "cuStreamWriteValue64",
        )
        self._finish(value, timeline, extra=timeline, target=target)

    def wait(self, timeline: NativeTimeline, target: int, value: int, record: Record) -> None:
        assert isinstance(timeline, CUDATimeline)
        self._backend.make_current()
        self._wait_value(timeline, target)
        self._finish(value, timeline)

    def _wait_value(self, timeline: CUDATimeline, target: int) -> None:
        check(
            cu.cuStreamWaitValue64(self.stream, timeline.address, target, self._wait_flags),
            "cuStreamWaitValue64",
        )

    def copy(
        self, dst: Arg, src: Arg, nbytes: int, value: int, record: Record, peer: Any = None
    ) -> None:
        self._backend.make_current()
        if peer is None:
            check(
                cu.cuMemcpyDtoDAsync(
                    dst.handle + dst.offset, src.handle + src.offset, nbytes, self.stream
                ),
                "cuMemcpyDtoDAsync",
            )
        else:
            check(
                cu.cuMemcpyPeerAsync(
                    dst.handle + dst.offset,
                    self._backend.context,
                    src.handle + src.offset,
                    peer.context,
                    nbytes,
                    self.stream,
                ),
                "cuMemcpyPeerAsync",
            )
        self._finish(value, (dst, src), expected_ns=nbytes // 1000)  # ~2 TB/s each way

    def copyin(self, dst: Arg, src: memoryview, value: int, record: Record) -> None:
        self._backend.make_current()
        keep: list[object] = [dst, src]
        address = host_address(src)[0]
        base = dst.handle + dst.offset
        if src.nbytes <= STAGE_DIRECT:  # the driver copies it before the call returns
            check(cu.cuMemcpyHtoDAsync(base, address, src.nbytes, self.stream), "cuMemcpyHtoD")
        else:
            backend = self._backend
            for offset in range(0, src.nbytes, STAGE_CHUNK):
                n = min(STAGE_CHUNK, src.nbytes - offset)
                chunk = backend.staging.acquire()
                timeline, host_value = backend.copier.memmove(
                    chunk.address, address + offset, n, src
                )
                self._wait_value(timeline, host_value)
                check(
                    cu.cuMemcpyHtoDAsync(base + offset, chunk.address, n, self.stream),
                    "cuMemcpyHtoDAsync",
                )
                backend.staging.release_after(chunk, self._timeline, value)
                keep.append(chunk)
        self._finish(value, keep)

    def copyout(self, dst: memoryview, src: Arg, value: int, record: Record) -> None:
        self._backend.make_current()
        keep: list[object] = [dst, src]
        address = host_address(dst)[0]
        base = src.handle + src.offset
        backend = self._backend
        last: tuple[CUDATimeline, int] | None = None
        for offset in range(0, dst.nbytes, STAGE_CHUNK):
            n = min(STAGE_CHUNK, dst.nbytes - offset)
            chunk = backend.staging.acquire()
            check(
                cu.cuMemcpyDtoHAsync(chunk.address, base + offset, n, self.stream),
                "cuMemcpyDtoHAsync",
            )
            # The stream marks the chunk arrived (and the completion thread wakes whoever
            # sleeps on the mark); a host thread then moves it out.
            marker = backend.next_marker()
            self._mark(marker[0], marker[1], value - 1)
            backend.copier.wait(*marker)
            last = backend.copier.memmove(address + offset, chunk.address, n, dst)
            backend.staging.release_after(chunk, last[0], last[1])
            keep.append(chunk)
        if last is not None:
            self._wait_value(*last)  # the command completes once the bytes are in dst
        self._finish(value, keep)

    def close(self, abandon: bool = False) -> None:
        if self._waiter is not None:
            waiter, self._waiter = self._waiter, None
            if not abandon:
                self._backend.make_current()
                cu.cuStreamSynchronize(self.stream)
            self._backend.lib.am_cuwaiter_close(waiter, int(abandon))
            cu.cuStreamDestroy(self.stream)
            self._keep.clear()


class CUDABackend(Backend):
    kind = "cuda"
    host_visible = False
    # Measured on the H200: a stream parked in cuStreamWaitValue64 with ~64 launches
    # (each with its value write and event) behind it made cuLaunchKernel block.
    max_behind_wait = 16

    @classmethod
    def available(cls) -> list[str]:
        if cu is None or os.environ.get("ASYNCMETAL_WORKER"):
            return []
        try:
            (err,) = cu.cuInit(0)
            if int(err) != 0:
                return []
            err, count = cu.cuDeviceGetCount()
            return [f"cuda:{i}" for i in range(count)] if int(err) == 0 else []
        except Exception:
            return []

    def __init__(self, index: int) -> None:
        if cu is None:
            raise AsyncMetalError(
                "the cuda device needs cuda-bindings: pip install asyncmetal[cuda]"
            )
        check(cu.cuInit(0), "cuInit")
        self.index = index
        self.device = check(cu.cuDeviceGet(index), "cuDeviceGet")
        self.context = check(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self.context_address = int(self.context)
        self._local = threading.local()
        self.make_current()
        attr = cu.CUdevice_attribute
        major = check(
            cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device),
            "attr",
        )
        minor = check(
            cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.device),
            "attr",
        )
        memops = check(
            cu.cuDeviceGetAttribute(
                attr.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, self.device
            ),
            "attr",
        )
        unified = check(
            cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, self.device),
            "attr",
        )
        if not unified:
            raise AsyncMetalError(f"cuda:{index} lacks unified addressing, which asyncmetal needs")
        name = check(cu.cuDeviceGetName(256, self.device), "cuDeviceGetName")
        total = int(check(cu.cuDeviceTotalMem(self.device), "cuDeviceTotalMem"))
        self._info = DeviceInfo(
            name=name.split(b"\0")[0].decode(),
            total_memory=total,
            extra={"arch": f"sm_{major}{minor}", "stream_mem_ops_64": bool(memops)},
        )
        self._compiler = CUDACompiler(f"sm_{major}{minor}")
        self.lib = _native.runtime()
        self._modules: list[Any] = []
        self._slot_arenas: list[_Pinned] = []
        self._free_slots: list[int] = []
        self._slot_lock = threading.Lock()
        self.staging = _Staging(8)
        self.copier = _HostCopier(self, HOST_COPY_THREADS)
        self._markers = CUDATimeline(self)
        self._marker_value = 0
        self.live_allocations = 0
        # cuMemFree synchronizes the device: never on a loop, always on this thread.
        self._frees: queue_module.SimpleQueue[Any] = queue_module.SimpleQueue()
        self._freer = threading.Thread(
            target=self._free_loop, name="asyncmetal-cuda-free", daemon=True
        )
        self._freer.start()

    def make_current(self) -> None:
        local = self._local
        if getattr(local, "current", False):
            return
        check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        local.current = True

    def next_marker(self) -> tuple[CUDATimeline, int]:
        self._marker_value += 1
        return self._markers, self._marker_value

    def _timeline_slot(self) -> int:
        with self._slot_lock:
            if not self._free_slots:
                arena = _Pinned(64 << 10)
                self._slot_arenas.append(arena)
                self._free_slots = [arena.address + 128 * i for i in range(arena.nbytes // 128)]
            return self._free_slots.pop()

    def _release_slot(self, slot: int) -> None:
        with self._slot_lock:
            self._free_slots.append(slot)

    @property
    def info(self) -> DeviceInfo:
        return self._info

    @property
    def compiler(self) -> Compiler:
        return self._compiler

    def load(self, binary: bytes, name: str) -> Any:
        self.make_current()
        module = check(cu.cuModuleLoadData(binary), "cuModuleLoadData")
        self._modules.append(module)
        err, function = cu.cuModuleGetFunction(module, name.encode())
        if int(err) != 0:
            raise AttributeError(name)  # the device turns this into a CompileError
        return function

    def allocate(self, nbytes: int) -> Any:
        self.make_current()
        pointer = int(check(cu.cuMemAlloc(nbytes), "cuMemAlloc"))
        self.live_allocations += 1
        return pointer

    def free(self, handle: Any) -> None:
        self.live_allocations -= 1
        self._frees.put(handle)

    def _free_loop(self) -> None:
        self.make_current()
        while True:
            handle = self._frees.get()
            if handle is None:
                return
            cu.cuMemFree(handle)

    def host_view(self, handle: Any, offset: int, nbytes: int) -> memoryview:
        raise AsyncMetalError("cuda memory is not host-visible")

    def new_queue(self, timeline: NativeTimeline) -> NativeQueue:
        assert isinstance(timeline, CUDATimeline)
        return CUDAQueue(self, timeline)

    def new_timeline(self, on_advance: Callable[[int], None]) -> NativeTimeline:
        return CUDATimeline(self)

    def close(self) -> None:
        self.make_current()
        self.copier.close(abandon=False)
        self._frees.put(None)
        self._freer.join()
        cu.cuCtxSynchronize()
        self.staging.close()
        for module in self._modules:
            cu.cuModuleUnload(module)
        self._modules.clear()
        # The primary context stays retained for the life of the process (as the CUDA
        # runtime keeps it): timelines live in its pinned memory and may outlive the
        # device object (a Completion kept around, a loop's watch), so that memory must
        # never be unmapped under them.

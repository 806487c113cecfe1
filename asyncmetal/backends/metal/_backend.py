"""The metal backend: the system's default Metal device."""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Callable
from ctypes import c_uint64, c_ulong, c_void_p
from typing import Any, overload

from ... import _native
from ..._backend import (
    Backend,
    DeviceInfo,
    LoadGate,
    NativeQueue,
    NativeTimeline,
    Timelines,
)
from ..._compile import Compiler
from ..._errors import AsyncMetalError, CompileError, DeviceNotFoundError
from ..._threads import Freer
from . import _blocks
from ._compiler import MetalCompiler
from ._objc import (
    autorelease_pool,
    describe_error,
    forget_objects,
    library_path,
    load,
    nsstring,
    release,
    send,
)
from ._queue import STORAGE_SHARED, MetalKernel, MetalQueue, MetalTimeline, MTLSize

PAGE = mmap.PAGESIZE  # no-copy wrappers cover whole pages (16 KiB on Apple silicon)


class MetalBackend(Backend):
    kind = "metal"
    host_visible = True  # shared storage
    dlpack_device_type = 8  # kDLMetal: data is the MTLBuffer, byte_offset the offset
    # fillBuffer:range:value: writes one byte, over a range of whole 4-byte words on macOS
    fill_alignment = 4
    fill_patterns = False
    # A wait on a cpu or npy queue's timeline is held on the queue's own thread, with what
    # comes after it, until that timeline got there or failed (_queue.HostWait); another
    # device kind's timelines are not waited for (waits_for).
    waits_across_kinds = True
    # A wait a failure released runs what is behind it (the failure is reported): a
    # queue's wait for another stands for nothing more (Backend.waits_imply_order).
    waits_imply_order = False

    device: int
    lib: ctypes.CDLL
    block_isa: int
    live_allocations: int
    _info: DeviceInfo
    _compiler: MetalCompiler
    _dispatch: ctypes.CDLL

    @classmethod
    def available(cls) -> list[str]:
        """``metal`` where Metal and the Objective-C runtime load (Apple's on macOS, or
        the libraries the ``ASYNCMETAL_*`` variables name) and a device exists."""
        if any(library_path(role) is None for role in ("objc", "metal", "system")):
            return []
        try:
            metal = load("metal")
            metal.MTLCreateSystemDefaultDevice.restype = c_void_p
            device = metal.MTLCreateSystemDefaultDevice()
            if device:
                release(device)  # the Create rule: this call owns one reference
            return ["metal"] if device else []
        except (OSError, AttributeError):
            return []

    @classmethod
    def unavailable(cls) -> str:
        return "the metal device needs macOS and a Metal GPU"

    def __init__(self, index: int) -> None:
        try:
            metal = load("metal")
            dispatch = load("system")
        except OSError as exc:
            raise DeviceNotFoundError(f"the metal device is not available here: {exc}") from None
        metal.MTLCreateSystemDefaultDevice.restype = c_void_p
        self.device: int = metal.MTLCreateSystemDefaultDevice()
        if not self.device:
            raise DeviceNotFoundError("no Metal device")
        self.lib = _native.runtime()
        self.block_isa = _blocks.global_block_isa(dispatch)
        dispatch.dispatch_release.restype = None
        dispatch.dispatch_release.argtypes = [c_void_p]
        self._dispatch = dispatch
        name = send(send(self.device, "name"), "UTF8String", restype=ctypes.c_char_p)
        total = send(self.device, "recommendedMaxWorkingSetSize", restype=c_uint64)
        self._max_buffer = int(send(self.device, "maxBufferLength", restype=c_ulong))
        # The most threads of a threadgroup in each dimension, besides a pipeline's most in
        # all (maxTotalThreadsPerThreadgroup): both checked at a launch (MetalQueue.launch).
        most = send(self.device, "maxThreadsPerThreadgroup", restype=MTLSize)
        self.max_threadgroup = (int(most.width), int(most.height), int(most.depth))
        self._info = DeviceInfo(name=(name or b"metal").decode(), total_memory=int(total))
        self._compiler = MetalCompiler()
        self.live_allocations = 0
        self._pipelines: dict[int, None] = {}  # loaded, not unloaded yet
        self._pipelines_lock = threading.Lock()
        # Loads between their check and their pipeline's registration, against the close
        # (LoadGate): one ending after the close took the pipelines releases its own; the
        # close lets go of the device, unless a load is still under way (the last one does).
        self._loads = LoadGate(self._pipelines_lock, self._info.name)
        # Until a close let go of the device, or left it to the last load: once (a close
        # run again, after an interrupt, lets go of it no more).
        self._device_held = True
        self._timelines = Timelines()
        # Releasing a buffer lets go of its memory (its pages unmapped: time in proportion
        # to its size), and frees come from the loop: always on this thread (see Freer),
        # started at the first free and stopped by close.
        self._freer: Freer[int] = Freer("asyncmetal-metal-free", release)

    @property
    def info(self) -> DeviceInfo:
        return self._info

    @property
    def compiler(self) -> Compiler:
        return self._compiler

    def load(self, binary: bytes, name: str, bindings: tuple[int, ...] | None = None) -> Any:
        with self._loads.loading(self._release_device) as load:  # (if the last late one)
            # An asynchronous exception (a KeyboardInterrupt) lands only as a function
            # is entered or a called C function returns: from the assignment (no call
            # between) the pipeline is this load's until registered -- where the
            # finally sees it unregistered, it is released there.
            kernel = self._load_pipeline(binary, name, bindings)
            unregistered = True
            try:
                with self._pipelines_lock:
                    if load.end() is None:
                        self._pipelines[kernel.pipeline] = None  # released by unload() or close()
                        unregistered = False
            finally:
                if unregistered:  # late (the close went on without it: see LOAD_WAIT_S),
                    release(kernel.pipeline)  # or interrupted
            if unregistered:
                raise self._loads.refused()
        return kernel

    def _release_device(self) -> None:
        release(self.device)  # MTLCreateSystemDefaultDevice's reference

    def _load_pipeline(
        self, binary: bytes, name: str, bindings: tuple[int, ...] | None
    ) -> MetalKernel:
        """Kernel ``name`` of ``binary``: a MetalKernel of its new pipeline."""
        self._dispatch.dispatch_data_create.restype = c_void_p
        self._dispatch.dispatch_data_create.argtypes = [
            ctypes.c_char_p,
            ctypes.c_size_t,
            c_void_p,
            c_void_p,
        ]
        # The name and any NSError are autoreleased; the data, library and function are
        # ours and released here (the pipeline keeps what it needs). The pipeline is
        # released here too where anything raises once ``send`` returned it (registered
        # by load, once this returned): an interrupt as the function's release, the
        # kernel's making or the pool's end is entered too (no call between ``send``'s
        # return and the assignment).
        pipeline = None
        try:
            with autorelease_pool():
                data = self._dispatch.dispatch_data_create(binary, len(binary), None, None)
                error = c_void_p(0)
                library = send(self.device, "newLibraryWithData:error:", data, ctypes.byref(error))
                self._dispatch.dispatch_release(data)
                if not library:
                    reason = describe_error(error.value or 0)
                    raise CompileError(f"Metal rejected the library: {reason}")
                function = send(library, "newFunctionWithName:", nsstring(name))
                release(library)
                if not function:
                    raise AttributeError(name)
                pipeline = send(
                    self.device,
                    "newComputePipelineStateWithFunction:error:",
                    function,
                    ctypes.byref(error),
                )
                release(function)
                if not pipeline:
                    raise CompileError(
                        f"no pipeline for {name!r}: {describe_error(error.value or 0)}", name=name
                    )
                most = send(pipeline, "maxTotalThreadsPerThreadgroup", restype=ctypes.c_ulong)
                kernel = MetalKernel(pipeline, bindings, name, most)
            return kernel
        except BaseException:
            if pipeline:
                release(pipeline)
            raise

    def unload(self, native: Any) -> None:
        # A command buffer retains the pipelines encoded in it: released here, one still
        # running keeps it until it completes.
        assert isinstance(native, MetalKernel)
        with self._pipelines_lock:  # (after a close: already released)
            if self._pipelines.pop(native.pipeline, 0) is None:
                release(native.pipeline)

    def allocate(self, nbytes: int) -> Any:
        buffer = send(
            self.device,
            "newBufferWithLength:options:",
            nbytes,
            STORAGE_SHARED,
            argtypes=(c_ulong, c_ulong),
        )
        if not buffer:
            raise MemoryError(f"newBufferWithLength: {nbytes} failed")
        self.live_allocations += 1
        return buffer

    def max_allocation(self) -> int:
        return self._max_buffer  # newBufferWithLength: returns nil above it

    def free(self, handle: Any) -> None:
        self.live_allocations -= 1
        # (Closed -- a buffer a consumer held past the close: DLPack -- or a forked
        # child's, where release sends nothing: released at once.)
        self._freer.free(handle)

    @overload
    def wrap_pages(self, address: int, nbytes: int) -> tuple[int, int]: ...
    @overload
    def wrap_pages(self, address: int, nbytes: int, check: bool) -> tuple[int, int] | None: ...
    def wrap_pages(self, address: int, nbytes: int, check: bool = True) -> tuple[int, int] | None:
        """A buffer of this device over the pages that hold ``nbytes`` of host memory at
        ``address`` (no copy: whole pages are mapped, so covering them is valid), and
        the offset of ``address`` in it. Only the given range is ever read or written.
        If Metal refuses (or the pages are more than its largest buffer), raises, or with
        ``check=False`` returns None."""
        start = address - address % PAGE
        length = -(-(address + nbytes - start) // PAGE) * PAGE
        if length > self._max_buffer:  # (Metal makes no buffer above maxBufferLength)
            if not check:
                return None
            raise AsyncMetalError(
                f"{length} bytes of host memory are more than Metal's largest buffer "
                f"({self._max_buffer} bytes)"
            )
        wrapped: int = send(
            self.device,
            "newBufferWithBytesNoCopy:length:options:deallocator:",
            start,
            length,
            STORAGE_SHARED,
            None,
            argtypes=(c_void_p, c_ulong, c_ulong, c_void_p),
        )
        if not wrapped:
            if not check:
                return None
            raise AsyncMetalError(f"Metal could not wrap {length} bytes of host memory")
        return wrapped, address - start

    def loan_address(self, handle: Any) -> int | None:
        return None  # (an MTLBuffer: an object, whose address is not its memory's)

    def host_view(self, handle: Any, offset: int, nbytes: int) -> memoryview:
        base = send(handle, "contents")
        return memoryview((ctypes.c_ubyte * nbytes).from_address(base + offset)).cast("B")

    def waits_for(self, timeline: NativeTimeline) -> bool:
        return timeline.host_raised and timeline.c_timeline is not None

    def new_queue(self, timeline: NativeTimeline) -> NativeQueue:
        assert isinstance(timeline, MetalTimeline)
        return MetalQueue(self, timeline)

    def new_timeline(self, on_advance: Callable[[int], None]) -> NativeTimeline:
        timeline = MetalTimeline(self)
        self._timelines.add(timeline)
        return timeline

    def forked(self, message: str) -> None:
        # The completion handlers that raise the timelines run on the parent's Metal
        # threads; the parent's objects are not released here (nor anything sent).
        self._timelines.forked(message)
        forget_objects()
        self._freer.forked()  # (the parent's thread: frees in the child release at once)

    def close(self) -> None:
        with self._pipelines_lock:  # (whatever fails below: see LoadGate.refuse)
            self._loads.refuse()
        try:
            # The allocator freed everything before, but for buffers that command buffers
            # its queues abandoned may use, released after this (at once: a command buffer
            # retains the buffers it uses, so an earlier release would not free them
            # under it).
            self._freer.stop()
        finally:
            # Also where the stop failed: loads are refused, so nothing else would release
            # the pipelines. Those under way end first (bounded: see LOAD_WAIT_S), their
            # pipelines released here with the others.
            with self._pipelines_lock:
                loading = self._loads.close()  # (the last of them lets go of the device)
                lets_go, self._device_held = self._device_held and not loading, False
                pipelines, self._pipelines = self._pipelines, {}
                for pipeline in pipelines:
                    release(pipeline)
            if lets_go:
                self._release_device()

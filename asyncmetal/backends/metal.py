"""The ``metal`` device (Apple): the Objective-C runtime through ctypes, as tinygrad does.

NOT RUN ON APPLE HARDWARE. No machine available to this project runs macOS: this module
is written against Apple's documented API and tinygrad's ``ops_metal.py`` (0.10.2). It
runs, unchanged, against the tests' simulated Metal (``tests/metal_sim``: the same C
calls, x86-64, MSL run on the CPU), loaded through the ``ASYNCMETAL_*`` library
variables (``_objc.LIBRARIES``); ``devices()`` lists ``metal`` where they load.

* Each command is one command buffer: device-side waits (``encodeWaitForEvent:value:``)
  are encoded at the head of the command buffer that holds the dependent work (and of
  every later one until the value is seen reached) -- never in a separate empty command
  buffer, which raced in tinygrad -- then the work, then ``encodeSignalEvent:value:`` of
  the queue's own ``MTLSharedEvent``.
* Every command buffer gets ``addCompletedHandler:`` before ``commit`` with a global
  block whose invoke function is native (``am_block_completed``): it raises the queue's
  timeline mirror, which wakes the loops through their pipes. Status, error and GPU
  times are read from the retained command buffer afterwards, on the loop.
* A queue's signal of a timeline raises that timeline's mirror from the same completion
  handler, right after the queue's own timeline: a host that sees the value reached may
  rely on the signal command having completed. (An ``MTLSharedEventListener`` would
  report the event's value first -- the GPU signals it before the command buffer
  completes -- which let a host signal overtake the queue's own timeline.)
* ``commandBuffer`` blocks when the queue has 1024 buffers in flight: past 1000 a queue
  hands its submissions to its own thread, in order, so the loop never blocks.
* Buffers are shared storage. A host source is blitted in place through a no-copy
  buffer over its pages (nothing copied on the loop, and -- as ``Queue.copy`` documents
  -- not staged); only one Metal will not wrap is copied into a staging buffer at
  submission. Copies out blit into a shared staging
  buffer that the completion handler's native code moves to the host array.
* Kernels are Metal Shading Language compiled in the worker pool by the
  ``MTLCodeGenService`` of Apple's MTLCompiler framework, as tinygrad does (its reply
  block is a proper global block; the request and reply formats are tinygrad's), or by
  ``xcrun metal`` / ``xcrun metallib`` with ``MetalCompiler("xcrun")``; the compiler
  pickles as its configuration.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import os
import platform
import re
import struct
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, overload

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
from .._compile import Compiler, ParamKind
from .._errors import AsyncMetalError, CompileError, DeviceLostError
from . import _blocks
from ._objc import (
    autorelease_pool,
    describe_error,
    library_path,
    load,
    nsstring,
    release,
    retain,
    send,
)

c_void_p, c_uint64, c_ulong = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_ulong
STORAGE_SHARED = 0  # MTLResourceStorageModeShared
STATUS_ERROR = 5  # MTLCommandBufferStatusError
MAX_IN_FLIGHT = 1000  # the queues are made with room for 1024 command buffers
PAGE = mmap.PAGESIZE  # no-copy wrappers cover whole pages (16 KiB on Apple silicon)


class MTLSize(ctypes.Structure):
    _fields_ = [("width", c_ulong), ("height", c_ulong), ("depth", c_ulong)]


REQUEST_TYPE_COMPILE = 13  # MTLCodeGenServiceBuildRequest's request type for MSL -> library


def codegen_request(src: str, params: str) -> bytes:
    """The compiler service's request: the two lengths, the source padded with at least
    one NUL to a multiple of 4 bytes, then the NUL-terminated parameters."""
    source = src.encode()
    source += b"\0" * (-(-(len(source) + 1) // 4) * 4 - len(source))
    options = params.encode() + b"\0"
    return struct.pack("<QQ", len(source), len(options)) + source + options


def codegen_library(reply: bytes) -> bytes:
    """The Metal library in the service's reply: after a header whose size and the size
    of the warnings that follow it are the two little-endian uint32 at bytes 8-16."""
    if len(reply) < 16:
        raise CompileError(f"the Metal compiler service replied with {len(reply)} bytes")
    library = reply[sum(struct.unpack("<LL", reply[8:16])) :]
    if library[:4] != b"MTLB" or library[-4:] != b"ENDT":
        raise CompileError("the Metal compiler service returned no Metal library", repr(reply))
    return library


class MetalCompiler(Compiler):
    """Metal Shading Language -> a Metal library.

    ``tool="service"`` (the default) asks the ``MTLCodeGenService`` of Apple's
    MTLCompiler framework, present on every Mac, as tinygrad does; ``tool="xcrun"`` runs
    ``xcrun metal`` and ``xcrun metallib`` (they need the Metal toolchain of Xcode).
    Pickles as its configuration; the service is opened in the process that compiles.
    """

    name = "metal"

    def __init__(self, tool: str = "service", flags: Sequence[str] = ()) -> None:
        if tool not in ("service", "xcrun"):
            raise ValueError(f"tool must be 'service' or 'xcrun', got {tool!r}")
        self.tool = tool
        self.flags = tuple(flags)
        self._service: tuple[Any, int, int] | None = None  # library, service, block isa

    def config(self) -> tuple[Any, ...]:
        return (self.tool, self.flags)

    def version(self) -> str:
        if self.tool == "service":
            return f"MTLCodeGenService macOS {platform.mac_ver()[0] or 'none'}"
        try:
            out = subprocess.run(
                ["xcrun", "-sdk", "macosx", "metal", "--version"],
                capture_output=True,
                text=True,
                check=False,
            )
        except OSError:
            return "missing"
        return out.stdout.partition("\n")[0]

    def compile(self, src: str) -> bytes:
        return self._compile_service(src) if self.tool == "service" else self._compile_xcrun(src)

    def service_params(self) -> str:
        """The options the service compiles with (language version from the macOS one)."""
        major = int((platform.mac_ver()[0] or "0").split(".")[0])
        std = "metal3.1" if major >= 14 else "metal3.0" if major >= 13 else "macos-metal2.0"
        from .._cache import default_cache_dir

        modules = os.path.join(default_cache_dir(), "metal-modules")
        return " ".join(
            [
                f"-fno-fast-math -std={std} --driver-mode=metal -x metal",
                f'-fmodules-cache-path="{modules}" -fno-caret-diagnostics',
                *self.flags,
            ]
        )

    def _compile_service(self, src: str) -> bytes:
        if self._service is None:
            try:
                lib = load("compiler")
            except OSError as exc:
                raise CompileError(
                    f"the Metal compiler service is not available here ({exc}); "
                    "MetalCompiler('xcrun') uses the Xcode toolchain instead"
                ) from None
            lib.MTLCodeGenServiceCreate.restype = c_void_p
            lib.MTLCodeGenServiceCreate.argtypes = [ctypes.c_char_p]
            lib.MTLCodeGenServiceBuildRequest.restype = None
            lib.MTLCodeGenServiceBuildRequest.argtypes = [
                c_void_p,
                c_void_p,
                ctypes.c_int,
                ctypes.c_char_p,
                ctypes.c_size_t,
                c_void_p,
            ]
            service = lib.MTLCodeGenServiceCreate(b"asyncmetal")
            self._service = (lib, service, _blocks.global_block_isa(load("system")))
        lib, service, isa = self._service
        request = codegen_request(src, self.service_params())
        result = CodegenResult()
        block = result.block(isa)
        lib.MTLCodeGenServiceBuildRequest(
            service, None, REQUEST_TYPE_COMPILE, request, len(request), ctypes.addressof(block)
        )
        return result.library()

    def _compile_xcrun(self, src: str) -> bytes:
        with tempfile.TemporaryDirectory(prefix="asyncmetal-metal-") as tmp:
            source, air, lib = (os.path.join(tmp, n) for n in ("k.metal", "k.air", "k.metallib"))
            with open(source, "w") as f:
                f.write(src)
            for command in (
                ["xcrun", "-sdk", "macosx", "metal", "-O2", *self.flags, "-c", source, "-o", air],
                ["xcrun", "-sdk", "macosx", "metallib", air, "-o", lib],
            ):
                try:
                    proc = subprocess.run(command, capture_output=True, check=False)
                except OSError as exc:
                    raise CompileError(
                        f"cannot run {command[0]}: {exc} (install Xcode and its Metal toolchain)"
                    ) from None
                if proc.returncode != 0:
                    log = (proc.stderr + proc.stdout).decode(errors="replace")
                    raise CompileError(f"{command[3]} failed", log)
            with open(lib, "rb") as f:
                return f.read()

    def params(self, src: str, name: str) -> tuple[ParamKind, ...]:
        return metal_params(src, name)


CODEGEN_CALLBACK = ctypes.CFUNCTYPE(
    None, c_void_p, ctypes.c_int32, c_void_p, ctypes.c_size_t, ctypes.c_char_p
)


class CodegenResult:
    """What the compiler service hands its reply block: the library, or its error."""

    def __init__(self) -> None:
        self.reply: bytes | None = None
        self.error: tuple[int, str] | None = None
        self._invoke = CODEGEN_CALLBACK(self._called)

    def _called(
        self, block: int | None, error: int, data: int | None, length: int, message: bytes | None
    ) -> None:
        if error:
            self.error = (error, (message or b"").decode(errors="replace"))
        else:
            self.reply = ctypes.string_at(data, length) if data else b""

    def block(self, isa: int) -> _blocks.CallbackBlock:
        self._block = _blocks.callback_block(isa, self._invoke, _blocks.CODEGEN_SIGNATURE)
        return self._block

    def library(self) -> bytes:
        if self.error is not None:
            raise CompileError(f"Metal compile failed (error {self.error[0]})", self.error[1])
        if self.reply is None:
            raise CompileError("the Metal compiler service returned without replying")
        return codegen_library(self.reply)


def metal_params(src: str, name: str) -> tuple[ParamKind, ...]:
    """Launch parameters of a Metal kernel: those bound with ``[[buffer(i)]]`` in index
    order -- pointers are buffers, references and values are ``vals`` -- skipping
    ``[[thread_position_in_grid]]`` and the like."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", " ", src, flags=re.S)
    match = re.search(rf"\bkernel\s+void\s+{re.escape(name)}\s*\((.*?)\)\s*{{", text, re.S)
    if match is None:
        raise CompileError(f"kernel {name!r} is not defined in the source")
    bound: list[tuple[int, ParamKind]] = []
    for param in match.group(1).split(","):
        index = re.search(r"\[\[\s*buffer\s*\(\s*(\d+)\s*\)\s*\]\]", param)
        if index is None:
            continue
        bound.append((int(index.group(1)), "buffer" if "*" in param else "value"))
    return tuple(kind for _, kind in sorted(bound))


class MetalTimeline(NativeTimeline):
    """An ``MTLSharedEvent`` with a native mirror timeline that wakes the loops."""

    def __init__(self, backend: MetalBackend) -> None:
        self._lib = backend.lib
        self.event: int = send(backend.device, "newSharedEvent")
        self.c_timeline: int = backend.lib.am_timeline_new()
        self._mirror: _native.ValueReader = _native.timeline_reader(self.c_timeline)
        self._backend = backend

    def __del__(self) -> None:
        # Command buffers that wait on or signal the event retain it; this reference is
        # the timeline's own (newSharedEvent). None if __init__ failed before making it.
        release(getattr(self, "event", 0))

    @property
    def value(self) -> int:
        return self._mirror.value

    def device_value(self) -> int:
        value: int = send(self.event, "signaledValue", restype=c_uint64)
        return value

    def signal(self, value: int) -> None:
        send(self.event, "setSignaledValue:", value, restype=None, argtypes=(c_uint64,))
        self._lib.am_timeline_signal(self.c_timeline, value)


class MetalQueue(NativeQueue):
    def __init__(self, backend: MetalBackend, timeline: MetalTimeline) -> None:
        self._backend = backend
        self._timeline = timeline
        self._queue: int = send(
            backend.device, "newCommandQueueWithMaxCommandBufferCount:", 1024, argtypes=(c_ulong,)
        )
        self._waits: list[tuple[MetalTimeline, int]] = []  # re-encoded until reached
        self._unmarked = 0  # a wait command's own value, marked by the next buffer
        # (value, command buffer, block, record, committed behind an unreached wait)
        self._buffers: collections.deque[tuple[int, int, Any, Record, bool]] = collections.deque()
        self._keep = KeepAlive(timeline)
        self._worker: ThreadPoolExecutor | None = None
        self._routed = 0  # submissions handed to the worker and not yet committed
        self._lock = threading.Lock()

    # -- submission -----------------------------------------------------------------------

    def _submit(
        self,
        value: int,
        encode: Callable[[int], None],
        keep: object = None,
        copy_back: tuple[int, int, int] | None = None,
        record: Record | None = None,
        then: tuple[int, int] | None = None,
    ) -> None:
        record = record if record is not None else Record(value)
        if self._routed or value - 1 - self._timeline.value >= MAX_IN_FLIGHT:
            # `commandBuffer` would block: commit from the queue's own thread, in order.
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="asyncmetal-metal")
            with self._lock:
                self._routed += 1
            self._worker.submit(self._commit, value, encode, keep, copy_back, record, then, True)
            return
        self._commit(value, encode, keep, copy_back, record, then, False)

    def _commit(
        self,
        value: int,
        encode: Callable[[int], None],
        keep: object,
        copy_back: tuple[int, int, int] | None,
        record: Record,
        then: tuple[int, int] | None,
        routed: bool,
    ) -> None:
        # The command buffer and its encoders are autoreleased: without a pool they would
        # stay alive until this thread exits (the loop's thread: never).
        with autorelease_pool():
            self._encode_and_commit(value, encode, keep, copy_back, record, then)
        if routed:
            with self._lock:
                self._routed -= 1

    def _encode_and_commit(
        self,
        value: int,
        encode: Callable[[int], None],
        keep: object,
        copy_back: tuple[int, int, int] | None,
        record: Record,
        then: tuple[int, int] | None,
    ) -> None:
        backend = self._backend
        cb = retain(send(self._queue, "commandBuffer"))
        still = []
        for timeline, target in self._waits:
            if timeline.device_value() < target:
                send(
                    cb,
                    "encodeWaitForEvent:value:",
                    timeline.event,
                    target,
                    restype=None,
                    argtypes=(c_void_p, c_uint64),
                )
                still.append((timeline, target))
        self._waits = still
        encode(cb)
        send(
            cb,
            "encodeSignalEvent:value:",
            self._timeline.event,
            value,
            restype=None,
            argtypes=(c_void_p, c_uint64),
        )
        block = _blocks.make_block(
            backend.block_isa, _blocks.COMPLETED_SIGNATURE, self._timeline.c_timeline, value
        )
        if copy_back is not None:
            block.copy_dst, block.copy_src, block.copy_nbytes = copy_back
        if then is not None:
            block.then, block.then_value = then
        send(cb, "addCompletedHandler:", ctypes.addressof(block), restype=None)
        send(cb, "commit", restype=None)
        self._buffers.append((value, cb, block, record, bool(still)))
        self._keep.add(value, (keep, block))
        if len(self._buffers) > 256:
            self._reap()
        self._unmarked = 0

    def flush(self) -> None:
        """Commit a wait command that no later command carried yet (before parking)."""
        if self._unmarked:
            self._submit(self._unmarked, lambda cb: None)

    def _reap(self) -> None:
        """Release the command buffers that completed, noting the first that failed."""
        buffers, reached = self._buffers, self._timeline.value
        while buffers and buffers[0][0] <= reached:
            done_value, cb, _, record, _ = buffers.popleft()
            start = send(cb, "GPUStartTime", restype=ctypes.c_double)
            end = send(cb, "GPUEndTime", restype=ctypes.c_double)
            record.start_ns, record.end_ns = int(start * 1e9), int(end * 1e9)
            status = send(cb, "status", restype=c_ulong)
            if status == STATUS_ERROR and self._backend.lost is None:
                error = describe_error(send(cb, "error"))
                self._backend.lost = DeviceLostError(f"a Metal command buffer failed: {error}")
                self._backend.lost_from = done_value
            release(cb)
        _blocks.release_ran()

    def failure(self, value: int) -> BaseException | None:
        self.flush()
        self._reap()
        lost = self._backend.lost
        return lost if lost is not None and value >= self._backend.lost_from else None

    # -- commands -------------------------------------------------------------------------

    def launch(
        self,
        program: Any,
        args: Sequence[Arg],
        global_size: tuple[int, int, int],
        local_size: tuple[int, int, int],
        value: int,
        record: Record,
    ) -> None:
        ints = [ctypes.c_int32(a.value) for a in args if a.value is not None]

        def encode(cb: int) -> None:
            encoder = send(cb, "computeCommandEncoder")
            send(encoder, "setComputePipelineState:", program, restype=None)
            values = iter(ints)
            for index, (handle, offset, val) in enumerate(args):
                if val is None:
                    send(
                        encoder,
                        "setBuffer:offset:atIndex:",
                        handle,
                        offset,
                        index,
                        restype=None,
                        argtypes=(c_void_p, c_ulong, c_ulong),
                    )
                else:
                    v = next(values)
                    send(
                        encoder,
                        "setBytes:length:atIndex:",
                        ctypes.addressof(v),
                        4,
                        index,
                        restype=None,
                        argtypes=(c_void_p, c_ulong, c_ulong),
                    )
            send(
                encoder,
                "dispatchThreads:threadsPerThreadgroup:",
                MTLSize(*global_size),
                MTLSize(*local_size),
                restype=None,
                argtypes=(MTLSize, MTLSize),
            )
            send(encoder, "endEncoding", restype=None)

        self._submit(value, encode, (args, ints), record=record)

    def signal(self, timeline: NativeTimeline, target: int, value: int, record: Record) -> None:
        assert isinstance(timeline, MetalTimeline)

        def encode(cb: int) -> None:
            send(
                cb,
                "encodeSignalEvent:value:",
                timeline.event,
                target,
                restype=None,
                argtypes=(c_void_p, c_uint64),
            )

        # Host awaiters of `timeline` hear of it from this command's completion handler.
        self._submit(value, encode, timeline, record=record, then=(timeline.c_timeline, target))

    def wait(self, timeline: NativeTimeline, target: int, value: int, record: Record) -> None:
        assert isinstance(timeline, MetalTimeline)
        # Encoded at the head of the next command buffer, with the work that depends on
        # it; this command's own value is marked by that buffer (or by flush()).
        self._waits.append((timeline, target))
        self._unmarked = value

    def _blit(
        self,
        value: int,
        dst: tuple[int, int],
        src: tuple[int, int],
        nbytes: int,
        keep: object,
        record: Record,
        copy_back: tuple[int, int, int] | None = None,
    ) -> None:
        def encode(cb: int) -> None:
            blit = send(cb, "blitCommandEncoder")
            send(
                blit,
                "copyFromBuffer:sourceOffset:toBuffer:destinationOffset:size:",
                src[0],
                src[1],
                dst[0],
                dst[1],
                nbytes,
                restype=None,
                argtypes=(c_void_p, c_ulong, c_void_p, c_ulong, c_ulong),
            )
            send(blit, "endEncoding", restype=None)

        self._submit(value, encode, keep, copy_back, record)

    def copy(
        self, dst: Arg, src: Arg, nbytes: int, value: int, record: Record, peer: Any = None
    ) -> None:
        source: tuple[int, int] = (src.handle, src.offset)
        keep: list[object] = [dst, src]
        if peer is not None:  # another Metal device: wrap its shared memory here
            base = send(src.handle, "contents")
            length = send(src.handle, "length", restype=c_ulong)
            wrapped, delta = self._backend.wrap_pages(base, length)
            keep.append(_Owned(wrapped))
            source = (wrapped, delta + src.offset)
        self._blit(value, (dst.handle, dst.offset), source, nbytes, keep, record)

    def copyin(self, dst: Arg, src: memoryview, value: int, record: Record) -> None:
        # The source is read in place by the blit, through a buffer over its pages:
        # nothing is copied on the submitting thread, and the source is not staged (it is
        # kept until done). Only one Metal will not wrap is copied now.
        address, keep = host_address(src)
        wrapped = self._backend.wrap_pages(address, src.nbytes, check=False)
        if wrapped is None:
            staging = send(
                self._backend.device,
                "newBufferWithBytes:length:options:",
                address,
                src.nbytes,
                STORAGE_SHARED,
                argtypes=(c_void_p, c_ulong, c_ulong),
            )
            wrapped = (staging, 0)
        self._blit(
            value,
            (dst.handle, dst.offset),
            wrapped,
            src.nbytes,
            (keep, src, _Owned(wrapped[0])),
            record,
        )

    def copyout(self, dst: memoryview, src: Arg, value: int, record: Record) -> None:
        # Blit into a shared staging buffer (the blit is ordered after earlier work on
        # `src` by Metal's hazard tracking); the completion handler itself then moves the
        # bytes to the host array, natively, before it raises the timeline.
        staging = send(
            self._backend.device,
            "newBufferWithLength:options:",
            dst.nbytes,
            STORAGE_SHARED,
            argtypes=(c_ulong, c_ulong),
        )
        self._blit(
            value,
            (staging, 0),
            (src.handle, src.offset),
            dst.nbytes,
            (dst, src, _Owned(staging)),
            record,
            copy_back=(host_address(dst)[0], send(staging, "contents"), dst.nbytes),
        )

    def close(self, abandon: bool = False) -> None:
        self.flush()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        for _, cb, _, _, blocked in self._buffers:
            # At exit (abandon) drain what can complete, so no handler fires during
            # finalization; stop at the first buffer held by a wait nothing may signal
            # (buffers of a queue complete in order).
            if abandon and blocked:
                break
            send(cb, "waitUntilCompleted", restype=None)
        for _, cb, _, _, _ in self._buffers:
            release(cb)
        self._buffers.clear()
        release(self._queue)


class _Owned:
    """An Objective-C object released when the last command holding it is dropped."""

    def __init__(self, obj: int) -> None:
        self.obj = obj

    def __del__(self) -> None:
        release(self.obj)


class MetalBackend(Backend):
    kind = "metal"
    host_visible = True  # shared storage

    device: int
    lib: ctypes.CDLL
    block_isa: int
    lost: DeviceLostError | None
    lost_from: int
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

    def __init__(self, index: int) -> None:
        try:
            metal = load("metal")
            dispatch = load("system")
        except OSError as exc:
            raise AsyncMetalError(f"the metal device is not available here: {exc}") from None
        metal.MTLCreateSystemDefaultDevice.restype = c_void_p
        self.device: int = metal.MTLCreateSystemDefaultDevice()
        if not self.device:
            raise AsyncMetalError("no Metal device")
        self.lib = _native.runtime()
        self.block_isa = _blocks.global_block_isa(dispatch)
        dispatch.dispatch_release.restype = None
        dispatch.dispatch_release.argtypes = [c_void_p]
        self._dispatch = dispatch
        name = send(send(self.device, "name"), "UTF8String", restype=ctypes.c_char_p)
        total = send(self.device, "recommendedMaxWorkingSetSize", restype=c_uint64)
        self._info = DeviceInfo(name=(name or b"metal").decode(), total_memory=int(total))
        self._compiler = MetalCompiler()
        self.lost: DeviceLostError | None = None
        self.lost_from = 0
        self.live_allocations = 0
        self._pipelines: list[int] = []

    @property
    def info(self) -> DeviceInfo:
        return self._info

    @property
    def compiler(self) -> Compiler:
        return self._compiler

    def load(self, binary: bytes, name: str) -> Any:
        self._dispatch.dispatch_data_create.restype = c_void_p
        self._dispatch.dispatch_data_create.argtypes = [
            ctypes.c_char_p,
            ctypes.c_size_t,
            c_void_p,
            c_void_p,
        ]
        # The name and any NSError are autoreleased; the data, library and function are
        # ours and released here (the pipeline keeps what it needs).
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
                raise CompileError(f"no pipeline for {name!r}: {describe_error(error.value or 0)}")
            self._pipelines.append(pipeline)  # released with the device
            return pipeline

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

    def free(self, handle: Any) -> None:
        self.live_allocations -= 1
        release(handle)

    @overload
    def wrap_pages(self, address: int, nbytes: int) -> tuple[int, int]: ...
    @overload
    def wrap_pages(self, address: int, nbytes: int, check: bool) -> tuple[int, int] | None: ...
    def wrap_pages(self, address: int, nbytes: int, check: bool = True) -> tuple[int, int] | None:
        """A buffer of this device over the pages that hold ``nbytes`` of host memory at
        ``address`` (no copy: whole pages are mapped, so covering them is valid), and
        the offset of ``address`` in it. Only the given range is ever read or written.
        If Metal refuses, raises, or with ``check=False`` returns None."""
        start = address - address % PAGE
        length = -(-(address + nbytes - start) // PAGE) * PAGE
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

    def host_view(self, handle: Any, offset: int, nbytes: int) -> memoryview:
        base = send(handle, "contents")
        return memoryview((ctypes.c_ubyte * nbytes).from_address(base + offset)).cast("B")

    def new_queue(self, timeline: NativeTimeline) -> NativeQueue:
        assert isinstance(timeline, MetalTimeline)
        return MetalQueue(self, timeline)

    def new_timeline(self, on_advance: Callable[[int], None]) -> NativeTimeline:
        return MetalTimeline(self)

    def close(self) -> None:
        for pipeline in self._pipelines:
            release(pipeline)
        self._pipelines.clear()
        release(self.device)  # MTLCreateSystemDefaultDevice's reference

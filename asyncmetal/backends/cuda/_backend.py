"""The cuda backend: one opened GPU."""

from __future__ import annotations

import contextlib
import os
import queue as queue_module
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ... import _native
from ..._backend import (
    Backend,
    DeviceInfo,
    LoadGate,
    NativeQueue,
    NativeTimeline,
    StreamUse,
    Timelines,
)
from ..._compile import Compiler
from ..._errors import AsyncMetalError
from ..._interrupts import in_turn, until_uninterrupted
from . import _driver
from ._compiler import CUDACompiler
from ._driver import (
    LOST,
    check,
    cu,
    driver_error,
    error_name,
    install_driver,
    process_lost_error,
    refuse_if_lost,
)
from ._interop import (
    STREAM_LEGACY,
    check_stream_context,
    device_index_of,
    keeps_context,
    stream_handle,
    stream_id,
)
from ._limits import LaunchLimits
from ._peer import enable_peer_access
from ._queue import CUDAQueue
from ._staging import STAGE_CHUNK, STAGE_RING, STAGE_SPARE, Chunk
from ._timeline import CUDATimeline, Pinned

_listed: list[str] = []  # the devices the driver listed last


# The name of the threads that free memory let go of after its device closed.
AFTER_CLOSE = "asyncmetal-cuda-free-after-close"


class CUDABackend(Backend):
    kind = "cuda"
    host_visible = False
    dlpack_device_type = 2  # kDLCUDA
    # A wait on another kind's queue timeline (a cpu or npy queue's: no device word) is
    # held on the host until that queue's thread raised it (native/cuda_submit.c).
    waits_across_kinds = True
    _stream_ids = True  # the driver tells streams' ids (cuStreamGetId): see stream_key
    # The native queue bounds what a stream has in flight (MAX_IN_FLIGHT), device waits
    # included, and holds the rest.

    @classmethod
    def available(cls) -> list[str]:
        global _listed
        if cu is None or os.environ.get("ASYNCMETAL_WORKER"):
            return []
        if _driver.lost_first is not None:  # what was listed: opening one says the process is lost
            return list(_listed)
        try:
            (err,) = cu.cuInit(0)
            if int(err) == 0:
                err, count = cu.cuDeviceGetCount()
            if int(err) != 0:
                # A sticky error seen first here marks the process lost (driver_error):
                # the GPUs listed before stay listed, and opening one says so.
                driver_error("cuInit", err)
                return list(_listed) if _driver.lost_first is not None else []
            _listed = [f"cuda:{i}" for i in range(count)]
            return list(_listed)
        except Exception:
            return []

    @classmethod
    def unavailable(cls) -> str:
        if cu is None:
            return (
                "cuda devices need cuda-bindings, which is not installed here "
                '(pip install cuda-bindings; in a checkout, pip install -e ".[cuda]")'
            )
        return "cuda-bindings finds no NVIDIA GPU here (a GPU and NVIDIA's driver are needed)"

    @keeps_context
    def __init__(self, index: int) -> None:
        if cu is None:
            raise AsyncMetalError(self.unavailable())  # (open_device says so first)
        where = self.name = f"cuda:{index}"
        refuse_if_lost(f"opening {where}")
        check(cu.cuInit(0), "cuInit", where)
        self.index = index
        self.device = check(cu.cuDeviceGet(index), "cuDeviceGet", where)
        self.context = check(
            cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain", where
        )
        self.context_address = int(self.context)
        self.make_current()
        attr = cu.CUdevice_attribute
        major = check(
            cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device),
            "cuDeviceGetAttribute",
            where,
        )
        minor = check(
            cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.device),
            "cuDeviceGetAttribute",
            where,
        )
        memops = check(
            cu.cuDeviceGetAttribute(
                attr.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, self.device
            ),
            "cuDeviceGetAttribute",
            where,
        )
        unified = check(
            cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, self.device),
            "cuDeviceGetAttribute",
            where,
        )
        missing = None
        if not unified:
            missing = "unified addressing"
        elif not memops:  # else the first device-side wait would fail, mid-program
            missing = (
                "64-bit stream memory operations (CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_"
                "MEM_OPS is 0), which timelines need for device-side waits: GPUs of compute "
                "capability 7.0 or newer have them, enabled by default since CUDA 12"
            )
        if missing is not None:
            cu.cuDevicePrimaryCtxRelease(self.device)
            raise AsyncMetalError(f"cuda:{index} lacks {missing}; asyncmetal needs it")
        self.launch_limits = LaunchLimits(self.device, where)
        name = check(cu.cuDeviceGetName(256, self.device), "cuDeviceGetName", where)
        total = int(check(cu.cuDeviceTotalMem(self.device), "cuDeviceTotalMem", where))
        self._info = DeviceInfo(
            name=name.split(b"\0")[0].decode(),
            total_memory=total,
            extra={"arch": f"sm_{major}{minor}", "stream_mem_ops_64": bool(memops)},
        )
        self._compiler = CUDACompiler(f"sm_{major}{minor}")
        self.lib = _native.runtime()
        install_driver(self.lib)
        self._modules: dict[int, Any] = {}  # by the kernel loaded from it
        self._modules_lock = threading.Lock()
        # Loads between their check and their module's registration, against the close
        # (LoadGate): one ending after the close took the modules unloads its own, on the
        # primary context the close keeps retained.
        self._loads = LoadGate(self._modules_lock, self.name)
        self._timelines = Timelines()
        self._slot_arenas: list[Pinned] = []
        self._free_slots: list[int] = []
        self._slot_lock = threading.Lock()
        # (c_timeline, slot) of timelines their owners let go of while the runtime still
        # held references of them (_retire_timeline); freed once it holds none.
        self._retired: list[tuple[int, int]] = []
        self._slots_closed = False  # (then a timeline let go of is freed at once)
        # Before anything this object must give back if the open fails: peer access
        # stays enabled for the process whatever happens to this device.
        enable_peer_access(self)
        self._chunks: list[Chunk] = []
        try:
            for _ in range(STAGE_RING + STAGE_SPARE):
                self._chunks.append(Chunk(STAGE_CHUNK, where))
        except BaseException:  # (a close never comes: those pinned are unpinned here)
            for chunk in self._chunks:
                chunk.free()
            raise
        self._chunk_lock = threading.Lock()
        self.live_allocations = 0
        # cuMemFree synchronizes the device: never on a loop, always on this thread.
        # A SimpleQueue, not a Queue: its put is one C call, which no KeyboardInterrupt
        # cuts (a Queue's is Python code taking a lock and notifying: an interrupt
        # inside it could lose the free or leave that lock held).
        self._frees: queue_module.SimpleQueue[Any] = queue_module.SimpleQueue()
        self._freer_stopped = False  # (then frees run on threads of their own)
        self._freer_lock = threading.RLock()  # (an RLock: a free may come from the GC)
        self._freer = threading.Thread(
            target=self._free_loop, name="asyncmetal-cuda-free", daemon=True
        )
        self._freer.start()

    def make_current(self) -> None:
        """Make this device's context current on the calling thread. The current context
        is per thread and shared by every device (and library) used on it, so it is
        checked each time, never remembered. (The native submission path checks in C.)"""
        current = check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent", self.name)
        if int(current) != self.context_address:
            check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent", self.name)

    def lost_error(self, what: str) -> BaseException | None:
        return None if _driver.lost_first is None else process_lost_error(f"{what} on {self.name}")

    @keeps_context
    def take_chunk(self, pin: bool = True) -> Chunk | None:
        """A pinned staging chunk of the device's (pinned when it opened, or given back by
        a closed queue); if none is left, a newly pinned one, or None without ``pin``."""
        with self._chunk_lock:
            if self._chunks:
                return self._chunks.pop()
        if not pin:
            return None
        self.make_current()
        return Chunk(STAGE_CHUNK, self.name)

    def give_chunk(self, chunk: Chunk) -> None:
        """A chunk back to the pool; one there already is passed over: a staging's close
        run again after an interrupt as this returned gives that chunk again. (Nothing
        takes it in between: the run again follows at once, and an interrupt reaches a
        staging's close only in its device's close on the main thread, at exit, the
        device closed to copies.)"""
        with self._chunk_lock:
            if not any(c is chunk for c in self._chunks):
                self._chunks.append(chunk)

    @keeps_context
    def _timeline_slot(self) -> int:
        with self._slot_lock:  # (among takers: one makes an arena where none is free)
            self._reclaim_slots()
            if not self._free_slots:
                self.make_current()
                arena = Pinned(64 << 10, self.name)
                self._slot_arenas.append(arena)
                self._free_slots.extend(arena.address + 128 * i for i in range(arena.nbytes // 128))
            return self._free_slots.pop()

    def _release_slot(self, slot: int) -> None:
        """A slot back that no timeline used (its making failed): no lock, an append
        being atomic (see ``_retire_timeline``)."""
        self._free_slots.append(slot)

    def _retire_timeline(self, c_timeline: int, slot: int) -> None:
        """A timeline's owner lets go of it (its finalizer). The runtime may still hold
        references of it (a command in a ring, an operation held, a kick, a signal kept
        for its fence, a queue's own), through which the timeline's word -- ``slot`` --
        is still written, by the host or by a stream: a timeline given the slot now
        would see its value raised or lowered by another's. Freed, the slot reused, once
        the owner's reference is the only one left: none can be taken after it let go
        (each is taken through a submission, which holds the owner). That is now, or at
        a later slot's taking (``_reclaim_slots``), or at the close.

        No lock, an append being atomic: a collection may run this finalizer on a thread
        inside ``_timeline_slot``, which holds the slot lock."""
        lib = self.lib
        if lib.am_timeline_refs(c_timeline) == 1:
            lib.am_timeline_free(c_timeline)
            self._free_slots.append(slot)
            return
        self._retired.append((c_timeline, slot))
        if self._slots_closed:
            self._free_retired()

    def _reclaim_slots(self) -> None:
        """Free the retired timelines the runtime holds no reference of now, their
        slots free again. Under the slot lock. Each is taken off the list by a pop (a
        finalizer run meanwhile -- any allocation here may collect -- appends, and
        another thread may free them at a close: each pair is taken once)."""
        if not self._retired:
            return
        lib = self.lib
        held = []
        while self._retired:
            try:
                pair = self._retired.pop()
            except IndexError:  # (a close's thread took the last)
                break
            if lib.am_timeline_refs(pair[0]) == 1:
                lib.am_timeline_free(pair[0])
                self._free_slots.append(pair[1])
            else:
                held.append(pair)
        self._retired.extend(held)
        if self._slots_closed:  # (closed meanwhile: its close missed these)
            self._free_retired()

    def _free_retired(self) -> None:
        """Let go of every retired timeline (the device closed: no slot is taken any
        more, and what of the runtime still holds one frees it with its last reference;
        the slots stay mapped, never reused). Each taken off by a pop: another thread
        freeing meanwhile takes others."""
        while self._retired:
            try:
                c_timeline, _ = self._retired.pop()
            except IndexError:  # (the other thread took the last)
                return
            self.lib.am_timeline_free(c_timeline)

    @property
    def info(self) -> DeviceInfo:
        return self._info

    @property
    def compiler(self) -> Compiler:
        return self._compiler

    @keeps_context
    def load(self, binary: bytes, name: str, bindings: tuple[int, ...] | None = None) -> Any:
        refuse_if_lost(f"loading kernel {name!r} on {self.name}")
        with self._loads.loading() as load:
            # An asynchronous exception (a KeyboardInterrupt) lands only as a function
            # is entered or a called C function returns: ``module`` is this load's from
            # the assignment (no call between) until registered -- where the finally
            # sees it, neither registered nor unloaded, it is unloaded there.
            function, module = self._load_module(binary, name)
            try:
                with self._modules_lock:
                    if load.end() is None:
                        # A CUfunction's address, as the native launch takes it; its
                        # module unloaded by unload() or close().
                        self._modules[function] = module
                        module = None
            finally:
                if module is not None:  # late (the close went on without it: see
                    cu.cuModuleUnload(module)  # LOAD_WAIT_S), or interrupted
                    self.launch_limits.unloaded(function)
            if module is not None:
                raise self._loads.refused()
        return function

    def _load_module(self, binary: bytes, name: str) -> tuple[int, Any]:
        """Kernel ``name`` of ``binary``, loaded: its CUfunction's address and its module.
        Whatever it raises (an interrupt too, anywhere after the driver returned the
        module: the result is kept with no call between), the module is unloaded."""
        self.make_current()
        loaded: Any = None
        function: Any = None
        try:
            loaded = cu.cuModuleLoadData(binary)
            module = check(loaded, "cuModuleLoadData", self.name)
            err, function = cu.cuModuleGetFunction(module, name.encode())
            if int(err) != 0:  # (nothing of it was launched: unloaded below)
                if error_name(err) in LOST or _driver.lost_first is not None:
                    raise driver_error("cuModuleGetFunction", err, self.name)
                raise AttributeError(name)  # the device turns this into a CompileError
            self.launch_limits.loaded(function, name)
            return int(function), module
        except BaseException:
            if loaded is not None and int(loaded[0]) == 0:
                cu.cuModuleUnload(loaded[1])
                if function is not None:  # (its limits read, some or all of them)
                    self.launch_limits.unloaded(int(function))
            raise

    def param_sizes(self, native: Any) -> tuple[int, ...] | None:
        return self.launch_limits.param_sizes.get(native)  # (read as it loaded)

    @keeps_context
    def unload(self, native: Any) -> None:
        with self._modules_lock:  # (after a close: already unloaded)
            module = self._modules.pop(native, None)
            if module is not None:
                self.launch_limits.unloaded(native)
                self.make_current()
                cu.cuModuleUnload(module)

    @keeps_context
    def allocate(self, nbytes: int) -> Any:
        refuse_if_lost(f"allocating {nbytes} bytes on {self.name}")
        self.make_current()
        pointer = int(check(cu.cuMemAlloc(nbytes), "cuMemAlloc", self.name))
        self.live_allocations += 1
        return pointer

    def free(self, handle: Any) -> None:
        self.live_allocations -= 1
        with self._freer_lock:
            self._frees.put(handle)  # (one C call: see _frees)
            if not self._freer_stopped:
                return
        # Closed: memory a consumer held past the close (DLPack), now let go of, on a
        # thread of its own -- with whatever is queued: where an interrupt cut this
        # before that thread started, the next such free's thread frees it too.
        thread = threading.Thread(target=self._free_queued, name=AFTER_CLOSE, daemon=True)
        thread.start()

    def _free_queued(self) -> None:
        """Free what is queued (after the close: the freeing thread is gone)."""
        self.make_current()  # (a thread of its own: no other context to keep)
        while True:
            try:
                handle = self._frees.get_nowait()
            except queue_module.Empty:
                return
            if handle is not None:  # (the close's word to the freeing thread)
                cu.cuMemFree(handle)

    def _free_loop(self) -> None:
        while True:
            handle = self._frees.get()
            if handle is None:
                return
            # Checked before each free (a thread-local read once it is current): a
            # refusal to make it current must not end this thread, which every later
            # free of the device waits on; that free's own error is the driver's.
            with contextlib.suppress(AsyncMetalError):
                self.make_current()
            cu.cuMemFree(handle)

    def host_view(self, handle: Any, offset: int, nbytes: int) -> memoryview:
        raise AsyncMetalError("cuda memory is not host-visible")

    def new_queue(self, timeline: NativeTimeline) -> NativeQueue:
        assert isinstance(timeline, CUDATimeline)
        return CUDAQueue(self, timeline)

    def pointer_index(self, address: int) -> int | None:
        return device_index_of(address)

    def stream_key(self, stream: object) -> object:
        # The handle and the driver's id: a stream destroyed while its queue lives and a
        # new stream given its handle are told apart. Where the driver gives no id (or
        # for the legacy stream, one per context), the handle alone.
        handle = self.checked_stream(stream)
        if handle == STREAM_LEGACY or not self._stream_ids:
            return handle
        identity = stream_id(handle, self.name)
        if identity is None:
            self._stream_ids = False  # (asked once: the driver has none)
            return handle
        return handle, identity

    def stream_handle(self, stream: object, use: StreamUse = "adopt") -> int:
        return stream_handle(stream, use)

    def checked_stream(self, stream: object) -> int:
        handle = self.stream_handle(stream)
        check_stream_context(handle, self.context_address, self.name)
        return handle

    def adopt_queue(self, timeline: NativeTimeline, stream: object) -> NativeQueue:
        assert isinstance(timeline, CUDATimeline)
        return CUDAQueue(self, timeline, adopt=stream_handle(stream))

    def order_stream(self, stream: object, uses: Sequence[tuple[NativeTimeline, int]]) -> None:
        # Stream rules as adopt_stream's (the per-thread stream refused, this context's
        # streams only). Each use is a queue's value: its stream's own are in order
        # already (and a wait on its word could wait for a command behind the wait).
        handle = stream_handle(stream, "consume")  # (not adopted: its errors say so)
        check_stream_context(handle, self.context_address, self.name, consumer=True)
        for timeline, target in uses:
            owner = timeline.queue if isinstance(timeline, CUDATimeline) else None
            if isinstance(owner, CUDAQueue) and owner.handle != handle:
                owner.order_stream(self.context_address, handle, target)

    def new_timeline(self, on_advance: Callable[[int], None]) -> NativeTimeline:
        timeline = CUDATimeline(self)
        self._timelines.add(timeline)
        return timeline

    def forked(self, message: str) -> None:
        # No driver call: the child has no usable CUDA state and none of the completion
        # threads; the parent's streams, memory and contexts are left as they are. The
        # retired timelines are the parent's, forgotten here: never freed by the child.
        self._timelines.forked(message)
        self._retired = []

    def close(self) -> None:
        # Each step runs whatever an earlier one raised, and again where a
        # KeyboardInterrupt landed in it or just after it (each may run again): the
        # interrupt is raised once all ran, before the first error (as
        # Device._close_native, which runs this among its steps).
        errors: list[BaseException] = []
        steps: list[tuple[Any, ...]] = [
            (self._refuse_loads,),  # (whatever fails below: see LoadGate.refuse)
            (self._close,),
            # Also where the driver refused the context calls around it (the close
            # raises that): the freeing thread and the pinned chunks are not left.
            (self._stop_freer,),
            (self._free_chunks,),
            (self._close_slots,),
        ]
        interrupted = until_uninterrupted(in_turn, steps, errors)
        if interrupted is not None:
            raise interrupted
        if errors:
            raise errors[0]

    def _refuse_loads(self) -> None:
        with self._modules_lock:
            self._loads.refuse()

    def _close_slots(self) -> None:
        # Its queues are closed: a queue's thread given up on by an abandoning close
        # still holds what it held, and frees it with its last reference.
        self._slots_closed = True
        self._free_retired()

    def _stop_freer(self) -> None:
        with self._freer_lock:
            self._freer_stopped = True
            self._frees.put(None)
        self._freer.join()

    def _free_chunks(self) -> None:
        with self._chunk_lock:
            for chunk in self._chunks:
                chunk.free()
            self._chunks.clear()

    @keeps_context
    def _close(self) -> None:
        # Device waits on its timelines end first, failed: a stream of this GPU still
        # waiting on one would hold up the frees below, which wait for every stream of
        # the GPU. (Its queues are closed: what a stopped one's stream runs now is never
        # confirmed, so it stays abandoned.) The memory of the device those commands use
        # is freed once this close returned (Allocator._uses_left), after the synchronize
        # below has them run out: a free's own wait for the streams is no rule to count on.
        # A KeyboardInterrupt as it ends them (a Ctrl-C as the close runs at exit, on the
        # main thread) is raised once the close ran: they are all ended again (ending one
        # twice changes nothing), so the synchronize neither skips the streams those
        # already ended let run, nor waits for a stream still held by one. So is one
        # in the rest, at its entry too: that rest runs again (each of its parts may).
        steps: list[tuple[Any, ...]] = [(self._end_waits,), (self._close_after_waits,)]
        interrupted = until_uninterrupted(in_turn, steps)
        if interrupted is not None:
            raise interrupted  # (before an error of the close, as Device._close_native)
        # The primary context stays retained for the life of the process (as the CUDA
        # runtime keeps it): timelines live in its pinned memory and may outlive the
        # device object (a Completion kept around, a loop's watch), so that memory must
        # never be unmapped under them.

    def _end_waits(self) -> None:
        """The first part of _close: the device waits on its timelines end."""
        self._timelines.close_waits()

    def _close_after_waits(self) -> None:
        """The rest of _close, once the device waits on its timelines ended."""
        try:
            try:
                self.make_current()
                self._stop_freer()
            finally:
                # What the raised words let run runs out before anything it may use is
                # freed (the chunks, the modules, and the device's memory once this close
                # returned) -- also where a step above failed, the context made current
                # again for it.
                with contextlib.suppress(AsyncMetalError):
                    self.make_current()
                cu.cuCtxSynchronize()
            self._free_chunks()
        finally:
            # Also where a step above failed (after the synchronize): loads are refused,
            # so nothing else would unload the modules. Those under way end first
            # (bounded: see LOAD_WAIT_S), their modules unloaded here with the others.
            with self._modules_lock:
                self._loads.close()
                # Each taken off as it is unloaded: run again after an interrupt in
                # this loop, the close unloads those left, and none twice.
                while self._modules:
                    cu.cuModuleUnload(self._modules.popitem()[1])

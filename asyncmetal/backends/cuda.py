"""The ``cuda:N`` devices, through NVIDIA's cuda-bindings (driver API and NVRTC).

* Queues are non-blocking streams. Each command is submitted in one native call
  (``native/cuda_submit.c``: the launch, an event record) and its event handed to a native
  completion thread per stream, which polls it a moment, then blocks on it, without the
  GIL, and raises the queue's timeline once the event confirmed the command. Nothing
  runs inside a driver callback. Driver functions on that path are the pointers
  ``cuGetProcAddress`` (through cuda-bindings) returns; everything else calls
  cuda-bindings.
* Timelines are native-runtime timelines (the host-side value that loops read and await,
  raised only for confirmed work) with a 64-bit device word in pinned, device-mapped host
  memory: streams wait on the word with ``cuStreamWaitValue64`` (GEQ) before anyone
  signals, from the host, another stream or another GPU. A wait on a queue's own
  timeline for a value already submitted waits on that command's event instead
  (``cuStreamWaitEvent``); for a later value the queue writes its word once it gets
  there.
* Kernels are CUDA C compiled by NVRTC for the device's own architecture into a cubin,
  in the compile pool. ``global_size`` is the number of threads per dimension and
  ``local_size`` the block: the grid is ``ceil(global / local)``.
* Host copies of pageable memory are staged through a queue's own ring of pinned chunks
  (``STAGE_RING`` of ``STAGE_CHUNK``): its native host-copy threads
  (``HOST_COPY_THREADS``, made at its first large copy) fill or empty chunks while the
  DMA engine moves others, and a chunk is reused once its previous use is marked done
  -- a copy of any size runs in the ring's memory. Each chunk's host copy is shared by
  all the threads, which take its parts (``STAGE_PART``) one at a time. Between the DMA
  engine and the host copies there are only device words: the stream writes a mark
  after a chunk's DMA, which the threads poll; the thread that copies a chunk's last
  part raises its ready word, which the stream waits on. No event and no completion
  thread in between.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import mmap
import os
import queue as queue_module
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from .. import _native, _native_contract
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
# Pageable host copies go through a ring of pinned chunks that host threads fill (or
# empty). 8 MiB chunks and 12 threads: 46-48 GB/s of 1 GiB pageable -> H200 against
# 33-36 with 4 MiB chunks and 8 threads on one machine; all four mixes 47-49 on another.
STAGE_CHUNK = 8 << 20  # bytes per pinned staging chunk
STAGE_RING = 16  # chunks a queue stages through at most
# Pinning memory takes ~2 ms per chunk and holds up every other thread's driver calls
# (a launch on the loop included) meanwhile, so the device pins its chunks when it
# opens: a ring's worth and a few more, which queues take as they stage. A queue that
# finds none left makes do with the chunks it has; only one with fewer than STAGE_MIN
# pins more, at its first staged copy.
STAGE_SPARE = 4
STAGE_MIN = 2
HUGE_PAGE = 2 << 20  # staging chunks are aligned to it (transparent huge pages)
STAGE_DIRECT = 64 << 10  # smaller host copies go straight from pageable memory
STAGE_PART = 256 << 10  # the host-copy threads take a chunk's copy in parts of this
STAGED_BYTES_PER_NS = 20  # staged host copies are expected at 20 GB/s or better
HOST_COPY_THREADS = max(2, min(12, (os.cpu_count() or 2) * 3 // 4))  # per queue, lazily
COMPLETION_SPIN_NS = 30_000  # the completion thread polls this long before blocking
# Commands a stream holds unconfirmed at most; later ones wait on the host, in native
# code, and the completion thread submits them as earlier ones finish. On the H200,
# cuLaunchKernel blocks for a kernel's length once ~56 commands with blocking-sync
# events are queued on one stream (plain events: not up to 1024 deep).
MAX_IN_FLIGHT = 32
FINISH_LONG, FINISH_PLAIN = 1, 2  # am_cuq_finish flags
MAX_POLL_NS = 2_000_000  # ... or up to this long for a command expected to take so long
MAX_COPY_POLL_NS = 4_000_000  # ... a device copy (one of 1 GiB between two H200s: 2.8 ms)

# Process-fatal ("sticky") errors. NVIDIA documents the launch errors among them as
# leaving the process in an inconsistent state, every later CUDA call of it failing until
# it restarts -- on every device, not just the one that faulted (on two H200s a fault on
# cuda:1 failed cuda:0's next cuMemAlloc, and its cuMemHostRegister when cuda:0 was
# opened again). An uncorrectable ECC error is treated alike: device memory is corrupt.
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


_UNCONFIRMED = (1 << 64) - 1
_lost_lock = threading.Lock()
# The first sticky error the process saw, and which call or command saw it. Once set, every
# cuda device of the process reports itself lost (DeviceLostError): open, alloc, load,
# new queues, submissions, and completions not confirmed by then.
_lost_first: str | None = None
_live_queues: weakref.WeakSet[CUDAQueue] = weakref.WeakSet()  # what to mark when it is set


def _lose_process(first: str) -> None:
    """Note the process's CUDA state lost (once): each queue keeps the value its timeline
    had reached, the commands up to which the driver confirmed before."""
    global _lost_first
    with _lost_lock:
        if _lost_first is None:
            for queue in list(_live_queues):
                queue._confirmed_at_loss = queue._timeline.value
            _lost_first = first


def _lost_error(what: str) -> DeviceLostError:
    return DeviceLostError(
        f"{what}: the process's CUDA state is lost ({_lost_first}). The driver fails every "
        "later CUDA call of this process, on every device: restart the process to use "
        "CUDA again. Separate processes (one per device, say) contain such faults"
    )


def _refuse_if_lost(what: str) -> None:
    if _lost_first is not None:
        raise _lost_error(what)


def _error_name(err: Any) -> str:
    try:
        return str(cu.CUresult(int(err)).name)
    except Exception:
        return f"CUDA error {int(err)}"


def driver_error(call: str, err: Any, where: str = "") -> AsyncMetalError:
    """The asyncmetal exception for CUDA result ``err`` of driver ``call`` (on device
    ``where``). A sticky error marks the process's CUDA state lost; once it is, every
    error is reported as that loss (the driver's state is corrupt, whatever it says)."""
    name = _error_name(err)
    at = f"{call} on {where}" if where else call
    if name in _LOST:
        _lose_process(f"{name}, first seen by {at}")
    if _lost_first is not None:
        return _lost_error(f"{at} failed with {name}")
    if name == "CUDA_ERROR_OUT_OF_MEMORY":
        return _CudaOutOfMemory(f"{at} failed: {name}")
    return AsyncMetalError(f"{at} failed: {name}")


class _CudaOutOfMemory(AsyncMetalError, MemoryError):
    """The driver had no memory left (the allocator empties its cache and retries)."""


def check(result: Any, call: str, where: str = "") -> Any:
    """Unpack a cuda-bindings result tuple, raising on an error (of device ``where``)."""
    err, *values = result
    if int(err) != 0:
        raise driver_error(call, err, where)
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

    def __init__(self, nbytes: int, where: str = "") -> None:
        flags = cu.CU_MEMHOSTALLOC_PORTABLE | cu.CU_MEMHOSTALLOC_DEVICEMAP
        self.address = int(check(cu.cuMemHostAlloc(nbytes, flags), "cuMemHostAlloc", where))
        self.nbytes = nbytes
        ctypes.memset(self.address, 0, nbytes)

    def free(self) -> None:
        if self.address:
            cu.cuMemFreeHost(self.address)
            self.address = 0


class CUDATimeline(NativeTimeline):
    """A native-runtime timeline with a device word in pinned memory: streams write and
    wait on the word; the timeline's value (what the host reads, awaits and reports) is
    raised by host signals, and for device writes only once a completion thread has
    confirmed the work before them succeeded."""

    def __init__(self, backend: CUDABackend) -> None:
        # The device word: unified addressing makes it the same pointer on every GPU.
        self.address = backend._timeline_slot()
        ctypes.c_uint64.from_address(self.address).value = 0  # a reused slot holds an old value
        self.c_timeline: int = backend.lib.am_timeline_new()
        if not self.c_timeline:
            backend._release_slot(self.address)
            raise MemoryError("could not allocate a timeline")
        self._backend = backend
        backend.lib.am_timeline_set_word(self.c_timeline, self.address)
        self._value: _native.ValueReader = _native.timeline_reader(self.c_timeline)
        self._word = ctypes.c_uint64.from_address(self.address)
        self.queue: CUDAQueue | None = None  # the queue whose own timeline this is

    @property
    def value(self) -> int:
        return self._value.value

    def reached(self, target: int) -> bool:
        """Whether the device word got to ``target``: written by a stream behind its work
        (not yet confirmed by a completion thread), or raised by a host signal."""
        return self._word.value >= target

    def signal(self, value: int) -> None:
        # Raises the word, then wakes napping completion threads: a stream's wait it
        # releases is confirmed within microseconds rather than at the end of a nap.
        self._backend.lib.am_timeline_host_signal(self.c_timeline, value)

    def __del__(self) -> None:
        backend = getattr(self, "_backend", None)
        if backend is not None and backend.lib is not None:
            backend.lib.am_timeline_free(self.c_timeline)
            backend._release_slot(self.address)


# Every staging chunk's mapping, until freed: a chunk dropped unfreed (a queue abandoned
# at exit, say) must not be unmapped while the driver holds it registered -- a stream may
# still write it, and a new mapping there could not be registered.
_MAPPED: dict[int, tuple[mmap.mmap, Any]] = {}


def _map(nbytes: int) -> int:
    """Map ``nbytes`` of anonymous memory aligned to ``HUGE_PAGE``, kept in ``_MAPPED``
    until unmapped; return its address. A function of its own so that no frame but this
    one, gone once it returns, holds the ctypes view: a map cannot close while a view of
    it lives, and a ``_Chunk.__init__`` whose registration failed unmaps with its own
    frame still alive (its traceback is being raised)."""
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux: private, so huge pages may back it
        private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        mapped = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=private)
        with contextlib.suppress(OSError):  # no huge pages in this kernel: 4 KiB ones
            mapped.madvise(mmap.MADV_HUGEPAGE)
    else:
        mapped = mmap.mmap(-1, nbytes + HUGE_PAGE)  # zero-filled; aligned inside
    view = (ctypes.c_char * len(mapped)).from_buffer(mapped)
    address = -(-ctypes.addressof(view) // HUGE_PAGE) * HUGE_PAGE
    _MAPPED[address] = (mapped, view)
    return address


class _Chunk:
    """A pinned staging chunk, with the device word its host copies mark it ready on (a
    stream waits on it): its ``generation``-th use is ready once the word reaches it.

    Its memory is anonymous memory -- on transparent huge pages where the kernel gives
    them -- pinned and mapped with cuMemHostRegister: 16 chunks of 8 MiB in 30-35 ms and
    freed in 4, against 65-88 and 17-20 by cuMemHostAlloc, DMA alike (on 4 KiB pages,
    where the kernel gives no huge ones, 90-99 ms). Pinning holds up the device's other
    driver calls (~2 ms a chunk), so the device pins its chunks when it opens."""

    def __init__(self, nbytes: int, where: str = "") -> None:
        self.address = _map(nbytes)
        self.nbytes = nbytes
        try:
            flags = cu.CU_MEMHOSTREGISTER_PORTABLE | cu.CU_MEMHOSTREGISTER_DEVICEMAP
            check(cu.cuMemHostRegister(self.address, nbytes, flags), "cuMemHostRegister", where)
        except BaseException:
            self._unmap()
            raise
        self.track_uses()

    def free(self) -> None:
        if self.address:
            cu.cuMemHostUnregister(self.address)
            self._unmap()

    def _unmap(self) -> None:
        mapped, view = _MAPPED.pop(self.address)
        self.address = 0
        del view  # the map cannot close while a ctypes view holds its buffer
        mapped.close()

    def track_uses(self) -> None:
        self.ready: CUDATimeline | None = None  # made by the first queue that stages
        self.generation = 0
        # Parts copied over all uses (in C) and submitted (here): a use is ready once the
        # count gets to what was submitted up to it. Uses run one after another.
        self.count = ctypes.c_uint64(0)
        self.count_address = ctypes.addressof(self.count)
        self.parts = 0
        # Parts the threads took (in C): each use's parts are numbered on from here.
        self.claimed = ctypes.c_uint64(0)
        self.claimed_address = ctypes.addressof(self.claimed)


class _HostCopier:
    """Native threads that copy between pageable memory and pinned chunks. Every thread
    gets each chunk's copy and takes its parts (``STAGE_PART``) one at a time, so the
    chunk is ready about when all threads together could copy it -- and a thread that is
    late (descheduled, slow to wake) delays it by one part, not by a fixed share -- and
    the chunks get ready in the order the DMA engine takes them. A whole chunk per
    thread (round robin) left the DMA engine waiting: 1 GiB pageable -> H200 at 42.1
    GB/s against 49.6 split into a fixed share per thread (best of 12)."""

    def __init__(self, backend: CUDABackend, threads: int) -> None:
        self._backend = backend
        self.queues = [CPUQueue(backend.lib, CUDATimeline(backend)) for _ in range(threads)]
        self.submitted = [0] * threads

    def copy(
        self,
        dst: int,
        src: int,
        nbytes: int,
        keep: object,
        chunk: _Chunk,
        after: tuple[CUDATimeline, int] | None,
    ) -> tuple[CUDATimeline, int]:
        """Copy ``nbytes`` into or out of ``chunk`` in parts, once ``after``'s device word
        (a stream's mark) got there, if given; returns the chunk's ready word and the
        value it reaches once every part is in."""
        if chunk.ready is None:
            chunk.ready = CUDATimeline(self._backend)
        chunk.generation = generation = chunk.generation + 1
        parts = -(-nbytes // STAGE_PART)
        claimed = (chunk.claimed_address, chunk.parts)
        chunk.parts += parts
        count = (chunk.count_address, chunk.parts)
        waits = (0, 0) if after is None else (after[0].c_timeline, after[1])
        ready = (chunk.ready.address, generation)
        submitted = self.submitted
        for i in range(min(parts, len(self.queues))):
            submitted[i] += 1
            self.queues[i].copy_part(
                dst, src, nbytes, STAGE_PART, submitted[i], keep, waits, claimed, count, ready
            )
        return chunk.ready, generation

    def close(self, abandon: bool) -> None:
        for q in self.queues:
            q.close(abandon)


class _Staging:
    """A queue's machinery for pageable host copies: host-copy threads, a ring of pinned
    chunks and a timeline its stream marks chunks done on.

    Pageable memory is copied through the ring: host threads fill (or empty) chunks
    while the DMA engine moves others. A chunk is reused once its previous use has
    ended, whoever must write it next waiting for that -- a host thread on the stream's
    mark, or the stream on a host thread's copy -- so a copy of any size runs in the
    ring's bounded memory. Everything here is the queue's own: its waits depend only on
    its own stream, never on another queue's progress.
    """

    def __init__(self, backend: CUDABackend) -> None:
        self._backend = backend
        self.copier = _HostCopier(backend, HOST_COPY_THREADS)
        self.marks = CUDATimeline(backend)
        self._marked = 0
        self._ring: collections.deque[tuple[_Chunk, CUDATimeline, int]] = collections.deque()
        self._count = 0

    def acquire(self) -> tuple[_Chunk, tuple[CUDATimeline, int] | None]:
        """A chunk, and the (timeline, value) its previous use ends at, if not yet."""
        ring = self._ring
        if not (ring and ring[0][1].reached(ring[0][2])) and self._count < STAGE_RING:
            chunk = self._backend.take_chunk(pin=self._count < STAGE_MIN)
            if chunk is not None:
                self._count += 1
                return chunk, None
        chunk, timeline, value = ring.popleft()  # every chunk it has is in the ring now
        return chunk, None if timeline.reached(value) else (timeline, value)

    def release_after(self, chunk: _Chunk, timeline: CUDATimeline, value: int) -> None:
        self._ring.append((chunk, timeline, value))

    def unfinished(self) -> list[tuple[CUDATimeline, int]]:
        """The chunks' host copies not yet done (what a copy out must wait for)."""
        return [(t, v) for _, t, v in self._ring if t is not self.marks and not t.reached(v)]

    def next_mark(self) -> tuple[CUDATimeline, int]:
        self._marked += 1
        return self.marks, self._marked

    def close(self, abandon: bool) -> None:
        self.copier.close(abandon)
        if not abandon:  # everything finished: the chunks go back to the device's pool
            for chunk, _, _ in self._ring:
                self._backend.give_chunk(chunk)
        self._ring.clear()


class CUDAQueue(NativeQueue):
    def __init__(self, backend: CUDABackend, timeline: CUDATimeline) -> None:
        _refuse_if_lost(f"a new queue on {backend.name}")
        self._backend = backend
        self._timeline = timeline
        lib = self._lib = backend.lib
        backend.make_current()
        flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        self.stream = check(cu.cuStreamCreate(flags), "cuStreamCreate", backend.name)
        self._q: int | None = lib.am_cuq_new(
            backend.context_address,
            int(self.stream),
            timeline.c_timeline,
            COMPLETION_SPIN_NS,
            MAX_IN_FLIGHT,
        )
        if not self._q:
            cu.cuStreamDestroy(self.stream)
            raise AsyncMetalError("could not start the CUDA completion thread")
        timeline.queue = self
        self._error = ctypes.c_int.from_address(self._q)  # am_cuq's first member
        self._sticky = (0, 0)
        self._keep = KeepAlive(timeline)
        self._slots = (ctypes.c_uint64 * MAX_PARAMS)()
        base = ctypes.addressof(self._slots)
        self._pointers = (ctypes.c_void_p * MAX_PARAMS)(*(base + 8 * i for i in range(MAX_PARAMS)))
        self._pointers_address = ctypes.addressof(self._pointers)
        extension = _native.extension()
        self._fast_launch = None if extension is None else extension.cuq_launch
        self._copy = self._lib.am_cuq_copy if extension is None else extension.cuq_copy
        self._dims: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
        self._dims_arrays: list[ctypes.Array[ctypes.c_uint]] = []
        self._staging: _Staging | None = None  # made at the first large pageable copy
        # Commands up to this value were confirmed before the process's CUDA state was
        # lost (set then); every later one failed with it.
        self._confirmed_at_loss = _UNCONFIRMED
        with _lost_lock:
            if _lost_first is not None:  # lost while this queue was being made
                self._confirmed_at_loss = 0
            _live_queues.add(self)

    def _failed(self, code: int) -> AsyncMetalError:
        if code == -1:
            raise MemoryError("the CUDA completion ring could not grow")
        call = self._lib.am_cuda_name(self._lib.am_cuq_failed_call(self._q)).decode()
        return driver_error(call, code, self._backend.name)

    def _lost(self, what: str) -> DeviceLostError:
        """The process-wide loss, for a submission refused after it (the native launch
        path finds it at its driver calls, or when its completion is awaited)."""
        return _lost_error(f"{what} on {self._backend.name}")

    def _check(self, code: int) -> None:
        """Raise what a native submission call's nonzero result means."""
        if code:
            raise self._failed(code)

    def _finish(
        self,
        value: int,
        keep: object = None,
        extra: CUDATimeline | None = None,
        target: int = 0,
        expected_ns: int = 0,
        device_wait: bool = False,
    ) -> None:
        """End a command: an event behind it, which the completion thread confirms (the
        stream also writes the queue's device word if a device wait asked for the
        value before it was submitted). A command expected to take at most
        ``MAX_POLL_NS`` (a copy of known size) is polled for through its end: blocking
        would add an interrupt and a wake-up. One expected to take longer gets a
        blocking-sync event, which the completion thread sleeps on after a short poll.
        A device wait's event is always plain: its thread naps, and a host signal wakes it."""
        long_running = expected_ns > MAX_POLL_NS
        flags = FINISH_PLAIN if device_wait else FINISH_LONG if long_running else 0
        self._check(
            self._lib.am_cuq_finish(
                self._q,
                value,
                extra.c_timeline if extra else None,
                target,
                0 if long_running else expected_ns,
                flags,
            )
        )
        self._keep.add(value, keep)

    def _write(self, value: int, timeline: CUDATimeline, target: int) -> None:
        """The stream writes ``target`` into ``timeline``'s word (part of command ``value``)."""
        self._check(self._lib.am_cuq_write(self._q, timeline.address, target, value))

    def _wait_value(self, value: int, timeline: CUDATimeline, target: int) -> None:
        """The stream waits for ``timeline``'s word to reach ``target`` (part of ``value``)."""
        self._check(self._lib.am_cuq_wait(self._q, timeline.address, target, value))

    def _memcpy(self, value: int, to_device: bool, dst: int, src: int, nbytes: int) -> None:
        """A copy between pinned (or a few pages of pageable) host memory and the device,
        part of command ``value``."""
        self._check(self._lib.am_cuq_memcpy(self._q, to_device, dst, src, nbytes, value))

    def failure(self, value: int) -> BaseException | None:
        if not self._error.value and _lost_first is None:  # the common case: no call
            return None
        code, first = self._first_error()
        if code and value >= first:
            where = f"a stream of {self._backend.name}"
            return driver_error(f"the command at value {first}", code, where)
        if _lost_first is not None and value > self._confirmed_at_loss:
            return _lost_error(f"the command at value {value} on {self._backend.name}")
        return None

    def stats(self) -> dict[str, int]:
        """How this stream's completion thread worked: event queries; waits, after
        polling found a command unfinished, blocked on its blocking-sync event or with
        naps on its plain one; events created; whether commands get blocking-sync events
        now (after a long one); operations held on the host (the stream had
        ``MAX_IN_FLIGHT`` commands unconfirmed) so far and now; naps cut short by a host
        signal. For benchmarks and tests."""
        out = (ctypes.c_uint64 * 8)()
        if self._q is not None:
            self._lib.am_cuq_stats(self._q, out)
        keys = (
            "queries",
            "blocking_waits",
            "napping_waits",
            "events_made",
            "blocking_now",
            "held_total",
            "held_now",
            "kicked",
        )
        return dict(zip(keys, out, strict=True))

    def _first_error(self) -> tuple[int, int]:
        if self._q is not None:
            first = ctypes.c_uint64()
            code = self._lib.am_cuq_error(self._q, ctypes.byref(first))
            self._sticky = (code, first.value)
        return self._sticky

    def launch(
        self,
        program: Any,
        args: Sequence[Arg],
        global_size: tuple[int, int, int],
        local_size: tuple[int, int, int],
        value: int,
        record: Record,
    ) -> None:
        if _lost_first is not None:
            raise self._lost("a launch")
        if len(args) > MAX_PARAMS:
            raise AsyncMetalError(f"cuda kernels take at most {MAX_PARAMS} parameters here")
        # One native call, which makes the context current (through the extension, which
        # packs the arguments and works out the grid itself, where it could be built).
        if self._fast_launch is not None:
            code = self._fast_launch(self._q, program, global_size, local_size, args, value)
        else:
            dims = self._dims.get((global_size, local_size))
            if dims is None:
                dims = self._launch_dims(global_size, local_size)
            slots = self._slots
            for i, (handle, offset, val) in enumerate(args):
                slots[i] = (handle + offset) if val is None else (val & 0xFFFFFFFF)
            code = self._lib.am_cuq_launch(
                self._q, program, dims, self._pointers_address, len(args), value
            )
        self._check(code)

    def launch_target(self) -> tuple[Any, ...] | None:
        if self._fast_launch is None:
            return None
        return _native_contract.cuda_launch_target(self, self._q)

    def _launch_dims(self, global_size: tuple[int, ...], local_size: tuple[int, ...]) -> int:
        """The address of (grid, block, shared bytes) for these sizes, cached."""
        if len(self._dims) >= 256:
            self._dims.clear()  # the arrays stay alive in _dims_arrays until then
            self._dims_arrays.clear()
        grid = [-(-g // b) for g, b in zip(global_size, local_size, strict=True)]
        array = (ctypes.c_uint * 7)(*grid, *local_size, 0)
        self._dims_arrays.append(array)
        address = self._dims[(global_size, local_size)] = ctypes.addressof(array)
        return address

    def signal(self, timeline: NativeTimeline, target: int, value: int, record: Record) -> None:
        assert isinstance(timeline, CUDATimeline)
        if _lost_first is not None:
            raise self._lost("a signal")
        self._write(value, timeline, target)  # native calls: they make the context current
        self._finish(value, timeline, extra=timeline, target=target)

    def wait(self, timeline: NativeTimeline, target: int, value: int, record: Record) -> None:
        assert isinstance(timeline, CUDATimeline)
        if _lost_first is not None:
            raise self._lost("a wait")
        # Native calls only (they make the context current); none if confirmed already.
        confirms = None
        if timeline.value < target:
            owner = timeline.queue
            if owner is not None and owner._q is not None:  # a queue's: its event or word
                self._check(self._lib.am_cuq_wait_queue(self._q, owner._q, target, value))
                if owner._backend is self._backend:
                    # Once this wait is confirmed, so is the other queue's work up to
                    # target (a fault there would have failed this context's streams):
                    # its timeline gets there first, so a completion awaited here never
                    # shows one it waited for as unfinished.
                    confirms = timeline
            else:
                self._wait_value(value, timeline, target)
        self._finish(value, timeline, confirms, target, device_wait=True)

    def copy(
        self, dst: Arg, src: Arg, nbytes: int, value: int, record: Record, peer: Any = None
    ) -> None:
        if _lost_first is not None:
            raise self._lost("a copy")
        # Expected at most ~1 ns per KB on one H200 (~2 TB/s each way), ~3 between two
        # (~390 GB/s over NVLink): the completion thread polls that long.
        expected = nbytes // 1000 if peer is None else nbytes * 3 // 1000
        code = self._copy(  # one native call, which makes the context current
            self._q,
            dst.handle + dst.offset,
            src.handle + src.offset,
            None if peer is None else peer.context_address,
            nbytes,
            value,
            expected if expected < MAX_COPY_POLL_NS else MAX_COPY_POLL_NS,
        )
        self._check(code)
        record.due_ns = time.perf_counter_ns() + expected

    def _staging_for(self) -> _Staging:
        if self._staging is None:
            self._staging = _Staging(self._backend)
        return self._staging

    def copyin(self, dst: Arg, src: memoryview, value: int, record: Record) -> None:
        if _lost_first is not None:
            raise self._lost("a copy from the host")
        self._backend.make_current()
        address = host_address(src)[0]
        base = dst.handle + dst.offset
        if src.nbytes <= STAGE_DIRECT:  # a few pages: the driver stages them itself
            self._memcpy(value, True, base, address, src.nbytes)
            self._finish(value, (dst, src))
            return
        staging = self._staging_for()
        for offset in range(0, src.nbytes, STAGE_CHUNK):
            n = min(STAGE_CHUNK, src.nbytes - offset)
            chunk, busy = staging.acquire()  # busy: host threads refill it after the stream
            filled = staging.copier.copy(chunk.address, address + offset, n, src, chunk, busy)
            self._wait_value(value, *filled)
            self._memcpy(value, True, base + offset, chunk.address, n)
            mark = staging.next_mark()
            self._write(value, *mark)  # the chunk is free again: host threads poll the word
            staging.release_after(chunk, *mark)
        self._finish(value, (dst, src), expected_ns=src.nbytes // STAGED_BYTES_PER_NS)

    def copyout(self, dst: memoryview, src: Arg, value: int, record: Record) -> None:
        if _lost_first is not None:
            raise self._lost("a copy to the host")
        self._backend.make_current()
        address = host_address(dst)[0]
        base = src.handle + src.offset
        staging = self._staging_for()
        for offset in range(0, dst.nbytes, STAGE_CHUNK):
            n = min(STAGE_CHUNK, dst.nbytes - offset)
            chunk, busy = staging.acquire()
            if busy is not None:  # the stream refills it once a host thread emptied it
                self._wait_value(value, *busy)
            self._memcpy(value, False, chunk.address, base + offset, n)
            # The stream marks the chunk arrived; a host thread then moves it out.
            mark = staging.next_mark()
            self._write(value, *mark)
            emptied = staging.copier.copy(address + offset, chunk.address, n, dst, chunk, mark)
            staging.release_after(chunk, *emptied)
        for unfinished in staging.unfinished():  # done once every byte is in dst
            self._wait_value(value, *unfinished)
        self._finish(value, (dst, src), expected_ns=dst.nbytes // STAGED_BYTES_PER_NS)

    def close(self, abandon: bool = False) -> None:
        if self._q is not None:
            handle = self._q
            code, _ = self._first_error()
            self._q = None
            # Without abandon this returns once every held command was submitted and
            # every command confirmed (the stream is then idle).
            self._lib.am_cuq_close(handle, int(abandon))
            if self._staging is not None:
                self._staging.close(abandon)
            self._error = ctypes.c_int(code)  # the closed queue's error stays reported
            cu.cuStreamDestroy(self.stream)
            self._keep.clear()


# The native runtime calls these with the signatures of CUDA 12 and 13 (the same for
# every function it uses); it asks for the driver's own version of each, up to 13.
_DRIVER_ABI = (12000, 13000)
_installed = False


def _install_driver(lib: Any) -> None:
    """Hand the native runtime the driver functions it calls, from cuGetProcAddress."""
    global _installed
    if _installed:
        return
    driver = int(check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
    version = min(max(driver, _DRIVER_ABI[0]), _DRIVER_ABI[1])
    i = 0
    while (name := lib.am_cuda_name(i)) != b"?":
        pfn = check(cu.cuGetProcAddress(name, version, 0), f"cuGetProcAddress({name})")
        pointer = int(pfn[0] if isinstance(pfn, tuple) else pfn)
        if not pointer:
            raise AsyncMetalError(f"the CUDA driver has no {name.decode()}")
        lib.am_cuda_set(i, pointer)
        i += 1
    _installed = True


_peers_lock = threading.Lock()
_opened: dict[int, tuple[Any, Any]] = {}  # ordinal -> (CUdevice, primary context) opened here
_peers_done: set[tuple[int, int]] = set()  # (device, peer) ordinals with access enabled


def _enable_peer_access(backend: CUDABackend) -> None:
    """Let this device and every other GPU opened in this process read each other's
    memory where the hardware can (NVLink or PCIe peer to peer), once per pair: peer
    copies then go device to device instead of through host memory (38 GB/s on the
    two-H200 host without it). Runs where devices open, off the event loop; touches no
    GPU that asyncmetal has not opened. Access stays enabled for the life of the process,
    like the primary contexts it belongs to (which other libraries share)."""
    with _peers_lock:
        _opened[backend.index] = (backend.device, backend.context)
        for (src, (src_device, src_context)), (
            dst,
            (dst_device, dst_context),
        ) in itertools.permutations(_opened.items(), 2):
            if (src, dst) in _peers_done:
                continue
            _peers_done.add((src, dst))
            where = f"cuda:{src}"
            can = cu.cuDeviceCanAccessPeer(src_device, dst_device)
            if not check(can, "cuDeviceCanAccessPeer", where):
                continue
            check(cu.cuCtxSetCurrent(src_context), "cuCtxSetCurrent", where)
            (err,) = cu.cuCtxEnablePeerAccess(dst_context, 0)
            already = cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            if err not in (cu.CUresult.CUDA_SUCCESS, already):
                raise driver_error("cuCtxEnablePeerAccess", err, where)
    backend.make_current()


_listed: list[str] = []  # the devices the driver listed last


class CUDABackend(Backend):
    kind = "cuda"
    host_visible = False
    # No commands are held in Python behind a device wait: the native queue bounds what
    # a stream has in flight (MAX_IN_FLIGHT), device waits included.

    @classmethod
    def available(cls) -> list[str]:
        global _listed
        if cu is None or os.environ.get("ASYNCMETAL_WORKER"):
            return []
        if _lost_first is not None:  # what was listed: opening one says the process is lost
            return list(_listed)
        try:
            (err,) = cu.cuInit(0)
            if int(err) != 0:
                return []
            err, count = cu.cuDeviceGetCount()
            _listed = [f"cuda:{i}" for i in range(count)] if int(err) == 0 else []
            return list(_listed)
        except Exception:
            return []

    def __init__(self, index: int) -> None:
        if cu is None:
            raise AsyncMetalError(
                "the cuda device needs cuda-bindings: pip install asyncmetal[cuda]"
            )
        where = self.name = f"cuda:{index}"
        _refuse_if_lost(f"opening {where}")
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
        name = check(cu.cuDeviceGetName(256, self.device), "cuDeviceGetName", where)
        total = int(check(cu.cuDeviceTotalMem(self.device), "cuDeviceTotalMem", where))
        self._info = DeviceInfo(
            name=name.split(b"\0")[0].decode(),
            total_memory=total,
            extra={"arch": f"sm_{major}{minor}", "stream_mem_ops_64": bool(memops)},
        )
        self._compiler = CUDACompiler(f"sm_{major}{minor}")
        self.lib = _native.runtime()
        _install_driver(self.lib)
        self._modules: list[Any] = []
        self._slot_arenas: list[_Pinned] = []
        self._free_slots: list[int] = []
        self._slot_lock = threading.Lock()
        self._chunks = [_Chunk(STAGE_CHUNK, where) for _ in range(STAGE_RING + STAGE_SPARE)]
        self._chunk_lock = threading.Lock()
        self.live_allocations = 0
        # cuMemFree synchronizes the device: never on a loop, always on this thread.
        self._frees: queue_module.SimpleQueue[Any] = queue_module.SimpleQueue()
        self._freer = threading.Thread(
            target=self._free_loop, name="asyncmetal-cuda-free", daemon=True
        )
        self._freer.start()
        _enable_peer_access(self)

    def make_current(self) -> None:
        """Make this device's context current on the calling thread. The current context
        is per thread and shared by every device (and library) used on it, so it is
        checked each time, never remembered. (The native submission path checks in C.)"""
        current = check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent", self.name)
        if int(current) != self.context_address:
            check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent", self.name)

    def lost_error(self, what: str) -> BaseException | None:
        return None if _lost_first is None else _lost_error(f"{what} on {self.name}")

    def take_chunk(self, pin: bool = True) -> _Chunk | None:
        """A pinned staging chunk of the device's (pinned when it opened, or given back by
        a closed queue); if none is left, a newly pinned one, or None without ``pin``."""
        with self._chunk_lock:
            if self._chunks:
                return self._chunks.pop()
        if not pin:
            return None
        self.make_current()
        return _Chunk(STAGE_CHUNK, self.name)

    def give_chunk(self, chunk: _Chunk) -> None:
        with self._chunk_lock:
            self._chunks.append(chunk)

    def _timeline_slot(self) -> int:
        with self._slot_lock:
            if not self._free_slots:
                self.make_current()
                arena = _Pinned(64 << 10, self.name)
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
        _refuse_if_lost(f"loading kernel {name!r} on {self.name}")
        self.make_current()
        module = check(cu.cuModuleLoadData(binary), "cuModuleLoadData", self.name)
        self._modules.append(module)
        err, function = cu.cuModuleGetFunction(module, name.encode())
        if int(err) != 0:
            if _error_name(err) in _LOST or _lost_first is not None:
                raise driver_error("cuModuleGetFunction", err, self.name)
            raise AttributeError(name)  # the device turns this into a CompileError
        return int(function)  # a CUfunction's address, as the native launch takes it

    def allocate(self, nbytes: int) -> Any:
        _refuse_if_lost(f"allocating {nbytes} bytes on {self.name}")
        self.make_current()
        pointer = int(check(cu.cuMemAlloc(nbytes), "cuMemAlloc", self.name))
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
        self._frees.put(None)
        self._freer.join()
        cu.cuCtxSynchronize()
        with self._chunk_lock:
            for chunk in self._chunks:
                chunk.free()
            self._chunks.clear()
        for module in self._modules:
            cu.cuModuleUnload(module)
        self._modules.clear()
        # The primary context stays retained for the life of the process (as the CUDA
        # runtime keeps it): timelines live in its pinned memory and may outlive the
        # device object (a Completion kept around, a loop's watch), so that memory must
        # never be unmapped under them.

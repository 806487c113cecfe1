"""Staging of pageable host copies: pinned chunks, the native host-copy threads that fill
and empty them, and a queue's ring of them."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import mmap
import os
from typing import Any, Protocol

from ..cpu import CPUQueue
from ._driver import check, cu
from ._timeline import CUDATimeline, TimelineDevice

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


# at exit, say) must not be unmapped while the driver holds it registered -- a stream may
# still write it, and a new mapping there could not be registered.
_MAPPED: dict[int, tuple[mmap.mmap, Any]] = {}


def _map(nbytes: int) -> int:
    """Map ``nbytes`` of anonymous memory aligned to ``HUGE_PAGE``, kept in ``_MAPPED``
    until unmapped; return its address. A function of its own so that no frame but this
    one, gone once it returns, holds the ctypes view: a map cannot close while a view of
    it lives, and a ``Chunk.__init__`` whose registration failed unmaps with its own
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


class Chunk:
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
        # (None: popped by a free an interrupt cut short -- its map went with its frame.)
        mapped, view = _MAPPED.pop(self.address, (None, None))
        self.address = 0
        del view  # the map cannot close while a ctypes view holds its buffer
        if mapped is not None:
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


class StagingDevice(TimelineDevice, Protocol):
    """What staging needs of its GPU (a ``CUDABackend``): its pool of pinned chunks."""

    def take_chunk(self, pin: bool = True) -> Chunk | None: ...

    def give_chunk(self, chunk: Chunk) -> None: ...


class _HostCopier:
    """Native threads that copy between pageable memory and pinned chunks. Every thread
    gets each chunk's copy and takes its parts (``STAGE_PART``) one at a time, so the
    chunk is ready about when all threads together could copy it -- and a thread that is
    late (descheduled, slow to wake) delays it by one part, not by a fixed share -- and
    the chunks get ready in the order the DMA engine takes them. A whole chunk per
    thread (round robin) left the DMA engine waiting: 1 GiB pageable -> H200 at 42.1
    GB/s against 49.6 split into a fixed share per thread (best of 12)."""

    def __init__(self, backend: StagingDevice, threads: int) -> None:
        self._backend = backend
        self.queues = [CPUQueue(backend.lib, CUDATimeline(backend)) for _ in range(threads)]
        self.submitted = [0] * threads

    def copy(
        self,
        dst: int,
        src: int,
        nbytes: int,
        keep: object,
        chunk: Chunk,
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


class Staging:
    """A queue's machinery for pageable host copies: host-copy threads, a ring of pinned
    chunks and a timeline its stream marks chunks done on.

    Pageable memory is copied through the ring: host threads fill (or empty) chunks
    while the DMA engine moves others. A chunk is reused once its previous use has
    ended, whoever must write it next waiting for that -- a host thread on the stream's
    mark, or the stream on a host thread's copy -- so a copy of any size runs in the
    ring's bounded memory. Everything here is the queue's own: its waits depend only on
    its own stream, never on another queue's progress.
    """

    def __init__(self, backend: StagingDevice) -> None:
        self._backend = backend
        self.copier = _HostCopier(backend, HOST_COPY_THREADS)
        self.marks = CUDATimeline(backend)
        self._marked = 0
        self._ring: collections.deque[tuple[Chunk, CUDATimeline, int]] = collections.deque()
        self._count = 0
        self._retired: list[Chunk] = []
        self._reserved: list[Chunk] = []  # taken by reserve(), not yet in the ring

    def reserve(self, nbytes: int) -> None:
        """Take now -- pinning them where the device has none left -- the chunks that a
        copy of ``nbytes`` would pin as it goes (a queue with fewer than STAGE_MIN takes
        up to that many), before any part of it reaches the driver: a refusal to pin
        then raises with nothing of the copy submitted. Refused at a later chunk, it
        would raise for a copy whose earlier chunks still land in its destination."""
        wanted = min(-(-nbytes // STAGE_CHUNK), STAGE_MIN)
        while self._count + len(self._reserved) < wanted:
            chunk = self._backend.take_chunk(pin=True)
            assert chunk is not None  # (pin: one is made where none is left)
            self._reserved.append(chunk)

    def acquire(self, first: bool) -> tuple[Chunk, tuple[CUDATimeline, int] | None]:
        """A chunk, and the (timeline, value) its previous use ends at, if not yet.
        ``first``: the copy's first chunk, before which nothing of it was submitted --
        only then is a chunk pinned here (those of later chunks: ``reserve``)."""
        ring = self._ring
        if not (ring and ring[0][1].reached(ring[0][2])) and self._count < STAGE_RING:
            if self._reserved:
                chunk: Chunk | None = self._reserved.pop()
            else:
                chunk = self._backend.take_chunk(pin=first and self._count < STAGE_MIN)
            if chunk is not None:
                self._count += 1
                return chunk, None
        chunk, timeline, value = ring.popleft()  # every chunk it has is in the ring now
        return chunk, None if timeline.reached(value) else (timeline, value)

    def release_after(self, chunk: Chunk, timeline: CUDATimeline, value: int) -> None:
        self._ring.append((chunk, timeline, value))

    def retire(self, chunk: Chunk) -> None:
        """Set aside a chunk whose use the driver refused part of: what of that use was
        submitted may still read or write it, and nothing the stream writes marks its
        end, so it is not staged through again before the close (which waits for the
        stream, then gives it back). The ring takes another in its place."""
        self._retired.append(chunk)
        self._count -= 1

    def unfinished(self) -> list[tuple[CUDATimeline, int]]:
        """The chunks' host copies not yet done (what a copy out must wait for)."""
        return [(t, v) for _, t, v in self._ring if t is not self.marks and not t.reached(v)]

    def next_mark(self) -> tuple[CUDATimeline, int]:
        self._marked += 1
        return self.marks, self._marked

    def close(self, abandon: bool, idle: bool = False) -> None:
        """``abandon``: the host threads stop where they are (a copy of a command that
        never ran may wait for a mark its stream never writes). ``idle``: the stream is
        past everything it was given (its queue closed without abandoning, in a process
        whose CUDA state is not lost), so nothing writes a chunk any more.

        May run again after a KeyboardInterrupt (a step of its queue's close, at exit on
        the main thread): each chunk is read off its list, not taken (no call between),
        and taken off once its end returned, so a run again goes on from the chunk it
        landed in -- given back again, which the pool passes over (``give_chunk``) --
        and none is lost. (Its copy threads' queues close once: see CPUQueue.close.)"""
        self.copier.close(abandon)
        ring, reserved, retired = self._ring, self._reserved, self._retired
        while ring:
            chunk, timeline, value = ring[0]
            if not abandon or timeline.reached(value):  # its last use ended: back to the pool
                self._backend.give_chunk(chunk)
            else:
                self._unfinished(chunk, idle)
            del ring[0]
        while reserved:  # never used: nothing writes them
            self._backend.give_chunk(reserved[-1])
            del reserved[-1]
        while retired:
            if not abandon:
                self._backend.give_chunk(retired[-1])
            else:
                self._unfinished(retired[-1], idle)
            del retired[-1]

    @staticmethod
    def _unfinished(chunk: Chunk, idle: bool) -> None:
        """A chunk whose last use never ended, its host threads stopped."""
        if idle:
            # Nothing writes it any more, but its count of parts copied stopped part
            # way through a use: unpinned and unmapped, not staged through again.
            chunk.free()
        elif chunk.ready is not None:
            # A fill the stream waits for may never come. Its wait ends (the chunk is
            # not used again), so that the stream, once what holds it up ends, runs to
            # its end rather than waiting for good -- and holding up the device's
            # frees, which wait for every stream. It stays pinned and mapped: the
            # stream may still write it.
            chunk.ready.close_waits()

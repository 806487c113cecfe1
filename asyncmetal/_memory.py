"""Buffers and the per-device allocator."""

from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from ._backend import Arg, new_arg
from ._bridge import checkpoint
from ._errors import (
    ArgumentTypeError,
    ClosedResourceError,
    InvalidArgumentError,
    OutOfMemoryError,
)
from ._timeline import HostEvents, call_when_reached, wait_value

if TYPE_CHECKING:
    from ._device import Device
    from ._queue import Queue


def plain_dtype(dtype: Any, what: str = "dtype") -> np.dtype[Any]:
    """``dtype`` as a numpy dtype whose items are plain bytes of a nonzero size.

    Device memory holds bytes: an object dtype would fill an array with raw bytes where
    numpy expects ``PyObject*`` pointers (or send those pointers to the device)."""
    try:
        checked: np.dtype[Any] = np.dtype(dtype)
    except (TypeError, ValueError):
        raise ArgumentTypeError(f"{what} must be a numpy dtype, got {dtype!r}") from None
    if checked.hasobject:
        raise ArgumentTypeError(
            f"{what} must be a plain data type (numbers, bools, bytes), got {checked}, "
            "which holds Python objects"
        )
    if checked.itemsize == 0:
        raise InvalidArgumentError(f"{what} must have items of at least 1 byte, got {checked}")
    return checked


class _Block:
    """Native memory and the commands that use it. Outlives the Python-facing
    allocation, so a collected buffer is still freed only after its last use."""

    __slots__ = ("freed", "generation", "handle", "last_use", "nbytes")

    def __init__(self, handle: Any, nbytes: int) -> None:
        self.handle = handle
        self.nbytes = nbytes
        self.generation = 0  # bumped each time the block is handed out anew
        self.freed = False  # this generation was freed (explicitly or collected)
        self.last_use: dict[Queue, int] = {}  # per queue: value of the last command using it


class _Allocation:
    """What Buffers (and their views) hold; its collection frees the block."""

    __slots__ = ("allocator", "block", "freed", "generation", "handle", "last_use", "nbytes")

    def __init__(self, block: _Block, allocator: Allocator | None = None) -> None:
        self.block = block
        self.handle = block.handle
        self.nbytes = block.nbytes
        self.last_use = block.last_use  # the same dict: commands record uses here
        self.freed = False
        self.allocator = allocator
        self.generation = block.generation

    def __del__(self) -> None:
        # Collected without free(): hand the block back -- unless this generation of it
        # was already freed (and maybe handed out again). Any thread, even inside the GC.
        if self.allocator is not None and not self.freed:
            self.allocator._collected.append((self.block, self.generation))


class Buffer:
    """Device memory. Made by ``await device.alloc(nbytes)``.

    Every command that uses a buffer records its timeline value; :meth:`free` returns the
    memory only after those values have passed, so cancelling an awaiting task never
    frees memory a device still uses.
    """

    def __init__(self, device: Device, allocation: _Allocation, offset: int, nbytes: int) -> None:
        self.device = device
        self._allocation = allocation
        self.offset = offset
        self.nbytes = nbytes

    def __repr__(self) -> str:
        state = " freed" if self._allocation.freed else ""
        return f"<Buffer {self.nbytes} bytes on {self.device.name}{state}>"

    @property
    def freed(self) -> bool:
        return self._allocation.freed

    def view(self, offset: int, nbytes: int | None = None) -> Buffer:
        """A sub-buffer of ``nbytes`` at ``offset`` sharing this buffer's memory."""
        self._check_usable("buffer")
        if not isinstance(offset, int) or not 0 <= offset <= self.nbytes:
            raise InvalidArgumentError(f"offset must be an int in [0, {self.nbytes}], got {offset}")
        nbytes = self.nbytes - offset if nbytes is None else nbytes
        if not isinstance(nbytes, int) or not 0 < nbytes <= self.nbytes - offset:
            raise InvalidArgumentError(
                f"nbytes must be an int in [1, {self.nbytes - offset}], got {nbytes}"
            )
        return Buffer(self.device, self._allocation, self.offset + offset, nbytes)

    def _check_usable(self, what: str, device: Device | None = None) -> None:
        if self._allocation.freed:
            raise ClosedResourceError(f"{what} was freed: {self!r}")
        if self.device.closed:
            raise ClosedResourceError(f"{what} belongs to the closed device {self.device.name}")
        if device is not None and device is not self.device:
            raise InvalidArgumentError(
                f"{what} is on {self.device.name}, expected a buffer of {device.name}"
            )

    def _arg(self) -> Arg:
        return new_arg(Arg, (self._allocation.handle, self.offset, None))

    def _used(self, queue: Queue, value: int) -> None:
        self._allocation.last_use[queue] = value

    async def __aenter__(self) -> Buffer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._allocation.freed:
            await self.free()

    async def write(self, data: Any) -> None:
        """Copy ``data`` (any C-contiguous buffer-protocol object) into the buffer.

        Ordered after earlier work on the device's default queue. Cancelling the await
        does not withdraw the copy: it completes, and ``data`` is kept alive until then.
        """
        await self.device.queue.copy(self, data)

    async def read(self, dtype: Any = np.uint8, shape: Any = None) -> np.ndarray[Any, Any]:
        """A new numpy array holding the buffer's bytes, read after earlier queue work."""
        dtype = plain_dtype(dtype)
        if self.nbytes % dtype.itemsize:
            raise InvalidArgumentError(
                f"buffer of {self.nbytes} bytes is not a whole number of {dtype} items"
            )
        out = np.empty(self.nbytes // dtype.itemsize, dtype)
        await self.device.queue.copy(out, self)
        return out if shape is None else out.reshape(shape)

    async def free(self) -> None:
        """Free the buffer (and every view of it) once the commands using it finished.

        It is unusable at once. Waits until the memory is back with the allocator;
        cancelling that wait changes nothing: the memory still returns when the device
        is done with it.
        """
        self._check_usable("buffer")
        allocation = self._allocation
        allocation.freed = True
        allocation.block.freed = True
        uses = list(allocation.last_use.items())
        self.device._allocator.release_after(allocation.block, uses)
        for queue, value in uses:
            await wait_value(queue.timeline, value)
        if not uses:
            await checkpoint()

    async def map(self, dtype: Any = np.uint8, shape: Any = None) -> np.ndarray[Any, Any]:
        """A zero-copy numpy view of host-visible memory (the cpu device, Metal's shared
        storage), handed out once every command using the buffer has finished.

        The view aliases the buffer: later device work shows through it, and it must
        not be used after the buffer is freed.
        """
        self._check_usable("buffer")
        backend = self.device._backend
        if not backend.host_visible:
            raise InvalidArgumentError(
                f"{self.device.name} memory is not host-visible: use read() instead"
            )
        dtype = plain_dtype(dtype)
        if self.nbytes % dtype.itemsize:
            raise InvalidArgumentError(
                f"buffer of {self.nbytes} bytes is not a whole number of {dtype} items"
            )
        for queue, value in list(self._allocation.last_use.items()):
            await wait_value(queue.timeline, value)
        view = backend.host_view(self._allocation.handle, self.offset, self.nbytes)
        array = np.frombuffer(view, dtype)
        return array if shape is None else array.reshape(shape)


@dataclass(frozen=True)
class MemoryStatistics:
    """A device's memory, in bytes (see :meth:`Device.memory_statistics`)."""

    in_use: int  # buffers handed out, and freed ones whose last use is in flight
    cached: int  # freed blocks kept for reuse
    peak: int  # the most held at once (in use + cached)
    budget: int


class Allocator:
    """The native allocations of one device: a cache of freed blocks, a budget, and
    frees deferred until the device is done with the memory.

    ``in_use`` counts blocks handed out (and freed blocks whose last use is still in
    flight); ``cached`` counts freed blocks kept for reuse. Their sum never exceeds
    ``budget``: an allocation that does not fit waits for frees (backpressure).
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self.budget = device._backend.info.total_memory
        self.cache_limit = min(self.budget // 4, 1 << 30)  # bytes of freed blocks kept
        self.in_use = 0
        self.cached = 0
        self.peak = 0  # the most bytes held at once (in use + cached)
        self._cache: collections.OrderedDict[int, _Block] = collections.OrderedDict()
        self._by_size: dict[int, list[_Block]] = {}
        self._live: set[_Block] = set()  # blocks handed out and not yet released
        self._collected: collections.deque[tuple[_Block, int]] = collections.deque()  # GC
        self._pending: list[tuple[_Block, list[tuple[Queue, int]]]] = []  # not yet armed
        self._frees = HostEvents()  # counts releases: what waiting allocations await
        self._lock = threading.Lock()  # several loops may share a device

    # -- allocation ----------------------------------------------------------------------

    async def alloc(self, nbytes: int, timeout: float | None = None) -> Buffer:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool):
            raise ArgumentTypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
        if nbytes <= 0:
            raise InvalidArgumentError(f"nbytes must be > 0, got {nbytes}")
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
            raise InvalidArgumentError(f"timeout must be a number >= 0, got {timeout!r}")
        if nbytes > self.budget:
            raise self._oom(nbytes, "larger than the device's whole budget")
        deadline = None if timeout is None else time.monotonic() + timeout
        waited = False
        while True:
            self.sweep()
            block = self._try_alloc(nbytes)
            if block is not None:
                break
            # Does not fit: wait for a release (explicit, deferred or collected).
            seen = self._frees.value
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise self._oom(nbytes, f"no memory was freed within {timeout} s")
            with anyio.move_on_after(remaining if remaining is not None else math.inf):
                await wait_value(self._frees, seen + 1)
            waited = True
        if not waited:
            await checkpoint()
        return Buffer(self.device, _Allocation(block, self), 0, nbytes)

    def _try_alloc(self, nbytes: int) -> _Block | None:
        with self._lock:
            blocks = self._by_size.get(nbytes)
            if blocks:  # an exact-size cached block: no native call at all
                block = blocks.pop()
                del self._cache[id(block)]
                self.cached -= nbytes
                return self._hand_out(block)
            if self.in_use + nbytes > self.budget:
                return None  # only releases of blocks in use can make room
            self._evict(self.in_use + self.cached + nbytes - self.budget)
        try:
            handle = self.device._backend.allocate(nbytes)
        except MemoryError:
            with self._lock:
                self._evict(self.cached)  # the device itself is full: drop the cache, retry
            try:
                handle = self.device._backend.allocate(nbytes)
            except MemoryError:
                if self._live:
                    return None  # frees of blocks in use (or in flight) may make room
                raise self._oom(nbytes, "the device itself has no memory left") from None
        with self._lock:
            return self._hand_out(_Block(handle, nbytes))

    def _hand_out(self, block: _Block) -> _Block:
        block.last_use.clear()
        block.generation += 1
        block.freed = False
        self._live.add(block)
        self.in_use += block.nbytes
        self.peak = max(self.peak, self.in_use + self.cached)
        return block

    def _evict(self, nbytes: int) -> None:
        """Free least recently cached blocks natively until ``nbytes`` are gone."""
        while nbytes > 0 and self._cache:
            _, block = self._cache.popitem(last=False)
            self._by_size[block.nbytes].remove(block)
            self.cached -= block.nbytes
            nbytes -= block.nbytes
            self.device._backend.free(block.handle)

    def _oom(self, nbytes: int, detail: str) -> OutOfMemoryError:
        return OutOfMemoryError(nbytes, self.in_use, self.cached, self.budget, detail)

    # -- release -------------------------------------------------------------------------

    def release_after(self, block: _Block, uses: list[tuple[Queue, int]]) -> None:
        """Release ``block`` once each queue's timeline has passed its last use.

        Called on a loop thread: the release runs there, from the bridge's drain."""
        pending = [(q, v) for q, v in uses if q.timeline.value < v and not q.device.closed]
        if not pending:
            self._release(block)
            return
        remaining = [len(pending)]

        def one_done() -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                self._release(block)

        for queue, value in pending:
            call_when_reached(queue.timeline, value, one_done)

    def sweep(self) -> None:
        """Take over blocks whose buffers were garbage-collected (loop thread)."""
        while self._collected:
            block, generation = self._collected.popleft()
            if block in self._live and block.generation == generation and not block.freed:
                block.freed = True
                self.release_after(block, list(block.last_use.items()))

    def _release(self, block: _Block) -> None:
        with self._lock:
            if block not in self._live:
                return
            self._live.discard(block)
            self.in_use -= block.nbytes
            if block.nbytes <= self.cache_limit and not self.device.closed:
                self._cache[id(block)] = block
                self._by_size.setdefault(block.nbytes, []).append(block)
                self.cached += block.nbytes
                self._evict(self.cached - self.cache_limit)
            else:
                self.device._backend.free(block.handle)
        self._frees.increment()

    def set_budget(self, budget: int) -> None:
        if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
            raise InvalidArgumentError(f"memory_budget must be an int > 0, got {budget!r}")
        with self._lock:
            self.budget = budget
            self._evict(self.in_use + self.cached - budget)
        self._frees.increment()  # waiting allocations re-check against the new budget

    def trim(self) -> None:
        """Free every cached block natively."""
        with self._lock:
            self._evict(self.cached)

    def close(self) -> None:
        """The device is closing and idle: free everything natively."""
        with self._lock:
            self._evict(self.cached)
            for block in list(self._live):
                self.device._backend.free(block.handle)
            self._live.clear()
            self.in_use = 0

"""Buffers and the per-device allocator."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ._backend import Arg
from ._errors import ArgumentTypeError, ClosedResourceError, InvalidArgumentError
from ._timeline import wait_value

if TYPE_CHECKING:
    from ._device import Device
    from ._queue import Queue


class _Allocation:
    """One native allocation; sub-buffer views share it."""

    __slots__ = ("freed", "handle", "last_use", "nbytes")

    def __init__(self, handle: Any, nbytes: int) -> None:
        self.handle = handle
        self.nbytes = nbytes
        self.freed = False
        self.last_use: dict[Queue, int] = {}  # per queue: value of the last command using it


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
        return Arg(self._allocation.handle, self.offset)

    def _used(self, queue: Queue, value: int) -> None:
        self._allocation.last_use[queue] = value

    async def write(self, data: Any) -> None:
        """Copy ``data`` (any C-contiguous buffer-protocol object) into the buffer.

        Ordered after earlier work on the device's default queue. Cancelling the await
        does not withdraw the copy: it completes, and ``data`` is kept alive until then.
        """
        await self.device.queue.copy(self, data)

    async def read(self, dtype: Any = np.uint8, shape: Any = None) -> np.ndarray[Any, Any]:
        """A new numpy array holding the buffer's bytes, read after earlier queue work."""
        dtype = np.dtype(dtype)
        if self.nbytes % dtype.itemsize:
            raise InvalidArgumentError(
                f"buffer of {self.nbytes} bytes is not a whole number of {dtype} items"
            )
        out = np.empty(self.nbytes // dtype.itemsize, dtype)
        await self.device.queue.copy(out, self)
        return out if shape is None else out.reshape(shape)

    async def free(self) -> None:
        """Free the buffer once every command using it has finished.

        Waits for those commands; cancelling the wait leaves the buffer freed-pending:
        it is unusable at once and its memory returns when the device is done with it.
        """
        self._check_usable("buffer")
        allocation = self._allocation
        allocation.freed = True
        uses = list(allocation.last_use.items())
        allocation.last_use.clear()
        self.device._allocator.release_after(allocation, uses)
        for queue, value in uses:
            await wait_value(queue.timeline, value)

    async def __aenter__(self) -> Buffer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._allocation.freed:
            await self.free()


class Allocator:
    """Native allocations of one device, returned only after their last use."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.in_use = 0
        self.live: set[_Allocation] = set()
        self.deferred: list[tuple[_Allocation, list[tuple[Queue, int]]]] = []

    async def alloc(self, nbytes: int) -> Buffer:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool):
            raise ArgumentTypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
        if nbytes <= 0:
            raise InvalidArgumentError(f"nbytes must be > 0, got {nbytes}")
        self.sweep()
        handle = self.device._backend.allocate(nbytes)
        allocation = _Allocation(handle, nbytes)
        self.in_use += nbytes
        self.live.add(allocation)
        return Buffer(self.device, allocation, 0, nbytes)

    def release_after(self, allocation: _Allocation, uses: list[tuple[Queue, int]]) -> None:
        """Release ``allocation`` once each queue's timeline has passed its last use."""
        self.deferred.append((allocation, uses))
        self.sweep()

    def sweep(self) -> None:
        """Release every deferred allocation whose last uses have all completed."""
        still = []
        for allocation, uses in self.deferred:
            if all(queue.timeline.value >= value for queue, value in uses):
                self._release(allocation)
            else:
                still.append((allocation, uses))
        self.deferred = still

    def _release(self, allocation: _Allocation) -> None:
        if allocation in self.live:
            self.live.discard(allocation)
            self.in_use -= allocation.nbytes
            self.device._backend.free(allocation.handle)

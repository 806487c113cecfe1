"""copy(): host <-> device, same device, and between devices, ordered on the devices."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ._errors import ArgumentTypeError, InvalidArgumentError
from ._memory import Buffer
from ._timeline import wait_value

if TYPE_CHECKING:
    from ._queue import Completion, Queue


def host_view(obj: Any, what: str, *, writable: bool) -> memoryview:
    """A flat byte view of a host object; refuses what cannot be copied in place."""
    try:
        view = memoryview(obj)
    except TypeError:
        raise ArgumentTypeError(
            f"{what} must be a Buffer or support the buffer protocol, got {type(obj).__name__}"
        ) from None
    if not view.c_contiguous:
        raise InvalidArgumentError(
            f"{what} is not C-contiguous; pass a contiguous copy (numpy.ascontiguousarray)"
        )
    if writable and view.readonly:
        raise InvalidArgumentError(f"{what} is read-only and cannot be copied into")
    if "O" in view.format and _holds_objects(view):
        raise ArgumentTypeError(
            f"{what} holds Python objects ({view.format!r} items): expected plain data "
            "(numbers, bools, bytes); device memory cannot hold object pointers"
        )
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _holds_objects(view: memoryview) -> bool:
    """Whether ``view``'s items hold ``PyObject*`` (its format names an "O" field)."""
    exporter = view.obj
    if isinstance(exporter, np.ndarray):
        return bool(exporter.dtype.hasobject)
    try:
        return bool(np.asarray(view).dtype.hasobject)
    except (TypeError, ValueError):  # a format numpy cannot read: refuse what may be objects
        return True


def _size(dst_nbytes: int, src_nbytes: int, nbytes: int | None) -> int:
    if nbytes is None:
        if dst_nbytes != src_nbytes:
            raise InvalidArgumentError(
                f"sizes do not match: dst holds {dst_nbytes} bytes, src {src_nbytes}; "
                "pass nbytes to copy a prefix"
            )
        nbytes = src_nbytes
    if not isinstance(nbytes, int) or isinstance(nbytes, bool):
        raise ArgumentTypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
    if nbytes <= 0:
        raise InvalidArgumentError(f"nbytes must be > 0, got {nbytes}")
    if nbytes > dst_nbytes or nbytes > src_nbytes:
        raise InvalidArgumentError(
            f"nbytes {nbytes} exceeds dst ({dst_nbytes} bytes) or src ({src_nbytes} bytes)"
        )
    return nbytes


def submit_copy(queue: Queue, dst: Any, src: Any, nbytes: int | None) -> Completion:
    device = queue.device
    if isinstance(dst, Buffer) and not dst.device._backend.writable:
        raise InvalidArgumentError(
            f"dst is a buffer of {dst.device.name}: its buffers are read-only sources"
        )
    if isinstance(dst, Buffer) and isinstance(src, Buffer):
        dst._check_usable("dst", device)
        src._check_usable("src")
        if src.device.kind != device.kind:
            raise InvalidArgumentError(
                f"copies between {src.device.name} and {device.name} are staged through the "
                "host: use asyncmetal.copy()"
            )
        nbytes = _size(dst.nbytes, src.nbytes, nbytes)
        if dst._allocation is src._allocation and (
            dst.offset < src.offset + nbytes and src.offset < dst.offset + nbytes
        ):
            raise InvalidArgumentError(
                f"src and dst overlap in one buffer (src at {src.offset}, dst at "
                f"{dst.offset}, {nbytes} bytes)"
            )
        queue._after((dst, src))
        done = queue._next()
        value = done.value
        peer = None if src.device is device else src.device._backend
        queue._issue(queue._native.copy, dst._arg(), src._arg(), nbytes, value, done, peer)
        dst._used(queue, value)
        src._used(queue, value)
    elif isinstance(dst, Buffer):
        dst._check_usable("dst", device)
        view = host_view(src, "src", writable=False)
        nbytes = _size(dst.nbytes, view.nbytes, nbytes)
        queue._after((dst,))
        done = queue._next()
        value = done.value
        queue._issue(queue._native.copyin, dst._arg(), view[:nbytes], value, done)
        dst._used(queue, value)
    elif isinstance(src, Buffer):
        src._check_usable("src", device)
        view = host_view(dst, "dst", writable=True)
        nbytes = _size(view.nbytes, src.nbytes, nbytes)
        queue._after((src,))
        done = queue._next()
        value = done.value
        queue._issue(queue._native.copyout, view[:nbytes], src._arg(), value, done)
        src._used(queue, value)
    else:
        raise ArgumentTypeError("copy needs a Buffer as dst or src (or both)")
    return done


async def copy(dst: Any, src: Any, nbytes: int | None = None) -> None:
    """Copy ``nbytes`` (default: all) from ``src`` to ``dst`` and wait for it.

    Either side may be a :class:`Buffer` of any device or a host buffer-protocol object
    (numpy array, bytes, ...). Between devices of one kind the backend's own transfer
    runs, ordered on the devices after earlier work that used either buffer. Between
    kinds the bytes go through host memory: directly when one side is host-visible,
    else through a ring of staging buffers, chunked so that reading the source and
    writing the destination overlap. Cancelling the await detaches; the copy goes on.
    """
    if isinstance(dst, Buffer) and isinstance(src, Buffer) and dst.device.kind != src.device.kind:
        await _copy_between_kinds(dst, src, nbytes)
        return
    if isinstance(dst, Buffer):
        if not dst.device._backend.writable:
            raise InvalidArgumentError(f"{dst.device.kind} buffers are read-only sources")
        queue = dst.device.queue
    elif isinstance(src, Buffer):
        queue = src.device.queue
    else:
        raise ArgumentTypeError("copy needs a Buffer as dst or src (or both)")
    await submit_copy(queue, dst, src, nbytes)


STAGING_CHUNK = 8 << 20
STAGING_RING = 3


async def _copy_between_kinds(dst: Buffer, src: Buffer, nbytes: int | None) -> None:
    dst._check_usable("dst")
    src._check_usable("src")
    if not dst.device._backend.writable:
        raise InvalidArgumentError(f"{dst.device.kind} buffers are read-only sources")
    nbytes = _size(dst.nbytes, src.nbytes, nbytes)
    # One side is read or written in place by the other side's queue: that queue's
    # copy is a use of it like any other, so that freeing it (say, once this await is
    # cancelled) returns its memory only after the copy.
    if src.device._backend.host_visible:  # read the source in place
        await _settled(src)
        view = src.device._backend.host_view(src._allocation.handle, src.offset, nbytes)
        queue = dst.device.queue
        done = submit_copy(queue, dst, view, nbytes)
        src._used(queue, done.value)
        await done
        return
    if dst.device._backend.host_visible:  # write the destination in place
        await _settled(dst)
        view = dst.device._backend.host_view(dst._allocation.handle, dst.offset, nbytes)
        queue = src.device.queue
        done = submit_copy(queue, view, src, nbytes)
        dst._used(queue, done.value)
        await done
        return
    await _staged_copy(dst, src, nbytes)


async def _settled(buf: Buffer) -> None:
    """Wait until every command using ``buf`` has finished (those submitted while
    waiting too)."""
    while True:
        pending = [(q, v) for q, v in buf._allocation.last_use.items() if q.timeline.value < v]
        if not pending:
            return
        for queue, value in pending:
            await wait_value(queue.timeline, value)


async def _staged_copy(dst: Buffer, src: Buffer, nbytes: int) -> None:
    """Through host memory, chunk by chunk: the copy-out of chunk i+1 runs while the
    copy-in of chunk i does. A ring slot is reused only once its copy-in finished."""
    chunk = min(STAGING_CHUNK, nbytes)
    ring = [np.empty(chunk, np.uint8) for _ in range(min(STAGING_RING, -(-nbytes // chunk)))]
    copy_ins: list[Completion | None] = [None] * len(ring)
    for i, offset in enumerate(range(0, nbytes, chunk)):
        size = min(chunk, nbytes - offset)
        slot = i % len(ring)
        previous = copy_ins[slot]
        if previous is not None:
            await previous
        stage = ring[slot][:size]
        await submit_copy(src.device.queue, stage, src.view(offset, size), size)
        copy_ins[slot] = submit_copy(dst.device.queue, dst.view(offset, size), stage, size)
    for pending in copy_ins:
        if pending is not None:
            await pending

"""copy(): host <-> device, same device, and between devices, ordered on the devices."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._errors import ArgumentTypeError, InvalidArgumentError
from ._memory import Buffer

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
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


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


def _order_after_other_queues(queue: Queue, *buffers: Buffer) -> None:
    """Make ``queue`` wait, on the device, for each use of ``buffers`` on other queues."""
    for buf in buffers:
        for other, value in list(buf._allocation.last_use.items()):
            if other is not queue and other.timeline.value < value:
                queue.wait(other.timeline, value)


def submit_copy(queue: Queue, dst: Any, src: Any, nbytes: int | None) -> Completion:
    device = queue.device
    if isinstance(dst, Buffer) and isinstance(src, Buffer):
        dst._check_usable("dst", device)
        src._check_usable("src")
        if src.device._backend.kind != device._backend.kind:
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
        _order_after_other_queues(queue, dst, src)
        done = queue._next()
        value = done.value
        peer = None if src.device is device else src.device._backend
        with queue._rollback_on_error():
            queue._native.copy(dst._arg(), src._arg(), nbytes, value, done, peer)
        dst._used(queue, value)
        src._used(queue, value)
    elif isinstance(dst, Buffer):
        dst._check_usable("dst", device)
        view = host_view(src, "src", writable=False)
        nbytes = _size(dst.nbytes, view.nbytes, nbytes)
        _order_after_other_queues(queue, dst)
        done = queue._next()
        value = done.value
        with queue._rollback_on_error():
            queue._native.copyin(dst._arg(), view[:nbytes], value, done)
        dst._used(queue, value)
    elif isinstance(src, Buffer):
        src._check_usable("src", device)
        view = host_view(dst, "dst", writable=True)
        nbytes = _size(view.nbytes, src.nbytes, nbytes)
        _order_after_other_queues(queue, src)
        done = queue._next()
        value = done.value
        with queue._rollback_on_error():
            queue._native.copyout(view[:nbytes], src._arg(), value, done)
        src._used(queue, value)
    else:
        raise ArgumentTypeError("copy needs a Buffer as dst or src (or both)")
    return done


async def copy(dst: Any, src: Any, nbytes: int | None = None) -> None:
    """Copy ``nbytes`` (default: all) from ``src`` to ``dst`` and wait for it.

    Either side may be a :class:`Buffer` of any device or a host buffer-protocol object
    (numpy array, bytes, ...). The copy is ordered after earlier work that used either
    buffer, on the devices. Cancelling the await detaches; the copy still completes.
    """
    if isinstance(dst, Buffer):
        queue = dst.device.queue
    elif isinstance(src, Buffer):
        queue = src.device.queue
    else:
        raise ArgumentTypeError("copy needs a Buffer as dst or src (or both)")
    await submit_copy(queue, dst, src, nbytes)

"""copy(): host <-> device, same device, and between devices, ordered on the devices.

A copy that one queue can run is that queue's ``Queue.copy`` (its operands checked in
``_copyargs``); between devices of different kinds the bytes go through host memory,
here, as copies on each side's default queue."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._buffer import Buffer, buffer_state, check_buffer, host_memory, settled
from ._copyargs import copy_size, no_buffer
from ._errors import InvalidArgumentError
from ._queue import Completion, Queue, copy_in_place


def _queue_of(buf: Buffer) -> Queue:
    """The default queue of ``buf``'s device."""
    queue = buffer_state(buf).default_queue()
    assert isinstance(queue, Queue)
    return queue


async def copy(dst: Any, src: Any, nbytes: int | None = None) -> None:
    """Copy ``nbytes`` (default: all) from ``src`` to ``dst`` and wait for it.

    Either side may be a :class:`Buffer` of any device or a host buffer-protocol object
    (numpy array, bytes, ...). Between devices of one kind the backend's own transfer
    runs, ordered on the devices after earlier work that used either buffer. Between
    kinds the bytes go through host memory: directly when one side is host-visible,
    else through a ring of staging buffers, chunked so that reading the source and
    writing the destination overlap. Cancelling the await detaches; the copy goes on.
    Between kinds, only once submitted: such a copy starts once the buffers' earlier
    users finished, and cancelled before then it is withdrawn (nothing copied; through
    staging buffers, cancelled between chunks, it stops there). Cancelled in flight, the
    buffers stay in use until it ends (never freed before), and the other device's
    later commands on the buffer read or written in place are ordered after it where
    that device's queues can wait for the copying queue (``Queue.after``: cpu and npy
    queues wait for any kind's, Metal and cuda queues for cpu and npy queues'); where
    they cannot, ``synchronize`` the device that copies before writing that buffer.
    """
    if (
        isinstance(dst, Buffer)
        and isinstance(src, Buffer)
        and buffer_state(dst).kind != buffer_state(src).kind
    ):
        await _copy_between_kinds(dst, src, nbytes)
        return
    if isinstance(dst, Buffer):
        if not buffer_state(dst).backend.writable:
            raise InvalidArgumentError(f"{buffer_state(dst).kind} buffers are read-only sources")
        queue = _queue_of(dst)
    elif isinstance(src, Buffer):
        queue = _queue_of(src)
    else:
        raise no_buffer(dst, src)
    await queue.copy(dst, src, nbytes)


STAGING_CHUNK = 8 << 20
STAGING_RING = 3


async def _copy_between_kinds(dst: Buffer, src: Buffer, nbytes: int | None) -> None:
    check_buffer(dst, "dst")
    check_buffer(src, "src")
    if not buffer_state(dst).backend.writable:
        raise InvalidArgumentError(f"{buffer_state(dst).kind} buffers are read-only sources")
    nbytes = copy_size(dst.nbytes, src.nbytes, nbytes)
    # One side is read or written in place by the other side's queue: that queue's
    # copy is a use of it like any other, checked and recorded with the submission, so
    # that freeing it (on another thread as it is submitted, or once this await is
    # cancelled) returns its memory only after the copy, and its own device's later
    # commands wait for the copy where its queues can wait for another kind's.
    if buffer_state(src).backend.host_visible:  # read the source in place
        await settled(src, "src")
        done = copy_in_place(_queue_of(dst), dst, host_memory(src, nbytes), nbytes, src)
        await done
        return
    if buffer_state(dst).backend.host_visible:  # write the destination in place
        await settled(dst, "dst")
        done = copy_in_place(_queue_of(src), host_memory(dst, nbytes), src, nbytes, dst)
        await done
        return
    await _staged_copy(dst, src, nbytes)


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
        await _queue_of(src).copy(stage, src.view(offset, size), size)
        copy_ins[slot] = _queue_of(dst).copy(dst.view(offset, size), stage, size)
    for pending in copy_ins:
        if pending is not None:
            await pending

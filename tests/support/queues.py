"""Queues in a known state, for tests."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NoReturn

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal.backends.cpu import CPUBackend, CPUQueue


def held_queue(device: am.Device) -> tuple[am.Queue, am.Timeline]:
    """A new queue of ``device`` held behind a device wait on a new timeline: what is
    submitted to it runs once the timeline is signalled to 1."""
    tl = device.timeline()
    q = device.new_queue()
    q.wait(tl, 1)
    return q, tl


def fail_new_queues(device: am.Device, where: object, name: str, count: int = 4) -> None:
    """``count`` new_queues of ``device`` that fail, with MemoryError, once their native
    queue was made: ``where.name``, called in a later step of the making, raises it (an
    interrupt there alike). Each hands out nothing, and nothing else holds that queue."""

    def refused(*args: object) -> NoReturn:
        raise MemoryError(f"{name} refused (simulated)")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(where, name, refused)
        for _ in range(count):
            with pytest.raises(MemoryError, match="simulated"):
                device.new_queue()


async def discard_outcomes(done: list[am.Completion]) -> list[bool]:
    """Whether each command ran (its await returned) or was dropped by a close with
    discard=True (it raised ClosedResourceError saying so); anything else fails."""
    ran = []
    for completion in done:
        error: am.ClosedResourceError | None = None
        try:
            await completion
        except am.ClosedResourceError as exc:
            error = exc
        assert error is None or "discard" in str(error), error
        ran.append(error is None)
    return ran


def record_native_closes(
    monkeypatch: pytest.MonkeyPatch, name: Callable[[CPUQueue], object]
) -> list[object]:
    """The list that cpu queues' native closes append ``name(queue)`` to, once closed,
    and cpu backends' closes "backend" to, before closing."""
    events: list[object] = []
    close_queue, close_backend = CPUQueue.close, CPUBackend.close

    def queue_closed(self: CPUQueue, abandon: bool = False) -> None:
        close_queue(self, abandon)
        events.append(name(self))

    def backend_closing(self: CPUBackend) -> None:
        events.append("backend")
        close_backend(self)

    monkeypatch.setattr(CPUQueue, "close", queue_closed)
    monkeypatch.setattr(CPUBackend, "close", backend_closing)
    return events


async def close_failing_with_a_wait(device: am.Device, error: str) -> list[BaseException]:
    """Close ``device``, which must raise an AsyncMetalError matching ``error``, while
    a task waits for a value of one of its timelines that nothing signals (the close
    ends it); return the errors such waits ended with."""
    ended: list[BaseException] = []

    async def wait_on_timeline(timeline: am.Timeline) -> None:
        try:
            await timeline.wait(1)
        except am.ClosedResourceError as exc:
            ended.append(exc)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_on_timeline, device.timeline())
            await anyio.sleep(0.01)
            with pytest.raises(am.AsyncMetalError, match=error):
                await device.close()
    return ended


class _Tracked(np.ndarray):  # (a plain ndarray takes no weak reference)
    pass


async def copies_done_before_awaited(
    device: am.Device,
) -> tuple[weakref.ref[np.ndarray], bytearray]:
    """Two copies on ``device``'s default queue, each awaited once done: from an array
    (nothing else keeps it: the reference given tells whether the queue still does)
    into a buffer, and from the buffer into a bytearray (which cannot be resized while
    the queue keeps a view of it), which it returns."""
    buf = await device.alloc(16)
    source = np.arange(16, dtype=np.uint8).view(_Tracked)
    into = bytearray(16)
    with anyio.fail_after(30):
        for done in (device.queue.copy(buf, source), device.queue.copy(into, buf)):
            while not done.done():  # done before it is awaited
                await anyio.sleep(0.001)
            await done
    return weakref.ref(source), into


async def fail_default_queue_for_good(device: am.Device) -> am.Buffer:
    """Make every later command of ``device``'s default queue fail (``fail_for_good``).
    Returns a buffer of ``device`` the default queue wrote 5s to before."""
    before = await device.alloc(64)
    await before.write(np.full(64, 5, np.uint8))
    await fail_for_good(device, device.queue)
    return before


async def replace_a_used_stand_in(
    device: am.Device,
) -> tuple[am.Buffer, am.Buffer, weakref.ref[am.Queue]]:
    """Fail ``device``'s default queue for good, write a buffer on the queue its buffers'
    work then runs on in its stead (``_own_queue``), and fail that one for good too: the
    device replaces it. Returns the buffer the default queue wrote before, the one the
    stand-in wrote (its record holds the stand-in) and a weak reference to the
    stand-in."""
    before = await fail_default_queue_for_good(device)
    stand_in = device._own_queue()
    buf = await device.alloc(64)
    await buf.write(bytes(64))  # (run on the stand-in)
    assert stand_in in buf._allocation.block.last_use
    await fail_for_good(device, stand_in)
    assert device._own_queue() is not stand_in
    return before, buf, weakref.ref(stand_in)


async def fail_for_good(
    device: am.Device, queue: am.Queue, behind: Callable[[], object] | None = None
) -> None:
    """Make every later command of ``queue``, a queue of ``device``, fail: another
    device (a cpu one) closes while ``queue`` waits (on the device, or held on the host)
    for that device's command that never runs, a copy out of its buffer. ``behind``
    submits more to ``queue`` right after that copy, before the close."""
    other = await am.open_device("cpu:23")
    try:
        put = await other.compile("void put(char* x) { x[0] = 9; }", "put")
        theirs = await other.alloc(64)
        stuck_queue = other.new_queue()
        stuck_queue.wait(other.timeline(), 1)  # never signalled: the close abandons it
        stuck_queue.launch(put, theirs)
        mine = await device.alloc(64)
        copied = queue.copy(mine, theirs)  # ordered after that launch
        if behind is not None:
            behind()
    finally:
        with anyio.fail_after(20):
            await other.close()
    with anyio.fail_after(20), pytest.raises(am.ClosedResourceError):
        await copied


async def check_buffers_usable(device: am.Device, before: am.Buffer) -> None:
    """A zeroed alloc, reads, writes and copies of ``device``'s buffers run (``before``
    holding 5s, as ``fail_default_queue_for_good`` leaves it)."""
    with anyio.fail_after(20):
        buf = await device.alloc(64, zeroed=True)
        assert (await buf.read(np.uint8) == 0).all()
        await buf.write(np.arange(64, dtype=np.uint8))
        out = np.zeros(64, np.uint8)
        await am.copy(out, buf)
        assert (out == np.arange(64)).all()
        assert (await before.read(np.uint8) == 5).all()
        await am.copy(before, buf)
        assert (await before.read(np.uint8) == np.arange(64)).all()

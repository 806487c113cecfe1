"""What a buffer's record of uses keeps alive: the queues that used it, each with its
command's value. A use known done needs keeping no longer, and the queue of a device
that closed -- whose commands ran, or never will -- not at all: the closed device, its
queues and timelines, go once dropped, however long a buffer of another device they
used lives."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am

N = 64
LIMIT = 10  # seconds: a bound on a hang, not a timing


async def _collected(refs: dict[str, weakref.ref[Any]]) -> list[str]:
    """The names of ``refs`` still alive once collections stopped freeing them (a
    device's threads may hold it a moment after its close)."""
    with anyio.move_on_after(LIMIT):
        while gc.collect() >= 0 and any(ref() is not None for ref in refs.values()):
            await anyio.sleep(0.01)
    return [name for name, ref in refs.items() if ref() is not None]


async def _used_by(user: am.Device, src: am.Buffer, abandoned: bool) -> dict[str, weakref.ref[Any]]:
    """Copies ``src`` (a buffer of another device) on ``user``'s default queue and on a
    queue of its own, each into a buffer of ``user``'s; with ``abandoned``, the default
    queue's copy behind a device wait nobody signals (its close abandons it). Returns
    weak references to ``user`` and what of it the copies touched. (The caller keeps
    the device's reaper from letting go of the idle queue meanwhile, ``unreaped``: that
    takes the queue's uses off the records while the device is open.)"""
    dst = await user.alloc(N)
    other = user.new_queue()
    await other.copy(dst, src)
    if abandoned:
        user.queue.wait(user.timeline(), 1)
        user.queue.copy(dst, src)
    else:
        await user.queue.copy(dst, src)
    assert {user.queue, other} <= set(src._allocation.last_use)
    return {
        "device": weakref.ref(user),
        "default queue": weakref.ref(user.queue),
        "its timeline": weakref.ref(user.queue.timeline),
        "another queue": weakref.ref(other),
        "its native queue": weakref.ref(other._native),
    }


@pytest.mark.anyio
@pytest.mark.parametrize("abandoned", [False, True], ids=["ran", "abandoned"])
async def test_a_closed_device_goes_while_a_buffer_its_queues_used_lives(
    anyio_backend: object, unreaped: None, abandoned: bool
) -> None:
    """``cpu:72`` copies a buffer of ``cpu:71`` on two of its queues, then closes and is
    dropped: it is collected, with its queues and their timelines, while the buffer
    lives on -- also where its close abandoned a copy behind a device wait nobody
    signals. The buffer stays usable, and no use of it is left waiting. Checked:
    fails without the fix (the buffer's record held both queues, and through them
    the closed device, for as long as the buffer lived)."""
    async with am.open_device("cpu:71") as owner:
        src = await owner.alloc(N)
        await src.write(np.arange(N, dtype=np.uint8))
        user = await am.open_device("cpu:72")
        refs = await _used_by(user, src, abandoned)
        await user.close()
        del user
        assert await _collected(refs) == []
        assert not src.busy()
        assert (await src.read()).tolist() == list(range(N))
        await src.free()


@pytest.mark.anyio
async def test_a_closed_device_goes_while_a_closed_devices_buffer_it_used_lives(
    anyio_backend: object, unreaped: None
) -> None:
    """As above, with the buffer's own device closed first (the buffer kept): the
    closed device that copied it then goes as it closes in turn. Checked: fails
    without the fix."""
    owner = await am.open_device("cpu:73")
    src = await owner.alloc(N)
    user = await am.open_device("cpu:74")
    refs = await _used_by(user, src, abandoned=False)
    await owner.close()
    await user.close()
    del user
    assert await _collected(refs) == []
    assert src._allocation.last_use == {}
    del owner, src


@pytest.mark.anyio
@pytest.mark.parametrize("abandoned", [False, True], ids=["ran", "abandoned"])
async def test_a_release_pending_on_a_closed_devices_copy_keeps_it_no_longer(
    anyio_backend: object, abandoned: bool
) -> None:
    """A buffer of ``cpu:75`` is dropped while a copy of it on ``cpu:76`` waits behind a
    device wait: its release waits for that copy. Once ``cpu:76`` closed (the copy run,
    or abandoned), that pending release keeps it no longer -- not until ``cpu:75``'s
    next allocation, free or look at its memory -- and the memory is released at that
    next look. Checked: fails without the fix (the release's uses, and the queue's heap
    of releases waiting for it, held the queue)."""
    async with am.open_device("cpu:75") as owner:
        src = await owner.alloc(N)
        user = await am.open_device("cpu:76")
        dst = await user.alloc(N)
        gate = user.timeline()
        user.queue.wait(gate, 1)
        user.queue.copy(dst, src)
        refs = {"device": weakref.ref(user), "default queue": weakref.ref(user.queue)}
        del src
        gc.collect()
        in_use = owner.memory_statistics().in_use  # (a look: the release now waits)
        assert in_use > 0
        if not abandoned:
            gate.signal(1)
        await user.close()
        del user, dst, gate
        assert await _collected(refs) == []
        assert owner.memory_statistics().in_use < in_use  # (released at this look)


@pytest.mark.anyio
async def test_an_abandoned_use_stays_on_the_record_until_its_device_ran_out(
    anyio_backend: object, unreaped: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy on ``cpu:78`` of a buffer of ``cpu:77``, abandoned by ``cpu:78``'s close
    behind a device wait nobody signals, stays on the buffer's record as ``cpu:78``'s
    queues stop -- a GPU stream runs such a copy as its backend's close raises what it
    waits on, and the memory must not go to another buffer before -- and goes once
    its commands ran out; a copy that ran goes as the queues stop."""
    from asyncmetal import _allocator

    left: list[tuple[bool, list[str]]] = []  # (ran out, the uses left) as queues stopped
    forget = _allocator.forget_closed_queues

    def noted(state: Any) -> None:
        forget(state)
        names = {user.queue: "abandoned", ran: "ran"}
        left.append((state.ran_out, [names[q] for q in src._allocation.last_use]))

    monkeypatch.setattr(_allocator, "forget_closed_queues", noted)
    async with am.open_device("cpu:77") as owner:
        src = await owner.alloc(N)
        user = await am.open_device("cpu:78")
        dst = await user.alloc(N)
        ran = user.new_queue()
        await ran.copy(dst, src)
        user.queue.wait(user.timeline(), 1)
        user.queue.copy(dst, src)
        assert set(src._allocation.last_use) == {ran, user.queue}
        await user.close()
        assert left == [(False, ["abandoned"])]
        assert src._allocation.last_use == {}

"""A queue closed (``Queue.close``) or replaced as the device's default queue's
stand-in goes off the buffers' records of uses once its commands ran, while the device
stays open: the reaper takes its uses off, as those of an idle queue, so that a buffer
does not keep every queue that ever used it (each with its timeline and native queue)
alive until the buffer goes or the device closes."""

from __future__ import annotations

import gc
import time
import weakref

import anyio
import pytest

import asyncmetal as am
from tests.support.queues import replace_a_used_stand_in

pytestmark = pytest.mark.anyio

LIMIT = 20  # seconds: the reaper looks within a fraction of this


async def _until_gone(refs: list[weakref.ref[am.Queue]], *buffers: am.Buffer) -> None:
    """Wait (LIMIT at most) until every queue of ``refs`` is collected and off the
    records of ``buffers``; fail saying how many are left."""
    left = len(refs)
    deadline = time.monotonic() + LIMIT
    while time.monotonic() < deadline:
        gc.collect()
        left = sum(r() is not None for r in refs)  # (on a record or not: alive)
        if not left:
            return
        await anyio.sleep(0.2)
    sizes = [len(b._allocation.block.last_use) for b in buffers]
    pytest.fail(f"{left} of {len(refs)} queues left alive; records of {sizes} uses")


async def test_closed_queues_go_off_the_buffers_records(device: am.Device) -> None:
    """Checked failing before: every closed queue stayed on both buffers' records (and
    alive) as long as the device was open."""
    src, dst = await device.alloc(64), await device.alloc(64)
    refs = []
    for _ in range(30):
        async with device.new_queue() as q:
            await q.copy(dst, src)
        refs.append(weakref.ref(q))
    del q
    await _until_gone(refs, src, dst)
    assert len(src._allocation.block.last_use) <= 1  # (the default queue's, at most)


async def test_a_closed_queue_with_work_in_flight_keeps_its_uses_until_done(
    device: am.Device,
) -> None:
    """A queue closed while its commands wait behind a device wait keeps its uses on
    the records until they ran; then it goes off them."""
    src, dst = await device.alloc(64), await device.alloc(64)
    tl = device.timeline()
    q = device.new_queue()
    q.wait(tl, 1)
    q.copy(dst, src)
    ref = weakref.ref(q)
    async with anyio.create_task_group() as tg:
        tg.start_soon(q.close)
        await anyio.sleep(0.3)  # (the reaper looks meanwhile: nothing has run)
        assert q in src._allocation.block.last_use
        tl.signal(1)
    del q
    await _until_gone([ref], src, dst)


async def test_a_replaced_stand_in_queue_goes_off_the_buffers_records(device: am.Device) -> None:
    """The queue the device's buffers' work ran on in its default queue's stead, once
    replaced (``retire_queue``) and released, goes off those buffers' records too."""
    before, buf, ref = await replace_a_used_stand_in(device)
    with anyio.fail_after(LIMIT):
        with pytest.raises(am.ClosedResourceError, match="device-side wait"):
            await device.synchronize()  # (the default queue's)
        await device.synchronize()
    await _until_gone([ref], buf, before)

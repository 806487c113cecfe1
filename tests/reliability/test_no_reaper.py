"""A device whose reaper thread could not be started (``threading.Thread.start`` raising
RuntimeError, "can't start new thread", under a limit on threads) still takes the uses
of its closed queues off the buffers' records once they are released: nothing else
would (the reaper's looks do it where one runs), and each closed queue, with its
timeline, would stay alive on those records as long as the buffers.

The reaper's start is refused here, and only its: the release threads still run."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import anyio
import pytest

import asyncmetal as am
from tests.support.queues import replace_a_used_stand_in

pytestmark = pytest.mark.anyio

LIMIT = 20  # seconds: the release threads end within a fraction of this


@pytest.fixture
def no_reaper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every device's reaper fails to start, as with no thread to be had."""
    start = threading.Thread.start

    def refuse_reapers(self: threading.Thread) -> None:
        if self.name.startswith("asyncmetal reaper"):
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", refuse_reapers)


def _closed_on(buf: am.Buffer) -> list[am.Queue]:
    """The closed (or replaced) queues on ``buf``'s record of uses."""
    return [q for q in buf._allocation.block.last_use if q._closed is not None]


async def _until_collected(refs: list[weakref.ref[am.Queue]]) -> None:
    """Wait (LIMIT at most) until every queue of ``refs`` is collected: a release thread
    (the native close) holds its queues until it is done, which nobody awaits where a
    new_queue started it."""
    deadline = time.monotonic() + LIMIT
    while True:
        gc.collect()
        left = sum(r() is not None for r in refs)
        if not left:
            return
        assert time.monotonic() < deadline, f"{left} of {len(refs)} queues left alive"
        await anyio.sleep(0.05)


async def test_closed_queues_go_off_the_records_without_a_reaper(
    no_reaper: None, device: am.Device
) -> None:
    """Checked failing before: with no reaper every closed queue stayed on both buffers'
    records (and alive) until the device closed."""
    src, dst = await device.alloc(64), await device.alloc(64)
    refs = []
    for _ in range(5):
        async with device.new_queue() as q:
            await q.copy(dst, src)
        refs.append(weakref.ref(q))
    del q
    assert device._reaper is None  # (the scenario: no reaper ever ran)
    assert _closed_on(src) == _closed_on(dst) == []
    assert not device._closed_off
    await _until_collected(refs)


async def test_a_replaced_stand_in_goes_off_the_records_without_a_reaper(
    no_reaper: None, device: am.Device
) -> None:
    """The default queue's stand-in, once replaced and released (by a new_queue: no
    reaper looks), goes off its buffers' records too."""
    before, buf, ref = await replace_a_used_stand_in(device)
    with pytest.raises(am.ClosedResourceError, match="device-side wait"):
        await device.synchronize()  # (the default queue's)
    await device.synchronize()
    async with device.new_queue():  # (releases the stand-in, settled: _release_done)
        pass
    assert device._reaper is None
    assert _closed_on(buf) == _closed_on(before) == []
    await _until_collected([ref])

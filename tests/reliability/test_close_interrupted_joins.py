"""A device's native close interrupted (a Ctrl-C as it runs at exit, on the main thread)
while it waits, before its steps, for the threads it joins -- the makers of queues made
as it closed, its reaper, the threads releasing queues closed before -- waits for them
all the same, then runs every step (its queues, its memory and its backend released,
the device taken off the open ones) and raises the interrupt once they ran. On every
device of the ``device`` fixture's (cpu, the simulated Metal)."""

from __future__ import annotations

import threading
import time
import types
from typing import Any

import pytest

import asyncmetal as am
from asyncmetal import _device
from asyncmetal._device_state import unreleased_states

pytestmark = pytest.mark.anyio


class _InterruptedJoin:
    """``thread``, whose first join raises a KeyboardInterrupt before it waits (where a
    Ctrl-C lands in a join on the main thread); later joins wait for it."""

    def __init__(self, thread: threading.Thread) -> None:
        self.thread, self.ident, self.interrupted = thread, thread.ident, False

    def join(self) -> None:
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        self.thread.join()

    def is_alive(self) -> bool:
        return self.thread.is_alive()


@pytest.mark.parametrize("at", ["making", "reaper", "release"])
async def test_an_interrupt_in_a_native_close_s_joins_skips_none_of_its_steps(
    anyio_backend: object, device_name: str, monkeypatch: pytest.MonkeyPatch, at: str
) -> None:
    """A device with two buffers and a queue, its native close (as at exit) interrupted
    in one of its waits before its steps: for a queue being made ("making": its poll's
    sleep), for its reaper, for a release thread. The close waits on (the thread
    joined, the count of queues being made at 0), then releases everything, and raises
    the interrupt. Checked failing before: the interrupt left the close there, the
    device marked closed with nothing released ('assert 1 == 0': its memory stayed
    allocated; at "reaper", 'assert not True': the reaper was not waited for)."""
    dev = await am.open_device(device_name)
    backend = dev._backend
    for _ in range(2):
        await dev.alloc(256)
    queue = dev.new_queue()
    closed: list[bool] = []
    close = backend.close

    def noted_close() -> None:
        close()
        closed.append(True)

    monkeypatch.setattr(backend, "close", noted_close)
    interrupted: list[bool] = []
    if at == "making":
        dev._makings += 1  # (a maker's count, given back once its queue is released)

        def sleep(seconds: float) -> None:
            if not interrupted:
                interrupted.append(True)
                dev._makings -= 1
                raise KeyboardInterrupt
            time.sleep(seconds)

        monkeypatch.setattr(
            _device, "time", types.SimpleNamespace(sleep=sleep, monotonic=time.monotonic)
        )
    elif at == "reaper":
        assert dev._reaper is not None
        reaper: Any = _InterruptedJoin(dev._reaper)
        dev._reaper = reaper
    else:
        released = threading.Thread(target=lambda: None)
        released.start()
        release: Any = _InterruptedJoin(released)
        dev._release_threads.append(release)
    with pytest.raises(KeyboardInterrupt):
        dev._close_native(abandon=True)
    if at == "making":
        assert interrupted
        assert not dev._makings
    elif at == "reaper":
        assert reaper.interrupted
        assert not reaper.is_alive()  # waited for all the same
    else:
        assert release.interrupted
    assert backend.live_allocations == 0, backend.live_allocations
    assert closed == [True]
    assert dev._state.ran_out
    assert dev not in _device._devices()
    assert dev._state not in unreleased_states()
    assert queue.closed

"""A Metal queue's close interrupted at each call's entry and return in it (a Ctrl-C as
the device's close runs at exit, on the main thread; the device's close runs the
queue's close again) runs none of it again once the queue was released."""

from __future__ import annotations

import contextlib
import gc
import time
from types import FunctionType
from typing import Any

import anyio
import pytest

import asyncmetal as am
from asyncmetal import _interrupts
from asyncmetal._queue import native_queue
from asyncmetal.backends.metal._queue import MetalQueue
from tests.backends.metal.test_metal import sim_only
from tests.support.fakes import metal_sim
from tests.support.interrupts import interrupted

pytestmark = [pytest.mark.metal, sim_only, pytest.mark.anyio]

# What a queue's close releases (the device's default queue's too).
_RELEASED = ("MTLCommandBuffer", "MTLCommandQueue")


async def test_a_metal_queue_close_interrupted_anywhere_runs_none_of_it_again_once_released(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each place in turn, on a device with a queue that ran a fill: no close of a queue
    begins once that queue was released (its MTLCommandQueue's finalizer run). Checked
    failing with the close noted ran only after it returned: an interrupt as it
    returned ran it again ('close return _close')."""
    close = MetalQueue._close
    again: list[str] = []

    def closing(self: MetalQueue, abandon: bool) -> None:
        if not self._release_dropped.alive:
            again.append(", ".join(where[0]))  # (where the interrupt was raised)
        close(self, abandon)

    monkeypatch.setattr(MetalQueue, "_close", closing)
    helpers = [f for f in vars(_interrupts).values() if isinstance(f, FunctionType)]
    codes = {f.__code__ for f in (MetalQueue.close, closing, close, *helpers)}
    where: list[list[str]] = [[]]
    at = 0
    while True:
        dev = await am.open_device("metal")
        queue: Any = dev.new_queue()
        await queue.fill(await dev.alloc(64), 0)
        gc.collect()
        gc.disable()  # (no finalizer's call among the places counted)
        try:
            with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
                where[0] = raised  # (filled as it is raised)
                dev._close_native(abandon=True)
        finally:
            gc.enable()
        assert dev not in am.open_devices()
        if not raised:
            break
        at += 1
        assert at < 500
    assert at > 10 and again == [], again


async def test_a_metal_queue_close_interrupted_anywhere_releases_its_command_buffers(
    anyio_backend: object,
) -> None:
    """Each place in turn, in the close (at exit: abandoning) of a queue with command
    buffers still listed (fills not awaited): once the device's close ran it again,
    every command buffer and the MTLCommandQueue are released -- none left alive, none
    released twice (the simulated Metal aborts on a message to a released object).
    Checked failing with the buffers retained and released one by one in Python, as
    before: "(['_close return retain'], {'MTLCommandBuffer': 1, 'MTLCommandQueue': 1})";
    and with _release's list cleared before its loop released them: "(['_release
    c_return clear'], {'MTLCommandBuffer': 2, 'MTLCommandQueue': 1})"."""
    helpers = [f for f in vars(_interrupts).values() if isinstance(f, FunctionType)]
    codes = {
        f.__code__ for f in (MetalQueue.close, MetalQueue._close, MetalQueue._release, *helpers)
    }
    at = 0
    while True:
        gc.collect()
        before = {name: metal_sim.live(name) for name in _RELEASED}
        dev = await am.open_device("metal")
        queue: Any = dev.new_queue()
        buf = await dev.alloc(64)
        queue.fill(buf, 0)
        queue.fill(buf, 1)
        assert native_queue(queue)._buffers
        gc.disable()  # (no finalizer's call among the places counted)
        try:
            with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
                dev._close_native(abandon=True)
        finally:
            gc.enable()
        assert dev not in am.open_devices()
        del queue, buf
        # (a command buffer's last reference, and its queue's, may go as its handler
        # returns, on the simulated GPU's thread: looked at until then, 10 s at most)
        deadline = time.monotonic() + 10
        while True:
            gc.collect()
            left = {n: metal_sim.live(n) - before[n] for n in _RELEASED}
            if not any(left.values()) or time.monotonic() > deadline:
                break
            await anyio.sleep(0.001)
        assert left == dict.fromkeys(_RELEASED, 0), (raised, left)
        if not raised:
            break
        at += 1
        assert at < 500
    assert at > 10, at

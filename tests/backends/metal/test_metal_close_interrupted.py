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
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _interrupts
from asyncmetal._queue import native_queue
from asyncmetal.backends.metal._queue import MetalQueue
from tests.backends.metal.test_metal import sim_only, unwrapped
from tests.backends.metal.test_metal_races import _until
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


async def test_a_close_interrupted_in_its_drain_after_the_worker_released_lets_go_of_it(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An abandoning close (at exit) whose worker is busy leaves the release to the
    worker, which may run it (the queue's finalizer then dead) as this thread still
    drains: an interrupt then, before the drain let go of the command buffers it holds,
    and the close run again (by the device's) lets go of them all the same. The
    worker's release is run here just before the drain lets go (where the interrupt
    lands). Checked failing with the close run again doing nothing once the finalizer
    is dead: the buffers drained and the queue left (assert {'MTLCommandBuffer': 3,
    'MTLCommandQueue': 1} == {... 0, ... 0})."""
    unwrapped(monkeypatch)  # (the copy below is staged on the queue's own thread)
    gc.collect()
    before = {name: metal_sim.live(name) for name in _RELEASED}
    dev = await am.open_device("metal")
    queue: Any = dev.new_queue()
    own = native_queue(queue)
    assert isinstance(own, MetalQueue)
    buf = await dev.alloc(64)
    queue.fill(buf, 0)
    queue.copy(buf, np.ones(16, np.int32))  # (the worker started)
    queue.fill(buf, 1)
    # (the worker idle: joined by the close, which runs the release itself -- stood in
    # for here by the worker's, as the drain ends)
    await _until(lambda: not own._routed and not own._busy)
    lib = own._backend.lib
    release_each = lib.am_metal_release_each
    cut: list[bool] = []

    def releasing(held: Any, *args: Any) -> None:
        if held is own._drained and not cut and any(held):
            cut.append(True)
            own._release()  # (the worker's, as the drain ends)
            raise KeyboardInterrupt
        release_each(held, *args)

    monkeypatch.setattr(lib, "am_metal_release_each", releasing)
    with contextlib.suppress(KeyboardInterrupt):
        dev._close_native(abandon=True)
    monkeypatch.undo()
    assert cut and not own._release_dropped.alive
    dev._close_native(abandon=True)  # (at exit: the device's close run again)
    del queue, buf
    deadline = time.monotonic() + 5
    while True:
        gc.collect()
        left = {name: metal_sim.live(name) - before[name] for name in _RELEASED}
        if not any(left.values()) or time.monotonic() > deadline:
            break
        await anyio.sleep(0.001)
    assert left == dict.fromkeys(_RELEASED, 0)

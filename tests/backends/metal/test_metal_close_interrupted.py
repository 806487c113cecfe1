"""A Metal queue's close interrupted at each call's entry and return in it (a Ctrl-C as
the device's close runs at exit, on the main thread; the device's close runs the
queue's close again) runs none of it again once the queue was released."""

from __future__ import annotations

import contextlib
import gc
from types import FunctionType
from typing import Any

import pytest

import asyncmetal as am
from asyncmetal import _interrupts
from asyncmetal.backends.metal._queue import MetalQueue
from tests.backends.metal.test_metal import sim_only
from tests.support.interrupts import interrupted

pytestmark = [pytest.mark.metal, sim_only, pytest.mark.anyio]


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

"""A device whose teardown's native close was cut by a KeyboardInterrupt (raised by the
close that awaited it) is finished by the next ``await dev.close()``: that close runs
the native close again, with the teardown's arguments, and returns once the device is
released -- its queues closed natively, its memory freed, its reaper joined, the device
off the open ones -- rather than at once, leaving that to the exit hook.

The interrupt lands where CPython would run a signal handler (see
``tests.support.interrupts.interrupted``), in the native close's own frame, at each
place in turn, on a fresh device each time (raised on the teardown's thread, which no
Ctrl-C reaches, as a step raising one would): only where it hands its steps over is
the close cut; elsewhere it ran them all."""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import anyio
import pytest

import asyncmetal as am
from asyncmetal import _device
from tests.support.interrupts import interrupted, native_closes

pytestmark = pytest.mark.anyio

MOST_PLACES = 50  # (the native close's own frame has a few)


async def test_a_close_after_one_whose_native_close_was_cut_releases_the_device(
    anyio_backend: object, device_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each place in turn: the first close raises the interrupt (where one landed), and
    the second leaves the device released. Checked failing before (a second close
    returned at once, the teardown having ended): at place 0 ('_close_native call
    until_uninterrupted': nothing of it run) 'assert [True] == [False]' (the device
    still open after the second close)."""
    closed = await native_closes(monkeypatch, device_name)
    code = am.Device._close_native.__code__
    cuts: list[str] = []
    at = 0
    while True:
        dev = await am.open_device(device_name)
        natives = [dev.queue._native, dev.new_queue()._native]
        await dev.alloc(256)
        await dev.queue.marker()
        real = dev._close_native
        raised: list[str] = []

        def cut(*args: Any, real: Any = real, raised: list[str] = raised, at: int = at) -> None:
            if raised:  # (once: run again, it is not cut)
                return real(*args)  # type: ignore[no-any-return]
            gc.collect()
            gc.disable()  # (no finalizer's call among the places counted)
            try:
                with interrupted({code}, at) as places:
                    try:
                        real(*args)
                    finally:
                        raised.extend(places or ["none"])
            finally:
                gc.enable()

        dev._close_native = cut  # type: ignore[method-assign]
        with anyio.fail_after(20):
            with contextlib.suppress(KeyboardInterrupt):
                await dev.close()
            assert dev.closed
            if raised != ["none"] and any(d is dev for d in _device._devices()):
                cuts.append(raised[0])  # (cut: the device left open)
            await dev.close()  # finishes what the first left
        reaper = dev._reaper
        assert [any(d is dev for d in _device._devices())] == [False], raised
        assert dev._backend.live_allocations == 0, raised
        assert [n for n in natives if not any(n is c for c in closed)] == [], raised
        assert reaper is None or not reaper.is_alive(), raised
        closed.clear()
        if raised == ["none"]:
            break
        at += 1
        assert at < MOST_PLACES
    assert cuts, "no place left the device open after the first close"

"""A device's native close interrupted anywhere in its own code (a Ctrl-C as it runs at
exit, on the main thread) -- at a step's entry or return, between two steps, inside its
bookkeeping (marking it closed, taking the collected queues off its records) -- still
runs every step: its queues, its memory and its backend are released and the device
taken off the open ones, and the interrupt is raised once they ran. On every device of
the ``device`` fixture's (cpu, the simulated Metal), and on cuda over the fake driver,
whose backend's close is interrupted in its own steps too.

The interrupt lands where CPython would run a signal handler (see
``tests.support.interrupts.interrupted``): at each call's entry and return made from the
close's frames, one place after another, on a fresh device each time."""

from __future__ import annotations

import functools
import gc
import signal
import sys
from collections.abc import Callable, Iterator
from types import CodeType, FunctionType
from typing import Any

import pytest

import asyncmetal as am
from asyncmetal import _device, _interrupts
from asyncmetal._device_state import unreleased_states
from asyncmetal.backends.cuda import _backend as cuda_backend
from tests.reliability.test_cuda_faults import _Driver, fake_driver
from tests.support.interrupts import interrupted, native_closes

pytestmark = pytest.mark.anyio

MOST_PLACES = 2_000  # (a close has a few hundred)


# The close's own frames: the device's methods, the functions of its module that run
# for the close (``_note_open``), and the interrupts helpers it runs its steps with.
CLOSE_CODES = {
    f.__code__
    for owner in (am.Device, _device, _interrupts)
    for f in vars(owner).values()
    if isinstance(f, FunctionType) and f.__module__ in (_device.__name__, _interrupts.__name__)
}


def _interrupts_of(close: Callable[[], object]) -> int:
    """``close()``; how many KeyboardInterrupts it raised, or that were reported (one
    that lands in a callback the close set off -- a weakref's, as an object it held
    ends -- is reported, not raised, as CPython does with one raised there)."""
    seen = 0

    def reported(info: Any) -> None:
        nonlocal seen
        seen += isinstance(info.exc_value, KeyboardInterrupt)

    hook, sys.unraisablehook = sys.unraisablehook, reported
    try:
        close()
    except KeyboardInterrupt:
        seen += 1
    finally:
        sys.unraisablehook = hook
    return seen


async def _sweep(
    device_name: str,
    monkeypatch: pytest.MonkeyPatch,
    codes: set[CodeType],
    left_by: Callable[[am.Device], list[str]] = lambda dev: [],
) -> tuple[int, list[str]]:
    """Close a fresh device of ``device_name`` natively (as at exit: abandoning), with
    two buffers, a queue made and one collected, interrupted at each place of
    ``codes`` in turn, until a close has no place left. Returns how many places were
    interrupted, and where the close left what (``left_by``: what else it left)."""
    natives = await native_closes(monkeypatch, device_name)
    handler = signal.getsignal(signal.SIGINT)
    left: list[str] = []
    at = 0
    while True:
        dev = await am.open_device(device_name)
        backend: Any = dev._backend
        bufs = [await dev.alloc(256) for _ in range(2)]
        queue = dev.new_queue()
        dropped = dev.new_queue()  # collected: its native queue released by the close
        made = [queue._native, dropped._native, dev.queue._native]
        del dropped
        closes: list[bool] = []
        close = backend.close

        def noted_close(close: Callable[[], None] = close, closes: list[bool] = closes) -> None:
            close()
            closes.append(True)

        monkeypatch.setattr(backend, "close", noted_close)
        gc.collect()  # (the dropped queue's finalizer runs now, not as the close runs)
        gc.disable()  # (nor another's: its interrupt would be reported, not raised)
        try:
            with interrupted(codes, at) as raised:
                caught = _interrupts_of(functools.partial(dev._close_native, abandon=True))
        finally:
            gc.enable()
        if not raised:
            assert caught == 0
            return at, left
        where = f"{at} ({raised[0]})"
        # (a close's steps at exit note a Ctrl-C meanwhile: that handler put back after)
        assert signal.getsignal(signal.SIGINT) is handler, where
        assert caught == 1, where  # the interrupt reaches the caller (or is reported), once
        if not dev.closed:
            # Before its first step (as the loop running them is entered): as at the
            # close's own entry, nothing of it ran, and it is the caller's to close.
            assert at == 0, where
            dev._close_native(abandon=True)
        unreleased = [n for n in made if not any(n is c for c in natives)]
        what = [
            name
            for name, left_over in [
                ("queues", unreleased),
                ("memory", backend.live_allocations),
                ("backend", not closes),
                ("ran out", not dev._state.ran_out),
                ("noted open", dev in _device._devices()),
                ("unreleased", dev._state in unreleased_states()),
            ]
            if left_over
        ] + left_by(dev)
        if what:
            left.append(f"{where}: {', '.join(what)}")
            _device._note_open(dev, False)  # (the next device's close finds it closed)
        del bufs, queue
        natives.clear()
        at += 1
        assert at < MOST_PLACES


async def test_a_native_close_interrupted_anywhere_releases_everything(
    anyio_backend: object, device_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each place in turn: the close raises the interrupt once, and has released the
    device's queues (the default one, one made, one collected), its memory and its
    backend, and taken the device off the open (and the unreleased) ones."""
    places, left = await _sweep(device_name, monkeypatch, CLOSE_CODES)
    assert places > 20 and left == [], left


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Driver]:
    yield from fake_driver(monkeypatch)


# The cuda backend's close's own frames, and the helpers it runs its steps with.
CUDA_CLOSE_CODES = {
    f.__code__
    for f in (
        cuda_backend.CUDABackend.close,
        cuda_backend.CUDABackend._close,  # (keeps_context's wrapper)
        cuda_backend.CUDABackend._close.__wrapped__,  # type: ignore[attr-defined]
        *(f for f in vars(_interrupts).values() if isinstance(f, FunctionType)),
    )
}


async def test_a_cuda_backend_s_close_interrupted_anywhere_runs_all_of_it(
    anyio_backend: object, driver: _Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cuda backend's close (over the fake driver) of a device whose queues and
    memory its close released, with a kernel loaded, interrupted at each place of its
    own code in turn (the end of its device waits, the rest after it): it raises the
    interrupt once, having unloaded the module, stopped its freeing thread and
    synchronized the context (what its abandoned streams still ran ran out)."""
    left: list[str] = []
    at = 0
    while True:
        dev = await am.open_device("cuda:0")
        backend: Any = dev._backend
        backend.load(b"", "k")
        close = backend.close
        monkeypatch.setattr(backend, "close", lambda: None)
        dev._close_native(abandon=True)  # (all but the backend's close)
        driver.calls.clear()
        with interrupted(CUDA_CLOSE_CODES, at) as raised:
            caught = _interrupts_of(close)
        if not raised:
            break
        where = f"{at} ({raised[0]})"
        assert caught == 1, where
        if at == 0:  # (before its first step: the device's close runs it again)
            close()
        what = [
            name
            for name, left_over in [
                ("module", "cuModuleUnload" not in driver.calls),
                ("synchronize", "cuCtxSynchronize" not in driver.calls),
                ("freer", backend._freer.is_alive()),
            ]
            if left_over
        ]
        if what:
            left.append(f"{where}: {', '.join(what)}")
        at += 1
        assert at < MOST_PLACES
    assert at > 5 and left == [], left

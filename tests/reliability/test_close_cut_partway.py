"""A device's close cut partway -- a native free that fails, a KeyboardInterrupt in one of
its steps -- still frees every block it can, leaves none of those left to queues
unregistered, and runs its later steps (the backend's close, the frees of the memory
left to queues, the device taken off the open ones); the error, or the interrupt, is
raised once all ran. On every device of the ``device`` fixture's (cpu, the simulated
Metal)."""

from __future__ import annotations

import gc
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _device
from asyncmetal._device_state import unreleased_states

pytestmark = pytest.mark.anyio


class DriverError(RuntimeError):
    """A native call that failed (injected): a free, a queue's close."""


async def _buffers(dev: am.Device, count: int) -> tuple[list[am.Buffer], list[Any]]:
    """``count`` buffers of ``dev``, and their blocks in the order the close looks at
    them (its allocator's live ones, which nothing changes until the close)."""
    buffers = [await dev.alloc(256) for _ in range(count)]
    by_block = {b._allocation.block: b for b in buffers}
    order = [block for block in dev._allocator._live if block in by_block]
    return [by_block[block] for block in order], order


async def test_a_free_that_fails_in_a_close_stops_no_other_free(
    anyio_backend: object, device_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six buffers; the first two the close looks at copied between behind a device
    wait nobody signals (the close leaves them to that abandoned copy: freed once the
    device's commands ran out), the third's native free fails. The close raises that
    error, and every other block is freed: those after the failing one, and the two
    left to the copy (registered as found). Checked failing before: the error ended
    the close's frees there ('assert 6 == 1': it, the three after it, and the two kept
    before it, never registered, stayed allocated)."""
    dev = await am.open_device(device_name)
    backend = dev._backend
    buffers, order = await _buffers(dev, 6)
    failing = order[2].handle
    free = backend.free
    failed: list[Any] = []

    def failing_free(handle: Any) -> None:
        if handle is failing and not failed:
            failed.append(handle)
            raise DriverError("injected: the native free failed")
        free(handle)

    monkeypatch.setattr(backend, "free", failing_free)
    queue = dev.new_queue()
    queue.wait(dev.timeline(), 1)  # never signalled: the close abandons what follows
    queue.copy(buffers[0], buffers[1])
    assert [b for b in dev._allocator._live if b in set(order)] == order  # (unchanged)
    with anyio.fail_after(20), pytest.raises(DriverError, match="injected"):
        await dev.close()
    assert failed == [failing]
    assert backend.live_allocations == 1, backend.live_allocations  # the failing one
    assert not dev._allocator._live
    assert dev not in _device._devices()


async def test_a_cached_blocks_free_that_fails_in_a_close_stops_no_other_free(
    anyio_backend: object, device_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three buffers freed (their blocks cached), two still live; the native free of the
    first cached block the close frees fails. The close raises that error, and every
    other block, cached or live, is freed. Checked failing before: the error ended the
    close there ('assert 5 == 1': the other cached ones and the live ones stayed
    allocated)."""
    dev = await am.open_device(device_name)
    backend = dev._backend
    buffers = [await dev.alloc(256) for _ in range(5)]
    for buf in buffers[:3]:
        await buf.free()
    assert len(dev._allocator._cache) == 3
    free = backend.free
    failed: list[Any] = []

    def failing_free(handle: Any) -> None:
        if not failed:
            failed.append(handle)
            raise DriverError("injected: the native free failed")
        free(handle)

    monkeypatch.setattr(backend, "free", failing_free)
    with anyio.fail_after(20), pytest.raises(DriverError, match="injected"):
        await dev.close()
    assert failed
    assert backend.live_allocations == 1, backend.live_allocations  # the failing one
    assert not dev._allocator._cache
    assert not dev._allocator._live


async def test_a_block_lent_out_after_a_free_that_fails_is_left_to_its_loan(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three cpu buffers; the native free of the first the close looks at fails, the
    second is lent out (DLPack, to numpy) as the device closes. The close raises the
    error, frees the third, and leaves the lent one to its loan: freed once the numpy
    array is collected. Checked failing before: the error ended the close's frees
    there ('assert 3 == 2': the lent one, never left to its loan, stayed allocated
    after it, and the third too)."""
    dev = await am.open_device("cpu")
    backend = dev._backend
    buffers, order = await _buffers(dev, 3)
    failing = order[0].handle
    lent: Any = np.from_dlpack(buffers[1])
    free = backend.free
    failed: list[Any] = []

    def failing_free(handle: Any) -> None:
        if handle is failing and not failed:
            failed.append(handle)
            raise DriverError("injected: the native free failed")
        free(handle)

    monkeypatch.setattr(backend, "free", failing_free)
    with anyio.fail_after(20), pytest.raises(DriverError, match="injected"):
        await dev.close()
    assert failed == [failing]
    assert backend.live_allocations == 2, backend.live_allocations  # the failing, the lent
    del lent
    gc.collect()
    assert backend.live_allocations == 1, backend.live_allocations


class _Interrupting:
    """``fn``, whose first call raises a KeyboardInterrupt as it returns (where CPython
    delivers a Ctrl-C after a call: one, the native close then runs that step again);
    each call is noted in ``calls``."""

    def __init__(self, fn: Any, calls: list[str], name: str, interrupts: bool) -> None:
        self.fn, self.calls, self.name, self.interrupts = fn, calls, name, interrupts

    def __call__(self, *args: Any) -> None:
        self.fn(*args)
        self.calls.append(self.name)
        if self.interrupts:
            self.interrupts = False
            raise KeyboardInterrupt


@pytest.mark.parametrize("at", ["queue", "allocator", "backend"])
async def test_an_interrupt_in_a_native_close_step_skips_none_of_the_later_ones(
    anyio_backend: object, device_name: str, monkeypatch: pytest.MonkeyPatch, at: str
) -> None:
    """The native close of a device (as at exit: on the main thread, where a Ctrl-C
    lands) interrupted as one of its steps returns -- a queue's native close, the
    allocator's close, the backend's -- with memory left to a copy it abandoned behind
    a device wait nobody signals: the later steps all run (the backend closed, the
    memory left to the copy freed, the device no longer open nor its state
    unreleased), and the interrupt is raised once they did. Checked failing before:
    the interrupt left the close at that step ('assert 2 == 0' at "backend": the two
    blocks left to the copy stayed allocated; "assert ['queue'] == ['allocator',
    'backend']" at "queue": neither the memory nor the backend was closed)."""
    dev = await am.open_device(device_name)
    backend = dev._backend
    dst, src = [await dev.alloc(256) for _ in range(2)]
    queue = dev.new_queue()
    queue.wait(dev.timeline(), 1)  # never signalled: the close abandons what follows
    queue.copy(dst, src)
    calls: list[str] = []
    monkeypatch.setattr(
        _device,
        "close_native",
        _Interrupting(_device.close_native, calls, "queue", at == "queue"),
    )
    monkeypatch.setattr(
        dev._allocator,
        "close",
        _Interrupting(dev._allocator.close, calls, "allocator", at == "allocator"),
    )
    monkeypatch.setattr(
        backend, "close", _Interrupting(backend.close, calls, "backend", at == "backend")
    )
    with pytest.raises(KeyboardInterrupt):
        dev._close_native(abandon=True)
    assert list(dict.fromkeys(calls))[-2:] == ["allocator", "backend"], calls
    assert backend.live_allocations == 0, backend.live_allocations
    assert dev._state.ran_out
    assert dev not in _device._devices()  # (taken off those noted open)
    assert dev._state not in unreleased_states()


async def test_an_interrupt_in_a_native_close_is_raised_before_an_earlier_error(
    anyio_backend: object, device_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queue's native close that fails, then an interrupt as the backend's close
    returns: the native close raises the interrupt (a Ctrl-C is not turned into
    another error), once the later steps ran. Checked failing before: raised at once,
    the interrupt left the device among those noted open."""
    dev = await am.open_device(device_name)
    backend = dev._backend
    close_native = _device.close_native

    def failing_close_native(queue: Any, abandon: bool) -> None:
        close_native(queue, abandon)
        raise DriverError("injected: the native close failed")

    calls: list[str] = []
    monkeypatch.setattr(_device, "close_native", failing_close_native)
    monkeypatch.setattr(backend, "close", _Interrupting(backend.close, calls, "backend", True))
    with pytest.raises(KeyboardInterrupt):
        dev._close_native(abandon=True)
    assert calls == ["backend", "backend"]  # (interrupted as it returned, then run again)
    assert dev not in _device._devices()


async def test_an_interrupt_in_a_native_free_of_a_close_stops_no_other_free(
    anyio_backend: object, device_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six buffers, the first two the close looks at left to a copy it abandons (as in
    the first test); the native close (as at exit, on the main thread) interrupted as
    the third's native free returns. The interrupt is raised once every other block
    was freed: those after it, and those left to the copy once the device's commands
    ran out. Checked failing before (the interrupt not deferred by the allocator's
    close): 'assert 3 == 0', the three after it stayed allocated."""
    dev = await am.open_device(device_name)
    backend = dev._backend
    buffers, order = await _buffers(dev, 6)
    interrupted = order[2].handle
    free = backend.free
    frees: list[Any] = []

    def interrupted_free(handle: Any) -> None:
        free(handle)
        frees.append(handle)
        if handle is interrupted:
            raise KeyboardInterrupt

    monkeypatch.setattr(backend, "free", interrupted_free)
    queue = dev.new_queue()
    queue.wait(dev.timeline(), 1)  # never signalled: the close abandons what follows
    queue.copy(buffers[0], buffers[1])
    assert [b for b in dev._allocator._live if b in set(order)] == order  # (unchanged)
    with pytest.raises(KeyboardInterrupt):
        dev._close_native(abandon=True)
    assert interrupted in frees
    assert backend.live_allocations == 0, backend.live_allocations
    assert not dev._allocator._live
    assert dev not in _device._devices()

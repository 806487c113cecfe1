"""A queue drops its records of the device waits and signals it passed (``_sync_ops``,
``_clocks``) as its commands are seen done (``Queue._forget_reached``): from an await
of one of its completions, a synchronize, or its device letting go of it idle. What
goes is only what is done -- commands ordered after a wait still come after what it
waited for, byte for byte, whichever thread drops the records meanwhile -- and a
KeyboardInterrupt on the way (trio raises Ctrl-C in whatever code its task runs)
leaves the device's submission lock as it found it."""

from __future__ import annotations

import contextlib
import threading

import anyio
import pytest

import asyncmetal as am
from asyncmetal import _queue
from tests.support.interrupts import interrupted

pytestmark = pytest.mark.anyio

LIMIT = 20  # seconds: every wait here ends within a fraction of this, or it hangs


def _free_elsewhere(lock: object) -> bool:
    """Whether another thread can take ``lock`` (a submission lock) within 5 seconds."""
    got: list[bool] = []

    def take() -> None:
        ok = lock.acquire(timeout=5.0)  # type: ignore[attr-defined]
        got.append(ok)
        if ok:
            lock.release()  # type: ignore[attr-defined]

    thread = threading.Thread(target=take)
    thread.start()
    thread.join()
    return got == [True]


async def _passed_wait(dev: am.Device, queue: am.Queue) -> am.Completion:
    """A device wait of ``queue`` for a timeline signalled, and a command after it,
    both done (the queue's records of the wait not dropped yet)."""
    gate = dev.timeline()
    queue.wait(gate, 1)
    last = queue.marker()
    gate.signal(1)
    with anyio.fail_after(LIMIT):
        await queue.timeline.wait(last.value)  # (no completion of it awaited)
    assert queue._sync_ops
    return last


async def test_an_interrupted_drop_on_an_await_leaves_the_submission_lock_free(
    anyio_backend: object,
) -> None:
    """A KeyboardInterrupt wherever CPython delivers one in the drop an await of a
    completion makes: the awaiting thread no longer holds its device's submission lock
    (another thread takes it: a submission, the reaper), and a later await drops the
    records. Checked failing before: one right after the lock was taken ('c_return
    acquire') left it held by the loop's thread, for good."""
    codes = {am.Queue._forget_reached.__code__}
    at = 0
    while True:
        async with am.open_device("cpu") as dev:
            last = await _passed_wait(dev, dev.queue)
            lock = dev._state.submitting
            with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
                await last
            held = lock._is_owned()  # type: ignore[attr-defined]
            if held:  # (let go, so that the device closes: then the test fails)
                lock.release()
            assert not held, f"interrupted at {raised}"
            assert _free_elsewhere(lock), f"interrupted at {raised}"
            await last
            assert not dev.queue._sync_ops and not dev.queue._clocks
        if not raised:
            break
        at += 1
    assert at >= 3


async def test_an_interrupted_drop_as_a_queue_is_let_go_of_leaves_the_lock_held_once(
    anyio_backend: object,
) -> None:
    """A KeyboardInterrupt wherever CPython delivers one in the drop made as a device
    lets go of an idle queue (new_queue does, on the caller's thread, its submission
    lock held): once that hold ends, the lock is free -- the drop took no hold of its
    own that the interrupt left. Checked failing before: one right after the drop took
    the lock again ('c_return acquire') left it held."""
    codes = {am.Queue._forget_reached.__code__}
    at = 0
    while True:
        async with am.open_device("cpu") as dev:
            queue = dev.new_queue()
            await _passed_wait(dev, queue)
            lock = dev._state.submitting
            with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt), lock:
                _queue.let_go(queue)
            held = lock._is_owned()  # type: ignore[attr-defined]
            if held:  # (let go, so that the device closes: then the test fails)
                lock.release()
            assert not held, f"interrupted at {raised}"
            assert _free_elsewhere(lock), f"interrupted at {raised}"
        if not raised:
            break
        at += 1
    assert at >= 1


async def test_a_drop_on_another_thread_during_a_signals_check_still_refuses_a_cycle(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Queue B (of a second device) waits for a timeline X, then for T, then signals
    U; queue A waits for U and signals T: A's signal would come after itself, and is
    refused. X is signalled first, so B holds a record of a wait it passed; another
    thread dropping it (an await of one of B's completions, B's synchronize: B's own
    device's lock, which A's check does not hold) as A's check looks at B's records
    leaves the check as sure as before -- what went was done. Checked failing before:
    the check gave up (the deque mutated as it was read) and let the signal through, a
    signal that never runs."""
    dev, other = await am.open_device("cpu:0"), await am.open_device("cpu:1")
    try:
        a, b = dev.new_queue(), other.new_queue()
        t, u, x = dev.timeline(), dev.timeline(), other.timeline()
        b.wait(x, 1)
        b.wait(t, 1)
        b.signal(u, 1)
        x.signal(1)
        with anyio.fail_after(LIMIT):
            await b.timeline.wait(1)
        a.wait(u, 1)
        assert b._sync_ops[0][0] == 1  # (passed, not dropped yet)
        left = _queue._After.left
        looked = [0]

        def dropping(self: _queue._After) -> bool:
            looked[0] += 1
            if looked[0] == 2:  # (as B's records are read: what another thread does)
                b._forget_reached()
            return left(self)

        monkeypatch.setattr(_queue._After, "left", dropping)
        with pytest.raises(am.InvalidArgumentError, match="would never run"):
            a.signal(t, 1)
        assert b._sync_ops[0][0] == 2  # (the passed wait's record went meanwhile)
    finally:
        with anyio.fail_after(LIMIT):
            await a.close(discard=True)
            await b.close(discard=True)
            await dev.close()
            await other.close()

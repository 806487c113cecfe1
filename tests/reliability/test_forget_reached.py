"""A queue drops its records of the device waits and signals it passed (``_sync_ops``,
``_clocks``) as its commands are seen done (``Queue._forget_reached``): from an await
of one of its completions, a synchronize, or its device letting go of it idle. What
goes is only what is done -- commands ordered after a wait still come after what it
waited for, byte for byte, whichever thread drops the records meanwhile -- and a
KeyboardInterrupt on the way (trio raises Ctrl-C in whatever code its task runs)
leaves the device's submission lock as it found it."""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _queue
from tests.reliability.test_after_chain import SIZE, STEP, _step
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


@contextlib.asynccontextmanager
async def _a_cycle_to_come() -> AsyncIterator[tuple[am.Queue, am.Queue, am.Timeline]]:
    """Queue B (of a second device) waits for a timeline X, then for T, then signals
    U; queue A waits for U: A's signal of T would come after itself. X is signalled
    first, so B holds a record of a wait it passed (not dropped yet). Yields A, B, T."""
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
        yield a, b, t
    finally:
        with anyio.fail_after(LIMIT):
            await a.close(discard=True)
            await b.close(discard=True)
            await dev.close()
            await other.close()


def _counting_looks(monkeypatch: pytest.MonkeyPatch, drop: am.Queue | None) -> list[int]:
    """Count the waits and signals the signal checks look at (``_After.left``), in the
    list returned; ``drop``: a queue made to drop what it reached at the second look
    -- as B's records are read, what another thread does there."""
    left = _queue._After.left
    looked = [0]

    def counting(self: _queue._After) -> bool:
        looked[0] += 1
        if looked[0] == 2 and drop is not None:
            drop._forget_reached()
        return left(self)

    monkeypatch.setattr(_queue._After, "left", counting)
    return looked


async def test_a_drop_on_another_thread_during_a_signals_check_still_refuses_a_cycle(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's signal of T, which would come after itself (``_a_cycle_to_come``), is
    refused where another thread drops B's passed wait's record (an await of one of
    B's completions, B's synchronize: B's own device's lock, which A's check does not
    hold) as A's check looks at B's records: the check is as sure as before -- what
    went was done. Checked failing before: the check gave up (the deque mutated as it
    was read) and let the signal through, a signal that never runs."""
    async with _a_cycle_to_come() as (a, b, t):
        _counting_looks(monkeypatch, b)
        with pytest.raises(am.InvalidArgumentError, match="would never run"):
            a.signal(t, 1)
        assert b._sync_ops[0][0] == 2  # (the passed wait's record went meanwhile)


async def test_a_signals_check_read_again_after_a_drop_counts_its_looks_once(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a look budget (``SELF_WAIT_STEPS``) just large enough for the check that
    refuses A's signal of T (``_a_cycle_to_come``), a drop of B's passed wait's record
    on another thread as the check reads B's records -- which has it read them again
    -- still leaves the signal refused: the looks of the read given up are not counted
    with those of the read again. Checked failing before: they were, the check ran out
    of looks before it found the cycle, and let the signal through."""
    async with _a_cycle_to_come() as (a, b, t):  # (the looks the check takes, no drop)
        looked = _counting_looks(monkeypatch, None)
        with pytest.raises(am.InvalidArgumentError, match="would never run"):
            a.signal(t, 1)
    assert 2 < looked[0] < _queue.SELF_WAIT_STEPS  # (the drop comes as B's are read)
    monkeypatch.setattr(_queue, "SELF_WAIT_STEPS", looked[0])
    async with _a_cycle_to_come() as (a, b, t):
        _counting_looks(monkeypatch, b)  # (over the first, which goes on counting)
        with pytest.raises(am.InvalidArgumentError, match="would never run"):
            a.signal(t, 1)
        assert b._sync_ops[0][0] == 2  # (the passed wait's record went meanwhile)


def _dropping(queues: list[am.Queue], done: list[am.Completion], seed: int) -> threading.Thread:
    """A thread with a loop of its own that, until ``done`` gets None, awaits the done
    completions of ``done``, synchronizes queues with nothing in flight, and has
    ``queues`` drop what they reached -- each where a submission on the test's thread
    may be under way."""

    async def main() -> None:
        rng = random.Random(seed)
        while done[-1:] != [None]:
            x = rng.random()
            if x < 0.4 and done:
                c = rng.choice(done)
                if c is not None and c.done():
                    await c
            elif x < 0.7:
                for q in queues:
                    q._forget_reached()
            else:
                q = rng.choice(queues)
                if q.timeline.value >= q.submitted:
                    await q.synchronize()
            await anyio.lowlevel.checkpoint()

    backend = "trio" if seed % 2 else "asyncio"
    return threading.Thread(target=anyio.run, args=(main,), kwargs={"backend": backend})


@pytest.mark.parametrize("seed", range(4))
async def test_records_dropped_on_other_threads_keep_the_order_byte_for_byte(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Random turns of queues on one buffer -- steps after it, fills, copies of host
    bytes, and signals and device waits of timelines between the queues, with the first
    queue held until all is submitted or not -- while another thread (a loop of its
    own) awaits their completions, synchronizes them and has them drop what they
    reached, and each after() has them drop it as it reads the buffer's uses (what
    another thread may do there): the bytes are those of the submission order."""
    rng = random.Random(seed)
    async with am.open_device("cpu") as dev:
        step = await dev.compile(STEP, "step")
        buf = await dev.alloc(SIZE)
        expected = np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)
        await buf.write(expected)
        queues = [dev.new_queue() for _ in range(rng.randint(2, 5))] + [dev.queue]
        timelines, signalled = [dev.timeline() for _ in range(3)], [0, 0, 0]
        gate = dev.timeline()
        held = bool(seed % 2)
        if held:
            queues[0].wait(gate, 1)
        read = _queue.uses

        def uses(b: Any) -> Any:
            for q in queues:
                q._forget_reached()
            return read(b)

        monkeypatch.setattr(_queue, "uses", uses)
        done: list[Any] = []
        thread = _dropping(queues, done, seed)
        thread.start()
        try:
            k = 0
            for _ in range(60):
                q = rng.choice(queues)
                kind = rng.random()
                if kind < 0.1:
                    start, end = sorted(rng.sample(range(SIZE + 1), 2))
                    byte = rng.randrange(256)
                    done.append(q.fill(buf, byte, offset=start, size=end - start))
                    expected = expected.copy()
                    expected[start:end] = byte
                elif kind < 0.2:
                    src = np.random.default_rng(rng.randrange(1 << 30))
                    expected = src.integers(0, 256, SIZE, dtype=np.uint8)
                    done.append(q.copy(buf, expected))
                elif kind < 0.35:
                    i = rng.randrange(3)
                    signalled[i] += 1
                    done.append(q.signal(timelines[i], signalled[i]))
                elif kind < 0.5:
                    i = rng.randrange(3)
                    if signalled[i]:
                        done.append(q.wait(timelines[i], rng.randint(1, signalled[i])))
                else:
                    k += 1
                    done.append(q.after(buf).launch(step, buf, vals=(SIZE, k)))
                    expected = _step(expected, k)
                if rng.random() < 0.2:
                    await anyio.lowlevel.checkpoint()
            if held:
                gate.signal(1)
            with anyio.fail_after(LIMIT):
                for c in list(done):
                    await c
                got = await buf.read(np.uint8)
        finally:
            done.append(None)
            thread.join(LIMIT)
        assert not thread.is_alive()
        assert (got == expected).all()
        for q in queues[:-1]:
            await q.close()

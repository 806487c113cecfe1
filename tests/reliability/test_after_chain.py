"""Queues ordered one after another on a buffer (``q.after(buf)``, copies, fills) make
only the device waits that are not already implied: a queue whose last use of the
buffer came after its own wait for an earlier queue's use stands for that use too, and
a queue that waited for a use before need not wait for it again. The order of the
work is kept, byte for byte, also where a wait on the way fails: what came after it
fails rather than run out of order."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _queue

pytestmark = pytest.mark.anyio

LIMIT = 20  # seconds: every wait here ends within a fraction of this, or it hangs
SIZE = 256

# An order-sensitive step: x*31 + k + i, wrapping at a byte. Two steps with different
# ``k`` give different bytes in either order, so a step run out of order shows.
STEP = r"""
void step(unsigned char* x, int n, int k) {
    for (int i = 0; i < n; i++) x[i] = (unsigned char)(x[i] * 31 + k + i);
}
"""


def _step(x: np.ndarray[Any, Any], k: int) -> np.ndarray[Any, Any]:
    """The host's model of ``step``."""
    return ((x.astype(np.int64) * 31 + k + np.arange(x.size)) % 256).astype(np.uint8)


def _counting_waits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, int]]:
    """Each device wait submitted from now on, as (queue, the value it waits for)."""
    made: list[tuple[Any, int]] = []
    submitted = _queue.queue_wait_submitted

    def noted(timeline: Any, queue: Any, at: int, target: int, ordering: bool) -> None:
        made.append((queue, target))
        submitted(timeline, queue, at, target, ordering)

    monkeypatch.setattr(_queue, "queue_wait_submitted", noted)
    return made


async def _stepped(dev: am.Device) -> tuple[am.Buffer, np.ndarray[Any, Any], am.Program]:
    """A buffer of ``dev`` holding 0, 1, 2, ... (mod 256), those bytes, and STEP."""
    buf = await dev.alloc(SIZE)
    start = np.arange(SIZE, dtype=np.uint8)
    await buf.write(start)
    return buf, start, await dev.compile(STEP, "step")


async def _chain(
    dev: am.Device, queues: list[am.Queue], buf: am.Buffer, rounds: int, first_k: int = 0
) -> list[am.Completion]:
    """``rounds`` rounds of each queue in turn stepping ``buf`` after the others."""
    step = await dev.compile(STEP, "step")
    done = []
    for r in range(rounds):
        for i, q in enumerate(queues):
            done.append(q.after(buf).launch(step, buf, vals=(SIZE, first_k + r * len(queues) + i)))
    return done


async def test_a_chain_of_queues_makes_one_device_wait_per_after(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """N queues take turns on one buffer, their commands held (the first queue waits for
    a timeline the host signals at the end): each after() waits for the queue before
    it only, whose last use came after its own wait -- one wait a turn, not one per
    queue that used the buffer (N - 1 a turn)."""
    n, rounds = 8, 3
    async with am.open_device("cpu") as dev:
        buf, start, step = await _stepped(dev)
        queues = [dev.new_queue() for _ in range(n)]
        gate = dev.timeline()
        queues[0].wait(gate, 1)  # (not counted: made before the count starts)
        made = _counting_waits(monkeypatch)
        done = []
        for r in range(rounds):
            for i, q in enumerate(queues):
                before = len(made)
                done.append(q.after(buf).launch(step, buf, vals=(SIZE, r * n + i)))
                waited = made[before:]
                if r or i:  # (the very first has nothing of another queue to wait for)
                    previous = queues[i - 1]
                    assert waited == [(q, previous.submitted)], (r, i, len(waited))
        assert len(made) == n * rounds - 1
        # Waiting again for what it waited for already makes no wait; nor does a second
        # buffer used by the same queue.
        other = await dev.alloc(SIZE)
        last = queues[-1]
        last.launch(step, other, vals=(SIZE, 0))
        before = len(made)
        queues[0].after(buf, other)
        queues[0].after(buf)
        queues[0].after(other, buf)
        assert len(made) == before + 1
        gate.signal(1)
        with anyio.fail_after(LIMIT):
            for c in done:
                await c
        expected = start
        for k in range(n * rounds):
            expected = _step(expected, k)
        assert (await buf.read(np.uint8) == expected).all()
        for q in queues:
            await q.close()


@pytest.mark.parametrize("held", [True, False])
async def test_many_queues_taking_turns_keep_the_order_byte_for_byte(
    anyio_backend: object, held: bool
) -> None:
    """Sixteen queues step one buffer in turn, with fills and copies between (which
    order themselves the same way): the bytes are those of the steps run in submission
    order -- with the first queue held until all is submitted (every command pending
    as the next is ordered after it), and not held (some done by then)."""
    n, rounds = 16, 4
    rng = np.random.default_rng(7)
    async with am.open_device("cpu") as dev:
        step = await dev.compile(STEP, "step")
        buf = await dev.alloc(SIZE)
        expected = rng.integers(0, 256, SIZE, dtype=np.uint8)
        await buf.write(expected)
        queues = [dev.new_queue() for _ in range(n)]
        gate = dev.timeline()
        if held:
            queues[0].wait(gate, 1)
        done = []
        k = 0
        for _ in range(rounds):
            for q in queues:
                kind = rng.integers(0, 6)
                if kind == 0:  # a fill of part of it
                    offset, size = sorted(rng.integers(0, SIZE + 1, 2).tolist())
                    if size > offset:
                        byte = int(rng.integers(0, 256))
                        done.append(q.fill(buf, byte, offset=offset, size=size - offset))
                        expected = expected.copy()
                        expected[offset:size] = byte
                elif kind == 1:  # a copy of host bytes into it
                    src = rng.integers(0, 256, SIZE, dtype=np.uint8)
                    done.append(q.copy(buf, src))
                    expected = src
                else:
                    k += 1
                    done.append(q.after(buf).launch(step, buf, vals=(SIZE, k)))
                    expected = _step(expected, k)
        gate.signal(1)
        with anyio.fail_after(LIMIT):
            for c in done:
                await c
        assert (await buf.read(np.uint8) == expected).all()
        for q in queues:
            await q.close()


async def test_a_failed_wait_in_a_chain_fails_what_comes_after_it(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round of queues taking turns runs; a queue ordered after it then waits for a
    timeline nobody signals and steps the buffer, and the queues take another round,
    each waiting only for the one before it (the first for that queue). That queue is
    closed with discard=True: its wait and step are dropped, so every command of the
    second round -- each ordered after the dropped step through the others' waits,
    not its own -- fails, none runs: the buffer holds the first round's bytes."""
    n = 6
    async with am.open_device("cpu") as dev:
        buf, start, step = await _stepped(dev)
        queues = [dev.new_queue() for _ in range(n)]
        gate, never = dev.timeline(), dev.timeline()
        queues[0].wait(gate, 1)
        first = await _chain(dev, queues, buf, 1)
        failing = dev.new_queue()
        failing.after(buf).wait(never, 1)
        dropped = failing.launch(step, buf, vals=(SIZE, 99))
        made = _counting_waits(monkeypatch)
        second = await _chain(dev, queues, buf, 1, first_k=n)
        assert made == [(queues[0], failing.submitted)] + [
            (queues[i], queues[i - 1].submitted) for i in range(1, n)
        ]
        gate.signal(1)
        with anyio.fail_after(LIMIT):
            for c in first:
                await c
            await failing.close(discard=True)
            with pytest.raises(am.ClosedResourceError):
                await dropped
            for c in second:
                with pytest.raises(am.AsyncMetalError):
                    await c
        expected = start
        for k in range(n):
            expected = _step(expected, k)
        assert (await buf.read(np.uint8) == expected).all()


async def test_a_use_left_to_a_failed_queues_wait_still_comes_first(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Queue A steps the buffer, held. Queue B, behind a wait for a timeline nobody
    signals, waits for A's step and steps the buffer; queue C waits for B's step only
    (B's wait stands for A's) and steps it. B is closed with discard=True, so its wait
    for A never completes and its step never runs: C's step fails and never runs,
    neither before A's step nor after it, which runs once A is let go -- the buffer
    holds A's step alone, and stays in use (freed after it) until then."""
    async with am.open_device("cpu") as dev:
        buf, start, step = await _stepped(dev)
        a, b, c = dev.new_queue(), dev.new_queue(), dev.new_queue()
        gate, never = dev.timeline(), dev.timeline()
        a.wait(gate, 1)
        by_a = a.launch(step, buf, vals=(SIZE, 1))
        b.wait(never, 1)
        by_b = b.after(buf).launch(step, buf, vals=(SIZE, 2))
        made = _counting_waits(monkeypatch)
        by_c = c.after(buf).launch(step, buf, vals=(SIZE, 3))
        assert made == [(c, by_b.value)]  # (not for A: B's wait came before B's step)
        with anyio.fail_after(LIMIT):
            await b.close(discard=True)
            with pytest.raises(am.ClosedResourceError):
                await by_b
            assert not by_a.done()
            # Its record of uses keeps A's: a free still waits for it.
            assert dict(_queue.uses(buf))[a] == by_a.value
            assert buf.busy()
            gate.signal(1)
            await by_a
            with pytest.raises(am.AsyncMetalError):
                await by_c
        assert (await buf.read(np.uint8) == _step(start, 1)).all()
        await a.close()


async def _collected(ref: weakref.ref[Any]) -> bool:
    """Whether what ``ref`` refers to is collected within 5 seconds (a queue dropped is
    let go of by its device's reaper, then released, within a second or so; a device
    closed, let go of by its threads, sooner)."""
    with anyio.move_on_after(5.0):
        while ref() is not None:
            gc.collect()
            await anyio.sleep(0.02)
    return ref() is None


@pytest.mark.parametrize("seen", ["await", "synchronize", "device synchronize", "let go"])
async def test_a_queue_left_idle_keeps_no_timeline_of_a_queue_it_waited_for(
    anyio_backend: object, seen: str
) -> None:
    """A burst of turns of two queues on a buffer, the first held until all is
    submitted (each wait of the second one's, and what it stands for, pending as the
    next is made), then the second queue's commands seen done (``seen``: an await of its
    last one, its synchronize, its device's -- the default queue, which its device never
    lets go of -- or, for a queue of new_queue(), its device letting go of it idle) and
    the other queue dropped: the second queue, left idle, no longer holds the dropped
    queue's timeline -- its records of the waits it passed went as they were seen
    done, not at its next wait (which an idle queue may never make)."""
    async with am.open_device("cpu") as dev:
        buf, _, step = await _stepped(dev)
        a, b = dev.new_queue(), dev.new_queue() if seen == "let go" else dev.queue
        gate = dev.timeline()
        a.wait(gate, 1)
        for i in range(100):
            a.after(buf).launch(step, buf, vals=(SIZE, 2 * i))
            last = b.after(buf).launch(step, buf, vals=(SIZE, 2 * i + 1))
        gate.signal(1)
        with anyio.fail_after(LIMIT):
            await a.synchronize()
            if seen == "await":
                await last
            elif seen == "synchronize":
                await b.synchronize()
            elif seen == "device synchronize":
                await dev.synchronize()
            else:
                await b.timeline.wait(last.value)  # (no completion of b's awaited)
        timeline = weakref.ref(a.timeline)
        del a
        assert await _collected(timeline), "the dropped queue's timeline is kept alive"
        if b is not dev.queue:
            await b.close()


async def test_a_queue_keeps_no_closed_device_alive_through_a_wait_it_passed(
    anyio_backend: object,
) -> None:
    """A queue's device waits for a timeline of another device, run and awaited, then
    that device closed and dropped: the queue keeps neither that device nor its
    timeline alive (the default queue, which its device never lets go of idle)."""
    async with am.open_device("cpu") as dev:
        q = dev.queue
        other = await am.open_device("cpu")
        timeline = other.timeline()
        for value in range(1, 50):
            q.wait(timeline, value)
        timeline.signal(49)
        with anyio.fail_after(LIMIT):
            await q.marker()
        await other.close()
        refs = weakref.ref(other), weakref.ref(timeline)
        del other, timeline
        assert [await _collected(r) for r in refs] == [True, True]


@pytest.mark.metal
async def test_a_metal_wait_a_failure_releases_stands_for_nothing(anyio_backend: object) -> None:
    """On Metal a device wait released by a failure still runs what is behind it (its
    commands report the failure): it orders nothing after what the failed queue's
    own waits stood for. Queue Z steps the buffer behind a timeline nobody has
    signalled yet; A waits for Z's step and steps it; B waits for the buffer's uses
    and steps it. A is closed with discard=True: B's step fails -- and, ran or not,
    must not come before Z's, which it was ordered after (a wait of B's own for Z's
    use): Z's step, which succeeds, reads the buffer as it was before B's."""
    if "metal" not in am.devices():
        pytest.skip("no Metal here, not even the simulation (tests/support/fakes/metal_sim)")
    from tests.support.kernels import MSL_KERNELS

    async with am.open_device("metal") as dev:
        buf = await dev.alloc(16)
        await buf.write(np.array([5, 0, 0, 0], dtype=np.int32))
        step = await dev.compile(MSL_KERNELS, "step")  # cells[0] = cells[0] * 32 + val
        z, a, b = dev.new_queue(), dev.new_queue(), dev.new_queue()
        gate = dev.timeline()
        z.wait(gate, 1)
        by_z = z.launch(step, buf, vals=(0, 0, 1))
        by_a = a.after(buf).launch(step, buf, vals=(0, 0, 2))
        by_b = b.after(buf).launch(step, buf, vals=(0, 0, 3))
        with anyio.fail_after(LIMIT):
            await a.close(discard=True)
            with pytest.raises(am.ClosedResourceError):
                await by_a
            await anyio.sleep(0.2)  # (time for B's step to run, were it let through)
            gate.signal(1)
            await by_z
            with pytest.raises(am.AsyncMetalError):
                await by_b
            # Z's step, then B's (which ran: Metal's GPU runs it, the failure is
            # reported) -- not B's, then Z's (5217).
            assert int((await buf.read(np.int32))[0]) == (5 * 32 + 1) * 32 + 3
        await z.close()
        await b.close()

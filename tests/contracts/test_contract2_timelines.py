"""Contract 2: one timeline per queue, values from 1; device-side waits before the signal."""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import itertools
import sys
import threading
import time

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import asyncmetal as am
import asyncmetal._queue
from asyncmetal import _native, _timeline
from asyncmetal._timeline import wait_value
from tests.support.interrupts import interrupted
from tests.support.queues import (
    check_buffers_usable,
    fail_default_queue_for_good,
    fail_for_good,
    held_queue,
)

pytestmark = pytest.mark.anyio


async def test_each_queue_counts_from_one(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    q1, q2 = device.new_queue(), device.new_queue()
    assert q1.timeline is not q2.timeline
    a = [q1.launch(kernels["empty"]) for _ in range(3)]
    b = [q2.launch(kernels["empty"]) for _ in range(2)]
    assert [c.value for c in a] == [1, 2, 3]
    assert [c.value for c in b] == [1, 2]
    assert all(c.timeline is q1.timeline for c in a)
    await a[-1]
    await b[-1]
    assert q1.timeline.value == 3 and q2.timeline.value == 2
    assert all(c.done() for c in a + b)


async def test_completion_follows_the_value_reached(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    q, tl = held_queue(device)
    later = [q.launch(kernels["empty"]) for _ in range(4)]
    await anyio.sleep(0.02)
    assert not any(c.done() for c in later)
    tl.signal(1)
    await later[-1]  # awaiting the last implies all earlier ones are done
    assert all(c.done() for c in later)


@pytest.mark.parametrize("reached", ["before", "after"])
async def test_a_reached_wait_completes_while_a_later_wait_of_its_queue_waits(
    device: am.Device, kernels: dict[str, am.Program], reached: str
) -> None:
    """A device wait's completion is awaitable on its own: once its value is reached
    (before the wait is submitted, or after) it completes, while a later wait on the
    same queue, for a value nobody signals yet, holds only what follows it. Checked
    failing on Metal before: the queue's own thread marked the first wait's value
    only with the command after the second wait, so its await waited for that."""
    tl, never = device.timeline(), device.timeline()
    q = device.new_queue()
    if reached == "before":
        tl.signal(1)
    first = q.wait(tl, 1)
    second = q.wait(never, 1)
    behind = q.launch(kernels["empty"])
    if reached == "after":
        tl.signal(1)
    try:
        with anyio.fail_after(20):
            await first
        assert q.timeline.value == first.value
        assert not second.done() and not behind.done()
    finally:
        never.signal(1)  # (the device's close then has nothing held)
    with anyio.fail_after(20):
        await behind


async def test_device_wait_enqueued_before_host_signal(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    tl = device.timeline()
    buf = await device.alloc(4)
    q = device.new_queue()
    q.wait(tl, 7)
    done = q.launch(kernels["fill"], buf, vals=(9, 1))
    await anyio.sleep(0.02)
    assert not done.done()
    tl.signal(3)  # not enough
    await anyio.sleep(0.02)
    assert not done.done()
    tl.signal(8)  # past 7 is enough
    await done
    assert (await buf.read(np.int32))[0] == 9


async def test_signal_from_another_queue_orders_work(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    tl = device.timeline()
    cells = await device.alloc(8)
    await cells.write(np.array([1, 0], np.int32))
    consumer, producer = device.new_queue(), device.new_queue()
    consumer.wait(tl, 1)  # submitted before the producer even starts
    done = consumer.launch(kernels["step"], cells, vals=(1, 0, 0))  # cells[1] = cells[0]
    tl_blocker = device.timeline()
    producer.wait(tl_blocker, 1)
    producer.launch(kernels["fill"], cells, vals=(5, 1))  # cells[0] = 5
    producer.signal(tl, 1)
    await anyio.sleep(0.02)
    assert not done.done()
    tl_blocker.signal(1)
    await done
    assert (await cells.read(np.int32)).tolist() == [5, 5]


async def test_signal_from_another_device(anyio_backend: object) -> None:
    src = "void put(int* x, int v) { x[0] = v; }"
    async with am.open_device("cpu:0") as d0, am.open_device("cpu:1") as d1:
        p0, p1 = await d0.compile(src, "put"), await d1.compile(src, "put")
        tl = d0.timeline()
        b1 = await d1.alloc(4)
        d1.queue.wait(tl, 2)  # a cpu:1 queue waits on a cpu:0 timeline
        done = d1.queue.launch(p1, b1, vals=(11,))
        b0 = await d0.alloc(4)
        d0.queue.launch(p0, b0, vals=(1,))
        d0.queue.signal(tl, 2)
        await done
        assert (await b1.read(np.int32))[0] == 11


async def test_a_signal_shows_done_once_a_command_that_waited_for_it_is_awaited(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    # A queue raises the timeline it signals before its own: the waiting queue's next
    # command could finish, and be awaited, while the signal still showed pending.
    tl = device.timeline()
    async with device.new_queue() as producer, device.new_queue() as consumer:
        pending = 0
        for value in range(1, 201):
            consumer.wait(tl, value)
            after = consumer.launch(kernels["empty"])
            signal = producer.signal(tl, value)
            await after
            pending += not signal.done()
        assert pending == 0, f"{pending} of 200 signals pending once what waited for them ran"


async def test_a_signal_is_not_done_while_its_queue_has_not_passed_it_though_its_timeline_failed(
    device: am.Device,
) -> None:
    """A timeline settles at 2**64 - 1 once a signal of it fails (another queue's, whose
    device wait failed): a signal of it still held behind its own queue's wait is not
    done until that queue passes it, and then fails. Checked failing before: done()
    read the settled value as the signal's value reached, while its queue had not
    started it (its await then waited for the queue all the same)."""
    held, gate = held_queue(device)
    tl, failing = device.timeline(), device.new_queue()
    signals: list[am.Completion] = []

    def behind() -> None:
        failing.signal(tl, 3)
        signals.append(held.signal(tl, 5))

    await fail_for_good(device, failing, behind)
    with anyio.move_on_after(20):
        while tl.value != 2**64 - 1:
            await anyio.sleep(0.005)
    assert tl.value == 2**64 - 1
    assert not signals[0].done()
    gate.signal(1)
    with anyio.fail_after(20), pytest.raises(am.ClosedResourceError):
        await signals[0]
    assert signals[0].done()


async def test_a_default_queue_failing_for_good_leaves_the_buffers_usable(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """Another device closes while this device's default queue waits (on the device, or
    held on the host) for a command of that device that never runs, a copy's: the wait
    fails, and with it every
    later command of the default queue, for good (``device.queue`` stays so: what a
    program orders there must not run out of order). The device's own work for its
    buffers -- ``read``, ``write``, ``copy()``, a zeroed ``alloc`` -- runs on a queue
    the device makes in its stead: the device stays usable. Checked failing before:
    each raised ClosedResourceError ("it follows a device-side wait ...")."""
    before = await fail_default_queue_for_good(device)
    with anyio.fail_after(20), pytest.raises(am.ClosedResourceError, match="device-side wait"):
        await device.queue.launch(kernels["empty"])
    await check_buffers_usable(device, before)
    with anyio.fail_after(20), pytest.raises(am.ClosedResourceError, match="device-side wait"):
        await device.queue.launch(kernels["empty"])  # (still the default queue's error)


async def test_a_failed_queues_own_timeline_settles_so_no_wait_on_it_is_left_waiting(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """A queue whose device wait ended on a value never produced fails from that wait
    on, and once it has passed every command it was given its own timeline settles at
    2**64 - 1 (README, "Errors"), as a cuda stream's does: a host wait on it for more
    than it was given -- one parked before the failure, and one made after -- ends at
    once with the failure, rather than wait for a command nobody submits. A command
    submitted later fails at once. Checked failing on cpu, and on the simulated Metal,
    before: the timeline stayed at the failed command's value, and both waits were left
    waiting. (The simulated
    cuda driver's streams do so: tests/backends/cuda/test_simulated_launch_paths.py.)"""
    q = device.new_queue()
    beyond = 1000  # (more than fail_for_good submits to q)
    parked_error: list[BaseException] = []
    parked = anyio.Event()
    ended = anyio.Event()

    async def park() -> None:
        parked.set()
        try:
            await q.timeline.wait(beyond)
        except am.ClosedResourceError as exc:
            parked_error.append(exc)
        ended.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(park)
        await parked.wait()
        await fail_for_good(device, q)
        with anyio.fail_after(5):
            await ended.wait()
    assert q.submitted < beyond
    assert parked_error, "the parked wait returned: the value was never produced"
    assert "settled without it running" in str(parked_error[0])
    assert q.timeline.value == 2**64 - 1
    with anyio.fail_after(5), pytest.raises(am.ClosedResourceError, match="settled without"):
        await q.timeline.wait(q.submitted + 1)
    with anyio.fail_after(5), pytest.raises(am.ClosedResourceError, match="device-side wait"):
        await q.launch(kernels["empty"])
    assert q.timeline.value == 2**64 - 1


async def test_the_devices_synchronize_reports_a_failure_once(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """Once the default queue fails for good (it cannot be closed), ``synchronize()``
    raises its failure once, and then returns: the device is usable again. A command
    submitted to it later fails, and that failure is reported, once, in turn. Checked
    failing before: every later synchronize() raised the old failure."""
    before = await fail_default_queue_for_good(device)
    with anyio.fail_after(20):
        with pytest.raises(am.ClosedResourceError, match="device-side wait"):
            await device.synchronize()
        await device.synchronize()
        await check_buffers_usable(device, before)
        await device.synchronize()
        device.queue.launch(kernels["empty"])  # (fails: it follows the failed wait)
        with pytest.raises(am.ClosedResourceError, match="device-side wait"):
            await device.synchronize()
        await device.synchronize()


async def test_synchronize_calls_made_at_once_each_raise_the_failure(
    device: am.Device,
) -> None:
    """Two ``synchronize()`` calls made at once, while the default queue's failure has
    not been raised yet, each raise it (neither caller is told all went well); a call
    made after them returns. Checked failing before: the second call to resume
    returned as if nothing had failed."""
    await fail_default_queue_for_good(device)
    outcomes: list[BaseException | None] = []

    async def synchronize() -> None:
        try:
            await device.synchronize()
        except am.ClosedResourceError as exc:
            outcomes.append(exc)
        else:
            outcomes.append(None)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(synchronize)
            tg.start_soon(synchronize)
        assert len(outcomes) == 2 and all(o is not None for o in outcomes), outcomes
        await device.synchronize()


async def test_a_queue_used_in_the_default_queues_stead_failing_for_good_is_replaced(
    device: am.Device,
) -> None:
    """The queue the device's buffers' work runs on in its failed default queue's stead
    fails for good in turn: the device makes another, and releases the one replaced
    (its failure was its buffer operations' own: ``synchronize()`` reports only the
    default queue's, once); waits on its timeline past its last command are refused
    saying it was replaced. Checked failing before: the queue replaced stayed among the
    device's queues, never released, and every synchronize() raised; the refusals said
    it was closed."""
    before = await fail_default_queue_for_good(device)
    stand_in = device._own_queue()
    await fail_for_good(device, stand_in)
    await check_buffers_usable(device, before)
    assert device._own_queue() is not stand_in
    replaced = r"queue was replaced \(every later command of it failed\) after its command"
    with pytest.raises(am.ClosedResourceError, match=replaced):
        device.new_queue().wait(stand_in.timeline, stand_in.submitted + 1)
    with anyio.fail_after(20):
        with pytest.raises(am.ClosedResourceError, match=replaced):
            await stand_in.timeline.wait(stand_in.submitted + 1)
        with pytest.raises(am.ClosedResourceError, match="device-side wait"):
            await device.synchronize()  # (the default queue's)
        await device.synchronize()
        while stand_in in device._queues:  # released by the device's reaper, once settled
            await anyio.sleep(0.01)
    assert stand_in.closed


async def test_host_signal_from_a_plain_thread_wakes_the_loop(device: am.Device) -> None:
    tl = device.timeline()
    thread = threading.Timer(0.02, tl.signal, args=(4,))
    thread.start()
    with anyio.fail_after(5):
        await tl.wait(4)
    thread.join()
    assert tl.value == 4


async def test_wait_on_reached_value_is_still_a_checkpoint(device: am.Device) -> None:
    tl = device.timeline()
    tl.signal(1)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await tl.wait(1)
        pytest.fail("a reached wait must still be a checkpoint")
    assert scope.cancelled_caught


async def test_timeline_values_are_64_bit(device: am.Device) -> None:
    tl = device.timeline()
    big = (1 << 64) - 1
    device.queue.signal(tl, 1 << 40)
    await tl.wait(1 << 40)
    tl.signal(big)
    await tl.wait(big)
    assert tl.value == big


async def test_signals_take_effect_in_submission_order(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    tl, gate = device.timeline(), device.timeline()
    q1, q2 = device.new_queue(), device.new_queue()
    q1.wait(gate, 1)
    q1.signal(tl, 1)  # held back behind the gate
    q2.signal(tl, 2)  # must not take effect before q1's 1: the value never goes backwards
    await anyio.sleep(0.02)
    assert tl.value == 0
    with pytest.raises(am.InvalidArgumentError, match="has not run yet"):
        tl.signal(3)  # the host may not jump ahead of pending device signals
    gate.signal(1)
    await tl.wait(2)
    assert tl.value == 2
    tl.signal(3)


async def test_host_signals_racing_on_two_threads_keep_the_highest(
    device: am.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two threads signal one timeline at once: 3 is checked, then 5 (the other thread's)
    is checked and made, then 3 is made. A later signal below 5 is refused (before, the
    3 made last was taken as the highest, and 4 passed as if the timeline were below
    it: a signal that did nothing, unrefused). The 3 is a numpy integer: such a value
    is checked in full, where the check calls out (a plain int's few steps do not)."""
    tl = device.timeline()
    pending = tl._signal_pending
    interleaved: list[int] = []

    def the_other_thread_signals_now() -> bool:  # between the check and the record
        if not interleaved:
            interleaved.append(5)
            tl.signal(5)
        return pending()

    monkeypatch.setattr(tl, "_signal_pending", the_other_thread_signals_now)
    tl.signal(np.int64(3))  # type: ignore[arg-type]
    monkeypatch.undo()
    assert interleaved == [5]
    assert tl.value == 5
    with pytest.raises(am.InvalidArgumentError, match="up to 5"):
        tl.signal(4)
    tl.signal(6)
    assert tl.value == 6


@pytest.mark.parametrize("other", ["queue", "queue of another device", "host"])
async def test_a_signal_checked_while_another_threads_queue_signal_is_submitted_sees_it(
    device: am.Device, monkeypatch: pytest.MonkeyPatch, other: str
) -> None:
    """Thread A submits a queue signal of a timeline to 5 (held behind a gate); thread B
    signals the same timeline -- to 5 from another queue, or to 6 from the host -- while
    A's signal is between its check and its record. B must see A's signal: a second 5
    does not increase the timeline, and the host may not signal past a pending queue
    signal. Checked failing without: B's check ran before A's record, so both 5s were
    accepted (and on two threads at once, about one race in five, a 6 submitted after
    a 5 took effect before it), and the host raised the timeline past A's pending 5."""
    tl, gate = device.timeline(), device.timeline()
    q = device.new_queue()
    q.wait(gate, 1)
    async with contextlib.AsyncExitStack() as stack:
        if other == "queue of another device":
            other_device = await stack.enter_async_context(am.open_device(device.name))
        else:
            other_device = device
        other_queue = other_device.new_queue()
        outcome: list[object] = []

        def signal_on_thread_b() -> None:
            try:
                if other == "host":
                    tl.signal(6)
                else:
                    other_queue.signal(tl, 5)
                outcome.append("accepted")
            except am.InvalidArgumentError as refused:
                outcome.append(refused)

        thread_b = threading.Thread(target=signal_on_thread_b)
        record = asyncmetal._queue.queue_signal_submitted

        def b_signals_first(*args: object) -> None:  # (before A records its signal)
            if not thread_b.is_alive() and not outcome:
                thread_b.start()
                thread_b.join(0.5)  # (B's check comes now, or waits for this signal)
            record(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(asyncmetal._queue, "queue_signal_submitted", b_signals_first)
        done = q.signal(tl, 5)
        monkeypatch.undo()
        thread_b.join()
        assert len(outcome) == 1 and isinstance(outcome[0], am.InvalidArgumentError), outcome
        expected = "has not run yet" if other == "host" else "does not increase"
        assert expected in str(outcome[0])
        assert tl.value == 0
        gate.signal(1)
        await done
        assert tl.value == 5


async def test_the_host_may_signal_once_a_queues_signal_is_seen(device: am.Device) -> None:
    """A queue raises a timeline before it records the signalling command as done: a
    task that saw the value (as told: await timeline.wait(target)) may signal the
    timeline from the host at once, though the queue has not recorded it yet. (Once a
    race under load; here the queue is held behind a gate while the value is seen.)
    Checked: refused with "has not run yet" before the timeline's own value counted."""
    tl, gate = device.timeline(), device.timeline()
    q = device.new_queue()
    q.wait(gate, 1)
    q.signal(tl, 5)  # held behind the gate: the queue has not done it
    tl.native.signal(5)  # the value the signal writes, seen before the queue records it
    await tl.wait(5)
    tl.signal(6)
    gate.signal(1)
    await q.marker()
    assert tl.value == 6


@pytest.mark.parametrize("due", ["soon", "none", "passed"])
async def test_a_wait_due_soon_is_checked_for_rather_than_parked(
    device: am.Device, due: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wait with a near due time (a cuda copy's completion carries one) keeps its task
    checking until then instead of parking; without one it parks after one yield, and
    so does one whose due time has passed (by SPIN_NS). (Scaled to seconds where the
    machine's load could matter: DUE_NS is patched; the value comes after three turns
    of the loop, or once the waiter has parked.)"""
    from asyncmetal import _timeline

    monkeypatch.setattr(_timeline, "DUE_NS", 20_000_000_000)
    tl = device.timeline()
    now = time.perf_counter_ns()
    due_ns = {"soon": now + 10_000_000_000, "none": 0, "passed": now + 1_000}[due]

    async def release() -> None:
        if due == "passed":  # once the waiter has checked until then, and parked
            while am.loop_statistics().waiting < 1:
                await anyio.lowlevel.checkpoint()
        else:
            for _ in range(3):
                await anyio.lowlevel.checkpoint()
        tl.signal(1)

    before = am.loop_statistics()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(release)
            await wait_value(tl, 1, due_ns)
    parked = am.loop_statistics().resolved - before.resolved
    assert parked == (0 if due == "soon" else 1)


def test_a_device_word_follows_host_signals_not_confirmations() -> None:
    """The word a device waits on is raised by host signals (never lowered); a
    completion thread's confirmation (poke) raises the host value only."""
    lib = _native.runtime()
    t = lib.am_timeline_new()
    word = ctypes.c_uint64(0)
    lib.am_timeline_set_word(t, ctypes.addressof(word))
    try:
        lib.am_timeline_signal(t, 5)
        assert (word.value, lib.am_timeline_value(t)) == (5, 5)
        lib.am_timeline_poke(t, 9)
        assert (word.value, lib.am_timeline_value(t)) == (5, 9)
        word.value = 20  # a device wrote ahead of the host
        lib.am_timeline_signal(t, 12)
        assert (word.value, lib.am_timeline_value(t)) == (20, 12)
    finally:
        lib.am_timeline_free(t)


def test_launches_from_two_threads_on_one_queue_run_in_value_order() -> None:
    """Two threads launch on one queue, one through the native launch path only, the
    other alternating it with the Python path (a ``range`` size is the Python path's);
    each kernel appends its tag to a log. The queue runs them in the order of their
    values -- what each Completion's value says -- whatever the threads' interleaving.
    Checked: before, the native path numbered a command and ran Python code before
    handing it over (and took no submission lock), so another thread's later value ran
    first (2 to 51 of 8000 each run with a tiny switch interval), and a completion could
    be awaited before its kernel ran."""
    src = "void k(int* log, int tag) { int n = log[0]; log[n + 1] = tag; log[0] = n + 1; }"
    n = 3000
    values: dict[int, int] = {}

    async def main() -> list[int]:
        async with am.open_device("cpu:31") as dev:
            k = await dev.compile(src, "k")
            log = await dev.alloc(4 * (2 * n + 1))
            await log.write(np.zeros(2 * n + 1, np.int32))
            queue = dev.new_queue()

            def launch_all(thread: int) -> None:
                for i in range(n):
                    tag = thread * n + i + 1
                    size: object = range(1, 2) if thread and i % 2 else 1
                    values[tag] = queue.launch(k, log, vals=(tag,), global_size=size).value

            threads = [threading.Thread(target=launch_all, args=(t,)) for t in range(2)]
            for thread in threads:
                thread.start()
            while any(thread.is_alive() for thread in threads):
                await anyio.sleep(0.01)
            await queue.synchronize()
            ran = (await log.read(np.int32)).tolist()
            return ran[1 : ran[0] + 1]

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        ran = anyio.run(main)
    finally:
        sys.setswitchinterval(switch)
    assert len(ran) == 2 * n
    order = [values[tag] for tag in ran]
    inverted = sum(b < a for a, b in itertools.pairwise(order))
    assert inverted == 0, f"{inverted} commands ran before a command of a lower value"


async def test_a_keyboard_interrupt_in_a_host_signal_leaves_it_made_or_not_made(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """A KeyboardInterrupt wherever CPython delivers one in ``Timeline.signal`` and the
    backend's native signal (trio raises Ctrl-C in whatever Python code its task runs)
    leaves the signal whole or not made: a host wait and a queue's device wait for the
    value end once it is signalled -- where it was not made, a signal of it again is
    not refused. Checked failing without: interrupted between the count and the native
    signal, the value counted as signalled (a signal of it refused as not increasing)
    and never came; on Metal, interrupted between the event and its mirror, the GPU's
    wait ran and host waits waited for good."""
    native_type = type(device.timeline().native)
    codes = {am.Timeline.signal.__code__}
    codes |= {f.__code__ for f in vars(native_type).values() if inspect.isfunction(f)}
    at = 0
    while True:
        tl, queue = device.timeline(), device.new_queue()
        waited = queue.wait(tl, 5)
        behind = queue.launch(kernels["empty"])
        with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
            tl.signal(5)
        if tl.value < 5:
            tl.signal(5)  # (not made: made now)
        with anyio.fail_after(10):
            await tl.wait(5)
            await waited
            await behind
        assert tl.value == 5, raised
        await queue.close()
        if not raised:
            break
        at += 1
    assert at >= 3


async def test_a_keyboard_interrupt_as_a_wait_parks_leaves_no_wake_up_behind(
    device: am.Device,
) -> None:
    """A KeyboardInterrupt wherever CPython delivers one as ``Timeline.wait`` parks its
    task (trio raises Ctrl-C in whatever Python code its task runs) leaves no wake-up
    for that task behind: once the value comes, the task -- waiting on something else
    by then -- is not woken, and another task's wait for the value is. Checked failing
    without: on trio, interrupted after its entry went into the watch, the wake-up
    rescheduled the task in its next wait ("Should never have been rescheduled!")."""
    from asyncmetal import _bridge

    names = {"wait", "wait_value", "_watch_for", "park", "parked", "add", "_publish", "add_ready"}
    classes = [am.Timeline, _timeline.Waitable, _bridge.Watch, *_bridge.LoopBridge.__subclasses__()]
    codes = {wait_value.__code__}
    for cls in classes:
        for name in names & set(vars(cls)):
            codes.add(inspect.unwrap(vars(cls)[name]).__code__)
    at = 0
    while True:
        tl = device.timeline()
        with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
            with anyio.move_on_after(0.01):  # (parked, or interrupted first)
                await tl.wait(1)
        woken = anyio.Event()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_set_once_reached, tl, woken)
                await anyio.to_thread.run_sync(tl.signal, 1)
                await woken.wait()  # (where a wake-up left behind would reach this task)
        if not raised:
            break
        at += 1
    assert at >= 10


async def _set_once_reached(tl: am.Timeline, woken: anyio.Event) -> None:
    await tl.wait(1)
    woken.set()

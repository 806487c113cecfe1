"""Closing a device, and the queue edges around it: nothing submitted is lost, every
waiter ends, and nothing of a finished event loop stays referenced."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import random
import re
import resource
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, ClassVar

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _device, _device_state, backends
from asyncmetal._compile import Compiler
from asyncmetal.backends.cpu import CCompiler, CPUBackend
from tests.reliability.test_forget_reached import _free_elsewhere as free_elsewhere
from tests.support.interrupts import (
    InterruptedWait,
    check_queue_making_interrupted,
    interrupted,
    native_closes,
)
from tests.support.kernels import KERNELS, MSL_KERNELS
from tests.support.other_kind import held_pair
from tests.support.queues import (
    close_failing_with_a_wait,
    discard_outcomes,
    record_native_closes,
)
from tests.support.threads import Contended, closed_while_making

INC = "void inc(int* x) { x[0] += 1; }"
WIDE = "void wide(" + ", ".join(f"int a{i}" for i in range(17)) + ") {}"


# -- work submitted while close() waits --------------------------------------------------


@pytest.mark.anyio
async def test_work_submitted_while_close_waits_runs(anyio_backend: object) -> None:
    dev = await am.open_device("cpu:21")
    sleep = await dev.compile(KERNELS, "sleep_ms")
    fill = await dev.compile(KERNELS, "fill")
    buf = await dev.alloc(4)
    stuck_queue = dev.new_queue()
    stuck_queue.wait(dev.timeline(), 1)  # never signalled: close abandons what follows
    stuck = stuck_queue.launch(sleep, vals=(0,))
    dev.queue.launch(sleep, vals=(150,))  # close waits for this...
    out = np.zeros(1, np.int32)
    late: list[am.Completion] = []

    async def submit_while_closing() -> None:
        await anyio.sleep(0.03)  # ...while this submits more
        assert not dev.closed
        late.append(dev.queue.launch(fill, buf, vals=(7, 1)))
        late.append(dev.queue.copy(out, buf))
        late.append(dev.new_queue().launch(sleep, vals=(1,)))  # a queue made meanwhile

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(submit_while_closing)
            await dev.close()
        for done in late:
            await done  # ran: no "never ran"
    assert out[0] == 7
    with pytest.raises(am.ClosedResourceError, match="never ran"):
        await stuck


@pytest.mark.anyio
async def test_a_read_behind_an_abandoned_command_of_another_queue_says_which_queue(
    anyio_backend: object,
) -> None:
    """A buffer's read (on the default queue) waits on the device for the launch of
    another queue that waits for a value nobody signals; the close abandons both, and
    the read's error names the queue whose command it is, not "this queue"."""
    dev = await am.open_device("cpu:22")
    fill = await dev.compile(KERNELS, "fill")
    buf = await dev.alloc(4)
    other = dev.new_queue()
    other.wait(dev.timeline(), 1)  # never signalled
    stuck = other.launch(fill, buf, vals=(7, 1))
    reading = dev.queue.copy(np.zeros(1, np.int32), buf)  # ordered after that launch
    with anyio.fail_after(20):
        await dev.close()
    with pytest.raises(am.ClosedResourceError, match=r"of its default queue \(this command.s\)"):
        await reading
    with pytest.raises(am.ClosedResourceError, match=r"of a queue \(this command.s\)"):
        await stuck


@pytest.mark.anyio
@pytest.mark.parametrize("at_count", [1, 2])
async def test_what_another_thread_submits_as_close_counts_runs_or_is_refused(
    anyio_backend: object, at_count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread (another loop's) submits a launch (the native path) and a copy
    (Python's) as the close counts what is left to wait for (each time it counts, in
    turn; the count holds the submission locks, so the thread goes on right after it):
    each command runs, or is refused as the device is closed -- never accepted, then
    abandoned as one that "never ran"."""
    from asyncmetal import _device

    dev = await am.open_device("cpu:22")
    fill = await dev.compile(KERNELS, "fill")
    buf = await dev.alloc(4)
    queue = dev.new_queue()
    await queue.launch(fill, buf, vals=(1, 1))
    out = np.zeros(1, np.int32)
    made: list[am.Completion] = []
    refused: list[am.ClosedResourceError] = []

    def submit() -> None:
        for one in (lambda: queue.launch(fill, buf, vals=(7, 1)), lambda: queue.copy(out, buf)):
            try:
                made.append(one())
            except am.ClosedResourceError as exc:
                refused.append(exc)

    counted = 0
    original = _device.completable
    threads: list[threading.Thread] = []

    def count_then_submit_elsewhere(*args: Any) -> dict[am.Queue, int]:
        nonlocal counted
        limits = original(*args)
        counted += 1
        if counted == at_count:  # another thread submits from here on
            threads.append(threading.Thread(target=submit))
            threads[0].start()
        return limits

    monkeypatch.setattr(_device, "completable", count_then_submit_elsewhere)
    with anyio.fail_after(20):
        await dev.close()
        for thread in threads:
            await anyio.to_thread.run_sync(thread.join)
    assert counted >= at_count and len(made) + len(refused) == 2
    for done in made:
        await done  # ran (a command abandoned at close would raise "never ran")
    if len(made) == 2:
        assert out[0] == 7


async def _made_elsewhere_as_it_closes(
    dev: am.Device, cls: type, make: Any, monkeypatch: pytest.MonkeyPatch
) -> list[Any]:
    """Another thread calls ``make()``, which builds a ``cls`` -- slowly: the device's
    close starts while it does. Returns what it made (nothing where it was refused)."""
    making, made_slowly = threading.Event(), threading.Event()
    original = cls.__init__

    def slow_init(self: object, *args: object, **kwargs: object) -> None:
        if threading.current_thread() is not threading.main_thread():
            making.set()
            made_slowly.wait(10)
        original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__init__", slow_init)
    made: list[Any] = []

    def call() -> None:
        with contextlib.suppress(am.ClosedResourceError):
            made.append(make())

    thread = threading.Thread(target=call)
    thread.start()
    assert making.wait(10)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(dev.close)
            await anyio.sleep(0.05)
            made_slowly.set()
        await anyio.to_thread.run_sync(thread.join)
    return made


@pytest.mark.anyio
async def test_a_queue_made_on_another_thread_as_the_device_closes_closes_with_it(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queue that another thread is making as the device closes is closed with the
    device, or refused (before: it was added once the close had closed the others, and
    its native thread ran on)."""
    from asyncmetal._queue import Queue

    dev = await am.open_device("cpu:23")
    for queue in await _made_elsewhere_as_it_closes(dev, Queue, dev.new_queue, monkeypatch):
        assert queue._native._handle is None  # closed natively


@pytest.mark.anyio
async def test_a_timeline_made_on_another_thread_as_the_device_closes_ends_its_waits(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the queue above: a timeline made as the device closes is refused, or one whose
    waits the close ends (before: made after the close ended the others' waits, a wait
    on it waited for good)."""
    from asyncmetal._timeline import Timeline

    dev = await am.open_device("cpu:24")
    for timeline in await _made_elsewhere_as_it_closes(dev, Timeline, dev.timeline, monkeypatch):
        with anyio.fail_after(20), pytest.raises(am.ClosedResourceError):
            await timeline.wait(1)


def test_a_wait_another_thread_submits_as_close_counts_is_abandoned_not_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A device wait nothing will signal, submitted by another thread as the device
    closes: the close counts it as a wait (and abandons what it holds) rather than as a
    command that completes -- which it would wait for for good. Here the thread is held
    between the wait's hand-over and its record as a wait (before: the close hung)."""
    from asyncmetal._queue import Queue

    original = Queue._track
    submitted = threading.Event()

    def slow_track(self: Queue, *args: Any) -> None:
        if threading.current_thread().name == "submitter":
            submitted.set()
            time.sleep(0.3)  # preempted here: the close counts meanwhile
        original(self, *args)

    monkeypatch.setattr(Queue, "_track", slow_track)

    async def main() -> tuple[bool, list[object]]:
        dev = await am.open_device("cpu:25")
        timeline, queue = dev.timeline(), dev.new_queue()
        result: list[object] = []

        def submit() -> None:
            try:
                result.append(queue.wait(timeline, 5))  # nothing signals 5
            except am.ClosedResourceError as exc:
                result.append(exc)

        thread = threading.Thread(target=submit, name="submitter")
        thread.start()
        await anyio.to_thread.run_sync(submitted.wait)
        closing = asyncio.ensure_future(dev.close())  # shielded: waited for, bounded
        done, _ = await asyncio.wait({closing}, timeout=10)
        if not done:
            timeline.signal(5)  # let the hung close end, to report it
            await closing
        await anyio.to_thread.run_sync(thread.join)
        return bool(done), result

    closed, result = asyncio.run(main())
    assert closed, "the close waited for a device wait nothing signals"
    assert len(result) == 1


def test_devices_opened_and_closed_on_another_thread_as_one_closes() -> None:
    """The open devices are looked at (a close's count) while another thread opens and
    closes devices (before: the set of them, iterated in Python, raised "changed size
    during iteration" out of the close, which left the device half closed)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        async def run() -> None:
            while not stop.is_set():
                await (await am.open_device("cpu:31")).close()

        try:
            asyncio.run(run())
        except BaseException as exc:  # reported below
            errors.append(exc)

    async def main() -> None:
        held = [await am.open_device(f"cpu:{40 + i}") for i in range(64)]  # a long set
        try:
            for _ in range(400):
                device = await am.open_device("cpu:32")
                await device.close()
                assert device.closed
        finally:
            for device in held:
                await device.close()

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        asyncio.run(main())
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert not errors, errors


def test_closes_at_once_report_run_commands_as_run() -> None:
    """A's queue waits on the device for B's command, which waits for a value nobody
    signals; A and B close at once, from two threads. B's close abandons its command
    and raises its timeline, which releases A's wait: A's commands behind it may run
    before A's queue stops. Each of them reports what it did -- ran, or never ran --
    (before: a copy that had filled the host array raised "never ran", in about one
    run in ten)."""

    async def once() -> None:
        a, b = await am.open_device("cpu:33"), await am.open_device("cpu:34")
        b.queue.wait(b.timeline(), 1)  # B's command 1: never satisfied
        a.queue.wait(b.queue.timeline, 1)
        buf = await a.alloc(8)
        host, sentinel = np.zeros(1, np.int64), np.array([42], np.int64)
        a.queue.copy(buf, sentinel)
        out = a.queue.copy(host, buf)
        barrier = threading.Barrier(2)

        def close(device: am.Device) -> None:
            async def run() -> None:
                barrier.wait()
                await device.close()

            asyncio.run(run())

        threads = [threading.Thread(target=close, args=(d,)) for d in (a, b)]
        for thread in threads:
            thread.start()
        for thread in threads:
            await anyio.to_thread.run_sync(thread.join)
        try:
            await out
        except am.ClosedResourceError:
            assert host[0] == 0, "a copy that ran reported it never ran"
        else:
            assert host[0] == 42

    async def main() -> None:
        for _ in range(30):
            await once()

    asyncio.run(main())


def test_a_close_counting_on_another_closing_devices_signal_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """R's queue waits for Y (a third device's timeline), then signals X; A's queue
    waits for X. R closes: its count finds the wait on Y unsatisfied and stops the
    queue there. Y is then signalled from the host, and A closes: its count must not
    take R's signal of X for one still to come (its waits now satisfied) and wait for it
    for good (before: A's close hung; the reviewer's natural race hung 3 runs in 25)."""
    from asyncmetal import _device

    original = _device.close_native
    stopped = threading.Event()
    timelines: dict[str, am.Timeline] = {}

    def close_native_then_signal_y(queue: am.Queue, abandon: bool) -> None:
        original(queue, abandon)
        if abandon and not stopped.is_set():  # R's, stopped in its wait on Y: now Y comes
            timelines["Y"].signal(1)
            stopped.set()
            time.sleep(0.3)  # R is still among the open devices meanwhile

    monkeypatch.setattr(_device, "close_native", close_native_then_signal_y)

    async def main() -> bool:
        r, a, c = [await am.open_device(f"cpu:{i}") for i in (35, 36, 37)]
        y, x = timelines["Y"], timelines["X"] = c.timeline(), a.timeline()
        r.queue.wait(y, 1)
        r.queue.signal(x, 1)
        a.queue.wait(x, 1)
        closing_r = threading.Thread(target=lambda: asyncio.run(r.close()))
        closing_r.start()
        await anyio.to_thread.run_sync(stopped.wait)
        closed = threading.Event()

        def close_a() -> None:
            asyncio.run(a.close())
            closed.set()

        threading.Thread(target=close_a, daemon=True).start()  # (left hung on failure)
        await anyio.to_thread.run_sync(closing_r.join)
        finished = await anyio.to_thread.run_sync(closed.wait, 10)
        await c.close()
        return finished

    assert asyncio.run(main()), "a close waited for good for another closing device's signal"


@pytest.mark.anyio
async def test_concurrent_closes_share_one_teardown(anyio_backend: object) -> None:
    dev = await am.open_device("cpu:22")
    sleep = await dev.compile(KERNELS, "sleep_ms")
    dev.queue.launch(sleep, vals=(50,))
    real_close = dev._backend.close
    teardowns: list[str] = []

    def slow_close() -> None:  # the native teardown (runs in a worker thread)
        teardowns.append("started")
        time.sleep(0.05)
        real_close()
        teardowns.append("done")

    dev._backend.close = slow_close  # type: ignore[method-assign]
    returned: list[list[str]] = []

    async def closer() -> None:
        await dev.close()
        returned.append(list(teardowns))

    async def late_closer() -> None:  # arrives while the teardown is under way
        while not dev.closed:
            await anyio.sleep(0.001)
        await closer()

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(closer)
            tg.start_soon(late_closer)
    assert teardowns == ["started", "done"]
    assert returned == [["started", "done"]] * 4  # each returned after the one teardown


def test_closes_from_two_threads_at_once_share_one_teardown() -> None:
    """Two threads, each with a loop of its own, close one device at the same moment:
    one teardown, and both return once it is done (before, both could start one: the
    later failed with a KeyError, and both could close the native queues). The race is
    narrow: a short switch interval widens it (it showed within ~100 trials)."""

    async def opened() -> am.Device:
        return await am.open_device("cpu:25")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(300):
            dev = asyncio.run(opened())
            for _ in range(3):
                dev.new_queue()
            barrier = threading.Barrier(2)
            errors: list[BaseException] = []

            def close(
                dev: am.Device, barrier: threading.Barrier, errors: list[BaseException]
            ) -> None:
                async def run() -> None:
                    barrier.wait()
                    await dev.close()

                try:
                    asyncio.run(run())
                except BaseException as exc:  # reported below
                    errors.append(exc)

            threads = [
                threading.Thread(target=close, args=(dev, barrier, errors)) for _ in range(2)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(20)
            assert not any(thread.is_alive() for thread in threads), "a close hung"
            assert not errors, errors
            assert dev.closed
    finally:
        sys.setswitchinterval(interval)


@pytest.mark.anyio
async def test_a_close_cancelled_by_its_caller_still_closes_the_device(
    anyio_backend: object,
) -> None:
    """A caller's timeout cancels close() while it waits for work: on asyncio
    ``wait_for``'s (a task.cancel(), which anyio's shielded scope does not stop), on
    trio a cancel scope's. The close goes on to its end before the cancellation is
    raised: the device is closed and an abandoned command's waiter fails (before, on
    asyncio the device stayed open for good, and every later close returned at once).
    On asyncio also every task the close made cancelled with it, as a framework
    shutting down cancels every task."""
    on_asyncio = am._bridge.running_asyncio_loop() is not None
    for how in ("timeout", "every task cancelled") if on_asyncio else ("timeout",):
        dev = await am.open_device("cpu:26")
        sleep = await dev.compile(KERNELS, "sleep_ms")
        dev.queue.launch(sleep, vals=(200,))  # the close waits for this
        stuck_queue = dev.new_queue()
        stuck_queue.wait(dev.timeline(), 1)  # never signalled: the close abandons the rest
        stuck = stuck_queue.launch(sleep, vals=(0,))
        with anyio.fail_after(20):
            if how == "every task cancelled":  # as a framework shutting down does
                others = asyncio.all_tasks()  # (the test's own: left alone)
                closing = asyncio.ensure_future(dev.close())
                await asyncio.sleep(0.02)
                for task in asyncio.all_tasks() - others:  # the close's, and any it made
                    task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await closing
            elif on_asyncio:
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(dev.close(), 0.02)
            else:
                with anyio.move_on_after(0.02):
                    await dev.close()
            assert dev.closed, how
            assert dev not in am.open_devices()
            with pytest.raises(am.ClosedResourceError, match="never ran"):
                await stuck
            await dev.close()  # closed: returns at once


@pytest.mark.anyio
async def test_a_close_waiting_for_work_does_not_spin_the_loop(anyio_backend: object) -> None:
    """A close waits for a 400 ms kernel inside a cancel scope that expires meanwhile:
    the loop sleeps while it waits (before, on asyncio it ran flat out: anyio delivers
    its cancellation again every iteration while a task is in the scope)."""
    dev = await am.open_device("cpu:29")
    sleep = await dev.compile(KERNELS, "sleep_ms")
    dev.queue.launch(sleep, vals=(400,))
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    with anyio.move_on_after(0.01):
        await dev.close()
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - start
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert dev.closed
    assert wall >= 0.3 and cpu < 0.5 * wall, (cpu, wall)


@pytest.mark.anyio
async def test_synchronize_raises_for_commands_that_did_not_run(
    anyio_backend: object,
) -> None:
    """A queue waits on another device's timeline; that device closes, so the wait and
    what follows never run. Queue.synchronize and Device.synchronize raise the
    ClosedResourceError that awaiting the launch raises (before, both returned as if it
    had run). Buffer.map waits for the buffer's uses and does not judge them: a use
    that did not run may have been a read (the buffer intact), and its record stays."""
    dev, other = await am.open_device("cpu:27"), await am.open_device("cpu:28")
    fill = await dev.compile(KERNELS, "fill")
    buf = await dev.alloc(4)
    await buf.write(np.zeros(1, np.int32))
    queue = dev.new_queue()
    queue.wait(other.timeline(), 1)  # nobody signals it
    launch = queue.launch(fill, buf, vals=(1, 1))
    with anyio.fail_after(20):
        await other.close()
        for waited in (launch, queue.synchronize(), dev.synchronize()):
            with pytest.raises(am.ClosedResourceError, match="cpu:28"):
                await waited
        await dev.queue.synchronize()  # the default queue's work ran
        await dev.close()


# -- tasks parked on a free timeline -----------------------------------------------------


@pytest.mark.anyio
async def test_close_ends_tasks_parked_on_timelines(anyio_backend: object) -> None:
    dev = await am.open_device("cpu:23")
    tl = dev.timeline()
    tl.signal(1)
    queue = dev.new_queue()
    ended: list[tuple[str, int]] = []

    async def parked(name: str, timeline: am.Timeline, value: int) -> None:
        with pytest.raises(am.ClosedResourceError, match="closed"):
            await timeline.wait(value)
        ended.append((name, value))

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(parked, "free", tl, 2)
            tg.start_soon(parked, "free", tl, 9)
            tg.start_soon(parked, "queue", queue.timeline, 3)
            await anyio.sleep(0.05)  # all three parked
            tg.start_soon(parked, "free", tl, 4)  # parks while close begins
            await dev.close()
    assert sorted(ended) == [("free", 2), ("free", 4), ("free", 9), ("queue", 3)]
    await tl.wait(1)  # reached before the close: no error
    with anyio.fail_after(5), pytest.raises(am.ClosedResourceError, match="closed"):
        await tl.wait(2)  # after it: at once


@pytest.mark.anyio
@pytest.mark.parametrize("discard", [False, True], ids=["plain", "discard"])
async def test_a_close_finishes_a_reached_wait_held_before_a_wait_nobody_signals(
    anyio_backend: object, device_name: str, discard: bool
) -> None:
    """A queue waits for a value that is then reached, then for one nobody signals,
    then launches: the close (plain or discarding) ends, the first wait completed --
    a plain close finishes what can complete; a discarding one may drop it if it had
    not started yet -- and what follows the second never ran. Checked failing on Metal
    before: the close counted the first wait as completable, and waited for good for
    it, whose value the queue's thread marked only with the launch."""
    device = await am.open_device(device_name)
    source = MSL_KERNELS if device_name == "metal" else KERNELS
    empty = await device.compile(source, "empty")
    tl, never = device.timeline(), device.timeline()
    q = device.new_queue()
    first = q.wait(tl, 1)
    second = q.wait(never, 1)
    behind = q.launch(empty)
    tl.signal(1)
    with anyio.fail_after(20):
        await device.close(discard=discard)
        if discard:
            assert (await discard_outcomes([first, second, behind]))[1:] == [False, False]
        else:
            await first
            for dropped in (second, behind):
                with pytest.raises(am.ClosedResourceError):
                    await dropped
    assert device.closed


# -- completable(): waits on other queues' own timelines ---------------------------------


@pytest.mark.anyio
async def test_close_waits_for_a_queue_waiting_on_another_devices_queue(
    anyio_backend: object,
) -> None:
    dev, peer = await am.open_device("cpu:29"), await am.open_device("cpu:30")
    fill = await dev.compile(KERNELS, "fill")
    sleep = await peer.compile(KERNELS, "sleep_ms")
    buf = await dev.alloc(4)
    out = np.zeros(1, np.int32)
    running = peer.queue.launch(sleep, vals=(200,))
    dev.queue.wait(peer.queue.timeline, running.value)  # satisfied once `running` ends
    dev.queue.launch(fill, buf, vals=(5, 1))
    copied = dev.queue.copy(out, buf)
    with anyio.fail_after(20):
        await dev.close()
        await copied  # it ran: the peer's queue was going to reach that value
    assert out[0] == 5
    await peer.close()


@pytest.mark.anyio
async def test_a_wait_for_a_command_abandoned_by_a_close_fails_what_follows(
    device: am.Device, device_name: str
) -> None:
    """A queue of one device waits, on the device, for a command of another device's
    queue that waits for a value nobody signals; closing that device abandons the
    command. The waiting queue's commands from its wait on fail (ClosedResourceError,
    naming where), and so do host waits for the abandoned value. On cpu they do not run
    (a Metal GPU runs them); either way the timeline they signal fails in turn, failing
    the commands and host waits behind it. (Before, the close raised the abandoned
    queue's timeline as if its commands had run: the commands behind the wait ran on
    data never produced, and every wait returned as if it had been.)"""
    source = MSL_KERNELS if device_name == "metal" else KERNELS
    other = await am.open_device(device_name)
    fill_here = await device.compile(source, "fill")
    fill_there = await other.compile(source, "fill")
    mine, theirs = await device.alloc(4), await other.alloc(4)
    await device.queue.launch(fill_here, mine, vals=(5, 1))
    stuck = other.new_queue()
    ran = stuck.launch(fill_there, theirs, vals=(2, 1))
    stuck.wait(other.timeline(), 1)  # nobody signals it
    produced = stuck.launch(fill_there, theirs, vals=(1, 1))
    queue = device.new_queue()
    before = queue.launch(fill_here, mine, vals=(5, 1))
    waited = queue.wait(stuck.timeline, produced.value)
    behind = queue.launch(fill_here, mine, vals=(7, 1))
    signalled = device.timeline()
    queue.signal(signalled, 1)
    follower = device.new_queue()
    follower.wait(signalled, 1)
    followed = follower.launch(fill_here, mine, vals=(9, 1))
    with anyio.fail_after(20):
        await before
        await other.close()
        for done in (waited, behind):
            with pytest.raises(am.ClosedResourceError, match=f"never produced: {other.name} was"):
                await done
        with pytest.raises(am.ClosedResourceError, match="never ran"):
            await stuck.timeline.wait(produced.value)
        await stuck.timeline.wait(ran.value)  # ran before the close: no error
        await queue.timeline.wait(before.value)
        with pytest.raises(am.ClosedResourceError, match="never produced"):
            await queue.timeline.wait(behind.value)
        with pytest.raises(am.ClosedResourceError, match="never produced"):
            await signalled.wait(1)
        with pytest.raises(am.ClosedResourceError, match="never produced"):
            await followed
        if device_name == "cpu":  # (a Metal GPU runs them: only their awaits fail)
            assert (await mine.read(np.int32))[0] == 5  # neither fill ran
        # The queue stays failed, and says so; another one of the device works. On cpu
        # its commands say they did not run (checked: they said they "ran").
        ran_or_not = "did not run" if device_name == "cpu" else "ran"
        with pytest.raises(
            am.ClosedResourceError,
            match=rf"this command {ran_or_not}.*never produced.*use another queue",
        ):
            await queue.launch(fill_here, mine, vals=(3, 1))
        await device.new_queue().launch(fill_here, mine, vals=(4, 1))
    assert (await mine.read(np.int32))[0] == 4


@pytest.mark.anyio
async def test_a_close_abandoning_a_wait_a_held_signal_would_satisfy_says_not_yet(
    anyio_backend: object,
) -> None:
    """A queue of cpu:0 waits, on the device, for a value of a timeline whose signal a
    queue of cpu:1 holds behind a wait for a host signal; closing cpu:0 abandons the
    waiting command. Its error, and those of what depends on it (a queue of cpu:1 that
    waits for its value), say that the device closed while the command waited for a
    value not produced yet -- which the host's signal then brings -- not that the value
    was never produced. Checked: before, they said "a timeline value never produced
    (nobody signalled it ...)" and "a timeline value nobody signalled"."""
    dev, other = await am.open_device("cpu:0"), await am.open_device("cpu:1")
    try:
        fill = await dev.compile(KERNELS, "fill")
        buf = await dev.alloc(4)
        timeline, gate = other.timeline(), other.timeline()
        held = other.new_queue()
        held.wait(gate, 1)  # only the host raises it, once the close has ended
        signalled = held.signal(timeline, 1)
        queue = dev.new_queue()
        waited = queue.wait(timeline, 1)
        behind = queue.launch(fill, buf, vals=(7, 1))
        follower = other.new_queue()
        followed = follower.wait(queue.timeline, behind.value)
        with anyio.fail_after(20):
            await dev.close()
            errors = []
            for done in (waited, behind, queue.timeline.wait(behind.value), followed):
                with pytest.raises(am.ClosedResourceError) as caught:
                    await done
                errors.append(str(caught.value))
            for error in errors:
                assert "timeline value not produced yet" in error, error
                assert "a signal held behind another wait, or the host's" in error, error
                assert "nobody signalled" not in error, error
                assert "value never produced" not in error, error
            assert errors[0].startswith(f"the device {dev.name} was closed while command ")
            assert f"{dev.name} was closed while that command waited for a timeline" in errors[3]
            gate.signal(1)
            await signalled  # the value came after all
            await timeline.wait(1)
    finally:
        await dev.close()
        await other.close()


@pytest.mark.anyio
async def test_a_host_wait_past_a_queues_abandoned_commands_raises(anyio_backend: object) -> None:
    """A close abandons a queue's commands (they wait for a value nobody signals): its
    timeline settles, and a host wait on it for a value past its last command -- made
    before the close or after -- raises, as one does on a queue that had nothing
    abandoned. Nothing produced those values: a wait that returned would say they ran."""
    dev = await am.open_device("cpu:58")
    queue = dev.new_queue()
    queue.wait(dev.timeline(), 1)  # nobody signals it
    stuck = queue.marker()
    outcomes: dict[int, str] = {}

    async def wait_for(value: int) -> None:
        try:
            await queue.timeline.wait(value)
            outcomes[value] = "returned"
        except am.ClosedResourceError:
            outcomes[value] = "raised"

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for value in (stuck.value, stuck.value + 1, stuck.value + 9):
                tg.start_soon(wait_for, value)
            await anyio.sleep(0.05)
            await dev.close()
        assert outcomes == dict.fromkeys((stuck.value, stuck.value + 1, stuck.value + 9), "raised")
        for value in (stuck.value + 1, stuck.value + 9):
            with pytest.raises(am.ClosedResourceError, match=f"will not reach {value}"):
                await queue.timeline.wait(value)


@pytest.mark.anyio
async def test_a_host_wait_for_a_signal_failed_by_another_devices_close_raises(
    anyio_backend: object,
) -> None:
    """A queue of cpu:0 waits, on the device, for a cpu:1 timeline, then signals a
    cpu:0 timeline; cpu:1 closes, so the wait fails, and with it the signal: the
    timeline settles failed. A host wait for the signal's value (or more) raises,
    naming the closed device. Checked: before, it returned as if the value had come
    (the failure, of a device's close, was taken for the timeline's own device's)."""
    async with am.open_device("cpu:0") as d0:
        d1 = await am.open_device("cpu:1")
        theirs, mine = d1.timeline(), d0.timeline()
        queue = d0.new_queue()
        queue.wait(theirs, 1)
        signalled = queue.signal(mine, 2)
        with anyio.fail_after(20):
            await d1.close()
            with pytest.raises(am.ClosedResourceError, match="cpu:1, closed before"):
                await signalled
            for value in (2, 3):
                with pytest.raises(am.ClosedResourceError, match="cpu:1, closed before"):
                    await mine.wait(value)


@pytest.mark.anyio
async def test_a_closed_devices_timeline_still_reaches_a_signal_another_device_submitted(
    anyio_backend: object,
) -> None:
    """A queue of cpu:0 has a signal of a cpu:1 timeline submitted, not run yet (held
    here by a wait the host releases later), and another cpu:0 queue and a host task
    wait for that value; cpu:1 closes. The signal still comes, and with it the waits
    end as they would have: the close fails the timeline only past what such a signal
    raises it to. Checked: before, both waits failed ("closed before the timeline got
    there"), the device wait also where the signal was ready to run and its queue's
    thread had not run it yet."""
    async with am.open_device("cpu:0") as d0:
        d1 = await am.open_device("cpu:1")
        theirs, hold = d1.timeline(), d0.timeline()
        signaller, waiter = d0.new_queue(), d0.new_queue()
        signaller.wait(hold, 1)
        signalled = signaller.signal(theirs, 2)
        waited = waiter.wait(theirs, 2)
        results: list[object] = []

        async def host_wait(value: int) -> None:
            try:
                await theirs.wait(value)
                results.append(value)
            except am.ClosedResourceError as exc:
                results.append(exc)

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(host_wait, 2)
                tg.start_soon(host_wait, 3)
                await anyio.sleep(0.02)
                await d1.close()
                hold.signal(1)
                await signalled
                await waited
        assert theirs.value == 2
        assert results[0] == 2 or results[1] == 2, results
        beyond = results[0] if results[1] == 2 else results[1]
        assert isinstance(beyond, am.ClosedResourceError), results  # 3: never to come
        with pytest.raises(am.ClosedResourceError, match="closed before it reached 3"):
            await theirs.wait(3)


@pytest.mark.anyio
async def test_a_host_wait_on_a_closed_devices_timeline_ends_with_the_first_signal_reaching_it(
    anyio_backend: object,
) -> None:
    """Two signals of a cpu:1 timeline that cpu:0 queues submitted are pending as cpu:1
    closes: to 1 (held by a wait the host releases later) and then to 2 (held by a wait
    nobody releases). A host wait for 1 ends once the first signal ran: the second one
    has nothing to do with it. Checked: before, it waited for the last pending signal's
    queue, until cpu:0 closed."""
    async with am.open_device("cpu:0") as d0:
        d1 = await am.open_device("cpu:1")
        theirs, first, never = d1.timeline(), d0.timeline(), d0.timeline()
        q1, q2 = d0.new_queue(), d0.new_queue()
        q1.wait(first, 1)
        signalled = q1.signal(theirs, 1)
        q2.wait(never, 1)
        q2.signal(theirs, 2)
        ended = anyio.Event()

        async def host_wait() -> None:
            await theirs.wait(1)
            ended.set()

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(host_wait)
                await anyio.sleep(0.02)
                await d1.close()
                first.signal(1)
                await signalled
                with anyio.move_on_after(5):
                    await ended.wait()
                assert ended.is_set(), "the host wait for 1 still waits for the signal to 2"
                never.signal(1)  # (else: what it waits for comes now)


@pytest.mark.anyio
@pytest.mark.parametrize("whose", ["timeline", "queue"])
async def test_a_wait_for_a_closed_devices_timeline_fails_what_follows(
    device: am.Device, device_name: str, whose: str
) -> None:
    """A queue waits, on the device, for a value of another device's timeline (a
    ``device.timeline()``, or a queue's own) that it has not reached; that device
    closes (nothing can signal the timeline any more). The wait ends: the queue's
    commands from it on fail (ClosedResourceError naming the closed device); a host wait
    for the value raises too. Checked: before, the queue waited until its own device
    closed."""
    source = MSL_KERNELS if device_name == "metal" else KERNELS
    other = await am.open_device(device_name)
    fill = await device.compile(source, "fill")
    mine = await device.alloc(4)
    await device.queue.launch(fill, mine, vals=(5, 1))
    if whose == "queue":
        their_queue = other.new_queue()
        theirs = their_queue.timeline
        their_fill = await other.compile(source, "fill")
        await their_queue.launch(their_fill, await other.alloc(4), vals=(1, 1))
    else:
        theirs = other.timeline()
        theirs.signal(1)
    assert theirs.value == 1
    queue = device.new_queue()
    waited = queue.wait(theirs, 2)
    behind = queue.launch(fill, mine, vals=(7, 1))
    with anyio.fail_after(20):
        await anyio.sleep(0.05)  # the queue waits
        await other.close()
        for done in (waited, behind):
            with pytest.raises(am.ClosedResourceError, match=f"{other.name}, closed before"):
                await done
        with pytest.raises(am.ClosedResourceError, match="closed before it reached 2"):
            await theirs.wait(2)
        await theirs.wait(1)
        if device_name == "cpu":
            assert (await mine.read(np.int32))[0] == 5  # the fill did not run


@pytest.mark.anyio
@pytest.mark.parametrize("seed", [1, 2])
async def test_close_with_thousands_of_mixed_commands_loses_none(
    anyio_backend: object, seed: int
) -> None:
    rng = random.Random(seed)
    dev = await am.open_device(f"cpu:{30 + seed}")
    inc = await dev.compile(INC, "inc")
    queues = [dev.queue, dev.new_queue(), dev.new_queue()]
    bufs = [await dev.alloc(64) for _ in range(6)]
    hosts = [np.zeros(16, np.int32) for _ in range(4)]
    timelines = [dev.timeline() for _ in range(3)]
    highest = [0] * len(timelines)
    must_run: list[am.Completion] = []
    # Every wait below is for a value whose signal was submitted before it, and every
    # ordering points back at earlier commands: all of this can complete.
    for _ in range(3000):
        q = rng.choice(queues)
        op = rng.randrange(7)
        a, b = rng.sample(bufs, 2)
        if op == 0:
            must_run.append(q.launch(inc, a))
        elif op == 1:
            must_run.append(q.after(a).launch(inc, a))
        elif op == 2:
            must_run.append(q.copy(a, b))  # ordered after other queues' uses of a and b
        elif op == 3:
            must_run.append(q.copy(rng.choice(hosts), a))
        elif op == 4:
            must_run.append(q.copy(a, rng.choice(hosts)))
        elif op == 5:
            t = rng.randrange(len(timelines))
            highest[t] += 1
            must_run.append(q.signal(timelines[t], highest[t]))
        else:
            t = rng.randrange(len(timelines))
            if highest[t]:
                must_run.append(q.wait(timelines[t], rng.randint(1, highest[t])))
    # Then one queue waits for a value nothing signals; what depends on it is stuck.
    q0, q1, q2 = queues
    never = dev.timeline()
    stuck = [q0.wait(never, 1), q0.launch(inc, bufs[0])]
    highest[0] += 1
    stuck.append(q0.signal(timelines[0], highest[0]))
    stuck.append(q1.copy(bufs[1], bufs[0]))  # after q0's stuck use of bufs[0]
    stuck.append(q1.launch(inc, bufs[1]))  # behind that copy
    must_run.append(q2.launch(inc, bufs[2]))
    must_run.append(q2.copy(bufs[3], bufs[4]))
    stuck.append(q2.wait(timelines[0], highest[0]))  # signalled only by stuck q0
    stuck.append(q2.launch(inc, bufs[2]))
    with anyio.fail_after(60):
        await dev.close()
        for done in must_run:
            await done
        for done in stuck:
            with pytest.raises(am.ClosedResourceError, match="never ran"):
                await done


# -- a launch the backend refuses ---------------------------------------------------------


@pytest.mark.anyio
async def test_a_launch_the_backend_refuses_is_refused_at_once(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Too many parameters for a cpu kernel: the launch raises, and its value is taken
    back (the next command gets it and runs)."""
    # Compiling refuses such a kernel first: let it past that to reach the launch check.
    monkeypatch.setattr(CCompiler, "_params", Compiler._params)
    async with am.open_device("cpu:24") as dev:
        wide = await dev.compile(WIDE, "wide")
        empty = await dev.compile(KERNELS, "empty")
        q = dev.new_queue()
        with pytest.raises(am.ArgumentTypeError, match="at most 16"):
            q.launch(wide, vals=(0,) * 17)
        assert q.submitted == 0
        with anyio.fail_after(10):
            await q.launch(empty)
        assert q.submitted == 1


# -- copies between kinds through a host-visible buffer ----------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("direction", ["read", "write"])
async def test_a_cross_kind_copy_keeps_the_host_visible_buffer(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, direction: str
) -> None:
    cpu, other, mine, theirs, gate = await held_pair(monkeypatch, "cpu:26")
    if direction == "read":  # the other queue reads `mine` in place
        with anyio.move_on_after(0.05):
            await am.copy(theirs, mine)
    else:  # the other queue writes `mine` in place
        with anyio.move_on_after(0.05):
            await am.copy(mine, theirs)
    with anyio.move_on_after(0.05):
        await mine.free()  # cancelled: the memory returns once the copy is done
    again = await cpu.alloc(64)  # must not be the memory the copy still uses
    await again.write(np.full(16, 2, np.int32))
    gate.signal(1)
    with anyio.fail_after(10):
        await other.synchronize()
    assert (await again.read(np.int32) == 2).all()
    if direction == "read":
        assert (await theirs.read(np.int32) == 1).all()
    await again.write(np.zeros(16, np.int32))  # still usable by the cpu queue
    await other.close()
    await cpu.close()


@pytest.mark.anyio
async def test_a_command_after_another_queues_discarded_copy_names_that_queue(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cpu write waits, on the device, for the other kind's copy of its buffer, which
    that device's close with discard drops: the write fails, saying the value it waited
    for was discarded on that device's queue. Before, it said the write's own queue was
    closed with discard=True, which it was not."""
    cpu, other, mine, theirs, gate = await held_pair(monkeypatch, "cpu:56")
    sleep = await other.compile(KERNELS, "sleep_ms")
    gate.signal(1)
    other.queue.launch(sleep, vals=(200,))  # the copy waits behind it: none is abandoned
    with anyio.move_on_after(0.05):
        await am.copy(theirs, mine)  # submitted, not started: cancelled
    done = cpu.queue.copy(mine, np.full(16, 7, np.int32))
    await other.close(discard=True)
    with pytest.raises(am.ClosedResourceError) as caught:
        with anyio.fail_after(10):
            await done
    assert "a device-side wait for a value that command" in str(caught.value)
    assert "of a queue of cpu2" in str(caught.value)
    await cpu.close()


# -- finished event loops ----------------------------------------------------------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _open_device(name: str) -> am.Device:
    async def opened() -> am.Device:
        return await am.open_device(name)

    return asyncio.run(opened())


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts fds in /proc")
@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_finished_asyncio_runs_leave_nothing_referenced(use_uvloop: bool) -> None:
    """Runs each ended with a wait cancelled by a timeout and a completion's wait
    cancelled by the run's end: no loop stays referenced, and no descriptor (the
    bridge's wake-up pipe) open -- on uvloop too, whose runs close their loops as
    asyncio's do."""
    run: Any = asyncio.run
    if use_uvloop:
        run = pytest.importorskip("uvloop", reason="uvloop is a test dependency").run
    dev = _open_device("cpu:27")
    tl = dev.timeline()
    queue = dev.new_queue()
    pending = queue.wait(tl, 1)  # a command that stays pending across the runs
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def one_run() -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(tl.wait(1), 0.01)  # cancelled by the timeout
        asyncio.get_running_loop().create_task(pending.wait())  # cancelled by the run's end
        await asyncio.sleep(0)

    run(one_run())  # the first run loads what later runs share
    gc.collect()
    before = _open_fds()
    for _ in range(20):
        run(one_run())
    gc.collect()
    assert [ref for ref in loops if ref() is not None] == []
    assert _open_fds() <= before
    tl.signal(1)
    asyncio.run(dev.close())


def test_finished_trio_runs_leave_no_fds() -> None:
    trio = pytest.importorskip("trio")
    dev = _open_device("cpu:28")
    tl = dev.timeline()

    async def one_run() -> None:
        with trio.move_on_after(0.01):
            await tl.wait(1)

    trio.run(one_run)
    gc.collect()
    before = _open_fds()
    for _ in range(20):
        trio.run(one_run)
    gc.collect()
    assert _open_fds() <= before
    asyncio.run(dev.close())


@pytest.mark.anyio
async def test_a_closed_device_whose_queue_waited_on_another_devices_timeline_is_collected(
    anyio_backend: object,
) -> None:
    """A device wait on another device's timeline is recorded on that timeline (for the
    checks of later signals), weakly: the closed, dropped device goes, though the
    timeline it waited on lives on (checked: before, the record kept its queue, and so
    the device, alive for as long as the other device's timeline)."""
    async with am.open_device("cpu:27") as other:
        gate = other.timeline()

        async def waited() -> weakref.ref[am.Device]:
            dev = await am.open_device("cpu")
            dev.queue.wait(gate, 1)
            await dev.close()  # abandons the wait
            return weakref.ref(dev)

        dev = await waited()
        with anyio.fail_after(10):
            while gc.collect() >= 0 and dev() is not None:
                await anyio.sleep(0.01)
        assert gate.value == 0


_LEFT_OPEN = """
import sys, anyio, numpy as np, asyncmetal as am
async def main():
    dev = await am.open_device("cpu")
    fill = await dev.compile("void k(int* x) { x[0] = 1; }", "k")
    await dev.queue.launch(fill, await dev.alloc(4))
    if sys.argv[1] == "closed, after from_numpy":
        await am.copy(await dev.alloc(16), await am.from_numpy(np.arange(4, dtype=np.int32)))
    if sys.argv[1] != "left open":
        await dev.close()
anyio.run(main)
"""


@pytest.mark.parametrize("how", ["left open", "closed", "closed, after from_numpy"])
def test_a_device_left_open_at_exit_warns(how: str) -> None:
    """A device never closed is closed at exit, with a ResourceWarning saying so (shown
    under ``-X dev`` or ``-W``, as Python's own unclosed resources are); a closed one
    warns nothing, nor does the npy device ``from_numpy`` opened for itself (checked:
    it warned, for a device the program never opened)."""
    proc = subprocess.run(
        [sys.executable, "-W", "always::ResourceWarning", "-c", _LEFT_OPEN, how],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = "was never closed" in proc.stderr
    assert warned == (how == "left open"), proc.stderr[-3000:]


_TWO_LEFT_OPEN = """
import anyio, asyncmetal as am
async def main():
    for _ in range(2):
        await am.open_device("cpu")
    await am.open_device("cpu")
anyio.run(main)
"""


def test_each_device_left_open_warns_for_itself() -> None:
    """Devices of one name left open each warn at exit, also under the ``default``
    action (``-X dev``, ``-W default``), which shows a warning once per text: each says
    which device of the process it is and where it was opened (checked: three cpu
    devices warned once, all alike)."""
    proc = subprocess.run(
        [sys.executable, "-W", "default::ResourceWarning", "-c", _TWO_LEFT_OPEN],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = sorted(re.findall(r"device cpu \((.*?)\) was never closed", proc.stderr))
    assert warned == [
        "number 1 opened in this process, at <string>:5",
        "number 2 opened in this process, at <string>:5",
        "number 3 opened in this process, at <string>:6",
    ], proc.stderr[-3000:]


_LOOP_LEFT = """
import asyncio, sys, asyncmetal as am
async def serve():
    dev = await am.open_device("cpu")
    await dev.compile("void k(int* x) { x[0] = 1; }", "k")
    if sys.argv[1] == "closed":
        await dev.close()
    await asyncio.sleep(3600)  # still pending when the loop stops
loop = asyncio.new_event_loop()
loop.create_task(serve())
loop.call_later(0.2, loop.stop)  # as a SIGTERM handler calling loop.stop() would
loop.run_forever()
loop.close()
print("left the loop")
"""


@pytest.mark.parametrize("how", ["left open", "closed"])
def test_a_program_whose_loop_stops_with_the_opening_task_pending_exits(how: str) -> None:
    """A program whose asyncio loop stops (``loop.stop()``, or a framework leaving its
    loop on a repeated Ctrl-C) while the task that opened a device is still pending
    exits. Checked: it waited at exit, for good, for the idle worker thread the device
    had opened on (anyio's, told to stop only once that task was done)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _LOOP_LEFT, how], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the program never exited; it printed {exc.stdout!r}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "left the loop\n"


@pytest.mark.anyio
async def test_a_queue_whose_native_close_fails_leaves_nothing_else_unreleased(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One queue's native close raises: the device's other queues, its memory and its
    backend are released all the same, waits on its timelines end, and close() raises
    that error (the first)."""
    from asyncmetal import _device
    from asyncmetal._queue import native_queue
    from asyncmetal.backends.cpu import CPUBackend

    closed = record_native_closes(monkeypatch, lambda queue: queue)
    close_native = _device.close_native

    def failing_close(queue: am.Queue, abandon: bool) -> None:
        close_native(queue, abandon)  # (released all the same: nothing left running)
        if queue is dev.queue:
            raise am.AsyncMetalError("the native close failed")

    monkeypatch.setattr(_device, "close_native", failing_close)
    dev = await am.open_device("cpu:23")
    failing = native_queue(dev.queue)  # the first closed
    other = native_queue(dev.new_queue())
    await dev.alloc(1024)
    backend = dev._backend
    assert isinstance(backend, CPUBackend) and backend.live_allocations == 1
    ended = await close_failing_with_a_wait(dev, "the native close failed")
    assert closed == [failing, other, "backend"]
    assert backend.live_allocations == 0, "the allocator's close was skipped"
    assert len(ended) == 1
    assert dev not in am.open_devices()


# -- an open that does not hand its device over ------------------------------------------


class _Recorded(CPUBackend):
    """A cpu device whose instances opened and closed are recorded; with ``no_queue``
    set, its default queue cannot be made (the Device of it is never made)."""

    kind = "recordedcpu"
    no_queue = False
    opened: ClassVar[list[CPUBackend]] = []
    closed: ClassVar[list[CPUBackend]] = []

    @classmethod
    def available(cls) -> list[str]:
        return ["recordedcpu"]

    def __init__(self, index: int) -> None:
        super().__init__(index)
        type(self).opened.append(self)

    def new_queue(self, timeline: Any) -> Any:
        if type(self).no_queue:
            raise am.AsyncMetalError("no queue to be had")
        return super().new_queue(timeline)

    def close(self) -> None:
        type(self).closed.append(self)
        super().close()


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> type[_Recorded]:
    monkeypatch.setitem(backends.BACKENDS, "recordedcpu", f"{__name__}:_Recorded")
    monkeypatch.setattr(_Recorded, "opened", [])
    monkeypatch.setattr(_Recorded, "closed", [])
    return _Recorded


async def _all_closed(recorded: type[_Recorded]) -> None:
    """Wait until every backend opened was closed (a given-up one closes on a thread
    of its own); then no device of them is open, nor any state of theirs."""
    with anyio.move_on_after(10):  # (a bound on a hang, not a timing)
        while len(recorded.closed) < len(recorded.opened):
            await anyio.sleep(0.005)
    assert recorded.closed == recorded.opened
    assert not [d for d in am.open_devices() if d.kind == recorded.kind]
    assert not [s for s in _device_state.unreleased_states() if s.kind == recorded.kind]


@pytest.mark.anyio
async def test_an_open_whose_device_cannot_be_made_closes_its_backend(
    anyio_backend: object, recorded: type[_Recorded], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend opened for a Device that cannot be made of it (its default queue
    refused) is closed, and the error raised; nothing of it stays among the open
    devices. Checked: the backend never closed, its state left among the open ones."""
    monkeypatch.setattr(recorded, "no_queue", True)
    with pytest.raises(am.AsyncMetalError, match="no queue to be had"):
        await am.open_device("recordedcpu")
    assert len(recorded.opened) == 1
    await _all_closed(recorded)


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["await", "async with"])
async def test_a_keyboard_interrupt_as_an_open_hands_its_device_over_closes_it(
    anyio_backend: object, recorded: type[_Recorded], how: str
) -> None:
    """A KeyboardInterrupt wherever CPython delivers one in the opening, once its
    backend has opened (trio raises Ctrl-C in whatever Python code its main task runs)
    -- as the Device is made, as an 'async with' records its entry -- either comes
    after the caller got the device, or closes what was opened: the backend, and the
    Device made of it. Checked: an interrupt as the 'async with' recorded its entry
    left the device open, never handed over."""
    codes = {_device.DeviceOpener._open.__code__, _device.DeviceOpener.__aenter__.__code__}
    at = 0
    while True:
        handed: list[am.Device] = []
        with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
            if how == "await":
                handed.append(await am.open_device("recordedcpu"))
            else:
                async with am.open_device("recordedcpu") as dev:
                    handed.append(dev)
        if how == "await" and handed:
            await handed[0].close()
        await _all_closed(recorded)
        assert bool(handed) != bool(raised), raised
        if not raised:
            break
        at += 1
    assert at >= 4


@pytest.mark.anyio
async def test_a_keyboard_interrupt_as_a_queue_is_made_leaves_none_unreleased(
    anyio_backend: object, device_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt wherever CPython delivers one in ``new_queue`` and the
    Queue's making (trio raises Ctrl-C in whatever Python code its task runs) -- once
    the backend made the native queue, before the device recorded it -- either comes
    after the caller got the queue, or leaves nothing of it: every native queue made is
    released, by the device's close at the latest (a cpu queue's thread stopped),
    except where the backend's new_queue returned it and it is not stored yet (nothing
    in Python can keep it there: see check_queue_making_interrupted).
    Checked failing before: an interrupt as Queue() returned into new_queue left the
    native queue (its thread) unreleased by the close."""
    async with am.open_device(device_name) as device:
        natives = type(device.queue._native)
    at = await check_queue_making_interrupted(
        monkeypatch,
        device_name,
        "new_queue",
        natives,
        lambda device: device.new_queue(),
    )
    assert at >= 8


@pytest.mark.anyio
async def test_a_keyboard_interrupt_in_a_wait_for_the_lock_as_a_queue_is_made_leaves_no_making(
    anyio_backend: object, device_name: str
) -> None:
    """A KeyboardInterrupt in each of ``new_queue``'s waits for the submission lock in
    turn (as Ctrl-C comes while other loops' threads submit to the device) leaves no
    queue counted as being made: the device's close, which waits until none is, ends.
    Checked: fails without the fix (the wait that takes the count back, interrupted,
    left it: the close waited for good)."""
    at = 0
    while True:
        device = await am.open_device(device_name)
        lock = InterruptedWait(device._state.submitting, at)
        device._state.submitting = lock
        made = None
        try:
            with contextlib.suppress(KeyboardInterrupt):
                made = device.new_queue()
        finally:
            device._state.submitting = lock.lock
        left = device._makings
        device._makings = 0  # (the close ends whatever was left)
        with anyio.fail_after(20):
            if made is None and lock.raised:
                await device.new_queue().marker()  # made again, whole
            await device.close()
        assert left == 0, f"the wait for the lock numbered {at} interrupted left a making"
        if not lock.raised:
            break
        at += 1
    assert at >= 2


@pytest.mark.anyio
async def test_a_keyboard_interrupt_as_collected_queues_are_released_loses_none(
    anyio_backend: object, device_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt wherever CPython delivers one as new_queue starts the
    release of a queue its owner dropped (collected, its reaper not come yet): the
    native queue is still released once, by the device's close at the latest.
    Checked failing before: one after the collected queues' natives were taken off the
    device's records, before their release thread started ('_take_dropped call
    <listcomp>', the first), left the native queue (a cpu queue's thread) never
    closed."""
    closed = await native_closes(monkeypatch, device_name)
    codes = {
        _device.Device.new_queue.__code__,
        _device.Device._release_done.__code__,
        _device.Device._take_dropped.__code__,
        _device.Device._start_release.__code__,
    }
    at = 0
    while True:
        device = await am.open_device(device_name)
        dropped = device.new_queue()
        native = dropped._native
        with device._state.submitting:  # (the reaper releases nothing meanwhile)
            device._mark_idle()  # (so that it is collected once dropped)
            del dropped
            gc.collect()
            assert device._dropped_queues
            gc.disable()  # (none runs a finalizer meanwhile: its interrupt would be reported)
            try:
                with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
                    device.new_queue()
            finally:
                gc.enable()
        with anyio.fail_after(20):
            await device.close()
        assert sum(native is c for c in closed) == 1, f"interrupted at {raised}"
        closed.clear()
        if not raised:
            break
        at += 1
    assert at >= 6


@pytest.mark.anyio
async def test_a_queue_close_a_keyboard_interrupt_stopped_is_ended_by_the_next(
    anyio_backend: object, device_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt wherever CPython delivers one in a queue's close (trio raises
    Ctrl-C in whatever Python code its task runs): closing the queue again returns once
    its native queue is released, as a close not interrupted does."""
    closed = await native_closes(monkeypatch, device_name)
    codes = {
        am.Queue.close.__code__,
        _device.Device._close_queue.__code__,
        _device.Device._release.__code__,
        _device.Device._claim_release.__code__,
        _device.Device._start_release.__code__,
    }
    at = 0
    while True:
        device = await am.open_device(device_name)
        queue = device.new_queue()
        native = queue._native
        with anyio.fail_after(20):
            with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
                await queue.close()
            await queue.close()  # (again: ends what the interrupt stopped)
            assert any(native is c for c in closed), f"interrupted at {raised}"
            await device.close()
        closed.clear()
        if not raised:
            break
        at += 1
    assert at >= 6


@pytest.mark.anyio
async def test_a_host_signal_as_the_device_closes_is_run_or_refused(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread host-signals a timeline that a queue waits on as the device
    closes, held between the signal's checks and its native signal until the close has
    ended or waits for it: either the signal is refused as the device is closed and the
    command behind the wait is abandoned, or the signal takes effect and the command
    runs (before: the close abandoned the command as one whose value "nobody
    signalled", and then the signal returned as done, raising the closed device's
    timeline)."""
    from asyncmetal import _timeline

    dev = await am.open_device("cpu:57")
    timeline = dev.timeline()
    queue = dev.new_queue()
    waited = queue.wait(timeline, 1)
    marker = queue.marker()
    checked, go, contended = threading.Event(), threading.Event(), threading.Event()
    monkeypatch.setattr(_timeline, "_signal_order", Contended(_timeline._signal_order, contended))
    native_signal = timeline.native.signal

    def held_signal(value: int) -> None:
        checked.set()
        go.wait(20)
        native_signal(value)

    monkeypatch.setattr(timeline.native, "signal", held_signal)
    outcome: list[BaseException | None] = []

    def signal() -> None:
        try:
            timeline.signal(1)
            outcome.append(None)
        except am.ClosedResourceError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=signal)
    thread.start()
    with anyio.fail_after(20):
        assert await anyio.to_thread.run_sync(checked.wait, 20)

        async def close() -> None:
            await dev.close()
            contended.set()  # (ended without waiting for the signal)

        async with anyio.create_task_group() as tg:
            tg.start_soon(close)
            await anyio.to_thread.run_sync(contended.wait, 20)
            go.set()
        await anyio.to_thread.run_sync(thread.join)
    assert len(outcome) == 1
    if outcome[0] is None:  # it took effect: what waited for it ran
        await waited
        await marker
    else:
        with pytest.raises(am.ClosedResourceError, match="never ran"):
            await marker
        assert timeline.value == 0


@pytest.mark.anyio
@pytest.mark.parametrize("command", ["wait", "signal", "launch", "copy"])
async def test_a_keyboard_interrupt_as_a_command_is_submitted_leaves_it_whole(
    anyio_backend: object, device_name: str, command: str
) -> None:
    """A KeyboardInterrupt wherever CPython delivers one as a command is submitted
    (trio raises Ctrl-C in whatever Python code its task runs) -- in the Queue's method,
    its submission, the backend's hook -- leaves the queue's numbering, the commands
    the backend has and the close's record of device waits and signals agreeing: a
    device wait submitted next is not reported done before its value is reached, a
    signal of the timeline is made or may still be made, and the device's close ends
    (abandoning what waits for a value nobody signals). Checked failing without: the
    value of a command the backend had taken was taken back, and the next command,
    given the same value, was reported done once the interrupted one was; a value
    taken but never handed over, or a device wait handed over but not recorded, left
    a close waiting for good."""
    source = MSL_KERNELS if device_name == "metal" else KERNELS
    at = 0
    while True:
        dev = await am.open_device(device_name)
        empty = await dev.compile(source, "empty")
        queue, gate, tl = dev.new_queue(), dev.timeline(), dev.timeline()
        queue._fast_launch = None  # (the Python path: the native one runs no Python code)
        buf = await dev.alloc(16)
        host = np.arange(4, dtype=np.int32)
        hook = {"wait": "wait", "signal": "signal", "launch": "launch", "copy": "copyin"}
        method = getattr(am.Queue, command)
        codes = {method.__code__, am.Queue._submit.__code__, am.Queue._wait.__code__}
        codes.add(getattr(type(queue._native), hook[command]).__code__)
        with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
            if command == "wait":
                queue.wait(gate, 1)  # (nobody signals it)
            elif command == "signal":
                queue.signal(tl, 1)
            elif command == "launch":
                queue.launch(empty)
            else:
                queue.copy(buf, host)
        held = queue.wait(gate, 2)
        after = queue.launch(empty)
        if command != "wait":  # (one for gate waits until the close)
            with anyio.fail_after(10):
                await queue.timeline.wait(held.value - 1)
        await anyio.sleep(0.02)  # (a command before the wait would have run by now)
        assert not held.done() and not after.done(), raised
        if command == "signal":
            if tl.value < 1:
                tl.signal(1)  # (not made: may be made now)
            with anyio.fail_after(10):
                await tl.wait(1)
        # The close abandons the waits for gate; from another thread, as it waits
        # shielded: one that waits for good must show as such here, not hang.
        closed = threading.Event()
        threading.Thread(target=_close_then_set, args=(dev, closed), daemon=True).start()
        with anyio.move_on_after(10):
            while not closed.is_set():
                await anyio.sleep(0.01)
        assert closed.is_set(), f"the close waits for good (interrupted at {raised})"
        with pytest.raises(am.ClosedResourceError):
            await after
        if not raised:
            break
        at += 1
    assert at >= 5


def _close_then_set(device: am.Device, closed: threading.Event) -> None:
    anyio.run(device.close)
    closed.set()


@pytest.mark.anyio
async def test_a_close_as_a_queue_is_made_releases_it_before_the_backend_and_says_so(
    anyio_backend: object, device_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close that seals the device while another thread's new_queue makes its native
    queue (outside the submission lock) waits for that making: the new_queue raises
    ClosedResourceError, and the native queue it made is released before the backend
    is closed -- nothing of it is left, nor used after its device's end."""
    device = await am.open_device(device_name)
    backend = type(device._backend)
    backend_make, backend_close = backend.new_queue, backend.close
    making, made = threading.Event(), threading.Event()
    order: list[object] = []

    def slow(self: Any, timeline: Any) -> Any:
        making.set()
        made.wait(10)
        native = backend_make(self, timeline)
        order.append(native)
        return native

    def closing(self: Any) -> None:
        order.append(list(closed))  # the native queues released by then
        backend_close(self)

    monkeypatch.setattr(backend, "new_queue", slow)
    monkeypatch.setattr(backend, "close", closing)
    closed = await native_closes(monkeypatch, device_name, type(device.queue._native))

    def sealed() -> None:
        time.sleep(0.1)
        assert not order  # the close waits for the making

    got = await closed_while_making(device, device.new_queue, making, made, sealed)
    assert isinstance(got, am.ClosedResourceError), got
    assert re.search(f"device {device_name} is closed", str(got))
    native, closed_by_then = order
    assert isinstance(closed_by_then, list)
    assert any(c is native for c in closed_by_then)  # released before the backend closed
    assert not device._makings


async def test_an_interrupted_hold_of_the_submission_locks_leaves_none_held(
    anyio_backend: object,
) -> None:
    """A KeyboardInterrupt wherever CPython delivers one in ``holding`` (the hold of
    devices' submission locks a close's count of what can complete takes, on the
    loop's thread where no other thread holds one): no lock stays held by the loop's
    thread. Checked failing before: one right after a lock was taken ('c_return
    acquire'), before it was named among those held, left it held, for good."""
    codes = {_device_state.holding.__code__}
    at = 0
    while True:
        async with am.open_device("cpu") as dev, am.open_device("cpu:1") as other:
            locks = [dev._state.submitting, other._state.submitting]
            with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
                await _device_state.holding([dev._state, other._state], lambda: None)
            held = [lock for lock in locks if lock._is_owned()]  # type: ignore[attr-defined]
            for lock in held:  # (let go, so that the devices close: then the test fails)
                lock.release()
            assert not held, f"interrupted at {raised}"
            assert all(free_elsewhere(lock) for lock in locks), f"interrupted at {raised}"
        if not raised:
            break
        at += 1
    assert at >= 4

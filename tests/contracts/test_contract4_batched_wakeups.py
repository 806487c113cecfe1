"""Contract 4: many waiters resolved by one completion cost about one loop wake-up."""

from __future__ import annotations

import asyncio
import threading
import time

import anyio
import anyio.lowlevel
import pytest

import asyncmetal as am
from tests.support.queues import held_queue
from tests.support.stress import park_all

pytestmark = pytest.mark.anyio


async def test_64_timeline_waiters_one_signal_one_wakeup(device: am.Device) -> None:
    tl = device.timeline()
    done: list[int] = []

    async def one(i: int) -> None:
        await tl.wait(1 + i % 3)
        done.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(64):
            tg.start_soon(one, i)
        while am.loop_statistics().waiting < 64:
            await anyio.sleep(0.001)
        before = am.loop_statistics()
        # Signal from another thread, as a device would: one wake-up must serve all 64.
        threading.Thread(target=tl.signal, args=(3,)).start()
    after = am.loop_statistics()
    assert sorted(done) == list(range(64))
    assert after.wakeups - before.wakeups == 1
    assert after.resolved - before.resolved == 64


async def test_64_launch_waiters_released_together(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    q, tl = held_queue(device)
    completions = [q.launch(kernels["empty"]) for _ in range(64)]
    async with anyio.create_task_group() as tg:
        for c in completions:
            tg.start_soon(c.wait)
        before = await park_all(completions)
        tl.signal(1)
        # Hold the loop (as a busy loop would be) while the queue thread finishes all 64:
        # their completions must then arrive as one wake-up, not 64 callbacks.
        deadline = time.monotonic() + 5
        while q.timeline.value < 64 and time.monotonic() < deadline:
            time.sleep(0.001)  # noqa: ASYNC251  # blocking on purpose
        # A queue raises its timeline before it wakes the loop: held a little longer,
        # the last command's wake-up is in before the loop looks.
        time.sleep(0.05)  # noqa: ASYNC251
    after = am.loop_statistics()
    assert after.resolved - before.resolved == 64
    assert after.wakeups - before.wakeups == 1


async def test_completions_during_a_busy_loop_are_batched(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """A loop busy with other work in slices while kernels complete: each wake-up must
    collect every completion of the slice, not one callback apiece. The slices and the
    completions are the test's: each slice releases a group of kernels (a host timeline
    the queue waits on) and holds the loop until the queue has finished them, as a busy
    loop would be held while they complete -- whatever the machine's load."""
    slices, per_slice = 20, 10
    q = device.new_queue()
    tl = device.timeline()
    groups: list[list[am.Completion]] = []
    for i in range(slices):
        q.wait(tl, i + 1)
        groups.append([q.launch(kernels["empty"]) for _ in range(per_slice)])
    completions = [c for group in groups for c in group]

    async def busy() -> None:
        for i, group in enumerate(groups):
            tl.signal(i + 1)
            deadline = time.monotonic() + 5
            while q.timeline.value < group[-1].value and time.monotonic() < deadline:
                time.sleep(0.001)  # noqa: ASYNC251  # blocking on purpose: a busy slice
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        for c in completions:
            tg.start_soon(c.wait)
        while am.loop_statistics().waiting < len(completions):
            await anyio.sleep(0.001)
        before = am.loop_statistics()
        tg.start_soon(busy)
        await completions[-1]  # (parks: the last group waits for the last slice's signal)
    after = am.loop_statistics()
    resolved, wakeups = after.resolved - before.resolved, after.wakeups - before.wakeups
    assert resolved == len(completions) + 1  # and our own wait for the last
    # About one per slice (twice that allowed: no test of the machine's timing); one
    # apiece would be about 200.
    assert wakeups <= 2 * slices, (wakeups, resolved)


async def test_no_wakeup_for_completions_nobody_awaits(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    before = am.loop_statistics()
    for _ in range(200):
        device.queue.launch(kernels["empty"])
    await anyio.sleep(0.05)
    assert device.queue.timeline.value == device.queue.submitted
    assert am.loop_statistics().wakeups == before.wakeups


@pytest.mark.parametrize("awake", [True, False], ids=["awake", "asleep"])
async def test_a_loop_kept_awake_sees_a_native_value_without_a_wake_up(
    device: am.Device, awake: bool
) -> None:
    """After a host signal that releases device work, the loop reads its native watches'
    timelines every iteration for a moment: a value raised there (here written in place,
    so nothing writes the loop's pipe) wakes its waiter with no wake-up at all."""
    import ctypes

    from asyncmetal import _bridge

    tl = device.timeline()
    c_timeline = tl.native.c_timeline
    assert c_timeline  # the cpu device's timelines live in the native runtime
    woken = anyio.Event()

    async def waiter() -> None:
        await tl.wait(1)
        woken.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        while am.loop_statistics().waiting < 1:
            await anyio.sleep(0.001)
        if awake:
            _bridge.stay_awake(2_000_000_000)
        ctypes.c_uint64.from_address(c_timeline).value = 1  # the value, first member
        with anyio.move_on_after(0.2):
            await woken.wait()
        assert woken.is_set() == awake
        if not awake:
            tl.signal(2)  # the waiter is still parked: wake it through the pipe
            await woken.wait()


@pytest.mark.parametrize("due_in", [1.0, 3.0], ids=["due-soon", "due-later"])
async def test_a_crowd_parked_on_a_command_due_soon_keeps_the_loop_awake(
    device: am.Device, monkeypatch: pytest.MonkeyPatch, due_in: float
) -> None:
    """A crowd's tasks park at once; parked on a command the queue expects done within
    ``AWAKE_DUE_NS``, they keep the loop reading their timeline in each iteration, so
    the value (here written in place: nothing writes the loop's pipe) wakes them with no
    wake-up. Due later, the loop sleeps until woken. (Scaled to seconds: the constant
    and the queue's prediction are patched.) Checked: without it, due soon fails."""
    import ctypes

    from asyncmetal import _native, _timeline

    monkeypatch.setattr(_timeline, "AWAKE_DUE_NS", 2_000_000_000, raising=False)
    monkeypatch.setattr(_native, "due", lambda c, v: time.perf_counter_ns() + int(due_in * 1e9))
    tl = device.timeline()
    c_timeline = tl.native.c_timeline
    assert c_timeline  # the cpu device's timelines live in the native runtime
    n = _timeline.CROWD + 4
    woken = 0

    async def waiter() -> None:
        nonlocal woken
        await tl.wait(1)
        woken += 1

    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(waiter)
        while am.loop_statistics().waiting < n:
            await anyio.lowlevel.checkpoint()
        ctypes.c_uint64.from_address(c_timeline).value = 1  # the value, first member
        with anyio.move_on_after(0.5):
            while woken < n:
                await anyio.sleep(0.001)
        assert woken == (n if due_in < 2 else 0)
        if woken < n:
            tl.signal(2)  # still parked: wake them through the pipe
    assert woken == n


@pytest.mark.parametrize(
    ("awaited", "awake_s", "cap_s", "after_s", "wakes"),
    [
        (1, 2.0, 3.0, 0.0, True),
        (2, 2.0, 3.0, 0.0, False),
        (1, 0.05, 3.0, 0.2, False),
        (1, 2.0, 0.05, 0.2, False),
    ],
    ids=["near-its-value", "near-a-value-before-it", "past-the-time-asked", "past-the-cap"],
)
async def test_a_loop_woken_ahead_of_a_value_stays_awake_until_the_time_asked(
    device: am.Device,
    monkeypatch: pytest.MonkeyPatch,
    awaited: int,
    awake_s: float,
    cap_s: float,
    after_s: float,
    wakes: bool,
) -> None:
    """A completion thread that napped through most of a long command wakes the loops
    waiting for it ahead of its end (``am_timeline_near``), asking them to read the
    timeline in each iteration until shortly after: a sleeping loop takes tens of
    microseconds to wake. Here the value then comes in place (nothing writes the pipe):
    a task parked on it wakes while the loop is kept awake -- not when the work near
    its end is not what it awaits, nor once the time asked is past (the loop sleeps
    again), nor past ``AHEAD_AWAKE_NS`` whatever the time asked. Checked: without it,
    the first fails."""
    import ctypes

    from asyncmetal import _bridge, _native

    monkeypatch.setattr(_bridge, "AHEAD_AWAKE_NS", int(cap_s * 1e9))  # (scaled to seconds)
    lib = await anyio.to_thread.run_sync(_native.runtime)
    tl = device.timeline()
    c_timeline = tl.native.c_timeline
    assert c_timeline  # the cpu device's timelines live in the native runtime
    woken = anyio.Event()

    async def waiter() -> None:
        await tl.wait(awaited)
        woken.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        while am.loop_statistics().waiting < 1:
            await anyio.lowlevel.checkpoint()
        await anyio.sleep(0.01)  # parked, and the loop asleep
        lib.am_timeline_near(c_timeline, 1, time.perf_counter_ns() + int(awake_s * 1e9))
        await anyio.sleep(after_s or 0.01)
        ctypes.c_uint64.from_address(c_timeline).value = awaited  # the value, first member
        with anyio.move_on_after(0.5):
            await woken.wait()
        assert woken.is_set() == wakes
        if not wakes:
            tl.signal(awaited + 1)  # still parked: wake it through the pipe
    assert woken.is_set()


async def test_a_watch_left_empty_goes_after_the_woken_tasks_have_run(
    device: am.Device,
) -> None:
    """The loop lets go of a timeline's watch that its last waiter left (freeing its
    native part) only after the woken tasks have run: not on their way to running."""
    from asyncmetal import _bridge

    tl = device.timeline()
    bridge = _bridge.current_bridge()
    seen: list[object] = []

    async def waiter() -> None:
        await tl.wait(1)
        seen.append(tl._watch_of.get(bridge))  # the first thing it does once woken

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        watch = tl._watch_of.get(bridge)
        assert watch is not None
        tl.signal(1)
    assert seen == [watch]
    for _ in range(6):
        await anyio.lowlevel.checkpoint()
    assert tl._watch_of.get(bridge) is None


async def test_a_wait_added_to_a_watch_about_to_go_keeps_it(device: am.Device) -> None:
    """A wait is added to a timeline's watch that its last waiter has just left (the watch
    is to go two turns of the loop later): the watch stays, and the new wait ends at the
    timeline's next signal; the watch goes once that wait left it too."""
    from asyncmetal import _bridge, _timeline

    tl = device.timeline()
    bridge = _bridge.current_bridge()
    watches: list[object] = []
    reached = anyio.Event()

    def at_2() -> None:
        watches.append(tl._watch_of.get(bridge))
        reached.set()

    async def first() -> None:
        await tl.wait(1)
        # Woken: the watch is empty and about to go. Wait on it again, at once.
        watches.append(tl._watch_of.get(bridge))
        _timeline.call_when_reached(tl, 2, at_2)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await anyio.wait_all_tasks_blocked()
            watch = tl._watch_of[bridge]
            tl.signal(1)
        for _ in range(6):  # past the turns at which an empty watch goes
            await anyio.lowlevel.checkpoint()
        assert tl._watch_of.get(bridge) is watch  # kept: a wait is on it
        threading.Thread(target=tl.signal, args=(2,)).start()
        await reached.wait()
    assert watches == [watch, watch]
    for _ in range(6):
        await anyio.lowlevel.checkpoint()
    assert tl._watch_of.get(bridge) is None


async def test_a_host_signal_on_the_loop_wakes_its_tasks_as_it_returns(
    device: am.Device,
) -> None:
    """A task of the loop signals a timeline its other tasks wait on: they are woken by
    the signal itself, as ``Event.set`` wakes, and run in the loop's next iteration --
    before the signalling task's second checkpoint returns. Checked failing without (on
    asyncio, at once; on trio, by chance): they were woken only once the loop had seen
    its pipe, an iteration later."""
    tl = device.timeline()
    woken: list[int] = []

    async def waiter(v: int) -> None:
        await tl.wait(v)
        woken.append(v)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for v in (1, 2, 2, 3):
                tg.start_soon(waiter, v)
            await anyio.wait_all_tasks_blocked()
            tl.signal(2)
            assert woken == []  # (woken, not run: nothing runs inside the signal)
            await anyio.lowlevel.checkpoint()
            await anyio.lowlevel.checkpoint()
            assert sorted(woken) == [1, 2, 2]
            tl.signal(3)
    assert sorted(woken) == [1, 2, 2, 3]


async def test_a_host_signal_on_the_loop_leaves_its_own_pipe_out(anyio_backend: object) -> None:
    """A task's host signal of a timeline other tasks of its loop wait on wakes them in
    the call, so the native signal writes no byte to that loop's own pipe: no wake-up
    through it follows (``loop_statistics().wakeups``), also for tasks woken in the
    loop's next slices (more than a slice reached at once). Checked failing without
    (a wake-up through the pipe after each signal)."""
    from asyncmetal import _bridge

    woken: list[int] = []
    async with am.open_device("cpu") as device:
        tl = device.timeline()

        async def waiter(v: int) -> None:
            await tl.wait(v)
            woken.append(v)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                for v in [1, *[2] * (2 * _bridge.WAKE_SLICE)]:
                    tg.start_soon(waiter, v)
                await anyio.wait_all_tasks_blocked()
                before = am.loop_statistics().wakeups
                tl.signal(1)
                while woken != [1]:
                    await anyio.lowlevel.checkpoint()
                tl.signal(2)
                while len(woken) < 1 + 2 * _bridge.WAKE_SLICE:
                    await anyio.lowlevel.checkpoint()
                for _ in range(10):  # (where a byte was written, the loop has read it)
                    await anyio.lowlevel.checkpoint()
                assert am.loop_statistics().wakeups == before


async def test_a_host_signal_from_another_loops_task_wakes_both_loops(
    anyio_backend: object,
) -> None:
    """Tasks of two loops, each on its own thread, wait on one timeline; a task of the
    other loop signals it and then holds its thread: this loop's task is woken through
    this loop's pipe meanwhile (only the signalling loop's own pipe is left out), and
    the other loop's, woken in the signal's call, runs once its thread goes on."""
    other_woken = threading.Event()
    go_on = threading.Event()
    errors: list[BaseException] = []
    async with am.open_device("cpu") as device:
        tl = device.timeline()

        def other_loop() -> None:
            async def main() -> None:
                async def waiter() -> None:
                    await tl.wait(1)
                    other_woken.set()

                task = asyncio.ensure_future(waiter())
                while am.loop_statistics().waiting < 1:
                    await asyncio.sleep(0)
                tl.signal(1)
                go_on.wait(5)  # the loop held (blocking on purpose)
                await task

            try:
                asyncio.run(main())
            except BaseException as exc:  # (asserted on below)
                errors.append(exc)

        with anyio.fail_after(5):
            thread = threading.Thread(target=other_loop)
            thread.start()
            try:
                await tl.wait(1)
                assert not other_woken.is_set()  # (its loop is held)
            finally:
                go_on.set()
                await anyio.to_thread.run_sync(thread.join)
    assert errors == []
    assert other_woken.is_set()


async def test_a_host_signal_interrupted_on_the_loop_still_wakes_its_tasks(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C that lands in a task's host signal after the value was raised and
    before the signal woke the loop's tasks it reached: with that loop's pipe left out
    of the signal, the loop looks at them in its next slice instead, and they wake.
    Checked failing without (they were never woken)."""
    from asyncmetal import _bridge

    woken: list[int] = []
    async with am.open_device("cpu") as device:
        tl = device.timeline()

        async def waiter() -> None:
            await tl.wait(1)
            woken.append(1)

        def interrupted(self: _bridge.LoopBridge, watch: _bridge.Watch) -> None:
            raise KeyboardInterrupt

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await anyio.wait_all_tasks_blocked()
                for bridge in (_bridge._AsyncioBridge, _bridge._TrioBridge):
                    monkeypatch.setattr(bridge, "wake_now", interrupted)
                with pytest.raises(KeyboardInterrupt):
                    tl.signal(1)
                monkeypatch.undo()
                assert tl.value == 1
    assert woken == [1]


@pytest.mark.parametrize("timelines", [1, 64], ids=["one-timeline", "a-timeline-each"])
async def test_a_crowd_reached_signal_by_signal_in_one_step_is_woken_in_slices(
    device: am.Device, timelines: int
) -> None:
    """A task raises, in one step, the values 64 tasks of its loop wait for, one signal
    for each (of one timeline, or of a timeline each): the signals wake a slice of them
    at most, and the rest are woken in slices, an iteration of the loop apiece -- not
    all 64 in the loop's next iteration, however many signals reached them. Checked
    failing without (all 64 ran before the signalling task's first checkpoint returned:
    each signal woke what it reached with a slice of its own)."""
    from asyncmetal import _bridge

    tls = [device.timeline() for _ in range(timelines)]
    woken: list[int] = []

    async def waiter(i: int) -> None:
        await tls[i % timelines].wait(i // timelines + 1)
        woken.append(i)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for i in range(64):
                tg.start_soon(waiter, i)
            await anyio.wait_all_tasks_blocked()
            for i in range(64):
                tls[i % timelines].signal(i // timelines + 1)
            runs = []  # how many have run, after each checkpoint of this task
            while len(woken) < 64:
                await anyio.lowlevel.checkpoint()
                runs.append(len(woken))
    steps = [b - a for a, b in zip([0, *runs], runs, strict=False)]
    # (a slice woken by the signals, and one by the loop, between two checkpoints)
    assert max(steps) <= 2 * _bridge.WAKE_SLICE, runs
    assert sorted(woken) == list(range(64))


@pytest.mark.parametrize("anyio_backend", [pytest.param("trio", id="trio")])
async def test_a_host_signal_wakes_its_trio_tasks_where_a_ctrl_c_is_held_off(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On trio, the tasks a host signal wakes in the signalling task's step are taken off
    their watch's heap with KeyboardInterrupt protection on, as the bridge's other
    wake-ups run: a Ctrl-C delivered between a pop and its entry marked done would lose
    the wait. Checked failing without (unprotected)."""
    import trio

    from asyncmetal import _bridge

    protected: list[bool] = []
    resolve = _bridge.Watch.resolve

    def recording(self: _bridge.Watch, budget: int, calls: bool = True) -> int:
        protected.append(trio.lowlevel.currently_ki_protected())
        return resolve(self, budget, calls)

    async with am.open_device("cpu") as device:
        tl = device.timeline()
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(tl.wait, 1)
                await anyio.wait_all_tasks_blocked()
                monkeypatch.setattr(_bridge.Watch, "resolve", recording)
                tl.signal(1)
                monkeypatch.undo()
    assert protected[:1] == [True]


async def test_a_callback_waiting_is_not_run_inside_a_host_signal(device: am.Device) -> None:
    """A callback waiting on a timeline (``call_when_reached``) is run by the loop after a
    host signal reached it, never inside the signal's call, also when the signal comes
    from the loop's own thread; the tasks waiting behind it still wake."""
    from asyncmetal import _timeline

    tl = device.timeline()
    order: list[str] = []

    async def waiter() -> None:
        await tl.wait(1)
        order.append("task")

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            _timeline.call_when_reached(tl, 1, lambda: order.append("callback"))
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            tl.signal(1)
            order.append("signalled")
    assert order[0] == "signalled"
    assert sorted(order[1:]) == ["callback", "task"]


async def test_a_callback_that_raises_does_not_stop_the_wakeups_after_it(
    device: am.Device, caplog: pytest.LogCaptureFixture
) -> None:
    """Of three waits for value 1 -- a callback that raises (``call_when_reached``),
    a task, another callback -- the two after the raising one still wake, and the
    error is logged ("asyncmetal"). Checked: without the guard the drain stopped at the
    raise and the task waited for good."""
    from asyncmetal import _timeline

    tl = device.timeline()
    woken: list[str] = []

    def raising() -> None:
        raise ValueError("a callback's own error")

    async def waiter() -> None:
        await tl.wait(1)
        woken.append("task")

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            _timeline.call_when_reached(tl, 1, raising)
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            _timeline.call_when_reached(tl, 1, lambda: woken.append("callback"))
            threading.Thread(target=tl.signal, args=(1,)).start()
    assert sorted(woken) == ["callback", "task"]
    assert any(
        r.name == "asyncmetal" and r.exc_info and isinstance(r.exc_info[1], ValueError)
        for r in caplog.records
    )


def test_a_callback_raising_a_base_exception_leaves_the_waits_after_it_to_a_slice() -> None:
    """A callback waiting for value 1 raises KeyboardInterrupt, which goes on up out of
    the loop (as a Ctrl-C would); a task parked for the same value behind it wakes once
    the loop runs again. Checked: without putting the watch back, it stayed parked
    (``next`` at the reached value, the watch off the queue: nothing drained it)."""
    from asyncmetal import _timeline

    loop = asyncio.new_event_loop()
    dev = loop.run_until_complete(am.open_device("cpu"))
    try:
        tl = dev.timeline()

        def interrupt() -> None:
            raise KeyboardInterrupt

        async def setup() -> asyncio.Task[None]:
            _timeline.call_when_reached(tl, 1, interrupt)
            task = asyncio.ensure_future(tl.wait(1))
            await asyncio.sleep(0.01)  # parked behind the callback
            return task

        task = loop.run_until_complete(setup())
        threading.Thread(target=tl.signal, args=(1,)).start()
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(task)
        loop.run_until_complete(asyncio.wait_for(asyncio.shield(task), 5))
    finally:
        loop.run_until_complete(dev.close())
        loop.close()

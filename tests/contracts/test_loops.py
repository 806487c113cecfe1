"""Event loops: uvloop, several loops in several threads on one device, loop shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import selectors
import subprocess
import sys
import textwrap
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np
import pytest
import trio
import trio.testing

import asyncmetal as am
from tests.support.kernels import KERNELS
from tests.support.loops import dropped_with_parked_waits, signalled_wait

uvloop = pytest.importorskip("uvloop", reason="uvloop is not built for this platform")


async def _exercise(device_name: str = "cpu") -> am.LoopStatistics:
    async with am.open_device(device_name) as dev:
        add = await dev.compile(KERNELS, "add")
        n = 256
        a, out = await dev.alloc(4 * n), await dev.alloc(4 * n)
        await a.write(np.arange(n, dtype=np.float32))
        await dev.queue.launch(add, out, a, a, vals=(n,))
        np.testing.assert_array_equal(await out.read(np.float32), 2 * np.arange(n))
        tl = dev.timeline()
        before = am.loop_statistics()
        async with anyio.create_task_group() as tg:
            for i in range(64):
                tg.start_soon(tl.wait, 1 + i % 4)
            while am.loop_statistics().waiting < 64:
                await anyio.sleep(0.001)
            threading.Thread(target=tl.signal, args=(4,)).start()
        after = am.loop_statistics()
        assert after.resolved - before.resolved == 64
        return after


def test_uvloop() -> None:
    stats = uvloop.run(_exercise())
    assert stats.wakeups >= 1


@pytest.mark.asyncio
async def test_pytest_asyncio_strict_mode() -> None:
    await _exercise()


def test_a_trio_guest_run_on_an_asyncio_loop_awaits_as_trio_beside_the_hosts_tasks() -> None:
    """``trio.lowlevel.start_guest_run``: trio's tasks run inside the asyncio loop's
    callbacks, on its thread, where asyncio's running loop is the host's. A trio task's
    awaits go through trio (asyncio's bare yield would end its run with a TypeError),
    the host's tasks' through asyncio, at the same time."""

    async def host() -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        trio.lowlevel.start_guest_run(
            _exercise,
            "cpu:1",
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            run_sync_soon_not_threadsafe=loop.call_soon,
            done_callback=done.set_result,
            host_uses_signal_set_wakeup_fd=True,
        )
        hosted = await _exercise("cpu")
        guest = (await done).unwrap()
        assert hosted.resolved >= 64 and guest.resolved >= 64

    asyncio.run(host())


def test_loops_taking_turns_on_one_thread_each_count_their_own_waiting_tasks() -> None:
    """The crowd count (turns and slices start from 16 waiting tasks) is per loop: a
    loop run again after another ran on the thread finds its tasks still counted
    (before: it started from 0, and a crowd of it was not treated as one)."""
    from asyncmetal import _timeline

    async def waiting() -> int:
        return _timeline.waiting_here()

    loops = [asyncio.new_event_loop() for _ in range(3)]
    try:
        dev = loops[0].run_until_complete(am.open_device("cpu"))
        timeline = dev.timeline()
        crowds = [
            [loop.create_task(timeline.wait(1)) for _ in range(n)]
            for loop, n in zip(loops, (20, 5, 17), strict=True)
        ]
        for loop in loops:
            loop.run_until_complete(asyncio.sleep(0.01))
        for _ in range(2):
            assert [loop.run_until_complete(waiting()) for loop in loops] == [20, 5, 17]
        timeline.signal(1)
        for loop, crowd in zip(reversed(loops), reversed(crowds), strict=True):
            loop.run_until_complete(asyncio.gather(*crowd))
        assert [loop.run_until_complete(waiting()) for loop in loops] == [0, 0, 0]
        loops[0].run_until_complete(dev.close())
    finally:
        for loop in loops:
            loop.close()


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # (the dropped loop, unclosed)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_wait_resumed_after_another_loop_ran_on_its_thread_sets_that_loops_waits_aside() -> None:
    """A task's wait yielded as its loop stopped; another loop ran on the thread, parked
    10 tasks and was dropped unclosed; the first loop, run again, parks that wait. Its
    park notes the switch back (``_bridge._switch_here``), as the first wait there of any
    other task would: the dropped loop's waits are set aside and it is garbage. Checked
    failing at 9273091 (the wait's count, kept from before the other loop ran, had the
    bridge at hand and asked for none: the timeline held the dropped loop)."""
    boot = asyncio.new_event_loop()
    try:
        dev = boot.run_until_complete(am.open_device("cpu"))
        timeline = dev.timeline()

        boot.run_until_complete(
            signalled_wait(timeline, 1)
        )  # (a park: boot's count has its bridge)
        started: list[asyncio.Task[None]] = []

        async def start() -> None:  # its wait's first step, a yield, as boot stops
            started.append(asyncio.ensure_future(timeline.wait(2)))

        boot.run_until_complete(start())
        dropped = dropped_with_parked_waits(timeline)

        async def finish() -> None:  # (no wait of its own: the resumed one parks alone)
            await asyncio.sleep(0.01)
            timeline.signal(2)
            await asyncio.wait_for(started[0], 5)

        boot.run_until_complete(finish())
        for _ in range(3):
            gc.collect()
        assert dropped() is None
        boot.run_until_complete(dev.close())
    finally:
        boot.close()


def test_outside_a_loop_the_error_is_asyncmetals() -> None:
    """loop_statistics(), awaiting nothing, says where to call it (checked: it said
    that asyncmetal must be awaited)."""
    for _ in range(2):  # with trio imported and not running, and again
        with pytest.raises(
            am.NoLoopError, match=r"^loop_statistics.* call it from a task of asyncio, uvloop or"
        ):
            am.loop_statistics()
    assert issubclass(am.NoLoopError, RuntimeError)


def test_awaited_outside_a_loop_the_error_is_asyncmetals() -> None:
    """An await driven by something other than asyncio, uvloop or trio (a coroutine
    sent to by hand, another framework's runner) raises NoLoopError at its first step,
    whether its value is reached or not (it yielded one of trio's traps to the caller)."""
    loop = asyncio.new_event_loop()

    async def awaiting(awaitable: Awaitable[Any]) -> Any:
        return await awaitable

    try:
        dev = loop.run_until_complete(am.open_device("cpu"))
        tl = dev.timeline()
        queue = dev.new_queue()
        # (also the awaits that begin with a call on a worker thread or a close: an
        # open, a compile, the pool's close, a queue's, the device's -- checked: they
        # raised anyio's NoEventLoopError, and the queue and the device were closed)
        for awaited in (
            tl.wait(1),
            tl.wait(0),
            dev.queue.marker().wait(),
            awaiting(am.open_device("cpu")),
            awaiting(dev.compile(KERNELS, "empty")),
            awaiting(dev.compile_pool.aclose()),
            awaiting(queue.close()),
            awaiting(dev.close()),
        ):
            with pytest.raises(am.NoLoopError, match="awaited from asyncio, uvloop or trio"):
                awaited.send(None)
            awaited.close()
        assert not dev.closed
        loop.run_until_complete(awaiting(queue.marker()))  # (the queue still open)
        loop.run_until_complete(dev.close())
    finally:
        loop.close()


def test_several_loops_in_several_threads_share_a_device() -> None:
    async def main() -> None:
        async with am.open_device("cpu") as dev:
            empty = await dev.compile(KERNELS, "empty")
            tl = dev.timeline()
            queue = dev.new_queue()
            errors: list[BaseException] = []
            counts: list[int] = []

            async def user() -> None:
                for _ in range(300):
                    await queue.launch(empty)
                await tl.wait(1)
                counts.append(1)

            def in_thread(kind: str) -> None:
                try:
                    if kind == "trio":
                        trio.run(user)
                    elif kind == "uvloop":
                        uvloop.run(user())
                    else:
                        asyncio.run(user())
                except BaseException as exc:  # reported below
                    errors.append(exc)

            threads = [
                threading.Thread(target=in_thread, args=(k,))
                for k in ["asyncio", "trio", "uvloop", "asyncio", "trio"]
            ]
            for t in threads:
                t.start()
            await anyio.sleep(0.2)
            tl.signal(1)
            for t in threads:
                await anyio.to_thread.run_sync(t.join)
            assert not errors, errors
            assert len(counts) == len(threads)
            assert queue.timeline.value == queue.submitted == 300 * len(threads)

    asyncio.run(main())


def test_loop_closed_with_waiters_pending_gets_no_callbacks() -> None:
    loop = asyncio.new_event_loop()
    dev = loop.run_until_complete(am.open_device("cpu"))
    tl = dev.timeline()
    empty = loop.run_until_complete(dev.compile(KERNELS, "empty"))
    q = dev.new_queue()
    q.wait(tl, 1)
    pending = q.launch(empty)
    waiter = loop.create_task(pending.wait())
    waiter._log_destroy_pending = False  # type: ignore[attr-defined]  # left pending on purpose
    loop.run_until_complete(asyncio.sleep(0.05))  # the waiter is parked on the bridge
    assert not waiter.done()
    loop.close()  # closed with the waiter pending; Task destroyed warnings are expected
    tl.signal(1)  # the queue now completes: the dead loop must not be called
    done = q.wait(tl, 1)
    while not done.done():
        pass
    del waiter
    gc.collect()

    async def finish() -> None:
        await dev.close()

    asyncio.run(finish())


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_interpreter_exit_with_work_and_waiters_pending(loop: str) -> None:
    script = textwrap.dedent(
        f"""
        import asyncmetal as am, anyio, threading

        async def main():
            dev = await am.open_device("cpu")
            k = await dev.compile("void k(int* x) {{ x[0] += 1; }}", "k")
            buf = await dev.alloc(4)
            tl = dev.timeline()
            dev.queue.wait(tl, 1)          # never signalled: the queue stays blocked
            done = dev.queue.launch(k, buf)
            q2 = dev.new_queue()
            for _ in range(1000):
                q2.launch(k, buf)          # work still in flight at exit
            async with anyio.create_task_group() as tg:
                tg.start_soon(done.wait)   # a waiter left parked
                await anyio.sleep(0.05)
                tg.cancel_scope.cancel()
            print("exiting")

        anyio.run(main, backend={loop!r})
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "exiting"
    assert proc.stderr == ""


def test_each_loop_in_each_thread_is_given_its_own_bridge() -> None:
    """current_bridge() keeps the last asyncio loop's bridge at hand: with loops in two
    threads asking in turn, and with loops made anew (possibly where a closed one was),
    each gets its own live bridge, never another loop's."""
    from asyncmetal import _bridge

    wrong: list[str] = []
    turn = [threading.Event(), threading.Event()]

    def in_thread(i: int) -> None:
        async def ask() -> None:
            loop = asyncio.get_running_loop()
            for _ in range(50):
                turn[i].wait(5)
                turn[i].clear()
                bridge = _bridge.current_bridge()
                if bridge._loop_ref() is not loop or bridge.dead:  # type: ignore[attr-defined]
                    wrong.append(f"thread {i}")
                turn[1 - i].set()

        for _ in range(3):
            asyncio.run(ask())
            gc.collect()  # a new loop may then be made where this one was

    threads = [threading.Thread(target=in_thread, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    turn[0].set()
    for t in threads:
        t.join(30)
    assert not wrong, wrong


def _wake_then_sleep_half_a_millisecond(
    tl: am.Timeline, sleep: Callable[[float], Awaitable[None]]
) -> Callable[[], Awaitable[None]]:
    """A task woken through the bridge's pipe that then sleeps 0.5 ms: a timer due within
    the millisecond the bridge holds the loop for."""

    async def woken_then_sleeps() -> None:
        value = tl.value + 1
        threading.Timer(0.01, tl.signal, args=(value,)).start()
        await tl.wait(value)
        await sleep(0.0005)

    return woken_then_sleeps


class _VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on virtual time (as pytest's looptime makes one): where it would
    sleep until a timer, its clock jumps there instead; only a wait for I/O alone
    blocks."""

    def __init__(self) -> None:
        super().__init__(selectors.PollSelector())  # whole milliseconds: the bridge holds
        self.virtual = 0.0
        select = self._selector.select  # type: ignore[attr-defined]

        def select_on_virtual_time(timeout: float | None = None) -> Any:
            if timeout is not None and timeout > 0:
                self.virtual += timeout
                timeout = 0
            return select(timeout)

        self._selector.select = select_on_virtual_time  # type: ignore[attr-defined]

    def time(self) -> float:
        return self.virtual


def test_a_loop_on_virtual_time_is_not_held_forever() -> None:
    """Loops whose clock stands still while they poll -- trio's MockClock with autojump,
    an asyncio loop on virtual time -- advance it only when they would sleep: a
    wake-up just before a timer must not keep them polling until that timer is due
    (it never would be), only for as long in real time."""

    async def on_trio() -> bool:
        async with am.open_device("cpu") as dev:
            with trio.CancelScope() as scope:
                token = trio.lowlevel.current_trio_token()
                watchdog = threading.Timer(10, token.run_sync_soon, args=(scope.cancel,))
                watchdog.start()
                await _wake_then_sleep_half_a_millisecond(dev.timeline(), trio.sleep)()
            watchdog.cancel()
            return not scope.cancelled_caught

    assert trio.run(on_trio, clock=trio.testing.MockClock(autojump_threshold=0))

    async def on_asyncio() -> bool:
        async with am.open_device("cpu") as dev:
            woken = _wake_then_sleep_half_a_millisecond(dev.timeline(), asyncio.sleep)
            task = asyncio.ensure_future(woken())
            loop = asyncio.get_running_loop()
            watchdog = threading.Timer(10, loop.call_soon_threadsafe, args=(task.cancel,))
            watchdog.start()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            watchdog.cancel()
            return not task.cancelled()

    loop = _VirtualTimeLoop()
    try:
        assert loop.run_until_complete(on_asyncio())
    finally:
        loop.close()


def test_a_completion_as_a_trio_run_ends_leaves_the_run_to_end() -> None:
    """A completion that reaches a waited value while trio shuts its run down: the wake-up
    may run among the run's last callbacks, where asking for another raises
    RunFinishedError. The bridge takes that for the run's end; trio must not turn it
    into a TrioInternalError."""
    from asyncmetal._timeline import HostEvents

    async def main() -> None:
        events = HostEvents()  # notified from Python, not through the bridge's pipe
        with trio.move_on_after(0.001):
            await events.wait(1)  # parks, then is cancelled: the watch still waits for 1

        async def completes_as_the_run_ends() -> None:
            try:
                await trio.sleep_forever()
            finally:  # system tasks are cancelled as the run ends
                events.increment()

        trio.lowlevel.spawn_system_task(completes_as_the_run_ends)
        await trio.lowlevel.checkpoint()

    for _ in range(20):  # where among trio's last callbacks the wake-up runs varies
        trio.run(main)


def test_on_trio_the_look_for_a_timer_does_not_walk_the_runs_sockets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After each wake-up the bridge looks (a few times) for trio's next deadline.
    trio.lowlevel.current_statistics() gives it, but also counts every file descriptor
    the run waits on -- a server's thousands of sockets, at every look -- so the bridge
    reads the deadline alone: the I/O manager's statistics are never asked for."""
    from trio._core._run import GLOBAL_RUN_CONTEXT

    counted = [0]

    async def main() -> None:
        manager = type(GLOBAL_RUN_CONTEXT.runner.io_manager)
        statistics = manager.statistics

        def counting(self: Any) -> Any:
            counted[0] += 1
            return statistics(self)

        monkeypatch.setattr(manager, "statistics", counting)
        async with am.open_device("cpu") as dev:
            tl = dev.timeline()
            for _ in range(5):  # each wake-up looks, then holds for the 0.5 ms sleep
                await _wake_then_sleep_half_a_millisecond(tl, trio.sleep)()

    trio.run(main)
    assert counted[0] == 0


def test_an_asyncio_await_while_another_thread_imports_trio(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An await on an asyncio loop asks whether it runs as a trio task where trio is in
    ``sys.modules``; a trio another thread is still importing is there without its
    attributes. That is no trio task (it raised AttributeError out of the await)."""
    import types

    from asyncmetal import _bridge

    monkeypatch.setitem(sys.modules, "trio", types.ModuleType("trio"))  # half imported
    monkeypatch.setattr(_bridge, "_trio_run_context", None)

    async def main() -> None:
        async with am.open_device("cpu") as dev:
            empty = await dev.compile(KERNELS, "empty")
            await dev.queue.launch(empty)

    asyncio.run(main())


def _shielded_wait_with_watchdog(
    awaited: Callable[[], Awaitable[None]], woke: list[bool]
) -> Callable[[], Awaitable[None]]:
    """A wait in a shielded scope (what a cleanup does as a trio run ends) that a
    watchdog cancels after 10 s: ``woke`` says whether it ended by itself."""

    async def wait() -> None:
        with trio.CancelScope(shield=True), trio.CancelScope() as inner:
            token = trio.lowlevel.current_trio_token()
            watchdog = threading.Timer(10, token.run_sync_soon, args=(inner.cancel,))
            watchdog.start()
            try:
                await awaited()
            finally:
                watchdog.cancel()
        woke.append(not inner.cancelled_caught)

    return wait


async def _a_launch_released_later(
    dev: am.Device, tl: am.Timeline, empty: am.Program, woke: list[bool]
) -> None:
    """Await, shielded (with a watchdog), a launch on a new queue behind a wait for
    ``tl``'s 1, which a thread signals 50 ms later."""
    queue = dev.new_queue()
    queue.wait(tl, 1)
    pending = queue.launch(empty)
    threading.Timer(0.05, tl.signal, args=(1,)).start()
    await _shielded_wait_with_watchdog(pending.wait, woke)()


def test_a_system_tasks_cleanup_as_the_trio_run_ends_is_woken() -> None:
    """trio cancels its system tasks together as the run ends, the bridge's pipe reader
    among them. Another system task's shielded cleanup that awaits a command then is
    still woken when the command is done (it stayed parked for good: the run never
    ended)."""
    woke: list[bool] = []
    opened: list[Any] = [None]

    async def main() -> None:
        dev = opened[0] = await am.open_device("cpu")
        empty = await dev.compile(KERNELS, "empty")
        tl = dev.timeline()
        await dev.queue.launch(empty)  # the bridge's reader of its pipe runs

        async def cleans_up_as_the_run_ends() -> None:
            try:
                await trio.sleep_forever()
            finally:  # system tasks are cancelled as the run ends
                await _a_launch_released_later(dev, tl, empty, woke)

        trio.lowlevel.spawn_system_task(cleans_up_as_the_run_ends)
        await trio.lowlevel.checkpoint()

    trio.run(main)
    asyncio.run(opened[0].close())
    assert woke == [True]


def test_an_async_generator_finalized_as_the_trio_run_ends_is_woken() -> None:
    """trio finalizes the async generators left unfinished once its system tasks (the
    bridge's pipe reader among them) have ended: a generator's cleanup that awaits a
    command (shielded: a device's close is) is still woken when it is done."""
    woke: list[bool] = []
    opened: list[Any] = [None]
    left: list[Any] = []

    async def main() -> None:
        dev = opened[0] = await am.open_device("cpu")
        empty = await dev.compile(KERNELS, "empty")
        tl = dev.timeline()
        await dev.queue.launch(empty)  # the bridge's reader of its pipe runs

        async def generator() -> Any:
            try:
                yield 1
                yield 2
            finally:  # run by trio as the run ends
                await _a_launch_released_later(dev, tl, empty, woke)

        unfinished = generator()
        left.append(unfinished)  # kept: trio finalizes it as the run ends
        async for _ in unfinished:
            break

    trio.run(main)
    asyncio.run(opened[0].close())
    assert woke == [True]

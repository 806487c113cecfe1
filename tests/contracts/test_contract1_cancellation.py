"""Contract 1: every await is a checkpoint; cancelling detaches that waiter only."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any, ClassVar

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _threads, backends
from asyncmetal.backends.cpu import CPUBackend
from tests.support.threads import submission_lock_held

pytestmark = pytest.mark.anyio


async def test_thousands_of_random_cancellations_lose_nothing(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    rng = random.Random(1234)
    queues = [device.queue, device.new_queue(), device.new_queue()]
    counters = [await device.alloc(4) for _ in queues]
    for c in counters:
        await c.write(np.zeros(1, np.int32))
    launches = [0] * len(queues)
    cancelled = completed = 0

    async def awaiter(completion: am.Completion, delay: float, scope_holder: list[bool]) -> None:
        nonlocal cancelled, completed
        with anyio.move_on_after(delay) as scope:
            await completion
        if scope.cancelled_caught:
            cancelled += 1
        else:
            completed += 1

    async with anyio.create_task_group() as tg:
        for _ in range(3000):
            i = rng.randrange(len(queues))
            done = queues[i].launch(kernels["spin"], counters[i], vals=(rng.randrange(2000),))
            launches[i] += 1
            # delays of 0 cancel before the first wait; small ones cancel while parked
            tg.start_soon(awaiter, done, rng.choice([0, 0, 1e-5, 1e-4, 1e-3, 1]), [])
            if rng.random() < 0.05:
                await anyio.lowlevel.checkpoint()
    assert cancelled > 100, "the test must cancel many waiters"
    assert cancelled + completed == 3000
    # Nothing submitted was aborted: every launch ran exactly once.
    for q, c, n in zip(queues, counters, launches):
        await q.synchronize()
        assert (await c.read(np.int32))[0] == n
        assert q.timeline.value == q.submitted
    # And the device still works.
    await device.queue.launch(kernels["empty"])


async def test_cancelled_timeline_waiter_does_not_disturb_others(device: am.Device) -> None:
    tl = device.timeline()
    woken = []

    async def waiter(i: int) -> None:
        await tl.wait(5)
        woken.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(10):
            tg.start_soon(waiter, i)
        await anyio.sleep(0.01)
        with anyio.move_on_after(0.01):
            await tl.wait(5)  # cancelled while parked among the others
        assert am.loop_statistics().waiting == 10
        tl.signal(5)
    assert sorted(woken) == list(range(10))
    assert am.loop_statistics().waiting == 0


async def test_cancelled_waits_for_unreached_values_do_not_pile_up(device: am.Device) -> None:
    tl = device.timeline()
    for _ in range(500):
        with anyio.move_on_after(0):
            await tl.wait(10**9)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await tl.wait(10**9)
    watch_sizes = [len(w.heap) for w in tl._watches]
    assert all(size <= 70 for size in watch_sizes), watch_sizes


async def test_a_watch_whose_only_waits_were_cancelled_goes(device: am.Device) -> None:
    """Waits that time out (or are cancelled) on a timeline nobody signals: once none is
    left, the loop lets go of the timeline's watch -- and of its native part, which would
    otherwise stay armed at the old value -- as it does when the last waiter is woken.
    Kept, every timeline ever waited on with a timeout held a watch until the device
    closed."""
    from asyncmetal import _bridge

    bridge = _bridge.current_bridge()
    timelines = [device.timeline() for _ in range(3)]
    before = len(bridge.watches)
    for tl in timelines:
        for value in (5, 7):  # two waits, the second one the last to go
            with anyio.move_on_after(0.005):
                await tl.wait(value)
    for _ in range(6):  # past the turns at which an empty watch goes
        await anyio.lowlevel.checkpoint()
    assert [tl._watch_of.get(bridge) for tl in timelines] == [None] * 3
    assert len(bridge.watches) == before
    assert not any(w.timeline in timelines for w in bridge._native_watches)
    # A wait after that makes a new watch, and is woken as any.
    async with anyio.create_task_group() as tg:
        tg.start_soon(timelines[0].wait, 1)
        await anyio.wait_all_tasks_blocked()
        timelines[0].signal(1)


async def test_the_last_waiter_woken_past_cancelled_ones_lets_the_watch_go(
    device: am.Device,
) -> None:
    """A wait for a value nobody signals times out while another task waits for a lower
    one, which is then woken: only the withdrawn wait is left in the timeline's watch,
    and the loop lets go of the watch (it kept it, armed at the withdrawn wait's value)."""
    from asyncmetal import _bridge

    bridge = _bridge.current_bridge()
    tl = device.timeline()
    async with anyio.create_task_group() as tg:
        tg.start_soon(tl.wait, 1)
        await anyio.wait_all_tasks_blocked()
        with anyio.move_on_after(0.005):
            await tl.wait(5)
        tl.signal(1)
    for _ in range(6):  # past the turns at which an empty watch goes
        await anyio.lowlevel.checkpoint()
    assert tl._watch_of.get(bridge) is None


async def test_a_wait_withdrawn_while_its_watch_wakes_keeps_the_watchs_count(
    device: am.Device,
) -> None:
    """A callback waiting for value 1 (``call_when_reached``) is woken first, cancels the
    only task also parked for 1 and waits for 2 itself. On trio the task's wait is
    withdrawn there and then, inside the wake-up going through that same watch (its
    abort runs at once; asyncio and uvloop withdraw it when the task next runs). The
    watch's count of withdrawn waits stays right: once 2 is reached with only a
    cancelled wait left, the watch goes (with the count left at -1 it stayed)."""
    from asyncmetal import _bridge, _timeline

    bridge = _bridge.current_bridge()
    tl = device.timeline()
    scope = anyio.CancelScope()
    reached_2 = anyio.Event()

    def at_1() -> None:
        scope.cancel()
        _timeline.call_when_reached(tl, 2, reached_2.set)

    async def waiter() -> None:
        with scope:
            await tl.wait(1)

    async with anyio.create_task_group() as tg:
        _timeline.call_when_reached(tl, 1, at_1)  # before the task's: woken first
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        tl.signal(1)
    assert scope.cancelled_caught
    with anyio.move_on_after(0.005):
        await tl.wait(3)  # withdrawn, left behind the callback's wait for 2
    tl.signal(2)
    await reached_2.wait()
    for _ in range(6):
        await anyio.lowlevel.checkpoint()
    assert tl._watch_of.get(bridge) is None


async def test_cancelled_write_still_completes_and_keeps_its_source_alive(
    device: am.Device,
) -> None:
    tl = device.timeline()
    buf = await device.alloc(1 << 20)
    device.queue.wait(tl, 1)  # hold the queue so the copy is still pending when cancelled
    data = np.arange(1 << 18, dtype=np.int32)
    with anyio.move_on_after(0.01) as scope:
        await buf.write(data)
    assert scope.cancelled_caught
    del data  # the queue must hold its own reference
    tl.signal(1)
    np.testing.assert_array_equal(await buf.read(np.int32), np.arange(1 << 18))


async def test_map_is_a_checkpoint_with_no_command_to_wait_for(device: am.Device) -> None:
    """A buffer no command used yet (over an array: from_numpy, from_dlpack) too.
    Checked: without it, a cancelled scope's map returned the view all the same."""
    if device.name == "metal":
        pytest.skip("host arrays come in as cpu memory")
    for buf in (await am.from_numpy(np.zeros(4)), am.from_dlpack(np.zeros(4))):
        assert not buf.busy()
        with anyio.CancelScope() as scope:
            scope.cancel()
            await buf.map()
            pytest.fail("map returned in a cancelled scope")
        assert scope.cancelled_caught


async def test_from_numpy_and_a_buffers_exit_are_checkpoints(device: am.Device) -> None:
    """from_numpy once its device is open, and ``async with`` a buffer whose exit frees
    nothing (a view, a freed buffer). Checked: without it, each returned in a cancelled
    scope."""
    await am.from_numpy(np.zeros(4))  # (opens the npy device)
    buf = await device.alloc(16)
    view = buf.view(8)
    freed = await device.alloc(16)
    await freed.free()
    for name, step in (
        ("from_numpy", lambda: am.from_numpy(np.zeros(4))),
        ("a view's exit", lambda: view.__aexit__(None, None, None)),
        ("a freed buffer's exit", lambda: freed.__aexit__(None, None, None)),
    ):
        with anyio.CancelScope() as scope:
            scope.cancel()
            await step()
            pytest.fail(f"{name} returned in a cancelled scope")
        assert scope.cancelled_caught
    assert not buf.freed
    await buf.free()


async def test_cancelled_free_returns_memory_only_after_use(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    before = device.memory_statistics()
    tl = device.timeline()
    buf = await device.alloc(4)
    device.queue.wait(tl, 1)
    done = device.queue.launch(kernels["fill"], buf, vals=(3, 1))
    with anyio.move_on_after(0.01):
        await buf.free()
    assert buf.freed  # unusable at once...
    assert device.memory_statistics().in_use == before.in_use + 512  # ...but still held
    # (512: the 4 bytes' size class, what the device holds for them)
    tl.signal(1)
    await done
    await anyio.sleep(0.01)  # the release runs in the loop's next drain
    after = device.memory_statistics()
    assert after.in_use == before.in_use
    assert after.cached == before.cached + 512


async def test_close_waits_for_work_even_when_cancelled(
    anyio_backend: object,
) -> None:
    dev = await am.open_device("cpu:2")
    prog = await dev.compile("void k(int* x) { x[0] = 42; }", "k")
    buf = await dev.alloc(4)
    tl = dev.timeline()
    dev.queue.wait(tl, 1)
    dev.queue.launch(prog, buf)
    out = np.zeros(1, np.int32)
    dev.queue.copy(out, buf)
    with anyio.CancelScope() as scope:
        scope.cancel()
        tl.signal(1)
        await dev.close()  # shielded: completes despite the cancelled scope
    assert dev.closed
    assert out[0] == 42


async def test_close_abandons_commands_waiting_for_values_nobody_signals(
    anyio_backend: object,
) -> None:
    dev = await am.open_device("cpu:3")
    prog = await dev.compile("void k(int* x) { x[0] += 1; }", "k")
    buf = await dev.alloc(4)
    await buf.write(np.zeros(1, np.int32))
    never, later = dev.timeline(), dev.timeline()
    q1, q2 = dev.new_queue(), dev.new_queue()
    ran = q1.launch(prog, buf)  # completes
    q1.signal(later, 1)
    q2.wait(later, 1)  # satisfied by q1's signal: this part of q2 completes too
    ran2 = q2.launch(prog, buf)
    q2.wait(never, 1)  # nothing will ever signal this
    stuck = q2.launch(prog, buf)
    with anyio.fail_after(10):
        await dev.close()  # must not hang
    await ran
    await ran2
    assert stuck.done()
    with pytest.raises(am.ClosedResourceError, match="never ran"):
        await stuck


async def test_a_free_cancelled_as_another_thread_submits_still_returns_the_memory(
    device: am.Device,
) -> None:
    """free() releases the memory once the submissions under way on other threads are
    done (their device's submission lock free again), on a thread of its own when one
    holds it now: a free cancelled at once still returns the memory. Handed to a worker
    thread, the release was lost, as that hand-off is cancellable before it starts."""
    buf = await device.alloc(4096)
    with submission_lock_held(device), anyio.CancelScope() as scope:
        scope.cancel()
        await buf.free()
    with anyio.move_on_after(5):
        while device.memory_statistics().in_use:
            await anyio.sleep(0.005)
    assert device.memory_statistics().in_use == 0


class _SlowToOpen(CPUBackend):
    """A cpu device whose opening waits for ``go``; its instances opened and closed are
    recorded."""

    kind = "slowcpu"
    started = threading.Event()
    go = threading.Event()
    opened: ClassVar[list[CPUBackend]] = []
    closed: ClassVar[list[CPUBackend]] = []

    @classmethod
    def available(cls) -> list[str]:
        return ["slowcpu"]

    def __init__(self, index: int) -> None:
        type(self).started.set()
        type(self).go.wait()
        super().__init__(index)
        type(self).opened.append(self)

    def close(self) -> None:
        type(self).closed.append(self)
        super().close()


@pytest.mark.parametrize(
    "when", ["opening", "opened", "loop closed", "loop closed handed over", "loop closed reported"]
)
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_an_open_cancelled_meanwhile_closes_what_it_opened(
    monkeypatch: pytest.MonkeyPatch, loop: str, when: str
) -> None:
    """asyncio's own task.cancel() (a wait_for's timeout, Ctrl-C under asyncio.run) ends
    an open's wait for its backend, not the opening on its worker thread: the backend
    it opens, for nobody now, is closed (a cuda device's pinned staging memory and free
    thread were held for good). Cancelled while the backend opens, and once it has
    opened and its result is handed over, the caller not yet resumed; and with its
    loop stopped and closed while it opens (as a framework left by a repeated Ctrl-C
    does), the task never resumed, or once the opening ended and handed its result to
    the stopped loop, which its close drops unrun, or reported to the task and its
    loop stopped before the task resumed (checked: never closed, each way)."""
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop", reason="uvloop is not built for this platform")
        if when == "loop closed reported":
            pytest.skip("uvloop runs the callbacks queued meanwhile before it stops")
    monkeypatch.setitem(backends.BACKENDS, "slowcpu", f"{__name__}:_SlowToOpen")
    monkeypatch.setattr(_SlowToOpen, "started", threading.Event())
    monkeypatch.setattr(_SlowToOpen, "go", threading.Event())
    monkeypatch.setattr(_SlowToOpen, "opened", [])
    monkeypatch.setattr(_SlowToOpen, "closed", [])

    async def main() -> None:
        opening = asyncio.ensure_future(am.open_device("slowcpu"))
        if when == "opened":  # cancelled as its result is handed over, before it resumes
            report = _threads._report

            def report_then_cancel(*args: Any) -> None:
                report(*args)
                opening.cancel()

            monkeypatch.setattr(_threads, "_report", report_then_cancel)
        await asyncio.get_running_loop().run_in_executor(None, _SlowToOpen.started.wait)
        if when == "opening":
            opening.cancel()
        _SlowToOpen.go.set()
        with pytest.raises(asyncio.CancelledError):
            await opening

    if when.startswith("loop closed"):
        left = uvloop.new_event_loop() if loop == "uvloop" else asyncio.new_event_loop()
        pending = left.create_task(am.open_device("slowcpu"))
        left.run_until_complete(left.run_in_executor(None, _SlowToOpen.started.wait))
        if when == "loop closed handed over":
            idle = len(_threads._workers._idle)
            _SlowToOpen.go.set()
            for _ in range(1000):  # (a bound on a hang) until the worker has handed over
                if len(_threads._workers._idle) > idle:
                    break
                time.sleep(0.01)
        elif when == "loop closed reported":  # the loop stops as the result comes
            report = _threads._report

            def report_then_stop(*args: Any) -> None:
                report(*args)
                left.stop()

            monkeypatch.setattr(_threads, "_report", report_then_stop)
            _SlowToOpen.go.set()
            left.run_forever()
        left.close()
        _SlowToOpen.go.set()
        assert not pending.done()
    else:
        (uvloop.run if loop == "uvloop" else asyncio.run)(main())
    for _ in range(1000):  # (a bound on a hang, not a timing)
        if _SlowToOpen.closed:
            break
        time.sleep(0.01)
    assert len(_SlowToOpen.opened) == 1
    assert _SlowToOpen.closed == _SlowToOpen.opened

"""Queue lifetime: Queue.close releases a queue's native resources (a cpu queue's
thread, a Metal command queue); a closed queue refuses commands; the default queue
closes with its device only."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
import weakref
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal._queue import native_queue
from asyncmetal.backends.cpu import CPUQueue
from tests.support.kernels import KERNELS, MSL_KERNELS
from tests.support.queues import held_queue, record_native_closes

pytestmark = pytest.mark.anyio

INC = "void inc(int* x) { x[0] += 1; }"


@pytest.fixture
async def buf(device: am.Device) -> am.Buffer:
    """A 4-byte buffer of the device (a kernel's int)."""
    return await device.alloc(4)


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.parametrize("closed", [True, False], ids=["closed", "dropped"])
async def test_queues_closed_or_dropped_release_their_threads(
    anyio_backend: object, closed: bool
) -> None:
    """A queue per request: each closed one is released at its close; dropped ones
    are released on threads of their own, a batch at a time (each kept till then)."""
    async with am.open_device("cpu") as dev:
        inc = await dev.compile(INC, "inc")
        buf = await dev.alloc(4)
        await buf.write(np.zeros(1, np.int32))
        before = threads()
        for _ in range(300):
            q = dev.new_queue()
            await q.launch(inc, buf)
            if closed:
                await q.close()
        assert (await buf.read(np.int32))[0] == 300
        with anyio.fail_after(10):  # (300 more threads without letting go of them)
            while threads() > before + (2 if closed else 24):  # (a release may be ending)
                await anyio.sleep(0.01)


async def test_close_waits_for_submitted_commands(
    device: am.Device, kernels: dict[str, am.Program], buf: am.Buffer
) -> None:
    q = device.new_queue()
    q.launch(kernels["sleep_ms"], vals=(50,))
    last = q.launch(kernels["fill"], buf, vals=(7, 1))
    await q.close()
    assert last.done()
    assert q.timeline.value == 2
    assert (await buf.read(np.int32))[0] == 7


async def test_close_waits_for_a_device_wait_signalled_later(
    device: am.Device, kernels: dict[str, am.Program], buf: am.Buffer
) -> None:
    q, tl = held_queue(device)
    filled = q.launch(kernels["fill"], buf, vals=(5, 1))
    closed = anyio.Event()

    async def close() -> None:
        await q.close()
        closed.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(close)
        await anyio.sleep(0.05)
        assert not closed.is_set() and not filled.done()
        with pytest.raises(am.ClosedResourceError):  # refused as soon as close is called
            q.launch(kernels["empty"])
        tl.signal(1)
    assert closed.is_set() and filled.done()
    assert (await buf.read(np.int32))[0] == 5


async def test_a_discard_that_is_no_bool_is_refused_before_anything_is_dropped(
    device: am.Device, kernels: dict[str, am.Program], buf: am.Buffer
) -> None:
    """``close(discard=...)`` of a queue or a device takes a bool: anything else (a
    string "false" read from a configuration, say, which is true) is refused with an
    ArgumentTypeError, nothing closed or dropped, as ``alloc``'s ``zeroed`` is.
    Checked: fails without the fix (the queue closed, discarding its backlog)."""
    q, tl = held_queue(device)
    filled = q.launch(kernels["fill"], buf, vals=(9, 1))
    for discard in ("false", 0, None, 1.0):
        with pytest.raises(am.ArgumentTypeError, match="discard must be a bool, got"):
            await q.close(discard=discard)  # type: ignore[arg-type]
        with pytest.raises(am.ArgumentTypeError, match="discard must be a bool, got"):
            await device.close(discard=discard)  # type: ignore[arg-type]
    assert not q.closed and not device.closed
    tl.signal(1)
    await filled
    assert (await buf.read(np.int32))[0] == 9
    await q.close()


async def test_a_closed_queue_refuses_commands(
    device: am.Device, kernels: dict[str, am.Program], buf: am.Buffer
) -> None:
    tl = device.timeline()
    q = device.new_queue()
    q.signal(tl, 1)
    done = q.launch(kernels["fill"], buf, vals=(3, 1))
    await q.close()
    assert q.closed
    calls = {
        "launch": lambda: q.launch(kernels["fill"], buf, vals=(3, 1)),
        "signal": lambda: q.signal(tl, 2),
        "wait": lambda: q.wait(tl, 1),
        "copy": lambda: q.copy(buf, np.zeros(1, np.int32)),
        "after": lambda: q.after(buf),
        "marker": lambda: q.marker(),
        "handle": lambda: q.handle,
        "fill": lambda: q.fill(buf, 0),
    }
    for name, call in calls.items():
        with pytest.raises(am.ClosedResourceError, match=r"queue of .* was closed"):
            call()
        assert q.submitted == 2, name
    with pytest.raises(am.ClosedResourceError, match=r"queue of .* was closed"):
        await q.synchronize()
    # Its timeline, the timelines it signalled and its completions stay valid.
    await done
    await q.timeline.wait(2)
    assert tl.value == 1
    device.queue.wait(q.timeline, 2)  # another queue may still wait on its values
    await device.queue.synchronize()
    await q.close()  # again: nothing to do
    assert (await buf.read(np.int32))[0] == 3


async def test_the_default_queue_closes_with_its_device_only(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    with pytest.raises(am.InvalidArgumentError, match=r"default queue .* closing its device"):
        await device.queue.close()
    assert not device.queue.closed
    await device.queue.launch(kernels["empty"])


async def test_async_with_the_default_queue_is_refused_before_its_body(
    device: am.Device,
) -> None:
    """Before: entered, the body ran, and leaving it raised the refusal (over the body's
    own exception, if any)."""
    ran = False
    with pytest.raises(am.InvalidArgumentError, match=r"default queue .* closing its device"):
        async with device.queue:
            ran = True
    assert not ran and not device.queue.closed


async def test_async_with_closes_the_queue(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    async with device.new_queue() as q:
        done = q.launch(kernels["sleep_ms"], vals=(20,))
    assert q.closed and done.done()
    with pytest.raises(am.ClosedResourceError):
        q.launch(kernels["empty"])


async def test_a_queue_closed_before_its_device_is_not_closed_again(
    anyio_backend: object, device_name: str
) -> None:
    dev = await am.open_device(device_name)
    queues = [dev.new_queue() for _ in range(3)]
    for q in queues[:2]:
        await q.close()
    await dev.close()
    assert all(q.closed for q in queues)
    await queues[2].close()  # closed with the device: nothing to do


async def test_the_queues_of_a_closed_device_refuse_synchronize(
    anyio_backend: object, device_name: str
) -> None:
    """``synchronize()`` of a queue closed with its device raises as its other calls
    and the device's own ``synchronize()`` do, rather than wait for nothing. Checked:
    fails without the fix (it returned)."""
    dev = await am.open_device(device_name)
    queues = [dev.queue, dev.new_queue()]
    await dev.close()
    for q in queues:
        with pytest.raises(am.ClosedResourceError, match=r"closed"):
            q.marker()
        with pytest.raises(am.ClosedResourceError, match=r"closed"):
            await q.synchronize()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.parametrize("new_queue", [True, False], ids=["new queue", "reaper"])
async def test_a_cancelled_close_leaves_the_queue_closed_and_releases_it_later(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, new_queue: bool
) -> None:
    """Released once its commands ran: by the next new_queue(), or without one by the
    device's reaper."""
    closes = record_native_closes(monkeypatch, lambda native: native)
    async with am.open_device("cpu") as dev:
        fill = await dev.compile("void fill(int* x, int v) { x[0] = v; }", "fill")
        buf = await dev.alloc(4)
        tl = dev.timeline()
        before = threads()
        q = dev.new_queue()
        q.wait(tl, 1)
        filled = q.launch(fill, buf, vals=(9,))
        with anyio.move_on_after(0.05) as scope:
            await q.close()  # waits for the wait: cancelled
        assert scope.cancelled_caught
        with pytest.raises(am.ClosedResourceError):
            q.launch(fill, buf, vals=(1,))
        tl.signal(1)  # what it waited for comes: its commands run
        await filled
        assert (await buf.read(np.int32))[0] == 9
        if new_queue:
            dev.new_queue()  # released here (on a thread of its own)
        with anyio.fail_after(5):
            while native_queue(q) not in closes:
                await anyio.sleep(0.01)
            while threads() > before + 1 + new_queue:  # (the reaper; the new queue)
                await anyio.sleep(0.01)
        await q.close()  # released: nothing to do


async def test_a_cancelled_close_of_a_blocked_queue_leaves_it_to_the_device(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    q, _ = held_queue(device)
    blocked = q.launch(kernels["empty"])
    with anyio.move_on_after(0.05):
        await q.close()
    await device.close()  # abandons what nothing will signal
    with pytest.raises(am.ClosedResourceError):
        await blocked
    await q.close()


# -- queues dropped without close --------------------------------------------------------


async def test_a_dropped_queue_with_pending_work_still_runs_it(
    device: am.Device, kernels: dict[str, am.Program], buf: am.Buffer
) -> None:
    start, done = device.timeline(), device.timeline()
    q = device.new_queue()
    q.wait(start, 1)
    q.launch(kernels["fill"], buf, vals=(4, 1))
    q.signal(done, 1)  # another queue waits for it on the device
    waiter = device.new_queue()
    waiter.wait(done, 1)
    after = waiter.launch(kernels["fill"], buf, vals=(6, 1))
    del q
    gc.collect()
    for _ in range(40):  # the device looks for queues to let go of meanwhile
        device.new_queue()
    await anyio.sleep(0.02)
    assert done.value == 0 and not after.done()
    start.signal(1)
    with anyio.fail_after(10):
        await done.wait(1)
        await after
    assert (await buf.read(np.int32))[0] == 6


async def test_a_kept_queue_let_go_of_while_idle_goes_on_working(
    device: am.Device, kernels: dict[str, am.Program], buf: am.Buffer
) -> None:
    q = device.new_queue()
    await q.launch(kernels["fill"], buf, vals=(1, 1))
    for _ in range(40):  # the device lets go of idle queues meanwhile
        device.new_queue()
    assert q.launch(kernels["empty"]).value == 2
    assert [q.launch(kernels["fill"], buf, vals=(v, 1)).value for v in (2, 3)] == [3, 4]
    tl = device.timeline()
    q.wait(tl, 1)
    last = q.launch(kernels["fill"], buf, vals=(8, 1))
    for _ in range(40):
        device.new_queue()
    tl.signal(1)
    await device.synchronize()  # it counts the queue with work in flight
    assert last.done()
    assert (await buf.read(np.int32))[0] == 8


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.parametrize("in_flight", [False, True], ids=["idle", "in flight"])
async def test_a_dropped_queue_is_released_once_idle_without_another_new_queue(
    anyio_backend: object, in_flight: bool
) -> None:
    """Queues dropped without close, with or without commands in flight: once their
    commands ran (those in flight run, and a completion someone holds stays awaitable)
    each is released -- its thread ends -- with no new_queue() after the drop (which
    alone released them before: a service that made no more queues kept them all)."""
    async with am.open_device("cpu") as dev:
        inc = await dev.compile(INC, "inc")
        sleep = await dev.compile(KERNELS, "sleep_ms")
        buf = await dev.alloc(4)
        await buf.write(np.zeros(1, np.int32))
        before = threads()
        queues = [dev.new_queue() for _ in range(4)]
        for q in queues:
            if in_flight:
                q.launch(sleep, vals=(100,))
                held = q.launch(inc, buf)
            else:
                await q.launch(inc, buf)
        del q, queues
        gc.collect()
        if in_flight:
            await held  # its queue was dropped: it still runs, and is awaited
            del held
            gc.collect()
        with anyio.fail_after(10):
            while threads() > before + 1:  # (the device's reaper)
                await anyio.sleep(0.01)
        assert (await buf.read(np.int32))[0] == 4


async def test_a_queue_dropped_on_the_loop_is_released_on_another_thread(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queue its device let go of (nothing in flight) is collected as the loop drops
    it, while another thread holds the device's submission lock (as a GC pass may run
    anywhere): its finalizer runs on the loop's thread, waits for no lock, and hands the
    release (which may wait: a queue thread's join, a stream's synchronize) to another
    thread -- the drop returns first, and the release never runs on the loop."""
    events: list[str] = []
    release_threads: list[threading.Thread] = []
    original = CPUQueue.close

    def close(self: CPUQueue, abandon: bool = False) -> None:
        release_threads.append(threading.current_thread())
        time.sleep(0.2)
        original(self, abandon)
        events.append("released")

    monkeypatch.setattr(CPUQueue, "close", close)
    async with am.open_device("cpu") as dev:
        fill = await dev.compile(KERNELS, "fill")
        buf = await dev.alloc(4)
        q = dev.new_queue()
        await q.launch(fill, buf, vals=(5, 1))
        with anyio.fail_after(10):
            while not q._idle:  # let go of by its device: collected at the drop below
                await anyio.sleep(0.01)
        held, dropped_now = threading.Event(), threading.Event()
        waited: list[bool] = []

        def hold_the_lock() -> None:
            with dev._state.submitting:
                held.set()
                waited.append(dropped_now.wait(10))

        holder = threading.Thread(target=hold_the_lock)
        holder.start()
        held.wait(10)
        dropped = weakref.ref(q)
        del q
        assert dropped() is None  # collected here, on the loop's thread
        events.append("dropped")
        dropped_now.set()
        holder.join()
        assert waited == [True]  # the drop returned while the lock was held
        with anyio.fail_after(10):
            while not events.count("released"):
                await anyio.sleep(0.01)
        assert events == ["dropped", "released"]
        assert threading.current_thread() not in release_threads
        assert (await buf.read(np.int32))[0] == 5


async def test_closing_a_device_waits_for_a_queue_kept_again(
    anyio_backend: object, device_name: str
) -> None:
    dev = await am.open_device(device_name)
    sleep = await dev.compile(KERNELS if device_name == "cpu" else MSL_KERNELS, "sleep_ms")
    q = dev.new_queue()
    await q.launch(sleep, vals=(1,))
    for _ in range(40):
        dev.new_queue()
    last = q.launch(sleep, vals=(50,))
    idle = dev.new_queue()
    for _ in range(40):
        dev.new_queue()
    await dev.close()
    assert last.done() and q.closed and idle.closed
    with pytest.raises(am.ClosedResourceError, match="is closed"):
        idle.launch(sleep, vals=(1,))


def _slow_release(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """cpu queues take 0.2 s to release; the event is set once one has been."""
    released = threading.Event()
    original = CPUQueue.close

    def close(self: CPUQueue, abandon: bool = False) -> None:
        time.sleep(0.2)
        original(self, abandon)
        released.set()

    monkeypatch.setattr(CPUQueue, "close", close)
    return released


async def test_a_close_cancelled_as_it_releases_returns_once_released(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    released = _slow_release(monkeypatch)
    async with am.open_device("cpu") as dev:
        q = dev.new_queue()
        with anyio.move_on_after(0.05):
            await q.close()
        assert released.is_set()  # never left half released
        await q.close()  # released: nothing to do


def test_a_close_cancelled_by_asyncio_as_it_releases_returns_once_released(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """asyncio's own task.cancel(), which no shielded scope stops."""
    released = _slow_release(monkeypatch)

    async def main() -> None:
        async with am.open_device("cpu") as dev:
            task = asyncio.ensure_future(dev.new_queue().close())
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert released.is_set()

    asyncio.run(main())


async def test_closing_a_queue_ends_waits_for_values_it_never_reaches(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """Waits on a queue's timeline for more than its last command, made before its
    close -- a host task's and another queue's device wait -- end failed once it closed
    (checked: both waited until the device closed), and those made after are refused."""
    q = device.new_queue()
    await q.launch(kernels["empty"])
    other = device.new_queue()
    waited = other.wait(q.timeline, 2)  # never submitted: the close ends it
    behind = other.launch(kernels["empty"])
    ended = anyio.Event()

    async def wait_beyond() -> None:
        with pytest.raises(am.ClosedResourceError, match="queue was closed after its command 1"):
            await q.timeline.wait(2)
        ended.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_beyond)
            await q.close()
        for command in (waited, behind):
            with pytest.raises(am.ClosedResourceError, match="closed after its command 1"):
                await command
    assert ended.is_set()
    await q.timeline.wait(1)  # reached: no error
    with pytest.raises(am.ClosedResourceError, match="closed after its command 1"):
        await q.timeline.wait(3)
    with pytest.raises(am.ClosedResourceError, match="closed after its command 1"):
        device.new_queue().wait(q.timeline, 2)


DROPPED = r"queue was dropped \(collected, never closed\) after its command 1"


async def test_dropping_a_queue_ends_waits_for_values_it_never_reaches(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """A queue dropped without close, its timeline still held: once it is released, a
    host task's and another queue's device wait for more than its last command end
    failed, and later ones are refused, each error saying the queue was dropped
    (checked: both waited until the device closed; the errors said "closed" before)."""
    q = device.new_queue()
    await q.launch(kernels["empty"])
    timeline = q.timeline
    other = device.new_queue()
    waited = other.wait(timeline, 2)
    ended = anyio.Event()

    async def wait_beyond() -> None:
        with pytest.raises(am.ClosedResourceError, match=DROPPED):
            await timeline.wait(2)
        ended.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_beyond)
            del q
            while not ended.is_set():  # the device lets go of it, then releases it
                device.new_queue()
                gc.collect()
                await anyio.sleep(0.01)
        with pytest.raises(am.ClosedResourceError, match=DROPPED):
            await waited
    await timeline.wait(1)  # reached: no error
    with pytest.raises(am.ClosedResourceError, match=DROPPED):
        device.new_queue().wait(timeline, 2)


async def test_a_release_new_queue_starts_ends_before_its_device_closes(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queue whose close was cancelled is released by the next new_queue(), on a
    thread of its own: a device close on another thread meanwhile waits for that
    release before it closes the backend, however late the thread is started."""
    events = record_native_closes(
        monkeypatch, lambda queue: "queue" if queue is native else "other queue"
    )
    dev = await am.open_device("cpu")
    q, tl = held_queue(dev)
    native = native_queue(q)
    with anyio.move_on_after(0.02):
        await q.close()  # cancelled: left for the next new_queue to release
    tl.signal(1)
    await q.timeline.wait(q.submitted)
    entered, device_closed = threading.Event(), threading.Event()
    start_release = dev._start_release

    def late_start(*args: Any) -> None:
        entered.set()
        # Where new_queue starts the release with the submission lock let go, the
        # device's close may run to its end before the thread starts: let it.
        if not dev._state.submitting._is_owned():  # type: ignore[attr-defined]
            device_closed.wait(10)
        start_release(*args)

    monkeypatch.setattr(dev, "_start_release", late_start)
    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, dev.new_queue)
        await anyio.to_thread.run_sync(entered.wait, 10)
        await dev.close()
        device_closed.set()
    for thread in dev._release_threads:
        thread.join(10)
    assert events.index("queue") < events.index("backend"), events


async def test_a_queue_closed_as_its_device_closes_returns_once_its_commands_ran(
    device: am.Device, kernels: dict[str, am.Program], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the device is sealed, its close still waits for what was submitted before:
    so does a close of one of its queues."""
    q = device.new_queue()
    late: list[am.Completion] = []
    seal = device._seal

    def seal_after_a_command() -> None:  # (another thread's, just before the seal)
        late.append(q.launch(kernels["sleep_ms"], vals=(100,)))
        seal()

    monkeypatch.setattr(device, "_seal", seal_after_a_command)
    async with anyio.create_task_group() as tg:
        tg.start_soon(device.close)
        with anyio.fail_after(10):
            while not device.closed:
                await anyio.sleep(0.001)
        await q.close()
        assert late[0].done()


async def test_a_queue_closed_as_its_device_closes_returns_once_released(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queue the device's close releases: its own close returns once that is done."""
    go, released = threading.Event(), threading.Event()
    original = CPUQueue.close

    def close(self: CPUQueue, abandon: bool = False) -> None:
        go.wait(10)
        original(self, abandon)
        if self is native:
            released.set()

    monkeypatch.setattr(CPUQueue, "close", close)
    dev = await am.open_device("cpu")
    q = dev.new_queue()
    native = native_queue(q)
    released_at_return: list[bool] = []

    async def close_queue() -> None:
        await q.close()
        released_at_return.append(released.is_set())

    async with anyio.create_task_group() as tg:
        tg.start_soon(dev.close)
        with anyio.fail_after(10):
            while not dev.closed:
                await anyio.sleep(0.001)
        tg.start_soon(close_queue)
        await anyio.sleep(0.05)
        go.set()
    assert released_at_return == [True]


def _no_release_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The threads that release queues cannot start (a limit on threads reached)."""
    start = threading.Thread.start

    def refused(self: threading.Thread) -> None:
        if self.name == "asyncmetal queue close":
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", refused)


@pytest.mark.parametrize("by", ["its close", "new_queue"])
async def test_a_queue_whose_release_thread_cannot_start_is_released_all_the_same(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, by: str
) -> None:
    """The release is made on the caller's thread rather than never: the queue's close
    returns, the native queue is closed, and so is the device."""
    released: list[CPUQueue] = []
    original = CPUQueue.close

    def close(self: CPUQueue, abandon: bool = False) -> None:
        original(self, abandon)
        released.append(self)

    monkeypatch.setattr(CPUQueue, "close", close)
    _no_release_threads(monkeypatch)
    dev = await am.open_device("cpu")
    q, tl = held_queue(dev)
    native = native_queue(q)
    with anyio.fail_after(10):
        if by == "new_queue":
            with anyio.move_on_after(0.02):
                await q.close()  # cancelled: left for the next new_queue to release
            tl.signal(1)
            await q.timeline.wait(q.submitted)
            dev.new_queue()  # releases it
        else:
            tl.signal(1)
            assert native not in released
        await q.close()
        assert native in released
        await dev.close()


class _HoldsOfTheReaper:
    """A device's submission lock (an RLock) that notes each hold of it by the device's
    reaper thread: how many uses it looked at (``_passed``) in each."""

    def __init__(self, lock: Any) -> None:
        self.lock = lock
        self.depth = 0  # (the reaper's)
        self.holds: list[int] = []

    @staticmethod
    def reaper() -> bool:
        return threading.current_thread().name.startswith("asyncmetal reaper")

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = bool(self.lock.acquire(blocking, timeout))
        if got and self.reaper():
            self.depth += 1
            if self.depth == 1:
                self.holds.append(0)
        return got

    def release(self) -> None:
        if self.reaper():
            self.depth -= 1
        self.lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def looked_at_one(self) -> None:
        if self.reaper() and self.depth:
            self.holds[-1] += 1


async def test_the_reaper_forgets_the_uses_of_one_buffer_a_part_per_hold_of_the_lock(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Queues the reaper lets go of all used one buffer: their uses on its record are
    forgotten a part (REAP_CHUNK of them) per hold of the submission lock, as those of
    many buffers are -- not all of one buffer's in one hold (a buffer every request's
    queue reads had thousands, and each loop's next launch waited for all of them)."""
    from asyncmetal import _allocator, _device

    monkeypatch.setattr(_device, "REAP_CHUNK", 8)
    async with am.open_device("cpu") as dev:
        holds = _HoldsOfTheReaper(dev._state.submitting)
        monkeypatch.setattr(dev._state, "submitting", holds)
        passed = _allocator._passed

        def counted(queue: Any, value: int) -> bool:
            holds.looked_at_one()
            return passed(queue, value)

        monkeypatch.setattr(_allocator, "_passed", counted)
        inc = await dev.compile(INC, "inc")
        buf = await dev.alloc(4)
        await buf.write(np.zeros(1, np.int32))
        queues = [dev.new_queue() for _ in range(40)]
        for q in queues:
            await q.launch(inc, buf)
        with anyio.fail_after(10):
            while any(q in buf._allocation.last_use for q in queues):
                await anyio.sleep(0.01)
        assert sum(holds.holds) >= len(queues)  # each use looked at, then forgotten
        assert max(holds.holds) <= 8
        assert (await buf.read(np.int32))[0] == 40


async def test_letting_go_of_idle_queues_compares_no_two_queues(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reaper lets go of many idle queues at once, under the submission lock,
    without comparing each queue kept with each let go of (a pass over the idle ones
    per queue: with 6000 queues, a hold of about 0.3 s that each loop's next launch
    waited for)."""
    from asyncmetal._device import Device
    from asyncmetal._queue import Queue

    compared: list[int] = []
    letting_go: list[bool] = []  # (empty: the reaper lets go of none yet)
    mark_idle = Device._mark_idle

    def eq(self: object, other: object) -> bool:
        compared.append(1)
        return self is other

    def held(self: Device, unused: list[tuple[Queue, int]] | None = None) -> list[Queue]:
        return mark_idle(self, unused) if letting_go else []

    # (Held while the queues are set up: on a loaded machine the reaper's looks, which
    # let go of a queue unused since the look before, came between the first launches
    # and the last.)
    monkeypatch.setattr(Device, "_mark_idle", held)
    async with am.open_device("cpu") as dev:
        empty = await dev.compile(KERNELS, "empty")
        queues = [dev.new_queue() for _ in range(100)]
        for q in queues:  # each kept (again, where a new_queue let go of it)
            await q.launch(empty)
        assert not any(q._idle for q in queues)
        letting_go.append(True)
        monkeypatch.setattr(Queue, "__eq__", eq)
        with anyio.fail_after(10):
            while not all(q._idle for q in queues):  # let go of by the reaper
                await anyio.sleep(0.01)
        assert len(compared) < len(queues)


async def test_the_reaper_looks_for_unused_queues_with_submissions_going_on(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reaper's pass over every queue kept, to find those not submitted to since
    its last look, does not hold the submission lock: a submission made on another
    thread in the middle of it goes through at once (the pass held it for every queue,
    with thousands of queues each loop's next submission waited for the whole pass).
    Checked: fails without the change (the submission waited the 5 s)."""
    from asyncmetal import _device

    unused = _device._unused
    went_through: list[bool] = []
    submitters: list[threading.Thread] = []
    looking = threading.Event()

    def looked_at(queue: Any) -> bool:
        if looking.is_set() and not went_through and _HoldsOfTheReaper.reaper():
            submitted = threading.Event()

            def submit() -> None:
                dev.queue.signal(timeline, 1)
                submitted.set()

            submitters.append(threading.Thread(target=submit))
            submitters[0].start()
            went_through.append(submitted.wait(5))
        return unused(queue)

    monkeypatch.setattr(_device, "_unused", looked_at)
    async with am.open_device("cpu") as dev:
        timeline = dev.timeline()
        queues = [dev.new_queue() for _ in range(8)]
        looking.set()
        try:
            with anyio.fail_after(20):
                while not went_through:  # (the reaper looks soon after a queue is made)
                    await anyio.sleep(0.01)
        finally:
            looking.clear()
            for thread in submitters:
                thread.join()
        assert went_through == [True]
        with anyio.fail_after(10):
            await timeline.wait(1)
        del queues


async def test_releasing_the_queues_of_many_cancelled_closes_compares_no_two_queues(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many closes cancelled while their queues wait each leave a queue to release
    once its commands ran: the reaper takes them all off the device without comparing
    each with the others closed (a search of the closed queues per queue: 2000 of them
    held the submission lock about 50 ms, each loop's next launch waiting)."""
    from asyncmetal._queue import Queue

    compared: list[int] = []

    def eq(self: object, other: object) -> bool:
        if self is not other:  # (weak references' look-ups compare a queue with itself)
            compared.append(1)
        return self is other

    closes = record_native_closes(monkeypatch, lambda native: native)
    async with am.open_device("cpu") as dev:
        tl = dev.timeline()
        queues = [dev.new_queue() for _ in range(100)]
        monkeypatch.setattr(Queue, "__eq__", eq)
        for q in queues:
            q.wait(tl, 1)
            with anyio.CancelScope() as scope:
                scope.cancel()
                await q.close()  # sealed, then cancelled at its wait
        assert not any(native_queue(q) in closes for q in queues)
        tl.signal(1)
        with anyio.fail_after(10):
            while not all(native_queue(q) in closes for q in queues):
                await anyio.sleep(0.01)
        assert not compared


async def _collected(dropped: weakref.ref[am.Queue], sweep: am.Device | None = None) -> None:
    """Wait (10 s at most) until the queue ``dropped`` refers to is collected: let go of
    by the reaper, or, given ``sweep``, by a sweep of that device's new_queue (once the
    queues kept doubled)."""
    if sweep is not None:
        for _ in range(40):
            sweep.new_queue()
    with anyio.fail_after(10):
        while dropped() is not None:
            await anyio.sleep(0.01)
            gc.collect()


async def test_new_queue_looks_at_a_few_blocked_closes_and_releases_each_in_turn(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many closes cancelled while their queues wait: each new_queue() looks at a few of
    those queues (whether their commands ran), not at every one -- a pass over them
    all per call, with thousands blocked, made many new_queue() calls quadratic -- and
    still releases each once its commands ran, in turn, none before. (No reaper here:
    new_queue alone releases them; whether a queue ran is counted through ``settled``.)
    Checked failing without the fix (10,000 looks for 100 calls)."""
    from asyncmetal import _device

    monkeypatch.setattr(am.Device, "_reap_later", lambda self: None)
    looked: list[int] = []
    settled = _device.settled

    def counted(queue: am.Queue) -> bool:
        looked.append(1)
        return settled(queue)

    closes = record_native_closes(monkeypatch, lambda native: native)
    async with am.open_device("cpu") as dev:
        tl = dev.timeline()
        queues = [dev.new_queue() for _ in range(100)]
        for q in queues:
            q.wait(tl, 1)
            with anyio.CancelScope() as scope:
                scope.cancel()
                await q.close()  # sealed, then cancelled at its wait
        monkeypatch.setattr(_device, "settled", counted)
        made = [dev.new_queue() for _ in range(100)]  # (kept: none of them released)
        assert len(looked) <= 8 * len(made)  # (a few each, however many are blocked)
        assert not any(native_queue(q) in closes for q in queues)
        tl.signal(1)
        for q in queues:
            await q.timeline.wait(q.submitted)
        calls = 0
        while any(q in dev._unreleased for q in queues) and calls < len(queues):
            made.append(dev.new_queue())  # takes those done among the next few off
            calls += 1
        assert calls < len(queues)  # each released, in turn, by new_queue alone
        with anyio.fail_after(10):  # (each released on a thread of its own)
            while not all(native_queue(q) in closes for q in queues):
                await anyio.sleep(0.01)


async def _copied_between(a: am.Device, b: am.Device) -> tuple[am.Buffer, am.Buffer, am.Queue]:
    """A buffer of ``a`` (16 int32), one of ``b`` it was copied from on a new queue of
    ``a``, and that queue."""
    mine, theirs = await a.alloc(64), await b.alloc(64)
    await theirs.write(np.arange(16, dtype=np.int32))
    q = a.new_queue()
    await q.copy(mine, theirs)
    return mine, theirs, q


@pytest.mark.parametrize("new_queue", [False, True], ids=["reaper", "new queue"])
async def test_a_queue_that_copied_from_another_device_is_collected_once_dropped(
    anyio_backend: object, new_queue: bool
) -> None:
    """A copy between devices records its queue's use on the other device's buffer
    too: once the queue is let go of (by the reaper, or a new_queue's sweep) that use,
    passed, is forgotten there as well, so the queue dropped is collected (and
    released) -- not kept alive by the other device's buffer as long as that lives."""
    async with am.open_device("cpu") as a, am.open_device("cpu") as b:
        mine, _held, q = await _copied_between(a, b)  # (the source, held: its record)
        dropped = weakref.ref(q)
        del q
        await _collected(dropped, a if new_queue else None)
        assert (await mine.read(np.int32)).tolist() == list(range(16))


async def test_a_queue_that_used_a_foreign_buffer_is_collected_once_dropped(
    anyio_backend: object,
) -> None:
    """A buffer over another library's memory (from_dlpack of a numpy array) is no
    block of the device's allocator, and its record of uses was never looked through:
    a queue that launched on it, dropped, stayed alive (and unreleased) as long as that
    buffer. Once let go of, its passed use is forgotten there too."""
    async with am.open_device("cpu") as dev:
        inc = await dev.compile(INC, "inc")
        array = np.zeros(4, np.int32)
        foreign = am.from_dlpack(array, device=dev)
        q = dev.new_queue()
        await q.launch(inc, foreign)
        dropped = weakref.ref(q)
        del q
        await _collected(dropped)
        assert array[0] == 1


@pytest.mark.parametrize("new_queue", [False, True], ids=["reaper", "new queue"])
async def test_a_queue_that_copied_from_a_closed_devices_buffer_is_collected_once_dropped(
    anyio_backend: object, new_queue: bool
) -> None:
    """The other device of a copy between devices closed first, its buffer still held:
    its blocks are no longer among any open device's, yet the queue's use on that
    buffer's record, passed, is forgotten once the queue is let go of (by the reaper,
    or a new_queue's sweep), so the queue dropped is collected -- not kept alive by a
    closed device's buffer as long as that lives."""
    async with am.open_device("cpu") as a:
        async with am.open_device("cpu") as b:
            mine, theirs, q = await _copied_between(a, b)
        dropped = weakref.ref(q)
        del q
        await _collected(dropped, a if new_queue else None)
        assert (await mine.read(np.int32)).tolist() == list(range(16))
        del theirs


@pytest.mark.parametrize("where", ["_look", "_reaped"])
async def test_a_reaper_that_raised_goes_on_reaping_and_its_close_reports_it(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """An error inside the reaper's work (its look, or its release of what was
    collected, which each look ends with) ended its thread, silently: no queue dropped
    later was released (until a new_queue's sweep, or the device's close). It is
    reported as an error nobody awaited (the device's close raises it) and the reaper
    goes on."""
    from asyncmetal import _device

    work = getattr(_device.Device, where)
    raised: list[bool] = []

    def failing_once(self: am.Device, *args: Any, **kwargs: Any) -> object:
        if not raised:
            raised.append(True)
            raise RuntimeError(f"{where} failed")
        return work(self, *args, **kwargs)

    monkeypatch.setattr(_device.Device, where, failing_once)
    closes = record_native_closes(monkeypatch, lambda native: native)
    dev = await am.open_device("cpu")
    async with dev:
        inc = await dev.compile(INC, "inc")
        buf = await dev.alloc(4)
        await buf.write(np.zeros(1, np.int32))
        first = dev.new_queue()  # the reaper starts, and looks soon
        await first.launch(inc, buf)
        with anyio.fail_after(10):
            while not raised:
                await anyio.sleep(0.01)
        q = dev.new_queue()
        await q.launch(inc, buf)
        native = native_queue(q)
        del q  # released by the reaper once let go of
        with anyio.fail_after(10):
            while native not in closes:
                await anyio.sleep(0.01)
                gc.collect()
        assert (await buf.read(np.int32))[0] == 2
        with pytest.raises(RuntimeError, match=f"{where} failed"):
            await dev.close()


class _Clock:
    """A monotonic clock ``ahead`` seconds ahead of the real one (the reaper's: see
    test_after_a_long_look_the_reaper_looks_again_within_seconds)."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead


async def test_after_a_long_look_the_reaper_looks_again_within_seconds(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reaper waits longer after a long look (it takes the GIL), but not without
    bound: after a look that took 1000 s (its clock moved on meanwhile), a queue dropped
    is let go of and released once a minute has passed -- not 100 times that look's
    time later (a day)."""
    from asyncmetal import _device

    clock = _Clock()
    monkeypatch.setattr(_device, "time", clock)  # (the reaper's clock only)
    look = _device.Device._look
    looks: list[bool | None] = []

    def long_first_look(self: am.Device) -> bool | None:
        let_go_of = look(self)
        if not looks:
            clock.ahead += 1000.0  # as if this look took 1000 s
        looks.append(let_go_of)
        return let_go_of

    monkeypatch.setattr(_device.Device, "_look", long_first_look)
    closes = record_native_closes(monkeypatch, lambda native: native)
    async with am.open_device("cpu") as dev:
        inc = await dev.compile(INC, "inc")
        buf = await dev.alloc(4)
        await buf.write(np.zeros(1, np.int32))
        q = dev.new_queue()  # the reaper starts, and looks soon
        await q.launch(inc, buf)
        native = native_queue(q)
        del q  # kept until let go of, at a look after the long one
        with anyio.fail_after(10):
            while not looks:
                await anyio.sleep(0.01)
        await anyio.sleep(0.1)  # (the reaper has set when to look next)
        assert native not in closes
        clock.ahead += 60.0
        dev._reaper_inbox.put(_device._LOOK)  # wakes it: it looks if that time has come
        with anyio.fail_after(10):
            while native not in closes:
                await anyio.sleep(0.01)
                gc.collect()
        assert (await buf.read(np.int32))[0] == 1

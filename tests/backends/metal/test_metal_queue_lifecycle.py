"""A Metal queue's own lifecycle against the simulated Metal: closed by several threads
at once (in a child process: an over-release aborts the simulation), collected
unclosed."""

from __future__ import annotations

import gc
import textwrap
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal._errors import NoHostMemoryError
from asyncmetal.backends.metal import _queue
from asyncmetal.backends.metal._queue import MetalQueue, MetalTimeline
from tests.backends.metal.test_metal import FAULTY, _in_a_child, sim_only
from tests.support.fakes import metal_sim
from tests.support.kernels import KERNELS as C_KERNELS
from tests.support.kernels import MSL_KERNELS
from tests.support.queues import fail_new_queues

pytestmark = [pytest.mark.metal, sim_only]
LOOPS = ["asyncio", "trio"]

CLOSES = textwrap.dedent(
    """
    import sys, threading
    sys.path.insert(0, sys.argv[1])
    import anyio
    import asyncmetal as am
    from asyncmetal._queue import native_queue
    from tests.support.fakes import metal_sim

    async def main():
        async with am.open_device("metal") as dev:
            queue, tl = dev.new_queue(), dev.timeline()
            buf = await dev.alloc(64)
            queue.wait(tl, 1)  # (only the host signals it, once the closes are under way)
            filled = queue.fill(buf, 0)
            native = native_queue(queue)
            queues = metal_sim.live("MTLCommandQueue")
            closed = []

            def close(who, abandon):
                native.close(abandon)
                closed.append(who)

            threads = [
                threading.Thread(target=close, args=args, daemon=True)
                for args in (("first", False), ("second", False), ("abandoning", True))
            ]
            threads[0].start()
            with anyio.fail_after(10):
                while not native._closed:  # (inside its close)
                    await anyio.sleep(0.001)
            for thread in threads[1:]:
                thread.start()
            await anyio.sleep(0.3)
            print("before", sorted(closed), flush=True)
            tl.signal(1)
            with anyio.fail_after(20):
                while any(thread.is_alive() for thread in threads):
                    await anyio.sleep(0.001)
            print("after", sorted(closed), flush=True)
            await filled
            native.close()  # (once more, after: nothing left to release)
            with anyio.move_on_after(10):  # (Metal's threads let go of it too)
                while metal_sim.live("MTLCommandQueue") == queues:
                    await anyio.sleep(0.001)
            print("released", queues - metal_sim.live("MTLCommandQueue"), flush=True)

    anyio.run(main, backend=sys.argv[2])
    """
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loop", LOOPS)
def test_every_close_of_a_metal_queue_returns_once_it_is_released_once(loop: str) -> None:
    """A Metal queue with a fill behind a wait only the host signals, closed plainly
    on one thread and, once that close is under way, plainly on a second and
    abandoning on a third, then once more after: none returns before the value is
    signalled (an abandoning close waits for the plain one under way, as documented),
    all do after, and the MTLCommandQueue is released once. Checked: without the fix
    the later closes released it again (the simulation aborts on the over-release)."""
    lines = _in_a_child(CLOSES, loop, timeout=100)
    assert lines == [
        "before []",
        "after ['abandoning', 'first', 'second']",
        "released 1",
    ], lines


async def _settled_queues() -> int:
    """The MTLCommandQueues alive, once collected and the count steady for 0.2 s (at most
    10 s): those of devices closed before are let go of by Metal's threads too."""
    count, steady = -1, 0.0
    with anyio.move_on_after(10):
        while steady < 0.2:
            gc.collect()
            now = metal_sim.live("MTLCommandQueue")
            count, steady = now, steady + 0.01 if now == count else 0.0
            await anyio.sleep(0.01)
    return count


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", LOOPS)
async def test_a_metal_queue_collected_unclosed_releases_its_command_queue(
    anyio_backend: object,
) -> None:
    """Four new_queues that fail once their MTLCommandQueue was made (here: the queue's
    keep-alive not to be made; an interrupt there alike) hand out nothing, and nothing
    else holds those queues: collected, their MTLCommandQueues are released, as are
    those of four MetalQueues made and dropped; the device goes on. Checked: without
    the finalizer those MTLCommandQueues stayed for good (8 more than before)."""
    async with am.open_device("metal") as dev:
        before = await _settled_queues()
        fail_new_queues(dev, _queue, "KeepAlive")
        backend: Any = dev._backend
        for _ in range(4):
            MetalQueue(backend, MetalTimeline(backend))  # (dropped at once)
        assert await _settled_queues() == before
        async with dev.new_queue() as queue:  # (the device goes on)
            buf = await dev.alloc(16)
            await queue.copy(buf, np.arange(4, dtype=np.float32))
            assert (await buf.read(np.float32)).tolist() == [0, 1, 2, 3]


def _metal_workers() -> int:
    return sum(thread.name == "asyncmetal-metal" for thread in threading.enumerate())


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", LOOPS)
@pytest.mark.parametrize("held_by", ["metal timeline", "cpu copy"])
async def test_dropped_metal_queues_whose_commands_were_held_are_let_go_of(
    anyio_backend: object, held_by: str
) -> None:
    """Queues dropped with a fill held on their own thread (behind a wait for a Metal
    timeline the host signals later, or behind a cpu queue's copy into the buffer, a
    wait across kinds) are let go of once the fills ran, as any dropped queue is
    (README: within two looks of the reaper, 10 s at the most): their MTLCommandQueues
    are released and their threads end while the device stays open. Checked: without
    the fix their threads kept the last command they ran, whose completion holds the
    queue, and most of the 8 stayed (with their threads) until the device closed."""
    async with am.open_device("metal") as dev, am.open_device("cpu") as cpu:
        before = await _settled_queues()
        timeline = dev.timeline()
        bufs = [await dev.alloc(64) for _ in range(8)]
        src = await cpu.alloc(64)
        await src.write(np.full(64, 7, np.uint8))
        if held_by == "cpu copy":
            sleep = await cpu.compile(C_KERNELS, "sleep_ms")
            cpu.queue.launch(sleep, vals=(100,))
        done = []
        for buf in bufs:
            queue = dev.new_queue()
            if held_by == "cpu copy":
                cpu.queue.copy(buf, src)
            else:
                queue.wait(timeline, 1)
            done.append(queue.fill(buf, 5, size=4))
            del queue
        assert _metal_workers() == 8
        timeline.signal(1)
        for completion in done:
            await completion
        del done, completion
        with anyio.move_on_after(12):
            while _metal_workers() or await _settled_queues() != before:
                await anyio.sleep(0.05)
        assert (_metal_workers(), await _settled_queues()) == (0, before)
        for buf in bufs:
            assert (await buf.read(np.uint8))[:4].tolist() == [5] * 4


def _depth(error: BaseException) -> int:
    """How many frames ``error``'s traceback holds."""
    depth, tb = 0, error.__traceback__
    while tb is not None:
        depth, tb = depth + 1, tb.tb_next
    return depth


def _collecting(
    errors: list[BaseException], kind: type[BaseException]
) -> Callable[[am.Completion], Awaitable[None]]:
    """An awaiter of a completion that appends the error of ``kind`` it raises."""

    async def awaiter(completion: am.Completion) -> None:
        try:
            await completion
        except kind as exc:
            errors.append(exc)

    return awaiter


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", LOOPS)
async def test_a_dropped_metal_queue_whose_held_command_failed_is_let_go_of(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fill held on a queue's own thread (behind a wait for a timeline the host
    signals later) whose command buffer comes back nil there fails, and three tasks
    awaiting it each get the error as an object of their own, with a traceback of their
    own (no longer for being raised to the others); the queue goes on (the fill after
    it runs). Dropped, the queue is let go of as any is: its MTLCommandQueue released,
    its thread ended. Checked: without the fix the three got one object whose traceback
    grew with each raise, and the queue kept that error, whose traceback held the
    awaiters' frames, and so the Queue itself: it stayed alive, with its thread, until
    the device closed."""
    send, refused = _queue.send, []

    def nil_once_held(obj: int, selector: str, *args: Any, **kwargs: Any) -> Any:
        held = threading.current_thread().name == "asyncmetal-metal"
        if selector == "commandBuffer" and held and not refused:
            refused.append(selector)
            return 0
        return send(obj, selector, *args, **kwargs)

    async with am.open_device("metal") as dev:
        before = await _settled_queues()
        workers = _metal_workers()
        timeline = dev.timeline()
        buf = await dev.alloc(64)
        queue = dev.new_queue()
        queue.wait(timeline, 1)
        failing = queue.fill(buf, 5, size=4)
        after = queue.fill(buf, 6, size=4)
        dropped = weakref.ref(queue)
        del queue
        monkeypatch.setattr(_queue, "send", nil_once_held)
        timeline.signal(1)
        errors: list[BaseException] = []
        awaiter = _collecting(errors, am.AsyncMetalError)

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(awaiter, failing)
        await awaiter(failing)  # (and once more, after the others)
        monkeypatch.undo()
        assert refused == ["commandBuffer"]
        assert [type(e) for e in errors] == [NoHostMemoryError] * 4, errors
        assert len({id(e) for e in errors}) == 4
        assert len({str(e) for e in errors}) == 1
        assert len({_depth(e) for e in errors}) == 1, [_depth(e) for e in errors]
        await after
        assert (await buf.read(np.uint8))[:4].tolist() == [6] * 4
        errors.clear()
        del failing, after
        with anyio.move_on_after(12):
            while dropped() is not None or _metal_workers() > workers:
                gc.collect()
                await anyio.sleep(0.05)
        assert (dropped() is None, _metal_workers()) == (True, workers)
        assert await _settled_queues() == before


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", LOOPS)
async def test_a_dropped_metal_queue_that_faulted_is_let_go_of(anyio_backend: object) -> None:
    """A queue whose kernel faulted fails that command and each later one with Metal's
    error: tasks awaiting them each get an object of their own, with a traceback of
    their own. Once the device's synchronize reported the failure (a queue whose last
    command failed is kept until then), the queue, dropped, is let go of as any is.
    Checked: without the fix every await raised the queue's one DeviceLostError, whose
    traceback grew with each and held the awaiters' frames, and so the Queue itself,
    which the device's record of its native queue kept alive until the device closed."""
    async with am.open_device("metal") as dev:
        crash = await dev.compile(FAULTY, "crash")
        fill = await dev.compile(MSL_KERNELS, "fill")
        bad = await dev.alloc(64)
        queue = dev.new_queue()
        dropped = weakref.ref(queue)
        done = [queue.launch(crash, bad)]
        done += [queue.launch(fill, bad, vals=(1, 16)) for _ in range(2)]
        del queue
        errors: list[BaseException] = []
        awaiter = _collecting(errors, am.DeviceLostError)

        async with anyio.create_task_group() as tg:
            for completion in done * 2:
                tg.start_soon(awaiter, completion)
        assert len(errors) == 6, errors
        assert len({id(e) for e in errors}) == 6
        assert all("kernel crash faulted" in str(e) for e in errors), errors
        assert len({_depth(e) for e in errors}) == 1, [_depth(e) for e in errors]
        with pytest.raises(am.DeviceLostError, match="kernel crash faulted"):
            await dev.synchronize()
        errors.clear()
        del done, completion
        with anyio.move_on_after(12):
            while dropped() is not None:
                gc.collect()
                await anyio.sleep(0.05)
        assert dropped() is None

"""The hot paths leave no cyclic garbage: an awaited launch, copy, marker, synchronize,
a host timeline signal and wait, an allocation and its free, a cancelled await, a DLPack
exchange either way, a failed command's error awaited, a queue made and closed. Each
reference cycle an operation leaves waits for the cycle collector; one per operation
makes its collections more frequent, and a full collection pauses the loop for tens of
milliseconds. Counted with the collector off: what ``gc.collect()`` finds after many
operations, per operation."""

from __future__ import annotations

import gc
import itertools
import linecache
import statistics
import sys
import threading
import types
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _allocator
from asyncmetal._allocator import Allocation
from tests.support.kernels import KERNELS
from tests.support.queues import held_queue

pytestmark = pytest.mark.anyio

OPS = 2000
WARM_UP = 200  # (caches filled, lazily made objects made)
MOST_PER_OP = 0.01  # objects left as cyclic garbage per operation
CHUNKS = 5  # the runs' parts, each counted (see cyclic_garbage_per_op)


async def cyclic_garbage_per_op(op: Callable[[], Awaitable[object]]) -> float:
    """How many objects ``OPS`` runs of ``op`` leave for the cycle collector, per run:
    what a collection after them finds, those before it collected first -- the median
    of ``CHUNKS`` such counts, each over a part of the runs. Garbage that ``op`` leaves
    shows in every part; a part may also find what the process's other threads left
    meanwhile once (in the whole suite: a compile pool retiring an idle worker, say),
    which the median leaves out. (Garbage that every collection finds again would
    count: uvloop's loops collected unclosed, which uvloop brings back to life -- a test
    that would leave such runs that part in a child, see test_abandoned_loops.)"""
    for _ in range(WARM_UP):
        await op()
    gc.collect()
    gc.disable()
    try:
        counts = []
        for _ in range(CHUNKS):
            gc.collect()
            for _ in range(OPS // CHUNKS):
                await op()
            counts.append(gc.collect())
        return statistics.median(counts) / (OPS // CHUNKS)
    finally:
        gc.enable()


async def cancelled_while_parked(wait: Callable[[], Awaitable[object]]) -> None:
    """``wait()`` in a task cancelled once it parked: the task's own scope takes the
    cancellation, so the task ends as usual (a task that a task group's scope cancels
    ends in a reference cycle of anyio's own on asyncio, whatever it awaited)."""
    scope = anyio.CancelScope()

    async def waiter() -> None:
        with scope:
            await wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        while not am.loop_statistics().waiting:  # (it yields to the loop before parking)
            await anyio.lowlevel.checkpoint()
        scope.cancel()


@pytest.fixture
async def dev(anyio_backend: object) -> AsyncIterator[am.Device]:
    async with am.open_device("cpu") as device:
        yield device


async def test_awaited_commands_leave_no_cyclic_garbage(dev: am.Device) -> None:
    """Each awaited at once, as a request handler does."""
    empty = await dev.compile(KERNELS, "empty")
    q = dev.queue
    src, dst = await dev.alloc(4096), await dev.alloc(4096)
    tl = dev.timeline()
    values = iter(range(1, 1 << 30))

    async def signal_and_wait() -> None:
        value = next(values)
        tl.signal(value)
        await tl.wait(value)

    async def alloc_and_free() -> None:
        buf = await dev.alloc(4096)
        await buf.free()

    ops: dict[str, Callable[[], Awaitable[object]]] = {
        "launch": lambda: q.launch(empty),
        "copy": lambda: q.copy(dst, src),
        "marker": q.marker,
        "synchronize": q.synchronize,
        "signal and wait": signal_and_wait,
        "alloc and free": alloc_and_free,
    }
    found = {name: await cyclic_garbage_per_op(op) for name, op in ops.items()}
    assert not {name: n for name, n in found.items() if n >= MOST_PER_OP}


async def test_cancelled_awaits_leave_no_cyclic_garbage(dev: am.Device) -> None:
    """A timeline wait and a command's await, each cancelled while parked."""
    empty = await dev.compile(KERNELS, "empty")
    waited, gate = dev.timeline(), dev.timeline()
    q = dev.new_queue()
    values = iter(range(1, 1 << 30))
    gates = iter(range(1, 1 << 30))

    async def timeline_wait() -> None:
        value = next(values)
        await cancelled_while_parked(lambda: waited.wait(value))
        waited.signal(value)

    async def command() -> None:
        value = next(gates)
        q.wait(gate, value)  # (the launch waits on the device until the gate's signal)
        done = q.launch(empty)

        async def awaited() -> None:
            await done

        await cancelled_while_parked(awaited)
        gate.signal(value)
        await done

    with anyio.fail_after(60):
        found = {
            "timeline wait": await cyclic_garbage_per_op(timeline_wait),
            "command": await cyclic_garbage_per_op(command),
        }
    assert not {name: n for name, n in found.items() if n >= MOST_PER_OP}
    await q.close()


async def test_dlpack_exchanges_leave_no_cyclic_garbage(dev: am.Device) -> None:
    """A numpy array taken by ``am.from_dlpack`` and a buffer taken by numpy, each
    dropped at once."""
    array = np.zeros(1024, np.float32)
    buf = await dev.alloc(4096)

    async def taken() -> None:
        am.from_dlpack(array)

    async def given() -> None:
        np.from_dlpack(buf)

    found = {
        "am.from_dlpack": await cyclic_garbage_per_op(taken),
        "np.from_dlpack": await cyclic_garbage_per_op(given),
    }
    assert not {name: n for name, n in found.items() if n >= MOST_PER_OP}


async def test_failed_commands_and_closed_queues_leave_no_cyclic_garbage(
    dev: am.Device,
) -> None:
    """A failed command's error, raised by each await of it, of its queue's synchronize
    and of a timeline it was to signal; and a queue made and closed.

    Checked: fails without the fix (6 objects per await of the failed command, 8 per
    synchronize and 6 per timeline wait: each error held the frame that raised it, through
    its traceback, and that frame the error; 6 per queue closed: the HostEvents its
    release made and its counter's bound method of it)."""
    empty = await dev.compile(KERNELS, "empty")
    q, tl = dev.new_queue(), dev.timeline()
    async with am.open_device("cpu:1") as other:
        q.wait(other.timeline(), 1)  # never reached: the close fails q from here on
        done = q.launch(empty)
        q.signal(tl, 1)

    def failing(awaited: Callable[[], Awaitable[object]]) -> Callable[[], Awaitable[None]]:
        async def op() -> None:
            with pytest.raises(am.ClosedResourceError, match="nothing will produce"):
                await awaited()

        return op

    async def made_and_closed() -> None:
        await dev.new_queue().close()

    found = {
        "command": await cyclic_garbage_per_op(failing(lambda: done)),
        "synchronize": await cyclic_garbage_per_op(failing(q.synchronize)),
        "timeline wait": await cyclic_garbage_per_op(failing(lambda: tl.wait(1))),
        "queue closed": await cyclic_garbage_per_op(made_and_closed),
    }
    assert not {name: n for name, n in found.items() if n >= MOST_PER_OP}
    await q.close()


class _CachingArray:
    """An array type that keeps the asyncmetal Buffer made of it (``buffer()``): the
    producer refers to its buffer, which refers to it back (its memory's owner)."""

    def __init__(self, n: int) -> None:
        self.array = np.zeros(n, np.int32)
        self.buf: am.Buffer | None = None

    def __dlpack__(self, **kwargs: Any) -> object:
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.array.__dlpack_device__()  # type: ignore[no-any-return]

    def buffer(self) -> am.Buffer:
        if self.buf is None:
            self.buf = am.from_dlpack(self)
        return self.buf


async def test_a_producer_that_keeps_its_buffer_is_collected_once_no_command_uses_it(
    dev: am.Device,
) -> None:
    """A producer and the buffer made of it, in a cycle through each other, dropped: the
    collector takes them once no command uses the memory -- not while a held write
    still does (its finalizer waits until the write ran, and a look let go of it), and
    at once where every command ran. Checked: fails without the fix (never collected,
    not even after the device's close: the hold on the buffer's block, kept while the
    buffer lived, reached the buffer through the producer)."""
    with anyio.fail_after(30):
        idle = _CachingArray(1024)
        await dev.queue.copy(np.ones(1024, np.int32), idle.buffer())
        idle_gone = anyio.Event()
        weakref.finalize(idle, idle_gone.set)
        del idle
        gc.collect()
        assert idle_gone.is_set()

        held = _CachingArray(1024)
        written = held.array
        queue, gate = held_queue(dev)
        write = queue.copy(held.buffer(), np.full(1024, 7, np.int32))
        held_gone = anyio.Event()
        weakref.finalize(held, held_gone.set)
        del held
        gc.collect()
        assert not held_gone.is_set()  # the held write still uses its memory
        gate.signal(1)
        await write
        assert written.tolist() == [7] * 1024
        await (await dev.alloc(64)).free()  # a look: let go of once its write ran
        gc.collect()
        assert held_gone.is_set()
        await queue.close()


def _drop_with_a_collection_at(k: int, bufs: list[am.Buffer]) -> int:
    """Drop ``bufs`` (on this thread, a worker's), the event loop's thread run at the
    ``k``-th line of the finalizer of their allocation, or as it returns -- for a
    collection there --; at how many points it could have run."""
    finalizer = Allocation.__del__.__code__
    points = 0

    def step(frame: types.FrameType, event: str, arg: object) -> Any:
        nonlocal points
        if event in ("line", "return"):
            points += 1
            if points == k:  # the loop's thread runs here
                anyio.from_thread.run_sync(gc.collect)
        return step

    def call(frame: types.FrameType, event: str, arg: object) -> Any:
        return step if frame.f_code is finalizer else None

    sys.settrace(call)
    try:
        bufs.clear()
    finally:
        sys.settrace(None)
    return points


@pytest.mark.parametrize("held", [False, True], ids=["ran", "held"])
async def test_a_collection_as_a_dropped_buffers_finalizer_runs_lets_its_owner_go(
    dev: am.Device, held: bool
) -> None:
    """A buffer over another library's array dropped on a worker thread, a collection
    run by the event loop's thread at each point of the finalizer of the buffer's
    allocation in turn (its lines, and as it returns, after it took the block out): the
    array is kept while a held write into it runs, and goes once no command uses it --
    never held for good. Checked: fails without the fix (the collection got the
    allocation from its weak references, which live until its finalizer returns, and
    put its block back after the finalizer took it out: the array held for good)."""
    with anyio.fail_after(60):
        for k in itertools.count(1):
            array = np.zeros(1024, np.int32)
            released: list[bool] = []  # (set on either thread)
            weakref.finalize(array, released.append, True)
            bufs = [am.from_dlpack(array)]
            if held:
                queue, gate = held_queue(dev)
                write = queue.copy(bufs[0], np.full(1024, 7, np.int32))
            else:
                await dev.queue.copy(bufs[0], np.full(1024, 7, np.int32))
            del array
            points = await anyio.to_thread.run_sync(_drop_with_a_collection_at, k, bufs)
            if held:
                assert not released, f"let go of under the held write (point {k})"
                gate.signal(1)
                await write
                await queue.close()
                await (await dev.alloc(64)).free()  # a look: lets go of what waited
            gc.collect()
            assert released, f"held for good (a collection at point {k} of {points})"
            if k >= points:
                break


def _drop_as_a_collection_looks(
    bufs: list[am.Buffer], interrupted: list[object] | None = None
) -> None:
    """Drop ``bufs`` (on this thread, a worker's) while another thread's collection is
    in its callback that lets go of blocks: the callback gets the allocation of
    ``bufs`` as their finalizer starts, and goes on -- holding again the blocks still
    in use -- once the drop returned. With ``interrupted``, a KeyboardInterrupt is
    raised in the callback there instead (a Ctrl-C; what the collector reports of it
    is appended to the list)."""
    finalizer, look = Allocation.__del__.__code__, _allocator._hold_in_use.__code__
    looked, dropped = threading.Event(), threading.Event()

    def holding(frame: types.FrameType, event: str, arg: object) -> Any:
        line = linecache.getline(look.co_filename, frame.f_lineno).strip()
        if event == "line" and line == "_hold(busy)":
            looked.set()
            assert dropped.wait(10)
            if interrupted is not None:
                raise KeyboardInterrupt
        return holding

    def collect() -> None:
        hook = sys.unraisablehook
        if interrupted is not None:
            sys.unraisablehook = lambda report: interrupted.append(report.exc_type)
        sys.settrace(lambda frame, event, arg: holding if frame.f_code is look else None)
        try:
            gc.collect()
        finally:
            sys.settrace(None)
            sys.unraisablehook = hook

    collector = threading.Thread(target=collect)

    def started(frame: types.FrameType, event: str, arg: object) -> Any:
        if frame.f_code is finalizer and collector.ident is None:  # (started once)
            collector.start()
            assert looked.wait(10)
        return None

    sys.settrace(started)
    try:
        bufs.clear()
    finally:
        sys.settrace(None)
    dropped.set()
    collector.join(10)


@pytest.mark.parametrize("interrupt", [False, True], ids=["plain", "interrupted"])
async def test_a_buffer_dropped_as_a_collection_looks_at_uses_lets_its_owner_go(
    dev: am.Device, interrupt: bool
) -> None:
    """A buffer over another library's array, a write into it held, dropped on a worker
    thread while a collection on another thread looks at the uses of such buffers --
    the collection got the buffer's allocation as its finalizer started, and holds
    again the blocks still in use after that finalizer returned (``interrupt``: a
    Ctrl-C there instead, whose recovery holds every block it looked at again) --: the
    array is kept until the write ran, then goes -- never held for good. Checked: fails
    without the fix (the collection, or the recovery, put the block back after the
    finalizer took it out, and no finalizer was left to take it out again: the array
    held for good)."""
    with anyio.fail_after(30):
        array = np.zeros(1024, np.int32)
        released: list[bool] = []  # (set on any thread)
        weakref.finalize(array, released.append, True)
        bufs = [am.from_dlpack(array)]
        queue, gate = held_queue(dev)
        write = queue.copy(bufs[0], np.full(1024, 7, np.int32))
        del array
        interrupted: list[object] | None = [] if interrupt else None
        await anyio.to_thread.run_sync(_drop_as_a_collection_looks, bufs, interrupted)
        assert interrupted in (None, [KeyboardInterrupt])  # (the recovery ran)
        assert not released  # the held write still uses its memory
        gate.signal(1)
        await write
        await queue.close()
        await (await dev.alloc(64)).free()  # a look: lets go of what waited
        gc.collect()
        assert released  # held for good otherwise


async def test_a_dropped_buffer_whose_commands_ran_lets_its_owner_go_at_once(
    dev: am.Device,
) -> None:
    """A buffer over another library's array dropped once every command that used it
    ran lets go of the array at once -- with collections off too --, not at the next
    import, allocation or close: and a cycle through it goes with the collection that
    finds it, not put back for a later one (older, and so rarer). Checked: fails
    without the fix (the array was held until the next look)."""
    fill = await dev.compile(KERNELS, "fill")
    array = np.zeros(1024, np.int32)
    gone = anyio.Event()
    weakref.finalize(array, gone.set)
    buf = am.from_dlpack(array)
    await dev.queue.launch(fill, buf, vals=(3, 1024))
    assert array[0] == 3
    del array
    gc.disable()
    try:
        del buf
        assert gone.is_set()
    finally:
        gc.enable()

"""The Metal backend where its threads meet: Metal's completion handlers, the queue's own
thread and the loop's (against the simulated Metal, whose hooks order them)."""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import textwrap
import threading
import weakref
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from tests.backends.metal.test_metal import (
    FAULTY,
    _in_a_child,
    gpu_gate,
    timelines_freed,
    unwrapped,
)
from tests.backends.metal.test_metal import pytestmark_loops as loops
from tests.support.fakes import metal_sim
from tests.support.kernels import MSL_KERNELS

SIMULATED = metal_sim.configured()
LARGE = 1 << 20  # bytes of a large copy to the host
sim_only = pytest.mark.skipif(not SIMULATED, reason="needs the simulated Metal")
pytestmark = [pytest.mark.metal, sim_only]


def every_loop(test: Callable[..., Any]) -> Callable[..., Any]:
    """An async test run on asyncio, uvloop and trio."""
    return loops(pytest.mark.anyio(test))  # type: ignore[no-any-return]


async def _until(condition: Callable[[], object]) -> None:
    """Poll ``condition()`` from the loop, for at most 20 s (what it waits for is under
    way: no timing decides the outcome)."""
    with anyio.fail_after(20):
        while not condition():
            await anyio.sleep(0.001)


def _full_pipe() -> tuple[int, int]:
    """A pipe whose write end is blocking and full: a write of one byte to it blocks
    until the read end is read."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    for chunk in (b"\0" * 4096, b"\0"):
        try:
            while True:
                os.write(w, chunk)
        except BlockingIOError:
            pass
    os.set_blocking(w, True)
    return r, w


@every_loop
async def test_a_queue_signal_raises_its_timeline_before_the_queue_records_it_done(
    anyio_backend: object,
) -> None:
    """A signal command's completion raises the signalled timeline first, then the
    queue's own: a task that awaited the command (woken by the queue's timeline) sees
    the value. Here the completion handler is stopped right after it raised the queue's
    timeline (a watch of that timeline whose notifier writes to a full pipe), and the
    signalled timeline must be there already. Checked failing without (the queue's
    timeline was raised first: the handler stopped with the timeline still at 0)."""
    async with am.open_device("metal") as dev:
        q, tl = dev.new_queue(), dev.timeline()
        lib = q._native._backend.lib  # type: ignore[attr-defined]
        own = q._native._timeline.c_timeline  # type: ignore[attr-defined]
        r, w = _full_pipe()
        notifier = lib.am_notifier_new(w)
        watch = lib.am_watch_new(own, notifier)
        held = False
        try:
            assert not lib.am_watch_arm(watch, 1)  # (the signal is the queue's first)
            # Its handler is let go of once the signal was submitted: held in the write,
            # it holds the timeline's lock, which the submission takes once it committed.
            metal_sim.hold_handlers(q._native._queue, True)  # type: ignore[attr-defined]
            try:
                done = q.signal(tl, 5)
            finally:
                metal_sim.hold_handlers(q._native._queue, False)  # type: ignore[attr-defined]
            # The handler raised the queue's timeline, and is held in the notifier's write.
            await _until(lambda: q.timeline.native.value >= done.value)
            held = True
            seen = tl.value
        finally:
            while held and b"\1" not in os.read(r, 1 << 16):  # (its byte: it went on)
                pass
        await done
        lib.am_watch_free(watch)
        lib.am_notifier_free(notifier)
        os.close(r)
        os.close(w)
        assert seen == 5
        assert tl.value == 5


@every_loop
async def test_a_wait_for_a_failed_signal_fails_even_if_its_handler_comes_last(
    anyio_backend: object,
) -> None:
    """A queue faults, then signals a timeline another queue waits on. The GPU raises
    the event all the same, so the other queue's command runs -- and its completion
    handler may be called before the failed signal's (here it is: the simulation holds
    the first queue's handlers back). Its await must still raise, as a command that
    waited for a failed value (it reported success: the timeline had not failed yet)."""
    async with am.open_device("metal") as dev:
        crash = await dev.compile(FAULTY, "crash")
        fill = await dev.compile(MSL_KERNELS, "fill")
        bad, good = await dev.alloc(4), await dev.alloc(64)
        other, tl = dev.new_queue(), dev.timeline()
        first = dev.queue._native._queue  # type: ignore[attr-defined]
        metal_sim.hold_handlers(first, True)
        try:
            dev.queue.launch(crash, bad)
            signalled = dev.queue.signal(tl, 1)
            other.wait(tl, 1)
            returned = metal_sim.handlers_returned()
            after = other.launch(fill, good, vals=(9, 16))
            outcome: list[str] = []

            async def await_after() -> None:
                try:
                    await after
                    outcome.append("success")
                except am.DeviceLostError:
                    outcome.append("failed")

            async with anyio.create_task_group() as tg:
                tg.start_soon(await_after)
                # The other queue's command ran and its handler returned ...
                await _until(lambda: metal_sim.handlers_returned() > returned)
                if after.done():  # (what the handler raised, seen by its awaiter)
                    await _until(lambda: outcome)
                assert not tl.value  # ... the failed signal's handler was not called
                metal_sim.hold_handlers(first, False)
            assert outcome == ["failed"]
            with pytest.raises(am.DeviceLostError):
                await signalled
        finally:
            metal_sim.hold_handlers(first, False)


@every_loop
@pytest.mark.timeout(120)
async def test_a_failure_noted_by_the_queues_thread_is_seen_by_the_loops(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The queue's own thread reaps command buffers (past 256 kept) while the loop's asks
    a command's failure, which reaps too. A buffer the thread has taken and not yet looked
    at was neither in the list nor noted as failed: the loop reported its command (a
    fault) as a success. Now one reaps at a time (the queue's thread is held mid-reap
    here, from its first buffer's GPUStartTime, until the loop's question was asked)."""
    from asyncmetal.backends.metal import _objc, _queue

    send, held = _objc.send, threading.Event()
    committing, popped, resume = threading.Event(), threading.Event(), threading.Event()
    worker: list[int] = []

    def ordered(obj: int, selector: str, *args: Any, **kwargs: Any) -> Any:
        if worker and threading.get_ident() == worker[0]:
            if selector == "commandBuffer":
                committing.wait(20)
            elif selector == "GPUStartTime" and not held.is_set():
                held.set()
                popped.set()
                resume.wait(20)
        return send(obj, selector, *args, **kwargs)

    monkeypatch.setattr(_queue, "send", ordered)
    unwrapped(monkeypatch)  # (the large read is staged)
    async with am.open_device("metal") as dev:
        crash = await dev.compile(FAULTY, "crash")
        empty = await dev.compile(MSL_KERNELS, "empty")
        bad, big = await dev.alloc(4), await dev.alloc(LARGE)
        q, (tl, release) = dev.new_queue(), await gpu_gate(dev)
        native = q._native
        q.wait(tl, 1)
        crashed = q.launch(crash, bad)
        last = [q.launch(empty) for _ in range(300)][-1]  # more than 256 kept
        host = np.zeros(LARGE, np.uint8)
        copied = q.copy(host, big)  # a large read: committed by the queue's thread
        worker.append(native._worker.ident)  # type: ignore[attr-defined]
        release()
        await _until(lambda: q.timeline.value >= last.value)  # (no reap on the loop)
        committing.set()  # the thread commits the copy, then reaps: held in it
        await anyio.to_thread.run_sync(popped.wait, 20)
        seen: list[BaseException | None] = []
        asker = threading.Thread(target=lambda: seen.append(native.failure(crashed.value)))
        asker.start()
        asker.join(1)  # (done at once, or waiting for the thread's reap)
        resume.set()
        await anyio.to_thread.run_sync(asker.join)
        assert isinstance(seen[0], am.DeviceLostError), seen
        with pytest.raises(am.DeviceLostError):
            await crashed
        with pytest.raises(am.DeviceLostError):
            await copied


CLOSE_AS_THE_THREAD_RELEASES = textwrap.dedent(
    """
    import os, sys, threading, time
    sys.path.insert(0, sys.argv[1])
    import anyio
    import asyncmetal as am
    from asyncmetal.backends.metal import _objc, _queue
    from tests.backends.metal.test_metal import gpu_gate
    from tests.support.fakes import metal_sim
    from tests.support.kernels import MSL_KERNELS

    released = threading.Event()
    original = _queue.MetalQueue._release

    def noted(self):
        original(self)
        released.set()

    _queue.MetalQueue._release = noted

    def until(condition):
        deadline = time.monotonic() + 20
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.001)

    async def main():
        dev = await am.open_device("metal")
        empty = await dev.compile(MSL_KERNELS, "empty")
        (tl, _), q = await gpu_gate(dev), dev.new_queue()
        native = q._native
        # Two command buffers that run, their handlers held back; behind them a wait on
        # the GPU that nothing ends holds the rest of the queue's 1024, and its thread
        # is left blocked in commandBuffer.
        metal_sim.hold_handlers(native._queue, True)
        q.launch(empty)
        q.launch(empty)
        q.wait(tl, 1)
        for _ in range(1100):
            q.launch(empty)
        until(lambda: len(native._buffers) == 1024 and native._busy)
        let_go = metal_sim.buffers_let_go()
        send, asked = _objc.send, []

        def ordered(obj, selector, *args, **kwargs):
            if selector == "waitUntilCompleted" and not asked:
                # The close drains the two: as it does, their handlers run, which lets
                # the queue's thread return from commandBuffer and release the queue.
                asked.append(obj)
                metal_sim.hold_handlers(native._queue, False)
                until(lambda: metal_sim.buffers_let_go() >= let_go + 2 and released.is_set())
            return send(obj, selector, *args, **kwargs)

        _queue.send = ordered
        await anyio.to_thread.run_sync(native.close, True)  # as at exit: abandon
        print("closed", flush=True)
        os._exit(0)  # (the device's own close would close the queue again)

    anyio.run(main)
    """
)


@pytest.mark.timeout(120)
def test_an_abandoning_close_drains_buffers_the_queues_thread_releases() -> None:
    """A close that abandons a queue whose thread is blocked in commandBuffer leaves the
    release of the queue and its buffers to that thread, and drains the buffers that can
    complete. Their completion lets the thread go on and release them: the close then
    sent waitUntilCompleted to a released command buffer (the simulation aborts). Now
    the close holds a reference to each buffer it drains (in a child process)."""
    assert _in_a_child(CLOSE_AS_THE_THREAD_RELEASES, timeout=90) == ["closed"]


@every_loop
async def test_a_step_that_fails_on_the_queues_thread_fails_its_command(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large read's staging buffer (into host memory Metal does not wrap) is made on
    the queue's own thread; Metal returns nil there (out of memory). The copy fails with
    MemoryError -- the error went to the thread's excepthook, and a later command's
    completion then reported the copy as done -- and the queue goes on: what follows it
    runs."""
    from asyncmetal.backends.metal import _objc, _queue

    send, loop_thread = _objc.send, threading.get_ident()

    def no_memory_off_the_loop(obj: int, selector: str, *args: Any, **kwargs: Any) -> Any:
        # only the large read's: a small one is also staged on that thread when the
        # queue routes its commands there (behind one not yet done)
        large = selector == "newBufferWithLength:options:" and args[0] >= LARGE
        if large and threading.get_ident() != loop_thread:
            return None  # nil: as Metal, out of memory
        return send(obj, selector, *args, **kwargs)

    monkeypatch.setattr(_queue, "send", no_memory_off_the_loop)
    unwrapped(monkeypatch)  # (the large read is staged)
    async with am.open_device("metal") as dev:
        fill = await dev.compile(MSL_KERNELS, "fill")
        n = LARGE // 4
        big, small = await dev.alloc(4 * n), await dev.alloc(64)
        await dev.queue.launch(fill, big, vals=(3, n))
        host = np.zeros(n, np.int32)
        copied = dev.queue.copy(host, big)  # staged on the queue's thread: nil there
        later = dev.queue.launch(fill, small, vals=(4, 16))  # after it, on that thread
        await later
        with pytest.raises(MemoryError, match="newBufferWithLength"):
            await copied
        assert not host.any()
        await dev.queue.launch(fill, small, vals=(5, 16))
        assert (await small.read(np.int32) == 5).all()


@every_loop
async def test_host_memory_is_wrapped_only_within_max_buffer_length(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """newBufferWithBytesNoCopy makes no buffer above maxBufferLength (Metal returns nil:
    the simulation does too). A copy from host memory whose pages span more than that
    -- the largest buffer's size, from an address inside a page -- is not wrapped but
    staged, and arrives (a smaller one is still wrapped)."""
    from asyncmetal.backends.metal import _backend, _objc

    largest = 1 << 20
    monkeypatch.setenv("ASYNCMETAL_SIM_MAX_BUFFER", str(largest))
    wrapped: list[int] = []
    send = _objc.send

    def recorded(obj: int, selector: str, *args: Any, **kwargs: Any) -> Any:
        if selector.startswith("newBufferWithBytesNoCopy:"):
            wrapped.append(args[1])
        return send(obj, selector, *args, **kwargs)

    async with am.open_device("metal") as dev:
        device = dev._state.backend.device  # type: ignore[attr-defined]
        # The simulation: nil above the largest buffer, as Metal.
        page = _backend.PAGE
        pages = np.zeros(largest + page, np.uint8)
        base = pages.ctypes.data + (-pages.ctypes.data) % page
        args = (base, largest + page, 0, None)
        argtypes = (ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_void_p)
        name = "newBufferWithBytesNoCopy:length:options:deallocator:"
        assert not send(device, name, *args, argtypes=argtypes)
        monkeypatch.setattr(_backend, "send", recorded)
        buf = await dev.alloc(largest)
        host = np.frombuffer(np.random.default_rng(2).bytes(largest + 64), np.uint8)[16:]
        src = host[:largest]  # (16 bytes into a page: its pages are one more)
        assert src.ctypes.data % page
        await dev.queue.copy(buf, src)
        assert (await buf.read(np.uint8) == src).all()
        await dev.queue.copy(buf.view(0, 4096), host[:4096])  # wrapped: two pages
        # (the read's own array is wrapped too where its pages are few enough)
        assert wrapped[-1] == 2 * page and max(wrapped) <= largest, wrapped


@every_loop
@pytest.mark.timeout(120)
async def test_a_signal_abandoned_behind_a_wait_nothing_signals_keeps_nothing(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal held behind a wait for another device's timeline value that nothing
    signals is abandoned by its device's close. It was held on the queue's own thread,
    never committed: nothing keeps the timeline it signals, whose native timeline is
    freed once the device is dropped, and a later signal of the value waited for runs
    nothing. (Committed behind a GPU wait, it kept its timeline until its command
    buffer ran -- and, before that was fixed, until the next reap of some queue.)"""
    freed = timelines_freed(monkeypatch)

    async def abandoned(gate: am.Timeline) -> tuple[int, weakref.ref[am.Device]]:
        dev = await am.open_device("metal")
        tl = dev.timeline()
        dev.queue.wait(gate, 1)
        dev.queue.signal(tl, 1)  # held: the close abandons it
        await dev.close()
        return tl.native.c_timeline, weakref.ref(dev)  # type: ignore[attr-defined]

    async with am.open_device("metal") as other:
        gate = other.timeline()
        c_timeline, dev = await abandoned(gate)
        await _until(lambda: gc.collect() >= 0 and dev() is None)  # dropped (a cycle)
        await _until(lambda: c_timeline in freed)
        gate.signal(1)


async def _a_failed_signal(dev: am.Device) -> tuple[am.Program, am.Timeline]:
    """The ``empty`` kernel, and a timeline whose signal failed (behind a faulting kernel
    on the default queue), its failure seen."""
    crash = await dev.compile(FAULTY, "crash")
    empty = await dev.compile(MSL_KERNELS, "empty")
    bad = await dev.alloc(4)
    tl = dev.timeline()
    dev.queue.launch(crash, bad)
    dev.queue.signal(tl, 1)
    with anyio.fail_after(20), pytest.raises(am.DeviceLostError):
        await tl.wait(1)
    return empty, tl


@every_loop
@pytest.mark.parametrize("between", [False, True], ids=["next", "later"])
async def test_a_signal_after_a_wait_for_a_failed_value_fails_its_timeline(
    anyio_backend: object, between: bool
) -> None:
    """A queue waits on the device for a value whose signal failed, then signals
    another timeline (right after the wait, or after a launch): that timeline fails
    too, as on cpu and cuda -- it rose, and a host wait for it reported success."""
    async with am.open_device("metal") as dev:
        empty, tl = await _a_failed_signal(dev)
        other, onward = dev.new_queue(), dev.timeline()
        other.wait(tl, 1)
        if between:
            other.launch(empty)
        signalled = other.signal(onward, 1)
        with anyio.fail_after(20):
            with pytest.raises(am.DeviceLostError):
                await signalled
            with pytest.raises(am.DeviceLostError):
                await onward.wait(1)


@every_loop
@pytest.mark.timeout(120)
async def test_a_flush_on_another_thread_keeps_a_wait_submitted_meanwhile(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread awaits a queue's wait command (its await commits the command
    buffer that marks it: ``flush``) while this one submits a second wait, then a
    launch. The launch's command buffer must still wait for the second wait's timeline:
    the flush's commit, ending after the second wait was noted, replaced the queue's
    list of waits with its own, and the launch ran before that timeline was signalled.
    (The other thread's commit is held, at most 1 s, until the second wait was
    submitted -- or, where the two exclude each other, until it gives up.)"""
    from asyncmetal.backends.metal import _objc, _queue

    send = _objc.send
    flusher: list[int] = []
    committing, waited = threading.Event(), threading.Event()
    # command buffer -> the (event, value)s it waits for, and those it signals
    waits: dict[int, list[tuple[Any, ...]]] = {}
    signals: dict[int, list[tuple[Any, ...]]] = {}
    noted = {"encodeWaitForEvent:value:": waits, "encodeSignalEvent:value:": signals}

    def ordered(obj: int, selector: str, *args: Any, **kwargs: Any) -> Any:
        if selector in noted:
            noted[selector].setdefault(obj, []).append(args)
        elif selector == "commit" and threading.get_ident() in flusher:
            committing.set()
            waited.wait(1)
        return send(obj, selector, *args, **kwargs)

    async with am.open_device("metal") as dev:
        fill = await dev.compile(MSL_KERNELS, "fill")
        buf = await dev.alloc(64)
        q = dev.new_queue()
        (first_tl, release_first), (second_tl, release_second) = [
            await gpu_gate(dev) for _ in range(2)
        ]
        monkeypatch.setattr(_queue, "send", ordered)
        first = q.wait(first_tl, 1)

        def await_first() -> None:
            flusher.append(threading.get_ident())

            async def awaiting() -> None:
                await first  # (flushes the queue, then parks until first_tl reaches 1)

            anyio.run(awaiting)

        other = threading.Thread(target=await_first)
        other.start()
        try:
            await anyio.to_thread.run_sync(committing.wait, 20)
            await anyio.to_thread.run_sync(q.wait, second_tl, 1)
        finally:
            waited.set()
            release_first()
            await anyio.to_thread.run_sync(other.join, 20)
        assert not other.is_alive()
        launched = q.launch(fill, buf, vals=(7, 16))
        own = q.timeline.native.event  # type: ignore[attr-defined]
        (cb,) = [cb for cb, signalled in signals.items() if (own, launched.value) in signalled]
        waited_for = [event for event, _ in waits.get(cb, [])]
        assert second_tl.native.event in waited_for  # type: ignore[attr-defined]
        assert not launched.done()
        release_second()
        with anyio.fail_after(20):
            await launched
        assert (await buf.read(np.int32) == 7).all()


@every_loop
@pytest.mark.timeout(120)
async def test_two_threads_asking_a_failure_keep_a_failed_wait(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two threads ask a queue whether a command failed (each await does) while the
    queue's first wait was produced and its second waited for a failed signal: each
    drops the produced wait off the queue's list and must still find the failed one.
    Both had read the first as produced; the second to take it off took the failed
    one instead, and reported the command after it as a success. (The first thread is
    held, at most 1 s, in its look at the produced wait's timeline until the second
    asked -- or, where the two exclude each other, until it gives up.)"""
    from asyncmetal.backends.metal import _queue

    async with am.open_device("metal") as dev:
        empty, failed = await _a_failed_signal(dev)
        other, produced = dev.new_queue(), dev.timeline()
        produced.signal(1)
        other.wait(produced, 1)
        other.wait(failed, 1)
        after = other.launch(empty)
        await _until(after.done)  # (not awaited: no failure asked yet)
        native = other._native  # type: ignore[attr-defined]
        first: list[int] = []
        looking, asked = threading.Event(), threading.Event()
        failure = _queue.MetalTimeline.failure

        def held(timeline: Any, target: int) -> Any:
            if timeline is produced.native and threading.get_ident() in first:
                first.clear()
                looking.set()
                asked.wait(1)
            return failure(timeline, target)

        monkeypatch.setattr(_queue.MetalTimeline, "failure", held)
        seen: list[BaseException | None] = []

        def ask() -> None:
            first.append(threading.get_ident())
            seen.append(native.failure(after.value))

        asker = threading.Thread(target=ask)
        asker.start()
        try:
            await anyio.to_thread.run_sync(looking.wait, 20)
            seen.append(await anyio.to_thread.run_sync(native.failure, after.value))
        finally:
            asked.set()
            await anyio.to_thread.run_sync(asker.join, 20)
        assert len(seen) == 2
        assert all(isinstance(error, am.DeviceLostError) for error in seen), seen


async def _zeros_fives_zeros(
    cpu: am.Device, metal: am.Device
) -> tuple[am.Buffer, am.Buffer, am.Buffer]:
    """64 bytes each: a cpu buffer of zeros, a Metal buffer of 5s, a Metal one of zeros."""
    c = await cpu.alloc(64)
    m1, m2 = await metal.alloc(64), await metal.alloc(64)
    await c.write(np.zeros(64, np.uint8))
    await m1.write(np.full(64, 5, np.uint8))
    await m2.write(np.zeros(64, np.uint8))
    return c, m1, m2


@every_loop
@pytest.mark.parametrize("reader", ["another queue", "the same queue"])
@pytest.mark.parametrize("memory", ["wrapped", "staged"])
async def test_a_copy_into_a_cpu_buffer_lands_before_a_metal_queue_ordered_after_it_reads_it(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, reader: str, memory: str
) -> None:
    """A Metal queue copies a Metal buffer into a cpu buffer's memory (in place), then a
    Metal queue ordered after it -- on the GPU: a wait on the first queue's event, or
    the same queue's order -- copies that cpu buffer into another Metal buffer. The
    first copy's bytes must be in the host memory by then. They were moved there by
    its completion handler from a staging buffer, and the GPU runs what is ordered
    after a command buffer once it completed, before (here: long before, the
    simulation holds them back) its handlers: the second copy read the old bytes. Now
    the GPU writes the host memory, through a buffer over its pages; where Metal does
    not wrap them (``staged``: the first copy's, not the second's), the handler still
    moves the bytes, and what is ordered after the copy waits for that handler on the
    host (given a second here to run on the GPU before it, it does not). Checked
    failing without the fix (each way)."""
    if memory == "staged":
        unwrapped(monkeypatch, above=32)  # the first copy's 64 bytes, not the second's 32
    async with am.open_device("cpu") as cpu, am.open_device("metal") as metal:
        c, m1, m2 = await _zeros_fives_zeros(cpu, metal)
        first = metal.new_queue()
        second = first if reader == "the same queue" else metal.new_queue()
        handlers = first._native._queue  # type: ignore[attr-defined]
        metal_sim.hold_handlers(handlers, True)
        try:
            copied = first.copy(c, m1)  # into the cpu buffer's memory, by a Metal queue
            read = second.copy(m2.view(0, 32), c.view(0, 32))  # after it on the GPU
            # The GPU ran both command buffers (the second signalled its event); staged,
            # the second must wait for the first's handler: it is given a second.
            event = second._native._timeline  # type: ignore[attr-defined]
            with anyio.move_on_after(1 if memory == "staged" else 20):
                while event.device_value() < read.value:
                    await anyio.sleep(0.001)
        finally:
            metal_sim.hold_handlers(handlers, False)
        with anyio.fail_after(20):
            await copied
            await read
        assert (await c.read()).tolist() == [5] * 64
        assert (await m2.read()).tolist() == [5] * 32 + [0] * 32


@every_loop
async def test_a_copy_from_memory_metal_does_not_wrap_takes_it_after_its_writer(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Metal queue copies a cpu buffer into a Metal buffer, ordered after a cpu
    queue's copy into that cpu buffer (held behind a wait here). Where Metal will not
    wrap the source's pages, its bytes are staged: that was done as the copy was
    submitted, before its writer ran, and the copy delivered the old bytes. Now they
    are taken once the commands before the copy ran. Checked failing without the fix."""
    unwrapped(monkeypatch)
    async with am.open_device("cpu") as cpu, am.open_device("metal") as metal:
        src, dst = await cpu.alloc(64), await metal.alloc(64)
        await src.write(np.zeros(64, np.uint8))
        await dst.write(np.zeros(64, np.uint8))
        gate = cpu.timeline()
        cpu.queue.wait(gate, 1)
        written = cpu.queue.copy(src, np.full(64, 7, np.uint8))  # its writer, held
        copied = metal.queue.copy(dst, src)  # ordered after it
        later = metal.queue.copy(dst.view(0, 8), np.full(8, 9, np.uint8))  # after it
        assert not copied.done()
        gate.signal(1)
        with anyio.fail_after(20):
            await written
            await copied
            await later
        assert (await dst.read()).tolist() == [9] * 8 + [7] * 56


@every_loop
async def test_a_discard_hands_no_staged_copy_to_the_host_to_gpu_waits_before_its_handler(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Metal queue copies a Metal buffer into a cpu buffer's memory, staged (its
    handler moves the bytes; the simulation holds that handler back), and is closed
    with discard=True as its thread waits for that handler: the command after the copy
    is dropped, the copy ran. Another Metal queue waits for the copy's value and copies
    the cpu buffer into a Metal buffer: it must read the copy's bytes. The empty command
    buffer that takes the discarding queue's timeline past what it dropped handed its
    value to the GPU's waits, that for the copy among them, before the copy's handler
    ran: the reader read the old bytes. Checked failing without the fix."""
    unwrapped(monkeypatch, above=32)  # the first copy's 64 bytes, not the second's 32
    async with am.open_device("cpu") as cpu, am.open_device("metal") as metal:
        c, m1, m2 = await _zeros_fives_zeros(cpu, metal)
        first, second = metal.new_queue(), metal.new_queue()
        handlers = first._native._queue  # type: ignore[attr-defined]
        metal_sim.hold_handlers(handlers, True)
        try:
            copied = first.copy(c, m1)  # staged: its handler moves the bytes
            dropped = first.copy(m1.view(0, 16), np.zeros(16, np.uint8))  # behind it
            second.wait(first.timeline, copied.value)
            read = second.copy(m2.view(0, 32), c.view(0, 32))
            native = first._native  # type: ignore[attr-defined]
            await _until(lambda: native._host_waiting is not None)  # the copy committed
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(first.close, discard=True))
                # The discard ran (the copy's successor dropped); the GPU ran what it
                # was handed meanwhile: the reader is given a second to run before the
                # copy's handler.
                await _until(lambda: native._discarded_to and not native._busy)
                event = second._native._timeline  # type: ignore[attr-defined]
                with anyio.move_on_after(1):
                    while event.device_value() < read.value:
                        await anyio.sleep(0.001)
                metal_sim.hold_handlers(handlers, False)
        finally:
            metal_sim.hold_handlers(handlers, False)
        with anyio.fail_after(20):
            await copied
            await read
            with pytest.raises(am.ClosedResourceError, match="discarded"):
                await dropped
        assert (await c.read()).tolist() == [5] * 64
        assert (await m2.read()).tolist() == [5] * 32 + [0] * 32


AWAITED_AFTER_AN_ABANDONING_CLOSE = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    from tests.support.fakes import metal_sim
    metal_sim.configure()
    import anyio
    import asyncmetal as am
    from asyncmetal.backends.metal._queue import MetalQueue

    async def main():
        async with am.open_device("metal") as dev0:
            dev1 = await am.open_device("metal")
            buf = await dev1.alloc(64)
            q, tl = dev1.queue, dev0.timeline()
            filled = q.fill(buf, 0)
            await filled
            q.wait(tl, 1)  # never signalled: held on the queue's own thread
            with anyio.fail_after(20):  # (once that thread took it up)
                while q._native._host_waiting is None:
                    await anyio.sleep(0.001)
            stop_waiting = MetalQueue._stop_waiting

            def reached_as_stopped(self, waiting):
                # The value comes as the close stops the wait (another device's close
                # fails it so): the thread holds the wait to commit it, after the close
                # has dropped what would have committed it.
                dev0.queue._native._backend.lib.am_timeline_signal(waiting.c_timeline, 1)
                stop_waiting(self, waiting)

            MetalQueue._stop_waiting = reached_as_stopped
            queues = metal_sim.live("MTLCommandQueue")
            await dev1.close()
            MetalQueue._stop_waiting = stop_waiting
            with anyio.fail_after(20):  # (Metal's threads let go of it)
                while metal_sim.live("MTLCommandQueue") == queues:
                    await anyio.sleep(0.001)
            await filled  # (ran before: asks its queue whether it failed)
            print("awaited", flush=True)

    anyio.run(main)
    """
)


@pytest.mark.timeout(120)
def test_a_command_awaited_after_an_abandoning_close_commits_nothing() -> None:
    """A wait held on a Metal queue's own thread whose value comes as an abandoning
    close stops it is noted there for the next command buffer, after the close dropped
    the flush that would have committed it; awaiting an earlier command of the queue
    after the close then committed it: commandBuffer sent to the released queue (the
    simulation aborts). Now a closed queue commits nothing (in a child process)."""
    assert _in_a_child(AWAITED_AFTER_AN_ABANDONING_CLOSE, timeout=90) == ["awaited"]


@every_loop
async def test_an_abandoning_close_keeps_nothing_for_a_handler_that_ran_and_went(
    anyio_backend: object,
) -> None:
    """A close that abandons a queue keeps what the commands it reports as never run use
    until their handlers ran (_disarm). One such command buffer, committed behind a GPU
    wait, may have run since, and its block been freed by another queue's reap: the
    close kept its things for a block that never runs again (the thread that lets go of
    them stayed for ever) and wrote into the freed block. Now only a block still kept is
    disarmed."""
    from asyncmetal.backends.metal import _blocks

    dev = await am.open_device("metal")
    try:
        gate, release_gate = await gpu_gate(dev)
        buf = await dev.alloc(64)
        q, never = dev.queue, dev.timeline()
        q.wait(gate, 1)  # on the GPU: the fill's buffer is committed behind it
        q.fill(buf, 0)
        block = q._native._buffers[-1][2]  # type: ignore[attr-defined]
        q.wait(never, 1)  # held on the queue's own thread: the close abandons the queue
        release_gate()
        await _until(lambda: block.calls)
        _blocks.release_ran()  # (as another queue's reap: this queue's is not reaped)
    finally:
        await dev.close()
    address = ctypes.addressof(block)
    with _blocks._lock:
        assert address not in _blocks._held or address in _blocks._alive


@every_loop
async def test_a_wait_whose_flush_of_the_waited_queue_fails_is_kept(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queue's thread, parked on another queue's wait command, has that queue flush
    (``_flush_waited``); the flush's commit, on the parked thread, gets a nil command
    buffer (no resources left, once). The park must go on (the next nap's flush
    commits it), as the flush the park starts with does: the wait is kept, and the
    launch after it runs only once the other queue's wait command was committed.
    Checked: before, the error left the park and the worker's step, the wait was
    dropped, and the launch ran with the other queue's value never reached."""
    from asyncmetal.backends.metal import _queue

    original = _queue.MetalQueue._flush_waited
    asked: list[object] = []

    def nil_once(self: Any, wait: Any) -> bool:
        if asked:
            return original(self, wait)
        asked.append(wait)
        metal_sim.fail_at(1)  # (this thread's next command buffer is nil)
        try:
            return original(self, wait)
        finally:
            metal_sim.fail_at(-1)

    reported: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: reported.append(args.exc_value))
    monkeypatch.setattr(_queue.MetalQueue, "_flush_waited", nil_once)
    async with am.open_device("metal") as dev:
        fill = await dev.compile(MSL_KERNELS, "fill")
        buf = await dev.alloc(64)
        waiting, other, third = dev.queue, dev.new_queue(), dev.new_queue()
        await (done := third.signal(dev.timeline(), 1))
        first = other.wait(third.timeline, done.value)  # (ready: marked by a flush only)
        waiting.wait(other.timeline, first.value)
        launched = waiting.launch(fill, buf, vals=(7, 16))
        with anyio.fail_after(20):
            await launched
        assert other.timeline.native.value >= first.value  # type: ignore[attr-defined]
        assert len(reported) == 1 and isinstance(reported[0], am.AsyncMetalError), reported
        assert (await buf.read(np.int32) == 7).all()

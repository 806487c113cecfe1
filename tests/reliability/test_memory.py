"""The allocator at its edges: dropped buffers, closing, budget changes, ending loops,
cancellation, concurrent loops, devices closed while another uses their memory, and
host arrays that cannot be copied as bytes. Every wait is bounded: a hang fails."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _allocator, _dlpack, _queue
from asyncmetal._allocator import Allocator
from tests.support.interrupts import interrupted
from tests.support.kernels import KERNELS
from tests.support.queues import copies_done_before_awaited

MiB = 1 << 20
LIMIT = 10  # seconds: every wait here ends within a fraction of this, or it hangs


async def _gets_a_mib(device: am.Device, *then_free: am.Buffer) -> None:
    """An allocation of 1 MiB gets its memory within LIMIT; then everything is freed."""
    with anyio.fail_after(LIMIT):
        buf = await device.alloc(MiB)
    for each in (buf, *then_free):
        await each.free()


@pytest.mark.anyio
async def test_dropped_buffers_wake_allocations_waiting_under_the_budget(
    device: am.Device,
) -> None:
    device.memory_budget = 64 * MiB
    done = []

    async def task(i: int) -> None:
        buf = await device.alloc(16 * MiB)
        await buf.view(0, 8).write(np.full(8, i, np.uint8))
        assert (await buf.view(0, 8).read())[-1] == i
        del buf  # dropped, never freed: the memory must still come back
        done.append(i)

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(task, i)
    assert sorted(done) == list(range(16))
    assert device.memory_statistics().in_use == 0


def test_a_buffer_dropped_while_its_thread_holds_the_release_counter_does_not_deadlock(
    anyio_backend: tuple[str, dict[str, Any]],
) -> None:
    # A finalizer may run inside the GC on a thread that is itself in the middle of
    # counting a release: the wake-up from the finalizer must never wait for that.
    async def scenario() -> None:
        dev = await am.open_device("cpu:5")
        buf = await dev.alloc(MiB)
        holder: list[am.Buffer] = [buf]
        del buf
        counter = dev._allocator._frees.native
        finished = threading.Event()

        def drop_inside_the_counter() -> None:
            with counter._lock:  # type: ignore[attr-defined]
                holder.clear()  # the finalizer runs here, on this thread
            finished.set()

        threading.Thread(target=drop_inside_the_counter, daemon=True).start()
        if not await anyio.to_thread.run_sync(finished.wait, LIMIT):
            pytest.fail("deadlocked (the device is left open: closing would hang too)")
        with anyio.fail_after(LIMIT):
            dev.memory_budget = MiB
            again = await dev.alloc(MiB)  # the dropped block came back
        await again.free()
        await dev.close()

    name, options = anyio_backend
    anyio.run(scenario, backend=name, backend_options=options)


@pytest.mark.anyio
async def test_closing_the_device_fails_waiting_allocations(anyio_backend: object) -> None:
    dev = await am.open_device("cpu:6")
    dev.memory_budget = MiB
    held = await dev.alloc(MiB)
    errors: list[BaseException] = []

    async def waiter() -> None:
        try:
            await dev.alloc(MiB)
        except am.ClosedResourceError as exc:
            errors.append(exc)

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(waiter)
            await anyio.sleep(0.05)
            assert not errors  # still waiting for memory
            await dev.close()
    assert len(errors) == 3
    assert "closed" in str(errors[0])
    del held


@pytest.mark.anyio
async def test_lowering_the_budget_below_a_waiting_request_fails_it(device: am.Device) -> None:
    device.memory_budget = 4 * MiB
    held = await device.alloc(3 * MiB)
    errors: list[am.OutOfMemoryError] = []

    async def waiter() -> None:
        try:
            await device.alloc(2 * MiB)
        except am.OutOfMemoryError as exc:
            errors.append(exc)

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(0.05)
            assert not errors  # 2 MiB fits a 4 MiB budget once the 3 MiB return
            device.memory_budget = MiB
    (err,) = errors
    assert (err.requested, err.budget) == (2 * MiB, MiB)
    assert f"cannot allocate {2 * MiB} bytes" in str(err) and f"budget {MiB}" in str(err)
    await held.free()


@pytest.mark.anyio
async def test_a_request_above_the_largest_buffer_the_device_makes_fails_at_once(
    device: am.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device whose buffers have a size limit below its budget (Backend.max_allocation)
    refuses a larger request with OutOfMemoryError at once, even while other buffers are
    held (whose frees could never make room for it); one within the limit is made."""
    device.memory_budget = 64 * MiB
    monkeypatch.setattr(device._backend, "max_allocation", lambda: 4 * MiB, raising=False)
    held = await device.alloc(MiB)
    with anyio.fail_after(LIMIT), pytest.raises(am.OutOfMemoryError) as info:
        await device.alloc(4 * MiB + 1)
    assert info.value.requested == 4 * MiB + 1
    assert f"largest buffer the device makes ({4 * MiB} bytes)" in str(info.value)
    within = await device.alloc(4 * MiB)
    assert device.memory_statistics().in_use == 5 * MiB
    await within.free()
    await held.free()


@pytest.mark.anyio
async def test_a_release_never_caches_beyond_a_lowered_budget(device: am.Device) -> None:
    device.memory_budget = 4 * MiB
    held = await device.alloc(3 * MiB)
    device.memory_budget = MiB
    await held.free()
    stats = device.memory_statistics()
    assert stats.in_use + stats.cached <= MiB, stats
    assert (await device.alloc(MiB)).nbytes == MiB


def _run_twice(anyio_backend: tuple[str, dict[str, Any]], signal_between: bool) -> tuple[int, int]:
    """Free a buffer whose last use is pending in one run of a loop, end that run, and
    allocate its memory again in a second run."""
    name, options = anyio_backend
    state: dict[str, Any] = {}

    async def first() -> None:
        dev = state["dev"] = await am.open_device("cpu:7")
        dev.memory_budget = MiB
        buf = await dev.alloc(MiB)
        state["handle"] = buf._allocation.handle
        tl = state["tl"] = dev.timeline()
        dev.queue.wait(tl, 1)
        dev.queue.copy(buf, np.ones(MiB, np.uint8))
        with anyio.move_on_after(0.01):
            await buf.free()  # deferred: the copy waits for tl; this loop ends first

    async def signal_later() -> None:
        await anyio.sleep(0.05)
        state["tl"].signal(1)

    async def second() -> None:
        dev = state["dev"]
        try:
            with anyio.fail_after(LIMIT):
                async with anyio.create_task_group() as tg:
                    if not signal_between:
                        tg.start_soon(signal_later)  # the copy runs while alloc waits
                    again = await dev.alloc(MiB)
            state["again"] = again._allocation.handle
            await again.free()
        finally:
            await dev.close()

    anyio.run(first, backend=name, backend_options=options)
    if signal_between:
        state["tl"].signal(1)
    anyio.run(second, backend=name, backend_options=options)
    return state["handle"], state["again"]


def test_a_deferred_free_returns_after_the_loop_that_freed_ended(
    anyio_backend: tuple[str, dict[str, Any]],
) -> None:
    handle, again = _run_twice(anyio_backend, signal_between=True)
    assert again is handle  # the deferred block came back through the cache


def test_an_allocation_waits_for_a_deferred_free_made_by_an_ended_loop(
    anyio_backend: tuple[str, dict[str, Any]],
) -> None:
    handle, again = _run_twice(anyio_backend, signal_between=False)
    assert again is handle


@pytest.mark.anyio
async def test_an_allocation_cancelled_at_its_last_checkpoint_keeps_no_memory(
    device: am.Device,
) -> None:
    device.memory_budget = MiB
    with anyio.CancelScope() as scope:
        scope.cancel()
        await device.alloc(MiB)
    assert scope.cancelled_caught
    assert device.memory_statistics().in_use == 0
    with anyio.fail_after(LIMIT):
        buf = await device.alloc(MiB)  # the budget is whole again
    await buf.free()


@pytest.mark.anyio
async def test_a_release_between_a_failed_attempt_and_the_wait_is_not_missed(
    device: am.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    device.memory_budget = MiB
    allocator = device._allocator
    held = await device.alloc(MiB)
    attempt = allocator._try_alloc

    def attempt_then_release(*args: Any) -> Any:
        block = attempt(*args)
        if block is None and not held.freed:
            # What free() does before it awaits, as another loop's free would do it now.
            held._allocation.freed = held._allocation.block.freed = True
            allocator.release_after(held._allocation.block, [])
        return block

    monkeypatch.setattr(allocator, "_try_alloc", attempt_then_release)
    with anyio.fail_after(LIMIT):
        buf = await device.alloc(MiB)
    await buf.free()


@pytest.mark.anyio
async def test_a_freed_buffers_last_use_passing_as_the_allocation_looks_is_not_missed(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A buffer freed while a kernel uses it (the free's caller cancelled): an
    allocation that needs its memory sweeps (the use not passed yet), and the kernel
    ends before it looks for uses to watch. It must not park unwatched (before, it
    waited for good)."""
    async with am.open_device("cpu:33") as device:
        device.memory_budget = 2 * MiB
        sleep, fill = (
            await device.compile(KERNELS, "sleep_ms"),
            await device.compile(KERNELS, "fill"),
        )
        a, b = await device.alloc(MiB), await device.alloc(MiB)
        device.queue.launch(sleep, vals=(50,))
        done = device.queue.launch(fill, a, vals=(1, 1))
        with anyio.CancelScope() as scope:
            scope.cancel()  # (a request's timeout, say: free() goes on without its caller)
            await a.free()
        allocator = device._allocator
        sweep = allocator.sweep

        def sweep_then_finish() -> None:
            sweep()
            while not done.done():  # the kernel ends between the sweep and the watch
                time.sleep(0.001)

        monkeypatch.setattr(allocator, "sweep", sweep_then_finish)
        await _gets_a_mib(device, b)


@pytest.mark.anyio
async def test_two_sweeps_releasing_one_block_never_release_its_next_owners(
    device: am.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two threads sweep at once and both find a collected buffer's block due: one
    releases it, an allocation takes it, then the other's release comes. That one must
    not release the block from under its new owner (before, it went back to the cache
    while the new buffer held it: the next allocation was handed the same memory, and
    ``in_use`` counted it out). Checked: fails without the fix."""
    allocator = device._allocator
    release = allocator._release
    parked, go = threading.Event(), threading.Event()

    def release_later(block: Any, generation: Any = None) -> None:
        if threading.current_thread() is sweeper:
            parked.set()  # it found the block due, and releases it only now
            go.wait(LIMIT)
        release(block, generation)

    monkeypatch.setattr(allocator, "_release", release_later)
    buf = await device.alloc(MiB)
    block = buf._allocation.block
    del buf  # collected unfreed: queued for the next sweep
    sweeper = threading.Thread(target=allocator.sweep)
    sweeper.start()
    try:
        assert parked.wait(LIMIT)
        allocator.sweep()  # this thread's sweep releases it first: to the cache
        with anyio.fail_after(LIMIT):
            owner = await device.alloc(MiB)
        assert owner._allocation.block is block  # its new owner
    finally:
        go.set()
        sweeper.join(LIMIT)
    assert not sweeper.is_alive()
    assert device.memory_statistics().in_use == MiB
    with anyio.fail_after(LIMIT):
        other = await device.alloc(MiB)
    assert other._allocation.block is not block, "one block handed to two buffers"
    await other.free()
    await owner.free()
    assert device.memory_statistics().in_use == 0


@pytest.mark.anyio
async def test_a_buffer_freed_as_a_copy_into_it_is_submitted_is_refused_by_the_copy(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread frees the buffer after a copy checked it and before the copy is
    numbered: the copy is refused (before, it was submitted after the free had seen no
    use, so the block went back to the allocator, and to its next owner, with the copy
    still to run)."""
    async with am.open_device("cpu:34") as device:
        buf = await device.alloc(4096)
        operands = _queue.copy_operands
        freeing: list[Any] = []

        def checked_then_freed(*args: Any, **kwargs: Any) -> Any:
            checked = operands(*args, **kwargs)
            coro = buf.free()  # its part before the first await, as another thread's
            freeing.append(coro)
            with contextlib.suppress(StopIteration):
                coro.send(None)
            return checked

        monkeypatch.setattr(_queue, "copy_operands", checked_then_freed)
        with pytest.raises(am.ClosedResourceError, match="freed"):
            device.queue.copy(buf, np.full(4096, 7, np.uint8))
        monkeypatch.undo()
        with anyio.fail_after(LIMIT), contextlib.suppress(StopIteration, RuntimeError):
            await freeing[0]  # (its end)
        assert device.memory_statistics().in_use == 0


@pytest.mark.anyio
async def test_a_free_cancelled_while_another_thread_submits_still_waits_for_that_submission(
    anyio_backend: object,
) -> None:
    """Another thread is inside a copy's submission into the buffer (its hand-over slow,
    as a large pageable copy is on cuda) when the buffer is freed, and the free is
    cancelled at once (on asyncio by wait_for's timeout). The block is released only
    after that copy recorded its use, so the next owner's data stays its own (before, a
    cancelled free released it at once, and the copy landed in the next owner's)."""
    async with am.open_device("cpu:39") as device:
        sleep = await device.compile(KERNELS, "sleep_ms")
        queue = device.new_queue()
        buf = await device.alloc(MiB)
        queue.launch(sleep, vals=(400,))  # the copy runs after this
        inside = threading.Event()
        copyin = queue._native.copyin

        def slow_copyin(*args: Any) -> None:  # (under the submission lock)
            inside.set()
            time.sleep(0.2)
            copyin(*args)

        queue._native.copyin = slow_copyin  # type: ignore[method-assign]
        submitting = threading.Thread(target=queue.copy, args=(buf, np.ones(MiB // 4, np.int32)))
        submitting.start()
        inside.wait()
        if am._bridge.running_asyncio_loop() is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(buf.free(), 0.02)
        else:
            with anyio.move_on_after(0.02):
                await buf.free()
        with anyio.fail_after(LIMIT):
            following = await device.alloc(MiB)
            await following.write(np.zeros(MiB // 4, np.int32))
            submitting.join()
            await queue.synchronize()
            assert not (await following.read(np.int32)).any()
        await following.free()


def test_a_free_never_holds_up_another_devices_submissions() -> None:
    """While a slow submission holds device B's submission lock, a free on another
    thread waits for it -- and holds no other device's lock meanwhile: a loop copying
    to device A is not held up (before, the free held A's lock as it waited for B's,
    and A's copy blocked its loop for the whole hand-over). B's submission goes on once
    the loop's copies to A returned (or after a minute: then A's copy waited for it)."""

    async def main() -> bool:
        a, b = await am.open_device("cpu:40"), await am.open_device("cpu:41")
        queue = b.new_queue()
        b_buf, a_buf, to_free = await b.alloc(4096), await a.alloc(4096), await a.alloc(64)
        inside, go = threading.Event(), threading.Event()
        copyin = queue._native.copyin
        held_up = []

        def slow_copyin(*args: Any) -> None:
            inside.set()
            held_up.append(not go.wait(60))
            copyin(*args)

        queue._native.copyin = slow_copyin  # type: ignore[method-assign]
        submitting = threading.Thread(target=queue.copy, args=(b_buf, np.ones(1024, np.int32)))
        submitting.start()
        inside.wait()
        freeing = threading.Thread(target=asyncio.run, args=(to_free.free(),))
        freeing.start()
        await asyncio.sleep(0.02)  # (the free waits for B's lock now)
        for _ in range(10):
            a.queue.copy(a_buf, np.zeros(1024, np.int32))
            await asyncio.sleep(0.01)
        go.set()
        submitting.join()
        freeing.join()
        await queue.synchronize()
        await a.close()
        await b.close()
        return held_up == [False]

    assert asyncio.run(main()), "a copy to A waited for B's submission"


@pytest.mark.anyio
async def test_a_loan_an_idle_queue_of_another_device_kept_comes_back_to_a_waiting_allocation(
    anyio_backend: object,
) -> None:
    """A DLPack view of a cpu buffer's memory is a copy's host source on cpu:1's queue,
    then let go of; the buffer is freed (the free waits for the copy, a use of its
    memory) and an allocation waits for its memory. Once the copy has run, the
    allocation gets it, though cpu:1's queue submits nothing more (before, it waited
    until that queue's next submission)."""
    async with am.open_device("cpu:35") as device, am.open_device("cpu:36") as other:
        device.memory_budget = MiB
        a = await device.alloc(MiB)
        view = np.from_dlpack(a)
        target, gate = await other.alloc(MiB), other.timeline()
        other.queue.wait(gate, 1)  # (holds the copy until the allocation waits)
        copied = other.queue.copy(target, view)
        del view
        gc.collect()
        async with anyio.create_task_group() as tg:
            got: list[am.Buffer] = []

            async def allocate() -> None:
                got.append(await device.alloc(MiB))

            tg.start_soon(a.free)
            await anyio.sleep(0.05)
            assert a.freed
            tg.start_soon(allocate)
            await anyio.sleep(0.1)
            gate.signal(1)
            with anyio.fail_after(LIMIT):
                await copied
                while not got:
                    await anyio.sleep(0.01)
        await got[0].free()
        await target.free()


def test_an_allocation_inside_the_backend_as_the_device_closes_counts_nothing_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The device closes while an allocation is inside the backend's allocate (its
    bytes reserved): the close counts them out, and the allocation does not again
    (before, in_use went negative)."""

    async def main() -> am.MemoryStatistics:
        device = await am.open_device("cpu:37")
        backend = device._backend
        allocate = backend.allocate

        def allocate_as_it_closes(nbytes: int) -> Any:
            handle = allocate(nbytes)
            device._allocator.close(dict)  # what the close does (nothing of it in use)
            return handle

        monkeypatch.setattr(backend, "allocate", allocate_as_it_closes)
        with pytest.raises(am.ClosedResourceError):
            await device.alloc(4096)
        statistics = device.memory_statistics()
        monkeypatch.undo()
        await device.close()
        return statistics

    assert anyio.run(main).in_use == 0


def test_a_close_waits_for_another_threads_allocation_inside_the_backend(
    anyio_backend: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop on another thread is inside the backend's allocate as the device closes:
    the close waits for it, the allocation frees what it got and raises
    ClosedResourceError, and nothing of it calls the backend after the backend's close."""
    name, options = anyio_backend

    async def open_device() -> am.Device:
        return await am.open_device("cpu:46")

    dev = anyio.run(open_device, backend=name, backend_options=options)
    backend = dev._backend
    allocate = backend.allocate
    calls = _record_frees_and_close(monkeypatch, backend)
    inside, go_on = threading.Event(), threading.Event()

    def blocked_allocate(nbytes: int) -> Any:
        calls.append("allocate")
        inside.set()
        go_on.wait(LIMIT)
        return allocate(nbytes)

    monkeypatch.setattr(backend, "allocate", blocked_allocate)
    failures: list[BaseException] = []

    async def allocate_as_it_closes() -> None:
        with pytest.raises(am.ClosedResourceError):
            await dev.alloc(MiB)

    def loop() -> None:
        try:
            anyio.run(allocate_as_it_closes, backend=name, backend_options=options)
        except BaseException as exc:
            failures.append(exc)

    async def close_as_it_allocates() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(dev.close)
            with anyio.fail_after(LIMIT):
                while not dev._allocator.closed:
                    await anyio.sleep(0.001)
            await anyio.sleep(0.1)  # a close that did not wait would go on meanwhile
            go_on.set()

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        assert inside.wait(LIMIT)
        anyio.run(close_as_it_allocates, backend=name, backend_options=options)
    finally:
        go_on.set()
        thread.join(LIMIT)
    assert not thread.is_alive() and not failures
    assert calls == ["allocate", "free", "close"]
    assert backend.live_allocations == 0  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_empty_memory_cache_as_the_device_closes_frees_before_the_backend_closes(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """empty_memory_cache runs as the device closes, just after the close freed the
    blocks being released: the cached blocks are freed natively (by the close, or by
    empty_memory_cache with the close waiting for it) before the backend closes, never
    after. Checked failing without: the close ended with the cache emptied under it and
    the block was freed after the backend's close."""
    dev = await am.open_device("cpu:49")
    backend, allocator = dev._backend, dev._allocator
    await (await dev.alloc(MiB)).free()  # cached
    close_passed, emptied, backend_closed = threading.Event(), threading.Event(), threading.Event()
    calls = _record_frees_and_close(monkeypatch, backend, backend_closed)
    free_releasing = allocator._free_releasing
    seen = [0]

    def widened_free_releasing() -> None:
        seen[0] += 1
        if seen[0] == 1:  # the close's: the cache is emptied right after it
            free_releasing()
            close_passed.set()
            emptied.wait(LIMIT)
        else:  # empty_memory_cache's thread: late, as late as it may be
            backend_closed.wait(1)
            free_releasing()

    monkeypatch.setattr(allocator, "_free_releasing", widened_free_releasing)

    async def empty() -> None:
        try:
            await dev.empty_memory_cache()
        finally:
            emptied.set()

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(dev.close)
            assert await anyio.to_thread.run_sync(close_passed.wait, LIMIT)
            tg.start_soon(empty)
            while not (allocator._releasing or emptied.is_set()):
                await anyio.sleep(0.001)
            emptied.set()  # taken out of the cache (or refused): the close goes on
    assert calls == ["free", "close"]
    assert backend.live_allocations == 0  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_a_free_the_gc_makes_as_the_cpu_freer_starts_starts_no_second_one(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cpu backend starts its freer thread at its first free: a free from a
    finalizer the GC runs right then (inside that first free, its lock held) starts no
    second one, and the close stops the one there is. Checked failing without: two
    freer threads, of which the close stopped one (the other waited for good, or took
    the close's stop and left the close waiting for good)."""
    dev = await am.open_device("cpu:50")
    backend = dev._backend
    first, second = backend.allocate(4096), backend.allocate(4096)
    made: list[threading.Thread] = []
    thread_class = threading.Thread

    class GCInside(thread_class):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if kwargs.get("name") == "asyncmetal-cpu-free":
                made.append(self)
                if len(made) == 1:  # what a finalizer the GC ran here would do
                    backend.free(second)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(threading, "Thread", GCInside)
    backend.free(first)
    monkeypatch.undo()
    try:
        assert len(made) == 1
    finally:
        for _ in made[1:]:  # (without: let the extra ones end, or the close would hang)
            backend._freer.frees.put(None)  # type: ignore[attr-defined]
        await dev.close()
    assert not any(thread.is_alive() for thread in made)
    assert backend.live_allocations == 0  # type: ignore[attr-defined]
    assert first.array.size == second.array.size == 0  # both let go of


def test_allocations_on_loops_in_several_threads_stay_within_the_budget(
    anyio_backend: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    name, options = anyio_backend

    async def open_device() -> am.Device:
        return await am.open_device("cpu:8")

    dev = anyio.run(open_device, backend=name, backend_options=options)
    dev.memory_budget = MiB
    backend = dev._backend
    real = backend.allocate
    entered = threading.Barrier(2, timeout=0.5)

    def slow_allocate(nbytes: int) -> Any:
        # Give the other thread the chance to pass the budget check meanwhile; if
        # only one gets here, the other waits for memory, as it must.
        with contextlib.suppress(threading.BrokenBarrierError):
            entered.wait()
        return real(nbytes)

    monkeypatch.setattr(backend, "allocate", slow_allocate)
    over: list[int] = []

    async def allocate_and_free(size: int) -> None:
        with anyio.fail_after(LIMIT):
            buf = await dev.alloc(size)
            stats = dev.memory_statistics()
            if stats.in_use + stats.cached > stats.budget:
                over.append(stats.in_use + stats.cached)
            await anyio.sleep(0.01)
            await buf.free()
            dev._allocator.trim()  # the next allocation calls the backend again

    def loop(size: int) -> None:
        anyio.run(allocate_and_free, size, backend=name, backend_options=options)

    try:
        threads = [threading.Thread(target=loop, args=(MiB - i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(LIMIT * 2)
        assert not any(thread.is_alive() for thread in threads)
        assert not over, f"held {over} bytes under a budget of {MiB}"
        assert dev.memory_statistics().peak <= MiB
    finally:
        anyio.run(dev.close, backend=name, backend_options=options)


@pytest.mark.anyio
async def test_closing_a_device_keeps_memory_another_device_still_reads(
    device: am.Device, kernels: dict[str, am.Program], monkeypatch: pytest.MonkeyPatch
) -> None:
    other = await am.open_device("cpu:4")
    src = await other.alloc(MiB)
    await src.write(np.full(MiB, 7, np.uint8))
    dst = await device.alloc(MiB)
    device.queue.launch(kernels["sleep_ms"], vals=(200,))
    copied = device.queue.copy(dst, src)  # device's queue reads other's memory, later
    freed_early: list[bool] = []
    real_free = other._backend.free

    def free(handle: Any) -> None:
        freed_early.append(not copied.done())
        real_free(handle)

    monkeypatch.setattr(other._backend, "free", free)
    with anyio.fail_after(LIMIT):
        await other.close()
        await copied
    assert freed_early and not any(freed_early), "freed before the other device's copy ran"
    assert (await dst.read()).min() == 7
    await dst.free()


@pytest.mark.anyio
async def test_closing_a_device_never_frees_memory_a_held_copy_will_read(
    device: am.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The other device's copy waits for a value only the host will signal: closing
    # cannot wait for it, so it must leave the memory allocated rather than free it.
    other = await am.open_device("cpu:4")
    src = await other.alloc(MiB)
    await src.write(np.full(MiB, 3, np.uint8))
    dst = await device.alloc(MiB)
    gate = device.timeline()
    device.queue.wait(gate, 1)
    copied = device.queue.copy(dst, src)
    freed: list[object] = []
    monkeypatch.setattr(other._backend, "free", freed.append)
    with anyio.fail_after(LIMIT):
        await other.close()  # returns: it does not wait for the host's signal
        assert src._allocation.handle not in freed
        gate.signal(1)
        await copied
    assert (await dst.read()).min() == 3
    await dst.free()


@pytest.mark.anyio
@pytest.mark.parametrize("signalled", [False, True], ids=["abandoned", "ran"])
async def test_memory_a_close_left_to_another_devices_held_copy_is_freed_once_that_device_closes(
    anyio_backend: object, signalled: bool
) -> None:
    """A close leaves memory that another device's copy, held behind a wait nobody has
    signalled, will read (see the test above). Once the copy ran, the next look at any
    device's memory frees it (off the loop); abandoned, that device's close frees it.
    Checked: before, it stayed allocated for good (a cpu backend's count of live
    allocations stayed at 1)."""
    reader = await am.open_device("cpu:5")
    owner = await am.open_device("cpu:4")
    src = await owner.alloc(MiB)
    await src.write(np.full(MiB, 3, np.uint8))
    dst = await reader.alloc(MiB)
    gate = reader.timeline()
    held = reader.new_queue()
    held.wait(gate, 1)
    copied = held.copy(dst, src)
    del src
    backend = owner._backend
    with anyio.fail_after(LIMIT):
        await owner.close()  # left allocated: the held copy will read it
        assert backend.live_allocations == 1  # type: ignore[attr-defined]
        if signalled:
            gate.signal(1)
            await copied
            assert (await dst.read()).min() == 3
            reader.memory_statistics()  # a look: hands the free to the emptying thread
            await _after_the_emptying_thread()
            assert backend.live_allocations == 0  # type: ignore[attr-defined]
        await reader.close()
    assert backend.live_allocations == 0  # type: ignore[attr-defined]


async def _after_the_emptying_thread() -> None:
    """Returns once what was handed to the thread that empties caches before has run
    (it runs what it is given in turn)."""
    done = threading.Event()
    _allocator._EMPTYING.submit(done.set)
    await anyio.to_thread.run_sync(done.wait)


@pytest.mark.anyio
@pytest.mark.parametrize(
    "dtype",
    [object, np.dtype([("a", np.int32), ("b", object)]), np.dtype((object, 2))],
    ids=["object", "struct-with-object", "subarray-of-object"],
)
async def test_dtypes_holding_python_objects_are_refused(device: am.Device, dtype: Any) -> None:
    buf = await device.alloc(64)
    await buf.write(np.arange(64, dtype=np.uint8))
    with pytest.raises(am.ArgumentTypeError, match="dtype"):
        await buf.read(dtype)
    with pytest.raises(am.ArgumentTypeError, match="dtype"):
        await buf.map(dtype)
    objects = np.empty(64 // np.dtype(dtype).itemsize or 1, dtype)
    with pytest.raises(am.ArgumentTypeError, match="data"):
        await buf.write(objects)
    with pytest.raises(am.ArgumentTypeError, match="src"):
        await am.copy(buf, objects, nbytes=8)
    with pytest.raises(am.ArgumentTypeError, match="dst"):
        await am.copy(objects, buf, nbytes=8)
    with pytest.raises(am.ArgumentTypeError, match="dst"):
        device.queue.copy(objects, buf, nbytes=8)
    with pytest.raises(am.ArgumentTypeError, match="src"):
        device.queue.copy(buf, objects, nbytes=8)
    assert (await buf.read()).tolist() == list(range(64))  # nothing was written
    await buf.free()


@pytest.mark.anyio
async def test_from_numpy_refuses_arrays_holding_python_objects(device: am.Device) -> None:
    for dtype in (object, np.dtype([("a", np.int32), ("b", object)])):
        with pytest.raises(am.ArgumentTypeError, match="array"):
            await am.from_numpy(np.empty(4, dtype))
    plain = await am.from_numpy(np.arange(8, dtype=np.uint8))
    buf = await device.alloc(8)
    await am.copy(buf, plain)
    assert (await buf.read()).tolist() == list(range(8))
    await buf.free()


@pytest.mark.anyio
async def test_zero_size_and_unknown_dtypes_are_refused(device: am.Device) -> None:
    buf = await device.alloc(16)
    for dtype in ("V0", np.dtype([])):
        with pytest.raises(am.InvalidArgumentError, match="dtype"):
            await buf.read(dtype)
        with pytest.raises(am.InvalidArgumentError, match="dtype"):
            await buf.map(dtype)
    with pytest.raises(am.ArgumentTypeError, match="dtype"):
        await buf.read("not a dtype")
    assert (await buf.read(np.int32)).shape == (4,)
    await buf.free()


def test_gc_of_a_buffer_on_another_thread_wakes_the_waiting_loop(
    anyio_backend: tuple[str, dict[str, Any]],
) -> None:
    async def scenario() -> None:
        async with am.open_device("cpu:3") as dev:
            dev.memory_budget = MiB
            holder = [await dev.alloc(MiB)]
            gc.collect()

            def drop() -> None:
                holder.clear()

            async def drop_later() -> None:
                await anyio.sleep(0.05)
                threading.Thread(target=drop).start()

            with anyio.fail_after(LIMIT):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(drop_later)
                    buf = await dev.alloc(MiB)
            await buf.free()

    name, options = anyio_backend
    anyio.run(scenario, backend=name, backend_options=options)


async def _result_or_closed(call: Callable[[], Awaitable[object]], into: list[object]) -> None:
    """Append what ``call()`` returns, or the ClosedResourceError it raises."""
    try:
        into.append(await call())
    except am.ClosedResourceError as exc:
        into.append(exc)


@pytest.mark.anyio
async def test_map_of_a_buffer_freed_while_it_waits_raises(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """``map`` waits for the commands using the buffer; a free (or the device's close)
    meanwhile makes it raise, rather than hand out a view of memory the next allocation
    gets. Checked: before, it returned the view, which then showed the next buffer's
    data."""
    buf = await device.alloc(16)
    gate = device.timeline()
    device.queue.wait(gate, 1)
    device.queue.launch(kernels["fill"], buf, vals=(1, 4))
    outcome: list[object] = []
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_result_or_closed, lambda: buf.map(np.int32), outcome)
            await anyio.sleep(0.02)
            tg.start_soon(buf.free)
            await anyio.sleep(0.02)
            gate.signal(1)
    assert len(outcome) == 1 and isinstance(outcome[0], am.ClosedResourceError), outcome
    assert "was freed" in str(outcome[0])


@pytest.mark.anyio
@pytest.mark.metal
@pytest.mark.skipif("metal" not in am.devices(), reason="needs Metal (or its simulation)")
async def test_a_copy_between_kinds_of_a_source_freed_as_it_settles_raises(
    anyio_backend: object,
) -> None:
    """A copy from a cpu buffer to a Metal one waits for the source's writers, then
    reads it in place: a free of the source meanwhile makes it raise, rather than copy
    memory that another buffer may have by then. Checked: before, it copied."""
    cpu, metal = await am.open_device("cpu"), await am.open_device("metal")
    try:
        fill = await cpu.compile(KERNELS, "fill")
        src, dst = await cpu.alloc(16), await metal.alloc(16)
        gate = cpu.timeline()
        cpu.queue.wait(gate, 1)
        cpu.queue.launch(fill, src, vals=(1, 4))
        outcome: list[object] = []
        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_result_or_closed, lambda: am.copy(dst, src), outcome)
                await anyio.sleep(0.02)  # it waits for the fill
                tg.start_soon(src.free)
                await anyio.sleep(0.02)
                gate.signal(1)
        assert len(outcome) == 1 and isinstance(outcome[0], am.ClosedResourceError), outcome
        assert "src was freed" in str(outcome[0])
    finally:
        await cpu.close()
        await metal.close()


@pytest.mark.anyio
async def test_a_dlpack_view_a_finished_copy_kept_lets_its_memory_come_back(
    anyio_backend: object,
) -> None:
    """A DLPack view of a buffer's own memory, used as a copy's host source, is let go
    of by the consumer and the buffer freed: an allocation that needs that memory gets
    it, though nothing more is submitted to the queue that copied. Checked: before, the
    queue kept the view (so the loan, so the block) until its next submission, and the
    allocation waited for good (numpy imports cpu memory only)."""
    async with am.open_device("cpu:32") as device:
        device.memory_budget = 2 * MiB
        a, b = await device.alloc(MiB), await device.alloc(MiB)
        view = np.from_dlpack(a)
        await b.write(view)  # done: nothing in flight
        del view
        gc.collect()
        await a.free()
        await _gets_a_mib(device, b)


@pytest.mark.anyio
async def test_a_buffer_freed_on_another_thread_as_it_is_exported_is_not_lent(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread frees the buffer after the export checked it: the export is
    refused, and the block goes back unlent (before, the block, released meanwhile, was
    lent from the allocator's cache: its next owner's memory held by a stale loan)."""
    async with am.open_device("cpu:38") as device:
        buf = await device.alloc(4096)
        order = _dlpack._order_for_consumer

        def checked_then_freed(*args: Any) -> None:  # (after the export's checks)
            order(*args)
            # What free() does before it awaits, as another thread's free would now.
            buf._allocation.freed = buf._allocation.block.freed = True
            device._allocator.release_after(buf._allocation.block, [])

        monkeypatch.setattr(_dlpack, "_order_for_consumer", checked_then_freed)
        with pytest.raises(am.ClosedResourceError, match="freed as it was exported"):
            np.from_dlpack(buf)
        monkeypatch.undo()
        again = await device.alloc(4096)  # the cached block, not lent
        assert not again._allocation.block.lent
        await again.free()
        assert device.memory_statistics().in_use == 0


@pytest.mark.anyio
async def test_a_buffer_freed_and_its_block_handed_out_again_as_it_is_exported_is_not_lent(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, and the block, back in the cache, is handed out again to a new buffer
    (the loop allocates) before the export lends it: the export is refused. Checked:
    before, the block -- live again, under a new generation -- was lent, the old
    buffer's consumer getting a view of the new buffer's memory."""
    async with am.open_device("cpu:39") as device:
        buf = await device.alloc(4096)
        allocator = device._allocator
        order = _dlpack._order_for_consumer
        again: list[Any] = []

        def checked_then_freed_and_reused(*args: Any) -> None:  # (after the checks)
            order(*args)
            buf._allocation.freed = buf._allocation.block.freed = True
            allocator.release_after(buf._allocation.block, [])
            # What the loop's next alloc(4096) does meanwhile: takes the cached block.
            again.append(allocator._try_alloc(4096, allocator._usable_size(4096)))

        monkeypatch.setattr(_dlpack, "_order_for_consumer", checked_then_freed_and_reused)
        with pytest.raises(am.ClosedResourceError, match="freed as it was exported"):
            np.from_dlpack(buf)
        monkeypatch.undo()
        assert again[0].block is buf._allocation.block  # the same block, handed out anew
        assert not again[0].block.lent


@pytest.mark.anyio
@pytest.mark.parametrize("export", ["dlpack", "copy"])
async def test_a_buffer_whose_device_closes_as_it_is_exported_names_the_close(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, export: str
) -> None:
    """Another thread exports the buffer; the device closes after the export checked it,
    before it lends the memory: the export raises ClosedResourceError naming the close
    (nothing freed the buffer), and the close left nothing lent. Checked: fails without
    the fix (it said the buffer was freed as it was exported)."""
    device = await am.open_device("cpu:40")
    buf = await device.alloc(4096)
    order = _dlpack._order_for_consumer
    checked, closed = threading.Event(), threading.Event()

    def checked_then_closed(*args: Any) -> None:  # (after the export's checks)
        order(*args)
        checked.set()
        assert closed.wait(10)

    def exported() -> object:
        if export == "copy":  # copy=True: a host copy, made of the memory at once
            return buf.__dlpack__(copy=True)
        return np.from_dlpack(buf)

    monkeypatch.setattr(_dlpack, "_order_for_consumer", checked_then_closed)
    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:

                async def close_once_checked() -> None:
                    assert await anyio.to_thread.run_sync(checked.wait, 10)
                    await device.close()
                    closed.set()

                tg.start_soon(close_once_checked)
                with pytest.raises(am.ClosedResourceError) as refused:
                    await anyio.to_thread.run_sync(exported)
    finally:
        closed.set()
        await device.close()
    assert str(refused.value) == (
        "the buffer's device cpu:40 was closed as the buffer was exported (the close "
        "freed its memory)"
    )
    assert not buf._allocation.block.lent and not device._allocator._left_lent


@pytest.mark.anyio
async def test_exported_buffers_leave_no_record_once_released(anyio_backend: object) -> None:
    """A buffer exported through DLPack, then freed: the allocator forgets the export,
    so its memory (freed natively, or cached and handed out again) is not kept alive.
    Checked: before, each export's record stayed until the next ``am.from_dlpack`` (8
    buffers of 64 MiB under an 80 MiB budget grew the process by 448 MiB)."""
    async with am.open_device("cpu:34") as device:
        for i in range(8):
            buf = await device.alloc(MiB + i)  # sizes the cache does not reuse
            view = np.from_dlpack(buf)
            del view
            gc.collect()
            await buf.free()
        device.memory_statistics()  # (sweeps: the last loan's return)
        assert not device._allocator._exported


@pytest.mark.anyio
async def test_buffers_dropped_after_their_device_closed_are_let_go_of(
    anyio_backend: object,
) -> None:
    """Checked: before, the closed device's allocator queued them for a sweep that never
    came, keeping their memory while the Device object lived."""
    device = await am.open_device("cpu:35")
    bufs = [await device.alloc(MiB) for _ in range(4)]
    memory = [weakref.ref(buf._allocation.handle.array) for buf in bufs]
    await device.close()
    del bufs
    gc.collect()
    assert not device._allocator._collected
    assert all(ref() is None for ref in memory)


@pytest.mark.anyio
async def test_memory_lent_out_past_a_close_is_freed_when_its_last_loan_ends(
    anyio_backend: object,
) -> None:
    """A buffer's memory held by a consumer (DLPack: a numpy array, an unconsumed
    capsule) as its device closes stays allocated until the consumer lets go, and is
    freed natively then (before, nothing freed it: device memory stayed allocated until
    the process exited)."""
    device = await am.open_device("cpu:43")
    viewed, captured, lent_before = [await device.alloc(4096) for _ in range(3)]
    view = np.from_dlpack(viewed)
    capsule = captured.__dlpack__()
    gone = np.from_dlpack(lent_before)
    del gone  # a loan that ended before the close: freed by it
    gc.collect()
    await device.close()
    assert device._backend.live_allocations == 2
    del view
    gc.collect()
    assert device._backend.live_allocations == 1
    del capsule
    gc.collect()
    assert device._backend.live_allocations == 0


@pytest.mark.anyio
async def test_a_loan_ending_as_the_close_leaves_its_block_lent_still_frees_it(
    anyio_backend: object,
) -> None:
    """A buffer's last loan ends on another thread just as the device's close finds the
    buffer lent and leaves its block allocated for the loan: the block is freed all the
    same (by the loan's end or by the close), once. Checked failing without: the loan's
    end found the block not yet left to it and the close left it for a loan already
    over, allocated for as long as the device object lived."""
    dev = await am.open_device("cpu:51")
    buf = await dev.alloc(4096)
    views = [np.from_dlpack(buf)]
    allocator, backend = dev._allocator, dev._backend
    endings: list[threading.Thread] = []

    class LeftAsTheLoanEnds(set):  # type: ignore[type-arg]
        def add(self, block: Any) -> None:  # the close found the block lent
            ending = threading.Thread(target=views.clear)  # its loan ends meanwhile
            endings.append(ending)
            ending.start()
            ending.join(0.5)  # (where the loan's end waits for the close: not long)
            super().add(block)

    allocator._left_lent = LeftAsTheLoanEnds()
    await dev.close()
    assert len(endings) == 1
    endings[0].join(LIMIT)
    assert not endings[0].is_alive()
    assert backend.live_allocations == 0  # type: ignore[attr-defined]
    assert not allocator._left_lent
    del buf


@pytest.mark.anyio
async def test_a_loan_end_a_sweep_takes_up_as_the_device_closes_frees_its_block(
    anyio_backend: object,
) -> None:
    """A freed buffer's last loan ended (queued for a sweep), and the close comes as
    the sweep looks at the queue: the loan's end is counted once, by the close or by
    the sweep seeing the close, and the block is freed. (A sweep once took the loan's
    end off the queue before its lock and counted it after: a close between the two
    left the block to the loan, which nothing freed. It now takes it off and counts it
    in one run under the lock, which the close takes too.)"""
    dev = await am.open_device("cpu:52")
    buf = await dev.alloc(4096)
    view = np.from_dlpack(buf)
    await buf.free()  # released once its loan ends
    allocator, backend = dev._allocator, dev._backend
    with allocator._lock:  # (its loan's end only tries it)
        del view  # its loan ends: queued for the next sweep
    assert allocator._returned
    closing = [True]

    class ClosesAsItIsLookedAt(collections.deque):  # type: ignore[type-arg]
        def __len__(self) -> int:
            if closing:
                closing.clear()
                allocator.close(dict)  # what the device's close does (on another thread)
            return super().__len__()

    allocator._returned = ClosesAsItIsLookedAt(allocator._returned)
    dev.memory_statistics()  # sweeps
    assert not closing
    assert backend.live_allocations == 0  # type: ignore[attr-defined]
    assert not allocator._left_lent
    await dev.close()


@pytest.mark.anyio
async def test_a_buffer_context_ends_quietly_once_its_device_closed(device: am.Device) -> None:
    """``async with await dev.alloc(n) as buf:`` around a close of the device: the close
    freed it. Checked: before, leaving the block raised ClosedResourceError (hiding the
    body's own exception, if any)."""
    other = await am.open_device(device.name)
    async with await other.alloc(16):
        await other.close()


@pytest.mark.anyio
@pytest.mark.parametrize("timeout", [float("nan"), -1.0])
async def test_an_allocation_refuses_a_bad_timeout(device: am.Device, timeout: object) -> None:
    """Checked: before, NaN reached anyio (a bare ValueError)."""
    with pytest.raises(am.InvalidArgumentError, match="timeout"):
        await device.alloc(16, timeout=timeout)  # type: ignore[arg-type]


@pytest.mark.anyio
@pytest.mark.parametrize("timeout", [True, "1", 1j])
async def test_an_allocation_refuses_a_timeout_of_the_wrong_type_as_a_type_error(
    device: am.Device, timeout: object
) -> None:
    """As a compile's timeout is refused. Checked: before, InvalidArgumentError (and
    before that, True meant 1 s)."""
    with pytest.raises(am.ArgumentTypeError, match="timeout"):
        await device.alloc(16, timeout=timeout)  # type: ignore[arg-type]


@pytest.mark.anyio
@pytest.mark.parametrize("timeout", [10**400, 1e300, float("inf")], ids=["int", "float", "inf"])
async def test_an_allocation_takes_a_timeout_too_long_for_a_clock_as_none(
    device: am.Device, timeout: float
) -> None:
    """A timeout beyond any deadline the clocks hold waits without one, as None does.
    Checked: before, an int too large for a float raised a bare OverflowError."""
    async with await device.alloc(16, timeout=timeout):
        pass


@pytest.mark.anyio
@pytest.mark.parametrize("setting", ["memory_budget", "memory_cache_limit"])
async def test_memory_settings_refuse_a_wrong_type_as_a_type_error(
    device: am.Device, setting: str
) -> None:
    """A value of the wrong type raises ArgumentTypeError, as alloc's nbytes does; a
    wrong int, InvalidArgumentError. Checked: before, both raised InvalidArgumentError."""
    before = getattr(device, setting)
    for bad in (1.5, "1024", True, float("nan")):
        with pytest.raises(am.ArgumentTypeError, match=setting):
            setattr(device, setting, bad)
    with pytest.raises(am.InvalidArgumentError, match=setting):
        setattr(device, setting, -1)
    assert getattr(device, setting) == before


@pytest.mark.anyio
async def test_peak_counts_only_memory_held(anyio_backend: object) -> None:
    """An allocation the device itself cannot make reserves its bytes a moment; the
    peak counts what was held. Checked: before, it counted the refused request."""
    async with am.open_device("cpu:36") as device:
        held = await device.alloc(64)

        def full(nbytes: int) -> object:
            raise MemoryError("device full")

        device._backend.allocate = full  # type: ignore[method-assign]
        with anyio.move_on_after(0.2):
            await device.alloc(MiB)
        assert device.memory_statistics().peak == 512  # the 64 bytes' size class
        await held.free()


@pytest.mark.anyio
async def test_an_allocation_waiting_while_the_device_is_full_does_not_spin(
    anyio_backend: object,
) -> None:
    """The device itself full (its allocator refuses) while a buffer is held: the
    allocation waits for a release, trying again now and then, and gets its block once
    the buffer is freed. Checked: before, its own failed attempt counted as a release
    and it tried again at once, for good (about 100,000 native attempts a second on
    the loop)."""
    async with am.open_device("cpu:37") as dev:
        backend = dev._allocator._state.backend
        allocate, attempts = backend.allocate, [0]

        def full_beyond_one(nbytes: int) -> Any:
            attempts[0] += 1
            if backend.live_allocations >= 1:
                raise MemoryError("the device is full")
            return allocate(nbytes)

        backend.allocate = full_beyond_one  # type: ignore[method-assign]
        held = await dev.alloc(1 << 20)
        got: list[am.Buffer] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: _append(got, dev.alloc(1 << 20)))
            await anyio.sleep(0.05)
            attempts[0] = 0
            await anyio.sleep(0.3)
            assert not got and attempts[0] < 300, attempts[0]  # (about 60: 2 in 10 ms)
            await held.free()
        assert got
        backend.allocate = allocate  # type: ignore[method-assign]
        await got[0].free()


async def _append(into: list[Any], awaitable: Any) -> None:
    into.append(await awaitable)


def _record_frees_and_close(
    monkeypatch: pytest.MonkeyPatch, backend: Any, closed: threading.Event | None = None
) -> list[str]:
    """The list ``backend``'s frees and close append "free" and "close" to (the event
    set once it closed)."""
    free, close = backend.free, backend.close
    calls: list[str] = []

    def recorded_free(handle: Any) -> None:
        calls.append("free")
        free(handle)

    def recorded_close() -> None:
        calls.append("close")
        close()
        if closed is not None:
            closed.set()

    monkeypatch.setattr(backend, "free", recorded_free)
    monkeypatch.setattr(backend, "close", recorded_close)
    return calls


@pytest.mark.anyio
@pytest.mark.parametrize("cached", [False, True], ids=["native", "cached"])
async def test_a_keyboard_interrupt_inside_an_allocation_leaves_no_allocation_under_way(
    anyio_backend: object, cached: bool
) -> None:
    """A KeyboardInterrupt wherever CPython delivers one in an allocation's attempt
    leaves nothing counted as being allocated (a close waits for those to end: it
    would wait for good), no reservation behind (the bytes in use are those of the
    blocks handed out), and the cache whole."""
    codes = {Allocator._try_alloc.__code__, Allocator._hand_out.__code__}
    async with am.open_device("cpu") as dev:
        allocator = dev._allocator
        at = 0
        while True:
            if cached:
                await (await dev.alloc(MiB)).free()
            with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
                allocator._try_alloc(MiB, MiB)
            assert not allocator._allocating, f"an allocation left under way ({at})"
            live = sum(block.nbytes for block in allocator._live)
            assert allocator.in_use == live, f"a reservation left behind ({at})"
            allocator.close(dict)  # (frees everything, the cache too: whole)
            allocator.closed = False
            if not raised:
                break
            at += 1
        assert at >= 6


@pytest.mark.anyio
async def test_a_copy_done_before_it_was_awaited_lets_its_host_objects_go_once_awaited(
    device: am.Device,
) -> None:
    """The queue keeps a copy's host side alive until the copy has run; awaited, a
    copy done before lets it go at once, as one still running does: the array is
    freed, and a bytearray can be resized (while a view of it is kept, it cannot)."""
    gone, into = await copies_done_before_awaited(device)
    gc.collect()
    assert gone() is None, "the copy's source is kept alive"
    into.extend(b"!")  # (BufferError while a view of it is kept)
    assert bytes(into[:16]) == bytes(range(16))


@pytest.mark.anyio
async def test_a_detached_call_returning_as_its_caller_is_cancelled_reports_nothing(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call handed to a thread (a free's settling, a cache emptying) returns just as
    its caller is cancelled: the thread had taken its outcome, and the caller left
    before the thread looked again. Nothing went wrong, so nothing goes to ``unheard``
    (the device's close raises what does). The thread's "has the caller left" was the
    caller's own list where it had not left yet, which its leaving then filled: the
    call's result -- a free's list of uses -- went to ``unheard``, and the device's
    close raised TypeError on it. Checked failing without the fix."""
    from asyncmetal import _timeline

    detached = _timeline.Detached("asyncmetal test detached")
    unheard: list[object] = []
    returned, left, finished = threading.Event(), threading.Event(), threading.Event()
    increment = _timeline.HostEvents.increment

    def held(self: Any) -> int:
        # The call's thread, once it took the outcome: held until the caller left.
        if threading.current_thread().name == detached.name and not left.is_set():
            returned.set()
            left.wait(LIMIT)
        return increment(self)

    monkeypatch.setattr(_timeline.HostEvents, "increment", held)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:

            async def cancel_once_returned() -> None:
                await anyio.to_thread.run_sync(returned.wait, LIMIT)
                scope.cancel()

            tg.start_soon(cancel_once_returned)
            await _timeline.run_detached(detached, lambda: [("uses", 1)], unheard.append)
    assert scope.cancelled_caught
    left.set()
    detached.submit(finished.set)  # (after the call's own end)
    assert await anyio.to_thread.run_sync(finished.wait, LIMIT)
    assert unheard == []


@pytest.mark.anyio
async def test_a_timeline_the_runtime_has_no_memory_for_is_dropped_without_a_crash(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The native runtime had no memory for a cpu timeline (am_timeline_new returned
    NULL): timeline() raises a MemoryError, and the half-made timeline is collected
    freeing nothing. Checked: its finalizer freed NULL, and the process crashed."""
    from asyncmetal import _native

    async with am.open_device("cpu") as dev:
        with monkeypatch.context() as patched:
            patched.setattr(_native.runtime(), "am_timeline_new", lambda: 0)
            with pytest.raises(MemoryError):
                dev.timeline()
        gc.collect()
        assert dev.timeline().value == 0


@pytest.mark.anyio
@pytest.mark.parametrize("call", ["am_queue_new", "am_timeline_new"])
async def test_a_queue_or_timeline_the_runtime_has_no_memory_for_raises_an_asyncmetal_error(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """The native runtime had no host memory for a new queue or timeline (its call
    returned NULL): new_queue() and timeline() raise an AsyncMetalError that is a
    MemoryError, naming the call, and the device goes on. Checked: a bare MemoryError
    (no AsyncMetalError) before."""
    from asyncmetal import _native

    async with am.open_device("cpu") as dev:
        lib = _native.runtime()
        with monkeypatch.context() as patched:
            patched.setattr(lib, call, lambda *args: 0)
            for make in (dev.new_queue, dev.timeline):
                if call == "am_queue_new" and make == dev.timeline:
                    continue  # (a timeline alone makes no queue)
                with pytest.raises(am.AsyncMetalError, match=call) as caught:
                    make()
                assert isinstance(caught.value, MemoryError)
        buf = await dev.alloc(16)
        await dev.new_queue().copy(buf, np.arange(4, dtype=np.int32))
        assert list(await buf.read(np.int32)) == [0, 1, 2, 3]

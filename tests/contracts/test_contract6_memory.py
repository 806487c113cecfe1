"""Contract 6: memory is awaited, not failed. The allocator's cache, budget,
backpressure, deferred and collected frees, and zero-copy views."""

from __future__ import annotations

import gc
import os
import pickle
import threading
import time
import weakref
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from tests.support.threads import submission_lock_held

pytestmark = pytest.mark.anyio
MiB = 1 << 20


async def test_freed_blocks_are_reused_from_the_cache(device: am.Device) -> None:
    backend = device._backend
    buf = await device.alloc(MiB)
    handle = buf._allocation.handle
    natives = backend.live_allocations  # type: ignore[attr-defined]
    await buf.free()
    again = await device.alloc(MiB)
    assert again._allocation.handle is handle  # the same block, no native call
    assert backend.live_allocations == natives  # type: ignore[attr-defined]
    stats = device.memory_statistics()
    assert stats.in_use >= MiB and stats.cached == 0


async def test_backpressure_200_tasks_under_a_budget_of_10(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    device.memory_budget = 10 * MiB
    device._allocator.peak = 0
    done = []

    async def task(i: int) -> None:
        buf = await device.alloc(MiB)
        await device.queue.launch(kernels["fill"], buf, vals=(i, MiB // 4))
        assert (await buf.read(np.int32))[-1] == i
        await buf.free()
        done.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(200):
            tg.start_soon(task, i)
    assert sorted(done) == list(range(200))
    stats = device.memory_statistics()
    assert stats.peak <= 10 * MiB
    assert stats.in_use == 0


async def test_alloc_waits_for_deferred_free(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    device.memory_budget = MiB
    tl = device.timeline()
    first = await device.alloc(MiB)
    device.queue.wait(tl, 1)
    device.queue.launch(kernels["fill"], first, vals=(1, 4))
    got: list[am.Buffer] = []

    async def second() -> None:
        got.append(await device.alloc(MiB))

    async with anyio.create_task_group() as tg:
        tg.start_soon(first.free)  # deferred: the launch is still waiting on tl
        tg.start_soon(second)
        await anyio.sleep(0.05)
        assert not got, "the allocation must wait for the in-flight free"
        assert device.memory_statistics().in_use == MiB
        tl.signal(1)
    assert len(got) == 1
    assert got[0]._allocation.handle is first._allocation.handle


async def test_collected_buffer_is_freed_after_its_last_use(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    device.memory_budget = MiB
    tl = device.timeline()
    buf = await device.alloc(MiB)
    device.queue.wait(tl, 1)
    done = device.queue.launch(kernels["fill"], buf, vals=(1, 4))
    del buf
    gc.collect()
    got: list[am.Buffer] = []

    async def second() -> None:
        got.append(await device.alloc(MiB))

    async with anyio.create_task_group() as tg:
        tg.start_soon(second)
        await anyio.sleep(0.05)
        assert not got  # collected, but its launch has not run yet
        tl.signal(1)
    await done
    assert len(got) == 1


async def test_out_of_memory_names_the_numbers(device: am.Device) -> None:
    device.memory_budget = 4 * MiB
    held = await device.alloc(3 * MiB)
    with pytest.raises(am.OutOfMemoryError) as info:
        await device.alloc(5 * MiB)
    err = info.value
    assert (err.requested, err.in_use, err.budget) == (5 * MiB, 3 * MiB, 4 * MiB)
    assert f"cannot allocate {5 * MiB} bytes: {3 * MiB} in use, 0 cached, budget {4 * MiB}" in str(
        err
    )
    assert isinstance(err, MemoryError)
    with pytest.raises(am.OutOfMemoryError, match=r"no memory was freed within 0\.05 s"):
        await device.alloc(2 * MiB, timeout=0.05)
    await held.free()
    assert (await device.alloc(2 * MiB)).nbytes == 2 * MiB


async def test_out_of_memory_crosses_processes_whole(device: am.Device) -> None:
    """An OutOfMemoryError pickles as itself, its message and numbers kept, as every
    error asyncmetal raises does: one raised in a worker process reaches its parent
    (multiprocessing's and concurrent.futures' pools pickle a job's error; one that
    cannot be rebuilt there breaks the pool, or hangs ``Pool.get``)."""
    device.memory_budget = 4 * MiB
    held = await device.alloc(3 * MiB)
    with pytest.raises(am.OutOfMemoryError) as info:
        await device.alloc(2 * MiB, timeout=0)
    err = info.value
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is am.OutOfMemoryError
    assert str(again) == str(err) and "no memory was freed within 0 s" in str(again)
    numbers = ("requested", "in_use", "cached", "budget")
    assert [getattr(again, n) for n in numbers] == [getattr(err, n) for n in numbers]
    await held.free()


async def test_a_request_over_the_budget_says_what_to_do(device: am.Device) -> None:
    """Over a budget the program set: raise it or ask less; over the device's memory:
    ask less (checked: both said only 'larger than the device's whole budget')."""
    device.memory_budget = 4 * MiB
    total = device.total_memory
    raise_it = rf"raise its memory_budget \(the device has {total} bytes\) or allocate less"
    with pytest.raises(am.OutOfMemoryError, match=raise_it):
        await device.alloc(5 * MiB)
    device.memory_budget = None
    with pytest.raises(
        am.OutOfMemoryError, match="larger than the device's whole memory: allocate"
    ):
        await device.alloc(total + 1)


async def test_a_request_over_the_devices_memory_fails_under_a_budget_above_it(
    device: am.Device,
) -> None:
    """A budget may be set above the device's memory; a request larger than that
    memory still can never fit, so it fails at once rather than wait for frees while
    a buffer is held (checked: it waited for good)."""
    held = await device.alloc(MiB)
    device.memory_budget = 2 * device.total_memory
    with anyio.fail_after(10), pytest.raises(am.OutOfMemoryError, match="larger than the device"):
        await device.alloc(device.total_memory + 1)
    await held.free()


async def test_native_out_of_memory_empties_the_cache_then_retries(
    device: am.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached = await device.alloc(MiB)
    await cached.free()
    assert device.memory_statistics().cached == MiB
    backend = device._backend
    real = backend.allocate
    calls = []

    def flaky(nbytes: int) -> object:
        calls.append(nbytes)
        if len(calls) == 1:
            raise MemoryError("device full")
        return real(nbytes)

    monkeypatch.setattr(backend, "allocate", flaky)
    buf = await device.alloc(2 * MiB)
    assert buf.nbytes == 2 * MiB
    assert calls == [2 * MiB, 2 * MiB]
    assert device.memory_statistics().cached == 0  # emptied before the retry

    monkeypatch.setattr(backend, "allocate", lambda n: (_ for _ in ()).throw(MemoryError()))
    await buf.free()
    device._allocator.trim()
    with pytest.raises(am.OutOfMemoryError, match="the device itself has no memory left"):
        await device.alloc(3 * MiB)


async def test_lowering_the_budget_trims_the_cache(device: am.Device) -> None:
    bufs = [await device.alloc(MiB) for _ in range(4)]
    for b in bufs:
        await b.free()
    assert device.memory_statistics().cached == 4 * MiB
    device.memory_budget = 2 * MiB
    assert device.memory_statistics().cached <= 2 * MiB
    for bad in (0, -1, 1.5, True):
        with pytest.raises((am.InvalidArgumentError, am.ArgumentTypeError)):
            device.memory_budget = bad  # type: ignore[assignment]
    device.memory_budget = None  # back to the default: all the device has
    assert device.memory_budget == device._backend.info.total_memory


async def test_map_is_zero_copy_and_waits_for_pending_work(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    buf = await device.alloc(16)
    await buf.write(np.zeros(4, np.int32))
    tl = device.timeline()
    device.queue.wait(tl, 1)
    device.queue.launch(kernels["fill"], buf, vals=(9, 4))
    views: list[np.ndarray] = []

    async def mapper() -> None:
        views.append(await buf.map(np.int32))

    async with anyio.create_task_group() as tg:
        tg.start_soon(mapper)
        await anyio.sleep(0.05)
        assert not views  # not handed out while the launch is pending
        tl.signal(1)
    view = views[0]
    assert view.tolist() == [9, 9, 9, 9]
    view[0] = 5  # zero-copy: the device sees host writes
    assert (await buf.read(np.int32))[0] == 5


async def test_map_waits_for_commands_submitted_while_it_waits(device: am.Device) -> None:
    """Handed out once every command using the buffer has finished -- also one another
    queue took while map waited for the first (a DLPack export would be refused then).
    Checked: without it, the view came with the other queue's copy in flight."""
    buf = await device.alloc(16)
    first, second = device.timeline(), device.timeline()
    other = device.new_queue()
    device.queue.wait(first, 1)
    device.queue.copy(buf, np.full(4, 1, np.int32))
    views: list[np.ndarray] = []

    async def mapper() -> None:
        views.append(await buf.map(np.int32))

    async with anyio.create_task_group() as tg:
        tg.start_soon(mapper)
        await anyio.sleep(0.02)
        other.wait(second, 1)
        other.copy(buf, np.full(4, 2, np.int32))  # (ordered after the first copy)
        first.signal(1)
        await device.queue.synchronize()
        await anyio.sleep(0.05)
        assert not views  # not handed out while the other queue's copy is pending
        second.signal(1)
    assert views[0].tolist() == [2, 2, 2, 2]
    assert not buf.busy()


async def test_a_mapped_view_holds_its_memory_past_a_free(device: am.Device) -> None:
    """A map's view outlives the buffer's free: its memory goes to no other buffer until
    the view is gone (checked: before, the next allocation of the size got that memory,
    and writes through the stale view landed in the new owner's buffer)."""
    buf = await device.alloc(64)
    held = device.memory_statistics().in_use  # (64 bytes, as the allocator rounds them)
    view = (await buf.map(np.int32)).reshape(4, 4)[1:]  # an array over it holds it too
    address = view.ctypes.data
    await buf.free()
    other = await device.alloc(64)
    await other.write(np.full(16, 9, np.int32))
    view[:] = 0
    assert (await other.read(np.int32)).tolist() == [9] * 16
    await other.free()
    assert device.memory_statistics().in_use == held  # the view's
    del view
    gc.collect()
    assert device.memory_statistics().in_use == 0  # let go of with the last array over it
    assert address


async def test_no_native_allocation_leaks(anyio_backend: object) -> None:
    dev = await am.open_device("cpu:9")
    backend = dev._backend
    bufs = [await dev.alloc(1000 + i) for i in range(20)]
    for b in bufs[:10]:
        await b.free()
    with pytest.raises(am.AsyncMetalError):
        dev.queue.copy(bufs[10], np.zeros(3))
    with pytest.raises(am.AsyncMetalError):
        dev.queue.copy(bufs[11], b"x")
    del bufs, b
    gc.collect()
    await dev.alloc(64)  # sweeps the collected buffers into the cache
    await dev.close()
    assert backend.live_allocations == 0  # type: ignore[attr-defined]


# -- size classes, the cache's limits, emptying it, peaks ------------------------------


def test_size_classes_round_up_by_at_most_an_eighth() -> None:
    from asyncmetal._allocator import block_size

    sizes = [*range(1, 20000), *(int(x) for x in np.geomspace(20000, 1 << 40, 5000))]
    previous = 0
    for n in sizes:
        size = block_size(n)
        assert n <= size, n
        assert size - n < 512 if n <= 4096 else size <= n * 1.125, (n, size)
        assert size % 512 == 0 and block_size(size) == size, (n, size)  # a class is a class
        assert size >= previous, n  # monotonic
        previous = size
    # Eight classes per doubling above 4 KiB: few distinct sizes up to 1 MiB.
    assert len({block_size(n) for n in range(1, MiB + 1, 97)}) <= 8 + 8 * 8


async def test_near_sizes_reuse_a_cached_block(device: am.Device) -> None:
    """A freed 1 MiB block serves a request a little smaller: before, only the exact
    size reused it (checked: this failed without size classes)."""
    backend = device._backend
    buf = await device.alloc(MiB)
    handle = buf._allocation.handle
    await buf.free()
    natives = backend.live_allocations  # type: ignore[attr-defined]
    again = await device.alloc(MiB - 4)
    assert again._allocation.handle is handle
    assert backend.live_allocations == natives  # type: ignore[attr-defined]
    # The buffer is the size asked for; the budget counts the block the device holds.
    assert again.nbytes == MiB - 4 and again.view(0).nbytes == MiB - 4
    assert len(await again.read()) == MiB - 4
    assert device.memory_statistics().in_use == MiB
    with pytest.raises(am.InvalidArgumentError):
        again.view(0, MiB)  # the rounding is not the buffer's to use
    await again.free()


async def test_a_request_takes_a_cached_block_of_a_near_larger_class(device: am.Device) -> None:
    """A request whose class has no cached block takes one of the next two classes'
    rather than a new block (at most 37.5 % more than asked); not a farther one."""
    step = 64 << 10  # the classes between 512 KiB and 1 MiB are 64 KiB apart
    buf = await device.alloc(MiB)
    handle = buf._allocation.handle
    await buf.free()
    far = await device.alloc(13 * step - 100)  # three classes below: a new block
    assert far._allocation.handle is not handle
    near = await device.alloc(14 * step - 100)  # two classes below: the cached block
    assert near._allocation.handle is handle and near.nbytes == 14 * step - 100
    assert device.memory_statistics().in_use == 13 * step + MiB  # the blocks' sizes
    await far.free()
    await near.free()


async def test_under_a_budget_a_request_takes_no_larger_block(device: am.Device) -> None:
    """Under a budget, a request does not take a larger class's cached block: the
    buffer would hold its extra bytes as long as it lives, and a later request that fits
    beside the buffers' own classes would wait for good (found by the memory property
    test: a 479-byte buffer held a 1536-byte block, and a 624-byte alloc never ended)."""
    device.memory_budget = 2048
    big = await device.alloc(1536)
    await big.free()  # cached: 1536
    small = await device.alloc(512)  # a new block of its own class; the 1536 one is evicted
    assert device.memory_statistics().in_use == 512
    with anyio.fail_after(10):  # (a bound on a hang, not a timing)
        other = await device.alloc(1024)  # 512 + 1024 fit the budget
    assert device.memory_statistics().in_use == 1536
    await small.free()
    await other.free()


async def test_random_sizes_one_at_a_time_keep_the_cache_bounded(device: am.Device) -> None:
    """Holding one buffer of at most 1 MiB at a time, in random sizes: the cache holds a
    block per size class at most, and the process's memory stays near that. Before, each
    new size was a new block kept (checked: without size classes, cached reached 208 MiB
    here, and 1 GiB in longer runs)."""
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    rng = np.random.default_rng(7)
    before = rss()
    for n in rng.integers(1, MiB, 400):
        buf = await device.alloc(int(n))
        await buf.write(np.ones(int(n), np.uint8))  # touch every page of it
        await buf.free()
    stats = device.memory_statistics()
    assert stats.cached <= 32 * MiB, stats
    assert stats.peak_in_use <= MiB, stats
    assert rss() - before <= 96 * MiB


async def test_rounding_never_refuses_what_fits_the_budget(device: am.Device) -> None:
    device.memory_budget = 5000  # 4700 bytes' class (5120) would not fit
    buf = await device.alloc(4700)
    assert device.memory_statistics().in_use == 4700  # the block is the bytes asked for
    waiting: list[am.Buffer] = []

    async def second() -> None:
        waiting.append(await device.alloc(400))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(second)
            await anyio.sleep(0.05)
            assert not waiting  # 4700 + 400 > 5000: it waits for the free
            await buf.free()
    assert device.memory_statistics().in_use == 512
    await waiting[0].free()
    # Nor does it hold back one that fits beside what is in use: 1 MiB's class would not.
    device.memory_budget = 2 * MiB - 1000
    held = await device.alloc(MiB)
    with anyio.fail_after(10):
        beside = await device.alloc(MiB - 1000)
    assert device.memory_statistics().in_use == 2 * MiB - 1000
    await beside.free()
    await held.free()
    device.memory_budget = 1000
    with pytest.raises(am.OutOfMemoryError):
        await device.alloc(1001)


async def test_under_a_budget_blocks_keep_their_classes(device: am.Device) -> None:
    """README's example: under a budget blocks count at their classes too (so blocks
    of one class serve requests of other sizes with no new native allocation), and a
    request that fits beside the blocks in use but not beside their classes waits."""
    device.memory_budget = MiB
    first = await device.alloc(600_000)
    assert device.memory_statistics().in_use == 655_360
    with anyio.move_on_after(0.2) as waited:
        await device.alloc(MiB - 600_000)
    assert waited.cancelled_caught  # waits for the first to be freed
    await first.free()
    again = await device.alloc(590_000)  # the same class: the block reused
    assert again._allocation.handle == first._allocation.handle
    await again.free()


async def test_the_cache_limit_is_settable_and_evicts_least_recently_freed(
    device: am.Device,
) -> None:
    assert device.memory_cache_limit == min(device.total_memory // 4, 1 << 30)
    bufs = [await device.alloc(MiB) for _ in range(3)]
    handles = [b._allocation.handle for b in bufs]
    device.memory_cache_limit = 2 * MiB
    assert device.memory_cache_limit == 2 * MiB
    for b in bufs:
        await b.free()
    assert device.memory_statistics().cached == 2 * MiB
    again = [await device.alloc(MiB) for _ in range(2)]
    assert {id(b._allocation.handle) for b in again} == {id(h) for h in handles[1:]}
    for b in again:
        await b.free()
    device.memory_cache_limit = 0  # caches nothing: what is cached goes now
    assert device.memory_statistics().cached == 0
    big = await device.alloc(MiB)
    await big.free()
    assert device.memory_statistics().cached == 0
    device.memory_cache_limit = None  # the default again
    assert device.memory_cache_limit == min(device.total_memory // 4, 1 << 30)
    with pytest.raises(am.InvalidArgumentError):
        device.memory_cache_limit = -1
    for bad in (1.5, True, "1"):
        with pytest.raises(am.ArgumentTypeError):
            device.memory_cache_limit = bad  # type: ignore[assignment]


async def test_blocks_not_reused_for_long_are_released(device: am.Device) -> None:
    """No timer: the next allocation, release or look at the statistics after the
    age passed releases them."""
    backend = device._backend
    device._allocator.cache_max_age = 0.05
    old = await device.alloc(MiB)
    await old.free()
    natives = backend.live_allocations  # type: ignore[attr-defined]
    assert device.memory_statistics().cached == MiB
    await anyio.sleep(0.1)
    fresh = await device.alloc(3 * MiB)  # misses the cache: looks for old blocks
    assert device.memory_statistics().cached == 0
    assert backend.live_allocations == natives  # type: ignore[attr-defined]  # -1 +1
    await fresh.free()
    await anyio.sleep(0.1)
    assert device.memory_statistics().cached == 0  # (the statistics looked)


async def test_empty_memory_cache_releases_every_cached_block_off_the_loop(
    device: am.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = device._backend
    held = await device.alloc(MiB)
    for n in (100, 5000, MiB, 3 * MiB):
        await (await device.alloc(n)).free()
    cached = device.memory_statistics().cached
    assert cached == 512 + 5120 + MiB + 3 * MiB
    natives = backend.live_allocations  # type: ignore[attr-defined]
    threads: list[int] = []
    free = backend.free

    def recording_free(handle: object) -> None:
        threads.append(threading.get_ident())
        free(handle)

    monkeypatch.setattr(backend, "free", recording_free)
    assert await device.empty_memory_cache() == cached
    stats = device.memory_statistics()
    assert (stats.cached, stats.in_use) == (0, MiB)  # buffers in use are untouched
    assert backend.live_allocations == natives - 4  # type: ignore[attr-defined]
    assert len(threads) == 4 and threading.get_ident() not in threads
    assert await device.empty_memory_cache() == 0  # nothing left
    await held.free()


async def test_a_closed_device_still_answers_its_memory_calls(
    anyio_backend: object, device_name: str
) -> None:
    """``memory_statistics()`` and ``empty_memory_cache()`` answer on a closed device
    (its close released everything: nothing in use, nothing cached, 0 released), as
    README says they do in a forked child; the calls that would make or use memory
    raise ``ClosedResourceError``."""
    dev = await am.open_device(device_name)
    await (await dev.alloc(MiB)).free()  # cached until the close
    await dev.close()
    stats = dev.memory_statistics()
    assert (stats.in_use, stats.cached) == (0, 0)
    assert await dev.empty_memory_cache() == 0
    with pytest.raises(am.ClosedResourceError):
        await dev.alloc(4)
    with pytest.raises(am.ClosedResourceError):
        await dev.synchronize()


async def test_cpu_memory_is_let_go_of_off_the_loop(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cpu block's pages are unmapped (its array deallocated) on a thread of the
    backend, not on the loop: evicted by an allocation, released beyond the cache's
    limit, or released by empty_memory_cache."""
    async with am.open_device("cpu:47") as dev:
        backend = dev._backend
        allocate = backend.allocate
        threads: list[int] = []

        def recorded_allocate(nbytes: int) -> object:
            memory = allocate(nbytes)
            weakref.finalize(memory.array.base, lambda: threads.append(threading.get_ident()))
            return memory

        monkeypatch.setattr(backend, "allocate", recorded_allocate)

        async def let_go_of() -> int:
            with anyio.fail_after(10):
                while not threads:
                    await anyio.sleep(0.001)
            return threads.pop()

        loop = threading.get_ident()
        dev.memory_budget = 3 * MiB
        await (await dev.alloc(2 * MiB)).free()  # cached
        held = await dev.alloc(3 * MiB)  # evicts it
        assert await let_go_of() != loop
        dev.memory_cache_limit = MiB
        await held.free()  # beyond the cache's limit: released
        del held
        assert await let_go_of() != loop
        await (await dev.alloc(MiB)).free()
        assert await dev.empty_memory_cache() == MiB
        assert await let_go_of() != loop
        assert not threads


async def test_cancelling_empty_memory_cache(
    device: am.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled at its checkpoint, it releases nothing; cancelled while the frees run,
    it returns at once (a checkpoint, as every await), and the frees go on: the block
    counts as cached until it is freed."""
    backend = device._backend
    await (await device.alloc(MiB)).free()
    with anyio.CancelScope() as scope:
        scope.cancel()
        await device.empty_memory_cache()
    assert device.memory_statistics().cached == MiB
    natives = backend.live_allocations  # type: ignore[attr-defined]
    free = backend.free

    def slow_free(handle: object) -> None:
        time.sleep(0.2)
        free(handle)

    monkeypatch.setattr(backend, "free", slow_free)
    start = time.monotonic()
    with anyio.move_on_after(0.02):
        await device.empty_memory_cache()
    assert time.monotonic() - start < 0.15  # not held for the 0.2 s free
    assert device.memory_statistics().cached == MiB  # being freed
    with anyio.fail_after(10):
        while device.memory_statistics().cached:  # counted out once freed
            await anyio.sleep(0.005)
    assert backend.live_allocations == natives - 1  # type: ignore[attr-defined]
    stats = device.memory_statistics()
    assert (stats.cached, stats.in_use) == (0, 0)


async def test_an_allocation_waits_for_blocks_being_released(
    device: am.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks being freed off the loop still count against the budget: an allocation
    that needs their room waits for those frees, and is woken by them."""
    backend = device._backend
    device.memory_budget = 2 * MiB
    held = await device.alloc(MiB)
    await (await device.alloc(MiB)).free()  # 1 MiB cached
    gate = _frees_held(monkeypatch, backend)
    got: list[am.Buffer] = []

    async def allocate() -> None:
        got.append(await device.alloc(MiB))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(device.empty_memory_cache)
            await anyio.sleep(0.05)
            tg.start_soon(allocate)
            await anyio.sleep(0.05)
            assert not got  # 1 MiB in use + 1 MiB being freed: the budget is spent
            assert device.memory_statistics().in_use + MiB <= 2 * MiB
            gate.set()
    assert device.memory_statistics().in_use == 2 * MiB
    await got[0].free()
    await held.free()


async def test_blocks_being_released_count_as_cached_until_freed(
    device: am.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While empty_memory_cache frees blocks off the loop, the statistics count them as
    cached (the device holds them, and the budget counts them), and in the peak."""
    backend = device._backend
    held = await device.alloc(MiB)
    await (await device.alloc(MiB)).free()  # 1 MiB cached
    device.memory_statistics(reset_peaks=True)
    gate = _frees_held(monkeypatch, backend)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(device.empty_memory_cache)
            await anyio.sleep(0.05)
            try:
                stats = device.memory_statistics()
                more = await device.alloc(MiB)  # 3 MiB held at once
            finally:
                gate.set()
    assert (stats.in_use, stats.cached) == (MiB, MiB)
    stats = device.memory_statistics()
    assert (stats.in_use, stats.cached, stats.peak) == (2 * MiB, 0, 3 * MiB)
    await more.free()
    await held.free()


async def test_closing_waits_for_blocks_being_released(anyio_backend: object) -> None:
    dev = await am.open_device("cpu:44")
    backend = dev._backend
    await (await dev.alloc(MiB)).free()
    gate = threading.Event()
    free = backend.free

    def slow_free(handle: object) -> None:
        gate.wait(10)
        free(handle)

    backend.free = slow_free  # type: ignore[method-assign]
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(dev.empty_memory_cache)
            await anyio.sleep(0.05)
            tg.start_soon(dev.close)
            await anyio.sleep(0.05)
            gate.set()
    assert backend.live_allocations == 0  # type: ignore[attr-defined]


async def test_peaks_in_use_and_held_and_resetting_them(device: am.Device) -> None:
    """``peak`` is the most held (in use + cached), ``peak_in_use`` the most in
    buffers; both start again from what is held now when reset. Checked: there was no
    peak in use, and no reset."""
    stats = device.memory_statistics(reset_peaks=True)
    a, b = await device.alloc(3 * MiB), await device.alloc(MiB)
    await a.free()
    await b.free()
    stats = device.memory_statistics(reset_peaks=True)  # the numbers before the reset
    assert (stats.peak_in_use, stats.peak, stats.cached) == (4 * MiB, 4 * MiB, 4 * MiB)
    stats = device.memory_statistics()
    assert (stats.peak_in_use, stats.peak) == (0, 4 * MiB)  # from what is held now
    c = await device.alloc(MiB)  # from the cache: held stays 4 MiB
    stats = device.memory_statistics()
    assert (stats.peak_in_use, stats.peak) == (MiB, 4 * MiB)
    await c.free()
    await device.empty_memory_cache()
    device.memory_statistics(reset_peaks=True)
    stats = device.memory_statistics()
    assert (stats.peak_in_use, stats.peak) == (0, 0)
    with pytest.raises(am.ArgumentTypeError):
        device.memory_statistics(reset_peaks=1)  # type: ignore[arg-type]


async def test_an_emptying_given_up_while_worker_threads_are_busy_still_frees(
    anyio_backend: object,
) -> None:
    """empty_memory_cache() frees on a thread of its own: with anyio's worker threads all
    taken, a caller that gives up still has its blocks freed natively, and counted so
    only then. Handed to a worker thread, the blocks taken out of the cache were neither
    freed nor counted once the caller was cancelled waiting for a thread."""
    limiter = anyio.to_thread.current_default_thread_limiter()
    tokens, busy = limiter.total_tokens, threading.Event()
    async with am.open_device("cpu") as dev:
        buf = await dev.alloc(1 << 20)
        await buf.free()
        assert dev.memory_statistics().cached == 1 << 20
        limiter.total_tokens = 1
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, busy.wait)  # the one worker's
                await anyio.sleep(0.05)
                with anyio.move_on_after(0.1):
                    await dev.empty_memory_cache()
                busy.set()
        finally:
            busy.set()
            limiter.total_tokens = tokens
        with anyio.move_on_after(5):
            while dev._backend.live_allocations:
                await anyio.sleep(0.005)
        assert dev._backend.live_allocations == 0
        assert dev.memory_statistics().cached == 0


async def test_a_free_and_an_emptying_where_no_thread_starts_still_release(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the thread of their own cannot be started (a limit on threads reached: a
    storm of frees while another thread submits starts one a free), a free behind
    another thread's submission and empty_memory_cache() still release the memory, on
    the caller's thread. Before, the free raised with its buffer already unusable and the
    memory in use for good, and the emptying left the bytes counted as cached for good
    (and against the budget)."""
    start = threading.Thread.start

    def no_thread(thread: threading.Thread) -> None:
        if thread.name in ("asyncmetal free", "asyncmetal empty cache"):
            raise RuntimeError("can't start new thread")
        start(thread)

    async with am.open_device("cpu") as dev:
        buf = await dev.alloc(1 << 20)
        await buf.free()
        monkeypatch.setattr(threading.Thread, "start", no_thread)
        assert await dev.empty_memory_cache() == 1 << 20
        assert dev.memory_statistics().cached == 0
        assert dev._backend.live_allocations == 0

        buf = await dev.alloc(1 << 20)
        with submission_lock_held(dev) as let_go:
            timer = threading.Timer(0.05, let_go.set)  # (the free waits for it here)
            start(timer)
            try:
                await buf.free()
            finally:
                timer.join()
        assert dev.memory_statistics().in_use == 0


async def test_a_burst_of_frees_behind_another_threads_submission_takes_one_thread(
    anyio_backend: object,
) -> None:
    """500 buffers freed at once while another thread holds the device's submission
    lock: their releases wait on one thread, not one each (each had a thread of its
    own: 500 started at once, the loop held for their starts), and all the memory
    returns once the lock is let go."""
    async with am.open_device("cpu") as dev:
        bufs = [await dev.alloc(4096) for _ in range(500)]
        with submission_lock_held(dev) as let_go:
            async with anyio.create_task_group() as tg:
                for buf in bufs:
                    tg.start_soon(buf.free)
                await anyio.sleep(0.1)  # every free waits now
                # (Alive only: a Thread whose start an interrupt cut, in tests that
                # interrupt it, stays listed, never started.)
                freeing = [
                    t for t in threading.enumerate() if t.name == "asyncmetal free" and t.is_alive()
                ]
                let_go.set()
        assert len(freeing) == 1
        assert dev.memory_statistics().in_use == 0


def _frees_held(monkeypatch: pytest.MonkeyPatch, backend: Any) -> threading.Event:
    """Have ``backend``'s native frees wait until the event given is set."""
    gate = threading.Event()
    free = backend.free

    def slow_free(handle: object) -> None:
        gate.wait(10)
        free(handle)

    monkeypatch.setattr(backend, "free", slow_free)
    return gate


def _first_free_fails(monkeypatch: pytest.MonkeyPatch, backend: Any) -> threading.Event:
    """``backend``'s next native free waits until the event given is set, then raises
    (the memory is let go all the same); later frees run as usual."""
    gate = threading.Event()
    free = backend.free
    failed: list[bool] = []

    def failing_free(handle: object) -> None:
        free(handle)
        if not failed:
            failed.append(True)
            gate.wait(10)
            raise am.DeviceLostError("the native free failed")

    monkeypatch.setattr(backend, "free", failing_free)
    return gate


@pytest.mark.parametrize("by", ["a free", "empty_memory_cache"])
async def test_an_error_of_a_release_whose_caller_was_cancelled_is_raised_by_close(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, by: str
) -> None:
    """The native free fails after its caller stopped waiting (cancelled): nobody heard
    of it, and the device's close raises it."""
    dev = await am.open_device("cpu")
    buf = await dev.alloc(MiB)
    if by == "a free":
        dev.memory_cache_limit = 0  # released natively, not cached
    else:
        await buf.free()  # cached
    gate = _first_free_fails(monkeypatch, dev._backend)
    with anyio.fail_after(10):
        if by == "a free":
            # Another thread's submission under way: the release waits for it on the
            # frees' thread, to its end whatever happens to the caller.
            with submission_lock_held(dev) as let_go, anyio.move_on_after(0.05) as scope:
                await buf.free()
            let_go.set()
        else:
            with anyio.move_on_after(0.05) as scope:
                await dev.empty_memory_cache()
        assert scope.cancelled_caught
        gate.set()
        names = ("asyncmetal free", "asyncmetal empty cache")
        while any(t.name in names and t.is_alive() for t in threading.enumerate()):
            await anyio.sleep(0.001)  # (the thread ends once its work is over)
        with pytest.raises(am.DeviceLostError, match="the native free failed"):
            await dev.close()


async def test_a_look_for_due_releases_reads_what_passed_not_what_is_pending(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thousands of frees behind a queue held on a wait: an allocation (which looks for
    releases that are due, and watches those pending while it waits) reads the uses of
    the releases whose uses passed, and one per queue -- not every pending release's.
    Once the wait is signalled they all come back, and a wait under the budget for them
    is met. Checked: before, every allocation read each pending release's uses (2,000
    reads here; with 5,000 pending, an alloc took ~5 ms on the 2-core VM, against ~9
    us)."""
    from asyncmetal import _allocator
    from tests.support.kernels import KERNELS

    async with am.open_device("cpu") as dev:
        fill = await dev.compile(KERNELS, "fill")
        gate = dev.timeline()
        queue = dev.new_queue()
        queue.wait(gate, 1)
        buffers = [await dev.alloc(256) for _ in range(2000)]
        for buf in buffers:
            queue.launch(fill, buf, vals=(1, 64))
        async with anyio.create_task_group() as tg:
            for buf in buffers:
                tg.start_soon(buf.free)
            await anyio.sleep(0.1)
            assert len(dev._allocator._pending) == 2000
            reads = []
            passed = _allocator._passed
            monkeypatch.setattr(_allocator, "_passed", lambda q, v: reads.append(v) or passed(q, v))
            await (await dev.alloc(4096)).free()
            assert len(reads) <= 8, len(reads)
            monkeypatch.setattr(_allocator, "_passed", passed)
            stats = dev.memory_statistics()
            dev.memory_budget = stats.in_use + stats.cached + 4096

            async def allocate() -> None:  # (fits only once they came back)
                big = await dev.alloc(256 * 1000)
                await big.free()

            tg.start_soon(allocate)
            await anyio.sleep(0.05)
            assert dev.memory_statistics().in_use == stats.in_use
            gate.signal(1)
        assert dev.memory_statistics().in_use == 0
        await queue.close()

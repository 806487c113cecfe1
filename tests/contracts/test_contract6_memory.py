"""Contract 6: memory is awaited, not failed. The allocator's cache, budget,
backpressure, deferred and collected frees, and zero-copy views."""

from __future__ import annotations

import gc

import anyio
import numpy as np
import pytest

import asyncmetal as am

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


async def test_a_mapped_view_holds_its_memory_past_a_free(device: am.Device) -> None:
    """A map's view outlives the buffer's free: its memory goes to no other buffer until
    the view is gone (checked: before, the next allocation of the size got that memory,
    and writes through the stale view landed in the new owner's buffer)."""
    buf = await device.alloc(64)
    view = (await buf.map(np.int32)).reshape(4, 4)[1:]  # an array over it holds it too
    address = view.ctypes.data
    await buf.free()
    other = await device.alloc(64)
    await other.write(np.full(16, 9, np.int32))
    view[:] = 0
    assert (await other.read(np.int32)).tolist() == [9] * 16
    await other.free()
    assert device.memory_statistics().in_use == 64  # the view's
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

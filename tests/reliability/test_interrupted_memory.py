"""A KeyboardInterrupt wherever CPython delivers one (trio raises Ctrl-C in whatever
Python code its main task runs) in an allocation, a free and the caches' bookkeeping
loses nothing: no memory stays counted or held, the budget is whole again, no waiter
is left parked, and what a cache counts is what it holds. Each test interrupts every
call of its window in turn (``tests.support.interrupts``), then looks."""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _allocator, _buffer, _dlpack, _timeline
from asyncmetal._allocator import Allocation, Allocator, Block
from asyncmetal._buffer import Buffer
from asyncmetal._cache import CompileCache
from asyncmetal._threads import Freer
from asyncmetal.backends.cuda import _backend as cuda_backend
from asyncmetal.backends.cuda._backend import CUDABackend
from asyncmetal.backends.metal import _blocks
from tests.reliability.test_cuda_faults import fake_driver
from tests.support.interrupts import InterruptedWait, interrupted
from tests.support.threads import submission_lock_held

GPUS = [d for d in am.devices() if d.startswith("cuda:")]
NO_GPU = pytest.mark.skipif(not GPUS, reason="no NVIDIA GPU with cuda-bindings on this machine")
# The cuda backend over a fake of the driver (tests/reliability/test_cuda_faults.py): its
# allocations and frees (its freeing thread's queue) without a GPU; it runs no commands.
FAKE_CUDA = "cuda:0 (fake driver)"
# The allocator is the same for every backend; the backends' native calls differ.
DEVICES = ["cpu", pytest.param("cuda:0", marks=[pytest.mark.cuda, NO_GPU]), FAKE_CUDA]
MiB = 1 << 20
BUDGET = 4 * MiB
LIMIT = 10  # seconds: every wait here ends within a fraction of this, or it hangs

# Where an interrupt loses a native allocation, and nothing in Python can keep it: the
# backend's allocation returned, and its result was not stored yet (see _try_alloc). The
# cuda backend's allocate is its keeps_context wrapper, ``keeping``.
NATIVE_RESULT_IN_FLIGHT = {
    "_allocate return allocate",
    "_allocate return keeping",
    "_try_alloc return _allocate",
}


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The fake driver as the cuda backend's (see FAKE_CUDA)."""
    yield from fake_driver(monkeypatch)


async def _open(name: str, request: pytest.FixtureRequest) -> am.Device:
    """Device ``name`` (one of DEVICES) opened."""
    if name == FAKE_CUDA:
        request.getfixturevalue("fake_cuda").calls.clear()  # (this device's from now)
        name = "cuda:0"
    return await am.open_device(name)


def _consistent(allocator: Allocator) -> None:
    """What the allocator counts is what it holds; nothing is under way or waiting."""
    assert not allocator._allocating, "an allocation left under way"
    assert allocator.in_use == sum(block.nbytes for block in allocator._live)
    cache = list(allocator._cache.values())
    assert allocator.cached == sum(block.nbytes for block in cache)
    assert sorted(map(id, cache)) == sorted(id(b) for bs in allocator._by_size.values() for b in bs)
    assert all(block.nbytes == size for size, bs in allocator._by_size.items() for block in bs)
    parked = [e for w in allocator._frees._watches for _, _, e in w.heap if not e.done]
    assert not parked, "a waiter left parked"
    counter = allocator._frees._counter
    assert not counter._requests, "a wake-up left uncounted"
    assert _free_elsewhere(counter._lock), "the wake-ups' lock left held"


def _free_elsewhere(lock: Any) -> bool:
    """Whether another thread can take ``lock`` now (one held by this thread is not)."""
    got: list[bool] = []

    def take() -> None:
        got.append(lock.acquire(blocking=False))
        if got[0]:
            lock.release()

    thread = threading.Thread(target=take)
    thread.start()
    thread.join()
    return got[0]


async def _whole_budget_back(device: am.Device, where: list[str]) -> None:
    """Nothing is in use, and an allocation of the whole budget gets it at once."""
    gc.collect()  # (a buffer the interrupt dropped: its memory comes back when collected)
    stats = device.memory_statistics()
    assert stats.in_use == 0, f"memory left in use (interrupted at {where})"
    _consistent(device._allocator)
    assert _free_elsewhere(device._state.submitting), "the submission lock left held"
    with anyio.fail_after(LIMIT):
        whole = await device.alloc(BUDGET, timeout=LIMIT)
    await whole.free()
    _consistent(device._allocator)


async def _nothing_lost(device: am.Device, raised: list[str], unclosable: set[str]) -> None:
    """The budget is whole again, and once the device closed no native memory is left
    allocated -- but a block lost where ``raised`` is in ``unclosable``."""
    await _whole_budget_back(device, raised)
    backend: Any = device._backend
    await device.close()
    lost = set(raised) & unclosable
    assert backend.live_allocations == len(lost), f"native memory lost at {raised}"
    calls = getattr(cuda_backend.cu, "calls", None)  # (the fake driver's, see FAKE_CUDA)
    if isinstance(backend, CUDABackend) and calls is not None:  # its freeing thread's too
        freed = calls.count("cuMemFree")
        assert calls.count("cuMemAlloc") - freed == len(lost), f"a free lost at {raised}"


@pytest.mark.anyio
@pytest.mark.parametrize("name", DEVICES)
@pytest.mark.parametrize("cached", [False, True], ids=["native", "cached"])
async def test_a_keyboard_interrupt_anywhere_in_an_allocation_loses_no_memory(
    anyio_backend: object, cached: bool, name: str, request: pytest.FixtureRequest
) -> None:
    """From the request to the Buffer handed back -- the block taken from the cache or
    allocated natively, counted in use, wrapped -- an interrupt leaves the memory either
    in the caller's hands or back with the allocator, except where the backend's native
    allocation returned and its result is not stored yet (NATIVE_RESULT_IN_FLIGHT)."""
    codes: set[Any] = {
        am.Device.alloc.__code__,
        Allocator.alloc.__code__,
        Allocator._try_alloc.__code__,
        Allocator._allocate.__code__,
        Allocator._hand_out.__code__,
        Allocation.__init__.__code__,
        Block.__init__.__code__,
        Buffer.__init__.__code__,
    }
    at = 0
    while True:
        device = await _open(name, request)
        device.memory_budget = BUDGET
        if cached:
            await (await device.alloc(MiB)).free()
        buf = None
        with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
            buf = await device.alloc(MiB)
        if buf is not None:
            await buf.free()
            del buf
        await _nothing_lost(device, raised, NATIVE_RESULT_IN_FLIGHT)
        if not raised:
            break
        at += 1
    assert at >= 20


@pytest.mark.anyio
@pytest.mark.parametrize("name", DEVICES)
async def test_a_keyboard_interrupt_in_a_wait_for_the_lock_in_an_allocation_leaves_none_under_way(
    anyio_backend: object, name: str, request: pytest.FixtureRequest
) -> None:
    """A KeyboardInterrupt in each of an allocation's waits for the allocator's lock in
    turn (as Ctrl-C comes while another thread allocates or frees) leaves no allocation
    counted as under way -- the device's close, which waits until none is, ends -- and
    loses no memory. Checked: fails without the fix (the wait that counts the
    allocation out, interrupted, left it under way: the close waited for good)."""
    at = 0
    while True:
        device = await _open(name, request)
        device.memory_budget = BUDGET
        allocator = device._allocator
        lock = InterruptedWait(allocator._lock, at)
        allocator._lock = lock
        buf = None
        try:
            with contextlib.suppress(KeyboardInterrupt):
                buf = await device.alloc(MiB)
        finally:
            allocator._lock = lock.lock
        left = dict(allocator._allocating)
        allocator._allocating.clear()  # (the close ends whatever was left)
        if buf is not None:
            await buf.free()
            del buf
        with anyio.fail_after(LIMIT):
            await _nothing_lost(device, [], set())
        assert not left, f"the wait for the lock numbered {at} interrupted left an allocation"
        if not lock.raised:
            break
        at += 1
    assert at >= 3


@pytest.mark.anyio
@pytest.mark.parametrize("name", DEVICES)
async def test_two_keyboard_interrupts_in_waits_for_the_lock_in_an_allocation_lose_no_memory(
    anyio_backend: object, name: str, request: pytest.FixtureRequest
) -> None:
    """A KeyboardInterrupt in each of an allocation's waits for the allocator's lock in
    turn, and a second one in the wait after it (Ctrl-C twice, while another thread
    allocates or frees), loses no memory: the reservation an interrupted allocation
    made is counted out, its native block freed. Checked: fails without the fix (the
    second interrupt, in the wait that counts the reservation out, left it in use)."""
    at = 0
    while True:
        device = await _open(name, request)
        device.memory_budget = BUDGET
        allocator = device._allocator
        lock = InterruptedWait(allocator._lock, at, at + 1)
        allocator._lock = lock
        buf = None
        try:
            with contextlib.suppress(KeyboardInterrupt):
                buf = await device.alloc(MiB)
        finally:
            allocator._lock = lock.lock
        allocator._allocating.clear()  # (the close ends whatever was left)
        if buf is not None:
            await buf.free()
            del buf
        with anyio.fail_after(LIMIT):
            await _nothing_lost(device, [f"the waits numbered {at} and {at + 1}"], set())
        if not lock.raised:
            break
        at += 1
    assert at >= 3


def test_a_keyboard_interrupt_in_a_lock_wait_as_a_freer_starts_leaves_it_stoppable() -> None:
    """A KeyboardInterrupt in each of a first free's waits for its Freer's lock in turn
    (the free starts the Freer's thread; Ctrl-C comes while a free on another thread
    holds the lock) leaves the thread recorded and the Freer not starting: its stop
    ends, and what was queued is released. Checked: fails without the fix (the wait
    after the thread started, interrupted, left it starting: the stop waited for
    good)."""
    at = 0
    while True:
        released: list[int] = []
        freer: Freer[int] = Freer("asyncmetal-test-free", released.append)
        lock = InterruptedWait(freer._lock, at)
        freer._lock = lock
        try:
            with contextlib.suppress(KeyboardInterrupt):
                freer.free(1)
        finally:
            freer._lock = lock.lock
        queued = at > 0 or not lock.raised  # (the first wait is the free's own, before)
        starting = freer._starting
        freer._starting = False  # (the stop ends whatever was left)
        stopper = threading.Thread(target=freer.stop, daemon=True)
        stopper.start()
        stopper.join(LIMIT)
        assert not stopper.is_alive(), "the stop waited for good"
        assert not starting, f"the wait for the lock numbered {at} interrupted left it starting"
        assert released == ([1] if queued else [])
        if not lock.raised:
            break
        at += 1
    assert at >= 2


def test_a_keyboard_interrupt_in_a_lock_wait_as_metal_blocks_start_letting_go_leaves_none_starting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A KeyboardInterrupt in each of the waits for the Metal blocks' lock in turn as
    the thread that lets go of what blocks keep is started (Ctrl-C comes while another
    thread holds the lock: a command made, a block run) leaves that thread recorded and
    none starting, which would hold every later start back. Checked: fails without the fix (the wait
    after the thread started, interrupted, left it starting: no thread was started again,
    and what blocks keep stayed)."""
    done = threading.Event()
    monkeypatch.setattr(_blocks, "_let_go", done.wait)  # (the thread: until let go of)
    monkeypatch.setattr(_blocks, "_held", {0: object()})  # (something kept)
    monkeypatch.setattr(_blocks, "_letting_go", None)
    monkeypatch.setattr(_blocks, "_starting", False)
    real = _blocks._lock
    at = 0
    while True:
        lock = InterruptedWait(real, at)
        _blocks._lock = lock
        try:
            with contextlib.suppress(KeyboardInterrupt):
                _blocks._start_letting_go()
        finally:
            _blocks._lock = real
        starting, thread = _blocks._starting, _blocks._letting_go
        started = [t for t in threading.enumerate() if t.name == "asyncmetal-metal-blocks"]
        _blocks._starting = False  # (a later start is not held back by what was left)
        done.set()
        for each in started:
            each.join(LIMIT)
        done.clear()
        _blocks._letting_go = None
        assert not starting, f"the wait for the lock numbered {at} interrupted left it starting"
        assert thread is (started[0] if started else None)
        if not lock.raised:
            break
        at += 1
    assert at >= 2


@pytest.mark.anyio
@pytest.mark.parametrize("name", DEVICES)
async def test_a_keyboard_interrupt_in_a_lock_wait_as_a_free_wakes_allocations_counts_it(
    anyio_backend: object, name: str, request: pytest.FixtureRequest
) -> None:
    """A KeyboardInterrupt in each of a free's waits for the lock of the count that
    wakes waiting allocations in turn (Ctrl-C comes while another thread counts) leaves
    no wake-up queued uncounted, and loses no memory. Checked: fails without the fix
    (the wake-up stayed queued, uncounted until some later one)."""
    at = 0
    while True:
        device = await _open(name, request)
        device.memory_budget = BUDGET
        buf = await device.alloc(MiB)
        counter = device._allocator._frees._counter
        before = counter.value
        lock = InterruptedWait(counter._lock, at)
        counter._lock = lock
        try:
            with contextlib.suppress(KeyboardInterrupt):
                await buf.free()
        finally:
            counter._lock = lock.lock
        left = list(counter._requests)
        assert not left, f"the wait for the lock numbered {at} interrupted left a wake-up"
        assert counter.value > before
        del buf
        with anyio.fail_after(LIMIT):
            await _nothing_lost(device, [], set())
        if not lock.raised:
            break
        at += 1
    assert at >= 1


# Where an interrupt loses a native free: the block is off the books, and the backend's
# free was entered but has not run (see Allocator._release and _evict).
NATIVE_FREE_CUT = {"_release call free", "_evict call free"}

FREES = ["cached", "native", "in_flight", "collected", "evicted", "expired"]


def _releasing_codes() -> set[Any]:
    """Buffer.free, the allocator's release and eviction, and the wake-ups after."""
    free = am.Buffer.free.__code__
    settle = next(c for c in free.co_consts if getattr(c, "co_name", "") == "settle")
    functions = [
        am.Buffer.free,
        _buffer.after_submissions,
        Allocator.release_after,
        Allocator._release,
        Allocator.collected,
        Allocator.sweep,
        Allocator._evict,
        Allocator._expire,
        Allocator.set_cache_limit,
        Allocator.statistics,
        CUDABackend.free,  # (its thread's queue: the native free runs there)
        _allocator._Releases.increment,
        _allocator._ReleaseCounter._request,
    ]
    return {settle, *(function.__code__ for function in functions)}


async def _let_go(device: am.Device, buffers: list[am.Buffer], how: str) -> None:
    """Let go of the one buffer in ``buffers``, ``how``: freed (into the cache, natively,
    with a use in flight), dropped, or freed before and evicted or expired from the
    cache now."""
    allocator = device._allocator
    if how == "collected":
        del buffers[0]
        device.memory_statistics()  # (sweeps)
    elif how == "evicted":
        device.memory_cache_limit = 0
    elif how == "expired":
        allocator.cache_max_age = 0.0
        allocator._next_expiry = 0.0
        device.memory_statistics()
    elif how == "in_flight":  # (its use passes once the host signals the gate it waits on)
        threading.Timer(0.01, buffers.pop().signal, (1,)).start()
        await buffers.pop().free()
    else:
        await buffers.pop().free()


@pytest.mark.anyio
@pytest.mark.parametrize("name", DEVICES)
@pytest.mark.parametrize("how", FREES)
async def test_a_keyboard_interrupt_anywhere_in_a_free_loses_no_memory(
    anyio_backend: object, how: str, name: str, request: pytest.FixtureRequest
) -> None:
    """From a buffer's free (or its collection) to its block back in the cache or freed
    natively -- the release recorded, pending while a use is in flight, made, the
    cache's least recently used blocks evicted or expired, waiting allocations told --
    an interrupt leaves the memory with the allocator, counted once, except where the
    backend's native free was entered but has not run (NATIVE_FREE_CUT)."""
    if name == FAKE_CUDA and how == "in_flight":
        pytest.skip("the fake driver runs no commands")
    codes = _releasing_codes()
    at = 0
    while True:
        device = await _open(name, request)
        device.memory_budget = BUDGET
        if how == "native":
            device.memory_cache_limit = 0
        buf = await device.alloc(MiB)
        buffers: list[Any] = [buf]
        if how in ("evicted", "expired"):
            await buffers.pop().free()
        if how == "in_flight":
            gate, queue = device.timeline(), device.new_queue()
            queue.wait(gate, 1)
            filled = queue.fill(buf, 7)
            buffers.append(gate)
        del buf
        with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
            await _let_go(device, buffers, how)
        if how == "in_flight":
            with anyio.fail_after(LIMIT):
                await filled
            del filled
        if buffers:  # (the free never began)
            await buffers.pop().free()
        device.memory_cache_limit = None
        await _nothing_lost(device, raised, NATIVE_FREE_CUT)
        if not raised:
            break
        at += 1
    assert at >= 8


@pytest.mark.anyio
async def test_a_keyboard_interrupt_as_a_free_hands_its_release_over_loses_no_later_free(
    anyio_backend: object,
) -> None:
    """A free behind another thread's submission hands its release to the frees' thread
    (``_buffer._FREES``). An interrupt anywhere in that hand-over -- in threading's own
    making and starting of the thread, before the thread began -- still releases the
    memory once the submission is over, and later frees handed over still run. Before,
    an interrupt there left the frees counted as having a thread that never began: this
    release, and every later one handed over (any free behind another thread's
    submission, on any loop), waited for it for good."""
    codes = {
        _timeline.Detached.submit.__code__,
        threading.Thread.__init__.__code__,
        threading.Thread.start.__code__,
    }
    at = 0
    async with am.open_device("cpu") as device:
        while True:
            buf = await device.alloc(MiB)
            await _frees_idle()  # (its free makes and starts the thread: the sweep's steps)
            with submission_lock_held(device) as let_go:
                with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
                    await buf.free()
                let_go.set()
            await _released(device, raised)
            # A later free handed over (the lock is busy again) is released too.
            buf = await device.alloc(MiB)
            with submission_lock_held(device) as let_go:
                threading.Timer(0.01, let_go.set).start()
                with anyio.fail_after(LIMIT):
                    await buf.free()
            await _released(device, raised)
            if not raised:
                break
            at += 1
    assert at >= 8


async def _frees_idle() -> None:
    """Until the frees' thread has ended (within LIMIT): one still taking its last look
    for work, on a busy machine, would take the next free handed over, which then starts
    none."""
    with anyio.fail_after(LIMIT):
        while _buffer._FREES._running:
            await anyio.sleep(0.001)


async def _released(device: am.Device, where: list[str]) -> None:
    """Every buffer of ``device`` freed is back with its allocator within LIMIT."""
    with anyio.move_on_after(LIMIT, shield=True):
        while device.memory_statistics().in_use:
            await anyio.sleep(0.001)
    assert device.memory_statistics().in_use == 0, f"memory left in use (interrupted at {where})"
    _consistent(device._allocator)


def test_a_keyboard_interrupt_anywhere_in_the_compile_caches_memory_keeps_its_count(
    tmp_path: Any,
) -> None:
    """Storing a binary in the compile cache's memory (evicting the least recently used
    past its limit), evicting one and clearing it: an interrupt anywhere leaves the
    bytes it counts those of the binaries it holds."""
    codes = {c.__code__ for c in (CompileCache._put_memory, CompileCache._evict)}
    codes.add(CompileCache._clear_memory.__code__)
    at = 0
    while True:
        cache = CompileCache(tmp_path, disk=False, max_memory_bytes=250)
        cache._put_memory("kept", b"k" * 100)
        with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
            cache._put_memory("a", b"a" * 100)
            cache._put_memory("b", b"b" * 100)  # past the limit: "kept" goes
            cache._evict("a")
            cache._clear_memory()
        held = sum(len(data) for data in cache._memory.values())
        assert cache._memory_bytes == held, f"counted apart (interrupted at {raised})"
        if not raised:
            break
        at += 1
    assert at >= 8


def _drop(views: list[Any]) -> None:
    """Drop the one view in ``views`` (its loan's end, the capsule's deleter, is called
    from here: a frame the interrupts can be told to count the calls of)."""
    del views[0]


@pytest.mark.anyio
@pytest.mark.parametrize("maker", ["extension", "numpy", "map"])
@pytest.mark.parametrize("freed", [False, True], ids=["in_use", "freed"])
async def test_a_keyboard_interrupt_as_a_loan_ends_loses_no_memory(
    anyio_backend: object, freed: bool, maker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DLPack export's end, or a mapped view's (any thread, even in the GC: the
    allocator's lock is only tried), interrupted anywhere -- at the entry of the
    function that ends the loan too, called by the capsule's deleter (the extension's,
    in C) or by a finalizer (numpy's capsule's, the mapped view's) -- leaves that lock
    free (every allocation and free takes it) and the loan ended, once: the buffer's
    memory comes back once it is freed."""
    if maker == "numpy":
        monkeypatch.setattr(_dlpack._maker, "chosen", _dlpack.numpy_capsule)
    codes = {Allocator.returned.__code__, _drop.__code__, _dlpack.Loan.__del__.__code__}
    codes.add(weakref.finalize.__call__.__code__)
    at = 0
    while True:
        device = await am.open_device("cpu")
        device.memory_budget = BUDGET
        buf = await device.alloc(MiB)
        views = [await buf.map() if maker == "map" else np.from_dlpack(buf)]
        if freed:
            await buf.free()  # (released when the loan ends)
        with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
            _drop(views)
        assert _free_elsewhere(device._allocator._lock), f"its lock left held ({raised})"
        if not freed:
            await buf.free()
        del buf
        await _whole_budget_back(device, raised)
        await device.close()
        if not raised:
            break
        at += 1
    assert at >= 3


@pytest.mark.anyio
@pytest.mark.parametrize("maker", ["extension", "numpy", "map"])
async def test_a_keyboard_interrupt_as_a_loan_is_made_loses_no_memory_and_reports_nothing(
    anyio_backend: object, maker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DLPack export, or a ``map()``, interrupted anywhere as it lends the memory out
    (at the entry of each function it calls too): the loan is made and ends with the
    view, or is never made -- the buffer's memory comes back once it is freed -- and no
    error of a half-made loan's finalizer is reported (before, one cut at its
    ``__init__``'s entry reported an AttributeError as it went). Checked: fails without
    the fix."""
    if maker == "numpy":
        monkeypatch.setattr(_dlpack._maker, "chosen", _dlpack.numpy_capsule)
    codes = {
        Buffer.map.__code__,
        Buffer._lend.__code__,
        Allocator.lend.__code__,
        _dlpack.export_dlpack.__code__,
        _dlpack.numpy_capsule.__code__,
        _dlpack.Loan.__init__.__code__,
        _buffer._Mapping.__init__.__code__,
    }
    reported: list[Any] = []
    hook, sys.unraisablehook = sys.unraisablehook, reported.append
    try:
        at = 0
        while True:
            device = await am.open_device("cpu")
            device.memory_budget = BUDGET
            buf = await device.alloc(MiB)
            views: list[Any] = []
            with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
                views.append(await buf.map() if maker == "map" else np.from_dlpack(buf))
            views.clear()
            await buf.free()
            del buf
            gc.collect()
            assert not reported, f"{reported[0].exc_value!r} (interrupted at {raised})"
            await _whole_budget_back(device, raised)
            await device.close()
            if not raised:
                break
            at += 1
    finally:
        sys.unraisablehook = hook
    assert at >= 5


@pytest.mark.anyio
@pytest.mark.parametrize("freed", [False, True], ids=["in_use", "freed"])
async def test_a_keyboard_interrupt_as_a_sweep_takes_up_an_ended_loan_loses_no_memory(
    anyio_backend: object, freed: bool
) -> None:
    """A loan's end queued for the sweep (its lock was taken as it ended), taken up by a
    sweep interrupted anywhere: the loan stays ended, once -- counted down, and the
    block released once the buffer is freed -- never left lent out for good."""
    codes = {Allocator.sweep.__code__, Allocator._release.__code__}
    at = 0
    while True:
        device = await am.open_device("cpu")
        device.memory_budget = BUDGET
        allocator = device._allocator
        buf = await device.alloc(MiB)
        view = np.from_dlpack(buf)
        if freed:
            await buf.free()  # (released when the loan ends)
        with allocator._lock:  # (the loan's end only tries it: queued for the sweep)
            del view
        assert allocator._returned, "the loan's end was not queued"
        with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
            device.memory_statistics()  # (sweeps)
        if not freed:
            await buf.free()
        del buf
        await _whole_budget_back(device, raised)
        await device.close()
        if not raised:
            break
        at += 1
    assert at >= (3 if freed else 1)


# Where an interrupt leaves a block that a device's close left to its loans allocated
# as its last loan ends: before that end counted it -- from the entry of the function
# that ends the loan, which the capsule's deleter calls -- or (cuda) before its free,
# queued for the backend's freeing thread, has a thread to run on: the device's next
# loan's end frees it. At the entry of its native free it is lost (as in
# NATIVE_FREE_CUT).
LAST_LOAN_CUT = {
    "_drop call returned",
    "returned c_return clear",
    "returned call _take_returned_after_close",
    "free c_return put",
    "free c_return __exit__",
    "free call __init__",
    "free return __init__",
    "free call start",
}
LAST_LOAN_FREE_CUT = {"_take_returned_after_close call free"}


def _unfreed(backend: Any) -> int:
    """Blocks the backend allocated and did not free: the fake driver's count, once
    the threads freeing after a close are done (cuda), or the backend's own."""
    calls = getattr(cuda_backend.cu, "calls", None)
    if not isinstance(backend, CUDABackend) or calls is None:
        return int(backend.live_allocations)
    for thread in threading.enumerate():
        if thread.name == cuda_backend.AFTER_CLOSE:
            thread.join(LIMIT)  # (no free runs that long)
    return calls.count("cuMemAlloc") - calls.count("cuMemFree")


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["cpu", FAKE_CUDA])
async def test_a_keyboard_interrupt_as_a_loan_ends_after_the_close_leaves_its_block_to_the_next(
    anyio_backend: object, name: str, request: pytest.FixtureRequest
) -> None:
    """Blocks a device's close left to their loans (DLPack exports still held) are freed
    by their last loans' ends: one interrupted anywhere frees its block, or -- where it
    had not counted its end yet, or (cuda) its free had no thread yet (LAST_LOAN_CUT) --
    leaves it to the device's next loan's end, which frees both; but where its native
    free was entered and has not run (LAST_LOAN_FREE_CUT)."""
    codes = {Allocator.returned.__code__, _drop.__code__, CUDABackend.free.__code__}
    codes.add(Allocator._take_returned_after_close.__code__)
    at = 0
    while True:
        device = await _open(name, request)
        first, second = await device.alloc(MiB), await device.alloc(MiB)
        capsules, later = [first.__dlpack__()], [second.__dlpack__()]  # (never consumed)
        del first, second
        backend: Any = device._backend
        await device.close()
        assert _unfreed(backend) == 2, "the close freed memory still lent"
        with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
            _drop(capsules)
        left = set(raised) & (LAST_LOAN_CUT | LAST_LOAN_FREE_CUT)
        assert _unfreed(backend) == 1 + len(left), f"interrupted at {raised}"
        _drop(later)
        lost = len(set(raised) & LAST_LOAN_FREE_CUT)
        assert _unfreed(backend) == lost, f"memory lost (interrupted at {raised})"
        if not raised:
            break
        at += 1
    assert at >= 4

"""A buffer's memory goes back to its allocator (and so to a new owner) only once every
command using it is done: also while the device that runs such a command is closing,
and for a copy between kinds that reads or writes it in place."""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _allocator, _queue, backends
from tests.support import other_kind
from tests.support.other_kind import held_pair

N = 4096
LIMIT = 20  # seconds: every wait here ends within a fraction of this, or it hangs

# Holds its queue until the host sets flag[0]: a command that runs as long as the test
# wants, which a close cannot tell from a long kernel (it waits for it).
HOLD = r"""
#include <time.h>
void hold(volatile int* flag) {
    struct timespec ts = { 0, 100000 };
    while (!flag[0]) nanosleep(&ts, 0);
}
"""


def _noting_releases(monkeypatch: pytest.MonkeyPatch, device: am.Device) -> threading.Event:
    """An event set each time ``device``'s allocator decides when a freed block goes
    back (its ``release_after``)."""
    settled = threading.Event()
    release_after = device._allocator.release_after

    def noted(*args: Any) -> None:
        release_after(*args)
        settled.set()

    monkeypatch.setattr(device._allocator, "release_after", noted)
    return settled


class _InFlight(NamedTuple):
    reader: am.Device
    owner: am.Device
    src: am.Buffer  # the owner's buffer, filled with the fill byte
    copied: list[am.Completion]  # where the copy's Completion will be
    seen: np.ndarray[Any, Any]  # a view of the copy's destination
    gate: np.ndarray[Any, Any]  # set [0] to let the held command go
    sealed: threading.Event  # set once the reader is sealed


async def _closing_with_a_copy_in_flight(
    monkeypatch: pytest.MonkeyPatch, names: tuple[str, str], fill: int
) -> _InFlight:
    """Opens a reader and an owner (cpu devices ``names``); the reader copies a buffer
    of the owner's, filled with ``fill``, into a buffer of its own, behind a command
    held until the host lets it go; both are submitted just before its close seals it
    (as another thread's may be), so the close waits for them. Start
    ``reader.close()`` next."""
    reader, owner = await am.open_device(names[0]), await am.open_device(names[1])
    src = await owner.alloc(N)
    await src.write(np.full(N, fill, np.uint8))
    hold = await reader.compile(HOLD, "hold")
    flag = await reader.alloc(4)
    await flag.write(np.zeros(1, np.int32))
    gate = await flag.map(np.int32)
    dst = await reader.alloc(N)
    seen = await dst.map()  # (cpu memory: readable after the close too)
    sealed = threading.Event()
    copied: list[am.Completion] = []
    seal = reader._seal

    def submit_then_seal() -> None:
        reader.queue.launch(hold, flag)
        copied.append(reader.queue.copy(dst, src))
        seal()
        sealed.set()

    monkeypatch.setattr(reader, "_seal", submit_then_seal)
    return _InFlight(reader, owner, src, copied, seen, gate, sealed)


@pytest.mark.anyio
async def test_a_free_waits_for_a_closing_devices_copy_of_the_buffer(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another cpu device's queue still has to copy the buffer when that device seals
    itself as it closes: freeing the buffer meanwhile must not hand its memory to a new
    allocation before the copy has read it (before, a sealed device's uses all counted
    as done: the new owner's bytes were copied)."""
    flight = await _closing_with_a_copy_in_flight(monkeypatch, ("cpu:41", "cpu:42"), 7)
    reader, owner, src, copied, seen, gate, sealed = flight
    block = src._allocation.block
    settled = _noting_releases(monkeypatch, owner)
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader.close)
            await anyio.to_thread.run_sync(sealed.wait)
            assert reader.closed
            tg.start_soon(src.free)  # returns once the copy ran
            await anyio.to_thread.run_sync(settled.wait)  # it decided when to release
            again = await owner.alloc(N)
            await again.write(np.full(N, 9, np.uint8))
            gate[0] = 1  # the copy runs now
            await copied[0]
    assert again._allocation.block is not block, "handed out while the copy still read it"
    assert (seen == 7).all(), "the copy read the memory's new owner's bytes"
    await again.free()
    await owner.close()


@pytest.mark.anyio
async def test_a_close_frees_memory_only_after_a_closing_devices_copy_of_it(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, but the buffer's own device closes: it waits for the other device's
    copy of its memory before freeing it natively, also while that device is closing
    (before, it freed it at once)."""
    flight = await _closing_with_a_copy_in_flight(monkeypatch, ("cpu:43", "cpu:44"), 5)
    reader, owner, src, copied, seen, gate, sealed = flight
    handle = src._allocation.handle
    decided = threading.Event()  # the owner's close freed the memory, or waits to
    freed_early: list[bool] = []
    free = owner._backend.free

    def noted_free(freed: Any) -> None:
        if freed is handle:
            freed_early.append(gate[0] == 0)
            decided.set()
        free(freed)

    class Sleep:  # the closing allocator's time: a sleep is a wait for another's queue
        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        def sleep(self, seconds: float) -> None:
            decided.set()
            time.sleep(seconds)

    monkeypatch.setattr(owner._backend, "free", noted_free)
    monkeypatch.setattr(_allocator, "time", Sleep())
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader.close)
            await anyio.to_thread.run_sync(sealed.wait)
            tg.start_soon(owner.close)
            await anyio.to_thread.run_sync(decided.wait)
            gate[0] = 1  # the copy runs now
            await copied[0]
    assert freed_early == [False], "freed while the other device's copy had not run"
    assert (seen == 5).all()


@pytest.mark.anyio
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("direction", ["read", "write"])
async def test_a_free_on_another_thread_as_a_copy_between_kinds_is_submitted(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, direction: str, when: str
) -> None:
    """A copy between kinds reads (or writes) the cpu buffer in place, on the other
    device's queue; another thread frees that buffer just before the copy is handed to
    the queue, or just after. Before: the copy went ahead with the freed memory, or
    recorded its use only after the queue's submission lock was let go -- either way the
    free released the memory at once, and the next allocation got memory the copy then
    read or overwrote. Now the copy is refused (freed before), or the free waits for it
    (freed after)."""
    cpu, other, mine, theirs, gate = await held_pair(monkeypatch, "cpu:45")
    block = mine._allocation.block
    settled = _noting_releases(monkeypatch, cpu)
    threads: list[threading.Thread] = []

    def free_elsewhere() -> None:  # another thread's loop frees `mine`, up to its release
        threads.append(threading.Thread(target=anyio.run, args=(mine.free,)))
        threads[0].start()
        assert settled.wait(LIMIT)

    # Freed once the copy was checked, before it takes the submission lock (under which
    # it reads the buffers' uses and is handed over), or once it let go of that lock.
    checked_operands, copy_checked = _queue.copy_operands, other.queue._copy

    def checked_then_freed(*args: Any) -> Any:
        operands = checked_operands(*args)
        if when == "before" and not threads:
            free_elsewhere()
        return operands

    def copied_then_freed(*args: Any, **kwargs: Any) -> am.Completion:
        done = copy_checked(*args, **kwargs)
        if when == "after":
            free_elsewhere()
        return done

    monkeypatch.setattr(_queue, "copy_operands", checked_then_freed)
    monkeypatch.setattr(other.queue, "_copy", copied_then_freed)
    refused: list[am.ClosedResourceError] = []

    async def copy() -> None:
        try:
            if direction == "read":  # the other queue reads `mine` in place
                await am.copy(theirs, mine)
            else:  # the other queue writes `mine` in place
                await am.copy(mine, theirs)
        except am.ClosedResourceError as exc:
            refused.append(exc)

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(copy)
            await anyio.to_thread.run_sync(settled.wait)
            monkeypatch.undo()  # (the allocation and the writes below are plain)
            again = await cpu.alloc(64)
            await again.write(np.full(16, 2, np.int32))
            gate.signal(1)
        await other.synchronize()
        await anyio.to_thread.run_sync(threads[0].join)
    assert (await again.read(np.int32) == 2).all(), "the copy wrote the new owner's memory"
    if direction == "read":
        copied = (await theirs.read(np.int32)).tolist()
        assert copied == [3 if refused else 1] * 16, "the copy read the new owner's bytes"
    assert bool(refused) == (when == "before")
    if not refused:
        assert again._allocation.block is not block, "handed out while the copy used it"
    await other.close()
    await cpu.close()


class _NotingLock:
    """A device's submission lock that calls ``noted()`` as each acquire begins."""

    def __init__(self, lock: Any, noted: Any) -> None:
        self._lock = lock
        self._noted = noted

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        self._noted()
        return bool(self._lock.acquire(blocking, timeout))

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


async def test_two_threads_copying_into_one_buffer_on_two_queues_are_ordered(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two threads copy into one buffer at once, on two queues of one device: the
    second copy handed over waits for the first. The first thread is held right after
    it read the buffer's uses until the second has read them too, or is waiting for
    the submission lock (which the device's lock, wrapped, tells). Before, a copy read
    the uses before taking that lock: each read none of the other's, and the second,
    not ordered, could run before the first (held here behind a wait), whose bytes
    were then left. Checked failing without the fix (the second waited for nothing)."""
    async with am.open_device("cpu") as dev:
        held, other = dev.new_queue(), dev.new_queue()
        gate = dev.timeline()
        held.wait(gate, 1)
        buf = await dev.alloc(N)
        first, second = np.full(N, 1, np.uint8), np.full(N, 2, np.uint8)
        arrived = threading.Event()  # the second thread read the uses, or waits to
        threads: list[threading.Thread] = []
        copies: list[am.Completion] = []

        def copy_second() -> None:
            copies.append(other.copy(buf, second))

        def second_arrived() -> None:
            if threads and threading.current_thread() is threads[0]:
                arrived.set()

        read_uses = _queue.uses

        def uses_then_second(b: am.Buffer) -> Any:
            found = read_uses(b)
            if not threads:  # (the first thread's read: the second copies now)
                threads.append(threading.Thread(target=copy_second))
                threads[0].start()
                assert arrived.wait(LIMIT)
            else:
                second_arrived()
            return found

        state = dev._state
        monkeypatch.setattr(state, "submitting", _NotingLock(state.submitting, second_arrived))
        monkeypatch.setattr(_queue, "uses", uses_then_second)
        with anyio.fail_after(LIMIT):
            copies.insert(0, await anyio.to_thread.run_sync(held.copy, buf, first))
            await anyio.to_thread.run_sync(threads[0].join)
            monkeypatch.undo()
            assert any(op[2] is held.timeline for op in other._sync_ops), "not ordered"
            gate.signal(1)
            for done in copies:
                await done
            assert (await buf.read() == 2).all(), "the second copy ran before the first"


class _Racing(NamedTuple):
    """Two copies of one buffer, each submitted on a thread of its own."""

    arrived: threading.Event  # set once the second thread submitted, or waits to
    threads: list[threading.Thread]
    copies: list[am.Completion]


class _NotingWaits(_NotingLock):
    """A device's submission lock that calls ``noted()`` as an acquire begins to wait
    (another thread holds it)."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if blocking and self._lock.acquire(False):
            return True
        return super().acquire(blocking, timeout)


def _second_inside_the_first(
    monkeypatch: pytest.MonkeyPatch,
    shared: am.Buffer,
    states: list[Any],
    second: Any,
) -> _Racing:
    """Holds the first thread that reads ``shared``'s uses (its record, wherever a
    buffer sharing it is) right after that read, until a second thread, running
    ``second()``, has submitted or waits for a submission lock of ``states`` (each
    wrapped to tell). Before each device's lock over a shared record was held, the
    second thread went through: it never saw the first one's use, nor the first its."""
    racing = _Racing(threading.Event(), [], [])
    record = shared._allocation.last_use

    def run_second() -> None:
        try:
            racing.copies.append(second())
        finally:
            racing.arrived.set()

    def second_waits() -> None:
        if racing.threads and threading.current_thread() is racing.threads[0]:
            racing.arrived.set()

    read_uses = _queue.uses

    def uses_then_second(b: am.Buffer) -> Any:
        found = read_uses(b)
        if b._allocation.last_use is record and not racing.threads:  # (the first's read)
            racing.threads.append(threading.Thread(target=run_second))
            racing.threads[0].start()
            assert racing.arrived.wait(LIMIT)
        return found

    for state in states:
        monkeypatch.setattr(state, "submitting", _NotingWaits(state.submitting, second_waits))
    monkeypatch.setattr(_queue, "uses", uses_then_second)
    return racing


def _waits_for(queue: Any, other: Any) -> bool:
    """Whether ``queue`` holds a device wait for ``other`` queue's timeline."""
    return any(op[1] and op[2] is other.timeline for op in queue._sync_ops)


@pytest.mark.anyio
@pytest.mark.parametrize("write", ["copy", "fill"])
@pytest.mark.parametrize("source", ["buffer", "lent memory"])
async def test_copies_on_two_devices_of_one_buffer_are_ordered(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, source: str, write: str
) -> None:
    """A queue of one cpu device copies out of a buffer of another cpu device (the
    buffer itself, or the memory it lent out through DLPack, which shares its record of
    uses) while that device's queue copies into it (or fills it), on two threads at
    once: the one handed over second waits for the first. Before, each read the buffer's uses under
    its own device's submission lock only, so neither saw the other's: the write, not
    ordered, ran before the read (held behind a wait), which copied its bytes. Checked
    failing without the fix."""
    reader, owner = await am.open_device("cpu:46"), await am.open_device("cpu:47")
    shared = await owner.alloc(N)
    await shared.write(np.full(N, 1, np.uint8))
    dst = await reader.alloc(N)
    gate = reader.timeline()
    reader.queue.wait(gate, 1)  # the reader's copy stays pending behind this
    lent = np.from_dlpack(shared) if source == "lent memory" else None
    src = shared if lent is None else lent
    states = [reader._state, owner._state]

    def second() -> am.Completion:
        if write == "fill":
            return owner.queue.fill(shared, 2)
        return owner.queue.copy(shared, np.full(N, 2, np.uint8))

    racing = _second_inside_the_first(monkeypatch, shared, states, second)
    with anyio.fail_after(LIMIT):
        copied = await anyio.to_thread.run_sync(reader.queue.copy, dst, src)
        await anyio.to_thread.run_sync(racing.threads[0].join)
        monkeypatch.undo()
        assert _waits_for(owner.queue, reader.queue), "the write is not ordered after the read"
        gate.signal(1)
        await copied
        await racing.copies[0]
    assert (await dst.read() == 1).all(), "the read copied the bytes written after it"
    del lent, src
    await reader.close()
    await owner.close()


@pytest.mark.anyio
async def test_a_copy_between_kinds_in_place_and_a_copy_of_the_buffers_device_are_ordered(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cpu device's queue copies into a cpu buffer while, on another thread, a copy
    between kinds writes that buffer in place on the other kind's queue: the one handed
    over second waits for the first. Before, the copy in place recorded its use under
    its own device's submission lock only, and ordered itself after nothing on the
    device: the two ran in either order (here the in-place one first, and then the cpu
    copy, held behind a wait, overwrote it). Checked failing without the fix."""
    monkeypatch.setitem(backends.BACKENDS, "cpu2", f"{other_kind.__name__}:OtherKind")
    cpu, other = await am.open_device("cpu:48"), await am.open_device("cpu2")
    theirs = await other.alloc(N)
    await theirs.write(np.full(N, 3, np.uint8))
    mine = await cpu.alloc(N)
    gate = cpu.timeline()
    cpu.queue.wait(gate, 1)  # the cpu device's copy stays pending behind this
    states = [cpu._state, other._state]
    racing = _second_inside_the_first(
        monkeypatch, mine, states, lambda: anyio.run(am.copy, mine, theirs)
    )
    with anyio.fail_after(LIMIT):
        first = await anyio.to_thread.run_sync(cpu.queue.copy, mine, np.full(N, 5, np.uint8))
        monkeypatch.undo()
        gate.signal(1)
        await first
        await anyio.to_thread.run_sync(racing.threads[0].join)
    assert (await mine.read() == 3).all(), "the copy in place was not ordered after the first"
    await other.close()
    await cpu.close()


class _FirstTakenLock(_NotingLock):
    """A device's submission lock that calls ``taken()`` once an acquire has it, and
    ``noted()`` as one begins to wait; a wait longer than ``LIMIT`` (a deadlock) raises."""

    def __init__(self, lock: Any, noted: Any, taken: Any) -> None:
        super().__init__(lock, noted)
        self._taken = taken

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock.acquire(False):
            if not blocking:
                return False
            self._noted()
            if not self._lock.acquire(True, LIMIT):
                raise AssertionError("deadlocked: each thread waits for the other's lock")
        self._taken()
        return True


@pytest.mark.anyio
async def test_copies_each_way_between_two_devices_at_once_never_deadlock(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two cpu devices each copy out of a buffer of the other at once, on two threads:
    each takes both devices' submission locks. The second thread starts once the first
    holds its first lock, and the first goes on once the second waits for one: taken
    in one order whoever takes them (each its own device's first would have each wait
    for the other's for good), the second waits for the first's copy to be handed over,
    and then goes on."""
    one, two = await am.open_device("cpu:49"), await am.open_device("cpu:50")
    buf_one, buf_two = await one.alloc(N), await two.alloc(N)
    await buf_one.write(np.full(N, 1, np.uint8))
    await buf_two.write(np.full(N, 2, np.uint8))
    dst_one, dst_two = await one.alloc(N), await two.alloc(N)
    waiting = threading.Event()
    firsts: list[threading.Thread] = []  # the first thread
    threads: list[threading.Thread] = []  # the second
    copies: list[am.Completion] = []

    def copy_first() -> am.Completion:
        firsts.append(threading.current_thread())
        return one.queue.copy(dst_one, buf_two)

    def second() -> None:
        copies.append(two.queue.copy(dst_two, buf_one))

    def noted() -> None:
        if threads and threading.current_thread() is threads[0]:
            waiting.set()

    def taken() -> None:
        if not threads and threading.current_thread() in firsts:
            threads.append(threading.Thread(target=second))
            threads[0].start()
            assert waiting.wait(LIMIT)

    for state in (one._state, two._state):
        monkeypatch.setattr(state, "submitting", _FirstTakenLock(state.submitting, noted, taken))
    with anyio.fail_after(LIMIT * 2):
        first = await anyio.to_thread.run_sync(copy_first)
        await anyio.to_thread.run_sync(threads[0].join)
        monkeypatch.undo()
        assert copies, "the second copy was not submitted"
        await first
        await copies[0]
    assert (await dst_one.read() == 2).all() and (await dst_two.read() == 1).all()
    await one.close()
    await two.close()

"""The cuda backend's copies over the real native runtime and a simulated driver whose
streams run them (tests/support/fakes/fake_cuda_driver.c: device memory is host memory,
a copy a memcpy on its stream), for the child process of simulated_cuda.py, on two
simulated GPUs: writes and reads through the staging ring, copies on one device and
between two, each checked byte for byte -- in the device memory itself too, which the
host reads here --, a copy cancelled in flight, and a sweep failing each driver call of
a workload of copies in turn.

The staging chunk is made 1 MiB here (the backend's is 8 MiB): the ring's logic does not
depend on its size, and a queue's ring of 16 chunks then wraps within a few MiB.

Besides what each scenario checks, the driver counts what breaks the copies' rules
(fake_cuda_driver.c): a copy whose source changed while the device read it (a staging
chunk refilled under it), device memory freed or host memory unregistered while a copy
used it; and a copy into pageable memory, which would block the calling thread, fails
the child.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np

from tests.support.native.simulated_cuda import STICKY, Seen, _error, _Simulated, left_behind

CHUNK = 1 << 20  # the staging chunk here
GPUS = 2


def small_chunks() -> None:
    """The staging chunk made ``CHUNK`` (before any device opens: it pins them)."""
    from asyncmetal.backends.cuda import _backend, _queue, _staging

    _staging.STAGE_CHUNK = _queue.STAGE_CHUNK = _backend.STAGE_CHUNK = CHUNK


def _memory(buf: Any, nbytes: int | None = None) -> bytes:
    """The bytes of ``buf`` in the simulated device memory (host memory)."""
    from asyncmetal._buffer import native_arg

    arg = native_arg(buf)
    return ctypes.string_at(arg.handle + arg.offset, buf.nbytes if nbytes is None else nbytes)


def _busy(sim: _Simulated, buf: Any) -> bool:
    """Whether a copy not yet run through touches ``buf``'s memory."""
    from asyncmetal._buffer import native_arg

    arg = native_arg(buf)
    return bool(sim.fake.fake_copy_busy(arg.handle + arg.offset, buf.nbytes))


def _counters(sim: _Simulated) -> tuple[int, int, int]:
    return sim.torn_copies.value, sim.freed_busy.value, sim.unregistered_busy.value


def _broken(sim: _Simulated, before: tuple[int, int, int]) -> list[str]:
    """What the driver counted since ``before`` (``_counters``)."""
    torn, freed, unregistered = (now - then for now, then in zip(_counters(sim), before))
    found = []
    if torn:
        found.append(f"{torn} copies whose source changed while the device read it")
    if freed:
        found.append(f"{freed} device allocations freed while a copy used them")
    if unregistered:
        found.append(f"{unregistered} host ranges unregistered while a copy used them")
    return found


def _bytes(rng: np.random.Generator, nbytes: int) -> np.ndarray[Any, Any]:
    return rng.integers(0, 256, nbytes, np.uint8)


SIZES = (1, 4096, 64 << 10, (64 << 10) + 1, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK // 2 + 7)


async def _sizes(sim: _Simulated, dev: Any, far: Any) -> list[str]:
    """Each of ``SIZES`` written, read back, copied on the device (to an offset) and to
    the other device, each checked; a mismatch is listed."""
    import asyncmetal as am

    rng = np.random.default_rng(1)
    found = []
    for size in SIZES:
        data = _bytes(rng, size)
        expected = data.tobytes()
        async with await dev.alloc(size) as buf, await dev.alloc(size + 24) as other:
            await buf.write(data)
            if _memory(buf) != expected:
                found.append(f"{size} bytes written: the device memory differs")
            if (await buf.read()).tobytes() != expected:
                found.append(f"{size} bytes read back differ")
            await am.copy(other.view(24, size), buf)
            if _memory(other.view(24, size)) != expected:
                found.append(f"{size} bytes copied on the device differ")
            if (await other.view(24, size).read()).tobytes() != expected:
                found.append(f"{size} bytes copied on the device read back differ")
            async with await far.alloc(size) as there:
                await am.copy(there, other.view(24, size))
                if _memory(there) != expected:
                    found.append(f"{size} bytes copied to the other device differ")
                back = np.zeros(size, np.uint8)
                await am.copy(back, there)
                if back.tobytes() != expected:
                    found.append(f"{size} bytes copied to the other device read back differ")
    return found


TASKS = 6
ROUNDS = 2


async def _concurrent(sim: _Simulated, dev: Any, far: Any) -> tuple[list[str], int, int]:
    """``TASKS`` tasks, each writing ``ROUNDS`` times 2.5 chunks and more to a buffer of
    its own, then reading it back, copying it on the device and to the other device and
    reading those, all at once on the device's default queue (its ring of chunks wraps):
    the mismatches, and how many chunks the queue's ring holds and used in all."""
    import asyncmetal as am

    found: list[str] = []

    async def one(task: int) -> None:
        rng = np.random.default_rng(100 + task)
        for round_ in range(ROUNDS):
            size = 5 * CHUNK // 2 + 4099 * task + round_
            data = _bytes(rng, size)
            expected = data.tobytes()
            where = f"task {task}, round {round_} ({size} bytes)"
            async with await dev.alloc(size) as buf, await dev.alloc(size) as copy:
                await buf.write(data)
                if (await buf.read()).tobytes() != expected:
                    found.append(f"{where}: read back differs")
                await am.copy(copy, buf)
                if (await copy.read()).tobytes() != expected:
                    found.append(f"{where}: copied on the device differs")
                async with await far.alloc(size) as there:
                    await am.copy(there, copy)
                    if (await there.read()).tobytes() != expected:
                        found.append(f"{where}: copied to the other device differs")

    async with anyio.create_task_group() as tg:
        for task in range(TASKS):
            tg.start_soon(one, task)
    staging = dev.queue._native._staging
    chunks = [chunk for chunk, _, _ in staging._ring]
    return found, len(chunks), sum(chunk.generation for chunk in chunks)


async def _copies(sim: _Simulated) -> Seen:
    """Sizes one at a time, then many copies at once (each device copy taking 100 us, so
    that they overlap the host threads' staging)."""
    import asyncmetal as am

    before = _counters(sim)
    seen: Seen = {}
    with anyio.fail_after(60):
        async with await am.open_device("cuda:0") as dev, await am.open_device("cuda:1") as far:
            seen["sizes"] = await _sizes(sim, dev, far)
            sim.copy_ns.value = 100_000
            try:
                seen["concurrent"], seen["ring"], seen["uses"] = await _concurrent(sim, dev, far)
            finally:
                sim.copy_ns.value = 0
    seen["broken"] = _broken(sim, before)
    return seen


CANCELLED_CHUNKS = 20  # more than a ring holds: the copy itself reuses chunks
SLOW_COPY_NS = 2_000_000  # each device copy of a chunk then


async def _cancelled_at_third_copy(
    sim: _Simulated, copy: Callable[[], Awaitable[Any]], seen: Seen
) -> None:
    """Submit and await ``copy()`` with the driver holding its third device copy (from
    then on until the caller sets ``sim.hold_after`` to 0), cancelled once the driver
    holds it; it gets there whatever the timing. Sets
    ``seen["finished_before_cancelled"]`` if the copy ended first."""
    started = sim.copies_started.value
    sim.hold_after.value = started + 2
    with anyio.CancelScope() as scope:

        async def cancel_once_held() -> None:
            while sim.copies_started.value < started + 3:
                await anyio.sleep(0.001)
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_once_held)
            await copy()
            seen["finished_before_cancelled"] = True


async def _cancelled_once(sim: _Simulated, dev: Any, to_device: bool) -> Seen:
    """A staged copy of ``CANCELLED_CHUNKS`` chunks, each device copy taking 2 ms, whose
    third device copy the driver holds; once it does, the awaiting task is cancelled,
    the copy's buffer freed (that wait cancelled too) and a buffer of its size
    allocated, and another copy as large submitted to the same queue (its chunks); then
    the driver lets the copies go on. What each got."""
    seen: Seen = {}
    rng = np.random.default_rng(7 if to_device else 8)
    size = CANCELLED_CHUNKS * CHUNK
    first, second = _bytes(rng, size), _bytes(rng, size)
    expected, expected_second = first.tobytes(), second.tobytes()
    buf, other = await dev.alloc(size), await dev.alloc(size)
    out, second_out = np.zeros(size, np.uint8), np.zeros(size, np.uint8)
    if not to_device:  # (the source on the device first)
        await buf.write(first)
        await other.write(second)
    sim.copy_ns.value = SLOW_COPY_NS
    try:
        await _cancelled_at_third_copy(
            sim,
            functools.partial(buf.write, first)
            if to_device
            else functools.partial(dev.queue.copy, out, buf),
            seen,
        )
        del first  # (what the copy reads, kept by the copy itself)
        gc.collect()
        seen["copying_when_cancelled"] = _busy(sim, buf)
        with anyio.CancelScope() as free_scope:
            free_scope.cancel()
            await buf.free()  # (memory returns once the copy is done)
        again = await dev.alloc(size)
        seen["handed_out_busy"] = _busy(sim, again)
        dst, src = (other, second) if to_device else (second_out, other)
        done = dev.queue.copy(dst, src)
    finally:
        sim.hold_after.value = 0
    try:
        with anyio.fail_after(30):
            await done
    finally:
        sim.copy_ns.value = 0
    if to_device:
        second_out = await other.read()
    seen["second"] = second_out.tobytes() == expected_second
    # (the cancelled copy ran before the second; its buffer's memory stays with the
    # allocator, read where it was)
    seen["first"] = (_memory(buf) if to_device else out.tobytes()) == expected
    await again.free()
    await other.free()
    return seen


async def _cancelled_read(sim: _Simulated, dev: Any) -> bool:
    """``Buffer.read`` of ``CANCELLED_CHUNKS`` chunks cancelled while the driver holds
    its third device copy: the array it made for the bytes is dropped, the copy still
    writes it. Whether arrays made then (in memory an early free would hand them) hold
    what they were filled with once the copy ran."""
    size = CANCELLED_CHUNKS * CHUNK
    buf = await dev.alloc(size)
    await buf.write(_bytes(np.random.default_rng(9), size))
    sim.copy_ns.value = SLOW_COPY_NS // 4
    try:
        await _cancelled_at_third_copy(sim, buf.read, {})
        gc.collect()
        arrays = [np.full(size, 7, np.uint8) for _ in range(4)]
    finally:
        sim.hold_after.value = 0
    try:
        with anyio.fail_after(30):
            await dev.queue.marker()  # (the cancelled read ran before it)
    finally:
        sim.copy_ns.value = 0
    await buf.free()
    return all(bool((array == 7).all()) for array in arrays)


async def _both_ways(
    sim: _Simulated, once: Callable[[_Simulated, Any, bool], Awaitable[Seen]], *more: Any
) -> Seen:
    """What ``once`` saw to the device and to the host on one device (and each of
    ``more``, (key, its coroutine function of sim and the device), after them), and
    whether the simulated driver's counters say anything broke."""
    import asyncmetal as am

    before = _counters(sim)
    seen: Seen = {}
    with anyio.fail_after(60):
        async with await am.open_device("cuda:0") as dev:
            seen["to_device"] = await once(sim, dev, True)
            seen["to_host"] = await once(sim, dev, False)
            for key, then in more:
                seen[key] = await then(sim, dev)
    seen["broken"] = _broken(sim, before)
    return seen


async def _cancelled(sim: _Simulated) -> Seen:
    return await _both_ways(sim, _cancelled_once, ("read_dropped_intact", _cancelled_read))


async def _pin_refused_once(sim: _Simulated, dev: Any, to_device: bool) -> Seen:
    """A staged copy of three chunks on a new queue, with the device's pool of chunks
    empty (other queues hold them) and the driver pinning one chunk, then refusing the
    next: what it raised, and whether the device copied any of it (slow device copies:
    one submitted is still busy when the call returns)."""
    from asyncmetal.backends.cuda import _staging
    from tests.reliability.test_cuda_faults import CUresult

    backend = dev._backend
    taken = []
    while (chunk := backend.take_chunk(pin=False)) is not None:
        taken.append(chunk)
    driver = _staging.cu
    register = driver.cuMemHostRegister
    pinned: list[int] = []

    def pin_one(address: int, nbytes: int, flags: int) -> tuple[Any, ...]:
        pinned.append(address)
        if len(pinned) > 1:
            return (CUresult.CUDA_ERROR_OUT_OF_MEMORY,)
        return register(address, nbytes, flags)

    size = 5 * CHUNK // 2
    seen: Seen = {}
    queue = dev.new_queue()
    buf = await dev.alloc(size)
    await dev.queue.fill(buf, 0)
    host = np.full(size, 3, np.uint8)
    driver.cuMemHostRegister = pin_one
    sim.copy_ns.value = SLOW_COPY_NS * 10
    try:
        try:
            await (queue.copy(buf, host) if to_device else queue.copy(host, buf))
            seen["raised"] = None
        except Exception as exc:
            seen["raised"] = _error(exc)
        seen["busy"] = _busy(sim, buf)
    finally:
        driver.cuMemHostRegister = register
        sim.copy_ns.value = 0
    await queue.close()
    with anyio.fail_after(30):
        await dev.queue.marker()
    seen["untouched"] = _memory(buf) == bytes(size) and bool((host == 3).all())
    await buf.free()
    for chunk in taken:
        backend.give_chunk(chunk)
    return seen


async def _pin_refused(sim: _Simulated) -> Seen:
    return await _both_ways(sim, _pin_refused_once)


SWEEP_SMALL = 3000  # bytes: copied straight from pageable memory
SWEEP_BIG = 5 * CHUNK // 2 + 5  # three chunks


HELD_AHEAD = 40  # with held: copies of 1 ms ahead of the workload's (its bound: 32)

# The simulated driver's kinds of calls counted (fake_cuda_driver.c, FAKE_CALL_*, in order).
FAKE_CALLS = (
    "launch",
    "record",
    "create",
    "write",
    "fill",
    "copy",
    "copy_peer",
    "htod",
    "dtoh",
    "wait",
    "wait_event",
)


def _kinds(sim: _Simulated) -> list[str]:
    """The kinds of the driver calls counted since the run began."""
    return [name for i, name in enumerate(FAKE_CALLS) if sim.counted_kinds.value >> i & 1]


def _kind_of(sim: _Simulated, n: int) -> str:
    """The kind of the run's counted driver call number ``n`` (from 1)."""
    if not 0 < n <= min(sim.counted.value, len(sim.counted_order)):
        return "not made"
    return FAKE_CALLS[sim.counted_order[n - 1][0] - ord("A")]


async def _sweep_run(
    sim: _Simulated, fail_at: int, code: int, seen: Seen | None = None, held: bool = False
) -> tuple[int, list[str]]:
    """One run of the copy workload with driver call number ``fail_at`` of the
    submitting thread failing with ``code`` (0: none): on cuda:0's default queue a small
    write, a staged write, a copy on the device, a staged read of that, a small read; a
    copy to cuda:1 of what was written. ``held``: behind ``HELD_AHEAD`` copies of 1 ms
    (not counted), so that the workload's commands are held on the host, and the
    completion thread's calls handing them over are counted too. Then the buffer
    written by the device copy is freed (the wait cancelled) and one of its size
    allocated, and every copy awaited.
    Returns the calls counted and what broke the contracts: an await that ended other
    than done or with an AsyncMetalError, a copy done whose data is wrong, a freed
    buffer's memory handed out while a copy used it, threads or events left, and after
    an error that is not sticky, a device that does not work."""
    import asyncmetal as am
    from asyncmetal import DeviceLostError
    from asyncmetal.backends.cuda import _driver
    from tests.support.faults import device_threads

    problems: list[str] = []
    _driver.lost_first = None  # (each run in a process whose CUDA state is not lost)
    sim.fault_code.value = 0
    sim.counted.value, sim.fail_at.value, sim.fail_code.value = 0, fail_at, code
    sim.counted_kinds.value = 0
    threads, made = device_threads(), sim.events_made.value - sim.events_destroyed.value
    before = _counters(sim)
    rng = np.random.default_rng(fail_at)
    small, big = _bytes(rng, SWEEP_SMALL), _bytes(rng, SWEEP_BIG)
    results: dict[str, str] = {}
    with anyio.fail_after(30):
        dev = await am.open_device("cuda:0")
        far = await am.open_device("cuda:1")
        try:
            c, a = await dev.alloc(SWEEP_SMALL), await dev.alloc(SWEEP_BIG)
            b, d = await dev.alloc(SWEEP_BIG), await far.alloc(SWEEP_BIG)
            out_big, out_small = np.zeros(SWEEP_BIG, np.uint8), np.zeros(SWEEP_SMALL, np.uint8)
            q, q_far = dev.queue, far.queue
            submissions: dict[str, Callable[[], Any]] = {
                "c": functools.partial(q.copy, c, small),
                "a": functools.partial(q.copy, a, big),
                "b": functools.partial(q.copy, b, a),
                "out_big": functools.partial(q.copy, out_big, b),
                "d": functools.partial(q_far.copy, d, a),
                "out_small": functools.partial(q.copy, out_small, c),
            }
            done: dict[str, Any] = {}
            # Of each copy submitted, the earlier ones settled once it was: a copy on
            # another queue submitted after one it follows was known to have failed
            # does not wait for it (README, on a failed command's memory).
            settled: dict[str, set[str]] = {}
            ahead: list[Any] = []
            if held:  # (not counted: the same in every run)
                filler, spare = _bytes(rng, SWEEP_SMALL), await dev.alloc(SWEEP_SMALL)
                sim.copy_ns.value = 1_000_000
                ahead = [q.copy(spare, filler) for _ in range(HELD_AHEAD)]
            sim.fake.fake_count_calls(1)
            try:
                for name, submit in submissions.items():
                    try:
                        done[name] = submit()
                        settled[name] = {e for e, then in done.items() if e != name and then.done()}
                    except am.AsyncMetalError as exc:
                        results[name] = _error(exc)
                        if code == STICKY and not isinstance(exc, DeviceLostError):
                            problems.append(f"{name} refused, not DeviceLostError: {_error(exc)}")
                    except Exception as exc:
                        problems.append(f"{name}: its submission raised {_error(exc)}")
            finally:
                sim.fake.fake_count_calls(0)
            with anyio.CancelScope() as scope:
                scope.cancel()
                await b.free()  # (memory returns once the copies using it are done)
            with contextlib.suppress(am.AsyncMetalError):  # (after a fault: refused)
                again = await dev.alloc(SWEEP_BIG)
                if _busy(sim, again):
                    problems.append("a freed buffer's memory was handed out as a copy used it")
            sim.count_all.value = held  # (the completion thread handing held ones over)
            try:
                for completion in ahead:
                    with contextlib.suppress(am.AsyncMetalError):
                        await completion
                sim.copy_ns.value = 0
                for name, completion in done.items():
                    try:
                        await completion
                        results[name] = "done"
                    except am.AsyncMetalError as exc:
                        results[name] = _error(exc)
                    except Exception as exc:
                        problems.append(f"{name}: its await raised {_error(exc)}")
            finally:
                sim.count_all.value = 0
                sim.copy_ns.value = 0
            problems += _wrong(
                results,
                submitted=set(done),
                settled=settled,
                memory={
                    "c": _memory(c),
                    "a": _memory(a),
                    "d": _memory(d),
                    "out_big": out_big.tobytes(),
                    "out_small": out_small.tobytes(),
                    "small": small.tobytes(),
                    "big": big.tobytes(),
                },
            )
        finally:
            for device in (dev, far):
                try:
                    await device.close()
                except Exception as exc:
                    problems.append(f"close raised {_error(exc)}")
    if seen is not None:
        seen.update(results)
    if code and code != STICKY:  # the device still works
        with anyio.fail_after(30):
            try:
                async with (
                    await am.open_device("cuda:0") as dev,
                    await am.open_device("cuda:1") as far,
                ):
                    a, d = await dev.alloc(SWEEP_BIG), await far.alloc(SWEEP_BIG)
                    await a.write(big)
                    await am.copy(d, a)
                    if (await d.read()).tobytes() != big.tobytes():
                        problems.append("after the error, a copy's bytes differ")
            except Exception as exc:
                problems.append(f"the device failed after: {_error(exc)}")
    problems += await left_behind(sim, threads, made)
    problems += _broken(sim, before)
    return sim.counted.value, problems


# The sweep's copies: each one's source, and the copies it follows on the device.
SOURCES = {"c": "small", "a": "big", "b": "a", "out_big": "b", "d": "a", "out_small": "c"}


def _wrong(
    results: dict[str, str],
    submitted: set[str],
    settled: dict[str, set[str]],
    memory: dict[str, bytes],
) -> list[str]:
    """What the sweep's copies did wrong: a copy done whose bytes are not its source's
    as they are now (nothing writes them after the workload's copy: what a refused copy
    left unwritten, the copy after it copies as it is -- and what a failed one's parts
    that reached the driver wrote, once they ran: a copy reading them as they run
    differs), or are not what its source's own copy wrote there, done; and a copy done
    after one it follows that was submitted and failed, where that one had not settled
    once it was submitted (``settled``: by copy, those settled then) -- it waited on the
    device for that one, and fails too. Submitted after that one's failure settled, it
    does not wait for it, and runs on what is there (README: a command that failed
    leaves the memory it would have written as it was)."""
    found = []
    for name, source in SOURCES.items():
        if results.get(name) != "done":
            continue
        chain = [name]
        while chain[-1] in SOURCES:
            chain.append(SOURCES[chain[-1]])
        for earlier in chain[1:-1]:
            failed = earlier in submitted and results.get(earlier) != "done"
            if failed and earlier not in settled.get(name, ()):
                unsettled = f"had not settled when {name} was submitted"
                found.append(f"{name}: done after {earlier}, which failed and {unsettled}")
        if name not in memory:  # (b: freed, seen through out_big)
            continue
        if source in memory and memory[name] != memory[source]:
            found.append(f"{name}: done with other bytes than its source's")
        written = all(results.get(earlier) == "done" for earlier in chain[1:-1])
        if written and memory[name] != memory[chain[-1]]:
            found.append(f"{name}: done with other bytes than were written")
    return found


async def _copy_sweep(sim: _Simulated, first: int, step: int, held: bool) -> Seen:
    """The copy workload once clean, counting the submitting thread's driver calls, then
    for N = ``first``, ``first + step``, ... with call N failing, not sticky (an invalid
    value) and sticky (the context faulted). What each copy's await ended with is
    counted in "outcomes"; the kinds of the calls counted in the clean run, in "kinds"
    (how many of each there are depends on timing: events reused, a wait found
    confirmed, held commands handed over as earlier ones end)."""
    clean: Seen = {}
    total, problems = await _sweep_run(sim, 0, 0, clean, held)
    kinds = _kinds(sim)
    found = [f"clean: {p}" for p in problems]
    outcomes: dict[str, int] = {}
    for code in (1, STICKY):
        for n in range(first, total + 1, step):
            seen: Seen = {}
            _, problems = await _sweep_run(sim, n, code, seen, held)
            failed = f"call {n} ({_kind_of(sim, n)}) failing with {code}"
            found += [f"{failed}: {p}" for p in problems]
            for result in seen.values():
                key = "done" if result == "done" else "failed"
                outcomes[key] = outcomes.get(key, 0) + 1
    return {"calls": total, "kinds": kinds, "found": found, "clean": clean, "outcomes": outcomes}


def _copy_behind_a_wait_never_met(dev: Any, dst: Any, src: Any) -> None:
    """A copy of ``src`` to ``dst`` on a new queue of ``dev``, behind a device wait for
    a value nobody signals: its device's close abandons it, and the stream runs it once
    that close raises the word it waits on."""
    queue, gate = dev.new_queue(), dev.timeline()
    gate.signal(1)  # (only ever signalled by the host: the wait goes to the driver)
    queue.wait(gate, 2)
    queue.copy(dst, src)


async def _left_to_a_closing_device(sim: _Simulated) -> Seen:
    """A copy on cuda:0 from a buffer of cuda:1, behind a device wait for a value only
    the host would signal (its wait on the driver at once); cuda:1 closed, leaving that
    buffer's memory to cuda:0's queue, then cuda:0 closed, abandoning the copy. Whether
    the memory was freed while the copy was still to read it (cuda:0's close lets its
    stream run what it abandoned, which another device's free does not wait for), and
    whether it was freed within 5 s of that close (not kept for good). The copy takes
    200 ms: a free made before it ran is seen while it runs, also where the thread that
    makes that free starts late (a loaded machine)."""
    import asyncmetal as am
    from asyncmetal._buffer import native_arg
    from asyncmetal.backends.cuda import _driver

    seen: Seen = {"freed_busy": False, "freed": False}
    driver = _driver.cu
    free = driver.cuMemFree
    dev = await am.open_device("cuda:0")
    far = await am.open_device("cuda:1")
    dst, src = await dev.alloc(1 << 16), await far.alloc(1 << 16)
    handle = native_arg(src).handle

    def watched_free(pointer: int) -> Any:
        if int(pointer) == handle:
            seen["freed"] = True
            seen["freed_busy"] = seen["freed_busy"] or bool(sim.fake.fake_copy_busy(handle, 1))
        return free(pointer)

    driver.cuMemFree = watched_free
    sim.copy_ns.value = 200_000_000
    try:
        _copy_behind_a_wait_never_met(dev, dst, src)
        del dst, src
        with anyio.fail_after(20):
            await far.close()
            seen["freed_at_its_close"] = seen["freed"]
            await dev.close()
        with anyio.move_on_after(5):
            while not seen["freed"]:
                await anyio.sleep(0.01)
    finally:
        driver.cuMemFree = free
        sim.copy_ns.value = 0
    return seen


async def _freed_while_a_closing_device_copies(sim: _Simulated) -> Seen:
    """A copy on cuda:0 from a buffer of cuda:1, which stays open, behind a device wait
    for a value only the host would signal; cuda:0 closed, abandoning the copy, its
    backend's close held until the buffer was freed and one of its size allocated on
    cuda:1. Whether that allocation got memory the copy has still to read (cuda:0's
    backend close lets its stream run what it abandoned: 200 ms), and whether the
    freed memory came back within 5 s of the close (not kept for good), and not freed
    natively while the copy was still to read it."""
    import asyncmetal as am
    from asyncmetal._buffer import native_arg
    from asyncmetal.backends.cuda import _driver

    seen: Seen = {}
    dev = await am.open_device("cuda:0")
    far = await am.open_device("cuda:1")
    size = 1 << 16
    dst, src = await dev.alloc(size), await far.alloc(size)
    allocator, block = far._allocator, src._allocation.block
    before = _counters(sim)
    names = {native_arg(dst).handle: "dst", native_arg(src).handle: "src"}
    free = _driver.cu.cuMemFree
    freed_busy: list[str] = []

    def watched_free(pointer: Any) -> Any:
        if sim.fake.fake_copy_busy(int(pointer), 1):
            freed_busy.append(names.get(int(pointer), "other"))
        return free(pointer)

    _driver.cu.cuMemFree = watched_free
    entered, go = threading.Event(), threading.Event()
    backend = dev._backend
    real = backend.close

    def held_close() -> None:
        entered.set()
        go.wait(20)
        real()

    backend.close = held_close
    sim.copy_ns.value = 200_000_000
    try:
        _copy_behind_a_wait_never_met(dev, dst, src)
        del dst
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(dev.close)
                await anyio.to_thread.run_sync(entered.wait)
                tg.start_soon(src.free)  # (it waits for the close: its release does not)
                while block in allocator._live and block not in allocator._pending:
                    await anyio.sleep(0.001)
                again = await far.alloc(size)
                seen["handed_out_busy"] = _busy(sim, again)
                seen["ran_out_then"] = dev._state.ran_out
                go.set()
        with anyio.move_on_after(5):
            while far.memory_statistics().in_use > size:
                await anyio.sleep(0.01)
        seen["came_back"] = far.memory_statistics().in_use == size
        await again.free()
    finally:
        go.set()
        _driver.cu.cuMemFree = free
        sim.copy_ns.value = 0
    await far.close()
    # (What was freed while a copy was still to use it: "src", the buffer freed, nor
    # "dst", cuda:0's own, which its close frees once its backend's close let the
    # abandoned copy run.)
    seen["freed_busy"] = freed_busy
    seen["broken"] = _broken(sim, before)
    return seen


SCENARIOS = {
    "copies": _copies,
    "cancelled_copy": _cancelled,
    "pin_refused": _pin_refused,
    "left_to_a_closing_device": _left_to_a_closing_device,
    "freed_while_a_closing_device_copies": _freed_while_a_closing_device_copies,
}


def run(sim: _Simulated, scenario: str, loop: str, args: tuple[str, ...]) -> Seen:
    """``scenario``'s observations, on event loop ``loop``."""
    small_chunks()
    if scenario == "copy_sweep":
        first, step, held = (int(arg) for arg in args)
        sweep = functools.partial(_copy_sweep, sim, first, step, bool(held))
        return anyio.run(sweep, backend=loop)
    return anyio.run(functools.partial(SCENARIOS[scenario], sim), backend=loop)

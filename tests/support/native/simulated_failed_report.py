"""A failed cuda queue's report over the simulated driver (simulated_cuda.py: the real
native runtime, streams of tests/support/fakes/fake_cuda_driver.c), in a child process:
``python -m tests.support.native.simulated_failed_report SCENARIO LOOP`` prints what
SCENARIO saw, as JSON, on its last line (``run`` runs it, and reads that).

- ``gated``: a queue's device wait that fails, followed on that queue by a signal
  ordered after another queue's lower signal of the same timeline, which is held
  behind a gate the program raises only after it awaited the failed wait.
- ``held_signal``: as ``gated``, the later signal of a higher value and a command after
  it awaited before the gate is raised; ``held_signal_discarded``: the same, the failed
  queue then closed with ``discard=True`` before the gate is raised.
- ``discarded_behind_lower``: a queue that never failed, its signal waiting for another
  queue's lower signal held behind a gate, closed with ``discard=True`` before the gate
  is raised.
- ``refused_wait``: a queue's device wait on another queue's command in flight, refused
  by the driver (a fault) after its record with that queue was made, that queue then
  failing and settling before the refusal is looked at.
- ``refused_wait_number``: a queue's device wait on another queue's command in flight,
  refused by the driver (not a fault: the device still works), that queue failing at
  or below the value waited for only after the refusal returned.
- ``reached_while_closing``: as ``held_signal``, the failed queue asked how far its
  commands got (a device's close counts from there) while another thread closes it.
- ``refused_wait_failing``: as ``refused_wait_number``, that queue failing and settling
  while the refused wait's driver call is in the driver; ``made_wait_failing``: the
  same, the driver taking the wait.
- ``lower_handed_never_runs``: as ``held_signal``, but the lower signal's queue first
  waits on the device for a timeline nothing signals, so the lower signal, handed over
  as the gate is raised, never runs; then the device closes.
- ``queue_closed_while_held``: the failed queue, holding its signal behind a lower one
  that never runs, closed (no discard) with a deadline; then the device closes.
- ``abandoned_across`` (two simulated GPUs): a queue of ``cuda:1`` signals a timeline
  of ``cuda:0`` behind a wait nothing signals, and ``cuda:1`` closes (abandoning it);
  ``abandoned_across_held``: the same, a failed queue of ``cuda:0`` holding its signal
  of that timeline to a higher value behind the abandoned one.
- ``abandoned_across_after_lower`` (two simulated GPUs): the abandoned signal ordered
  after a lower signal of that timeline by a queue of ``cuda:0``, held behind a gate
  raised only after the close.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import anyio

from tests.support.native.simulated_cuda import (
    STICKY,
    Seen,
    _awaited,
    _error,
    _Simulated,
    child_main,
    run_child,
)

REPORT_S = 5  # the failed wait is reported within this, or it waits for the gate


class _Failing(NamedTuple):
    waiting: Any
    discarded: Any
    other: Any
    gate: Any
    shared: Any
    doomed: Any
    lower: Any
    behind: Any


def _failing_behind(dev: Any, lower: int, higher: int, *holds: tuple[Any, int]) -> _Failing:
    """On ``dev``: queue ``waiting`` waits on the device for a command of queue
    ``discarded`` (held by ``gate`` at 1: the scenario closes it with discard=True, and
    the wait fails, "doomed"), then signals ``shared`` to ``higher`` ("behind"); queue
    ``other`` first signals ``shared`` to ``lower`` ("lower"), behind its device waits
    for ``holds`` (timeline, value; None: the gate), by default the gate at 2."""
    waiting, discarded, other = dev.new_queue(), dev.new_queue(), dev.new_queue()
    gate, shared = dev.timeline(), dev.timeline()
    discarded.wait(gate, 1)
    doomed = waiting.wait(discarded.timeline, 1)
    for timeline, value in holds or ((None, 2),):
        other.wait(gate if timeline is None else timeline, value)
    signalled = other.signal(shared, lower)
    behind = waiting.signal(shared, higher)
    return _Failing(waiting, discarded, other, gate, shared, doomed, signalled, behind)


async def gated(am: Any, dev: Any) -> Seen:
    """On ``dev`` (any backend): queue ``waiting`` waits on the device for a command of
    queue ``discarded``, which is then closed with ``discard=True`` (the wait fails:
    "doomed"), and signals ``shared`` to 2 behind it ("behind"); queue ``other`` signals
    ``shared`` to 1 ("lower") behind a wait for ``gate``, which is signalled only once
    "doomed" was awaited (at most REPORT_S). How each ended, and whether "doomed" ended
    before the gate was raised."""
    seen: Seen = {}
    waiting, discarded, _, gate, _, doomed, lower, behind = _failing_behind(dev, 1, 2)
    await discarded.close(discard=True)
    seen["doomed"] = "still waiting"
    with anyio.move_on_after(REPORT_S):
        seen["doomed"] = await _awaited(doomed)
    late = dev.new_queue()  # (a wait for the failed value, once it was reported)
    late.wait(waiting.timeline, doomed.value)
    seen["late"] = "still waiting"
    with anyio.move_on_after(REPORT_S):
        try:  # (a queue whose failure settled it refuses the submission, with it)
            marker = late.marker()
        except Exception as exc:
            seen["late"] = _error(exc)
        else:
            seen["late"] = await _awaited(marker)
    gate.signal(2)  # (only now, as the program does: after the await of the failed wait)
    for name, done in {"lower": lower, "behind": behind}.items():
        seen[name] = "still waiting"
        with anyio.move_on_after(REPORT_S):
            seen[name] = await _awaited(done)
    return seen


def _on_cuda(
    program: Callable[[Any, Any], Awaitable[Seen]],
) -> Callable[[_Simulated], Awaitable[Seen]]:
    """A scenario that runs ``program`` (any backend's) on the simulated ``cuda:0``."""

    async def scenario(sim: _Simulated) -> Seen:
        import asyncmetal as am

        dev = await am.open_device("cuda:0")
        try:
            return await program(am, dev)
        finally:
            with anyio.fail_after(20):
                await dev.close()

    return scenario


async def held_signal(am: Any, dev: Any) -> Seen:
    """On ``dev`` (any backend): queue ``waiting`` waits on the device for a command of
    queue ``discarded``, which is then closed with ``discard=True`` (the wait fails:
    "doomed"), then signals ``shared`` to 5 ("behind") and has a marker ("after");
    queue ``other`` signals ``shared`` to 3 ("lower") behind a wait for ``gate``, which
    is signalled only once those were awaited (at most REPORT_S each).
    How each ended, ``shared``'s value before the gate, and how a host wait for 3 and
    for 5 of ``shared`` ended after it."""
    return await _held_signal(dev, discard=False)


async def held_signal_discarded(am: Any, dev: Any) -> Seen:
    """As ``held_signal``, queue ``waiting`` then closed with ``discard=True`` before the
    gate is raised (its signal of 5 dropped as it waits for the lower one): also how
    that close ended ("close": "closed", or "still closing" after REPORT_S)."""
    return await _held_signal(dev, discard=True)


async def _held_signal(dev: Any, discard: bool) -> Seen:
    seen: Seen = {}
    waiting, discarded, _, gate, shared, doomed, lower, behind = _failing_behind(dev, 3, 5)
    after = waiting.marker()
    await discarded.close(discard=True)
    for name, done in {"doomed": doomed, "behind": behind, "after": after}.items():
        seen[name] = "still waiting"
        with anyio.move_on_after(REPORT_S):
            seen[name] = await _awaited(done)
    seen["later"] = "still waiting"
    with anyio.move_on_after(REPORT_S):
        try:  # (a queue whose failure was reported may refuse the submission, with it)
            later = waiting.marker()
        except Exception as exc:
            seen["later"] = _error(exc)
        else:
            seen["later"] = await _awaited(later)
    if discard:
        seen["close"] = "still closing"
        with anyio.move_on_after(REPORT_S):
            await waiting.close(discard=True)
            seen["close"] = "closed"
    seen["shared before gate"] = shared.value
    gate.signal(2)  # (only now: after the awaits of the failed queue's later commands)
    seen["lower"] = await _awaited(lower)
    for target in (3, 5):
        seen[f"shared {target}"] = await _awaited(shared.wait(target))
    return seen


async def discarded_behind_lower(am: Any, dev: Any) -> Seen:
    """On ``dev`` (any backend): queue ``other`` signals ``shared`` to 3 ("lower") behind
    a wait for ``gate``; queue ``waiting``, which never failed, then signals it to 5
    ("higher": it waits for the lower signal first) and is closed with ``discard=True``
    before the gate is raised. How that close and "higher" ended (within REPORT_S),
    ``shared``'s value before the gate, how "lower" ended once it is raised, and a host
    wait for 3 and for 5 of ``shared`` after it."""
    seen: Seen = {}
    other, waiting = dev.new_queue(), dev.new_queue()
    gate, shared = dev.timeline(), dev.timeline()
    other.wait(gate, 1)
    lower = other.signal(shared, 3)
    higher = waiting.signal(shared, 5)
    seen["close"] = "still closing"
    with anyio.move_on_after(REPORT_S):
        await waiting.close(discard=True)
        seen["close"] = "closed"
    seen["higher"] = "still waiting"
    with anyio.move_on_after(REPORT_S):
        seen["higher"] = await _awaited(higher)
    seen["shared before gate"] = shared.value
    gate.signal(1)
    seen["lower"] = await _awaited(lower)
    for target in (3, 5):
        seen[f"shared {target}"] = await _awaited(shared.wait(target))
    return seen


class _HeldLib:
    """A queue's native library, its ``am_cuq_reached`` held until ``release`` is set
    (``asking`` set meanwhile), its ``am_cuq_close`` noting whether it came while one
    was held. A close that came first leaves the held call unmade (its queue freed)."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self.asking, self.release = threading.Event(), threading.Event()
        self.closed_while_asked = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def am_cuq_reached(self, q: Any) -> int:
        self.asking.set()
        self.release.wait(REPORT_S)
        return MAX if self.closed_while_asked else int(self._lib.am_cuq_reached(q))

    def am_cuq_close(self, q: Any, abandon: int) -> None:
        if self.asking.is_set() and not self.release.is_set():
            self.closed_while_asked = True
        self._lib.am_cuq_close(q, abandon)


async def reached_while_closing(am: Any, dev: Any) -> Seen:
    """``held_signal``'s failed queue, once its failed wait was awaited: how far its
    commands got asked on one thread (held in the native call) while another closes the
    queue; whether the close went on to free the native queue meanwhile, and how the
    question ended."""
    seen: Seen = {}
    waiting, discarded, _, gate, _, doomed, _, _ = _failing_behind(dev, 3, 5)
    await discarded.close(discard=True)
    seen["doomed"] = await _awaited(doomed)
    native = waiting._native
    held = native._lib = _HeldLib(native._lib)
    asked: list[object] = []
    asker = threading.Thread(target=lambda: asked.append(native.reached()))
    asker.start()
    held.asking.wait(REPORT_S)
    closer = threading.Thread(target=native.close, args=(True,))
    closer.start()
    closer.join(0.5)  # (long enough for a close not held back to free the queue)
    seen["closed while asked"] = held.closed_while_asked
    held.release.set()
    asker.join(REPORT_S)
    closer.join(REPORT_S)
    seen["asked"] = repr(asked)
    gate.signal(2)
    return seen


MAX = (1 << 64) - 1
SETTLE_S = 10  # the failed queue settles within this (its thread naps 1 ms at most)
CLOSE_S = 10  # the device closes within this, or waits for good
CU_WAIT_EVENT = 9  # the driver table's cuStreamWaitEvent (native/cuda_stream.h)


def _wait_refused(sim: _Simulated, seen: Seen, code: int, waiting: Any, *wait: Any) -> None:
    """``waiting.wait(*wait)`` with the first driver call it makes failing with ``code``:
    how it ended (``seen["wait"]``) and which call that was (``"refused call"``)."""
    import asyncmetal as am

    sim.counted.value, sim.fail_at.value, sim.fail_code.value = 0, 1, code
    sim.fake.fake_count_calls(1)
    try:
        waiting.wait(*wait)
        seen["wait"] = "submitted"
    except am.AsyncMetalError as exc:
        seen["wait"] = _error(exc)
    finally:
        sim.fake.fake_count_calls(0)
        sim.fail_at.value = 0
    seen["refused call"] = sim.counted_order[0].decode()  # 'K': cuStreamWaitEvent


async def _refused_wait(sim: _Simulated) -> Seen:
    """Queue ``first`` holds its stream on a device wait for ``gate`` (which only the
    host signals) with a marker in flight behind it; queue ``waiting`` waits for that
    marker, and the driver refuses the wait's call (the stream's wait on the marker's
    event) with a fault, after the wait was recorded with ``first``. The fault fails
    ``first``, whose thread settles it -- failing the commands of the queues recorded as
    waiting for it from their waits on, ``waiting``'s refused one among them -- before
    the submitting thread looks at the refusal (held back for that here, as a thread
    slow to return from the driver is). How the wait's submission ended, whether
    ``first`` had settled then, and whether the device then closed (a close that waits
    for good prints what was seen and ends the process)."""
    import asyncmetal as am
    from asyncmetal import _native

    seen: Seen = {}
    dev = await am.open_device("cuda:0")
    first, waiting, gate = dev.new_queue(), dev.new_queue(), dev.timeline()
    gate.signal(1)  # (only ever signalled by the host: the wait goes to the driver)
    first.wait(gate, 2)
    ahead = first.marker()
    lib = _native.runtime()
    real = lib.am_cuq_wait_queue

    def refused(q: Any, other: Any, target: int, command: int) -> int:
        code = int(real(q, other, target, command))
        if code:
            until = time.monotonic() + SETTLE_S
            while first.timeline.value != MAX and time.monotonic() < until:
                time.sleep(0.001)
            seen["first settled"] = first.timeline.value == MAX
        return code

    lib.am_cuq_wait_queue = refused
    try:
        _wait_refused(sim, seen, STICKY, waiting, first.timeline, ahead.value)
    finally:
        lib.am_cuq_wait_queue = real
    seen["close"] = "hung"

    def hung() -> None:  # (a close is not cancelled, and the exit's would wait too)
        print(json.dumps(seen), flush=True)
        os._exit(0)

    watchdog = threading.Timer(CLOSE_S, hung)
    watchdog.start()
    try:
        await dev.close()
        seen["close"] = "closed"
    except Exception as exc:
        seen["close"] = _error(exc)
    finally:
        watchdog.cancel()
    return seen


async def _refused_wait_number(sim: _Simulated) -> Seen:
    """Queue ``first`` holds its stream on a device wait for ``gate`` (which only the
    host raises) with a marker ``ahead`` in flight behind it. Queue ``waiting`` waits for
    ``ahead``: the driver refuses the wait's call (cuStreamWaitEvent, with
    CUDA_ERROR_INVALID_VALUE: no fault, the device still works), and its command number
    is given back. ``waiting`` then has a marker ("before", which takes that number).
    Only then ``gate`` fails at the value ``first`` waits for (abandoned, as a device
    close leaves a timeline whose signals will never run), which fails ``first`` from its
    wait on, ``ahead`` among them, and ``first`` settles. Then ``waiting`` has a second
    marker ("after"). How the wait's submission ended, ``first``'s wait, whether
    ``first`` settled, and each marker."""
    import asyncmetal as am

    seen: Seen = {}
    dev = await am.open_device("cuda:0")
    try:
        first, waiting, gate = dev.new_queue(), dev.new_queue(), dev.timeline()
        gate.signal(1)  # (only ever signalled by the host: the wait goes to the driver)
        doomed = first.wait(gate, 2)
        ahead = first.marker()
        _wait_refused(sim, seen, 1, waiting, first.timeline, ahead.value)
        before = waiting.marker()
        gate.native.abandon(2, 2)
        seen["doomed"] = await _awaited(doomed)
        with anyio.move_on_after(SETTLE_S):
            while first.timeline.value != MAX:  # (its settling has nothing to await)
                await anyio.sleep(0.001)
        seen["first settled"] = first.timeline.value == MAX
        try:
            after = waiting.marker()
        except am.AsyncMetalError as exc:
            seen["after"] = _error(exc)
        else:
            seen["after"] = await _awaited(after)
        seen["before"] = await _awaited(before)
    finally:
        with anyio.fail_after(CLOSE_S):
            await dev.close()
    return seen


async def _wait_failing(sim: _Simulated, made: bool) -> Seen:
    """As ``refused_wait_number``, but ``gate`` fails (and ``first`` fails and settles,
    its failure reaching its record of ``waiting``'s wait) while the wait's driver call
    is still in the driver (cuStreamWaitEvent, replaced for the call), which then takes
    the wait (``made``: not enqueued on the simulated stream) or refuses it
    (CUDA_ERROR_INVALID_VALUE). How the wait's submission ended (and, taken, the wait),
    whether ``first`` had settled in the call, and each marker of ``waiting`` after it."""
    import ctypes

    import asyncmetal as am
    from asyncmetal import _native

    seen: Seen = {}
    dev = await am.open_device("cuda:0")
    lib = _native.runtime()
    try:
        first, waiting, gate = dev.new_queue(), dev.new_queue(), dev.timeline()
        gate.signal(1)  # (only ever signalled by the host: the wait goes to the driver)
        doomed = first.wait(gate, 2)
        ahead = first.marker()

        def in_driver(stream: int, event: int, flags: int) -> int:
            gate.native.abandon(2, 2)
            until = time.monotonic() + SETTLE_S
            while first.timeline.value != MAX and time.monotonic() < until:
                time.sleep(0.001)  # (its settling has nothing to wait on)
            seen["first settled"] = first.timeline.value == MAX
            return 0 if made else 1  # CUDA_ERROR_INVALID_VALUE

        call = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
        hook = call(in_driver)
        lib.am_cuda_set(CU_WAIT_EVENT, ctypes.cast(hook, ctypes.c_void_p))
        try:
            wait = waiting.wait(first.timeline, ahead.value)
            seen["wait"] = "submitted"
        except am.AsyncMetalError as exc:
            seen["wait"] = _error(exc)
        finally:
            sim.fake.fake_driver_install()
        try:  # (a queue failing from the wait on may refuse it)
            before = waiting.marker()
        except am.AsyncMetalError as exc:
            before, seen["before"] = None, _error(exc)
        seen["doomed"] = await _awaited(doomed)
        if made:
            seen["waited"] = await _awaited(wait)
        try:
            after = waiting.marker()
        except am.AsyncMetalError as exc:
            seen["after"] = _error(exc)
        else:
            seen["after"] = await _awaited(after)
        if before is not None:
            seen["before"] = await _awaited(before)
    finally:
        with anyio.fail_after(CLOSE_S):
            await dev.close()
    return seen


async def _refused_wait_failing(sim: _Simulated) -> Seen:
    return await _wait_failing(sim, made=False)


async def _made_wait_failing(sim: _Simulated) -> Seen:
    return await _wait_failing(sim, made=True)


HUNG_S = 15  # a close not done within this waits for good: the child says so and ends
QUEUE_CLOSE_S = 3  # how long a queue's close is waited for before it is cancelled


async def _close_watched(seen: Seen, key: str, close: Callable[[], Awaitable[None]]) -> None:
    """``close()``, ``seen[key]`` saying how it ended: "closed", its error, or, past
    HUNG_S (a close waiting in a native call, which no cancellation ends), "hung" -- the
    child then prints what it saw and exits."""
    seen[key] = "hung"

    def hung() -> None:
        print(json.dumps(seen), flush=True)
        os._exit(0)

    watchdog = threading.Timer(HUNG_S, hung)
    watchdog.start()
    try:
        await close()
        seen[key] = "closed"
    except Exception as exc:
        seen[key] = _error(exc)
    finally:
        watchdog.cancel()


async def _try(seen: Seen, name: str, done: Any) -> None:
    seen[name] = "still waiting"
    with anyio.move_on_after(REPORT_S):
        seen[name] = await _awaited(done)


def _reached(queue: Any) -> Any:
    return queue._native.reached()


async def _lower_handed_never_runs(sim: _Simulated) -> Seen:
    """Queue ``waiting`` fails behind a device wait for a command of queue ``discarded``
    (closed with discard=True), its signal of 5 of ``shared`` held on the host for
    queue ``other``'s signal of 3, which waits for ``gate`` and then, on the device, for
    ``never`` (at 1, never signalled again). The failed queue's commands are awaited
    (reported at once), and how far it says its stream got; the gate is raised (the
    lower signal is handed over, behind a wait that never ends, and the hold ends); how
    far it says its stream got then, and how the device's close ended (its queues'
    commands that can never run abandoned), and the lower signal."""
    import asyncmetal as am

    seen: Seen = {}
    dev = await am.open_device("cuda:0")
    never = dev.timeline()
    never.signal(1)  # (a host timeline then: a wait for 2 goes to the driver at once)
    # The gate held on the host until raised, then the wait for never handed over: it
    # never ends.
    waiting, discarded, _, gate, _, doomed, lower, behind = _failing_behind(
        dev, 3, 5, (None, 2), (never, 2)
    )
    after = waiting.marker()
    await discarded.close(discard=True)
    for name, done in {"doomed": doomed, "behind": behind, "after": after}.items():
        await _try(seen, name, done)
    seen["reached before gate"] = _reached(waiting)
    gate.signal(2)
    # Until the lower signal is handed over and the held signal after it (and nothing
    # confirms it: the stream waits for shared at 3 for good).
    until = time.monotonic() + SETTLE_S
    while waiting._native.stats()["held_now"] and time.monotonic() < until:
        await anyio.sleep(0.001)
    seen["held after gate"] = waiting._native.stats()["held_now"]
    seen["reached after gate"] = _reached(waiting)
    await _close_watched(seen, "close", dev.close)
    await _try(seen, "lower", lower)
    return seen


async def _queue_closed_while_held(sim: _Simulated) -> Seen:
    """Queue ``waiting`` fails behind a device wait for a command of queue ``discarded``
    (closed with discard=True), its signal of 2 of ``shared`` held on the host for queue
    ``other``'s signal of 1, which waits on the device for ``never`` (nothing signals
    it). The failed queue's commands are awaited (reported at once), then the queue is
    closed without discard, cancelled after QUEUE_CLOSE_S; then the device's close."""
    import asyncmetal as am

    seen: Seen = {}
    dev = await am.open_device("cuda:0")
    waiting, discarded, _, _, _, doomed, _, behind = _failing_behind(dev, 1, 2, (dev.timeline(), 1))
    await discarded.close(discard=True)
    await _try(seen, "doomed", doomed)
    await _try(seen, "behind", behind)

    async def close_queue() -> None:
        with anyio.move_on_after(QUEUE_CLOSE_S) as scope:
            await waiting.close()
        if scope.cancelled_caught:
            raise TimeoutError("still closing: cancelled")

    await _close_watched(seen, "queue close", close_queue)
    dev.new_queue()  # (releases closed queues whose commands ran: not this one)
    await _close_watched(seen, "close", dev.close)
    return seen


async def _reached_interrupted(sim: _Simulated) -> Seen:
    """A failed cuda queue asked how far its stream got (``reached``, which a reaper's
    look, a close's count run on a loop's thread) with a KeyboardInterrupt at each place
    in it where CPython raises one, in turn: where each landed and whether it left the
    queue's lock held; then how the device's close ended."""
    import asyncmetal as am
    from asyncmetal.backends.cuda._queue import CUDAQueue
    from tests.support.interrupts import interrupted

    seen: Seen = {}
    dev = await am.open_device("cuda:0")
    waiting, discarded, *_, behind = _failing_behind(dev, 1, 2, (dev.timeline(), 1))
    await discarded.close(discard=True)
    await _try(seen, "behind", behind)
    native = waiting._native
    places: list[object] = []
    for at in range(20):
        with (
            interrupted({CUDAQueue.reached.__code__}, at) as raised,
            contextlib.suppress(KeyboardInterrupt),
        ):
            native.reached()
        if not raised:
            break
        places.append([raised[0], native._closing_lock.locked()])
        if native._closing_lock.locked():
            break  # (asked again, it would wait for good)
    seen["places"] = places
    await _close_watched(seen, "close", dev.close)
    return seen


async def abandoned_across(am: Any, dev: Any, other: Any, held: bool) -> Seen:
    """Queue ``signaller`` of device ``other`` signals ``shared``, a timeline of ``dev``,
    to 3 ("lower") behind a device wait for a timeline of ``other`` that nothing
    signals; with ``held``, a failed queue of ``dev`` (``_failing_behind``'s "waiting",
    its wait discarded: "doomed") then signals ``shared`` to 5 ("behind"), held behind
    the lower signal. ``other`` is closed (no discard: the lower signal is abandoned).
    How that close, "lower", and host waits for 3 and for 5 of ``shared`` ended (each
    within REPORT_S, else "still waiting"); ``shared``'s value before the close."""
    seen: Seen = {}
    shared, never = dev.timeline(), other.timeline()
    signaller = other.new_queue()
    signaller.wait(never, 1)
    lower = signaller.signal(shared, 3)
    if held:
        waiting, discarded = dev.new_queue(), dev.new_queue()
        gate = dev.timeline()
        discarded.wait(gate, 1)
        doomed = waiting.wait(discarded.timeline, 1)
        behind = waiting.signal(shared, 5)
        await discarded.close(discard=True)
        await _try(seen, "doomed", doomed)
        await _try(seen, "behind", behind)
    seen["shared before close"] = shared.value
    seen["close"] = "still closing"
    with anyio.move_on_after(REPORT_S):
        await other.close()
        seen["close"] = "closed"
    await _try(seen, "lower", lower)
    for target in (3, 5):
        await _try(seen, f"shared {target}", shared.wait(target))
    return seen


async def abandoned_after_lower(am: Any, dev: Any, other: Any) -> Seen:
    """Queue ``first`` of ``dev`` signals ``shared``, a timeline of ``dev``, to 2
    ("lower") behind a wait for ``gate``; queue ``signaller`` of device ``other`` signals
    it to 3 ("higher": ordered after the lower one) behind a device wait for a timeline
    of ``other`` that nothing signals. ``other`` is closed (no discard: "higher" is
    abandoned), then the gate raised. How the close and "higher" ended, ``shared``'s
    value before the gate, how "lower" and host waits for 2 and 3 then ended (each
    within REPORT_S)."""
    seen: Seen = {}
    shared, gate, never = dev.timeline(), dev.timeline(), other.timeline()
    first, signaller = dev.new_queue(), other.new_queue()
    first.wait(gate, 1)
    lower = first.signal(shared, 2)
    signaller.wait(never, 1)
    higher = signaller.signal(shared, 3)
    seen["close"] = "still closing"
    with anyio.move_on_after(REPORT_S):
        await other.close()
        seen["close"] = "closed"
    await _try(seen, "higher", higher)
    seen["shared before gate"] = shared.value
    gate.signal(1)
    await _try(seen, "lower", lower)
    await _try(seen, "shared 2", shared.wait(2))
    await _try(seen, "shared 3", shared.wait(3))
    return seen


async def _abandoned_across(sim: _Simulated, held: bool | None = False) -> Seen:
    """``abandoned_across`` on the simulated ``cuda:0`` (``shared``'s) and ``cuda:1``
    (``held`` None: ``abandoned_after_lower``)."""
    import asyncmetal as am

    dev = await am.open_device("cuda:0")
    try:
        other = await am.open_device("cuda:1")
        try:
            if held is None:
                return await abandoned_after_lower(am, dev, other)
            return await abandoned_across(am, dev, other, held)
        finally:
            with anyio.fail_after(20):
                await other.close()  # (closed already: returns at once)
    finally:
        with anyio.fail_after(20):
            await dev.close()


async def _abandoned_across_held(sim: _Simulated) -> Seen:
    return await _abandoned_across(sim, held=True)


async def _abandoned_across_after_lower(sim: _Simulated) -> Seen:
    return await _abandoned_across(sim, held=None)


SCENARIOS = {
    "gated": _on_cuda(gated),
    "held_signal": _on_cuda(held_signal),
    "held_signal_discarded": _on_cuda(held_signal_discarded),
    "discarded_behind_lower": _on_cuda(discarded_behind_lower),
    "reached_while_closing": _on_cuda(reached_while_closing),
    "refused_wait": _refused_wait,
    "refused_wait_number": _refused_wait_number,
    "refused_wait_failing": _refused_wait_failing,
    "made_wait_failing": _made_wait_failing,
    "lower_handed_never_runs": _lower_handed_never_runs,
    "queue_closed_while_held": _queue_closed_while_held,
    "reached_interrupted": _reached_interrupted,
}
# Scenarios on two simulated GPUs.
TWO_GPUS = {
    "abandoned_across": _abandoned_across,
    "abandoned_across_held": _abandoned_across_held,
    "abandoned_across_after_lower": _abandoned_across_after_lower,
}


def run(scenario: str, loop: str, timeout: float = 60) -> Seen:
    """What ``scenario`` saw in a child process, on event loop ``loop`` (``timeout``: the
    child's, in seconds)."""
    return run_child(scenario, loop, timeout=timeout, module=__name__)


def _two_gpus_main() -> None:
    """``child_main`` for TWO_GPUS' scenarios: two simulated GPUs, cuda:0 and cuda:1."""
    import sys
    import tempfile
    from pathlib import Path

    from tests.support.native.simulated_cuda import _install

    scenario, loop = sys.argv[1:3]
    with tempfile.TemporaryDirectory(prefix="asyncmetal-simcuda-") as tmp:
        sim = _Simulated(Path(tmp))
        _install(sim, 2)
        seen = anyio.run(TWO_GPUS[scenario], sim, backend=loop)
    print(json.dumps(seen))


if __name__ == "__main__":
    import sys

    if sys.argv[1] in TWO_GPUS:
        _two_gpus_main()
    else:
        child_main(SCENARIOS)

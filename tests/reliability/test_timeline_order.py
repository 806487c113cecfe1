"""A queue's timeline never passes a value while a command of that queue submitted
before that value is still running (ARCHITECTURE.md, "The ordering invariant"): on
success, on failure (a faulting kernel, a failed device wait), on discard
(``Queue.close(discard=True)``, ``Device.close(discard=True)``), on an abandoning close
and on a device close with work in flight. The allocator reuses a block once its uses'
values passed (``_timeline.passed``), and copies and fills order themselves by these
timelines, so a timeline passing early is memory reused under a running command.

Each kernel marks a slot of a mapped flags buffer 1 as it starts and 2 as it ends (3:
it ends faulting, simulated Metal only). A host thread (the watcher) reads each
queue's timeline as the allocator does -- every value passed once its device stopped,
else the native value -- and then the flags; so do tasks that await completions and
timelines. Every command at or below a value seen passed must have ended then, unless
it never runs at all (the flags read at the very end: 0). Storms of seeded random
rounds on cpu and on Metal (the simulation here) mix launches of several lengths, device
waits on other queues' timelines and on host timelines, faults, and ends of every kind
while work is in flight. The cuda counterpart runs over the simulated driver:
test_timeline_order_cuda.py."""

from __future__ import annotations

import collections
import contextlib
import math
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _timeline
from tests.support import stress

pytestmark = pytest.mark.anyio

# mark(flags, at, us, fault): flags[at] = 1, about `us` microseconds, flags[at] = 2.
C_MARK = r"""
#include <time.h>
void mark(int* flags, int at, int us, int fault) {
    __atomic_store_n(&flags[at], 1, __ATOMIC_RELEASE);
    struct timespec ts = { us / 1000000, (long)(us % 1000000) * 1000L };
    if (us > 0) nanosleep(&ts, 0);
    __atomic_store_n(&flags[at], 2, __ATOMIC_RELEASE);
    (void)fault;  /* a cpu kernel has no fault to raise */
}
"""
# The same in MSL; on the simulated Metal a `fault` command buffer faults once it ends
# (its slot 3), on a real GPU it runs as any other.
MSL_MARK = r"""
#include <metal_stdlib>
using namespace metal;
kernel void mark(device int* flags [[buffer(0)]], constant int& at [[buffer(1)]],
                 constant int& us [[buffer(2)]], constant int& fault [[buffer(3)]],
                 uint i [[thread_position_in_grid]]) {
    if (i != 0) return;
    volatile device int* f = flags;
    f[at] = 1;
#ifdef __ASYNCMETAL_SIM__
    if (us >= 1000) __asyncmetal_sim_sleep_ms(us / 1000);
    if (fault) { f[at] = 3; __asyncmetal_sim_fault(); return; }
#else
    for (long k = 0; k < (long)us * 400; k++) f[at + 0] = 1;
#endif
    f[at] = 2;
}
"""
SLOTS = 4096  # kernels per round at most (each its own slot of the flags)
ENDED = (2, 3)
LENGTHS_US = (0, 0, 200, 1000, 2000, 4000)
ROUNDS = 40  # per device and loop
OPS = 40  # submissions per round, about
ROUND_S = 8.0  # a round that takes longer than this has hung: it fails


@dataclass
class Watched:
    """One device's queues and their launches (queue index, value, slot), appended on
    the loop's thread as submitted and read by the watcher."""

    flags: np.ndarray[Any, Any]
    timelines: list[am.Timeline] = field(default_factory=list)
    launches: list[list[tuple[int, int]]] = field(default_factory=list)  # (value, slot)
    suspects: dict[int, tuple[str, int, int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_queue(self, queue: am.Queue) -> int:
        self.launches.append([])
        self.timelines.append(queue.timeline)
        return len(self.timelines) - 1

    def look(self, who: str, index: int, reached: float) -> None:
        """Every launch of queue ``index`` at or below ``reached`` (read before this
        call) must have ended now: one that has not is a suspect, a violation unless it
        never runs at all."""
        snapshot = self.flags.copy()
        launches = self.launches[index]
        for value, slot in launches[: len(launches)]:
            if value <= reached and snapshot[slot] not in ENDED:
                with self.lock:
                    self.suspects.setdefault(slot, (who, value, int(snapshot[slot])))

    def look_all(self, who: str) -> None:
        for index, timeline in enumerate(list(self.timelines)):
            self.look(who, index, passed_up_to(timeline))

    def violations(self) -> list[str]:
        """The suspects that ran after all (their slot set at the end)."""
        final = self.flags.copy()
        return [
            f"slot {slot}: {who} saw value {value} passed while it was "
            f"{'running' if seen == 1 else 'not started'} (it ran: {int(final[slot])})"
            for slot, (who, value, seen) in sorted(self.suspects.items())
            if final[slot] != 0
        ]


def _simulated() -> bool:
    from tests.support.fakes import metal_sim

    return metal_sim.configured()


def passed_up_to(timeline: am.Timeline) -> float:
    """The highest value of ``timeline`` that the allocator takes as passed now
    (``_timeline.passed``): every one once its device stopped, else the native value."""
    if _timeline.timeline_device(timeline).stopped:
        return math.inf
    return float(timeline.native.value)


@contextlib.contextmanager
def watcher(watched: list[Watched]) -> Iterator[None]:
    """A host thread that looks at every watched queue until the block ends."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            for w in list(watched):
                w.look_all("the watcher")
            stop.wait(0.0002)

    thread = threading.Thread(target=run, name="timeline-order-watcher", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
        assert not thread.is_alive()


async def settle(done: am.Completion) -> str:
    try:
        await done
    except am.AsyncMetalError as exc:
        return type(exc).__name__
    return "ran"


async def _round(
    device_name: str, rng: random.Random, end: str, found: list[str], counts: dict[str, int]
) -> None:
    metal = device_name == "metal"
    async with contextlib.AsyncExitStack() as stack:
        dev = await am.open_device(device_name)
        stack.push_async_callback(dev.close)  # (again after a close: does nothing)
        prog = await dev.compile(MSL_MARK if metal else C_MARK, "mark")
        buf = await dev.alloc(SLOTS * 4)
        await buf.write(np.zeros(SLOTS, np.int32))
        flags = await buf.map(np.int32)
        w = Watched(flags)
        queues = [dev.queue, dev.new_queue(), dev.new_queue()]
        for q in queues:
            w.add_queue(q)
        host = dev.timeline()
        host_next = 0  # the highest value waited for on the host timeline
        done: list[am.Completion] = []
        last = [0] * len(queues)  # the last value submitted to each queue
        slot = 0

        async def awaiting(queue_index: int, completion: am.Completion) -> None:
            """A task's view: once a completion is awaited (or the timeline waited
            for), every command up to it has ended."""
            outcome = await settle(completion)
            if outcome == "ran":
                w.look(f"an await of value {completion.value}", queue_index, completion.value)

        async def awaiting_timeline(queue_index: int, value: int) -> None:
            with contextlib.suppress(am.AsyncMetalError):
                await w.timelines[queue_index].wait(value)
                w.look(f"a timeline wait for {value}", queue_index, value)

        async with anyio.create_task_group() as tg:
            with watcher([w]):
                for _ in range(OPS):
                    qi, q, pick, before = stress.next_step(rng, queues, done)
                    try:
                        if pick < 0.65 and slot < SLOTS:
                            fault = int(metal and rng.random() < 0.08)
                            c = q.launch(prog, buf, vals=(slot, rng.choice(LENGTHS_US), fault))
                            w.launches[qi].append((c.value, slot))
                            slot += 1
                            counts["launches"] += 1
                            done.append(c)
                            if rng.random() < 0.3:
                                tg.start_soon(awaiting, qi, c)
                        elif pick < 0.85:  # a wait for the host or another queue
                            host_next = stress.add_wait(
                                rng, pick, q, qi, queues, last, host, host_next, done
                            )
                        elif pick < 0.92 and host.value < host_next:
                            host.signal(rng.randint(host.value + 1, host_next))
                        else:
                            latest = w.launches[qi][-1][0] if w.launches[qi] else 1
                            tg.start_soon(awaiting_timeline, qi, latest)
                    except am.ClosedResourceError:
                        pass  # a queue discarded mid-round: nothing submitted
                    await stress.after_step(rng, end, tg, queues, qi, done, before, last)
                # The end, with what was submitted in flight.
                if end == "finish":
                    if host_next > host.value:
                        host.signal(host_next)
                    for q in queues[1:]:
                        await q.close()
                    await dev.close()
                elif not await stress.discard_round(end, dev, queues, host, host_next):
                    # "abandon": host waits never signalled; the close abandons them
                    if host_next - 1 > host.value:
                        host.signal(host_next - 1)
                    held = queues[rng.randrange(len(queues))]
                    with contextlib.suppress(am.AsyncMetalError):  # (a queue closed)
                        done.append(held.wait(host, host_next + 1))
                        c = held.launch(prog, buf, vals=(slot, 0, 0))
                        w.launches[queues.index(held)].append((c.value, slot))
                        done.append(c)
                    await dev.close()
                for c in done:
                    counts[await settle(c)] += 1
                await anyio.sleep(0.005)  # the watcher looks at the stopped device
            tg.cancel_scope.cancel()
        await anyio.sleep(0.01)
        found.extend(f"{end}: {v}" for v in w.violations())
        del flags


ENDS = ("finish", "discard_queue", "discard_device", "abandon")


async def test_a_timeline_never_passes_a_running_command(
    anyio_backend: Any, device_name: str
) -> None:
    """Seeded random rounds, each on a device opened for it and ended one of ``ENDS``
    ways (all finished; queues discarded mid-flight; the device discarded; the device
    closed abandoning waits nothing signals), watched by a host thread and awaiting
    tasks: no value is seen passed before every command of its queue up to it ended
    (or never ran). About 5 s per device and loop."""
    found: list[str] = []
    counts: collections.Counter[str] = collections.Counter()
    started = time.monotonic()
    for n in range(ROUNDS):
        rng = random.Random(f"{device_name}-{n}")
        with anyio.fail_after(ROUND_S):
            await _round(device_name, rng, ENDS[n % len(ENDS)], found, counts)
    assert not found, found[:10]
    # What the rounds went through (the seeds fix it): commands that ran, and others
    # that failed or were dropped.
    assert counts["launches"] > ROUNDS * OPS // 2, counts
    assert counts["ran"] > counts["launches"] // 2, counts
    assert counts["ClosedResourceError"] > 0, counts
    if device_name == "metal" and "metal" in am.devices() and _simulated():
        assert counts["DeviceLostError"] > 0, counts  # the faulting command buffers
    assert time.monotonic() - started < ROUNDS * ROUND_S


async def _fail(device: am.Device, queue: Any, host: am.Timeline) -> None:
    """Fail ``queue``'s timeline: its wait for a value of another queue, held behind that
    queue's wait for ``host``'s 1, which is then closed with ``discard=True``."""
    other = device.new_queue()
    other.wait(host, 1)
    doomed = queue.wait(other.timeline, 1)
    await other.close(discard=True)
    with anyio.fail_after(5), pytest.raises(am.ClosedResourceError, match="discard=True"):
        await doomed


@pytest.mark.parametrize("held", [True, False], ids=["held-wait", "ready-wait"])
async def test_a_failed_queues_wait_for_its_own_wait_ends(device: am.Device, held: bool) -> None:
    """A queue whose timeline failed (its wait for a discarded queue's value) waits for
    the value of one of its own wait commands before: that wait fails as the rest of the
    queue's commands do, and the device closes. Checked: on Metal, without the fix it
    never ended, held (its wait for the host released after) or not -- the failed
    timeline counted as there for it, so the GPU waited on the queue's own event in the
    very command buffer that was to signal that value."""
    queue, host = device.new_queue(), device.timeline()
    await _fail(device, queue, host)
    if not held:
        host.signal(2)
    before = queue.wait(host, 2)
    queue.wait(host, 2)  # (a buffer marks both values, this one's and the one before)
    own = queue.wait(queue.timeline, before.value)
    if held:
        host.signal(2)
    with anyio.fail_after(5), pytest.raises(am.ClosedResourceError, match="discard=True"):
        await own
    with anyio.fail_after(5):
        await queue.close()


async def test_a_wait_for_a_failed_queues_wait_ends(device: am.Device) -> None:
    """A queue waits for the value of another queue's wait command, the last command of
    that queue, whose timeline failed (its wait for a discarded queue's value): the wait
    fails, and the waiting queue closes, without anything awaiting the failed queue.
    Checked: on Metal, without the fix neither ended -- the failed timeline counted as
    there for the wait, which went to the GPU at once, for a value that only the failed
    queue's next command buffer (or a flush) marks, and nothing committed one."""
    failed, waiting, host = device.new_queue(), device.new_queue(), device.timeline()
    await _fail(device, failed, host)
    host.signal(2)
    last = failed.wait(host, 2)  # (reached: carried by the failed queue's next buffer)
    theirs = waiting.wait(failed.timeline, last.value)
    with anyio.fail_after(5), pytest.raises(am.ClosedResourceError, match="discard=True"):
        await theirs
    with anyio.fail_after(5):
        await waiting.close()


@pytest.mark.parametrize("held", [True, False], ids=["held-wait", "ready-wait"])
async def test_a_wait_past_a_failed_signal_ends(device: am.Device, held: bool) -> None:
    """A queue waits for a value of a timeline past the one a failed signal (behind a
    wait for a discarded queue's value) was to reach, which nothing else signals: the
    wait fails, as the signal does, and the device closes. Checked: on Metal, without
    the fix neither ended, held (the wait was submitted before the failure) or not --
    the failure counted as there for the wait, and the GPU waited on the timeline's event
    for a value no command buffer signals (a close that cannot be cancelled hung)."""
    signalling, other = device.new_queue(), device.new_queue()
    host, timeline = device.timeline(), device.timeline()
    other.wait(host, 1)
    signalling.wait(other.timeline, 1)
    if not held:
        await other.close(discard=True)
    signal = signalling.signal(timeline, 2)
    waited = device.queue.wait(timeline, 3)
    if held:
        await other.close(discard=True)
    with anyio.fail_after(5), pytest.raises(am.ClosedResourceError, match="discard=True"):
        await signal
    with anyio.fail_after(5), pytest.raises(am.ClosedResourceError, match="discard=True"):
        await waited
    with anyio.fail_after(5):
        await device.close()


async def test_a_discard_of_a_queue_waiting_for_a_failed_queues_held_command_ends(
    device: am.Device,
) -> None:
    """A queue waits for a command of a queue whose timeline failed (its wait for a
    discarded queue's value), held behind that queue's wait for a host value nobody
    signals yet: the waiting queue's discard drops its wait and ends. Checked: on Metal,
    without the fix it ended only once the host signalled -- the failure counted as
    there for the wait, which went to the GPU for a value that the failed queue still
    held on the host."""
    failed, waiting, host = device.new_queue(), device.new_queue(), device.timeline()
    await _fail(device, failed, host)
    failed.wait(host, 2)
    behind = failed.signal(device.timeline(), 1)
    theirs = waiting.wait(failed.timeline, behind.value)
    with anyio.fail_after(5):
        await waiting.close(discard=True)
    with anyio.fail_after(5), pytest.raises(am.ClosedResourceError, match="discard=True"):
        await theirs
    host.signal(2)


@pytest.mark.metal
@pytest.mark.parametrize("failed", [False, True], ids=["healthy", "failed"])
async def test_a_metal_wait_for_its_own_queue_makes_no_command_buffer(
    anyio_backend: Any, failed: bool
) -> None:
    """A Metal queue's wait for its own timeline, submitted while a wait command of its
    own is not carried by a buffer yet, for a value a committed buffer signals (or, its
    timeline failed, for that wait command's value): it is submitted as any wait is,
    the submitting thread making no command buffer (one could block there, with 1024 in
    flight, or fail), and the queue goes on. Checked: a fix that committed the pending
    wait command first made one here, in both cases."""
    if "metal" not in am.devices():
        pytest.skip("no Metal here, not even the simulation (tests/support/fakes/metal_sim)")
    from tests.support.fakes import metal_sim

    async with am.open_device("metal") as dev:
        queue, host = dev.new_queue(), dev.timeline()
        if failed:
            await _fail(dev, queue, host)
        else:
            await queue.marker()
            await queue.signal(dev.timeline(), 1)  # (a committed buffer: value 1)
        host.signal(2)
        pending = queue.wait(host, 2)  # ready: its value is marked by the next buffer
        metal_sim.fail_at(0)  # (counts the objects the thread makes from here)
        own = queue.wait(queue.timeline, pending.value if failed else 1)
        assert metal_sim.fail_at(-1) == 0
        with anyio.fail_after(5):
            if failed:
                with pytest.raises(am.ClosedResourceError):
                    await own
            else:
                await own
            await queue.close()


@pytest.mark.metal
@pytest.mark.parametrize("held", [True, False], ids=["held-wait", "gpu-wait"])
async def test_a_metal_wait_for_another_queues_wait_ends(anyio_backend: Any, held: bool) -> None:
    """A Metal queue's device wait for the value of another queue's wait command (its
    last command): the other wait is released (a host signal; or it waits for a value
    reached already), and the first wait ends without anyone awaiting the other queue,
    as it does on cpu. Checked: without the fix it never ended -- the released wait's
    own value is marked only by the next command buffer of its queue, or by a flush
    that an await of that queue makes, and nothing committed it (the storm above hung
    in the device's close so)."""
    if "metal" not in am.devices():
        pytest.skip("no Metal here, not even the simulation (tests/support/fakes/metal_sim)")
    async with am.open_device("metal") as dev:
        waiting, other = dev.queue, dev.new_queue()
        if held:
            host = dev.timeline()
            first = other.wait(host, 1)
        else:
            third = dev.new_queue()
            await third.marker()  # (value 0: nothing)
            await (done := third.signal(dev.timeline(), 1))
            first = other.wait(third.timeline, done.value)
        second = waiting.wait(other.timeline, first.value)
        if held:
            host.signal(1)
        try:
            with anyio.fail_after(5):
                await second
        finally:
            with anyio.fail_after(5):
                await first  # (flushes `other`: a close never hangs on it)

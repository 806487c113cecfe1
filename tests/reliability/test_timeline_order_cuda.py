"""The ordering invariant of test_timeline_order.py on a cuda device: the real native
runtime and extension over the simulated driver (tests/support/fakes/
fake_cuda_driver.c), in a child process (the runtime's driver table is process-wide:
tests/support/native/simulated_cuda.py). Runs everywhere a C compiler is found.

A simulated kernel runs on its stream's thread and then logs its first parameter, here
the address of a slot of its own: the stream's log says which launches ended. A host
thread reads each queue's timeline as the allocator does (``_timeline.passed``: every
value once the device stopped, else the native value) and then its stream's log; every
launch at or below a value seen passed must be in the log by then, unless it never runs
(the log at the end, read as each stream is destroyed, does not have it). Seeded rounds
mix launches of 0 to 3 ms, device waits on other queues' and host timelines, host
signals, a faulting kernel (the context's sticky error), queue discards and every kind
of device close while work is in flight.

``python -m tests.reliability.test_timeline_order_cuda order LOOP`` is the child.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import json
import math
import random
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.support import stress
from tests.support.native import harness, simulated_cuda

LOOPS = ["asyncio", "trio"]
ROUNDS = 24
OPS = 40
SLOTS = 1024
DURATIONS_NS = (0, 0, 200_000, 1_000_000, 3_000_000)
ENDS = ("finish", "discard_queue", "discard_device", "abandon")


def _end(n: int) -> str:
    """Round ``n``'s end; the last faults (the driver's sticky error is the process's
    for good: no device opens after it)."""
    return "fault" if n == ROUNDS - 1 else ENDS[n % len(ENDS)]


# fake_cuda_driver.h's fake_stream up to its log: a pthread_t, a pthread_mutex_t, the
# ops pointer, cap, head and tail, the stop flag (padded); then the log (1 << 16
# int64s) and `ran`, which is checked against stream_ran() before the log is trusted.
LOG_OFFSET = ctypes.sizeof(ctypes.c_void_p) * 5 + 40 + 8
LOG_SIZE = 1 << 16


@pytest.fixture(autouse=True)
def _compiler() -> None:
    harness.skip_without_compiler()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_cuda_timeline_never_passes_a_running_command(loop: str) -> None:
    """No cuda queue's timeline is seen passed before every launch of that queue up to
    it ended (or never runs), whatever ended the round. About 10 s per loop."""
    seen = simulated_cuda.run_child(
        "order", loop, timeout=240, module="tests.reliability.test_timeline_order_cuda"
    )
    assert seen["violations"] == [], seen["violations"][:10]
    counts = seen["counts"]
    assert counts["launches"] > ROUNDS * OPS // 2, counts
    assert counts["ran"] > counts["launches"] // 3, counts
    assert counts["ClosedResourceError"] > 0 and counts["DeviceLostError"] > 0, counts


class Stream:
    """A simulated stream's log, read as it grows, and for the last time as the stream
    is destroyed (its memory goes then)."""

    def __init__(self, sim: Any, handle: int) -> None:
        self.sim, self.handle = sim, handle
        self.read = 0
        self.logged: set[int] = set()
        self.gone = False
        ran = ctypes.c_long.from_address(handle + LOG_OFFSET + 8 * LOG_SIZE).value
        assert ran == sim.fake.stream_ran(handle), "fake_stream's layout changed"

    def update(self) -> None:
        if self.gone:
            return
        ran = int(self.sim.fake.stream_ran(self.handle))
        log = (ctypes.c_int64 * LOG_SIZE).from_address(self.handle + LOG_OFFSET)
        assert ran - self.read < LOG_SIZE
        for i in range(self.read, ran):
            self.logged.add(int(log[i % LOG_SIZE]))
        self.read = ran


class Watch:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queues: list[tuple[Any, Stream, list[tuple[int, int]]]] = []
        self.suspects: dict[int, tuple[int, float]] = {}
        self.streams: dict[int, Stream] = {}

    def look(self, sim: Any) -> None:
        from asyncmetal import _timeline

        with self.lock:
            for queue, stream, launches in self.queues:
                if sim.fault_code.value:
                    # The context faulted: the driver fails every call of the process
                    # from then on, and a GPU stops all of the context's work; the
                    # simulated streams let a kernel running then finish while the
                    # queues settle their timelines (not an early pass: no memory can
                    # be taken again).
                    return
                timeline = queue.timeline
                if _timeline.timeline_device(timeline).stopped:
                    reached = math.inf
                else:
                    reached = float(timeline.native.value)
                stream.update()
                for value, address in launches[: len(launches)]:
                    if value <= reached and address not in stream.logged:
                        self.suspects.setdefault(address, (value, reached))

    def destroyed(self, handle: int) -> None:
        with self.lock:
            stream = self.streams.get(handle)
            if stream is not None:
                stream.update()
                stream.gone = True


async def _settle(done: Any) -> str:
    import asyncmetal as am

    try:
        await done
    except am.AsyncMetalError as exc:
        return type(exc).__name__
    return "ran"


async def _round(sim: Any, watch: Watch, rng: random.Random, end: str, counts: Any) -> None:
    import asyncmetal as am
    from tests.reliability.test_cuda_faults import SRC

    dev = await am.open_device("cuda:0")
    try:
        params = await dev._params(SRC, "k")
        kernel = await dev._program(
            ("key", "k"), params, b"cubin", SRC, dev._backend.compiler, None
        )
        faulty = await dev._program(
            ("key", "bounded"),
            params,
            b"cubin",
            simulated_cuda.BOUNDED_SRC,
            dev._backend.compiler,
            None,
        )
        buf = await dev.alloc(SLOTS * 8)
        base = buf.__cuda_array_interface__["data"][0]
        queues = [dev.queue, dev.new_queue(), dev.new_queue()]
        entries: list[list[tuple[int, int]]] = []
        with watch.lock:
            watch.queues.clear()
            for q in queues:
                stream = Stream(sim, int(q._native.handle))
                watch.streams[stream.handle] = stream
                entries.append([])
                watch.queues.append((q, stream, entries[-1]))
        host = dev.timeline()
        host_next, slot = 0, 0
        last = [0] * len(queues)
        done: list[Any] = []
        fault_at = rng.randrange(OPS // 2, OPS) if end == "fault" else -1

        def launch(qi: int, program: Any) -> None:
            nonlocal slot
            sim.duration_ns.value = rng.choice(DURATIONS_NS)
            c = queues[qi].launch(program, buf.view(slot * 8, 8))
            entries[qi].append((c.value, base + slot * 8))
            slot += 1
            counts["launches"] += 1
            done.append(c)

        async with anyio.create_task_group() as tg:
            for n in range(OPS):
                qi, q, pick, before = stress.next_step(rng, queues, done)
                try:
                    if n == fault_at:
                        sim.bounded.fault = 1
                        launch(qi, faulty)
                    elif pick < 0.65 and slot < SLOTS:
                        launch(qi, kernel)
                    elif pick < 0.85:  # a wait for the host or another queue
                        host_next = stress.add_wait(
                            rng, pick, q, qi, queues, last, host, host_next, done
                        )
                    elif host.value < host_next:
                        host.signal(rng.randint(host.value + 1, host_next))
                except am.ClosedResourceError:
                    pass  # a queue discarded mid-round
                except am.DeviceLostError:
                    pass  # the context faulted: nothing more is taken
                await stress.after_step(rng, end, tg, queues, qi, done, before, last)
            with anyio.fail_after(30):
                if end in ("finish", "fault"):
                    if host_next > host.value:
                        host.signal(host_next)
                    await dev.close()
                elif not await stress.discard_round(end, dev, queues, host, host_next):
                    # "abandon": waits that nothing signals
                    with contextlib.suppress(am.AsyncMetalError):
                        held = rng.randrange(len(queues))
                        done.append(queues[held].wait(host, host_next + 1))
                        launch(held, kernel)
                    await dev.close()
                for c in done:
                    counts[await _settle(c)] += 1
    finally:
        with anyio.fail_after(30):
            await dev.close()
        sim.bounded.fault = 0
        sim.duration_ns.value = 0


async def _order(sim: Any) -> dict[str, Any]:
    watch = Watch()
    destroy = sim.fake.stream_destroy

    def destroyed(handle: int) -> None:
        watch.destroyed(handle)
        destroy(handle)

    sim.fake.stream_destroy = destroyed
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            watch.look(sim)
            stop.wait(0.0002)

    counts: collections.Counter[str] = collections.Counter()
    thread = threading.Thread(target=run, name="timeline-order-watcher", daemon=True)
    thread.start()
    try:
        for n in range(ROUNDS):
            await _round(sim, watch, random.Random(f"cuda-{n}"), _end(n), counts)
            await anyio.sleep(0.005)
            with watch.lock:
                for stream in watch.streams.values():
                    stream.update()
                logged = set().union(*(s.logged for s in watch.streams.values()))
                violations = [
                    f"round {n} ({_end(n)}): the launch at {address:#x} (value "
                    f"{value}) ran though its timeline was seen at {reached}"
                    for address, (value, reached) in sorted(watch.suspects.items())
                    if address in logged
                ]
                if violations:
                    return {"violations": violations, "counts": counts}
                # (the round's queues too: their stopped timelines would make suspects of
                # its launches that never ran, whose addresses the next round's reuse)
                watch.queues.clear()
                watch.suspects.clear()
                watch.streams = {h: s for h, s in watch.streams.items() if not s.gone}
                for s in watch.streams.values():
                    s.logged.clear()
    finally:
        stop.set()
        thread.join(10)
        sim.fake.stream_destroy = destroy
    return {"violations": [], "counts": counts}


def main(scenario: str, loop: str) -> None:
    assert scenario == "order", scenario
    with tempfile.TemporaryDirectory(prefix="asyncmetal-simcuda-") as tmp:
        sim = simulated_cuda._Simulated(Path(tmp))
        simulated_cuda._install(sim, 1)
        seen = anyio.run(functools.partial(_order, sim), backend=loop)
    print(json.dumps(seen))


if __name__ == "__main__":
    main(*sys.argv[1:])

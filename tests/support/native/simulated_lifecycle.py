"""A cuda queue's own lifecycle over the simulated driver (simulated_cuda.py: the real
native runtime, streams of tests/support/fakes/fake_cuda_driver.c), in a child process:
``python -m tests.support.native.simulated_lifecycle SCENARIO LOOP`` prints what
SCENARIO saw, as JSON, on its last line (``run`` runs it, and reads that).

- ``closes``: one native queue closed by several threads at once while its stream waits
  on the device for a value only the host signals.
- ``dropped``: native queues whose CUDAQueue was collected unclosed (a new_queue failing
  once its native queue was made; a CUDAQueue dropped); and one collected in a forked
  child, the parent's.
- ``behind_a_failed_wait``: a queue's device wait that fails, and behind it a wait for a
  value nothing may produce (of each kind), or a signal ordered after another queue's.
- ``behind_a_failed_wait_stuck``: the same, the signal ordered after another queue's that
  never runs (that queue waits for a value nobody signals): the device's close.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import warnings
import weakref
from typing import Any

import anyio

from tests.support.native.simulated_cuda import (
    Seen,
    _awaited,
    _Simulated,
    child_main,
    run_child,
)

GATE_S = 0.3  # how long the closes are left waiting before the value is signalled


async def _closes(sim: _Simulated) -> Seen:
    """A queue whose stream waits, on the device, for a timeline value only the host
    signals, a marker behind the wait: its native queue closed plainly on one thread
    and, once that close is inside the runtime's, plainly on a second and abandoning on
    a third. Which closes had returned before the value was signalled, and after."""
    import asyncmetal as am
    from asyncmetal._queue import native_queue

    seen: Seen = {}
    dev = await am.open_device("cuda:0")
    try:
        held, gate = dev.new_queue(), dev.timeline()
        gate.signal(1)  # (only ever signalled by the host: its waits go to the driver at once)
        held.wait(gate, 2)
        done = held.marker()
        native: Any = native_queue(held)
        closed: list[str] = []

        def close(who: str, abandon: bool) -> None:
            native.close(abandon)
            closed.append(who)

        first = threading.Thread(target=close, args=("first", False), daemon=True)
        first.start()
        with anyio.fail_after(10):
            while native._q is not None:  # (taken: inside its native close)
                await anyio.sleep(0.001)
        threads = [first] + [
            threading.Thread(target=close, args=args, daemon=True)
            for args in (("second", False), ("abandoning", True))
        ]
        for thread in threads[1:]:
            thread.start()
        await anyio.sleep(GATE_S)
        seen["before"] = sorted(closed)
        gate.signal(2)
        with anyio.move_on_after(20):
            while any(thread.is_alive() for thread in threads):
                await anyio.sleep(0.001)
        seen["after"] = sorted(closed)
        seen["marker"] = await _awaited(done)
    finally:
        with anyio.fail_after(20):
            await dev.close()
    return seen


def _threads() -> int:
    """The process's threads, native ones too (a completion thread, a simulated stream's)."""
    return len(os.listdir("/proc/self/task"))


def _child_ended(pid: int) -> str:
    """How forked child ``pid`` ended: "exited", or "hung" past 10 s (then killed)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return f"exited {os.waitstatus_to_exitcode(status)}"
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"


async def _dropped(sim: _Simulated) -> Seen:
    """Four new_queues that fail once their native queue was made (here: as CUDAQueue
    asks for the native extension), which hand out nothing and leave nothing else
    holding it; four CUDAQueues made and dropped; then one kept while a forked child
    collects its copy. Threads and events left after a collection (compared with
    before), how the child ended (its exit code: 3, the queue not collected; 4, native
    calls made for it), and whether the device went on."""
    import asyncmetal as am
    from asyncmetal import _native
    from asyncmetal.backends.cuda import _queue
    from asyncmetal.backends.cuda._queue import CUDAQueue
    from asyncmetal.backends.cuda._timeline import CUDATimeline
    from tests.support.queues import fail_new_queues

    seen: Seen = {}
    dev = await am.open_device("cuda:0")
    try:
        async with dev.new_queue() as queue:  # (the device's own threads started)
            await queue.marker()
        gc.collect()
        threads, events = _threads(), sim.events_made.value - sim.events_destroyed.value
        fail_new_queues(dev, _native, "extension")
        backend: Any = dev._backend
        for _ in range(4):
            CUDAQueue(backend, CUDATimeline(backend))  # (dropped at once)
        gc.collect()
        with anyio.move_on_after(10):
            while _threads() > threads:
                await anyio.sleep(0.01)
        seen["threads_left"] = _threads() - threads
        seen["events_left"] = sim.events_made.value - sim.events_destroyed.value - events
        kept = CUDAQueue(backend, CUDATimeline(backend))
        collected = weakref.ref(kept)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (a fork with threads)
            pid = os.fork()
        if pid == 0:  # (the child: the queue collected, then out)
            # Its native calls noted, not made: with the parent's threads gone here, an
            # abandoning close gives up on its completion thread after 200 ms, and a
            # real driver's call on a parent's stream does what it does.
            calls: list[str] = []
            backend.lib.am_cuq_close = lambda *args: calls.append("am_cuq_close")
            _queue.cu.cuStreamDestroy = lambda *args: calls.append("cuStreamDestroy")
            del kept
            gc.collect()
            os._exit(3 if collected() is not None else 4 if calls else 0)
        seen["forked"] = _child_ended(pid)
        kept.close()
        async with dev.new_queue() as queue:  # (the device goes on)
            seen["after"] = await _awaited(queue.marker())
    finally:
        with anyio.fail_after(20):
            await dev.close()
    return seen


BEHIND = ("unsignalled", "host", "queue", "ordering")


async def _behind_a_failed_wait(sim: _Simulated) -> Seen:
    """Per form in BEHIND, on a device of its own: a queue's device wait for the command
    of a queue then closed with ``discard=True`` (it fails: "doomed"), and behind it
    ("behind") a wait for a value nobody signals -- of a timeline never signalled, of
    one the host signalled (whose waits go to the driver at once), of another queue's
    own timeline -- or ("ordering") a signal of a timeline that another queue, held
    behind a gate, signals to a lower value first (the signal waits for that one). How
    each ended (5 s at most; the ordering form's once the gate is raised), and how long
    the device's close took; the ordering form's too: the other queue's signal
    ("lower"), and waits for the lower and the higher value."""
    import asyncmetal as am

    seen: Seen = {}
    for form in BEHIND:
        dev = await am.open_device("cuda:0")
        try:
            waiting, discarded, other = dev.new_queue(), dev.new_queue(), dev.new_queue()
            gate, shared = dev.timeline(), dev.timeline()
            discarded.wait(gate, 1)
            doomed = waiting.wait(discarded.timeline, 1)
            if form == "unsignalled":
                behind = waiting.wait(shared, 5)
            elif form == "host":
                shared.signal(1)
                behind = waiting.wait(shared, 5)
            elif form == "queue":
                behind = waiting.wait(other.timeline, 100)
            else:
                other.wait(gate, 2)
                lower = other.signal(shared, 1)
                behind = waiting.signal(shared, 2)
            await discarded.close(discard=True)
            if form == "ordering":
                gate.signal(2)
            awaited = {"doomed": doomed, "behind": behind}
            if form == "ordering":
                awaited |= {"lower": lower, "1": shared.wait(1), "2": shared.wait(2)}
            for name, done in awaited.items():
                with anyio.move_on_after(5):
                    seen[f"{form} {name}"] = await _awaited(done)
        finally:
            started = time.monotonic()
            await dev.close()
            seen[f"{form} close_s"] = time.monotonic() - started
    return seen


async def _behind_a_failed_wait_stuck(sim: _Simulated) -> Seen:
    """The "ordering" form of ``_behind_a_failed_wait``, but the other queue's lower
    signal never runs: that queue waits first for a timeline nobody signals. The waiting
    queue's signal is ordered after that one (a device wait held on the host for it),
    behind its own failed wait. How long the device's close took (it cannot be
    cancelled: a hang is the child's timeout), and how each command ended after it."""
    import asyncmetal as am

    seen: Seen = {}
    dev = await am.open_device("cuda:0")
    try:
        waiting, discarded, other = dev.new_queue(), dev.new_queue(), dev.new_queue()
        gate, never, shared = dev.timeline(), dev.timeline(), dev.timeline()
        discarded.wait(gate, 1)
        doomed = waiting.wait(discarded.timeline, 1)
        other.wait(never, 1)
        lower = other.signal(shared, 1)
        behind = waiting.signal(shared, 2)
        await discarded.close(discard=True)
        with anyio.move_on_after(1):
            seen["doomed before close"] = await _awaited(doomed)
    finally:
        started = time.monotonic()
        await dev.close()
        seen["close_s"] = time.monotonic() - started
    for name, done in {"doomed": doomed, "behind": behind, "lower": lower}.items():
        with anyio.move_on_after(5):
            seen[name] = await _awaited(done)
    return seen


SCENARIOS = {
    "closes": _closes,
    "dropped": _dropped,
    "behind_a_failed_wait": _behind_a_failed_wait,
    "behind_a_failed_wait_stuck": _behind_a_failed_wait_stuck,
}


def run(scenario: str, loop: str, timeout: float = 120) -> Seen:
    """What ``scenario`` saw in a child process, on event loop ``loop`` (``timeout``: the
    child's, in seconds)."""
    return run_child(scenario, loop, timeout=timeout, module=__name__)


if __name__ == "__main__":
    child_main(SCENARIOS)

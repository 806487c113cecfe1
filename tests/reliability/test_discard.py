"""Closing with discard=True: a queue's or a device's commands that have not started
are dropped -- each raises ClosedResourceError saying so where awaited, a timeline one
was to signal fails -- what runs finishes, and nothing leaks. And a KeyboardInterrupt
that reaches a close (trio's second Ctrl-C) switches it to discarding, never leaving
the device half closed."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _device
from asyncmetal._interrupts import ctrl_c_discards
from tests.support.interrupts import interrupted
from tests.support.kernels import KERNELS, MSL_KERNELS
from tests.support.queues import discard_outcomes

pytestmark = pytest.mark.anyio

# Commands queued behind a wait: more than a Metal queue commits ahead of what it has run
# (1000 command buffers), as a real backlog would be.
BACKLOG = 2_000
HOLD_S = 60  # how long held_elsewhere holds at most


# A cpu kernel that holds its queue until the test says so: it writes a byte to one
# pipe (it started), then reads one from another (the test's go). Its buffer is for
# other queues to wait for it (Queue.after).
C_HELD = r"""
#include <unistd.h>
void held(int* used, int started, int go) {
    char c = 1;
    while (write(started, &c, 1) < 0) {}
    while (read(go, &c, 1) < 0) {}
}
"""


@contextlib.asynccontextmanager
async def held_elsewhere() -> AsyncIterator[Callable[[am.Queue], None]]:
    """``hold(queue)``: ``queue`` waits (on the device) for a command of another (cpu)
    device's queue that runs until the context ends: what is submitted to ``queue``
    next is held behind work that runs -- a close waits for it, a discard drops it all
    (a Metal queue holds a wait for another kind's queue on its own thread; a cpu queue,
    on its thread) -- and none of it can have run before the context ends. (Or before
    HOLD_S: a close that does not discard, shielded, would wait for good; released
    then, what it waited for runs, which the test sees.)"""
    started_r, started_w = os.pipe()
    go_r, go_w = os.pipe()
    released = threading.Lock()

    def release() -> None:
        if released.acquire(blocking=False):
            os.write(go_w, b"g")

    watchdog = threading.Timer(HOLD_S, release)
    try:
        async with am.open_device("cpu:60") as other:
            kernel = await other.compile(C_HELD, "held")
            used = await other.alloc(4)
            other.queue.launch(kernel, used, vals=(started_w, go_r))

            def hold(queue: am.Queue) -> None:
                queue.after(used)

            watchdog.start()
            try:
                yield hold
            finally:
                release()
    finally:
        watchdog.cancel()
        if watchdog.is_alive():
            watchdog.join()
        for fd in (started_r, started_w, go_r, go_w):
            os.close(fd)


async def until(condition: Callable[[], bool]) -> None:
    """Until ``condition()`` holds (what the test waits for happens on this loop, or on
    a thread: a condition to see, not a time to wait)."""
    with anyio.fail_after(20):
        while not condition():
            await anyio.sleep(0.001)


# A kernel that marks its run at its end: the mark is there once it is done, never
# before (a command reported as run that did not finish would show).
C_MARK = r"""
#include <time.h>
void slow_mark(int* marks, int i, int ms) {
    struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };
    nanosleep(&ts, 0);
    marks[i] = 1;
}
"""
MSL_MARK = r"""
#include <metal_stdlib>
using namespace metal;
kernel void slow_mark(device int* marks [[buffer(0)]], constant int& i [[buffer(1)]],
                      constant int& ms [[buffer(2)]], uint t [[thread_position_in_grid]]) {
    volatile int x = 0;
    for (long k = 0; k < (long)ms * 400000; k++) x += 1;
    if (t == 0) marks[i] = 1;
}
"""


async def marker(device: am.Device) -> am.Program:
    return await device.compile(MSL_MARK if device.name == "metal" else C_MARK, "slow_mark")


def check_ran(ran: list[bool], marks: np.ndarray, count: int) -> None:
    """The first ``count`` commands ran, each marked its run; the others never ran (no
    mark)."""
    assert ran == [True] * count + [False] * (len(ran) - count)
    assert marks[: len(ran)].tolist() == [int(r) for r in ran]


async def test_a_queue_closed_with_discard_drops_what_has_not_started(
    device: am.Device,
) -> None:
    mark = await marker(device)
    marks = await device.alloc(4 * BACKLOG)
    await marks.write(np.zeros(BACKLOG, np.int32))
    tl = device.timeline()
    q = device.new_queue()
    first = q.launch(mark, marks, vals=(0, 1))
    async with held_elsewhere() as hold:
        hold(q)  # (none of what follows runs before the discard)
        done = [first, *(q.launch(mark, marks, vals=(i, 1)) for i in range(1, BACKLOG))]
        signalled = q.signal(tl, 1)  # among the dropped: tl never gets there
        await first
        with anyio.fail_after(20):
            await q.close(discard=True)
            assert q.closed and q.timeline.value >= q.submitted
            ran = await discard_outcomes(done)
            with pytest.raises(am.ClosedResourceError, match="discard"):
                await signalled
            with pytest.raises(am.ClosedResourceError, match="discard"):
                await tl.wait(1)
    check_ran(ran, await marks.read(np.int32), 1)
    # The device goes on: its other queues, the same buffer.
    await device.queue.launch(mark, marks, vals=(BACKLOG - 1, 0))
    assert (await marks.read(np.int32))[-1] == 1


async def test_a_command_running_as_a_discard_lands_finishes_and_nothing_after_it_runs(
    device: am.Device,
) -> None:
    """A discard that lands while a cpu queue's thread runs a command: that command
    finishes (and is reported as run), the next ones -- due at once, behind no wait --
    never start."""
    mark = await marker(device)
    held = await device.compile(C_HELD, "held")
    marks = await device.alloc(4 * BACKLOG)
    await marks.write(np.zeros(BACKLOG, np.int32))
    q = device.new_queue()
    started_r, started_w = os.pipe()
    go_r, go_w = os.pipe()
    try:
        running = q.launch(held, marks, vals=(started_w, go_r))
        done = [q.launch(mark, marks, vals=(i, 0)) for i in range(BACKLOG)]
        with anyio.fail_after(30):
            await anyio.to_thread.run_sync(os.read, started_r, 1)  # (it runs)
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(q.close, discard=True))
                await until(lambda: q.closed)  # (sealed and discarded in one step)
                os.write(go_w, b"g")
            ran = await discard_outcomes([running, *done])
    finally:
        for fd in (started_r, started_w, go_r, go_w):
            os.close(fd)
    assert ran == [True] + [False] * BACKLOG
    assert not (await marks.read(np.int32)).any()


async def test_a_device_wait_under_way_ends(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """A device wait nobody signals does not hold a discarding close: on cpu its queue
    thread waits on the host; on Metal a wait that no committed command buffer (nor the
    host) satisfies is held on the queue's own thread, with what follows it, and never
    reaches the GPU (whose wait could not be taken back)."""
    q = device.new_queue()
    waiting = q.wait(device.timeline(), 1)
    dropped = [q.launch(kernels["sleep_ms"], vals=(1,)) for _ in range(100)]
    with anyio.fail_after(20):
        await q.close(discard=True)
        assert await discard_outcomes([waiting, *dropped]) == [False] * 101


async def test_a_discard_as_a_held_wait_gets_ready_ends(device: am.Device) -> None:
    """A queue's last command, a wait for a host value, is released just as the queue
    is discarded: the discard ends, the wait having run (as on cpu). Checked: on Metal,
    without the fix the discard never ended while the device was open -- the queue's
    thread noted the released wait for its next command buffer, the discard dropped the
    flush that was to commit it (nothing else was left to drop, so no buffer came after),
    and its value was never marked."""
    q = device.new_queue()
    host = device.timeline()
    waited = q.wait(host, 1)
    await anyio.sleep(0.05)  # (on Metal, held on the queue's thread by now)
    host.signal(1)
    with anyio.fail_after(5):
        await q.close(discard=True)
    with anyio.fail_after(5):
        await waited


async def test_a_device_wait_for_a_dropped_signal_fails_what_follows(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """Another queue's device wait for a signal the close dropped fails that queue's
    commands from the wait on, naming the discard."""
    tl = device.timeline()
    q, other = device.new_queue(), device.new_queue()
    async with held_elsewhere() as hold:
        hold(q)
        dropped = [q.launch(kernels["sleep_ms"], vals=(1,)) for _ in range(BACKLOG)]
        q.signal(tl, 1)
        other.wait(tl, 1)
        behind = other.launch(kernels["empty"])
        with anyio.fail_after(20):
            await q.close(discard=True)
            with pytest.raises(am.AsyncMetalError, match="discard"):
                await behind
        assert await discard_outcomes(dropped) == [False] * BACKLOG


@pytest.mark.parametrize("how", ["discard", "switched"])
async def test_a_device_closed_with_discard_drops_every_queues_backlog(
    anyio_backend: object, device_name: str, how: str
) -> None:
    """``close(discard=True)``, or a plain close switched to discarding by one with
    discard=True while it waits: bounded, every queue's backlog dropped (a queue held
    by a wait nobody signals too), waits on the device's timelines end failed, memory
    returns to zero (also buffers never freed, used by dropped commands) and the
    queue threads go. The backlog waits behind work that runs on another device, which
    a plain close waits for: it is held until the close has discarded it."""
    threads = len(os.listdir("/proc/self/task"))
    device = await am.open_device(device_name)
    mark = await marker(device)
    marks = await device.alloc(4 * BACKLOG)
    await marks.write(np.zeros(BACKLOG, np.int32))
    tl, never = device.timeline(), device.timeline()
    queues = [device.queue, device.new_queue(), device.new_queue()]
    queues[2].wait(never, 1)
    ran_first = queues[0].launch(mark, marks, vals=(0, 1))
    async with held_elsewhere() as hold:
        for queue in queues[:2]:
            hold(queue)
        done = [queues[i % 2].launch(mark, marks, vals=(i, 1)) for i in range(1, BACKLOG)]
        held = queues[2].launch(mark, marks, vals=(0, 1))
        queues[0].signal(tl, 1)
        await ran_first
        with anyio.fail_after(30):
            if how == "switched":
                async with anyio.create_task_group() as tg:
                    tg.start_soon(device.close)
                    # (its teardown has begun: it waits for the backlog, behind the gate)
                    await until(lambda: device._torn_down)
                    await device.close(discard=True)
            else:
                await device.close(discard=True)
            ran = await discard_outcomes([ran_first, *done, held])
            with pytest.raises(am.ClosedResourceError):
                await tl.wait(1)
    assert device.closed
    assert ran == [True] + [False] * BACKLOG
    statistics = device.memory_statistics()  # (marks was never freed)
    assert statistics.in_use == statistics.cached == 0
    del marks, done, held
    with anyio.fail_after(10):
        while len(os.listdir("/proc/self/task")) > threads + 1:  # (a close may be ending)
            await anyio.sleep(0.01)


@pytest.mark.parametrize("closed", ["queue", "device"])
async def test_a_dropped_command_s_error_names_the_close_that_dropped_it(
    anyio_backend: object, device_name: str, closed: str
) -> None:
    """A command a close with discard=True dropped, and a command of another queue
    behind a device wait for a signal it dropped, fail naming that close: the queue's,
    or the device's. Checked: fails without the fix (a device's close said "its queue
    was closed with discard=True")."""
    device = await am.open_device(device_name)
    try:
        kernel = await device.compile(MSL_KERNELS if device.name == "metal" else KERNELS, "empty")
        tl = device.timeline()
        q, other = device.new_queue(), device.new_queue()
        async with held_elsewhere() as hold:
            hold(q)
            dropped = q.launch(kernel)
            q.signal(tl, 1)
            other.wait(tl, 1)
            behind = other.launch(kernel)
            with anyio.fail_after(20):
                if closed == "queue":
                    await q.close(discard=True)
                else:
                    await device.close(discard=True)
        why = (
            "its queue was closed with discard=True"
            if closed == "queue"
            else f"its device, {device_name}, was closed with discard=True"
        )
        with anyio.fail_after(20):
            for completion in (dropped, behind):  # (behind: dropped, or its wait failed)
                with pytest.raises(am.ClosedResourceError, match=re.escape(why)):
                    await completion
    finally:
        await device.close()


async def test_a_queue_close_under_way_switches_to_discarding(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    q = device.new_queue()
    async with held_elsewhere() as hold:
        hold(q)
        done = [q.launch(kernels["sleep_ms"], vals=(1,)) for _ in range(BACKLOG)]
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(q.close)
                await until(lambda: q.closed)  # (it waits for the backlog, behind the gate)
                await q.close(discard=True)
        assert await discard_outcomes(done) == [False] * BACKLOG


# A program as a user writes it: a backlog queued, then Ctrl-C (the first leaves
# sleep_forever, and the `async with` closes the device, waiting for the backlog), then
# Ctrl-C again while that close waits. Each from a thread, as a terminal's would come.
_INTERRUPTED = r"""
import os, signal, sys, threading, time
import anyio, numpy as np
import asyncmetal as am
from asyncmetal import _device
from asyncmetal._interrupts import ctrl_c_discards

LOOP = sys.argv[1]
dev = last = None


def interrupt():
    while dev is None or dev._closing is None:  # (until the first one started a close)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGINT)


async def main():
    global dev, last
    async with am.open_device("cpu") as opened:
        k = await opened.compile("#include <time.h>\n"
            "void k(int* x) { struct timespec t = {0, 2000000}; nanosleep(&t, 0); x[0]++; }",
            "k")
        buf = await opened.alloc(4)
        await buf.write(np.zeros(1, np.int32))
        for _ in range(5000):  # ~10 s of kernels
            opened.queue.launch(k, buf)
        dev, last = opened, opened.queue.launch(k, buf)
        threading.Thread(target=interrupt, daemon=True).start()
        await anyio.sleep_forever()


try:
    if LOOP == "asyncio.run":  # (asyncio's own runner, as most programs start)
        import asyncio
        asyncio.run(main())
    else:
        anyio.run(main, backend=LOOP.replace("uvloop", "asyncio"),
                  backend_options={"use_uvloop": True} if LOOP == "uvloop" else {})
except KeyboardInterrupt:
    pass
dropped = last.queue._failure(last.value) is not None  # (what its await raises)
print("closed", dev.closed, "stopped", dev._state.stopped, "open", len(am.open_devices()),
      "dropped", dropped, "default", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""


@pytest.mark.parametrize("loop", ["trio", "asyncio", "asyncio.run", "uvloop"])
def test_a_second_ctrl_c_during_a_close_discards_and_never_half_closes(loop: str) -> None:
    """The second Ctrl-C, while the close waits for the backlog, switches the close to
    discarding and is raised once the device is fully closed (its queues stopped
    natively), within a fraction of the backlog's time. trio raises it in its main task
    even inside a shielded close; asyncio's runner raises it wherever the main thread
    is (mostly in the loop's select) and then waits for every task, the close's too."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_INTERRUPTED), loop],
        capture_output=True,
        text=True,
        timeout=60,  # (the backlog alone: ~10 s)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = ["closed", "True", "stopped", "True", "open", "0", "dropped", "True"]
    facts += ["default", "True"]  # (Python's own Ctrl-C handler is back)
    assert proc.stdout.split() == facts, proc.stdout + proc.stderr[-3000:]


async def test_a_keyboard_interrupt_anywhere_in_close_leaves_the_device_closable(
    anyio_backend: object,
) -> None:
    """A KeyboardInterrupt wherever CPython delivers one in ``Device.close`` (trio
    raises Ctrl-C in whatever Python code its main task runs) -- before, while and
    after the teardown is started -- never leaves a device whose teardown nobody
    runs: the next close ends, the device fully closed (its queues stopped)."""
    at = 0
    while True:
        device = await am.open_device("cpu")
        device.new_queue().wait(device.timeline(), 1)  # (abandoned by the close)
        codes = {am.Device.close.__code__}
        with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
            await device.close()
        # The next close, from a thread of its own: one waiting for a teardown that
        # never comes waits for good (shielded), which this must see fail, not hang.
        closed = threading.Event()
        threading.Thread(target=_close_then_set, args=(device, closed), daemon=True).start()
        with anyio.move_on_after(10):
            while not closed.is_set():
                await anyio.sleep(0.01)
        assert closed.is_set(), f"the next close waits for good (interrupted at {at})"
        assert device.closed and device._state.stopped, at
        assert device not in am.open_devices(), at
        if not raised:
            break
        at += 1
    assert at >= 3


def _slowly(close_native: Any, *args: Any) -> None:
    time.sleep(0.05)
    close_native(*args)


def _close_then_set(device: am.Device, closed: threading.Event) -> None:
    anyio.run(device.close)
    closed.set()


async def test_a_keyboard_interrupt_as_a_close_begins_to_wait_discards_and_waits_for_the_end(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt wherever CPython delivers one in the close's wait for its
    teardown -- entering the scopes it waits in (Ctrl-C's hook, the shield), before
    they stand, included -- is raised once the teardown has ended, the close switched to
    discarding (but where the teardown had ended already: leaving those scopes)."""
    codes = {_device._until_closed.__code__}
    at = 0
    while True:
        device = await am.open_device("cpu")
        device.new_queue().wait(device.timeline(), 1)  # (abandoned by the close)
        slowly = functools.partial(_slowly, device._close_native)
        monkeypatch.setattr(device, "_close_native", slowly)  # (ends after the interrupt)
        with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
            await device.close()
        assert device.closed and device._state.stopped, f"raised before the end ({raised})"
        leaving = any("__exit__" in where for where in raised)
        assert device._discarding or leaving or not raised, f"not discarding ({raised})"
        if not raised:
            break
        at += 1
    assert at >= 4


def test_ctrl_c_switches_waiting_closes_then_raises_and_leaves_other_handlers_alone() -> None:
    """Where Ctrl-C would raise a KeyboardInterrupt, a close waiting on the main thread
    is switched (each of several) before it is raised, and the handler is put back once
    the last has ended; a handler the program installed itself is never wrapped."""
    switched: list[str] = []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with ctrl_c_discards(lambda: switched.append("a")):
        with ctrl_c_discards(lambda: switched.append("b")):
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
            assert sorted(switched) == ["a", "b"]
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert sorted(switched) == ["a", "a", "b"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    own: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: own.append(signum))
    try:
        with ctrl_c_discards(lambda: switched.append("c")):
            signal.raise_signal(signal.SIGINT)
        assert own == [signal.SIGINT] and "c" not in switched
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)

    with ctrl_c_discards(lambda: switched.append("e")):  # the program's own, installed meanwhile
        signal.signal(signal.SIGINT, lambda signum, frame: own.append(signum))
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler  # (left alone)
    signal.raise_signal(signal.SIGINT)
    assert own == [signal.SIGINT] * 2 and "e" not in switched
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def off_main_thread() -> None:
        with ctrl_c_discards(lambda: switched.append("d")):
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    thread = threading.Thread(target=off_main_thread)
    thread.start()
    thread.join()

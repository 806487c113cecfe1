"""A failed Metal queue settles its own timeline -- the native value and the
``MTLSharedEvent`` both -- once its last command completed, against the simulated Metal:
the paths the timelines contract (tests/contracts/test_contract2_timelines.py) does not
take on Metal: a queue failed by a faulted command buffer, another queue's GPU wait on
it, a signal submitted once it settled, and a wait submitted behind the failure."""

from __future__ import annotations

import contextlib
import pathlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from ctypes import c_uint64
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _native
from asyncmetal._queue import native_queue
from asyncmetal._timeline import MAX_VALUE
from asyncmetal.backends.metal import _queue as metal_queue
from asyncmetal.backends.metal._objc import send
from asyncmetal.backends.metal._queue import MetalQueue
from tests.backends.metal.test_metal import FAULTY, SPIN_UNTIL, sim_only, unwrapped
from tests.backends.metal.test_metal_races import _until
from tests.support.fakes import metal_sim
from tests.support.kernels import KERNELS, MSL_KERNELS
from tests.support.queues import fail_for_good

pytestmark = [pytest.mark.metal, sim_only]


async def test_another_queues_gpu_wait_on_a_failed_queue_ends_as_it_settles(
    anyio_backend: object,
) -> None:
    """A queue whose kernel faulted, with more submitted behind it, fails its timeline
    from the faulted command on; another queue's wait for a value beyond what it was
    given is then made on the GPU (the timeline failed for it), on the queue's event.
    Once the failed queue's last command completed, its timeline and its event settle
    at 2**64 - 1: that GPU wait ends, and the waiting queue fails from it on. Checked
    failing without the settle (q's timeline stayed at 3), and with the native
    timeline's settle but not the event's: the event stayed at 3, and without that
    assertion the waiting queue's launch was never done (its GPU waited on the event
    for good) and the fail_after ran out."""
    async with am.open_device("metal") as dev:
        crash = await dev.compile(FAULTY, "crash")
        fill = await dev.compile(MSL_KERNELS, "fill")
        buf, gate = await dev.alloc(64), dev.timeline()
        q, q2 = dev.new_queue(), dev.new_queue()
        own = native_queue(q)
        assert isinstance(own, MetalQueue)
        # The gate's event at 1 through a committed signal (as another queue's), its
        # native mirror not yet (that queue's handler has not run): q's wait for it goes
        # to the GPU, which passes it, and the completion of the buffer that carries it
        # -- q's last command, after the one that faults -- is held until the mirror
        # gets there: q has its last command still to complete once the first failed.
        lib = dev._backend.lib
        lib.am_signal_committed(gate.native.c_timeline, 1)
        send(gate.native.event, "setSignaledValue:", 1, restype=None, argtypes=(c_uint64,))
        # (the handlers held while they are submitted: the fault's, run before the rest
        # was noted, would settle q then)
        metal_sim.hold_handlers(own._queue, True)
        try:
            faulted = q.launch(crash, buf)
            q.wait(gate, 1)
            last = q.launch(fill, buf, vals=(1, 16))
        finally:
            metal_sim.hold_handlers(own._queue, False)
        with anyio.fail_after(5), pytest.raises(am.DeviceLostError, match="crash faulted"):
            await faulted
        assert q.timeline.value < MAX_VALUE  # (not settled: its last handler is held)

        def signal_gate(value: int) -> None:  # (the mirror, as that queue's handler would)
            lib.am_timeline_signal(gate.native.c_timeline, value)

        q2.wait(q.timeline, 1000)  # failed for it: made on the GPU, on q's event
        behind = q2.launch(fill, buf, vals=(2, 16))
        try:
            await anyio.wait_all_tasks_blocked()
            assert not behind.done()
            signal_gate(1)
            with anyio.fail_after(5), pytest.raises(am.DeviceLostError, match="crash faulted"):
                await last
            assert q.timeline.value == MAX_VALUE
            assert own._timeline.device_value() == MAX_VALUE
            with anyio.fail_after(5), pytest.raises(am.DeviceLostError, match="device-side wait"):
                await behind
        finally:  # (failed, the GPU's wait would hold up the device's close for good)
            signal_gate(1)
            own._timeline.signal(MAX_VALUE)
        with anyio.fail_after(5), pytest.raises(am.ClosedResourceError, match="settled without"):
            await q.timeline.wait(1000)


async def test_a_signal_submitted_to_a_settled_metal_queue_fails_its_timeline_at_once(
    anyio_backend: object,
) -> None:
    """A command submitted to a failed queue that settled is not committed: it fails at
    once with the queue's failure, and a signal fails the timeline it signals -- a host
    wait on it raises, and another queue's GPU wait on it ends, that queue failing from
    it on -- rather than leave them waiting for a signal that never runs. Checked
    failing without the settle: the host wait for q.submitted + 1 was left waiting,
    and the fail_after ran out."""
    async with am.open_device("metal") as dev:
        crash = await dev.compile(FAULTY, "crash")
        fill = await dev.compile(MSL_KERNELS, "fill")
        buf, signalled = await dev.alloc(64), dev.timeline()
        q, q2 = dev.new_queue(), dev.new_queue()
        with anyio.fail_after(5), pytest.raises(am.DeviceLostError, match="crash faulted"):
            await q.launch(crash, buf)
        with anyio.fail_after(5), pytest.raises(am.ClosedResourceError, match="settled without"):
            await q.timeline.wait(q.submitted + 1)
        q2.wait(signalled, 1)
        behind = q2.launch(fill, buf, vals=(2, 16))
        signal = q.signal(signalled, 1)
        with anyio.fail_after(5), pytest.raises(am.DeviceLostError, match="crash faulted"):
            await signal
        with anyio.fail_after(5), pytest.raises(am.DeviceLostError, match="crash faulted"):
            await signalled.wait(1)
        with anyio.fail_after(5), pytest.raises(am.DeviceLostError, match="device-side wait"):
            await behind
        with anyio.fail_after(5), pytest.raises(am.DeviceLostError, match="crash faulted"):
            await q.launch(fill, buf, vals=(3, 16))
        assert q.timeline.value == MAX_VALUE


async def test_a_queue_failed_by_a_wait_settles_once_a_later_command_buffer_completed(
    anyio_backend: object,
) -> None:
    """A queue whose device wait ended on a value never produced settles once its last
    command completed also where that command is not the one that ran behind the
    failed wait: a launch after it carries no wait and signals nothing, and its handler
    reads the queue's failure from the queue's timeline. Checked failing with the settle
    looking only at the handler's own command (its failure, a failed wait it carried):
    the host wait for q.submitted + 1 was left waiting, and the fail_after ran out."""
    async with am.open_device("metal") as dev:
        fill = await dev.compile(MSL_KERNELS, "fill")
        buf = await dev.alloc(64)
        q = dev.new_queue()
        later: list[am.Completion] = []
        await fail_for_good(dev, q, lambda: later.append(q.launch(fill, buf, vals=(1, 16))))
        with anyio.fail_after(5), pytest.raises(am.ClosedResourceError, match="device-side"):
            await later[0]
        with anyio.fail_after(5), pytest.raises(am.ClosedResourceError, match="settled without"):
            await q.timeline.wait(q.submitted + 1)
        assert q.timeline.value == MAX_VALUE


async def _behind_a_failed_wait(kind: str) -> None:
    """On a ``kind`` device: a queue failed by a wait for a value never produced, then a
    wait for a timeline nobody signals, a launch and a signal behind it: the launch and
    the signal fail with the queue's failure, the signalled timeline with them, and the
    queue settles, that timeline still unsignalled."""
    async with am.open_device(kind) as dev:
        fill = await dev.compile(MSL_KERNELS if kind == "metal" else KERNELS, "fill")
        buf, never, signalled = await dev.alloc(64), dev.timeline(), dev.timeline()
        q = dev.new_queue()
        later: list[am.Completion] = []

        def behind() -> None:
            q.wait(never, 1)
            later.append(q.launch(fill, buf, vals=(1, 16)))
            later.append(q.signal(signalled, 1))

        await fail_for_good(dev, q, behind)
        for done in later:
            with anyio.fail_after(5), pytest.raises(am.ClosedResourceError, match="device-side"):
                await done
        with anyio.fail_after(5), pytest.raises(am.ClosedResourceError, match="cpu:23 was"):
            await signalled.wait(1)
        with anyio.fail_after(5), pytest.raises(am.ClosedResourceError, match="settled without"):
            await q.timeline.wait(q.submitted + 1)
        assert q.timeline.value == MAX_VALUE
        assert never.value == 0


async def test_a_wait_behind_a_failed_wait_is_not_held(anyio_backend: object) -> None:
    """A wait submitted to a Metal queue whose earlier wait failed (it waited for a
    value its producer never made), for a timeline nobody signals, is not held on the
    queue's thread: the commands behind it fail at once with the queue's failure and the
    queue settles, as on a cpu queue (run here too), where such a wait is never made.
    Checked failing without the drop: the launch behind the wait was never done (held
    with the wait) and the fail_after ran out."""
    await _behind_a_failed_wait("cpu")
    await _behind_a_failed_wait("metal")


async def test_a_held_wait_is_dropped_once_its_queue_fails(anyio_backend: object) -> None:
    """A wait the Metal queue's thread already holds (for a timeline nobody signals) when
    a command before it fails is dropped then -- at once: the failure wakes the thread,
    well within its nap (HOST_WAIT_NAP_NS, left at its default) -- the commands behind
    it fail with that command's error, and the queue settles. The fault's handler is
    held back until the thread holds the wait. Checked failing without the drop: the
    launch behind the wait was never done (held with the wait) and the fail_after ran
    out; and without the wake: the launch behind the wait was done only after the nap
    (about 1 s), past the bound."""
    assert metal_queue.HOST_WAIT_NAP_NS >= 1_000_000_000
    async with am.open_device("metal") as dev:
        crash = await dev.compile(FAULTY, "crash")
        fill = await dev.compile(MSL_KERNELS, "fill")
        buf, never, signalled = await dev.alloc(64), dev.timeline(), dev.timeline()
        q = dev.new_queue()
        own = native_queue(q)
        assert isinstance(own, MetalQueue)
        metal_sim.hold_handlers(own._queue, True)
        try:
            faulted = q.launch(crash, buf)
            q.wait(never, 1)
            launched = q.launch(fill, buf, vals=(1, 16))
            signal = q.signal(signalled, 1)
            await _until(lambda: own._host_waiting is never.native)
        finally:
            metal_sim.hold_handlers(own._queue, False)
            released = time.monotonic()
        with anyio.fail_after(5), pytest.raises(am.DeviceLostError, match="crash faulted"):
            await launched
        assert time.monotonic() - released < 0.3  # (the nap: 1 s)
        for done in (faulted, launched, signal):
            with anyio.fail_after(5), pytest.raises(am.DeviceLostError, match="crash faulted"):
                await done
        with anyio.fail_after(5), pytest.raises(am.DeviceLostError, match="crash faulted"):
            await signalled.wait(1)
        with anyio.fail_after(5), pytest.raises(am.ClosedResourceError, match="settled without"):
            await q.timeline.wait(q.submitted + 1)
        assert q.timeline.value == MAX_VALUE
        assert never.value == 0


async def test_a_command_refused_after_its_note_does_not_keep_a_failed_queue_unsettled(
    anyio_backend: object,
) -> None:
    """A launch noted as submitted and then refused before its commit (here its commit
    raises, as a nil command buffer does) gives its number back: the failed queue
    settles once its last committed command completed, not once a handler of the
    refused one ran (none does). Checked failing without the note taken back: the host
    wait for q.submitted + 1 ran past its fail_after (TimeoutError)."""
    async with am.open_device("metal") as dev:
        q, own, view, faulted, fill, buf = await _failing_behind_a_spin(dev)

        own._encode_and_commit = _refuse  # type: ignore[method-assign]
        with pytest.raises(am.AsyncMetalError, match="simulated"):
            q.launch(fill, buf, vals=(1, 16))  # 3: noted, then refused
        del own._encode_and_commit
        assert q.submitted == 2
        view[0] = 1
        await _settled_failed(q, faulted)


async def test_a_refused_command_settles_a_failed_queue_whose_handlers_all_ran(
    anyio_backend: object,
) -> None:
    """A launch refused before its commit on a failed queue whose last command's handler
    ran already, with no settle (the refused one was noted as its last), settles it as
    it takes its note back. Checked failing without the note taken back: the host wait
    for q.submitted + 1 ran past its fail_after (TimeoutError); and with the note taken
    back but no settle there: the same."""
    async with am.open_device("metal") as dev:
        q, own, view, faulted, fill, buf = await _failing_behind_a_spin(dev)
        lib = dev._backend.lib
        with own._buffers_lock:
            block = own._buffers[-1][2]
        assert block.value == 2
        block.notify = 1  # (its run wakes am_blocks_wait)

        def refuse_once_ran(*args: object, **kw: object) -> None:
            # 3 is noted as the last submitted: command 2's handler, run now, does not
            # settle the queue
            view[0] = 1
            seen, until = lib.am_blocks_wait(0, 0), time.monotonic() + 5
            while not block.calls and time.monotonic() < until:
                seen = lib.am_blocks_wait(seen, 100_000_000)
            assert block.calls
            assert q.timeline.value == 2
            raise am.AsyncMetalError("commandBuffer returned nil (simulated)")

        own._encode_and_commit = refuse_once_ran  # type: ignore[method-assign]
        with pytest.raises(am.AsyncMetalError, match="simulated"):
            q.launch(fill, buf, vals=(1, 16))  # 3: noted, then refused
        del own._encode_and_commit
        assert q.submitted == 2
        await _settled_failed(q, faulted)


async def test_a_step_refused_twice_on_the_queues_thread_does_not_keep_a_failed_queue_unsettled(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command whose step on the queue's own thread raises is replaced by an empty
    command buffer (MetalQueue._step_failed); where that commit is refused too (here both
    raise, as a nil command buffer does), no handler of the command runs: its note is
    taken back, and the failed queue settles once its last committed command completed.
    The command fails with its step's error. Checked failing without the note taken
    back there: the host wait for q.submitted + 1 ran past its fail_after
    (TimeoutError), q's timeline left at 2."""
    unwrapped(monkeypatch)  # (the copy below is staged on the queue's own thread)
    reported: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: reported.append(args.exc_value))
    async with am.open_device("metal") as dev:
        q, own, view, faulted, _, buf = await _failing_behind_a_spin(dev)

        with _commits_refused(own, view):
            copied = q.copy(buf, np.zeros(16, np.int32))  # 3: its step waits for 2 to run
            view[0] = 1
            await _until(lambda: reported)  # (the empty commit's refusal, reported)
        try:
            assert isinstance(reported[0], am.AsyncMetalError)
            await _settled_failed(q, faulted)
            with anyio.fail_after(5), pytest.raises(am.AsyncMetalError, match="simulated"):
                await copied
        finally:  # (unsettled, command 3 would never be done: the close would wait for it)
            own._timeline.signal(MAX_VALUE)


async def test_a_signal_refused_twice_on_the_queues_thread_fails_its_timeline(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal committed from the queue's own thread (behind a staged copy held there)
    whose commit is refused, and its empty command buffer's too, fails the timeline it
    was to signal -- a wait on it raises rather than wait for good -- and takes its
    note back: the failed queue settles once its last committed command (the copy)
    completed. Checked failing with the timeline failed only after a commit that
    succeeded: the wait on it ran past its fail_after (TimeoutError); and without the
    note taken back: the signal's own await did (its value never came)."""
    unwrapped(monkeypatch)  # (the copy below is staged on the queue's own thread)
    reported: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: reported.append(args.exc_value))
    async with am.open_device("metal") as dev:
        q, own, view, faulted, _, buf = await _failing_behind_a_spin(dev)
        signalled = dev.timeline()
        commit = own._encode_and_commit

        def refuse_the_signal(value: int, *args: Any, **kw: Any) -> None:
            if value == 4:
                raise am.AsyncMetalError("commandBuffer returned nil (simulated)")
            commit(value, *args, **kw)

        own._encode_and_commit = refuse_the_signal  # type: ignore[method-assign]
        try:
            q.copy(buf, np.zeros(16, np.int32))  # 3: its step waits for 2 to run
            signal = q.signal(signalled, 1)  # 4: behind it, on the queue's own thread
            view[0] = 1
            await _until(lambda: reported)  # (the empty commit's refusal, reported)
        finally:
            del own._encode_and_commit
            view[0] = 1
        try:
            with anyio.fail_after(5), pytest.raises(am.AsyncMetalError, match="simulated"):
                await signal
            with anyio.fail_after(5), pytest.raises(am.AsyncMetalError, match=r"command 4 .* nil"):
                await signalled.wait(1)
            with (
                anyio.fail_after(5),
                pytest.raises(am.ClosedResourceError, match="settled without"),
            ):
                await q.timeline.wait(q.submitted + 1)
            with anyio.fail_after(5), pytest.raises(am.DeviceLostError, match="crash faulted"):
                await faulted
        finally:  # (unsettled, command 4 would never be done: the close would wait for it)
            own._timeline.signal(MAX_VALUE)
            signalled.native.signal(MAX_VALUE)


async def test_two_steps_refused_in_a_row_do_not_keep_a_failed_queue_unsettled(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two commands in a row whose steps on the queue's own thread raise, and whose empty
    command buffers are refused too (3, then 4): neither runs a handler. The first's
    note is kept by the later one (made already), whose take-back then goes below both:
    the failed queue settles once its last committed command (2) completed. Checked
    failing with the note taken back only to the value below the last: the host wait
    for q.submitted + 1 ran past its fail_after (TimeoutError), q's own note left at 3."""
    unwrapped(monkeypatch)  # (the copies below are staged on the queue's own thread)
    reported: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: reported.append(args.exc_value))
    async with am.open_device("metal") as dev:
        q, own, view, faulted, _, buf = await _failing_behind_a_spin(dev)

        with _commits_refused(own, view):
            first = q.copy(buf, np.zeros(16, np.int32))  # 3: its step waits for 2 to run
            second = q.copy(buf, np.ones(16, np.int32))  # 4: behind it
            view[0] = 1
            await _until(lambda: len(reported) == 2)  # (both empty commits' refusals)
        try:
            await _settled_failed(q, faulted)
            await _all_refused((first, second))
        finally:  # (unsettled, commands 3 and 4 would never be done: the close would wait)
            own._timeline.signal(MAX_VALUE)


async def test_a_step_refused_twice_on_a_healthy_queue_fails_the_queue_from_it(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a queue nothing failed, a command whose step on the queue's own thread raises
    and whose empty command buffer is refused too has no handler to produce its value:
    the queue fails from it on, as from a command buffer that failed. Its await raises
    its step's error, its timeline settles failed from it (a wait for it raises), and a
    command submitted after it fails too; the close does not wait for it. Checked
    failing without that: the await of the command ran past its fail_after
    (TimeoutError)."""
    unwrapped(monkeypatch)  # (the copy below is staged on the queue's own thread)
    reported: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: reported.append(args.exc_value))
    async with am.open_device("metal") as dev:
        q, own, view, spun = await _behind_a_spin(dev)  # 1: holds the GPU until view[0] = 1
        fill = await dev.compile(MSL_KERNELS, "fill")
        buf = await dev.alloc(64)

        with _commits_refused(own, view):
            copied = q.copy(buf, np.zeros(16, np.int32))  # 2: its step waits for 1 to run
            view[0] = 1
            await _until(lambda: reported)  # (the empty commit's refusal, reported)
        try:
            assert isinstance(reported[0], am.AsyncMetalError)
            with anyio.fail_after(5):
                await spun
            with anyio.fail_after(5), pytest.raises(am.AsyncMetalError, match="simulated"):
                await copied
            with anyio.fail_after(5), pytest.raises(am.AsyncMetalError, match="simulated"):
                await q.timeline.wait(2)
            assert q.timeline.value == MAX_VALUE
            with anyio.fail_after(5), pytest.raises(am.AsyncMetalError, match="nil"):
                await q.launch(fill, buf, vals=(1, 16))
        finally:  # (unsettled, command 2 would never be done: the close would wait for it)
            if q.timeline.value < MAX_VALUE:
                own._timeline.signal(MAX_VALUE)


@pytest.mark.parametrize("later_on", ["loop", "worker"])
async def test_a_refusal_after_a_step_refused_twice_does_not_keep_a_failed_queue_unsettled(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, later_on: str
) -> None:
    """A failed queue's command whose step on the queue's own thread raises and whose
    empty command buffer is refused too (3, its note taken back at once: nothing was
    noted after it), then a later command refused (4: a direct blit on the loop's thread,
    its number given back, or another such step): no handler passes 3, so 4's note goes
    back below it too, and the queue settles once 2 completed -- its awaits, a wait for
    its timeline and its close end. Checked failing with 3 not kept among the values no
    handler passes: the host wait for q.submitted + 1 ran past its fail_after
    (TimeoutError), q's note left at 3 with only 2 finished."""
    unwrapped(monkeypatch)  # (the copies below are staged on the queue's own thread)
    reported: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: reported.append(args.exc_value))
    async with am.open_device("metal") as dev:
        q, own, view, faulted, _, buf = await _failing_behind_a_spin(dev)
        other = await dev.alloc(64)

        # 3: staged, refused twice; 4: refused after it
        copies = await _refused_twice_then_later(q, own, view, buf, other, reported, later_on)
        try:
            await _settled_failed(q, faulted)
            await _all_refused(copies)
            with anyio.fail_after(5):
                await q.close()
        finally:  # (unsettled, 3 would never be done: the device's close would wait)
            if q.timeline.value < MAX_VALUE:
                own._timeline.signal(MAX_VALUE)


@pytest.mark.parametrize("later_on", ["loop", "worker"])
async def test_a_refusal_after_a_step_refused_twice_on_a_healthy_queue_lets_it_settle(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, later_on: str
) -> None:
    """On a queue nothing failed, a command whose step on the queue's own thread raises
    and whose empty command buffer is refused too (2: the queue fails from it), then a
    later command refused (3, on the loop's thread or as 2 was): 3's note goes back below
    2, which no handler passes, so the queue settles once 1 completed and the awaits of
    both raise their refusal. Checked failing with 2 not kept among the values no handler
    passes: the await of 2 ran past its fail_after (TimeoutError)."""
    unwrapped(monkeypatch)  # (the copies below are staged on the queue's own thread)
    reported: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: reported.append(args.exc_value))
    async with am.open_device("metal") as dev:
        q, own, view, spun = await _behind_a_spin(dev)  # 1: holds the GPU until view[0] = 1
        buf, other = await dev.alloc(64), await dev.alloc(64)

        # 2: staged, refused twice; 3: refused after it
        copies = await _refused_twice_then_later(q, own, view, buf, other, reported, later_on)
        try:
            with anyio.fail_after(5):
                await spun
            await _all_refused(copies)
            assert q.timeline.value == MAX_VALUE
        finally:  # (unsettled, 2 would never be done: the device's close would wait)
            if q.timeline.value < MAX_VALUE:
                own._timeline.signal(MAX_VALUE)


class _Looked(dict[int, int]):
    """The values a queue's refusals skip, counting each entry looked at."""

    looks = 0

    def __iter__(self) -> Any:
        for key in super().__iter__():
            self.looks += 1
            yield key

    def __getitem__(self, key: int) -> int:
        self.looks += 1
        return super().__getitem__(key)


async def test_a_run_of_refusals_looks_at_each_value_it_skips_a_bounded_number_of_times(
    anyio_backend: object,
) -> None:
    """Refusals whose take-backs later notes keep (the queue's own thread refusing the
    commands a loop handed it, one after the other), then the last taken back below them
    all: the values kept are looked at a bounded number of times each, not once a
    refusal each (2000 of them: 2 million looks). Checked failing with those at or below
    the last committed let go of by looking through all of them each refusal, as
    before: about 2 million looks."""
    n = 2000
    async with am.open_device("metal") as dev:
        q = dev.new_queue()
        own = native_queue(q)
        assert isinstance(own, MetalQueue)
        looked = own._refused = _Looked()
        try:
            for value in range(10, 11 + n):  # (noted as a loop hands them over)
                assert own._submitting(value)
            for value in range(10, 10 + n):
                own._unnote(value, fail=True)  # kept by the later notes
            assert len(looked) == n
            own._unnote(10 + n, fail=True)  # below them all: to 9
            assert looked.looks <= 4 * n
        finally:
            own._timeline.signal(MAX_VALUE)


async def test_a_fault_found_after_a_later_refused_step_fails_the_queue_from_it(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command refused twice on the queue's own thread (its step, then its empty
    command buffer) fails the queue from it on before the handler of an earlier command
    that faulted ran (held): that handler, once it runs, fails the queue from its own
    command instead -- the native timeline from 1, and the await of the faulted command
    raises its fault, as do later commands -- while the refused one still raises its
    step's error. Checked failing without the fault noted below the refused command
    (_note_status): the await of the faulted command returned; and without the native
    mark lowered (am_block_completed): the timeline's failure stayed from 3."""
    reported: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: reported.append(args.exc_value))
    async with am.open_device("metal") as dev:
        crash = await dev.compile(FAULTY, "crash")
        fill = await dev.compile(MSL_KERNELS, "fill")
        buf, gate = await dev.alloc(64), dev.timeline()
        q = dev.new_queue()
        own = native_queue(q)
        assert isinstance(own, MetalQueue)
        commit = own._encode_and_commit

        def refuse_three(value: int, *args: Any, **kw: Any) -> None:
            if value == 3:
                raise am.AsyncMetalError("commandBuffer returned nil (simulated)")
            commit(value, *args, **kw)

        metal_sim.hold_handlers(own._queue, True)
        try:
            faulted = q.launch(crash, buf)  # 1: committed, its handler held
            q.wait(gate, 1)  # 2: held on the queue's own thread, with what follows
            own._encode_and_commit = refuse_three  # type: ignore[method-assign]
            try:
                refused = q.launch(fill, buf, vals=(1, 16))  # 3
                gate.signal(1)
                await _until(lambda: reported)  # (the empty commit's refusal, reported)
            finally:
                del own._encode_and_commit
        finally:
            metal_sim.hold_handlers(own._queue, False)
        try:
            assert isinstance(reported[0], am.AsyncMetalError)
            with anyio.fail_after(5), pytest.raises(am.DeviceLostError, match="crash faulted"):
                await faulted
            with anyio.fail_after(5), pytest.raises(am.AsyncMetalError, match="simulated"):
                await refused
            with (
                anyio.fail_after(5),
                pytest.raises(am.ClosedResourceError, match="settled without"),
            ):
                await q.timeline.wait(q.submitted + 1)
            failure = _native.timeline_failure(own._timeline.c_timeline)
            assert failure is not None and failure.first == 1
            with anyio.fail_after(5), pytest.raises(am.DeviceLostError, match="crash faulted"):
                await q.launch(fill, buf, vals=(2, 16))
        finally:
            if q.timeline.value < MAX_VALUE:
                own._timeline.signal(MAX_VALUE)


# Run in a child: the simulated Metal aborts the interpreter on a message to a released
# object.
_HELD_HANDLER_AFTER_RELEASE = """
import sys
from ctypes import c_uint64

from tests.support.fakes import metal_sim

metal_sim.configure()

import anyio

import asyncmetal as am
from asyncmetal._queue import native_queue
from asyncmetal._timeline import MAX_VALUE
from asyncmetal.backends.metal._objc import release, send
from tests.backends.metal.test_metal import FAULTY
from tests.backends.metal.test_metal_races import _until


async def main() -> None:
    dev = await am.open_device("metal")
    crash = await dev.compile(FAULTY, "crash")
    buf = await dev.alloc(64)
    gate = dev.timeline()
    q = dev.new_queue()
    own = native_queue(q)
    lib = dev._backend.lib
    # The gate's event at 1 (a committed signal, as another queue's), its native mirror
    # not yet (that queue's handler has not run).
    lib.am_signal_committed(gate.native.c_timeline, 1)
    send(gate.native.event, "setSignaledValue:", 1, restype=None, argtypes=(c_uint64,))
    returned = metal_sim.handlers_returned()
    q.wait(gate, 1)  # 1: a GPU wait, its completion gated on the mirror
    q.launch(crash, buf)  # 2: faults, carrying the wait: its handler is held
    await _until(lambda: metal_sim.handlers_returned() > returned)
    assert q.timeline.value == 0
    # The queue's own reference of its event goes, and the command buffers' with it (what
    # MetalTimeline.__del__ does once nothing else holds the timeline).
    with own._buffers_lock:
        buffers = [cb for _, cb, _, _, _ in own._buffers]
        own._buffers.clear()
    for cb in buffers:
        release(cb)
    release(own._timeline.event)
    own._timeline.event = 0
    lib.am_timeline_signal(gate.native.c_timeline, 1)  # the held handlers run: it settles
    await _until(lambda: q.timeline.value == MAX_VALUE)
    print("settled", flush=True)
    sys.stdout.flush()


anyio.run(main)
"""


def test_a_held_handler_settles_a_queue_whose_event_was_released() -> None:
    """A failed queue's handler held until its gate settles runs after the queue's own
    reference of its MTLSharedEvent went: the native timeline retains the event, so the
    settle sets a live one. Checked failing without the retain: the child aborted
    (setSignaledValue: sent to deallocated instance)."""
    root = pathlib.Path(__file__).resolve().parents[3]
    child = subprocess.run(
        [sys.executable, "-c", _HELD_HANDLER_AFTER_RELEASE],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert "settled" in child.stdout


async def _failing_behind_a_spin(
    dev: am.Device,
) -> tuple[am.Queue, MetalQueue, np.ndarray[Any, Any], am.Completion, am.Program, am.Buffer]:
    """A new queue of ``dev`` given a kernel that spins until the flag (``view[0] = 1``)
    is set (1), then one that faults (2: ``faulted``, which fails the queue); also its
    native queue, and ``fill`` with a buffer for a third launch."""
    q, own, view, _ = await _behind_a_spin(dev)  # 1: holds the GPU until the flag is set
    crash = await dev.compile(FAULTY, "crash")
    fill = await dev.compile(MSL_KERNELS, "fill")
    buf = await dev.alloc(64)
    faulted = q.launch(crash, buf)  # 2: fails the queue
    return q, own, view, faulted, fill, buf


async def _behind_a_spin(
    dev: am.Device,
) -> tuple[am.Queue, MetalQueue, np.ndarray[Any, Any], am.Completion]:
    """A new queue of ``dev`` given a kernel that spins until the flag (``view[0] = 1``)
    is set (1: ``spun``); also its native queue."""
    spin = await dev.compile(SPIN_UNTIL, "spin_until")
    flag = await dev.alloc(4)
    await flag.write(np.zeros(1, np.int32))
    view = np.frombuffer(dev._backend.host_view(flag._allocation.handle, 0, 4), np.int32)
    q = dev.new_queue()
    own = native_queue(q)
    assert isinstance(own, MetalQueue)
    spun = q.launch(spin, flag)
    return q, own, view, spun


def _refuse(*args: object, **kw: object) -> None:
    raise am.AsyncMetalError("commandBuffer returned nil (simulated)")


@contextlib.contextmanager
def _commits_refused(own: MetalQueue, view: np.ndarray[Any, Any]) -> Iterator[None]:
    """Every commit of ``own`` raises, as a nil command buffer does, within the block;
    at its end (raised or not) commits go through again and the spin's flag is set."""
    own._encode_and_commit = _refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        del own._encode_and_commit
        view[0] = 1


async def _refused_twice_then_later(
    q: am.Queue,
    own: MetalQueue,
    view: np.ndarray[Any, Any],
    buf: am.Buffer,
    other: am.Buffer,
    reported: list[BaseException | None],
    later_on: str,
) -> list[am.Completion]:
    """With ``own``'s commits refused: a copy staged on the queue's own thread, refused
    twice (its step, then its empty command buffer), then a later command refused --
    a direct blit on the loop's thread (``later_on == "loop"``: it raises as it is
    submitted) or another such copy (``"worker"``). Returns the copies' completions;
    the spin's flag is set at the end."""
    copies: list[am.Completion] = []
    with _commits_refused(own, view):
        copies.append(q.copy(np.zeros(16, np.int32), buf))  # staged, refused twice
        await _until(lambda: len(reported) == 1 and not own._routed)
        if later_on == "loop":
            with pytest.raises(am.AsyncMetalError, match="simulated"):
                q.copy(other, buf)  # refused as it is submitted
        else:
            copies.append(q.copy(np.zeros(16, np.int32), buf))  # as the first
            await _until(lambda: len(reported) == 2 and not own._routed)
    return copies


async def _all_refused(copies: Iterable[am.Completion]) -> None:
    """Each of ``copies`` raises its refusal."""
    for copied in copies:
        with anyio.fail_after(5), pytest.raises(am.AsyncMetalError, match="simulated"):
            await copied


async def _settled_failed(q: am.Queue, faulted: am.Completion) -> None:
    """``faulted`` raises its fault, and ``q``'s timeline settles failed: a wait past its
    last submitted command raises, and its value is MAX_VALUE."""
    with anyio.fail_after(5), pytest.raises(am.DeviceLostError, match="crash faulted"):
        await faulted
    with anyio.fail_after(5), pytest.raises(am.ClosedResourceError, match="settled without"):
        await q.timeline.wait(q.submitted + 1)
    assert q.timeline.value == MAX_VALUE

"""CUDA queues: non-blocking streams with a native completion thread each."""

from __future__ import annotations

import collections
import ctypes
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

from ... import _native, _native_contract
from ..._backend import Arg, KeepAlive, NativeQueue, NativeTimeline, Record, host_address
from ..._errors import AsyncMetalError, DeviceLostError
from ..._interrupts import in_turn
from ..._native import ABANDONED, CLOSED, DISCARDED, Failure
from ..._timeline import (
    LATER_FAIL,
    MAX_VALUE,
    QUEUE_DISCARDED,
    closed_queue_error,
    command_of,
    discarded_error,
    failure_error,
)
from . import _driver
from ._driver import (
    UNCONFIRMED,
    CudaOutOfMemory,
    check,
    cu,
    driver_error,
    process_lost_error,
    refuse_if_lost,
)
from ._interop import keeps_context, other_context, warn_unrestored
from ._limits import LaunchLimits
from ._staging import STAGE_CHUNK, STAGE_DIRECT, STAGED_BYTES_PER_NS, Staging, StagingDevice
from ._timeline import CUDATimeline

MAX_PARAMS = 64
COMPLETION_SPIN_NS = 30_000  # the completion thread polls this long before blocking
# Commands a stream holds unconfirmed at most; later ones wait on the host, in native
# code, and the completion thread submits them as earlier ones finish. On the H200,
# cuLaunchKernel blocks for a kernel's length once ~56 commands with blocking-sync
# events are queued on one stream (plain events: not up to 1024 deep).
MAX_IN_FLIGHT = 32
# On an adopted stream, whose owner submits to it from its own thread in its own order,
# nothing is held on the host: each command reaches the stream when it is made.
ADOPTED_IN_FLIGHT = 1 << 40
FINISH_LONG, FINISH_PLAIN, FINISH_WAITED = 1, 2, 8  # am_cuq_finish flags
MAX_POLL_NS = 2_000_000  # ... or up to this long for a command expected to take so long
MAX_COPY_POLL_NS = 4_000_000  # ... a device copy (one of 1 GiB between two H200s: 2.8 ms)
MARKER_POLL_NS = 500_000  # ... a marker with nothing unconfirmed before it
# A queue's error when a command of it waited on the device for a value of another
# queue's that failed before producing it (CU_WAITED_FAILED, native/cuda_stream.h).
WAITED_FAILED = -3
# A queue's error when a wait of it, held on the host until what it waits for reached
# the driver, found that it failed before the wait was made -- a host queue's timeline
# (cpu, npy), another queue's command, or a timeline whose signal failed or was passed:
# its commands from that wait on were never handed to the stream (CU_HELD_FAILED).
HELD_FAILED = -8
# A wait for what no one has handed to the device yet (CU_DEFERRED): am_cuq_wait_foreign
# and am_cuq_hand_over return it when a stream cannot be made to wait now.
DEFERRED = -4
# A wait for another library's stream refused before anything was submitted: the stream
# is of another context than the device's (AM_OTHER_CONTEXT, native/amrt.h).
OTHER_CONTEXT = -9
# Out of host memory in a submission (native/cuda_submit.c, cuq_no_memory); as a queue's
# error: part of that command had reached the driver, and the queue failed from it on.
NO_MEMORY = -1
# How many queues deep a hand-over follows waits to the signals they wait for.
MAX_HAND_OVER_DEPTH = 8


class QueueDevice(StagingDevice, Protocol):
    """What a queue needs of its GPU (a ``CUDABackend``)."""

    name: str
    context_address: int
    launch_limits: LaunchLimits

    def make_current(self) -> None: ...


_SLOT = (1 << 64) - 1  # a value's two's complement bits in a 64-bit slot


class _StagedKeepAlive(KeepAlive):
    """A cuda queue's host objects. A pageable copy's host side is kept by its staging's
    host-copy threads as well (each thread's queue, until that queue's next part): once
    the copy is done and awaited, theirs are let go of with the queue's own."""

    __slots__ = ("staging",)

    def __init__(self, timeline: NativeTimeline) -> None:
        super().__init__(timeline)
        self.staging: Staging | None = None

    def let_go(self) -> None:
        super().let_go()
        if self.staging is not None:
            for copier in self.staging.copier.queues:
                copier.let_go_kept()


class CUDAQueue(NativeQueue):
    markers = True  # an event recorded on the stream: adopted streams have others' work
    hands_over_waits = True  # a stream's wait on a word only the host raised, and its work

    @keeps_context
    def __init__(
        self, backend: QueueDevice, timeline: CUDATimeline, adopt: int | None = None
    ) -> None:
        """A queue over a new stream, or over the stream ``adopt`` of another library,
        which closing the queue leaves to its owner."""
        refuse_if_lost(f"a new queue on {backend.name}")
        self._backend = backend
        self._timeline = timeline
        lib = self._lib = backend.lib
        backend.make_current()
        self.adopted = adopt is not None
        if adopt is None:
            flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
            self.stream = check(cu.cuStreamCreate(flags), "cuStreamCreate", backend.name)
        else:
            self.stream = cu.CUstream(adopt)
        self.handle = int(self.stream)
        self._q: int | None = lib.am_cuq_new(
            backend.context_address,
            int(self.stream),
            timeline.c_timeline,
            COMPLETION_SPIN_NS,
            MAX_IN_FLIGHT if adopt is None else ADOPTED_IN_FLIGHT,
        )
        if not self._q:
            if not self.adopted:
                cu.cuStreamDestroy(self.stream)
            raise AsyncMetalError("could not start the CUDA completion thread")
        # One collected unclosed -- made for a new_queue that an interrupt or an error
        # stopped before anything held it -- would keep its completion thread, its
        # stream and its memory for good: closed then (_close_dropped), by a finalizer
        # that holds no reference of the queue. A close detaches it.
        self._release_dropped = weakref.finalize(
            self, _close_dropped, lib, self._q, None if self.adopted else self.stream, os.getpid()
        )
        self._release_dropped.atexit = False  # (open devices close theirs at exit)
        if adopt is not None:
            lib.am_cuq_set_shared(self._q)  # its owner submits too: query less often
        timeline.queue = self
        self._error = ctypes.c_int.from_address(self._q)  # am_cuq's first member
        # The first value of its timeline that failed (0: none), read in place: a queue
        # failing behind a failed device wait sets its error only as it settles, and
        # reports the failed commands its thread confirmed before that through this
        # (native/cuda_completion.c, cuq_run; am_cuq_error says why they failed).
        self._failed_from = _native.failed_from(timeline.c_timeline)
        # Threads holding a note of a restore of their context that a native call could
        # not make (amrt.h, am_cuda_unrestored_notes), read in place after native calls.
        self._notes = ctypes.c_int.from_address(lib.am_cuda_unrestored_notes())
        self._sticky = (0, 0)
        self._cause = (0, 0, 0)  # for WAITED_FAILED: that queue's timeline, error, value
        self._keep: _StagedKeepAlive = _StagedKeepAlive(timeline)
        # A discard (any thread) and the close's take of the native queue; the export
        # calls of other threads under way (_held_open), which the close waits for.
        self._closing_lock = threading.Lock()
        self._closing = threading.Condition(self._closing_lock)
        self._exporting = 0
        # Held over a whole close: a close on another thread meanwhile waits for it (not
        # _closing, which a discard on a loop takes and must get at once, and which the
        # export calls take as they end).
        self._close_lock = threading.Lock()
        # What a close has left to do (see _close), and what it releases once.
        self._left: list[tuple[Any, ...]] = []
        self._native_left: int | None = None
        self._stream_left: Any = None
        self._discarded: str | None = None  # what dropped what had not started (discard)
        self._slots = (ctypes.c_uint64 * MAX_PARAMS)()
        base = ctypes.addressof(self._slots)
        self._pointers = (ctypes.c_void_p * MAX_PARAMS)(*(base + 8 * i for i in range(MAX_PARAMS)))
        self._pointers_address = ctypes.addressof(self._pointers)
        extension = _native.extension()
        self._fast_launch = None if extension is None else extension.cuq_launch
        self._copy = self._lib.am_cuq_copy if extension is None else extension.cuq_copy
        self._wait_stream = None if extension is None else extension.cuq_wait_stream
        self._limits = backend.launch_limits
        self._dims: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
        self._dims_arrays: list[ctypes.Array[ctypes.c_uint]] = []
        self._staging: Staging | None = None  # made at the first large pageable copy
        # This queue's device waits not known to be confirmed: (command, timeline,
        # target), for a hand-over that finds one of them held (_hand_over_signals).
        self._waits: collections.deque[tuple[int, NativeTimeline, int]] = collections.deque()
        # Commands up to this value were confirmed before the process's CUDA state was
        # lost (set then); every later one failed with it.
        self._confirmed_at_loss = UNCONFIRMED
        with _driver.lost_lock:
            if _driver.lost_first is not None:  # lost while this queue was being made
                self._confirmed_at_loss = 0
            _driver.live_queues.add(self)

    def _failed(self, code: int) -> AsyncMetalError:
        if code == NO_MEMORY:
            failed, first = self._first_error()
            if failed == NO_MEMORY:
                return CudaOutOfMemory(
                    f"out of host memory for the command at value {first} on a stream of "
                    f"{self._backend.name}, after part of it was handed to the driver: the "
                    "queue fails from that command on"
                )
            return CudaOutOfMemory(
                f"out of host memory to submit a command to a stream of {self._backend.name}: "
                "nothing of it was submitted"
            )
        if code in (WAITED_FAILED, HELD_FAILED):
            return self._waited_failed(*self._first_error())
        call = self._lib.am_cuda_name(self._lib.am_cuq_failed_call(self._q)).decode()
        error = driver_error(call, code, self._backend.name)
        failed, first = self._first_error()
        if failed != code or isinstance(error, DeviceLostError):
            return error  # (refused, nothing of it submitted: the queue goes on)
        return type(error)(
            f"{error}, for the command at value {first} on a stream of "
            f"{self._backend.name}: the queue fails from that command on"
        )

    def _lost(self, what: str) -> DeviceLostError:
        """The process-wide loss, for a submission refused after it (the native launch
        path finds it at its driver calls, or when its completion is awaited)."""
        return process_lost_error(f"{what} on {self._backend.name}")

    def _check(self, code: int) -> None:
        """Raise what a native submission call's nonzero result means (after warning of
        a restore of the thread's context that the call could not make)."""
        if self._notes.value:
            self._unrestored()
        if code:
            raise self._failed(code)

    def _unrestored(self) -> None:
        """Warn where the native calls just made on this thread could not make its
        context current again (RuntimeWarning, as for Python's own driver calls: see
        keeps_context). The extension's launch calls it only then."""
        warn_unrestored(self._lib)

    def _kept(self, value: int, keep: object, clean: bool) -> bool:
        """Whether command ``value``, refused by a native call, stays submitted, failed
        (``keep``: its host objects, then kept): where the driver refused a part of it
        after another part reached the driver (a staged copy's later chunk, an
        operation's event), the native queue fails from that command on
        (native/cuda_submit.c) -- what reached the driver runs, so the command is not
        taken back as never run. Its completion raises the driver's error, its host
        objects and buffers are kept until the stream is past it, and every later
        submission to the queue is refused. ``clean``: the queue had not failed before
        the command's native calls (read before them: they set the failure)."""
        # The queue's own error, read in place: am_cuq_error also gives a queue failing
        # behind a failed device wait its failure before it settles, from that wait's
        # command on: no part of a refused command reached the driver for that (a wait
        # the driver refused is not failed by the queue it waited for: native/
        # cuda_submit.c, stream_wait_queue), and kept, a command with nothing of it
        # handed over would leave the queue nothing to confirm, and unsettled.
        if not clean or self._q is None or not self._error.value:
            return False
        code, first = self._first_error()
        if not code or first != value:
            return False
        self._keep.add(value, keep)
        return True

    def _refused(self, code: int, value: int, clean: bool) -> None:
        """Command ``value``'s one native call returned ``code``: raise its error, unless
        the command stays submitted (``_kept``)."""
        if self._notes.value:
            self._unrestored()
        if code and not self._kept(value, None, clean):
            raise self._failed(code)

    def _finish(
        self,
        value: int,
        keep: object = None,
        extra: NativeTimeline | None = None,
        target: int = 0,
        expected_ns: int = 0,
        device_wait: bool = False,
        waited: bool = False,
    ) -> None:
        """End a command: an event behind it, which the completion thread confirms. A
        command expected to take at most ``MAX_POLL_NS`` (a copy of known size) is polled
        for through its end: blocking would add an interrupt and a wake-up. One expected
        to take longer gets a blocking-sync event, which the completion thread sleeps on
        after a short poll. A device wait's event is always plain: its thread naps, and a
        host signal wakes it.
        ``waited``: the command is a device wait on the word of ``extra`` (a timeline no
        queue owns, or another kind's queue timeline, held on the host) for ``target``,
        confirmed once the timeline got there, and failed if the timeline failed
        instead."""
        long_running = expected_ns > MAX_POLL_NS
        flags = FINISH_PLAIN if device_wait else FINISH_LONG if long_running else 0
        flags |= FINISH_WAITED if waited else 0
        self._check(
            self._lib.am_cuq_finish(
                self._q,
                value,
                extra.c_timeline if extra else None,
                target,
                0 if long_running else expected_ns,
                flags,
            )
        )
        self._keep.add(value, keep)

    def _write(self, value: int, timeline: CUDATimeline, target: int) -> None:
        """The stream writes ``target`` into ``timeline``'s word (part of command ``value``)."""
        self._check(self._lib.am_cuq_write(self._q, timeline.address, target, value))

    def _mark(self, value: int, timeline: CUDATimeline, target: int) -> None:
        """The stream marks a staging chunk's use on ``timeline``'s word, which host
        threads poll: ``target`` written there (part of ``value``), as ``_write``. Of a
        command that never runs (behind a failed wait held on the host), the host threads
        copy nothing for it (native/cuda_submit.c, am_cuq_mark)."""
        self._check(self._lib.am_cuq_mark(self._q, timeline.c_timeline, target, value))

    def _wait_value(self, value: int, timeline: CUDATimeline, target: int) -> None:
        """The stream waits for ``timeline``'s word, which only host threads raise (a
        staging chunk's), to reach ``target`` (part of ``value``)."""
        self._check(self._lib.am_cuq_wait(self._q, timeline.address, target, value))

    def _memcpy(self, value: int, to_device: bool, dst: int, src: int, nbytes: int) -> None:
        """A copy between pinned (or a few pages of pageable) host memory and the device,
        part of command ``value``."""
        self._check(self._lib.am_cuq_memcpy(self._q, to_device, dst, src, nbytes, value))

    def order_stream(self, context: int, stream: int, target: int) -> None:
        """Make another library's ``stream`` (of ``context``) wait, on the device, until
        this queue reaches ``target``, on the command's event: what the queue still
        holds on the host up to it is handed to the driver first (a stream that waited
        on a word written later could hold up this queue's, sharing a hardware queue).
        Nothing is numbered or watched for the stream; the calling thread's context is
        kept."""
        if _driver.lost_first is not None:
            raise self._lost("a consumer stream's wait")
        call = ctypes.c_int()
        wait = self._lib.am_cuq_wait_foreign
        code = self._held_open(wait, context, stream, target, ctypes.byref(call))
        if code == DEFERRED and self._hand_over_signals(target, 0):
            code = self._held_open(wait, context, stream, target, ctypes.byref(call))
        if code is None:  # closed: its commands are done or were abandoned
            return
        if code == DEFERRED:
            raise self._not_handed_over(target)
        if code:
            name = self._lib.am_cuda_name(call.value).decode()
            raise driver_error(name, code, self._backend.name)

    def hand_over(self, value: int, depth: int = 0) -> None:
        """Hand the operations held on the host up to command ``value`` to the driver
        now, past the bound on commands in flight: another library is about to use the
        stream itself (record an event there), which sees only what reached it."""
        code = self._held_open(self._lib.am_cuq_hand_over, value)
        if code == DEFERRED and self._hand_over_signals(value, depth):
            code = self._held_open(self._lib.am_cuq_hand_over, value)
        if code == DEFERRED:
            raise self._not_handed_over(value)

    def _held_open(self, fn: Any, *args: Any) -> int | None:
        """``fn(the native queue, *args)``, the queue kept from being freed meanwhile (a
        close on another thread frees it: these run on the thread of a DLPack export's
        consumer, any); None once closed. No lock is held over the call, which may wait
        for another thread's hand-over: a discard (on a loop) does not wait for it, and
        the native queue takes its own; the close waits for it to return."""
        with self._closing:
            handle = self._q
            if handle is None:
                return None
            self._exporting += 1
        try:
            code = int(fn(handle, *args))
            if self._notes.value:
                self._unrestored()
            return code
        finally:
            # A KeyboardInterrupt as this waits for the lock (a close or a discard on
            # another thread holds it: CPython runs the handler in the wait, and nothing
            # is taken) does not skip what follows: it waits again, and the interrupt is
            # raised once done -- skipped, the call stayed counted, and the queue's close
            # waited for good.
            interrupt: KeyboardInterrupt | None = None
            entered = False
            while not entered:
                try:
                    with self._closing:  # (no call before the count is down)
                        entered = True
                        self._exporting -= 1
                        if not self._exporting:
                            self._closing.notify_all()
                except KeyboardInterrupt as exc:
                    if entered:
                        raise
                    interrupt = exc
            if interrupt is not None:
                raise interrupt

    def _hand_over_signals(self, value: int, depth: int) -> bool:
        """Before a hand-over up to command ``value`` is tried again: the queue signals
        that this queue's waits up to it wait for, handed over up to the signal. Another
        queue may hold such a signal on the host (past its bound), and then holds this
        queue's wait too, which the native hand-over cannot help (a timeline does not
        record which queue holds its signal); a wait for another queue's command is
        followed to that queue's waits. Whether any signal was handed over; BufferError
        for one that cannot be."""
        handed = False
        for command, timeline, target in list(self._waits):
            if command > value or depth >= MAX_HAND_OVER_DEPTH:
                break
            if timeline.value >= target or not isinstance(timeline, CUDATimeline):
                continue  # (another kind's: only its queue's thread raises it)
            owner, signal = timeline.queue, timeline.last_signal
            if isinstance(owner, CUDAQueue):  # the native hand-over hands its commands over
                handed = owner._hand_over_signals(target, depth + 1) or handed
                continue
            if signal is None:  # no queue signals it: only the host can
                continue
            signaller, at, raises_to = signal[0](), signal[1], signal[2]
            if (
                not isinstance(signaller, CUDAQueue)
                or signaller is self
                or raises_to < target  # no signal submitted gets there
                or signaller._timeline.value >= at  # confirmed: handed over long ago
            ):
                continue
            try:
                signaller.hand_over(at, depth + 1)
            except BufferError as held:
                raise BufferError(
                    f"command {command} of a queue of {self._backend.name} waits, on the "
                    f"host, for a timeline value that command {at} of a queue of "
                    f"{signaller._backend.name} signals, and that signal cannot be handed "
                    f"to the device before it: {held}"
                ) from None
            handed = True
        return handed

    def _not_handed_over(self, value: int) -> BufferError:
        held = self._held_behind_host(value, 0)
        if held is not None:
            return BufferError(
                f"command {value} of a queue of {self._backend.name} is held on the host "
                f"behind a wait for {held}, which has not run yet: another library's stream "
                "cannot wait on the device for a host queue's command, and an export does "
                "not block the calling thread (await that command, or this one, before "
                "exporting)"
            )
        return BufferError(
            f"command {value} of a queue of {self._backend.name} waits, on the host, for a "
            "timeline value nothing has signalled yet: another library's stream cannot "
            "wait for it (signal the timeline, or await the command, before exporting)"
        )

    def _held_behind_host(self, value: int, depth: int) -> str | None:
        """The command of another kind's queue (a host queue's: cpu, npy) not yet run that
        a wait of this queue up to command ``value`` waits for, held on the host until
        it ran -- or that such a wait of a queue this one waits for does, up to what it
        waits for -- named; None if there is none."""
        for command, timeline, target in list(self._waits):
            if command > value or depth >= MAX_HAND_OVER_DEPTH:
                break
            if timeline.value >= target:
                continue
            if not isinstance(timeline, CUDATimeline):  # (a host queue's: no device word)
                assert timeline.c_timeline is not None
                return command_of(timeline.c_timeline, target)
            owner = timeline.queue
            if isinstance(owner, CUDAQueue):
                held = owner._held_behind_host(target, depth + 1)
                if held is not None:
                    return held
        return None

    def failure(self, value: int) -> BaseException | None:
        if not self._error.value and _driver.lost_first is None:  # the common case: no call
            failed = self._failed_from.value
            if not failed or value < failed:
                return None
        code, first = self._first_error()
        if code in (WAITED_FAILED, HELD_FAILED) and value >= first:
            return self._waited_failed(code, first)
        if code == DISCARDED and value >= first:
            return discarded_error(value, self._discarded or QUEUE_DISCARDED)
        if code == NO_MEMORY and value >= first:
            return self._failed(code)
        if code and value >= first:
            where = f"a stream of {self._backend.name}"
            return driver_error(f"the command at value {first}", code, where)
        if _driver.lost_first is not None and value > self._confirmed_at_loss:
            return process_lost_error(f"the command at value {value} on {self._backend.name}")
        return None

    def _reported_failed(self, value: int) -> bool:
        """Whether ``value`` of this queue's timeline was reached failed before the queue
        settled: its thread raises the timeline through the failed commands it confirms
        (native/cuda_completion.c, cuq_run). A device wait for it is made still, as while
        it was not reached -- the native queue finds it failed, and fails the waiting
        queue's commands from there on -- not passed as one for a value produced."""
        failed = self._failed_from.value
        return bool(failed) and value >= failed and self._timeline.value != MAX_VALUE

    def fails_later(self) -> bool:
        if not self._error.value and not self._failed_from.value:
            return False  # (failing, reported before it settled: am_cuq_error says so)
        return self._first_error()[0] in (WAITED_FAILED, HELD_FAILED)

    def reached(self) -> int | None:
        # (Failing behind a failed wait, it reports what it holds on the host behind a
        # signal's wait for another queue's lower signal before its stream gets past
        # them -- the hold may end and the stream still never get there:
        # native/cuda_submit.c, am_cuq_reached. Its timeline is failed before it is
        # raised through them, so a queue whose timeline never failed is asked nothing.
        # Asked under _closing's lock: a close on another thread frees the native queue
        # once it took it, and a device's close counts every device's queues. The lock
        # taken as itself, as _close does: asked on a loop's thread too, by a reaper's
        # look or a close's count, where a Ctrl-C as Condition.__enter__ -- a Python
        # function -- returns would leave it held, and every later close waiting.)
        if not self._failed_from.value:
            return None
        with self._closing_lock:
            if self._q is None:
                return None
            reached = int(self._lib.am_cuq_reached(self._q))
        return None if reached == MAX_VALUE else reached

    def stats(self) -> dict[str, int]:
        """How this stream's completion thread worked: event queries; waits, after
        polling found a command unfinished, blocked on its blocking-sync event or with
        naps on its plain one; events created; whether commands get blocking-sync events
        now (after a long one); operations held on the host (the stream had
        ``MAX_IN_FLIGHT`` commands unconfirmed) so far and now; naps cut short by a host
        signal. For benchmarks and tests."""
        out = (ctypes.c_uint64 * 8)()
        with self._closing_lock:  # (a close on another thread frees it: see reached)
            if self._q is not None:
                self._lib.am_cuq_stats(self._q, out)
        keys = (
            "queries",
            "blocking_waits",
            "napping_waits",
            "events_made",
            "blocking_now",
            "held_total",
            "held_now",
            "kicked",
        )
        return dict(zip(keys, out, strict=True))

    def _first_error(self) -> tuple[int, int]:
        # Asked on any thread (failure, fails_later: a loop's, of a failed queue only)
        # while a close on another may free the native queue: read under the lock its
        # take is made under, taken as itself (see reached).
        with self._closing_lock:
            return self._first_error_held()

    def _first_error_held(self) -> tuple[int, int]:
        """(Under _closing_lock.) The queue's first error and the value it failed from,
        read from the native queue while there is one, else as last read."""
        if self._q is not None:
            first = ctypes.c_uint64()
            code = self._lib.am_cuq_error(self._q, ctypes.byref(first))
            self._sticky = (code, first.value)
            if code in (WAITED_FAILED, HELD_FAILED):
                error, value = ctypes.c_int(), ctypes.c_uint64()
                cause = self._lib.am_cuq_cause(self._q, ctypes.byref(error), ctypes.byref(value))
                self._cause = (cause or 0, error.value, value.value)
        return self._sticky

    def _waited_failed(self, code: int, first: int) -> AsyncMetalError:
        """The error of this queue's commands from ``first`` on, which ran after a device
        wait for a value that another queue's failed command never produced: that
        command's error, named (by its queue's device, where that queue is still alive).
        Held on the host until that failure was known (HELD_FAILED), they never ran: they
        say so, and one behind another kind's queue fails as a cpu queue's command behind
        a failed wait does, naming where it began."""
        timeline, error, value = self._cause
        source = next(
            (
                queue
                for queue in list(_driver.live_queues)
                if isinstance(queue, CUDAQueue) and queue._timeline.c_timeline == timeline
            ),
            None,
        )
        if code == HELD_FAILED and (
            error in (ABANDONED, CLOSED, DISCARDED) or (source is None and error <= 0)
        ):
            lead = "this command did not run: it follows a device-side wait for a value that"
            return failure_error(Failure(first, error, value, timeline), lead, LATER_FAIL)
        if error in (ABANDONED, CLOSED, DISCARDED):  # its device closed, or it was dropped
            lead = (
                f"the command at value {first} on a stream of {self._backend.name} ran after "
                "a device-side wait for a value that"
            )
            return failure_error(Failure(first, error, value, timeline), lead, LATER_FAIL)
        where = "another stream" if source is None else f"a stream of {source._backend.name}"
        cause = driver_error(f"the command at value {value}", error, where)
        kind = DeviceLostError if isinstance(cause, DeviceLostError) else AsyncMetalError
        ran = "did not run: it follows" if code == HELD_FAILED else "ran after"
        return kind(
            f"the command at value {first} on a stream of {self._backend.name} {ran} a "
            f"device-side wait for a value that was never produced: {cause}{LATER_FAIL}"
        )

    def launch(
        self,
        program: Any,
        args: Sequence[Arg],
        global_size: tuple[int, int, int],
        local_size: tuple[int, int, int],
        value: int,
        record: Record,
    ) -> None:
        if _driver.lost_first is not None:
            raise self._lost("a launch")
        if len(args) > MAX_PARAMS:
            raise AsyncMetalError(f"cuda kernels take at most {MAX_PARAMS} parameters here")
        limits = self._limits
        if (program, global_size, local_size) != limits.last:  # (else checked just before)
            limits.check(program, global_size, local_size)
        # One native call, which makes the context current (through the extension, which
        # packs the arguments and works out the grid itself, where it could be built).
        clean = not self._error.value
        if self._fast_launch is not None:
            code = self._fast_launch(self._q, program, global_size, local_size, args, value)
        else:
            dims = self._dims.get((global_size, local_size))
            if dims is None:
                dims = self._launch_dims(global_size, local_size)
            slots = self._slots
            # Each parameter's pointer is its 8-byte slot (8-aligned), the value in its
            # low bytes: the driver copies as many as the kernel's parameter takes.
            for i, (handle, offset, val) in enumerate(args):
                if val is None:
                    slots[i] = handle + offset
                else:
                    slots[i] = (val if isinstance(val, int) else val.bits) & _SLOT
            code = self._lib.am_cuq_launch(
                self._q, program, dims, self._pointers_address, len(args), value
            )
        self._refused(code, value, clean)

    def launch_target(self) -> tuple[Any, ...] | None:
        if self._fast_launch is None:
            return None
        limits = self._limits
        return _native_contract.cuda_launch_target(
            self, self._q, limits=limits.address, kernel_threads=limits.kernel_threads
        )

    def _launch_dims(self, global_size: tuple[int, ...], local_size: tuple[int, ...]) -> int:
        """The address of (grid, block, shared bytes) for these sizes, cached."""
        if len(self._dims) >= 256:
            self._dims.clear()  # the arrays stay alive in _dims_arrays until then
            self._dims_arrays.clear()
        grid = [-(-g // b) for g, b in zip(global_size, local_size, strict=True)]
        array = (ctypes.c_uint * 7)(*grid, *local_size, 0)
        self._dims_arrays.append(array)
        address = self._dims[(global_size, local_size)] = ctypes.addressof(array)
        return address

    def signal(self, timeline: NativeTimeline, target: int, value: int, record: Record) -> None:
        assert isinstance(timeline, CUDATimeline)
        if _driver.lost_first is not None:
            raise self._lost("a signal")
        clean = not self._error.value
        try:
            self._write(value, timeline, target)  # native calls: they make the context current
            self._finish(value, timeline, extra=timeline, target=target)
            timeline.last_signal = (weakref.ref(self), value, target)
        except AsyncMetalError:
            if not self._kept(value, timeline, clean):
                raise

    def wait(self, timeline: NativeTimeline, target: int, value: int, record: Record) -> None:
        # A CUDATimeline; or another kind's queue timeline (a host queue's, with no device
        # word), waited for across kinds: held on the host until its queue's thread
        # raised it, then nothing for the stream to wait on (the work behind it reaches
        # the driver after that), and failed from there if it failed instead.
        assert timeline.c_timeline is not None
        if _driver.lost_first is not None:
            raise self._lost("a wait")
        # Native calls only (they make the context current); none if confirmed already.
        clean = not self._error.value
        try:
            self._wait(timeline, target, value)
        except AsyncMetalError:
            if not self._kept(value, timeline, clean):
                raise

    def _wait(self, timeline: NativeTimeline, target: int, value: int) -> None:
        confirms: NativeTimeline | None = None
        waited = False
        reached = timeline.value
        owner = getattr(timeline, "queue", None)
        # Made also past its target where the value may have failed: at 2**64 - 1 (past
        # any value a signal gives) the timeline settled as it failed, or its queue did,
        # and a queue's own is raised through its failed commands before it settles
        # (``_reported_failed``). The runtime then fails this queue from the wait on
        # where the value waited for never ran (as a host queue's wait fails), and
        # passes it where that value ran before the failure.
        if (
            reached < target
            or reached == MAX_VALUE
            or (isinstance(owner, CUDAQueue) and owner._reported_failed(target))
        ):
            if isinstance(owner, CUDAQueue):  # a queue's own
                # Decided with that queue kept open (its close waits for the call): once
                # its close took its native queue, nothing raises its timeline further
                # -- its commands ran, or were abandoned -- and its word is not written
                # by its stream, so a stream's wait on the word would never end.
                wait = self._lib.am_cuq_wait_queue
                code = owner._held_open(lambda other: wait(self._q, other, target, value))
                if code is None:
                    if timeline.value < target:
                        raise closed_queue_error(owner._timeline.c_timeline, target)
                    failed = owner._failed_from.value
                    if failed and target >= failed:
                        # Closed failed at or before target: the timeline's own record
                        # of the failure is waited on, and fails this queue from here.
                        code = self._lib.am_cuq_wait_timeline(
                            self._q, timeline.c_timeline, target, value
                        )
                        waited = True
                    else:
                        code = 0  # (got there as its close began)
                self._check(code)
                if owner._backend is self._backend:
                    # Once this wait is confirmed, so is the other queue's work up to
                    # target (a fault there would have failed this context's streams):
                    # its timeline gets there first, so a completion awaited here never
                    # shows one it waited for as unfinished.
                    confirms = timeline
            else:
                # Held on the host until a signal that gets there was handed to a device
                # (or the host raised the word): a stream's wait on a word holds up the
                # streams sharing its hardware queue, the signal's among them.
                self._check(
                    self._lib.am_cuq_wait_timeline(self._q, timeline.c_timeline, target, value)
                )
                # Confirmed once the timeline's value got there: its word may be raised
                # for a value never produced, when the command signalling it failed.
                confirms, waited = timeline, True
        self._finish(value, timeline, confirms, target, device_wait=True, waited=waited)
        if timeline.value < target:
            waits = self._waits
            while waits and waits[0][0] <= self._timeline.value:
                waits.popleft()
            waits.append((value, timeline, target))

    def copy(
        self, dst: Arg, src: Arg, nbytes: int, value: int, record: Record, peer: Any = None
    ) -> None:
        if _driver.lost_first is not None:
            raise self._lost("a copy")
        # Expected at most ~1 ns per KB on one H200 (~2 TB/s each way), ~3 between two
        # (~390 GB/s over NVLink): the completion thread polls that long.
        expected = nbytes // 1000 if peer is None else nbytes * 3 // 1000
        clean = not self._error.value
        code = self._copy(  # one native call, which makes the context current
            self._q,
            dst.handle + dst.offset,
            src.handle + src.offset,
            None if peer is None else peer.context_address,
            nbytes,
            value,
            expected if expected < MAX_COPY_POLL_NS else MAX_COPY_POLL_NS,
        )
        self._refused(code, value, clean)
        record._due_ns = time.perf_counter_ns() + expected

    def fill(
        self, dst: Arg, nbytes: int, pattern: int, size: int, value: int, record: Record
    ) -> None:
        if _driver.lost_first is not None:
            raise self._lost("a fill")
        # cuMemsetD8/D16/D32Async, then its event: one native call, which makes the
        # context current. Expected at most ~1 ns per 2 KB (writes only, on one H200).
        expected = nbytes // 2000
        clean = not self._error.value
        code = self._lib.am_cuq_fill(
            self._q,
            dst.handle + dst.offset,
            pattern,
            size,
            nbytes,
            value,
            expected if expected < MAX_COPY_POLL_NS else MAX_COPY_POLL_NS,
        )
        self._refused(code, value, clean)
        record._due_ns = time.perf_counter_ns() + expected

    def _held_across(self) -> bool:
        """Whether a wait of this queue on another kind's queue timeline (held on the
        host until that queue's thread raises it) may not have ended yet."""
        return any(
            not isinstance(timeline, CUDATimeline) and timeline.value < target
            for _, timeline, target in self._waits
        )

    def _staging_for(self) -> Staging:
        if self._staging is None:
            self._staging = self._keep.staging = Staging(self._backend)
        return self._staging

    def wait_stream(self, stream: int, value: int, record: Record) -> None:
        if _driver.lost_first is not None:
            raise self._lost("a wait for another library's stream")
        if stream == self.handle:  # this queue's own stream: in order already
            self.marker(value, record)
            return
        # The wait and the command's end (a marker's) in one native call.
        lone = self._timeline.value >= value - 1
        poll_ns = MARKER_POLL_NS if lone else 0
        context = self._backend.context_address
        clean = not self._error.value
        if self._wait_stream is not None:
            code, failed = self._wait_stream(self._q, context, stream, value, poll_ns, 0)
        else:
            call = ctypes.c_int()
            code = self._lib.am_cuq_wait_stream_end(
                self._q, context, stream, value, poll_ns, 0, ctypes.byref(call)
            )
            failed = call.value
        if self._notes.value:
            self._unrestored()
        if code == OTHER_CONTEXT:  # (asked of the driver in the same call)
            name = self._backend.name
            raise other_context(name, f"an array imported on {name} comes with a stream of {name}")
        if code and not self._kept(value, None, clean):  # (kept: the wait ran, its end refused)
            if code == NO_MEMORY:
                raise self._failed(code)
            name = self._lib.am_cuda_name(failed).decode()
            raise driver_error(name, code, self._backend.name)
        self._keep.add(value, None)
        if lone:
            record._due_ns = time.perf_counter_ns() + MARKER_POLL_NS

    def marker(self, value: int, record: Record) -> None:
        if _driver.lost_first is not None:
            raise self._lost("a marker")
        # An event, recorded in a native call (context kept). What it covers (another
        # library's work) is of unknown length. A lone marker -- everything before it
        # confirmed, one request awaited at a time -- is polled for up to MARKER_POLL_NS,
        # by the completion thread (a blocking-sync event's wake-up costs tens of
        # microseconds) and by its awaiting task, between yields to the loop (so is a
        # park's). Behind unconfirmed commands it is not: with many requests in flight
        # the thread's queries would contend with the submitting library's.
        lone = self._timeline.value >= value - 1
        self._finish(value, expected_ns=MARKER_POLL_NS if lone else 0)
        if lone:
            record._due_ns = time.perf_counter_ns() + MARKER_POLL_NS

    @keeps_context
    def copyin(self, dst: Arg, src: memoryview, value: int, record: Record) -> None:
        if _driver.lost_first is not None:
            raise self._lost("a copy from the host")
        self._backend.make_current()
        clean = not self._error.value
        try:
            self._copyin(dst, src, value)
        except AsyncMetalError:
            if not self._kept(value, (dst, src), clean):
                raise

    def _copyin(self, dst: Arg, src: memoryview, value: int) -> None:
        address = host_address(src)[0]
        base = dst.handle + dst.offset
        if src.nbytes <= STAGE_DIRECT:  # a few pages: the driver stages them itself
            self._memcpy(value, True, base, address, src.nbytes)
            self._finish(value, (dst, src))
            return
        staging = self._staging_for()
        staging.reserve(src.nbytes)  # (pinning refused: nothing of the copy submitted)
        held = self._held_across()
        for offset in range(0, src.nbytes, STAGE_CHUNK):
            n = min(STAGE_CHUNK, src.nbytes - offset)
            # busy: host threads refill it after the stream
            chunk, busy = staging.acquire(first=offset == 0)
            try:
                if held:
                    # The stream is held on the host behind another kind's queue (which
                    # may write src: lent memory of its buffer): the host threads read src
                    # only once the stream got past that wait, and the chunk's last use
                    # ended.
                    if busy is not None:
                        self._wait_value(value, *busy)
                    busy = staging.next_mark()
                    self._mark(value, *busy)
                filled = staging.copier.copy(chunk.address, address + offset, n, src, chunk, busy)
                self._wait_value(value, *filled)
                self._memcpy(value, True, base + offset, chunk.address, n)
                mark = staging.next_mark()
                self._mark(value, *mark)  # the chunk is free again: host threads poll the word
            except BaseException:
                staging.retire(chunk)
                raise
            staging.release_after(chunk, *mark)
        self._finish(value, (dst, src), expected_ns=src.nbytes // STAGED_BYTES_PER_NS)

    @keeps_context
    def copyout(self, dst: memoryview, src: Arg, value: int, record: Record) -> None:
        if _driver.lost_first is not None:
            raise self._lost("a copy to the host")
        self._backend.make_current()
        clean = not self._error.value
        try:
            self._copyout(dst, src, value)
        except AsyncMetalError:
            if not self._kept(value, (dst, src), clean):
                raise

    def _copyout(self, dst: memoryview, src: Arg, value: int) -> None:
        address = host_address(dst)[0]
        base = src.handle + src.offset
        staging = self._staging_for()
        staging.reserve(dst.nbytes)  # (pinning refused: nothing of the copy submitted)
        for offset in range(0, dst.nbytes, STAGE_CHUNK):
            n = min(STAGE_CHUNK, dst.nbytes - offset)
            chunk, busy = staging.acquire(first=offset == 0)
            try:
                if busy is not None:  # the stream refills it once a host thread emptied it
                    self._wait_value(value, *busy)
                self._memcpy(value, False, chunk.address, base + offset, n)
                # The stream marks the chunk arrived; a host thread then moves it out.
                mark = staging.next_mark()
                self._mark(value, *mark)
                emptied = staging.copier.copy(address + offset, chunk.address, n, dst, chunk, mark)
            except BaseException:
                staging.retire(chunk)
                raise
            staging.release_after(chunk, *emptied)
        for unfinished in staging.unfinished():  # done once every byte is in dst
            self._wait_value(value, *unfinished)
        self._finish(value, (dst, src), expected_ns=dst.nbytes // STAGED_BYTES_PER_NS)

    def discard(self, why: str) -> None:
        with self._closing_lock:  # (the close frees the native queue; see reached)
            if self._q is not None:
                self._discarded = why
                self._lib.am_cuq_discard(self._q)

    def close(self, abandon: bool = False) -> None:
        """(See NativeQueue.close.) Every caller returns once the queue is released: a
        close under way on another thread is waited for, as it releases it (with its
        ``abandon``). An abandoning close meanwhile waits for a plain one too, even one
        held up by a device wait that nothing signals: the runtime has no call that
        turns a close under way into an abandoning one (a discard leaves a closing
        queue to its close). The device never closes a queue twice at once: its own
        close (at exit too, abandoning) first joins the release threads that close
        queues."""
        with self._close_lock:
            self._close(abandon)

    def _close(self, abandon: bool) -> None:
        # Its native queue is taken once, with what the close has left to do recorded
        # beside it (``_left``): a KeyboardInterrupt in the rest (a Ctrl-C as the
        # device's close runs at exit, on the main thread) leaves it to the next close
        # -- the device's step run again, or the close at exit -- which goes on from
        # there (``in_turn``). Each step may run again; those that release something
        # once take it first, with no call between the take and the release. (The
        # condition's lock, taken as itself: an interrupt as Condition.__enter__ -- a
        # Python function -- returns would leave it held, and the next close waiting.)
        with self._closing_lock:
            handle = self._q
            if handle is not None:
                code, _ = self._first_error_held()
                # The closed queue's error stays reported, kept before the native queue
                # can be freed: read in place (failure, fails_later: any thread, with no
                # lock), it would be read from the freed queue meanwhile. (Stored with
                # no call before the take: an interrupt finds both or neither.)
                kept = ctypes.c_int(code)
                self._left = [
                    (self._release_dropped.detach,),
                    (self._close_handle, int(abandon)),
                    (self._close_staging, code, abandon),
                    (self._destroy_stream,),
                    (self._keep.clear,),
                ]
                self._error = kept
                self._native_left = handle
                self._stream_left = None if self.adopted else self.stream
                self._q = None
            while self._exporting:  # (another thread's export call, not long)
                self._closing.wait()
        errors: list[BaseException] = []
        in_turn(self._left, errors)
        if errors:
            raise errors[0]

    def _close_handle(self, abandon: int) -> None:
        """(A step of _close.) Without abandon this returns once every held command was
        submitted and every command confirmed (the stream is then idle)."""
        handle, self._native_left = self._native_left, None
        if handle is not None:
            self._lib.am_cuq_close(handle, abandon)

    def _close_staging(self, code: int, abandon: bool) -> None:
        """(A step of _close.) Discarded or failed (a fault loses the whole context: the
        process's CUDA state), a host copy of a command that never ran may wait for a
        mark its stream never writes: the copy threads stop where they are (those of
        commands that ran are done: a command is confirmed after them). Otherwise the
        close waited for good. Closed without abandoning, the stream is past all it was
        given: a chunk a stopped host copy left part way is freed, not left pinned.
        (Closed again, the staging has nothing left: its threads are closed.)"""
        if self._staging is not None:
            lost = _driver.lost_first is not None
            failed = code != 0 or lost
            dropped = abandon or failed or self._discarded is not None
            self._staging.close(dropped, not abandon and not lost)

    def _destroy_stream(self) -> None:
        """(A step of _close.) Its own stream, not an adopted one."""
        stream, self._stream_left = self._stream_left, None
        if stream is not None:
            cu.cuStreamDestroy(stream)


def _close_dropped(lib: Any, handle: int, stream: Any, pid: int) -> None:
    """A CUDAQueue's finalizer: the native queue of one collected unclosed is closed,
    abandoned (am_cuq_close), on whatever thread collects it -- a loop's too -- so that
    it never waits there for a device wait: one never handed out had nothing submitted,
    and its idle completion thread stops at once (with work in flight, the close gives
    up on a thread blocked on an event after ~200 ms). Then its own stream, not an
    adopted one, is destroyed: the driver's call returns at once, the stream's work,
    if any, going on. In a forked child the queue is the parent's (its completion
    thread is not there, its lock may be held for good): left alone."""
    if os.getpid() != pid:
        return
    lib.am_cuq_close(handle, 1)
    if stream is not None:
        cu.cuStreamDestroy(stream)

"""Metal timelines (shared events with a native mirror) and queues (one command buffer
per command)."""

from __future__ import annotations

import collections
import ctypes
import functools
import heapq
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from ctypes import c_uint64, c_ulong, c_void_p
from typing import Any, NamedTuple, Protocol, overload

from ... import _native
from ..._backend import (
    Arg,
    ForkableTimeline,
    InheritedValue,
    KeepAlive,
    NativeQueue,
    NativeTimeline,
    Record,
    host_address,
)
from ..._errors import DeviceLostError, InvalidArgumentError, fresh_error, keep_error
from ..._scalars import SIZES, Scalar
from ..._timeline import LATER_FAIL, MAX_VALUE, QUEUE_DISCARDED, discarded_error, failure_error
from . import _blocks
from ._objc import (
    autorelease_pool,
    describe_error,
    made,
    objc_msgsend_address,
    release,
    retain,
    selector,
    send,
)

STORAGE_SHARED = 0  # MTLResourceStorageModeShared
STATUS_ERROR = 5  # MTLCommandBufferStatusError
MAX_IN_FLIGHT = 1000  # the queues are made with room for 1024 command buffers
# A queue's thread holding a wait looks at its timeline again this often whatever (it
# is woken when the timeline moves, when the queue discards, and when a command of its
# queue fails: see _park).
HOST_WAIT_NAP_NS = 1_000_000_000
# amrt.h, am_host_wait's `committed`: what makes a wait held on the host ready -- its
# timeline got there or failed for it; or also a committed command buffer that signals
# it that far (the GPU waits for the rest); or, a queue's own timeline, got there or a
# committed signal only (its failure does not count before the queue is closed).
HOST_WAIT_REACHED, HOST_WAIT_COMMITTED, HOST_WAIT_OWN = 0, 1, 2
AM_COMMAND_FAILED = -6  # amrt.h: a timeline's failure, a command of a Metal queue failed
AM_DISCARDED = _native.DISCARDED  # amrt.h: ... a command dropped by a discarding close


class MetalDevice(Protocol):
    """What timelines and queues need of their GPU (a ``MetalBackend``)."""

    device: int
    lib: ctypes.CDLL
    block_isa: int
    max_threadgroup: tuple[int, int, int]  # maxThreadsPerThreadgroup: width, height, depth

    @overload
    def wrap_pages(self, address: int, nbytes: int) -> tuple[int, int]: ...
    @overload
    def wrap_pages(self, address: int, nbytes: int, check: bool) -> tuple[int, int] | None: ...


class MetalKernel(NamedTuple):
    """A loaded kernel: its pipeline, the index each launch argument binds at (its
    parameter's ``[[buffer(i)]]``; None: the i-th at i), its name, and the most threads
    a threadgroup of its pipeline may have."""

    pipeline: int
    bindings: tuple[int, ...] | None
    name: str
    max_threads: int


class MTLSize(ctypes.Structure):
    _fields_ = [("width", c_ulong), ("height", c_ulong), ("depth", c_ulong)]


_MTLSIZE_FIELDS = ("width", "height", "depth")  # a launch size's x, y, z


class NSRange(ctypes.Structure):
    _fields_ = [("location", c_ulong), ("length", c_ulong)]


class _Waited:
    """What a queue's waits and their gates read of what a Metal queue's wait waits on:
    the native timeline, and whether a value of it is there for the GPU's wait."""

    c_timeline: int
    _lib: ctypes.CDLL
    # How a wait for it held on the host gets ready (HOST_WAIT_*): a host queue's
    # timeline only by getting there (or failing); one the GPU can wait on (an
    # ``MTLSharedEvent``) also by a committed command buffer's signal
    # (am_signal_committed); a queue's own (HOST_WAIT_OWN) not by failing.
    host_wait = HOST_WAIT_REACHED

    def failure(self, target: int) -> _native.Failure | None:
        """Why ``target``, reached, was never produced (None: it was)."""
        failure = _native.timeline_failure(self.c_timeline)
        return failure if failure is not None and target >= failure.first else None

    def ready(self, target: int) -> bool:
        """Whether a wait for ``target`` can be committed now (objc_blocks.c,
        am_host_wait): the timeline got there or failed for it (not a queue's own), or
        (``host_wait``) a command buffer that signals it so was committed."""
        return bool(self._lib.am_host_wait(self.c_timeline, target, self.host_wait, None, 0))


class MetalTimeline(_Waited, ForkableTimeline):
    """An ``MTLSharedEvent`` with a native mirror timeline that wakes the loops."""

    host_wait = HOST_WAIT_COMMITTED
    # The queue whose own timeline it is (weakly), if any: a wait for its value asks it
    # to flush (MetalQueue._park), as an await of its command does.
    queue: weakref.ref[MetalQueue] | None = None

    def __init__(self, backend: MetalDevice) -> None:
        self._lib = backend.lib
        self.event = made(send(backend.device, "newSharedEvent"), "newSharedEvent")
        self.c_timeline: int = backend.lib.am_timeline_new()
        self._mirror: _native.ValueReader = _native.timeline_reader(self.c_timeline)
        self._backend = backend

    def __del__(self) -> None:
        # Command buffers that wait on or signal the event retain it, as a queue's own
        # native timeline does (am_metal_own); this reference is the timeline's own
        # (newSharedEvent). None if __init__ failed before making it.
        release(getattr(self, "event", 0))
        # Reached once no queue nor watch refers to it (they hold us); a completion
        # handler yet to run may still raise the native timeline.
        if getattr(self, "c_timeline", 0):
            _blocks.free_timeline(self.c_timeline, self._lib.am_timeline_free)

    @property
    def value(self) -> int:
        return self._mirror.value

    def device_value(self) -> int:
        value: int = send(self.event, "signaledValue", restype=c_uint64)
        return value

    def gpu_target(self, target: int) -> int:
        """The value the GPU waits for, for a wait for ``target``: ``target`` -- but of a
        timeline that failed for it (a signal of it failed: its command buffer, or a wait
        before it), not past what committed command buffers signal it to, which may be
        less: nothing else will. (Not a queue's own timeline, whose queue commits all its
        values: a discard's last buffer takes it past those it dropped.) Its gate
        reports the failure."""
        if self.queue is not None or self.failure(target) is None:
            return target
        committed: int = self._lib.am_signal_committed_to(self.c_timeline)
        return min(target, committed)

    def forked(self, message: str) -> None:
        self._mirror = InheritedValue(message)

    def signal(self, value: int) -> None:
        send(self.event, "setSignaledValue:", value, restype=None, argtypes=(c_uint64,))
        self._lib.am_timeline_signal(self.c_timeline, value)

    def abandon(self, target: int, first: int) -> None:
        # The mirror fails and settles; the event goes as far, ending the GPU's waits on
        # it (the queues that waited report their commands from there on as failed).
        super().abandon(target, first)
        send(self.event, "setSignaledValue:", MAX_VALUE, restype=None, argtypes=(c_uint64,))

    def close_waits(self, pending: int = 0) -> None:
        super().close_waits()  # (and the GPU's waits on the event end)
        send(self.event, "setSignaledValue:", MAX_VALUE, restype=None, argtypes=(c_uint64,))


class HostWait(_Waited):
    """A Metal queue's wait for a value of another kind's queue timeline (a cpu or npy
    queue's, which has no ``MTLSharedEvent``: the GPU cannot wait on it). One whose
    value is not there yet is held on the queue's own thread, with what comes after it,
    until the timeline got there or failed (``MetalQueue._host_wait``); the commands
    behind it are then committed with no GPU wait, their completions gated on the
    timeline, which fail them if it failed, as for a Metal timeline."""

    def __init__(self, backend: MetalDevice, timeline: NativeTimeline) -> None:
        if not timeline.host_raised or timeline.c_timeline is None:
            raise InvalidArgumentError(
                "a Metal queue waits on the host for a cpu or npy queue's timeline only: "
                f"not for {timeline!r}"
            )
        self._timeline = timeline
        self.c_timeline: int = timeline.c_timeline
        self._lib = backend.lib

    @property
    def value(self) -> int:
        return self._timeline.value


class MetalQueue(NativeQueue):
    def __init__(self, backend: MetalDevice, timeline: MetalTimeline) -> None:
        self._backend = backend
        self._timeline = timeline
        timeline.queue = weakref.ref(self)
        timeline.host_wait = HOST_WAIT_OWN
        # Failed, the queue settles its timeline, and the event, once the last command
        # submitted completed (objc_blocks.c, settle_failed: see _submitting).
        own = timeline.c_timeline
        backend.lib.am_metal_own(own, timeline.event, *_settle_call())
        what = "newCommandQueueWithMaxCommandBufferCount:"
        self._queue = made(send(backend.device, what, 1024, argtypes=(c_ulong,)), what)
        # One collected unclosed -- made for a new_queue that an interrupt or an error
        # stopped before anything held it -- would keep its MTLCommandQueue for good: it
        # is released then (one message, which returns at once, on whatever thread
        # collects it), by a finalizer that holds no reference of the queue. The
        # close's release runs it, once. (A queue whose own thread started is held by
        # that thread until its close.)
        self._release_dropped = weakref.finalize(self, release, self._queue)
        self._release_dropped.atexit = False  # (open devices close theirs at exit)
        self._waits: list[tuple[MetalTimeline, int]] = []  # re-encoded until reached
        # Its waits, until their value is reached: (the wait command's value, timeline,
        # target). A timeline that fails instead (its device closed while its command
        # waited) ends the GPU's wait all the same: that command and every later one
        # fail. Under _waited_lock: any thread's await takes the produced ones off and
        # looks through the rest (another's taking one off as this one looked would take
        # a failed one instead, or end the look with RuntimeError).
        self._waited: collections.deque[tuple[int, MetalTimeline | HostWait, int]] = (
            collections.deque()
        )
        self._waited_lock = threading.Lock()
        # A wait command's own value, marked by the next buffer. It, _waits and _gates
        # belong to whichever thread commits -- a submitting thread, or the worker while
        # it holds commands -- and are read and changed under _commit_lock, which is
        # also held from the choice between committing here and handing over to the
        # worker to the end of that commit or hand-over: another thread's flush (an
        # await of a command, which commits the wait it waits for) is then never half
        # way through a commit as a submission notes a wait or commits.
        self._unmarked = 0
        # The last wait not made behind a failure of the queue (_host_wait): its
        # timeline, target and command. A signal of that timeline right behind it (the
        # wait by which Queue.signal orders it after another queue's lower signal of it,
        # not committed yet) fails the timeline only once it got that target
        # (am_block.then_after), as a cuda queue's held signal does -- a value a healthy
        # queue signals is never reported failed. Under _commit_lock.
        self._order: tuple[int | None, int, int] = (None, 0, 0)
        # The waits since the last buffer: its completion raises the queue's timeline
        # only once each reached its value or failed (_blocks.set_gates).
        self._gates: list[tuple[MetalTimeline | HostWait, int]] = []
        self._wait_held = False  # a wait was handed to the worker since the last flush
        # (value, command buffer, block, record, committed behind an unreached wait)
        self._buffers: collections.deque[tuple[int, int, Any, Record, bool]] = collections.deque()
        # Held by whoever takes buffers off the list (a reap, on the loop's thread or the
        # queue's own) until it has noted what they say: another then sees that too.
        self._buffers_lock = threading.Lock()
        self._keep: KeepAlive = KeepAlive(timeline)
        # The first of its command buffers that failed -- or of its commands refused on
        # its own thread, never committed (_step_failed): it and every later one report
        # its error (another queue's commands report their own).
        self._lost: BaseException | None = None
        self._lost_from = 0
        # The queue's own thread, and what is held for it (_hand_over).
        self._worker: threading.Thread | None = None
        # (step, its arguments, the command it commits: its value, record and signal)
        self._held: queue.SimpleQueue[
            tuple[Callable[..., None], tuple[Any, ...], _Command | None] | None
        ]
        self._held = queue.SimpleQueue()
        # Commands whose step failed on the worker, and the error each fails with (kept:
        # each caller gets a copy, see _errors.keep_error).
        self._step_errors: dict[int, BaseException] = {}
        self._routed = 0  # submissions handed to the worker and not yet committed
        self._busy = False  # the worker is committing (maybe blocked in commandBuffer)
        self._dropping = False  # abandoned: what is held is dropped, not committed
        # Discarding (discard): the worker drops what it holds, from _discarded_from on,
        # then commits one empty command buffer that takes the timeline past it all.
        self._discarding = False
        self._discarded_by: str | None = None  # what dropped them (discard's why)
        self._discarded_from = 0
        self._discarded_to = 0
        self._release_later = False  # the worker releases the queue once it returns
        # Closed: nothing more is committed. An await after the close flushes (failure):
        # a wait the worker noted once an abandoning close had dropped what would have
        # committed it would go to the released MTLCommandQueue.
        self._closed = False
        # The wait the worker holds now (_host_wait), and what ends it early once set, for
        # good (am_host_wait_stop: discarding, abandoned).
        self._host_waiting: MetalTimeline | HostWait | None = None
        self._stop_host_wait = ctypes.c_int(0)
        self._lock = threading.Lock()
        # Held over a whole close: a close on another thread meanwhile waits for it (not
        # _lock, which a discard on a loop takes and must get at once); set once it ran.
        self._close_lock = threading.Lock()
        self._close_ran = False
        # The command buffers a close holds while it drains them, and those its release
        # took off the list and lets go of: kept here, a close that a KeyboardInterrupt
        # cut, run again, lets go of what is left of them (each slot cleared as it is
        # released, in C: see _close).
        self._drained: ctypes.Array[c_void_p] | None = None
        self._released: ctypes.Array[c_void_p] | None = None
        # The worker takes it once `commandBuffer` returned, which can block (1024
        # buffers in flight): a loop's flush never waits for that. A submitting thread
        # holds it through its own commit, which routing keeps under MAX_IN_FLIGHT.
        self._commit_lock = threading.RLock()
        # The last command committed (under _commit_lock): one refused after its note
        # was not (_unnote). And the commands refused that no handler will ever pass --
        # the value kept (a step refused on the worker: _step_failed), or the note kept
        # by a later one -- each mapped to a value below it to look at next (the highest
        # not among them once looked up: _unnote), and the same values in a heap, to let
        # go of those at or below the last committed (a walk stops there) as it moves.
        self._committed = 0
        self._refused: dict[int, int] = {}
        self._refused_heap: list[int] = []

    # -- submission -----------------------------------------------------------------------

    def _submit(
        self,
        value: int,
        encode: Callable[[int], None],
        keep: object = None,
        copy_back: tuple[int, int, int] | None = None,
        record: Record | None = None,
        then: tuple[int, int] | None = None,
    ) -> None:
        if not self._submitting(value, then):
            if isinstance(keep, MetalTimeline):  # (a signal's: the GPU's waits on it end)
                send(keep.event, "setSignaledValue:", MAX_VALUE, restype=None, argtypes=(c_uint64,))
            return
        record = record if record is not None else Record(value)
        try:
            with self._commit_lock:
                if self._routing(value):
                    command = _Command(value, record, then)
                    self._hand_over(
                        self._commit, value, encode, keep, copy_back, record, then, command=command
                    )
                    return
                self._commit(value, encode, keep, copy_back, record, then)
        except KeyboardInterrupt:
            raise
        except BaseException:
            self._unnote(value)
            raise

    def _submitting(self, value: int, then: tuple[int, int] | None = None) -> bool:
        """Note command ``value`` as submitted: a failed queue settles only once it
        completed (objc_blocks.c, settle_failed). False if the queue settled already: the
        command is not committed -- its timeline is past it, and it fails by what failed
        the queue (``failure``: the failed wait before it, or ``_lost``) -- and a timeline
        it signals (``then``) fails so (am_metal_submitting)."""
        signalled, target = then if then is not None else (None, 0)
        own = self._timeline.c_timeline
        return bool(self._backend.lib.am_metal_submitting(own, value, signalled, target))

    def _unnote(self, value: int, fail: bool = False) -> None:
        """Command ``value``, noted by _submitting, was refused before its commit (or its
        hand-over) -- a nil command buffer or encoder, an error encoding, a worker that
        did not start: unless it was committed, the note is taken back (its number goes
        back to the queue), and a failed queue whose handlers all ran settles now
        (am_metal_unsubmitting) rather than wait for a handler of it. Taken back to the
        highest value below it that a handler passes, below every command refused
        before it that none passes: those whose values were kept (``fail``), and those
        whose notes a later one kept (this one, or one still to commit: then this one is
        skipped so in turn) -- so the note stands, after any sequence of refusals, at a
        value some handler passes. ``fail``: its value is never given back (the command
        was handed over), so the queue fails from it on (_step_failed). Called from each
        site's ``except BaseException`` (a plain try costs nothing on the hot path; a
        context manager's generator about a microsecond a command) -- but not on an
        interrupt: the queue hands ``value`` over again (Queue._interrupted), and a
        hand-over it cut may be held already."""
        with self._commit_lock:
            committed = self._committed
            if committed == value:
                return
            refused, heap = self._refused, self._refused_heap
            while heap and heap[0] <= committed:  # (each let go of once: amortised O(log n))
                del refused[heapq.heappop(heap)]
            # The highest value below it that a handler passes: the timeline's note goes
            # no lower than that, and never to a value none passes (the queue would wait
            # for it for good). Each value looked past points at the one found (path
            # compression): a run of refusals is walked once, not once a refusal.
            to, past = value - 1, list[int]()
            while to in refused:
                past.append(to)
                to = refused[to]
            for skipped in past:
                refused[skipped] = to
            own = self._timeline.c_timeline
            taken = self._backend.lib.am_metal_unsubmitting(own, value, to, fail)
            if (fail or not taken) and value not in refused:
                refused[value] = to
                heapq.heappush(heap, value)

    def _routing(self, value: int) -> bool:
        """Whether command ``value`` is committed from the queue's own thread, in order:
        it holds earlier submissions, or `commandBuffer` would block."""
        return bool(self._routed) or value - 1 - self._timeline.value >= MAX_IN_FLIGHT

    def _commit(
        self,
        value: int,
        encode: Callable[[int], None],
        keep: object,
        copy_back: tuple[int, int, int] | None,
        record: Record,
        then: tuple[int, int] | None,
        hand: bool = True,
    ) -> None:
        # The command buffer and its encoders are autoreleased: without a pool they would
        # stay alive until this thread exits (the loop's thread: never).
        with autorelease_pool():
            self._encode_and_commit(value, encode, keep, copy_back, record, then, hand)

    def _hand_over(
        self, step: Callable[..., None], *args: Any, command: _Command | None = None
    ) -> None:
        """Run ``step(*args)`` on the queue's own thread, after what it was handed before
        (committing ``command``, which fails with the step's error if it raises)."""
        if self._worker is None:
            # A daemon: blocked in `commandBuffer` behind a wait nobody signals, it must
            # not hold up the interpreter's exit (nor a close that abandons the queue).
            self._worker = threading.Thread(target=self._work, name="asyncmetal-metal", daemon=True)
            self._worker.start()
        with self._lock:
            self._routed += 1
        self._held.put((step, args, command))

    def _work(self) -> None:
        while (item := self._held.get()) is not None:
            step, args, command = item
            with self._lock:
                run = self._busy = not self._dropping
            if run and self._discarding and step != self._end_discard:
                run = False
                self._drop(step, args, command)
            try:
                if run:
                    try:
                        step(*args)
                    except Exception as exc:
                        if command is None:
                            raise
                        self._step_failed(command, exc)
            except Exception as exc:  # reported as a thread's own; the queue goes on
                thread = threading.current_thread()
                threading.excepthook(
                    threading.ExceptHookArgs((type(exc), exc, exc.__traceback__, thread))
                )
            finally:
                with self._lock:
                    self._busy = False
                    self._routed -= 1
                # Not kept while the next is awaited: a command's record refers to its
                # Queue, which, dropped, is let go of only once collected.
                del item, step, args, command
        with self._lock:
            release = self._release_later
        if release:
            self._release()

    def discard(self, why: str) -> None:
        """Drop what the worker holds (the commands past the bound in flight, and those
        behind them): committed ones run."""
        with self._lock:
            self._discarded_by = self._discarded_by or why
            if self._discarding or self._dropping or not self._routed:
                return  # (nothing held: everything was committed)
            self._discarding = True
            waiting = self._host_waiting
        self._stop_waiting(waiting)  # (held there, a wait is dropped: see _host_wait)
        self._hand_over(self._end_discard)

    def _stop_waiting(self, waiting: MetalTimeline | HostWait | None) -> None:
        """End the worker's wait for ``waiting``'s timeline, and any it starts later."""
        if waiting is not None:
            flag = ctypes.byref(self._stop_host_wait)
            self._backend.lib.am_host_wait_stop(waiting.c_timeline, flag)
        else:
            self._stop_host_wait.value = 1  # (read under the lock by _host_wait first)

    def _drop(
        self, step: Callable[..., None], args: tuple[Any, ...], command: _Command | None
    ) -> None:
        """On the worker, discarding: a held step is dropped. A command's signal fails
        its timeline; a held wait is not encoded (nothing after it runs). A signal right
        behind a dropped wait on its timeline (the wait by which Queue.signal orders it
        after another queue's lower signal of it, not committed yet: held for it) fails
        the timeline only once it got that value (am_timeline_fail_after), as a failed
        signal's handler does (_order): a value a queue that did not fail signals is
        never reported failed."""
        value = command.value if command is not None else 0
        if step in (self._hold_wait, self._host_wait):
            value = args[2]
            if isinstance(args[0], MetalTimeline):
                with self._commit_lock:
                    self._order = (args[0].c_timeline, args[1], value)
        if not value:
            return  # (a flush: its wait's value is dropped already)
        self._discarded_from = self._discarded_from or value
        self._discarded_to = max(self._discarded_to, value)
        if command is not None and command.then is not None:
            target_timeline, target = command.then
            ordered, below, at = self._order
            after = below if at == value - 1 and ordered == target_timeline else 0
            self._backend.lib.am_timeline_fail_after(
                target_timeline, after, target, AM_DISCARDED, value, self._timeline.c_timeline
            )
            signalled = args[2]  # (a signal's keep: its timeline, see signal)
            if after:
                # (no GPU wait on it past `after`: nothing committed signals it that far,
                # and the lower signal's own buffer raises its event)
                return
            if isinstance(signalled, MetalTimeline):  # the GPU's waits on it end too
                send(
                    signalled.event,
                    "setSignaledValue:",
                    MAX_VALUE,
                    restype=None,
                    argtypes=(c_uint64,),
                )

    def _end_discard(self) -> None:
        """After the dropped steps: one empty command buffer, with none of the waits held
        before, takes the queue's timeline through their values."""
        if not self._discarded_to:
            # Nothing was dropped: a wait held as the discard came got ready first, with
            # nothing behind it, and was noted (_host_wait). Its value is marked as a
            # flush marks it -- the flush asked for it since was dropped (_drop).
            self._flush_held()
        else:
            with self._commit_lock:
                if self._unmarked:  # a wait run before, still to be encoded: dropped too
                    self._discarded_from = min(self._discarded_from, self._unmarked)
                self._waits, self._gates, self._unmarked = [], [], 0
            value, first = self._discarded_to, self._discarded_from
            own = self._timeline.c_timeline
            self._backend.lib.am_timeline_fail_from(own, first, AM_DISCARDED, first, own)
            # Its value is not handed to other queues' GPU waits: a staged copy to the
            # host before it whose handler has not run yet (the discard ended the wait
            # for it, see _staged_copyout) would be handed with it. The values it takes
            # the timeline through failed already: waits for them are ready.
            self._commit(value, lambda cb: None, None, None, Record(value), None, hand=False)

    def _step_failed(self, command: _Command, error: BaseException) -> None:
        """The worker's step for ``command`` raised: the command fails with ``error``. An
        empty command buffer takes its place, so that the queue's timeline still gets
        there in order (with the waits it was to carry); a timeline it was to signal
        fails. That commit refused too (a nil command buffer), no handler of the command
        runs: its note is taken back, as a refusal at submission's is (_unnote), the
        queue fails from it on (its value, which the queue keeps, is produced by nothing
        else), and the timeline it was to signal fails all the same."""
        value, record, then = command
        self._step_errors[value] = keep_error(error)
        try:
            self._commit(value, lambda cb: None, None, None, record, None)
        except BaseException as refused:
            # Nothing produces its value now: the queue fails from it on, as from a
            # command buffer that failed -- later commands report why (a fault before it,
            # noted by a later reap, comes first: _note_status).
            with self._buffers_lock:
                if self._lost is None or value < self._lost_from:
                    # (a copy: the refusal itself is raised on, with its traceback)
                    self._lost, self._lost_from = keep_error(fresh_error(refused)), value
            self._unnote(value, fail=True)
            raise
        finally:
            if then is not None:
                self._backend.lib.am_timeline_fail(
                    then[0], then[1], AM_COMMAND_FAILED, value, self._timeline.c_timeline
                )

    def _encode_and_commit(
        self,
        value: int,
        encode: Callable[[int], None],
        keep: object,
        copy_back: tuple[int, int, int] | None,
        record: Record,
        then: tuple[int, int] | None,
        hand: bool = True,
    ) -> None:
        cb = made(send(self._queue, "commandBuffer"), "commandBuffer")
        retain(cb)
        if self._dropping:  # abandoned while this waited in commandBuffer
            release(cb)
            return
        with self._commit_lock:
            try:
                still, block = self._encode(cb, value, encode, copy_back, then, hand)
            except BaseException:
                release(cb)  # never committed (its waits are carried by the next one)
                raise
            self._waits = still
            entry = (value, cb, block, record, bool(still))
            with self._buffers_lock:
                self._buffers.append(entry)
            self._keep.add(value, (keep, block))
            self._unmarked = 0
            self._gates = []
        if self._dropping:  # abandoned while this was encoded: close may not have seen it
            self._disarm([entry])
        if len(self._buffers) > 256:
            self._reap()

    def _encode(
        self,
        cb: int,
        value: int,
        encode: Callable[[int], None],
        copy_back: tuple[int, int, int] | None,
        then: tuple[int, int] | None,
        hand: bool = True,
    ) -> tuple[list[tuple[MetalTimeline, int]], Any]:
        """Encode command ``value`` into ``cb`` after the waits not reached yet, and
        commit it; returns those waits and its completion handler's block. ``hand``:
        other queues' waits for ``value`` may go to the GPU once it is committed."""
        still = []
        for timeline, target in self._waits:
            if timeline.device_value() < target:
                send(
                    cb,
                    "encodeWaitForEvent:value:",
                    timeline.event,
                    target,
                    restype=None,
                    argtypes=(c_void_p, c_uint64),
                )
                still.append((timeline, target))
        encode(cb)
        send(
            cb,
            "encodeSignalEvent:value:",
            self._timeline.event,
            value,
            restype=None,
            argtypes=(c_void_p, c_uint64),
        )
        block = _blocks.make_block(
            self._backend.block_isa, _blocks.COMPLETED_SIGNATURE, self._timeline.c_timeline, value
        )
        if copy_back is not None:
            block.copy_dst, block.copy_src, block.copy_nbytes = copy_back
        if then is not None:
            block.then, block.then_value = then
            ordered, below, at = self._order
            if at == value - 1 and ordered == then[0]:
                block.then_after = below
        # Its handler asks the command buffer's status and notes the queue's first that
        # failed: a signal of a failed one, or of one after it, fails its timeline
        # rather than raising it.
        block.status_send, block.status_selector = _status_call()
        if self._gates:
            # (the host waits among them hold their timelines, which the handler reads)
            hosts = [wait for wait, _ in self._gates if isinstance(wait, HostWait)]
            _blocks.set_gates(block, [(w.c_timeline, v) for w, v in self._gates], hosts)
        send(cb, "addCompletedHandler:", ctypes.addressof(block), restype=None)
        send(cb, "commit", restype=None)
        self._committed = value
        # Waits for what it signals go to the GPU from now on (those held go on) -- not
        # for a copy whose bytes its handler moves to the host (see _staged_copyout),
        # nor where ``hand`` is False (see _end_discard).
        if copy_back is None and hand:
            self._backend.lib.am_signal_committed(self._timeline.c_timeline, value)
        if then is not None:
            self._backend.lib.am_signal_committed(*then)
        return still, block

    def flush(self) -> None:
        """Commit a wait command that no later command carried yet (before parking).
        From any thread (an await of a command calls it)."""
        with self._commit_lock:
            if self._closed:
                return
            if self._routed:
                if self._wait_held:  # the worker's to commit, after what it holds
                    self._wait_held = False
                    self._hand_over(self._flush_held)
            elif self._unmarked:
                self._submit(self._unmarked, lambda cb: None)

    def _flush_held(self) -> None:
        if self._unmarked:
            self._commit(self._unmarked, lambda cb: None, None, None, Record(self._unmarked), None)

    def _reap(self) -> None:
        """Release the command buffers that completed, noting the first that failed."""
        with self._buffers_lock:
            buffers, reached = self._buffers, self._timeline.value
            while buffers and buffers[0][0] <= reached:
                done_value, cb, _, record, _ = buffers.popleft()
                start = send(cb, "GPUStartTime", restype=ctypes.c_double)
                end = send(cb, "GPUEndTime", restype=ctypes.c_double)
                record._start_ns, record._end_ns = int(start * 1e9), int(end * 1e9)
                self._note_status(done_value, cb)
                release(cb)
        _blocks.release_ran()

    def _note_status(self, value: int, cb: int) -> None:
        """Note command buffer ``cb`` (of command ``value``) if it is the first that
        failed: it and every later command report its error. Under _buffers_lock."""
        status = send(cb, "status", restype=c_ulong)
        if status == STATUS_ERROR and (self._lost is None or value < self._lost_from):
            error = describe_error(send(cb, "error"))
            self._lost = DeviceLostError(f"a Metal command buffer failed: {error}")
            self._lost_from = value

    def failure(self, value: int) -> BaseException | None:
        self.flush()
        self._reap()
        if self._step_errors and value in self._step_errors:
            return fresh_error(self._step_errors[value])
        if self._discarded_from and value >= self._discarded_from:
            return discarded_error(value, self._discarded_by or QUEUE_DISCARDED)
        if self._lost is not None and value >= self._lost_from:
            return fresh_error(self._lost)
        waited = self._waited
        if not waited:  # (a wait submitted meanwhile comes after `value`, reached)
            return None
        with self._waited_lock:
            self._drop_produced(waited)
            for at, timeline, target in waited:
                if at > value:
                    break
                failure = timeline.failure(target)
                if failure is not None:
                    lead = "this command ran after a device-side wait for a value that"
                    return failure_error(failure, lead, LATER_FAIL)
        return None

    @staticmethod
    def _drop_produced(
        waited: collections.deque[tuple[int, MetalTimeline | HostWait, int]],
    ) -> None:
        """Take off the waits whose value was produced: nothing after them can fail by
        them (under _waited_lock)."""
        while (
            waited and waited[0][1].value >= waited[0][2] and not waited[0][1].failure(waited[0][2])
        ):
            waited.popleft()

    def fails_later(self) -> bool:
        waited = self._waited
        if not waited:
            return False
        with self._waited_lock:
            self._drop_produced(waited)
            return any(timeline.failure(target) is not None for _, timeline, target in waited)

    # -- commands -------------------------------------------------------------------------

    def launch(
        self,
        program: MetalKernel,
        args: Sequence[Arg],
        global_size: tuple[int, int, int],
        local_size: tuple[int, int, int],
        value: int,
        record: Record,
    ) -> None:
        # Each value's bytes (the low ones of its slot: Metal's GPUs are little-endian)
        # and their number, its type's size: setBytes copies them into the argument
        # table, aligned as the kernel's parameter type.
        # Metal's validation aborts the process on a dispatch beyond either limit: refused
        # here, before the command has a command buffer.
        most = self._backend.max_threadgroup
        for i, axis in enumerate("xyz"):
            if local_size[i] > most[i]:
                raise InvalidArgumentError(
                    f"local_size {local_size} has {local_size[i]} threads in {axis}; a "
                    f"threadgroup takes at most {most[i]} "
                    f"(the device's maxThreadsPerThreadgroup.{_MTLSIZE_FIELDS[i]})"
                )
        threads = local_size[0] * local_size[1] * local_size[2]
        if threads > program.max_threads:
            raise InvalidArgumentError(
                f"local_size {local_size} makes {threads} threads per threadgroup; kernel "
                f"{program.name!r} takes at most {program.max_threads} "
                "(its pipeline's maxTotalThreadsPerThreadgroup)"
            )
        values = [_value_bytes(a.value) for a in args if a.value is not None]
        indices = program.bindings or range(len(args))

        def encode(cb: int) -> None:
            encoder = made(send(cb, "computeCommandEncoder"), "computeCommandEncoder")
            send(encoder, "setComputePipelineState:", program.pipeline, restype=None)
            pending = iter(values)
            for index, (handle, offset, val) in zip(indices, args, strict=True):
                if val is None:
                    send(
                        encoder,
                        "setBuffer:offset:atIndex:",
                        handle,
                        offset,
                        index,
                        restype=None,
                        argtypes=(c_void_p, c_ulong, c_ulong),
                    )
                else:
                    v, size = next(pending)
                    send(
                        encoder,
                        "setBytes:length:atIndex:",
                        ctypes.addressof(v),
                        size,
                        index,
                        restype=None,
                        argtypes=(c_void_p, c_ulong, c_ulong),
                    )
            send(
                encoder,
                "dispatchThreads:threadsPerThreadgroup:",
                MTLSize(*global_size),
                MTLSize(*local_size),
                restype=None,
                argtypes=(MTLSize, MTLSize),
            )
            send(encoder, "endEncoding", restype=None)

        self._submit(value, encode, (args, values), record=record)

    def signal(self, timeline: NativeTimeline, target: int, value: int, record: Record) -> None:
        assert isinstance(timeline, MetalTimeline)

        def encode(cb: int) -> None:
            send(
                cb,
                "encodeSignalEvent:value:",
                timeline.event,
                target,
                restype=None,
                argtypes=(c_void_p, c_uint64),
            )

        # Host awaiters of `timeline` hear of it from this command's completion handler.
        self._submit(value, encode, timeline, record=record, then=(timeline.c_timeline, target))

    def wait(self, timeline: NativeTimeline, target: int, value: int, record: Record) -> None:
        # A Metal timeline's event, which the GPU waits on once a command buffer that
        # signals it that far was committed; or another kind's queue timeline (a cpu or
        # npy queue's, waited for across kinds: see HostWait). Until then the wait is
        # held on the queue's own thread, with what comes after it, so that a discard
        # drops it all rather than wait for a value nothing may ever signal.
        if isinstance(timeline, MetalTimeline):
            waited: MetalTimeline | HostWait = timeline
        else:
            waited = HostWait(self._backend, timeline)
        if not self._submitting(value):
            return
        try:
            self._wait(waited, target, value)
        except KeyboardInterrupt:
            raise
        except BaseException:
            self._unnote(value)
            raise

    def _wait(self, waited: MetalTimeline | HostWait, target: int, value: int) -> None:
        held = not waited.ready(target)
        with self._waited_lock:
            self._waited.append((value, waited, target))
        with self._commit_lock:
            if held:  # what comes after it is held with it
                self._wait_held = True
                self._hand_over(self._host_wait, waited, target, value)
            elif self._routed:  # after the commands the worker holds, not into them
                self._wait_held = True
                self._hand_over(self._hold_wait, waited, target, value)
            else:
                self._hold_wait(waited, target, value)

    def _host_wait(self, wait: MetalTimeline | HostWait, target: int, value: int) -> None:
        """On the queue's own thread: hold what was submitted after wait ``value`` until
        the wait is ready (``wait.ready``) -- then the commands behind it are committed
        after it -- or the queue discards (the wait is dropped, and so is what follows
        it) or is abandoned (nothing more is committed), or a command before it is known
        to have failed (the wait is not made: what follows it is committed, and fails).
        Waits held before it, whose values were reached, are marked first: their
        completions do not wait for this one (as on a queue whose waits run one after
        another)."""
        behind = self._failed_before(value)
        if not behind:
            flush = not wait.ready(target)
            discarding = self._park(wait, target, wait.host_wait, flush=flush, behind=value)
            if not wait.ready(target):
                if discarding:
                    self._drop(self._hold_wait, (wait, target, value), None)
                    return
                behind = not self._stop_host_wait.value and self._failed_before(value)
                if not behind:
                    return
        if behind:
            # Behind a failure of the queue nothing after the wait is produced: it is not
            # made (what it waits for may never come, and would hold the commands behind
            # it, and the queue's settle, for good). Its value is marked by the next
            # buffer, whose handler fails it, and those after it, by the queue's failure.
            with self._commit_lock:
                self._unmarked = value
                self._order = (wait.c_timeline, target, value)
            return
        self._hold_wait(wait, target, value)

    def _failed_before(self, value: int) -> bool:
        """On the queue's own thread: whether a command before ``value`` is known to have
        failed -- its own timeline failed (a command buffer's handler found a fault, or a
        wait that failed before it), or a wait before it was for a value never produced
        -- so that nothing from ``value`` on is produced. (Not a discard's failure: the
        worker drops what it holds then.)"""
        failure = _native.timeline_failure(self._timeline.c_timeline)
        if failure is not None and failure.first < value and failure.error != AM_DISCARDED:
            return True
        with self._waited_lock:
            self._drop_produced(self._waited)
            return any(
                at < value and timeline.failure(target) is not None
                for at, timeline, target in self._waited
            )

    def _hold_wait(self, timeline: MetalTimeline | HostWait, target: int, value: int) -> None:
        # A Metal timeline's wait is encoded at the head of the next command buffer, with
        # the work that depends on it (another kind's value is there already: nothing
        # for the GPU to wait for); the completion of that buffer is gated on it. This
        # command's own value is marked by that buffer (or by flush()).
        with self._commit_lock:
            if isinstance(timeline, MetalTimeline):
                self._waits.append((timeline, timeline.gpu_target(target)))
            self._gates.append((timeline, target))
            self._unmarked = value

    def _blit(
        self,
        value: int,
        dst: tuple[int, int],
        src: tuple[int, int],
        nbytes: int,
        keep: object,
        record: Record,
    ) -> None:
        self._submit(value, _blit_encoder(dst, src, nbytes), keep, None, record)

    def copy(
        self, dst: Arg, src: Arg, nbytes: int, value: int, record: Record, peer: Any = None
    ) -> None:
        source: tuple[int, int] = (src.handle, src.offset)
        keep: list[object] = [dst, src]
        if peer is not None:  # another Metal device: wrap its shared memory here
            base = send(src.handle, "contents")
            length = send(src.handle, "length", restype=c_ulong)
            wrapped, delta = self._backend.wrap_pages(base, length)
            keep.append(_Owned(wrapped))
            source = (wrapped, delta + src.offset)
        self._blit(value, (dst.handle, dst.offset), source, nbytes, keep, record)

    def fill(
        self, dst: Arg, nbytes: int, pattern: int, size: int, value: int, record: Record
    ) -> None:
        # A blit fill writes one byte: a wider pattern reached here as one byte repeated
        # (Backend.fill_patterns), over whole words (fill_alignment).
        byte = ctypes.c_uint8(pattern & 0xFF)
        span = NSRange(dst.offset, nbytes)

        def encode(cb: int) -> None:
            blit = made(send(cb, "blitCommandEncoder"), "blitCommandEncoder")
            send(
                blit,
                "fillBuffer:range:value:",
                dst.handle,
                span,
                byte,
                restype=None,
                argtypes=(c_void_p, NSRange, ctypes.c_uint8),
            )
            send(blit, "endEncoding", restype=None)

        self._submit(value, encode, dst, None, record)

    def copyin(self, dst: Arg, src: memoryview, value: int, record: Record) -> None:
        # The source is read in place by the blit, through a buffer over its pages:
        # nothing is copied on the submitting thread, and the source is not staged (it is
        # kept until done). Only one Metal will not wrap is copied now.
        address, keep = host_address(src)
        wrapped = self._backend.wrap_pages(address, src.nbytes, check=False)
        if wrapped is None:  # staged on the queue's own thread, in turn (_staged_copyin)
            if not self._submitting(value):
                return
            command = _Command(value, record, None)
            try:
                with self._commit_lock:
                    self._hand_over(self._staged_copyin, dst, src, command, command=command)
            except KeyboardInterrupt:
                raise
            except BaseException:
                self._unnote(value)
                raise
            return
        self._blit(
            value,
            (dst.handle, dst.offset),
            wrapped,
            src.nbytes,
            (keep, src, _Owned(wrapped[0])),
            record,
        )

    def _staged_copyin(self, dst: Arg, src: memoryview, command: _Command) -> None:
        """On the queue's own thread, a copy from host memory Metal will not wrap: its
        bytes go to a staging buffer the blit reads once every command before the copy
        ran -- among them the waits for what writes that memory (a cpu queue's copy
        into a cpu buffer, a Metal queue's into it), which taking them at submission
        would have read before."""
        value, record, _ = command
        if not self._until_ran(value - 1):
            with self._lock:
                discarding = self._discarding
            if discarding:
                self._drop(self._staged_copyin, (dst, src, command), command)
            return
        address, keep = host_address(src)
        # (nil raised as an asyncmetal error: the step's error is what the awaiting
        # task gets, _step_failed)
        staging = made(
            send(
                self._backend.device,
                "newBufferWithBytes:length:options:",
                address,
                src.nbytes,
                STORAGE_SHARED,
                argtypes=(c_void_p, c_ulong, c_ulong),
            ),
            f"newBufferWithBytes: of {src.nbytes} bytes (a copy's staging)",
        )
        self._commit(
            value,
            _blit_encoder((dst.handle, dst.offset), (staging, 0), src.nbytes),
            (keep, src, dst, _Owned(staging)),
            None,
            record,
            None,
        )

    def _until_ran(self, target: int) -> bool:
        """On the queue's own thread: wait until the queue's own timeline got to
        ``target`` or failed for it (its commands up to ``target`` ran), committing first
        a wait command that no buffer carries yet. False if the queue discards or is
        abandoned first (which ends the wait)."""
        own = self._timeline
        if target <= 0 or own.value >= target:
            return True
        self._park(own, target, HOST_WAIT_REACHED, flush=True)
        return bool(
            self._backend.lib.am_host_wait(own.c_timeline, target, HOST_WAIT_REACHED, None, 0)
        )

    def _park(
        self,
        wait: MetalTimeline | HostWait,
        target: int,
        mode: int,
        *,
        flush: bool,
        behind: int = 0,
    ) -> bool:
        """On the queue's own thread: wait until ``wait`` (``mode``: how, HOST_WAIT_*) got
        to ``target``, or the queue discards or is abandoned, or (``behind``: the value of
        the wait held, 0: none) a command before ``behind`` is known to have failed --
        committing first, where ``flush``, the wait commands no buffer carries yet.
        Returns whether the queue was discarding once the wait ended."""
        if flush:
            try:
                self._flush_held()
            except Exception as exc:  # (its mark is then carried by the next buffer)
                thread = threading.current_thread()
                threading.excepthook(
                    threading.ExceptHookArgs((type(exc), exc, exc.__traceback__, thread))
                )
        with self._lock:
            stop = self._discarding or self._dropping
            self._host_waiting = None if stop else wait
        flag = ctypes.byref(self._stop_host_wait)
        lib, own = self._backend.lib, self._timeline.c_timeline
        # The count of the queue's failed commands looked at (am_metal_host_wait): one
        # that fails as the wait is held wakes it, to look again before the nap ends.
        # (0: the first wait ends at once if any failed ever, and the look follows.)
        seen = ctypes.c_uint64(0)
        try:
            while (
                not stop
                and not self._flush_waited(wait)
                and not (behind and self._failed_before(behind))
                and not (
                    lib.am_metal_host_wait(
                        own,
                        ctypes.byref(seen),
                        wait.c_timeline,
                        target,
                        mode,
                        flag,
                        HOST_WAIT_NAP_NS,
                    )
                    if behind
                    else lib.am_host_wait(wait.c_timeline, target, mode, flag, HOST_WAIT_NAP_NS)
                )
            ):
                stop = bool(self._stop_host_wait.value)
        finally:
            with self._lock:
                self._host_waiting = None
                discarding = self._discarding
        return discarding

    def _flush_waited(self, wait: MetalTimeline | HostWait) -> bool:
        """Where ``wait`` is another Metal queue's own timeline, have that queue commit
        a wait command of its that no buffer carries yet (``flush``): its value is
        marked only by its next buffer, or by a flush, and this wait may be all that
        waits for it. Asked again after each nap, for a value submitted meanwhile.
        Returns False (the wait goes on): a flush that fails (a nil command buffer) is
        reported and asked again after the nap, as the park's own first one is -- its
        error leaving the park would drop this queue's wait."""
        queue = wait.queue() if isinstance(wait, MetalTimeline) and wait.queue else None
        if queue is not None and queue is not self:
            try:
                queue.flush()
            except Exception as exc:
                thread = threading.current_thread()
                threading.excepthook(
                    threading.ExceptHookArgs((type(exc), exc, exc.__traceback__, thread))
                )
        return False

    def copyout(self, dst: memoryview, src: Arg, value: int, record: Record) -> None:
        # The destination is written in place by the blit, through a buffer over its
        # pages (as a source is read, see copyin): the bytes are there once the GPU ran
        # the command, which is when the GPU goes on with what is ordered after it -- on
        # this queue, or on another whose wait on this queue's event it satisfies --
        # while the command's completion handler may run much later. So a copy into a
        # cpu buffer's memory is seen by a Metal copy of that buffer ordered after it.
        address, keep = host_address(dst)
        wrapped = self._backend.wrap_pages(address, dst.nbytes, check=False)
        if wrapped is not None:
            self._blit(
                value,
                wrapped,
                (src.handle, src.offset),
                dst.nbytes,
                (keep, dst, src, _Owned(wrapped[0])),
                record,
            )
            return
        # Memory Metal will not wrap: blit into a shared staging buffer (the blit is
        # ordered after earlier work on `src` by Metal's hazard tracking, and before
        # later work on it); the completion handler itself then moves the bytes to the
        # host array, natively, before it raises the timeline (_staged_copyout).
        if not self._submitting(value):
            return
        command = _Command(value, record, None)
        try:
            with self._commit_lock:
                self._hand_over(self._staged_copyout, dst, src, command, command=command)
        except KeyboardInterrupt:
            raise
        except BaseException:
            self._unnote(value)
            raise

    def _staged_copyout(self, dst: memoryview, src: Arg, command: _Command) -> None:
        """On the queue's own thread, a copy to host memory Metal will not wrap, through
        a staging buffer (as large: made here, not on the loop's thread) whose bytes the
        completion handler moves to the host. The GPU goes on with what follows a
        command buffer before its handler runs: so nothing after the copy is committed
        until the handler ran (this thread waits for it), and the copy's value is not
        handed to other queues' GPU waits (their waits for it are held on their
        threads until the handler raised it), so that what is ordered after the copy
        sees its bytes."""
        value, record, _ = command
        staging = made(
            send(
                self._backend.device,
                "newBufferWithLength:options:",
                dst.nbytes,
                STORAGE_SHARED,
                argtypes=(c_ulong, c_ulong),
            ),
            f"newBufferWithLength: of {dst.nbytes} bytes (a copy's staging)",
        )
        self._commit(
            value,
            _blit_encoder((staging, 0), (src.handle, src.offset), dst.nbytes),
            (dst, src, _Owned(staging)),
            (host_address(dst)[0], send(staging, "contents"), dst.nbytes),
            record,
            None,
        )
        self._until_ran(value)  # (a discard or abandon ends it: what follows is dropped)

    def close(self, abandon: bool = False) -> None:
        """(See NativeQueue.close.) It runs once: a close under way on another thread is
        waited for, as it ends (with its ``abandon``), and a later one returns at once --
        the MTLCommandQueue and the command buffers are released once. An abandoning
        close meanwhile waits for a plain one too, even one held up by a wait that
        nothing signals (the plain one waits there on the queue's own thread and in
        ``waitUntilCompleted``, which nothing cuts short). The device never closes a
        queue twice at once: its own close (at exit too, abandoning) first joins the
        release threads that close queues."""
        with self._close_lock:
            # Released once _close's last call (_release) ran: its finalizer is dead
            # then. A KeyboardInterrupt from there on, before _close_ran is set (a
            # Ctrl-C as the device's close runs at exit, which runs this again), leaves
            # nothing to run again; one before runs all of _close again (each release
            # in it takes what it releases first). (One whose release _close left to
            # the worker is noted ran as _close returns.) That release, on the worker,
            # may end as this thread still drains: an interrupt there before the drain
            # let go of its holds leaves them in _drained, let go of here then.
            if not self._close_ran:
                if self._release_dropped.alive:
                    self._close(abandon)
                elif (held := self._drained) is not None:
                    msgsend, _, _, release_sel = _settle_call()
                    self._backend.lib.am_metal_release_each(held, len(held), msgsend, release_sel)
            self._close_ran = True

    def _close(self, abandon: bool) -> None:
        with self._commit_lock:
            self.flush()
            self._closed = True
        later = False
        if self._worker is not None:
            with self._lock:
                # Abandoned, what is still held is dropped (the device reports it as
                # never run). A commit under way may be blocked in `commandBuffer` by
                # buffers held by a wait that ends only after this close (or never, at
                # exit): the worker releases the queue itself once that returns.
                self._dropping = abandon
                later = self._release_later = abandon and self._busy
                waiting = self._host_waiting
            if abandon:
                self._stop_waiting(waiting)
            self._held.put(None)
            if not later:
                self._worker.join()
        # Left to the worker, the buffers are released by it once its commit returns --
        # which the buffers drained here completing may let it do meanwhile: each is
        # held here while it is drained. The holds are taken, and let go of, in C, with
        # no Python code between a hold and its record in _drained: a KeyboardInterrupt
        # anywhere here (a Ctrl-C as the device's close runs at exit, which runs this
        # again) leaves each buffer held once, or not at all -- and the next run lets go
        # of what it held first.
        lib = self._backend.lib
        msgsend, _, retain_sel, release_sel = _settle_call()
        held = self._drained
        if held is not None:
            lib.am_metal_release_each(held, len(held), msgsend, release_sel)
        with self._buffers_lock:
            buffers = list(self._buffers)
            cbs = (c_void_p * len(buffers))(*[cb for _, cb, _, _, _ in buffers])
            held = self._drained = (c_void_p * len(buffers))()
            lib.am_metal_retain_into(cbs, held, len(buffers), msgsend, retain_sel)
        try:
            for at, (_, cb, _, _, blocked) in enumerate(buffers):
                # At exit (abandon) drain what can complete, so no handler fires during
                # finalization; stop at the first buffer held by a wait nothing may
                # signal (buffers of a queue complete in order).
                if abandon and blocked:
                    self._disarm(buffers[at:])
                    break
                send(cb, "waitUntilCompleted", restype=None)
        finally:
            lib.am_metal_release_each(held, len(held), msgsend, release_sel)
        if not later:
            self._release()

    def _disarm(self, held: list[tuple[int, int, Any, Record, bool]]) -> None:
        """Commands reported as never run, whose buffers may still run once their wait
        ends: their handlers copy nothing to the host, and what they use outlives the
        queue until they ran."""
        kept = self._keep.by_value()
        for value, _, block, _, _ in held:
            _blocks.hold_until_run(block, kept.get(value), disarm=True)

    def _release(self) -> None:
        # Those completed and not reaped yet say whether they failed first: a command
        # awaited after the close reports its fault (a reap finds none of them then).
        # Then they go off the list into _released, which lets go of each once, in C: a
        # KeyboardInterrupt anywhere here (the close run again: see _close) leaves each
        # listed still, or in _released, or released.
        lib = self._backend.lib
        msgsend, _, _, release_sel = _settle_call()
        left = self._released
        if left is not None:
            lib.am_metal_release_each(left, len(left), msgsend, release_sel)
        with self._buffers_lock:
            buffers = self._buffers
            for value, cb, _, _, _ in buffers:
                self._note_status(value, cb)
            if buffers:
                cbs = [cb for _, cb, _, _, _ in buffers]
                left = self._released = (c_void_p * len(cbs))(*cbs)
                buffers.clear()
        if left is not None:
            lib.am_metal_release_each(left, len(left), msgsend, release_sel)
        self._release_dropped()  # (the MTLCommandQueue)


def _value_bytes(value: int | Scalar) -> tuple[ctypes.c_int64, int]:
    """A launch value's slot, and how many of its bytes its type has."""
    if isinstance(value, int):
        return ctypes.c_int64(value), 4  # an int32
    return ctypes.c_int64(value.bits), SIZES[value.type]


def _blit_encoder(dst: tuple[int, int], src: tuple[int, int], nbytes: int) -> Callable[[int], None]:
    """What encodes a blit of ``nbytes`` from ``src`` to ``dst`` (buffer, offset)."""

    def encode(cb: int) -> None:
        blit = made(send(cb, "blitCommandEncoder"), "blitCommandEncoder")
        send(
            blit,
            "copyFromBuffer:sourceOffset:toBuffer:destinationOffset:size:",
            src[0],
            src[1],
            dst[0],
            dst[1],
            nbytes,
            restype=None,
            argtypes=(c_void_p, c_ulong, c_void_p, c_ulong, c_ulong),
        )
        send(blit, "endEncoding", restype=None)

    return encode


class _Command(NamedTuple):
    """A command a step on the queue's own thread commits: its value, its record, and
    the timeline value its command buffer signals (native timeline, target), if any."""

    value: int
    record: Record
    then: tuple[int, int] | None


class _Owned:
    """An Objective-C object released when the last command holding it is dropped."""

    def __init__(self, obj: int) -> None:
        self.obj = obj

    def __del__(self) -> None:
        # (None made where __init__ was interrupted before it got it: a KeyboardInterrupt)
        release(getattr(self, "obj", 0))


@functools.cache
def _settle_call() -> tuple[int, int, int, int]:
    """``objc_msgSend``'s address and the ``setSignaledValue:``, ``retain`` and
    ``release`` selectors, for a completion handler's native code to settle its queue's
    event (which its native timeline retains until freed: am_metal_own)."""
    return (
        objc_msgsend_address(),
        selector("setSignaledValue:"),
        selector("retain"),
        selector("release"),
    )


@functools.cache
def _status_call() -> tuple[int, int]:
    """``objc_msgSend``'s address and the ``status`` selector, for a completion
    handler's native code to ask its command buffer whether it failed."""
    return objc_msgsend_address(), selector("status")

"""Timeline: a 64-bit monotonic counter shared by a device and the host, and the
awaiting of any such counter (``wait_value``)."""

from __future__ import annotations

import _thread
import bisect
import collections
import itertools
import os
import sys
import threading
import time
import types
import weakref
from asyncio import _get_running_loop
from collections.abc import Callable, Generator, Iterable
from typing import Any, Protocol, TypeVar

from . import _bridge, _native
from ._backend import NativeTimeline
from ._device_state import DeviceState
from ._errors import (
    ArgumentTypeError,
    AsyncMetalError,
    ClosedResourceError,
    DeviceLostError,
    InvalidArgumentError,
    Singular,
    as_int,
)

MAX_VALUE = (1 << 64) - 1


def check_value(value: object, what: str = "value") -> int:
    number = as_int(value)
    if number is None:
        raise ArgumentTypeError(f"{what} must be an int, got {type(value).__name__}")
    if not 0 <= number <= MAX_VALUE:
        raise InvalidArgumentError(f"{what} must be in [0, 2**64 - 1], got {number}")
    return number


# What Device and Queue pass to make timelines and queues: made any other way, one would
# belong to no device's bookkeeping (never closed with it, never woken at its close).
MADE_BY_DEVICE = object()


class FailingQueue(Protocol):
    @property
    def device(self) -> Any: ...

    @property
    def timeline(self) -> Timeline: ...

    _discarded: str | None  # what dropped its commands not started (discard), if any

    @property
    def submitted(self) -> int: ...

    def _failure(self, value: int) -> BaseException | None: ...


# The timelines alive, by native address: a native timeline's failure names where it
# began by that address (a queue's own timeline, or a closed device's).
_timelines: weakref.WeakValueDictionary[int, Timeline] = weakref.WeakValueDictionary()


def _queue_of(c_timeline: int) -> FailingQueue | None:
    """The live queue whose own timeline is at ``c_timeline``, if any."""
    timeline = _timelines.get(c_timeline)
    return None if timeline is None or timeline._queue is None else timeline._queue()


def command_of(c_timeline: int, value: int) -> str:
    """Command ``value`` of the live queue whose own timeline is at ``c_timeline``, named
    by its device ("a command of another queue" if there is none)."""
    queue = _queue_of(c_timeline)
    return (
        "a command of another queue"
        if queue is None
        else f"command {value} of a queue of {queue.device.name}"
    )


# What a queue's command failed by a wait of that queue for a value never produced adds.
LATER_FAIL = (
    " (the wait holds every later command of that queue, and so fails each: use "
    "another queue, dev.new_queue())"
)


# Why a close abandoned a command waiting on the device for a value: not that the value
# will never come (a host signal, or a queue's signal held behind another wait, may
# bring it later), but that nothing the close could wait for would.
NOT_YET = (
    "nothing left to run would produce it; a signal held behind another wait, "
    "or the host's, may bring it later"
)


def failure_error(failure: _native.Failure, lead: str, tail: str = "") -> AsyncMetalError:
    """The error of something that depends on a value ``failure`` kept from being
    produced: ``lead`` ("... a value that"), then the command where the failure began
    and why (a queue that is gone is not named), then ``tail``."""
    queue = _queue_of(failure.cause)
    where = command_of(failure.cause, failure.value)
    if failure.error == _native.CLOSED:  # a timeline whose device (or queue) closed
        owner = _timelines.get(failure.cause)
        if owner is not None and owner._last is not None:
            return ClosedResourceError(
                f"{lead} nothing will produce: it is a queue's own timeline, and that "
                f"queue was {owner._queue_end()}{tail}"
            )
        device = "its device" if owner is None else f"its device, {owner.device.name},"
        return ClosedResourceError(
            f"{lead} nothing will produce: {device} closed before the timeline got there{tail}"
        )
    if failure.error == _native.DISCARDED:
        why = (
            queue and queue._discarded
        ) or "its queue (or its device) was closed with discard=True"
        return ClosedResourceError(
            f"{lead} {where} never produced: it was discarded, not started when {why}{tail}"
        )
    if failure.error == _native.ABANDONED:
        device = "its device" if queue is None else queue.device.name
        return ClosedResourceError(
            f"{lead} {where} never produced: {device} was closed while that command waited "
            f"for a timeline value not produced yet ({NOT_YET}), and it never ran{tail}"
        )
    cause = None if queue is None else queue._failure(failure.value)
    if cause is None:
        cause = AsyncMetalError(f"it failed (error {failure.error})")
    kind = DeviceLostError if isinstance(cause, DeviceLostError) else AsyncMetalError
    error = kind(f"{lead} {where} never produced: {cause}{tail}")
    error.__cause__ = cause
    return error


# What dropped a queue's commands that had not started (``NativeQueue.discard``'s
# ``why``): the queue's close, or its device's (a close with ``discard=True``, or one a
# KeyboardInterrupt reached).
QUEUE_DISCARDED = "its queue was closed with discard=True"


def device_discarded(name: str, interrupted: bool = False) -> str:
    """What dropped the commands of a queue of device ``name``: its close."""
    if interrupted:
        return f"its device, {name}, was closing and a KeyboardInterrupt reached the close"
    return f"its device, {name}, was closed with discard=True"


def discarded_error(value: int, why: str) -> ClosedResourceError:
    """The error of command ``value`` of a queue, dropped before it started by a close
    with ``discard=True`` (``Queue.close``, ``Device.close``): ``why`` says which."""
    return ClosedResourceError(
        f"command {value} was discarded: {why} before the command started, and it never ran"
    )


class Waitable:
    """Something whose monotonic ``native.value`` tasks on any loop can await.

    Whoever raises the value calls ``_advanced`` afterwards, from any thread.
    Once ``_ended`` (its device closed) no value will come: every waiter is woken.
    """

    native: NativeTimeline
    _ended = False

    def __init__(self) -> None:
        self._recent_ns = 0  # a moving average of how long waits on it took
        self._watches: tuple[_bridge.Watch, ...] = ()
        self._watch_of: dict[_bridge.LoopBridge, _bridge.Watch] = {}
        self._watch_lock = threading.Lock()  # among loop threads only; never a notifier

    @property
    def value(self) -> int:
        """The value reached now."""
        return self.native.value

    def _advanced(self, value: int) -> None:
        """Called from any thread after the value rose to ``value``."""
        for watch in self._watches:
            if value >= watch.next:
                watch.bridge.notify(watch)

    def _watch_for(self, bridge: _bridge.LoopBridge) -> _bridge.Watch:
        watch = self._watch_of.get(bridge)
        if watch is None:
            with self._watch_lock:
                # One its loop set aside as it stopped (LoopBridge.suspend), with its
                # waiters, rejoins: a loop has one watch on a timeline.
                taken = watch = bridge.take_detached(self)
                if watch is None:
                    watch = _bridge.Watch(bridge, self)
                else:
                    watch.attach()
                # Watches of loops that have ended go now (their bridge let go of them
                # then, but may not take this lock: it ends from a finalizer).
                watch_of = {b: w for b, w in self._watch_of.items() if not b.dead}
                watch_of[bridge] = watch
                self._watch_of = watch_of
                self._watches = tuple(watch_of.values())
            if taken is not None:
                taken.rearm()  # (once notifiers see it: see _bridge's module doc)
        return watch

    def _drop_watch(self, watch: _bridge.Watch) -> None:
        """``watch`` has no waiter left (its bridge lets go of it)."""
        with self._watch_lock:
            if self._watch_of.get(watch.bridge) is watch:
                del self._watch_of[watch.bridge]
                self._watches = tuple(w for w in self._watches if w is not watch)


def close_timeline(timeline: Timeline) -> None:
    """``timeline``'s device closed: nothing of it will raise the timeline any more, so
    every wait for more than it reached ends, failed -- but for the signals of it that
    queues of other devices submitted and have not run yet, which still come (or
    fail): a wait goes on until the first of them that reaches its value."""
    state = timeline._state
    with _signals_lock:
        signals = list(timeline._signals)
    pending = tuple(
        (signaller, at, target)
        for target, at, signaller in signals  # (in the order they run: targets increase)
        if signaller._state is not state and signaller.native.value < at
    )
    timeline._pending_at_close = pending
    timeline.native.close_waits(pending[-1][2] if pending else 0)
    end_waits(timeline)


def abandon_signals(
    signaller: Timeline, first: int, signals: Iterable[tuple[Timeline, int, int]]
) -> None:
    """The queue whose own timeline is ``signaller`` will never run its commands from
    ``first`` on (its device closed while they waited): of ``signals``, (timeline, the
    command's value, target), those from ``first`` on never raise their timeline, of
    any device -- whose own close ends nothing here while that device stays open: a
    wait for that value, and every later signal of the timeline (each ordered after the
    one before), ends only through this. Each fails from the value after the last it
    reached (ABANDONED, the command as cause), once it got the target of the highest
    lower signal another queue submitted and has not run (that one still comes first,
    as signals take effect in the order submitted), else at once. The close path only:
    a healthy queue's signals record nothing more."""
    cause = signaller.native.c_timeline
    for timeline, at, target in signals:
        c_timeline = timeline.native.c_timeline
        if at < first or c_timeline is None or cause is None:
            continue  # (ran; or a timeline outside the native runtime, left as it was)
        with _signals_lock:
            earlier = timeline._signals[: bisect.bisect_left(timeline._signals, (target,))]
        after = next(
            (
                low
                for low, low_at, other in reversed(earlier)
                if other is not signaller and other.native.value < low_at
            ),
            0,
        )
        _native.runtime().am_timeline_fail_after(
            c_timeline, after, target, _native.ABANDONED, at, cause
        )


# How a queue's own timeline came to its end, as its errors say it (``queue_closed``):
# its queue was closed, collected without a close, or replaced as the device's stand-in
# default queue (``DeviceState.default_queue``).
QUEUE_CLOSED = "closed"
QUEUE_DROPPED = "dropped (collected, never closed)"
QUEUE_REPLACED = "replaced (every later command of it failed)"


def queue_closed(timeline: Timeline, last: int, how: str = QUEUE_CLOSED) -> None:
    """``timeline`` is a queue's own, and that queue was closed (or collected, or
    replaced: ``how``) after its command ``last``: nothing will raise it further. Waits
    for more are refused from now on; those made before end once ``close_timeline``
    closed it (the queue released)."""
    timeline._last_how = how
    timeline._last = last


def closed_queue_error(c_timeline: int, value: int) -> ClosedResourceError:
    """The error of a device wait for ``value`` on the queue's own timeline at
    ``c_timeline`` (native), whose queue was closed before the timeline got there."""
    timeline = _timelines.get(c_timeline)
    last = None if timeline is None else timeline._last
    after = "" if last is None else f" after its command {last}"
    return ClosedResourceError(
        f"timeline will not reach {value}: it is a queue's own timeline, and that queue "
        f"was closed{after}"
    )


def end_waits(waitable: Waitable) -> None:
    """No value will come any more (the device closed): wake every waiter of
    ``waitable``, on every loop; each finds its value unreached and raises (see
    ``Timeline.wait``)."""
    waitable._ended = True
    for watch in waitable._watches:
        watch.bridge.notify(watch)


class HostCounter(NativeTimeline):
    """A host-only monotonic counter (for the allocator and the compile pool)."""

    def __init__(self, on_advance: Callable[[int], None]) -> None:
        self._value = 0
        self._lock = threading.Lock()
        self._on_advance = on_advance

    @property
    def value(self) -> int:
        return self._value

    def signal(self, value: int) -> None:
        with self._lock:
            if value <= self._value:
                return
            self._value = value
        self._on_advance(value)

    def increment(self) -> int:
        with self._lock:
            self._value += 1
            value = self._value
        self._on_advance(value)
        return value


class HostEvents(Waitable):
    """A counter of host events (frees, finished compiles) that tasks can await."""

    def __init__(self) -> None:
        super().__init__()
        # Its counter reports to it through a weak reference: with the bound method the
        # two would be a reference cycle, one made with each (a queue's release, a
        # compile, a free handed to a thread), and left to the cycle collector. No task
        # waits on it once it is gone (a waiter holds it), so nothing is left to wake.
        self.native = self._counter = HostCounter(_reporter(weakref.ref(self)))

    def increment(self) -> int:
        """Count one more event (any thread) and wake the tasks it satisfies."""
        return self._counter.increment()

    async def wait(self, value: int) -> None:
        await wait_value(self, value)


def _reporter(events: weakref.ref[HostEvents]) -> Callable[[int], None]:
    """``events()._advanced``, while ``events`` is alive."""

    def advanced(value: int) -> None:
        target = events()
        if target is not None:
            target._advanced(value)

    return advanced


T = TypeVar("T")


class Detached:
    """Runs functions one after another on a thread of its own, started when one comes
    and ending once none is left: what is handed to it runs to its end whatever happens
    to whoever handed it over, and a burst of them takes one thread, not one each.

    A KeyboardInterrupt (CPython delivers one between any two calls of the main thread)
    may cut ``submit`` once it counted the thread as running and before the thread
    began -- in threading's own making and starting of it -- or once the job went in
    after the thread ended; nothing would then ever run what is queued, nor anything
    handed over later. So the interrupted call starts one more thread, with one C call
    (no interrupt lands between its start and the thread's): where the first did begin
    too, the two take turns (``_turn``), and jobs still run one after another."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._turn = threading.Lock()  # held by the thread running the jobs
        self._work: collections.deque[Callable[[], None]] = collections.deque()
        self._running = False
        _detached.add(self)

    def submit(self, job: Callable[[], None]) -> None:
        starting = False  # this call counted the thread as running: it starts it
        try:
            with self._lock:
                self._work.append(job)
                if self._running:
                    return  # (the running thread takes it)
                self._running = starting = True
            try:  # (started with the lock let go: the GC may run finalizers on it at once)
                threading.Thread(target=self._run, name=self.name, daemon=True).start()
            except Exception:
                # No thread to be had (a limit on threads reached, the interpreter
                # exiting): here, blocking the caller's thread, rather than never (what
                # is handed over -- a free, a release -- is counted on to happen).
                self._run()
        except Exception:
            raise
        except BaseException:
            self._interrupted(starting)
            raise

    def _interrupted(self, starting: bool) -> None:
        """``submit`` was interrupted (see the class doc): where what is queued may have
        no thread to run it, one more is started."""
        with self._lock:
            if not self._work or (self._running and not starting):
                return  # (a running thread takes it)
            self._running = True
        try:
            _thread.start_new_thread(self._run, ())
        except RuntimeError:  # no thread to be had: the next submit starts one
            with self._lock:
                self._running = False

    def _run(self) -> None:
        with self._turn:
            while True:
                with self._lock:
                    if not self._work:
                        self._running = False
                        return
                    job = self._work.popleft()
                job()

    def forked(self) -> None:
        """In a forked child: no thread runs, and what the parent handed over is the
        parent's."""
        self._lock = threading.Lock()
        self._turn = threading.Lock()
        self._work = collections.deque()
        self._running = False


_detached: weakref.WeakSet[Detached] = weakref.WeakSet()


def _detached_forked() -> None:
    for detached in list(_detached):
        detached.forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_detached_forked)


async def run_detached(
    detached: Detached, fn: Callable[[], T], unheard: Callable[[BaseException], None]
) -> T:
    """``fn()`` on ``detached``'s thread, and its result (or error) once it returns: it
    runs to its end whatever happens to the caller meanwhile (anyio's hand-off to a
    worker thread is cancellable before the work starts). Its error goes to
    ``unheard`` instead where the caller stopped waiting (cancelled) before it came:
    whichever of the two comes second hands it over, once."""
    outcome: list[tuple[bool, Any]] = []
    done = HostEvents()
    lock = threading.Lock()
    left: list[bool] = []  # the caller stopped waiting

    def run() -> None:
        try:
            result: tuple[bool, Any] = (True, fn())
        except BaseException as exc:  # (raised to the caller, if it still waits)
            result = (False, exc)
        with lock:
            outcome.append(result)
            lost = bool(left) and not result[0]  # (not the list: the caller may fill it)
        done.increment()
        if lost:
            unheard(result[1])

    detached.submit(run)
    try:
        await wait_value(done, 1)
    except BaseException:
        with lock:
            left.append(True)
            lost = bool(outcome) and not outcome[0][0]  # (not the list: see run)
        if lost:
            unheard(outcome[0][1])
        raise
    ok, value = outcome[0]
    if not ok:
        raise value
    result: T = value
    return result


class Timeline(Waitable, Singular):
    """A monotonic 64-bit timeline (a shared event), starting at 0.

    Queues signal it and wait on it on the device (``Queue.signal`` / ``Queue.wait``);
    the host signals it with :meth:`signal` and awaits it with :meth:`wait`. Signalled
    values must increase: a value that is not above every value already signalled or
    submitted for signalling raises :class:`InvalidArgumentError`.
    """

    def __init__(self, state: DeviceState, owned: bool = False, *, _made: object = None) -> None:
        if _made is not MADE_BY_DEVICE:
            raise ArgumentTypeError(
                "timelines come from their device: device.timeline() (a queue's own is "
                "queue.timeline)"
            )
        super().__init__()
        self._state = state
        self.device = state.device
        self._owned = owned  # a queue's own timeline is signalled by that queue only
        # Signal ordering: the highest value signalled or submitted for signalling, and
        # the last queue signal (the queue's own timeline, its value there, the target).
        self._highest = 0
        self._last_signal: tuple[Timeline, int, int] | None = None
        # Queue signals of it not known to have run, in the order submitted (each the
        # signalling queue's own timeline, its value there, the target), and the highest
        # value a queue's device wait on it was submitted for: what tells a queue signal
        # that would wait for itself (see ``signal_provider``).
        self._signals: list[tuple[int, int, Timeline]] = []  # (target, at, signaller)
        self._waited = 0
        # Queues' device waits on it not known done, by target: (target, a number in
        # order submitted, the queue (weakly: a closed device's queues are not kept
        # alive by another device's timeline), its value, whether it orders the queue's
        # signal of this timeline after another's).
        self._waits: list[tuple[int, int, Any, int, bool]] = []
        self.native: NativeTimeline = state.backend.new_timeline(self._advanced)
        if self.native.c_timeline is not None:
            _timelines[self.native.c_timeline] = self
        self._queue: weakref.ref[FailingQueue] | None = None  # a queue's own: that queue
        # A queue's own whose queue was closed: the value of its last command, the most
        # it will ever reach (a wait for more ends failed once the queue is released).
        self._last: int | None = None
        self._last_how = QUEUE_CLOSED  # (how its queue ended: see queue_closed)
        # Once its device closed: the signals of it that queues of other devices had
        # submitted and not run then, in order (each that queue's timeline, its value
        # there, the target), which the close left it to reach (see ``close_timeline``).
        self._pending_at_close: tuple[tuple[Timeline, int, int], ...] = ()
        self._failed_from: _native.ValueReader | None = None  # read in place, once made

    def __repr__(self) -> str:
        return f"<Timeline of {self._state.name} value={self.value}>"

    def signal(self, value: int) -> None:
        """Raise the timeline to ``value`` from the host, at once.

        Waiters up to ``value`` -- host tasks and device queues -- are released.
        """
        # Checked, counted as signalled and signalled natively in one step that queue
        # signals of it, on other threads, and its device's close come before or after
        # (see signal_order): a close that seals the device meanwhile counts what the
        # signal raised, or the signal is refused -- never run once the close has
        # abandoned what waited for it.
        native = self.native
        # The calling thread's running loop, where it waits on this timeline (its watch)
        # or the signal releases device work: its tasks the signal reaches are woken in
        # this call, as Event.set wakes (Watch.wake_now), and so the native signal
        # leaves out that loop's own pipe (signal_here) -- a system call, then an event
        # the loop handles, both before the tasks woken run. A watch of the timeline's
        # that lives only in Python (none in a forked child) has no pipe to leave out.
        bridge = _bridge.running_bridge() if self._watches or native.releases_device_work else None
        watch = None if bridge is None else self._watch_of.get(bridge)
        here = 0
        if watch is not None and watch.cwatch is not None:
            here = watch.bridge.notifier or 0
        try:
            with _signal_order:
                # The usual case in few steps (this path's time is its latency): a
                # timeline no queue signals. (Only a queue's signal fails a timeline, and
                # records itself in _last_signal: such a timeline is checked in full.)
                if not (
                    type(value) is int
                    and self._highest < value <= native.max_value
                    and self._last_signal is None
                    and not self._owned
                    and not self._state.closed
                ):
                    value = self._check_signal(value, "value")
                    if self._owned:
                        raise InvalidArgumentError(
                            "this is a queue's own timeline: only its queue signals it; "
                            "make one with device.timeline()"
                        )
                    if self._signal_pending():
                        previous = self._last_signal
                        assert previous is not None
                        raise InvalidArgumentError(
                            f"a queue's signal of this timeline to {previous[2]} has not "
                            f"run yet: the host may signal it only after that "
                            f"(await timeline.wait({previous[2]}))"
                        )
                try:
                    # (A max: this thread's own signal may have come in between, see
                    # signal_order.)
                    self._highest = max(self._highest, value)
                    if here:
                        native.signal_here(value, here)
                    else:
                        native.signal(value)
                except KeyboardInterrupt:
                    # A Ctrl-C raised here (trio raises it in whatever code its task
                    # runs): between the count and the native signal, or inside that (a
                    # Metal timeline's event raised, its mirror not). Left so, the value
                    # would count as signalled -- a signal of it again refused -- and
                    # never come. The signal is made whole (signals of a value reached do
                    # nothing), then the interrupt goes on.
                    self._highest = max(self._highest, value)
                    native.signal(value)
                    raise
            if watch is not None:
                watch.bridge.wake_now(watch)
        except BaseException:
            if here and watch is not None:
                # Refused, or interrupted (a Ctrl-C) maybe once the value was raised and
                # before its waiters here were woken: with its pipe left out, the loop
                # looks at the watch in its next slice instead.
                watch.bridge.notify_here(watch)
            raise
        if bridge is not None and native.releases_device_work:
            bridge.stay_awake(AWAKE_AFTER_SIGNAL_NS)  # (the device work it released)

    def _signal_pending(self) -> bool:
        """Whether the last queue signal of this timeline has not run yet: its queue has
        not done the command, and the timeline has not reached its target (a queue raises
        the timeline before it records the command as done, so a waiter can see the
        value first)."""
        previous = self._last_signal
        return (
            previous is not None
            and previous[0].value < previous[1]
            and self.native.value < previous[2]
        )

    async def wait(self, value: int) -> None:
        """Wait until the timeline reaches ``value``.

        Always a checkpoint. Cancelling it withdraws this waiter only; the timeline and
        the device are unaffected. Raises :class:`ClosedResourceError` if the device
        closes (or has closed) before ``value`` is reached -- or, a queue's own
        timeline, if the queue was closed before a command of it got that far.
        """
        value = check_value(value)
        if self._last is not None and value > self._last:
            await _bridge.checkpoint()
            raise self._beyond_last(value)
        await wait_value(self, value)
        if self._pending_at_close and self.native.value < value:
            # Its device closed before other devices' queues ran signals of it submitted
            # before: the first that reaches this value (or its failure) settles it.
            for signaller, at, target in self._pending_at_close:
                if target >= value:
                    await wait_value(signaller, at)
                    break
        failure = self._failure(value)
        if failure is not None:
            try:
                raise failure
            finally:
                failure = None  # (not kept by this frame, which its traceback holds)
        if self.native.value < value:  # woken by the close: the value will never come
            if self._last is not None and value > self._last:
                raise self._beyond_last(value)
            raise ClosedResourceError(
                f"the timeline's device {self._state.name} closed before it reached {value}"
            )

    def _beyond_last(self, value: int) -> ClosedResourceError:
        """The error of a wait for ``value``, past the last command of this timeline's
        queue, closed: nothing will raise it that far."""
        return ClosedResourceError(
            f"this timeline will not reach {value}: its queue was {self._queue_end()}"
        )

    def _queue_end(self) -> str:
        """(A queue's own timeline whose queue ended.) How and where it ended: "closed
        after its command 3"."""
        return f"{self._last_how} after its command {self._last}"

    def _failure(self, value: int) -> BaseException | None:
        """Why ``value``, reached, was never produced: a command that signals the
        timeline failed, or was abandoned by its device's close. None if it was."""
        queue = None if self._queue is None else self._queue()
        if queue is not None:  # a queue's own timeline: its commands' failures
            submitted = queue.submitted
            if value <= submitted:
                return queue._failure(value)
            if self.native.value < value:
                return None
            # Reached past its last command: the timeline settled (at 2**64 - 1) as its
            # commands failed or were abandoned, and no command produced this value.
            last = queue._failure(submitted) if submitted else None
            why = f": {last}" if last is not None else ""
            return ClosedResourceError(
                f"this timeline will not reach {value}: its queue's last command is "
                f"{submitted}, and its timeline settled without it running{why}"
            )
        c_timeline = self.native.c_timeline
        if c_timeline is None:
            return None
        if self._failed_from is None:
            self._failed_from = _native.failed_from(c_timeline)
        first = self._failed_from.value
        if not first or value < first:  # (the common case: one read in place)
            return None
        failure = _native.timeline_failure(c_timeline)
        assert failure is not None
        if failure.error == _native.CLOSED and failure.cause == c_timeline:
            # Its own device's close (Timeline.wait says so); another device's, which
            # failed a signal of it (through that signal's queue), is raised below.
            return None
        return failure_error(failure, f"this timeline will not reach {value}: a value that")

    def _check_signal(self, value: object, what: str) -> int:
        value = self._check_device_value(value, what)
        if value <= self._highest:
            raise InvalidArgumentError(
                f"{what} {value} does not increase the timeline: it has been signalled "
                f"(or a signal submitted) up to {self._highest}; expected > {self._highest}"
            )
        if self._state.closed:
            raise ClosedResourceError(f"the timeline's device {self._state.name} is closed")
        # A failed timeline (a signal of it failed, or was discarded) stays at 2**64 - 1
        # and every wait for this value on it fails: a signal of it would do nothing.
        failure = None if self._owned else self._failure(value)
        if failure is not None:
            raise ClosedResourceError(f"{what} {value} cannot be signalled: {failure}")
        return value

    def _check_device_value(self, value: object, what: str) -> int:
        """``value`` as one this timeline can be signalled to or waited for."""
        value = check_value(value, what)
        highest = self.native.max_value
        if value > highest:
            raise InvalidArgumentError(
                f"{what} must be at most {highest} on a {self._state.kind} timeline (its "
                f"devices compare values in fewer bits), got {value}"
            )
        return value


def check_timeline(timeline: object, what: str, kind: str) -> Timeline:
    """``timeline`` as a Timeline that a queue of ``kind`` can wait on or signal."""
    if not isinstance(timeline, Timeline):
        raise ArgumentTypeError(f"{what} must be a Timeline, got {type(timeline).__name__}")
    state = timeline._state
    if state.closed:
        raise ClosedResourceError(f"{what} belongs to the closed device {state.name}")
    if state.kind != kind:
        raise InvalidArgumentError(
            f"{what} is a {state.kind} timeline; a {kind} queue can only wait on or "
            "signal its own kind (await it on the host instead)"
        )
    return timeline


def order_queue_signal(timeline: Timeline, value: object, signaller: Timeline) -> tuple[int, int]:
    """Check a queue's signal of ``timeline`` to ``value``, before it is submitted by
    the queue whose own timeline is ``signaller``. Returns the value and the target of
    an earlier signal by another queue that has not run yet (0: none): signals of one
    timeline take effect in the order submitted, so the queue waits for that one first,
    on the device, and the timeline's value never goes backwards."""
    if timeline._owned:
        raise InvalidArgumentError("a queue's own timeline is signalled by its queue only")
    value = timeline._check_signal(value, "value")
    previous = timeline._last_signal
    if previous is not None and previous[0] is not signaller and timeline._signal_pending():
        return value, previous[2]
    return value, 0


def queue_signal_submitted(timeline: Timeline, signaller: Timeline, at: int, target: int) -> None:
    """The queue whose own timeline is ``signaller`` submitted, as its command ``at``,
    a signal of ``timeline`` to ``target`` (checked by :func:`order_queue_signal`)."""
    timeline._highest = max(timeline._highest, target)  # (see Timeline.signal)
    timeline._last_signal = (signaller, at, target)
    signals = timeline._signals
    with _signals_lock:  # (queues of several devices may signal one timeline)
        _drop_reached(signals, timeline.native.value)
        signals.append((target, at, signaller))  # (targets increase)


# Guards the timelines' records of queue signals and waits (_signals, _waits, and the
# highest value waited for, _waited): queues of several devices, under their own
# submission locks, may signal or wait on one.
_signals_lock = threading.Lock()
# Held by a queue's signal of a timeline from its check (order_queue_signal) to its
# record (queue_signal_submitted), and by a host signal around its check, count and
# native signal: a signal on another thread -- a queue's of any device, or the host's --
# is checked against this one's record, never against what was there before it; and a
# device's close seals the device under it (Device._seal), so a host signal of one of
# its timelines either lands before the close counts what can still complete or sees
# the device closed. (A queue's signal and the seal take it inside the device's
# submission lock; nothing holding it takes one. Re-entrant: code the check calls
# back, a finalizer, may signal on this thread.)
_signal_order = threading.RLock()


def signal_order() -> threading.RLock:
    """The lock that orders the checks of timelines' signals with their records."""
    return _signal_order


def _new_signals_lock() -> None:
    """In a forked child: a parent thread may have held the locks at the fork."""
    global _signals_lock, _signal_order
    _signals_lock = threading.Lock()
    _signal_order = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_signals_lock)


_LAST = (1 << 64,)  # after every (value, ...) of the same value, in tuple order
_waits_made = itertools.count()  # (next() is atomic)


def _drop_reached(entries: list[Any], reached: int) -> None:
    """Forget the ``entries`` (by target, first) that ``reached`` satisfies: now and
    then, a run of them at once (a list's head is not removed one by one)."""
    if len(entries) < 64:  # (few: kept, and skipped over when looked at)
        return
    done = bisect.bisect_right(entries, (reached, *_LAST))
    if done >= 32:
        del entries[:done]


def queue_wait_submitted(
    timeline: Timeline, queue: FailingQueue, at: int, target: int, ordering: bool
) -> None:
    """``queue`` submitted, as its command ``at``, a device wait for ``timeline`` to
    reach ``target``; ``ordering``: one that orders its signal of ``timeline`` after
    another queue's (see ``waits_for``)."""
    waits = timeline._waits
    entry = (target, next(_waits_made), weakref.ref(queue), at, ordering)
    with _signals_lock:
        # (Under the lock: queues of several devices, each under its own submission
        # lock, may wait on one timeline at once, and a max read before another's write
        # and written after it would lower it.)
        if target > timeline._waited:
            timeline._waited = target
        _drop_reached(waits, timeline.native.value)
        if not waits or waits[-1] < entry:
            waits.append(entry)  # (the common case: waits for more and more)
        else:
            bisect.insort_right(waits, entry)


def waits_for(timeline: Timeline, low: int, high: int) -> list[tuple[Any, int, int, bool]]:
    """The queues' device waits on ``timeline`` for a value from ``low`` to ``high``
    not done yet: (queue, its value, target, whether it orders a signal)."""
    if timeline._waited < low:  # (none was ever submitted for that much)
        return []
    low = max(low, timeline.native.value + 1)
    waits = timeline._waits
    with _signals_lock:
        first = bisect.bisect_left(waits, (low,))
        found = waits[first : bisect.bisect_right(waits, (high, *_LAST), lo=first)]
    return [
        (queue, at, target, ordering)
        for target, _, ref, at, ordering in found
        if (queue := ref()) is not None and queue.timeline.value < at
    ]


def signal_satisfies(timeline: Timeline, target: int) -> int:
    """Where a queue's pending signal of ``timeline`` to ``target`` takes it from: the
    device waits for more than that, up to ``target``, are satisfied by that signal
    (signals run in the order submitted, each after the one before)."""
    signals = timeline._signals
    with _signals_lock:
        i = bisect.bisect_left(signals, (target,))
        before = signals[i - 1][0] if i else 0
    return max(before, timeline.native.value)


def waits_beyond_signals(timeline: Timeline) -> int:
    """The lowest value of ``timeline`` that no signal submitted so far (a queue's, or
    the host's) raises it to, where a queue's device wait was submitted for that much or
    more; 0 where none was."""
    return timeline._highest + 1 if timeline._waited > timeline._highest else 0


def signal_provider(timeline: Timeline, value: int) -> tuple[FailingQueue, int] | None:
    """The queue command that will raise ``timeline`` to ``value``, where that is known
    now: the queue and its command's value. For a queue's own timeline, that queue's
    command ``value`` (once submitted); for another timeline, the first queue signal
    submitted for ``value`` or more that has not run (signals of a timeline run in the
    order submitted, each after the one before). None where ``value`` is reached, or
    nothing submitted yet reaches it (the host or a later signal may)."""
    if timeline.native.value >= value:
        return None
    if timeline._queue is not None:
        queue = timeline._queue()
        return None if queue is None or value > queue.submitted else (queue, value)
    signals = timeline._signals
    with _signals_lock:  # (their targets increase: the first that reaches value, halving)
        i = bisect.bisect_left(signals, (value,))
        if i == len(signals):
            return None
        _, at, signaller = signals[i]
    if signaller.value >= at:  # (it ran: a queue raises the timeline first)
        return None
    queue = None if signaller._queue is None else signaller._queue()
    return None if queue is None else (queue, at)


def timeline_kind(timeline: Timeline) -> str:
    """The kind of ``timeline``'s device ("cpu", "cuda", ...)."""
    return timeline._state.kind


def timeline_device(timeline: Timeline) -> DeviceState:
    """``timeline``'s device (its state: closed or not, its name)."""
    return timeline._state


def passed(timeline: Timeline, value: int) -> bool:
    """Whether a queue whose own timeline is ``timeline`` is done with its command
    ``value``: run, or never to run (its device's queues stopped: they ran or abandoned
    everything). A device that is closing but whose queues still run (``closed`` is set
    before the close waits for them) is not done with anything it has not run."""
    return timeline._state.stopped or timeline.native.value >= value


AWAKE_AFTER_SIGNAL_NS = 500_000  # a loop that host-signals a device timeline checks this long
SPIN_NS = 50_000  # waits recently shorter than this first yield to the loop a few times
CROWD = 16  # from this many waiting tasks on, a wait yields first only on a turn (_bridge)
SPINNERS = 4  # only while fewer tasks wait does a wait read the timeline between yields
DUE_NS = 2_000_000  # a command due within this long is checked for rather than parked on
SLICE_NS = 5_000  # between two such yields, a native timeline is read this long at most
AWAKE_DUE_NS = 200_000  # a task parking on a command due within this long keeps the loop awake


class _Count:
    """Tasks of one loop waiting in ``wait_value`` now, counted on the loop's thread. A
    wait keeps its own count: a task dropped while it waits is closed wherever the
    garbage collector runs, maybe on another thread, and must uncount itself from its
    loop's -- there through ``gone`` (an append is atomic; ``n -= 1`` there would race
    the loop's). ``owner`` is the loop's (weakly): another loop on the thread, or a trio
    run after it, starts a count of its own, so tasks a closed loop left parked, still
    held, count for no later loop.

    It also keeps what every wait of its loop on this thread looks up: ``asyncio``,
    whether the loop is an asyncio (or uvloop) loop running the tasks that count here
    (not a trio run, hosted or not), whose checkpoint is a bare yield; and ``bridge``,
    the loop's bridge (``_bridge.current_bridge()``, the same object for as long as the
    loop lives), once a wait asked for it -- None again whenever this thread takes the
    count up after another loop's (``_switch_count``) or ``current_bridge`` found
    another loop's bridge here (``_forget_bridge``), so that its next wait asks
    ``current_bridge`` again, which notes the switch (``_bridge._switch_here``)."""

    __slots__ = ("asyncio", "bridge", "gone", "n", "owner")

    def __init__(self, owner: object | None, asyncio: bool = False) -> None:
        self.n = 0
        self.gone: collections.deque[None] = collections.deque()  # uncounted elsewhere
        self.owner: Callable[[], object | None] = _no_owner if owner is None else weakref.ref(owner)
        self.asyncio = asyncio
        self.bridge: _bridge.LoopBridge | None = None

    def loop_bridge(self) -> _bridge.LoopBridge:
        """The bridge of the loop this count is of (which runs the calling task)."""
        bridge = self.bridge
        if bridge is None:
            bridge = self.bridge = _bridge.current_bridge()
        return bridge

    def settle(self) -> None:
        """On the owning thread: take off the waits that ended on other threads."""
        gone = self.gone
        while gone:
            gone.pop()
            self.n -= 1


def _no_owner() -> None:
    return None


# Per thread: the _Count of the loop that waited last, as "count", and those of other
# loops that waited on the thread before, as "others" (by id; while they are alive):
# loops that take turns on one thread (a trio guest run and its asyncio host, asyncio
# loops run in turn) each keep their own.
_waiting = threading.local()


def _count_here() -> _Count:
    """The running loop's count (a new one where another loop waited last here)."""
    count: _Count | None = getattr(_waiting, "count", None)
    owner: object = _get_running_loop()  # (_bridge.running_asyncio_loop(), inline: hot)
    plain = owner is not None
    if not plain or ("trio" in sys.modules and _bridge.in_trio_task()):
        owner = _bridge.running_trio_run()
        plain = False
    # (A count whose loop is gone has no owner either: the asyncio flag tells it apart
    # from one of no loop.)
    if count is None or count.owner() is not owner or count.asyncio is not plain:
        count = _switch_count(count, owner, plain)
    return count


def _forget_bridge() -> None:
    """This thread's running loop changed (``_bridge.on_switch``): the count of the loop
    that waited last here asks for its bridge again at its next wait."""
    count: _Count | None = getattr(_waiting, "count", None)
    if count is not None:
        count.bridge = None


_bridge.on_switch(_forget_bridge)


def _others() -> dict[int, _Count]:
    others: dict[int, _Count] | None = getattr(_waiting, "others", None)
    if others is None:
        others = _waiting.others = {}
    return others


def _switch_count(last: _Count | None, owner: object, plain: bool = False) -> _Count:
    """The count of ``owner``, a loop other than the one that waited last on this
    thread: kept from when it waited here before, or a new one (``plain``: ``owner`` is
    an asyncio loop, see ``_Count.asyncio``). The last one's is kept in turn (and those
    of loops gone are let go of)."""
    others = _others()
    count = others.pop(id(owner), None)
    if count is None or count.owner() is not owner or count.asyncio is not plain:
        count = _Count(owner, plain)
    else:
        count.bridge = None  # (asked for again: see _Count)
        if count.gone:
            count.settle()
    if last is not None and (last_owner := last.owner()) is not None:
        others[id(last_owner)] = last
    for key in [key for key, kept in others.items() if kept.owner() is None]:
        del others[key]
    _waiting.count = count
    return count


def waiting_here() -> int:
    """How many tasks of the calling thread's loop wait in ``wait_value`` now (outside a
    loop: of the loop that waited last on this thread)."""
    owner = _bridge.running_asyncio_loop() or _bridge.running_trio_run()
    count: _Count | None = getattr(_waiting, "count", None)
    if owner is not None and (count is None or count.owner() is not owner):
        count = _others().get(id(owner))
        if count is not None and count.owner() is not owner:
            count = None
    if count is None:
        return 0
    count.settle()
    return count.n


@types.coroutine
def wait_value(
    timeline: Waitable, value: int, due_ns: int = 0, unreached: bool = False
) -> Generator[Any, Any, None]:
    """Park the calling task until ``timeline`` reaches ``value``; always a checkpoint.

    Before parking the task yields to the loop once (every other ready task runs), and
    when recent waits on this timeline ended within ``SPIN_NS`` it keeps yielding for up
    to twice that recent time, since the value is about to be reached: that saves a
    park and a wake-up. So it does, up to ``due_ns`` (a ``perf_counter_ns`` by which
    the device expects to be done: the backend's, or else what the queue predicts from
    its commands' recent run times), when that is at most ``DUE_NS`` away. Between two
    of those yields it reads a native timeline for up to ``SLICE_NS`` (in C, without the
    GIL), so that the value is seen the moment it is reached rather than a loop
    iteration later; the loop and its other tasks wait that long at most. It never
    spins while nothing is about to finish. (A generator-based coroutine: ``await`` it,
    or ``yield from`` it in an ``__await__``, with no coroutine frame between.)
    ``unreached``: the caller has just read the value below ``value`` (it is not read
    again before the first yield).
    """
    native = timeline.native
    if not unreached and native.value >= value:
        yield from ready_checkpoint()
        return
    c_timeline = native.c_timeline or 0
    spin = _native.spin if c_timeline else None  # (a native timeline: the runtime is loaded)
    start = time.perf_counter_ns()
    recent = timeline._recent_ns
    count = _count_here()
    if count.gone:
        count.settle()
    crowd = count.n
    count.n = crowd + 1
    try:
        # Yield once before parking: under load one pass over the other ready tasks
        # usually finishes the command, and a yield costs far less than a park and a
        # wake-up. In a crowd, only while the bridge grants turns: tasks that never park
        # are all ready in every iteration of the loop, which then lasts as long as all
        # their steps; the bridge grants as many turns per iteration as keep it short,
        # and the rest park at once and are woken in slices (WAKE_SLICE) with the loop's
        # other work between -- also those whose value is reached already.
        # And reading the timeline between yields pays off for a few waiters only: each
        # read holds the loop up to SLICE_NS, once per waiter and iteration.
        deadline = 0
        if crowd < SPINNERS and not _native.cores_taken():  # (spinning takes a core)
            deadline = start + 2 * recent if recent < SPIN_NS else 0
            if not due_ns and c_timeline and _native.due is not None:
                # The queue's prediction for its last command (a launch, a marker).
                due_ns = _native.due(c_timeline, value)
            if start < due_ns <= start + DUE_NS:
                deadline = max(deadline, due_ns + SPIN_NS)
        if crowd < CROWD or count.loop_bridge().turn():
            while True:
                if count.asyncio:
                    yield  # (_bridge.checkpoint()'s, inline: this is every wait's)
                else:
                    yield from _bridge.checkpoint()
                if native.value >= value:
                    timeline._recent_ns = (recent * 7 + time.perf_counter_ns() - start) >> 3
                    return
                if not deadline:  # (a crowd's: one yield, no clock read)
                    break
                now = time.perf_counter_ns()
                if now < deadline and (
                    spin is not None and spin(c_timeline, value, min(SLICE_NS, deadline - now))
                ):
                    timeline._recent_ns = (recent * 7 + time.perf_counter_ns() - start) >> 3
                    return
                if now >= deadline:
                    break
        # After a yield: where another loop waited on this thread meanwhile (this one
        # stopped, then ran again), the count is no longer the thread's, and the bridge
        # it kept would skip current_bridge's note of the switch (_switch_here: the
        # other loop, maybe stopped with tasks parked, sets them aside).
        if getattr(_waiting, "count", None) is count:
            bridge = count.loop_bridge()
        else:
            bridge = _bridge.current_bridge()
        watch = None if native.value >= value else timeline._watch_for(bridge)
        if watch is not None and c_timeline and _native.due is not None:
            # Parked on a command the queue expects done soon (a crowd's tasks park at
            # once): the loop reads the timeline in each iteration until shortly after,
            # rather than sleep and be woken through the pipe, which takes tens of
            # microseconds -- with short kernels the loop would sleep between most of
            # them while the streams ran dry.
            due = due_ns or _native.due(c_timeline, value)
            now = time.perf_counter_ns()
            if now < due <= now + AWAKE_DUE_NS:
                bridge.stay_awake(due - now + SPIN_NS)
        yield from bridge.parked(watch, value)
        timeline._recent_ns = (recent * 7 + time.perf_counter_ns() - start) >> 3
    finally:
        if getattr(_waiting, "count", None) is count:  # ended on its loop's thread
            count.n -= 1
        else:
            count.gone.append(None)


@types.coroutine
def ready_checkpoint() -> Generator[Any, Any, None]:
    """The checkpoint of an await whose value is reached: a yield -- or, while a crowd
    of tasks waits on this thread's loop and the bridge grants no turn, a place in its
    next slices (tasks whose commands are always done by the time they await would
    otherwise all be ready in every iteration of the loop)."""
    count = _count_here()
    if count.gone:
        count.settle()
    crowd = count.n
    count.n = crowd + 1
    try:
        if crowd < CROWD or count.loop_bridge().turn():
            if count.asyncio:
                yield  # (_bridge.checkpoint()'s, inline)
            else:
                yield from _bridge.checkpoint()
        else:
            yield from count.loop_bridge().parked(None, 0)
    finally:
        if getattr(_waiting, "count", None) is count:  # ended on its loop's thread
            count.n -= 1
        else:
            count.gone.append(None)


def call_when_reached(waitable: Waitable, value: int, callback: Callable[[], None]) -> None:
    """Run ``callback`` on the calling loop's thread once ``waitable`` reaches ``value``
    (at once if it has). Call it from a task."""
    if waitable.native.value >= value:
        callback()
        return
    bridge = _bridge.current_bridge()
    bridge_watch = waitable._watch_for(bridge)
    bridge_watch.add(value, _bridge.Entry(callback, task=False))

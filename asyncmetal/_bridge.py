"""The one path from a native completion to each waiting event loop.

A thread that sees a timeline advance (a cpu queue thread, a CUDA completion thread, a
Metal completion handler's hand-off) calls ``Waitable._advanced``. That touches no lock
the loop could wait on: it compares the new value with the smallest value each loop
waits for (``Watch.next``) and, if reached, appends the watch to that loop's bridge and
schedules one drain -- unless a drain is already scheduled. The drain runs on the loop
thread and wakes every waiter whose value has been reached, so any number of completions
between two loop iterations cost one wake-up of that loop.

The handshake is lock-free and relies on the GIL ordering plain attribute reads and
writes: the notifier writes the value and then reads ``next``/``queued``; the loop
writes ``next``/``queued`` and then reads the value. One of the two always sees the
other's write, so no wake-up is lost.

A drain wakes a slice of the tasks due; if more are due, it goes on in the loop's next
iteration (without another wake-up). Every woken task runs in the iteration after its
wake-up, so a thousand tasks woken at once would make that one iteration as long as a
thousand task steps (tens of milliseconds) and hold back every timer and socket of the
loop; in slices, the loop's other work runs between them. A slice is sized by time, not
count alone: each slice that follows another measures the iteration between them (the
woken tasks' steps and the loop's other work) and sizes the next to about
``SLICE_BUDGET_NS`` of such steps, between 1 and ``WAKE_SLICE`` tasks -- ``WAKE_SLICE``
whose steps are short, one whose steps run a model's Python for a hundred
microseconds. (Larger slices of short steps do not raise throughput: they only
lengthen the iterations.)

A crowd's waits take turns. From a number of waiting tasks on (``_timeline.CROWD``), a
wait would park at once, and so bound the loop's iterations; but a park and its wake-up
cost more than the step of a task whose command finishes while the loop runs its other
tasks once. So a crowd's wait may first yield plainly, once -- a turn -- and parks only
if its command is still not done. The bridge grants as many turns per iteration of the
loop as keep its tasks' steps to about ``TURN_BUDGET_NS`` an iteration: a callback that
runs once per iteration while turns are taken measures the iterations, counts the steps
in them (the tasks on a turn and those a slice woke) and grants the next what the
slices leave of the budget's worth of such steps, but at least half of it
(``turn_limit``); the tasks that asked later park and are woken in slices, as before.
Where not even one turn fits (a step longer than half the budget, or the loop's other
work filling it), none is granted; one is again as soon as the steps of the tasks a
slice wakes (smoothed over slices) say it fits, and else one turn in every
``TURN_PROBE``-th iteration measures again.
While the turns run out (the limit refused a task since the last measure), one turn
asked for in ``TURN_SHARE``, at random, is refused too, so that the tasks taking turns
change: a task refused parks behind those woken in slices, and one of those takes its
place. While every task that asks gets a turn, none waits for one, and none is refused
so: its park and wake-up would cost more than its turn.

A wake-up from the bridge also keeps the loop's timers on time. asyncio's epoll and
poll selectors, and trio's epoll, sleep in whole milliseconds, rounded up: a loop woken
0.3 ms before a timer is due sleeps a full millisecond after the wake-up, and the timer
runs 0.7 ms late. After each wake-up the bridge caused, while the loop's next timer is
due within that millisecond, the loop keeps polling (a callback per iteration) until
that timer is due, and no longer: at most a millisecond of polling per wake-up (of
real time too, where the loop's clock stands still while it polls), and none where the
loop sleeps precisely (kqueue, select) or cannot say when its next timer is due
(uvloop).

While the cpu device's queue threads running commands need every core the process may
run on, or lately waited for one (``_native.cores_taken``), a polling loop would take
CPU time from their kernels (on two cores, four busy queues of 200 us kernels ran a
fifth fewer; one, beside another process, ran its 10 us kernels 2-30 times slower, the
loop thread holding the core it waited for): there an asyncio
loop sleeps instead until that timer is due, precisely, in ``select`` on its selector's
own descriptor (which any of the loop's descriptors becoming ready wakes at once), and
only when nothing else is ready to run; where it cannot, the hold ends, and so does
``stay_awake``'s polling below.

A wake-up may also come ahead of a completion: a CUDA completion thread that napped
through most of a long command wakes the loops awaiting it shortly before its expected
end, with a time until which each reads its native timelines in every iteration
(``stay_awake``) rather than sleep. Woken by the end itself, a loop asleep that long
takes tens of microseconds to run again.

A loop may stop and never run again: a thread that returns from
``loop.run_until_complete`` without closing the loop leaves its other tasks parked. The
timelines hold those tasks' watches, so the tasks and their loop, its bridge's pipe and
native watches, for as long as they live. So once the thread that ran the loop ends
(``_ThreadEnd``, kept in a thread-local, is dropped then) or parks a task of another
loop (``_switch_here``), and the loop is not running, its bridge sets its watches
aside (``suspend``): the timelines let go of them, and a callback queued on the loop
holds them and takes them back if it runs again. A loop nothing else holds is then
garbage, and its bridge closes. A closed loop's bridge lets go of its waiters for good
(``release``). The loop may start again on a third thread as it is set aside: the
setting aside frees no native watch (the loop may be arming it: each keeps its own and
takes it back with it, or the callback frees it on the loop's thread, or the bridge's
close once the loop is gone) and changes in place nothing the loop goes through.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import heapq
import itertools
import logging
import os
import random
import select
import selectors
import sys
import threading
import time
import types
import weakref
from abc import ABC, abstractmethod
from asyncio import _get_running_loop
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

from . import _native
from ._backend import NativeTimeline
from ._errors import NoLoopError

_log = logging.getLogger("asyncmetal")
INFINITY = 1 << 64  # larger than any 64-bit timeline value
SLEEP_GRANULE = 1e-3  # seconds: epoll and poll sleep in whole milliseconds, rounded up
WAKE_SLICE = 8  # tasks a drain wakes at most; the rest in the loop's next iteration
# A timer (a socket's event alike) due while an iteration runs waits for the rest of it
# and for the next one, whose callbacks wake its task: two iterations of woken steps and
# turns, plus one step over the budget each, stay within a millisecond at these.
SLICE_BUDGET_NS = 150_000  # fewer, where their steps would take longer than this
TURN_BUDGET_NS = 200_000  # a crowd's turns: as many per iteration as keep it this long
TURN_LIMIT = 16  # turns per iteration granted at first
TURN_MAX = 4096
TURN_SHARE = 4  # while turns run out, one asked for in 4, at random, is refused (it parks)
TURN_PROBE = 8  # while no turn fits: one turn in every 8th iteration, to measure again
AHEAD_AWAKE_NS = 2_000_000  # a loop woken ahead of a completion stays awake this long at most


@dataclass(frozen=True)
class LoopStatistics:
    """What asyncmetal did for one event loop (see :func:`loop_statistics`):
    ``wakeups``, the wake-ups it ran on the loop (each woke the tasks whose commands,
    copies or timeline values had come since the last), ``resolved``, the tasks those
    woke, and ``waiting``, the tasks parked on it right now."""

    wakeups: int  # drains run on the loop: each is one wake-up
    resolved: int  # tasks woken by those drains
    waiting: int  # tasks parked right now


class Watched(Protocol):
    """What a watch needs of the counter it watches (a ``Waitable`` of ``_timeline``)."""

    @property
    def native(self) -> NativeTimeline: ...

    @property
    def _ended(self) -> bool: ...

    def _drop_watch(self, watch: Watch) -> None: ...

    def _watch_for(self, bridge: LoopBridge) -> Watch: ...


class Entry:
    __slots__ = ("done", "task", "wake")

    def __init__(self, wake: Callable[[], None], task: bool = True) -> None:
        self.done = False  # woken, or withdrawn by cancellation
        self.wake = wake
        self.task = task  # a parked task (counted in the statistics), not a callback


class Watch:
    """The waiters of one loop on one timeline: a heap ordered by value.

    For a timeline living in the native runtime (``c_timeline``), a native watch holds
    ``next`` where native threads read it, and they wake the loop through its pipe.
    """

    __slots__ = (
        "__weakref__",
        "bridge",
        "cwatch",
        "detached",
        "dropping",
        "heap",
        "next",
        "queued",
        "timeline",
        "withdrawn",
    )

    def __init__(self, bridge: LoopBridge, timeline: Watched) -> None:
        self.bridge = bridge
        self.timeline = timeline
        self.heap: list[tuple[int, int, Entry]] = []
        self.next = INFINITY  # smallest value waited for; read by notifying threads
        self.queued = False  # already in the bridge's pending deque
        self.withdrawn = 0  # cancelled entries still in the heap
        self.dropping = False  # empty: let go of two turns of the loop later, if still
        self.cwatch: int | None = None
        self.attach()

    def attach(self) -> None:
        """Join the bridge, and the native runtime's watches where the timeline lives
        there; also again, after its loop set it aside (``LoopBridge.suspend``), with
        the native watch it kept."""
        self.detached = False  # set aside, with its waiters, by a loop that stopped
        self.next = INFINITY  # (nothing is published yet: see rearm)
        self.bridge.watches.add(self)
        c_timeline = getattr(self.timeline.native, "c_timeline", None)
        if c_timeline is not None:
            self.cwatch = self.bridge.native_watch(self, c_timeline)

    def rearm(self) -> None:
        """Attached again (and seen by the timeline's notifiers): publish the smallest
        value waited for, and wake what was reached meanwhile."""
        if self.heap and self._update_next():
            self.bridge.notify_here(self)

    def add(self, value: int, entry: Entry) -> None:
        """Park ``entry`` until ``value``; it is woken later, never from inside this call."""
        heapq.heappush(self.heap, (value, next(_sequence), entry))
        self.bridge.waiting += entry.task
        # Only a new smallest value is published: notifiers compare each advance with
        # `next`, so a watch armed at a smaller one already wakes the loop in time for
        # this entry (the drain then publishes the next smallest).
        if value < self.next:
            try:
                reached = self._publish(value)
            except BaseException:
                # Interrupted (a KeyboardInterrupt) as it published: `next` may say
                # `value` with the native watch not armed at it, and a later add for as
                # much would not publish it again (its wake-up lost). Published in full.
                if self._update_next():
                    self.bridge.notify_here(self)
                raise
            if reached:
                # Reached while publishing `next`: the notifier may have missed it, so
                # go through the bridge (in the loop's next slice) rather than wake inline.
                self.bridge.notify_here(self)

    def _publish(self, value: int) -> bool:
        """Set ``next``; return whether the timeline has already reached it (or ended:
        then every waiter is woken)."""
        self.next = value
        if self.timeline._ended:
            return True
        if self.cwatch is not None:
            return bool(self.bridge.arm(self.cwatch, min(value, _U64_MAX)))
        return self.timeline.native.value >= value

    def withdraw(self, entry: Entry) -> None:
        if not self.bridge.on_loop_thread():
            # Closed on another thread (a task dropped while it waited, by the garbage
            # collector there): the heap and the counts are the loop thread's.
            self.bridge.off_thread(functools.partial(self.withdraw, entry))
            return
        if entry.done:  # woken meanwhile (withdrawn from another thread, later)
            return
        entry.done = True
        entry.wake = _nothing  # it held the task and its loop: let them go now
        self.bridge.waiting -= entry.task
        self.withdrawn += 1
        # The heap changes in place: a withdraw can come from inside resolve() going
        # through this heap (a woken callback cancelling a trio task, whose abort runs
        # at once).
        if self.withdrawn == len(self.heap):
            self._update_next()  # none left: the watch goes
        # Cancelled waits for values never reached would pile up: rebuild when most are dead.
        elif self.withdrawn > 32 and self.withdrawn * 2 > len(self.heap):
            self.heap[:] = [item for item in self.heap if not item[2].done]
            heapq.heapify(self.heap)
            self.withdrawn = 0
            self._update_next()

    def wake_now(self) -> None:
        """The timeline was raised on the loop's own thread (a host signal from one of
        its tasks): wake the tasks it reached at once, as ``asyncio.Event.set`` does,
        rather than after the loop's next look at its pipe -- a loop iteration, and the
        slowest part of the way on a CPU that was idle. A callback's turn
        (``call_when_reached``), or more tasks than a slice, wait for the next slice as
        usual: a callback never runs inside the signal. A slice in all, per iteration of
        the loop, whatever the signals (a task raising a timeline value by value, each
        reaching one task of a crowd, or a timeline each): the rest go to the slices."""
        bridge = self.bridge
        if self.queued or bridge.dead or not self.heap:
            return
        budget = bridge.slice - bridge.woken_now
        if budget <= 0:  # (this iteration's slice is woken: the next slice's, if reached)
            if self.timeline._ended or self.heap[0][0] <= self.timeline.native.value:
                bridge.notify_here(self)
            return
        resolved = bridge.resolved
        left = self.resolve(budget, calls=False)
        if bridge.resolved != resolved:  # (0 left may also be a callback's turn)
            if not bridge.woken_now:
                bridge._call_soon(bridge._woken_now_reset)
            bridge.woken_now += bridge.resolved - resolved
        if left == 0:
            bridge.notify_here(self)

    def resolve(self, budget: int, calls: bool = True) -> int:
        """Wake the entries whose value is reached, ``budget`` tasks at most; return the
        budget left (0: it stopped there, and more may be due). With ``calls`` false it
        stops at a callback's entry instead of running it, returning 0."""
        heap, timeline, bridge, pop = self.heap, self.timeline, self.bridge, heapq.heappop
        while True:
            reached = INFINITY if timeline._ended else timeline.native.value
            while heap and heap[0][0] <= reached:
                if budget <= 0 or not (calls or heap[0][2].task or heap[0][2].done):
                    return 0
                value, _, entry = pop(heap)
                if entry.done:
                    self.withdrawn -= 1
                    continue
                entry.done = True
                if entry.task:
                    bridge.waiting -= 1
                    bridge.resolved += 1
                    budget -= 1
                    entry.wake()
                else:
                    self._call(entry, value)
            if not self._update_next():  # re-read after publishing next: see module doc
                return budget

    def _call(self, entry: Entry, value: int) -> None:
        """Run a callback's wake-up (``call_when_reached``): one that raises is logged and
        the waits after it still wake -- now, or (a BaseException, which goes on up) in a
        later slice."""
        try:
            entry.wake()
        except Exception:
            _log.exception("a callback waiting for value %d raised", value)
        except BaseException:
            self.bridge.notify_here(self)
            raise

    def _update_next(self) -> bool:
        heap = self.heap
        if heap and self.withdrawn == len(heap):
            # Only withdrawn waits left: let go of the watch (and of its native part,
            # armed at a value nobody waits for now) as when the last waiter is woken.
            heap.clear()
            self.withdrawn = 0
        if heap:
            return self._publish(heap[0][0])
        self.next = INFINITY
        # Let go of it (and free its native part) after the tasks just woken have run,
        # not on their way; one that parks on this timeline again by then keeps it.
        # Two turns of the loop later: trio runs a batch's tasks in random order, and
        # the woken tasks and a callback scheduled now share the next batch.
        if not self.dropping:
            self.dropping = True
            self.bridge._call_soon(self._drop_soon)
        return False

    def _drop_soon(self) -> None:
        self.bridge._call_soon(self._drop_if_idle)

    def _drop_if_idle(self) -> None:
        self.dropping = False
        if not self.heap:
            self.bridge.watches.discard(self)
            self.timeline._drop_watch(self)
            if self.cwatch is not None:
                self.bridge.drop_native_watch(self)


_sequence = itertools.count()


def _unloaded(*args: int) -> NoReturn:
    raise RuntimeError("the native runtime is not loaded")


def _nothing() -> None:
    """What a withdrawn entry's wake-up becomes (it let go of its task and loop)."""


_U64_MAX = (1 << 64) - 1


def _native_lib() -> Any:
    lib = _native.loaded()
    assert lib is not None
    return lib


class LoopBridge(ABC):
    """Per event loop: the pending watches and the one scheduled drain.

    Python notifiers (a completion thread) schedule the drain with the loop's own
    thread-safe call. Native threads instead write a byte to the bridge's pipe, which
    the loop watches; either way one wake-up drains everything reached so far.
    """

    def __init__(self) -> None:
        self._closing = threading.RLock()  # close() and release() run once, on any thread
        self._released = False
        self._pending: collections.deque[Watch] = collections.deque()
        self._scheduled = False
        self._continued = False  # a drain's next slice is scheduled on the loop
        self._ready: collections.deque[Entry] = collections.deque()  # woken in order
        self.dead = False
        self.wakeups = 0
        self.resolved = 0
        self.waiting = 0
        self.notifier: int | None = None  # the native notifier writing our pipe
        self.arm: Callable[[int, int], object] = _unloaded  # am_watch_arm, once loaded
        self._reset: Callable[[int], int] = _unloaded  # am_notifier_reset
        self._pipe: tuple[int, int] | None = None
        # The watches with a native part, which the loop goes through as it wakes: changed
        # in place on the loop's thread only; another thread replaces it (a loop seen
        # stopped may run again as it is set aside, see suspend). Both under
        # _native_lock, as is _handles: every native watch not freed yet (close frees
        # them), with the object of its native timeline, kept as long: a watch set aside
        # may go (its loop closed, its callbacks dropped) and its timeline with it, which
        # frees the native one -- before am_watch_free, which unlinks the watch from it.
        # Reentrant: a collection as it is held (at any allocation) may collect the loop,
        # whose finalizer closes the bridge on this thread (as for _closing).
        self._native_lock = threading.RLock()
        self._native_watches: set[Watch] = set()
        self._handles: dict[int, object] = {}
        self.watches: set[Watch] = set()  # every watch of this loop's, native or not
        # Watches set aside as the loop stopped (see suspend), by id of their timeline:
        # weakly, the loop holds them.
        self._detached: weakref.WeakValueDictionary[int, Watch] = weakref.WeakValueDictionary()
        self._awake_until = 0  # a perf_counter_ns: check native watches every iteration
        self.slice = WAKE_SLICE  # tasks the next slice wakes at most
        self.woken_now = 0  # tasks host signals on the loop's thread woke this iteration
        self._ready_first = False  # the last slice woke a crowd's tasks before watches
        self._step_ns = SLICE_BUDGET_NS // WAKE_SLICE  # a woken task's step, smoothed
        self._slice_began = 0  # a perf_counter_ns: when a full slice was woken (0: none)
        self._slice_woke = 0  # how many tasks it woke
        self._holding = False  # polling until a timer due within SLEEP_GRANULE
        self._hold_until = 0.0  # until then, on the loop's clock
        self._hold_wall = 0.0  # and at most until then, on time.perf_counter's
        self._hold_looks = 0  # looks left for such a timer, after a wake-up
        self.sleeps_coarsely = False  # the loop sleeps in whole SLEEP_GRANULEs, rounded up
        # Iterations after a wake-up in which to look for a timer: one where the tasks
        # just woken have run by then (asyncio runs callbacks in order).
        self.looks_after_wakeup = 1
        self.turn_limit = TURN_LIMIT  # turns a crowd's waits get per iteration of the loop
        self._turns = 0  # granted since the last mark
        # One turn asked for in TURN_SHARE is refused, at random: a count would refuse
        # the same task each time where as many ask per iteration as the count.
        self._refusal = random.Random().random  # noqa: S311 (a share, not a secret)
        self._ran_out = False  # the limit refused a turn since the last mark
        self._sharing = False  # ... or before it: turns are refused at random too
        self._asked = False  # a turn was asked for since the last mark
        self._probe_in = TURN_PROBE  # marks until a probe, while turn_limit is 0
        self._marking = False  # _turn_mark is scheduled
        self._marked_at = 0  # a perf_counter_ns: when it last ran (0: not in the iteration before)
        self._resolved_at_mark = 0  # self.resolved when it last ran

    def turn(self) -> bool:
        """Whether a crowd's wait may yield plainly now rather than park (see the module
        doc). Called on the loop's thread."""
        self._asked = True
        if not self._marking:
            self._marking = True
            self._marked_at = 0
            self._call_soon(self._turn_mark)
        if self._turns >= self.turn_limit:
            self._ran_out = self._sharing = True
            return False
        if self._sharing and self._refusal() * TURN_SHARE < 1:
            return False
        self._turns += 1
        return True

    def _turn_mark(self) -> None:
        """Once per iteration while turns are asked for: size the turns to the iteration."""
        now = time.perf_counter_ns()
        granted, self._turns = self._turns, 0
        woken, self._resolved_at_mark = self.resolved - self._resolved_at_mark, self.resolved
        asked, self._asked = self._asked, False
        self._sharing, self._ran_out = self._ran_out, False
        limit = self.turn_limit
        if self._marked_at and granted:  # it ran in the iteration before: that one took
            took = max(now - self._marked_at, 1)  # this long, with these steps in it
            # Sized by every step of the iteration, the tasks woken in slices as well as
            # those on a turn: the turns get what the slices leave of the budget's worth
            # of steps, but at least half of it. Without that half, the limit would fall
            # to none where the slices fill the budget by themselves; then every wait
            # parks, which keeps the slices full, and the loop stays there (at about
            # half the rate turns give). An iteration holds up to half a budget more.
            steps = (granted + woken) * TURN_BUDGET_NS // took
            fit = max(steps - woken, steps // 2)
            # Quick to fall, slow to rise: a mark may run early or late in its iteration
            # (trio shuffles a batch), so one iteration measured short says little.
            # To none only from one: twice over the budget with a single turn.
            if fit < limit:
                limit = fit if fit or limit == 1 else 1
            else:
                limit = min(TURN_MAX, fit, limit + limit // 8 + 1)
            self._probe_in = TURN_PROBE
        elif limit == 0 and asked:
            # None granted. The tasks a slice woke tell how long a step is (smoothed over
            # slices: one iteration gone long, the process descheduled or a collection,
            # says little); where steps of that length fit, a turn again at once. Else
            # a turn now and then measures again.
            steps = TURN_BUDGET_NS // (self._step_ns or 1) if woken else 0
            if max(steps - woken, steps // 2):
                limit = 1
                self._probe_in = TURN_PROBE
            else:
                self._probe_in -= 1
                if self._probe_in <= 0:
                    limit = 1
        self.turn_limit = limit
        if asked and not self.dead:
            self._marked_at = now
            self._call_soon(self._turn_mark)
        else:
            self._marking = False

    @abstractmethod
    def _call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop's thread soon; callable from any thread."""

    @abstractmethod
    def _call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the loop's next iteration; called on the loop's thread."""

    @abstractmethod
    def _watch_fd(self, fd: int) -> None:
        """Call :meth:`_drain_native` on the loop whenever ``fd`` is readable."""

    def _next_timer(self) -> tuple[float, float] | None:
        """(now, when the loop's next timer is due) on the loop's clock, in seconds; None
        if it has none. Only where ``sleeps_coarsely``."""
        return None

    def native_watch(self, watch: Watch, c_timeline: int) -> int | None:
        """A native watch on ``c_timeline`` that wakes this loop through its pipe: the
        one ``watch`` has kept, if it was set aside with it (see ``suspend``). Called on
        the loop's thread."""
        lib = _native_lib()
        if self.notifier is None:
            rfd, wfd = os.pipe()
            os.set_blocking(rfd, False)
            os.set_blocking(wfd, False)
            self._pipe = (rfd, wfd)
            self.notifier = lib.am_notifier_new(wfd)
            self.arm = _native.fast_call(lib, "am_watch_arm")
            self._reset = _native.fast_call(lib, "am_notifier_reset")
            self._watch_fd(rfd)
        handle = watch.cwatch
        if handle is None:
            handle = lib.am_watch_new(c_timeline, self.notifier)  # (None in a fork's child)
        with self._native_lock:
            if handle is not None:
                self._handles[handle] = watch.timeline.native
            self._native_watches.add(watch)
        return handle

    def drop_native_watch(self, watch: Watch) -> None:
        """Free ``watch``'s native part, unless ``close`` has. Called on the loop's
        thread: the loop may be arming it (only ``close``, once the loop is gone, frees
        native watches elsewhere)."""
        handle, watch.cwatch = watch.cwatch, None
        with self._native_lock:
            self._native_watches.discard(watch)
            if handle is None or handle not in self._handles:
                return
            native = self._handles.pop(handle)  # (let go of once the watch is freed)
        _native_lib().am_watch_free(handle)
        del native

    def _drain_native(self) -> None:
        """The pipe is readable: resolve every native watch that was reached."""
        assert self.notifier is not None and self._pipe is not None
        # Empty the pipe, then re-arm, then read values: in this order a byte written by
        # a native thread is either still unread after re-arming or its value is seen.
        # One read empties it: the notifier writes one byte until it is re-armed.
        # A completion thread may have woken the loop ahead of a long command's end
        # (am_timeline_near): then the loop stays awake until shortly after it.
        # (A try rather than contextlib.suppress: its three Python calls cost ~10 us on a
        # CPU just woken from an idle sleep, as this loop's is, on the way to the tasks
        # it wakes.)
        try:  # noqa: SIM105
            os.read(self._pipe[0], 4096)
        except BlockingIOError:
            pass
        awake_until = self._reset(self.notifier)
        self.wakeups += 1
        if not self._continued:  # else the slice scheduled next does it
            self._resolve()
        if awake_until and awake_until > (now := time.perf_counter_ns()):
            self.stay_awake(min(awake_until - now, AHEAD_AWAKE_NS))
        self._hold_for_timer()

    @abstractmethod
    def on_loop_thread(self) -> bool:
        """Whether the calling thread is the one running this bridge's loop now."""

    def close(self) -> None:
        """The loop is gone: detach every native watch, then release the pipe. Once,
        from whichever thread gets here first (a finalizer, a new loop's release)."""
        with self._closing:
            self.dead = True
            # (made before: an allocation under the lock may collect the loop, whose
            # finalizer closes the bridge inside, on this thread, freeing what this then
            # took too)
            no_watches: set[Watch] = set()
            no_handles: dict[int, object] = {}
            with self._native_lock:
                watches, self._native_watches = self._native_watches, no_watches
                handles, self._handles = self._handles, no_handles
            # (Also those set aside, which kept theirs: see suspend.)
            for watch in [*watches, *self._detached.values()]:
                watch.cwatch = None
            for handle in handles:  # (their timelines let go of after)
                _native_lib().am_watch_free(handle)
            del handles
            if self.notifier is not None:
                _native_lib().am_notifier_free(self.notifier)
                self.notifier = None
            if self._pipe is not None and not self._pipe_kept():
                for fd in self._pipe:
                    os.close(fd)
                self._pipe = None

    def _pipe_kept(self) -> bool:
        """Whether ``close`` leaves the pipe to another thread, which closes it (it may
        be waiting on it now)."""
        return False

    def release(self) -> None:
        """The loop closed with tasks still parked (an asyncio loop closed without
        cancelling them; ``asyncio.run`` cancels them): let go of them and of every
        watch, which would otherwise keep the timelines holding the tasks, their futures
        and the loop itself, and so the pipe, for good. The tasks, unreachable then, are
        closed by the garbage collector."""
        self.close()
        with self._closing:
            if self._released:
                return
            self._released = True
        for watch in list(self.watches) + list(self._detached.values()):
            for _, _, entry in watch.heap:
                entry.done = True
                entry.wake = _nothing
            watch.heap.clear()  # (in place, as everywhere: see Watch.withdraw)
            watch.withdrawn = 0
            watch.timeline._drop_watch(watch)
        self.watches.clear()
        self._detached.clear()
        for entry in self._ready:
            entry.done = True
            entry.wake = _nothing
        self._ready.clear()
        self._pending.clear()
        self.waiting = 0

    def take_detached(self, timeline: Watched) -> Watch | None:
        """The watch on ``timeline`` that this loop set aside as it stopped (see
        ``suspend``), to attach again; None if there is none."""
        if not self._detached:  # (most often: a pop costs more)
            return None
        watch = self._detached.pop(id(timeline), None)
        return watch if watch is not None and watch.timeline is timeline else None

    def suspend(self) -> bool:
        """The loop has stopped, and may never run again (the thread that ran it has
        ended, or runs another loop now): the timelines let go of its watches, and so of
        its parked tasks and the loop, which now hold one another only. The loop is
        handed what it needs to take them back, a callback that runs as it runs again
        (``resume``); a loop that nothing else holds is garbage, and its bridge closes
        (the finalizer of ``_AsyncioBridge``) -- as an asyncio loop lets go of a task
        waiting on a socket. Called on any thread; never while the loop runs. Returns
        whether it set anything aside.

        The loop may have started on another thread since it was seen stopped, its
        tasks parking and being woken now: whatever this takes from it goes back as
        that callback runs. So this changes in place nothing the loop goes through (the
        set of native watches: it replaces it), and frees no native watch, which the
        loop may be arming: a watch set aside keeps its own, registered with its
        timeline (whose notifier may write to the pipe meanwhile), and takes it back
        with it; the callback frees those it does not take back, on the loop's thread,
        and ``close`` those of a loop that never runs again."""
        with self._closing:
            if self.dead or self._released:
                return False
            taken = list(self.watches)  # (the loop may be adding to it)
            if not (self._ready or any(watch.heap for watch in taken)):
                return False  # (empty watches hold nothing of the loop's)
            # What is set aside, filled in below; the loop's callback reads it under
            # _closing, so once this is done.
            watches: list[Watch] = []
            ready: list[Entry] = []
            pending: list[Watch] = []
            try:
                self._call_soon_threadsafe(functools.partial(self.resume, watches, ready, pending))
            except RuntimeError:  # the loop closed meanwhile (or is gone)
                return False
            for watch in taken:
                self.watches.discard(watch)
                watch.queued = False
                # Also one with no waiter now: a task of the loop started meanwhile may
                # be adding one (a park takes the watch back, as resume does). Set aside
                # before the timeline lets go of it: a park that finds it no more there
                # finds it here.
                watch.detached = True
                self._detached[id(watch.timeline)] = watch
                watch.timeline._drop_watch(watch)
                watches.append(watch)
            with self._native_lock:  # (not one that a park took back meanwhile)
                self._native_watches = {
                    watch for watch in self._native_watches if not watch.detached
                }
            # (swapped, not cleared: what is added meanwhile stays, or goes back)
            taken_pending, self._pending = self._pending, collections.deque()
            taken_ready, self._ready = self._ready, collections.deque()
            pending.extend(taken_pending)
            ready.extend(taken_ready)
            return True

    def resume(self, watches: list[Watch], ready: list[Entry], pending: list[Watch]) -> None:
        """The loop runs again (``suspend``'s callback): take its watches back, and free
        the native part of those not taken back (all their waits withdrawn)."""
        with self._closing:  # (after the suspend, where it overtook it)
            pass
        for watch in pending:  # (queued as it was set aside: looked at again below)
            watch.queued = False
        for watch in watches:
            if watch.detached and watch.heap and not self.dead:  # (not all withdrawn)
                # (A park may have registered it as it was set aside: it goes, and comes
                # back attached.)
                watch.timeline._drop_watch(watch)
                self._detached[id(watch.timeline)] = watch
                watch.timeline._watch_for(self)  # (takes it back)
            if watch.detached and watch.cwatch is not None:
                self.drop_native_watch(watch)  # (a park that takes it later makes one)
        for entry in ready:
            if not entry.done:
                self._ready.append(entry)  # (still counted as waiting)
                self._schedule_slice()
        for watch in pending:
            if not watch.detached:  # (one still set aside is looked at as it comes back)
                self.notify_here(watch)

    def _woken_now_reset(self) -> None:
        """The loop's next iteration after host signals woke tasks (``Watch.wake_now``):
        its signals may wake a slice again."""
        self.woken_now = 0

    def notify(self, watch: Watch) -> None:
        """Called from any thread once ``watch.timeline`` reached ``watch.next``."""
        if watch.queued or self.dead:
            return
        watch.queued = True
        self._queue_pending(watch)
        if not self._scheduled:
            self._scheduled = True
            try:
                self._call_soon_threadsafe(self._drain)
            except Exception:  # the loop closed (asyncio RuntimeError, trio RunFinishedError)
                self.dead = True

    def _queue_pending(self, watch: Watch) -> None:
        """Append ``watch`` to the pending watches: to the deque there now, also where a
        ``suspend`` (another thread) swapped it for a new one between the read and the
        append -- having maybe taken what was in the old one before this came, which
        would leave the watch marked as queued in a deque nobody reads, never looked at
        again. (A watch queued twice is looked at twice: the second finds nothing.)"""
        pending = self._pending
        pending.append(watch)
        while self._pending is not pending:
            pending = self._pending
            pending.append(watch)

    def _schedule_slice(self) -> None:
        """Resolve a slice in the loop's next iteration (called on the loop's thread)."""
        if not self._continued:
            self._continued = True
            self._call_soon(self._resolve)

    def add_ready(self, entry: Entry) -> None:
        """Wake ``entry`` in a coming slice (its value is reached: a crowd's turn)."""
        self._ready.append(entry)
        self.waiting += 1
        self._schedule_slice()

    def withdraw_ready(self, entry: Entry) -> None:
        if not self.on_loop_thread():  # as Watch.withdraw
            self.off_thread(functools.partial(self.withdraw_ready, entry))
            return
        if entry.done:
            return
        entry.done = True  # skipped when its turn comes
        entry.wake = _nothing  # it held the task and its loop: let them go now
        self.waiting -= 1

    def off_thread(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop's thread; called from another one. Nothing if the loop
        is gone (its waiters went with it)."""
        if self.dead:
            return
        try:
            self._call_soon_threadsafe(fn)
        except Exception:  # the loop closed (asyncio RuntimeError, trio RunFinishedError)
            self.dead = True

    def notify_here(self, watch: Watch) -> None:
        """``notify`` from the loop's own thread: no wake-up, the next slice."""
        if watch.queued or self.dead:
            return
        watch.queued = True
        self._queue_pending(watch)
        self._schedule_slice()

    def _drain(self) -> None:
        self.wakeups += 1
        self._scheduled = False
        if not self._continued:  # else the slice scheduled next does it
            self._resolve()
        self._hold_for_timer()

    def _hold_for_timer(self) -> None:
        """After a wake-up the bridge caused: look in the loop's next iteration(s), once the
        tasks just woken have run, for a timer due within ``SLEEP_GRANULE``, and if there
        is one keep the loop polling until it is due (see the module doc)."""
        if not self.sleeps_coarsely:
            return
        self._hold_looks = self.looks_after_wakeup
        if not self._holding:
            self._holding = True
            self._call_soon(self._hold_tick)

    def _sleep_precisely(self, seconds: float) -> bool:
        """Block the loop's thread for up to ``seconds``, woken at once by any of the
        loop's descriptors, if nothing else is ready to run. Whether the loop may go on
        holding for a timer without polling idle: it slept, or it has other work."""
        return False

    def _hold_tick(self) -> None:
        if not self.dead:
            looking = self._hold_looks > 0
            self._hold_looks -= looking
            holding = False
            timer = self._next_timer()
            if timer is not None:
                now, when = timer
                if looking and now < when < now + SLEEP_GRANULE and when > self._hold_until:
                    self._hold_until = when  # the timer due next: hold until it is due
                    # ... and no longer in real time: a loop whose clock stands still
                    # while it polls (trio's MockClock, an asyncio loop on virtual time)
                    # would never reach it, nor ever sleep.
                    self._hold_wall = time.perf_counter() + (when - now)
                holding = now < self._hold_until and time.perf_counter() < self._hold_wall
            if holding and _native.cores_taken():
                # polling would take a busy queue's core: sleep until the timer is due
                ahead = min(self._hold_until - now, self._hold_wall - time.perf_counter())
                try:
                    slept = self._sleep_precisely(ahead)
                except BaseException:  # (a signal handler's, raised in select: Ctrl-C's)
                    self._holding = False  # (the next wake-up holds again)
                    self._hold_until = self._hold_wall = 0.0
                    self._hold_looks = 0
                    raise
                if slept:
                    self._call_soon(self._hold_tick)
                    return
            elif self._hold_looks or holding:
                self._call_soon(self._hold_tick)  # the loop polls in its next iteration
                return
        self._holding = False
        self._hold_until = self._hold_wall = 0.0
        self._hold_looks = 0

    def _resolve(self) -> None:
        """Wake a slice of the waiters reached; if more may be due, go on in the loop's
        next iteration. Two kinds wait: a crowd's tasks whose turn in a slice came
        (``_ready``), and the watches reached (queued by notifiers, or native ones whose
        wake-up came through the pipe). No kind, and no watch, may take every slice
        while the others wait: the crowd's tasks and the watches go first in alternate
        slices, and a watch that used up a slice goes behind the others (a crowd kept
        busy by one queue would otherwise leave the tasks of another queue parked for as
        long as it lasts)."""
        self._continued = False
        began = time.perf_counter_ns()
        if self._slice_began:
            # The previous slice was full and this one follows it: what the loop ran in
            # between (its woken tasks' steps, chiefly) sizes the slices to come.
            step = (began - self._slice_began) // self._slice_woke
            self._step_ns = (self._step_ns * 3 + step) >> 2
            self.slice = max(1, min(WAKE_SLICE, SLICE_BUDGET_NS // (self._step_ns or 1)))
            self._slice_began = 0
        size = self.slice
        self._ready_first = ready_first = not self._ready_first
        if ready_first:
            budget = self._wake_watches(self._wake_ready(size))
        else:
            budget = self._wake_ready(self._wake_watches(size))
        if budget == 0:
            self._slice_began, self._slice_woke = began, size
            self._schedule_slice()

    def _wake_ready(self, budget: int) -> int:
        """Wake up to ``budget`` of a crowd's tasks whose turn came; return the rest."""
        ready = self._ready
        while ready and budget:
            entry = ready.popleft()
            if not entry.done:
                entry.done = True
                self.waiting -= 1
                self.resolved += 1
                budget -= 1
                entry.wake()
        return budget

    def _wake_watches(self, budget: int) -> int:
        """Wake up to ``budget`` tasks of the watches reached, in the order they were
        reached; return the budget left. Native watches reached (their wake-up came
        through the pipe) join the queue behind those already in it."""
        pending = self._pending
        for watch in self._native_watches:
            if not watch.queued and watch.timeline.native.value >= watch.next:
                watch.queued = True
                pending.append(watch)
        while pending and budget:
            watch = pending.popleft()
            watch.queued = False
            budget = watch.resolve(budget)
            if budget == 0:
                if not watch.queued:
                    watch.queued = True
                    pending.append(watch)  # behind the others queued
                return 0
        return budget

    def wake_now(self, watch: Watch) -> None:
        """``watch.wake_now()``, in the step of the task that signalled."""
        watch.wake_now()

    def stay_awake(self, ns: int) -> None:
        """For ``ns``, read the native watches' timelines in every iteration of the loop
        (which then does not sleep) and wake what they reached without a wake-up through
        the pipe: a sleeping loop takes tens of microseconds to wake, more after a long
        idle. Only while tasks wait on native timelines, and not while the cpu device's
        busy queue threads need every core (``_native.cores_taken``). Called on the
        loop's thread."""
        if _native.cores_taken():
            return
        until = time.perf_counter_ns() + ns
        if self._awake_until < until:
            if self._awake_until == 0:
                self._call_soon(self._awake_tick)
            self._awake_until = until

    def _awake_tick(self) -> None:
        for watch in list(self._native_watches):
            if watch.timeline.native.value >= watch.next:
                if not self._continued:
                    self._resolve()
                break
        if (
            self._native_watches
            and time.perf_counter_ns() < self._awake_until
            and not _native.cores_taken()
        ):
            self._call_soon(self._awake_tick)
        else:
            self._awake_until = 0

    def statistics(self) -> LoopStatistics:
        return LoopStatistics(self.wakeups, self.resolved, self.waiting)

    @abstractmethod
    async def park(self, watch: Watch | None, value: int) -> None:
        """Wait, as the calling task, until ``watch``'s timeline reaches ``value``; with
        no watch (the value is reached), until a coming slice wakes it."""

    def parked(self, watch: Watch | None, value: int) -> Generator[Any, Any, None]:
        """``park``'s steps, for ``yield from`` in a generator-based coroutine (every
        wait's way: ``_timeline.wait_value``). A generator: nothing is made until it
        runs (an interrupt as it is returned leaves no coroutine unawaited)."""
        yield from self.park(watch, value).__await__()


class _AsyncioBridge(LoopBridge):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._loop_ref = weakref.ref(loop)  # weak: the bridge must not keep the loop alive
        weakref.finalize(loop, self.close)
        # asyncio's epoll and poll selectors (uvloop has neither, nor says when its next
        # timer is due: libuv's timers are whole milliseconds anyway).
        selector = getattr(loop, "_selector", None)
        self.sleeps_coarsely = isinstance(selector, _COARSE_SELECTORS) and hasattr(
            loop, "_scheduled"
        )
        self._pid = os.getpid()
        self.thread = 0  # the thread the loop ran on when last seen (made on it)
        self.thread_gone = False  # it has ended since
        self._thread_mark = 0
        self._adopt_thread()

    def _adopt_thread(self) -> None:
        """The loop runs on the calling thread: have its end looked at (``thread_ended``)."""
        holder: _ThreadEnd | None = getattr(_thread_end, "holder", None)
        if holder is None:
            holder = _thread_end.holder = _ThreadEnd()
        self.thread = _get_ident()
        self.thread_gone = False
        self._thread_mark = holder.mark(self)

    def thread_ended(self, mark: int) -> None:
        """The thread the loop ran on when last seen has ended (called as it ends): a
        loop it left stopped sets its waiters aside (``suspend``), as one may never run
        again; one it left closed lets go of them (``release``)."""
        if mark != self._thread_mark:  # (seen on another thread since)
            return
        self.thread_gone = True
        self.left_behind()

    def left_behind(self) -> None:
        """The thread the loop ran on has ended, or runs another loop now: if it left
        the loop stopped, set its waiters aside; closed, let go of them."""
        loop = self._loop_ref()
        if loop is None or os.getpid() != self._pid:
            # (In a forked child, whose copies of other threads' states are cleared as
            # it starts: the parent's loops and timelines are the parent's.)
            return
        if loop.is_closed():
            if self.watches or self._native_watches or self._detached or self._handles:
                self.release()
        elif not loop.is_running():
            self.suspend()

    def resume(self, watches: list[Watch], ready: list[Entry], pending: list[Watch]) -> None:
        if self.thread_gone or self.thread != _get_ident():
            self._adopt_thread()
        super().resume(watches, ready, pending)

    def on_loop_thread(self) -> bool:
        # Its loop is running on this thread (a loop may run on one thread, then another).
        return _get_running_loop() is self._loop_ref()

    def _call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        loop = self._loop_ref()
        if loop is None:
            raise RuntimeError("the loop is gone")
        loop.call_soon_threadsafe(fn)

    def _call_soon(self, fn: Callable[[], None]) -> None:
        loop = self._loop_ref()
        if loop is not None:
            loop.call_soon(fn)

    def _watch_fd(self, fd: int) -> None:
        loop = self._loop_ref()
        assert loop is not None
        loop.add_reader(fd, self._drain_native)

    def _sleep_precisely(self, seconds: float) -> bool:
        loop = self._loop_ref()
        # (PollSelector has no descriptor of its own: the hold ends, as trio's)
        fileno = getattr(getattr(loop, "_selector", None), "fileno", None)
        if fileno is None:
            return False
        # (asyncio's ready callbacks: the rest of this iteration's, and any added since)
        if getattr(loop, "_ready", None):
            return True  # the next iteration has work: no sleep, no idle poll
        try:  # select: microseconds (epoll and poll: whole milliseconds, rounded up)
            select.select([fileno()], [], [], max(seconds, 0.0))
        except (ValueError, OSError):  # a descriptor past select's FD_SETSIZE
            return False
        return True

    def _next_timer(self) -> tuple[float, float] | None:
        loop = self._loop_ref()
        # What asyncio's own loop reads to choose its sleep (BaseEventLoop._run_once).
        scheduled = getattr(loop, "_scheduled", None)
        if loop is None or not scheduled:
            return None
        return loop.time(), scheduled[0].when()

    async def park(self, watch: Watch | None, value: int) -> None:
        await _Parked(self.parked(watch, value))

    def parked(self, watch: Watch | None, value: int) -> Generator[Any, Any, None]:
        # A generator, not a coroutine: a wait's park makes no coroutine object, and its
        # wake-up resumes one frame fewer.
        loop = self._loop_ref()
        assert loop is not None
        if self.thread != _get_ident() or self.thread_gone:
            self._adopt_thread()  # (the loop moved to another thread)
        future: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not future.done():
                future.set_result(None)

        entry = Entry(wake)
        if watch is None:
            self.add_ready(entry)
        else:
            watch.add(value, entry)
        try:
            yield from future
        except BaseException:
            if not entry.done:
                if watch is None:
                    self.withdraw_ready(entry)
                else:
                    watch.withdraw(entry)
            raise


class _Parked:
    """An awaitable of a generator of ``parked``'s."""

    __slots__ = ("steps",)

    def __init__(self, steps: Generator[Any, Any, None]) -> None:
        self.steps = steps

    def __await__(self) -> Generator[Any, Any, None]:
        return self.steps


class _ThreadEnd:
    """Held by a thread-local of each thread that ran an asyncio loop with a bridge, so
    dropped as that thread ends: it tells the bridges of the loops last seen on it."""

    __slots__ = ("bridges",)

    def __init__(self) -> None:
        self.bridges: weakref.WeakKeyDictionary[_AsyncioBridge, int] = weakref.WeakKeyDictionary()

    def mark(self, bridge: _AsyncioBridge) -> int:
        self.bridges[bridge] = mark = next(_thread_marks)
        return mark

    def __del__(self) -> None:
        if _is_finalizing():  # (the interpreter's end: its loops go with it)
            return
        for bridge, mark in list(self.bridges.items()):
            try:
                bridge.thread_ended(mark)
            except Exception:  # (nowhere to raise to: the thread has ended)
                _log.exception("letting go of a loop whose thread ended")


_thread_end = threading.local()
_thread_marks = itertools.count(1)
_is_finalizing = sys.is_finalizing
_get_ident = threading.get_ident


class _TrioBridge(LoopBridge):
    """A trio run's bridge. Its pipe is read by a system task; but trio cancels its
    system tasks as the run ends, and the run goes on a while after that: the other
    system tasks' cleanup runs, then the async generators left unfinished are finalized
    (an ``async with`` device's close among them) -- and these may await. From the
    reader's end on, a thread watches the pipe and hands each wake-up to the run
    (``run_sync_soon``); the bridge closes once the run has ended (``after_run``)."""

    def __init__(self) -> None:
        import trio

        global _trio_wake_now
        super().__init__()
        if _trio_wake_now is None:
            _trio_wake_now = trio.lowlevel.enable_ki_protection(_wake_now)
        self._run_sync_soon = trio.lowlevel.current_trio_token().run_sync_soon
        self._thread = threading.get_ident()  # the run's (made there)
        self.sleeps_coarsely = _TRIO_SLEEPS_COARSELY
        self.looks_after_wakeup = 2  # trio runs a batch's tasks in random order
        self._next_deadline = _trio_next_deadline_reader()
        self._current_time = trio.current_time
        self._reader_ended = False  # the system task reading the pipe has ended
        self._watcher: threading.Thread | None = None  # reads it from then on
        self._drained = threading.Event()  # the wake-up it handed over has run
        trio.lowlevel.add_instrument(_run_end_instrument(self))

    def wake_now(self, watch: Watch) -> None:
        # In a user task's step, where trio raises a Ctrl-C at any point unless the frame
        # is protected: one between a heap's pop and its entry marked done would lose a
        # wait (the bridge's other wake-ups run where trio delivers none).
        assert _trio_wake_now is not None
        _trio_wake_now(watch)

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self._thread  # (a trio run stays on its thread)

    def _call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        self._run_sync_soon(fn)

    def _call_soon(self, fn: Callable[[], None]) -> None:
        try:
            self._run_sync_soon(fn)
        except RuntimeError:  # trio.RunFinishedError: called among the run's last callbacks
            self.dead = True

    def _watch_fd(self, fd: int) -> None:
        import trio

        async def reader() -> None:
            try:
                while True:
                    await trio.lowlevel.wait_readable(fd)
                    self._drain_native()
            finally:  # the run is ending: its system tasks are cancelled
                self._reader_ended = True
                if self._native_watches:
                    self._watch_on_thread(fd)

        if self._reader_ended:  # (a run's system tasks are not spawned again)
            self._watch_on_thread(fd)
            return
        try:
            trio.lowlevel.spawn_system_task(reader, name="asyncmetal-bridge")
        except RuntimeError:  # its system tasks have all ended: the run is ending
            self._reader_ended = True
            self._watch_on_thread(fd)

    def native_watch(self, watch: Watch, c_timeline: int) -> int | None:
        handle = super().native_watch(watch, c_timeline)
        if self._reader_ended and self._watcher is None and self._pipe is not None:
            self._watch_on_thread(self._pipe[0])  # a new wait after the reader's end
        return handle

    def _watch_on_thread(self, fd: int) -> None:
        """Watch the pipe on a thread of its own until the run has ended (see the class
        doc): it hands each wake-up to the run and waits for it to have run."""
        with self._closing:
            if self.dead or self._watcher is not None:
                return
            self._watcher = threading.Thread(
                target=self._watch_pipe, args=(fd,), name="asyncmetal-bridge", daemon=True
            )
            self._watcher.start()

    def _watch_pipe(self, fd: int) -> None:
        poll = select.poll()  # (select.select refuses descriptors from FD_SETSIZE on)
        poll.register(fd, select.POLLIN)
        try:
            while not self.dead:
                poll.poll()
                self._drained.clear()
                if self.dead:  # (after the clear: a close sets dead, then _drained)
                    break
                try:
                    self._run_sync_soon(self._drain_handed_over)
                except RuntimeError:  # trio.RunFinishedError: the run has ended
                    break
                self._drained.wait()
        finally:
            self._watcher = None
            self.close()  # (the pipe is this thread's to close)

    def _drain_handed_over(self) -> None:
        try:
            if not self.dead:
                self._drain_native()
        finally:
            self._drained.set()

    def _pipe_kept(self) -> bool:
        watcher = self._watcher
        if watcher is None or watcher is threading.current_thread():
            return False
        assert self._pipe is not None
        with contextlib.suppress(OSError):  # wake it: it ends, and closes the pipe
            os.write(self._pipe[1], b"\0")
        self._drained.set()
        return True

    def run_ended(self) -> None:
        """The run has ended: close, and let the pipe's watcher end (not left behind)."""
        watcher = self._watcher
        self.close()
        if watcher is not None:
            watcher.join(1.0)

    def _next_timer(self) -> tuple[float, float] | None:
        when = self._next_deadline()
        return None if when == float("inf") else (self._current_time(), when)

    async def park(self, watch: Watch | None, value: int) -> None:
        import trio

        task = trio.lowlevel.current_task()
        entry = Entry(lambda: trio.lowlevel.reschedule(task))

        def abort(_: Any) -> trio.lowlevel.Abort:
            if watch is None:
                self.withdraw_ready(entry)
            else:
                watch.withdraw(entry)
            return trio.lowlevel.Abort.SUCCEEDED

        try:
            if watch is None:
                self.add_ready(entry)
            else:
                watch.add(value, entry)
        except BaseException:
            # Interrupted (a KeyboardInterrupt: trio raises Ctrl-C in whatever code its
            # task runs) maybe with the entry in: its wake-up would reschedule the task
            # once the value came, blocked elsewhere by then (trio: "Should never have
            # been rescheduled!"). It does nothing now (still counted until then).
            entry.wake = _nothing
            raise
        await trio.lowlevel.wait_task_rescheduled(abort)


def _wake_now(watch: Watch) -> None:
    watch.wake_now()


# _wake_now with trio's KeyboardInterrupt protection, once a trio run made a bridge.
_trio_wake_now: Callable[[Watch], None] | None = None


def _run_end_instrument(bridge: _TrioBridge) -> Any:
    """A trio instrument that runs ``bridge.run_ended`` once its run has ended."""
    import trio

    class RunEnd(trio.abc.Instrument):
        def after_run(self) -> None:
            bridge.run_ended()

    return RunEnd()


# Selectors that sleep in whole milliseconds (rounded up); kqueue and select do not.
_COARSE_SELECTORS = tuple(
    getattr(selectors, name)
    for name in ("EpollSelector", "PollSelector", "DevpollSelector")
    if hasattr(selectors, name)
)
# trio sleeps in epoll (Linux) or IOCP (Windows), both in milliseconds; kqueue elsewhere.
_TRIO_SLEEPS_COARSELY = sys.platform.startswith("linux") or sys.platform == "win32"


def _trio_next_deadline_reader() -> Callable[[], float]:
    """A reader of when the running trio run's next deadline is due, on its clock (inf:
    none): what its run loop reads to choose its sleep. trio.lowlevel.current_statistics()
    says it too, but also counts every file descriptor the run waits on (a server's
    thousands of sockets, at each of the hold's looks); it stands in where trio's
    internals differ."""
    import trio

    try:
        from trio._core._run import GLOBAL_RUN_CONTEXT

        GLOBAL_RUN_CONTEXT.runner.deadlines.next_deadline  # noqa: B018 (present?)
    except (ImportError, AttributeError):

        def from_statistics() -> float:
            seconds = trio.lowlevel.current_statistics().seconds_to_next_deadline
            return float(trio.current_time() + seconds)

        return from_statistics

    def next_deadline() -> float:  # the run's own, looked up each time: none is kept
        return float(GLOBAL_RUN_CONTEXT.runner.deadlines.next_deadline())

    return next_deadline


def running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The asyncio (or uvloop) loop running the calling task, or None -- also inside a
    task of a trio run hosted by that loop (``trio.lowlevel.start_guest_run``), where
    the thread's running asyncio loop is the host's."""
    loop = _get_running_loop()
    if loop is not None and "trio" in sys.modules and in_trio_task():
        return None
    return loop


def in_trio_task() -> bool:
    """Whether the calling code runs as a trio task (trio is imported)."""
    global _trio_run_context
    if _trio_run_context is None:
        trio = sys.modules["trio"]
        try:  # what trio sets while it runs a task's step, and deletes after it
            _trio_run_context = trio._core._run.GLOBAL_RUN_CONTEXT
            _trio_run_context.__dict__  # noqa: B018 (a threading.local: its thread's dict)
        except AttributeError:  # another trio's layout: ask it, each time
            _trio_run_context = None
            try:
                trio.lowlevel.current_task()
            except RuntimeError:
                return False
            except AttributeError:  # a trio still being imported (another thread's):
                return False  # no task of it runs yet
            return True
    # (Its thread's dict: hasattr would raise and catch an AttributeError in every
    # await of an asyncio loop of a process that imported trio, ~0.4 us each.)
    return "task" in _trio_run_context.__dict__


_trio_run_context: Any = None  # trio's per-thread run state, once looked up


def running_trio_run() -> object | None:
    """The trio run on this thread (its runner: one per ``trio.run``), or None."""
    trio = sys.modules.get("trio")
    if trio is None:  # never imported: no trio run anywhere
        return None
    try:
        return trio._core._run.GLOBAL_RUN_CONTEXT.runner  # type: ignore[no-any-return]
    except AttributeError:  # none on this thread (or another trio's layout)
        try:
            return trio.lowlevel.current_trio_token()  # type: ignore[no-any-return]
        except RuntimeError:
            return None


_asyncio_bridges: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopBridge] = (
    weakref.WeakKeyDictionary()
)
_trio_bridge_var: Any = None
_bridges_lock = threading.Lock()


def _new_bridges_lock() -> None:
    """In a forked child: a parent thread may have held the lock at the fork (making
    its loop's bridge); the child's first loop makes one too."""
    global _bridges_lock
    _bridges_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_bridges_lock)


def current_bridge() -> LoopBridge:
    """The bridge of the running loop (asyncio, uvloop or trio), made on first use."""
    loop = _get_running_loop()  # (running_asyncio_loop(), inline: this is every park's)
    if loop is None or ("trio" in sys.modules and in_trio_task()):
        return _current_trio_bridge()
    last_loop, last = _last_asyncio_bridge  # (a weak reference to a loop, its bridge)
    if last is not None and last_loop() is loop:
        return last
    bridge = _asyncio_bridges.get(loop)
    if bridge is None:
        with _bridges_lock:  # (inserts, and the look for closed loops, one at a time)
            bridge = _asyncio_bridges.get(loop)
            if bridge is None:
                bridge = _asyncio_bridges[loop] = _AsyncioBridge(loop)
            closed = _closed_loops_bridges()
            stopped = _stopped_loops_bridges()
        for other in closed:
            other.release()
        for other in stopped:
            other.suspend()
    _switch_here(bridge)
    _remember(loop, bridge)
    return bridge


def _switch_here(bridge: LoopBridge) -> None:
    """The calling thread's running loop is ``bridge``'s: the one it ran before, if it
    stopped there with tasks parked, sets them aside (``LoopBridge.suspend``) -- it may
    never run again (nothing else may hold it)."""
    last_ref: Callable[[], LoopBridge | None] = getattr(_thread_end, "last", _no_loop)
    last = last_ref()
    if last is bridge:
        return
    _on_switch()  # (first: an interrupt before the next line leaves the switch unnoted)
    _thread_end.last = weakref.ref(bridge)
    if isinstance(last, _AsyncioBridge) and last.thread == _get_ident():
        last.left_behind()


_on_switch: Callable[[], None] = _nothing


def on_switch(callback: Callable[[], None]) -> None:
    """Have ``callback`` called on a thread whose running loop's bridge is another than
    the last one ``current_bridge`` found there (``_switch_here``): what keeps the
    bridge of the thread's loop (_timeline's wait counts) forgets it, so that its next
    wait asks ``current_bridge`` again."""
    global _on_switch
    _on_switch = callback


def _closed_loops_bridges() -> list[LoopBridge]:
    """The bridges of asyncio loops closed with tasks still parked, to release (see
    ``LoopBridge.release``): looked for as a new loop's bridge is made."""
    return [
        bridge
        for loop, bridge in list(_asyncio_bridges.items())
        if loop.is_closed()
        and not bridge._released
        and (bridge.watches or bridge._native_watches or bridge._handles)
    ]


def _stopped_loops_bridges() -> list[LoopBridge]:
    """The bridges of asyncio loops stopped, not closed, with tasks still parked, that
    were last seen on a thread that has ended, to suspend (see ``LoopBridge.suspend``):
    looked for as a new loop's bridge is made (where the loop moved to another thread
    as that one ended, see ``thread_ended``)."""
    return [
        bridge
        for loop, bridge in list(_asyncio_bridges.items())
        if isinstance(bridge, _AsyncioBridge)
        and bridge.thread_gone
        and (bridge.watches or bridge._ready)
        and not loop.is_closed()
        and not loop.is_running()
    ]


def _remember(loop: asyncio.AbstractEventLoop, bridge: LoopBridge) -> None:
    """Keep the last loop's bridge at hand: most processes run one loop, and looking it
    up in the weak dictionary on every await costs more than the rest of the lookup."""
    global _last_asyncio_bridge
    _last_asyncio_bridge = (weakref.ref(loop), bridge)


def _no_loop() -> None:
    return None


_last_asyncio_bridge: tuple[Callable[[], object], LoopBridge | None] = (_no_loop, None)


def _current_trio_bridge() -> LoopBridge:
    global _trio_bridge_var
    trio = sys.modules.get("trio")
    if trio is None:
        raise NoLoopError("asyncmetal must be awaited from asyncio, uvloop or trio")
    if _trio_bridge_var is None:
        with _bridges_lock:
            if _trio_bridge_var is None:
                _trio_bridge_var = trio.lowlevel.RunVar("asyncmetal_bridge")
    try:
        bridge: LoopBridge = _trio_bridge_var.get()
    except LookupError:
        bridge = _TrioBridge()
        _trio_bridge_var.set(bridge)
    except RuntimeError:  # not in a trio run either
        raise NoLoopError("asyncmetal must be awaited from asyncio, uvloop or trio") from None
    return bridge


@types.coroutine
def checkpoint() -> Generator[Any, Any, None]:
    """Yield to the loop once, honouring cancellation, on whichever loop runs us.

    ``await checkpoint()``, or ``yield from checkpoint()`` in an ``__await__``. Under
    asyncio a bare yield: what ``asyncio.sleep(0)`` does, minus its coroutine frames."""
    if _get_running_loop() is not None and ("trio" not in sys.modules or not in_trio_task()):
        yield
    elif "trio" in sys.modules and in_trio_task():
        import trio

        yield from trio.lowlevel.checkpoint().__await__()  # noqa: ASYNC105 (yielded from)
    else:  # (trio's trap, yielded to whatever drives us, would say nothing of why)
        raise NoLoopError("asyncmetal must be awaited from asyncio, uvloop or trio")


def require_loop() -> None:
    """Raise NoLoopError unless the calling code runs on an asyncio (uvloop) loop or
    as a trio task: for an await whose first step is not a wait of the bridge's (a
    call on a thread, a close), where anyio's own error would come instead, or nothing
    until after the step's work began."""
    if _get_running_loop() is None and ("trio" not in sys.modules or not in_trio_task()):
        raise NoLoopError("asyncmetal must be awaited from asyncio, uvloop or trio")


def running_bridge() -> LoopBridge | None:
    """The bridge of the calling thread's running loop, if it runs one and its bridge
    exists (nothing waits on it otherwise) and lives."""
    loop = _get_running_loop()
    if loop is not None and ("trio" not in sys.modules or not in_trio_task()):
        last_loop, bridge = _last_asyncio_bridge
        if bridge is None or last_loop() is not loop:
            bridge = _asyncio_bridges.get(loop)
    elif _trio_bridge_var is not None:
        try:
            bridge = _trio_bridge_var.get()
        except (LookupError, RuntimeError):  # no bridge yet; not in a trio run
            return None
    else:
        return None
    return None if bridge is None or bridge.dead else bridge


def stay_awake(ns: int) -> None:
    """``LoopBridge.stay_awake`` of the calling thread's running loop, if any."""
    bridge = running_bridge()
    if bridge is not None:
        bridge.stay_awake(ns)


def loop_statistics() -> LoopStatistics:
    """Wake-ups and waiters of the calling event loop (a :class:`LoopStatistics`).

    Raises :class:`NoLoopError` outside a running asyncio, uvloop or trio loop."""
    try:
        bridge = current_bridge()
    except NoLoopError:  # (its own words: nothing is awaited here)
        raise NoLoopError(
            "loop_statistics() reports on the running event loop: call it from a task of "
            "asyncio, uvloop or trio"
        ) from None
    return bridge.statistics()

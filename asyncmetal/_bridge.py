"""The one path from a native completion to each waiting event loop.

A thread that sees a timeline advance (a cpu queue thread, a CUDA completion thread, a
Metal completion handler's hand-off) calls ``Timeline._advanced``. That touches no lock
the loop could wait on: it compares the new value with the smallest value each loop
waits for (``_Watch.next``) and, if reached, appends the watch to that loop's bridge and
schedules one drain -- unless a drain is already scheduled. The drain runs on the loop
thread and wakes every waiter whose value has been reached, so any number of completions
between two loop iterations cost one wake-up of that loop.

The handshake is lock-free and relies on the GIL ordering plain attribute reads and
writes: the notifier writes the value and then reads ``next``/``queued``; the loop
writes ``next``/``queued`` and then reads the value. One of the two always sees the
other's write, so no wake-up is lost.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ._timeline import Waitable

INFINITY = 1 << 64  # larger than any 64-bit timeline value


class _ValueSource(Protocol):
    @property
    def value(self) -> int: ...


@dataclass(frozen=True)
class LoopStatistics:
    """What the bridge did for one event loop (see :func:`loop_statistics`)."""

    wakeups: int  # drains run on the loop: each is one wake-up
    resolved: int  # waiters woken by those drains
    waiting: int  # waiters parked right now


class _Entry:
    __slots__ = ("done", "wake")

    def __init__(self, wake: Callable[[], None]) -> None:
        self.done = False  # woken, or withdrawn by cancellation
        self.wake = wake


class _Watch:
    """The waiters of one loop on one timeline: a heap ordered by value."""

    __slots__ = ("bridge", "heap", "next", "queued", "timeline", "withdrawn")

    def __init__(self, bridge: LoopBridge, timeline: Waitable) -> None:
        self.bridge = bridge
        self.timeline = timeline
        self.heap: list[tuple[int, int, _Entry]] = []
        self.next = INFINITY  # smallest value waited for; read by notifying threads
        self.queued = False  # already in the bridge's pending deque
        self.withdrawn = 0  # cancelled entries still in the heap

    def add(self, value: int, entry: _Entry) -> None:
        """Park ``entry`` until ``value``; it is woken later, never from inside this call."""
        heapq.heappush(self.heap, (value, next(_sequence), entry))
        self.bridge.waiting += 1
        self.next = self.heap[0][0]
        if self.timeline._native.value >= self.next:
            # Reached while publishing `next`: the notifier may have missed it, so go
            # through the bridge (a wake-up of our own loop) rather than wake inline.
            self.bridge.notify(self)

    def withdraw(self, entry: _Entry) -> None:
        entry.done = True
        self.bridge.waiting -= 1
        self.withdrawn += 1
        # Cancelled waits for values never reached would pile up: rebuild when most are dead.
        if self.withdrawn > 32 and self.withdrawn * 2 > len(self.heap):
            self.heap = [item for item in self.heap if not item[2].done]
            heapq.heapify(self.heap)
            self.withdrawn = 0
            self._update_next()

    def resolve(self) -> None:
        heap, native = self.heap, self.timeline._native
        while True:
            reached = native.value
            while heap and heap[0][0] <= reached:
                entry = heapq.heappop(heap)[2]
                if entry.done:
                    self.withdrawn -= 1
                    continue
                entry.done = True
                self.bridge.waiting -= 1
                self.bridge.resolved += 1
                entry.wake()
            self._update_next()
            if native.value < self.next:  # re-read after publishing next: see module doc
                return

    def _update_next(self) -> None:
        if self.heap:
            self.next = self.heap[0][0]
        else:
            self.next = INFINITY
            self.timeline._drop_watch(self)


_sequence = itertools.count()


class LoopBridge:
    """Per event loop: the pending watches and the one scheduled drain."""

    def __init__(self, call_soon_threadsafe: Callable[[Callable[[], None]], object]) -> None:
        self._call_soon_threadsafe = call_soon_threadsafe
        self._pending: collections.deque[_Watch] = collections.deque()
        self._scheduled = False
        self.dead = False
        self.wakeups = 0
        self.resolved = 0
        self.waiting = 0

    def notify(self, watch: _Watch) -> None:
        """Called from any thread once ``watch.timeline`` reached ``watch.next``."""
        if watch.queued or self.dead:
            return
        watch.queued = True
        self._pending.append(watch)
        if not self._scheduled:
            self._scheduled = True
            try:
                self._call_soon_threadsafe(self._drain)
            except Exception:  # the loop closed (asyncio RuntimeError, trio RunFinishedError)
                self.dead = True

    def _drain(self) -> None:
        self.wakeups += 1
        self._scheduled = False
        pending = self._pending
        while pending:
            watch = pending.popleft()
            watch.queued = False
            watch.resolve()

    def statistics(self) -> LoopStatistics:
        return LoopStatistics(self.wakeups, self.resolved, self.waiting)

    async def park(self, watch: _Watch, value: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class _AsyncioBridge(LoopBridge):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop.call_soon_threadsafe)
        self._loop_ref = weakref.ref(loop)

    async def park(self, watch: _Watch, value: int) -> None:
        loop = self._loop_ref()
        assert loop is not None
        future: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not future.done():
                future.set_result(None)

        entry = _Entry(wake)
        watch.add(value, entry)
        try:
            await future
        except BaseException:
            if not entry.done:
                watch.withdraw(entry)
            raise


class _TrioBridge(LoopBridge):
    def __init__(self) -> None:
        import trio

        super().__init__(trio.lowlevel.current_trio_token().run_sync_soon)

    async def park(self, watch: _Watch, value: int) -> None:
        import trio

        task = trio.lowlevel.current_task()
        entry = _Entry(lambda: trio.lowlevel.reschedule(task))

        def abort(_: Any) -> trio.lowlevel.Abort:
            watch.withdraw(entry)
            return trio.lowlevel.Abort.SUCCEEDED

        watch.add(value, entry)
        await trio.lowlevel.wait_task_rescheduled(abort)


_asyncio_bridges: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopBridge] = (
    weakref.WeakKeyDictionary()
)
_trio_bridge_var: Any = None
_bridges_lock = threading.Lock()


def current_bridge() -> LoopBridge:
    """The bridge of the running loop (asyncio, uvloop or trio), made on first use."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return _current_trio_bridge()
    bridge = _asyncio_bridges.get(loop)
    if bridge is None:
        bridge = _asyncio_bridges.setdefault(loop, _AsyncioBridge(loop))
    return bridge


def _current_trio_bridge() -> LoopBridge:
    global _trio_bridge_var
    trio = sys.modules.get("trio")
    if trio is None:
        raise RuntimeError("asyncmetal must be awaited from asyncio, uvloop or trio")
    if _trio_bridge_var is None:
        with _bridges_lock:
            if _trio_bridge_var is None:
                _trio_bridge_var = trio.lowlevel.RunVar("asyncmetal_bridge")
    try:
        bridge: LoopBridge = _trio_bridge_var.get()
    except LookupError:
        bridge = _TrioBridge()
        _trio_bridge_var.set(bridge)
    return bridge


async def checkpoint() -> None:
    """Yield to the loop once, honouring cancellation, on whichever loop runs us."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        import trio

        await trio.lowlevel.checkpoint()
        return
    await asyncio.sleep(0)


def loop_statistics() -> LoopStatistics:
    """Wake-ups and waiters of the calling event loop's bridge."""
    return current_bridge().statistics()

"""DeviceState: what the layers below :class:`~asyncmetal.Device` know of their device.

A Device owns one and hands it to everything it makes -- timelines, buffers, queues,
programs, its allocator -- instead of itself: its name, its backend (and so its kind),
whether it is closed, and its default queue for the buffers' own reads and writes. The
``device`` it names is only handed out (``buffer.device``, ``queue.device``): nothing
below the Device calls it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from ._backend import Backend
from ._errors import ClosedResourceError
from ._threads import run_sync as to_thread


class Copier(Protocol):
    """What a buffer's ``read``/``write`` need of its device's default queue."""

    def copy(self, dst: Any, src: Any, nbytes: int | None = None) -> Awaitable[None]: ...

    def _fails_later(self) -> bool: ...


class DeviceState:
    """One opened device, as its timelines, buffers, queues and allocator see it."""

    __slots__ = (
        "_unheard",
        "_unheard_lock",
        "backend",
        "busy",
        "close_waits",
        "closed",
        "device",
        "in_stead",
        "make_queue",
        "name",
        "order",
        "queue",
        "ran_out",
        "retire_queue",
        "stopped",
        "submitting",
    )

    def __init__(self, name: str, backend: Backend, device: Any) -> None:
        self.name = name
        self.backend = backend
        self.closed = False
        # Its callers' waits on work outside the device (a compile in its pool), each a
        # HostEvents: the close that seals it (``closed``) ends them (``end_waits``), and
        # each raises ClosedResourceError then rather than wait for that work. A waiter
        # adds its own, then looks at ``closed``; the close sets ``closed``, then takes
        # them -- each a set's own step (no lock, which a fork could leave held): one of
        # the two sees the other.
        self.close_waits: set[Any] = set()
        # Set once its queues have stopped (closed natively: each ran what it could and
        # the rest was abandoned): nothing of the device is confirmed any more, nor runs
        # but what its backend's close lets through (``ran_out``). Not ``closed``:
        # a close seals the device (``closed``) before it waits for the commands
        # submitted by then, which still run -- and read or write their buffers.
        self.stopped = False
        # Set once its backend closed too: what its stopped queues' streams still ran has
        # run out. Not ``stopped``: an abandoned queue's commands held behind a device wait
        # run on a GPU once the backend's close raises the words they wait on, until it
        # synchronizes -- and write memory another library may hand out again once let
        # go of (``_allocator.lingering``).
        self.ran_out = False
        # Held by a queue from the check that the device is open to the hand-over of
        # its command (and its record as a device wait or signal), by a close as it
        # sets ``closed`` and as it counts what is left to wait for (Queue._submit,
        # Device.close): no command of another thread is half submitted then.
        self.submitting = threading.RLock()
        # Where its submission lock comes among devices' (``locks_in_order``): one that
        # takes several takes them in this order, so two such never wait for each other.
        self.order = next(_orders)
        # How many Python-path submissions (Queue._submit) are under way, lock held.
        # The native launch path takes no lock: it numbers a command, reads ``closed``
        # and hands the command over with no Python code between (no other thread runs
        # meanwhile) -- unless ``busy``: another thread's submission is half done
        # (numbered, not yet handed over), and the launch takes the Python path, which
        # waits for the lock. So commands are handed over in the order of their values.
        self.busy = 0
        self.device = device  # the asyncmetal.Device that owns this state
        self.queue: Copier | None = None  # its default queue, once made
        # The queue its buffers' own reads and writes run on once every later command
        # of the default queue fails (``default_queue``), and how the device makes one.
        self.in_stead: Copier | None = None
        self.make_queue: Callable[[], Copier] | None = None
        self.retire_queue: Callable[[Copier], None] | None = None  # (one replaced)
        # Errors of work done for callers who were cancelled before it ended (a free's
        # release, an emptying of the cache): raised by the device's close; None once
        # that close took them.
        self._unheard: list[BaseException] | None = []
        self._unheard_lock = threading.Lock()
        # Listed last, with no call after it: an interrupt leaves it listed only once it
        # was made whole.
        _change_states(self, opened=True)

    @property
    def kind(self) -> str:
        return self.backend.kind

    def check_open(self) -> None:
        if self.closed:
            raise ClosedResourceError(f"device {self.name} is closed")

    def unheard_error(self, error: BaseException) -> None:
        """``error`` ended work of this device whose caller no longer waited for it
        (any thread): the device's close raises it -- or, where that close has taken
        its errors already, it goes to ``threading.excepthook``, as an error nobody
        catches on a thread does."""
        with self._unheard_lock:
            if self._unheard is not None:
                self._unheard.append(error)
                return
        hook_args = (type(error), error, error.__traceback__, threading.current_thread())
        threading.excepthook(threading.ExceptHookArgs(hook_args))

    def take_unheard_errors(self) -> list[BaseException]:
        """The errors ``unheard_error`` kept (for the device's close): later ones go to
        ``threading.excepthook``."""
        with self._unheard_lock:
            errors, self._unheard = self._unheard or [], None
        return errors

    def default_queue(self) -> Copier:
        """The queue that the device's own work for its buffers runs on (``read``,
        ``write``, ``copy()``, a zeroed ``alloc``, what ``from_dlpack`` orders): its
        default queue -- or, once every later command of that one fails (a device wait
        of it ended on a value never produced: another device closed while it waited,
        say), a new queue of the device in its stead, and then another if that one
        fails so in turn (the one replaced is released once its commands settled:
        ``retire_queue``). ``device.queue`` stays the default queue: what a program
        submits there in order must not run out of that order."""
        queue = self.in_stead or self.queue
        assert queue is not None, "a device makes its default queue when it opens"
        if not queue._fails_later() or self.closed or self.make_queue is None:
            return queue
        # Made before the submission lock is taken (its native queue takes long: see
        # Device.new_queue). One not put in stead -- another thread's was first, the
        # device closed, an interrupt -- is let go of: it has no command, and is
        # released once collected.
        try:
            made = self.make_queue()
        except ClosedResourceError:
            return self.in_stead or queue
        with self.submitting:
            queue = self.in_stead or self.queue
            assert queue is not None
            if queue._fails_later() and not self.closed:
                # (Retired first: a KeyboardInterrupt before the next is put in stead
                # leaves it in_stead, sealed -- failing later -- and the next call
                # replaces it.)
                if self.in_stead is not None and self.retire_queue is not None:
                    self.retire_queue(self.in_stead)
                queue = self.in_stead = made
        return queue


def two_names(one: DeviceState, other: DeviceState) -> tuple[str, str]:
    """The names of two different devices for one message: where both were opened under
    the same name (each ``open_device`` opens a device of its own), the first is called
    "another device opened as ..."."""
    if one.name == other.name:
        return f"another device opened as {one.name}", other.name
    return one.name, other.name


# Every open device's state, in the order opened: a close takes its own out as it seals
# the device. And every state until its device's close released its queues and memory
# (or its opening failed): a sealed device's commands still run meanwhile, on its memory.
# Two dicts never changed once made, replaced together by each change
# (``_change_states``), and so read with no lock: a finalizer that the garbage
# collector runs at any allocation may read them (an import: from_dlpack), also on a
# thread that is changing them, and a lock held while a list of them is made would be
# waited for there by its own holder. The lock is held only to compare and store,
# which allocate nothing (no collection starts there).
_states: tuple[dict[int, DeviceState], dict[int, DeviceState]] = ({}, {})
_open_lock = threading.Lock()
_orders = itertools.count()  # (next() of it is one step: no lock)

T = TypeVar("T")


def open_states() -> list[DeviceState]:
    """The states of the devices open now."""
    return list(_states[0].values())


def unreleased_states() -> list[DeviceState]:
    """The states of the devices open now and of those closing, until each close has
    released its device's queues and memory."""
    return list(_states[1].values())


def _changed(
    states: tuple[dict[int, DeviceState], dict[int, DeviceState]],
    state: DeviceState,
    opened: bool = False,
    released: bool = False,
) -> tuple[dict[int, DeviceState], dict[int, DeviceState]]:
    """New dicts of ``states`` with ``state`` added to both (``opened``), or taken out of
    the open ones (and, ``released``, of the unreleased ones)."""
    key = id(state)
    open_now, unreleased = dict(states[0]), dict(states[1])
    if opened:
        open_now[key] = unreleased[key] = state
    else:
        open_now.pop(key, None)
        if released:
            unreleased.pop(key, None)
    return open_now, unreleased


def _change_states(state: DeviceState, opened: bool = False, released: bool = False) -> None:
    """Add ``state`` to both (``opened``), or take it out of the open ones (and,
    ``released``, of the unreleased ones): new dicts, made before the lock is taken, and
    made again where another thread's change landed meanwhile."""
    global _states
    while True:
        before = _states
        after = _changed(before, state, opened, released)
        with _open_lock:
            if _states is before:
                _states = after
                return


def forget_open_states() -> None:
    """In a forked child: none of the parent's devices is open here (and the lock may
    have been held by a parent thread at the fork)."""
    global _open_lock, _states
    _open_lock = threading.Lock()
    _states = ({}, {})


def state_closed(state: DeviceState) -> None:
    """``state``'s device closed (or, in a forked child, was the parent's)."""
    _change_states(state)


def state_released(state: DeviceState) -> None:
    """``state``'s device released its queues and memory (its close's last step), or
    never opened (its opening failed)."""
    _change_states(state, released=True)


def _in_order(state: DeviceState) -> int:
    return state.order


def locks_in_order(states: set[DeviceState]) -> contextlib.ExitStack:
    """The submission locks of ``states``, taken (blocking) in one order whoever takes
    several -- as ``holding`` takes them -- and let go as the stack it returns closes."""
    stack = contextlib.ExitStack()
    try:
        for state in sorted(states, key=_in_order):
            stack.enter_context(state.submitting)
    except BaseException:
        stack.close()
        raise
    return stack


def release_owned(states: list[DeviceState]) -> None:
    """Let go of each of ``states``' submission locks that this thread holds: a task
    holds none across an await, so, called where one took them (each once) with no
    name for what it got -- an interrupt may come right after a try took one, before
    anything names it (CPython runs signal handlers as a call returns; trio raises
    Ctrl-C in whatever code its task runs) -- each held is that taker's."""
    for state in reversed(states):
        if state.submitting._is_owned():  # type: ignore[attr-defined]
            state.submitting.release()


async def holding(states: list[DeviceState], fn: Callable[[], T]) -> T:
    """``fn()`` with the submission lock of each of ``states`` held: on the loop's
    thread where no other thread holds one now (the common case, no hop), else from a
    worker thread that waits for them, taken in one order (``DeviceState.order``)
    whoever takes several, so that two such takers never wait for each other."""
    states = sorted(states, key=_in_order)
    held: list[DeviceState] = []
    try:
        try:
            for state in states:
                if not state.submitting.acquire(blocking=False):
                    break
                held.append(state)
            else:
                return fn()
        finally:
            while held:
                held.pop().submitting.release()
    except BaseException:
        # (an interrupt right after a try took a lock, before it was named held; or as
        # they were let go)
        release_owned(states)
        raise

    def waiting() -> T:
        with contextlib.ExitStack() as stack:
            for state in states:
                stack.enter_context(state.submitting)
            return fn()

    return await to_thread(waiting)

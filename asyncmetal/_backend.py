"""Every hook a device backend supplies, in one place.

A backend (``backends/cpu.py``, the package ``backends/cuda/``, ...) subclasses these three
classes. Nothing here is async: the hooks submit and return, and report progress by
calling the ``on_advance`` callback a timeline was made with, from whichever thread sees
it. Everything async -- waiting, batching wake-ups, cancellation, validation -- lives
above, once, for all backends.
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple

import numpy as np

from . import _native
from ._errors import ClosedResourceError, InvalidArgumentError
from ._scalars import Scalar

if TYPE_CHECKING:
    from ._compile import Compiler


class Record:
    """What a device reports about one submitted command, filled in by the backend:
    an error if it failed, and device start/end times (ns, the backend's clock) set as
    ``_start_ns``/``_end_ns`` or found in a native ring the device writes (``_ring`` of
    int64 triples start, end, value; ``_row``), valid while the row still holds ``value``.
    A backend that knows how long a command takes (a copy of known size) may set
    ``_due_ns``, a ``time.perf_counter_ns()`` by which it should be done: a task awaiting
    it keeps checking until then rather than parking, when that is near.
    :class:`~asyncmetal.Completion` is the Record of its command."""

    __slots__ = ("_due_ns", "_end_ns", "_error", "_ring", "_row", "_start_ns", "value")

    def __init__(self, value: int) -> None:
        self.value = value
        self._error: BaseException | None = None
        self._ring: Any = None
        self._row = 0
        self._start_ns: int | None = None
        self._end_ns: int | None = None
        self._due_ns = 0

    def _times(self) -> tuple[int, int] | None:
        """(_start_ns, _end_ns) where the backend measured them, else None."""
        if self._ring is None:
            if self._start_ns is None or self._end_ns is None:
                return None
            return self._start_ns, self._end_ns
        ring, base = self._ring, 3 * self._row
        before, start, end, after = ring[base + 2], ring[base], ring[base + 1], ring[base + 2]
        if before != self.value or after != self.value:
            return None  # the row was reused by a later command
        return int(start), int(end)


def host_address(view: memoryview) -> tuple[int, Any]:
    """The address of a contiguous host buffer (read-only ones too), and the object to
    keep alive while a device uses that memory."""
    array = np.frombuffer(view, np.uint8)
    return int(array.ctypes.data), array


class KeepAlive:
    """Host objects a queue's commands use, kept until its timeline passes them.

    ``items`` holds each command's value and object, in the order added (values rise);
    its length is what a fast launch path reads (whether anything is kept at all). A
    deque: a backlog of any length is added to on the event loop's thread in bounded
    time (a dict of them copies itself into a table twice as large each time it fills),
    and its memory goes back as it drains (a dict keeps its largest table). Objects are
    let go of as later commands are added, and by :func:`let_go_everywhere`, from any
    thread, oldest first, one thread at a time (``_lock``): a let-go that read the
    timeline before another's could otherwise take an entry from the front while the
    other one reads it, find it not passed and put it back once the other one returned
    -- which kept the object of a command that other let-go saw pass (a task awaiting it
    lets go of what it kept) until the queue's next submission. The lock is taken only
    where the front has passed: a let-go with nothing to drop takes none. Reentrant: an
    object let go of may run code (a finalizer) that lets go again."""

    __slots__ = ("__weakref__", "_lock", "_timeline", "items")

    def __init__(self, timeline: NativeTimeline) -> None:
        self._timeline = timeline
        self.items: collections.deque[tuple[int, object]] = collections.deque()
        self._lock = threading.RLock()
        with _keeps_lock:
            _keeps.add(self)

    def add(self, value: int, obj: object) -> None:
        if self.items:
            self.let_go()
        if obj is not None:
            self.items.append((value, obj))

    def get(self, value: int) -> object:
        """The object last added for command ``value``, or None (let go of, or none)."""
        return self.by_value().get(value)

    def by_value(self) -> dict[int, object]:
        """The objects kept now, by value (the one last added for a value). A copy, made
        at once: other threads let go of entries meanwhile."""
        return dict(list(self.items))

    def let_go(self) -> None:
        """Drop the objects of the commands the timeline has passed."""
        items = self.items
        reached = self._timeline.value
        try:  # nothing passed: nothing to do (entries are taken in order, oldest first)
            if items[0][0] > reached:
                return
        except IndexError:
            return
        lock = self._lock
        lock.acquire()  # (not `with`: twice the cost, on every launch that drops one)
        try:
            while items:
                try:
                    if items[0][0] > reached:
                        return
                    entry = items.popleft()
                except IndexError:  # emptied meanwhile (clear)
                    return
                if entry[0] > reached:  # (a let-go this thread ran meanwhile took it)
                    items.appendleft(entry)
                    return
        finally:
            lock.release()

    def clear(self) -> None:
        self.items.clear()


_keeps: weakref.WeakSet[KeepAlive] = weakref.WeakSet()
_keeps_lock = threading.Lock()


def _new_keeps_in_child() -> None:
    """In a forked child: a parent thread may have held the lock at the fork (making a
    queue, letting go of what queues keep); the child's own queues take it too. The
    parent's queues are left out of the child's :func:`let_go_everywhere`: their
    timelines refuse every read there (an allocation of the child's own device waiting
    for a loan would raise the parent's device's ClosedResourceError), and a parent
    thread may have held one's own lock at the fork."""
    global _keeps, _keeps_lock
    _keeps_lock = threading.Lock()
    _keeps = weakref.WeakSet()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_keeps_in_child)


def let_go_everywhere() -> None:
    """Every queue's :meth:`KeepAlive.let_go`: a host object that lends memory out (a
    DLPack view of a buffer's own memory, used as a copy's host side) holds that memory
    until its last holder lets it go, which a queue does otherwise only at its next
    submission."""
    with _keeps_lock:
        keeps = list(_keeps)
    for keep in keeps:
        keep.let_go()


# How long a device's close waits for the kernel loads under way (a load may compile for
# the GPU: cuModuleLoadData's PTX, Metal's pipeline making) to let go of their kernels
# with the others; one still under way then lets go of its own as it ends.
LOAD_WAIT_S = 10.0


class LoadGate:
    """A backend's kernel loads against its close. A load is counted from its check until
    its kernel is registered (``with gate.loading() as load``, then ``load.end()``),
    under ``lock`` (the registry's, which it was made with): the close refuses new
    loads, waits until those counted ended (bounded: LOAD_WAIT_S), then takes the
    registry; a load ending after that -- late -- lets go of its own kernel, and the
    last late one of what the close left to it (Metal's device)."""

    __slots__ = ("_ended", "_loading", "_message", "_taken", "closed", "lock")

    def __init__(self, lock: threading.Lock, name: str) -> None:
        self.lock = lock
        self._ended = threading.Condition(lock)
        self._loading = 0
        self.closed = False  # loads refused
        self._taken = False  # the close took the registry: a load ending now is late
        self._message = f"device {name} is closed"

    def refused(self) -> ClosedResourceError:
        return ClosedResourceError(self._message)

    def refuse(self) -> None:
        """Refuse loads from now on (under the lock): the close began, and whatever fails
        in it, it lets go of the kernels registered -- none registered after that would be."""
        self.closed = True

    def loading(self, on_last: Callable[[], None] | None = None) -> Load:
        """A load's count, taken as a ``with`` block begins (ClosedResourceError once
        refused) and given back by :meth:`Load.end` or as the block ends, whichever
        comes first; ``on_last`` (what the close left to the loads) runs as the block
        ends where the load was the last late one."""
        return Load(self, on_last)

    def close(self) -> int:
        """Refuse loads from now on, wait for those under way (bounded: LOAD_WAIT_S), and
        take the registry (under the lock): how many loads are still under way, which
        end late."""
        self.closed = True
        self._ended.wait_for(lambda: not self._loading, LOAD_WAIT_S)
        self._taken = True
        return self._loading


class Load:
    """One load's count at its :class:`LoadGate`, taken and given back as one unit: an
    asynchronous exception (a KeyboardInterrupt) lands only where the interpreter checks
    for one -- as a function is entered, as a called C function returns -- so the count
    and ``counted`` are set with no call between them, ``__enter__`` gives the count back
    itself where it raises after taking it (the lock's release is such a call), and the
    ``with`` block's exit gives it back where ``end`` did not. Left up, the close would
    wait out LOAD_WAIT_S for no load, and on Metal never let go of the device (left to
    the last load counted)."""

    __slots__ = ("_gate", "_on_last", "counted", "last")

    def __init__(self, gate: LoadGate, on_last: Callable[[], None] | None) -> None:
        self._gate = gate
        self._on_last = on_last
        self.counted = False
        self.last = False  # the last late load: what the close left is this one's

    def __enter__(self) -> Load:
        gate = self._gate
        try:
            with gate.lock:
                if gate.closed:
                    raise gate.refused()
                gate._loading += 1
                self.counted = True
        except BaseException:
            self.__exit__()
            raise
        return self

    def end(self) -> bool | None:
        """The load is through (under the lock). None while the close has not taken the
        registry (the load registers its kernel), else whether it was the last under way:
        what the close left to the loads is then this one's, let go of as the block ends."""
        gate = self._gate
        self.counted = False
        gate._loading -= 1
        late = (not gate._loading) if gate._taken else None
        self.last = late is True
        if not gate._loading:
            gate._ended.notify_all()
        return late

    def __exit__(self, *exc: object) -> None:
        if self.counted:  # (the load raised before its end)
            with self._gate.lock:
                self.end()
        if self.last:
            self.last = False
            if self._on_last is not None:
                self._on_last()


class Arg(NamedTuple):
    """One launch argument: a native buffer handle plus a byte offset, or a value: an
    int (an int32), or a :class:`~asyncmetal._scalars.Scalar` (its type and bits)."""

    handle: Any = None
    offset: int = 0
    value: int | Scalar | None = None


new_arg = tuple.__new__  # new_arg(Arg, (handle, offset, value)): Arg without its Python __new__


class NativeTimeline(ABC):
    """A 64-bit monotonic counter the device and the host can both signal.

    A timeline of the native runtime sets ``c_timeline`` to its address: the runtime's
    threads then wake waiting loops themselves and ``on_advance`` is never called.
    """

    c_timeline: int | None = None
    # The highest value it takes (a device's waits may compare fewer bits than 64).
    max_value = (1 << 64) - 1
    # A host signal may release device waits, whose commands then finish in microseconds
    # (their completion comes through a native thread): the signalling loop stays awake a
    # moment to see it rather than sleep and be woken.
    releases_device_work = False
    # Only host threads raise or fail it (a cpu or npy queue's, a host signal): it has no
    # device word or event a device's own wait could read.
    host_raised = False

    @property
    @abstractmethod
    def value(self) -> int:
        """The value reached now. Must not block."""

    @abstractmethod
    def signal(self, value: int) -> None:
        """Host-side signal: raise to ``value`` (never lower) and report the advance."""

    def signal_here(self, value: int, notifier: int) -> None:
        """``signal(value)`` on the thread running the loop whose native notifier is
        ``notifier`` (a timeline of the native runtime), which wakes its own waiters on
        this timeline as the signal returns (``Watch.wake_now``): that loop's pipe need
        not be written -- a timeline of the runtime leaves it out; other loops' pipes
        are written as usual."""
        self.signal(value)

    def abandon(self, target: int, first: int) -> None:
        """The commands of its queue that would raise it from where it is to ``target``
        (``first`` on) will never run: their device closed while they waited. Every wait
        for them ends: a native timeline fails, from the value after the last it
        reached, and settles (a host task's wait then raises; a queue that waited for
        one of those values fails its commands from that wait on)."""
        if self.c_timeline is None:
            self.signal(target)
        else:
            _native.timeline_abandon(self.c_timeline, target, first)

    def close_waits(self, pending: int = 0) -> None:
        """Its device closed: nothing will raise it any more, but a signal of it that a
        queue of another device submitted and has not run (to ``pending``). A native
        timeline fails from the value after the one it reached, or after ``pending``
        (without rising): a device wait of another device's queue for more ends, and
        that queue fails from that wait on."""
        if self.c_timeline is not None:
            _native.timeline_close(self.c_timeline, pending)


class InheritedValue:
    """Where a timeline of the parent process keeps its value, in a forked child: the
    threads (and driver) that would raise it are the parent's, so a value read would
    never move. Every read raises ClosedResourceError(message) instead."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message

    @property
    def value(self) -> int:
        raise ClosedResourceError(self.message)


class ForkableTimeline(NativeTimeline):
    """A timeline whose value a forked child must no longer read (see ``Backend.forked``)."""

    @abstractmethod
    def forked(self, message: str) -> None:
        """Make every later read of the value raise ClosedResourceError(message), touching
        nothing native (an :class:`InheritedValue` in place of its reader)."""


class Timelines:
    """The timelines a backend made and still alive: to cut them off in a forked child,
    and to end device waits on them when the device closes."""

    def __init__(self) -> None:
        self._alive: weakref.WeakSet[ForkableTimeline] = weakref.WeakSet()

    def add(self, timeline: ForkableTimeline) -> None:
        self._alive.add(timeline)

    def forked(self, message: str) -> None:
        for timeline in list(self._alive):
            timeline.forked(message)

    def close_waits(self) -> None:
        for timeline in list(self._alive):
            timeline.close_waits()


class NativeQueue(ABC):
    """An ordered stream of commands. Each command ends by signalling ``timeline`` to
    ``value`` (the queue's own timeline), after which ``record`` must be complete."""

    # A marker is a command of its own (an event on a stream that other libraries may
    # submit to too), not the queue's last command.
    markers: bool = False
    handle: int | None = None  # the native stream (a CUstream's address), where there is one
    adopted: bool = False  # over another library's stream (adopt_queue)
    # Its device waits may be handed to a driver with commands behind them, which then run
    # once the wait ends, whatever a discard says: a discarding close waits only for
    # what can complete (see Device._close_queue).
    hands_over_waits: bool = False
    # The host objects its commands use (a copy's arrays), kept until they are done.
    _keep: KeepAlive | None = None

    def marker(self, value: int, record: Record) -> None:
        """A command that does nothing: done once everything before it on the stream is
        (asked for only where ``markers`` is set)."""
        raise NotImplementedError(f"{type(self).__name__} has no marker commands")

    def wait_stream(self, stream: int, value: int, record: Record) -> None:
        """A command done once what another library submitted to ``stream`` (a handle
        ``Backend.stream_handle`` gave) until now is, and which the queue's later
        commands come after, on the device (asked for only where ``markers`` is set).
        A stream of another device (or context) is refused, nothing submitted."""
        raise NotImplementedError(f"{type(self).__name__} cannot wait for other streams")

    @abstractmethod
    def launch(
        self,
        program: Any,
        args: Sequence[Arg],
        global_size: tuple[int, int, int],
        local_size: tuple[int, int, int],
        value: int,
        record: Record,
    ) -> None: ...

    @abstractmethod
    def signal(self, timeline: NativeTimeline, target: int, value: int, record: Record) -> None:
        """Raise ``timeline`` to ``target`` once earlier commands finished."""

    @abstractmethod
    def wait(self, timeline: NativeTimeline, target: int, value: int, record: Record) -> None:
        """Hold later commands until ``timeline`` reaches ``target`` (no host thread blocks)."""

    @abstractmethod
    def copy(
        self, dst: Arg, src: Arg, nbytes: int, value: int, record: Record, peer: Any = None
    ) -> None:
        """Device memory to device memory. ``peer`` is the source's backend when it is
        another device of the same kind."""

    def fill(
        self, dst: Arg, nbytes: int, pattern: int, size: int, value: int, record: Record
    ) -> None:
        """Fill ``nbytes`` at ``dst`` with ``pattern``'s low ``size`` bytes (1, 2 or 4,
        in host byte order) repeated: ``nbytes`` is a multiple of ``size``, and ``dst``
        is aligned to it within its block. Checked against ``Backend.fill_alignment``
        and ``Backend.fill_patterns`` before it gets here."""
        raise NotImplementedError(f"{type(self).__name__} has no fill command")

    @abstractmethod
    def copyin(self, dst: Arg, src: memoryview, value: int, record: Record) -> None:
        """Host to device. ``src`` stays alive and unchanged until the command completes."""

    @abstractmethod
    def copyout(self, dst: memoryview, src: Arg, value: int, record: Record) -> None:
        """Device to host into ``dst``."""

    def failure(self, value: int) -> BaseException | None:
        """The error that failed the command at ``value`` (a lost device), if any."""
        return None

    def fails_later(self) -> bool:
        """Whether every command submitted to it from now on fails: a device wait of
        it ended on a value that was never produced, and it holds all that follows.
        Cheap (a read in place where nothing failed): asked whenever the device's
        default queue is (``DeviceState.default_queue``)."""
        return False

    def reached(self) -> int | None:
        """How far its commands got where its timeline says more (a device's close counts
        from there, see ``_queue.completable``): commands it reported failed at once,
        their values reached, but not confirmed yet: held behind a device wait, or
        handed over behind one, that may never end.
        None: as far as its timeline says."""
        return None

    def launch_target(self) -> tuple[Any, ...] | None:
        """What the native extension's ``launch`` needs to submit this queue's common
        launches itself (``_native_contract.LAYOUTS`` lists the forms), or None: every launch goes
        through :meth:`launch`. Read once, when the Queue is made."""
        return None

    def flush(self) -> None:  # noqa: B027 - most backends keep nothing back
        """Hand over anything submitted but still kept back (a Metal wait waiting for
        the command buffer of the work that depends on it). Called before parking."""

    def hand_over(self, value: int) -> None:  # noqa: B027 - most backends hold nothing
        """Hand what is held on the host up to command ``value`` to the device now:
        another library is about to use the queue's stream itself, and sees only what
        reached it. Raise BufferError if a wait before it cannot be handed over yet."""

    def discard(self, why: str) -> None:  # noqa: B027 - a backend that holds nothing runs it all
        """Drop the commands that have not started (the queue is sealed: none comes
        after): each fails with ``_timeline.discarded_error`` (given ``why``: what
        dropped them) where awaited, a timeline
        one of them was to signal fails, a device wait under way ends (failed), and the
        queue's own timeline still reaches every value, failed from the first one
        dropped. What runs on the device now finishes. Must not block; ``close`` comes
        next."""

    @abstractmethod
    def close(self, abandon: bool = False) -> None:
        """Finish what was submitted, then release the queue. May block: never on a loop.

        ``abandon`` (interpreter exit): stop now, even inside a device-side wait."""


@dataclass
class DeviceInfo:
    name: str
    total_memory: int
    extra: dict[str, Any] = field(default_factory=dict)


# What another library's stream is taken for: adopted (a queue of its own), ordered on
# (a DLPack consumer's), or waited for (the stream an imported array's producer named).
StreamUse = Literal["adopt", "consume", "import"]


class Backend(ABC):
    """One opened device. Construction and ``close`` may block; they run in a thread."""

    kind: ClassVar[str]  # its name in the registry (asyncmetal.backends.BACKENDS)
    host_visible: ClassVar[bool] = False  # buffers can be viewed from the host in place
    runs_kernels: ClassVar[bool] = True  # compiles and launches kernels: a default device
    writable: ClassVar[bool] = True  # its buffers can be written (else: read-only sources)
    fork_safe: ClassVar[bool] = False  # a forked child may open one after its parent did
    any_index: ClassVar[bool] = False  # every ``kind:N`` opens a further device
    # DLPack's device type of its memory (kDLCPU 1, kDLCUDA 2, kDLMetal 8); 0: none.
    # Memory that is not host-visible is DLPack's device ``index`` (``kind:index``).
    dlpack_device_type: ClassVar[int] = 0
    # Queue.fill: the multiple of bytes its start (within the block) and length must be
    # (Metal on macOS: 4), and whether patterns of 2 or 4 bytes that are not one byte
    # repeated can be written (Metal's blit fills bytes only).
    fill_alignment: ClassVar[int] = 1
    fill_patterns: ClassVar[bool] = True
    # Its queues' device waits take any timeline of the native runtime (``c_timeline``
    # set: every kind's queue timelines), not only its own kind's: a cpu or npy queue's
    # thread waits on the timeline's condition, which whatever raises or fails the
    # timeline wakes; a cuda queue's wait on one with no device word (a cpu or npy
    # queue's) is held on the host, with the stream's work behind it, until it got there
    # or failed (native/timelines.c: ``kick_due``); Metal's waits on the host queues'
    # timelines only (``waits_for``), held on the queue's own thread with what comes
    # after until the timeline got there or failed (metal/_queue.py: ``HostWait``).
    # Its queues then order themselves after another kind's copies that read or wrote
    # its buffers in place (as after their own kind's commands: ``Queue.after``).
    waits_across_kinds: ClassVar[bool] = False
    # A device wait of its queues on another of its queues stands for what that queue's
    # own waits before the value stood for (Queue._ordered_after leaves those out): a
    # failure that ends a wait fails the commands behind it without running them, or
    # ends it only once what it waited for ran. Not on Metal, whose GPU runs a committed
    # command buffer whose wait a failure released (an abandoned queue's event goes to
    # its end; a discard fails the dropped values, and what waits for them is
    # committed): each use is waited for there.
    waits_imply_order: ClassVar[bool] = True

    def waits_for(self, timeline: NativeTimeline) -> bool:
        """Whether this backend's queues can wait on ``timeline``, another kind's queue
        timeline: where ``waits_across_kinds``, any of the native runtime's (a backend
        may take fewer)."""
        return self.waits_across_kinds and timeline.c_timeline is not None

    @classmethod
    @abstractmethod
    def available(cls) -> list[str]:
        """Names of the devices of this kind that can be opened here. Must not raise."""

    @classmethod
    def unavailable(cls) -> str:
        """Where :meth:`available` lists none: what this machine lacks for a device of
        this kind, and what would give it one ("": nothing to add). Must not raise."""
        return ""

    @abstractmethod
    def __init__(self, index: int) -> None: ...

    @property
    @abstractmethod
    def info(self) -> DeviceInfo: ...

    @property
    @abstractmethod
    def compiler(self) -> Compiler: ...

    @abstractmethod
    def load(self, binary: bytes, name: str, bindings: tuple[int, ...] | None = None) -> Any:
        """Load a compiled binary; return the native program for ``name``, whose
        parameters bind at ``bindings`` (its compiler's ``bindings``; None: in order).
        Raise AttributeError where the binary lacks ``name``; PermissionError where this
        process may not load code as the backend does (a noexec temporary directory, or
        one it cannot write the binary to), which no rebuilt binary would change;
        anything else: the binary does not load here, and the device builds it afresh
        once; ClosedResourceError once ``close`` has begun, which waits for the loads
        under way (one it stopped waiting for lets go of what it loaded itself). May
        block."""

    @abstractmethod
    def unload(self, native: Any) -> None:
        """Release a native program ``load`` returned, which nothing launches any more:
        every command that launched it has finished, and no Program holds it (after a
        ``close``: nothing to do). May block."""

    def param_sizes(self, native: Any) -> tuple[int, ...] | None:
        """Each parameter's size in bytes, in order, as the native program ``load``
        returned lays them out, where the backend can ask (None: it cannot): a compile
        refuses a kernel whose source reads otherwise (``binary_disagrees``)."""
        return None

    @abstractmethod
    def allocate(self, nbytes: int) -> Any:
        """A native buffer handle; raise MemoryError when the device has none left."""

    def max_allocation(self) -> int | None:
        """The largest buffer one ``allocate`` can make, where the device has such a
        limit below its memory (None: none); a larger request is refused at once."""
        return None

    @abstractmethod
    def free(self, handle: Any) -> None:
        """Release a handle ``allocate`` returned. Called on any thread, a loop's too (a
        cache eviction, a release), and from the GC: what takes time (a free that waits
        for the device, unmapping pages) belongs on a thread of the backend's own."""

    @abstractmethod
    def host_view(self, handle: Any, offset: int, nbytes: int) -> memoryview:
        """A writable view of host-visible memory (only if ``host_visible``)."""

    @abstractmethod
    def new_queue(self, timeline: NativeTimeline) -> NativeQueue:
        """A queue that signals ``timeline`` (made by :meth:`new_timeline`) after each
        command."""

    @abstractmethod
    def new_timeline(self, on_advance: Callable[[int], None]) -> NativeTimeline: ...

    def loan_address(self, handle: Any) -> int | None:
        """Where the memory of ``handle``, lent out, is addressed when it comes back (a
        host array over cpu memory, a device pointer): what a copy or ``from_dlpack``
        given that address matches to the buffer. None where memory lent out does not
        come back as an address of the buffer's range (a Metal buffer goes out as its
        MTLBuffer; its handle is an object, not its memory)."""
        address = getattr(handle, "address", handle)
        return address if isinstance(address, int) else None

    def pointer_index(self, address: int) -> int | None:
        """The index of the device whose memory ``address`` is (as its driver says),
        or None where this backend cannot tell."""
        return None

    def stream_key(self, stream: object) -> object:
        """What identifies the stream ``stream`` (as the user gave it) among those this
        device adopted; raise for what is not a stream this device can adopt."""
        raise InvalidArgumentError(
            f"{self.kind} devices have no streams to adopt (adopt_stream is for cuda devices)"
        )

    def stream_handle(self, stream: object, use: StreamUse = "adopt") -> int:
        """The handle of another library's ``stream`` (as the user gave it), not yet
        checked to be a stream of this device (a queue's ``wait_stream`` checks that);
        raise for what is no stream. ``use``: what it is taken for, as its errors say
        (``"adopt"``, ``"consume"``, ``"import"``)."""
        raise InvalidArgumentError(
            f"{self.kind} devices have no streams of other libraries (streams are for cuda devices)"
        )

    def checked_stream(self, stream: object) -> int:
        """``stream_handle(stream)``, checked to be a stream of this device; raise for
        what is not."""
        return self.stream_handle(stream)

    def adopt_queue(self, timeline: NativeTimeline, stream: object) -> NativeQueue:
        """A queue over an existing stream of another library (``stream`` as the user
        gave it), which ``close`` leaves to its owner."""
        raise InvalidArgumentError(
            f"{self.kind} devices have no streams to adopt (adopt_stream is for cuda devices)"
        )

    def order_stream(self, stream: object, uses: Sequence[tuple[NativeTimeline, int]]) -> None:
        """Make another library's ``stream`` (as the user gave it: a DLPack consumer's)
        wait, on the device, until each queue timeline of ``uses`` reaches its value,
        without adopting it: no queue and nothing that watches it is made. Raise
        InvalidArgumentError for what is not a stream of this device."""
        raise InvalidArgumentError(
            f"{self.kind} devices have no streams to order (streams are for cuda devices)"
        )

    def lost_error(self, what: str) -> BaseException | None:
        """The error ``what`` (an allocation, a compile) raises now because of a fault
        the driver made process-wide, or None. Checked before allocations and compiles,
        which may not reach the driver at all (a cached block, a loaded program)."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release the device after every queue was closed. May block."""

    def forked(self, message: str) -> None:  # noqa: B027 - a backend with no timelines
        """In a child forked from the process that opened this device, where its threads
        and driver state are the parent's: from now on every read of a timeline this
        backend made raises ClosedResourceError(message) (a wait on one would never
        end). Nothing of the parent's may be released or waited for here."""

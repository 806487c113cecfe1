"""Device, open_device() and devices() (the backends they open: asyncmetal.backends)."""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import functools
import importlib
import itertools
import math
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Collection, Coroutine, Generator, Iterable
from queue import Empty, SimpleQueue
from typing import Any

import anyio
import numpy as np

from . import backends
from ._allocator import (
    Allocator,
    Block,
    MemoryStatistics,
    closed_blocks,
    forget_left_blocks,
    free_left_blocks,
    let_lingering_go,
)
from ._backend import Backend, NativeQueue
from ._bridge import checkpoint, require_loop
from ._buffer import Buffer, wrap_buffer
from ._buffer import discard as discard_buffer
from ._compile import (
    Compiler,
    NotDefinedError,
    Signature,
    binary_disagrees,
    check_options,
    source_key,
    unlinked_hint,
)
from ._device_state import (
    DeviceState,
    forget_open_states,
    holding,
    state_closed,
    state_released,
    unreleased_states,
)
from ._dlpack import device_dlpack
from ._errors import (
    ArgumentTypeError,
    AsyncMetalError,
    ClosedResourceError,
    CompileError,
    CompileWarning,
    DeviceLostError,
    DeviceNotFoundError,
    InvalidArgumentError,
    Singular,
    as_int,
    check_bool,
    warn,
)
from ._interrupts import ctrl_c_discards, in_turn, until_uninterrupted
from ._pool import CompilePool, check_timeout, compiler_identity, default_pool
from ._program import Program
from ._queue import (
    Queue,
    abandon,
    close_native,
    completable,
    discard,
    fill_zeros,
    flush,
    let_go,
    native_queue,
    seal,
    settled,
    stream_reached,
    submitted_record,
    wait_finished,
)
from ._threads import run_sync as to_thread
from ._timeline import (
    MADE_BY_DEVICE,
    MAX_VALUE,
    QUEUE_DROPPED,
    QUEUE_REPLACED,
    HostEvents,
    Timeline,
    close_timeline,
    device_discarded,
    end_waits,
    queue_closed,
    signal_order,
    wait_value,
)


def devices() -> list[str]:
    """The devices that can be opened here, best first: ``"cuda:0"``, ``"metal"``, ``"cpu"``.

    ``"cpu"`` is ``"cpu:0"``; ``"cpu:1"``, ``"cpu:2"``... open further independent cpu
    devices, so cross-device code runs on any machine.
    """
    return [name for kind in backends.PREFERENCE for name in backends.available(kind)]


def is_available(name: str) -> bool:
    """Whether ``open_device(name)`` finds its device here (``name`` parses)."""
    kind, index = parse_name(name)
    cls = backends.backend_class(kind)
    available = cls.available()
    if name in available or f"{kind}:{index}" in available:
        return True
    return cls.any_index and bool(available)


def why_unavailable(name: str) -> str:
    """What a refusal of ``name`` (not available here) adds: where no device of its kind
    can be opened here, what this machine lacks for one ("" otherwise)."""
    kind, _ = parse_name(name)
    cls = backends.backend_class(kind)
    return "" if cls.available() else cls.unavailable()


# The largest index a device name may have: a C int, as DLPack's device id and CUDA's
# device ordinal are (cpu:N opens any N: one past this is no device any backend has).
MAX_DEVICE_INDEX = 2**31 - 1


def parse_name(name: str) -> tuple[str, int]:
    if not isinstance(name, str):
        raise ArgumentTypeError(f"device name must be a str, got {type(name).__name__}")
    kind, colon, index = name.partition(":")
    # (ASCII digits only, no leading zero: "cpu:01" would be another name for cpu:1, and
    # str.isdigit passes digits int() refuses, such as "²"; at most MAX_DEVICE_INDEX)
    if kind not in backends.BACKENDS or (
        colon
        and not (
            index.isascii()
            and index.isdigit()
            and str(int(index)) == index
            and int(index) <= MAX_DEVICE_INDEX
        )
    ):
        raise InvalidArgumentError(
            f"unknown device {name!r}: expected one of {', '.join(backends.BACKENDS)}, "
            f"optionally with ':N' (N at most {MAX_DEVICE_INDEX})"
        )
    return kind, int(index or 0)


def _import_anyio_now() -> None:
    """Import what anyio imports lazily, at its first use on a loop: done there, the
    first open_device held the loop 15-25 ms. Here it runs as asyncmetal is imported."""
    loops = ["asyncio", "trio"] if "trio" in sys.modules else ["asyncio"]
    modules = ["anyio.to_thread", "anyio.lowlevel", "anyio.abc", "anyio.streams.memory"]
    for module in modules + [f"anyio._backends._{loop}" for loop in loops]:
        with contextlib.suppress(ImportError):  # (a private module anyio may move)
            importlib.import_module(module)


_import_anyio_now()

RECOUNT_S = 0.05  # a close waiting for its queues counts what can complete this often
# A device's reaper (see Device._reap_later) looks for queues from new_queue() and
# adopt_stream() that have nothing in flight any more this long after one was made or
# submitted to again, then again twice as long after each look that let go of none (at
# most REAP_MAX_S), and at least REAP_DUTY times as long as its last look took -- but
# never more than REAP_LONGEST_S later: a queue dropped is let go of at its second look
# after its last command, so a long look (many buffers' records) delays that by seconds,
# not by a hundred times its own length. It holds the submission lock for REAP_CHUNK
# uses on the blocks' records at a time.
CLOSE_THREAD = "asyncmetal close"  # the name of the threads that run closes


class _CloseThread:
    """A close's thread, running ``target(*args)``: never a daemon, whoever starts it --
    a close awaited on a daemon thread's loop too. Inheriting that thread's daemon flag
    it would not be joined at exit, and the exit hook would find its device still open
    and run a native close beside its own (see _close_at_exit): joined, it ends first,
    as one started from the main thread does. Whether it began is told by a
    handshake, not by its ident: Thread.start may raise (no thread to be had, or a
    KeyboardInterrupt anywhere in it, also once the thread runs and before its ident is
    set), and then the starter calls it off. Under one lock (its __enter__ C: no
    interrupt in it) the thread either claims the run first or, called off, returns
    without running ``target``: what its end would do is the starter's then."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        self._lock = threading.Lock()
        self._begun = self._off = False
        self._target, self._args = target, args
        self.thread = threading.Thread(target=self._run, name=CLOSE_THREAD, daemon=False)

    def _run(self) -> None:
        with self._lock:
            self._begun = not self._off
        if self._begun:
            self._target(*self._args)

    def call_off(self) -> bool:
        """(Where its start raised.) Whether it never ran ``target`` and now never will;
        the same each time asked (called again after an interrupt)."""
        with self._lock:
            self._off = not self._begun
        return self._off


REAP_S = 0.05
REAP_MAX_S = 0.5
REAP_DUTY = 100
REAP_LONGEST_S = 5.0
REAP_CHUNK = 1024
RELEASE_LOOKS = 4  # closed queues new_queue (and a collection) look at, in turn
MAKING_POLL_S = 0.001  # how often a close looks whether the queues being made are through
# What a reaper is told: look soon (a queue to watch); a queue was collected; stop.
_LOOK, _COLLECTED, _STOP = 0, 1, 2
# A source this long or longer is hashed on a worker thread, not the loop: about 20 us
# per KiB (33 ms for 1.5 MB).
OFF_LOOP_SOURCE = 16 << 10
# And its kernel's parameters read there: an ordinary source's take about 20 us per
# KiB too, but the worst a source can make them take (text that the parser reads as
# many calls or declarations, ``k(a) int a;`` over and over) is about 0.8 ms per KiB.
OFF_LOOP_PARAMS = 1 << 10

# The devices open in this process, weakly: a tuple never changed, replaced whole by an
# open or a close (``_note_open``), and so read with no lock. A finalizer that the
# garbage collector runs at any allocation may look the devices up (one that imports:
# from_dlpack), also on a thread that is changing them: a lock held while the list is
# made, or while a change allocates, would be waited for there by its own holder. The
# lock is held only to compare and store, which allocate nothing (no collection starts
# there).
_open_devices: tuple[weakref.ref[Device], ...] = ()
_open_devices_lock = threading.Lock()
_opened = [0]  # devices opened so far in this process


def _devices() -> list[Device]:
    """The devices in ``_open_devices`` now (some may be closing)."""
    return [device for ref in _open_devices if (device := ref()) is not None]


def _note_open(device: Device, is_open: bool) -> int:
    """Add ``device`` to ``_open_devices`` (``is_open``; counted among those opened) or
    take it out; the devices collected meanwhile go too. Returns how many devices this
    process has opened. The new tuple is made before the lock is taken, and made again
    where another thread's change landed meanwhile."""
    global _open_devices
    while True:
        before = _open_devices
        after = tuple(r for r in before if (d := r()) is not None and d is not device)
        if is_open:
            after += (weakref.ref(device),)
        with _open_devices_lock:
            if _open_devices is before:
                _open_devices = after
                if is_open:
                    _opened[0] += 1  # (an int: not tracked, no collection starts here)
                return _opened[0]


def devices_opened() -> int:
    """How many devices this process has opened so far: what was looked up among the
    open devices is stale once it changes (another may be the one to pick now)."""
    return _opened[0]


def _completable() -> dict[Queue, int]:
    """How far each queue of every open device can still get (``_queue.completable``):
    queues of one device may wait on those of another."""
    return completable([q for d in _devices() for q in d._queues])


async def _count_completable() -> dict[Queue, int]:
    """``_completable()``, from what was submitted to each queue taken while no
    submission to any open device is under way: each holds its device's submission
    lock from its check that the device is open to its record of a device wait
    (``Queue.wait``), and a count between a wait's hand-over and that record would take
    the wait for one that completes, and wait for it for good. Only the taking is under
    the locks (a queue's number and its record of waits: quick); the count is not."""
    devices = _devices()
    states = list({id(d._state): d._state for d in devices}.values())  # (holding orders them)

    def take() -> dict[Queue, tuple[int, list[Any]]]:
        return {q: submitted_record(q) for d in devices for q in d._queues}

    records = await holding(states, take)
    return completable(list(records), records)


async def _finish_commands(queue: Queue) -> bool:
    """Wait until ``queue`` (sealed) ran what was submitted to it (a checkpoint); raise
    a command's error. Once its commands are discarded -- by this close or another one,
    also while this waits -- a queue whose device waits a driver may have been handed
    (``hands_over_waits``: what it has behind them cannot be dropped) is waited for only
    until it ran what can still complete (``_count_completable``): False if it stopped
    short of its last command, held on the device behind a wait that nothing submitted
    or signalled yet satisfies. (Other backends drop such waits with what follows.)"""
    hands_over = native_queue(queue).hands_over_waits
    while True:
        target = queue.submitted
        if queue._discarded is not None and hands_over:
            limits = await _count_completable()
            target = min(target, limits.get(queue, target))
        until, recount = target, hands_over
        if queue.timeline.value >= target:
            # (Its timeline's value, but for commands it reported failed before its
            # stream got past them, which may never come: see NativeQueue.reached. It
            # settles -- its timeline at MAX_VALUE -- once its stream is past them.)
            reached = stream_reached(queue)
            if reached >= target:
                return reached >= queue.submitted
            until, recount = MAX_VALUE, True
        # Counted again now and then: a discard may come while this waits, and what the
        # count relied on may never come (another device's close stops its queues). Only
        # where waits are handed over: elsewhere a discard ends the wait by itself.
        with anyio.move_on_after(RECOUNT_S if recount else math.inf):
            await wait_value(queue.timeline, until)


class Device(Singular):
    """An opened device. Use ``async with asyncmetal.open_device(name) as dev``.

    ``dev.queue`` is its default queue, made when it opens (``new_queue()`` makes more;
    ``adopt_stream()`` wraps another library's cuda stream). ``buf.write`` and
    ``buf.read`` run on it -- or, once every later command of it fails, on a queue the
    device makes in its stead; ``queue.copy`` runs a copy on any queue.
    """

    def __init__(self, name: str, backend: Backend, opened_at: str = "") -> None:
        # What the layers below see of this device: they are handed this, not the Device.
        self._state = DeviceState(name, backend, self)
        self._backend = backend
        self._queues: list[Queue] = []
        # The queues over adopted streams, by stream, while they live: released as those
        # of new_queue() are (see _idle), once dropped with nothing in flight.
        self._adopted: weakref.WeakValueDictionary[object, Queue] = weakref.WeakValueDictionary()
        self._timelines: weakref.WeakSet[Timeline] = weakref.WeakSet()  # from timeline()
        self._closing: HostEvents | None = None  # reaches 1 once a close has finished
        self._torn_down = False  # a close's teardown has begun (on its thread)
        # A close whose teardown could not begin (its loop not made) and why: the closes
        # that waited for it raise that.
        self._unstarted: tuple[HostEvents, BaseException] | None = None
        self._starting = 0  # close threads started that have not ended
        # What the teardown's native close was called with, once it was: where that was
        # cut as it was entered (the device still open once the teardown ended), a
        # later close runs it again with them (_native_cut).
        self._native_args: tuple[bool, frozenset[Queue]] | None = None
        # Its close drops what has not started (close(discard=), or a KeyboardInterrupt
        # reached it): what the dropped commands' errors say did it (discard's why).
        self._discarding: str | None = None
        self._close_lock = threading.Lock()
        # The queues new_queue and adopt_stream are making (their native queues outside
        # the submission lock; counted under it): see _close_native.
        self._makings = 0
        self._allocator = Allocator(self._state)
        self._pool: CompilePool | None = None
        # Loaded programs while they are in use; a Program collected leaves its native
        # program in _dropped (its finalizer), to be unloaded once what launched it ran.
        self._programs: weakref.WeakValueDictionary[tuple[str, str], Program] = (
            weakref.WeakValueDictionary()
        )
        self._dropped: list[Any] = []
        self._retired: list[tuple[Any, list[tuple[Queue, int]]]] = []
        self._retire_lock = threading.Lock()
        # Queues closed (Queue.close) and not released yet: each is released once its
        # commands ran, by its close or, where that was cancelled, the reaper (or
        # new_queue, a few at a time: _release_done). A dict (in the order they were
        # closed), so that each is found and taken off at once, however many there are.
        self._unreleased: dict[Queue, None] = {}
        # Its queues in the order new_queue looks at them, a few at a time (see
        # _release_done); those released since are passed over as they come.
        self._in_turn: collections.deque[Queue] = collections.deque()
        self._releases: dict[Queue, HostEvents] = {}  # under way: reach 1 once done
        self._taken: dict[Queue, None] = {}  # those a release thread took (_start_release)
        # The numbers of collected queues handed to a release thread not yet run.
        self._dropping: set[int] = set()
        self._release_threads: list[threading.Thread] = []
        # Queues from new_queue() and adopt_stream() with nothing in flight that the
        # device let go of (see _let_go_of_idle_queues): alive while someone holds
        # them. One collected leaves its number here (its finalizer, on any thread)
        # and tells the reaper, which releases its native queue on a thread of its
        # own (so does the next new_queue, and the device's close). The native
        # queues are kept here by number, not by the finalizers: a native queue that
        # refers to its Queue (a Metal queue's recent command buffers' records)
        # would keep it alive for good from a finalizer.
        self._idle: weakref.WeakSet[Queue] = weakref.WeakSet()
        # The queues closed (or replaced in the default queue's stead) and released
        # whose uses the reaper has not yet taken off the buffers' records (see _look):
        # a closed queue is never submitted to again, and is claimed only once its
        # commands settled, so its uses pass; a buffer would otherwise keep it alive
        # (with its timeline and native queue) as long as the buffer lives. Weakly: one
        # on no record is collected, and has nothing left to take off.
        self._closed_off: weakref.WeakSet[Queue] = weakref.WeakSet()
        self._natives: dict[int, tuple[NativeQueue, Timeline]] = {}
        self._dropped_queues: list[int] = []
        self._numbers = itertools.count()
        self._on_drop: weakref.WeakKeyDictionary[Queue, weakref.finalize[Any, Any]] = (
            weakref.WeakKeyDictionary()
        )
        # How many queues it kept after it last let go of some, and how many blocks it
        # looked through then: the next time is once the queues doubled, and later with
        # many blocks (each new_queue pays for about 64 looked at).
        self._kept_at_sweep = 0
        self._blocks_at_sweep = 0
        # The reaper (see _reap_later): a thread, started at the first new_queue, that
        # lets go of idle queues and releases collected ones without waiting for another
        # new_queue. _watching: it was told to look (submission lock held to change it).
        self._reaper: threading.Thread | None = None
        self._reaper_inbox: SimpleQueue[int] = SimpleQueue()
        self._watching = False
        # (A plain attribute, not a read-only property: programs read dev.queue at each
        # launch, and a property costs a launch's submission a few percent.)
        self.queue = self._state.queue = Queue(self._state, _made=MADE_BY_DEVICE)
        self._queues = [self.queue]  # (no call between: made, it is among them)
        self._state.make_queue = self.new_queue
        self._state.retire_queue = self._retire_queue
        self._opened_as = ""  # (read by the exit's warning: set before it is listed)
        number = _note_open(self, True)
        # Which device of the process it is, and where open_device was called: its
        # warning if left open says so (two of one name would warn alike).
        self._opened_as = f"number {number} opened in this process" + (
            f", at {opened_at}" if opened_at else ""
        )

    def __repr__(self) -> str:
        return f"<Device {self.name}{' closed' if self.closed else ''}>"

    @property
    def name(self) -> str:
        """The name it was opened as: ``"cpu"``, ``"cpu:1"``, ``"cuda:0"``, ``"metal"``..."""
        return self._state.name

    @property
    def closed(self) -> bool:
        """Whether it is closed: true once its close takes no more work (at once with
        ``discard=True``); its calls then raise ClosedResourceError."""
        return self._state.closed

    def _mark_closed(self) -> None:
        # (Read-only to users: a device marked closed by hand would skip its close.)
        self._state.closed = True
        state_closed(self._state)
        # Its callers' waits on compiles in the pool end: see DeviceState.close_waits.
        # Each is ended before it is taken off (a wait ended twice is ended): an
        # interrupt as one is taken off leaves none unended (the close marks it again).
        waits = self._state.close_waits
        while waits:
            for wait in list(waits):
                end_waits(wait)
                waits.discard(wait)  # (its waiter may have taken it off meanwhile)

    @property
    def kind(self) -> str:
        """Its kind, the name without ``:N``: ``"cpu"``, ``"npy"``, ``"cuda"``, ``"metal"``."""
        return self._backend.kind

    def _pointer_index(self, address: int) -> int | None:
        """The index of the GPU whose memory ``address`` is, where this device's driver
        can tell (cuda: any GPU's), else None."""
        return self._backend.pointer_index(address)

    @property
    def writable(self) -> bool:
        """Whether its buffers can be written (the npy device's are read-only sources)."""
        return self._backend.writable

    @property
    def dlpack_device(self) -> tuple[int, int]:
        """Its memory's DLPack (device type, index), as its buffers'
        ``__dlpack_device__`` say: (kDLCPU, 0) for host memory, (kDLCUDA, N) for cuda:N."""
        return device_dlpack(self._state)

    @property
    def total_memory(self) -> int:
        """The bytes of memory the device has (what ``memory_budget`` None stands for)."""
        return self._backend.info.total_memory

    def _check_open(self) -> None:
        self._state.check_open()

    def _own_queue(self) -> Queue:
        """The queue its own work for its buffers runs on: ``queue``, or the one the
        device uses in its stead once every later command of it fails
        (``DeviceState.default_queue``)."""
        queue = self._state.default_queue()
        assert isinstance(queue, Queue)
        return queue

    def new_queue(self) -> Queue:
        """A new queue: its own ordered stream and timeline."""
        self._check_open()  # (first: see Queue._submit)
        return self._make_queue()

    def _make_queue(self, stream: object = None, key: object = None) -> Queue:
        """new_queue's queue, or (``key`` given) adopt_stream's over ``stream``, whose
        key among the adopted streams is ``key``.

        Made and recorded whole: a KeyboardInterrupt (trio raises Ctrl-C in whatever
        Python code its task runs; CPython, at a call's entry or return) before the
        queue is recorded -- among the queues, its native queue by number, its
        finalizer -- releases what was made of it (_unmade), as does a close that came
        first. Left: an interrupt as the backend's new_queue returns its native queue,
        not stored yet (nothing in Python holds it then: its finalizer releases it
        once collected). Where another thread adopted the stream meanwhile, its queue is
        the one given."""
        making: list[Queue] = []
        number = -1
        recorded = counted = False
        try:
            # Its native queue (a cuda stream, its events and completion thread: up to
            # tens of ms) is made outside the submission lock, which every other
            # thread's submission to the device waits for: counted as being made first
            # (the device's close releases nothing before those are through), and
            # recorded under the lock once made, if the device is still open.
            with self._state.submitting:
                self._makings += 1
                counted = True  # (no call between: nothing interrupts them)
                self._check_open()  # (after the count: see _close_native)
            queue = Queue(
                self._state,
                _made=MADE_BY_DEVICE,
                _stream=stream,
                _closer=self._close_queue,
                _keeper=self._keep_queue,
                _making=making,
            )
            with self._state.submitting:  # (a close seals its queues: see Queue._submit)
                self._check_open()
                adopted = None if key is None else self._adopted.get(key)
                if adopted is not None and adopted._closed is None:
                    queue = adopted
                else:
                    number = next(self._numbers)
                    self._record(queue, number)
                    if key is not None:
                        self._adopted[key] = queue
                    recorded = True
                    self._recorded()
        finally:
            # A KeyboardInterrupt as this waits for the lock (another thread's submission
            # holds it: CPython runs the handler in the wait, and nothing is taken) does
            # not skip what follows: it waits again, and the interrupt is raised once
            # done -- skipped, the count would stay, and the device's close wait for good.
            interrupt: KeyboardInterrupt | None = None
            entered = False
            while not entered:
                try:
                    with self._state.submitting:
                        entered = True  # (no call between the lock taken and this)
                        try:
                            if not recorded:
                                if (
                                    key is not None
                                    and making
                                    and self._adopted.get(key) is making[0]
                                ):
                                    del self._adopted[key]
                                self._unmade(making, number)
                        finally:
                            if counted:
                                self._makings -= 1
                except KeyboardInterrupt as exc:
                    if entered:
                        raise
                    interrupt = exc
            if interrupt is not None:
                raise interrupt
        return queue

    def _record(self, queue: Queue, number: int) -> None:
        """Record ``queue``, just made by new_queue or adopt_stream, as numbered
        ``number`` (submission lock held): among the queues, its native queue by number,
        its finalizer, which hands that native queue to the reaper once the queue is
        collected (see _idle). Interrupted on the way, _unmade takes back what was."""
        self._queues = [*self._queues, queue]  # (a new list: see _claim_release)
        self._natives[number] = (native_queue(queue), queue.timeline)
        drop = weakref.finalize(queue, _collected, self._dropped_queues, self._reaper_inbox, number)
        drop.atexit = False
        self._on_drop[queue] = drop

    def _recorded(self) -> None:
        """After a queue was recorded (submission lock held): let go of the idle queues
        once the queues kept doubled, release those done, and have the reaper look."""
        if len(self._queues) >= 2 * self._kept_at_sweep + 16 + self._blocks_at_sweep // 64:
            self._let_go_of_idle_queues()
        self._release_done()
        self._reap_later()

    def _unmade(self, making: list[Queue], number: int) -> None:
        """A KeyboardInterrupt, or the device's close, stopped new_queue (or
        adopt_stream) before the queue it was making (in ``making``, if its making
        began) was recorded whole, and numbered ``number`` (-1: not yet):
        take what of it was recorded back, and release its native queue, if made, on a
        release thread (submission lock held), as a collected queue's."""
        for queue in making:
            self._queues = [q for q in self._queues if q is not queue]
            if number >= 0:
                self._natives.pop(number, None)
            drop = self._on_drop.pop(queue, None)
            if drop is not None:
                drop.detach()
            native = queue.__dict__.get("_native")  # (None: interrupted before it was made)
            if native is not None:
                self._start_release([], [native])

    def _release_done(self, every: bool = False) -> None:
        """Release, on release threads, the closed queues whose closes were cancelled
        once their commands ran, and the native queues of the queues collected
        (submission lock held). Started before the lock is let go: a close seals the
        device under it, so their threads are then among those the close waits for (see
        _start_release).

        The closed queues looked at are RELEASE_LOOKS of them, in turn -- ``every`` one
        at the reaper's looks (paced by how long they take): so new_queue takes the
        same time however many closes stay blocked (not a pass over all of them per
        call), and one done is released by the reaper's next look or by new_queue once
        its turn comes, whichever is first."""
        if every:
            ready: list[Queue] = []
            waiting: collections.deque[Queue] = collections.deque()
            for queue in self._unreleased:
                (ready if settled(queue) else waiting).append(queue)
            self._in_turn = waiting
        else:
            ready = self._settled_in_turn(RELEASE_LOOKS)
        self._release(ready)
        # The collected queues' natives stay recorded (by number, among those dropped)
        # until the release thread takes them: a KeyboardInterrupt before it started
        # leaves them to a later call, or to the device's close.
        dropped = [n for n in self._dropped_queues[:] if n not in self._dropping]
        if not dropped:
            return
        for number in dropped:  # its close ends waits on it (none reach it)
            recorded = self._natives.get(number)
            if recorded is not None:
                self._timelines.add(recorded[1])
        try:
            self._dropping.update(dropped)  # (not handed to another release thread)
            self._start_release([], dropped=dropped)
        except BaseException:
            self._dropping.difference_update(dropped)  # (taken by none: for a later call)
            raise

    def _settled_in_turn(self, looks: int) -> list[Queue]:
        """The settled ones among the next ``looks`` closed queues in turn (submission
        lock held); those not settled go to the back. Those released since they were
        closed are passed over (not counted): each once."""
        ready = []
        turn = self._in_turn
        while looks and turn:
            queue = turn.popleft()
            if queue not in self._unreleased:
                continue
            looks -= 1
            if settled(queue):
                ready.append(queue)
            else:
                turn.append(queue)
        return ready

    def _take_dropped(self, numbers: list[int] | None = None) -> list[tuple[NativeQueue, Timeline]]:
        """The native queues of the queues collected (those numbered ``numbers``, or
        all), each with its queue's timeline, taken off the records (submission lock
        held; those taken before left)."""
        if numbers is None:
            numbers = self._dropped_queues[:]  # (finalizers append meanwhile)
        taken = []
        for number in numbers:
            self._dropping.discard(number)
            with contextlib.suppress(ValueError):
                self._dropped_queues.remove(number)
            recorded = self._natives.pop(number, None)
            if recorded is not None:
                taken.append(recorded)
        return taken

    def _let_go_of_idle_queues(self) -> None:
        """Stop keeping alive the queues from new_queue() and adopt_stream() that have
        nothing in flight
        (submission lock held), so that one its owner dropped is collected and its
        native queue released: their uses that passed are taken off the buffers' records
        too (a queue there would stay alive as long as the buffer). An idle queue
        submitted to again is kept again first (Queue._kept). Made now and then: once
        the queues kept doubled since the last time."""
        idle = self._mark_idle()
        if idle:
            self._blocks_at_sweep = self._allocator.forget_passed_uses(
                idle, self._recorded_blocks()
            )

    def _recorded_blocks(self) -> list[Block]:
        """The blocks in use and cached whose records this device's queues may be on:
        its own, those of the other open devices (a copy between devices records its
        queue's use on the other's buffer too), and those of closed devices whose
        buffers live with such uses on their records."""
        return [
            *self._allocator.blocks(),
            *(b for d in _devices() if d is not self for b in d._allocator.blocks()),
            *closed_blocks(),
        ]

    def _mark_idle(self, unused: list[tuple[Queue, int]] | None = None) -> list[Queue]:
        """Let go of the idle queues (see _let_go_of_idle_queues; submission lock held),
        with ``unused`` only those of it (the reaper's look: see _unused_queues) not
        submitted to since: their uses on the buffers' records are left to the caller.
        Return them."""
        if unused is None:
            idle = [q for q in self._queues if q is not self.queue and let_go(q)]
        else:
            idle = [q for q, seen in unused if not q._idle and q.submitted == seen and let_go(q)]
        if idle:
            gone = {id(q) for q in idle}  # (not ``in idle``: that is one pass per queue kept)
            self._queues = [q for q in self._queues if id(q) not in gone]
            self._idle.update(idle)
        self._kept_at_sweep = len(self._queues)
        return idle

    def _keep_queue(self, queue: Queue) -> None:
        """Keep an idle queue again: a command is about to be submitted to it (its
        submission lock held)."""
        self._idle.discard(queue)
        self._queues = [*self._queues, queue]
        self._reap_later()

    def _reap_later(self) -> None:
        """Have the reaper look soon for queues to let go of and release (submission
        lock held): a queue was made, submitted to after it was let go of, or closed by
        a close that may be cancelled before it releases it.

        The reaper is a thread of the device's, so that a queue its owner dropped is
        released once nothing of it is in flight, not at the next new_queue: it lets go
        of the idle queues now and then (``_look``) while some may become idle, and a
        queue collected (its finalizer, on any thread, even in a GC pass inside a
        lock, only appends its number and tells the reaper through a SimpleQueue,
        which takes no lock) is released at once on a release thread (``_reaped``):
        neither the thread that dropped it nor a loop ever waits for its native
        close."""
        if self._watching:
            return
        if self._reaper is None:
            reaper = threading.Thread(
                target=_reap,
                args=(weakref.ref(self), self._reaper_inbox),
                name=f"asyncmetal reaper ({self.name})",
                daemon=True,
            )
            try:
                reaper.start()
            except RuntimeError:
                return  # (no thread to be had: new_queue and the close release them)
            self._reaper = reaper
            # A device collected unclosed (its warning at exit says so) stops it.
            weakref.finalize(self, self._reaper_inbox.put, _STOP).atexit = False
        self._watching = True
        self._reaper_inbox.put(_LOOK)

    def _reaped(self, every: bool = False) -> bool:
        """Release the native queues of the queues collected, and the closed queues
        whose closes were cancelled once their commands ran (on the reaper; taking the
        submission lock): ``every`` one done, or those done of the next few in turn (a
        collection: see _release_done). False once the device is closed (the close
        releases them)."""
        with self._state.submitting:
            if self.closed:
                return False
            self._release_done(every)
        return True

    def _look(self) -> bool | None:
        """Let go of the idle queues (on the reaper), a part of the buffers' records at a
        time, so that those dropped are collected (and then released: ``_reaped``); the
        uses of the queues closed and released since (``_closed_off``) go off the records
        too. Whether it let go of any; None once nothing more can become idle (the reaper
        waits until told; ``_watching`` unset) or the device is closed."""
        lock = self._state.submitting
        unused = self._unused_queues()
        with lock:
            if self.closed:
                return None
            idle = self._mark_idle(unused)
            closed = list(self._closed_off)  # (taken off once looked at: an error keeps them)
        del unused
        blocks = self._recorded_blocks() if idle or closed else []  # (each use looked up again)
        parts = _recorded_uses([*idle, *closed], blocks)
        off = {id(q) for q in closed}  # (sealed: never submitted to again)
        left: list[Queue] = []
        part: list[tuple[Block, Queue]] = []
        uses: list[tuple[Block, Queue]] = []
        for part in parts:
            with lock:
                if self.closed:
                    return None
                # Those submitted to again meanwhile (kept) record new uses: left alone.
                uses = [(b, q) for b, q in part if q._idle or id(q) in off]
                self._allocator.forget_passed(uses)
                # A closed queue's use not passed yet (none should be: it was claimed
                # once settled) is looked at again at the next look.
                left += [q for b, q in uses if id(q) in off and q in b.last_use]
        let_go_of = bool(idle)
        with lock:  # (those claimed meanwhile stay for the next look)
            kept = {id(q) for q in left}
            self._closed_off.difference_update([q for q in closed if id(q) not in kept])
        del idle, closed, left, uses, parts, part  # one nobody else holds is collected here
        if not self._reaped(every=True):
            return None
        with lock:
            if let_go_of:
                self._blocks_at_sweep = len(blocks)
            if (
                not self._unreleased
                and not self._closed_off
                and not any(q is not self.queue for q in self._queues)
            ):
                self._watching = False
                return None
        return let_go_of

    def _unused_queues(self) -> list[tuple[Queue, int]]:
        """The queues kept (but the default one) not submitted to since the reaper's last
        look, each with what had been submitted to it then (on the reaper). Read without
        the submission lock: a pass over every queue kept, which with thousands of them
        would hold each loop's next submission for as long; only those found unused are looked
        at again under the lock (``_mark_idle``), where one submitted to meanwhile is
        passed over. ``_queues`` is replaced, never changed in place, so the pass sees
        one whole list; ``_looked_at`` is the reaper's own."""
        default = self.queue
        return [(q, q._looked_at) for q in self._queues if q is not default and _unused(q)]

    def adopt_stream(self, stream: object) -> Queue:
        """A Queue over an existing stream of another library (cuda devices): an object
        with ``__cuda_stream__`` (PyTorch, CuPy, cuda.core, numba-cuda streams), or a raw
        ``CUstream`` (an integer, ``1`` the legacy default stream). Its
        :meth:`Queue.marker` records an event on the stream, so awaiting it awaits
        everything anyone submitted there before. asyncmetal commands on it run in the
        stream's order. Closing the queue or the device leaves the stream to its owner
        (it must outlive the device or the queue's last use).

        Adopting a stream again gives the same queue as long as that one lives, until it
        is closed: from its ``close()`` on -- also while that waits for its commands -- a
        new one (the closed one refuses every command). A stream its owner destroyed and
        a new one given its handle are two streams (told apart by the driver's id of
        each, where the driver has ids: CUDA 12): the new one gets a queue of its own.
        A queue dropped without
        ``close()`` (nothing refers to it any more) is released, as one of
        ``new_queue()`` is, once nothing of it is in flight -- its completion thread and
        events; the stream stays its owner's --, so adopting a new stream per request
        does not pile them up; adopting that stream later gives a new queue. The
        stream of one of this device's own queues (its ``handle``) is refused: submit to
        that queue."""
        self._check_open()
        key = self._backend.stream_key(stream)
        with self._state.submitting:
            self._check_open()
            queue = self._adopted.get(key)
        if queue is not None and queue._closed is None:
            return queue
        # One of this device's own queues' streams (``q.handle``, through
        # ``torch.cuda.ExternalStream``): a second queue over it would number its
        # commands apart from that queue's, and that queue's close destroys the stream.
        handle = self._backend.checked_stream(stream)
        for own in self._queues:
            native = own._native
            if own._closed is None and not native.adopted and native.handle == handle:
                raise InvalidArgumentError(
                    f"stream {handle:#x} is the stream of a queue of {self.name} "
                    "(its handle): submit to that queue itself"
                )
        return self._make_queue(stream, key)

    def timeline(self) -> Timeline:
        """A new timeline at value 0, for ordering between queues, devices and the host."""
        self._check_open()
        with self._state.submitting:  # (as new_queue: a close ends waits on every one)
            self._check_open()
            timeline = Timeline(self._state, _made=MADE_BY_DEVICE)
            self._timelines.add(timeline)
        return timeline

    async def alloc(
        self, nbytes: int, *, timeout: float | None = None, zeroed: bool = False
    ) -> Buffer:
        """Allocate ``nbytes`` of device memory (contents undefined; with ``zeroed``,
        zeros).

        When the device's budget is spent this waits for frees -- including buffers
        freed (or dropped) while commands using them are still in flight -- and raises
        :class:`OutOfMemoryError` (with the numbers) only if ``nbytes`` can never fit
        (also once the budget is lowered below it while it waits), the device itself is
        full with nothing in flight, or ``timeout`` passes. Closing the device makes it
        raise :class:`ClosedResourceError`. Cancelling it allocates nothing.

        ``zeroed``: the memory is filled with zeros on the device (a fill on the
        default queue, as ``queue.fill(buf, 0)``) and the buffer is returned once that
        fill has finished, so commands on any queue see zeros (``timeout`` bounds the
        allocation only); cancelled during the fill, the buffer is freed once the fill
        is done.
        """
        self._check_open()
        check_bool(zeroed, "zeroed")
        nbytes = as_int(nbytes) or nbytes  # (a numpy integer as an int; the rest refused below)
        lost = self._backend.lost_error(f"allocating {nbytes} bytes")  # a cached block too
        if lost is not None:
            raise lost
        span = nbytes
        if zeroed and isinstance(nbytes, int):  # (whole words where the fill needs them)
            span = -(-nbytes // self._backend.fill_alignment) * self._backend.fill_alignment
        allocation = await self._allocator.alloc(span, timeout)
        buf = Buffer(self._state, allocation, 0, nbytes)
        if zeroed:
            try:
                await fill_zeros(self._own_queue(), buf, span)
            except BaseException:
                discard_buffer(buf)  # (after the fill: it is recorded as a use)
                raise
        return buf

    def _wrap(self, array: Any) -> Buffer:
        """A read-only Buffer whose memory is ``array`` itself (the ``npy`` device only).

        The array must be C-contiguous; it is kept alive by the buffer."""
        self._check_open()
        wrap = getattr(self._backend, "wrap", None)
        if wrap is None:
            raise InvalidArgumentError(
                f"{self.name} buffers come from alloc(); only the npy device wraps arrays "
                "(from_numpy)"
            )
        if not isinstance(array, np.ndarray):
            raise ArgumentTypeError(f"wrap takes a numpy array, got {type(array).__name__}")
        if array.dtype.hasobject:
            raise ArgumentTypeError(
                f"the array holds Python objects ({array.dtype}): expected plain data "
                "(numbers, bools, bytes); device memory cannot hold object pointers"
            )
        if not array.flags.c_contiguous:
            raise InvalidArgumentError("the array is not C-contiguous: np.ascontiguousarray it")
        if array.nbytes == 0:
            raise InvalidArgumentError("the array is empty")
        return wrap_buffer(self._state, wrap(array), array.nbytes)

    @property
    def memory_budget(self) -> int:
        """Bytes this device may hold (buffers in use plus cached ones). Settable (None:
        all it has, the default); lowering it below what is in use makes later
        allocations wait, and fails those waiting for more than the new budget."""
        return self._allocator.budget

    @memory_budget.setter
    def memory_budget(self, budget: int | None) -> None:
        self._allocator.set_budget(budget)

    @property
    def memory_cache_limit(self) -> int:
        """Most bytes of freed blocks this device keeps for reuse (least recently freed
        go first). Settable: an int >= 0 (0 caches nothing), or None for the default,
        a quarter of the device's memory and at most 1 GiB (``memory_budget`` bounds
        what is cached too). Setting it, or ``memory_budget``, on a closed device
        raises ClosedResourceError."""
        return self._allocator.cache_limit

    @memory_cache_limit.setter
    def memory_cache_limit(self, limit: int | None) -> None:
        self._allocator.set_cache_limit(limit)

    def memory_statistics(self, *, reset_peaks: bool = False) -> MemoryStatistics:
        """Bytes in use, cached, the peaks and the budget (releases due are made first).
        With ``reset_peaks``, the peaks start again from what is held now, once these
        numbers are taken."""
        check_bool(reset_peaks, "reset_peaks")
        return self._allocator.statistics(reset_peaks)

    async def empty_memory_cache(self) -> int:
        """Release every cached block (freed buffers kept for reuse) to the device, and
        return how many bytes that was. The native frees run on a thread of their own
        (a cuda free may wait for the device), to their end whatever cancels the caller;
        buffers in use are untouched.

        Like :meth:`memory_statistics`, it still answers once the device is closed (or
        is the parent's, in a forked child): its close released every block, so it
        returns 0 and releases nothing."""
        return await self._allocator.release_cached()

    @property
    def compile_pool(self) -> CompilePool:
        """The pool this device compiles in (the process's shared one by default)."""
        return self._pool if self._pool is not None else default_pool()

    @compile_pool.setter
    def compile_pool(self, pool: CompilePool | None) -> None:
        """Set to a CompilePool; None: back to the process's shared one."""
        self._check_open()
        if pool is not None and not isinstance(pool, CompilePool):
            raise ArgumentTypeError(
                f"compile_pool must be a CompilePool, or None for the process's shared "
                f"one, got {type(pool).__name__}"
            )
        self._pool = pool

    async def compile(
        self,
        src: str,
        name: str,
        *,
        options: tuple[str, ...] | list[str] = (),
        timeout: float | None = None,
    ) -> Program:
        """Compile ``src`` in the worker-process pool (cached) and load kernel ``name``.

        ``options`` go to the device's compiler after its own flags, one per item: the C
        compiler's (cpu: ``("-DN=4", "-O3")``), NVRTC's (cuda: ``("-DN=4",
        "--use_fast_math")``), the Metal compiler's (``("-DN=4",)``). A source compiled
        with other options is another program, cached apart.

        Raises :class:`CompileError` (its ``name`` is ``name``) with the compiler's log,
        also when ``name`` is not defined in ``src``, and when ``timeout`` (seconds,
        positive) passes: the worker and the compiler processes it started are then
        killed. A cached binary that does not load is rebuilt once -- unless code may
        not run where it is loaded from (a noexec temporary directory: a CompileError
        naming it, the cache entry kept). Cancelling withdraws a compile that has not
        started; a running one finishes into the cache. The device's close ends the
        wait as it seals the device, with ClosedResourceError, as cancelling does (the
        compile goes on for other callers awaiting it, another device's too).
        """
        timeout = check_timeout(timeout)  # arguments first, then the source
        options = check_options(options)
        with _naming(name):
            self._check_compile(src, name)
            compiler = self._backend.compiler._with_options(options)
            key = (await _source_key(await compiler_identity(compiler), src), name)
            program = self._programs.get(key)
            if program is not None:  # (its parameters were read when it was loaded)
                await checkpoint()
                return program
            params = await self._params(src, name, compiler)
            pool = self.compile_pool
            if isinstance(params, NotDefinedError):
                # Not found: where the source does not compile (a typo in the very
                # signature), the compiler's error says why, with its log.
                await pool._compile_keyed(compiler, src, key[0], timeout=timeout, state=self._state)
                raise params
            binary, log = await pool._compile_keyed(
                compiler, src, key[0], timeout=timeout, state=self._state
            )
            program = await self._program(key, params, binary, src, compiler, timeout)
        if log:  # once the program is loaded: raised as an error, it loses no compile
            _warn_compiled(name, log)
        return program

    def _check_compile(self, src: object, name: object) -> None:
        self._check_open()
        if not isinstance(src, str) or not isinstance(name, str):
            raise ArgumentTypeError(
                f"compile(src, name) takes two str, got {type(src).__name__}, {type(name).__name__}"
            )
        _check_kernel(src, name, "compile(src, name)")
        lost = self._backend.lost_error(f"compiling {name!r}")  # a loaded program too
        if lost is not None:
            raise lost

    async def _params(
        self, src: str, name: str, compiler: Compiler | None = None
    ) -> Signature | NotDefinedError:
        """Kernel ``name``'s parameters as ``src`` declares them to ``compiler`` (the
        device's by default; a compile's, with its options: ``-funsigned-char`` makes a
        plain char unsigned), or the NotDefinedError of a name it lacks; read on a
        worker thread for a long source."""
        compiler = self._backend.compiler if compiler is None else compiler
        read = functools.partial(_read_params, compiler, src, name)
        return read() if len(src) < OFF_LOOP_PARAMS else await to_thread(read)

    async def _program(
        self,
        key: tuple[str, str],
        params: Signature,
        binary: bytes,
        src: str,
        compiler: Compiler,
        timeout: float | None,
    ) -> Program:
        name = key[1]
        try:
            native = await self._loaded(binary, name, src)
        except _UnloadableError:
            # A binary that verified but does not load came from the cache damaged in a
            # way no checksum sees (built for another machine sharing the directory):
            # a miss. Build it afresh, once; if that does not load either, say so.
            pool = self.compile_pool
            binary, log = await pool._compile_keyed(
                compiler, src, key[0], timeout=timeout, refresh=True, state=self._state
            )
            if log:
                _warn_compiled(name, log)
            try:
                native = await self._loaded(binary, name, src)
            except _UnloadableError as exc:
                cause = exc.__cause__
                raise CompileError(
                    f"the compiled kernel {name!r} does not load: {cause}", name=name
                ) from cause
        if self.closed:
            # Loaded while the device's close sealed it (a close does not wait for a
            # load): refused as any compile the close ends, never a Program of a closed
            # device. What loaded goes with the backend's close, which unloads every
            # library it loaded (and refuses a load that comes after it).
            self._dropped.append(native)
            self._state.check_open()
        # (what the binary says of the value types its source does not: cpu's checks)
        try:
            params = compiler._answered(params, name, binary, src)
        except CompileError:  # (a type no launch value is: never run)
            self._dropped.append(native)
            raise
        disagrees = binary_disagrees(params, self._backend.param_sizes(native))
        if disagrees is not None:  # (its launches would pass it other bytes than it takes)
            self._dropped.append(native)
            raise CompileError(f"kernel {name!r}: {disagrees}", name=name)
        program = Program(self._state, name, params, binary, native)
        kept = self._programs.setdefault(key, program)
        if kept is not program:  # a concurrent compile of it loaded it first: never run
            self._dropped.append(native)
        else:
            weakref.finalize(program, self._dropped.append, native).atexit = False
        return kept

    def compile_many(
        self,
        kernels: Iterable[tuple[str, str]],
        *,
        options: tuple[str, ...] | list[str] = (),
        timeout: float | None = None,
    ) -> CompileMany:
        """Compile every ``(src, name)`` in the pool; yield each program once it is ready.

        Programs come in the order they finish, so the device can run the first while
        the pool compiles the rest. A failed compile raises its CompileError when
        reached (its ``name`` says which kernel failed). Compiles not consumed finish
        into the cache -- unless ``aclose()`` gives them up (``contextlib.aclosing``).
        ``options`` go to the compiler for every kernel, as :meth:`compile`'s do;
        ``timeout`` bounds each kernel's compile, counted from the step that submits it
        (the first), and is this caller's own, as :meth:`compile`'s is: a kernel whose
        compile another caller started with a longer one (or none) still times out.
        The device's close ends it: one step raises ``ClosedResourceError``, later
        steps StopAsyncIteration (:class:`CompileMany`).
        """
        compiler = self._backend.compiler._with_options(check_options(options))
        try:
            each = iter(kernels)
        except TypeError:
            raise ArgumentTypeError(
                f"compile_many takes an iterable of (src, name) pairs, got {type(kernels).__name__}"
            ) from None
        kernels = list(each)
        for kernel in kernels:  # checked before anything is submitted
            if not (
                isinstance(kernel, (tuple, list))
                and len(kernel) == 2
                and isinstance(kernel[0], str)
                and isinstance(kernel[1], str)
            ):
                raise ArgumentTypeError(
                    f"compile_many takes (src, name) pairs of str, got {kernel!r:.80}"
                )
        for i, (src, name) in enumerate(kernels):
            _check_kernel(src, name, f"compile_many: kernel {i}")
        kernels = [(src, name) for src, name in kernels]
        return CompileMany(self, kernels, compiler, check_timeout(timeout))

    async def _loaded(self, binary: bytes, name: str, src: str) -> Any:
        """``_load`` on a worker thread. What it loads for a caller cancelled meanwhile
        (asyncio's own cancel ends the wait, not the thread) is left to be unloaded as
        a collected program's is."""
        claim = _Claim(self._dropped.append)
        try:
            return await to_thread(self._load_claimed, binary, name, src, claim)
        except BaseException:
            claim.give_up()
            raise

    def _load_claimed(self, binary: bytes, name: str, src: str, claim: _Claim) -> Any:
        native = self._load(binary, name, src)
        claim.made(native)
        return native

    def _load(self, binary: bytes, name: str, src: str) -> Any:
        self._unload_retired()
        bindings = self._backend.compiler._bindings(src, name)
        try:
            if bindings is None:  # (a backend whose kernels bind in order takes none)
                return self._backend.load(binary, name)
            return self._backend.load(binary, name, bindings)
        except AttributeError:
            raise CompileError(
                f"kernel {name!r} is not defined in the compiled code" + unlinked_hint(src, name),
                name=name,
            ) from None
        except ClosedResourceError:
            self._state.check_open()  # (named as the device was opened)
            raise
        except (DeviceLostError, MemoryError):
            raise  # the device's trouble, not the binary's
        except PermissionError as exc:
            # Nor is a place that may not run code (a noexec temporary directory): a
            # rebuilt binary would not load either, so the cached one is kept.
            why = exc.strerror if exc.filename is None else str(exc)
            raise CompileError(f"kernel {name!r} cannot be loaded: {why}", name=name) from exc
        except Exception as exc:
            raise _UnloadableError from exc

    def _unload_retired(self) -> None:
        """Unload the programs collected before, once every command that may have
        launched one has finished: each queue reached what it had been given when the
        collection was first seen here (later, so more than the launches needed).
        Called as a program loads (off the loop): a device that compiles now and then
        keeps the programs in use and those dropped since the compile before."""
        with self._retire_lock:
            dropped = self._dropped[:]  # (finalizers append meanwhile, on any thread)
            del self._dropped[: len(dropped)]
            if dropped:
                reach = [(queue, queue.submitted) for queue in list(self._queues)]
                self._retired += [(native, reach) for native in dropped]
            ready: list[tuple[Any, list[tuple[Queue, int]]]] = []
            left: list[tuple[Any, list[tuple[Queue, int]]]] = []
            for native, reach in self._retired:
                # (The timeline's value, not stream_reached: what a failed cuda queue
                # reports before its stream gets there is past its skip, whose launches
                # never reach the driver -- native/cuda_submit.c, cuq_run_op.)
                done = all(queue.timeline.value >= value for queue, value in reach)
                (ready if done else left).append((native, reach))
            self._retired = left
        for native, _ in ready:
            self._backend.unload(native)

    async def synchronize(self) -> None:
        """Wait until every queue of this device has finished what was submitted; then
        raise the error of a command that failed (the first queue's, in creation order).

        Each failure is raised once: a queue's failure, once raised here, is not raised
        by a later ``synchronize()`` -- unless a command submitted to that queue since
        fails in turn (a failure fails what follows it on its queue: the default queue
        after a device wait for a value never produced, say, which it cannot be closed
        to be rid of). So after one call that raised, the device is usable again and
        a later call raises only what failed since (or another queue's failure not
        raised yet, one per call). Calls made at once each raise it: what counts is what
        was raised before the call began. ``Queue.synchronize`` raises its queue's
        failure every time.

        Raises :class:`ClosedResourceError` once the device is closed (its close waited
        for what was submitted, or dropped it)."""
        self._check_open()
        failed: tuple[Queue, int, AsyncMetalError] | None = None
        queues = list(self._queues)
        reported = [queue._reported for queue in queues]  # (as the call began)
        for queue, before in zip(queues, reported, strict=True):
            value = queue.submitted
            try:
                await wait_finished(queue, value)
            except AsyncMetalError as exc:
                if failed is None and value > before:
                    failed = (queue, value, exc)
        if failed is not None:
            queue, value, failure = failed
            queue._reported = max(queue._reported, value)
            raise failure

    def _retire_queue(self, queue: Any) -> None:
        """Seal the queue the device ran its buffers' work on in its default queue's
        stead, replaced as it failed for good (``DeviceState.default_queue``; submission
        lock held): it is released once its commands settled, as a queue whose close
        was cancelled is (by the reaper, a new_queue, the device's close). Its failure
        was its buffer operations' own (each raised it): ``synchronize`` raises it no
        more."""
        assert isinstance(queue, Queue)
        queue._reported = queue.submitted
        why = f"this queue of {self.name} was replaced: every later command of it failed"
        if seal(queue, why, self._unreleased, QUEUE_REPLACED):
            self._in_turn.append(queue)
            self._reap_later()

    async def close(self, *, discard: bool = False) -> None:
        """Let submitted work finish, then release the device.

        Work submitted while the close waits is waited for too. Commands still waiting
        on the device for a timeline value that nothing will signal are abandoned:
        awaiting them raises ClosedResourceError, and so do waits on the device's
        timelines for values they never reached. Concurrent closes share one teardown
        and all return once it is done. Shielded from cancellation: a device is never
        left half-closed.

        ``discard=True`` seals the device at once and drops every command of its queues
        that has not started (see ``Queue.close``): only what runs on the device now
        finishes. A close under way is switched to discarding by a close with
        ``discard=True``, and by a KeyboardInterrupt that reaches a task waiting for it
        (trio delivers Ctrl-C so), or a Ctrl-C while it waits on the main thread where
        Ctrl-C raises one (Python's handler, asyncio.Runner's; a handler the program
        installed, as aiohttp's ``web.run_app`` does, is left alone): that task waits
        for the rest, now bounded, and then raises the interrupt; a further interrupt
        is raised at once, the teardown running on to its end on its own thread.

        Raises the first error of its teardown (everything is released all the same),
        else the first of the device's native frees that failed after their callers
        were cancelled (a ``Buffer.free``, ``empty_memory_cache``): nobody heard of it.
        """
        check_bool(discard, "discard")  # (before anything closes)
        require_loop()  # (also: its teardown would begin, then fail to be awaited)
        failed: list[BaseException] = []
        with self._close_lock:  # one teardown, whichever thread closes first
            if self._closing is None and not self.closed:
                self._closing = HostEvents()
            # A teardown that ended with its native close cut: this close finishes it,
            # on a thread of its own, and the closes meanwhile wait for that. Started
            # here, with no call between the new events stored and the try: where no
            # thread began, they end at once (the device left to a later close),
            # whatever interrupts land in the handler (each goes round again; each step
            # may run again) -- left at 0, every later close would wait for good.
            cut = self._native_cut()
            if cut is not None:
                self._closing = finishing = HostEvents()
                finisher: _CloseThread | None = None
                try:
                    finisher = _CloseThread(self._finish, cut, finishing, failed)
                    finisher.thread.start()
                except BaseException:
                    ended = False
                    while not ended:
                        try:
                            # (Begun: it ends them.)
                            if (finisher is None or finisher.call_off()) and not finishing.value:
                                finishing.increment()
                            ended = True
                        except KeyboardInterrupt:
                            pass
                    raise
            # Until a teardown has begun, each close starts one (the first to begin runs
            # it, see _teardown): a KeyboardInterrupt may have stopped an earlier close
            # anywhere before its thread ran, and nothing else would ever end it.
            closing, starts = self._closing, not self._torn_down
            self._starting += starts
        if closing is None:
            return  # closed without a teardown (a forked child's, at exit)
        if discard:
            # (A teardown under way sees it at its next count.)
            self._discarding = self._discarding or device_discarded(self.name)
        if starts:
            # The teardown runs on a loop of its own, in a thread: nothing of the caller's
            # reaches it -- neither asyncio's own task.cancel() (a wait_for timeout, a
            # framework cancelling every task as it stops), which no shielded scope stops,
            # nor trio's KeyboardInterrupt, which trio raises in its main task also inside
            # a shielded scope (and, between checkpoints, in whatever Python code runs).
            run = functools.partial(self._teardown, closing, failed)
            args = (run, closing, failed)
            thread: _CloseThread | None = None
            try:
                thread = _CloseThread(self._tear_down, *args)
                thread.thread.start()
            except BaseException:  # (no thread to be had, or an interrupt before it began)
                # Its count given back once, whatever interrupts land here (as above).
                # (Else a later close's thread, whose loop cannot be made, would count on
                # this one to begin the teardown: nothing would end their waits.)
                given = False
                while not given:
                    try:
                        if thread is None or thread.call_off():  # (begun: it gives it back)
                            with self._close_lock:
                                self._starting -= not given
                                given = True
                        given = True
                    except KeyboardInterrupt:
                        pass
                raise
        await _until_closed(closing, self._interrupted)  # (another close's, or this one's)
        if failed:
            raise failed[0]
        unstarted = self._unstarted
        if unstarted is not None and unstarted[0] is closing:  # (another close's start)
            raise unstarted[1]

    def _native_cut(self) -> tuple[bool, frozenset[Queue]] | None:
        """(Under _close_lock.) The arguments of a teardown's native close that was cut
        as it was entered -- a KeyboardInterrupt there, raised by the close that awaited
        it: the teardown has ended, and the device is still on the open ones (its native
        close's last step takes it off, and an interrupt anywhere after the entry runs
        the rest of it: ``until_uninterrupted``) -- else None."""
        args, closing = self._native_args, self._closing
        if args is None or closing is None or not closing.value:
            return None
        return args if any(d is self for d in _devices()) else None

    def _finish(
        self,
        args: tuple[bool, frozenset[Queue]],
        closing: HostEvents,
        failed: list[BaseException],
    ) -> None:
        """A close's thread: the teardown's native close, cut as it was entered, run
        with its arguments (each step may run again; nothing else of the teardown is
        left: its waits were ended as the cut was raised)."""
        try:
            self._close_native(*args)
        except BaseException as exc:
            failed.append(exc)
        finally:
            failed += self._state.take_unheard_errors()
            closing.increment()

    def _tear_down(
        self,
        run: Callable[[], Coroutine[Any, Any, None]],
        closing: HostEvents,
        failed: list[BaseException],
    ) -> None:
        """A close's thread: ``run`` (its teardown) on a loop of its own. Where that
        loop could not be made (no file descriptor left for its selector or its wake-up
        pipe: EMFILE) and no other close's thread is still to begin the teardown, it
        never began and nothing else would end the close's waits: they end, raising
        that error, and the device stays open for a later close (which starts afresh)
        or the one at exit."""
        try:
            anyio.run(run)
        except BaseException as exc:
            with self._close_lock:
                self._starting -= 1
                ends = not self._torn_down and not self._starting
                if ends:
                    self._closing = None
                    self._unstarted = (closing, exc)
            if not ends:
                raise  # (the teardown, begun, counts its waits out itself)
            failed.append(exc)
            closing.increment()
        else:
            with self._close_lock:
                self._starting -= 1

    def _interrupted(self) -> None:
        """A KeyboardInterrupt reached a task waiting for this device's close: what has
        not started is dropped (the teardown discards at its next count)."""
        self._discarding = self._discarding or device_discarded(self.name, interrupted=True)

    async def _teardown(self, closing: HostEvents, failed: list[BaseException]) -> None:
        with self._close_lock:
            if self._torn_down:
                return  # another close's thread runs it
            self._torn_down = True
        try:
            await self._finish_completable()  # (returns at once when discarding)
            # Sealed: no submission is under way (another thread's) or can start.
            # Then what was submitted meanwhile is waited for as well (or discarded).
            await holding([self._state], self._seal)
            limits = await self._finish_completable()
            for queue in self._queues:  # what other devices' closes count on
                queue._final = limits[queue]
            blocked = {q: limits[q] for q in self._queues if limits[q] < q.submitted}
            args = self._native_args = (False, frozenset(blocked))
            try:
                await to_thread(self._close_native, *args)
            except Exception as exc:  # (raised by close once the waits below ended)
                failed.append(exc)
            finally:
                # Also where the native close raised a KeyboardInterrupt (a step's,
                # raised once all ran; close raises it, from the handler below):
                # nothing else ends these waits.
                for queue, limit in blocked.items():
                    # From what did not run: another device's close may have released
                    # a wait it was blocked on meanwhile (its abandon raises the
                    # timeline waited on), and then more ran before its queue stopped.
                    abandon(queue, max(limit, queue.timeline.value) + 1)
                for timeline in [*self._timelines, *(q.timeline for q in self._queues)]:
                    close_timeline(timeline)  # other devices' queues' waits end
        except BaseException as exc:  # raised by close() (on the caller's loop)
            failed.append(exc)
        finally:
            # Then the errors of frees and cache emptyings whose callers were cancelled
            # before those ended (nobody else heard of them).
            failed += self._state.take_unheard_errors()
            closing.increment()

    async def _close_queue(self, queue: Queue, discarding: bool = False) -> None:
        """Queue.close of one of its queues (not the default one): seal it, wait for its
        commands (a checkpoint) or drop those not started (``discarding``), then release
        it natively on a thread of its own, which every caller waits for (as close waits
        for its teardown). Once the device is sealed its close does all that: this
        waits for that close to end instead."""
        why = f"this queue of {self.name} was closed"
        with self._state.submitting:
            closed = self.closed
            # (Recorded unreleased as it is sealed: a KeyboardInterrupt after that leaves
            # it to be released by a later close or the reaper, which looks at all.)
            if not closed and seal(queue, why, self._unreleased):
                self._in_turn.append(queue)
                self._reap_later()  # (released by the reaper if this close is cancelled)
            # Sealed either way (by the device's close, or here). One being released has
            # finished: nothing is left to drop. (The backend's discard and its native
            # close exclude each other: the device's close releases it meanwhile.)
            if discarding and (closed or queue in self._unreleased):
                discard(queue)
        if closed:
            await self._device_closed()  # closed with the device
            return
        flush(queue)
        with contextlib.suppress(AsyncMetalError):  # a command's error: its awaiter's
            if not await _finish_commands(queue):
                # Discarded, and held behind a device wait that nothing will satisfy: what
                # the driver was given behind it stays there (a GPU stream's commands
                # cannot be taken back), so the queue is released once they ran (by the
                # reaper) or by the device's close, which abandons them.
                return
        with self._state.submitting:
            closed = self.closed  # (meanwhile: the device's close releases it)
            released = None if closed else self._releases.get(queue)
            if released is None and not closed:
                released = self._release([queue])
                if released is None:
                    return  # released already
        if released is None:
            await self._device_closed()
        else:
            await _until_closed(released)

    async def _device_closed(self) -> None:
        """Wait until the device's close, sealed, has ended (a checkpoint): it finishes
        what its queues were given and releases them. Cancelled, the close goes on."""
        closing = self._closing
        if closing is None:  # (closed without a teardown: a forked child's, at exit)
            await checkpoint()
        else:
            await wait_value(closing, 1)

    def _claim_release(self, queues: list[Queue]) -> HostEvents | None:
        """Take ``queues`` (closed, settled) off the device, submission lock held: its
        close no longer waits for them. A new list, not changed in place: a close on
        another thread may be going through the old one. None if there are none. Each
        of ``queues`` is looked up, not searched for: one pass over the queues kept in
        all, however many cancelled closes left theirs."""
        queues = [q for q in queues if q in self._unreleased]
        if not queues:
            return None
        released = HostEvents()
        for queue in queues:
            # Claimed in one run with no call (a KeyboardInterrupt finds it claimed or
            # not); the rest (_claimed) may be done again (see _release).
            del self._unreleased[queue]
            self._releases[queue] = released
        self._claimed(queues)
        return released

    def _claimed(self, queues: list[Queue]) -> None:
        """Take ``queues``, claimed, off the device's records (submission lock held);
        done again, it changes nothing more."""
        for queue in queues:
            self._idle.discard(queue)
            self._closed_off.add(queue)  # (its uses left to the reaper: see _look)
            self._timelines.add(queue.timeline)  # its close ends waits on it (none reach it)
            drop = self._on_drop.get(queue)
            if drop is not None:  # released here, not once collected
                finalizing = drop.peek()
                if finalizing is not None:
                    self._natives.pop(finalizing[2][2], None)  # (its number)
                drop.detach()
                self._on_drop.pop(queue, None)
        gone = {id(q) for q in queues}
        self._queues = [q for q in self._queues if id(q) not in gone]
        for key, adopted in list(self._adopted.items()):
            if id(adopted) in gone:
                del self._adopted[key]
        if self._reaper is None:
            self._closed_off_now()

    def _closed_off_now(self) -> None:
        """What the reaper's looks do for the closed queues, done as they are claimed by
        a device whose reaper could not be started (no thread to be had: see
        _reap_later; submission lock held): their uses go off the buffers' records (one
        pass over the blocks, as a new_queue's sweep makes), and those released leave
        the closed queues in turn (new_queue passes over them only as their turn comes).
        Else nothing would: each would stay alive, with its timeline, as long as a
        buffer it used. A use not passed yet (none should be: claimed once settled)
        stays, looked at again at the next claim."""
        closed = list(self._closed_off)
        uses = [use for part in _recorded_uses(closed, self._recorded_blocks()) for use in part]
        self._allocator.forget_passed(uses)
        kept = {id(q) for b, q in uses if q in b.last_use}
        self._closed_off.difference_update([q for q in closed if id(q) not in kept])
        self._in_turn = collections.deque(q for q in self._in_turn if q in self._unreleased)

    def _release(self, queues: list[Queue]) -> HostEvents | None:
        """Claim ``queues`` (closed, settled; see _claim_release) and release them on a
        release thread (submission lock held); what reaches 1 once that is done, or
        None where none was left to claim. A KeyboardInterrupt on the way -- after the
        claim, before its thread started -- starts the release all the same: a
        later close waits for what the claim recorded, and would wait for good."""
        try:
            released = self._claim_release(queues)
            if released is not None:
                self._start_release(queues)
        except BaseException:
            claimed = [q for q in queues if q in self._releases and q not in self._taken]
            if claimed:  # (started twice, it is released once: see _start_release)
                self._claimed(claimed)
                self._start_release(claimed)
            raise
        return released

    def _start_release(
        self,
        queues: list[Queue],
        natives: list[NativeQueue] = (),  # type: ignore[assignment]
        dropped: list[int] = (),  # type: ignore[assignment]
    ) -> None:
        """Close ``queues`` (claimed: see _release), ``natives`` and the native queues
        of the collected queues numbered ``dropped`` (taken off the records by the
        thread, those another took left) natively on a thread: it may block, never on a
        loop. Submission lock held, from the claim of what it releases on: the
        device's close, which seals the device under that lock, then finds the thread
        among ``_release_threads`` and waits for it before it closes the backend (and
        then releases the collected queues' natives no thread took)."""

        def release() -> None:
            # Each queue is released by the thread that takes it: a release started
            # again (see _release) finds it taken, or released already (no longer
            # among _releases), and leaves it. Each queue's own record of its release
            # reaches 1 once it is done.
            mine: list[Queue] = []
            theirs: list[tuple[NativeQueue, Timeline | None]] = [(n, None) for n in natives]
            try:
                with self._state.submitting:
                    mine = [q for q in queues if q in self._releases and q not in self._taken]
                    self._taken.update(dict.fromkeys(mine))
                    theirs += self._take_dropped(dropped)
                for queue in mine:
                    with contextlib.suppress(Exception):  # (the device's close reports it)
                        close_native(queue, False)
                    # Its commands all ran: waits on its timeline for more end, failed
                    # (other queues' device waits, and host tasks'), as at the device's
                    # close -- nothing will raise it further.
                    close_timeline(queue.timeline)
                for native, timeline in theirs:
                    with contextlib.suppress(Exception):
                        native.close(False)
                    if timeline is not None:
                        # A collected queue's, which someone may still hold: it had
                        # nothing in flight, and nothing will raise it further.
                        queue_closed(timeline, timeline.value, QUEUE_DROPPED)
                        close_timeline(timeline)
            finally:
                with self._state.submitting:
                    done = [self._releases.pop(queue, None) for queue in mine]
                    for queue in mine:
                        self._taken.pop(queue, None)
                for events in {id(e): e for e in done if e is not None}.values():
                    events.increment()

        thread = threading.Thread(target=release, name="asyncmetal queue close", daemon=True)
        # Among those the device's close joins before the thread starts: an interrupt
        # as it starts leaves it there, started (joined) or not (passed over).
        self._release_threads = [t for t in self._release_threads if t.is_alive()] + [thread]
        try:
            thread.start()
        except Exception:
            # No thread to be had (a limit on threads reached, the interpreter exiting):
            # released here, blocking the caller, rather than never (the queues are
            # claimed: nothing else releases them, and their closes wait for this).
            release()

    def _seal(self) -> None:
        # With the submission lock held (see close), and the signal-order lock: a host
        # signal of one of its timelines under way on another thread lands first, and
        # the close counts it, or it finds the device closed (see Timeline.signal).
        with signal_order():
            self._mark_closed()
        # Its idle queues close with the others (none is submitted to any more).
        kept = set(self._queues)
        self._queues = [*self._queues, *(q for q in list(self._idle) if q not in kept)]

    async def _finish_completable(self) -> dict[Queue, int]:
        """Wait until every queue of this device has finished all the commands that can
        still complete (commands may be submitted meanwhile: they are waited for too);
        return each queue's limit, computed with nothing left to wait for. Discarding
        (``_discarding``, seen at each count): once sealed, what has not started is
        dropped natively and then passes at once; before, this returns at once (empty)."""
        while True:
            if self._discarding:
                if not self.closed:
                    return {}  # (the close seals the device next)
                for queue in self._queues:
                    discard(queue, self._discarding)
            limits = await _count_completable()
            # (A queue kept again after the count is counted the next time.)
            behind = [q for q in self._queues if q.timeline.value < limits.get(q, 0)]
            if not behind:
                return limits
            # Counted again now and then: another device's close, deciding what of its
            # queues stops, can make what this count relied on never come.
            with anyio.move_on_after(RECOUNT_S):
                for queue in behind:
                    flush(queue)
                    await wait_value(queue.timeline, limits[queue])

    def _join_closers(self) -> None:
        """Wait, as the device closes, for the threads that may still release what its
        close releases: the makers of queues made as it closed, its reaper, the threads
        releasing queues closed before."""
        # A queue being made when the device closed is released on a release thread by
        # its maker, which finds the device closed (new_queue): waited for, then joined
        # with the others. (Its maker counted it, then looked at ``closed``.)
        while self._makings:
            time.sleep(MAKING_POLL_S)
        reaper = self._reaper
        if reaper is not None and reaper is not threading.current_thread():
            self._reaper_inbox.put(_STOP)  # (put again after an interrupted join: unread)
            reaper.join()  # (it starts no release threads once closed)
        for thread in list(self._release_threads):  # queues closed before (idle ones)
            if thread.ident is not None:  # (None: never started, see _start_release)
                thread.join()

    def _close_native(self, abandon: bool = False, blocked: Collection[Queue] = ()) -> None:
        """Close every queue natively, then the allocator and the backend. A queue in
        ``blocked`` (or every queue, with ``abandon``) is stopped where it is, inside a
        device-side wait; the others have finished everything submitted."""
        # Each step runs whatever an earlier one raised (a queue's native close that
        # fails still leaves the others, the memory and the backend to release); the
        # first error is raised once all of them ran. So is a KeyboardInterrupt (a
        # Ctrl-C as the close runs at exit, on the main thread), before any error:
        # raised at once, it would leave the device marked closed with the rest undone
        # -- its memory allocated, its queues and backend unreleased, the device noted
        # open for good (its close does not run again). Wherever one lands, in a step or
        # between two, the step it landed in (or the one before it, not yet taken off
        # the list) runs again, and those after it run: each step may run again. The
        # joins first: the threads joined end on their own, and the steps must not run
        # beside them. (Made with no call, nothing lands before the loop is entered:
        # one as it is, with nothing of the close run, is the caller's.)
        errors: list[BaseException] = []
        closed: list[Queue] = []
        steps: list[tuple[Any, ...]] = [
            (self._mark_closed,),
            (self._join_closers,),
            (self._close_queues, abandon, blocked, closed, errors),
            (self._close_dropped, abandon, errors),
            (self._stopped,),
            # Its memory is freed natively, but for blocks that commands its queues
            # abandoned may still use (another device's queues', or its own: left to
            # them, see Allocator._uses_left) -- a cuda stream stopped inside a device
            # wait runs on once the backend's close raises the word it waits on, and a
            # free does not wait for it.
            (self._allocator.close, _completable),
            (self._backend.close,),
            # Nothing of the device runs now (a close that failed leaves nothing to wait
            # for either): the memory left to its queues is freed -- its own, and what
            # other closes left to them whose uses passed (those of other devices'
            # queues that may still run stay, see free_left_blocks) -- and what its
            # queues used of other libraries' memory is let go of.
            (self._ran_out,),
            (free_left_blocks,),
            (let_lingering_go,),
            (state_released, self._state),
            (_note_open, self, False),
        ]
        interrupt = until_uninterrupted(in_turn, steps, errors)
        if interrupt is not None:
            raise interrupt
        if errors:
            raise errors[0]

    def _close_queues(
        self,
        abandon: bool,
        blocked: Collection[Queue],
        closed: list[Queue],
        errors: list[BaseException],
    ) -> None:
        """(A step of _close_native.) Close each queue natively, its idle ones too, but
        those in ``closed``: each is put there once closed (one closed again, by a step
        run again, is closed already: its close does nothing)."""
        kept = set(self._queues)
        for queue in [*self._queues, *(q for q in list(self._idle) if q not in kept)]:
            if queue not in closed:
                in_turn([(close_native, queue, abandon or queue in blocked)], errors)
                closed.append(queue)

    def _close_dropped(self, abandon: bool, errors: list[BaseException]) -> None:
        """(A step of _close_native.) Close the native queues of the queues collected
        (with nothing in flight), each taken off the records once closed: one taken off
        first, an interrupt before its close would leave it unclosed for good."""
        for number in self._dropped_queues[:]:  # (finalizers append meanwhile)
            recorded = self._natives.get(number)
            if recorded is not None:
                in_turn([(recorded[0].close, abandon)], errors)
            self._take_dropped([number])

    def _stopped(self) -> None:
        """(A step of _close_native.) Its queues are closed: other devices' closes wait
        for them to stop."""
        self._natives.clear()  # (each closed with its queue)
        self._state.stopped = True

    def _ran_out(self) -> None:
        """(A step of _close_native.) Its backend closed: what its stopped queues'
        streams still ran has run out."""
        self._state.ran_out = True

    async def __aenter__(self) -> Device:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _unused(queue: Queue) -> bool:
    """Whether nothing was submitted to ``queue`` since the reaper's last look (each
    look notes it): a queue in use is not let go of (its next launch would take the
    Python path), only one left alone a whole look apart (on the reaper, without the
    submission lock: see Device._unused_queues)."""
    looked_at, queue._looked_at = queue._looked_at, queue.submitted
    return looked_at == queue.submitted


def _recorded_uses(
    queues: Collection[Queue], blocks: list[Block]
) -> Generator[list[tuple[Block, Queue]], None, None]:
    """The uses by ``queues`` on the records of ``blocks``, REAP_CHUNK at a time (for
    Device._look: one part per hold of the submission lock, however many queues used
    one block). Read without that lock: each record's queues are listed at once (no
    Python code runs meanwhile), and a use is looked up again under the lock."""
    forget = set(queues)
    part: list[tuple[Block, Queue]] = []
    for block in blocks:
        for queue in list(block.last_use):
            if queue in forget:
                part.append((block, queue))
                if len(part) >= REAP_CHUNK:
                    yield part
                    part = []
    if part:
        yield part


def _collected(dropped: list[int], inbox: SimpleQueue[int], number: int) -> None:
    """The finalizer of a queue from new_queue() or adopt_stream(): its number for the
    reaper. It may run on any thread, inside a GC pass of a thread holding any lock (the
    submission lock, a driver's): it takes none (SimpleQueue.put is safe from
    finalizers) and never waits."""
    dropped.append(number)
    inbox.put(_COLLECTED)


def _reap(device_ref: weakref.ref[Device], inbox: SimpleQueue[int]) -> None:
    """A device's reaper thread (see Device._reap_later). It holds the device only while
    it works, so a device left unclosed is still collected (its finalizer stops this).
    An error in its work goes to the device's close (``unheard_error``: the first
    until a look succeeds), and it looks again later, as after a look that let go of
    nothing: it reaps as long as the device is open."""
    due: float | None = None  # when to look next
    wait = REAP_S  # how long after a look that let go of nothing
    failing = False  # its work raised since its last look that did not
    while True:
        try:
            message = inbox.get(timeout=None if due is None else max(0.0, due - time.monotonic()))
        except Empty:
            message = None  # time to look
        if message == _STOP:
            return
        if message == _LOOK:  # a queue made or submitted to: it may be idle soon
            wait = REAP_S
            if due is None:
                due = time.monotonic() + wait
            continue
        device = device_ref()
        if device is None:
            return
        began = time.monotonic()
        try:
            let_go_of = device._reaped() if message == _COLLECTED else device._look()
        except Exception as exc:  # reported; what failed is done again at a later look
            if not failing:
                device._state.unheard_error(exc)
            failing = failed = True
            let_go_of = False
        else:
            failed = False
            if message != _COLLECTED:
                failing = False  # (a look ends with a release too: all of it went)
        took = time.monotonic() - began
        closed = device.closed
        del device
        if closed:
            return
        if message == _COLLECTED and not failed:
            continue  # (released: when to look next is unchanged)
        if let_go_of is None:
            due = None  # nothing to watch: told again when there is
            continue
        wait = REAP_S if let_go_of else min(2 * wait, REAP_MAX_S)
        due = time.monotonic() + min(max(wait, REAP_DUTY * took), REAP_LONGEST_S)


class _UnloadableError(Exception):
    """The backend refused a binary (its cause says why)."""


@contextlib.contextmanager
def _naming(name: str) -> Generator[None, None, None]:
    """A CompileError raised inside comes out as kernel ``name``'s (see ``_for_kernel``):
    a compile of one source may be shared by several kernels, and a pool's error names
    none."""
    try:
        yield
    except CompileError as exc:
        named = exc._for_kernel(name)
        if named is exc:
            raise
        raise named from None


def _warn_compiled(name: str, log: str) -> None:
    """The CompileWarning of kernel ``name``, whose compile printed ``log``."""
    warn(CompileWarning(f"kernel {name!r}: the compiler printed warnings", log))


def _read_params(compiler: Any, src: str, name: str) -> Signature | NotDefinedError:
    try:
        params: Signature = compiler._signature(src, name)
    except NotDefinedError as missing:
        return missing
    return params


async def _source_key(identity: str, src: str) -> str:
    """``source_key``, computed on a worker thread for a long source."""
    if len(src) < OFF_LOOP_SOURCE:
        return source_key(identity, src)
    return await to_thread(source_key, identity, src)


def _check_kernel(src: str, name: str, what: str) -> None:
    """Refuse a kernel that cannot be compiled whatever its source says."""
    if not name:
        raise InvalidArgumentError(f"{what}: the kernel's name is empty")
    if not name.isidentifier():
        shown = name if len(name) <= 40 else name[:37] + "..."
        raise InvalidArgumentError(
            f"{what}: the kernel's name must be an identifier, got {shown!r}"
            + (" (source and name swapped?)" if name_looks_like_source(name) else "")
        )
    try:
        src.encode()
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(
            f"{what}: the source of {name!r} is not encodable text ({exc.reason} at "
            f"character {exc.start})"
        ) from None


def name_looks_like_source(name: str) -> bool:
    return any(mark in name for mark in "(){};\n")


class CompileMany:
    """What :meth:`Device.compile_many` returns: an async iterator of the programs, each
    as soon as it is ready; ``aclose()`` gives up the compiles not yet stepped to.

    A kernel that fails raises its :class:`CompileError` once, from the step that
    reaches it -- and one its pool refused, closed, its ``ClosedResourceError``. A step
    that raises or is cancelled loses no other kernel: the next step goes on from where
    the last one stopped.

    The device's close ends it: the first step to find the device closed (before it
    looks, while it waits or while it loads its program) raises its
    ``ClosedResourceError`` -- after a checkpoint, so a cancelled step raises the
    cancellation instead, and the next step raises the error -- and gives up the rest as
    ``aclose()`` does; every later step raises StopAsyncIteration. A lost device's
    :class:`DeviceLostError` ends it alike. So does every step once ``aclose()`` ran,
    the device closed or not.
    """

    def __init__(
        self,
        device: Device,
        kernels: list[tuple[str, str]],
        compiler: Compiler,
        timeout: float | None,
    ) -> None:
        self._device = device
        self._kernels = kernels
        self._compiler = compiler
        self._timeout = timeout
        self._dispatched = 0  # kernels looked up and, on a miss, submitted
        # Each kernel's result -- a binary from a cache, a pool job, or the CompileError
        # of a name its source lacks -- arrives here and is yielded (or raised) once, in
        # the order they arrive.
        self._ready: collections.deque[tuple[tuple[str, str], Any]] = collections.deque()
        self._events = HostEvents()
        self._yielded = 0
        # Its claims on pool jobs not yet yielded (kernels of one source share a job).
        self._jobs: collections.Counter[Any] = collections.Counter()
        # With a timeout: each kernel submitted to the pool, until its result or its
        # timeout arrives (whichever is first; the other is then dropped).
        self._timed: list[_Submitted] = []
        self._settle_lock = threading.Lock()
        self._closed = False
        self._stepping = False
        self._pid = os.getpid()

    def __aiter__(self) -> CompileMany:
        return self

    async def aclose(self) -> None:
        """Stop: kernels not submitted yet are not compiled, and this iterator's claims
        on the compiles in the pool are given up -- one not started that nobody else
        awaits is dropped, a running one finishes into the cache. A step under way, and
        every later one, raises StopAsyncIteration."""
        self._give_up()
        await checkpoint()

    def _give_up(self) -> None:
        """``aclose()``'s work, which the device's close ends it with too."""
        if not self._closed:
            self._closed = True
            if self._pid == os.getpid():  # (a forked child's: the parent's jobs)
                pool = self._device.compile_pool
                for job, claims in self._jobs.items():
                    for _ in range(claims):
                        pool._withdraw(job, untimed=self._timeout is None)
            self._jobs.clear()
            self._ready.clear()
            self._events.increment()  # a step waiting wakes, and stops

    async def _dispatch(self) -> None:
        device = self._device
        pool, compiler = device.compile_pool, self._compiler
        identity = await compiler_identity(compiler)
        while self._dispatched < len(self._kernels) and not self._closed:
            src, name = self._kernels[self._dispatched]
            try:
                device._check_compile(src, name)
                # A name not defined is compiled all the same: see compile().
                params = await device._params(src, name, compiler)
            except CompileError as exc:  # this kernel's own result, raised in its turn
                self._dispatched += 1
                self._arrived(("", name), ((), src), exc)
                continue
            key = await _source_key(identity, src)
            binary = pool.cache._get_memory(key)
            if binary is None and pool.cache.disk_enabled:
                binary = await pool.cache._get_disk(key)  # cancelled: looked up again next time
            if self._closed:  # (closed while this step looked the kernel up)
                return
            if binary is None:
                submitted = _Submitted((key, name), (params, src))
                try:
                    job = pool._submit(
                        compiler,
                        src,
                        key,
                        timeout=self._timeout,
                        on_done=functools.partial(self._job_done, submitted),
                    )
                except ClosedResourceError as refused:
                    # The pool is closed: the refusal is this kernel's result, raised
                    # once in its turn, as a pool's close fails the compiles it had not
                    # started. (Left undispatched, every later step would be refused it
                    # again, and the iterator never end.)
                    self._dispatched += 1
                    self._arrived((key, name), (params, src), refused)
                    continue
                self._dispatched += 1
                self._jobs[job] += 1
                if self._timeout is not None:  # counted from now, as compile()'s is
                    submitted.job = job
                    submitted.deadline = anyio.current_time() + self._timeout
                    self._timed.append(submitted)
            else:
                self._dispatched += 1
                self._arrived((key, name), (params, src), binary)

    def _arrived(self, key: tuple[str, str], params: Any, result: Any) -> None:
        """A binary (a cache hit), a finished pool job or an error; any thread."""
        self._ready.append((key, (params, result)))
        self._events.increment()

    def _settle(self, submitted: _Submitted) -> bool:
        """Whether this is the first of a submitted kernel's job and its timeout to
        arrive (any thread)."""
        with self._settle_lock:
            first, submitted.settled = not submitted.settled, True
        return first

    def _job_done(self, submitted: _Submitted, job: Any) -> None:
        """A pool job finished for a submitted kernel (on the pool's handler thread)."""
        if self._settle(submitted):
            self._arrived(submitted.key, submitted.params, job)

    def _next_deadline(self) -> float:
        """When the first of the timed kernels still awaited times out (inf: none)."""
        self._timed = [submitted for submitted in self._timed if not submitted.settled]
        return min((submitted.deadline for submitted in self._timed), default=math.inf)

    def _expire(self, now: float) -> None:
        """Each timed kernel whose timeout has passed, not compiled yet, arrives as the
        CompileError of its timeout; this iterator's claim on its job is given up (a
        job nobody else awaits is dropped if not started, or killed by its worker)."""
        pool = self._device.compile_pool
        for submitted in self._timed:
            if submitted.deadline > now or not self._settle(submitted):
                continue
            job = submitted.job
            pool._withdraw(job)
            self._jobs[job] -= 1
            if not self._jobs[job]:
                del self._jobs[job]
            timed_out = CompileError(f"compile timed out after {self._timeout} s")
            self._arrived(submitted.key, submitted.params, timed_out)

    async def __anext__(self) -> Program:
        if self._stepping:
            raise RuntimeError("a step of this compile_many is already under way")
        self._stepping = True
        try:
            return await self._step()
        except (ClosedResourceError, DeviceLostError) as exc:
            if isinstance(exc, ClosedResourceError) and not self._device.closed:
                raise  # (a kernel's own: its pool refused it)
            # The device's close, or its loss: raised once, and the iterator ends. A
            # step cancelled here has not raised it, so the next one does.
            await checkpoint()
            self._give_up()
            raise
        finally:
            self._stepping = False

    async def _step(self) -> Program:
        if not self._closed and self._dispatched < len(self._kernels):
            await self._dispatch()
        if self._closed or self._yielded == len(self._kernels):
            raise StopAsyncIteration
        # The device's own refusal (closed, or a forked child's: the parent's results
        # never come here), not a wait for results nothing will bring. Its close ends
        # the wait as it seals the device (see DeviceState.close_waits), whatever the
        # compiles do: the step raises its ClosedResourceError then.
        waits = self._device._state.close_waits
        waits.add(self._events)
        try:
            self._device._check_open()
            while True:
                # A timeout is each caller's own: a kernel joining a compile that another
                # caller started without one (or with a longer one) times out all the same.
                with anyio.move_on_at(self._next_deadline()):
                    await wait_value(self._events, self._yielded + 1)
                    break
                self._expire(anyio.current_time())
        finally:
            waits.discard(self._events)
        if self._closed:  # (closed while this step waited)
            raise StopAsyncIteration
        self._device._check_open()  # (closed while this step waited)
        self._yielded += 1
        key, ((params, src), result) = self._ready.popleft()
        with _naming(key[1]):
            if isinstance(result, (CompileError, ClosedResourceError)):
                raise result  # (a ClosedResourceError: the pool refused the kernel)
            log = ""
            if not isinstance(result, bytes):  # a finished pool job
                pool = self._device.compile_pool
                pool._withdraw(result, untimed=self._timeout is None)
                self._jobs[result] -= 1
                if not self._jobs[result]:
                    del self._jobs[result]
                pool.cache._warn_if_disabled()  # storing it may have found the disk full
                log = pool._take_log(result)
                result = pool._result(result)
            if isinstance(params, NotDefinedError):  # the source compiled without it
                raise params
            try:
                program = await self._device._program(
                    key, params, result, src, self._compiler, self._timeout
                )
                if self._closed:  # (closed while this step loaded it: not handed out)
                    raise StopAsyncIteration
                if log:
                    _warn_compiled(key[1], log)
            except (anyio.get_cancelled_exc_class(), CompileWarning):
                # Not handed out (cancelled, or its warning raised as an error): the next
                # step yields it (its binary is ready now; it warns no more).
                self._ready.appendleft((key, ((params, src), result)))
                self._yielded -= 1
                raise
            return program


class _Submitted:
    """A kernel of a compile_many submitted to the pool: its key and (parameters,
    source); with a timeout, its job and when it times out."""

    __slots__ = ("deadline", "job", "key", "params", "settled")

    def __init__(self, key: tuple[str, str], params: tuple[Any, str]) -> None:
        self.key, self.params = key, params
        self.job: Any = None
        self.deadline = math.inf
        self.settled = False  # its job's result or its timeout has arrived


class DeviceOpener(Coroutine[Any, Any, "Device"]):
    """What :func:`open_device` returns: ``async with`` it (the device closes at the
    block's end), or ``await`` it for the :class:`Device` -- or hand it to what takes a
    coroutine (``asyncio.run``, ``asyncio.create_task``), as it is one (``send``,
    ``throw`` and ``close`` are the coroutine's). Each await, each ``async with`` and
    each task made of it opens a device of its own."""

    def __init__(self, name: str | None, opened_at: str = "") -> None:
        self._name = name
        self._opened_at = opened_at
        # The devices its 'async with' entries opened and have not closed, by task, in
        # the order they were entered: one opener may be entered again meanwhile,
        # nested or by another task.
        self._entered: list[tuple[int, Device]] = []
        # The openings that send/throw run, by the task that drives them (None: driven
        # from no task): each task made of the opener (asyncio.create_task, asyncio.run)
        # opens a device of its own, as each await does, and one under way in a task is
        # never resumed by another's first send. Each is taken out once it has ended.
        self._openings: dict[int | None, Coroutine[Any, Any, Device]] = {}

    def _step(self, step: Callable[[Coroutine[Any, Any, Device]], Any]) -> Any:
        """Run ``step`` on the calling task's opening (begun now if it has none)."""
        driver = _driving_task()
        opening = self._openings.get(driver)
        if opening is None:
            opening = self._openings[driver] = self._open()
        try:
            return step(opening)
        except BaseException:  # (StopIteration included: it ended, whichever way)
            if self._openings.get(driver) is opening:
                del self._openings[driver]
            raise

    def send(self, value: Any) -> Any:
        """The coroutine's: run the calling task's opening to its next suspension."""
        return self._step(lambda opening: opening.send(value))

    def throw(self, *exc: Any) -> Any:
        """The coroutine's: raise ``exc`` where the calling task's opening is suspended."""
        return self._step(lambda opening: opening.throw(*exc))

    def close(self) -> None:
        """The coroutine's: end the calling task's opening, which will not be awaited to
        its end (called from no task: every opening under way)."""
        driver = _driving_task()
        if driver is None:
            openings, self._openings = list(self._openings.values()), {}
        else:
            opening = self._openings.pop(driver, None)
            openings = [] if opening is None else [opening]
        for opening in openings:
            opening.close()

    def __enter__(self) -> None:
        raise TypeError(
            "open_device() is asynchronous: use 'async with open_device(...) as dev' or "
            "'dev = await open_device(...)'"
        )

    def __exit__(self, *exc: object) -> None:
        """(Never reached: __enter__ refuses.)"""

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("_") or not hasattr(Device, attribute):
            raise AttributeError(attribute)
        raise AttributeError(
            f"open_device() returns an opener, not a Device (no {attribute!r}): use "
            "'dev = await open_device(...)' or 'async with open_device(...) as dev'"
        )

    async def _open(self, enter: bool = False) -> Device:
        """Open a device and hand it over: return it, and with ``enter`` (an 'async
        with') record it as the calling task's entry, which its exit closes."""
        if os.environ.get("ASYNCMETAL_WORKER"):
            raise AsyncMetalError("compile workers never open a device")
        # Finding compilers and drivers touches the filesystem: all of it off the loop.
        # What it opens for a caller cancelled meanwhile (asyncio's own cancel ends the
        # wait, not the thread), or whose loop closed meanwhile, is closed.
        claim = _Claim(_close_abandoned)
        try:
            name, backend = await to_thread(self._open_claimed, claim, undelivered=claim.give_up)
        except BaseException:
            claim.give_up()
            raise
        # Then what is not handed over is closed too (with what of a Device was made of
        # it, see _close_abandoned): a Device that could not be made, or one a
        # KeyboardInterrupt reached before the caller got it (trio raises Ctrl-C
        # wherever its main task is; CPython, at a call's entry or return).
        entry: tuple[int, Device] | None = None
        try:
            device = Device(name, backend, self._opened_at)
            if enter:
                entry = (anyio.get_current_task().id, device)
                self._entered.append(entry)
        except BaseException:
            if entry is not None and entry in self._entered:
                self._entered.remove(entry)
            claim.give_up()
            raise
        return device  # (handed over: no call since the entry was recorded)

    def _open_claimed(self, claim: _Claim) -> tuple[str, Backend]:
        name, backend = self._open_backend()
        claim.made(backend)
        return name, backend

    def _open_backend(self) -> tuple[str, Backend]:
        name = (
            self._name
            if self._name is not None  # ("" is no device's name: refused below)
            else os.environ.get("ASYNCMETAL_DEVICE") or (devices() or [backends.HOST])[0]
        )
        told = self._name is None and bool(os.environ.get("ASYNCMETAL_DEVICE"))
        try:
            kind, index = parse_name(name)
        except InvalidArgumentError as exc:
            if told:
                raise InvalidArgumentError(f"{exc} (from $ASYNCMETAL_DEVICE)") from None
            raise
        cls = backends.backend_class(kind)
        if not cls.runs_kernels and self._name is None:
            name = backends.HOST  # never the default: a device for kernels is wanted
            kind, index = parse_name(name)
            cls = backends.backend_class(kind)
        _check_fork_safe(kind)
        if not is_available(name):
            why = why_unavailable(name)
            raise DeviceNotFoundError(
                f"device {name!r} is not available here (available: {devices()})"
                + (f": {why}" if why else "")
                + (" (from $ASYNCMETAL_DEVICE)" if told else "")
            )
        backend = cls(index)
        if not cls.fork_safe:
            _kinds_opened.add(kind)
        return name, backend

    def __await__(self) -> Generator[Any, None, Device]:
        return self._open().__await__()

    async def __aenter__(self) -> Device:
        return await self._open(enter=True)

    async def __aexit__(self, *exc: object) -> None:
        """Close the device of the calling task's innermost entry -- or, exited by a
        task that entered none (an async generator's teardown in a task of its own),
        of the latest entry."""
        task = anyio.get_current_task().id
        entries = [i for i, (entered_by, _) in enumerate(self._entered) if entered_by == task]
        _, device = self._entered.pop(entries[-1] if entries else -1)
        await device.close()


def _driving_task() -> int | None:
    """The task running on this thread now (the one driving a coroutine it sends to),
    by id; None outside any task."""
    try:
        return anyio.get_current_task().id
    except RuntimeError:  # (no loop running here, or none of the libraries anyio knows)
        return None


class _Claim:
    """What a worker thread makes for a caller who may give it up meanwhile (asyncio's
    own cancel ends the wait, not the thread): then ``drop`` takes it, whichever of the
    two comes second."""

    def __init__(self, drop: Callable[[Any], None]) -> None:
        self._lock = threading.Lock()
        self._drop = drop
        self._made: Any = None
        self._given_up = False

    def made(self, made: Any) -> None:
        with self._lock:
            self._made = made
            if self._given_up:
                self._drop(made)

    def give_up(self) -> None:
        """Give up what is made, now or once it is (a second time: nothing)."""
        with self._lock:
            if self._given_up:
                return
            self._given_up = True
            if self._made is not None:
                self._drop(self._made)


def _close_abandoned(backend: Backend) -> None:
    """Close a backend opened for a caller who never got it -- who stopped waiting, or
    whose Device could not be made of it -- on a thread of its own (a native close may
    wait for the device), with what of a Device was made of it. Its errors are
    nobody's to hear."""

    def close() -> None:
        with contextlib.suppress(Exception):
            made = _made_of(backend)
            if made is None:
                backend.close()
            else:
                made._close_native(abandon=True)  # its queue, its memory, the backend

    threading.Thread(target=close, name=CLOSE_THREAD, daemon=True).start()


def _made_of(backend: Backend) -> Device | None:
    """The Device made of ``backend`` for a caller who never got it, where its making
    got as far as its default queue (its native close then releases that, its memory
    and the backend); none where it made nothing more of the backend. Its state is no
    open device's either way."""
    for state in unreleased_states():
        if state.backend is backend:
            state_released(state)
            device = state.device
            return device if isinstance(device, Device) and hasattr(device, "queue") else None
    return None


async def _until_closed(closing: HostEvents, interrupted: Callable[[], None] | None = None) -> None:
    """Wait for a close's teardown to end, whatever cancels the caller meanwhile: in a
    shielded scope, and on asyncio waiting again after each of its own cancellations
    (which no scope stops); the cancellation is raised once the teardown has ended.
    A KeyboardInterrupt (trio raises Ctrl-C in its main task, shielded or not), or a
    Ctrl-C meanwhile on the main thread (``ctrl_c_discards``: asyncio's runner raises it
    outside any task), calls ``interrupted`` -- a device's close then drops what has
    not started. A KeyboardInterrupt raised here is raised once the teardown has ended;
    a second one, or any without ``interrupted``, is raised at once (the teardown, on
    a thread of its own, still ends)."""
    cancelled: BaseException | None = None
    try:
        interrupts = (
            contextlib.nullcontext() if interrupted is None else ctrl_c_discards(interrupted)
        )
        with interrupts, anyio.CancelScope(shield=True):
            while True:
                try:
                    await wait_value(closing, 1)
                except asyncio.CancelledError as exc:  # (asyncio's own: a task.cancel())
                    cancelled = cancelled if isinstance(cancelled, KeyboardInterrupt) else exc
                    continue
                except KeyboardInterrupt as exc:
                    if interrupted is None or isinstance(cancelled, KeyboardInterrupt):
                        raise
                    interrupted()
                    cancelled = exc
                    continue
                break
    except KeyboardInterrupt:
        # Raised where trio raises Ctrl-C in Python code: entering those scopes (before
        # the shield stands) or leaving them. Before the end, the first is as one
        # raised while waiting: it discards, and is raised once the teardown ended.
        if interrupted is None or isinstance(cancelled, KeyboardInterrupt) or closing.value:
            raise
        interrupted()
        await _until_closed(closing)
        raise
    if cancelled is not None:
        raise cancelled


def open_devices() -> list[Device]:
    """The devices open now in this process."""
    return [device for device in _devices() if not device.closed]


def closing(device: Device) -> bool:
    """Whether ``device``'s close has begun (what was submitted may still run): a
    device picked for a caller who named none is never one of those."""
    return device.closed or device._closing is not None


def open_device(name: str | None = None) -> DeviceOpener:
    """Open a device: ``async with open_device("cpu") as dev`` or ``dev = await ...``
    (a coroutine too: ``asyncio.run`` and ``asyncio.create_task`` take it).

    ``name``: ``"cpu"`` (``"cpu:1"``... open independent ones), ``"cuda:0"``,
    ``"metal"``, ``"npy"``; :func:`devices` lists those here. None means
    ``$ASYNCMETAL_DEVICE``, else the best device available -- one that runs kernels:
    ``$ASYNCMETAL_DEVICE=npy`` opens ``cpu``. Each call opens a device of its own. One
    never closed is closed at exit, once its queued work ran, with a ResourceWarning.
    """
    caller = sys._getframe(1)  # where it is opened: a device left open says so at exit
    return DeviceOpener(name, f"{caller.f_code.co_filename}:{caller.f_lineno}")


_npy_device: Device | None = None


async def from_numpy(array: Any) -> Buffer:
    """``array`` as a read-only Buffer of the process's ``npy`` device, usable as a
    source of :func:`asyncmetal.copy` like any device buffer. No bytes are copied."""
    global _npy_device
    if not isinstance(array, np.ndarray):
        raise ArgumentTypeError(f"from_numpy takes a numpy array, got {type(array).__name__}")
    if _npy_device is not None and not _npy_device.closed:
        await checkpoint()  # (as opening it is: cancelled, nothing is wrapped)
    if _npy_device is None or _npy_device.closed:
        device = await open_device(backends.ARRAYS)
        if _npy_device is None or _npy_device.closed:
            _npy_device = device
        else:
            await device.close()
    return _npy_device._wrap(array)


def _close_all_at_exit() -> None:
    # Drain in-flight work before the interpreter finalizes, so no device thread or
    # native callback runs into a half-torn-down interpreter. (A forked child has none
    # of its parent's devices here: _forget_parent_devices took them out.) A Ctrl-C as
    # one device closes (on the main thread: its close raises it once all its steps
    # ran) leaves no other unclosed: the first is raised once every device was closed
    # (the interpreter reports it and runs the other exit hooks). One that lands
    # before the device's close began (as _close_native is entered) or as it returned
    # runs its close at exit again (``until_uninterrupted``), and that goes on from
    # where it got to. The devices are closed in turn inside one more of those, whose
    # noting handler (the main thread's, at exit) takes one between two closes too.
    interrupts: list[KeyboardInterrupt] = []
    interrupt = until_uninterrupted(_close_each_at_exit, interrupts, {})
    if interrupt is not None:
        interrupts.append(interrupt)
    if interrupts:
        raise interrupts[0]


def _close_each_at_exit(interrupts: list[KeyboardInterrupt], begun: dict[int, list[bool]]) -> None:
    """Each open device closed at exit (_close_at_exit), the Ctrl-Cs its closes took in
    ``interrupts``; ``begun`` by device (its id: alive, on the open ones, while this
    runs), for a call again to go on from where each got to."""
    for device in _devices():
        interrupt = until_uninterrupted(_close_at_exit, device, begun.setdefault(id(device), []))
        if interrupt is not None:
            interrupts.append(interrupt)


def _close_at_exit(device: Device, begun: list[bool]) -> None:
    """``device`` closed at exit (abandoning waits nobody signals), with a
    ResourceWarning where the program left it open; ``begun``: noted once this close
    at exit began, with whether it was left open (then it runs again, if called again,
    until the device is off the open ones: its native close's last step). A device
    whose close began and did not release it -- its teardown (at its end by now: the
    close's thread, not a daemon, was joined) ended before its native close ran, or
    with one cut as it was entered -- is closed too; one closed otherwise, on a thread
    of its own (_close_abandoned's, a daemon), is left to that thread."""
    if not any(d is device for d in _devices()):
        return  # (its close at exit got to its end before an interrupt)
    if device.closed and not device._torn_down and not begun:
        return
    if not begun:
        begun.append(not device.closed)  # (whether the program left it open)
    with contextlib.suppress(Exception):  # exiting: nothing left to report to
        device._close_native(abandon=True)
    if device is _npy_device or not begun[0]:
        return  # from_numpy's own (the program never opened it), or one it closed
    with contextlib.suppress(Exception):  # (a warnings filter that raises)
        warnings.warn(
            f"device {device.name} ({device._opened_as}) was never closed: "
            "closed at exit once its "
            "queued work ran, waits nobody signals abandoned (close it: `async "
            "with am.open_device(...)`, or `await dev.close()`)",
            ResourceWarning,
            stacklevel=1,
        )


atexit.register(_close_all_at_exit)

# Forks. A child gets the parent's memory but none of its other threads: the devices
# opened before the fork have no queue threads, completion threads or (for GPU drivers)
# usable driver state in the child. So in the child every one of them is closed as the
# parent's -- nothing native of it is touched or waited for -- and any use of it, its
# queues, buffers or timelines raises ClosedResourceError saying where it was opened.
# The child may open devices of its own; those of a kind whose driver does not survive
# a fork (a backend not ``fork_safe``) only if the parent never opened one.
_kinds_opened: set[str] = set()  # kinds of device not fork_safe that this process opened
_inherited_drivers: dict[str, int] = {}  # kind -> the ancestor process that opened one
# This process's id, the parent's in a child's handler below, which then notes its own:
# not noted by a handler in the parent, which would run Python code there (see _pool's
# _starting: a Ctrl-C during the fork would be lost in it).
_pid = os.getpid()


def _forget_parent_devices() -> None:
    global _pid
    parent, _pid = _pid, os.getpid()
    for kind in _kinds_opened:
        _inherited_drivers.setdefault(kind, parent)
    global _open_devices, _open_devices_lock
    _open_devices_lock = threading.Lock()  # (a parent thread may have held it at the fork)
    forget_open_states()
    forget_left_blocks()
    parents, _open_devices = _devices(), ()
    for device in parents:
        # A thread of the parent may have held it at the fork: it is never let go here.
        device._state.submitting = threading.RLock()
        device._close_lock = threading.Lock()
        device._makings = 0  # (a parent thread's, never through here)
        device._allocator.forked()
        device._closing = None  # (a close under way in the parent: no teardown here)
        where = f"opened in process {parent}; open devices in the child"
        message = f"device {device.name} was {where}"
        if not device.closed:
            device._state.name = f"{device.name} ({where})"  # every closed-device error names it
            device._mark_closed()
        # Closing in the parent too: its native close is not through (a device is in
        # _open_devices until then), and nothing of it goes on here -- its backend's
        # locks and threads are the parent's as much as an open device's are.
        device._state.stopped = device._state.ran_out = True  # (nothing of it runs in the child)
        device._backend.forked(message)


def _check_fork_safe(kind: str) -> None:
    parent = _inherited_drivers.get(kind)
    if parent is not None:
        raise AsyncMetalError(
            f"{kind} devices cannot be opened in a process forked from one that opened "
            f"one (process {parent}): the {kind} driver does not survive a fork. Start "
            "the process with multiprocessing's 'spawn' or 'forkserver' method instead"
        )


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parent_devices)

"""The per-device Allocator: native blocks, a cache of freed ones, a budget, and frees
deferred until the commands using a block have passed."""

from __future__ import annotations

import bisect
import collections
import functools
import gc
import heapq
import math
import numbers
import operator
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from ._backend import NativeTimeline, let_go_everywhere
from ._bridge import LoopBridge, checkpoint, current_bridge
from ._device_state import DeviceState, unreleased_states
from ._errors import (
    MAX_TIMEOUT_S,
    ArgumentTypeError,
    ClosedResourceError,
    InvalidArgumentError,
    OutOfMemoryError,
    as_int,
)
from ._timeline import (
    Detached,
    Timeline,
    Waitable,
    call_when_reached,
    passed,
    run_detached,
    wait_value,
)


class Queue(Protocol):
    """What memory needs of the queues whose commands use it (``_queue.Queue``): the
    timeline each use is a value of."""

    @property
    def timeline(self) -> Timeline: ...


class Owner(Protocol):
    """What keeps memory the device does not own alive (``Block.owner``): ``held``, what
    holds that memory (another library's array, the DLPack capsule it exported), until
    ``let_go``."""

    held: object

    def let_go(self) -> object:
        """``held``, given up (None from then on): its buffer was freed."""
        ...


class Block:
    """Native memory and the commands that use it. Outlives the Python-facing
    allocation, so a collected buffer is still freed only after its last use."""

    __slots__ = (
        "__weakref__",  # (an allocator's foreign blocks: see Allocator.note_foreign)
        "cached_at",
        "dropped",
        "freed",
        "generation",
        "handle",
        "keeper",
        "last_use",
        "lent",
        "memory",
        "nbytes",
        "owner",
        "waited",
    )

    def __init__(
        self, handle: Any, nbytes: int, keeper: DeviceState, owner: Owner | None = None
    ) -> None:
        self.handle = handle
        self.nbytes = nbytes
        self.owner = owner  # what keeps memory the device does not own alive (an array)
        self.lent = 0  # loans to consumers outside asyncmetal (DLPack) not yet returned
        self.generation = 0  # bumped each time the block is handed out anew
        self.freed = False  # this generation was freed (explicitly or collected)
        self.last_use: dict[Queue, int] = {}  # per queue: value of the last command using it
        # The device under whose submission lock a command that orders itself after the
        # uses on ``last_use`` reads them and records its own (see Queue._copy): the
        # device that allocated the block, or whose block's record it shares.
        self.keeper = keeper
        self.cached_at = 0.0  # time.monotonic() when it last went into the cache
        # Of a block over memory the device does not own: the record that every buffer
        # over that memory shares (see ForeignMemory), None where it shares an allocated
        # block's record (memory of asyncmetal's own that went out and came back).
        self.memory: ForeignMemory | None = None
        # Of a block over memory another library owns: the command that waited for that
        # library's work on it (``foreign_buffer``'s ``after``), which uses no memory.
        self.waited: tuple[Queue, int] | None = None
        # Of a block over memory another library owns: its buffers went (the finalizer
        # of their allocation took it out of ``imported``), for good.
        self.dropped = False


class ForeignMemory:
    """A range of memory the device does not own (another library's array) and the
    record of uses that every buffer over it shares -- each ``from_dlpack`` of the same
    array, on one device or on several of its kind -- so that their commands are ordered
    as on one buffer. Buffers over a part of it share it too (ordered with more than
    they use, never with less), and so does one over more of it that no other record
    covers a part of (a whole array after a slice: see ``_buffer._share_foreign_memory``).
    Lives while a buffer over it does (its blocks hold it) or a command on one runs
    (host memory's handle, which the command holds, holds it too), found meanwhile by
    address (``Allocator.foreign_memory``)."""

    __slots__ = ("__weakref__", "address", "keeper", "last_use", "nbytes")

    def __init__(
        self, address: int, nbytes: int, last_use: dict[Queue, int], keeper: DeviceState
    ) -> None:
        self.address = address
        self.nbytes = nbytes
        self.last_use = last_use  # the record: its buffers' blocks hold the same dict
        self.keeper = keeper  # (as Block.keeper)

    def holds(self, address: int, nbytes: int) -> bool:
        """Whether ``nbytes`` at ``address`` lie within it."""
        return self.address <= address and address + nbytes <= self.address + self.nbytes

    def overlaps(self, address: int, nbytes: int) -> bool:
        """Whether ``nbytes`` at ``address`` share a byte with it."""
        return self.address < address + nbytes and address < self.address + self.nbytes


# What memory coming back shares the record of: an allocated block's, or foreign memory's.
Record = Block | ForeignMemory


class _Token:
    """What a loan of a block to a consumer outside asyncmetal holds until it ends: the
    loan's end is recorded as this goes (see :meth:`Allocator.lend`)."""

    __slots__ = ("__weakref__",)


class _LoanRecord(weakref.ref[_Token]):
    """A loan's record: a weak reference to its token, whose callback -- a deque's
    append, which CPython calls as the token goes, running no Python code, so that no
    interrupt comes between -- queues this record of the loan's end."""

    __slots__ = ("block",)
    block: Block
    # (Its hash is its own, not its token's: the token may be gone before it is hashed.)
    __hash__ = object.__hash__


def _not_lent() -> None:
    """Ends a loan that was never made (an export of a copy): nothing."""


def _pending(queue: Queue, value: int) -> bool:
    """Whether the command ``value`` of ``queue`` recorded as a use may still run: its
    queue's timeline has not reached it, and its device's commands did not run out."""
    timeline = queue.timeline
    return not timeline._state.ran_out and timeline.native.value < value


class Allocation:
    """What Buffers (and their views) hold; its collection frees the block."""

    __slots__ = (
        "__weakref__",  # (those over foreign memory: see _imports)
        "allocator",
        "block",
        "freed",
        "generation",
        "handle",
        "last_use",
        "nbytes",
    )

    def __init__(self, block: Block, allocator: Allocator | None = None) -> None:
        self.block = block
        self.handle = block.handle
        self.nbytes = block.nbytes
        self.last_use = block.last_use  # the same dict: commands record uses here
        self.freed = False
        self.allocator = allocator
        self.generation = block.generation

    def __del__(self) -> None:
        # Collected without free(): hand the block back -- unless this generation of it
        # was already freed (and maybe handed out again). Any thread, even inside the GC:
        # a deque append, then a wake-up that waits for no lock (see _ReleaseCounter).
        try:
            allocator, freed = self.allocator, self.freed
        except AttributeError:  # an interrupt at __init__'s entry: it held nothing
            return
        if allocator is not None and not freed:
            allocator.collected(self.block, self.generation)
        elif allocator is None:
            block, looked = self.block, False
            try:
                if block.owner is not None and block.last_use:
                    # Memory another library owns: its owner (that library's array) is
                    # held until the commands recorded on it so far ran (see lingering)
                    # -- freed or not: a free's wait, cancelled, leaves them running --
                    # unless the one recorded is the wait for that library's work, or
                    # they ran already (its owner goes at once, not at the next look: and
                    # a cycle the collector found goes with this collection, not come
                    # back for another), or the queue's device closed (its commands ran
                    # out: and a buffer that outlived the last device's close would wait
                    # for a look never to come). (Read from a copy: a collection while
                    # the list is made may run code that records a use.)
                    uses = [use for use in block.last_use.copy().items() if _pending(*use)]
                    if uses and uses != [block.waited]:
                        lingering[id(block)] = (block, uses)
                looked = True
            finally:
                if not looked:  # (an interrupt above: held until every use recorded ran)
                    lingering[id(block)] = (block, list(block.last_use.copy().items()))
                # After: it stays reachable meanwhile. (No call before the one that takes
                # it out, where an interrupt would leave it, and its owner, held for good.)
                # Marked first: a collection on another thread may hold this allocation
                # again (its weak references live until this returns) and put its block
                # back after this took it out -- it takes it out again once it sees this.
                block.dropped = True
                imported.discard(block)


# The blocks over memory another library owns whose buffers live: reachable from here,
# not only through their buffers, so that a buffer collected in a reference cycle while
# a command uses its memory leaves its block out of the garbage. The collector clears
# the weak references to what it collects -- and calls their callbacks -- before any
# finalizer runs: the owner's (a producer that frees its memory from one) and the
# record's (``ForeignMemory``, found by address through weak references) would go
# before the buffer's finalizer put the block in ``lingering``. Added as the buffer is
# made (``hold_imported``); taken out by that finalizer (``Allocation.__del__``), and,
# for the length of a collection, where no command may still use the memory
# (``_hold_in_use``): a block held through every collection would hold its owner, and
# with it a buffer the owner refers to (a producer that keeps the buffer made of it),
# whose cycle no collection could then find.
imported: set[Block] = set()  # (a block hashes by identity)
# The allocations of the buffers over memory another library owns, held weakly: each
# goes as its buffers do (a look then lets go of its block, which no collection holds
# again). Those made since the last collection started, the only ones the youngest
# generation's may take, in ``_young``; those the collection under way let go of, to
# hold again as it ends, in ``_unheld``.
_imports: weakref.WeakSet[Allocation] = weakref.WeakSet()
_young: list[weakref.ref[Allocation]] = []
_unheld: list[weakref.ref[Allocation]] = []
letting_go = False  # (a collection let go of blocks it looked at: see _hold_in_use)


def hold_imported(allocation: Allocation) -> None:
    """Hold the block of new ``allocation``, over foreign memory, from here while its
    buffers live (see ``imported``)."""
    global _holding, _young_limit
    imported.add(allocation.block)
    _imports.add(allocation)
    _young.append(weakref.ref(allocation))
    if len(_young) > _young_limit:  # (no collection ran: collections switched off)
        _young[:] = [ref for ref in _young if ref() is not None]
        _young_limit = max(_YOUNG_LIMIT, 2 * len(_young))
    if not _holding:
        _holding = True
        gc.callbacks.append(_hold_in_use)


_holding = False  # (_hold_in_use is among the collector's callbacks)
_YOUNG_LIMIT = 1024
_young_limit = _YOUNG_LIMIT  # (where _young's gone buffers are dropped: it doubles)


def _hold_in_use(phase: str, info: dict[str, int]) -> None:
    """A collection's callback (any thread, no lock taken): as it starts, let go of the
    blocks in ``imported`` that it may take whose memory no command may still use; as
    it ends, hold them again. Other threads run meanwhile -- this is Python code --, and
    one may record a command on a buffer the collection may take (reached through a
    weak reference) and drop it again before this returns: so each block is let go of
    before its uses are looked at, and held again where one may not have passed, and a
    command recorded after the look holds its buffers' blocks again itself
    (``hold_used``, while ``letting_go``: until the collection ends, as code may run
    before the collector cleared its weak references -- a finalizer's, or, where no
    GIL is, another thread's). A command that ended needs no hold: the blocks let go
    of hold nothing the collection may take early. The youngest generation's
    collections, the most frequent, look at the buffers made since the last one only
    (the others are older: it cannot take them), the older ones' at every buffer (some
    1 us each). An interrupt holds every block it looked at (the
    collector reports it, and goes on): one held longer, never one in use unheld."""
    global letting_go
    if _unheld:  # (as one ends; as one starts, where an interrupt cut the last end)
        _hold_again()
    if phase != "start":
        letting_go = False
        return
    allocations: list[Allocation] = []
    try:
        letting_go = True  # (before any block is let go of)
        if info["generation"] > 0:
            allocations = list(_imports)
        else:
            allocations = [a for ref in _young if (a := ref()) is not None]
        _young.clear()  # (older once this one ends, if it does not take them)
        _unheld.extend([weakref.ref(allocation) for allocation in allocations])
        imported.difference_update([allocation.block for allocation in allocations])
        busy = []
        for allocation in allocations:
            if any(_pending(*use) for use in allocation.block.last_use.copy().items()):
                busy.append(allocation.block)
        _hold(busy)
    except BaseException:
        _hold([allocation.block for allocation in allocations])
        raise


def _hold(blocks: list[Block]) -> None:
    """Hold ``blocks`` in ``imported`` again -- but not those whose buffers went: a
    collection on another thread may have reached their allocation as its finalizer
    took them out (its weak references live until that returns; see
    Allocation.__del__)."""
    imported.update(blocks)
    imported.difference_update([block for block in blocks if block.dropped])


def hold_used(allocations: Iterable[Allocation]) -> None:
    """Hold again the blocks over foreign memory of ``allocations``, on which a command
    was just recorded, while a collection lets go of blocks (``letting_go``): its look
    at their uses may have come before the command's (see ``_hold_in_use``)."""
    imported.update(
        [a.block for a in allocations if a.allocator is None and a.block.owner is not None]
    )


def _hold_again() -> None:
    """Hold again the blocks the last collection let go of whose buffers it left. (The
    allocations kept until the blocks are held: one whose buffers another thread drops
    meanwhile takes its block out after, not before -- held for good.)"""
    allocations = [a for ref in _unheld if (a := ref()) is not None]
    _hold([allocation.block for allocation in allocations])
    _unheld.clear()


# Blocks over memory another library owns whose buffers were dropped while commands may
# still use that memory, by id, each with the uses recorded on it then: the block holds
# the memory's owner (the library's array, or its DLPack capsule) until those uses
# passed -- the library would otherwise hand the memory out again (PyTorch's caching
# allocator does, at once) while the device still reads or writes it. Added to by a
# collection with no call (any thread, even inside the GC); moved to ``held_back`` (or
# let go of) by ``let_lingering_go``, at the next import, allocation or close of a device.
# Also what held the memory of such a buffer that was freed while commands may still
# use it (``Owner.held``, which its owner let go of: see ``let_go_after_uses``).
lingering: dict[int, tuple[object, list[tuple[Queue, int]]]] = {}
# Those of them ``let_lingering_go`` took over, by id, each waiting in ``_waiting`` for
# one of its uses that had not passed. Touched only under ``_looking``.
held_back: dict[int, tuple[object, list[tuple[Queue, int]]]] = {}
# Per queue, a heap of (value, id) of the blocks of held_back waiting for its command
# ``value``: a look reads each queue's timeline once and takes what passed off the top,
# so that its cost goes with what it lets go of, not with how many wait.
_waiting: dict[Queue, list[tuple[int, int]]] = {}
_looking = threading.Lock()  # (one look at a time: see let_lingering_go)
_look_again = False  # (a call found a look under way: that one looks again)


_parents_lingering: list[tuple[object, list[tuple[Queue, int]]]] = []  # (forget_left_blocks)


def lingering_count() -> int:
    """How many dropped buffers' blocks of foreign memory, and freed ones' holds on it,
    are held (see lingering)."""
    return len(lingering) + len(held_back)


def let_go_after_uses(block: Block) -> None:
    """Have the owner of ``block`` -- over memory another library owns, whose buffer
    was freed: no command records a use of it from now -- let go of what holds that
    memory (``Owner.held``), kept until the commands recorded on it so far ran (see
    ``lingering``), as a dropped buffer's block is: the library may hand the memory out
    again (and asyncmetal's own buffer that lent it, come back, return to its
    allocator) while the freed buffer lives. At once where none may still run, or the
    one recorded is the wait for that library's work. Again: nothing."""
    if block.owner is None:
        return
    uses: list[tuple[Queue, int]] = []
    looked = False
    try:
        uses = [use for use in block.last_use.copy().items() if _pending(*use)]
        looked = True
    finally:
        if not looked:  # (an interrupt above: held until every use recorded ran)
            uses = list(block.last_use.copy().items())
        # (Put in lingering as it is let go of: no call between, where an interrupt
        # would leave it let go of early, or held for good.)
        if uses and uses != [block.waited]:
            held = block.owner.held
            if held is not None:
                lingering[id(held)] = (held, uses)
        block.owner.let_go()


def let_lingering_go() -> None:
    """Let go of the blocks of ``lingering`` and ``held_back`` whose uses passed (their
    owners' finalizers may run here: one that imports looks at none meanwhile). One
    look at a time: a call while one is under way (on another thread, or from an
    owner's finalizer it runs) leaves it to that one, which looks again once through.
    An interrupt anywhere keeps one longer, never lets one go early: each is put where
    it waits next before it is taken from where it waited."""
    global _look_again
    if _left_to_queues:  # (a device's commands ran out: blocks left to its queues may go)
        _free_passed_left_blocks()
    if _running_out:  # (... and uses its queues left on records may)
        _forget_run_out_uses()
    _look_again = True  # (before the try: a look letting go now sees it, and looks again)
    while _look_again:
        got: list[bool] = []
        try:
            try_locks((_looking,), got)  # (one call: no interrupt leaves it taken unnoted)
            if not got[0]:
                return
            _look_again = False  # (what the calls until now asked for: this look)
            _look_at_lingering()
        finally:
            if got and got[0]:
                _looking.release()


def _look_at_lingering() -> None:
    """One look of ``let_lingering_go`` (``_looking`` held)."""
    reached: dict[Queue, float] = {}  # (each queue's timeline read once a look)

    def done_to(queue: Queue) -> float:
        at = reached.get(queue)
        if at is None:
            timeline = queue.timeline
            at = reached[queue] = math.inf if timeline._state.ran_out else timeline.native.value
        return at

    def waits_for(uses: list[tuple[Queue, int]]) -> tuple[Queue, int] | None:
        for queue, value in uses:
            if done_to(queue) < value:
                return queue, value
        return None

    # A copy made at once, then looked through: a collection may run between any
    # two steps of a look (at each object made), and the buffers it collects add to
    # lingering, which a look at the dict itself would then fail on.
    for key, entry in lingering.copy().items():
        wait = waits_for(entry[1])
        if wait is not None:
            heapq.heappush(_waiting.setdefault(wait[0], []), (wait[1], key))
            held_back[key] = entry
        lingering.pop(key, None)
    for queue, heap in list(_waiting.items()):
        at = done_to(queue)
        while heap and heap[0][0] <= at:
            key = heap[0][1]
            held = held_back.get(key)  # (None: let go of, its top left by an interrupt)
            if held is not None:
                wait = waits_for(held[1])
                if wait is not None:  # (another queue's)
                    heapq.heappush(_waiting.setdefault(wait[0], []), (wait[1], key))
                else:
                    del held  # (the owner goes with the pop: its finalizer runs there)
                    held_back.pop(key, None)
            heapq.heappop(heap)
        if not heap:
            del _waiting[queue]


# The allocators some of whose memory went out to another library: while none has, a
# host copy's operand needs no look-up (it can be no buffer's memory lent out).
lenders: weakref.WeakSet[Allocator] = weakref.WeakSet()
# The allocators that have noted buffers over foreign memory (see note_foreign), until
# those are gone or they close, by id, held weakly: a host operand over such memory is
# a use of those buffers (see ``_copyargs._lent_back``). Empty while there are none: no
# look-up. (A dict of references: a WeakSet takes longer to copy than the look-up it
# decides on.)
foreign_holders: dict[int, weakref.ref[Allocator]] = {}


def holding_foreign() -> list[Allocator]:
    """The allocators among ``foreign_holders`` now."""
    return [a for ref in list(foreign_holders.values()) if (a := ref()) is not None]


# The blocks of closed devices whose records held other devices' queues as their device
# closed (a copy between devices), while their buffers live: no open device lists them
# (``Allocator.blocks``), yet those queues' uses there keep them alive until forgotten
# when their own device lets go of them (``closed_blocks``).
_closed_blocks: weakref.WeakSet[Block] = weakref.WeakSet()
_closed_blocks_lock = threading.Lock()


# The blocks a close left allocated because queues held behind waits nobody had
# signalled would still use them (see ``Allocator.close``), with the allocator of each:
# other devices' queues, and the closing device's own, which it abandoned there and
# whose streams its backend's close lets run (it raises the words they wait on). Freed
# once those uses passed -- as those devices' closes let their commands run out (the
# closing device's own close, once its backend's has), or as a sweep of any device's
# memory finds them passed (``free_left_blocks``).
_left_to_queues: dict[Block, Allocator] = {}
_left_freeing = False  # a sweep handed free_left_blocks to a thread, not run yet


def free_left_blocks() -> None:
    """Free the blocks closes left to queues whose uses of them have all passed now (a
    device's close calls this once its commands ran out: the blocks left to its own
    queues, and those other closes left to them, whose uses it abandoned; a sweep
    finds others passed, ``let_lingering_go``). One still lent out (DLPack) is left to
    its last loan, as a close leaves it. A native free that fails goes to its device's
    unheard errors (that device has closed)."""
    global _left_freeing
    with _closed_blocks_lock:
        _left_freeing = False
        done = [(b, a) for b, a in list(_left_to_queues.items()) if not a._uses_left(b)]
        for block, _ in done:
            del _left_to_queues[block]
    for block, allocator in done:
        with allocator._loans_lock:
            left = block.lent > 0
            if left:
                allocator._left_lent.add(block)
        if not left:
            try:
                allocator._state.backend.free(block.handle)
            except Exception as exc:
                allocator._state.unheard_error(exc)


def _free_passed_left_blocks() -> None:
    """(A sweep, while closes have left blocks to queues still running.) Where one of
    them has no use left, free those on the thread cache emptyings use: never on a loop
    (a native free may take long)."""
    global _left_freeing
    with _closed_blocks_lock:
        if _left_freeing or all(a._uses_left(b) for b, a in _left_to_queues.items()):
            return
        _left_freeing = True
    _EMPTYING.submit(free_left_blocks)


def forget_left_blocks() -> None:
    """In a forked child: the blocks closes left are the parent's (and a parent thread
    may have held the lock at the fork)."""
    global _closed_blocks_lock, _left_freeing, _looking
    _closed_blocks_lock = threading.Lock()
    _left_to_queues.clear()
    _left_freeing = False
    # The parent's dropped buffers' foreign memory: its owners are the parent's (another
    # library's CUDA arrays, whose release may call a driver the child cannot use), never
    # let go of here.
    _looking = threading.Lock()
    _parents_lingering.extend(lingering.values())
    _parents_lingering.extend(held_back.values())
    lingering.clear()
    held_back.clear()
    _waiting.clear()


def closed_blocks() -> list[Block]:
    """The blocks of closed devices whose records may hold open devices' queues (see
    ``_closed_blocks``)."""
    with _closed_blocks_lock:
        return list(_closed_blocks)


# Uses by the queues of closed devices that may still run as those devices' queues
# stopped (a copy abandoned behind a device wait nobody signalled: a GPU stream runs it
# once its backend's close raises the words it waits on), left on the records of other
# devices' blocks -- so that a free or a close of that memory still waits for them (see
# ``_pending``) -- until each device's commands ran out: per device, by its state's id,
# the state and each (block, queue) of it left. Taken off by ``let_lingering_go`` (its
# close calls that once they ran out).
_running_out: dict[int, tuple[DeviceState, list[tuple[Block, Queue]]]] = {}


def forget_closed_queues(state: DeviceState) -> None:
    """The queues of ``state``'s device have stopped (nothing is submitted to them any
    more): take their uses off the records of the other devices' blocks -- of the open
    and closing devices, and of closed ones whose buffers live (``closed_blocks``) --
    so that a buffer that outlives the device keeps neither its queues nor, through
    them, their timelines, the device and its native handles alive. A use whose
    command ran goes now; one that may still run (``_pending``), once the device's
    commands ran out (``_running_out``). Any thread but a loop's (a look through every
    block). No lock is needed: a record changes only by its own commands' uses, and none
    is recorded for these queues any more; each look reads a copy of the record, as a
    collection may record a use on it meanwhile. (The closed devices' blocks are listed
    after the others': a close on another thread moves its blocks there as it lets go
    of them, so each is in one of the two lists.)"""
    blocks = [block for other in _other_allocators(state) for block in other.blocks()]
    blocks += closed_blocks()
    left: list[tuple[Block, Queue]] = []
    for block in blocks:
        uses = block.last_use
        for queue, value in uses.copy().items():
            if queue.timeline._state is not state:
                continue
            if _pending(queue, value):
                left.append((block, queue))
            else:
                uses.pop(queue, None)
    # Listed whatever is left: the other devices' releases pending on its queues'
    # commands -- made before, or meanwhile from the uses left -- are looked at again
    # once they ran out (``settle_closed_queues``), which wakes allocations waiting for
    # that memory (nothing else will: see ``Allocator._watch_pending``).
    _running_out[id(state)] = (state, left)


def allocator_of(state: DeviceState) -> Allocator | None:
    """The allocator of ``state``'s device; None while that device is opening: its state
    is listed among the devices before it has made its allocator (and it has lent out
    or recorded nothing yet)."""
    allocator: Allocator | None = getattr(state.device, "_allocator", None)
    return allocator


def _other_allocators(state: DeviceState) -> list[Allocator]:
    """The allocators of the devices open or closing (until their memory is released)
    but ``state``'s -- of those that have one yet (``allocator_of``)."""
    found = (allocator_of(s) for s in unreleased_states() if s is not state)
    return [allocator for allocator in found if allocator is not None]


def _forget_run_out_uses() -> None:
    """Take the uses left on records by closed devices' queues (``_running_out``) off
    them once those devices' commands ran out, and have the other devices' releases
    pending on those queues looked at again (``settle_closed_queues``). (Any thread,
    any number at once: taking a use off twice takes it once, and a look finds what
    an earlier one left.)"""
    for key, (state, left) in _running_out.copy().items():
        if state.ran_out:
            for block, queue in left:
                block.last_use.pop(queue, None)
            for other in _other_allocators(state):
                other.settle_closed_queues(state)
            _running_out.pop(key, None)


def lenders_for(own: Allocator, any_kind: bool = False) -> list[Allocator]:
    """The allocators whose lent memory, coming back as an address, is a buffer of
    theirs to ``own``'s device: ``own`` first, then those of other devices of its kind
    (whose commands its queues order themselves with, on the device), then where
    ``any_kind``, those of devices of other kinds (a host copy over their memory is a
    use of their buffer: see ``_copyargs._lent_back``) -- open, or closing until their
    memory is released: a sealed device's commands still run on its memory (a copy is
    then refused, see ``Queue._after``), and memory it lent is no plain host operand
    before its close has ended. Empty while none of them lent anything out."""
    if not lenders:
        return []
    kind = own._state.kind
    # (Not by iterating lenders: another thread may add to it meanwhile.)
    states = unreleased_states()
    found = [own] if own in lenders else []
    # (A device still opening has no allocator yet, and is in no list of lenders.)
    found += [
        a
        for s in states
        if s.kind == kind and (a := allocator_of(s)) is not None and a is not own and a in lenders
    ]
    if any_kind:
        found += [
            a
            for s in states
            if s.kind != kind and (a := allocator_of(s)) is not None and a in lenders
        ]
    return found


@dataclass(frozen=True)
class MemoryStatistics:
    """A device's memory, in bytes (see :meth:`Device.memory_statistics`). Blocks count
    at their size class (a request rounded up: ``alloc(4)`` holds 512 bytes), as the
    device holds them.

    ``in_use``: buffers handed out, and freed ones whose last use is in flight;
    ``cached``: freed blocks kept for reuse, or still being released (emptying it);
    ``peak``: the most held at once (in use + cached), and ``peak_in_use``: the most in
    use at once, each since the device opened or the last ``reset_peaks=True``;
    ``budget``: the device's ``memory_budget``.
    """

    in_use: int
    cached: int
    peak: int
    budget: int
    peak_in_use: int = 0


# Size classes: a request is rounded up so that a freed block serves near sizes too.
# Up to SMALL_BLOCK, to a multiple of BLOCK_ALIGN; above, to a multiple of an eighth of
# the power of two below it (8 classes per doubling: at most 12.5 % more than asked).
# A request whose class has no cached block takes one of the next LARGER_CLASSES classes
# rather than a new block (two: above SMALL_BLOCK, at most 37.5 % more than asked).
BLOCK_ALIGN = 512
SMALL_BLOCK = 4096
CLASSES_PER_DOUBLING = 8
LARGER_CLASSES = 2
# Most bytes of freed blocks kept for reuse, unless set (Device.memory_cache_limit): a
# quarter of the device's memory, at most this (the budget bounds it too).
CACHE_LIMIT_CAP = 1 << 30
# A cached block not reused for this long is released (at the next allocation, free or
# look at the statistics after that: no timer runs).
CACHE_MAX_AGE_S = 60.0


@functools.lru_cache(maxsize=1024)  # (a hit costs less than the arithmetic)
def block_size(nbytes: int) -> int:
    """The size class of a request of ``nbytes`` (> 0): the bytes its block holds."""
    if nbytes <= SMALL_BLOCK:
        return -(-nbytes // BLOCK_ALIGN) * BLOCK_ALIGN
    step = (1 << ((nbytes - 1).bit_length() - 1)) // CLASSES_PER_DOUBLING
    return -(-nbytes // step) * step


class _ReleaseCounter(NativeTimeline):
    """The count behind :class:`_Releases`: raised from any thread, including a buffer's
    finalizer that the GC runs on a thread which is, at that moment, inside this very
    counter. So raising never waits for itself: requests are queued, and the thread
    taking them up takes up those queued meanwhile, a finalizer's beneath it included
    (the lock is re-entrant; ``_busy`` tells it is taken up already). Each request is
    counted and taken off the queue in one run with no call, and the lock is held in a
    ``with``, so an interrupt (see Allocator._try_alloc) never leaves the lock held or a
    request half counted; one cutting a wake-up after the count is why a waiting
    allocation looks again now and then (LOST_WAKE_UP_RECHECK_S)."""

    def __init__(self, on_advance: Callable[[int], None]) -> None:
        self._value = 0
        self._lock = threading.RLock()
        self._busy = False  # a thread is taking requests up (under the lock)
        self._requests: collections.deque[int] = collections.deque()  # 0: one more
        self._on_advance = on_advance

    @property
    def value(self) -> int:
        return self._value

    def signal(self, value: int) -> None:
        self._request(value)

    def increment(self) -> None:
        self._request(0)

    def _request(self, target: int) -> None:
        try:
            self._requests.append(target)
        finally:  # (also where an interrupt came right after the append)
            # A KeyboardInterrupt as this waits for the lock (another thread counts:
            # CPython runs the handler in the wait, and nothing is taken) does not skip
            # the count: it waits again, and the interrupt is raised once done --
            # skipped, the requests stayed queued, uncounted until some later one.
            interrupt: KeyboardInterrupt | None = None
            taking = True
            while taking and self._requests:
                entered = False
                try:
                    with self._lock:
                        entered = True
                        taking = not self._busy  # (busy: this thread, beneath this finalizer)
                        if taking:
                            self._busy = True
                            try:
                                while self._requests:  # only the busy thread takes them out
                                    target = self._requests[0]
                                    if target == 0:
                                        self._value += 1
                                    elif target > self._value:
                                        self._value = target
                                    del self._requests[0]
                            finally:
                                self._busy = False
                except KeyboardInterrupt as exc:
                    if entered:
                        raise
                    interrupt = exc
                    continue
                if taking:
                    self._on_advance(self._value)
            if interrupt is not None:
                raise interrupt

    def forked(self) -> None:
        """In a forked child: a parent thread may have been counting at the fork (the
        lock held, ``_busy`` set), and never lets go here."""
        self._lock = threading.RLock()
        self._busy = False


class _Releases(Waitable):
    """Counts what may let a waiting allocation proceed (a release, a dropped buffer,
    a budget change, a pending release whose use passed, closing); waiting
    allocations on any loop await its next value."""

    def __init__(self) -> None:
        super().__init__()
        self._counter = _ReleaseCounter(self._advanced)
        self.native = self._counter

    def increment(self) -> None:
        """Count one more event and wake the allocations waiting for it (any thread)."""
        self._counter.increment()


_TRY = operator.methodcaller("acquire", False)


def try_locks(locks: Iterable[Any], got: list[bool]) -> None:
    """Try each of ``locks`` without waiting, appending to ``got`` whether it was taken.
    No interrupt comes between a try and its record -- they are all one C call, and no
    signal handler runs between calls made from C -- so a caller letting go (in a
    finally) of those ``got`` says were taken leaves none held."""
    got.extend(map(_TRY, locks))


def _held_here(lock: Any) -> bool:
    """Whether the calling thread holds ``lock`` (an RLock)."""
    return bool(lock._is_owned())


def _passed(queue: Queue, value: int) -> bool:
    """Whether ``queue`` is done with the command ``value``."""
    return passed(queue.timeline, value)


# How often an allocation waiting while blocks are lent out (``np.from_dlpack(buf)``)
# looks for loans that finished commands of idle queues still keep.
LOAN_RECHECK_S = 0.01
# How often a close waiting for allocations under way looks again without being told.
ALLOCATING_RECHECK_S = 0.05
# How often an allocation waiting while the device itself is full tries again.
FULL_RECHECK_S = 0.01
# How often a waiting allocation looks again, told or not: an interrupt (a Ctrl-C) may
# cut the wake-up that follows a release (see _ReleaseCounter).
LOST_WAKE_UP_RECHECK_S = 1.0
# Where empty_memory_cache frees: one thread, whoever empties a cache.
_EMPTYING = Detached("asyncmetal empty cache")


class Allocator:
    """The native allocations of one device: a cache of freed blocks, a budget, and
    frees deferred until the device is done with the memory.

    ``in_use`` counts blocks handed out (and freed blocks whose last use is still in
    flight); ``cached`` counts freed blocks kept for reuse. Their sum never exceeds
    ``budget``: an allocation that does not fit waits for frees (backpressure). Both
    count a block at its size (the request rounded up to its class, see
    :func:`block_size`), which is what the device holds.

    The cache keeps at most ``cache_limit`` bytes, least recently freed blocks going
    first; a block cached for ``cache_max_age`` seconds is released at the next look
    (an allocation that misses the cache, a release, the statistics).

    Nothing here depends on the loop that freed a block: a deferred release waits in
    ``_pending`` until its last uses passed and is made by whoever looks next (an
    allocation, a free, the statistics); an allocation that waits has its own loop
    told when those uses pass. Several loops, on several threads, may share a device:
    the state is guarded by ``_lock``, which a buffer's finalizer never takes (an import
    in any finalizer looks memory up under it: reentrant).
    """

    def __init__(self, state: DeviceState) -> None:
        self._state = state
        self.budget = state.backend.info.total_memory
        self.cache_limit = self.default_cache_limit()  # bytes of freed blocks kept
        self.cache_max_age = CACHE_MAX_AGE_S
        self._next_expiry = 0.0  # time.monotonic() of the next look for old blocks
        self.in_use = 0  # handed out, being allocated natively, or released later
        self.cached = 0
        self.peak = 0  # the most bytes held at once (in use, being released, cached)
        self.peak_in_use = 0
        # Cached blocks taken out to be freed natively off the loop (release_cached):
        # their bytes still count against the budget until they are freed.
        self._releasing = 0
        self._releasing_blocks: list[Block] = []
        self._free_lock = threading.Lock()  # held while those are freed (any thread)
        self.closed = False
        self._cache: collections.OrderedDict[int, Block] = collections.OrderedDict()
        self._by_size: dict[int, list[Block]] = {}
        self._live: set[Block] = set()  # blocks handed out and not yet released
        # Blocks over memory the device does not own (another library's array) while
        # their buffers live: their records of uses are looked through too (``blocks``).
        self._foreign: weakref.WeakSet[Block] = weakref.WeakSet()
        self._collected: collections.deque[tuple[Block, int]] = collections.deque()  # GC
        # Loans out (DLPack), and the records of those that ended, queued as they end
        # (see lend): counted by the next look (a loan's end, a sweep, the close).
        self._loans: set[_LoanRecord] = set()
        self._returned: collections.deque[_LoanRecord] = collections.deque()
        self._left_lent: set[Block] = set()  # lent out as the device closed: still held
        # Guards loans' ends once the device is closing (their count, _left_lent): they
        # end on any thread, even in the GC, where _lock may be held. Held only around
        # a few operations that run no Python code (the GC runs none inside it).
        self._loans_lock = threading.RLock()
        self._lent_out: set[Block] = set()  # released while lent: released once returned
        # Blocks whose memory went out to another library (DLPack, the CUDA array
        # interface), by address: memory that comes back in (from_dlpack) is found here.
        self._exported: dict[int, Block] = {}
        # Their addresses in order, for a look-up by address: the blocks in use are
        # separate memory, so the one that holds a range is the nearest in use at or
        # before it. Those taken out of ``_exported`` stay here until a look-up passes
        # them or there are twice as many as entries (a release takes an entry out with
        # no call: see _release).
        self._exported_at: list[int] = []
        # The same of foreign memory (another library's, lent on by buffers over it), by
        # address and size, while buffers over it live: the memory stays its owner's, so
        # nothing is held. (By its shared record, not by a block: each buffer over the
        # memory lending it on is the same entry, however many there are, whichever goes.)
        self._exported_foreign: weakref.WeakValueDictionary[tuple[int, int], ForeignMemory] = (
            weakref.WeakValueDictionary()
        )
        # The foreign memory of buffers of this device, by address and size, while buffers
        # over it live: a buffer made over it again shares its record (see foreign_memory).
        # Held weakly, with no callback that needs the lock (one comes as its last buffer
        # goes, which the GC may collect it under): those gone are dropped once they may
        # be most, as an entry is added (``_foreign_pruned_at``: how many there were
        # after the last drop). The keys in order too, and the largest size among them;
        # and whether two of those ranges may share a byte (slices of one array): while
        # none do, their ends are in order as well, and a look-up of a range reads only
        # those that overlap it and one more, however large the largest (a big tensor
        # beside thousands of small ones); else those that start less than the largest
        # size before it. Each reference made is
        # counted, and its end queued as it comes (a deque's append, which runs no Python
        # code): once every one has ended, the device holds no foreign memory, and is no
        # longer among ``foreign_holders`` -- a host copy then looks nothing up.
        self._foreign_memory: dict[tuple[int, int], weakref.ref[ForeignMemory]] = {}
        self._foreign_ranges: list[tuple[int, int]] = []
        self._foreign_largest = 0
        self._foreign_overlap = False
        self._foreign_pruned_at = 0
        self._foreign_made = 0
        self._foreign_gone: collections.deque[object] = collections.deque()
        # Freed blocks whose last uses are in flight: those uses, by block (one entry a
        # block: recorded, updated and taken off with no call, see _release).
        self._pending: dict[Block, list[tuple[Queue, int]]] = {}
        # What a sweep reads of them, so that it costs what passed, not what is pending
        # (thousands of frees behind a deep queue): per queue, a heap of (value, number,
        # block) -- a use of each pending block not passed when it was put there, which
        # the block is looked at again once passed -- and those pending not in a heap
        # yet (``_unheaped``: collected, or their last loan ended) and those found due
        # (``_due``: released, then taken off). Each pending block is in one of them
        # from before it is pending: an entry is put in before the block's record
        # changes and taken out after. Entries may be stale (released since, pending
        # again): a look reads ``_pending``, and at worst looks once more.
        self._heaps: dict[Queue, list[tuple[int, int, Block]]] = {}
        self._heaped = 0  # (the entries' numbers: ties never compare blocks)
        self._unheaped: collections.deque[Block] = collections.deque()
        self._due: list[tuple[Block, int]] = []
        # Per loop: the (queue, value) uses it already watches for a pending release.
        self._watched: weakref.WeakKeyDictionary[LoopBridge, set[tuple[Queue, int]]] = (
            weakref.WeakKeyDictionary()
        )
        self._frees = _Releases()
        # Reentrant: a collection starts at any allocation of a tracked object, also in
        # a section under it, and runs finalizers on this thread there; one that imports
        # an array (from_dlpack) looks the memory up under it (foreign_memory,
        # note_foreign, exported_block), which this thread would otherwise wait for
        # itself. Those look-ups change nothing another section is in the middle of
        # (the foreign memory's record is whole between any two of its allocations);
        # a loan's end, which would, only tries it where this thread does not hold it
        # (see returned).
        self._lock = threading.RLock()
        # Native allocations under way (outside the lock), per thread: a close waits
        # for them (on _allocated) before it frees anything, so that none of them calls
        # the backend after the close's frees and the backend's own close.
        self._allocating: dict[int, int] = {}  # (a dict: Counter.__delitem__ is Python code)
        self._allocated = threading.Condition(self._lock)

    def forked(self) -> None:
        """In a forked child: a parent thread may have held a lock at the fork (it is
        never let go of here), and its allocations under way are not the child's. Its
        memory is the parent's: closed here, as its device is, nothing of it is freed,
        cached or handed out (``empty_memory_cache`` releases none, a buffer dropped
        queues nothing). Nor is the foreign memory its buffers are over any use of them
        here: a host operand over it is a plain one, as after a close."""
        self.closed = True
        self._forget_foreign()
        self._lock = threading.RLock()
        self._allocated = threading.Condition(self._lock)
        self._allocating = {}
        self._free_lock = threading.Lock()
        self._loans_lock = threading.RLock()
        self._frees._counter.forked()  # (a buffer dropped in the child counts a release)

    # -- allocation ----------------------------------------------------------------------

    async def alloc(self, nbytes: int, timeout: float | None = None) -> Allocation:
        given, nbytes = nbytes, as_int(nbytes)  # type: ignore[assignment]
        if nbytes is None:
            raise ArgumentTypeError(f"nbytes must be an int, got {type(given).__name__}")
        if nbytes <= 0:
            raise InvalidArgumentError(f"nbytes must be > 0, got {nbytes}")
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, numbers.Real)  # (a numpy scalar too, as in compile)
        ):
            raise ArgumentTypeError(
                f"timeout must be a number of seconds or None, got {type(timeout).__name__}"
            )
        if timeout is not None and not timeout >= 0:  # also refuses NaN
            raise InvalidArgumentError(f"timeout must be a number >= 0, got {timeout!r}")
        deadline = (  # a float: an np.float32 deadline would reach trio's epoll call
            None
            if timeout is None or timeout > MAX_TIMEOUT_S
            else time.monotonic() + float(timeout)
        )
        # The checkpoint comes first: once a block is taken, nothing may cancel the
        # allocation before it is handed out, or the block would have no owner.
        await checkpoint()
        while True:
            seen = self._frees.value  # before the attempt: a release after it wakes us
            size = self._usable_size(nbytes)
            self.sweep()
            allocation = self._try_alloc(nbytes, size)
            if allocation is not None:
                return allocation
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise self._oom(nbytes, f"no memory was freed within {timeout} s")
            wait = min(math.inf if remaining is None else remaining, LOST_WAKE_UP_RECHECK_S)
            if self.in_use + self._releasing + size <= self.budget:
                # Not the budget: the device itself is full (its failed attempt counted
                # a release, for allocations its reservation held back: not for this
                # one, which would try again at once, for good). Wait for a release
                # from now on, and look again now and then for one missed meanwhile.
                seen = self._frees.value
                wait = min(wait, FULL_RECHECK_S)
            if self._lent_out:  # a loan a finished command still keeps comes back now
                let_go_everywhere()
                # ... or later: a queue lets go of what its finished commands kept only
                # at its next submission (or here), and nothing wakes this for that.
                wait = min(wait, LOAN_RECHECK_S)
            self._watch_pending()
            with anyio.move_on_after(wait):
                await wait_value(self._frees, seen + 1)

    def _usable_size(self, nbytes: int) -> int:
        """The size of the block for a request of ``nbytes``: its size class, or
        ``nbytes`` itself where the class would not fit the budget or the device's
        largest buffer (rounding never refuses a request that fits; _try_alloc also
        takes ``nbytes`` where only that fits beside what is in use)."""
        if self.closed or self._state.closed:
            raise ClosedResourceError(f"device {self._state.name} is closed")
        # (The device's memory bounds a request also under a budget set above it: the
        # native allocation would fail, and while a buffer is held it would wait for good.)
        total = self._state.backend.info.total_memory
        if nbytes > total:
            raise self._oom(nbytes, "larger than the device's whole memory: allocate less")
        if nbytes > self.budget:
            raise self._oom(
                nbytes,
                "larger than the device's whole budget: raise its memory_budget (the device "
                f"has {total} bytes) or allocate less",
            )
        largest = self._state.backend.max_allocation()
        if largest is not None and nbytes > largest:
            detail = f"larger than the largest buffer the device makes ({largest} bytes)"
            raise self._oom(nbytes, detail)
        size = block_size(nbytes)
        if size > self.budget or (largest is not None and size > largest):
            return nbytes
        return size

    def _try_alloc(self, nbytes: int, size: int) -> Allocation | None:
        """A block of ``size`` bytes for a request of ``nbytes``, handed out, or None to
        wait.

        A KeyboardInterrupt (a Ctrl-C outside trio's own code, or with no loop's
        handler) comes where CPython runs signal handlers -- after a call, at a
        function's entry, at a loop's end. Each change of state here is a run of
        bytecode with no call inside, and what a native allocation counted (its
        reservation in ``in_use``, itself as under way) is undone by what ``reserved``
        and ``counted`` say, set in those runs; a native block not handed out is freed.
        The block is handed out as an Allocation made before it changes hands (see
        _hand_out): one an interrupt drops after that hands the block back when it is
        collected. So no allocation stays counted as under way (a close waits for
        those to end: it would wait for good), and the block is handed out or stays
        where it was -- but for one window no Python code can close: from the native
        allocation's return inside ``backend.allocate`` until ``handle`` below holds
        its result, an interrupt (between a call's return and the store of what it
        returned) loses that memory: the cpu backend's is collected, a cuda or Metal
        block stays allocated, counted nowhere, until the process ends."""
        thread = threading.get_ident()
        counted = reserved = False
        interrupt: KeyboardInterrupt | None = None  # one in a wait below: raised once done
        handle: Any = None  # a native block, not handed out yet
        block: Block | None = None
        try:
            with self._lock:
                if self.closed:
                    return None
                blocks = self._by_size.get(size)
                if not blocks and self._cache and not self._budget_set():
                    blocks = self._larger_cached(size)
                if blocks:  # a cached block of the size class: no native call at all
                    return self._hand_out(blocks[-1], blocks)
                if self._cache:
                    self._expire(time.monotonic())
                if self.in_use + self._releasing + size > self.budget:
                    if self.in_use + self._releasing + nbytes > self.budget:
                        return None  # only releases of blocks in use can make room
                    size = nbytes  # the class would not fit beside what is in use: exact
                self._evict(self.in_use + self._releasing + self.cached + size - self.budget)
                # Reserved before the lock is let go: an allocation on another thread
                # sees it, so the two cannot both pass the budget while the backend
                # allocates; and counted as under way: a close waits until it is done.
                under_way = self._allocating.get(thread, 0) + 1
                self._allocating[thread] = under_way
                self.in_use += size
                counted = reserved = True
            handle = self._allocate(nbytes, size)
            block = None if handle is None else Block(handle, size, self._state)
            with self._lock:
                if self.closed:  # closed meanwhile: the device has no use for it, and
                    reserved, block = False, None  # its close counted the reservation out
                    if handle is not None:
                        self._state.backend.free(handle)  # (before the close's frees)
                elif block is not None:
                    return self._hand_out(block)
                else:
                    self.in_use -= size
                    reserved = False
        except BaseException:
            if reserved:
                # A KeyboardInterrupt as this waits for the lock (a second Ctrl-C, the
                # first what brought this here) waits again, as the count below does:
                # skipped, the reservation stayed in use for good, and the block allocated.
                entered = False
                while not entered:
                    try:
                        with self._lock:
                            entered = True
                            if block is None or block not in self._live:  # not handed out
                                if not self.closed:  # (a close counted it out already)
                                    self.in_use -= size
                                if handle is not None:
                                    self._state.backend.free(handle)
                    except KeyboardInterrupt as exc:
                        if entered:
                            raise
                        interrupt = exc
                self._frees.increment()  # the reservation may have held another back
            raise  # (and the interrupt, if any, once the finally below waited too)
        finally:
            if counted:
                # A KeyboardInterrupt as this waits for the lock (another thread's
                # allocation holds it: CPython runs the handler in the wait, and nothing
                # is taken) does not skip what follows: it waits again, and the interrupt
                # is raised once done -- skipped, the allocation stayed under way, and
                # the device's close waited for good.
                entered = False
                while not entered:
                    try:
                        with self._lock:  # (no call before the count is down)
                            entered = True
                            under_way = self._allocating[thread] - 1
                            if under_way:
                                self._allocating[thread] = under_way
                            else:
                                del self._allocating[thread]
                            self._allocated.notify_all()
                    except KeyboardInterrupt as exc:
                        if entered:
                            raise
                        interrupt = exc
            if interrupt is not None:
                raise interrupt
        self._frees.increment()
        return None

    def _budget_set(self) -> bool:
        """Whether a budget below the device's memory is set. Under one, a request never
        takes a larger class's cached block: the buffer would hold that block's extra
        bytes against the budget for as long as it lives, and a later request that fits
        beside the buffers' own classes could wait for good (the larger block, cached,
        is evicted instead when room is needed)."""
        return self.budget < self._state.backend.info.total_memory

    def _larger_cached(self, size: int) -> list[Block] | None:
        """(Under the lock.) The cached blocks of the nearest of the next LARGER_CLASSES
        size classes above ``size`` that has any."""
        for _ in range(LARGER_CLASSES):
            size = block_size(size + 1)
            blocks = self._by_size.get(size)
            if blocks:
                return blocks
        return None

    def _allocate(self, nbytes: int, size: int) -> Any:
        """Native memory of ``size`` bytes, or None when only releases of blocks in use
        can make room."""
        try:
            return self._state.backend.allocate(size)
        except MemoryError:
            with self._lock:
                self._evict(self.cached)  # the device itself is full: drop the cache, retry
        try:
            return self._state.backend.allocate(size)
        except MemoryError:
            if self._live:
                return None  # frees of blocks in use (or in flight) may make room
            detail = "the device itself has no memory left"
            raise self._oom(nbytes, detail, reserved=size) from None

    def _hand_out(self, block: Block, cached: list[Block] | None = None) -> Allocation:
        """(Under the lock.) Hand ``block`` out: a new one, which ``in_use`` counts
        already, or the last of ``cached``, its size class's cached blocks. Its
        Allocation is made first (an interrupt, see _try_alloc, lands before anything
        changed hands); then the block changes hands in a run with no call but the
        last, which makes it live: an interrupt lands before the change or after it,
        and after it the Allocation dropped hands the block back when collected."""
        key = id(block)
        block.last_use.clear()  # (a cached block's uses passed: they go either way)
        block.generation += 1  # (one never handed out: its allocation's is stale)
        allocation = Allocation(block, self)
        if cached is not None:
            del cached[-1]
            del self._cache[key]
            self.cached -= block.nbytes
            self.in_use += block.nbytes
        block.freed = False
        if self.in_use > self.peak_in_use:
            self.peak_in_use = self.in_use
        held = self.in_use + self._releasing + self.cached
        if held > self.peak:
            self.peak = held
        self._live.add(block)
        return allocation

    def _evict(self, nbytes: int) -> None:
        """(Under the lock.) Free least recently cached blocks natively until ``nbytes``
        are gone."""
        while nbytes > 0 and self._cache:
            key, block = next(iter(self._cache.items()))
            same = self._by_size[block.nbytes]
            at = same.index(block)
            # The block leaves the cache, its size class and the count in one run with
            # no call (an interrupt lands between two blocks, never inside one's move);
            # an interrupt at the native free's entry, or in the backend's free before
            # its native call, leaves that block allocated and counted nowhere.
            del self._cache[key]
            del same[at]
            self.cached -= block.nbytes
            nbytes -= block.nbytes
            self._state.backend.free(block.handle)

    def _expire(self, now: float) -> None:
        """(Under the lock.) Free the blocks cached for ``cache_max_age`` or longer
        (``now``: time.monotonic()); looks at most eight times per that age. None once
        closed: the close freed the cache (in a forked child, the cache is the parent's)."""
        if now < self._next_expiry or self.closed:
            return
        self._next_expiry = now + self.cache_max_age / 8
        cutoff = now - self.cache_max_age
        while self._cache:
            block = next(iter(self._cache.values()))  # the least recently cached
            if block.cached_at > cutoff:
                break
            self._evict(block.nbytes)

    def default_cache_limit(self) -> int:
        """A quarter of the device's memory, at most CACHE_LIMIT_CAP."""
        return min(self._state.backend.info.total_memory // 4, CACHE_LIMIT_CAP)

    def set_cache_limit(self, limit: int | None) -> None:
        """Keep at most ``limit`` bytes of freed blocks (None: the default)."""
        given = limit
        if limit is not None and (limit := as_int(limit)) is None:
            raise ArgumentTypeError(
                f"memory_cache_limit must be an int or None, got {type(given).__name__}"
            )
        if limit is not None and limit < 0:
            raise InvalidArgumentError(
                f"memory_cache_limit must be an int >= 0 or None, got {limit}"
            )
        with self._lock:  # (a close seals the device before its allocator takes this)
            self._state.check_open()
            self.cache_limit = self.default_cache_limit() if limit is None else limit
            self._evict(self.cached - self.cache_limit)

    def _oom(self, nbytes: int, detail: str, reserved: int = 0) -> OutOfMemoryError:
        in_use = self.in_use - reserved  # without this request's own reservation
        cached = self.cached + self._releasing  # (as the statistics count them)
        return OutOfMemoryError(nbytes, in_use, cached, self.budget, detail)

    # -- release -------------------------------------------------------------------------

    def release_after(
        self, block: Block, uses: list[tuple[Queue, int]], generation: int | None = None
    ) -> None:
        """Release ``block`` once each queue's timeline has passed its last use: now,
        or at the first look after that (any thread, any loop). With ``generation``
        (the one freed), only that generation's: made again -- after an interrupt that
        may have cut the first -- it changes nothing. A use by a queue of a device whose
        queues stopped waits until that device's commands ran out (``_pending``): one
        it abandoned behind a device wait still runs, reading or writing this memory,
        once its backend's close raises the words it waits on."""
        pending = [use for use in uses if _pending(*use)]
        if not pending:
            self._release(block, generation)
            return
        with self._lock:
            if block not in self._live or generation not in (None, block.generation):
                return  # released already (and maybe handed out again)
            self._heap(block, *pending[0])
            self._pending[block] = pending
        self._frees.increment()  # waiting allocations start watching its uses

    def _heap(self, block: Block, queue: Queue, value: int) -> None:
        """(Under the lock.) Have ``block`` looked at again once ``queue`` passed ``value``."""
        self._heaped += 1
        heapq.heappush(self._heaps.setdefault(queue, []), (value, self._heaped, block))

    def collected(self, block: Block, generation: int) -> None:
        """A buffer of ``block`` was garbage-collected unfreed (any thread, even in the
        GC): queue the block for the next sweep and wake whoever waits to sweep. Not once
        the device closed: its close freed the memory, and nothing sweeps any more."""
        if self.closed:
            return
        self._collected.append((block, generation))
        self._frees.increment()

    def lend(self, block: Block, generation: int, hold: bool = True) -> Callable[[], None]:
        """Hold ``block`` for a consumer outside asyncmetal until the function returned
        is called or dropped, whichever comes first (any thread, even in the GC; with
        ``hold`` False: not held), and remember that its memory went out. Refused where
        ``generation`` of it (the exported buffer's) was freed meanwhile -- also where
        the block went on to another buffer since -- or the device closed (each
        ClosedResourceError saying which).

        The loan's end is recorded with no Python code (see _LoanRecord) as its token
        goes -- the function clears it first thing (:meth:`returned`), or, where an
        interrupt cut it before, its caller drops it -- so no interrupt loses it. (An
        interrupt at a Python function's entry comes before any ``try`` of its own:
        no code in it can catch that one.) The loan is counted in one run with no
        call, its record among the loans; an interrupt before drops the token of a
        record that was never among them: ignored."""
        address = self._state.backend.loan_address(block.handle)
        token = _Token() if hold else None
        loan = None if token is None else _LoanRecord(token, self._returned.append)
        if loan is not None:
            loan.block = block
        with self._lock:
            # (Loans whose ends nothing counted -- a mapped view's, see Buffer.map --
            # are counted here: a program exporting in a loop never sweeps.)
            self._count_returned()
            # The device closed on another thread since (its close freed its memory).
            if self.closed:
                raise ClosedResourceError(
                    f"the buffer's device {self._state.name} was closed as the buffer was "
                    "exported (the close freed its memory)"
                )
            # Freed on another thread since (and maybe handed out anew: a new generation).
            if block.freed or block not in self._live or block.generation != generation:
                raise ClosedResourceError("the buffer was freed as it was exported")
            if loan is not None:
                block.lent += 1
                self._loans |= {loan}
            if address is not None:
                if address not in self._exported:
                    if len(self._exported_at) > 2 * len(self._exported) + 16:
                        self._exported_at = sorted(self._exported)
                    bisect.insort(self._exported_at, address)
                self._exported[address] = block
                lenders.add(self)
        return _not_lent if token is None else functools.partial(self.returned, [token])

    def lend_foreign(self, block: Block) -> None:
        """Remember that the memory of foreign ``block`` (see note_foreign) went out to
        another library through its buffer, as :meth:`lend` does of the device's own
        blocks: memory coming back at its address then shares its record of uses (its
        buffer's commands and those of what came back are ordered as on one buffer).
        Nothing is held: the memory is its owner's, which the loan keeps alive."""
        address = self._state.backend.loan_address(block.handle)
        if address is None:
            return
        memory = block.memory
        if memory is None:  # (an allocated block's record, shared: this range of it)
            memory = ForeignMemory(address, block.nbytes, block.last_use, block.keeper)
            block.memory = memory
        with self._lock:
            if self.closed or block not in self._foreign:  # (npy: arrays it only reads)
                return
            self._exported_foreign[memory.address, memory.nbytes] = memory
            lenders.add(self)

    def exported_uses(self, address: int, nbytes: int) -> dict[Queue, int] | None:
        """The uses record (``last_use``) of the block in use whose memory went out to
        another library and holds ``nbytes`` at ``address``; None if there is none."""
        block = self.exported_block(address, nbytes)
        return None if block is None else block.last_use

    def exported_block(self, address: int, nbytes: int) -> Record | None:
        """The block in use -- or the foreign memory (see ForeignMemory) -- whose memory
        went out to another library and holds ``nbytes`` at ``address``; None if there
        is none."""
        if not self._exported and not self._exported_foreign:
            return None
        with self._lock:
            at_ = self._exported_at
            at = bisect.bisect_right(at_, address)
            while at > 0:
                base = at_[at - 1]
                block = self._exported.get(base)
                if block is None or block not in self._live:  # released since (or cached)
                    if block is not None:
                        del self._exported[base]
                    del at_[at - 1]
                    at -= 1
                    continue
                if address + nbytes <= base + block.nbytes:
                    return block
                break  # (those before it end before it starts)
            # (The same range first, as an import of the array that went out finds it;
            # listed only where it holds any: a WeakValueDictionary's iteration is
            # Python code, ~1.3 us even when empty, and a host copy looks here while
            # any block is lent out.)
            foreign_memory = self._exported_foreign
            if foreign_memory:
                same = foreign_memory.get((address, nbytes))
                if same is not None:
                    return same
                for memory in list(foreign_memory.values()):
                    if memory.holds(address, nbytes):
                        return memory
            if not self._exported and not self._exported_foreign:
                lenders.discard(self)
        return None

    def returned(self, held: list[_Token]) -> None:
        """A loan ended (any thread, even in the GC: the lock is only tried): its token
        ``held`` goes, which queues the loan's record (see lend) -- also where an
        interrupt cut this before, as its caller drops this function. Counted here
        when the lock is free at once -- most loans end with nothing to release, and a
        program exporting in a loop without allocating never sweeps (the queue would
        grow by one entry per export) -- else by the next sweep. After the device
        closed, its last loan's end frees what the close left allocated for it."""
        held.clear()
        if self.closed:  # (queued before the close counted it: the close did)
            self._take_returned_after_close()
            return
        got: list[bool] = []
        try:
            # Not where this thread holds it: this end then came in the middle of one of
            # its sections (a collection's finalizer), which the count would change under.
            if _held_here(self._lock):
                got.append(False)
            else:
                try_locks([self._lock], got)
            if got[0]:
                self._count_returned()
        finally:
            if got and got[0]:
                self._lock.release()
        if self._pending or self._returned:  # a release, or a sweep, is due
            self._frees.increment()

    def _count_returned(self) -> None:
        """(Under the lock.) Count the loans' ends queued, until the device is closing
        (then the close counts them, see _take_returned_after_close). Each is taken off
        the queue and counted in one run with no call: an interrupt leaves the loan's
        end queued, or counted -- and the block, if that was its last loan and it was
        released meanwhile, pending (released by the next sweep)."""
        while self._returned and not self.closed:
            loan = self._returned[0]
            if loan in self._loans:  # (else its loan was never made)
                self._loans -= {loan}
                block = loan.block
                block.lent -= 1
                if not block.lent and block in self._lent_out:
                    self._lent_out -= {block}
                    self._unheaped += (block,)
                    self._pending[block] = []  # (no use left)
            del self._returned[0]

    def _take_returned_after_close(self) -> None:
        """Count the loans' ends queued once the device is closing; free each block
        whose last loan that was and which the close left allocated for it (any
        thread, the close's too). Each is taken off the queue and counted in one run
        with no call but the last, its native free (as in _evict)."""
        # (Under _loans_lock: the close may be deciding whether to leave a block to its
        # loans, and two loans' ends must not both take their last as their own.)
        with self._loans_lock:
            while self._returned:
                loan = self._returned[0]
                last = None
                if loan in self._loans:  # (else its loan was never made)
                    self._loans -= {loan}
                    block = loan.block
                    block.lent -= 1
                    if not block.lent and block in self._left_lent:
                        self._left_lent -= {block}
                        last = block
                del self._returned[0]
                if last is not None:
                    self._state.backend.free(last.handle)

    def sweep(self) -> None:
        """Take over blocks of garbage-collected buffers, and release the blocks whose
        last uses passed (and those closes left to this or other devices' queues, see
        ``free_left_blocks``; and let go of dropped buffers' foreign memory whose uses
        passed, see ``lingering``)."""
        if lingering or held_back:
            let_lingering_go()
        if _left_to_queues:
            _free_passed_left_blocks()
        if self._returned:
            with self._lock:
                self._count_returned()
        if self._returned and self.closed:  # closed since they were queued
            self._take_returned_after_close()
        while self._collected:
            with self._lock:
                if not self._collected:
                    break  # another thread swept it
                # Taken off the queue and recorded pending in one run with no call: an
                # interrupt leaves it queued, or pending (released below, or later).
                block, generation = self._collected[0]
                taken = block in self._live and block.generation == generation
                if taken and not block.freed:
                    uses = list(block.last_use.items())
                    block.freed = True
                    self._unheaped += (block,)
                    self._pending[block] = uses
                del self._collected[0]
        if not self._pending and not self._due:
            return
        with self._lock:
            while self._unheaped:
                self._look_again(self._unheaped[0])
                del self._unheaped[0]
            # (An interrupt may leave a heap empty: taken out at the next look.)
            for queue in [q for q, h in self._heaps.items() if not h or not _pending(q, h[0][0])]:
                heap = self._heaps[queue]
                while heap and not _pending(queue, heap[0][0]):
                    self._look_again(heap[0][2])
                    heapq.heappop(heap)
                if not heap:
                    del self._heaps[queue]
            due = list(self._due)
        # (Pending until released, and due until then: an interrupt loses none.) With its
        # generation: another thread's sweep may release it first, and an allocation hand
        # it out anew, before this one gets to it.
        for block, generation in due:
            self._release(block, generation)
        if due:
            with self._lock:
                released = {id(entry) for entry in due}
                self._due[:] = [entry for entry in self._due if id(entry) not in released]

    def _look_again(self, block: Block) -> None:
        """(Under the lock.) One of pending ``block``'s uses passed (or none was looked
        at yet): it is due once all did, else looked at again once another does (a
        stopped queue's, once its device's commands ran out: see release_after)."""
        uses = self._pending.get(block)
        if uses is None:  # (released since)
            return
        left = [use for use in uses if _pending(*use)]
        if left:
            self._heap(block, *left[0])
            self._pending[block] = left
        else:
            self._due += ((block, block.generation),)
            self._pending[block] = left  # (holding no queue until released)

    def _watch_pending(self) -> None:
        """Have the calling loop count an event when a pending release's next use
        passes, whichever loop freed the block (that one may be gone)."""
        if not self._pending:
            return
        bridge = current_bridge()
        with self._lock:
            watched = self._watched.setdefault(bridge, set())
            # A release waits for all its uses, each looked at again once the use it is
            # heaped on passed: watching the first of each queue's heap is enough, as
            # each event brings this loop back here to watch the next.
            # A stopped queue's use is not watched: its timeline is raised no more, so a
            # watch would never end -- or, once its device ended its waits, end at once,
            # over and over; the look made as that device's commands ran out wakes this
            # instead (settle_closed_queues).
            firsts = [(queue, heap[0][0]) for queue, heap in self._heaps.items() if heap]
            reached = [use for use in firsts if not _pending(*use)]
            new = [
                use
                for use in firsts
                if use not in watched and use not in reached and not use[0].timeline._state.stopped
            ]
            watched.update(new)
            due = reached or self._unheaped or self._due
        if due:  # one passed since the sweep (or is due): sweep again now
            self._frees.increment()
        for queue, value in new:
            passed = functools.partial(self._use_passed, watched, queue, value)
            call_when_reached(queue.timeline, value, passed)

    def _use_passed(self, watched: set[tuple[Queue, int]], queue: Queue, value: int) -> None:
        with self._lock:
            watched.discard((queue, value))
        self._frees.increment()

    def _release(self, block: Block, generation: int | None = None) -> None:
        """Cache ``block`` (freed, its uses passed), or free it natively; with
        ``generation``, only that generation of it. Its bookkeeping changes in one run
        with no call but the last (the block leaves ``_live``): an interrupt lands
        before it, the block still live and pending, or after it. The native free of a
        block not cached is the window left: an interrupt at its entry, or in the
        backend's free before its native call, leaves that memory allocated, counted
        nowhere (as in _evict)."""
        with self._lock:
            if block not in self._live or generation not in (None, block.generation):
                return
            if block.lent:  # a consumer outside asyncmetal still holds it
                if block in self._pending:
                    del self._pending[block]
                self._lent_out.add(block)
                return
            nbytes = block.nbytes
            keep = nbytes <= self.cache_limit and not self.closed
            now, key = 0.0, 0
            same: list[Block] = []
            if keep:
                now, key = time.monotonic(), id(block)
                same = self._by_size.get(nbytes) or self._by_size.setdefault(nbytes, same)
            exported, address = None, 0
            if self._exported:  # its memory went out once: no longer this buffer's
                address = getattr(block.handle, "address", block.handle)
                exported = self._exported.get(address)
            # The run: no call until its last step (a native free, or the block leaving
            # the live ones for the cache).
            if exported is block:
                del self._exported[address]
            if block in self._pending:
                del self._pending[block]
            self.in_use -= nbytes
            if not keep:
                self._live -= {block}
                self._state.backend.free(block.handle)
            else:
                block.cached_at = now
                self._cache[key] = block
                same += (block,)
                self.cached += nbytes
                self._live.discard(block)
            if exported is not None and not self._exported and not self._exported_foreign:
                lenders.discard(self)
            if keep:
                # Within the cache's limit and the budget (which may have been lowered
                # below what was in use): the least recently cached blocks go first.
                over_limit = self.cached - self.cache_limit
                held = self.in_use + self._releasing + self.cached
                self._evict(max(over_limit, held - self.budget))
                if now >= self._next_expiry:
                    self._expire(now)
        self._frees.increment()

    def set_budget(self, budget: int | None) -> None:
        """The bytes the device may hold (None: all it has, the default)."""
        if budget is None:
            budget = self._state.backend.info.total_memory
        given, budget = budget, as_int(budget)
        if budget is None:
            raise ArgumentTypeError(
                f"memory_budget must be an int or None (all it has), got {type(given).__name__}"
            )
        if budget <= 0:
            raise InvalidArgumentError(
                f"memory_budget must be an int > 0 or None (all it has), got {budget}"
            )
        with self._lock:  # (a close seals the device before its allocator takes this)
            self._state.check_open()
            self.budget = budget
            held = self.in_use + self._releasing + self.cached
            self._evict(max(held - budget, self.cached - self.cache_limit))
        self._frees.increment()  # waiting allocations re-check against the new budget

    def statistics(self, reset_peaks: bool = False) -> MemoryStatistics:
        """The numbers now; with ``reset_peaks``, the peaks start again from what is
        held now (after these are read: a peak between the two cannot be lost)."""
        self.sweep()
        with self._lock:
            self._expire(time.monotonic())
            # Blocks being released count as cached: freed, and held until their
            # native frees are done (the budget counts them so too).
            cached = self.cached + self._releasing
            stats = MemoryStatistics(self.in_use, cached, self.peak, self.budget, self.peak_in_use)
            if reset_peaks:
                self.peak = self.in_use + cached
                self.peak_in_use = self.in_use
            return stats

    def trim(self) -> None:
        """Free every cached block natively, on the calling thread."""
        with self._lock:
            self._evict(self.cached)

    async def release_cached(self) -> int:
        """Free every cached block natively, on a thread of its own (a native free may
        wait for the device); the bytes count against the budget until they are freed.
        Returns the bytes released: none once the device is closing (its close frees
        what is cached). Cancelled, the caller stops waiting; the frees go on."""
        await checkpoint()
        with self._lock:
            if self.closed or not self._cache:  # (closing: the close frees the cache)
                return 0
            # (No reference to a block kept here: its last one goes on the thread.)
            self._releasing_blocks.extend(self._cache.values())
            self._cache.clear()
            self._by_size.clear()
            released, self.cached = self.cached, 0
            self._releasing += released

        def free() -> None:
            try:
                self._free_releasing()
            finally:
                with self._lock:
                    self._releasing -= released
                self._frees.increment()  # waiting allocations may fit now

        await run_detached(_EMPTYING, free, self._state.unheard_error)
        return released

    def _free_releasing(self) -> None:
        """Free the blocks taken out of the cache by release_cached (any thread; a close
        waits for this, and frees those no thread got to)."""
        with self._free_lock:
            while self._releasing_blocks:
                self._state.backend.free(self._releasing_blocks.pop().handle)

    def close(self, completable: Callable[[], Mapping[Any, int]]) -> None:
        """The device is closing and its queues have stopped: fail waiting allocations
        and free everything natively -- once other devices' queues are done with it, as
        far as they can get: ``completable()`` says how far each queue can (see
        ``_queue.completable``), and once other threads' allocations inside the backend
        are over; a block that commands abandoned behind device waits may still use
        (any device's: ``_uses_left``) is left to them, freed once they ran out
        (``free_left_blocks``) -- and take its queues' uses off other devices' records
        (whatever failed before: see ``forget_closed_queues``). Runs on a thread of its
        own (or at exit), never a loop's."""
        try:
            self._close(completable)
        finally:
            forget_closed_queues(self._state)

    def _close(self, completable: Callable[[], Mapping[Any, int]]) -> None:
        """``close``, but for the other devices' records."""
        with self._lock:  # (release_cached takes no block out of the cache from now on)
            self.closed = True
        self._frees.increment()  # waiting allocations wake and raise ClosedResourceError
        self._settle_foreign_uses(completable)
        # The blocks release_cached took out before: freed here, or by its worker thread
        # (which this waits for).
        self._free_releasing()
        with self._lock:
            # Allocations inside the backend finish first (a native call that returns;
            # the lock is let go meanwhile): seeing the close, they free what they got
            # before the frees below, and none calls the backend after its close. Not
            # this thread's own (a close from inside its allocate could never go on).
            me = threading.get_ident()
            while any(thread != me for thread in self._allocating):
                self._allocated.wait(ALLOCATING_RECHECK_S)  # (a notify an interrupt cut)
            # A native free that fails (or a KeyboardInterrupt in one) stops no other
            # block's: each block is freed, or put where it waits to be, on its own --
            # one left to queues is registered at once, where their running out frees
            # it -- and the first error (an interrupt before any) is raised once all
            # were. (Raised at once, it would leave the blocks after it allocated for
            # good, and those left to queues before it unregistered: never freed.)
            errors: list[Exception] = []
            interrupt: KeyboardInterrupt | None = None

            def attempt(fn: Callable[..., object], *args: Any) -> None:
                nonlocal interrupt
                try:
                    fn(*args)
                except Exception as exc:
                    errors.append(exc)
                except KeyboardInterrupt as exc:
                    interrupt = interrupt or exc

            # Each cached block, and each ended loan, is taken off before its native
            # free: done again after one that raised, the next goes on -- as long as
            # one was taken (an error before that would come again: no end).
            left = -1
            while self._cache and len(self._cache) != left:
                left = len(self._cache)
                attempt(self._evict, self.cached)
            # Loans that ended before the close (none of their blocks is left to them yet).
            left = -1
            while self._returned and len(self._returned) != left:
                left = len(self._returned)
                attempt(self._take_returned_after_close)
            device = self._state.device
            with _closed_blocks_lock:
                _closed_blocks.update(
                    block
                    for block in [*self._live, *self._foreign]
                    if any(q.timeline.device is not device for q in list(block.last_use))
                )
            # Each taken off before its native free: a close run again after an
            # interrupt here (Device._close_native) frees none twice.
            while self._live:
                attempt(self._close_block, self._live.pop())
            self._pending.clear()
            self._heaps.clear()
            self._unheaped.clear()
            self._due.clear()
            self._collected.clear()
            self._exported.clear()
            self._exported_at.clear()
            self._exported_foreign.clear()
            self._forget_foreign()
            lenders.discard(self)
            self.in_use = 0
        if interrupt is not None:
            raise interrupt
        if errors:
            raise errors[0]

    def _close_block(self, block: Block) -> None:
        """(The close, under the lock.) Free live ``block`` natively, or leave it
        allocated until its uses that may still run passed (``_left_to_queues``) or its
        last loan ended (``_left_lent``)."""
        if self._uses_left(block):
            # Left allocated until those uses passed: other devices' (see
            # _settle_foreign_uses), or its own queues' that they abandoned (see
            # _uses_left).
            with _closed_blocks_lock:
                _left_to_queues[block] = self
            return
        with self._loans_lock:
            left = block.lent > 0  # left allocated until its last loan ends
            if left:
                self._left_lent.add(block)
        if not left:
            self._state.backend.free(block.handle)

    def settle_closed_queues(self, state: DeviceState) -> None:
        """Look at once at the pending releases heaped on uses by the queues of
        ``state``'s device, whose commands ran out (see ``_forget_run_out_uses``): those
        uses are all done (``_pending``), as the next sweep would find -- until which
        the heaps, and the releases' lists of uses, would keep those queues alive -- and
        wake the allocations waiting: nothing else does (``_watch_pending`` watches no
        stopped queue). The blocks found due are released by the sweep that wakes.
        (Each looked at before it leaves its heap, as a sweep does: an interrupt leaves
        it there. None goes back on such a heap: its device's uses are all done.)"""
        with self._lock:
            queues = [q for q in self._heaps if q.timeline._state is state]
            for queue in queues:
                heap = self._heaps[queue]
                while heap:
                    self._look_again(heap[0][2])
                    heapq.heappop(heap)
                del self._heaps[queue]
        if queues:
            self._frees.increment()

    def blocks(self) -> list[Block]:
        """The blocks in use and cached now, and the foreign ones whose buffers live
        (for ``forget_passed_uses``, a part at a time)."""
        with self._lock:
            return [*self._live, *self._cache.values(), *self._foreign]

    def note_foreign(self, block: Block) -> None:
        """``block`` is over memory the device does not own (a buffer of another
        library's array): the queues that use it are recorded on it too, and a buffer
        made over that memory again shares its record (``block.memory``, where set)."""
        memory = block.memory
        with self._lock:
            self._foreign.add(block)
            if memory is None or self.closed:
                return
            key = (memory.address, memory.nbytes)
            registry = self._foreign_memory
            known = registry.get(key)
            if known is not None and known() is not None:
                return  # (a record of its own, where another shares that range already)
            registry[key] = weakref.ref(memory, self._foreign_gone.append)
            self._foreign_made += 1
            foreign_holders[id(self)] = weakref.ref(self)
            ranges = self._foreign_ranges
            if known is None:
                at = bisect.bisect_left(ranges, key)
                ranges.insert(at, key)
                if not self._foreign_overlap:  # (its neighbours are the only ones it may)
                    before = ranges[at - 1] if at else None
                    after = ranges[at + 1] if at + 1 < len(ranges) else None
                    self._foreign_overlap = (before is not None and sum(before) > key[0]) or (
                        after is not None and after[0] < sum(key)
                    )
            if len(registry) > 2 * self._foreign_pruned_at + 16:  # maybe mostly gone
                for gone in [k for k, ref in registry.items() if ref() is None]:
                    del registry[gone]
                ranges[:] = sorted(registry)
                self._foreign_overlap = any(
                    sum(ranges[i]) > ranges[i + 1][0] for i in range(len(ranges) - 1)
                )
                self._foreign_pruned_at = len(registry)
                ended = self._foreign_gone
                while ended:  # (counted off one at a time: ends come meanwhile)
                    ended.popleft()
                    self._foreign_made -= 1
            if memory.nbytes > self._foreign_largest:
                self._foreign_largest = memory.nbytes

    def _forget_foreign(self) -> None:
        """Drop the record of foreign memory (none lives, or the device closed): the
        device is no longer among ``foreign_holders``. Under the lock, or where no other
        thread runs (a forked child). Ends of references made before, queued later, go
        to the queue left behind."""
        foreign_holders.pop(id(self), None)
        self._foreign_memory.clear()
        self._foreign_ranges.clear()
        self._foreign_largest = 0
        self._foreign_overlap = False
        self._foreign_pruned_at = 0
        self._foreign_made = 0
        self._foreign_gone = collections.deque()

    def foreign_memory(self, address: int, nbytes: int) -> list[ForeignMemory]:
        """The foreign memory of this device's buffers (see ForeignMemory) that shares a
        byte with ``nbytes`` at ``address``: the one of that very range first where
        there is one, else one that holds the range, if any."""
        registry = self._foreign_memory
        if not registry:
            return []
        if self._foreign_made == len(self._foreign_gone):  # every one gone
            with self._lock:
                if self._foreign_made == len(self._foreign_gone):  # (none made meanwhile)
                    self._forget_foreign()
            return []
        found = []
        with self._lock:
            same = registry.get((address, nbytes))
            memory = None if same is None else same()
            if memory is not None:
                return [memory]
            # Those that start before the range ends, back to where even the largest
            # would end before it starts -- or, no two of them overlapping (their ends
            # in order too), to the first that ends before it starts.
            ranges = self._foreign_ranges
            at = bisect.bisect_left(ranges, (address + nbytes,))
            disjoint = not self._foreign_overlap
            lowest = address - self._foreign_largest
            while at > 0 and ranges[at - 1][0] > lowest:
                at -= 1
                if disjoint and sum(ranges[at]) <= address:
                    break
                ref = registry.get(ranges[at])
                memory = None if ref is None else ref()
                if memory is not None and memory.overlaps(address, nbytes):
                    found.append(memory)
        found.sort(key=lambda m: not m.holds(address, nbytes))
        return found

    def forget_passed_uses(
        self, queues: Collection[Queue], blocks: list[Block] | None = None
    ) -> int:
        """Take the uses by ``queues`` that passed off the records of ``blocks`` (by
        default the blocks in use and cached), so that the blocks no longer keep those
        queues alive; return how many blocks it looked through. The caller sees that
        nothing submits to ``queues`` meanwhile."""
        if blocks is None:
            blocks = self.blocks()
        forget = set(queues)
        for block in blocks:
            uses = block.last_use
            for queue in [q for q in list(uses) if q in forget]:
                value = uses.get(queue)
                if value is not None and _passed(queue, value):
                    uses.pop(queue, None)
        return len(blocks)

    @staticmethod
    def forget_passed(uses: Iterable[tuple[Block, Queue]]) -> None:
        """Take each of ``uses`` (a block and a queue on its record) that passed off that
        block's record (see ``forget_passed_uses``). The caller sees that nothing submits
        to those queues meanwhile."""
        for block, queue in uses:
            value = block.last_use.get(queue)
            if value is not None and _passed(queue, value):
                block.last_use.pop(queue, None)

    def _foreign_uses(self, block: Block) -> list[tuple[Queue, int]]:
        """Uses of ``block`` by other devices' queues (a copy between devices) that
        may still run: not reached, and that queue's device's commands did not run out
        (``_pending``). Not ``_passed``: a device whose queues stopped still runs what
        they abandoned behind device waits once its backend's close raises the words
        they wait on, and that reads this memory (another device's free of it does not
        wait for that device's streams)."""
        return [
            (q, v)
            for q, v in list(block.last_use.items())
            if q.timeline.device is not self._state.device and _pending(q, v)
        ]

    def _uses_left(self, block: Block) -> list[tuple[Queue, int]]:
        """Uses of ``block`` that may still run (``_pending``), by any queue: other
        devices' (``_foreign_uses``) and, once its own queues stopped, theirs that they
        abandoned behind device waits nobody had signalled. Those run once the device's
        backend's close raises the words they wait on (a cuda stream runs on: the
        native free must not come before, and a cuda free is no wait for its streams
        one can count on), or never (cpu: the queue's thread stopped, what it held
        dropped); either way they are done once the device's commands ran out
        (``ran_out``), and its close frees the block then (``free_left_blocks``)."""
        return [(q, v) for q, v in list(block.last_use.items()) if _pending(q, v)]

    def _settle_foreign_uses(self, completable: Callable[[], Mapping[Any, int]]) -> None:
        """Wait (on the closing thread, never a loop) until other devices' queues are
        done with this device's memory, as far as they can get without the host: a use
        behind a device-side wait that nothing will signal is not waited for, and its
        block is then left allocated rather than freed under that queue (until that
        queue's device closes: see ``free_left_blocks``)."""
        with self._lock:
            uses = [use for block in self._live for use in self._foreign_uses(block)]
        if not uses:
            return
        limits = completable()
        for queue, value in uses:
            target = min(value, limits.get(queue, value))
            while not _passed(queue, target):
                time.sleep(0.0005)

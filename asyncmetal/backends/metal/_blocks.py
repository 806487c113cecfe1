"""Objective-C blocks built from Python, for the Metal backend (and tested on Linux).

A block is the Block ABI's literal: ``isa`` (``&_NSConcreteGlobalBlock``), ``flags``
(``BLOCK_IS_GLOBAL | BLOCK_HAS_SIGNATURE``), ``invoke``, a descriptor carrying the size
and the type signature, then asyncmetal's own fields. Its invoke function is one of the
native runtime's (``am_block_completed``, ``am_block_reached``): it records its argument
and raises a timeline, so the loop is woken through its pipe and the callback never takes
the GIL. A global block is not moved by ``_Block_copy``: the memory stays asyncmetal's,
kept alive in :data:`_alive` until the block has run (or its owner is closed).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from typing import Any

from ..._errors import NoHostMemoryError

BLOCK_IS_GLOBAL = 1 << 28
BLOCK_HAS_SIGNATURE = 1 << 30

COMPLETED_SIGNATURE = b"v16@?0@8"  # void (^)(id<MTLCommandBuffer>)
REACHED_SIGNATURE = b"v24@?0@8Q16"  # void (^)(id<MTLSharedEvent>, uint64_t)
# void (^)(int32_t error, void *data, size_t length, const char *message)
CODEGEN_SIGNATURE = b"v40@?0i8^v16Q24*32"


class BlockDescriptor(ctypes.Structure):
    _fields_ = [
        ("reserved", ctypes.c_ulong),
        ("size", ctypes.c_ulong),
        ("signature", ctypes.c_char_p),
    ]


# The Block ABI's literal, which every block starts with.
_LITERAL: list[tuple[str, Any]] = [
    ("isa", ctypes.c_void_p),
    ("flags", ctypes.c_int),
    ("reserved", ctypes.c_int),
    ("invoke", ctypes.c_void_p),
    ("descriptor", ctypes.POINTER(BlockDescriptor)),
]


class BlockLiteral(ctypes.Structure):
    _fields_ = [
        *_LITERAL,
        ("timeline", ctypes.c_void_p),
        ("value", ctypes.c_uint64),
        ("arg", ctypes.c_void_p),
        ("calls", ctypes.c_int),
        ("notify", ctypes.c_int),
        ("copy_dst", ctypes.c_void_p),
        ("copy_src", ctypes.c_void_p),
        ("copy_nbytes", ctypes.c_size_t),
        ("then", ctypes.c_void_p),
        ("then_value", ctypes.c_uint64),
        ("status_send", ctypes.c_void_p),
        ("status_selector", ctypes.c_void_p),
        ("gates", ctypes.c_void_p),
        ("ngates", ctypes.c_int),
        ("reserved3", ctypes.c_int),
        ("then_after", ctypes.c_uint64),
    ]


class Gate(ctypes.Structure):
    """A value of another timeline that a block's command buffer waited for (am_gate)."""

    _fields_ = [("timeline", ctypes.c_void_p), ("value", ctypes.c_uint64)]


_alive: dict[int, BlockLiteral] = {}  # address -> block: kept until it ran
_held: dict[int, object] = {}  # address -> what the block's command uses, kept as long
_gates: dict[int, Any] = {}  # address -> its gates (a Gate array, what keeps them)
# Native timelines dropped while a block yet to run raises them, and how each is freed.
_unfreed: list[tuple[int, Any]] = []
_lock = threading.RLock()  # (a collection inside it may free a timeline: free_timeline)


def global_block_isa(runtime: Any = None) -> int:
    """The address of ``_NSConcreteGlobalBlock`` in ``runtime``: by default libSystem
    (Apple's, or the one ``ASYNCMETAL_LIBSYSTEM`` names), else libBlocksRuntime."""
    if runtime is None:
        from ._objc import library_path

        runtime = ctypes.CDLL(library_path("system") or "libBlocksRuntime.so.0")
    return ctypes.addressof(ctypes.c_void_p.in_dll(runtime, "_NSConcreteGlobalBlock"))


def make_block(isa: int, signature: bytes, timeline: int, value: int = 0) -> BlockLiteral:
    """A global block that, when called, raises ``timeline`` (to ``value``, or to the
    value it is called with). Its memory is C memory with a static descriptor, freed by
    :func:`release_ran` once it has run -- never while Metal may still call it, and never
    at interpreter exit."""
    from ... import _native

    reached = {COMPLETED_SIGNATURE: 0, REACHED_SIGNATURE: 1}[signature]
    address = _native.runtime().am_block_new(isa, reached, timeline, value)
    if not address:
        raise NoHostMemoryError("am_block_new returned NULL: no memory for a completion handler")
    block = BlockLiteral.from_address(address)
    with _lock:
        _alive[address] = block
    return block


class CallbackBlock(ctypes.Structure):
    """A global block in Python memory whose invoke function is a ctypes callback: for a
    callee that calls it before returning and keeps nothing (the Metal compiler
    service), never for Metal's completion handlers or listeners."""

    _fields_ = _LITERAL


def callback_block(isa: int, invoke: Any, signature: bytes) -> CallbackBlock:
    """A global block calling ``invoke`` (a ctypes function whose first parameter is the
    block). The caller keeps the returned object -- it holds ``invoke`` and the
    descriptor too -- alive until the callee has returned."""
    descriptor = BlockDescriptor(0, ctypes.sizeof(CallbackBlock), signature)
    block = CallbackBlock(
        isa,
        BLOCK_IS_GLOBAL | BLOCK_HAS_SIGNATURE,
        0,
        ctypes.cast(invoke, ctypes.c_void_p).value,
        ctypes.pointer(descriptor),
    )
    block._keep = (invoke, descriptor)
    return block


def hold_until_run(block: BlockLiteral, obj: object, disarm: bool = False) -> None:
    """Keep ``obj`` (the host memory the block's command reads or writes; None: nothing)
    alive until the block has run, whatever else lets go of it (an abandoned queue);
    ``disarm``: and have it copy nothing to the host (its command is reported as never
    run). Nothing for a block freed already: it ran, and a release_ran let it go -- its
    memory may be another command's block by now."""
    address = ctypes.addressof(block)
    with _lock:
        if _alive.get(address) is not block:
            return
        if disarm:
            block.copy_nbytes = 0
        if obj is None:
            return
        _held[address] = obj
        _notify(block)
    _start_letting_go()


# What is kept until blocks have run (_held, _unfreed) is let go of once they ran by a
# thread of its own, which their running wakes (am_blocks_wait): else it would be only at
# the next reap of some queue, maybe never.
_NAP_NS = 1_000_000_000  # (and it looks again after this long, whatever)
_letting_go: threading.Thread | None = None
_starting = False  # the thread is being started (the lock let go of meanwhile)


def _forked() -> None:
    """In a forked child: a parent thread may have held the lock at the fork (a command
    made, a block run, a timeline dropped), or been starting the thread, which the child
    has not; a timeline of the parent's dropped in the child takes the lock too."""
    global _lock, _letting_go, _starting
    _lock = threading.RLock()
    _letting_go, _starting = None, False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _notify(block: BlockLiteral) -> None:
    """(Under the lock.) Have the thread let go of what ``block`` keeps once it ran: the
    holder of the lock starts it once it has let go of the lock (_start_letting_go)."""
    block.notify = 1


def _start_letting_go() -> None:
    """Start the thread if something is kept until blocks run and none is running. Never
    with the lock held: the GC may run finalizers on a new thread before Thread.start()
    returns to its starter, and a dropped timeline's (free_timeline) takes the lock.
    Inside a holder of the lock on this thread (a finalizer the GC ran there), left to
    that holder."""
    global _letting_go, _starting
    if _lock._is_owned():  # type: ignore[attr-defined]
        return
    again = True
    while again:
        with _lock:
            running = _letting_go is not None and _letting_go.is_alive()
            if _starting or running or not (_held or _unfreed):
                return
            _starting = True
        thread = None
        try:
            thread = threading.Thread(target=_let_go, name="asyncmetal-metal-blocks", daemon=True)
            thread.start()
        finally:
            # A KeyboardInterrupt as this waits for the lock (another thread holds it: a
            # command made, a block run; CPython runs the handler in the wait, and
            # nothing is taken) does not skip what follows: it waits again, and the
            # interrupt is raised once done -- skipped, ``_starting`` stayed set, and no
            # thread was started again: what blocks keep stayed until a reap, maybe never.
            interrupt: KeyboardInterrupt | None = None
            entered = False
            while not entered:
                try:
                    with _lock:  # (no call before the thread is recorded)
                        entered = True
                        _letting_go, _starting = thread, False
                        # Started, the thread may have found nothing kept and ended
                        # already, while another caller, seeing it starting, left
                        # something to it.
                        again = (
                            thread is not None and not thread.is_alive() and bool(_held or _unfreed)
                        )
                except KeyboardInterrupt as exc:
                    if entered:
                        raise
                    interrupt = exc
            if interrupt is not None:
                raise interrupt


def _let_go() -> None:
    from ... import _native

    lib = _native.runtime()
    seen = 0
    while True:
        release_ran()
        with _lock:
            if not _held and not _unfreed:
                global _letting_go
                _letting_go = None
                return
        seen = lib.am_blocks_wait(seen, _NAP_NS)


def set_gates(block: BlockLiteral, gates: list[tuple[int, int]], keep: object = None) -> None:
    """Have ``block`` raise its timeline only once each native timeline of ``gates``
    reached its value or failed (the values its command buffer waited for: the GPU goes
    on once their events get there, maybe before the handler of the command that signals
    one has said whether it failed). Those timelines are kept until it ran: a Metal
    timeline's through ``free_timeline``; another's (a cpu or npy queue's, freed as its
    object goes) by ``keep``, what holds their objects, kept as long."""
    array = (Gate * len(gates))(*(Gate(t, v) for t, v in gates))
    with _lock:
        _gates[ctypes.addressof(block)] = (array, keep)
    block.gates, block.ngates = ctypes.addressof(array), len(gates)


def release_ran() -> int:
    """Free every block that has run; returns how many are still kept."""
    from ... import _native

    let_go = []  # let go of once the lock is: a timeline's last reference among them
    with _lock:  # frees its native timeline through free_timeline, which takes the lock
        for address in [a for a, b in _alive.items() if b.calls]:
            del _alive[address]
            let_go.append(_held.pop(address, None))
            let_go.append(_gates.pop(address, None))
            _native.runtime().am_block_free(address)
        if _unfreed:
            _free_unreferenced()
        left = len(_alive)
    del let_go
    _start_letting_go()
    return left


def free_timeline(c_timeline: int, free: Any) -> None:
    """Free a native timeline nothing else refers to (``free(c_timeline)``): now, or once
    every block that raises it has run (a command buffer of an abandoned queue may run
    much later). Not during the interpreter's finalization: a daemon thread (this
    module's own, a queue's) stopped there may hold the lock for ever; what is left goes
    with the process."""
    if sys.is_finalizing():
        return
    with _lock:
        _unfreed.append((c_timeline, free))
        _free_unreferenced()
    _start_letting_go()


def _raised(address: int, block: BlockLiteral) -> tuple[int, ...]:
    gates = _gates.get(address)
    return (block.timeline, block.then, *(g.timeline for g in (gates[0] if gates else ())))


def _free_unreferenced() -> None:
    """(Under the lock.) Free the dropped timelines no block yet to run raises; have the
    blocks that raise the others let go of them once they ran."""
    raising = [(a, b) for a, b in _alive.items() if not b.calls]
    raised = {t for a, b in raising for t in _raised(a, b)}
    for entry in [e for e in _unfreed if e[0] not in raised]:
        if entry in _unfreed:  # (not freed by a call nested in this one, from the GC)
            _unfreed.remove(entry)
            entry[1](entry[0])
    if _unfreed:
        unfreed = {e[0] for e in _unfreed}
        for address, block in raising:
            if not block.notify and unfreed.intersection(_raised(address, block)):
                _notify(block)

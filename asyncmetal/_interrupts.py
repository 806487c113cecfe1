"""Ctrl-C while a device's close waits on the main thread of an asyncio (or uvloop) loop.

trio raises a Ctrl-C in its main task, where the close's wait sees it (``_device``'s
``_until_closed``). asyncio's runner does not: the first Ctrl-C cancels the main task
(which a close, shielded, waits through) and the second is raised wherever the main
thread is -- mostly in the loop's ``select``, where no task sees it -- after which the
runner cancels every task and waits for them, the close among them: a close waiting
for a backlog held the program for all of it, and a third Ctrl-C left the runner with
its tasks unfinished (and their worker threads, which join at exit, never stopped).

So while such a close waits, a Ctrl-C that would raise a KeyboardInterrupt (Python's
default handler, ``asyncio.Runner``'s) first switches it to discarding, then goes on to
that handler. Handlers a program installed itself are left alone (its Ctrl-C is its
own to handle), and so is every thread but the main one (signals reach only that).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import threading
from collections.abc import Callable, Generator
from types import FrameType
from typing import Any

_closes: dict[int, Callable[[], None]] = {}  # closes waiting now: id -> switch to discard
_previous: Any = None  # the handler ours runs after switching them


def _raises_interrupt(handler: Any) -> bool:
    """Whether ``handler`` turns a Ctrl-C into a KeyboardInterrupt (at once, or asyncio's
    runner on a later one)."""
    if handler is signal.default_int_handler:
        return True
    runner = getattr(asyncio, "Runner", None)  # (Python 3.11 on)
    return (
        runner is not None
        and isinstance(handler, functools.partial)
        and getattr(handler.func, "__func__", None) is runner._on_sigint
    )


def _passed_on(handler: Any) -> Any:
    """What ours passes a Ctrl-C on to, and puts back: ``handler``, but Python's default
    for none (a program that put ours back after the last close ended) and for an
    asyncio.Runner's whose run has ended -- found ours current as its run ended, the
    runner left its own in place, where it would have put the default back (and a
    later asyncio.run installs its own only over the default)."""
    if handler is None:
        return signal.default_int_handler
    if isinstance(handler, functools.partial) and _raises_interrupt(handler):
        task = handler.keywords.get("main_task")
        if task is not None and task.done():
            return signal.default_int_handler
    return handler


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _previous
    previous = _passed_on(_previous)
    if not _closes:
        # No close waits: ours was left installed (an interrupt as a close stopped
        # waiting, or a wait that ended off the main thread): it puts back what it
        # passes on to, so that a later asyncio.run finds the default and installs its own.
        _previous = None
        if signal.getsignal(signal.SIGINT) is _on_sigint:
            signal.signal(signal.SIGINT, previous)
    for interrupted in list(_closes.values()):
        interrupted()
    try:
        previous(signum, frame)
    except KeyboardInterrupt:
        # Raised, asyncio's runner behaves as the default handler from now on (it raises
        # at every later Ctrl-C), and its run may be left by this very interrupt without
        # putting the default back (ours is current): ours goes on as the default, and
        # puts the default back, not a handler of a runner that ended.
        if _closes:
            _previous = signal.default_int_handler
        raise


@contextlib.contextmanager
def ctrl_c_discards(interrupted: Callable[[], None]) -> Generator[None, None, None]:
    """While in it: a Ctrl-C calls ``interrupted`` before the handler that raises it
    (see the module's docstring; nothing changes where that handler is not one that
    raises, or off the main thread)."""
    global _previous
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    key = id(interrupted)
    installed = False
    try:
        current = signal.getsignal(signal.SIGINT)
        if current is _on_sigint or _raises_interrupt(current):
            # Registered before ours is installed, and inside the try: an interrupt at
            # signal.signal's return (where its handler runs: ours) is cleaned up below.
            installed = True
            _closes[key] = interrupted
            if current is not _on_sigint:
                _previous = current
                signal.signal(signal.SIGINT, _on_sigint)
        yield
    finally:
        if installed:
            _leave(key)


def _leave(key: int) -> None:
    """A close that ``ctrl_c_discards`` registered stops waiting: the last to, on the
    main thread, puts back the handler ours passes on to. It is taken off the list
    first: ours, run by an interrupt at a later call's return here (or at this one's),
    finds no close waiting and puts that handler back itself."""
    global _previous
    _closes.pop(key, None)
    # (Left installed where the wait ends off the main thread -- a coroutine dropped and
    # finalized elsewhere: with no close waiting it puts back the handler at a Ctrl-C.)
    if not _closes and threading.current_thread() is threading.main_thread():
        try:
            if signal.getsignal(signal.SIGINT) is _on_sigint:
                signal.signal(signal.SIGINT, _passed_on(_previous))
        finally:
            if not _closes:
                _previous = None  # (also where the program replaced ours meanwhile)


def until_uninterrupted(fn: Callable[..., object], *args: Any) -> KeyboardInterrupt | None:
    """``fn(*args)``, called again each time a KeyboardInterrupt ends it, until a call
    returns: the first such interrupt (for the caller to raise once done), or None.
    ``fn`` must be safe to call again wherever one lands (a Ctrl-C as a close runs at
    exit, on the main thread: raised at once, it would leave the rest undone). An
    error it raises is raised, but after an interrupt the interrupt is (the error its
    context): the interrupt before any error, as a close raises them.

    On the main thread with Python's default handler current (at exit: no loop's
    handler left), a Ctrl-C from then on is noted, not raised, and returned where no
    interrupt ended a call: raised, one as this goes round for another (the loop's
    end, outside the ``try``) would leave the rest undone. Others' handlers are left
    alone (trio's, asyncio.Runner's: a close's steps run on the main thread only at
    exit)."""
    interrupt: KeyboardInterrupt | None = None
    noted: list[KeyboardInterrupt] = []
    tried = installed = False

    def note(signum: int, frame: FrameType | None) -> None:
        noted.append(KeyboardInterrupt())

    try:
        while True:
            try:
                if not tried:
                    # Inside the try: one that lands here (the default handler still
                    # current) is as one in ``fn``, which then runs. Noted installed
                    # before it is: one at its return finds it put back below.
                    tried = True
                    if (
                        threading.get_ident() == threading.main_thread().ident
                        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
                    ):
                        installed = True
                        signal.signal(signal.SIGINT, note)
                fn(*args)
                break
            except KeyboardInterrupt as exc:
                interrupt = interrupt or exc
            except Exception:
                first = interrupt or (noted[0] if noted else None)
                if first is not None:
                    raise first  # noqa: B904 - the interrupt first, the error its context
                raise
    finally:
        # Put back until it was: signal.signal is a Python function, whose entry may take
        # an interrupt before it ran (the noting handler would then stay for good).
        while installed:
            try:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                installed = False
            except KeyboardInterrupt as exc:
                interrupt = interrupt or exc
    return interrupt or (noted[0] if noted else None)


def in_turn(steps: list[tuple[Any, ...]], errors: list[BaseException] | None = None) -> None:
    """Each of ``steps`` (a function and its arguments) called in turn, and taken off the
    list once it returned: called again after a KeyboardInterrupt (by
    ``until_uninterrupted``), this goes on from the step it landed in, or landed just
    after (which runs again), and skips none. An error a step raises is raised, or,
    ``errors`` given, put there, and the next step goes on."""
    while steps:
        fn, *args = steps[0]
        if errors is None:
            fn(*args)
        else:
            try:
                fn(*args)
            except Exception as exc:
                errors.append(exc)
        del steps[0]

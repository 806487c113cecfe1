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


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _previous
    for interrupted in list(_closes.values()):
        interrupted()
    previous = _previous
    try:
        previous(signum, frame)
    except KeyboardInterrupt:
        # Raised, asyncio's runner behaves as the default handler from now on (it raises
        # at every later Ctrl-C), and its run may be left by this very interrupt without
        # putting the default back (ours is current): ours goes on as the default, and
        # puts the default back, not a handler of a runner that ended.
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
    current = signal.getsignal(signal.SIGINT)
    installed = current is _on_sigint or _raises_interrupt(current)
    if installed:
        if current is not _on_sigint:
            _previous = current
            signal.signal(signal.SIGINT, _on_sigint)
        _closes[key] = interrupted
    try:
        yield
    finally:
        if installed:
            _closes.pop(key, None)
            # (Left installed where the wait ends off the main thread -- a coroutine
            # dropped and finalized elsewhere: with no close waiting it only passes on.)
            if threading.current_thread() is threading.main_thread() and not _closes:
                if signal.getsignal(signal.SIGINT) is _on_sigint:
                    signal.signal(signal.SIGINT, _previous)
                _previous = None  # (also where the program replaced ours meanwhile)

"""KeyboardInterrupts raised where CPython would deliver one, for tests."""

from __future__ import annotations

import contextlib
import inspect
import sys
import types
from collections.abc import Iterator
from typing import Any

_RESUMABLE = inspect.CO_COROUTINE | inspect.CO_GENERATOR | inspect.CO_ITERABLE_COROUTINE


@contextlib.contextmanager
def interrupted(codes: set[types.CodeType], at: int) -> Iterator[list[str]]:
    """A KeyboardInterrupt raised where CPython would raise one (it runs signal
    handlers after a call returns, attributed to the call, and at a function's entry)
    in a frame of ``codes``: at the ``at``-th of its calls' entries and returns,
    counted from 0 (the list given gets where then: "caller event callee", as in
    "_try_alloc return _allocate" or "_evict c_return popitem"). Loops' ends, where
    CPython also runs them, are not counted. A coroutine's or a generator's own
    entries and returns (each resumption and suspension, inside the loop's scheduling
    for one awaited, where CPython runs no handler) are not counted either: its code
    is interrupted where it calls."""
    raised: list[str] = []
    seen = [0]

    def profile(frame: types.FrameType, event: str, arg: object) -> None:
        caller = frame if event.startswith("c_") else frame.f_back
        calls = event in ("call", "return", "c_return")
        if not event.startswith("c_") and frame.f_code.co_flags & _RESUMABLE:
            return
        if calls and caller is not None and caller.f_code in codes and not raised:
            seen[0] += 1
            if seen[0] > at:
                callee = frame.f_code.co_name if not event.startswith("c_") else arg
                name = getattr(callee, "__name__", callee)
                raised.append(f"{caller.f_code.co_name} {event} {name}")
                raise KeyboardInterrupt

    def unraisable(info: Any) -> None:
        # One raised in a finalizer (a collected buffer's) is reported, not raised, as
        # CPython does with any: its report is this helper's own, not a failure.
        if not isinstance(info.exc_value, KeyboardInterrupt):
            hook(info)

    hook = sys.unraisablehook
    sys.unraisablehook = unraisable
    sys.setprofile(profile)
    try:
        yield raised
    finally:
        sys.setprofile(None)
        sys.unraisablehook = hook

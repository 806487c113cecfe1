"""KeyboardInterrupts raised where CPython would deliver one, for tests."""

from __future__ import annotations

import contextlib
import inspect
import sys
import types
from collections.abc import Iterator


@contextlib.contextmanager
def interrupted(codes: set[types.CodeType], at: int) -> Iterator[list[str]]:
    """A KeyboardInterrupt raised where CPython would raise one (it runs signal
    handlers after a call returns, attributed to the call, and at a function's entry)
    in a frame of ``codes``: at the ``at``-th of its calls' entries and returns,
    counted from 0 (the list given gets where then: "caller event callee", as in
    "_try_alloc return _allocate" or "_evict c_return popitem"). These frames have no
    loops. A
    coroutine's own entries and returns (each resumption and suspension, inside the
    loop's scheduling) are not counted: a coroutine's code is interrupted where it
    calls."""
    raised: list[str] = []
    seen = [0]

    def profile(frame: types.FrameType, event: str, arg: object) -> None:
        caller = frame if event.startswith("c_") else frame.f_back
        calls = event in ("call", "return", "c_return")
        if not event.startswith("c_") and frame.f_code.co_flags & inspect.CO_COROUTINE:
            return
        if calls and caller is not None and caller.f_code in codes and not raised:
            seen[0] += 1
            if seen[0] > at:
                callee = frame.f_code.co_name if not event.startswith("c_") else arg
                name = getattr(callee, "__name__", callee)
                raised.append(f"{caller.f_code.co_name} {event} {name}")
                raise KeyboardInterrupt

    sys.setprofile(profile)
    try:
        yield raised
    finally:
        sys.setprofile(None)

"""KeyboardInterrupts raised where CPython would deliver one, for tests."""

from __future__ import annotations

import contextlib
import gc
import inspect
import sys
import threading
import types
from collections.abc import Callable, Iterator
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


class InterruptedWait:
    """A lock (a device's submission lock, an allocator's, a Condition) whose ``at``-th blocking
    acquire on this thread (counted from 0) is interrupted: KeyboardInterrupt raised,
    nothing taken -- what CPython does where Ctrl-C comes as the main thread waits for a
    lock another thread holds (a submission of another loop's): it runs the handler
    inside the wait."""

    def __init__(self, lock: Any, at: int, *more: int) -> None:
        self.lock = lock
        self.at = {at, *more}  # (more: further waits interrupted, as repeated Ctrl-Cs)
        self.waits = 0
        self.raised = False
        self._thread = threading.get_ident()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if blocking and threading.get_ident() == self._thread:
            self.waits += 1
            if self.waits - 1 in self.at:
                self.raised = True
                raise KeyboardInterrupt
        return bool(self.lock.acquire(blocking, timeout))

    def release(self) -> None:
        self.lock.release()

    def _is_owned(self) -> bool:
        return bool(self.lock._is_owned())

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lock, name)  # (a Condition's notify_all, wait)


async def native_closes(
    monkeypatch: Any, device_name: str, natives: type | None = None
) -> list[object]:
    """The list that native queues of ``device_name``'s backend (or of type
    ``natives``) append themselves to once their close ran."""
    import asyncmetal as am

    if natives is None:
        async with am.open_device(device_name) as device:
            natives = type(device.queue._native)
    closed: list[object] = []
    close = natives.close

    def closing(self: Any, abandon: bool = False) -> None:
        close(self, abandon)
        closed.append(self)

    monkeypatch.setattr(natives, "close", closing)
    return closed


async def check_queue_making_interrupted(
    monkeypatch: Any,
    device_name: str,
    hook: str,
    natives: type,
    make: Callable[[Any], Any],
) -> int:
    """Interrupt ``make(device)`` -- a call of ``Device.<hook's maker>`` that makes a
    Queue through the backend's ``hook`` (``new_queue``, ``adopt_queue``) -- at each
    call entry and return of that maker (and of what it records the queue with) and
    ``Queue.__init__`` in turn, on a fresh
    device of ``device_name`` each time, until one is not interrupted. Each time the
    interrupt either came after the caller got the queue, or left nothing of it: every
    native queue (of type ``natives``) the backend made is released by the device's
    close at the latest -- except where the interrupt came as the backend's hook
    returned it into ``Queue.__init__`` (nothing in Python stores it yet). Where
    interrupted, the same call made again works. Returns how many places were
    interrupted."""
    import anyio

    import asyncmetal as am

    made: list[object] = []
    async with am.open_device(device_name) as device:
        backend = type(device._backend)
    backend_make = getattr(backend, hook)

    def making(self: Any, *args: Any) -> Any:
        native = backend_make(self, *args)
        made.append(native)
        return native

    monkeypatch.setattr(backend, hook, making)
    closed = await native_closes(monkeypatch, device_name, natives)
    maker = am.Device.new_queue if hook == "new_queue" else am.Device.adopt_stream
    # (with what it records the queue by: the same steps for both makers)
    recording = (am.Device._make_queue, am.Device._record, am.Device._recorded)
    codes = {maker.__code__, am.Queue.__init__.__code__, *(f.__code__ for f in recording)}
    at = 0
    while True:
        device = await am.open_device(device_name)
        handed: list[Any] = []
        gc.collect()  # (none runs a finalizer meanwhile: its interrupt would be reported)
        gc.disable()
        try:
            with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
                handed.append(make(device))
        finally:
            gc.enable()
        if raised and raised[0] == "__init__ return making":  # (the hook, as wrapped)
            made.clear()  # (nothing in Python holds it yet: lost)
        assert bool(handed) != bool(raised), raised
        if raised:  # made again, whole
            with anyio.fail_after(20):
                await make(device).marker()
        handed.clear()
        with anyio.fail_after(20):
            await device.close()
        unreleased = [native for native in made if not any(native is c for c in closed)]
        assert not unreleased, f"interrupted at {raised}"
        made.clear()
        closed.clear()
        if not raised:
            return at
        at += 1

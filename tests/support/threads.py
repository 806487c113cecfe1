"""Threads the tests use to stand for another thread's work."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import asyncmetal as am


@contextlib.contextmanager
def submission_lock_held(device: am.Device) -> Iterator[threading.Event]:
    """Another thread holds ``device``'s submission lock (a submission under way there)
    until the block ends or the event it gives is set."""
    held, let_go = threading.Event(), threading.Event()

    def submitting() -> None:
        with device._state.submitting:
            held.set()
            let_go.wait(10)

    thread = threading.Thread(target=submitting, name="test submitting")
    threading.Thread.start(thread)
    held.wait(10)
    try:
        yield let_go
    finally:
        let_go.set()
        thread.join()


class Contended:
    """A lock standing in for another (``inner``, one of ``_timeline``'s, say) that sets
    ``contended`` when a thread had to wait for it."""

    def __init__(self, inner: Any, contended: threading.Event) -> None:
        self._inner = inner
        self._contended = contended

    def __enter__(self) -> bool:
        if not self._inner.acquire(blocking=False):
            self._contended.set()
            self._inner.acquire()
        return True

    def __exit__(self, *exc: object) -> None:
        self._inner.release()

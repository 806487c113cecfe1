"""Threads the tests use to stand for another thread's work."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio

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


async def closed_while_making(
    device: am.Device,
    make: Callable[[], object],
    making: threading.Event,
    made: threading.Event,
    sealed: Callable[[], None] = lambda: None,
) -> object:
    """Close ``device`` while ``make()`` runs on another thread, held where it makes a
    queue (``making`` set once it is there; it goes on once ``made`` is): the device
    is sealed first, then ``sealed()`` is called, then the making goes on, and the
    close is awaited. What ``make`` returned, or the ClosedResourceError it raised."""
    got: list[object] = []

    def maker() -> None:
        try:
            got.append(make())
        except am.ClosedResourceError as exc:
            got.append(exc)

    thread = threading.Thread(target=maker, name="test making")
    thread.start()
    try:
        assert making.wait(10)
        async with anyio.create_task_group() as tg:
            tg.start_soon(device.close)
            with anyio.fail_after(10):
                while not device.closed:  # sealed, the making under way
                    await anyio.sleep(0.01)
            sealed()
            made.set()
    finally:
        made.set()
        thread.join()
    return got[0]


def submitted_while_making(
    makers: list[Callable[[], Any]], making: Any, made: Any, submit: Callable[[], object]
) -> tuple[float, list[Any]]:
    """How long ``submit()`` took while each of ``makers`` ran on a thread of its own,
    held in its queue's making (``making`` released once each is there; ``made`` set
    once ``submit`` returned lets them go on); and what each returned."""
    got: list[Any] = []
    threads = [threading.Thread(target=lambda m=m: got.append(m())) for m in makers]
    for thread in threads:
        thread.start()
    try:
        for _ in threads:
            assert making.acquire(timeout=10)
        start = time.perf_counter()
        submit()
        took = time.perf_counter() - start
    finally:
        made.set()
        for thread in threads:
            thread.join()
    return took, got

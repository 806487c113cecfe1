"""A cuda queue's native handle against a close on another thread, without a GPU.

A DLPack or ``__cuda_array_interface__`` export asks the queues that last wrote the
buffer to order the consumer's stream (``order_stream``) or to hand what they hold over
to the driver (``hand_over``), on whatever thread the consumer calls from; the queue's
close, on another thread, frees the native queue. Each such call must be made with the
queue kept open, and none after it closed.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref
from typing import Any

import pytest

from asyncmetal._timeline import QUEUE_DISCARDED
from asyncmetal.backends.cuda._queue import CUDAQueue
from tests.support.interrupts import InterruptedWait


class _Lib:
    """The native queue's calls these paths make, one of them held until released."""

    def __init__(self) -> None:
        self.freed = False
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls: list[str] = []

    def _call(self, name: str, handle: int) -> int:
        assert handle == 1234 and not self.freed, f"{name} on a freed queue"
        self.entered.set()
        self.release.wait(10)
        assert not self.freed, f"the queue was freed during {name}"
        self.calls.append(name)
        return 0

    def am_cuq_hand_over(self, handle: int, value: int) -> int:
        return self._call("hand_over", handle)

    def am_cuq_wait_foreign(self, handle: int, *args: Any) -> int:
        return self._call("wait_foreign", handle)

    def am_cuq_error(self, handle: int, first: Any) -> int:
        return 0

    def am_cuq_close(self, handle: int, abandon: int) -> None:
        self.freed = True

    def am_cuq_discard(self, handle: int) -> None:
        assert not self.freed, "a discard on a freed queue"
        self.calls.append("discard")


class _Keep:
    def clear(self) -> None:
        pass


def _queue(lib: _Lib) -> CUDAQueue:
    queue = object.__new__(CUDAQueue)
    queue._closing_lock = threading.Lock()
    queue._closing = threading.Condition(queue._closing_lock)
    queue._close_lock = threading.Lock()
    queue._left = []  # (what a close has left to do)
    queue._native_left = queue._stream_left = None
    queue._exporting = 0
    queue._q = 1234
    queue._release_dropped = weakref.finalize(queue, lib.am_cuq_close, 1234, 1)  # (as made)
    queue._lib = lib
    queue._staging = None
    queue.adopted = True
    queue._keep = _Keep()  # type: ignore[assignment]
    queue._discarded = None
    queue._sticky = (0, 0)
    queue._error = ctypes.c_int(0)
    queue._notes = ctypes.c_int(0)  # (no thread's context left unrestored)
    return queue


@pytest.mark.parametrize("call", ["hand_over", "order_stream"])
def test_a_close_on_another_thread_waits_for_an_exports_call(call: str) -> None:
    lib = _Lib()
    queue = _queue(lib)

    def export() -> None:
        if call == "hand_over":
            queue.hand_over(5)
        else:
            queue.order_stream(0, 99, 5)

    exporting = threading.Thread(target=export)
    exporting.start()
    assert lib.entered.wait(10)
    discarding = threading.Thread(
        target=queue.discard, args=(QUEUE_DISCARDED,)
    )  # (as a loop's close(discard=True))
    discarding.start()
    discarding.join(5)
    assert not discarding.is_alive() and lib.calls == ["discard"]  # (it did not wait)
    closing = threading.Thread(target=queue.close)
    closing.start()
    closing.join(0.2)
    assert closing.is_alive() and not lib.freed  # (the close waits for the call)
    lib.release.set()
    exporting.join(10)
    closing.join(10)
    assert lib.freed and lib.calls == [
        "discard",
        "hand_over" if call == "hand_over" else "wait_foreign",
    ]
    export()  # closed: nothing to order, and no call on the freed queue
    queue.discard(QUEUE_DISCARDED)
    assert len(lib.calls) == 2


@pytest.mark.parametrize("call", ["hand_over", "order_stream"])
def test_a_keyboard_interrupt_in_a_wait_for_the_lock_as_an_export_calls_leaves_it_closable(
    call: str,
) -> None:
    """A KeyboardInterrupt in each of an export's waits for the queue's lock in turn (as
    Ctrl-C comes while a close or a discard on another thread holds it) leaves no call
    counted as under way: the queue's close, which waits until none is, ends. Checked:
    fails without the fix (the wait that counts the call out, interrupted, left it
    counted: the close waited for good)."""
    at = 0
    while True:
        lib = _Lib()
        lib.release.set()  # (the call returns at once)
        queue = _queue(lib)
        lock = InterruptedWait(queue._closing, at)
        queue._closing = lock
        try:
            with contextlib.suppress(KeyboardInterrupt):
                if call == "hand_over":
                    queue.hand_over(5)
                else:
                    queue.order_stream(0, 99, 5)
        finally:
            queue._closing = lock.lock
        left = queue._exporting
        queue._exporting = 0  # (the close ends whatever was left)
        closing = threading.Thread(target=queue.close, daemon=True)
        closing.start()
        closing.join(10)
        assert not closing.is_alive() and lib.freed
        assert not left, f"the wait for the lock numbered {at} interrupted left a call counted"
        if not lock.raised:
            break
        at += 1
    assert at >= 2


class _Freed(_Lib):
    """A native queue of real memory whose first member is its error (read in place, as
    am_cuq's); its close writes there what a freed allocation's first bytes hold (the
    allocator's own link: seldom 0)."""

    LINK = 0x5A5A5A5A

    def __init__(self, error: int) -> None:
        super().__init__()
        self.memory = ctypes.c_int(error)
        self.handle = ctypes.addressof(self.memory)

    def am_cuq_error(self, handle: int, first: Any) -> int:
        assert handle == self.handle and not self.freed, "the error asked of a freed queue"
        first._obj.value = 3
        return self.memory.value

    def am_cuq_close(self, handle: int, abandon: int) -> None:
        self.freed = True
        self.memory.value = self.LINK


class _Probe:
    """A staging whose close (a step of the queue's close after its native close) reads
    the queue's error as another thread may then."""

    def __init__(self, queue: CUDAQueue) -> None:
        self.queue = queue
        self.seen: list[tuple[int, bool]] = []

    def close(self, dropped: bool, freed: bool) -> None:
        self.seen.append((self.queue._error.value, self.queue.fails_later()))


@pytest.mark.parametrize("error", [0, 700])
def test_a_closing_queue_s_error_is_never_read_from_its_freed_native_queue(error: int) -> None:
    """Between the native close (which frees am_cuq) and the end of the queue's close,
    its error -- read in place with no lock, by failure() and fails_later() on any
    thread -- is the one kept at the close's take, not what the freed memory holds.
    Checked failing before (the error kept only in a step after the staging's close):
    'assert [(1515870810, False)] == [(0, False)]' (the freed memory's link read)."""
    lib = _Freed(error)
    queue = _queue(lib)  # type: ignore[arg-type]
    queue._q = lib.handle
    queue._release_dropped = weakref.finalize(queue, lambda: None)
    queue._error = ctypes.c_int.from_address(lib.handle)  # (as made: am_cuq's first member)
    queue._failed_from = ctypes.c_uint64(0)
    probe = _Probe(queue)
    queue._staging = probe  # type: ignore[assignment]
    queue.close()
    assert lib.freed
    assert probe.seen == [(error, False)]
    assert queue._error.value == error and queue._first_error() == (error, 3)


class _Contended:
    """A lock (as _closing_lock is used: with, acquire, release) that notes a thread
    finding it held."""

    def __init__(self, contended: threading.Event) -> None:
        self._lock = threading.Lock()
        self._contended = contended

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(False):
            return True
        self._contended.set()
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class _Failed(_Lib):
    """A failed queue's native calls: the first read of its error or its stats (by the
    reader thread) held until released."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def _read(self, name: str, handle: object) -> None:
        if threading.current_thread().name == "reader" and not self.entered.is_set():
            assert handle == 1234 and not self.freed, f"{name} on a freed queue"
            self.entered.set()
            self.release.wait(10)
        assert handle == 1234 and not self.freed, f"{name} read from a freed queue"
        self.reads.append(name)

    def am_cuq_error(self, handle: int, first: Any) -> int:
        self._read("error", handle)
        first._obj.value = 3
        return 700

    def am_cuq_stats(self, handle: int, out: Any) -> None:
        self._read("stats", handle)
        out[0] = 5


@pytest.mark.parametrize("read", ["fails_later", "failure", "stats"])
def test_a_failed_queue_s_error_read_on_one_thread_as_another_closes_it(read: str) -> None:
    """failure() and fails_later() of a failed queue read its error from the native
    queue on a loop's thread (an await of a completion), stats() on any, while a close
    on another thread frees it: the read holds the close's take off until it returned.
    Checked failing before (the handle read with no lock, the close free to free it
    meanwhile): 'AssertionError: error read from a freed queue' (stats likewise)."""
    lib = _Failed()
    queue = _queue(lib)  # type: ignore[arg-type]
    contended = threading.Event()
    queue._closing_lock = _Contended(contended)  # type: ignore[assignment]
    queue._closing = threading.Condition(queue._closing_lock)  # type: ignore[arg-type]
    queue._error = ctypes.c_int(700)
    queue._failed_from = ctypes.c_uint64(3)
    queue._backend = type("B", (), {"name": "cuda:0"})()
    got: list[object] = []

    def reader() -> None:
        try:
            if read == "stats":
                got.append(queue.stats()["queries"])
            elif read == "failure":
                got.append(type(queue.failure(4)).__name__)
            else:
                got.append(queue.fails_later())
        except BaseException as exc:
            got.append(exc)

    thread = threading.Thread(target=reader, name="reader")
    thread.start()
    assert lib.entered.wait(10)
    ended = threading.Event()

    def close() -> None:
        try:
            queue.close()
        finally:
            ended.set()
            contended.set()

    closer = threading.Thread(target=close)
    closer.start()
    assert contended.wait(10)  # (the close ended, or waits for the read)
    lib.release.set()
    thread.join(10)
    closer.join(10)
    assert ended.is_set() and lib.freed
    expected = {"stats": 5, "failure": "AsyncMetalError", "fails_later": False}[read]
    assert got == [expected]
    assert queue._first_error() == (700, 3)

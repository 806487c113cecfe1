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

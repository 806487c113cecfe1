"""Queues in a known state, for tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import asyncmetal as am
from asyncmetal.backends.cpu import CPUBackend, CPUQueue


def held_queue(device: am.Device) -> tuple[am.Queue, am.Timeline]:
    """A new queue of ``device`` held behind a device wait on a new timeline: what is
    submitted to it runs once the timeline is signalled to 1."""
    tl = device.timeline()
    q = device.new_queue()
    q.wait(tl, 1)
    return q, tl


def record_native_closes(
    monkeypatch: pytest.MonkeyPatch, name: Callable[[CPUQueue], object]
) -> list[object]:
    """The list that cpu queues' native closes append ``name(queue)`` to, once closed,
    and cpu backends' closes "backend" to, before closing."""
    events: list[object] = []
    close_queue, close_backend = CPUQueue.close, CPUBackend.close

    def queue_closed(self: CPUQueue, abandon: bool = False) -> None:
        close_queue(self, abandon)
        events.append(name(self))

    def backend_closing(self: CPUBackend) -> None:
        events.append("backend")
        close_backend(self)

    monkeypatch.setattr(CPUQueue, "close", queue_closed)
    monkeypatch.setattr(CPUBackend, "close", backend_closing)
    return events

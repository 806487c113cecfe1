"""Queues in a known state, for tests."""

from __future__ import annotations

import asyncmetal as am


def held_queue(device: am.Device) -> tuple[am.Queue, am.Timeline]:
    """A new queue of ``device`` held behind a device wait on a new timeline: what is
    submitted to it runs once the timeline is signalled to 1."""
    tl = device.timeline()
    q = device.new_queue()
    q.wait(tl, 1)
    return q, tl

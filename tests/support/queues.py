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


async def discard_outcomes(done: list[am.Completion]) -> list[bool]:
    """Whether each command ran (its await returned) or was dropped by a close with
    discard=True (it raised ClosedResourceError saying so); anything else fails."""
    ran = []
    for completion in done:
        error: am.ClosedResourceError | None = None
        try:
            await completion
        except am.ClosedResourceError as exc:
            error = exc
        assert error is None or "discard" in str(error), error
        ran.append(error is None)
    return ran

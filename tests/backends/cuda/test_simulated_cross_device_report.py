"""A device's close past a wait of its queue on a failed cuda queue of another device
that reported commands failed before its stream got to them (the report of d4c16e1),
over the simulated driver with two GPUs, in child processes
(tests/support/native/simulated_cross_device.py, whose docstring gives the scenario).

A close counts a wait on a queue of an open device from where that queue's stream got
(``_queue.completable``: every open device's queues, ``stream_reached``); a queue of a
device closed already is counted by its timeline, which then says as much (its native
queue closed, ``reached`` has nothing more to say). Either way the waiting queue's
wait is never made on the device: held on the host until the failed queue's command
reaches its stream, it fails with the report (or, made after it, at once), and fails
its queue from there on, which settles. So neither close waits for it, whichever
device closes first."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.support.native import harness, simulated_cross_device

LOOPS = ["asyncio", "trio"]
DID_NOT_RUN = "ClosedResourceError: this command did not run"


@functools.cache
def _seen(scenario: str, loop: str) -> Any:
    missing = harness.sanitizer_missing("")
    if missing is not None:
        pytest.skip(missing)
    return simulated_cross_device.run(scenario, loop)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("scenario", sorted(simulated_cross_device.SCENARIOS))
def test_devices_close_past_a_wait_on_another_devices_queue_that_reported_failed(
    loop: str, scenario: str
) -> None:
    seen = _seen(scenario, loop)
    assert seen["close0"] == seen["close1"] == "closed", seen
    # The report stood: the timeline raised past the stream, which stopped before it.
    assert seen["reached"] == 1 and seen["timeline"] >= seen["behind"] > 1, seen
    assert seen["limits"] == [1], seen  # (both open: counted from where it got)
    for name in ("wait", "marker"):
        assert seen[name].removeprefix("refused: ").startswith(DID_NOT_RUN), seen

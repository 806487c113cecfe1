"""A device's close counting a wait of its queue on a failed cuda queue of another
device, whose timeline that queue raised through commands it reported failed before its
stream got there -- over the simulated driver with two GPUs (simulated_cuda.py: the real
native runtime), in a child process: ``python -m
tests.support.native.simulated_cross_device SCENARIO LOOP`` prints what SCENARIO saw, as
JSON, on its last line (``run`` runs it, and reads that).

Each scenario: on cuda:0, queue ``waiting`` fails behind a device wait for a command of
queue ``discarded`` (closed with discard=True), and reports at once its signal of 5 of
``shared`` and a marker ("after"), held on the host behind queue ``other``'s signal of
3, which waits for ``gate`` and then, on the device, for ``never`` (nothing signals it
again); the gate is raised, and the held commands go to the stream, which never gets
past the lower signal. A queue of cuda:1 waits for "after" (``early``: before the
failure, so held on the host until it was reported; else after the gate), then has a
marker. Then both devices close: cuda:0 first (``*0``: the waiting queue's close then
counts the failed queue off the open devices, by its timeline) or cuda:1 first.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from tests.support.native.simulated_cuda import Seen, _install, _Simulated, run_child
from tests.support.native.simulated_failed_report import (
    SETTLE_S,
    _close_watched,
    _failing_behind,
    _reached,
    _try,
)

GPUS = 2


def _limits(*queues: Any) -> list[int]:
    """How far a close would count each of ``queues`` can get (every open device's)."""
    from asyncmetal._device import _completable

    limits = _completable()
    return [limits.get(q, -1) for q in queues]


def _submit(seen: Seen, waiter: Any, timeline: Any, value: int) -> dict[str, Any]:
    """``waiter`` waits on the device for ``value`` of ``timeline``, then has a marker:
    those submitted, by name; one refused at submission (the queue failed already, by
    the wait) is in ``seen``, "refused: " and its error."""
    from tests.support.native.simulated_cuda import _error

    made: dict[str, Any] = {}
    try:
        made["wait"] = waiter.wait(timeline, value)
        made["marker"] = waiter.marker()
    except Exception as exc:
        seen["marker" if made else "wait"] = f"refused: {_error(exc)}"
    return made


async def _waited_from_another_device(sim: _Simulated, early: bool, first: int) -> Seen:
    import asyncmetal as am

    seen: Seen = {}
    dev, dev1 = await am.open_device("cuda:0"), await am.open_device("cuda:1")
    never = dev.timeline()
    never.signal(1)  # (a host timeline then: a wait for 2 goes to the driver at once)
    waiting, discarded, _, gate, _, _, _, behind = _failing_behind(dev, 3, 5, (None, 2), (never, 2))
    after = waiting.marker()
    waiter = dev1.new_queue()
    if early:
        made = _submit(seen, waiter, waiting.timeline, after.value)
    await discarded.close(discard=True)
    await _try(seen, "after", after)
    gate.signal(2)
    until = time.monotonic() + SETTLE_S
    while waiting._native.stats()["held_now"] and time.monotonic() < until:
        await anyio.sleep(0.001)
    if not early:
        made = _submit(seen, waiter, waiting.timeline, after.value)
    seen["reached"] = _reached(waiting)  # (how far its stream got: before "behind")
    seen["timeline"] = waiting.timeline.value
    seen["behind"] = behind.value
    seen["limits"] = _limits(waiting)
    closes = [("close0", dev), ("close1", dev1)]
    for key, device in closes if first == 0 else closes[::-1]:
        await _close_watched(seen, key, device.close)
    for name, done in made.items():
        await _try(seen, name, done)
    return seen


SCENARIOS = {
    f"{when}{first}": lambda sim, early=when == "early", first=first: _waited_from_another_device(
        sim, early, first
    )
    for when in ("early", "late")
    for first in (0, 1)
}


def run(scenario: str, loop: str, timeout: float = 60) -> Seen:
    """What ``scenario`` saw in a child process, on event loop ``loop``."""
    return run_child(scenario, loop, timeout=timeout, module=__name__)


if __name__ == "__main__":
    scenario, loop = sys.argv[1:3]
    with tempfile.TemporaryDirectory(prefix="asyncmetal-simcuda-") as tmp:
        sim = _Simulated(Path(tmp))
        _install(sim, GPUS)
        seen: Any = anyio.run(SCENARIOS[scenario], sim, backend=loop)
    print(json.dumps(seen))

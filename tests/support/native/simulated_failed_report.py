"""A failed cuda queue's report over the simulated driver (simulated_cuda.py: the real
native runtime, streams of tests/support/fakes/fake_cuda_driver.c), in a child process:
``python -m tests.support.native.simulated_failed_report SCENARIO LOOP`` prints what
SCENARIO saw, as JSON, on its last line (``run`` runs it, and reads that).

- ``gated``: a queue's device wait that fails, followed on that queue by a signal
  ordered after another queue's lower signal of the same timeline, which is held
  behind a gate the program raises only after it awaited the failed wait.
"""

from __future__ import annotations

from typing import Any

import anyio

from tests.support.native.simulated_cuda import (
    Seen,
    _awaited,
    _error,
    _Simulated,
    child_main,
    run_child,
)

REPORT_S = 5  # the failed wait is reported within this, or it waits for the gate


async def gated(am: Any, dev: Any) -> Seen:
    """On ``dev`` (any backend): queue ``waiting`` waits on the device for a command of
    queue ``discarded``, which is then closed with ``discard=True`` (the wait fails:
    "doomed"), and signals ``shared`` to 2 behind it ("behind"); queue ``other`` signals
    ``shared`` to 1 ("lower") behind a wait for ``gate``, which is signalled only once
    "doomed" was awaited (at most REPORT_S). How each ended, and whether "doomed" ended
    before the gate was raised."""
    seen: Seen = {}
    waiting, discarded, other = dev.new_queue(), dev.new_queue(), dev.new_queue()
    gate, shared = dev.timeline(), dev.timeline()
    discarded.wait(gate, 1)
    doomed = waiting.wait(discarded.timeline, 1)
    other.wait(gate, 2)
    lower = other.signal(shared, 1)
    behind = waiting.signal(shared, 2)
    await discarded.close(discard=True)
    seen["doomed"] = "still waiting"
    with anyio.move_on_after(REPORT_S):
        seen["doomed"] = await _awaited(doomed)
    late = dev.new_queue()  # (a wait for the failed value, once it was reported)
    late.wait(waiting.timeline, doomed.value)
    seen["late"] = "still waiting"
    with anyio.move_on_after(REPORT_S):
        try:  # (a queue whose failure settled it refuses the submission, with it)
            marker = late.marker()
        except Exception as exc:
            seen["late"] = _error(exc)
        else:
            seen["late"] = await _awaited(marker)
    gate.signal(2)  # (only now, as the program does: after the await of the failed wait)
    for name, done in {"lower": lower, "behind": behind}.items():
        seen[name] = "still waiting"
        with anyio.move_on_after(REPORT_S):
            seen[name] = await _awaited(done)
    return seen


async def _gated(sim: _Simulated) -> Seen:
    import asyncmetal as am

    dev = await am.open_device("cuda:0")
    try:
        return await gated(am, dev)
    finally:
        with anyio.fail_after(20):
            await dev.close()


SCENARIOS = {"gated": _gated}


def run(scenario: str, loop: str, timeout: float = 60) -> Seen:
    """What ``scenario`` saw in a child process, on event loop ``loop`` (``timeout``: the
    child's, in seconds)."""
    return run_child(scenario, loop, timeout=timeout, module=__name__)


if __name__ == "__main__":
    child_main(SCENARIOS)

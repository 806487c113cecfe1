"""A cuda queue's own lifecycle over the simulated driver (simulated_cuda.py: the real
native runtime, streams of tests/support/fakes/fake_cuda_driver.c), in a child process:
``python -m tests.support.native.simulated_lifecycle SCENARIO LOOP`` prints what
SCENARIO saw, as JSON, on its last line (``simulated_cuda.run_child`` runs it).

- ``closes``: one native queue closed by several threads at once while its stream waits
  on the device for a value only the host signals.
"""

from __future__ import annotations

import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import anyio

from tests.support.native.simulated_cuda import ROOT, Seen, _awaited, _install, _Simulated

GATE_S = 0.3  # how long the closes are left waiting before the value is signalled


async def _closes(sim: _Simulated) -> Seen:
    """A queue whose stream waits, on the device, for a timeline value only the host
    signals, a marker behind the wait: its native queue closed plainly on one thread
    and, once that close is inside the runtime's, plainly on a second and abandoning on
    a third. Which closes had returned before the value was signalled, and after."""
    import asyncmetal as am
    from asyncmetal._queue import native_queue

    seen: Seen = {}
    dev = await am.open_device("cuda:0")
    try:
        held, gate = dev.new_queue(), dev.timeline()
        gate.signal(1)  # (only ever signalled by the host: its waits go to the driver at once)
        held.wait(gate, 2)
        done = held.marker()
        native: Any = native_queue(held)
        closed: list[str] = []

        def close(who: str, abandon: bool) -> None:
            native.close(abandon)
            closed.append(who)

        first = threading.Thread(target=close, args=("first", False), daemon=True)
        first.start()
        with anyio.fail_after(10):
            while native._q is not None:  # (taken: inside its native close)
                await anyio.sleep(0.001)
        threads = [first] + [
            threading.Thread(target=close, args=args, daemon=True)
            for args in (("second", False), ("abandoning", True))
        ]
        for thread in threads[1:]:
            thread.start()
        await anyio.sleep(GATE_S)
        seen["before"] = sorted(closed)
        gate.signal(2)
        with anyio.move_on_after(20):
            while any(thread.is_alive() for thread in threads):
                await anyio.sleep(0.001)
        seen["after"] = sorted(closed)
        seen["marker"] = await _awaited(done)
    finally:
        with anyio.fail_after(20):
            await dev.close()
    return seen


SCENARIOS = {"closes": _closes}


def run(scenario: str, loop: str, timeout: float = 120) -> Seen:
    """What ``scenario`` saw in a child process, on event loop ``loop``."""
    import json
    import subprocess

    child = subprocess.run(
        [sys.executable, "-m", __name__, scenario, loop],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-6000:] + child.stdout[-2000:]
    seen: Seen = json.loads(child.stdout.splitlines()[-1])
    return seen


def main(scenario: str, loop: str) -> None:
    import json

    with tempfile.TemporaryDirectory(prefix="asyncmetal-simcuda-") as tmp:
        sim = _Simulated(Path(tmp))
        _install(sim)
        seen = anyio.run(SCENARIOS[scenario], sim, backend=loop)
    print(json.dumps(seen))


if __name__ == "__main__":
    main(*sys.argv[1:])

"""What the fault-injection sweeps (tests/reliability/test_fault_sweep_*.py) share."""

from __future__ import annotations

import threading

from asyncmetal import _threads


def sampled(total: int, most: int) -> list[int]:
    """At most ``most`` of 1..``total``, evenly spread, the first and last among them:
    the same ones every run."""
    if total <= most:
        return list(range(1, total + 1))
    return sorted({1 + round(i * (total - 1) / (most - 1)) for i in range(most)})


def device_threads() -> set[threading.Thread]:
    """asyncmetal's threads alive now that a device or a close made -- not the shared
    workers (which stay a while for the next call, _threads.IDLE_S) nor the compile
    pool's (which outlives devices)."""
    shared = (_threads.NAME, "asyncmetal-compile")
    return {t for t in threading.enumerate() if t.name.startswith("asyncmetal")} - {
        t for t in threading.enumerate() if t.name in shared
    }

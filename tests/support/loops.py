"""Event loops the tests leave behind, as an application may."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any


def dropped_with_parked_waits(timeline: Any, n: int = 10) -> weakref.ref[asyncio.AbstractEventLoop]:
    """A new asyncio loop on this thread whose ``n`` tasks park on a wait of
    ``timeline`` that never ends, then dropped stopped, not closed: a weak reference to
    it (collected once asyncmetal set its parked tasks aside)."""
    loop = asyncio.new_event_loop()
    dropped = weakref.ref(loop)

    async def park() -> None:
        waits = [asyncio.ensure_future(timeline.wait(1 << 60)) for _ in range(n)]
        await asyncio.sleep(0.02)
        for task in waits:
            task._log_destroy_pending = False  # type: ignore[attr-defined]

    loop.run_until_complete(park())
    return dropped


async def signalled_wait(timeline: Any, value: int) -> None:
    """A task's wait for ``value`` of ``timeline``, parked, then signalled from this loop
    10 ms later: the loop's bridge (and its pipe) made, and the wait's count kept."""
    waiting = asyncio.ensure_future(timeline.wait(value))
    await asyncio.sleep(0.01)
    timeline.signal(value)
    await asyncio.wait_for(waiting, 5)

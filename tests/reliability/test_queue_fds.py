"""A live cpu queue holds no file descriptor of its own: its thread opens its schedstat
(how long it waited for a core) for each read, not for as long as it runs."""

from __future__ import annotations

import contextlib
import os
import threading

import numpy as np
import pytest

import asyncmetal as am

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(
        not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"),
        reason="needs Linux's schedstat and /proc/self/fd",
    ),
]

QUEUES = 24
# Spins some 6 ms: a window of the thread's watch on its waits (5 ms) passes within one
# command, so that its schedstat is read after it.
SPIN = """#include <time.h>
void spin(int* out) {
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    do clock_gettime(CLOCK_MONOTONIC, &b);
    while ((b.tv_sec - a.tv_sec) * 1000000000L + (b.tv_nsec - a.tv_nsec) < 6000000L);
    out[0] = 7;
}"""


def _schedstat_fds() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the listing's own, closed since)
            count += os.readlink(f"/proc/self/fd/{fd}").endswith("/schedstat")
    return count


async def test_live_cpu_queues_hold_no_schedstat_descriptor(anyio_backend: object) -> None:
    """Checked: fails without the fix (each queue thread kept its schedstat open: "assert
    25 == 0", the device's own queue and the 24 made here)."""
    async with am.open_device("cpu") as device, contextlib.AsyncExitStack() as stack:
        program = await device.compile(SPIN, "spin")
        queues = [await stack.enter_async_context(device.new_queue()) for _ in range(QUEUES)]
        bufs = [await device.alloc(4) for _ in queues]
        # Twice on each: a read of its waits comes after the second at the latest. A
        # synchronize returns after the look that follows the command before it.
        for _ in range(2):
            for queue, buf in zip(queues, bufs, strict=True):
                await queue.launch(program, buf)
        for queue in queues:
            await queue.synchronize()
        assert _schedstat_fds() == 0
        for buf in bufs:
            assert (await buf.read(np.int32))[0] == 7

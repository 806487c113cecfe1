"""Closing a device, and the queue edges around it: nothing submitted is lost, every
waiter ends, and nothing of a finished event loop stays referenced."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import weakref

import pytest

import asyncmetal as am

INC = "void inc(int* x) { x[0] += 1; }"
WIDE = "void wide(" + ", ".join(f"int a{i}" for i in range(17)) + ") {}"


# -- finished event loops ----------------------------------------------------------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _open_device(name: str) -> am.Device:
    async def opened() -> am.Device:
        return await am.open_device(name)

    return asyncio.run(opened())


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts fds in /proc")
def test_finished_asyncio_runs_leave_nothing_referenced() -> None:
    dev = _open_device("cpu:27")
    tl = dev.timeline()
    queue = dev.new_queue()
    pending = queue.wait(tl, 1)  # a command that stays pending across the runs
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def one_run() -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(tl.wait(1), 0.01)  # cancelled by the timeout
        asyncio.get_running_loop().create_task(pending.wait())  # cancelled by the run's end
        await asyncio.sleep(0)

    asyncio.run(one_run())  # the first run loads what later runs share
    gc.collect()
    before = _open_fds()
    for _ in range(20):
        asyncio.run(one_run())
    gc.collect()
    assert [ref for ref in loops if ref() is not None] == []
    assert _open_fds() <= before
    tl.signal(1)
    asyncio.run(dev.close())


def test_finished_trio_runs_leave_no_fds() -> None:
    trio = pytest.importorskip("trio")
    dev = _open_device("cpu:28")
    tl = dev.timeline()

    async def one_run() -> None:
        with trio.move_on_after(0.01):
            await tl.wait(1)

    trio.run(one_run)
    gc.collect()
    before = _open_fds()
    for _ in range(20):
        trio.run(one_run)
    gc.collect()
    assert _open_fds() <= before
    asyncio.run(dev.close())

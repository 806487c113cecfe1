"""A device's close whose own loop cannot be made (no file descriptor left: EMFILE, as a
busy server meets it) ends its waits with that error and leaves the device open for a
later close -- it never hangs (contract 9: every waiter ends)."""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap
import threading
import types
from typing import Any

import anyio
import pytest

import asyncmetal as am
from asyncmetal import _device

pytestmark = pytest.mark.anyio

LIMIT = 20  # seconds: each wait here ends at once, or it hangs


@pytest.mark.parametrize("refused", [1, 2])
async def test_a_close_whose_loop_cannot_be_made_raises_and_can_be_done_again(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, refused: int
) -> None:
    """Two closes, each starting a thread for the teardown: where both threads' loops
    are refused (OSError EMFILE), both closes raise that, the device is still open and
    usable, and the next close closes it; where one is, the other thread's teardown
    closes it. Checked failing without the fix: the closes waited for good
    (fail_after's TimeoutError)."""
    device = await am.open_device("cpu")
    refusals = [OSError(errno.EMFILE, "Too many open files") for _ in range(refused)]

    def run(fn: Any, *args: Any) -> Any:
        if refusals:
            raise refusals.pop()
        return anyio.run(fn, *args)

    monkeypatch.setattr(_device, "anyio", types.SimpleNamespace(**{**vars(anyio), "run": run}))
    outcomes: list[BaseException | None] = []

    async def close() -> None:
        try:
            await device.close()
            outcomes.append(None)
        except OSError as exc:
            outcomes.append(exc)

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(close)
            tg.start_soon(close)
    if refused == 1:  # (the refused close's waits end with the error where no other
        # close's thread was still to begin then; the other's close closes it)
        assert None in outcomes and device.closed, outcomes
        assert all(o is None or getattr(o, "errno", 0) == errno.EMFILE for o in outcomes)
        return
    assert [getattr(o, "errno", o) for o in outcomes] == [errno.EMFILE] * 2, outcomes
    assert not device.closed and device in am.open_devices()
    program = await device.compile("void k(int* x) { x[0] = 7; }", "k")
    buf = await device.alloc(4)
    await device.queue.launch(program, buf)
    with anyio.fail_after(LIMIT):
        await device.close()
    assert device.closed


def test_a_close_out_of_file_descriptors_ends(tmp_path: Any) -> None:
    """The same with the process's descriptors really used up as the close starts
    (RLIMIT_NOFILE lowered to those open): the close raises, and closes once the limit
    is back. Checked failing without the fix: the child hung (its timeout)."""
    script = textwrap.dedent(
        """
        import asyncio, errno, os, resource
        import asyncmetal as am

        async def main():
            dev = await am.open_device("cpu")
            await dev.queue.marker()
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")), hard))
            try:
                await asyncio.wait_for(dev.close(), 15)
                print("closed")
            except OSError as exc:
                print("refused", exc.errno == errno.EMFILE)
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            await asyncio.wait_for(dev.close(), 15)
            print("then", dev.closed)

        asyncio.run(main())
        """
    )
    child = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.split() == ["refused", "True", "then", "True"], child.stdout


async def test_a_close_whose_thread_never_started_leaves_no_count_behind(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close whose thread could not start raises that; a later close whose loop then
    cannot be made still ends its waits with its error, and the next one closes. Checked
    failing without the fix: the first close's count stayed, so the second's thread
    counted on it to begin the teardown and nothing ended its wait (fail_after)."""
    device = await am.open_device("cpu")
    start, starts = threading.Thread.start, [RuntimeError("can't start new thread")]

    def refused_once(thread: threading.Thread) -> None:
        if thread.name == _device.CLOSE_THREAD and starts:
            raise starts.pop()
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refused_once)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        await device.close()
    refusals = [OSError(errno.EMFILE, "Too many open files")]

    def run(fn: Any, *args: Any) -> Any:
        if refusals:
            raise refusals.pop()
        return anyio.run(fn, *args)

    monkeypatch.setattr(_device, "anyio", types.SimpleNamespace(**{**vars(anyio), "run": run}))
    with anyio.fail_after(LIMIT), pytest.raises(OSError, match="Too many open files"):
        await device.close()
    with anyio.fail_after(LIMIT):
        await device.close()
    assert device.closed

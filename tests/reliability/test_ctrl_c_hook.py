"""Ctrl-C's hook (``_interrupts.ctrl_c_discards``): what it leaves behind once no close
waits -- a later ``asyncio.run`` must install its own handler again (its first Ctrl-C
cancels the main task), and no ended Runner is kept alive."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from asyncmetal import _interrupts
from asyncmetal._interrupts import ctrl_c_discards

# A close in a task of its own still waits as the main task returns: asyncio.run's
# runner finds the hook installed (not its own handler) as its run ends, so leaves it;
# the hook, once the close ended in the runner's close, puts back the runner's handler.
_OUTLIVED = r"""
import asyncio, gc, os, signal, threading, weakref
import asyncmetal as am

runners = []
async def main():
    dev = await am.open_device("cpu")
    k = await dev.compile("#include <time.h>\n"
        "void k(int* x) { struct timespec t = {0, 2000000}; nanosleep(&t, 0); }", "k")
    buf = await dev.alloc(4)
    for _ in range(100):  # ~0.2 s
        dev.queue.launch(k, buf)
    asyncio.get_running_loop().create_task(dev.close())
    await asyncio.sleep(0.05)  # returns while that close waits

asyncio.run(main())
handler = signal.getsignal(signal.SIGINT)
print("default", handler is signal.default_int_handler)
del handler

async def graceful():
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        await asyncio.sleep(5)
    except asyncio.CancelledError:  # the first Ctrl-C, the runner's own
        await asyncio.sleep(0)
        return "cancelled"
    return "slept"

try:
    print("second", asyncio.run(graceful()))
except KeyboardInterrupt:
    print("second interrupted")
"""


def test_a_close_outliving_asyncio_run_leaves_its_runner_handler_behind() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_OUTLIVED)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["default", "True", "second", "cancelled"], (
        proc.stdout + proc.stderr[-3000:]
    )


def test_an_interrupt_right_after_the_hook_is_installed_leaves_it_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The handler runs after a call returns: here, signal.signal's, which installed the
    hook, before the close is registered and its ``try`` stands."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    install = signal.signal

    def interrupted_after(signum: int, handler: Any) -> Any:
        old = install(signum, handler)
        if handler is _interrupts._on_sigint:
            signal.raise_signal(signal.SIGINT)  # (delivered as this call returns)
        return old

    monkeypatch.setattr(signal, "signal", interrupted_after)
    try:
        with pytest.raises(KeyboardInterrupt), ctrl_c_discards(lambda: None):
            pass
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        install(signal.SIGINT, signal.default_int_handler)


def test_an_interrupt_as_the_hook_is_left_leaves_it_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Here, at the return of the look at the handler that comes before putting it back
    (the hook still installed)."""
    look = signal.getsignal
    leaving = [False]

    def interrupted_after(signum: int) -> Any:
        found = look(signum)
        if leaving[0]:
            leaving[0] = False
            signal.raise_signal(signal.SIGINT)  # (delivered as this call returns)
        return found

    monkeypatch.setattr(signal, "getsignal", interrupted_after)
    try:
        with pytest.raises(KeyboardInterrupt), ctrl_c_discards(lambda: None):
            leaving[0] = True
        assert look(signal.SIGINT) is signal.default_int_handler
        assert _interrupts._previous is None and not _interrupts._closes
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _interrupts._previous = None


def test_the_hook_put_back_by_the_program_after_the_close_passes_ctrl_c_on() -> None:
    """A program that saved the handler while a close waited (the hook) and puts it
    back after the close ended: Ctrl-C is a KeyboardInterrupt, not a TypeError."""
    try:
        with ctrl_c_discards(lambda: None):
            saved = signal.signal(signal.SIGINT, lambda signum, frame: None)
        signal.signal(signal.SIGINT, saved)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)

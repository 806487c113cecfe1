"""Finalizers that call asyncmetal, run by the garbage collector inside asyncmetal's own
bookkeeping (contract: nothing hangs).

A collection starts at any allocation of a tracked object, and runs the finalizers
(``__del__``, weakref callbacks) of what it finds on whatever thread allocated, in the
middle of whatever that thread was doing. A finalizer that imports an array
(``am.from_dlpack``) or lists the open devices takes the locks that guard the records
of open devices: a thread that held one of them while it allocated would wait on itself
for good. Each scenario runs in a fresh interpreter, bounded in time: at every
collection the interpreter makes while the scenario's calls run, a garbage cycle with
such a finalizer is made for that very collection to find.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import _thread, gc, sys, threading
import anyio, numpy as np
import asyncmetal as am
from asyncmetal import _buffer, _device_state, _interop

ran, finalizing, inside = [0], [False], [False]


class Imports:
    def __init__(self):
        self.me = self  # (a cycle: only a collection finds it)

    def __del__(self):
        finalizing[0] = True
        try:
            _interop._last_found.clear()  # (looked up again, not taken from the last)
            am.from_dlpack(np.zeros(4, np.float32))
            am.open_devices()
            ran[0] += 1
        finally:
            finalizing[0] = False


def collecting(phase, info):
    if phase == "start" and inside[0] and not finalizing[0]:
        Imports()  # garbage that this collection finds


async def main(scenario):
    keep = await am.open_device("cpu")  # (what the finalizers import onto)
    gc.callbacks.append(collecting)
    gc.set_threshold(1)  # (a collection at about every allocation)
    inside[0] = True
    try:
        if scenario == "devices":
            for _ in range(20):
                dev = await am.open_device("cpu")
                am.open_devices()
                await dev.close()
        elif scenario == "buffers":  # (the allocator's sections, where it caches and frees)
            for _ in range(20):
                buf = await keep.alloc(64)
                await buf.write(np.zeros(16, np.float32))
                await buf.read()
                await buf.free()
        elif scenario == "switched":  # another thread switches collection on meanwhile
            share = _buffer._share_locked

            def switched(*args):
                # (The other thread allocates nothing once collection is on, until this
                # look-up ended: a collection of its own would run the finalizers.)
                on, done = _thread.allocate_lock(), _thread.allocate_lock()
                on.acquire()
                done.acquire()
                told, until = on.release, done.acquire

                def switch():
                    gc.enable()
                    told()
                    until()

                threading.Thread(target=switch).start()
                on.acquire()
                try:
                    share(*args)
                finally:
                    done.release()

            _buffer._share_locked = switched
            try:
                for _ in range(20):
                    am.from_dlpack(np.zeros(16, np.float32))
            finally:
                _buffer._share_locked = share
        elif scenario == "imports":
            for _ in range(20):
                am.from_dlpack(np.zeros(16, np.float32))
        else:  # the devices' states, as the allocator and the frees list them
            for _ in range(100):
                _device_state.open_states()
                _device_state.unreleased_states()
    finally:
        inside[0] = False
        gc.set_threshold(700, 10, 10)
        gc.callbacks.remove(collecting)
    await keep.close()
    # (Switched: how many collections its few allocations start varies, 19 to 63 finalizer
    # runs over runs of it; the others' hundreds and thousands.)
    assert ran[0] >= (10 if scenario == "switched" else 20), ran
    print("ok", ran[0])


anyio.run(main, sys.argv[1])
"""


@pytest.mark.parametrize("scenario", ["devices", "imports", "states", "buffers", "switched"])
def test_a_finalizer_that_imports_never_waits_on_its_own_thread(scenario: str) -> None:
    """Devices opened, listed and closed (``devices``), arrays imported (``imports``),
    the devices' states listed (``states``), buffers allocated, written, read and freed
    (``buffers``), arrays imported while another thread switches collection on inside
    each import's look-up (``switched``), while collections run finalizers that import
    an array and list the open devices. Checked: fails without the fix, each (the
    thread waited for a lock it held itself -- the open devices' inside ``_devices()``,
    the foreign memory's inside an import's look-up (with ``switched`` too), the
    states' inside ``unreleased_states()``, the allocator's inside a free's release of
    the block -- and the child timed out)."""
    try:
        child = subprocess.run(
            [sys.executable, "-c", SCRIPT, scenario],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the child hung: a finalizer waited for a lock its own thread held")
    assert child.returncode == 0, child.stderr[-4000:]
    assert child.stdout.startswith("ok"), child.stdout

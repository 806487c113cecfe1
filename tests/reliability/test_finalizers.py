"""Finalizers that call asyncmetal, run by the garbage collector inside asyncmetal's own
bookkeeping (contract: nothing hangs).

A collection starts at any allocation of a tracked object, and runs the finalizers
(``__del__``, weakref callbacks) of what it finds on whatever thread allocated, in the
middle of whatever that thread was doing. A finalizer that imports an array
(``am.from_dlpack``) or lists the open devices takes the locks that guard the records
of open devices: a thread that held one of them while it allocated would wait on itself
for good. Each scenario runs in a fresh interpreter, bounded in time: at every
collection the interpreter makes while the scenario's calls run, a garbage cycle with
such a finalizer is made for that very collection to find -- or, where a collection
comes only as another thread switches collection back on, at the one point it is
brought to (an import's look-up of the memory's record).
"""

from __future__ import annotations

import pytest

from tests.support.children import run_child

HUNG = "the child hung: a finalizer waited for a lock its own thread held"

SCRIPT = r"""
import gc, sys
import anyio, numpy as np
import asyncmetal as am
from asyncmetal import _device_state, _interop

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
    assert ran[0] >= 20, ran
    print("ok", ran[0])


anyio.run(main, sys.argv[1])
"""


@pytest.mark.parametrize("scenario", ["devices", "imports", "states", "buffers"])
def test_a_finalizer_that_imports_never_waits_on_its_own_thread(scenario: str) -> None:
    """Devices opened, listed and closed (``devices``), arrays imported (``imports``),
    the devices' states listed (``states``), buffers allocated, written, read and freed
    (``buffers``), while collections run finalizers that import an array and list the
    open devices. Checked: fails without the fix, each (the thread waited for a lock it
    held itself -- the open devices' inside ``_devices()``, the foreign memory's inside
    an import's look-up (before collections were switched off there: the reentrant lock
    that still matters is checked by the test below), the states' inside
    ``unreleased_states()``, the allocator's inside a free's release of the block -- and
    the child timed out)."""
    child = run_child(SCRIPT, scenario, hung=HUNG)
    assert child.returncode == 0, child.stderr[-4000:]
    assert child.stdout.startswith("ok"), child.stdout


SWITCHED = r"""
import _thread, faulthandler, gc, threading, weakref
import anyio, numpy as np
import asyncmetal as am
from asyncmetal import _interop

faulthandler.dump_traceback_later(30, exit=True)  # (a hang: where it waits, and out)


async def main():
    dev = await am.open_device("cpu")
    allocator = dev._allocator
    array, other = np.arange(16, dtype=np.float32), np.arange(16, 32, dtype=np.float32)
    address = array.__array_interface__["data"][0]
    kept = weakref.ref(array), weakref.ref(other)
    nested, inside = [], [False]
    look_up = allocator.foreign_memory

    class Imports:
        def __init__(self):
            self.me = self  # (a cycle: only a collection finds it)

        def __del__(self):
            assert inside[0], "a collection outside the look-up ran the finalizer"
            assert threading.current_thread() is threading.main_thread(), threading.current_thread()
            _interop._last_found.clear()  # (looked up again, not taken from the last)
            nested.append(am.from_dlpack(array))  # the memory the import looks up
            nested.append(am.from_dlpack(other))

    def foreign_memory(at, nbytes):
        found = look_up(at, nbytes)
        if at != address or inside[0] or nested:  # (the finalizer's own look-ups, and later)
            return found
        # The import's look-up, its lock held and collection switched off by it: another
        # thread switches collection on; then one starts here, which finds the
        # finalizer that imports -- before the import notes what it found. (Started
        # by the call, not by the next allocation's count: with the count lowered, an
        # allocation of any other thread of the process -- asyncmetal's worker that
        # opened the device, reporting back -- could start it there first, and run the
        # finalizer on that thread.)
        assert not gc.isenabled()
        Imports()
        inside[0] = True
        on, done = _thread.allocate_lock(), _thread.allocate_lock()
        on.acquire()
        done.acquire()
        told, until = on.release, done.acquire

        def switch():
            gc.enable()
            told()
            until()

        threading.Thread(target=switch).start()
        try:
            on.acquire()
            assert gc.isenabled()
            gc.collect()
        finally:
            done.release()
            inside[0] = False
        assert len(nested) == 2, "no collection ran inside the look-up"
        return found

    allocator.foreign_memory = foreign_memory
    try:
        buf = am.from_dlpack(array)
    finally:
        del allocator.foreign_memory
    assert gc.isenabled()
    again, elsewhere = nested
    # Nothing lost: every buffer is the device's, over a record of the whole array, and
    # the array's memory has one record on record -- the finalizer's, noted first, which
    # later imports share; the first import's buffer has it, or at worst a second one
    # of its own.
    blocks = [b._allocation.block for b in (buf, again, elsewhere)]
    assert all(block in allocator._foreign for block in blocks)
    records = [block.memory for block in blocks]
    assert all((r.address, r.nbytes) == (address, 64) for r in records[:2]), records
    assert allocator.foreign_memory(address, 64) == [records[1]]
    other_address = other.__array_interface__["data"][0]
    assert allocator.foreign_memory(other_address, 64) == [records[2]]
    assert am.from_dlpack(array)._allocation.block.memory is records[1]
    # The arrays are held while their buffers are used, and the buffers are over them.
    del array, other
    gc.collect()
    assert all(ref() is not None for ref in kept)
    await again.write(np.full(16, 7, np.float32))
    assert (await buf.read(np.float32) == 7).all()
    assert (await elsewhere.read(np.float32) == np.arange(16, 32)).all()
    del buf, again, elsewhere, nested, blocks, records
    await dev.close()
    gc.collect()
    assert all(ref() is None for ref in kept)
    print("ok")


anyio.run(main)
"""


def test_a_finalizer_that_imports_inside_an_imports_look_up_once_collection_is_on() -> None:
    """An import's look-up of the record of the memory it is over, with collection
    switched off by the import and back on by another thread meanwhile: a collection
    starts there and runs a finalizer that imports that very array and another one, on
    the look-up's thread, the look-up's lock held. The finalizer's imports end, and so
    does the first; every buffer is the device's, over its array, which is held while
    they are used; at worst the first import's buffer has a second record of its own
    for that memory (the finalizer's, noted first, is the one later imports share).
    Checked: with a lock that is not reentrant (``threading.Lock``), the finalizer's
    import waited for the lock its own thread held, and the child hung."""
    child = run_child(SWITCHED, hung=HUNG)
    assert child.returncode == 0, child.stderr[-4000:]
    assert child.stdout == "ok\n", child.stdout

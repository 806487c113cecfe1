"""A freed ``from_dlpack`` buffer lets go of the memory it is over once the commands
that used it ran, while the (unusable) Buffer object itself lives on: another library's
array goes, and a buffer of asyncmetal's own that lent it out (coming back) returns to
its allocator -- not before those commands ran."""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _allocator, _buffer

pytestmark = pytest.mark.anyio

LIMIT = 20  # seconds: every wait here ends within a fraction of this, or it hangs
SIZE = 600 << 10  # of a budget of 1 MiB: two such buffers do not fit

# Waits until the host sets flag[0], then writes 7 to out[0]: a command that uses ``out``
# for as long as the test wants.
HOLD = r"""
#include <time.h>
void hold_write(volatile int* flag, int* out) {
    struct timespec ts = { 0, 100000 };
    while (!flag[0]) nanosleep(&ts, 0);
    out[0] = 7;
}
"""


@pytest.mark.parametrize("through", ["buffer", "numpy"])
@pytest.mark.parametrize("first", ["import", "buffer"])
async def test_a_freed_import_of_a_buffer_gives_its_memory_back(
    anyio_backend: object, through: str, first: str
) -> None:
    """``am.from_dlpack(buf)`` (or of ``np.from_dlpack(buf)``), both freed: ``buf``'s
    memory is back under the budget, and an allocation that fits only then succeeds,
    while the freed import lives. Checked: before, the import held ``buf``'s loan until
    it was collected (in use, and the allocation timed out)."""
    async with am.open_device("cpu") as dev:
        dev.memory_budget = 1 << 20
        buf = await dev.alloc(SIZE)
        imp = am.from_dlpack(buf if through == "buffer" else np.from_dlpack(buf))
        frees = (imp, buf) if first == "import" else (buf, imp)
        for each in frees:
            await each.free()
        assert imp.freed and buf.freed
        assert dev.memory_statistics().in_use == 0
        again = await dev.alloc(SIZE, timeout=LIMIT / 4)
        assert imp.freed  # (still here: what let go was the free)
        await again.free()


async def test_a_freed_import_lets_go_of_a_foreign_array(anyio_backend: object) -> None:
    """``am.from_dlpack(array)`` freed lets go of the array at once where no command
    used it, while the freed Buffer object lives. Checked: before, the array lived as
    long as the Buffer object."""
    async with am.open_device("cpu") as dev:
        array = np.zeros(1 << 16, np.uint8)
        gone = weakref.ref(array)
        imp = am.from_dlpack(array)
        await imp.write(np.ones(1 << 16, np.uint8))  # (a use, ran before the free)
        del array
        await imp.free()
        assert gone() is None
        assert imp.freed
        assert dev.memory_statistics().in_use == 0


async def test_a_free_keeps_the_array_until_the_command_using_it_ran(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A free while a kernel still writes the imported array: the array is held (not
    by the freed buffer, which let go of it, but until the kernel ran) -- and goes when
    it did, as the free returns."""
    let_go = threading.Event()
    original = _buffer.let_go_after_uses

    def noted(block: Any) -> None:
        original(block)
        let_go.set()

    monkeypatch.setattr(_buffer, "let_go_after_uses", noted)
    async with am.open_device("cpu") as dev:
        hold = await dev.compile(HOLD, "hold_write")
        flag = await dev.alloc(4)
        await flag.write(np.zeros(1, np.int32))
        gate = await flag.map(np.int32)
        array = np.zeros(4, np.int32)
        gone = weakref.ref(array)
        imp = am.from_dlpack(array)
        memory = imp._allocation.block.owner
        del array
        written = dev.queue.launch(hold, flag, imp)
        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(imp.free)  # returns once the kernel ran
                try:
                    await anyio.to_thread.run_sync(let_go.wait)
                    gc.collect()
                    assert memory is not None and memory.held is None  # the buffer let go
                    assert gone() is not None, "let go of while the kernel still writes it"
                    assert _allocator.lingering_count() >= 1
                    assert not written.done()
                finally:
                    gate[0] = 1  # (a failure too: the device's close waits for the kernel)
            await written
        assert gone() is None
        assert imp.freed


@pytest.mark.parametrize("export", ["dlpack", "map"])
async def test_an_export_of_a_freed_import_keeps_the_array(
    anyio_backend: object, export: str
) -> None:
    """An array made of an import (a DLPack export, a map() view) holds the memory as
    an export does: the import's free lets go of the imported array only once that
    array is gone too."""
    async with am.open_device("cpu"):
        array = np.arange(4, dtype=np.int32)
        gone = weakref.ref(array)
        imp = am.from_dlpack(array)
        del array
        view = (
            np.from_dlpack(imp.typed(np.int32)) if export == "dlpack" else await imp.map(np.int32)
        )
        await imp.free()
        gc.collect()
        assert gone() is not None, "let go of while an array over its memory lives"
        assert view.tolist() == [0, 1, 2, 3]
        del view
        gc.collect()
        assert gone() is None

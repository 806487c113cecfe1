"""A closing device's own memory that commands its queues abandoned may still use: freed
natively only once the device's commands ran out (its backend closed), the rest of its
memory before. On cpu the abandoned commands never run (the queue's thread is stopped
and joined) and Metal's command buffers retain the buffers they use, so neither could
write freed memory; a cuda stream runs them as its backend's close raises the words it
waits on, which tests/backends/cuda/test_simulated_abandoned_own_memory.py checks over
the simulated driver. Here: the order of the frees, on every device of the ``device``
fixture's (cpu, the simulated Metal), and that everything is freed by the close."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal._buffer import native_arg

pytestmark = pytest.mark.anyio


async def test_memory_of_abandoned_commands_is_freed_once_they_ran_out(
    anyio_backend: object, device_name: str
) -> None:
    """A copy between two buffers held behind a device wait nobody signals, a third
    buffer no abandoned command uses; the device closed, abandoning the copy. The copy's
    buffers are freed natively after the backend's close (the device's commands ran
    out), the third before it; nothing is left allocated once the close returned, and
    the abandoned copy reports that it never ran."""
    dev = await am.open_device(device_name)
    backend = dev._backend
    dst, src, other = [await dev.alloc(256) for _ in range(3)]
    await src.write(np.arange(64, dtype=np.int32))
    names = {id(native_arg(b).handle): n for b, n in ((dst, "dst"), (src, "src"), (other, "o"))}
    freed: dict[str, bool] = {}  # by name: whether freed once the commands ran out
    free, close = backend.free, backend.close
    closed: list[bool] = []

    def watched_free(handle: Any) -> None:
        name = names.get(id(handle))
        if name is not None:
            freed[name] = dev._state.ran_out and bool(closed)
        free(handle)

    def watched_close() -> None:
        close()
        closed.append(True)

    backend.free, backend.close = watched_free, watched_close  # type: ignore[method-assign]
    queue = dev.new_queue()
    queue.wait(dev.timeline(), 1)  # never signalled: the close abandons what follows
    copied = queue.copy(dst, src)
    with anyio.fail_after(20):
        await dev.close()
    assert freed == {"dst": True, "src": True, "o": False}, freed
    assert backend.live_allocations == 0
    with pytest.raises(am.ClosedResourceError, match="never ran"):
        await copied

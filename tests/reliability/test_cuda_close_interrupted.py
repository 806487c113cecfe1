"""A cuda device's backend close interrupted (a Ctrl-C: at exit, where the close runs
on the main thread) as it ends the device waits on its timelines, over the simulated
driver (tests/support/native/simulated_cuda.py), in a child process: the runtime's
driver table is process-wide. ``python -m tests.reliability.test_cuda_close_interrupted
SCENARIO LOOP`` is that child; it prints what SCENARIO saw, as JSON, on its last line.

A copy between two buffers of cuda:0, held on the device behind a wait for a value only
the host would signal, is abandoned by the device's close; the backend's close raises
the words its streams wait on, and the stream then runs the copy. An interrupt there
must not skip the synchronize that has it run out before the memory it uses is freed:
the simulated driver's cuMemFree waits for no stream, and counts a free of memory a
copy still uses (``freed_busy``).
"""

from __future__ import annotations

import functools
from typing import Any

import anyio
import numpy as np
import pytest

from tests.support.native import harness
from tests.support.native.simulated_cuda import Seen, _Simulated, child_main, run_child

LOOPS = ["asyncio", "trio"]
SIZE = 1 << 16
COPY_NS = 200_000_000  # each copy of the simulated driver takes this long


async def _interrupted_as_waits_end(sim: _Simulated) -> Seen:
    """The copy above, its buffers dropped; the backend's close interrupted as its end of
    the device waits returns (the words raised: the stream runs the copy, 200 ms).
    Which buffers were freed natively while the copy still used them, which were freed
    at all (within 5 s of the close), whether the copy landed (read before the free),
    and what the close raised."""
    import ctypes

    import asyncmetal as am
    from asyncmetal._buffer import native_arg
    from asyncmetal.backends.cuda import _driver

    seen: Seen = {"freed_busy": [], "freed": []}
    driver = _driver.cu
    free = driver.cuMemFree
    dev = await am.open_device("cuda:0")
    dst, src = await dev.alloc(SIZE), await dev.alloc(SIZE)
    await src.write(np.frombuffer(bytes(range(256)) * (SIZE // 256), np.uint8))
    names = {native_arg(dst).handle: "dst", native_arg(src).handle: "src"}
    landed: list[bool] = []

    def watched_free(pointer: Any) -> Any:
        name = names.get(int(pointer))
        if name is not None:
            seen["freed"].append(name)
            if sim.fake.fake_copy_busy(int(pointer), SIZE):
                seen["freed_busy"].append(name)
            elif name == "dst":  # (still allocated: read in place, as the host here can)
                landed.append(ctypes.string_at(int(pointer), SIZE)[:512] == bytes(range(256)) * 2)
        return free(pointer)

    driver.cuMemFree = watched_free
    sim.copy_ns.value = COPY_NS
    before = sim.freed_busy.value
    timelines: Any = dev._backend._timelines
    close_waits = timelines.close_waits

    def interrupted_close_waits() -> None:
        close_waits()
        timelines.close_waits = close_waits  # (once)
        raise KeyboardInterrupt

    timelines.close_waits = interrupted_close_waits
    try:
        queue, gate = dev.new_queue(), dev.timeline()
        gate.signal(1)  # (only ever signalled by the host: the wait goes to the driver)
        queue.wait(gate, 2)
        copied = queue.copy(dst, src)
        del dst, src
        with anyio.fail_after(20):
            await anyio.sleep(0.05)  # (the stream waits)
            try:
                await dev.close()
            except KeyboardInterrupt:
                seen["close_raised"] = "KeyboardInterrupt"
        with anyio.move_on_after(5):
            while len(seen["freed"]) < 2:
                await anyio.sleep(0.01)
        seen["live_allocations"] = dev._backend.live_allocations
        try:
            await copied
            seen["copied"] = "ran"
        except am.ClosedResourceError:
            seen["copied"] = "abandoned"
    finally:
        driver.cuMemFree = free
        sim.copy_ns.value = 0
    seen["landed"] = landed
    seen["driver_freed_busy"] = sim.freed_busy.value - before
    seen["freed"].sort()
    return seen


SCENARIOS = {"interrupted": _interrupted_as_waits_end}


@functools.cache
def _seen(scenario: str, loop: str) -> Any:
    missing = harness.sanitizer_missing("")
    if missing is not None:
        pytest.skip(missing)
    return run_child(scenario, loop, timeout=240, module=__name__)


@pytest.mark.parametrize("loop", LOOPS)
def test_an_interrupt_as_a_cuda_close_ends_its_waits_still_has_the_streams_run_out(
    loop: str,
) -> None:
    """The backend's close interrupted as it raised the words the streams wait on: it
    ends them all the same, has the streams run out, releases the rest, and the device's
    close raises the interrupt; no buffer is freed natively before the copy ran, and
    both are freed. Checked failing before (the interrupt skipped the synchronize):
    "assert ['dst', 'src'] == []", both were freed while the copy ran."""
    seen = _seen("interrupted", loop)
    assert seen.get("close_raised") == "KeyboardInterrupt", seen
    assert seen["freed_busy"] == [], seen
    assert seen["driver_freed_busy"] == 0, seen
    assert seen["freed"] == ["dst", "src"], seen
    assert seen["live_allocations"] == 0, seen
    assert seen["landed"] == [True], seen


if __name__ == "__main__":
    child_main(SCENARIOS)

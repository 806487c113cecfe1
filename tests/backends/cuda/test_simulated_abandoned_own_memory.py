"""A closing cuda device's own memory that its abandoned commands still use, over the
simulated driver (tests/support/native/simulated_cuda.py: the real native runtime and
extension module, streams of tests/support/fakes/fake_cuda_driver.c whose copies are
memcpys on their streams), in a child process: the runtime's driver table is
process-wide. ``python -m tests.backends.cuda.test_simulated_abandoned_own_memory
SCENARIO LOOP`` is that child; it prints what SCENARIO saw, as JSON, on its last line.

A copy between two buffers of one device, held on the device behind a wait for a value
only the host would signal, is abandoned by that device's close; the close's backend
close raises the words its streams wait on, and the stream then runs the copy. Neither
buffer may be freed natively before that: the simulated driver's cuMemFree waits for no
stream (the driver's "may" synchronize is nothing to count on), and counts a free of
memory a copy still uses (``freed_busy``).
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


async def _own_memory_of_an_abandoned_copy(
    sim: _Simulated, keep: bool, refused: bool = False, interrupted: bool = False
) -> Seen:
    """A copy on a new queue of cuda:0 between two of its buffers, behind a device wait
    for a value nobody signals; cuda:0 closed (the buffers dropped before, or still
    held with ``keep``), abandoning the copy. Which of the two were freed natively while
    the copy was still to run or running (200 ms: a free made before it ran is seen
    while it runs, on a loaded machine too), whether both were freed within 5 s of the
    close (not kept for good), and whether the copy landed (the destination's memory,
    read before its free). With ``refused``, the backend's close fails right after it
    let the streams run (the driver refuses to make its context current once: the
    close raises that), and what the close raised is seen too. With ``interrupted``, a
    KeyboardInterrupt comes as the backend's end of the device waits returns (a Ctrl-C
    at exit, where the close runs on the main thread), and what the close raised is
    seen alike."""
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
    backend: Any = dev._backend
    if refused:
        released, current = backend._timelines.close_waits, backend.make_current
        refusals = [am.AsyncMetalError("cuCtxSetCurrent refused (simulated)")]

        def make_current() -> None:
            if refusals:
                raise refusals.pop()
            current()

        def close_waits() -> None:
            released()
            backend.make_current = make_current

        backend._timelines.close_waits = close_waits
    if interrupted:
        timelines: Any = backend._timelines
        ends = timelines.close_waits

        def interrupted_close_waits() -> None:
            ends()
            timelines.close_waits = ends  # (once)
            raise KeyboardInterrupt

        timelines.close_waits = interrupted_close_waits
    try:
        queue, gate = dev.new_queue(), dev.timeline()
        gate.signal(1)  # (only ever signalled by the host: the wait goes to the driver)
        queue.wait(gate, 2)
        copied = queue.copy(dst, src)
        if not keep:
            del dst, src
        with anyio.fail_after(20):
            await anyio.sleep(0.05)  # (the stream waits)
            try:
                await dev.close()
            except am.AsyncMetalError as error:
                seen["close_raised"] = str(error)
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


async def _own_memory_of_abandoned_host_copies(sim: _Simulated) -> Seen:
    """A copy from host memory into a buffer of cuda:0 and one back, through the staging
    ring (1 MiB: more than a direct copy), on a new queue behind a device wait for a
    value nobody signals; the buffer dropped, cuda:0 closed, abandoning both. What the
    driver counted meanwhile: device memory freed, or host memory unregistered, while
    a copy still used it."""
    import asyncmetal as am

    dev = await am.open_device("cuda:0")
    dst = await dev.alloc(1 << 20)
    counters = (sim.freed_busy, sim.unregistered_busy)
    before = [c.value for c in counters]
    sim.copy_ns.value = COPY_NS // 2
    try:
        queue, gate = dev.new_queue(), dev.timeline()
        gate.signal(1)  # (only ever signalled by the host: the wait goes to the driver)
        queue.wait(gate, 2)
        data = np.arange((1 << 20) // 4, dtype=np.int32)
        out = np.zeros_like(data)
        copies = [queue.copy(dst, data), queue.copy(out, dst)]
        del dst
        with anyio.fail_after(20):
            await anyio.sleep(0.05)  # (the stream waits)
            await dev.close()
        with anyio.move_on_after(5):
            while dev._backend.live_allocations:
                await anyio.sleep(0.01)
        await anyio.sleep(0.3)  # (a stream still running would be counted meanwhile)
    finally:
        sim.copy_ns.value = 0
    seen: Seen = {"live_allocations": dev._backend.live_allocations}
    seen["freed_busy"], seen["unregistered_busy"] = (
        c.value - b for c, b in zip(counters, before, strict=True)
    )
    seen["copied"] = []
    for done in copies:
        try:
            await done
            seen["copied"].append("ran")
        except am.ClosedResourceError:
            seen["copied"].append("abandoned")
    return seen


SCENARIOS = {
    "dropped": functools.partial(_own_memory_of_an_abandoned_copy, keep=False),
    "kept": functools.partial(_own_memory_of_an_abandoned_copy, keep=True),
    "host_copies": _own_memory_of_abandoned_host_copies,
    "refused": functools.partial(_own_memory_of_an_abandoned_copy, keep=False, refused=True),
    "interrupted": functools.partial(
        _own_memory_of_an_abandoned_copy, keep=False, interrupted=True
    ),
}


@functools.cache
def _seen(scenario: str, loop: str) -> Any:
    missing = harness.sanitizer_missing("")
    if missing is not None:
        pytest.skip(missing)
    return run_child(scenario, loop, timeout=240, module=__name__)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("scenario", ["dropped", "kept"])
def test_a_closing_devices_own_memory_is_freed_only_once_its_abandoned_copy_ran(
    loop: str, scenario: str
) -> None:
    """A copy between two buffers of cuda:0 held behind a device wait only the host would
    release; the buffers dropped (or still held), then cuda:0 closed, abandoning the
    copy: its backend's close raises the words its streams wait on, and the stream runs
    the copy. Neither buffer is freed natively before the copy ran (the simulated
    driver's free waits for no stream), both are freed by the close (within 5 s), and
    the copy, which ran, landed whole though it is reported abandoned. (Checked failing
    before: the allocator's close freed both while the copy was still to run.)"""
    seen = _seen(scenario, loop)
    assert seen["freed_busy"] == [], seen
    assert seen["driver_freed_busy"] == 0, seen
    assert seen["freed"] == ["dst", "src"], seen
    assert seen["live_allocations"] == 0, seen
    assert seen["landed"] == [True], seen
    assert seen["copied"] == "abandoned", seen


@pytest.mark.parametrize("loop", LOOPS)
def test_a_closing_devices_own_memory_is_freed_only_once_its_abandoned_host_copies_ran(
    loop: str,
) -> None:
    """A write from host memory into a buffer of cuda:0 and a read back, staged, held
    behind a device wait only the host would release; the buffer dropped, then cuda:0
    closed, abandoning both: the buffer is not freed natively while the stream may
    still run the copy into it, no staging chunk is unpinned under a copy, and
    everything is freed by the close. (Checked failing before: the buffer was freed
    while the staged copy into it was still to run.)"""
    seen = _seen("host_copies", loop)
    assert seen["freed_busy"] == 0, seen
    assert seen["unregistered_busy"] == 0, seen
    assert seen["live_allocations"] == 0, seen
    assert seen["copied"] == ["abandoned", "abandoned"], seen


@pytest.mark.parametrize("loop", LOOPS)
def test_a_backend_close_failing_after_it_let_the_streams_run_still_waits_for_them(
    loop: str,
) -> None:
    """As above (the buffers dropped), but the backend's close fails right after it
    raised the words the streams wait on (the driver refuses its context once): the
    device's close raises that, and still no buffer is freed natively before the copy
    ran -- the backend has the streams run out (its context made current again) before
    it raises. (Checked failing before: both were freed while the copy ran.)"""
    seen = _seen("refused", loop)
    assert "refused (simulated)" in seen.get("close_raised", ""), seen
    assert seen["freed_busy"] == [], seen
    assert seen["driver_freed_busy"] == 0, seen
    assert seen["freed"] == ["dst", "src"], seen
    assert seen["landed"] == [True], seen


@pytest.mark.parametrize("loop", LOOPS)
def test_an_interrupt_as_a_cuda_close_ends_its_waits_still_has_the_streams_run_out(
    loop: str,
) -> None:
    """As above (the buffers dropped), but the backend's close is interrupted as it
    raised the words the streams wait on: it ends them all the same, has the streams
    run out, releases the rest, and the device's close raises the interrupt; no buffer
    is freed natively before the copy ran, and both are freed. Checked failing before
    (the interrupt skipped the synchronize): "assert ['dst', 'src'] == []", both were
    freed while the copy ran."""
    seen = _seen("interrupted", loop)
    assert seen.get("close_raised") == "KeyboardInterrupt", seen
    assert seen["freed_busy"] == [], seen
    assert seen["driver_freed_busy"] == 0, seen
    assert seen["freed"] == ["dst", "src"], seen
    assert seen["live_allocations"] == 0, seen
    assert seen["landed"] == [True], seen


if __name__ == "__main__":
    child_main(SCENARIOS)

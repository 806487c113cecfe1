"""A device's close ends its callers' waits for compiles in the pool: each raises
ClosedResourceError as the close seals the device, not once the compile ends; the
compile goes on for whoever else awaits it (another device sharing the pool) and into
the cache. Every compile here is held at a gate (GatedCompiler) the test opens only
after the wait it looks at has ended. Every wait is bounded."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import asyncmetal as am
from asyncmetal._cache import CompileCache
from asyncmetal._pool import CompilePool
from tests.support.compilers import GatedCompiler, gate_name

pytestmark = pytest.mark.anyio
BOUND = 30  # seconds (a gate left shut holds its compile GATE_WAIT_S: longer)
SRC = "int twice(int x) {{ return 2 * x; }}\n/* {tag} {ns} */\n"


def _src(tag: object) -> str:
    return SRC.format(tag=tag, ns=time.time_ns())


@pytest.fixture
def gated(tmp_path: Path) -> Iterator[tuple[Path, CompilePool]]:
    """A folder of gates and a pool of one worker caching under ``tmp_path``; every gate
    of a source the test compiled is opened at its end, then the pool is shut down (a
    compile held at its gate would hold the close up to SHUTDOWN_JOIN_S)."""
    gates = tmp_path / "gates"
    gates.mkdir()
    pool = CompilePool(1, cache=CompileCache(tmp_path / "cache"))
    yield gates, pool
    for began in gates.glob("*.began"):
        (gates / began.name.removesuffix(".began")).touch()
    pool.shutdown()


def _use_gated(dev: am.Device, pool: CompilePool, gates: Path) -> None:
    dev.compile_pool = pool
    dev._backend._compiler = GatedCompiler(str(gates))


async def _began(gates: Path, src: str) -> None:
    """Wait until the worker runs ``src``'s compile (held at its gate)."""
    while not (gates / f"{gate_name(src)}.began").exists():
        await anyio.sleep(0.01)


def _job(pool: CompilePool) -> Any:
    (job,) = pool._in_flight.values()
    return job


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts fds in /proc")
async def test_a_compile_awaited_as_its_device_closes_raises_at_once(
    anyio_backend: object, tmp_path: Path
) -> None:
    """The caller of a compile running in the pool as the device closes raises the
    device's ClosedResourceError while the compile still runs; its claim is withdrawn
    (the job goes on into the cache), the close's wake-up is taken off the device, and
    the pool compiles on. Run thrice: the later runs leave nothing more open than the
    first did, no descriptor, no thread. Checked: before, the caller waited for the
    compile to end."""
    left: list[tuple[int, set[str]]] = []
    for run in range(3):
        gates = tmp_path / f"gates {run}"
        gates.mkdir()
        pool = CompilePool(1, cache=CompileCache(tmp_path / f"cache {run}"))
        try:
            await _awaited_as_its_device_closes(gates, pool)
        finally:
            for began in gates.glob("*.began"):
                (gates / began.name.removesuffix(".began")).touch()
            await pool.aclose()
            pool.cache.close()
        left.append((_open_fds(), _threads()))
    assert left[2][0] <= left[0][0]
    assert left[2][1] <= left[0][1]


async def _compile_recording_close(
    dev: am.Device, src: str, raised: list[str], timeout: float | None = None
) -> None:
    """``dev.compile(src, "twice")``; its ClosedResourceError's words go to ``raised``."""
    try:
        await dev.compile(src, "twice", timeout=timeout)
    except am.ClosedResourceError as exc:
        raised.append(str(exc))


async def _awaited_as_its_device_closes(gates: Path, pool: CompilePool) -> None:
    src = _src("awaited")
    raised: list[str] = []
    dev = await am.open_device("cpu")
    try:
        _use_gated(dev, pool, gates)

        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_compile_recording_close, dev, src, raised)
                await _began(gates, src)
                await anyio.wait_all_tasks_blocked()  # its caller waits for it
                job = _job(pool)
                await dev.close()
        assert raised == ["device cpu is closed"]
        assert not job.done.value and job.awaiters == 0  # still running, nobody's
        assert not job.callbacks and not dev._state.close_waits
        (gates / gate_name(src)).touch()
        with anyio.fail_after(BOUND):
            await job.done.wait(1)
        assert isinstance(job.result, bytes) and pool.cache._get_memory(job.key) is not None
        again = _src("after the close")
        (gates / gate_name(again)).touch()
        with anyio.fail_after(BOUND):
            assert await pool.compile(GatedCompiler(str(gates)), again)
    finally:
        await dev.close()


async def test_another_devices_caller_of_the_same_compile_still_gets_it(
    anyio_backend: object, gated: tuple[Path, CompilePool]
) -> None:
    """Two devices sharing a pool join one compile: the one that closes ends its own
    caller's wait (ClosedResourceError) and withdraws that claim alone; the other's
    caller gets its program once the compile ends."""
    gates, pool = gated
    src = _src("shared")
    got: dict[str, Any] = {}
    async with am.open_device("cpu:1") as other:
        dev = await am.open_device("cpu")
        try:
            for each in (dev, other):
                _use_gated(each, pool, gates)

            async def compile_on(device: am.Device, tag: str) -> None:
                try:
                    got[tag] = await device.compile(src, "twice")
                except am.ClosedResourceError as exc:
                    got[tag] = str(exc)

            with anyio.fail_after(BOUND):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(compile_on, dev, "closed")
                    tg.start_soon(compile_on, other, "open")
                    await _began(gates, src)
                    await anyio.wait_all_tasks_blocked()
                    job = _job(pool)
                    assert job.awaiters == 2  # one job, joined
                    await dev.close()
                    while not got:  # (its caller ends at once: the gate is shut)
                        await anyio.sleep(0.01)
                    assert got == {"closed": "device cpu is closed"}
                    assert job.awaiters == 1 and not job.done.value
                    (gates / gate_name(src)).touch()
            program = got["open"]
            assert isinstance(program, am.Program) and program.device is other
            assert pool.compiles == 1
        finally:
            await dev.close()


_HELD_KERNEL = """
#include <time.h>
#include <unistd.h>
void held(void) {{
    struct timespec ts = {{ 0, 5000000L }};
    for (int i = 0; i < 12000 && access("{path}", F_OK) != 0; i++) nanosleep(&ts, 0);
}}
"""


async def test_a_compile_entered_as_its_device_begins_to_close_raises_once_sealed(
    anyio_backend: object, gated: tuple[Path, CompilePool], tmp_path: Path
) -> None:
    """A compile entered after the close began (it waits for a kernel that runs: the
    device is not closed yet) is submitted and waited for -- until the close seals the
    device, which ends that wait with ClosedResourceError, the compile still running.
    Checked: before, its caller waited for the compile to end."""
    gates, pool = gated
    release = tmp_path / "release"
    src = _src("entered")
    raised: list[str] = []
    dev = await am.open_device("cpu")
    try:
        held = await dev.compile(_HELD_KERNEL.format(path=release), "held")  # (cc's)
        _use_gated(dev, pool, gates)
        dev.queue.launch(held)  # runs until ``release`` exists: the close waits for it

        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tg:
                tg.start_soon(dev.close)
                while dev._closing is None:
                    await anyio.sleep(0.01)
                assert not dev.closed
                tg.start_soon(_compile_recording_close, dev, src, raised)
                await _began(gates, src)
                await anyio.wait_all_tasks_blocked()
                assert not dev.closed and not raised  # submitted, waited for
                job = _job(pool)
                release.touch()  # the kernel ends, and the close seals the device
        assert raised == ["device cpu is closed"]
        assert not job.done.value and job.awaiters == 0
    finally:
        release.touch()
        await dev.close()


async def test_a_compile_whose_device_closes_as_it_looks_the_source_up_submits_nothing(
    anyio_backend: object, gated: tuple[Path, CompilePool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device's close sealing it between compile()'s own check and the pool's
    submission (here while the cache looks the source up): the compile raises
    ClosedResourceError and submits nothing. Checked: before, it submitted the compile
    and waited for it."""
    gates, pool = gated
    src = _src("looked up")
    dev = await am.open_device("cpu")
    try:
        _use_gated(dev, pool, gates)
        get_disk = pool.cache._get_disk

        async def closing_get_disk(key: str) -> bytes | None:
            await dev.close()
            return await get_disk(key)

        monkeypatch.setattr(pool.cache, "_get_disk", closing_get_disk)
        with anyio.fail_after(BOUND), pytest.raises(am.ClosedResourceError) as caught:
            await dev.compile(src, "twice")
        assert str(caught.value) == "device cpu is closed"
        assert not pool._in_flight and not dev._state.close_waits
        assert not (gates / f"{gate_name(src)}.began").exists()
    finally:
        await dev.close()


async def test_a_timed_compile_awaited_as_its_device_closes_raises_at_once(
    anyio_backend: object, gated: tuple[Path, CompilePool]
) -> None:
    """As above with a timeout (its wait takes another path): the close ends it before
    the timeout, with ClosedResourceError, and withdraws its timed claim."""
    gates, pool = gated
    src = _src("timed")
    raised: list[str] = []
    dev = await am.open_device("cpu")
    try:
        _use_gated(dev, pool, gates)

        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_compile_recording_close, dev, src, raised, 10 * BOUND)
                await _began(gates, src)
                await anyio.wait_all_tasks_blocked()
                job = _job(pool)
                await dev.close()
        assert raised == ["device cpu is closed"]
        assert not job.done.value and job.awaiters == 0 and job.untimed == 0
    finally:
        await dev.close()


async def test_a_cancelled_compile_still_withdraws_its_claim_and_wake_up(
    anyio_backend: object, gated: tuple[Path, CompilePool]
) -> None:
    """A compile's caller cancelled as it waits (the device open) withdraws its claim and
    its wake-up at the device's close; the device then closes with nothing of it left."""
    gates, pool = gated
    src = _src("cancelled")
    async with am.open_device("cpu") as dev:
        _use_gated(dev, pool, gates)
        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tg:
                tg.start_soon(dev.compile, src, "twice")
                await _began(gates, src)
                await anyio.wait_all_tasks_blocked()
                job = _job(pool)
                assert dev._state.close_waits and job.callbacks
                tg.cancel_scope.cancel()
        assert job.awaiters == 0 and not job.callbacks and not dev._state.close_waits

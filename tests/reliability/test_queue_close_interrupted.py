"""A queue's native close cut by a KeyboardInterrupt after it took its handle (a Ctrl-C
as the device's close runs at exit, on the main thread) is finished by the next close --
the device's step run again: what it had left runs once, none of it twice. On the cpu
queue (its native close) and on the cuda one over the fake driver (its native close,
its staging's close, its stream's destroy).

The interrupt lands where CPython would run a signal handler (see
``tests.support.interrupts.interrupted``): at each call's entry and return made from the
queue close's frames, one place after another, on a fresh device each time."""

from __future__ import annotations

import collections
import gc
from collections.abc import Callable, Iterator
from types import FunctionType
from typing import Any

import pytest

import asyncmetal as am
from asyncmetal import _interrupts
from asyncmetal.backends import cpu
from asyncmetal.backends.cuda import _queue as cuda_queue
from asyncmetal.backends.cuda._backend import CUDABackend
from asyncmetal.backends.cuda._staging import Staging, _HostCopier
from tests.reliability.test_cuda_faults import _Driver, fake_driver
from tests.support.interrupts import interrupted

pytestmark = pytest.mark.anyio

MOST_PLACES = 500  # (a queue's close has a few dozen)

# The runtime's and the driver's calls counted below are C functions: no handler runs
# at their entry (the counting wrappers' entries, Python's, are no place to interrupt).
NATIVE_ENTRIES = ("call native_close", "call stream_destroy")


def _codes(*closes: tuple[type, tuple[str, ...]]) -> set[Any]:
    """The frames of ``closes`` (a queue class's close and its steps, by name: those it
    has), and those of the interrupts helpers they run their steps with."""
    helpers = [f for f in vars(_interrupts).values() if isinstance(f, FunctionType)]
    named = [vars(owner).get(name) for owner, names in closes for name in names]
    return {f.__code__ for f in (*named, *helpers) if isinstance(f, FunctionType)}


CPU_CLOSE = (cpu.CPUQueue, ("close", "_close_handle"))
CUDA_CLOSE = (
    cuda_queue.CUDAQueue,
    ("close", "_close", "_close_handle", "_close_staging", "_destroy_stream"),
)
# The staging's close and what it gives its chunks back through.
STAGING_CLOSE = (
    (Staging, ("close",)),
    (_HostCopier, ("close",)),
    (CUDABackend, ("give_chunk",)),
)


def _counting(counts: collections.Counter[int], real: Callable[..., Any]) -> Callable[..., Any]:
    def native_close(handle: int, abandon: int) -> Any:
        counts[handle] += 1
        if counts[handle] == 1:  # (a second native close would free it twice)
            return real(handle, abandon)
        return None

    return native_close


def _at_native_entry(raised: list[str], *libs: _Lib) -> bool:
    """Whether the interrupt landed at a counting wrapper's entry (never a place: see
    NATIVE_ENTRIES); then the cpu queues it kept from their native close are closed
    here, uncounted (each a thread of the runtime)."""
    if not raised[0].endswith(NATIVE_ENTRIES):
        return False
    for lib in libs:
        for handle in lib.handles:
            if lib.counts[handle] == 0:
                lib.real.am_queue_close(handle, 1)
    return True


class _Lib:
    """The runtime of cpu queues (set on each of ``queues``) whose queue closes are
    counted."""

    def __init__(self, queues: list[Any]) -> None:
        self.real = queues[0]._lib
        self.counts: collections.Counter[int] = collections.Counter()
        self.handles = [q._handle for q in queues]
        self.am_queue_close = _counting(self.counts, self.real.am_queue_close)
        for queue in queues:
            assert isinstance(queue, cpu.CPUQueue)
            queue._lib = self  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def left(self) -> dict[int, int]:
        """The queues not closed natively exactly once: how many times each was."""
        return {h: self.counts[h] for h in self.handles if self.counts[h] != 1}


def _close(dev: am.Device, at: int, codes: set[Any]) -> list[str]:
    """The device's native close, interrupted at ``at``; where it was."""
    gc.collect()
    gc.disable()  # (no finalizer's call among the places counted)
    try:
        with interrupted(codes, at) as raised:
            try:
                dev._close_native(abandon=True)
            except KeyboardInterrupt:
                assert raised, "an interrupt the sweep did not raise"
            else:
                assert not raised, f"{raised}: not raised by the close"
    finally:
        gc.enable()
    return raised


async def test_a_cpu_queue_close_cut_after_its_take_is_finished_once(
    anyio_backend: object,
) -> None:
    """Each place in turn: every queue's native close (the default one's, one made's)
    ran exactly once. Checked failing with the handle taken before the rest ran
    unrecorded: places 0 and 1 (at the finalizer's detach) left the default queue
    never closed natively ('Counter()')."""
    codes = _codes(CPU_CLOSE)
    left: list[str] = []
    at = 0
    while True:
        dev = await am.open_device("cpu")
        lib = _Lib([dev.queue._native, dev.new_queue()._native])
        raised = _close(dev, at, codes)
        if not raised:
            break
        if not _at_native_entry(raised, lib) and lib.left():
            left.append(f"{at} ({raised[0]}): closed {lib.left()}")
        at += 1
        assert at < MOST_PLACES
    assert at > 5 and left == [], left


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Driver]:
    yield from fake_driver(monkeypatch)


def _staged(staging: Staging) -> dict[str, Any]:
    """Chunks of the device's pool put on each of ``staging``'s lists, as copies leave
    them: one in the ring whose use ended, one whose use did not (a mark never written),
    one reserved, one retired."""
    backend: Any = staging._backend
    ended, unended, reserved, retired = (backend.take_chunk() for _ in range(4))
    staging._ring.extend([(ended, staging.marks, 0), (unended, staging.marks, 1)])
    staging._count = 2
    staging._reserved.append(reserved)
    staging._retired.append(retired)
    return {"ended": ended, "unended": unended, "reserved": reserved, "retired": retired}


async def test_a_cuda_queue_close_cut_after_its_take_is_finished_once(
    anyio_backend: object, driver: _Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each place in turn -- the staging's close's among them -- a queue with a staging
    (a large pageable copy's) among the device's: every native queue closed once, the
    staging closed (its host-copy queues each closed once), every stream destroyed once,
    and the staging's chunks back in the device's pool once each where their use ended
    or was never begun (closed abandoning: the others stay out). Checked failing with
    the handle taken before the rest ran unrecorded: from the native close's return on,
    the queue cut there was never closed natively, its staging never closed and its
    stream never destroyed ('stream 0x...: 0 destroys'); and with the staging's close
    and give_chunk put back (its lists emptied once all were given back, each given
    back again when it ran again): "86 (give_chunk c_return append): chunks in the pool
    {'ended': 2, 'unended': 0, 'reserved': 1, 'retired': 0}" and more places alike."""
    assert driver.runtime is not None
    closes: collections.Counter[int] = collections.Counter()
    monkeypatch.setattr(
        driver.runtime, "am_cuq_close", _counting(closes, driver.runtime.am_cuq_close)
    )
    destroys: collections.Counter[int] = collections.Counter()
    destroy = driver.cuStreamDestroy

    def stream_destroy(stream: Any) -> Any:
        destroys[int(stream)] += 1
        return destroy(stream) if destroys[int(stream)] == 1 else (0,)

    monkeypatch.setattr(driver, "cuStreamDestroy", stream_destroy)
    pooled: list[list[Any]] = []  # the pool as the backend's close frees it (each time)
    free_chunks = CUDABackend._free_chunks

    def freeing(self: Any) -> None:
        pooled.append(list(self._chunks))
        free_chunks(self)

    monkeypatch.setattr(CUDABackend, "_free_chunks", freeing)
    codes = _codes(CUDA_CLOSE, CPU_CLOSE, *STAGING_CLOSE) | {Staging._unfinished.__code__}
    left: list[str] = []
    at = 0
    while True:
        dev = await am.open_device("cuda:0")
        natives: list[Any] = [dev.queue._native, dev.new_queue()._native]
        staging = natives[1]._staging = Staging(dev._backend)  # type: ignore[arg-type]
        copiers = _Lib(staging.copier.queues)
        chunks = _staged(staging)
        handles = [n._q for n in natives]
        streams = [int(n.stream) for n in natives]
        closes.clear()
        destroys.clear()
        pooled.clear()
        raised = _close(dev, at, codes)
        if not raised:
            break
        if _at_native_entry(raised, copiers):  # (the fake's queues and streams: no thread)
            at += 1
            continue
        where = f"{at} ({raised[0]})"
        left += [f"{where}: queue {h:#x}: {closes[h]} closes" for h in handles if closes[h] != 1]
        left += [
            f"{where}: stream {s:#x}: {destroys[s]} destroys" for s in streams if destroys[s] != 1
        ]
        if copiers.left():
            left.append(f"{where}: staging's copy queues closed {copiers.left()}")
        pool = [c for chunks_freed in pooled for c in chunks_freed]
        given = {name: sum(c is chunk for c in pool) for name, chunk in chunks.items()}
        if given != {"ended": 1, "unended": 0, "reserved": 1, "retired": 0}:
            left.append(f"{where}: chunks in the pool {given}")
        at += 1
        assert at < MOST_PLACES
    assert at > 10 and left == [], left

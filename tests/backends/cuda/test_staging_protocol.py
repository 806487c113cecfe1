"""The cuda staging protocol without a GPU: the queue's ring of pinned chunks
(``Staging``), its host-copy threads sharing each chunk's parts (``_HostCopier``,
native queue threads) and the device words they wait on and raise, against a simulated
stream (a Python thread running stream operations in order: waits on device words, the
DMA as a memmove, writes of device words).

Each chunk is used many times over, with the whole copy submitted before any of it ran
(as ``CUDAQueue.copyin``/``copyout`` do): a chunk's next uses are submitted while its
earlier ones have not started, which hung real 1 GiB copies once (a per-use count reset
at submission). Every byte is checked, both ways.
"""

from __future__ import annotations

import collections
import ctypes
import threading
import time
from typing import Any

import numpy as np
import pytest

from asyncmetal import _native
from asyncmetal.backends.cuda import _staging as cb

CHUNK = 64 << 10
RING = 4


class _StubChunk(cb.Chunk):
    """A staging chunk in plain memory (``Chunk`` without cuMemHostAlloc)."""

    def __init__(self) -> None:
        self._memory = (ctypes.c_uint8 * CHUNK)()
        self.address = ctypes.addressof(self._memory)
        self.nbytes = CHUNK
        self.track_uses()


class _StubBackend:
    """What staging needs of a CUDABackend: the runtime, device-word slots, chunks (a
    pool of ``pooled`` pinned ones; more are pinned only when asked to)."""

    def __init__(self, pooled: int = 1 << 20) -> None:
        self.pool = pooled
        self.pinned = 0  # chunks pinned past the pool
        self.lib = _native.runtime()
        self._words = (ctypes.c_uint64 * 256)()
        base = ctypes.addressof(self._words)
        self._free = [base + 8 * i for i in range(256)]

    def _timeline_slot(self) -> int:
        return self._free.pop()

    def _release_slot(self, slot: int) -> None:
        self._free.append(slot)

    def _retire_timeline(self, c_timeline: int, slot: int) -> None:
        # (The stub's streams are Python's: nothing of the runtime keeps a timeline.)
        self.lib.am_timeline_free(c_timeline)
        self._free.append(slot)

    def take_chunk(self, pin: bool = True) -> _StubChunk | None:
        if self.pool:
            self.pool -= 1
        elif pin:
            self.pinned += 1
        else:
            return None
        return _StubChunk()

    def give_chunk(self, chunk: _StubChunk) -> None:
        pass


class _Stream:
    """Stream operations run in order on a thread, as a GPU runs them."""

    def __init__(self) -> None:
        self._ops: collections.deque[tuple[Any, ...]] = collections.deque()
        self._lock = threading.Lock()
        self.stuck: str | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def put(self, *op: Any) -> None:
        with self._lock:
            self._ops.append(op)

    def _run(self) -> None:
        while True:
            with self._lock:
                op = self._ops.popleft() if self._ops else None
            if op is None:
                time.sleep(0.0001)
            elif op[0] == "end":
                return
            elif op[0] == "wait":
                deadline = time.monotonic() + 10
                while not op[1].reached(op[2]):
                    if time.monotonic() > deadline:
                        self.stuck = f"waited 10 s for a device word to reach {op[2]}"
                        return
            elif op[0] == "memmove":
                ctypes.memmove(op[1], op[2], op[3])
            elif op[0] == "write":
                ctypes.c_uint64.from_address(op[1].address).value = op[2]

    def finish(self) -> None:
        self.put("end")
        self._thread.join(60)
        assert self.stuck is None, self.stuck
        assert not self._thread.is_alive(), "the simulated stream never finished"


def _copy_in(staging: Any, stream: _Stream, device: np.ndarray, host: np.ndarray) -> None:
    """CUDAQueue.copyin's submissions, the stream's part simulated."""
    staging.reserve(host.nbytes)
    for offset in range(0, host.nbytes, CHUNK):
        n = min(CHUNK, host.nbytes - offset)
        chunk, busy = staging.acquire(first=offset == 0)
        filled = staging.copier.copy(chunk.address, host.ctypes.data + offset, n, host, chunk, busy)
        stream.put("wait", *filled)
        stream.put("memmove", device.ctypes.data + offset, chunk.address, n)
        mark = staging.next_mark()
        stream.put("write", *mark)
        staging.release_after(chunk, *mark)


def _copy_out(staging: Any, stream: _Stream, host: np.ndarray, device: np.ndarray) -> None:
    """CUDAQueue.copyout's submissions, the stream's part simulated."""
    staging.reserve(host.nbytes)
    for offset in range(0, host.nbytes, CHUNK):
        n = min(CHUNK, host.nbytes - offset)
        chunk, busy = staging.acquire(first=offset == 0)
        if busy is not None:
            stream.put("wait", *busy)
        stream.put("memmove", chunk.address, device.ctypes.data + offset, n)
        mark = staging.next_mark()
        stream.put("write", *mark)
        emptied = staging.copier.copy(
            host.ctypes.data + offset, chunk.address, n, host, chunk, mark
        )
        staging.release_after(chunk, *emptied)
    for unfinished in staging.unfinished():
        stream.put("wait", *unfinished)


@pytest.mark.parametrize(("threads", "pooled"), [(1, RING), (3, RING), (8, RING), (3, 0)])
def test_staged_copies_reuse_chunks_before_their_last_use_ran(
    threads: int, pooled: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every byte through a ring of chunks reused before their last use ran; with the
    device's pool empty (other queues took it), the ring makes do with the STAGE_MIN
    chunks it pins itself rather than pinning a ring's worth."""
    monkeypatch.setattr(cb, "STAGE_RING", RING)
    monkeypatch.setattr(cb, "STAGE_CHUNK", CHUNK)
    monkeypatch.setattr(cb, "HOST_COPY_THREADS", threads)
    monkeypatch.setattr(cb, "STAGE_PART", 4096)  # chunks of 64 KiB taken in many parts
    rng = np.random.default_rng(threads)
    nbytes = 8 * CHUNK * RING + 12345  # every chunk used ~8 times per copy, a short tail
    data = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(2)]
    device = np.zeros(nbytes, np.uint8)
    backend = _StubBackend(pooled)
    staging = cb.Staging(backend)  # type: ignore[arg-type]
    stream = _Stream()
    try:
        for d in data:  # in, out, in again over the same ring, out again
            out = np.zeros(nbytes, np.uint8)
            _copy_in(staging, stream, device, d)
            _copy_out(staging, stream, out, device)
            stream.finish()
            assert np.array_equal(device, d) and np.array_equal(out, d)
            stream = _Stream()
        assert backend.pinned == (0 if pooled else cb.STAGE_MIN)
    finally:
        stream.finish()
        staging.close(False)


class _Gate:
    """A device word nobody raises until the test does."""

    value = 0

    def reached(self, target: int) -> bool:
        return self.value >= target


def test_an_abandoned_staged_copy_leaves_no_stream_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream held up (by a wait nobody signals) with a staged copy in behind it,
    larger than the ring: the host threads fill the chunks they can, then wait for marks
    that never come. Closing the staging with abandon (a device's close does, for a
    blocked queue) ends the stream's waits for fills that will never come: once what
    holds it up ends (the close raises the word), the stream runs to its end. Checked:
    before, it waited on a chunk nobody filled (for good: a device's frees then hung)."""
    monkeypatch.setattr(cb, "STAGE_RING", RING)
    monkeypatch.setattr(cb, "STAGE_CHUNK", CHUNK)
    monkeypatch.setattr(cb, "HOST_COPY_THREADS", 2)
    monkeypatch.setattr(cb, "STAGE_PART", 4096)
    staging = cb.Staging(_StubBackend())  # type: ignore[arg-type]
    stream, gate = _Stream(), _Gate()
    nbytes = 3 * CHUNK * RING
    device = np.zeros(nbytes, np.uint8)
    stream.put("wait", gate, 1)
    _copy_in(staging, stream, device, np.ones(nbytes, np.uint8))
    time.sleep(0.1)  # the host threads filled the ring and wait for the stream's marks
    staging.close(True)
    gate.value = 1
    stream.finish()


def test_chunks_stay_mapped_while_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A staging chunk is anonymous memory registered with the driver (faked here): freed,
    it is unregistered, then unmapped; dropped unfreed (a queue abandoned), it stays
    mapped and registered -- unmapping it would let a new chunk land on an address the
    driver still holds (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED). Where the kernel
    refuses huge pages, a chunk is made on small ones."""
    import gc
    import mmap
    import types

    registered: set[int] = set()

    def register(address: int, nbytes: int, flags: int) -> tuple[int, None]:
        if address in registered:
            return 1, None
        registered.add(address)
        return 0, None

    def check(result: tuple[int, Any], call: str, where: str = "") -> Any:
        if result[0]:
            raise RuntimeError(f"{call}: already registered")
        return result[1]

    fake = types.SimpleNamespace(
        CU_MEMHOSTREGISTER_PORTABLE=1,
        CU_MEMHOSTREGISTER_DEVICEMAP=2,
        cuMemHostRegister=register,
        cuMemHostUnregister=registered.remove,
    )

    class NoHugePages(mmap.mmap):
        def madvise(self, *args: int) -> None:
            raise OSError(22, "Invalid argument")  # a kernel built without them

    monkeypatch.setattr(cb, "cu", fake)
    monkeypatch.setattr(cb, "check", check)
    kept = set(cb._MAPPED)
    try:
        for i in range(12):
            if i == 11:
                monkeypatch.setattr(mmap, "mmap", NoHugePages)
            chunk = cb.Chunk(1 << 20)
            assert chunk.address % cb.HUGE_PAGE == 0 and chunk.address in registered
            ctypes.memset(chunk.address, i, chunk.nbytes)  # mapped and writable
            if i % 2:
                chunk.free()
                assert chunk.address == 0
            del chunk
            gc.collect()
        assert len(registered) == 6 and set(cb._MAPPED) - kept == registered
    finally:
        for address in set(cb._MAPPED) - kept:
            mapped, view = cb._MAPPED.pop(address)
            del view
            mapped.close()

"""Faults of the cuda backend without a GPU: a fake of cuda-bindings' driver module
(``_Driver``, monkeypatched in as ``asyncmetal.backends.cuda.cu``) that answers every
call the backend makes, and whose calls can be made to fail as the real driver's do.

* A staging chunk whose registration fails unmaps its memory and raises the driver's
  error -- never ``BufferError`` (a ctypes view of the map kept alive by the failing
  ``__init__``'s frame once made ``mmap.close`` refuse, masking the real error).
"""

from __future__ import annotations

import ctypes
import enum
import gc
from typing import Any

import pytest

from asyncmetal import DeviceLostError
from asyncmetal.backends import cuda as cb


class CUresult(enum.IntEnum):
    """The driver's result codes the backend meets (the real values)."""

    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
    CUDA_ERROR_LAUNCH_FAILED = 719


class _Driver:
    """What the backend calls of cuda-bindings' ``driver`` module. Each call returns a
    result tuple as cuda-bindings does; ``fail[name]`` makes call ``name`` return that
    error instead (and do nothing); ``calls`` lists every call made, by name."""

    CUresult = CUresult
    CU_MEMHOSTREGISTER_PORTABLE = 1
    CU_MEMHOSTREGISTER_DEVICEMAP = 2

    def __init__(self) -> None:
        self.fail: dict[str, CUresult] = {}
        self.calls: list[str] = []
        self.registered: set[int] = set()

    def _result(self, name: str, *values: Any) -> tuple[Any, ...]:
        self.calls.append(name)
        if name in self.fail:
            return (self.fail[name], *(None for _ in values))
        return (CUresult.CUDA_SUCCESS, *values)

    def cuMemHostRegister(self, address: int, nbytes: int, flags: int) -> tuple[Any, ...]:
        result = self._result("cuMemHostRegister")
        if result[0] == 0:
            self.registered.add(address)
        return result

    def cuMemHostUnregister(self, address: int) -> tuple[Any, ...]:
        self.registered.discard(address)
        return self._result("cuMemHostUnregister")


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> Any:
    fake = _Driver()
    monkeypatch.setattr(cb, "cu", fake)
    kept = set(cb._MAPPED)
    yield fake
    leaked = set(cb._MAPPED) - kept
    for address in leaked:  # unmapped here, so one failing test does not leak into others
        mapped, view = cb._MAPPED.pop(address)
        del view
        mapped.close()


@pytest.mark.parametrize(
    "error", [CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, CUresult.CUDA_ERROR_OUT_OF_MEMORY]
)
def test_a_chunk_whose_registration_fails_raises_the_drivers_error(
    driver: Any, error: CUresult
) -> None:
    """cuMemHostRegister fails (a sticky error left by a fault, or no memory): the
    driver's error comes out, as the asyncmetal error it maps to, and the chunk's memory
    is unmapped -- nothing is left in ``_MAPPED``, nothing registered."""
    kept = set(cb._MAPPED)
    driver.fail["cuMemHostRegister"] = error
    expected = DeviceLostError if error in (700, 719) else MemoryError
    for _ in range(3):
        with pytest.raises(expected, match=error.name) as caught:
            cb._Chunk(1 << 20)
        assert not isinstance(caught.value.__context__, BufferError)
        del caught
        assert set(cb._MAPPED) == kept and not driver.registered
    driver.fail.clear()
    chunk = cb._Chunk(1 << 20)  # and the next one maps and registers as usual
    assert chunk.address in driver.registered
    ctypes.memset(chunk.address, 1, chunk.nbytes)
    chunk.free()
    assert set(cb._MAPPED) == kept and not driver.registered
    gc.collect()

"""The ``npy`` device: numpy arrays as read-only device buffers.

``asyncmetal.from_numpy(array)`` (or ``npy_device.wrap(array)``) gives a Buffer whose
memory is the array itself, so a program can hand host arrays and device buffers to
``asyncmetal.copy`` alike. It has no kernels and cannot be written to; its queues are
the cpu device's native threads (reads out of it are memmoves, ordered like any other).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._compile import Compiler
from .._errors import CompileError, InvalidArgumentError
from .cpu import CPUBackend


class _ArrayMemory:
    """A host array seen as device memory (the cpu backend's handle shape)."""

    __slots__ = ("address", "array")

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self.array = array.reshape(-1).view(np.uint8)
        self.address: int = self.array.ctypes.data


class _NoCompiler(Compiler):
    name = "npy"

    def compile(self, src: str) -> bytes:
        raise CompileError("the npy device runs no kernels")

    def params(self, src: str, name: str) -> tuple[Any, ...]:
        raise CompileError("the npy device runs no kernels")


class NpyBackend(CPUBackend):
    kind = "npy"
    host_visible = True
    runs_kernels = False
    writable = False
    any_index = False

    @classmethod
    def available(cls) -> list[str]:
        return ["npy"] if CPUBackend.available() else []

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self._npy_compiler = _NoCompiler()
        self.info.name = f"npy:{index}" if index else "npy"

    @property
    def compiler(self) -> Compiler:
        return self._npy_compiler

    def allocate(self, nbytes: int) -> Any:
        raise InvalidArgumentError("npy buffers are made from arrays: asyncmetal.from_numpy(array)")

    def wrap(self, array: np.ndarray[Any, Any]) -> _ArrayMemory:
        return _ArrayMemory(array)

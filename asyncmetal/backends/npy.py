"""The ``npy`` device: numpy arrays as read-only device buffers.

``asyncmetal.from_numpy(array)`` gives a Buffer whose
memory is the array itself, so a program can hand host arrays and device buffers to
``asyncmetal.copy`` alike.

What it does: wrap arrays (``wrap``), copy out of them -- to the host, or to any
device through ``asyncmetal.copy``, read in place (host-visible) -- and order that work
with its queues and timelines, which are native threads of the runtime like the cpu
device's (reads are memmoves, ordered like any other command).

What it refuses, saying why: allocating (its memory is the arrays'), being written
(copies into it, ``Buffer.write``), compiling and loading kernels. Never a default
device (``runs_kernels`` is false), and a forked child may open one (``fork_safe``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _native
from .._backend import Backend, DeviceInfo, Timelines
from .._compile import Compiler, ParamKind
from .._errors import CompileError, InvalidArgumentError
from .cpu import CPUBackend, HostQueues, host_memory

NO_KERNELS = "the npy device runs no kernels: compile for a device that does"


class _ArrayMemory:
    """A host array seen as device memory (the shape the cpu device's queues copy)."""

    __slots__ = ("address", "array")

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        # As a plain ndarray: a subclass slices otherwise (np.matrix by rows, a masked
        # array with its mask), and the memory is read in byte ranges of this.
        self.array = array.view(np.ndarray).reshape(-1).view(np.uint8)
        self.address: int = self.array.ctypes.data


class _NoCompiler(Compiler):
    name = "npy"

    def compile(self, src: str) -> bytes:
        raise CompileError(NO_KERNELS)

    def _params(self, src: str, name: str) -> tuple[ParamKind, ...]:
        raise CompileError(NO_KERNELS)


class NpyBackend(HostQueues, Backend):
    kind = "npy"
    host_visible = True  # read in place: its memory is the arrays
    dlpack_device_type = 1  # kDLCPU
    runs_kernels = False
    writable = False
    fork_safe = True  # the native runtime's threads are the process's own

    @classmethod
    def available(cls) -> list[str]:
        # Its queues are the native runtime's, which builds where the cpu device's does.
        return ["npy"] if CPUBackend.available() else []

    def __init__(self, index: int) -> None:
        self._lib = _native.runtime()  # builds it on first use (we are off the loop)
        self._compiler = _NoCompiler()
        self._timelines = Timelines()
        name = f"npy:{index}" if index else "npy"
        self._info = DeviceInfo(name=name, total_memory=host_memory())

    @property
    def info(self) -> DeviceInfo:
        return self._info

    @property
    def compiler(self) -> Compiler:
        return self._compiler

    def load(self, binary: bytes, name: str, bindings: tuple[int, ...] | None = None) -> Any:
        raise CompileError(NO_KERNELS)

    def unload(self, native: Any) -> None:
        raise CompileError(NO_KERNELS)  # (never called: nothing was loaded)

    def allocate(self, nbytes: int) -> Any:
        raise InvalidArgumentError("npy buffers are made from arrays: asyncmetal.from_numpy(array)")

    def wrap(self, array: np.ndarray[Any, Any]) -> _ArrayMemory:
        """The device memory of a Buffer over ``array`` (checked by Device.wrap)."""
        return _ArrayMemory(array)

    def free(self, handle: Any) -> None:
        pass  # the array is its owner's: dropping the handle lets it go

    def host_view(self, handle: Any, offset: int, nbytes: int) -> memoryview:
        """A read-only view: the array is read in place, never written."""
        memory: _ArrayMemory = handle
        return memory.array[offset : offset + nbytes].data.toreadonly()

    def close(self) -> None:
        pass  # its queues were closed (Device closes them first); nothing else is held

"""The device backends: which kinds of device there are, where each one's backend lives,
and which is preferred. The core asks these and the backend classes' own attributes
(:class:`asyncmetal._backend.Backend`); it names no kind itself."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._backend import Backend

# kind -> "module:class", imported when first asked for (a driver's bindings load then).
BACKENDS: dict[str, str] = {
    "cpu": "asyncmetal.backends.cpu:CPUBackend",
    "npy": "asyncmetal.backends.npy:NpyBackend",
    "cuda": "asyncmetal.backends.cuda:CUDABackend",
    "metal": "asyncmetal.backends.metal:MetalBackend",
}
PREFERENCE = ("cuda", "metal", "cpu", "npy")  # the order devices() lists them in, best first
HOST = "cpu"  # the kind every machine has: opened when no better one is named or found
ARRAYS = "npy"  # the kind whose devices wrap host arrays: asyncmetal.from_numpy


def backend_class(kind: str) -> type[Backend]:
    module, _, name = BACKENDS[kind].partition(":")
    cls: type[Backend] = getattr(importlib.import_module(module), name)
    return cls


def available(kind: str) -> list[str]:
    """The devices of ``kind`` that can be opened here; none where its module cannot
    be imported."""
    try:
        return backend_class(kind).available()
    except ImportError:
        return []

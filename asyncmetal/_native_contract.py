"""The contract between asyncmetal's Python objects and its native extension module.

The extension (``native/py_launch.c``, ``native/py_module.c``) submits
``Queue.launch``'s common case in one C call. To do so it reads Python objects directly:
attributes of the queue, its device, the program, each buffer and its allocation; one
method of each backend queue; and the fields of five positional tuples. **This module
is the one declaration of all of it.** The C side names each thing it reads by a key
(``"Queue.device"``, its ``CONTRACT_KEYS``) and gets the attribute or method name from
:data:`NAMES` when it loads; it hard-codes no attribute name.

Renaming one of these attributes or methods: change its entry here, nothing else. The
checks below run once -- :func:`install_names` when the extension loads, :func:`setup`
when the first queue is made, the launch-target builders once per backend queue class --
and raise :class:`NativeContractError` naming what is missing, rather than letting the
fast path silently fall back to Python (or read the wrong thing).
"""

from __future__ import annotations

import dis
import inspect
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from ._errors import AsyncMetalError


class NativeContractError(AsyncMetalError):
    """The native extension and the Python classes disagree on a name or a layout."""


# Key ("Class.role", as the C side names it) -> the attribute or method name it reads.
# The classes: Queue (_queue.py), its Device (_device.py) and DeviceState
# (_device_state.py), Program (_program.py),
# Buffer (_buffer.py) and its allocation (_allocator.py), Completion (_queue.py), the
# cpu backend's memory handle and queue (backends/cpu.py), the cuda backend's queue.
# A public attribute among them (a buffer's offset, a program's device) is a read-only
# property over the private field named here: what a launch trusts, users cannot set.
NAMES: dict[str, str] = {
    "Queue.device": "_device",  # the queue's Device
    "Queue.submitted": "_submitted",  # int: the last value numbered; set to the next one
    "Queue.state": "_state",  # its DeviceState (a plain attribute: read with no Python code)
    "Queue.fast": "_fast_launch",  # None while the queue is closed or let go of (idle)
    "DeviceState.closed": "closed",  # bool (a slot)
    "DeviceState.busy": "busy",  # int: Python-path submissions under way (a slot)
    "Program.device": "_device",  # must be the queue's device
    "Program.buffer_count": "_buffer_count",  # int: buffers the kernel takes
    "Program.value_count": "_value_count",  # int: values the kernel takes
    # None (buffers then int32 values, in the kernel's order), or (order, value_codes):
    # order None or list[int] (launch argument -> parameter position), value_codes None
    # or bytes (one per value: _scalars.CODES)
    "Program.launch_layout": "_launch_layout",
    "Program.native": "_native",  # int: the kernel's function (cpu) or CUfunction (cuda)
    "Buffer.device": "_device",  # must be the queue's device
    "Buffer.allocation": "_allocation",  # the allocation it views
    "Buffer.offset": "_offset",  # int: bytes into the allocation
    "Allocation.freed": "freed",  # bool
    "Allocation.handle": "handle",  # cuda: the device pointer (int); cpu: its memory
    "Allocation.last_use": "last_use",  # dict: queue -> the last value using it (set)
    "Completion.ring": "_ring",  # cpu: the queue's times ring (set)
    "Completion.row": "_row",  # cpu: the command's row in it (set)
    "CPUMemory.address": "address",  # int: a cpu allocation's host address
    "CUDAQueue.failed": "_failed",  # method (code) -> the error for a refused launch
    # method () -> None: warns of a restore of the thread's context the launch's native
    # call could not make (called only then)
    "CUDAQueue.unrestored": "_unrestored",
    "CPUQueue.submitted": "_submitted",  # method (status, value, handles) after a submit
}
# The keys that name methods (called), not attributes (read or set).
METHODS = frozenset({"CUDAQueue.failed", "CUDAQueue.unrestored", "CPUQueue.submitted"})

# The positional tuples the extension reads, field by field.
LAYOUTS: dict[str, tuple[str, ...]] = {
    # asyncmetal._backend.Arg: a buffer handle plus offset, or a value (an int, or a
    # Scalar).
    "Arg": ("handle", "offset", "value"),
    # asyncmetal._scalars.Scalar: a value's 64-bit slot, and its type's name.
    "Scalar": ("bits", "type"),
    # Program.launch_layout, where not None (see NAMES).
    "launch_layout": ("order", "value_codes"),
    # The backend queue's launch_target(): what the extension submits through.
    # cuda: limits, the address of the device's launch limits (7 unsigned ints:
    # backends/cuda/_limits.py's DEVICE_LIMITS); kernel_threads, a dict: each loaded
    # kernel's CUfunction (int) -> the most threads per block it takes (int).
    "cuda_target": ("kind", "queue", "backend_queue", "limits", "kernel_threads"),
    "cpu_target": (
        "kind",
        "queue",
        "backend_queue",
        "times",
        "times_address",
        "times_kept",
        "keep_items",
    ),
}
CUDA_KIND, CPU_KIND = 1, 0  # a launch target's "kind"


def install_names(extension: ModuleType) -> None:
    """Check the extension's keys and layouts against this declaration and hand it the
    names. Called once, when the extension loads."""
    keys: tuple[str, ...] = extension.CONTRACT_KEYS
    missing = [key for key in keys if key not in NAMES]
    unused = [key for key in NAMES if key not in keys]
    if missing or unused:
        raise NativeContractError(
            f"the native extension reads {missing} that _native_contract.NAMES does not "
            f"declare, and NAMES declares {unused} that it does not read"
        )
    layouts: dict[str, tuple[str, ...]] = extension.LAYOUTS
    if layouts != LAYOUTS:
        raise NativeContractError(
            f"the native extension reads tuples laid out as {layouts}, "
            f"_native_contract.LAYOUTS declares {LAYOUTS}"
        )
    extension.set_names(tuple(NAMES[key] for key in keys))


def setup(extension: ModuleType, classes: Mapping[str, type], one3: object) -> None:
    """Check every attribute the extension reads against ``classes`` (class name, as in
    the keys -> class) and tell the extension which classes its fast path accepts.
    Called once, with the first queue."""
    for cls_name, cls in classes.items():
        check_class(cls_name, cls)
    for layout in ("Arg", "Scalar"):
        fields = tuple(getattr(classes.get(layout), "_fields", LAYOUTS[layout]))
        if fields != LAYOUTS[layout]:
            raise NativeContractError(
                f"{layout}'s fields are {fields}, the extension reads {LAYOUTS[layout]}"
            )
    extension.setup(classes["Program"], classes["Buffer"], classes["Completion"], one3)


_checked: set[tuple[str, type]] = set()


def check_class(cls_name: str, cls: type) -> None:
    """Raise NativeContractError if ``cls`` lacks an attribute or method that the keys
    of ``cls_name`` name. Once per class: a class that passed is not looked at again."""
    if (cls_name, cls) in _checked:
        return
    for key, name in NAMES.items():
        if key.partition(".")[0] != cls_name:
            continue
        if key in METHODS:
            if not callable(getattr(cls, name, None)):
                raise NativeContractError(
                    f"{cls.__qualname__} has no method {name!r}, which the native extension "
                    f"calls ({key} in asyncmetal/_native_contract.py)"
                )
        elif not _has_attribute(cls, name):
            raise NativeContractError(
                f"{cls.__qualname__} has no attribute {name!r}, which the native extension "
                f"reads ({key} in asyncmetal/_native_contract.py)"
            )
    _checked.add((cls_name, cls))


def _has_attribute(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` have ``name``: a class attribute, property or slot,
    a dataclass field, or an attribute that an ``__init__``/``__post_init__`` of the
    class or a base assigns (``self.name = ...``)."""
    if hasattr(cls, name) or name in getattr(cls, "__dataclass_fields__", {}):
        return True
    for klass in cls.__mro__:
        for method in ("__init__", "__post_init__"):
            function = klass.__dict__.get(method)
            if inspect.isfunction(function) and name in _assigned(function.__code__):
                return True
    return False


def _assigned(code: Any) -> set[str]:
    return {i.argval for i in dis.get_instructions(code) if i.opname == "STORE_ATTR"}


def cuda_launch_target(
    backend_queue: object, handle: int | None, *, limits: int, kernel_threads: dict[int, int]
) -> tuple[Any, ...]:
    """A cuda backend queue's launch target (LAYOUTS["cuda_target"])."""
    check_class("CUDAQueue", type(backend_queue))
    return (CUDA_KIND, handle, backend_queue, limits, kernel_threads)


def cpu_launch_target(
    backend_queue: object,
    handle: int | None,
    *,
    times: object,
    times_address: int,
    times_kept: int,
    keep_items: object,
    memory_type: type,
) -> tuple[Any, ...]:
    """A cpu backend queue's launch target (LAYOUTS["cpu_target"]); ``memory_type`` is
    the class of its allocations' handles."""
    check_class("CPUQueue", type(backend_queue))
    check_class("CPUMemory", memory_type)
    return (CPU_KIND, handle, backend_queue, times, times_address, times_kept, keep_items)

"""The CUDA driver: its bindings, the mapping of its errors to asyncmetal's, the
process-wide state a sticky error leaves, and the driver functions handed to the native
runtime."""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol

from ..._backend import NativeTimeline
from ..._errors import AsyncMetalError, DeviceLostError, NoHostMemoryError

# What the other modules import.
__all__ = ["CudaOutOfMemory", "check", "cu", "driver_error", "nvrtc"]

try:
    from cuda.bindings import driver as cu
    from cuda.bindings import nvrtc
except ImportError:  # pragma: no cover - without cuda-bindings there is no cuda device
    cu = nvrtc = None

# Process-fatal ("sticky") errors. NVIDIA documents the launch errors among them as
# leaving the process in an inconsistent state, every later CUDA call of it failing until
# it restarts -- on every device, not just the one that faulted (on two H200s a fault on
# cuda:1 failed cuda:0's next cuMemAlloc, and its cuMemHostRegister when cuda:0 was
# opened again). An uncorrectable ECC error is treated alike: device memory is corrupt.
LOST = {
    "CUDA_ERROR_ILLEGAL_ADDRESS",
    "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_MISALIGNED_ADDRESS",
    "CUDA_ERROR_HARDWARE_STACK_ERROR",
    "CUDA_ERROR_INVALID_ADDRESS_SPACE",
    "CUDA_ERROR_INVALID_PC",
    "CUDA_ERROR_ASSERT",
    "CUDA_ERROR_LAUNCH_TIMEOUT",
    "CUDA_ERROR_ECC_UNCORRECTABLE",
}


UNCONFIRMED = (1 << 64) - 1
lost_lock = threading.Lock()
# The first sticky error the process saw, and which call or command saw it. Once set, every
# cuda device of the process reports itself lost (DeviceLostError): open, alloc, load,
# new queues, submissions, and completions not confirmed by then.
lost_first: str | None = None


class LiveQueue(Protocol):
    """What a lost process marks on each queue (a ``CUDAQueue``): the value its timeline
    had reached, up to which the driver confirmed its commands."""

    _confirmed_at_loss: int

    @property
    def _timeline(self) -> NativeTimeline: ...


live_queues: weakref.WeakSet[LiveQueue] = weakref.WeakSet()  # what to mark when it is set


def _lose_process(first: str) -> None:
    """Note the process's CUDA state lost (once): each queue keeps the value its timeline
    had reached, the commands up to which the driver confirmed before."""
    global lost_first
    with lost_lock:
        if lost_first is None:
            for queue in list(live_queues):
                queue._confirmed_at_loss = queue._timeline.value
            lost_first = first


def process_lost_error(what: str) -> DeviceLostError:
    return DeviceLostError(
        f"{what}: the process's CUDA state is lost ({lost_first}). The driver fails every "
        "later CUDA call of this process, on every device: restart the process to use "
        "CUDA again. Separate processes (one per device, say) contain such faults"
    )


def refuse_if_lost(what: str) -> None:
    if lost_first is not None:
        raise process_lost_error(what)


def error_name(err: Any) -> str:
    try:
        return str(cu.CUresult(int(err)).name)
    except Exception:
        return f"CUDA error {int(err)}"


def driver_error(call: str, err: Any, where: str = "") -> AsyncMetalError:
    """The asyncmetal exception for CUDA result ``err`` of driver ``call`` (on device
    ``where``). A sticky error marks the process's CUDA state lost; once it is, every
    error is reported as that loss (the driver's state is corrupt, whatever it says)."""
    name = error_name(err)
    at = f"{call} on {where}" if where else call
    if name in LOST:
        _lose_process(f"{name}, first seen by {at}")
    if lost_first is not None:
        return process_lost_error(f"{at} failed with {name}")
    if name == "CUDA_ERROR_OUT_OF_MEMORY":
        return CudaOutOfMemory(f"{at} failed: {name}")
    return AsyncMetalError(f"{at} failed: {name}")


class CudaOutOfMemory(NoHostMemoryError):
    """The driver, or the host, had no memory left (the allocator empties its cache and
    retries)."""


def check(result: Any, call: str, where: str = "") -> Any:
    """Unpack a cuda-bindings result tuple, raising on an error (of device ``where``)."""
    err, *values = result
    if int(err) != 0:
        raise driver_error(call, err, where)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


# The native runtime calls these with the signatures of CUDA 12 and 13 (the same for
# every function it uses but cuStreamGetCtx, whose version of CUDA 12.5 on takes a third
# pointer: it passes one, which the one before ignores); it asks for the driver's own
# version of each, up to 13.
_DRIVER_ABI = (12000, 13000)
_installed = False


def install_driver(lib: Any) -> None:
    """Hand the native runtime the driver functions it calls, from cuGetProcAddress."""
    global _installed
    if _installed:
        return
    driver = int(check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
    version = min(max(driver, _DRIVER_ABI[0]), _DRIVER_ABI[1])
    i = 0
    while (name := lib.am_cuda_name(i)) != b"?":
        pfn = check(cu.cuGetProcAddress(name, version, 0), f"cuGetProcAddress({name})")
        pointer = int(pfn[0] if isinstance(pfn, tuple) else pfn)
        if not pointer:
            raise AsyncMetalError(f"the CUDA driver has no {name.decode()}")
        lib.am_cuda_set(i, pointer)
        i += 1
    _installed = True

"""A cuda launch's sizes against its device's limits and its kernel's, checked at the call.

cuLaunchKernel refuses a block of more threads than the device or the kernel takes, and
a block or a grid beyond the device's limit in a dimension, with CUDA_ERROR_INVALID_VALUE.
A launch that the queue holds on the host (past its bound on commands in flight,
_queue.MAX_IN_FLIGHT) reaches the driver later, from the completion thread, where that
refusal fails the queue from the launch on -- while the same launch on an idle queue
raises at once. So both launch paths check every launch before submitting it, against
limits read once: the device's when it opens, a kernel's when it loads.
"""

from __future__ import annotations

import ctypes
from typing import Any

from ..._errors import InvalidArgumentError
from ._driver import check, cu

# The device's limits, in the order the native launch path reads them (the launch
# target's "limits"): a block's threads, a block's threads per dimension, a grid's blocks
# per dimension. (An H200's: 1024; 1024, 1024, 64; 2**31 - 1, 65535, 65535.)
DEVICE_LIMITS = (
    "MAX_THREADS_PER_BLOCK",
    "MAX_BLOCK_DIM_X",
    "MAX_BLOCK_DIM_Y",
    "MAX_BLOCK_DIM_Z",
    "MAX_GRID_DIM_X",
    "MAX_GRID_DIM_Y",
    "MAX_GRID_DIM_Z",
)
_AXES = "xyz"


class LaunchLimits:
    """A device's launch limits and those of its loaded kernels.

    ``address``: the device's, as 7 unsigned ints in ``DEVICE_LIMITS``'s order;
    ``kernel_threads``: each loaded kernel's most threads per block, by its CUfunction's
    address -- both read by the native launch path, which declines a launch beyond them
    (the Python path then raises, naming the limit). ``last``: the last launch checked and
    found within them, (function, global_size, local_size): the Python path checks again
    only a launch that differs from it."""

    def __init__(self, device: Any, where: str) -> None:
        self.where = where
        attribute = cu.CUdevice_attribute
        self.device = tuple(
            int(
                check(
                    cu.cuDeviceGetAttribute(
                        getattr(attribute, f"CU_DEVICE_ATTRIBUTE_{limit}"), device
                    ),
                    "cuDeviceGetAttribute",
                    where,
                )
            )
            for limit in DEVICE_LIMITS
        )
        self._array = (ctypes.c_uint * len(DEVICE_LIMITS))(*self.device)
        self.address = ctypes.addressof(self._array)
        self.kernel_threads: dict[int, int] = {}
        self._names: dict[int, str] = {}
        # Each loaded kernel's parameter sizes (param_sizes), for the compile's check.
        self.param_sizes: dict[int, tuple[int, ...] | None] = {}
        self.last: tuple[Any, ...] = ()

    def loaded(self, function: Any, name: str) -> None:
        """Read the most threads per block of kernel ``name`` (its CUfunction), which its
        registers per thread or its ``__launch_bounds__`` may set below the device's."""
        threads = check(
            cu.cuFuncGetAttribute(
                cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, function
            ),
            "cuFuncGetAttribute",
            self.where,
        )
        self.kernel_threads[int(function)] = int(threads)
        self._names[int(function)] = name
        self.param_sizes[int(function)] = param_sizes(function)
        self.last = ()  # (a function's address may be one an unloaded kernel had)

    def unloaded(self, function: int) -> None:
        self.kernel_threads.pop(function, None)
        self._names.pop(function, None)
        self.param_sizes.pop(function, None)
        self.last = ()

    def check(
        self, function: int, global_size: tuple[int, int, int], local_size: tuple[int, int, int]
    ) -> None:
        """Raise InvalidArgumentError, naming the limit and the kernel, for a launch of
        ``function`` beyond the device's limits or the kernel's; else remember it as the
        last launch checked."""
        most = self.device
        where = f"launch of kernel {self._names.get(function, hex(function))!r} on {self.where}: "
        for i, axis in enumerate(_AXES):
            if local_size[i] > most[1 + i]:
                raise InvalidArgumentError(
                    f"{where}local_size {local_size} has {local_size[i]} threads in {axis}; "
                    f"a block takes at most {most[1 + i]} "
                    f"(CU_DEVICE_ATTRIBUTE_{DEVICE_LIMITS[1 + i]})"
                )
        threads = local_size[0] * local_size[1] * local_size[2]
        if threads > most[0]:
            raise InvalidArgumentError(
                f"{where}local_size {local_size} makes {threads} threads per block; a block "
                f"takes at most {most[0]} (CU_DEVICE_ATTRIBUTE_{DEVICE_LIMITS[0]})"
            )
        kernel = self.kernel_threads.get(function, most[0])
        if threads > kernel:
            raise InvalidArgumentError(
                f"{where}local_size {local_size} makes {threads} threads per block; the "
                f"kernel takes at most {kernel} (its CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, "
                "which its registers per thread or its __launch_bounds__ set)"
            )
        for i, axis in enumerate(_AXES):
            blocks = -(-global_size[i] // local_size[i])
            if blocks > most[4 + i]:
                raise InvalidArgumentError(
                    f"{where}global_size {global_size} in blocks of {local_size} makes "
                    f"{blocks} blocks in {axis}; a grid takes at most {most[4 + i]} "
                    f"(CU_DEVICE_ATTRIBUTE_{DEVICE_LIMITS[4 + i]})"
                )
        self.last = (function, global_size, local_size)


# More parameters than a kernel can take (their bytes are at most 32764, from CUDA 12.1 on
# Volta or later, 4 KiB before; a byte each at least): a bound on the look.
_MOST_PARAMS = 32764


def param_sizes(function: Any) -> tuple[int, ...] | None:
    """Each parameter's size in bytes of a loaded kernel (its CUfunction), as the driver
    lays them out for a launch (cuFuncGetParamInfo, from CUDA 12.4 drivers); None where
    the driver or cuda-bindings cannot say (an older one), or says no parameters -- which
    a kernel that takes some but is not the driver's own (a runtime's registered stub)
    would say too. The driver answers CUDA_ERROR_INVALID_VALUE past the last one."""
    get = getattr(cu, "cuFuncGetParamInfo", None)
    if get is None:
        return None
    sizes: list[int] = []
    while len(sizes) < _MOST_PARAMS:
        err, _offset, size = get(function, len(sizes))
        if int(err) != 0:
            past_the_last = bool(sizes) and int(err) == int(cu.CUresult.CUDA_ERROR_INVALID_VALUE)
            return tuple(sizes) if past_the_last else None
        sizes.append(int(size))
    return None

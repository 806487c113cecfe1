"""Buffers in: ``from_dlpack`` makes a Buffer over another library's array, no copy.

It takes the producer's DLPack capsule -- asking the producer to order its pending work
before the device's default queue -- and owns it: the capsule's deleter runs once the
Buffer (and every view of it) is gone. ``__cuda_array_interface__`` objects are taken
too (their ``stream`` is waited for by the default queue, on the device).
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np

from ._device import Device, open_devices
from ._dlpack import (
    _NAME,
    _NAME_VERSIONED,
    _USED,
    _USED_VERSIONED,
    DLPACK_VERSION,
    KDLCPU,
    KDLCUDA,
    KDLCUDAHOST,
    DLManagedTensor,
    DLManagedTensorVersioned,
    DLTensor,
)
from ._errors import ArgumentTypeError, InvalidArgumentError
from ._memory import Buffer, foreign_buffer

_api = ctypes.pythonapi
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api)
)
_capsule_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api)
)
_capsule_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_SetName", _api)
)


class _Imported:
    """The producer's tensor, owned by a Buffer: its deleter runs once that is gone.
    Host memory carries ``address`` and ``array``, as the cpu backend's buffers do."""

    __slots__ = ("_deleter", "_managed", "address", "array", "producer")

    def __init__(
        self, producer: object, managed: int, deleter: Any, address: int, host_nbytes: int
    ) -> None:
        self.producer = producer  # kept alive too, as producers may expect
        self._managed = managed
        self._deleter = deleter
        self.address = address
        self.array = (
            np.ctypeslib.as_array((ctypes.c_uint8 * host_nbytes).from_address(address))
            if host_nbytes
            else None
        )

    def __del__(self) -> None:
        if self._deleter:
            self._deleter(self._managed)


def _device_for(device_type: int, device_id: int, given: Device | None) -> Device:
    want: tuple[str, ...]
    if device_type in (KDLCPU, KDLCUDAHOST):
        kind, want = "cpu", ("cpu", "cpu:0")
    elif device_type == KDLCUDA:
        kind, want = "cuda", (f"cuda:{device_id}",)
    else:
        raise InvalidArgumentError(f"DLPack device type {device_type} is not one asyncmetal opens")
    if given is not None:
        if not isinstance(given, Device):
            raise ArgumentTypeError(f"device must be a Device, got {type(given).__name__}")
        if given.kind != kind or (kind == "cuda" and given.name not in want):
            raise InvalidArgumentError(
                f"the array is on DLPack device {(device_type, device_id)}, not {given.name}"
            )
        given._check_open()
        return given
    for device in open_devices():
        if device.name in want:
            return device
    raise InvalidArgumentError(f"the array lives on {want[0]}: open it first, or pass device=")


def _nbytes(shape: tuple[int, ...], strides: tuple[int, ...] | None, itembits: int) -> int:
    """Bytes of a C-contiguous array (strides in items, None: contiguous)."""
    if math.prod(shape) == 0:
        raise InvalidArgumentError("the array is empty")
    if strides is not None:
        expected = 1
        for n, stride in zip(reversed(shape), reversed(strides), strict=True):
            if n != 1 and stride != expected:
                raise InvalidArgumentError(
                    "the array is not C-contiguous: make it contiguous before sharing it"
                )
            expected *= n
    return (math.prod(shape) * itembits + 7) // 8


def from_dlpack(obj: Any, *, device: Device | None = None) -> Buffer:
    """A Buffer over the memory of ``obj`` -- a numpy, PyTorch, CuPy or JAX array, any
    object with ``__dlpack__`` or ``__cuda_array_interface__`` -- without copying.

    The buffer is on the open device the memory lives on (or ``device``, which must be
    that one): host memory on the open ``cpu``, CUDA memory on the open ``cuda:N``. The
    producer's pending work on it comes before the device's default queue, and so
    before every command that orders itself after the buffer (copies do; launches with
    ``queue.after(buf)``). The array must be C-contiguous. It is kept alive while the
    buffer is; freeing the buffer gives nothing back to the allocator (the memory is
    the producer's). Never blocks.
    """
    if not hasattr(obj, "__dlpack__"):
        if hasattr(obj, "__cuda_array_interface__"):
            return _from_cuda_array_interface(obj, device)
        raise ArgumentTypeError(
            "from_dlpack takes an object with __dlpack__ or __cuda_array_interface__, "
            f"got {type(obj).__name__}"
        )
    device_type, device_id = (int(x) for x in obj.__dlpack_device__())
    target = _device_for(device_type, device_id, device)
    stream = target.queue.handle if device_type == KDLCUDA else None
    try:
        capsule = obj.__dlpack__(stream=stream, max_version=DLPACK_VERSION)
    except TypeError:  # a producer of the protocol before max_version
        capsule = obj.__dlpack__() if stream is None else obj.__dlpack__(stream=stream)
    managed: DLManagedTensor | DLManagedTensorVersioned
    if _capsule_valid(capsule, _NAME_VERSIONED):
        address = _capsule_pointer(capsule, _NAME_VERSIONED)
        managed, used = DLManagedTensorVersioned.from_address(address), _USED_VERSIONED
    elif _capsule_valid(capsule, _NAME):
        address = _capsule_pointer(capsule, _NAME)
        managed, used = DLManagedTensor.from_address(address), _USED
    else:
        raise ArgumentTypeError("__dlpack__ returned no unconsumed DLPack capsule")
    tensor: DLTensor = managed.dl_tensor
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    strides = tuple(tensor.strides[i] for i in range(tensor.ndim)) if tensor.strides else None
    nbytes = _nbytes(shape, strides, tensor.dtype.bits * tensor.dtype.lanes)
    data = (tensor.data or 0) + tensor.byte_offset
    _capsule_set_name(capsule, used)  # consumed: the deleter is ours to call
    host = device_type != KDLCUDA
    memory = _Imported(obj, address, managed.deleter, data, nbytes if host else 0)
    return _buffer(target, memory, nbytes)


def _buffer(device: Device, memory: _Imported, nbytes: int) -> Buffer:
    if device.kind == "cpu":
        return foreign_buffer(device, memory, nbytes, None, None)
    # Device memory: the handle is its address; later commands order themselves after
    # a marker behind what the producer made the default queue wait for.
    after = device.queue.marker()
    return foreign_buffer(device, memory.address, nbytes, memory, (device.queue, after.value))


def _from_cuda_array_interface(obj: Any, device: Device | None) -> Buffer:
    interface = obj.__cuda_array_interface__
    shape = tuple(interface["shape"])
    dtype = np.dtype(interface["typestr"])
    strides = interface.get("strides")
    if strides is not None:
        if any(s % dtype.itemsize for s in strides):
            raise InvalidArgumentError("the array is not C-contiguous")
        strides = tuple(s // dtype.itemsize for s in strides)
    nbytes = _nbytes(shape, strides, dtype.itemsize * 8)
    address = int(interface["data"][0])
    if device is None:
        from .backends.cuda_interop import device_index_of

        device = _device_for(KDLCUDA, device_index_of(address), None)
    else:
        _device_for(KDLCUDA, int(device.name.partition(":")[2] or 0), device)
    stream = interface.get("stream")
    if stream is not None:  # the producer's stream: the default queue waits for it
        produced = device.adopt_stream(int(stream)).marker()
        device.queue.wait(produced.timeline, produced.value)
    memory = _Imported(obj, 0, None, address, 0)
    return _buffer(device, memory, nbytes)

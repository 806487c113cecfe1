"""Buffers in: ``from_dlpack`` makes a Buffer over another library's array, no copy.

It takes the producer's DLPack capsule -- asking the producer to order its pending work
before the device's default queue -- and owns it: the capsule's deleter runs once the
Buffer (and every view of it) is gone. ``__cuda_array_interface__`` objects are taken
too (their ``stream`` is waited for by the default queue, on the device).
"""

from __future__ import annotations

import ctypes
import math
import weakref
from typing import Any

import numpy as np

from . import backends
from ._buffer import Buffer
from ._device import Device, foreign_buffer, open_devices
from ._dlpack import (
    CAPSULE_NAME,
    CAPSULE_NAME_VERSIONED,
    DLPACK_VERSION,
    FLAG_READ_ONLY,
    KDLCPU,
    KDLCUDA,
    KDLCUDAHOST,
    KDLMETAL,
    USED_NAME,
    USED_NAME_VERSIONED,
    DLManagedTensor,
    DLManagedTensorVersioned,
    DLTensor,
    capsule_pointer,
    capsule_set_name,
    capsule_valid,
)
from ._errors import ArgumentTypeError, ClosedResourceError, ExchangeError, InvalidArgumentError


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
            np.frombuffer(
                memoryview((ctypes.c_uint8 * host_nbytes).from_address(address)), np.uint8
            )
            if host_nbytes
            else None
        )

    def __del__(self) -> None:
        if self._deleter:
            self._deleter(self._managed)


def _device_for(device_type: int, device_id: int, given: Device | None) -> Device:
    """The open device whose memory DLPack calls (device_type, device_id): ``given``,
    checked, or the first one open (the host kind's device 0 first for host memory)."""
    if device_type == KDLCUDAHOST:  # pinned host memory: host memory to asyncmetal
        device_type, device_id = KDLCPU, 0
    where = (device_type, device_id)
    if given is not None:
        if not isinstance(given, Device):
            raise ArgumentTypeError(f"device must be a Device, got {type(given).__name__}")
        if given.closed:
            raise ClosedResourceError(f"device {given.name} is closed")
        if given.dlpack_device != where:
            raise InvalidArgumentError(f"the array is on DLPack device {where}, not {given.name}")
        return given
    last = _last_found.get(where)
    if last is not None and not last.closed:
        return last
    found = [d for d in open_devices() if d.writable and d.dlpack_device == where]
    found.sort(key=lambda d: d.name not in (backends.HOST, f"{backends.HOST}:0"))
    if not found:
        raise InvalidArgumentError(
            f"no open device holds DLPack device {where}'s memory: open it first "
            "(cpu for host memory, cuda:N for CUDA memory), or pass device="
        )
    _last_found[where] = found[0]
    return found[0]


# The device each DLPack device was found on last (kept while it is open: weakly).
_last_found: weakref.WeakValueDictionary[tuple[int, int], Device] = weakref.WeakValueDictionary()


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
    if device_type == KDLMETAL:  # an MTLBuffer and an offset, not an address
        raise ExchangeError("from_dlpack of Metal memory is not supported yet")
    target = _device_for(device_type, device_id, device)
    stream = target.queue.handle if device_type == KDLCUDA else None
    try:
        capsule = obj.__dlpack__(stream=stream, max_version=DLPACK_VERSION)
    except TypeError:  # a producer of the protocol before max_version
        capsule = obj.__dlpack__() if stream is None else obj.__dlpack__(stream=stream)
    managed: DLManagedTensor | DLManagedTensorVersioned
    if capsule_valid(capsule, CAPSULE_NAME_VERSIONED):
        address = capsule_pointer(capsule, CAPSULE_NAME_VERSIONED)
        versioned = DLManagedTensorVersioned.from_address(address)
        # Refused before it is consumed: the capsule's own destructor then calls the
        # producer's deleter.
        if versioned.version.major > DLPACK_VERSION[0]:
            raise ExchangeError(
                f"the capsule is DLPack {versioned.version.major}.{versioned.version.minor}; "
                f"asyncmetal reads {DLPACK_VERSION[0]}.x"
            )
        if versioned.flags & FLAG_READ_ONLY:
            raise ExchangeError(
                "the array is read-only, and kernels and copies may write a Buffer: pass a "
                "writable array (or, for a host array used only as a copy's source, "
                "await asyncmetal.from_numpy(array))"
            )
        managed, used = versioned, USED_NAME_VERSIONED
    elif capsule_valid(capsule, CAPSULE_NAME):
        address = capsule_pointer(capsule, CAPSULE_NAME)
        managed, used = DLManagedTensor.from_address(address), USED_NAME
    else:
        raise ArgumentTypeError("__dlpack__ returned no unconsumed DLPack capsule")
    tensor: DLTensor = managed.dl_tensor
    ndim = tensor.ndim
    shape = tuple(tensor.shape[:ndim])
    strides = tuple(tensor.strides[:ndim]) if tensor.strides else None
    nbytes = _nbytes(shape, strides, tensor.dtype.bits * tensor.dtype.lanes)
    data = (tensor.data or 0) + tensor.byte_offset
    capsule_set_name(capsule, used)  # consumed: the deleter is ours to call
    host = device_type != KDLCUDA
    memory = _Imported(obj, address, managed.deleter, data, nbytes if host else 0)
    return _buffer(target, memory, nbytes)


def _buffer(device: Device, memory: _Imported, nbytes: int) -> Buffer:
    if memory.array is not None:  # host memory: the handle carries its address
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
    indices = {d.pointer_index(address) for d in open_devices()} - {None}
    if not indices:
        raise InvalidArgumentError(
            "no open device holds the array's memory: open its cuda device first"
        )
    device = _device_for(KDLCUDA, indices.pop() or 0, device)
    stream = interface.get("stream")
    if stream is not None:  # the producer's stream: the default queue waits for it
        produced = device.adopt_stream(int(stream)).marker()
        device.queue.wait(produced.timeline, produced.value)
    memory = _Imported(obj, 0, None, address, 0)
    return _buffer(device, memory, nbytes)

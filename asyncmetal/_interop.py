"""Buffers in: ``from_dlpack`` makes a Buffer over another library's array, no copy.

It takes the producer's DLPack capsule -- asking the producer to order its pending work
before the device's default queue -- and owns it: the capsule's deleter runs once the
Buffer (and every view of it) is gone. A PyTorch tensor's capsule is asked for without
ordering, and the default queue waits, on the device, for the tensor's current stream
itself (PyTorch's own ordering costs more than the whole exchange otherwise).
``__cuda_array_interface__`` objects are taken too (their ``stream`` waited for the
same way). Neither stream is adopted: nothing watches it afterwards.
"""

from __future__ import annotations

import ctypes
import math
import sys
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import _native, backends
from ._allocator import Record, lenders
from ._buffer import Buffer
from ._buffer import foreign_buffer as _foreign_buffer
from ._device import Device, closing, devices_opened, open_devices
from ._dlpack import (
    ADDRESS_LIMIT,
    DLPACK_VERSION,
    EMPTY,
    KDLCPU,
    KDLCUDA,
    KDLCUDAHOST,
    KDLMETAL,
    NOT_CONTIGUOUS,
    READ_ONLY,
    TAKEN,
    Exports,
    export_dlpack,
    refuse,
    take_capsule,
)
from ._errors import (
    ArgumentTypeError,
    AsyncMetalError,
    ClosedResourceError,
    ExchangeError,
    InvalidArgumentError,
    as_int,
)
from ._queue import Queue


class _Imported:
    """The producer's tensor, owned by a Buffer: the capsule's owner calls its deleter
    once that is gone (both ``held``, until the buffer is freed: see
    ``_allocator.let_go_after_uses``). Host memory carries ``address`` and ``array``,
    as the cpu backend's buffers do (the array made at its first use: most buffers are
    only launched on). Host memory's is also the handle its buffer's commands hold until
    they ran, and holds the record of uses of the memory (``record``): a buffer dropped while its
    commands run leaves that record to them, so that one made over the memory again
    meanwhile still shares it, and is ordered after them. It is its buffer's owner too
    (``Block.owner``): a copy of another kind's queue holds a view of the memory only,
    not this, so a buffer dropped with such a copy in flight holds it until it ran."""

    __slots__ = ("_array", "address", "held", "nbytes", "record")

    def __init__(self, producer: object, owner: object, address: int, nbytes: int) -> None:
        # (the producer kept alive too, as producers may expect)
        self.held: object = (producer, owner)
        self.address = address
        self.nbytes = nbytes
        self._array: np.ndarray[Any, Any] | None = None
        self.record: object = None  # (see above: the registry holds it weakly)

    def let_go(self) -> object:
        """``held``, given up (see ``_allocator.Owner``)."""
        held, self.held = self.held, None
        return held

    @property
    def array(self) -> np.ndarray[Any, Any]:
        if self._array is None:
            memory = (ctypes.c_uint8 * self.nbytes).from_address(self.address)
            self._array = np.frombuffer(memoryview(memory), np.uint8)
        return self._array


def _device_for(device_type: int, device_id: int, given: Device | None) -> Device:
    """The open device whose memory DLPack calls (device_type, device_id): ``given``,
    checked, or the first one open whose close has not begun (the host kind's device 0
    first for host memory)."""
    if device_type == KDLCUDAHOST:  # pinned host memory: host memory to asyncmetal
        device_type, device_id = KDLCPU, 0
    where = (device_type, device_id)
    if given is not None:
        if not isinstance(given, Device):
            raise ArgumentTypeError(f"device must be a Device, got {type(given).__name__}")
        if given.closed:
            raise ClosedResourceError(f"device {given.name} is closed")
        if not given.writable:  # (npy: from_numpy's sources, ordered with no other kind's)
            raise InvalidArgumentError(
                f"{given.name} buffers are read-only sources (asyncmetal.from_numpy): "
                "from_dlpack makes buffers of cpu (host memory) or cuda:N"
            )
        if given.dlpack_device != where:
            raise InvalidArgumentError(f"the array is on DLPack device {where}, not {given.name}")
        return given
    opened = devices_opened()  # (before the listing: a device opening meanwhile is newer)
    found_last = _last_found.get(where)
    if found_last is not None and found_last[1] == opened:
        last = found_last[0]()
        if last is not None and not closing(last):
            return last
    found = [d for d in open_devices() if d.writable and d.dlpack_device == where]
    closing_names = [d.name for d in found if closing(d)]
    found = [d for d in found if not closing(d)]
    found.sort(key=lambda d: d.name not in (backends.HOST, f"{backends.HOST}:0"))
    if not found and closing_names:
        raise ClosedResourceError(
            f"the open devices that hold DLPack device {where}'s memory are closing "
            f"({', '.join(closing_names)}): open another, or pass device="
        )
    if not found:
        raise InvalidArgumentError(
            f"no open device holds DLPack device {where}'s memory: open it first "
            "(cpu for host memory, cuda:N for CUDA memory), or pass device="
        )
    _last_found[where] = (weakref.ref(found[0]), opened)
    return found[0]


# The device each DLPack device was found on last, while it is open (weakly) and no
# device has opened since (which may be the one to pick: cpu before cpu:1).
_last_found: dict[tuple[int, int], tuple[weakref.ref[Device], int]] = {}


def from_dlpack(obj: Any, *, device: Device | None = None) -> Buffer:
    """A Buffer over the memory of ``obj`` -- a numpy, PyTorch, CuPy or JAX array, any
    object with ``__dlpack__`` or ``__cuda_array_interface__`` -- without copying.

    The buffer is on the open device the memory lives on (or ``device``, which must be
    that one): host memory on the open ``cpu`` (or on the device one of whose buffers
    lent it out, coming back), CUDA memory on the open ``cuda:N`` -- never, unless
    given, on a device whose close has begun (ClosedResourceError where only such
    devices could take it). The producer's pending work on it comes before the
    device's default queue, and so before every command that orders itself after the
    buffer (copies do; launches with ``queue.after(buf)``). The array must be
    C-contiguous and writable (and unmasked: ``__cuda_array_interface__``'s ``mask``).
    It is kept alive while the buffer is, until it is freed -- freed or dropped, until
    the commands that used the buffer ran (see ``_allocator.lingering``), and while an
    array exported from the buffer lives; freeing the buffer gives nothing back to the
    allocator (the memory is the producer's), but lets go of the array (and of a buffer
    of asyncmetal's own that lent it out, coming back). A producer that fails to export (its
    own error: JAX's for int4, which DLPack has no type for) raises ExchangeError,
    chained from that error. Never blocks.
    """
    if not hasattr(obj, "__dlpack__"):
        name = "__cuda_array_interface__"  # (JAX's own error for bfloat16: no AttributeError)
        interface = _asked(obj, name, getattr, obj, name, _NO_INTERFACE)
        if interface is not _NO_INTERFACE:
            return _from_cuda_array_interface(obj, interface, device)
        raise ArgumentTypeError(
            "from_dlpack takes an object with __dlpack__ or __cuda_array_interface__, "
            f"got {type(obj).__name__}"
        )
    exported = obj._exported() if isinstance(obj, Exports) else None
    if exported is not None:  # (freed, or its device closed: said as such first)
        exported[0]._check_usable("buffer")
    device_type, device_id = _dlpack_device(obj)
    if device_type == KDLMETAL:  # an MTLBuffer and an offset, not an address
        raise ExchangeError("from_dlpack of Metal memory is not supported yet")
    target = _device_for(device_type, device_id, device)
    # Device memory: the queue that orders after the producer's work (asked once).
    own = target._own_queue() if device_type == KDLCUDA else None
    producer = None
    torch = sys.modules.get("torch")
    if own is not None and torch is not None and isinstance(obj, torch.Tensor):
        producer = _tensor_stream(obj, torch, device_id)  # (its CUDA device's index)
    if producer is not None:
        # PyTorch's own ordering (an event and an external-stream wrapper made in Python
        # on every call) costs more than the rest of the exchange: the capsule is asked
        # for without it (-1), and the default queue waits for the tensor's stream itself.
        stream: int | None = -1
    else:
        stream = None if own is None else own.handle
    source: Buffer | None = None  # one of asyncmetal's own buffers, coming back
    try:
        if exported is not None:
            # Its memory is lent even while a command uses it: the buffer made of it
            # shares its record of uses (below), so commands order themselves after it.
            source, dtype, shape = exported
            if not source.device.writable:  # (refused as read-only: it is a source already)
                raise ExchangeError(
                    f"{source!r} is a read-only source already (asyncmetal.from_numpy), "
                    "and kernels and copies may write a Buffer: use it as a copy's source "
                    "as it is, or copy it into a buffer to write"
                )
            capsule = export_dlpack(
                source, dtype, shape, stream=stream, max_version=DLPACK_VERSION, ordered=True
            )
        else:
            try:
                capsule = obj.__dlpack__(stream=stream, max_version=DLPACK_VERSION)
            except TypeError:  # a producer of the protocol before max_version
                capsule = obj.__dlpack__() if stream is None else obj.__dlpack__(stream=stream)
    except AsyncMetalError:  # (a round trip of asyncmetal's own: its errors as they are)
        raise
    except BufferError as refused:  # the protocol's refusal (numpy: byte order, dtype)
        raise ExchangeError(f"{type(obj).__name__} refused to export: {refused}") from refused
    except Exception as failed:  # its own error (JAX: int4, which DLPack has no type for)
        raise _failed(obj, "__dlpack__", failed) from failed
    found = (_taker.chosen or _taker())(capsule)  # (chosen once: no call to look it up)
    if found[0] != TAKEN:
        raise refuse(found)
    _, owner, data, nbytes, tensor_type, tensor_id = found
    if (tensor_type != device_type or tensor_id != device_id) and not (
        tensor_type in _HOST and device_type in _HOST  # pinned or not: host memory
    ):
        raise ExchangeError(
            f"the capsule's tensor is on DLPack device {(tensor_type, tensor_id)}, but "
            f"__dlpack_device__ said {(device_type, device_id)}"
        )
    memory = _Imported(obj, owner, data, nbytes)
    shares: Record | None = None if source is None else source._allocation.block
    if device is None and device_type in _HOST:
        lent = _lender(data, nbytes)
        if lent is not None:  # one of its buffers lent it: the record shared, found once
            target, lent_block = lent
            if shares is None:
                shares = lent_block
    if own is None:
        buf = _foreign_buffer(target._state, memory, nbytes, memory, None, shares)
        memory.record = buf._allocation.block.memory
        return buf
    after = own._after_stream(producer) if producer is not None else own.marker()
    return _foreign_buffer(target._state, data, nbytes, memory, (own, after.value))


_HOST = (KDLCPU, KDLCUDAHOST)
_NO_INTERFACE = object()  # (an object without __cuda_array_interface__)


def lent_memory(device: Device, view: memoryview, address: int) -> Buffer:
    """A Buffer of ``device`` over host memory one of its buffers lent out (``view``, at
    ``address``), sharing that buffer's record of uses (see ``foreign_buffer``)."""
    return _buffer(device, _Imported(view, None, address, view.nbytes), None)


def _lender(address: int, nbytes: int) -> tuple[Device, Record] | None:
    """The open device one of whose buffers lent this host memory out, now coming back
    (``cpu:1``'s, say, where ``cpu`` would be picked), and that buffer's block (or the
    foreign memory it is over: see ForeignMemory): there the buffer shares the lender's
    record of uses, and so its ordering. None where its close has begun: the buffer is
    then on the device picked otherwise, which shares that record too where it is of
    the lender's kind, until the lender's close has ended."""
    if not lenders:  # no memory went out: none comes back (no device looked through)
        return None
    for device in open_devices():
        block = device._allocator.exported_block(address, nbytes) if device.writable else None
        if block is not None:
            return None if closing(device) else (device, block)
    return None


def _dlpack_device(obj: Any) -> tuple[int, int]:
    """``obj.__dlpack_device__()``, checked; for a PyTorch CUDA tensor read in two C calls
    (its ``__dlpack_device__`` is Python that makes a device object and an enum first)."""
    torch = sys.modules.get("torch")
    if (
        torch is not None
        and type(obj) is torch.Tensor  # (a subclass may answer otherwise)
        and obj.is_cuda
        and torch.version.hip is None  # (ROCm memory says kDLROCM)
    ):
        return KDLCUDA, obj.get_device()
    dlpack_device = getattr(obj, "__dlpack_device__", None)
    if dlpack_device is None:
        raise ArgumentTypeError(
            f"{type(obj).__name__} has __dlpack__ but no __dlpack_device__, which DLPack asks for"
        )
    where = _asked(obj, "__dlpack_device__", dlpack_device)
    if where.__class__ is tuple and len(where) == 2:
        kind, index = where
        if kind.__class__ is int and index.__class__ is int:  # (numpy's: as_int's own)
            return where
    try:
        kind, index = where
    except (TypeError, ValueError):  # not a pair
        kind = index = None
    device_type, device_id = as_int(kind), as_int(index)
    if device_type is None or device_id is None:
        raise ArgumentTypeError(
            f"{type(obj).__name__}.__dlpack_device__() returned {where!r}: expected a "
            "(device type, device index) pair of ints"
        )
    return device_type, device_id


def _failed(obj: object, call: str, failed: Exception) -> ExchangeError:
    """The error for a producer's ``call`` that raised ``failed``, an exception of its
    own -- not the protocol's BufferError (KeyboardInterrupt and cancellation are no
    Exception: they pass as they are)."""
    return ExchangeError(
        f"{type(obj).__name__}.{call} failed with {type(failed).__name__}: {failed}"
    )


def _asked(obj: object, call: str, ask: Callable[..., Any], *args: Any) -> Any:
    """``ask(*args)``, a producer's ``call``: its own error (an Exception, not
    asyncmetal's) raised as ExchangeError (``_failed``)."""
    try:
        return ask(*args)
    except AsyncMetalError:
        raise
    except Exception as failed:
        raise _failed(obj, call, failed) from failed


def _torch_stream(obj: Any) -> int | None:
    """For a PyTorch CUDA tensor: the handle of its device's current stream (the stream
    its ``__dlpack__`` would order on); else None -- also where that is the per-thread
    default stream, which a queue cannot wait for (PyTorch then orders it itself)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor):
        return None
    return _tensor_stream(obj, torch, None)


def _tensor_stream(obj: Any, torch: Any, index: int | None) -> int | None:
    """``_torch_stream`` of ``obj``, a tensor of module ``torch`` (``index``: its device's,
    where already read)."""
    # The raw handle in one call (what PyTorch's compiled code asks for on every launch):
    # torch.cuda.current_stream() makes a Stream object in Python first.
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        handle: int = raw(obj.get_device() if index is None else index)
    else:
        handle = torch.cuda.current_stream(obj.device).cuda_stream
    return None if handle == _PER_THREAD_STREAM else handle


_PER_THREAD_STREAM = 2  # CU_STREAM_PER_THREAD


# How a capsule is taken: the extension's one call where it is loaded, else ctypes (the
# runtime is loaded by then: an open device loaded it).
_taker = _native.ExtensionCall("dlpack_take", take_capsule)


def _buffer(device: Device, memory: _Imported, queue: Queue | None) -> Buffer:
    """A Buffer of ``device`` over ``memory``: host memory (``queue`` None), whose
    handle carries its address; or device memory, whose handle is its address, and
    whose later commands order themselves after a marker on ``queue`` behind what the
    producer made that queue wait for."""
    if queue is None:
        buf = _foreign_buffer(device._state, memory, memory.nbytes, memory, None)
        memory.record = buf._allocation.block.memory
        return buf
    after = queue.marker()
    return _foreign_buffer(
        device._state, memory.address, memory.nbytes, memory, (queue, after.value)
    )


def _interface(interface: object) -> tuple[int, int, int | None]:
    """``__cuda_array_interface__`` checked as a capsule is (``take_capsule``): the
    memory's address and size, and the producer's stream (None: none named). Refused as
    a capsule would be: read-only memory (its ``data`` flag), a mask (elements it marks
    are no data), no C-contiguous elements, none at all, no memory; malformed fields
    raise ExchangeError, as a malformed capsule does."""
    if not isinstance(interface, Mapping):
        raise ArgumentTypeError(
            f"__cuda_array_interface__ must be a dict, got {type(interface).__name__}"
        )
    shape = _ints(interface.get("shape"), "shape")
    typestr = interface.get("typestr")
    try:
        dtype = np.dtype(typestr) if isinstance(typestr, str) else None
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.hasobject or not dtype.itemsize:
        raise _malformed(f"typestr {typestr!r} is no numpy type of plain data")
    data = interface.get("data")
    pointer = read_only = None
    if isinstance(data, tuple | list) and len(data) == 2:
        pointer, read_only = data
    address = as_int(pointer)
    if address is None or not isinstance(read_only, bool | np.bool_ | int):
        raise _malformed(f"data must be an (address, read-only) pair, got {data!r}")
    if interface.get("mask") is not None:
        raise ExchangeError(
            "the array is masked (its __cuda_array_interface__'s mask): pass one without"
        )
    strides = interface.get("strides")
    if strides is not None:
        strides = _ints(strides, "strides")
        if len(strides) != len(shape):
            raise _malformed(f"strides {strides!r} do not match shape {shape!r}")
    if not math.prod(shape):
        raise refuse((EMPTY,))
    if strides is not None:
        expected = dtype.itemsize
        for n, stride in zip(reversed(shape), reversed(strides), strict=True):
            if n != 1 and stride != expected:
                raise refuse((NOT_CONTIGUOUS,))
            expected *= n
    if read_only:
        raise refuse((READ_ONLY,))
    nbytes = math.prod(shape) * dtype.itemsize
    if not address:
        raise _malformed("no data")
    if address < 0 or address + nbytes >= ADDRESS_LIMIT:
        raise _malformed("an address past the address space")
    stream = interface.get("stream")
    handle = None if stream is None else as_int(stream)
    if stream is not None and handle is None:
        raise _malformed(f"stream must be None or an int, got {stream!r}")
    if handle == 0:
        raise InvalidArgumentError(
            "the array's stream is 0, which __cuda_array_interface__ disallows (it would "
            "be ambiguous): its producer names its stream (1: the legacy stream)"
        )
    return address, nbytes, handle


def _ints(value: object, what: str) -> tuple[int, ...]:
    """A tuple of ints of an interface (``shape``: none negative), checked."""
    items = [as_int(n) for n in value] if isinstance(value, tuple | list) else [None]
    ints = tuple(n for n in items if n is not None and (n >= 0 or what != "shape"))
    if len(ints) != len(items):
        raise _malformed(f"{what} must be a tuple of ints (extents >= 0), got {value!r}")
    return ints


def _malformed(what: str) -> ExchangeError:
    return ExchangeError(f"the array's __cuda_array_interface__ is malformed: {what}")


def _from_cuda_array_interface(obj: Any, interface: object, device: Device | None) -> Buffer:
    address, nbytes, stream = _interface(interface)
    indices = {d._pointer_index(address) for d in open_devices()} - {None}
    if not indices:
        raise InvalidArgumentError(
            "no open device holds the array's memory: open its cuda device first"
        )
    device = _device_for(KDLCUDA, indices.pop() or 0, device)
    memory = _Imported(obj, None, address, nbytes)
    queue = device._own_queue()
    if stream is None:
        return _buffer(device, memory, queue)
    # The producer's stream: the default queue waits, on the device, for what was
    # submitted there until now (the stream is not adopted), and so do later commands.
    after = queue._after_stream(stream)
    return _foreign_buffer(device._state, address, nbytes, memory, (queue, after.value))

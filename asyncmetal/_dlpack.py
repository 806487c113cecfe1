"""DLPack and ``__cuda_array_interface__``: buffers shared with numpy, PyTorch, CuPy and
JAX without copying.

Buffers out. A Buffer exports its bytes as a 1-D ``uint8`` tensor; ``buf.typed(dtype,
shape)`` exports the same memory typed (a C-contiguous array of ``shape``). The capsule's
manager holds the memory: the allocator neither releases nor reuses it until the consumer
calls the deleter (on any thread), even if the Buffer is freed meanwhile. A memory still
held when its device closes is left allocated. Ordering: on a device with streams the
consumer's stream waits, on the device, for the commands that use the buffer (the
backend's ``order_stream``: on cuda, on each queue's event, or its timeline word for a
command still held on the host); the stream is not adopted, so no queue or completion
thread is made per consumer stream. A command held on the host behind a wait for a host
queue's command (cpu, npy) that has not run cannot be waited for on the device, and the
export does not block: it raises ``BufferError`` naming that command. Host memory (cpu,
npy, Metal's shared storage) has no stream to wait on, so exporting it while a command
that uses it is in flight raises ``BufferError`` (await that command first) -- but to
asyncmetal's own ``from_dlpack``, whose buffer shares the record of uses.
``copy=True`` (the array API's) exports a copy of host memory, as kDLCPU, made at once.
ml_dtypes' types of fewer than 8 bits, one a byte in numpy, export flagged padded
(DLPack 1.1), to consumers that ask for 1.1 or later only. ``__cuda_array_interface__``
has no type string for ml_dtypes' one-byte types (see :func:`cuda_array_interface`).
The capsule is made in one call of the native extension (``native/py_dlpack.c``'s
``dlpack_export``), else through numpy and ctypes (:func:`numpy_capsule`): the same
tensor either way.

Buffers in. ``from_dlpack(obj)`` takes a producer's DLPack capsule (asking it to order
its work before the device's default queue) and makes a Buffer over that memory, on the
open device it lives on; the capsule's deleter runs once that Buffer is gone. Elements
of fewer than 8 bits are packed, unless a versioned capsule flags them padded.

The structures are DLPack 1.x's (``dlpack.h``); a versioned capsule is made when the
consumer asks for ``max_version >= (1, 0)``, the legacy one otherwise.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _native
from ._errors import (
    ArgumentTypeError,
    ExchangeError,
    InvalidArgumentError,
    Singular,
    as_int,
)

# The buffers here are asyncmetal Buffers, typed Any: _buffer imports this module, and
# layers depend downward only.
Buffer = Any

KDLCPU, KDLCUDA, KDLCUDAHOST, KDLMETAL = 1, 2, 3, 8
# DLPack's type codes and bits of ml_dtypes' types (JAX's and PyTorch's), by name. Those
# of fewer than 8 bits numpy holds one a byte: exported flagged padded (DLPack 1.1).
_ML_DTYPES = {
    "int2": (0, 2),
    "int4": (0, 4),
    "uint2": (1, 2),
    "uint4": (1, 4),
    "float4_e2m1fn": (17, 4),
    "float6_e2m3fn": (15, 6),
    "float6_e3m2fn": (16, 6),
    "bfloat16": (4, 16),
    "float8_e3m4": (7, 8),
    "float8_e4m3": (8, 8),
    "float8_e4m3b11fnuz": (9, 8),
    "float8_e4m3fn": (10, 8),
    "float8_e4m3fnuz": (11, 8),
    "float8_e5m2": (12, 8),
    "float8_e5m2fnuz": (13, 8),
    "float8_e8m0fnu": (14, 8),
}
DLPACK_VERSION = (1, 1)
FLAG_READ_ONLY = 1
FLAG_IS_COPIED = 2
FLAG_SUBBYTE_PADDED = 4  # elements of fewer than 8 bits one a byte, not packed
_STREAM_NONE = -1  # the consumer asks for no ordering at all


class DLDevice(ctypes.Structure):
    _fields_ = (("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32))


class DLDataType(ctypes.Structure):
    _fields_ = (("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16))


class DLTensor(ctypes.Structure):
    _fields_ = (
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    )


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # void (*)(DLManagedTensor*)


class DLManagedTensor(ctypes.Structure):
    _fields_ = (("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter))


class DLPackVersion(ctypes.Structure):
    _fields_ = (("major", ctypes.c_uint32), ("minor", ctypes.c_uint32))


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = (
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", _Deleter),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    )


_api = ctypes.pythonapi
capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api)
)
capsule_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api)
)
capsule_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_SetName", _api)
)
# Names must outlive every capsule: module-level buffers.
CAPSULE_NAME = ctypes.create_string_buffer(b"dltensor")
CAPSULE_NAME_VERSIONED = ctypes.create_string_buffer(b"dltensor_versioned")
USED_NAME = ctypes.create_string_buffer(b"used_dltensor")
USED_NAME_VERSIONED = ctypes.create_string_buffer(b"used_dltensor_versioned")
# Where a capsule's DLTensor starts in its managed tensor.
_TENSOR_AT = {
    CAPSULE_NAME.value: 0,
    CAPSULE_NAME_VERSIONED.value: DLManagedTensorVersioned.dl_tensor.offset,
}

# What taking a producer's capsule found: the first item of take_capsule's tuple (and of
# the extension's dlpack_take, native/py_dlpack.c, which does the same in one call).
TAKEN, NO_CAPSULE, NEWER_VERSION, READ_ONLY, EMPTY, NOT_CONTIGUOUS, MALFORMED = range(7)
_SIZE_LIMIT = (1 << 63) - 8  # bytes' bits + 7 fit an int64, as in C
ADDRESS_LIMIT = 1 << (8 * ctypes.sizeof(ctypes.c_void_p))  # where memory would end


class _Owner:
    """Calls a taken capsule's deleter once collected (the extension's owner is a
    capsule whose destructor does the same)."""

    __slots__ = ("_deleter", "_managed")

    def __init__(self, managed: int, deleter: Any) -> None:
        self._managed = managed
        self._deleter = deleter

    def __del__(self) -> None:
        if self._deleter:
            self._deleter(self._managed)


def take_capsule(capsule: object) -> tuple[Any, ...]:
    """Check a producer's capsule and take it (renamed ``used_dltensor[_versioned]``):
    ``(TAKEN, owner, data, nbytes, device_type, device_id)``, where collecting ``owner``
    calls the producer's deleter (``nbytes``: elements of fewer than 8 bits packed, or
    one a byte where a versioned capsule flags them padded); else ``(status,
    *details)``, the capsule left as it was (its own destructor then calls the
    deleter). Through ctypes: the extension's ``dlpack_take`` is the same in one call."""
    managed: DLManagedTensor | DLManagedTensorVersioned
    padded = False  # (a legacy capsule has no flags: packed)
    if capsule_valid(capsule, CAPSULE_NAME_VERSIONED):
        address = capsule_pointer(capsule, CAPSULE_NAME_VERSIONED)
        versioned = DLManagedTensorVersioned.from_address(address)
        if versioned.version.major > DLPACK_VERSION[0]:
            return NEWER_VERSION, versioned.version.major, versioned.version.minor
        if versioned.flags & FLAG_READ_ONLY:
            return (READ_ONLY,)
        padded = bool(versioned.flags & FLAG_SUBBYTE_PADDED)
        managed, used = versioned, USED_NAME_VERSIONED
    elif capsule_valid(capsule, CAPSULE_NAME):
        address = capsule_pointer(capsule, CAPSULE_NAME)
        managed, used = DLManagedTensor.from_address(address), USED_NAME
    else:
        return (NO_CAPSULE,)
    tensor: DLTensor = managed.dl_tensor
    ndim = tensor.ndim
    if ndim < 0:
        return MALFORMED, "a negative ndim"
    if ndim and not tensor.shape:
        return MALFORMED, "no shape"
    shape = tensor.shape[:ndim]
    count = 1
    for n in shape:
        if n < 0:
            return MALFORMED, "a negative extent"
        if n == 0:
            return (EMPTY,)
        count *= n
    if count >= 1 << 64:
        return MALFORMED, "a size past 64 bits"
    if tensor.strides:
        expected = 1
        for n, stride in zip(reversed(shape), reversed(tensor.strides[:ndim]), strict=True):
            if n != 1 and stride != expected:
                return (NOT_CONTIGUOUS,)
            expected *= n
    each = tensor.dtype.bits
    if padded and 0 < each < 8:
        each = 8
    bits = count * each * tensor.dtype.lanes
    if not bits:
        return MALFORMED, "a zero-sized element type"
    if bits > _SIZE_LIMIT:
        return MALFORMED, "a size past 64 bits"
    # No memory, or memory that would end past the address space: a Buffer over it
    # would have kernels and copies write wherever the sum wrapped to.
    if not tensor.data:
        return MALFORMED, "no data"
    data = tensor.data + tensor.byte_offset
    if data + (bits + 7) // 8 >= ADDRESS_LIMIT:  # (as in C: the end fits a pointer)
        return MALFORMED, "an address past the address space"
    capsule_set_name(capsule, used)  # consumed: the deleter is ours to call
    device = tensor.device
    owner = _Owner(address, managed.deleter)
    return TAKEN, owner, data, (bits + 7) // 8, device.device_type, device.device_id


def refuse(found: tuple[Any, ...]) -> BaseException:
    """The error for what :func:`take_capsule` (or the extension) found, not TAKEN."""
    status = found[0]
    if status == NEWER_VERSION:
        return ExchangeError(
            f"the capsule is DLPack {found[1]}.{found[2]}; asyncmetal reads {DLPACK_VERSION[0]}.x"
        )
    if status == READ_ONLY:
        return ExchangeError(
            "the array is read-only, and kernels and copies may write a Buffer: pass a "
            "writable array (or, for a host array used only as a copy's source, "
            "await asyncmetal.from_numpy(array))"
        )
    if status == EMPTY:
        return InvalidArgumentError("the array is empty")
    if status == NOT_CONTIGUOUS:
        return InvalidArgumentError(
            "the array is not C-contiguous: make it contiguous before sharing it"
        )
    if status == MALFORMED:
        return ExchangeError(f"the capsule's tensor is malformed: {found[1]}")
    return ArgumentTypeError("__dlpack__ returned no unconsumed DLPack capsule")


class Loan:
    """Ends a buffer's loan of its memory when collected: the exported array's memory
    object (or a mapped view's base) holds it, and the consumer's deleter lets that go
    (on any thread). Where an interrupt cuts ``__del__`` before ``release`` is called,
    the loan still ends, as ``release`` goes with this (see Allocator.lend)."""

    __slots__ = ("release",)

    def __init__(self, release: Callable[[], None]) -> None:
        self.release = release

    def __del__(self) -> None:
        try:
            release = self.release
        except AttributeError:  # an interrupt at __init__'s entry: it holds no loan (the
            return  # ``release`` it was given goes, which ends that loan)
        release()


def _no_release(*held: object) -> None:
    """What a loan whose capsule was never made ends with: nothing (the caller ends it);
    also a copy's export's end (its arguments, the copy, were kept alive until then)."""


_dtype_codes: dict[np.dtype[Any], tuple[int, int]] = {}
_USER_TYPES = 256  # NPY_USERDEF: the types numpy does not define itself number from here
_KINDS = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}


def dtype_code(dtype: np.dtype[Any]) -> tuple[int, int]:
    """DLPack's (type code, bits) for a numpy dtype."""
    known = _dtype_codes.get(dtype)
    if known is not None:
        return known
    named = _ML_DTYPES.get(dtype.name) if dtype.num >= _USER_TYPES else None
    # ml_dtypes' (those of fewer than 8 bits held one a byte)
    if named is not None and max(named[1], 8) == dtype.itemsize * 8:
        known = _dtype_codes[dtype] = named
        return known
    if (
        dtype.kind not in _KINDS
        or dtype.num >= _USER_TYPES  # (float8_e5m2 says kind "f": not an IEEE float)
        or dtype.fields is not None
        or dtype.subdtype is not None
    ):
        raise ArgumentTypeError(
            "DLPack exports ints, unsigned ints (int4 and int2 too), floats (bfloat16, "
            f"float8, float6 and float4 too), complex and bools, not {dtype}"
        )
    known = _dtype_codes[dtype] = _KINDS[dtype.kind], dtype.itemsize * 8
    return known


def _export_code(dtype: np.dtype[Any]) -> tuple[int, int]:
    """:func:`dtype_code`, and numpy's refusals of what a consumer would misread (as
    numpy's own ``__dlpack__`` words them, which the fallback calls)."""
    known = _export_codes.get(dtype)
    if known is not None:
        return known
    code, bits = dtype_code(dtype)
    if not dtype.isnative:
        raise ExchangeError("DLPack only supports native byte order.")
    if (dtype.kind == "f" and bits > 64) or (dtype.kind == "c" and bits > 128):
        raise ExchangeError(
            "DLPack only supports IEEE floating point types without padding (longdouble "
            "typically is not IEEE)."
        )
    known = _export_codes[dtype] = code, bits
    return known


_export_codes: dict[np.dtype[Any], tuple[int, int]] = {}


def dlpack_device(buffer: Buffer) -> tuple[int, int]:
    """``__dlpack_device__`` of a buffer: (device type, device index)."""
    return device_dlpack(buffer._export_state())


def device_dlpack(state: Any) -> tuple[int, int]:
    """The DLPack (device type, index) of a device's state: its backend says the type;
    host memory is device 0, other memory the device's own index (``cuda:1`` is 1)."""
    backend = state.backend
    kind = backend.dlpack_device_type
    if not kind:
        raise ExchangeError(f"{state.name} buffers have no DLPack device type")
    if backend.host_visible:
        return kind, 0
    name = state.name
    index = _indices.get(name)
    if index is None:
        index = _indices[name] = int(name.partition(":")[2] or 0)
    return kind, index


_indices: dict[str, int] = {}  # a device name's index ("cuda:1": 1), read once


def export_dlpack(
    buffer: Buffer,
    dtype: Any = np.uint8,
    shape: tuple[int, ...] | None = None,
    *,
    stream: int | None = None,
    max_version: tuple[int, int] | None = None,
    dl_device: tuple[int, int] | None = None,
    copy: bool | None = None,
    ordered: bool = False,
) -> object:
    """``buffer.__dlpack__``: a capsule of ``buffer``'s memory as ``dtype`` of ``shape``.
    ``ordered``: the consumer is asyncmetal's ``from_dlpack``, whose buffer shares
    ``buffer``'s record of uses, so host memory still in use is lent all the same."""
    buffer._check_usable("buffer")
    state = buffer._export_state()
    device_type, device_id = device_dlpack(state)
    if not isinstance(dtype, np.dtype):  # a Buffer's and a TypedView's are already
        dtype = np.dtype(dtype)
    code, bits = _export_code(dtype)
    if shape is None:
        shape = (buffer.nbytes // dtype.itemsize,)
    if max_version is None:
        version = (0, 0)
    elif (  # (what consumers pass: a pair of ints, taken as it is)
        max_version.__class__ is tuple
        and len(max_version) == 2
        and max_version[0].__class__ is int
        and max_version[1].__class__ is int
    ):
        version = max_version
    else:
        version = _pair(max_version, "max_version")
    versioned = version >= (1, 0)
    # numpy holds elements of fewer than 8 bits one a byte: DLPack 1.1 flags them padded
    # (a consumer of an older version would read them packed).
    flags = FLAG_SUBBYTE_PADDED if bits < 8 else 0
    if flags and version < (1, 1):
        raise ExchangeError(
            f"{dtype} elements are one a byte, which only DLPack 1.1's padded flag says: "
            "ask with max_version=(1, 1) or later"
        )
    if dl_device is not None or (copy is not None and copy is not False):
        copied = (code, bits, shape, stream, versioned, flags)  # (a host copy's)
        capsule = _moved_or_copied(buffer, state, dl_device, copy, copied)
        if capsule is not None:
            return capsule
    if not state.backend.writable:
        if not versioned:  # as numpy does: the legacy capsule has no flag
            raise ExchangeError(
                "the buffer is read-only and a legacy DLPack capsule cannot say so: ask with "
                "max_version=(1, 0) or later"
            )
        flags |= FLAG_READ_ONLY
    _order_for_consumer(buffer, state, stream, ordered)
    handle, release = buffer._lend()
    if device_type == KDLMETAL:  # the MTLBuffer, and the offset into it
        data, byte_offset = int(handle), buffer.offset
    else:  # an address (host memory objects carry theirs)
        data, byte_offset = int(getattr(handle, "address", handle)) + buffer.offset, 0
    try:
        return (_maker.chosen or _maker())(
            data,
            byte_offset,
            device_type,
            device_id,
            code,
            bits,
            shape,
            versioned,
            flags,
            release,
        )
    except BaseException:
        release()  # no capsule: the loan ends here
        raise


def _moved_or_copied(
    buffer: Buffer,
    state: Any,
    dl_device: tuple[int, int] | None,
    copy: bool | None,
    copied: tuple[int, int, tuple[int, ...], int | None, bool, int],
) -> object:
    """``export_dlpack`` asked for ``dl_device`` or ``copy`` (other than None, False):
    the capsule of a host copy where that is what is asked for (``copied``: the rest of
    ``_host_copy``'s arguments), None where the export goes on as one without them;
    refused where it cannot."""
    device_type, device_id = device_dlpack(state)
    target = (device_type, device_id) if dl_device is None else _pair(dl_device, "dl_device")
    moved = target != (device_type, device_id)
    if copy is not None and copy.__class__ is not bool and not isinstance(copy, np.bool_):
        # (a truthy string or number taken for True would copy where it was not meant)
        raise ArgumentTypeError(f"copy must be True, False or None, got {copy!r}")
    # A copy, as the array API asks for copy=True (or for another device, unless
    # copy=False): made of host memory into host memory, at once.
    if (copy or (moved and copy is None)) and state.backend.host_visible and target == (KDLCPU, 0):
        return _host_copy(buffer, state, *copied)
    if moved:
        raise ExchangeError(
            f"the buffer is on DLPack device {(device_type, device_id)}, not {target}:"
            " asyncmetal exports without copying there (copy it with asyncmetal.copy first)"
        )
    if copy:
        raise ExchangeError(
            f"asyncmetal exports {state.name} memory without copying: copy=True is supported "
            "for host memory exported as kDLCPU (dl_device=(1, 0))"
        )
    return None


def _pair(value: Any, what: str) -> tuple[int, int]:
    """``max_version`` or ``dl_device``: a pair of ints (IntEnums too), checked."""
    try:
        first, second = value
    except (TypeError, ValueError):  # not a pair
        first = second = None
    pair = as_int(first), as_int(second)
    if pair[0] is None or pair[1] is None:
        raise ArgumentTypeError(f"{what} must be a pair of ints or None, got {value!r}")
    return pair[0], pair[1]


def _host_copy(
    buffer: Buffer,
    state: Any,
    code: int,
    bits: int,
    shape: tuple[int, ...],
    stream: int | None,
    versioned: bool,
    flags: int,
) -> object:
    """A capsule of a new host array holding a copy of host-visible ``buffer``'s memory,
    as DLPack's type ``code`` and ``bits`` of ``shape`` (kDLCPU; versioned ones flagged
    as copied, and with ``flags``), made as a shared export's capsule is (numpy's own
    refuses ml_dtypes' types). It is read at once, so a command still using the memory
    is refused as for a shared export. The memory is lent (held) while it is read: a
    ``free()`` on another thread meanwhile cannot hand the block to another buffer,
    whose bytes the copy would read."""
    _order_for_consumer(buffer, state, stream)
    handle, release = buffer._lend()  # (refused if freed: checked and held at once)
    try:
        view = state.backend.host_view(handle, buffer.offset, buffer.nbytes)
        copy = np.frombuffer(view, np.uint8).copy()
        del view
    finally:
        release()
    if versioned:
        flags |= FLAG_IS_COPIED
    # The tensor holds the copy until it is deleted.
    held = functools.partial(_no_release, copy)
    data = copy.ctypes.data
    return _maker()(data, 0, KDLCPU, 0, code, bits, shape, versioned, flags, held)


def numpy_capsule(
    data: int,
    byte_offset: int,
    device_type: int,
    device_id: int,
    code: int,
    bits: int,
    shape: tuple[int, ...],
    versioned: bool,
    flags: int,
    release: Callable[[], None],
) -> object:
    """The capsule of a C-contiguous tensor of ``shape`` at ``data`` (+ ``byte_offset``)
    on ``(device_type, device_id)``, of DLPack's type ``code`` and ``bits`` (fewer than
    8: one a byte), versioned ones with ``flags``; deleting the tensor calls ``release``
    once, on any thread. Through numpy and ctypes: the extension's ``dlpack_export`` is
    the same in one call. Failing, it leaves ``release`` uncalled."""
    dtype = np.dtype(f"{_LETTERS[code]}{max(bits // 8, 1)}")
    nbytes = math.prod(shape) * dtype.itemsize
    # numpy makes the capsule (in C, and its deleter takes the GIL on whatever thread
    # calls it) of an array over the memory -- never read here: device memory, or a
    # Metal buffer's handle -- and the tensor's device is then set to the buffer's.
    memory: Any = (ctypes.c_uint8 * nbytes).from_address(data)  # carries the loan
    memory.loan = loan = Loan(release)
    try:
        array = np.frombuffer(memory, dtype).reshape(shape)
        if flags & FLAG_READ_ONLY:
            array.flags.writeable = False  # numpy's read-only flag
        try:
            capsule: object = array.__dlpack__(max_version=DLPACK_VERSION if versioned else None)
        except TypeError:  # a numpy before the versioned protocol
            capsule = array.__dlpack__()
    except BaseException:
        loan.release = _no_release
        raise
    name = (
        CAPSULE_NAME_VERSIONED if capsule_valid(capsule, CAPSULE_NAME_VERSIONED) else CAPSULE_NAME
    )
    address = capsule_pointer(capsule, name)
    if name is CAPSULE_NAME_VERSIONED:
        managed = DLManagedTensorVersioned.from_address(address)
        managed.flags |= flags
        # The version whose structures and flags these are, as the extension writes it:
        # numpy writes its own (1.0, which has no padded flag for sub-byte elements).
        managed.version.major, managed.version.minor = DLPACK_VERSION
    tensor = DLTensor.from_address(address + _TENSOR_AT[name.value])
    tensor.device = DLDevice(device_type, device_id)
    # (ml_dtypes': numpy made it of unsigned ints, one a byte)
    tensor.dtype.code, tensor.dtype.bits = code, bits
    if byte_offset:
        tensor.data, tensor.byte_offset = data, byte_offset
    return capsule


_LETTERS = {c: "u" for c, _ in _ML_DTYPES.values()} | {code: kind for kind, code in _KINDS.items()}
MakeCapsule = Callable[
    [int, int, int, int, int, int, tuple[int, ...], bool, int, Callable[[], None]], object
]


# How a capsule is made: the extension's one call where it is loaded, else numpy and
# ctypes (the runtime is loaded by then: the buffer's device loaded it).
_maker: _native.ExtensionCall[MakeCapsule] = _native.ExtensionCall("dlpack_export", numpy_capsule)


def _order_for_consumer(
    buffer: Buffer, state: Any, stream: int | None, ordered: bool = False
) -> None:
    """Make the consumer see the commands that use ``buffer``: its stream waits for them
    on the device; for host memory there is nothing to wait on, so they must be done
    (unless the consumer orders itself after them: ``ordered``)."""
    if isinstance(stream, (bool, np.bool_)):  # (not the legacy stream 1, nor 0)
        raise ExchangeError(f"DLPack's stream is an integer or None, got {stream!r}")
    if not state.backend.host_visible:  # device memory: a device with streams
        if stream == _STREAM_NONE:
            return
        if stream == 0:
            raise ExchangeError(
                "stream 0 is ambiguous for CUDA (DLPack): pass 1 for the legacy stream"
            )
        try:
            state.backend.order_stream(1 if stream is None else stream, buffer._pending_uses())
        except InvalidArgumentError as refused:  # the protocol's error for a consumer
            raise ExchangeError(str(refused)) from None
        return
    if stream is not None:
        raise ExchangeError(
            f"{state.name} buffers are host memory: DLPack's stream must be None for them, "
            f"got {stream!r}"
        )
    if not ordered and buffer.busy():
        raise ExchangeError(
            f"a command using this {state.name} buffer is still in flight: await it "
            "(or queue.marker()) before sharing the memory, which the consumer reads at once"
        )


class Exports:
    """The exchange protocols of a buffer's memory, seen as :meth:`_exported` says:
    ``(buffer, dtype, shape)`` (shape None: 1-D)."""

    __slots__ = ()

    def _exported(self) -> tuple[Buffer, np.dtype[Any], tuple[int, ...] | None]:
        raise NotImplementedError

    # What the functions above ask of the buffer that _exported names (a Buffer
    # implements them):
    def _export_state(self) -> Any:
        """The DeviceState of the buffer's device (backend, name, its default queue)."""
        raise NotImplementedError

    def _pending_uses(self) -> list[tuple[Any, int]]:
        """(native timeline, value) of each queue whose last command using the memory
        has not finished: what a consumer's stream waits for."""
        raise NotImplementedError

    def _check_usable(self, what: str) -> None:
        """Raise if the buffer cannot be used now (freed, its device closed)."""
        raise NotImplementedError

    def _lend(self, hold: bool = True) -> tuple[Any, Callable[[], None]]:
        """The native handle of the memory, and a function that ends the loan: until it
        is called (once, on any thread, even inside the GC) the memory is neither
        released nor reused, even once the buffer is freed (``hold`` False: no loan)."""
        raise NotImplementedError

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> object:
        """A DLPack capsule of the memory, no copy (array API semantics: versioned when
        ``max_version >= (1, 0)``). The consumer's ``stream`` waits, on the device, for
        the commands using the buffer; the memory stays valid while the consumer holds
        it, freed buffer or not. Host memory still used by a command raises BufferError.
        ``copy=True`` (or ``dl_device`` kDLCPU of host-visible memory on another DLPack
        device, ``copy`` not False) gives a capsule of a host copy of host memory."""
        buffer, dtype, shape = self._exported()
        return export_dlpack(
            buffer,
            dtype,
            shape,
            stream=stream,
            max_version=max_version,
            dl_device=dl_device,
            copy=copy,
        )

    def __dlpack_device__(self) -> tuple[int, int]:
        """(DLPack device type, index): kDLCPU for cpu and npy, kDLCUDA, kDLMetal."""
        return dlpack_device(self._exported()[0])

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Version 3 of the CUDA array interface (cuda buffers only), with ``stream``;
        none for ml_dtypes' one-byte types, which it has no type string for (DLPack
        carries them); bfloat16 is ``<V2``, as PyTorch gives it."""
        return cuda_array_interface(*self._exported())


def items_shape(nbytes: int, dtype: np.dtype[Any], shape: Any) -> tuple[int, ...]:
    """The shape of the ``dtype`` items ``nbytes`` hold: 1-D for ``shape`` None, else
    ``shape``, an int or a sequence of ints (numpy ints too) of which one may be -1 (as
    many as the rest leave) -- no other negative one, which numpy's ``reshape`` would
    take as -1 --, checked to fill whole items and to take that shape, before anything
    is read."""
    if nbytes % dtype.itemsize:
        raise InvalidArgumentError(
            f"buffer of {nbytes} bytes is not a whole number of {dtype} items"
        )
    count = nbytes // dtype.itemsize
    if shape is None:
        return (count,)
    try:
        dims = tuple(as_int(d) for d in (shape if np.iterable(shape) else (shape,)))
        if None in dims:  # (not an integer, or a bool)
            raise TypeError
        if [d for d in dims if d < 0] in ([], [-1]):  # type: ignore[operator]
            # (a zero-stride array of that many items: reshaped without memory)
            return tuple(np.broadcast_to(np.empty(1, np.uint8), (count,)).reshape(dims).shape)
    except TypeError:
        raise ArgumentTypeError(f"shape must be an int or a tuple of ints, got {shape!r}") from None
    except ValueError:
        raise InvalidArgumentError(
            f"shape {shape!r} does not cover the buffer's {count} {dtype} items, as it must "
            "(to type a part, take a view of it first: buf.view(offset, nbytes))"
        ) from None
    raise InvalidArgumentError(
        f"shape {shape!r} has a negative dimension other than one -1 (which takes as many "
        "items as the other dimensions leave)"
    )


class TypedView(Exports, Singular):
    """A buffer's memory as a C-contiguous array of ``dtype`` and ``shape``, for export
    (``buf.typed(np.float32, (64, 64))``): ``torch.from_dlpack``, ``np.from_dlpack``,
    ``cupy.asarray`` take it. It holds nothing itself; an exported tensor holds the
    memory as a buffer's export does."""

    # (Read-only: an export trusts its dtype and shape to lie within the buffer.)
    __slots__ = ("_buffer", "_dtype", "_shape")

    def __init__(self, buffer: Buffer, dtype: Any, shape: Any = None) -> None:
        try:
            if dtype is None:  # (which numpy takes for float64)
                raise TypeError
            dtype = np.dtype(dtype)
        except (TypeError, ValueError):
            raise ArgumentTypeError(f"dtype must be a numpy dtype, got {dtype!r}") from None
        dtype_code(dtype)
        shape = items_shape(buffer.nbytes, dtype, shape)
        self._buffer = buffer
        self._dtype: np.dtype[Any] = dtype
        self._shape: tuple[int, ...] = shape

    def __repr__(self) -> str:
        return f"<TypedView {self._dtype}{list(self._shape)} of {self._buffer!r}>"

    @property
    def buffer(self) -> Buffer:
        """The :class:`Buffer` whose memory it types."""
        return self._buffer

    @property
    def dtype(self) -> np.dtype[Any]:
        """Its numpy dtype."""
        return self._dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """Its shape (C-contiguous, within the buffer)."""
        return self._shape

    def _exported(self) -> tuple[Buffer, np.dtype[Any], tuple[int, ...] | None]:
        return self._buffer, self._dtype, self._shape


def _no_typestr(dtype: np.dtype[Any]) -> str:
    return (
        f"__cuda_array_interface__ has no type string for {dtype}: numpy's "
        f"({dtype.str}) is opaque bytes that every one-byte ml_dtypes type shares. DLPack "
        f"carries {dtype}: export with __dlpack__ (torch.from_dlpack, cupy.from_dlpack, "
        "jax.dlpack.from_dlpack)"
    )


def cuda_array_interface(
    buffer: Buffer, dtype: Any = np.uint8, shape: tuple[int, ...] | None = None
) -> dict[str, Any]:
    """``__cuda_array_interface__`` (version 3) of a cuda buffer. Its ``stream`` is the
    device's default queue, made to wait for every command using the buffer, or None
    when they are all done. The interface holds nothing: keep the buffer alive and
    unfreed while the consumer uses the memory (DLPack holds it for you).

    The interface's types are numpy's type strings, which ml_dtypes' types have none
    of: bfloat16 is ``<V2`` (its numpy ``str``, which no other type exported has: as
    PyTorch gives it); the others of one byte (float8, float6, float4, int4, int2)
    would all be ``|V1``, which cannot say which one it is: they have no interface
    (AttributeError, as a buffer of another device: ``hasattr`` is False, and a
    consumer takes DLPack, which carries their types, instead)."""
    state = buffer._export_state()
    if state.backend.dlpack_device_type != KDLCUDA:  # (first: freed, it has none either)
        raise AttributeError(
            f"__cuda_array_interface__ is for cuda buffers; this one is on {state.name}"
        )
    buffer._check_usable("buffer")
    if not isinstance(dtype, np.dtype):  # a Buffer's and a TypedView's are already
        dtype = np.dtype(dtype)
    if dtype.num >= _USER_TYPES and dtype.name != "bfloat16":
        raise AttributeError(_no_typestr(dtype))
    if shape is None:
        shape = (buffer.nbytes // dtype.itemsize,)
    stream = None
    if buffer.busy():
        queue = state.default_queue()
        queue.after(buffer)
        queue._native.hand_over(queue._submitted)  # the consumer records an event there
        stream = queue.handle
    handle, _ = buffer._lend(hold=False)
    return {
        "shape": tuple(shape),
        "typestr": dtype.str,
        "data": (int(handle) + buffer.offset, False),
        "strides": None,
        "version": 3,
        "stream": stream,
    }

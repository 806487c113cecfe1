"""A copy's operands, checked before anything is submitted: buffers, host views, sizes
and overlaps, and what the backend's copy, copyin or copyout then takes; and a fill's
(its buffer, pattern and range)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from . import _native
from ._allocator import Allocator, foreign_holders, holding_foreign, lenders_for
from ._buffer import Buffer, buffer_state, check_buffer, native_arg, not_a_buffer, overlap
from ._device_state import DeviceState, two_names
from ._errors import ArgumentTypeError, InvalidArgumentError, as_int


def host_view(obj: Any, what: str, *, writable: bool) -> memoryview:
    """A flat byte view of a host object; refuses what cannot be copied in place."""
    try:
        view = memoryview(obj)
    except TypeError:
        raise ArgumentTypeError(
            f"{what} must be a Buffer or support the buffer protocol, got {type(obj).__name__}"
            + not_a_buffer(obj)
        ) from None
    except ValueError:  # an item type the buffer protocol cannot name (ml_dtypes' bfloat16)
        if not isinstance(obj, np.ndarray) or obj.dtype.hasobject:
            raise
        items: Any = obj.view(np.dtype((np.void, obj.dtype.itemsize)))  # its bytes
        view = memoryview(items)
    if not view.c_contiguous:
        if writable:  # (a contiguous copy of it would receive the bytes, not it)
            raise InvalidArgumentError(
                f"{what} is not C-contiguous, and a copy cannot fill it in place: copy "
                "into a contiguous array (numpy.empty(shape, dtype)), then assign that "
                f"to {what} (an array's dst[...] = filled)"
            )
        raise InvalidArgumentError(
            f"{what} is not C-contiguous; pass a contiguous copy (numpy.ascontiguousarray)"
        )
    if writable and view.readonly:
        raise InvalidArgumentError(f"{what} is read-only and cannot be copied into")
    if "O" in view.format and _holds_objects(view):
        raise ArgumentTypeError(
            f"{what} holds Python objects ({view.format!r} items): expected plain data "
            "(numbers, bools, bytes); device memory cannot hold object pointers"
        )
    if view.nbytes == 0 and view.ndim > 1:  # (memoryview cannot cast a zero in a shape)
        view.release()
        return memoryview(bytearray() if writable else b"")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _holds_objects(view: memoryview) -> bool:
    """Whether ``view``'s items hold ``PyObject*`` (its format names an "O" field)."""
    exporter = view.obj
    if isinstance(exporter, np.ndarray):
        return bool(exporter.dtype.hasobject)
    try:
        return bool(np.asarray(view).dtype.hasobject)
    except (TypeError, ValueError):  # a format numpy cannot read: refuse what may be objects
        return True


def copy_size(dst_nbytes: int, src_nbytes: int, nbytes: int | None) -> int:
    """The bytes a copy moves: ``nbytes``, or all of both sides when they match."""
    if nbytes is None:
        if dst_nbytes != src_nbytes:
            raise InvalidArgumentError(
                f"sizes do not match: dst holds {dst_nbytes} bytes, src {src_nbytes}; "
                "pass nbytes to copy a prefix"
            )
        nbytes = src_nbytes
    given, nbytes = nbytes, as_int(nbytes)
    if nbytes is None:
        raise ArgumentTypeError(f"nbytes must be an int, got {type(given).__name__}")
    if nbytes <= 0:
        raise InvalidArgumentError(f"nbytes must be > 0, got {nbytes}")
    if nbytes > dst_nbytes or nbytes > src_nbytes:
        raise InvalidArgumentError(
            f"nbytes {nbytes} exceeds dst ({dst_nbytes} bytes) or src ({src_nbytes} bytes)"
        )
    return nbytes


class CopyOperands(NamedTuple):
    """A checked copy: the backend hook (``"copy"``, ``"copyin"``, ``"copyout"``), its
    arguments before the command's value, those after its record, the buffers it uses
    (the queue orders it after their earlier uses, then records its own) and what each
    of them is to the caller, for errors: ``"dst"``, ``"src"``, or what a host operand
    over memory another buffer lent out is (``lent_operand``)."""

    hook: str
    args: tuple[Any, ...]
    extra: tuple[Any, ...]
    buffers: tuple[Buffer, ...]
    names: tuple[str, ...]
    # A buffer of another kind of device among ``buffers``, read or written in place:
    # its pending uses that the queue cannot wait for on the device refuse the copy.
    across: bool = False


_COPY_ELSEWHERE = "copy on a queue of its device (asyncmetal.copy(dst, src) picks one)"


def _check_own(
    buf: Buffer, what: str, state: DeviceState, elsewhere: str = _COPY_ELSEWHERE
) -> None:
    """``check_buffer`` of a buffer that must be the queue's device's, saying where the
    command goes with another device's (``elsewhere``: a copy's, by default)."""
    check_buffer(buf, what)
    if buffer_state(buf) is not state:
        its, this = two_names(buffer_state(buf), state)
        raise InvalidArgumentError(
            f"{what} is a buffer of {its}, not of {this}, whose queue this is: {elsewhere}"
        )


def copy_operands(state: DeviceState, dst: Any, src: Any, nbytes: int | None) -> CopyOperands:
    """Check a copy submitted to a queue of ``state``'s device."""
    if isinstance(dst, Buffer) and not buffer_state(dst).backend.writable:
        raise InvalidArgumentError(
            f"dst is a buffer of {buffer_state(dst).name}: its buffers are read-only sources"
        )
    if isinstance(dst, Buffer) and isinstance(src, Buffer):
        if buffer_state(dst).kind != buffer_state(src).kind:
            return _across_kinds(state, dst, src, nbytes)
        _check_own(dst, "dst", state)
        check_buffer(src, "src")
        source = buffer_state(src)
        nbytes = copy_size(dst.nbytes, src.nbytes, nbytes)
        if overlap(dst, src, nbytes):
            raise InvalidArgumentError(
                f"src and dst overlap in one buffer (src at {src.offset}, dst at "
                f"{dst.offset}, {nbytes} bytes)"
            )
        peer = None if source is state else source.backend
        args = (native_arg(dst), native_arg(src), nbytes)
        return CopyOperands("copy", args, (peer,), (dst, src), ("dst", "src"))
    if isinstance(dst, Buffer):
        _check_own(dst, "dst", state)
        view = host_view(src, "src", writable=False)
        lent, how = _lent_back(state, view)
        if lent is not None and buffer_state(lent) is state:  # ordered as that buffer
            return copy_operands(state, dst, lent, nbytes)
        view = _holding(view, lent)
        nbytes = copy_size(dst.nbytes, view.nbytes, nbytes)
        used = (dst,) if lent is None else (dst, lent)
        names = ("dst", lent_operand("src", lent, how))
        return CopyOperands("copyin", (native_arg(dst), view[:nbytes]), (), used, names)
    if isinstance(src, Buffer):
        _check_own(src, "src", state)
        view = host_view(dst, "dst", writable=True)
        lent, how = _lent_back(state, view)
        if lent is not None and buffer_state(lent) is state:
            return copy_operands(state, lent, src, nbytes)
        view = _holding(view, lent)
        nbytes = copy_size(view.nbytes, src.nbytes, nbytes)
        used = (src,) if lent is None else (src, lent)
        names = ("src", lent_operand("dst", lent, how))
        return CopyOperands("copyout", (view[:nbytes], native_arg(src)), (), used, names)
    raise no_buffer(dst, src)


def _across_kinds(state: DeviceState, dst: Buffer, src: Buffer, nbytes: int | None) -> CopyOperands:
    """A copy between a buffer of ``state``'s device and one of another kind of device
    whose memory the host sees (cpu, npy, Metal): the queue reads or writes that one in
    place, a host copy ordered with both buffers' uses as any copy is. Between a kind
    the host cannot see and another device's, it is refused, saying what does it."""
    own, other = (dst, src) if buffer_state(dst) is state else (src, dst)
    role = "dst" if own is dst else "src"
    _check_own(own, role, state)
    other_role = "src" if own is dst else "dst"
    check_buffer(other, other_role)
    its = buffer_state(other)
    if not its.backend.host_visible:
        there = (
            f"a queue of {its.name} reads or writes {state.name}'s memory in place"
            if state.backend.host_visible
            else "it stages them through host memory"
        )
        raise InvalidArgumentError(
            f"{other_role} is a buffer of {its.name}, whose memory the host cannot see: "
            f"queues of {state.name} cannot read or write it; use asyncmetal.copy() "
            f"({there})"
        )
    nbytes = copy_size(dst.nbytes, src.nbytes, nbytes)
    memory = its.backend.host_view(other._allocation.handle, other.offset, nbytes)
    # Memory that a buffer lent out (an npy source over np.from_dlpack(buf), say): the
    # copy is ordered as that buffer's too, as one with a host operand over it is.
    lent, how = _lent_back(state, memory)
    if lent is not None and lent._allocation.last_use is other._allocation.last_use:
        lent = None  # (the other buffer's own record: ordered with it already)
    more = () if lent is None else (lent,)
    names = () if lent is None else (lent_operand(other_role, lent, how),)
    if lent is not None and buffer_state(lent) is state:
        # A buffer of this device over that very memory (see ``_lent_back``): the copy
        # is one of it, the same bytes, so that the command holds its record until it
        # ran -- the buffers over that memory may all be gone by then.
        pair = (dst, lent) if own is dst else (lent, src)
        args: tuple[Any, ...] = (native_arg(pair[0]), native_arg(pair[1]), nbytes)
        return CopyOperands(
            "copy", args, (None,), (own, other, lent), (role, other_role, other_role), True
        )
    memory = _holding(memory, lent)
    if own is dst:
        args = (native_arg(dst), memory)
        return CopyOperands("copyin", args, (), (dst, src, *more), ("dst", "src", *names), True)
    return CopyOperands(
        "copyout", (memory, native_arg(src)), (), (src, dst, *more), ("src", "dst", *names), True
    )


def no_buffer(dst: object, src: object) -> ArgumentTypeError:
    """The error of a copy given no Buffer at all."""
    hint = not_a_buffer(dst) or not_a_buffer(src)
    return ArgumentTypeError(f"copy needs a Buffer as dst or src (or both){hint}")


# How the memory of a copy's host operand came to a buffer (``_lent_back``).
LENT = "lent out (a DLPack export or a map() view)"
WRAPS = "wraps (asyncmetal.from_dlpack)"
_NOT_LENT: tuple[None, str] = (None, LENT)


def lent_operand(role: str, lent: Buffer | None, how: str = LENT) -> str:
    """What the host operand ``role`` of a copy is where it is memory that a buffer
    lent out or wraps (``_lent_back``'s ``lent`` and ``how``): errors about it name the
    device that lent it, not a buffer or timeline the caller never saw."""
    if lent is None:
        return role
    return f"{role}, host memory that a buffer of {buffer_state(lent).name} {how},"


def _lent_back(state: DeviceState, view: memoryview) -> tuple[Buffer | None, str]:
    """A Buffer over the host memory ``view`` (flat bytes) if a buffer of an open device
    lent it out (``np.from_dlpack(buf)``, say), sharing that buffer's record of uses: a
    copy with it as an operand is then ordered as with the buffer itself -- on
    ``state``'s device, a copy with that buffer; on another, a host copy that also uses
    it: its queue waits, on the device, for the lender's earlier commands where it can
    (a device of ``state``'s kind; another kind's where ``state``'s queues wait across
    kinds: ``Backend.waits_for``), and the lender's later commands wait for it
    where theirs can -- with how that memory came to the buffer: lent out (``LENT``),
    or wrapped (``WRAPS``: ``am.from_dlpack(array)``, below). None if the memory is
    neither (a plain host copy)."""
    if not view.nbytes:
        return _NOT_LENT
    candidates = lenders_for(state.device._allocator, any_kind=True)
    # Host memory a buffer wraps (``am.from_dlpack(array)``) stays its owner's: used
    # itself, it is a use of that buffer too.
    holders = holding_foreign() if foreign_holders else []
    if not candidates and not holders:  # nothing lent out nor wrapped: no look-up
        return _NOT_LENT
    address, _ = _addresser()(view)
    for allocator in candidates:
        if allocator.exported_uses(address, view.nbytes) is not None:
            return _lent_memory(allocator, view, address), LENT
    for allocator in holders:
        if allocator.foreign_memory(address, view.nbytes):
            if allocator._state.kind == state.kind:
                # A buffer of ``state``'s own device, sharing that record all the same: the
                # copy is then one of that buffer, whose commands hold its record until
                # they ran (the buffers over the memory may all be gone by then).
                allocator = state.device._allocator
            return _lent_memory(allocator, view, address), WRAPS
    return _NOT_LENT


def numpy_address(view: memoryview) -> tuple[int, int]:
    """Where ``view``'s bytes are, and how many: (address, nbytes), through numpy (where
    the extension's ``buffer_address``, which does the same in one C call, is not
    loaded). An exporter refuses a view that is not C-contiguous, with its own error."""
    array = np.frombuffer(view, np.uint8)
    return array.ctypes.data, array.nbytes


# How a host operand's address is found: the extension's one call where it is loaded,
# else numpy (a device's open loaded the runtime; an npy device's may not have).
_addresser = _native.ExtensionCall("buffer_address", numpy_address)


class _Holding(np.ndarray[Any, Any]):
    """A copy's host operand that holds what the copy must keep alive until it ran
    (``holds``): the queue keeps the bytes it copies until then, and so this too."""

    holds: object


def _holding(view: memoryview, lent: Buffer | None) -> memoryview:
    """``view``, holding ``lent`` -- a buffer of another device over that memory (see
    ``_lent_back``), whose record of uses the copy's use goes on -- until the copy ran:
    the buffers over that memory may all be gone by then, and with them that record,
    which a buffer made over the memory meanwhile must find."""
    if lent is None:
        return view
    array = np.frombuffer(view, np.uint8).view(_Holding)
    array.holds = lent
    return array.data  # (a memoryview over the array: its ``obj``)


def _lent_memory(allocator: Allocator, view: memoryview, address: int) -> Buffer:
    from ._interop import lent_memory  # (it needs the devices: imported once open)

    return lent_memory(allocator._state.device, view, address)


class FillOperands(NamedTuple):
    """A checked fill: the pattern (an int in host byte order) and its size in bytes (1,
    2 or 4), and the range of the buffer it fills."""

    pattern: int
    size: int
    offset: int
    nbytes: int


_PATTERN_SIZES = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def fill_pattern(value: object) -> tuple[int, int]:
    """A fill's ``value`` as (pattern, size): an int from 0 to 255 is a byte; a numpy
    scalar of 1, 2 or 4 bytes (``np.uint16(7)``, ``np.float32(1.0)``) is its bits."""
    if isinstance(value, np.generic):
        if value.dtype.kind not in "iuf" or value.dtype.itemsize not in _PATTERN_SIZES:
            raise ArgumentTypeError(
                f"value must be an int from 0 to 255 or a numpy integer or float scalar of "
                f"1, 2 or 4 bytes, got numpy {value.dtype}"
            )
        size = value.dtype.itemsize
        bits = np.asarray(value).reshape(1).view(_PATTERN_SIZES[size])
        return int(bits[0]), size
    if not isinstance(value, int) or isinstance(value, bool):
        hint = " (a float's bits: np.float32(x))" if isinstance(value, float) else ""
        raise ArgumentTypeError(
            f"value must be an int from 0 to 255 (a byte) or a numpy scalar of 1, 2 or 4 "
            f"bytes (a pattern), got {type(value).__name__}{hint}"
        )
    if not 0 <= value <= 255:
        raise InvalidArgumentError(
            f"value must be a byte, 0 to 255, got {value}; a wider pattern is a numpy "
            "scalar (np.uint16, np.uint32, np.float32, ...)"
        )
    return value, 1


def fill_operands(
    state: DeviceState, buf: Any, value: object, offset: object, nbytes: object
) -> FillOperands:
    """Check a fill of ``buf`` submitted to a queue of ``state``'s device."""
    if not isinstance(buf, Buffer):
        raise ArgumentTypeError(
            f"buf must be a Buffer, got {type(buf).__name__}" + not_a_buffer(buf)
        )
    if not buffer_state(buf).backend.writable:
        raise InvalidArgumentError(
            f"buf is a buffer of {buffer_state(buf).name}: its buffers are read-only sources"
        )
    _check_own(buf, "buf", state, "fill it on a queue of its device (buf.device.queue.fill)")
    pattern, size = fill_pattern(value)
    given, offset = offset, as_int(offset)
    if offset is None:
        raise ArgumentTypeError(f"offset must be an int, got {type(given).__name__}")
    if not 0 <= offset < buf.nbytes:
        raise InvalidArgumentError(f"offset must be in [0, {buf.nbytes - 1}], got {offset}")
    if nbytes is None:
        nbytes = buf.nbytes - offset
    given, nbytes = nbytes, as_int(nbytes)
    if nbytes is None:
        raise ArgumentTypeError(f"size must be an int or None, got {type(given).__name__}")
    if not 0 < nbytes <= buf.nbytes - offset:
        raise InvalidArgumentError(
            f"size must be in [1, {buf.nbytes - offset}] (the bytes from offset {offset} to "
            f"the buffer's end), got {nbytes}"
        )
    align = math.lcm(size, state.backend.fill_alignment)
    for what, number in (("offset", offset), ("size", nbytes)):
        if number % align:
            raise InvalidArgumentError(
                f"{what} must be a multiple of {align}{_why(size, align, state)}, got {number}"
            )
    if buf.offset % align:
        raise InvalidArgumentError(
            f"buf is a view at byte {buf.offset} of its buffer, and a fill starts at a multiple "
            f"of {align}{_why(size, align, state)}: fill the buffer it views instead"
        )
    if not state.backend.fill_patterns and pattern != int.from_bytes(
        bytes([pattern & 0xFF]) * size, "little"
    ):
        raise InvalidArgumentError(
            f"{state.name} fills bytes only (MTLBlitCommandEncoder fillBuffer:range:value:): "
            f"the {size}-byte pattern {value!r} is not one byte repeated; write it with a "
            "kernel, or copy an array of it"
        )
    return FillOperands(pattern, size, offset, nbytes)


def _why(size: int, align: int, state: DeviceState) -> str:
    """Why a fill's range must be a multiple of ``align`` (the pattern's ``size``, or the
    device's own rule)."""
    if align == size:
        return f" (the pattern's size, {size} bytes)"
    return f" ({state.name} fills ranges of whole {state.backend.fill_alignment}-byte words)"

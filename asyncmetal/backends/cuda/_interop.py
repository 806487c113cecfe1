"""The cuda side of interop: streams of other libraries, the device a pointer lives on,
and the calling thread's current context left as the caller had it.

A stream to adopt is anything with the CUDA stream protocol ``__cuda_stream__``
(returning ``(0, handle)``: cuda.core, CuPy, numba-cuda, recent PyTorch), a PyTorch
stream (``.cuda_stream``), a CuPy stream (``.ptr``), a cuda-bindings ``CUstream`` or a
raw handle (an integer -- a Python int, a numpy or PyTorch integer scalar: anything with
``__index__`` but a bool -- ``0``/``1`` the legacy default stream). The per-thread default
stream (``2``) is refused: it is a different stream on every thread, and a queue's
commands may be submitted from another thread than the one that adopted it. A stream
adopted is known by its handle and the driver's id of it (:func:`stream_id`): a
stream destroyed and a new one that got its handle are two streams. A cuda
buffer's DLPack consumer names its stream by the same rules; that stream is ordered on
(``CUDAQueue.order_stream``), not adopted.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from ..._backend import StreamUse
from ..._errors import ArgumentTypeError, InvalidArgumentError, as_int, warn
from . import _driver
from ._driver import check, cu

_P = ParamSpec("_P")
_R = TypeVar("_R")

STREAM_LEGACY, STREAM_PER_THREAD = 1, 2  # CU_STREAM_LEGACY, CU_STREAM_PER_THREAD
HANDLE_MAX = (1 << 64) - 1  # a CUstream is a pointer: larger ones overflow the driver's call


# What a stream is taken for, as its errors say: who takes it; what the per-thread
# default stream cannot be; what to do instead.
_STREAM_USES: dict[StreamUse, tuple[str, str, str]] = {
    "adopt": ("adopt_stream", "adopted", "adopt a stream of your own"),
    "consume": (
        "a DLPack consumer",
        "waited on for a DLPack consumer",
        "consume on a stream of your own",
    ),
    "import": (
        "from_dlpack",
        "waited on for an imported array",
        "its producer must name a stream of its own",
    ),
}


def stream_handle(stream: object, use: StreamUse = "adopt") -> int:
    """The ``CUstream`` address of ``stream`` (see the module's docstring for the forms).
    ``use``, what it is taken for (its errors say so): ``"adopt"`` (adopt_stream),
    ``"consume"`` (a DLPack consumer's stream, ordered on) or ``"import"`` (the stream an
    imported array's producer named, waited for); only an adopted stream is adopted."""
    if stream.__class__ is int and STREAM_PER_THREAD < stream <= HANDLE_MAX:
        return stream  # (a raw handle, as from_dlpack's)
    taker, refused, instead = _STREAM_USES[use]
    if isinstance(stream, bool):  # (an int to a CUstream check that takes ints)
        raise ArgumentTypeError(f"{taker} takes a stream or a raw CUstream handle, not a bool")
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        value = protocol() if callable(protocol) else protocol
        # (The handle an integer as a raw one is: int() would take 1.9 as the legacy
        # stream, True as well, and "20480" as a stream.)
        pair = value if isinstance(value, tuple) and len(value) == 2 else (None, None)
        version, given = as_int(pair[0]), as_int(pair[1])
        if version != 0 or given is None:
            raise InvalidArgumentError(
                "__cuda_stream__ must give (0, handle) (protocol version 0, the handle an "
                f"integer), got {value!r}"
            )
        handle = given
    elif (integer := as_int(stream)) is not None:  # (an int, a numpy integer; no bool)
        handle = integer
    elif cu is not None and isinstance(stream, cu.CUstream):
        handle = int(stream)
    elif isinstance(getattr(stream, "cuda_stream", None), int):  # torch.cuda.Stream
        handle = stream.cuda_stream  # type: ignore[attr-defined]
    elif isinstance(getattr(stream, "ptr", None), int):  # cupy.cuda.Stream
        handle = stream.ptr  # type: ignore[attr-defined]
    else:
        raise ArgumentTypeError(
            f"{taker} takes a stream (__cuda_stream__, a torch or cupy stream, a CUstream) "
            f"or a raw CUstream handle, got {type(stream).__name__}"
        )
    if not 0 <= handle <= HANDLE_MAX:
        raise InvalidArgumentError(
            f"a CUstream handle is an address, from 0 to 2**64-1, got {handle}"
        )
    if handle == STREAM_PER_THREAD:
        raise InvalidArgumentError(
            f"the per-thread default stream (2) differs from thread to thread and cannot be "
            f"{refused}: {instead} (or the legacy default stream, 1)"
        )
    return handle or STREAM_LEGACY  # 0, the NULL stream, is the legacy one: one queue


def check_stream_context(
    handle: int, context_address: int, where: str, consumer: bool = False
) -> None:
    """Refuse a stream of another context (another GPU, or a context not primary);
    ``consumer`` as :func:`stream_handle`'s."""
    if handle in (0, STREAM_LEGACY):  # the legacy stream of whatever context is current
        return
    context = check(cu.cuStreamGetCtx(cu.CUstream(handle)), "cuStreamGetCtx", where)
    if int(context) != context_address:
        raise other_context(
            where,
            f"a DLPack consumer of a {where} buffer consumes it on a stream of {where}"
            if consumer
            else "adopt it on the device it belongs to",
        )


def other_context(where: str, advice: str) -> InvalidArgumentError:
    """The error for a stream of another context than device ``where``'s (also where a
    queue's wait for another library's stream found it: AM_OTHER_CONTEXT)."""
    return InvalidArgumentError(
        f"the stream belongs to another CUDA context than {where}'s primary context "
        f"(another GPU, or a context of its own): {advice}"
    )


def stream_id(handle: int, where: str) -> int | None:
    """The driver's id of the stream ``handle`` (cuStreamGetId, CUDA 12.0 on), unique in
    the process: a destroyed stream's handle may be a new stream's, its id never is.
    None where the bindings or the driver have no cuStreamGetId (the bindings raise
    RuntimeError where the driver lacks a function)."""
    try:
        err, identity = cu.cuStreamGetId(cu.CUstream(handle))
    except (AttributeError, RuntimeError):  # (AttributeError: bindings before CUDA 12)
        return None
    if int(err):
        raise _driver.driver_error("cuStreamGetId", err, where)
    return int(identity)


def device_index_of(address: int) -> int | None:
    """The ordinal of the GPU that device pointer ``address`` lives on; None for memory
    the driver does not know."""
    attribute = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    err, ordinal = cu.cuPointerGetAttribute(attribute, address)
    if int(err) and (_driver.error_name(err) in _driver.LOST or _driver.lost_first is not None):
        # The process's CUDA state is lost: that is the error, not unknown memory.
        raise _driver.driver_error("cuPointerGetAttribute", err)
    return None if int(err) else int(ordinal)


def keeps_context(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``method`` (which makes a device's context current), then make the context
    that was current on the calling thread before it current again: the current context
    is per thread and shared with every other library there (PyTorch, CuPy, JAX assume
    theirs). The native submission path does the same in C, noting a restore the driver
    refused for the caller to warn of (:func:`warn_unrestored`)."""

    @functools.wraps(method)
    def keeping(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if _driver.lost_first is not None:  # refused before any driver call
            return method(*args, **kwargs)
        # Where the driver cannot say which context is current, nothing is done: there
        # would be nothing to give back.
        before: Any = check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
        try:
            return method(*args, **kwargs)
        finally:
            unrestored = _restore(before)
            if unrestored is not None:
                warn(unrestored, RuntimeWarning)

    return keeping


def _restore(before: Any) -> str | None:
    """Make ``before`` the calling thread's current context again (also where the driver
    cannot say what is current now); what went wrong if it could not be, else None.

    Not raised: raising would lose what the call made (an allocation, a queue, a
    command submitted) or hide the error it raised. A warning (RuntimeWarning, at the
    caller's frame: ``-W error`` makes it one) says that the thread is left with
    another context current than its own, on which another library's calls there
    would go to the wrong device."""
    err, now = cu.cuCtxGetCurrent()
    if not int(err) and int(now) == int(before):
        return None
    failed = cu.cuCtxSetCurrent(before)[0]
    if not int(failed):
        return None
    return _unrestored(int(before), failed, None if int(err) else int(now))


def _unrestored(before: int, failed: Any, now: int | None) -> str:
    """What a warning says of context ``before``, which cuCtxSetCurrent refused (with
    ``failed``) to make current again, ``now`` current instead (None: unknown)."""
    left = "unknown" if now is None else f"{now:#x}"
    return (
        f"the calling thread's CUDA context ({before:#x}) could not be made current "
        f"again: cuCtxSetCurrent failed with {_driver.error_name(failed)}. The thread's "
        f"current context is now {left}: CUDA calls of other libraries on this thread "
        "may go to another device than they expect"
    )


def warn_unrestored(lib: Any) -> None:
    """Warn, as :func:`keeps_context` does, where a call of the native runtime ``lib``
    on this thread could not make the thread's context current again (it notes that for
    the thread: native/cuda_driver.c, cu_restore); take the note."""
    before, now, unknown = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_int()
    failed = lib.am_cuda_unrestored(ctypes.byref(before), ctypes.byref(now), ctypes.byref(unknown))
    if failed:
        left = None if unknown.value else now.value or 0
        warn(_unrestored(before.value or 0, failed, left), RuntimeWarning)

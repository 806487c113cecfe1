"""Objective-C messaging with ctypes, as tinygrad's ``ops_metal.py`` does: no PyObjC.

``send(obj, "selector:with:", *args, restype=..., argtypes=(...))`` calls ``objc_msgSend``
through one cached ctypes function object per (restype, argtypes) signature -- or, on
x86-64, ``objc_msgSend_stret`` for a structure the ABI returns in memory (one larger than
16 bytes, an ``MTLSize``): there the caller passes the address of the result first, so
the receiver and selector are not where ``objc_msgSend`` looks for them. (arm64's
``objc_msgSend`` returns every structure.)
Nothing here is loaded until first used, so importing it off macOS is harmless.

Where the system libraries come from is configurable, so the backend can run against a
simulated Metal (the tests' ``tests/support/fakes/metal_sim``): each ``ASYNCMETAL_*`` variable of
:data:`LIBRARIES` names a shared library to load instead of Apple's; unset, Apple's path
is used on macOS and there is none elsewhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
import sys
from collections.abc import Iterator
from typing import Any

from ..._errors import NoHostMemoryError

# role -> (environment variable, Apple's path)
LIBRARIES = {
    "objc": ("ASYNCMETAL_OBJC_LIB", "/usr/lib/libobjc.dylib"),
    "metal": ("ASYNCMETAL_METAL_LIB", "/System/Library/Frameworks/Metal.framework/Metal"),
    "compiler": (
        "ASYNCMETAL_MTLCOMPILER_LIB",
        "/System/Library/PrivateFrameworks/MTLCompiler.framework/MTLCompiler",
    ),
    "system": ("ASYNCMETAL_LIBSYSTEM", "/usr/lib/libSystem.B.dylib"),
}


def library_path(role: str) -> str | None:
    """The path the library of ``role`` is loaded from: its variable, else Apple's path
    on macOS, else None (there is none here)."""
    variable, apple = LIBRARIES[role]
    configured = os.environ.get(variable)
    if configured:
        return configured
    return apple if sys.platform == "darwin" else None


def load(role: str) -> ctypes.CDLL:
    path = library_path(role)
    if path is None:
        variable = LIBRARIES[role][0]
        raise OSError(f"no {role} library here (macOS has one; elsewhere set {variable})")
    return ctypes.CDLL(path)


@functools.cache
def _libobjc(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.objc_getClass.restype = ctypes.c_void_p
    lib.objc_getClass.argtypes = [ctypes.c_char_p]
    lib.sel_registerName.restype = ctypes.c_void_p
    lib.sel_registerName.argtypes = [ctypes.c_char_p]
    lib.objc_autoreleasePoolPush.restype = ctypes.c_void_p
    lib.objc_autoreleasePoolPush.argtypes = []
    lib.objc_autoreleasePoolPop.restype = None
    lib.objc_autoreleasePoolPop.argtypes = [ctypes.c_void_p]
    return lib


def libobjc() -> ctypes.CDLL:
    path = library_path("objc")
    if path is None:
        raise OSError("no Objective-C runtime here (set ASYNCMETAL_OBJC_LIB off macOS)")
    return _libobjc(path)


@contextlib.contextmanager
def autorelease_pool() -> Iterator[None]:
    """``@autoreleasepool``: objects autoreleased inside (command buffers, encoders,
    strings) are released on leaving. A thread with no pool in place would keep them
    until it exits -- for the loop's thread, for ever."""
    lib = libobjc()
    token = lib.objc_autoreleasePoolPush()
    try:
        yield
    finally:
        lib.objc_autoreleasePoolPop(token)


@functools.cache
def selector(name: str) -> int:
    sel: int = libobjc().sel_registerName(name.encode())
    return sel


@functools.cache
def objc_class(name: str) -> int:
    cls: int = libobjc().objc_getClass(name.encode())
    if not cls:
        raise OSError(f"Objective-C class {name} not found")
    return cls


def objc_msgsend_address() -> int:
    """The address of ``objc_msgSend``, for native code that sends messages itself."""
    return ctypes.cast(libobjc().objc_msgSend, ctypes.c_void_p).value or 0


# Whether a structure larger than 16 bytes comes back through objc_msgSend_stret.
_STRET = platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def _sender(restype: Any, argtypes: tuple[Any, ...]) -> Any:
    address = objc_msgsend_address()
    structure = isinstance(restype, type) and issubclass(restype, ctypes.Structure)
    if _STRET and structure and ctypes.sizeof(restype) > 16:
        address = ctypes.cast(libobjc().objc_msgSend_stret, ctypes.c_void_p).value or 0
    prototype = ctypes.CFUNCTYPE(restype, ctypes.c_void_p, ctypes.c_void_p, *argtypes)
    return prototype(address)


def send(
    obj: int, name: str, *args: Any, restype: Any = ctypes.c_void_p, argtypes: tuple[Any, ...] = ()
) -> Any:
    """``[obj name...]`` with ``args`` of ``argtypes`` (pointers/ids by default)."""
    if not argtypes:
        argtypes = (ctypes.c_void_p,) * len(args)
    return _sender(restype, argtypes)(obj, selector(name), *args)


def made(obj: int | None, what: str) -> int:
    """``obj``, which Metal's ``what`` returned; nil (no memory or resources left for it)
    raised, before anything is sent to it: a message to nil does nothing and returns 0,
    so an unmade event or encoder would lose the work silently."""
    if not obj:
        raise NoHostMemoryError(f"{what} returned nil: Metal had no memory left for it")
    return obj


def nsstring(text: str) -> int:
    ns: int = send(
        objc_class("NSString"),
        "stringWithUTF8String:",
        text.encode(),
        argtypes=(ctypes.c_char_p,),
    )
    return ns


def describe_error(error: int) -> str:
    """The ``localizedDescription`` of an NSError (empty when there is none)."""
    if not error:
        return ""
    with autorelease_pool():  # the description is autoreleased: read it inside the pool
        description = send(error, "localizedDescription")
        text = send(description, "UTF8String", restype=ctypes.c_char_p)
        return text.decode(errors="replace") if text else "unknown error"


_inherited = False  # a forked child's objects are its parent's: it releases none


def forget_objects() -> None:
    """In a child forked from a process that opened Metal: every object is the parent's
    (and the Metal runtime is unusable here), so from now on ``release`` sends nothing."""
    global _inherited
    _inherited = True


def release(obj: int) -> None:
    if obj and not _inherited:
        send(obj, "release", restype=None)


def retain(obj: int) -> int:
    retained: int = send(obj, "retain")
    return retained

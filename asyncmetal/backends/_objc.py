"""Objective-C messaging with ctypes, as tinygrad's ``ops_metal.py`` does: no PyObjC.

``send(obj, "selector:with:", *args, restype=..., argtypes=(...))`` calls ``objc_msgSend``
through one cached ctypes function object per (restype, argtypes) signature.
Nothing here is loaded until first used, so importing it off macOS is harmless.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

_LIBOBJC = "/usr/lib/libobjc.dylib"


@functools.cache
def libobjc() -> ctypes.CDLL:
    lib = ctypes.CDLL(_LIBOBJC)
    lib.objc_getClass.restype = ctypes.c_void_p
    lib.objc_getClass.argtypes = [ctypes.c_char_p]
    lib.sel_registerName.restype = ctypes.c_void_p
    lib.sel_registerName.argtypes = [ctypes.c_char_p]
    return lib


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


@functools.cache
def _sender(restype: Any, argtypes: tuple[Any, ...]) -> Any:
    address = ctypes.cast(libobjc().objc_msgSend, ctypes.c_void_p).value or 0
    prototype = ctypes.CFUNCTYPE(restype, ctypes.c_void_p, ctypes.c_void_p, *argtypes)
    return prototype(address)


def send(
    obj: int, name: str, *args: Any, restype: Any = ctypes.c_void_p, argtypes: tuple[Any, ...] = ()
) -> Any:
    """``[obj name...]`` with ``args`` of ``argtypes`` (pointers/ids by default)."""
    if not argtypes:
        argtypes = (ctypes.c_void_p,) * len(args)
    return _sender(restype, argtypes)(obj, selector(name), *args)


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
    description = send(error, "localizedDescription")
    text = send(description, "UTF8String", restype=ctypes.c_char_p)
    return text.decode(errors="replace") if text else "unknown error"


def release(obj: int) -> None:
    if obj:
        send(obj, "release", restype=None)


def retain(obj: int) -> int:
    retained: int = send(obj, "retain")
    return retained

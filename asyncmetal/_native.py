"""Loads asyncmetal's native runtime (``native/amrt.c``), building it on first use.

The runtime holds the cpu device's queue threads and the notifiers through which native
threads wake event loops by writing one byte to a pipe, without ever taking the GIL.
It is built with the system C compiler into the cache directory, keyed by the source's
hash, atomically (several processes may race to build it).

Where the interpreter's headers are installed (``Python.h``), the same shared object is
also a CPython extension module (``native/ampy.c`` appended to the runtime): the launch
path of the cpu and cuda queues calls it instead of ctypes. It is loaded from the very
file ctypes loads, so both see one runtime. Without the headers, or with
``ASYNCMETAL_EXTENSION=0``, everything goes through ctypes (:func:`extension` is None).
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from collections.abc import Callable
from importlib import resources
from types import ModuleType
from typing import Protocol

from ._cache import CacheWarning, default_cache_dir
from ._errors import AsyncMetalError

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_extension: ModuleType | None = None
extension_error: str | None = None  # why the extension module is not in use, if it is not
# spin(c_timeline, value, max_ns): read a native timeline until it reaches value, for at
# most max_ns, without the GIL; true if it did. Set when the runtime loads.
spin: Callable[[int, int, int], object] | None = None

c_p, c_u64, c_int = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int
_SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "am_notifier_new": (c_p, [c_int]),
    "am_notifier_free": (None, [c_p]),
    "am_notifier_reset": (None, [c_p]),
    "am_watch_new": (c_p, [c_p, c_p]),
    "am_watch_free": (None, [c_p]),
    "am_watch_arm": (c_int, [c_p, c_u64]),
    "am_timeline_new": (c_p, []),
    "am_timeline_set_word": (None, [c_p, c_p]),
    "am_timeline_free": (None, [c_p]),
    "am_timeline_value": (c_u64, [c_p]),
    "am_timeline_signal": (None, [c_p, c_u64]),
    "am_timeline_poke": (None, [c_p, c_u64]),
    "am_timeline_spin": (c_int, [c_p, c_u64, ctypes.c_long]),
    "am_queue_new": (c_p, [c_p, ctypes.c_long]),
    "am_queue_call": (c_int, [c_p, c_p, c_int, c_p, c_p, c_u64]),
    "am_queue_copy": (c_int, [c_p, c_p, c_p, ctypes.c_size_t, c_p, c_u64]),
    "am_queue_signal": (c_int, [c_p, c_p, c_u64, c_u64]),
    "am_queue_wait": (c_int, [c_p, c_p, c_u64, c_u64]),
    "am_queue_copy_part": (
        c_int,
        [c_p, c_p, c_p, ctypes.c_size_t, ctypes.c_size_t, *[c_p, c_u64] * 5],
    ),
    "am_queue_close": (None, [c_p, c_int]),
    "am_cuda_name": (ctypes.c_char_p, [c_int]),
    "am_cuda_set": (None, [c_int, c_p]),
    "am_timeline_host_signal": (None, [c_p, c_u64]),
    "am_cuq_new": (c_p, [c_p, c_p, c_p, ctypes.c_long, ctypes.c_long]),
    "am_cuq_finish": (c_int, [c_p, c_u64, c_p, c_u64, ctypes.c_long, c_int]),
    "am_cuq_launch": (c_int, [c_p, c_p, c_p, c_p, c_int, c_u64]),
    "am_cuq_copy": (c_int, [c_p, c_u64, c_u64, c_p, ctypes.c_size_t, c_u64, ctypes.c_long]),
    "am_cuq_memcpy": (c_int, [c_p, c_int, c_u64, c_u64, ctypes.c_size_t, c_u64]),
    "am_cuq_write": (c_int, [c_p, c_p, c_u64, c_u64]),
    "am_cuq_wait": (c_int, [c_p, c_p, c_u64, c_u64]),
    "am_cuq_wait_queue": (c_int, [c_p, c_p, c_u64, c_u64]),
    "am_cuq_failed_call": (c_int, [c_p]),
    "am_cuq_stats": (None, [c_p, ctypes.POINTER(c_u64)]),
    "am_cuq_error": (c_int, [c_p, ctypes.POINTER(c_u64)]),
    "am_cuq_close": (None, [c_p, c_int]),
    "am_block_completed": (None, [c_p, c_p]),
    "am_block_reached": (None, [c_p, c_p, c_u64]),
    "am_block_new": (c_p, [c_p, c_int, c_p, c_u64]),
    "am_block_free": (None, [c_p]),
}
MAX_ARGS = 16


def compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return cc if shutil.which(cc) else None


def _build(source: bytes, target: str, flags: list[str]) -> None:
    cc = compiler()
    if cc is None:
        raise AsyncMetalError("the cpu device needs a C compiler: none found (set $CC)")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, "-O2", "-shared", "-fPIC", "-pthread", *flags, "-x", "c", "-", "-o", tmp]
            + (["-undefined", "dynamic_lookup"] if sys.platform == "darwin" else []),
            input=source,
            capture_output=True,
            check=False,
        )
        if proc.returncode != 0:
            raise AsyncMetalError(
                f"building asyncmetal's native runtime failed:\n{proc.stderr.decode()}"
            )
        os.replace(tmp, target)  # atomic: a racing process sees all or nothing
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _python_include() -> str | None:
    """The interpreter's header directory if Python.h is there and wanted."""
    if os.environ.get("ASYNCMETAL_EXTENSION", "1") == "0":
        return None
    include = sysconfig.get_paths().get("include")
    if include and os.path.exists(os.path.join(include, "Python.h")):
        return include
    return None


def _built(source: bytes, name: str, flags: list[str]) -> str:
    digest = hashlib.sha256(source + repr(flags).encode()).hexdigest()[:16]
    filename = f"{name}-{digest}.so"
    target = os.path.join(default_cache_dir(), filename)
    if os.path.exists(target):
        return target
    try:
        _build(source, target, flags)
    except OSError as exc:
        # The cache directory cannot be written (read-only, full, not a directory): build
        # into a directory of this process's own instead, and say so.
        target = os.path.join(_private_build_dir(), filename)
        warnings.warn(
            f"asyncmetal: cannot build the native runtime into {default_cache_dir()} ({exc}); "
            f"building it into {os.path.dirname(target)} for this process only",
            CacheWarning,
            stacklevel=2,
        )
        if not os.path.exists(target):
            try:
                _build(source, target, flags)
            except OSError as again:
                raise AsyncMetalError(
                    f"building asyncmetal's native runtime failed: {again}"
                ) from again
    return target


_private_dir: str | None = None


def _private_build_dir() -> str:
    """A temporary directory for this process's builds, removed at exit (a loaded
    shared object stays mapped once its file is gone)."""
    global _private_dir
    if _private_dir is None:
        _private_dir = tempfile.mkdtemp(prefix="asyncmetal-native-")
        atexit.register(shutil.rmtree, _private_dir, ignore_errors=True)
    return _private_dir


def _load_extension(path: str) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader("asyncmetal._amrt", path)
    spec = importlib.util.spec_from_loader("asyncmetal._amrt", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def runtime() -> ctypes.CDLL:
    """The loaded runtime; builds it the first time. Blocks: call it off the loop."""
    global _lib, _extension, extension_error, spin
    with _lock:
        if _lib is None:
            native = resources.files("asyncmetal").joinpath("native")
            source = native.joinpath("amrt.c").read_bytes()
            include = _python_include()
            target = None
            if include is None:
                extension_error = "no Python.h (or ASYNCMETAL_EXTENSION=0): ctypes only"
            else:
                glue = native.joinpath("ampy.c").read_bytes()
                tag = sys.implementation.cache_tag or "python"
                try:
                    target = _built(source + b"\n" + glue, f"amrt-{tag}", ["-I", include])
                    _extension = _load_extension(target)
                except (AsyncMetalError, ImportError, OSError) as exc:
                    extension_error, target, _extension = f"{exc}", None, None
            if target is None:
                target = _built(source, "amrt", [])
            lib = ctypes.CDLL(target)
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype = restype
                fn.argtypes = argtypes
            spin = lib.am_timeline_spin if _extension is None else _extension.spin
            _lib = lib
        return _lib


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def extension() -> ModuleType | None:
    """The runtime's extension module (``native/ampy.c``), or None where it could not
    be built; loads the runtime first."""
    runtime()
    return _extension


# Where a plain load is an acquire load. Python reads a timeline's value where the
# runtime keeps it; a thread raised it (a release store) after writing what the value
# stands for -- a kernel's results, a copied buffer -- which the caller reads next. On
# x86-64 a plain load suffices: the processor never lets a later load pass an earlier
# one (TSO), and the compiler cannot move one across the C call that ctypes makes for
# the read. On weakly ordered processors (arm64: Apple's, Graviton) it does not: the
# caller could see the new value and stale data, so values are read with an acquire
# load. (So they are on 32-bit x86, where a plain 64-bit load may also be torn.)
PLAIN_LOADS_ACQUIRE = platform.machine().lower() in ("x86_64", "amd64")


class ValueReader(Protocol):
    @property
    def value(self) -> int: ...


class _AcquireReader:
    """A timeline value read with an acquire load (the extension's, else the runtime's
    am_timeline_value through ctypes)."""

    __slots__ = ("_read", "_timeline")

    def __init__(self, read: Callable[[int], int], c_timeline: int) -> None:
        self._read = read
        self._timeline = c_timeline

    @property
    def value(self) -> int:
        return self._read(self._timeline)


def timeline_reader(c_timeline: int, plain: bool | None = None) -> ValueReader:
    """An object whose ``.value`` is the native timeline's value, ordered before every
    later read of the caller (see PLAIN_LOADS_ACQUIRE). ``plain`` overrides the choice
    (tests). Loads the runtime."""
    lib = runtime()
    if PLAIN_LOADS_ACQUIRE if plain is None else plain:
        return ctypes.c_uint64.from_address(c_timeline)  # read in place: one load
    read = lib.am_timeline_value if _extension is None else _extension.timeline_value
    return _AcquireReader(read, c_timeline)


def loaded() -> ctypes.CDLL | None:
    """The runtime if some device already loaded it (never builds)."""
    return _lib

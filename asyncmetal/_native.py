"""Loads asyncmetal's native runtime (``native/amrt.c``), building it on first use.

The runtime holds the cpu device's queue threads and the notifiers through which native
threads wake event loops by writing one byte to a pipe, without ever taking the GIL.
It is built with the system C compiler into the cache directory, keyed by the source's
hash, atomically (several processes may race to build it).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from importlib import resources

from ._cache import default_cache_dir
from ._errors import AsyncMetalError

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None

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
    "am_queue_new": (c_p, [c_p, ctypes.c_long]),
    "am_queue_call": (c_int, [c_p, c_p, c_int, c_p, c_p, c_u64]),
    "am_queue_copy": (c_int, [c_p, c_p, c_p, ctypes.c_size_t, c_p, c_u64]),
    "am_queue_signal": (c_int, [c_p, c_p, c_u64, c_u64]),
    "am_queue_wait": (c_int, [c_p, c_p, c_u64, c_u64]),
    "am_queue_close": (None, [c_p, c_int]),
    "am_cuda_name": (ctypes.c_char_p, [c_int]),
    "am_cuda_set": (None, [c_int, c_p]),
    "am_cuq_new": (c_p, [c_p, c_p, c_p, ctypes.c_long]),
    "am_cuq_finish": (c_int, [c_p, c_u64, c_p, c_u64, ctypes.c_long]),
    "am_cuq_launch": (c_int, [c_p, c_p, c_p, c_p, c_u64]),
    "am_cuq_write": (c_int, [c_p, c_p, c_u64]),
    "am_cuq_wait": (c_int, [c_p, c_p, c_u64]),
    "am_cuq_wait_queue": (c_int, [c_p, c_p, c_u64]),
    "am_cuq_failed_call": (c_int, [c_p]),
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


def _build(source: bytes, target: str) -> None:
    cc = compiler()
    if cc is None:
        raise AsyncMetalError("the cpu device needs a C compiler: none found (set $CC)")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, "-O2", "-shared", "-fPIC", "-pthread", "-x", "c", "-", "-o", tmp]
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


def runtime() -> ctypes.CDLL:
    """The loaded runtime; builds it the first time. Blocks: call it off the loop."""
    global _lib
    with _lock:
        if _lib is None:
            source = resources.files("asyncmetal").joinpath("native/amrt.c").read_bytes()
            digest = hashlib.sha256(source).hexdigest()[:16]
            target = os.path.join(default_cache_dir(), f"amrt-{digest}.so")
            if not os.path.exists(target):
                _build(source, target)
            lib = ctypes.CDLL(target)
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype = restype
                fn.argtypes = argtypes
            _lib = lib
        return _lib


def loaded() -> ctypes.CDLL | None:
    """The runtime if some device already loaded it (never builds)."""
    return _lib

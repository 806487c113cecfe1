"""Loads asyncmetal's native runtime (``native/``: ``native/amrt.h`` lists its files).

The runtime holds the cpu device's queue threads, the CUDA queues' completion threads
and the notifiers through which native threads wake event loops by writing one byte to
a pipe, without ever taking the GIL.

Where it comes from, in order:

* **packaged**: compiled when the wheel was built (``setup.py``) and installed in the
  package directory -- ``_amrt`` plus the interpreter's extension suffix, with the
  extension module, or ``libamrt`` without it. Used only if it was built from the
  sources installed beside it (its ``am_build_digest``), so an editable install whose C
  files were edited since does not run stale code.
* **built at first use**: otherwise, with the system C compiler (``$CC``/``cc``), into
  the cache directory, keyed by the sources' digest, atomically (several processes may
  race to build it).

Where the interpreter's headers are installed (``Python.h``), the same shared object is
also a CPython extension module (``native/py_module.c``, ``native/py_launch.c``,
``native/py_dlpack.c``): the launch path of the cpu and cuda queues, and
``from_dlpack``'s reading of a capsule, call it instead of ctypes. It is loaded from the
very file ctypes loads, so both see one runtime. Without the headers, or with
``ASYNCMETAL_EXTENSION=0``, everything goes through ctypes (:func:`extension` is None).
What the extension reads from Python objects is declared in
:mod:`asyncmetal._native_contract`, and checked when it loads.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.machinery
import importlib.util
import mmap
import os
import platform
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable
from importlib import resources
from types import ModuleType
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from . import _native_build as build
from . import _native_contract
from ._cache import CacheWarning, default_cache_dir
from ._errors import AsyncMetalError, env_switch, warn

F = TypeVar("F", bound=Callable[..., Any])
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_extension: ModuleType | None = None
extension_error: str | None = None  # why the extension module is not in use, if it is not
# spin(c_timeline, value, max_ns): read a native timeline until it reaches value, for at
# most max_ns, without the GIL; true if it did. Set when the runtime loads.
spin: Callable[[int, int, int], object] | None = None
# due(c_timeline, value): when the command reaching value is expected done (0: unknown).
due: Callable[[int, int], int] | None = None
# host_running(): the cpu device's commands (kernels, copies, fills) running now on its
# queue threads, in the whole process.
host_running: Callable[[], int] | None = None
# host_starved(): whether those commands lately waited for a core (held by other
# threads, other processes'), for a while after (am_host_starved).
host_starved: Callable[[], object] | None = None
# The cores this process may run on.
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cores_taken() -> bool:
    """Whether the cpu device's queue threads running commands now need every core the
    process may run on. A loop that polls for what is about to end (rather than sleep
    until woken) would then take CPU time from their kernels: on two cores, four busy
    queues ran a fifth fewer 200 us kernels with the loop polling. So also while their
    commands lately waited for a core (``host_starved``): where other processes hold
    some of the cores, a polling loop thread may share one with a queue thread, which
    as a lower priority (cpu.QUEUE_NICE) then runs only a sliver of the time -- on two
    cores, one held by another process, one task's 10 us kernels ran at 0.4-6 k/s with
    the loop polling and 12-19 k/s with it sleeping."""
    return host_running is not None and (
        host_running() >= CORES or (host_starved is not None and bool(host_starved()))
    )


# The extension's functions that stand for runtime functions on the way from a host
# signal to the task it releases (fast_call), by the runtime function's name.
_FAST_CALLS = {
    "am_timeline_signal_here": "timeline_signal",
    "am_timeline_host_signal": "host_signal",
    "am_watch_arm": "watch_arm",
    "am_notifier_reset": "notifier_reset",
}

c_p, c_u64, c_int = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int
_SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "am_notifier_new": (c_p, [c_int]),
    "am_notifier_free": (None, [c_p]),
    "am_notifier_reset": (ctypes.c_int64, [c_p]),
    "am_watch_new": (c_p, [c_p, c_p]),
    "am_watch_free": (None, [c_p]),
    "am_watch_arm": (c_int, [c_p, c_u64]),
    "am_timeline_new": (c_p, []),
    "am_timeline_set_word": (None, [c_p, c_p]),
    "am_timeline_free": (None, [c_p]),
    "am_timeline_refs": (c_int, [c_p]),
    "am_timeline_value": (c_u64, [c_p]),
    "am_timeline_signal": (None, [c_p, c_u64]),
    "am_timeline_signal_here": (None, [c_p, c_u64, c_p]),
    "am_timeline_poke": (None, [c_p, c_u64]),
    "am_timeline_near": (None, [c_p, c_u64, ctypes.c_int64]),
    "am_timeline_spin": (c_int, [c_p, c_u64, ctypes.c_long]),
    "am_timeline_due": (ctypes.c_int64, [c_p, c_u64]),
    "am_host_running": (c_int, []),
    "am_host_starved": (c_int, []),
    "am_timeline_fail": (None, [c_p, c_u64, c_int, c_u64, c_p]),
    "am_timeline_fail_from": (None, [c_p, c_u64, c_int, c_u64, c_p]),
    "am_timeline_fail_after": (None, [c_p, c_u64, c_u64, c_int, c_u64, c_p]),
    "am_timeline_failure": (
        c_u64,
        [c_p, ctypes.POINTER(c_int), ctypes.POINTER(c_u64), ctypes.POINTER(c_p)],
    ),
    "am_timeline_failed_offset": (ctypes.c_size_t, []),
    "am_timeline_close": (None, [c_p, c_u64]),
    "am_queue_new": (c_p, [c_p, ctypes.c_long, ctypes.c_int]),
    "am_queue_call": (c_int, [c_p, c_p, c_int, c_p, ctypes.c_uint32, c_p, c_u64]),
    "am_queue_copy": (c_int, [c_p, c_p, c_p, ctypes.c_size_t, c_p, c_u64]),
    "am_queue_fill": (c_int, [c_p, c_p, ctypes.c_size_t, ctypes.c_uint32, c_int, c_p, c_u64]),
    "am_queue_signal": (c_int, [c_p, c_p, c_u64, c_u64]),
    "am_queue_wait": (c_int, [c_p, c_p, c_u64, c_u64]),
    "am_queue_copy_part": (
        c_int,
        [c_p, c_p, c_p, ctypes.c_size_t, ctypes.c_size_t, *[c_p, c_u64] * 5],
    ),
    "am_queue_close": (None, [c_p, c_int]),
    "am_queue_discard": (None, [c_p]),
    "am_cuda_name": (ctypes.c_char_p, [c_int]),
    "am_cuda_set": (None, [c_int, c_p]),
    "am_cuda_unrestored": (
        c_int,
        [ctypes.POINTER(c_p), ctypes.POINTER(c_p), ctypes.POINTER(c_int)],
    ),
    "am_cuda_unrestored_notes": (c_p, []),
    "am_timeline_host_signal": (None, [c_p, c_u64, c_p]),
    "am_cuq_new": (c_p, [c_p, c_p, c_p, ctypes.c_long, ctypes.c_long]),
    "am_cuq_finish": (c_int, [c_p, c_u64, c_p, c_u64, ctypes.c_long, c_int]),
    "am_cuq_launch": (c_int, [c_p, c_p, c_p, c_p, c_int, c_u64]),
    "am_cuq_copy": (c_int, [c_p, c_u64, c_u64, c_p, ctypes.c_size_t, c_u64, ctypes.c_long]),
    "am_cuq_fill": (
        c_int,
        [c_p, c_u64, ctypes.c_uint32, c_int, ctypes.c_size_t, c_u64, ctypes.c_long],
    ),
    "am_cuq_memcpy": (c_int, [c_p, c_int, c_u64, c_u64, ctypes.c_size_t, c_u64]),
    "am_cuq_write": (c_int, [c_p, c_p, c_u64, c_u64]),
    "am_cuq_mark": (c_int, [c_p, c_p, c_u64, c_u64]),
    "am_cuq_wait": (c_int, [c_p, c_p, c_u64, c_u64]),
    "am_cuq_wait_timeline": (c_int, [c_p, c_p, c_u64, c_u64]),
    "am_cuq_hand_over": (c_int, [c_p, c_u64]),
    "am_cuq_wait_queue": (c_int, [c_p, c_p, c_u64, c_u64]),
    "am_cuq_failed_call": (c_int, [c_p]),
    "am_cuq_stats": (None, [c_p, ctypes.POINTER(c_u64)]),
    "am_cuq_set_shared": (None, [c_p]),
    "am_cuq_error": (c_int, [c_p, ctypes.POINTER(c_u64)]),
    "am_cuq_reached": (c_u64, [c_p]),
    "am_cuq_cause": (c_p, [c_p, ctypes.POINTER(c_int), ctypes.POINTER(c_u64)]),
    "am_cuq_close": (None, [c_p, c_int]),
    "am_cuq_discard": (None, [c_p]),
    "am_cuq_wait_foreign": (c_int, [c_p, c_p, c_p, c_u64, ctypes.POINTER(c_int)]),
    "am_cuq_wait_stream": (c_int, [c_p, c_p, c_p, c_u64, ctypes.POINTER(c_int)]),
    "am_cuq_wait_stream_end": (
        c_int,
        [c_p, c_p, c_p, c_u64, ctypes.c_long, c_int, ctypes.POINTER(c_int)],
    ),
    "am_block_completed": (None, [c_p, c_p]),
    "am_block_reached": (None, [c_p, c_p, c_u64]),
    "am_block_new": (c_p, [c_p, c_int, c_p, c_u64]),
    "am_block_free": (None, [c_p]),
    "am_blocks_wait": (c_u64, [c_u64, ctypes.c_int64]),
    "am_host_wait": (c_int, [c_p, c_u64, c_int, c_p, ctypes.c_int64]),
    "am_host_wait_stop": (None, [c_p, c_p]),
    "am_metal_host_wait": (c_int, [c_p, c_p, c_p, c_u64, c_int, c_p, ctypes.c_int64]),
    "am_signal_committed": (None, [c_p, c_u64]),
    "am_signal_committed_to": (c_u64, [c_p]),
    "am_metal_own": (None, [c_p, c_p, c_p, c_p, c_p, c_p]),
    "am_metal_retain_into": (None, [c_p, c_p, ctypes.c_size_t, c_p, c_p]),
    "am_metal_release_each": (None, [c_p, ctypes.c_size_t, c_p, c_p]),
    "am_metal_submitting": (c_int, [c_p, c_u64, c_p, c_u64]),
    "am_metal_unsubmitting": (c_int, [c_p, c_u64, c_u64, c_int]),
}
MAX_ARGS = 16


def compiler() -> list[str] | None:
    """``$CC`` (default ``cc``), split into its words, if it can be run, else None."""
    return build.compiler()


def available() -> bool:
    """Whether the runtime can be loaded here: packaged, built already, or buildable."""
    return _lib is not None or _packaged_candidates() != [] or compiler() is not None


# Where the loaded runtime came from, for `python -m asyncmetal info`.
origin: str | None = None  # "packaged" | "built at first use"
origin_path: str | None = None


def _sources() -> dict[str, bytes]:
    native = resources.files("asyncmetal").joinpath("native")
    return {name: native.joinpath(name).read_bytes() for name in build.ALL_FILES}


def _packaged_candidates() -> list[tuple[str, bool]]:
    """The packaged runtimes installed here, best first: (path, has the extension)."""
    here = os.path.dirname(os.path.abspath(__file__))
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    found = []
    for stem, with_extension in (
        (build.PACKAGED_WITH_EXTENSION, True),
        (build.PACKAGED_RUNTIME_ONLY, False),
    ):
        path = os.path.join(here, stem + suffix)
        if os.path.exists(path):
            found.append((path, with_extension))
    return found


def _python_include() -> str | None:
    """The interpreter's header directory if Python.h is there and wanted."""
    if not env_switch("ASYNCMETAL_EXTENSION"):
        return None
    return build.python_include()


def _switched_off() -> str:
    """Why the extension module is not in use where ``ASYNCMETAL_EXTENSION`` turned it
    off: the value as set."""
    return f"ASYNCMETAL_EXTENSION={os.environ.get('ASYNCMETAL_EXTENSION', '')}: ctypes only"


def _compile(sources: dict[str, bytes], target: str, include: str | None) -> None:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".so.tmp")
    os.close(fd)
    try:
        try:
            build.compile_runtime(sources, tmp, include)
        except FileNotFoundError as exc:
            packaged = "; ".join(_not_packaged) or "not packaged in this install"
            raise AsyncMetalError(
                f"asyncmetal's native runtime is {packaged}, and cannot be built here: "
                f"no C compiler ({os.environ.get('CC') or 'cc'}; set $CC)"
            ) from exc
        except RuntimeError as exc:
            raise AsyncMetalError(f"building asyncmetal's native runtime failed:\n{exc}") from exc
        os.replace(tmp, target)  # atomic: a racing process sees all or nothing
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _built(sources: dict[str, bytes], name: str, include: str | None) -> str:
    """The first-use build of the runtime, from the cache directory or compiled now."""
    filename = f"{name}-{build.digest(sources, include is not None)}.so"
    directory = "the cache directory"
    try:
        directory = str(default_cache_dir())  # (OSError: there is none)
        target = os.path.join(directory, filename)
        if os.path.exists(target):
            return target
        _compile(sources, target, include)
    except OSError as exc:
        # The cache directory cannot be written (read-only, full, not a directory, none
        # at all): build into a directory of this process's own instead, and say so.
        target = os.path.join(_private_build_dir(), filename)
        warn(
            f"asyncmetal: cannot build the native runtime into {directory} ({exc}); "
            f"building it into {os.path.dirname(target)} for this process only",
            CacheWarning,
        )
        if not os.path.exists(target):
            try:
                _compile(sources, target, include)
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
    loader = importlib.machinery.ExtensionFileLoader(build.MODULE, path)
    spec = importlib.util.spec_from_loader(build.MODULE, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    _native_contract.install_names(module)  # raises NativeContractError on a drift
    return module


def _packaged(sources: dict[str, bytes], want_extension: bool) -> tuple[str, bool] | None:
    """The packaged runtime to load, if one was built from these sources: (path, load
    the extension from it). Skipped, with the reason kept, where it was built from
    other sources (an editable install whose C files changed)."""
    global extension_error
    for path, with_extension in _packaged_candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            extension_error = f"the packaged runtime {path} does not load: {exc}"
            continue
        lib.am_build_digest.restype = ctypes.c_char_p
        if lib.am_build_digest().decode() == build.digest(sources, with_extension):
            return path, with_extension and want_extension
        _not_packaged.append(f"{path} was built from other sources than those beside it")
    return None


_not_packaged: list[str] = []  # why packaged runtimes found were not used


def maps_executable(fd: int) -> bool:
    """Whether the file open as ``fd`` may be mapped as code, as dlopen maps a library's
    text. A file system mounted ``noexec`` (or a policy: SELinux, a container's) refuses
    with EPERM or EACCES, whatever the file holds -- and dlopen then says only "failed
    to map segment from shared object", as it does when memory runs out."""
    try:
        mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_EXEC).close()
    except PermissionError:
        return False
    except (OSError, ValueError):  # (another failure: not this one's to report)
        return True
    return True


def _load_built(target: str) -> ctypes.CDLL:
    """The runtime built at first use, loaded from ``target`` in the cache directory;
    where code may not run from there, the error says so and what to set."""
    try:
        return ctypes.CDLL(target)
    except OSError as exc:
        with open(target, "rb") as f:
            if maps_executable(f.fileno()):
                raise
        raise AsyncMetalError(
            f"cannot run asyncmetal's native runtime from {os.path.dirname(target)}: code "
            "there may not be mapped (a file system mounted noexec, or a security policy) "
            "-- it is built at first use into the cache directory: set "
            "$ASYNCMETAL_CACHE_DIR to one that allows running code"
        ) from exc


def runtime() -> ctypes.CDLL:
    """The loaded runtime; builds it the first time. Blocks: call it off the loop."""
    global _lib, _extension, extension_error, spin, due, host_running, host_starved
    global origin, origin_path
    with _lock:
        if _lib is None:
            sources = _sources()
            include = _python_include()
            want_extension = env_switch("ASYNCMETAL_EXTENSION")
            packaged = _packaged(sources, want_extension)
            target, load_extension = None, False
            if packaged is not None:
                (target, load_extension), origin = packaged, "packaged"
                if not load_extension:
                    extension_error = (
                        _switched_off()
                        if not want_extension
                        else "the packaged runtime was built without Python.h: ctypes only"
                    )
            else:
                origin = "built at first use"
                if include is None:
                    extension_error = (
                        _switched_off() if not want_extension else "no Python.h: ctypes only"
                    )
                else:
                    tag = sys.implementation.cache_tag or "python"
                    try:
                        target = _built(sources, f"amrt-{tag}", include)
                        load_extension = True
                    except AsyncMetalError as exc:
                        extension_error = f"{exc}"
                if target is None:
                    target = _built(sources, "amrt", None)
            _extension = None
            if load_extension:
                try:
                    _extension = _load_extension(target)
                except (ImportError, OSError) as exc:
                    extension_error = f"{exc}"
            lib = ctypes.CDLL(target) if origin == "packaged" else _load_built(target)
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype = restype
                fn.argtypes = argtypes
            spin = lib.am_timeline_spin if _extension is None else _extension.spin
            due = lib.am_timeline_due if _extension is None else _extension.due
            host_running = lib.am_host_running if _extension is None else _extension.host_running
            host_starved = lib.am_host_starved if _extension is None else _extension.host_starved
            origin_path = target
            _lib = lib
        return _lib


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def fast_call(lib: Any, name: str) -> Callable[..., Any]:
    """``lib``'s runtime function ``name`` (one of _FAST_CALLS): the extension's version
    where ``lib`` is the loaded runtime and its extension is in use (a C call, not
    ctypes), else ``lib``'s own (ctypes, or a test's stand-in)."""
    if lib is _lib and _extension is not None:
        call: Callable[..., Any] = getattr(_extension, _FAST_CALLS[name])
        return call
    return getattr(lib, name)  # type: ignore[no-any-return]


def extension() -> ModuleType | None:
    """The runtime's extension module (``native/py_module.c``), or None where it is not
    in use (:data:`extension_error` says why); loads the runtime first."""
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


# AM_ABANDONED (amrt.h): the error of a command that will never run, its device having
# closed while it waited for a value not produced yet. AM_CLOSED: a timeline's device
# closed before it reached the value. AM_DISCARDED: a command dropped before it
# started, its queue (or device) closed with discard=True.
ABANDONED = -4
CLOSED = -5
DISCARDED = -7


class Failure(NamedTuple):
    """Why a native timeline's values from ``first`` on were never produced: a command
    that signals it failed, or was abandoned (``error`` is ABANDONED, else the backend's
    error code); ``value`` is the command where that began, on the queue whose own
    timeline is ``cause`` (a native timeline's address)."""

    first: int
    error: int
    value: int
    cause: int


def timeline_failure(c_timeline: int) -> Failure | None:
    """The native timeline's failure, if it failed (after its value got there, a read of
    it is current)."""
    lib = runtime()
    error, value, cause = c_int(), c_u64(), c_p()
    first = lib.am_timeline_failure(
        c_timeline, ctypes.byref(error), ctypes.byref(value), ctypes.byref(cause)
    )
    return Failure(first, error.value, value.value, cause.value or 0) if first else None


def timeline_abandon(c_timeline: int, target: int, first: int) -> None:
    """The commands that would raise the native timeline from where it is to ``target``
    will never run (their device closed): it fails, and settles (every wait on it ends;
    a queue that waited on it fails its commands from there on)."""
    runtime().am_timeline_fail(c_timeline, target, ABANDONED, first, c_timeline)


def timeline_close(c_timeline: int, pending: int = 0) -> None:
    """The native timeline's device closed: waits for values it has not reached (nor
    ``pending``, see am_timeline_close) end, failed."""
    runtime().am_timeline_close(c_timeline, pending)


def failed_from(c_timeline: int) -> ValueReader:
    """An object whose ``.value`` is the native timeline's first failed value (0: none),
    read in place: current once its value got to what the caller awaited."""
    offset = runtime().am_timeline_failed_offset()
    return ctypes.c_uint64.from_address(c_timeline + offset)


def loaded() -> ctypes.CDLL | None:
    """The runtime if some device already loaded it (never builds)."""
    return _lib


class ExtensionCall(Generic[F]):
    """Which function does a thing: the extension's ``name`` where the extension is
    loaded, else ``fallback`` (Python's way, numpy or ctypes). Chosen once the runtime is
    loaded -- never building it: until a device loads it, the fallback, not kept (a
    device opened later may load it). Called for the function: ``how()(args)``;
    ``chosen`` may be set to pin one."""

    __slots__ = ("chosen", "fallback", "name")

    def __init__(self, name: str, fallback: F) -> None:
        self.name = name
        self.fallback = fallback
        self.chosen: F | None = None

    def __call__(self) -> F:
        chosen = self.chosen
        if chosen is None:
            if _lib is None:
                return self.fallback
            module = extension()
            chosen = self.chosen = self.fallback if module is None else getattr(module, self.name)
        return chosen

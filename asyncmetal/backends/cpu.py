"""The ``cpu`` device: C kernels built by the system C compiler, run on queue threads.

Each queue is a thread of asyncmetal's native runtime (``native/host_queues.c``) executing its
commands in order -- kernel calls, memmoves, fills, timeline signals and waits -- without ever
taking the GIL. Timelines are 64-bit counters in the runtime; a queue thread that
reaches a value some loop awaits writes one byte to that loop's pipe.

Kernels are called with up to 16 parameters (compiling refuses more), each passed as a
64-bit integer register or stack slot (pointers, and ints widened): right for the x86-64
System V and AArch64 Linux calling conventions, which read an ``int`` from the low half.
A kernel given floats (``float``, ``double``, ``_Float16`` parameters) is called with
them in the vector registers instead, as those conventions pass them (the runtime sorts
the arguments: ``native/host_queues.c``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from .. import _native, _native_contract
from .._backend import (
    Arg,
    Backend,
    DeviceInfo,
    ForkableTimeline,
    InheritedValue,
    KeepAlive,
    NativeQueue,
    NativeTimeline,
    Record,
    Timelines,
    host_address,
)
from .._compile import (
    OTHER_CONVENTIONS,
    SIGNATURE_CHECKS_FILE,
    Compiler,
    ParamKind,
    Signature,
    answered_values,
    c_value_types,
    calling_conventions,
    checks_identity,
    refused_signature,
    scalar_params,
    signature_checks,
    tool_answer,
    unread_checks,
)
from .._errors import (
    ArgumentTypeError,
    ClosedResourceError,
    CompileError,
    InvalidArgumentError,
    NoHostMemoryError,
)
from .._interrupts import in_turn
from .._native_build import cc_command
from .._scalars import host_types, scalar_type
from .._threads import Freer
from .._timeline import LATER_FAIL, QUEUE_DISCARDED, discarded_error, failure_error

_ALIGN = 64
MAX_ARGS = _native.MAX_ARGS
TIMES_KEPT = 4096  # device times are kept for a queue's last 4096 commands
SPIN_NS = 50_000  # a queue thread spins this long for the next command before sleeping
# The queue threads' nice value (Linux): the lowest priority by default, so that a loop
# thread that wakes runs before spinning kernels; $ASYNCMETAL_CPU_QUEUE_NICE sets another
# (0-19) for the queues made after it is set, e.g. where other busy processes starve them.
QUEUE_NICE = 19
NICE_VARIABLE = "ASYNCMETAL_CPU_QUEUE_NICE"


def queue_nice() -> int:
    """The nice value for a queue thread made now."""
    given = os.environ.get(NICE_VARIABLE)
    if given is None or given == "":
        return QUEUE_NICE
    try:
        nice = int(given)
    except ValueError:
        nice = -1
    if not 0 <= nice <= 19:
        raise InvalidArgumentError(
            f"${NICE_VARIABLE} must be an integer from 0 to 19, got {given!r}"
        )
    return nice


# A kernel's calls to functions of its own source bind to them, not to a library's of the
# same name loaded before (libc's truncate, write, kill...): ELF shared objects resolve
# such calls through the process's global symbols otherwise. (Mach-O binds them within
# the library already.)
_LINK = ("-Wl,-Bsymbolic",) if sys.platform.startswith("linux") else ()


class CCompiler(Compiler):
    """C source -> shared object, with the compiler the argument ``cc`` names, or where
    none is given, ``$CC`` (the program ``cc`` where unset) as it is when the compiler is
    made: a device's compiler keeps the ``$CC`` of its opening, and
    one set later is a compiler of its own (another identity, other binaries). Pickles as
    its command and flags."""

    name = "cc"

    def __init__(
        self, cc: str | Sequence[str] | None = None, flags: Sequence[str] = ("-O2",)
    ) -> None:
        # The program and the words ``$CC`` gives with it (``_native_build.cc_command``);
        # a str ``cc`` is one program.
        if isinstance(cc, str):
            cc = (cc,) if cc else None
        self.cc = tuple(cc) if cc else tuple(cc_command())
        self.flags = tuple(flags)

    def config(self) -> tuple[Any, ...]:
        return (self.cc, self.flags)

    def _command(self) -> tuple[str, ...]:
        return self.cc

    def version(self) -> str:
        command = self._command()  # (its flags in $CC make other binaries)
        version = _cc_version(command)  # (first: a compiler that hangs is told at once)
        # The C types it compiles for are asked here too: compile reads the identity
        # first, off the loop, so that reading a kernel's value types runs nothing.
        self.plain_types()
        # (checks_identity: its compiles carry the checks of what kernels return and
        # take, so binaries cached before them, or before they changed, which a
        # source's key alone would find, are not)
        return " ".join((version, *command[1:], *_LINK, checks_identity()))

    def plain_types(self) -> Mapping[str, str]:
        """The types of a plain ``char`` and of ``wchar_t`` as this compiler, with its
        flags (``-funsigned-char``...), compiles C (``_scalars.platform_types``)."""
        return _plain_types(self._command(), _type_flags(self.flags))

    def _value_types(self, src: str, name: str) -> tuple[tuple[str | None, str], ...]:
        return c_value_types(src, name, self.plain_types())

    def _answered(self, signature: Signature, name: str, binary: bytes, src: str) -> Signature:
        # (what the checks' compile says of the types the source does not read: a
        # typedef in #if branches, a header's, a macro a compile option defines)
        return answered_values(signature, name, binary, src)

    def compile(self, src: str) -> bytes:
        command = self._command()
        cc = command[0]
        if shutil.which(cc) is None:
            missing = "is not an executable" if os.sep in cc else "is not on PATH"
            raise CompileError(
                f"compiling cpu kernels needs a C compiler: {cc!r} {missing} "
                "(install one, or set $CC to one)"
            )
        # What the functions a launch can name return and take by value, where the
        # source does not say, is checked by the compiler (``signature_checks``), in the
        # same compile: a refused one fails it, saying why. Where the checks' lines have
        # diagnostics (a refusal; a check that does not compile: a function within an
        # ``#if 0``...), the source is compiled alone, for its own log and binary: a
        # refusal stands where it compiles (its own errors are told first).
        checks, checked = signature_checks(src)
        with tempfile.TemporaryDirectory(prefix="asyncmetal-cc-") as tmp:
            out = os.path.join(tmp, "kernel.so")
            proc, log = _cc(command, self.flags, src + checks, out)
            unread: frozenset[int] = frozenset()
            while checks and SIGNATURE_CHECKS_FILE in log:
                refused = refused_signature(log, checked) if proc.returncode != 0 else None
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(out)
                # (checks that do not compile -- of a function the preprocessor drops --
                # may end the compile before later checks are read, -Wfatal-errors or an
                # error limit making theirs the last error told: it is compiled again
                # without them, until each check left compiles, or none is left)
                if refused is None and not unread_checks(log) <= unread:
                    unread |= unread_checks(log)
                    checks = signature_checks(src, unread)[0]
                    proc, log = _cc(command, self.flags, src + checks, out)
                    continue
                proc, log = _cc(command, self.flags, src, out)
                if refused is not None and proc.returncode == 0:
                    raise refused
                break
            if proc.returncode != 0:
                raise CompileError(f"{cc} failed with exit code {proc.returncode}", log)
            if not os.path.exists(out):  # (it exits 0 having made nothing to load)
                raise CompileError(
                    f"{cc} made no kernel library: an option stops it before it links one "
                    "(-fsyntax-only, --help, -###...)",
                    log,
                )
            self._last_log = log
            with open(out, "rb") as f:
                return f.read()

    def _params(self, src: str, name: str) -> tuple[ParamKind, ...]:
        """The kernel's parameters, refused when the queue threads could not pass them
        all: checked before compiling, not at every launch."""
        params = scalar_params(src, name)
        conventions = calling_conventions(src, name)
        other = sorted(conventions & OTHER_CONVENTIONS)
        if other:
            raise CompileError(
                f"cpu kernel {name!r} is declared {other[0]}: it takes its parameters in "
                "other registers than the C calling convention a launch calls it with "
                "(x86-64 System V, AArch64), so it would read garbage (or crash the "
                "process): drop the attribute, or make it sysv_abi",
                name=name,
            )
        abi = [flag for flag in (*self.cc[1:], *self.flags) if flag.startswith("-mabi=")]
        if abi and abi[-1] == "-mabi=ms" and "sysv_abi" not in conventions:
            raise CompileError(
                f"cpu kernel {name!r} is compiled with -mabi=ms, which makes it take its "
                "parameters in the Microsoft x64 convention's registers, not those of the "
                "C calling convention a launch calls it with (x86-64 System V), so it would "
                "read garbage (or crash the process): drop the option, or declare the "
                "kernel __attribute__((sysv_abi))",
                name=name,
            )
        if len(params) > MAX_ARGS:
            raise CompileError(
                f"cpu kernel {name!r} has {len(params)} parameters; cpu kernels take at most "
                f"{MAX_ARGS} (buffers and vals together)",
                name=name,
            )
        return params


def _cc(
    command: Sequence[str], flags: Sequence[str], src: str, out: str
) -> tuple[subprocess.CompletedProcess[bytes], str]:
    """``src`` compiled to the shared object ``out``: the compiler's process, and its log."""
    proc = subprocess.run(
        [*command, *flags, "-shared", "-fPIC", *_LINK, "-x", "c", "-", "-o", out],
        input=src.encode(),
        capture_output=True,
        check=False,
    )
    return proc, (proc.stderr + proc.stdout).decode(errors="replace")


@functools.lru_cache(maxsize=8)
def _cc_version(cc: tuple[str, ...]) -> str:
    """The compiler's version and target: machines of two architectures that share a
    cache directory (a network home) must not share binaries. Blocks (up to
    ``VERSION_TIMEOUT_S`` for each question): asked off the loop, through
    ``compiler_identity``. CompileError where the compiler does not answer in time."""
    hint = "check it, or set $CC to another"
    version = tool_answer([*cc, "--version"], hint)
    target = tool_answer([*cc, "-dumpmachine"], hint)
    if version is None or target is None:
        return "missing"
    first_line = version.stdout.decode(errors="replace").partition("\n")[0]
    machine = target.stdout.decode(errors="replace").strip() if target.returncode == 0 else ""
    return f"{first_line} {machine or platform.machine()}"


# Flags that change no C type (macros, include paths, optimisation, warnings, debug
# information): left out of asking the compiler, so that one answer serves compiles
# that differ only in them; those in _WITH_NEXT take the next flag as their argument.
_TYPE_NEUTRAL = ("-D", "-U", "-I", "-O", "-W", "-g")
_WITH_NEXT = frozenset(("-D", "-U", "-I", "-include", "-isystem", "-iquote"))


def _type_flags(flags: Sequence[str]) -> tuple[str, ...]:
    kept: list[str] = []
    flags_left = iter(flags)
    for flag in flags_left:
        if flag in _WITH_NEXT:
            next(flags_left, None)
        elif not flag.startswith(_TYPE_NEUTRAL):
            kept.append(flag)
    return tuple(kept)


@functools.cache
def _plain_types(cc: tuple[str, ...], flags: tuple[str, ...]) -> Mapping[str, str]:
    """The types of a plain ``char`` and of ``wchar_t`` as ``cc`` with ``flags``
    compiles C, asked of it once (its predefined ``__CHAR_UNSIGNED__`` and
    ``__WCHAR_TYPE__``, as GCC and clang define them); the host platform's where it
    cannot be asked (a compile with it fails then anyway). CompileError where it does
    not answer in time (as for its version: asked with it, off the loop)."""
    host = host_types()
    question = [*cc, *flags, "-dM", "-E", "-x", "c", os.devnull]
    proc = tool_answer(question, "check it, or set $CC to another")
    if proc is None or proc.returncode != 0:
        return host
    macros = dict(re.findall(r"^#define (\w+) ?(.*)$", proc.stdout.decode(errors="replace"), re.M))
    wchar = scalar_type(macros.get("__WCHAR_TYPE__", "").split(), {})
    return {
        **_library_types(cc, flags),
        "char": "uint8" if "__CHAR_UNSIGNED__" in macros else "int8",
        "wchar_t": wchar or host["wchar_t"],
    }


# The integer and floating-point types of the C library's headers that a kernel names
# without defining them: each C library and ABI gives them their own widths
# (``int_fast16_t``: 64 bits on glibc's x86-64 and AArch64, 32 on musl's, 16 on macOS),
# so the compiler is asked (``_library_types``).
LIBRARY_TYPES = (
    *(
        f"{u}int_{kind}{n}_t"
        for u in ("", "u")
        for kind in ("least", "fast")
        for n in (8, 16, 32, 64)
    ),
    *("intmax_t", "uintmax_t", "intptr_t", "uintptr_t", "size_t", "ptrdiff_t", "ssize_t"),
    *("off_t", "time_t", "clock_t", "clockid_t", "pid_t", "uid_t", "gid_t", "id_t", "mode_t"),
    *("dev_t", "ino_t", "nlink_t", "blksize_t", "blkcnt_t", "fsblkcnt_t", "fsfilcnt_t"),
    *("suseconds_t", "useconds_t", "key_t", "sig_atomic_t", "wint_t", "socklen_t"),
    *("sa_family_t", "u_char", "u_short", "u_int", "u_long"),
    *(f"u_int{n}_t" for n in (8, 16, 32, 64)),
    *("char8_t", "char16_t", "char32_t", "float_t", "double_t"),
)
_PROBE_HEADERS = (
    *("stddef.h", "stdint.h", "signal.h", "time.h", "wchar.h", "math.h", "uchar.h"),
    *("sys/types.h", "sys/socket.h"),
)
# What precedes the answers in the compiled probe.
_PROBE_MARK = b"asyncmetal library types:"


def _probe_source(names: Sequence[str]) -> str:
    """C whose compiled data holds, after ``_PROBE_MARK``, three bytes for each of
    ``names``: its size, whether it is signed, whether it is a floating-point type."""
    includes = "".join(
        f"#if __has_include(<{header}>)\n#include <{header}>\n#endif\n" for header in _PROBE_HEADERS
    )
    answers = "".join(f"sizeof({t}), ({t})-1 < ({t})0, ({t})0.5 != ({t})0,\n" for t in names)
    mark = ", ".join(map(str, _PROBE_MARK))
    return (
        "#define _GNU_SOURCE 1\n"  # (every type the C library has: widths are alike)
        f"{includes}const unsigned char asyncmetal_library_types[] = {{\n{mark},\n{answers}}};\n"
    )


def _library_types(cc: tuple[str, ...], flags: tuple[str, ...]) -> dict[str, str]:
    """``LIBRARY_TYPES`` as ``cc`` with ``flags`` compiles them (their scalar types; a
    name that is no such scalar, or that the C library does not have, left out): a
    probe is compiled, not run, and its data read. Nothing where the compiler cannot
    say (a compile with it fails then anyway)."""
    try:
        return _asked_library_types(cc, flags)
    except OSError:  # (the temporary directory: compiling fails there too, saying so)
        return {}


def _asked_library_types(cc: tuple[str, ...], flags: tuple[str, ...]) -> dict[str, str]:
    names = list(LIBRARY_TYPES)
    with tempfile.TemporaryDirectory(prefix="asyncmetal-cc-") as tmp:
        source, out = os.path.join(tmp, "types.c"), os.path.join(tmp, "types.o")
        for _ in range(3):  # (again without the names its errors name: not declared)
            with open(source, "w") as f:
                f.write(_probe_source(names))
            # (Its object is written where it runs: named after its source, types.o.)
            question = [*cc, *flags, "-fno-lto", "-c", "types.c"]
            proc = tool_answer(question, "check it, or set $CC to another", cwd=tmp)
            if proc is None:
                return {}
            if proc.returncode == 0:
                break
            errors = set(re.findall(r"\w+", proc.stderr.decode(errors="replace")))
            if errors.isdisjoint(names):
                return {}
            names = [t for t in names if t not in errors]
        else:
            return {}
        with open(out, "rb") as f:
            data = f.read()
    at = data.find(_PROBE_MARK) + len(_PROBE_MARK)
    if at < len(_PROBE_MARK) or at + 3 * len(names) > len(data):
        return {}
    found = {}
    for i, name in enumerate(names):
        size, signed, floating = data[at + 3 * i : at + 3 * i + 3]
        if floating:
            type_ = {2: "float16", 4: "float32", 8: "float64"}.get(size)
        else:
            type_ = f"{'' if signed else 'u'}int{8 * size}" if size in (1, 2, 4, 8) else None
        if type_ is not None:
            found[name] = type_
    return found


class _DlInfo(ctypes.Structure):
    _fields_ = (
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    )


def _libdl() -> ctypes.CDLL:
    """The library with dladdr and dlclose: the C library itself since glibc 2.34 and
    on macOS, libdl before (which the interpreter links)."""
    for name in (None, ctypes.util.find_library("dl")):
        lib = ctypes.CDLL(name)
        if hasattr(lib, "dladdr") and hasattr(lib, "dlclose"):
            lib.dladdr.argtypes = (ctypes.c_void_p, ctypes.POINTER(_DlInfo))
            lib.dladdr.restype = ctypes.c_int
            lib.dlclose.argtypes = (ctypes.c_void_p,)
            lib.dlclose.restype = ctypes.c_int
            return lib
    raise OSError("dladdr/dlclose not found")


_dl = _libdl()


def _dlclose(handle: int) -> None:
    _dl.dlclose(handle)


def _own_symbol(lib: ctypes.CDLL, name: str, path: str) -> int:
    """The address of ``name`` defined in ``lib`` itself (loaded from ``path``).

    dlsym also searches the library's dependencies: a kernel that is not defined (say,
    only inside ``#if 0``) but shares its name with a C library function (``getpid``)
    would resolve to that function. So the object holding the address dlsym found is
    checked (dladdr) to be this library's file. AttributeError if it is not there.
    """
    try:
        address = ctypes.cast(lib[name], ctypes.c_void_p).value  # [] also takes "__x__"
    except AttributeError:
        address = None
    info = _DlInfo()
    if address and _dl.dladdr(address, ctypes.byref(info)) and info.dli_fname:
        found = os.fsdecode(info.dli_fname)
        with contextlib.suppress(OSError):
            if found == path or os.path.samefile(found, path):
                return address
    raise AttributeError(f"{name!r} is not defined in the compiled library")


_ET_DYN = 3
_ELF_TYPES = {1: "a relocatable object (ELF type 1)", 2: "an executable (ELF type 2)"}


def _program_headers(binary: bytes) -> list[tuple[int, int, int, int]]:
    """``binary``'s ELF program headers, as (type, offset in the file, address, size in
    the file); none where it is not ELF (Mach-O on macOS). OSError where the headers
    themselves are cut short."""
    if binary[:4] != b"\x7fELF":
        return []
    if len(binary) < 64 or binary[4] not in (1, 2) or binary[5] not in (1, 2):
        raise OSError("the compiled library is cut short (an incomplete ELF header)")
    order = "<" if binary[5] == 1 else ">"
    (kind,) = struct.unpack_from(order + "H", binary, 16)
    if kind != _ET_DYN:  # an object file (-c among the options) has no program headers
        what = _ELF_TYPES.get(kind, f"an ELF file of type {kind}")
        raise OSError(f"the compiler made {what}, not a shared library")
    if binary[4] == 2:  # ELFCLASS64: e_phoff at 32; type, flags, offset, address, .., size
        (table,) = struct.unpack_from(order + "Q", binary, 32)
        entry, count = struct.unpack_from(order + "HH", binary, 54)
        row_format, least = order + "IIQQQQ", 56
    else:  # ELFCLASS32: e_phoff at 28; type, offset, address, .., size
        (table,) = struct.unpack_from(order + "I", binary, 28)
        entry, count = struct.unpack_from(order + "HH", binary, 42)
        row_format, least = order + "IIIII", 32
    if not count:
        return []
    if entry < least or table + entry * count > len(binary):
        raise OSError("the compiled library is cut short (its program headers)")
    headers = []
    for row in range(table, table + entry * count, entry):
        fields = struct.unpack_from(row_format, binary, row)
        if binary[4] == 2:
            kind, _, offset, address, _, size = fields
        else:
            kind, offset, address, _, size = fields
        headers.append((kind, offset, address, size))
    return headers


def _check_extent(binary: bytes) -> None:
    """Raise OSError if ``binary``, an ELF shared object, ends before what its program
    headers say is in the file.

    dlopen maps each segment from the file; a page mapped past the file's end raises
    SIGBUS when the loader touches it, which kills the process. A cache entry checks its
    own checksum, but one stored already cut short (with the checksum of what was
    stored) passes that. Not ELF (Mach-O on macOS): left to the loader.
    """
    for _, offset, _, size in _program_headers(binary):
        if offset + size > len(binary):
            raise OSError(
                f"the compiled library is cut short: a segment ends at byte {offset + size}"
                f" of a {len(binary)}-byte file"
            )


def _unwritable(exc: OSError) -> PermissionError:
    """The error of a kernel library that cannot be written to the temporary directory
    (missing, unwritable, full): the place's fault, not the binary's (see
    Backend.load), so no rebuild would load either."""
    return PermissionError(
        exc.errno,
        f"cannot write a kernel library to {tempfile.gettempdir()}: {exc.strerror} -- each "
        "kernel library is written to the temporary directory to be loaded: set $TMPDIR "
        "to one that is writable and allows running code",
    )


_PT_LOAD, _PT_DYNAMIC, _DT_NEEDED, _DT_STRTAB = 1, 2, 1, 5


def _needed(binary: bytes) -> list[str]:
    """The libraries ``binary`` (a checked ELF shared object) names as its dependencies
    (DT_NEEDED); none where it is not ELF or names none."""
    headers = _program_headers(binary)
    wide, order = binary[4:5] == b"\x02", "<" if binary[5:6] == b"\x01" else ">"
    pair = struct.Struct(order + ("qQ" if wide else "iI"))
    names, strtab = [], None
    for kind, offset, _, size in headers:
        if kind != _PT_DYNAMIC:
            continue
        for at in range(offset, offset + size - pair.size + 1, pair.size):
            tag, value = pair.unpack_from(binary, at)
            if tag == 0:  # DT_NULL
                break
            if tag == _DT_NEEDED:
                names.append(value)
            elif tag == _DT_STRTAB:
                strtab = value
    if strtab is None:
        return []
    for kind, offset, address, size in headers:  # the table's address to its place in the file
        if kind == _PT_LOAD and address <= strtab < address + size:
            base = offset + strtab - address
            return [os.fsdecode(binary[base + at : binary.index(b"\0", base + at)]) for at in names]
    return []


# Sanitizer runtimes that must be the first library of the process: loaded later (by a
# kernel library built with -fsanitize=address under gcc, which names it) they end the
# process from inside dlopen ("ASan runtime does not come first in initial library list").
_FIRST_RUNTIMES = ("libasan.", "libhwasan.")


def _check_first_runtimes(binary: bytes) -> None:
    """Raise PermissionError (no rebuilt binary would load) where ``binary`` needs a
    sanitizer runtime that this process did not load first; loaded already (Python run
    with it in LD_PRELOAD), the kernel library loads as any other."""
    for name in _needed(binary):
        if not name.startswith(_FIRST_RUNTIMES):
            continue
        try:
            ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            raise PermissionError(
                errno.EPERM,
                f"the kernel library needs {name} (built with -fsanitize=address), which "
                "must be the first library the process loads: run Python with it "
                "preloaded (LD_PRELOAD=$(cc -print-file-name=" + name + ")), or build "
                "without it",
            ) from None


_pinned: set[str] = set()


def _pin_dependencies(binary: bytes) -> None:
    """Keep the libraries a kernel library loaded with it (an OpenMP runtime, say)
    loaded for the process's life. Unloading a kernel library unloads them too when
    nothing else uses them; but a library may leave threads of its own running its code
    after the kernel returned (OpenMP's worker threads, which a queue thread's exit lets
    go of without waiting for them), and those die of the unmapping, and the process
    with them. Only the kernel libraries themselves are unmapped then: the dependencies
    are few and shared by all of them."""
    if not hasattr(os, "RTLD_NODELETE") or not hasattr(os, "RTLD_NOLOAD"):
        return
    for name in _needed(binary):
        if name not in _pinned:
            with contextlib.suppress(OSError):  # (not loaded after all: nothing to keep)
                ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_NODELETE | os.RTLD_LAZY)
                _pinned.add(name)


class _Memory:
    __slots__ = ("address", "array")

    def __init__(self, nbytes: int) -> None:
        raw = np.empty(nbytes + _ALIGN, np.uint8)
        start = -raw.ctypes.data % _ALIGN
        self.array = raw[start : start + nbytes]
        self.address: int = self.array.ctypes.data

    def drop(self) -> None:
        """Let go of the array: its pages are unmapped here, unless a view handed out
        (``host_view``) still holds them."""
        self.array = _NO_MEMORY
        self.address = 0


_NO_MEMORY = np.empty(0, np.uint8)


class CPUTimeline(ForkableTimeline):
    """A timeline in the native runtime: queue threads signal and wait on it in C."""

    host_raised = True

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self.c_timeline: int = lib.am_timeline_new()
        if not self.c_timeline:
            raise NoHostMemoryError("am_timeline_new returned NULL: no memory for a timeline")
        self._value: _native.ValueReader = _native.timeline_reader(self.c_timeline)
        self._signal = _native.fast_call(lib, "am_timeline_signal_here")

    @property
    def value(self) -> int:
        return self._value.value

    def signal(self, value: int) -> None:
        self._signal(self.c_timeline, value, 0)

    def signal_here(self, value: int, notifier: int) -> None:
        self._signal(self.c_timeline, value, notifier)

    def forked(self, message: str) -> None:
        """In a forked child, where the queue threads that raise it are the parent's (a
        value read would never move): every read raises ClosedResourceError(message)."""
        self._value = InheritedValue(message)

    def __del__(self) -> None:
        # Only reached once no queue command nor watch refers to it (they hold us); of
        # one the runtime had no memory for, there is nothing (freeing NULL crashed).
        if self.c_timeline:
            self._lib.am_timeline_free(self.c_timeline)


def _address(arg: Arg) -> int:
    memory: _Memory = arg.handle
    return memory.address + arg.offset


class CPUQueue(NativeQueue):
    """A queue thread of the native runtime. Python only keeps the commands' objects
    alive until the queue's own timeline has passed them."""

    def __init__(self, lib: ctypes.CDLL, timeline: NativeTimeline) -> None:
        self._lib = lib
        self._timeline = timeline
        self._handle: int | None = lib.am_queue_new(timeline.c_timeline, SPIN_NS, queue_nice())
        if not self._handle:
            raise NoHostMemoryError("am_queue_new returned NULL: no memory for a queue")
        # One collected unclosed -- made for a new_queue that an interrupt or an error
        # stopped before anything held it -- would keep its thread and its memory for
        # good: it is closed then, abandoned, so that the thread that collects it (any,
        # a loop's too) never waits there for a device wait; one never handed out had
        # nothing submitted anyway. A close detaches this.
        self._release_dropped = weakref.finalize(self, lib.am_queue_close, self._handle, 1)
        self._release_dropped.atexit = False  # (open devices close theirs at exit)
        self._keep: KeepAlive = KeepAlive(timeline)
        self._discarded: str | None = None  # what dropped what had not started (discard)
        self._closing = threading.Lock()  # a discard (any thread) and the close's take
        # Held over a whole close: a close on another thread meanwhile waits for it (not
        # _closing, which a discard on a loop takes and must get at once).
        self._close_lock = threading.Lock()
        # What a close has left to do (see close), and the handle it closes once.
        self._left: list[tuple[Any, ...]] = []
        self._handle_left: int | None = None
        self._scratch = (ctypes.c_int64 * MAX_ARGS)()
        self._call = lib.am_queue_call
        extension = _native.extension()
        self._fast_call = None if extension is None else extension.queue_call
        self._times = (ctypes.c_int64 * (3 * TIMES_KEPT))()  # start, end, value per row
        self._times_address = ctypes.addressof(self._times)
        # The first of its commands that failed (a device wait of theirs ended on a
        # timeline that failed instead), or was abandoned (0: none), read in place.
        assert timeline.c_timeline is not None
        self._failed_from = _native.failed_from(timeline.c_timeline)

    def failure(self, value: int) -> BaseException | None:
        first = self._failed_from.value
        if not first or value < first:  # the common case: one read in place
            return None
        own = self._timeline.c_timeline
        assert own is not None
        failure = _native.timeline_failure(own)
        if failure is None or failure.cause == own:
            if failure is not None and failure.error == _native.DISCARDED:
                return discarded_error(value, self._discarded or QUEUE_DISCARDED)
            return None  # abandoned by its own device's close (Queue says so)
        lead = "this command did not run: it follows a device-side wait for a value that"
        return failure_error(failure, lead, LATER_FAIL)

    def fails_later(self) -> bool:
        if not self._failed_from.value:
            return False
        own = self._timeline.c_timeline
        failure = _native.timeline_failure(own) if own is not None else None
        return failure is not None and failure.cause != own  # (own: its device's close)

    def _row(self, record: Record) -> int:
        """The address of the times row the queue thread writes for ``record``."""
        record._ring = self._times
        record._row = row = record.value % TIMES_KEPT
        return self._times_address + 24 * row

    def launch_target(self) -> tuple[Any, ...] | None:
        if self._fast_call is None:
            return None
        return _native_contract.cpu_launch_target(
            self,
            self._handle,
            times=self._times,
            times_address=self._times_address,
            times_kept=TIMES_KEPT,
            keep_items=self._keep.items,
            memory_type=_Memory,
        )

    def _submitted(self, status: int, value: int, keep: object) -> None:
        if status != 0:
            raise NoHostMemoryError("the cpu queue had no memory for another segment of commands")
        self._keep.add(value, keep)

    def launch(
        self,
        program: Any,
        args: Sequence[Arg],
        global_size: tuple[int, int, int],
        local_size: tuple[int, int, int],
        value: int,
        record: Record,
    ) -> None:
        nargs = len(args)
        if nargs > MAX_ARGS:
            raise ArgumentTypeError(f"cpu kernels take at most {MAX_ARGS} parameters")
        # The times row, inline (this is the hot path of every launch).
        record._ring = self._times
        record._row = row = value % TIMES_KEPT
        if self._fast_call is not None:  # the extension packs the arguments itself
            status = self._fast_call(
                self._handle, program, args, self._times_address + 24 * row, value
            )
        else:
            ints = self._scratch  # the runtime copies the arguments before returning
            floats = 0  # bit i: argument i is a float's bits
            for i in range(nargs):
                handle, offset, val = args[i]
                if val is None:
                    ints[i] = handle.address + offset
                elif isinstance(val, int):
                    ints[i] = val
                else:
                    ints[i] = val.bits
                    floats |= (val.type[0] == "f") << i
            status = self._call(
                self._handle, program, nargs, ints, floats, self._times_address + 24 * row, value
            )
        if status or nargs or self._keep.items:
            self._submitted(status, value, args or None)

    def signal(self, timeline: NativeTimeline, target: int, value: int, record: Record) -> None:
        assert timeline.c_timeline is not None
        status = self._lib.am_queue_signal(self._handle, timeline.c_timeline, target, value)
        self._submitted(status, value, timeline)

    def wait(self, timeline: NativeTimeline, target: int, value: int, record: Record) -> None:
        assert timeline.c_timeline is not None
        status = self._lib.am_queue_wait(self._handle, timeline.c_timeline, target, value)
        self._submitted(status, value, timeline)

    def copy_part(
        self,
        dst: int,
        src: int,
        nbytes: int,
        part: int,
        value: int,
        keep: object,
        after: tuple[int, int],
        claimed: tuple[int, int],
        count: tuple[int, int],
        ready: tuple[int, int],
    ) -> None:
        """A share of a chunk's host copy (the cuda staging path): once the device word of
        the native timeline ``after[0]`` reaches ``after[1]`` (no wait if it is 0), take
        ``part``-byte parts of the ``nbytes`` one at a time -- numbered from ``claimed[1]``
        on the uint64 at ``claimed[0]``, which the queues sharing the copy share -- copy
        each and add one to the uint64 at ``count[0]``; the part that brings it to
        ``count[1]`` raises the device word at ``ready[0]`` to ``ready[1]``. Every queue
        that shares the copy gets this call; whichever is free first copies more. A
        stream writes or waits on these words, which wakes no thread: one of the queue
        threads waiting on a timeline's word polls it, the others sleep."""
        status = self._lib.am_queue_copy_part(
            self._handle,
            dst,
            src,
            nbytes,
            part,
            after[0] or None,
            after[1],
            *claimed,
            *count,
            *ready,
            None,
            value,
        )
        self._submitted(status, value, keep)

    def memmove(
        self, dst: int, src: int, nbytes: int, value: int, record: Record, keep: object
    ) -> None:
        status = self._lib.am_queue_copy(self._handle, dst, src, nbytes, self._row(record), value)
        self._submitted(status, value, keep)

    def copy(
        self, dst: Arg, src: Arg, nbytes: int, value: int, record: Record, peer: Any = None
    ) -> None:
        self.memmove(_address(dst), _address(src), nbytes, value, record, (dst, src))

    def copyin(self, dst: Arg, src: memoryview, value: int, record: Record) -> None:
        address, keep = host_address(src)
        self.memmove(_address(dst), address, src.nbytes, value, record, (dst, keep))

    def copyout(self, dst: memoryview, src: Arg, value: int, record: Record) -> None:
        address, keep = host_address(dst)
        self.memmove(address, _address(src), dst.nbytes, value, record, (keep, src))

    def fill(
        self, dst: Arg, nbytes: int, pattern: int, size: int, value: int, record: Record
    ) -> None:
        status = self._lib.am_queue_fill(
            self._handle, _address(dst), nbytes, pattern, size, self._row(record), value
        )
        self._submitted(status, value, dst)

    def discard(self, why: str) -> None:
        with self._closing:  # (the close frees the native queue)
            if self._handle is not None:
                self._discarded = why
                self._lib.am_queue_discard(self._handle)

    def let_go_kept(self) -> None:
        """Let go of the host objects of the commands this queue has done."""
        self._keep.let_go()

    def close(self, abandon: bool = False) -> None:
        """(See NativeQueue.close.) Every caller returns once the queue is released: a
        close under way on another thread is waited for, as it released it (with its
        ``abandon``)."""
        with self._close_lock:
            # The handle is taken once, with what the close has left to do recorded
            # beside it: a KeyboardInterrupt in the rest (a Ctrl-C as the device's close
            # runs at exit, on the main thread) leaves it to the next close, which goes
            # on from there (each step may run again; the native close takes the handle
            # first, with no call between the take and the close).
            with self._closing:
                if self._handle is not None:
                    self._left = [
                        (self._release_dropped.detach,),
                        (self._close_handle, int(abandon)),
                        (self._keep.clear,),
                    ]
                    self._handle_left, self._handle = self._handle, None
            in_turn(self._left)

    def _close_handle(self, abandon: int) -> None:
        """(A step of close.)"""
        handle, self._handle_left = self._handle_left, None
        if handle is not None:
            self._lib.am_queue_close(handle, abandon)


def host_memory() -> int:
    """Bytes of physical memory here (16 GiB where the system does not say)."""
    pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return int(pages * os.sysconf("SC_PAGE_SIZE")) if pages else 1 << 34


class HostQueues:
    """The queues and timelines of a backend whose queues are threads of the native
    runtime (the cpu device's, the npy device's): set ``_lib`` and ``_timelines``."""

    _lib: ctypes.CDLL
    _timelines: Timelines
    waits_across_kinds: ClassVar[bool] = True  # (a wait is on the timeline's condition)

    def new_queue(self, timeline: NativeTimeline) -> NativeQueue:
        assert isinstance(timeline, CPUTimeline)
        return CPUQueue(self._lib, timeline)

    def new_timeline(self, on_advance: Callable[[int], None]) -> NativeTimeline:
        # The runtime notifies waiting loops itself (through their pipes): no callback.
        timeline = CPUTimeline(self._lib)
        self._timelines.add(timeline)
        return timeline

    def forked(self, message: str) -> None:
        # The runtime leaves the parent's queues and timelines alone when they are
        # closed or freed in a child (native/timelines.c, am_forks).
        self._timelines.forked(message)


class CPUBackend(HostQueues, Backend):
    kind = "cpu"
    host_visible = True
    dlpack_device_type = 1  # kDLCPU
    fork_safe = True  # the native runtime's threads are the process's own
    any_index = True  # cpu:1, cpu:2... are further independent devices

    @classmethod
    def available(cls) -> list[str]:
        # Kernels need a C compiler at compile time only: with a packaged runtime the
        # device opens without one, and compiling then says what is missing.
        return ["cpu"] if _native.available() else []

    def __init__(self, index: int) -> None:
        self.index = index
        self._lib = _native.runtime()  # builds it on first use (we are off the loop)
        self._compiler = CCompiler()
        self._libraries: dict[int, Any] = {}  # by the address of the kernel loaded
        self._libraries_lock = threading.Lock()
        self._closed = False
        self._timelines = Timelines()
        self.live_allocations = 0
        self._info = DeviceInfo(name=f"cpu:{index}", total_memory=host_memory())
        # Unmapping a freed block's pages takes time, and frees come from the loop:
        # always on this thread (see Freer), started at the first free, stopped by close.
        self._freer: Freer[_Memory] = Freer("asyncmetal-cpu-free", _Memory.drop)

    @property
    def info(self) -> DeviceInfo:
        return self._info

    @property
    def compiler(self) -> Compiler:
        return self._compiler

    def load(self, binary: bytes, name: str, bindings: tuple[int, ...] | None = None) -> Any:
        _check_extent(binary)  # a file cut short would kill the process in dlopen
        try:
            f = tempfile.NamedTemporaryFile(prefix="asyncmetal-", suffix=".so")
        except OSError as exc:
            raise _unwritable(exc) from exc
        with f:
            try:
                f.write(binary)
                f.flush()
            except OSError as exc:
                raise _unwritable(exc) from exc
            # Under the lock: a close (another thread) never unloads a library that is
            # being looked into, nor misses one loaded for a compile that raced it.
            with self._libraries_lock:
                if self._closed:
                    raise ClosedResourceError(f"device {self._info.name} is closed")
                if hasattr(os, "RTLD_NOLOAD"):
                    _check_first_runtimes(binary)
                try:
                    lib = ctypes.CDLL(f.name, mode=os.RTLD_LOCAL)
                except OSError as exc:
                    if _native.maps_executable(f.fileno()):
                        raise  # the binary's own fault: the device rebuilds it
                    directory = os.path.dirname(f.name)
                    raise PermissionError(
                        errno.EPERM,
                        f"cannot run a kernel library from {directory}: code there may not "
                        "be mapped (a file system mounted noexec, or a security policy) -- "
                        "each kernel library is written to the temporary directory to be "
                        "loaded: set $TMPDIR to one that allows running code",
                    ) from exc
                _pin_dependencies(binary)
                try:
                    address = _own_symbol(lib, name, f.name)
                except AttributeError:
                    _dlclose(lib._handle)
                    raise
                self._libraries[address] = lib  # unloaded by unload() or close()
                return address

    def unload(self, native: Any) -> None:
        with self._libraries_lock:  # (after a close: already unloaded)
            lib = self._libraries.pop(native, None)
            if lib is not None:
                _dlclose(lib._handle)

    def allocate(self, nbytes: int) -> Any:
        memory = _Memory(nbytes)
        self.live_allocations += 1
        return memory

    def free(self, handle: Any) -> None:
        memory: _Memory = handle
        self.live_allocations -= 1
        # (Closed, or the parent's device in a forked child: memory a consumer held past
        # the close -- DLPack -- is let go of at once, where its last loan ended.)
        self._freer.free(memory)

    def host_view(self, handle: Any, offset: int, nbytes: int) -> memoryview:
        memory: _Memory = handle
        view: memoryview = memory.array[offset : offset + nbytes].data
        return view

    def forked(self, message: str) -> None:
        super().forked(message)
        self._libraries_lock = threading.Lock()  # may have been held at the fork
        self._closed = True
        self._libraries = {}  # the parent's to unload
        self._freer.forked()  # (the parent's thread: frees in the child let go at once)

    def close(self) -> None:
        # Every queue of the device has stopped (Device closes them first) and its
        # Programs can no longer be launched (Queue.launch refuses a closed device's),
        # so no thread can be inside these libraries' code any more: unmap them. A
        # device opened, used and closed over and over would otherwise keep every
        # library it loaded mapped, until the process runs out of mappings.
        with self._libraries_lock:
            self._closed = True
            libraries, self._libraries = self._libraries, {}
            for lib in libraries.values():
                _dlclose(lib._handle)
        # The allocator freed everything before (but memory its queues' abandoned
        # commands used, freed after this close: at once, the freer stopped): the freer
        # lets go of it, then stops.
        self._freer.stop()

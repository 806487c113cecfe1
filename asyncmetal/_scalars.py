"""The scalar types of kernel value parameters, and a launch value as its parameter
takes it.

A kernel's value parameters are read from its source (``_compile``): each is one of the
types below (numpy's names, and ``bool``), or unknown (a struct, a type the source's
own typedefs do not resolve). A launch value becomes what the backend passes: a plain
``int`` for an int32 (the common case, as it always was), else a :class:`Scalar` -- its
bits and its type, from which each backend takes the size (Metal's ``setBytes``) and
the register class (cpu: integer or floating-point).
"""

from __future__ import annotations

import functools
import numbers
import platform
import re
import sys
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from . import _scan
from ._errors import ArgumentTypeError, InvalidArgumentError

# Each type's size in bytes.
SIZES: dict[str, int] = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "float32": 4,
    "float64": 8,
}
_RANGES: dict[str, tuple[int, int]] = {"bool": (0, 1)}
for _name, _size in SIZES.items():
    if _name.startswith("int"):
        _RANGES[_name] = (-(1 << (8 * _size - 1)), (1 << (8 * _size - 1)) - 1)
    elif _name.startswith("uint"):
        _RANGES[_name] = (0, (1 << (8 * _size)) - 1)
_INT32_MIN, _INT32_MAX = _RANGES["int32"]

# What the native launch path reads of a program (``Program._value_codes``): one byte per
# value parameter -- an integer type's struct code (``?`` bool), or ``f`` for a float,
# which the native path leaves to Python.
CODES: dict[str | None, bytes] = {
    None: b"i",
    "bool": b"?",
    "int8": b"b",
    "uint8": b"B",
    "int16": b"h",
    "uint16": b"H",
    "int32": b"i",
    "uint32": b"I",
    "int64": b"q",
    "uint64": b"Q",
    "float16": b"f",
    "float32": b"f",
    "float64": b"f",
}


class Scalar(NamedTuple):
    """A launch value other than an int32: the 64-bit slot that carries it (a signed
    int64 whose low ``SIZES[type]`` bytes, little-endian, are the value's own), and its
    type."""

    bits: int
    type: str


# C's type names (cpu C, CUDA C, the Metal Shading Language), after the qualifiers are
# dropped; the integer keywords (signed, unsigned, char, short, int, long) are read
# apart. ``long`` is 64-bit (LP64: Linux, macOS, CUDA's host, Metal).
_NAMED: dict[str, str] = {
    "float": "float32",
    "_Float32": "float32",
    "double": "float64",
    "_Float64": "float64",
    "_Float32x": "float64",  # (a double wherever double is IEEE binary64: GCC's, clang's)
    "half": "float16",
    "_Float16": "float16",
    "__half": "float16",
    "bool": "bool",
    "_Bool": "bool",
    "uchar": "uint8",
    "ushort": "uint16",
    "uint": "uint32",
    "ulong": "uint64",
    "size_t": "uint64",
    "uintptr_t": "uint64",
    "ssize_t": "int64",
    "ptrdiff_t": "int64",
    "intptr_t": "int64",
    # C11's <uchar.h> types (uint_least16_t, uint_least32_t), C++'s keywords alike.
    "char16_t": "uint16",
    "char32_t": "uint32",
    **{f"int{n}_t": f"int{n}" for n in (8, 16, 32, 64)},
    **{f"uint{n}_t": f"uint{n}" for n in (8, 16, 32, 64)},
}
# Qualifiers, and Metal's address spaces.
_QUALIFIERS = frozenset(
    [
        "const",
        "volatile",
        # GCC's alternate spellings of the qualifiers, and C11's atomic one (an atomic
        # integer or float is passed as the plain one: its size and alignment).
        "__const",
        "__const__",
        "__volatile",
        "__volatile__",
        "_Atomic",
        "restrict",
        "__restrict",
        "__restrict__",
        "__grid_constant__",  # CUDA's, of a const kernel parameter
        "register",
        "constant",
        "device",
        "thread",
        "threadgroup",
    ]
)
_INTEGER_WORDS = frozenset(("signed", "unsigned", "char", "short", "int", "long"))
# GCC's alternate spellings of ``signed`` (a Linux header's ``typedef __signed__ char s8;``).
_SPELLINGS = {"__signed__": "signed", "__signed": "signed"}
# ``typeof`` (C23, GCC's ``__typeof__``...) or ``_Atomic`` of a type spelled in words
# alone (``__typeof__(float)``, ``_Atomic(unsigned int)``): that type. (``typeof`` of an
# expression, ``typeof(x * 2.0)``, is left: its type is not read from the source.)
_OF_TYPE_WORDS = re.compile(
    r"\b(?:typeof|__typeof__|__typeof|typeof_unqual|__typeof_unqual__|__typeof_unqual|_Atomic)"
    r"\s*\(([\w\s]*)\)"
)
# ``typeof`` and its spellings (one left by ``_OF_TYPE_WORDS``: of an expression).
TYPEOF_WORDS = frozenset(
    ("typeof", "__typeof__", "__typeof", "typeof_unqual", "__typeof_unqual__", "__typeof_unqual")
)
# Words no parameter is named: an unnamed parameter's declaration may end in one.
_KEYWORDS = _INTEGER_WORDS | {"float", "double", "_Bool", "_Float16", "_Float32", "_Float64"}
_KEYWORDS |= {"const", "volatile", "restrict", "wchar_t", "char16_t", "char32_t", "_Float32x"}
_KEYWORDS |= {"__const", "__const__", "__volatile", "__volatile__", "_Atomic", *_SPELLINGS}

# The types a platform's C ABI sets: a plain ``char`` (neither ``signed`` nor
# ``unsigned``) and ``wchar_t``. These are x86-64 Linux's and macOS's (Apple's arm64
# too); a plain char is signed in the Metal Shading Language as well.
# :func:`platform_types` gives other platforms'.
SIGNED_CHAR: Mapping[str, str] = {"char": "int8", "wchar_t": "int32"}


def host_types() -> Mapping[str, str]:
    """:func:`platform_types` of this host."""
    return platform_types(platform.machine(), sys.platform)


@functools.cache
def platform_types(machine: str, system: str) -> Mapping[str, str]:
    """The types of a plain ``char`` and of ``wchar_t`` under the C ABI of ``machine``
    (``platform.machine()``) and ``system`` (``sys.platform``): for a compiler that
    cannot be asked (see ``backends.cpu``).

    A plain char is unsigned on Linux's AArch64 and 32-bit ARM (their procedure call
    standards), PowerPC, s390x and RISC-V; signed on x86 and on macOS, whose arm64 ABI
    keeps it signed. ``wchar_t`` is an ``unsigned int`` on Linux's ARM ABIs, an ``int``
    on the others of Linux and macOS, and 16-bit unsigned on Windows."""
    machine = machine.lower()
    if system == "win32":
        return {"char": "int8", "wchar_t": "uint16"}
    if system == "darwin":
        return SIGNED_CHAR
    arm = machine.startswith(("aarch64", "arm"))
    unsigned = arm or machine.startswith(("ppc", "powerpc", "s390", "riscv"))
    return {"char": "uint8" if unsigned else "int8", "wchar_t": "uint32" if arm else "int32"}


_TYPEDEF = re.compile(r"\btypedef\s+([\w\s:]+?)\s+(\w+)\s*;")
# What ends a typedef of words (those ``_TYPEDEF`` reads: words, spaces, colons).
_TYPEDEF_END = re.compile(r"[^\w\s:]")
_TYPEDEF_WORD = re.compile(r"\btypedef\b")
_USING = re.compile(r"\busing\s+(\w+)\s*=\s*([\w\s:]+?)\s*;")  # C++'s typedef
# What no match of ``_USING`` holds but as its last character (``_scan.finditer``).
_NOT_IN_USING = re.compile(r"[^\w\s:=]")
_NOT_WORD = re.compile(r"\W")
_NEWLINE = re.compile("\n")
_DIRECTIVE = re.compile(r"^[ \t]*#[ \t]*(\w+)(.*)$", re.M)
_TYPE_MACRO = re.compile(r"[ \t]*(\w+)(?:[ \t]+([\w \t]*?))?[ \t]*$")
# What a declaration holds besides its type and name: attributes (``[[...]]``, GNU's
# ``__attribute__((unused))``, ``__attribute((unused))``), namespaces.
_NOT_TYPE_WORDS = re.compile(r"\[\[.*?\]\]|__attribute(?:__)?\s*\(\(.*?\)\)|\w+::")


def statements(
    text: str, pattern: re.Pattern[str], keyword: re.Pattern[str], stops: re.Pattern[str]
) -> list[tuple[str, ...]]:
    """``pattern.findall(text)`` (its groups, "" for one that took no part) for a pattern
    that begins with ``keyword`` and ends with the first of ``stops`` after it, a ``;``
    (a statement): ``pattern`` is tried at the first ``keyword`` of each statement only,
    so that the time is linear in the length of ``text``. findall's is quadratic: it
    tries each ``keyword`` of a statement that ends otherwise, reading on to its end (a
    source of a few KB of ``typedef`` with no ``;`` held the event loop for seconds).
    ``pattern`` must match at a statement's first ``keyword`` where it matches at a
    later one (a lazy body that can take the later ``keyword`` in). ``keyword``: a
    word (``\\btypedef\\b``); ``stops``: one character. Read in short steps
    (``_scan``)."""
    found: list[tuple[str, ...]] = []
    end = 0  # of the statement of the last keyword tried
    for first in _scan.finditer(keyword, text, _NOT_WORD):
        if first.start() < end:
            continue
        stop = _scan.search(stops, text, first.end(), 1)
        if stop is None:
            break
        end = stop.end()
        match = pattern.match(text, first.start(), end) if stop.group() == ";" else None
        if match:
            found.append(match.groups(""))
    return found


def typedefs(text: str, apart: set[str] | None = None) -> dict[str, list[str]]:
    """The plain typedefs of ``text`` (``typedef unsigned int u32;``, C++'s ``using u32 =
    unsigned int;``) and its object-like macros of type words (``#define REAL float``):
    name -> words. A name given different types (typedefs in ``#if`` branches, of which
    one compiles), a macro defined inside an ``#if`` (a default a compile option may
    override) or undefined is left out (and added to ``apart``, where given): which type
    the kernel takes cannot be told from the source."""
    found: dict[str, list[str]] = {}
    apart = set() if apart is None else apart

    def add(name: str, words: list[str]) -> None:
        if found.setdefault(name, words) != words:
            apart.add(name)

    for words, name in statements(text, _TYPEDEF, _TYPEDEF_WORD, _TYPEDEF_END):
        add(name, re.findall(r"\w+", words))
    for name, words in _scan.findall(_USING, text, _NOT_IN_USING):
        add(name, re.findall(r"\w+", words))
    depth = 0  # of #if blocks
    for directive, rest in _scan.findall(_DIRECTIVE, text, _NEWLINE):
        if directive in ("if", "ifdef", "ifndef"):
            depth += 1
        elif directive == "endif":
            depth -= 1
        elif directive in ("define", "undef"):
            macro = _TYPE_MACRO.match(rest)
            if macro is None:  # function-like, or more than words
                continue
            name, body = macro.group(1), macro.group(2)
            if directive == "undef" or depth:
                apart.add(name)
            else:
                add(name, body.split() if body else [])
    return {name: words for name, words in found.items() if name not in apart}


def resolved(words: list[str], typedefs: Mapping[str, list[str]]) -> list[str]:
    """Type words with each typedef's or macro's name replaced by what it names (in turn;
    a macro may stand for a qualifier, ``#define KCONST const``, or nothing)."""
    for _ in range(8):  # a typedef of a typedef...
        named = [w for word in words for w in typedefs.get(word, [word]) if w not in _QUALIFIERS]
        if named == words:
            break
        words = named
    return words


def type_words(declaration: str) -> list[str]:
    """The words of a parameter declaration's type: its name (the last word, where
    there are several and it is no keyword: a parameter may be unnamed, ``unsigned
    char``), qualifiers and attributes dropped."""
    declaration = _OF_TYPE_WORDS.sub(r" \1 ", re.sub(_NOT_TYPE_WORDS, " ", declaration))
    words = re.findall(r"\w+", declaration)
    words = words[:-1] if len(words) > 1 and words[-1] not in _KEYWORDS else words
    return [word for word in words if word not in _QUALIFIERS]


def scalar_type(
    words: list[str], typedefs: Mapping[str, list[str]], plain: Mapping[str, str] = SIGNED_CHAR
) -> str | None:
    """The scalar type that a declaration's type words name, or None where they name
    none of ``SIZES`` (a struct, a vector, ``long double``, an unknown name). ``plain``:
    the types of a plain ``char`` and of ``wchar_t``, which the platform sets."""
    words = [_SPELLINGS.get(word, word) for word in resolved(words, typedefs)]
    if len(words) == 1 and words[0] in plain:
        return plain[words[0]]
    if len(words) == 1 and words[0] in _NAMED:
        return _NAMED[words[0]]
    if not words or not _INTEGER_WORDS.issuperset(words):
        return None
    signed = "unsigned" not in words
    if "char" in words:
        bits = 8
    elif "short" in words:
        bits = 16
    elif "long" in words:
        bits = 64
    else:
        bits = 32
    return f"{'' if signed else 'u'}int{bits}"


def launch_value(value: object, declared: str | None, where: str, param: str) -> int | Scalar:
    """``value`` as the backend passes it to a parameter of type ``declared`` (None:
    not known), declared as ``param``: an int (an int32) or a :class:`Scalar`. Refuses
    (naming ``where``, the value) what the parameter would not receive as given: a
    float for an integer, a wider float for a narrower one, a value out of range.

    Python ints take the parameter's type (int32 where it is not known); Python floats
    take a floating-point parameter's type (refused where it is not known: pass
    ``np.float32``/``np.float64``); numpy scalars keep their own type, checked against
    a known parameter's (an integer's value must fit it; a float may widen, not
    narrow)."""
    if isinstance(value, (bool, np.bool_)):
        if declared != "bool":
            wanted = "a float" if declared and declared[0] == "f" else "an integer"
            raise ArgumentTypeError(
                f"{where} must be {wanted}, got {type(value).__name__}" + _takes(declared, param)
            )
        return Scalar(int(value), "bool")
    if isinstance(value, np.generic):
        own = value.dtype.name
        if own not in SIZES:
            raise ArgumentTypeError(
                f"{where} must be an integer or a float, got numpy {own}" + _takes(declared, param)
            )
        if own[0] == "f" and declared in (None, own):  # its own bits (a NaN's payload too)
            return Scalar(int.from_bytes(value.tobytes(), "little", signed=True), own)
        if declared is None:
            return _packed(value.item(), own, where, param)
        if (own[0] == "f") != (declared[0] == "f"):
            wanted = "a float" if declared[0] == "f" else "an integer"
            raise ArgumentTypeError(
                f"{where} must be {wanted}, got numpy {own}" + _takes(declared, param)
            )
        if own[0] == "f" and SIZES[own] > SIZES[declared]:
            raise ArgumentTypeError(
                f"{where} is a numpy {own}, wider than its parameter {param!r} ({declared}): "
                f"pass np.{declared}(...) to round it"
            )
        return _packed(value.item(), declared, where, param)
    if isinstance(value, float):
        if declared is None:
            raise ArgumentTypeError(
                f"{where} is a Python float, and the type of its parameter {param!r} is not "
                "known here: pass np.float32(x) or np.float64(x)"
            )
        if declared[0] != "f":
            raise ArgumentTypeError(
                f"{where} must be an integer, got float" + _takes(declared, param)
            )
        return _packed(value, declared, where, param)
    if isinstance(value, numbers.Integral):
        return _packed(int(value), declared or "int32", where, param)
    raise ArgumentTypeError(
        f"{where} must be an integer or a float, got {type(value).__name__}"
        + _takes(declared, param)
    )


def _takes(declared: str | None, param: str) -> str:
    return "" if declared is None else f"; its parameter {param!r} takes {declared}"


def _packed(value: float, type_: str, where: str, param: str) -> int | Scalar:
    """A Python number as a parameter of ``type_`` takes it (checked to fit)."""
    if type_[0] == "f":
        with np.errstate(over="raise"):
            try:
                raw = np.array(value, dtype=type_).tobytes()
            except (FloatingPointError, OverflowError):
                raise InvalidArgumentError(
                    f"{where} does not fit in {type_} (its parameter {param!r}): {value}"
                ) from None
        return Scalar(int.from_bytes(raw, "little", signed=True), type_)
    low, high = _RANGES[type_]
    if not low <= value <= high:  # (value: an int here)
        about = "" if type_ == "int32" else f" (its parameter {param!r})"
        raise InvalidArgumentError(f"{where} must fit in {type_}{about}: {value}")
    if type_ == "int32":
        return int(value)
    bits = int(value)
    return Scalar(bits - (1 << 64) if bits >= 1 << 63 else bits, type_)

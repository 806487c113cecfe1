"""Compilers: pickle-safe by construction, and what they read of a kernel's source."""

from __future__ import annotations

import bisect
import contextlib
import difflib
import functools
import hashlib
import os
import re
import signal
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal, NamedTuple

from . import _scan
from ._errors import ArgumentTypeError, CompileError, InvalidArgumentError
from ._scalars import (
    SIZES,
    TYPEOF_WORDS,
    host_types,
    resolved,
    scalar_type,
    statements,
    type_words,
    typedefs,
)

ParamKind = Literal["buffer", "value"]


# How long a compiler may take to say its version and target (milliseconds, as a rule):
# one that does not answer (a wrapper that hangs) fails the compile, rather than holding
# it -- and the thread that asks -- for good.
VERSION_TIMEOUT_S = 30.0


def tool_answer(
    command: list[str], hint: str, cwd: str | None = None
) -> subprocess.CompletedProcess[bytes] | None:
    """``command`` (a compiler asked its version) run to its end (in ``cwd``, where
    given), its output captured; None where it cannot be started. Blocks: call it off
    the loop (``Compiler.version`` is asked through ``compiler_identity``).
    CompileError, with ``hint``, once
    ``VERSION_TIMEOUT_S`` has passed and it and whatever it started (a wrapper's
    compiler, which would hold the output open) are killed."""
    try:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # a process group of its own, ended as one
            cwd=cwd,
        )
    except OSError:
        return None
    with proc:
        try:
            out, err = proc.communicate(timeout=VERSION_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # (unreaped: the group is its own)
            raise CompileError(
                f"`{' '.join(command)}` did not answer within {VERSION_TIMEOUT_S:g} s (the"
                f" compiler's version keys the compile cache): {hint}"
            ) from None
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


class Signature(NamedTuple):
    """What launches need of a kernel's parameters: each one's kind, in order, and each
    value parameter's scalar type (``_scalars.SIZES``' names; None where not known) and
    declaration, in order."""

    kinds: tuple[ParamKind, ...]
    values: tuple[tuple[str | None, str], ...]


# A launch's every argument is an 8-byte slot, the value in its low bytes (a buffer: its
# device address): a parameter the loaded kernel takes in more bytes would read past it.
SLOT_BYTES = 8


def binary_disagrees(signature: Signature, sizes: tuple[int, ...] | None) -> str | None:
    """Why launches of a kernel whose source reads as ``signature`` would pass the loaded
    kernel other bytes than its parameters take -- ``sizes``, each parameter's size in
    bytes as the loaded binary lays them out (``Backend.param_sizes``; None: not known)
    -- or None where they agree: a count that differs (a parameter list the source's
    reading got wrong), a buffer that is no 8-byte address, a value of a known type of
    another size, and a value of a type not known here (a header's struct) that is no
    1, 2, 4 or 8 bytes, which a launch's slot cannot carry."""
    if sizes is None:
        return None
    kinds = signature.kinds
    if len(sizes) != len(kinds):
        return (
            f"its source reads as {len(kinds)} parameter{'' if len(kinds) == 1 else 's'}, "
            f"the compiled kernel takes {len(sizes)}"
        )
    values = iter(signature.values)
    for i, (kind, size) in enumerate(zip(kinds, sizes, strict=True)):
        if kind == "buffer":
            if size != SLOT_BYTES:
                return (
                    f"parameter {i + 1} reads as a buffer (a device address of "
                    f"{SLOT_BYTES} bytes), the compiled kernel takes {size} bytes there"
                )
            continue
        declared, declaration = next(values)
        if declared is not None and SIZES[declared] != size:
            return (
                f"parameter {declaration!r} reads as {declared} ({SIZES[declared]} "
                f"byte{'' if SIZES[declared] == 1 else 's'}) from its source, the "
                f"compiled kernel takes {size}"
            )
        if declared is None and size not in (1, 2, 4, 8):
            return (
                f"parameter {declaration!r} takes {size} bytes in the compiled kernel: a "
                "launch passes a value of 1, 2, 4 or 8 bytes (an integer, a float, a "
                "double or a half), never a struct by value"
            )
    return None


class Compiler(ABC):
    """Turns kernel source into a binary.

    A compiler is plain configuration: it pickles as ``(type(self), self.config())`` and
    makes any native handle (a compiler service, a library) lazily in the process that
    compiles, so it can be sent to a worker process. Subclasses implement
    :meth:`config`, :meth:`compile` and, for the cache key, :meth:`version`.
    """

    name: str = "compiler"
    # What the compiler printed as its last compile succeeded (its warnings), where it
    # can tell: the pool's worker sends it back with the binary.
    _last_log: str = ""

    def config(self) -> tuple[Any, ...]:
        """The constructor arguments that recreate this compiler."""
        return ()

    def version(self) -> str:
        """The compiler's version string (part of the cache key). May run the compiler."""
        return ""

    @abstractmethod
    def compile(self, src: str) -> bytes:
        """Compile ``src``; raise :class:`CompileError` carrying the full log on failure."""

    def _params(self, src: str, name: str) -> tuple[ParamKind, ...]:
        """The kinds of kernel ``name``'s parameters, in order, read from ``src``."""
        return c_params(src, name)

    def _value_types(self, src: str, name: str) -> tuple[tuple[str | None, str], ...]:
        """Each value parameter of kernel ``name``: its scalar type (None where not
        known) and its declaration, in order, read from ``src``."""
        return c_value_types(src, name)

    def _signature(self, src: str, name: str) -> Signature:
        """``_params`` and ``_value_types`` together; where the two read a
        different number of values (a subclass's own ``_params``), the types are not
        known."""
        kinds = self._params(src, name)
        values = self._value_types(src, name)
        if len(values) != kinds.count("value"):
            values = tuple((None, f"value {i}") for i in range(kinds.count("value")))
        return Signature(kinds, values)

    def _answered(self, signature: Signature, name: str, binary: bytes, src: str) -> Signature:
        """``signature`` (``_signature``'s, of kernel ``name``) with what ``binary``, as
        this compiler built it from ``src``, says of the value types the source does not
        (None): nothing, by default. CompileError where what it says is no type a
        launch value passes."""
        return signature

    def _bindings(self, src: str, name: str) -> tuple[int, ...] | None:
        """The index each of ``_params``' parameters binds at, where the kernel's source
        names them (Metal's ``[[buffer(i)]]``); None: the i-th parameter binds at i."""
        return None

    def _with_options(self, options: tuple[str, ...]) -> Compiler:
        """This compiler with ``options`` after its own flags: a compiler of its own
        (its own cache entries; it pickles so). A compiler that takes options keeps its
        flags in ``flags``, the last of its :meth:`config`."""
        if not options:
            return self
        flags = getattr(self, "flags", None)
        config = self.config()
        if not isinstance(flags, tuple) or not config or config[-1] != flags:
            # (Flags kept elsewhere in the config: made from it, they would land in
            # another of its arguments.)
            raise InvalidArgumentError(
                f"the {self.name} compiler takes no options (a compiler takes them with "
                "its flags in a tuple `flags`, the last item of its config())"
            )
        made: Compiler = type(self)(*config[:-1], (*flags, *options))  # type: ignore[call-arg]
        return made

    def _identity(self) -> str:
        """A key naming this compiler's class, name, version, target and flags (the
        class too: a subclass that compiles otherwise may keep its base's name and
        config)."""
        kind = f"{type(self).__module__}.{type(self).__qualname__}"
        return f"{kind}|{self.name}|{self.version()}|{self.config()!r}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self.config())

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Compiler)
            and type(other) is type(self)
            and (other.config() == self.config())
        )

    def __hash__(self) -> int:
        return hash((type(self), self.config()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self.config()!r}"


def check_options(options: object) -> tuple[str, ...]:
    """A compile's ``options`` as a tuple of str, or the error naming what is wrong."""
    if not isinstance(options, (tuple, list)):
        raise ArgumentTypeError(
            "options must be a tuple or list of str, one option each (e.g. ('-DN=4', '-O3')), "
            f"got {type(options).__name__}"
        )
    for option in options:
        if not isinstance(option, str):
            raise ArgumentTypeError(f"each compile option must be a str, got {option!r:.60}")
        if not option or "\0" in option:
            raise InvalidArgumentError(
                f"compile option {option!r:.60}: expected a non-empty str without NUL "
                "characters (leave an option out rather than pass '')"
            )
        if any(c.isspace() for c in option):
            raise InvalidArgumentError(
                f"compile option {option!r:.60}: one option per item, without whitespace "
                "(pass '-D N=4' as '-DN=4', or '-D' and 'N=4' as two)"
            )
    return tuple(options)


def source_key(compiler_identity: str, src: str) -> str:
    return hashlib.sha256(f"{compiler_identity}\0{src}".encode()).hexdigest()


# Comments, and string and character literals (which may hold "//" or "/*"): a comment
# becomes a space, a literal an empty one. One left open ends where the source (or the
# literal's line) does, as the compiler refuses it anyway: tried again at each later
# "/*" or quote instead, it would take time quadratic in the source's length. Read in
# short steps (``_scan``): where each may begin, then its end.
_COMMENT_OR_LITERAL = re.compile(r"""[/"']""")
_COMMENT = re.compile("/")
_LITERAL_STOP = {'"': re.compile(r'["\\\n]'), "'": re.compile(r"['\\\n]")}
# A number (C's preprocessing number) and its digit separators (C++14, C23: 1'000'000,
# 0x1'FFu), whose quotes open no character literal; or a word, or another character.
_TOKEN = re.compile(r"\.?\d(?:[eEpP][+-]|'\w|[\w.])*|\w+|.", re.S)
# The characters of a number and of a word before it (the sign of an exponent too).
_NUMBER_CHARACTER = re.compile(r"[\w.']|(?<=[eEpP])[+-]")
# Names a source makes pointer types of: `typedef float *fptr;`, `#define BUF float*`.
# (Each pattern that reads a statement, up to a ";", is tried at the first keyword of
# each: see ``statements``.)
_STATEMENT_END = re.compile(r"[;{}]")
_TYPEDEF_WORD = re.compile(r"\btypedef\b")
_USING_WORD = re.compile(r"\busing\b")
_POINTER_TYPEDEF = re.compile(r"\btypedef\b([^;{}]*);")
# The words of a pointer typedef's declarator that can be its name: one that ends it,
# or one that an array's brackets follow.
_DECLARATOR_WORD = re.compile(r"\b(\w+)(?=\s*(\[|\Z))")
_POINTER_MARK = re.compile(r"[*\[]")
_POINTER_MACRO = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)[ \t]+[^\n(]*\*", re.M)
# A function-like macro of a pointer type: `#define GLOBAL_PTR(T) T*`.
_POINTER_TYPE_MACRO = re.compile(
    r"^[ \t]*#[ \t]*define[ \t]+(\w+)\([\w\s,]*\)[ \t]+[^\n(]*\*", re.M
)
# C++'s typedefs of either: `using fp = float*;`, `using vec3 = float[3];`.
_POINTER_USING = re.compile(r"\busing\s+(\w+)\s*=[^;{}=]*[*\[][^;{}]*;")


def _pointer_typedefs(text: str) -> set[str]:
    """The names ``text``'s typedefs make pointer types of (``typedef float *fptr;``,
    ``typedef float *rows[4];``) and array types of (``typedef float vec3[3];``, which a
    parameter takes as a pointer). Read by a scan of each typedef's words (in time
    linear in its length: regular expressions that find the name after a ``*`` backtrack
    in time cubic in it)."""
    names: set[str] = set()
    for (body,) in statements(text, _POINTER_TYPEDEF, _TYPEDEF_WORD, _STATEMENT_END):
        if "*" not in body and "[" not in body:  # (most: no pointer, no array)
            continue
        # Each declarator names a type of its own (``typedef float *fp, real;``: real is
        # a float), the first after the type's words.
        for declarator in _split_top_level(body) if "," in body else [body.strip()]:
            closed = declarator.endswith("]")  # (an array's brackets end it)
            # The words that can be the name: the last, or one that brackets follow.
            candidates = [
                (word.start(), word.group(1), word.group(2))
                for word in _DECLARATOR_WORD.finditer(declarator)
                if closed or not word.group(2)
            ]
            # An array type: the first word brackets follow.
            names.update(next(([name] for _, name, bracket in candidates if bracket), []))
            marks = [mark.start() for mark in _POINTER_MARK.finditer(declarator)]
            if marks and candidates and marks[0] < candidates[-1][0]:
                # A pointer type: the first name after the last '*' or '[' that one follows.
                last = max(i for i in marks if i < candidates[-1][0])
                names.add(next(name for start, name, _ in candidates if start > last))
    return names


def _strip(src: str, literals: bool = True) -> str:
    """``src`` with its comments each made a space and (``literals``) its string and
    character literals each made an empty one (``_COMMENT_OR_LITERAL``)."""
    pieces: list[str] = []
    copied = pos = 0  # what is in pieces; what is read
    size = len(src)
    begins = _COMMENT_OR_LITERAL if literals else _COMMENT
    while (found := _scan.search(begins, src, pos, 1)) is not None:
        at = found.start()
        mark = src[at]
        if mark == "/":
            after = src[at + 1 : at + 2]
            if after == "/":
                end = _scan.find(src, "\n", at)
                end = size if end < 0 else end
            elif after == "*":
                end = _scan.find(src, "*/", at + 2)
                end = size if end < 0 else end + 2
            else:
                pos = at + 1
                continue
            made = " "
        else:
            number_end = _number_end(src, pos, at) if mark == "'" else -1
            if number_end >= 0:
                pos = number_end
                continue
            end = _literal_end(src, at)
            made = mark * 2
        pieces += (src[copied:at], made)
        copied = pos = end
    if not pieces:
        return src
    pieces.append(src[copied:])
    return "".join(pieces)


def _literal_end(src: str, at: int) -> int:
    """Where the string or character literal that opens at ``at`` ends: after its
    closing quote, else at its line's end (or the source's)."""
    quote = src[at]
    stop = _LITERAL_STOP[quote]
    pos = at + 1
    while (found := _scan.search(stop, src, pos, 1)) is not None:
        if found.group() == "\\":  # (it and the next character: a line spliced too)
            pos = found.end() + 1
        elif found.group() == quote:
            return found.end()
        else:
            return found.start()  # its line's end
    return len(src)


def _number_end(src: str, read: int, at: int) -> int:
    """Where the number that holds the quote at ``at`` (a digit separator) ends, or -1
    where the quote is none (it opens a character literal). ``read``: where the
    characters before it begin that are no comment or literal."""
    # Read from the start of the number or word the quote ends (no further back than
    # ``read``, which the last quote's reading passed: each character is read once).
    begin = at
    while begin > read and _NUMBER_CHARACTER.match(src, begin - 1):
        begin -= 1
    pos = begin
    while True:
        token = _TOKEN.match(src, pos)
        assert token is not None  # (it matches any character)
        if token.end() > at:
            return token.end() if token.start() < at else -1
        pos = token.end()


def strip_comments(src: str) -> str:
    """``src`` with its comments each made a space."""
    return _strip(src, literals=False)


def _without_attributes(text: str) -> str:
    """``text`` without its attributes (``[[buffer(0)]]``). (One left open, which no
    source that compiles has, ends where the source does.)"""
    pieces: list[str] = []
    copied = 0
    while (at := _scan.find(text, "[[", copied)) >= 0:
        end = _scan.find(text, "]]", at + 2)
        pieces.append(text[copied:at])
        copied = len(text) if end < 0 else end + 2
    if not pieces:
        return text
    pieces.append(text[copied:])
    return "".join(pieces)


def _directives(text: str) -> list[int]:
    """Where each preprocessor directive's line of ``text`` starts."""
    return list(_scan.directive_starts(text))


class NotDefinedError(CompileError):
    """No definition of the kernel was found in the source (before compiling it: a
    source that does not compile says why instead). ``defined``: the names of the
    kernels the source does define, sorted; the message lists them (the first
    10) and the nearest to ``name``."""

    _SHOWN_DEFINED = 10

    def __init__(self, name: str, defined: Iterable[str] = (), hint: str = "") -> None:
        self.defined = tuple(sorted(set(defined)))
        self._hint = hint  # (why it may not be seen, where the source names it)
        super().__init__(
            f"kernel {name!r}: not defined in the source; {self._listed(name)}{hint}", name=name
        )

    def _listed(self, name: str) -> str:
        defined = self.defined
        if not defined:
            return "it defines no kernel"
        shown = ", ".join(map(repr, defined[: self._SHOWN_DEFINED]))
        if len(defined) > self._SHOWN_DEFINED:
            shown = (
                f"{len(defined)} kernels: {shown}, ... ({len(defined) - self._SHOWN_DEFINED} more)"
            )
        listed = f"it defines {shown}"
        nearest = difflib.get_close_matches(name, defined, n=1) if len(defined) > 1 else []
        return listed + (f" (did you mean {nearest[0]!r}?)" if nearest else "")

    def __reduce__(self) -> tuple[type[NotDefinedError], tuple[str, tuple[str, ...], str]]:  # type: ignore[override]
        return type(self), (self.name or "", self.defined, self._hint)


def c_params(src: str, name: str) -> tuple[ParamKind, ...]:
    """Parameter kinds of the C-like function ``name`` defined in ``src``.

    A parameter declared with ``*`` or ``[]`` is a buffer; any other is a value.
    Attributes (``[[buffer(0)]]``) and comments are ignored.
    """
    return tuple(kind for kind, _ in c_param_declarations(src, name))


def c_value_types(
    src: str, name: str, plain: Mapping[str, str] | None = None
) -> tuple[tuple[str | None, str], ...]:
    """Each value parameter of the C-like function ``name`` defined in ``src``: its
    scalar type (resolving the source's plain typedefs; None where not known) and its
    declaration. ``plain``: the types of a plain ``char`` and of ``wchar_t``
    (``_scalars.platform_types``; the host's by default). A name the source defines
    apart (``typedefs``: in ``#if`` branches) is not known, also where a header or the
    compiler would define it otherwise (``size_t``)."""
    apart: set[str] = set()
    known = typedefs(_strip(src), apart)
    plain = host_types() if plain is None else plain
    return tuple(
        (
            None
            if apart.intersection(resolved(type_words(declaration), known))
            else scalar_type(type_words(declaration), known, plain),
            declaration,
        )
        for kind, declaration in c_param_declarations(src, name)
        if kind == "value"
    )


# Type words of value parameters that are no scalar a launch can pass (with
# ``scalar_type`` None: ``long double``, a struct by value, CUDA's vector types...).
_NOT_A_SCALAR = re.compile(
    r"\b(float|double|half|_Float\d+x?|__fp16|__half|__half2|__nv_bfloat16|_Complex|struct|union"
    r"|class|__u?int128(?:_t)?|_BitInt|__float128|__float80|__ibm128|__bf16|_Decimal\d+|__m\d+\w*"
    r"|vector_size|ext_vector_type|__nv_bfloat162|nv_bfloat16|nv_bfloat162|dim3"
    r"|(?:u?char|u?short|u?int|u?long|u?longlong|float|double)[1-4]"
    # the Metal Shading Language's: bfloat, vectors, matrices, packed vectors, atomics
    r"|bfloat\d?|(?:half|bool)[2-4]|(?:float|half|double|bfloat)[2-4]x[2-4]|packed_\w+"
    r"|simd_\w+|atomic\w*)\b"
)
# Each typedef of a source (its body's braces emptied): its words and its name, before
# any GNU attribute (``typedef float v4 __attribute__((vector_size(16)));``).
# (Its parentheses balanced, three deep: a lazy ``.*?`` retried at each word of a long
# statement would take time quadratic in its length.)
_ANY_TYPEDEF = re.compile(
    r"\btypedef\b([^;]*?)\b(\w+)\s*"
    r"(__attribute(?:__)?\s*\(\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)\))?\s*;"
)
_SEMICOLON = re.compile(";")
_BRACE = re.compile(r"[{}]")


# A struct, class or union a source defines (C++ names it without the keyword).
_RECORD = re.compile(
    r"\b(?:struct|class|union)\s+(?:(?:alignas|__align__|__attribute(?:__)?)\s*\(+[^()]*\)+\s*)*"
    r"(\w+)\s*(?:final\s*)?[{:]"
)
_RECORD_WORD = re.compile(r"\b(?:struct|class|union)\b")
_ENUM_CLASS = re.compile(r"\benum\s+(?:class|struct)\b")
_NOT_WORD = re.compile(r"\W")
_NOT_WORD_OR_SPACE = re.compile(r"[^\w\s]")
_NEWLINE = re.compile("\n")


def _pairs(text: str, brackets: re.Pattern[str]) -> Iterator[tuple[int, int]]:
    """Where each pair of ``brackets`` (a pattern of one opening and one closing
    character, ``[{}]``) that closes in ``text`` opens and closes, in the order they
    close; a closing one with none open is passed over. One pass."""
    opened: list[int] = []
    for bracket in _scan.finditer(brackets, text, None):
        if bracket.group() in "({[":
            opened.append(bracket.start())
        elif opened:
            yield opened.pop(), bracket.start()


def _without_braces(text: str, made: str = " ") -> str:
    """``text`` with each brace-enclosed part (of those closed) made ``made``: what
    ``{[^{}]*}`` replaced by a space again and again until none is left makes, read in
    one pass."""
    closed: list[tuple[int, int]] = []  # the outermost so far, in order
    for start, end in _pairs(text, _BRACE):
        while closed and closed[-1][0] > start:  # (inside this one)
            closed.pop()
        closed.append((start, end + 1))
    pieces: list[str] = []
    copied = 0
    for start, end in closed:
        pieces += (text[copied:start], made)
        copied = end
    if not pieces:
        return text
    pieces.append(text[copied:])
    return "".join(pieces)


def _not_scalar_typedefs(text: str) -> set[str]:
    """The names ``text`` typedefs as types no launch value passes (a struct, a vector,
    ``long double``...), and those of the structs, classes and unions it defines."""
    enums = _scan.finditer(_ENUM_CLASS, text, _NOT_WORD_OR_SPACE)
    records_text = _scan.sub(enums, text, "enum")
    records = {
        m.group(1)
        for m in _scan.matches_at(
            _RECORD,
            records_text,
            (m.start() for m in _scan.finditer(_RECORD_WORD, records_text, _NOT_WORD)),
        )
    }
    text = _without_braces(text)
    found = records | {
        each
        for words, name, attribute in statements(text, _ANY_TYPEDEF, _TYPEDEF_WORD, _SEMICOLON)
        for typed, each in _value_declarators(words, name)
        if (_NOT_A_SCALAR.search(attribute) and each == name)  # a vector
        or (_NOT_A_SCALAR.search(typed) and scalar_type(type_words(f"{typed} {each}"), {}) is None)
    }
    return _chained(_typedef_values(text), found)


# A bfloat16's spellings (``__bf16``, CUDA's ``__nv_bfloat16``...).
_BFLOAT = re.compile(r"bfloat|bf16")


def _bfloat_typedefs(text: str) -> set[str]:
    """The names ``text`` (stripped) typedefs as a bfloat16 (``_BFLOAT``), in any of the
    ``#if`` branches that give a name types too (where ``typedefs`` knows it by none),
    also through typedefs of those names (``_chained``)."""
    values = _typedef_values(_without_braces(text))
    return _chained(values, {each for typed, each in values if _BFLOAT.search(typed)})


def _typedef_values(text: str) -> list[tuple[str, str]]:
    """Each value declarator (``_value_declarators``: no pointer, array or function) of
    each typedef of ``text`` (its braces emptied), in any ``#if`` branch: its type's
    words, and its name."""
    return [
        (typed, each)
        for words, name, _ in statements(text, _ANY_TYPEDEF, _TYPEDEF_WORD, _SEMICOLON)
        for typed, each in _value_declarators(words, name)
        if not _DECLARATOR_MARK.search(typed)
    ]


def _chained(values: list[tuple[str, str]], names: set[str]) -> set[str]:
    """``names`` and the names that typedefs (``values``: type words and name) make of
    one of them, in turn (``typedef bf bf2; typedef const bf2 bf3;``): where ``#if``
    branches give a name of the chain another type too, ``typedefs`` knows it by none,
    and its words, the name alone, would show no such type. Eight steps at most, as
    ``resolved`` takes; a cycle (``typedef a b; typedef b a;``) adds nothing more."""
    names = set(names)
    for _ in range(8):
        more = {
            each
            for typed, each in values
            if each not in names and names.intersection(_WORD.findall(typed))
        }
        if not more:
            break
        names |= more
    return names


def _value_declarators(words: str, name: str) -> list[tuple[str, str]]:
    """Each declarator of a typedef (``words``, then its last name, ``name``) that is no
    pointer, array or function: what its type is spelled with, and its name. Where there
    are several (``typedef float *fp, real;``), each is its own type: the first's type
    words, less what makes a pointer of one (fp is left out, real is a float)."""
    parts = _split_top_level(f"{words} {name}") if "," in words else []
    if len(parts) < 2:  # (one declarator; a comma within parentheses too)
        return [(words, name)]
    first = parts[0]
    marked = _DECLARATOR_MARK.search(first)
    spelled = first[: marked.start()] if marked else first
    if marked and _POINTER_MARK.match(first, marked.start()):
        # (what precedes a pointer's star is type words alone, an array's or a
        # function's bracket its name too: a name put after them, that ``type_words``
        # drops as the declarator's, keeps their last, ``const __bf16 *bfp``)
        spelled += " name"
    base = " ".join(type_words(spelled))
    found = []
    for i, part in enumerate(parts):
        if not _DECLARATOR_MARK.search(part):
            found.append((base, part.split()[-1] if i else first.split()[-1]))
    return found


_DECLARATOR_MARK = re.compile(r"[*&(\[]")
_POINTER_MARK = re.compile(r"[*&]|\(\s*[*&^]")  # (a pointer's, not a name's)
_WORD = re.compile(r"\w+")


# Calling-convention attributes that make a function take its parameters in other
# registers than the C calling convention's (x86-64 System V, AArch64), which a cpu
# launch calls a kernel with: the Microsoft x64 convention (GCC's and clang's ``ms_abi``)
# and clang's ``vectorcall``, ``regcall`` and ``preserve_none``. (The 32-bit x86 ones --
# ``stdcall``, ``fastcall``, ``regparm``... -- are ignored on x86-64; ``sysv_abi`` is
# the convention itself.) Spelled with or without underscores around them.
OTHER_CONVENTIONS = frozenset(("ms_abi", "vectorcall", "regcall", "preserve_none"))
_CONVENTIONS = OTHER_CONVENTIONS | {"sysv_abi"}
_DEFINE = re.compile(r"[ \t]*#[ \t]*define[ \t]+(\w+)(.*)", re.S)


def calling_conventions(src: str, name: str) -> set[str]:
    """The calling-convention attributes (``OTHER_CONVENTIONS``, ``sysv_abi``; without
    underscores around them) that declare function ``name`` in ``src``: in each of its
    declarations at file scope (a prototype's attribute holds for the definition too),
    before its name or after its parameters, also through a macro of the source
    (``#define WINAPI __attribute__((ms_abi))``). Read from the source as written: one
    that a header's macro gives is not seen."""
    text = _strip(src)
    # The words of each macro's body, and the conventions it gives (in turn, through
    # other macros).
    bodies: dict[str, set[str]] = {}
    for line in _scan.matches_at(_PREPROCESSOR_LINE, text, _directives(text)):
        define = _DEFINE.match(line.group())
        if define:
            (macro,) = _words(define.group(1))
            bodies.setdefault(macro, set()).update(_words(define.group(2)))
    text = _scan.sub(_scan.matches_at(_PREPROCESSOR_LINE, text, _directives(text)), text, " ")
    text = _without_braces(text, ";")  # (each body ends a statement: none is read within)
    found: set[str] = set()
    heads = re.compile(rf"\b{re.escape(name)}\s*\(")
    # Each ";" and each "(" and its ")", found once (in time linear in the text's length
    # however many heads there are).
    semicolons: list[int] | None = None
    closing: dict[int, int] = {}
    found_heads = list(_scan.finditer(heads, text, _NOT_WORD_OR_SPACE))
    read = 0  # where the text read so far ends: each part is read once
    for i, head in enumerate(found_heads):
        if semicolons is None:
            semicolons = [m.start() for m in _scan.finditer(_SEMICOLON, text, None)]
            closing = {opens: closes + 1 for opens, closes in _pairs(text, _PARENS)}
        after = closing.get(head.end() - 1)
        if after is None:  # (never closed)
            continue
        # Its statement's words before it and after its parameters (not theirs: a
        # pointer to a function of another convention is one), up to the next head.
        at = bisect.bisect_left(semicolons, head.start())
        start = max(semicolons[at - 1] + 1 if at else 0, read)
        at = bisect.bisect_left(semicolons, after)
        stop = semicolons[at] if at < len(semicolons) else len(text)
        if i + 1 < len(found_heads):
            stop = min(stop, found_heads[i + 1].start())
        found |= _words(text[start : head.start()] + " " + text[after:stop])
        read = max(read, stop)
    for _ in range(8):  # a macro of a macro...
        more = found.union(*(bodies[word] for word in found if word in bodies))
        if more == found:
            break
        found = more
    return found & _CONVENTIONS


def _words(text: str) -> set[str]:
    """The words of ``text``, without underscores around them (``__ms_abi__``)."""
    return {word.strip("_") or word for word in re.findall(r"\w+", text)}


def scalar_params(src: str, name: str) -> tuple[ParamKind, ...]:
    """``c_params``, refusing a value parameter whose type is no scalar a launch
    passes (``long double``, a struct by value, a vector...): its value would arrive as
    garbage (cpu, whose C calling convention passes it elsewhere) or cut short (cuda);
    a kernel that is a template (C++: its parameters' types are its arguments'); and
    one that returns a struct or a ``long double`` (``_refuse_returned_in_memory``)."""
    declarations = c_param_declarations(src, name)
    text = _without_attributes(_strip(src))
    if "template" in _declared_with(text, name):
        raise CompileError(
            f"kernel {name!r} is a template: its compiled name is mangled and its "
            'parameters\' types are those it is instantiated with; launch an extern "C" '
            f'function that calls it (extern "C" __global__ void {name}_f(float* x, '
            f"float a) {{ {name}<float>(x, a); }})",
            name=name,
        )
    macros = set(_scan.findall(_FUNCTION_MACRO, text, _NEWLINE))
    functions = _function_typedefs(text, macros)
    for kind, declaration in declarations:
        if _takes_function(declaration, functions, macros):
            raise CompileError(
                f"kernel {name!r}: parameter {declaration!r} is a function pointer: a launch "
                "passes it a buffer's address or an integer, no function's, and a call "
                "through it would jump into data; choose the function in the kernel (a "
                "switch on a value parameter)",
                name=name,
            )
        if declaration == "...":
            raise CompileError(
                f"kernel {name!r} is variadic (its parameters end in '...'): a launch passes "
                "each value as its parameter's declared type, and those of '...' have none "
                "(a variadic call passes a float otherwise, too); declare each parameter",
                name=name,
            )
        if kind == "value" and "&" in declaration:
            raise CompileError(
                f"kernel {name!r}: parameter {declaration!r} is a reference, which the "
                "kernel takes as an address: a launch value is no address (pass a pointer "
                "to a buffer, or the value itself)",
                name=name,
            )
    refuse_non_scalars(src, name, [d for kind, d in declarations if kind == "value"])
    _refuse_returned_in_memory(text, name)  # (a kernel is called as a void function)
    return tuple(kind for kind, _ in declarations)


# A declarator of a pointer to a function: a ``*`` (and its qualifiers) and the name, if
# any, in parentheses that a parameter list follows (``(*f)(int)``, ``(* const)(int)``,
# ``(*(*f)(int))[3]``: a pointer to one that returns a pointer to an array). ``(**f)``
# and ``(*f)[3]`` are pointers to memory (function pointers, an array): buffers.
_FUNCTION_POINTER = re.compile(
    r"\(\s*\*\s*(?:(?:const|volatile|restrict|__restrict|__restrict__)\b\s*)*(\w*)\s*\)\s*\("
)
_LAST_WORD = re.compile(r"(\w+)\s*$")
# Words that parentheses follow in a type, not a function's declarator (``_Atomic(int)``).
_TYPE_OPERATORS = TYPEOF_WORDS | {
    "_Atomic",
    "_BitInt",
    "decltype",
    "__declspec",
    "__attribute__",
    "__attribute",
}
_QUALIFIER_WORDS = frozenset(("const", "volatile", "restrict", "__restrict", "__restrict__"))
_FUNCTION_MACRO = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)\(", re.M)
# C++'s typedef of a type that parentheses end (a function's, or a pointer to one's).
_USING_PARENS = re.compile(r"\busing\s+(\w+)\s*=([^;{}=]*\))\s*;")
_USING_WORD = re.compile(r"\busing\b")


def _function_declarator(declarator: str, macros: set[str]) -> tuple[str, str] | None:
    """What ``declarator`` (a parameter's declaration, a typedef's; C++'s type alone:
    ``int(*)(int)``) declares where it is a pointer to a function ("pointer") or a
    function ("function", which a parameter takes as a pointer to it), and its name (""
    where it has none); None otherwise. A word that the parentheses ending it follow is
    a function's where words of a type precede it, and it is none of the source's
    function-like ``macros`` (``GLOBAL_PTR(float) p``) nor a type operator; with none,
    the type's word (``int(int)``)."""
    if "(" not in declarator:
        return None
    declarator = _GNU_ATTRIBUTE.sub(" ", declarator).rstrip()
    pointer = _FUNCTION_POINTER.search(declarator)
    if pointer is not None:
        return "pointer", pointer.group(1)
    if not declarator.endswith(")"):
        return None
    depth, opens = 0, len(declarator)  # (the "(" of the last ")", read back to it)
    while opens > 0:
        opens -= 1
        depth += {")": 1, "(": -1}.get(declarator[opens], 0)
        if depth == 0:
            break
    last = _LAST_WORD.search(declarator, 0, opens)
    if last is None or last.group(1) in _TYPE_OPERATORS or last.group(1) in macros:
        return None
    if set(re.findall(r"\w+", declarator[: last.start()])) - _QUALIFIER_WORDS:
        return "function", last.group(1)
    return "function", ""


def _function_typedefs(text: str, macros: set[str]) -> dict[str, str]:
    """The names that ``text``'s (stripped) typedefs and ``using`` declarations make
    function types of ("function": ``typedef int fn(int);``) and function pointer types
    of ("pointer": ``typedef int (*fp)(int);``, ``typedef fn *fp;``), also those of such
    a name in turn (``typedef fp fp2;``). ``macros``: its function-like macros'."""
    found: dict[str, str] = {}
    if "(" not in text:  # (most sources: none is made)
        return found
    made = [
        declarator
        for (body,) in statements(text, _POINTER_TYPEDEF, _TYPEDEF_WORD, _STATEMENT_END)
        for declarator in (_split_top_level(body) if "," in body else [body.strip()])
    ]
    for name, type_ in statements(text, _USING_PARENS, _USING_WORD, _STATEMENT_END):
        declared = _function_declarator(type_, macros)
        if declared is not None:
            found[name] = declared[0]
    for declarator in made:
        declared = _function_declarator(declarator, macros)
        if declared is not None and declared[1]:
            found[declared[1]] = declared[0]
    for _ in range(8):  # (a typedef of a typedef...)
        more = dict(found)
        for declarator in made:
            words = re.findall(r"\w+", declarator)
            of = [found[word] for word in words[:-1] if word in found]
            if not words or not of or "[" in declarator or "(" in declarator:
                continue
            stars = declarator.count("*")
            if of[0] == "pointer" and stars == 0:
                more[words[-1]] = "pointer"
            elif of[0] == "function" and stars <= 1:
                more[words[-1]] = "pointer" if stars else "function"
        if more == found:
            break
        found = more
    return found


def _takes_function(declaration: str, functions: Mapping[str, str], macros: set[str]) -> bool:
    """Whether a parameter's ``declaration`` is of a pointer to a function, or of a
    function (which it takes as a pointer to it): as its declarator says, or a typedef
    of the source (``functions``: ``_function_typedefs``) that its type is."""
    declared = _function_declarator(declaration, macros)
    if declared is not None:
        return declared[0] == "pointer" or bool(declared[1])
    if not functions or "[" in declaration:
        return False
    of = [functions[word] for word in type_words(declaration) if word in functions]
    stars = declaration.count("*")
    return bool(of) and stars <= (1 if of[0] == "function" else 0)


def refuse_non_scalars(src: str, name: str, values: list[str]) -> None:
    """Refuse (``CompileError``, naming the parameter) any of kernel ``name``'s value
    parameter declarations ``values`` whose type is no scalar that a launch value
    passes: a struct, class or union (also one a typedef names), a vector or matrix,
    ``long double``, a bfloat16 (numpy has no such scalar)..."""
    text = _strip(src)
    known = typedefs(text)
    not_scalars = _not_scalar_typedefs(text)
    bfloats = _bfloat_typedefs(text)
    # (a name that a typedef ``typedefs`` does not read gives another type -- one of a
    # declarator list, ``typedef __bf16 *bfp, bf;``, or with an attribute, in another
    # #if branch than the one it reads -- is known by no one type either)
    for typed, each in _typedef_values(_without_braces(text)):
        if each in known and resolved(type_words(f"{typed} {each}"), {}) != resolved(
            known[each], {}
        ):
            del known[each]
    for declaration in values:
        words = resolved(type_words(declaration), known)
        if TYPEOF_WORDS.intersection(words) and scalar_type(words, known) is None:
            raise CompileError(
                f"kernel {name!r}: parameter {declaration!r} takes the type of an expression "
                "(typeof), which is not read from the source: a launch value is passed as "
                "its parameter's declared type, so declare it (float, int64_t...), or "
                "typeof of that type",
                name=name,
            )
        if (
            _NOT_A_SCALAR.search(" ".join(words)) or not_scalars.intersection(words)
        ) and scalar_type(words, known) is None:
            bfloat = _BFLOAT.search(" ".join(words)) or bfloats.intersection(words)
            raise CompileError(
                f"kernel {name!r}: parameter {declaration!r} is not a scalar that launch "
                "values pass (an integer of 8, 16, 32 or 64 bits, a bool, a half, float or "
                "double): pass it in a buffer"
                + (", or take a float and convert it in the kernel" if bfloat else ""),
                name=name,
            )


def _refuse_returned_in_memory(text: str, name: str) -> None:
    """Refuse (``CompileError``) a C kernel ``name`` whose definition in ``text`` (the
    source, stripped, its attributes too) returns a type that
    the C calling convention returns through memory or on the x87 stack: a struct,
    union or class (its caller's hidden address takes the first parameter's register,
    every parameter shifted), a ``long double`` (left on the x87 stack, which a caller
    that calls it as a void function never pops), or another type no launch value is.
    A pointer, ``void`` or a scalar is returned in a register (and dropped)."""
    heads = [declared.split() for _, declared, _ in _each_definition(text, re.escape(name))]
    if all(words and words[-1] in ("void", "*", "&") for words in heads):
        return  # (most kernels: nothing more to read)
    known = typedefs(text)
    not_scalars = _not_scalar_typedefs(text)
    pointers = _pointer_names(text)
    text = _scan.sub(_scan.matches_at(_PREPROCESSOR_LINE, text, _directives(text)), text, " ")
    for _, declared, _ in _each_definition(text, re.escape(name)):
        words = [w for w in declared.split() if w not in _NOT_RETURN_TYPE]
        if {"*", "&"}.intersection(words) or pointers.intersection(words):
            continue
        # (typeof of a type is that type; of an expression -- a struct's variable too --
        # its type is not read from the source: refused, as it may be returned in memory)
        typeof = TYPEOF_WORDS.intersection(words)
        spelled = words = [w for w in words if w not in TYPEOF_WORDS]
        words = resolved(words, known)
        if typeof and scalar_type(words, known) is None:
            raise CompileError(
                f"kernel {name!r} returns the type of an expression ({' '.join(typeof)}), "
                "which is not read from the source: it may be a struct, which the C "
                "calling convention returns through memory (a hidden first argument, "
                "which shifts the parameters): return void, or a type spelled out",
                name=name,
            )
        if (
            _NOT_A_SCALAR.search(" ".join(words)) or not_scalars.intersection(words)
        ) and scalar_type(words, known) is None:
            raise CompileError(
                f"kernel {name!r} returns {' '.join(spelled)!r}, which is no pointer or scalar: "
                "the C calling convention may return it through memory (a hidden first "
                "argument, which shifts the parameters) or on the x87 stack (which a kernel, "
                "called as a void function, leaves full): return void, and write the result "
                "to a buffer",
                name=name,
            )


# Words of a function's declaration before its name that are no part of its return type.
_NOT_RETURN_TYPE = frozenset(
    (
        *("static", "extern", "inline", "__inline", "__inline__", "_Noreturn", "register"),
        *("__global__", "__device__", "__host__", "__forceinline__", "__noinline__", "kernel"),
    )
)


# What a source's functions return and take by value, where the source as written does
# not say (a type a header or a macro makes: ``sigset_t``, a typedef of a struct), is
# asked of the C compiler itself: ``signature_checks`` writes C that the compile appends
# to the source, lines for each such return type or parameter -- its class (GCC's and
# clang's ``__builtin_classify_type``) and size as an enum's constants (a parameter's
# also whether it is an array: its type is not that of the value it decays to, and
# whether it points to a function), then, for a parameter, an array type whose size is
# negative (an error) where it is an array, then one whose size is negative where it is
# a struct or union (for a parameter, then one where it is a pointer to a function: a
# header's ``sighandler_t``), then one whose size is negative where it is no pointer or
# scalar of at most 8 bytes; and, for a parameter the source reads through a typedef in
# an ``#if`` block, one whose size is negative where its class and size are not those
# of what the source reads (a buffer's pointer, the scalar a launch passes), the only
# line of one the source reads as a buffer (an array decays to one). A parameter's
# class, size and signedness are kept in the binary's data too (``_answers``): a launch
# passes a value of a type that the source does not read as the type the compiler says
# (``answered_values``). Each line is under a file name of its own (a ``#line``),
# ``SIGNATURE_CHECKS_FILE-<check>-<line>``, which every format of the compiler's
# diagnostics (text, GCC's JSON and SARIF, clang's msvc and vi styles...) names as it
# is: which of those lines have diagnostics tells what was refused. The checks turn the
# compiler's warnings off for their own lines (those it lets a pragma turn off:
# ``-Werror`` would make one an error, and hide a refusal).
SIGNATURE_CHECKS_FILE = "asyncmetal-signature-checks"
# The classes of a pointer or scalar a kernel, called as a void function, may return (in
# a register, dropped), and that a launch value passes (in an integer or float register):
# integer, char, enum, boolean, pointer and floating types.
_CALLABLE_CLASSES = (1, 2, 3, 4, 5, 8)
_RECORD_CLASSES = (12, 13)  # struct, union
# What the checks' lines are preceded by: the warnings they could draw turned off
# (clang's all at once; GCC's, which has no such name, one by one: those the checks can
# draw), each name unknown to the one compiler or the other let pass.
_QUIET = (
    "push",
    'ignored "-Wpragmas"',
    'ignored "-Wunknown-warning-option"',
    'ignored "-Weverything"',
    'ignored "-Wpedantic"',
    'ignored "-Wdeprecated-declarations"',
    'ignored "-Wimplicit-function-declaration"',  # (a call of one the preprocessor drops)
    'ignored "-Wc++-compat"',
    'ignored "-Wtraditional"',
    'ignored "-Wunused-value"',  # (the comma that decays an array)
    'ignored "-Wtype-limits"',  # (the answers' signedness: an unsigned type's -1 < 0)
    'ignored "-Wattributes"',  # (the answers' ``retain``, which an older GCC lacks)
)
_CHECK_LINES = ("read", "array", "record", "function", "other", "agree")
_REGISTER = re.compile(r"\bregister\b")
_CHECKED_LINE = re.compile(rf"{re.escape(SIGNATURE_CHECKS_FILE)}-(\d+)-({'|'.join(_CHECK_LINES)})")


class SignatureCheck(NamedTuple):
    """A type that ``signature_checks`` has the compiler check: the function's name, the
    type as the source spells it, the parameter's declaration (None: the type is the
    function's return type), and what a launch passes it as, where a typedef in an
    ``#if`` block says (a scalar's name of ``SIZES``, ``float32``; "pointer": a
    buffer's address), which the compiler is asked to agree with."""

    name: str
    spelled: str
    param: str | None = None
    read: str | None = None
    place: int | None = None  # (a parameter's: its index in the function's list)


def signature_checks(
    src: str, without: frozenset[int] = frozenset()
) -> tuple[str, tuple[SignatureCheck, ...]]:
    """C to append to ``src`` that the compiler refuses (``SIGNATURE_CHECKS_FILE``) where
    a function of it that a launch can name returns or takes by value a type that the
    source as written does not show to be a pointer, a scalar or ``void`` (a header's or
    a macro's type), and that is a struct or union, or no pointer or scalar of at most 8
    bytes; and those types, in the order of the checks. ("", ()) where there is none to
    check (most sources). A type the source shows to be a struct, union or other type no
    launch value is is refused when its kernel is compiled (``scalar_params``), not here:
    a function of the source that is no kernel may return or take one. A return type's
    checks call the function with a 0 for each parameter (unevaluated): one whose
    parameters the source shows are no scalars or pointers is not checked; a parameter's
    checks read an object declared as it is (of a function type: its address). Derived
    from the source alone, so that a compile's cache key, which the source is part of,
    keys them too. A parameter whose
    type a typedef in an ``#if`` block makes (one the preprocessor may drop, the
    compiler seeing a header's instead) is checked to be what the source reads and a
    launch passes (``SignatureCheck.read``): a pointer, or a scalar of its size.
    ``without``: the checks (their indices) whose lines are left out, all the same
    told (``unread_checks``)."""
    text = _without_attributes(_strip(src))
    written = text  # (its directives too: what ``c_param_declarations`` reads)
    text = _scan.sub(_scan.matches_at(_PREPROCESSOR_LINE, text, _directives(text)), text, " ")
    heads: dict[str, list[tuple[list[str], list[str]]]] = {}
    for name, declared, params in _each_definition(text, r"\w+"):
        if name not in _NOT_FUNCTIONS:
            heads.setdefault(name, []).append((declared.split(), params))
    if all(
        (not words or words[-1] in ("void", "*", "&")) and all(map(_plain_param, params))
        for each in heads.values()
        for words, params in each
    ):
        return "", ()  # (most sources: nothing more to read)
    known = typedefs(text)
    not_scalars = _not_scalar_typedefs(text)
    pointers = _pointer_names(text)
    outside = _outside_if_blocks(written)
    in_blocks = _names_made_in_if_blocks(written, outside)
    # (the functions defined within #if blocks alone, which the preprocessor may drop:
    # their checks' first line names the function, so that it does not compile, and
    # the checks are dropped, where the function is not)
    in_block_functions = set(heads)
    if outside is not None:
        outside = _scan.sub(
            _scan.matches_at(_PREPROCESSOR_LINE, outside, _directives(outside)), outside, " "
        )
        in_block_functions -= {name for name, _, _ in _each_definition(outside, r"\w+")}
    else:
        in_block_functions.clear()
    apart: set[str] = set()
    read_known = typedefs(written, apart)  # (``apart``: as ``c_value_types`` reads them)
    read_pointers = _pointer_names(written) if in_blocks else pointers

    def read_as(param: str, typed: list[str]) -> str | None:
        """What a launch passes a parameter declared ``param`` (of type words ``typed``)
        as, as ``c_param_declarations`` and ``c_value_types`` read it: "pointer" (a
        buffer) or a scalar's name; None where that rests on no typedef in an ``#if``
        block, or is no pointer or scalar."""
        if "*" in param or "[" in param or not in_blocks.intersection(typed):
            return None
        if _is_buffer(param, read_pointers):
            return "pointer"
        if apart.intersection(resolved(typed, read_known)):
            return None
        return scalar_type(typed, read_known)

    def unknown(words: list[str]) -> bool:
        """Whether ``words`` spell a type the source does not show to be a pointer, a
        scalar or void, nor one no launch value is (a struct it defines...)."""
        if not words or words[-1] == "void" or {"*", "&"}.intersection(words):
            return False
        if pointers.intersection(words) or TYPEOF_WORDS.intersection(words):
            return False
        words = resolved(words, known)
        if scalar_type(words, known) is not None or words[-1:] == ["void"]:
            return False
        return not (_NOT_A_SCALAR.search(" ".join(words)) or not_scalars.intersection(words))

    checked: list[SignatureCheck] = []
    lines: list[str] = []
    # (those of a type a typedef in an #if block makes, or of a function defined in one,
    # after the others: where the preprocessor drops it, their first line does not
    # compile, an error that -Wfatal-errors, or clang's error limit, would make the last
    # one told, hiding the others' refusals)
    late: list[str] = []
    # (the parameters of types the source does not read: the compiler's answers go into
    # the binary, ``answered_values``)
    answered: list[tuple[int, str, SignatureCheck]] = []

    def check(made: str, value: str, what: SignatureCheck) -> None:
        """The lines of the check of ``value``'s type (``made``: what declares what
        ``value`` names, on the first line before it); a parameter's (``what.param``)
        check whether it is an array too."""
        i = len(checked)
        checked.append(what)
        if i in without:
            return
        if what.param is not None and what.read is None:
            answered.append((i, value, what))
        kind, size = f"asyncmetal_class_{i}", f"asyncmetal_size_{i}"
        callable_ = " || ".join(f"{kind} == {c}" for c in _CALLABLE_CLASSES)
        record = " || ".join(f"{kind} == {c}" for c in _RECORD_CLASSES)
        # (an array's class and size are those of the pointer it decays to and of the
        # array: a header's array typedef, ``jmp_buf``, ``va_list``, would be read as a
        # pointer, or a pointer too large, where the parameter is a pointer a launch
        # value is not. The comma decays an array and leaves any other type as it is,
        # less its qualifiers, which the comparison ignores but for clang's ``_Atomic``,
        # a type of its own there: an atomic pointer, ``_Atomic(sighandler_t)``, is
        # compared with the atomic type of what the comma leaves too. Made of the
        # pointer class alone, which an array decays to)
        # (a pointer to a function, of a header's or a macro's type, ``sighandler_t``:
        # a parameter declared of the type it points to is adjusted to a pointer to that
        # function, the pointer's own type, where one of any other pointee -- an
        # incomplete struct too, which no value is read of -- is not. A value of no
        # pointer class, and a pointer to ``void``, which no parameter is declared of
        # where qualified (``const void *``), are tested as a ``char *``)
        pointer = f"__builtin_choose_expr({kind} == 5, {value}, (char *)0)"
        pointer = (
            f"__builtin_choose_expr(__builtin_types_compatible_p(__typeof__(*{pointer}), "
            f"void), (char *)0, {pointer})"
        )
        tested = {
            "array": f"{kind} == 5 && !__builtin_types_compatible_p(__typeof__({value}), "
            f"__typeof__((0, {value}))) && !__builtin_types_compatible_p(__typeof__({value}), "
            f"_Atomic(__typeof__((0, {value}))))",
            "record": record,
            "function": f"{kind} == 5 && __builtin_types_compatible_p(void (*)(__typeof__("
            f"*{pointer})), void (*)(__typeof__((0, {pointer}))))",
            "other": f"!(({callable_}) && {size} <= 8)",
        }
        if what.param is None:
            # (no function returns an array; one that returns a function pointer
            # returns it in a register, dropped)
            del tested["array"], tested["function"]
        if what.read == "pointer":  # (a buffer's address, as a pointer or an array takes)
            tested = {"function": tested["function"], "agree": f"{kind} != 5"}
        elif what.read is not None:  # (in a float or an integer register, of its size)
            floating = int(what.read.startswith("float"))
            tested["agree"] = f"({kind} == 8) != {floating} || {size} != {SIZES[what.read]}"
        in_block = what.name in in_block_functions
        made += (
            f"enum {{ {kind} = __builtin_classify_type({value}), {size} = sizeof({value})"
            + (f", asyncmetal_defined_{i} = sizeof(&{what.name})" if in_block else "")
            + "".join(f", asyncmetal_{line}_is_{i} = {test}" for line, test in tested.items())
            + " };"
        )
        to = late if what.read is not None or in_block else lines
        to.extend((f'#line 1 "{SIGNATURE_CHECKS_FILE}-{i}-read"', made))
        for line in tested:
            to.extend(
                (
                    f'#line 1 "{SIGNATURE_CHECKS_FILE}-{i}-{line}"',
                    f"typedef char asyncmetal_{line}_{i}[asyncmetal_{line}_is_{i} ? -1 : 1];",
                )
            )

    for name, each in heads.items():
        if any("static" in words for words, _ in each) or len({tuple(p) for _, p in each}) > 1:
            # no kernel; or definitions in #if branches whose parameters differ: which
            # compiles is not told, and a launch of it is refused (``c_param_declarations``)
            continue
        words, params = each[0]
        params = [p for p in params if p != "..."]
        for place, param in enumerate(params):  # (each by value, of a type not shown)
            typed = type_words(param)
            read = None if "&" in param else read_as(param, typed)
            masked = _GNU_ATTRIBUTE.sub(lambda m: " " * len(m.group()), param)
            # (a pointer to what a header's or a macro's type is, which a launch passes a
            # buffer's address: checked to point to no function, ``cookie_read_function_t
            # *f``, as its source's typedef is, ``_takes_function``. One to a header's
            # function pointer, ``sighandler_t *h``, points to data, as ``void (**h)(int)``)
            pointee = "*" in masked and not {"(", "[", "&"}.intersection(masked)
            if read is None and pointee and unknown(typed):
                read = "pointer"
            # (a name given types in #if branches is not known to a launch, also one the
            # source would read as a scalar -- ``size_t`` --: its answer is asked too)
            if read is None and (
                _is_buffer(param, pointers)
                or "&" in param
                or not (unknown(typed) or apart.intersection(resolved(typed, read_known)))
            ):
                continue
            # (an object of the type declared, not defined: a parameter is no object to
            # read outside its function. Declared as the parameter is, its name the
            # checks' own -- its attributes, a function-like macro's type, ``TYPE(big)
            # b``, read as the compiler reads them --, less a storage class; its type
            # words alone, where it is not named. One of a function type, a header's
            # ``cookie_read_function_t``, which no struct's member is, declares a
            # function: the parameter is a pointer to it, the value its address)
            i = len(checked)
            value = f"asyncmetal_param_{i}"
            spelled = re.findall(r"\w+", masked)
            if len(spelled) > 1 and spelled[-1] not in typed:
                at = list(re.finditer(rf"\b{spelled[-1]}\b", masked))[-1]
                declared = _REGISTER.sub(" ", param[: at.start()] + value + param[at.end() :])
            elif pointee:  # (unnamed: its stars, and their qualifiers, before the name)
                declared = f"{_REGISTER.sub(' ', param)} {value}"
            else:
                declared = f"{' '.join(typed)} {value}"
            adjusted = f"asyncmetal_adjusted_{i}"
            made = (
                f"extern {declared}; enum {{ {adjusted} = __builtin_types_compatible_p("
                f"void (*)(__typeof__({value})), void (*)(__typeof__(&{value}))) }}; "
            )
            what = SignatureCheck(name, " ".join(typed), param, read, place)
            check(made, f"__builtin_choose_expr({adjusted}, &{value}, {value})", what)
        words = [w for w in words if w not in _NOT_RETURN_TYPE]
        if not unknown(words) and not (
            in_blocks.intersection(words) and not {"*", "&"}.intersection(words)
        ):
            continue
        if not all(_is_buffer(p, pointers) or _takes_zero(p, known, not_scalars) for p in params):
            continue
        call = f"{name}({', '.join(['0'] * len(params))})"
        # (a void call made a 0, whose class and size are an int's)
        value = (
            f"__builtin_choose_expr(__builtin_types_compatible_p(__typeof__({call}), void), "
            f"0, {call})"
        )
        check("", value, SignatureCheck(name, " ".join(words)))
    if not checked:
        return "", ()
    if not (lines or late):
        return "", tuple(checked)
    # (after two newlines: the source may end in a comment, or a line continued; the
    # pragmas under the checks' file name too, which a diagnostic of theirs names)
    quiet = "\n".join(f"#pragma GCC diagnostic {each}" for each in _QUIET)
    return (
        f'\n\n#line 1 "{SIGNATURE_CHECKS_FILE}"\n{quiet}\n'
        + "\n".join((*lines, *late, *_answers(answered, src)))
        + "\n#pragma GCC diagnostic pop\n",
        tuple(checked),
    )


# What precedes the compiler's answers in a binary compiled with the checks, before the
# digest of the source (``answers_mark``).
ANSWERS_MARK = b"asyncmetal signature answers:"
_MARK_DIGEST_BYTES = 16


def answers_mark(src: str) -> bytes:
    """What precedes the compiler's answers in the binary of ``src`` compiled with its
    checks: ``ANSWERS_MARK`` and the first bytes of the SHA-256 digest of ``src``. The
    source's own data (a string literal of the mark, with other answers after it) may
    hold ``ANSWERS_MARK``, never that digest: no source holds its own."""
    return ANSWERS_MARK + hashlib.sha256(src.encode()).digest()[:_MARK_DIGEST_BYTES]


def _answers(answered: list[tuple[int, str, SignatureCheck]], src: str) -> tuple[str, ...]:
    """The lines that keep, in the binary's data, what the compiler says of each of the
    ``answered`` parameters' types (a check's index, the value it reads, the check),
    after the mark of ``src`` (``answers_mark``): the function's name (its length in two
    bytes, then its UTF-8), the parameter's place (two bytes), then five bytes: its
    type's class (``__builtin_classify_type``), its size (0 past 8 bytes), whether it is
    signed (of an integer, a char or an enum: -1 cast to the type, less its qualifiers,
    is below 0; any other type is told as an int, as a struct cannot be cast to),
    whether it is ``_Bool`` and whether ``_Float16`` (where the compiler has it:
    ``__FLT16_MAX__``); a name of length 0 ends them. Kept where the linker drops
    unused data (``retain``). Under a file name of their own, which no check's
    diagnostics name: a diagnostic of theirs has the source compiled alone, whose
    binary answers nothing."""
    if not answered:
        return ()
    each: dict[bool, list[str]] = {True: [], False: []}
    for i, value, what in answered:
        kind, size = f"asyncmetal_class_{i}", f"asyncmetal_size_{i}"
        name = what.name.encode()
        place = what.place or 0
        integer = f"__typeof__((0, __builtin_choose_expr({kind} >= 1 && {kind} <= 4, {value}, 0)))"
        plain = f"__typeof__((0, {value}))"
        for half in (True, False):
            each[half].extend(
                map(
                    str,
                    (
                        *divmod(len(name), 256)[::-1],
                        *name,
                        *divmod(place, 256)[::-1],
                        kind,
                        f"({size} <= 8 ? {size} : 0)",
                        f"({integer})-1 < ({integer})0",
                        f"__builtin_types_compatible_p({plain}, _Bool)",
                        f"__builtin_types_compatible_p({plain}, _Float16)" if half else "0",
                    ),
                )
            )
    mark = ", ".join(map(str, answers_mark(src)))
    made = {
        half: "static const unsigned char asyncmetal_answers[] __attribute__((used, retain)) = "
        f"{{ {mark}, {', '.join(fields)}, 0, 0 }};"
        for half, fields in each.items()
    }
    return (
        f'#line 1 "{SIGNATURE_CHECKS_FILE}-answers"',
        "#ifdef __FLT16_MAX__",
        made[True],
        "#else",
        made[False],
        "#endif",
    )


def answered_values(signature: Signature, name: str, binary: bytes, src: str) -> Signature:
    """``signature`` (of kernel ``name``) with each value parameter's type that was not
    known (None) made what the compiler says it is, where ``binary``, compiled from
    ``src``, holds its answer (``_answers``) and a launch value is that type: a
    ``_Bool`` a bool; an integer (a char, an enum) of 1, 2, 4 or 8 bytes the integer of
    its size and signedness; a pointer the unsigned integer of its size (an address); a
    floating type of 4 or 8 bytes float32 or float64, ``_Float16`` float16. Any other
    (a 2-byte float that is not ``_Float16``: ``__bf16``) is refused (CompileError,
    naming the parameter), as the source's ``__bf16`` is (``refuse_non_scalars``): a
    launch value would be passed as an int32, in another register. Answers are read
    after ``src``'s mark (``answers_mark``) alone: not after the source's own copy of
    ``ANSWERS_MARK``."""
    if None not in (type_ for type_, _ in signature.values):
        return signature
    mark = answers_mark(src)
    at = binary.find(mark)
    if at < 0:
        return signature
    at += len(mark)
    kinds, values = signature.kinds, list(signature.values)
    while at + 2 <= len(binary):
        length = int.from_bytes(binary[at : at + 2], "little")
        if length == 0 or at + length + 9 > len(binary):
            break
        function = binary[at + 2 : at + 2 + length]
        at += 2 + length
        index = int.from_bytes(binary[at : at + 2], "little")
        kind, size, signed, boolean, half = binary[at + 2 : at + 7]
        at += 7
        if function != name.encode() or index >= len(kinds) or kinds[index] != "value":
            continue
        value = kinds[:index].count("value")
        if values[value][0] is None:
            type_ = _answered_type(kind, size, signed, boolean, half)
            declaration = values[value][1]
            if type_ is None:
                raise CompileError(
                    f"kernel {name!r}: parameter {declaration!r} is not a scalar that launch "
                    "values pass (an integer of 8, 16, 32 or 64 bits, a bool, a half, float "
                    f"or double): the compiler says it is {_unpassable(kind, size)}; pass it "
                    "in a buffer"
                    + (", or take a float and convert it in the kernel" if kind == 8 else ""),
                    name=name,
                )
            values[value] = (type_, declaration)
    return signature._replace(values=tuple(values))


def _unpassable(kind: int, size: int) -> str:
    """What the compiler says a type classed ``kind``, of ``size`` bytes (0: more than
    8), that no launch value is, is (``_answers``)."""
    if kind == 8 and size == 2:
        return "a 2-byte float that is not _Float16 (a bfloat16: __bf16)"
    of = f"of {size} bytes" if size else "of more than 8 bytes"
    return f"a float {of}" if kind == 8 else f"a type {of}, of class {kind}"


def _answered_type(kind: int, size: int, signed: int, boolean: int, half: int) -> str | None:
    """The launch value type of a type the compiler classed ``kind``, of ``size``
    bytes (``_answers``)."""
    if boolean:
        return "bool"
    if kind in (1, 2, 3, 4) and size in (1, 2, 4, 8):  # (an integer, a char, an enum)
        return f"{'' if signed else 'u'}int{8 * size}"
    if kind == 5 and size in (4, 8):  # (a pointer: an address)
        return f"uint{8 * size}"
    if kind == 8:
        return {2: "float16" if half else None, 4: "float32", 8: "float64"}.get(size)
    return None


@functools.lru_cache(maxsize=1)
def checks_identity() -> str:
    """What names the checks ``signature_checks`` writes, for a compiler's identity (the
    compile cache's key): their file's name and a digest of the checks of a source that
    has each kind, which any change to what they are made of changes."""
    sample = "T f(T a, int n, float *p, T *q) { return a; }"  # (T: a type not shown)
    digest = hashlib.sha256(signature_checks(sample)[0].encode()).hexdigest()[:16]
    return f"{SIGNATURE_CHECKS_FILE}-{digest}"


@functools.lru_cache(maxsize=1024)  # (most declarations repeat: ``int n``)
def _plain_param(declaration: str) -> bool:
    """Whether a parameter's ``declaration`` is plainly a pointer to what the language's
    words name (a scalar, ``void``, a struct), or of such a scalar type (not one a
    typedef names): one that no check is made of. (What most kernels take: their
    sources are read no further.)"""
    if "[" in declaration or declaration in ("...", "void"):
        return True
    words = type_words(declaration)
    bare = _GNU_ATTRIBUTE.sub(" ", declaration)
    if "*" in bare and ("(" in bare or words[-1:] == ["void"] or _RECORD_KEYWORD.search(bare)):
        return True
    return scalar_type(words, {}) is not None


def _takes_zero(declaration: str, known: Mapping[str, list[str]], not_scalars: set[str]) -> bool:
    """Whether a value parameter's ``declaration`` may take a 0 for all the source shows:
    not one of a struct it defines, a vector, a reference..."""
    words = resolved(type_words(declaration), known)
    if "&" in declaration or TYPEOF_WORDS.intersection(words):
        return False
    if scalar_type(words, known) is not None:
        return True
    return not (_NOT_A_SCALAR.search(" ".join(words)) or not_scalars.intersection(words))


# The word of a preprocessor directive's line (``_PREPROCESSOR_LINE``).
_DIRECTIVE_WORD = re.compile(r"[ \t]*#[ \t]*(\w*)")


def _outside_if_blocks(text: str) -> str | None:
    """``text`` (stripped) less its ``#if`` blocks (each up to its ``#endif``), each made
    a space: what the preprocessor keeps whatever it drops. None where ``text`` has no
    ``#if`` (most sources)."""
    blocks: list[tuple[int, int]] = []
    depth = start = 0
    for line in _scan.matches_at(_PREPROCESSOR_LINE, text, _directives(text)):
        word = _DIRECTIVE_WORD.match(line.group())
        directive = word.group(1) if word else ""
        if directive in ("if", "ifdef", "ifndef"):
            start = line.start() if depth == 0 else start
            depth += 1
        elif directive == "endif" and depth:
            depth -= 1
            if depth == 0:
                blocks.append((start, line.end()))
    if depth:  # (one left open, which no source that compiles has)
        blocks.append((start, len(text)))
    if not blocks:
        return None
    pieces: list[str] = []
    copied = 0
    for start, end in blocks:
        pieces += (text[copied:start], " ")
        copied = end
    return "".join((*pieces, text[copied:]))


def _names_made_in_if_blocks(text: str, outside: str | None) -> set[str]:
    """The type names ``text`` (stripped) makes -- its typedefs and pointer types'
    object-like macros -- only within ``#if`` blocks (``outside``: ``text`` less them,
    ``_outside_if_blocks``), and those made of one in turn: a branch the preprocessor
    may drop, where the compiler sees a header's type of the name, or another
    branch's."""
    if outside is None:
        return set()
    known = typedefs(text)
    made = set(known) | _pointer_names(text)
    names = made - set(typedefs(outside)) - _pointer_names(outside)
    while True:  # (``typedef real real2;`` outside, ``real`` within)
        more = {name for name, words in known.items() if names.intersection(words)}
        if more <= names:
            return names
        names |= more


def unread_checks(log: str) -> frozenset[int]:
    """The checks (``signature_checks``' indices) whose first line the compile's ``log``
    has a diagnostic of: those that do not compile (of a function, or a type, that the
    preprocessor drops...)."""
    return frozenset(int(i) for i, line in _CHECKED_LINE.findall(log) if line == "read")


def refused_signature(log: str, checked: tuple[SignatureCheck, ...]) -> CompileError | None:
    """The CompileError of the first of the ``checked`` types (``signature_checks``) that
    the compile's ``log`` (in any of the compiler's diagnostics formats) says its checks
    refused: one whose class and size were read (its first line has no diagnostic) but
    whose other lines have one. None where none was refused so."""
    named = {(int(i), line) for i, line in _CHECKED_LINE.findall(log)}
    for i, (name, spelled, param, read, _) in enumerate(checked):
        if (i, "read") in named or not {(i, line) for line in _CHECK_LINES[1:]} & named:
            continue
        fix = "take a pointer to it, and pass a buffer"
        if (i, "array") in named:
            what = (
                "which the compiler says is an array (a header's typedef of one: jmp_buf, "
                "va_list...): a parameter of an array type is a pointer to its first "
                "element, an address, which the source does not show: a launch would pass "
                "it a value (buffers' addresses go to parameters the source declares "
                "pointers)"
            )
        elif (i, "record") in named:
            what = "which the compiler says is a struct or union: the C calling convention "
            what += (
                "returns one through memory (a hidden address, which a launch, calling the "
                "kernel as a void function, does not pass: the kernel writes through "
                "whatever its register holds, the first parameter's on x86-64)"
                if param is None
                else "passes one in memory or split over registers, not as the one integer "
                "or float a launch passes in its register"
            )
        elif (i, "function") in named:
            what = (
                "which the compiler says is a function pointer (a header's or a macro's "
                "type of one, or of a function, which a parameter takes as a pointer to "
                "it: cookie_read_function_t): a launch passes it a buffer's address or an "
                "integer, no function's, and a call through it would jump into data"
            )
            fix = "choose the function in the kernel (a switch on a value parameter)"
        elif param is None:
            what = (
                "which the compiler says is no pointer or scalar of at most 8 bytes (a "
                "vector, a complex number, a long double, an __int128...): the C calling "
                "convention may return it through memory (a hidden address, which a launch, "
                "calling the kernel as a void function, does not pass) or on the x87 stack "
                "(which such a kernel leaves full)"
            )
        elif (i, "other") in named:
            what = (
                "which the compiler says is no pointer or scalar of at most 8 bytes (a "
                "vector, a complex number, a long double, an __int128...): the C calling "
                "convention passes it in memory or in vector or paired registers, not as the "
                "one integer or float a launch passes in its register"
            )
        else:  # ("agree": the source's reading, of a typedef in an #if block, is not)
            made = "a typedef in an #if block makes it, in a branch the preprocessor may drop"
            what = (
                f"which the source reads as a pointer ({made}), and a launch passes a "
                "buffer's address to, but which the compiler says is no pointer"
                if read == "pointer"
                else f"which the source reads as {read} ({made}), and a launch passes as "
                f"one, but which the compiler says is no {SIZES[str(read)]}-byte "
                f"{'float' if str(read).startswith('float') else 'integer'}"
            )
            fix = "define the type outside the #if, as the kernel compiles it"
        if param is None:
            told, fix = f"returns {spelled!r}", "return void, and write the result to a buffer"
        else:
            told = f"takes {param!r}" + ("" if read == "pointer" else " by value")
        return CompileError(
            f"function {name!r} of the source {told}, {what}: {fix} (each function of the "
            "source that a launch can name is checked: declare one that is no kernel "
            "static)",
            name=name,
        )
    return None


def c_param_declarations(src: str, name: str) -> list[tuple[ParamKind, str]]:
    """Each parameter of the C-like function ``name`` defined in ``src``: its kind and
    its declaration (``NotDefinedError`` where no definition is found).

    Read from the source as written, before preprocessing: a parameter whose type is a
    name the source makes a pointer type of (a typedef, an object-like macro) is a
    buffer; two definitions that differ (in ``#if`` branches: only one compiles) are
    refused, as the one that compiles cannot be told."""
    text = _without_attributes(_strip(src))
    pointers = _pointer_names(text)
    found: list[list[tuple[ParamKind, str]]] = []
    for params in _definitions(text, name):
        declared: list[tuple[ParamKind, str]] = [
            ("buffer" if _is_buffer(p, pointers) else "value", p) for p in params
        ]
        if found and [p for _, p in declared] != [p for _, p in found[0]]:
            raise CompileError(
                f"kernel {name!r} is defined more than once, with different parameters "
                "(in #if branches?): its parameters are read from the source, which "
                "cannot say which definition compiles; keep one definition",
                name=name,
            )
        found.append(declared)
    if not found:
        if _kr_defined(text, name):
            raise CompileError(
                f"kernel {name!r} is defined in K&R style (its parameters' types declared "
                "after the parentheses), which is not supported: a launch passes each value "
                "as its declared type, and such a function takes its values promoted (a "
                "float as a double), with no prototype to say so; C23 removes the style. "
                f"Use a prototype-style definition: void {name}(float *a, int n) {{ ... }}",
                name=name,
            )
        raise NotDefinedError(name, c_kernel_names(src), _made_by_macro_hint(text, name))
    return found[0]


def _made_by_macro_hint(text: str, name: str) -> str:
    """Why kernel ``name``, which ``text`` (stripped) names but does not define as
    written, is not seen where a macro of the source may make it (``#define K name``
    then ``void K(...)``, ``DEFINE(name)``): "" where the source has no macro or does
    not name it."""
    defines = _scan.matches_at(_DEFINE_OR_INCLUDE, text, _directives(text))
    named = _scan.search(re.compile(rf"\b{re.escape(name)}\b"), text, 0, len(name) + 1)
    if next(defines, None) is None or named is None:
        return ""
    return (
        f"; it names {name!r} otherwise: a kernel defined in a header, or whose name or "
        "definition a macro makes, is not seen, as its parameters are read from the "
        "source as written (spell its definition out in the source)"
    )


_DEFINE_OR_INCLUDE = re.compile(r"^[ \t]*#[ \t]*(?:define|include)\b", re.M)


def _pointer_names(text: str) -> set[str]:
    """The names ``text`` (stripped) makes pointer types of: its typedefs and
    object-like macros of a pointer or array type, and those of such a name in turn
    (``typedef float *fp; typedef fp fp2;``, ``#define P fp``)."""
    pointers = (
        _pointer_typedefs(text)
        | {name for (name,) in statements(text, _POINTER_USING, _USING_WORD, _STATEMENT_END)}
        | set(_scan.findall(_POINTER_MACRO, text, _NEWLINE))
        | {m.group(1) for m in _scan.matches_at(_POINTER_TYPE_MACRO, text, _directives(text))}
    )
    plain = typedefs(text)
    while True:
        more = {name for name, words in plain.items() if pointers.intersection(words)}
        if more <= pointers:
            return pointers
        pointers |= more


def _kr_defined(text: str, name: str) -> bool:
    """Whether ``text`` has a K&R (old-style) definition of function ``name``:
    identifiers alone in the parentheses, then their declarations (each beginning with
    a word, with no ``=``), then the body.

    Scanned rather than searched for with one pattern: that pattern, tried at each
    ``name(a)`` of a source, reads the text after it to the next ``{``, ``}`` or ``=``,
    in time quadratic in the source's length; here each declaration is read once."""
    heads = re.compile(rf"\b{re.escape(name)}\s*\(\s*\w+(?:\s*,\s*\w+)*\s*\)")
    known: dict[int, bool] = {}  # after a declaration: whether more, then a body, follow
    stop = -1  # the first ';', '{', '}' or '=' after the last head
    for head in _scan.finditer(heads, text, _NOT_IN_KR_HEAD):
        if head.end() > stop:
            found = _scan.search(_KR_STOP, text, head.end(), 1)
            stop = found.start() if found else len(text)
        if stop == len(text) or text[stop] != ";" or not _KR_WORD.match(text, head.end()):
            continue
        pos, path = stop + 1, []
        while True:
            if pos in known:
                defined = known[pos]
                break
            path.append(pos)
            if _BODY.match(text, pos):
                defined = True
                break
            declaration = _KR_DECLARATION.match(text, pos)
            if declaration is None:
                defined = False
                break
            pos = declaration.end()
        known.update(dict.fromkeys(path, defined))
        if defined:
            return True
    return False


_KR_STOP = re.compile(r"[;{}=]")
_NOT_IN_KR_HEAD = re.compile(r"[^\w\s,(]")  # (what a head holds but as its last)
_KR_WORD = re.compile(r"\s*[A-Za-z_]")
_KR_DECLARATION = re.compile(r"\s*[A-Za-z_][^;{}=]*;")


def c_kernel_names(src: str) -> list[str]:
    """The names of the functions ``src`` defines that a launch can name: not those
    declared ``static`` (no external linkage) and, in a source that has ``__global__``
    functions (CUDA), only those (its ``__device__`` and host functions are no kernels)."""
    text = _without_attributes(_strip(src))
    text = _scan.sub(_scan.matches_at(_PREPROCESSOR_LINE, text, _directives(text)), text, " ")
    declared = {
        name: set(words.split())
        for name, words, _ in _each_definition(text, r"\w+")
        if name not in _NOT_FUNCTIONS
    }
    kernels = {name for name, words in declared.items() if "static" not in words}
    if any("__global__" in declared[name] for name in kernels):
        kernels = {name for name in kernels if "__global__" in declared[name]}
    return sorted(kernels)


# A preprocessor line and its continuations (a function-like macro's body is no function).
_PREPROCESSOR_LINE = re.compile(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", re.M)
# Words before a parenthesis that make no function definition (``if (x) {``).
_NOT_FUNCTIONS = frozenset(
    [
        "if",
        "for",
        "while",
        "switch",
        "catch",
        "return",
        "sizeof",
        "alignof",
        "_Alignof",
        "alignas",
        "_Alignas",
        "decltype",
        "typeof",
        "__typeof__",
        "__attribute__",
        "__attribute",
        "__declspec",
        "noexcept",
        "static_assert",
        "_Static_assert",
    ]
)


def unlinked_hint(src: str, name: str) -> str:
    """Why a kernel the source defines may not be in the compiled code: declared
    ``static`` (internal linkage) or plain ``inline`` (C99 emits no external definition
    of it), read from the declaration before the name; "" when neither."""
    text = _without_attributes(_strip(src))
    defines = re.compile(rf"^[ \t]*#[ \t]*define[ \t]+{re.escape(name)}\b", re.M)
    if next(_scan.matches_at(defines, text, _directives(text)), None) is not None:
        return (
            f"; {name!r} is a macro of the source: a kernel whose name a macro makes is "
            "not seen (spell its name out in its definition)"
        )
    words = _declared_with(text, name)
    if "static" in words:
        return "; it is declared static: a kernel needs external linkage (drop static)"
    if "inline" in words and "extern" not in words:
        return "; it is declared inline: C emits no external definition of it (drop inline)"
    return ""


def _declared_with(text: str, name: str) -> set[str]:
    """The words before ``name`` in the declarations of function ``name`` in ``text``
    (``static``, ``inline``, ``template``...)."""
    # What ``(?:^|[;{}])([^;{}]*?)\bname\s*\(`` finds, read in short steps: the words
    # from the last ";", "{" or "}" before each call or declaration of ``name``, the first
    # of its statement.
    words: set[str] = set()
    ends = _scan.finditer(_STATEMENT_END, text, None)
    end = next(ends, None)
    after = -1  # the last ";", "{" or "}" before the head (-1: none)
    taken: int | None = None  # that of the last head taken
    heads = re.compile(rf"\b{re.escape(name)}\s*\(")
    for head in _scan.finditer(heads, text, _NOT_WORD_OR_SPACE):
        while end is not None and end.start() < head.start():
            after = end.start()
            end = next(ends, None)
        if after != taken:
            taken = after
            words.update(re.findall(r"\w+", text[after + 1 : head.start()]))
    return words


def _is_buffer(param: str, pointers: set[str]) -> bool:
    if "*" in param or "[" in param or ("&" in param and "device" in param):
        return True
    words = re.findall(r"\w+", param)
    return any(word in pointers for word in words[:-1] or words)


def _definitions(text: str, name: str) -> Iterator[list[str]]:
    """The parameter declarations of each definition of ``name`` in ``text``."""
    for _, _, params in _each_definition(text, re.escape(name)):
        yield params


_BODY = re.compile(r"\s*\{")
_PARENS = re.compile(r"[()]")


def _each_definition(text: str, name: str) -> Iterator[tuple[str, str, list[str]]]:
    """Each function definition in ``text`` whose name matches the pattern ``name``:
    its name, the words of its declaration before the name (``static``,
    ``__global__``...; its return type's, a ``*`` or ``&`` among them) and its
    parameter declarations."""
    # The ")" of each "(" read so far: a name within another's parentheses
    # (``k(k(k(...)))``) finds its own there, not by reading them again, which would
    # take time quadratic in the source's length.
    closing: dict[int, int] = {}
    braces: dict[int, int] | None = None
    heads = re.compile(rf"\b({name})\s*\(")
    for match in _scan.finditer(heads, text, _NOT_WORD_OR_SPACE):
        start = match.end()
        if start - 1 not in closing:
            opened: list[int] = []
            for paren in _scan.finditer(_PARENS, text, None, start - 1):
                if paren.group() == "(":
                    opened.append(paren.start())
                else:
                    closing[opened.pop()] = paren.start()
                    if not opened:
                        break
            else:
                return
        pos = closing[start - 1] + 1
        if not _BODY.match(text, pos):  # a call or a declaration, not the definition
            continue
        body = text[start : pos - 1].strip()
        after = max(_scan.rfind(text, c, match.start()) for c in ";{}") + 1
        declared = text[after : match.start()]
        if after and text[after - 1] == "}":  # a type defined in the return type?
            if braces is None:  # (each "}" and its "{", found once)
                braces = {closes: opens for opens, closes in _pairs(text, _BRACE)}
            if after - 1 in braces:
                declared = _record_head(text, braces[after - 1]) + " " + declared
        words = " ".join(re.findall(r"\w+|[*&]", _GNU_ATTRIBUTE.sub(" ", declared)))
        yield match.group(1), words, [] if body in ("", "void") else _split_top_level(body)


# A GNU attribute (``__attribute__`` or ``__attribute``, both the compilers' spellings;
# its parentheses balanced, three deep), and C11's and C++'s alignment specifiers: no
# part of a type's words.
_GNU_ATTRIBUTE = re.compile(
    r"\b(?:__attribute(?:__)?\s*\(\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)\)"
    r"|(?:_Alignas|alignas|__align__)\s*\((?:[^()]|\([^()]*\))*\))"
)
_RECORD_KEYWORD = re.compile(r"\b(?:struct|union|class|enum)\b")


def _record_head(text: str, opens: int) -> str:
    """What declares the struct, union, class or enum whose body opens at ``opens`` and
    ends right before a function's name (``static struct r``, of ``static struct r {
    int a; } k(...)``: a type defined in the function's return type), from the start of
    its statement; "" where that body is no such type's."""
    start = max(_scan.rfind(text, c, opens) for c in ";{}") + 1
    head = _GNU_ATTRIBUTE.sub(" ", text[start:opens])
    if _RECORD_KEYWORD.search(head) and not head.rstrip().endswith(")"):
        return head
    return ""


def _split_top_level(params: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in params:
        # (Braces too: a type defined in the list, `enum e {A, B} x`, is one parameter.)
        if ch in "(<{[":
            depth += 1
        elif ch in ")>}]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts]

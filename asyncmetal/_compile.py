"""Compilers: pickle-safe by construction, and what they read of a kernel's source."""

from __future__ import annotations

import hashlib
import re
from abc import ABC, abstractmethod
from typing import Any, Literal

from ._errors import CompileError

ParamKind = Literal["buffer", "value"]


class Compiler(ABC):
    """Turns kernel source into a binary.

    A compiler is plain configuration: it pickles as ``(type(self), self.config())`` and
    makes any native handle (a compiler service, a library) lazily in the process that
    compiles, so it can be sent to a worker process (contract 7). Subclasses implement
    :meth:`config`, :meth:`compile` and, for the cache key, :meth:`version`.
    """

    name: str = "compiler"

    def config(self) -> tuple[Any, ...]:
        """The constructor arguments that recreate this compiler."""
        return ()

    def version(self) -> str:
        """The compiler's version string (part of the cache key). May run the compiler."""
        return ""

    @abstractmethod
    def compile(self, src: str) -> bytes:
        """Compile ``src``; raise :class:`CompileError` carrying the full log on failure."""

    def params(self, src: str, name: str) -> tuple[ParamKind, ...]:
        """The kinds of kernel ``name``'s parameters, in order, read from ``src``."""
        return c_params(src, name)

    def identity(self) -> str:
        """A key naming this compiler's name, version, target and flags."""
        return f"{self.name}|{self.version()}|{self.config()!r}"

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


def source_key(compiler_identity: str, src: str) -> str:
    return hashlib.sha256(f"{compiler_identity}\0{src}".encode()).hexdigest()


_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_ATTRIBUTES = re.compile(r"\[\[.*?\]\]", re.S)


def c_params(src: str, name: str) -> tuple[ParamKind, ...]:
    """Parameter kinds of the C-like function ``name`` defined in ``src``.

    A parameter declared with ``*`` or ``[]`` is a buffer; any other is a value.
    Attributes (``[[buffer(0)]]``) and comments are ignored.
    """
    text = _ATTRIBUTES.sub("", _COMMENTS.sub(" ", src))
    for match in re.finditer(rf"\b{re.escape(name)}\s*\(", text):
        depth, start = 1, match.end()
        pos = start
        while pos < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[pos], 0)
            pos += 1
        if depth:
            break
        rest = text[pos:].lstrip()
        if not rest.startswith("{"):  # a call or a declaration, not the definition
            continue
        body = text[start : pos - 1].strip()
        if body in ("", "void"):
            return ()
        return tuple(
            "buffer" if ("*" in p or "[" in p or ("&" in p and "device" in p)) else "value"
            for p in _split_top_level(body)
        )
    raise CompileError(f"kernel {name!r} is not defined in the source", name=name)


def _split_top_level(params: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in params:
        if ch in "(<":
            depth += 1
        elif ch in ")>":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts]

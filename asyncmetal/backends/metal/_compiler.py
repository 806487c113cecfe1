"""Metal Shading Language -> Metal library: the MTLCodeGenService, or xcrun."""

from __future__ import annotations

import ctypes
import os
import platform
import re
import struct
import subprocess
import tempfile
from collections.abc import Sequence
from ctypes import c_void_p
from typing import Any

from ... import _scan
from ..._compile import (
    Compiler,
    NotDefinedError,
    ParamKind,
    refuse_non_scalars,
    strip_comments,
    tool_answer,
)
from ..._errors import CompileError
from ..._scalars import SIGNED_CHAR, scalar_type, type_words, typedefs
from . import _blocks
from ._objc import (
    load,
)

REQUEST_TYPE_COMPILE = 13  # MTLCodeGenServiceBuildRequest's request type for MSL -> library


def codegen_request(src: str, params: str) -> bytes:
    """The compiler service's request: the two lengths, the source padded with at least
    one NUL to a multiple of 4 bytes, then the NUL-terminated parameters."""
    source = src.encode()
    source += b"\0" * (-(-(len(source) + 1) // 4) * 4 - len(source))
    options = params.encode() + b"\0"
    return struct.pack("<QQ", len(source), len(options)) + source + options


def codegen_library(reply: bytes) -> bytes:
    """The Metal library in the service's reply: after a header whose size and the size
    of the warnings that follow it are the two little-endian uint32 at bytes 8-16."""
    if len(reply) < 16:
        raise CompileError(f"the Metal compiler service replied with {len(reply)} bytes")
    library = reply[sum(struct.unpack("<LL", reply[8:16])) :]
    if library[:4] != b"MTLB" or library[-4:] != b"ENDT":
        raise CompileError("the Metal compiler service returned no Metal library", repr(reply))
    return library


def codegen_warnings(reply: bytes) -> str:
    """The compiler's warnings in the service's reply (between its header and the
    library; NUL-terminated), or ``""``."""
    header, size = struct.unpack("<LL", reply[8:16])
    return reply[header : header + size].rstrip(b"\0").decode(errors="replace")


class MetalCompiler(Compiler):
    """Metal Shading Language -> a Metal library.

    ``tool="service"`` (the default) asks the ``MTLCodeGenService`` of Apple's
    MTLCompiler framework, present on every Mac, as tinygrad does; ``tool="xcrun"`` runs
    ``xcrun metal`` and ``xcrun metallib`` (they need the Metal toolchain of Xcode).
    Pickles as its configuration; the service is opened in the process that compiles.
    """

    name = "metal"

    def __init__(self, tool: str = "service", flags: Sequence[str] = ()) -> None:
        if tool not in ("service", "xcrun"):
            raise ValueError(f"tool must be 'service' or 'xcrun', got {tool!r}")
        self.tool = tool
        self.flags = tuple(flags)
        self._service: tuple[Any, int, int] | None = None  # library, service, block isa

    def config(self) -> tuple[Any, ...]:
        return (self.tool, self.flags)

    def version(self) -> str:
        if self.tool == "service":
            return f"MTLCodeGenService macOS {platform.mac_ver()[0] or 'none'}"
        out = tool_answer(
            ["xcrun", "-sdk", "macosx", "metal", "--version"],
            "check Xcode's command line tools (xcode-select -p)",
        )
        return "missing" if out is None else out.stdout.decode(errors="replace").partition("\n")[0]

    def compile(self, src: str) -> bytes:
        return self._compile_service(src) if self.tool == "service" else self._compile_xcrun(src)

    def service_params(self) -> str:
        """The options the service compiles with (language version from the macOS one)."""
        major = int((platform.mac_ver()[0] or "0").split(".")[0])
        std = "metal3.1" if major >= 14 else "metal3.0" if major >= 13 else "macos-metal2.0"
        from ..._cache import default_cache_dir

        modules = os.path.join(default_cache_dir(), "metal-modules")
        return " ".join(
            [
                f"-fno-fast-math -std={std} --driver-mode=metal -x metal",
                f'-fmodules-cache-path="{modules}" -fno-caret-diagnostics',
                *self.flags,
            ]
        )

    def _compile_service(self, src: str) -> bytes:
        if self._service is None:
            try:
                lib = load("compiler")
            except OSError as exc:
                raise CompileError(
                    f"the Metal compiler service is not available here ({exc}); "
                    "MetalCompiler('xcrun') uses the Xcode toolchain instead"
                ) from None
            lib.MTLCodeGenServiceCreate.restype = c_void_p
            lib.MTLCodeGenServiceCreate.argtypes = [ctypes.c_char_p]
            lib.MTLCodeGenServiceBuildRequest.restype = None
            lib.MTLCodeGenServiceBuildRequest.argtypes = [
                c_void_p,
                c_void_p,
                ctypes.c_int,
                ctypes.c_char_p,
                ctypes.c_size_t,
                c_void_p,
            ]
            service = lib.MTLCodeGenServiceCreate(b"asyncmetal")
            self._service = (lib, service, _blocks.global_block_isa(load("system")))
        lib, service, isa = self._service
        request = codegen_request(src, self.service_params())
        result = CodegenResult()
        block = result.block(isa)
        lib.MTLCodeGenServiceBuildRequest(
            service, None, REQUEST_TYPE_COMPILE, request, len(request), ctypes.addressof(block)
        )
        library = result.library()
        self._last_log = result.warnings()
        return library

    def _compile_xcrun(self, src: str) -> bytes:
        with tempfile.TemporaryDirectory(prefix="asyncmetal-metal-") as tmp:
            source, air, lib = (os.path.join(tmp, n) for n in ("k.metal", "k.air", "k.metallib"))
            with open(source, "w") as f:
                f.write(src)
            printed = ""
            for command in (
                ["xcrun", "-sdk", "macosx", "metal", "-O2", *self.flags, "-c", source, "-o", air],
                ["xcrun", "-sdk", "macosx", "metallib", air, "-o", lib],
            ):
                try:
                    proc = subprocess.run(command, capture_output=True, check=False)
                except OSError as exc:
                    raise CompileError(
                        f"cannot run {command[0]}: {exc} (install Xcode and its Metal toolchain)"
                    ) from None
                log = (proc.stderr + proc.stdout).decode(errors="replace")
                if proc.returncode != 0:
                    raise CompileError(f"{command[3]} failed", log)
                printed += log
            self._last_log = printed
            with open(lib, "rb") as f:
                return f.read()

    def _params(self, src: str, name: str) -> tuple[ParamKind, ...]:
        return metal_params(src, name)

    def _value_types(self, src: str, name: str) -> tuple[tuple[str | None, str], ...]:
        return metal_value_types(src, name)

    def _bindings(self, src: str, name: str) -> tuple[int, ...]:
        return metal_bindings(src, name)


CODEGEN_CALLBACK = ctypes.CFUNCTYPE(
    None, c_void_p, ctypes.c_int32, c_void_p, ctypes.c_size_t, ctypes.c_char_p
)


class CodegenResult:
    """What the compiler service hands its reply block: the library, or its error."""

    def __init__(self) -> None:
        self.reply: bytes | None = None
        self.error: tuple[int, str] | None = None
        self._invoke = CODEGEN_CALLBACK(self._called)

    def _called(
        self, block: int | None, error: int, data: int | None, length: int, message: bytes | None
    ) -> None:
        if error:
            self.error = (error, (message or b"").decode(errors="replace"))
        else:
            self.reply = ctypes.string_at(data, length) if data else b""

    def block(self, isa: int) -> _blocks.CallbackBlock:
        self._block = _blocks.callback_block(isa, self._invoke, _blocks.CODEGEN_SIGNATURE)
        return self._block

    def library(self) -> bytes:
        if self.error is not None:
            raise CompileError(f"Metal compile failed (error {self.error[0]})", self.error[1])
        if self.reply is None:
            raise CompileError("the Metal compiler service returned without replying")
        return codegen_library(self.reply)

    def warnings(self) -> str:
        """The compiler's warnings, once ``library()`` returned."""
        assert self.reply is not None
        return codegen_warnings(self.reply)


def metal_params(src: str, name: str) -> tuple[ParamKind, ...]:
    """Launch parameters of a Metal kernel: those bound with ``[[buffer(i)]]`` in index
    order -- pointers and ``device`` references (``device atomic_uint& n``: memory the
    kernel may write) are buffers, other references (``constant float& x``) and values
    are ``vals`` -- skipping ``[[thread_position_in_grid]]`` and the like. A value
    parameter whose type is no scalar (a vector, a matrix, a struct, ``bfloat``) is
    refused (``CompileError``): ``setBytes`` of one launch value cannot make it."""
    bound = _bound_params(src, name)
    refuse_non_scalars(src, name, [param for _, kind, param in bound if kind == "value"])
    return tuple(kind for _, kind, _ in bound)


def metal_value_types(src: str, name: str) -> tuple[tuple[str | None, str], ...]:
    """Each ``vals`` parameter of ``metal_params``: its scalar type (``constant float&
    s`` is a float32; a plain ``char`` is signed in the Metal Shading Language; None
    where not known) and its declaration."""
    known = typedefs(src)
    return tuple(
        (scalar_type(type_words(param), known, SIGNED_CHAR), param)
        for _, kind, param in _bound_params(src, name)
        if kind == "value"
    )


def metal_bindings(src: str, name: str) -> tuple[int, ...]:
    """The ``[[buffer(i)]]`` index of each of ``metal_params``' parameters (the indices
    may have gaps: each argument is bound at its own)."""
    return tuple(index for index, _, _ in _bound_params(src, name))


def _bound_params(src: str, name: str) -> list[tuple[int, ParamKind, str]]:
    # (A comment left open ends where the source does: tried again at each later "/*",
    # it would take time quadratic in the source's length.)
    text = strip_comments(src)
    # Its parameters: to the first ")" the body's "{" follows. (Found from the first
    # "kernel void name(" alone: one pattern, tried at each, would read on from each
    # to the next "){", in time quadratic in the source's length.)
    # (Each read in short steps: ``_scan``.)
    heads = re.compile(rf"\bkernel\s+void\s+{re.escape(name)}\s*\(")
    head = next(_scan.finditer(heads, text, _NOT_WORD_OR_SPACE), None)
    close = head and next(_scan.finditer(_BEFORE_BODY, text, _NOT_IN_BEFORE_BODY, head.end()), None)
    if head is None or close is None:
        raise NotDefinedError(name, _scan.findall(_KERNEL_NAME, text, _NOT_WORD_OR_SPACE))
    bound: list[tuple[int, ParamKind, str]] = []
    for param in text[head.end() : close.start()].split(","):
        index = re.search(r"\[\[\s*buffer\s*\(\s*(\d+)\s*\)\s*\]\]", param)
        if index is None:
            continue
        memory = "*" in param or ("&" in param and re.search(r"\bdevice\b", param))
        kind: ParamKind = "buffer" if memory else "value"
        declaration = re.sub(r"\[\[.*?(?:\]\]|\Z)", "", param).strip()
        bound.append((int(index.group(1)), kind, " ".join(declaration.split())))
    return sorted(bound)


_BEFORE_BODY = re.compile(r"\)\s*\{")
_NOT_IN_BEFORE_BODY = re.compile(r"[^\s)]")  # (what it holds but as its last)
_KERNEL_NAME = re.compile(r"\bkernel\s+void\s+(\w+)\s*\(")
_NOT_WORD_OR_SPACE = re.compile(r"[^\w\s]")

"""CUDA C -> cubin with NVRTC."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..._compile import Compiler, ParamKind, c_value_types, scalar_params
from ..._errors import CompileError
from ..._scalars import host_types
from ._driver import check, nvrtc


class CUDACompiler(Compiler):
    """CUDA C -> cubin with NVRTC for one architecture. Pickles as (arch, flags); the
    NVRTC program is made inside the process that compiles."""

    name = "nvrtc"

    def __init__(self, arch: str = "sm_90", flags: Sequence[str] = ("-default-device",)) -> None:
        self.arch = arch
        self.flags = tuple(flags)

    def config(self) -> tuple[Any, ...]:
        return (self.arch, self.flags)

    def version(self) -> str:
        major, minor = check(nvrtc.nvrtcVersion(), "nvrtcVersion")
        return f"nvrtc {major}.{minor}"

    def compile(self, src: str) -> bytes:
        prog = check(nvrtc.nvrtcCreateProgram(src.encode(), b"kernel.cu", 0, [], []), "nvrtc")
        try:
            options = [
                f"--gpu-architecture={self.arch}".encode(),
                *(f.encode() for f in self.flags),
            ]
            (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
            size = check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            raw = b" " * size
            check(nvrtc.nvrtcGetProgramLog(prog, raw), "nvrtcGetProgramLog")
            log = raw.rstrip(b"\0").decode(errors="replace")
            if int(err) != 0:
                raise CompileError(f"NVRTC failed ({_nvrtc_name(err)})", log)
            size = check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            cubin = b" " * size
            check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            self.last_log = log
            return bytes(cubin)
        finally:
            nvrtc.nvrtcDestroyProgram(prog)

    def params(self, src: str, name: str) -> tuple[ParamKind, ...]:
        """The kernel's parameters; a value parameter must be a scalar (an integer,
        ``float``, ``double`` or ``__half``: launches pass nothing else)."""
        return scalar_params(src, name)

    def value_types(self, src: str, name: str) -> tuple[tuple[str | None, str], ...]:
        """The kernel's value types, a plain ``char`` and ``wchar_t`` as the host
        platform's C ABI has them. NVRTC's guide does not say which signedness its char
        has (nor can it be asked without compiling); nvcc compiles host and device code
        as one program, whose types must agree, and libcu++'s NVRTC headers work out
        ``__CHAR_UNSIGNED__`` as ``('\\xff' > 0)`` rather than assume one. So a char
        is signed on x86-64 hosts and taken as unsigned on AArch64 Linux ones (GH200),
        which is to be checked on such a host."""
        return c_value_types(src, name, host_types())


def _nvrtc_name(err: Any) -> str:
    try:
        return str(nvrtc.nvrtcResult(int(err)).name)
    except Exception:
        return str(err)

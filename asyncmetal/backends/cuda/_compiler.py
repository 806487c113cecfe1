"""CUDA C -> cubin with NVRTC."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..._compile import Compiler, ParamKind, c_value_types, scalar_params
from ..._errors import CompileError
from ..._scalars import host_types
from ._driver import nvrtc


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
        major, minor = _check(_call("nvrtcVersion"), "nvrtcVersion")
        return f"nvrtc {major}.{minor}"

    def compile(self, src: str) -> bytes:
        prog = _check(
            _call("nvrtcCreateProgram", src.encode(), b"kernel.cu", 0, [], []),
            "nvrtcCreateProgram",
        )
        try:
            options = [
                f"--gpu-architecture={self.arch}".encode(),
                *(f.encode() for f in self.flags),
            ]
            (err,) = _call("nvrtcCompileProgram", prog, len(options), options)
            size = _check(_call("nvrtcGetProgramLogSize", prog), "nvrtcGetProgramLogSize")
            # NVRTC writes into the buffer it is given (the bindings pass its storage as
            # a char*): a fresh bytearray, never bytes, which the interpreter may share
            # (b" " * 1, the size of an empty log, its NUL, is the interpreter's cached
            # b" ", whose byte the NUL would overwrite for the whole process).
            raw = bytearray(size)
            _check(_call("nvrtcGetProgramLog", prog, raw), "nvrtcGetProgramLog")
            log = raw.rstrip(b"\0").decode(errors="replace")
            if int(err) != 0:
                raise CompileError(f"nvrtcCompileProgram failed: {_nvrtc_name(err)}", log)
            size = _check(_call("nvrtcGetCUBINSize", prog), "nvrtcGetCUBINSize")
            cubin = bytearray(size)
            _check(_call("nvrtcGetCUBIN", prog, cubin), "nvrtcGetCUBIN")
            self._last_log = log
            return bytes(cubin)
        finally:
            _call("nvrtcDestroyProgram", prog)

    def _params(self, src: str, name: str) -> tuple[ParamKind, ...]:
        """The kernel's parameters; a value parameter must be a scalar (an integer,
        ``float``, ``double`` or ``__half``: launches pass nothing else)."""
        return scalar_params(src, name)

    def _value_types(self, src: str, name: str) -> tuple[tuple[str | None, str], ...]:
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


def _call(name: str, *args: Any) -> Any:
    """NVRTC's function ``name`` called with ``args``. cuda-bindings loads the NVRTC
    library at the first call that needs it, and raises a RuntimeError where it cannot
    (cuda-bindings installed without it): a CompileError here, as any compile's
    failure is."""
    try:
        return getattr(nvrtc, name)(*args)
    except RuntimeError as exc:
        raise CompileError(f"NVRTC could not be loaded ({name}): {exc}") from exc


def _check(result: Any, call: str) -> Any:
    """Unpack an NVRTC result tuple, raising a CompileError that names ``call`` and
    NVRTC's result: not through the driver's check, whose names are CUresult's (NVRTC's
    numbers mean other things there: its out of memory, 1, is the driver's invalid
    value, and its program creation failure, 2, the driver's out of memory)."""
    err, *values = result
    if int(err) != 0:
        raise CompileError(f"{call} failed: {_nvrtc_name(err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)

"""How asyncmetal's native runtime is compiled: its source files and the compiler call.

One recipe for both builds: the wheel's (``setup.py`` loads this file by path, before
asyncmetal can be imported) and the first-use build of :mod:`asyncmetal._native`. So it
imports nothing from asyncmetal.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Mapping

# native/: the runtime (every backend's native part; amrt.h says what each file holds),
# then the CPython extension module, compiled in only where Python.h is.
RUNTIME_SOURCES = (
    "timelines.c",
    "host_queues.c",
    "cuda_driver.c",
    "cuda_stream.c",
    "cuda_submit.c",
    "cuda_completion.c",
    "objc_blocks.c",
)
EXTENSION_SOURCES = ("py_module.c", "py_launch.c", "py_dlpack.c")
HEADERS = ("amrt.h", "cuda_stream.h", "py_ext.h")
ALL_FILES = RUNTIME_SOURCES + EXTENSION_SOURCES + HEADERS
# The extension module's import name, and the packaged runtime's file names (in the
# asyncmetal package directory): with the extension, else the runtime alone.
MODULE = "asyncmetal._amrt"
PACKAGED_WITH_EXTENSION = "_amrt"
PACKAGED_RUNTIME_ONLY = "libamrt"


def cc_command() -> list[str]:
    """``$CC`` (default ``cc``) split as a shell splits it: as with make and setuptools,
    it may name a launcher or flags besides the compiler (``ccache gcc``, ``gcc -m64``).
    One a shell cannot split is taken whole: a program not found, as any other."""
    cc = os.environ.get("CC") or ""
    try:
        return shlex.split(cc) or ["cc"]
    except ValueError:  # (no closing quotation: one word, which no program is named)
        return [cc]


def compiler() -> list[str] | None:
    """``cc_command()`` if its program can be run, else None."""
    command = cc_command()
    return command if shutil.which(command[0]) else None


def python_include() -> str | None:
    """The interpreter's header directory if Python.h is there."""
    include = sysconfig.get_paths().get("include")
    if include and os.path.exists(os.path.join(include, "Python.h")):
        return include
    return None


def digest(sources: Mapping[str, bytes], with_extension: bool) -> str:
    """What a build is made from: every file's name and bytes, and whether the
    extension is compiled in. A packaged runtime records it (am_build_digest) so that
    one built from other sources is not used."""
    h = hashlib.sha256(b"extension" if with_extension else b"runtime")
    for name in sorted(sources):
        h.update(name.encode() + b"\0" + sources[name] + b"\0")
    return h.hexdigest()[:16]


def compile_runtime(
    sources: Mapping[str, bytes], target: str, include: str | None, cc: list[str] | None = None
) -> None:
    """Compile the runtime (with the extension module if ``include``, the directory of
    Python.h, is given) from ``sources`` (file name -> bytes) into ``target``. Raises
    RuntimeError with the compiler's output if it fails, OSError if it cannot run."""
    cc = cc or compiler()
    if cc is None:
        raise FileNotFoundError("no C compiler: $CC or cc")
    names = RUNTIME_SOURCES + (EXTENSION_SOURCES if include else ())
    with tempfile.TemporaryDirectory(prefix="asyncmetal-build-") as tmp:
        for name, data in sources.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        flags = ["-O2", "-shared", "-fPIC", "-pthread", "-I", tmp]
        flags.append(f'-DAM_BUILD_DIGEST="{digest(sources, include is not None)}"')
        if include:
            flags += ["-I", include]
        if sys.platform == "darwin":
            flags += ["-undefined", "dynamic_lookup"]
        proc = subprocess.run(
            [*cc, *flags, *(os.path.join(tmp, n) for n in names), "-o", target],
            capture_output=True,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.decode(errors="replace"))

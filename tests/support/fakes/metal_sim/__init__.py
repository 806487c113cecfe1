"""A simulated Metal for Linux x86-64 (sim.h lists its C files), built here with the
system compilers and handed to the Metal backend through its library variables.

:func:`configure` builds the simulation once per source version (into the test cache
directory) and sets ``ASYNCMETAL_OBJC_LIB``, ``ASYNCMETAL_METAL_LIB``,
``ASYNCMETAL_MTLCOMPILER_LIB`` and ``ASYNCMETAL_LIBSYSTEM`` to it, unless one is set
already (a Mac, or a run that points the backend elsewhere). Compile workers inherit the
variables, so they compile with the simulated service.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = [
    HERE / name
    for name in (
        "objc_runtime.c",
        "metal_objects.c",
        "command_buffers.c",
        "encoders.c",
        "compiler.c",
    )
]
HEADERS = [HERE / "sim.h"]
VARIABLES = (
    "ASYNCMETAL_OBJC_LIB",
    "ASYNCMETAL_METAL_LIB",
    "ASYNCMETAL_MTLCOMPILER_LIB",
    "ASYNCMETAL_LIBSYSTEM",
)


def missing() -> str | None:
    """Why the simulation cannot be built here, or None."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return "the simulated Metal is written for Linux x86-64"
    if shutil.which("clang") is None:
        return "clang is not installed (apt-get install clang libblocksruntime-dev)"
    if not Path("/usr/include/Block.h").exists():
        return "the blocks runtime is not installed (apt-get install libblocksruntime-dev)"
    if shutil.which(os.environ.get("ASYNCMETAL_SIM_CXX", "c++")) is None:
        return "no C++ compiler for the simulated Metal compiler (apt-get install g++)"
    return None


@functools.cache
def build() -> Path:
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS)).hexdigest()[:16]
    root = Path(os.environ.get("ASYNCMETAL_CACHE_DIR") or tempfile.gettempdir())
    out = root / f"asyncmetal-metal-sim-{digest}.so"
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run(
            [
                "clang",
                "-fblocks",
                "-shared",
                "-fPIC",
                "-O1",
                "-g",
                "-Wall",
                "-Werror",
                *map(str, SOURCES),
                "-o",
                str(tmp),
                "-lBlocksRuntime",
                "-lpthread",
                "-ldl",
            ],
            check=True,
        )
        tmp.replace(out)
    return out


def configure() -> bool:
    """Point the Metal backend at the simulation; False (nothing set) where it is not
    built here: on macOS, where a variable is set already, or without the compilers."""
    if sys.platform == "darwin" or any(os.environ.get(v) for v in VARIABLES):
        return False
    if missing():
        return False
    path = str(build())
    for variable in VARIABLES:
        os.environ[variable] = path
    return True


def configured() -> bool:
    path = os.environ.get("ASYNCMETAL_OBJC_LIB", "")
    return "asyncmetal-metal-sim" in path


def library() -> ctypes.CDLL:
    """The simulation's own queries (live objects per class, leaked autoreleases)."""
    lib = ctypes.CDLL(os.environ["ASYNCMETAL_OBJC_LIB"])
    lib.asyncmetal_sim_live.restype = ctypes.c_long
    lib.asyncmetal_sim_live.argtypes = [ctypes.c_char_p]
    lib.asyncmetal_sim_implicit.restype = ctypes.c_long
    lib.asyncmetal_sim_handlers.restype = ctypes.c_long
    lib.asyncmetal_sim_handlers.argtypes = [ctypes.c_int]
    lib.asyncmetal_sim_hold_handlers.restype = None
    lib.asyncmetal_sim_hold_handlers.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.asyncmetal_sim_fail_at.restype = ctypes.c_long
    lib.asyncmetal_sim_fail_at.argtypes = [ctypes.c_long]
    return lib


def live(name: str) -> int:
    count: int = library().asyncmetal_sim_live(name.encode())
    return count


def implicit() -> int:
    """Objects autoreleased with no pool in place (never freed on a long-lived thread)."""
    count: int = library().asyncmetal_sim_implicit()
    return count


def handlers() -> tuple[int, int]:
    """Completed handlers run so far, and how many ran on the committing thread."""
    lib = library()
    return lib.asyncmetal_sim_handlers(0), lib.asyncmetal_sim_handlers(1)


def handlers_returned() -> int:
    """Completed handlers that have returned so far."""
    count: int = library().asyncmetal_sim_handlers(2)
    return count


def buffers_let_go() -> int:
    """Command buffers whose handlers all ran and that their queue let go of since."""
    count: int = library().asyncmetal_sim_handlers(3)
    return count


def hold_handlers(queue: int, hold: bool) -> None:
    """Hold back (or, released, call in order) the completed handlers of the command
    buffers of ``queue`` (an ``MTLCommandQueue``): its GPU thread goes on meanwhile."""
    library().asyncmetal_sim_hold_handlers(queue, int(hold))


def fail_at(n: int) -> int:
    """From now on the calling thread's ``n``-th message that makes an object (a buffer,
    a queue, an event, a command buffer, an encoder...) returns nil, as Metal's do with
    no memory left (0: none, only counted; -1: off). Returns how many such messages the
    thread that asked last sent since."""
    sent: int = library().asyncmetal_sim_fail_at(n)
    return sent

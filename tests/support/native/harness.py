"""Builds the C harnesses of this folder against the runtime's source, plain or under a
sanitizer, and runs them.

Each harness is compiled together with the runtime's source files
(``asyncmetal/_native_build.RUNTIME_SOURCES``, the runtime's headers on the include path),
with the harness's flags: under ThreadSanitizer every access of the runtime's threads is
checked, under AddressSanitizer (with LeakSanitizer) every allocation. A sanitizer the
machine cannot build or run skips its test, saying which and why; CI installs clang,
with which both run.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import pytest

from asyncmetal._native_build import RUNTIME_SOURCES

HERE = Path(__file__).parent
SUPPORT = HERE.parent  # extra sources are named from here (fakes/fake_cuda_driver.c)
SANITIZERS = ("", "thread", "address")  # "": a plain -O2 build

# A sanitized binary reports with a non-zero exit (TSan exits 66 on a report) and says
# where; halt_on_error keeps the first report readable.
_OPTIONS = {
    "thread": ("TSAN_OPTIONS", "halt_on_error=1 second_deadlock_stack=1"),
    "address": ("ASAN_OPTIONS", "detect_leaks=1 halt_on_error=1"),
}


def _compiler() -> str | None:
    """clang where installed (its sanitizers are the ones CI uses), else cc/$CC."""
    for cc in ("clang", os.environ.get("CC") or "cc", "gcc"):
        if shutil.which(cc):
            return cc
    return None


@functools.cache
def sanitizer_missing(sanitizer: str) -> str | None:
    """Why ``-fsanitize=sanitizer`` cannot be used here, or None if a threaded probe
    builds and runs under it."""
    cc = _compiler()
    if cc is None:
        return "no C compiler (clang, cc or $CC)"
    if not sanitizer:
        return None
    probe = (
        "#include <pthread.h>\n"
        "static void *run(void *p) { return p; }\n"
        "int main(void) { pthread_t t; pthread_create(&t, 0, run, 0);"
        " return pthread_join(t, 0); }\n"
    )
    with tempfile.TemporaryDirectory(prefix="asyncmetal-san-") as tmp:
        out = os.path.join(tmp, "probe")
        build = subprocess.run(
            [cc, f"-fsanitize={sanitizer}", "-pthread", "-x", "c", "-", "-o", out],
            input=probe.encode(),
            capture_output=True,
            check=False,
        )
        if build.returncode != 0:
            return f"{cc} cannot build with -fsanitize={sanitizer}: {build.stderr.decode()[-400:]}"
        run = subprocess.run([out], capture_output=True, check=False, timeout=60)
        if run.returncode != 0:
            why = run.stderr.decode()[-400:]
            return f"a -fsanitize={sanitizer} binary does not run here: {why}"
    return None


def skip_without_compiler() -> None:
    """Skip the calling test where the simulated driver's binaries cannot be built."""
    missing = sanitizer_missing("")
    if missing is not None:
        pytest.skip(missing)


def build(
    harness: str,
    out_dir: Path,
    sanitizer: str = "",
    extra: tuple[str, ...] = (),
    defines: tuple[str, ...] = (),
) -> Path:
    """``harness`` (a file of this folder, with the files ``extra`` of tests/support) compiled with
    the runtime, with the macros ``defines`` (the runtime's test hooks: AM_TEST_ALLOC and
    AM_TEST_HOOKS, see native/cuda_stream.h); skips the calling test if the sanitizer is
    unavailable."""
    reason = sanitizer_missing(sanitizer)
    if reason is not None:
        pytest.skip(reason)
    cc = _compiler()
    assert cc is not None
    native = Path(str(resources.files("asyncmetal").joinpath("native")))
    flags = ["-O2"]
    if sanitizer:
        flags = ["-O1", "-g", "-fno-omit-frame-pointer", f"-fsanitize={sanitizer}"]
    binary = out_dir / f"{Path(harness).stem}-{sanitizer or 'plain'}"
    extras = [SUPPORT / name for name in extra]
    sources = [HERE / harness, *extras]
    sources += [native / name for name in RUNTIME_SOURCES]
    subprocess.run(
        [
            cc,
            *flags,
            *(f"-D{name}" for name in defines),
            "-pthread",
            "-I",
            str(native),
            *(f"-I{p.parent}" for p in extras),
            *map(str, sources),
            "-o",
            str(binary),
        ],
        check=True,
    )
    return binary


def run(
    binary: Path, *args: str, sanitizer: str = "", timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """Run a harness built by :func:`build`, with its sanitizer's options set."""
    env = dict(os.environ)
    if sanitizer:
        name, options = _OPTIONS[sanitizer]
        env[name] = options
    return subprocess.run(
        [str(binary), *args], capture_output=True, text=True, timeout=timeout, env=env
    )

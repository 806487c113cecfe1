"""A cpu kernel library built with -fsanitize=address (gcc names libasan among its
dependencies) loads only into a process that loaded that runtime first: anywhere else
the runtime ends the process from inside dlopen. It is refused with a CompileError that
says how to preload it; preloaded, it loads and runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncmetal._native_build import cc_command
from asyncmetal.backends.cpu import _needed

SCRIPT = textwrap.dedent(
    """
    import asyncio, random
    import numpy as np
    import asyncmetal as am

    async def main():
        async with am.open_device("cpu") as dev:
            src = f"// {random.random()}\\nvoid k(int* x) {{ x[0] = 7; }}"
            try:
                k = await dev.compile(src, "k", options=("-fsanitize=address",))
            except am.CompileError as exc:
                print("refused:", exc)
            else:
                buf = await dev.alloc(4)
                await dev.queue.launch(k, buf)
                print("ran", (await buf.read(np.int32))[0])
        print("alive")

    asyncio.run(main())
    """
)


def _asan_runtime(tmp_path: Path) -> str | None:
    """The ASan runtime the C compiler links a sanitized library against, where it
    names one among its dependencies (gcc; clang leaves a shared library's unlinked)."""
    out = tmp_path / "probe.so"
    probe = subprocess.run(
        [*cc_command(), "-shared", "-fPIC", "-fsanitize=address", "-x", "c", "-", "-o", out],
        input=b"int f(int* x) { return x[1]; }",
        capture_output=True,
        check=False,
    )
    if probe.returncode != 0:
        return None
    return next((n for n in _needed(out.read_bytes()) if n.startswith("libasan.")), None)


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **env},
    )


def test_a_kernel_built_with_asan_is_refused_unless_its_runtime_came_first(
    tmp_path: Path,
) -> None:
    """Checked failing without the check: the child died in dlopen (exit code 1, "ASan
    runtime does not come first in initial library list"), never printing "alive"."""
    runtime = _asan_runtime(tmp_path)
    if runtime is None:
        pytest.skip("the C compiler links no ASan runtime into a shared library here")
    child = _run({})
    assert child.returncode == 0, child.stderr[-3000:]
    lines = child.stdout.splitlines()
    assert lines[-1] == "alive" and lines[0].startswith("refused: kernel 'k' cannot be loaded")
    assert f"needs {runtime}" in lines[0] and "LD_PRELOAD" in lines[0], lines[0]
    path = subprocess.run(
        [*cc_command(), f"-print-file-name={runtime}"], capture_output=True, text=True, check=True
    ).stdout.strip()
    preloaded = _run({"LD_PRELOAD": path, "ASAN_OPTIONS": "detect_leaks=0"})
    assert preloaded.returncode == 0, preloaded.stderr[-3000:]
    assert preloaded.stdout.splitlines() == ["ran 7", "alive"], preloaded.stdout

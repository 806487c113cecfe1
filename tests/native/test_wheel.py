"""The built wheel carries the native runtime: installed into a fresh virtual environment
where no C compiler can be found, the runtime loads (packaged, with its extension
module), the cpu device opens, and compiling a cpu kernel says that it needs a C
compiler.

Offline where it can be: the wheel is built without build isolation when setuptools is
installed here (else pip fetches it), installed with this environment's pip into the new
one, which finds numpy and anyio in this environment's site-packages."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
from pathlib import Path

import anyio
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = textwrap.dedent(
    """
    import asyncio, shutil
    import asyncmetal as am
    from asyncmetal import _native

    assert shutil.which("cc") is None and shutil.which("gcc") is None
    _native.runtime()
    print("origin:", _native.origin, _native.origin_path)
    print("extension:", _native.extension() is not None, _native.extension_error)
    print("devices:", am.devices())

    async def main():
        async with am.open_device("cpu") as dev:
            try:
                await dev.compile("void k(void) {}", "k")
            except am.CompileError as exc:
                print("compile:", type(exc).__name__, exc)

    asyncio.run(main())
    """
)


def _can_build_here() -> bool:
    """Whether this environment has what the build asks for: setuptools 77 or later
    (pyproject.toml's licence is an SPDX expression; it has its own bdist_wheel too)."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    from importlib.metadata import version

    return int(version("setuptools").split(".")[0]) >= 77


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of the sources (the tree stays clean)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "asyncmetal",
        source / "asyncmetal",
        ignore=shutil.ignore_patterns("__pycache__", "*.so"),
    )
    isolation = ["--no-build-isolation"] if _can_build_here() else []
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, str(source)],
        cwd=tmp,
        check=True,
        timeout=300,
    )
    (built,) = tmp.glob("asyncmetal-*.whl")
    return built


def test_the_wheel_is_a_platform_wheel_with_the_runtime(wheel: Path) -> None:
    import zipfile

    assert not wheel.name.endswith("-none-any.whl"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    assert f"asyncmetal/_amrt{suffix}" in names or f"asyncmetal/libamrt{suffix}" in names
    assert "asyncmetal/native/amrt.h" in names  # the sources the loader checks it against


def test_the_runtime_loads_where_no_compiler_is(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "--python", str(python), "install", "-q"),
            *("--no-deps", "--no-index", str(wheel)),
        ],
        check=True,
        timeout=300,
    )
    # numpy, anyio and theirs from this environment (a path line: its .pth files, among
    # them an editable asyncmetal's, are not read).
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dependencies = {str(Path(m.__file__).resolve().parent.parent) for m in (np, anyio)}
    (Path(site) / "dependencies.pth").write_text("\n".join(sorted(dependencies)) + "\n")

    env = {
        "PATH": str(env_dir / "bin"),  # python only: no cc, gcc or clang
        "CC": str(tmp_path / "no-such-compiler"),
        "ASYNCMETAL_CACHE_DIR": str(tmp_path / "cache"),  # nothing built before
        "HOME": str(tmp_path),
    }

    def run(*args: str) -> str:
        proc = subprocess.run(
            [str(python), *args],
            cwd=tmp_path,  # not the source tree: asyncmetal comes from the wheel
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    out = run("-c", CHECK)
    assert f"origin: packaged {site}" in out, out
    assert "extension: True" in out or "without Python.h" in out, out
    assert "'cpu'" in out, out
    assert "compile: CompileError kernel 'k': compiling cpu kernels needs a C compiler" in out, out
    assert "no-such-compiler" in out, out

    info = run("-m", "asyncmetal", "info")
    assert f"native runtime: packaged, {site}" in info, info
    assert not list((tmp_path / "cache").glob("amrt*")), "nothing was built at first use"

    # A runtime built from other sources than those installed beside it is not used.
    with open(Path(site) / "asyncmetal" / "native" / "timelines.c", "a") as f:
        f.write("/* edited after the build */\n")
    info = run("-m", "asyncmetal", "info")
    assert "native runtime: unavailable" in info, info
    assert "was built from other sources than those beside it" in info, info
    assert "no C compiler" in info, info

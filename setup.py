"""Builds asyncmetal's native runtime into the wheel (the rest is in pyproject.toml).

setuptools, because it needs nothing but a C compiler: a clean machine with gcc and pip
builds the wheel, with no CMake or Meson to fetch. The runtime is compiled by the same
recipe as asyncmetal's first-use build (asyncmetal/_native_build.py, loaded here by
path: asyncmetal itself needs numpy to import), as the extension module
``asyncmetal._amrt`` where the interpreter's headers are (Python.h), else as the plain
shared library ``asyncmetal/libamrt*.so`` that ctypes loads. Where no C compiler works,
the wheel is built without it and the runtime is built at first use instead.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "_native_build", os.path.join(HERE, "asyncmetal", "_native_build.py")
)
assert _spec is not None and _spec.loader is not None
native_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(native_build)

INCLUDE = native_build.python_include()
STEM = native_build.PACKAGED_WITH_EXTENSION if INCLUDE else native_build.PACKAGED_RUNTIME_ONLY


class BuildRuntime(build_ext):
    """Compiles the runtime with native_build.compile_runtime instead of setuptools'
    compiler driver, into the path setuptools chose (the wheel, or in place for an
    editable install)."""

    def build_extension(self, ext: Extension) -> None:
        native = os.path.join(HERE, "asyncmetal", "native")
        sources = {}
        for name in native_build.ALL_FILES:
            with open(os.path.join(native, name), "rb") as f:
                sources[name] = f.read()
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            native_build.compile_runtime(sources, target, INCLUDE)
        except (OSError, RuntimeError) as exc:
            print(
                f"asyncmetal: the native runtime is not packaged ({exc}); "
                "it will be built at first use",
                file=sys.stderr,
            )


setup(
    ext_modules=[Extension(f"asyncmetal.{STEM}", sources=[])],
    cmdclass={"build_ext": BuildRuntime},
)

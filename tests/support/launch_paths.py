"""Choosing a queue's launch path in tests: Queue.launch's common case in the native
extension module ("queue"), Python's checks then the backend's launch through the
extension module ("extension"), or through ctypes ("ctypes")."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import asyncmetal as am
from asyncmetal import _native

PATHS = ["queue", "extension", "ctypes"]


def select_launch_path(
    queue: am.Queue, path: str, attribute: str, ctypes_function: object = None
) -> None:
    """Make ``queue`` submit through ``path`` (one of PATHS); the extension's paths are
    skipped, with the reason, where the module could not be built. ``attribute``: the
    backend queue's extension call, set to ``ctypes_function`` for "ctypes"."""
    if path != "queue":
        queue._fast_launch = None
    if path == "ctypes":
        setattr(queue._native, attribute, ctypes_function)
    elif _native.extension() is None:
        pytest.skip(f"the extension module is not built here: {_native.extension_error}")
    elif path == "queue":
        assert queue._fast_launch is not None
    else:
        assert getattr(queue._native, attribute) is not None


def run_without_extension(code: str, switch: str = "0") -> subprocess.CompletedProcess[str]:
    """``code`` run by a new interpreter with the extension module switched off
    (``ASYNCMETAL_EXTENSION=0``, or another value that turns it off: ``switch``): its exit
    status and output, text."""
    env = {**os.environ, "ASYNCMETAL_EXTENSION": switch}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )

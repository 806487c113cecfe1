"""Choosing a queue's launch path in tests: the native runtime's extension module or ctypes."""

from __future__ import annotations

import pytest

import asyncmetal as am
from asyncmetal import _native


def select_launch_path(
    queue: am.Queue, path: str, attribute: str, ctypes_function: object = None
) -> None:
    """Make ``queue`` launch through ctypes (``path == "ctypes"``), or check that it
    launches through the extension module (``"extension"``; skipped, with the reason,
    where the module could not be built). ``attribute``: the backend queue's fast path,
    set to ``ctypes_function`` for ctypes."""
    if path == "ctypes":
        setattr(queue._native, attribute, ctypes_function)
    elif _native.extension() is None:
        pytest.skip(f"the extension module is not built here: {_native.extension_error}")
    else:
        assert getattr(queue._native, attribute) is not None

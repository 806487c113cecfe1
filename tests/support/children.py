"""A test's Python script run in a fresh interpreter, from the repository's root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_child(
    *args: str, hung: str, timeout: float = 90, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -c *args`` (a script and its arguments), its output captured, in ``env``
    (None: this process's); the test fails with ``hung`` and what the child printed if it
    runs past ``timeout`` seconds."""
    try:
        return subprocess.run(
            [sys.executable, "-c", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{hung}; it printed {exc.stdout!r}")

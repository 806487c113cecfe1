"""The README's commands are the ones CI runs, and the demo and example work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    command = 'pip install -e ".[test]" && python -m pytest'
    assert f"    {command}\n" in readme
    assert f"\n{command}\n" in (ROOT / ".ci" / "run").read_text()


def test_demo_runs_and_checks_its_result() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "asyncmetal", "demo"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "result checked: correct" in proc.stdout


def _run(*args: str) -> str:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, check=True, timeout=120
    ).stdout


def test_info_lists_cpu() -> None:
    assert "  cpu" in _run("-m", "asyncmetal", "info")


def test_hello_example() -> None:
    assert _run(str(ROOT / "examples" / "hello.py")).strip() == "[1. 2. 3. 4. 5. 6. 7. 8.]"


def test_overlap_example() -> None:
    out = _run(str(ROOT / "examples" / "overlap.py"))
    assert out.count("compiled; launching") == 8
    assert "all done" in out

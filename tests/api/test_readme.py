"""The README's commands are the ones CI runs, and the demo and example work."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import asyncmetal as am

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
    assert "all done; x[0] = 36.0" in out  # whatever order the stages ran in


def _readme_programs() -> list[str]:
    """The README's Python blocks that are complete programs (they run their main);
    the others are fragments of a program that needs a GPU."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", readme, flags=re.S | re.M)
    return [block for block in blocks if "anyio.run(main)" in block]


# What each README program prints, by a line that tells the program: all of it is
# deterministic (the first prints numpy's summary of 1024 twos).
_PRINTS = {
    "void add(": ["[2. 2. 2. ... 2. 2. 2.]"],
    "void produce(": ["[ 0  2  4  6  8 10 12 14]"],
    "void twice(": ["[2. 2. 2. 2.]", "[7 7 7 7]"],
    "jnp.from_dlpack": ["7168", "[0 1 2 3]"],
    "compile_many": ["ready: ['inc'] failed: ['absent', 'broken']"],
}


def _numbers(text: str) -> set[float]:
    return {float(n) for n in re.findall(r"-?\d+(?:\.\d*)?", text)}


def test_readme_programs_print_what_they_say() -> None:
    """Each README program runs and prints exactly its expected lines, and each
    ``print(...)  # comment`` of it names the numbers its line shows. Checked: fails
    with an expected line or a comment changed."""
    programs = _readme_programs()
    assert len(programs) >= 3  # the first example, the compile_many one, the numpy one
    for program in programs:
        (expected,) = [lines for key, lines in _PRINTS.items() if key in program]
        proc = subprocess.run(
            [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, f"{program}\n{proc.stderr}"
        out = proc.stdout.splitlines()
        assert out == expected, program
        prints = [line for line in program.splitlines() if "print(" in line]
        assert len(prints) == len(out)
        for line, printed in zip(prints, out, strict=True):
            if "  # " in line:
                assert _numbers(line.split("  # ", 1)[1]) == _numbers(printed), line


def test_readme_compile_many_goes_on_past_failures() -> None:
    """The README's catch-and-continue snippet: the failing kernels are reported by
    name (each CompileError's ``name``) and the good one still comes, as the README says
    it prints."""
    (program,) = [p for p in _readme_programs() if "compile_many" in p]
    out = _run("-c", program)
    assert out.splitlines() == ["ready: ['inc'] failed: ['absent', 'broken']"]
    readme = (ROOT / "README.md").read_text()
    assert "It prints `ready: ['inc'] failed: ['absent', 'broken']`." in readme


def test_readme_service_example_answers_what_the_kernel_computes() -> None:
    """The README's ``curl`` of examples/service.py's ``/compute`` shows the sum of its
    kernel's ``out[i] = i * k + 1`` (tests/api/test_interop_service.py checks that the
    service answers that sum)."""
    readme = (ROOT / "README.md").read_text()
    (match,) = re.finditer(
        r"`curl 'http://127\.0\.0\.1:8080/compute\?n=(\d+)&k=(\d+)'` answers "
        r"`\{\"sum\": (\d+), \"n\": (\d+)\}`",
        readme,
    )
    n, k, total, answered_n = (int(g) for g in match.groups())
    assert (total, answered_n) == (sum(i * k + 1 for i in range(n)), n)
    assert "out[i] = i * k + 1" in (ROOT / "examples" / "service.py").read_text()


def test_readme_names_every_export() -> None:
    """Every top-level name is documented in README's API section."""
    readme = (ROOT / "README.md").read_text()
    api = readme.split("\n## API\n", 1)[1].split("\n## ", 1)[0]
    missing = [name for name in am.__all__ if not re.search(rf"`{name}\b", api)]
    assert not missing
    # and README names nothing as ``am.X`` or ``asyncmetal.X`` that is not exported
    named = set(re.findall(r"\b(?:am|asyncmetal)\.([A-Za-z]\w*)", readme))
    assert named - set(am.__all__) - {"backends"} == set()


_RECEIVERS: dict[str, Any] = {"am": am, "dev": am.Device, "q": am.Queue, "buf": am.Buffer}


def _table_calls() -> list[tuple[str, Any, str]]:
    """Every ``name(args)`` of README's API table (``await`` and a receiver -- ``am.``,
    ``dev.``, ``q.``, ``buf.`` -- allowed): the text, the callable it names (a method of
    the row's class where it has one), its written arguments."""
    readme = (ROOT / "README.md").read_text()
    api = readme.split("\n## API\n", 1)[1].split("\n## ", 1)[0]
    calls = []
    for row in re.findall(r"^\| (`.*)$", api, re.MULTILINE):
        cell = re.match(r"`(\w+)`", row)
        owner = getattr(am, cell[1], None) if cell else None
        for span in re.findall(r"`([^`]+)`", row):
            call = re.fullmatch(r"(?:await )?(?:(\w+)\.)?(\w+)\(([^()]*)\)(?: -> \w+)?", span)
            if call is None or (call[1] is not None and call[1] not in _RECEIVERS):
                continue
            if call[1] is not None:
                where = _RECEIVERS[call[1]]
            elif inspect.isclass(owner) and hasattr(owner, call[2]):
                where = owner
            else:
                where = am
            calls.append((span, getattr(where, call[2]), call[3]))
    return calls


def test_readme_api_table_writes_each_call_as_its_signature() -> None:
    """Each ``name(args)`` of the API table agrees with the callable's signature: a bare
    name is the parameter at its place, ``name=<its default>`` is written after ``*``
    exactly where the parameter is keyword-only, ``name=<another value>`` is a call the
    signature takes. Checked: fails without the fix (``memory_statistics(reset_peaks=
    False)``, ``close(discard=False)`` and ``from_dlpack(x, device=None)`` left out the
    ``*`` of their keyword-only parameters)."""
    calls = _table_calls()
    assert len(calls) >= 15  # (the table's calls are found)
    wrong = []
    for span, function, written in calls:
        params = [p for p in inspect.signature(function).parameters.values() if p.name != "self"]
        args = [a.strip() for a in written.split(",") if a.strip()]
        positional = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        keyword_only = False
        ok = True
        for i, arg in enumerate(args):
            name, eq, value = arg.partition("=")
            param = next((p for p in params if p.name == name), None)
            if arg == "*":
                keyword_only = True
            elif not eq:  # a bare name is the parameter at its place (a value, there)
                here = i < len(positional) and not keyword_only
                ok &= here and (positional[i].name == arg or not arg.isidentifier())
            elif param is None or param.kind is param.POSITIONAL_ONLY:
                ok = False
            elif value == repr(param.default):  # written as its signature
                ok &= keyword_only == (param.kind is param.KEYWORD_ONLY)
        required = [p for p in positional if p.default is p.empty]
        ok &= len([a for a in args if "=" not in a and a != "*"]) >= len(required)
        if not ok:
            wrong.append(f"{span} != {function.__qualname__}{inspect.signature(function)}")
    assert wrong == [], "\n".join(wrong)

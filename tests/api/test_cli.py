"""``python -m asyncmetal`` and examples/service.py where something they need is missing:
each says what, and exits, without a traceback (a new user's first runs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import asyncmetal as am

ROOT = Path(__file__).resolve().parents[2]
SERVICE = ROOT / "examples" / "service.py"


def _run(
    args: list[str],
    *,
    hide: tuple[str, ...] = (),
    site: str = "",
    tmp_path: Path | None = None,
    env: dict[str, str] | None = None,
    unset: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` with ``env`` added and ``unset`` removed; modules in
    ``hide`` cannot be imported, and ``site`` runs at start-up."""
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in unset}
    if hide or site:
        assert tmp_path is not None
        # sitecustomize runs at start-up: a None in sys.modules makes a module absent.
        (tmp_path / "sitecustomize.py").write_text(
            "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in hide) + site
        )
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
        cwd=ROOT,
    )


def _said_plainly(proc: subprocess.CompletedProcess[str], code: int, *words: str) -> None:
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr


@pytest.mark.parametrize("device", ["cuda:0", "cuda:7"])
def test_demo_on_a_device_not_here_says_so(device: str) -> None:
    if device in am.devices():
        pytest.skip(f"{device} is here")
    proc = _run(["-m", "asyncmetal", "demo", "--device", device])
    _said_plainly(proc, 1, f"device {device!r} is not available here", "asyncmetal info")


def test_a_cuda_device_without_cuda_bindings_says_what_to_install(tmp_path: Path) -> None:
    """Checked: it said only that the device is not available here."""
    proc = _run(
        ["-m", "asyncmetal", "info"],
        hide=("cuda",),
        tmp_path=tmp_path,
        env={"ASYNCMETAL_DEVICE": "cuda:0"},
    )
    _said_plainly(
        proc,
        1,
        "$ASYNCMETAL_DEVICE: device 'cuda:0' is not available here: cuda devices need "
        "cuda-bindings, which is not installed here (pip install cuda-bindings",
    )


def test_demo_on_an_unknown_device_says_so() -> None:
    proc = _run(["-m", "asyncmetal", "demo", "--device", "gpu"])
    _said_plainly(proc, 1, "unknown device 'gpu'")


def test_demo_on_a_device_it_has_no_kernels_for_says_so() -> None:
    proc = _run(["-m", "asyncmetal", "demo", "--device", "npy"])
    _said_plainly(proc, 1, "kernels are for cpu only, not npy")


def test_demo_without_a_c_compiler_says_so(tmp_path: Path) -> None:
    env_cc = {"CC": str(tmp_path / "no-cc"), "ASYNCMETAL_CACHE": "0"}
    proc = _run(["-m", "asyncmetal", "demo"], env=env_cc)
    _said_plainly(proc, 1, "needs a C compiler", "is not an executable")


@pytest.mark.parametrize("command", ["demo", "bench"])
@pytest.mark.parametrize("loop", ["trio", "uvloop"])
def test_a_loop_not_installed_says_so(command: str, loop: str, tmp_path: Path) -> None:
    proc = _run(["-m", "asyncmetal", command, "--loop", loop], hide=(loop,), tmp_path=tmp_path)
    _said_plainly(proc, 2, f"needs {loop}", f"pip install {loop}")


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
def test_bench_compares_with_a_thread_hand_off(loop: str) -> None:
    """bench --help promises a comparison: bench prints both ways and their ratio, each
    row's as the time asyncmetal takes against the hand-off's (lower is better in both:
    a ratio of rates read the other way round from a ratio of times)."""
    proc = _run(["-m", "asyncmetal", "bench", "--loop", loop, "--launches", "300", "--tasks", "20"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if "thread hand-off" in line and "takes" in line)
    assert "asyncmetal" in header
    for label, time_of in [
        ("one at a time, mean (us)", lambda x: x),
        ("20 tasks at once, per second", lambda x: 1 / x),
    ]:
        (row,) = [line for line in lines if line.startswith(label)]
        ours, theirs, ratio, unit = row[len(label) :].split(maxsplit=3)
        assert float(ours) > 0 and float(theirs) > 0
        assert unit == "the time" and ratio.endswith("x")
        expected = time_of(float(ours)) / time_of(float(theirs))
        assert float(ratio[:-1]) == pytest.approx(expected, rel=0.05, abs=0.01)
    helped = _run(["-m", "asyncmetal", "bench", "--help"]).stdout
    assert "to_thread.run_sync" in helped


def test_service_torch_without_torch_says_so(tmp_path: Path) -> None:
    proc = _run([str(SERVICE), "--torch", "--port", "0"], hide=("torch",), tmp_path=tmp_path)
    _said_plainly(proc, 2, "--torch needs PyTorch, which is not installed here")


def test_service_torch_on_a_cpu_device_says_so(tmp_path: Path) -> None:
    """With PyTorch present (a stand-in here: the refusal comes before it is used) and
    no cuda device asked for, --torch refuses instead of crashing on the model."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('not to be used')\n")
    args = [str(SERVICE), "--torch", "--device", "cpu", "--port", "0"]
    proc = _run(args, env={"PYTHONPATH": str(tmp_path)})
    _said_plainly(proc, 2, "--torch runs a PyTorch model on a cuda device, and cpu is not one")


def test_service_without_aiohttp_says_so(tmp_path: Path) -> None:
    proc = _run([str(SERVICE), "--port", "0"], hide=("aiohttp",), tmp_path=tmp_path)
    _said_plainly(proc, 1, "needs aiohttp", "pip install aiohttp")


def test_service_on_a_device_not_here_says_so() -> None:
    if "cuda:7" in am.devices():
        pytest.skip("cuda:7 is here")
    proc = _run([str(SERVICE), "--device", "cuda:7", "--port", "0"])
    _said_plainly(proc, 2, "device 'cuda:7' is not available here")


@pytest.mark.parametrize(
    ("device", "said"),
    [("garbage", "unknown device 'garbage'"), ("cuda:7", "device 'cuda:7' is not available")],
)
def test_info_says_so_where_asyncmetal_device_names_no_device_here(device: str, said: str) -> None:
    """info lists what open_device() can open; a $ASYNCMETAL_DEVICE that would fail
    there is said, on one line, with a non-zero exit. Checked: before, info ignored it
    (exit 0), and the user's program failed later."""
    if device in am.devices():
        pytest.skip(f"{device} is here")
    proc = _run(["-m", "asyncmetal", "info"], env={"ASYNCMETAL_DEVICE": device})
    _said_plainly(proc, 1, f"$ASYNCMETAL_DEVICE: {said}")
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "  cpu" in proc.stdout.splitlines()  # the listing, all the same


def test_a_cache_directory_that_is_a_file_is_one_line_saying_so(tmp_path: Path) -> None:
    """The command runs without the disk cache, its warning one line naming the
    command and the cause, not a file and line of the library's with its source.
    Checked: before, two lines pointing into anyio, with "[Errno 17] File exists"."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    env = {"ASYNCMETAL_CACHE_DIR": str(blocker)}
    proc = _run(["-m", "asyncmetal", "bench", "--launches", "5", "--tasks", "2"], env=env)
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("python -m asyncmetal bench: CacheWarning: "), line
    assert f"{blocker} is not a directory" in line, line


def test_no_home_directory_runs_the_demo_without_a_disk_cache(tmp_path: Path) -> None:
    """No $HOME and a user the password database does not know (a container run as an
    arbitrary uid): the demo runs, one line saying there is no disk cache. Checked:
    before, a traceback ending in pathlib's "Could not determine home directory"."""
    site = (
        "import pwd\n"
        "def _unknown(uid):\n"
        "    raise KeyError(f'getpwuid(): uid not found: {uid}')\n"
        "pwd.getpwuid = _unknown\n"
    )
    unset = ("HOME", "XDG_CACHE_HOME", "ASYNCMETAL_CACHE_DIR")
    proc = _run(["-m", "asyncmetal", "demo"], site=site, tmp_path=tmp_path, unset=unset)
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert "CacheWarning" in line and "set $ASYNCMETAL_CACHE_DIR" in line, line


@pytest.mark.parametrize(
    ("raised", "code", "said"),
    [
        (KeyboardInterrupt(), 130, "python -m asyncmetal bench: interrupted"),
        (OSError(28, "No space left on device"), 1, "OSError: [Errno 28] No space left"),
    ],
    ids=["interrupt", "full-disk"],
)
def test_an_interrupt_or_an_unexpected_error_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    raised: BaseException,
    code: int,
    said: str,
) -> None:
    """Ctrl-C, or an error that is not asyncmetal's (a full disk), ends the command
    with a line saying so and a non-zero exit, not a traceback. Checked: before, both
    came out as tracebacks."""
    from asyncmetal import __main__ as cli

    def run_on(*args: object) -> None:
        raise raised

    monkeypatch.setattr(cli, "_run_on", run_on)
    try:
        returned = cli.main(["bench"])
    except BaseException as exc:  # (a KeyboardInterrupt let out would end the session)
        pytest.fail(f"main() let out {exc!r}")
    assert returned == code
    err = capsys.readouterr().err
    assert said in err.splitlines()[0] and "Traceback" not in err, err


@pytest.mark.parametrize("command", ["info", "demo"])
def test_output_read_by_nobody_ends_the_command_quietly(command: str) -> None:
    """Output into a pipe nobody reads (``| head -1`` having left: here, a pipe whose
    reading end is closed before the command starts) ends it with exit code 1 and
    nothing on stderr. Checked: before, Python's "Exception ignored ... BrokenPipeError"
    at exit (code 120), or a traceback."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "asyncmetal", command],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
            cwd=ROOT,
        )
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (1, ""), proc.stderr

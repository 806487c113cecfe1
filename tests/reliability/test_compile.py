"""Reliability of compiling: the pool under races, bad arguments, timeouts and dead
workers, and the caches when damaged, full or unwritable. Every wait is bounded."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import mmap
import os
import pickle
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _compile
from asyncmetal._cache import CacheWarning, CompileCache
from asyncmetal._compile import source_key
from asyncmetal._native_build import cc_command
from asyncmetal._pool import CompilePool, compiler_identity
from asyncmetal.backends.cpu import CCompiler
from tests.reliability.test_fork import _FORK_HOLDING
from tests.support.compilers import GatedCompiler, SlowCompiler, gate_name

pytestmark = pytest.mark.anyio
BOUND = 60  # seconds: what would otherwise hang fails instead


def _src(tag: object) -> str:
    return f"int twice(int x) {{ return 2 * x; }}\n/* {tag} {time.time_ns()} */\n"


@pytest.fixture
async def pool(anyio_backend: object, tmp_path: Path) -> AsyncIterator[CompilePool]:
    p = CompilePool(1, cache=CompileCache(tmp_path / "cache"))
    yield p
    await p.aclose()


class _HookedLock:
    """The pool's lock, running ``hook`` once on the handler thread right after the
    first critical section that follows its taking of the job ``key`` from the queue:
    the moment the worker has decided about that job."""

    def __init__(self, pool: CompilePool, key: str, hook: Any) -> None:
        self._lock = threading.Lock()
        self._key, self._hook = key, hook
        self._armed: threading.Thread | None = None
        self.gate = threading.Event()  # the job is handed over once this is set
        pending = pool._pending
        real_get = pending.get

        def get(*args: Any, **kwargs: Any) -> Any:
            job = real_get(*args, **kwargs)
            if getattr(job, "key", None) == self._key:
                self.gate.wait(BOUND)
                self._armed = threading.current_thread()
            return job

        pending.get = get  # type: ignore[method-assign]

    def __enter__(self) -> bool:
        return self._lock.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._lock.__exit__(*exc)
        if self._armed is threading.current_thread():
            self._armed = None
            self._hook()


async def test_joining_a_compile_being_withdrawn_gets_a_real_result(pool: CompilePool) -> None:
    compiler, src = CCompiler(), _src("withdrawn")
    key = source_key(await compiler_identity(compiler), src)
    joined: list[Any] = []

    def join() -> None:  # a request for the same source, in the worker's window
        joined.append(pool._submit(compiler, src, key))

    lock = _HookedLock(pool, key, join)
    pool._lock = lock  # type: ignore[assignment]
    first = pool._submit(compiler, src, key)
    pool._withdraw(first)  # nobody wants it any more: the worker will skip it
    lock.gate.set()
    with anyio.fail_after(BOUND):
        while not joined:
            await anyio.sleep(0.01)
        binary = await pool._wait(joined[0])
    assert binary.startswith(b"\x7fELF")


BAD_TIMEOUTS = [
    (-1, am.InvalidArgumentError),
    pytest.param(-(10**400), am.InvalidArgumentError, id="huge-negative"),
    (0, am.InvalidArgumentError),
    (float("nan"), am.InvalidArgumentError),
    ("1", am.ArgumentTypeError),
    (True, am.ArgumentTypeError),
]


@pytest.mark.parametrize(("timeout", "error"), BAD_TIMEOUTS)
async def test_a_bad_timeout_is_refused_and_the_pool_keeps_compiling(
    pool: CompilePool, timeout: Any, error: type[Exception]
) -> None:
    for _ in range(pool.max_workers + 1):  # more bad calls than workers
        with anyio.fail_after(BOUND), pytest.raises(error, match="timeout"):
            await pool.compile(CCompiler(), _src("bad timeout"), timeout=timeout)
    with anyio.fail_after(BOUND):
        assert await pool.compile(CCompiler(), _src("after"), timeout=BOUND)


@pytest.mark.parametrize(("timeout", "error"), BAD_TIMEOUTS)
async def test_device_compiles_refuse_a_bad_timeout_up_front(
    device: am.Device, timeout: Any, error: type[Exception]
) -> None:
    with anyio.fail_after(BOUND):
        with pytest.raises(error, match="timeout"):
            await device.compile("void k(void) {}", "k", timeout=timeout)
        with pytest.raises(error, match="timeout"):
            device.compile_many([("void k(void) {}", "k")], timeout=timeout)


@pytest.mark.parametrize("timeout", [10**400, 1e300, float("inf")], ids=["int", "float", "inf"])
async def test_a_timeout_too_long_for_a_clock_is_none(device: am.Device, timeout: float) -> None:
    """Checked: before, an int too large for a float raised a bare OverflowError."""
    with anyio.fail_after(BOUND):
        assert await device.compile(_src("long timeout"), "twice", timeout=timeout)


class _UnpicklableCompiler(CCompiler):
    """A compiler whose configuration cannot be sent to a worker."""

    name = "unpicklable-cc"

    def __init__(self) -> None:
        super().__init__()
        self.hook = lambda: None

    def config(self) -> tuple[Any, ...]:
        return (self.hook,)


async def test_the_handler_thread_survives_a_failing_job(pool: CompilePool) -> None:
    for _ in range(pool.max_workers + 1):
        with anyio.fail_after(BOUND), pytest.raises(am.CompileError, match="pickle"):
            await pool.compile(_UnpicklableCompiler(), _src("unpicklable"))
    with anyio.fail_after(BOUND):
        assert await pool.compile(CCompiler(), _src("after"))


def _dead(pid: int) -> bool:
    """Whether ``pid`` has ended (gone, or a zombie nobody has collected yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _existing(*paths: str) -> list[str]:
    return [path for path in paths if os.path.lexists(path)]


def _entries(directory: Path) -> list[str]:
    return [str(path) for path in directory.iterdir()]


_HANGING_CC = """#!/bin/sh
# A C compiler that hangs: it records its pid, the directory of its output, a
# temporary file of its own and the pid of a child, then waits for that child.
out=""
while [ $# -gt 0 ]; do
    if [ "$1" = "-o" ]; then out="$2"; fi
    shift
done
if [ -z "$out" ]; then echo "hanging-cc 1.0"; exit 0; fi
scratch=$(mktemp)
sleep 120 &
echo "$$ $! $(dirname "$out") $scratch" > "{record}.tmp"
mv "{record}.tmp" "{record}"
wait
"""


_SILENT_CC = """#!/bin/sh
# A C compiler (a wrapper) that never answers one question: it starts a child that
# holds its output open, records the child's pid and waits for it. Else the real one.
case " $* " in
*" {question} "*)
    sleep 20 &
    echo "$!" > "{record}.tmp"
    mv "{record}.tmp" "{record}"
    wait
    exit 0;;
esac
exec {real} "$@"
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("question", ["--version", "-dM"])
async def test_a_compiler_that_does_not_say_its_version_fails_the_compile_in_time(
    anyio_backend: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, question: str
) -> None:
    """The compiler's version keys the cache, and its predefined macros give its C
    types; one that does not answer ``--version`` or ``-dM -E`` (asked off the loop)
    fails the compile with a CompileError saying so once VERSION_TIMEOUT_S has passed,
    killed with what it started. Checked: fails without the fix (the compile waited for
    the wrapper's child, then went on; for -dM, its child outlived the question)."""
    monkeypatch.setattr(_compile, "VERSION_TIMEOUT_S", 2.0)
    real = shutil.which(cc_command()[0])
    assert real is not None
    record = tmp_path / "child"
    wrapper = tmp_path / "silent-cc"
    wrapper.write_text(_SILENT_CC.format(question=question, record=record, real=shlex.quote(real)))
    wrapper.chmod(0o755)
    asked_on: list[threading.Thread] = []
    real_popen = subprocess.Popen

    def popen(args: Any, *rest: Any, **kwargs: Any) -> Any:
        if question in args:
            asked_on.append(threading.current_thread())
        return real_popen(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    pool = CompilePool(1, cache=CompileCache(tmp_path / "cache", disk=False))
    try:
        with anyio.fail_after(15), pytest.raises(am.CompileError, match="did not answer"):
            await pool.compile(CCompiler(str(wrapper)), _src("silent"))
    finally:
        await anyio.to_thread.run_sync(lambda: pool.shutdown(kill=True))
    assert asked_on and threading.main_thread() not in asked_on  # (the loop's thread)
    child = int(record.read_text())
    with anyio.fail_after(5):  # (SIGKILL is sent, its end comes a moment later)
        while not _dead(child):
            await anyio.sleep(0.01)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
async def test_an_xcrun_that_does_not_say_the_metal_version_fails_in_time(
    anyio_backend: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Metal compiler's xcrun tool is asked its version alike: one that hangs fails
    with a CompileError once VERSION_TIMEOUT_S has passed, killed. Checked: fails
    without the fix (the question waited for the hung tool)."""
    from asyncmetal.backends.metal._compiler import MetalCompiler

    monkeypatch.setattr(_compile, "VERSION_TIMEOUT_S", 1.0)
    record = tmp_path / "xcrun-pid"
    (tmp_path / "xcrun").write_text(f"#!/bin/sh\necho $$ > {record}\nexec sleep 60\n")
    (tmp_path / "xcrun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with anyio.fail_after(15), pytest.raises(am.CompileError, match=r"did not answer.*xcode"):
        await anyio.to_thread.run_sync(MetalCompiler("xcrun").version)
    tool = int(record.read_text())
    with anyio.fail_after(5):
        while not _dead(tool):
            await anyio.sleep(0.01)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
async def test_a_timeout_kills_a_worker_that_reads_no_long_source(
    anyio_backend: object, tmp_path: Path
) -> None:
    """A worker that reads nothing (stopped, hung) takes no more of a source than its
    input pipe holds: a timed compile of a longer one still ends at its timeout with
    the worker killed, and the same source then compiles afresh. Checked: before, the
    pool's thread stayed blocked writing it, the worker was never killed, and every
    later compile of that source joined the stuck one (here: never ended)."""
    pool = CompilePool(1, cache=CompileCache(tmp_path / "cache", disk=False))
    src = _src("long") + "/*" + "x" * (4 << 20) + "*/\n"  # far more than a pipe holds
    pid: int | None = None
    try:
        with anyio.fail_after(BOUND):
            assert await pool.compile(CCompiler(), _src("warm"))
        pid = pool._workers[0].proc.pid  # type: ignore[union-attr]
        os.kill(pid, signal.SIGSTOP)
        with anyio.fail_after(BOUND), pytest.raises(am.CompileError, match="timed out"):
            await pool.compile(CCompiler(), src, timeout=0.5)
        assert _dead(pid)
        with anyio.fail_after(BOUND / 2):
            assert await pool.compile(CCompiler(), src)
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await anyio.to_thread.run_sync(lambda: pool.shutdown(kill=True))


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
async def test_a_timeout_ends_the_compilers_and_removes_their_files(
    pool: CompilePool, tmp_path: Path
) -> None:
    record = tmp_path / "record"
    cc = tmp_path / "hanging-cc"
    cc.write_text(_HANGING_CC.replace("{record}", str(record)))
    cc.chmod(0o755)
    with anyio.fail_after(BOUND):
        assert await pool.compile(CCompiler(), _src("warm"))  # the worker is up
        with pytest.raises(am.CompileError, match="timed out"):
            await pool.compile(CCompiler(str(cc)), _src("hangs"), timeout=5)
    assert record.exists(), "the compiler had not started within the timeout"
    shell, child, out_dir, scratch = record.read_text().split()
    with anyio.move_on_after(15):
        while not (_dead(int(shell)) and _dead(int(child))):
            await anyio.sleep(0.05)
    assert _dead(int(shell)) and _dead(int(child)), "the compiler processes outlived the timeout"
    assert _existing(out_dir, scratch) == [], "the compiler's temporary files were left behind"
    with anyio.fail_after(BOUND):
        assert await pool.compile(CCompiler(), _src("after"))


async def _drain(programs: Any) -> tuple[list[str], list[str]]:
    """Every program's name and every error's first line, stepping past the errors."""
    names: list[str] = []
    errors: list[str] = []
    for _ in range(20):
        try:
            with anyio.fail_after(BOUND):
                names.append((await programs.__anext__()).name)
        except StopAsyncIteration:
            return sorted(names), errors
        except am.CompileError as exc:
            errors.append(str(exc).partition("\n")[0])
    raise AssertionError("compile_many never ended")


async def test_compile_many_goes_on_after_an_error(device: am.Device) -> None:
    tag = time.time_ns()
    kernels = [
        (f"void ok{tag}(void) {{}}", f"ok{tag}"),
        (f"void k{tag}(void) {{}}", "nowhere"),  # not defined in its source
        (f"void bad{tag}(void) {{ oops }}", f"bad{tag}"),  # does not compile
        (f"void ok2{tag}(void) {{}}", f"ok2{tag}"),
    ]
    names, errors = await _drain(device.compile_many(kernels))
    assert names == sorted([f"ok{tag}", f"ok2{tag}"])
    assert sorted(errors) == sorted(
        [
            f"kernel 'nowhere': not defined in the source; it defines 'k{tag}'",
            f"kernel 'bad{tag}': cc failed with exit code 1",
        ]
    )


async def test_compile_errors_name_their_kernel(device: am.Device) -> None:
    """Each CompileError out of compile_many says which kernel failed, in its message
    and as ``name``, and keeps the compiler's log -- also two kernels of one broken
    source, which share one compile (each gets an error of its own) -- and so does
    ``compile``'s; ``name`` and ``log`` survive pickling. Checked: the errors of a
    failed compile named no kernel before."""
    tag = time.time_ns()
    broken = f"void b1_{tag}(int* x) {{ x[0] = ; }}\nvoid b2_{tag}(int* x) {{ x[0] = 1; }}\n"
    kernels = [
        (f"void ok{tag}(void) {{}}", f"ok{tag}"),
        (broken, f"b1_{tag}"),
        (broken, f"b2_{tag}"),
        (f"void k{tag}(void) {{}}", "nowhere"),
    ]
    programs = device.compile_many(kernels)
    errors: dict[str | None, am.CompileError] = {}
    names = []
    for _ in range(len(kernels) + 1):
        try:
            with anyio.fail_after(BOUND):
                names.append((await programs.__anext__()).name)
        except StopAsyncIteration:
            break
        except am.CompileError as exc:
            errors[exc.name] = exc
    assert names == [f"ok{tag}"]
    assert sorted(errors, key=str) == sorted([f"b1_{tag}", f"b2_{tag}", "nowhere"])
    for name in (f"b1_{tag}", f"b2_{tag}"):
        exc = errors[name]
        assert str(exc).startswith(f"kernel {name!r}: cc failed with exit code 1\n")
        assert f"b1_{tag}" in exc.log and exc.log in str(exc)  # the compiler's own words
    assert errors[f"b1_{tag}"] is not errors[f"b2_{tag}"]
    assert (
        str(errors["nowhere"])
        == f"kernel 'nowhere': not defined in the source; it defines 'k{tag}'"
    )
    with pytest.raises(am.CompileError) as caught:
        await device.compile(broken, f"b2_{tag}")
    exc = caught.value
    assert exc.name == f"b2_{tag}" and str(exc).startswith(f"kernel 'b2_{tag}': cc failed")
    copy = pickle.loads(pickle.dumps(exc))
    assert (type(copy), str(copy), copy.name, copy.log) == (
        am.CompileError,
        str(exc),
        exc.name,
        exc.log,
    )


async def test_compile_many_goes_on_after_a_cancelled_step(device: am.Device) -> None:
    tag = time.time_ns()
    kernels = [(f"void a{tag}(void) {{}}", f"a{tag}"), (f"void b{tag}(void) {{}}", f"b{tag}")]
    programs = device.compile_many(kernels)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await programs.__anext__()  # cancelled while it looks in the caches
    names, errors = await _drain(programs)
    assert names == sorted([f"a{tag}", f"b{tag}"]) and errors == []


TWO_KERNELS = (
    "void put(int* out, int v) { out[0] = v; }\nvoid put2(int* out, int v) { out[0] = v + 1; }\n"
)

_DAMAGE_SCRIPT = """
import sqlite3, sys
import anyio, numpy as np
import asyncmetal as am
from asyncmetal._cache import CacheWarning, CompileCache
from asyncmetal._compile import source_key
from asyncmetal._pool import CompilePool, compiler_identity

def damage(path, expression):
    db = sqlite3.connect(path)
    tables = [row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    for table in tables:
        if "data" in [column[1] for column in db.execute(f"PRAGMA table_info({table})")]:
            db.execute(f"UPDATE {table} SET data = {expression}")
    db.commit()
    db.close()

async def main(directory, how):
    async with am.open_device("cpu") as dev:
        pool = dev.compile_pool = CompilePool(1, cache=CompileCache(directory))
        await dev.compile(sys.argv[3], "put")
        await pool.aclose()
        key = source_key(await compiler_identity(dev._backend.compiler), sys.argv[3])
        good = pool.cache._load_disk(key)
        if how.startswith("keep="):  # stored cut short, with its own checksum
            pool.cache._put_disk(key, good[: int(float(how[5:]) * len(good))])
            pool.cache.close()
        else:  # an SQL expression of the stored data
            pool.cache.close()
            damage(pool.cache.path, how)
        pool = dev.compile_pool = CompilePool(1, cache=CompileCache(directory))
        prog = await dev.compile(sys.argv[3], "put2")  # a new name: loaded from the cache
        buf = await dev.alloc(4)
        await dev.queue.launch(prog, buf, vals=(41,))
        print(int((await buf.read(np.int32))[0]))
        await buf.free()
        await pool.aclose()
        print(pool.cache._load_disk(key) == good)  # the entry was replaced
        pool.cache.close()

anyio.run(main, sys.argv[1], sys.argv[2])
"""


def _damaged_run(tmp_path: Path, how: str) -> list[str]:
    """What the damage script printed: the kernel's result (42), and whether the entry
    was stored again as it was built. In a child process: loading a damaged shared
    object can kill its process."""
    proc = subprocess.run(
        [sys.executable, "-c", _DAMAGE_SCRIPT, str(tmp_path / "cache"), how, TWO_KERNELS],
        capture_output=True,
        text=True,
        timeout=BOUND * 2,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    return proc.stdout.split()


@pytest.mark.parametrize(
    "expression",
    [
        pytest.param("randomblob(length(data))", id="garbage"),
        pytest.param("substr(data, 1, length(data) / 2)", id="truncated"),
        pytest.param("substr(data, 1, 64)", id="header-only"),
    ],
)
def test_a_damaged_cache_entry_is_rebuilt(tmp_path: Path, expression: str) -> None:
    assert _damaged_run(tmp_path, expression)[0] == "42"


@pytest.mark.parametrize("keep", [0.25, 0.5, 0.75])
def test_a_cached_binary_cut_short_under_its_own_checksum_is_rebuilt(
    tmp_path: Path, keep: float
) -> None:
    """A binary stored already cut short (its checksum taken of what was stored: a
    writer that stored a partial file, another machine sharing the directory) passes
    the entry's check; given to dlopen, the pages its segments map past the file's end
    raise SIGBUS. It is refused before loading, as a binary that does not load: rebuilt."""
    assert _damaged_run(tmp_path, f"keep={keep}") == ["42", "True"]


def _other_machine(binary: bytes) -> bytes:
    """``binary`` as if built for another architecture (its ELF e_machine changed)."""
    assert binary.startswith(b"\x7fELF")
    machine = int.from_bytes(binary[18:20], "little")
    other = 183 if machine != 183 else 62  # EM_AARCH64, else EM_X86_64
    return binary[:18] + other.to_bytes(2, "little") + binary[20:]


async def test_a_cached_binary_for_another_machine_is_rebuilt(
    device: am.Device, tmp_path: Path
) -> None:
    directory = tmp_path / "cache"
    pool = device.compile_pool = CompilePool(1, cache=CompileCache(directory))
    with anyio.fail_after(BOUND):
        await device.compile(TWO_KERNELS, "put")
        await pool.aclose()
        key = source_key(await compiler_identity(device._backend.compiler), TWO_KERNELS)
        good = pool.cache._load_disk(key)
        assert good is not None
        pool.cache._put_disk(key, _other_machine(good))  # stored as a valid entry
        pool.cache.close()
        pool = device.compile_pool = CompilePool(1, cache=CompileCache(directory))
        try:
            await _put2_runs(device)
        finally:
            await pool.aclose()
            pool.cache.close()
    rebuilt = CompileCache(directory)
    assert rebuilt._load_disk(key) == good  # the bad entry was replaced
    rebuilt.close()


async def _put2_runs(device: am.Device) -> None:
    """TWO_KERNELS' ``put2`` compiles, loads and runs on ``device`` (41 in, 42 out)."""
    prog = await device.compile(TWO_KERNELS, "put2")
    buf = await device.alloc(4)
    await device.queue.launch(prog, buf, vals=(41,))
    assert (await buf.read(np.int32))[0] == 42
    await buf.free()


def _noexec_dlopen(name: Any, *args: Any, **kwargs: Any) -> Any:
    """ctypes.CDLL as where the temporary directory is mounted noexec: a kernel library
    (written there as ``asyncmetal-*.so``) fails as glibc's dlopen fails there."""
    if isinstance(name, str) and os.path.basename(name).startswith("asyncmetal-"):
        raise OSError(f"{name}: failed to map segment from shared object")
    return _REAL_CDLL(name, *args, **kwargs)


def _noexec_mmap(*args: Any, **kwargs: Any) -> Any:
    """mmap.mmap as on a noexec file system: no mapping as code (EPERM)."""
    if kwargs.get("prot", 0) & mmap.PROT_EXEC:
        raise PermissionError(errno.EPERM, "Operation not permitted")
    return _REAL_MMAP(*args, **kwargs)


_REAL_CDLL, _REAL_MMAP = ctypes.CDLL, mmap.mmap


def _refuse_running(patch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[str, str]:
    """The temporary directory may not run code (mounted noexec), as the system refuses
    it: dlopen's "failed to map segment from shared object" and EPERM for a mapping as
    code. What the error says, and the directory it names."""
    patch.setattr(ctypes, "CDLL", _noexec_dlopen)
    patch.setattr(mmap, "mmap", _noexec_mmap)
    return "cannot run a kernel library", tempfile.gettempdir()


def _refuse_writing(patch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[str, str]:
    """No kernel library can be written to the temporary directory (missing here;
    unwritable or full alike)."""
    missing = tmp_path / "missing"
    patch.setattr(tempfile, "tempdir", str(missing))
    return "cannot write a kernel library", str(missing)


@pytest.mark.parametrize("refuse", [_refuse_running, _refuse_writing], ids=["noexec", "unwritable"])
async def test_a_temporary_directory_that_cannot_load_a_kernel_keeps_its_cache_entry(
    anyio_backend: object,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    refuse: Callable[[pytest.MonkeyPatch, Path], tuple[str, str]],
) -> None:
    """Where the temporary directory may not run code, or cannot take the kernel
    library at all, loading a kernel raises a CompileError naming the directory and
    $TMPDIR; the cached binary, not at fault, is neither evicted nor built again, and
    loads once the directory allows it. (Really mounted noexec, as root:
    test_a_noexec_temporary_directory_keeps_the_cache_entry.) Checked: fails without
    the fix (noexec: the entry was evicted and compiled again, and the error said only
    that the kernel does not load; unwritable: compiled again, the system's message)."""
    pool = CompilePool(1, cache=CompileCache(tmp_path / "cache"))
    try:
        async with am.open_device("cpu") as device:
            device.compile_pool = pool
            with anyio.fail_after(BOUND):
                await device.compile(TWO_KERNELS, "put")
                compiles = pool.compiles
                key = source_key(await compiler_identity(device._backend.compiler), TWO_KERNELS)
                with monkeypatch.context() as patch:
                    says, directory = refuse(patch, tmp_path)
                    with pytest.raises(am.CompileError) as caught:
                        await device.compile(TWO_KERNELS, "put2")
                message = str(caught.value)
                assert "'put2'" in message and says in message, message
                assert directory in message and "$TMPDIR" in message, message
                assert pool.compiles == compiles  # not built again ...
                assert await anyio.to_thread.run_sync(pool.cache._load_disk, key)  # nor evicted
                await _put2_runs(device)  # it loads now
                assert pool.compiles == compiles
    finally:
        await pool.aclose()
        pool.cache.close()


_NOEXEC_SCRIPT = """
import sys, tempfile
import anyio
sys.path.insert(0, {root!r})
import asyncmetal as am
from asyncmetal._cache import CompileCache
from asyncmetal._pool import CompilePool

async def main(cache, noexec, src):
    pool = CompilePool(1, cache=CompileCache(cache))
    try:
        async with am.open_device("cpu") as dev:
            dev.compile_pool = pool
            await dev.compile(src, "put")
            tempfile.tempdir = noexec  # (as $TMPDIR set there would)
            try:
                await dev.compile(src, "put2")
            except am.CompileError as exc:
                print("error:", str(exc).replace("\\n", " "))
            tempfile.tempdir = None
            await dev.compile(src, "put2")
            print("compiles:", pool.compiles)
    finally:
        await pool.aclose()

anyio.run(main, *sys.argv[1:])
"""


def test_a_noexec_temporary_directory_keeps_the_cache_entry(tmp_path: Path) -> None:
    """The simulated test above on a file system really mounted noexec (a tmpfs in a
    mount namespace of the script's own): its CompileError names that directory and
    $TMPDIR, and the cached binary loads from elsewhere with no compile. Needs root
    (and ``unshare``); skipped, saying so, where mounting is not allowed -- the
    simulated test covers the same path everywhere. Checked: fails without the fix."""
    if os.geteuid() != 0:
        pytest.skip("mounting a noexec tmpfs needs root (the simulated test covers this)")
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare to mount a noexec tmpfs (the simulated test covers this)")
    noexec = tmp_path / "noexec"
    noexec.mkdir()
    script = _NOEXEC_SCRIPT.format(root=str(Path(__file__).resolve().parents[2]))
    command = [sys.executable, "-c", script, str(tmp_path / "cache"), str(noexec), TWO_KERNELS]
    mounted = f"mount -t tmpfs -o noexec tmpfs {shlex.quote(str(noexec))}"
    done = subprocess.run(
        [
            unshare,
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            f"{mounted} && exec {shlex.join(command)}",
        ],
        capture_output=True,
        text=True,
        timeout=BOUND,
    )
    if done.returncode != 0 and "Traceback" not in done.stderr:
        pytest.skip(f"cannot mount a noexec tmpfs here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error:"), lines
    assert f"from {noexec}:" in lines[0] and "$TMPDIR" in lines[0], lines
    assert lines[1] == "compiles: 1", lines


_NOEXEC_RUNTIME_SCRIPT = """
import ctypes, errno, mmap, os
import anyio
import asyncmetal as am
from asyncmetal import _native

_native._packaged_candidates = lambda: []  # as where no runtime is packaged: built at first use
cache = os.environ["ASYNCMETAL_CACHE_DIR"]
real_cdll, real_mmap = ctypes.CDLL, mmap.mmap

def cdll(name, *args, **kwargs):  # as dlopen fails where the cache directory is noexec
    if isinstance(name, str) and name.startswith(cache):
        raise OSError(f"{name}: failed to map segment from shared object")
    return real_cdll(name, *args, **kwargs)

def mapped(*args, **kwargs):  # and as mapping code there fails
    if kwargs.get("prot", 0) & mmap.PROT_EXEC:
        raise PermissionError(errno.EPERM, "Operation not permitted")
    return real_mmap(*args, **kwargs)

ctypes.CDLL, mmap.mmap = cdll, mapped

async def main():
    try:
        async with am.open_device("cpu"):
            print("opened")
    except am.AsyncMetalError as exc:
        print("error:", exc)

anyio.run(main)
"""


def test_a_runtime_built_into_a_noexec_cache_directory_says_what_to_set(tmp_path: Path) -> None:
    """The native runtime, built at first use into the cache directory, cannot be loaded
    where that directory may not run code (mounted noexec: simulated as the system
    refuses it): opening the cpu device raises an AsyncMetalError naming the directory
    and $ASYNCMETAL_CACHE_DIR. Checked: fails without the fix (dlopen's OSError, which
    names neither)."""
    cache = tmp_path / "cache"
    env = dict(os.environ, ASYNCMETAL_CACHE_DIR=str(cache))
    done = subprocess.run(
        [sys.executable, "-c", _NOEXEC_RUNTIME_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=BOUND * 3,  # a first-use build compiles the runtime
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip()
    assert line.startswith("error: cannot run asyncmetal's native runtime"), line
    assert f"from {cache}:" in line and "$ASYNCMETAL_CACHE_DIR" in line, line


async def test_a_full_disk_turns_the_cache_off_with_a_warning(pool: CompilePool) -> None:
    db = pool.cache._connect()
    (pages,) = db.execute("PRAGMA page_count").fetchone()
    db.execute(f"PRAGMA max_page_count = {pages}")  # sqlite's own 'database or disk is full'
    with anyio.fail_after(BOUND):
        with pytest.warns(CacheWarning, match="full"):
            binary = await pool.compile(CCompiler(), _src("full"))
        assert binary.startswith(b"\x7fELF")
        assert not pool.cache.disk_enabled
        assert await pool.compile(CCompiler(), _src("full, again"))  # warned once


_UNWRITABLE_SCRIPT = """
import sys, warnings
import anyio, numpy as np
import asyncmetal as am
from asyncmetal import _native

if sys.argv[2] == "first-use-build":  # as where no runtime is packaged: built at first use
    _native._packaged_candidates = lambda: []

async def main():
    async with am.open_device("cpu") as dev:
        prog = await dev.compile(sys.argv[1], "put")
        buf = await dev.alloc(4)
        await dev.queue.launch(prog, buf, vals=(42,))
        print(int((await buf.read(np.int32))[0]))
        await buf.free()

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    anyio.run(main)
for warning in caught:
    print(warning.category.__name__, warning.message, file=sys.stderr)
print(sorted({warning.category.__name__ for warning in caught}))
print(_native.origin)
print(any("native runtime" in str(warning.message) for warning in caught))
"""


@pytest.mark.parametrize("runtime", ["packaged", "first-use-build"])
def test_an_unwritable_cache_directory_still_opens_the_cpu_device(
    tmp_path: Path, runtime: str
) -> None:
    """The compile cache, and the native runtime where it is built at first use (an
    install without the packaged runtime: the cache directory is where it goes), fall
    back with a CacheWarning. The checkout's editable install has the packaged runtime,
    so the build's fallback is reached only with it set aside."""
    blocker = tmp_path / "a-file"
    blocker.write_text("a regular file: nothing can be made under it, even by root")
    env = dict(os.environ, ASYNCMETAL_CACHE_DIR=str(blocker / "cache"))
    proc = subprocess.run(
        [sys.executable, "-c", _UNWRITABLE_SCRIPT, TWO_KERNELS, runtime],
        capture_output=True,
        text=True,
        env=env,
        timeout=BOUND * 3,  # a first-use build compiles the runtime
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["42", "['CacheWarning']"], proc.stderr[-3000:]
    built = runtime == "first-use-build"
    assert (lines[2] == "built at first use") is built, lines
    assert lines[3] == str(built), proc.stderr[-3000:]  # the build's own warning


async def test_killing_workers_mid_compile_fails_those_compiles_only(
    anyio_backend: object, tmp_path: Path
) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    pool = CompilePool(2, cache=CompileCache(tmp_path / "cache"))
    errors: list[str] = []

    async def doomed(tag: str) -> None:
        try:
            await pool.compile(SlowCompiler(BOUND, str(markers)), _src(tag))
        except am.CompileError as exc:
            errors.append(str(exc))

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(doomed, "first")
            tg.start_soon(doomed, "second")
            with anyio.fail_after(BOUND):
                while len(list(markers.iterdir())) < 2:  # both workers are compiling
                    await anyio.sleep(0.02)
            pids = {int(marker.name.partition("-")[0]) for marker in markers.iterdir()}
            assert len(pids) == 2
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            with anyio.fail_after(BOUND):  # the compiles end with their workers
                while len(errors) < 2:
                    await anyio.sleep(0.02)
        assert all("the compile worker died (signal SIGKILL)" in e for e in errors), errors
        # The pool replaces them and keeps compiling, both workers at once.
        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(pool.compile, CCompiler(), _src(f"after {i}"))
        assert pool.workers <= 2
    finally:
        await pool.aclose()


_SHARING_SCRIPT = """
import sys
import tempfile
import anyio, numpy as np
import asyncmetal as am

async def main():
    async with am.open_device("cpu") as dev:
        kernels = [(f"void put{i}(int* out) {{ out[0] = {i}; }}", f"put{i}") for i in range(6)]
        buf = await dev.alloc(4)
        seen = []
        async for prog in dev.compile_many(kernels):
            await dev.queue.launch(prog, buf)
            seen.append(int((await buf.read(np.int32))[0]) == int(prog.name[3:]))
        await buf.free()
        print(len(seen), all(seen))

anyio.run(main)
"""


async def test_a_cache_directory_is_the_one_named_when_the_cache_is_made(
    anyio_backend: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache directory given relative to the working directory stays there when the
    program changes directory before its first compile (a service does, as it starts),
    and a ``~`` in one (given as a str, or in ``$ASYNCMETAL_CACHE_DIR`` from an
    environment file, which no shell expanded) is the home directory. Checked: before,
    the first went to the new working directory, the second to a directory named
    ``~`` in the working directory."""
    home, start, later = tmp_path / "home", tmp_path / "start", tmp_path / "later"
    for directory in (home, start, later):
        directory.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(start)
    relative = CompileCache("relative-cache")
    tilde = CompileCache("~/tilde-cache")
    monkeypatch.setenv("ASYNCMETAL_CACHE_DIR", "~/env-cache")
    from_env = CompileCache()
    monkeypatch.chdir(later)
    for cache in (relative, tilde, from_env):
        pool = CompilePool(1, cache=cache)
        try:
            with anyio.fail_after(BOUND):
                assert await pool.compile(CCompiler(), _src("where"))
        finally:
            await pool.aclose()
            cache.close()
    assert (start / "relative-cache" / "compile-cache.sqlite").is_file()
    assert (home / "tilde-cache" / "compile-cache.sqlite").is_file()
    assert (home / "env-cache" / "compile-cache.sqlite").is_file()
    assert sorted(os.listdir(later)) == []


def test_two_processes_share_one_cache_directory_concurrently(tmp_path: Path) -> None:
    # A new directory: the two also race to build the native runtime into it.
    env = dict(os.environ, ASYNCMETAL_CACHE_DIR=str(tmp_path / "shared"))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SHARING_SCRIPT],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=BOUND * 2) for p in procs]
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, err[-3000:]
        assert out.split() == ["6", "True"], err[-3000:]


def _unusable_cache(tmp_path: Path, how: str) -> Path:
    directory = tmp_path / "cache"
    if how == "unwritable":
        blocker = tmp_path / "a-file"
        blocker.write_text("nothing can be made under a regular file, even by root")
        return blocker / "cache"
    directory.mkdir()
    path = directory / "compile-cache.sqlite"
    if how == "garbage":
        path.write_bytes(b"not a database" * 1000)
    else:  # a database whose table is not ours
        import sqlite3

        db = sqlite3.connect(path)
        db.execute("CREATE TABLE entries (key TEXT PRIMARY KEY, blob BLOB)")
        db.execute("INSERT INTO entries VALUES ('x', x'00')")
        db.commit()
        db.close()
    return directory


@pytest.mark.parametrize("how", ["unwritable", "garbage", "foreign-schema"])
async def test_an_unusable_cache_keeps_compiles_working(
    device: am.Device, tmp_path: Path, how: str
) -> None:
    pool = device.compile_pool = CompilePool(1, cache=CompileCache(_unusable_cache(tmp_path, how)))
    try:
        with anyio.fail_after(BOUND):
            with pytest.warns(CacheWarning, match="unusable"):
                prog = await device.compile(TWO_KERNELS, "put")
            buf = await device.alloc(4)
            await device.queue.launch(prog, buf, vals=(7,))
            assert (await buf.read(np.int32))[0] == 7
            await buf.free()
            assert await device.compile(TWO_KERNELS, "put2")  # warned once
            names = [p.name async for p in device.compile_many([(_src("many"), "twice")])]
            assert names == ["twice"]
        assert not pool.cache.disk_enabled
    finally:
        await pool.aclose()


_READ_ONLY_SCRIPT = """
import sys, warnings
import anyio
sys.path.insert(0, {root!r})
from asyncmetal._cache import CacheWarning, CompileCache
from asyncmetal._pool import CompilePool
from asyncmetal.backends.cpu import CCompiler

async def main():
    pool = CompilePool(1, cache=CompileCache(sys.argv[1]))
    try:
        for tag in sys.argv[2:]:
            await pool.compile(CCompiler(), "int twice(int x) {{ return 2 * x; }} // " + tag)
    finally:
        await pool.aclose()
    print(pool.compiles, pool.cache.hits_disk)

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    anyio.run(main)
for warning in caught:
    print(warning.category.__name__, warning.message)
"""


def _run_read_only(directory: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    """The script above with ``directory`` really read-only to it: by its mode where
    this is not root; as root (which ignores modes) on a read-only bind mount of it, in
    a mount namespace of the script's own (``unshare``; skipped where it cannot)."""
    script = _READ_ONLY_SCRIPT.format(root=str(Path(__file__).resolve().parents[2]))
    command = [sys.executable, "-c", script, str(directory), *args]
    if os.geteuid() != 0:
        modes = {path: path.stat().st_mode for path in [directory, *directory.iterdir()]}
        for path in modes:
            path.chmod(0o555 if path.is_dir() else 0o444)
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=BOUND)
        finally:
            for path, mode in modes.items():
                path.chmod(mode)
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("root, and no unshare to mount the cache directory read-only")
    mounted = f"mount --bind -o ro {shlex.quote(str(directory))} {shlex.quote(str(directory))}"
    shell = f"{mounted} && exec {shlex.join(command)}"
    done = subprocess.run(
        [unshare, "-m", "--propagation", "private", "sh", "-c", shell],
        capture_output=True,
        text=True,
        timeout=BOUND,
    )
    if done.returncode != 0 and "Traceback" not in done.stderr:
        pytest.skip(f"cannot mount the cache directory read-only here: {done.stderr.strip()}")
    return done


# A process that had the cache open and was killed: its WAL files stay behind.
_KILLED_WITH_THE_CACHE_OPEN = """
import os, sqlite3, sys
db = sqlite3.connect(sys.argv[1])
db.execute("PRAGMA journal_mode=WAL")
db.execute("SELECT count(*) FROM entries").fetchall()
os._exit(0)
"""


@pytest.mark.parametrize("wal_left", [False, True], ids=["closed", "wal-files-left"])
def test_a_read_only_cache_directory_is_read(tmp_path: Path, wal_left: bool) -> None:
    """A cache directory this process cannot write, its entries made earlier, still
    serves them (disk hits, no compile); a source not there compiles and is not stored;
    one CacheWarning says so -- also where a process that had it open was killed, its
    WAL files left there. Checked: before, the cache was not read at all (sqlite
    cannot make a WAL database's shared-memory file there): both sources compiled,
    with a warning that the cache was unusable; and with WAL files left, sqlite opened
    it as if writable, the new source's store failed, and the cache was turned off (a
    later source of the disk compiled) with a warning that it was unusable."""
    directory = tmp_path / "cache"  # filled first, writable
    script = _READ_ONLY_SCRIPT.format(root=str(Path(__file__).resolve().parents[2]))
    done = subprocess.run(
        [sys.executable, "-c", script, str(directory), "a", "b"],
        capture_output=True,
        text=True,
        timeout=BOUND,
    )
    assert done.returncode == 0 and done.stdout.split() == ["2", "0"], done.stderr
    if wal_left:
        database = str(directory / "compile-cache.sqlite")
        subprocess.run(
            [sys.executable, "-c", _KILLED_WITH_THE_CACHE_OPEN, database],
            check=True,
            timeout=BOUND,
        )
        assert Path(database + "-wal").exists() and Path(database + "-shm").exists()
    done = _run_read_only(directory, ["a", "new", "b"])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "1 2", lines  # a and b from the disk, new compiled
    assert len(lines) == 2 and lines[1].startswith("CacheWarning"), lines
    assert "cannot be written" in lines[1] and "not stored" in lines[1], lines


@pytest.mark.parametrize("through", ["pool.compile", "Device.compile", "compile_many"])
@pytest.mark.parametrize("warning", [CacheWarning, am.CompileWarning])
async def test_warnings_point_at_the_callers_line(
    anyio_backend: object, tmp_path: Path, through: str, warning: type[Warning]
) -> None:
    """A CacheWarning (an unusable cache) and a CompileWarning (a compiler that printed
    warnings) are reported at the line of this file that called asyncmetal, however
    deep inside the package they arose. Checked: before, a CacheWarning found on the
    cache lookup pointed into _pool.py or _device.py."""
    if warning is CacheWarning:
        cache, src = CompileCache(_unusable_cache(tmp_path, "unwritable")), _src(through)
    else:
        cache, src = CompileCache(tmp_path / "cache"), f'#warning "look"\n{_src(through)}'
    pool = CompilePool(1, cache=cache)
    try:
        async with am.open_device("cpu") as dev:
            dev.compile_pool = pool
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with anyio.fail_after(BOUND):
                    if through == "pool.compile":
                        await pool.compile(CCompiler(), src)
                    elif through == "Device.compile":
                        await dev.compile(src, "twice")
                    else:
                        assert [p.name async for p in dev.compile_many([(src, "twice")])]
    finally:
        await pool.aclose()
    assert [w.category for w in caught] == [warning], [str(w.message) for w in caught]
    assert caught[0].filename == __file__, (caught[0].filename, caught[0].lineno)


async def test_no_home_directory_compiles_without_a_disk_cache(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process with no $HOME whose user the password database does not know (a
    container run as an arbitrary uid: pathlib's own lookup fails, as here) has no
    default cache directory: compiling goes on without a disk cache, with one
    CacheWarning saying to set $ASYNCMETAL_CACHE_DIR. Checked: before, making the
    cache raised pathlib's RuntimeError, so no compile could run."""
    import pwd

    for name in ("HOME", "XDG_CACHE_HOME", "ASYNCMETAL_CACHE_DIR", "ASYNCMETAL_CACHE"):
        monkeypatch.delenv(name, raising=False)

    def unknown(uid: int) -> Any:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", unknown)
    cache = CompileCache()
    assert not cache.disk_enabled
    pool = CompilePool(1, cache=cache)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with anyio.fail_after(BOUND):
                assert await pool.compile(CCompiler(), _src("no home"))
                assert await pool.compile(CCompiler(), _src("no home, again"))
    finally:
        await pool.aclose()
    assert [w.category for w in caught] == [CacheWarning], [str(w.message) for w in caught]
    assert "set $ASYNCMETAL_CACHE_DIR" in str(caught[0].message)


async def test_a_worker_that_cannot_start_loses_no_thread_and_no_directory(
    anyio_backend: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    real_popen = subprocess.Popen

    def no_process(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EAGAIN, "no process for you")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    pool = CompilePool(1, cache=CompileCache(tmp_path / "cache"))
    try:
        pool.prestart()  # its thread tries at once, and fails
        with anyio.fail_after(BOUND):
            with pytest.raises(am.CompileError, match="no process for you"):
                await pool.compile(CCompiler(), _src("no process"))
            assert [p.name for p in scratch.iterdir() if "worker" in p.name] == []
            monkeypatch.setattr(subprocess, "Popen", real_popen)
            assert await pool.compile(CCompiler(), _src("a process"))
    finally:
        await pool.aclose()


async def test_compile_many_of_no_iterable_is_an_argument_type_error(device: am.Device) -> None:
    """What is not an iterable of kernels is refused as a bad argument is, with an
    ArgumentTypeError (an AsyncMetalError) naming what compile_many takes. Checked: fails
    without the fix (a bare TypeError of list(), "'NoneType' object is not iterable")."""
    for kernels in (None, 3, 1.5, object()):
        with pytest.raises(
            am.ArgumentTypeError,
            match=r"compile_many takes an iterable of \(src, name\) pairs, got "
            + type(kernels).__name__,
        ):
            device.compile_many(kernels)  # type: ignore[arg-type]


async def test_compile_many_refuses_a_bad_kernel_before_submitting_any(device: am.Device) -> None:
    tag = time.time_ns()
    good = (f"void g{tag}(void) {{}}", f"g{tag}")
    for bad in [(b"void k(void) {}", "k"), ("void k(void) {}",), "void k(void) {}"]:
        with pytest.raises(am.ArgumentTypeError, match=r"\(src, name\) pairs"):
            device.compile_many([good, bad])  # type: ignore[list-item]
    # Nothing was submitted: the good kernel is still a miss in every cache.
    key = source_key(await compiler_identity(device._backend.compiler), good[0])
    assert device.compile_pool.cache._get_memory(key) is None
    assert key not in device.compile_pool._in_flight


@pytest.mark.anyio
async def test_a_compile_submitted_as_a_worker_takes_another_gets_its_own_worker(
    anyio_backend: object, tmp_path: Path
) -> None:
    """A compile submitted between a worker taking a job from the queue and counting
    itself busy must still start a second worker (a slot is free): else it waits behind
    the first compile, however long that takes."""
    pool = CompilePool(2, cache=CompileCache(tmp_path / "cache", disk=False))
    slow, quick = SlowCompiler(6.0), CCompiler()
    quick_src = _src("in-the-gap")
    quick_key = source_key(await compiler_identity(quick), quick_src)
    real_get = pool._pending.get
    second: list[Any] = []

    def get(*args: Any, **kwargs: Any) -> Any:
        job = real_get(*args, **kwargs)
        if not second:  # the second compile arrives right now, in the gap
            second.append(pool._submit(quick, quick_src, quick_key))
        return job

    pool._pending.get = get  # type: ignore[method-assign]
    try:
        with anyio.fail_after(BOUND):
            first = pool._submit(slow, _src("slow"), "slow-key", timeout=4.0)
            while not second:
                await anyio.sleep(0.01)
            assert isinstance(await pool._wait(second[0]), bytes)
            # on a second worker: done while the first compile still runs
            assert first.done.value == 0
            with pytest.raises(am.CompileError, match="timed out"):
                await pool._wait(first)
    finally:
        await pool.aclose()


async def test_a_kernels_own_helper_is_called_not_a_librarys_namesake(
    anyio_backend: object,
) -> None:
    """A helper of the kernel's source named like a libc function (``truncate``) is the
    one its kernel calls. Checked: before, the call went to libc's ``truncate(path, n)``
    (an ELF shared object's calls resolve through the process's global symbols)."""
    src = (
        "int truncate(int v, int hi) { return v < hi ? v : hi; }\n"
        "void k(int* x, int n) { for (int i = 0; i < n; i++) x[i] = truncate(i, 3); }\n"
        f"/* {time.time_ns()} */"
    )
    with anyio.fail_after(BOUND):
        async with am.open_device("cpu") as device:
            k = await device.compile(src, "k")
            buf = await device.alloc(24)
            await device.queue.launch(k, buf, vals=(6,))
            assert (await buf.read(np.int32)).tolist() == [0, 1, 2, 3, 3, 3]


async def test_timed_compiles_work_with_descriptors_above_1023(
    anyio_backend: object, tmp_path: Path
) -> None:
    """A service holds over a thousand sockets: a compile with a timeout still works.
    Checked: before, the pool waited on the worker's pipe with ``select``, which refuses
    descriptors above 1023 ("filedescriptor out of range"), killing the worker."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit on open files here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    pool = CompilePool(1, cache=CompileCache(tmp_path / "cache"))
    try:
        with anyio.fail_after(BOUND):
            assert await pool.compile(CCompiler(), _src("many fds"), timeout=BOUND)
            assert await pool.compile(CCompiler(), _src("huge timeout"), timeout=1e300)
    finally:
        await pool.aclose()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize(
    "arguments",
    [
        {"max_workers": -1},
        {"max_workers": 0},
        {"idle_timeout": -1},
        {"idle_timeout": float("nan")},
        {"idle_timeout": 0},
    ],
    ids=str,
)
def test_a_pool_with_bad_arguments_is_refused(arguments: dict[str, Any]) -> None:
    """Checked: before, such a pool was made, and its compiles waited for good (no
    worker ever started, or its handler thread died of the idle timeout)."""
    with pytest.raises(am.InvalidArgumentError, match=next(iter(arguments))):
        CompilePool(**arguments)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: CompilePool(1.5), "max_workers must be an int or None"),  # type: ignore[arg-type]
        (lambda: CompilePool("2"), "max_workers must be an int or None"),  # type: ignore[arg-type]
        (lambda: CompilePool(True), "max_workers must be an int or None"),
        (lambda: CompilePool(1, idle_timeout="60"), "idle_timeout must be a number of seconds"),  # type: ignore[arg-type]
        (lambda: CompilePool(1, idle_timeout=True), "idle_timeout must be a number of seconds"),
        (lambda: CompileCache(1.5), "directory must be a str or a path"),  # type: ignore[arg-type]
        (lambda: CompileCache(b"/tmp/cache"), "directory must be a str or a path"),  # type: ignore[arg-type]
    ],
    ids=[
        "workers float",
        "workers str",
        "workers bool",
        "idle str",
        "idle bool",
        "dir float",
        "dir bytes",
    ],
)
async def test_a_pool_or_cache_given_the_wrong_types_raises_argument_type_errors(
    make: Callable[[], object], match: str
) -> None:
    """A CompilePool's or CompileCache's argument of the wrong type is an
    ArgumentTypeError (a TypeError) naming it and what it takes, as such arguments
    elsewhere are. Checked: fails without the fix (an InvalidArgumentError -- a
    ValueError -- for the pool's, os.fspath's or str.startswith's bare TypeError for
    the cache's directory)."""
    with pytest.raises(am.ArgumentTypeError, match=match):
        make()


async def test_a_pools_flags_that_are_no_bools_are_refused(tmp_path: Path) -> None:
    """``CompilePool.compile``'s ``refresh`` and ``shutdown``'s ``kill`` take a bool:
    anything else (a string "no", which is true) is an ArgumentTypeError, nothing
    evicted, compiled or killed. Checked: fails without the fix (refresh="no" compiled
    the cached source again; kill="no" shut the pool down)."""
    pool = CompilePool(1, cache=CompileCache(tmp_path, disk=False))
    try:
        src = _src("flags")
        await pool.compile(CCompiler(), src)
        compiled = pool.compiles
        with pytest.raises(am.ArgumentTypeError, match="refresh must be a bool, got str"):
            await pool.compile(CCompiler(), src, refresh="no")  # type: ignore[arg-type]
        with pytest.raises(am.ArgumentTypeError, match="kill must be a bool, got str"):
            pool.shutdown(kill="no")  # type: ignore[arg-type]
        assert await pool.compile(CCompiler(), src)  # from the cache, the pool still open
        assert pool.compiles == compiled
    finally:
        await pool.aclose()


@pytest.mark.parametrize("cache", ["compile-cache", CompileCache], ids=["a path", "the class"])
def test_a_pool_given_no_cache_for_its_cache_is_refused(cache: object) -> None:
    """Checked: before, such a pool was made, and each of its compiles raised an
    AttributeError or TypeError of the cache's internals."""
    with pytest.raises(am.ArgumentTypeError, match="cache must be a CompileCache"):
        CompilePool(1, cache=cache)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("compiler", "src", "error", "match"),
    [
        (CCompiler(), b"int f(void) { return 1; }", am.ArgumentTypeError, "src must be a str"),
        (CCompiler, "int f(void) { return 1; }", am.ArgumentTypeError, r"make one, CCompiler\(\)"),
        ("cc", "int f(void) { return 1; }", am.ArgumentTypeError, "must be a Compiler"),
        (CCompiler(), "int f(void) { return 1; } // \udce9", am.InvalidArgumentError, "encodable"),
    ],
    ids=["bytes", "a class", "a str", "a lone surrogate"],
)
async def test_a_pools_compile_refuses_bad_arguments_before_submitting(
    pool: CompilePool, compiler: object, src: object, error: type[Exception], match: str
) -> None:
    """``CompilePool.compile`` names a bad compiler or source at once, and submits
    nothing. Checked: before, a bytes source went to a worker and came back as "error:
    AttributeError: 'bytes' object has no attribute 'encode'", a compiler class raised
    a bare TypeError, and a lone surrogate a UnicodeEncodeError."""
    with anyio.fail_after(BOUND), pytest.raises(error, match=match):
        await pool.compile(compiler, src)  # type: ignore[arg-type]
    assert pool.compiles == 0 and pool.workers == 0


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({"max_memory_bytes": None}, am.ArgumentTypeError),
        ({"max_memory_bytes": "1"}, am.ArgumentTypeError),
        ({"max_memory_bytes": 1.5}, am.ArgumentTypeError),
        ({"max_memory_bytes": -1}, am.InvalidArgumentError),
        ({"disk": "off"}, am.ArgumentTypeError),
    ],
    ids=str,
)
def test_a_cache_with_bad_arguments_is_refused(
    arguments: dict[str, Any], error: type[Exception], tmp_path: Path
) -> None:
    """Checked: before, such a cache was made (``disk="off"`` kept the disk on), and the
    first compile into it waited for good: its handler thread died storing the binary."""
    with pytest.raises(error, match=next(iter(arguments))):
        CompileCache(tmp_path, **arguments)


async def test_a_binary_that_cannot_be_cached_still_reaches_its_callers(
    pool: CompilePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Storing a binary that fails (memory short, a limit set to nonsense since) leaves
    it uncached; its compile's callers get it all the same, and the pool goes on.
    Checked: before, the handler thread died of it and the compile never ended."""

    def refuse(key: str, data: bytes) -> None:
        raise MemoryError("no room")

    monkeypatch.setattr(pool.cache, "_put_memory", refuse)
    for tag in ("first", "second"):
        with anyio.fail_after(BOUND):
            assert await pool.compile(CCompiler(), _src(tag))
    assert pool.compiles == 2


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (("void b(int* x) {}", ""), "kernel 1: the kernel's name is empty"),
        (("void b(int* x) {} // caf\udce9", "b"), "kernel 1: the source of 'b' is not encodable"),
    ],
    ids=["empty name", "lone surrogate"],
)
async def test_compile_many_refuses_a_bad_kernel_before_compiling_any(
    device: am.Device, bad: tuple[str, str], match: str
) -> None:
    """Checked: before, the list was accepted, and every step raised the bad kernel's
    error for good (the good kernels never came)."""
    good = f"void a(int* x) {{ x[0] = 1; }} /* {time.time_ns()} */"
    kernels = [(good, "a"), bad, (good, "a")]
    with pytest.raises(am.InvalidArgumentError, match=match):
        device.compile_many(kernels)
    with pytest.raises(am.InvalidArgumentError, match="not encodable"):
        await device.compile("void b(int* x) {} // caf\udce9", "b")


async def test_kernel_parameters_are_read_as_the_compiler_sees_them(anyio_backend: object) -> None:
    """A kernel's parameter kinds come from its source before preprocessing. Checked:
    before, ``//`` inside a string literal hid the kernel ("not defined"); a typedef'd
    or macro pointer type was taken for a value (the launch passed the buffer's address
    as an int and the value as a pointer: memory corruption, or SIGSEGV); and of two
    ``#if`` branches defining the kernel differently, the first was used, the compiled
    one being the other."""
    tag = time.time_ns()
    fill = "{ for (int i = 0; i < n; i++) x[i] = i; }"
    async with am.open_device("cpu") as device:
        buf = await device.alloc(16)
        for src in (
            f'static const char* origin = "https://example.org/{tag}"; '
            f"void k(int* x, int n) {fill}",
            f"typedef int *ints; /* {tag} */ void k(ints x, int n) {fill}",
            f"#define INTS int *\n/* {tag} */ void k(INTS x, int n) {fill}",
        ):
            await buf.write(np.full(4, -1, np.int32))
            with anyio.fail_after(BOUND):
                k = await device.compile(src, "k")
                await device.queue.launch(k, buf, vals=(4,))
                assert (await buf.read(np.int32)).tolist() == [0, 1, 2, 3], src
        two = (
            f"#ifdef OLD_API\nvoid k(int n, int* x) {fill}\n#else\n"
            f"void k(int* x, int n) {fill}\n#endif\n/* {tag} */"
        )
        with pytest.raises(am.CompileError, match="defined more than once"):
            await device.compile(two, "k")


_EXIT_WITH_COMPILES = """
import sys, time, anyio
sys.path.insert(0, {root!r})
from asyncmetal._pool import CompilePool
from asyncmetal._cache import CompileCache
from tests.reliability.test_fork import _FORK_HOLDING
from tests.support.compilers import GatedCompiler, SlowCompiler, gate_name
async def main():
    pools = [CompilePool(2, cache=CompileCache({cache!r})) for _ in range(2)]
    async with anyio.create_task_group() as tg:
        for i in range(4):
            src = "int f%d(void) {{ return %d; }}" % (i, time.time_ns() % 1000)
            tg.start_soon(pools[i % 2].compile, SlowCompiler(30), src)
        await anyio.sleep(3)  # the workers compile
        print(" ".join(str(w.proc.pid) for p in pools for w in p._workers if w.proc), flush=True)
        tg.cancel_scope.cancel()
anyio.run(main)
"""


# A process whose pool's worker is up (and, with "compiling", on a slow compile) says
# the worker's pid and temporary directory, then waits to be killed.
_KILLED_WITH_A_WORKER = """
import sys, threading, time, anyio
sys.path.insert(0, {root!r})
from asyncmetal._cache import CompileCache
from asyncmetal._pool import CompilePool
from asyncmetal.backends.cpu import CCompiler
from tests.reliability.test_fork import _FORK_HOLDING
from tests.support.compilers import GatedCompiler, SlowCompiler, gate_name
pool = CompilePool(1, cache=CompileCache({cache!r}))
assert anyio.run(pool.compile, CCompiler(), "int twice(int x) {{ return 2 * x; }}")
worker = pool._workers[0]
if {compiling!r}:
    slow = SlowCompiler(1.0)
    threading.Thread(target=anyio.run, args=(pool.compile, slow, "int f(void) {{ return 1; }}"),
                     daemon=True).start()
    while worker.proc is None or not pool._in_flight:
        time.sleep(0.01)
print(worker.proc.pid, worker.tmpdir, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("compiling", [False, True], ids=["idle", "compiling"])
def test_a_worker_whose_pools_process_is_killed_removes_its_temporary_directory(
    tmp_path: Path, compiling: bool
) -> None:
    """A process killed (SIGKILL: no exit handler runs) while its pool's worker is idle,
    or compiling: the worker ends (its input ends, or its reply is refused) and its
    temporary directory goes with it. Checked: before, the worker ended and left its
    directory behind for good."""
    script = _KILLED_WITH_A_WORKER.format(
        root=str(Path(__file__).resolve().parents[2]),
        cache=str(tmp_path / "cache"),
        compiling=compiling,
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid, directory = parent.stdout.readline().split()
        assert os.path.isdir(directory)
    finally:
        parent.kill()
        parent.wait(BOUND)
        if parent.stdout is not None:
            parent.stdout.close()
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            break
        time.sleep(0.02)
    else:
        os.kill(int(pid), signal.SIGKILL)
        pytest.fail("the worker outlived its pool's process")
    while os.path.exists(directory) and time.monotonic() < deadline:
        time.sleep(0.02)  # (removed as the worker exits: a moment before it is gone)
    assert not os.path.exists(directory)


def test_exit_with_compiles_in_flight_kills_them_at_once(tmp_path: Path) -> None:
    """A process exits while its pools (the default one and those made by hand) compile:
    it exits at once, its workers and their temporary directories gone. Checked: before,
    the exit joined each busy worker for up to 10 s in turn, and left the workers (and
    every hand-made pool's directory) behind."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    script = _EXIT_WITH_COMPILES.format(
        root=str(Path(__file__).resolve().parents[2]), cache=str(tmp_path / "cache")
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=BOUND,
        env={**os.environ, "TMPDIR": str(scratch)},
        check=False,
    )
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 4
    assert took < 3 + 6, f"the exit took {took - 3:.1f} s"
    assert all(_dead(pid) for pid in pids), "workers outlived the exit"
    assert list(scratch.iterdir()) == [], "temporary directories were left behind"


_FORK_WITH_A_POOL = """
import os, sys, time, anyio
sys.path.insert(0, {root!r})
import asyncmetal as am
from asyncmetal._pool import CompilePool
from asyncmetal._cache import CompileCache
from asyncmetal.backends.cpu import CCompiler
def src(tag):
    return "int twice(int x) {{ return 2 * x; }} /* %s %d */" % (tag, time.time_ns())
pool = CompilePool(1, cache=CompileCache({cache!r}))
assert anyio.run(pool.compile, CCompiler(), src("parent"))  # its worker is up
pid = os.fork()
if pid == 0:  # the child
    code = 1
    try:
        anyio.run(pool.compile, CCompiler(), src("child"))
    except am.ClosedResourceError as exc:
        code = 0 if "before the fork" in str(exc) else 3
    except BaseException:
        code = 2
    os._exit(code)
deadline = time.monotonic() + 30
while (status := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
    time.sleep(0.05)
if status[0] == 0:
    os.kill(pid, 9)
    sys.exit("the child's compile hung")
assert os.waitstatus_to_exitcode(status[1]) == 0, status
assert anyio.run(pool.compile, CCompiler(), src("parent again"))  # still works
anyio.run(pool.aclose)
print("ok")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_pool_made_before_a_fork_is_refused_in_the_child(tmp_path: Path) -> None:
    """A forked child has none of a pool's threads, and its workers are the parent's: a
    compile there is refused at once, and the parent's pool goes on. (In a fresh
    interpreter, as tests/reliability/test_fork.py's: this one's threads are not all
    asyncmetal's.) Checked: before, the child's compile waited for good (only the
    default pool was reset at fork)."""
    script = _FORK_WITH_A_POOL.format(
        root=str(Path(__file__).resolve().parents[2]), cache=str(tmp_path / "cache")
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=BOUND
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


_FORK_AS_A_CACHE_STORES = (
    _FORK_HOLDING
    + """
import os, sys, time, anyio
sys.path.insert(0, {root!r})
from asyncmetal._pool import CompilePool
from asyncmetal._cache import CompileCache
from asyncmetal.backends.cpu import CCompiler
def src(tag):
    return "int twice(int x) {{ return 2 * x; }} /* %s %d */" % (tag, time.time_ns())
cache = CompileCache({cache!r})
async def compile_once(tag):
    pool = CompilePool(1, cache=cache)
    try:
        return await pool.compile(CCompiler(), src(tag))
    finally:
        await pool.aclose()
assert anyio.run(compile_once, "parent")  # its database is open
# A thread of the parent stores a binary as the fork comes (one waiting for another
# process's lock on the database holds the cache's lock up to 10 s); the child compiles
# with the cache made before the fork.
status = fork_holding(
    cache._db_lock, lambda: os._exit(0 if anyio.run(compile_once, "child") else 1)
)
assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
assert anyio.run(compile_once, "parent again")
print("ok")
"""
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_cache_made_before_a_fork_compiles_in_the_child(tmp_path: Path) -> None:
    """A forked child may compile into a cache made before the fork (a pool made in
    the child takes it): its locks are the child's own, with a database connection of
    its own, whatever a thread of the parent was doing with them at the fork. Checked:
    before, the child's compile waited for good for the lock a thread of the parent,
    not there, held."""
    script = _FORK_AS_A_CACHE_STORES.format(
        root=str(Path(__file__).resolve().parents[2]), cache=str(tmp_path / "cache")
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=BOUND
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


# What both fork scripts begin with: a fork whose child lives on until the parent
# closes ``release`` (returned with the child's pid).
_FORK_HEAD = """
import os, subprocess, sys, anyio
sys.path.insert(0, {root!r})
import asyncmetal as am
from asyncmetal._pool import CompilePool
from asyncmetal._cache import CompileCache
from asyncmetal.backends.cpu import CCompiler
def fork_held():
    held, release = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(release)
        os.read(held, 1)
        os._exit(0)
    os.close(held)
    return pid, release
"""

_FORK_THEN_CLOSE = (
    _FORK_HEAD
    + """
pool = CompilePool(1, cache=CompileCache({cache!r}))
assert anyio.run(pool.compile, CCompiler(), "int twice(int x) {{ return 2 * x; }}")
worker = pool._workers[0].proc  # up, waiting for its next job
pid, release = fork_held()
anyio.run(pool.aclose)
os.close(release)
os.waitpid(pid, 0)
print(worker.returncode)
"""
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_hold_the_parents_workers_open(tmp_path: Path) -> None:
    """A child forked while a pool's worker waits for work gets none of the worker's
    pipes: closing the pool in the parent ends the worker by its end of input (exit
    code 0), while the child lives. Checked: before, the child's copy of the worker's
    input kept it waiting, and the parent's close waited 5 s for it, then killed it
    (SIGKILL: -9)."""
    assert _worker_exit(_FORK_THEN_CLOSE, tmp_path) == "0", "it did not end by its input's end"


# The fork comes as the worker's process has started and before the pool knows it (its
# pipes are open, worker.proc still unset): as another thread's fork may.
_FORK_AS_A_WORKER_STARTS = (
    _FORK_HEAD
    + """
real, forked, workers = subprocess.Popen, [], []
def popen(*args, **kwargs):
    proc = real(*args, **kwargs)
    if "asyncmetal._worker" not in args[0]:  # (the compiler's own runs)
        return proc
    workers.append(proc)
    if not forked:
        forked.append(fork_held())
    return proc
subprocess.Popen = popen
pool = CompilePool(1, cache=CompileCache({cache!r}))
assert anyio.run(pool.compile, CCompiler(), "int twice(int x) {{ return 2 * x; }}")
subprocess.Popen = real
anyio.run(pool.aclose)
pid, release = forked[0]
os.close(release)
os.waitpid(pid, 0)
print(workers[0].returncode)
"""
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_as_a_worker_starts_does_not_hold_it_open(tmp_path: Path) -> None:
    """A child forked after a worker's process started but before the pool recorded it
    (so the at-fork handler cannot point its pipes at /dev/null) holds a copy of the
    worker's input: closing the pool still ends the worker by its word to stop (exit
    code 0), not after 5 s by SIGKILL. Checked: before, the worker waited for its
    input's end, which the child's copy held off, and was killed (-9)."""
    assert _worker_exit(_FORK_AS_A_WORKER_STARTS, tmp_path) == "0", "not by its word to stop"


# Another thread forks while the pool's thread is inside subprocess.Popen starting a
# worker (the hook: Popen's call that starts the process, when every pipe of it is open,
# among them the one on which Popen then waits for the exec). The hook holds the start
# until the fork has happened -- or until the forking thread waits in the pool's
# before-fork handler, which lets the start finish first. That handler is the pool's
# lock's own acquire, C code: so the lock is made (as asyncmetal is imported) as one
# whose acquire is Python code, seen in the waiting thread's frames.
_FORK_IN_POPEN = (
    """
import threading
rlock = threading.RLock
class Seen:
    def __init__(self):
        self.lock = rlock()
    def acquire(self, blocking=True, timeout=-1):
        return self.lock.acquire(blocking, timeout)
    def release(self):
        self.lock.release()
    def __enter__(self):
        return self.acquire()
    def __exit__(self, *exc):
        self.release()
    def _is_owned(self):
        return self.lock._is_owned()
    def _at_fork_reinit(self):
        self.lock._at_fork_reinit()
threading.RLock = Seen
"""
    + _FORK_HEAD
    + """
threading.RLock = rlock
import time
from asyncmetal import _pool
assert isinstance(_pool._starting, Seen)
forking, forked, started = threading.Event(), threading.Event(), threading.Event()
os.register_at_fork(before=forking.set, after_in_parent=forked.set)
main = threading.main_thread().ident
def fork_waits_for_the_pool():
    frame = sys._current_frames().get(main)
    while frame is not None:
        if frame.f_code.co_name == "acquire" and frame.f_locals.get("self") is _pool._starting:
            return True
        frame = frame.f_back
    return False
real = subprocess._fork_exec
def fork_exec(*args):
    if "asyncmetal._worker" in repr(args[0]):
        started.set()
        forking.wait()
        while not forked.is_set() and not fork_waits_for_the_pool():
            time.sleep(0.001)
    return real(*args)
subprocess._fork_exec = fork_exec
pool = CompilePool(1, cache=CompileCache({cache!r}))
pool.prestart()
started.wait()
pid, release = fork_held()
subprocess._fork_exec = real
began = time.monotonic()
pool.shutdown()
took = time.monotonic() - began
os.close(release)
os.waitpid(pid, 0)
print(pool.workers, "workers left after", round(took, 1), "s")
"""
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.skipif(not hasattr(subprocess, "_fork_exec"), reason="hooks subprocess._fork_exec")
def test_a_fork_as_a_worker_process_starts_waits_for_the_start(tmp_path: Path) -> None:
    """A fork from another thread while the pool's thread is in subprocess.Popen starting
    a worker waits until the process has started and is recorded: the child gets none
    of its pipes, and closing the pool ends the worker at once. Checked: before, the
    child held a copy of the pipe on which Popen waits for the exec, so the pool's
    thread stayed in Popen for the child's life (a compile waited all that time), and
    the close gave up on it after SHUTDOWN_JOIN_S (10 s), the worker left behind."""
    code = _FORK_IN_POPEN.format(
        root=str(Path(__file__).resolve().parents[2]), cache=str(tmp_path / "cache")
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=BOUND
    )
    assert done.returncode == 0, done.stderr
    left, took = done.stdout.split()[0], float(done.stdout.split()[-2])
    assert left == "0" and took < 5, done.stdout


def _worker_exit(script: str, tmp_path: Path) -> str:
    """Run one of the fork scripts above in a process of its own; return what it printed:
    the worker's exit code."""
    code = script.format(
        root=str(Path(__file__).resolve().parents[2]), cache=str(tmp_path / "cache")
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=BOUND
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("first", ["timed", "untimed"])
async def test_a_joined_compile_keeps_each_callers_own_timeout(
    pool: CompilePool, first: str
) -> None:
    """Two callers compile one source (3 s), one with a 1 s timeout, the other with
    none, in either order: the timed one raises after its second; the other gets the
    binary. Checked: before, the job kept the first caller's timeout, so the untimed
    caller failed with it, or the timed one waited the whole 3 s and succeeded."""
    src = _src(f"joined {first}")
    outcome: dict[str, object] = {}

    async def compile_with(name: str, timeout: float | None) -> None:
        try:
            outcome[name] = await pool.compile(SlowCompiler(3), src, timeout=timeout)
        except am.CompileError as exc:
            outcome[name] = exc
            # The job still runs for the other (it ends, and leaves, once compiled).
            outcome[name + " in flight"] = bool(pool._in_flight)

    callers = [("timed", 1.0), ("untimed", None)]
    if first == "untimed":
        callers.reverse()
    with anyio.fail_after(BOUND):
        async with anyio.create_task_group() as tg:
            for name, timeout in callers:
                tg.start_soon(compile_with, name, timeout)
                while not pool._in_flight:  # the second joins the first's job
                    await anyio.sleep(0.001)
    assert isinstance(outcome["untimed"], bytes), outcome["untimed"]
    assert isinstance(outcome["timed"], am.CompileError), outcome["timed"]
    assert "timed out after 1.0 s" in str(outcome["timed"])
    assert outcome["timed in flight"], "the timed caller waited for the job to end"


async def test_a_compile_that_waited_for_a_worker_times_out_in_its_own_time(
    pool: CompilePool, tmp_path: Path
) -> None:
    """A timed compile that waits for the one worker (busy with another compile for
    about half its timeout) and then starts, never to finish, raises within its timeout
    plus TIMEOUT_GRACE_S (asserted with a second's margin): its timeout runs from the
    call. Checked: before, the worker timed it from the start, so it raised after about
    one and a half timeouts (4.5 s here)."""
    timeout = 3.0
    markers = tmp_path / "markers"
    markers.mkdir()
    outcome: list[object] = []

    async def timed() -> None:
        began = time.monotonic()
        with pytest.raises(am.CompileError, match="timed out") as caught:
            await pool.compile(SlowCompiler(BOUND, str(markers)), _src("hangs"), timeout=timeout)
        outcome.extend([time.monotonic() - began, caught.value])

    with anyio.fail_after(BOUND):
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.compile, SlowCompiler(timeout / 2, str(markers)), _src("busy"))
            while not list(markers.iterdir()):  # the worker is on the first compile
                await anyio.sleep(0.01)
            tg.start_soon(timed)
    took = outcome[0]
    assert len(list(markers.iterdir())) == 2, "the timed compile did not start"
    assert isinstance(took, float) and took < timeout + 1, f"raised after {took:.1f} s"


async def test_a_compiler_returning_no_binary_is_a_compile_error(pool: CompilePool) -> None:
    """A custom compiler whose compile returns a str, not bytes, fails the compile with
    a CompileError saying so; one whose _last_log is not a str still gives its binary,
    the log as text in the CompileWarning. Checked: before, the str came back as the
    "binary", and the log's .strip() raised AttributeError in the caller."""
    from tests.support.compilers import WrongTypeCompiler

    with anyio.fail_after(BOUND):
        with pytest.raises(am.CompileError, match="returned str, not bytes"):
            await pool.compile(WrongTypeCompiler("binary"), _src("str"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            binary = await pool.compile(WrongTypeCompiler("log"), _src("log"))
    assert isinstance(binary, bytes) and binary
    assert [w.category for w in caught] == [am.CompileWarning]
    assert caught[0].message.log == "42"  # type: ignore[union-attr]


@pytest.mark.anyio
async def test_compiler_identities_are_kept_for_the_most_recently_used_only(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each set of options makes a compiler of its own: ever new options (a ``-DN=``
    per request) keep no identity for good, while one in use stays, and one that
    went is found again alike."""
    from asyncmetal import _pool

    monkeypatch.setattr(_pool, "IDENTITIES_KEPT", 8, raising=False)
    base = CCompiler()
    used = base._with_options(("-DUSED=1",))
    first = await compiler_identity(used)
    for n in range(40):
        await compiler_identity(base._with_options((f"-DN={n}",)))
        assert await compiler_identity(used) == first  # (used again: kept)
        assert len(_pool._identities) <= 8
    assert used in _pool._identities
    gone = base._with_options(("-DN=0",))
    assert gone not in _pool._identities
    assert await compiler_identity(gone) == gone._identity()


async def test_compile_many_times_out_joining_a_compile_without_one(
    anyio_backend: object, tmp_path: Path
) -> None:
    """A compile_many's timeout is its caller's own, as compile()'s is: a kernel joining
    a compile another caller started without a timeout raises "timed out" while that
    compile goes on. Checked: before, the step waited for the joined compile to end
    (here: not within the test)."""
    pool = CompilePool(1, cache=CompileCache(tmp_path / "cache", disk=False))
    src = f"void k(int* x) {{ x[0] = 1; }}\n/* {time.time_ns()} */\n"
    try:
        with anyio.fail_after(BOUND):
            async with am.open_device("cpu") as device:
                device.compile_pool = pool
                device._backend._compiler = SlowCompiler(BOUND * 2)  # type: ignore[attr-defined]
                async with anyio.create_task_group() as tg:
                    tg.start_soon(device.compile, src, "k")  # no timeout
                    while not pool._in_flight:
                        await anyio.sleep(0.001)
                    (job,) = pool._in_flight.values()
                    with pytest.raises(am.CompileError, match=r"timed out after 0\.5 s") as caught:
                        async for _ in device.compile_many([(src, "k")], timeout=0.5):
                            pass
                    assert caught.value.name == "k"
                    assert not job.done.value, "the other caller's compile was ended"
                    tg.cancel_scope.cancel()
    finally:
        await anyio.to_thread.run_sync(lambda: pool.shutdown(kill=True))


def test_a_closed_pool_refuses_to_prestart(tmp_path: Path) -> None:
    """prestart on a closed pool is refused, as a compile is. Checked: before, it
    started workers that no close would stop (the exit skips a closed pool), whose
    temporary directories outlived the process."""
    pool = CompilePool(2, cache=CompileCache(tmp_path / "cache", disk=False))
    pool.shutdown()
    with pytest.raises(am.ClosedResourceError, match="closed"):
        pool.prestart()
    assert pool.workers == 0


@pytest.mark.anyio
async def test_a_compile_submitted_as_the_pool_shuts_down_is_refused(
    anyio_backend: object, tmp_path: Path
) -> None:
    """A compile whose submission is under way when a shutdown on another thread
    (aclose's) closes the pool is refused, not queued behind the workers' stops.
    Checked: before, its job was queued with no worker left to run it, and the compile
    waited for good."""
    pool = CompilePool(1, cache=CompileCache(tmp_path / "cache", disk=False))
    with anyio.fail_after(BOUND):
        assert await pool.compile(CCompiler(), _src("up"))  # a worker waits for work
    real_lock = pool._lock
    arm = threading.Event()

    class ShutdownFirst:
        """The pool's lock; armed, the next taker on this thread lets a shutdown on
        another thread run to its end first."""

        def __enter__(self) -> bool:
            if arm.is_set() and threading.current_thread() is main:
                arm.clear()
                closing = threading.Thread(target=pool.shutdown)
                closing.start()
                closing.join(BOUND)
            return real_lock.__enter__()

        def __exit__(self, *exc: object) -> None:
            real_lock.__exit__(*exc)

    main = threading.current_thread()
    pool._lock = ShutdownFirst()  # type: ignore[assignment]
    try:
        arm.set()
        with anyio.fail_after(BOUND), pytest.raises(am.ClosedResourceError, match="closed"):
            await pool.compile(CCompiler(), _src("during shutdown"))
    finally:
        pool._lock = real_lock
        pool.shutdown()


async def test_a_close_refuses_the_compiles_not_started_and_lets_the_running_one_finish(
    anyio_backend: object, tmp_path: Path
) -> None:
    """A close refuses at once the compiles still queued -- their callers get
    ClosedResourceError, and they never start -- while the one running finishes with
    its binary, and the close returns once it has. Checked: fails without the fix
    (the close ran every queued compile first: the queued caller waited behind the
    running compile, held at its gate, past its bound)."""
    gates = tmp_path / "gates"
    gates.mkdir()
    pool = CompilePool(1, cache=CompileCache(tmp_path / "cache", disk=False))
    compiler = GatedCompiler(str(gates))
    running, queued = _src("running"), _src("queued")
    binaries: list[bytes] = []
    closed = anyio.Event()

    async def compile_running() -> None:
        binaries.append(await pool.compile(compiler, running))

    async def close() -> None:
        await pool.aclose()
        closed.set()

    try:
        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tg:
                tg.start_soon(compile_running)
                while not (gates / f"{gate_name(running)}.began").exists():
                    await anyio.sleep(0.01)  # (another process) the one worker is on it
                key = source_key(await compiler_identity(compiler), queued)
                job = pool._submit(compiler, queued, key)  # queued behind it
                tg.start_soon(close)
                # (Well within SHUTDOWN_JOIN_S, which the close waits for the running one.)
                with anyio.fail_after(5), pytest.raises(am.ClosedResourceError, match="closed"):
                    await pool._wait(job)
                assert not closed.is_set()  # the running compile is still held
                (gates / gate_name(running)).touch()
                await closed.wait()
        assert len(binaries) == 1 and binaries[0].startswith(b"\x7fELF")
        assert not (gates / f"{gate_name(queued)}.began").exists()
        assert pool.compiles == 1 and pool.workers == 0
    finally:
        for src in (running, queued):  # (a test failed before opening them)
            (gates / gate_name(src)).touch()
        await anyio.to_thread.run_sync(lambda: pool.shutdown(kill=True))


async def test_a_compile_a_worker_takes_as_its_pool_closes_is_refused(
    anyio_backend: object, tmp_path: Path
) -> None:
    """A job a worker took from the queue just before a close emptied it is refused by
    that worker (ClosedResourceError), not started. Checked: fails without the fix (it
    was compiled)."""
    pool = CompilePool(1, cache=CompileCache(tmp_path / "cache", disk=False))
    compiler, src = CCompiler(), _src("taken as closed")
    key = source_key(await compiler_identity(compiler), src)
    pending = pool._pending
    real_get, real_get_nowait = pending.get, pending.get_nowait
    draining = threading.Event()
    closers: list[threading.Thread] = []

    def get_nowait() -> Any:  # the close empties the queue, the pool closed already
        draining.set()
        return real_get_nowait()

    def get(*args: Any, **kwargs: Any) -> Any:
        job = real_get(*args, **kwargs)
        if getattr(job, "key", None) == key:  # taken, not yet decided about: close now
            closers.append(threading.Thread(target=pool.shutdown))
            closers[0].start()
            draining.wait(BOUND / 4)
        return job

    pending.get = get  # type: ignore[method-assign]
    pending.get_nowait = get_nowait  # type: ignore[method-assign]
    try:
        job = pool._submit(compiler, src, key)
        with anyio.fail_after(BOUND), pytest.raises(am.ClosedResourceError, match="closed"):
            await pool._wait(job)
        assert pool.compiles == 0
    finally:
        draining.set()
        await anyio.to_thread.run_sync(lambda: pool.shutdown(kill=True))
        for closer in closers:
            await anyio.to_thread.run_sync(closer.join, BOUND)


async def test_a_timed_out_caller_waiting_for_its_compiles_end_is_not_held_by_a_joiner(
    anyio_backend: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller whose timeout passed while its compile ran waits for the worker to end
    the compile at that same timeout; a caller joining meanwhile without a timeout lets
    the compile go on, and the first then raises "timed out" at once. Checked: before,
    it went on waiting for the compile's end (here: its gate, never opened)."""
    from asyncmetal import _pool
    from tests.support.compilers import GatedCompiler

    pool = CompilePool(1, cache=CompileCache(tmp_path / "cache", disk=False))
    compiler, src = GatedCompiler(str(tmp_path)), _src("gated")
    key = source_key(await compiler_identity(compiler), src)
    started, joined = threading.Event(), threading.Event()
    real = _pool._replies_in_time

    def held(pipe: Any, job: Any) -> bool:  # the worker ends nothing before the join
        started.set()
        joined.wait(BOUND)
        return real(pipe, job)

    monkeypatch.setattr(_pool, "_replies_in_time", held)
    outcome: list[object] = []

    async def first() -> None:
        try:
            outcome.append(await pool.compile(compiler, src, timeout=1.0))
        except am.CompileError as exc:
            outcome.append(exc)

    try:
        with anyio.fail_after(BOUND / 2):
            async with anyio.create_task_group() as tg:
                submitted = anyio.current_time()
                tg.start_soon(first)
                while not started.is_set():
                    await anyio.sleep(0.01)
                # Past the first caller's timeout (its timer, due first, has fired).
                await anyio.sleep_until(submitted + 1.5)
                pool._submit(compiler, src, key)  # joins, with no timeout
                joined.set()
        assert isinstance(outcome[0], am.CompileError), outcome
        assert "timed out after 1.0 s" in str(outcome[0])
    finally:
        joined.set()
        await anyio.to_thread.run_sync(lambda: pool.shutdown(kill=True))


async def test_a_cancelled_caller_without_a_timeout_gives_the_compile_its_timeout_back(
    anyio_backend: object, tmp_path: Path
) -> None:
    """A caller with no timeout joins a timed compile (its compiler never ends) and is
    cancelled: the compile has the first caller's timeout again, so its worker kills it
    then, and the first caller's "timed out" comes once it is ended. Checked: before,
    the cancelled caller's lifting of the timeout stayed, and the worker went on with
    the compile nobody awaited (here: until its gate's wait ran out)."""
    from tests.support.compilers import GatedCompiler, gate_name

    pool = CompilePool(1, cache=CompileCache(tmp_path / "cache", disk=False))
    compiler, src = GatedCompiler(str(tmp_path)), _src("gated, joined, cancelled")
    key = source_key(await compiler_identity(compiler), src)
    began = tmp_path / (gate_name(src) + ".began")
    outcome: list[object] = []

    async def first() -> None:
        try:
            outcome.append(await pool.compile(compiler, src, timeout=2.0))
        except am.CompileError as exc:
            outcome.append(exc)

    try:
        with anyio.fail_after(BOUND / 2):
            async with anyio.create_task_group() as tg:
                tg.start_soon(first)
                while not began.exists():  # the worker runs the compiler
                    await anyio.sleep(0.01)
                job = pool._in_flight[key]
                async with anyio.create_task_group() as joiner:
                    joiner.start_soon(pool.compile, compiler, src)  # no timeout
                    while job.awaiters < 2:
                        await anyio.sleep(0.001)
                    joiner.cancel_scope.cancel()
        assert isinstance(outcome[0], am.CompileError), outcome
        assert "timed out after 2.0 s" in str(outcome[0])
        assert job.done.value == 1, "the compile went on after its callers were gone"
    finally:
        (tmp_path / gate_name(src)).touch()
        await anyio.to_thread.run_sync(lambda: pool.shutdown(kill=True))


async def test_a_compile_asked_for_as_its_worker_ends_it_for_a_timeout_starts_afresh(
    anyio_backend: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request for a source whose compile its worker is ending (its timeout passed:
    the worker kills the compiler) starts the compile afresh, with its own timeout: it
    gets the binary. Checked: before, it joined the compile being ended, and got its
    "timed out" at once -- as "timed out after 60 s" -- long before its own timeout."""
    from asyncmetal import _pool
    from tests.support.compilers import GatedCompiler, gate_name

    pool = CompilePool(1, cache=CompileCache(tmp_path / "cache", disk=False))
    compiler, src = GatedCompiler(str(tmp_path)), _src("gated, ended, asked again")
    key = source_key(await compiler_identity(compiler), src)
    later: list[Any] = []
    kill = _pool._Worker._kill

    def killing(worker: Any) -> None:  # the worker has decided: the request comes now
        if not later:
            later.append(pool._submit(compiler, src, key, timeout=BOUND))
            (tmp_path / gate_name(src)).touch()  # (the compile asked for again ends)
        kill(worker)

    monkeypatch.setattr(_pool._Worker, "_kill", killing)
    try:
        with anyio.fail_after(BOUND / 2):
            with pytest.raises(am.CompileError, match=r"timed out after 1\.0 s"):
                await pool.compile(compiler, src, timeout=1.0)
            assert later
            assert isinstance(await pool._wait(later[0], BOUND), bytes)
    finally:
        (tmp_path / gate_name(src)).touch()
        await anyio.to_thread.run_sync(lambda: pool.shutdown(kill=True))


@pytest.mark.parametrize("timeout", [None, BOUND / 2])
async def test_what_a_compilers_child_prints_does_not_reach_the_replies(
    pool: CompilePool, timeout: float | None
) -> None:
    """A compiler that runs a command printing to its (inherited) standard output still
    compiles: the worker's replies go out on a descriptor of their own. Checked: before,
    the printed newline became the first byte of the reply's length, and the pool read
    a reply of about a megabyte that never came (with a timeout too: the reply had
    begun)."""
    from tests.support.compilers import PrintingCompiler

    try:
        with anyio.fail_after(BOUND):
            assert await pool.compile(PrintingCompiler(), _src("printing"), timeout=timeout)
    finally:
        await anyio.to_thread.run_sync(lambda: pool.shutdown(kill=True))


async def test_a_compilers_child_reading_its_input_does_not_take_the_jobs(
    pool: CompilePool,
) -> None:
    """A compiler that runs a command reading its (inherited) standard input to its end
    still compiles: the worker's jobs come in on a descriptor of their own, and the
    command reads an empty input. Checked: before, the command read the job pipe,
    waiting there for good (and would have eaten the next job)."""
    from tests.support.compilers import ReadingCompiler

    try:
        with anyio.fail_after(BOUND):
            assert await pool.compile(ReadingCompiler(), _src("reading"))
            assert await pool.compile(CCompiler(), _src("after"))
    finally:
        await anyio.to_thread.run_sync(lambda: pool.shutdown(kill=True))


_COMPILE_IN_A_DELETED_DIRECTORY = """
import os, sys, anyio
sys.path.insert(0, {root!r})
sys.path.append("a-relative-entry")  # as an editable install's path hook is
from asyncmetal._pool import CompilePool
from asyncmetal._cache import CompileCache
from asyncmetal.backends.cpu import CCompiler
os.chdir({gone!r})
os.rmdir({gone!r})
pool = CompilePool(1, cache=CompileCache({cache!r}, disk=False))
try:
    assert anyio.run(pool.compile, CCompiler(), "int twice(int x) {{ return 2 * x; }}")
finally:
    pool.shutdown()
print("ok")
"""


def test_a_process_whose_working_directory_was_deleted_compiles(tmp_path: Path) -> None:
    """A process whose working directory was deleted (a service's release directory,
    replaced) still compiles, a relative entry in its sys.path left out of its workers'.
    Checked: before, each worker failed to start ("failed to make path absolute"), and
    every compile failed with "the compile worker died"."""
    gone = tmp_path / "gone"
    gone.mkdir()
    script = _COMPILE_IN_A_DELETED_DIRECTORY.format(
        root=str(Path(__file__).resolve().parents[2]), gone=str(gone), cache=str(tmp_path)
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=BOUND
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


async def test_compile_many_stepped_on_after_its_pool_closed_never_waits_for_good(
    anyio_backend: object, tmp_path: Path
) -> None:
    """A compile_many whose pool closes while a step looks its second kernel up raises
    that kernel's ClosedResourceError (the pool's refusal) once, in its turn, and then
    ends: no step waits for it, nor raises it for ever. Checked: before, the refused
    kernel counted as submitted, and the step after the first kernel's waited for its
    result for good; later, every step raised the refusal again and never ended."""
    pool = CompilePool(1, cache=CompileCache(tmp_path / "cache"))
    tag = time.time_ns()
    kernels = [(f"void a(void) {{}} /* {tag} */", "a"), (f"void b(void) {{}} /* {tag} */", "b")]
    real_get_disk = pool.cache._get_disk
    lookups: list[str] = []

    async def get_disk(key: str) -> bytes | None:
        lookups.append(key)
        if len(lookups) == 2:  # the second kernel: the pool closes meanwhile
            await pool.aclose()
        return await real_get_disk(key)

    pool.cache._get_disk = get_disk  # type: ignore[method-assign]
    outcomes: list[str] = []
    with anyio.fail_after(BOUND):
        async with am.open_device("cpu") as device:
            device.compile_pool = pool
            programs = device.compile_many(kernels)
            for _ in range(4):
                try:
                    outcomes.append((await programs.__anext__()).name)
                except am.ClosedResourceError:
                    outcomes.append("closed")
                except StopAsyncIteration:
                    outcomes.append("ended")
                    break
    # (a, submitted first, compiled before the close, or was refused by it)
    assert sorted(outcomes[:-1]) in (["a", "closed"], ["closed", "closed"]), outcomes
    assert outcomes[-1] == "ended", outcomes


@pytest.mark.parametrize("idle_timeout", [1e10, 1e300])
async def test_a_pool_that_never_idles_out_keeps_compiling(
    anyio_backend: object, tmp_path: Path, idle_timeout: float
) -> None:
    """An idle timeout longer than a thread's wait may last (threading.TIMEOUT_MAX) is
    as long as the longest: the worker waits for its next job. Checked: before, its
    thread died of an OverflowError as it began to wait, still holding its slot, and
    the next compile waited for good."""
    pool = CompilePool(1, idle_timeout=idle_timeout, cache=CompileCache(tmp_path, disk=False))
    try:
        with anyio.fail_after(BOUND):
            assert await pool.compile(CCompiler(), _src("first"))
            assert await pool.compile(CCompiler(), _src("second"))
    finally:
        await anyio.to_thread.run_sync(lambda: pool.shutdown(kill=True))


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
async def test_a_worker_still_compiling_when_its_pool_closed_is_killed_at_exit(
    anyio_backend: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close waits a while for each worker's job in hand; one still compiling after
    it (a compiler that hangs) is killed at interpreter exit, its temporary directory
    removed, as the workers of a pool not closed are. Checked: before, the exit skipped
    the closed pool, and the worker outlived the process (an orphan, for good)."""
    from asyncmetal import _pool

    monkeypatch.setattr(_pool, "SHUTDOWN_JOIN_S", 0.2)
    pool = CompilePool(1, cache=CompileCache(tmp_path / "cache", disk=False))
    began = tmp_path / "began"
    began.mkdir()
    proc = None

    async def compiling() -> None:
        with contextlib.suppress(am.CompileError):  # (its worker killed, in the end)
            await pool.compile(SlowCompiler(BOUND * 10, str(began)), _src("hangs"))

    try:
        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tg:
                tg.start_soon(compiling)
                while not _existing(*_entries(began)):  # the compiler began
                    await anyio.sleep(0.01)
                proc, tmpdir = pool._workers[0].proc, pool._workers[0].tmpdir
                assert proc is not None and tmpdir is not None
                await pool.aclose()  # waits 0.2 s for the job in hand: not done
                assert proc.poll() is None
                await anyio.to_thread.run_sync(_pool._shutdown_at_exit, pool)  # (at exit)
                tg.cancel_scope.cancel()
        assert _dead(proc.pid), "the worker outlived the exit"
        assert _existing(tmpdir) == [], "its temporary directory outlived the exit"
    finally:
        if proc is not None and proc.poll() is None:  # (the test failed: clean up)
            await anyio.to_thread.run_sync(lambda: pool.shutdown(kill=True))


async def test_a_close_waits_for_hung_workers_once_not_once_each(
    anyio_backend: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close waits SHUTDOWN_JOIN_S for all the workers' jobs in hand together, not
    that long for each in turn: three hung compiles hold it once. Checked: before, its
    waits were one after another (here 3 x 1 s; 10 s a worker by default)."""
    from asyncmetal import _pool

    monkeypatch.setattr(_pool, "SHUTDOWN_JOIN_S", 1.0)
    pool = CompilePool(3, cache=CompileCache(tmp_path / "cache", disk=False))
    began = tmp_path / "began"
    began.mkdir()
    waited: list[float] = []

    async def compiling(tag: int) -> None:
        with contextlib.suppress(am.CompileError):  # (its worker killed, in the end)
            await pool.compile(SlowCompiler(BOUND * 10, str(began)), _src(tag))

    try:
        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tg:
                for tag in range(3):
                    tg.start_soon(compiling, tag)
                while len(_entries(began)) < 3:  # each worker is on its job
                    await anyio.sleep(0.01)
                for worker in list(pool._workers):
                    join = worker.thread.join

                    def timed(timeout: float | None = None, join: Any = join) -> None:
                        waited.append(timeout or 0.0)
                        join(timeout)

                    worker.thread.join = timed  # type: ignore[method-assign]
                await pool.aclose()
                await anyio.to_thread.run_sync(lambda: pool.shutdown(kill=True))
                tg.cancel_scope.cancel()
        assert len(waited) >= 3 and sum(waited[:3]) <= 1.0, waited
    finally:
        await anyio.to_thread.run_sync(lambda: pool.shutdown(kill=True))


async def test_a_worker_started_as_its_pool_is_killed_is_killed_too(
    pool: CompilePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kill at exit (shutdown(kill=True)) that comes as a worker's process has just
    started, before the pool recorded it, finds no process to kill: the worker then
    goes on to compile the job it had taken, and outlives the exit. It kills its own
    process once recorded. Checked: before, the compile ran on (this test's bound
    expired)."""
    import asyncmetal._pool as pool_module

    monkeypatch.setattr(pool_module, "SHUTDOWN_JOIN_S", 0.0)  # (the worker is held here)
    real = subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> Any:
        proc = real(*args, **kwargs)
        if "asyncmetal._worker" in args[0]:  # the kill comes now, whole
            killer = threading.Thread(target=pool.shutdown, kwargs={"kill": True})
            killer.start()
            killer.join()
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen)
    src = _src("started as killed")
    key = source_key(await compiler_identity(SlowCompiler(BOUND)), src)
    job = pool._submit(SlowCompiler(BOUND), src, key)
    with anyio.fail_after(BOUND / 4), pytest.raises(am.CompileError, match="shut down"):
        await pool._wait(job)


# Sources whose kernel's parameters a regular-expression parser may read in time more
# than linear in their length: text that each of its patterns, tried at each keyword,
# reads on to the source's end without matching.
_PATHOLOGICAL = [
    "typedef * ",  # cubic: a name after a '*', tried at each typedef and each '*'
    "typedef *[ x ",
    "typedef ",
    "typedef a __attribute__(( ",
    "using a = * ",
    "/* ",  # a comment, an attribute, a string left open
    "[[ ",
    '"\\',
    "'\\",
    "1' ",  # a quote after a number or word, read back to its start
    "a'b'",
    "k(a) ",  # a K&R definition, looked for after each call
    "k(a) int a; ",
    "k(",  # parentheses never closed
    "kernel void k( ",
    "kernel void k(a) ",
]


def _parse_time(compiler: Any, src: str) -> float:
    from asyncmetal._device import _read_params

    best = float("inf")
    # The least of a few, in this thread's own CPU time: what the parse takes, not the
    # machine's load (time other processes take the core from it is not counted).
    for _ in range(5):
        start = time.thread_time()
        with contextlib.suppress(am.CompileError):
            _read_params(compiler, src, "k")
        best = min(best, time.thread_time() - start)
    return best


@pytest.mark.parametrize("unit", _PATHOLOGICAL)
def test_a_kernels_parameters_are_read_in_time_linear_in_its_source(unit: str) -> None:
    """Reading a kernel's parameters (on the event loop's thread, for a short source)
    takes time about linear in the source's length, whatever it holds: 8 times as long a
    source takes well under 64 times as long (what a quadratic parse takes; a cubic one,
    512). Checked: fails without the fix (``typedef * `` over and over, 4 KB, took 16 s;
    the other sources here, 60 to 200 times as long as one of 512 bytes)."""
    from asyncmetal.backends.cuda._compiler import CUDACompiler
    from asyncmetal.backends.metal._compiler import MetalCompiler

    for compiler in (CCompiler(), CUDACompiler(), MetalCompiler()):
        short, long = (_parse_time(compiler, unit * (n // len(unit))) for n in (512, 4096))
        assert long < 24 * short + 0.002, (type(compiler).__name__, short, long)


async def test_a_kernels_parameters_are_read_off_the_loop_for_all_but_short_sources(
    device: am.Device,
) -> None:
    """A source's kernel parameters are read on a worker thread unless the source is
    short enough that the worst it can hold takes about a millisecond there (1 KiB):
    a source of a few KB can hold text that takes the parser tens of ms. Checked: fails
    without the fix (read on the loop up to 16 KiB)."""
    read_on: list[int] = []

    class Recording(CCompiler):
        def _signature(self, src: str, name: str) -> Any:
            read_on.append(threading.get_ident())
            return super()._signature(src, name)

    loop = threading.get_ident()
    kernel = "void k(float *a, int n) { }\n"
    for size, on_loop in ((512, True), (2 << 10, False)):
        src = kernel + " " * (size - len(kernel))
        with anyio.fail_after(BOUND):
            params = await device._params(src, "k", Recording())
        assert not isinstance(params, Exception) and params.kinds == ("buffer", "value")
        assert (read_on.pop() == loop) is on_loop, size


# A source of the usual mix, ``size`` characters long, defining kernel ``k`` at its end.
_MIXED = """// helper {i}: adds things
/* a block comment
   over lines */
typedef unsigned int u32_{i};
#define SCALE_{i} 2.0f
static const char *name_{i} = "helper {i} // not a comment";
static inline float helper_{i}(const float *a, int n, char c) {{
    float s = 0.0f; // sum
    for (int i = 0; i < n; ++i) {{ s += a[i] * SCALE_{i}; if (c == 'x') s -= 1; }}
    return s;
}}
"""


def _long_source(size: int, kernel: str) -> str:
    parts: list[str] = []
    while size > 0:
        parts.append(_MIXED.format(i=len(parts)))
        size -= len(parts[-1])
    return "".join(parts) + kernel


async def test_a_long_sources_parameters_are_read_in_short_steps(anyio_backend: object) -> None:
    """A source's kernel parameters, read off the loop for a long source, are read in
    steps that each hold the interpreter's lock about a millisecond (measured as the
    time between two events of a profiler on the reading thread, in that thread's own
    CPU time, which the machine's load does not lengthen), so that the loop is not held
    up: over 1 MB, at most 5 ms each. Checked: fails without the fix (single regular
    expression calls of 15 to 30 ms)."""
    from asyncmetal.backends.metal._compiler import MetalCompiler

    steps: list[float] = []

    def profiled(base: type[Any]) -> Any:
        def _signature(compiler: Any, src: str, name: str) -> Any:
            last = time.thread_time()
            longest = 0.0

            def profile(frame: object, event: str, arg: object) -> None:
                nonlocal last, longest
                now = time.thread_time()
                longest = max(longest, now - last)
                last = now

            sys.setprofile(profile)
            try:
                return base._signature(compiler, src, name)
            finally:
                sys.setprofile(None)
                steps.append(longest)

        return type("Profiled", (base,), {"_signature": _signature})()

    metal = "kernel void k(device float *a [[buffer(0)]], constant int &n [[buffer(1)]]) {}\n"
    readers = (
        (profiled(CCompiler), "void k(float *a, int n, u32_1 m) { }\n", 3),
        (profiled(MetalCompiler), metal, 2),
    )
    # Each reader's longest step, the shortest of up to three reads: a step the kernel
    # lengthened once (page faults under a loaded machine count as the thread's time)
    # passes on a later read; a single long call is long on every read.
    longest = [float("inf")] * len(readers)
    collecting = gc.isenabled()
    gc.disable()  # (a collection of the test process's objects is no step of the reader)
    try:
        async with am.open_device("cpu") as device:
            for _ in range(3):
                for i, (compiler, kernel, kinds) in enumerate(readers):
                    with anyio.fail_after(BOUND):
                        src = _long_source(1 << 20, kernel)
                        params = await device._params(src, "k", compiler)
                    assert not isinstance(params, Exception)
                    assert params.kinds == ("buffer",) + ("value",) * (kinds - 1)
                    longest[i] = min(longest[i], steps.pop())
                if max(longest) < 0.005:
                    break
    finally:
        if collecting:
            gc.enable()
    assert max(longest) < 0.005, longest


@pytest.mark.parametrize("compiler", ["c", "cuda"])
def test_a_digit_separator_opens_no_character_literal(compiler: str) -> None:
    """A quote between a number's digits (C++14's and C23's digit separators:
    ``1'000``, ``0x1'FFu``) is part of the number, not a character literal left open:
    the rest of its line -- the kernel's definition, or its parameters -- is read; a
    character literal after a word (``L'a'``, ``u8'b'``) is still one, and a quote left
    open (an apostrophe in an ``#error`` line) ends at its line's end. Checked: fails
    without the fix (each of the first three kernels "not defined")."""
    from asyncmetal._compile import _strip
    from asyncmetal.backends.cuda._compiler import CUDACompiler
    from asyncmetal.backends.metal._compiler import MetalCompiler

    reader = CCompiler() if compiler == "c" else CUDACompiler()
    for src, kinds in (
        ("constexpr int N = 1'000; __global__ void k(float *a, int n) { }", 2),
        ("enum { M = 0x1'FFu }; __global__ void k(float *a, int n, int m) { }", 3),
        ("__global__ void k(float a[1'024], int n) { }", 2),
        ("#error the build's flags are wrong\n__global__ void k(float *a, int n) { }", 2),
    ):
        params = reader._signature(src, "k")
        assert params.kinds == ("buffer",) + ("value",) * (kinds - 1), src
    assert _strip("x = 1'000'000 + L'a' + u8'b' + 0x1'FFu + 1.5e+1'0f; y = ';'; // '\n'") == (
        "x = 1'000'000 + L'' + u8'' + 0x1'FFu + 1.5e+1'0f; y = '';  \n''"
    )
    metal = "constant int N = 1'000; kernel void k(device float *a [[buffer(0)]]) { }"
    assert MetalCompiler()._signature(metal, "k").kinds == ("buffer",)

"""Contract 7 and the compile pool: pickle-safe compilers in spawned workers, isolation,
cancellation, deduplication and the content-addressed caches."""

from __future__ import annotations

import ast
import contextlib
import copy
import gc
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal._cache import CacheWarning, CompileCache
from asyncmetal._compile import Compiler, source_key
from asyncmetal._native_build import cc_command
from asyncmetal._pool import CompilePool, compiler_identity
from asyncmetal.backends.cpu import CCompiler
from tests.support.compilers import (
    GATE_WAIT_S,
    CrashingCompiler,
    DeviceOpeningCompiler,
    EnvironmentCompiler,
    GatedCompiler,
    PrefixingCompiler,
    SlowCompiler,
    UnreadableCompiler,
    gate_name,
)

pytestmark = pytest.mark.anyio
SRC = "int twice(int x) { return 2 * x; }\n"


def _src(tag: object) -> str:
    return SRC + f"/* {tag} {time.time_ns()} */\n"


@pytest.fixture
async def pool(anyio_backend: object, tmp_path: Path) -> AsyncIterator[CompilePool]:
    p = CompilePool(2, cache=CompileCache(tmp_path / "cache"))
    yield p
    await p.aclose()


def test_compilers_pickle_as_their_configuration() -> None:
    compiler = CCompiler(flags=("-O1",))  # (the $CC of now, kept: a worker compiles with it)
    assert compiler.__reduce__() == (CCompiler, (tuple(cc_command()), ("-O1",)))
    data = pickle.dumps(compiler)
    assert len(data) < 200  # configuration only: no handle, no cached state
    copy = pickle.loads(data)
    assert copy == compiler and copy is not compiler
    assert copy.compile(SRC) == compiler.compile(SRC)  # the copy builds the same bytes


async def test_workers_are_fresh_interpreters_that_open_no_device(pool: CompilePool) -> None:
    facts = ast.literal_eval((await pool.compile(EnvironmentCompiler(), _src("env"))).decode())
    assert facts["worker"] == "1"
    assert facts["cuda_visible"] == ""  # a worker can never take GPU memory
    assert facts["main"] is not None and facts["main"].endswith("_worker.py")
    assert "SIG_IGN" in facts["sigint"] or facts["sigint"] == "1"
    assert facts["pid"] != os.getpid()
    with pytest.raises(am.CompileError, match="compile workers never open a device"):
        await pool.compile(DeviceOpeningCompiler(), _src("open"))


async def test_workers_never_import_the_working_directorys_modules(
    anyio_backend: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A program whose working directory holds a file named as a module of the
    standard library (``random.py``, which ``tempfile`` imports) compiles: its workers
    import no more of that directory than the program does. Checked: before, each worker
    (``python -m`` puts the working directory first on its path) imported that file
    instead, and died of it ("the compile worker died (exit code 1)")."""
    here = tmp_path / "here"
    here.mkdir()
    (here / "random.py").write_text('raise SystemExit("the directory\'s random.py ran")\n')
    monkeypatch.chdir(here)
    pool = CompilePool(1, cache=CompileCache(tmp_path / "cache", disk=False))
    try:
        with anyio.fail_after(60):
            facts = ast.literal_eval(
                (await pool.compile(EnvironmentCompiler(), _src("cwd"))).decode()
            )
            assert facts["main"] is not None and facts["main"].endswith("_worker.py")
            assert await pool.compile(CCompiler(), _src("random"))
    finally:
        await pool.aclose()


def test_script_without_main_guard(tmp_path: Path) -> None:
    script = tmp_path / "noguard.py"
    script.write_text(
        textwrap.dedent(
            """
            import anyio, asyncmetal as am
            print("script body ran")
            async def main():
                async with am.open_device("cpu") as dev:
                    progs = [p async for p in dev.compile_many(
                        [(f"void k{i}(void) {{}}", f"k{i}") for i in range(4)])]
                    print(len(progs), "compiled")
            anyio.run(main)
            """
        )
    )
    env = dict(os.environ, ASYNCMETAL_CACHE_DIR=str(tmp_path / "c"))
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    # The body ran once: workers never re-ran the user's script.
    assert proc.stdout.splitlines() == ["script body ran", "4 compiled"]


@pytest.mark.parametrize("how", ["segfault", "exit"])
async def test_a_crashing_compile_fails_alone(pool: CompilePool, how: str) -> None:
    expected = "signal SIGSEGV" if how == "segfault" else "exit code 3"
    with pytest.raises(am.CompileError, match=f"the compile worker died \\({expected}\\)"):
        await pool.compile(CrashingCompiler(how), _src(how))
    # The pool replaced the worker and keeps compiling.
    assert await pool.compile(CCompiler(), _src("after"))


async def test_a_compiler_the_worker_cannot_unpickle_is_named_and_the_worker_lives(
    anyio_backend: object, tmp_path: Path
) -> None:
    """A compiler a worker cannot unpickle (its class, or what its config holds,
    defined in the parent's ``__main__``, which workers never import) fails with an
    error saying so, and the worker goes on compiling. Checked: before, the worker died
    of it ("the compile worker died (exit code 1)" and its traceback)."""
    pool = CompilePool(1, cache=CompileCache(tmp_path / "cache", disk=False))
    try:
        with anyio.fail_after(60):
            facts = ast.literal_eval(
                (await pool.compile(EnvironmentCompiler(), _src("a"))).decode()
            )
            with pytest.raises(am.CompileError, match="could not unpickle the compiler") as caught:
                await pool.compile(UnreadableCompiler(), _src("unreadable"))
            assert "__main__" in str(caught.value)
            again = ast.literal_eval(
                (await pool.compile(EnvironmentCompiler(), _src("b"))).decode()
            )
            assert again["pid"] == facts["pid"], "the worker did not live on"
    finally:
        await pool.aclose()


async def test_workers_start_where_warnings_are_errors(
    anyio_backend: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A program run with ``PYTHONWARNINGS=error`` (as test suites are) compiles: its
    workers, which inherit it, start without a warning. Checked: before, runpy warned
    that ``asyncmetal._worker`` was imported (by the package) before it ran, and each
    worker died of it ("the compile worker died (exit code 1)")."""
    monkeypatch.setenv("PYTHONWARNINGS", "error")
    pool = CompilePool(1, cache=CompileCache(tmp_path / "cache", disk=False))
    try:
        with anyio.fail_after(60):
            assert await pool.compile(CCompiler(), _src("warnings are errors"))
    finally:
        await pool.aclose()


async def test_a_subclass_compiling_otherwise_has_cache_entries_of_its_own(
    pool: CompilePool,
) -> None:
    """A compiler's subclass that compiles otherwise, keeping its base's name and
    config, gets its own binary of a source the base compiled, not the base's. Checked:
    before, the identity left the class out, and the cache handed it the base's."""
    src = _src("subclass") + "#ifndef V\n#define V 1\n#endif\nint v(void) { return V; }\n"
    with anyio.fail_after(60):
        base = await pool.compile(CCompiler(), src)
        sub = await pool.compile(PrefixingCompiler(), src)
    assert sub != base


async def test_timeout_kills_the_worker_and_raises(pool: CompilePool) -> None:
    t0 = time.perf_counter()
    with pytest.raises(am.CompileError, match=r"timed out after 0\.3 s"):
        await pool.compile(SlowCompiler(30), _src("slow"), timeout=0.3)
    assert time.perf_counter() - t0 < 10
    assert await pool.compile(CCompiler(), _src("after"))


async def test_identical_compiles_in_flight_run_once(pool: CompilePool, tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    compiler, src = SlowCompiler(0.3, str(markers)), _src("dedupe")
    results = []

    async def one() -> None:
        results.append(await pool.compile(compiler, src))

    async with anyio.create_task_group() as tg:
        for _ in range(8):
            tg.start_soon(one)
    assert len(results) == 8 and len(set(results)) == 1
    assert len(list(markers.iterdir())) == 1


class _Local:
    """Something only one caller's frame refers to."""


def _depth(error: BaseException) -> int:
    depth, tb = 0, error.__traceback__
    while tb is not None:
        depth, tb = depth + 1, tb.tb_next
    return depth


async def test_callers_of_one_failed_compile_each_get_an_error_of_their_own(
    pool: CompilePool, tmp_path: Path
) -> None:
    """Four callers join one compile that fails: each gets a CompileError of its own,
    alike (the compiler's log, pickled alike), whose traceback holds its own frames
    only -- kept, one lets the other callers' locals go. Checked: before, all four got
    the job's one error, whose traceback grew with each raise and held every caller's
    frame (and what they referred to) as long as any of them kept the error."""
    markers = tmp_path / "markers"
    markers.mkdir()
    compiler, src = SlowCompiler(0.3, str(markers)), _src("broken") + "int broken( {\n"
    errors: list[BaseException] = []
    locals_: list[weakref.ref[_Local]] = []

    async def one() -> None:
        mine = _Local()
        locals_.append(weakref.ref(mine))
        try:
            await pool.compile(compiler, src)
        except am.CompileError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(one)
    assert len(list(markers.iterdir())) == 1  # (one compile, joined by all four)
    assert len(errors) == 4 and len({id(e) for e in errors}) == 4
    assert len({(str(e), e.log) for e in errors if isinstance(e, am.CompileError)}) == 1
    assert len({_depth(e) for e in errors}) == 1, [_depth(e) for e in errors]
    copied = pickle.loads(pickle.dumps(errors[0]))
    assert type(copied) is am.CompileError and str(copied) == str(errors[0])
    kept = errors[0]
    errors.clear()
    gc.collect()
    assert sum(ref() is not None for ref in locals_) == 1
    del kept
    gc.collect()
    assert not any(ref() is not None for ref in locals_)


async def test_cancel_withdraws_unstarted_and_finishes_running(
    anyio_backend: object, tmp_path: Path
) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    pool = CompilePool(1, cache=CompileCache(tmp_path / "cache"))
    slow = SlowCompiler(0.5, str(markers))
    running, queued = _src("running"), _src("queued")
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.compile, slow, running)
            await anyio.sleep(0.2)  # the one worker is busy with `running`
            with anyio.move_on_after(0.05):
                await pool.compile(slow, queued)  # waits behind it, then is cancelled
            tg.cancel_scope.cancel()  # cancels the wait on `running` too
        with anyio.fail_after(60):  # `running` finishes, `queued` is skipped
            while pool._in_flight:
                await anyio.sleep(0.05)
        ran = [p.read_text() for p in markers.iterdir()]
        assert ran == [running]  # `queued` was withdrawn before it started
        # `running` finished into the cache: asking again compiles nothing.
        compiles = pool.compiles
        await pool.compile(slow, running)
        assert pool.compiles == compiles
    finally:
        await pool.aclose()


async def test_memory_and_disk_cache(anyio_backend: object, tmp_path: Path) -> None:
    compiler, src = CCompiler(), _src("cache")
    first = CompilePool(1, cache=CompileCache(tmp_path))
    try:
        binary = await first.compile(compiler, src)
        assert first.compiles == 1
        assert await first.compile(compiler, src) == binary
        assert first.cache.hits_memory == 1 and first.compiles == 1
    finally:
        await first.aclose()
    assert (tmp_path / "compile-cache.sqlite").exists()
    second = CompilePool(1, cache=CompileCache(tmp_path))  # as a new process would
    try:
        assert await second.compile(compiler, src) == binary
        assert second.cache.hits_disk == 1 and second.compiles == 0
    finally:
        await second.aclose()


async def test_disk_cache_off(
    anyio_backend: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCMETAL_CACHE", "0")
    pool = CompilePool(1, cache=CompileCache(tmp_path))
    try:
        await pool.compile(CCompiler(), _src("off"))
        assert not (tmp_path / "compile-cache.sqlite").exists()
    finally:
        await pool.aclose()


@pytest.mark.parametrize("off", ["false", "OFF", " no "])
def test_the_cache_switch_takes_the_usual_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, off: str
) -> None:
    """``ASYNCMETAL_CACHE`` (as ``ASYNCMETAL_EXTENSION``) is off for 0, false, no and
    off in any case, and a word it does not know is taken as on with a warning naming
    those. Checked: before, only "0" turned it off, and "off" was silently on."""
    monkeypatch.setenv("ASYNCMETAL_CACHE", off)
    assert not CompileCache(tmp_path).disk_enabled
    monkeypatch.setenv("ASYNCMETAL_CACHE", "Yes")
    assert CompileCache(tmp_path).disk_enabled
    monkeypatch.setenv("ASYNCMETAL_CACHE", "disabled")
    with pytest.warns(RuntimeWarning, match=r"ASYNCMETAL_CACHE='disabled'.*taken as on"):
        assert CompileCache(tmp_path).disk_enabled


async def test_corrupt_cache_is_ignored_with_a_warning(
    anyio_backend: object, tmp_path: Path
) -> None:
    (tmp_path / "compile-cache.sqlite").write_bytes(b"this is no sqlite database" * 100)
    pool = CompilePool(1, cache=CompileCache(tmp_path))
    try:
        with pytest.warns(CacheWarning, match="unusable"):
            binary = await pool.compile(CCompiler(), _src("corrupt"))
        assert binary.startswith(b"\x7fELF") or binary
        assert not pool.cache.disk_enabled
    finally:
        await pool.aclose()


def test_several_processes_share_one_cache(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import anyio, sys
        from asyncmetal._pool import CompilePool
        from asyncmetal._cache import CompileCache
        from asyncmetal.backends.cpu import CCompiler
        async def main():
            pool = CompilePool(1, cache=CompileCache(sys.argv[1]))
            for i in range(6):
                await pool.compile(CCompiler(), f"int f{i}(void) {{ return {i}; }}")
            await pool.aclose()
            print(pool.compiles + pool.cache.hits_disk)
        anyio.run(main)
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert [int(o) for o in outs] == [6, 6, 6]


async def test_workers_ignore_sigint(pool: CompilePool) -> None:
    facts = ast.literal_eval((await pool.compile(EnvironmentCompiler(), _src("pid"))).decode())
    os.kill(facts["pid"], signal.SIGINT)
    await anyio.sleep(0.2)
    again = ast.literal_eval((await pool.compile(EnvironmentCompiler(), _src("pid2"))).decode())
    assert again["pid"] == facts["pid"]  # the same worker, still alive


async def test_idle_workers_retire(anyio_backend: object, tmp_path: Path) -> None:
    pool = CompilePool(2, idle_timeout=0.2, cache=CompileCache(tmp_path))
    try:
        await pool.compile(CCompiler(), _src("idle"))
        assert pool.workers >= 1
        await anyio.sleep(1.0)
        assert pool.workers == 0
        assert await pool.compile(CCompiler(), _src("again"))  # starts one anew
    finally:
        await pool.aclose()
    assert pool.workers == 0


async def test_device_compile_uses_its_pool(device: am.Device, tmp_path: Path) -> None:
    pool = CompilePool(1, cache=CompileCache(tmp_path))
    device.compile_pool = pool
    try:
        prog = await device.compile("void k(int* x) { x[0] = 5; }", "k")
        assert pool.compiles == 1
        assert prog.binary.startswith(b"\x7fELF")
    finally:
        await pool.aclose()


async def test_compile_many_reports_failures_in_turn(device: am.Device) -> None:
    good = "void ok(void) {}"
    names = []

    async def consume() -> None:
        async for prog in device.compile_many([(good, "ok"), ("void bad(void) { oops }", "bad")]):
            names.append(prog.name)

    with pytest.raises(am.CompileError, match="failed with exit code"):
        await consume()
    assert names in ([], ["ok"])


async def test_prestart_starts_every_worker(anyio_backend: object, tmp_path: Path) -> None:
    pool = CompilePool(2, cache=CompileCache(tmp_path))
    try:
        pool.prestart()
        assert pool.workers == 2
        with anyio.fail_after(30):
            while not all(w.proc is not None for w in pool._workers):
                await anyio.sleep(0.01)
        assert await pool.compile(CCompiler(), _src("prestarted"))
        assert pool.workers == 2
    finally:
        await pool.aclose()


def _gated_pool(tmp_path: Path) -> tuple[Path, CompilePool]:
    """A folder of gates (GatedCompiler) and a pool of one worker caching under tmp_path."""
    gates = tmp_path / "gates"
    gates.mkdir()
    return gates, CompilePool(1, cache=CompileCache(tmp_path / "cache"))


def _use_gated(dev: am.Device, pool: CompilePool, gates: Path) -> None:
    """``dev`` compiles in ``pool`` with a compiler held at ``gates``."""
    dev.compile_pool = pool
    dev._backend._compiler = GatedCompiler(str(gates))


async def test_compile_many_aclose_gives_up_what_it_has_not_yielded(
    anyio_backend: object, tmp_path: Path
) -> None:
    """``aclose()`` on compile_many's iterator: the step waiting in another task stops
    (StopAsyncIteration), as does every later one; the compile not started that
    nobody else awaits is dropped, the running one finishes into the cache. (The
    compiler holds the second compile at a gate the test opens after aclose: held so,
    it runs while the third waits behind it for the pool's one worker, whatever the
    machine's load.)"""
    gates, pool = _gated_pool(tmp_path)
    sources = [_src(f"many {i}") for i in range(3)]
    try:
        async with am.open_device("cpu") as dev:
            _use_gated(dev, pool, gates)
            (gates / gate_name(sources[0])).touch()  # the first compiles at once
            kernels = [(src, "twice") for src in sources]
            many = dev.compile_many(kernels)
            stopped: list[bool] = []

            async def step() -> None:
                try:
                    await many.__anext__()
                except StopAsyncIteration:
                    stopped.append(True)

            with anyio.fail_after(30):
                first = await many.__anext__()
                assert first.name == "twice"
                while not (gates / f"{gate_name(sources[1])}.began").exists():
                    await anyio.sleep(0.01)  # the second compiles now, the third waits
                async with anyio.create_task_group() as tg:
                    tg.start_soon(step)
                    await anyio.wait_all_tasks_blocked()  # it waits for the second
                    await many.aclose()
                assert stopped == [True]
                with pytest.raises(StopAsyncIteration):
                    await many.__anext__()
                for src in sources[1:]:  # (a third compile not dropped would run now)
                    (gates / gate_name(src)).touch()
                while pool._in_flight:
                    await anyio.sleep(0.01)
            identity = await compiler_identity(dev._backend.compiler)
            keys = [source_key(identity, src) for src in sources]
            assert pool.compiles == 2
            assert [pool.cache._get_memory(k) is not None for k in keys] == [True, True, False]
            assert not (gates / f"{gate_name(sources[2])}.began").exists()
    finally:
        for src in sources:  # (a test failed before opening them: its worker goes on)
            (gates / gate_name(src)).touch()
        await pool.aclose()


async def test_compile_many_aclose_gives_up_every_claim(
    anyio_backend: object, tmp_path: Path
) -> None:
    """Kernels of one source share one pool job (joined once per kernel): aclose gives
    up each of its claims, so the job, not started, is dropped; and aclose while a step
    is still looking kernels up submits no more of them. Checked: before, the shared
    job kept a claim, and the step went on submitting every kernel."""
    two = SRC + "int thrice(int x) { return 3 * x; }\n"
    pool = CompilePool(1, cache=CompileCache(tmp_path))
    try:
        async with am.open_device("cpu") as dev:
            dev.compile_pool = pool
            a, b = _src("a"), two + f"/* b {time.time_ns()} */\n"
            many = dev.compile_many([(a, "twice"), (b, "twice"), (b, "thrice")])
            await many.__anext__()  # a compiled; b was submitted for both its kernels
            (shared,) = [job for job in many._jobs if job.src == b]
            assert shared.awaiters == 2
            await many.aclose()
            assert shared.awaiters == 0  # (not started: dropped; started: into the cache)
            later = dev.compile_many([(_src(i), "twice") for i in range(4)])

            async def step() -> None:
                with contextlib.suppress(StopAsyncIteration):
                    await later.__anext__()

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(step)
                    await anyio.lowlevel.checkpoint()  # the step looks the first kernel up
                    await later.aclose()
            assert later._dispatched <= 1 and not later._jobs
    finally:
        await pool.aclose()


async def test_compile_many_aclose_stops_a_step_loading_its_program(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``aclose()`` while a step has taken its kernel's binary and is loading it on a
    thread: that step raises StopAsyncIteration once the load ends, as a step waiting
    does, rather than handing the program out. (The backend's load is held until the
    test has closed the iterator.) Checked: before, the step returned the program."""
    began, release = threading.Event(), threading.Event()
    async with am.open_device("cpu") as dev:
        load = dev._backend.load

        def held_load(*args: object) -> object:
            began.set()
            release.wait(GATE_WAIT_S)
            return load(*args)

        monkeypatch.setattr(dev._backend, "load", held_load)
        many = dev.compile_many([(_src("held load"), "twice")])
        got: list[object] = []

        async def step() -> None:
            try:
                got.append(await many.__anext__())
            except StopAsyncIteration:
                got.append(StopAsyncIteration)

        try:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(step)
                    await anyio.to_thread.run_sync(began.wait)  # the step loads it now
                    await many.aclose()
                    release.set()
        finally:
            release.set()
        assert got == [StopAsyncIteration]
        with pytest.raises(StopAsyncIteration):
            await many.__anext__()


async def test_compile_many_refuses_a_second_step_under_way(anyio_backend: object) -> None:
    """Two tasks stepping one compile_many at once: the second is refused, as an async
    generator's would be. Checked: before, the steps took each other's kernels (one
    yielded twice, another never, or IndexError)."""
    async with am.open_device("cpu") as device:
        await _steps_refused(device)


async def _steps_refused(device: am.Device) -> None:
    many = device.compile_many([(_src(i), "twice") for i in range(3)])
    got: list[str] = []

    async def step() -> None:
        try:
            got.append((await many.__anext__()).name)
        except RuntimeError as exc:
            got.append(str(exc))

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(step)
            tg.start_soon(step)
        assert sorted(got) == ["a step of this compile_many is already under way", "twice"]
        names = [program.name async for program in many]
    assert names == ["twice", "twice"]


async def _steps_until_it_ends(many: am.CompileMany) -> list[str]:
    """What each step raises, in a loop that goes on past every error, until one raises
    StopAsyncIteration (bounded: an iterator that never ends fails the test)."""
    raised: list[str] = []
    with anyio.fail_after(30):
        for _ in range(10):
            try:
                await many.__anext__()
                raised.append("a program")
            except StopAsyncIteration:
                return raised
            except am.AsyncMetalError as exc:
                raised.append(type(exc).__name__)
    raise AssertionError(f"the iterator never ended: {raised}")


async def _raises_once_after_a_checkpoint(many: am.CompileMany, error: str) -> None:
    """A step cancelled at its checkpoint raises the cancellation, the next step
    ``error``, and every later step ends the iteration."""
    with anyio.CancelScope() as scope:
        scope.cancel()
        await many.__anext__()
    assert scope.cancelled_caught
    assert await _steps_until_it_ends(many) == [error]
    assert await _steps_until_it_ends(many) == []


async def test_compile_many_ends_once_its_device_closed(anyio_backend: object) -> None:
    """A compile_many whose device closed raises ClosedResourceError from one step, after
    a checkpoint (a step cancelled there raises the cancellation, and the next step the
    error), then ends: a loop that goes on past errors stops. After ``aclose()`` it
    only ends. Checked: before, every step raised the error, never a cancellation, and
    the loop went on for ever."""
    async with am.open_device("cpu") as dev:
        many = dev.compile_many([(_src(i), "twice") for i in range(3)])
        with anyio.fail_after(30):
            assert (await many.__anext__()).name == "twice"
        closed = dev.compile_many([(_src("closed later"), "twice")])
        await closed.aclose()
    await _raises_once_after_a_checkpoint(many, "ClosedResourceError")
    assert not many._jobs  # its claims were given up
    assert await _steps_until_it_ends(closed) == []


async def test_compile_many_ends_once_its_device_is_lost(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lost device (a fault the driver made process-wide: every compile raises
    DeviceLostError, here as the backend says so) ends it as a close does: one step
    raises the error, after a checkpoint, and later steps StopAsyncIteration. Checked:
    before, every step raised it again, at once, and the loop went on for ever."""
    async with am.open_device("cpu") as dev:
        many = dev.compile_many([(_src(i), "twice") for i in range(3)])
        with monkeypatch.context() as patch:
            patch.setattr(dev._backend, "lost_error", lambda what: am.DeviceLostError(what))
            await _raises_once_after_a_checkpoint(many, "DeviceLostError")


async def test_compile_many_raises_a_closed_pools_refusal_once_per_kernel(
    anyio_backend: object, tmp_path: Path
) -> None:
    """A pool closed before the kernels were submitted refuses each: each kernel raises
    that ClosedResourceError once, in its turn, and the iterator then ends (the device
    is open: it is no close of the device). Checked: before, every step raised the
    refusal of the first kernel again, and a loop going on past it never ended."""
    pool = CompilePool(1, cache=CompileCache(tmp_path))
    await pool.aclose()
    async with am.open_device("cpu") as dev:
        dev.compile_pool = pool
        many = dev.compile_many([(_src(i), "twice") for i in range(3)])
        assert await _steps_until_it_ends(many) == ["ClosedResourceError"] * 3
        assert await _steps_until_it_ends(many) == []


async def test_compile_many_ends_once_its_device_closed_past_a_failed_kernel(
    anyio_backend: object, tmp_path: Path
) -> None:
    """A kernel's CompileError does not end it -- the next step goes on with the other
    kernels -- and the device's close past it does, as above. (A pool of one worker
    compiles them in turn: the broken one arrives first.) Checked: before, the steps
    past the close raised ClosedResourceError for ever."""
    pool = CompilePool(1, cache=CompileCache(tmp_path))
    broken = f"int twice(int x) {{ oops }}\n/* {time.time_ns()} */\n"
    try:
        async with am.open_device("cpu") as dev:
            dev.compile_pool = pool
            many = dev.compile_many([(broken, "twice"), *[(_src(i), "twice") for i in range(3)]])
            with anyio.fail_after(30):
                with pytest.raises(am.CompileError, match="failed with exit code"):
                    await many.__anext__()
                assert (await many.__anext__()).name == "twice"
        assert await _steps_until_it_ends(many) == ["ClosedResourceError"]
    finally:
        await pool.aclose()


async def test_compile_many_ends_once_its_device_closed_while_a_step_waited(
    anyio_backend: object, tmp_path: Path
) -> None:
    """A step waiting for a compile as the device closes raises ClosedResourceError as
    the close seals the device, the compile still running (held at its gate), and
    gives up its claims; the iterator ends. Checked: before, the step raised it once
    the compile arrived (it cannot be loaded)."""
    gates, pool = _gated_pool(tmp_path)
    sources = [_src(f"held {i}") for i in range(2)]
    try:
        async with am.open_device("cpu") as dev:
            _use_gated(dev, pool, gates)
            many = dev.compile_many([(src, "twice") for src in sources])
            raised: list[str] = []

            async def step() -> None:
                try:
                    await many.__anext__()
                except am.ClosedResourceError as exc:
                    raised.append(str(exc))

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(step)
                    while not (gates / f"{gate_name(sources[0])}.began").exists():
                        await anyio.sleep(0.01)
                    await anyio.wait_all_tasks_blocked()  # the step waits for it
                    (job,) = [job for job in many._jobs if job.src == sources[0]]
                    await dev.close()
            assert raised == ["device cpu is closed"]
            assert not job.done.value and job.awaiters == 0 and not many._jobs
        assert await _steps_until_it_ends(many) == []
    finally:
        for src in sources:
            (gates / gate_name(src)).touch()
        await pool.aclose()


async def test_compiler_warnings_come_as_a_compile_warning(
    anyio_backend: object, tmp_path: Path
) -> None:
    """A kernel that compiles with warnings: the compile that ran the compiler warns
    once (CompileWarning naming the kernel, with the compiler's output, at the caller's
    line), however many callers joined it, through compile and compile_many; a cached
    binary warns no more. Raised as an error, the warning loses no kernel: compile_many's
    next step yields it. Checked: before, the warnings were dropped; then each joined
    caller warned, and compile_many lost the kernel whose warning raised."""
    pool = CompilePool(1, cache=CompileCache(tmp_path))
    try:
        async with am.open_device("cpu") as dev:
            dev.compile_pool = pool
            src = f'#warning "look at {time.time_ns()}"\n' + SRC
            with warnings.catch_warnings(record=True) as got:
                warnings.simplefilter("always")
                async with anyio.create_task_group() as tg:
                    for _ in range(3):
                        tg.start_soon(dev.compile, src, "twice")
            assert [type(w.message) for w in got] == [am.CompileWarning]
            warning = got[0].message
            assert isinstance(warning, am.CompileWarning) and "look at" in warning.log
            assert str(warning).startswith("kernel 'twice': the compiler printed warnings")
            await dev.compile(src, "twice")  # cached: no warning (warnings are errors here)
            with pytest.warns(am.CompileWarning) as where:
                await dev.compile("\n" + src, "twice")
            assert where[0].filename == __file__
            many = dev.compile_many([("\n\n" + src, "twice")])
            with pytest.raises(am.CompileWarning, match="look at"):
                await many.__anext__()  # raised as an error (this suite's filter)
            assert [p.name async for p in many] == ["twice"]
    finally:
        await pool.aclose()


_PUT = {
    "cpu": "void put(int* out) { out[0] = VALUE; }",
    "metal": "kernel void put(device int* out [[buffer(0)]], uint i [[thread_position_in_grid]])"
    " { if (i == 0) out[0] = VALUE; }",
}


async def test_compile_options_reach_the_compiler_and_key_the_cache(device: am.Device) -> None:
    """``options`` go to the device's compiler (a macro here): each set of options is a
    program of its own, compile_many takes them too, and without the macro the source
    does not compile."""
    src = _PUT["metal" if device.name == "metal" else "cpu"]
    out = await device.alloc(4)
    for value in (7, 9):
        prog = await device.compile(src, "put", options=(f"-DVALUE={value}",))
        await device.queue.launch(prog, out)
        assert (await out.read(np.int32))[0] == value
    async for prog in device.compile_many([(src, "put")], options=["-DVALUE=11"]):
        await device.queue.launch(prog, out)
    assert (await out.read(np.int32))[0] == 11
    with pytest.raises(am.CompileError):
        await device.compile(src, "put")
    with pytest.raises(am.NotDefinedError, match="'nope': not defined"):
        await device.compile(src, "nope", options=("-DVALUE=1",))


async def test_options_that_make_an_object_file_say_so(device: am.Device) -> None:
    """``-c`` makes the C compiler write a relocatable object, not a shared library: the
    compile fails saying what the compiler made (an ELF file with no program headers).
    Checked: fails without the fix ("range() arg 3 must not be zero" in the message)."""
    with pytest.raises(am.CompileError, match=r"made a relocatable object .*not a shared"):
        await device.compile(_PUT["cpu"], "put", options=("-c", "-DVALUE=1"))


async def test_options_that_make_no_library_say_so_with_the_log(device: am.Device) -> None:
    """``-fsyntax-only`` (as ``--help`` or ``-###``) makes the C compiler write no file at
    all: the compile fails saying so, naming the kernel and carrying what the compiler
    printed (here its warning). Checked: fails without the fix (a FileNotFoundError of a
    temporary path in the message, and an empty log)."""
    src = "void put(int* x) { int unused; x[0] = 1; }"
    with pytest.raises(am.CompileError, match="made no kernel library") as info:
        await device.compile(src, "put", options=("-fsyntax-only", "-Wall"))
    assert info.value.name == "put"
    assert "unused" in (info.value.log or "")


async def test_compile_options_are_checked_before_anything_compiles(device: am.Device) -> None:
    src = _PUT["metal" if device.name == "metal" else "cpu"]
    with pytest.raises(am.ArgumentTypeError, match="tuple or list of str"):
        await device.compile(src, "put", options="-DVALUE=1")  # type: ignore[arg-type]
    with pytest.raises(am.ArgumentTypeError, match="must be a str"):
        await device.compile(src, "put", options=(1,))  # type: ignore[arg-type]
    with pytest.raises(am.InvalidArgumentError, match="without whitespace"):
        await device.compile(src, "put", options=("-D VALUE=1",))
    for empty in ("", "-DVALUE=1\0"):  # (checked: both were said to hold whitespace)
        with pytest.raises(am.InvalidArgumentError, match="non-empty str without NUL"):
            device.compile_many([(src, "put")], options=(empty,))


async def test_a_long_macro_and_a_macro_given_apart_reach_the_compiler(
    device: am.Device,
) -> None:
    """A macro thousands of characters long (an expression) and ``-D`` with the macro as
    the next option, as the error for ``'-D N=4'`` suggests, compile alike on every
    device. The simulated Metal compiler put a macro longer than 511 characters from
    beyond its buffer (garbage, or the compile worker killed by SIGSEGV), and let a
    ``-D`` given apart define nothing."""
    src = _PUT["metal" if device.name == "metal" else "cpu"]
    out = await device.alloc(4)
    expr = "(" + "+".join(["1"] * 2000) + ")"
    for options in ((f"-DVALUE={expr}",), ("-D", "VALUE=5")):
        prog = await device.compile(src, "put", options=options)
        await device.queue.launch(prog, out)
        assert (await out.read(np.int32))[0] == (2000 if len(options) == 1 else 5)


class _FlagsFirst(Compiler):
    """A user's compiler keeping its flags first in its config, not last."""

    name = "flags-first"

    def __init__(self, flags: tuple[str, ...] = (), target: str = "t1") -> None:
        self.flags, self.target = tuple(flags), target

    def config(self) -> tuple[object, ...]:
        return (self.flags, self.target)

    def compile(self, src: str) -> bytes:
        return src.encode()


def test_options_for_a_compiler_without_its_flags_last_are_refused() -> None:
    """with_options remakes a compiler from its config with the options after the flags,
    its last item: a compiler whose flags are elsewhere is refused as one that takes no
    options. Before, it was remade with the flags and options as its target."""
    with pytest.raises(am.InvalidArgumentError, match="takes no options"):
        _FlagsFirst(("-O1",))._with_options(("-DN=4",))
    assert _FlagsFirst()._with_options(()) == _FlagsFirst()


async def test_a_copy_of_a_pool_is_the_pool_itself(pool: CompilePool) -> None:
    """``copy.copy``/``copy.deepcopy`` of a CompilePool gives the pool itself: a copy
    kept its own state over the original's workers, so a compile on it once the
    original closed waited for good. Checked: fails without the fix (timed out)."""
    assert copy.copy(pool) is pool and copy.deepcopy(pool) is pool
    await pool.compile(CCompiler(), "void a(void) {}")
    other = copy.copy(pool)
    await pool.aclose()
    with anyio.fail_after(10), pytest.raises(am.ClosedResourceError, match="pool is closed"):
        await other.compile(CCompiler(), "void b(void) {}")

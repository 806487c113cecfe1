"""The cpu queues of the native runtime, stressed from C (tests/support/native/queue_stress.c).

Thousands of queues are opened, made to wait and closed -- abandoning the wait, or
letting another thread release it -- with the close landing at varied moments of the
queue thread's way into its wait; plus watches and blocks under the same churn, and
kernels of mixed parameter types called with random bits. Plain,
and under ThreadSanitizer and AddressSanitizer (each skips, saying why, where the
machine cannot run it). A hang ends the run through the harness's watchdog.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _native
from asyncmetal._queue import native_queue
from asyncmetal.backends.cpu import CPUBackend, CPUQueue, CPUTimeline
from tests.support.native import harness
from tests.support.queues import fail_new_queues, held_queue

# Iterations of the abandon check (the others run a fraction of it). The plain build
# runs enough to hit a lost wake-up in a handful of thousand tries; the sanitized ones,
# ~10x slower a thread switch, run fewer. Forks of a process with threads run only in
# the plain build: ThreadSanitizer does not support them, and AddressSanitizer's
# allocator (before LLVM 17) can be locked for ever in the child, by a thread that was
# allocating at the fork.
ARGS = {"": ["20000", "fork"], "thread": ["2000"], "address": ["5000"]}


@pytest.mark.parametrize("sanitizer", harness.SANITIZERS, ids=["plain", "tsan", "asan"])
def test_queue_close_wait_watch_stress(tmp_path: Path, sanitizer: str) -> None:
    binary = harness.build("queue_stress.c", tmp_path, sanitizer)
    args = ARGS[sanitizer]
    proc = harness.run(binary, *args, sanitizer=sanitizer)
    assert proc.returncode == 0, proc.stderr[-6000:] + proc.stdout
    checks = [
        "abandon",
        "word",
        "finish",
        "discard",
        "settle",
        "watch",
        "notify",
        "parts",
        "blocks",
        "calls",
        "deadlines",
        *args[1:],
    ]
    assert proc.stdout.split() == [word for check in checks for word in ("ok", check)]


@pytest.mark.parametrize("sanitizer", harness.SANITIZERS, ids=["plain", "tsan", "asan"])
def test_a_queue_backlog_is_never_copied_and_its_memory_goes_back_once_it_ran(
    tmp_path: Path, sanitizer: str
) -> None:
    """A push behind 100,000 queued commands allocates one segment of commands at most
    (an event loop's launch never copies the backlog), the commands run in order, and
    once they ran the queue holds what it held before, but for one spare segment
    (tests/support/native/queue_backlog.c). Checked: fails without the fix (one ring of
    commands that doubled, copying them all, and never shrank)."""
    binary = harness.build("queue_backlog.c", tmp_path, sanitizer, defines=("AM_TEST_HOST_ALLOC",))
    proc = harness.run(binary, "100000", sanitizer=sanitizer)
    assert proc.returncode == 0, proc.stderr[-6000:] + proc.stdout
    assert proc.stdout.split() == ["ok", "backlog"]


@pytest.mark.parametrize("sanitizer", harness.SANITIZERS, ids=["plain", "tsan", "asan"])
def test_queue_segments_under_concurrent_pushes_closes_and_drains_at_their_edges(
    tmp_path: Path, sanitizer: str
) -> None:
    """A cpu queue's command segments: backlogs held and drained at and around a
    segment's end (63, 64, 65, 128 ... commands), four threads pushing at once, a close
    (finishing or abandoning) and a discard landing in a backlog -- every command runs
    once and in order, or never, and no segment outlives its queue
    (tests/support/native/queue_segments.c)."""
    binary = harness.build("queue_segments.c", tmp_path, sanitizer, defines=("AM_TEST_HOST_ALLOC",))
    proc = harness.run(binary, "200" if sanitizer else "1000", sanitizer=sanitizer)
    assert proc.returncode == 0, proc.stderr[-6000:] + proc.stdout
    checks = ["edges", "pushers", "closing", "discard"]
    assert proc.stdout.split() == [word for check in checks for word in ("ok", check)]


@pytest.mark.parametrize("sanitizer", harness.SANITIZERS, ids=["plain", "tsan", "asan"])
def test_a_queue_holds_the_timelines_its_commands_use_until_they_passed(
    tmp_path: Path, sanitizer: str
) -> None:
    """A timeline whose owner lets go of it while a cpu queue waits on it, has a signal
    of it queued, or raises it (its own) stays until those commands passed or were
    dropped unrun at the close, which lets go of it then (tests/support/native/
    queue_timelines.c). Checked: fails without the queue's references (letting go of the
    timeline waited on hung: its condition destroyed under the waiter)."""
    binary = harness.build(
        "queue_timelines.c", tmp_path, sanitizer, defines=("AM_TEST_HOST_ALLOC",)
    )
    proc = harness.run(binary, sanitizer=sanitizer)
    assert proc.returncode == 0, proc.stderr[-6000:] + proc.stdout
    checks = ["waited", "signalled", "own", "dropped", "edges", "word", "discarded", "refused"]
    assert proc.stdout.split() == [word for check in checks for word in ("ok", check)]


# ---- a cpu queue's close, from several threads ----------------------------------------


@pytest.mark.anyio
async def test_every_close_of_a_cpu_queue_returns_once_it_is_released(
    anyio_backend: object,
) -> None:
    """Two threads close one cpu queue natively at once, its commands held behind a
    device wait: neither returns before the wait is signalled and the queue released
    (NativeQueue.close: finish what was submitted, then release it). Checked: without
    the fix the second returned at once, the first still waiting in the native close."""
    async with am.open_device("cpu") as dev:
        queue, gate = held_queue(dev)
        done = queue.marker()
        native = native_queue(queue)
        closed: list[str] = []

        def close(who: str) -> None:
            native.close()
            closed.append(who)

        first = threading.Thread(target=close, args=("first",), daemon=True)
        second = threading.Thread(target=close, args=("second",), daemon=True)
        first.start()
        with anyio.fail_after(10):
            while getattr(native, "_handle", 0) is not None:  # (taken: inside its close)
                await anyio.sleep(0.001)
        second.start()
        await anyio.sleep(0.3)
        assert closed == [] and first.is_alive() and second.is_alive()
        gate.signal(1)
        with anyio.fail_after(10):
            while first.is_alive() or second.is_alive():
                await anyio.sleep(0.001)
        assert sorted(closed) == ["first", "second"]
        await done


def _threads_here() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.anyio
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
async def test_a_cpu_queue_collected_unclosed_releases_its_thread(anyio_backend: object) -> None:
    """A new_queue that fails once its native queue was made (here: its failure word
    not to be read; an interrupt there alike) hands out nothing, and nothing else holds
    that queue: collected, its thread stops (with its memory), as does that of a
    CPUQueue made and dropped unclosed. Checked: without the finalizer those threads
    stayed for good (the count never came back down)."""
    async with am.open_device("cpu") as dev:
        await dev.queue.marker()
        before = _threads_here()
        fail_new_queues(dev, _native, "failed_from")
        lib = _native.runtime()
        timeline = CPUTimeline(lib)
        for _ in range(4):
            CPUQueue(lib, timeline)  # (dropped at once)
        gc.collect()
        with anyio.move_on_after(10):
            while _threads_here() > before:
                await anyio.sleep(0.01)
        assert _threads_here() <= before
        async with dev.new_queue() as queue:  # (the device goes on)
            buf = await dev.alloc(16)
            await queue.copy(buf, np.arange(4, dtype=np.float32))
            assert (await buf.read(np.float32)).tolist() == [0, 1, 2, 3]


# ---- kernel libraries: names resolved in the library itself, unloaded at close -------

_SHADOWED = """
#include <stdlib.h>
#if 0
void getpid(void) {}  /* not compiled: the C library's getpid must not stand in for it */
#endif
/* calls the C library, which the library then depends on (dlsym searches it) */
void present(int* out) { out[0] = getenv("ASYNCMETAL_NOT_SET_ANYWHERE") ? 1 : 7; }
"""


@pytest.mark.anyio
async def test_a_kernel_missing_from_the_library_is_not_found_in_its_dependencies(
    anyio_backend: object,
) -> None:
    async with am.open_device("cpu") as dev:
        with pytest.raises(am.CompileError, match="'getpid'"):
            await dev.compile(_SHADOWED, "getpid")
        present = await dev.compile(_SHADOWED, "present")
        buf = await dev.alloc(4)
        await dev.queue.launch(present, buf)
        assert (await buf.read(np.int32))[0] == 7


def _kernel_mappings() -> int:
    """Mappings of kernel libraries the cpu device loaded (their files are deleted)."""
    with open("/proc/self/maps") as maps:
        return sum("/asyncmetal-" in line and ".so" in line for line in maps)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
@pytest.mark.anyio
async def test_closing_a_device_unmaps_its_kernel_libraries(anyio_backend: object) -> None:
    src = "void k(int* out) { out[0] += 1; }\n"
    before = _kernel_mappings()
    for _ in range(100):  # a compile cache hit after the first: the same binary each time
        async with am.open_device("cpu") as dev:
            program = await dev.compile(src, "k")
            buf = await dev.alloc(4)
            await dev.queue.launch(program, buf)
    assert _kernel_mappings() - before <= 0
    # A Program of a closed device is refused, on its device's queue and on another's.
    with pytest.raises(am.ClosedResourceError):
        dev.queue.launch(program, buf)
    async with am.open_device("cpu") as other:
        with pytest.raises(am.InvalidArgumentError, match="compiled for"):
            other.queue.launch(program, await other.alloc(4))


_OPENMP = r"""
import time, anyio, numpy as np, asyncmetal as am
SRC = "void k(int* x, int n) {\n#pragma omp parallel for\nfor (int i = 0; i < n; i++) x[i] = i;\n}"
def mapped(part):
    with open("/proc/self/maps") as maps:
        return sum(part in line for line in maps)
async def main():
    for _ in range(3):
        async with am.open_device("cpu") as dev:
            program = await dev.compile(SRC, "k", options=("-fopenmp",))
            buf = await dev.alloc(4096)
            await dev.queue.launch(program, buf, vals=(1024,))
            assert (await buf.read(np.int32))[1023] == 1023
            assert mapped(".so (deleted)") > 0  # (the kernel library, its file deleted)
        time.sleep(0.1)  # (the OpenMP workers, spinning, run into anything unmapped)
    print("kernel libraries", mapped(".so (deleted)"), "openmp", mapped("libgomp"))
anyio.run(main)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_a_kernel_librarys_dependencies_stay_loaded_once_it_is_unloaded() -> None:
    """An OpenMP kernel, its device closed: the kernel library is unmapped, the OpenMP
    runtime it brought is not. Its worker threads outlive the queue thread that ran the
    kernel and spin in its code: unmapped with the kernel library, it killed the process
    at times (SIGSEGV; checked: without the pinning the runtime was unmapped)."""
    proc = subprocess.run(
        [sys.executable, "-c", _OPENMP],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_WAIT_POLICY": "active", "OMP_NUM_THREADS": "2"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = proc.stdout.split()
    assert counts[2] == "0", proc.stdout  # the kernel libraries: unmapped
    assert int(counts[4]) > 0, proc.stdout  # the OpenMP runtime: kept


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
@pytest.mark.anyio
async def test_programs_no_longer_used_are_unloaded_while_the_device_stays_open(
    anyio_backend: object,
) -> None:
    """A long-lived device that compiles kernel after kernel (a service building one per
    shape) keeps only the programs in use mapped: one collected is unloaded by a later
    compile once what launched it has run. One compiled again loads afresh."""
    sources = [f"void k(int* out) {{ out[0] += {i}; }}\n" for i in range(12)]
    async with am.open_device("cpu") as dev:
        buf = await dev.alloc(4)
        await buf.write(np.zeros(1, np.int32))
        before = _kernel_mappings()
        program = await dev.compile(sources[0], "k")
        per_library = _kernel_mappings() - before
        await dev.queue.launch(program, buf)
        for src in sources[1:]:
            program = await dev.compile(src, "k")  # the one before is collected
            await dev.queue.launch(program, buf)
        assert _kernel_mappings() - before <= 2 * per_library  # (12 before)
        assert (await buf.read(np.int32))[0] == sum(range(12))
        again = await dev.compile(sources[0], "k")
        await dev.queue.launch(again, buf)
        assert (await buf.read(np.int32))[0] == sum(range(12))


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
@pytest.mark.anyio
async def test_a_program_collected_while_its_launch_waits_stays_loaded_until_it_ran(
    anyio_backend: object,
) -> None:
    async with am.open_device("cpu") as dev:
        buf = await dev.alloc(4)
        queue, timeline = dev.new_queue(), dev.timeline()
        before = _kernel_mappings()
        program = await dev.compile("void k(int* out) { out[0] = 41; }\n", "k")
        loaded = _kernel_mappings()
        queue.wait(timeline, 1)
        done = queue.launch(program, buf)
        del program
        gc.collect()
        other = await dev.compile("void k(int* out) { out[0] += 1; }\n", "k")
        assert _kernel_mappings() - before == 2 * (loaded - before)  # both still mapped
        timeline.signal(1)
        await done
        await queue.launch(other, buf)
        assert (await buf.read(np.int32))[0] == 42
        del other
        gc.collect()
        await dev.compile("void k(int* out) { out[0] = 0; }\n", "k")  # unloads both
        assert _kernel_mappings() - before == loaded - before


@pytest.mark.anyio
async def test_a_program_loaded_for_a_cancelled_compile_is_unloaded_later(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compile cancelled while its library loads on a worker thread (asyncio's own
    cancel ends the wait, not the thread; the load slowed here): the library it loaded,
    owned by no Program, is unloaded by a later compile (before, it stayed until close)."""
    async with am.open_device("cpu") as dev:
        backend = dev._backend
        await dev.compile("void k1(int* x) { x[0] = 1; }", "k1")  # compiled: cached
        gc.collect()  # (its Program gone: compiled again, it is loaded again)
        load = backend.load

        def slow_load(binary: bytes, name: str) -> Any:
            time.sleep(0.2)
            return load(binary, name)

        monkeypatch.setattr(backend, "load", slow_load)
        if am._bridge.running_asyncio_loop() is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(dev.compile("void k1(int* x) { x[0] = 1; }", "k1"), 0.1)
        else:
            with anyio.move_on_after(0.1):
                await dev.compile("void k1(int* x) { x[0] = 1; }", "k1")
        await anyio.sleep(0.3)  # the load ended meanwhile
        monkeypatch.undo()
        kept = await dev.compile("void k2(int* x) { x[0] = 2; }", "k2")
        assert len(backend._libraries) == 1, "a library nothing owns is still loaded"
        del kept


def test_a_closed_cpu_backend_loads_nothing() -> None:
    """A compile that finishes after its device closed loads no library the close would
    have missed (or unloaded under it)."""
    backend = CPUBackend(0)
    binary = backend.compiler.compile("void k(void) {}")
    assert backend.load(binary, "k")
    backend.close()
    with pytest.raises(am.ClosedResourceError):
        backend.load(binary, "k")


def test_a_free_the_gc_makes_on_the_cpu_freer_as_it_starts_does_not_deadlock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GC may run finalizers on a new thread as it starts, before Thread.start()
    returns to the thread that started it: one there freeing memory of the same backend
    (a DLPack loan ending after its device's allocator closed) is not held up by the
    first free, which starts the freer thread and waits for it to start. Checked
    failing without: the first free held the freer lock across the start, and both
    threads waited for each other for good."""
    backend = CPUBackend(0)
    first, second = backend.allocate(4096), backend.allocate(4096)
    thread_class = threading.Thread

    class GCAsItStarts(thread_class):
        def _set_native_id(self) -> None:  # (on the new thread, before it says started)
            if self.name == "asyncmetal-cpu-free":
                backend.free(second)  # what a finalizer the GC ran here would do
            super()._set_native_id()  # type: ignore[misc]

    monkeypatch.setattr(threading, "Thread", GCAsItStarts)
    freeing = thread_class(target=backend.free, args=(first,), daemon=True)
    freeing.start()
    freeing.join(10)
    monkeypatch.undo()
    assert not freeing.is_alive(), "the first free and the freer thread wait for each other"
    backend.close()
    assert backend.live_allocations == 0
    assert first.array.size == second.array.size == 0  # both let go of


# ---- timeline values: read with acquire ordering where a plain load is not ----------


@pytest.mark.parametrize("plain", [True, False], ids=["plain-load", "acquire-load"])
def test_timeline_readers_follow_the_native_value(plain: bool) -> None:
    lib = _native.runtime()
    timeline = lib.am_timeline_new()
    try:
        reader = _native.timeline_reader(timeline, plain)
        assert reader.value == 0
        lib.am_timeline_signal(timeline, 5)
        assert reader.value == 5
        lib.am_timeline_signal(timeline, (1 << 64) - 1)
        assert reader.value == (1 << 64) - 1
    finally:
        lib.am_timeline_free(timeline)


@pytest.mark.anyio
async def test_cpu_timelines_use_acquire_loads_on_weakly_ordered_machines(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on arm64: every timeline of the device is read through an acquire load, and
    what a kernel wrote is there once its completion is seen."""
    monkeypatch.setattr(_native, "PLAIN_LOADS_ACQUIRE", False)
    async with am.open_device("cpu") as dev:
        program = await dev.compile("void k(int* o, int v) { o[0] = v; }", "k")
        buf = await dev.alloc(4)
        timeline = dev.timeline()
        for native in (dev.queue.timeline.native, timeline.native):
            assert type(native.value) is int
            assert not isinstance(native._value, ctypes.c_uint64)
        for v in range(1, 50):
            dev.queue.launch(program, buf, vals=(v,))
            dev.queue.signal(timeline, v)
            await timeline.wait(v)
            assert (await buf.read(np.int32))[0] == v

"""Forking a process that has devices open (contract 9: forking loses nothing).

A child gets the parent's memory but none of its threads. Every use in the child of a
device opened in the parent -- its queues, buffers, timelines, programs, completions --
raises a ClosedResourceError naming the parent process, never hangs; the child opens
cpu devices of its own, which work; its exit never waits for the parent's threads; and
the parent's devices go on as if nothing happened. Each scenario runs in a fresh
interpreter (tests/reliability/test_fork.py's SCRIPT), bounded in time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fakes import metal_sim

# What the scripts start with: forking and waiting for the child, bounded, and checking
# a refusal. (``am`` is imported by each script.)
PRELUDE = r"""
import os, sys, time
import anyio, numpy as np

checks = []


def wait_child(pid, seconds=30.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "hung"


async def refused(what, make):  # the await raises ClosedResourceError naming the parent
    try:
        result = make()
        if hasattr(result, "__await__"):
            await result
    except am.ClosedResourceError as exc:
        if f"opened in process {os.getppid()}" not in str(exc):
            checks.append(f"{what}: unclear: {exc}")
    except Exception as exc:
        checks.append(f"{what}: {type(exc).__name__}: {exc}")
    else:
        checks.append(f"{what}: not refused")


# Fork; the child exits at once ("exit"), from inside a running loop ("exit-in-loop"),
# or after child(*objects) ("use"); the parent waits for it.
def fork_and_check(scenario, child, objects):
    if scenario == "exit-in-loop":
        async def fork_in_loop():
            pid = os.fork()
            if pid == 0:
                sys.exit(0)  # from inside the running loop: asyncio.run's teardown, atexit
            return pid
        pid = anyio.run(fork_in_loop)
    else:
        pid = os.fork()
        if pid == 0:
            if scenario == "use":
                anyio.run(child, *objects)
                if checks:
                    print("\n".join("child: " + c for c in checks), flush=True)
                sys.exit(1 if checks else 0)
            sys.exit(0)
    code = wait_child(pid)
    if code != 0:
        checks.append(f"the child exited with {code}")
"""

SCRIPT = (
    PRELUDE
    + r"""
import tempfile
import asyncmetal as am
from asyncmetal import _device
from asyncmetal.backends.cpu import CCompiler

SRC = "void k(int* o, int v) { o[0] = v; }"


async def child(dev, program, buf, tl, queue, pending):
    with anyio.fail_after(20):
        await refused("launch", lambda: dev.queue.launch(program, buf, vals=(5,)))
        await refused("launch, no buffer", lambda: queue.launch(dev._programs_empty))
        await refused("await a completion", lambda: pending)
        await refused("completion.done", pending.done)
        await refused("timeline.wait", lambda: tl.wait(1))
        await refused("timeline.value", lambda: tl.value)
        await refused("timeline.signal", lambda: tl.signal(1))
        await refused("queue.signal", lambda: queue.signal(tl, 2))
        await refused("buffer.read", lambda: buf.read(np.int32))
        await refused("buffer.write", lambda: buf.write(np.zeros(1, np.int32)))
        await refused("copy", lambda: am.copy(np.zeros(1, np.int32), buf))
        await refused("compile", lambda: dev.compile(SRC, "k"))
        await refused("compile_many's step", dev._stepping.__anext__)
        await refused("alloc", lambda: dev.alloc(4))
        await refused("timeline()", dev.timeline)
        await refused("new_queue", dev.new_queue)
        await refused("synchronize", dev.synchronize)
        await refused("queue.wait", lambda: queue.wait(tl, 3))
        await refused("buffer.free", buf.free)
        await dev.close()  # the parent's: nothing to do here, and no hang
        try:
            await am.open_device("cuda")
        except am.AsyncMetalError as exc:
            if "forked" not in str(exc):
                checks.append(f"cuda: unclear: {exc}")
        else:
            checks.append("cuda: opened in a child of a process that used it")
        async with am.open_device("cpu") as mine:  # the child's own device works
            own = await mine.compile(f"/* new to the cache: {time.time_ns()} */ {SRC}", "k")
            mbuf = await mine.alloc(4)
            await mine.queue.launch(own, mbuf, vals=(9,))
            if (await mbuf.read(np.int32))[0] != 9:
                checks.append("the child's own device gave a wrong result")
        mine2 = await am.open_device("cpu:1")  # left open: closed at exit
        await mine2.queue.launch(await mine2.compile(SRC, "k"), await mine2.alloc(4), vals=(1,))


async def parent_open():
    dev = await am.open_device("cpu")
    # New to the cache: compiled in the pool's workers, which then are the parent's.
    program = await dev.compile(f"/* {time.time_ns()} */ {SRC}", "k")
    buf = await dev.alloc(4)
    await dev.queue.launch(program, buf, vals=(3,))
    tl = dev.timeline()
    queue = dev.new_queue()
    queue.wait(tl, 1)  # its thread sleeps on tl's condition across the fork
    pending = queue.launch(program, buf, vals=(4,))
    dev._programs_empty = await dev.compile("void e(void) {}", "e")  # (held for the child)
    # A compile_many whose kernel is in the pool, compiling (for good: a compiler that
    # hangs), as the process forks.
    hanging = os.path.join(tempfile.mkdtemp(), "hanging-cc")
    with open(hanging, "w") as f:
        f.write('#!/bin/sh\ncase " $* " in *" -shared "*) exec sleep 1000;; esac\nexec cc "$@"\n')
    os.chmod(hanging, 0o755)
    compiler, dev._backend._compiler = dev._backend._compiler, CCompiler(hanging)
    dev._stepping = dev.compile_many([(f"/* {time.time_ns()} */ {SRC}", "k")])
    async with anyio.create_task_group() as tg:
        tg.start_soon(dev._stepping.__anext__)
        while not dev.compile_pool._in_flight:  # submitted
            await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    dev._backend._compiler = compiler
    getattr(_device, "_kinds_opened", set()).add("cuda")  # as if it had opened cuda too
    return dev, program, buf, tl, queue, pending


async def parent_finish(dev, buf, tl, pending):
    with anyio.fail_after(20):
        await dev._stepping.aclose()  # (its compile is killed at exit)
        tl.signal(1)
        await pending
        if (await buf.read(np.int32))[0] != 4:
            checks.append("the parent's device lost work")
        await dev.close()


def main(scenario):
    objects = anyio.run(parent_open)
    dev, program, buf, tl, queue, pending = objects
    stop, submitter = False, None
    if scenario == "use-while-submitting":  # a parent thread may hold the device's
        scenario = "use"  # submission lock as the process forks

        def submit(q=dev.new_queue(), out=np.zeros(1, np.int32)):
            while not stop:
                q.copy(out, buf)

        import threading

        submitter = threading.Thread(target=submit)
        submitter.start()
        time.sleep(0.05)
    fork_and_check(scenario, child, objects)
    stop = True
    if submitter is not None:
        submitter.join()
    anyio.run(parent_finish, dev, buf, tl, pending)
    print("\n".join(checks) if checks else "ok", flush=True)


main(sys.argv[1])
"""
)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
@pytest.mark.parametrize("scenario", ["exit", "exit-in-loop", "use", "use-while-submitting"])
def test_a_forked_child_is_refused_the_parents_devices_and_exits(scenario: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, scenario], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.split("\n")[-2:] == ["ok", ""], (
        proc.stdout + proc.stderr[-4000:]
    )


# A cuda device (the fake driver of tests/reliability/test_cuda_faults.py, whose queues
# run nothing: a command is numbered and confirmed by hand) or the simulated Metal. In
# the child, a completion and a timeline of the parent's were never reached: awaiting
# them parked for good before the backends cut their values off at the fork.
GPU_SCRIPT = (
    PRELUDE
    + r"""
sys.path.insert(0, sys.argv[1])
kind, scenario = sys.argv[2], sys.argv[3]
import pytest
from tests.support.fakes import metal_sim
metal_sim.configure()
import asyncmetal as am
from tests.reliability.test_cuda_faults import fake_driver, numbered_only
from tests.support.kernels import MSL_KERNELS

if kind == "cuda":
    next(fake_driver(pytest.MonkeyPatch()))


async def parent_open():
    dev = await am.open_device("cuda:0" if kind == "cuda" else "metal")
    tl = dev.timeline()
    queue = dev.new_queue()
    if kind == "cuda":
        pending = queue._submit(numbered_only)
    else:
        queue.wait(tl, 1)  # the command waits on the device across the fork
        pending = queue.launch(await dev.compile(MSL_KERNELS, "empty"))
    return dev, tl, pending


async def child(dev, tl, pending):
    with anyio.fail_after(20):
        await refused("await a completion", lambda: pending)
        await refused("completion.done", pending.done)
        await refused("timeline.wait", lambda: tl.wait(1))
        await refused("timeline.value", lambda: tl.value)
        await dev.close()  # the parent's: nothing to do here, and no hang


async def parent_finish(dev, tl, pending):
    with anyio.fail_after(20):
        tl.signal(1)
        if kind == "cuda":
            pending.queue.timeline.native.signal(pending.value)  # as its thread would
        await pending
        await dev.close()


objects = anyio.run(parent_open)
fork_and_check(scenario, child, objects)
anyio.run(parent_finish, *objects)
print("\n".join(checks) if checks else "ok", flush=True)
"""
)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
@pytest.mark.parametrize("scenario", ["exit", "exit-in-loop", "use"])
@pytest.mark.parametrize(
    "kind",
    [
        "cuda",
        pytest.param(
            "metal",
            marks=[
                pytest.mark.metal,
                pytest.mark.skipif(
                    metal_sim.missing() is not None, reason=f"{metal_sim.missing()}"
                ),
            ],
        ),
    ],
)
def test_a_forked_child_of_a_gpu_process_gets_errors_and_exits(kind: str, scenario: str) -> None:
    root = str(Path(__file__).parents[2])
    proc = subprocess.run(
        [sys.executable, "-c", GPU_SCRIPT, root, kind, scenario],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.split("\n")[-2:] == ["ok", ""], (
        proc.stdout + proc.stderr[-4000:]
    )


_FORK_WHILE_THE_ALLOCATOR_IS_LOCKED = """
import os, signal, sys, threading, time
import anyio
import asyncmetal as am

async def main():
    dev = await am.open_device("cpu")
    buf = await dev.alloc(1 << 20)
    await buf.free()  # cached
    backend = dev._allocator._state.backend
    free, inside = backend.free, threading.Event()

    def slow_free(handle):  # a slow native free: the allocator's lock is held meanwhile
        inside.set()
        time.sleep(1.0)
        free(handle)

    backend.free = slow_free
    evicting = threading.Thread(target=setattr, args=(dev, "memory_cache_limit", 0))
    evicting.start()
    inside.wait()
    pid = os.fork()
    if pid == 0:
        signal.alarm(10)  # a child that hangs is killed
        dev.memory_statistics()
        try:  # (taken under the allocator's lock: refused, the parent's device closed here)
            dev.memory_cache_limit = 0
        except am.ClosedResourceError:
            os._exit(0)
        os._exit(3)
    _, status = os.waitpid(pid, 0)
    print(status)
    evicting.join()
    backend.free = free
    await dev.close()

anyio.run(main)
"""


def test_a_child_forked_while_a_thread_holds_the_allocators_lock_does_not_hang() -> None:
    """Another thread of the parent held the device's allocator lock at the fork (a
    slow native free): in the child the allocator's locks are new, so its statistics
    and settings (refused there: the device is closed) do not wait for a thread that
    does not exist there (checked: the child hung in memory_statistics())."""
    assert _child_prints(_FORK_WHILE_THE_ALLOCATOR_IS_LOCKED) == ["0"]


_FORK_HOLDING = """
import os, signal, threading


def fork_holding(lock, in_child):
    # Fork while another thread holds `lock`; the child runs in_child() and exits (killed
    # by an alarm if it hangs). The child's exit status, once the holder let go.
    holding, go_on = threading.Event(), threading.Event()

    def hold():
        with lock:
            holding.set()
            go_on.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    holding.wait()
    pid = os.fork()
    if pid == 0:
        signal.alarm(10)
        in_child()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    go_on.set()
    holder.join()
    return status
"""


_FORK_AS_A_RELEASE_IS_COUNTED = (
    _FORK_HOLDING
    + """
import os, signal, threading
import anyio
import asyncmetal as am

async def main():
    dev = await am.open_device("cpu")
    bufs = [await dev.alloc(4096), await dev.alloc(4096)]
    # a thread inside the count of a release (a free, a buffer dropped); in the child a
    # buffer of the parent's device dropped
    print(fork_holding(dev._allocator._frees._counter._lock, bufs.pop))
    await bufs.pop().free()
    print(dev.memory_statistics().in_use)
    await dev.close()

anyio.run(main)
"""
)


def test_a_child_forked_as_a_release_is_counted_drops_the_parents_buffers() -> None:
    """Another thread of the parent was counting a release (its counter's lock held)
    at the fork: in the child a buffer of the parent's device dropped counts one too,
    which must not wait for a thread that does not exist there. Checked: fails without
    the fix (the child hung, killed by its alarm: status 14)."""
    assert _child_prints(_FORK_AS_A_RELEASE_IS_COUNTED) == ["0", "4096"]


_EMPTY_THE_PARENTS_CACHE_IN_THE_CHILD = """
import os, signal
import anyio
import asyncmetal as am


async def parent_open():
    dev = await am.open_device("cpu")
    buf = await dev.alloc(4096)
    await buf.free()  # cached
    return dev


async def child(dev):
    live = dev._backend.live_allocations
    allocator = dev._allocator
    allocator.cache_max_age = allocator._next_expiry = 0.0  # as if cached long ago
    stats = dev.memory_statistics()  # (a look that frees blocks cached that long)
    released = await dev.empty_memory_cache()  # the parent's cache: nothing of it here
    print(stats.cached, released, dev._backend.live_allocations - live, flush=True)


dev = anyio.run(parent_open)
pid = os.fork()
if pid == 0:
    signal.alarm(10)  # a child that hangs is killed
    anyio.run(child, dev)
    os._exit(0)
os.waitpid(pid, 0)
print(dev.memory_statistics().cached)
anyio.run(dev.close)
"""


def test_a_child_empties_none_of_the_parents_memory_cache() -> None:
    """In a forked child the parent's device is closed, its memory the parent's: its
    ``empty_memory_cache()`` releases nothing there (as on a closed device: 0 bytes),
    nor does a look at its statistics free blocks cached long ago, rather than hand
    the parent's cached blocks to the backend's free -- on cuda a freeing thread's
    queue and lock that are the parent's. Checked: fails without the fix (the child
    released the 4096 bytes; with the cache emptied only, its statistics freed them)."""
    prints = _child_prints(_EMPTY_THE_PARENTS_CACHE_IN_THE_CHILD)
    assert prints == ["4096", "0", "0", "4096"]


_WRAPPED_IN_THE_PARENT = """
import os, signal
import anyio
import numpy as np
import asyncmetal as am

array = np.zeros(4, np.int32)


async def parent_open():
    dev = await am.open_device("cpu")
    return dev, am.from_dlpack(array)  # (the buffer lives on in the child)


async def child():  # the array as host operand of the child's own queues, of two kinds
    source = await am.from_numpy(np.full(4, 3, np.int32))
    await source.device.queue.copy(array, source)
    print(*array, flush=True)
    async with am.open_device("cpu") as dev:
        buf = await dev.alloc(16)
        await dev.queue.copy(buf, array)
        print(*(await buf.read(np.int32)), flush=True)


dev, buf = anyio.run(parent_open)
pid = os.fork()
if pid == 0:
    signal.alarm(10)  # a child that hangs is killed
    anyio.run(child)
    os._exit(0)
os.waitpid(pid, 0)
anyio.run(dev.close)
"""


def test_an_array_a_parents_buffer_wraps_is_a_plain_host_operand_in_the_child() -> None:
    """In a forked child a numpy array that a buffer of the parent's device wraps
    (``am.from_dlpack``) is a plain host operand of the child's own queues -- of an
    npy and of a cpu device -- as once the parent's device closed, not memory of that
    device's buffer, refused as the parent's. Checked: fails without the fix (the npy
    queue's copy raised ClosedResourceError naming the parent's cpu)."""
    assert _child_prints(_WRAPPED_IN_THE_PARENT) == ["3"] * 8


_FORK_AS_A_THREAD_HOLDS_A_SHARED_LOCK = (
    _FORK_HOLDING
    + """
import asyncio, os, signal, sys, threading
import numpy as np
import asyncmetal as am
from asyncmetal import _backend, _bridge

# What a parent thread holds as the process forks: the lock around making a loop's
# bridge (its first await of asyncmetal's), or around queues' records of what they keep
# (a queue being made).
lock = {"bridges": _bridge._bridges_lock, "keeps": _backend._keeps_lock}[sys.argv[1]]


async def child():  # a device of the child's own, on its first loop
    async with am.open_device("cpu") as dev:
        buf = await dev.alloc(16)
        await buf.write(np.arange(16, dtype=np.uint8))
        assert (await buf.read())[5] == 5


async def main():
    dev = await am.open_device("cpu")
    print(fork_holding(lock, lambda: asyncio.new_event_loop().run_until_complete(child())))
    await dev.close()

asyncio.run(main())
"""
)


@pytest.mark.parametrize("lock", ["bridges", "keeps"])
def test_a_child_forked_as_a_thread_holds_a_shared_lock_opens_its_own_devices(
    lock: str,
) -> None:
    """Another thread of the parent held a lock of asyncmetal's own that a child's
    devices take too (making a loop's bridge, a queue's record of what it keeps) at the
    fork: the child opens and uses a device of its own without waiting for a thread
    that does not exist there. Checked: fails without the fix (the child hung, killed
    by its alarm: status 14)."""
    assert _child_prints(_FORK_AS_A_THREAD_HOLDS_A_SHARED_LOCK, lock) == ["0"]


_WAIT_FOR_A_LOAN_IN_THE_CHILD = """
import os, signal
import anyio
import numpy as np
import asyncmetal as am


async def parent_open():  # a queue of the parent's keeps a timeline for its wait
    dev = await am.open_device("cpu")
    queue, gate, other = dev.new_queue(), dev.timeline(), dev.timeline()
    queue.wait(gate, 1)
    return dev, gate, queue.signal(other, 1)


async def child():  # an allocation of the child's own device waits for a loan to end
    async with await am.open_device("cpu") as dev:
        dev.memory_budget = 8192
        buf = await dev.alloc(8192)
        view = np.from_dlpack(buf)  # its memory lent out
        await buf.free()  # allocated while lent
        try:
            await dev.alloc(4096, timeout=0.2)
        except Exception as exc:
            print(type(exc).__name__, flush=True)
        del view


async def parent_close(dev, gate, done):
    gate.signal(1)
    await done
    await dev.close()


dev, gate, done = anyio.run(parent_open)
pid = os.fork()
if pid == 0:
    signal.alarm(10)  # a child that hangs is killed
    anyio.run(child)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
anyio.run(parent_close, dev, gate, done)
"""


def test_a_childs_allocation_waiting_for_a_loan_is_not_refused_by_the_parents_queues() -> None:
    """In a forked child, an allocation of the child's own device that waits for memory
    lent out (DLPack) lets go of what every queue keeps -- not the parent's queues,
    whose timelines refuse every read there: it times out as out of memory, not with the
    parent's device's ClosedResourceError. Checked: fails without the fix (the child's
    allocation raised ClosedResourceError)."""
    assert _child_prints(_WAIT_FOR_A_LOAN_IN_THE_CHILD) == ["OutOfMemoryError", "0"]


_FORK_AS_A_METAL_BLOCK_IS_MADE = (
    _FORK_HOLDING
    + """
import gc, os, signal, sys, threading
sys.path.insert(0, sys.argv[1])
import anyio
from tests.support.fakes import metal_sim

metal_sim.configure()
import asyncmetal as am
from asyncmetal.backends.metal import _blocks


async def main():
    dev = await am.open_device("metal")
    timelines = [dev.timeline()]

    def in_child():  # a timeline of the parent's device dropped in the child
        timelines.clear()
        gc.collect()

    # a thread inside the records of Metal's completion handlers
    print(fork_holding(_blocks._lock, in_child))
    await dev.close()

anyio.run(main)
"""
)


@pytest.mark.metal
@pytest.mark.skipif(metal_sim.missing() is not None, reason=f"{metal_sim.missing()}")
def test_a_child_forked_as_a_metal_block_is_made_drops_the_parents_timelines() -> None:
    """Another thread of the parent held the lock of Metal's completion handlers' records
    at the fork (a command being made, a handler run): a timeline of the parent's Metal
    device dropped in the child frees its native part under that lock, which must not
    wait for a thread that does not exist there. Checked: fails without the fix (the
    child hung, killed by its alarm: status 14)."""
    root = str(Path(__file__).parents[2])
    assert _child_prints(_FORK_AS_A_METAL_BLOCK_IS_MADE, root) == ["0"]


_FORK_WHILE_A_CLOSING_CPU_DEVICE_FREES = """
import os, queue, signal, threading, time
import anyio, numpy as np
import asyncmetal as am


class SlowPuts:  # the cpu freer's queue, whose puts take a while (the freer lock held)
    def __init__(self, inside):
        self.items, self.inside = queue.SimpleQueue(), inside

    def put(self, item):
        if item is not None:
            self.inside.set()
            time.sleep(1.0)
        self.items.put(item)

    def get(self):
        return self.items.get()


async def main():
    dev = await am.open_device("cpu")
    a, b = await dev.alloc(4096), await dev.alloc(4096)
    views = [np.from_dlpack(a), np.from_dlpack(b)]  # lent past the close
    backend = dev._backend
    inside, closing, go_on = threading.Event(), threading.Event(), threading.Event()
    backend._freer.frees = SlowPuts(inside)
    close = backend.close

    def held_close():  # the device's close, held just before its backend's
        closing.set()
        go_on.wait(30)
        close()

    backend.close = held_close
    async with anyio.create_task_group() as tg:
        tg.start_soon(dev.close)
        await anyio.to_thread.run_sync(closing.wait)
        ending = threading.Thread(target=views.pop)  # a loan ends: its memory is freed
        ending.start()
        await anyio.to_thread.run_sync(inside.wait)
        pid = os.fork()
        if pid == 0:
            signal.alarm(10)  # a child that hangs is killed
            views.clear()  # the other loan ends in the child: its memory is freed
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(status)
        go_on.set()
    ending.join()
    print(backend.live_allocations)

anyio.run(main)
"""


def test_a_child_forked_as_a_closing_cpu_device_frees_does_not_hang() -> None:
    """The parent's cpu device was closing (its backend not closed yet) and a thread
    held the backend's freer lock at the fork (a loan ending, its memory freed): in the
    child that device's backend is the parent's as an open one's is, so a loan ending
    there lets its memory go at once rather than wait for a lock, or a freer thread,
    that does not exist there. Checked failing without: the child hung (its alarm
    killed it, status 14)."""
    assert _child_prints(_FORK_WHILE_A_CLOSING_CPU_DEVICE_FREES) == ["0", "1"]


_FORK_WHILE_A_CPU_KERNEL_RUNS = """
import os, signal
import anyio
import asyncmetal as am
from asyncmetal import _native

SRC = "#include <unistd.h>\\nvoid read_one(int fd) { char c; (void)read(fd, &c, 1); }"

async def main():
    async with am.open_device("cpu") as dev:
        prog = await dev.compile(SRC, "read_one")
        r, w = os.pipe()
        done = dev.queue.launch(prog, vals=(r,))  # runs until a byte comes
        while _native.host_running() < 1:
            await anyio.sleep(0.001)
        pid = os.fork()
        if pid == 0:
            signal.alarm(10)
            os._exit(_native.host_running())
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
        os.write(w, b"x")
        await done
        print(_native.host_running())

anyio.run(main)
"""


def test_a_child_forked_while_a_cpu_kernel_runs_counts_no_kernel_running() -> None:
    """The count of the cpu queues' commands running now (``_native.host_running``,
    which ``cores_taken`` compares with the process's cores) starts at none in a forked
    child: the parent's kernel running at the fork does not run there, nor ever ends
    there. Checked failing without: the child counted the parent's kernel (1) for
    good, so on a machine of as many cores as the parent ran kernels at the fork, its
    loops never polled for a timer or a completion again."""
    assert _child_prints(_FORK_WHILE_A_CPU_KERNEL_RUNS) == ["0", "0"]


def _child_prints(script: str, *args: str) -> list[str]:
    """What ``script`` (given ``args``), run in a new interpreter that must exit
    cleanly, printed."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


# A Ctrl-C as a fork's handlers run in the parent: tripped as the C signal handler trips
# it, by a handler that runs no Python code itself, registered where argv says -- its
# after_in_parent handler running before asyncmetal's ("after"), or its before handler
# running before asyncmetal's ("before"). The child exits at once.
_FORK_INTERRUPTED = r"""
import _thread, functools, logging, os, signal, sys
trip = functools.partial(_thread.interrupt_main, signal.SIGINT)
sys.unraisablehook = lambda u: print("lost-in", getattr(u.object, "__module__", u.object))
if sys.argv[1] == "after":
    os.register_at_fork(after_in_parent=trip)
import asyncmetal as am
from asyncmetal import _pool
from asyncmetal.backends import cpu
if sys.argv[1] == "before":
    os.register_at_fork(before=trip)
raised = False
try:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
except KeyboardInterrupt:
    raised = True
os.wait()
print("raised", raised)
"""


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="needs os.register_at_fork")
@pytest.mark.parametrize("where", ["after", "before"])
def test_a_ctrl_c_during_a_fork_is_not_lost_in_asyncmetals_handlers(where: str) -> None:
    """Where Ctrl-C comes as a fork's handlers run in the parent, asyncmetal's handlers
    run no Python code (CPython runs a pending handler in any, and an exception there
    is reported as unraisable, then dropped): the KeyboardInterrupt stays pending
    through them -- raised as os.fork returns, in the parent, where no other library's
    handler runs Python code after them. Before asyncmetal's, logging's (which asyncio
    imports) run, and take it: those must not be asyncmetal's. Checked: fails without
    the fix (lost in _release_after_fork; in _note_fork)."""
    proc = subprocess.run(
        [sys.executable, "-c", _FORK_INTERRUPTED, where], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout.split()
    lost_in = [printed[i + 1] for i, word in enumerate(printed) if word == "lost-in"]
    assert not [m for m in lost_in if m.startswith("asyncmetal")], printed
    if where == "after":
        assert printed == ["raised", "True"], printed

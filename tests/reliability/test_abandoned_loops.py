"""asyncio loops stopped with tasks parked on a timeline and never closed (the thread
that ran ``loop.run_until_complete`` ends, or runs another loop): a loop nothing else
holds goes, with its bridge's wake-up pipe and watches; a loop still held runs its waits
again when it runs again. (A trio run always ends: its bridge closes then.)"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import pytest

import asyncmetal as am
from tests.support.children import run_child
from tests.support.loops import dropped_with_parked_waits, signalled_wait

LOOPS = [pytest.param(False, id="asyncio"), pytest.param(True, id="uvloop")]
LIMIT = 10  # seconds: every wait here ends within a fraction of this, or it hangs


def _new_loop(use_uvloop: bool) -> Callable[[], asyncio.AbstractEventLoop]:
    if use_uvloop:
        uvloop = pytest.importorskip("uvloop", reason="uvloop is a test dependency")
        return uvloop.new_event_loop  # type: ignore[no-any-return]
    return asyncio.new_event_loop


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _open_pipes() -> set[str]:
    """The pipes the process has open, as /proc names them ("pipe:[inode]")."""
    names = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (listdir's own, closed since)
            names.add(os.readlink(f"/proc/self/fd/{fd}"))
    return {name for name in names if name.startswith("pipe:")}


def _collected(refs: list[weakref.ref[asyncio.AbstractEventLoop]]) -> bool:
    """Whether the loops are garbage once collected (a thread's end is seen as the
    thread ends, before join returns; looked at a while, in case it came later)."""
    for _ in range(200):
        gc.collect()
        if all(ref() is None for ref in refs):
            return True
        threading.Event().wait(0.01)
    return False


def _settled_threads(baseline: int) -> int:
    for _ in range(200):
        if threading.active_count() <= baseline:
            break
        threading.Event().wait(0.01)
    return threading.active_count()


def _native_watches_counted(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """The native watches made from now on and not freed yet, kept up to date."""
    lib = am._bridge._native_lib()
    new, free = lib.am_watch_new, lib.am_watch_free
    live: set[int] = set()

    def watch_new(c_timeline: int, notifier: int) -> int:
        handle: int = new(c_timeline, notifier)
        live.add(handle)
        return handle

    def watch_free(handle: int) -> None:
        free(handle)
        live.discard(handle)

    monkeypatch.setattr(lib, "am_watch_new", watch_new)
    monkeypatch.setattr(lib, "am_watch_free", watch_free)
    return live


# The loops were never closed: asyncio warns as each goes, and its finalizer, closing
# the loop, may find the loop's own sockets closed already (collected with it).
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("use_uvloop", LOOPS)
def test_a_loop_left_stopped_by_a_thread_that_ended_is_let_go_of(
    use_uvloop: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Threads each ran a loop until its main task was done, 10 other tasks still parked
    on a device's timeline, and ended without closing it. The timeline held the tasks,
    so the loop, its bridge's wake-up pipe (2 file descriptors), its native watch and
    notifier -- for as long as the device lived. Now each loop is garbage, with its
    bridge, and its pipe is closed; the timeline keeps no watch and the process no
    thread. (uvloop, for its part, does not close a loop that is collected unclosed: its
    own descriptors stay, asyncmetal or not; asyncio's loop closes then.) Every native
    watch made is freed. Checked failing without: the three loops stayed, with their
    pipes and watches, 15 descriptors.

    uvloop's runs in a fresh interpreter: a uvloop loop collected unclosed, its libuv
    handles open, is brought back to life by uvloop as it goes, and found again as
    garbage -- 18 objects a loop -- by every later collection of the process (where
    other tests count what collections find)."""
    if not use_uvloop:
        _loops_left_stopped_are_let_go_of(False, monkeypatch)
        return
    pytest.importorskip("uvloop", reason="uvloop is a test dependency")
    child = run_child(_LEFT_STOPPED_ON_UVLOOP, hung="the child hung", timeout=120)
    assert child.returncode == 0, child.stderr[-4000:]
    assert child.stdout == "ok\n", child.stdout


_LEFT_STOPPED_ON_UVLOOP = """
import pytest
from tests.reliability.test_abandoned_loops import _loops_left_stopped_are_let_go_of
with pytest.MonkeyPatch.context() as monkeypatch:
    _loops_left_stopped_are_let_go_of(True, monkeypatch)
print("ok")
"""


def _loops_left_stopped_are_let_go_of(use_uvloop: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The body of ``test_a_loop_left_stopped_by_a_thread_that_ended_is_let_go_of``."""
    new_loop = _new_loop(use_uvloop)
    boot = asyncio.new_event_loop()
    dev = boot.run_until_complete(am.open_device("cpu"))
    try:
        timeline = dev.timeline()
        boot.run_until_complete(timeline.wait(0))
        gc.collect()
        fds, threads = _fds(), threading.active_count()
        bridges = len(am._bridge._asyncio_bridges)
        loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []
        pipes: list[str] = []
        live = _native_watches_counted(monkeypatch)

        def run() -> None:
            loop = new_loop()
            loops.append(weakref.ref(loop))

            async def main() -> None:
                waits = [asyncio.ensure_future(timeline.wait(1 << 60)) for _ in range(10)]
                await asyncio.sleep(0.02)
                for task in waits:
                    task._log_destroy_pending = False  # type: ignore[attr-defined]
                wake_up = am._bridge.current_bridge()._pipe  # the bridge's pipe
                assert wake_up is not None
                pipes.extend(os.readlink(f"/proc/self/fd/{fd}") for fd in wake_up)

            loop.run_until_complete(main())  # returns with the 10 still parked

        for _ in range(3):
            thread = threading.Thread(target=run)
            thread.start()
            thread.join()
        assert _collected(loops)
        assert len(am._bridge._asyncio_bridges) == bridges
        assert not timeline._watch_of
        assert pipes and not set(pipes) & _open_pipes()
        assert not live
        if not use_uvloop:
            assert _fds() == fds
        assert _settled_threads(threads) <= threads

        async def later() -> None:  # the timeline's waits go on for other loops
            waiting = asyncio.ensure_future(timeline.wait(1))
            await asyncio.sleep(0.01)
            timeline.signal(1)
            await asyncio.wait_for(waiting, 5)

        boot.run_until_complete(later())
    finally:
        boot.run_until_complete(dev.close())
        boot.close()


@pytest.mark.parametrize("use_uvloop", LOOPS)
def test_a_loop_stopped_by_a_thread_that_ended_runs_its_waits_when_run_again(
    use_uvloop: bool,
) -> None:
    """A loop stopped with three tasks parked on a timeline by a thread that then ended,
    the loop still held: it is not torn down. Run again on another thread, each wait
    ends as it would have -- one for a value signalled while it was stopped, one
    cancelled while it was stopped, one for a value signalled after -- and none is left
    counted as waiting."""
    new_loop = _new_loop(use_uvloop)
    boot = asyncio.new_event_loop()
    dev = boot.run_until_complete(am.open_device("cpu"))
    held: list[asyncio.AbstractEventLoop] = []
    waits: list[asyncio.Future[None]] = []
    try:
        timeline = dev.timeline()

        def run() -> None:
            loop = new_loop()
            held.append(loop)

            async def main() -> None:
                waits.extend(asyncio.ensure_future(timeline.wait(v)) for v in (1, 2, 3))
                await asyncio.sleep(0.02)

            loop.run_until_complete(main())

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        (loop,) = held
        assert am._bridge._asyncio_bridges[loop] not in timeline._watch_of  # set aside
        timeline.signal(1)
        loop.call_soon_threadsafe(waits[1].cancel)

        async def again() -> int:
            await asyncio.sleep(0.01)
            timeline.signal(3)
            await asyncio.wait_for(asyncio.gather(waits[0], waits[2]), 5)
            assert waits[1].cancelled()
            await asyncio.sleep(0.01)
            return am.loop_statistics().waiting

        assert loop.run_until_complete(again()) == 0
        loop.close()
    finally:
        boot.run_until_complete(dev.close())
        boot.close()


@pytest.mark.parametrize("use_uvloop", LOOPS)
def test_a_loop_started_again_as_it_is_set_aside_loses_no_wait(use_uvloop: bool) -> None:
    """A loop seen stopped is set aside by another thread (``LoopBridge.suspend``, as
    the thread that ran it ends) while a thread starts it again: meanwhile, a task of
    it parks on a timeline the loop had no watch on, and another takes a place in the
    bridge's next slice (a crowd's park, ``park(None, 0)``). Both are woken once the
    loop runs on, with the task parked before it was set aside. Checked failing
    without: the two tasks were never woken (the watch made meanwhile was set aside and
    never taken back; the place, cleared)."""
    new_loop = _new_loop(use_uvloop)
    loop = new_loop()
    try:
        dev = loop.run_until_complete(am.open_device("cpu"))
        first, later = dev.timeline(), dev.timeline()

        bridge, parked_before = loop.run_until_complete(_park_one(first))
        call_soon_threadsafe = bridge._call_soon_threadsafe
        started, parked = threading.Event(), threading.Event()

        def held(fn: Callable[[], None]) -> None:  # the loop starts as this sets it aside
            del bridge._call_soon_threadsafe  # type: ignore[method-assign]
            started.set()
            parked.wait(10)
            call_soon_threadsafe(fn)

        bridge._call_soon_threadsafe = held  # type: ignore[method-assign]
        setting_aside = threading.Thread(target=bridge.suspend)
        setting_aside.start()
        started.wait(10)

        async def meanwhile() -> None:
            parks = asyncio.ensure_future(later.wait(1))
            while am.loop_statistics().waiting < 2:
                await asyncio.sleep(0)
            takes_a_place = asyncio.ensure_future(bridge.park(None, 0))
            await asyncio.sleep(0)  # (it takes its place; its slice is the next iteration's)
            parked.set()
            setting_aside.join()  # (the loop waits here, its tasks parked, till it is done)
            first.signal(1)
            later.signal(1)
            await asyncio.wait_for(asyncio.gather(parked_before, parks, takes_a_place), 5)

        loop.run_until_complete(meanwhile())
        loop.run_until_complete(dev.close())
    finally:
        loop.close()


def _held_back(bridge: am._bridge.LoopBridge) -> list[Callable[[], None]]:
    """The callback that takes a loop's waiters back as it runs again (``resume``),
    which the next setting aside of ``bridge`` queues on the loop: kept in the list
    returned, for the test to queue once the loop is done with the iteration it runs as
    the setting aside is held (the callback would wait for it to end there)."""
    resumes: list[Callable[[], None]] = []

    def held_back(fn: Callable[[], None]) -> None:
        del bridge._call_soon_threadsafe  # type: ignore[method-assign]
        resumes.append(fn)

    bridge._call_soon_threadsafe = held_back  # type: ignore[method-assign]
    return resumes


@pytest.mark.parametrize("use_uvloop", LOOPS)
def test_a_loop_started_again_as_it_is_set_aside_arms_no_freed_watch(
    use_uvloop: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop seen stopped, two tasks parked on a timeline (for 5 and 7), is set aside by
    another thread while a thread starts it again. The setting aside is held where the
    native runtime frees a native watch (``am_watch_free``, through ctypes, which lets go
    of the GIL: the loop runs on meanwhile), and the loop wakes the task waiting for 5,
    then arms the watch for 7. No native watch is armed once freed (the stand-in for
    ``am_watch_arm`` here records it instead: the real one would write into freed
    memory), both tasks are woken, and every native watch is freed once its waits are
    done. Checked failing without: the setting-aside thread freed the watch the loop
    armed next."""
    new_loop = _new_loop(use_uvloop)
    loop = new_loop()
    try:
        dev = loop.run_until_complete(am.open_device("cpu"))
        timeline, other = dev.timeline(), dev.timeline()

        async def park_two() -> tuple[am._bridge.LoopBridge, list[asyncio.Future[None]]]:
            waits = [asyncio.ensure_future(timeline.wait(v)) for v in (5, 7)]
            while am.loop_statistics().waiting < 2:
                await asyncio.sleep(0.001)
            return am._bridge.current_bridge(), waits

        bridge, waits = loop.run_until_complete(park_two())
        lib = am._bridge._native_lib()
        live = {watch.cwatch for watch in bridge.watches}  # native watches not yet freed
        armed_freed: list[int] = []
        held, go_on = threading.Event(), threading.Event()
        new, free, arm = lib.am_watch_new, lib.am_watch_free, bridge.arm

        def watch_new(c_timeline: int, notifier: int) -> int:
            handle: int = new(c_timeline, notifier)
            live.add(handle)  # (a new one may have the address of one freed)
            return handle

        def watch_free(handle: int) -> None:
            free(handle)
            live.remove(handle)
            if threading.current_thread() is setting_aside:
                held.set()  # (as ctypes has let go of the GIL, the loop runs here)
                go_on.wait(10)

        def watch_arm(handle: int, value: int) -> object:
            if handle not in live:
                armed_freed.append(handle)
                return 0
            return arm(handle, value)

        monkeypatch.setattr(lib, "am_watch_new", watch_new)
        monkeypatch.setattr(lib, "am_watch_free", watch_free)
        monkeypatch.setattr(bridge, "arm", watch_arm)
        resumes = _held_back(bridge)

        def set_aside() -> None:
            bridge.suspend()
            held.set()  # (done without freeing any)

        setting_aside = threading.Thread(target=set_aside)
        setting_aside.start()

        async def meanwhile() -> None:
            held.wait(10)  # (the loop waits here, its tasks parked)
            # A wake-up through the loop's pipe: a watch made now, on another timeline.
            woken = asyncio.ensure_future(other.wait(1))
            while am.loop_statistics().waiting < 3:
                await asyncio.sleep(0)
            timeline.signal(5)
            other.signal(1)
            await asyncio.wait_for(woken, 5)  # (and the watches reached with it)
            go_on.set()
            setting_aside.join()
            for resume in resumes:
                loop.call_soon(resume)
            await asyncio.wait_for(waits[0], 5)
            timeline.signal(7)
            await asyncio.wait_for(waits[1], 5)
            for _ in range(4):  # (an idle watch goes two turns of the loop later)
                await asyncio.sleep(0)

        loop.run_until_complete(meanwhile())
        assert not armed_freed
        assert not live
        loop.run_until_complete(dev.close())
    finally:
        go_on.set()
        loop.close()


class _ReadHook:
    """A timeline's native part whose value, read as the bridge goes through its native
    watches (``LoopBridge._wake_watches``), runs ``hook`` first, once."""

    def __init__(self, native: object, hook: Callable[[], None]) -> None:
        self._native, self._hook = native, hook

    def __getattr__(self, name: str) -> object:
        return getattr(self._native, name)

    @property
    def value(self) -> int:
        if sys._getframe(1).f_code.co_name == "_wake_watches":
            hook, self._hook = self._hook, _nothing
            hook()
        value: int = self._native.value  # type: ignore[attr-defined]
        return value


async def _park_one(timeline: am.Timeline) -> tuple[am._bridge.LoopBridge, asyncio.Future[None]]:
    """A task of the running loop parked on ``timeline`` (for 1), and that loop's bridge."""
    waiting = asyncio.ensure_future(timeline.wait(1))
    while am.loop_statistics().waiting < 1:
        await asyncio.sleep(0.001)
    return am._bridge.current_bridge(), waiting


def _nothing() -> None:
    pass


@pytest.mark.parametrize("use_uvloop", LOOPS)
def test_a_loop_started_again_as_it_is_set_aside_goes_through_its_watches_unhindered(
    use_uvloop: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop seen stopped, a task parked on a timeline, is set aside by another thread
    while a thread starts it again; the setting aside is held as it makes that timeline
    let go of the watch (``_drop_watch``). The loop, woken through its pipe for a watch
    of another timeline made meanwhile (signalled from another thread), goes through its
    native watches, and the setting
    aside goes on and ends as the loop reads that other timeline's value. The loop goes
    on through its watches unhindered, wakes the task of the other timeline, and the
    first task too once its value comes. Checked failing without: the setting aside
    changed the set of native watches the loop went through ("Set changed size during
    iteration", raised in the loop's wake-up; the other task was never woken)."""
    new_loop = _new_loop(use_uvloop)
    loop = new_loop()
    errors: list[object] = []
    go_on = threading.Event()
    try:
        dev = loop.run_until_complete(am.open_device("cpu"))
        timeline, other = dev.timeline(), dev.timeline()

        bridge, parked_before = loop.run_until_complete(_park_one(timeline))
        held, hooked = threading.Event(), threading.Event()
        _drop_watch = timeline._drop_watch

        def held_drop_watch(watch: am._bridge.Watch) -> None:
            if threading.current_thread() is setting_aside:
                held.set()
                go_on.wait(10)
            _drop_watch(watch)

        monkeypatch.setattr(timeline, "_drop_watch", held_drop_watch)
        resumes = _held_back(bridge)
        setting_aside = threading.Thread(target=bridge.suspend)
        setting_aside.start()

        def setting_aside_ends() -> None:  # (on the loop's thread, in its wake-up)
            hooked.set()
            go_on.set()
            setting_aside.join()

        monkeypatch.setattr(other, "native", _ReadHook(other.native, setting_aside_ends))

        async def meanwhile() -> None:
            failed = asyncio.Event()

            def on_error(_: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
                errors.append(context.get("exception", context))
                failed.set()

            loop.set_exception_handler(on_error)
            held.wait(10)  # (the loop waits here, its task parked)
            woken = asyncio.ensure_future(other.wait(1))
            while am.loop_statistics().waiting < 2:
                await asyncio.sleep(0)
            # (From another thread: a task of the loop signalling wakes the loop's tasks
            # itself, without the pipe, and the loop goes through no watches for it.)
            signaller = threading.Thread(target=other.signal, args=(1,))
            signaller.start()
            failing = asyncio.ensure_future(failed.wait())
            await asyncio.wait([woken, failing], timeout=5, return_when="FIRST_COMPLETED")
            failing.cancel()
            assert not errors
            assert hooked.is_set() and woken.done()
            signaller.join()
            for resume in resumes:
                loop.call_soon(resume)
            await asyncio.sleep(0)
            timeline.signal(1)
            await asyncio.wait_for(parked_before, 5)

        loop.run_until_complete(meanwhile())
        loop.run_until_complete(dev.close())
    finally:
        go_on.set()
        loop.close()


@pytest.mark.parametrize("use_uvloop", LOOPS)
def test_a_loop_started_again_as_it_is_set_aside_parks_on_the_watch_set_aside(
    use_uvloop: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop seen stopped, a task parked on a timeline (for 1), is set aside by another
    thread while a thread starts it again; the setting aside is held once the timeline
    has let go of the loop's watch (``_drop_watch``), and a task of the loop parks on
    that timeline (for 2). It takes the watch set aside back, the one task parked before
    with it: both are woken. Checked failing without: the park made another watch (the
    one let go of was not set aside yet), and the task parked before was never woken."""
    new_loop = _new_loop(use_uvloop)
    loop = new_loop()
    go_on = threading.Event()
    try:
        dev = loop.run_until_complete(am.open_device("cpu"))
        timeline = dev.timeline()

        bridge, parked_before = loop.run_until_complete(_park_one(timeline))
        held = threading.Event()
        _drop_watch = timeline._drop_watch

        def held_drop_watch(watch: am._bridge.Watch) -> None:
            _drop_watch(watch)
            if threading.current_thread() is setting_aside:
                held.set()
                go_on.wait(10)

        monkeypatch.setattr(timeline, "_drop_watch", held_drop_watch)
        resumes = _held_back(bridge)
        setting_aside = threading.Thread(target=bridge.suspend)
        setting_aside.start()

        async def meanwhile() -> None:
            held.wait(10)  # (the loop waits here, its task parked)
            parks = asyncio.ensure_future(timeline.wait(2))
            while am.loop_statistics().waiting < 2:
                await asyncio.sleep(0)
            go_on.set()
            setting_aside.join()
            for resume in resumes:
                loop.call_soon(resume)
            await asyncio.sleep(0)
            timeline.signal(2)
            await asyncio.wait_for(asyncio.gather(parked_before, parks), 5)

        loop.run_until_complete(meanwhile())
        loop.run_until_complete(dev.close())
    finally:
        go_on.set()
        loop.close()


@pytest.mark.parametrize("use_uvloop", LOOPS)
def test_a_stopped_loop_runs_its_waits_after_another_loop_ran_on_its_thread(
    use_uvloop: bool,
) -> None:
    """A loop stopped with tasks parked on a timeline, then another loop run on the same
    thread (whose first wait lets go of stopped loops' waits there, for a loop nothing
    else holds): the first, run again, wakes its tasks -- for a value reached while the
    other ran, and one after."""
    new_loop = _new_loop(use_uvloop)
    first = new_loop()
    dev = first.run_until_complete(am.open_device("cpu"))
    try:
        timeline = dev.timeline()

        async def park() -> list[asyncio.Future[None]]:
            waits = [asyncio.ensure_future(timeline.wait(v)) for v in (1, 1, 2)]
            await asyncio.sleep(0.02)
            return waits

        waits = first.run_until_complete(park())

        async def other() -> None:
            waiting = asyncio.ensure_future(timeline.wait(1))
            await asyncio.sleep(0.01)
            timeline.signal(1)
            await asyncio.wait_for(waiting, 5)

        second = new_loop()
        second.run_until_complete(other())
        second.close()
        assert am._bridge._asyncio_bridges[first] not in timeline._watch_of  # set aside

        async def again() -> int:
            await asyncio.sleep(0.01)
            timeline.signal(2)
            await asyncio.wait_for(asyncio.gather(*waits), 5)
            await asyncio.sleep(0.01)
            return am.loop_statistics().waiting

        assert first.run_until_complete(again()) == 0
    finally:
        first.run_until_complete(dev.close())
        first.close()


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # as above
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_stopped_loop_nothing_holds_goes_once_another_loop_runs_on_its_thread() -> None:
    """A loop run until its main task was done, 10 other tasks still parked on a
    timeline, then dropped, unclosed, by a thread that lives on: once another loop's
    first wait on that thread lets go of its waits, it is garbage, and its bridge's pipe
    closed. Checked failing without: the loop stayed, held by the timeline."""
    boot = asyncio.new_event_loop()
    dev = boot.run_until_complete(am.open_device("cpu"))
    try:
        timeline = dev.timeline()

        boot.run_until_complete(signalled_wait(timeline, 1))  # (its bridge, and pipe, made)
        gc.collect()
        fds = _fds()
        dropped = dropped_with_parked_waits(timeline)
        boot.run_until_complete(signalled_wait(timeline, 2))
        assert _collected([dropped])
        assert _fds() == fds
    finally:
        boot.run_until_complete(dev.close())
        boot.close()


@pytest.mark.parametrize("use_uvloop", LOOPS)
def test_a_loop_closed_with_tasks_parked_goes_as_its_thread_ends(use_uvloop: bool) -> None:
    """A thread ran a loop, 10 tasks still parked on a timeline, and closed it without
    cancelling them; no other loop awaits anything after: the loop's waits, watch and
    pipe are let go of as the thread ends (they were at the next loop's first await
    only). Checked failing without: the watch stayed."""
    new_loop = _new_loop(use_uvloop)
    boot = asyncio.new_event_loop()
    dev = boot.run_until_complete(am.open_device("cpu"))
    try:
        timeline = dev.timeline()
        pipes: list[str] = []

        def run() -> None:
            loop = new_loop()

            async def main() -> None:
                waits = [asyncio.ensure_future(timeline.wait(1 << 60)) for _ in range(10)]
                await asyncio.sleep(0.02)
                for task in waits:
                    task._log_destroy_pending = False  # type: ignore[attr-defined]
                wake_up = am._bridge.current_bridge()._pipe
                assert wake_up is not None
                pipes.extend(os.readlink(f"/proc/self/fd/{fd}") for fd in wake_up)

            loop.run_until_complete(main())
            loop.close()  # the 10 still parked

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        assert not timeline._watch_of
        assert pipes and not set(pipes) & _open_pipes()
    finally:
        boot.run_until_complete(dev.close())
        boot.close()


def test_a_trio_run_ended_by_an_error_with_tasks_parked_keeps_nothing() -> None:
    """trio's counterpart: a ``trio.run`` cannot be left stopped -- it returns only once
    every task has ended, also when an error ends it while 10 tasks wait on a timeline
    -- and its bridge closes as the run ends: no watch, pipe or thread is left."""
    import trio

    boot = asyncio.new_event_loop()
    dev = boot.run_until_complete(am.open_device("cpu"))
    try:
        timeline = dev.timeline()
        gc.collect()
        fds, threads = _fds(), threading.active_count()

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                for _ in range(10):
                    nursery.start_soon(timeline.wait, 1 << 60)
                await trio.sleep(0.02)
                raise KeyError("ends the run")

        ended: list[Exception] = []

        def run() -> None:
            try:
                trio.run(main)
            except Exception as error:  # (the KeyError, in trio's exception group)
                ended.append(error)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        assert "KeyError" in repr(ended)
        gc.collect()
        assert not timeline._watch_of
        assert _fds() == fds
        assert _settled_threads(threads) <= threads
    finally:
        boot.run_until_complete(dev.close())
        boot.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("use_uvloop", LOOPS)
def test_a_loop_closed_once_set_aside_frees_its_native_watches_before_their_timelines(
    use_uvloop: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop set aside (``LoopBridge.suspend``) with a task parked on a timeline keeps
    the watch's native part, for the callback that takes it back; the loop is closed
    instead (which drops that callback, and with it the watch and the task, the only
    holders of the timeline), and its bridge is released later. The native timeline is
    freed only once the native watch on it is (``am_watch_free`` unlinks the watch from
    its timeline: it would read and lock freed memory). Checked failing without: the
    timeline was freed as the loop closed, and the native watch on it after."""
    loop = _new_loop(use_uvloop)()
    order: list[str] = []

    def free_watch(handle: int) -> None:
        order.append("watch" if handle == cwatch else "other watch")
        watch_free(handle)

    def free_timeline(c_timeline: int) -> None:
        order.append("timeline" if c_timeline == c_timeline_of_watch else "other timeline")
        timeline_free(c_timeline)

    try:
        dev = loop.run_until_complete(am.open_device("cpu"))
        lib = am._bridge._native_lib()
        watch_free, timeline_free = lib.am_watch_free, lib.am_timeline_free

        async def park() -> am._bridge.LoopBridge:
            timeline = dev.timeline()
            # (held by its wait only: the watch, and the timeline, go with the loop's
            # callbacks)
            asyncio.ensure_future(timeline.wait(5))  # noqa: RUF006
            while am.loop_statistics().waiting < 1:
                await asyncio.sleep(0.001)
            return am._bridge.current_bridge()

        bridge = loop.run_until_complete(park())
        (watch,) = bridge.watches
        cwatch, c_timeline_of_watch = watch.cwatch, watch.timeline.native.c_timeline
        del watch
        monkeypatch.setattr(lib, "am_watch_free", free_watch)
        monkeypatch.setattr(lib, "am_timeline_free", free_timeline)
        assert bridge.suspend()  # (here, as a thread that ran it would as it ended)
    finally:
        loop.close()
    gc.collect()
    bridge.release()  # (as a new loop's bridge, or the end of its thread, does)
    gc.collect()
    assert [step for step in order if not step.startswith("other")] == ["watch", "timeline"]
    dev_closing = asyncio.new_event_loop()
    try:
        dev_closing.run_until_complete(dev.close())
    finally:
        dev_closing.close()


class _CollectingAsHeld:
    """``lock``, with a garbage collection each time ``thread`` takes it (as one may come
    at any allocation of an object the collector tracks)."""

    def __init__(self, lock: Any, thread: Callable[[], threading.Thread | None]) -> None:
        self._lock, self._thread = lock, thread

    def __enter__(self) -> None:
        self._lock.__enter__()
        if threading.current_thread() is self._thread():
            gc.collect()

    def __exit__(self, *exc: object) -> None:
        self._lock.__exit__(*exc)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("use_uvloop", LOOPS)
def test_a_release_during_which_a_collection_closes_the_bridge_ends(
    use_uvloop: bool,
) -> None:
    """A loop set aside with a task parked, then closed (which drops the callback that
    would take its watches back) and let go of, is garbage: its bridge is released (by
    a new loop's bridge, or the end of a thread), and a collection there, as the bridge
    holds its lock on the native watches, collects the loop, whose finalizer closes the
    bridge on that thread, inside. The release ends. Checked failing without: the
    finalizer waited for the lock its own thread held, for good."""
    gc.disable()  # (the loop goes at the collection in the lock, not before)
    boot = asyncio.new_event_loop()
    try:
        dev = boot.run_until_complete(am.open_device("cpu"))
        timeline = dev.timeline()

        def set_aside_and_closed() -> tuple[am._bridge.LoopBridge, weakref.ref[Any]]:
            loop = _new_loop(use_uvloop)()

            async def park() -> am._bridge.LoopBridge:
                asyncio.ensure_future(timeline.wait(5))  # noqa: RUF006
                while am.loop_statistics().waiting < 1:
                    await asyncio.sleep(0.001)
                return am._bridge.current_bridge()

            bridge = loop.run_until_complete(park())
            assert bridge.suspend()  # (as a thread that ran it would as it ended)
            loop.close()
            return bridge, weakref.ref(loop)

        bridge, loop = set_aside_and_closed()
        assert loop() is not None  # (garbage, not collected yet)
        releasing: list[threading.Thread] = []
        bridge._native_lock = _CollectingAsHeld(  # type: ignore[assignment]
            bridge._native_lock, lambda: releasing[0] if releasing else None
        )
        releasing.append(threading.Thread(target=bridge.release, daemon=True))
        releasing[0].start()
        releasing[0].join(10)
        assert not releasing[0].is_alive(), "the release never ended"
        assert loop() is None and bridge.dead
        boot.run_until_complete(dev.close())
    finally:
        gc.enable()
        boot.close()


@pytest.mark.parametrize("use_uvloop", LOOPS)
def test_a_wake_up_queued_as_its_stopped_loop_is_set_aside_is_not_lost(
    use_uvloop: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop stopped with a task parked on a host counter, set aside as its thread
    ends, while another thread raises the counter: the raise queues the loop's watch
    in the bridge's deque of pending watches read before the setting aside swaps it
    for a new one, and appends to it after the setting aside took what was in it
    (held there by a deque that waits in its append). Run again, the loop wakes the
    task (before: the watch stayed marked as queued, in a deque nobody reads, so the
    loop never looked at it again and the task waited for good)."""
    from asyncmetal._timeline import HostEvents

    new_loop = _new_loop(use_uvloop)
    events = HostEvents()
    loop = new_loop()
    waits: list[asyncio.Future[None]] = []
    bridges: list[Any] = []
    appending, set_aside, go = threading.Event(), threading.Event(), threading.Event()

    class HeldDeque(collections.deque):  # type: ignore[type-arg]
        def append(self, item: Any) -> None:
            if threading.current_thread().name == "raiser":
                appending.set()
                go.wait(LIMIT)
            super().append(item)

    def raise_counter() -> None:
        events.increment()

    def _drop_watch(watch: Any) -> None:  # the setting aside, before it swaps the deque
        if not appending.is_set():
            threading.Thread(target=raise_counter, name="raiser").start()
            appending.wait(LIMIT)
        HostEvents._drop_watch(events, watch)

    def run() -> None:
        async def main() -> None:
            waits.append(asyncio.ensure_future(events.wait(1)))
            bridge = am._bridge.current_bridge()
            while not bridge.waiting:  # (parked within an iteration or two)
                await asyncio.sleep(0)
            bridges.append(bridge)

        loop.run_until_complete(main())
        (bridge,) = bridges
        bridge._pending = HeldDeque()
        suspend = bridge.suspend

        def suspended() -> bool:
            try:
                return bool(suspend())
            finally:
                set_aside.set()

        monkeypatch.setattr(bridge, "suspend", suspended)
        monkeypatch.setattr(events, "_drop_watch", _drop_watch)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert set_aside.wait(LIMIT) and appending.is_set()
    go.set()
    monkeypatch.undo()
    try:
        loop.run_until_complete(asyncio.wait_for(waits[0], LIMIT))
    finally:
        loop.close()

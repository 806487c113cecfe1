"""The native runtime's extension module (native/py_module.c): the launch path without ctypes.

It is built where Python's headers are installed (CI's interpreter has them) and must
then be in use; the ctypes path it replaces must give the same results.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
import time

import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _native
from tests.support.launch_paths import PATHS, run_without_extension, select_launch_path

pytestmark = pytest.mark.anyio


def test_extension_is_built_where_python_headers_are() -> None:
    lib = _native.runtime()
    if _native._python_include() is None:
        assert _native.extension() is None
        assert _native.extension_error is not None
        return
    extension = _native.extension()
    assert extension is not None, _native.extension_error
    # One library: the module's functions are those ctypes calls.
    for name in ("am_queue_call", "am_cuq_launch", "am_cuq_copy"):
        assert extension.address_of(name) == ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    with pytest.raises(KeyError):
        extension.address_of("am_nothing")


def test_extension_refuses_bad_arguments_without_crashing() -> None:
    extension = _native.extension()
    if extension is None:
        pytest.skip(f"the extension module is not built here: {_native.extension_error}")
    with pytest.raises(TypeError):
        extension.queue_call(1, 2, [], 3)  # too few
    with pytest.raises(TypeError):
        extension.queue_call(1, 2, "not a list", 3, 4)
    with pytest.raises(TypeError):
        extension.queue_call(1, 2, [(1, 2)], 3, 4)  # not (handle, offset, val)
    with pytest.raises(ValueError, match="at most 16"):
        extension.queue_call(1, 2, [(None, 0, 1)] * 17, 3, 4)
    one = (1, 1, 1)
    with pytest.raises(ValueError, match="null queue"):
        extension.cuq_launch(0, 0, one, one, [], 1)
    with pytest.raises(TypeError, match="3-tuples"):
        extension.cuq_launch(1, 0, (1, 1), one, [], 1)
    with pytest.raises(ValueError, match="launch sizes"):
        extension.cuq_launch(1, 0, one, (1, 0, 1), [], 1)
    # Sizes past 32 bits, past 64 or below 0, in either size: the same ValueError, never a
    # wrapped grid nor a conversion's OverflowError. Checked: fails without the fix (an
    # OverflowError for 2**64).
    for huge in (2**32, 2**32 + 1, 2**64 - 1, 2**64, 2**70, -1):
        for sizes in (((1, huge, 1), one), (one, (1, 1, huge))):
            with pytest.raises(ValueError, match=re.escape("launch sizes must be in [1, 2**32)")):
                extension.cuq_launch(1, 0, *sizes, [], 1)
    with pytest.raises(ValueError, match="at most 64"):
        extension.cuq_launch(1, 0, one, one, [(None, 0, 1)] * 65, 1)
    with pytest.raises(OverflowError):
        extension.cuq_launch(1, 0, one, one, [(None, 0, 1 << 70)], 1)
    with pytest.raises(TypeError, match="takes 7 arguments"):
        extension.cuq_copy(1, 2, 3, None, 4, 5)
    with pytest.raises(ValueError, match="null queue"):
        extension.cuq_copy(0, 2, 3, None, 4, 5, 6)
    with pytest.raises(OverflowError):
        extension.cuq_copy(1, -2, 3, None, 4, 5, 6)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.usefixtures("unreaped")
async def test_launch_paths_give_the_same_results(
    device: am.Device, kernels: dict[str, am.Program], path: str
) -> None:
    queue = device.new_queue()
    select_launch_path(queue, path, "_fast_call")
    n = 4096
    out = await device.alloc(4 * n)
    cells = await device.alloc(32)
    await queue.copy(cells, np.zeros(8, np.int32))
    for value in (-(1 << 31), -1, 0, 7, (1 << 31) - 1):
        await queue.launch(kernels["fill"], out.view(4), vals=(value, n - 1))
        got = np.empty(n, np.int32)
        await queue.copy(got, out)
        assert (got[1:] == value).all()
    # Several values, in order: steps run out of order or mixed up would show.
    expected = [0] * 8
    for i in range(16):
        dst, src = i % 8, (i * 3) % 8
        queue.launch(kernels["step"], cells, vals=(dst, src, i - 8))
        expected[dst] = expected[dst] * 31 + expected[src] + i - 8
    got = np.empty(8, np.int32)
    await queue.copy(got, cells)
    assert got.tolist() == expected


def test_ctypes_only_when_asked() -> None:
    """ASYNCMETAL_EXTENSION=0 builds and runs the ctypes-only runtime."""
    code = (
        "import anyio, numpy as np, asyncmetal as am\n"
        "from asyncmetal import _native\n"
        "async def main():\n"
        "    async with am.open_device('cpu') as dev:\n"
        "        p = await dev.compile('void fill(int* o, int v, int n)"
        " { for (int i = 0; i < n; i++) o[i] = v; }', 'fill')\n"
        "        b = await dev.alloc(64)\n"
        "        await dev.queue.launch(p, b, vals=(-5, 16))\n"
        "        out = await b.read(np.int32)\n"
        "        assert (out == -5).all(), out\n"
        "        tl = dev.timeline()\n"  # a host signal releasing a parked task: ctypes calls
        "        async with anyio.create_task_group() as tg:\n"
        "            tg.start_soon(tl.wait, 3)\n"
        "            await anyio.wait_all_tasks_blocked()\n"
        "            tl.signal(3)\n"
        "        assert _native.extension() is None\n"
        "        print('ok', _native.extension_error)\n"
        "anyio.run(main)\n"
    )
    proc = run_without_extension(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok ") and "ASYNCMETAL_EXTENSION=0" in proc.stdout


def test_why_the_extension_is_not_in_use_names_the_switch_as_set() -> None:
    """``info`` (and ``extension_error``) say which value of ASYNCMETAL_EXTENSION turned
    the extension module off, as it was set. Checked: fails without the fix (it said
    ``ASYNCMETAL_EXTENSION=0`` for ``off``)."""
    code = "from asyncmetal import _native\n_native.runtime()\nprint(_native.extension_error)\n"
    proc = run_without_extension(code, switch="off")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ASYNCMETAL_EXTENSION=off: ctypes only", proc.stdout


@pytest.mark.parametrize("path", ["extension", "ctypes"])
def test_spin_sees_a_value_raised_by_another_thread(path: str) -> None:
    lib = _native.runtime()
    if path == "extension":
        if _native.extension() is None:
            pytest.skip(f"the extension module is not built here: {_native.extension_error}")
        spin = _native.extension().spin  # type: ignore[union-attr]
    else:
        spin = lib.am_timeline_spin
    timeline = lib.am_timeline_new()
    try:
        assert not spin(timeline, 1, 1000)  # nothing raises it: gives up after ~1 us
        t0 = time.perf_counter()
        assert not spin(timeline, 1, 20_000_000)
        assert time.perf_counter() - t0 >= 0.019
        raiser = threading.Timer(0.01, lambda: lib.am_timeline_signal(timeline, 5))
        raiser.start()
        t0 = time.perf_counter()
        assert spin(timeline, 5, 5_000_000_000)  # without the GIL: the timer thread runs
        assert time.perf_counter() - t0 < 2
        assert spin(timeline, 3, 0)  # already reached
        raiser.join()
    finally:
        lib.am_timeline_free(timeline)


def test_host_copies_move_every_byte() -> None:
    """CPUQueue.memmove (the cuda staging path's host copies): sizes small and large,
    source and destination at odd alignments, the bytes around the copy untouched."""
    from asyncmetal._backend import Record
    from asyncmetal.backends.cpu import CPUQueue, CPUTimeline

    lib = _native.runtime()
    timeline = CPUTimeline(lib)
    queue = CPUQueue(lib, timeline)
    rng = np.random.default_rng(7)
    source = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    value = 0
    try:
        for nbytes in (1, 63, 4096, (64 << 10) - 1, 64 << 10, (64 << 10) + 77, 300_001):
            for dst_shift, src_shift in ((0, 0), (1, 0), (0, 5), (13, 7), (15, 15)):
                dst = np.zeros(nbytes + 64, np.uint8)
                src = source[src_shift : src_shift + nbytes]
                value += 1
                queue.memmove(
                    dst.ctypes.data + dst_shift,
                    src.ctypes.data,
                    nbytes,
                    value,
                    Record(value),
                    (dst, src),
                )
                deadline = time.monotonic() + 10
                while timeline.value < value and time.monotonic() < deadline:
                    time.sleep(0.0005)
                assert timeline.value >= value
                assert np.array_equal(dst[dst_shift : dst_shift + nbytes], src), nbytes
                assert not dst[:dst_shift].any() and not dst[dst_shift + nbytes :].any()
    finally:
        queue.close()


def test_host_copies_in_parts_wait_and_mark_on_device_words() -> None:
    """CPUQueue.copy_part (the cuda staging path's host copies): queues that share a
    chunk's copy wait for a word (a stream's mark there, this thread here), take its
    parts one at a time -- a queue held back leaves its share to the others -- count
    them, and the part that completes the count raises the ready word (which a stream
    waits on there) once every byte is in; an abandoning close ends a wait that would
    never end."""
    from asyncmetal.backends.cpu import CPUQueue, CPUTimeline

    lib = _native.runtime()
    timelines = [CPUTimeline(lib) for _ in range(3)]
    queues = [CPUQueue(lib, t) for t in timelines]
    words = (ctypes.c_uint64 * 4)()  # the mark the parts wait for, the ready word, a hold
    ready, scratch = ctypes.addressof(words) + 8, ctypes.addressof(words) + 24
    marks, holds = CPUTimeline(lib), CPUTimeline(lib)  # timelines whose words streams write
    lib.am_timeline_set_word(marks.c_timeline, ctypes.addressof(words))
    lib.am_timeline_set_word(holds.c_timeline, ctypes.addressof(words) + 16)
    after, hold = marks.c_timeline, holds.c_timeline
    claimed, count = ctypes.c_uint64(0), ctypes.c_uint64(0)
    held = (ctypes.c_uint64 * 2)()  # the held command's own claim and count
    src = np.random.default_rng(3).integers(0, 256, 3 * 4096 + 100, dtype=np.uint8)
    dst = np.zeros_like(src)
    at = ctypes.addressof

    def settled(values: list[int], within: float) -> bool:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if all(t.value >= v for t, v in zip(timelines, values, strict=True)):
                return True
            time.sleep(0.0005)
        return False

    def share(q: CPUQueue, value: int, nbytes: int, wait: tuple[int, int], first: int) -> None:
        q.copy_part(
            dst.ctypes.data,
            src.ctypes.data,
            nbytes,
            4096,
            value,
            (dst, src),
            wait,
            (at(claimed), first),
            (at(count), first + -(-nbytes // 4096)),
            (ready, 11 + first),
        )

    try:
        # The third queue is held back by an earlier command, until words[2] is written.
        queues[2].copy_part(
            scratch,
            scratch,
            1,
            1,
            1,
            None,
            (hold, 1),
            (at(held), 0),
            (at(held) + 8, 1),
            (scratch, 1),
        )
        for i, q in enumerate(queues):  # four parts: 4096, 4096, 4096 and 100 bytes
            share(q, 2 if i == 2 else 1, src.nbytes, (after, 7), 0)
        words[0] = 6  # not yet
        assert not settled([1, 1, 0], 0.05) and not dst.any() and words[1] == 0
        words[0] = 7  # the two free queues take every part, the held one's share too
        assert settled([1, 1, 0], 10) and not settled([1, 1, 1], 0.05)
        assert np.array_equal(dst, src) and words[1] == 11
        assert claimed.value == 4 and count.value == 4
        words[2] = 1  # the held queue finds nothing left to take
        assert settled([1, 1, 2], 10)
        assert claimed.value == 4 and count.value == 4 and held[1] == 1 and words[3] == 1
        # The chunk's next use, one part and no mark to wait for (address 0): it copies at
        # once, numbered on from the claims and count as they run on (4 -> 5).
        dst[0] ^= 0xFF
        share(queues[0], 2, 1, (0, 0), 4)
        assert settled([2, 1, 2], 10) and words[1] == 15 and dst[0] == src[0]
        assert claimed.value == 5 and count.value == 5
        share(queues[1], 2, 1, (after, 1 << 40), 5)  # waits for a mark never written
        time.sleep(0.05)
    finally:
        t0 = time.monotonic()
        for q in queues:
            q.close(abandon=True)
        assert time.monotonic() - t0 < 5
    assert timelines[1].value == 1 and words[1] == 15 and count.value == 5


def test_waits_on_one_device_word_release_each_at_its_value() -> None:
    """Queue threads waiting on one timeline's device word (one polls it, the others
    sleep): each goes on once the word reaches its own value, lower or higher than the
    poller's."""
    from asyncmetal.backends.cpu import CPUQueue, CPUTimeline

    lib = _native.runtime()
    timelines = [CPUTimeline(lib) for _ in range(4)]
    queues = [CPUQueue(lib, t) for t in timelines]
    marks = CPUTimeline(lib)
    word = ctypes.c_uint64(0)
    lib.am_timeline_set_word(marks.c_timeline, ctypes.addressof(word))
    count, ready = ctypes.c_uint64(0), ctypes.c_uint64(0)
    claims = iter([ctypes.c_uint64(0) for _ in range(16)])  # each wait copies its own byte
    scratch = (ctypes.c_uint8 * 16)()

    def wait_on_marks(q: CPUQueue, target: int, value: int) -> None:
        at = ctypes.addressof(scratch)
        q.copy_part(
            at,
            at + 8,
            1,
            1,
            value,
            None,
            (marks.c_timeline, target),
            (ctypes.addressof(next(claims)), 0),
            (ctypes.addressof(count), 1 << 40),
            (ctypes.addressof(ready), 1),
        )

    def done(which: list[int], value: int, within: float) -> bool:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if all(timelines[i].value >= value for i in which):
                return True
            time.sleep(0.0005)
        return False

    try:
        wait_on_marks(queues[0], 5, 1)  # the first waiter: it polls, for 5
        time.sleep(0.02)
        for q in queues[1:]:
            wait_on_marks(q, 3, 1)  # they sleep, needing less than the poller
        time.sleep(0.02)
        word.value = 2
        assert not done([0, 1, 2, 3], 1, 0.05) and not any(t.value for t in timelines)
        word.value = 3
        assert done([1, 2, 3], 1, 10) and not done([0], 1, 0.05)
        for q in queues[1:]:
            wait_on_marks(q, 9, 2)  # higher than the poller's: one takes over after it
        word.value = 5
        assert done([0], 1, 10) and not done([1, 2, 3], 2, 0.05)
        word.value = 9
        assert done([1, 2, 3], 2, 10)
        wait_on_marks(queues[0], 100, 2)  # the poller now, for a value never written
        time.sleep(0.02)
        for q in queues[1:]:
            wait_on_marks(q, 12, 3)
        time.sleep(0.02)
        queues[0].close(abandon=True)  # the poller leaves: a sleeper must take over
        word.value = 12
        assert done([1, 2, 3], 3, 10)
    finally:
        for q in queues:
            q.close(abandon=True)  # a wait left over (a failure) ends too
    assert count.value == 10 and ready.value == 0


def test_fast_calls_do_what_the_runtime_functions_do() -> None:
    """The host-signal path's calls (``_native.fast_call``): the extension's functions
    where it is in use, each doing what the runtime's function does through ctypes."""
    lib = _native.runtime()
    stand_in = type("Lib", (), {"am_watch_arm": staticmethod(lambda w, v: 0)})()
    assert _native.fast_call(stand_in, "am_watch_arm") is stand_in.am_watch_arm
    extension = _native.extension()
    if extension is None:
        assert _native.fast_call(lib, "am_watch_arm") is lib.am_watch_arm
        pytest.skip(f"the extension module is not built here: {_native.extension_error}")
    for runtime_name, name in _native._FAST_CALLS.items():
        assert _native.fast_call(lib, runtime_name) is getattr(extension, name)
    word = ctypes.c_uint64(0)
    timeline = lib.am_timeline_new()
    rfd, wfd = os.pipe()
    os.set_blocking(rfd, False)
    notifier = lib.am_notifier_new(wfd)
    watch = lib.am_watch_new(timeline, notifier)
    try:
        lib.am_timeline_set_word(timeline, ctypes.addressof(word))
        extension.timeline_signal(timeline, 5, 0)
        assert lib.am_timeline_value(timeline) == 5 and word.value == 5
        assert extension.watch_arm(watch, 5) is True  # reached already
        assert extension.watch_arm(watch, 7) is False
        extension.host_signal(timeline, 7, 0)  # the word, the value, and the loop's pipe
        assert lib.am_timeline_value(timeline) == 7 and word.value == 7
        assert os.read(rfd, 16) == b"\x01"
        assert extension.watch_arm(watch, 8) is False
        extension.timeline_signal(timeline, 8, 0)
        with pytest.raises(BlockingIOError):  # one byte until the notifier is reset
            os.read(rfd, 16)
        extension.notifier_reset(notifier)
        # Signalled from the loop of that notifier (it wakes its own waiters): its pipe
        # is left alone, here and through the runtime's own function, and its next
        # advance from elsewhere writes it.
        assert extension.watch_arm(watch, 9) is False
        extension.timeline_signal(timeline, 9, notifier)
        assert lib.am_timeline_value(timeline) == 9
        assert extension.watch_arm(watch, 10) is False
        extension.host_signal(timeline, 10, notifier)
        assert lib.am_timeline_value(timeline) == 10 and word.value == 10
        assert extension.watch_arm(watch, 11) is False
        lib.am_timeline_signal_here(timeline, 11, notifier)
        assert lib.am_timeline_value(timeline) == 11
        with pytest.raises(BlockingIOError):
            os.read(rfd, 16)
        assert extension.watch_arm(watch, 12) is False
        extension.timeline_signal(timeline, 12, 0)
        assert os.read(rfd, 16) == b"\x01"
        extension.notifier_reset(notifier)
        assert extension.watch_arm(watch, 9) is True
        assert extension.watch_arm(watch, 13) is False
        extension.timeline_signal(timeline, 13, 0)
        assert os.read(rfd, 16) == b"\x01"
        assert extension.notifier_reset(notifier) == 0  # not asked to stay awake
        # Work near a value beyond the one awaited wakes nothing; near it, the loop, asked
        # to stay awake until the later of the times asked (once: reset forgets it).
        assert extension.watch_arm(watch, 15) is False
        lib.am_timeline_near(timeline, 14, 5_000)
        with pytest.raises(BlockingIOError):
            os.read(rfd, 16)
        lib.am_timeline_near(timeline, 15, 7_000)
        lib.am_timeline_near(timeline, 16, 6_000)
        assert os.read(rfd, 16) == b"\x01"
        assert extension.notifier_reset(notifier) == 7_000
        assert extension.notifier_reset(notifier) == 0
    finally:
        lib.am_watch_free(watch)
        lib.am_notifier_free(notifier)
        lib.am_timeline_free(timeline)
        os.close(rfd)
        os.close(wfd)
    for call, args in (
        (extension.timeline_signal, (0, 1, 0)),
        (extension.host_signal, (0, 1, 0)),
        (extension.watch_arm, (0, 1)),
    ):
        with pytest.raises(ValueError, match="null"):
            call(*args)
    with pytest.raises(ValueError, match="null"):
        extension.notifier_reset(0)
    with pytest.raises(TypeError, match="takes 3 arguments"):
        extension.timeline_signal(timeline, 1)

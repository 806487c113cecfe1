"""The public surface on the cpu device: open, compile, launch, buffers, timelines."""

from __future__ import annotations

import asyncio
import ctypes
import sys
import tempfile
from pathlib import Path

import anyio
import numpy as np
import pytest

import asyncmetal as am
from tests.support.fakes import metal_sim
from tests.support.kernels import KERNELS

pytestmark = pytest.mark.anyio


def test_devices_lists_cpu() -> None:
    names = am.devices()
    assert names[:1] == ["cpu"] or names[0].startswith(("cuda", "metal"))
    assert "npy" in names
    # metal: on macOS, or where the tests configured the simulated Metal
    assert "metal" not in names or __import__("sys").platform == "darwin" or metal_sim.configured()


async def test_open_close_and_name(anyio_backend: object) -> None:
    async with am.open_device("cpu") as dev:
        assert dev.name == "cpu"
        assert not dev.closed
        assert dev.queue.timeline.value == 0
    assert dev.closed
    dev2 = await am.open_device("cpu:1")
    assert dev2.name == "cpu:1"
    await dev2.close()
    await dev2.close()  # closing twice is harmless


def test_open_device_is_a_coroutine_for_asyncio() -> None:
    """What takes a coroutine takes open_device(...) as it is: ``asyncio.run`` (a device
    opened at start-up, used by a server's loop later) and ``asyncio.create_task``; each
    await of it opens a device of its own. Checked: both raised, asyncio.run with "a
    coroutine was expected, got <asyncmetal._device.DeviceOpener object ...>"."""
    dev = asyncio.run(am.open_device("cpu"))

    async def main() -> list[am.Device]:
        opener = am.open_device("cpu:1")
        opened = [await asyncio.create_task(am.open_device("cpu:2")), await opener]
        opened.append(await opener)
        assert (await dev.alloc(16)).nbytes == 16  # another loop's device
        for device in [*opened, dev]:
            await device.close()
        return opened

    opened = asyncio.run(main())
    assert [d.name for d in opened] == ["cpu:2", "cpu:1", "cpu:1"]
    assert opened[1] is not opened[2]
    assert dev.closed and all(d.closed for d in opened)


def test_each_task_made_of_one_opener_opens_a_device_of_its_own() -> None:
    """asyncio.run and asyncio.create_task run an opener through its coroutine protocol
    (send, throw): each task made of one opener opens a device of its own, as each
    await of it does -- two at once, one after another's ended, one after another's
    was cancelled -- and an ``async with`` of it after an await enters (and closes) a
    device of its own, the awaited one left open. Checked: without the fix the
    protocol ran one opening for all its tasks, so of two tasks at once the first raised
    "cannot reuse already awaited coroutine" and the second "Attempted to exit cancel
    scope in a different task than it was entered in", and a task made after one had
    ended (a second asyncio.run) raised the first."""
    opener = am.open_device("cpu:1")
    first = asyncio.run(opener)
    second = asyncio.run(opener)

    async def main() -> list[am.Device]:
        cancelled = asyncio.create_task(opener)
        await asyncio.sleep(0)  # (it began opening)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        both = [asyncio.create_task(opener), asyncio.create_task(opener)]
        opened = [await task for task in both]
        opened.append(await asyncio.create_task(opener))
        opened.append(await opener)
        async with opener as entered:
            assert entered not in opened
        assert entered.closed and not any(device.closed for device in opened)
        for device in [*opened, first, second]:
            await device.close()
        return opened

    opened = [first, second, *asyncio.run(main())]
    assert len({id(device) for device in opened}) == len(opened) == 6
    assert all(device.name == "cpu:1" and device.closed for device in opened)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.wait wraps awaitables")
def test_asyncio_wait_of_a_completion_says_what_to_pass() -> None:
    """asyncio.wait takes only futures (Python 3.11 on): a Completion passed to it is
    refused saying what to pass (checked: a bare "AttributeError: 'Completion' object
    has no attribute 'add_done_callback'"), and what it says works, as does a task of
    completion.wait()."""

    async def main() -> None:
        async with am.open_device("cpu") as dev:
            done = dev.queue.marker()
            with pytest.raises(am.ArgumentTypeError, match=r"asyncio\.ensure_future"):
                await asyncio.wait([done])
            finished, pending = await asyncio.wait(
                [asyncio.ensure_future(done), asyncio.create_task(done.wait())]
            )
            assert len(finished) == 2 and not pending

    asyncio.run(main())


async def test_default_device_from_environment(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCMETAL_DEVICE", "cpu:3")
    async with am.open_device() as dev:
        assert dev.name == "cpu:3"


async def test_unknown_device_is_a_clear_error(anyio_backend: object) -> None:
    """A name no backend has is bad input: an argument error (also ValueError), like
    every other (README: bad input fails first)."""
    for name in ("tpu", "cpu:-1", "cpu:x", "cpu:01", "cpu:\u00b2", "cpu:\u0663", "", "cpu:"):
        with pytest.raises(am.InvalidArgumentError, match=f"unknown device {name!r}"):
            await am.open_device(name)
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        await am.open_device("tpu")


async def test_a_device_index_past_any_backends_is_a_clear_error(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An index past the largest any backend takes (a C int, as DLPack's device id and
    CUDA's ordinal are) is bad input, as a malformed one is: named directly or by
    $ASYNCMETAL_DEVICE, for cpu (which opens any index below it) and cuda. Checked:
    fails without the fix (cpu:99999999999999999999 opened)."""
    largest = 2**31 - 1
    async with am.open_device(f"cpu:{largest}") as dev:
        assert dev.name == f"cpu:{largest}"
    for name in (f"cpu:{largest + 1}", "cpu:99999999999999999999", f"cuda:{largest + 1}"):
        with pytest.raises(am.InvalidArgumentError, match=f"unknown device {name!r}"):
            await am.open_device(name)
        monkeypatch.setenv("ASYNCMETAL_DEVICE", name)
        with pytest.raises(
            am.InvalidArgumentError,
            match=rf"unknown device {name!r}.*\(from \$ASYNCMETAL_DEVICE\)",
        ):
            await am.open_device()
        monkeypatch.delenv("ASYNCMETAL_DEVICE")


async def test_a_device_not_here_is_not_found(anyio_backend: object) -> None:
    """A known kind whose device is not here (no such GPU, an index past those there
    are): DeviceNotFoundError, also a LookupError, naming what can be opened (checked:
    it was a bare AsyncMetalError)."""
    for name in ("cuda:7", "npy:1"):
        with pytest.raises(am.DeviceNotFoundError, match="not available here") as refused:
            await am.open_device(name)
        assert isinstance(refused.value, LookupError)
        assert "'cpu'" in str(refused.value)


async def test_a_kind_with_no_device_here_says_what_it_needs(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where no device of a kind is here, the refusal says what the machine lacks for
    one: cuda-bindings (and how to install it) for cuda, macOS for metal (checked: it
    said only what can be opened)."""
    from asyncmetal.backends.cuda import _backend as cuda_backend

    monkeypatch.setattr(cuda_backend, "cu", None)  # cuda-bindings not installed
    with pytest.raises(
        am.DeviceNotFoundError, match=r"cuda devices need cuda-bindings.*pip install cuda-bindings"
    ):
        await am.open_device("cuda:0")
    if sys.platform != "darwin":  # (elsewhere metal is the simulation these variables name)
        for variable in ("ASYNCMETAL_OBJC_LIB", "ASYNCMETAL_METAL_LIB", "ASYNCMETAL_LIBSYSTEM"):
            monkeypatch.delenv(variable, raising=False)
        with pytest.raises(am.DeviceNotFoundError, match="the metal device needs macOS"):
            await am.open_device("metal")
    with pytest.raises(am.DeviceNotFoundError) as refused:  # kinds that are here: no more
        await am.open_device("npy:1")
    assert str(refused.value).endswith("(available: " + str(am.devices()) + ")")


async def test_launch_computes_and_reads_back(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    n = 1000
    a, b, out = [await device.alloc(4 * n) for _ in range(3)]
    await a.write(np.arange(n, dtype=np.float32))
    await b.write(np.full(n, 2, np.float32))
    done = device.queue.launch(kernels["add"], out, a, b, vals=(n,))
    assert isinstance(done, am.Completion)
    await done
    assert done.done()
    assert done.value == 3  # two writes, then the launch: values from 1
    assert done.start_time is not None and done.end_time is not None
    assert done.end_time >= done.start_time
    np.testing.assert_array_equal(await out.read(np.float32), np.arange(n) + 2)
    grid = await out.read(np.float32, (10, 100))
    np.testing.assert_array_equal(grid[:, 0], np.arange(0, n, 100) + 2)


async def test_a_cpu_command_that_never_ran_has_no_times() -> None:
    """A cpu launch failed behind a failed device wait, and one dropped by a discarding
    close, have no start or end time (a launch that ran has both). Checked failing
    before: each had a start and an end time a fraction of a microsecond apart."""
    from tests.support.queues import fail_for_good, held_queue

    async with await am.open_device("cpu") as device:
        empty = await device.compile(KERNELS, "empty")
        failed = device.new_queue()
        await fail_for_good(device, failed)
        never = failed.launch(empty)
        held, _ = held_queue(device)
        dropped = held.launch(empty)
        with anyio.fail_after(20):
            await held.close(discard=True)
            ran = device.queue.launch(empty)
            await ran
            for command in (never, dropped):
                with pytest.raises(am.ClosedResourceError):
                    await command
        assert ran.start_time is not None and ran.end_time is not None
        for command in (never, dropped):
            assert command.done()
            assert (command.start_time, command.end_time) == (None, None), command


async def test_queue_values_count_from_one(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    q = device.new_queue()
    values = [q.launch(kernels["empty"]).value for _ in range(5)]
    assert values == [1, 2, 3, 4, 5]
    await q.synchronize()
    assert q.timeline.value == 5


async def test_buffer_views_and_free(device: am.Device, kernels: dict[str, am.Program]) -> None:
    async with await device.alloc(64) as buf:
        await buf.write(np.zeros(16, np.int32))
        tail = buf.view(32)
        assert tail.nbytes == 32
        device.queue.launch(kernels["fill"], tail, vals=(7, 8))
        np.testing.assert_array_equal(await buf.read(np.int32), [0] * 8 + [7] * 8)
    assert buf.freed
    with pytest.raises(am.ClosedResourceError, match="freed"):
        await buf.read()


async def test_compile_many_yields_each(device: am.Device) -> None:
    names = {"empty", "add", "fill"}
    got = set()
    async for prog in device.compile_many([(KERNELS, n) for n in names]):
        assert isinstance(prog, am.Program)
        got.add(prog.name)
    assert got == names


async def test_a_cpu_kernel_with_too_many_parameters_is_refused_at_compile(
    anyio_backend: object,
) -> None:
    """17 parameters cannot be passed by the cpu queue threads: compile says so, rather
    than handing out a program every launch of which fails."""
    wide = "void wide(float* out, " + ", ".join(f"int a{i}" for i in range(16)) + ") {}"
    async with am.open_device("cpu") as device:
        with pytest.raises(am.CompileError, match=r"'wide' has 17 parameters; .* at most 16"):
            await device.compile(wide, "wide")
        steps = device.compile_many([(wide, "wide"), (KERNELS, "empty")])
        with pytest.raises(am.CompileError, match="'wide' has 17"):
            await steps.__anext__()
        assert (await steps.__anext__()).name == "empty"
        at_most = "void most(" + ", ".join(f"int a{i}" for i in range(16)) + ") {}"
        most = await device.compile(at_most, "most")
        await device.queue.launch(most, vals=tuple(range(16)))


async def test_compile_pool_configured_from_the_public_namespace(
    anyio_backend: object, tmp_path: Path
) -> None:
    from asyncmetal import CacheWarning, CompileCache, CompilePool

    assert issubclass(CacheWarning, UserWarning)
    async with am.open_device("cpu:2") as dev:
        pool = am.CompilePool(1, cache=am.CompileCache(tmp_path / "cache"))
        assert isinstance(pool, CompilePool) and isinstance(pool.cache, CompileCache)
        try:
            dev.compile_pool = pool
            assert dev.compile_pool is pool
            prog = await dev.compile(KERNELS, "fill")
            assert pool.compiles == 1  # compiled in this pool's worker, into its cache
            assert pool.cache.directory == tmp_path / "cache"
            assert any(pool.cache.directory.iterdir())
            buf = await dev.alloc(16)
            await dev.queue.launch(prog, buf, vals=(5, 4))
            np.testing.assert_array_equal(await buf.read(np.int32), [5] * 4)
        finally:
            await pool.aclose()
            pool.cache.close()


async def test_copy_between_cpu_devices(anyio_backend: object) -> None:
    async with am.open_device("cpu:0") as d0, am.open_device("cpu:1") as d1:
        src = await d0.alloc(4096)
        dst = await d1.alloc(4096)
        data = np.random.default_rng(0).integers(0, 255, 4096, dtype=np.uint8)
        await am.copy(src, data)
        await am.copy(dst, src)
        np.testing.assert_array_equal(await dst.read(), data)
        out = np.empty(4096, np.uint8)
        await am.copy(out, dst)
        np.testing.assert_array_equal(out, data)


@pytest.mark.anyio
async def test_queues_and_timelines_come_only_from_their_device(device: am.Device) -> None:
    """Made directly, a queue or timeline would belong to no device's bookkeeping (never
    closed with it, its waiters never woken at its close): refused, saying where they
    come from."""
    with pytest.raises(am.ArgumentTypeError, match=r"device\.new_queue\(\)"):
        am.Queue(device)
    with pytest.raises(am.ArgumentTypeError, match=r"device\.timeline\(\)"):
        am.Timeline(device)
    assert device.new_queue().device is device
    assert device.timeline().value == 0


def test_a_missing_c_compiler_is_named_as_given() -> None:
    """A compiler named by path that is not there is said not to be an executable; one
    named by name, not to be on PATH (a path was said to be 'not on PATH')."""
    from asyncmetal.backends.cpu import CCompiler

    with pytest.raises(am.CompileError, match="'/nonexistent/cc' is not an executable"):
        CCompiler("/nonexistent/cc").compile("void f(void) {}")
    with pytest.raises(am.CompileError, match="'no-such-cc-here' is not on PATH"):
        CCompiler("no-such-cc-here").compile("void f(void) {}")


def test_cc_may_give_flags_and_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """``$CC`` is split as a shell splits it (as make and setuptools take it): a
    compiler with flags, or behind a launcher, compiles; its flags are part of the
    compiler's identity (a binary built with them is not one built without)."""
    from asyncmetal.backends.cpu import CCompiler

    source = "int answer(void) { return ANSWER; }"
    identities = set()
    for cc in ("cc -DANSWER=42", "env LC_ALL=C cc -DANSWER=42"):
        monkeypatch.setenv("CC", cc)
        binary = CCompiler().compile(source)
        identities.add(CCompiler().version())
        with tempfile.NamedTemporaryFile(suffix=".so") as f:
            f.write(binary)
            f.flush()
            assert ctypes.CDLL(f.name).answer() == 42
    monkeypatch.setenv("CC", "cc -DANSWER=7")
    identities.add(CCompiler().version())
    assert len(identities) == 3
    monkeypatch.setenv("CC", "no-such-cc-here -O1")
    with pytest.raises(am.CompileError, match="'no-such-cc-here' is not on PATH"):
        CCompiler().compile(source)
    monkeypatch.setenv("CC", 'cc "-O1')  # no closing quote: no compiler (no ValueError)
    assert CCompiler().version()
    with pytest.raises(am.CompileError, match="is not on PATH"):
        CCompiler().compile(source)


async def test_a_device_keeps_the_cc_it_opened_with(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device compiles with the ``$CC`` of its opening; one set afterwards is the
    compiler of devices opened afterwards, under an identity of its own. Checked: before,
    the identity was found once per process (the compiler's config left ``$CC`` out, and
    each compile read it anew, in whichever process compiled), so a device opened under
    the new ``$CC`` got the binary built under the old one from the cache."""
    source = "void answer(int *out) { *out = ANSWER + %d; }"
    monkeypatch.setenv("CC", "cc -DANSWER=40")
    async with am.open_device("cpu") as dev:
        out = await dev.alloc(4)
        await dev.queue.launch(await dev.compile(source % 2, "answer"), out)
        assert (await out.read(np.int32))[0] == 42
        monkeypatch.setenv("CC", "cc -DANSWER=7")
        await dev.queue.launch(await dev.compile(source % 3, "answer"), out)
        assert (await out.read(np.int32))[0] == 43  # the $CC it opened with
    async with am.open_device("cpu") as dev:
        out = await dev.alloc(4)
        await dev.queue.launch(await dev.compile(source % 3, "answer"), out)
        assert (await out.read(np.int32))[0] == 10  # the $CC now, not the cache's 43


def test_the_package_lists_its_api() -> None:
    """``__all__`` names every public class, function and error the package exports (so
    pydoc and ``from asyncmetal import *`` show the API), and nothing else."""
    import inspect

    exported = {
        name
        for name, value in vars(am).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }
    assert set(am.__all__) == exported


async def test_each_async_with_of_one_opener_closes_the_device_it_opened() -> None:
    """One opener entered more than once at a time -- nested, and by two tasks -- gives
    each ``async with`` a device of its own, and each exit closes its own. Checked: the
    opener remembered only the last device opened, so an exit closed another's device
    (twice), and the first one opened was never closed."""
    opener = am.open_device("cpu")
    async with opener as outer:
        async with opener as inner:
            assert inner is not outer
        assert inner.closed and not outer.closed
    assert outer.closed

    entered: list[am.Device] = []
    first_in, second_in, first_out = anyio.Event(), anyio.Event(), anyio.Event()

    async def user(first: bool) -> None:
        if not first:
            await first_in.wait()
        async with opener as dev:
            entered.append(dev)
            if first:  # leaves while the second is inside
                first_in.set()
                await second_in.wait()
            else:
                second_in.set()
                await first_out.wait()
            assert not dev.closed
        if first:
            first_out.set()
        assert dev.closed

    async with anyio.create_task_group() as tg:
        tg.start_soon(user, True)
        tg.start_soon(user, False)
    assert len(entered) == 2 and entered[0] is not entered[1]


async def test_an_opener_entered_in_one_task_exits_in_another() -> None:
    """An ``async with`` of an opener left in another task than the one that entered it
    (an async generator fixture's teardown, in a task of its own) closes its device."""
    opener = am.open_device("cpu")
    entered: list[am.Device] = []

    async def enter() -> None:
        entered.append(await opener.__aenter__())

    async with anyio.create_task_group() as tg:
        tg.start_soon(enter)
    async with anyio.create_task_group() as tg:
        tg.start_soon(opener.__aexit__, None, None, None)
    assert entered[0].closed

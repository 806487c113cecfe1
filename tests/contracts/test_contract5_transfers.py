"""Contract 5: copies in every direction, ordered on the devices; a random-interleaving
stress test over several queues and two devices checks every byte."""

from __future__ import annotations

import gc
import weakref

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _transfer, backends
from tests.support.kernels import KERNELS
from tests.support.other_kind import held_pair
from tests.support.queues import held_queue
from tests.support.stress import interleavings

pytestmark = pytest.mark.anyio

MIX = """
void mix(unsigned char* x, int n, int k) {
    for (int i = 0; i < n; i++) x[i] = (unsigned char)(x[i] * 31 + k + i);
}
"""


def _bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


async def test_every_pair(anyio_backend: object) -> None:
    async with am.open_device("cpu:0") as d0, am.open_device("cpu:1") as d1:
        data = _bytes(4096)
        a, b, c = await d0.alloc(4096), await d0.alloc(4096), await d1.alloc(4096)
        await am.copy(a, data)  # numpy -> Buffer
        await am.copy(b, a)  # Buffer -> Buffer, one device
        await am.copy(c, b)  # Buffer -> Buffer, two devices
        out = np.zeros(4096, np.uint8)
        await am.copy(out, c)  # Buffer -> numpy
        np.testing.assert_array_equal(out, data)
        await am.copy(a, bytes(range(256)) * 16)  # bytes -> Buffer
        assert (await a.read())[:256].tolist() == list(range(256))
        await am.copy(c.view(100, 50), a.view(10, 50))  # views, with offsets
        assert (await c.read())[100:150].tolist() == list(range(10, 60))


async def test_npy_buffers_are_read_only_sources(anyio_backend: object) -> None:
    async with am.open_device("cpu") as dev:
        arr = np.arange(1000, dtype=np.float32)
        src = await am.from_numpy(arr)
        assert src.device.kind == "npy" and src.nbytes == 4000
        buf = await dev.alloc(4000)
        await am.copy(buf, src)  # npy -> cpu, like any device buffer
        np.testing.assert_array_equal(await buf.read(np.float32), arr)
        out = np.empty(1000, np.float32)
        await am.copy(out, src)  # npy -> numpy
        np.testing.assert_array_equal(out, arr)
        with pytest.raises(am.InvalidArgumentError, match="read-only"):
            await am.copy(src, buf)
        with pytest.raises(am.InvalidArgumentError, match="read-only"):
            await am.copy(src, np.zeros(1000, np.float32))
        with pytest.raises(am.InvalidArgumentError, match="from_numpy"):
            await src.device.alloc(16)
        with pytest.raises(am.InvalidArgumentError, match="not C-contiguous"):
            await am.from_numpy(np.zeros((4, 4))[:, 1])
        with pytest.raises(am.InvalidArgumentError, match="wrap"):
            dev._wrap(arr)


async def test_write_takes_an_npy_buffer(anyio_backend: object) -> None:
    """``Buffer.write`` of an npy buffer reads it in place, as ``asyncmetal.copy`` does
    (before, it was refused -- "staged through the host: use asyncmetal.copy()" --
    while a buffer of another cpu device was taken); an npy buffer is still never
    written. Checked failing without the fix."""
    async with am.open_device("cpu") as dev:
        arr = np.arange(1000, dtype=np.float32)
        src = await am.from_numpy(arr)
        buf = await dev.alloc(4000)
        await buf.write(src)  # npy -> cpu
        np.testing.assert_array_equal(await buf.read(np.float32), arr)
        await buf.view(0, 400).write(src.view(400, 400))  # views, with offsets
        np.testing.assert_array_equal((await buf.read(np.float32))[:100], arr[100:200])
        with pytest.raises(am.InvalidArgumentError, match="read-only"):
            await src.write(buf)  # cpu -> npy: refused, as a write of any data is


@pytest.mark.parametrize("direction", ["cpu to other", "other to cpu"])
async def test_write_takes_a_host_visible_buffer_of_another_kind_once_its_writer_ran(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, direction: str
) -> None:
    """``Buffer.write`` of a buffer of another kind whose memory the host sees reads
    it in place once the command writing it (held here behind a wait) ran, as a write
    of a buffer of another device of its own kind does; of a buffer of a kind the host
    cannot see it still says to use ``asyncmetal.copy``. Checked failing without the
    fix (refused: "staged through the host")."""
    monkeypatch.setitem(backends.BACKENDS, "cpu3", "tests.support.other_kind:HostKind")
    monkeypatch.setitem(backends.BACKENDS, "cpu2", "tests.support.other_kind:OtherKind")
    async with am.open_device("cpu") as cpu, am.open_device("cpu3") as other:
        source, destination = (cpu, other) if direction == "cpu to other" else (other, cpu)
        src, dst = await source.alloc(64), await destination.alloc(64)
        await src.write(np.full(64, 1, np.uint8))
        queue, gate = held_queue(source)
        queue.copy(src, np.full(64, 7, np.uint8))  # the source's last writer, held
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(dst.write, src)
                await anyio.wait_all_tasks_blocked()  # the write waits for the writer
                gate.signal(1)
        assert (await dst.read()).tolist() == [7] * 64
        async with am.open_device("cpu2") as hidden:
            with pytest.raises(am.InvalidArgumentError, match=r"use asyncmetal\.copy\(\)"):
                await dst.write(await hidden.alloc(64))


@pytest.mark.parametrize("chunk", [4096, 1000, 1 << 20])
async def test_staged_copy_through_a_ring(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    # Two cpu devices stand in for two kinds with no host-visible side: the ring of
    # staging buffers, chunk boundaries and slot reuse are what is tested.
    monkeypatch.setattr(_transfer, "STAGING_CHUNK", chunk)
    async with am.open_device("cpu:0") as d0, am.open_device("cpu:1") as d1:
        n = 50_000
        data = _bytes(n, 3)
        src, dst = await d0.alloc(n), await d1.alloc(n)
        await src.write(data)
        await _transfer._staged_copy(dst, src, n)
        np.testing.assert_array_equal(await dst.read(), data)


async def test_copy_after_launch_on_the_source_needs_no_host_sync(anyio_backend: object) -> None:
    async with am.open_device("cpu:0") as d0, am.open_device("cpu:1") as d1:
        mix0 = await d0.compile(MIX, "mix")
        src, dst = await d0.alloc(256), await d1.alloc(256)
        await src.write(np.zeros(256, np.uint8))
        tl = d0.timeline()
        q = d0.new_queue()
        q.wait(tl, 1)
        launched = q.launch(mix0, src, vals=(256, 7))
        copied = d1.queue.copy(dst, src)  # submitted while the launch is still blocked
        await anyio.sleep(0.02)
        assert not launched.done() and not copied.done()
        tl.signal(1)
        await copied  # ordered on the devices: sees the launch's result
        expected = np.array([(7 + i) % 256 for i in range(256)], np.uint8)
        np.testing.assert_array_equal(await dst.read(), expected)


async def test_launch_after_copy_on_the_destination_sees_the_data(anyio_backend: object) -> None:
    async with am.open_device("cpu:0") as d0, am.open_device("cpu:1") as d1:
        mix1 = await d1.compile(MIX, "mix")
        src, dst = await d0.alloc(256), await d1.alloc(256)
        tl = d0.timeline()
        d0.queue.wait(tl, 1)
        d0.queue.copy(src, np.full(256, 2, np.uint8))
        d1.queue.copy(dst, src)
        other = d1.new_queue()
        done = other.after(dst).launch(mix1, dst, vals=(256, 1))  # another queue: after()
        tl.signal(1)
        await done
        expected = np.array([(2 * 31 + 1 + i) % 256 for i in range(256)], np.uint8)
        np.testing.assert_array_equal(await dst.read(), expected)


async def test_host_source_is_not_staged(device: am.Device) -> None:
    # The docstring of Queue.copy says a host source is not staged: changing it before
    # the copy completes changes what is copied. This checks that we say the truth.
    buf = await device.alloc(64)
    tl = device.timeline()
    device.queue.wait(tl, 1)
    src = np.zeros(64, np.uint8)
    done = device.queue.copy(buf, src)
    src[:] = 7
    tl.signal(1)
    await done
    assert (await buf.read()).tolist() == [7] * 64


@pytest.mark.parametrize("seed", [99, 7])
async def test_random_interleavings_two_devices_every_byte(
    anyio_backend: object, seed: int
) -> None:
    async with am.open_device("cpu:0") as d0, am.open_device("cpu:1") as d1:
        mixes = [await d.compile(MIX, "mix") for d in (d0, d1)]
        await interleavings([d0, d1], mixes, {}, seed)


async def test_a_copys_host_array_is_let_go_of_once_its_copy_is_awaited(
    device: am.Device,
) -> None:
    """The queue keeps a copy's host array until the copy is done; the task that
    awaited it lets it go then (checked: before, it stayed until the queue's next
    submission -- for an idle queue, as long as the device lived)."""
    buf = await device.alloc(1 << 20)
    q, tl = held_queue(device)
    host = np.ones(1 << 18, np.float32)
    gone = anyio.Event()
    weakref.finalize(host, gone.set)
    done = q.copy(buf, host)
    del host

    async def go_on() -> None:
        await anyio.sleep(0.01)  # the copy's task parks first
        tl.signal(1)

    async with anyio.create_task_group() as tg:
        tg.start_soon(go_on)
        await done
    gc.collect()
    assert gone.is_set()
    assert (await buf.read(np.float32) == 1).all()


# -- copies between kinds: the in-place side's later commands ----------------------------


@pytest.mark.parametrize("later", ["write", "fill", "launch"])
async def test_a_later_write_on_the_sources_device_waits_for_a_copy_between_kinds(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, later: str
) -> None:
    """The other kind's queue reads the cpu buffer in place, held there; a write of
    that buffer submitted next on the cpu device (a copy, a fill, a launch after
    ``after()``) runs only once the copy has read it. Before, the cpu queue did not
    wait for the other kind's copy, and the write changed what it copied."""
    cpu, other, mine, theirs, gate = await held_pair(monkeypatch, "cpu:53")
    fill = await cpu.compile(KERNELS, "fill")
    with anyio.move_on_after(0.05):
        await am.copy(theirs, mine)  # submitted, held behind the gate: cancelled
    if later == "write":
        done = cpu.queue.copy(mine, np.full(16, 7, np.int32))
    elif later == "fill":
        done = cpu.queue.fill(mine, np.int32(7))
    else:
        done = cpu.new_queue().after(mine).launch(fill, mine, vals=(7, 16))
    await _open_gate_after(done, gate, other)
    assert (await theirs.read(np.int32)).tolist() == [1] * 16, "the copy read the later write"
    assert (await mine.read(np.int32)).tolist() == [7] * 16
    await other.close()
    await cpu.close()


async def _open_gate_after(done: am.Completion, gate: am.Timeline, other: am.Device) -> None:
    """Give ``done`` 50 ms (unordered, it would run now), then open the gate holding the
    copy and wait for both."""
    with anyio.move_on_after(0.05):
        await done
    gate.signal(1)
    with anyio.fail_after(10):
        await done
        await other.synchronize()


@pytest.mark.parametrize("later", ["read", "launch"])
async def test_a_later_read_on_the_destinations_device_waits_for_a_copy_between_kinds(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, later: str
) -> None:
    """The other kind's queue writes the cpu buffer in place, held there; a read of
    that buffer submitted next on the cpu device (a copy out, a launch after
    ``after()``) sees the copy's bytes. Before, it ran first and saw the old ones."""
    cpu, other, mine, theirs, gate = await held_pair(monkeypatch, "cpu:54")
    step = await cpu.compile(KERNELS, "step")
    with anyio.move_on_after(0.05):
        await am.copy(mine, theirs)  # submitted, held behind the gate: cancelled
    seen = np.zeros(16, np.int32)
    if later == "read":
        done = cpu.queue.copy(seen, mine)
    else:  # mine[0] = mine[0] * 31 + mine[1]: 96 from the copy's 3s, 32 from the 1s
        done = cpu.new_queue().after(mine).launch(step, mine, vals=(0, 1, 0))
    await _open_gate_after(done, gate, other)
    expected = [3] * 16
    if later == "launch":
        seen, expected[0] = await mine.read(np.int32), 96
    assert seen.tolist() == expected, "read before the copy wrote"
    await other.close()
    await cpu.close()


@pytest.mark.parametrize("cpu_side", ["earlier", "later"])
async def test_an_npy_queues_copy_into_lent_cpu_memory_is_ordered_with_the_cpu_device(
    anyio_backend: object, cpu_side: str
) -> None:
    """An npy queue copies into a host array over a cpu buffer's memory (a DLPack
    export): a copy of another kind's queue, which uses that buffer. A cpu write of it
    submitted before that copy, held, runs first; a cpu read submitted after it, with
    the npy queue held, sees its bytes. Before, the host array was a plain operand of
    the npy queue, ordered with neither."""
    async with am.open_device("cpu:55") as cpu:
        mine = await cpu.alloc(64)
        await mine.write(np.full(16, 1, np.int32))
        src = await am.from_numpy(np.full(16, 3, np.int32))
        lent = np.from_dlpack(mine)  # mine's memory, no copy
        seen = np.zeros(16, np.int32)
        if cpu_side == "earlier":
            q, tl = held_queue(cpu)
            first = q.copy(mine, np.full(16, 5, np.int32))
            then = src.device.queue.copy(lent, src)
        else:
            q, tl = held_queue(src.device)
            first = q.copy(lent, src)
            then = cpu.queue.copy(seen, mine)
        with anyio.move_on_after(0.05):
            await then  # (unordered, it runs now)
        tl.signal(1)
        with anyio.fail_after(10):
            await first
            await then
        if cpu_side == "later":
            assert seen.tolist() == [3] * 16, "read before the npy queue's copy wrote"
        assert (await mine.read(np.int32)).tolist() == [3] * 16
        del lent


async def test_a_queue_copies_between_its_buffer_and_a_host_kinds_buffer(
    anyio_backend: object,
) -> None:
    """``Queue.copy`` between a cpu buffer and an npy buffer -- two kinds whose memory
    the host sees -- is a host copy on the queue, in either direction (the cpu queue
    reads the npy buffer in place; the npy queue writes the cpu buffer in place),
    returned at once and ordered on the devices like any copy: after the held command
    that wrote the cpu buffer before it, and before the cpu queue's later copy out of
    it. Before, it was refused, saying to stage it through the host. Checked failing
    without the fix."""
    async with am.open_device("cpu") as cpu, am.open_device("npy") as npy:
        arr = np.arange(64, dtype=np.int32)
        src = npy._wrap(arr)
        buf = await cpu.alloc(arr.nbytes)
        await cpu.queue.copy(buf, src)  # on the cpu queue: npy read in place
        assert (await buf.read(np.int32)).tolist() == arr.tolist()
        await buf.write(np.zeros(64, np.int32))
        held, gate = held_queue(cpu)
        held.copy(buf, np.full(64, 7, np.int32))  # the buffer's last writer, held
        copied = npy.queue.copy(buf.view(0, 128), src.view(128, 128))  # written in place
        out = np.zeros(64, np.int32)
        read = cpu.queue.copy(out, buf)
        assert not copied.done() and not read.done()  # (neither waits on the host)
        gate.signal(1)
        with anyio.fail_after(10):
            await read
        assert copied.done()
        assert out.tolist() == arr[32:64].tolist() + [7] * 32


@pytest.mark.parametrize("direction", ["in", "out"])
async def test_a_queue_copy_with_another_kinds_buffer_refuses_what_it_cannot_order(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, direction: str
) -> None:
    """``Queue.copy`` between its buffer and another kind's says why it refuses, with
    nothing submitted: a kind whose memory the host cannot see (``asyncmetal.copy``
    stages it, or runs on that kind's queue), and a host-visible buffer in use by a
    command that the queue cannot wait for on the device (``asyncmetal.copy`` waits on
    the host) -- copied once that command ran."""
    monkeypatch.setitem(backends.BACKENDS, "cpu2", "tests.support.other_kind:OtherKind")
    monkeypatch.setitem(backends.BACKENDS, "cpu4", "tests.support.other_kind:NoWaitKind")
    async with (
        am.open_device("cpu") as cpu,
        am.open_device("cpu2") as hidden,
        am.open_device("cpu4") as other,
    ):
        mine, theirs = await cpu.alloc(64), await other.alloc(64)
        await theirs.write(np.full(64, 3, np.uint8))
        with pytest.raises(am.InvalidArgumentError, match=r"cannot see.*asyncmetal\.copy\(\)"):
            cpu.queue.copy(mine, await hidden.alloc(64))
        held, gate = held_queue(cpu)
        held.fill(mine, 5)  # a use of the cpu buffer that cpu4's queues cannot wait for
        operands = (mine, theirs) if direction == "out" else (theirs, mine)
        submitted = other.queue.submitted
        with pytest.raises(am.InvalidArgumentError, match=r"cannot wait for.*asyncmetal\.copy"):
            other.queue.copy(*operands)
        assert other.queue.submitted == submitted
        gate.signal(1)
        await held.synchronize()
        await other.queue.copy(*operands)
        expected = 3 if direction == "out" else 5
        assert (await operands[0].read()).tolist() == [expected] * 64

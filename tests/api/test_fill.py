"""Queue.fill and alloc(zeroed=True): a memset on the device, ordered like a write, on
every device the `device` fixture opens (cpu; metal where it opens), asyncio and trio."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import anyio
import numpy as np
import pytest

import asyncmetal as am

pytestmark = pytest.mark.anyio

N = 256


@contextlib.contextmanager
def released(tl: am.Timeline) -> Iterator[am.Timeline]:
    """``tl``, signalled to 1 on the way out if it was not: a failed check does not leave
    a queue waiting for good (its close would wait for it)."""
    try:
        yield tl
    finally:
        if tl.value < 1:
            tl.signal(1)


async def _numbered(device: am.Device, nbytes: int = N) -> tuple[am.Buffer, np.ndarray]:
    """A buffer holding 1, 2, 3, ... (every byte nonzero), and those bytes."""
    data = (np.arange(nbytes) % 251 + 1).astype(np.uint8)
    buf = await device.alloc(nbytes)
    await buf.write(data)
    return buf, data


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        (0, b"\x00"),
        (0xAB, b"\xab"),
        (np.uint8(7), b"\x07"),
        (np.int8(-1), b"\xff"),
        (np.uint16(0x0101), b"\x01\x01"),
        (np.uint32(0), b"\x00\x00\x00\x00"),
        (np.float32(np.frombuffer(b"\x3c" * 4, np.float32)[0]), b"\x3c" * 4),
    ],
    ids=["zero", "byte", "np-uint8", "np-int8", "uint16-repeated", "uint32-zero", "float32"],
)
async def test_fill_writes_the_pattern_over_the_range_only(
    device: am.Device, value: object, pattern: bytes
) -> None:
    """Patterns every device takes (Metal: one byte repeated), over the whole buffer and
    over a range of whole words inside it: the bytes around the range are untouched."""
    buf, data = await _numbered(device)
    await device.queue.fill(buf, value)
    assert bytes(await buf.read()) == pattern * (N // len(pattern))

    buf, data = await _numbered(device)
    done = device.queue.fill(buf, value, offset=8, size=32)
    assert isinstance(done, am.Completion)
    await done
    expected = data.copy()
    expected[8:40] = np.frombuffer(pattern * (32 // len(pattern)), np.uint8)
    np.testing.assert_array_equal(await buf.read(), expected)


@pytest.mark.parametrize(
    ("value", "offset", "size"),
    [
        (np.uint16(0x0102), 2, 6),
        (np.int16(-2), 10, 20),
        (np.float16(1.5), 0, N),
        (np.uint32(0xDEADBEEF), 4, 12),
        (np.int32(-7), 12, 240),
        (np.float32(-3.25), 0, N),
        (0x5A, 3, 1),
        (0x5A, 1, 250),
    ],
)
async def test_fill_patterns_of_each_size_on_cpu(
    anyio_backend: object, value: np.generic | int, offset: int, size: int
) -> None:
    """2- and 4-byte patterns of different bytes, and bytes at any offset (the cpu device;
    cuda: tests/backends/cuda; Metal fills bytes only): each item holds the scalar's bits,
    the rest of the buffer is untouched."""
    async with am.open_device("cpu") as device:
        buf, data = await _numbered(device)
        await device.queue.fill(buf, value, offset=offset, size=size)
        got = await buf.read()
        item = np.array(value, np.uint8 if isinstance(value, int) else type(value))
        expected = data.copy()
        expected[offset : offset + size] = np.frombuffer(
            item.tobytes() * (size // item.nbytes), np.uint8
        )
        np.testing.assert_array_equal(got, expected)
        typed = got[offset : offset + size].view(item.dtype)
        assert (typed.view(np.uint8) == np.frombuffer(item.tobytes() * len(typed), np.uint8)).all()


async def test_a_fill_of_a_view_fills_its_range(device: am.Device) -> None:
    buf, data = await _numbered(device)
    view = buf.view(64, 64)
    await device.queue.fill(view, 0xEE, offset=4, size=8)
    expected = data.copy()
    expected[68:76] = 0xEE
    np.testing.assert_array_equal(await buf.read(), expected)


async def test_a_read_after_a_fill_on_another_queue_sees_the_fill(device: am.Device) -> None:
    """The fill is held on another queue behind a device wait; the read, submitted after
    it on the default queue, waits for it (on the device) and sees its bytes."""
    buf, data = await _numbered(device)
    tl = device.timeline()
    async with device.new_queue() as q2:
        with released(tl):
            q2.wait(tl, 1)
            filled = q2.fill(buf, 0x11, offset=16, size=16)
            assert buf.busy()  # the fill is recorded as a use of the buffer
            got: list[np.ndarray] = []
            async with anyio.create_task_group() as tg:

                async def read() -> None:
                    got.append(await buf.read())

                tg.start_soon(read)
                await anyio.sleep(0.05)
                assert not got and not filled.done()
                tl.signal(1)
            expected = data.copy()
            expected[16:32] = 0x11
            np.testing.assert_array_equal(got[0], expected)
            assert filled.done()


async def test_a_fill_after_a_write_on_another_queue_lands_after_it(device: am.Device) -> None:
    """A write held on another queue, then a fill of part of the same buffer on the
    default queue: the fill waits for the write, so its range ends filled."""
    buf = await device.alloc(N)
    data = np.full(N, 0x77, np.uint8)
    tl = device.timeline()
    async with device.new_queue() as q2:
        with released(tl):
            q2.wait(tl, 1)
            written = q2.copy(buf, data)
            filled = device.queue.fill(buf, 0, offset=N // 2, size=N // 4)
            await anyio.sleep(0.05)
            assert not filled.done()
            tl.signal(1)
            await filled
            await written
    expected = data.copy()
    expected[N // 2 : N // 2 + N // 4] = 0
    np.testing.assert_array_equal(await buf.read(), expected)


async def test_a_copy_on_another_queue_after_a_fill_copies_the_filled_bytes(
    device: am.Device,
) -> None:
    src, _ = await _numbered(device)
    dst = await device.alloc(N)
    await device.queue.fill(dst, 0)
    tl = device.timeline()
    async with device.new_queue() as q2:
        with released(tl):
            q2.wait(tl, 1)
            q2.fill(src, 0x42)
            copied = device.queue.copy(dst, src)  # ordered after q2's fill, on the device
            await anyio.sleep(0.05)
            assert not copied.done()
            tl.signal(1)
            await copied
    assert (await dst.read() == 0x42).all()


async def test_a_buffer_freed_behind_a_held_fill_returns_only_after_it(
    device: am.Device,
) -> None:
    buf = await device.alloc(N)
    tl = device.timeline()
    async with device.new_queue() as q2:
        with released(tl):
            q2.wait(tl, 1)
            filled = q2.fill(buf, 1)
            with anyio.move_on_after(0.05) as scope:
                await buf.free()  # waits for the fill
            assert scope.cancelled_caught
            assert device.memory_statistics().in_use > 0
            tl.signal(1)
            await filled
    await device.queue.synchronize()
    assert device.memory_statistics().in_use == 0


async def test_zeroed_alloc_zeroes_a_block_from_the_cache(device: am.Device) -> None:
    """A freed block that held data comes back from the cache as it was (alloc does not
    zero), and with zeroed=True as zeros, ready for any queue once alloc returns."""
    buf, data = await _numbered(device, 4096)
    await buf.free()
    cached = device.memory_statistics().cached
    assert cached >= 4096
    reused = await device.alloc(4096)
    assert device.memory_statistics().cached == cached - 4096  # the same block again
    np.testing.assert_array_equal(await reused.read(), data)
    await reused.free()

    zeroed = await device.alloc(4096, zeroed=True)
    assert device.memory_statistics().cached == cached - 4096
    assert not zeroed.busy()  # its fill has finished: other queues see zeros too
    async with device.new_queue() as q2:
        out = np.ones(4096, np.uint8)
        await q2.copy(out, zeroed)
    assert not out.any()


@pytest.mark.parametrize("nbytes", [1, 3, 10, 1001, 5000])
async def test_zeroed_alloc_of_any_size(device: am.Device, nbytes: int) -> None:
    """Sizes that are not whole words too (Metal fills whole words: the block is
    allocated to the next one)."""
    async with await device.alloc(8192) as dirty:  # (a dirty block for the cache)
        await dirty.write(np.full(8192, 0xFF, np.uint8))
    buf = await device.alloc(nbytes, zeroed=True)
    assert buf.nbytes == nbytes
    assert not (await buf.read()).any()


async def test_zeroed_alloc_cancelled_during_its_fill_frees_the_buffer(
    device: am.Device,
) -> None:
    """The default queue is held behind a device wait: the zeroing fill cannot run, the
    caller gives up, and the block is released once the fill has run."""
    with released(device.timeline()) as tl:
        device.queue.wait(tl, 1)
        with anyio.move_on_after(0.05) as scope:
            await device.alloc(N, zeroed=True)
        assert scope.cancelled_caught
        assert device.memory_statistics().in_use > 0  # the fill still holds it
        tl.signal(1)
    await device.queue.synchronize()
    assert device.memory_statistics().in_use == 0


async def test_fill_refuses_bad_arguments_before_submitting(device: am.Device) -> None:
    buf = await device.alloc(N)
    q = device.queue
    before = q.submitted
    type_errors: list[tuple[object, dict[str, object], str]] = [
        (b"no", {}, "buf must be a Buffer, got bytes"),
        (buf, {"value": 1.5}, r"np.float32\(x\)"),
        (buf, {"value": True}, "got bool"),
        (buf, {"value": np.float64(1)}, "got numpy float64"),
        (buf, {"value": np.uint64(1)}, "got numpy uint64"),
        (buf, {"value": np.bool_(True)}, "got numpy bool"),
        (buf, {"value": "a"}, "got str"),
        (buf, {"offset": 1.0}, "offset must be an int"),
        (buf, {"offset": True}, "offset must be an int"),
        (buf, {"size": "8"}, "size must be an int or None"),
    ]
    for target, kwargs, message in type_errors:
        kwargs = {"value": 0, **kwargs}
        with pytest.raises(am.ArgumentTypeError, match=message):
            q.fill(target, **kwargs)  # type: ignore[arg-type]
    pending = device.alloc(4)
    with pytest.raises(am.ArgumentTypeError, match="did you forget to await"):
        q.fill(pending, 0)  # type: ignore[arg-type]
    pending.close()
    value_errors: list[tuple[dict[str, object], str]] = [
        ({"value": 256}, "value must be a byte, 0 to 255, got 256"),
        ({"value": -1}, "value must be a byte"),
        ({"offset": -4}, r"offset must be in \[0, 255\]"),
        ({"offset": N}, r"offset must be in \[0, 255\]"),
        ({"size": 0}, r"size must be in \[1, 256\]"),
        ({"offset": 8, "size": N}, r"size must be in \[1, 248\]"),
        ({"value": np.uint32(0), "offset": 2, "size": 4}, "offset must be a multiple of 4"),
        ({"value": np.uint32(0), "size": 6}, "size must be a multiple of 4"),
    ]
    for kwargs, message in value_errors:
        kwargs = {"value": 0, **kwargs}
        with pytest.raises(am.InvalidArgumentError, match=message):
            q.fill(buf, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(am.InvalidArgumentError, match="a view at byte 2"):
        q.fill(buf.view(2, 8), np.uint32(0))
    async with am.open_device("cpu:7") as other:
        theirs = await other.alloc(N)
        with pytest.raises(am.InvalidArgumentError, match="buf is a buffer of cpu:7"):
            q.fill(theirs, 0)
    async with am.open_device("npy") as npy:
        source = await am.from_numpy(np.zeros(N, np.uint8))
        with pytest.raises(am.InvalidArgumentError, match="read-only sources"):
            npy.queue.fill(source, 0)
    freed = await device.alloc(N)
    await freed.free()
    with pytest.raises(am.ClosedResourceError, match="buf was freed"):
        q.fill(freed, 0)
    with pytest.raises(am.ArgumentTypeError, match="zeroed must be a bool"):
        await device.alloc(N, zeroed=1)  # type: ignore[arg-type]
    assert q.submitted == before  # nothing was submitted


async def test_metal_fills_bytes_over_whole_words(anyio_backend: object) -> None:
    """Metal's blit fill writes one byte over whole 4-byte words (macOS): a wider pattern
    of different bytes, and a range of part of a word, are refused before submitting."""
    if "metal" not in am.devices():
        pytest.skip("no Metal device (nor the simulated one) here")
    async with am.open_device("metal") as device:
        buf = await device.alloc(N)
        q = device.queue
        with pytest.raises(am.InvalidArgumentError, match="fills bytes only"):
            q.fill(buf, np.uint16(0x0102))
        with pytest.raises(am.InvalidArgumentError, match="offset must be a multiple of 4"):
            q.fill(buf, 1, offset=2, size=4)
        with pytest.raises(am.InvalidArgumentError, match="size must be a multiple of 4"):
            q.fill(buf, np.uint16(0), size=6)
        with pytest.raises(am.InvalidArgumentError, match="a view at byte 2"):
            q.fill(buf.view(2, 8), 0)
        assert q.submitted == 0
        await q.fill(buf, np.float32(0.0), offset=4, size=8)
        await q.fill(buf, np.uint32(0xA5A5A5A5), offset=12, size=4)
        got = await buf.read()
        assert not got[4:12].any() and (got[12:16] == 0xA5).all()

"""The npy device as a backend of its own: what it does (wrap arrays, be read, in place
or copied out, ordered by its queues and timelines) and what it refuses, saying so
(allocating, being written, kernels)."""

from __future__ import annotations

import numpy as np
import pytest

import asyncmetal as am

pytestmark = pytest.mark.anyio


async def test_npy_buffers_are_read_and_ordered_like_device_buffers(anyio_backend: object) -> None:
    async with am.open_device("npy") as npy, am.open_device("cpu") as cpu:
        assert npy.kind == "npy" and npy.name == "npy" and npy.total_memory > 0
        arr = np.arange(256, dtype=np.int32)
        buf = npy._wrap(arr)
        np.testing.assert_array_equal(await buf.read(np.int32), arr)
        np.testing.assert_array_equal(await buf.view(64, 64).read(np.int32), arr[16:32])
        mapped = await buf.map(np.int32)  # read in place: the array itself, read-only
        np.testing.assert_array_equal(mapped, arr)
        assert not mapped.flags.writeable
        # Its queue orders a copy out behind a wait on its own timeline.
        gate = npy.timeline()
        queue = npy.new_queue()
        queue.wait(gate, 1)
        out = np.zeros(256, np.int32)
        done = queue.copy(out, buf)
        assert not done.done()
        gate.signal(1)
        await done
        np.testing.assert_array_equal(out, arr)
        # To another device: through the host, read in place.
        dst = await cpu.alloc(arr.nbytes)
        await am.copy(dst, buf)
        np.testing.assert_array_equal(await dst.read(np.int32), arr)
        await npy.synchronize()
        await buf.free()


async def test_npy_refuses_what_it_does_not_do(anyio_backend: object) -> None:
    async with am.open_device("npy") as npy:
        buf = npy._wrap(np.ones(64, np.uint8))
        with pytest.raises(am.InvalidArgumentError, match="from_numpy"):
            await npy.alloc(64)
        with pytest.raises(am.InvalidArgumentError, match="read-only"):
            await buf.write(bytes(64))
        with pytest.raises(am.InvalidArgumentError, match="read-only"):
            npy.queue.copy(buf, bytes(64))
        with pytest.raises(am.InvalidArgumentError, match="read-only"):
            await am.copy(buf.view(0, 32), buf.view(32, 32))
        with pytest.raises(am.CompileError, match="runs no kernels"):
            await npy.compile("void k(int* x) { x[0] = 1; }", "k")
        with pytest.raises(am.CompileError, match="runs no kernels"):
            npy._backend.load(b"\x7fELF", "k")  # reached by no public call: refused too
        with pytest.raises(am.ArgumentTypeError, match="numpy array"):
            npy._wrap(b"bytes")
    with pytest.raises(am.AsyncMetalError, match="not available"):
        await am.open_device("npy:1")  # one npy device: there is nothing to number


async def test_npy_is_never_the_default_device(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert am.devices()[-1] == "npy"  # listed, last
    monkeypatch.setenv("ASYNCMETAL_DEVICE", "npy")
    async with am.open_device() as dev:  # holds no kernels: the host device instead
        assert dev.kind == "cpu"
    async with am.open_device("npy") as dev:  # named: opened
        assert dev.kind == "npy"


async def test_npy_wraps_an_array_subclass_as_its_plain_memory(anyio_backend: object) -> None:
    """``from_numpy`` takes any ndarray, subclasses too (``np.matrix``, a masked array):
    its buffer is the array's memory, read alike whole and in parts, on every path --
    also where a part is read in place, which the subclass's own slicing (a matrix's by
    rows, a masked array's with its mask) would not give as bytes."""
    plain = np.arange(8, dtype=np.int32)
    async with am.open_device("cpu") as cpu:
        matrix = plain.reshape(2, 4).view(np.matrix)  # (np.matrix() warns that it is deprecated)
        for array in (matrix, np.ma.array(plain, mask=[0, 1] * 4)):
            buf = await am.from_numpy(array)
            part = buf.view(8, 8)
            np.testing.assert_array_equal(await buf.read(np.int32), plain)
            np.testing.assert_array_equal(await part.read(np.int32), plain[2:4])
            np.testing.assert_array_equal(await part.map(np.int32), plain[2:4])
            out = await cpu.alloc(8)
            await cpu.queue.copy(out, part)  # read in place by the cpu queue
            np.testing.assert_array_equal(await out.read(np.int32), plain[2:4])
            await out.write(np.zeros(2, np.int32))
            await out.write(part)
            np.testing.assert_array_equal(await out.read(np.int32), plain[2:4])
            await out.write(np.zeros(2, np.int32))
            await am.copy(out, part)
            np.testing.assert_array_equal(await out.read(np.int32), plain[2:4])

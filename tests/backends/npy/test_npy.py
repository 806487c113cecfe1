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

"""Interop on any machine: Queue.marker() on every backend, DLPack both ways with numpy
and JAX (the same memory, written through one side and read through the other), the lifetime
of exported memory, and what is refused."""

from __future__ import annotations

import asyncio
import ctypes
import functools
import gc
import re
import sys
import threading
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _dlpack
from tests.api.test_dlpack_take import _tensor
from tests.support.kernels import KERNELS

pytestmark = pytest.mark.anyio

_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]


# -- Queue.marker() -----------------------------------------------------------------------


async def test_marker_covers_what_was_submitted(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """The launch is held behind a device wait on a timeline only the test signals: the
    marker stays pending until then, however long the host takes between the calls (a
    kernel's run time cannot stand for that, on a loaded machine)."""
    q = device.new_queue()
    assert q.marker().done()  # nothing submitted: done at once
    await q.marker()
    gate = device.timeline()
    q.wait(gate, 1)
    try:
        launched = q.launch(kernels["empty"])
        marker = q.marker()
        assert not marker.done()
    finally:
        gate.signal(1)
    await marker
    assert launched.done()
    assert q.timeline.value >= marker.value == launched.value == q.submitted
    later = q.launch(kernels["empty"])
    assert marker.value < later.value
    await q.marker()
    assert later.done()


async def test_marker_of_the_npy_device_and_after_close(anyio_backend: object) -> None:
    buf = await am.from_numpy(np.arange(8, dtype=np.int32))
    out = np.zeros(8, np.int32)
    q = buf.device.queue
    q.copy(out, buf)
    await q.marker()
    assert out.tolist() == list(range(8))
    dev = await am.open_device("cpu:1")
    q = dev.queue
    await dev.close()
    with pytest.raises(am.ClosedResourceError):
        q.marker()


async def test_adopting_a_stream_is_for_cuda(device: am.Device) -> None:
    with pytest.raises(am.InvalidArgumentError, match="adopt_stream is for cuda"):
        device.adopt_stream(1)
    assert device.queue.handle is None


# -- buffers out --------------------------------------------------------------------------


async def test_dlpack_device_of_each_kind(device: am.Device) -> None:
    buf = await device.alloc(16)
    expected = {"cpu": (1, 0), "metal": (8, 0)}[device.name]
    assert buf.__dlpack_device__() == expected
    assert buf.typed(np.float32).__dlpack_device__() == expected
    assert not hasattr(buf, "__cuda_array_interface__")
    npy = await am.from_numpy(np.zeros(4))
    assert npy.__dlpack_device__() == (1, 0)


async def test_from_dlpack_of_an_unusable_buffer_says_why(anyio_backend: object) -> None:
    """A buffer of a closed device, or one freed, given to from_dlpack: said so
    (ClosedResourceError), whatever devices are open. Checked failing without (run
    alone, no other cpu device open): 'no open device holds DLPack device (1, 0)'s memory: open it
    first' (InvalidArgumentError) for the closed device's buffer."""
    device = await am.open_device("cpu:77")
    closed, freed = await device.alloc(64), await device.alloc(64)
    await freed.free()
    with pytest.raises(am.ClosedResourceError, match="buffer was freed"):
        am.from_dlpack(freed)
    await device.close()
    with pytest.raises(am.ClosedResourceError, match="belongs to the closed device cpu:77"):
        am.from_dlpack(closed)


async def test_a_freed_host_buffer_has_no_cuda_array_interface_either(
    anyio_backend: object,
) -> None:
    """``hasattr(buf, "__cuda_array_interface__")`` -- how CuPy, Numba and PyTorch ask
    -- is False for a buffer of the cpu device whatever its state: freed, or of a
    closed device (it never has one), as the README says of other devices' buffers.
    Checked: fails without the fix (the freed buffer's ClosedResourceError came out of
    hasattr)."""
    dev = await am.open_device("cpu")
    freed, kept = await dev.alloc(16), await dev.alloc(16)
    view = freed.typed(np.float32)
    await freed.free()
    await dev.close()
    for buf in (freed, view, kept):
        assert not hasattr(buf, "__cuda_array_interface__")
        with pytest.raises(am.ClosedResourceError):
            buf.__dlpack__()


async def _cpu_kernels(device: am.Device) -> dict[str, am.Program]:
    return {name: await device.compile(KERNELS, name) for name in ("fill", "empty")}


async def test_numpy_shares_a_cpu_buffer_both_ways(anyio_backend: object) -> None:
    async with am.open_device("cpu") as device:
        await _numpy_shares(device, await _cpu_kernels(device))


async def _numpy_shares(device: am.Device, kernels: dict[str, am.Program]) -> None:
    buf = await device.alloc(64)
    await buf.write(np.arange(16, dtype=np.float32))
    raw = np.from_dlpack(buf)  # 1-D uint8, the buffer's bytes
    assert raw.dtype == np.uint8 and raw.shape == (64,)
    assert raw.view(np.float32).tolist() == list(range(16))
    grid = np.from_dlpack(buf.typed(np.float32, (4, 4)))
    assert grid.shape == (4, 4) and grid.dtype == np.float32
    assert grid.ctypes.data == raw.ctypes.data  # the same memory, no copy
    grid[1, :] = -1  # numpy writes, the device reads
    assert (await buf.read(np.float32))[4:8].tolist() == [-1] * 4
    await device.queue.launch(kernels["fill"], buf, vals=(7, 16))  # the device writes
    assert grid.view(np.int32).ravel().tolist() == [7] * 16  # numpy reads


async def test_legacy_and_versioned_capsules(device: am.Device) -> None:
    buf = await device.alloc(8)
    assert _capsule_name(buf.__dlpack__()) == b"dltensor"
    assert _capsule_name(buf.__dlpack__(max_version=(1, 0))) == b"dltensor_versioned"
    assert _capsule_name(buf.__dlpack__(max_version=(0, 8))) == b"dltensor"
    # unconsumed capsules delete their tensors: the memory is free to return
    gc.collect()
    await buf.free()
    stats = device.memory_statistics()
    assert stats.in_use == 0


async def test_exported_memory_outlives_a_freed_buffer(anyio_backend: object) -> None:
    async with am.open_device("cpu") as dev:
        buf = await dev.alloc(4096)
        await buf.write(np.full(1024, 5, np.int32))
        held = np.from_dlpack(buf.typed(np.int32))
        await buf.free()
        assert dev.memory_statistics().in_use == 4096  # lent: not released
        other = await dev.alloc(4096)  # not the held memory: it is not reused
        await other.write(np.zeros(1024, np.int32))
        assert held.tolist() == [5] * 1024
        held[:] = 9  # still the consumer's to write
        # The consumer lets go on another thread: the memory returns to the allocator.
        dropper = threading.Thread(target=lambda: held_box.clear())
        held_box = [held]
        del held
        dropper.start()
        dropper.join()
        gc.collect()
        stats = dev.memory_statistics()
        assert (stats.in_use, stats.cached) == (4096, 4096)
        await other.free()


async def test_a_dropped_buffer_keeps_exported_memory(anyio_backend: object) -> None:
    async with am.open_device("cpu") as dev:
        buf = await dev.alloc(256)
        await buf.write(np.full(64, 3, np.int32))
        held = np.from_dlpack(buf.typed(np.int32))
        del buf
        gc.collect()
        again = await dev.alloc(256)
        await again.write(np.zeros(64, np.int32))
        assert held.tolist() == [3] * 64
        assert dev.memory_statistics().in_use == 1024  # two blocks of 256 B's class, 512


async def test_exporting_memory_a_command_uses_is_refused(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    buf = await device.alloc(64)
    done = device.queue.launch(kernels["fill"], buf, vals=(1, 16))
    busy = device.new_queue().after(buf)
    gate = device.timeline()  # holds the other queue's use until the checks are made
    busy.wait(gate, 1)
    try:
        use = busy.launch(kernels["fill"], buf, vals=(2, 16))
        assert buf.busy()
        with pytest.raises(BufferError, match="in flight"):
            buf.__dlpack__()
    finally:
        gate.signal(1)
    await done
    await use
    assert not buf.busy()
    assert buf.__dlpack__() is not None


async def test_a_typed_view_takes_shapes_as_read_does(device: am.Device) -> None:
    """numpy ints and one -1, as numpy's reshape (and read and map) take them. Checked:
    without it, np.int64(16) was "not an int", and (np.int64(16),) a shape that "does
    not hold the buffer's 16 items"."""
    buf = await device.alloc(64)
    assert buf.typed(np.float32, np.int64(16)).shape == (16,)
    assert buf.typed(np.float32, (np.int64(4), np.int32(4))).shape == (4, 4)
    assert buf.typed(np.float32, (2, -1)).shape == (2, 8)
    assert buf.typed(np.float32, [4, 4]).shape == (4, 4)
    if device.name == "cpu":
        assert np.from_dlpack(buf.typed(np.float32, (np.int64(2), -1))).shape == (2, 8)
    with pytest.raises(am.InvalidArgumentError, match=r"shape \(5,\) does not cover"):
        buf.typed(np.float32, (5,))
    with pytest.raises(am.InvalidArgumentError, match=r"does not cover.*buf\.view"):
        buf.typed(np.float32, (3, -1))
    with pytest.raises(am.ArgumentTypeError, match="shape"):
        buf.typed(np.float32, (4.0, 4))
    await buf.free()


async def test_a_negative_dimension_other_than_one_minus_one_is_refused(
    device: am.Device,
) -> None:
    """One -1 takes what the other dimensions leave; any other negative dimension (which
    numpy's reshape takes as -1 too) is refused naming the shape, for typed() and
    read() alike. Checked: without it, (2, -8) gave (2, 8), and (-1, -16) was refused
    as a shape that "does not cover the buffer's 16 items"."""
    buf = await device.alloc(64)
    for shape in [(2, -8), (-1, -16), (-1, -1), -2]:
        with pytest.raises(am.InvalidArgumentError, match=rf"shape {re.escape(repr(shape))} has"):
            buf.typed(np.float32, shape)
        with pytest.raises(am.InvalidArgumentError, match=rf"shape {re.escape(repr(shape))} has"):
            await buf.read(np.float32, shape)
    assert (await buf.read(np.float32, (-1, 4))).shape == (4, 4)
    await buf.free()


async def test_copy_true_copies_host_memory(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """As the array API asks: copy=True (or dl_device another device, copy not False)
    gives a copy, made of host memory exported as kDLCPU; a command still using the
    memory is refused as for a shared export. Checked: without it, copy=True was
    refused everywhere, and so was np.from_dlpack(metal_buffer, device="cpu")."""
    buf = await device.alloc(64)
    await buf.write(np.arange(16, dtype=np.int32))
    cpu = (1, 0)
    if device.name == "cpu":
        copied = np.from_dlpack(buf.typed(np.int32, (4, 4)), copy=True)
    else:  # Metal memory: a copy as kDLCPU only (no new MTLBuffer is made at once)
        with pytest.raises(BufferError, match="copy=True is supported for host memory"):
            buf.__dlpack__(copy=True)
        with pytest.raises(BufferError, match="without copying there"):
            buf.__dlpack__(dl_device=cpu, copy=False)
        copied = np.from_dlpack(buf.typed(np.int32, (4, 4)), device="cpu")
    assert copied.tolist() == np.arange(16).reshape(4, 4).tolist()
    copied[:] = 0  # the copy's own memory
    assert (await buf.read(np.int32)).tolist() == list(range(16))
    capsule = buf.__dlpack__(max_version=(1, 0), dl_device=cpu, copy=True)
    managed = _tensor(capsule)[0]
    assert managed.flags & _dlpack.FLAG_IS_COPIED
    assert managed.dl_tensor.device.device_type == 1
    with pytest.raises(BufferError, match="must be None"):
        buf.__dlpack__(dl_device=cpu, copy=True, stream=1)
    # The array API's copy is a bool (numpy's too) or None: nothing else is taken for one.
    for wrong in ("yes", "", 1, 0, 1.0):
        with pytest.raises(TypeError, match="copy must be True, False or None"):
            buf.__dlpack__(dl_device=cpu, copy=wrong)
    numpy_true = buf.__dlpack__(max_version=(1, 0), dl_device=cpu, copy=np.True_)
    assert _tensor(numpy_true)[0].flags & _dlpack.FLAG_IS_COPIED
    del numpy_true
    gate = device.timeline()  # holds the use until the export was refused
    device.queue.wait(gate, 1)
    try:
        use = device.queue.launch(kernels["fill"], buf, vals=(2, 16))
        with pytest.raises(BufferError, match="in flight"):
            buf.__dlpack__(dl_device=cpu, copy=True)
    finally:
        gate.signal(1)
    await use
    del capsule, managed
    await buf.free()
    gc.collect()
    assert device.memory_statistics().in_use == 0  # a copy holds no loan


async def test_what_an_export_refuses(device: am.Device) -> None:
    buf = await device.alloc(64)
    with pytest.raises(BufferError, match="DLPack device"):
        buf.__dlpack__(dl_device=(2, 0))
    # max_version and dl_device are pairs of ints, named where they are not. Checked:
    # "x" raised a plain TypeError naming neither, and (1,) asked for the legacy capsule.
    for bad in ("x", (1,), (1, 0, 0), ("1", "0"), (1.0, 0), None.__class__):
        with pytest.raises(am.ArgumentTypeError, match="max_version must be a pair"):
            buf.__dlpack__(max_version=bad)
        with pytest.raises(am.ArgumentTypeError, match="dl_device must be a pair"):
            buf.__dlpack__(dl_device=bad)
    with pytest.raises(am.InvalidArgumentError, match="shape"):
        buf.typed(np.float32, (3, 5))
    with pytest.raises(am.InvalidArgumentError, match="whole number"):
        (await device.alloc(10)).typed(np.float32)
    with pytest.raises(am.ArgumentTypeError, match="DLPack exports"):
        buf.typed(np.dtype([("a", np.int32)]))
    await buf.free()
    with pytest.raises(am.ClosedResourceError, match="freed"):
        buf.__dlpack__()


async def test_arrays_of_ml_dtypes_are_copied_read_and_mapped(device: am.Device) -> None:
    """ml_dtypes' bfloat16 and float8 arrays (JAX's, PyTorch's) have no buffer-protocol
    format: their bytes are copied as they are, and read() and map() give their type.
    Checked: write, copies and read raised a plain ValueError ("cannot include dtype
    'E' in a buffer"), and map() gave an array of void items (V2)."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="needs ml_dtypes (JAX installs it)")
    bf16, f8 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn
    values = np.arange(8, dtype=np.float32).astype(bf16)
    buf = await device.alloc(16)
    await buf.write(values)
    assert (await buf.read(np.uint16)).tolist() == values.view(np.uint16).tolist()
    read = await buf.read(bf16, (2, 4))
    assert read.dtype == bf16 and read.astype(np.float32).ravel().tolist() == list(range(8))
    mapped = await buf.map(bf16)
    assert mapped.dtype == bf16 and mapped.astype(np.float32).tolist() == list(range(8))
    del mapped
    assert (await buf.read(f8)).view(np.uint8).tolist() == values.view(np.uint8).tolist()
    await am.copy(buf, np.zeros(8, bf16))
    out = np.ones(8, bf16)
    await device.queue.copy(out, buf)
    assert out.astype(np.float32).tolist() == [0.0] * 8
    with pytest.raises(am.InvalidArgumentError, match="not C-contiguous"):
        await buf.view(0, 8).write(np.zeros(8, bf16)[::2])


# -- buffers in ---------------------------------------------------------------------------


async def test_from_dlpack_wraps_a_numpy_array(anyio_backend: object) -> None:
    async with am.open_device("cpu") as device:
        await _wraps_numpy(device, await _cpu_kernels(device))


async def test_host_memory_goes_to_cpu_once_it_opens_whatever_was_picked_before(
    anyio_backend: object,
) -> None:
    """Host memory is the open ``cpu``'s, also after a lookup found only ``cpu:1``."""
    async with am.open_device("cpu:1") as second:
        assert am.from_dlpack(np.zeros(4)).device is second
        async with am.open_device("cpu") as first:
            assert am.from_dlpack(np.zeros(4)).device is first
            assert am.from_dlpack(np.zeros(4)).device is first
        assert am.from_dlpack(np.zeros(4)).device is second


async def _wraps_numpy(device: am.Device, kernels: dict[str, am.Program]) -> None:
    array = np.arange(32, dtype=np.int32)
    buf = am.from_dlpack(array)
    assert buf.device is device and buf.nbytes == 128
    await device.queue.launch(kernels["fill"], buf.view(64), vals=(4, 16))  # a launch
    assert array[:16].tolist() == list(range(16)) and array[16:].tolist() == [4] * 16
    out = await device.alloc(128)
    await am.copy(out, buf)  # a copy
    assert (await out.read(np.int32)).tolist() == array.tolist()
    await am.copy(buf, np.full(32, -2, np.int32))
    assert array.tolist() == [-2] * 32
    assert (await buf.map(np.int32)).ctypes.data == array.ctypes.data
    # The buffer keeps the array alive.
    del array
    gc.collect()
    assert (await buf.read(np.int32)).tolist() == [-2] * 32
    await buf.free()  # the memory is numpy's: nothing returns to the allocator
    assert device.memory_statistics().in_use == 512  # 128 B's size class


async def test_jax_shares_cpu_memory_both_ways(anyio_backend: object) -> None:
    """JAX (CPU): a JAX array over a buffer's memory and a buffer over a JAX array's,
    both without a copy (the same address), each seeing what the other side wrote."""
    jnp = pytest.importorskip("jax.numpy", reason="needs JAX (the test extra installs it)")
    async with am.open_device("cpu") as device:
        kernels = await _cpu_kernels(device)
        buf = await device.alloc(64)
        await buf.write(np.arange(16, dtype=np.float32))
        grid = jnp.from_dlpack(buf.typed(np.float32, (4, 4)))
        assert grid.shape == (4, 4) and grid.dtype == jnp.float32
        assert grid.unsafe_buffer_pointer() == np.from_dlpack(buf).ctypes.data  # no copy
        assert np.asarray(grid).ravel().tolist() == list(range(16))
        await device.queue.launch(kernels["fill"], buf, vals=(7, 16))  # the device writes
        assert np.asarray(grid).view(np.int32).ravel().tolist() == [7] * 16  # JAX reads

        array = jnp.arange(32, dtype=jnp.int32)
        wrapped = am.from_dlpack(array)
        assert wrapped.device is device and wrapped.nbytes == 128
        assert (await wrapped.map(np.int32)).ctypes.data == array.unsafe_buffer_pointer()
        out = await device.alloc(128)
        await am.copy(out, wrapped)  # the device reads what JAX wrote
        assert (await out.read(np.int32)).tolist() == list(range(32))


async def test_from_dlpack_round_trip_through_a_buffer(anyio_backend: object) -> None:
    async with am.open_device("cpu") as dev:
        buf = await dev.alloc(40)
        again = am.from_dlpack(buf.typed(np.float64))
        await again.write(np.linspace(0, 1, 5))
        assert (await buf.read(np.float64)).tolist() == np.linspace(0, 1, 5).tolist()
        assert again.device is dev


async def test_a_round_trip_alias_is_ordered_with_its_buffer(anyio_backend: object) -> None:
    """Memory of a buffer that comes back through DLPack (directly, or through numpy)
    shares the buffer's record of uses: a copy of one orders itself after a launch on
    another queue that wrote the other. Checked: without the shared record, the reads
    ran before the writes."""
    async with am.open_device("cpu") as dev:
        kernels = {name: await dev.compile(KERNELS, name) for name in ("fill", "sleep_ms")}
        buf = await dev.alloc(64)
        await dev.queue.launch(kernels["fill"], buf, vals=(1, 16))
        for alias in (am.from_dlpack(buf.typed(np.int32)), am.from_dlpack(np.from_dlpack(buf))):
            q = dev.new_queue()
            q.launch(kernels["sleep_ms"], vals=(30,))
            q.launch(kernels["fill"], alias, vals=(2, 16))  # a write of the alias ...
            assert (await buf.read(np.int32)).tolist() == [2] * 16  # ... read after
            q.launch(kernels["sleep_ms"], vals=(30,))
            q.launch(kernels["fill"], buf, vals=(3, 16))  # and the other way round
            assert (await alias.read(np.int32)).tolist() == [3] * 16
            await dev.queue.launch(kernels["fill"], buf, vals=(1, 16))


async def test_from_dlpack_of_a_buffer_in_use_is_ordered_after_it(anyio_backend: object) -> None:
    """am.from_dlpack of one of asyncmetal's own host buffers (or a typed view of it)
    while a command using it is held: where a host consumer is refused (BufferError),
    asyncmetal takes it, as the buffer it makes shares the record of uses -- also of a
    buffer over a numpy array, which lent nothing out -- so a copy of it on another
    queue runs after that command, and a command using it holds the original's later
    ones. Checked: before, from_dlpack raised BufferError ("in flight")."""
    async with am.open_device("cpu") as dev:
        fill = await dev.compile(KERNELS, "fill")
        for buf in (await dev.alloc(64), am.from_dlpack(np.zeros(16, np.int32))):
            for source in (buf, buf.typed(np.int32, (4, 4))):
                await dev.queue.launch(fill, buf, vals=(1, 16))
                gate = dev.timeline()
                held = dev.new_queue()
                held.wait(gate, 1)
                held.launch(fill, buf, vals=(2, 16))
                with pytest.raises(BufferError, match="in flight"):
                    np.from_dlpack(source)
                back = am.from_dlpack(source)
                assert back.busy()  # the held command is on its record too
                out = await dev.alloc(64)
                copied = dev.new_queue().copy(out, back)
                gate.signal(1)
                await copied
                assert (await out.read(np.int32)).tolist() == [2] * 16
                gate = dev.timeline()
                held.wait(gate, 2)
                held.launch(fill, back, vals=(3, 16))
                assert buf.busy()  # and the other way round
                gate.signal(2)
                assert (await buf.read(np.int32)).tolist() == [3] * 16


async def test_what_from_dlpack_refuses(anyio_backend: object) -> None:
    with pytest.raises(am.ArgumentTypeError, match="__dlpack__"):
        am.from_dlpack([1, 2, 3])
    for device in am.open_devices():
        assert device.name not in ("cpu", "cpu:0")
    with pytest.raises(am.InvalidArgumentError, match="open it first"):
        am.from_dlpack(np.zeros(4))
    async with am.open_device("cpu") as dev:
        with pytest.raises(am.InvalidArgumentError, match="C-contiguous"):
            am.from_dlpack(np.zeros((4, 4))[:, 1])
        with pytest.raises(am.InvalidArgumentError, match="empty"):
            am.from_dlpack(np.zeros(0))
        for refused in (np.zeros(4, ">i4"), np.zeros(4, "i4,f4")):  # numpy's own refusal
            with pytest.raises(am.ExchangeError, match="ndarray refused to export"):
                am.from_dlpack(refused)
        other = await am.open_device("cpu:1")
        try:
            assert am.from_dlpack(np.zeros(4), device=other).device is other
        finally:
            await other.close()
        assert am.from_dlpack(np.zeros(4), device=dev).device is dev


class _Claims:
    """A producer whose ``__dlpack_device__`` returns ``where`` (or that has none)."""

    def __init__(self, where: object) -> None:
        self.where = where
        self.asked = 0

    def __dlpack__(self, **kwargs: object) -> object:
        self.asked += 1
        return np.zeros(4).__dlpack__()

    def __getattr__(self, name: str) -> Any:
        if name == "__dlpack_device__" and self.where != "none":
            return lambda: self.where
        raise AttributeError(name)


async def test_a_dlpack_device_that_is_no_pair_of_ints_is_refused(anyio_backend: object) -> None:
    """What ``__dlpack_device__`` returns is checked before the capsule is asked for,
    and refused as every asyncmetal error is (ArgumentTypeError). Checked: without it,
    a plain TypeError, ValueError, IndexError or AttributeError came out of int() and
    indexing, and (1.5, 0) was taken as (1, 0)."""
    async with am.open_device("cpu"):
        for where in (None, "ab", (1,), (1, 0, 0), (1.5, 0), (1, None), (True, 0), "none"):
            producer = _Claims(where)
            with pytest.raises(am.ArgumentTypeError, match="__dlpack_device__") as refused:
                am.from_dlpack(producer)
            assert isinstance(refused.value, am.AsyncMetalError)
            assert producer.asked == 0
        # What producers return: ints, IntEnums (PyTorch's, JAX's), numpy ints, a list.
        for where in ((1, 0), [1, 0], (np.int64(1), np.int32(0)), (_dlpack_type(1), 0)):
            assert am.from_dlpack(_Claims(where)).nbytes == 32


class _ProducerError(Exception):
    """A producer's own exception type (JAX's JaxRuntimeError, say)."""


class _Failing:
    """A producer whose ``fails`` call raises ``error``; its other calls answer as a
    host array's do (``interface`` only: it has no ``__dlpack__``)."""

    def __init__(self, fails: str, error: BaseException, interface: bool = False) -> None:
        self.fails = fails
        self.error = error
        self.interface = interface
        self.array = np.zeros(4)

    def __getattr__(self, name: str) -> Any:
        if name == self.fails == "__cuda_array_interface__":  # (a property)
            raise self.error
        if name == self.fails:
            return self._raise
        if name == "__dlpack__" and not self.interface:
            return self.array.__dlpack__
        if name == "__dlpack_device__" and not self.interface:
            return self.array.__dlpack_device__
        raise AttributeError(name)

    def _raise(self, **kwargs: object) -> None:
        raise self.error


async def test_a_producers_own_error_is_an_exchange_error(anyio_backend: object) -> None:
    """A producer whose ``__dlpack__`` (or ``__dlpack_device__``, or, without those,
    ``__cuda_array_interface__``) raises an exception of its own -- JAX's
    JaxRuntimeError for int4, which DLPack has no type for -- gives ExchangeError,
    naming the call and the producer's error, which it is chained from. An interrupt
    or a cancellation passes as it is. Checked: fails without the fix (JAX's own
    JaxRuntimeError came out, and the fake producer's _ProducerError)."""
    async with am.open_device("cpu"):
        for fails in ("__dlpack__", "__dlpack_device__", "__cuda_array_interface__"):
            error = _ProducerError("no such type")
            producer = _Failing(fails, error, interface=fails == "__cuda_array_interface__")
            match = f"_Failing.{fails} failed with _ProducerError: no such type"
            with pytest.raises(am.ExchangeError, match=match) as caught:
                am.from_dlpack(producer)
            assert caught.value.__cause__ is error
            # (BaseExceptions, as trio's Cancelled is too)
            for interrupt in (KeyboardInterrupt(), asyncio.CancelledError()):
                producer = _Failing(fails, interrupt, fails == "__cuda_array_interface__")
                with pytest.raises(type(interrupt)) as interrupted:
                    am.from_dlpack(producer)
                assert interrupted.value is interrupt
        jnp = pytest.importorskip("jax.numpy", reason="needs JAX (the test extra installs it)")
        with pytest.raises(am.ExchangeError, match=r"__dlpack__ failed with .*S4") as caught:
            am.from_dlpack(jnp.zeros(8, jnp.int4))
        assert type(caught.value.__cause__).__name__ == "JaxRuntimeError"


def _dlpack_type(value: int) -> Any:
    import enum

    return enum.IntEnum("DLDeviceType", {"kDLCPU": 1})(value)


async def test_from_dlpack_onto_the_npy_device_is_refused(anyio_backend: object) -> None:
    """The npy device holds from_numpy's read-only sources; from_dlpack never picks it,
    and refuses it given. Checked: given, it made an npy buffer over a cpu buffer's
    memory that shared none of that buffer's record of uses -- a copy from it ran
    before a cpu copy into the buffer submitted first (it read 0s, not 5s)."""
    source = await am.from_numpy(np.zeros(4, np.int32))
    async with am.open_device("cpu") as device:
        buf = await device.alloc(16)
        for array in (np.zeros(4, np.int32), buf):
            with pytest.raises(am.InvalidArgumentError, match="npy buffers are read-only"):
                am.from_dlpack(array, device=source.device)
        # What the buffer's own device does: ordered as the buffer.
        alias = am.from_dlpack(buf)
        gate = device.timeline()
        queue = device.new_queue()
        queue.wait(gate, 1)
        write = queue.copy(buf, np.full(4, 5, np.int32))
        out = np.zeros(4, np.int32)
        read = device.queue.copy(out, alias)
        gate.signal(1)
        await write
        await read
        assert out.tolist() == [5] * 4


async def test_from_dlpack_of_a_read_only_source_says_it_is_one_already(
    anyio_backend: object,
) -> None:
    """``am.from_dlpack`` of an npy buffer (``from_numpy``'s read-only source) or a
    typed view of it is refused as read-only memory is, saying it is a source already --
    not to make one with ``from_numpy``, which made it. Checked: fails without the fix
    (the message told to call asyncmetal.from_numpy)."""
    source = await am.from_numpy(np.arange(4, dtype=np.int32))
    async with am.open_device("cpu"):
        for given in (source, source.typed(np.int32, (2, 2))):
            with pytest.raises(am.ExchangeError, match="read-only source already") as refused:
                am.from_dlpack(given)
            assert "from_numpy(array)" not in str(refused.value)


async def test_from_dlpack_refuses_read_only_memory_and_newer_versions(
    anyio_backend: object,
) -> None:
    """A versioned capsule flagged read-only is refused (kernels and copies write
    buffers: one over an immutable ``bytes`` once changed it), and so is one of a major
    version asyncmetal cannot read; the producer's deleter still runs. Checked: both
    were wrapped before."""
    from asyncmetal._dlpack import CAPSULE_NAME_VERSIONED, DLManagedTensorVersioned, capsule_pointer

    class Newer:
        """A producer whose capsules claim DLPack 2.0."""

        def __init__(self, array: np.ndarray) -> None:
            self.array = array

        def __dlpack_device__(self) -> tuple[int, int]:
            return self.array.__dlpack_device__()  # type: ignore[no-any-return]

        def __dlpack__(self, **kwargs: object) -> object:
            capsule = self.array.__dlpack__(max_version=(1, 0))
            address = capsule_pointer(capsule, CAPSULE_NAME_VERSIONED)
            DLManagedTensorVersioned.from_address(address).version.major = 2
            return capsule

    async with am.open_device("cpu"):
        raw = bytes(16)
        with pytest.raises(BufferError, match="read-only") as refused:
            am.from_dlpack(np.frombuffer(raw, np.int32))
        assert isinstance(refused.value, am.AsyncMetalError)  # as every error (ExchangeError)
        assert raw == bytes(16)
        base = np.zeros(4, np.int32)
        view = base.view()
        view.flags.writeable = False
        with pytest.raises(BufferError, match="read-only"):
            am.from_dlpack(view)
        with pytest.raises(BufferError, match=r"DLPack 2\.0"):
            am.from_dlpack(Newer(base))
        assert am.from_dlpack(base).nbytes == 16  # writable: wrapped


async def test_host_exports_take_no_stream_and_read_only_ones_are_versioned(
    anyio_backend: object,
) -> None:
    """Host memory has no stream to order on: a stream other than None is refused, as
    the protocol says. A read-only buffer (npy) exports only as a versioned capsule,
    whose flag says so; the legacy capsule cannot, so it is refused, as numpy does.
    Checked: both were accepted before (the legacy capsule writable)."""
    async with am.open_device("cpu") as dev:
        buf = await dev.alloc(64)
        with pytest.raises(BufferError, match="stream must be None"):
            buf.__dlpack__(stream=5)
        assert buf.__dlpack__(stream=None) is not None
    source = await am.from_numpy(np.arange(4, dtype=np.int32))
    with pytest.raises(BufferError, match="read-only"):
        source.__dlpack__()
    shared = np.from_dlpack(source.typed(np.int32))  # numpy asks for a versioned one
    assert shared.tolist() == [0, 1, 2, 3]
    assert not shared.flags.writeable


async def test_from_dlpack_refuses_metal_memory(anyio_backend: object) -> None:
    """A Metal tensor is an MTLBuffer and an offset, not an address: refused, before
    any device is looked for (with a metal device open it was wrapped as host memory,
    its handle read as an address). Checked: fails without the refusal."""

    class MetalTensor:
        def __dlpack_device__(self) -> tuple[int, int]:
            return (8, 0)  # kDLMetal

        def __dlpack__(self, **kwargs: object) -> object:
            return np.zeros(4, np.int32).__dlpack__()

    async with am.open_device("cpu"):
        with pytest.raises(BufferError, match="Metal memory"):
            am.from_dlpack(MetalTensor())


def test_a_torch_tensors_stream_is_the_current_one_unless_per_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``am.from_dlpack`` waits itself for a PyTorch tensor's current stream; for the
    per-thread default stream (2), which a queue cannot wait for, it lets PyTorch order
    it (the protocol's way). A stand-in for torch: only what the lookup uses."""
    import types

    from asyncmetal import _interop

    class Tensor:
        device = "cuda:1"

        def get_device(self) -> int:
            return 1

    current = types.SimpleNamespace(cuda_stream=0x5000)
    torch = types.SimpleNamespace(
        Tensor=Tensor,
        _C=types.SimpleNamespace(),  # a PyTorch without the raw lookup
        cuda=types.SimpleNamespace(current_stream={"cuda:1": current}.__getitem__),
    )
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert _interop._torch_stream(Tensor()) == 0x5000
    assert _interop._torch_stream(object()) is None  # not a tensor
    current.cuda_stream = 2
    assert _interop._torch_stream(Tensor()) is None
    # With it: the raw handle of the tensor's device's current stream, in one call.
    raw = {1: 0x6000}
    torch._C = types.SimpleNamespace(_cuda_getCurrentRawStream=raw.__getitem__)
    assert _interop._torch_stream(Tensor()) == 0x6000
    raw[1] = 2
    assert _interop._torch_stream(Tensor()) is None


async def test_a_host_array_of_a_buffer_is_ordered_as_the_buffer_in_copies(
    anyio_backend: object,
) -> None:
    """A numpy array over a buffer's memory (``np.from_dlpack``), used as a copy's host
    operand on another queue while a command writing the buffer is still queued: the
    copy is ordered as if the buffer itself were its operand -- it reads what that
    command wrote, and writes only after it. Checked: before, the copy read the bytes
    from before the write, and a copy into it was overwritten by the queued write."""
    async with am.open_device("cpu") as dev:
        fill = await dev.compile(KERNELS, "fill")
        sleep = await dev.compile(KERNELS, "sleep_ms")
        buf, out, src = await dev.alloc(4), await dev.alloc(4), await dev.alloc(4)
        await dev.queue.launch(fill, buf, vals=(1, 1))
        await dev.queue.launch(fill, src, vals=(9, 1))
        alias = np.from_dlpack(buf.typed(np.int32))
        writer, copier = dev.new_queue(), dev.new_queue()
        writer.launch(sleep, vals=(100,))
        writer.launch(fill, buf, vals=(7, 1))
        await copier.copy(out, alias)  # reads the 7
        assert (await out.read(np.int32)).tolist() == [7]
        writer.launch(sleep, vals=(100,))
        writer.launch(fill, buf, vals=(8, 1))
        await copier.copy(alias, src)  # lands after the 8
        await writer.synchronize()
        assert (await buf.read(np.int32)).tolist() == [9]
        assert alias.tolist() == [9]


async def test_memory_of_a_buffer_over_another_librarys_array_comes_back_ordered(
    anyio_backend: object,
) -> None:
    """A buffer over a numpy array (``am.from_dlpack``) whose memory goes out through
    numpy (``np.from_dlpack`` or ``map()``) and comes back -- as a buffer, a part of it,
    or a copy's host operand -- shares the buffer's record of uses, as an allocated
    buffer's memory does: a copy of it on another queue comes after a command still
    held that writes the buffer, and the buffer's later commands after a command on
    what came back. Checked: fails without the fix (each copy read the bytes from
    before the held write)."""
    async with am.open_device("cpu") as dev:
        fill = await dev.compile(KERNELS, "fill")
        buf = am.from_dlpack(np.zeros(16, np.int32))
        await dev.queue.launch(fill, buf, vals=(1, 16))
        lent = np.from_dlpack(buf.typed(np.int32))
        mapped = await buf.map(np.int32)
        held, copier = dev.new_queue(), dev.new_queue()
        comes_back = (
            lambda: am.from_dlpack(lent),
            lambda: am.from_dlpack(lent[4:]),
            lambda: lent,
            lambda: mapped[:8],
        )
        for step, operand in enumerate(comes_back, 1):
            source = operand()
            out = await _copied_behind_a_held_fill(held, copier, fill, buf, step + 1, source)
            assert set((await out.read(np.int32)).tolist()) == {step + 1}, step
        alias = am.from_dlpack(lent)  # and the other way round
        out = await _copied_behind_a_held_fill(held, copier, fill, alias, 9, buf)
        assert (await out.read(np.int32)).tolist() == [9] * 16


async def test_the_array_under_a_buffer_over_it_is_ordered_as_that_buffer(
    anyio_backend: object,
) -> None:
    """The numpy array that a buffer wraps (``am.from_dlpack(array)``), used itself --
    never lent on -- as a copy's source or destination, by ``from_numpy`` or wrapped
    again, on the same device or on another of its kind: each comes after a command
    still held that writes the buffer, as the buffer itself would. Checked: fails
    without the fix (each copy read the bytes from before the held write)."""
    async with am.open_device("cpu") as dev, am.open_device("cpu:1") as other:
        fill = await dev.compile(KERNELS, "fill")
        held, copier = dev.new_queue(), dev.new_queue()
        array = np.zeros(16, np.int32)
        buf = am.from_dlpack(array)
        comes_back = (
            lambda: array,
            lambda: array[4:12],
            lambda: am.from_dlpack(array, device=other),
        )
        for step, operand in enumerate(comes_back, 2):
            source = operand()
            out = await _copied_behind_a_held_fill(held, copier, fill, buf, step, source)
            assert set((await out.read(np.int32)).tolist()) == {step}, step
        three = await dev.alloc(64)
        await three.write(np.full(16, 3, np.int32))
        gate = dev.timeline()
        held.wait(gate, 1)
        held.launch(fill, buf, vals=(7, 16))
        copied = copier.copy(array, three)  # lands after the 7s
        made = am.from_numpy(array)
        await anyio.sleep(0.05)
        assert not copied.done()
        gate.signal(1)
        with anyio.fail_after(10):
            await copied
            source = await made
        assert array.tolist() == [3] * 16
        assert (await source.read(np.int32)).tolist() == [3] * 16


async def test_host_copies_look_nothing_up_once_every_buffer_over_an_array_went(
    anyio_backend: object,
) -> None:
    """Once the buffers over another library's arrays are gone (and their commands ran),
    the device holds no foreign memory: a host copy no longer looks its operands up
    among it (a look-up that cost every host copy, on any device, a third more). Made
    over an array again, it is looked up again. Checked: fails without the change (the
    device stayed among the holders until it closed)."""
    from asyncmetal import _allocator

    async with am.open_device("cpu") as dev:
        array = np.zeros(16, np.int32)
        buf = am.from_dlpack(array)
        await dev.queue.copy(np.zeros(16, np.int32), buf)
        assert id(dev._allocator) in _allocator.foreign_holders
        del buf
        gc.collect()
        await dev.queue.copy(await dev.alloc(64), array)  # finds none alive
        assert id(dev._allocator) not in _allocator.foreign_holders
        buf = am.from_dlpack(array)
        assert id(dev._allocator) in _allocator.foreign_holders
        fill = await dev.compile(KERNELS, "fill")
        held, copier = dev.new_queue(), dev.new_queue()
        out = await _copied_behind_a_held_fill(held, copier, fill, buf, 5, array)
        assert set((await out.read(np.int32)).tolist()) == {5}


async def _copied_behind_a_held_fill(
    held: am.Queue, copier: am.Queue, fill: am.Program, target: am.Buffer, value: int, source: Any
) -> am.Buffer:
    """``held`` fills ``target`` (16 int32s) with ``value`` behind a device wait, and
    ``copier`` copies ``source`` into a new buffer meanwhile: the copy must not finish
    before the wait is released (it comes after the fill, on the device). The copy."""
    dev = held.device
    gate = dev.timeline()
    held.wait(gate, 1)
    held.launch(fill, target, vals=(value, 16))
    out = await dev.alloc(source.nbytes)
    copied = copier.copy(out, source)
    await anyio.sleep(0.05)
    assert not copied.done()  # after the held write, on the device
    gate.signal(1)
    with anyio.fail_after(10):
        await copied
    return out


async def test_a_read_only_source_over_a_buffers_memory_is_ordered_as_the_buffer(
    anyio_backend: object,
) -> None:
    """``from_numpy`` of an array over a buffer's memory (``np.from_dlpack``, ``map()``):
    a copy from that source on a queue of the buffer's device is ordered as one from
    the array itself, and as ``asyncmetal.copy`` of it is -- after a command still
    held that writes the buffer, and the buffer's later writes after it. Checked: fails
    without the fix (the queue's copy read the bytes from before the held write)."""
    async with am.open_device("cpu") as dev:
        fill = await dev.compile(KERNELS, "fill")
        buf = await dev.alloc(64)
        await dev.queue.launch(fill, buf, vals=(1, 16))
        for array in (np.from_dlpack(buf.typed(np.int32)), await buf.map(np.int32)):
            source = await am.from_numpy(array)
            held, copier = dev.new_queue(), dev.new_queue()
            out = await _copied_behind_a_held_fill(held, copier, fill, buf, 2, source)
            assert (await out.read(np.int32)).tolist() == [2] * 16
            gate = dev.timeline()
            copier.wait(gate, 1)
            read = copier.copy(out, source)  # held: the buffer's next write after it
            write = held.copy(buf, np.full(16, 3, np.int32))
            await anyio.sleep(0.05)
            assert not write.done()
            gate.signal(1)
            with anyio.fail_after(10):
                await read
                await write
            assert (await out.read(np.int32)).tolist() == [2] * 16
            assert (await buf.read(np.int32)).tolist() == [3] * 16
            await dev.queue.launch(fill, buf, vals=(1, 16))


async def test_a_host_array_of_another_devices_buffer_is_a_plain_host_operand(
    anyio_backend: object,
) -> None:
    """An array over memory ``cpu:1`` lent out, as a host operand of copies on ``cpu``'s
    queue, both ways: a host copy on that queue (ordered as with the buffer: see the
    next test). Checked: a copy into it was refused ("dst is on cpu:1")."""
    async with am.open_device("cpu") as dev, am.open_device("cpu:1") as lender:
        theirs, mine = await lender.alloc(4), await dev.alloc(4)
        await theirs.write(np.array([3], np.int32))
        await mine.write(np.array([4], np.int32))
        alias = np.from_dlpack(theirs.typed(np.int32))
        out = await dev.alloc(4)
        await dev.queue.copy(out, alias)
        assert (await out.read(np.int32)).tolist() == [3]
        await dev.queue.copy(alias, mine)
        assert alias.tolist() == [4]


async def test_a_host_array_of_another_devices_buffer_is_ordered_as_that_buffer(
    anyio_backend: object,
) -> None:
    """A copy on ``cpu``'s queue into or out of an array over memory ``cpu:1`` lent out
    comes after ``cpu:1``'s earlier commands using that buffer, and its later ones after
    the copy, as with ``cpu``'s own lent memory (and with the buffer itself). Checked:
    without it, the copy ran at once -- before the lender's pending write, which then
    overwrote it, and a read got the bytes from before that write."""
    async with am.open_device("cpu") as dev, am.open_device("cpu:1") as lender:
        theirs, mine = await lender.alloc(16), await dev.alloc(16)
        await theirs.write(np.zeros(4, np.int32))
        await mine.write(np.full(4, 2, np.int32))
        alias = np.from_dlpack(theirs.typed(np.int32))
        gate = lender.timeline()
        lender.queue.wait(gate, 1)
        lender.queue.copy(theirs, np.full(4, 1, np.int32))  # pending
        into = dev.queue.copy(alias, mine)
        await anyio.sleep(0.05)
        assert not into.done()  # after the pending write, on the device
        check = await lender.alloc(16)
        after = lender.queue.copy(check, theirs)  # (on the lender: after the copy)
        gate.signal(1)
        await into
        await after
        assert alias.tolist() == [2] * 4
        assert (await check.read(np.int32)).tolist() == [2] * 4
        lender.queue.wait(gate, 2)
        lender.queue.copy(theirs, np.full(4, 3, np.int32))  # pending
        out = await dev.alloc(16)
        read = dev.queue.copy(out, alias)
        await anyio.sleep(0.05)
        assert not read.done()
        gate.signal(2)
        await read
        assert (await out.read(np.int32)).tolist() == [3] * 4


async def test_from_dlpack_onto_another_device_of_the_lenders_kind_is_ordered_with_it(
    anyio_backend: object,
) -> None:
    """``from_dlpack(array, device=cpu)`` of memory ``cpu:1`` lent out shares the lending
    buffer's record of uses, as the same coming back to ``cpu:1`` does. Checked: without
    it, a read of it ran at once, before ``cpu:1``'s pending write of that memory."""
    async with am.open_device("cpu") as dev, am.open_device("cpu:1") as lender:
        theirs = await lender.alloc(16)
        await theirs.write(np.zeros(4, np.int32))
        alias = am.from_dlpack(np.from_dlpack(theirs.typed(np.int32)), device=dev)
        assert alias.device is dev
        gate = lender.timeline()
        lender.queue.wait(gate, 1)
        lender.queue.copy(theirs, np.full(4, 1, np.int32))  # pending
        read: list[np.ndarray] = []
        async with anyio.create_task_group() as tg:

            async def reader() -> None:
                read.append(await alias.read(np.int32))

            tg.start_soon(reader)
            await anyio.sleep(0.05)
            assert not read  # after the pending write, on the device
            gate.signal(1)
        assert read[0].tolist() == [1] * 4


def _park_close_when_sealed(lender: am.Device) -> tuple[threading.Event, threading.Event]:
    """Make ``lender``'s close stop once it sealed the device (no command can be
    submitted to it), before its queues and memory go: ``(parked, go)``, set as it stops
    there, and to let it go on."""
    parked, go = threading.Event(), threading.Event()
    real = lender._close_native

    def close_native(*args: Any) -> None:
        parked.set()
        go.wait(30)
        real(*args)

    lender._close_native = close_native  # type: ignore[method-assign]
    return parked, go


@pytest.mark.parametrize("export", ["dlpack", "map"])
@pytest.mark.parametrize("pending", [False, True], ids=["idle", "pending"])
async def test_a_copy_of_lent_memory_as_its_lender_closes_names_the_lender(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, export: str, pending: bool
) -> None:
    """A copy on ``cpu`` of host memory that a buffer of ``cpu:1`` lent out (a DLPack
    export, a map() view), submitted as ``cpu:1`` closes on another thread -- open as
    the copy looked up the lender, sealed by the time it orders itself or submits --
    is refused naming its operand, what lent the memory and the device that closed.
    Checked: it said "buffer belongs to the closed device cpu:1" (a buffer the caller
    never passed) or, with a command of ``cpu:1`` on that memory pending, "timeline
    belongs to the closed device cpu:1"."""
    from asyncmetal import _interop

    async with am.open_device("cpu") as dev:
        lender = await am.open_device("cpu:1")
        theirs = await lender.alloc(16)
        await theirs.write(np.arange(4, dtype=np.int32))
        if export == "map":
            host = await theirs.map(np.int32)
        else:
            host = np.from_dlpack(theirs.typed(np.int32))
        gate = dev.timeline()
        if pending:  # a command of the lender on that memory, waiting for the host
            lender.queue.wait(gate, 1)
            lender.queue.copy(theirs, np.full(4, 1, np.int32))
        parked, go = _park_close_when_sealed(lender)
        closing: list[threading.Thread] = []
        real_lent_memory = _interop.lent_memory

        def lent_memory(*args: Any) -> am.Buffer:  # the lender just found: it closes now
            closer = threading.Thread(target=anyio.run, args=(lender.close,))
            closer.start()
            closing.append(closer)
            assert parked.wait(30)
            return real_lent_memory(*args)

        monkeypatch.setattr(_interop, "lent_memory", lent_memory)
        mine = await dev.alloc(16)
        role = "src" if export == "dlpack" else "dst"
        operands = (mine, host) if role == "src" else (host, mine)
        try:
            with pytest.raises(am.ClosedResourceError) as info:
                dev.queue.copy(*operands)
        finally:
            go.set()
            gate.signal(1)
            for closer in closing:
                await anyio.to_thread.run_sync(closer.join)
        lent = (
            f"{role}, host memory that a buffer of cpu:1 lent out (a DLPack export or a "
            "map() view), "
        )
        why = (
            "is used by commands of cpu:1 that had not finished when cpu:1 closed"
            if pending
            else "belongs to the closed device cpu:1"
        )
        assert str(info.value).startswith(lent + why), str(info.value)
        assert lender.closed
        await dev.queue.copy(*operands)  # once the close is over: a plain host copy


async def test_a_copy_of_a_buffer_over_lent_memory_as_its_lender_closes_names_the_lender(
    anyio_backend: object,
) -> None:
    """``from_dlpack(array, device=cpu)`` of memory ``cpu:1`` lent out, used by a copy
    while ``cpu:1``, closing, has a command on that memory it never ran: refused naming
    the operand and ``cpu:1`` (checked: "timeline belongs to the closed device cpu:1",
    a timeline the caller never saw). Once that close is over the copy goes through."""
    async with am.open_device("cpu") as dev:
        lender = await am.open_device("cpu:1")
        theirs = await lender.alloc(16)
        alias = am.from_dlpack(np.from_dlpack(theirs.typed(np.int32)), device=dev)
        gate = dev.timeline()
        lender.queue.wait(gate, 1)
        never_ran = lender.queue.copy(theirs, np.full(4, 1, np.int32))
        parked, go = _park_close_when_sealed(lender)
        mine = await dev.alloc(16)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lender.close)
            try:
                await anyio.to_thread.run_sync(parked.wait, 30)
                with pytest.raises(am.ClosedResourceError) as info:
                    dev.queue.copy(mine, alias)
            finally:
                go.set()
        assert str(info.value).startswith(
            "src is used by commands of cpu:1 that had not finished when cpu:1 closed"
        ), str(info.value)
        with pytest.raises(am.ClosedResourceError, match="cpu:1 was closed while command"):
            await never_ran
        await dev.queue.copy(mine, alias)
        gate.signal(1)


# A write of 7s that a cpu device's queue, once it started it (its flag's second int
# set), runs only once the host lets it (the first, set through a map() view): its
# device's close waits for it meanwhile -- a discarding one too, as it has started.
_HELD_FILL = r"""
#include <time.h>
void held_fill(volatile int* flag, int* out, int value, int n) {
    struct timespec ts = { 0, 200000L };
    flag[1] = 1;
    while (!flag[0]) nanosleep(&ts, 0);
    for (int i = 0; i < n; i++) out[i] = value;
}
"""


async def _held_fill(device: am.Device, buf: am.Buffer) -> np.ndarray[Any, Any]:
    """Launch ``_HELD_FILL`` on ``buf`` (4 int32s); return its flag, once it started."""
    program = await device.compile(_HELD_FILL, "held_fill")
    flag = await device.alloc(8)
    await flag.write(np.zeros(2, np.int32))
    release: np.ndarray[Any, Any] = await flag.map(np.int32)
    device.queue.launch(program, flag, buf, vals=(7, 4))
    await _until(lambda: release[1])
    return release


async def _until(condition: Any) -> None:
    with anyio.fail_after(10):  # (a bound on a hang, not a timing)
        while not condition():
            await anyio.sleep(0.001)


@pytest.mark.parametrize("export", ["dlpack", "map", "from_dlpack"])
async def test_a_copy_of_lent_memory_while_its_lender_is_sealed_is_refused(
    anyio_backend: object, export: str
) -> None:
    """A copy on ``cpu`` of host memory that a buffer of ``cpu:1`` lent out (a DLPack
    export, a map() view, or a ``from_dlpack`` buffer on ``cpu`` over it) submitted while
    ``cpu:1`` is sealed -- its close under way (a discarding one: sealed at once), still
    waiting for a command that writes that memory -- is refused naming ``cpu:1``: that
    command cannot be waited for any more. Checked: a plain host copy, not ordered
    after the write."""
    async with am.open_device("cpu") as dev:
        lender = await am.open_device("cpu:1")
        theirs = await lender.alloc(16)
        await theirs.write(np.zeros(4, np.int32))
        if export == "map":
            host = await theirs.map(np.int32)
        else:
            host = np.from_dlpack(theirs.typed(np.int32))
        release = await _held_fill(lender, theirs)
        mine = await dev.alloc(16)
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(lender.close, discard=True))
            try:
                await _until(lambda: lender.closed)  # sealed, waiting for the write
                operand = am.from_dlpack(host) if export == "from_dlpack" else host
                with pytest.raises(am.ClosedResourceError) as info:
                    dev.queue.copy(mine, operand)
            finally:
                release[0] = 1
        what = (
            "src"
            if export == "from_dlpack"
            else "src, host memory that a buffer of cpu:1 lent out (a DLPack export or a "
            "map() view),"
        )
        assert str(info.value).startswith(
            f"{what} is used by commands of cpu:1 that had not finished when cpu:1 closed"
        ), str(info.value)
        await dev.queue.copy(mine, operand)  # once the close is over: a plain host copy
        assert (await mine.read(np.int32)).tolist() == [7] * 4


@pytest.mark.parametrize("operand", ["array", "from_numpy", "from_dlpack"])
async def test_a_copy_of_an_array_a_sealed_device_wraps_is_refused(
    anyio_backend: object, operand: str
) -> None:
    """A copy on ``cpu`` of a numpy array that a buffer of ``cpu:1`` wraps -- the array
    itself, ``from_numpy``'s source over it, or a buffer of ``cpu`` made over it then --
    submitted while ``cpu:1`` is sealed, still running a command that writes the array
    through that buffer, is refused naming ``cpu:1``, as a copy of memory it lent out
    is; once the close is over it is a plain copy. Checked: fails without the fix (a
    buffer of ``cpu`` made then had a record of its own: the copy read the array as
    that command wrote it)."""
    async with am.open_device("cpu") as dev:
        lender = await am.open_device("cpu:1")
        array = np.zeros(4, np.int32)
        wrapped = am.from_dlpack(array, device=lender)
        release = await _held_fill(lender, wrapped)
        mine = await dev.alloc(16)
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(lender.close, discard=True))
            try:
                await _until(lambda: lender.closed)  # sealed, waiting for the write
                made = {"array": lambda: array, "from_dlpack": lambda: am.from_dlpack(array)}
                source = made[operand]() if operand in made else await am.from_numpy(array)
                with pytest.raises(am.ClosedResourceError) as info:
                    dev.queue.copy(mine, source)
            finally:
                release[0] = 1
        assert str(info.value).startswith(
            "src is used by commands of cpu:1 that had not finished when cpu:1 closed"
        ), str(info.value)
        await dev.queue.copy(mine, source)
        assert (await mine.read(np.int32)).tolist() == [7] * 4


async def test_a_copy_of_another_kind_into_an_array_a_sealed_device_wraps_says_so(
    anyio_backend: object,
) -> None:
    """An npy queue's copy into a numpy array that a buffer of ``cpu:1`` wraps, while
    ``cpu:1`` is sealed and still running a command that writes it, is refused naming
    the array as memory that buffer wraps -- not as memory it lent out, which the
    caller never did. Checked: fails without the fix (the message said "lent out (a
    DLPack export or a map() view)")."""
    lender = await am.open_device("cpu:1")
    array = np.zeros(4, np.int32)
    release = await _held_fill(lender, am.from_dlpack(array, device=lender))
    source = await am.from_numpy(np.ones(4, np.int32))
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(lender.close, discard=True))
        try:
            await _until(lambda: lender.closed)  # sealed, waiting for the write
            with pytest.raises(am.ClosedResourceError) as info:
                source.device.queue.copy(array, source)
        finally:
            release[0] = 1
    assert str(info.value).startswith(
        "dst, host memory that a buffer of cpu:1 wraps (asyncmetal.from_dlpack), is used "
        "by commands of cpu:1 that had not finished when cpu:1 closed"
    ), str(info.value)


async def test_from_dlpack_of_memory_a_closing_device_lent_is_on_another_open_device(
    anyio_backend: object,
) -> None:
    """``from_dlpack(array)`` of memory a buffer of ``cpu:1`` lent out, as ``cpu:1``'s
    close waits for its commands (not sealed yet), is a buffer of ``cpu`` -- not of the
    closing ``cpu:1``, whose queues refuse it once sealed -- and ordered after
    ``cpu:1``'s write of that memory all the same. With no other device of the kind
    open, it is refused naming ``cpu:1``. Checked: a buffer of ``cpu:1``."""
    async with am.open_device("cpu") as dev:
        lender = await am.open_device("cpu:1")
        theirs = await lender.alloc(16)
        await theirs.write(np.zeros(4, np.int32))
        host = np.from_dlpack(theirs.typed(np.int32))
        release = await _held_fill(lender, theirs)
        mine = await dev.alloc(16)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lender.close)
            try:
                await _until(lambda: lender._closing is not None)
                assert not lender.closed  # (its close waits for the write before sealing)
                alias = am.from_dlpack(host)
                assert alias.device is dev
                done = dev.queue.copy(mine, alias)  # after the write, on the device
            finally:
                release[0] = 1
        await done
        assert (await mine.read(np.int32)).tolist() == [7] * 4
    lender = await am.open_device("cpu:1")
    theirs = await lender.alloc(16)
    host = np.from_dlpack(theirs.typed(np.int32))
    release = await _held_fill(lender, theirs)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lender.close)
        try:
            await _until(lambda: lender._closing is not None)
            with pytest.raises(am.ClosedResourceError, match=r"closing \(cpu:1\)"):
                am.from_dlpack(host)
        finally:
            release[0] = 1


async def _held_write(dev: am.Device, fill: am.Program, target: am.Buffer, value: int) -> Any:
    """A queue of ``dev`` fills ``target`` (int32s) with ``value`` behind a device wait
    nobody has signalled: the wait's timeline (``signal(1)`` lets the write run)."""
    gate = dev.timeline()
    held = dev.new_queue()
    held.wait(gate, 1)
    held.launch(fill, target, vals=(value, target.nbytes // 4))
    return gate


async def _not_before(gate: Any, copied: am.Completion) -> None:
    """``copied`` must not finish until ``gate`` lets the held write run (it comes after
    that write, on the device), then must."""
    await anyio.sleep(0.05)
    assert not copied.done()  # after the held write, on the device
    gate.signal(1)
    with anyio.fail_after(10):
        await copied


async def test_buffers_over_the_same_array_share_one_record_of_uses(
    anyio_backend: object,
) -> None:
    """Two buffers made by ``am.from_dlpack`` of the same numpy array (on one device, or
    on two of the cpu kind) are ordered as one buffer: while a command still held
    writes through one, the other is busy, its export to a host consumer is refused,
    and a copy of it on another queue comes after the write. Checked: fails without
    the fix (the second buffer had a record of its own: not busy, exported at once)."""
    async with am.open_device("cpu") as dev, am.open_device("cpu:1") as other:
        fills = {d: await d.compile(KERNELS, "fill") for d in (dev, other)}
        for _ in range(100):  # (buffers gone, over memory numpy hands out again)
            am.from_dlpack(np.zeros(16, np.int32))
        for where in (dev, other):
            array = np.zeros(16, np.int32)
            first = am.from_dlpack(array)
            second = am.from_dlpack(array, device=where)
            gate = await _held_write(dev, fills[dev], first, 2)
            assert second.busy()
            with pytest.raises(BufferError, match="in flight"):
                np.from_dlpack(second)
            out = await where.alloc(64)
            await _not_before(gate, where.new_queue().copy(out, second))
            assert (await out.read(np.int32)).tolist() == [2] * 16
            gate = await _held_write(where, fills[where], second, 3)
            out = await dev.alloc(64)
            await _not_before(gate, dev.new_queue().copy(out, first))  # the other way
            assert (await out.read(np.int32)).tolist() == [3] * 16


@pytest.mark.parametrize("held", ["launch", "copy", "host operand"])
async def test_a_buffer_dropped_while_its_command_runs_leaves_the_record_to_it(
    anyio_backend: object, held: str
) -> None:
    """A command held on ``cpu:1`` that writes a numpy array -- a launch or a copy on a
    buffer over it, or a copy into the array itself as a host operand, wrapped by a
    buffer of ``cpu`` -- and the only buffer over the array dropped meanwhile: a buffer
    made over the array again, on ``cpu``, is ordered after that command (the record
    outlives the buffers while the commands on it run). Checked: fails without the fix
    (the record went with the buffer: the new one had one of its own, and the copy read
    the bytes from before)."""
    async with am.open_device("cpu") as dev, am.open_device("cpu:1") as other:
        fill = await other.compile(KERNELS, "fill")
        source = await other.alloc(64)
        await source.write(np.full(16, 6, np.int32))
        array = np.zeros(16, np.int32)
        # (the array itself as the operand: wrapped on the device whose queue it is not)
        first = am.from_dlpack(array, device=dev if held == "host operand" else other)
        gate = other.timeline()
        queue = other.new_queue()
        queue.wait(gate, 1)
        if held == "launch":
            queue.launch(fill, first, vals=(6, 16))
        else:
            queue.copy(first if held == "copy" else array, source)
        del first
        gc.collect()
        again = am.from_dlpack(array)
        out = await dev.alloc(64)
        await _not_before(gate, dev.new_queue().copy(out, again))
        assert (await out.read(np.int32)).tolist() == [6] * 16


async def test_a_buffer_dropped_while_another_kinds_copy_writes_its_array_leaves_the_record(
    anyio_backend: object,
) -> None:
    """A copy held on an npy queue that writes a numpy array (a host operand, ordered as
    the cpu buffer that wraps it), and that buffer dropped meanwhile: a copy of a buffer
    made over the array again comes after the write. Checked: fails without the fix (the
    record went with the buffer: the copy read the bytes from before the write)."""
    async with am.open_device("cpu") as dev:
        array = np.zeros(16, np.int32)
        wrapped = am.from_dlpack(array)
        source = await am.from_numpy(np.full(16, 4, np.int32))
        gate = source.device.timeline()
        queue = source.device.new_queue()
        queue.wait(gate, 1)
        queue.copy(array, source)
        del wrapped
        gc.collect()
        out = await dev.alloc(64)
        await _not_before(gate, dev.new_queue().copy(out, am.from_dlpack(array)))
        assert (await out.read(np.int32)).tolist() == [4] * 16


@pytest.mark.parametrize("wrapped_on", ["cpu", "cpu:1"])
async def test_a_buffer_dropped_while_a_source_over_its_array_is_read_leaves_the_record(
    anyio_backend: object, wrapped_on: str
) -> None:
    """A copy held on ``cpu`` that reads a numpy array through ``from_numpy``'s source
    over it, ordered as the buffer that wraps the array (on ``cpu`` or ``cpu:1``), and
    that buffer dropped meanwhile: a write through a buffer made over the array again
    comes after the read, which sees the bytes from before. Checked: fails without the
    fix (the record went with the buffer: the write ran first, and the read saw it)."""
    async with am.open_device("cpu") as dev, am.open_device("cpu:1") as other:
        array = np.ones(16, np.int32)
        wrapped = am.from_dlpack(array, device=dev if wrapped_on == "cpu" else other)
        source = await am.from_numpy(array)
        nines = await dev.alloc(64)
        await nines.write(np.full(16, 9, np.int32))
        out = await dev.alloc(64)
        gate = dev.timeline()
        queue = dev.new_queue()
        queue.wait(gate, 1)
        read = queue.copy(out, source)
        del wrapped
        gc.collect()
        await _not_before(gate, dev.new_queue().copy(am.from_dlpack(array), nines))
        await read
        assert (await out.read(np.int32)).tolist() == [1] * 16
        assert array.tolist() == [9] * 16


async def test_memory_lent_on_by_two_buffers_over_one_array_comes_back_ordered_with_both(
    anyio_backend: object,
) -> None:
    """Two buffers over the same numpy array, each lent on (``np.from_dlpack``) once
    idle: memory coming back -- as a buffer, or as a copy's host operand -- is ordered
    after a command still held that writes through the first, though the second was
    lent last, and also once that second buffer is gone. Checked: fails without the
    fix (the second loan took the first's place: what came back was ordered with the
    second buffer only, and read the bytes from before the held write)."""
    async with am.open_device("cpu") as dev:
        fill = await dev.compile(KERNELS, "fill")
        array = np.zeros(16, np.int32)
        first, second = am.from_dlpack(array), am.from_dlpack(array)
        lent = np.from_dlpack(first.typed(np.int32))
        np.from_dlpack(second.typed(np.int32))  # (dropped at once: the loan ends)
        for step, comes_back in enumerate((lambda: am.from_dlpack(lent), lambda: lent), 2):
            gate = await _held_write(dev, fill, first, step)
            out = await dev.alloc(64)
            await _not_before(gate, dev.new_queue().copy(out, comes_back()))
            assert (await out.read(np.int32)).tolist() == [step] * 16
        del second  # the last to lend it on is gone: the first's loan still comes back
        gc.collect()
        gate = await _held_write(dev, fill, first, 5)
        out = await dev.alloc(64)
        await _not_before(gate, dev.new_queue().copy(out, lent))
        assert (await out.read(np.int32)).tolist() == [5] * 16


async def test_a_part_of_an_array_shares_the_record_of_a_buffer_over_all_of_it(
    anyio_backend: object,
) -> None:
    """A buffer over a part of a numpy array that a buffer already covers shares that
    buffer's record (ordered with it both ways); one over more than an earlier buffer
    covers is ordered after the commands submitted on that buffer before it was made.
    Checked: fails without the fix (a record of its own: the copy ran before the
    held write)."""
    async with am.open_device("cpu") as dev:
        fill = await dev.compile(KERNELS, "fill")
        array = np.zeros(32, np.int32)
        whole = am.from_dlpack(array)
        part = am.from_dlpack(array[8:24])
        gate = await _held_write(dev, fill, whole, 2)
        out = await dev.alloc(64)
        await _not_before(gate, dev.new_queue().copy(out, part))
        assert (await out.read(np.int32)).tolist() == [2] * 16
        gate = await _held_write(dev, fill, part, 3)
        out = await dev.alloc(128)
        await _not_before(gate, dev.new_queue().copy(out, whole))
        assert (await out.read(np.int32)).tolist() == [2] * 8 + [3] * 16 + [2] * 8
        array = np.zeros(32, np.int32)
        head = am.from_dlpack(array[:16])
        gate = await _held_write(dev, fill, head, 4)
        whole = am.from_dlpack(array)  # more than ``head``: after its held write
        assert whole.busy()
        out = await dev.alloc(128)
        await _not_before(gate, dev.new_queue().copy(out, whole))
        assert (await out.read(np.int32)).tolist() == [4] * 16 + [0] * 16


async def test_a_whole_array_after_a_slice_shares_the_slices_record(
    anyio_backend: object,
) -> None:
    """A buffer over a whole numpy array made after one over a slice of it (the only
    earlier record there; here on another device of the kind) shares the slice's
    record, both ways: a buffer over that slice made later -- a part of memory the whole
    covers, and the very range of the first slice -- is ordered after a write through
    the whole, as is the slice itself as a host operand; and the whole after a write
    through the first slice, made after the whole was. Checked: fails without the fix
    (the whole had a record of its own, the later slice took the first slice's, and
    each copy ran before the held write)."""
    async with am.open_device("cpu") as dev, am.open_device("cpu:1") as other:
        fills = {d: await d.compile(KERNELS, "fill") for d in (dev, other)}
        array = np.zeros(32, np.int32)
        head = am.from_dlpack(array[:16])
        whole = am.from_dlpack(array, device=other)
        again = am.from_dlpack(array[:16])
        for value, written, then in ((2, whole, again), (3, whole, array[:16]), (4, head, whole)):
            where, reader = written.device, other if then is whole else dev
            gate = await _held_write(where, fills[where], written, value)
            out = await reader.alloc(64)
            await _not_before(gate, reader.new_queue().copy(out, then, 64))
            assert (await out.read(np.int32)).tolist() == [value] * 16


class _CountedList(list[tuple[int, int]]):
    """A list that counts the items read from it (bisect's reads included)."""

    reads = 0

    def __getitem__(self, index: Any) -> Any:
        self.reads += 1
        return super().__getitem__(index)


async def test_a_look_up_of_foreign_memory_reads_only_the_ranges_that_may_overlap(
    anyio_backend: object,
) -> None:
    """With thousands of buffers over separate arrays and one over a large one, looking
    up a new array's memory (each from_dlpack of it, each host copy operand while such
    buffers live) reads the few ranges that may overlap it -- not every range that starts
    less than the largest size before it. Checked: fails without the change (2,533-2,803
    reads of the 2,001 ranges; such a look-up took 120-270 us on the 2-core VM with
    5,000 small arrays, against ~3 us)."""
    async with am.open_device("cpu") as dev:
        allocator = dev._allocator
        counted = _CountedList()
        allocator._foreign_ranges = counted
        large = np.zeros(1 << 26, np.uint8)
        small = [np.zeros(16, np.float32) for _ in range(2000)]
        buffers = [am.from_dlpack(a) for a in (large, *small)]
        assert len(counted) == 2001
        probe = np.zeros(16, np.float32)
        counted.reads = 0
        assert allocator.foreign_memory(probe.ctypes.data, probe.nbytes) == []
        assert counted.reads <= 2 * (2001).bit_length() + 4, counted.reads
        del buffers


async def test_a_look_up_of_foreign_memory_finds_what_overlaps(anyio_backend: object) -> None:
    """Random ranges, separate and overlapping (slices of one array, one within another):
    the records a look-up finds are those over the very range where there is one, else
    every one that shares a byte with it, those that hold it first -- before and after
    the first overlap, and after records went."""
    from asyncmetal._allocator import Block, ForeignMemory

    rng = np.random.default_rng(7)
    async with am.open_device("cpu") as dev:
        allocator, state = dev._allocator, dev._state
        records: list[ForeignMemory] = []
        blocks: list[Block] = []
        base = 1 << 40

        def note(address: int, nbytes: int) -> None:
            block = Block(address, nbytes, state)
            block.memory = ForeignMemory(address, nbytes, block.last_use, state)
            allocator.note_foreign(block)
            records.append(block.memory)
            blocks.append(block)

        def check() -> None:
            for _ in range(40):
                address = base + int(rng.integers(0, 1 << 20))
                nbytes = int(rng.integers(1, 1 << 14))
                found = allocator.foreign_memory(address, nbytes)
                same = [m for m in records if (m.address, m.nbytes) == (address, nbytes)]
                if same:
                    assert found == same[:1]
                    continue
                expected = {id(m) for m in records if m.overlaps(address, nbytes)}
                assert {id(m) for m in found} == expected
                holds = [m.holds(address, nbytes) for m in found]
                assert holds == sorted(holds, reverse=True)

        for i in range(200):  # separate ranges, 4 KiB apart
            note(base + i * 4096, int(rng.integers(1, 4096)))
        check()
        assert not allocator._foreign_overlap
        for _ in range(60):  # then overlapping ones
            address = base + int(rng.integers(0, 1 << 20))
            note(address, int(rng.integers(1, 1 << 16)))
        check()
        del records[::2], blocks[::2]  # some go (their references end)
        for _ in range(100):  # more, which prunes those gone
            address = base + (1 << 21) + int(rng.integers(0, 1 << 20))
            note(address, int(rng.integers(1, 1 << 12)))
        check()


async def test_a_look_up_of_memory_lent_out_reads_only_the_nearest_block(
    anyio_backend: object,
) -> None:
    """With thousands of buffers lent out (``np.from_dlpack``, the arrays kept), looking
    up memory coming back (each from_dlpack of an array, each host copy operand) reads
    the nearest block lent out at or before it, not every one -- and finds the right
    one, before and after some were freed and their memory handed out again. (Before,
    with no index in address order, the look-up read every entry: with 5,000 lent out,
    from_dlpack of a new array took ~1 ms on the 2-core VM, against ~17 us now.)"""
    async with am.open_device("cpu") as dev:
        allocator = dev._allocator
        buffers = [await dev.alloc(256) for _ in range(2000)]
        arrays = [np.from_dlpack(b.typed(np.uint8)) for b in buffers]
        counted = _CountedList(allocator._exported_at)
        allocator._exported_at = counted
        probe = np.zeros(64, np.uint8)
        counted.reads = 0
        assert allocator.exported_block(probe.ctypes.data, probe.nbytes) is None
        assert counted.reads <= 2 * (2000).bit_length() + 4, counted.reads

        def check() -> None:
            for i in range(0, len(buffers), 7):
                address = arrays[i].ctypes.data
                block = buffers[i]._allocation.block
                size = block.nbytes  # (256 rounded up)
                assert allocator.exported_block(address, 256) is block
                assert allocator.exported_block(address + 100, size - 100) is block
                assert allocator.exported_block(address + 100, size - 99) is None

        check()
        for buf in buffers[::3]:
            await buf.free()
        arrays = [a for i, a in enumerate(arrays) if i % 3]
        buffers = [b for i, b in enumerate(buffers) if i % 3]
        check()
        more = [await dev.alloc(256) for _ in range(300)]  # (the memory freed, again)
        arrays += [np.from_dlpack(b.typed(np.uint8)) for b in more]
        buffers += more
        check()


async def _made_over(dev: am.Device, how: str) -> tuple[am.Buffer, np.ndarray[Any, Any]]:
    """A buffer of ``dev`` and a numpy array over its memory (16 int32s): the array
    wrapped by ``am.from_dlpack``, or the buffer's own memory lent out (``np.from_dlpack``)."""
    if how == "wrapped":
        array = np.zeros(16, np.int32)
        return am.from_dlpack(array, device=dev), array
    buf = await dev.alloc(64, zeroed=True)
    return buf, np.from_dlpack(buf.typed(np.int32))


async def _finishes_after(gate: Any, work: Any) -> Any:
    """``await work()``, which must not return until ``gate`` lets a held write run;
    what it returned."""
    got: list[Any] = []

    async def run() -> None:
        got.append(await work())

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await anyio.sleep(0.05)
        assert not got  # after the held write
        gate.signal(1)
    return got[0]


@pytest.mark.parametrize("how", ["wrapped", "lent"])
async def test_a_read_only_source_over_a_buffers_memory_reads_after_its_commands(
    anyio_backend: object, how: str
) -> None:
    """``from_numpy`` of an array a buffer of ``cpu`` wraps (``am.from_dlpack``) or lent
    out (``np.from_dlpack``), made while a command held on a queue of ``cpu`` writes
    that buffer: the source is busy, its export is refused, and its ``read()``,
    ``map()`` and a copy of it into a host array on the npy device's queue come after
    that write, on the device. Checked: fails without the change (the source had a
    record of its own: not busy, exported, and read the bytes from before the write)."""
    async with am.open_device("cpu") as dev:
        fill = await dev.compile(KERNELS, "fill")
        buf, array = await _made_over(dev, how)
        gate = await _held_write(dev, fill, buf, 2)
        source = await am.from_numpy(array)
        assert source.busy()
        with pytest.raises(BufferError, match="in flight"):
            np.from_dlpack(source)
        got = await _finishes_after(gate, lambda: source.read(np.int32))
        assert got.tolist() == [2] * 16
        gate = await _held_write(dev, fill, buf, 3)
        got = await _finishes_after(gate, lambda: source.map(np.int32))
        assert got.tolist() == [3] * 16
        del got
        gate = await _held_write(dev, fill, buf, 4)
        out = np.zeros(16, np.int32)
        await _not_before(gate, source.device.queue.copy(out, source))
        assert out.tolist() == [4] * 16
        gate = await _held_write(dev, fill, buf, 5)
        await _finishes_after(gate, lambda: am.copy(out, source))
        assert out.tolist() == [5] * 16
        assert not source.busy()
        assert np.from_dlpack(source).view(np.int32).tolist() == [5] * 16


@pytest.mark.parametrize("how", ["wrapped", "lent"])
async def test_a_buffers_write_comes_after_a_held_read_of_a_source_over_its_memory(
    anyio_backend: object, how: str
) -> None:
    """A copy out of ``from_numpy``'s source over memory a buffer of ``cpu`` wraps or
    lent out, held on the npy device's queue behind a wait: the buffer is busy
    meanwhile, and a later write to it (``write()``, on ``cpu``'s default queue) comes
    after that copy, which reads the bytes from before. Checked: fails without the
    change (the write ran first, and the held copy read its bytes)."""
    async with am.open_device("cpu") as dev:
        buf, array = await _made_over(dev, how)
        array[:] = 1
        source = await am.from_numpy(array)
        gate, read, out = _held_read(source)
        assert buf.busy()
        await _written_after(gate, read, out, buf, array)


async def test_a_held_read_of_a_source_keeps_the_record_its_buffers_dropped(
    anyio_backend: object,
) -> None:
    """A copy out of ``from_numpy``'s source over an array a buffer of ``cpu:1`` wraps,
    held on the npy device's queue, and both that buffer and the source dropped
    meanwhile: a write through a buffer made over the array again, on ``cpu``, comes
    after the read, which sees the bytes from before (the record outlives the buffers
    while the read is pending: the dropped buffer lingers with it). Checked: fails
    without the change (the new buffer had a record of its own: its write ran first)."""
    async with am.open_device("cpu") as dev, am.open_device("cpu:1") as other:
        array = np.ones(16, np.int32)
        wrapped = am.from_dlpack(array, device=other)
        source = await am.from_numpy(array)
        gate, read, out = _held_read(source)
        del wrapped, source
        gc.collect()
        again = am.from_dlpack(array)
        assert again.device is dev and again.busy()
        await _written_after(gate, read, out, again, array)


def _held_read(source: am.Buffer) -> tuple[am.Timeline, am.Completion, np.ndarray[Any, Any]]:
    """A copy of ``source`` (16 int32) into a new array, held on its device's queue
    behind a wait for the timeline returned: the gate, the copy and its array."""
    queue = source.device.queue
    gate = source.device.timeline()
    queue.wait(gate, 1)
    out = np.zeros(16, np.int32)
    return gate, queue.copy(out, source), out


async def _written_after(
    gate: am.Timeline,
    read: am.Completion,
    out: np.ndarray[Any, Any],
    buf: am.Buffer,
    array: np.ndarray[Any, Any],
) -> None:
    """``buf.write`` of 2s over ``array`` (whose 1s the held ``read`` copies) finishes
    only after the gate opened and the read ran: the read saw the 1s."""
    await _finishes_after(gate, lambda: buf.write(np.full(16, 2, np.int32)))
    with anyio.fail_after(10):
        await read
    assert out.tolist() == [1] * 16
    assert array.tolist() == [2] * 16


async def test_a_source_over_parts_of_two_buffers_reads_after_their_commands(
    anyio_backend: object,
) -> None:
    """``from_numpy`` of an array two buffers of ``cpu`` each wrap half of, made while
    a command held on a queue of ``cpu`` writes the first half: the source is busy, and
    its ``read()`` comes after that write. Checked: fails without the change (not
    busy; read the bytes from before the write)."""
    async with am.open_device("cpu") as dev:
        fill = await dev.compile(KERNELS, "fill")
        array = np.zeros(32, np.int32)
        first, second = am.from_dlpack(array[:16]), am.from_dlpack(array[16:])
        await second.write(np.full(16, 1, np.int32))
        gate = await _held_write(dev, fill, first, 2)
        source = await am.from_numpy(array)
        assert source.busy()
        got = await _finishes_after(gate, lambda: source.read(np.int32))
        assert got.tolist() == [2] * 16 + [1] * 16


@pytest.mark.parametrize("how", ["wrapped", "lent"])
async def test_a_source_over_memory_a_sealed_device_holds_is_refused_then_plain(
    anyio_backend: object, how: str
) -> None:
    """``from_numpy``'s source over memory a buffer of ``cpu:1`` wraps or lent out,
    read while ``cpu:1`` is sealed and still running a command that writes it: refused
    naming ``cpu:1`` (its command cannot be waited for any more), as a copy of that
    memory is; once the close is over, read as plain memory. Checked: fails without
    the change (read at once, not refused)."""
    lender = await am.open_device("cpu:1")
    if how == "wrapped":
        array = np.zeros(4, np.int32)
        buf = am.from_dlpack(array, device=lender)
    else:
        buf = await lender.alloc(16, zeroed=True)
        array = np.from_dlpack(buf.typed(np.int32))
    release = await _held_fill(lender, buf)
    source = await am.from_numpy(array)
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(lender.close, discard=True))
        try:
            await _until(lambda: lender.closed)  # sealed, waiting for the write
            with pytest.raises(am.ClosedResourceError, match="commands of cpu:1 that had"):
                await source.read(np.int32)
        finally:
            release[0] = 1
    assert (await source.read(np.int32)).tolist() == [7] * 4
    assert not source.busy()

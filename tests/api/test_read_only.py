"""Attributes the library relies on are read-only to users: assigning one raises
AttributeError rather than corrupting the object's state."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import asyncmetal as am

pytestmark = pytest.mark.anyio


async def test_a_device_s_name_and_closed_are_read_only(device: am.Device) -> None:
    """Checked: fails without the fix (both were accepted; after ``closed = True`` the
    device's close did nothing: no teardown, its native queues never released)."""
    name = device.name
    with pytest.raises(AttributeError):
        device.closed = True  # type: ignore[misc]
    with pytest.raises(AttributeError):
        device.name = "other"  # type: ignore[misc]
    assert not device.closed and device.name == name
    await device.close()
    assert device.closed
    with pytest.raises(AttributeError):
        device.closed = False  # type: ignore[misc]
    with pytest.raises(am.ClosedResourceError):
        await device.alloc(16)


async def test_a_buffer_s_size_and_a_typed_view_s_layout_are_read_only(
    device: am.Device,
) -> None:
    """What bounds a buffer's commands and exports: ``nbytes``, ``is_view`` (a view's
    ``free`` is refused: its memory is the viewed buffer's) and a TypedView's
    ``buffer``, ``dtype`` and ``shape`` (an export trusts them to lie within the
    buffer). Checked: fails without the fix (each was accepted)."""
    buf = await device.alloc(64)
    view = buf.view(16, 16)
    typed = buf.typed(np.int32, (16,))
    for target, attribute, value in [
        (buf, "nbytes", 1 << 30),
        (view, "is_view", False),
        (typed, "buffer", view),
        (typed, "dtype", np.dtype(np.float64)),
        (typed, "shape", (1 << 20,)),
    ]:
        with pytest.raises(AttributeError):
            setattr(target, attribute, value)
    assert (buf.nbytes, view.is_view) == (64, True)
    assert (typed.buffer, typed.dtype, typed.shape) == (buf, np.dtype(np.int32), (16,))
    with pytest.raises(am.InvalidArgumentError, match="is a view"):
        await view.free()


async def test_a_queue_s_timeline_and_a_program_are_read_only(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """``q.timeline``, and what a launch reads of a program besides what the native
    launch path reads (``name``, ``params``, ``value_types``, ``binary``). Checked:
    fails without the fix (each was accepted)."""
    q = device.new_queue()
    program = kernels["fill"]
    for target, attribute, value in [
        (q, "timeline", device.timeline()),
        (program, "name", "other"),
        (program, "params", ("buffer",)),
        (program, "value_types", ()),
        (program, "binary", b""),
    ]:
        with pytest.raises(AttributeError):
            setattr(target, attribute, value)
    assert q.timeline is not device.queue.timeline and program.name == "fill"
    buf = await device.alloc(16)
    await q.launch(program, buf, vals=(7, 4))
    assert (await buf.read(np.int32)).tolist() == [7] * 4


def test_a_compile_pool_s_settings_are_read_only() -> None:
    """Checked when made, and what its workers run by: ``max_workers``,
    ``idle_timeout``, ``cache``; and its count, ``compiles``. Checked: fails without
    the fix (each was accepted)."""
    pool = am.CompilePool(2, idle_timeout=5)
    try:
        for attribute, value in [
            ("max_workers", 0),
            ("idle_timeout", 0),
            ("cache", am.CompileCache(disk=False)),
            ("compiles", 5),
        ]:
            with pytest.raises(AttributeError):
                setattr(pool, attribute, value)
        assert (pool.max_workers, pool.idle_timeout, pool.compiles) == (2, 5.0, 0)
    finally:
        pool.shutdown()


async def test_what_the_native_launch_path_reads_is_read_only(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """What a launch reads by name, in C or in Python: a buffer's ``offset`` and
    ``device``, a queue's ``device``, a program's ``device``, ``native``,
    ``buffer_count`` and ``value_count``, and a completion's times
    ring. Checked: fails without the fix (each was accepted)."""
    q = device.new_queue()
    program = kernels["fill"]
    buf = await device.alloc(64)
    other = await device.alloc(16)
    native = program.native
    done = q.launch(program, buf, vals=(1, 16))
    await done
    for target, attribute, value in [
        (buf, "offset", 1 << 40),
        (buf, "device", other.device),
        (buf.view(16), "offset", 0),
        (q, "device", None),
        (program, "device", None),
        (program, "native", 0),
        (program, "buffer_count", 0),
        (program, "value_count", 9),
        (done, "ring", [0] * 3),
        (done, "row", 1 << 40),
    ]:
        with pytest.raises(AttributeError):
            setattr(target, attribute, value)
    assert (buf.offset, buf.device, q.device, program.device) == (0, device, device, device)
    assert program.native == native
    assert (program.buffer_count, program.value_count) == (1, 2)
    await q.launch(program, buf, vals=(7, 16))
    assert (await buf.read(np.int32)).tolist() == [7] * 16


async def test_an_offset_assigned_cannot_move_a_launch_outside_its_buffer(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """A launch writes where the buffer is, whatever a user assigns to ``offset``: an
    offset past the view made the launch write outside it (here into the rest of the
    buffer it views; past the allocation, a crash or another buffer's bytes
    overwritten). Checked: fails without the fix."""
    whole = await device.alloc(64)
    await whole.write(np.zeros(16, np.int32))
    view = whole.view(16, 16)
    with contextlib.suppress(AttributeError):
        view.offset = 48  # type: ignore[misc]
    await device.queue.launch(kernels["fill"], view, vals=(5, 4))
    assert (await whole.read(np.int32)).tolist() == [0] * 4 + [5] * 4 + [0] * 8
    assert view.offset == 16

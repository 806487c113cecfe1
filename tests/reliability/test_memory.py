"""The allocator at its edges: dropped buffers, closing, budget changes, ending loops,
cancellation, concurrent loops, devices closed while another uses their memory, and
host arrays that cannot be copied as bytes. Every wait is bounded: a hang fails."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import asyncmetal as am

MiB = 1 << 20


@pytest.mark.anyio
@pytest.mark.parametrize(
    "dtype",
    [object, np.dtype([("a", np.int32), ("b", object)]), np.dtype((object, 2))],
    ids=["object", "struct-with-object", "subarray-of-object"],
)
async def test_dtypes_holding_python_objects_are_refused(device: am.Device, dtype: Any) -> None:
    buf = await device.alloc(64)
    await buf.write(np.arange(64, dtype=np.uint8))
    with pytest.raises(am.ArgumentTypeError, match="dtype"):
        await buf.read(dtype)
    with pytest.raises(am.ArgumentTypeError, match="dtype"):
        await buf.map(dtype)
    objects = np.empty(64 // np.dtype(dtype).itemsize or 1, dtype)
    with pytest.raises(am.ArgumentTypeError, match="src"):
        await buf.write(objects)
    with pytest.raises(am.ArgumentTypeError, match="src"):
        await am.copy(buf, objects, nbytes=8)
    with pytest.raises(am.ArgumentTypeError, match="dst"):
        await am.copy(objects, buf, nbytes=8)
    with pytest.raises(am.ArgumentTypeError, match="dst"):
        device.queue.copy(objects, buf, nbytes=8)
    with pytest.raises(am.ArgumentTypeError, match="src"):
        device.queue.copy(buf, objects, nbytes=8)
    assert (await buf.read()).tolist() == list(range(64))  # nothing was written
    await buf.free()


@pytest.mark.anyio
async def test_zero_size_and_unknown_dtypes_are_refused(device: am.Device) -> None:
    buf = await device.alloc(16)
    for dtype in ("V0", np.dtype([])):
        with pytest.raises(am.InvalidArgumentError, match="dtype"):
            await buf.read(dtype)
        with pytest.raises(am.InvalidArgumentError, match="dtype"):
            await buf.map(dtype)
    with pytest.raises(am.ArgumentTypeError, match="dtype"):
        await buf.read("not a dtype")
    assert (await buf.read(np.int32)).shape == (4,)
    await buf.free()

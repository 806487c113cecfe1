"""An import (``from_dlpack``) made while another device of its kind is being opened: the
opening device is listed among the devices (its state) before it has made its
allocator, and the look-ups of memory lent out walk every listed device of the kind --
a device that is still opening has lent nothing, and is passed over."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _device

pytestmark = pytest.mark.anyio


async def test_an_import_made_while_a_device_of_its_kind_opens_passes_it_over(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cpu`` lends a buffer's memory out (so imports look for lenders) and holds a
    copy into it behind a wait; ``cpu:2``'s opening makes, between listing its state and
    making its allocator, imports into ``cpu:1`` of plain host memory (looked for among
    every device of the kind) and of the lent memory: both are made, the lent one with
    the lender's record of uses (busy while the copy waits)."""
    made: list[am.Buffer] = []
    real = _device.Allocator

    def opening(state: Any) -> Any:
        if state.name == "cpu:2":
            made.append(am.from_dlpack(np.zeros(16, np.float32), device=importer))
            made.append(am.from_dlpack(lent, device=importer))
        return real(state)

    async with am.open_device("cpu") as lender, am.open_device("cpu:1") as importer:
        buf = await lender.alloc(64)
        lent = np.from_dlpack(buf.typed(np.float32, (16,)))
        gate = lender.timeline()
        lender.queue.wait(gate, 1)
        lender.queue.copy(buf, np.ones(64, np.uint8))
        monkeypatch.setattr(_device, "Allocator", opening)
        async with am.open_device("cpu:2") as opened:
            monkeypatch.setattr(_device, "Allocator", real)
            assert opened.memory_statistics().in_use == 0
        plain, again = made
        assert plain.device is importer and not plain.busy()
        assert again.busy()  # (the lender's record: the copy waits)
        gate.signal(1)
        await lender.synchronize()
        assert not again.busy()
        assert (await again.read(np.uint8) == 1).all()

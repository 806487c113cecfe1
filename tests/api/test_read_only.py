"""Attributes the library relies on are read-only to users: assigning one raises
AttributeError rather than corrupting the object's state."""

from __future__ import annotations

import pytest

import asyncmetal as am

pytestmark = pytest.mark.anyio


async def test_a_device_s_name_and_closed_are_read_only(device: am.Device) -> None:
    """Checked: fails without the fix (both were accepted; ``closed = True`` left the
    device marked closed with its queues open, its close then doing nothing)."""
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

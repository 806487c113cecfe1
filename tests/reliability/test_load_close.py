"""A compile whose kernel loads while the device's close seals it raises
ClosedResourceError, as any compile the close ends does: it never hands back a Program
of a closed device (the library loaded goes with the close)."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest

import asyncmetal as am

pytestmark = pytest.mark.anyio

LIMIT = 20  # seconds: every wait here ends within a fraction of this, or it hangs


async def test_a_load_ending_after_the_seal_is_refused(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load (on a thread) is held until the close has sealed the device, and the
    backend's close until the load ended. Checked failing before: compile returned a
    Program of the closed device."""
    device = await am.open_device("cpu")
    loading, sealed, loaded = threading.Event(), threading.Event(), threading.Event()
    load, seal, close = device._backend.load, device._seal, device._backend.close

    def sealing() -> None:
        seal()
        sealed.set()

    def held_load(*args: Any) -> Any:
        loading.set()
        sealed.wait(LIMIT)
        try:
            return load(*args)
        finally:
            loaded.set()

    def held_close(*args: Any) -> None:
        loaded.wait(LIMIT)
        close(*args)

    monkeypatch.setattr(device, "_seal", sealing)
    monkeypatch.setattr(device._backend, "load", held_load)
    monkeypatch.setattr(device._backend, "close", held_close)
    outcome: list[object] = []

    async def compile_() -> None:
        try:
            outcome.append(await device.compile("void late(int* x) { x[0] = 3; }", "late"))
        except am.ClosedResourceError as exc:
            outcome.append(exc)

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(compile_)
            while not loading.is_set():
                await anyio.sleep(0.01)
            await device.close()
    assert len(outcome) == 1 and isinstance(outcome[0], am.ClosedResourceError), outcome
    assert not device._backend._libraries  # (unloaded by the close)

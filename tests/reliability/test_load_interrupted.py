"""A kernel load interrupted anywhere after the driver made its module (cuda's
cuModuleLoadData, over the fake driver of test_cuda_faults.py) or its pipeline (Metal's
newComputePipelineStateWithFunction:error:, over the simulated Metal) lets go of it, or
leaves it registered for the close: none is leaked.

An asynchronous exception (a KeyboardInterrupt) lands wherever the interpreter checks
for one -- as a function is entered, as a C function returns to the Python calling it
(the events of a ``sys.setprofile`` profiler). The driver's own calls are taken as one
C call each: events inside them (the fake driver's Python, the Objective-C bridge's
``send`` and what the simulated Metal calls back) are not interrupted. The check as
such a call returns -- the handle then only on the interpreter's stack -- is the one
point no Python code can close."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest

import asyncmetal as am
from asyncmetal import _backend as gate_module
from asyncmetal.backends.metal import _objc
from tests.reliability.test_cuda_faults import _Driver, fake_driver
from tests.reliability.test_load_close import _interrupted_at as _interrupted_anywhere
from tests.support.fakes import metal_sim

pytestmark = pytest.mark.anyio

LIBRARY = os.path.dirname(am.__file__)
BRIDGE = _objc.__file__  # (Metal's driver calls, as the fake driver's are cuda's)
MOST_EVENTS = 10_000


def _ours(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs the library's code (not a driver's, not the test's)."""
    if frame is None:
        return False
    path = frame.f_code.co_filename
    return path.startswith(LIBRARY) and path != BRIDGE


def _interrupted_at(event: int, load: Callable[[], object]) -> bool:
    """``load()`` with _Interrupt raised at its ``event``-th point in the library's code
    (a function entered from it, a C function returning to it; counting from 1);
    whether it was raised (else the load had fewer)."""

    def counts(frame: FrameType, what: str) -> bool:
        return _ours(frame.f_back if what == "call" else frame)

    return _interrupted_anywhere(event, load, counts)


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Driver]:
    yield from fake_driver(monkeypatch)


async def test_a_cuda_load_interrupted_anywhere_leaks_no_module(
    anyio_backend: object, driver: _Driver
) -> None:
    """Every point of a load an asynchronous exception can land, one after another: each
    module cuModuleLoadData made is unloaded, or registered (the close unloads those).
    Checked failing before: interrupted as ``check`` was entered with the result of
    cuModuleLoadData, as cuModuleGetFunction was, as the gate's end was, and so on, the
    module was neither ('leaked' not empty)."""
    dev = await am.open_device("cuda:0")
    backend: Any = dev._backend
    leaked: list[int] = []
    event = 1

    def held() -> int:
        return driver.calls.count("cuModuleLoadData") - driver.calls.count("cuModuleUnload")

    while True:
        before, registered = held(), len(backend._modules)
        if not _interrupted_at(event, lambda: backend.load(b"", "k")):
            break
        if held() - before != len(backend._modules) - registered:
            leaked.append(event)
        event += 1
        assert event < MOST_EVENTS
    assert event > 10 and leaked == [], leaked
    await dev.close()
    assert not backend._modules
    assert held() == 0


metal = [
    pytest.mark.metal,
    pytest.mark.skipif(not metal_sim.configured(), reason="needs the simulated Metal"),
]
MSL = "kernel void k(device int* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {}"


@pytest.mark.parametrize("_", [pytest.param(None, marks=metal, id="metal")])
async def test_a_metal_load_interrupted_anywhere_leaks_no_pipeline(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, _: None
) -> None:
    """As the cuda test above, on Metal: each pipeline made is released, or registered
    (the close releases those). Checked failing before: interrupted as the function's
    release was entered after the pipeline was made, as the gate's end was, and so on,
    the pipeline stayed alive, unregistered ('leaked' not empty)."""
    monkeypatch.setattr(gate_module, "LOAD_WAIT_S", 0.0)
    dev = await am.open_device("metal")
    program = await dev.compile(MSL, "k")
    binary = program.binary
    backend: Any = dev._backend
    leaked: list[int] = []
    event = 1

    def alive() -> int:
        gc.collect()
        return metal_sim.live("MTLComputePipelineState")

    while True:
        before, registered = alive(), len(backend._pipelines)
        if not _interrupted_at(event, lambda: backend.load(binary, "k")):
            break
        if alive() - before != len(backend._pipelines) - registered:
            leaked.append(event)
        event += 1
        assert event < MOST_EVENTS
    assert event > 10 and leaked == [], leaked
    del program
    await dev.close()
    assert not backend._pipelines

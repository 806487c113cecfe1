"""A compile whose kernel loads while the device's close seals it raises
ClosedResourceError, as any compile the close ends does: it never hands back a Program
of a closed device (the library loaded goes with the close)."""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import pytest

import asyncmetal as am
from asyncmetal import _backend as gate_module
from asyncmetal.backends.metal import _backend as metal_backend
from tests.reliability.test_cuda_faults import CUresult, _Driver, fake_driver
from tests.support.fakes import metal_sim

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


# The cuda and metal backends: a load inside the driver (cuModuleLoadData, Metal's
# newComputePipelineStateWithFunction:error:) held there while the device closes, over
# the fake cuda driver (test_cuda_faults.py's, which the simulated driver's module calls
# are) and the simulated Metal. The close either waits for the load (it refuses loads
# from its start, then waits: the held load goes on once it sees that) and unloads its
# module with the others, or -- given no time to wait (LOAD_WAIT_S) -- goes on, and the
# load, ending after it, unloads its own and is refused. Either way the compile raises
# ClosedResourceError and nothing it loaded stays loaded.
WAITED, GIVEN_UP = "waited for", "given up on"
SRC = "void k(int* x) { x[0] = 1; }"  # parsed for its parameters only: never compiled
MSL = "kernel void k(device int* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {}"


def _until(condition: Callable[[], object]) -> None:
    """Poll ``condition()`` on this thread for at most LIMIT seconds (what it waits for is
    under way: no timing decides the outcome)."""
    deadline = time.monotonic() + LIMIT
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)


def _closing(backend: Any, closed: threading.Event, how: str) -> Callable[[], object]:
    """When a load held inside the driver goes on: ``WAITED``, once the close refuses
    loads (then it waits for those under way), or -- before the fix, the close not
    waiting -- once it returned; ``GIVEN_UP``, once the close returned."""
    if how == WAITED:
        return lambda: closed.is_set() or backend._loads.closed
    return closed.is_set


async def _compile_held_through_close(
    device: am.Device, compile_: Callable[[], Awaitable[object]], inside: threading.Event
) -> object:
    """What ``compile_()`` gave, its load held inside the driver, as ``device`` closes."""
    outcome: list[object] = []

    async def compiling() -> None:
        try:
            outcome.append(await compile_())
        except am.ClosedResourceError as exc:
            outcome.append(exc)

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(compiling)
            while not inside.is_set():
                await anyio.sleep(0.01)
            await device.close()
    assert len(outcome) == 1
    return outcome[0]


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Driver]:
    yield from fake_driver(monkeypatch)


@pytest.mark.parametrize("how", [WAITED, GIVEN_UP])
async def test_a_cuda_load_inside_the_driver_as_the_device_closes_leaves_no_module(
    anyio_backend: object, driver: _Driver, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """cuModuleLoadData held until the close refuses loads (or, given up on, returned):
    the compile raises ClosedResourceError and every module loaded is unloaded; waited
    for, before the close returns (no module call of the device after it). Checked
    failing without the fix: the load registered its module after the close had
    unloaded the others, and it stayed loaded (one cuModuleLoadData more than
    cuModuleUnload), both ways."""
    if how == GIVEN_UP:
        monkeypatch.setattr(gate_module, "LOAD_WAIT_S", 0.0)
    dev = await am.open_device("cuda:0")
    backend: Any = dev._backend
    params = await dev._params(SRC, "k")
    assert isinstance(params, tuple)
    inside, closed = threading.Event(), threading.Event()
    after: list[int] = []  # where the driver's calls were when the close returned
    load_data, close = driver.cuModuleLoadData, backend.close
    goes_on = _closing(backend, closed, how)

    def held_load_data(binary: bytes) -> tuple[Any, ...]:
        inside.set()
        _until(goes_on)
        return load_data(binary)

    def closing() -> None:
        try:
            close()
        finally:
            after.append(len(driver.calls))
            closed.set()

    monkeypatch.setattr(driver, "cuModuleLoadData", held_load_data)
    monkeypatch.setattr(backend, "close", closing)
    outcome = await _compile_held_through_close(
        dev,
        lambda: dev._program(("key", "k"), params, b"", SRC, backend.compiler, None),
        inside,
    )
    assert isinstance(outcome, am.ClosedResourceError), outcome
    assert driver.calls.count("cuModuleLoadData") == 1
    assert driver.calls.count("cuModuleUnload") == 1
    assert not backend._modules
    if how == WAITED:
        late = [c for c in driver.calls[after[0] :] if c.startswith("cuModule")]
        assert late == [], late


async def test_a_cuda_load_after_the_close_is_refused(
    anyio_backend: object, driver: _Driver
) -> None:
    """The backend's load after its close raises ClosedResourceError and calls no driver
    function of modules. Checked failing without the fix: the module loaded, into a
    backend that never unloads it again."""
    dev = await am.open_device("cuda:0")
    backend: Any = dev._backend
    await dev.close()
    with pytest.raises(am.ClosedResourceError):
        backend.load(b"", "k")
    assert [c for c in driver.calls if c.startswith("cuModule")] == []
    assert not backend._modules


metal = [
    pytest.mark.metal,
    pytest.mark.skipif(not metal_sim.configured(), reason="needs the simulated Metal"),
]


@pytest.mark.parametrize("how", [WAITED, GIVEN_UP])
@pytest.mark.parametrize("_", [pytest.param(None, marks=metal, id="metal")])
async def test_a_metal_load_inside_metal_as_the_device_closes_leaves_no_pipeline(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, how: str, _: None
) -> None:
    """newComputePipelineStateWithFunction:error: held until the close refuses loads (or,
    given up on, returned): the compile raises ClosedResourceError, no pipeline of it
    stays alive, and nothing is sent to the device after the backend let go of its
    reference of it. Checked failing without the fix: the pipeline was registered after
    the close had released the others, and stayed alive; the close had released the
    device while the load still sent messages to it."""
    if how == GIVEN_UP:
        monkeypatch.setattr(gate_module, "LOAD_WAIT_S", 0.0)
    async with am.open_device("metal") as warm:  # (built now: the compile below loads it)
        await warm.compile(MSL, "k")
    before = metal_sim.live("MTLComputePipelineState")
    dev = await am.open_device("metal")
    backend: Any = dev._backend
    inside, closed = threading.Event(), threading.Event()
    let_go: list[str] = []  # what was sent to the device after its release
    released = threading.Event()
    send, release, close = metal_backend.send, metal_backend.release, backend.close
    goes_on = _closing(backend, closed, how)

    def held_send(receiver: Any, selector: str, *args: Any, **kwargs: Any) -> Any:
        if selector == "newComputePipelineStateWithFunction:error:" and not inside.is_set():
            inside.set()
            _until(goes_on)
        if receiver == backend.device and released.is_set():
            let_go.append(selector)
        return send(receiver, selector, *args, **kwargs)

    def releasing(obj: Any) -> None:
        if obj == backend.device:
            released.set()
        release(obj)

    def closing() -> None:
        try:
            close()
        finally:
            closed.set()

    monkeypatch.setattr(metal_backend, "send", held_send)
    monkeypatch.setattr(metal_backend, "release", releasing)
    monkeypatch.setattr(backend, "close", closing)
    outcome = await _compile_held_through_close(dev, lambda: dev.compile(MSL, "k"), inside)
    assert isinstance(outcome, am.ClosedResourceError), outcome
    assert released.is_set()
    assert let_go == [], let_go
    assert not backend._pipelines
    gc.collect()
    assert metal_sim.live("MTLComputePipelineState") == before


@pytest.mark.parametrize("_", [pytest.param(None, marks=metal, id="metal")])
async def test_a_metal_load_after_the_close_is_refused(anyio_backend: object, _: None) -> None:
    """The backend's load after its close raises ClosedResourceError and sends nothing to
    the device. Checked failing without the fix: a pipeline was made (of the device the
    close had let go of), and stayed alive."""
    before = metal_sim.live("MTLComputePipelineState")
    dev = await am.open_device("metal")
    program = await dev.compile(MSL, "k")
    backend: Any = dev._backend
    await dev.close()
    with pytest.raises(am.ClosedResourceError):
        backend.load(program.binary, "k")
    del program
    gc.collect()
    assert metal_sim.live("MTLComputePipelineState") == before


@pytest.mark.parametrize("_", [pytest.param(None, marks=metal, id="metal")])
async def test_a_metal_load_failing_after_a_close_that_went_on_lets_go_of_the_device(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, _: None
) -> None:
    """A load under way as the close stopped waiting (LOAD_WAIT_S 0), whose pipeline
    Metal then refuses: it raises its CompileError, and it -- the last load under way --
    releases the backend's reference of the device, once, which the close left to it."""
    monkeypatch.setattr(gate_module, "LOAD_WAIT_S", 0.0)
    dev = await am.open_device("metal")
    program = await dev.compile(MSL, "k")
    backend: Any = dev._backend
    inside, closed = threading.Event(), threading.Event()
    releases: list[int] = []
    send, release = metal_backend.send, metal_backend.release

    def refusing_send(receiver: Any, selector: str, *args: Any, **kwargs: Any) -> Any:
        if selector == "newComputePipelineStateWithFunction:error:":
            inside.set()
            _until(closed.is_set)
            return 0  # (nil, no error)
        return send(receiver, selector, *args, **kwargs)

    def releasing(obj: Any) -> None:
        if obj == backend.device:
            releases.append(obj)
        release(obj)

    monkeypatch.setattr(metal_backend, "send", refusing_send)
    monkeypatch.setattr(metal_backend, "release", releasing)
    raised: list[BaseException] = []

    def load() -> None:
        try:
            backend.load(program.binary, "k")
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    with anyio.fail_after(LIMIT):
        while not inside.is_set():
            await anyio.sleep(0.01)
        await dev.close()
    assert releases == []  # (left to the load under way)
    closed.set()
    thread.join(LIMIT)
    assert len(raised) == 1 and isinstance(raised[0], am.CompileError), raised
    assert len(releases) == 1


# A close that fails before it gets to the kernels (a step of its own raising: the freeing
# thread's stop, the pinned chunks' free) still refuses every load from its start and
# lets go of every kernel registered: a load after it would otherwise register its kernel
# with a device that never lets go of it again.
class _Failing(RuntimeError):
    pass


def _fail_once(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[str]:
    """``owner.name()`` raises _Failing the first time, then runs as before; the list
    records the failure."""
    failed: list[str] = []
    method = getattr(owner, name)

    def failing(*args: Any) -> Any:
        if not failed:
            failed.append(name)
            raise _Failing(f"{name} failed")
        return method(*args)

    monkeypatch.setattr(owner, name, failing)
    return failed


def _refused(load: Callable[[], object]) -> bool:
    """Whether ``load()`` raised ClosedResourceError (else it loaded)."""
    try:
        load()
    except am.ClosedResourceError:
        return True
    return False


@pytest.mark.parametrize("step", ["_stop_freer", "_free_chunks"])
async def test_a_failing_cuda_close_refuses_loads_and_unloads_its_modules(
    anyio_backend: object, driver: _Driver, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """The backend's close raises from ``step``, before its modules part: the module
    loaded before it is unloaded all the same, and a load after it raises
    ClosedResourceError, calling no driver function of modules."""
    dev = await am.open_device("cuda:0")
    backend: Any = dev._backend
    backend.load(b"", "k")  # (the backend's own: the device unloads none of it)
    failed = _fail_once(monkeypatch, backend, step)
    with pytest.raises(_Failing):
        await dev.close()
    assert failed == [step]
    unloaded = driver.calls.count("cuModuleUnload")
    refused = _refused(lambda: backend.load(b"", "k"))
    assert (unloaded, refused, len(backend._modules)) == (1, True, 0)
    assert driver.calls.count("cuModuleLoadData") == 1


async def test_a_cuda_close_failing_before_its_own_steps_refuses_loads(
    anyio_backend: object, driver: _Driver
) -> None:
    """The driver cannot say which context is current as the backend's close begins (it
    raises before any step of its own): a load after it raises ClosedResourceError all
    the same, calling no driver function of modules."""
    dev = await am.open_device("cuda:0")
    backend: Any = dev._backend
    driver.fail["cuCtxGetCurrent"] = CUresult.CUDA_ERROR_INVALID_CONTEXT
    with pytest.raises(am.AsyncMetalError):
        await dev.close()
    del driver.fail["cuCtxGetCurrent"]
    refused = _refused(lambda: backend.load(b"", "k"))
    assert (refused, driver.calls.count("cuModuleLoadData")) == (True, 0)


@pytest.mark.parametrize("_", [pytest.param(None, marks=metal, id="metal")])
async def test_a_failing_metal_close_refuses_loads_and_releases_its_pipelines(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, _: None
) -> None:
    """The backend's close raises from its freeing thread's stop, before its pipelines
    part: the pipeline loaded before it is released all the same, so is the device, and
    a load after it raises ClosedResourceError, making no pipeline."""
    before = metal_sim.live("MTLComputePipelineState")
    dev = await am.open_device("metal")
    program = await dev.compile(MSL, "k")
    backend: Any = dev._backend
    backend.load(program.binary, "k")  # (the backend's own: the device releases none of it)
    releases: list[int] = []
    release = metal_backend.release

    def releasing(obj: Any) -> None:
        if obj == backend.device:
            releases.append(obj)
        release(obj)

    monkeypatch.setattr(metal_backend, "release", releasing)
    failed = _fail_once(monkeypatch, backend._freer, "stop")
    with pytest.raises(_Failing):
        await dev.close()
    assert failed == ["stop"]
    binary = program.binary
    refused = _refused(lambda: backend.load(binary, "k"))
    assert (len(releases), refused, len(backend._pipelines)) == (1, True, 0)
    del program
    gc.collect()
    assert metal_sim.live("MTLComputePipelineState") == before


# A load's count at the gate and its undo are one unit: an asynchronous exception (a
# KeyboardInterrupt, PyThreadState_SetAsyncExc) lands wherever the interpreter checks for
# one -- as a function is entered, and as a C function returns to the Python calling it --
# and wherever it lands in a load, the count is given back. Left up, the close would wait
# out LOAD_WAIT_S for a load that is not under way, and on Metal never let go of the
# device (the close leaves that to the last load still counted).
class _Interrupt(BaseException):
    """What the profiler raises: an exception no ``except Exception`` takes."""


def _interrupted_at(
    event: int, load: Callable[[], object], counts: Callable[[Any, str], bool] | None = None
) -> bool:
    """``load()`` with _Interrupt raised at its ``event``-th function entry or C function
    return (counting from 1; ``counts``: which of those count, given the frame and the
    event, all by default); whether it was raised (else the load had fewer)."""
    seen = 0

    def profiler(frame: Any, what: str, arg: object) -> None:
        nonlocal seen
        if what in ("call", "c_return") and (counts is None or counts(frame, what)):
            seen += 1
            if seen == event:
                raise _Interrupt(event)  # (the interpreter then drops the profiler)

    kept = sys.getprofile()
    sys.setprofile(profiler)
    try:
        load()
    except _Interrupt:
        return True
    finally:
        sys.setprofile(kept)
    return False


def _counted(backend: Any) -> int:
    with backend._loads.lock:
        return int(backend._loads._loading)


MOST_EVENTS = 10_000  # (a load has about fifty, on the fake driver and on the simulated Metal)


async def test_a_cuda_load_interrupted_anywhere_gives_its_count_back(
    anyio_backend: object, driver: _Driver
) -> None:
    """Every point of a load an asynchronous exception can land, one after another: the
    gate counts no load afterwards, and the close leaves no module registered. Checked
    failing without the fix ('[11, 42]'): interrupted as the modules lock was let go of
    after the count, or as the load entered the gate's end, the load left it up."""
    dev = await am.open_device("cuda:0")
    backend: Any = dev._backend
    left_up: list[int] = []
    event = 1
    while _interrupted_at(event, lambda: backend.load(b"", "k")):
        if _counted(backend):
            left_up.append(event)
            with backend._loads.lock:  # (so that the next ones show their own)
                backend._loads._loading = 0
        event += 1
        assert event < MOST_EVENTS
    assert event > 3 and left_up == [], left_up
    await dev.close()
    assert not backend._modules


@pytest.mark.parametrize("_", [pytest.param(None, marks=metal, id="metal")])
async def test_a_metal_load_interrupted_anywhere_gives_its_count_back(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, _: None
) -> None:
    """As the cuda test above, on Metal: no load is counted afterwards, and the close --
    given no time to wait for loads (LOAD_WAIT_S 0) -- lets go of the device itself.
    Checked failing without the fix ('[5, 46]'): interrupted as the pipelines lock was
    let go of after the count, or as the load entered the gate's end, it left it up."""
    monkeypatch.setattr(gate_module, "LOAD_WAIT_S", 0.0)
    dev = await am.open_device("metal")
    program = await dev.compile(MSL, "k")
    backend: Any = dev._backend
    left_up: list[int] = []
    event = 1
    while _interrupted_at(event, lambda: backend.load(program.binary, "k")):
        if _counted(backend):
            left_up.append(event)
            with backend._loads.lock:  # (so that the next ones show their own)
                backend._loads._loading = 0
        event += 1
        assert event < MOST_EVENTS
    assert event > 3 and left_up == [], left_up
    releases: list[int] = []
    release = metal_backend.release

    def releasing(obj: Any) -> None:
        if obj == backend.device:
            releases.append(obj)
        release(obj)

    monkeypatch.setattr(metal_backend, "release", releasing)
    await dev.close()
    assert len(releases) == 1 and not backend._pipelines

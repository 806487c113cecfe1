"""A fault-injection sweep of the Metal backend on the simulated Metal
(tests/support/fakes/metal_sim): a workload that makes every kind of Metal object the
backend makes (a device's queues and events, buffers, a kernel's function, command
buffers and their encoders: launches, copies, fills, host copies, timeline signals and
waits) runs once counting the messages that make one, then once for each N (sampled,
deterministically) with the Nth returning nil, as Metal's do with no memory left.

Every run checks the contracts at an edge (DESIGN.md 9): what fails is an
``AsyncMetalError``, never a raw Python error; nothing hangs; the close completes; the
device's threads end; every Metal object made is released; and the next run (nothing
failing) works, with the right bytes.
"""

from __future__ import annotations

import gc
import time
import traceback
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from tests.support.fakes import metal_sim
from tests.support.faults import device_threads, sampled

pytestmark = [
    pytest.mark.metal,
    pytest.mark.skipif(
        not metal_sim.configured(), reason=f"no simulated Metal here: {metal_sim.missing()}"
    ),
]

SRC = """
#include <metal_stdlib>
using namespace metal;
kernel void fill(device int* out [[buffer(0)]], constant int& value [[buffer(1)]],
                 uint i [[thread_position_in_grid]]) { out[i] = value; }
"""
N = 1024  # ints per buffer
SAMPLES = 40  # failing runs at most, spread evenly over the messages
CLASSES = ("MTLBuffer", "MTLCommandQueue", "MTLSharedEvent", "MTLCommandBuffer", "MTLFunction")


class _Outcome:
    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.trace = ""
        self.problems: list[str] = []


async def _workload(out: _Outcome) -> None:
    """Open, allocate, write, compile, launch, copy, fill, read (checked), a timeline
    signalled on one queue and waited for on another, free, close; stops at the first
    error, then closes the device."""
    state: dict[str, Any] = {}
    try:
        dev = state["dev"] = await am.open_device("metal")
        a = state["a"] = await dev.alloc(4 * N)
        b = state["b"] = await dev.alloc(4 * N)
        await a.write(np.arange(N, dtype=np.int32))
        fill = await dev.compile(SRC, "fill")
        await dev.queue.launch(fill, b, vals=(7,), global_size=N, local_size=32)
        if not (await b.read(np.int32) == 7).all():
            out.problems.append("the kernel's bytes are wrong")
        await am.copy(b, a)
        await dev.queue.fill(a, 1)
        if not (await b.read(np.int32) == np.arange(N)).all():
            out.problems.append("the copy's bytes are wrong")
        timeline = dev.timeline()
        q1, q2 = dev.new_queue(), dev.new_queue()
        q2.wait(timeline, 1)
        done = q2.launch(fill, b, vals=(3,), global_size=N, local_size=32)
        q1.signal(timeline, 1)
        await done
        await q1.close()
        await q2.close()
        for name in ("a", "b"):
            await state.pop(name).free()
    except Exception as exc:
        out.error = exc
        out.trace = "".join(traceback.format_exception(exc))
        for link in (exc, exc.__context__, exc.__cause__):  # (their frames hold buffers)
            if link is not None:
                link.__traceback__ = None
    finally:
        # Its buffers are the close's to free: a free waits for the buffer's last use,
        # which may wait on the GPU for a signal that failed (and the close ends).
        if "dev" in state:
            try:
                await state["dev"].close()
            except Exception as exc:
                out.problems.append(f"close raised {exc!r}")


async def _run(fail_at: int = 0) -> tuple[int, _Outcome]:
    """The workload with the ``fail_at``-th making message returning nil (0: none):
    how many such messages it sent, and what it met."""
    live = {name: metal_sim.live(name) for name in CLASSES}
    threads = device_threads()
    out = _Outcome()
    metal_sim.fail_at(fail_at)
    try:
        with anyio.fail_after(30):
            await _workload(out)
    finally:
        sent = metal_sim.fail_at(-1)
    deadline = time.monotonic() + 10  # (handlers run, closes end, on threads of their own)
    while time.monotonic() < deadline:
        gc.collect()
        left = {n: metal_sim.live(n) - live[n] for n in CLASSES if metal_sim.live(n) > live[n]}
        if not left and not device_threads() - threads:
            break
        await anyio.sleep(0.01)
    else:
        if left:
            out.problems.append(f"Metal objects never released: {left}")
        if device_threads() - threads:
            out.problems.append(
                f"threads left: {sorted(t.name for t in device_threads() - threads)}"
            )
    return sent, out


@pytest.fixture
def anyio_backend() -> str:
    """asyncio only: what is swept is the backend's handling of nil from Metal, the
    same under every loop."""
    return "asyncio"


async def test_every_metal_object_that_cannot_be_made_ends_in_a_clear_error(
    anyio_backend: str,
) -> None:
    """For each sampled N, the Nth message that makes a Metal object returns nil: the
    workload raises an AsyncMetalError or, where that is absorbed, ends as usual; the
    checks of ``_run`` hold; and the next run, nothing failing, is clean."""
    total, out = await _run()
    assert out.error is None and not out.problems, (out.trace, out.problems)
    assert total > 10, total  # every kind of object the workload makes
    found: list[str] = []
    for n in sampled(total, SAMPLES):
        _, out = await _run(n)
        at = f"message {n} of {total} returning nil"
        if out.error is not None and not isinstance(out.error, am.AsyncMetalError):
            found.append(f"{at}: raised {type(out.error).__name__}: {out.error}\n{out.trace}")
        found += [f"{at}: {problem}" for problem in out.problems]
        _, again = await _run()
        if again.error is not None or again.problems:
            found.append(f"{at}: the next run failed: {again.trace} {again.problems}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("to_device", [True, False], ids=["copy in", "copy out"])
async def test_a_staging_buffer_that_cannot_be_made_fails_its_copy_clearly(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch, to_device: bool
) -> None:
    """A copy of host memory Metal will not wrap is staged on the queue's own thread;
    where its staging buffer comes back nil, the awaiting task gets an AsyncMetalError
    (NoHostMemoryError, still a MemoryError), not a bare MemoryError from that thread,
    and the queue goes on: the next copy is right. Checked: before, a bare MemoryError
    reached the task."""
    from asyncmetal.backends.metal import _backend, _objc

    monkeypatch.setattr(_backend.MetalBackend, "wrap_pages", lambda self, a, n, check=True: None)
    send, refused = _objc.send, {"n": 0}
    staging = ("newBufferWithBytes:length:options:", "newBufferWithLength:options:")

    def nil_once(obj: int, selector: str, *args: Any, **kwargs: Any) -> Any:
        if selector in staging and not refused["n"]:
            refused["n"] += 1
            return 0
        return send(obj, selector, *args, **kwargs)

    monkeypatch.setattr("asyncmetal.backends.metal._queue.send", nil_once)
    host = np.arange(N, dtype=np.int32)
    async with am.open_device("metal") as dev:
        buf = await dev.alloc(4 * N)
        dst, src = (buf, host) if to_device else (np.zeros(N, np.int32), buf)
        with pytest.raises(am.AsyncMetalError, match="staging") as caught:
            await am.copy(dst, src)
        assert isinstance(caught.value, MemoryError)
        assert refused["n"] == 1
        await am.copy(buf, host)
        back = np.zeros(N, np.int32)
        await am.copy(back, buf)
        assert (back == host).all()
        await buf.free()

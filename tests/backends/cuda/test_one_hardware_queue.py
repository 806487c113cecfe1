"""Streams sharing one hardware queue (`pytest -m cuda`). Streams beyond a GPU's
CUDA_DEVICE_MAX_CONNECTIONS (8 by default) share hardware queues, in the order their
work was handed over, and a stream's wait there holds up every stream behind it. With
one hardware queue every stream shares it: a wait handed to the driver before the work
that satisfies it hangs for good. So each case runs in a process of its own with
CUDA_DEVICE_MAX_CONNECTIONS=1 and must end: a queue's wait for a command its queue
still holds on the host (past its bound on commands in flight), a wait on a timeline
before the signal that raises it was submitted, and other libraries' streams reading a
buffer whose writer is held (DLPack and ``__cuda_array_interface__``).
Checked on the H200 with the runtime before waits were held until they can be met: the
queue wait, the timeline wait and both DLPack consumers hung (the
``__cuda_array_interface__`` case passed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import asyncmetal as am

from .test_interop import _importable

GPUS = [d for d in am.devices() if d.startswith("cuda:")]
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not GPUS, reason="no NVIDIA GPU with cuda-bindings on this machine"),
]
ROOT = Path(__file__).resolve().parents[3]

SETUP = """
import asyncio
import numpy as np
import asyncmetal as am
from tests.backends.cuda.test_interop import GRID, KERNELS, N

async def deep(dev, sleep):  # more long kernels than a queue hands to the driver at once
    for _ in range(40):
        dev.queue.launch(sleep, vals=(1_000,))

async def main():
    async with am.open_device("cuda:0") as dev:
        fill, sleep = await dev.compile(KERNELS, "fill"), await dev.compile(KERNELS, "sleep_us")
        buf = await dev.alloc(4 * N)
        view = buf.typed(np.int32)
        other = dev.new_queue()
        await case(dev, fill, sleep, buf, view, other)
        print("ended", flush=True)

"""

CASES = {
    "queue_wait": """
async def case(dev, fill, sleep, buf, view, other):
    await deep(dev, sleep)
    dev.queue.launch(fill, buf, vals=(1, N), **GRID)
    await other.after(buf).launch(fill, buf, vals=(2, N), **GRID)
    assert (await buf.read(np.int32) == 2).all()
""",
    "timeline_before_signal": """
async def case(dev, fill, sleep, buf, view, other):
    timeline = dev.timeline()
    other.wait(timeline, 1)
    filled = other.launch(fill, buf, vals=(3, N), **GRID)
    await deep(dev, sleep)
    dev.queue.signal(timeline, 1)
    await filled
    assert (await buf.read(np.int32) == 3).all()
""",
}
# Another library reads a buffer on a stream of its own while the buffer's writer is
# held on the host: the export hands it over, and that stream waits on its event.
CONSUMER = """
import {module}
async def case(dev, fill, sleep, buf, view, other):
    await deep(dev, sleep)
    dev.queue.launch(fill, buf, vals=({value}, N), **GRID)
    with {stream}:
        assert int({take}(view).sum()) == {value} * N
"""
CUPY_STREAM = "cupy.cuda.Stream(non_blocking=True)"
CASES["cupy_dlpack"] = CONSUMER.format(
    module="cupy", value=4, stream=CUPY_STREAM, take="cupy.from_dlpack"
)
CASES["cupy_interface"] = CONSUMER.format(
    module="cupy", value=5, stream=CUPY_STREAM, take="cupy.asarray"
)
CASES["torch_dlpack"] = CONSUMER.format(
    module="torch",
    value=6,
    stream="torch.cuda.stream(torch.cuda.Stream())",
    take="torch.from_dlpack",
)
NEEDS = {"cupy_dlpack": "cupy", "cupy_interface": "cupy", "torch_dlpack": "torch"}


@pytest.mark.parametrize("case", list(CASES))
def test_waits_end_on_one_hardware_queue(case: str) -> None:
    needed = NEEDS.get(case)
    if needed and not _importable(needed):
        pytest.skip(f"needs {needed}")
    script = SETUP + textwrap.dedent(CASES[case]) + "\nasyncio.run(main())\n"
    env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", script],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=90,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: hung with one hardware queue")
    assert proc.returncode == 0 and "ended" in proc.stdout, proc.stderr[-4000:]

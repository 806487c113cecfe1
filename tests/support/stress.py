"""The ordering stress test, shared by the cpu and cuda test modules."""

from __future__ import annotations

import random
from typing import Any

import numpy as np

import asyncmetal as am


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


async def interleavings(
    devs: list[am.Device],
    mixes: list[am.Program],
    launch: dict[str, Any],
    seed: int,
    steps: int = 600,
    n: int = 512,
) -> None:
    """Random launches and copies over three queues per device and two buffers per
    device; every byte is checked against a sequential model. ``mixes[i]`` computes
    x[i] = x[i] * 31 + k + i over ``n`` bytes on device i."""
    rng = random.Random(seed)
    queues = [[d.queue, d.new_queue(), d.new_queue()] for d in devs]
    bufs = [(i, await devs[i].alloc(n)) for i in range(len(devs)) for _ in range(2)]
    model = [random_bytes(n, k) for k in range(len(bufs))]
    for (_, b), m in zip(bufs, model):
        await b.write(m)
    ramp = np.arange(n)
    for step in range(steps):
        op = rng.random()
        if op < 0.45:  # a launch on any queue of the buffer's device, ordered by after()
            j = rng.randrange(len(bufs))
            dev_i, buf = bufs[j]
            k = rng.randrange(256)
            rng.choice(queues[dev_i]).after(buf).launch(mixes[dev_i], buf, vals=(n, k), **launch)
            model[j] = ((model[j].astype(np.int64) * 31 + k + ramp) % 256).astype(np.uint8)
        elif op < 0.9:  # a copy of a random range between any two buffers, any dst queue
            s, t = rng.sample(range(len(bufs)), 2)
            size = rng.randrange(1, n)
            so, to = rng.randrange(n - size + 1), rng.randrange(n - size + 1)
            src, dst = bufs[s][1].view(so, size), bufs[t][1].view(to, size)
            rng.choice(queues[bufs[t][0]]).copy(dst, src)
            model[t][to : to + size] = model[s][so : so + size]
        elif op < 0.95:  # a host write
            j = rng.randrange(len(bufs))
            data = random_bytes(n, 1000 + step)
            await am.copy(bufs[j][1], data)
            model[j] = data
        else:  # a read in the middle of it all
            j = rng.randrange(len(bufs))
            np.testing.assert_array_equal(await bufs[j][1].read(), model[j])
    for (_, b), m in zip(bufs, model):
        np.testing.assert_array_equal(await b.read(), m)


async def park_all(completions: list[am.Completion]) -> am.LoopStatistics:
    """Wait until a task awaiting each of ``completions`` is parked on the bridge;
    return the loop's statistics at that moment."""
    import anyio

    while am.loop_statistics().waiting < len(completions):
        await anyio.sleep(0.001)
    return am.loop_statistics()

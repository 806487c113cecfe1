"""The ordering stress test, shared by the cpu and cuda test modules."""

from __future__ import annotations

import functools
import random
from typing import Any

import anyio
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


def add_wait(
    rng: random.Random,
    pick: float,
    q: Any,
    qi: int,
    queues: list[Any],
    last: list[int],
    host: am.Timeline,
    host_next: int,
    done: list[Any],
) -> int:
    """An ordering storm's wait, for ``pick`` below 0.85: queue ``q`` (``queues[qi]``)
    waits for the host timeline's next value (below 0.75) or for a value of a queue's
    already submitted, its own included (``last``: each queue's latest; the waits never
    make a cycle, nor wait for what nothing submits), reached or not. Each wait made is appended to
    ``done``. Returns the host timeline's next value."""
    if pick < 0.75:
        host_next += 1
        done.append(q.wait(host, host_next))
        return host_next
    other = rng.randrange(len(queues))
    if last[other]:
        value = rng.randint(max(1, last[other] - 3), last[other])
        done.append(q.wait(queues[other].timeline, value))
    return host_next


async def discard_round(
    end: str, dev: am.Device, queues: list[Any], host: am.Timeline, host_next: int
) -> bool:
    """End an ordering storm's round by discarding, where ``end`` says so:
    "discard_queue" (every queue but the device's own discarded, then the host timeline
    signalled to ``host_next`` and the device closed) or "discard_device" (the device
    closed, discarding). Returns False, having done nothing, for another ``end``."""
    if end == "discard_queue":
        for q in queues[1:]:
            await q.close(discard=True)
        if host_next > host.value:
            host.signal(host_next)
        await dev.close()
    elif end == "discard_device":
        await dev.close(discard=True)
    else:
        return False
    return True


async def after_step(
    rng: random.Random,
    end: str,
    tg: Any,
    queues: list[Any],
    qi: int,
    done: list[Any],
    before: int,
    last: list[int],
) -> None:
    """An ordering storm's step done on ``queues[qi]``: its latest value noted in ``last``
    (where the step added to ``done``, ``before`` long before it), at times a short sleep,
    and in a round that ends "discard_queue", at times a queue discarded in task group
    ``tg`` (never the device's own, ``queues[0]``)."""
    if len(done) > before:
        last[qi] = done[-1].value
    if rng.random() < 0.3:
        await anyio.sleep(rng.random() * 0.003)
    if end == "discard_queue" and rng.random() < 0.04:
        victim = queues[rng.randrange(1, len(queues))]
        tg.start_soon(functools.partial(victim.close, discard=True))


def next_step(
    rng: random.Random, queues: list[Any], done: list[Any]
) -> tuple[int, Any, float, int]:
    """An ordering storm's next step: the index of the queue it runs on, that queue, the
    pick of what it does (in [0, 1)) and how many commands ``done`` held before it."""
    qi = rng.randrange(len(queues))
    return qi, queues[qi], rng.random(), len(done)

"""Diagnostic: pageable 1 GiB host -> H200 copies, staging's chunk size and host-copy
threads A/B (session 3's 4 MiB x 8 against session 4's 8 MiB x 12), alternated.

    PYTHONPATH=. python benchmarks/diagnostics/h2d_staging_ab.py  (OUT=dir for h2d_ab.json)

Ran as run 46 (without the 16-thread row) and run 48 at the final code of session 4
(results/h200/h2d_staging_ab-run4{6,8}.json).

Each round makes a fresh queue per configuration (order reversed every other round) and
times three copies on it; best and median per configuration over all rounds.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, "benchmarks")
from _common import seconds_each

import asyncmetal as am
from asyncmetal.backends import cuda as cb

CONFIGS = {
    "chunk4_threads8": (4 << 20, 8),
    "chunk8_threads12": (8 << 20, 12),
    "chunk8_threads8": (8 << 20, 8),
    "chunk4_threads12": (4 << 20, 12),
    "chunk8_threads16": (8 << 20, 16),
}


async def main() -> dict[str, object]:
    n = 1 << 30
    host = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    saved = cb.STAGE_CHUNK, cb.HOST_COPY_THREADS
    async with am.open_device("cuda:0") as dev:
        b = await dev.alloc(n)
        for rnd in range(4):
            names = list(CONFIGS) if rnd % 2 == 0 else list(reversed(CONFIGS))
            for name in names:
                cb.STAGE_CHUNK, cb.HOST_COPY_THREADS = CONFIGS[name]
                dev._backend._chunks.clear()  # no pooled chunk of another size (leaks them)
                q = dev.new_queue()
                await q.copy(b, host[: 64 << 20], 64 << 20)  # the ring and threads made
                times[name] += await seconds_each(lambda q=q: q.copy(b, host), 3)
                print(rnd, name, round(n / min(times[name][-3:]) / 1e9, 1), flush=True)
        cb.STAGE_CHUNK, cb.HOST_COPY_THREADS = saved
        correct = bool(np.array_equal(await b.read(), host))
    return {
        "gbps_best": {k: n / min(v) / 1e9 for k, v in times.items()},
        "gbps_median": {k: n / statistics.median(v) / 1e9 for k, v in times.items()},
        "correct": correct,
    }


result = asyncio.run(main())
print(json.dumps(result, indent=1))
with open(os.environ.get("OUT", "/tmp") + "/h2d_ab.json", "w") as f:
    json.dump(result, f, indent=1)

"""Diagnostic: pageable 1 GiB host -> H200 copies under staging configurations.

    PYTHONPATH=. python benchmarks/diagnostics/h2d_staging_configs.py  (OUT=dir for h2d.json)

Each configuration (chunk size, ring length, host-copy threads) on a fresh queue, best of
three copies, two rounds. Ran as run 42 at bf134d7, when staging had non-temporal stores
("default" then; "plain": memcpy, the only mode since 5b7fdac). Needs that commit to run
as written: the "plain" override passes the ``streaming`` flag it had.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import numpy as np

sys.path.insert(0, "benchmarks")
from _common import seconds_each

import asyncmetal as am
from asyncmetal.backends import cuda as cb


def flush_pool(backend):
    backend._chunks.clear()  # diagnostic: forget pooled chunks (leaks pinned memory)


async def main():
    n = 1 << 30
    host = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    out = {}
    async with am.open_device("cuda:0") as dev:
        b = await dev.alloc(n)
        await dev.queue.copy(b, host[: 64 << 20], 64 << 20)
        backend = dev._backend
        configs = [
            ("default", dict()),
            ("plain", dict(streaming=False)),
            ("ring32", dict(STAGE_RING=32)),
            ("threads12", dict(HOST_COPY_THREADS=12)),
            ("chunk8", dict(STAGE_CHUNK=8 << 20)),
            ("chunk16_ring8", dict(STAGE_CHUNK=16 << 20, STAGE_RING=8)),
            (
                "chunk8_threads12_plain",
                dict(STAGE_CHUNK=8 << 20, HOST_COPY_THREADS=12, streaming=False),
            ),
        ]
        saved = {k: getattr(cb, k) for k in ("STAGE_RING", "HOST_COPY_THREADS", "STAGE_CHUNK")}
        orig_memmove = cb._HostCopier.memmove
        for rnd in range(2):
            for name, cfg in configs:
                cfg = dict(cfg)
                streaming = cfg.pop("streaming", True)
                for k, v in cfg.items():
                    setattr(cb, k, v)
                if "STAGE_CHUNK" in cfg or (rnd == 0 and name == "default"):
                    flush_pool(backend)
                if not streaming:
                    cb._HostCopier.memmove = lambda self, d, s, nb, keep, streaming=False: (
                        orig_memmove(self, d, s, nb, keep, False)
                    )
                q = dev.new_queue()
                times = await seconds_each(lambda q=q: q.copy(b, host), 3)
                out.setdefault(name, []).append(n / min(times) / 1e9)
                st = q._native.stats()
                out.setdefault(name + "_stats", st)
                cb._HostCopier.memmove = orig_memmove
                for k, v in saved.items():
                    setattr(cb, k, v)
                if "STAGE_CHUNK" in cfg:
                    flush_pool(backend)
                print(name, round(out[name][-1], 1), st, flush=True)
        back = await b.read()
        out["correct"] = bool(np.array_equal(back, host))
    print(out["correct"])
    return out


result = asyncio.run(main())
with open(os.environ.get("OUT", "/tmp") + "/h2d.json", "w") as f:
    json.dump(result, f, indent=1)

"""Diagnostic: what pinning a pageable numpy array in place costs (cuMemHostRegister), and
the copy from it -- a possible route past staging's host-memcpy bound for pageable H2D.

    PYTHONPATH=. python benchmarks/diagnostics/host_register.py  (OUT=dir for register.json)

1 GiB arrays, freshly made each round: register, a 1 GiB cuMemcpyHtoDAsync from the
registered array, unregister; against the raw copy from cuMemHostAlloc memory. Ran as run
50 (results/h200/host_register-run50.json).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from asyncmetal.backends.cuda import check, cu


def main() -> dict[str, object]:
    n = 1 << 30
    check(cu.cuInit(0), "cuInit")
    device = check(cu.cuDeviceGet(0), "cuDeviceGet")
    context = check(cu.cuDevicePrimaryCtxRetain(device), "retain")
    check(cu.cuCtxSetCurrent(context), "current")
    stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "stream")
    dst = check(cu.cuMemAlloc(n), "alloc")
    pinned = int(check(cu.cuMemHostAlloc(n, 0), "hostalloc"))
    rows: dict[str, list[float]] = {"register_ms": [], "copy_ms": [], "unregister_ms": []}
    rows["raw_pinned_copy_ms"] = []
    for _ in range(4):
        host = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
        t0 = time.perf_counter()
        check(cu.cuMemHostRegister(host.ctypes.data, n, 0), "cuMemHostRegister")
        t1 = time.perf_counter()
        check(cu.cuMemcpyHtoDAsync(dst, host.ctypes.data, n, stream), "h2d")
        check(cu.cuStreamSynchronize(stream), "sync")
        t2 = time.perf_counter()
        check(cu.cuMemHostUnregister(host.ctypes.data), "cuMemHostUnregister")
        t3 = time.perf_counter()
        check(cu.cuMemcpyHtoDAsync(dst, pinned, n, stream), "h2d")
        check(cu.cuStreamSynchronize(stream), "sync")
        t4 = time.perf_counter()
        for key, seconds in zip(rows, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            rows[key].append(seconds * 1e3)
        print({k: round(v[-1], 2) for k, v in rows.items()}, flush=True)
    return {"bytes": n, **rows}


result = main()
with open(os.environ.get("OUT", "/tmp") + "/register.json", "w") as f:
    json.dump(result, f, indent=1)

"""Diagnostic: does where host memory and host-copy threads sit (NUMA nodes) set pageable
H2D speed? Pageable H2D has been slower on the two-GPU machine (runs 51, 52, 56: 0.46-0.72
of raw) than on the one-GPU machine (runs 53-59: 0.79-0.84).

    PYTHONPATH=. python benchmarks/diagnostics/h2d_numa.py  (OUT=dir for h2d_numa.json)

Records the topology (lscpu, ``nvidia-smi topo -m``, each GPU's PCI NUMA node and CUDA's
host NUMA id). Then per GPU: raw pinned cuMemcpyHtoDAsync of 1 GiB from pinned memory
made on each node; and asyncmetal's 1 GiB pageable copy for each (source array's node,
host-copy threads' and chunks' node), on a fresh queue with fresh chunks each, three
copies each. Memory goes where it is first touched; threads inherit the affinity of
the thread that starts them, so the main thread's affinity places all of it. Where
each buffer's pages really are is read back with move_pages(2).

Ran as run 60 on two H200s (results/h200/h2d_numa-run60-x2.json; lscpu and
``nvidia-smi topo -m`` in topo-run60-x2.txt): one NUMA node.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import statistics
import subprocess
import sys
from typing import Any

import numpy as np

sys.path.insert(0, "benchmarks")
from _common import raw_h2d_seconds, seconds_each
from cuda.bindings import driver as cu

import asyncmetal as am
from asyncmetal.backends import cuda as cb

N = 1 << 30
libc = ctypes.CDLL(None, use_errno=True)
SYS_MOVE_PAGES = 279  # x86_64


def nodes() -> dict[int, set[int]]:
    out = {}
    base = "/sys/devices/system/node"
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        if name.startswith("node") and name[4:].isdigit():
            cpus: set[int] = set()
            for part in open(f"{base}/{name}/cpulist").read().strip().split(","):
                lo, _, hi = part.partition("-")
                cpus.update(range(int(lo), int(hi or lo) + 1))
            out[int(name[4:])] = cpus & os.sched_getaffinity(0)
    return out or {0: os.sched_getaffinity(0)}


def page_nodes(address: int, nbytes: int, samples: int = 64) -> dict[int, int]:
    """How many of ``samples`` pages spread over the buffer sit on each node."""
    pages = (ctypes.c_void_p * samples)(
        *[(address + i * (nbytes // samples)) & ~4095 for i in range(samples)]
    )
    status = (ctypes.c_int * samples)()
    if libc.syscall(SYS_MOVE_PAGES, 0, samples, pages, None, status, 0) != 0:
        return {-ctypes.get_errno(): samples}
    counts: dict[int, int] = {}
    for s in status:
        counts[s] = counts.get(s, 0) + 1
    return counts


def run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except Exception as e:  # a missing tool is part of the answer
        return repr(e)


def topology(gpus: int) -> dict[str, Any]:
    out: dict[str, Any] = {"lscpu": run(["lscpu"]), "topo": run(["nvidia-smi", "topo", "-m"])}
    cb.check(cu.cuInit(0), "cuInit")
    for i in range(gpus):
        dev = cb.check(cu.cuDeviceGet(i), "cuDeviceGet")
        bus = cb.check(cu.cuDeviceGetPCIBusId(32, dev), "bus").split(b"\0")[0].decode().lower()
        path = f"/sys/bus/pci/devices/{bus}/numa_node"
        out[f"gpu{i}_pci"] = bus
        out[f"gpu{i}_sysfs_numa_node"] = open(path).read().strip() if os.path.exists(path) else None
        attr = getattr(cu.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID", None)
        out[f"gpu{i}_host_numa_id"] = (
            None if attr is None else cb.check(cu.cuDeviceGetAttribute(attr, dev), "attr")
        )
    out["thp"] = run(["cat", "/sys/kernel/mm/transparent_hugepage/enabled"]).strip()
    return out


async def on_gpu(index: int, where: dict[int, set[int]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    everywhere = set().union(*where.values())
    async with am.open_device(f"cuda:{index}") as dev:
        backend = dev._backend
        buf = await dev.alloc(N)
        stream = dev.queue._native.stream  # type: ignore[attr-defined]
        for node, cpus in where.items():  # raw pinned DMA from each node's memory
            os.sched_setaffinity(0, cpus)
            backend.make_current()
            pinned = int(cb.check(cu.cuMemHostAlloc(N, 0), "cuMemHostAlloc"))
            ctypes.memset(pinned, 1, N)
            times = raw_h2d_seconds(buf._allocation.handle, pinned, N, stream, 3)
            out[f"raw_from_node{node}"] = {
                "pages": page_nodes(pinned, N),
                "gbps": [N / t / 1e9 for t in times],
            }
            cu.cuMemFreeHost(pinned)
        sources = {}
        for node, cpus in where.items():
            os.sched_setaffinity(0, cpus)
            sources[node] = np.empty(N, np.uint8)
            sources[node].fill(node + 3)
        for rnd in range(2):
            for tnode, cpus in where.items():
                for snode, src in sources.items():
                    os.sched_setaffinity(0, cpus)
                    for old in backend._chunks:  # fresh chunks, made under this affinity
                        old.free()
                    backend._chunks = []
                    q = dev.new_queue()
                    await q.copy(buf, src[: 64 << 20], 64 << 20)
                    times = await seconds_each(lambda q=q, src=src: q.copy(buf, src), 3)
                    chunk = q._native._staging._ring[0][0]  # type: ignore[attr-defined]
                    key = f"threads_node{tnode}_source_node{snode}"
                    entry = out.setdefault(key, {"gbps": []})
                    entry["gbps"] += [N / t / 1e9 for t in times]
                    entry["source_pages"] = page_nodes(src.ctypes.data, N)
                    entry["chunk_pages"] = page_nodes(chunk.address, chunk.nbytes, 16)
                    q._native.close()  # type: ignore[attr-defined]
                    os.sched_setaffinity(0, everywhere)
                    print(index, rnd, key, [round(g, 1) for g in entry["gbps"][-3:]], flush=True)
        for entry in out.values():
            entry["median_gbps"] = statistics.median(entry["gbps"])
    return out


async def main() -> dict[str, Any]:
    cb.check(cu.cuInit(0), "cuInit")
    gpus = cb.check(cu.cuDeviceGetCount(), "count")
    where = nodes()
    result: dict[str, Any] = {
        "nodes": {k: sorted(v) for k, v in where.items()},
        **topology(gpus),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "lscpu"}, indent=1), flush=True)
    for i in range(gpus):
        result[f"gpu{i}"] = await on_gpu(i, where)
    return result


result = asyncio.run(main())
with open(os.environ.get("OUT", "/tmp") + "/h2d_numa.json", "w") as f:
    json.dump(result, f, indent=1)

"""The compile pool against serial compilation, cache hits, and compile/run overlap.

    python benchmarks/compile.py [--workers N] [--kernels N] [--json out.json]

Side by side in one process and one run:
  * N distinct C kernels: the pool with --workers workers against compiling them one by
    one in this process (target on the 2-core machine, 2 workers: >= 1.7x);
  * cache hits per kernel, median: in memory (<= 20 us) and on disk (<= 2 ms);
  * a pipeline where compiling a kernel takes about as long as running it:
    ``compile_many`` overlapped with execution against compile-all-then-run-all
    (>= 1.6x), with a one-worker pool so both sides have the same compile capacity.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import anyio
from _common import pool_vs_serial, write_json

import asyncmetal as am
from asyncmetal._cache import CompileCache
from asyncmetal._compile import source_key
from asyncmetal._pool import CompilePool, compiler_identity
from asyncmetal.backends.cpu import CCompiler


def kernel(i: int, tag: str) -> str:
    # Distinct sources with some real work for the optimiser.
    return f"""
/* {tag} {i} */
void k{abs(i)}(float* x, int n, int iters) {{
    for (int r = 0; r < iters; r++)
        for (int j = 0; j < n; j++) x[j] = x[j] * 0.999f + (float)({i} + r + j) * 1e-6f;
}}
"""


async def parallel_vs_serial(workers: int, n: int, tag: str) -> dict[str, Any]:
    return await pool_vs_serial(
        CCompiler(),
        [kernel(i, f"{tag}-serial") for i in range(n)],
        [kernel(i, f"{tag}-pool") for i in range(n)],
        workers,
    )


async def cache_hits(tag: str, n: int = 200) -> dict[str, Any]:
    compiler = CCompiler()
    with tempfile.TemporaryDirectory() as tmp:
        pool = CompilePool(1, cache=CompileCache(tmp))
        try:
            sources = [kernel(i, f"{tag}-cache") for i in range(20)]
            for src in sources:
                await pool.compile(compiler, src)
            memory = []
            for i in range(n):
                src = sources[i % len(sources)]
                t0 = time.perf_counter_ns()
                await pool.compile(compiler, src)
                memory.append(time.perf_counter_ns() - t0)
            disk = []
            for i in range(n):
                pool.cache._clear_memory()
                src = sources[i % len(sources)]
                t0 = time.perf_counter_ns()
                await pool.compile(compiler, src)
                disk.append(time.perf_counter_ns() - t0)
            assert pool.cache.hits_disk == n
        finally:
            await pool.aclose()
    return {"memory_us": statistics.median(memory) / 1e3, "disk_us": statistics.median(disk) / 1e3}


async def overlap(n: int, tag: str) -> dict[str, Any]:
    async with am.open_device("cpu") as dev:
        dev.compile_pool = pool = CompilePool(1, cache=CompileCache(disk=False))
        try:
            # Calibrate: how long does one compile take, and how many iterations make a
            # run of about that length?
            probe = await dev.compile(kernel(0, f"{tag}-probe"), "k0")  # warms the worker
            samples = []
            for i in range(1, 4):
                t0 = time.perf_counter()
                await dev.compile(kernel(i, f"{tag}-probe"), f"k{i}")
                samples.append(time.perf_counter() - t0)
            compile_s = statistics.median(samples)
            buf = await dev.alloc(4 * 4096)
            timed = dev.queue.launch(probe, buf, vals=(4096, 2000))
            await timed
            per_iter = (timed.end_time - timed.start_time) / 2000  # type: ignore[operator]
            iters = max(1, int(compile_s / per_iter))
            run_s = []

            async def run(prog: am.Program) -> None:
                done = dev.queue.launch(prog, buf, vals=(4096, iters))
                await done
                run_s.append(done.end_time - done.start_time)  # type: ignore[operator]

            def batch(label: str) -> list[tuple[str, str]]:
                return [(kernel(i, f"{tag}-{label}"), f"k{i}") for i in range(n)]

            t0 = time.perf_counter()  # compile everything, then run everything
            programs = [await dev.compile(src, name) for src, name in batch("serial")]
            for prog in programs:
                await run(prog)
            serial = time.perf_counter() - t0

            t0 = time.perf_counter()  # run each as soon as it is compiled
            async with anyio.create_task_group() as tg:
                async for prog in dev.compile_many(batch("overlap")):
                    tg.start_soon(run, prog)
            overlapped = time.perf_counter() - t0
        finally:
            await pool.aclose()
    return {
        "kernels": n,
        "compile_ms": compile_s * 1e3,
        "run_ms": statistics.median(run_s) * 1e3,
        "serial_s": serial,
        "overlapped_s": overlapped,
        "speedup": serial / overlapped,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    tag = str(time.time_ns())  # fresh sources: nothing from an earlier run is cached
    identity = await compiler_identity(CCompiler())
    assert source_key(identity, "x")
    return {
        "parallel": await parallel_vs_serial(args.workers, args.kernels, tag),
        "cache": await cache_hits(tag),
        "overlap": await overlap(args.overlap_kernels, tag),
    }


def report(r: dict[str, Any]) -> None:
    p, c, o = r["parallel"], r["cache"], r["overlap"]
    print(
        f"{p['kernels']} kernels: serial in-process {p['serial_s']:.2f} s, pool of "
        f"{p['workers']} {p['pool_s']:.2f} s -> {p['speedup']:.2f}x"
    )
    print(
        f"cache hit, median: memory {c['memory_us']:.1f} us (<= 20), "
        f"disk {c['disk_us']:.0f} us (<= 2000)"
    )
    print(
        f"overlap, {o['kernels']} kernels (compile {o['compile_ms']:.0f} ms, run "
        f"{o['run_ms']:.0f} ms each): compile-all-then-run-all {o['serial_s']:.2f} s, "
        f"compile_many overlapped {o['overlapped_s']:.2f} s -> {o['speedup']:.2f}x (>= 1.6)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kernels", type=int, default=64)
    parser.add_argument("--overlap-kernels", type=int, default=16)
    parser.add_argument("--json")
    args = parser.parse_args()
    result = anyio.run(main, args)
    report(result)
    write_json(args.json, result)

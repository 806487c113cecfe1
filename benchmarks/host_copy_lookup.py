"""What a cpu queue's host copy costs to submit while host memory is lent out or wrapped.

    python benchmarks/host_copy_lookup.py [--json out.json]

A host copy (``queue.copy(buf, array)``, ``queue.copy(array, buf)``) looks its host
operand's address up among the memory buffers lent out (a DLPack export) or wrap
(``am.from_dlpack`` of another library's array) whenever any is alive: the copy is then
ordered as a use of that buffer. Three cases, each timed alone: (a) nothing lent out
nor wrapped (no look-up), (b) one ``am.from_dlpack(numpy array)`` alive, (c) one buffer's
DLPack export alive -- the operand itself another array in (b) and (c), so that the
look-up finds nothing; then (d) 5,000 imports of small arrays and one of a 256 MiB array
alive, (e) 5,000 exports alive (a service keeping what it exchanged). Each round
submits ``BATCH`` copies in and ``BATCH`` out (64 bytes) and then awaits the last; the
per-copy submission time is the round's time over its copies, and the figure is the
median of ``ROUNDS`` rounds. ``copy_operands``' own
share (the check and the look-up, without the submission) is timed the same way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import anyio
import numpy as np
from _common import write_json

import asyncmetal as am
from asyncmetal._copyargs import copy_operands

BATCH = 500
ROUNDS = 31
NBYTES = 64
CROWD = 5000


async def submit_us(q: am.Queue, buf: am.Buffer, host: Any, back: Any) -> float:
    """Median over rounds of one copy's submission, in µs."""
    per_copy = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(BATCH):
            q.copy(buf, host)
            last = q.copy(back, buf)
        t1 = time.perf_counter()
        await last
        per_copy.append((t1 - t0) / (2 * BATCH) * 1e6)
    return statistics.median(per_copy)


def operands_us(q: am.Queue, buf: am.Buffer, host: Any, back: Any) -> float:
    """Median over rounds of one copy's ``copy_operands``, in µs."""
    state = q._state
    per_copy = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(BATCH):
            copy_operands(state, buf, host, None)
            copy_operands(state, back, buf, None)
        per_copy.append((time.perf_counter() - t0) / (2 * BATCH) * 1e6)
    return statistics.median(per_copy)


async def case(name: str) -> dict[str, float]:
    """One case on a device of its own (so that nothing of another case is alive)."""
    async with am.open_device("cpu") as dev:
        q = dev.new_queue()
        buf = await dev.alloc(NBYTES)
        host = np.arange(NBYTES, dtype=np.uint8)
        back = np.zeros(NBYTES, np.uint8)
        await q.copy(buf, host)  # (the first copy's one-time setup)
        kept: list[Any] = []
        if name == "import":
            kept.append(am.from_dlpack(np.ones(NBYTES, np.uint8), device=dev))
        elif name == "export":
            lender = await dev.alloc(NBYTES)
            kept += [lender, np.from_dlpack(lender.typed(np.uint8))]
        elif name == "imports_5000":
            arrays = [
                np.zeros(1 << 28, np.uint8),
                *(np.ones(NBYTES, np.uint8) for _ in range(CROWD)),
            ]
            kept += [am.from_dlpack(a, device=dev) for a in arrays]
        elif name == "exports_5000":
            lenders = [await dev.alloc(NBYTES) for _ in range(CROWD)]
            kept += [*lenders, *(np.from_dlpack(b.typed(np.uint8)) for b in lenders)]
        result = {
            "submit_us": await submit_us(q, buf, host, back),
            "copy_operands_us": operands_us(q, buf, host, back),
        }
        if not np.array_equal(back, host):
            raise SystemExit(f"{name}: the copies did not move the bytes")
        print(
            f"{name:12} submit {result['submit_us']:.2f} µs/copy, "
            f"copy_operands {result['copy_operands_us']:.2f} µs",
            flush=True,
        )
        del kept
        return result


async def main() -> dict[str, Any]:
    names = ("none", "import", "export", "imports_5000", "exports_5000")
    return {name: await case(name) for name in names}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    out = anyio.run(main)
    if args.json:
        write_json(args.json, {"host_copy_lookup": out})
    sys.exit(0)

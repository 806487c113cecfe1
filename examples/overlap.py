"""Compile and execute overlapped: run each kernel as soon as the pool has compiled it.

python examples/overlap.py
"""

import time

import anyio
import numpy as np

import asyncmetal as am


def kernel(i: int) -> str:
    # Stage i adds i + 1: the stages run in the order they finish compiling, which
    # varies, and the sum (36) does not depend on it.
    return f"""
void stage{i}(float* x, int n) {{
    for (int j = 0; j < n; j++) x[j] += {i + 1}.0f;
}}
"""


async def main() -> None:
    async with am.open_device("cpu") as dev:
        n = 1 << 20
        buf = await dev.alloc(4 * n)
        await buf.write(np.zeros(n, np.float32))
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            # Each program arrives as soon as a worker has compiled it; the device runs it
            # while the pool compiles the rest.
            async for prog in dev.compile_many([(kernel(i), f"stage{i}") for i in range(8)]):
                print(
                    f"{1e3 * (time.perf_counter() - t0):7.1f} ms  {prog.name} compiled; launching"
                )
                tg.start_soon(dev.queue.launch(prog, buf, vals=(n,)).wait)
        x = await buf.read(np.float32)
        print(f"{1e3 * (time.perf_counter() - t0):7.1f} ms  all done; x[0] = {x[0]:.1f}")


anyio.run(main)

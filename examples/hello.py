"""The smallest complete asyncmetal program: compile, copy in, launch, await, copy out."""

import anyio
import numpy as np

import asyncmetal as am

SRC = """
void add(float* out, const float* a, const float* b, int n) {
    for (int i = 0; i < n; i++) out[i] = a[i] + b[i];
}
"""


async def main() -> None:
    async with am.open_device("cpu") as dev:
        add = await dev.compile(SRC, "add")
        n = 1024
        a, b, out = [await dev.alloc(4 * n) for _ in range(3)]
        await a.write(np.arange(n, dtype=np.float32))
        await b.write(np.ones(n, dtype=np.float32))
        await dev.queue.launch(add, out, a, b, vals=(n,))
        print((await out.read(np.float32))[:8])  # [1. 2. 3. 4. 5. 6. 7. 8.]


anyio.run(main)

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator

import pytest

# Keep the tests' compile cache out of the user's cache directory.
os.environ.setdefault("ASYNCMETAL_CACHE_DIR", tempfile.mkdtemp(prefix="asyncmetal-test-cache-"))

import asyncmetal as am

# Kernels used across the tests: C for the cpu device.
KERNELS = r"""
void empty(void) {}
void add(float* out, const float* a, const float* b, int n) {
    for (int i = 0; i < n; i++) out[i] = a[i] + b[i];
}
void fill(int* out, int value, int n) { for (int i = 0; i < n; i++) out[i] = value; }
/* out[dst] = out[dst] * 31 + out[src] + val: order-sensitive, so a race shows */
void step(int* cells, int dst, int src, int val) {
    cells[dst] = cells[dst] * 31 + cells[src] + val;
}
void spin(int* out, int iters) {
    volatile int x = 0;
    for (int i = 0; i < iters; i++) x += i;
    out[0] += 1;
}
#include <time.h>
void sleep_ms(int ms) {
    struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };
    nanosleep(&ts, 0);
}
"""


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {"debug": True}), id="asyncio"),
        pytest.param(("trio", {}), id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
async def device(anyio_backend: object) -> AsyncIterator[am.Device]:
    async with am.open_device("cpu") as dev:
        yield dev


@pytest.fixture
async def kernels(device: am.Device) -> dict[str, am.Program]:
    names = ["empty", "add", "fill", "step", "spin", "sleep_ms"]
    return {name: await device.compile(KERNELS, name) for name in names}

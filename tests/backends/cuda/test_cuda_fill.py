"""Queue.fill and alloc(zeroed=True) on an NVIDIA GPU (`pytest -m cuda`): cuMemsetD8/D16/
D32Async on the queue's stream; skipped where there is no GPU."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

import asyncmetal as am

GPUS = [d for d in am.devices() if d.startswith("cuda:")]
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.anyio,
    pytest.mark.skipif(not GPUS, reason="no NVIDIA GPU with cuda-bindings on this machine"),
]

KERNELS = r"""
extern "C" __global__ void mix(unsigned char* x, int n, int k) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = (unsigned char)(x[i] * 31 + k + i);
}
extern "C" __global__ void sleep_us(int us) {
    long long start = clock64();
    long long cycles = (long long)us * 1800;  // ~1.8 GHz
    while (clock64() - start < cycles) {}
}
"""


def _mixed(x: np.ndarray, k: int) -> np.ndarray:
    return ((x.astype(np.int64) * 31 + k + np.arange(len(x))) % 256).astype(np.uint8)


@pytest.mark.parametrize(
    "value",
    [0, 0xAB, np.uint16(0x0102), np.float16(-1.5), np.uint32(0xDEADBEEF), np.float32(3.25)],
    ids=["zero", "byte", "uint16", "float16", "uint32", "float32"],
)
async def test_fill_patterns_on_cuda(anyio_backend: object, value: object) -> None:
    """Each pattern size (cuMemsetD8/D16/D32Async), over a whole buffer of 64 MiB and a
    range inside a numbered one (the bytes around it untouched), and through a view."""
    async with am.open_device("cuda:0") as dev:
        item = np.array(value, np.uint8 if isinstance(value, int) else type(value))
        size, bits = item.nbytes, np.frombuffer(item.tobytes(), np.uint8)
        big = await dev.alloc(64 << 20)
        await dev.queue.fill(big, value)
        got = await big.read(item.dtype)
        assert (got.view(np.uint8).reshape(-1, size) == bits).all()

        data = (np.arange(4096) % 251 + 1).astype(np.uint8)
        buf = await dev.alloc(4096)
        await buf.write(data)
        await dev.queue.fill(buf, value, offset=8 * size, size=100 * size)
        await dev.queue.fill(buf.view(2048, 1024), value, offset=4 * size, size=size)
        expected = data.copy()
        expected[8 * size : 108 * size] = np.frombuffer(item.tobytes() * 100, np.uint8)
        expected[2048 + 4 * size : 2048 + 5 * size] = bits
        np.testing.assert_array_equal(await buf.read(), expected)


async def test_fills_and_kernels_on_streams_keep_their_order(anyio_backend: object) -> None:
    """Fills between kernels on one stream, past the bound on commands in flight (held on
    the host, handed over by the completion thread), and a read on another queue that
    orders itself after the last fill: every byte as if run in submission order."""
    async with am.open_device("cuda:0") as dev:
        mix = await dev.compile(KERNELS, "mix")
        sleep_us = await dev.compile(KERNELS, "sleep_us")
        n = 1 << 16
        buf = await dev.alloc(n, zeroed=True)
        q = dev.new_queue()
        expected = np.zeros(n, np.uint8)
        q.launch(sleep_us, vals=(2000,))  # what follows is held behind it
        for k in range(200):
            if k % 3 == 0:
                lo, hi = (k * 97) % (n // 2), (k * 97) % (n // 2) + n // 4
                q.fill(buf, np.uint32(k * 0x01010101), offset=lo & ~3, size=(hi - lo) & ~3)
                expected[lo & ~3 : (lo & ~3) + ((hi - lo) & ~3)] = k
            else:
                q.launch(mix, buf, vals=(n, k), global_size=n, local_size=256)
                expected = _mixed(expected, k)
        q.fill(buf, 0x5A, offset=n - 3, size=3)
        expected[n - 3 :] = 0x5A
        out = np.empty(n, np.uint8)
        await dev.queue.copy(out, buf)  # on another queue: ordered after q's last use
        np.testing.assert_array_equal(out, expected)
        await q.close()


async def test_zeroed_alloc_on_cuda_zeroes_a_cached_block(anyio_backend: object) -> None:
    async with am.open_device("cuda:0") as dev:
        buf = await dev.alloc(1 << 20)
        await buf.write(np.full(1 << 20, 0xFF, np.uint8))
        await buf.free()
        zeroed = await dev.alloc((1 << 20) - 4, zeroed=True)
        assert dev.memory_statistics().cached == 0  # the same block, from the cache
        assert not zeroed.busy()
        async with dev.new_queue() as q2:
            out = np.ones((1 << 20) - 4, np.uint8)
            await q2.copy(out, zeroed)
        assert not out.any()


async def test_a_cancelled_zeroed_alloc_frees_its_block_on_cuda(anyio_backend: object) -> None:
    async with am.open_device("cuda:0") as dev:
        sleep_us = await dev.compile(KERNELS, "sleep_us")
        dev.queue.launch(sleep_us, vals=(200_000,))
        with anyio.move_on_after(0.02) as scope:
            await dev.alloc(1 << 20, zeroed=True)
        assert scope.cancelled_caught
        await dev.queue.synchronize()
        assert dev.memory_statistics().in_use == 0

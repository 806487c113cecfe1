"""The metal backend. The parts that need no Apple hardware run everywhere; the rest is
marked `metal` and runs only on macOS with a Metal device (it has never run: no macOS
machine is available to this project)."""

from __future__ import annotations

import pickle
import struct
import sys

import numpy as np
import pytest

import asyncmetal as am
from asyncmetal.backends.metal import (
    MetalCompiler,
    codegen_library,
    codegen_request,
    metal_params,
)

KERNELS = """
#include <metal_stdlib>
using namespace metal;
kernel void add(device float* out [[buffer(0)]], const device float* a [[buffer(1)]],
                const device float* b [[buffer(2)]], constant int& n [[buffer(3)]],
                uint i [[thread_position_in_grid]]) {
    if ((int)i < n) out[i] = a[i] + b[i];
}
kernel void fill(device int* out [[buffer(0)]], constant int& value [[buffer(1)]],
                 uint i [[thread_position_in_grid]]) { out[i] = value; }
"""


def test_metal_params_follow_buffer_indices() -> None:
    assert metal_params(KERNELS, "add") == ("buffer", "buffer", "buffer", "value")
    assert metal_params(KERNELS, "fill") == ("buffer", "value")
    with pytest.raises(am.CompileError, match="not defined"):
        metal_params(KERNELS, "missing")


def test_metal_compiler_pickles_as_configuration() -> None:
    compiler = MetalCompiler("xcrun", ("-O3",))
    data = pickle.dumps(compiler)
    assert len(data) < 200
    assert pickle.loads(data) == compiler
    assert compiler.__reduce__() == (MetalCompiler, ("xcrun", ("-O3",)))
    assert pickle.loads(pickle.dumps(MetalCompiler())) != compiler


def test_compiler_service_request_layout() -> None:
    """tinygrad's request: two little-endian lengths, the source padded with at least
    one NUL to a multiple of 4, the options NUL-terminated."""
    for src in ("", "a", "abc", "abcd", KERNELS):
        request = codegen_request(src, "-x metal")
        n_src, n_opt = struct.unpack("<QQ", request[:16])
        assert n_src % 4 == 0 and n_src > len(src.encode())
        assert request[16 : 16 + len(src)] == src.encode()
        assert set(request[16 + len(src) : 16 + n_src]) == {0}
        assert request[16 + n_src :] == b"-x metal\0"
        assert len(request) == 16 + n_src + n_opt
    with pytest.raises(am.CompileError, match="no Metal library"):
        codegen_library(b"\0" * 8 + struct.pack("<LL", 16, 0) + b"garbage")
    assert codegen_library(b"\0" * 8 + struct.pack("<LL", 16, 0) + b"MTLBxENDT") == b"MTLBxENDT"


@pytest.mark.skipif(sys.platform == "darwin", reason="off macOS only")
def test_compiler_service_is_missing_off_macos() -> None:
    with pytest.raises(am.CompileError, match="not available here"):
        MetalCompiler().compile(KERNELS)


GPU = "metal" in am.devices()


@pytest.mark.parametrize("n", [1000])
@pytest.mark.metal
@pytest.mark.anyio
@pytest.mark.skipif(not GPU, reason="needs macOS with a Metal device")
async def test_launch_timelines_and_copies(anyio_backend: object, n: int) -> None:
    async with am.open_device("metal") as dev:
        add = await dev.compile(KERNELS, "add")
        a, b, out = [await dev.alloc(4 * n) for _ in range(3)]
        await a.write(np.arange(n, dtype=np.float32))
        await b.write(np.ones(n, np.float32))
        tl = dev.timeline()
        q = dev.new_queue()
        q.wait(tl, 1)  # before anyone signals
        done = q.launch(add, out, a, b, vals=(n,), global_size=n, local_size=64)
        tl.signal(1)
        await done
        np.testing.assert_array_equal(await out.read(np.float32), np.arange(n) + 1)
        view = await out.map(np.float32)  # shared storage: zero-copy
        assert view[5] == 6
        with pytest.raises(am.CompileError):
            await dev.compile("kernel void k() { nope; }", "k")


@pytest.mark.metal
@pytest.mark.skipif(not GPU, reason="needs macOS with a Metal device")
def test_metal_compiler_compiles_the_same_bytes_after_pickling() -> None:
    compiler = MetalCompiler()
    assert pickle.loads(pickle.dumps(compiler)).compile(KERNELS) == compiler.compile(KERNELS)

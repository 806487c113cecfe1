"""The cuda:N backend, on an NVIDIA GPU (`pytest -m cuda`); skipped where none is."""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal._scalars import host_types
from tests.support.interrupts import check_queue_making_interrupted
from tests.support.launch_paths import PATHS, select_launch_path
from tests.support.queues import (
    check_buffers_usable,
    close_failing_with_a_wait,
    copies_done_before_awaited,
    discard_outcomes,
    fail_default_queue_for_good,
    held_queue,
)
from tests.support.stress import interleavings, park_all

GPUS = [d for d in am.devices() if d.startswith("cuda:")]
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.anyio,
    pytest.mark.skipif(not GPUS, reason="no NVIDIA GPU with cuda-bindings on this machine"),
]
two_gpus = pytest.mark.skipif(len(GPUS) < 2, reason="needs two NVIDIA GPUs")

KERNELS = r"""
extern "C" __global__ void add(float* out, const float* a, const float* b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}
extern "C" __global__ void fill(int* out, int value, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}
extern "C" __global__ void mix(unsigned char* x, int n, int k) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = (unsigned char)(x[i] * 31 + k + i);
}
extern "C" __global__ void empty() {}
extern "C" __global__ void sleep_us(int us) {
    long long start = clock64();
    long long cycles = (long long)us * 1800;  // ~1.8 GHz
    while (clock64() - start < cycles) {}
}
extern "C" __global__ void fault(int* p) { *(int*)0x10 = 1; p[0] = 1; }
extern "C" __global__ void held(int* flag, int us) {
    // Runs until flag[0] is set (by another stream), or for about `us` microseconds at
    // most; flag[1] says which ended it: 1 the flag, 2 the time.
    volatile int* f = flag;
    long long start = clock64();
    long long cycles = (long long)us * 1800;  // ~1.8 GHz
    while (!f[0]) {
        if (clock64() - start > cycles) {
            f[1] = 2;
            return;
        }
    }
    f[1] = 1;
}
"""
MIX_LAUNCH = {"global_size": 512, "local_size": 128}


async def test_launch_computes(anyio_backend: object) -> None:
    async with am.open_device("cuda:0") as dev:
        assert dev.kind == "cuda"
        add = await dev.compile(KERNELS, "add")
        n = 100_000
        a, b, out = [await dev.alloc(4 * n) for _ in range(3)]
        await a.write(np.arange(n, dtype=np.float32))
        await b.write(np.full(n, 2, np.float32))
        await dev.queue.launch(add, out, a, b, vals=(n,), global_size=n, local_size=256)
        np.testing.assert_array_equal(await out.read(np.float32), np.arange(n) + 2)


async def test_compile_options_reach_nvrtc(anyio_backend: object) -> None:
    """A macro given as a compile option (NVRTC's ``-D``); another value is another
    program; the source does not compile without it."""
    src = 'extern "C" __global__ void put(int* out) { out[0] = VALUE; }'
    async with am.open_device("cuda:0") as dev:
        out = await dev.alloc(4)
        for value in (7, 9):
            prog = await dev.compile(src, "put", options=(f"-DVALUE={value}",))
            await dev.queue.launch(prog, out)
            assert (await out.read(np.int32))[0] == value
        with pytest.raises(am.CompileError):
            await dev.compile(src, "put")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.usefixtures("unreaped")
async def test_launch_paths_give_the_same_results(anyio_backend: object, path: str) -> None:
    """The extension module's launch (native/py_module.c) and the ctypes one it replaces:
    buffers at offsets, int32 values at both ends, sizes, every element checked."""
    async with am.open_device("cuda:0") as dev:
        fill = await dev.compile(KERNELS, "fill")
        queue = dev.new_queue()
        select_launch_path(queue, path, "_fast_launch")
        n = 10_000
        out = await dev.alloc(4 * n)
        for value in (-(1 << 31), -1, 0, 7, (1 << 31) - 1):
            await queue.copy(out, np.full(n, 99, np.int32))
            queue.launch(fill, out.view(8), vals=(value, n - 2), global_size=n - 2, local_size=128)
            got = np.empty(n, np.int32)
            await queue.copy(got, out)
            assert (got[:2] == 99).all() and (got[2:] == value).all(), value


VALUES = r"""
extern "C" __global__ void put(float f, unsigned char* out, double d, long long big,
                               unsigned int u, unsigned char* more, float g, int n, short s,
                               unsigned char c) {
    if (blockIdx.x * blockDim.x + threadIdx.x != 0) return;
    *(float*)(out) = f; *(double*)(out + 8) = d; *(long long*)(out + 16) = big;
    *(unsigned int*)(out + 24) = u; *(float*)(more) = g; *(int*)(more + 4) = n;
    *(short*)(more + 8) = s; more[10] = c;
}
extern "C" __global__ void ints(unsigned char* out, long long a, unsigned int b, short c,
                                unsigned long long d) {
    *(long long*)(out) = a; *(unsigned int*)(out + 8) = b; *(short*)(out + 12) = c;
    *(unsigned long long*)(out + 16) = d;
}
"""


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.usefixtures("unreaped")
async def test_launch_values_of_each_type_reach_the_kernel_bit_for_bit(
    anyio_backend: object, path: str
) -> None:
    """float, double, int64 and uint32 beyond int32, int16 and uint8 parameters between
    buffers, on each launch path (floats leave the native one for Python's): each value
    in its parameter slot (cuLaunchKernel copies each parameter's size from it), every
    byte written back its own; ints of other integer types on the native path too."""
    async with am.open_device("cuda:0") as dev:
        put, ints = await dev.compile(VALUES, "put"), await dev.compile(VALUES, "ints")
        queue = dev.new_queue()
        select_launch_path(queue, path, "_fast_launch")
        out, more = await dev.alloc(32), await dev.alloc(16)
        await queue.copy(out, np.zeros(32, np.uint8))
        await queue.copy(more, np.zeros(16, np.uint8))
        vals = (
            np.float32(-0.1), np.float64(np.pi), np.int64(-(1 << 40) - 3),
            np.uint32(0xFFFF_FFF0), 1e-3, -7, np.int16(-300), 200,
        )  # fmt: skip
        await queue.launch(put, out, more, vals=vals)
        got, got_more = (await out.read(np.uint8)).tobytes(), (await more.read(np.uint8)).tobytes()
        assert got[0:4] == np.float32(-0.1).tobytes()
        assert got[8:16] == np.float64(np.pi).tobytes()
        assert got[16:24] == np.int64(-(1 << 40) - 3).tobytes()
        assert got[24:28] == np.uint32(0xFFFF_FFF0).tobytes()
        expected = b"".join(
            v.tobytes() for v in (np.float32(1e-3), np.int32(-7), np.int16(-300), np.uint8(200))
        )
        assert got_more[0:11] == expected
        values = [(1 << 40) + 5, (1 << 32) - 2, -300, (1 << 64) - 1]
        await queue.launch(ints, out, vals=values)
        got = (await out.read(np.uint8)).tobytes()
        assert got[0:8] == np.int64(values[0]).tobytes()
        assert got[8:14] == np.uint32(values[1]).tobytes() + np.int16(values[2]).tobytes()
        assert got[16:24] == np.uint64(values[3]).tobytes()


CHARACTERS = r"""
template <typename T> __device__ void store(unsigned char* out, T v) { *(T*)(out) = v; }
template <typename T> __global__ void twice(T* x, T a) { x[0] = a + a; }
extern "C" __global__ void chars(unsigned char* out, char c, char16_t a, char32_t b, wchar_t w) {
    if (blockIdx.x * blockDim.x + threadIdx.x != 0) return;
    store(out, c); store(out + 2, a); store(out + 4, b); store(out + 8, w);
}
extern "C" __global__ void twice_f(float* x, float a) { twice<float>(x, a); }
"""


async def test_character_types_and_a_templates_wrapper_take_their_types(
    anyio_backend: object,
) -> None:
    """A plain char takes the host platform's signedness (on an x86-64 host: signed,
    -1 reaching the kernel as such and 200 refused), char16_t a uint16, char32_t a
    uint32, wchar_t the host's (an int on Linux x86-64); an extern "C" wrapper of a
    template kernel takes its own float, and the template itself is refused at
    compile."""
    async with am.open_device("cuda:0") as dev:
        chars = await dev.compile(CHARACTERS, "chars")
        char, wide = host_types()["char"], host_types()["wchar_t"]
        assert [t for t, _ in chars.value_types] == [char, "uint16", "uint32", wide]
        out = await dev.alloc(16)
        await dev.queue.copy(out, np.zeros(16, np.uint8))
        c = -1 if char == "int8" else 255
        await dev.queue.launch(chars, out, vals=(c, 0xFFFF, 0xFFFF_FFFF, 65))
        got = (await out.read(np.uint8)).tobytes()
        assert got[0:1] == np.array(c, char).tobytes()
        assert got[2:8] == np.uint16(0xFFFF).tobytes() + np.uint32(0xFFFF_FFFF).tobytes()
        assert got[8:12] == np.array(65, wide).tobytes()
        with pytest.raises(
            am.InvalidArgumentError, match=rf"vals\[0\] of 'chars' must fit in {char}"
        ):
            dev.queue.launch(chars, out, vals=(200 if char == "int8" else -1, 1, 2, 3))
        twice = await dev.compile(CHARACTERS, "twice_f")
        await dev.queue.launch(twice, out, vals=(1.25,))
        assert (await out.read(np.float32))[0] == 2.5
        with pytest.raises(am.CompileError, match="'twice' is a template"):
            await dev.compile(CHARACTERS, "twice")


UNKNOWN_TYPES = r"""
#if 1
#define wide_t double2
#define idx_t long long
#endif
extern "C" __global__ void takes_wide(double* x, wide_t p) { x[0] = p.x + p.y; }
extern "C" __global__ void put_idx(long long* x, idx_t v) { x[0] = v; }
extern "C" __global__ void sizes(float* x, int n, double d, bool b, char c, short s) {}
"""


async def test_parameters_the_source_does_not_type_are_checked_against_the_binary(
    anyio_backend: object,
) -> None:
    """The driver's parameter sizes (cuFuncGetParamInfo) are each type's; a parameter
    whose type is a macro defined inside an #if (not known to the source's reading) is
    refused where it is a 16-byte struct by value -- a launch would pass it 8 bytes and
    the next slot's -- and, of 8 bytes, takes a numpy int64's every bit and a Python
    int sign-extended from its slot."""
    async with am.open_device("cuda:0") as dev:
        sizes = await dev.compile(UNKNOWN_TYPES, "sizes")
        assert dev._backend.param_sizes(sizes.native) == (8, 4, 8, 1, 1, 2)
        with pytest.raises(
            am.CompileError, match="kernel 'takes_wide': parameter 'wide_t p' takes 16 bytes"
        ):
            await dev.compile(UNKNOWN_TYPES, "takes_wide")
        put = await dev.compile(UNKNOWN_TYPES, "put_idx")
        assert put.value_types == ((None, "idx_t v"),)
        out = await dev.alloc(8)
        for value in (np.int64(-(1 << 40) - 3), -5):
            await dev.queue.launch(put, out, vals=(value,))
            assert (await out.read(np.int64))[0] == value


@pytest.mark.parametrize("path", ["extension", "ctypes"])
async def test_copy_paths_give_the_same_results(anyio_backend: object, path: str) -> None:
    """Device copies through the extension module's call and through ctypes: at offsets
    on both sides, every byte checked, the bytes around the copied range untouched."""
    async with am.open_device("cuda:0") as dev:
        queue = dev.new_queue()
        ctypes_copy = queue._native._lib.am_cuq_copy  # type: ignore[attr-defined]
        select_launch_path(queue, path, "_copy", ctypes_copy)
        n = 1 << 20
        data = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8)
        src, dst = await dev.alloc(n), await dev.alloc(n)
        await queue.copy(src, data)
        await queue.copy(dst, np.zeros(n, np.uint8))
        await queue.copy(dst.view(4096), src.view(100), n - 8192)
        got = np.empty(n, np.uint8)
        await queue.copy(got, dst)
        np.testing.assert_array_equal(got[4096 : n - 4096], data[100 : 100 + n - 8192])
        assert not got[:4096].any() and not got[n - 4096 :].any()


async def test_submitting_while_a_long_kernel_is_waited_for(anyio_backend: object) -> None:
    """A completion thread blocked on a long kernel's event holds up no submission: not
    on its own stream, not on another; and the other stream's work finishes first. The
    kernel runs until the test releases it (another stream sets its flag) once all that
    was seen, or ends on its own after a minute: that it was the release that ended it shows
    everything before happened while it ran, however slow the host."""
    async with am.open_device("cuda:0") as dev:
        held = await dev.compile(KERNELS, "held")
        fill = await dev.compile(KERNELS, "fill")
        empty = await dev.compile(KERNELS, "empty")
        q, other = dev.new_queue(), dev.new_queue()
        flag = await dev.alloc(8)
        await flag.write(np.zeros(2, np.int32))
        await q.launch(empty)

        def waits() -> int:
            stats = q._native.stats()  # type: ignore[attr-defined]
            return int(stats["napping_waits"] + stats["blocking_waits"])

        before = waits()
        long = q.launch(held, flag, vals=(60_000_000,), local_size=1)  # until released
        with anyio.fail_after(30):
            while waits() == before:  # (its completion thread waits for it now)
                await anyio.sleep(0.001)
        assert not long.done()
        other.launch(empty)
        done = q.launch(empty)
        assert not long.done()  # (had a launch waited for it, it would have ended)
        await other.synchronize()
        assert not long.done()
        other.launch(fill, flag, vals=(1, 1), global_size=1, local_size=1)  # the release
        await done
        assert long.done()
        assert (await flag.read(np.int32)).tolist() == [1, 1]  # ended by the release


async def test_long_commands_switch_a_queue_to_blocking_events(anyio_backend: object) -> None:
    """Quick commands get plain events (polled, no interrupt each); a command that runs
    long is waited for with naps and the next ones get blocking-sync events (blocked on,
    costing no CPU), until commands are quick again."""
    async with am.open_device("cuda:0") as dev:
        sleep = await dev.compile(KERNELS, "sleep_us")
        empty = await dev.compile(KERNELS, "empty")
        q = dev.new_queue()

        async def until_plain() -> None:
            for _ in range(200):
                await q.launch(empty)
                if not q._native.stats()["blocking_now"]:  # type: ignore[attr-defined]
                    return
            raise AssertionError("quick commands kept blocking-sync events")

        await until_plain()
        before = q._native.stats()  # type: ignore[attr-defined]
        await q.launch(sleep, vals=(20_000,), local_size=1)  # ~20 ms
        after_one = q._native.stats()  # type: ignore[attr-defined]
        assert after_one["napping_waits"] == before["napping_waits"] + 1, after_one
        assert after_one["blocking_now"] == 1, after_one
        await q.launch(sleep, vals=(20_000,), local_size=1)
        after_two = q._native.stats()  # type: ignore[attr-defined]
        assert after_two["blocking_waits"] == after_one["blocking_waits"] + 1, after_two
        await until_plain()


async def test_a_gpu_without_64_bit_stream_memory_operations_is_refused(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused when it opens, naming the attribute: device-side waits need them."""
    from asyncmetal.backends import cuda

    attribute = cuda.cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
    real = cuda.cu.cuDeviceGetAttribute

    def without(which: object, device: object) -> object:
        return (cuda.cu.CUresult.CUDA_SUCCESS, 0) if which == attribute else real(which, device)

    monkeypatch.setattr(cuda.cu, "cuDeviceGetAttribute", without)
    with pytest.raises(am.AsyncMetalError, match="CAN_USE_64_BIT_STREAM_MEM_OPS is 0"):
        async with am.open_device("cuda:0"):
            pass
    monkeypatch.undo()
    async with am.open_device("cuda:0") as dev:  # and nothing was left half-open
        assert dev._backend.info.extra["stream_mem_ops_64"] is True


async def test_compile_errors(anyio_backend: object) -> None:
    async with am.open_device("cuda:0") as dev:
        with pytest.raises(am.CompileError) as info:
            await dev.compile('extern "C" __global__ void k() { nope; }', "k")
        assert "nope" in info.value.log
        with pytest.raises(am.CompileError, match="not defined"):
            await dev.compile(KERNELS, "missing")
        with pytest.raises(am.CompileError) as info:  # the signature itself is broken
            await dev.compile('extern "C" __global__ void k( {', "k")
        assert "not defined" not in str(info.value) and info.value.log
        # A value no launch passes: a long double, a reference (the kernel takes an address).
        with pytest.raises(am.CompileError, match="'long double a' is not a scalar"):
            await dev.compile('extern "C" __global__ void k(float* x, long double a) {}', "k")
        with pytest.raises(am.CompileError, match="'float2 a' is not a scalar"):
            await dev.compile('extern "C" __global__ void k(float* x, float2 a) {}', "k")
        with pytest.raises(am.CompileError, match="'const float& a' is a reference"):
            await dev.compile('extern "C" __global__ void k(float* x, const float& a) {}', "k")


def test_nvrtc_compiler_pickles_as_configuration() -> None:
    from asyncmetal.backends.cuda import CUDACompiler

    compiler = CUDACompiler("sm_90")
    data = pickle.dumps(compiler)
    assert len(data) < 200
    copy = pickle.loads(data)
    assert copy == compiler
    assert copy.compile(KERNELS) == compiler.compile(KERNELS)


async def test_device_wait_before_host_signal_and_between_streams(anyio_backend: object) -> None:
    async with am.open_device("cuda:0") as dev:
        fill = await dev.compile(KERNELS, "fill")
        buf = await dev.alloc(4)
        tl, tl2 = dev.timeline(), dev.timeline()
        q1, q2 = dev.new_queue(), dev.new_queue()
        q2.wait(tl2, 1)  # waits on a signal q1 will make, itself behind the host's
        done = q2.launch(fill, buf, vals=(7, 1))
        q1.wait(tl, 5)
        q1.launch(fill, buf, vals=(3, 1))
        q1.signal(tl2, 1)
        await anyio.sleep(0.05)
        assert not done.done()
        threading.Thread(target=tl.signal, args=(5,)).start()
        await done
        assert (await buf.read(np.int32))[0] == 7
        await tl2.wait(1)


async def test_waits_on_another_queues_timeline(anyio_backend: object) -> None:
    """A wait for a value already submitted on another queue (its event), and for a value
    that queue has not reached yet (its device word, written once it gets there). Once a
    command that waited is done, so is what it waited for."""
    async with am.open_device("cuda:0") as dev:
        fill = await dev.compile(KERNELS, "fill")
        sleep = await dev.compile(KERNELS, "sleep_us")
        n, size = 1000, {"global_size": 1000, "local_size": 128}
        buf = await dev.alloc(4 * n)
        q1, q2 = dev.new_queue(), dev.new_queue()
        q1.launch(sleep, vals=(20_000,))
        first = q1.launch(fill, buf, vals=(1, n), **size)
        q2.wait(q1.timeline, first.value)
        second = q2.launch(fill, buf, vals=(2, n), **size)
        await second
        assert first.done()  # confirmed with q2's wait, before second: never behind it
        await first
        assert (await buf.read(np.int32) == 2).all()
        target = q1.submitted + 2
        q2.wait(q1.timeline, target)
        third = q2.launch(fill, buf, vals=(3, n), **size)
        await anyio.sleep(0.02)
        assert not third.done()
        q1.launch(sleep, vals=(20_000,))
        fourth = q1.launch(fill, buf, vals=(4, n), **size)
        assert fourth.value == target
        await third
        assert fourth.done()
        await fourth
        assert (await buf.read(np.int32) == 3).all()


async def test_waits_for_what_a_closed_device_never_produced_fail_what_follows(
    anyio_backend: object,
) -> None:
    """Two devices on one GPU: queues of one wait, on the device, for a command of the
    other's that its close abandons (behind a wait nobody signals), and for a value
    another of its queues was never given. The close ends both waits, and each waiting
    queue's commands from its wait on fail with ClosedResourceError naming the closed
    device; a queue that waited for a command that ran goes on. (Checked on the
    simulated driver: before, the first ran and reported success, the second waited
    until its own device closed.)"""
    dev, other = await am.open_device("cuda:0"), await am.open_device("cuda:0")
    try:
        fill_here, fill_there = (
            await dev.compile(KERNELS, "fill"),
            await other.compile(KERNELS, "fill"),
        )
        mine, theirs = await dev.alloc(4), await other.alloc(4)
        await dev.queue.launch(fill_here, mine, vals=(5, 1))
        stuck = other.new_queue()
        stuck.wait(other.timeline(), 1)  # nobody signals it
        produced = stuck.launch(fill_there, theirs, vals=(1, 1))
        idle = other.new_queue()
        ran = idle.launch(fill_there, theirs, vals=(2, 1))
        await ran
        abandoned_wait, never_given = dev.new_queue(), dev.new_queue()
        fine = dev.new_queue()
        waits = [
            abandoned_wait.wait(stuck.timeline, produced.value),
            abandoned_wait.launch(fill_here, mine, vals=(7, 1)),
        ]
        closed = [
            never_given.wait(idle.timeline, ran.value + 1),
            never_given.launch(fill_here, mine, vals=(8, 1)),
        ]
        fine.wait(idle.timeline, ran.value)
        fine_done = fine.launch(fill_here, mine, vals=(5, 1))
        with anyio.fail_after(30):
            await anyio.sleep(0.05)
            await other.close()
            for done in waits:
                with pytest.raises(am.ClosedResourceError, match="never produced: cuda:0 was"):
                    await done
            for done in closed:
                with pytest.raises(am.ClosedResourceError, match="cuda:0, closed before"):
                    await done
            await fine_done
            await dev.new_queue().launch(fill_here, mine, vals=(4, 1))
            assert (await mine.read(np.int32))[0] == 4
    finally:
        await other.close()
        await dev.close()


@pytest.mark.parametrize("whose", ["own", "peer"])
def test_close_ends_a_stream_waiting_for_a_value_nobody_signals(whose: str) -> None:
    """A stream waits on the device for a value of a timeline that the host signalled
    before (such a wait goes to the device at once) and nobody signals: the device's own
    timeline, or another device's on the same GPU. Closing the device whose timeline it
    is returns (in a child process, with a watchdog), and the commands behind the wait
    raise ClosedResourceError. Checked on the H200: before, both closes hung (freeing
    memory waits for every stream of the GPU, the waiting one too)."""
    script = textwrap.dedent(
        f"""
        import os, threading, anyio, asyncmetal as am
        SRC = {KERNELS!r}
        async def main():
            dev = await am.open_device("cuda:0")
            peer = await am.open_device("cuda:0") if {whose == "peer"!r} else dev
            fill = await dev.compile(SRC, "fill")
            buf = await dev.alloc(4)
            tl = peer.timeline()
            tl.signal(1)
            queue = dev.new_queue()
            behind = [queue.wait(tl, 2), queue.launch(fill, buf, vals=(3, 1))]
            await anyio.sleep(0.1)  # the stream waits
            threading.Timer(30, lambda: (print("hung", flush=True), os._exit(3))).start()
            await peer.close()
            print("closed", flush=True)
            for done in behind:
                try:
                    await done
                    print("ran")
                except am.ClosedResourceError:
                    print("raised")
            await dev.close()
            os._exit(0)
        anyio.run(main)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.stdout.split() == ["closed", "raised", "raised"], proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stderr


async def test_modules_no_longer_used_are_unloaded_while_the_device_stays_open(
    anyio_backend: object,
) -> None:
    """A collected Program's module is unloaded (cuModuleUnload) by a later compile, once
    every queue ran what it had been given: one whose launch waits on a timeline stays
    loaded until that launch ran, and ran right."""
    kernel = 'extern "C" __global__ void k(int* out) {{ out[0] += {}; }}'
    async with am.open_device("cuda:0") as dev:
        buf = await dev.alloc(4)
        await buf.write(np.zeros(1, np.int32))
        loaded = dev._backend._modules
        before = len(loaded)
        tl, queue = dev.timeline(), dev.new_queue()
        program = await dev.compile(kernel.format(1), "k")
        queue.wait(tl, 1)
        waiting = queue.launch(program, buf)
        for n in range(2, 6):
            program = await dev.compile(kernel.format(n), "k")  # the one before collected
            await dev.queue.launch(program, buf)
        assert len(loaded) - before == 5  # the queue still waits: nothing unloaded
        tl.signal(1)
        with anyio.fail_after(10):
            await waiting
            await queue.synchronize()
        del program
        gc.collect()
        await dev.compile(kernel.format(6), "k")
        assert len(loaded) - before == 1
        assert (await buf.read(np.int32))[0] == 1 + 2 + 3 + 4 + 5


async def test_timeline_values_stop_below_2_to_the_63(anyio_backend: object) -> None:
    """A stream's 64-bit wait compares cyclically ((int64_t)(word - target) >= 0): a
    timeline at 2**64 - 1 would release no wait, and a wait for 2**63 would pass at
    once. Signals and device waits beyond 2**63 - 1 are refused on cuda; up to it they
    work."""
    async with am.open_device("cuda:0") as dev:
        tl = dev.timeline()
        for value in (1 << 63, (1 << 64) - 1):
            with pytest.raises(am.InvalidArgumentError, match="at most"):
                tl.signal(value)
            with pytest.raises(am.InvalidArgumentError, match="at most"):
                dev.queue.wait(tl, value)
            with pytest.raises(am.InvalidArgumentError, match="at most"):
                dev.queue.signal(tl, value)
        top = (1 << 63) - 1
        fill = await dev.compile(KERNELS, "fill")
        buf = await dev.alloc(4)
        queue = dev.new_queue()
        queue.wait(tl, top)
        done = queue.launch(fill, buf, vals=(6, 1))
        await anyio.sleep(0.02)
        assert not done.done()
        tl.signal(top)
        with anyio.fail_after(10):
            await done
        assert (await buf.read(np.int32))[0] == 6


async def test_64_awaiters_batched(anyio_backend: object) -> None:
    async with am.open_device("cuda:0") as dev:
        empty = await dev.compile(KERNELS, "empty")
        tl = dev.timeline()
        q = dev.new_queue()
        q.wait(tl, 1)
        completions = [q.launch(empty) for _ in range(64)]
        async with anyio.create_task_group() as tg:
            for c in completions:
                tg.start_soon(c.wait)
            before = await park_all(completions)
            tl.signal(1)
        after = am.loop_statistics()
        # 64 parked tasks (the queue's own flush of the commands it held on the host
        # behind the device wait is a callback, not counted). The wait, on a timeline
        # nothing signalled yet, is held on the host with the launches behind it until
        # the signal: they reach the device in batches (the first few on the signalling
        # thread, the rest as the bound on commands in flight allows), a few wake-ups.
        assert after.resolved - before.resolved in (64, 65)
        assert after.wakeups - before.wakeups <= 6


async def test_copies(anyio_backend: object) -> None:
    async with am.open_device("cuda:0") as dev:
        for n in (100, 40 << 20):  # direct, and staged through pinned chunks
            data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
            a, b = await dev.alloc(n), await dev.alloc(n)
            await a.write(data)
            await am.copy(b, a)
            np.testing.assert_array_equal(await b.read(), data)
        cpu_side = await am.from_numpy(data)
        await am.copy(a, cpu_side)  # npy -> cuda
        np.testing.assert_array_equal(await a.read(), data)


@pytest.mark.parametrize("n", [64, 24 << 20])  # direct, and staged through pinned chunks
async def test_a_copy_of_lent_cpu_memory_waits_for_a_held_cpu_write_of_it(
    anyio_backend: object, n: int
) -> None:
    """A cuda queue copies from a host array over a cpu buffer's memory (a DLPack
    export) after a cpu write of that buffer was submitted, held behind a timeline: the
    copy waits (held on the host, its stream's work and the staging threads' reads of
    the memory with it) until the write ran, and copies what it wrote. Before, a cuda
    queue did not wait for another kind's uses: the copy read the old bytes."""
    async with am.open_device("cuda:0") as dev, am.open_device("cpu") as cpu:
        mine = await cpu.alloc(n)
        await mine.write(np.full(n, 1, np.uint8))
        lent = np.from_dlpack(mine)  # mine's memory, no copy
        q, tl = held_queue(cpu)
        write = q.copy(mine, np.full(n, 5, np.uint8))
        dst = await dev.alloc(n)
        copy = dev.new_queue().copy(dst, lent)
        with anyio.move_on_after(0.05):
            await copy
        assert not copy.done(), "the copy ran before the cpu write it follows"
        tl.signal(1)
        with anyio.fail_after(30):
            await write
            await copy
        seen = await dst.read(np.uint8)
        assert (seen == 5).all(), "the copy read the bytes from before the write"
        del lent


async def test_pageable_copies_reuse_the_staging_ring(anyio_backend: object) -> None:
    """Copies larger than a queue's ring of pinned chunks (16 x 4 MiB), both ways, on
    two queues at once, at odd offsets and sizes: every byte checked."""
    async with am.open_device("cuda:0") as dev:
        n = 150 << 20
        rng = np.random.default_rng(7)
        data = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(2)]
        bufs = [await dev.alloc(n) for _ in range(2)]
        queues = [dev.new_queue(), dev.new_queue()]
        writes = [q.copy(b, d) for q, b, d in zip(queues, bufs, data, strict=True)]
        outs = [np.zeros(n, np.uint8) for _ in range(2)]
        reads = [
            q.copy(o, b) for q, o, b in zip(reversed(queues), outs, bufs, strict=True)
        ]  # each read orders itself after the other queue's write
        for c in (*writes, *reads):
            await c
        for o, d in zip(outs, data, strict=True):
            np.testing.assert_array_equal(o, d)
        odd = np.zeros(n - 12345, np.uint8)
        await am.copy(odd, bufs[0].view(777, n - 12345))
        np.testing.assert_array_equal(odd, data[0][777 : 777 + n - 12345])
        await am.copy(bufs[1].view(3, n - 12345), data[0][5 : 5 + n - 12345])
        np.testing.assert_array_equal((await bufs[1].read())[3 : 3 + n - 12345], data[0][5:-12340])


async def test_cancelled_waits_lose_nothing(anyio_backend: object) -> None:
    async with am.open_device("cuda:0") as dev:
        fill = await dev.compile(KERNELS, "fill")
        buf = await dev.alloc(4 * 1000)
        for i in range(300):
            with anyio.move_on_after(0 if i % 2 else 1e-5):
                await dev.queue.launch(fill, buf, vals=(i, 1000), global_size=1000, local_size=128)
        assert (await buf.read(np.int32) == 299).all()


@two_gpus
async def test_peer_copies_and_stress_on_two_gpus(anyio_backend: object) -> None:
    async with am.open_device("cuda:0") as d0, am.open_device("cuda:1") as d1:
        mixes = [await d.compile(KERNELS, "mix") for d in (d0, d1)]
        await interleavings([d0, d1], mixes, MIX_LAUNCH, seed=5, steps=800)


@two_gpus
async def test_two_gpus_opened_can_read_each_others_memory(anyio_backend: object) -> None:
    """Opening a second GPU enables peer access both ways where the hardware allows."""
    from asyncmetal.backends.cuda import cu

    async with am.open_device("cuda:0") as d0, am.open_device("cuda:1") as d1:
        b0, b1 = d0._backend, d1._backend
        # The checks make each device's context current here: the thread's own is given
        # back after them (later tests, and PyTorch and CuPy, read the current device).
        before = cu.cuCtxGetCurrent()[1]  # type: ignore[attr-defined]
        try:
            for src, dst in ((b0, b1), (b1, b0)):
                (err, can) = cu.cuDeviceCanAccessPeer(src.device, dst.device)  # type: ignore[attr-defined]
                if not can:
                    continue
                src.make_current()  # type: ignore[attr-defined]
                (err,) = cu.cuCtxEnablePeerAccess(dst.context, 0)  # type: ignore[attr-defined]
                assert err == cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, err
        finally:
            cu.cuCtxSetCurrent(before)  # type: ignore[attr-defined]
        n = 64 << 20
        a, b = await d0.alloc(n), await d1.alloc(n)
        data = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
        await a.write(data)
        await am.copy(b, a)
        assert np.array_equal(await b.read(), data)


async def test_stress_one_gpu_three_queues(anyio_backend: object) -> None:
    async with am.open_device("cuda:0") as d0:
        mix = await d0.compile(KERNELS, "mix")
        await interleavings([d0], [mix], MIX_LAUNCH, seed=11, steps=600)


async def test_waiting_on_a_long_kernel_costs_no_cpu(anyio_backend: object) -> None:
    """Awaiting a kernel of ~0.4 s takes under 5 % of a core in all. The kernel is long
    so that what one await costs once -- the launch, the wake-up, the threads' first
    steps on cores that idled (1-4 ms in all on an H100 in asyncio's debug mode, where a
    100 ms kernel measured up to 5.2 %) -- is not what is judged: a thread polling
    while it waits costs in proportion to the wait."""
    async with am.open_device("cuda:0") as dev:
        sleep = await dev.compile(KERNELS, "sleep_us")
        await dev.queue.launch(sleep, vals=(10,))
        before = dev.queue._native.stats()  # type: ignore[attr-defined]
        threads0 = _thread_cpu_ns()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await dev.queue.launch(sleep, vals=(400_000,))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        threads = _thread_cpu_ns()
        after = dev.queue._native.stats()  # type: ignore[attr-defined]
        assert wall > 0.2
        # (where it went, if it fails: each thread's share by name -- the loop's is
        # "python", the queue's completion thread's "asyncmetal-cuda" -- and the
        # completion thread's queries, napping waits and kicks)
        shares = sorted(
            (
                (ns - threads0[tid][1]) / 1e9 / wall,
                name if tid != threading.get_native_id() else "(the loop)",
            )
            for tid, (name, ns) in threads.items()
            if tid in threads0 and ns > threads0[tid][1]
        )[::-1]
        how = {k: after[k] - before[k] for k in ("queries", "napping_waits", "kicked")}
        by_thread = ", ".join(f"{name} {share:.1%}" for share, name in shares[:6])
        assert cpu / wall < 0.05, (f"{cpu / wall:.1%}: {by_thread}", how)


async def test_a_cuda_queue_names_its_completion_thread(anyio_backend: object) -> None:
    """Each cuda queue's completion thread is named ``asyncmetal-cuda`` (as ``top -H``,
    py-spy, gdb and ``/proc`` show it), while the queue is open."""
    before = set(_thread_cpu_ns())
    async with am.open_device("cuda:0") as dev:
        queue = dev.new_queue()
        await queue.marker()
        names = [name for tid, (name, _) in _thread_cpu_ns().items() if tid not in before]
        assert names.count("asyncmetal-cuda") >= 2, names  # (the default queue's, this one's)
        await queue.close()


def _thread_cpu_ns() -> dict[int, tuple[str, int]]:
    """Each thread of this process: its name and the CPU time it ran (ns, schedstat)."""
    out = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                name = comm.read().strip()
            with open(f"/proc/self/task/{task}/schedstat") as stat:
                out[int(task)] = (name, int(stat.read().split()[0]))
        except (FileNotFoundError, ProcessLookupError):  # it ended since it was listed
            continue
    return out


def test_fault_loses_the_context_only() -> None:
    script = (
        textwrap.dedent(
            """
        import anyio, numpy as np, asyncmetal as am
        SRC = '''%s'''
        async def main():
            async with am.open_device("cuda:0") as dev, am.open_device("cpu") as cpu:
                fault = await dev.compile(SRC, "fault")
                fill = await dev.compile(SRC, "fill")
                buf = await dev.alloc(4)
                await dev.queue.launch(fill, buf, vals=(1, 1))
                bad = dev.queue.launch(fault, buf)
                later = dev.queue.launch(fill, buf, vals=(1, 1))
                for c in (bad, later):
                    try:
                        await c
                        print("no error")
                    except am.DeviceLostError as exc:
                        print("lost:", "ILLEGAL" in str(exc) or "LAUNCH_FAILED" in str(exc))
                try:
                    await dev.queue.launch(fill, buf, vals=(1, 1))
                    print("no error")
                except am.AsyncMetalError:  # refused at submission or lost when awaited
                    print("refused")
                k = await cpu.compile("void k(int* x) { x[0] = 9; }", "k")
                b = await cpu.alloc(4)
                await cpu.queue.launch(k, b)
                print("cpu ok:", (await b.read(np.int32))[0] == 9)
        anyio.run(main)
        print("exiting")
        """
        )
        % KERNELS
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    expected = ["lost: True", "lost: True", "refused", "cpu ok: True", "exiting"]
    assert proc.stdout.splitlines() == expected, proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stderr


def test_fault_in_a_burst_fails_it_and_everything_after() -> None:
    """A fault in a burst queued behind a long kernel: the kernel before it completes,
    the faulting command and every one after it fail, none is reported done."""
    script = (
        textwrap.dedent(
            """
        import asyncio, asyncmetal as am
        SRC = r'''%s'''
        async def main():
            async with am.open_device("cuda:0") as dev:
                fault = await dev.compile(SRC, "fault")
                fill = await dev.compile(SRC, "fill")
                sleep = await dev.compile(SRC, "sleep_us")
                buf = await dev.alloc(4)
                first = dev.queue.launch(sleep, vals=(2000,))  # in flight: the rest wait
                burst = [dev.queue.launch(fill, buf, vals=(1, 1)) for _ in range(10)]
                bad = dev.queue.launch(fault, buf)
                after = [dev.queue.launch(fill, buf, vals=(2, 1)) for _ in range(10)]
                async def outcome(c):
                    try:
                        await c
                        return "ok"
                    except am.DeviceLostError:
                        return "lost"
                print("first", await outcome(first))
                rest = [await outcome(c) for c in [bad, *after]]
                print("after", sorted(set(rest)))
                print("burst", len(burst))
        asyncio.run(main())
        """
        )
        % KERNELS
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.stdout.splitlines() == ["first ok", "after ['lost']", "burst 10"], (
        proc.stdout + proc.stderr
    )


@pytest.mark.parametrize("round_", range(5))
def test_fault_is_never_reported_as_success(round_: int) -> None:
    """The stream's value write behind a faulting kernel may land before the fault is
    reported; the completion must still fail (the host reports verified values only).
    Awaited at once, spinning, with nothing queued behind it."""
    script = textwrap.dedent(
        """
        import asyncio, asyncmetal as am
        SRC = 'extern "C" __global__ void fault(int* p) { *(int*)0x10 = 1; p[0] = 1; }'
        async def main():
            async with am.open_device("cuda:0") as dev:
                fault = await dev.compile(SRC, "fault")
                buf = await dev.alloc(4)
                try:
                    await dev.queue.launch(fault, buf)
                    print("no error")
                except am.DeviceLostError:
                    print("lost")
        asyncio.run(main())
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.stdout.split() == ["lost"], proc.stdout + proc.stderr


# A fault poisons the CUDA state of the whole process that saw it, so the scenarios below
# run in a subprocess of their own: the other cuda tests of this pytest process go on.
FAULT_PRELUDE = (
    f"import anyio, numpy as np, asyncmetal as am\nSRC = {KERNELS!r}\n"
    + r'''
async def outcome(what, call):
    """Print what ``call()`` (awaited if it returns an awaitable) raised: its type,
    whether the message says the process's CUDA state is lost, must restart and can
    be contained by one process per device, and the device and command that saw the
    first error."""
    try:
        result = call()
        if hasattr(result, "__await__"):
            await result
        print(what, "ok")
    except BaseException as exc:
        text = str(exc)
        explained = all(
            part in text
            for part in ("CUDA state is lost", "restart the process", "one per device")
        )
        first = text.split("first seen by ", 1)[-1].split(")", 1)[0] if explained else ""
        print(what, type(exc).__name__, explained, first.rsplit(" ", 1)[-1])
'''
)


def _fault_scenario(body: str) -> list[str]:
    """Run ``body`` (the inside of ``async def main()``, which may use ``outcome``) in
    a fresh process; the lines it printed."""
    script = FAULT_PRELUDE + "async def main():\n" + textwrap.indent(textwrap.dedent(body), "    ")
    script += "anyio.run(main)\nprint('exiting')\n"
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.splitlines()


def test_a_fault_loses_the_process_cuda_state() -> None:
    """A kernel writing through a bad pointer on cuda:0: its completion raises
    DeviceLostError saying the process's CUDA state is lost, that the process must
    restart and that one process per device contains such faults, naming the command
    that saw it. Then every use of the device says the same -- an alloc (of a size not
    cached), a launch, a copy, a new queue, a kernel load -- and opening cuda:0 afresh
    raises DeviceLostError too, not BufferError from its staging chunks' cleanup. The
    cpu device keeps working, and the cuda device still closes."""
    lines = _fault_scenario(
        """
        dev = await am.open_device("cuda:0")
        fault = await dev.compile(SRC, "fault")
        fill = await dev.compile(SRC, "fill")
        buf = await dev.alloc(4)
        await dev.queue.launch(fill, buf, vals=(1, 1))
        await outcome("fault", lambda: dev.queue.launch(fault, buf))
        await outcome("alloc", lambda: dev.alloc(1 << 20))
        await outcome("launch", lambda: dev.queue.launch(fill, buf, vals=(2, 1)))
        await outcome("copy", lambda: dev.queue.copy(np.zeros(1, np.int32), buf))
        await outcome("new_queue", dev.new_queue)
        await outcome("load", lambda: dev.compile(SRC + "// another source", "fill"))
        await outcome("open", lambda: am.open_device("cuda:0"))
        async with am.open_device("cpu") as cpu:
            k = await cpu.compile("void k(int* x) { x[0] = 9; }", "k")
            b = await cpu.alloc(4)
            await cpu.queue.launch(k, b)
            print("cpu", (await b.read(np.int32))[0])
        await dev.close()
        print("closed")
        """
    )
    lost = "DeviceLostError True cuda:0"  # the first error was seen on a stream of cuda:0
    expected = [
        f"fault {lost}",
        f"alloc {lost}",
        f"launch {lost}",
        f"copy {lost}",
        f"new_queue {lost}",
        f"load {lost}",
        f"open {lost}",
        "cpu 9",
        "closed",
        "exiting",
    ]
    assert lines == expected, "\n".join(lines)


@two_gpus
def test_a_fault_on_one_gpu_loses_the_other_gpu_too() -> None:
    """Two GPUs open; a kernel on cuda:1 faults. Its completion raises DeviceLostError,
    and so does everything on cuda:0 after it -- it was opened before and worked: its
    next alloc, launch and copy, and opening it afresh -- each saying the process's CUDA
    state is lost, first seen on cuda:1."""
    lines = _fault_scenario(
        """
        dev0 = await am.open_device("cuda:0")
        dev1 = await am.open_device("cuda:1")
        fill = await dev0.compile(SRC, "fill")
        buf0 = await dev0.alloc(4)
        await dev0.queue.launch(fill, buf0, vals=(1, 1))
        fault = await dev1.compile(SRC, "fault")
        buf1 = await dev1.alloc(4)
        await outcome("fault", lambda: dev1.queue.launch(fault, buf1))
        await outcome("alloc", lambda: dev0.alloc(1 << 20))
        await outcome("launch", lambda: dev0.queue.launch(fill, buf0, vals=(2, 1)))
        await outcome("copy", lambda: dev0.queue.copy(np.zeros(1, np.int32), buf0))
        await outcome("open", lambda: am.open_device("cuda:0"))
        await dev1.close()
        await dev0.close()
        print("closed")
        """
    )
    lost = "DeviceLostError True cuda:1"
    expected = [f"{what} {lost}" for what in ("fault", "alloc", "launch", "copy", "open")]
    assert lines == [*expected, "closed", "exiting"], "\n".join(lines)


def test_a_cpu_write_after_a_faulted_cuda_copy_of_its_buffer_fails_naming_it() -> None:
    """A copy from cuda:0 into a cpu buffer (cuda's queue writes it in place) is in
    flight behind a kernel that faults; a cpu write of that buffer, ordered after the
    copy on the device (the cpu queue's thread waits on the cuda queue's timeline),
    fails -- DeviceLostError naming the cuda queue's command -- and never runs: the
    buffer keeps its bytes. Before, the cuda queue's timeline settled with no failure
    that the cpu queue's wait read: the write ran."""
    lines = _fault_scenario(
        """
        async with am.open_device("cuda:0") as dev, am.open_device("cpu") as cpu:
            fault = await dev.compile(SRC, "fault")
            sleep = await dev.compile(SRC, "sleep_us")
            host = await cpu.alloc(64)
            await host.write(np.zeros(16, np.int32))
            src, other = await dev.alloc(64), await dev.alloc(4)
            await src.write(np.full(16, 5, np.int32))
            dev.queue.launch(sleep, vals=(300_000,))
            bad = dev.queue.launch(fault, other)
            with anyio.move_on_after(0.05):
                await am.copy(host, src)  # in flight, behind the fault: cancelled
            write = cpu.queue.copy(host, np.full(16, 7, np.int32))
            try:
                with anyio.fail_after(30):
                    await write
                print("write ok")
            except am.AsyncMetalError as exc:
                named = "that command" in str(exc) and "of a queue of cuda:0" in str(exc)
                print("write", type(exc).__name__, named)
            out = np.ones(16, np.int32)
            await cpu.new_queue().copy(out, host)
            print("host", out.tolist() == [0] * 16)
            await outcome("fault", lambda: bad)
        """
    )
    assert lines == [
        "write DeviceLostError True",
        "host True",
        "fault DeviceLostError True cuda:0",
        "exiting",
    ], "\n".join(lines)


async def test_a_default_queue_failing_for_good_leaves_the_buffers_usable_cuda(
    anyio_backend: object,
) -> None:
    """As on cpu and Metal (test_contract2_timelines): a cpu device closes while the
    cuda device's default queue holds, on the host, a copy out of a cpu buffer behind
    that cpu device's command that never runs; every later command of the default
    queue fails (it says so), and the cuda buffers' reads, writes, copies and zeroed
    allocs run on a queue made in its stead."""
    async with am.open_device("cuda:0") as dev:
        before = await fail_default_queue_for_good(dev)
        empty = await dev.compile(KERNELS, "empty")
        with anyio.fail_after(20), pytest.raises(am.ClosedResourceError, match="wait"):
            await dev.queue.launch(empty)
        await check_buffers_usable(dev, before)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


async def test_closed_and_dropped_queues_release_their_streams(anyio_backend: object) -> None:
    """Queue.close releases a queue's stream, completion thread, events and staging
    chunks (a large pageable copy staged through them first); a queue dropped with
    nothing in flight is released too, a few new_queue() calls later."""
    async with am.open_device("cuda:0") as dev:
        fill = await dev.compile(KERNELS, "fill")
        n = 16 << 20  # 64 MiB of pageable memory: staged through pinned chunks
        buf = await dev.alloc(4 * n)
        for i in range(3):
            async with dev.new_queue() as q:
                await q.copy(buf, np.full(n, i, np.int32))
            assert (await buf.read(np.int32))[:: n // 8].tolist() == [i] * 8
        # Counted from here: the driver starts threads of its own at the first staging.
        await dev.new_queue().close()
        before = _threads()
        for i in range(100):
            q = dev.new_queue()
            await q.launch(fill, buf, vals=(i, 1024), global_size=1024)
            await q.close()
        assert _threads() <= before + 8
        for i in range(200):
            await dev.new_queue().launch(fill, buf, vals=(i, 1024), global_size=1024)
        with anyio.fail_after(10):
            while _threads() > before + 64:  # (200 completion threads without it)
                await anyio.sleep(0.01)
        assert (await buf.read(np.int32))[:1024].tolist() == [199] * 1024


async def test_closing_an_adopted_streams_queue_leaves_the_stream_to_its_owner(
    anyio_backend: object,
) -> None:
    torch = pytest.importorskip("torch")
    stream = torch.cuda.Stream()
    async with am.open_device("cuda:0") as dev:
        fill = await dev.compile(KERNELS, "fill")
        buf = await dev.alloc(4 * 1024)
        queue = dev.adopt_stream(stream)
        await queue.launch(fill, buf, vals=(5, 1024), global_size=1024)
        await queue.close()
        with pytest.raises(am.ClosedResourceError):
            queue.marker()
        with torch.cuda.stream(stream):  # still its owner's, and usable
            out = torch.ones(1024, device="cuda:0") * 3
        stream.synchronize()
        assert int(out.sum()) == 3 * 1024
        again = dev.adopt_stream(stream)
        assert again is not queue
        await again.launch(fill, buf, vals=(6, 1024), global_size=1024)
        assert (await buf.read(np.int32)).tolist() == [6] * 1024


SLOW_MARK = r"""
extern "C" __global__ void slow_mark(int* marks, int i, int us) {
    long long start = clock64();
    long long cycles = (long long)us * 1800;  // ~1.8 GHz
    while (clock64() - start < cycles) {}
    marks[i] = 1;
}
"""


@pytest.mark.parametrize("what", ["queue", "device"])
async def test_close_with_discard_drops_a_streams_held_backlog(
    anyio_backend: object, what: str
) -> None:
    """10,000 launches of ~1 ms queued on a stream (held on the host past its bound)
    and closed with discard: the commands the driver has run (those that ran are the
    first ones, each marked its buffer), the held ones are dropped -- their awaits say
    so (a staged copy to pageable memory among them too, whose host part the close
    stops), the timeline a dropped signal was to raise fails, another stream's device
    wait for it fails its queue -- and memory returns to zero."""
    n = 10_000
    dev = await am.open_device("cuda:0")
    mark = await dev.compile(SLOW_MARK, "slow_mark")
    marks = await dev.alloc(4 * n)
    await marks.write(np.zeros(n, np.int32))
    q, other = dev.new_queue(), dev.new_queue()
    gate, tl = dev.timeline(), dev.timeline()
    q.wait(gate, 1)  # (held until the backlog is submitted: none runs meanwhile)
    done = [q.launch(mark, marks, vals=(i, 1000)) for i in range(n)]
    big = await dev.alloc(32 << 20)
    out = np.empty(32 << 20, np.uint8)
    copied = q.copy(out, big)  # pageable: its host part waits for a mark never written
    signalled = q.signal(tl, 1)
    other.wait(tl, 1)
    behind = other.launch(mark, marks, vals=(0, 1))
    gate.signal(1)
    await done[0]
    with anyio.fail_after(60):
        if what == "queue":
            await q.close(discard=True)
        else:
            await dev.close(discard=True)
        ran = await discard_outcomes(done)
        for dropped in (copied, signalled):
            with pytest.raises(am.ClosedResourceError, match="discard"):
                await dropped
        with pytest.raises(am.ClosedResourceError):
            await tl.wait(1)
        with pytest.raises(am.AsyncMetalError):
            await behind
    count = sum(ran)
    assert ran == [True] * count + [False] * (n - count)
    assert count < n // 2
    if what == "queue":
        assert (await marks.read(np.int32))[:n].tolist() == [int(r) for r in ran]
        await marks.free()
        await big.free()
        await dev.close()
    statistics = dev.memory_statistics()
    assert statistics.in_use == statistics.cached == 0


async def test_a_queue_whose_native_close_fails_leaves_nothing_else_unreleased(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default queue's native close raises (after closing it): the other queue,
    the memory and the backend are released all the same, a wait on one of its
    timelines ends, close() raises that error, and the GPU opens again as new."""
    from asyncmetal import _device

    close_native = _device.close_native
    closed: list[am.Queue] = []

    def failing_close(queue: am.Queue, abandon: bool) -> None:
        close_native(queue, abandon)
        closed.append(queue)
        if queue is dev.queue:
            raise am.AsyncMetalError("the native close failed")

    monkeypatch.setattr(_device, "close_native", failing_close)
    dev = await am.open_device("cuda:0")
    other = dev.new_queue()
    fill = await dev.compile(KERNELS, "fill")
    buf = await dev.alloc(4 * 1024)
    await other.launch(fill, buf, vals=(3, 1024), global_size=1024)
    ended = await close_failing_with_a_wait(dev, "the native close failed")
    assert closed == [dev.queue, other]
    assert len(ended) == 1
    assert dev not in am.open_devices()
    async with am.open_device("cuda:0") as again:
        fill = await again.compile(KERNELS, "fill")
        buf = await again.alloc(4 * 1024)
        await again.queue.launch(fill, buf, vals=(4, 1024), global_size=1024)
        assert (await buf.read(np.int32)).tolist() == [4] * 1024


async def test_a_copy_done_before_it_was_awaited_lets_its_host_objects_go_once_awaited(
    anyio_backend: object,
) -> None:
    """As on cpu (tests/reliability/test_memory.py): awaited, a copy done before lets
    go of its host side -- the array is freed, the bytearray can be resized."""
    async with am.open_device("cuda:0") as dev:
        gone, into = await copies_done_before_awaited(dev)
        gc.collect()
        assert gone() is None, "the copy's source is kept alive"
        into.extend(b"!")  # (BufferError while a view of it is kept)
        assert bytes(into[:16]) == bytes(range(16))


async def test_a_budget_holds_on_cuda(anyio_backend: object) -> None:
    """The allocator's budget over cuMemAlloc: a request takes a block of its own size
    class only (a larger cached block would hold its extra bytes against the budget),
    and an alloc waiting under the budget ends when a buffer is freed."""
    async with am.open_device("cuda:0") as dev:
        dev.memory_budget = 2 * 2**20
        big = await dev.alloc(3 * 2**19)
        await big.free()  # cached: 1.5 MiB
        small = await dev.alloc(2**19)  # a block of its own class; the cached one evicted
        assert dev.memory_statistics().in_use == 2**19
        with anyio.fail_after(10):  # (a bound on a hang, not a timing)
            other = await dev.alloc(2**20)
        assert dev.memory_statistics().in_use == 3 * 2**19
        async with anyio.create_task_group() as tg:
            got: list[am.Buffer] = []

            async def waiter() -> None:
                got.append(await dev.alloc(2**20, timeout=10))

            tg.start_soon(waiter)
            await anyio.sleep(0.05)
            assert not got  # 1.5 MiB in use: 1 MiB more does not fit
            await other.free()
        assert dev.memory_statistics().in_use == 3 * 2**19
        await got[0].free()
        await small.free()
        await dev.synchronize()
        assert dev.memory_statistics().in_use == 0


async def test_a_keyboard_interrupt_as_a_stream_is_adopted_leaves_none_unreleased(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt wherever CPython delivers one in ``adopt_stream`` and the
    Queue's making either comes after the caller got the queue, or leaves nothing of
    it: every native queue made over the stream is released by the device's close at
    the latest (its completion thread stopped), and adopting the stream again works --
    except where the backend returned it and Queue.__init__ has not stored it yet.
    Checked failing before: an interrupt as Queue() returned into adopt_stream left its
    native queue unreleased by the close."""
    torch = pytest.importorskip("torch")
    stream = torch.cuda.Stream()
    async with am.open_device("cuda:0") as device:
        natives = type(device.adopt_stream(stream)._native)
    at = await check_queue_making_interrupted(
        monkeypatch,
        "cuda:0",
        "adopt_queue",
        natives,
        lambda device: device.adopt_stream(stream),
    )
    assert at >= 4

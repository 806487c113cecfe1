"""The metal backend. The parts that need no Metal run everywhere; the rest is marked
`metal` and runs where a Metal device opens: on Linux x86-64 that is the simulated Metal
of tests/support/fakes/metal_sim (configured by conftest), on macOS Apple's (never run: no macOS
machine is available to this project)."""

from __future__ import annotations

import gc
import pickle
import struct
import subprocess
import sys
import textwrap
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal.backends.metal import MetalCompiler, codegen_library, codegen_request
from asyncmetal.backends.metal._compiler import codegen_warnings, metal_bindings, metal_params
from tests.support.fakes import metal_sim
from tests.support.kernels import KERNELS as C_KERNELS
from tests.support.kernels import MSL_KERNELS

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


SPARSE = """
kernel void k(device int* out [[buffer(0)]], constant int& add [[buffer(3)]],
              uint i [[thread_position_in_grid]], device int* in [[buffer(2)]]) {
    out[i] = in[i] + add;
}
"""


def test_metal_bindings_are_each_parameters_own_index() -> None:
    assert metal_params(SPARSE, "k") == ("buffer", "buffer", "value")
    assert metal_bindings(SPARSE, "k") == (0, 2, 3)
    assert metal_bindings(KERNELS, "add") == (0, 1, 2, 3)


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


def test_compiler_service_warnings_are_read_from_its_reply() -> None:
    """The warnings section lies between the header and the library (its size at bytes
    12-16), NUL-terminated."""
    warning = b"program.metal:3:9: warning: unused variable 'x'\n"
    reply = b"\0" * 8 + struct.pack("<LL", 16, len(warning) + 1) + warning + b"\0MTLBxENDT"
    assert codegen_library(reply) == b"MTLBxENDT"
    assert codegen_warnings(reply) == warning.decode()
    assert codegen_warnings(b"\0" * 8 + struct.pack("<LL", 16, 1) + b"\0MTLBxENDT") == ""


@pytest.mark.skipif(sys.platform == "darwin", reason="off macOS only")
def test_compiler_service_is_missing_off_macos(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCMETAL_MTLCOMPILER_LIB", raising=False)
    with pytest.raises(am.CompileError, match="not available here"):
        MetalCompiler().compile(KERNELS)


GPU = "metal" in am.devices()
SIMULATED = metal_sim.configured()


USING = """
#include <metal_stdlib>
using namespace metal;
using real = float;
using count_t = ushort;
kernel void keep(device uchar* out [[buffer(0)]], constant real& x [[buffer(1)]],
                 constant count_t& n [[buffer(2)]], uint i [[thread_position_in_grid]]) {
    *(device real*)(out) = x; *(device count_t*)(out + 4) = n;
}
"""


@pytest.mark.metal
@pytest.mark.anyio
@pytest.mark.skipif(not GPU, reason="needs macOS with a Metal device")
async def test_values_of_types_named_by_using(anyio_backend: object) -> None:
    """A type C++'s ``using`` names is read as the type it names: a Python int reaches a
    ``real`` (float) parameter as that float, not as an int's bits, and a ``count_t``
    (ushort) parameter as its two bytes."""
    async with am.open_device("metal") as dev:
        keep = await dev.compile(USING, "keep")
        out = await dev.alloc(8)
        await dev.queue.launch(keep, out, vals=(3, 65535))
        got = (await out.read(np.uint8)).tobytes()
        assert got[:6] == np.float32(3).tobytes() + np.uint16(65535).tobytes()
        assert [t for t, _ in keep.value_types] == ["float32", "uint16"]


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
        with pytest.raises(am.CompileError) as info:
            await dev.compile("kernel void k() { nope; }", "k")
        assert "nope" in info.value.log  # the compiler's own message


@pytest.mark.metal
@pytest.mark.skipif(not GPU, reason="needs macOS with a Metal device")
def test_metal_compiler_compiles_the_same_bytes_after_pickling() -> None:
    compiler = MetalCompiler()
    assert pickle.loads(pickle.dumps(compiler)).compile(KERNELS) == compiler.compile(KERNELS)


# -- against the simulated Metal: what it alone can show ----------------------------------

sim_only = pytest.mark.skipif(not SIMULATED, reason="needs the simulated Metal")
ROOT = str(__import__("pathlib").Path(__file__).parents[3])


def _in_a_child(script: str, *args: str, timeout: float) -> list[str]:
    """The lines ``script`` printed, run in a child process (this checkout on its path
    as ``sys.argv[1]``) that must end by itself, successfully, within ``timeout``."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", script, ROOT, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung: {exc.stdout!r}")
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


def timelines_freed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The native timelines freed from now on (each ``am_timeline_free``'s argument)."""
    from asyncmetal import _native

    lib = _native.runtime()
    free, freed = lib.am_timeline_free, []

    def counted(c_timeline: int) -> None:
        freed.append(c_timeline)
        free(c_timeline)

    monkeypatch.setattr(lib, "am_timeline_free", counted)
    return freed


pytestmark_loops = pytest.mark.parametrize(
    "anyio_backend",
    [
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
        pytest.param(("trio", {}), id="trio"),
    ],
)

REFERENCES = """
#include <metal_stdlib>
using namespace metal;
struct params { float scale; int n; };
kernel void keep(device int& out [[buffer(0)]], constant char& c [[buffer(1)]],
                 device atomic_uint& count [[buffer(2)]], uint i [[thread_position_in_grid]]) {
    out = c;
}
kernel void by_vector(device float* out [[buffer(0)]], constant float4& v [[buffer(1)]]) {}
kernel void by_struct(device float* out [[buffer(0)]], constant params& p [[buffer(1)]]) {}
kernel void by_half3(device float* out [[buffer(0)]], half3 h [[buffer(1)]]) {}
kernel void by_packed(device float* out [[buffer(0)]], constant packed_float3& v [[buffer(1)]]) {}
kernel void by_matrix(device float* out [[buffer(0)]], constant float2x2& m [[buffer(1)]]) {}
kernel void by_bfloat(device float* out [[buffer(0)]], constant bfloat& b [[buffer(1)]]) {}
"""


def test_metal_references_to_device_memory_are_buffers_and_no_vector_is_a_value() -> None:
    """A ``device`` reference (``device int& out``, ``device atomic_uint& n``) is
    memory the kernel may write: a buffer. A ``constant`` reference or a value of a
    vector, matrix, packed vector, struct or ``bfloat`` is refused at compile, naming
    it: one launch value's ``setBytes`` cannot make it (an int's 4 bytes were read
    past). A plain char is signed (the Metal Shading Language's)."""
    assert metal_params(REFERENCES, "keep") == ("buffer", "value", "buffer")
    assert MetalCompiler()._value_types(REFERENCES, "keep") == (("int8", "constant char& c"),)
    for name, declaration in [
        ("by_vector", "constant float4& v"),
        ("by_struct", "constant params& p"),
        ("by_half3", "half3 h"),
        ("by_packed", "constant packed_float3& v"),
        ("by_matrix", "constant float2x2& m"),
        ("by_bfloat", "constant bfloat& b"),
    ]:
        with pytest.raises(am.CompileError, match="is not a scalar that launch values") as info:
            metal_params(REFERENCES, name)
        assert f"parameter {declaration!r}" in str(info.value)


DEVICE_REFERENCE = """
struct params { float scale; int n; };
kernel void keep(device int& out [[buffer(0)]], constant char& c [[buffer(1)]],
                 uint i [[thread_position_in_grid]]) { out = c; }
kernel void by_struct(device float* out [[buffer(0)]], constant params& p [[buffer(1)]]) {}
"""


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
async def test_a_device_reference_is_bound_as_a_buffer(anyio_backend: object) -> None:
    """A kernel writes through its ``device int&`` parameter into the buffer launched
    for it; its signed char takes -1 and refuses 200; a struct reference is refused at
    compile, before anything is compiled."""
    async with am.open_device("metal") as dev:
        keep = await dev.compile(DEVICE_REFERENCE, "keep")
        out = await dev.alloc(4)
        await dev.queue.launch(keep, out, vals=(-1,))
        assert (await out.read(np.int32)).tolist() == [-1]
        with pytest.raises(am.InvalidArgumentError, match=r"must fit in int8 .*'constant char& c'"):
            dev.queue.launch(keep, out, vals=(200,))
        with pytest.raises(am.CompileError, match="'constant params& p' is not a scalar"):
            await dev.compile(DEVICE_REFERENCE, "by_struct")


FAULTY = """
kernel void crash(device int* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    out[0] = 1;
    __asyncmetal_sim_fault();  // the simulation's hook: this command buffer faults
}
"""

# Runs until the host sets flag[0] (the simulation's "GPU" thread reads host memory).
SPIN_UNTIL = """
kernel void spin_until(device int* flag [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    while (((volatile device int*)flag)[0] == 0) {}
}
"""


async def gpu_gate(dev: am.Device) -> tuple[am.Timeline, Callable[[], None]]:
    """A timeline of ``dev`` whose value 1 a command buffer already committed signals,
    behind a kernel that runs until the function returned is called: a Metal queue's
    wait for it goes to the GPU (a wait for a value nothing committed signals yet is
    held on the queue's own thread instead), and holds what follows it there until
    then."""
    spin = await dev.compile(SPIN_UNTIL, "spin_until")
    flag = await dev.alloc(4)
    await flag.write(np.zeros(1, np.int32))
    view = np.frombuffer(dev._backend.host_view(flag._allocation.handle, 0, 4), np.int32)
    tl, queue = dev.timeline(), dev.new_queue()
    queue.launch(spin, flag)
    queue.signal(tl, 1)

    def release() -> None:
        view[0] = 1

    return tl, release


def unwrapped(monkeypatch: pytest.MonkeyPatch, above: int = 0) -> None:
    """Metal wraps no host memory a copy reads or writes of more than ``above`` bytes
    (as where its pages are more than its largest buffer): those copies are staged."""
    from asyncmetal.backends.metal import _backend

    wrap = _backend.MetalBackend.wrap_pages

    def refused(self: Any, address: int, nbytes: int, check: bool = True) -> Any:
        return wrap(self, address, nbytes) if check or nbytes <= above else None

    monkeypatch.setattr(_backend.MetalBackend, "wrap_pages", refused)


GRID = """
kernel void index(device uint* out [[buffer(0)]], constant int& base [[buffer(1)]],
                  uint i [[thread_position_in_grid]]) { out[i] = i + base; }
"""


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
@sim_only
async def test_a_faulting_kernel_loses_the_device(anyio_backend: object) -> None:
    """The command buffer ends with MTLCommandBufferStatusError and an NSError: the
    launch's await raises DeviceLostError with Metal's description; closing still works."""
    async with am.open_device("metal") as dev:
        crash = await dev.compile(FAULTY, "crash")
        buf = await dev.alloc(4)
        with pytest.raises(am.DeviceLostError, match="kernel crash faulted"):
            await dev.queue.launch(crash, buf)


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
async def test_every_thread_position_runs(anyio_backend: object) -> None:
    """dispatchThreads with a grid of n threads in groups of 64 (MTLSize by value): each
    position runs once with its index; the value set with setBytes arrives."""
    n = 1000
    async with am.open_device("metal") as dev:
        index = await dev.compile(GRID, "index")
        out = await dev.alloc(4 * n)
        await dev.queue.launch(index, out, vals=(7,), global_size=n, local_size=64)
        np.testing.assert_array_equal(await out.read(np.uint32), np.arange(n) + 7)


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
async def test_copies_between_metal_and_cpu_keep_order(anyio_backend: object) -> None:
    """metal -> cpu -> metal, submitted without awaiting in between: each copy sees the
    work before it on its source (contract 5), every byte arrives."""
    n = 1 << 16
    data = np.random.default_rng(1).integers(0, 1 << 30, n, dtype=np.int32)
    async with am.open_device("metal") as mtl, am.open_device("cpu") as cpu:
        msl = await mtl.compile(MSL_KERNELS, "fill")
        c_fill = await cpu.compile(C_KERNELS, "fill")
        a, b = await mtl.alloc(4 * n), await mtl.alloc(4 * n)
        c = await cpu.alloc(4 * n)
        for round_ in range(3):
            await am.copy(a, data)
            mtl.queue.launch(msl, a, vals=(round_, n // 2))  # first half: round_
            await am.copy(c, a)
            cpu.queue.launch(c_fill, c, vals=(-round_, n // 4))  # first quarter: -round_
            await am.copy(b, c)
            expect = data.copy()
            expect[: n // 2] = round_
            expect[: n // 4] = -round_
            np.testing.assert_array_equal(await b.read(np.int32), expect)


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
async def test_copies_between_two_metal_buffers_and_views(anyio_backend: object) -> None:
    async with am.open_device("metal") as dev:
        src = await dev.alloc(4096)
        dst = await dev.alloc(4096)
        await src.write(np.arange(1024, dtype=np.int32))
        await dev.queue.copy(dst.view(400, 1000), src.view(100, 1000))
        out = await dst.read(np.int32)
        np.testing.assert_array_equal(out[100:350], np.arange(25, 275))
        assert not out[:100].any()


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
async def test_cancelled_waiter_leaves_held_work_to_run(anyio_backend: object) -> None:
    """A command held by a device-side wait: its awaiter is cancelled, the command still
    runs once the timeline is signalled, and its buffer stays alive until then."""
    async with am.open_device("metal") as dev:
        fill = await dev.compile(MSL_KERNELS, "fill")
        tl = dev.timeline()
        buf = await dev.alloc(64)
        dev.queue.wait(tl, 1)
        done = dev.queue.launch(fill, buf, vals=(5, 16))
        with anyio.move_on_after(0.05) as scope:
            await done
        assert scope.cancelled_caught
        tl.signal(1)
        await dev.queue.launch(fill, buf, vals=(6, 1))  # after the held one
        assert (await buf.read(np.int32)).tolist() == [6] + [5] * 15


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
@sim_only
async def test_completion_handlers_run_on_metal_threads(anyio_backend: object) -> None:
    """Metal calls each command buffer's handler later, from its own thread -- never the
    committing one -- and that wakes the loop (through the native invoke function)."""
    ran, on_committer = metal_sim.handlers()
    async with am.open_device("metal") as dev:
        empty = await dev.compile(MSL_KERNELS, "empty")
        for _ in range(50):
            await dev.queue.launch(empty)
    after = metal_sim.handlers()
    assert after[0] - ran >= 50
    assert after[1] == on_committer


LIFETIMES = textwrap.dedent(
    """
    import gc, json, sys, time
    sys.path.insert(0, sys.argv[1])
    import anyio, numpy as np
    import asyncmetal as am
    from tests.support.fakes import metal_sim
    from tests.support.kernels import MSL_KERNELS

    CLASSES = ["MTLCommandBuffer", "MTLComputeCommandEncoder", "MTLBlitCommandEncoder",
               "MTLBuffer", "MTLSharedEvent", "MTLCommandQueue", "MTLLibrary",
               "MTLFunction", "MTLComputePipelineState", "NSError", "OS_dispatch_data"]

    async def work():
        async with am.open_device("metal") as dev:
            fill = await dev.compile(MSL_KERNELS, "fill")
            tl = dev.timeline()
            q = dev.new_queue()
            buf = await dev.alloc(1 << 20)
            for i in range(40):
                q.wait(tl, i + 1)
                q.launch(fill, buf, vals=(i, 256))
                dev.queue.signal(tl, i + 1)
                await am.copy(np.zeros(1 << 16, np.uint8), buf.view(0, 1 << 16))
            await buf.write(np.ones(1 << 18, np.int32))
            await q.copy(buf.view(0, 4096), buf.view(8192, 4096))
            with anyio.move_on_after(0.01):
                await q.launch(fill, buf, vals=(1, 1))
            await buf.free()

    anyio.run(work)
    # Threads let go a little later (a queue's GPU thread once it has no work, a worker
    # thread's last frame): count until nothing is left, for at most 10 s.
    deadline = time.monotonic() + 10
    while True:
        gc.collect()
        counts = {c: metal_sim.live(c) for c in CLASSES}
        if not any(counts.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    print(json.dumps(counts | {"implicit": metal_sim.implicit()}))
    """
)


@pytest.mark.metal
@sim_only
def test_nothing_is_leaked_or_released_twice(tmp_path: object) -> None:
    """In a fresh process: a workload of launches, waits, signals, copies each way and a
    cancelled await, then close. Every Metal object the backend
    made or was handed is released exactly once (an over-release or a message to a
    released object aborts the simulation), and nothing was autoreleased with no pool."""
    counts = __import__("json").loads(_in_a_child(LIFETIMES, timeout=240)[-1])
    assert counts == {name: 0 for name in counts}, counts


@pytest.mark.metal
@sim_only
@pytest.mark.anyio
async def test_pipelines_no_longer_used_are_released_while_the_device_stays_open(
    anyio_backend: object,
) -> None:
    """A Program collected gives its pipeline back at a later compile, once every queue
    of the device ran what it had been given by then: a queue still waiting keeps those
    dropped meanwhile."""
    kernel = "kernel void k(device int* out [[buffer(0)]], uint i [[thread_position_in_grid]])"
    sources = [f"{kernel} {{ if (i == 0) out[0] += {n}; }}" for n in range(6)]
    async with am.open_device("metal") as dev:
        buf = await dev.alloc(4)
        await buf.write(np.zeros(1, np.int32))
        before = metal_sim.live("MTLComputePipelineState")
        tl, queue = dev.timeline(), dev.new_queue()
        program = await dev.compile(sources[0], "k")
        queue.wait(tl, 1)
        waiting = queue.launch(program, buf)
        for src in sources[1:]:
            program = await dev.compile(src, "k")  # the one before is collected
            await dev.queue.launch(program, buf)
        gc.collect()
        assert metal_sim.live("MTLComputePipelineState") - before == 6
        tl.signal(1)
        await waiting
        del program
        gc.collect()
        await dev.compile(sources[0], "k")
        assert metal_sim.live("MTLComputePipelineState") - before == 1
        assert (await buf.read(np.int32))[0] == sum(range(6))


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_more_commands_than_a_queue_holds_do_not_block_the_loop(
    anyio_backend: object,
) -> None:
    """Held behind an unsignalled wait, 1100 launches: past 1000 in flight the queue hands
    its submissions to its own thread, since `commandBuffer` blocks at the queue's 1024
    (the simulation blocks there too). Had the loop's thread blocked, the signal below
    would never come (the test would hang)."""
    async with am.open_device("metal") as dev:
        step = await dev.compile(MSL_KERNELS, "step")
        cells = await dev.alloc(8)
        tl = dev.timeline()
        q = dev.new_queue()
        q.wait(tl, 1)
        done = [q.launch(step, cells, vals=(0, 1, i % 7)) for i in range(1100)]
        tl.signal(1)
        await done[-1]
        expect = 0
        for i in range(1100):
            expect = (expect * 31 + i % 7) & 0xFFFFFFFF
        got = int((await cells.read(np.uint32))[0])
        assert got == expect  # every launch ran, in order


NEW_BUFFER = "b = send(device, 'newBufferWithLength:options:', 64, 0, argtypes=(c_ulong, c_ulong))"
MISUSE = {
    "unrecognized selector": "send(device, 'newCommandQueue')",
    "release sent to deallocated instance": f"{NEW_BUFFER}; release(b); release(b)",
    "contents sent to deallocated instance": f"{NEW_BUFFER}; release(b); send(b, 'contents')",
    "an encoder of the command buffer is still open": "q = send(device,"
    " 'newCommandQueueWithMaxCommandBufferCount:', 4, argtypes=(c_ulong,));"
    " cb = send(q, 'commandBuffer'); send(cb, 'blitCommandEncoder');"
    " send(cb, 'computeCommandEncoder')",
}


@pytest.mark.metal
@sim_only
@pytest.mark.parametrize("message", list(MISUSE))
def test_the_simulation_traps_misuse(message: str) -> None:
    """What Metal's validation layer or the Objective-C runtime would trap aborts the
    simulation with its reason: the lifetime and encoding checks can fail."""
    code = (
        "from ctypes import c_ulong, c_void_p\n"
        "from asyncmetal.backends.metal._objc import load, release, send\n"
        "metal = load('metal'); metal.MTLCreateSystemDefaultDevice.restype = c_void_p\n"
        "device = metal.MTLCreateSystemDefaultDevice()\n" + MISUSE[message] + "\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "asyncmetal-sim:" in out.stderr and message in out.stderr, out.stderr[-2000:]


@pytest.mark.metal
@sim_only
def test_shared_event_listener_calls_its_block_on_its_queue() -> None:
    """notifyListener:atValue:block: (the backend does not use it: its queue signals reach
    host awaiters through completion handlers) runs the native listener block once the
    event reaches the value, on the listener's dispatch queue."""
    code = textwrap.dedent(
        """
        import ctypes, time
        from ctypes import c_uint64, c_void_p
        from asyncmetal import _native
        from asyncmetal.backends.metal import _blocks
        from asyncmetal.backends.metal._objc import load, objc_class, send
        metal, system = load("metal"), load("system")
        metal.MTLCreateSystemDefaultDevice.restype = c_void_p
        system.dispatch_queue_create.restype = c_void_p
        device = metal.MTLCreateSystemDefaultDevice()
        queue = system.dispatch_queue_create(b"listener", None)
        listener = send(send(objc_class("MTLSharedEventListener"), "alloc"),
                        "initWithDispatchQueue:", c_void_p(queue))
        event = send(device, "newSharedEvent")
        lib = _native.runtime()
        timeline = lib.am_timeline_new()
        block = _blocks.make_block(_blocks.global_block_isa(system),
                                   _blocks.REACHED_SIGNATURE, timeline)
        send(event, "notifyListener:atValue:block:", listener, 5, ctypes.addressof(block),
             restype=None, argtypes=(c_void_p, c_uint64, c_void_p))
        send(event, "setSignaledValue:", 4, restype=None, argtypes=(c_uint64,))
        time.sleep(0.1)
        assert block.calls == 0, "called before the value was reached"
        send(event, "setSignaledValue:", 9, restype=None, argtypes=(c_uint64,))
        deadline = time.monotonic() + 5
        while not block.calls and time.monotonic() < deadline:
            time.sleep(0.005)
        assert block.calls == 1 and block.arg == event
        assert lib.am_timeline_value(timeline) == 9
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


DROPPED_SIGNAL_TARGET = textwrap.dedent(
    """
    import gc, sys
    sys.path.insert(0, sys.argv[1])
    import anyio
    import asyncmetal as am
    from tests.support.kernels import MSL_KERNELS

    async def abandoned(gate):
        dev = await am.open_device("metal")
        tl = dev.timeline()
        dev.queue.wait(gate, 1)
        dev.queue.signal(tl, 1)  # held: the close abandons it, and keeps tl for it
        await dev.close()

    async def main():
        other = await am.open_device("metal")
        empty = await other.compile(MSL_KERNELS, "empty")
        gate = other.timeline()
        await abandoned(gate)
        for _ in range(3):
            gc.collect()
            await anyio.sleep(0.05)
        gate.signal(1)  # the abandoned command buffer runs now
        await anyio.sleep(0.3)
        await other.queue.launch(empty)  # its reap lets go of the dropped timeline
        print("done")
        await other.close()

    anyio.run(main)
    """
)


@pytest.mark.metal
@sim_only
def test_a_timeline_an_abandoned_signal_kept_is_let_go_of_without_a_deadlock() -> None:
    """A held signal abandoned by a close keeps its timeline until its command buffer
    ran; the app dropped the timeline meanwhile. Letting go of it frees its native
    timeline, which takes the lock the letting go held: a deadlock of the loop's thread
    before (in a child process, with a timeout)."""
    assert _in_a_child(DROPPED_SIGNAL_TARGET, timeout=60) == ["done"]


HELD_AT_CLOSE = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[1])
    import anyio
    import asyncmetal as am
    from tests.support.fakes import metal_sim
    from tests.support.kernels import MSL_KERNELS

    async def held(dev):
        # More than the queue's 1024 command buffers, behind a wait nobody signals: its
        # thread is left blocked in commandBuffer.
        empty = await dev.compile(MSL_KERNELS, "empty")
        tl, q = dev.timeline(), dev.new_queue()
        q.wait(tl, 1)
        done = [q.launch(empty) for _ in range(1100)]
        await anyio.sleep(0.3)
        return done

    async def main():
        dev = await am.open_device("metal")
        done = await held(dev)
        with anyio.fail_after(30):
            await dev.close()
        try:
            await done[-1]
        except am.ClosedResourceError:
            pass
        # The queue is released once its thread's commandBuffer returned.
        deadline = time.monotonic() + 10
        while metal_sim.live("MTLCommandQueue") and time.monotonic() < deadline:
            await anyio.sleep(0.02)
        print("closed", metal_sim.live("MTLCommandQueue"), flush=True)
        await held(await am.open_device("metal"))  # left open: closed at exit

    options = {"use_uvloop": True} if sys.argv[3] == "uvloop" else {}
    anyio.run(main, backend=sys.argv[2], backend_options=options)
    """
)


@pytest.mark.metal
@sim_only
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("loop", "options"),
    [("asyncio", {}), ("asyncio", {"use_uvloop": True}), ("trio", {})],
    ids=["asyncio", "uvloop", "trio"],
)
def test_close_and_exit_do_not_wait_for_commands_held_past_the_queue(
    loop: str, options: dict[str, object]
) -> None:
    """A device closed while more commands than its queue holds wait behind a wait that
    nothing signals: the close abandons them without waiting for the queue's thread, and
    a process that exits with such a device open exits."""
    assert _in_a_child(HELD_AT_CLOSE, loop, repr(options), timeout=90) == ["closed 0"]


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_wait_after_commands_held_for_the_queue_holds_only_later_ones(
    anyio_backend: object,
) -> None:
    """A wait submitted while the queue's thread holds earlier commands (more than 1000
    in flight) comes after them: they run without it, and it completes once signalled."""
    async with am.open_device("metal") as dev:
        step = await dev.compile(MSL_KERNELS, "step")
        cells = await dev.alloc(8)
        tl, later_tl = dev.timeline(), dev.timeline()
        q = dev.new_queue()
        q.wait(tl, 1)
        done = [q.launch(step, cells, vals=(0, 1, 1)) for _ in range(1100)]
        later = q.wait(later_tl, 1)
        tl.signal(1)
        # (The finally clauses keep a failure from leaving the close waiting for ever.)
        try:
            try:
                with anyio.fail_after(20):
                    await done[-1]  # later_tl is not signalled yet
                assert not later.done()
            finally:
                later_tl.signal(1)
            with anyio.fail_after(20):
                await later
        finally:
            q.launch(step, cells, vals=(0, 1, 1))  # marks the wait's value if it was lost


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
@sim_only
async def test_an_abandoned_copy_to_the_host_never_writes_it(anyio_backend: object) -> None:
    """A copy to a host array, held behind a wait for another device's timeline that
    nothing signals yet, is abandoned by its device's close. When the other device
    signals later, nothing of it runs (it was held on the queue's own thread, never
    committed): nothing is written into the array."""
    n = 1 << 14
    async with am.open_device("metal") as other:
        dev = await am.open_device("metal")
        tl = other.timeline()
        src = await dev.alloc(4 * n)
        await src.write(np.full(n, 0x5A5A5A5A, np.int32))
        host = np.zeros(n, np.int32)
        kept = np.zeros(n, np.int32)
        dev.queue.wait(tl, 1)
        copies = [dev.queue.copy(host, src), dev.queue.copy(kept, src)]
        await dev.close()
        for copy in copies:
            with pytest.raises(am.ClosedResourceError):
                await copy
        ran = metal_sim.handlers()[0]
        tl.signal(1)
        await anyio.sleep(0.1)
        assert metal_sim.handlers()[0] == ran  # (no command buffer of them was committed)
        assert not host.any() and not kept.any()


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
async def test_a_dropped_timeline_frees_its_native_timeline(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each timeline has a native mirror: freed once the timeline is dropped and no
    command that raises it is left to run."""
    freed = timelines_freed(monkeypatch)
    async with am.open_device("metal") as dev:
        empty = await dev.compile(MSL_KERNELS, "empty")
        made = []
        for _ in range(20):
            tl = dev.timeline()
            await dev.queue.signal(tl, 1)
            made.append(tl.native.c_timeline)
            del tl
        await dev.queue.signal(dev.timeline(), 1)  # (the queue notes its last signal)
        for _ in range(2):  # (what the commands kept, and blocks that ran, are let go of)
            await dev.queue.launch(empty)
            gc.collect()
        assert set(made) <= set(freed)


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
@sim_only
async def test_a_fault_fails_its_own_queue_only(anyio_backend: object) -> None:
    """A command buffer that faults fails its command and its queue's later ones; the
    commands of another queue that ran report success."""
    async with am.open_device("metal") as dev:
        fill = await dev.compile(MSL_KERNELS, "fill")
        crash = await dev.compile(FAULTY, "crash")
        good, bad = await dev.alloc(64), await dev.alloc(4)
        other = dev.new_queue()
        ran = [other.launch(fill, good, vals=(7, 16)) for _ in range(5)]
        for done in ran:
            await done
        with pytest.raises(am.DeviceLostError, match="kernel crash faulted"):
            await dev.queue.launch(crash, bad)  # the default queue's value 1
        with pytest.raises(am.DeviceLostError, match="kernel crash faulted"):
            await dev.queue.launch(fill, bad, vals=(1, 1))
        for done in ran:
            await done  # values 1 to 5 of the other queue: they ran
        await other.launch(fill, good, vals=(8, 16))
        host = np.zeros(16, np.int32)
        await other.copy(host, good)  # (the default queue, which reads would use, failed)
        assert (host == 8).all()


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
@sim_only
async def test_a_signal_a_fault_kept_from_running_fails_its_timeline(
    anyio_backend: object,
) -> None:
    """A queue faults, then signals a timeline that another queue waits on: the signal
    fails the timeline (as on cpu and cuda), so the host's wait for it and the other
    queue's commands after its wait raise (before, the completion handler raised the
    timeline whatever the command buffer's status: both reported success)."""
    async with am.open_device("metal") as dev:
        crash = await dev.compile(FAULTY, "crash")
        fill = await dev.compile(MSL_KERNELS, "fill")
        bad, good = await dev.alloc(4), await dev.alloc(64)
        other, tl = dev.new_queue(), dev.timeline()
        crashed = dev.queue.launch(crash, bad)
        signalled = dev.queue.signal(tl, 1)
        other.wait(tl, 1)
        after = other.launch(fill, good, vals=(9, 16))
        with anyio.fail_after(20):
            for done in (crashed, signalled):
                with pytest.raises(am.DeviceLostError):
                    await done
            with pytest.raises(am.DeviceLostError):
                await tl.wait(1)
            with pytest.raises(am.DeviceLostError):
                await after


SPARSE_LAUNCH = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    import anyio, numpy as np
    import asyncmetal as am

    async def main():
        async with am.open_device("metal") as dev:
            k = await dev.compile(sys.argv[4], "k")
            out, inp = await dev.alloc(64), await dev.alloc(64)
            await inp.write(np.arange(16, dtype=np.int32))
            await dev.queue.launch(k, out, inp, vals=(100,), global_size=16)
            print((await out.read(np.int32)).tolist())

    options = {"use_uvloop": True} if sys.argv[3] == "uvloop" else {}
    anyio.run(main, backend=sys.argv[2], backend_options=options)
    """
)


@pytest.mark.metal
@sim_only
@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
def test_each_argument_is_bound_at_its_own_buffer_index(loop: str) -> None:
    """A kernel whose [[buffer(i)]] indices have gaps (0, 2, 3): each argument is bound
    at its parameter's index, the value too (in a fresh process: a kernel argument left
    unbound aborts the simulation, as Metal's validation would trap it)."""
    backend = "trio" if loop == "trio" else "asyncio"
    printed = _in_a_child(SPARSE_LAUNCH, backend, loop, SPARSE, timeout=120)
    assert printed[-1] == str(list(range(100, 116)))


WARNED = """
kernel void warned(device int* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    out[i] = 3;  // __asyncmetal_sim_warning unused variable 'x' [-Wunused-variable]
}
"""


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
@sim_only
async def test_the_compiler_services_warnings_raise_a_compile_warning(
    anyio_backend: object,
) -> None:
    """A kernel the compiler service compiles with warnings warns once, with them as its
    log, and runs; from the cache it warns no more."""
    src = f"{WARNED}// {uuid.uuid4().hex} (not cached by another run)\n"
    async with am.open_device("metal") as dev:
        with pytest.warns(am.CompileWarning) as warned:
            program = await dev.compile(src, "warned")
        assert len(warned) == 1
        log = warned[0].message.log  # type: ignore[union-attr]
        assert "program.metal:3: warning: unused variable 'x'" in log, log
        out = await dev.alloc(16)
        await dev.queue.launch(program, out, global_size=4)
        assert (await out.read(np.int32)).tolist() == [3] * 4
    async with am.open_device("metal") as dev:
        await dev.compile(src, "warned")  # (warnings are errors in the tests)


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
@sim_only
async def test_a_buffer_above_max_buffer_length_is_refused_at_once(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Metal makes no buffer above the device's maxBufferLength (newBufferWithLength:
    returns nil), well within the budget: such a request raises OutOfMemoryError at once,
    while another buffer is held, rather than waiting for frees."""
    monkeypatch.setenv("ASYNCMETAL_SIM_MAX_BUFFER", str(1 << 20))  # the simulation's
    async with am.open_device("metal") as dev:
        assert dev.memory_budget > 1 << 21
        held = await dev.alloc(4096)
        with anyio.fail_after(10), pytest.raises(am.OutOfMemoryError, match="largest buffer"):
            await dev.alloc((1 << 20) + 1)
        largest = await dev.alloc(1 << 20)
        await largest.write(np.ones(1 << 18, np.int32))
        assert int((await largest.read(np.int32)).sum()) == 1 << 18
        await held.free()


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
async def test_a_large_read_stages_off_the_loop_in_order(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy of a large buffer to host memory Metal does not wrap has its staging
    buffer (as large) made on the queue's own thread, not the loop's; it still sees the
    work before it on its source and none after it, and the submissions after it keep
    their order."""
    from asyncmetal.backends.metal import _queue

    unwrapped(monkeypatch)

    made: list[tuple[int, bool]] = []  # (bytes, on the loop's thread)
    send, loop_thread = _queue.send, threading.get_ident()

    def recorded(obj: int, selector: str, *args: Any, **kwargs: Any) -> Any:
        if selector == "newBufferWithLength:options:":
            made.append((args[0], threading.get_ident() == loop_thread))
        return send(obj, selector, *args, **kwargs)

    monkeypatch.setattr(_queue, "send", recorded)
    n = 1 << 20  # 4 MiB of int32
    async with am.open_device("metal") as dev:
        fill = await dev.compile(MSL_KERNELS, "fill")
        buf = await dev.alloc(4 * n)
        firsts, lasts = np.zeros(n, np.int32), np.zeros(n, np.int32)
        small = np.zeros(16, np.int32)
        dev.queue.launch(fill, buf, vals=(1, n))
        first = dev.queue.copy(firsts, buf)
        dev.queue.launch(fill, buf, vals=(2, n))  # after the copy read
        dev.queue.copy(small, buf.view(0, 64))
        await dev.queue.copy(lasts, buf)
        await first
        assert (firsts == 1).all() and (small == 2).all() and (lasts == 2).all()
    large = [on_loop for nbytes, on_loop in made if nbytes == 4 * n]
    assert large == [False, False], made


HOST_MEMORY_NEAR_A_LENT_BUFFER = textwrap.dedent(
    """
    import ctypes, sys
    sys.path.insert(0, sys.argv[1])
    import anyio, numpy as np
    import asyncmetal as am

    async def main():
        async with am.open_device("metal") as dev:
            buf = await dev.alloc(4096)
            view = await buf.map(np.uint8)  # lent while the view lives
            handle = buf._allocation.handle  # the MTLBuffer: an object, not the memory
            near = np.ctypeslib.as_array((ctypes.c_ubyte * 16).from_address(handle))
            out = await dev.alloc(16)
            await dev.queue.copy(out, near)  # a plain host source
            print((await out.read(np.uint8) == near).all(), view.nbytes)

    anyio.run(main)
    """
)


@pytest.mark.metal
@sim_only
def test_host_memory_at_a_lent_buffers_object_is_a_plain_host_operand() -> None:
    """A Metal buffer lent out (a map's view, a DLPack export) was recorded as lent at
    its MTLBuffer's address, as if that were its memory: host memory within that many
    bytes of the object (any heap allocation there, a numpy array a read made) was then
    taken for the buffer's own memory coming back, made a Buffer whose handle Metal
    cannot blit, and the encoder's abandonment killed the process (checked: it did, in
    the child; intermittently in the suite, wherever a read's array fell there)."""
    assert _in_a_child(HOST_MEMORY_NEAR_A_LENT_BUFFER, timeout=60) == ["True 4096"]


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
async def test_a_metal_queue_waits_for_a_cpu_queues_pending_use_of_a_buffer(
    anyio_backend: object,
) -> None:
    """A Metal queue ordered after a cpu buffer (``after``) whose write a cpu queue holds
    (behind a timeline not signalled yet) waits for it -- held on the Metal queue's own
    thread until the cpu queue's thread ran the write: its kernel completes only after
    the write ran.
    A wait for a cpu write discarded instead (its queue closed with discard=True) ends
    all the same, and the kernel behind it fails, naming the first command the discard
    dropped (the held queue's wait). Checked:
    before, the Metal queue skipped the cpu queue's use (metal waited for its own kind
    only) and its kernel completed with the write still held."""
    from tests.support.queues import held_queue

    n = 16
    async with am.open_device("metal") as mtl, am.open_device("cpu") as cpu:
        fill = await mtl.compile(MSL_KERNELS, "fill")
        host = await cpu.alloc(4 * n)
        out = await mtl.alloc(4 * n)
        held, gate = held_queue(cpu)
        write = held.copy(host, np.full(n, 7, np.int32))
        queue = mtl.new_queue()
        queue.after(host)
        launched = queue.launch(fill, out, vals=(5, n))
        seen: list[bool] = []

        async def await_launch() -> None:
            await launched
            seen.append(held.timeline.value >= write.value)  # the write had run

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(await_launch)
                await anyio.sleep(0.05)
                gate.signal(1)
        assert seen == [True]
        assert (await out.read(np.int32)).tolist() == [5] * n

        held, gate = held_queue(cpu)
        write = held.copy(host, np.full(n, 9, np.int32))
        queue.after(host)
        launched = queue.launch(fill, out, vals=(6, n))
        await held.close(discard=True)
        with anyio.fail_after(10):
            with pytest.raises(am.ClosedResourceError) as caught:
                await launched
        assert str(caught.value).startswith(  # (the first it dropped: its wait, 1)
            "this command ran after a device-side wait for a value that command 1 of a "
            "queue of cpu never produced: it was discarded"
        ), caught.value


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
async def test_a_metal_fill_waits_for_a_cpu_copy_that_reads_its_buffer_in_place(
    anyio_backend: object,
) -> None:
    """``am.copy(cpu_buf, metal_buf)`` runs on the cpu queue, reading the Metal buffer's
    shared memory in place; held there (behind a timeline), a Metal fill of that buffer
    submitted meanwhile waits for it on the GPU, so the copy reads what the buffer held
    before the fill. Checked: before, the fill ran first and the copy read zeros."""
    async with am.open_device("metal") as mtl, am.open_device("cpu") as cpu:
        metal_buf = await mtl.alloc(64)
        await metal_buf.write(np.full(16, 3, np.int32))
        cpu_buf = await cpu.alloc(64)
        gate = cpu.timeline()
        cpu.queue.wait(gate, 1)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(am.copy, cpu_buf, metal_buf)
                while not metal_buf.busy():  # the copy submitted on the cpu queue
                    await anyio.sleep(0.001)
                filled = mtl.queue.fill(metal_buf, 0)
                gate.signal(1)
                await filled
        assert (await cpu_buf.read(np.int32)).tolist() == [3] * 16
        assert (await metal_buf.read(np.int32)).tolist() == [0] * 16


@pytest.mark.metal
@sim_only
@pytestmark_loops
@pytest.mark.anyio
async def test_commands_held_behind_a_wait_for_a_cpu_command_never_run_once_abandoned(
    anyio_backend: object,
) -> None:
    """A Metal queue's fill waits for a cpu queue's command (``after``) held behind a
    timeline nobody signals. The Metal device's close abandons the fill (it raises
    ClosedResourceError); the cpu device's close then ends the cpu command (failed):
    the fill never runs -- it was held on the Metal queue's thread, never committed --
    so nothing is gated on the cpu queue's timeline, which goes with that queue, while
    the simulation holds every completion handler of the Metal queue back. Checked:
    before, the fill's command buffer was committed behind the GPU's wait, ran once the
    cpu device closed, and its (held) handler kept the cpu timeline."""
    from asyncmetal.backends.metal._objc import release, retain
    from tests.support.queues import held_queue

    sim = metal_sim.library()
    cpu = await am.open_device("cpu").__aenter__()
    mtl = await am.open_device("metal").__aenter__()
    out = await mtl.alloc(64)
    host = await cpu.alloc(64)
    held, gate = held_queue(cpu)
    held.copy(host, np.full(16, 7, np.int32))
    queue = mtl.new_queue()
    command_queue = retain(queue._native._queue)
    sim.asyncmetal_sim_hold_handlers(command_queue, 1)
    try:
        queue.after(host)
        filled = queue.fill(out, 1)
        queue._native.flush()
        with anyio.fail_after(10):
            await mtl.close()
            with pytest.raises(am.ClosedResourceError):
                await filled
        timeline = weakref.ref(held.timeline.native)
        with anyio.fail_after(10):
            await cpu.close()  # (the cpu command fails: the wait for it ends)
        del cpu, mtl, out, host, held, gate, queue, filled
        with anyio.fail_after(10):
            while timeline() is not None:  # (the loop lets go of its watches later)
                await anyio.sleep(0.01)
                gc.collect()
    finally:
        sim.asyncmetal_sim_hold_handlers(command_queue, 0)
        release(command_queue)


@pytest.mark.metal
@sim_only
@pytestmark_loops
@pytest.mark.anyio
@pytest.mark.parametrize("close", ["queue", "device"])
async def test_a_discarding_close_drops_what_waits_for_a_cpu_command_not_run_yet(
    anyio_backend: object, close: str
) -> None:
    """A Metal queue waits for a cpu queue's command held behind a timeline nobody
    signalled yet. Its close (or its device's) with discard=True returns at once: the
    commands behind the wait are dropped -- each raises ClosedResourceError saying it
    was discarded, and never runs, not even once the cpu command ran -- and no event is
    left made for the wait. Checked: before, the close waited until the cpu command ran."""
    from tests.support.queues import held_queue

    async with am.open_device("cpu") as cpu:
        mtl = await am.open_device("metal")
        fill = await mtl.compile(MSL_KERNELS, "fill")
        out = await mtl.alloc(64)
        await out.write(np.zeros(16, np.int32))
        host = await cpu.alloc(64)
        held, gate = held_queue(cpu)
        held.copy(host, np.full(16, 7, np.int32))
        queue = mtl.new_queue()
        before = metal_sim.live("MTLSharedEvent")  # (its device's timelines, its own)
        queue.after(host)
        dropped = [queue.launch(fill, out, vals=(5, 16)), queue.launch(fill, out, vals=(6, 16))]
        try:
            await _closed_discarding(close, queue, dropped)
        finally:
            gate.signal(1)  # (the cpu command runs: a failed check leaves nothing held)
        await held.synchronize()
        del dropped, queue
        with anyio.fail_after(10):
            while metal_sim.live("MTLSharedEvent") > before:
                await anyio.sleep(0.01)
                gc.collect()
        if close == "queue":
            assert (await out.read(np.int32)).tolist() == [0] * 16  # never ran
            await mtl.close()


async def _closed_discarding(close: str, queue: am.Queue, dropped: list[am.Completion]) -> None:
    """Close ``queue`` (``close`` "queue") or its device with discard=True, and check
    that each of ``dropped`` raises as discarded."""
    with anyio.fail_after(10):
        if close == "queue":
            await queue.close(discard=True)
        else:
            await queue.device.close(discard=True)
        for done in dropped:
            with pytest.raises(am.ClosedResourceError, match="discarded"):
                await done


@pytest.mark.metal
@sim_only
@pytestmark_loops
@pytest.mark.anyio
@pytest.mark.parametrize("close", ["queue", "device"])
@pytest.mark.parametrize("waited", ["device timeline", "queue timeline"])
async def test_a_discarding_close_drops_what_waits_for_a_metal_value_nobody_signals(
    anyio_backend: object, close: str, waited: str
) -> None:
    """A Metal queue waits for a value of a Metal timeline that no command buffer
    committed signals, nor the host: a device timeline's, or another queue's command
    held behind such a wait itself. Its close (or its device's) with discard=True
    returns at once: the commands behind the wait were never committed (held on the
    queue's own thread), are dropped -- each raises ClosedResourceError saying it was
    discarded -- and never run, not even once the value is signalled. Checked: before,
    they were committed behind a GPU wait, and the queue's close waited for good."""
    mtl = await am.open_device("metal")
    fill = await mtl.compile(MSL_KERNELS, "fill")
    out = await mtl.alloc(64)
    await out.write(np.zeros(16, np.int32))
    tl = mtl.timeline()
    queue = mtl.new_queue()
    other = mtl.new_queue()
    if waited == "device timeline":
        queue.wait(tl, 1)
    else:
        other.wait(tl, 1)
        marker = other.marker()
        queue.wait(other.timeline, marker.value)
    dropped = [queue.launch(fill, out, vals=(5, 16)), queue.launch(fill, out, vals=(6, 16))]
    try:
        await _closed_discarding(close, queue, dropped)
    finally:
        if close == "queue":
            tl.signal(1)  # (a failed check leaves nothing held)
    if close == "queue":
        with anyio.fail_after(10):
            await other.close()
        assert (await out.read(np.int32)).tolist() == [0] * 16  # never ran
        await mtl.close()


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
@sim_only
async def test_a_fault_fails_its_queues_timeline_for_a_cpu_queue_that_waits_on_it(
    anyio_backend: object,
) -> None:
    """A Metal queue faults, then copies from a cpu buffer in place (``am.copy``): that
    copy fails with the fault, and its queue's timeline fails from the fault on, so a
    cpu queue ordered after the copy (``after``) -- waiting for that Metal queue's value
    on its thread -- fails its commands from the wait on, naming the fault (as behind a
    wait on a failed cpu command), and a host wait for the value raises. Checked:
    before, the completion handlers raised the timeline as if the commands had run: the
    cpu queue's copy behind the wait ran and reported success."""
    async with am.open_device("metal") as mtl, am.open_device("cpu") as cpu:
        crash = await mtl.compile(FAULTY, "crash")
        bad, metal_buf = await mtl.alloc(4), await mtl.alloc(64)
        cpu_buf = await cpu.alloc(64)
        await cpu_buf.write(np.full(16, 3, np.int32))
        gate = mtl.timeline()
        mtl.queue.wait(gate, 1)  # (what follows waits until the cpu queue waits for it)
        crashed = mtl.queue.launch(crash, bad)
        failed: list[BaseException] = []

        async def copy_in() -> None:
            try:
                await am.copy(metal_buf, cpu_buf)  # (on the Metal queue, after the fault)
            except am.DeviceLostError as exc:
                failed.append(exc)

        host = np.zeros(16, np.int32)
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(copy_in)
                while not cpu_buf.busy():
                    await anyio.sleep(0.001)
                cq = cpu.new_queue()
                copied = cq.after(cpu_buf).copy(host, cpu_buf)
                gate.signal(1)
            assert len(failed) == 1 and "kernel crash faulted" in str(failed[0]), failed
            with pytest.raises(am.DeviceLostError, match="kernel crash faulted"):
                await mtl.queue.timeline.wait(crashed.value)
            with pytest.raises(am.DeviceLostError, match="never produced") as caught:
                await copied
        assert "kernel crash faulted" in str(caught.value), caught.value
        assert not host.any()  # (the copy never ran)


@pytest.mark.metal
@sim_only
def test_a_wait_on_a_timeline_with_a_device_word_is_refused_as_such() -> None:
    """A Metal queue waits on the host for another kind's timeline that its host queue
    raises (a cpu or npy queue's) only: one with a device word (a cuda device's own) is
    refused with an InvalidArgumentError saying so (Backend.waits_for keeps the queues
    from asking)."""
    import ctypes

    from asyncmetal import _native
    from asyncmetal._backend import NativeTimeline
    from asyncmetal.backends.metal import MetalBackend
    from asyncmetal.backends.metal._queue import HostWait

    lib = _native.runtime()
    word = ctypes.c_uint64(0)
    c_timeline = lib.am_timeline_new()
    lib.am_timeline_set_word(c_timeline, ctypes.addressof(word))

    class WithAWord(NativeTimeline):
        value = 0

        def signal(self, value: int) -> None:
            raise AssertionError("not signalled")

    timeline = WithAWord()
    timeline.c_timeline = c_timeline
    backend = MetalBackend(0)
    try:
        assert not backend.waits_for(timeline)
        with pytest.raises(am.InvalidArgumentError, match="cpu or npy queue's timeline only"):
            HostWait(backend, timeline)
    finally:
        lib.am_timeline_free(c_timeline)
        backend.close()


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
@sim_only
async def test_a_fault_awaited_after_its_queues_close_is_reported(anyio_backend: object) -> None:
    """A queue's kernel faults, and the queue closes before anything awaited it: the
    launch and the command after it, awaited then, raise DeviceLostError naming the
    fault. Checked: before, the close let go of the command buffers without looking at
    their status, and both reported success."""
    async with am.open_device("metal") as mtl:
        crash = await mtl.compile(FAULTY, "crash")
        fill = await mtl.compile(MSL_KERNELS, "fill")
        bad, out = await mtl.alloc(4), await mtl.alloc(64)
        queue = mtl.new_queue()
        crashed = queue.launch(crash, bad)
        after = queue.launch(fill, out, vals=(5, 16))
        with anyio.fail_after(20):
            await queue.close()
        for done in (crashed, after):
            with pytest.raises(am.DeviceLostError, match="kernel crash faulted"):
                await done


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
@sim_only
async def test_a_fault_fails_its_queues_timeline_from_the_fault_after_a_discard(
    anyio_backend: object,
) -> None:
    """A Metal queue's kernel, committed behind a wait on the GPU (for a signal another
    queue committed behind a kernel that runs until the test lets it end), then a fill;
    then, held on its own thread, a wait for a cpu command not run yet and what follows
    it. The queue's discarding close drops those, failing its timeline from the first of
    them; then the GPU's wait ends and the kernel faults. The timeline fails from the
    fault on all the same: another Metal queue ordered after the fill (``after``) fails
    its command behind that wait, naming the fault. Checked: before, a failure of an
    earlier value did not lower the timeline's mark (the discard's): the other queue's
    command reported success."""
    from asyncmetal import _native
    from tests.support.queues import held_queue

    async with am.open_device("metal") as mtl, am.open_device("cpu") as cpu:
        crash = await mtl.compile(FAULTY, "crash")
        fill = await mtl.compile(MSL_KERNELS, "fill")
        bad, out, out2, spare = [await mtl.alloc(n) for n in (4, 64, 64, 64)]
        held_buf = await cpu.alloc(64)
        held, cpu_gate = held_queue(cpu)
        held.copy(held_buf, np.full(16, 7, np.int32))  # (runs once cpu_gate is signalled)
        queue = mtl.new_queue()
        gate, release = await gpu_gate(mtl)
        queue.wait(gate, 1)
        queue.launch(crash, bad)
        queue.launch(fill, out, vals=(5, 16))  # (fails: after the fault)
        queue.after(held_buf)  # (held on the queue's thread: the cpu copy has not run)
        dropped = queue.launch(fill, spare, vals=(6, 16))
        c_timeline = queue.timeline.native.c_timeline
        try:
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(lambda: queue.close(discard=True))
                    while _native.timeline_failure(c_timeline) is None:  # (the discard's)
                        await anyio.sleep(0.001)
                    other = mtl.new_queue()
                    behind = other.after(out).launch(fill, out2, vals=(8, 16))
                    release()  # (the GPU's wait ends)
        finally:
            release()
        with anyio.fail_after(20):
            with pytest.raises(am.ClosedResourceError, match="discarded"):
                await dropped
            with pytest.raises(am.DeviceLostError, match="never produced") as caught:
                await behind
        cpu_gate.signal(1)
        await held.synchronize()
        assert "kernel crash faulted" in str(caught.value), caught.value


@pytest.mark.metal
@pytestmark_loops
@pytest.mark.anyio
async def test_metal_memory_is_released_off_the_loop(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An MTLBuffer is released (its memory let go of: pages unmapped, in time that
    grows with its size) on a thread of the backend, not on the loop: evicted by an
    allocation, released beyond the cache's limit, or released by empty_memory_cache.
    Checked: before, each on the loop's thread."""
    from asyncmetal.backends.metal import _backend

    mib = 1 << 20
    async with am.open_device("metal") as dev:
        backend = dev._backend
        allocate, release = backend.allocate, _backend.release
        buffers: set[int] = set()
        threads: list[int] = []

        def recorded_allocate(nbytes: int) -> Any:
            handle = allocate(nbytes)
            buffers.add(handle)
            return handle

        def recorded_release(obj: int) -> None:
            if obj in buffers:
                buffers.discard(obj)
                threads.append(threading.get_ident())
            release(obj)

        monkeypatch.setattr(backend, "allocate", recorded_allocate)
        monkeypatch.setattr(backend._freer, "_release", recorded_release)

        async def released() -> int:
            with anyio.fail_after(10):
                while not threads:
                    await anyio.sleep(0.001)
            return threads.pop()

        loop = threading.get_ident()
        dev.memory_budget = 3 * mib
        await (await dev.alloc(2 * mib)).free()  # cached
        held = await dev.alloc(3 * mib)  # evicts it
        assert await released() != loop
        dev.memory_cache_limit = mib
        await held.free()  # beyond the cache's limit: released
        del held
        assert await released() != loop
        await (await dev.alloc(mib)).free()
        assert await dev.empty_memory_cache() == mib
        assert await released() != loop
        assert not threads


@pytest.mark.metal
@sim_only
@pytestmark_loops
@pytest.mark.anyio
async def test_the_simulations_sleep_kernel_lasts_what_it_is_given(anyio_backend: object) -> None:
    """The shared ``sleep_ms`` kernel sleeps its ``ms`` on the simulated GPU (the
    simulation's hook: a real sleep, which never ends early), as the cpu one does: tests
    that need a command still running count on it. Checked: before, a busy loop whose
    length was the CPU's, about a fifth to a tenth of it."""
    async with am.open_device("metal") as dev:
        sleep = await dev.compile(MSL_KERNELS, "sleep_ms")
        start = time.monotonic()
        await dev.queue.launch(sleep, vals=(100,))
        assert time.monotonic() - start >= 0.1


@pytest.mark.metal
@pytest.mark.anyio
@sim_only
@pytest.mark.parametrize(
    ("what", "nth", "call"),
    [
        ("newSharedEvent", 1, lambda dev, buf, fill: dev.timeline()),
        ("newCommandQueueWithMaxCommandBufferCount:", 2, lambda dev, buf, fill: dev.new_queue()),
        ("commandBuffer", 1, lambda dev, buf, fill: dev.queue.fill(buf, 1)),
        ("blitCommandEncoder", 2, lambda dev, buf, fill: dev.queue.fill(buf, 1)),
        (
            "computeCommandEncoder",
            2,
            lambda dev, buf, fill: dev.queue.launch(fill, buf, vals=(5, 16)),
        ),
    ],
    ids=["event", "queue", "command-buffer", "blit-encoder", "compute-encoder"],
)
async def test_a_metal_object_made_nil_raises_an_asyncmetal_error(
    anyio_backend: object, what: str, nth: int, call: Any
) -> None:
    """Metal returns nil where it has no memory or resources left for an object. Each
    such nil the backend meets is raised at once as an AsyncMetalError (a MemoryError
    too) naming the call, and the device goes on working. Checked: before, a nil event,
    queue or encoder was used as if made (messages to nil do nothing: a launch or fill
    that never ran reported success; a signal of the nil event aborted the simulation as
    Metal's validation would), and a nil command buffer raised a bare MemoryError."""
    async with am.open_device("metal") as mtl:
        fill = await mtl.compile(MSL_KERNELS, "fill")
        buf = await mtl.alloc(64)
        metal_sim.fail_at(nth)
        try:
            with pytest.raises(am.AsyncMetalError, match=f"{what} returned nil") as caught:
                call(mtl, buf, fill)
        finally:
            metal_sim.fail_at(-1)
        assert isinstance(caught.value, MemoryError)
        await mtl.queue.launch(fill, buf, vals=(5, 16))
        assert (await buf.read(np.int32) == 5).all()

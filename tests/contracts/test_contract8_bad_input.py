"""Contract 8: bad input gets a clear error before anything is submitted."""

from __future__ import annotations

import copy
import functools
import itertools
import pickle
import re

import anyio
import numpy as np
import pytest

import asyncmetal as am
from tests.support.refusals import rejects as _rejects

pytestmark = pytest.mark.anyio


async def test_wrong_argument_counts_and_types(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    q, add, fill = device.queue, kernels["add"], kernels["fill"]
    a = await device.alloc(16)
    _rejects(
        device,
        am.ArgumentTypeError,
        "takes 3 buffers, got 2",
        lambda: q.launch(add, a, a, vals=(4,)),
    )
    _rejects(
        device,
        am.ArgumentTypeError,
        r"takes 1 value \(vals\), got 0",
        lambda: q.launch(add, a, a, a),
    )
    _rejects(device, am.ArgumentTypeError, "takes 1 buffer, got 0", lambda: q.launch(fill))
    _rejects(
        device, am.ArgumentTypeError, r"takes 2 values \(vals\), got 0", lambda: q.launch(fill, a)
    )
    _rejects(
        device,
        am.ArgumentTypeError,
        "buffer 1 of 'add' must be a Buffer, got ndarray",
        lambda: q.launch(add, a, np.zeros(4), a, vals=(4,)),
    )
    _rejects(
        device,
        am.ArgumentTypeError,
        r"vals\[0\] of 'fill' must be an integer, got float",
        lambda: q.launch(fill, a, vals=(1.5, 2)),
    )
    _rejects(
        device,
        am.ArgumentTypeError,
        r"vals\[1\] of 'fill' must be an integer, got bool",
        lambda: q.launch(fill, a, vals=(1, True)),
    )
    _rejects(
        device,
        am.InvalidArgumentError,
        "must fit in int32",
        lambda: q.launch(fill, a, vals=(1 << 40, 1)),
    )
    _rejects(
        device, am.ArgumentTypeError, "vals must be a sequence", lambda: q.launch(fill, a, vals=3)
    )  # type: ignore[arg-type]
    _rejects(device, am.ArgumentTypeError, "program must be a Program", lambda: q.launch("add"))  # type: ignore[arg-type]
    _rejects(
        device,
        am.InvalidArgumentError,
        "global_size must hold ints >= 1",
        lambda: q.launch(fill, a, vals=(1, 1), global_size=(0, 1, 1)),
    )
    _rejects(
        device,
        am.ArgumentTypeError,
        "local_size must be an int or a tuple",
        lambda: q.launch(fill, a, vals=(1, 1), local_size=(1, 1, 1, 1)),
    )
    # The errors are also plain ValueError / TypeError for code that catches those.
    assert issubclass(am.InvalidArgumentError, ValueError)
    assert issubclass(am.ArgumentTypeError, TypeError)


async def test_timeline_values_must_increase(device: am.Device) -> None:
    tl = device.timeline()
    tl.signal(5)
    with pytest.raises(
        am.InvalidArgumentError, match=r"5 does not increase the timeline.*expected > 5"
    ):
        tl.signal(5)
    _rejects(
        device, am.InvalidArgumentError, "3 does not increase", lambda: device.queue.signal(tl, 3)
    )
    device.queue.signal(tl, 9)  # a submitted signal counts too, before it runs
    with pytest.raises(am.InvalidArgumentError, match="expected > 9"):
        tl.signal(7)
    with pytest.raises(am.InvalidArgumentError, match=r"in \[0, 2\*\*64 - 1\]"):
        tl.signal(-1)
    with pytest.raises(am.ArgumentTypeError, match="value must be an int, got str"):
        await tl.wait("3")  # type: ignore[arg-type]
    with pytest.raises(am.InvalidArgumentError, match="queue's own timeline"):
        device.queue.timeline.signal(100)
    other = device.new_queue()
    _rejects(
        device,
        am.InvalidArgumentError,
        "own timeline",
        lambda: other.signal(device.queue.timeline, 100),
    )
    _rejects(
        device, am.ArgumentTypeError, "timeline must be a Timeline", lambda: device.queue.wait(3, 1)
    )  # type: ignore[arg-type]


async def test_a_failed_timeline_refuses_signals(anyio_backend: object) -> None:
    """A timeline whose queue signal was discarded fails (on cpu, where a discard drops
    a device wait held for a value nobody signals): its value goes to 2**64 - 1 and
    every wait for a value from there on raises. A later signal of it -- from the host,
    or a queue -- can raise it to nothing: refused, naming the failure, before anything
    is submitted. Checked failing without: both were accepted, the queue's completing as
    if it had signalled 7, and a wait for 7 then raised."""
    async with am.open_device("cpu") as device:
        tl, gate = device.timeline(), device.timeline()
        q = device.new_queue()
        q.wait(gate, 1)
        q.signal(tl, 5)
        await q.close(discard=True)
        assert tl.value == 2**64 - 1
        why = "cannot be signalled: this timeline will not reach {}: .* discarded"
        with pytest.raises(am.ClosedResourceError, match=why.format(10)):
            tl.signal(10)
        _rejects(
            device,
            am.ClosedResourceError,
            why.format(7),
            lambda: device.queue.signal(tl, 7),
        )
        with pytest.raises(am.ClosedResourceError, match="will not reach 7"):
            await tl.wait(7)
        other = device.timeline()  # (the device and its default queue are unaffected)
        await device.queue.signal(other, 1)
        assert other.value == 1


async def test_closed_device_and_its_objects(anyio_backend: object) -> None:
    dev = await am.open_device("cpu:5")
    prog = await dev.compile("void k(int* x) { x[0] = 1; }", "k")
    buf = await dev.alloc(4)
    tl = dev.timeline()
    q = dev.queue
    await dev.close()
    for action, match in [
        (lambda: q.launch(prog, buf), "closed"),
        (lambda: tl.signal(1), "closed"),
        (lambda: dev.new_queue(), "closed"),
        (lambda: dev.timeline(), "closed"),
    ]:
        with pytest.raises(am.ClosedResourceError, match=match):
            action()
    with pytest.raises(am.ClosedResourceError, match="closed"):
        await dev.alloc(4)
    with pytest.raises(am.ClosedResourceError, match="closed"):
        await dev.compile("void k(void) {}", "k")
    with pytest.raises(am.ClosedResourceError, match="closed device cpu:5"):
        await buf.read()


async def test_a_closed_devices_settings_are_refused(
    anyio_backend: object, device_name: str
) -> None:
    """Setting ``memory_budget``, ``memory_cache_limit`` or ``compile_pool`` on a closed
    device raises ClosedResourceError, as every other use of it does, and changes
    nothing (what they read stays readable). Checked failing before: each setting was
    taken silently."""
    dev = await am.open_device(device_name)
    budget, limit, pool = dev.memory_budget, dev.memory_cache_limit, dev.compile_pool
    await dev.close()
    for setting, value in [
        ("memory_budget", 1 << 20),
        ("memory_budget", None),
        ("memory_cache_limit", 0),
        ("memory_cache_limit", None),
        ("compile_pool", pool),
    ]:
        with pytest.raises(am.ClosedResourceError, match=f"device {device_name} is closed"):
            setattr(dev, setting, value)
    assert (dev.memory_budget, dev.memory_cache_limit) == (budget, limit)
    assert dev.compile_pool is pool


async def test_a_closed_devices_synchronize_is_refused(
    anyio_backend: object, device_name: str
) -> None:
    """``await dev.synchronize()`` once the device is closed raises ClosedResourceError,
    as its other calls do, rather than returning as if its work had run. Checked:
    fails without the fix (it returned None)."""
    dev = await am.open_device(device_name)
    await dev.synchronize()
    await dev.close()
    with anyio.fail_after(10):
        with pytest.raises(am.ClosedResourceError, match=f"device {device_name} is closed"):
            await dev.synchronize()


async def test_buffer_of_another_device_is_refused(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    async with am.open_device("cpu:7") as other:
        foreign = await other.alloc(16)
        _rejects(
            device,
            am.InvalidArgumentError,
            "is on cpu:7, expected a buffer of cpu",
            lambda: device.queue.launch(kernels["fill"], foreign, vals=(1, 1)),
        )
        foreign_prog = await other.compile("void k(void) {}", "k")
        _rejects(
            device,
            am.InvalidArgumentError,
            "compiled for cpu:7, not cpu",
            lambda: device.queue.launch(foreign_prog),
        )
        # A fill is pointed to the buffer's own device's queues (asyncmetal.copy, where
        # a copy is pointed, fills nothing; checked: a fill was told to use it).
        _rejects(
            device,
            am.InvalidArgumentError,
            r"buf is a buffer of cpu:7, not of cpu, whose queue this is: fill it on a "
            r"queue of its device \(buf.device.queue.fill\)$",
            lambda: device.queue.fill(foreign, 0),
        )


async def test_a_device_opened_under_the_same_name_is_told_apart(anyio_backend: object) -> None:
    """Each open_device opens a device of its own: two opened as cpu are two devices,
    and a refusal says which is which (before: "is on cpu, expected a buffer of cpu")."""
    async with am.open_device("cpu") as first, am.open_device("cpu") as second:
        assert first is not second and first.name == second.name == "cpu"
        k = await second.compile("void k(int* x) {}", "k")
        buf = await second.alloc(4)
        with pytest.raises(
            am.InvalidArgumentError, match="compiled for another device opened as cpu, not cpu"
        ):
            first.queue.launch(k, buf)
        k = await first.compile("void k(int* x) {}", "k")
        with pytest.raises(
            am.InvalidArgumentError,
            match="is on another device opened as cpu, expected a buffer of cpu",
        ):
            first.queue.launch(k, buf)


async def test_freed_buffer_is_refused(device: am.Device, kernels: dict[str, am.Program]) -> None:
    buf = await device.alloc(16)
    await buf.free()
    _rejects(
        device,
        am.ClosedResourceError,
        "was freed",
        lambda: device.queue.launch(kernels["fill"], buf, vals=(1, 1)),
    )
    with pytest.raises(am.ClosedResourceError, match="was freed"):
        await buf.free()  # freeing twice


async def test_missing_kernel_name(device: am.Device) -> None:
    with pytest.raises(am.CompileError, match="kernel 'nope': not defined"):
        await device.compile("void k(void) {}", "nope")
    # A name only declared or called, never defined, is missing too.
    with pytest.raises(am.CompileError, match="kernel 'g': not defined"):
        await device.compile("void g(int);\nvoid k(void) { }", "g")


_TWO_KERNELS = {
    "cpu": "static void helper(float* a) {}\n"
    "void scale(float* a, float s) { if (s) { helper(a); } }\n"
    "void shift(float* a, float s) { for (;;) { break; } }\n",
    "metal": "void helper(device float* a) {}\n"
    "kernel void scale(device float* a [[buffer(0)]], constant float& s [[buffer(1)]]) {}\n"
    "kernel void shift(device float* a [[buffer(0)]], constant float& s [[buffer(1)]]) {}\n",
}


async def test_a_missing_kernel_lists_those_the_source_defines(device: am.Device) -> None:
    """A mistyped name gets the names of the kernels the source does define (sorted; not
    its static or non-kernel helpers, nor ``if``/``for``) and the nearest of them, in
    the message and as ``defined``, also after pickling and from compile_many (checked:
    the message named only the missing kernel)."""
    src = _TWO_KERNELS["metal" if device.name == "metal" else "cpu"]
    expected = "kernel 'scal': not defined in the source; it defines 'scale', 'shift'"
    with pytest.raises(am.NotDefinedError) as info:
        await device.compile(src, "scal")
    assert str(info.value) == expected + " (did you mean 'scale'?)"
    assert info.value.defined == ("scale", "shift") and info.value.name == "scal"
    copy = pickle.loads(pickle.dumps(info.value))
    assert str(copy) == str(info.value) and copy.defined == ("scale", "shift")
    with pytest.raises(am.NotDefinedError, match=re.escape(expected)):
        await device.compile_many([(src, "scal")]).__anext__()


async def test_a_missing_kernel_of_a_long_source_lists_some(device: am.Device) -> None:
    """A source of many kernels: the message lists the first ten names, sorted, says
    how many more there are and names the nearest (one not listed here); ``defined``
    has them all."""
    if device.name == "metal":
        kernel = "kernel void k{}(device int* a [[buffer(0)]]) {{}}"
    else:
        kernel = "void k{}(int* a) {{}}"
    src = "\n".join(kernel.format(i) for i in range(25))
    with pytest.raises(am.NotDefinedError) as info:
        await device.compile(src, "k_24")
    names = sorted(f"k{i}" for i in range(25))
    assert info.value.defined == tuple(names)
    shown = ", ".join(map(repr, names[:10]))
    assert str(info.value).endswith(
        f"it defines 25 kernels: {shown}, ... (15 more) (did you mean 'k24'?)"
    )
    with pytest.raises(am.NotDefinedError, match=r"it defines no kernel$"):
        await device.compile("int unused;", "k")


async def test_a_kernel_a_macro_names_or_makes_says_why_it_is_not_seen(
    anyio_backend: object,
) -> None:
    """A kernel whose name or definition a macro of the source makes compiles, but its
    parameters cannot be read: the error says so, whichever name is asked for, also
    after pickling (checked: it said only "not defined in the source; it defines 'K'",
    and for the macro's own name "not defined in the compiled code")."""
    async with am.open_device("cpu") as device:
        named = "#define K scale\nvoid K(float *a) { a[0] = 1; }\n"
        made = "#define DEFINE(n) void n(float *a) { a[0] = 1; }\nDEFINE(scale)\n"
        for src in (named, made):
            with pytest.raises(am.NotDefinedError) as info:
                await device.compile(src, "scale")
            assert "a kernel defined in a header, or whose name or definition a macro" in str(
                info.value
            )
            assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)
        with pytest.raises(am.CompileError, match="'K' is a macro of the source"):
            await device.compile(named, "K")
        # A name the source does not use at all gets no such hint.
        with pytest.raises(am.NotDefinedError) as info:
            await device.compile(named, "other")
        assert "macro" not in str(info.value)


async def test_a_kernel_defined_in_k_and_r_style_is_refused_saying_why(device: am.Device) -> None:
    """An old-style (K&R) definition, which cc compiles, is refused before compiling,
    saying so and what to write instead (checked: it was "not defined in the
    source"): its float values would arrive as doubles, and C23 removes the style. A
    call followed by a block is no such definition."""
    for src in (
        "void k(a, n)\n  float *a;\n  int n;\n{ a[0] = n; }\n",
        "void k(a, b, s) float *a, *b; float s; { a[0] = b[0] * s; }",
    ):
        with pytest.raises(am.CompileError, match="kernel 'k' is defined in K&R style") as info:
            await device.compile(src, "k")
        assert not isinstance(info.value, am.NotDefinedError) and info.value.name == "k"
        assert "Use a prototype-style definition: void k(float *a, int n)" in str(info.value)
    calls = "void h(float *a, int n);\nvoid g(float *a, int n) { h(a, n); { a[0] = 1; } }"
    with pytest.raises(am.NotDefinedError, match="kernel 'h': not defined"):
        await device.compile(calls, "h")


def test_a_cuda_parameter_of_a_using_pointer_alias_is_a_buffer() -> None:
    """C++'s typedef, ``using fp = float*;`` (or of an array, which a parameter takes
    as a pointer), makes a buffer as C's typedef does (no GPU needed: read from the
    source). Checked: before, ``fp v`` was read as a value of a type not known, and a
    value given for it was taken as an address."""
    from asyncmetal.backends.cuda import CUDACompiler

    src = (
        "using fp = const float *__restrict__;\nusing vec3 = float[3];\nusing real = float;\n"
        'extern "C" __global__ void k(fp in, vec3 out, real s) { out[0] = in[0] * s; }\n'
    )
    signature = CUDACompiler()._signature(src, "k")
    assert signature.kinds == ("buffer", "buffer", "value")
    assert signature.values == (("float32", "real s"),)


def test_a_missing_cuda_kernel_lists_the_global_functions() -> None:
    """The cuda backend reads its kernels' parameters from the source too (no GPU
    needed): its list holds the ``__global__`` functions, not the ``__device__`` ones."""
    from asyncmetal.backends.cuda import CUDACompiler

    src = (
        "__device__ float twice(float x) { return 2 * x; }\n"
        'extern "C" __global__ void scale(float* a, float s) { a[0] = twice(s); }\n'
        'extern "C" {\n__global__ void shift(float* a, float s) { a[0] += s; }\n}\n'
    )
    with pytest.raises(am.NotDefinedError) as info:
        CUDACompiler()._signature(src, "twice_")
    assert info.value.defined == ("scale", "shift")
    assert str(info.value).endswith("it defines 'scale', 'shift'")


async def test_a_kernel_without_external_linkage_says_why(device: am.Device) -> None:
    """A C kernel declared static (or plain inline) compiles but its symbol is not in the
    library: the error says so (checked: it said only "not defined in the compiled
    code")."""
    for prefix, why in (("static ", "declared static"), ("inline ", "declared inline")):
        with pytest.raises(am.CompileError, match=f"not defined in the compiled code; .*{why}"):
            await device.compile(f"{prefix}void k(float *a) {{ a[0] = 1; }}", "k")
    program = await device.compile("extern inline void k(float *a) { a[0] = 1; }", "k")
    assert program.name == "k"


async def test_a_signature_that_does_not_compile_carries_the_log(device: am.Device) -> None:
    """No definition is found where the very signature is broken: the compiler's error
    comes out, with its log, rather than a kernel said to be missing (checked: it was
    "not defined in the source", with no log)."""
    broken = "void f( {"
    with pytest.raises(am.CompileError) as info:
        await device.compile(broken, "f")
    assert "not defined" not in str(info.value) and info.value.log and info.value.name == "f"
    with pytest.raises(am.CompileError) as info:
        await device.compile_many([(broken, "f")]).__anext__()
    assert "not defined" not in str(info.value) and info.value.log and info.value.name == "f"
    with pytest.raises(am.CompileError, match="kernel 'g': not defined"):  # it compiles
        await device.compile_many([("void f(void) {}", "g")]).__anext__()


async def test_value_parameters_must_be_scalars(device: am.Device) -> None:
    """Launch values are integers and floats: a cpu kernel's ``long double`` or struct
    parameter would get garbage from them (the C calling convention passes those
    elsewhere). Refused at compile, before compiling; ``float`` and ``double`` are read
    as their types."""
    for declaration in ("long double a", "struct pair { int x; } a", "_Complex double a"):
        source = f"void k(int* out, {declaration}, int n) {{ out[0] = n; }}"
        with pytest.raises(am.CompileError, match="is not a scalar") as info:
            await device.compile(source, "k")
        assert info.value.name == "k" and declaration in str(info.value)
        assert "a bool, a half, float or double" in str(info.value)  # (what it would take)
    ints = "void k(int* out, long a, unsigned n, unsigned long long m, char c, _Bool b) {}"
    program = await device.compile(ints, "k")
    assert program.params == ("buffer",) + ("value",) * 5
    assert [t for t, _ in program.value_types] == ["int64", "uint32", "uint64", "int8", "bool"]
    # Named like a type, still an int (the name is not the type).
    named = "void k(int* out, int half, unsigned float_count, int struct_size) {}"
    program = await device.compile(named, "k")
    assert program.params == ("buffer",) + ("value",) * 3
    assert [t for t, _ in program.value_types] == ["int32", "uint32", "int32"]
    floats = "typedef double real; void k(float a, int* out, const real b, _Float16 c) {}"
    program = await device.compile(floats, "k")
    assert [t for t, _ in program.value_types] == ["float32", "float64", "float16"]


async def test_c_that_does_not_compile_carries_the_log(device: am.Device) -> None:
    with pytest.raises(am.CompileError) as info:
        await device.compile("void k(void) { this is not C; }", "k")
    err = info.value
    assert "error" in err.log
    assert "this is not C" in err.log or "unknown type name" in err.log
    assert err.log in str(err)


async def test_bad_compile_arguments(device: am.Device) -> None:
    with pytest.raises(am.ArgumentTypeError, match="takes two str"):
        await device.compile(b"void k(void){}", "k")  # type: ignore[arg-type]


async def test_bad_dtypes_and_shapes_raise_asyncmetals_errors(device: am.Device) -> None:
    """Checked before anything is read (before: numpy's own TypeError and ValueError,
    the read's after its copy)."""
    buf = await device.alloc(64)
    await buf.write(np.arange(16, dtype=np.int32))
    with pytest.raises(am.ArgumentTypeError, match="dtype"):
        buf.typed("nope")
    with pytest.raises(am.ArgumentTypeError, match="shape"):
        buf.typed(np.int32, "4")
    # Never bools, nor None for a dtype (numpy's float64): checked, both were taken.
    with pytest.raises(am.ArgumentTypeError, match="dtype"):
        buf.typed(None)
    for shape in ((True, 16), (4, np.True_), True):
        with pytest.raises(am.ArgumentTypeError, match="shape"):
            buf.typed(np.int32, shape)
    assert buf.typed(np.int32, (np.int64(4), 4)).shape == (4, 4)
    for read in (buf.read, buf.map):
        with pytest.raises(am.InvalidArgumentError, match=r"shape \(5,\) does not cover"):
            await read(np.int32, (5,))
        with pytest.raises(am.ArgumentTypeError, match="shape"):
            await read(np.int32, "4")
        assert (await read(np.int32, (4, -1))).tolist()[1] == [4, 5, 6, 7]


async def test_read_and_map_take_a_sub_array_dtype_with_a_shape(device: am.Device) -> None:
    """Its own dimensions come after the shape's, as with no shape (and as numpy's
    ``np.empty(shape, dtype)``). Checked: without it, a shape raised numpy's ValueError
    (from read, once its copy had run), and -1 flattened the items' dimensions."""
    buf = await device.alloc(32)
    await buf.write(np.arange(8, dtype=np.int32))
    pair = np.dtype((np.int32, 2))
    expected = np.arange(8).reshape(4, 2).tolist()
    for read in (buf.read, buf.map):
        assert (await read(pair)).tolist() == expected
        assert (await read(pair, (4,))).tolist() == expected
        assert (await read(pair, (-1,))).tolist() == expected
        assert (await read(pair, (2, 2))).shape == (2, 2, 2)
        with pytest.raises(am.InvalidArgumentError, match=r"shape \(8,\) does not cover"):
            await read(pair, (8,))


async def test_a_freed_buffer_used_again_says_what_to_do(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """Also a view of it, also after ``async with`` freed it (checked: it said only
    that the buffer was freed)."""
    told = r"was freed: .* stays unusable: allocate another"
    async with await device.alloc(16) as buf:
        view = buf.view(0, 8)
    with pytest.raises(am.ClosedResourceError, match=rf"^buffer {told}"):
        await buf.read()
    with pytest.raises(am.ClosedResourceError, match=rf"^buffer {told}"):
        await view.write(bytes(8))
    _rejects(
        device,
        am.ClosedResourceError,
        rf"^buffer 0 of 'fill' {told}",
        lambda: device.queue.launch(kernels["fill"], view, vals=(1, 2)),
    )


async def test_refusals_name_what_was_called(device: am.Device) -> None:
    """Not the internals' names (before: "src was freed" from read, "wrap takes" from
    from_numpy, and an empty kernel name compiled before it was refused)."""
    buf = await device.alloc(16)
    await buf.free()
    with pytest.raises(am.ClosedResourceError, match=r"^buffer was freed"):
        await buf.read()
    with pytest.raises(am.ClosedResourceError, match=r"^buffer was freed"):
        await buf.write(bytes(16))
    with pytest.raises(am.ArgumentTypeError, match=r"^from_numpy takes a numpy array, got list"):
        await am.from_numpy([1, 2])
    with pytest.raises(am.InvalidArgumentError, match="name is empty"):
        await device.compile("void k(void) {}", "")


async def test_a_write_of_the_wrong_size_points_to_a_view(device: am.Device) -> None:
    """write() takes no nbytes (before: the copy's "pass nbytes to copy a prefix")."""
    buf = await device.alloc(64, zeroed=True)
    with pytest.raises(am.InvalidArgumentError, match="data holds 8 bytes") as small:
        await buf.write(np.zeros(2, np.float32))
    assert "nbytes" not in str(small.value) and "buf.view(offset, 8)" in str(small.value)
    with pytest.raises(am.InvalidArgumentError, match="data holds 800 bytes") as large:
        await buf.write(np.zeros(100))
    assert "nbytes" not in str(large.value)
    await buf.view(8, 8).write(np.ones(2, np.float32))
    assert (await buf.read(np.float32))[2:5].tolist() == [1, 1, 0]


async def test_a_view_of_a_wrong_type_names_the_type(device: am.Device) -> None:
    """Before: an offset of True was taken as 1, and a float's refusal was its range's."""
    buf = await device.alloc(64)
    with pytest.raises(am.ArgumentTypeError, match="offset must be an int, got float"):
        buf.view(8.0, 8)  # type: ignore[arg-type]
    with pytest.raises(am.ArgumentTypeError, match="nbytes must be an int or None, got str"):
        buf.view(8, "8")  # type: ignore[arg-type]
    with pytest.raises(am.ArgumentTypeError, match="offset must be an int, got bool"):
        buf.view(True, 8)
    with pytest.raises(am.ArgumentTypeError, match="offset must be an int, got bool"):
        buf.view(np.True_, 8)  # type: ignore[arg-type]
    with pytest.raises(am.InvalidArgumentError, match=r"nbytes must be an int in \[1, 56\]"):
        buf.view(8, 57)
    assert buf.view(8, 8).nbytes == 8 and buf.view(8).nbytes == 56


async def test_numpy_integers_are_sizes_offsets_and_values(device: am.Device) -> None:
    """Sizes, offsets, budgets and timeline values take numpy's integer scalars, as
    ``range`` and numpy's own indexing do (``alloc(np.prod(shape) * 4)``), each taken as
    a plain int. Checked: before, each was refused ("nbytes must be an int, got int64")."""
    four = np.int64(4)
    buf = await device.alloc(np.prod((4, 4)) * four)
    assert buf.nbytes == 64 and type(buf.nbytes) is int
    view = buf.view(np.uint8(8), np.int32(8))
    assert (view.offset, view.nbytes) == (8, 8) and type(view.offset) is int
    await device.queue.fill(buf, 0)
    await device.queue.fill(buf, 7, offset=np.int16(4), size=np.uint64(4))
    assert (await buf.read(np.uint8))[:12].tolist() == [0] * 4 + [7] * 4 + [0] * 4
    other = await device.alloc(64, zeroed=True)
    await device.queue.copy(other, buf, nbytes=np.int64(8))
    assert (await other.read(np.uint8))[:8].tolist() == [0] * 4 + [7] * 4
    device.memory_budget = np.int64(1 << 30)
    device.memory_cache_limit = np.uint32(1 << 20)
    assert (device.memory_budget, device.memory_cache_limit) == (1 << 30, 1 << 20)
    tl = device.timeline()
    tl.signal(np.uint64(3))
    await tl.wait(np.int8(3))
    await device.queue.signal(tl, np.int64(4))
    await device.queue.wait(tl, np.uint16(4))
    assert tl.value == 4
    device.memory_budget = None
    device.memory_cache_limit = None


async def test_bad_allocations(device: am.Device) -> None:
    for size, exc in [
        (0, am.InvalidArgumentError),
        (-5, am.InvalidArgumentError),
        (1.5, am.ArgumentTypeError),
        (True, am.ArgumentTypeError),
    ]:
        with pytest.raises(exc, match="nbytes"):
            await device.alloc(size)  # type: ignore[arg-type]


async def test_an_allocation_timeout_may_be_a_numpy_scalar(device: am.Device) -> None:
    """As compile's timeout may (before: "timeout must be a number >= 0, got
    np.float32(0.05)")."""
    device.memory_budget = 4096
    held = await device.alloc(4096)
    for timeout in (np.float32(0.05), np.float64(0.05)):  # (an np.float32 deadline once
        with pytest.raises(am.OutOfMemoryError, match=r"within 0\.050*\d* s"):  # broke trio)
            await device.alloc(512, timeout=timeout)
    with pytest.raises(am.ArgumentTypeError, match="timeout must be a number of seconds"):
        await device.alloc(512, timeout="1")  # type: ignore[arg-type]
    with pytest.raises(am.InvalidArgumentError, match="timeout must be a number >= 0"):
        await device.alloc(512, timeout=np.float64("nan"))
    await held.free()
    await (await device.alloc(512, timeout=np.float32(1))).free()
    await (await device.alloc(512, timeout=np.int64(1))).free()


async def test_bad_copies(device: am.Device) -> None:
    buf = await device.alloc(64)
    q = device.queue
    _rejects(
        device,
        am.InvalidArgumentError,
        "sizes do not match: dst holds 64 bytes, src 32",
        lambda: q.copy(buf, np.zeros(8, np.float32)),
    )
    _rejects(
        device, am.InvalidArgumentError, "nbytes must be > 0", lambda: q.copy(buf, bytes(64), 0)
    )
    _rejects(device, am.InvalidArgumentError, "exceeds", lambda: q.copy(buf, bytes(64), 65))
    _rejects(
        device,
        am.InvalidArgumentError,
        "not C-contiguous",
        lambda: q.copy(buf, np.zeros((8, 4), np.float32)[:, ::2].copy()[:, ::1].T),
    )
    _rejects(device, am.InvalidArgumentError, "read-only", lambda: q.copy(b"x" * 64, buf))
    _rejects(
        device,
        am.InvalidArgumentError,
        "overlap",
        lambda: q.copy(buf.view(0, 32), buf.view(16, 32)),
    )
    _rejects(device, am.ArgumentTypeError, "needs a Buffer", lambda: q.copy(bytearray(4), b"1234"))
    _rejects(device, am.ArgumentTypeError, "buffer protocol", lambda: q.copy(buf, [1, 2, 3]))
    with pytest.raises(am.InvalidArgumentError, match="whole number"):
        await buf.view(0, 6).read(np.float32)


@pytest.mark.anyio
async def test_a_queue_waiting_for_its_own_later_value_is_refused(device: am.Device) -> None:
    """Its commands after the wait would run only after it: never. Checked: before, it
    was accepted and the queue waited until the device closed."""
    queue = device.new_queue()
    with pytest.raises(am.InvalidArgumentError, match="its own value 1"):
        queue.wait(queue.timeline, 1)
    assert queue.submitted == 0
    queue.signal(device.timeline(), 1)
    await queue.wait(queue.timeline, 1)  # a value already submitted: accepted


async def test_mistakes_a_newcomer_makes_are_named(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """What the refusal of a common slip says: a Program or Buffer not awaited, a view
    freed on its own, a copy on another device's queue, open_device in a plain with."""
    fill = kernels["fill"]
    buf = await device.alloc(16)
    pending = device.compile("void k(void) {}", "k")
    _rejects(
        device,
        am.ArgumentTypeError,
        "forget to await compile",
        lambda: device.queue.launch(pending),
    )  # type: ignore[arg-type]
    pending.close()
    pending = device.alloc(16)
    _rejects(
        device,
        am.ArgumentTypeError,
        "forget to await alloc",
        lambda: device.queue.launch(fill, pending, vals=(1, 1)),  # type: ignore[arg-type]
    )
    pending.close()
    with pytest.raises(am.InvalidArgumentError, match="source and name swapped"):
        await device.compile("k", "void k(void) {}")
    with pytest.raises(am.InvalidArgumentError, match="offset 16 leaves no bytes"):
        buf.view(16, 1)
    view = buf.view(4, 8)
    assert "a view at 4" in repr(view)
    with pytest.raises(am.InvalidArgumentError, match="freed with the buffer it views"):
        await view.free()
    async with buf.view(0, 8):
        pass  # frees nothing
    assert not buf.freed and not view.freed
    async with am.open_device("cpu:8") as other:
        elsewhere = await other.alloc(16)
        pairs = [(elsewhere, np.zeros(16, np.uint8))]
        if device.kind == other.kind:  # (another kind's queue writes it in place: contract 5)
            pairs.append((elsewhere, buf))
        for dst, src in pairs:
            _rejects(
                device,
                am.InvalidArgumentError,
                rf"dst is a buffer of cpu:8, not of {device.name}, .*asyncmetal\.copy",
                lambda dst=dst, src=src: device.queue.copy(dst, src),
            )
        _rejects(
            device,
            am.InvalidArgumentError,
            "src is a buffer of cpu:8",
            lambda: device.queue.copy(np.zeros(16, np.uint8), elsewhere),
        )
    with pytest.raises(TypeError, match="async with open_device"), am.open_device("cpu"):  # type: ignore[attr-defined]
        pass
    await buf.free()
    assert view.freed


async def test_more_slips_are_named(
    device: am.Device, kernels: dict[str, am.Program], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A typed view, an npy buffer or an un-awaited from_numpy where a buffer goes, a
    buffer among vals, an opener used as a device, a bad $ASYNCMETAL_DEVICE, a pool that
    is not one (checked: each refused without saying why, the pool only at the next
    compile)."""
    fill, add = kernels["fill"], kernels["add"]
    buf = await device.alloc(16)
    typed = buf.typed(np.int32)
    hint = r"typed view is for export: pass its \.buffer"
    _rejects(
        device, am.ArgumentTypeError, hint, lambda: device.queue.launch(fill, typed, vals=(1, 4))
    )  # type: ignore[arg-type]
    _rejects(device, am.ArgumentTypeError, hint, lambda: device.queue.copy(buf, typed))
    with pytest.raises(am.ArgumentTypeError, match=hint):
        await am.copy(typed, np.zeros(4, np.int32))  # type: ignore[arg-type]
    pending = am.from_numpy(np.zeros(4, np.int32))
    with pytest.raises(am.ArgumentTypeError, match="forget to await from_numpy"):
        await am.copy(buf, pending)  # type: ignore[arg-type]
    pending.close()
    held = await am.from_numpy(np.zeros(4, np.int32))
    _rejects(
        device,
        am.InvalidArgumentError,
        f"npy buffers hold data only: am.copy it into a {device.kind} buffer",
        lambda: device.queue.launch(fill, held, vals=(1, 4)),
    )
    _rejects(
        device,
        am.ArgumentTypeError,
        r"vals\[0\] is a Buffer",
        lambda: device.queue.launch(add, buf, buf, vals=(buf, 4)),  # type: ignore[arg-type]
    )
    await device.queue.launch(fill, buf, vals=np.array([9, 4], np.int32))  # type: ignore[arg-type]
    assert list(await buf.read(np.int32)) == [9, 9, 9, 9]
    opener = am.open_device("cpu")
    with pytest.raises(AttributeError, match="await open_device"):
        opener.alloc(16)  # type: ignore[attr-defined]
    monkeypatch.setenv("ASYNCMETAL_DEVICE", "bogus")
    with pytest.raises(am.InvalidArgumentError, match=r"from \$ASYNCMETAL_DEVICE"):
        await am.open_device()
    with pytest.raises(am.ArgumentTypeError, match="must be a CompilePool, or None"):
        device.compile_pool = "pool"  # type: ignore[assignment]


async def test_a_compile_pool_set_to_none_is_the_shared_one_again(device: am.Device) -> None:
    """``compile_pool = None`` puts a device back on the process's shared pool (checked
    failing before: None was refused as not a CompilePool)."""
    shared, pool = device.compile_pool, am.CompilePool(1)
    try:
        device.compile_pool = pool
        assert device.compile_pool is pool
        device.compile_pool = None
        assert device.compile_pool is shared
    finally:
        await pool.aclose()


async def test_values_passed_as_buffers_are_named(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """A value passed positionally, where launch takes buffers, is named with where
    values go, whichever count it upsets (checked: the counts were said alone)."""
    fill, add = kernels["fill"], kernels["add"]
    buf = await device.alloc(16)
    hint = r"values go in vals=\(\.\.\.\), buffers are launch's positional arguments"
    for action, said in [
        (
            lambda: device.queue.launch(fill, buf, 7, 4),
            r"takes 1 buffer, got 3 \(buffer 1 is an int",
        ),
        (
            lambda: device.queue.launch(add, buf, buf, buf, np.int32(4)),
            r"takes 3 buffers, got 4 \(buffer 3 is a numpy int32",
        ),
        (
            lambda: device.queue.launch(fill, 7, vals=(4,)),
            r"takes 2 values \(vals\), got 1 \(buffer 0 is an int",
        ),
        (lambda: device.queue.launch(fill, buf, 1.5, 4), r"buffer 1 is a float"),
    ]:
        _rejects(device, am.ArgumentTypeError, f"{said}.*{hint}", action)  # type: ignore[arg-type]


async def test_a_strided_destination_is_told_how_to_receive_the_bytes(
    device: am.Device,
) -> None:
    """A host destination that is not C-contiguous is refused with what to do instead:
    a contiguous copy of it, as a source's refusal says to pass, would receive the
    bytes rather than it (checked: the destination was told so too)."""
    buf = await device.alloc(16)
    strided = np.zeros(8, np.int32)[::2]
    told = r"cannot fill it in place: copy into a contiguous array"
    with pytest.raises(am.InvalidArgumentError, match=told):
        await am.copy(strided, buf)
    _rejects(device, am.InvalidArgumentError, told, lambda: device.queue.copy(strided, buf))
    source = r"src is not C-contiguous; pass a contiguous copy \(numpy\.ascontiguousarray\)"
    _rejects(device, am.InvalidArgumentError, source, lambda: device.queue.copy(buf, strided))
    filled = np.empty(4, np.int32)
    await buf.write(np.arange(4, dtype=np.int32))
    await am.copy(filled, buf)
    strided[...] = filled
    assert list(strided) == [0, 1, 2, 3]


async def test_a_write_and_a_view_name_their_own_argument_and_range(device: am.Device) -> None:
    """``buf.write(data)`` refuses ``data`` by that name, and ``buf.view`` gives the
    range of offsets it takes. Checked failing before: write's errors named ``src``
    (a copy's parameter), and view's range ended at the buffer's size, an offset it
    refuses."""
    buf = await device.alloc(16)
    with pytest.raises(am.ArgumentTypeError, match=r"^data must be a Buffer or support the"):
        await buf.write([1, 2, 3, 4])
    with pytest.raises(am.InvalidArgumentError, match=r"^data is not C-contiguous"):
        await buf.write(np.zeros(8, np.int32)[::2])
    with pytest.raises(
        am.InvalidArgumentError, match=r"^offset must be an int in \[0, 15\], got -1"
    ):
        buf.view(-1)
    with pytest.raises(am.InvalidArgumentError, match=r"^offset 16 leaves no bytes"):
        buf.view(16)
    assert buf.view(15).nbytes == 1


async def test_an_empty_array_of_several_dimensions_is_refused_by_its_size(
    device: am.Device,
) -> None:
    """A host array with no bytes but several dimensions (``np.zeros((0, 4))``) is
    refused as any empty source or destination is, by its size, with the library's own
    error: not numpy's memoryview ``TypeError``; a write of it is not told to write to a
    view of 0 bytes (which ``view`` refuses)."""
    buf = await device.alloc(16)
    empty = np.zeros((0, 4), np.float32)
    sizes = "sizes do not match: dst holds 16 bytes, src 0"
    with pytest.raises(am.InvalidArgumentError, match=sizes):
        await am.copy(buf, empty)
    with pytest.raises(am.InvalidArgumentError, match="sizes do not match: dst holds 0 bytes"):
        await am.copy(np.zeros((4, 0), np.int32), buf)
    with pytest.raises(am.InvalidArgumentError, match="data holds 0 bytes and the buffer 16") as no:
        await buf.write(empty)
    # (not "write to a view: buf.view(offset, 0)", a view no buffer makes)
    assert "nothing to write" in str(no.value) and "view" not in str(no.value)
    _rejects(device, am.InvalidArgumentError, sizes, lambda: device.queue.copy(buf, empty))
    _rejects(
        device,
        am.InvalidArgumentError,
        "nbytes must be > 0, got 0",
        lambda: device.queue.copy(np.zeros((2, 0)), buf, nbytes=0),
    )
    await buf.write(np.arange(4, dtype=np.int32))
    assert list(await buf.read(np.int32)) == [0, 1, 2, 3]


async def test_numpy_integers_are_launch_values(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    buf = await device.alloc(16)
    await device.queue.launch(kernels["fill"], buf, vals=(np.int32(5), np.int64(4)))
    assert list(await buf.read(np.int32)) == [5, 5, 5, 5]
    _rejects(
        device,
        am.InvalidArgumentError,
        "must fit in int32",
        lambda: device.queue.launch(kernels["fill"], buf, vals=(np.int64(1 << 40), 4)),
    )
    _rejects(
        device,
        am.ArgumentTypeError,
        "must be an integer, got bool",
        lambda: device.queue.launch(kernels["fill"], buf, vals=(np.bool_(True), 4)),
    )


async def test_launch_sizes_past_32_bits_are_refused(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """A size of 2**32 or more in any dimension is refused before it is submitted, on
    the native launch path and the Python one alike, rather than cut to its low bits
    (a Metal grid of 2**64 threads ran none, a cuda grid of 2**32 + 1 blocks one).
    Checked: fails without the fix (the launch was submitted)."""
    q, fill = device.queue, kernels["fill"]
    a = await device.alloc(16)
    slow = device.new_queue()
    slow._fast_launch = None
    for queue in (q, slow):
        for size in (1 << 32, 1 << 64, (1, 1 << 40), (1, 1, (1 << 32) + 1)):
            for key in ("global_size", "local_size"):
                _rejects(
                    device,
                    am.InvalidArgumentError,
                    re.escape(f"{key} must hold ints in [1, 2**32), got {size!r}"),
                    lambda queue=queue, key=key, size=size: queue.launch(
                        fill, a, vals=(1, 1), **{key: size}
                    ),
                )
    # the largest size passes the check (a cpu kernel ignores it)
    if device.name == "cpu":
        await q.launch(fill, a, vals=(5, 4), global_size=(1 << 32) - 1)
        assert (await a.read(np.int32)).tolist() == [5] * 4
    await slow.close()


async def test_numpy_integers_are_launch_sizes(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """``global_size=np.prod(shape)`` is a size, as numpy integers are elsewhere.
    Checked: fails without the fix ("must be an int or a tuple", then "must hold ints")."""
    a = await device.alloc(16)
    n = np.prod((2, 2))
    await device.queue.launch(
        kernels["fill"], a, vals=(3, 4), global_size=n, local_size=np.int32(1)
    )
    await device.queue.launch(kernels["fill"], a, vals=(4, 4), global_size=(n, np.uint8(1)))
    assert (await a.read(np.int32)).tolist() == [4] * 4


async def test_launch_sizes_of_the_wrong_type_are_type_errors(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """A size that is no int -- a float, a bool or a str among its dimensions, or a
    str for the whole (a sequence of characters) -- is an ArgumentTypeError (a
    TypeError) naming the argument and what it takes, on the native launch path and the
    Python one alike, as a float or a bool for the whole size is; only an int below 1
    is an InvalidArgumentError. Checked: fails without the fix (InvalidArgumentError
    "must hold ints >= 1" for each)."""
    a = await device.alloc(16)
    slow = device.new_queue()
    slow._fast_launch = None
    wrong: list[object] = [(4.0,), (2, True), (1, 1, "4"), "4", b"\x04"]
    refusals = [
        (size, am.ArgumentTypeError, "must be an int or a tuple of 1 to 3 ints") for size in wrong
    ]
    refusals.append(((2, 0), am.InvalidArgumentError, "must hold ints >= 1"))
    for queue, key, (size, error, words) in itertools.product(
        (device.queue, slow), ("global_size", "local_size"), refusals
    ):
        launch = functools.partial(queue.launch, kernels["fill"], a, vals=(1, 1), **{key: size})
        _rejects(device, error, re.escape(f"{key} {words}, got {size!r}"), launch)
    await slow.close()


async def test_a_threadgroup_past_the_kernels_limit_is_refused(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """On Metal, a ``local_size`` of more threads than the kernel's pipeline takes
    (``maxTotalThreadsPerThreadgroup``) is refused before it is encoded, naming the
    limit: Metal's validation aborts the process on such a dispatch (the simulation
    does as well). A cpu kernel takes any. Checked: fails without the fix (the
    process aborted)."""
    q, fill = device.queue, kernels["fill"]
    a = await device.alloc(16)
    if device.name != "metal":
        await q.launch(fill, a, vals=(1, 4), local_size=(64, 64, 64))
        return
    for size in ((1024, 2), (32, 33), (16, 16, 8)):
        _rejects(
            device,
            am.InvalidArgumentError,
            r"local_size .* threads per threadgroup; kernel 'fill' takes at most 1024",
            lambda size=size: q.launch(fill, a, vals=(1, 4), global_size=64, local_size=size),
        )
    await q.launch(fill, a, vals=(2, 4), global_size=64, local_size=(32, 32))
    assert (await a.read(np.int32)).tolist() == [2] * 4


async def test_a_threadgroup_past_the_devices_limit_in_a_dimension_is_refused(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """On Metal, a ``local_size`` within the kernel's most threads in all but past the
    device's most in one dimension (``maxThreadsPerThreadgroup``, 1024 x 1024 x 64 in
    the simulation) is refused before it is encoded, naming the dimension and the limit:
    Metal's validation aborts the process on such a dispatch (the simulation does as
    well). A cpu kernel takes any. Checked: fails without the fix (the process
    aborted)."""
    q, fill = device.queue, kernels["fill"]
    a = await device.alloc(16)
    if device.name != "metal":
        await q.launch(fill, a, vals=(1, 4), global_size=(1, 1, 128), local_size=(1, 1, 128))
        return
    for size, axis, most in (((1, 1, 128), "z", 64), ((2, 1, 65), "z", 64)):
        _rejects(
            device,
            am.InvalidArgumentError,
            rf"local_size .* has {size[2]} threads in {axis}; a threadgroup takes at most "
            rf"{most} \(the device's maxThreadsPerThreadgroup.depth\)",
            lambda size=size: q.launch(fill, a, vals=(1, 4), global_size=size, local_size=size),
        )
    await q.launch(fill, a, vals=(2, 4), global_size=(1, 1, 64), local_size=(1, 1, 64))
    assert (await a.read(np.int32)).tolist() == [2] * 4


async def test_a_copy_of_a_device_queue_or_timeline_is_the_object_itself(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """``copy.copy``/``copy.deepcopy`` of a Device, Queue or Timeline gives the object
    itself (as of a Program): a copy with numbering and signal records of its own let a
    timeline go backwards unrefused, numbered a queue's commands twice, and launched on
    the native queue its original's close had released (a crash). Checked: fails without
    the fix (the backwards signal was accepted)."""
    tl = device.timeline()
    for obj in (device, device.queue, tl):
        assert copy.copy(obj) is obj and copy.deepcopy(obj) is obj
    tl.signal(5)
    with pytest.raises(am.InvalidArgumentError, match="does not increase the timeline"):
        copy.copy(tl).signal(3)
    q = device.new_queue()
    first = q.launch(kernels["empty"])
    second = copy.copy(q).launch(kernels["empty"])
    assert (first.value, second.value) == (1, 2)
    await q.close()
    with pytest.raises(am.ClosedResourceError):
        copy.copy(q).launch(kernels["empty"])
    held = {"queue": device.queue, "timeline": tl}  # (what dataclasses.asdict copies)
    assert copy.deepcopy(held) == held


async def test_pickling_what_stands_for_a_device_says_it_cannot(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """Pickling a Device, Queue, Timeline, Buffer, view, TypedView, Completion, Program
    or CompilePool (sending it to another process) raises ArgumentTypeError (a
    TypeError) saying why, not pickle's error about a lock inside it; copying one gives
    the object itself. Checked: fails without the fix ("cannot pickle '_thread.lock'
    object")."""
    buf = await device.alloc(64)
    pool = am.CompilePool()
    try:
        for obj in (
            device,
            device.queue,
            device.timeline(),
            buf,
            buf.view(0, 8),
            buf.typed(np.int32),
            device.queue.marker(),
            kernels["fill"],
            pool,
        ):
            with pytest.raises(am.ArgumentTypeError, match="objects cannot be pickled"):
                pickle.dumps(obj)
            assert copy.copy(obj) is obj and copy.deepcopy(obj) is obj
    finally:
        await pool.aclose()

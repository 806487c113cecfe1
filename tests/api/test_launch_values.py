"""Launch values of every scalar type a kernel takes: each passed as its parameter's
type (read from the kernel's source), bit for bit, or refused before anything is
submitted."""

from __future__ import annotations

import functools
import platform
import re
import shutil
import subprocess
import sys
import textwrap
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import asyncmetal as am
from asyncmetal._queue import _ONE3
from tests.support.children import run_child
from tests.support.launch_paths import PATHS, select_launch_path
from tests.support.refusals import rejects as _rejects

pytestmark = pytest.mark.anyio

# put: values of several types between two buffers, each written to them as its bytes.
# (Metal has no double: its kernel takes a half there.)
C_PUT = r"""
#include <string.h>
void put(float f, unsigned char* out, double d, long long big, unsigned int u,
         unsigned char* more, float g, int n, short s, unsigned char c) {
    memcpy(out, &f, 4); memcpy(out + 8, &d, 8); memcpy(out + 16, &big, 8);
    memcpy(out + 24, &u, 4); memcpy(more, &g, 4); memcpy(more + 4, &n, 4);
    memcpy(more + 8, &s, 2); memcpy(more + 10, &c, 1);
}
"""
MSL_PUT = r"""
#include <metal_stdlib>
using namespace metal;
kernel void put(constant float& f [[buffer(0)]], device uchar* out [[buffer(1)]],
                constant half& d [[buffer(2)]], constant long& big [[buffer(3)]],
                constant uint& u [[buffer(4)]], device uchar* more [[buffer(5)]],
                constant float& g [[buffer(6)]], constant int& n [[buffer(7)]],
                constant short& s [[buffer(8)]], constant uchar& c [[buffer(9)]],
                uint i [[thread_position_in_grid]]) {
    if (i != 0) return;
    *(device float*)(out) = f; *(device half*)(out + 8) = d;
    *(device long*)(out + 16) = big; *(device uint*)(out + 24) = u;
    *(device float*)(more) = g; *(device int*)(more + 4) = n;
    *(device short*)(more + 8) = s; more[10] = c;
}
"""


def _second(device: am.Device) -> np.floating[Any]:
    """The value for put's third parameter: a double, on Metal a half."""
    return np.float16(-2.71875) if device.kind == "metal" else np.float64(np.pi)


def _bytes_of(*values: np.generic) -> bytes:
    return b"".join(v.tobytes() for v in values)


async def _put(device: am.Device, queue: am.Queue, vals: tuple[Any, ...]) -> tuple[bytes, bytes]:
    put = await device.compile(MSL_PUT if device.kind == "metal" else C_PUT, "put")
    out, more = await device.alloc(32), await device.alloc(16)
    await queue.copy(out, np.zeros(32, np.uint8))
    await queue.copy(more, np.zeros(16, np.uint8))
    await queue.launch(put, out, more, vals=vals)
    return (await out.read(np.uint8)).tobytes(), (await more.read(np.uint8)).tobytes()


async def test_values_of_each_type_reach_the_kernel_bit_for_bit(device: am.Device) -> None:
    """float, double (Metal: half), int64 beyond int32, uint32 beyond int32, int16 and
    uint8 parameters between buffers: numpy scalars pass as their own type, Python
    numbers as the parameter's; every byte written back is the value's own."""
    second = _second(device)
    vals = (
        np.float32(-0.1),  # not exact in binary: its own rounding, not a double's
        second,
        np.int64(-(1 << 40) - 3),
        np.uint32(0xFFFF_FFF0),
        1e-3,  # a Python float, rounded to the float parameter
        -7,
        np.int16(-300),
        200,  # a Python int, into an unsigned char
    )
    out, more = await _put(device, device.queue, vals)
    assert out[0:4] == np.float32(-0.1).tobytes()
    assert out[8 : 8 + second.nbytes] == second.tobytes()
    assert out[16:28] == _bytes_of(np.int64(-(1 << 40) - 3), np.uint32(0xFFFF_FFF0))
    assert more[0:11] == _bytes_of(np.float32(1e-3), np.int32(-7), np.int16(-300), np.uint8(200))


async def test_python_ints_take_the_parameters_type(device: am.Device) -> None:
    """A Python int beyond int32 reaches a 64-bit parameter whole, one up to 2**32 - 1
    an unsigned int, and a Python int a float parameter as that float."""
    vals = (3, _second(device), -(1 << 62), (1 << 32) - 1, 1 << 24, 1 << 30, -1, 0)
    out, more = await _put(device, device.queue, vals)
    assert out[0:4] == np.float32(3).tobytes()
    assert out[16:28] == _bytes_of(np.int64(-(1 << 62)), np.uint32((1 << 32) - 1))
    assert more[0:8] == _bytes_of(np.float32(1 << 24), np.int32(1 << 30))


INTS = r"""
#include <string.h>
void ints(unsigned char* out, long long a, unsigned int b, short c, unsigned long long d) {
    memcpy(out, &a, 8); memcpy(out + 8, &b, 4); memcpy(out + 12, &c, 2); memcpy(out + 16, &d, 8);
}
"""


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.usefixtures("unreaped")
async def test_every_launch_path_passes_them(device: am.Device, path: str) -> None:
    """The native launch path (ints of other integer types, each checked against its
    type's range), the extension's call and ctypes' (floats too) pass the same bits."""
    queue = device.new_queue()
    select_launch_path(queue, path, "_fast_call")
    ints = await device.compile(INTS, "ints")
    assert ints._value_codes == b"qIhQ"
    buf = await device.alloc(24)
    vals = [(1 << 40) + 5, (1 << 32) - 2, -300, (1 << 63) - 1]
    if path == "queue":  # the native path submits it (a Completion, not None)
        assert queue._fast_launch is not None
        done = queue._fast_launch(queue, queue._launch_target, ints, (buf,), vals, _ONE3, _ONE3)
        assert isinstance(done, am.Completion)
        # (None: declined, for the Python path to refuse, submitting nothing)
        for i, beyond in ((1, -1), (2, 1 << 15), (3, -1), (0, 1 << 63)):
            wrong = [*vals[:i], beyond, *vals[i + 1 :]]
            assert (
                queue._fast_launch(queue, queue._launch_target, ints, (buf,), wrong, _ONE3, _ONE3)
                is None
            )
    await queue.launch(ints, buf, vals=vals)
    expected = _bytes_of(np.int64(vals[0]), np.uint32(vals[1]), np.int16(vals[2]))
    got = (await buf.read(np.uint8)).tobytes()
    assert got[:14] == expected and got[16:] == np.uint64(vals[3]).tobytes()
    out, more = await _put(device, queue, (3, 2.5, 1, 2, 1.0, 2, 3, 4))
    assert out[0:16] == _bytes_of(np.float32(3), np.zeros(4, np.uint8), np.float64(2.5))
    assert more[0:11] == _bytes_of(np.float32(1), np.int32(2), np.int16(3), np.uint8(4))


SPILL = r"""
#include <string.h>
void spill(double a0, long long i0, double a1, double a2, long long* out, double a3,
           double a4, double a5, double a6, long long i1, double a7, float a8,
           long long i2, long long i3, long long i4, long long i5) {
    double d[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    memcpy(out, d, sizeof d); memcpy(out + 8, &a8, 4);
    long long i[6] = {i0, i1, i2, i3, i4, i5};
    memcpy(out + 9, i, sizeof i);
}
"""


async def test_cpu_arguments_past_the_registers_go_on_the_stack(device: am.Device) -> None:
    """A cpu kernel of 16 parameters, 9 of them floats: the ninth float and the seventh
    integer (x86-64: past its 6 integer registers) go on the stack, in parameter order,
    each in its 8-byte slot."""
    spill = await device.compile(SPILL, "spill")
    out = await device.alloc(15 * 8)
    doubles = [np.float64(k + 0.125) * (-1) ** k for k in range(8)]
    ints = [(k + 1) * (1 << 33) + k for k in range(6)]
    vals = (
        doubles[0], ints[0], doubles[1], doubles[2], doubles[3], doubles[4], doubles[5],
        doubles[6], ints[1], doubles[7], np.float32(-9.5), ints[2], ints[3], ints[4], ints[5],
    )  # fmt: skip
    await device.queue.launch(spill, out, vals=vals)
    got = (await out.read(np.uint8)).tobytes()
    assert got[:64] == _bytes_of(*doubles)
    assert got[64:68] == np.float32(-9.5).tobytes()
    assert got[72:] == np.array(ints, np.int64).tobytes()


async def test_values_that_do_not_fit_their_parameter_are_refused(device: am.Device) -> None:
    """Nothing of the wrong size or kind reaches a kernel: each refusal names the value
    and its parameter, and submits nothing."""
    put = await device.compile(MSL_PUT if device.kind == "metal" else C_PUT, "put")
    out, more = await device.alloc(32), await device.alloc(16)
    good = [np.float32(1), _second(device), 1, 2, np.float32(3), 4, 5, 6]

    def launch(i: int, value: Any) -> Callable[[], Any]:
        vals = list(good)
        vals[i] = value
        return lambda: device.queue.launch(put, out, more, vals=vals)

    type_error, value_error = am.ArgumentTypeError, am.InvalidArgumentError
    cases: list[tuple[type[BaseException], str, int, Any]] = [
        # a double where a float is declared: it would be cut, or rounded unseen
        (type_error, r"vals\[0\] of 'put' is a numpy float64, wider than its parameter "
         r"'.*float.* f' \(float32\): pass np.float32", 0, np.float64(1.5)),
        # floats where an integer is declared, and the other way round
        (type_error, r"vals\[5\] of 'put' must be an integer, got float; its parameter "
         r"'.*int.* n' takes int32", 5, 2.5),
        (type_error, r"vals\[5\] of 'put' must be an integer, got numpy float32", 5,
         np.float32(2)),
        (type_error, r"vals\[0\] of 'put' must be a float, got numpy int32", 0, np.int32(1)),
        (type_error, r"vals\[3\] of 'put' must be an integer, got bool", 3, True),
        (type_error, r"vals\[0\] of 'put' must be a float, got bool; its parameter "
         r"'.*float.* f' takes float32", 0, True),
        (type_error, r"vals\[3\] of 'put' must be an integer or a float, got str", 3, "1"),
        # out of the parameter's range
        (value_error, r"vals\[3\] of 'put' must fit in uint32 \(its parameter .*\): -1", 3, -1),
        (value_error, r"vals\[3\] of 'put' must fit in uint32", 3, np.int64(1 << 32)),
        (value_error, r"vals\[2\] of 'put' must fit in int64", 2, 1 << 63),
        (value_error, r"vals\[7\] of 'put' must fit in uint8", 7, 256),
        (value_error, r"vals\[5\] of 'put' must fit in int32: 2147483648", 5, 1 << 31),
        (value_error, r"vals\[4\] of 'put' does not fit in float32", 4, 1e300),
    ]  # fmt: skip
    for exc, match, i, value in cases:
        _rejects(device, exc, match, launch(i, value))
    await device.queue.launch(put, out, more, vals=good)  # and the good ones pass


async def test_a_python_float_for_a_type_not_known_is_refused(device: am.Device) -> None:
    """A parameter whose type the source does not name plainly (a macro a compile
    option may override) takes numpy scalars as their own type; a Python float, whose
    size would be a guess, is refused, saying what to pass. (On cpu the compile asks the
    C compiler what the type is, and a Python float is rounded to the float it says.)"""
    src = (
        "#ifndef REAL\n#define REAL float\n#endif\n"
        "void scale(float* out, REAL x) { out[0] = x * 2; }"
    )
    scale = await device.compile(src, "scale")
    out = await device.alloc(4)
    if device.kind == "cpu":
        assert scale.value_types == (("float32", "REAL x"),)
        await device.queue.launch(scale, out, vals=(2.5,))
        assert (await out.read(np.float32)).tolist() == [5.0]
        return
    assert scale.value_types == ((None, "REAL x"),)
    _rejects(
        device,
        am.ArgumentTypeError,
        r"vals\[0\] of 'scale' is a Python float, and the type of its parameter 'REAL x' is "
        r"not known here: pass np.float32\(x\) or np.float64\(x\)",
        lambda: device.queue.launch(scale, out, vals=(2.5,)),
    )
    await device.queue.launch(scale, out, vals=(np.float32(2.5),))
    assert (await out.read(np.float32)).tolist() == [5.0]


@pytest.mark.metal
def test_the_simulated_metal_refuses_bytes_shorter_than_the_argument() -> None:
    """As Metal's validation does: a value bound with fewer bytes than its parameter's
    type (4 for a long, as every value was once passed) aborts the simulation, saying
    so, rather than have the kernel read past them."""
    if "metal" not in am.devices():
        pytest.skip("no Metal device (nor the simulation) here")
    code = textwrap.dedent(
        """
        import ctypes, anyio, asyncmetal as am
        from asyncmetal.backends.metal import _queue
        _queue._value_bytes = lambda v: (ctypes.c_int64(getattr(v, "bits", v)), 4)
        SRC = ("kernel void k(device long* out [[buffer(0)]], constant long& v [[buffer(1)]],"
               " uint i [[thread_position_in_grid]]) { out[0] = v; }")
        async def main():
            async with am.open_device("metal") as dev:
                k, out = await dev.compile(SRC, "k"), await dev.alloc(8)
                await dev.queue.launch(k, out, vals=(1 << 40,))
        anyio.run(main)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "takes 8 bytes, setBytes gave 4" in out.stderr, out.stderr[-2000:]


async def _kept(device: am.Device, src: str, vals: tuple[Any, ...]) -> tuple[am.Program, bytes]:
    """Kernel k of ``src`` launched with an 8-byte buffer and ``vals``: the buffer's bytes."""
    k = await device.compile(src, "k")
    out = await device.alloc(8)
    await device.queue.launch(k, out, vals=vals)
    return k, (await out.read(np.uint8)).tobytes()


async def test_cpu_half_floats_pass_in_the_vector_registers(device: am.Device) -> None:
    """``_Float16`` parameters (the C calling convention passes them in a vector
    register's low bytes) from np.float16 and a Python float."""
    src = (
        "#include <string.h>\n"
        "void k(_Float16 a, unsigned char* out, int n, _Float16 b)"
        " { memcpy(out, &a, 2); memcpy(out + 2, &b, 2); memcpy(out + 4, &n, 4); }"
    )
    _, got = await _kept(device, src, (np.float16(-1.5), 9, 0.333))
    assert got == _bytes_of(np.float16(-1.5), np.float16(0.333), np.int32(9))


async def test_numpy_floats_pass_their_own_bits(device: am.Device) -> None:
    """A numpy float for a parameter of its own type reaches it bit for bit: a
    signalling NaN stays one, its payload whole (not quieted by a round trip through a
    Python float)."""
    signalling = np.frombuffer(np.uint32(0x7F80_0001).tobytes(), np.float32)[0]
    payload = np.frombuffer(np.uint32(0xFFA0_0D0D).tobytes(), np.float32)[0]
    out, more = await _put(
        device, device.queue, (signalling, _second(device), 1, 2, payload, 3, 4, 5)
    )
    assert out[0:4] == signalling.tobytes() and more[0:4] == payload.tobytes()


TYPEDEF_APART = r"""
#include <string.h>
#ifdef WIDE
typedef double real;
#else
typedef float real;
#endif
void keep(unsigned char* out, real x) { memcpy(out, &x, sizeof x); }
"""


async def test_a_type_defined_apart_in_if_branches_is_not_known(device: am.Device) -> None:
    """A typedef in two #if branches names the type of whichever compiles, which the
    source cannot tell: not known, so a numpy float passes as its own type and a
    Python float is refused -- none is passed as the other branch's type. (On cpu the
    compile asks the C compiler which it is, and a Python float is rounded to it.)"""
    out = await device.alloc(8)
    for options, value in (((), np.float32(-2.5)), (("-DWIDE",), np.float64(-2.5))):
        keep = await device.compile(TYPEDEF_APART, "keep", options=options)
        await device.queue.launch(keep, out, vals=(value,))
        assert (await out.read(np.uint8)).tobytes()[: value.nbytes] == value.tobytes()
        if device.kind == "cpu":
            assert keep.value_types == ((value.dtype.name, "real x"),)
            await device.queue.launch(keep, out, vals=(-1.25,))
            wanted = value.dtype.type(-1.25).tobytes()
            assert (await out.read(np.uint8)).tobytes()[: value.nbytes] == wanted
            continue
        assert keep.value_types == ((None, "real x"),)
        _rejects(
            device,
            am.ArgumentTypeError,
            r"vals\[0\] of 'keep' is a Python float, and the type of its parameter 'real x' "
            r"is not known",
            functools.partial(device.queue.launch, keep, out, vals=(-2.5,)),
        )


@pytest.mark.parametrize(
    ("before", "declaration"),
    [
        ("typedef long double ld; typedef ld wide;", "wide a"),
        ("typedef long double ld, *ldp;", "ld a"),  # (one of several declarators)
        ("typedef struct { float x, y; } pair;", "pair a"),
        ("struct pair { int x; }; typedef struct pair pair_t;", "pair_t a"),
        ("typedef float v4 __attribute__((vector_size(16)));", "v4 a"),
        ("typedef unsigned __int128 u128;", "u128 a"),
        ("", "__int128 a"),
        ("", "__int128_t a"),  # the compiler's own typedefs of __int128
        ("", "const __uint128_t a"),
        ("", "__float128 a"),
        ("", "__bf16 a"),
        ("", "float2 a"),  # CUDA's vector types (a struct of two floats)
        ("", "const uint4 a"),
        ("", "__half2 a"),
    ],
)
async def test_a_value_no_launch_passes_is_refused_behind_its_typedef(
    device: am.Device, before: str, declaration: str
) -> None:
    """A cpu value parameter of a type no launch value passes (its calling convention
    passes it in memory, in two registers, or in a vector register a launch's int would
    not reach) is refused at compile, also when a typedef names it or it is one of the
    compiler's own (``__int128``, and its typedefs ``__int128_t`` and ``__uint128_t``)."""
    source = f"{before}\nvoid k(int* out, {declaration}, int n) {{ out[0] = n; }}"
    with pytest.raises(am.CompileError, match="is not a scalar") as info:
        await device.compile(source, "k")
    assert declaration in str(info.value)


@pytest.mark.parametrize("declaration", ["_BitInt(12) a", "unsigned _BitInt(40) a"])
async def test_a_bit_precise_integer_is_refused_naming_the_widths_taken(
    anyio_backend: object, declaration: str
) -> None:
    """A cpu kernel's ``_BitInt(N)`` parameter (C23) is refused at compile, and the refusal names
    the widths a launch value takes -- 8, 16, 32 or 64 bits, not every width between
    (checked failing before: "an integer of 8 to 64 bits", which a 12- or 40-bit one
    is)."""
    source = f"void k(int* out, {declaration}) {{ out[0] = 1; }}"
    async with am.open_device("cpu") as device:
        with pytest.raises(am.CompileError, match="is not a scalar") as info:
            await device.compile(source, "k")
    assert declaration in str(info.value)
    assert "8, 16, 32 or 64 bits" in str(info.value)


@pytest.mark.parametrize(
    ("typedefs", "declaration"),
    [
        ("#ifdef WIDE\ntypedef float bf;\n#else\ntypedef __bf16 bf;\n#endif", "bf a"),
        ("#if USE_BF\ntypedef __bf16 bf;\n#else\ntypedef _Float16 bf;\n#endif", "const bf a"),
        ("#ifndef WIDE\ntypedef const __bf16 bf;\n#else\ntypedef float bf;\n#endif", "bf a"),
    ],
)
async def test_a_bfloat16_typedef_in_if_branches_is_refused_with_the_float_hint(
    anyio_backend: object, typedefs: str, declaration: str
) -> None:
    """A bfloat16 that ``#if`` branches typedef (another branch another type, so the
    name is known by no one type) is refused as the source's own ``__bf16`` is, with the
    hint to take a float. Checked: fails without the fix (the refusal ended "pass it in
    a buffer", no hint)."""
    source = f"{typedefs}\nvoid k(int* out, {declaration}) {{ out[0] = 1; }}"
    async with am.open_device("cpu") as device:
        with pytest.raises(am.CompileError, match="is not a scalar") as info:
            await device.compile(source, "k")
    assert repr(declaration) in str(info.value)
    assert "take a float and convert it in the kernel" in str(info.value)


# A bfloat16 reached through typedefs that #if branches (or a declarator list beside a
# pointer) give it: (the typedefs, the parameter refused).
BFLOAT_CHAINS = [
    # through a typedef of it, outside the branches (known by one type) and inside them
    ("#if X\ntypedef __bf16 bf;\n#else\ntypedef __bf16 bf;\n#endif\ntypedef bf bf2;", "bf2 x"),
    ("#if X\ntypedef __bf16 bf;\ntypedef bf bf2;\n#else\ntypedef float bf2;\n#endif", "bf2 x"),
    (
        "#if X\ntypedef __bf16 bf;\n#else\ntypedef float bf;\n#endif\n"
        "#if Y\ntypedef const bf bf2;\n#else\ntypedef int bf2;\n#endif\ntypedef bf2 bf3;",
        "bf3 x",
    ),
    # a cycle of names the branches make: ends, the bfloat16 found
    (
        "#if X\ntypedef __bf16 a;\n#else\ntypedef b a;\n#endif\n"
        "#if Y\ntypedef a b;\n#else\ntypedef int b;\n#endif",
        "b x",
    ),
    # a declarator list of a pointer and a value, another branch giving the value a scalar
    ("#if X\ntypedef __bf16 *bfp, bf;\n#else\ntypedef float bf;\n#endif", "bf x"),
    ("#if X\ntypedef float bf;\n#else\ntypedef __bf16 *bfp, bf;\n#endif", "bf x"),
    ("#if X\ntypedef __bf16 bf, *bfp;\n#else\ntypedef unsigned short bf;\n#endif", "bf x"),
    ("#if X\ntypedef const __bf16 *bfp, bf;\n#else\ntypedef _Float16 bf;\n#endif", "bf x"),
    (
        "#if X\ntypedef const __bf16 *bfp, bf;\n#else\ntypedef const __bf16 *bfp, bf;\n#endif",
        "bf x",
    ),
]


@pytest.mark.parametrize("cc", ["gcc", "clang"])
@pytest.mark.parametrize(("typedefs", "declaration"), BFLOAT_CHAINS)
async def test_a_bfloat16_through_typedef_chains_and_lists_is_refused_with_the_float_hint(
    anyio_backend: object,
    monkeypatch: pytest.MonkeyPatch,
    cc: str,
    typedefs: str,
    declaration: str,
) -> None:
    """A bfloat16 that a chain of typedefs in ``#if`` branches (a cycle too) or a
    declarator list beside a pointer (``typedef __bf16 *bfp, bf;``) names is refused
    before compiling, with the hint to take a float, as the branches' own ``typedef
    __bf16 bf;`` is -- whichever compiler (neither gcc 12 nor clang 14 has ``__bf16``
    in C: its own error would be told). Checked: fails without the fix (the chain's
    name was in no set of the refused; the list's value left out by ``typedefs``,
    another branch's scalar was taken for it; ``const __bf16 *bfp, bf`` was read as a
    ``const``: "DID NOT RAISE", or the compiler's error)."""
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} here")
    monkeypatch.setenv("CC", cc)
    source = f"{typedefs}\nvoid k(int* out, {declaration}) {{ out[0] = 1; }}"
    async with am.open_device("cpu") as device:
        with pytest.raises(am.CompileError, match="is not a scalar") as info:
            await device.compile(source, "k")
    assert repr(declaration) in str(info.value) and not info.value.log
    assert "take a float and convert it in the kernel" in str(info.value)


@functools.cache
def _compiles_bfloat16(cc: str) -> bool:
    """Whether ``cc`` has C's ``__bf16`` (GCC 13, clang 15 on x86-64 on)."""
    probe = [cc, "-x", "c", "-fsyntax-only", "-"]
    return subprocess.run(probe, input=b"__bf16 x;", capture_output=True).returncode == 0


@pytest.mark.parametrize("cc", ["gcc", "clang"])
async def test_a_pointer_of_a_bfloat16_declarator_list_stays_a_buffer(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, cc: str
) -> None:
    """The pointer of ``typedef __bf16 *bfp, bf;`` (in ``#if`` branches, another giving
    it a float's) is a buffer, as ``__bf16 *p`` is: the branch compiled takes the
    buffer's floats; with ``-DX``, a compiler without ``__bf16`` gives its own error,
    not a refusal of the parameter."""
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} here")
    monkeypatch.setenv("CC", cc)
    source = (
        "#if X\ntypedef __bf16 *bfp, bf;\n#else\ntypedef float *bfp, bf;\n#endif\n"
        "void k(bfp p, int n) { p[0] = p[1] + n; }"
    )
    async with am.open_device("cpu") as device:
        k = await device.compile(source, "k")
        assert k.params == ("buffer", "value")
        buf = await device.alloc(8)
        await buf.write(np.array([0, 40], np.float32))
        await device.queue.launch(k, buf, vals=(2,))
        assert (await buf.read(np.float32))[0] == 42
        if _compiles_bfloat16(cc):
            k = await device.compile(source, "k", options=("-DX=1",))
            assert k.params == ("buffer", "value")
        else:
            with pytest.raises(am.CompileError, match="failed with exit code") as info:
                await device.compile(source, "k", options=("-DX=1",))
            assert "__bf16" in info.value.log, info.value  # (the compiler's own error)


@pytest.mark.parametrize(
    ("before", "returned", "refused"),
    [
        ("struct big { double a[8]; };", "struct big", True),
        ("typedef struct { double a[8]; } big;", "big", True),
        ("", "long double", True),
        ("", "extern long double", True),
        ("#define RET long double", "RET", True),
        ("struct big { double a[8]; };", "struct big *", False),
        ("struct big; typedef struct big *big_p;", "big_p", False),
        ("", "double", False),
        ("", "unsigned long", False),
    ],
)
async def test_a_cpu_kernel_returning_through_memory_or_the_x87_stack_is_refused(
    device: am.Device, before: str, returned: str, refused: bool
) -> None:
    """A cpu kernel is called as a void function. One that returns a struct through
    memory takes its caller's hidden address in its first parameter's register (every
    parameter shifted: its writes land past the buffers), and one that returns a
    ``long double`` leaves it on the x87 stack, which nobody pops (after eight such
    launches, ``long double`` arithmetic on that queue's thread gives NaN): both are
    refused at compile. A pointer or a scalar is returned in a register, and dropped."""
    source = (
        f"{before}\n{returned} k(long long* out, int w) {{ "
        f"{returned.removeprefix('extern ')} r = {{0}}; out[0] = w; return r; }}"
    )
    await _refused_or_run(device, source, refused)


async def _refused_or_run(device: am.Device, source: str, refused: bool) -> None:
    """Kernel ``k(long long* out, int w)`` of ``source`` refused at compile for what it
    returns, or compiled and run: ``out[0]`` is ``w``."""
    if refused:
        with pytest.raises(am.CompileError, match="returns") as info:
            await device.compile(source, "k")
        assert info.value.name == "k"
        return
    k = await device.compile(source, "k")
    out = await device.alloc(8)
    await device.queue.launch(k, out, vals=(7,))
    assert (await out.read(np.int64))[0] == 7


# A header of return types for the kernels of the test below: typedefs that the source,
# as written, does not show.
RETURNED_H = """
typedef struct { double a[16]; } big_t;
typedef union { double a[8]; long long n; } wide_t;
typedef long double real_t;
typedef float v8_t __attribute__((vector_size(32)));
typedef _Complex double complex_t;
typedef __int128 wide_int_t;
typedef float *fptr_t;
typedef long long count_t;
typedef double real64_t;
typedef void nothing_t;
typedef _Bool flag_t;
typedef enum { NO, YES } answer_t;
typedef long long cell_t[1];
typedef _Atomic int atomic_int_t;
"""
# Compiles kernel k of the source argv[1] (with the options after it) and launches it
# with an 8-byte buffer and 7: prints what came of it (a launch that crashes kills the
# child, not the test).
RETURNED_CHILD = """
import sys, warnings, anyio, numpy as np, asyncmetal as am
warnings.simplefilter("ignore", am.CompileWarning)
async def main():
    async with am.open_device("cpu") as device:
        try:
            k = await device.compile(sys.argv[1], "k", options=tuple(sys.argv[2:]))
        except am.CompileError as exc:
            print("refused", exc.name, str(exc).partition("\\n")[0])
            return
        out = await device.alloc(8)
        await device.queue.launch(k, out, vals=(7,))
        print("ran", (await out.read(np.int64))[0])
anyio.run(main)
"""


@pytest.mark.parametrize(
    ("before", "returned", "refused"),
    [
        ("#include <signal.h>", "sigset_t", True),  # 128 bytes: through memory
        ("#include <stdlib.h>", "div_t", True),  # a struct in registers
        ("#include <signal.h>\n#define RESULT sigset_t", "RESULT", True),
        ("", "big_t", True),
        ("#define RECORD(T) typedef struct { double a[16]; } T\nRECORD(big);", "big", True),
        ("", "wide_t", True),
        ("", "real_t", True),  # a long double
        ("", "v8_t", True),
        ("", "complex_t", True),
        ("", "wide_int_t", True),
        ("", "fptr_t", False),
        ("", "count_t", False),
        ("", "real64_t", False),
        ("", "nothing_t", False),
        ("", "flag_t", False),
        ("", "answer_t", False),
        ("#include <sys/types.h>", "ssize_t", False),
        ("#include <stdint.h>", "intptr_t", False),
        ("#include <math.h>", "float_t", False),
        ("#define KERNEL void", "KERNEL", False),
        ("#define RESULT const count_t", "RESULT", False),
        ("#if 0\ntypedef long long big_t;\n#endif", "big_t", True),  # (a dropped typedef)
    ],
)
def test_a_cpu_kernel_returning_a_header_type_no_launch_calls_is_refused(
    tmp_path: Path, before: str, returned: str, refused: bool
) -> None:
    """A return type that a header or a macro makes (``sigset_t``, a typedef of a
    struct, union, vector, ``long double``...) is not read from the source: the
    compiler is asked what each kernel returns, and a kernel that returns a struct or
    union (through memory: the launch, which calls it as a void function, passes no
    address for it, so the kernel writes to one its first parameter's register holds),
    or another type no launch value is, is refused at compile as one whose source
    spells it. Pointers, scalars, enums and ``void``, also behind a typedef or a macro,
    are taken. Run in a child, which a kernel that crashes kills. Checked: fails
    without the fix (sigset_t and big_t were taken, and their launches killed the
    child with SIGSEGV; the others were taken)."""
    (tmp_path / "returned.h").write_text(RETURNED_H)
    void = returned in ("nothing_t", "KERNEL")
    body = "" if void else f"{returned} r; __builtin_memset(&r, 0, sizeof r); "
    source = (
        f'#include "returned.h"\n{before}\n{returned} k(long long* out, int w) '
        f"{{ {body}out[0] = w;{'' if void else ' return r;'} }}"
    )
    child = run_child(
        RETURNED_CHILD, source, f"-I{tmp_path}", hung="the compile or the launch hung"
    )
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    if refused:
        refusal = f"refused k kernel 'k': function 'k' of the source returns {returned!r}, "
        assert child.stdout.startswith(refusal), child.stdout
    else:
        assert child.stdout == "ran 7\n", (child.stdout, child.stderr[-2000:])


@pytest.mark.parametrize("cc", ["gcc", "clang"])
@pytest.mark.parametrize(
    ("source", "flags", "refused"),
    [
        # a function a launch can name is checked, kernel or not (one compile serves all)
        ("#include <stdlib.h>\ndiv_t h(int a) { return div(a, 2); }", (), "'h'"),
        ("#include <stdlib.h>\nstatic div_t h(int a) { return div(a, 2); }", (), None),
        # checks that do not compile are dropped: the source is compiled alone
        (
            "#include <signal.h>\nstruct s { int a; };\n"
            "sigset_t h(struct s v) { sigset_t s; (void)v; return s; }",
            (),
            None,
        ),
        ("#include <signal.h>\n#if 0\nsigset_t gone(int a);\n#endif", (), None),
        # definitions in #if branches whose parameters differ: which compiles is not told
        (
            "#include <stdlib.h>\n#ifdef NOT_DEFINED\nint two(int* o, div_t d) { return d.quot; }"
            "\n#else\nint two(int* o, long long d) { return (int)d; }\n#endif",
            (),
            None,
        ),
        # a warning the checks draw (a deprecated function's call) is not one: made an
        # error, it would hide the refusal
        (
            "#include <signal.h>\n__attribute__((deprecated)) sigset_t d(int a) "
            "{ sigset_t s; (void)a; sigemptyset(&s); return s; }",
            ("-Werror",),
            "'d'",
        ),
        # nor does a call of a function the preprocessor drops (an implicit declaration):
        # made an error, and the first error fatal, it would hide a later refusal
        (
            "#include <signal.h>\n#if 0\nsigset_t gone(int a) { return 0; }\n#endif\n"
            "sigset_t h(int a) { sigset_t s; (void)a; sigemptyset(&s); return s; }",
            ("-Werror", "-Wfatal-errors"),
            "'h'",
        ),
        # nor does a check of a type only a dropped typedef makes, which does not compile
        (
            "#if 0\ntypedef float only_t;\nvoid gone(int* o, only_t x) { o[0] = (int)x; }\n"
            "#endif\n#include <stdlib.h>\nvoid h(int* o, div_t d) { o[0] = d.quot; }",
            ("-Werror", "-Wfatal-errors"),
            "'h'",
        ),
        # a function the preprocessor drops is not refused; one in a branch it keeps is
        (
            "#include <stdlib.h>\n#if 0\nvoid gone(int* o, div_t d) { o[0] = d.quot; }\n#endif",
            (),
            None,
        ),
        (
            "#ifndef GUARD\n#define GUARD\n#include <stdlib.h>\n"
            "#if 0\nvoid gone(int* o, div_t d) { o[0] = d.quot; }\n#endif\n"
            "void live(int* o, div_t d) { o[0] = d.quot; }\n#endif",
            ("-Werror", "-Wfatal-errors"),
            "'live'",
        ),
        # the source's own errors come first
        ("#include <signal.h>\nsigset_t h(int a) { sigset_t s; return s }", (), "failed"),
        ("nosuch_t h(int a) { return a; }", (), "failed"),
        # strict flags: the checks draw no diagnostic of their own
        (
            "#include <signal.h>\nsigset_t h(int a) { sigset_t s; (void)a; sigemptyset(&s); "
            "return s; }",
            ("-std=gnu89", "-pedantic-errors", "-Wall", "-Wextra", "-Werror"),
            "'h'",
        ),
    ],
)
def test_the_compiler_checks_the_return_types_of_every_function_a_launch_can_name(
    cc: str, source: str, flags: tuple[str, ...], refused: str | None
) -> None:
    """The compile of a source checks what each of its functions that a launch can name
    returns, where the source does not say: one compile serves every kernel of it, so a
    function with external linkage that is no kernel is checked too (declared static,
    it is not). A check that does not compile (a function the preprocessor drops, one
    that takes a struct) is dropped, and the source compiled alone; a source that does
    not compile says so itself, with its log. The checks draw no warning (none that
    ``-Werror`` makes an error of them). Definitions in ``#if`` branches whose parameters
    differ are not checked: which compiles is not told (checked: the dropped one's
    struct parameter was refused, the whole source with it). A check of a type that
    only a typedef in an ``#if 0`` block makes, which does not compile, comes after the
    others (checked: first, it hid the later refusal under -Wfatal-errors, and the
    source was taken). A function the preprocessor drops is not refused (checked: its
    struct parameter was, and the whole source with it), and its check, which does not
    compile, hides no other's refusal under -Wfatal-errors (the source is compiled again
    without it; checked: the live function was taken). Checked: the deprecated
    function's refusal failed without the check's warnings turned off (it was
    taken)."""
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} here")
    from asyncmetal.backends.cpu import CCompiler

    source += "\nvoid k(int* out) { out[0] = 1; }\n"
    compiler = CCompiler(cc, ("-O2", *flags))
    if refused is None:
        assert compiler.compile(source)
        assert "asyncmetal" not in compiler._last_log
        return
    with pytest.raises(am.CompileError) as info:
        compiler.compile(source)
    if refused == "failed":
        assert info.value.message.startswith(f"{cc} failed") and info.value.log
        assert "asyncmetal" not in info.value.log
    else:
        assert info.value.message.startswith(f"function {refused} of the source ")
        assert "declare one that is no kernel static" in info.value.message


# Compilers and flags that change how diagnostics are told (formats) or what a warning
# is (errors), which the signature checks read through.
DIAGNOSTICS = [
    ("gcc", ("-fdiagnostics-format=json",)),
    ("clang", ("-fdiagnostics-format=msvc",)),
    ("clang", ("-fdiagnostics-format=vi",)),
    ("gcc", ("-fdiagnostics-plain-output", "-fno-diagnostics-show-caret")),
    ("gcc", ("-Werror", "-Wall", "-Wextra", "-Wpedantic", "-Wc++-compat")),
    ("clang", ("-Weverything", "-Werror", "-Wno-missing-prototypes")),
]


@pytest.mark.parametrize(("cc", "flags"), DIAGNOSTICS)
def test_a_refusal_by_the_checks_is_told_in_any_diagnostics_format(
    cc: str, flags: tuple[str, ...]
) -> None:
    """The checks' refusal is read from the compiler's diagnostics in whatever format
    the flags ask for (GCC's JSON, clang's msvc and vi styles...), and the checks draw
    no warning of their own under strict flags: a refused function is refused. A
    source whose checks refuse nothing compiles under the same flags. Checked: fails
    without the fix (the JSON, msvc and vi formats' refusals were not recognised, and
    the source compiled alone was taken); a parameter of a header's array type is
    refused as one in each format (checked: it was refused as no pointer or scalar of
    at most 8 bytes, without the array's check); so is one whose type a typedef in a
    dropped ``#if`` block makes otherwise than the header does (checked: it was
    taken). A function the preprocessor drops is not refused, in any format (checked:
    it was)."""
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} here")
    from asyncmetal.backends.cpu import CCompiler

    compiler = CCompiler(cc, ("-O2", *flags))
    kernel = "void k(int* out);\nvoid k(int* out) { out[0] = 1; }\n"
    refused = (
        "#include <signal.h>\nsigset_t h(int a);\n"
        "sigset_t h(int a) { sigset_t s; (void)a; sigemptyset(&s); return s; }\n"
    )
    with pytest.raises(am.CompileError) as info:
        compiler.compile(refused + kernel)
    assert info.value.message.startswith("function 'h' of the source returns 'sigset_t'")
    array = (
        "#include <setjmp.h>\nvoid h(int* out, jmp_buf b);\n"
        "void h(int* out, jmp_buf b) { out[0] = b == 0; }\n"
    )
    with pytest.raises(am.CompileError) as info:
        compiler.compile(array + kernel)
    assert info.value.message.startswith(
        "function 'h' of the source takes 'jmp_buf b' by value, which the compiler says is an array"
    ), info.value.message
    dropped = (
        "#include <math.h>\n#if 0\ntypedef double float_t;\n#endif\n"
        "void h(int* out, float_t x);\nvoid h(int* out, float_t x) { out[0] = x > 0; }\n"
    )
    with pytest.raises(am.CompileError) as info:
        compiler.compile(dropped + kernel)
    assert info.value.message.startswith(
        "function 'h' of the source takes 'float_t x' by value, which the source reads as float64"
    ), info.value.message
    taken = "#include <math.h>\nfloat_t h(float_t a);\nfloat_t h(float_t a) { return a; }\n"
    assert compiler.compile(taken + kernel)
    assert "asyncmetal" not in compiler._last_log
    gone = "#include <stdlib.h>\n#if 0\nvoid gone(int* o, div_t d) { o[0] = d.quot; }\n#endif\n"
    assert compiler.compile(gone + kernel)
    assert "asyncmetal" not in compiler._last_log
    with pytest.raises(am.CompileError) as info:
        compiler.compile(gone + refused + kernel)
    assert info.value.message.startswith("function 'h' of the source returns 'sigset_t'")


@pytest.mark.parametrize("cc", ["gcc", "clang"])
@pytest.mark.parametrize(
    ("before", "param", "refused"),
    [
        ("#include <signal.h>", "sigset_t s", "a struct or union"),  # 128 bytes: in memory
        ("#include <stdlib.h>", "div_t d", "a struct or union"),  # a struct in a register
        ("#include <signal.h>\n#define ARG sigset_t", "const ARG s", "a struct or union"),
        ("", "big_t b", "a struct or union"),
        ("#define TYPE(name) name##_t", "TYPE(big) b", "a struct or union"),
        ("", "big_t b __attribute__((unused))", "a struct or union"),
        ("", "wide_t w", "a struct or union"),
        ("", "real_t r", "no pointer or scalar"),  # a long double: in memory
        ("", "v8_t v", "no pointer or scalar"),
        ("", "complex_t c", "no pointer or scalar"),
        ("", "wide_int_t i", "no pointer or scalar"),
        ("", "real_t", "no pointer or scalar"),  # unnamed (C23)
        # arrays: a parameter of one is a pointer, of a size a pointer has too (cell_t)
        ("#include <stdarg.h>", "va_list ap", "an array"),
        ("#include <setjmp.h>", "jmp_buf b", "an array"),
        ("#include <setjmp.h>", "sigjmp_buf b", "an array"),
        ("", "cell_t c", "an array"),
        ("", "atomic_int_t a", None),
        ("", "fptr_t p", None),
        ("", "count_t n", None),
        ("", "real64_t x", None),
        ("", "flag_t f", None),
        ("", "answer_t a", None),
        ("#include <math.h>", "float_t x", None),
        ("#include <sys/types.h>", "pid_t p", None),
    ],
)
def test_the_compiler_checks_parameters_of_types_the_source_does_not_show(
    tmp_path: Path, cc: str, before: str, param: str, refused: str | None
) -> None:
    """A value parameter whose type a header or a macro makes (``sigset_t``, ``div_t``,
    a typedef of a struct, a ``long double``, a vector...) is not read from the source:
    the compiler is asked its class and size, and a function that a launch can name
    that takes a struct or union, or another type than a pointer or scalar of at most 8
    bytes, by value is refused, naming it and the parameter (a launch passes each value
    in an integer or float register, where the C calling convention passes such a type
    in memory or split). Pointers, scalars, enums and bools are taken. Checked: fails
    without the fix (each was compiled, and launched with whatever the caller gave as an
    int)."""
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} here")
    from asyncmetal.backends.cpu import CCompiler

    (tmp_path / "returned.h").write_text(RETURNED_H)
    source = (
        f'#include "returned.h"\n{before}\n'
        f"void k(long long* out, {param}) {{ out[0] = (long long)sizeof(out); }}\n"
    )
    compiler = CCompiler(cc, ("-O2", "-std=gnu2x", f"-I{tmp_path}"))
    if refused is None:
        assert compiler.compile(source)
        assert "asyncmetal" not in compiler._last_log
        return
    with pytest.raises(am.CompileError) as info:
        compiler.compile(source)
    assert info.value.name == "k"
    assert info.value.message.startswith(
        f"function 'k' of the source takes {param!r} by value, which the compiler says is {refused}"
    ), info.value.message


@pytest.mark.parametrize(
    ("before", "param", "body"),
    [
        ("", "cell_t c", "out[0] = c[0];"),
        ("#include <stdarg.h>", "va_list ap", "out[0] = va_arg(ap, long long);"),
    ],
)
def test_a_cpu_kernel_taking_a_header_array_type_is_refused(
    tmp_path: Path, before: str, param: str, body: str
) -> None:
    """A parameter of an array type a header makes (``va_list``, a typedef of
    ``long long[1]``) is a pointer to the array's first element, which the source does
    not show: a launch would pass it 7, which the kernel reads through. Refused at
    compile, naming the kernel, the parameter and why (an array). Run in a child, which
    a launch that crashes kills. Checked: fails without the fix (cell_t was taken, and
    its launch killed the child with SIGSEGV, return code -11; va_list was refused as
    "no pointer or scalar of at most 8 bytes", passed "in memory or in vector or paired
    registers", which is not how a pointer is passed)."""
    (tmp_path / "returned.h").write_text(RETURNED_H)
    source = f'#include "returned.h"\n{before}\nvoid k(long long* out, {param}) {{ {body} }}'
    child = run_child(
        RETURNED_CHILD, source, f"-I{tmp_path}", hung="the compile or the launch hung"
    )
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    refusal = (
        f"refused k kernel 'k': function 'k' of the source takes {param!r} by value, which "
        "the compiler says is an array (a header's typedef of one: jmp_buf, va_list...): "
        "a parameter of an array type is a pointer to its first element"
    )
    assert child.stdout.startswith(refusal), child.stdout


@pytest.mark.parametrize("cc", ["gcc", "clang"])
@pytest.mark.parametrize(
    ("before", "param", "refused"),
    [
        # the source reads a float, a pointer, an int; the compiler sees the header's
        ("#if 0\ntypedef float real64_t;\n#endif", "real64_t x", "as float32"),
        ("#ifdef NOT_DEFINED\ntypedef float *real64_t;\n#endif", "real64_t x", "as a pointer"),
        ("#if 0\ntypedef int count_t;\n#endif", "count_t n", "as int32"),
        ("#if 0\n#define real64_t float *\n#endif", "real64_t x", "as a pointer"),
        (
            "#if 0\ntypedef float real64_t;\n#endif\ntypedef real64_t mine_t;",
            "mine_t m",
            "as float32",
        ),
        ("#if 0\ntypedef long long big_t;\n#endif", "big_t b", "a struct or union"),
        # what the source reads is what compiles: taken
        ("#if 0\ntypedef double real64_t;\n#endif", "real64_t x", None),
        ("#if 0\ntypedef long long count_t;\n#endif", "count_t n", None),
        ("#if 0\ntypedef float *fptr_t;\n#endif", "fptr_t p", None),
        ("#if 0\ntypedef long long *cell_t;\n#endif", "cell_t c", None),  # (an array's)
        ("#ifndef MINE\n#define MINE\ntypedef double mine_t;\n#endif", "mine_t m", None),
        ("#if 1\ntypedef float mine_t;\n#else\ntypedef double mine_t;\n#endif", "mine_t m", None),
    ],
)
def test_a_parameter_typed_in_an_if_block_is_checked_to_be_what_the_source_reads(
    tmp_path: Path, cc: str, before: str, param: str, refused: str | None
) -> None:
    """A parameter whose type a typedef (or a pointer type's macro) in an ``#if`` block
    makes is read from the source as that type -- a launch passes it as one -- though
    the preprocessor may drop the branch, and the compiler see a header's type of the
    name: it is checked to be what the source reads (a pointer; a float or an integer
    of its size), and refused, naming the function and the parameter, where it is not.
    Checked: fails without the fix (each was compiled, and a launch passed a float, a
    buffer's address or an int where the kernel read a double, a long long or a
    struct)."""
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} here")
    from asyncmetal.backends.cpu import CCompiler

    (tmp_path / "returned.h").write_text(RETURNED_H)
    source = (
        f'#include "returned.h"\n{before}\n'
        f"void k(long long* out, {param}) {{ out[0] = (long long)sizeof(out); }}\n"
    )
    compiler = CCompiler(cc, ("-O2", f"-I{tmp_path}"))
    if refused is None:
        assert compiler.compile(source)
        assert "asyncmetal" not in compiler._last_log
        return
    with pytest.raises(am.CompileError) as info:
        compiler.compile(source)
    assert info.value.name == "k"
    assert info.value.message.startswith(f"function 'k' of the source takes {param!r}")
    if refused.startswith("as "):
        assert f"which the source reads {refused} (a typedef in an #if block" in info.value.message
        assert "define the type outside the #if" in info.value.message
    else:
        assert f"which the compiler says is {refused}" in info.value.message


def test_a_cpu_kernel_launch_passes_no_type_a_dropped_typedef_makes(tmp_path: Path) -> None:
    """A typedef in an ``#if 0`` block (``float``) makes no parameter of the kernel a
    launch passes a value to as that type, where the header it includes makes it
    another (``double``): the kernel is refused at compile, rather than launched with
    a float where it reads a double. Run in a child, as the others. Checked: fails
    without the fix (it ran, and wrote 0 where the kernel was given 7)."""
    (tmp_path / "returned.h").write_text(RETURNED_H)
    source = (
        '#if 0\ntypedef float real64_t;\n#endif\n#include "returned.h"\n'
        "void k(long long* out, real64_t x) { out[0] = (long long)x; }"
    )
    child = run_child(
        RETURNED_CHILD, source, f"-I{tmp_path}", hung="the compile or the launch hung"
    )
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    refusal = (
        "refused k kernel 'k': function 'k' of the source takes 'real64_t x' by value, "
        "which the source reads as float32"
    )
    assert child.stdout.startswith(refusal), child.stdout


def test_the_compiler_identity_changes_with_the_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A C compiler's identity (the compile cache's key) names the checks its compiles
    append to a source (``signature_checks``), by what they are made of: checks made
    otherwise are another identity, so binaries cached before them are compiled again
    (the source's key alone would find them)."""
    from asyncmetal import _compile
    from asyncmetal.backends.cpu import CCompiler

    compiler = CCompiler()
    if shutil.which(compiler.cc[0]) is None:
        pytest.skip("no C compiler here")
    before = compiler.version()
    with monkeypatch.context() as patch:
        patch.setattr(_compile, "_QUIET", (*_compile._QUIET, 'ignored "-Wshadow"'))
        _compile.checks_identity.cache_clear()
        changed = compiler.version()
    _compile.checks_identity.cache_clear()
    assert changed != before
    assert compiler.version() == before


async def test_a_cpu_kernel_taking_a_header_struct_by_value_is_refused(
    anyio_backend: object,
) -> None:
    """A cpu kernel that takes by value a struct a header defines (``div_t``) is refused
    at compile, naming the kernel and the parameter, as one whose source defines the
    struct is; one that takes a header's float type (``float_t``) runs, given a float.
    Checked: fails without the fix (the kernel was taken, and a launch passed 7 as an
    int where the kernel read a struct)."""
    async with am.open_device("cpu") as device:
        source = "#include <stdlib.h>\nvoid k(long long* out, div_t d) { out[0] = d.quot; }"
        with pytest.raises(am.CompileError, match="takes 'div_t d' by value") as info:
            await device.compile(source, "k")
        assert info.value.name == "k"
        source = "#include <math.h>\nvoid k(long long* out, float_t x) { out[0] = (long long)x; }"
        k = await device.compile(source, "k")
        out = await device.alloc(8)
        await device.queue.launch(k, out, vals=(np.float32(7.0),))
        assert (await out.read(np.int64))[0] == 7


async def test_a_refused_return_type_is_named_as_spelled(anyio_backend: object) -> None:
    """The refusal of a kernel that returns a struct names the type as the source spells
    it: ``typedef struct node node;`` (C's common idiom) is not read again and again
    through its own name. Checked: before, it said the kernel returns 'struct struct
    struct struct struct struct struct struct node'."""
    source = (
        "typedef struct node node; struct node { double a[8]; };\n"
        "node k(int* out) { node r = {{0}}; out[0] = 1; return r; }"
    )
    async with am.open_device("cpu") as device:
        with pytest.raises(am.CompileError, match="returns 'node'"):
            await device.compile(source, "k")


async def test_scalar_types_read_past_attributes_and_enums(device: am.Device) -> None:
    """A GNU attribute after a parameter's name is not its type, nor is CUDA's
    ``__grid_constant__``; an enum's typedef (an int) is no struct (on cpu, the C
    compiler says which int: an unsigned one, of enumerators none negative)."""
    source = (
        "typedef enum { A, B } mode;\n"
        "void k(int* out, float x __attribute__((unused)), mode m, unsigned char c) {}"
    )
    k = await device.compile(source, "k")
    mode = "uint32" if device.kind == "cpu" else None
    assert [t for t, _ in k.value_types] == ["float32", mode, "uint8"]
    # CUDA's qualifier of a const kernel parameter (here defined away for C)
    source = "void k(int* out, const __grid_constant__ float x) {}"
    k = await device.compile(source, "k", options=("-D__grid_constant__=",))
    assert k.value_types == (("float32", "const __grid_constant__ float x"),)


async def test_a_macro_naming_a_type_is_read_as_it(device: am.Device) -> None:
    """An object-like macro of type words, defined outside any #if, names its type as a
    typedef does: a Python int reaches a float parameter so declared as that float (not
    as an int's bits in the wrong register), and an unsigned short's range is its own;
    a macro of a qualifier is one."""
    src = (
        "#include <string.h>\n#define REAL float\n#define COUNT unsigned short\n"
        "void k(unsigned char* out, REAL x, COUNT n)"
        " { memcpy(out, &x, 4); memcpy(out + 4, &n, 2); }"
    )
    k, got = await _kept(device, src, (3, 65535))
    assert got[:6] == _bytes_of(np.float32(3), np.uint16(65535))
    assert k.value_types == (("float32", "REAL x"), ("uint16", "COUNT n"))
    out = await device.alloc(8)
    _rejects(
        device,
        am.InvalidArgumentError,
        r"vals\[1\] of 'k' must fit in uint16",
        lambda: device.queue.launch(k, out, vals=(3, 65536)),
    )
    # A macro of a qualifier, or of nothing, beside a type.
    qualified = (
        "#include <string.h>\n#define KCONST const\n#define ARG\n"
        "void k(unsigned char* out, KCONST float x, ARG short n)"
        " { memcpy(out, &x, 4); memcpy(out + 4, &n, 2); }"
    )
    _, got = await _kept(device, qualified, (1.5, -2))
    assert got[:6] == _bytes_of(np.float32(1.5), np.int16(-2))


async def test_unnamed_parameters_take_their_whole_type(device: am.Device) -> None:
    """A value parameter without a name (C23, C++) is its whole declaration: an unnamed
    ``unsigned char`` takes uint8 (not uint32, its last word taken for a name), and an
    unnamed ``const float`` a float (not a type not known, given an int's bits)."""
    src = "void k(unsigned char* out, unsigned char, const float, unsigned short n) {}"
    k = await device.compile(src, "k", options=("-std=c2x",))
    assert [t for t, _ in k.value_types] == ["uint8", "float32", "uint16"]
    out = await device.alloc(8)
    _rejects(
        device,
        am.InvalidArgumentError,
        r"vals\[0\] of 'k' must fit in uint8",
        lambda: device.queue.launch(k, out, vals=(256, 1, 2)),
    )
    await device.queue.launch(k, out, vals=(255, 3, 2))


async def test_a_parameter_of_an_array_typedef_is_a_buffer(anyio_backend: object) -> None:
    """A parameter whose type is an array typedef of the source (``typedef float
    vec3[3];``) is a pointer in C: a buffer, as a pointer typedef's is. Checked: before,
    it was read as a value of a type not known -- the kernel could not be given its
    buffer, and a value given instead was taken as an address."""
    async with am.open_device("cpu") as device:
        src = "typedef float vec3[3];\nvoid k(vec3 v, int n) { v[0] = v[1] + n; }"
        k = await device.compile(src, "k")
        assert k.params == ("buffer", "value")
        buf = await device.alloc(12)
        await buf.write(np.array([0, 40, 0], np.float32))
        await device.queue.launch(k, buf, vals=(2,))
        assert (await buf.read(np.float32))[0] == 42


async def test_each_declarator_of_a_typedef_is_its_own_type(anyio_backend: object) -> None:
    """A typedef of several declarators (``typedef float *fp, real;``) makes each name
    its own type: ``fp`` a pointer (a buffer), ``real`` a float (a value), and so for an
    array's or a function pointer's names beside a plain one. Checked: before, the last
    name was read as the pointer (or the array) -- ``real x`` was taken for a buffer, and
    the kernel could not be given its value."""
    async with am.open_device("cpu") as device:
        for typedef in (
            "typedef float *fp, real;",
            "typedef float real, *fp;",
            "typedef float (*fn)(float), *fp, real;",
            "typedef float vec3[3], real, *fp;",
        ):
            src = f"{typedef}\nvoid k(fp out, real x, int n) {{ out[0] = x + n; }}"
            k = await device.compile(src, "k")
            assert k.params == ("buffer", "value", "value"), typedef
            out = await device.alloc(4)
            await device.queue.launch(k, out, vals=(np.float32(40), 2))
            assert (await out.read(np.float32))[0] == 42, typedef


async def test_a_typedef_or_macro_of_a_pointer_typedef_is_a_buffer(anyio_backend: object) -> None:
    """A pointer type spelled through a typedef of a pointer typedef (or a macro naming
    one) is a buffer too, however many names it goes through. Checked: before, only
    the typedef spelling out the ``*`` counted: ``fp2 a`` was read as a value of a type
    not known, and a value given for it was taken as an address."""
    async with am.open_device("cpu") as device:
        src = (
            "typedef float *fp;\ntypedef fp fp2;\n#define OUT fp2\n"
            "void k(OUT out, const fp2 in, int n) { out[0] = in[0] + n; }"
        )
        k = await device.compile(src, "k")
        assert k.params == ("buffer", "buffer", "value")
        out, src_buf = await device.alloc(4), await device.alloc(4)
        await src_buf.write(np.array([40], np.float32))
        await device.queue.launch(k, out, src_buf, vals=(2,))
        assert (await out.read(np.float32))[0] == 42


async def test_a_function_like_macro_of_a_pointer_type_makes_a_buffer(
    anyio_backend: object,
) -> None:
    """A parameter whose type a function-like macro of the source makes a pointer
    (``#define GLOBAL_PTR(T) T*``, as portable kernels spell their address spaces) is a
    buffer. Checked: before, it was refused at compile as "not a scalar that launch
    values pass ... pass it in a buffer" -- which it is."""
    async with am.open_device("cpu") as device:
        src = (
            "#define GLOBAL_PTR(T) T *restrict\n"
            "void k(GLOBAL_PTR(float) out, int n) { out[0] = n; }"
        )
        k = await device.compile(src, "k")
        assert k.params == ("buffer", "value")
        out = await device.alloc(4)
        await device.queue.launch(k, out, vals=(42,))
        assert (await out.read(np.float32))[0] == 42


async def test_a_type_defined_in_the_parameter_list_is_one_parameter(
    anyio_backend: object,
) -> None:
    """An enum or struct defined in the parameter list itself is one parameter, its
    braces' commas none of the list's: the enum's kernel takes one value, and the
    struct is refused by its whole declaration. Checked: before, each comma in the
    braces made another parameter (a launch asked for two values, the kernel took one)."""
    async with am.open_device("cpu") as device:
        src = "void k(int* out, enum e { A, B } v) { out[0] = v + 40; }"
        with warnings.catch_warnings():  # (cc's: the enum is not seen outside the list)
            warnings.simplefilter("ignore", am.CompileWarning)
            k = await device.compile(src, "k")
        assert k.params == ("buffer", "value")
        out = await device.alloc(4)
        await device.queue.launch(k, out, vals=(2,))
        assert (await out.read(np.int32))[0] == 42
        struct = "void s(int* out, struct { int a, b; } v) { out[0] = v.a; }"
        with pytest.raises(am.CompileError, match=re.escape("'struct { int a, b; } v'")):
            await device.compile(struct, "s")


async def test_a_reference_parameter_is_refused(device: am.Device) -> None:
    """A C++ reference parameter (CUDA C++ takes one in a kernel: an address the kernel
    reads through) is refused at compile, before compiling: a launch value would be
    read as an address, and ``const float&`` taken as a float."""
    for declaration in ("const float& a", "int &a", "const double &a"):
        source = f"void k(int* out, {declaration}) {{ out[0] = 1; }}"
        with pytest.raises(am.CompileError, match="is a reference") as info:
            await device.compile(source, "k")
        assert declaration in str(info.value) and not info.value.log


VARIADIC = (
    "#include <stdarg.h>\n"
    "void k(double* out, ...)"
    " { va_list ap; va_start(ap, out); out[0] = va_arg(ap, double); va_end(ap); }"
)


async def test_a_variadic_kernel_is_refused(anyio_backend: object) -> None:
    """A variadic kernel (``...``) is refused at compile, before compiling: its values
    have no declared type to pass them as, and a launch is no variadic call (which
    says in a register how many floats it passes: a double read with ``va_arg`` came
    as 0.0). Checked: before, '...' was read as one value of a type not known, and
    the kernel ran with what it read."""
    async with am.open_device("cpu") as device:
        with pytest.raises(am.CompileError, match="kernel 'k' is variadic") as info:
            await device.compile(VARIADIC, "k")
        assert info.value.name == "k" and not info.value.log


CHARS = (
    "#include <string.h>\n"
    "void k(unsigned char* out, char c, const char d)"
    " { memcpy(out, &c, 1); memcpy(out + 1, &d, 1); }"
)


async def test_a_plain_char_takes_the_signedness_its_compiler_gives_it(device: am.Device) -> None:
    """A plain ``char`` is signed or unsigned as the C compiler, with the compile's
    options, has it (asked of it): ``-fsigned-char`` takes -1 and 127 and refuses 200,
    ``-funsigned-char`` (AArch64 Linux's default) takes 200 and refuses -1; compiled
    as it is on x86-64, it is signed."""
    out = await device.alloc(8)
    defaults = [((), "int8")] if platform.machine() == "x86_64" else []
    for options, kind in [*defaults, (("-fsigned-char",), "int8"), (("-funsigned-char",), "uint8")]:
        k = await device.compile(CHARS, "k", options=options)
        assert [t for t, _ in k.value_types] == [kind, kind]
        taken, refused = ((-1, 127), 200) if kind == "int8" else ((200, 255), -1)
        await device.queue.launch(k, out, vals=taken)
        assert (await out.read(np.uint8)).tobytes()[:2] == np.array(taken, kind).tobytes()
        _rejects(
            device,
            am.InvalidArgumentError,
            rf"vals\[1\] of 'k' must fit in {kind} \(its parameter 'const char d'\): {refused}",
            functools.partial(device.queue.launch, k, out, vals=(taken[0], refused)),
        )


async def test_wide_character_parameters_take_their_types(device: am.Device) -> None:
    """``char16_t`` is a uint16 and ``char32_t`` a uint32 (C11's <uchar.h>, C++'s
    keywords); ``wchar_t`` is what the compiler makes it (an int on x86-64 Linux, an
    unsigned short with ``-fshort-wchar``)."""
    src = (
        "#include <string.h>\n#include <uchar.h>\n#include <stddef.h>\n"
        "void k(unsigned char* out, char16_t a, char32_t b, wchar_t w)"
        " { memcpy(out, &a, 2); memcpy(out + 4, &b, 4); memcpy(out + 8, &w, sizeof w); }"
    )
    out = await device.alloc(16)
    wide = "int32" if platform.machine() == "x86_64" else None
    for options, wchar in (((), wide), (("-fshort-wchar",), "uint16")):
        k = await device.compile(src, "k", options=options)
        assert [t for t, _ in k.value_types][:2] == ["uint16", "uint32"]
        assert wchar is None or k.value_types[2][0] == wchar
        await device.queue.launch(k, out, vals=(0xFFFF, 0xFFFF_FFFF, 65))
        got = (await out.read(np.uint8)).tobytes()
        assert got[:2] + got[4:8] == _bytes_of(np.uint16(0xFFFF), np.uint32(0xFFFF_FFFF))
        assert got[8:10] == np.uint16(65).tobytes()
        for i, beyond, kind in ((0, 0x10000, "uint16"), (1, -1, "uint32")):
            vals = [1, 2, 3]
            vals[i] = beyond
            _rejects(
                device,
                am.InvalidArgumentError,
                rf"vals\[{i}\] of 'k' must fit in {kind}",
                functools.partial(device.queue.launch, k, out, vals=vals),
            )


@pytest.mark.parametrize(
    ("machine", "system", "char", "wchar"),
    [
        ("x86_64", "linux", "int8", "int32"),
        ("aarch64", "linux", "uint8", "uint32"),
        ("armv7l", "linux", "uint8", "uint32"),
        ("ppc64le", "linux", "uint8", "int32"),
        ("s390x", "linux", "uint8", "int32"),
        ("riscv64", "linux", "uint8", "int32"),
        ("arm64", "darwin", "int8", "int32"),  # Apple's arm64 ABI: signed
        ("x86_64", "darwin", "int8", "int32"),
        ("ARM64", "win32", "int8", "uint16"),
    ],
)
def test_a_plain_char_where_no_compiler_is_asked_is_the_platforms(
    monkeypatch: pytest.MonkeyPatch, machine: str, system: str, char: str, wchar: str
) -> None:
    """Where the compiler cannot be asked (cuda's NVRTC; a C compiler that does not
    run), a plain char and wchar_t take the host platform's ABI types: simulated by
    the platform they are derived from."""
    from asyncmetal.backends.cpu import CCompiler
    from asyncmetal.backends.cuda import CUDACompiler

    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(sys, "platform", system)
    src = "void k(int* out, char c, wchar_t w, signed char s, unsigned char u) {}"
    expected = [char, wchar, "int8", "uint8"]
    assert [t for t, _ in CUDACompiler()._value_types(src, "k")] == expected
    missing = CCompiler(f"/nonexistent/cc-{uuid.uuid4().hex}")  # (its answer is kept)
    assert [t for t, _ in missing._value_types(src, "k")] == expected


CUDA_TEMPLATE = r"""
template <typename T> __global__ void scale(T* x, T a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}
extern "C" __global__ void scale_f(float* x, float a, int n) { scale<float>(x, a, n); }
extern "C" __global__ void scale_h(unsigned short* x, char16_t a, int n) {}
struct pair { float x, y; };
extern "C" __global__ void by_struct(float* x, pair p) {}
struct __align__(8) aligned final { float x, y; };
extern "C" __global__ void by_aligned(float* x, aligned p) {}
extern "C" __global__ void by_bfloat(float* x, const __nv_bfloat16 b) {}
"""


def test_cuda_kernels_read_from_source_without_a_gpu() -> None:
    """A CUDA kernel's value types are read from its source (no GPU needed): an extern
    "C" wrapper of a template takes its own declared types; the template itself is
    refused at compile (its name is mangled, its types its instantiation's), as are a
    struct that C++ names without the keyword and a bfloat16 (numpy has no such
    scalar), each naming the parameter."""
    from asyncmetal.backends.cuda import CUDACompiler

    nvrtc = CUDACompiler()
    assert nvrtc._signature(CUDA_TEMPLATE, "scale_f").values == (
        ("float32", "float a"),
        ("int32", "int n"),
    )
    assert [t for t, _ in nvrtc._signature(CUDA_TEMPLATE, "scale_h").values] == ["uint16", "int32"]
    refusals = [
        ("scale", r"kernel 'scale' is a template: .*extern \"C\" __global__ void scale_f"),
        ("by_struct", r"parameter 'pair p' is not a scalar that launch values pass"),
        ("by_aligned", r"parameter 'aligned p' is not a scalar"),
        ("by_bfloat", r"'const __nv_bfloat16 b' is not a scalar .*convert it in the kernel"),
    ]
    for name, match in refusals:
        with pytest.raises(am.CompileError, match=match):
            nvrtc._params(CUDA_TEMPLATE, name)


CONVENTION = "long long* out, long long a, double d"
CONVENTION_BODY = "{ out[0] = a; out[1] = (long long)d; }"


@pytest.mark.parametrize(
    ("before", "declared", "options", "refused"),
    [
        ("", "__attribute__((ms_abi)) void", (), "declared ms_abi"),
        ("", "void __attribute__((__ms_abi__))", (), "declared ms_abi"),
        ("#define WINAPI __attribute__((ms_abi))\n", "WINAPI void", (), "declared ms_abi"),
        # A prototype's attribute holds for the definition (clang takes it so)
        (f"__attribute__((ms_abi)) void k({CONVENTION});\n", "void", (), "declared ms_abi"),
        (f"void k({CONVENTION}) __attribute__((ms_abi));\n", "void", (), "declared ms_abi"),
        ("", "__attribute__((vectorcall)) void", (), "declared vectorcall"),
        ("", "__attribute__((regcall)) void", (), "declared regcall"),
        ("", "void", ("-mabi=ms",), "compiled with -mabi=ms"),
        ("", "__attribute__((sysv_abi)) void", (), None),  # the convention itself
        # another function's attribute is its own
        (
            "__attribute__((ms_abi)) long long twice(long long x) { return 2 * x; }\n",
            "void",
            (),
            None,
        ),
        ("", "void", ("-mabi=sysv",), None),
    ],
)
async def test_a_cpu_kernel_of_another_calling_convention_is_refused(
    anyio_backend: object, before: str, declared: str, options: tuple[str, ...], refused: str | None
) -> None:
    """A cpu kernel is called with the C calling convention (x86-64 System V, AArch64):
    one declared ``ms_abi`` (or compiled with ``-mabi=ms``), ``vectorcall`` or
    ``regcall`` takes its parameters in other registers, and reads garbage -- its
    first pointer taken from a register the launch did not set, the process crashed.
    Refused at compile, saying why. Checked: fails without the fix (compiled; launched,
    the process died of a segmentation fault)."""
    source = f"{before}{declared} k({CONVENTION}) {CONVENTION_BODY}"
    async with am.open_device("cpu") as device:
        if refused is not None:
            with pytest.raises(am.CompileError, match=refused) as info:
                await device.compile(source, "k", options=options)
            assert info.value.name == "k"
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", am.CompileWarning)
            k = await device.compile(source, "k", options=options)
        out = await device.alloc(16)
        await device.queue.launch(k, out, vals=(np.int64(42), 7.0))
        assert list(await out.read(np.int64)) == [42, 7]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="-mabi=ms is x86-64's")
async def test_a_cpu_kernel_declared_sysv_abi_takes_mabi_ms(anyio_backend: object) -> None:
    """``-mabi=ms`` leaves a kernel declared ``sysv_abi`` in the C calling convention:
    taken, and launched as any."""
    source = f"__attribute__((sysv_abi)) void k({CONVENTION}) {CONVENTION_BODY}"
    async with am.open_device("cpu") as device:
        k = await device.compile(source, "k", options=("-mabi=ms",))
        out = await device.alloc(16)
        await device.queue.launch(k, out, vals=(np.int64(42), 7.0))
        assert list(await out.read(np.int64)) == [42, 7]


@pytest.mark.parametrize(
    ("returned", "refused"),
    [
        ("struct big { double a[8]; }", True),
        ("const struct big { double a[8]; }", True),
        ("struct { double a[8]; }", True),
        ("union big { double a[8]; }", True),
        ("union wide { double a[8]; } const", True),
        ("struct __attribute__((packed)) big { double a[8]; }", True),
        ("struct big { double a[8]; } g; __typeof__(g)", True),  # an expression's type
        ("__typeof__(float)", False),  # typeof of a type: that type
        ("struct big { double a[8]; } *", False),
        ("enum big { A, B }", False),
        ("__attribute__((noinline)) double", False),  # an attribute is no part of the type
        ("double __attribute__((noinline))", False),
    ],
)
async def test_a_cpu_kernel_returning_a_struct_it_defines_is_refused(
    anyio_backend: object, returned: str, refused: bool
) -> None:
    """A struct or union defined in a kernel's return type is returned as any struct
    (through memory, a hidden first argument shifting the parameters): refused at
    compile, as is the type of an expression (``__typeof__(g)``, not read from the
    source); a pointer to one, an enum (an int) and a double, also behind a GNU
    attribute or as ``__typeof__(float)``, are returned in a register, and dropped.
    Checked: fails without the fix (the struct was read as no return type at all, and
    taken -- the launch crashed the process; the double behind an attribute, and
    ``__typeof__(float)``, were refused as no scalar)."""
    source = (
        f"{returned} k(long long* out, int w) {{ __typeof__(k(out, w)) r; "
        "__builtin_memset(&r, 0, sizeof r); out[0] = w; return r; }"
    )
    async with am.open_device("cpu") as device:
        await _refused_or_run(device, source, refused)


LIBRARY_TYPES = r"""
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
void k(unsigned char* out, int_fast16_t a, uint_least8_t b, off_t c, time_t d, uintmax_t e,
       int_fast8_t f)
{
    memcpy(out, &a, sizeof a); memcpy(out + 8, &b, sizeof b); memcpy(out + 16, &c, sizeof c);
    memcpy(out + 24, &d, sizeof d); memcpy(out + 32, &e, sizeof e); memcpy(out + 40, &f, 1);
}
"""


async def test_integer_types_of_the_c_library_take_their_widths(anyio_backend: object) -> None:
    """A value parameter of a type the C library's headers define (``int_fast16_t``,
    ``uint_least8_t``, ``off_t``, ``time_t``, ``uintmax_t``...) takes that type as the
    compiler has it (asked: each C library and ABI has its own widths), so a value
    reaches it whole, and one that does not fit is refused. Checked: fails without the
    fix (each was a type not known, taken as an int32: 2**40 was refused as no int32,
    and 200 reached the int_fast8_t as -56)."""
    async with am.open_device("cpu") as device:
        k = await device.compile(LIBRARY_TYPES, "k")
        types = [t for t, _ in k.value_types]
        if platform.machine() == "x86_64" and platform.libc_ver()[0] == "glibc":
            assert types == ["int64", "uint8", "int64", "int64", "uint64", "int8"]
        assert None not in types
        out = await device.alloc(48)
        vals = (-(2**40), 255, 2**40, -1, 2**64 - 1, -128)
        await device.queue.launch(k, out, vals=vals)
        got = (await out.read(np.uint8)).tobytes()
        for i, (value, kind) in enumerate(zip(vals, types)):
            size = np.dtype(kind).itemsize
            assert got[8 * i : 8 * i + size] == np.array(value, kind).tobytes(), (i, kind)
        _rejects(
            device,
            am.InvalidArgumentError,
            r"vals\[5\] of 'k' must fit in int8",
            functools.partial(device.queue.launch, k, out, vals=(*vals[:5], 200)),
        )


async def test_a_library_type_the_source_defines_apart_is_not_known(
    anyio_backend: object,
) -> None:
    """A name the source defines in ``#if`` branches is not known to its reading, also
    one the C library or the compiler would define otherwise (``size_t``, ``time_t``):
    which definition compiles cannot be told. Checked: fails without the fix
    (``size_t`` was read as a uint64 whichever branch compiled). The compile asks the
    C compiler, and a launch passes each value as the integer it says, of its size and
    signedness (checked: without that, both were not known, and took an int32)."""
    source = (
        "#ifdef NARROW\ntypedef unsigned short size_t; typedef int time_t;\n"
        "#else\ntypedef unsigned long size_t; typedef long time_t;\n#endif\n"
        "void k(long long* out, size_t n, time_t t) { out[0] = (long long)n + t; }"
    )
    async with am.open_device("cpu") as device:
        out = await device.alloc(8)
        for options, types, n in (
            ((), ["uint64", "int64"], 1 << 40),
            (("-DNARROW",), ["uint16", "int32"], 40000),
        ):
            k = await device.compile(source, "k", options=options)
            assert [t for t, _ in k.value_types] == types
            await device.queue.launch(k, out, vals=(n, -7))
            assert (await out.read(np.int64))[0] == n - 7
            _rejects(
                device,
                am.InvalidArgumentError,
                rf"vals\[0\] of 'k' must fit in {types[0]}",
                functools.partial(device.queue.launch, k, out, vals=(-1, 0)),
            )


SPELLED = r"""
#include <string.h>
void k(unsigned char* out, __typeof__(float) a, _Atomic(float) b, _Atomic double c,
       typeof(unsigned short) d, __const float e, __signed__ char f, __volatile__ int g)
{
    float x = a, y = b; double z = c; int h = g;
    memcpy(out, &x, 4); memcpy(out + 4, &y, 4); memcpy(out + 8, &z, 8);
    memcpy(out + 16, &d, 2); memcpy(out + 20, &e, 4); memcpy(out + 24, &f, 1);
    memcpy(out + 28, &h, 4);
}
"""


async def test_a_type_spelled_through_typeof_or_atomic_is_its_type(anyio_backend: object) -> None:
    """``typeof`` (``__typeof__``) of a type, ``_Atomic`` (an atomic scalar is passed as
    the plain one) and GCC's alternate spellings of the qualifiers and of ``signed``
    name the type they spell: each value reaches the kernel as it. Checked: fails
    without the fix (the floats were refused as no scalar, "pass it in a buffer"; the
    integers were types not known, taken as int32)."""
    async with am.open_device("cpu") as device:
        k = await device.compile(SPELLED, "k")
        types = ["float32", "float32", "float64", "uint16", "float32", "int8", "int32"]
        assert [t for t, _ in k.value_types] == types
        out = await device.alloc(32)
        vals = (1.5, -2.5, 0.1, 65535, 3.25, -128, -(2**31))
        await device.queue.launch(k, out, vals=vals)
        got = (await out.read(np.uint8)).tobytes()
        for at, value, kind in zip((0, 4, 8, 16, 20, 24, 28), vals, types):
            size = np.dtype(kind).itemsize
            assert got[at : at + size] == np.array(value, kind).tobytes(), (at, kind)
        _rejects(
            device,
            am.InvalidArgumentError,
            r"vals\[3\] of 'k' must fit in uint16",
            functools.partial(device.queue.launch, k, out, vals=(*vals[:3], 65536, *vals[4:])),
        )


@pytest.mark.parametrize("declaration", ["__typeof__(1.0) x", "typeof((float)1) x"])
async def test_a_parameter_of_the_type_of_an_expression_is_refused(
    anyio_backend: object, declaration: str
) -> None:
    """A parameter declared ``typeof`` of an expression takes a type not read from the
    source: refused at compile, saying so (not that it is no scalar, to pass in a
    buffer). Checked: fails without the fix (one was refused as no scalar; the other
    was a type not known, a Python int passed as an int32 to a double)."""
    source = f"void k(double* out, {declaration}) {{ out[0] = x; }}"
    async with am.open_device("cpu") as device:
        with pytest.raises(am.CompileError, match=r"takes the type of an expression \(typeof\)"):
            await device.compile(source, "k")


def test_float32x_is_a_double() -> None:
    """``_Float32x`` (GCC's: a double where double is IEEE binary64) is a float64, not
    refused as no scalar. Read from the source alone: not every compiler has it."""
    from asyncmetal._compile import c_value_types

    assert c_value_types("void k(float* o, _Float32x a) {}", "k") == (("float64", "_Float32x a"),)

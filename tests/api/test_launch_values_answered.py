"""Value parameters of types the source does not read (a typedef in ``#if`` branches, a
macro a compile option defines, a header's type): on cpu the compile's checks ask the C
compiler what each one is, and a launch passes Python numbers as that type."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

import asyncmetal as am
from tests.api.test_launch_values import DIAGNOSTICS
from tests.support.children import run_child

# A float, a double or a half, as the compile's options choose: the source cannot say
# which.
REAL = r"""
#if defined(USE_DOUBLE)
typedef double real;
#elif defined(USE_HALF)
typedef _Float16 real;
#else
typedef float real;
#endif
void k(real *out, real x) { out[0] = x; }
"""

# Compiles kernel k of the source argv[1] (with the options after argv[2]) and launches
# it with a Python int, then a Python float: prints what the kernel wrote (read as the
# numpy type argv[2]), or the launch's refusal (a launch that crashes kills the child,
# not the test).
REAL_CHILD = """
import sys, anyio, numpy as np, asyncmetal as am
async def main():
    async with am.open_device("cpu") as device:
        k = await device.compile(sys.argv[1], "k", options=tuple(sys.argv[3:]))
        out = await device.alloc(8)
        for value in (3, -2.5):
            try:
                await device.queue.launch(k, out, vals=(value,))
            except am.AsyncMetalError as exc:
                print("refused", type(exc).__name__, exc)
                continue
            print((await out.read(np.dtype(sys.argv[2])))[0])
anyio.run(main)
"""


@pytest.mark.parametrize("cc", ["gcc", "clang"])
@pytest.mark.parametrize(
    ("options", "type_"),
    [((), "float32"), (("-DUSE_DOUBLE",), "float64"), (("-DUSE_HALF",), "float16")],
)
def test_python_numbers_take_the_floating_type_the_compiler_says(
    cc: str, options: tuple[str, ...], type_: str
) -> None:
    """A parameter whose type a typedef in ``#if`` branches makes (a float, a double
    under ``-DUSE_DOUBLE``, a ``_Float16`` under ``-DUSE_HALF``) is not known to the
    source's reading; the compiler says it is a float of 4 (8, 2) bytes, and a Python
    int or float is passed as one, in a float register, where the kernel reads it. Run
    in a child, which a kernel given garbage may crash. Checked: fails without the fix
    (the int was passed as an int32, in an integer register: the kernel wrote 0.0; the
    float was refused, its type "not known here")."""
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} here")
    if type_ == "float16":
        macros = subprocess.run(
            [cc, "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True, check=False
        )
        if "__FLT16_MAX__" not in macros.stdout:
            pytest.skip(f"{cc} has no _Float16 here")
    child = run_child(
        REAL_CHILD,
        REAL,
        type_,
        *options,
        hung="the compile or the launch hung",
        env={**os.environ, "CC": cc},
    )
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert child.stdout == "3.0\n-2.5\n", child.stdout


# Parameters of every kind of type the source does not read, and what the compiler says
# each is (under -DWIDE where that differs: the other branch of each #if).
ANSWERED = r"""
#include <stddef.h>
#include <locale.h>
#ifdef WIDE
typedef double real; typedef long idx; typedef long long ssize;
typedef enum { NEGATIVE = -1, POSITIVE = 1 } mode; typedef _Bool flag;
#else
typedef float real; typedef unsigned short idx; typedef signed char ssize;
typedef enum { FIRST, SECOND } mode; typedef unsigned char flag;
#endif
#if 0
void gone(int* out, div_t d) { out[0] = d.quot; }
#endif
void k(int* out, real r, idx i, ssize s, mode m, flag f, MACRO t, locale_t l, size_t n,
       ptrdiff_t d) {
    (void)r; (void)i; (void)s; (void)m; (void)f; (void)t; (void)l; (void)n; (void)d;
    out[0] = 1;
}
"""
ANSWERS = {
    (): ["float32", "uint16", "int8", "uint32", "uint8", "float32", "uint64"],
    ("-DWIDE",): ["float64", "int64", "int64", "int32", "bool", "float32", "uint64"],
}


@pytest.mark.parametrize("wide", [(), ("-DWIDE",)])
@pytest.mark.parametrize(
    ("cc", "flags"),
    [
        ("gcc", ()),
        ("clang", ()),
        *DIAGNOSTICS,
        ("gcc", ("-ffunction-sections", "-fdata-sections", "-Wl,--gc-sections")),
        ("clang", ("-flto",)),
    ],
)
def test_the_compiler_answers_each_type_the_source_does_not_read(
    cc: str, flags: tuple[str, ...], wide: tuple[str, ...]
) -> None:
    """The compiled binary holds the compiler's answer for each such parameter, under
    any diagnostics format and strict warnings (the answers draw none), and kept where
    the linker drops unused data: a float of 4 or 8 bytes is a float32 or float64, an
    integer (an enum) the integer of its size and signedness, ``_Bool`` a bool, a
    header's pointer type (``locale_t``) an address; a header's ``size_t`` and
    ``ptrdiff_t``, which the source's reading knows, stay as read; a function the
    preprocessor drops is no answer's, nor stops the others'. Checked: fails without
    the fix (each was None)."""
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} here")
    from asyncmetal._compile import answered_values
    from asyncmetal.backends.cpu import CCompiler

    compiler = CCompiler(cc, ("-O2", *flags, "-DMACRO=float", *wide))
    signature = compiler._signature(ANSWERED, "k")
    assert [t for t, _ in signature.values] == [None] * 7 + ["uint64", "int64"]
    binary = compiler.compile(ANSWERED)
    assert "asyncmetal" not in compiler._last_log, compiler._last_log
    answered = answered_values(signature, "k", binary, ANSWERED)
    assert [t for t, _ in answered.values] == [*ANSWERS[wide], "uint64", "int64"]
    assert [d for _, d in answered.values] == [d for _, d in signature.values]
    assert answered.kinds == signature.kinds
    # (another kernel's answers are not this one's)
    assert answered_values(signature, "gone", binary, ANSWERED) == signature


# A source whose data holds the mark that precedes the compiler's answers, and answers
# after it that say the parameter is an int32 (a string literal: the checks' own answers
# are data too).
COPIED_MARK = r"""
#if defined(USE_DOUBLE)
typedef double real;
#else
typedef float real;
#endif
const char *told(void) {
    return "asyncmetal signature answers:\x01\x00k\x01\x00\x01\x04\x01\x00\x00\x00\x00";
}
void k(real *out, real x) { out[0] = x; }
"""


@pytest.mark.parametrize("cc", ["gcc", "clang"])
def test_the_source_s_own_copy_of_the_mark_is_not_read(cc: str) -> None:
    """The answers are read after a mark that holds the digest of the source, which no
    source holds: where the source's own data holds ``ANSWERS_MARK`` before the
    answers, with other answers after it, the compiler's are read all the same.
    Checked: fails without the fix (the literal's answers were read: int32)."""
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} here")
    from asyncmetal._compile import ANSWERS_MARK, answered_values, answers_mark
    from asyncmetal.backends.cpu import CCompiler

    for options, type_ in (((), "float32"), (("-DUSE_DOUBLE",), "float64")):
        compiler = CCompiler(cc, ("-O2", *options))
        signature = compiler._signature(COPIED_MARK, "k")
        assert signature.values == ((None, "real x"),)
        binary = compiler.compile(COPIED_MARK)
        # (the copy comes first in the binary: a search for the mark alone finds it)
        assert -1 < binary.find(ANSWERS_MARK) < binary.find(answers_mark(COPIED_MARK))
        answered = answered_values(signature, "k", binary, COPIED_MARK)
        assert answered.values == ((type_, "real x"),)


def _answers_of(src: str, kind: int, size: int, half: int) -> bytes:
    """A binary's data as the checks of ``src`` keep the compiler's answer for the
    parameter 1 of kernel k: a type of class ``kind``, of ``size`` bytes, ``_Float16``
    or not (``half``); no integer, no ``_Bool``."""
    from asyncmetal._compile import answers_mark

    answer = bytes((1, 0, *b"k", 1, 0, kind, size, 0, 0, half, 0, 0))
    return b"\x7fELF..." + answers_mark(src) + answer + b"..."


# A 2-byte float parameter whose type a compile option's macro makes.
HALF = r"""
#ifdef HALF_TYPE
typedef HALF_TYPE half_t;
#else
typedef float half_t;
#endif
void k(float *out, half_t x) { out[0] = (float)x; }
"""


def test_a_2_byte_float_that_is_no_float16_is_refused() -> None:
    """A 2-byte float that the compiler says is not ``_Float16`` (``__bf16``) has no
    launch value (a Python int was passed as an int32, in an integer register): it is
    refused, naming the kernel, the parameter and the type, as the source's own
    ``__bf16`` is; a ``_Float16`` is a float16. Checked: fails without the fix (the
    type stayed not known: "DID NOT RAISE")."""
    from asyncmetal._compile import answered_values
    from asyncmetal.backends.cpu import CCompiler

    signature = CCompiler("cc")._signature(HALF, "k")
    assert signature.values == ((None, "half_t x"),)
    half = answered_values(signature, "k", _answers_of(HALF, 8, 2, 1), HALF)
    assert half.values == (("float16", "half_t x"),)
    with pytest.raises(am.CompileError, match="not _Float16") as info:
        answered_values(signature, "k", _answers_of(HALF, 8, 2, 0), HALF)
    assert info.value.name == "k" and "'half_t x'" in str(info.value)
    assert "__bf16" in str(info.value) and "convert it in the kernel" in str(info.value)


# Compilers that may have ``__bf16`` (GCC 13 and clang 17 on x86-64 on): each is asked.
BF16_COMPILERS = ["gcc", "clang", *(f"gcc-{v}" for v in (13, 14)), "clang-19"]


@pytest.mark.parametrize("cc", BF16_COMPILERS)
def test_a_compiled_bf16_is_refused_at_compile(cc: str) -> None:
    """Through a device: the kernel of a ``__bf16`` parameter whose type a compile
    option's macro makes is refused at compile (a ``_Float16``'s compiles), where the
    compiler has ``__bf16``. Checked with clang 19: fails without the fix (the kernel
    compiled, its parameter not known, and the launch of 3 made it write 0.0)."""
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} here")
    probe = subprocess.run(
        [cc, "-fsyntax-only", "-x", "c", "-"],
        input="void f(__bf16 x, _Float16 y) { (void)x; (void)y; }",
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"{cc} has no __bf16 (or no _Float16) here")
    child = run_child(
        BF16_CHILD,
        HALF,
        hung="the compile or the launch hung",
        env={**os.environ, "CC": cc},
    )
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    lines = child.stdout.splitlines()
    assert lines[0].startswith("refused CompileError"), lines
    assert "'half_t x'" in lines[0] and "__bf16" in lines[0], lines
    assert lines[1:] == ["3.0"], lines


# Compiles kernel k of the source argv[1] with HALF_TYPE __bf16, then _Float16, and
# launches it with 3: prints the refusal, or what the kernel wrote.
BF16_CHILD = """
import sys, anyio, numpy as np, asyncmetal as am
async def main():
    async with am.open_device("cpu") as device:
        out = await device.alloc(8)
        for type_ in ("__bf16", "_Float16"):
            try:
                k = await device.compile(sys.argv[1], "k", options=(f"-DHALF_TYPE={type_}",))
                await device.queue.launch(k, out, vals=(3,))
            except am.AsyncMetalError as exc:
                print("refused", type(exc).__name__, str(exc).replace(chr(10), " "))
                continue
            print((await out.read(np.float32))[0])
anyio.run(main)
"""

"""A kernel parameter that is a function pointer (or a function, which a parameter takes
as a pointer to one) is refused at compile: a launch passes it a buffer's address or an
integer, and a call through it would jump into data."""

from __future__ import annotations

import pytest

import asyncmetal as am
from asyncmetal._compile import scalar_params

pytestmark = pytest.mark.anyio

# Each (source, kernel, the parameter the refusal names).
REFUSED = [
    ("void k(int* out, int (*f)(int), int n) { out[0] = n; }", "int (*f)(int)"),
    ("void k(int* out, int (* const f)(int)) { out[0] = 1; }", "int (* const f)(int)"),
    ("void k(int* out, int f(int)) { out[0] = 1; }", "int f(int)"),
    ("void k(int* out, int (*(*f)(int))[3]) { out[0] = 1; }", "int (*(*f)(int))[3]"),
    ("typedef int (*fn)(int); void k(int* out, fn f) { out[0] = 1; }", "fn f"),
    ("typedef int (*fn)(int); typedef fn fn2; void k(int* o, const fn2 f) { *o = 1; }", "fn2 f"),
    ("typedef int fnt(int); void k(int* out, fnt f) { out[0] = 1; }", "fnt f"),
    ("typedef int fnt(int); void k(int* out, fnt *f) { out[0] = 1; }", "fnt *f"),
    ("typedef int fnt(int); typedef fnt *fnp; void k(int* out, fnp f) { *out = 1; }", "fnp f"),
]

# Pointers to memory, and types that parentheses are part of: what they were.
KEPT = [
    ("void k(int* out, int (**f)(int)) { out[0] = 1; }", ("buffer", "buffer")),
    ("typedef int (*fn)(int); void k(int* out, fn *f) { out[0] = 1; }", ("buffer", "buffer")),
    ("void k(int* out, int (*rows)[4]) { out[0] = 1; }", ("buffer", "buffer")),
    ("#define PTR(T) T*\nvoid k(PTR(int) out, int n) { *out = n; }", ("buffer", "value")),
    ("void k(int* out, _Atomic(int) n) { out[0] = n; }", ("buffer", "value")),
    ("void k(int* out, __typeof__(int) n) { out[0] = n; }", ("buffer", "value")),
    ("void k(int* out, int n __attribute__((unused))) { out[0] = 1; }", ("buffer", "value")),
]


@pytest.mark.parametrize(("src", "param"), REFUSED)
async def test_a_function_pointer_parameter_is_refused(
    anyio_backend: object, src: str, param: str
) -> None:
    """Checked: before, a declarator of one was a buffer (``int (*f)(int)``: a launch
    passed a buffer's address as the function) and a typedef of one a value."""
    async with am.open_device("cpu") as device:
        with pytest.raises(am.CompileError, match="is a function pointer") as info:
            await device.compile(src, "k")
        assert info.value.name == "k" and param in str(info.value) and not info.value.log


@pytest.mark.parametrize(("src", "params"), KEPT)
async def test_pointers_to_memory_stay_buffers(
    anyio_backend: object, src: str, params: tuple[str, ...]
) -> None:
    async with am.open_device("cpu") as device:
        kernel = await device.compile(src, "k")
        assert kernel.params == params
        out = await device.alloc(16)
        values = (3,) * params.count("value")
        await device.queue.launch(kernel, *([out] * params.count("buffer")), vals=values)
        await device.queue.synchronize()


def test_cuda_kernels_are_read_alike() -> None:
    """The cuda backend reads its kernels' parameters the same way (``scalar_params``),
    C++'s ``using`` of a function pointer type too."""
    for src in (
        'extern "C" __global__ void k(float* x, float (*f)(float)) {}',
        'using fn = float (*)(float); extern "C" __global__ void k(float* x, fn f) {}',
        'using fnt = float(float); extern "C" __global__ void k(float* x, fnt* f) {}',
    ):
        with pytest.raises(am.CompileError, match="is a function pointer"):
            scalar_params(src, "k")
    kept = 'using fp = float*; extern "C" __global__ void k(fp x, decltype(1) n) {}'
    assert scalar_params(kept, "k") == ("buffer", "value")

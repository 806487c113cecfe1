"""A kernel parameter that is a function pointer (or a function, which a parameter takes
as a pointer to one) is refused at compile: a launch passes it a buffer's address or an
integer, and a call through it would jump into data."""

from __future__ import annotations

import shutil

import pytest

import asyncmetal as am
from asyncmetal._compile import answered_values, scalar_params
from asyncmetal.backends.cpu import CCompiler

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


# A header's function pointer type (``sighandler_t``: the source shows no ``(*``), also
# through a compile option's macro, which the compiler alone can say is one; and types
# of a header or a macro that are pointers to data (``void``, ``const void`` -- macOS's
# ``CFTypeRef`` --, an incomplete struct).
HEADER_TYPES = r"""
#define _GNU_SOURCE
#include <signal.h>
#include <time.h>
#include <locale.h>
struct opaque;
void k(float* out, PARAM) { out[0] = 1.0f; }
"""
HEADER_FUNCTION_POINTERS = ["sighandler_t h", "const sighandler_t h", "HANDLER h"]
# A header's function type (``cookie_read_function_t``: no source's ``(`` shows it),
# which a parameter takes as a pointer to it; and an atomic function pointer.
HEADER_FUNCTIONS = [
    "cookie_read_function_t f",
    "READER f",
    "cookie_read_function_t f __attribute__((unused))",
]
ATOMIC_FUNCTION_POINTERS = ["_Atomic(sighandler_t) h", "const _Atomic(sighandler_t) h"]
HEADER_DATA_POINTERS = ["timer_t t", "locale_t l", "OPAQUE o", "CONST_VOID c", "VOLATILE_VOID v"]
STRICT = ("-Werror", "-Wall", "-Wextra", "-Wpedantic", "-Wno-unused-parameter")


@pytest.mark.parametrize("cc", ["gcc", "clang"])
@pytest.mark.parametrize("param", HEADER_FUNCTION_POINTERS)
def test_a_header_s_function_pointer_type_is_refused_by_the_compiler(cc: str, param: str) -> None:
    """The compile's checks ask the compiler whether such a parameter points to a
    function, and refuse it so, naming the function and the parameter. Checked: fails
    without the fix (the compile succeeded, and the compiler's answer, a pointer, made
    the parameter a uint64 value)."""
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} here")
    compiler = CCompiler(cc, ("-O2", *STRICT, "-DHANDLER=__sighandler_t"))
    with pytest.raises(am.CompileError, match="is a function pointer") as info:
        compiler.compile(HEADER_TYPES.replace("PARAM", param))
    assert info.value.name == "k" and repr(param) in str(info.value) and not info.value.log


@pytest.mark.parametrize("std", ["-std=gnu89", "-std=c99", "-std=gnu17"])
@pytest.mark.parametrize("cc", ["gcc", "clang", "clang-19"])
@pytest.mark.parametrize("param", HEADER_FUNCTIONS)
def test_a_header_s_function_type_is_refused_by_the_compiler(cc: str, param: str, std: str) -> None:
    """A parameter of a header's (or a macro's) function type is a pointer to such a
    function: refused as a function pointer is, naming the function and the parameter,
    under strict warnings and whatever the C standard. Checked: fails without the fix
    (the checks declared a struct's member of the type, which does not compile: the
    check was dropped, the compile succeeded, the parameter not known -- "DID NOT
    RAISE")."""
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} here")
    compiler = CCompiler(cc, ("-O2", std, *STRICT, "-DREADER=cookie_read_function_t"))
    src = "#define _GNU_SOURCE\n#include <stdio.h>\n" + HEADER_TYPES.replace("PARAM", param)
    with pytest.raises(am.CompileError, match="is a function pointer") as info:
        compiler.compile(src)
    assert info.value.name == "k" and repr(param) in str(info.value) and not info.value.log
    assert "cookie_read_function_t" in str(info.value)


async def test_a_header_s_function_type_is_refused_by_a_device_each_time(
    anyio_backend: object,
) -> None:
    """Through a device and its compile cache: refused at each compile (no binary of the
    source is kept to load), and the device goes on."""
    src = "#define _GNU_SOURCE\n#include <stdio.h>\n" + HEADER_TYPES.replace(
        "PARAM", "cookie_read_function_t f"
    )
    async with am.open_device("cpu") as device:
        for _ in range(2):
            with pytest.raises(am.CompileError, match="is a function pointer") as info:
                await device.compile(src, "k")
            assert info.value.name == "k" and "'cookie_read_function_t f'" in str(info.value)
        kept = await device.compile(src.replace("cookie_read_function_t f", "sigset_t *s"), "k")
        assert kept.params == ("buffer", "buffer")


@pytest.mark.parametrize("cc", ["gcc", "clang"])
@pytest.mark.parametrize("param", ["cookie_read_function_t", "cookie_read_function_t *"])
def test_an_unnamed_parameter_of_a_function_type_or_a_pointer_to_one_is_refused(
    cc: str, param: str
) -> None:
    """Unnamed (C23, and GNU C before it), the checks name it themselves."""
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} here")
    src = f"#define _GNU_SOURCE\n#include <stdio.h>\nvoid k(float* out, {param}) {{}}"
    with pytest.raises(am.CompileError, match="is a function pointer") as info:
        CCompiler(cc, ("-O2",)).compile(src)
    assert info.value.name == "k" and repr(param) in str(info.value)


@pytest.mark.parametrize("cc", ["gcc", "clang", "clang-19"])
@pytest.mark.parametrize("param", ATOMIC_FUNCTION_POINTERS)
def test_an_atomic_function_pointer_is_refused_as_one(cc: str, param: str) -> None:
    """``_Atomic(sighandler_t)`` is a function pointer for clang too, not an array: clang's
    ``_Atomic`` is a type of its own, which the array check's comparison with the
    comma's (not atomic) pointer did not ignore. Checked: fails without the fix on clang
    (refused "which the compiler says is an array"); gcc passed before and after."""
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} here")
    compiler = CCompiler(cc, ("-O2", *STRICT))
    with pytest.raises(am.CompileError, match="is a function pointer") as info:
        compiler.compile(HEADER_TYPES.replace("PARAM", param))
    assert info.value.name == "k" and repr(param) in str(info.value)
    assert "an array" not in str(info.value)


@pytest.mark.parametrize("cc", ["gcc", "clang", "clang-19"])
def test_atomic_values_of_a_header_s_type_stay_values(cc: str) -> None:
    """An atomic scalar or pointer to data of a header's type is no array, nor a
    function: its answer is read (clang's ``_Atomic`` too)."""
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} here")
    compiler = CCompiler(cc, ("-O2", *STRICT))
    params = ["_Atomic(timer_t) t", "_Atomic(pid_t) p"]
    src = "#include <sys/types.h>\n" + HEADER_TYPES.replace("PARAM", ", ".join(params))
    signature = compiler._signature(src, "k")
    binary = compiler.compile(src)
    assert "asyncmetal" not in compiler._last_log, compiler._last_log
    answered = answered_values(signature, "k", binary, src)
    assert answered.values == (("uint64", params[0]), ("int32", params[1]))


@pytest.mark.parametrize("cc", ["gcc", "clang"])
def test_a_header_s_pointer_to_data_stays_an_address(cc: str) -> None:
    """A pointer to data of a header's or a macro's type (``void *``, ``const void *``,
    a pointer to an incomplete struct) is no function's: an address, as before, under
    strict warnings (the check draws none). Checked: a check of ``const void``'s
    pointer as a function's, which declared a parameter of ``const void``, did not
    compile, and left the type not known (None)."""
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} here")
    macros = ("-DOPAQUE=struct opaque *", "-DCONST_VOID=const void *")
    compiler = CCompiler(cc, ("-O2", *STRICT, *macros, "-DVOLATILE_VOID=volatile void *"))
    src = HEADER_TYPES.replace("PARAM", ", ".join(HEADER_DATA_POINTERS))
    signature = compiler._signature(src, "k")
    binary = compiler.compile(src)
    assert "asyncmetal" not in compiler._last_log, compiler._last_log
    answered = answered_values(signature, "k", binary, src)
    assert answered.values == tuple(("uint64", p) for p in HEADER_DATA_POINTERS)


# A value of a header's type with an attribute, in each spelling gcc and clang take
# (``__attribute`` too), after the name or before the type.
ATTRIBUTED_VALUES = [
    "pid_t p __attribute((unused))",
    "pid_t p __attribute__((unused))",
    "__attribute((unused)) pid_t p",
    "pid_t __attribute((unused)) p",
    "int p __attribute((unused))",
]


@pytest.mark.parametrize("cc", ["gcc", "clang"])
@pytest.mark.parametrize("param", ATTRIBUTED_VALUES)
def test_an_attribute_of_either_spelling_is_no_function_s_parameter_list(
    cc: str, param: str
) -> None:
    """``__attribute((unused))`` after a parameter's name is an attribute, as
    ``__attribute__((unused))`` is: the value is read, not refused as a function
    pointer. Checked: fails without the fix (``__attribute`` read as a function's name,
    its parentheses as its parameter list: "is a function pointer")."""
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} here")
    compiler = CCompiler(cc, ("-O2", *STRICT))
    src = "#include <sys/types.h>\n" + HEADER_TYPES.replace("PARAM", param)
    signature = compiler._signature(src, "k")
    binary = compiler.compile(src)
    assert answered_values(signature, "k", binary, src).values == (("int32", param),)


def test_a_double_bracket_attribute_keeps_a_value() -> None:
    """A C23 ``[[...]]`` attribute (gcc takes it in any C mode), before the type or
    after the name, beside a typedef's and a parameter's ``__attribute``: each value is
    read as its type."""
    if shutil.which("gcc") is None:
        pytest.skip("no gcc here")
    src = (
        "typedef int i32 __attribute((aligned(4)));\n"
        "void k(int* out, [[maybe_unused]] i32 a, int b [[gnu::unused]],"
        " int c __attribute((unused))) { out[0] = a; }"
    )
    compiler = CCompiler("gcc", ("-O2",))
    signature = compiler._signature(src, "k")
    answered = answered_values(signature, "k", compiler.compile(src), src)
    assert answered.kinds == ("buffer", "value", "value", "value")
    assert [scalar for scalar, _ in answered.values] == ["int32"] * 3


# A pointer to a header's (or a macro's) function type: a function pointer, which the
# source's ``*`` shows to be a pointer, not to what.
HEADER_FUNCTION_POINTEES = [
    "cookie_read_function_t *f",
    "cookie_read_function_t * const f",
    "READER *f",
    "cookie_read_function_t *f __attribute((unused))",
]
# Pointers to data of a header's type: to a function pointer too (``sighandler_t *h``,
# as ``void (**h)(int)`` is, a buffer of them), and to a function type's pointer.
HEADER_POINTEES_OF_DATA = ["sighandler_t *h", "cookie_read_function_t **f", "FILE *s", "pid_t *p"]


@pytest.mark.parametrize("cc", ["gcc", "clang"])
@pytest.mark.parametrize("param", HEADER_FUNCTION_POINTEES)
def test_a_pointer_to_a_header_s_function_type_is_refused(cc: str, param: str) -> None:
    """Refused as a function pointer, naming the function and the parameter, under
    strict warnings. Checked: fails without the fix (no check was made of a parameter
    the source shows a ``*`` in: "DID NOT RAISE", the kernel's parameter a buffer)."""
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} here")
    compiler = CCompiler(cc, ("-O2", *STRICT, "-DREADER=cookie_read_function_t"))
    src = "#define _GNU_SOURCE\n#include <stdio.h>\n" + HEADER_TYPES.replace("PARAM", param)
    with pytest.raises(am.CompileError, match="is a function pointer") as info:
        compiler.compile(src)
    assert info.value.name == "k" and repr(param) in str(info.value) and not info.value.log


@pytest.mark.parametrize("cc", ["gcc", "clang"])
def test_a_header_s_pointers_to_data_stay_buffers(cc: str) -> None:
    """Under strict warnings, the checks of them drawing none."""
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} here")
    compiler = CCompiler(cc, ("-O2", *STRICT))
    params = ", ".join(HEADER_POINTEES_OF_DATA)
    src = "#define _GNU_SOURCE\n#include <stdio.h>\n" + HEADER_TYPES.replace("PARAM", params)
    assert compiler._signature(src, "k").kinds == ("buffer",) * 5
    compiler.compile(src)
    assert "asyncmetal" not in compiler._last_log, compiler._last_log


async def test_a_pointer_to_a_header_s_function_type_is_refused_by_a_device(
    anyio_backend: object,
) -> None:
    """``dev.compile`` refuses it (it read it as a buffer); a pointer to a function
    pointer stays one."""
    src = "#define _GNU_SOURCE\n#include <stdio.h>\n" + HEADER_TYPES.replace(
        "PARAM", "cookie_read_function_t *f"
    )
    async with am.open_device("cpu") as device:
        with pytest.raises(am.CompileError, match="is a function pointer") as info:
            await device.compile(src, "k")
        assert info.value.name == "k" and "'cookie_read_function_t *f'" in str(info.value)
        kept = await device.compile(
            src.replace("cookie_read_function_t *f", "sighandler_t *h"), "k"
        )
        assert kept.params == ("buffer", "buffer")

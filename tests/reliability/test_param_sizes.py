"""A kernel whose parameters, as its source reads, are not what the loaded binary takes
is refused when it is compiled (``CompileError``, its module unloaded): its launches
would pass it other bytes than it reads -- a header's struct by value read past its
8-byte slot into the next ones. The cuda backend asks the driver (cuFuncGetParamInfo),
over the fake driver of test_cuda_faults.py here; on a GPU, tests/backends/cuda."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import asyncmetal as am
from asyncmetal._compile import Signature, binary_disagrees
from tests.reliability.test_cuda_faults import _Driver, fake_driver

pytestmark = pytest.mark.anyio

HEADER_TYPES = "void k(float* x, pair_t p, int n) { }"  # parsed for its parameters only


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Driver]:
    yield from fake_driver(monkeypatch)


async def _compiled(dev: am.Device, src: str, name: str) -> Any:
    params = await dev._params(src, name)
    assert isinstance(params, tuple)
    return await dev._program(("key", name), params, b"", src, dev._backend.compiler, None)


@pytest.mark.parametrize(
    ("sizes", "refused"),
    [
        ((8, 16, 4), "parameter 'pair_t p' takes 16 bytes in the compiled kernel"),
        (
            (8, 8, 8),
            "parameter 'int n' reads as int32 (4 bytes) from its source, the compiled kernel "
            "takes 8",
        ),
        ((8, 8), "its source reads as 3 parameters, the compiled kernel takes 2"),
        (
            (4, 8, 4),
            "parameter 1 reads as a buffer (a device address of 8 bytes), the compiled kernel "
            "takes 4",
        ),
        ((8, 8, 4), None),  # a header's 8-byte type: a launch's slot carries it
        ((8, 2, 4), None),
        (None, None),  # a driver that cannot say (before CUDA 12.4): loaded as before
    ],
)
async def test_a_kernel_the_binary_disagrees_with_is_refused(
    anyio_backend: object, driver: _Driver, sizes: tuple[int, ...] | None, refused: str | None
) -> None:
    """Checked failing without the check: each refused kernel loaded, a Program."""
    if sizes is not None:
        driver.param_sizes[b"k"] = sizes
    dev = await am.open_device("cuda:0")
    try:
        if refused is None:
            program = await _compiled(dev, HEADER_TYPES, "k")
            assert program.value_types == ((None, "pair_t p"), ("int32", "int n"))
            assert dev._backend.param_sizes(program.native) == sizes
            return
        with pytest.raises(am.CompileError) as caught:
            await _compiled(dev, HEADER_TYPES, "k")
        assert str(caught.value).startswith(f"kernel 'k': {refused}"), caught.value
        assert caught.value.name == "k"
    finally:
        await dev.close()
    # The refused kernel's module was let go of (by the close at the latest), as every
    # other: none is left loaded.
    assert driver.calls.count("cuModuleUnload") == driver.calls.count("cuModuleLoadData") == 1


def test_a_source_read_agreeing_with_its_binary_passes() -> None:
    """Sizes of every scalar type a launch passes, buffers between them."""
    kinds = ("buffer", "value", "value", "buffer", "value", "value", "value")
    values = (
        ("bool", "bool b"),
        ("float16", "__half h"),
        ("float64", "double d"),
        ("uint64", "size_t n"),
        (None, "header_t t"),
    )
    assert binary_disagrees(Signature(kinds, values), (8, 1, 2, 8, 8, 8, 1)) is None  # type: ignore[arg-type]
    assert binary_disagrees(Signature(kinds, values), None) is None  # type: ignore[arg-type]
    assert binary_disagrees(Signature(kinds, values), (8, 1, 2, 8, 8, 8, 3)) == (  # type: ignore[arg-type]
        "parameter 'header_t t' takes 3 bytes in the compiled kernel: a launch passes a "
        "value of 1, 2, 4 or 8 bytes (an integer, a float, a double or a half), never a "
        "struct by value"
    )

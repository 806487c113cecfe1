"""Where a host copy's operand is: the address its look-up among the memory lent out or
wrapped takes (``asyncmetal._copyargs._lent_back``), found both ways it runs -- the
extension's one call (``native/py_module.c``, ``buffer_address``) and numpy
(``_copyargs.numpy_address``, used where the extension is not loaded). Every case runs
through both, which must agree with numpy's own view of the memory."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _copyargs, _native
from tests.api.test_interop import _copied_behind_a_held_fill
from tests.support.kernels import KERNELS
from tests.support.launch_paths import run_without_extension

pytestmark = pytest.mark.anyio

Address = Callable[[Any], tuple[int, int]]
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "host_copy_lookup.py"


@pytest.fixture(params=["extension", "numpy"])
def address(request: pytest.FixtureRequest) -> Address:
    if request.param == "numpy":
        return _copyargs.numpy_address
    _native.runtime()
    extension = _native.extension()
    if extension is None:
        pytest.skip(f"the extension module is not built here: {_native.extension_error}")
    found: Address = extension.buffer_address
    return found


@pytest.fixture
def address_path(address: Address) -> Iterator[Address]:
    """``address``, as the one host copies use while the test runs."""
    kept = _copyargs._addresser.chosen
    _copyargs._addresser.chosen = address
    try:
        yield address
    finally:
        _copyargs._addresser.chosen = kept


def _numpy_says(obj: Any) -> tuple[int, int]:
    array = np.frombuffer(obj, np.uint8)
    return array.ctypes.data, array.nbytes


def test_where_each_kind_of_buffer_is(address: Address) -> None:
    """Writable and read-only, whole and views of others, bytes-like and arrays of any
    shape that is C-contiguous: each at numpy's address, with its length in bytes."""
    base = np.arange(64, dtype=np.int32).reshape(8, 8)
    readonly = base.copy()
    readonly.flags.writeable = False
    cases: list[Any] = [
        base,
        base[2:5],  # a view of another array, further in
        base[3],
        readonly,
        memoryview(base).cast("B"),
        memoryview(base[4:]).toreadonly(),
        b"some bytes",
        bytearray(b"a bytearray"),
        memoryview(bytearray(b"0123456789"))[3:7],
        np.zeros((2, 3), np.float64).view(np.uint8),
    ]
    for obj in cases:
        assert address(obj) == _numpy_says(obj), obj
    assert address(base[2:5])[0] == base.ctypes.data + 2 * 8 * 4
    assert address(base[2:5])[1] == 3 * 8 * 4
    assert address(readonly)[0] == readonly.ctypes.data


def test_empty_buffers_have_no_bytes(address: Address) -> None:
    for obj in (b"", bytearray(), memoryview(b""), np.empty(0, np.uint8), np.empty((3, 0))):
        found, nbytes = address(obj)
        assert nbytes == 0, obj
        assert found == _numpy_says(obj)[0], obj


def test_what_is_not_one_block_of_bytes_is_refused_as_numpy_refuses_it(
    address: Address,
) -> None:
    """What is not C-contiguous (a strided view, a Fortran-ordered array, a memoryview
    of either), what has no buffer, and a released memoryview: the exporter's own error,
    the one numpy.frombuffer raises."""
    base = np.arange(64, dtype=np.uint8).reshape(8, 8)
    released = memoryview(b"gone")
    released.release()
    refused: list[tuple[Any, type[Exception]]] = [
        (base[:, ::2], ValueError),
        (base[::2], ValueError),
        (np.asfortranarray(base), ValueError),
        (memoryview(base[:, ::2]), BufferError),
        (memoryview(base)[::2], BufferError),
        (3, TypeError),
        ("text", TypeError),
        (released, ValueError),
    ]
    for obj, error in refused:
        with pytest.raises(error) as numpys:
            np.frombuffer(obj, np.uint8)
        with pytest.raises(error, match=f"^{re.escape(str(numpys.value))}$"):
            address(obj)


def test_a_buffer_stays_usable_after_its_address_was_taken(address: Address) -> None:
    """The view taken for the address is let go of: a bytearray can still be resized
    (it refuses while a view of it is held) and a memoryview released."""
    grows = bytearray(b"abc")
    address(grows)
    grows.extend(b"def")
    view = memoryview(bytearray(8))
    address(view)
    view.release()


def test_host_copies_find_addresses_with_the_extension_where_it_is_loaded() -> None:
    _native.runtime()
    extension = _native.extension()
    if extension is None:
        pytest.skip(f"the extension module is not built here: {_native.extension_error}")
    assert _copyargs._addresser() is extension.buffer_address


async def test_host_operands_over_wrapped_and_lent_memory_are_ordered_either_way(
    anyio_backend: object, address_path: Address
) -> None:
    """The array a buffer wraps (``am.from_dlpack``), a part of it, and an array over a
    buffer's memory (``np.from_dlpack``), as copies' host operands: each found by its
    address, the copy comes after a command still held that writes the buffer."""
    async with am.open_device("cpu") as dev:
        fill = await dev.compile(KERNELS, "fill")
        held, copier = dev.new_queue(), dev.new_queue()
        array = np.zeros(16, np.int32)
        wraps = am.from_dlpack(array)
        for step, source in enumerate((array, array[4:12]), 2):
            out = await _copied_behind_a_held_fill(held, copier, fill, wraps, step, source)
            assert set((await out.read(np.int32)).tolist()) == {step}, step
        buf = await dev.alloc(64)
        lent = np.from_dlpack(buf.typed(np.int32))
        out = await _copied_behind_a_held_fill(held, copier, fill, buf, 9, lent)
        assert (await out.read(np.int32)).tolist() == [9] * 16


def test_numpy_finds_addresses_without_the_extension() -> None:
    """Before any device loaded the runtime, and where the extension is not built
    (``ASYNCMETAL_EXTENSION=0``), host copies find addresses through numpy, and a copy
    of wrapped memory is still ordered as a use of its buffer."""
    code = (
        "import anyio, numpy as np, asyncmetal as am\n"
        "from asyncmetal import _copyargs, _native\n"
        "assert _native.loaded() is None\n"
        "assert _copyargs._addresser() is _copyargs.numpy_address\n"
        "assert _copyargs._addresser.chosen is None  # (not kept: the runtime may load later)\n"
        "async def main():\n"
        "    async with am.open_device('cpu') as dev:\n"
        "        array = np.arange(16, dtype=np.int32)\n"
        "        buf = am.from_dlpack(array)\n"
        "        out = await dev.alloc(64)\n"
        "        await dev.queue.copy(out, array)\n"
        "        assert (await out.read(np.int32)).tolist() == list(range(16))\n"
        "        assert _native.extension() is None\n"
        "        assert _copyargs._addresser() is _copyargs.numpy_address\n"
        "        assert _copyargs._lent_back(dev.queue._state, memoryview(array).cast('B'))"
        "[0] is not None\n"
        "        del buf\n"
        "        print('ok')\n"
        "anyio.run(main)\n"
    )
    proc = run_without_extension(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ok\n"


def test_the_benchmark_of_host_copies_over_lent_memory_runs(tmp_path: Path) -> None:
    """benchmarks/host_copy_lookup.py: its five cases run, the copies move the bytes
    (it checks), and each figure is there (printed, not judged)."""
    out = tmp_path / "host_copy_lookup.json"
    cmd = [sys.executable, str(BENCH), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures = json.loads(out.read_text())["host_copy_lookup"]
    assert sorted(figures) == ["export", "exports_5000", "import", "imports_5000", "none"]
    for case in figures.values():
        assert case["copy_operands_us"] > 0 and case["submit_us"] > 0

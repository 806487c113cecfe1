"""How ``from_dlpack`` takes a producer's capsule, both ways it runs: the native
extension's one call (``native/py_dlpack.c``) and the ctypes fallback
(``asyncmetal._dlpack.take_capsule``, used where the extension is not loaded). Every
case runs through both; the two are also compared field by field on the same inputs.

The capsules are numpy's, edited through ctypes before they are handed over, so that
each field the parser checks can be made wrong on its own. numpy's deleter drops the
manager's reference to the array: the array's reference count tells whether it ran,
and that it ran once (a capsule refused is left for its own destructor to delete)."""

from __future__ import annotations

import ctypes
import gc
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _dlpack, _interop, _native
from asyncmetal._dlpack import (
    CAPSULE_NAME,
    CAPSULE_NAME_VERSIONED,
    DLManagedTensor,
    DLManagedTensorVersioned,
    DLTensor,
    capsule_pointer,
)

pytestmark = pytest.mark.anyio

Take = Callable[[object], tuple[Any, ...]]
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "interop.py"
_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]


def _extension_take() -> Take:
    extension = _native.extension()
    if extension is None:
        pytest.skip(f"the native extension is not in use here: {_native.extension_error}")
    take: Take = extension.dlpack_take
    return take


@pytest.fixture(params=["extension", "ctypes"])
def take(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Take:
    """from_dlpack made to take capsules one way or the other."""
    fn = _extension_take() if request.param == "extension" else _dlpack.take_capsule
    monkeypatch.setattr(_interop._taker, "chosen", fn)
    return fn


def _tensor(capsule: object) -> tuple[Any, DLTensor]:
    """The managed tensor (legacy or versioned) of an unconsumed capsule, and its DLTensor."""
    managed: Any
    if _capsule_name(capsule) == CAPSULE_NAME_VERSIONED.value:
        address = capsule_pointer(capsule, CAPSULE_NAME_VERSIONED)
        managed = DLManagedTensorVersioned.from_address(address)
    else:
        managed = DLManagedTensor.from_address(capsule_pointer(capsule, CAPSULE_NAME))
    return managed, managed.dl_tensor


class Producer:
    """An array whose capsules are edited by ``edit(managed, tensor)`` before they are
    handed over; the last capsule is kept, to see its name afterwards."""

    def __init__(
        self,
        array: np.ndarray[Any, Any],
        edit: Callable[[Any, DLTensor], None] | None = None,
        versioned: bool = True,
    ) -> None:
        self.array = array
        self.edit = edit
        self.versioned = versioned
        self.capsule: object = None

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.array.__dlpack_device__()  # type: ignore[no-any-return]

    def __dlpack__(self, **kwargs: object) -> object:
        capsule = self.array.__dlpack__(max_version=(1, 0) if self.versioned else None)
        if self.edit is not None:
            self.edit(*_tensor(capsule))
        self.capsule = capsule
        return capsule


def _refs(array: np.ndarray[Any, Any]) -> int:
    gc.collect()
    return sys.getrefcount(array)


@pytest.mark.parametrize("versioned", [True, False])
async def test_a_capsule_is_taken_renamed_and_deleted_once(take: Take, versioned: bool) -> None:
    array = np.arange(12, dtype=np.int32).reshape(3, 4)
    producer = Producer(array, versioned=versioned)
    refs = _refs(array)
    async with am.open_device("cpu"):
        buf = am.from_dlpack(producer)
        used = b"used_dltensor_versioned" if versioned else b"used_dltensor"
        assert _capsule_name(producer.capsule) == used
        assert buf.nbytes == 48
        assert (await buf.map(np.int32)).ctypes.data == array.ctypes.data
        await am.copy(buf, np.full(12, 7, np.int32))
        assert array.ravel().tolist() == [7] * 12
        producer.capsule = None  # a used capsule's destructor does nothing
        assert _refs(array) > refs  # the manager holds it while the buffer is
        del buf
    assert _refs(array) == refs  # the buffer and its device's records of it gone: deleted once


def _offset_data(managed: Any, tensor: DLTensor) -> None:
    tensor.data -= 8
    tensor.byte_offset = 8


def _odd_unit_stride(managed: Any, tensor: DLTensor) -> None:
    tensor.strides[1] = 99  # an extent of 1: its stride does not matter


async def test_byte_offset_and_the_strides_of_unit_extents(take: Take) -> None:
    async with am.open_device("cpu"):
        array = np.arange(8, dtype=np.int64)
        buf = am.from_dlpack(Producer(array, _offset_data))
        assert (await buf.map(np.int64)).ctypes.data == array.ctypes.data
        column = np.arange(6, dtype=np.float32).reshape(6, 1)
        buf = am.from_dlpack(Producer(column, _odd_unit_stride))
        assert (await buf.read(np.float32)).tolist() == list(range(6))


def _set(**fields: Any) -> Callable[[Any, DLTensor], None]:
    """An edit: ``version_major``, ``flags``, ``ndim``, ``bits``, ``lanes``, ``device``,
    ``shape`` and ``shape1`` (index, extent) or ``stride`` (index, stride)."""

    def edit(managed: Any, tensor: DLTensor) -> None:
        for name, value in fields.items():
            if name == "version_major":
                managed.version.major = value
            elif name == "flags":
                managed.flags = value
            elif name in ("bits", "lanes"):
                setattr(tensor.dtype, name, value)
            elif name == "device":
                tensor.device.device_type = value
            elif name in ("shape", "shape1"):
                tensor.shape[value[0]] = value[1]
            elif name == "stride":
                tensor.strides[value[0]] = value[1]
            else:
                setattr(tensor, name, value)

    return edit


REFUSED = [
    (_set(version_major=2), am.ExchangeError, r"DLPack 2\.0; asyncmetal reads 1\.x"),
    (_set(flags=1), am.ExchangeError, "read-only"),
    (_set(shape=(0, 0)), am.InvalidArgumentError, "empty"),
    (_set(stride=(0, 5)), am.InvalidArgumentError, "not C-contiguous"),
    (_set(ndim=-1), am.ExchangeError, "malformed: a negative ndim"),
    (_set(shape=(1, -4)), am.ExchangeError, "malformed: a negative extent"),
    (_set(bits=0), am.ExchangeError, "malformed: a zero-sized element type"),
    # Past 64 bits: the element count; its bits; its bits (+ 7) as an int64.
    (_set(shape=(0, 1 << 62), shape1=(1, 8)), am.ExchangeError, "malformed: a size past 64"),
    (_set(shape=(0, 1 << 60)), am.ExchangeError, "malformed: a size past 64"),
    (_set(lanes=1 << 15, shape=(0, 1 << 42)), am.ExchangeError, "malformed: a size past 64"),
    (_set(device=2), am.ExchangeError, r"tensor is on DLPack device \(2, 0\)"),
    # No memory, or memory ending past the address space (before, both were taken: a
    # Buffer at address 0, or where the sum wrapped to; checked failing without).
    (_set(data=None), am.ExchangeError, "malformed: no data"),
    (_set(byte_offset=(1 << 64) - 8), am.ExchangeError, "malformed: an address past"),
    (_set(data=(1 << 64) - 16), am.ExchangeError, "malformed: an address past"),
]


@pytest.mark.parametrize(("edit", "error", "match"), REFUSED)
async def test_what_is_refused_and_the_capsule_left_to_delete(
    take: Take, edit: Callable[[Any, DLTensor], None], error: type[Exception], match: str
) -> None:
    array = np.zeros((2, 3), np.float32)
    producer = Producer(array, edit)
    refs = _refs(array)
    async with am.open_device("cpu"):
        with pytest.raises(error, match=match):
            am.from_dlpack(producer)
    producer.capsule = None  # unconsumed or ours: the deleter runs once either way
    assert _refs(array) == refs


def _int4(padded: bool) -> Callable[[Any, DLTensor], None]:
    """An edit: the elements int4, flagged padded (one a byte) or not (packed)."""

    def edit(managed: Any, tensor: DLTensor) -> None:
        tensor.dtype.code, tensor.dtype.bits = 0, 4
        if padded:
            managed.flags |= _dlpack.FLAG_SUBBYTE_PADDED

    return edit


@pytest.mark.parametrize(("padded", "nbytes"), [(True, 5), (False, 3)])
async def test_sub_byte_elements_padded_or_packed(take: Take, padded: bool, nbytes: int) -> None:
    """DLPack 1.1's padded flag: five int4 elements are five bytes where the capsule
    sets it, else packed two a byte (the last byte half used). Checked: with the flag
    unread, both ways took a padded capsule as 3 bytes of its 5."""
    array = np.arange(5, dtype=np.int8)
    async with am.open_device("cpu"):
        buf = am.from_dlpack(Producer(array, _int4(padded)))
        assert buf.nbytes == nbytes
        assert (await buf.map(np.int8)).ctypes.data == array.ctypes.data


def _pinned(managed: Any, tensor: DLTensor) -> None:
    tensor.device.device_type = 3  # kDLCUDAHost


async def test_host_memory_pinned_or_not_is_host_memory(take: Take) -> None:
    """A producer may say kDLCPU of pinned memory its capsule calls kDLCUDAHost (or the
    reverse): either way it is host memory, taken on the cpu device."""
    async with am.open_device("cpu") as dev:
        assert am.from_dlpack(Producer(np.zeros(4, np.int32), _pinned)).device is dev


async def test_what_is_not_an_unconsumed_capsule(take: Take) -> None:
    class Returns:
        def __init__(self, capsule: object) -> None:
            self.capsule = capsule

        def __dlpack_device__(self) -> tuple[int, int]:
            return (1, 0)

        def __dlpack__(self, **kwargs: object) -> object:
            return self.capsule

    taken = np.zeros(4).__dlpack__()
    take(taken)  # consumed once: renamed
    async with am.open_device("cpu"):
        for capsule in (object(), taken):
            with pytest.raises(am.ArgumentTypeError, match="no unconsumed DLPack capsule"):
                am.from_dlpack(Returns(capsule))


@pytest.mark.parametrize(
    ("edit", "versioned"),
    [(None, True), (None, False), (_offset_data, True), (_odd_unit_stride, False)]
    + [(_int4(True), True), (_int4(False), True), (_int4(False), False)]
    + [(edit, True) for edit, _, _ in REFUSED],
)
def test_extension_and_ctypes_agree(edit: Callable[[Any, DLTensor], None], versioned: bool) -> None:
    """The same capsule, taken each way, gives the same answer (but the owner)."""
    native = _extension_take()
    array = np.arange(6, dtype=np.float32).reshape(6, 1)
    found = []
    for take in (native, _dlpack.take_capsule):
        capsule = Producer(array, edit, versioned).__dlpack__()
        result = take(capsule)
        found.append(result[:1] + result[2:] if result[0] == _dlpack.TAKEN else result)
    assert found[0] == found[1]


def test_the_benchmarks_split_of_from_dlpack_runs_on_cpu(tmp_path: Path) -> None:
    """benchmarks/interop.py's cpu part: am.from_dlpack of a numpy array, and the
    producer's own __dlpack__ measured alone (its figures are printed, not judged)."""
    out = tmp_path / "interop.json"
    cmd = [sys.executable, str(BENCH), "--cpu", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    split = json.loads(out.read_text())["dlpack"]
    assert 0 < split["producer_dlpack_us"] < split["am_from_dlpack_us"]
    assert split["rest_us"] == split["am_from_dlpack_us"] - split["producer_dlpack_us"]


@pytest.mark.anyio
async def test_a_round_trip_of_cpu_1_memory_comes_back_on_cpu_1(anyio_backend: object) -> None:
    """A ``cpu:1`` buffer through numpy and back: the buffer lands on ``cpu:1`` (where
    its memory is), sharing the original's record of uses, so a copy of it orders
    itself after a held-up write of the original. Checked: before, it landed on ``cpu``
    (the first device of host memory), unordered: the copy read the old bytes."""
    fill = "void fill(int* x, int v, int n) { for (int i = 0; i < n; i++) x[i] = v; }"
    d0, d1 = await am.open_device("cpu"), await am.open_device("cpu:1")
    try:
        k = await d1.compile(fill, "fill")
        buf = await d1.alloc(4096)
        await d1.queue.launch(k, buf, vals=(1, 1024))
        back = am.from_dlpack(np.from_dlpack(buf))
        assert back.device is d1
        gate = d1.timeline()
        d1.queue.wait(gate, 1)
        d1.queue.launch(k, buf, vals=(2, 1024))  # held up
        out = await d0.alloc(4096)
        copied = d0.queue.copy(out, back)  # d0's queue: waits for d1's fill
        with anyio.fail_after(10):
            await anyio.sleep(0.05)
            gate.signal(1)
            await copied
            assert (await out.read(np.int32) == 2).all()
    finally:
        await d0.close()
        await d1.close()

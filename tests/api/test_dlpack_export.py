"""How a Buffer's DLPack capsule is made, both ways it runs: the native extension's one
call (``native/py_dlpack.c``, ``dlpack_export``) and the fallback where the extension is
not loaded (``asyncmetal._dlpack.numpy_capsule``: numpy makes a capsule, ctypes edits
its device). Every case runs through both, and the two capsules are compared field by
field; the tensor's deleter runs once whether a consumer took the capsule (and let go,
maybe on another thread) or nobody did; the memory outlives a freed Buffer while a
consumer holds it."""

from __future__ import annotations

import ctypes
import functools
import gc
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _dlpack, _native
from asyncmetal._dlpack import (
    CAPSULE_NAME,
    CAPSULE_NAME_VERSIONED,
    USED_NAME,
    USED_NAME_VERSIONED,
    DLManagedTensorVersioned,
    capsule_set_name,
)
from tests.api.test_dlpack_take import _capsule_name, _extension_take, _tensor

pytestmark = pytest.mark.anyio

Make = Callable[..., object]


def _extension_make() -> Make:
    _extension_take()  # skips where the extension is not in use
    make: Make = _native.extension().dlpack_export  # type: ignore[union-attr]
    return make


MAKERS: dict[str, Callable[[], Make]] = {
    "extension": _extension_make,
    "ctypes": lambda: _dlpack.numpy_capsule,
}


@pytest.fixture(params=list(MAKERS))
def make(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Make:
    """Buffer.__dlpack__ made to make capsules one way or the other."""
    fn = MAKERS[request.param]()
    monkeypatch.setattr(_dlpack._maker, "chosen", fn)
    return fn


def _managed(capsule: object) -> Any:
    """The managed tensor (legacy or versioned) of an unconsumed capsule."""
    return _tensor(capsule)[0]


def _fields(capsule: object) -> dict[str, Any]:
    """What a consumer reads of an unconsumed capsule, its version included (DLPack
    1.1's, whose padded flag a sub-byte export may set: numpy writes 1.0 of its own)."""
    managed = _managed(capsule)
    tensor = managed.dl_tensor
    ndim = tensor.ndim
    fields = {
        "name": _capsule_name(capsule),
        "data": tensor.data or 0,
        "byte_offset": tensor.byte_offset,
        "device": (tensor.device.device_type, tensor.device.device_id),
        "ndim": ndim,
        "dtype": (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes),
        "shape": tensor.shape[:ndim] if ndim else [],
        "strides": tensor.strides[:ndim] if tensor.strides else None,
    }
    if isinstance(managed, DLManagedTensorVersioned):
        fields["version"] = (managed.version.major, managed.version.minor)
        fields["flags"] = managed.flags
    return fields


def _both(export: Callable[[], object], monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The fields of ``export()``'s capsule made each way (each capsule then dropped)."""
    found = []
    for name, maker in MAKERS.items():
        monkeypatch.setattr(_dlpack._maker, "chosen", maker())
        capsule = export()
        found.append({"made by": name, **_fields(capsule)})
        del capsule
    return found


def _address(buf: am.Buffer) -> int:
    """Where a buffer's bytes start: a host address, or (Metal) the MTLBuffer."""
    handle = buf._allocation.handle
    return int(getattr(handle, "address", handle))


async def test_both_ways_make_the_same_tensor(
    device: am.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    _extension_make()
    buf = await device.alloc(256)
    view = buf.view(64, 96)
    metal = device.name == "metal"
    cases: list[tuple[Callable[[], object], dict[str, Any]]] = [
        (buf.__dlpack__, {"name": b"dltensor", "shape": [256], "dtype": (1, 8, 1)}),
        (lambda: buf.__dlpack__(max_version=(1, 0)), {"flags": 0, "version": (1, 1)}),
        (lambda: buf.typed(np.float32, (8, 8)).__dlpack__(), {"strides": [8, 1]}),
        (lambda: buf.typed(np.complex64, (2, 4, 4)).__dlpack__(max_version=(1, 1)), {}),
        (lambda: buf.typed(np.bool_, (16, 16)).__dlpack__(), {"dtype": (6, 8, 1)}),
        (lambda: view.typed(np.int16, (2, 24)).__dlpack__(max_version=(1, 0)), {}),
        (lambda: view.typed(np.float64, (12, 1)).__dlpack__(), {"shape": [12, 1]}),
        (lambda: buf.view(8, 4).typed(np.int32, ()).__dlpack__(), {"ndim": 0, "shape": []}),
    ]
    for export, expected in cases:
        extension, fallback = _both(export, monkeypatch)
        assert {**extension, "made by": ""} == {**fallback, "made by": ""}
        for key, value in expected.items():
            assert extension[key] == value, (key, extension)
    # Each export's address: the buffer's memory; Metal's is the MTLBuffer and an offset.
    extension, fallback = _both(lambda: view.__dlpack__(), monkeypatch)
    base = _address(buf)
    if metal:
        assert (extension["data"], extension["byte_offset"]) == (base, 64)
        assert extension["device"] == (8, 0)
    else:
        assert (extension["data"], extension["byte_offset"]) == (base + 64, 0)
        assert extension["device"] == (1, 0)
    assert extension == {**fallback, "made by": "extension"}


@pytest.mark.parametrize(
    ("name", "code", "bits"),
    [("bfloat16", 4, 16), ("float8_e4m3fn", 10, 8), ("float8_e5m2", 12, 8)],
)
async def test_ml_dtypes_export_as_dlpacks_types_both_ways(
    device: am.Device, monkeypatch: pytest.MonkeyPatch, name: str, code: int, bits: int
) -> None:
    """ml_dtypes' bfloat16 and float8 types (JAX's and PyTorch's) export as DLPack's
    kDLBfloat and kDLFloat8_* (JAX's codes), made either way (numpy makes the
    fallback's of unsigned ints). Checked: refused before ("DLPack exports ints, ...
    not bfloat16"), though DLPack has the types."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="needs ml_dtypes (JAX installs it)")
    _extension_make()
    buf = await device.alloc(64)
    typed = buf.typed(getattr(ml_dtypes, name), (4, -1))
    for versioned in (None, (1, 0)):
        made = functools.partial(typed.__dlpack__, max_version=versioned)
        extension, fallback = _both(made, monkeypatch)
        assert {**extension, "made by": ""} == {**fallback, "made by": ""}
        assert extension["dtype"] == (code, bits, 1)
        assert extension["shape"] == [4, 128 // bits]


@pytest.mark.parametrize(
    ("name", "code", "bits"),
    [
        ("int4", 0, 4),
        ("uint4", 1, 4),
        ("int2", 0, 2),
        ("float4_e2m1fn", 17, 4),
        ("float6_e2m3fn", 15, 6),
        ("float6_e3m2fn", 16, 6),
    ],
)
async def test_sub_byte_ml_dtypes_export_padded_both_ways(
    device: am.Device, monkeypatch: pytest.MonkeyPatch, name: str, code: int, bits: int
) -> None:
    """ml_dtypes' types of fewer than 8 bits, which numpy holds one a byte, export as
    DLPack's codes flagged padded (DLPack 1.1), made either way; a consumer of an older
    version, which would read them packed, is refused. Checked: refused before ("DLPack
    exports ints, ... not int4"); and fails without the fix of the fallback's version
    (numpy's 1.0, which has no padded flag, beside the flag)."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="needs ml_dtypes (JAX installs it)")
    _extension_make()
    buf = await device.alloc(64)
    typed = buf.typed(getattr(ml_dtypes, name), (4, -1))
    extension, fallback = _both(lambda: typed.__dlpack__(max_version=(1, 1)), monkeypatch)
    assert {**extension, "made by": ""} == {**fallback, "made by": ""}
    assert extension["dtype"] == (code, bits, 1)
    assert extension["shape"] == [4, 16]
    assert extension["flags"] == _dlpack.FLAG_SUBBYTE_PADDED
    assert fallback["version"] == (1, 1)  # the version that has the flag, either way
    for older in (None, (1, 0)):
        with pytest.raises(BufferError, match=r"padded flag says: ask with max_version=\(1, 1\)"):
            typed.__dlpack__(max_version=older)


async def test_sub_byte_buffers_come_back_whole(anyio_backend: object) -> None:
    """An int4 buffer's export, taken back by asyncmetal, is the buffer's 64 bytes (the
    padded flag read), and its copy (copy=True) holds the same bytes, flagged copied."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="needs ml_dtypes (JAX installs it)")
    async with am.open_device("cpu") as device:
        buf = await device.alloc(64)
        await buf.write(np.arange(64, dtype=np.int8) % 8)
        back = am.from_dlpack(buf.typed(ml_dtypes.int4, (8, 8)))
        assert back.nbytes == 64
        assert (await back.map(np.int8)).ctypes.data == (await buf.map(np.int8)).ctypes.data
        capsule = buf.typed(ml_dtypes.int4).__dlpack__(max_version=(1, 1), copy=True)
        fields = _fields(capsule)
        assert fields["flags"] == _dlpack.FLAG_SUBBYTE_PADDED | _dlpack.FLAG_IS_COPIED
        assert fields["dtype"] == (0, 4, 1)
        assert ctypes.string_at(fields["data"], 64) == (await buf.read()).tobytes()


@pytest.mark.parametrize("versioned", [None, (1, 0)])
async def test_a_copy_of_ml_dtypes_memory(
    make: Make, anyio_backend: object, versioned: tuple[int, int] | None
) -> None:
    """copy=True of a bfloat16 or float8 view: a copy of its bytes, of DLPack's type
    (versioned: flagged copied). Checked: refused before, as numpy's own export (which
    made the copy's capsule) refuses ml_dtypes' types."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="needs ml_dtypes (JAX installs it)")
    async with am.open_device("cpu") as device:
        buf = await device.alloc(32)
        await buf.write(np.arange(16, dtype=np.float32).astype(ml_dtypes.bfloat16))
        for dtype, code in ((ml_dtypes.bfloat16, 4), (ml_dtypes.float8_e4m3fn, 10)):
            typed = buf.typed(dtype, (2, -1))
            capsule = typed.__dlpack__(max_version=versioned, copy=True)  # holds the copy
            fields = _fields(capsule)
            assert fields["dtype"] == (code, 8 * np.dtype(dtype).itemsize, 1)
            assert fields["shape"] == [2, 32 // 2 // np.dtype(dtype).itemsize]
            assert fields.get("flags", _dlpack.FLAG_IS_COPIED) == _dlpack.FLAG_IS_COPIED
            assert fields["data"] != _address(buf)
            assert ctypes.string_at(fields["data"], 32) == (await buf.read()).tobytes()


async def test_jax_reads_bfloat16_and_float8_buffers(anyio_backend: object) -> None:
    jnp = pytest.importorskip("jax.numpy", reason="needs JAX (the test extra installs it)")
    async with am.open_device("cpu") as device:
        for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
            values = np.arange(16, dtype=np.float32).astype(dtype)
            buf = await device.alloc(values.nbytes)
            await buf.write(values)
            shared = jnp.from_dlpack(buf.typed(dtype, (4, 4)))
            assert shared.dtype == dtype
            assert shared.unsafe_buffer_pointer() == np.from_dlpack(buf).ctypes.data  # shared
            assert np.asarray(shared, np.float32).ravel().tolist() == list(range(16))


async def test_a_read_only_source_exports_flagged_both_ways(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    _extension_make()
    source = await am.from_numpy(np.arange(6, dtype=np.int32))
    extension, fallback = _both(
        lambda: source.typed(np.int32, (2, 3)).__dlpack__(max_version=(1, 0)), monkeypatch
    )
    assert extension["flags"] == fallback["flags"] == _dlpack.FLAG_READ_ONLY
    assert {**extension, "made by": ""} == {**fallback, "made by": ""}
    for name, maker in MAKERS.items():
        monkeypatch.setattr(_dlpack._maker, "chosen", maker())
        shared = np.from_dlpack(source.typed(np.int32, (2, 3)))
        assert shared.tolist() == [[0, 1, 2], [3, 4, 5]], name
        assert not shared.flags.writeable, name
        with pytest.raises(BufferError, match="read-only"):
            source.__dlpack__()  # legacy: no flag to say so


class _Counted:
    """A release that counts its calls, and the thread of each."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def __call__(self) -> None:
        self.threads.append(threading.get_ident())


class _Producer:
    """Hands over ``capsule`` (once) to a consumer such as numpy."""

    def __init__(self, capsule: object) -> None:
        self.capsule: object = capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)

    def __dlpack__(self, **kwargs: object) -> object:
        capsule, self.capsule = self.capsule, None
        return capsule


def _call_deleter_without_the_gil(capsule: object) -> None:
    """Consume ``capsule`` as a foreign consumer does -- renamed used, its deleter called
    through a C function pointer -- on a new thread, the GIL released (ctypes' CFUNCTYPE
    releases it): the deleter has to take it itself."""
    versioned = _capsule_name(capsule) == CAPSULE_NAME_VERSIONED.value
    managed = _managed(capsule)
    capsule_set_name(capsule, USED_NAME_VERSIONED if versioned else USED_NAME)
    address = ctypes.addressof(managed)
    deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(
        ctypes.cast(managed.deleter, ctypes.c_void_p).value
    )
    thread = threading.Thread(target=deleter, args=(address,))
    thread.start()
    thread.join()


@pytest.mark.parametrize("versioned", [True, False])
@pytest.mark.parametrize("consumer", ["numpy", "foreign thread", "none"])
def test_the_tensor_is_deleted_once(make: Make, versioned: bool, consumer: str) -> None:
    """Checked: a deleter left out of the capsule's destructor (or called twice) fails."""
    memory = np.arange(16, dtype=np.float32)
    release = _Counted()
    capsule = make(
        memory.ctypes.data, 0, 1, 0, 2, 32, (4, 4), versioned, False, release
    )  # fmt: skip
    name = CAPSULE_NAME_VERSIONED.value if versioned else CAPSULE_NAME.value
    assert _capsule_name(capsule) == name
    if consumer == "numpy":
        array = np.from_dlpack(_Producer(capsule))
        assert _capsule_name(capsule) == b"used_" + name
        del capsule
        gc.collect()
        assert array.tolist() == memory.reshape(4, 4).tolist()
        assert array.ctypes.data == memory.ctypes.data
        assert release.threads == []  # the consumer still holds it
        dropper = threading.Thread(target=lambda: held.clear())  # let go on another thread
        held = [array]
        del array
        dropper.start()
        dropper.join()
        assert release.threads == [dropper.ident]
    elif consumer == "foreign thread":
        _call_deleter_without_the_gil(capsule)
        assert len(release.threads) == 1 and release.threads[0] != threading.get_ident()
        del capsule  # used: its destructor leaves the tensor alone
    else:
        del capsule  # never consumed: the destructor deletes the tensor
    gc.collect()
    assert len(release.threads) == 1


def test_a_failed_export_calls_no_release(make: Make) -> None:
    """A tensor that cannot be made leaves the loan to the caller: release uncalled."""
    release = _Counted()
    memory = np.zeros(4, np.uint8)
    with pytest.raises((ValueError, TypeError)):
        make(memory.ctypes.data, 0, 1, 0, 1, 8, (-4,), True, False, release)
    gc.collect()
    assert release.threads == []


def test_the_extension_checks_its_arguments() -> None:
    export = _extension_make()
    release = _Counted()
    memory = np.zeros(4, np.uint8)
    args = [memory.ctypes.data, 0, 1, 0, 1, 8, (4,), True, False, release]
    with pytest.raises(TypeError, match="10 arguments"):
        export(*args[:9])
    for at, bad in ((6, [4]), (9, None), (5, 0), (5, 256), (4, -1)):
        with pytest.raises(TypeError, match="shape tuple"):
            export(*args[:at], bad, *args[at + 1 :])
    with pytest.raises(ValueError, match="2\\*\\*63"):
        export(*args[:6], (1 << 62, 4), *args[7:])
    with pytest.raises(OverflowError):
        export(*args[:6], (1 << 64,), *args[7:])
    gc.collect()
    assert release.threads == []


async def test_memory_outlives_a_freed_buffer(make: Make, anyio_backend: object) -> None:
    async with am.open_device("cpu") as dev:
        buf = await dev.alloc(4096)
        await buf.write(np.full(1024, 5, np.int32))
        held = np.from_dlpack(buf.typed(np.int32, (32, 32)))
        await buf.free()
        assert dev.memory_statistics().in_use == 4096  # lent: not released
        other = await dev.alloc(4096)  # not the held memory: it is not reused
        await other.write(np.zeros(1024, np.int32))
        assert held.ravel().tolist() == [5] * 1024
        held[:] = 9  # still the consumer's to write
        assert held.sum() == 9 * 1024
        del held
        gc.collect()
        stats = dev.memory_statistics()
        assert (stats.in_use, stats.cached) == (4096, 4096)  # back with the allocator
        await other.free()


async def test_exports_in_a_loop_leave_no_backlog(make: Make, anyio_backend: object) -> None:
    """Each loan that ends is counted as it ends: a program that exports in a loop and
    never allocates or frees (nothing sweeps) keeps no record per export. Checked:
    without it, every ended loan waited in a queue for the next sweep (10,000 here)."""
    async with am.open_device("cpu") as dev:
        buf = await dev.alloc(64)
        block, size = buf._allocation.block, dev.memory_statistics().in_use  # (rounded)
        for _ in range(1000):
            np.from_dlpack(buf.typed(np.float32, (4, 4)))
            buf.__dlpack__(max_version=(1, 0))  # never consumed
        gc.collect()
        assert block.lent == 0
        assert len(dev._allocator._returned) == 0
        held = np.from_dlpack(buf)
        await buf.free()  # lent: released once the consumer lets go
        assert dev.memory_statistics().in_use == size
        del held
        gc.collect()
        stats = dev.memory_statistics()
        assert (stats.in_use, stats.cached) == (0, size)


async def test_a_copy_reads_the_buffer_even_as_another_thread_frees_it(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``copy=True`` checks the buffer and holds its memory in one step: a ``free()``
    on another thread between the check and the read (forced here: the read's view of
    the memory first runs the free, and an allocation of the same size that writes
    other bytes) hands the block to no other buffer, and the copy holds the freed
    buffer's bytes. The block goes back to the allocator once read. Checked: before,
    the block was checked but not held, went to the new buffer, and the copy held its
    bytes (9s)."""
    async with am.open_device("cpu") as dev:
        buf = await dev.alloc(4096)
        await buf.write(np.full(1024, 5, np.int32))
        block = buf._allocation.block
        backend = dev._backend
        host_view = backend.host_view
        reused: list[am.Buffer] = []

        async def free_and_reuse() -> None:
            await buf.free()
            other = await dev.alloc(4096)
            await other.write(np.full(1024, 9, np.int32))
            reused.append(other)

        def freed_first(*args: Any) -> Any:
            monkeypatch.setattr(backend, "host_view", host_view)  # (once)
            anyio.from_thread.run(free_and_reuse)
            return host_view(*args)

        monkeypatch.setattr(backend, "host_view", freed_first)
        with anyio.fail_after(30):
            copied = await anyio.to_thread.run_sync(
                lambda: np.from_dlpack(buf.typed(np.int32), copy=True)
            )
        (other,) = reused
        assert copied.tolist() == [5] * 1024
        assert other._allocation.block is not block
        assert (await other.read(np.int32)).tolist() == [9] * 1024
        stats = dev.memory_statistics()
        assert (stats.in_use, stats.cached) == (4096, 4096)  # the copied block is back
        await other.free()


async def test_an_export_that_fails_ends_its_loan(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked: without the release on failure, the freed block stayed in use."""

    def fail(*args: object) -> object:
        raise MemoryError

    async with am.open_device("cpu") as dev:
        buf = await dev.alloc(256)
        monkeypatch.setattr(_dlpack._maker, "chosen", fail)
        with pytest.raises(MemoryError):
            buf.__dlpack__()
        await buf.free()
        assert dev.memory_statistics().in_use == 0


async def test_what_numpy_refuses_is_refused_alike(make: Make, anyio_backend: object) -> None:
    """A dtype a consumer would misread: refused with numpy's words whichever way the
    capsule is made (as ExchangeError, a BufferError), before anything is lent."""
    async with am.open_device("cpu") as dev:
        buf = await dev.alloc(64)
        with pytest.raises(am.ExchangeError, match="native byte order"):
            buf.typed(np.dtype(">f4")).__dlpack__()
        if np.dtype(np.longdouble).itemsize > 8:
            with pytest.raises(am.ExchangeError, match="longdouble"):
                buf.typed(np.longdouble).__dlpack__()
        await buf.free()
        assert dev.memory_statistics().in_use == 0


_AT_EXIT = """
import asyncio, ctypes, sys, threading
import numpy as np
import asyncmetal as am
from asyncmetal import _dlpack

HELD = []

async def main():
    dev = await am.open_device("cpu")
    buf = await dev.alloc(1 << 16)
    HELD.append(np.from_dlpack(buf.typed(np.int32)))  # consumed, held past the end
    HELD.append(buf.__dlpack__(max_version=(1, 0)))  # never consumed
    # Capsules a foreign consumer took: their deleters are called, without the GIL,
    # by a thread still running while the interpreter ends.
    deleters = []
    for _ in range(N):
        capsule = buf.__dlpack__(max_version=(1, 0))
        address = _dlpack.capsule_pointer(capsule, _dlpack.CAPSULE_NAME_VERSIONED)
        _dlpack.capsule_set_name(capsule, _dlpack.USED_NAME_VERSIONED)
        managed = _dlpack.DLManagedTensorVersioned.from_address(address)
        deleters.append((ctypes.cast(managed.deleter, ctypes.c_void_p).value, address))
        HELD.append(capsule)
    def consumer():
        for fn, address in deleters:
            ctypes.CFUNCTYPE(None, ctypes.c_void_p)(fn)(address)
    threading.Thread(target=consumer, daemon=True).start()

asyncio.run(main())
print("ended", flush=True)
"""


@pytest.mark.parametrize("path", list(MAKERS))
def test_deleters_at_interpreter_exit(path: str) -> None:
    """Exports held past the interpreter's end, and deleters called from another thread
    while it ends (some during finalization: the thread is still calling them then):
    the process exits cleanly, neither crashing nor hanging. (The deleter leaves an
    export alone once the interpreter is ending on a thread without the GIL; Python
    3.11 would end such a thread inside PyGILState_Ensure instead, which this exit does
    not tell apart; from 3.14 on it blocks there for good.)"""
    if path == "extension":
        _extension_make()
    env_line = "" if path == "extension" else "_dlpack._maker.chosen = _dlpack.numpy_capsule\n"
    source = _AT_EXIT.replace("HELD = []", "HELD = []\nN = 3000\n" + env_line)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == "ended"
    assert "Fatal" not in proc.stderr and "Exception" not in proc.stderr, proc.stderr[-4000:]

"""DLPack's hot paths against the general ones they skip: ``from_dlpack``'s reuse of the
device it found last, its look-up of memory lent out among its own device's and its
kind's (without listing the lenders), a consumer's ``max_version``, ``copy`` and
``dl_device`` taken as they are when plain, a raw stream handle taken as it is. Each
case here gives what the general path gives: the same device, the same record of uses
(seen as ``busy()`` while a command on the other buffer waits), the same capsule or the
same error."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import asyncmetal as am
from asyncmetal.backends.cuda._interop import stream_handle

pytestmark = pytest.mark.anyio


class _Capsule:
    """A capsule already made, handed to ``np.from_dlpack`` as its producer's."""

    def __init__(self, capsule: object) -> None:
        self.capsule = capsule

    def __dlpack__(self, **kwargs: object) -> object:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


def _held(dev: am.Device, buf: am.Buffer) -> am.Timeline:
    """A copy into ``buf`` on ``dev``'s default queue, held behind a wait for the
    returned timeline's value 1: ``buf``'s record has a use pending until it is
    signalled."""
    gate = dev.timeline()
    dev.queue.wait(gate, 1)
    dev.queue.copy(buf, np.zeros(buf.nbytes, np.uint8))
    return gate


async def test_the_device_found_last_is_not_taken_once_another_opened_or_it_closed(
    anyio_backend: object,
) -> None:
    """From host memory: ``cpu:1`` while it alone is open (twice: the second from what
    the first found), ``cpu`` once it opened too, ``cpu:1`` again once ``cpu`` closed."""
    array = np.zeros(16, np.float32)
    async with am.open_device("cpu:1") as other:
        assert am.from_dlpack(array).device is other
        assert am.from_dlpack(array).device is other
        dev = await am.open_device("cpu")
        try:
            assert am.from_dlpack(array).device is dev
            assert am.from_dlpack(array).device is dev
        finally:
            await dev.close()
        assert am.from_dlpack(array).device is other
        assert am.from_dlpack(array, device=other).device is other


@pytest.mark.parametrize(
    "case", ["same", "part", "dropped", "other device", "lent", "lent by its kind"]
)
async def test_an_import_shares_the_record_of_the_memory_however_it_is_found(
    anyio_backend: object, case: str
) -> None:
    """A buffer imported over memory that an earlier one is over (the same range, a part
    of it, the earlier one dropped while its command waits, on another device of the
    kind), or that a buffer lent out (of the device, or of another of its kind, the
    device given), is busy while a command on the earlier one waits, and not once it
    ran: one record of uses, found on whichever path."""
    async with am.open_device("cpu") as dev, am.open_device("cpu:1") as other:
        array = np.zeros(64, np.uint8)
        keep: list[object] = []
        if case in ("lent", "lent by its kind"):
            lender = await (dev if case == "lent" else other).alloc(64)
            array = np.from_dlpack(lender.typed(np.uint8))
            first = lender
        else:
            first = am.from_dlpack(array)
        gate = _held(first.device, first)
        if case == "dropped":
            del first
        where = other if case in ("other device", "lent by its kind") else None
        if case == "part":
            second = am.from_dlpack(array[16:32], device=where)
        else:
            second = am.from_dlpack(array, device=where)
        if case == "lent by its kind":
            assert second.device is other  # (memory coming back: on its lender)
            third = am.from_dlpack(array, device=dev)  # (its kind's lent memory, looked up)
            assert third.busy()
            keep.append(third)
        assert second.busy()
        gate.signal(1)
        await dev.synchronize()
        await other.synchronize()
        assert not second.busy()
        assert all(not b.busy() for b in keep if isinstance(b, am.Buffer))


async def test_an_import_beside_unrelated_lent_memory_has_a_record_of_its_own(
    anyio_backend: object,
) -> None:
    """Memory lent out by buffers of the device and of another of its kind, the arrays
    kept, does not make an unrelated array's import share their records."""
    async with am.open_device("cpu") as dev, am.open_device("cpu:1") as other:
        mine, theirs = await dev.alloc(64), await other.alloc(64)
        lent = [np.from_dlpack(b.typed(np.uint8)) for b in (mine, theirs)]
        gates = [_held(dev, mine), _held(other, theirs)]
        for where in (None, dev, other):
            assert not am.from_dlpack(np.zeros(64, np.uint8), device=where).busy()
        for gate in gates:
            gate.signal(1)
        await dev.synchronize()
        await other.synchronize()
        del lent


@pytest.mark.parametrize(
    "max_version", [(1, 1), [1, 1], (np.int64(1), 1), (1, 0), (2, 0), None, (0, 9)]
)
async def test_max_version_plain_or_not_gives_the_same_capsule(
    anyio_backend: object, max_version: Any
) -> None:
    """A pair of ints, a list, numpy integers: the same capsule, versioned from (1, 0)
    on, over the buffer's memory (the consumer's array sees the buffer's writes)."""
    async with am.open_device("cpu") as dev:
        buf = await dev.alloc(16)
        await buf.write(np.zeros(4, np.int32))
        capsule = buf.typed(np.int32).__dlpack__(max_version=max_version)
        versioned = max_version is not None and tuple(max_version) >= (1, 0)
        assert repr(capsule).startswith(f'<capsule object "dltensor{"_versioned" * versioned}"')
        array = np.from_dlpack(_Capsule(capsule))
        await buf.write(np.full(4, 7, np.int32))
        assert array.tolist() == [7] * 4


@pytest.mark.parametrize(
    ("max_version", "error"),
    [((1, True), am.ArgumentTypeError), ((1,), am.ArgumentTypeError), (1, am.ArgumentTypeError)],
)
async def test_max_version_that_is_no_pair_of_ints_is_refused_as_before(
    anyio_backend: object, max_version: Any, error: type[Exception]
) -> None:
    async with am.open_device("cpu") as dev:
        buf = await dev.alloc(16)
        with pytest.raises(error, match="max_version must be a pair of ints"):
            buf.typed(np.int32).__dlpack__(max_version=max_version)


@pytest.mark.parametrize(
    ("copy", "dl_device", "copied"),
    [
        (None, None, False),
        (False, None, False),
        (np.False_, None, False),
        (None, (1, 0), False),
        (False, (1, 0), False),
        (True, None, True),
        (np.True_, (1, 0), True),
    ],
)
async def test_copy_and_dl_device_plain_or_not_export_as_before(
    anyio_backend: object, copy: Any, dl_device: Any, copied: bool
) -> None:
    """No copy where ``copy`` is None or false (Python's or numpy's) and ``dl_device``
    None or the buffer's own; a copy where ``copy`` is true."""
    async with am.open_device("cpu") as dev:
        buf = await dev.alloc(16)
        await buf.write(np.zeros(4, np.int32))
        typed = buf.typed(np.int32)
        capsule = typed.__dlpack__(max_version=(1, 1), copy=copy, dl_device=dl_device)
        np.from_dlpack(_Capsule(capsule))[:] = 5
        assert (await buf.read(np.int32)).tolist() == [0 if copied else 5] * 4


@pytest.mark.parametrize(
    ("copy", "dl_device", "error", "says"),
    [
        ("yes", None, am.ArgumentTypeError, "copy must be True, False or None"),
        (1, None, am.ArgumentTypeError, "copy must be True, False or None"),
        (None, (2, 0), am.ExchangeError, "exports without copying there"),
        (False, (2, 0), am.ExchangeError, "exports without copying there"),
        (None, "cpu", am.ArgumentTypeError, "dl_device must be a pair of ints"),
    ],
)
async def test_copy_and_dl_device_refusals_are_as_before(
    anyio_backend: object, copy: Any, dl_device: Any, error: type[Exception], says: str
) -> None:
    async with am.open_device("cpu") as dev:
        buf = await dev.alloc(16)
        with pytest.raises(error, match=says):
            buf.typed(np.int32).__dlpack__(max_version=(1, 1), copy=copy, dl_device=dl_device)
        await buf.free()  # (no loan left: it frees)


@pytest.mark.parametrize(
    ("given", "handle"),
    [(0, 1), (1, 1), (3, 3), (0x5000, 0x5000), ((1 << 64) - 1, (1 << 64) - 1)],
)
def test_a_raw_stream_handle_is_taken_as_it_is(given: int, handle: int) -> None:
    """A Python int past the per-thread stream (taken at once) and below it alike."""
    assert stream_handle(given) == handle
    assert stream_handle(np.uint64(given)) == handle  # (the general path's)


@pytest.mark.parametrize("given", [2, -1, 1 << 64, True, np.True_])
def test_a_raw_stream_handle_that_is_no_stream_is_refused_as_before(given: object) -> None:
    error = am.ArgumentTypeError if isinstance(given, bool | np.bool_) else am.InvalidArgumentError
    with pytest.raises(error):
        stream_handle(given)


async def test_a_device_that_opens_as_the_devices_are_listed_is_not_hidden_for_good(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread opens ``cpu`` just after ``_device_for`` listed the open devices
    (only ``cpu:1``): that call picks ``cpu:1`` (what it saw), but the next one must see
    ``cpu``. Checked: before, the look-up was remembered with the count of devices
    opened read after the listing -- ``cpu``'s open already counted -- so every later
    import of host memory went to ``cpu:1`` until yet another device opened."""
    from asyncmetal import _device, _interop

    array = np.zeros(16, np.float32)
    async with am.open_device("cpu:1") as other, am.open_device("cpu") as dev:
        listed = _interop.open_devices

        def listed_before_cpu_opened() -> list[am.Device]:
            monkeypatch.setattr(_interop, "open_devices", listed)
            found = [d for d in listed() if d is not dev]
            _device._opened[0] += 1  # (cpu's open, landing now: what the count says)
            return found

        monkeypatch.setattr(_interop, "open_devices", listed_before_cpu_opened)
        _interop._last_found.clear()
        assert am.from_dlpack(array).device is other
        assert am.from_dlpack(array).device is dev

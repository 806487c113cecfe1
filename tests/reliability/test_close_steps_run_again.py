"""A close's step that a KeyboardInterrupt cut partway is run again (Device._close_native,
the cuda backend's close: ``until_uninterrupted``): what it did before the interrupt is
not done twice, and what it had left is done -- no block freed twice, no module left
loaded, no staging chunk left pinned."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import pytest

import asyncmetal as am
from asyncmetal import _allocator
from asyncmetal.backends.cuda import _staging
from tests.reliability.test_cuda_faults import _Driver, fake_driver
from tests.support.interrupts import interrupted

pytestmark = pytest.mark.anyio


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Driver]:
    yield from fake_driver(monkeypatch)


async def test_an_allocator_close_run_again_frees_no_block_twice(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt at each call's entry and return in the allocator's close, with three
    blocks live: the close run again frees each block natively once. Checked failing
    with the blocks taken off only after the loop: places 15, 16, 18 and 19 freed 1-3
    handles twice."""
    codes = {_allocator.Allocator._close.__code__}
    twice: list[str] = []
    at = 0
    while True:
        dev = await am.open_device("cpu")
        backend: Any = dev._backend
        bufs = [await dev.alloc(256) for _ in range(3)]
        freed: list[int] = []
        real_free = backend.free

        def free(handle: Any, real_free: Any = real_free, freed: list[int] = freed) -> None:
            freed.append(id(handle))
            if freed.count(id(handle)) == 1:  # (a second native free would be a double free)
                real_free(handle)

        monkeypatch.setattr(backend, "free", free)
        gc.collect()
        gc.disable()  # (no finalizer's call among the places counted)
        try:
            with interrupted(codes, at) as raised, contextlib.suppress(KeyboardInterrupt):
                dev._close_native(abandon=True)
        finally:
            gc.enable()
        if not raised:
            break
        again = {h for h in freed if freed.count(h) > 1}
        if again:
            twice.append(f"{at} ({raised[0]}): {len(again)} freed twice")
        del bufs
        at += 1
        assert at < 500
    assert at > 10, "the close's allocator step was never reached"
    assert twice == []


async def test_an_interrupt_between_two_module_unloads_leaves_none_loaded(
    anyio_backend: object, driver: _Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C as the first of two modules' unloads returns: the cuda backend's close,
    run again, unloads the other (each, once). Checked failing with the modules taken
    off all at once before the loop: one cuModuleUnload of two."""
    dev = await am.open_device("cuda:0")
    backend: Any = dev._backend
    backend.load(b"", "k1")
    backend.load(b"", "k2")
    assert len(backend._modules) == 2
    real = driver.cuModuleUnload
    fired: list[int] = []

    def unload(module: int) -> Any:
        r = real(module)
        if not fired:  # (as a Ctrl-C handled as the call returns)
            fired.append(module)
            raise KeyboardInterrupt
        return r

    monkeypatch.setattr(driver, "cuModuleUnload", unload)
    with pytest.raises(KeyboardInterrupt):
        dev._close_native(abandon=True)
    assert driver.calls.count("cuModuleUnload") == 2, driver.calls


async def test_an_interrupt_inside_a_chunks_unmap_leaves_no_chunk_pinned(
    anyio_backend: object, driver: _Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C as a staging chunk's map is taken off its records, before the chunk
    notes it unmapped: the close, run again, frees that chunk and every one after it,
    and raises the interrupt alone. Checked failing before: the chunk's second unmap
    raised KeyError, and every chunk was left mapped and pinned."""
    dev = await am.open_device("cuda:0")
    backend: Any = dev._backend
    chunks = list(backend._chunks)
    assert len(chunks) >= 2, len(chunks)
    fired: list[int] = []

    class Mapped(dict):  # type: ignore[type-arg]
        def pop(self, *args: Any) -> Any:
            popped = dict.pop(self, *args)
            if not fired:  # (as a Ctrl-C handled as the pop returns)
                fired.append(args[0])
                raise KeyboardInterrupt
            return popped

    # (moved, not copied: an entry left in the first would keep its map's view, and so
    # its map, from closing)
    records = _staging._MAPPED
    monkeypatch.setattr(_staging, "_MAPPED", Mapped(records))
    records.clear()
    try:
        with pytest.raises(KeyboardInterrupt) as raised:
            dev._close_native(abandon=True)
    finally:
        records.update(_staging._MAPPED)
    assert raised.value.__context__ is None, repr(raised.value.__context__)
    assert fired
    assert [c for c in chunks if c.address] == []

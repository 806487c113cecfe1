"""Queue.launch's common case in the native extension module (native/py_launch.c).

It must take exactly what Queue.launch's Python checks accept, or less: anything else
returns None before submitting, and the Python path checks and explains it. These tests
check that it takes the common case, declines each uncommon one without submitting, and
that random launches -- valid or not -- end the same with it and without it.
"""

from __future__ import annotations

import enum
import random
import threading
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _native
from asyncmetal._queue import _ONE3
from tests.support.kernels import KERNELS

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("unreaped")]


def _extension() -> Any:
    extension = _native.extension()
    if extension is None:
        pytest.skip(f"the extension module is not built here: {_native.extension_error}")
    return extension


class Small(enum.IntEnum):
    TWO = 2


@pytest.fixture
async def fast(device: am.Device) -> tuple[Any, am.Queue, am.Buffer]:
    """The extension module (or a skip), a new queue and a 64-byte buffer."""
    return _extension(), device.new_queue(), await device.alloc(64)


async def test_it_submits_the_common_case(
    fast: tuple[Any, am.Queue, am.Buffer], kernels: dict[str, am.Program]
) -> None:
    extension, queue, buf = fast
    fill = kernels["fill"]
    target = queue._launch_target
    done = extension.launch(queue, target, fill, (buf,), (3, 16), _ONE3, _ONE3)
    assert isinstance(done, am.Completion) and done.queue is queue
    assert done.value == queue.submitted == 1
    assert buf._allocation.last_use[queue] == 1
    # A view, vals in a list, sizes as an int and a list: still the common case.
    view = buf.view(32)
    done = extension.launch(queue, target, fill, (view,), [-4, 8], 5, [1, 1])
    assert done is not None and done.value == queue.submitted == 2
    await done
    assert done.done() and done.start_time is not None  # its times row was recorded
    assert (await buf.read(np.int32)).tolist() == [3] * 8 + [-4] * 8


async def test_it_declines_every_other_case_without_submitting(
    device: am.Device, fast: tuple[Any, am.Queue, am.Buffer], kernels: dict[str, am.Program]
) -> None:
    extension, queue, buf = fast
    freed = await device.alloc(64)
    await freed.free()
    fill, empty = kernels["fill"], kernels["empty"]

    class SubBuffer(am.Buffer):
        pass

    sub = SubBuffer(device._state, buf._allocation, 0, 64)
    declined: list[tuple[Any, ...]] = [
        (fill, (buf,), (Small.TWO, 16), _ONE3, _ONE3),  # an int subclass
        (fill, (buf,), (True, 16), _ONE3, _ONE3),  # a bool
        (fill, (buf,), (np.int32(2), 16), _ONE3, _ONE3),
        (fill, (buf,), (1 << 31, 16), _ONE3, _ONE3),  # beyond int32
        (fill, (buf,), (-(1 << 31) - 1, 16), _ONE3, _ONE3),
        (fill, (buf,), range(2), _ONE3, _ONE3),  # a sequence, not a tuple or list
        (fill, (buf,), (1,), _ONE3, _ONE3),  # too few vals
        (fill, (), (1, 16), _ONE3, _ONE3),  # too few buffers
        (fill, (freed,), (1, 16), _ONE3, _ONE3),
        (fill, (sub,), (1, 16), _ONE3, _ONE3),
        (fill, ("buf",), (1, 16), _ONE3, _ONE3),
        (fill, (buf,), (1, 16), 0, _ONE3),
        (fill, (buf,), (1, 16), (1, 1, 1, 1), _ONE3),
        (fill, (buf,), (1, 16), (), _ONE3),
        (fill, (buf,), (1, 16), _ONE3, (True,)),
        (fill, (buf,), (1, 16), np.array([1]), _ONE3),
        (fill, (buf,), (1, 16), _ONE3, 1 << 70),
        ("fill", (buf,), (1, 16), _ONE3, _ONE3),
        (empty.native, (), (), _ONE3, _ONE3),
    ]
    for args in declined:
        assert extension.launch(queue, queue._launch_target, *args) is None, args
    assert queue.submitted == 0 and queue not in buf._allocation.last_use


async def test_a_closed_device_is_declined(anyio_backend: object) -> None:
    extension = _extension()
    async with am.open_device("cpu") as device:
        empty = await device.compile("void empty(void) {}", "empty")
        queue = device.new_queue()
    assert extension.launch(queue, queue._launch_target, empty, (), (), _ONE3, _ONE3) is None
    with pytest.raises(am.ClosedResourceError):
        queue.launch(empty)


async def test_a_device_closed_as_it_reads_the_arguments_is_refused(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python code the native path runs after its check that the device is open (here a
    program's ``_device``, made a property) lets another thread close the device in
    between: the command it then numbers is taken back and refused, not submitted to a
    device whose close has counted what to wait for."""
    _extension()
    from asyncmetal._program import Program

    async with am.open_device("cpu") as device:
        fill = await device.compile(KERNELS, "fill")
        buf = await device.alloc(4)
        queue = device.new_queue()
        state = device._state

        def closed_meanwhile(program: Program) -> am.Device:
            state.closed = True  # as a close on another thread would, between two reads
            return device

        monkeypatch.setattr(Program, "_device", property(closed_meanwhile), raising=False)
        with pytest.raises(am.ClosedResourceError):
            queue.launch(fill, buf, vals=(7, 1))
        monkeypatch.undo()
        assert queue.submitted == 0 and buf._allocation.last_use.get(queue) is None
        state.closed = False  # (the close above was make-believe)


def _random_launch(rng: random.Random, buffers: list[am.Buffer]) -> dict[str, Any]:
    """Arguments for fill(int* out, int value, int n): about half valid, the rest with
    something off somewhere (values, their type, counts, sizes, a freed buffer)."""
    valid = rng.random() < 0.5
    good_ints = [0, 1, -1, 7, (1 << 31) - 1, -(1 << 31)]
    bad_ints = [1 << 31, -(1 << 31) - 1, 1 << 70, True, Small.TWO, np.int32(3), 2.0, "2", None]
    good_sizes: list[Any] = [_ONE3, 1, 300, (2,), (1, 4), [3, 1, 2], (1, 1, 1)]
    bad_sizes: list[Any] = [0, -1, (), (1, 0), (1, 1, 1, 1), True, (2, Small.TWO), None]

    def pick(good: list[Any], bad: list[Any]) -> Any:
        return rng.choice(good if valid or rng.random() < 0.7 else bad)

    live = [b for b in buffers if not b.freed]
    n_buffers = 1 if valid or rng.random() < 0.7 else rng.choice([0, 2])
    n_vals = 2 if valid or rng.random() < 0.7 else rng.choice([1, 3])
    bufs = tuple(rng.choice(live if valid else buffers) for _ in range(n_buffers))
    vals: Any = [pick(good_ints, bad_ints) for _ in range(n_vals)]
    if n_vals >= 2 and isinstance(vals[1], int) and not isinstance(vals[1], bool):
        vals[1] = rng.randint(-3, 16)  # the count: never past the 64-byte buffers
    # A range is a valid sequence of ints too: the Python path takes it.
    vals = rng.choice([tuple, tuple, list, lambda v: range(len(v))])(vals)
    kwargs: dict[str, Any] = {"vals": vals}
    if rng.random() < 0.5:
        kwargs["global_size"] = pick(good_sizes, bad_sizes)
    if rng.random() < 0.5:
        kwargs["local_size"] = pick(good_sizes, bad_sizes)
    return {"buffers": bufs, "kwargs": kwargs}


async def test_random_launches_end_alike_with_and_without_it(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """Each random launch on a queue with the fast path and on one without: the same
    exception (type and message), or the same submitted value and the same bytes."""
    _extension()
    fast, slow = device.new_queue(), device.new_queue()
    slow._fast_launch = None
    assert fast._fast_launch is not None
    freed = await device.alloc(64)
    await freed.free()
    pairs = []
    for _ in range(3):
        a, b = await device.alloc(64), await device.alloc(64)
        await a.write(np.zeros(64, np.uint8))
        await b.write(np.zeros(64, np.uint8))
        pairs.append((a, b))
    firsts = [a for a, _ in pairs]
    rng = random.Random(20261129)
    took = failed = 0
    for _ in range(600):
        case = _random_launch(rng, [*firsts, freed])
        outcomes = []
        for queue, side in ((fast, 0), (slow, 1)):  # the same launch on its own buffers
            bufs = tuple(b if b is freed else pairs[firsts.index(b)][side] for b in case["buffers"])
            try:
                done = queue.launch(kernels["fill"], *bufs, **case["kwargs"])
            except Exception as exc:  # compared below
                outcomes.append((type(exc), str(exc), queue.submitted))
            else:
                await done
                outcomes.append(("ok", done.value, queue.submitted))
        assert outcomes[0] == outcomes[1], case
        took += outcomes[0][0] == "ok"
        failed += outcomes[0][0] != "ok"
    for a, b in pairs:
        assert np.array_equal(await a.read(), await b.read())
    assert took > 100 and failed > 100, (took, failed)  # both kinds were exercised


SLOW_FILL = """
void slow_fill(int* out, int value, int n, int iters) {
    volatile int x = 0;
    for (int i = 0; i < iters; i++) x += i;
    for (int j = 0; j < n; j++) out[j] = value;
}
"""


def _on_another_thread(action: Any) -> None:
    """Run ``action`` (an async function) to its end on a loop in another thread, as
    another thread's code would, while the launch on this one is inside the extension."""
    thread = threading.Thread(target=anyio.run, args=(action,))
    thread.start()
    thread.join()


async def test_a_queue_closed_as_it_reads_the_arguments_is_declined(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread closes the queue (or the device lets go of it) while the native
    path runs Python code reading the arguments (here a buffer's ``_device``, made a
    property): the launch is declined and the Python path refuses it. Checked: before,
    the command went to the closed queue's freed native queue and never completed."""
    _extension()
    async with am.open_device("cpu") as device:
        fill = await device.compile(KERNELS, "fill")
        buf = await device.alloc(64)
        queue = device.new_queue()
        await queue.launch(fill, buf, vals=(1, 16))
        closing = [True]

        def device_then_close(self: am.Buffer) -> am.Device:
            if closing and self is buf:
                closing.clear()
                _on_another_thread(queue.close)
            return device

        monkeypatch.setattr(am.Buffer, "_device", property(device_then_close), raising=False)
        with pytest.raises(am.ClosedResourceError, match="closed"):
            queue.launch(fill, buf, vals=(7, 16))
        monkeypatch.undo()
        assert not closing and queue.submitted == 1


async def test_a_buffer_freed_as_its_launch_is_numbered_waits_for_it(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread frees the buffer while the native path makes the launch's
    Completion (Python code): the launch's use is recorded before that, so the free
    waits for the kernel and the next allocation does not get memory it still writes.
    Checked: before, the use was recorded after the Completion, the free released the
    memory at once, and the kernel wrote into the next owner's buffer."""
    _extension()
    from asyncmetal._queue import Completion

    async with am.open_device("cpu") as device:
        slow_fill = await device.compile(SLOW_FILL, "slow_fill")
        buf = await device.alloc(256)
        queue = device.new_queue()
        await queue.launch(slow_fill, buf, vals=(1, 64, 1))
        other: list[am.Buffer] = []
        init = Completion.__init__

        def init_then_free(self: Completion, *args: Any) -> None:
            init(self, *args)
            if not other:

                async def free_and_reuse() -> None:
                    await buf.free()
                    other.append(await device.alloc(256))
                    await other[0].write(np.zeros(64, np.int32))

                _on_another_thread(free_and_reuse)

        monkeypatch.setattr(Completion, "__init__", init_then_free)
        done = queue.launch(slow_fill, buf, vals=(7, 64, 50_000_000))
        monkeypatch.undo()
        assert other, "the free did not run inside the launch"
        await done
        assert (await other[0].read(np.int32) == 0).all(), "the freed buffer's kernel wrote it"

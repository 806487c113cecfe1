"""A cuda buffer's DLPack consumer stream, without a GPU: the fake driver of
tests/reliability/test_cuda_faults.py (its ``driver`` fixture), with the native
``am_cuq_wait_foreign`` recorded instead of run (the native side itself is checked
against a simulated driver: tests/support/native/fake_cuda.c, check ``foreign``).

``buf.__dlpack__(stream=S)`` makes S wait for each queue whose command using the buffer
is unfinished -- one native call per such queue, on the buffer's device's context --
and adopts nothing: no queue, so no completion thread, per consumer stream. The stream
rules are adopt_stream's: None is the legacy stream (1), -1 asks for no ordering, 0 and
the per-thread stream (2) are refused, as is a stream of another context."""

from __future__ import annotations

import ctypes
from typing import Any

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _dlpack
from asyncmetal._buffer import record_uses
from tests.api.test_dlpack_take import _tensor
from tests.reliability import test_cuda_faults
from tests.reliability.test_cuda_faults import CUresult, _confirmed, _Driver, numbered_only

pytestmark = pytest.mark.anyio
driver_fixture = test_cuda_faults.driver  # the fake driver: a fixture, by this name here
CONTEXT = 0x100  # the fake's primary context of cuda:0
CU_WAIT64 = 2  # the runtime's index of cuStreamWaitValue64 (cuda_stream.h)


def _record(driver: _Driver) -> list[tuple[int, int, int, int]]:
    """Record each am_cuq_wait_foreign call: (owner queue, context, stream, target)."""
    waits: list[tuple[int, int, int, int]] = []

    def wait_foreign(owner: int, context: int, stream: int, target: int, call: Any) -> int:
        waits.append((owner, context, stream, target))
        return 0

    assert driver.runtime is not None
    driver.runtime.am_cuq_wait_foreign = wait_foreign  # type: ignore[attr-defined]
    return waits


def _streams_of(driver: _Driver, context: int) -> None:
    """Every stream the fake is asked about belongs to ``context``."""
    driver.cuStreamGetCtx = lambda stream: driver._result("cuStreamGetCtx", context)  # type: ignore[attr-defined]


async def test_a_consumer_stream_waits_for_the_buffers_users_and_is_not_adopted(
    anyio_backend: object, driver_fixture: _Driver
) -> None:
    """Checked: with the stream adopted (as before), each consumer stream made a queue
    (am_cuq_new) and its wait reached native code as that queue's submission."""
    driver = driver_fixture
    waits = _record(driver)
    _streams_of(driver, CONTEXT)
    dev = await am.open_device("cuda:0")
    try:
        assert driver.runtime is not None
        buf = await dev.alloc(256)
        busy, idle = dev.new_queue(), dev.new_queue()
        used = busy._submit(numbered_only)  # submitted, not confirmed
        record_uses([buf], busy, used.value)
        record_uses([buf], idle, _confirmed(idle).value)  # done: nothing to wait for
        owner = busy._native._q  # type: ignore[attr-defined]
        queues = len(driver.runtime.queues)

        for stream in (0x5000, 0x6000, 0x7000, None):
            assert buf.__dlpack__(stream=stream) is not None
        assert waits == [
            (owner, CONTEXT, stream, used.value) for stream in (0x5000, 0x6000, 0x7000, 1)
        ]
        assert len(driver.runtime.queues) == queues  # no queue per consumer stream

        del waits[:]
        buf.__dlpack__(stream=-1)  # no ordering asked for
        buf.__dlpack__(stream=busy.handle)  # the user's own stream: in its order already
        assert waits == []
        for refused, match in ((0, "stream 0 is ambiguous"), (2, "per-thread default stream")):
            with pytest.raises(BufferError, match=match):
                buf.__dlpack__(stream=refused)
        # A bool is neither the legacy stream (1) nor 0 (checked: True was taken as 1).
        for flag in (True, False):
            with pytest.raises(BufferError, match="integer or None"):
                buf.__dlpack__(stream=flag)
            with pytest.raises(am.ArgumentTypeError, match="not a bool"):
                dev.adopt_stream(flag)
        _streams_of(driver, CONTEXT + 1)
        with pytest.raises(BufferError, match="another CUDA context"):
            buf.__dlpack__(stream=0x8000)
        _streams_of(driver, CONTEXT)

        busy.timeline.native.signal(used.value)  # confirmed: nothing left to wait for
        buf.__dlpack__(stream=0x5000)
        assert waits == [] and len(driver.runtime.queues) == queues
    finally:
        await dev.close()


async def test_a_consumer_stream_is_any_integer_and_one_past_64_bits_is_refused(
    anyio_backend: object, driver_fixture: _Driver
) -> None:
    """A consumer stream given as a numpy integer is that stream (it waits for the
    buffer's users); one that is no 64-bit address is the protocol's BufferError (an
    asyncmetal error), raised before anything reaches the driver. Checked: fails without
    the fix (ArgumentTypeError for numpy's integers; 2**64 reached the native call: with
    the real bindings, an OverflowError)."""
    driver = driver_fixture
    waits = _record(driver)
    _streams_of(driver, CONTEXT)
    dev = await am.open_device("cuda:0")
    try:
        buf = await dev.alloc(256)
        busy = dev.new_queue()
        used = busy._submit(numbered_only)  # submitted, not confirmed
        try:
            record_uses([buf], busy, used.value)
            owner = busy._native._q  # type: ignore[attr-defined]
            for stream in (np.int64(0x5000), np.uint32(0x6000)):
                assert buf.__dlpack__(stream=stream) is not None
            assert waits == [(owner, CONTEXT, s, used.value) for s in (0x5000, 0x6000)]
            del waits[:]
            with pytest.raises(am.ExchangeError, match="from 0 to 2\\*\\*64-1"):
                buf.__dlpack__(stream=1 << 64)
            assert waits == []
        finally:
            busy.timeline.native.signal(used.value)  # (the fake confirms nothing)
    finally:
        await dev.close()


async def test_a_refused_consumer_stream_is_not_said_to_be_adopted(
    anyio_backend: object, driver_fixture: _Driver
) -> None:
    """A consumer's stream is waited on, never adopted: refusing the per-thread stream or
    a stream of another context tells the consumer what stream to pass, not to adopt
    one (adopt_stream's errors keep their advice). Checked: fails without the fix (both
    said "adopt a stream of your own" / "adopt it on the device it belongs to")."""
    driver = driver_fixture
    _record(driver)
    _streams_of(driver, CONTEXT + 1)
    dev = await am.open_device("cuda:0")
    try:
        buf = await dev.alloc(256)
        with pytest.raises(BufferError) as per_thread:
            buf.__dlpack__(stream=2)
        with pytest.raises(BufferError) as other:
            buf.__dlpack__(stream=0x8000)
        for refused in (per_thread.value, other.value):
            assert "adopt" not in str(refused), refused
        assert "consume on a stream of your own" in str(per_thread.value)
        assert "on a stream of cuda:0" in str(other.value)
        with pytest.raises(am.InvalidArgumentError, match="adopt a stream of your own"):
            dev.adopt_stream(2)
        with pytest.raises(am.InvalidArgumentError, match="adopt it on the device"):
            dev.adopt_stream(0x8000)
    finally:
        await dev.close()


async def test_a_consumer_streams_wait_refused_by_the_driver_raises_its_error(
    anyio_backend: object, driver_fixture: _Driver
) -> None:
    def refuse(owner: int, context: int, stream: int, target: int, call: Any) -> int:
        ctypes.cast(call, ctypes.POINTER(ctypes.c_int))[0] = CU_WAIT64
        return int(CUresult.CUDA_ERROR_INVALID_VALUE)

    driver = driver_fixture
    assert driver.runtime is not None
    driver.runtime.am_cuq_wait_foreign = refuse  # type: ignore[attr-defined]
    _streams_of(driver, CONTEXT)
    dev = await am.open_device("cuda:0")
    try:
        buf = await dev.alloc(256)
        used = dev.queue._submit(numbered_only)
        record_uses([buf], dev.queue, used.value)
        with pytest.raises(am.AsyncMetalError, match=r"cuStreamWaitValue64.*INVALID_VALUE"):
            buf.__dlpack__(stream=0x5000)
        dev.queue.timeline.native.signal(used.value)  # confirmed: the close drains nothing
    finally:
        await dev.close()


async def test_an_interface_producers_stream_is_waited_for_and_not_adopted(
    anyio_backend: object, driver_fixture: _Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``am.from_dlpack`` of a ``__cuda_array_interface__`` object with a ``stream``: the
    default queue's one command waits for that stream's work (an event recorded there
    and the command's end, in one call: am_cuq_wait_stream_end) and is the buffer's
    last use; no queue is made for the stream.
    Checked: fails with the stream adopted (as before): a queue made per producer
    stream, whose marker nothing confirms here, so the device's close never ends."""
    driver = driver_fixture
    _streams_of(driver, CONTEXT)
    waits: list[tuple[int, int, int, int]] = []

    def wait_stream(
        q: int, context: int, stream: int, value: int, ns: int, flags: int, call: Any
    ) -> int:
        waits.append((q, context, stream, value))
        return 0

    def finish(q: int, value: int, extra: Any, target: int, ns: int, flags: int) -> int:
        return 0  # (a marker's: the import of an array without a stream)

    assert driver.runtime is not None
    driver.runtime.am_cuq_wait_stream_end = wait_stream  # type: ignore[attr-defined]
    driver.runtime.am_cuq_finish = finish  # type: ignore[attr-defined]
    dev = await am.open_device("cuda:0")
    # (the fake has no pointer attributes: every address is cuda:0's)
    monkeypatch.setattr(type(dev._backend), "pointer_index", lambda self, address: 0)
    try:
        memory = await dev.alloc(1024)
        address = int(memory._allocation.handle)
        queues = len(driver.runtime.queues)
        default = dev.queue._native._q  # type: ignore[attr-defined]

        class Producer:
            def __init__(self, stream: int | None) -> None:
                self.__cuda_array_interface__ = {
                    "shape": (256,),
                    "typestr": "<i4",
                    "data": (address, False),
                    "version": 3,
                    "stream": stream,
                }

        bufs = [am.from_dlpack(Producer(s), device=dev) for s in (0x5000, 0x6000, 0x5000)]
        assert [w[2] for w in waits] == [0x5000, 0x6000, 0x5000]
        assert all(w[0] == default and w[1] == CONTEXT for w in waits)
        assert len(driver.runtime.queues) == queues and not dev._adopted
        # (one memory: one record of uses, whose last is the last import's wait)
        record = bufs[0]._allocation.last_use
        assert all(buf._allocation.last_use is record for buf in bufs)
        assert record == {dev.queue: waits[-1][3]}
        with pytest.raises(am.InvalidArgumentError, match="per-thread") as refused:
            am.from_dlpack(Producer(2), device=dev)
        assert "imported array: its producer must name" in str(refused.value)
        del waits[:]
        am.from_dlpack(Producer(None), device=dev)  # no stream: nothing to wait for
        assert waits == []
    finally:  # (the fake confirms nothing: the close would wait for good)
        dev.queue._native._timeline._value.value = dev.queue._submitted  # type: ignore[attr-defined]
        await dev.close()


async def test_an_interface_producer_is_checked_as_a_capsule_is(
    anyio_backend: object, driver_fixture: _Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``am.from_dlpack`` of a ``__cuda_array_interface__`` object refuses what a capsule
    would be refused for, before anything is submitted: memory its ``data`` flags
    read-only (kernels and copies may write a Buffer), a mask (the elements it marks are
    no data), no memory at all, the stream 0 that the interface disallows; and a
    malformed interface raises ExchangeError, not whatever its reading hit.
    Checked: fails without the checks (a read-only or masked array became a Buffer; a
    missing key raised KeyError, a bad typestr TypeError)."""
    driver = driver_fixture
    _streams_of(driver, CONTEXT)
    assert driver.runtime is not None
    driver.runtime.am_cuq_finish = lambda q, value, extra, target, ns, flags: 0  # type: ignore[attr-defined]
    dev = await am.open_device("cuda:0")
    # (the fake has no pointer attributes: every address is cuda:0's)
    monkeypatch.setattr(type(dev._backend), "pointer_index", lambda self, address: 0)
    try:
        memory = await dev.alloc(1024)
        address = int(memory._allocation.handle)
        plain = {"shape": (256,), "typestr": "<i4", "data": (address, False), "version": 3}

        class Producer:
            def __init__(self, **changed: Any) -> None:
                interface = {**plain, **changed}
                self.__cuda_array_interface__ = {
                    k: v for k, v in interface.items() if v is not _GONE
                }

        submitted = dev.queue.submitted
        refused: list[tuple[dict[str, Any], type[Exception], str]] = [
            ({"data": (address, True)}, am.ExchangeError, "read-only"),
            ({"mask": Producer()}, am.ExchangeError, "masked"),
            ({"data": (0, False)}, am.ExchangeError, "malformed: no data"),
            ({"stream": 0}, am.InvalidArgumentError, "stream is 0"),
            ({"data": _GONE}, am.ExchangeError, "malformed: data must be"),
            ({"data": address}, am.ExchangeError, "malformed: data must be"),
            ({"shape": _GONE}, am.ExchangeError, "malformed: shape must be"),
            ({"shape": (-1,)}, am.ExchangeError, "malformed: shape must be"),
            ({"typestr": "zz"}, am.ExchangeError, "malformed: typestr"),
            ({"typestr": "|O"}, am.ExchangeError, "malformed: typestr"),
            ({"strides": (4, 4)}, am.ExchangeError, "malformed: strides"),
            ({"stream": "s"}, am.ExchangeError, "malformed: stream"),
            ({"strides": (8,), "shape": (128,)}, am.InvalidArgumentError, "C-contiguous"),
            ({"shape": (0,)}, am.InvalidArgumentError, "empty"),
        ]
        for changed, error, match in refused:
            with pytest.raises(error, match=match):
                am.from_dlpack(Producer(**changed), device=dev)
        assert dev.queue.submitted == submitted  # nothing submitted for them
        # What passes: a read-only flag of False given as an int, strides of C order.
        buf = am.from_dlpack(
            Producer(data=(address, 0), strides=(64, 4), shape=(4, 16)), device=dev
        )
        assert buf.nbytes == 256
    finally:
        dev.queue.timeline.native.signal(dev.queue.submitted)  # (the fake confirms nothing)
        await dev.close()


_GONE = object()  # an interface's key left out


async def test_an_interface_export_hands_the_default_queue_over_first(
    anyio_backend: object, driver_fixture: _Driver
) -> None:
    """``__cuda_array_interface__`` of a buffer another queue still uses names the
    default queue's stream, made to wait for that queue: the consumer records an event
    there, which covers only what reached the driver, so the default queue hands over
    what it holds up to that wait first (am_cuq_hand_over); a wait that cannot be
    handed over yet (CU_DEFERRED) raises BufferError. Checked: without the hand-over
    the export returned the stream with the wait still held on the host."""
    driver = driver_fixture
    assert driver.runtime is not None
    runtime: Any = driver.runtime
    handed: list[tuple[int, int]] = []
    answer = [0]

    def hand_over(q: int, value: int) -> int:
        handed.append((q, value))
        return answer[0]

    runtime.am_cuq_hand_over = hand_over
    runtime.am_cuq_wait_queue = lambda q, other, target, value: 0
    runtime.am_cuq_finish = lambda q, value, extra, target, ns, flags: 0
    dev = await am.open_device("cuda:0")
    try:
        buf = await dev.alloc(256)
        busy = dev.new_queue()
        used = busy._submit(numbered_only)  # submitted, not confirmed
        record_uses([buf], busy, used.value)
        interface = buf.__cuda_array_interface__
        default = dev.queue._native._q  # type: ignore[attr-defined]
        assert interface["stream"] == dev.queue.handle
        assert handed == [(default, dev.queue.submitted)]
        answer[0] = -4  # CU_DEFERRED
        with pytest.raises(BufferError, match="nothing has signalled yet"):
            buf.__cuda_array_interface__  # noqa: B018 - the property is the call
    finally:
        busy.timeline.native.signal(used.value)  # confirmed: the close drains nothing
        dev.queue.timeline.native.signal(dev.queue.submitted)
        await dev.close()


async def test_an_export_hands_over_the_signal_a_held_wait_waits_for_first(
    anyio_backend: object, driver_fixture: _Driver
) -> None:
    """A queue waits on a timeline whose signal another queue holds on the host (past
    its bound): the wait is held too (CU_DEFERRED), and the native hand-over cannot find
    the signal (a timeline does not record which queue holds it). The export hands the
    signalling queue over up to its signal first, then makes the consumer's stream wait
    (``__dlpack__``), or hands over the default queue, which waits for the waiting one
    (``__cuda_array_interface__``). A signal that cannot be handed over itself raises
    BufferError saying so. Checked: without it, both exports raised BufferError saying
    nothing had signalled the value."""
    driver = driver_fixture
    assert driver.runtime is not None
    runtime: Any = driver.runtime
    _streams_of(driver, CONTEXT)
    calls: list[tuple[str, int, int]] = []
    signal = {"queue": 0, "handed": False, "refused": False}

    def hand_over(q: int, value: int) -> int:
        calls.append(("hand_over", q, value))
        if q == signal["queue"]:
            signal["handed"] = not signal["refused"]
        return 0 if signal["handed"] else -4  # CU_DEFERRED: the wait held for the signal

    def wait_foreign(owner: int, context: int, stream: int, target: int, call: Any) -> int:
        calls.append(("wait_foreign", owner, target))
        return 0 if signal["handed"] else -4

    runtime.am_cuq_hand_over = hand_over
    runtime.am_cuq_wait_foreign = wait_foreign
    runtime.am_cuq_write = lambda q, word, target, value: 0
    runtime.am_cuq_finish = lambda q, value, extra, target, ns, flags: 0
    runtime.am_cuq_wait_timeline = lambda q, timeline, target, value: 0
    runtime.am_cuq_wait_queue = lambda q, other, target, value: 0
    dev = await am.open_device("cuda:0")
    queues: list[am.Queue] = []
    try:
        buf = await dev.alloc(256)
        timeline, signaller, waiter = dev.timeline(), dev.new_queue(), dev.new_queue()
        queues = [dev.queue, signaller, waiter]
        signal["queue"] = signaller._native._q  # type: ignore[attr-defined]
        signalled = signaller.signal(timeline, 3)
        waiter.wait(timeline, 3)
        used = waiter._submit(numbered_only)
        record_uses([buf], waiter, used.value)
        held = waiter._native._q  # type: ignore[attr-defined]

        assert buf.__dlpack__(stream=0x5000) is not None
        assert calls == [
            ("wait_foreign", held, used.value),
            ("hand_over", signal["queue"], signalled.value),
            ("wait_foreign", held, used.value),
        ]

        del calls[:]
        signal["handed"] = False
        interface = buf.__cuda_array_interface__
        default = dev.queue._native._q  # type: ignore[attr-defined]
        assert interface["stream"] == dev.queue.handle
        assert calls == [
            ("hand_over", default, dev.queue.submitted),
            ("hand_over", signal["queue"], signalled.value),
            ("hand_over", default, dev.queue.submitted),
        ]

        signal["handed"], signal["refused"] = False, True
        expected = (
            rf"command {used.value - 1} of a queue of cuda:0 waits, on the host, for a "
            rf"timeline value that command {signalled.value} of a queue of cuda:0 signals, "
            "and that signal cannot be handed to the device before it"
        )
        with pytest.raises(BufferError, match=expected):
            buf.__dlpack__(stream=0x5000)
        with pytest.raises(BufferError, match=expected):
            buf.__cuda_array_interface__  # noqa: B018 - the property is the call
    finally:
        for queue in queues:  # confirmed: the close drains nothing
            queue.timeline.native.signal(queue.submitted)
        await dev.close()


async def test_an_export_held_behind_a_cpu_queues_command_names_it(
    anyio_backend: object, driver_fixture: _Driver
) -> None:
    """A cuda buffer's writer is held on the host behind its queue's wait for a cpu
    queue's command that has not run (``after`` a cpu buffer that command writes): no
    stream can wait for a host queue's command on the device, and an export does not
    block the calling thread (a loop's, as a rule), so both exports refuse, naming that
    command and saying to await it -- through the default queue's wait for the writer's
    queue too (``__cuda_array_interface__``). Once it ran (the held wait released), the
    export goes on. Checked: before, both said "a timeline value nothing has signalled
    yet", naming no command."""
    from tests.support.queues import held_queue

    driver = driver_fixture
    assert driver.runtime is not None
    runtime: Any = driver.runtime
    _streams_of(driver, CONTEXT)
    released = [False]  # whether the native hand-over finds the held wait released
    runtime.am_cuq_hand_over = lambda q, value: 0 if released[0] else -4  # CU_DEFERRED
    runtime.am_cuq_wait_foreign = lambda owner, ctx, stream, target, call: 0 if released[0] else -4
    runtime.am_cuq_wait_timeline = lambda q, timeline, target, value: 0
    runtime.am_cuq_wait_queue = lambda q, other, target, value: 0
    runtime.am_cuq_finish = lambda q, value, extra, target, ns, flags: 0
    dev = await am.open_device("cuda:0")
    cpu = await am.open_device("cpu")
    queues: list[am.Queue] = []
    try:
        host = await cpu.alloc(64)
        held, gate = held_queue(cpu)
        write = held.copy(host, np.full(16, 7, np.int32))
        buf = await dev.alloc(256)
        queue = dev.new_queue()
        queues = [dev.queue, queue]
        queue.after(host)  # its wait for the cpu write, held on the host
        used = queue._submit(numbered_only)
        record_uses([buf], queue, used.value)
        tail = (
            f"is held on the host behind a wait for command {write.value} of a queue of "
            "cpu, which has not run yet: another library's stream cannot wait on the device "
            "for a host queue's command, and an export does not block the calling thread "
            "(await that command, or this one, before exporting)"
        )
        with pytest.raises(BufferError) as caught:
            buf.__dlpack__(stream=0x5000)
        assert str(caught.value) == f"command {used.value} of a queue of cuda:0 {tail}"
        with pytest.raises(BufferError) as caught:
            buf.__cuda_array_interface__  # noqa: B018 - the property is the call
        expected = f"command {dev.queue.submitted} of a queue of cuda:0 {tail}"
        assert str(caught.value) == expected
        gate.signal(1)
        with anyio.fail_after(10):
            await write
        released[0] = True  # (the cpu queue's thread ran it: the kick released the wait)
        assert buf.__dlpack__(stream=0x5000) is not None
    finally:
        for q in queues:  # confirmed: the close drains nothing
            q.timeline.native.signal(q.submitted)
        await cpu.close()
        await dev.close()


async def test_ml_dtypes_views_have_an_interface_only_where_their_type_string_says_which(
    anyio_backend: object, driver_fixture: _Driver
) -> None:
    """A bfloat16 view's ``__cuda_array_interface__`` types it ``<V2`` (its numpy type
    string, which no other type exported has: as PyTorch gives it); ml_dtypes' one-byte
    types would all be ``|V1``, so their views have none -- AttributeError naming
    DLPack, ``hasattr`` False -- and their DLPack capsules carry their types (kDLFloat8_*,
    kDLInt 4 bits flagged padded), on the device. Checked: fails without the fix (each
    one-byte view's interface said ``|V1``)."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="needs ml_dtypes (JAX installs it)")
    dev = await am.open_device("cuda:0")
    try:
        buf = await dev.alloc(256)
        bfloat16 = buf.typed(ml_dtypes.bfloat16, (8, -1))
        interface = bfloat16.__cuda_array_interface__
        assert interface["typestr"] == "<V2" and interface["shape"] == (8, 16)
        assert _dtype_of(bfloat16.__dlpack__(max_version=(1, 1))) == (4, 16, 0)  # kDLBfloat
        for name, code, bits in (
            ("float8_e4m3fn", 10, 8),
            ("float8_e5m2", 12, 8),
            ("float4_e2m1fn", 17, 4),
            ("int4", 0, 4),
        ):
            view = buf.typed(getattr(ml_dtypes, name))
            with pytest.raises(AttributeError, match=f"no type string for {name}.*DLPack"):
                view.__cuda_array_interface__  # noqa: B018 - the property is the call
            assert not hasattr(view, "__cuda_array_interface__")
            padded = _dlpack.FLAG_SUBBYTE_PADDED if bits < 8 else 0
            assert _dtype_of(view.__dlpack__(max_version=(1, 1))) == (code, bits, padded)
    finally:
        await dev.close()


def _dtype_of(capsule: object) -> tuple[int, int, int]:
    """(type code, bits, padded flag) of a versioned capsule of cuda:0's memory."""
    managed, tensor = _tensor(capsule)
    assert (tensor.device.device_type, tensor.device.device_id) == (_dlpack.KDLCUDA, 0)
    padded = managed.flags & _dlpack.FLAG_SUBBYTE_PADDED
    return tensor.dtype.code, tensor.dtype.bits, padded

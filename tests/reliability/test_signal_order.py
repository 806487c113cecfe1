"""Queue signals of a timeline run in the order submitted (a queue waits, on the device,
for another queue's earlier signal of it that has not run yet), and a timeline a queue's
signal of it is pending for is not signalled by the host. So a signal that its queue
reaches only after a device wait for more than the signals before it raise the timeline
to would never run: it is refused as it is submitted, saying why, with nothing
submitted -- where there is still a way, nothing is refused."""

from __future__ import annotations

import itertools
import threading

import anyio
import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import _queue
from tests.support.threads import Contended

LIMIT = 10  # seconds: every wait here ends within a fraction of this, or it hangs


async def _untouched(*queues: am.Queue) -> None:
    """Each queue still runs what is submitted to it next."""
    with anyio.fail_after(LIMIT):
        for queue in queues:
            await queue.marker()


@pytest.mark.anyio
async def test_a_queue_signal_after_its_own_wait_for_it_is_refused(device: am.Device) -> None:
    """``q.wait(tl, 1)`` then ``q.signal(tl, 1)`` (or to more): once the signal is
    submitted the host may not signal ``tl`` and other queues' signals of it wait for
    this one, so the wait -- and the signal behind it -- would wait for good (before:
    accepted, it hung until the device closed)."""
    timeline = device.timeline()
    queue = device.new_queue()
    queue.wait(timeline, 1)
    for value in (1, 2):
        with pytest.raises(am.InvalidArgumentError, match="would never run") as refused:
            queue.signal(timeline, value)
        message = str(refused.value)
        assert "this queue's command 1, a device wait for the timeline to reach 1" in message
        assert "the commands already behind that wait still wait for its value" in message
    assert queue.submitted == 1  # nothing submitted
    timeline.signal(1)  # the host still may: the wait ends, and the queue goes on
    done = queue.signal(timeline, 2)
    with anyio.fail_after(LIMIT):
        await done
        await timeline.wait(2)


@pytest.mark.anyio
async def test_an_implicit_wait_that_closes_a_cycle_is_refused(device: am.Device) -> None:
    """Two queues, two timelines, no wait on the first timeline written anywhere: q1
    waits for t2 then signals t1; q2 signals t1 (after q1's signal of it: an implicit
    wait) then t2. q2's signal of t2 would come after q1's, which comes after q1's wait
    for t2: refused, naming the implicit wait (before: accepted, all of it hung)."""
    t1, t2 = device.timeline(), device.timeline()
    q1, q2 = device.queue, device.new_queue()
    q1.wait(t2, 1)
    first = q1.signal(t1, 1)
    second = q2.signal(t1, 2)  # waits for q1's signal of t1 first
    with pytest.raises(am.InvalidArgumentError, match="would never run") as refused:
        q2.signal(t2, 1)
    message = str(refused.value)
    assert f"satisfies the default queue of {device.name}'s command 1, a device wait" in message
    assert "runs after an earlier one" in message  # the implicit wait is named
    assert q2.submitted == 2  # the implicit wait and the signal of t1: nothing more
    t2.signal(1)  # nothing signals t2 on a queue: the host can
    with anyio.fail_after(LIMIT):
        await first
        await second
        await t1.wait(2)
    await _untouched(q1, q2)


@pytest.mark.anyio
async def test_a_cycle_through_another_queues_signal_is_refused(device: am.Device) -> None:
    """q1 waits for a, signals b; q2 waits for b, then would signal a: refused."""
    a, b = device.timeline(), device.timeline()
    q1, q2 = device.new_queue(), device.new_queue()
    q1.wait(a, 1)
    q1.signal(b, 1)
    q2.wait(b, 1)
    with pytest.raises(am.InvalidArgumentError, match="would never run"):
        q2.signal(a, 1)
    a.signal(1)
    with anyio.fail_after(LIMIT):
        await b.wait(1)
    await _untouched(q1, q2)


@pytest.mark.anyio
async def test_a_signal_after_queues_waiting_on_each_other_is_refused_in_bounded_time(
    device: am.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two queues each wait for the other's later commands (values not submitted yet,
    which the search takes as to come); a signal that comes after one of them is
    refused, its message naming each step once (checked: the message went round that
    cycle for good, the loop held and its memory growing -- here cut short by a count
    of the queues named)."""
    named = itertools.count()
    who = _queue._who

    def counted(queue: am.Queue, this: am.Queue) -> str:
        if next(named) > 10_000:
            raise RecursionError("the refusal's message went round a cycle")
        return who(queue, this)

    monkeypatch.setattr(_queue, "_who", counted)
    timeline = device.timeline()
    q1, q2, q3, q4 = (device.new_queue() for _ in range(4))
    q1.wait(q2.timeline, 8)
    q2.wait(q1.timeline, 2)  # q1 and q2 wait for each other's later commands
    q3.wait(q4.timeline, 7)
    q2.wait(timeline, 6)
    q3.wait(q1.timeline, 3)
    with pytest.raises(am.InvalidArgumentError, match="would never run") as refused:
        q3.signal(timeline, 6)
    other = f"another queue of {device.name}"
    assert (
        f"it satisfies {other}'s command 2, a device wait for the timeline to reach 6; "
        f"{other}'s command 8, after it, is what {other}'s command 1 waits for; "
        f"{other}'s command 3, after it, is what this queue's command 2 waits for; and "
    ) in str(refused.value)
    assert q3.submitted == 2  # nothing submitted


@pytest.mark.anyio
async def test_a_wait_for_more_than_the_signals_before_is_refused_too(device: am.Device) -> None:
    """q1 waits for 2; q2 signals 1; q1's signal of 3 would come after its own wait for
    2, which only a signal after q2's could reach -- and q1's would be that one."""
    timeline = device.timeline()
    q1, q2 = device.new_queue(), device.new_queue()
    q1.wait(timeline, 2)
    q2.signal(timeline, 1)
    with pytest.raises(am.InvalidArgumentError, match="would never run"):
        q1.signal(timeline, 3)
    q2.signal(timeline, 2)  # another queue may: it does not wait
    with anyio.fail_after(LIMIT):
        await timeline.wait(2)
    await _untouched(q1, q2)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("waited", "said"),
    [
        pytest.param(
            1,
            ["which this queue's command 1 waits for"],
            id="satisfies-a-wait-it-comes-after",
        ),
        pytest.param(
            2,
            [
                "signal of it (command 2) is pending",
                "this queue's command 1 waits, on the device, for another timeline",
            ],
            id="after-another-timelines-pending-signal",
        ),
    ],
)
async def test_a_signal_that_a_pending_signal_of_another_timeline_comes_after_is_refused(
    device: am.Device, waited: int, said: list[str]
) -> None:
    """q1 waits for x, then signals t to 1; q3 waits for t, then would signal x.
    Waiting for 1, what q1's signal reaches: q1's wait for x, its signal of t, q3's wait
    for it, then this signal -- a cycle, refused. Waiting for 2 (more than any signal of
    t submitted): with q1's signal of t pending, only a signal of t after it can reach 2
    -- and q1's comes after q3's signal of x, which comes after q3's wait: refused too,
    though this signal is of another timeline than the wait's."""
    x, t = device.timeline(), device.timeline()
    q1, q3 = device.new_queue(), device.new_queue()
    q1.wait(x, 1)
    q1.signal(t, 1)
    q3.wait(t, waited)
    with pytest.raises(am.InvalidArgumentError, match="would never run") as refused:
        q3.signal(x, 1)
    for part in said:
        assert part in str(refused.value)
    x.signal(1)  # the host can: q1 goes on and signals t to 1 (the host raises it on)
    with anyio.fail_after(LIMIT):
        await t.wait(1)
        if waited > 1:
            t.signal(waited)
    await _untouched(q1, q3)


@pytest.mark.anyio
async def test_signals_with_a_way_to_run_are_not_refused(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """Waits submitted before the signals that satisfy them, on other queues, for values
    below the signal, or on timelines the host signals: none refused, all run."""
    fill = kernels["fill"]
    buf = await device.alloc(4 * 4)
    tl, other, host = device.timeline(), device.timeline(), device.timeline()
    q1, q2, q3 = device.queue, device.new_queue(), device.new_queue()
    q2.wait(tl, 1)  # (the README's example: the wait first)
    q2.launch(fill, buf, vals=(5, 4))
    q2.signal(other, 1)
    q1.launch(fill, buf, vals=(3, 4))
    q1.signal(tl, 1)
    q3.wait(other, 1)
    q3.wait(host, 1)  # a wait the host satisfies: the signals after it may run
    q3.signal(tl, 2)  # after q1's signal of 1 (implicit wait), and after its own waits
    q1.wait(tl, 2)
    q1.signal(other, 2)  # after q2's signal of 1, and after q1's wait for q3's signal
    q2.wait(other, 2)
    q2.signal(tl, 3)
    host.signal(1)
    with anyio.fail_after(LIMIT):
        await tl.wait(3)
        await other.wait(2)
        await device.synchronize()
    assert (await buf.read(np.int32)).tolist() == [5] * 4


@pytest.mark.anyio
async def test_a_chain_of_waits_with_a_way_out_is_not_refused(device: am.Device) -> None:
    """Signals checked against a wait for more (q3's, for 5): the chains behind them
    end at waits another queue or the host can still satisfy. None refused; the host
    signals what is left once the queues' signals ran."""
    tl, other = device.timeline(), device.timeline()
    q1, q2, q3 = device.new_queue(), device.new_queue(), device.new_queue()
    q3.wait(tl, 5)
    q1.wait(other, 1)  # nothing submitted signals `other` yet
    q1.signal(tl, 1)
    q2.signal(other, 1)
    q2.wait(tl, 1)
    q2.signal(tl, 2)  # after q1's signal of 1, behind q1's wait for q2's signal of other
    with anyio.fail_after(LIMIT):
        await tl.wait(2)
        tl.signal(5)
        await device.synchronize()


@pytest.mark.anyio
async def test_a_cycle_it_cannot_see_can_be_awaited_cancelled_and_closed(
    device: am.Device, kernels: dict[str, am.Program]
) -> None:
    """Waits on queues' own timelines for commands not submitted yet, then those
    commands: a cycle no submission refuses (a launch is not checked). Awaiting it can
    be cancelled (the device is untouched), and the close ends it, reporting every
    command of it as never run."""
    q1, q2 = device.new_queue(), device.new_queue()
    q1.wait(q2.timeline, 2)
    q2.wait(q1.timeline, 2)
    stuck = [q1.launch(kernels["empty"]), q2.launch(kernels["empty"])]
    with anyio.fail_after(LIMIT):
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(stuck[0].wait)
                await anyio.wait_all_tasks_blocked()
                scope.cancel()
        assert scope.cancelled_caught and not stuck[0].done()
        await device.queue.marker()  # the device's other queues go on
        await device.close()
        for done in stuck:
            with pytest.raises(am.ClosedResourceError, match="never ran"):
                await done


@pytest.mark.anyio
async def test_waits_of_two_devices_queues_recorded_at_once_both_count(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Queues of two devices (each under its own submission lock) submit device waits on
    one timeline at once, for 5 and 10: the highest value waited for is 10 whichever
    records first. Here the wait for 5 read the highest as 0, then was held until the
    wait for 10 had been recorded or waits for it (before: it then wrote 5 over 10, and
    once the host signalled 6 a queue's signal behind its own wait for 10 was accepted
    as one that would run, and waited for good, rather than refused)."""
    from asyncmetal import _timeline

    dev, peer = await am.open_device("cpu:58"), await am.open_device("cpu:59")
    timeline, queue, other = dev.timeline(), dev.new_queue(), peer.new_queue()
    read, go, either = threading.Event(), threading.Event(), threading.Event()
    monkeypatch.setattr(_timeline, "_signals_lock", Contended(_timeline._signals_lock, either))

    class HeldAfterRead(type(timeline)):  # type: ignore[misc]
        @property
        def _waited(self) -> int:
            value: int = self.__dict__["_waited"]
            if threading.current_thread().name == "held":
                read.set()
                go.wait(20)
            return value

        @_waited.setter
        def _waited(self, value: int) -> None:
            self.__dict__["_waited"] = value

    monkeypatch.setattr(timeline, "__class__", HeldAfterRead)
    held = threading.Thread(target=lambda: other.wait(timeline, 5), name="held")
    held.start()
    with anyio.fail_after(LIMIT):
        assert await anyio.to_thread.run_sync(read.wait, LIMIT)

        def wait_for_ten() -> None:
            queue.wait(timeline, 10)
            either.set()  # (recorded without waiting for the held one)

        ten = threading.Thread(target=wait_for_ten)
        ten.start()
        await anyio.to_thread.run_sync(either.wait, LIMIT)
        go.set()
        await anyio.to_thread.run_sync(held.join)
        await anyio.to_thread.run_sync(ten.join)
    monkeypatch.undo()  # (the class, the lock)
    timeline.signal(6)  # the wait for 5 ends; the one for 10 still waits
    with pytest.raises(am.InvalidArgumentError, match="would never run"):
        queue.signal(timeline, 10)
    timeline.signal(10)
    await _untouched(queue, other)
    await dev.close()
    await peer.close()

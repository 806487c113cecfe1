"""A failed queue's signal of a shared timeline, ordered after another queue's lower
signal of it that has not run yet (Queue.signal: the failed queue waits for that one
first): the failed queue's commands raise at once, but the timeline keeps its values in
order -- it gets the lower value when that signal runs, and fails only from the higher
one, then; a value a healthy queue signals is never reported failed. The same where
the failed queue is closed with ``discard=True`` while its signal waits, and where the
lower signal never runs (the device's close ends it all). On each device the ``device``
fixture opens (cpu; Metal, the simulation here); cuda runs the same programs over the
simulated driver (tests/backends/cuda/test_simulated_failed_report.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import pytest

import asyncmetal as am
from tests.support.native import simulated_failed_report

pytestmark = pytest.mark.anyio

LIMIT = 30  # seconds: each program's awaits are bounded well within this


def _check_in_order(seen: dict[str, object]) -> None:
    """``shared`` stays at 0 until the gate, gets 3 once the lower signal ran, and fails
    only from 5."""
    assert seen["shared before gate"] == 0, seen
    assert seen["lower"] == "done", seen
    assert seen["shared 3"] == "done", seen
    assert "will not reach 5" in str(seen["shared 5"]), seen


def _check_held(seen: dict[str, object]) -> None:
    for name in ("doomed", "behind", "after", "later"):
        assert "discard=True" in str(seen[name]), (name, seen)
    _check_in_order(seen)


def _check_discarded_behind_lower(seen: dict[str, object]) -> None:
    """``simulated_failed_report.discarded_behind_lower``'s: the close ends, the dropped
    higher signal raises, and ``shared`` keeps its values in order."""
    assert seen["close"] == "closed", seen
    assert "discard=True" in str(seen["higher"]), seen
    _check_in_order(seen)


async def _lower_discarded(device: am.Device) -> tuple[am.Queue, am.Timeline]:
    """``simulated_failed_report._failing_behind(device, 3, 5)``, its queue ``discarded``
    closed with ``discard=True`` before the gate is raised: the failed queue's wait
    (``doomed``) and its signal of ``shared`` to 5 (``behind``, held behind ``other``'s
    signal of it to 3) raise, naming the discard. Returns ``other`` and ``shared``."""
    _, discarded, other, _, shared, doomed, _, behind = simulated_failed_report._failing_behind(
        device, 3, 5
    )
    await discarded.close(discard=True)
    with anyio.fail_after(LIMIT):
        for done in (doomed, behind):
            with pytest.raises(am.ClosedResourceError, match="discard=True"):
                await done
    return other, shared


async def test_a_failed_signal_held_behind_a_lower_one_fails_the_timeline_only_past_it(
    device: am.Device,
) -> None:
    """Queue B fails behind a failed device wait, its signal of ``shared`` to 5 ordered
    after queue A's signal of it to 3, which waits for a gate: B's commands (the signal
    among them, and one submitted after) raise before the gate is raised; ``shared``
    stays at 0 until then, gets 3 once A's signal ran, and fails only from 5. Checked:
    without the fix the failed signal failed ``shared`` as a whole at once ("shared
    before gate": 2**64 - 1, "shared 3": "will not reach 3") -- on cpu as its thread
    passed it, on Metal as its command buffer's handler ran."""
    with anyio.fail_after(LIMIT):
        _check_held(await simulated_failed_report.held_signal(am, device))


async def test_a_discard_of_a_failed_queue_holding_such_a_signal_fails_the_timeline_only_past_it(
    device: am.Device,
) -> None:
    """The same, B closed with ``discard=True`` before the gate is raised (on cpu and
    Metal its failed signal was passed already; cuda drops the one it holds): the close
    ends at once, and ``shared`` still gets 3 first, failing only from 5. Checked as
    above (the same failure without the fix)."""
    with anyio.fail_after(LIMIT):
        seen = await simulated_failed_report.held_signal_discarded(am, device)
    assert seen["close"] == "closed", seen
    _check_held(seen)


async def test_a_discarded_signal_waiting_for_a_lower_one_fails_the_timeline_only_past_it(
    device: am.Device,
) -> None:
    """A queue that never failed, its signal of ``shared`` to 5 waiting for another
    queue's signal of it to 3 (held behind a gate), closed with ``discard=True`` before
    the gate is raised: the close ends at once and the dropped signal raises, but
    ``shared`` stays at 0 until the gate, gets 3, and fails only from 5. Checked: without
    the fix the dropped signal failed ``shared`` as a whole at once ("shared before
    gate": 2**64 - 1, "shared 3": "will not reach 3") -- on Metal (MetalQueue._drop),
    and on cpu with host_queues.c put back to before the failed signal's order (its
    thread passes the signal behind the discarded wait as a failed queue's)."""
    with anyio.fail_after(LIMIT):
        seen = await simulated_failed_report.discarded_behind_lower(am, device)
    _check_discarded_behind_lower(seen)


async def test_a_failed_signal_held_behind_a_dropped_lower_one_fails_the_timeline_at_once(
    device: am.Device,
) -> None:
    """B's failed signal of ``shared`` to 5 waits for A's signal of it to 3, and A is
    closed with ``discard=True`` before its gate is raised (the lower signal will never
    run): waits for 3 and for 5 of ``shared`` fail at once, neither left waiting for a
    value that can no longer come."""
    other, shared = await _lower_discarded(device)
    with anyio.fail_after(LIMIT):
        await other.close(discard=True)
        for target in (3, 5):
            with pytest.raises(am.ClosedResourceError, match=f"will not reach {target}"):
                await shared.wait(target)


async def test_a_device_closes_past_a_failed_signal_held_behind_one_that_never_runs(
    anyio_backend: object, device_name: str
) -> None:
    """B's failed signal held behind A's lower one, whose gate is never raised: the
    device's close ends (A's signal abandoned), and waits for 3 and for 5 of ``shared``
    fail (ClosedResourceError), neither left waiting."""
    dev = await am.open_device(device_name)
    try:
        _, shared = await _lower_discarded(dev)
        lower_wait, higher_wait = shared.wait(3), shared.wait(5)
    finally:
        with anyio.fail_after(LIMIT):
            await dev.close()
    with anyio.fail_after(LIMIT):
        for wait in (lower_wait, higher_wait):
            with pytest.raises(am.ClosedResourceError):
                await wait


def _check_abandoned(seen: dict[str, object], closed: str, held: bool) -> None:
    """``simulated_failed_report.abandoned_across``'s: the close of the lower signal's
    device ends, and the waits for 3 and 5 of ``shared`` raise, naming the abandoned
    command's device and its close (not still waiting for the device of ``shared``)."""
    assert seen["shared before close"] == 0, seen
    assert seen["close"] == "closed", seen
    assert "was closed while" in str(seen["lower"]), seen
    if held:
        for name in ("doomed", "behind"):
            assert "discard=True" in str(seen[name]), (name, seen)
    for target in (3, 5):
        error = str(seen[f"shared {target}"])
        assert error.startswith("ClosedResourceError"), seen
        assert f"will not reach {target}" in error, seen
        assert f"{closed} was closed while that command waited" in error, seen


async def _on_two_devices(
    program: Callable[..., Awaitable[dict[str, object]]], *args: object
) -> dict[str, object]:
    """``program(am, dev, other, *args)`` on two cpu devices, ``dev`` holding the shared
    timeline and ``other`` the queues its close abandons; both closed after."""
    dev = await am.open_device("cpu")
    try:
        other = await am.open_device("cpu")
        try:
            with anyio.fail_after(LIMIT):
                seen = await program(am, dev, other, *args)
        finally:
            with anyio.fail_after(LIMIT):
                await other.close()
    finally:
        with anyio.fail_after(LIMIT):
            await dev.close()
    return seen


@pytest.mark.parametrize("held", [False, True], ids=["alone", "held"])
async def test_a_close_that_abandons_a_signal_of_another_devices_timeline_fails_its_waits(
    anyio_backend: object, held: bool
) -> None:
    """A queue of cpu device ``other`` signals ``shared``, a timeline of cpu device
    ``dev``, to 3 behind a device wait nothing signals; ``held``: a failed queue of
    ``dev`` holds its signal of ``shared`` to 5 behind that one. ``other``'s close
    abandons the lower signal: host waits for 3 and 5 of ``shared`` raise at once,
    naming that close, while ``dev`` stays open. Checked: without the fix (the close
    failed only its queues' own timelines) both waits were still waiting after
    REPORT_S, until ``dev`` closed."""
    seen = await _on_two_devices(simulated_failed_report.abandoned_across, held)
    _check_abandoned(seen, "cpu", held)


def _check_after_lower(seen: dict[str, object], closed: str) -> None:
    """``simulated_failed_report.abandoned_after_lower``'s: the abandoned higher signal
    fails ``shared`` only past the lower one, which still runs."""
    assert seen["close"] == "closed", seen
    assert "was closed while" in str(seen["higher"]), seen
    assert seen["shared before gate"] == 0, seen
    assert seen["lower"] == "done", seen
    assert seen["shared 2"] == "done", seen
    error = str(seen["shared 3"])
    assert error.startswith("ClosedResourceError"), seen
    assert f"{closed} was closed while that command waited" in error, seen


async def test_a_close_that_abandons_a_signal_of_another_devices_timeline_keeps_its_order(
    anyio_backend: object,
) -> None:
    """The abandoned signal of ``shared`` (to 3) is ordered after a lower one (to 2) by a
    queue of ``shared``'s device, held behind a gate raised only after the close:
    ``shared`` stays at 0 through the close, gets 2 once the gate is raised, and only
    then fails from 3, naming the close. Checked: without the fix the wait for 3 was
    still waiting after REPORT_S; failed at once instead, ``shared`` would not get 2."""
    seen = await _on_two_devices(simulated_failed_report.abandoned_after_lower)
    _check_after_lower(seen, "cpu")

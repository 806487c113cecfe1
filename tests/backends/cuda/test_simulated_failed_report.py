"""A failed cuda queue reports a failed command as soon as its completion thread saw
it end, not once the queue settles: with the real native runtime over the simulated
driver, in a child process (tests/support/native/simulated_failed_report.py), and the
same program on cpu, which the cuda queue must match. Runs everywhere a C compiler is
found."""

from __future__ import annotations

import pytest

import asyncmetal as am
from tests.reliability.test_failed_signal_order import (
    _check_abandoned,
    _check_after_lower,
    _check_discarded_behind_lower,
)
from tests.support.native import harness, simulated_failed_report

LOOPS = ["asyncio", "trio"]


def _check(seen: dict[str, object]) -> None:
    assert "discard=True" in str(seen["doomed"]), seen
    assert "discard=True" in str(seen["late"]), seen
    assert seen["lower"] == "done", seen
    assert "discard=True" in str(seen["behind"]), seen


@pytest.mark.parametrize("loop", LOOPS)
def test_a_failed_cuda_wait_is_reported_before_a_later_signal_runs(loop: str) -> None:
    """A queue's device wait that fails, followed on that queue by a signal ordered
    after another queue's lower signal of the same timeline, that one held behind a
    gate the program raises only after awaiting the failed wait: the await raises (the
    discard named) before the gate is raised, the lower signal then runs, and the later
    signal fails. Another queue's wait for the failed value, made once the await raised,
    fails that queue's later commands too (the value was reached, failed, before the
    queue settled). Checked: without the fix the await waited for the gate (still waiting
    after REPORT_S) -- the queue reported nothing before its stream got past the later
    signal, and settled."""
    harness.skip_without_compiler()
    _check(simulated_failed_report.run("gated", loop))


@pytest.mark.anyio
async def test_a_failed_cpu_wait_is_reported_before_a_later_signal_runs() -> None:
    """The same program on cpu, the behaviour the cuda queue matches."""
    async with am.open_device("cpu") as dev:
        _check(await simulated_failed_report.gated(am, dev))


def _check_held(seen: dict[str, object]) -> None:
    for name in ("doomed", "behind", "after", "later"):
        assert "discard=True" in str(seen[name]), (name, seen)
    assert seen["lower"] == "done", seen
    assert "will not reach 5" in str(seen["shared 5"]), seen


@pytest.mark.parametrize("loop", LOOPS)
def test_a_failed_cuda_queue_reports_what_it_holds_behind_a_lower_signal(loop: str) -> None:
    """A queue failing behind a device wait, its later signal of a shared timeline held on
    the host for another queue's lower signal of it, which waits for a gate the program
    raises only after awaiting the failed queue's commands: the signal, a command after
    it, and one submitted once those were awaited, raise before the gate is raised (as
    on cpu); the timeline still gets the lower value first -- it stays below it until
    the gate, reaches it, and fails only from the higher one. Checked: with the held
    commands failed only once the hold ended, "behind", "after" and "later" were still
    waiting after REPORT_S each. (Their report raises the queue's timeline through them:
    test_simulated_queue_lifecycle's behind_a_failed_wait_stuck checks that a device's
    close still abandons such a queue where the lower signal never runs.)"""
    harness.skip_without_compiler()
    seen = simulated_failed_report.run("held_signal", loop)
    _check_held(seen)
    assert seen["shared before gate"] == 0, seen
    assert seen["shared 3"] == "done", seen


@pytest.mark.parametrize("loop", LOOPS)
def test_a_discard_of_a_failed_cuda_queue_holding_a_signal_keeps_the_timeline_in_order(
    loop: str,
) -> None:
    """The same program, the failed queue then closed with ``discard=True`` before the
    gate is raised, its held signal (and the wait for the lower one before it) dropped:
    the close ends at once, and the timeline still stays below the lower value until the
    gate, gets it, and fails only from the higher one. Checked: with every dropped
    signal failing its timeline at once (cuq_drop_refused), "shared before gate" was
    2**64 - 1 and "shared 3" failed ("will not reach 3: ... discarded")."""
    harness.skip_without_compiler()
    seen = simulated_failed_report.run("held_signal_discarded", loop)
    assert seen["close"] == "closed", seen
    _check_held(seen)
    assert seen["shared before gate"] == 0, seen
    assert seen["shared 3"] == "done", seen


@pytest.mark.parametrize("loop", LOOPS)
def test_a_discarded_cuda_signal_waiting_for_a_lower_one_keeps_the_timeline_in_order(
    loop: str,
) -> None:
    """A cuda queue that never failed, its signal held on the host for another queue's
    lower signal (behind a gate), closed with ``discard=True`` before the gate is raised:
    the close ends, the dropped signal raises, and the timeline stays at 0 until the
    gate, gets the lower value, and fails only from the higher one (as on cpu and Metal:
    tests/reliability/test_failed_signal_order.py). Checked: with every dropped signal
    failing its timeline at once (cuq_drop_refused), "shared before gate" was 2**64 - 1
    and "shared 3" failed ("will not reach 3: ... discarded")."""
    harness.skip_without_compiler()
    _check_discarded_behind_lower(simulated_failed_report.run("discarded_behind_lower", loop))


@pytest.mark.parametrize("loop", LOOPS)
def test_a_close_on_another_thread_waits_for_a_failed_queue_asked_how_far_it_got(
    loop: str,
) -> None:
    """A failed cuda queue holding a signal behind a lower one is asked how far its
    commands got (a device's close counts every device's queues so) while another thread
    closes it: the close waits for the question (the native queue it frees is not asked
    after), and the question is answered. Checked: without the fix the close freed the
    queue while the question was in the native call ("closed while asked": True)."""
    harness.skip_without_compiler()
    seen = simulated_failed_report.run("reached_while_closing", loop)
    assert "discard=True" in str(seen["doomed"]), seen
    assert seen["closed while asked"] is False, seen
    assert seen["asked"] not in ("[]", "[None]"), seen


@pytest.mark.parametrize("loop", LOOPS)
def test_an_interrupted_question_of_how_far_a_failed_queue_got_leaves_no_lock_held(
    loop: str,
) -> None:
    """A KeyboardInterrupt at each place in a failed queue's ``reached`` (asked on a
    loop's thread by a reaper's look and a close's count) leaves its lock free, and the
    device's close then ends. Checked: with the lock taken through the condition's
    Python ``__enter__``, an interrupt as that returned left it held ("reached return
    __enter__", True), and the close hung."""
    harness.skip_without_compiler()
    seen = simulated_failed_report.run("reached_interrupted", loop)
    assert "discard=True" in str(seen["behind"]), seen
    places = seen["places"]
    assert isinstance(places, list) and places, seen
    assert all(not held for _, held in places), seen
    assert seen["close"] == "closed", seen


@pytest.mark.anyio
async def test_a_failed_cpu_queue_reports_what_it_holds_behind_a_lower_signal() -> None:
    """The same program on cpu, whose failed queue's commands fail at once; its failed
    signal, as cuda's, fails the shared timeline only from the higher value, once the
    lower signal ran (tests/reliability/test_failed_signal_order.py)."""
    async with am.open_device("cpu") as dev:
        seen = await simulated_failed_report.held_signal(am, dev)
    _check_held(seen)
    assert seen["shared before gate"] == 0, seen
    assert seen["shared 3"] == "done", seen


@pytest.mark.parametrize("loop", LOOPS)
def test_a_wait_the_driver_refused_is_not_kept_once_its_queue_fails_behind_it(loop: str) -> None:
    """A device wait whose call the driver refused (a fault), nothing of it handed over,
    after it was recorded with the queue it waits for -- which then failed and settled,
    failing the waiting queue from that wait's command on before the refusal was looked
    at: the wait raises (the fault), and the device closes. Checked: kept as a command
    that failed part way (the failure reported for it before the waiting queue settles
    taken for one of the driver's), the wait was submitted with nothing of it to
    confirm, and the device's close waited for good ("close": "hung") -- the hang of
    simulated_cuda's copy_sweep, there when the other queue's thread settled first."""
    harness.skip_without_compiler()
    seen = simulated_failed_report.run("refused_wait", loop)
    assert seen["refused call"] == "K", seen  # cuStreamWaitEvent (fake_cuda_driver.c)
    assert seen["first settled"] is True, seen
    assert str(seen["wait"]).startswith("DeviceLostError: cuStreamWaitEvent"), seen
    assert seen["close"] == "closed", seen


@pytest.mark.parametrize("loop", LOOPS)
def test_a_wait_the_driver_refused_fails_no_later_command(loop: str) -> None:
    """A device wait whose call the driver refused (not a fault: the device still
    works), nothing of it handed over: the wait raises, and its command number goes to
    the queue's next command. The queue it waited for failing at or below the value
    waited for, and settling, only after that, fails neither that next command nor a
    later one. Checked: with the refused wait's records kept (with the queue waited for,
    and with the waiting queue), both markers failed ("ran after a device-side wait for
    a value that a command of another queue never produced", at value 1: the refused
    wait's number, then the marker's)."""
    harness.skip_without_compiler()
    seen = simulated_failed_report.run("refused_wait_number", loop)
    assert seen["refused call"] == "K", seen  # cuStreamWaitEvent (fake_cuda_driver.c)
    assert str(seen["wait"]).startswith("AsyncMetalError: cuStreamWaitEvent"), seen
    assert "never produced" in str(seen["doomed"]), seen
    assert seen["first settled"] is True, seen
    assert seen["before"] == "done", seen
    assert seen["after"] == "done", seen


@pytest.mark.parametrize("loop", LOOPS)
def test_a_wait_refused_while_its_queue_fails_fails_no_later_command(loop: str) -> None:
    """A device wait whose call the driver refused (not a fault) only after the queue
    it waited for failed at or below the value waited for and settled, that failure
    reaching its record with that queue while the call was in the driver: the wait
    raises the driver's error, and neither the command that takes its number nor a later
    one fails. Checked: with the failure passing that record on (its copy, or its
    settling's take, made in the call; its poison reaching the waiting queue once the
    call returned), both markers failed ("ran after a device-side wait for a value that
    a command of another queue never produced", at value 1: the refused wait's number)."""
    harness.skip_without_compiler()
    seen = simulated_failed_report.run("refused_wait_failing", loop)
    assert seen["first settled"] is True, seen
    assert str(seen["wait"]).startswith("AsyncMetalError: cuStreamWaitEvent"), seen
    assert "never produced" in str(seen["doomed"]), seen
    assert seen["before"] == "done", seen
    assert seen["after"] == "done", seen


@pytest.mark.parametrize("loop", LOOPS)
def test_a_wait_made_while_its_queue_fails_fails_its_queue_from_it(loop: str) -> None:
    """The same, the driver taking the wait: the failure that reached its record while
    the call was in the driver fails the waiting queue from the wait on, as one that
    came once the call returned does."""
    harness.skip_without_compiler()
    seen = simulated_failed_report.run("made_wait_failing", loop)
    assert seen["first settled"] is True, seen
    assert seen["wait"] == "submitted", seen
    for name in ("doomed", "waited", "before", "after"):
        assert "never produced" in str(seen[name]), (name, seen)


def _check_reported(seen: dict[str, object]) -> None:
    for name in ("doomed", "behind"):
        assert "discard=True" in str(seen[name]), (name, seen)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_device_closes_past_a_failed_queue_whose_held_signal_went_behind_one_never_run(
    loop: str,
) -> None:
    """A failed cuda queue reported its signal held behind another queue's lower signal
    (its timeline raised through it); the gate is raised, and the lower signal handed
    over behind a device wait that never ends, so the hold ends, and the held signal's
    wait for the lower one goes to the stream, which never gets past it. The queue still
    says its stream got only as far as before the held signal, and the device's close
    abandons what can never run and ends (the lower signal fails). Checked: with the
    queue's answer counting from the hold alone, "reached after gate" was None and the
    device's close waited for good ("close": "hung" after HUNG_S)."""
    harness.skip_without_compiler()
    seen = simulated_failed_report.run("lower_handed_never_runs", loop)
    _check_reported(seen)
    assert "discard=True" in str(seen["after"]), seen
    assert seen["close"] == "closed", seen
    assert seen["reached before gate"] == 1, seen
    assert seen["held after gate"] == 0, seen
    assert seen["reached after gate"] == 1, seen
    assert "ClosedResourceError" in str(seen["lower"]), seen


@pytest.mark.parametrize("loop", LOOPS)
def test_a_failed_queue_closed_while_its_signal_waits_for_one_never_run_stays_cancellable(
    loop: str,
) -> None:
    """A failed cuda queue reported its signal held behind another queue's lower signal
    that never runs (that queue waits for a timeline nothing signals); the queue's close
    (no discard) waits for its stream, which never gets there -- cancellably: cancelled
    after QUEUE_CLOSE_S; a queue made then (which releases closed queues whose commands
    ran) does not release it as finished, and the device's close abandons it and ends.
    Checked: with the queue's close counting from its (raised) timeline, it took the
    queue for finished and waited in the native close for good ("queue close": "hung"
    after HUNG_S); with that fixed but _queue.settled counting so, the device's close
    waited for good ("close": "hung")."""
    harness.skip_without_compiler()
    seen = simulated_failed_report.run("queue_closed_while_held", loop)
    _check_reported(seen)
    assert seen["queue close"] == "TimeoutError: still closing: cancelled", seen
    assert seen["close"] == "closed", seen


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("scenario", ["abandoned_across", "abandoned_across_held"])
def test_a_cuda_close_that_abandons_a_signal_of_another_devices_timeline_fails_its_waits(
    loop: str, scenario: str
) -> None:
    """Two simulated GPUs: a queue of cuda:1 signals a timeline of cuda:0 behind a wait
    nothing signals (``_held``: a failed queue of cuda:0 holds a higher signal of it
    behind that one), and cuda:1 closes, abandoning the signal: host waits for both
    values raise at once, naming cuda:1's close. Checked: without the fix both waits
    were still waiting after REPORT_S (until cuda:0 closed)."""
    harness.skip_without_compiler()
    seen = simulated_failed_report.run(scenario, loop)
    _check_abandoned(seen, "cuda:1", scenario.endswith("_held"))


@pytest.mark.parametrize("loop", LOOPS)
def test_a_cuda_close_that_abandons_a_signal_of_another_devices_timeline_keeps_its_order(
    loop: str,
) -> None:
    """The abandoned signal of a timeline of cuda:0 is ordered after a lower one by a
    queue of cuda:0, held behind a gate raised after cuda:1's close: the timeline gets
    the lower value, then fails from the higher, naming cuda:1's close. Checked: without
    the fix the wait for the higher value was still waiting after REPORT_S."""
    harness.skip_without_compiler()
    _check_after_lower(simulated_failed_report.run("abandoned_across_after_lower", loop), "cuda:1")

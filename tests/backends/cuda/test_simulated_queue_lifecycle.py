"""A cuda queue's own lifecycle -- closed by several threads at once, collected
unclosed -- with the real native runtime over the simulated driver, in a child process
(tests/support/native/simulated_lifecycle.py). Runs everywhere a C compiler is found."""

from __future__ import annotations

import pytest

from tests.support.native import harness, simulated_lifecycle

LOOPS = ["asyncio", "trio"]


@pytest.fixture(autouse=True)
def _compiler() -> None:
    harness.skip_without_compiler()


@pytest.mark.parametrize("loop", LOOPS)
def test_every_close_of_a_cuda_queue_returns_once_it_is_released(loop: str) -> None:
    """A native cuda queue whose stream waits on the device for a value only the host
    signals, closed plainly on one thread and, once that close is inside the runtime's,
    plainly on a second and abandoning on a third: none returns before the value is
    signalled and the queue released (NativeQueue.close: finish what was submitted,
    then release it; an abandoning close meanwhile waits for that one, as documented),
    and all do after; the marker behind the wait completes. Checked: without the fix
    the second and third returned at once, the first still in the runtime's close."""
    seen = simulated_lifecycle.run("closes", loop)
    assert seen["before"] == [], seen
    assert seen["after"] == ["abandoning", "first", "second"], seen
    assert seen["marker"] == "done", seen


@pytest.mark.parametrize("loop", LOOPS)
def test_a_cuda_queue_collected_unclosed_releases_its_thread_and_stream(loop: str) -> None:
    """Four new_queues that fail once their native queue was made (nothing handed out,
    nothing else holds it) and four CUDAQueues made and dropped: collected, their
    completion threads and streams stop and their events are destroyed (the process's
    thread count comes back); a CUDAQueue collected in a forked child, its parent's, is
    left alone there (no native call for it); the device goes on. Checked: without the
    finalizer those threads stayed for good (15 more than before: a completion thread
    and a simulated stream's each); without its check of the process, the forked child
    closed the parent's queue and destroyed its stream."""
    seen = simulated_lifecycle.run("dropped", loop)
    assert seen["threads_left"] <= 0, seen
    assert seen["events_left"] == 0, seen
    assert seen["forked"] == "exited 0", seen
    assert seen["after"] == "done", seen


@pytest.mark.parametrize("loop", LOOPS)
def test_a_cuda_queue_goes_on_past_a_failed_wait_through_its_later_waits(loop: str) -> None:
    """A queue's device wait for a command of a queue then closed with discard=True, and
    behind it a wait for a value nothing may produce (of a timeline never signalled, of
    one only the host signals, of another queue's own timeline): both fail at once,
    naming the discard, as a cpu queue's do (nothing runs behind a failed wait, so
    nothing waits either), and the device closes. Checked: without the fix neither
    ended, and the device's close (which cannot be cancelled) hung -- the queue, failed,
    settles only once its stream is past all it was given, and the later wait was held
    for its value. A signal behind the failed wait that follows another queue's pending
    signal of a lower value still waits for that one: the timeline gets the lower value,
    and fails only from the higher."""
    seen = simulated_lifecycle.run("behind_a_failed_wait", loop)
    for form in simulated_lifecycle.BEHIND:
        for name in ("doomed", "behind"):
            assert "discard=True" in seen.get(f"{form} {name}", "(still waiting)"), (form, seen)
        assert seen[f"{form} close_s"] < 5, (form, seen)
    assert (seen["ordering lower"], seen["ordering 1"]) == ("done", "done"), seen
    assert "discard=True" in seen["ordering 2"], seen


@pytest.mark.parametrize("loop", LOOPS)
def test_a_device_closes_past_a_failed_queue_whose_signal_waits_for_one_that_never_runs(
    loop: str,
) -> None:
    """The ordering form above, but the other queue's lower signal never runs (it waits
    for a timeline nobody signals). The failed queue's signal stays ordered after that
    one -- its wait held on the host -- and the failed queue settles, reporting its
    failed wait, only once past it; the device's close counted the failed wait as one
    that completes (its value reached, failed) and waited for it to be reported. Before:
    the close (which cannot be cancelled) hung. Now it ends, and every command fails."""
    seen = simulated_lifecycle.run("behind_a_failed_wait_stuck", loop, timeout=60)
    assert seen["close_s"] < 5, seen
    for name in ("doomed", "behind", "lower"):
        assert seen[name] != "done" and "still" not in seen[name], (name, seen)

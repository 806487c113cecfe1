"""A cuda queue's three launch paths (tests/support/launch_paths.py) with the real native
runtime and extension module, over a simulated driver (tests/support/fakes/
fake_cuda_driver.c), in a child process (tests/support/native/simulated_cuda.py: the
runtime's driver table is process-wide). Runs everywhere a C compiler is found.

* A launch whose kernel reached the driver and whose end (its event record) the driver
  refused stays submitted, failed, on every path: the launch returns its Completion, whose
  await raises the driver's error naming its value; its buffer's use is recorded; the
  queue refuses what comes after, and the value is never numbered again.
* A launch whose end the driver refused, and then the fence behind it too (for lack of
  memory: tried again), settles its queue (its await raises) only once the stream is
  past its kernel, on every path.
* A signal whose end the driver refused, and then the fence behind it too (so), fails
  its timeline only once the stream is past its word write (the kernel before it ran).
* A signal whose end the driver refused, and every fence behind it, with an error no
  later try cures (a destroyed context) fails its timeline and its completion at once,
  naming that error, on every path.
* A queue whose completion thread the driver refuses to make its context current
  fails, on every path: its timeline settles, a launch raises naming cuCtxSetCurrent,
  and its close ends.
* A native call that cannot make the caller's context current again (the driver refuses
  to, for another library's context) warns once, naming that context, on every path.
* A launch beyond the device's limits on a block or a grid, or beyond its kernel's most
  threads per block, raises InvalidArgumentError at the call, naming the limit and the
  kernel, on every path -- also when the queue holds commands on the host, where the
  driver's refusal would have come later, failing the queue -- with nothing numbered,
  held or handed to the driver; the queue goes on, and launches at the limits run.
* A launch on a buffer over another library's memory, made as a collection lets go of
  the blocks of such buffers that no command used, holds its block again on every path:
  the array, kept in a cycle with its buffer and dropped, is not collected until the
  launch ran.
* A timeline its owner let go of while the runtime still holds it (a queue's command
  that signals it, confirmed through another queue's wait before its own thread saw it)
  keeps its device word: no timeline made meanwhile is given that slot, which a timeline
  made once the runtime let go of it is.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest

from tests.support.launch_paths import PATHS
from tests.support.native import harness
from tests.support.native.simulated_cuda import AT_LIMITS, OVERSIZED, run_child

LOOPS = ["asyncio", "trio"]


@functools.cache
def _seen(scenario: str, loop: str) -> dict[str, dict[str, Any]]:
    return run_child(scenario, loop)


def _through(scenario: str, loop: str, path: str) -> dict[str, Any]:
    """What ``scenario`` saw through launch path ``path`` (one child process runs every
    path of a scenario and loop)."""
    missing = harness.sanitizer_missing("")
    if missing is not None:
        pytest.skip(missing)
    seen = _seen(scenario, loop)[path]
    if "skipped" in seen:
        pytest.skip(seen["skipped"])
    return seen


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("path", PATHS)
def test_a_launch_whose_end_is_refused_stays_submitted_and_fails_its_queue(
    path: str, loop: str
) -> None:
    """Command 2's kernel was launched, its event record refused. Checked: fails without
    the fix on the "queue" path (the extension's Queue.launch raised at submission, took
    the value back, recorded no use, and the next launch was numbered 2 again)."""
    seen = _through("refused_end", loop, path)
    assert "raised" not in seen, seen
    assert seen["value"] == 2 and seen["numbered"] == 2
    assert seen["last_use"] == 2  # a free waits for it
    assert re.fullmatch(
        r"AsyncMetalError: the command at value 2 on a stream of cuda:0 failed: "
        r"CUDA_ERROR_INVALID_VALUE.*",
        seen["awaited"],
    ), seen
    assert seen["later"].startswith("AsyncMetalError: cuEventRecord"), seen
    assert (
        "for the command at value 2 on a stream of cuda:0: the queue fails from that command on"
        in seen["later"]
    )
    assert seen["numbered_after"] == 2  # the refused one's value taken back, 2 never again


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("path", PATHS)
def test_a_context_a_native_call_cannot_restore_is_warned_of_once(path: str, loop: str) -> None:
    """Context 0xC0FFEE (another library's) was current; the native launch (and a marker,
    and a wait for another library's stream) made the device's current and the driver
    refused to make 0xC0FFEE current again: one RuntimeWarning names it and the context
    left current. Checked: fails without the fix (nothing was said)."""
    seen = _through("unrestored", loop, path)
    for call in ("launch", "marker", "wait_stream"):
        assert len(seen[call]) == 1, (call, seen)
        assert seen[call][0] == (
            "RuntimeWarning: the calling thread's CUDA context (0xc0ffee) could not be made "
            "current again: cuCtxSetCurrent failed with CUDA_ERROR_INVALID_VALUE. The "
            "thread's current context is now 0x100: CUDA calls of other libraries on this "
            "thread may go to another device than they expect"
        ), (call, seen)
        assert seen[f"{call}_current"] == 0x100  # (what the warning is about)
        assert seen[f"{call}_awaited"] == "done"


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("path", PATHS)
def test_a_wait_for_a_stream_of_another_context_is_refused_with_nothing_numbered(
    path: str, loop: str
) -> None:
    """A stream the driver says is of another context than cuda:0's (the queue's own
    wait for it, and an imported array that names it) is refused before anything is
    numbered or submitted -- the native call asks the driver (cuStreamGetCtx) -- and
    cuda:0's streams are waited for as before. Checked: fails without the native check
    (the waits were submitted: an event of cuda:0's context recorded on another
    context's stream)."""
    seen = _through("other_context_stream", loop, path)
    refusal = (
        "InvalidArgumentError: the stream belongs to another CUDA context than cuda:0's "
        "primary context (another GPU, or a context of its own): an array imported on "
        "cuda:0 comes with a stream of cuda:0"
    )
    assert seen["wait"] == refusal and seen["import"] == refusal, seen
    assert seen["numbered"] == 0, seen
    assert seen["value"] == 1, seen  # (the refused wait's value never taken)
    assert seen["awaited"] == seen["after"] == seen["imported_awaited"] == "done", seen


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("path", PATHS)
def test_a_refused_launch_whose_fence_is_refused_too_settles_after_its_kernel(
    path: str, loop: str
) -> None:
    """Command 2's kernel (200 ms) was launched; its event record was refused, and so
    was the record of the fence the queue puts behind it, three times, for lack of
    memory. Checked: fails without the fix (with nothing else in flight the queue
    settled at once, the await raising while the kernel still ran: a buffer it writes
    could be handed back)."""
    seen = _through("unfenced", loop, path)
    assert seen["value"] == 2, seen
    assert re.fullmatch(
        r"AsyncMetalError: the command at value 2 on a stream of cuda:0 failed: "
        r"CUDA_ERROR_INVALID_VALUE.*",
        seen["awaited"],
    ), seen
    assert seen["ran_when_settled"] == 1, seen  # the stream was past the kernel
    assert seen["refusals_left"] == 0, seen  # (every refusal was met: the fence tried again)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("path", PATHS)
def test_a_queue_whose_thread_cannot_make_its_context_current_fails_and_closes(
    path: str, loop: str
) -> None:
    """The driver refused cuda:0's context to the queue's completion thread. Checked:
    fails without the fix (the refusal was ignored: the queue never failed, and its
    commands were confirmed as if the context were current)."""
    seen = _through("no_context", loop, path)
    assert seen["settled"], seen
    assert seen["launch"] == (
        "AsyncMetalError: cuCtxSetCurrent on cuda:0 failed: CUDA_ERROR_INVALID_VALUE, for "
        "the command at value 1 on a stream of cuda:0: the queue fails from that command on"
    ), seen


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("path", PATHS)
def test_a_refused_signal_whose_fence_is_refused_too_fails_its_timeline_after_its_write(
    path: str, loop: str
) -> None:
    """Command 3 signals a timeline behind command 2's kernel (200 ms); its event record
    was refused, and the fence behind it twice, for lack of memory. Checked: fails
    without the fix (the timeline failed at once, its wait raising while the kernel
    still ran and the word write behind it could still land)."""
    seen = _through("unfenced_signal", loop, path)
    assert seen["value"] == 3, seen
    assert seen["waited"] == (
        "AsyncMetalError: this timeline will not reach 1: a value that command 3 of a queue "
        "of cuda:0 never produced: the command at value 3 on a stream of cuda:0 failed: "
        "CUDA_ERROR_INVALID_VALUE"
    ), seen
    assert seen["ran_when_failed"] == 1, seen  # the kernel ran: the write behind it landed
    assert seen["refusals_left"] == 0, seen


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("path", PATHS)
def test_a_launch_beyond_the_limits_raises_at_the_call_idle_or_deep(path: str, loop: str) -> None:
    """Each of OVERSIZED on an idle queue, then on one holding commands on the host.
    Checked: fails without the fix (idle, the driver's refusal came out as
    "cuLaunchKernel on cuda:0 failed: CUDA_ERROR_INVALID_VALUE", naming neither limit nor
    kernel; deep, the launch was held and returned its Completion, the driver refused it
    when it was handed over, and the queue failed from it on: every launch after it
    raised that refusal)."""
    seen = _through("launch_limits", loop, path)
    assert seen["held_before"] > 0, seen  # the queue was deep: commands held on the host
    for when in ("idle", "deep"):
        for (_, _, _, message), got in zip(OVERSIZED, seen[when], strict=True):
            assert got == {
                "raised": f"InvalidArgumentError: {message}",
                "numbered": 0,
                "held": 0,
                "refused_by_driver": 0,
            }, (when, got)
    assert seen["before"] == ["done"] * 40, seen
    assert seen["after"] == ["done"] * len(AT_LIMITS), seen
    assert seen["refused_by_driver"] == 0


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("path", PATHS)
def test_a_signal_whose_fence_is_refused_for_good_fails_its_timeline(path: str, loop: str) -> None:
    """Command 3 signals a timeline behind command 2's kernel (200 ms); the driver
    refused its event record and every fence behind it with
    CUDA_ERROR_CONTEXT_IS_DESTROYED, which no later try cures. Checked: fails without
    the fix (the fence was tried again for good: neither the signal's completion nor
    the wait on its timeline ever ended)."""
    seen = _through("fence_gone", loop, path)
    assert seen["value"] == 3, seen
    failed = "the command at value 3 on a stream of cuda:0 failed: CUDA_ERROR_CONTEXT_IS_DESTROYED"
    assert seen["awaited"] == f"AsyncMetalError: {failed}", seen
    assert seen["waited"] == (
        "AsyncMetalError: this timeline will not reach 1: a value that command 3 of a queue "
        f"of cuda:0 never produced: {failed}"
    ), seen


@pytest.mark.parametrize("loop", LOOPS)
def test_a_device_wait_past_a_closed_queues_last_command_is_refused_not_hung(loop: str) -> None:
    """A wait on a closed queue's timeline for more than its last command that reached
    the backend after the queue was released (its check in Queue.wait raced the close)
    is refused, as on the cpu device, its value taken back: the launch behind it runs,
    rather than the stream waiting for good on a word nothing writes (holding the
    device's close too). Checked: fails without the fix (the wait was submitted, the
    launch behind it still waited after 5 s, and the child timed out)."""
    seen = _through("late_wait_on_closed", loop, "queue")
    assert seen["wait"] == (
        "ClosedResourceError: timeline will not reach 2: it is a queue's own timeline, "
        "and that queue was closed after its command 1"
    ), seen
    assert seen["numbered"] == 0, seen
    assert seen["behind"] == "done", seen
    assert seen["host"].startswith("ClosedResourceError"), seen


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("path", PATHS)
def test_a_discarding_close_of_a_queue_held_in_a_device_wait_returns(path: str, loop: str) -> None:
    """A queue whose stream waits, on the device, for a value only the host signals (the
    wait is handed to the driver at once), with 40 launches behind it: its
    ``close(discard=True)`` returns at once, and so does a second one. The launches the
    driver was given (its bound: 32 commands, the wait among them) stay with it, and run
    once the value is signalled; the rest were dropped, each raising that it was
    discarded. Checked: fails without the fix (the close waited for the launches the
    driver has, for good)."""
    seen = _through("gated_discard", loop, path)
    assert seen["returned"] and seen["again"], seen
    assert seen["done_at_close"] == 0, seen
    assert seen["behind"] == {
        "done": 31,
        "ClosedResourceError: command N was discarded: its queue was closed with "
        "discard=True before the command started, and it never ran": 9,
    }, seen


@pytest.mark.parametrize("loop", LOOPS)
def test_closes_of_a_device_whose_queues_are_held_in_device_waits_return(loop: str) -> None:
    """A device with two queues whose streams wait, on the device, for values only the
    host signals, launches behind them: its ``close()`` and its ``close(discard=True)``
    return, every launch raising that the device's close abandoned or discarded it; and
    with one such queue closed with ``discard=True`` and the other left open, the
    interpreter's exit closes the device and the child exits (bounded: a timeout). The
    simulated driver's cuStreamDestroy returns at once, as the driver's does. Checked:
    fails without the fix (the discarding close of the queue waited for good)."""
    missing = harness.sanitizer_missing("")
    if missing is not None:
        pytest.skip(missing)
    seen = run_child("gated_closes", loop, timeout=120)["closes"]
    assert seen["close"] == {
        "returned": True,
        "behind": [
            "ClosedResourceError: the device cuda:N was closed while command N of a queue "
            "(this command's) waited on the device for a timeline value not produced yet "
            "(nothing left to run would produce it; a signal held behind another "
            "wait, or the host's, may bring it later): commands of that queue from there "
            "on never ran"
        ],
    }, seen
    assert seen["discard"] == {
        "returned": True,
        "behind": [
            "ClosedResourceError: command N was discarded: its device, cuda:N, was closed "
            "with discard=True before the command started, and it never ran"
        ],
    }, seen
    assert seen["exit"] == {"returned": True}, seen


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("path", PATHS)
def test_a_launch_recorded_as_a_collection_lets_go_of_blocks_keeps_the_owner(
    path: str, loop: str
) -> None:
    """Another library's array that keeps the buffer made of it (a cycle), reached
    through a weak reference once a collection's callback let go of the idle buffers'
    blocks, a launch on its buffer held on the device, the array dropped again: the
    collection leaves the array (its finalizer does not run) until the launch ran, on
    every path. Checked: fails without the fix on the "queue" path (the extension's
    Queue.launch recorded the use in C and held nothing again: the array was collected
    under the held launch)."""
    seen = _through("collected_launch", loop, path)
    assert seen["let_go"] and seen["launched"] == 1, seen
    assert not seen["released_under_launch"], seen
    assert seen["awaited"] == "done" and seen["released_after"], seen


@pytest.mark.parametrize("loop", LOOPS)
def test_a_timeline_slot_is_reused_only_once_the_runtime_lets_go_of_its_timeline(
    loop: str,
) -> None:
    """Queue a signals a timeline, and the driver holds the signal's end unfinished for
    a's completion thread while queue b, which waited for it, confirms it: a's timeline
    passes the signal, a lets go of the timeline, and it is collected while a's ring
    entry still holds it (a's thread has yet to raise it). Timelines made then are not
    given its device word's slot; once a's thread is past it, a new timeline is, and
    nothing is left retired. Such a timeline still retired (no slot taken since a's
    thread let go) when the device closes is freed by the close. Checked: fails without the change
    (the first timeline made took the slot while the runtime still held the old one)."""
    missing = harness.sanitizer_missing("")
    if missing is not None:
        pytest.skip(missing)
    seen = run_child("retired_slot", loop, timeout=120)["slots"]
    assert seen["refs_after_owner"] == 2, seen  # its owner's and a's ring entry's
    assert not seen["slot_taken_while_held"], seen
    assert seen["slot_taken_after"] and seen["retired_after"] == 0, seen
    # Retired until a slot is taken, or the close, which frees it.
    assert seen["retired_before_close"] == 1 and seen["retired_at_close"] == 0, seen


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("path", PATHS)
def test_a_wait_for_a_stream_of_a_green_context_is_refused_as_the_python_check_did(
    path: str, loop: str
) -> None:
    """A stream of a green context of cuda:0: CUDA 12.5's cuStreamGetCtx (the version the
    native wait is given from 12.5 on) gives cuda:0's primary context in its second
    pointer and the green context in its third; the bindings' older one, which the Python
    check asks (adopt_stream, and the wait before 87b1f8b), the green context's own
    CUcontext. The Python check refuses the stream; so must the native wait (an event of
    the primary context recorded on a green context's stream: cuEventRecord asks for one
    context), nothing numbered."""
    seen = _through("green_context_stream", loop, path)
    assert seen["adopt"] == "InvalidArgumentError", seen
    assert seen["wait"] == seen["import"] == "InvalidArgumentError", seen
    assert seen["numbered"] == 0, seen


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("path", PATHS)
def test_a_wait_whose_stream_context_the_driver_refuses_raises_with_nothing_numbered(
    path: str, loop: str
) -> None:
    """The native wait's cuStreamGetCtx fails (an invalid handle): the driver's error,
    naming cuStreamGetCtx, with nothing numbered, no event made, the caller's context
    left current; the queue goes on."""
    seen = _through("stream_context_refused", loop, path)
    assert seen["wait"].startswith("AsyncMetalError: cuStreamGetCtx"), seen
    assert "400" in seen["wait"], seen  # (CUDA_ERROR_INVALID_HANDLE, as the fake names it)
    assert seen["numbered"] == 0 and seen["events_made"] == 0, seen
    assert seen["current"] == 0xC0FFEE, seen
    assert seen["after"] == seen["again"] == "done", seen


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("path", PATHS)
def test_a_failed_queues_own_timeline_settles(path: str, loop: str) -> None:
    """A queue whose device wait ended on a value never produced settles its own timeline
    at 2**64 - 1 once nothing is left in flight (cuq_settle): a host wait on it for more
    than it was given, parked before the failure or made after, ends with the failure,
    and a later launch fails -- what tests/contracts/test_contract2_timelines.py asks of
    every device (test_a_failed_queues_own_timeline_settles_so_no_wait_on_it_is_left_
    waiting), here on the simulated driver."""
    seen = _through("failed_own_timeline", loop, path)
    beyond = "ClosedResourceError: this timeline will not reach {}: its queue's last command"
    assert seen["parked"].startswith(beyond.format(1000)), seen
    assert "settled without it running" in seen["parked"], seen
    assert seen["value"] == 2**64 - 1, seen
    assert seen["after"].startswith("ClosedResourceError: this timeline will not reach "), seen
    assert "settled without it running" in seen["after"], seen
    assert seen["later"].startswith("ClosedResourceError: this command did not run"), seen


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("path", PATHS)
def test_a_device_wait_on_a_settled_failure_fails_what_follows(path: str, loop: str) -> None:
    """A device wait submitted once a failed queue settled (its timeline at 2**64 - 1),
    for the value of its failed copy, or for a timeline value its failed signal was to
    produce, fails the waiting queue's later launch, as a host queue's wait does; one for
    the value of its launch that ran before the failure passes.
    (Checked failing before: the wait was not made once the timeline was past its
    target, and both launches behind it ran: "done".)"""
    seen = _through("wait_on_settled_failure", loop, path)
    assert seen["settled"], seen
    never = "ClosedResourceError: this command did not run: it follows a device-side wait"
    assert seen["own"].startswith(never), seen
    assert seen["signal"].startswith(never), seen
    assert seen["ran"] == "done", seen
    # Once the failed queue was closed too. (Checked failing before: "done".)
    assert seen["closed"].startswith(never), seen
    assert seen["closed ran"] == "done", seen

"""The cuda backend's copies with the real native runtime and extension module, over a
simulated driver whose streams run them (tests/support/fakes/fake_cuda_driver.c: device
memory is host memory, a copy a memcpy on its stream, in order with its other
operations), on two simulated GPUs, in a child process (tests/support/native/
simulated_copies.py: the runtime's driver table is process-wide; its staging chunks are
1 MiB). Runs everywhere a C compiler is found.

In every scenario the driver also checks that no copy's source changed while the device
read it (a staging chunk refilled under a copy), that no memory was freed or
unregistered while a copy used it, and that no copy went into pageable memory (which
blocks the calling thread).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.support.native import harness
from tests.support.native.simulated_cuda import run_child

LOOPS = ["asyncio", "trio"]
# The driver calls of the sweep's copies: the copies themselves, each command's event,
# the staging's word writes (a chunk free again) and the stream's waits (a chunk filled).
COPY_CALLS = {"htod", "dtoh", "copy", "copy_peer", "record", "write", "wait"}


@functools.cache
def _seen(scenario: str, loop: str, args: tuple[str, ...] = ()) -> Any:
    missing = harness.sanitizer_missing("")
    if missing is not None:
        pytest.skip(missing)
    return run_child(scenario, loop, timeout=240, args=args)


@pytest.mark.parametrize("loop", LOOPS)
def test_copies_of_every_size_and_many_at_once_keep_every_byte(loop: str) -> None:
    """Writes, reads, copies on one device (to an offset) and to the other device, of
    1 byte to 2.5 chunks (around the direct copy's limit and one chunk), each checked
    in the device memory and read back; then six tasks doing so at once on one queue,
    2.5 chunks and more each time, whose staging ring wraps many times over."""
    seen = _seen("copies", loop)
    assert seen["sizes"] == [], seen["sizes"]
    assert seen["concurrent"] == [], seen["concurrent"]
    assert seen["ring"] == 16, seen  # every chunk of the ring in use ...
    assert seen["uses"] > 4 * seen["ring"], seen  # ... each many times
    assert seen["broken"] == [], seen["broken"]


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("direction", ["to_device", "to_host"])
def test_a_staged_copy_cancelled_in_flight_runs_to_its_end_on_chunks_of_its_own(
    loop: str, direction: str
) -> None:
    """A copy through 20 chunks (more than the ring holds) whose device copies take 2 ms
    each, its awaiting task cancelled while the driver holds its third device copy; its
    buffer freed and one of its size allocated; another copy as large submitted to the
    same queue (its ring), and the copies let go on. The cancelled copy goes on and
    lands whole (its host array dropped by the caller, kept by the copy); no chunk is
    refilled while the device still copies from it (the driver checks each copy's
    source through its run); the freed memory is not handed out while the copy uses
    it; the second copy lands whole."""
    seen = _seen("cancelled_copy", loop)
    assert seen["broken"] == [], seen["broken"]
    one = seen[direction]
    assert "finished_before_cancelled" not in one, one
    assert one["copying_when_cancelled"], one
    assert one["handed_out_busy"] is False, one
    assert one["first"] is True and one["second"] is True, one


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("direction", ["to_device", "to_host"])
def test_a_staged_copy_whose_chunk_cannot_be_pinned_raises_with_nothing_copied(
    loop: str, direction: str
) -> None:
    """A staged copy of three chunks on a queue with no chunk yet, the device's pool
    empty: the driver pins its first chunk and refuses to pin the second. The copy
    raises the driver's error, and none of it reached the device -- no device copy of
    it is in flight as it raises, and the buffer and the host array keep their bytes:
    a copy that raises as not made must not write its destination afterwards (whose
    memory its caller may free and reuse at once). Checked: fails without the fix (the
    first chunk was submitted before the second was pinned, and landed)."""
    seen = _seen("pin_refused", loop)
    assert seen["broken"] == [], seen["broken"]
    one = seen[direction]
    assert "cuMemHostRegister" in one["raised"] and "OUT_OF_MEMORY" in one["raised"], one
    assert one["busy"] is False and one["untouched"] is True, one


# (loop, first N, step, held): odd N on asyncio and even N on trio; behind held
# copies, every third N on each.
SWEEPS = [("asyncio", 1, 2, 0), ("trio", 2, 2, 0), ("asyncio", 1, 3, 1), ("trio", 2, 3, 1)]


@pytest.mark.parametrize("loop", LOOPS)
def test_a_read_cancelled_in_flight_writes_only_its_own_array(loop: str) -> None:
    """``Buffer.read`` of 20 chunks cancelled while the driver holds its third device
    copy: the array it made is dropped by the read; the copy, going on, keeps it, and
    arrays made meanwhile keep their bytes."""
    seen = _seen("cancelled_copy", loop)
    assert seen["broken"] == [], seen["broken"]
    assert seen["read_dropped_intact"] is True, seen


@pytest.mark.parametrize(("loop", "first", "step", "held"), SWEEPS)
def test_every_failing_driver_call_of_copies_ends_in_a_clear_error(
    loop: str, first: int, step: int, held: int
) -> None:
    """On cuda:0 a direct write, a staged write (three chunks), a copy on the device, a
    staged read of that, a small read, and on cuda:1 a copy from cuda:0: run clean,
    then with the Nth driver call failing, not sticky and sticky -- the submitting
    thread's calls counted, or, ``held``, behind 40 copies of 1 ms (past the queue's
    bound on commands in flight: the workload's are held on the host), the completion
    thread's handing them over as well. Every await ends done or with an
    AsyncMetalError (a refusal with DeviceLostError once sticky); a copy done holds its
    source's bytes, and the bytes written where all it follows is done; none is done
    after a copy it follows failed, unless that failure had settled when it was
    submitted (it then does not wait, and copies what is there); the buffer the device
    copy wrote, freed at once, is not handed out while a copy uses it; no thread nor
    event is left; after an error that is not sticky, both devices work again."""
    seen = _seen("copy_sweep", loop, (str(first), str(step), str(held)))
    assert set(seen["clean"].values()) == {"done"}, seen["clean"]
    # Every kind of a copy's driver calls was counted, so failed in turn (how many
    # there are depends on timing; a device wait on another queue's command may be a
    # wait on its event or on its word, or none once it is confirmed).
    assert set(seen["kinds"]) >= COPY_CALLS, seen
    assert seen["outcomes"]["failed"] > 0 and seen["outcomes"]["done"] > 0, seen
    assert not seen["found"], "\n".join(seen["found"])


@pytest.mark.parametrize("loop", LOOPS)
def test_memory_left_to_a_closing_device_is_freed_only_once_its_abandoned_copy_ran(
    loop: str,
) -> None:
    """A copy on cuda:0 from cuda:1's buffer, held behind a device wait only the host
    would release; cuda:1 closed (its memory left to cuda:0's queue), then cuda:0
    closed, abandoning the copy: cuda:0's close releases the words its streams wait on,
    so its stream still reads that memory after its queues stopped, until its backend
    closed. The memory is not freed before (another device's free does not wait for
    cuda:0's streams), and is freed after."""
    seen = _seen("left_to_a_closing_device", loop)
    assert seen["freed_at_its_close"] is False, seen
    assert seen["freed_busy"] is False, seen
    assert seen["freed"] is True, seen

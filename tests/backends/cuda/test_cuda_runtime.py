"""The cuda queues of the native runtime against a simulated driver
(tests/support/native/fake_cuda.c).

Runs everywhere: the completion thread, waits between queues held until what they wait
for reached the driver (submitted from two threads, and on streams sharing one hardware
queue), fault stickiness, event recycling, fills of each pattern size, a wait's confirmation
of the value it waited for and a discard among the threads that hand a queue's work over
(its interleavings run at the runtime's test hooks, and in a stress) are the runtime's own
logic, which the GPU tests (tests/backends/cuda/test_cuda.py) can only exercise on an
NVIDIA machine.
Also under ThreadSanitizer and AddressSanitizer (each skips, saying why, where the
machine cannot run it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.native import harness


@pytest.mark.parametrize("sanitizer", harness.SANITIZERS, ids=["plain", "tsan", "asan"])
def test_cuda_queue_runtime_against_a_simulated_driver(tmp_path: Path, sanitizer: str) -> None:
    binary = harness.build(
        "fake_cuda.c",
        tmp_path,
        sanitizer,
        extra=("fakes/fake_cuda_driver.c",),
        # its simulated driver makes allocations fail on demand, and runs a check's
        # interleavings at the runtime's hooks
        defines=("AM_TEST_ALLOC", "AM_TEST_HOOKS"),
    )
    proc = harness.run(binary, sanitizer=sanitizer)
    assert proc.returncode == 0, proc.stderr[-6000:] + proc.stdout
    assert proc.stdout.split() == [
        *("ok", "order"),
        *("ok", "cross"),
        *("ok", "long"),
        *("ok", "fill"),
        *("ok", "events"),
        *("ok", "fault"),
        *("ok", "faultheld"),
        *("ok", "faulthanding"),
        *("ok", "causal"),
        *("ok", "bound"),
        *("ok", "refused"),
        *("ok", "discard"),
        *("ok", "partial"),
        *("ok", "refusedpart"),
        *("ok", "release"),
        *("ok", "hostwait"),
        *("ok", "hostheld"),
        *("ok", "hostfailed"),
        *("ok", "skipsignal"),
        *("ok", "twosignals"),
        *("ok", "poisonsignal"),
        *("ok", "poisonflight"),
        *("ok", "poisonlater"),
        *("ok", "failedqueue"),
        *("ok", "poisonheld"),
        *("ok", "poisondeferred"),
        *("ok", "refusedpromise"),
        *("ok", "promisedlater"),
        *("ok", "waitrace"),
        *("ok", "waitraceclose"),
        *("ok", "waitrace2"),
        *("ok", "abandonrace"),
        *("ok", "waittaken"),
        *("ok", "poisonoom"),
        *("ok", "chainclose"),
        *("ok", "signal"),
        *("ok", "signalrecord"),
        *("ok", "nomemory"),
        *("ok", "unfencedsignal"),
        *("ok", "stickyfence"),
        *("ok", "nocontext"),
        *("ok", "refencekept"),
        *("ok", "wallclock"),
        *("ok", "refenceabandon"),
        *("ok", "nocontextkept"),
        *("ok", "nocontextlowered"),
        *("ok", "fencegone"),
        *("ok", "predict"),
        *("ok", "near"),
        *("ok", "kick"),
        *("ok", "hostnap"),
        *("ok", "selfseen"),
        *("ok", "handkick"),
        *("ok", "abandon"),
        *("ok", "context"),
        *("ok", "foreign"),
        *("ok", "unlocked"),
        *("ok", "waitstream"),
        *("ok", "orphaned"),
        *("ok", "waitedfreed"),
        *("ok", "signalfreed"),
        *("ok", "confirmfreed"),
        *("ok", "heldfreed"),
        *("ok", "waitqueuefreed"),
        *("ok", "kickfreed"),
        *("ok", "poisonclosed"),
        *("ok", "orphanpoke"),
        *("ok", "orphankick"),
        *("ok", "stalekick"),
        *("ok", "unfencedfreed"),
        *("ok", "refsheld"),
        *("ok", "forked"),
        *("ok", "abandonwait"),
        *("ok", "closedwait"),
        *("ok", "uafwaiter"),
        *("ok", "confirmedfirst"),
        *("ok", "kickmiss"),
        *("ok", "idleabandon"),
        *("ok", "shared"),
        *("ok", "handover"),
        *("ok", "handsignal"),
        *("ok", "closing"),
        *("ok", "stress"),
        *("ok", "discardkick"),
        *("ok", "discarddrain"),
        *("ok", "discardstress"),
        *("ok", "closekick"),
        *("ok", "closeearly"),
        *("ok", "lowered"),
        *("ok", "foreignabandon"),
        *("ok", "released"),
    ]

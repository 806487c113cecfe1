"""The simulated CUDA driver the tests without a GPU run on
(tests/support/fakes/fake_cuda_driver.c), checked itself where the real driver's
behaviour is what the tests rely on.

* The default streams by their handles, as the driver's: 0 and 1 (CU_STREAM_LEGACY) the
  current context's legacy stream, 2 (CU_STREAM_PER_THREAD) the calling thread's own;
  with no context current a call on one fails with CUDA_ERROR_INVALID_CONTEXT
  (tests/support/fakes/fake_cuda_driver_check.c, "defaults"). Through the library: a
  queue's wait for the legacy stream, an import naming it and a queue adopting it run,
  the per-thread stream is refused (the driver once took the handles for its own
  streams' addresses, and the child crashed).
* Its waits take no CPU: streams waiting on the device, idle streams, a launch blocked
  behind a deep queue, cuEventSynchronize and cuCtxSynchronize sleep until what they
  wait for comes ("idle"; the process's CPU time checked in the plain build only, a
  sanitizer's own threads and slower wake-ups aside).
Also under ThreadSanitizer and AddressSanitizer (each skips, saying why, where the
machine cannot run it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.native import harness
from tests.support.native.simulated_cuda import run_child

LOOPS = ["asyncio", "trio"]


@pytest.mark.parametrize("sanitizer", harness.SANITIZERS, ids=["plain", "tsan", "asan"])
def test_the_simulated_driver_checks_itself(tmp_path: Path, sanitizer: str) -> None:
    binary = harness.build(
        "../fakes/fake_cuda_driver_check.c",
        tmp_path,
        sanitizer,
        extra=("fakes/fake_cuda_driver.c",),
        defines=("AM_TEST_ALLOC", "AM_TEST_HOOKS"),
    )
    proc = harness.run(binary, *(() if sanitizer else ("cpu",)), sanitizer=sanitizer)
    assert proc.returncode == 0, proc.stderr[-6000:] + proc.stdout
    assert proc.stdout.split() == ["ok", "defaults", "ok", "idle"], proc.stdout


@pytest.mark.parametrize("loop", LOOPS)
def test_the_default_streams_by_their_handles(loop: str) -> None:
    harness.skip_without_compiler()
    for path, seen in run_child("default_streams", loop).items():
        if "skipped" in seen:
            continue
        assert seen == {
            "wait_0": "done",
            "wait_1": "done",
            "import": "done",
            "adopted": "done",
            "adopted_ran": 1,
            "per_thread": "InvalidArgumentError",
            "synchronized": True,
        }, (path, seen)

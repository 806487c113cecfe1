"""The cuda queues of the native runtime against a simulated driver (tests/native/fake_cuda.c).

Runs everywhere: the completion thread, the word-or-event choice for waits between queues
(submitted from two threads), fault stickiness, event recycling and a wait's confirmation
of the value it waited for are the runtime's own
logic, which the GPU tests (tests/test_cuda.py) can only exercise on an NVIDIA machine.
"""

from __future__ import annotations

import os
import subprocess
from importlib import resources
from pathlib import Path

from asyncmetal import _native


def test_cuda_queue_runtime_against_a_simulated_driver(tmp_path: Path) -> None:
    cc = _native.compiler()
    assert cc is not None, "the cpu device and this test need a C compiler (cc or $CC)"
    amrt = resources.files("asyncmetal").joinpath("native/amrt.c")
    harness = os.path.join(os.path.dirname(__file__), "native", "fake_cuda.c")
    binary = tmp_path / "fake_cuda"
    subprocess.run(
        [cc, "-O2", "-pthread", f'-DAMRT_C="{amrt}"', harness, "-o", str(binary)], check=True
    )
    proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert proc.stdout.split() == [
        *("ok", "order"),
        *("ok", "cross"),
        *("ok", "long"),
        *("ok", "events"),
        *("ok", "fault"),
        *("ok", "causal"),
        *("ok", "bound"),
        *("ok", "refused"),
        *("ok", "kick"),
        *("ok", "abandon"),
    ]

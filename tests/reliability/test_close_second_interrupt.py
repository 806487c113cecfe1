"""A second Ctrl-C as a close's ``until_uninterrupted`` goes round for the first (the
loop's end, where CPython runs signal handlers, outside its ``try``) leaves none of the
close's steps undone. Checked in a child process: a real SIGINT, raised as that loop's
backward jump is about to run (an opcode trace), with Python's default handler."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = str(Path(__file__).parents[2])

_CLOSE = """
import dis, json, signal, sys
sys.path.insert(0, sys.argv[1])
import anyio
import asyncmetal as am
from asyncmetal import _device, _interrupts

async def main():
    dev = await am.open_device("cpu")
    await dev.alloc(256)
    return dev

dev = anyio.run(main)
backend = dev._backend
close = backend.close
first = []
def interrupting():
    close()
    if not first:  # the first Ctrl-C, as the backend's close returns
        first.append(True)
        raise KeyboardInterrupt
backend.close = interrupting
code = _interrupts.until_uninterrupted.__code__
jumps = {i.offset for i in dis.get_instructions(code) if i.opname.startswith("JUMP_BACKWARD")}
fired = []
def trace(frame, event, arg):
    if frame.f_code is not code:
        return None
    frame.f_trace_opcodes = True
    if event == "opcode" and frame.f_lasti in jumps and first and not fired:
        fired.append(True)  # the second, as the loop goes round for the first
        signal.raise_signal(signal.SIGINT)
    return trace
assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
sys.settrace(trace)
raised = 0
try:
    dev._close_native(abandon=True)
except KeyboardInterrupt:
    raised += 1
finally:
    sys.settrace(None)
print(json.dumps({
    "fired": len(fired),
    "raised": raised,
    "noted open": len(_device._devices()),
    "ran out": dev._state.ran_out,
    "default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
}), flush=True)
"""


def test_a_second_interrupt_as_the_close_goes_round_for_the_first_leaves_no_step_undone() -> None:
    """The first interrupt as the cpu backend's close returns, the second (a SIGINT) as
    the device's close goes round to run that step again: the close raises one
    interrupt, its later steps ran (the device off the open ones, its queues' streams
    run out), and Python's default handler is current again. Checked failing before
    (the second escaped the loop): "assert 1 == 0" (the device still noted open)."""
    proc = subprocess.run(
        [sys.executable, "-c", _CLOSE, ROOT], capture_output=True, text=True, timeout=120
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    report = json.loads(lines[-1])
    assert report["fired"] == 1, report
    assert report["raised"] == 1, report
    assert report["noted open"] == 0, report
    assert report["ran out"], report
    assert report["default"], report

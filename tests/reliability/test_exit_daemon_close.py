"""A device closed by a close awaited on a daemon thread's loop: its close's threads --
the teardown's, and the one that finishes a teardown whose native close was cut -- are
no daemons, so the interpreter joins them at exit before the exit hook looks at the
device, which then finds it released (no native close of its own beside theirs).
Checked in a child process, whose own exit hook, registered before asyncmetal's (so run
after it), reports what was seen."""

from __future__ import annotations

import json
import subprocess
import sys

_SCRIPT = """
import atexit, json, threading
seen = {"daemons": [], "natives": [], "most": 0}
active, lock = [0], threading.Lock()
def report():
    from asyncmetal import _device
    seen["open"] = len(_device._devices())
    seen["live"] = backends[0].live_allocations
    print(json.dumps(seen))
atexit.register(report)  # (before asyncmetal's: run after it)
import anyio, asyncmetal as am
closing, backends = threading.Event(), []

async def body():
    dev = await am.open_device("cpu")
    await dev.alloc(256)
    backends.append(dev._backend)
    close, tear_down = dev._close_native, dev._tear_down
    def native(*args, **kwargs):
        seen["natives"].append(kwargs.get("abandon", False))
        if len(seen["natives"]) == 1:
            raise KeyboardInterrupt  # (the cut, as it is entered: nothing of it ran)
        if not kwargs.get("abandon"):  # (the finisher's: on once the main thread ended)
            seen["daemons"].append(threading.current_thread().daemon)
            closing.set()
            threading.main_thread().join(10)
        with lock:
            active[0] += 1
            seen["most"] = max(seen["most"], active[0])
        try:
            return close(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1
    def teardown_thread(*args):
        seen["daemons"].append(threading.current_thread().daemon)
        return tear_down(*args)
    dev._close_native, dev._tear_down = native, teardown_thread
    try:
        await dev.close()
    except KeyboardInterrupt:
        pass
    await dev.close()  # (starts the finisher; its loop's thread ends at exit)

threading.Thread(target=lambda: anyio.run(body), daemon=True).start()
assert closing.wait(20)
"""


def test_a_close_on_a_daemon_thread_is_joined_at_exit_before_the_exit_hook() -> None:
    """Checked failing before (the threads inherited the caller's daemon flag):
    'assert [True, True] == [False, False]' (the teardown's and the finisher's), the
    natives seen then [False, False, True] (the exit hook's abandoning one as well)."""
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    seen = json.loads(lines[-1])
    assert seen["daemons"] == [False, False], proc.stderr[-3000:]
    assert seen["natives"] == [False, False], proc.stderr[-3000:]  # (none at exit)
    assert seen["most"] == 1
    assert seen["open"] == seen["live"] == 0

"""The Metal backend's Objective-C blocks, against a real blocks runtime on any OS.

A small C helper built here with ``clang -fblocks`` and libBlocksRuntime does what Metal
does with a completion handler or a shared-event listener: ``Block_copy`` it, keep it,
invoke it later from another thread, ``Block_release`` it. The block asyncmetal built in
Python must arrive intact, call its native invoke function (no GIL), raise the timeline a
loop awaits, and not have been freed in between.
"""

from __future__ import annotations

import ctypes
import gc
import os
import re
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import pytest

import asyncmetal as am
from asyncmetal import _native
from asyncmetal.backends.metal import CodegenResult, _blocks
from tests.support.fakes import metal_sim

pytestmark = pytest.mark.anyio
HELPER = Path(__file__).parents[2] / "support" / "native" / "blocks_helper.c"


def _missing() -> str | None:
    if shutil.which("clang") is None:
        return "clang is not installed (apt-get install clang libblocksruntime-dev)"
    if sys.platform != "darwin" and not Path("/usr/include/Block.h").exists():
        return "the blocks runtime is not installed (apt-get install libblocksruntime-dev)"
    return None


@pytest.fixture(scope="module")
def helper(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    reason = _missing()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("blocks") / "helper.so"
    libs = [] if sys.platform == "darwin" else ["-lBlocksRuntime"]
    subprocess.run(
        [
            "clang",
            "-fblocks",
            "-shared",
            "-fPIC",
            "-O1",
            str(HELPER),
            "-o",
            str(out),
            *libs,
            "-lpthread",
        ],
        check=True,
    )
    lib = ctypes.CDLL(str(out), mode=ctypes.RTLD_GLOBAL)
    for name in ("keep_completed", "keep_reached"):
        getattr(lib, name).restype = ctypes.c_void_p
        getattr(lib, name).argtypes = [ctypes.c_void_p]
    lib.signature_of.restype = ctypes.c_char_p
    lib.signature_of.argtypes = [ctypes.c_void_p]
    lib.flags_of.argtypes = [ctypes.c_void_p]
    lib.call_completed_later.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    lib.call_reached_later.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint]
    lib.call_codegen.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int32,
        ctypes.c_char_p,
        ctypes.c_size_t,
        ctypes.c_char_p,
    ]
    return lib


def _isa() -> int:
    runtime = None if sys.platform == "darwin" else ctypes.CDLL("libBlocksRuntime.so.0")
    return _blocks.global_block_isa(runtime)


def _invoke(name: str) -> int:
    address = ctypes.cast(getattr(_native.runtime(), name), ctypes.c_void_p).value
    assert address
    return address


async def _ran(block: _blocks.BlockLiteral) -> None:
    with anyio.fail_after(5):
        while not block.calls:
            await anyio.sleep(0.001)


async def test_completion_handler_block(helper: ctypes.CDLL, device: am.Device) -> None:
    # Blocks of command buffers that never run (an earlier test's, abandoned by a close)
    # are kept for good: only this test's own count.
    kept_before = _blocks.release_ran()
    tl = device.timeline()
    block = _blocks.make_block(
        _isa(),
        _blocks.COMPLETED_SIGNATURE,
        tl.native.c_timeline,
        value=7,  # type: ignore[attr-defined]
    )
    assert block.invoke == _invoke("am_block_completed")
    address = ctypes.addressof(block)
    assert helper.signature_of(address) == b"v16@?0@8"
    assert helper.flags_of(address) == _blocks.BLOCK_IS_GLOBAL | _blocks.BLOCK_HAS_SIGNATURE
    kept = helper.keep_completed(address)
    assert kept == address  # a global block is kept as it is, not moved: it must live on
    del block
    gc.collect()  # our reference is gone; the registry must keep the memory alive
    fake_command_buffer = 0xC0FFEE
    helper.call_completed_later(fake_command_buffer, 30_000)
    with anyio.fail_after(5):
        await tl.wait(7)  # woken through the loop's pipe by the native invoke function
    kept_block = _blocks.BlockLiteral.from_address(address)
    await _ran(kept_block)  # its count of calls is written last, after the timeline
    assert kept_block.arg == fake_command_buffer
    assert kept_block.calls == 1
    assert _blocks.release_ran() == kept_before  # freed once it ran (and not before)


async def test_shared_event_listener_block(helper: ctypes.CDLL, device: am.Device) -> None:
    kept_before = _blocks.release_ran()
    tl = device.timeline()
    block = _blocks.make_block(
        _isa(),
        _blocks.REACHED_SIGNATURE,
        tl.native.c_timeline,  # type: ignore[attr-defined]
    )
    assert block.invoke == _invoke("am_block_reached")
    address = ctypes.addressof(block)
    assert helper.signature_of(address) == b"v24@?0@8Q16"
    helper.keep_reached(address)
    del block
    gc.collect()
    helper.call_reached_later(0xE7E7, 41, 20_000)
    with anyio.fail_after(5):
        await tl.wait(41)  # the value the listener was called with
    assert tl.value == 41
    await _ran(_blocks.BlockLiteral.from_address(address))
    assert _blocks.BlockLiteral.from_address(address).arg == 0xE7E7
    assert _blocks.release_ran() == kept_before


def test_compiler_service_reply_block(helper: ctypes.CDLL) -> None:
    """The block the Metal compiler service calls with its reply, called by a real blocks
    runtime after Block_copy: the library is cut out of the reply, an error raises."""
    library = b"MTLB" + b"\x01" * 40 + b"ENDT"
    header = b"\0" * 8 + struct.pack("<LL", 24, 6) + b"\0" * 8
    reply = header + b"warn:\0" + library
    result = CodegenResult()
    block = result.block(_isa())
    assert helper.signature_of(ctypes.addressof(block)) == _blocks.CODEGEN_SIGNATURE
    helper.call_codegen(ctypes.addressof(block), 0, reply, len(reply), None)
    assert result.library() == library

    failed = CodegenResult()
    block = failed.block(_isa())
    helper.call_codegen(ctypes.addressof(block), 3, None, 0, b"k.metal:1:2: error: nope")
    with pytest.raises(am.CompileError, match="error 3") as info:
        failed.library()
    assert "error: nope" in info.value.log


def test_metal_is_absent_off_macos_without_configured_libraries() -> None:
    """Off macOS there is no metal device unless the ASYNCMETAL_* variables name the
    libraries (as the tests do for the simulated Metal)."""
    if sys.platform == "darwin":
        pytest.skip("on macOS metal may be present")
    code = (
        "import anyio, asyncmetal as am\n"
        "assert 'metal' not in am.devices(), am.devices()\n"
        "async def main():\n"
        "    try:\n"
        "        await am.open_device('metal')\n"
        "    except am.AsyncMetalError as exc:\n"
        "        print(exc)\n"
        "anyio.run(main)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in metal_sim.VARIABLES}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert re.search(r"metal.*not available here", out.stdout), out.stdout


_FREE_A_TIMELINE_AS_THE_THREAD_STARTS = """
import os
import threading
from asyncmetal import _native
from asyncmetal.backends.metal import _blocks

lib = _native.runtime()
timeline, dropped = lib.am_timeline_new(), lib.am_timeline_new()
block = _blocks.make_block(0, _blocks.COMPLETED_SIGNATURE, timeline)  # yet to run
thread_class = threading.Thread


class GCAsItStarts(thread_class):
    def _set_native_id(self):  # on the new thread, before it says it started
        if self.name == "asyncmetal-metal-blocks":  # what a dropped MetalTimeline does
            _blocks.free_timeline(dropped, lib.am_timeline_free)  # from the GC here
        super()._set_native_id()


threading.Thread = GCAsItStarts
holding = thread_class(target=_blocks.hold_until_run, args=(block, object()), daemon=True)
holding.start()
holding.join(10)
threading.Thread = thread_class
if holding.is_alive():
    print("deadlocked", flush=True)
    os._exit(1)  # (the lock is held for good: nothing more can be asked)
print("returned")
block.calls = 1  # it ran: the thread lets go of it, and ends
_blocks.release_ran()
letting_go = _blocks._letting_go
if letting_go is not None:
    letting_go.join(10)
print(_blocks._held, _blocks._unfreed)
"""


def test_a_timeline_freed_as_the_letting_go_thread_starts_does_not_deadlock() -> None:
    """The GC may run finalizers on a new thread before Thread.start() returns to its
    starter: a dropped MetalTimeline's there (free_timeline, which takes the module's
    lock) as hold_until_run starts the thread that lets go of what blocks keep does not
    wait for the starter, which waits for the thread to start. Checked failing without:
    the starter held the lock across the start, and both waited for good (this hung the
    test suite once, in a metal queue's close). In a process of its own: without the
    fix, the lock stays held for good."""
    proc = subprocess.run(
        [sys.executable, "-c", _FREE_A_TIMELINE_AS_THE_THREAD_STARTS],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-3000:])
    assert proc.stdout.split("\n")[:2] == ["returned", "{} []"], proc.stdout


def test_what_is_kept_as_the_letting_go_thread_ends_on_its_start_is_let_go_of(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A thread started to let go of what blocks keep may find nothing kept any more and
    end before its starter is through; something kept meanwhile by another caller, who
    saw the thread starting and left it to that thread, gets a thread of its own still.
    Before, it was kept with no thread running, until the next block was kept."""
    start = threading.Thread.start
    kept = object()
    first = [False, True]

    def ending_first(thread: threading.Thread) -> None:
        if thread.name != "asyncmetal-metal-blocks" or not first.pop():
            return start(thread)
        _blocks._held.pop(-1, None)  # let go of by another thread's release_ran, say
        start(thread)
        thread.join(10)  # it found nothing kept and ended
        _blocks._held[-2] = kept  # another caller keeps something: starting, so left
        _blocks._start_letting_go()

    monkeypatch.setattr(threading.Thread, "start", ending_first)
    _native.runtime()
    try:
        with _blocks._lock:
            _blocks._held[-1] = object()
        _blocks._start_letting_go()
        thread = _blocks._letting_go
        assert thread is not None and thread.is_alive()
    finally:
        monkeypatch.undo()
        with _blocks._lock:
            _blocks._held.pop(-1, None)
            _blocks._held.pop(-2, None)

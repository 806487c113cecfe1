"""The ``cpu`` device: C kernels built by the system C compiler, run on queue threads.

Each queue is one thread executing its commands in order; ctypes releases the GIL for
the kernel. Timelines are counters the queue threads advance. A device-side wait parks
the queue thread on its own inbox until a signal pokes it, so no lock is ever held
while waiting and the event loop never takes a lock a device thread could keep.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import os
import queue as queue_module
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._backend import Arg, Backend, DeviceInfo, NativeQueue, NativeTimeline, Record
from .._compile import Compiler
from .._errors import CompileError, DeviceLostError

_ALIGN = 64


class CCompiler(Compiler):
    """C source -> shared object, with ``$CC`` (default ``cc``). Pickles as its flags."""

    name = "cc"

    def __init__(self, cc: str | None = None, flags: Sequence[str] = ("-O2",)) -> None:
        self.cc = cc
        self.flags = tuple(flags)

    def config(self) -> tuple[Any, ...]:
        return (self.cc, self.flags)

    def _executable(self) -> str:
        return self.cc or os.environ.get("CC") or "cc"

    def version(self) -> str:
        return _cc_version(self._executable())

    def compile(self, src: str) -> bytes:
        cc = self._executable()
        if shutil.which(cc) is None:
            raise CompileError(f"no C compiler: {cc!r} is not on PATH (set $CC)")
        with tempfile.TemporaryDirectory(prefix="asyncmetal-cc-") as tmp:
            out = os.path.join(tmp, "kernel.so")
            proc = subprocess.run(
                [cc, *self.flags, "-shared", "-fPIC", "-x", "c", "-", "-o", out],
                input=src.encode(),
                capture_output=True,
                check=False,
            )
            if proc.returncode != 0:
                log = (proc.stderr + proc.stdout).decode(errors="replace")
                raise CompileError(f"{cc} failed with exit code {proc.returncode}", log)
            with open(out, "rb") as f:
                return f.read()


@functools.lru_cache(maxsize=8)
def _cc_version(cc: str) -> str:
    try:
        proc = subprocess.run([cc, "--version"], capture_output=True, check=False)
    except OSError:
        return "missing"
    return proc.stdout.decode(errors="replace").partition("\n")[0]


class _Memory:
    __slots__ = ("address", "array")

    def __init__(self, nbytes: int) -> None:
        raw = np.empty(nbytes + _ALIGN, np.uint8)
        start = -raw.ctypes.data % _ALIGN
        self.array = raw[start : start + nbytes]
        self.address: int = self.array.ctypes.data


class CPUTimeline(NativeTimeline):
    def __init__(self, on_advance: Callable[[int], None]) -> None:
        self._value = 0
        self._lock = threading.Lock()  # held for a few bytecodes, never while waiting
        self._sleepers: list[queue_module.SimpleQueue[Any]] = []
        self._on_advance = on_advance

    @property
    def value(self) -> int:
        return self._value

    def signal(self, value: int) -> None:
        with self._lock:
            if value <= self._value:
                return
            self._value = value
            sleepers = list(self._sleepers)
        for inbox in sleepers:
            inbox.put(_RECHECK)
        self._on_advance(value)


_RECHECK = object()
_STOP = object()


def _address(arg: Arg) -> int:
    memory: _Memory = arg.handle
    return memory.address + arg.offset


def _host_address(view: memoryview) -> tuple[int, Any]:
    array = np.frombuffer(view, np.uint8)
    return array.ctypes.data, array


class CPUQueue(NativeQueue):
    def __init__(self, name: str, timeline: CPUTimeline) -> None:
        self._inbox: queue_module.SimpleQueue[Any] = queue_module.SimpleQueue()
        self.timeline = timeline  # the queue's own: signalled after each command
        self._thread = threading.Thread(target=self._run, name=f"asyncmetal-{name}", daemon=True)
        self._thread.start()

    # Each command is (function, args, value, record).
    def _submit(
        self, fn: Callable[..., None], args: tuple[Any, ...], value: int, record: Record
    ) -> None:
        self._inbox.put((fn, args, value, record))

    def _run(self) -> None:
        backlog: collections.deque[Any] = collections.deque()
        inbox = self._inbox
        while True:
            item = backlog.popleft() if backlog else inbox.get()
            if item is _STOP:
                return
            if item is _RECHECK:
                continue
            fn, args, value, record = item
            if fn is _wait:
                if not self._wait(args[0], args[1], backlog):
                    return
            else:
                try:
                    record.start_ns = time.perf_counter_ns()
                    fn(*args)
                    record.end_ns = time.perf_counter_ns()
                except Exception as exc:  # a host-side failure of the command
                    record.error = DeviceLostError(f"cpu command failed: {exc!r}")
            self.timeline.signal(value)

    def _wait(self, timeline: CPUTimeline, target: int, backlog: collections.deque[Any]) -> bool:
        if timeline.value >= target:
            return True
        inbox = self._inbox
        timeline._sleepers.append(inbox)
        try:
            while timeline.value < target:
                item = inbox.get()
                if item is _STOP:  # closing while waiting: what follows is abandoned
                    return False
                if item is not _RECHECK:
                    backlog.append(item)
        finally:
            timeline._sleepers.remove(inbox)
        return True

    def launch(
        self,
        program: Any,
        args: Sequence[Arg],
        global_size: tuple[int, int, int],
        local_size: tuple[int, int, int],
        value: int,
        record: Record,
    ) -> None:
        converted = tuple(
            ctypes.c_int(a.value) if a.handle is None else ctypes.c_void_p(_address(a))
            for a in args
        )
        # The Arg tuple rides along so every buffer stays alive until the command ran.
        self._submit(_call, (program, converted, args), value, record)

    def signal(self, timeline: NativeTimeline, target: int, value: int, record: Record) -> None:
        self._submit(timeline.signal, (target,), value, record)

    def wait(self, timeline: NativeTimeline, target: int, value: int, record: Record) -> None:
        self._submit(_wait, (timeline, target), value, record)

    def copy(
        self, dst: Arg, src: Arg, nbytes: int, value: int, record: Record, peer: Any = None
    ) -> None:
        self._submit(_memmove, (_address(dst), _address(src), nbytes, dst, src), value, record)

    def copyin(self, dst: Arg, src: memoryview, value: int, record: Record) -> None:
        address, keep = _host_address(src)
        self._submit(_memmove, (_address(dst), address, src.nbytes, dst, keep), value, record)

    def copyout(self, dst: memoryview, src: Arg, value: int, record: Record) -> None:
        address, keep = _host_address(dst)
        self._submit(_memmove, (address, _address(src), dst.nbytes, keep, src), value, record)

    def close(self) -> None:
        self._inbox.put(_STOP)
        if self._thread is not threading.current_thread():
            self._thread.join()


def _call(program: Any, converted: tuple[Any, ...], _keep: object) -> None:
    program(*converted)


def _memmove(dst: int, src: int, nbytes: int, *_keep: object) -> None:
    ctypes.memmove(dst, src, nbytes)


def _wait(*_: object) -> None:  # a marker: the queue thread handles waits itself
    raise AssertionError("unreachable")


class CPUBackend(Backend):
    kind = "cpu"
    host_visible = True

    @classmethod
    def available(cls) -> list[str]:
        return ["cpu"]

    def __init__(self, index: int) -> None:
        self.index = index
        self._queues = 0
        self._compiler = CCompiler()
        self._libraries: list[Any] = []
        self.live_allocations = 0
        pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
        self._info = DeviceInfo(
            name=f"cpu:{index}",
            total_memory=int(pages * os.sysconf("SC_PAGE_SIZE")) if pages else 1 << 34,
        )

    @property
    def info(self) -> DeviceInfo:
        return self._info

    @property
    def compiler(self) -> Compiler:
        return self._compiler

    def load(self, binary: bytes, name: str) -> Any:
        with tempfile.NamedTemporaryFile(prefix="asyncmetal-", suffix=".so") as f:
            f.write(binary)
            f.flush()
            lib = ctypes.CDLL(f.name, mode=os.RTLD_LOCAL)
        fn = getattr(lib, name)  # AttributeError: the name is missing
        fn.restype = None
        self._libraries.append(lib)
        return fn

    def allocate(self, nbytes: int) -> Any:
        memory = _Memory(nbytes)
        self.live_allocations += 1
        return memory

    def free(self, handle: Any) -> None:
        self.live_allocations -= 1

    def host_view(self, handle: Any, offset: int, nbytes: int) -> memoryview:
        memory: _Memory = handle
        return memoryview(memory.array[offset : offset + nbytes])

    def new_queue(self, timeline: NativeTimeline) -> NativeQueue:
        assert isinstance(timeline, CPUTimeline)
        self._queues += 1
        return CPUQueue(f"cpu:{self.index}-q{self._queues}", timeline)

    def new_timeline(self, on_advance: Callable[[int], None]) -> NativeTimeline:
        return CPUTimeline(on_advance)

    def close(self) -> None:
        self._libraries.clear()

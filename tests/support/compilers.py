"""Compilers the compile-pool tests send to worker processes (importable there)."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from typing import Any

from asyncmetal.backends.cpu import CCompiler


class SlowCompiler(CCompiler):
    """A C compiler that first sleeps ``delay`` seconds (and records it ran)."""

    name = "slow-cc"

    def __init__(self, delay: float, marker_dir: str | None = None) -> None:
        super().__init__()
        self.delay = delay
        self.marker_dir = marker_dir

    def config(self) -> tuple[Any, ...]:
        return (self.delay, self.marker_dir)

    def compile(self, src: str) -> bytes:
        if self.marker_dir is not None:
            with open(os.path.join(self.marker_dir, f"{os.getpid()}-{time.time_ns()}"), "w") as f:
                f.write(src)
        time.sleep(self.delay)
        return super().compile(src)


class _HowCompiler(CCompiler):
    """A C compiler configured by ``how`` it misbehaves."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def config(self) -> tuple[Any, ...]:
        return (self.how,)


class CrashingCompiler(_HowCompiler):
    """Kills its own worker: by a signal or by exiting."""

    name = "crashing-cc"

    def compile(self, src: str) -> bytes:
        if self.how == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        os._exit(3)


class DeviceOpeningCompiler(CCompiler):
    """Tries to open a device inside the worker (which must refuse)."""

    name = "device-opening-cc"

    def compile(self, src: str) -> bytes:
        import anyio

        import asyncmetal

        async def try_open() -> None:
            await asyncmetal.open_device("cpu")

        anyio.run(try_open)
        return b""


class EnvironmentCompiler(CCompiler):
    """Returns facts about the worker process instead of a binary."""

    name = "environment-cc"

    def compile(self, src: str) -> bytes:
        import sys

        facts = {
            "main": getattr(sys.modules.get("__main__"), "__file__", None),
            "worker": os.environ.get("ASYNCMETAL_WORKER"),
            "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "sigint": str(signal.getsignal(signal.SIGINT)),
            "pid": os.getpid(),
        }
        return repr(facts).encode()


GATE_WAIT_S = 60.0  # a gate never opened (a failed test) holds its worker this long at most


def gate_name(src: str) -> str:
    """The name of ``src``'s gate in a GatedCompiler's directory."""
    return hashlib.sha256(src.encode()).hexdigest()[:16]


class GatedCompiler(CCompiler):
    """A C compiler that marks each source it begins (the file ``gate_name(src)`` +
    ``.began`` in ``gate_dir``), then waits for its gate (the file ``gate_name(src)``
    there) before compiling: the test opens it."""

    name = "gated-cc"

    def __init__(self, gate_dir: str) -> None:
        super().__init__()
        self.gate_dir = gate_dir

    def config(self) -> tuple[Any, ...]:
        return (self.gate_dir,)

    def compile(self, src: str) -> bytes:
        gate = os.path.join(self.gate_dir, gate_name(src))
        with open(gate + ".began", "w"):
            pass
        deadline = time.monotonic() + GATE_WAIT_S
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.005)
        return super().compile(src)


def _made_outside_a_worker() -> str:
    if os.environ.get("ASYNCMETAL_WORKER"):
        raise AttributeError("Can't get attribute 'Setting' on <module '__main__'>")
    return "setting"


class _UnpicklableInWorker:
    """What a compiler's config may hold that a worker cannot unpickle (a class of the
    parent's ``__main__``): here it raises there as such a class would."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_made_outside_a_worker, ())


class UnreadableCompiler(CCompiler):
    """A compiler whose config a worker cannot unpickle."""

    name = "unreadable-cc"

    def __init__(self, setting: object = None) -> None:
        super().__init__()
        self.setting = _UnpicklableInWorker() if setting is None else setting

    def config(self) -> tuple[Any, ...]:
        return (self.setting,)


class PrefixingCompiler(CCompiler):
    """A C compiler that defines ``V`` as 2 before the source: a subclass that compiles
    otherwise, with its base's name and config."""

    def compile(self, src: str) -> bytes:
        return super().compile("#define V 2\n" + src)


class PrintingCompiler(CCompiler):
    """A C compiler that first runs a command printing an empty line to its standard
    output (inherited: a compiler that does not capture what it runs)."""

    name = "printing-cc"

    def compile(self, src: str) -> bytes:
        os.system("echo")  # a child writing to descriptor 1
        return super().compile(src)


class ReadingCompiler(CCompiler):
    """A C compiler that first runs a command reading its (inherited) standard input
    until it ends."""

    name = "reading-cc"

    def compile(self, src: str) -> bytes:
        os.system("cat >/dev/null")  # a child reading descriptor 0
        return super().compile(src)


class WrongTypeCompiler(_HowCompiler):
    """A custom compiler's slips: ``compile`` returning a str, or (``log``) a binary
    with a ``_last_log`` that is not a str."""

    name = "wrong-type-cc"

    def compile(self, src: str) -> bytes:
        if self.how == "log":
            binary = super().compile(src)
            self._last_log = 42  # type: ignore[assignment]
            return binary
        return "not a binary"  # type: ignore[return-value]

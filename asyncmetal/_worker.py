"""The compile worker: run as ``python -m asyncmetal._worker`` (by runpy, with the
working directory off ``sys.path``: see ``_pool._WORKER_MAIN``).

Started by :class:`asyncmetal._pool.CompilePool` as a fresh interpreter (never forked,
never importing the parent's ``__main__``). It reads length-prefixed pickled jobs
``(compiler, src)`` on stdin and answers ``("ok", bytes, log)`` (the compiler's warnings)
or ``("error", message, log)`` on stdout. It ignores SIGINT so Ctrl-C reaches only the
parent, and it never opens a device: ``ASYNCMETAL_WORKER`` makes ``open_device`` refuse.

Nothing in the package imports this module (the framing is ``_messages``'): run with
runpy after its package was imported, a module imported already makes runpy warn,
which ``PYTHONWARNINGS=error`` turns into the worker's death.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import sys

from ._messages import TMPDIR_VARIABLE, read_bytes, write_message


def main() -> None:
    # The temporary directory the pool made for this process alone goes with it: the
    # pool removes it too once it collected the process, but a pool whose process was
    # killed cannot (this one then sees its input end, or its reply refused).
    try:
        serve()
    except BrokenPipeError:  # a reply to a parent that is gone
        pass
    finally:
        own = os.environ.get(TMPDIR_VARIABLE)
        if own:
            shutil.rmtree(own, ignore_errors=True)


def serve() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["ASYNCMETAL_WORKER"] = "1"
    # What the compiler reads or prints must not touch the message streams: the jobs
    # and replies go on descriptors of their own (not inherited), descriptor 0 -- which
    # the processes a compiler starts, and C code it calls, read -- becomes /dev/null
    # and descriptor 1 stderr.
    sys.stdout.flush()
    stdin, stdout = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from ._errors import CompileError

    while True:
        try:
            data = read_bytes(stdin)
        except EOFError:
            return
        if not data:  # the word to stop (write_stop)
            return
        try:
            compiler, src = pickle.loads(data)  # noqa: S301 - our own parent is the only peer
        except Exception as exc:  # the message was read whole: the next one is intact
            write_message(stdout, ("error", unreadable(exc), ""))
            continue
        try:
            binary, log = compiler.compile(src), compiler._last_log
            if not isinstance(binary, (bytes, bytearray, memoryview)):
                write_message(stdout, ("error", returned(compiler, binary), ""))
                continue
            # (A log that is not a str, a custom compiler's slip, is not the caller's.)
            log = log if isinstance(log, str) else "" if log is None else str(log)
            write_message(stdout, ("ok", bytes(binary), log))
        except CompileError as exc:
            write_message(stdout, ("error", str(exc).partition("\n")[0], exc.log))
        except Exception as exc:
            write_message(stdout, ("error", f"{type(exc).__name__}: {exc}", ""))


def returned(compiler: object, binary: object) -> str:
    """Why what a compiler's ``compile`` returned is not a binary."""
    return (
        f"{type(compiler).__name__}.compile returned {type(binary).__name__}, not bytes: "
        "a compiler's compile(src) returns the binary"
    )


def unreadable(exc: Exception) -> str:
    """Why a job could not be unpickled here."""
    return (
        f"the compile worker could not unpickle the compiler ({type(exc).__name__}: "
        f"{exc}): its class, and what its config() holds, must be importable by their "
        "module's name in a fresh interpreter -- not defined in the script run as "
        "__main__, which compile workers never import (define it in a module)"
    )


if __name__ == "__main__":
    main()

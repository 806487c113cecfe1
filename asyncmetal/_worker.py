"""The compile worker: ``python -m asyncmetal._worker``.

Started by :class:`asyncmetal._pool.CompilePool` as a fresh interpreter (never forked,
never importing the parent's ``__main__``). It reads length-prefixed pickled jobs
``(compiler, src)`` on stdin and answers ``("ok", bytes, log)`` (the compiler's warnings)
or ``("error", message, log)`` on stdout. It ignores SIGINT so Ctrl-C reaches only the
parent, and it never opens a device: ``ASYNCMETAL_WORKER`` makes ``open_device`` refuse.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
from typing import IO, Any

_HEADER = struct.Struct("<Q")


def read_message(stream: IO[bytes]) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)  # noqa: S301 - our own parent process is the only peer


def write_message(stream: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["ASYNCMETAL_WORKER"] = "1"
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    # Anything the compiler prints must not corrupt the message stream.
    sys.stdout = sys.stderr
    from ._errors import CompileError

    while True:
        try:
            compiler, src = read_message(stdin)
        except EOFError:
            return
        try:
            binary = compiler.compile(src)
            write_message(stdout, ("ok", binary, compiler.last_log))
        except CompileError as exc:
            write_message(stdout, ("error", str(exc).partition("\n")[0], exc.log))
        except Exception as exc:
            write_message(stdout, ("error", f"{type(exc).__name__}: {exc}", ""))


if __name__ == "__main__":
    main()

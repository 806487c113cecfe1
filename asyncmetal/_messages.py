"""The compile pool's messages: length-prefixed pickles, on a worker's stdin and stdout."""

from __future__ import annotations

import pickle
import struct
from typing import IO, Any

_HEADER = struct.Struct("<Q")

# The environment variable naming a worker's own temporary directory (its TMPDIR), made
# by the pool for it alone: removed by whichever of the two goes last.
TMPDIR_VARIABLE = "ASYNCMETAL_WORKER_TMPDIR"


def read_message(stream: IO[bytes]) -> Any:
    return pickle.loads(read_bytes(stream))  # noqa: S301 - our own parent process is the only peer


def read_bytes(stream: IO[bytes]) -> bytes:
    """One message, not unpickled yet (EOFError where the stream ends first)."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return data


def write_stop(stream: IO[bytes]) -> None:
    """The word to stop: an empty message (no pickle is empty). A worker ends on it
    even where a forked process still holds a copy of its input, whose end it would
    otherwise wait for."""
    stream.write(_HEADER.pack(0))
    stream.flush()


def pack_message(obj: Any) -> bytes:
    """``obj`` as one message: its length, then its pickle."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def write_message(stream: IO[bytes], obj: Any) -> None:
    stream.write(pack_message(obj))
    stream.flush()

"""Regular-expression reads of a long text in short steps.

A kernel's parameters are read from its source on a worker thread (for all but a
short source), but one regular-expression call holds the interpreter's lock for as
long as it reads: over a source of megabytes, tens of milliseconds, which the event
loop's thread waits out. Here each call reads a window of about ``WINDOW`` characters
(under a millisecond's reading), so the interpreter can hand its lock to the loop
between calls; each function finds what the one call over the whole text would.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

# The characters one call reads, about: 32 KiB take 0.2 to 0.5 ms on a 2-core VM.
WINDOW = 1 << 15


def windows(text: str, cut: re.Pattern[str] | None, pos: int = 0) -> Iterator[tuple[int, int]]:
    """Spans that cover ``text[pos:]`` in order, each about ``WINDOW`` long and (but the
    last) ending right after a character ``cut`` matches (one character); None: after
    any. A window is longer where no such character follows for long."""
    size = len(text)
    while pos < size:
        end = pos + WINDOW
        if end >= size:
            yield pos, size
            return
        if cut is not None:
            found = search(cut, text, end - 1, 1)
            end = size if found is None else found.end()
        yield pos, end
        pos = end


def finditer(
    pattern: re.Pattern[str], text: str, cut: re.Pattern[str] | None, pos: int = 0
) -> Iterator[re.Match[str]]:
    """``pattern.finditer(text, pos)``, read window by window (``windows``): ``cut``
    must match a character that no match of ``pattern`` holds but as its last, and
    a match that does not end in one may look at the character after it (``\\b``), no
    further: no match then straddles two windows, and each window's are those of the
    whole text."""
    for start, end in windows(text, cut, pos):
        yield from pattern.finditer(text, start, end)


def findall(pattern: re.Pattern[str], text: str, cut: re.Pattern[str] | None) -> list[Any]:
    """``pattern.findall(text)``, read as ``finditer`` reads."""
    found = finditer(pattern, text, cut)
    if pattern.groups == 0:
        return [m.group() for m in found]
    if pattern.groups == 1:
        return [m.groups("")[0] for m in found]
    return [m.groups("") for m in found]


def search(pattern: re.Pattern[str], text: str, pos: int, reach: int) -> re.Match[str] | None:
    """``pattern.search(text, pos)`` for a pattern whose matches are at most ``reach``
    characters long, counting any character it looks at after one (``\\b``: one more)."""
    size = len(text)
    while pos < size:
        end = pos + WINDOW
        found = pattern.search(text, pos, min(size, end + reach))
        if found is not None and found.start() < end:
            return found
        pos = end
    return None


def find(text: str, sub: str, pos: int) -> int:
    """``text.find(sub, pos)``."""
    size = len(text)
    while pos < size:
        end = pos + WINDOW
        found = text.find(sub, pos, end + len(sub) - 1)
        if found >= 0:
            return found
        pos = end
    return -1


def rfind(text: str, sub: str, end: int) -> int:
    """``text.rfind(sub, 0, end)`` for a one-character ``sub``."""
    while end > 0:
        start = max(0, end - WINDOW)
        found = text.rfind(sub, start, end)
        if found >= 0:
            return found
        end = start
    return -1


def matches_at(
    pattern: re.Pattern[str], text: str, starts: Iterable[int]
) -> Iterator[re.Match[str]]:
    """``pattern.finditer(text)`` where a match can start only at one of ``starts`` (in
    increasing order): each tried, but one inside the match before."""
    after = 0
    for start in starts:
        if start < after:
            continue
        found = pattern.match(text, start)
        if found is not None:
            after = max(found.end(), start + 1)
            yield found


def sub(
    matches: Iterable[re.Match[str]], text: str, repl: str | Callable[[re.Match[str]], str]
) -> str:
    """``text`` with each of ``matches`` (in order, none overlapping) replaced by
    ``repl`` (or what it gives for the match)."""
    pieces: list[str] = []
    last = 0
    for found in matches:
        pieces.append(text[last : found.start()])
        pieces.append(repl if isinstance(repl, str) else repl(found))
        last = found.end()
    if not pieces:
        return text
    pieces.append(text[last:])
    return "".join(pieces)


# The start of each preprocessor directive's line (a "#" after blanks alone).
_DIRECTIVE_START = re.compile(r"^[ \t]*#", re.M)
_NEWLINE = re.compile("\n")


def directive_starts(text: str) -> Iterator[int]:
    """Where each line of ``text`` that is a preprocessor directive starts: where a
    pattern that begins ``^[ \\t]*#`` (multiline) can match."""
    return (m.start() for m in finditer(_DIRECTIVE_START, text, _NEWLINE))

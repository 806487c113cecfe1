"""CompileCache: compiled binaries by content, in memory (LRU) and on disk (sqlite, WAL).

The disk cache lives under ``$ASYNCMETAL_CACHE_DIR`` (default: the user's cache
directory) and is shared safely by several processes. ``ASYNCMETAL_CACHE=0`` turns it
off. A corrupt or unreadable cache is ignored with a warning, never fatal; one that can
be read but not written (a read-only mount, another user's directory) is read, with a
warning that nothing new is stored.

Each entry is stored with its length and SHA-256 and checked when read: a damaged one
(a torn write, a bad disk, a hand edit) is evicted and counts as a miss, so it is
rebuilt rather than handed to a loader -- a truncated shared object given to dlopen
can kill the process with SIGBUS.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import hashlib
import numbers
import os
import sqlite3
import sys
import threading
import weakref
from pathlib import Path

from ._errors import ArgumentTypeError, InvalidArgumentError, env_switch, keep_error, warn
from ._threads import run_sync as to_thread


def default_cache_dir() -> Path:
    """``$ASYNCMETAL_CACHE_DIR``, else the user's cache directory; OSError where there
    is none: no ``$HOME`` (nor ``$XDG_CACHE_HOME``), and a user the system does not
    know (a container run as an arbitrary uid)."""
    if env := os.environ.get("ASYNCMETAL_CACHE_DIR"):
        return _absolute(env)
    base = None if sys.platform == "darwin" else os.environ.get("XDG_CACHE_HOME")
    if base:
        return Path(base) / "asyncmetal"
    try:
        home = Path.home()
    except (RuntimeError, KeyError) as exc:  # (KeyError: the password database's)
        raise OSError(
            "no home directory to keep it in ($HOME is not set, nor known for this "
            "user): set $ASYNCMETAL_CACHE_DIR"
        ) from exc
    if sys.platform == "darwin":
        return home / "Library" / "Caches" / "asyncmetal"
    return home / ".cache" / "asyncmetal"


def _absolute(directory: str | os.PathLike[str]) -> Path:
    """``directory`` as the absolute path it names now: a ``~`` expanded (as a shell
    does, which a service's environment file or a program's string does not), and
    one relative to the working directory kept there, whatever the working directory
    is when the cache is first used (a service changes it as it starts). An absolute
    path is taken as it is: no system call (a default pool is made on a loop)."""
    path = os.fspath(directory) if isinstance(directory, (str, os.PathLike)) else directory
    if not isinstance(path, str):  # (bytes too: a path of str is taken)
        raise ArgumentTypeError(
            f"directory must be a str or a path (os.PathLike) or None, got {type(path).__name__}"
        )
    if path.startswith("~"):
        path = os.path.expanduser(path)
    return Path(path if os.path.isabs(path) else os.path.abspath(path))


class CacheWarning(UserWarning):
    """The on-disk compile cache could not be used; compiling goes on without it."""


class CompileCache:
    """Compiled binaries keyed by compiler identity and source hash: the most recently
    used ones in memory (up to ``max_memory_bytes``), and all in an sqlite database in
    ``directory`` (default: ``$ASYNCMETAL_CACHE_DIR``, else the user's cache directory).
    ``disk=False`` keeps it in memory only (default: ``$ASYNCMETAL_CACHE``, on unless
    ``0``, ``false``, ``no`` or ``off``). A :class:`CompilePool` takes it:
    ``CompilePool(cache=CompileCache(directory))``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        disk: bool | None = None,
        max_memory_bytes: int = 256 << 20,
    ) -> None:
        # Checked here: the pool's handler threads store each binary, and one that
        # failed to would leave its compile's callers waiting.
        limit: object = max_memory_bytes
        if isinstance(limit, bool) or not isinstance(limit, numbers.Integral):
            raise ArgumentTypeError(
                f"max_memory_bytes must be an int (bytes), got {type(limit).__name__}"
            )
        if limit < 0:
            raise InvalidArgumentError(f"max_memory_bytes must be >= 0, got {limit!r}")
        if disk is not None and not isinstance(disk, bool):
            raise ArgumentTypeError(
                f"disk must be True, False or None ($ASYNCMETAL_CACHE), got {disk!r:.40}"
            )
        if disk is None:
            disk = env_switch("ASYNCMETAL_CACHE")
        self.disk_enabled = disk
        # Why the disk cache was turned off; below, why it is read but never written.
        # Each is kept without its traceback (keep_error), which would hold the frames
        # it was raised through -- this cache among their locals -- as long as the
        # cache: only its message is given (in a warning), it is never raised again.
        self.error: BaseException | None = None
        if directory is not None:
            self.directory = _absolute(directory)
        else:
            try:
                self.directory = default_cache_dir()
            except OSError as exc:  # no home: compiling goes on without a disk cache
                self.directory = Path("~", ".cache", "asyncmetal")  # (named, never used)
                if disk:
                    self.disk_enabled, self.error = False, keep_error(exc)
        # Whether it has a database at all: not one kept in memory only, nor one with
        # nowhere to keep it (a disk cache turned off later, by an error, still has one).
        self._has_disk = self.disk_enabled
        self.max_memory_bytes = int(limit)
        self._memory: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._memory_bytes = 0
        self._db: sqlite3.Connection | None = None
        self._db_lock = threading.Lock()
        self._memory_lock = threading.Lock()
        self.hits_memory = self.hits_disk = self.misses = 0
        self.damaged = 0  # entries found damaged on disk and evicted
        self.read_only: BaseException | None = None
        self._warned = self._warned_read_only = False
        _caches.add(self)

    # -- memory --------------------------------------------------------------------------

    def _get_memory(self, key: str) -> bytes | None:
        """The binary cached in memory under ``key``, else None."""
        data = self._memory.get(key)
        if data is not None:
            with contextlib.suppress(KeyError):  # evicted meanwhile by a handler thread
                self._memory.move_to_end(key)
            self.hits_memory += 1
        return data

    # An entry and its bytes are counted in and out together, in a run with no call (a
    # KeyboardInterrupt comes after a call or at a function's entry, never inside one).

    def _put_memory(self, key: str, data: bytes) -> None:
        """Keep ``data`` in memory under ``key``, the least recently used going first."""
        size = len(data)
        with self._memory_lock:
            if key in self._memory:
                return
            self._memory[key] = data
            self._memory_bytes += size
            while self._memory_bytes > self.max_memory_bytes and len(self._memory) > 1:
                try:
                    old_key = next(iter(self._memory))  # the least recently used
                except RuntimeError:  # reordered meanwhile by a lookup (_get_memory)
                    continue
                old_size = len(self._memory[old_key])
                del self._memory[old_key]
                self._memory_bytes -= old_size

    def _clear_memory(self) -> None:
        """Forget every binary held in memory (the disk cache keeps its own)."""
        with self._memory_lock:
            empty: collections.OrderedDict[str, bytes] = collections.OrderedDict()
            self._memory, self._memory_bytes = empty, 0

    # -- disk ----------------------------------------------------------------------------

    @property
    def path(self) -> Path | None:
        """The sqlite database of the disk cache; None for a cache that has none: one
        kept in memory only (``disk=False``, ``$ASYNCMETAL_CACHE`` off) or with nowhere
        to keep it (no home directory). One turned off by an error keeps naming it."""
        return self._file if self._has_disk else None

    @property
    def _file(self) -> Path:
        """Where the database is, or would be (what the warnings name)."""
        return self.directory / "compile-cache.sqlite"

    def _connect(self) -> sqlite3.Connection:
        if self._db is None:
            db = None
            try:
                try:
                    self.directory.mkdir(parents=True, exist_ok=True)
                except FileExistsError:  # ("File exists", of a file where it should be)
                    raise NotADirectoryError(f"{self.directory} is not a directory") from None
                db = sqlite3.connect(self._file, timeout=10, check_same_thread=False)
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
                db.execute(
                    "CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY,"
                    " size INTEGER NOT NULL, sha256 BLOB NOT NULL, data BLOB)"
                )
                if not self._writable():
                    # Where a process that had it open was killed (its WAL files left
                    # behind), sqlite opens a database it cannot write without a word,
                    # and the first store fails.
                    raise sqlite3.OperationalError("attempt to write a readonly database")
            except (sqlite3.Error, OSError) as exc:
                if db is not None:
                    db.close()
                self._db = self._connect_read_only(exc)
                self.read_only = keep_error(exc)
            else:
                self._db = db
        return self._db

    def _writable(self) -> bool:
        """Whether this process may write the cache (``os.access``: also False on a
        read-only mount, for root too)."""
        return os.access(self.directory, os.W_OK) and os.access(self._file, os.W_OK)

    def _connect_read_only(self, why: BaseException) -> sqlite3.Connection:
        """The cache as it is, opened to be read only, where it cannot be written (a
        directory of another user's, a read-only mount: ``os.access`` says so) -- or
        ``why`` raised, where there is none to read or it could be written. A WAL
        database whose shared-memory file cannot be made here opens only as immutable:
        what another process writes meanwhile may go unseen (a miss), and an entry read
        torn fails its checksum (a miss too)."""
        if self._writable() or not self._file.is_file():
            raise why
        uri = Path(os.path.abspath(self._file)).as_uri()
        for mode in ("mode=ro", "immutable=1"):
            db = sqlite3.connect(f"{uri}?{mode}", uri=True, timeout=10, check_same_thread=False)
            try:
                db.execute("SELECT size, sha256, data FROM entries LIMIT 1").fetchall()
            except sqlite3.Error:
                db.close()
                continue
            return db
        raise why

    def _disable(self, exc: BaseException) -> None:
        # Called from worker threads: the warning is given later, from the caller's task.
        self.disk_enabled = False
        self.error = keep_error(exc)

    def _warn_if_disabled(self) -> None:
        """Give the warning about an unusable cache once, in the calling task (and the
        one about a cache that is read but not written, once)."""
        if self.read_only is not None and not self._warned_read_only:
            self._warned_read_only = True
            warn(
                f"asyncmetal: the compile cache at {self._file} cannot be written "
                f"({self.read_only}); its binaries are used, new ones are not stored",
                CacheWarning,
            )
        if self.error is not None and not self._warned:
            self._warned = True
            warn(
                f"asyncmetal: the compile cache at {self._file} is unusable "
                f"({self.error}); compiling without it",
                CacheWarning,
            )

    def _load_disk(self, key: str) -> bytes | None:
        """Blocking disk lookup; run it off the loop. A damaged entry is evicted: a miss."""
        with self._db_lock:
            if not self.disk_enabled:
                return None
            try:
                db = self._connect()
                row = db.execute(
                    "SELECT size, sha256, data FROM entries WHERE key = ?", (key,)
                ).fetchone()
                if row is not None and not _intact(*row):
                    self.damaged += 1
                    if self.read_only is None:
                        with db:
                            db.execute("DELETE FROM entries WHERE key = ?", (key,))
                    row = None
            except Exception as exc:  # sqlite3.Error, OSError, or a row of the wrong types
                self._disable(exc)
                return None
        if row is None:
            self.misses += 1
            return None
        self.hits_disk += 1
        data = bytes(row[2])
        self._put_memory(key, data)
        return data

    async def _get_disk(self, key: str) -> bytes | None:
        """``_load_disk`` on a worker thread, never blocking the loop."""
        data = await to_thread(self._load_disk, key)
        self._warn_if_disabled()
        return data

    def _write_disk(self, sql: str, params: tuple[object, ...]) -> None:
        """One write to the disk cache (blocking); a failure turns the disk cache off."""
        with self._db_lock:
            if not self.disk_enabled:
                return
            try:
                db = self._connect()
                if self.read_only is not None:
                    return
                with db:
                    db.execute(sql, params)
            except Exception as exc:  # a full disk, a read-only directory...: go on without
                self._disable(exc)

    def _put_disk(self, key: str, data: bytes) -> None:
        """Blocking store (called from handler threads)."""
        self._write_disk(
            "INSERT OR REPLACE INTO entries (key, size, sha256, data) VALUES (?, ?, ?, ?)",
            (key, len(data), hashlib.sha256(data).digest(), data),
        )

    def _evict(self, key: str) -> None:
        """Forget ``key`` in memory and on disk (blocking: off the loop)."""
        with self._memory_lock:
            data = self._memory.get(key)
            if data is not None:
                size = len(data)
                del self._memory[key]
                self._memory_bytes -= size
        self._write_disk("DELETE FROM entries WHERE key = ?", (key,))

    def close(self) -> None:
        """Close the database connection (a later lookup opens it again)."""
        with self._db_lock:
            self._close_db()

    def _close_db(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def _intact(size: object, digest: object, data: object) -> bool:
    return isinstance(data, bytes) and len(data) == size and hashlib.sha256(data).digest() == digest


# Every cache alive, for a forked child: a cache is usable there (a pool made in the
# child may take one made before the fork), with locks and a database connection of
# its own.
_caches: weakref.WeakSet[CompileCache] = weakref.WeakSet()
# The parent's connections, in a forked child: never used there (sqlite's locks are
# each process's own, so one used across a fork may corrupt the database), nor closed
# (a close may checkpoint or remove the parent's write-ahead log).
_inherited: list[sqlite3.Connection] = []


def _own_in_child() -> None:
    """In a forked child: each cache's locks made anew (a thread of the parent, gone
    here, may have held one: storing a binary, waiting for another process's lock on
    the database), and its connection left to the parent -- a lookup opens its own."""
    for cache in list(_caches):
        cache._db_lock = threading.Lock()
        cache._memory_lock = threading.Lock()
        if cache._db is not None:
            _inherited.append(cache._db)
            cache._db = None


def _close_all_at_exit() -> None:
    """At exit, every cache's database closed: sqlite then writes its write-ahead log
    back and removes it and its shared-memory file (``-wal``, ``-shm``), which a
    connection still open as the interpreter ends leaves beside the database (a
    directory removed by hand, a cache made read-only, would keep or trip on them).
    Registered before the compile pools' exit hook (``_pool`` imports this module), so
    it runs after it, once their workers are gone. A lock a thread still holds (a
    store waiting for another process's lock) is waited for a moment, then that cache
    is left as it is. A Ctrl-C as one closes leaves no other open: the first is raised
    once all were closed (the interpreter reports it and runs the other exit hooks)."""
    interrupts: list[KeyboardInterrupt] = []
    for cache in list(_caches):
        try:
            if cache._db_lock.acquire(timeout=EXIT_LOCK_S):
                try:
                    with contextlib.suppress(sqlite3.Error):
                        cache._close_db()
                finally:
                    cache._db_lock.release()
        except KeyboardInterrupt as exc:
            interrupts.append(exc)
    if interrupts:
        raise interrupts[0]


EXIT_LOCK_S = 1.0
atexit.register(_close_all_at_exit)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_own_in_child)

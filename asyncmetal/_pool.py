"""CompilePool: compilers run in spawned worker processes, results cached by content.

One handler thread per worker process does the blocking pipe I/O; the event loop only
submits jobs and awaits them through the bridge. Identical compiles in flight run once.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import logging
import math
import numbers
import os
import queue as queue_module
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import anyio

from ._bridge import checkpoint, require_loop
from ._cache import CompileCache
from ._compile import Compiler, source_key
from ._errors import (
    MAX_TIMEOUT_S,
    ArgumentTypeError,
    ClosedResourceError,
    CompileError,
    CompileWarning,
    InvalidArgumentError,
    Singular,
    as_int,
    check_bool,
    fresh_error,
    keep_error,
    warn,
)
from ._messages import TMPDIR_VARIABLE, pack_message, read_message, write_stop
from ._threads import run_sync as to_thread
from ._timeline import HostEvents, wait_value

if TYPE_CHECKING:
    from ._device_state import DeviceState

_STOP = object()
_log = logging.getLogger("asyncmetal")


def check_timeout(timeout: object) -> float | None:
    """A compile's ``timeout`` as seconds (None: no limit), or the error naming it."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise ArgumentTypeError(
            f"timeout must be a number of seconds or None, got {type(timeout).__name__}"
        )
    seconds = cast(float, timeout)  # compared as it is: an int may exceed any float
    if not seconds > 0:  # also refuses NaN
        raise InvalidArgumentError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return None if seconds > MAX_TIMEOUT_S else float(seconds)


def _replies_in_time(pipe: Any, job: _Job) -> bool:
    """Whether ``pipe`` has something to read before ``job``'s deadline (see
    ``_ready_in_time``)."""
    return _ready_in_time(pipe, job, select.POLLIN)


def _ready_in_time(pipe: Any, job: _Job, event: int) -> bool:
    """Whether ``pipe`` is ready for ``event`` (POLLIN: something to read, POLLOUT: room
    to write) before ``job``'s deadline -- re-read as it waits: a request joining the
    job may put it later (or lift it: None). ``poll``, not ``select``: a process with
    more than 1024 files open (a service's sockets) gets descriptors ``select``
    refuses."""
    poller = select.poll()
    poller.register(pipe, event)
    while True:
        deadline = job.deadline
        left = JOIN_CHECK_S if deadline is None else deadline - time.monotonic()
        if left <= 0:
            return False
        if poller.poll(math.ceil(min(left, JOIN_CHECK_S) * 1000)):
            return True


JOIN_CHECK_S = 0.1  # how often a timed compile's wait looks at a widened timeout
SHUTDOWN_JOIN_S = 10.0  # how long a shutdown waits for the workers to finish their jobs
# How long past its timeout a compile that timed out waits for its worker to be killed
# and its compiler's files removed, so that its error comes once they are gone: a compile
# raises within ``timeout`` plus this. (A process stuck in the kernel may take longer to
# die: the error comes all the same, the worker's thread finishing the cleanup.)
TIMEOUT_GRACE_S = 0.5


def _ends_by(job_deadline: float | None, deadline: float | None) -> bool:
    """Whether a job with ``job_deadline`` is ended by its worker by ``deadline``."""
    return job_deadline is not None and deadline is not None and job_deadline <= deadline


class _Job:
    __slots__ = (
        "awaiters",
        "callbacks",
        "compiler",
        "deadline",
        "done",
        "key",
        "log",
        "result",
        "src",
        "started",
        "timed_deadline",
        "timeout",
        "untimed",
    )

    def __init__(self, key: str, compiler: Compiler, src: str, timeout: float | None) -> None:
        self.key, self.compiler, self.src, self.timeout = key, compiler, src, timeout
        # When its worker ends it (time.monotonic(); None: never): its callers' timeouts
        # run from their calls, however long the job waited for a worker to start it.
        self.deadline = None if timeout is None else time.monotonic() + timeout
        # The latest deadline of its callers with a timeout (None: none had one), and
        # how many of its claims have none: while one does, the job has no deadline;
        # once the last of those is withdrawn (cancelled), it has that latest one again.
        self.timed_deadline = self.deadline
        self.untimed = 0
        self.started = False  # a worker compiles it
        self.awaiters = 0
        self.result: bytes | CompileError | ClosedResourceError | None = None
        self.log = ""  # what the compiler printed as it succeeded (its warnings)
        self.done = HostEvents()  # reaches 1 when result is set
        self.callbacks: list[Callable[[_Job], None]] = []  # run on the handler thread


class _Worker:
    """One worker process and the thread that feeds it jobs."""

    def __init__(self, pool: CompilePool, eager: bool = False) -> None:
        self.pool = pool
        self.proc: subprocess.Popen[bytes] | None = None
        self.tmpdir: str | None = None  # the process's TMPDIR, removed with it
        self.stderr: Any = None
        self.eager = eager
        self.thread = threading.Thread(target=self._run, name="asyncmetal-compile", daemon=True)
        self.thread.start()

    def _spawn(self) -> None:
        """Start the worker's process as ``self.proc``."""
        env = dict(os.environ)
        env["ASYNCMETAL_WORKER"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""  # compilers need no GPU: never take its memory
        # Whatever the parent can import (a custom compiler's module), the worker can.
        env["PYTHONPATH"] = _worker_path()
        if self.stderr is None:
            self.stderr = tempfile.TemporaryFile()
        self.stderr.seek(0)
        self.stderr.truncate()
        # The compiler's temporary files (its own and those of cc and what cc runs) go
        # under a directory of this process alone, so that none outlives a killed worker.
        self.tmpdir = tempfile.mkdtemp(prefix="asyncmetal-worker-")
        env["TMPDIR"] = env["TMP"] = env["TEMP"] = env[TMPDIR_VARIABLE] = self.tmpdir
        try:
            # A fork waits until the process has started and is recorded (see
            # _starting): the child then holds none of its pipes.
            with _starting:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", _WORKER_MAIN, "asyncmetal._worker"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=self.stderr,
                    env=env,
                    # A terminal's Ctrl-C goes to the parent only; and the worker leads a
                    # process group holding everything it starts, which _reap ends as one.
                    start_new_session=True,
                )
        except BaseException:
            _remove_tree(self.tmpdir)
            self.tmpdir = None
            raise

    def _run(self) -> None:
        pool = self.pool
        if self.eager:
            with contextlib.suppress(Exception):  # if not now, it is spawned for its first job
                self._spawn()
        while True:
            with pool._lock:
                pool._idle += 1
            try:
                job = pool._pending.get(timeout=pool.idle_timeout)
            except queue_module.Empty:
                if pool._retire(self):
                    self._stop()
                    return
                continue
            with pool._lock:
                pool._idle -= 1
                # Deciding and leaving _in_flight are one critical section: a request that
                # arrives after this starts a new job instead of joining a withdrawn one.
                withdrawn = job is not _STOP and job.awaiters == 0
                # One whose deadline passed as it waited for a worker is not started:
                # its callers have timed out (a request from now on starts afresh).
                expired = (
                    job is not _STOP
                    and job.deadline is not None
                    and job.deadline <= time.monotonic()
                )
                # One taken after a close is not started either: a close lets the
                # compiles running finish, and refuses those still queued.
                closed = job is not _STOP and not withdrawn and not expired and pool._closed
                if withdrawn or expired or closed:
                    del pool._in_flight[job.key]
                # A job submitted while this thread took its own still counted it idle,
                # and so started no worker: start one now if a slot is free.
                pool._grow()
            if job is _STOP:
                self._stop()
                return
            if withdrawn:
                pool._finish(job, CompileError("compile withdrawn"), ran=False)
                continue
            if expired:
                pool._finish(job, _timed_out(job), ran=False)
                continue
            if closed:
                pool._finish(job, _closed_error(), ran=False)
                continue
            try:
                result = self._compile(job)
            except Exception as exc:
                # Whatever a job does, this thread lives on: a dead one would keep its
                # slot in the pool and leave its job's waiters waiting for ever. The worker
                # may have half a message: start afresh.
                self._kill()
                result = CompileError(
                    f"the compile failed in the pool: {type(exc).__name__}: {exc}"
                )
            pool._finish(job, result)

    def _compile(self, job: _Job) -> bytes | CompileError:
        if self.proc is not None and _exited(self.proc, 0):
            self._reap()  # it died while idle
        if self.proc is None:
            self._spawn()
            # A kill at exit that came as the process started found none to kill (it
            # sets _killing before it looks): nothing will await the job.
            if self.pool._killing:
                self._kill()
                return CompileError("the compile pool was shut down")
        proc = self.proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        message = pack_message((job.compiler, job.src))
        try:
            job.started = True
            # Sent within the deadline too: a worker that reads nothing (stopped, hung)
            # takes no more than a pipe holds, and is killed as one that does not reply.
            if not self._sent_by_deadline(proc.stdin, message, job) or (
                job.deadline is not None and not self._replies_by_deadline(proc.stdout, job)
            ):
                self._kill()
                return _timed_out(job)
            reply = read_message(proc.stdout)
        except (EOFError, OSError):
            return CompileError(self._death_message())
        if reply[0] == "ok":
            data: bytes = reply[1]
            job.log = reply[2]
            return data
        return CompileError(reply[1], reply[2])

    def _sent_by_deadline(self, pipe: Any, message: bytes, job: _Job) -> bool:
        """Whether all of ``message`` was written to ``pipe`` (the worker's input)
        before ``job``'s deadline (see ``_replies_by_deadline``)."""
        fd = pipe.fileno()
        left = memoryview(message)
        os.set_blocking(fd, False)  # (our end alone: the worker's is its own)
        try:
            while left:
                if not self._by_deadline(lambda: _ready_in_time(pipe, job, select.POLLOUT), job):
                    return False
                with contextlib.suppress(BlockingIOError):
                    left = left[os.write(fd, left) :]
        finally:
            os.set_blocking(fd, True)
        return True

    def _replies_by_deadline(self, pipe: Any, job: _Job) -> bool:
        """Whether ``pipe`` has something to read before ``job``'s deadline."""
        return self._by_deadline(lambda: _replies_in_time(pipe, job), job)

    def _by_deadline(self, ready_in_time: Callable[[], bool], job: _Job) -> bool:
        """Whether ``ready_in_time()`` (a wait for a pipe) is true before ``job``'s
        deadline. If not, the job leaves those in flight in the critical section that
        finds its deadline passed (a request joining it there puts the deadline later):
        a request from then on starts the compile afresh rather than join one being
        ended."""
        pool = self.pool
        while not ready_in_time():
            with pool._lock:
                deadline = job.deadline
                if deadline is not None and deadline <= time.monotonic():
                    if pool._in_flight.get(job.key) is job:
                        del pool._in_flight[job.key]
                    return False
        return True

    def _death_message(self) -> str:
        proc = self.proc
        assert proc is not None
        self._reap()
        code = proc.returncode
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        log = ""
        if self.stderr is not None:
            self.stderr.seek(0)
            log = self.stderr.read().decode(errors="replace")[-4000:]
        return f"the compile worker died ({how}) while compiling" + (f"\n{log}" if log else "")

    def _kill(self) -> None:
        if self.proc is not None:
            _kill_group(self.proc)
        self._reap()  # also a temporary directory made for a process that did not start

    def _reap(self) -> None:
        """Close our ends of the worker's pipes, collect it, end whatever it left running
        (a compiler it had started) and remove its temporary files."""
        proc, self.proc = self.proc, None
        tmpdir, self.tmpdir = self.tmpdir, None
        if proc is not None:
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
            if not _exited(proc, 5):
                _kill_group(proc)
                _exited(proc, None)
            # Still unreaped, the worker holds its pid, so the group's number names only
            # the processes it started: end any it left running, then collect it.
            _kill_group(proc)
            proc.wait()
        if tmpdir is not None:
            _remove_tree(tmpdir)

    def _stop(self) -> None:
        # The word to stop ends the worker's loop, and so does closing its stdin -- but
        # a child forked as the worker started (its pipes not yet known to the at-fork
        # handler, see _let_go_of_parents_workers) may hold a copy of that input open.
        # (Not to one killed or dead: where SIGPIPE is not ignored, a write to it would
        # end this process.)
        proc = self.proc
        if (
            proc is not None
            and proc.stdin is not None
            and not self.pool._killing
            and not _exited(proc, 0)
        ):
            with contextlib.suppress(OSError, ValueError):
                write_stop(proc.stdin)
        self._reap()
        if self.stderr is not None:
            self.stderr.close()
            self.stderr = None


# A worker runs ``python -m asyncmetal._worker`` -- without the working directory first
# on its sys.path, where ``-m`` puts it (and the parent's script need not have it): a
# file there named as a module of the standard library (a ``random.py``, which tempfile
# imports) would be imported by the worker in its stead. (Python 3.11's ``-P``; the
# name of the module to run is the command's argument.)
_WORKER_MAIN = """import sys
if sys.path and sys.path[0] == "":
    del sys.path[0]
import runpy
runpy.run_module(sys.argv[1], run_name="__main__", alter_sys=True)
"""


def _check_compile(compiler: object, src: object) -> None:
    """Refuse what ``CompilePool.compile`` cannot compile, before anything is submitted."""
    if not isinstance(compiler, Compiler):
        made = ""
        if isinstance(compiler, type) and issubclass(compiler, Compiler):
            made = f" (the class: make one, {compiler.__name__}())"
        raise ArgumentTypeError(
            f"compile(compiler, src): compiler must be a Compiler, got {compiler!r:.60}{made}"
        )
    if not isinstance(src, str):
        raise ArgumentTypeError(
            f"compile(compiler, src): src must be a str, got {type(src).__name__}"
        )
    try:
        src.encode()
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(
            f"compile(compiler, src): the source is not encodable text ({exc.reason} at "
            f"character {exc.start})"
        ) from None


def _wake(events: HostEvents, job: _Job) -> None:
    """A job's callback (``_submit``'s ``on_done``): it ended, and ``events`` counts it."""
    events.increment()


def _closed_error() -> ClosedResourceError:
    return ClosedResourceError("the compile pool was closed before this compile started")


def _timed_out(job: _Job) -> CompileError:
    return CompileError(f"compile timed out after {job.timeout} s")


def _worker_path() -> str:
    """The parent's ``sys.path`` for a worker's ``PYTHONPATH``, each entry absolute: an
    entry relative to a working directory since deleted (or no path at all, as an
    editable install's ``__editable__...__path_hook__``) is left out -- the interpreter
    fails to start on it there ("failed to make path absolute"). ("": the working
    directory, which ``-m`` puts first anyway.)"""
    entries = []
    for entry in sys.path:
        if not entry:
            continue
        if not os.path.isabs(entry):
            try:
                entry = os.path.abspath(entry)
            except OSError:  # the working directory is gone
                continue
        entries.append(entry)
    return os.pathsep.join(entries)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group that ``proc`` leads (it was started in a new session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _exited(proc: subprocess.Popen[bytes], timeout: float | None) -> bool:
    """Whether ``proc`` has exited, waiting up to ``timeout`` seconds (None: as long as
    it takes), without collecting it."""
    if proc.returncode is not None:
        return True
    if not hasattr(os, "waitid"):  # macOS: collect it (the group is then killed later)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
    flags = os.WEXITED | os.WNOWAIT
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        if deadline is None:
            os.waitid(os.P_PID, proc.pid, flags)
            return True
        while os.waitid(os.P_PID, proc.pid, flags | os.WNOHANG) is None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
    except ChildProcessError:  # collected already: it has exited
        return True
    return True


def _remove_tree(path: str) -> None:
    # A process killed a moment ago may still finish a file it was creating: try again.
    for _ in range(50):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            return
        time.sleep(0.02)


class CompilePool(Singular):
    """Worker processes that compile, with an in-memory and an on-disk cache.

    Workers start lazily (spawned interpreters), at most ``max_workers`` at once, and
    retire after ``idle_timeout`` seconds without work.
    """

    def __init__(
        self,
        max_workers: int | None = None,
        *,
        idle_timeout: float = 60.0,
        cache: CompileCache | None = None,
    ) -> None:
        workers = None if max_workers is None else as_int(max_workers)  # (any object)
        idle: object = idle_timeout
        if max_workers is not None and workers is None:
            raise ArgumentTypeError(
                "max_workers must be an int or None (one per core, at most 8), "
                f"got {type(max_workers).__name__}"
            )
        if workers is not None and workers < 1:
            raise InvalidArgumentError(
                f"max_workers must be an int >= 1 (or None: one per core, at most 8), "
                f"got {max_workers!r}"
            )
        if isinstance(idle, bool) or not isinstance(idle, numbers.Real):
            raise ArgumentTypeError(
                f"idle_timeout must be a number of seconds, got {type(idle).__name__}"
            )
        if not 0 < float(idle) < math.inf:
            raise InvalidArgumentError(
                f"idle_timeout must be a positive, finite number of seconds, got {idle_timeout!r}"
            )
        if cache is not None and not isinstance(cache, CompileCache):
            raise ArgumentTypeError(
                f"cache must be a CompileCache (a directory's: CompileCache(path)) or None, "
                f"got {cache!r:.60}"
            )
        # (Read-only to users, as properties: checked here, and its workers rely on them.)
        self._max_workers = workers or min(os.cpu_count() or 1, 8)
        # (Longer than MAX_TIMEOUT_S, about 31 years, is as long: a wait of more overflows
        # the clock, and the worker's thread would die of it.)
        self._idle_timeout = min(float(idle_timeout), MAX_TIMEOUT_S)
        self._cache = cache if cache is not None else CompileCache()
        self._pending: queue_module.Queue[Any] = queue_module.Queue()
        self._workers: list[_Worker] = []
        self._idle = 0
        self._in_flight: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._killing = False  # shut down at exit: jobs not run yet are dropped
        self._pid = os.getpid()  # a forked child refuses it
        self._compiles = 0  # jobs that ran in a worker
        _pools.add(self)

    def _check_usable(self) -> None:
        if self._pid != os.getpid():  # (before its lock, which a parent thread may hold)
            raise ClosedResourceError(
                "this compile pool was made before the fork that made this process: its "
                "workers and threads are the parent's; make a CompilePool here (the "
                "default pool is made afresh)"
            )
        if self._closed:
            raise ClosedResourceError("the compile pool is closed")

    @property
    def max_workers(self) -> int:
        """The most worker processes it runs at once."""
        return self._max_workers

    @property
    def idle_timeout(self) -> float:
        """Seconds a worker waits for work before it retires."""
        return self._idle_timeout

    @property
    def cache(self) -> CompileCache:
        """The :class:`CompileCache` it compiles into."""
        return self._cache

    @property
    def compiles(self) -> int:
        """Compile jobs that ran in a worker (those its cache did not answer)."""
        return self._compiles

    @property
    def workers(self) -> int:
        """Worker threads alive now (each owns at most one process)."""
        return len(self._workers)

    def prestart(self) -> None:
        """Start every worker process now rather than on demand (each then waits for
        work). Never blocks: the processes start in their handler threads."""
        self._check_usable()
        with self._lock:
            self._check_usable()  # (closed meanwhile: it would start workers nobody stops)
            while len(self._workers) < self.max_workers:
                self._workers.append(_Worker(self, eager=True))

    def _submit(
        self,
        compiler: Compiler,
        src: str,
        key: str,
        *,
        timeout: float | None = None,
        on_done: Callable[[_Job], None] | None = None,
    ) -> _Job:
        """Start (or join) the compile of ``src``; never blocks. Cache misses only."""
        timeout = check_timeout(timeout)
        self._check_usable()
        with self._lock:
            # Again under the lock, which shutdown closes under: a job queued after the
            # workers' stops would never run.
            self._check_usable()
            job = self._in_flight.get(key)
            if job is None:
                job = _Job(key, compiler, src, timeout)
                self._in_flight[key] = job
                self._pending.put(job)
                self._grow()
            elif timeout is None:  # joined: the job lasts as long as its latest caller
                job.deadline = None
            else:
                job.timeout = timeout if job.timeout is None else max(job.timeout, timeout)
                mine = time.monotonic() + timeout
                latest = job.timed_deadline
                job.timed_deadline = mine if latest is None else max(latest, mine)
                if not job.untimed:
                    job.deadline = job.timed_deadline
            job.awaiters += 1
            job.untimed += timeout is None
            if on_done is not None:
                job.callbacks.append(on_done)
        return job

    def _grow(self) -> None:
        """Start a worker if jobs wait beyond the idle ones and a slot is free (under
        the lock)."""
        if (
            not self._closed
            and self._pending.qsize() > self._idle
            and len(self._workers) < self.max_workers
        ):
            self._workers.append(_Worker(self))

    def _finish(
        self, job: _Job, result: bytes | CompileError | ClosedResourceError, *, ran: bool = True
    ) -> None:
        if isinstance(result, bytes):
            try:
                self.cache._put_memory(job.key, result)
                self.cache._put_disk(job.key, result)
            except Exception:  # (its callers still get the binary: never left waiting)
                _log.exception("asyncmetal: a compiled binary could not be cached")
        with self._lock:
            self._compiles += ran
            if self._in_flight.get(job.key) is job:  # a withdrawn job has left already
                del self._in_flight[job.key]
            callbacks = list(job.callbacks)
        # (An error is kept as one for every caller that joined the job: each raises a
        # copy, see _result.)
        job.result = result if isinstance(result, bytes) else keep_error(result)
        job.done.increment()
        for callback in callbacks:
            try:
                callback(job)
            except Exception:  # one broken callback must not stop the others, nor the thread
                _log.exception("asyncmetal: a compile callback failed")

    def _retire(self, worker: _Worker) -> bool:
        """After an idle timeout: leave, unless work arrived meanwhile."""
        with self._lock:
            self._idle -= 1
            if self._pending.qsize():
                return False
            self._workers.remove(worker)
            return True

    async def compile(
        self, compiler: Compiler, src: str, *, timeout: float | None = None, refresh: bool = False
    ) -> bytes:
        """Compile ``src`` with ``compiler`` in a worker; cached by content.

        ``refresh`` evicts the cached binary first (one that would not load) and compiles
        anew. Cancelling withdraws a compile that has not started; one already running
        finishes into the cache.
        """
        timeout = check_timeout(timeout)
        check_bool(refresh, "refresh")
        _check_compile(compiler, src)
        self._check_usable()
        key = source_key(await compiler_identity(compiler), src)
        binary, log = await self._compile_keyed(
            compiler, src, key, timeout=timeout, refresh=refresh
        )
        if log:
            warn(CompileWarning("the compiler printed warnings", log))
        return binary

    async def _compile_keyed(
        self,
        compiler: Compiler,
        src: str,
        key: str,
        *,
        timeout: float | None = None,
        refresh: bool = False,
        state: DeviceState | None = None,
    ) -> tuple[bytes, str]:
        """:meth:`compile` for a caller that has the source's key (``source_key`` of the
        compiler's identity and ``src``) already (a long source's hash costs the loop
        milliseconds), with the compiler's warnings (``_take_log``) for the caller to
        report: "" from a cache, or where another caller of the compile got them.
        ``state``: the device compiling it, whose close ends the wait (see _wait)."""
        timeout = check_timeout(timeout)
        self._check_usable()
        if refresh:
            await to_thread(self.cache._evict, key)
        else:
            cached = self.cache._get_memory(key)
            if cached is None and self.cache.disk_enabled:
                cached = await self.cache._get_disk(key)
            if cached is not None:
                await checkpoint()
                return cached, ""
        if state is None:
            job = self._submit(compiler, src, key, timeout=timeout)
            binary = await self._wait(job, timeout)
            return binary, self._take_log(job)
        # The device's close ends the wait as it seals the device (see
        # DeviceState.close_waits): ``woken`` reaches 1 once the job ends, or ends then.
        woken = HostEvents()
        wake = functools.partial(_wake, woken)
        state.close_waits.add(woken)
        try:
            state.check_open()  # (closed as the source was looked up: nothing submitted)
            job = self._submit(compiler, src, key, timeout=timeout, on_done=wake)
            binary = await self._wait(job, timeout, (woken, wake, state))
        finally:
            state.close_waits.discard(woken)
        return binary, self._take_log(job)

    async def _wait(
        self,
        job: _Job,
        timeout: float | None = None,
        device: tuple[HostEvents, Callable[[_Job], None], DeviceState] | None = None,
    ) -> bytes:
        """Wait for a job just submitted, for at most ``timeout`` seconds (its own: a job
        others joined with a longer one goes on for them) -- and ``TIMEOUT_GRACE_S`` more
        for its worker to end it; cancelling, or the timeout, withdraws it if nobody else
        waits and it has not started. ``device``: the events that the job's end (its
        callback, ``on_done`` of the submission) and the device's close both wake, that
        callback and the device's state: its close ends the wait at once, withdrawing
        this claim, with the device's ClosedResourceError (the job goes on for the
        others that await it, or into the cache)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        woken, on_done = (job.done, None) if device is None else device[:2]
        try:
            with anyio.move_on_after(math.inf if timeout is None else timeout) as waited:
                await wait_value(woken, 1)
        except BaseException:
            self._withdraw(job, untimed=timeout is None, on_done=on_done)
            raise
        if device is not None and device[2].closed:
            self._withdraw(job, untimed=timeout is None, on_done=on_done)
            device[2].check_open()
        if waited.cancelled_caught:
            try:
                # Its worker ends it by this same deadline (the job's is not later: it
                # was submitted first): its error, once the worker and its compiler's
                # files are gone -- waited for a grace at most, and unless a caller
                # joining meanwhile put the job's deadline later (or lifted it): then
                # this one's is over now.
                with anyio.move_on_after(TIMEOUT_GRACE_S):
                    while job.started and _ends_by(job.deadline, deadline):
                        with anyio.move_on_after(JOIN_CHECK_S):
                            await wait_value(woken, 1)
                            break
            except BaseException:
                self._withdraw(job, on_done=on_done)
                raise
            if device is not None and device[2].closed:
                self._withdraw(job, on_done=on_done)
                device[2].check_open()
            if not job.done.value:
                self._withdraw(job, on_done=on_done)
                raise CompileError(f"compile timed out after {timeout} s")
        self.cache._warn_if_disabled()  # storing the result may have found the disk full
        return self._result(job)

    def _withdraw(
        self,
        job: _Job,
        *,
        untimed: bool = False,
        on_done: Callable[[_Job], None] | None = None,
    ) -> None:
        """Give up one claim on ``job``; a job nobody claims is skipped if not started.
        ``untimed``: the claim was submitted with no timeout -- once no such claim is
        left, the job ends by the latest deadline of those submitted with one.
        ``on_done``: the claim's callback, taken off the job (not run once it ends)."""
        if self._pid != os.getpid():  # (a forked child's claim: on the parent's job)
            return
        with self._lock:
            job.awaiters -= 1
            if untimed:
                job.untimed -= 1
                if not job.untimed:
                    job.deadline = job.timed_deadline
            if on_done is not None and on_done in job.callbacks:
                job.callbacks.remove(on_done)

    @staticmethod
    def _result(job: _Job) -> bytes:
        """The binary of a finished job, or its error raised: its CompileError, or the
        ClosedResourceError of one its pool's close refused before it started."""
        result = job.result
        if isinstance(result, (CompileError, ClosedResourceError)):
            raise fresh_error(result)  # (its own: see _errors.keep_error)
        assert result is not None
        return result

    @staticmethod
    def _take_log(job: _Job) -> str:
        """What the compiler printed as the job succeeded (its warnings), once: to the
        first caller that asks (one compile warns once, whoever joined it)."""
        log, job.log = job.log, ""
        return log if log.strip() else ""

    def shutdown(self, *, kill: bool = False) -> None:
        """Stop the workers: compiles not started yet are refused at once (their callers
        get ``ClosedResourceError``); the workers finish the job in hand (waited for
        ``SHUTDOWN_JOIN_S`` at most, all together; one still on it goes on, and is
        killed at exit) -- or, with ``kill`` (at interpreter exit, when nothing will
        await them), that job is dropped too, the workers and their compilers killed at
        once. Their temporary directories are removed either way. Blocks: not on a
        loop."""
        check_bool(kill, "kill")
        with self._lock:  # (a job submitted from now on is refused: see _submit)
            self._closed = True
            self._killing = kill
            workers = list(self._workers)
            # Those queued leave now, not after the jobs in hand (a worker taking one
            # meanwhile refuses it: see _run).
            queued: list[_Job] = []
            with contextlib.suppress(queue_module.Empty):
                while True:
                    job = self._pending.get_nowait()
                    if job is not _STOP:  # (an earlier close's: its worker gets another)
                        queued.append(job)
            for job in queued:
                if self._in_flight.get(job.key) is job:
                    del self._in_flight[job.key]
        for job in queued:
            self._finish(job, _closed_error(), ran=False)
        for _ in workers:
            self._pending.put(_STOP)
        if kill:
            for worker in workers:
                proc = worker.proc
                if proc is not None:
                    _kill_group(proc)  # its thread sees the worker die, and goes on
        deadline = time.monotonic() + SHUTDOWN_JOIN_S  # for all of them at once
        for worker in workers:
            worker.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            # Those still on a job (a compile that hangs) stay listed: the exit kills them.
            self._workers[:] = [worker for worker in workers if worker.thread.is_alive()]

    async def aclose(self) -> None:
        """:meth:`shutdown` without blocking the loop: compiles not started yet raise
        ``ClosedResourceError`` in their callers at once; those running finish first.
        Not cancelled: the workers are stopped all the same."""
        require_loop()  # (before the pool is shut: asyncmetal's error, not anyio's)
        with anyio.CancelScope(shield=True):
            await to_thread(self.shutdown)


# Compilers' identities, the most recently used last: each compile's options make a
# compiler of their own, so a program compiling with ever new options (a ``-DN=`` per
# request) would keep one for each for good; past this many, the least recently used
# goes (found again, off the loop, if it comes back).
IDENTITIES_KEPT = 256
_identities: collections.OrderedDict[Compiler, str] = collections.OrderedDict()
_identities_lock = threading.Lock()  # (loops on several threads look them up)


async def compiler_identity(compiler: Compiler) -> str:
    """``compiler._identity()``, found off the loop once (it may run the compiler) and
    kept while it is among the ``IDENTITIES_KEPT`` most recently used."""
    with _identities_lock:
        identity = _identities.get(compiler)
        if identity is not None:
            _identities.move_to_end(compiler)
            return identity
    identity = await to_thread(compiler._identity)
    with _identities_lock:
        _identities[compiler] = identity
        _identities.move_to_end(compiler)
        while len(_identities) > IDENTITIES_KEPT:
            _identities.popitem(last=False)
    return identity


_default_pool: CompilePool | None = None
_default_lock = threading.Lock()


def default_pool() -> CompilePool:
    """The process's shared pool, made on first use and shut down at exit."""
    global _default_pool
    with _default_lock:
        if _default_pool is None or _default_pool._closed:
            _default_pool = CompilePool()
        return _default_pool


# Every pool alive (the default one and those made by hand), for the exit.
_pools: weakref.WeakSet[CompilePool] = weakref.WeakSet()


def _shutdown_all() -> None:
    """At exit: every pool's workers killed, with the compilers they run, and their
    temporary directories removed -- not waited for one after another."""
    for pool in list(_pools):
        _shutdown_at_exit(pool)


def _shutdown_at_exit(pool: CompilePool) -> None:
    """``pool``'s workers killed, unless all are gone already. Also a closed pool's
    whose workers were still on a job when it closed: else they would outlive the
    process, their temporary directories too. (A forked child's pools are the
    parent's.)"""
    if (not pool._closed or pool._workers) and pool._pid == os.getpid():
        pool.shutdown(kill=True)


atexit.register(_shutdown_all)


# Held while a worker's process starts and until the pool records it, and by a fork
# (os.fork, and so multiprocessing's) for its duration. A child forked in the middle of
# subprocess.Popen would hold copies of the starting process's pipes, which the at-fork
# handler cannot yet name -- among them the pipe on which Popen waits for the exec,
# whose copy keeps that Popen (the pool's thread: its compiles and its close) waiting
# for as long as the child lives. Reentrant: a fork made on the starting thread itself
# (a hook in Popen) goes through. The fork takes and lets go of it with the lock's own
# methods, which run no Python code: CPython runs a pending signal handler in any Python
# code of an at-fork handler, and reports what it raises as unraisable, so a Ctrl-C
# coming as the fork begins or ends would be dropped there; with none, it is raised as
# os.fork returns (unless another library's handler runs Python code after ours).
_starting = threading.RLock()


def _forget_default_in_child() -> None:
    # A forked child has none of the pool's threads, and its workers are the parent's
    # (their pipes too): compiles sent there would never come back. The child makes
    # its own pool on first use; the parent's is left alone.
    global _default_pool, _default_lock, _identities_lock
    # (Held by the forking thread, as the fork began; made anew in place: the fork's
    # handlers are its methods.)
    _starting._at_fork_reinit()  # type: ignore[attr-defined]
    _default_pool = None
    _default_lock = threading.Lock()
    _identities_lock = threading.Lock()  # (a parent thread may have held it)
    _let_go_of_parents_workers()


def _let_go_of_parents_workers() -> None:
    """In a forked child: its copies of the parent's worker pipes become /dev/null. A
    worker ends when its input ends: a child holding a copy of that input (for its
    life: a server's worker) would keep it waiting, and the parent's close would wait
    for it and then kill it. (The file objects stay, harmless: the child refuses the
    pools.)"""
    try:
        null = os.open(os.devnull, os.O_RDWR)
    except OSError:
        return
    try:
        for pool in list(_pools):
            for worker in list(pool._workers):
                proc = worker.proc
                if proc is None:
                    continue
                for stream in (proc.stdin, proc.stdout):
                    if stream is not None:
                        with contextlib.suppress(OSError, ValueError):
                            os.dup2(null, stream.fileno())
    finally:
        os.close(null)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_starting.acquire,
        after_in_parent=_starting.release,
        after_in_child=_forget_default_in_child,
    )

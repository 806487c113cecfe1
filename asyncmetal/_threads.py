"""Blocking calls handed to a worker thread and awaited, on threads that never hold up
the interpreter's exit.

``anyio.to_thread.run_sync`` would do, but on asyncio (and uvloop) anyio's worker
threads are not daemons, and each is told to stop only once the task its loop's run
began with is done. A program whose loop stops with that task still pending -- a
``loop.stop()`` from a signal handler, or aiohttp's ``web.run_app`` left by a third
Ctrl-C while it waits for its cleanup -- then waits at exit for that idle thread for
good, and the loop's signal handlers, still installed, swallow Ctrl-C and SIGTERM:
``open_device`` alone, whose backend opens on such a thread, made the program unable to
exit. asyncmetal's calls run on its own daemon threads instead, each kept for reuse
until it has been idle for ``IDLE_S``. Everything else is as anyio does it: a thread
limiter bounds how many run at once, the function runs in a copy of the caller's
context, and cancelling the caller does not abandon it (the wait is shielded:
asyncio's own ``task.cancel()``, which no scope stops, ends the wait, not the call).
On trio, trio's threads -- daemons already -- run them, through anyio.

The limiter is asyncmetal's own, per loop (``THREADS`` at once), not anyio's default
one: an application's threads that hold all of that one's tokens while they call back
into the loop for an open or a compile (sync code in ``anyio.to_thread.run_sync``,
``anyio.from_thread.run``) would wait for good on calls that wait for a token.

A task whose asyncio loop is closed while it waits here is never collected, nor its
loop: anyio's record of the shielded scope holds the task, keyed weakly by the task.
So it holds any task waiting in an anyio scope, or in anyio.to_thread.run_sync, as
its loop closes. ``undelivered`` is how what the call made is let go of then. (The
limiter's borrower is the call, not its task: its token is held until the call is
over, also where asyncio's ``task.cancel()`` ended the wait.)
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel

T = TypeVar("T")
IDLE_S = 10.0  # a worker idle this long exits (a later call starts another)
NAME = "asyncmetal worker"
THREADS = 40  # asyncmetal's calls on threads at once, per loop (anyio's default's too)
_limiter_of_run: anyio.lowlevel.RunVar[anyio.CapacityLimiter] = anyio.lowlevel.RunVar(
    "asyncmetal_thread_limiter"
)


def limiter() -> anyio.CapacityLimiter:
    """The running loop's limiter of asyncmetal's calls on threads (made at its first)."""
    try:
        return _limiter_of_run.get()
    except LookupError:
        made = anyio.CapacityLimiter(THREADS)
        _limiter_of_run.set(made)
        return made


class _Workers:
    """Idle worker threads, each waiting on its own inbox for its next job."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[Callable[[], None]]] = []

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name=NAME, daemon=True).start()
        inbox.put(job)

    def _serve(self, inbox: queue.SimpleQueue[Callable[[], None]]) -> None:
        while True:
            try:
                job = inbox.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    if any(idle is inbox for idle in self._idle):
                        self._idle = [idle for idle in self._idle if idle is not inbox]
                        return
                continue  # taken as it timed out: its job is on the way
            job()
            del job  # (what it holds is not kept alive by an idle thread)
            with self._lock:
                self._idle.append(inbox)


_workers = _Workers()


def _forked() -> None:
    """A forked child has none of its parent's threads (nor a sane copy of its lock)."""
    global _workers
    _workers = _Workers()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _report(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return  # (the caller stopped waiting: asyncio's own cancellation)
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class _Handover:
    """A call's outcome on its way to the caller, which may never get it: where its
    loop closed before the outcome could be queued there (``drop``), or dropped what
    was queued without running it -- closed (``close`` clears what is ready) or
    stopped for good and collected -- whether the report itself or the caller's wake-up
    that the report queued. Until the caller has resumed (and cleared ``undelivered``)
    those queued callbacks hold this, the caller only weakly: let go of with
    ``undelivered`` still set, it calls it, on whichever thread let go of it. Its run
    on the loop gives back the call's token (``release``): the call is over then,
    whether or not its caller still waits."""

    __slots__ = ("__weakref__", "error", "future", "release", "result", "undelivered")

    def __init__(
        self,
        future: asyncio.Future[Any],
        undelivered: Callable[[], None] | None,
        release: Callable[[], None],
    ) -> None:
        self.future = future
        self.result: Any = None
        self.error: BaseException | None = None
        self.undelivered = undelivered
        self.release = release

    def __call__(self) -> None:
        self.future.add_done_callback(self._held)  # (queued behind the caller's wake-up)
        self.release()
        _report(self.future, self.result, self.error)

    def _held(self, _: asyncio.Future[Any]) -> None:
        """(Holds this until the caller's wake-up has run.)"""

    def drop(self) -> None:
        undelivered, self.undelivered = self.undelivered, None
        if undelivered is not None:
            with contextlib.suppress(Exception):  # (nobody to tell)
                undelivered()

    def __del__(self) -> None:
        self.drop()


async def run_sync(
    fn: Callable[..., T], *args: Any, undelivered: Callable[[], None] | None = None
) -> T:
    """``fn(*args)`` on a worker thread, awaited; its exception is raised here. Where
    its loop closed, or was stopped and let go of, before the caller resumed with the
    outcome, ``undelivered()`` is called: on the worker thread, or the one that closed
    or collected the loop (the caller never resumes to see it)."""
    from ._bridge import require_loop, running_asyncio_loop  # (it imports this module)

    loop = running_asyncio_loop()
    if loop is None:  # trio (a guest run's task too)
        require_loop()  # (or none: asyncmetal's error, not anyio's)
        return await anyio.to_thread.run_sync(fn, *args, limiter=limiter())
    # The token is the call's, not its caller's: held until the call is over (see
    # _Handover), also where asyncio's own ``task.cancel()`` ended the wait before --
    # else every such cancellation would let one more call run on a thread at once.
    tokens = limiter()
    borrower = object()  # (who holds the token: this call)
    await tokens.acquire_on_behalf_of(borrower)
    release = functools.partial(tokens.release_on_behalf_of, borrower)
    submitted = False
    try:
        with anyio.CancelScope(shield=True):
            future: asyncio.Future[T] = loop.create_future()
            context = contextvars.copy_context()

            def job(handover: _Handover) -> None:
                try:
                    handover.result = context.run(fn, *args)
                except BaseException as exc:  # (raised on the caller's side)
                    handover.error = exc
                try:
                    loop.call_soon_threadsafe(handover)
                except RuntimeError:  # its loop closed meanwhile
                    handover.drop()

            handover = _Handover(future, undelivered, release)
            _workers.submit(functools.partial(job, handover))
            submitted = True
            arrived = weakref.ref(handover)
            del handover  # (held by the job, then by the loop's callbacks)
            try:
                result = await future
            finally:
                if (held := arrived()) is not None:
                    held.undelivered = None  # the caller resumed
    finally:
        if not submitted:
            release()
    return result


class Freer(Generic[T]):
    """A thread of its own that releases what ``free`` is given, one after another:
    releasing memory takes time (unmapping pages: about 2.5 ms a GiB touched), and
    frees come from the loop (an eviction, a release) -- never there. Started at the
    first free, stopped by ``stop`` (a backend's close); once stopped (or in a forked
    child, whose thread is the parent's) frees release at once, on the caller's thread.

    Its lock is an RLock: a free may come from the GC, even inside a free on the same
    thread. The thread is started with the lock let go of (``_starting`` meanwhile:
    other frees only queue, a stop waits on ``_started``): a finalizer the GC runs on
    the new thread before it says it started may free, and its start waits for that."""

    def __init__(self, name: str, release: Callable[[T], None]) -> None:
        self.name = name
        self._release = release
        self.frees: queue.SimpleQueue[T | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._lock = threading.RLock()
        self._started = threading.Condition(self._lock)
        self._starting = False

    def free(self, item: T) -> None:
        """Release ``item`` on the thread (here once stopped). Any thread, the GC's too."""
        with self._lock:
            stopped = self._stopped
            if not stopped:
                self.frees.put(item)
                start = self._thread is None and not self._starting
                self._starting |= start
        if stopped:
            self._release(item)
        elif start:
            self._start()

    def _start(self) -> None:
        thread: threading.Thread | None = None
        try:
            thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            thread.start()
        except BaseException:
            thread = None  # (not started: the next free tries again)
            raise
        finally:
            # A KeyboardInterrupt as this waits for the lock (a free on another thread
            # holds it: CPython runs the handler in the wait, and nothing is taken) does
            # not skip what follows: it waits again, and the interrupt is raised once
            # done -- skipped, the thread went unrecorded and ``_starting`` stayed set:
            # later frees only queued, and a stop waited for good.
            interrupt: KeyboardInterrupt | None = None
            entered = False
            while not entered:
                try:
                    with self._lock:  # (no call before the thread is recorded)
                        entered = True
                        self._thread, self._starting = thread, False
                        self._started.notify_all()
                except KeyboardInterrupt as exc:
                    if entered:
                        raise
                    interrupt = exc
            if interrupt is not None:
                raise interrupt

    def _run(self) -> None:
        frees, release = self.frees, self._release
        while (item := frees.get()) is not None:
            release(item)

    def stop(self) -> None:
        """Release what is queued, and stop the thread (waiting for it)."""
        with self._lock:
            self._stopped = True
            while self._starting:  # (a free is starting it, the lock let go of)
                self._started.wait()
            thread, self._thread = self._thread, None
            self.frees.put(None)
        if thread is not None:
            thread.join()
        else:  # none started (or its start failed): what is queued is released here
            self._run()

    def forked(self) -> None:
        """In a forked child: the thread is the parent's; frees release at once."""
        self._lock = threading.RLock()
        self._started = threading.Condition(self._lock)
        self._stopped, self._thread, self._starting = True, None, False
        self.frees = queue.SimpleQueue()

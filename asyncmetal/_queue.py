"""Queue: ordered submission to a device, and the Completion each submission returns."""

from __future__ import annotations

import collections
import inspect
import itertools
import weakref
from collections.abc import Awaitable, Callable, Generator, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, NoReturn, cast

import numpy as np

from . import _allocator, _native, _native_contract
from ._allocator import Allocation, hold_used
from ._backend import Arg, NativeQueue, Record, new_arg
from ._bridge import require_loop
from ._buffer import Buffer, check_buffer, launch_args, native_arg, record_uses, uses
from ._copyargs import copy_operands, fill_operands
from ._device_state import DeviceState, locks_in_order, release_owned, two_names
from ._errors import (
    ArgumentTypeError,
    ClosedResourceError,
    InvalidArgumentError,
    Singular,
    as_int,
    check_bool,
)
from ._program import Program
from ._scalars import Scalar, launch_value
from ._timeline import (
    MADE_BY_DEVICE,
    MAX_VALUE,
    NOT_YET,
    QUEUE_CLOSED,
    QUEUE_DISCARDED,
    Timeline,
    abandon_signals,
    check_timeline,
    discarded_error,
    order_queue_signal,
    queue_closed,
    queue_signal_submitted,
    queue_wait_submitted,
    ready_checkpoint,
    signal_order,
    signal_provider,
    signal_satisfies,
    timeline_device,
    timeline_kind,
    wait_value,
    waits_beyond_signals,
    waits_for,
)

if TYPE_CHECKING:
    from ._device import Device

_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_ONE3 = (1, 1, 1)


class Completion(Record, Singular):
    """One submitted command: the point ``value`` on ``queue.timeline``.

    ``await completion`` resumes once the device has finished the command (a checkpoint;
    cancelling it detaches this waiter only -- the command still runs to its end) and
    raises the command's error if it failed.
    """

    __slots__ = ("queue",)

    def __init__(self, queue: Queue, value: int) -> None:  # hot: Record's fields inline
        # (But Record's _error, which no backend sets: a command's error is its queue's
        # to say, native.failure, read as it is awaited.)
        self.queue = queue
        self.value = value
        self._ring = self._start_ns = self._end_ns = None
        self._row = self._due_ns = 0

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<Completion {self.queue.device.name} value={self.value} {state}>"

    @property
    def timeline(self) -> Timeline:
        """The timeline of the command's queue (``value`` is the command's point on it)."""
        return self.queue._timeline

    def done(self) -> bool:
        """Whether the command is settled: finished, or abandoned by closing the device
        while it waited for a value not produced yet (awaiting it then raises).
        Never blocks."""
        return self.queue._timeline.value >= self.value

    async def wait(self) -> None:
        """Wait for the command to finish; raise its error if it failed."""
        await self

    def add_done_callback(self, *args: object, **kwargs: object) -> NoReturn:
        """(Not an asyncio future: asyncio.wait, which takes only futures from Python
        3.11 on, calls this and is told what to pass it instead.)"""
        raise ArgumentTypeError(
            "a Completion is awaitable, not an asyncio future (asyncio.wait takes only "
            "futures): pass asyncio.ensure_future(completion)"
        )

    def __await__(self) -> Generator[Any, None, None]:
        queue = self.queue
        timeline = queue._timeline
        native = queue._native
        if timeline.native.value >= self.value:  # the fast path: a yield
            yield from ready_checkpoint()
        else:
            native.flush()
            yield from wait_value(timeline, self.value, self._due_ns, True)
        # What the queue kept for it goes now, not at the queue's next submission: a
        # copy's host array (megabytes maybe), a bytearray (which cannot be resized
        # while a view of it is kept).
        keep = native._keep
        if keep is not None and keep.items:
            keep.let_go()
        if queue._sync_ops:  # (so do its records of the device waits it passed)
            queue._forget_reached(self.value)
        failure = (  # (the common case without Queue._failure's frame)
            native.failure(self.value)
            if queue._abandoned_from is None
            else queue._failure(self.value)
        )
        if failure is not None:
            try:
                raise failure
            finally:
                # (Kept here, the error would hold this frame through its traceback and
                # the frame the error: a reference cycle, left to the cycle collector.)
                failure = None

    @property
    def start_time(self) -> float | None:
        """Device start time in seconds (backend clock), once done, where measured.

        The cpu device keeps the times of a queue's last 4096 commands, and has none for
        a command that never ran."""
        times = self._times() if self.done() else None
        return None if times is None else times[0] / 1e9

    @property
    def end_time(self) -> float | None:
        """Device end time in seconds (backend clock), once done, where measured."""
        times = self._times() if self.done() else None
        return None if times is None else times[1] / 1e9


def _size3(size: object, what: str) -> tuple[int, int, int]:
    # A size is 32 bits on every backend that reads one: a cuda grid's and block's
    # dimensions are, and Metal's gets no GPU past them; cut to its low bits in the
    # backend's structure, a larger one would run another number of threads (none, for
    # 2**64) with nothing said. numpy integers are sizes, as elsewhere (as_int).
    # A str or bytes is a sequence too, of characters: no size either.
    given = size
    if as_int(size) is not None:
        size = (size,)
    dims = []
    if isinstance(size, Sequence) and not isinstance(size, (str, bytes)) and 1 <= len(size) <= 3:
        dims = [as_int(d) for d in [*size, 1, 1][:3]]
    if not dims or None in dims:
        raise ArgumentTypeError(f"{what} must be an int or a tuple of 1 to 3 ints, got {given!r}")
    ints = cast("list[int]", dims)  # (None refused above)
    for d in ints:
        if d < 1:
            raise InvalidArgumentError(f"{what} must hold ints >= 1, got {given!r}")
        if d >= 1 << 32:
            raise InvalidArgumentError(f"{what} must hold ints in [1, 2**32), got {given!r}")
    return ints[0], ints[1], ints[2]


_extension_launches: dict[type, Callable[..., Completion | None] | None] = {}


def _extension_launch(device_type: type) -> Callable[..., Completion | None] | None:
    """The native extension's ``launch`` (Queue.launch's common case in C), told which
    classes it recognizes, after checking what it reads of them (declared in
    _native_contract) -- once per device class; None without the extension."""
    if device_type in _extension_launches:
        return _extension_launches[device_type]
    extension = _native.extension()
    if extension is None:
        _extension_launches[device_type] = None
        return None
    classes = {
        "Queue": Queue,
        "Device": device_type,
        "DeviceState": DeviceState,
        "Program": Program,
        "Buffer": Buffer,
        "Allocation": Allocation,
        "Completion": Completion,
        "Arg": Arg,
        "Scalar": Scalar,
    }
    _native_contract.setup(extension, classes, _ONE3)
    launch: Callable[..., Completion | None] = extension.launch
    _extension_launches[device_type] = launch
    return launch


class _SignalCompletion(Completion):
    """A queue's ``signal``: done also once the timeline it signals reached its value. A
    queue raises that timeline before its own, so a command of another queue that
    waited for the signal can finish, and be awaited, before the signal's own value
    lands: it must show done then too (what a command came after has finished)."""

    __slots__ = ("signalled", "target")

    def __init__(self, queue: Queue, value: int, signalled: Timeline, target: int) -> None:
        super().__init__(queue, value)
        self.signalled, self.target = signalled, target

    def done(self) -> bool:
        if self.queue._timeline.value >= self.value:
            return True
        reached = self.signalled.value
        # At 2**64 - 1 the timeline may have settled as another signal of it failed:
        # that says nothing of this one, done only once its queue passes it.
        return reached >= self.target and (
            reached != MAX_VALUE or self.signalled._failure(self.target) is None
        )


def _value_among_buffers(buffers: Sequence[object]) -> str:
    """What a launch's count error adds where a value was passed as a buffer
    (``q.launch(k, buf, 4)`` for ``vals=(4,)``)."""
    for i, arg in enumerate(buffers):
        if isinstance(arg, np.generic):
            kind = f"a numpy {arg.dtype}"
        elif isinstance(arg, (int, float)):
            kind = "an int" if type(arg) is int else f"a {type(arg).__name__}"
        else:
            continue
        return (
            f" (buffer {i} is {kind}: values go in vals=(...), buffers are launch's "
            "positional arguments)"
        )
    return ""


class Queue(Singular):
    """An ordered stream of device commands with its own timeline (values from 1).
    Made by ``device.new_queue()`` (``device.queue`` is the default one).

    Every method submits at once and returns a :class:`Completion`; nothing blocks.
    Arguments are checked before anything is submitted. ``timeline`` is the queue's
    own :class:`Timeline` (each command's completion is a value on it), and
    ``device`` its :class:`Device`.
    """

    def __init__(
        self,
        state: DeviceState,
        *,
        _made: object = None,
        _stream: object = None,
        _closer: Callable[[Queue, bool], Awaitable[None]] | None = None,
        _keeper: Callable[[Queue], None] | None = None,
        _making: list[Queue] | None = None,
    ) -> None:
        if _made is not MADE_BY_DEVICE:
            raise ArgumentTypeError("queues come from their device: device.new_queue()")
        if _making is not None:
            # Its maker's before anything native is made: where a KeyboardInterrupt
            # stops the making from here on, the maker releases what was made.
            _making.append(self)
        self._state = state
        # (Read-only to users, as properties: its commands' values are on this one, and
        # its launches check their program and buffers against its device. The launch
        # paths, native and Python, read the fields: _native_contract.NAMES.)
        self._device: Device = state.device
        self._timeline = Timeline(state, owned=True, _made=MADE_BY_DEVICE)
        backend, timeline = state.backend, self._timeline.native
        self._native: NativeQueue = (
            backend.new_queue(timeline)
            if _stream is None
            else backend.adopt_queue(timeline, _stream)
        )
        self._timeline._queue = weakref.ref(self)
        self._submitted = 0
        # Device-side signals and waits not yet known complete: (value, is_wait, tl, target)
        self._sync_ops: collections.deque[tuple[int, bool, Timeline, int]] = collections.deque()
        # What its commands are ordered after through the ordering waits of after(),
        # copies and fills for queues of its device (see _ordered_after), not yet known
        # complete: (value, stamp, clock), clock: timeline -> value done before command
        # ``value`` runs, stamp: when it was made. Appended and read under its device's
        # submission lock.
        self._clocks: collections.deque[tuple[int, int, dict[Timeline, int]]] = collections.deque()
        self._abandoned_from: int | None = None  # commands from here on never ran
        # Up to which command its failures were reported by its device's synchronize():
        # that raises each once (see Device.synchronize).
        self._reported = 0
        # Closed with discard=True (by whom: _timeline.QUEUE_DISCARDED, or its device's
        # close): what had not started never ran.
        self._discarded: str | None = None
        # Set by its device's close once it decided what can still complete: no command
        # past it (or past what ran by the time the queue stopped) will.
        self._final: int | None = None
        # Once closed: why it refuses commands (see close). Its device closes it.
        self._closed: str | None = None
        self._closer = _closer
        # Let go of by its device while it had nothing in flight (see let_go): the
        # next submission has the device keep it again first (``_keeper``).
        self._idle = False
        self._keeper = _keeper
        # What was submitted when its device's reaper last looked: one submitted to
        # since is in use, and not let go of then (see Device._look).
        self._looked_at = -1
        # Common launches submitted by the native extension in one call (py_launch.c).
        self._launch_target = self._native.launch_target()
        self._fast_launch = (
            None if self._launch_target is None else _extension_launch(type(state.device))
        )

    def __repr__(self) -> str:
        return f"<Queue of {self._state.name} submitted={self._submitted}>"

    @property
    def device(self) -> Device:
        """The :class:`Device` it runs on."""
        return self._device

    @property
    def timeline(self) -> Timeline:
        """Its own :class:`Timeline`: each command's completion is a value on it."""
        return self._timeline

    def _failure(self, value: int) -> BaseException | None:
        """The error of the command at ``value``, done: it failed (a device fault, a
        device-side wait for a value never produced), or was abandoned by the device's
        close. None if it ran."""
        abandoned = self._abandoned_from
        if abandoned is not None and value >= abandoned:  # (whatever it waited for)
            if self._discarded:
                return discarded_error(value, self._discarded)  # (stopped as discarded)
            which = "its default queue" if self._closer is None else "a queue"
            return ClosedResourceError(
                f"the device {self.device.name} was closed while command {abandoned} of "
                f"{which} (this command's) waited on the device for a timeline value not "
                f"produced yet ({NOT_YET}): commands of that queue from there on never ran"
            )
        return self._native.failure(value)

    def _fails_later(self) -> bool:
        """Whether every command submitted to it from now on fails (a device wait of it
        ended on a value never produced: ``NativeQueue.fails_later``)."""
        return self._native.fails_later()

    @property
    def handle(self) -> int | None:
        """The native stream under this queue (a ``CUstream`` address on cuda), for other
        libraries (``torch.cuda.ExternalStream(q.handle)``); None where there is none."""
        self._check_open()
        return self._native.handle

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (or its device is closed)."""
        return self._closed is not None or self._state.closed

    def _check_open(self) -> None:
        self._state.check_open()
        if self._closed is not None:
            raise ClosedResourceError(self._closed)

    async def close(self, *, discard: bool = False) -> None:
        """Let the commands submitted to this queue finish, then release what it holds
        natively (a cpu queue's thread; a cuda stream -- an adopted one only on
        asyncmetal's side, the stream stays its owner's -- its completion thread, events
        and staging chunks; a Metal command queue). From the call on, submitting to the
        queue raises ClosedResourceError; its timeline stays valid, and so do the
        completions it returned, but a wait on the timeline for more than its last
        command is refused from then on, and one made before ends failed once the queue
        is released (ClosedResourceError: nothing will raise it that far). Closing it
        again, or once its device closed, does nothing; closing it while its device
        closes returns once the device's close has ended (that close finishes the
        queue's commands and releases it). ``async with device.new_queue() as q:``
        closes it on exit. The default queue (``device.queue``) closes with its device
        only.

        Waiting for its commands is a checkpoint (a device-side wait may wait for a value
        signalled later): cancelling it leaves the queue closed, and once its commands
        ran it is released soon after by the device's reaper thread, a later close() or
        the device's close. The release itself, once begun, runs to its end whatever
        cancels the caller. Waiting for the device's close is a checkpoint too: that
        close goes on.

        ``discard=True`` drops the commands that have not started instead of waiting for
        them: what runs on the device now finishes (a GPU stream's commands already
        handed to the driver -- at most a bound per stream, device waits among them --
        run), a device-side wait held on the host ends (on cpu, any: its queue thread
        waits on the host), and every command dropped raises ClosedResourceError,
        saying it was discarded, where it is awaited; a timeline it was to signal
        fails, so waits for that value end failed rather than wait for good. Buffers
        those commands used go back to the allocator once no running command uses
        them. A queue already closing is switched to discarding (also while its device
        closes). A GPU stream waiting, on the device, for a value nobody signalled yet
        does not hold it: it returns once what can still complete has, and what the
        driver was given behind that wait stays with it -- run if the value comes (the
        queue is then released), else ended by the device's close (ClosedResourceError,
        discarded)."""
        check_bool(discard, "discard")
        if self._closer is None:
            raise self._not_closable()
        require_loop()  # (before the queue is marked closed)
        await self._closer(self, discard)

    def _not_closable(self) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"the default queue of {self._state.name} (device.queue) is closed by "
            "closing its device; close queues from device.new_queue() instead"
        )

    async def __aenter__(self) -> Queue:
        if self._closer is None:  # refused before the body runs, not at its end
            raise self._not_closable()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def submitted(self) -> int:
        """The timeline value of the last command submitted (0 if none)."""
        return self._submitted

    def _submit(
        self,
        fn: Callable[..., None],
        *before: Any,
        after: tuple[Any, ...] = (),
        uses: Iterable[Buffer] = (),
        names: Sequence[str] = (),
        then: Callable[[int], None] | None = None,
        again: bool = False,
        record: Callable[[Queue, int], Completion] = Completion,
    ) -> Completion:
        """Number the next command and hand it to the backend, ``fn(*before, value,
        completion, *after)``, then record it as the last use of ``uses`` (``names``:
        what each is to the caller, for errors; "buffer" past them) and call ``then(value)``
        (the caller's own record of it); return its Completion (a ``record``). If the
        backend refuses it, its value was never used: it is taken back. Under the
        device's submission lock, which a close takes to seal the device: a command
        submitted from another
        thread is either numbered and handed over before the close counts what to wait
        for, or refused as the device is closed (never numbered and left unsubmitted);
        and commands other threads submit to the queue are numbered, handed over and
        recorded in one order (the native launch path defers to it: see
        DeviceState.busy).

        A KeyboardInterrupt on the way (trio raises Ctrl-C in whatever code its task
        runs) leaves nothing half done: see ``_interrupted``; ``again``: the command
        may be handed over twice (a device wait, a signal: the second does nothing)."""
        state = self._state
        # Refused before the lock too: in a forked child (whose devices are all closed)
        # the lock may be one a parent thread held at the fork.
        self._check_open()
        with state.submitting:
            self._check_open()
            if self._idle:
                self._kept()
            for i, buf in enumerate(uses):  # freed, or its device closed, on another thread
                check_buffer(buf, names[i] if i < len(names) else "buffer")  # since checked
            state.busy += 1  # (see DeviceState.busy)
            # How far it got: 1 once its value is taken (the backend may have the
            # command), 2 once the backend returned. (Plain stores: no interrupt is
            # delivered between them and the step before.)
            stage = 0
            try:
                value = self._submitted + 1
                done = record(self, value)
                self._submitted = value
                stage = 1
                fn(*before, value, done, *after)
                stage = 2
                record_uses(uses, self, value)
                if then is not None:
                    then(value)
            except KeyboardInterrupt:
                if stage:
                    self._interrupted(stage == 1, fn, before, value, done, after, uses, then, again)
                raise
            except BaseException:
                if stage == 1:  # refused by the backend
                    self._submitted = value - 1
                raise
            finally:
                state.busy -= 1
        return done

    def _interrupted(
        self,
        handing: bool,
        fn: Callable[..., None],
        before: tuple[Any, ...],
        value: int,
        done: Completion,
        after: tuple[Any, ...],
        uses: Iterable[Buffer],
        then: Callable[[int], None] | None,
        again: bool,
    ) -> None:
        """Command ``value`` was interrupted (a KeyboardInterrupt) as it was handed over
        (``handing``: the backend may or may not have it) or recorded. Its value is kept,
        and the command made whole: taken back, a command the backend has would share
        its value with the next (whose completion would then report it done once this
        one is); left unsubmitted, its value would never be reached (a close would wait
        for it for good); unrecorded, a close would not count its wait or signal. So a
        command that may be handed over twice (``again``) is handed over again; any
        other gets a device wait for what is reached already as its value, after it,
        and keeps its arguments until then. Then it is recorded, from where it was."""
        if handing:
            if again:
                fn(*before, value, done, *after)
            else:
                keep = self._native._keep
                kept = None if keep is None else keep.get(value)
                self._native.wait(self._timeline.native, 0, value, done)
                if keep is not None:
                    keep.add(value, (kept, before, after))
        record_uses(uses, self, value)
        if then is not None:
            then(value)

    def _kept(self) -> None:
        """Kept by its device again (submission lock held), before a command is handed
        over: a queue with commands in flight is never let go of."""
        assert self._keeper is not None
        self._keeper(self)
        self._idle = False
        self._fast_launch = (
            None if self._launch_target is None else _extension_launch(type(self._state.device))
        )

    def marker(self) -> Completion:
        """A Completion for everything submitted to this queue so far: awaiting it
        resumes once all of it has finished (a checkpoint; cancelling detaches this
        waiter only). On cuda it is a command of its own, an event recorded on the
        stream now: on a queue over an adopted stream (``device.adopt_stream``) it also
        covers what other libraries submitted to that stream before this call."""
        if not self._native.markers:
            self._check_open()
            return Completion(self, self._submitted)
        return self._submit(self._native.marker)

    def _after_stream(self, stream: object) -> Completion:
        """A command done once what another library submitted to ``stream`` until now
        is done, and which this queue's later commands come after, on the device: an
        event recorded on that stream now, waited for in this queue's order. The stream
        is not adopted (nothing watches it afterwards). Where the backend has no such
        streams (``markers`` unset), a ``ValueError``-type refusal."""
        if not self._native.markers:
            raise InvalidArgumentError(f"{self.device.name} has no streams of other libraries")
        # (its context: checked natively)
        handle = self._state.backend.stream_handle(stream, "import")
        return self._submit(self._native.wait_stream, handle)

    def launch(
        self,
        program: Program,
        *buffers: Buffer,
        global_size: int | Sequence[int] = _ONE3,
        local_size: int | Sequence[int] = _ONE3,
        vals: Sequence[int | float | np.generic] = (),
    ) -> Completion:
        """Run ``program`` with ``buffers`` (its pointer parameters, in order) and
        ``vals`` (its value parameters, in order).

        Each value is passed as its parameter's type, read from the kernel's source: a
        Python int must fit it (an int32 where the type is not known), a Python float
        takes a floating-point parameter's type, and a numpy scalar (``np.float32``,
        ``np.int64``, ``np.uint32``...) keeps its own type -- an integer's value must
        fit an integer parameter, a float may widen to a float parameter, not narrow.
        Anything else (a float for an integer, a Python float where the type is not
        known) is refused. Every argument is checked before anything is submitted.

        ``global_size`` and ``local_size`` (an int, or one per dimension, up to three)
        are, on cuda and Metal, the threads per dimension and the block (threadgroup):
        the grid is ``ceil(global / local)``. A block of more threads than the kernel
        takes, and on cuda a block or a grid beyond the device's limits, raises
        InvalidArgumentError, nothing submitted (README, "Devices"). A cpu kernel is
        called once per launch and loops over its own range: they are not used there. A
        launch is not ordered after other queues' commands on its buffers:
        ``q.after(buf).launch(...)`` is.
        """
        fast = self._fast_launch
        if fast is not None:  # the common case, in C; None: not that case, see below
            submitted: Completion | None = fast(
                self, self._launch_target, program, buffers, vals, global_size, local_size
            )
            if submitted is not None:
                if _allocator.letting_go:  # (its uses recorded in C: see record_uses)
                    hold_used([buf._allocation for buf in buffers])
                return submitted
        args = self._launch_args(program, buffers, vals)
        gsize = _ONE3 if global_size is _ONE3 else _size3(global_size, "global_size")
        lsize = _ONE3 if local_size is _ONE3 else _size3(local_size, "local_size")
        return self._submit(self._native.launch, program._native, args, gsize, lsize, uses=buffers)

    def _launch_args(
        self, program: Program, buffers: Sequence[Buffer], vals: Sequence[Any]
    ) -> list[Arg]:
        # The hot path of every launch: identity checks first, messages only on failure.
        if program.__class__ is not Program:
            raise ArgumentTypeError(
                f"program must be a Program, got {type(program).__name__}"
                + (" (did you forget to await compile?)" if inspect.isawaitable(program) else "")
            )
        if program._device is not self._device:
            compiled_for, this = two_names(program._state, self._state)
            raise InvalidArgumentError(
                f"program {program.name!r} was compiled for {compiled_for}, not {this}"
            )
        if vals.__class__ is not tuple:
            if isinstance(vals, np.ndarray) and vals.ndim == 1 and vals.dtype.kind in "iuf":
                vals = list(vals)  # numpy scalars, each of the array's type
            elif isinstance(vals, (str, bytes)) or not isinstance(vals, Sequence):
                raise ArgumentTypeError(f"vals must be a sequence of numbers, got {vals!r}")
        if len(buffers) != program._buffer_count:
            misplaced = [i for i, v in enumerate(vals) if isinstance(v, Buffer)]
            raise ArgumentTypeError(
                f"kernel {program.name!r} takes {program.buffer_count} buffer"
                f"{'' if program.buffer_count == 1 else 's'}, got {len(buffers)}"
                + (
                    f" (vals[{misplaced[0]}] is a Buffer: buffers are launch's positional "
                    "arguments, vals= its values)"
                    if misplaced
                    else _value_among_buffers(buffers)
                )
            )
        if len(vals) != program._value_count:
            raise ArgumentTypeError(
                f"kernel {program.name!r} takes {program.value_count} "
                f"value{'' if program.value_count == 1 else 's'} (vals), got {len(vals)}"
                + _value_among_buffers(buffers)
            )
        name = program._name  # (the properties' fields: this is each launch's path)
        args = launch_args(buffers, name, self._state)
        append = args.append
        types = program._value_types
        for i, v in enumerate(vals):
            declared, param = types[i]
            if v.__class__ is not int or (declared is not None and declared != "int32"):
                v = launch_value(v, declared, f"vals[{i}] of {name!r}", param)
            elif not _INT32_MIN <= v <= _INT32_MAX:
                raise InvalidArgumentError(f"vals[{i}] of {name!r} must fit in int32: {v}")
            append(new_arg(Arg, (None, 0, v)))
        order = program._order
        return args if order is None else [args[i] for i in order]

    def signal(self, timeline: Timeline, value: int) -> Completion:
        """Raise ``timeline`` to ``value`` once every earlier command has finished.

        Signals of a timeline take effect in the order submitted: where another queue's
        signal of it has not run yet, this queue first waits for that one (on the
        device), and the host may not signal a timeline while a queue's signal of it
        is pending. A signal that could never run is refused (``InvalidArgumentError``,
        nothing submitted): one that comes after a command that comes after it (through
        the device waits commands satisfy), and one that comes after a device wait for
        more of a timeline than its signals reach while a pending signal of that
        timeline -- this one, or another that would come after this one -- must run
        before anything can raise it that far. The error names the wait and the chain of
        commands.
        """
        self._check_open()
        timeline = check_timeline(timeline, "timeline", self._state.kind)
        self._check_open()  # (before the lock: see _submit)
        # Recorded with it, for a close's count (as wait); checked, submitted and
        # recorded in one step that other threads' signals of the timeline (the host's,
        # other queues' of any device) come before or after.
        with self._state.submitting, signal_order():
            value, earlier = order_queue_signal(timeline, value, self._timeline)
            beyond = waits_beyond_signals(timeline)
            if beyond:  # a device wait for more than the signals so far: this one's to reach
                deadlock = _self_wait(self, timeline, beyond, value, earlier)
                if deadlock is not None:
                    raise InvalidArgumentError(deadlock)
            if earlier:  # another queue's signal of it, not run yet: that one first
                self._wait(timeline, earlier, True)

            def then(at: int) -> None:
                queue_signal_submitted(timeline, self._timeline, at, value)
                self._track(at, False, timeline, value)

            done = self._submit(
                self._native.signal,
                timeline.native,
                value,
                then=then,
                again=True,
                record=lambda queue, at: _SignalCompletion(queue, at, timeline, value),
            )
        return done

    def wait(self, timeline: Timeline, value: int) -> Completion:
        """Hold every later command until ``timeline`` reaches ``value``.

        The wait happens on the device; it may be submitted before anyone signals
        ``value``. No host thread blocks.
        """
        timeline = check_timeline(timeline, "timeline", self._state.kind)
        value = timeline._check_device_value(value, "value")
        if timeline is self._timeline and value > self._submitted:
            raise InvalidArgumentError(
                f"a queue cannot wait for its own value {value}: its commands so far reach "
                f"{self._submitted}, and later ones would run only after this wait"
            )
        last = timeline._last
        if last is not None and value > last:
            raise ClosedResourceError(
                f"timeline will not reach {value}: it is a queue's own timeline, and that "
                f"queue was {timeline._queue_end()}"
            )
        return self._wait(timeline, value, False)

    def _wait(
        self, timeline: Timeline, value: int, ordering: bool, orders: Queue | None = None
    ) -> Completion:
        """``wait`` of checked arguments; ``ordering``: it orders this queue's signal of
        ``timeline`` after another queue's (``signal``); ``orders``: the queue of this
        device whose own timeline it is, waited for by ``_after`` (its clock is noted:
        see ``_ordered_after``)."""
        # Recorded as a device wait with the command, under the lock a close counts
        # under (Device._finish_completable): counted in between, it would seem to be
        # one that completes, and the close would wait for it for good.
        self._check_open()  # (before the lock: see _submit)
        with self._state.submitting:

            def then(at: int) -> None:
                self._track(at, True, timeline, value)
                queue_wait_submitted(timeline, self, at, value, ordering)
                if orders is not None:
                    self._note_clock(at, orders, value)

            done = self._submit(self._native.wait, timeline.native, value, then=then, again=True)
        return done

    def _note_clock(self, at: int, other: Queue, target: int) -> None:
        """Command ``at`` is a device wait for ``other`` (a queue of this device) to
        reach ``target``, a value it had submitted: note what this queue's commands from
        ``at`` on come after -- what they came after before, ``other``'s ``target`` and
        what that came after (submission lock held)."""
        clocks = self._clocks
        if clocks:
            reached = self._timeline.native.value
            while clocks and clocks[0][0] <= reached:
                clocks.popleft()
        # (What is known done already is left out: the clocks stay as small as what is
        # in flight.)
        clock = {tl: v for tl, v in clocks[-1][2].items() if tl.native.value < v} if clocks else {}
        theirs = other._clocks
        if theirs:
            entry = theirs[-1] if theirs[-1][0] <= target else _clock_at(other, target)
            if entry is not None:
                for tl, v in entry[2].items():
                    if v > clock.get(tl, 0) and tl.native.value < v:
                        clock[tl] = v
        if target > clock.get(other._timeline, 0):
            clock[other._timeline] = target
        clock.pop(self._timeline, None)  # (its own commands come in order anyway)
        clocks.append((at, next(_clock_stamps), clock))

    def _forget_reached(self, reached: int | None = None, held: bool = False) -> None:
        """Drop the records of device waits and signals (``_sync_ops``) and the clocks
        (``_clocks``) of the commands this queue has reached (``reached``: a value its
        timeline is known to have reached; else read): done, they no longer matter (what
        a clock says came before its wait is done too once the wait ran), and kept they
        would keep other queues' timelines alive -- and through each, its device, a
        closed one too -- in a queue left idle, until its next wait or signal. Made
        where its commands are seen done: an await of one of its completions, its
        synchronize (where a task resumed: it holds no submission lock), its device
        letting go of it idle (``held``: the submission lock held). Never waits for the
        submission lock: held elsewhere, the records go at the next of these."""
        ops = self._sync_ops
        if reached is None:
            reached = self._timeline.native.value
        try:  # (read without the lock: another thread may drop them meanwhile)
            if ops[0][0] > reached:
                return  # (the common case in a stream of commands: nothing to drop yet)
        except IndexError:
            return  # (none: no clock either, each is of a wait recorded there)
        if self._native.fails_later():
            # A wait of it ended failed: its commands' errors name the timeline that
            # wait was for, and that timeline's device, found while it lives (kept
            # here, as before; its next wait or signal drops them).
            return
        if held:
            self._drop_reached(reached)
            return
        lock = self._state.submitting
        try:
            if not lock.acquire(False):  # (positional: the keyword takes longer to parse)
                return
            try:
                self._drop_reached(reached)
            finally:
                lock.release()
        except BaseException:
            # (an interrupt right after the acquire, before the try that lets it go: a
            # task resumed holds no submission lock, so one this thread holds here is
            # this acquire's)
            release_owned([self._state])
            raise

    def _drop_reached(self, reached: int) -> None:
        """``_forget_reached``'s drop, up to ``reached`` (submission lock held)."""
        ops, clocks = self._sync_ops, self._clocks
        while ops and ops[0][0] <= reached:
            ops.popleft()
        while clocks and clocks[0][0] <= reached:
            clocks.popleft()

    def _track(self, value: int, is_wait: bool, timeline: Timeline, target: int) -> None:
        ops = self._sync_ops
        reached = self._timeline.value
        while ops and ops[0][0] <= reached:
            ops.popleft()
        ops.append((value, is_wait, timeline, target))

    def copy(self, dst: Any, src: Any, nbytes: int | None = None) -> Completion:
        """Submit a copy of ``nbytes`` (default: all of ``src``) and return its Completion.

        ``dst`` and ``src`` are Buffers or host objects supporting the buffer protocol
        (numpy arrays, bytes, ...). A host source is not staged: it is kept alive, and it
        must not be changed until the completion is done. A host destination is filled
        when the completion is done.

        One Buffer is this queue's device's; the other may be of another device of its
        kind (``src``), or of another kind whose memory the host sees (cpu, npy, Metal),
        which this queue then reads or writes in place (a host memcpy on a host queue).
        Either way the copy is ordered, on the device, after the earlier commands of
        other queues that used either buffer, and their later copies after it; a
        buffer of another kind in use by a command this queue cannot wait for is
        refused (``asyncmetal.copy`` waits for it on the host), as is a buffer of a
        kind the host cannot see (``asyncmetal.copy`` stages it through host memory).
        """
        return self._copy(dst, src, nbytes)

    def _copy(
        self, dst: Any, src: Any, nbytes: int | None, in_place: tuple[Buffer, ...] = ()
    ) -> Completion:
        """``copy``; ``in_place``: buffers of another kind of device whose memory is the
        host operand (see ``copy_in_place``)."""
        self._check_open()
        operands = copy_operands(self._state, dst, src, nbytes)
        hook = getattr(self._native, operands.hook)
        used = (*operands.buffers, *in_place)
        with self._records_held(used):  # (the uses read and its own recorded: see _after)
            self._after(used, operands.names, operands.across)
            return self._submit(
                hook, *operands.args, after=operands.extra, uses=used, names=operands.names
            )

    def _records_held(self, buffers: Sequence[Buffer]) -> AbstractContextManager[object]:
        """The submission locks under which a command that orders itself after the uses
        of ``buffers`` reads them and records its own: its device's, and that of each
        device whose record of uses one of them shares (``Block.keeper``: a buffer of
        another device, memory another device's buffer lent out, a buffer of another
        kind read or written in place). Every command that orders itself after a
        record's uses holds its keeper's lock: two of them on two devices, submitted at
        once, are ordered one after the other, never each missing the other's use.
        Several are taken in one order (``locks_in_order``), so two never deadlock."""
        state = self._state
        for buf in buffers:
            if buf._allocation.block.keeper is not state:
                return locks_in_order({state, *(b._allocation.block.keeper for b in buffers)})
        return state.submitting  # (the common case: every buffer its device's own)

    def fill(
        self, buf: Buffer, value: Any, *, offset: int = 0, size: int | None = None
    ) -> Completion:
        """Submit a fill of ``size`` bytes of ``buf`` from ``offset`` (default: all of it)
        with ``value``, and return its Completion (a memset on the device: no host array
        is copied).

        ``value`` is a byte (an int from 0 to 255), or a numpy scalar of 2 or 4 bytes
        whose bits are repeated (``np.uint16(7)``, ``np.uint32(0xDEADBEEF)``,
        ``np.float32(1.0)``), and then ``offset`` and ``size`` are multiples of its size.
        Like a copy into ``buf``, it is ordered after earlier commands on other queues
        that used ``buf`` (on the device), and later copies and frees are ordered after
        it. Metal fills bytes only: a wider pattern must be one byte repeated, and the
        range whole 4-byte words. Every argument is checked before anything is submitted.
        """
        self._check_open()
        operands = fill_operands(self._state, buf, value, offset, size)
        return self._fill(buf, operands.offset, operands.nbytes, operands.pattern, operands.size)

    def _fill(self, buf: Buffer, offset: int, nbytes: int, pattern: int, size: int) -> Completion:
        """``fill`` of checked arguments (``nbytes`` may reach into the rest of the
        buffer's block: see ``fill_zeros``)."""
        arg = native_arg(buf)
        arg = new_arg(Arg, (arg.handle, arg.offset + offset, None))
        with self._records_held((buf,)):  # (see _copy)
            self._after((buf,))
            return self._submit(self._native.fill, arg, nbytes, pattern, size, uses=(buf,))

    def after(self, *buffers: Buffer) -> Queue:
        """Order this queue's next commands after every command submitted so far on
        other queues that used ``buffers`` (device-side waits; no host thread blocks).

        Copies do this by themselves; launches do not (queues run independently unless
        ordered), so ``q.after(buf).launch(k, buf)`` is how a launch on one queue sees a
        copy or launch submitted on another. A copy of another kind of device that read
        or wrote ``buf`` in place (``asyncmetal.copy`` between kinds) is waited for too
        where this device's queues can wait for that kind's (cpu and npy queues wait for
        any kind's; Metal and cuda queues for cpu and npy queues', held on the host).
        A use already waited for is not waited for again: one of a queue of this
        device that this queue waited for before (by after(), a copy or a fill), or
        that another use it waits for came after (README, "Ordering between queues").
        Returns the queue.
        """
        self._check_open()
        for buf in buffers:
            if not isinstance(buf, Buffer):
                raise ArgumentTypeError(f"after() takes Buffers, got {type(buf).__name__}")
            check_buffer(buf, "buffer")
        self._after(buffers)
        return self

    def _after(
        self, buffers: Sequence[Buffer], names: Sequence[str] = (), across: bool = False
    ) -> None:
        """after() for buffers already checked (``names``: what each is to the caller,
        for errors; "buffer" past them). A use by a queue of another kind (a copy
        between kinds reading or writing host-visible memory in place) is waited for
        too where this device's queues can wait on that queue's timeline
        (``Backend.waits_for``); elsewhere it cannot be waited for on this
        device (the copy settles the buffer on the host first; commands after it are
        not ordered with it). A use by a queue of a device closed since (on another
        thread) cannot be either: refused, naming that device rather than its queue's
        timeline. ``across``: a copy that reads or writes a buffer of another kind in
        place (``Queue.copy`` of two buffers of two kinds) is refused, before anything
        is submitted, where that buffer has a use it cannot wait for
        (``asyncmetal.copy`` waits for those on the host). A copy or fill reads the
        uses and records its own under the submission locks of its device and of each
        device whose record it reads, in one hold (``_records_held``): two of them,
        submitted at once on two threads -- on two queues of one device, or on two
        devices -- are ordered one after the other, never each missing the other's
        use."""
        state = self._state
        kind = state.kind
        for i, buf in enumerate(buffers if across else ()):  # (before any wait is submitted)
            for other, value in uses(buf):
                timeline = other.timeline
                if (
                    buf._state.kind != kind
                    and timeline.value < value
                    and timeline_kind(timeline) != kind
                    and not state.backend.waits_for(timeline.native)
                ):
                    raise _not_waited_for(self, names[i], timeline)
        pending: dict[Queue, tuple[int, int]] = {}  # queue -> (its last use, which buffer)
        for i, buf in enumerate(buffers):
            for user, value in uses(buf):
                timeline = user.timeline
                if user is self or timeline.value >= value:
                    continue
                if timeline_kind(timeline) != kind and not state.backend.waits_for(timeline.native):
                    continue
                if value > pending.get(user, (0, 0))[0]:  # type: ignore[call-overload]
                    pending[user] = (value, i)  # type: ignore[index]  # (Queues: last_use)
        if len(pending) == 1:  # (the common case: waited for already, or not)
            ((other, (value, i)),) = pending.items()
            clocks = self._clocks
            try:  # (its last clock, read whole: each is made, then appended)
                if clocks and clocks[-1][2].get(other._timeline, 0) >= value:
                    return
            except IndexError:  # (none, or being let go of on another thread)
                pass
        elif not pending:
            return
        else:
            pending = self._ordered_after(pending)
        # (Clocks are noted only where a wait stands for what came before it on the way:
        # Backend.waits_imply_order. Without any, nothing is left out.)
        clocked = state.backend.waits_imply_order
        for other, (value, i) in pending.items():
            timeline = other.timeline
            try:
                check_timeline(timeline, "timeline", timeline_kind(timeline))
                orders = other if clocked and other._state is state else None
                self._wait(timeline, value, False, orders)
            except ClosedResourceError:
                closed = timeline_device(timeline)
                if not closed.closed:
                    raise  # (this queue's own device)
                what = names[i] if i < len(names) else "buffer"
                raise ClosedResourceError(
                    f"{what} is used by commands of {closed.name} that had not "
                    f"finished when {closed.name} closed: this command cannot be "
                    "ordered after them"
                ) from None

    def _ordered_after(self, pending: dict[Queue, tuple[int, int]]) -> dict[Queue, tuple[int, int]]:
        """Of ``pending`` (queue -> the value of its last use not known done, and
        which buffer), the uses this queue's next command must wait for: each but those
        already waited for -- by one of this queue's earlier ordering waits, or by
        another queue before the use of it that this queue waits for, or by a queue
        that one waited for before, and so on (``_clocks``). Only queues of this
        device are left out so, and only through the waits of after(), copies and
        fills, each for a value submitted before it: a chain of them goes back in
        submission order, so no use is left out for one that comes after it. A
        failure on the way fails what waited for it, down to this queue's next
        command, as a wait of its own would (README, "What runs behind a failed
        cross-queue wait"); a buffer is still freed after every use recorded."""
        state = self._state
        with state.submitting:  # (every clock read is of this device: see _clocks)
            own = self._clocks
            known = dict(own[-1][2]) if own else {}
            # Latest first: a use another one's clock covers was made before it.
            order = []
            for other, use in pending.items():
                clock = _clock_at(other, use[0]) if other._state is state else None
                order.append((-1 if clock is None else clock[1], other, use, clock))
            order.sort(key=lambda entry: entry[0], reverse=True)
            needed = {}
            for _, other, use, clock in order:
                timeline = other._timeline
                if other._state is state and known.get(timeline, 0) >= use[0]:
                    continue
                needed[other] = use
                if other._state is state:
                    known[timeline] = max(use[0], known.get(timeline, 0))
                    if clock is not None:
                        for tl, v in clock[2].items():
                            if v > known.get(tl, 0):
                                known[tl] = v
        return needed

    async def synchronize(self) -> None:
        """Wait until everything submitted so far has finished; raise the error of a
        command that failed (its failure fails what follows it on the queue).

        Raises :class:`ClosedResourceError` once the queue is closed (or its device):
        its close waited for what was submitted, or dropped it."""
        self._check_open()
        await wait_finished(self, self._submitted)


def _not_waited_for(queue: Queue, what: str, user: Timeline) -> InvalidArgumentError:
    """The refusal of a copy by ``queue`` that reads or writes ``what``, a buffer of
    another kind, in place, while a command on it of the queue whose timeline is
    ``user`` runs, and ``queue`` cannot wait for that command on the device."""
    name, its = two_names(user._state, queue._state)
    return InvalidArgumentError(
        f"{what} is in use by a command of {name} that queues of {its} cannot wait for on "
        "the device: await asyncmetal.copy(dst, src), which waits for it on the host, "
        f"or {name}'s synchronize() first"
    )


_clock_stamps = itertools.count()


def _clock_at(queue: Queue, value: int) -> tuple[int, int, dict[Timeline, int]] | None:
    """``queue``'s clock for its command ``value``: the last one noted at or before it
    (its device's submission lock held)."""
    for entry in reversed(queue._clocks):
        if entry[0] <= value:
            return entry
    return None


# How many device waits and signals a signal's check looks at, at most: past that, the
# signal is let through (a cycle that far is left to the close to end).
SELF_WAIT_STEPS = 256

_INFINITE = 1 << 64

# How a queue's commands from some value on come after where a search began: (the
# queue's command that another queue's wait waits for -- the queue, its value -- the
# timeline and value that command raises it to, then that wait: its queue, value,
# target and whether it orders a signal, then how the first queue's commands were
# reached: the link before), or where it began: a wait, (its queue, value, target,
# whether it orders a signal). Each link holds the one before as it was when made: a
# queue reached again, earlier, later gets a new link, and one that led to it keeps
# its own way back (so no way back goes round: queues may wait for each other's later
# commands).
_Link = tuple[Any, ...]


class _After:
    """What comes after some device waits: on each one's queue its later commands, then
    the device waits of other queues that those satisfy (a wait for a queue's own
    timeline, by that command; for another timeline, by the first signal submitted for
    as much: ``signal_satisfies``), their later commands, and so on. A wait for what
    nothing submitted reaches yet is satisfied by nothing of this, so it ends a chain
    (the host, or a later signal, may satisfy it). ``steps``: how many waits and
    signals it may look at, shared with the searches it is handed to (``left``)."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = steps
        self.since: dict[Queue, tuple[int, _Link]] = {}  # from which command on, how
        self.signals: dict[Timeline, tuple[Queue, int]] = {}  # pending ones among them

    def search(
        self, waits: list[tuple[Any, int, int, bool]], goal: Callable[[Queue, int], bool]
    ) -> tuple[Queue, int, _Link] | None:
        """From ``waits``: the first queue command found after them for which
        ``goal(queue, value)`` holds (with how), else None -- also where it looked at
        too much (``steps``) or another thread submitted to a queue meanwhile."""
        since, todo = self.since, []

        def reached(queue: Queue, at: int, link: _Link) -> tuple[Queue, int, _Link] | None:
            """Whether ``queue``'s command ``at`` is the goal; if not, what follows it
            is searched next (where it comes before what was found of that queue)."""
            if goal(queue, at):
                return queue, at, link
            if at < since.get(queue, (_INFINITE, ()))[0]:
                since[queue] = (at, link)
                todo.append(queue)
            return None

        for wait in waits:
            if found := reached(wait[0], wait[1], wait):
                return found
        while todo:
            waiter = todo.pop()
            start, via = since[waiter]
            raises: list[tuple[int, Timeline, int, int]] = []  # (at, timeline, from, to)
            ops = waiter._sync_ops
            newest, steps = _last_op(waiter), self.steps[0]
            try:  # (another device's queue may take a submission meanwhile: let it be)
                if not self._signals_of(waiter, ops, start, raises):
                    return None
            except RuntimeError:  # (deque mutated during iteration)
                if _last_op(waiter) > newest:  # a submission meanwhile: nothing more is sure
                    self.steps[0] = -1
                    return None
                # Only records of commands done went (Queue._forget_reached, on another
                # thread): what is pending is as it was. Looked at again, taken whole,
                # with the looks of the read given up given back (counted twice, they
                # could end a search that one read fits in). (What it noted in
                # ``signals`` stands: a read just before the drop would have noted it.)
                raises.clear()
                self.steps[0] = steps
                if not self._signals_of(waiter, tuple(ops), start, raises):
                    return None
            raises.append((start, waiter._timeline, start - 1, _INFINITE))  # its own timeline
            for at, signalled, above, target in raises:
                for wait in waits_for(signalled, above + 1, target):
                    if not self.left():
                        return None
                    command = wait[2] if signalled is waiter._timeline else at
                    link = (waiter, command, signalled, *wait, via)
                    if found := reached(wait[0], wait[1], link):
                        return found
        return None

    def _signals_of(
        self,
        waiter: Queue,
        ops: Sequence[tuple[int, bool, Timeline, int]],
        start: int,
        raises: list[tuple[int, Timeline, int, int]],
    ) -> bool:
        """Add to ``raises`` the signals of ``waiter`` from its command ``start`` on,
        of its device waits and signals ``ops`` (newest last), each with where it takes
        its timeline from and to; False where it looked at too much (``steps``)."""
        for at, is_wait, signalled, target in reversed(ops):
            if not self.left():
                return False
            if at < start:
                break
            if not is_wait:
                self.signals.setdefault(signalled, (waiter, at))
                raises.append((at, signalled, signal_satisfies(signalled, target), target))
        return True

    def left(self) -> bool:
        self.steps[0] -= 1
        return self.steps[0] >= 0

    def chain(self, link: _Link, queue: Queue, timeline: Timeline) -> tuple[_Link, list[str]]:
        """Where the search began on the way to ``link``, and the steps from there, in
        words (for a message about ``queue``'s signal of ``timeline``)."""
        steps: list[str] = []
        while len(link) == 8:
            waiter, command, signalled, other, other_at, target, ordering, before = link
            what = "the timeline" if signalled is timeline else _describe(signalled, queue)
            raises = (
                "is what"
                if signalled is waiter._timeline
                else f"raises {what} to {target} or more, which"
            )
            steps.append(
                f"{_who(waiter, queue)}'s command {command}, after it, {raises} "
                f"{_who(other, queue)}'s command {other_at} waits for"
                + (" (its signal of it, next, runs after an earlier one)" if ordering else "")
            )
            link = before
        steps.reverse()
        return link, steps


def _last_op(queue: Queue) -> int:
    """The value of ``queue``'s last device wait or signal not known done; 0 where none
    is (those done are dropped: ``Queue._forget_reached``; read without its device's
    submission lock where it is another device's queue)."""
    try:
        return queue._sync_ops[-1][0]
    except IndexError:
        return 0


def _self_wait(queue: Queue, timeline: Timeline, low: int, value: int, earlier: int) -> str | None:
    """Why ``queue``'s signal of ``timeline`` to ``value``, about to be submitted (after
    its wait for ``earlier`` where that is not 0: another queue's signal first), could
    never run; None where that is not known.

    While a queue's signal of a timeline is pending, the host may not signal it, and
    later queue signals of it wait for that one: a device wait for more than the
    signals submitted so far reach can end only after that signal has run. So a wait
    that such a pending signal comes after never ends. This signal makes one where it
    comes after a device wait (``goal``: on its own queue, or before the command that
    its wait for ``earlier`` waits for) for more of a timeline than its signals reach,
    and that timeline has a pending signal that comes after this one -- or is
    ``timeline`` itself (a wait for ``low`` or more; this signal is then that one).

    What comes after this signal (``_After``): the waits it satisfies (for ``timeline``,
    from ``low`` to ``value``; for its queue's own timeline, beyond what was submitted)
    and what comes after those. At most ``SELF_WAIT_STEPS`` waits and signals are
    looked at (None past that); mostly the waits this signal satisfies are the last
    commands of their queues, and little comes after them."""
    first = signal_provider(timeline, earlier) if earlier else None

    def goal(other: Queue, at: int) -> bool:
        return other is queue or (first is not None and other is first[0] and at <= first[1])

    beyond = waits_for(timeline, low, _INFINITE)
    on_timeline = [wait for wait in beyond if wait[2] <= value]
    satisfied = on_timeline + waits_for(queue._timeline, queue._submitted + 1, _INFINITE)
    if len(on_timeline) == len(beyond) and all(
        # (the common case: what this signal satisfies is its queue's last signal or
        # wait, and nothing waits for that queue's later commands: nothing it satisfies
        # comes after this signal, and no wait is left that only it could satisfy)
        _last_op(other) == at and other._timeline._waited < at and not goal(other, at)
        for other, at, _, _ in satisfied
    ):
        return None
    steps = [SELF_WAIT_STEPS]
    after = _After(steps)  # what comes after this signal
    found = after.search(satisfied, goal)
    if found is not None:  # this signal comes after a command that comes after it
        return _cycle_error(queue, timeline, value, earlier, after, found, on_timeline)
    if steps[0] < 0:
        return None
    # (those this signal satisfies were searched from already: the same goal)
    trapped: list[tuple[Timeline, list[tuple[Any, int, int, bool]], tuple[Queue, int] | None]]
    trapped = [(timeline, [wait for wait in beyond if wait[2] > value], None)]
    for other, signal in after.signals.items():
        above = waits_beyond_signals(other)
        if other is not timeline and above:
            trapped.append((other, waits_for(other, above, _INFINITE), signal))
    for other, waits, pending in trapped:
        if not waits:
            continue
        before = _After(steps)  # what comes after those waits: this signal?
        found = before.search(waits, goal)
        if found is not None:
            return _self_wait_error(
                queue, timeline, value, earlier, other, pending, after, found, before
            )
        if steps[0] < 0:
            return None
    return None


def _cycle_error(
    queue: Queue,
    timeline: Timeline,
    value: int,
    earlier: int,
    after: _After,
    found: tuple[Queue, int, _Link],
    on_timeline: list[tuple[Any, int, int, bool]],
) -> str:
    """The refusal of ``queue``'s signal of ``timeline`` to ``value``, which comes after
    a command (``found``) that comes after it (``after``, which began with the waits
    ``on_timeline`` and waits for this queue's own later commands)."""
    last, _, link = found
    start, steps = after.chain(link, queue, timeline)
    waiter, wait_at, target, _ = start
    what = "the timeline" if start in on_timeline else "this queue's own timeline"
    return (
        f"this signal of the timeline to {value} would never run: it satisfies "
        f"{_who(waiter, queue)}'s command {wait_at}, a device wait for {what} to reach "
        f"{target}"
        + ("" if not steps else "; " + "; ".join(steps))
        + "; and this queue runs this signal only after that"
        + _first_words(last, queue, earlier)
        + ". Submit the signal before that wait, or on a queue that does not wait for it"
        + " (nothing was submitted: the commands already behind that wait still wait for "
        "its value from elsewhere -- the host's signal, another queue's -- or for their "
        "device's close)"
    )


def _first_words(last: Queue, queue: Queue, earlier: int) -> str:
    if last is queue:
        return ""
    return (
        f" -- this signal first waits for the timeline to reach {earlier} (signals of a "
        f"timeline run in order), which {_who(last, queue)}'s later command raises"
    )


def _self_wait_error(
    queue: Queue,
    timeline: Timeline,
    value: int,
    earlier: int,
    trapped: Timeline,
    pending: tuple[Queue, int] | None,
    after: _After,
    found: tuple[Queue, int, _Link],
    before: _After,
) -> str:
    """The refusal of ``queue``'s signal of ``timeline`` to ``value``: a wait for
    ``trapped`` (where ``before`` began) comes before it (``found``), and the pending
    signal of ``trapped`` (``pending``: its queue and value; None: this signal) comes
    after it (``after``)."""
    last, _, link = found
    start, steps = before.chain(link, queue, timeline)
    waiter, wait_at, target, _ = start
    what = "the timeline" if trapped is timeline else _describe(trapped, queue)
    words = [
        f"this signal of the timeline to {value} would never run: {_who(waiter, queue)}'s "
        f"command {wait_at} waits, on the device, for {what} to reach {target}"
    ]
    if pending is None:
        words.append(
            "; once this signal is submitted nothing raises the timeline before it runs (the "
            "host may not signal it while a queue's signal of it is pending, and later "
            "signals of it wait for this one)"
        )
    else:
        signaller, signal_at = pending
        satisfied, signal_steps = after.chain(after.since[signaller][1], queue, timeline)
        words.append(
            f"; {_who(signaller, queue)}'s signal of it (command {signal_at}) is pending, so "
            "nothing raises it before that signal runs (the host may not signal it, and "
            "later signals of it wait for that one) -- and that signal would come after "
            f"this one: this signal satisfies {_who(satisfied[0], queue)}'s command "
            f"{satisfied[1]}, a wait" + ("" if not signal_steps else "; " + "; ".join(signal_steps))
        )
    words.append("; and this queue runs this signal only after that wait")
    if steps:
        words.append(": " + "; ".join(steps))
    words.append(_first_words(last, queue, earlier))
    words.append(". Submit the signal before that wait, or on a queue that does not wait for it")
    return "".join(words)


def _who(queue: Queue, this: Queue) -> str:
    """``queue``, named for a message about ``this`` queue's command."""
    if queue is this:
        return "this queue"
    if queue._state.queue is queue:
        return f"the default queue of {queue._state.name}"
    return f"another queue of {queue._state.name}"


def _describe(timeline: Timeline, this: Queue) -> str:
    """``timeline``, named for a message about ``this`` queue's command."""
    owner = None if timeline._queue is None else timeline._queue()
    if isinstance(owner, Queue):
        return f"the own timeline of {_who(owner, this)}"
    return f"another timeline of {timeline._state.name}"


def copy_in_place(queue: Queue, dst: Any, src: Any, nbytes: int, buffer: Buffer) -> Completion:
    """``queue.copy(dst, src, nbytes)`` where the host side (``dst`` or ``src``) is the
    memory of ``buffer``, a host-visible buffer of another kind of device, read or
    written in place. The copy is a use of ``buffer`` like any other: it is checked (not
    freed, its device open) under the submission lock, and recorded as used by the copy
    before that lock is let go -- a ``free`` on another thread then either made the copy
    refuse it, or waits for the copy (see ``Buffer.free``); and it is ordered, on the
    device, after that buffer's uses submitted since it settled where the queue can wait
    for them, read and recorded under ``buffer``'s device's lock too (see
    ``_records_held``)."""
    return queue._copy(dst, src, nbytes, (buffer,))


def fill_zeros(queue: Queue, buf: Buffer, nbytes: int) -> Completion:
    """Zero the first ``nbytes`` of ``buf``'s block (a buffer just allocated, none of
    whose commands are in flight), on ``queue``: ``nbytes`` covers ``buf`` and is a
    multiple of the device's ``fill_alignment``, within the block."""
    return queue._fill(buf, 0, nbytes, 0, 1)


async def wait_finished(queue: Queue, value: int) -> None:
    """Wait for ``queue``'s command ``value`` (and so those before it); raise its error
    if it did not run -- also when one before it failed, which fails what follows."""
    queue._native.flush()
    await wait_value(queue._timeline, value)
    queue._forget_reached(value)
    failure = queue._failure(value) if value else None
    if failure is not None:
        try:
            raise failure
        finally:
            failure = None  # (not kept by this frame, which its traceback holds)


def submitted_record(queue: Queue) -> tuple[int, list[Any]]:
    """What ``completable`` reads of a queue's submissions: its last value, and its
    device-side signals and waits not yet known complete -- of a queue whose device is
    closing, only those up to what its close decided can complete (or what ran): its
    commands past that are stopped, whatever values its waits find reached later."""
    submitted, final = queue._submitted, queue._final
    if final is None:
        return submitted, list(queue._sync_ops)
    submitted = min(submitted, max(final, queue._timeline.value))
    return submitted, [op for op in list(queue._sync_ops) if op[0] <= submitted]


def completable(
    queues: list[Queue], records: dict[Queue, tuple[int, list[Any]]] | None = None
) -> dict[Queue, int]:
    """For each queue, the value up to which its commands can still complete.

    A queue stops at its first device-side wait that nothing will satisfy: not the
    timeline's value now, not a completable signal of some queue, and -- for a wait on
    a queue's own timeline (a copy ordered after another queue's use) -- not that
    queue's own completable commands. A fixed point over all queues: one queue's
    progress unblocks another's waits. ``records``: each queue's ``submitted_record``,
    taken earlier (else now).

    A queue whose device waits a driver may have been handed (``hands_over_waits``: a
    cuda stream) and one of which ended on a failed value reports nothing from that
    wait on until it is past everything it was given (native/cuda_completion.c,
    cuq_poison: it settles then): stopped at a later wait, it stops before the failed
    one -- counted up to the later wait, a close would wait for it to report the
    failed one, for good. Such a queue may also report what it holds on the host behind
    a later wait before its stream gets past it (its timeline raised through it):
    counted from where its commands really got (``stream_reached``), as are waits on
    its timeline.
    """
    if records is None:
        records = {q: submitted_record(q) for q in queues}
    reach: dict[Timeline, int] = {}
    limit = {q: stream_reached(q) for q in queues}
    position = dict.fromkeys(queues, 0)
    ops = {q: records[q][1] for q in queues}
    owner = {q._timeline: q for q in queues}
    failing: dict[Queue, int] = {}  # a queue's first wait that ended on a failed value

    def satisfied(timeline: Timeline, target: int) -> bool:
        queue = owner.get(timeline)
        if queue is not None and limit[queue] >= target:
            return True  # (its limit: at least its value, but for what it only reported)
        return (queue is None and timeline.value >= target) or reach.get(timeline, 0) >= target

    changed = True
    while changed:
        changed = False
        for q in queues:
            items = ops[q]
            i = position[q]
            notes_failed = q._native.hands_over_waits and q not in failing
            while i < len(items):
                value, is_wait, timeline, target = items[i]
                if is_wait and value > limit[q]:
                    if not satisfied(timeline, target):
                        break
                    if notes_failed and _ended_failed(timeline, target):
                        failing[q] = value
                        notes_failed = False
                if not is_wait:
                    reach[timeline] = max(reach.get(timeline, 0), target)
                i += 1
            position[q] = i
            reached = items[i][0] - 1 if i < len(items) else records[q][0]
            if i < len(items) and q in failing:
                reached = min(reached, failing[q] - 1)
            if reached > limit[q]:
                limit[q] = reached
                changed = True
    return limit


def stream_reached(queue: Queue) -> int:
    """How far ``queue``'s commands got: its timeline's value, but for commands it
    reported failed before its stream got past them (see ``NativeQueue.reached``)."""
    value = queue._timeline.value
    reached = queue._native.reached()
    return value if reached is None else min(value, reached)


def _ended_failed(timeline: Timeline, target: int) -> bool:
    """Whether a wait for ``target`` of ``timeline`` ended on a value never produced."""
    return timeline.value >= target and timeline._failure(target) is not None


# What the Device does with its queues as it closes.


def flush(queue: Queue) -> None:
    """Hand over what ``queue``'s backend still keeps back (before waiting for it)."""
    queue._native.flush()


def discard(queue: Queue, why: str = QUEUE_DISCARDED) -> None:
    """Drop ``queue``'s commands that have not started (see ``NativeQueue.discard``);
    sealed first (``seal``), so none comes after. ``why``: what drops them (its close,
    or its device's). Never blocks; once is enough."""
    if queue._discarded is None:
        queue._discarded = why
        queue._native.discard(why)


def close_native(queue: Queue, abandon: bool) -> None:
    """Close ``queue``'s backend queue (see ``NativeQueue.close``). May block."""
    queue._native.close(abandon)


def seal(
    queue: Queue,
    why: str,
    unreleased: dict[Queue, None] | None = None,
    how: str = QUEUE_CLOSED,
) -> bool:
    """Close ``queue`` to commands (see Queue.close), with its device's submission lock
    held: none of another thread is half submitted. False if it already was. The native
    launch path is turned off too: a launch reads ``_fast_launch`` and enters the
    extension with no Python code between, so no other thread runs meanwhile, and the
    extension hands the command over without running any either (see _submit).
    ``unreleased``: where it is recorded as closed and not released yet, in the same
    run with no call (a KeyboardInterrupt finds it both or neither). ``how``: what
    errors of waits on its timeline say of its end (``queue_closed``)."""
    if queue._closed is not None:
        return False
    if unreleased is not None:
        unreleased[queue] = None
    queue._closed = why
    queue._fast_launch = None
    queue_closed(queue._timeline, queue._submitted, how)
    return True


def let_go(queue: Queue) -> bool:
    """Whether ``queue`` (submission lock held, not closed) has nothing in flight; if
    so it is marked idle: its device no longer keeps it alive, and its next submission
    takes the Python path, which has the device keep it again first. The native launch
    path is turned off before its number is read: a launch that read it before has
    handed its command over already (see seal)."""
    fast, queue._fast_launch = queue._fast_launch, None
    # (One whose last command failed stays until Device.synchronize reported its error.)
    if (
        queue._closed is not None
        or not settled(queue)
        or (queue._submitted > queue._reported and queue._failure(queue._submitted))
    ):
        queue._fast_launch = fast
        return False
    queue._idle = True
    queue._forget_reached(held=True)  # (all of it: nothing in flight)
    return True


def native_queue(queue: Queue) -> NativeQueue:
    """``queue``'s backend queue (to release it once the queue was collected)."""
    return queue._native


def settled(queue: Queue) -> bool:
    """Whether every command submitted to ``queue`` has finished (or was settled). Its
    timeline's value says so but for commands it reported failed before its stream got
    past them (``stream_reached``): asked only once the value says so."""
    return queue._timeline.value >= queue._submitted and stream_reached(queue) >= queue._submitted


def abandon(queue: Queue, first: int) -> None:
    """``queue``'s commands from ``first`` on will never run: the device closed while
    they waited, and its queue threads were stopped. Settle them, so that their waiters
    wake and raise instead of waiting forever -- and so do the waits for what their
    signals of other timelines were to produce (``abandon_signals``)."""
    signals = [(timeline, at, target) for at, wait, timeline, target in queue._sync_ops if not wait]
    queue._abandoned_from = first
    queue._timeline.native.abandon(queue._submitted, first)
    abandon_signals(queue._timeline, first, signals)

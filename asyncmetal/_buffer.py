"""Buffer: device memory as the program sees it, and what queues and copies do with
buffers (their checks, native arguments and uses), read here where a Buffer's parts are
known."""

from __future__ import annotations

import functools
import gc
import inspect
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from . import _allocator
from ._allocator import (
    Allocation,
    Allocator,
    Block,
    ForeignMemory,
    Owner,
    Queue,
    Record,
    allocator_of,
    foreign_holders,
    held_back,
    hold_imported,
    hold_used,
    holding_foreign,
    lenders,
    lenders_for,
    let_go_after_uses,
    let_lingering_go,
    lingering,
)
from ._backend import Arg, NativeTimeline, new_arg
from ._bridge import checkpoint
from ._device_state import (
    DeviceState,
    open_states,
    release_owned,
    two_names,
    unreleased_states,
)
from ._dlpack import Exports, Loan, TypedView, items_shape
from ._errors import (
    ArgumentTypeError,
    ClosedResourceError,
    InvalidArgumentError,
    Singular,
    as_int,
)
from ._timeline import Detached, run_detached, wait_value

if TYPE_CHECKING:
    from ._device import Device


def plain_dtype(dtype: Any, what: str = "dtype") -> np.dtype[Any]:
    """``dtype`` as a numpy dtype whose items are plain bytes of a nonzero size.

    Device memory holds bytes: an object dtype would fill an array with raw bytes where
    numpy expects ``PyObject*`` pointers (or send those pointers to the device)."""
    try:
        checked: np.dtype[Any] = np.dtype(dtype)
    except (TypeError, ValueError):
        raise ArgumentTypeError(f"{what} must be a numpy dtype, got {dtype!r}") from None
    if checked.hasobject:
        raise ArgumentTypeError(
            f"{what} must be a plain data type (numbers, bools, bytes), got {checked}, "
            "which holds Python objects"
        )
    if checked.itemsize == 0:
        raise InvalidArgumentError(f"{what} must have items of at least 1 byte, got {checked}")
    return checked


_BYTES = np.dtype(np.uint8)


def array_shape(nbytes: int, dtype: np.dtype[Any], shape: Any) -> tuple[int, ...]:
    """The shape of the array of ``dtype`` items that ``nbytes`` hold, as ``shape`` (None:
    1-D) takes them, checked before anything is read (:func:`items_shape`). A sub-array
    dtype (``np.dtype((np.int32, 4))``) adds its own dimensions after them, as numpy
    does: the array's elements are ``dtype.base``."""
    return items_shape(nbytes, dtype, shape) + dtype.shape


class Buffer(Exports, Singular):
    """Device memory. Made by ``await device.alloc(nbytes)``: ``nbytes`` long, on
    ``device``.

    Every command that uses a buffer records its timeline value; :meth:`free` returns the
    memory only after those values have passed, so cancelling an awaiting task never
    frees memory a device still uses.
    """

    def __init__(
        self, state: DeviceState, allocation: Allocation, offset: int, nbytes: int
    ) -> None:
        self._state = state
        # (Read-only to users, as properties: commands trust them to lie within the
        # allocation, and a view's free to leave the memory it views alone. The launch
        # paths, native and Python, read the fields: _native_contract.NAMES.)
        self._device: Device = state.device
        self._allocation = allocation
        self._offset = offset
        self._nbytes = nbytes
        self._is_view = False  # made by view(): freed with the buffer it views

    def __repr__(self) -> str:
        state = " freed" if self._allocation.freed else ""
        view = f" (a view at {self._offset})" if self._is_view else ""
        return f"<Buffer {self._nbytes} bytes{view} on {self._state.name}{state}>"

    @property
    def device(self) -> Device:
        """The :class:`Device` it is on."""
        return self._device

    @property
    def offset(self) -> int:
        """Where it starts, in bytes from the start of the allocated buffer whose memory
        it is: 0 for that buffer; for a view, its offset plus the offsets of the views
        it was made from."""
        return self._offset

    @property
    def nbytes(self) -> int:
        """Its size in bytes."""
        return self._nbytes

    @property
    def is_view(self) -> bool:
        """Whether it was made by :meth:`view` (freeing it frees nothing: the memory is
        the viewed buffer's)."""
        return self._is_view

    @property
    def freed(self) -> bool:
        """Whether the buffer was freed (or its memory, through the buffer it views)."""
        return self._allocation.freed

    def view(self, offset: int, nbytes: int | None = None) -> Buffer:
        """A sub-buffer of ``nbytes`` at ``offset`` sharing this buffer's memory."""
        check_buffer(self, "buffer")
        # (the type first: the range's message would show an np.int64 8 as a plain 8)
        given, offset = offset, as_int(offset)  # type: ignore[assignment]
        if offset is None:
            raise ArgumentTypeError(f"offset must be an int, got {type(given).__name__}")
        if nbytes is not None:
            given, nbytes = nbytes, as_int(nbytes)
            if nbytes is None:
                raise ArgumentTypeError(
                    f"nbytes must be an int or None, got {type(given).__name__}"
                )
        if not 0 <= offset <= self.nbytes:
            raise InvalidArgumentError(
                f"offset must be an int in [0, {self.nbytes - 1}], got {offset}"
            )
        if offset == self.nbytes:
            raise InvalidArgumentError(
                f"offset {offset} leaves no bytes of the buffer's {self.nbytes} for a view"
            )
        nbytes = self.nbytes - offset if nbytes is None else nbytes
        if not 0 < nbytes <= self.nbytes - offset:
            raise InvalidArgumentError(
                f"nbytes must be an int in [1, {self.nbytes - offset}], got {nbytes}"
            )
        view = Buffer(self._state, self._allocation, self._offset + offset, nbytes)
        view._is_view = True
        return view

    def _check_usable(self, what: str) -> None:
        check_buffer(self, what)

    def busy(self) -> bool:
        """Whether a command using this buffer's memory is still in flight. Never blocks."""
        for queue, value in list(self._allocation.last_use.items()):
            if queue.timeline.native.value < value:
                return True
        return False

    def typed(self, dtype: Any, shape: Any = None) -> TypedView:
        """This buffer's memory as a C-contiguous array of ``dtype`` and ``shape`` (default:
        1-D), for exchange with other libraries: ``torch.from_dlpack(buf.typed(np.float32,
        (n, n)))``. The buffer itself exports as a 1-D ``uint8`` array of its bytes."""
        check_buffer(self, "buffer")
        return TypedView(self, dtype, shape)

    def _exported(self) -> tuple[Buffer, np.dtype[Any], tuple[int, ...] | None]:
        return self, _BYTES, None  # untyped: 1-D uint8, see typed()

    def _export_state(self) -> DeviceState:
        return self._state

    def _pending_uses(self) -> list[tuple[NativeTimeline, int]]:
        return [(q.timeline.native, v) for q, v in uses(self) if q.timeline.value < v]

    def _lend(self, hold: bool = True) -> tuple[Any, Callable[[], None]]:
        allocation = self._allocation
        allocator = allocation.allocator
        if allocator is None:  # (memory coming back shares its record: see lend_foreign)
            self._state.device._allocator.lend_foreign(allocation.block)
        if not hold:
            if allocator is not None:
                allocator.lend(allocation.block, allocation.generation, hold=False)
            return allocation.handle, _no_loan
        if allocator is None:  # memory the device does not own: keep what holds it alive
            owner = allocation.block.owner  # (a free lets go of what it holds: see free)
            held = None if owner is None else owner.held
            return allocation.handle, functools.partial(_no_loan, allocation, held)
        return allocation.handle, allocator.lend(allocation.block, allocation.generation)

    async def __aenter__(self) -> Buffer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        # (closed: freed with it; a view: freed with its buffer)
        if not self._allocation.freed and not self._state.closed and not self.is_view:
            await self.free()
        else:
            await checkpoint()  # (as a free is)

    async def write(self, data: Any) -> None:
        """Copy ``data`` (any C-contiguous buffer-protocol object) into the buffer.

        A copy on the device's default queue, ordered (as every copy is) after the
        earlier commands of any queue that used the buffer, launches included. Cancelling
        the await does not withdraw the copy: it completes, and ``data`` is kept alive
        until then. ``data`` may be a Buffer of this device, of another of its kind, or
        of another kind whose memory the host sees (cpu, npy, Metal): that one is read in
        place once the commands that used it finished, as ``asyncmetal.copy`` reads it;
        a buffer of another kind the host cannot see (cuda) goes through
        ``asyncmetal.copy``.
        """
        check_buffer(self, "buffer")  # (the copy's own check would call it dst)
        if isinstance(data, Buffer):
            size = data.nbytes
        else:  # refused first as the copy refuses it: no buffer protocol, objects, ...
            from ._copyargs import host_view  # (it imports this module)

            with host_view(data, "data", writable=False) as view:
                size = view.nbytes
        if size != self.nbytes:  # (the copy's own check would point to its nbytes)
            hint = (
                "there is nothing to write"
                if not size  # (a view holds a byte at least)
                else f"to write part of it, write to a view: buf.view(offset, {size}).write(data)"
                if size < self.nbytes
                else "pass as many bytes of data, or allocate a larger buffer"
            )
            raise InvalidArgumentError(
                f"data holds {size} bytes and the buffer {self.nbytes}: write() fills the "
                f"whole buffer; {hint}"
            )
        if (
            isinstance(data, Buffer)
            and data._state.kind != self._state.kind
            and data._state.backend.host_visible
            and self._state.backend.writable  # (else refused as read-only, below)
        ):
            from ._transfer import copy  # (it imports this module)

            await copy(self, data)  # read in place, on this device's default queue
            return
        await self._state.default_queue().copy(self, data)

    async def read(self, dtype: Any = np.uint8, shape: Any = None) -> np.ndarray[Any, Any]:
        """A new numpy array holding the buffer's bytes: a copy on the device's default
        queue, ordered (as every copy is) after the earlier commands of any queue that used
        the buffer, launches included."""
        check_buffer(self, "buffer")  # (the copy's own check would call it src)
        dtype = plain_dtype(dtype)
        out = np.empty(array_shape(self.nbytes, dtype, shape), dtype.base)
        await self._state.default_queue().copy(out, self)
        return out

    async def free(self) -> None:
        """Free the buffer (and every view of it) once the commands using it finished.
        A view is freed with its buffer: its own ``free()`` is refused.

        It is unusable at once. Waits until the memory is back with the allocator;
        cancelling that wait changes nothing: the memory still returns when the device
        is done with it.
        """
        check_buffer(self, "buffer")
        if self.is_view:
            raise InvalidArgumentError(
                f"{self!r} is a view: it is freed with the buffer it views (free that one)"
            )
        allocation = self._allocation
        allocation.freed = True
        allocation.block.freed = True
        # A submission on another thread may have found the buffer usable just before
        # and not recorded its use yet: it has once each device's submission lock was
        # free (each submission checks again under its lock, and refuses it now). The
        # release is made then, whatever happens to this call meanwhile.
        allocator = allocation.allocator  # None: memory it wraps, not the device's

        def settle() -> list[tuple[Queue, int]]:
            uses = list(allocation.last_use.items())
            if allocator is not None:
                allocator.release_after(allocation.block, uses, allocation.generation)
            else:  # (another library's memory: what holds it goes once those uses ran)
                let_go_after_uses(allocation.block)
            return uses

        try:
            uses = await after_submissions(open_states(), settle, self._state.unheard_error)
        except BaseException:
            # Interrupted (a KeyboardInterrupt lands between any two calls), maybe
            # before the release was recorded: recorded on the frees' thread, after the
            # submissions, as settle does (again, if it was: it changes nothing then).
            settle_detached(settle, self._state.unheard_error)
            raise
        for queue, value in uses:
            await wait_value(queue.timeline, value)
        if uses and allocator is not None:
            allocator.sweep()  # its last uses passed: the release is due now
        else:
            if uses and (lingering or held_back):
                let_lingering_go()  # (what held another library's memory goes now)
            await checkpoint()

    async def map(self, dtype: Any = np.uint8, shape: Any = None) -> np.ndarray[Any, Any]:
        """A zero-copy numpy view of host-visible memory (the cpu device, Metal's shared
        storage), handed out once every command using the buffer has finished.

        The view aliases the buffer: later device work shows through it. It holds the
        memory as an export does: a free (or the device's close) meanwhile does not let
        that memory go to another buffer until the view and every array over it are
        gone; commands submitted after the free are not ordered with it.
        """
        check_buffer(self, "buffer")
        backend = self._state.backend
        if not backend.host_visible:
            raise InvalidArgumentError(
                f"{self._state.name} memory is not host-visible: use read() instead"
            )
        dtype = plain_dtype(dtype)
        full = array_shape(self.nbytes, dtype, shape)
        if not self.busy():
            await checkpoint()  # (a checkpoint all the same; what it let in is seen below)
        await settled(self, "buffer")
        handle, release = self._lend()
        try:
            view = backend.host_view(handle, self._offset, self._nbytes)
            array = np.frombuffer(view, dtype.base)
        except BaseException:
            release()
            raise
        # Arrays over it keep it as their base; once it goes, its loan ends (an
        # interrupt before drops ``release``, which ends it too: see Allocator.lend).
        array = np.asarray(_Mapping(array, Loan(release)))
        if array.dtype != dtype.base:  # (the array interface names ml_dtypes' types V2)
            array = array.view(dtype.base)
        return array if array.shape == full else array.reshape(full)


async def settled(buf: Buffer, what: str) -> None:
    """Wait until every command using ``buf`` has finished (those submitted while
    waiting too); then raise if it was freed, or its device closed, meanwhile."""
    while True:
        pending = [(q, v) for q, v in uses(buf) if q.timeline.value < v]
        if not pending:
            check_buffer(buf, what)
            return
        for queue, value in pending:
            await wait_value(queue.timeline, value)


class _Mapping:
    """The base of a mapped view (Buffer.map) and the arrays over it: holds its loan,
    which ends as it goes."""

    __slots__ = ("__array_interface__", "array", "loan")

    def __init__(self, array: np.ndarray[Any, Any], loan: Loan) -> None:
        self.array = array  # (and the memory it is over)
        self.loan = loan
        self.__array_interface__ = array.__array_interface__


def discard(buf: Buffer) -> None:
    """Free ``buf``, which was never handed out (no other thread can be submitting a
    command that uses it), once the commands recorded as using it have finished."""
    allocation = buf._allocation
    allocation.freed = True
    allocation.block.freed = True
    allocator = allocation.allocator
    if allocator is not None:
        block, generation = allocation.block, allocation.generation
        try:
            allocator.release_after(block, list(block.last_use.items()), generation)
        except BaseException:  # an interrupt, maybe before it was recorded: again
            allocator.release_after(block, list(block.last_use.items()), generation)
            raise


def not_a_buffer(obj: object) -> str:
    """A hint for an object passed where a Buffer was expected ("" if none fits)."""
    if isinstance(obj, TypedView):
        return " (a typed view is for export: pass its .buffer)"
    if inspect.isawaitable(obj):
        code = getattr(obj, "cr_code", None)
        name = f" {code.co_name}" if code is not None else ""
        return f" (did you forget to await{name}?)"
    return ""


def check_buffer(buf: Buffer, what: str, state: DeviceState | None = None) -> None:
    """Raise unless ``buf`` is usable now (not freed, its device open) and, given
    ``state``, a buffer of that device."""
    if buf._allocation.freed:
        raise ClosedResourceError(
            f"{what} was freed: {buf!r} (a freed buffer, and every view of it, stays "
            "unusable: allocate another)"
        )
    own = buf._state
    if own.closed:
        raise ClosedResourceError(f"{what} belongs to the closed device {own.name}")
    if state is not None and state is not own:
        its, expected = two_names(own, state)
        hint = ""
        if not own.backend.runs_kernels and state.backend.runs_kernels:
            hint = f" ({own.kind} buffers hold data only: am.copy it into a {state.kind} buffer)"
        raise InvalidArgumentError(f"{what} is on {its}, expected a buffer of {expected}{hint}")


def launch_args(buffers: Sequence[Buffer], kernel: str, state: DeviceState) -> list[Arg]:
    """The launch arguments of ``buffers`` for kernel ``kernel`` on ``state``'s device,
    each checked. The hot path of every launch: identity checks first, messages only
    on failure."""
    args: list[Arg] = []
    append = args.append
    for i, buf in enumerate(buffers):
        if buf.__class__ is not Buffer:
            raise ArgumentTypeError(
                f"buffer {i} of {kernel!r} must be a Buffer, got {type(buf).__name__}"
                + not_a_buffer(buf)
            )
        allocation = buf._allocation
        if allocation.freed or buf._state is not state or state.closed:
            check_buffer(buf, f"buffer {i} of {kernel!r}", state)
        append(new_arg(Arg, (allocation.handle, buf._offset, None)))
    return args


def native_arg(buf: Buffer) -> Arg:
    """``buf`` as the backend takes it: its native handle and offset."""
    return new_arg(Arg, (buf._allocation.handle, buf._offset, None))


def record_uses(buffers: Iterable[Buffer], queue: Queue, value: int) -> None:
    """``queue``'s command ``value`` uses ``buffers``: they are freed only after it."""
    for buf in buffers:
        buf._allocation.last_use[queue] = value
    if _allocator.letting_go:  # (after: see _allocator._hold_in_use)
        hold_used([buf._allocation for buf in buffers])


def uses(buf: Buffer) -> list[tuple[Queue, int]]:
    """Each queue that used ``buf``'s memory, with the value of its last command that did."""
    return list(buf._allocation.last_use.items())


def overlap(a: Buffer, b: Buffer, nbytes: int) -> bool:
    """Whether ``nbytes`` from ``a`` and from ``b`` share memory."""
    return a._allocation is b._allocation and (
        a._offset < b._offset + nbytes and b._offset < a._offset + nbytes
    )


def buffer_state(buf: Buffer) -> DeviceState:
    """The state of ``buf``'s device."""
    return buf._state


def host_memory(buf: Buffer, nbytes: int) -> memoryview:
    """``nbytes`` of a host-visible ``buf``, in place."""
    return buf._state.backend.host_view(buf._allocation.handle, buf._offset, nbytes)


def _no_loan(*keep: object) -> None:
    """Ends a loan that held nothing in the allocator (its arguments were kept alive)."""


def foreign_buffer(
    state: DeviceState,
    handle: Any,
    nbytes: int,
    owner: Owner,
    after: tuple[Queue, int] | None,
    shares: Record | None = None,
) -> Buffer:
    """A Buffer over memory the device does not own (another library's array): ``owner``
    is kept alive while the buffer is, and its memory is never released by asyncmetal.
    ``after``: a command that later uses order themselves after, as after a write.
    Memory of one of the device's own buffers that went out and came back (a round trip
    through another library) -- or of a buffer of another open device of its kind --
    shares that buffer's record of uses: commands on either are ordered after those on
    the other, as on one buffer. ``shares``: that buffer's block, where it is known (a
    buffer of asyncmetal's own passed to from_dlpack, also one over another library's
    memory, which lent nothing), else looked up among the memory lent out."""
    if lingering or held_back:  # (an import in a loop lets go of what the ones before left)
        let_lingering_go()
    block = Block(handle, nbytes, state, owner)
    own = state.device._allocator
    address = state.backend.loan_address(handle)  # where memory lent out comes back
    if shares is None and lenders and address is not None:  # (none went out: none back)
        shares = _lent_record(own, address, nbytes, state=state)  # (its own, or its kind's)
    if shares is not None:
        _share_record(block, shares)
        own.note_foreign(block)  # (its record is looked through too)
    elif address is not None:
        _share_foreign_memory(state, address, block, own)
    else:
        own.note_foreign(block)
    if after is not None:
        queue, value = after
        uses = block.last_use
        if uses.get(queue, 0) < value:
            uses[queue] = value
        block.waited = after
    allocation = Allocation(block)
    hold_imported(allocation)  # (its finalizer takes it out: see imported)
    return Buffer(state, allocation, 0, nbytes)


def _share_foreign_memory(
    state: DeviceState, address: int, block: Block, own: Allocator | None = None
) -> None:
    """Have new foreign ``block`` (at ``address``, on ``state``'s device) share the
    record of the foreign memory it is over (see ForeignMemory) -- that of a buffer of
    the device or of another one of its kind (open, or closing until its memory is
    released) over the same memory, or over more of it -- or start that memory's
    record, and note it (``note_foreign``). Over more memory than the one record there
    covers (a whole array after a slice of it) it shares that record too, for its whole
    range: a part made later finds the slice's record first, which must be the whole's
    as well. A new record that overlaps several others (a whole
    array after two slices of it) starts with their uses: its commands come after those
    submitted through them so far, but their later commands are not ordered after its
    own (``queue.after`` orders those, as between any two buffers). Found and noted
    under one lock: two buffers made at once over the same memory, on two threads,
    share one record."""
    with _foreign_lock:
        # No collection starts while the lock is held: one runs finalizers on this
        # thread, and one that imports (from_dlpack) would share records in the middle
        # of this look-up (two records for one memory). Switched off and on by calls
        # that allocate nothing tracked (no collection starts between the lock's
        # taking and the switch); an interrupt anywhere leaves it as it was, and a
        # caller that had switched collections off finds them off. Another thread may
        # switch them on meanwhile (collection is the process's): the lock is
        # reentrant, so that a finalizer's import then runs inside this one -- at worst
        # a second record, where it imports this very memory -- rather than have this
        # thread wait for itself.
        collecting = gc.isenabled()
        try:
            gc.disable()
            _share_locked(state, address, block, own or state.device._allocator)
        finally:
            if collecting:
                gc.enable()


def _share_locked(state: DeviceState, address: int, block: Block, own: Allocator) -> None:
    """_share_foreign_memory's look-up and note, ``_foreign_lock`` held (``own``: the
    allocator of ``state``'s device)."""
    nbytes = block.nbytes
    # (this device's own first: a record shared between devices is kept by the first)
    overlapping = own.foreign_memory(address, nbytes)
    memory = overlapping[0] if overlapping else None
    if memory is None or not memory.holds(address, nbytes):
        memory = None
        # (closing ones too, until their memory is released: a sealed device's
        # commands still run on that memory, which a copy is then refused over)
        for other in unreleased_states():
            if other is state or other.kind != state.kind:
                continue
            if (allocator := allocator_of(other)) is None:
                continue  # (a device still opening: it has recorded nothing)
            found = allocator.foreign_memory(address, nbytes)
            if found and found[0].holds(address, nbytes):
                memory = found[0]
                break
            overlapping += found
    if memory is None and overlapping:
        records = {id(m.last_use): m for m in overlapping}
        if len(records) == 1:  # (ordered with more than it uses, never with less)
            (known,) = records.values()
            memory = ForeignMemory(address, nbytes, known.last_use, known.keeper)
    if memory is not None:
        block.last_use, block.keeper = memory.last_use, memory.keeper
    else:
        _take_uses(block, overlapping)
        memory = ForeignMemory(address, nbytes, block.last_use, state)
    block.memory = memory  # (what keeps it: the devices' registries hold it weakly)
    own.note_foreign(block)


def _new_foreign_lock() -> None:
    """In a forked child (a parent thread may have held the lock at the fork)."""
    global _foreign_lock
    _foreign_lock = threading.RLock()


_foreign_lock = threading.RLock()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_foreign_lock)


def wrap_buffer(state: DeviceState, handle: Any, nbytes: int) -> Buffer:
    """A Buffer over memory the device did not allocate (an array it wraps: the npy
    device's read-only sources, ``from_numpy``): never returned to an allocator. Host
    memory that a buffer of an open device -- of any kind -- lent out (``np.from_dlpack``,
    ``map()``) or wraps (``am.from_dlpack(array)``) is a use of that buffer: the new
    buffer shares its record of uses (see ``_share_host_record``)."""
    block = Block(handle, nbytes, state)
    address = state.backend.loan_address(handle)
    if address is not None and (lenders or foreign_holders):  # (else none to share)
        _share_host_record(state, address, block)
    return Buffer(state, Allocation(block), 0, nbytes)


def _share_host_record(state: DeviceState, address: int, block: Block) -> None:
    """Have ``block``, wrapped host memory at ``address`` (a read-only source), share
    the record of uses of a buffer of another device over that memory: one that lent
    it out (its block, or the foreign memory it is over), else the foreign memory that
    a buffer made by ``from_dlpack`` is over (see ForeignMemory) and that holds its
    whole range. Commands on either are then ordered after those on the other, as on
    one buffer: the source's reads come after that buffer's writes submitted before
    them, and that buffer's later writes after the source's reads. Where only records
    of parts of it are found (an array over two buffers' memory), the block starts with
    their uses: its commands come after those submitted through them so far, but
    their later commands are not ordered after its own (``queue.after`` orders those,
    as between any two buffers). The record outlives the buffers whose it is while the
    source's commands on it run: a dropped buffer over another library's memory
    lingers until the uses on its record passed (``lingering``), and memory lent out is
    held by its loan, which the source's array holds. A source made before any buffer
    over its memory keeps a record of its own."""
    nbytes = block.nbytes
    shares = _lent_record(state.device._allocator, address, nbytes, any_kind=True)
    overlapping: list[ForeignMemory] = []
    if shares is None and foreign_holders:
        for allocator in holding_foreign():
            found = allocator.foreign_memory(address, nbytes)
            if found and found[0].holds(address, nbytes):
                shares = found[0]
                break
            overlapping += found
    if shares is None:
        _take_uses(block, overlapping)
    else:
        _share_record(block, shares)


def _lent_record(
    own: Allocator,
    address: int,
    nbytes: int,
    any_kind: bool = False,
    state: DeviceState | None = None,
) -> Record | None:
    """The record of the buffer that lent out the memory ``nbytes`` at ``address`` --
    its block, or the foreign memory it is over -- among ``lenders_for(own,
    any_kind)``; None where none did. ``state``: that of ``own``'s device, where the
    caller has it: then the others of its kind are looked through in the order
    ``lenders_for`` lists them, without listing them (an import's hot path)."""
    # Its own first (one with nothing lent out answers at once, with no lock taken).
    shares = own.exported_block(address, nbytes)
    if shares is not None:
        return shares
    if state is not None and not any_kind:
        for other in unreleased_states():
            if other is not state and other.kind == state.kind:
                allocator = allocator_of(other)
                if allocator is None:
                    continue  # (a device still opening: it has lent nothing out)
                shares = allocator.exported_block(address, nbytes)
                if shares is not None:  # (a foreign one may share a record kept elsewhere)
                    return shares
        return None
    for allocator in lenders_for(own, any_kind=any_kind):
        if allocator is own:
            continue
        shares = allocator.exported_block(address, nbytes)
        if shares is not None:  # (a foreign one may share a record kept elsewhere)
            return shares
    return None


def _share_record(block: Block, shares: Record) -> None:
    """Have ``block`` share the record of uses ``shares`` (and whose lock guards it)."""
    block.last_use, block.keeper = shares.last_use, shares.keeper
    block.memory = shares if isinstance(shares, ForeignMemory) else shares.memory


def _take_uses(block: Block, records: list[ForeignMemory]) -> None:
    """Start ``block``'s record with the uses of ``records`` (the latest of each queue):
    its commands come after theirs submitted so far."""
    for record in records:
        for queue, value in list(record.last_use.items()):
            block.last_use[queue] = max(value, block.last_use.get(queue, 0))


T = TypeVar("T")
# Frees behind other threads' submissions: one thread for a burst of them.
_FREES = Detached("asyncmetal free")


async def after_submissions(
    states: list[DeviceState], fn: Callable[[], T], unheard: Callable[[BaseException], None]
) -> T:
    """``fn()`` once no submission to ``states``' devices that was under way when this
    was called still is: each device's submission lock tried and let go (never waited
    for here, so no other taker waits on this one for longer than a look). On the
    loop's thread where none is held now; else on the thread the frees share
    (``_FREES``), which runs ``fn`` whatever happens to the caller (its error goes to
    ``unheard`` where the caller was cancelled meanwhile, see ``run_detached``)."""
    busy = _held_elsewhere(states)
    if not busy:
        return fn()

    def waiting() -> T:
        _submissions_over(busy)
        return fn()

    return await run_detached(_FREES, waiting, unheard)


def _held_elsewhere(states: list[DeviceState]) -> list[DeviceState]:
    """The states whose submission lock another thread holds now, each tried and let
    go. An interrupt right after a try took a lock leaves no name for what it got, but
    the lock knows its owner: a task never holds a submission lock across an await, so
    one this thread holds here is this try's, and is let go."""
    busy = []
    try:
        for state in states:
            if state.submitting.acquire(blocking=False):
                state.submitting.release()
            else:
                busy.append(state)
    except BaseException:
        release_owned(states)
        raise
    return busy


def _submissions_over(states: list[DeviceState]) -> None:
    """Once each device's submission lock was taken and let go: a submission under way
    when this was called is over."""
    for state in states:
        state.submitting.acquire()
        state.submitting.release()


def settle_detached(fn: Callable[[], object], unheard: Callable[[BaseException], None]) -> None:
    """``fn()`` on the thread the frees share once no submission under way now still
    is (as after_submissions does), never waiting here; its error goes to ``unheard``."""
    states = open_states()

    def job() -> None:
        _submissions_over(states)
        try:
            fn()
        except Exception as exc:
            unheard(exc)

    _FREES.submit(job)

"""The exception types (every error asyncmetal raises derives from AsyncMetalError),
and what the argument checks share."""

from __future__ import annotations

import copy
import operator
import os
import sys
import warnings
from types import FrameType
from typing import NoReturn, TypeVar

# A timeout longer than this (seconds: about 32 years) is taken as none: an int too large
# for a float, or a deadline the loops' clocks cannot hold, would raise instead.
MAX_TIMEOUT_S = 1e9


def as_int(value: object) -> int | None:
    """``value`` as a plain int where it is an integer -- an int, or an integer scalar of
    numpy or PyTorch (anything with ``__index__``) -- but not a bool; None otherwise. Sizes,
    offsets and values take what ``range`` and numpy's indexing take."""
    if value.__class__ is int:
        return value
    if isinstance(value, bool):
        return None
    try:  # (numpy's bool has no __index__)
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


# The package's directory: a warning is reported at the first frame outside it.
_PACKAGE = os.path.dirname(__file__) + os.sep  # (as code objects name their files)


def warn(message: str | Warning, category: type[Warning] | None = None) -> None:
    """``warnings.warn``, reported at the first frame outside asyncmetal: the user's
    call, however deep in the package the warning arose (a pool's cache lookup inside
    ``Device.compile``). Where every frame is the package's (a thread of its own), at
    this function's caller."""
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, stacklevel=2, skip_file_prefixes=(_PACKAGE,))
        return
    level = 1
    frame: FrameType | None = sys._getframe(0)  # (this function's: the package's)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=2 if frame is None else level)


_OFF = frozenset(("0", "false", "no", "off"))
_ON = frozenset(("1", "true", "yes", "on"))


def env_switch(name: str) -> bool:
    """The environment variable ``name`` as a switch that is on unless set off: ``0``,
    ``false``, ``no`` or ``off`` (any case) turn it off; another value than those and
    ``1``, ``true``, ``yes``, ``on`` is taken as on, with a warning naming them."""
    value = os.environ.get(name, "").strip().lower()
    if not value or value in _ON:
        return True
    if value in _OFF:
        return False
    warn(
        f"${name}={os.environ[name]!r} is not a switch asyncmetal knows: taken as on "
        "(0, false, no or off turn it off)",
        RuntimeWarning,
    )
    return True


class AsyncMetalError(Exception):
    """The base of every error asyncmetal raises."""


class InvalidArgumentError(AsyncMetalError, ValueError):
    """An argument has the right type but a wrong value; nothing was submitted."""


class ArgumentTypeError(AsyncMetalError, TypeError):
    """An argument has the wrong type or the call has the wrong number of them."""


def not_picklable(obj: object) -> NoReturn:
    """The refusal of pickling ``obj``, an object that stands for what this process holds
    (a device, its memory, queues and programs, compile workers): pickled, it would
    name handles another process does not have -- and, without this, pickle's own error
    names a lock inside it."""
    raise ArgumentTypeError(
        f"{type(obj).__name__} objects cannot be pickled: each stands for what this process "
        "holds of a device, which another process cannot use (send data instead: "
        "await buffer.read())"
    )


_S = TypeVar("_S", bound="Singular")
_E = TypeVar("_E", bound=BaseException)


class Singular:
    """An object that is the one of its kind for what it stands for: a copy is the object
    itself, and pickling it says it cannot be (``not_picklable``). A copy made anew would
    keep records of its own -- a Device of its queues, programs and close; a Queue its
    numbering of commands, over a native queue its original's close released; a
    Timeline its record of signals, taking values below the original's; a CompilePool
    its state over the original's workers, waiting for good on a pool closed meanwhile;
    a Program a ``native`` its device unloads once the original is gone -- and a Buffer,
    a TypedView and a Completion stand for one memory or one point on a timeline,
    whatever refers to them."""

    __slots__ = ()

    def __copy__(self: _S) -> _S:
        return self

    def __deepcopy__(self: _S, memo: dict[int, object]) -> _S:
        return self

    def __reduce__(self) -> NoReturn:
        not_picklable(self)


class CompileWarning(UserWarning):
    """A kernel compiled, and the compiler printed warnings: ``log`` holds them. Emitted
    by the compile that ran the compiler (a cached binary warns no more)."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message if not log else f"{message}\n{log}")
        self.log = log


class CompileError(AsyncMetalError):
    """A kernel failed to compile, or the compiled code lacks the named kernel.

    ``log`` holds the compiler's full output; ``name`` the kernel it was compiling
    (the name given to ``compile`` or in ``compile_many``), or None where no one kernel
    is concerned (``CompilePool.compile`` of a source).
    """

    def __init__(self, message: str, log: str = "", *, name: str | None = None) -> None:
        super().__init__(message if not log else f"{message}\n{log}")
        self.message, self.log, self.name = message, log, name

    def __reduce__(self) -> tuple[type[CompileError], tuple[str, str], dict[str, object]]:
        return type(self), (self.message, self.log), {"name": self.name}

    def _for_kernel(self, name: str) -> CompileError:
        """This error as kernel ``name``'s: itself if it names that kernel already, else
        a new one whose message begins with the name. A new one, since one compile of a
        source can fail several kernels of it."""
        if self.name == name:
            return self
        return CompileError(f"kernel {name!r}: {self.message}", self.log, name=name)


class OutOfMemoryError(AsyncMetalError, MemoryError):
    """No memory can be had: nothing in flight can free enough."""

    def __init__(
        self, requested: int, in_use: int, cached: int, budget: int, detail: str = ""
    ) -> None:
        msg = (
            f"cannot allocate {requested} bytes: {in_use} in use, {cached} cached, budget {budget}"
        )
        super().__init__(f"{msg} ({detail})" if detail else msg)
        self.requested, self.in_use, self.cached, self.budget = requested, in_use, cached, budget
        self.detail = detail

    def __reduce__(self) -> tuple[type[OutOfMemoryError], tuple[int, int, int, int, str]]:
        # (Pickled as its arguments: Exception's own pickling passes the message alone,
        # which __init__ does not take -- a worker process's error would not rebuild.)
        return type(self), (self.requested, self.in_use, self.cached, self.budget, self.detail)


class NoHostMemoryError(AsyncMetalError, MemoryError):
    """A backend's native runtime (or driver) had no memory left for an object or a
    submission it was asked to make: nothing of it was made. Not OutOfMemoryError,
    whose numbers are a device's budget."""


class DeviceNotFoundError(AsyncMetalError, LookupError):
    """No such device here: its driver, framework or hardware is missing, or its index
    is past those there are (``devices()`` lists what can be opened)."""


class DeviceLostError(AsyncMetalError):
    """The device (or its context) failed; its work cannot complete."""


class ExchangeError(AsyncMetalError, BufferError):
    """A buffer cannot be shared with another library as asked (DLPack,
    ``__cuda_array_interface__``): the exchange protocols' BufferError."""


class ClosedResourceError(AsyncMetalError):
    """The device, queue or buffer has been closed or freed."""


class NoLoopError(AsyncMetalError, RuntimeError):
    """Called outside a running asyncio, uvloop or trio loop where one is needed."""


# An error kept to be raised later, maybe to many callers (a failed command's, awaited
# by each of its waiters; a compile's, by each caller that joined it), is kept with no
# traceback and handed out as a copy: raised, an exception gathers in its traceback the
# frames it passes through, which hold their locals -- raised again and again, one object
# would gather every caller's frames, and keep them (and the queues, buffers and
# devices they refer to) alive as long as it is kept.


def keep_error(error: _E) -> _E:
    """``error``, to be kept and raised later (as ``fresh_error``'s copies): the
    tracebacks of it and of the errors it chains to (``__cause__``, ``__context__``)
    dropped, and with them the frames they held."""
    seen: set[int] = set()
    links: list[BaseException | None] = [error]
    while links:
        link = links.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        link.__traceback__ = None
        links += (link.__cause__, link.__context__)
    return error


def fresh_error(error: _E) -> _E:
    """A copy of kept ``error`` (``keep_error``) for one caller to raise: its type, its
    arguments and attributes (pickled alike), its notes, cause and context -- and no
    traceback, nor the frames of the callers that raised the original's other copies.
    Where the error cannot be copied, the error itself, its traceback dropped."""
    try:
        copied = copy.copy(error)
    except Exception:
        copied = error
    if copied is error or type(copied) is not type(error):
        return error.with_traceback(None)
    copied.__cause__ = error.__cause__
    copied.__context__ = error.__context__
    copied.__suppress_context__ = error.__suppress_context__
    notes = getattr(error, "__notes__", None)
    if isinstance(notes, list):  # (its own list: a note added to the copy stays there)
        copied.__notes__ = list(notes)  # type: ignore[attr-defined]
    return copied.with_traceback(None)


def check_bool(value: object, name: str) -> None:
    """Refuse a flag that is not a bool, naming it: a truthy stand-in (the string
    "false" read from a configuration) would turn it on unsaid."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be a bool, got {type(value).__name__}")

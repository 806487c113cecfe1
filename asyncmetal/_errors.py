"""The exception types. Every error asyncmetal raises derives from AsyncMetalError."""

from __future__ import annotations


class AsyncMetalError(Exception):
    """The base of every error asyncmetal raises."""


class InvalidArgumentError(AsyncMetalError, ValueError):
    """An argument has the right type but a wrong value; nothing was submitted."""


class ArgumentTypeError(AsyncMetalError, TypeError):
    """An argument has the wrong type or the call has the wrong number of them."""


class CompileError(AsyncMetalError):
    """A kernel failed to compile, or the compiled code lacks the named kernel.

    ``log`` holds the compiler's full output.
    """

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message if not log else f"{message}\n{log}")
        self.log = log


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


class DeviceLostError(AsyncMetalError):
    """The device (or its context) failed; its work cannot complete."""


class ExchangeError(AsyncMetalError, BufferError):
    """A buffer cannot be shared with another library as asked (DLPack,
    ``__cuda_array_interface__``): the exchange protocols' BufferError."""


class ClosedResourceError(AsyncMetalError):
    """The device, queue or buffer has been closed or freed."""

"""Program: a compiled kernel loaded on one device, ready for ``Queue.launch``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._compile import ParamKind, Signature
from ._device_state import DeviceState
from ._errors import Singular
from ._scalars import CODES

if TYPE_CHECKING:
    from ._device import Device


class Program(Singular):
    """A kernel loaded on one device, ready for ``Queue.launch``. Made by
    ``await device.compile(src, name)``.

    ``name`` is the kernel's name; ``params`` the kind of each parameter, in order
    (``"buffer"``: a launch's positional Buffer, ``"value"``: one of its ``vals``);
    ``value_types`` each value parameter's scalar type (None where not known) and its
    declaration, as read from the source; ``device`` the :class:`Device`.
    """

    def __init__(
        self,
        state: DeviceState,
        name: str,
        signature: Signature,
        binary: bytes,
        native: Any,
    ) -> None:
        self._state = state
        # Read-only to users, as properties (launches trust them to agree); the launch
        # paths, native and Python, read the fields (_native_contract.NAMES).
        self._device: Device = state.device
        self._name = name
        self._params = params = signature.kinds
        # Each value parameter's scalar type (None: not known) and declaration.
        self._value_types = signature.values
        # What the native launch path reads of them: None where every one takes an
        # int32 from an int, else a code per value (``_scalars.CODES``).
        codes = b"".join(CODES[type_] for type_, _ in signature.values)
        self._value_codes = None if codes.count(b"i") == len(codes) else codes
        self._binary = binary
        self._native = native
        self._buffer_count = params.count("buffer")
        self._value_count = params.count("value")
        # Launch arguments come as buffers then values; `order` maps them to the
        # parameter order (None when the kernel already declares them so).
        buffers = [i for i, k in enumerate(params) if k == "buffer"]
        values = [i for i, k in enumerate(params) if k == "value"]
        position = {p: i for i, p in enumerate(buffers + values)}
        order = [position[p] for p in range(len(params))]
        self._order = None if order == sorted(order) else order
        # Both, as the native launch path reads them: None in the common case.
        self._launch_layout: tuple[list[int] | None, bytes | None] | None = (
            None
            if self._order is None and self._value_codes is None
            else (self._order, self._value_codes)
        )

    def __repr__(self) -> str:
        return f"<Program {self._name!r} on {self._state.name} params={self._params}>"

    @property
    def device(self) -> Device:
        """The :class:`Device` it was loaded on (its launches run there only)."""
        return self._device

    @property
    def name(self) -> str:
        """The kernel's name."""
        return self._name

    @property
    def native(self) -> Any:
        """The backend's handle of the loaded kernel: its function's address (cpu), its
        CUfunction (cuda). Valid while the program is."""
        return self._native

    @property
    def buffer_count(self) -> int:
        """How many buffers a launch passes: its ``"buffer"`` parameters."""
        return self._buffer_count

    @property
    def value_count(self) -> int:
        """How many values (``vals``) a launch passes: its ``"value"`` parameters."""
        return self._value_count

    @property
    def params(self) -> tuple[ParamKind, ...]:
        """Each parameter's kind, in order: ``"buffer"`` or ``"value"``."""
        return self._params

    @property
    def value_types(self) -> tuple[tuple[str | None, str], ...]:
        """Each value parameter's scalar type (None where not known) and declaration."""
        return self._value_types

    @property
    def binary(self) -> bytes:
        """The compiled binary it was loaded from."""
        return self._binary

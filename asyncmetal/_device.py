"""Device, open_device(), devices() and the registry of backends."""

from __future__ import annotations

import atexit
import importlib
import os
import weakref
from collections.abc import AsyncIterator, Generator, Iterable
from typing import Any

import anyio

from ._backend import Backend
from ._compile import Program
from ._errors import ArgumentTypeError, AsyncMetalError, ClosedResourceError, CompileError
from ._memory import Allocator, Buffer
from ._queue import Queue
from ._timeline import Timeline, wait_value

_BACKENDS = {
    "cpu": "asyncmetal.backends.cpu:CPUBackend",
    "cuda": "asyncmetal.backends.cuda:CUDABackend",
    "metal": "asyncmetal.backends.metal:MetalBackend",
}
_PREFERENCE = ("cuda", "metal", "cpu")


def _backend_class(kind: str) -> type[Backend]:
    module, _, name = _BACKENDS[kind].partition(":")
    cls: type[Backend] = getattr(importlib.import_module(module), name)
    return cls


def _available(kind: str) -> list[str]:
    try:
        return _backend_class(kind).available()
    except ImportError:
        return []


def devices() -> list[str]:
    """The devices that can be opened here, best first: ``"cuda:0"``, ``"metal"``, ``"cpu"``.

    ``"cpu"`` is ``"cpu:0"``; ``"cpu:1"``, ``"cpu:2"``... open further independent cpu
    devices, so cross-device code runs on any machine.
    """
    return [name for kind in _PREFERENCE for name in _available(kind)]


def parse_name(name: str) -> tuple[str, int]:
    if not isinstance(name, str):
        raise ArgumentTypeError(f"device name must be a str, got {type(name).__name__}")
    kind, _, index = name.partition(":")
    if kind not in _BACKENDS or (index and not index.isdigit()):
        raise AsyncMetalError(
            f"unknown device {name!r}: expected one of {', '.join(_BACKENDS)}, "
            "optionally with ':N'"
        )
    return kind, int(index or 0)


_open_devices: weakref.WeakSet[Device] = weakref.WeakSet()


class Device:
    """An opened device. Use ``async with asyncmetal.open_device(name) as dev``."""

    def __init__(self, name: str, backend: Backend) -> None:
        self.name = name
        self._backend = backend
        self.closed = False
        self._queues: list[Queue] = []
        self._allocator = Allocator(self)
        self.queue = self.new_queue()
        _open_devices.add(self)

    def __repr__(self) -> str:
        return f"<Device {self.name}{' closed' if self.closed else ''}>"

    @property
    def kind(self) -> str:
        return self._backend.kind

    @property
    def total_memory(self) -> int:
        return self._backend.info.total_memory

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedResourceError(f"device {self.name} is closed")

    def new_queue(self) -> Queue:
        """A new queue: its own ordered stream and timeline."""
        self._check_open()
        queue = Queue(self)
        self._queues.append(queue)
        return queue

    def timeline(self) -> Timeline:
        """A new timeline at value 0, for ordering between queues, devices and the host."""
        self._check_open()
        return Timeline(self)

    async def alloc(self, nbytes: int) -> Buffer:
        """Allocate ``nbytes`` of device memory."""
        self._check_open()
        return await self._allocator.alloc(nbytes)

    async def compile(self, src: str, name: str) -> Program:
        """Compile ``src`` off the loop and load kernel ``name`` from it.

        Raises :class:`CompileError` with the compiler's log, also when ``name`` is not
        defined in ``src``. Cancelling the await abandons the result; the compile ends
        in its worker.
        """
        self._check_open()
        if not isinstance(src, str) or not isinstance(name, str):
            raise ArgumentTypeError("compile(src, name) takes two str")
        compiler = self._backend.compiler
        params = compiler.params(src, name)
        binary = await anyio.to_thread.run_sync(compiler.compile, src, abandon_on_cancel=True)
        native = await anyio.to_thread.run_sync(self._load, binary, name)
        return Program(self, name, params, binary, native)

    async def compile_many(self, kernels: Iterable[tuple[str, str]]) -> AsyncIterator[Program]:
        """Compile every ``(src, name)``; yield each program as soon as it is ready."""
        items = list(kernels)
        send, receive = anyio.create_memory_object_stream[Program | BaseException](len(items))

        async def one(src: str, name: str) -> None:
            try:
                result: Program | BaseException = await self.compile(src, name)
            except AsyncMetalError as exc:
                result = exc
            await send.send(result)

        async with anyio.create_task_group() as tg, receive:
            for src, name in items:
                tg.start_soon(one, src, name)
            for _ in items:
                result = await receive.receive()
                if isinstance(result, BaseException):
                    raise result
                yield result

    def _load(self, binary: bytes, name: str) -> Any:
        try:
            return self._backend.load(binary, name)
        except AttributeError:
            raise CompileError(f"kernel {name!r} is not defined in the compiled code") from None

    async def synchronize(self) -> None:
        """Wait until every queue of this device has finished what was submitted."""
        for queue in list(self._queues):
            await wait_value(queue.timeline, queue.submitted)

    async def close(self) -> None:
        """Let submitted work finish, then release the device.

        Shielded from cancellation: a device is never left half-closed.
        """
        if self.closed:
            return
        with anyio.CancelScope(shield=True):
            await self.synchronize()
            self.closed = True
            await anyio.to_thread.run_sync(self._close_native)

    def _close_native(self) -> None:
        self.closed = True
        for queue in self._queues:
            queue._native.close()
        self._allocator.sweep()
        self._backend.close()
        _open_devices.discard(self)

    async def __aenter__(self) -> Device:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _DeviceOpener:
    """What open_device returns: ``async with`` it, or ``await`` it."""

    def __init__(self, name: str | None) -> None:
        self._name = name
        self._device: Device | None = None

    async def _open(self) -> Device:
        name = self._name or os.environ.get("ASYNCMETAL_DEVICE") or (devices() or ["cpu"])[0]
        kind, index = parse_name(name)
        cls = _backend_class(kind)
        available = cls.available()
        if kind != "cpu" and name not in available and f"{kind}:{index}" not in available:
            raise AsyncMetalError(
                f"device {name!r} is not available here (available: {devices()})"
            )
        backend = await anyio.to_thread.run_sync(cls, index)
        return Device(name, backend)

    def __await__(self) -> Generator[Any, None, Device]:
        return self._open().__await__()

    async def __aenter__(self) -> Device:
        self._device = await self._open()
        return self._device

    async def __aexit__(self, *exc: object) -> None:
        assert self._device is not None
        await self._device.close()


def open_device(name: str | None = None) -> _DeviceOpener:
    """Open a device: ``async with open_device("cpu") as dev`` or ``dev = await ...``.

    ``name`` None means ``$ASYNCMETAL_DEVICE``, else the best device available.
    """
    return _DeviceOpener(name)


def _close_all_at_exit() -> None:
    # Drain in-flight work before the interpreter finalizes, so no device thread or
    # native callback runs into a half-torn-down interpreter.
    for device in list(_open_devices):
        if not device.closed:
            try:
                device._close_native()
            except Exception:  # noqa: S110 - exiting: nothing left to report to
                pass


atexit.register(_close_all_at_exit)

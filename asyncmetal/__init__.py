"""asyncmetal: awaitable GPU work for asyncio, uvloop and trio."""

from ._allocator import MemoryStatistics as MemoryStatistics
from ._bridge import LoopStatistics as LoopStatistics
from ._bridge import loop_statistics as loop_statistics
from ._buffer import Buffer as Buffer
from ._cache import CacheWarning as CacheWarning
from ._cache import CompileCache as CompileCache
from ._compile import Compiler as Compiler
from ._compile import NotDefinedError as NotDefinedError
from ._device import CompileMany as CompileMany
from ._device import Device as Device
from ._device import DeviceOpener as DeviceOpener
from ._device import devices as devices
from ._device import from_numpy as from_numpy
from ._device import open_device as open_device
from ._device import open_devices as open_devices
from ._dlpack import TypedView as TypedView
from ._errors import ArgumentTypeError as ArgumentTypeError
from ._errors import AsyncMetalError as AsyncMetalError
from ._errors import ClosedResourceError as ClosedResourceError
from ._errors import CompileError as CompileError
from ._errors import CompileWarning as CompileWarning
from ._errors import DeviceLostError as DeviceLostError
from ._errors import DeviceNotFoundError as DeviceNotFoundError
from ._errors import ExchangeError as ExchangeError
from ._errors import InvalidArgumentError as InvalidArgumentError
from ._errors import NoLoopError as NoLoopError
from ._errors import OutOfMemoryError as OutOfMemoryError
from ._interop import from_dlpack as from_dlpack
from ._pool import CompilePool as CompilePool
from ._program import Program as Program
from ._queue import Completion as Completion
from ._queue import Queue as Queue
from ._timeline import Timeline as Timeline
from ._transfer import copy as copy

__version__ = "0.1.0"

__all__ = [
    "MemoryStatistics",
    "LoopStatistics",
    "loop_statistics",
    "Buffer",
    "CacheWarning",
    "CompileCache",
    "Compiler",
    "CompileMany",
    "Device",
    "DeviceOpener",
    "devices",
    "from_numpy",
    "open_device",
    "open_devices",
    "TypedView",
    "ArgumentTypeError",
    "AsyncMetalError",
    "ClosedResourceError",
    "CompileError",
    "CompileWarning",
    "DeviceLostError",
    "DeviceNotFoundError",
    "ExchangeError",
    "InvalidArgumentError",
    "NoLoopError",
    "NotDefinedError",
    "OutOfMemoryError",
    "from_dlpack",
    "CompilePool",
    "Program",
    "Completion",
    "Queue",
    "Timeline",
    "copy",
]

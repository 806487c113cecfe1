"""CUDA timelines: native-runtime timelines with a device word in pinned memory."""

from __future__ import annotations

import ctypes
import weakref
from typing import Any, Protocol

from ... import _native
from ..._backend import ForkableTimeline, InheritedValue
from ..._errors import NoHostMemoryError
from ..._native import fast_call
from ._driver import check, cu


class TimelineDevice(Protocol):
    """What a timeline needs of its GPU (a ``CUDABackend``): the native runtime, and a
    device word of pinned memory."""

    lib: Any

    def _timeline_slot(self) -> int: ...

    def _release_slot(self, slot: int) -> None: ...

    def _retire_timeline(self, c_timeline: int, slot: int) -> None: ...


class Pinned:
    """Pinned, device-mapped, portable host memory."""

    def __init__(self, nbytes: int, where: str = "") -> None:
        flags = cu.CU_MEMHOSTALLOC_PORTABLE | cu.CU_MEMHOSTALLOC_DEVICEMAP
        self.address = int(check(cu.cuMemHostAlloc(nbytes, flags), "cuMemHostAlloc", where))
        self.nbytes = nbytes
        ctypes.memset(self.address, 0, nbytes)

    def free(self) -> None:
        if self.address:
            cu.cuMemFreeHost(self.address)
            self.address = 0


class CUDATimeline(ForkableTimeline):
    """A native-runtime timeline with a device word in pinned memory: streams write and
    wait on the word; the timeline's value (what the host reads, awaits and reports) is
    raised by host signals, and for device writes only once a completion thread has
    confirmed the work before them succeeded."""

    def __init__(self, backend: TimelineDevice) -> None:
        # The device word: unified addressing makes it the same pointer on every GPU.
        self.address = backend._timeline_slot()
        ctypes.c_uint64.from_address(self.address).value = 0  # a reused slot holds an old value
        self.c_timeline: int = backend.lib.am_timeline_new()
        if not self.c_timeline:
            backend._release_slot(self.address)
            raise NoHostMemoryError("am_timeline_new returned NULL: no memory for a timeline")
        self._backend = backend
        backend.lib.am_timeline_set_word(self.c_timeline, self.address)
        self._value: _native.ValueReader = _native.timeline_reader(self.c_timeline)
        self._word = ctypes.c_uint64.from_address(self.address)
        self._host_signal = fast_call(backend.lib, "am_timeline_host_signal")
        self.queue: object = None  # the CUDAQueue whose own timeline this is
        # The last queue signal of it: (a weak reference to that CUDAQueue, the command,
        # the value it raises the timeline to); a hand-over of a wait held for it hands
        # that command over first (CUDAQueue._hand_over_signals).
        self.last_signal: tuple[weakref.ref[Any], int, int] | None = None

    @property
    def value(self) -> int:
        return self._value.value

    def reached(self, target: int) -> bool:
        """Whether the device word got to ``target``: written by a stream behind its work
        (not yet confirmed by a completion thread), or raised by a host signal."""
        return self._word.value >= target

    releases_device_work = True
    # A stream's 64-bit wait compares cyclically, (int64_t)(word - target) >= 0: it holds
    # as "word >= target" only while both stay below 2**63.
    max_value = (1 << 63) - 1

    def signal(self, value: int) -> None:
        # Raises the word, then wakes napping completion threads: a stream's wait it
        # releases is confirmed within microseconds rather than at the end of a nap.
        self._host_signal(self.c_timeline, value, 0)

    def signal_here(self, value: int, notifier: int) -> None:
        self._host_signal(self.c_timeline, value, notifier)

    def close_waits(self, pending: int = 0) -> None:
        # A queue's own: its native queue, closed, fails other queues' device waits for
        # values it never got to (am_cuq_close); its word stays where its stream left it.
        if self.queue is None:
            super().close_waits()

    def forked(self, message: str) -> None:
        # The completion threads that raise it are the parent's; its word and slot are
        # left as they are (the parent's pinned memory).
        self._value = InheritedValue(message)

    def __del__(self) -> None:
        backend = getattr(self, "_backend", None)
        inherited = isinstance(getattr(self, "_value", None), InheritedValue)
        if backend is not None and backend.lib is not None and not inherited:
            # Freed, and its slot reused, once the runtime holds no reference of it.
            backend._retire_timeline(self.c_timeline, self.address)


# Every staging chunk's mapping, until freed: a chunk dropped unfreed (a queue abandoned

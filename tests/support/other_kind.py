"""A second kind of device, for copies between kinds through a host-visible buffer."""

from __future__ import annotations

import numpy as np
import pytest

import asyncmetal as am
from asyncmetal import backends
from asyncmetal.backends.cpu import CPUBackend


class OtherKind(CPUBackend):
    """A second kind of device whose memory the host cannot see: copies between it and
    the cpu device run on its queue, reading or writing the cpu buffer in place."""

    kind = "cpu2"
    host_visible = False

    @classmethod
    def available(cls) -> list[str]:
        return ["cpu2"]


class HostKind(CPUBackend):
    """A second kind of device whose memory the host sees, as the cpu device's: a
    copy between it and the cpu device reads the source in place on the destination's
    queue."""

    kind = "cpu3"

    @classmethod
    def available(cls) -> list[str]:
        return ["cpu3"]


class NoWaitKind(HostKind):
    """A second kind of device whose memory the host sees, and whose queues cannot wait
    for other kinds' queues (on the device)."""

    kind = "cpu4"
    waits_across_kinds = False

    @classmethod
    def available(cls) -> list[str]:
        return ["cpu4"]


async def held_pair(
    monkeypatch: pytest.MonkeyPatch, cpu_name: str
) -> tuple[am.Device, am.Device, am.Buffer, am.Buffer, am.Timeline]:
    """Opens ``cpu_name`` and a device of the other kind, with a 64-byte buffer on each
    (the cpu one, ``mine``, holding 1s; the other's, ``theirs``, 3s), and holds the
    other device's default queue behind a wait on a timeline it returns (signal 1 to go
    on). Returns (cpu, other, mine, theirs, gate); the caller closes both devices."""
    monkeypatch.setitem(backends.BACKENDS, "cpu2", f"{__name__}:OtherKind")
    cpu = await am.open_device(cpu_name)
    other = await am.open_device("cpu2")
    theirs = await other.alloc(64)
    await theirs.write(np.full(16, 3, np.int32))
    mine = await cpu.alloc(64)
    await mine.write(np.full(16, 1, np.int32))
    gate = other.timeline()
    other.queue.wait(gate, 1)  # copies on the other queue stay pending behind this
    return cpu, other, mine, theirs, gate

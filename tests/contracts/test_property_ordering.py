"""Random programs of ordered work over two cpu devices, run on the devices and checked
against a model of what the documented ordering rules promise: every byte a command
reads back, every await's outcome, which signals are refused, and that awaiting a
command shows every command it was ordered after done.

A program allocates buffers, writes and reads them through host arrays (``q.copy``),
fills them, copies them between queues and between ``cpu:0`` and ``cpu:1``, launches
kernels on them -- ordered with ``q.after(...)``, or without it where queue order and
timeline waits already order the launch after every earlier use of its buffers --,
signals timelines from queues and from the host, waits on them on the device (also
before anything signals the value) and on the host, takes markers, makes and closes
queues, frees and drops buffers, and awaits commands in tasks of their own, some of
them cancelled part-way (which detaches that waiter only).

The model is a graph of the commands: each comes after its queue's previous command,
after the earlier commands of other queues on the same buffers when it orders itself
by them (copies, fills, ``after``), after the signal that first raises a timeline to
what it waits for, and a queue's signal after the previous queue signal of its
timeline. A command is blocked while something before it waits for a value nothing
submitted reaches yet. Programs stay inside defined behaviour: two commands that use
the same bytes, one writing, are always ordered, so running the commands in
submission order gives every byte; and timelines are either the host's or the
queues' (a host signal of a timeline a queue's signal of which is pending is refused,
so the host could not otherwise release what waits on it). A queue signal that comes
after a device wait on its own timeline for more than the signals so far reach could
never run, and must be refused (``InvalidArgumentError``); one whose ancestors wait on
another queue-signalled timeline beyond its signals (whether it deadlocks depends on
signals still to come) is left out.

``buf.free()`` returns once the buffer's uses ended, so it is awaited in a task too.
At the end the host either releases every wait (host signals, and a fresh queue's
signal of each queue timeline), after which every await must end, every byte match
and memory return to zero; or closes the devices with work still blocked (and maybe
some not run yet), after which each blocked await must end with
``ClosedResourceError`` (a queue's close and a free return) and nothing may hang.
Either way no thread of the devices is left.

It runs a fixed set of programs (derandomized, 80 per loop, about 15 s). To hunt longer:
``ASYNCMETAL_PROPERTY_EXAMPLES=3000 ASYNCMETAL_PROPERTY_RANDOM=1``. The same programs
run on metal (two devices over the one Metal device, and cpu with metal: a queue waits
on and signals only timelines of its own kind's devices), 20 per pair and loop (about
15 s more).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncmetal as am
from tests.contracts.test_property_memory import _left, _threads, host_bytes, mixed

KERNELS = """
void mix(unsigned char* p, int n, int v) {
    for (int i = 0; i < n; i++) p[i] = (unsigned char)(p[i] * 3 + v + i);
}
void mix2(unsigned char* d, const unsigned char* s, int n, int v) {
    for (int i = 0; i < n; i++) d[i] = (unsigned char)(d[i] * 5 + s[i] + v);
}
"""
# The same kernels in the Metal Shading Language (one thread by default does it all)
MSL_KERNELS = """
#include <metal_stdlib>
using namespace metal;
kernel void mix(device uchar* p [[buffer(0)]], constant int& n [[buffer(1)]],
                constant int& v [[buffer(2)]], uint i [[thread_position_in_grid]]) {
    if (i == 0) for (int j = 0; j < n; j++) p[j] = (uchar)(p[j] * 3 + v + j);
}
kernel void mix2(device uchar* d [[buffer(0)]], const device uchar* s [[buffer(1)]],
                 constant int& n [[buffer(2)]], constant int& v [[buffer(3)]],
                 uint i [[thread_position_in_grid]]) {
    if (i == 0) for (int j = 0; j < n; j++) d[j] = (uchar)(d[j] * 5 + s[j] + v);
}
"""
DEVS = ("cpu:0", "cpu:1")
# The pairs the programs also run on where metal opens (the simulation here): two
# devices over the one Metal device, and metal with cpu (copies go both ways).
METAL_PAIRS = {"metal-metal": ("metal", "metal"), "cpu-metal": ("cpu:0", "metal")}
SIZE = 64  # bytes, every buffer
START_QUEUES = 3  # per device: the default queue and two more
MAX_QUEUES = 5
# Timelines: (device index, signalled by the host?)
TIMELINES = ((0, True), (1, True), (0, False), (1, False))
LOOPS = {"asyncio": {"debug": True}, "trio": {}}
PROGRAM_TIMEOUT = float(os.environ.get("ASYNCMETAL_PROPERTY_TIMEOUT", 30))


def mixed2(d: np.ndarray, s: np.ndarray, v: int) -> np.ndarray:
    out: np.ndarray = ((d.astype(np.int64) * 5 + s + v) & 0xFF).astype(np.uint8)
    return out


@dataclass
class Node:
    """A command of the program, or a host signal (queue -1)."""

    id: int
    queue: int
    preds: set[int]
    wait: tuple[int, int] | None = None  # (timeline, value) of a device wait
    signal: tuple[int, int] | None = None  # (timeline, value) of a signal


@dataclass
class Program:
    ops: list[tuple[Any, ...]] = field(default_factory=list)


class Gen:
    """The model, as the program is drawn."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.queues: list[tuple[int, bool]] = []  # queue id -> (device, closed)
        self.last: dict[int, int] = {}  # queue id -> its last command
        self.signals: list[list[int]] = [[] for _ in TIMELINES]  # node ids, in order
        self.highest = [0] * len(TIMELINES)  # signalled or submitted up to
        self.waited = [0] * len(TIMELINES)  # the most waited for
        self.bufs: dict[int, int] = {}  # live buffer id -> device
        self.users: dict[int, list[int]] = {}  # buffer id -> the commands that used it
        self.data: dict[int, np.ndarray] = {}
        self.known: dict[int, np.ndarray] = {}
        self.tasks: list[tuple[int, str, Any, int]] = []  # (task, kind, what, value)
        self.next_buf = 0
        self.seed = 0

    # -- the graph
    def satisfier(self, tl: int, value: int) -> int | None:
        for nid in self.signals[tl]:
            signal = self.nodes[nid].signal
            assert signal is not None
            if signal[1] >= value:
                return nid
        return None

    def blocked(self, nid: int, memo: dict[int, bool]) -> bool:
        if nid in memo:
            return memo[nid]
        memo[nid] = True
        node = self.nodes[nid]
        result = any(self.blocked(p, memo) for p in node.preds)
        if not result and node.wait is not None:
            s = self.satisfier(*node.wait)
            result = s is None or self.blocked(s, memo)
        memo[nid] = result
        return result

    def ancestors(self, preds: set[int]) -> set[int]:
        seen: set[int] = set()
        todo = list(preds)
        while todo:
            nid = todo.pop()
            if nid in seen:
                continue
            seen.add(nid)
            node = self.nodes[nid]
            todo.extend(node.preds)
            if node.wait is not None:
                s = self.satisfier(*node.wait)
                if s is not None:
                    todo.append(s)
        return seen

    def add(self, queue: int, preds: set[int], **kw: Any) -> int:
        nid = len(self.nodes)
        if queue >= 0 and queue in self.last:
            preds = preds | {self.last[queue]}
        self.nodes.append(Node(nid, queue, preds, **kw))
        if queue >= 0:
            self.last[queue] = nid
        return nid

    def implicit(self, queue: int, bufs: tuple[int, ...]) -> set[int]:
        """What a copy or fill (or a launch after ``after``) orders itself after."""
        return {u for b in bufs for u in self.users[b] if self.nodes[u].queue != queue}

    def uses(self, nid: int, bufs: tuple[int, ...]) -> None:
        for b in bufs:
            self.users[b].append(nid)

    def ordered_without_after(self, queue: int, bufs: tuple[int, ...]) -> bool:
        """Whether every earlier use of ``bufs`` comes before a command on ``queue``
        now, by queue order and device waits alone."""
        before = self.ancestors({self.last[queue]}) if queue in self.last else set()
        return all(u in before for b in bufs for u in self.users[b])


def open_queues(g: Gen, dev: int | None = None) -> list[int]:
    return [q for q, (d, closed) in enumerate(g.queues) if not closed and dev in (None, d)]


@st.composite
def programs(draw: st.DrawFn, backends: tuple[str, ...] = ("cpu", "cpu")) -> Program:
    """``backends``: each device's kind (a queue waits on and signals only timelines of
    its own kind's devices)."""
    g = Gen()
    prog = Program()
    ops = prog.ops
    for d in range(len(DEVS)):
        for _ in range(START_QUEUES):
            g.queues.append((d, False))

    def new_buf(dev: int) -> int:
        g.next_buf += 1
        b = g.next_buf
        g.bufs[b] = dev
        g.users[b] = []
        g.data[b] = np.zeros(SIZE, np.uint8)
        g.known[b] = np.zeros(SIZE, bool)
        ops.append(("alloc", b, dev))
        return b

    def seed() -> int:
        g.seed += 1
        return draw(st.integers(0, 2**32 - 1))

    def pick_buf(dev: int | None = None) -> int:
        choices = sorted(b for b, d in g.bufs.items() if dev in (None, d))
        if not choices:
            return new_buf(draw(st.integers(0, len(DEVS) - 1)) if dev is None else dev)
        return draw(st.sampled_from(choices))

    def pick_queue(dev: int) -> int:
        return draw(st.sampled_from(open_queues(g, dev)))

    def queue_for(tl: int) -> int:
        kind = backends[TIMELINES[tl][0]]
        return draw(
            st.sampled_from([q for q in open_queues(g) if backends[g.queues[q][0]] == kind])
        )

    def task(kind: str, what: Any, value: int = 0) -> int:
        t = len(g.tasks)
        g.tasks.append((t, kind, what, value))
        return t

    kinds = [
        "alloc", "write", "write", "read", "read", "fill", "copy", "copy", "launch",
        "launch", "launch", "launch2", "launch2", "signal", "signal", "wait", "wait",
        "hsignal", "hwait", "marker", "await", "await", "settle", "newq", "closeq",
        "release", "bad",
    ]  # fmt: skip
    for _ in range(draw(st.integers(5, 45))):
        kind = draw(st.sampled_from(kinds))
        if kind == "alloc":
            new_buf(draw(st.integers(0, len(DEVS) - 1)))
        elif kind == "write":  # q.copy(buf, host array)
            b = pick_buf()
            q = pick_queue(g.bufs[b])
            s = seed()
            nid = g.add(q, g.implicit(q, (b,)))
            g.uses(nid, (b,))
            g.data[b] = host_bytes(s, SIZE)
            g.known[b][:] = True
            ops.append(("write", nid, q, b, s))
        elif kind == "read":  # q.copy(host array, buf), checked against the model
            b = pick_buf()
            q = pick_queue(g.bufs[b])
            nid = g.add(q, g.implicit(q, (b,)))
            g.uses(nid, (b,))
            ops.append(("read", nid, q, b, g.data[b].copy(), g.known[b].copy()))
        elif kind == "fill":
            b = pick_buf()
            q = pick_queue(g.bufs[b])
            value = draw(st.integers(0, 255))
            nid = g.add(q, g.implicit(q, (b,)))
            g.uses(nid, (b,))
            g.data[b][:] = value
            g.known[b][:] = True
            ops.append(("fill", nid, q, b, value))
        elif kind == "copy":  # within a device or from the other one, on dst's queue
            dst = pick_buf()
            src = pick_buf()
            if src == dst:
                continue
            q = pick_queue(g.bufs[dst])
            nid = g.add(q, g.implicit(q, (dst, src)))
            g.uses(nid, (dst, src))
            g.data[dst] = g.data[src].copy()
            g.known[dst] = g.known[src].copy()
            ops.append(("copy", nid, q, dst, src))
        elif kind in ("launch", "launch2"):
            dst = pick_buf()
            bufs: tuple[int, ...] = (dst,)
            if kind == "launch2":
                src = pick_buf(g.bufs[dst])
                if src == dst:
                    continue
                bufs = (dst, src)
            q = pick_queue(g.bufs[dst])
            after = draw(st.booleans()) or not g.ordered_without_after(q, bufs)
            v = draw(st.integers(0, 255))
            nid = g.add(q, g.implicit(q, bufs) if after else set())
            g.uses(nid, bufs)
            if kind == "launch":
                g.data[dst] = mixed(g.data[dst], v)
                g.known[dst] = g.known[dst].copy()
            else:
                g.data[dst] = mixed2(g.data[dst], g.data[bufs[1]], v)
                g.known[dst] = g.known[dst] & g.known[bufs[1]]
            ops.append((kind, nid, q, bufs, v, after))
        elif kind == "signal":  # a queue's signal of a queue timeline
            tl = draw(st.sampled_from([i for i, (_, host) in enumerate(TIMELINES) if not host]))
            q = queue_for(tl)
            value = g.highest[tl] + draw(st.integers(1, 2))
            preds = {g.signals[tl][-1]} if g.signals[tl] else set()
            if q in g.last:
                preds.add(g.last[q])
            before = g.ancestors(preds)
            unsatisfied = {
                w[0]
                for n in before
                if (w := g.nodes[n].wait) is not None and g.satisfier(*w) is None
            }
            if tl in unsatisfied:  # it would wait for itself: refused, nothing submitted
                ops.append(("signal_refused", q, tl, value))
                continue
            if any(not TIMELINES[t][1] for t in unsatisfied):
                continue  # (whether it deadlocks depends on signals still to come)
            nid = g.add(q, preds, signal=(tl, value))
            g.signals[tl].append(nid)
            g.highest[tl] = value
            ops.append(("signal", nid, q, tl, value))
        elif kind == "wait":
            tl = draw(st.integers(0, len(TIMELINES) - 1))
            q = queue_for(tl)
            value = draw(st.integers(1, g.highest[tl] + 2))
            g.waited[tl] = max(g.waited[tl], value)
            nid = g.add(q, set(), wait=(tl, value))
            ops.append(("wait", nid, q, tl, value))
        elif kind == "hsignal":
            tl = draw(st.sampled_from([i for i, (_, host) in enumerate(TIMELINES) if host]))
            value = g.highest[tl] + draw(st.integers(1, 2))
            nid = g.add(-1, set(), signal=(tl, value))
            g.signals[tl].append(nid)
            g.highest[tl] = value
            ops.append(("hsignal", tl, value))
        elif kind == "hwait":
            tl = draw(st.integers(0, len(TIMELINES) - 1))
            value = draw(st.integers(1, g.highest[tl] + 2))
            g.waited[tl] = max(g.waited[tl], value)
            ops.append(("hwait", task("tl", tl, value), tl, value))
        elif kind == "marker":
            q = draw(st.sampled_from(open_queues(g)))
            if q not in g.last:
                continue
            # (on cpu a marker is no command: the Completion of the queue's last one)
            ops.append(("marker", g.last[q], q, task("node", g.last[q])))
        elif kind == "await":
            cmds = [n.id for n in g.nodes if n.queue >= 0]
            if not cmds:
                continue
            nid = draw(st.sampled_from(cmds))
            cancel = draw(st.one_of(st.none(), st.none(), st.integers(0, 3)))
            ops.append(("await", task("node", nid), nid, cancel))
        elif kind == "settle":
            settle(g, ops)
        elif kind == "newq":
            d = draw(st.integers(0, len(DEVS) - 1))
            if len([q for q, (dd, _) in enumerate(g.queues) if dd == d]) < MAX_QUEUES:
                g.queues.append((d, False))
                ops.append(("newq", len(g.queues) - 1, d))
        elif kind == "closeq":
            closable = [q for q in open_queues(g) if q % START_QUEUES or q >= 2 * START_QUEUES]
            if closable:
                q = draw(st.sampled_from(closable))
                g.queues[q] = (g.queues[q][0], True)
                ops.append(("closeq", q, task("close", q)))
        elif kind == "release":
            if g.bufs:
                b = draw(st.sampled_from(sorted(g.bufs)))
                del g.bufs[b]
                if draw(st.booleans()):
                    ops.append(("drop", b))
                else:  # awaited in a task: free() returns once the buffer's uses ended
                    ops.append(("free", b, task("nodes", tuple(g.users[b]))))
        else:  # refused before anything is submitted
            what = draw(st.sampled_from(["backwards", "host_of_queue_tl", "closed"]))
            if what == "backwards":
                tl = draw(st.integers(0, len(TIMELINES) - 1))
                if g.highest[tl]:
                    host = TIMELINES[tl][1]
                    q = -1 if host else queue_for(tl)
                    ops.append(("bad_backwards", q, tl, draw(st.integers(1, g.highest[tl]))))
            elif what == "host_of_queue_tl":
                # a host signal while a queue's signal of the timeline certainly has not
                # run (it is blocked)
                memo: dict[int, bool] = {}
                pending = [
                    tl
                    for tl, (_, host) in enumerate(TIMELINES)
                    if not host and g.signals[tl] and g.blocked(g.signals[tl][-1], memo)
                ]
                if pending:
                    tl = draw(st.sampled_from(pending))
                    ops.append(("bad_host_signal", tl, g.highest[tl] + 1))
            else:
                closed = [q for q, (_, c) in enumerate(g.queues) if c]
                if closed:
                    ops.append(("bad_closed", draw(st.sampled_from(closed)), pick_buf()))
    release = draw(st.integers(0, 3)) > 0
    if release:  # every wait released: the host's timelines, then a fresh queue's signals
        for tl, (_, host) in enumerate(TIMELINES):
            if host and g.waited[tl] > g.highest[tl]:
                nid = g.add(-1, set(), signal=(tl, g.waited[tl]))
                g.signals[tl].append(nid)
                g.highest[tl] = g.waited[tl]
                ops.append(("hsignal", tl, g.waited[tl]))
        for tl, (d, host) in enumerate(TIMELINES):
            if not host and g.waited[tl] > g.highest[tl]:
                g.queues.append((d, False))
                q = len(g.queues) - 1
                ops.append(("newq", q, d))
                preds = {g.signals[tl][-1]} if g.signals[tl] else set()
                nid = g.add(q, preds, signal=(tl, g.waited[tl]))
                g.signals[tl].append(nid)
                g.highest[tl] = g.waited[tl]
                ops.append(("signal", nid, q, tl, g.waited[tl]))
        settle(g, ops)
        memo = {}
        assert not any(g.blocked(n.id, memo) for n in g.nodes)
        final = {b: (g.data[b].copy(), g.known[b].copy()) for b in g.bufs}
        ops.append(("end_released", final))
    else:
        if draw(st.booleans()):
            settle(g, ops)  # (else some of what can run may not have run by the close)
        memo = {}
        blocked = {n.id for n in g.nodes if n.queue >= 0 and g.blocked(n.id, memo)}
        # A free whose buffer's uses the close abandons returns (its memory is back), and
        # so does a queue's close: once the device's has ended.
        ends = {t for t, kind, _, _ in g.tasks if kind in ("nodes", "close")}
        ops.append(("end_closed", blocked, blocked_tasks(g, memo) - ends))
    return prog


def reached(g: Gen, tl: int, memo: dict[int, bool]) -> int:
    """What the unblocked signals of ``tl`` raise it to."""
    return max(
        [0]
        + [
            s[1]
            for nid in g.signals[tl]
            if (s := g.nodes[nid].signal) is not None and not g.blocked(nid, memo)
        ]
    )


def blocked_tasks(g: Gen, memo: dict[int, bool]) -> set[int]:
    """The tasks that cannot end yet: awaits of blocked commands, host waits beyond what
    the timeline can reach, closes of queues with blocked commands."""
    out = set()
    for t, kind, what, value in g.tasks:
        if kind == "node":
            stuck = g.blocked(what, memo)
        elif kind == "nodes":
            stuck = any(g.blocked(n, memo) for n in what)
        elif kind == "tl":
            stuck = reached(g, what, memo) < value
        else:
            stuck = what in g.last and g.blocked(g.last[what], memo)
        if stuck:
            out.add(t)
    return out


def settle(g: Gen, ops: list[tuple[Any, ...]]) -> None:
    """Await every command that can run, newest first, checking that what each was
    ordered after shows done once it is; then every task that can end."""
    memo: dict[int, bool] = {}
    ready = [
        (n.id, sorted(a for a in g.ancestors(n.preds) if g.nodes[a].queue >= 0))
        for n in reversed(g.nodes)
        if n.queue >= 0 and not g.blocked(n.id, memo)
    ]
    ops.append(("settle", set(range(len(g.tasks))) - blocked_tasks(g, memo), ready))


class Runner:
    def __init__(self, devs: list[am.Device], tg: anyio.abc.TaskGroup) -> None:
        self.devs = devs
        self.tg = tg
        self.queues: list[am.Queue] = []
        self.tls: list[am.Timeline] = []
        self.bufs: dict[int, am.Buffer] = {}
        self.done: dict[int, am.Completion] = {}
        self.reads: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, str]] = {}
        self.checked: set[int] = set()
        self.tasks: dict[
            int, tuple[anyio.Event, list[BaseException | None], anyio.CancelScope]
        ] = {}
        self.kernels: list[dict[str, am.Program]] = []
        self.hold: list[Any] = []  # host arrays of copies in flight

    async def start(self) -> None:
        for dev in self.devs:
            self.kernels.append(
                {
                    name: await dev.compile(MSL_KERNELS if dev.name == "metal" else KERNELS, name)
                    for name in ("mix", "mix2")
                }
            )
            self.queues += [dev.queue, *(dev.new_queue() for _ in range(START_QUEUES - 1))]
        self.tls = [self.devs[d].timeline() for d, _ in TIMELINES]

    def spawn(self, t: int, fn: Any) -> None:
        event, scope = anyio.Event(), anyio.CancelScope()
        outcome: list[BaseException | None] = []

        async def run() -> None:
            try:
                with scope:
                    await fn()
                outcome.append(None)  # (also where the scope swallowed its cancel)
            except BaseException as exc:  # (checked where the task is settled)
                outcome.append(exc)
                if not isinstance(exc, Exception):
                    raise
            finally:
                event.set()

        self.tasks[t] = (event, outcome, scope)
        self.tg.start_soon(run)

    async def op(self, what: str, kind: str, *args: Any) -> None:
        await getattr(self, "op_" + kind)(what, *args)

    async def op_alloc(self, what: str, b: int, d: int) -> None:
        self.bufs[b] = await self.devs[d].alloc(SIZE)

    async def op_write(self, what: str, nid: int, q: int, b: int, seed: int) -> None:
        self.done[nid] = self.queues[q].copy(self.bufs[b], host_bytes(seed, SIZE))

    async def op_read(
        self, what: str, nid: int, q: int, b: int, expected: np.ndarray, known: np.ndarray
    ) -> None:
        out = np.zeros(SIZE, np.uint8)
        self.done[nid] = self.queues[q].copy(out, self.bufs[b])
        self.reads[nid] = (out, expected, known, what)

    async def op_fill(self, what: str, nid: int, q: int, b: int, value: int) -> None:
        self.done[nid] = self.queues[q].fill(self.bufs[b], value)

    async def op_copy(self, what: str, nid: int, q: int, dst: int, src: int) -> None:
        self.done[nid] = self.queues[q].copy(self.bufs[dst], self.bufs[src])

    async def op_launch(
        self, what: str, nid: int, q: int, bufs: tuple[int, ...], v: int, after: bool
    ) -> None:
        queue = self.queues[q]
        buffers = [self.bufs[b] for b in bufs]
        if after:
            queue = queue.after(*buffers)
        name = "mix" if len(buffers) == 1 else "mix2"
        kernel = self.kernels[self.devs.index(buffers[0].device)][name]
        self.done[nid] = queue.launch(kernel, *buffers, vals=(SIZE, v))

    op_launch2 = op_launch

    async def op_signal(self, what: str, nid: int, q: int, tl: int, value: int) -> None:
        self.done[nid] = self.queues[q].signal(self.tls[tl], value)

    async def op_signal_refused(self, what: str, q: int, tl: int, value: int) -> None:
        queue = self.queues[q]
        submitted = queue.timeline.value, queue.marker().value
        with pytest.raises(am.InvalidArgumentError):
            queue.signal(self.tls[tl], value)
        assert queue.marker().value == submitted[1], f"{what}: submitted all the same"

    async def op_wait(self, what: str, nid: int, q: int, tl: int, value: int) -> None:
        self.done[nid] = self.queues[q].wait(self.tls[tl], value)

    async def op_hsignal(self, what: str, tl: int, value: int) -> None:
        self.tls[tl].signal(value)
        assert self.tls[tl].value >= value, what

    async def op_hwait(self, what: str, t: int, tl: int, value: int) -> None:
        timeline = self.tls[tl]

        async def wait() -> None:
            await timeline.wait(value)
            assert timeline.value >= value, f"{what}: woken at {timeline.value}"

        self.spawn(t, wait)

    async def op_marker(self, what: str, nid: int, q: int, t: int) -> None:
        marker = self.queues[q].marker()
        assert marker.value == self.done[nid].value, what
        self.spawn(t, lambda: marker)

    async def op_await(self, what: str, t: int, nid: int, cancel: int | None) -> None:
        done = self.done[nid]
        self.spawn(t, lambda: done)
        if cancel is not None:
            for _ in range(cancel):
                await anyio.lowlevel.checkpoint()
            self.tasks[t][2].cancel()

    async def op_newq(self, what: str, q: int, d: int) -> None:
        assert len(self.queues) == q
        self.queues.append(self.devs[d].new_queue())

    async def op_closeq(self, what: str, q: int, t: int) -> None:
        queue = self.queues[q]
        self.spawn(t, queue.close)
        while not queue.closed:  # (closed at the close's first step)
            await anyio.lowlevel.checkpoint()

    async def op_free(self, what: str, b: int, t: int) -> None:
        buf = self.bufs.pop(b)
        self.spawn(t, buf.free)
        while not buf.freed:  # (unusable from the free's first step: begun before what follows)
            await anyio.lowlevel.checkpoint()

    async def op_drop(self, what: str, b: int) -> None:
        del self.bufs[b]

    async def op_bad_backwards(self, what: str, q: int, tl: int, value: int) -> None:
        timeline = self.tls[tl]
        signal = timeline.signal if q < 0 else functools.partial(self.queues[q].signal, timeline)
        with pytest.raises(am.InvalidArgumentError):
            signal(value)

    async def op_bad_host_signal(self, what: str, tl: int, value: int) -> None:
        with pytest.raises(am.InvalidArgumentError, match="has not run yet"):
            self.tls[tl].signal(value)

    async def op_bad_closed(self, what: str, q: int, b: int) -> None:
        queue, buf = self.queues[q], self.bufs[b]
        with pytest.raises(am.ClosedResourceError):
            queue.fill(buf, 0)

    async def op_settle(
        self, what: str, tasks: set[int], ready: list[tuple[int, list[int]]]
    ) -> None:
        for nid, before in ready:
            await self.done[nid]
            for a in before:
                assert self.done[a].done(), f"{what}: {a} not done once {nid}, after it, was"
            if nid in self.reads and nid not in self.checked:
                out, expected, known, read = self.reads[nid]
                bad = np.flatnonzero(known & (out != expected))
                assert bad.size == 0, f"{read}: {bad.size} bytes differ from the model"
                self.checked.add(nid)
        for t in sorted(tasks):
            event, outcome, scope = self.tasks[t]
            await event.wait()
            if outcome[0] is not None and not (
                scope.cancel_called and isinstance(outcome[0], anyio.get_cancelled_exc_class())
            ):
                raise AssertionError(f"{what}: task {t} raised {outcome[0]!r}") from outcome[0]

    async def end_released(
        self, what: str, final: dict[int, tuple[np.ndarray, np.ndarray]]
    ) -> None:
        for b, (expected, known) in sorted(final.items()):
            got = await self.bufs[b].read()
            bad = np.flatnonzero(known & (got != expected))
            assert bad.size == 0, f"the end, buffer {b}: {bad.size} bytes differ from the model"
        for b in sorted(self.bufs):
            await self.bufs.pop(b).free()
        for q in self.queues:
            if not q.closed:
                await q.synchronize()
        for dev in self.devs:
            assert dev.memory_statistics().in_use == 0, dev.memory_statistics()


async def run_program(prog: Program, names: tuple[str, ...] = DEVS) -> None:
    with anyio.fail_after(PROGRAM_TIMEOUT):
        async with anyio.create_task_group() as tg:
            devs = [await am.open_device(name) for name in names]
            try:
                await run_on(devs, tg, prog)
            finally:
                with anyio.CancelScope(shield=True):
                    for dev in devs:
                        await dev.close(discard=True)


async def run_on(devs: list[am.Device], tg: anyio.abc.TaskGroup, prog: Program) -> None:
    runner = Runner(devs, tg)
    await runner.start()
    end = prog.ops[-1]
    for step, op in enumerate(prog.ops[:-1]):
        await runner.op(f"op {step} {op[:4]}", *op)
    if end[0] == "end_released":
        await runner.end_released("the end", end[1])
        runner.done.clear()
        runner.bufs.clear()
        for dev in devs:
            await dev.close()
        return
    # Closed with work still blocked: every blocked await ends, with
    # ClosedResourceError; everything else as it would have.
    _, blocked, blocked_tasks = end
    results: dict[int, BaseException | None] = {}

    async def close(dev: am.Device) -> None:
        await dev.close()

    async with anyio.create_task_group() as closing:
        for dev in devs:
            closing.start_soon(close, dev)
    for nid, done in runner.done.items():
        try:
            await done
            results[nid] = None
        except am.ClosedResourceError as exc:
            results[nid] = exc
    wrong = {nid for nid, r in results.items() if (r is None) == (nid in blocked)}
    assert not wrong, f"commands ended against the model: {sorted(wrong)} ({results})"
    for t, (event, outcome, scope) in runner.tasks.items():
        await event.wait()
        if scope.cancel_called:
            continue
        if t in blocked_tasks:
            assert isinstance(outcome[0], am.ClosedResourceError), (t, outcome)
        else:
            assert outcome[0] is None, (t, outcome)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.parametrize("backend", list(LOOPS))
@settings(
    max_examples=int(os.environ.get("ASYNCMETAL_PROPERTY_EXAMPLES", 80)),
    derandomize=not os.environ.get("ASYNCMETAL_PROPERTY_RANDOM"),
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(prog=programs())
def test_ordered_work_matches_the_model(backend: str, prog: Program) -> None:
    baseline = _threads()
    anyio.run(run_program, prog, backend=backend, backend_options=LOOPS[backend])
    assert _left(baseline) == []


@functools.cache
def _metal_started() -> None:
    """Runs a command on metal once: the thread Metal's completion handlers run on is the
    process's from the first command on, not a device's."""

    async def run() -> None:
        async with am.open_device("metal") as dev:
            buf = await dev.alloc(SIZE)
            await dev.queue.fill(buf, 0)
            await buf.free()

    anyio.run(run)


@pytest.mark.metal
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.skipif("metal" not in am.devices(), reason="metal opens on macOS or its simulation")
@pytest.mark.parametrize("pair", list(METAL_PAIRS))
@pytest.mark.parametrize("backend", list(LOOPS))
@settings(
    max_examples=int(os.environ.get("ASYNCMETAL_PROPERTY_EXAMPLES", 20)),
    derandomize=not os.environ.get("ASYNCMETAL_PROPERTY_RANDOM"),
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_ordered_work_on_metal_matches_the_model(
    backend: str, pair: str, data: st.DataObject
) -> None:
    names = METAL_PAIRS[pair]
    prog = data.draw(programs(tuple(name.split(":")[0] for name in names)))
    _metal_started()
    baseline = _threads()
    anyio.run(run_program, prog, names, backend=backend, backend_options=LOOPS[backend])
    assert _left(baseline) == []


def test_the_generator_reaches_the_orderings_it_is_about() -> None:
    # Guard against a generator that degenerates: across programs, launches ordered by
    # waits alone, waits submitted before their signal, refused signals, copies between
    # the devices, cancelled awaits, closed queues and both ends must all come up.
    seen: dict[str, int] = {}

    def count(what: str) -> None:
        seen[what] = seen.get(what, 0) + 1

    @settings(max_examples=300, derandomize=True, database=None, deadline=None)
    @given(prog=programs())
    def sample(prog: Program) -> None:
        g_dev = {op[1]: op[2] for op in prog.ops if op[0] == "alloc"}
        signalled: set[tuple[int, int]] = set()
        for op in prog.ops:
            if op[0] in ("launch", "launch2") and not op[5]:
                count("launch ordered by waits alone")
            elif op[0] == "copy" and g_dev.get(op[3]) != g_dev.get(op[4]):
                count("copy between the devices")
            elif op[0] in ("signal", "hsignal"):
                signalled.add((op[-2], op[-1]) if op[0] == "signal" else (op[1], op[2]))
            elif op[0] == "wait" and not any(t == op[3] and v >= op[4] for t, v in signalled):
                count("wait before its signal")
            elif op[0] == "await" and op[3] is not None:
                count("cancelled await")
            elif op[0] in ("signal_refused", "closeq", "end_released", "end_closed"):
                count(op[0])

    sample()
    expected = [
        "launch ordered by waits alone",
        "copy between the devices",
        "wait before its signal",
        "cancelled await",
        "signal_refused",
        "closeq",
        "end_released",
        "end_closed",
    ]
    assert all(seen.get(what, 0) >= 3 for what in expected), sorted(seen.items())

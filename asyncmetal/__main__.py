"""``python -m asyncmetal info | demo | bench``."""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import sys
import time
import warnings
from collections.abc import Awaitable, Callable, Sequence

import anyio
import numpy as np

import asyncmetal as am
from asyncmetal import _native
from asyncmetal._device import is_available, why_unavailable

# Three stages on three queues, ordered by one timeline, compiled while the first runs.
DEMO_KERNELS = {
    "cpu": r"""
void scale(float* x, int n, int k) { for (int i = 0; i < n; i++) x[i] *= (float)k; }
void offset(float* x, int n, int k) { for (int i = 0; i < n; i++) x[i] += (float)k; }
void square(float* x, int n) { for (int i = 0; i < n; i++) x[i] = x[i] * x[i]; }
""",
}


def info() -> int:
    names = am.devices()
    print(f"asyncmetal {am.__version__}")
    if not names:
        print("no devices can be opened here")
    for name in names:
        print(f"  {name}")
    try:
        _native.runtime()
    except am.AsyncMetalError as exc:
        print(f"native runtime: unavailable ({exc})")
    else:
        print(f"native runtime: {_native.origin}, {_native.origin_path}")
        if _native.extension() is not None:
            print("extension module: in use (launches without ctypes)")
        else:
            print(f"extension module: not in use ({_native.extension_error})")
    # What open_device() opens by default: a $ASYNCMETAL_DEVICE naming no device would
    # fail there, later, so it is said here.
    told = os.environ.get("ASYNCMETAL_DEVICE")
    if told:
        try:
            here = is_available(told)
        except am.AsyncMetalError as exc:
            print(f"python -m asyncmetal info: $ASYNCMETAL_DEVICE: {exc}", file=sys.stderr)
            return 1
        if not here:
            why = why_unavailable(told)
            print(
                f"python -m asyncmetal info: $ASYNCMETAL_DEVICE: device {told!r} is not "
                "available here" + (f": {why}" if why else ""),
                file=sys.stderr,
            )
            return 1
    return 0


async def demo(name: str | None) -> None:
    async with am.open_device(name) as dev:
        if dev.kind not in DEMO_KERNELS:
            raise SystemExit(
                f"python -m asyncmetal demo: its kernels are for {', '.join(DEMO_KERNELS)} "
                f"only, not {dev.name} (run it with --device cpu)"
            )
        src = DEMO_KERNELS[dev.kind]
        print(f"device {dev.name}: compiling 3 kernels in the worker pool")
        programs: dict[str, am.Program] = {}
        t0 = time.perf_counter()
        async for prog in dev.compile_many([(src, "scale"), (src, "offset"), (src, "square")]):
            programs[prog.name] = prog
            print(f"  {prog.name:7s} ready after {1e3 * (time.perf_counter() - t0):7.1f} ms")
        n = 1 << 23
        data = np.linspace(0, 1, n, dtype=np.float32)
        buf = await dev.alloc(data.nbytes)
        await buf.write(data)
        stage = dev.timeline()
        q1, q2, q3 = dev.queue, dev.new_queue(), dev.new_queue()
        # Submit all three stages at once, the last stage's wait first: the device orders
        # them; no host thread blocks. (Signals are submitted in increasing order.)
        q3.wait(stage, 2)
        c3 = q3.launch(programs["square"], buf, vals=(n,))
        c1 = q1.launch(programs["scale"], buf, vals=(n, 3))
        q1.signal(stage, 1)
        q2.wait(stage, 1)
        c2 = q2.launch(programs["offset"], buf, vals=(n, 1))
        q2.signal(stage, 2)
        print("submitted scale -> offset -> square on 3 queues; awaiting the last")
        ticks = 0
        async with anyio.create_task_group() as tg:

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    await anyio.sleep(0.001)  # (uvloop runs a shorter sleep at once)
                    ticks += 1

            tg.start_soon(ticker)
            await c3
            tg.cancel_scope.cancel()
        for label, c in [("scale", c1), ("offset", c2), ("square", c3)]:
            start, end = c.start_time, c.end_time
            took = f"{1e3 * (end - start):6.2f} ms" if start and end else "?"
            print(f"  {label:7s} (command {c.value} of its queue): {took} on the device")
        result = await buf.read(np.float32)
        expected = (data * 3 + 1) ** 2
        ok = np.allclose(result, expected)
        print(f"the loop ticked {ticks} times while the device worked")
        print(f"result {'checked: correct' if ok else 'WRONG'} ({n} floats)")
        await buf.free()
        if not ok:
            raise SystemExit(1)


def _loop_missing(loop: str) -> str | None:
    """What running on ``loop`` needs that is not installed here, if anything."""
    if loop != "asyncio" and importlib.util.find_spec(loop) is None:  # trio, uvloop
        return f"the {loop} loop needs {loop}, which is not installed here (pip install {loop})"
    return None


_LOOPS = ["asyncio", "uvloop", "trio"]


def _run_on(loop: str, fn: Callable[..., Awaitable[object]], *args: object) -> None:
    """``fn(*args)`` on ``loop`` (uvloop: asyncio with uvloop's event loop)."""
    if loop == "uvloop":
        anyio.run(fn, *args, backend="asyncio", backend_options={"use_uvloop": True})
    else:
        anyio.run(fn, *args, backend=loop)


def _one_line(command: str) -> Callable[..., None]:
    """``warnings.showwarning`` for the command line: a warning on one line, the
    command's, not the file and line of the library's code it came from."""

    def show(message: Warning | str, category: type[Warning], *args: object, **kw: object) -> None:
        text = str(message).partition("\n")[0]
        print(f"python -m asyncmetal {command}: {category.__name__}: {text}", file=sys.stderr)

    return show


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncmetal")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="list the devices that can be opened")
    demo_parser = sub.add_parser("demo", help="run a short checked job on a device")
    demo_parser.add_argument(
        "--device", default="cpu", help="a cpu device: cpu or cpu:N (the demo's kernels are C)"
    )
    demo_parser.add_argument("--loop", choices=_LOOPS, default="asyncio")
    bench_parser = sub.add_parser(
        "bench",
        help="time awaited empty cpu launches against the same C call handed to a thread",
        description="Times one awaited empty launch on the cpu device, and the same C "
        "function run through anyio.to_thread.run_sync (a thread hand-off), one at a time "
        "and from many tasks at once, and prints both with their ratio.",
    )
    bench_parser.add_argument("--loop", choices=_LOOPS, default="asyncio")
    bench_parser.add_argument(
        "--launches", type=int, default=3000, help="awaited one at a time, per way (3000)"
    )
    bench_parser.add_argument(
        "--tasks", type=int, default=200, help="tasks launching at once, 10 launches each (200)"
    )
    args = parser.parse_args(argv)
    command = f"python -m asyncmetal {args.command}"
    if args.command != "info":
        missing = _loop_missing(args.loop)
        if missing is not None:
            print(f"{command}: {missing}", file=sys.stderr)
            return 2
    if args.command == "bench" and (args.launches < 1 or args.tasks < 1):
        parser.error("--launches and --tasks must be at least 1")
    # A user gets one line for what went wrong (a device, a C compiler missing), not a
    # traceback -- unless asking for one: python -X dev.
    with warnings.catch_warnings():
        if not sys.flags.dev_mode:
            warnings.showwarning = _one_line(args.command)
        code = 0
        try:
            if args.command == "info":
                code = info()
            elif args.command == "demo":
                _run_on(args.loop, demo, args.device)
            else:
                _run_on(args.loop, bench, args.launches, args.tasks)
            sys.stdout.flush()  # (here: a reader gone, as in `| head -1`, is seen below)
        except BrokenPipeError:
            # The reader of the output left: nothing more to say, to it or at exit.
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, sys.stdout.fileno())
            os.close(null)
            return 1
        except am.AsyncMetalError as exc:
            print(f"{command}: {str(exc).rstrip()}", file=sys.stderr)
            if "not available" in str(exc):
                print("(python -m asyncmetal info lists what can be opened here)", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(f"{command}: interrupted", file=sys.stderr)
            return 130
        except Exception as exc:
            if sys.flags.dev_mode:
                raise
            text = str(exc).partition("\n")[0]
            print(f"{command}: {type(exc).__name__}: {text}", file=sys.stderr)
            print("(python -X dev -m asyncmetal ... shows where)", file=sys.stderr)
            return 1
    return code


async def _timed(n: int, run: Callable[[], Awaitable[object]]) -> float:
    """Mean seconds of one awaited ``run()``, over ``n`` in a row."""
    t0 = time.perf_counter()
    for _ in range(n):
        await run()
    return (time.perf_counter() - t0) / n


async def _rate(tasks: int, run: Callable[[], Awaitable[object]]) -> float:
    """Completions per second with ``tasks`` tasks each awaiting ``run()`` 10 times."""

    async def worker() -> None:
        for _ in range(10):
            await run()

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(tasks):
            tg.start_soon(worker)
    return 10 * tasks / (time.perf_counter() - t0)


async def bench(launches: int = 3000, tasks: int = 200) -> None:
    async with am.open_device("cpu") as dev:
        empty = await dev.compile("void empty(void) {}", "empty")
        call = ctypes.CFUNCTYPE(None)(empty.native)  # the very function the queue calls
        queue = dev.queue

        async def awaited() -> None:
            await queue.launch(empty)

        async def handed_off() -> None:
            await anyio.to_thread.run_sync(call)

        ways = {"asyncmetal": awaited, "thread hand-off": handed_off}
        for run in ways.values():  # warm both up: workers started, caches hot
            await _timed(min(launches, 200), run)
        mean = {name: await _timed(launches, run) for name, run in ways.items()}
        rate = {name: await _rate(tasks, run) for name, run in ways.items()}
    print(
        "an empty cpu kernel awaited with asyncmetal, and the same C function through "
        "anyio.to_thread.run_sync"
    )
    print(f"{'':32}{'asyncmetal':>12}{'thread hand-off':>17}   asyncmetal takes")
    a, t = mean["asyncmetal"], mean["thread hand-off"]
    print(f"{'one at a time, mean (us)':32}{1e6 * a:12.1f}{1e6 * t:17.1f}   {a / t:.2f}x the time")
    a, t = rate["asyncmetal"], rate["thread hand-off"]
    print(f"{f'{tasks} tasks at once, per second':32}{a:12.0f}{t:17.0f}   {t / a:.2f}x the time")
    print(
        "(the cpu queue threads run at nice 19: beside other busy processes they wait for "
        "the CPU, and both ratios move toward 1; README, 'Not done yet')"
    )


if __name__ == "__main__":
    sys.exit(main())

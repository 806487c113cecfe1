"""``python -m asyncmetal info | demo | bench``."""

from __future__ import annotations

import argparse
import time

import anyio
import numpy as np

import asyncmetal as am
from asyncmetal import _native

# Three stages on three queues, ordered by one timeline, compiled while the first runs.
DEMO_KERNELS = {
    "cpu": r"""
void scale(float* x, int n, int k) { for (int i = 0; i < n; i++) x[i] *= (float)k; }
void offset(float* x, int n, int k) { for (int i = 0; i < n; i++) x[i] += (float)k; }
void square(float* x, int n) { for (int i = 0; i < n; i++) x[i] = x[i] * x[i]; }
""",
}


def info() -> None:
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
        return
    print(f"native runtime: {_native.origin}, {_native.origin_path}")
    if _native.extension() is not None:
        print("extension module: in use (launches without ctypes)")
    else:
        print(f"extension module: not in use ({_native.extension_error})")


async def demo(name: str | None) -> None:
    async with am.open_device(name) as dev:
        if dev.kind not in DEMO_KERNELS:
            raise SystemExit(f"the demo has kernels for {', '.join(DEMO_KERNELS)} only")
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
                    await anyio.sleep(0.0005)
                    ticks += 1

            tg.start_soon(ticker)
            await c3
            tg.cancel_scope.cancel()
        for label, c in [("scale", c1), ("offset", c2), ("square", c3)]:
            start, end = c.start_time, c.end_time
            took = f"{1e3 * (end - start):6.2f} ms" if start and end else "?"
            print(f"  {label:7s} queue value {c.value}: {took} on the device")
        result = await buf.read(np.float32)
        expected = (data * 3 + 1) ** 2
        ok = np.allclose(result, expected)
        print(f"the loop ticked {ticks} times while the device worked")
        print(f"result {'checked: correct' if ok else 'WRONG'} ({n} floats)")
        await buf.free()
        if not ok:
            raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m asyncmetal")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="list the devices that can be opened")
    demo_parser = sub.add_parser("demo", help="run a short checked job on a device")
    demo_parser.add_argument("--device", default="cpu")
    demo_parser.add_argument("--loop", choices=["asyncio", "trio"], default="asyncio")
    bench_parser = sub.add_parser("bench", help="awaited launches against thread hand-offs")
    bench_parser.add_argument("--loop", choices=["asyncio", "trio"], default="asyncio")
    args = parser.parse_args()
    if args.command == "info":
        info()
    elif args.command == "demo":
        anyio.run(demo, args.device, backend=args.loop)
    else:
        anyio.run(bench, backend=args.loop)


async def bench() -> None:
    async with am.open_device("cpu") as dev:
        empty = await dev.compile("void empty(void) {}", "empty")
        for _ in range(500):
            await dev.queue.launch(empty)
        n = 5000
        t0 = time.perf_counter()
        for _ in range(n):
            await dev.queue.launch(empty)
        print(f"one awaited empty launch: {1e6 * (time.perf_counter() - t0) / n:.1f} us (mean)")
        print("for the side-by-side comparison run benchmarks/cpu_await.py")


if __name__ == "__main__":
    main()

"""GPU diagnostic (not for main): the cupy consumer hang."""
import asyncio, sys, time, threading, faulthandler
sys.path.insert(0, ".")
import numpy as np
import cupy
import asyncmetal as am
from asyncmetal.backends.cuda import _queue as cq
from tests.backends.cuda.test_interop import _kernels, N, GRID

calls = []
orig = cq.CUDAQueue.order_stream
def traced(self, context, stream, target):
    calls.append((hex(stream), target, self._timeline.value, self._timeline.queue is self))
    return orig(self, context, stream, target)
cq.CUDAQueue.order_stream = traced

async def main():
    faulthandler.dump_traceback_later(60, exit=True)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(5)]
    async with am.open_device("cuda:0") as dev:
        fill, sleep = await _kernels(dev)
        buf = await dev.alloc(4 * N)
        view = buf.typed(np.int32)
        for i in range(4):
            if i == 0:
                dev.queue.launch(sleep, vals=(50_000,))
            else:
                for _ in range(40):
                    dev.queue.launch(sleep, vals=(1_000,))
            done = dev.queue.launch(fill, buf, vals=(i + 1, N), **GRID)
            with streams[i]:
                print("round", i, "fill value", done.value, "stream", hex(streams[i].ptr), flush=True)
                array = cupy.from_dlpack(view)
                print("  calls", calls[-3:], "stats", dev.queue._native.stats(), flush=True)
                ev = cupy.cuda.Event(); ev.record(streams[i])
                t0 = time.time()
                while not ev.done and time.time() - t0 < 5: time.sleep(0.01)
                print("  consumer event done", ev.done, "after", round(time.time()-t0, 3), "queue value", dev.queue.timeline.value, "word", dev.queue.timeline.native._word.value if hasattr(dev.queue.timeline.native, "_word") else "?", flush=True)
                if not ev.done:
                    await asyncio.sleep(2)
                    print("  later: done", ev.done, "queue value", dev.queue.timeline.value, flush=True)
                    break
                print("  sum", int(array.sum()), "expected", (i + 1) * N, flush=True)
asyncio.run(main())

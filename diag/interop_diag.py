"""GPU diagnostic (not for main): where the 64-task flat-out lag comes from."""
import asyncio, sys, time, statistics
sys.path.insert(0, "benchmarks")
import interop
import asyncmetal as am
from asyncmetal import _bridge, _timeline

def pct(v, q):
    v = sorted(v); return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")

async def main():
    import torch
    async with am.open_device("cuda:0") as dev:
        stream = torch.cuda.Stream()
        model = interop.Model(torch, stream)
        q = dev.adopt_stream(stream)
        print("gpu us per pass", model.gpu_us, "width", model.width)
        for slice_, crowd, streams in ((32, 64, 1), (8, 16, 1), (32, 64, 4), (8, 16, 4)):
            _bridge.WAKE_SLICE, _timeline.CROWD = slice_, crowd
            ss = [stream] + [torch.cuda.Stream() for _ in range(streams - 1)]
            qs = [q] + [dev.adopt_stream(s) for s in ss[1:]]
            submit_us, lags, count = [], [], 0
            stop = time.perf_counter() + 2.0
            async def worker(i):
                nonlocal count
                s, qq = ss[i % streams], qs[i % streams]
                while time.perf_counter() < stop:
                    t0 = time.perf_counter_ns()
                    with torch.cuda.stream(s), torch.no_grad():
                        model.net(model.x)
                    submit_us.append((time.perf_counter_ns() - t0) / 1e3)
                    await qq.marker()
                    count += 1
            async def ticker():
                while time.perf_counter() < stop:
                    t0 = time.perf_counter(); await asyncio.sleep(0.001)
                    lags.append((time.perf_counter() - t0 - 0.001) * 1e3)
            st0 = am.loop_statistics(); t0 = time.perf_counter()
            await asyncio.gather(ticker(), *(worker(i) for i in range(64)))
            el = time.perf_counter() - t0; st1 = am.loop_statistics()
            print(f"slice {slice_} crowd {crowd} streams {streams}: req/s {count/el:.0f} lag p50 {pct(lags,.5):.2f} p99 {pct(lags,.99):.2f} max {max(lags):.2f} ms; submit us p50 {pct(submit_us,.5):.0f} p99 {pct(submit_us,.99):.0f} max {max(submit_us):.0f}; wakeups {st1.wakeups-st0.wakeups} resolved {st1.resolved-st0.resolved}", flush=True)
            # event_poll peer with the same streams
            count = 0; lags = []; stop = time.perf_counter() + 2.0
            async def pworker(i):
                nonlocal count
                s = ss[i % streams]
                while time.perf_counter() < stop:
                    with torch.cuda.stream(s), torch.no_grad():
                        model.net(model.x)
                    ev = torch.cuda.Event(); ev.record(s)
                    while not ev.query():
                        await asyncio.sleep(0)
                    count += 1
            t0 = time.perf_counter()
            await asyncio.gather(ticker(), *(pworker(i) for i in range(64)))
            el = time.perf_counter() - t0
            print(f"   event_poll streams {streams}: req/s {count/el:.0f} lag p99 {pct(lags,.99):.2f}", flush=True)
asyncio.run(main())

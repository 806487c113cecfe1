"""An HTTP service whose requests run GPU work and await it, with asyncmetal and aiohttp.

    python examples/service.py [--device cpu|cuda:0] [--port 8080] [--torch]

* ``GET /compute?n=N&k=K`` runs asyncmetal's own kernel (``out[i] = i * K + 1``) on the
  device, awaits it, and answers ``{"sum": ..., "n": N}``.
* ``GET /model?x=X`` (``--torch``, a cuda device): a small PyTorch model's forward pass
  on a stream asyncmetal adopted; the handler awaits ``queue.marker()`` instead of
  ``torch.cuda.synchronize()``, so the loop keeps serving meanwhile. Answers
  ``{"sum": ...}`` of the output for an input filled with X (at most 1e6 either way).
* ``GET /health`` answers at once: it stays responsive while the GPU works.

aiohttp: a mainstream asyncio server and client in one package with no ASGI server to
install (uvicorn is not on every GPU image), which runs on the event loop asyncmetal
awaits on. The first line printed is ``listening on http://HOST:PORT``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import signal
import sys
from typing import Any

import numpy as np

import asyncmetal as am

try:
    from aiohttp import web
except ImportError:  # said plainly, not as a traceback
    sys.exit("examples/service.py needs aiohttp, which is not installed here (pip install aiohttp)")

C_SRC = "void affine(int* out, int k, int n) { for (int i = 0; i < n; i++) out[i] = i * k + 1; }"
CUDA_SRC = r"""
extern "C" __global__ void affine(int* out, int k, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = i * k + 1;
}
"""
MODEL_WIDTH = 256
MAX_N = 1 << 22  # the largest request: 16 MiB of output, and i * k fits an int
MAX_K = 256
MAX_X = 1e6  # the model's input: its outputs stay far from float32's overflow


def build_model() -> Any:
    """The model /model runs: the same weights wherever it is built (seed 0)."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(MODEL_WIDTH, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, MODEL_WIDTH),
    )


class Refused(Exception):
    """What this machine lacks for the service as asked (said, then the service exits)."""


class Service:
    def __init__(self, device: am.Device, kernel: am.Program, use_torch: bool) -> None:
        self.device = device
        self.kernel = kernel
        self.torch_stream: Any = None
        if use_torch:
            import torch

            self.model = build_model().to(f"cuda:{device.name.partition(':')[2] or 0}")
            self.torch_stream = torch.cuda.Stream(self.model[0].weight.device)
            self.queue = device.adopt_stream(self.torch_stream)  # marker(): an event there

    async def compute(self, request: web.Request) -> web.Response:
        try:
            n, k = int(request.query.get("n", "1024")), int(request.query.get("k", "1"))
        except ValueError:
            raise web.HTTPBadRequest(text="n and k are integers") from None
        if not (0 < n <= MAX_N and -MAX_K <= k <= MAX_K):
            raise web.HTTPBadRequest(text=f"n in [1, {MAX_N}] and k in [-{MAX_K}, {MAX_K}]")
        async with await self.device.alloc(4 * n) as out:
            grid = {"global_size": n, "local_size": 128} if self.device.kind == "cuda" else {}
            await self.device.queue.launch(self.kernel, out, vals=(k, n), **grid)
            result = await out.read(np.int32)
        return web.json_response({"sum": int(result.sum(dtype=np.int64)), "n": n})

    async def model_forward(self, request: web.Request) -> web.Response:
        if self.torch_stream is None:
            raise web.HTTPNotFound(text="start the service with --torch on a cuda device")
        try:
            x = float(request.query.get("x", "1"))
        except ValueError:
            raise web.HTTPBadRequest(text="x is a number") from None
        if not abs(x) <= MAX_X:  # (nan too) outputs that stay finite, as JSON needs
            raise web.HTTPBadRequest(text=f"x in [-{MAX_X:g}, {MAX_X:g}]")
        import torch

        with torch.cuda.stream(self.torch_stream), torch.no_grad():
            inputs = torch.full((1, MODEL_WIDTH), x, device=self.model[0].weight.device)
            outputs = self.model(inputs).sum()
            host = torch.empty((), pin_memory=True)
            host.copy_(outputs, non_blocking=True)
        await self.queue.marker()  # the forward pass and the copy, awaited on the loop
        return web.json_response({"sum": float(host)})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "device": self.device.name})


def check_torch(device: am.Device) -> None:
    """--torch runs the model on the device's GPU through PyTorch: both must be there."""
    if device.kind != "cuda":
        gpus = [name for name in am.devices() if name.startswith("cuda:")]
        raise Refused(
            f"--torch runs a PyTorch model on a cuda device, and {device.name} is not one "
            f"(cuda devices here: {', '.join(gpus) or 'none'})"
        )
    import torch

    if not torch.cuda.is_available():
        raise Refused("--torch needs a PyTorch built with CUDA; this one sees no GPU")


async def serve(device_name: str, host: str, port: int, use_torch: bool) -> None:
    async with am.open_device(device_name) as device:
        if use_torch:
            check_torch(device)
        source = CUDA_SRC if device.kind == "cuda" else C_SRC
        kernel = await device.compile(source, "affine")
        service = Service(device, kernel, use_torch)
        app = web.Application()
        app.router.add_get("/compute", service.compute)
        app.router.add_get("/model", service.model_forward)
        app.router.add_get("/health", service.health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:  # the port in use, a host not of this machine...
            await runner.cleanup()
            raise Refused(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        address, bound_port = runner.addresses[0][:2]
        if ":" in address:  # an IPv6 address: bracketed in a URL
            address = f"[{address}]"
        print(f"listening on http://{address}:{bound_port}", flush=True)
        stopped = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopped.set)
        try:
            await stopped.wait()  # until SIGTERM (or Ctrl-C)
        finally:
            await runner.cleanup()


def tcp_port(text: str) -> int:
    """--port: an int a socket binds (0 to 65535), else argparse's plain refusal."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0 to 65535, got {text!r}")
    return port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="default: the best device here")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=tcp_port, default=8080, help="0: any free port")
    parser.add_argument("--torch", action="store_true", help="serve /model (a cuda device)")
    args = parser.parse_args()
    if args.torch and importlib.util.find_spec("torch") is None:
        parser.exit(2, "service.py: --torch needs PyTorch, which is not installed here\n")
    try:
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: stop quietly
            asyncio.run(serve(args.device, args.host, args.port, args.torch))
    except (Refused, am.AsyncMetalError) as exc:  # a device not here, no C compiler, ...
        parser.exit(2, f"service.py: {exc}\n")


if __name__ == "__main__":
    main()

"""examples/service.py as a real server (a subprocess) driven by a real HTTP client:
concurrent requests whose results are checked, while /health is timed. On the cpu
device everywhere; with a PyTorch model on a cuda device where there is one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

import asyncmetal as am

pytestmark = pytest.mark.anyio

SERVICE = Path(__file__).resolve().parents[2] / "examples" / "service.py"
GPUS = [d for d in am.devices() if d.startswith("cuda:")]


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


async def _server(*args: str) -> AsyncIterator[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = await anyio.open_process(
        [sys.executable, str(SERVICE), "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        assert process.stdout is not None
        line = b""
        with anyio.fail_after(120):  # opening a device and compiling the kernel
            while not line.endswith(b"\n"):
                chunk = await process.stdout.receive(1)
                line += chunk
        text = line.decode().strip()
        assert text.startswith("listening on "), text
        yield text.removeprefix("listening on ")
    finally:
        process.terminate()
        with anyio.move_on_after(20):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()
        await process.aclose()


@pytest.fixture
async def cpu_service(anyio_backend: object) -> AsyncIterator[str]:
    async for url in _server("--device", "cpu"):
        yield url


async def _health_while(client: httpx.AsyncClient, busy: anyio.Event) -> list[float]:
    """Time /health requests, one after another, until ``busy`` is set."""
    latencies = []
    while not busy.is_set():
        start = time.perf_counter()
        response = await client.get("/health")
        latencies.append(time.perf_counter() - start)
        assert response.status_code == 200 and response.json()["ok"]
    return latencies


async def _drive(url: str, path: str, requests: list[dict[str, str]]) -> tuple[list, list]:
    results: list = [None] * len(requests)
    async with (
        httpx.AsyncClient(base_url=url, timeout=60) as client,
        httpx.AsyncClient(base_url=url, timeout=60) as prober,  # its own connection
    ):
        await prober.get("/health")  # connected before the timing starts
        done = anyio.Event()
        latencies: list[float] = []

        async def health() -> None:
            latencies.extend(await _health_while(prober, done))

        async def one(i: int) -> None:
            response = await client.get(path, params=requests[i])
            assert response.status_code == 200, response.text
            results[i] = response.json()

        async with anyio.create_task_group() as tg:
            tg.start_soon(health)
            async with anyio.create_task_group() as requests_group:
                for i in range(len(requests)):
                    requests_group.start_soon(one, i)
            done.set()
    return results, latencies


def _report(name: str, latencies: list[float]) -> None:
    ordered = sorted(latencies)
    p50 = ordered[len(ordered) // 2] * 1e3
    worst = ordered[-1] * 1e3
    print(f"{name}: /health {len(ordered)} requests, p50 {p50:.2f} ms, max {worst:.2f} ms")


async def test_the_service_computes_concurrently_and_stays_healthy(cpu_service: str) -> None:
    requests = [{"n": str(1000 + 37 * i), "k": str(i % 7)} for i in range(48)]
    results, latencies = await _drive(cpu_service, "/compute", requests)
    for request, result in zip(requests, results):
        n, k = int(request["n"]), int(request["k"])
        assert result == {"sum": k * n * (n - 1) // 2 + n, "n": n}
    assert latencies, "/health was never answered while requests ran"
    _report("cpu service", latencies)
    # Health answers are not held up behind the kernels: no answer takes seconds.
    assert max(latencies) < 2.0


async def test_the_service_refuses_what_it_cannot_compute(cpu_service: str) -> None:
    """Requests outside what the kernel computes exactly are answered 400, at once: a
    size of 0, a negative one, one that would allocate gigabytes, a factor whose products
    overflow an int, and what is not a number. Checked: each was a 500 (or a 12 GB
    allocation) before."""
    async with httpx.AsyncClient(base_url=cpu_service, timeout=30) as client:
        for query in ("n=0", "n=-4", "n=abc", "n=3000000000", "n=1024&k=100000", "k=x"):
            response = await client.get(f"/compute?{query}")
            assert response.status_code == 400, (query, response.text)
        response = await client.get("/compute?n=8&k=2")
        assert response.json() == {"sum": sum(i * 2 + 1 for i in range(8)), "n": 8}


async def test_the_model_endpoint_needs_torch_on_cuda(cpu_service: str) -> None:
    async with httpx.AsyncClient(base_url=cpu_service) as client:
        response = await client.get("/model")
        assert response.status_code == 404 and "--torch" in response.text


async def test_the_model_endpoint_refuses_what_it_cannot_compute(anyio_backend: object) -> None:
    """``/model?x=`` that is no number, or none whose outputs are finite (nan, an
    infinity, one large enough to overflow float32), is answered 400 before any PyTorch
    work, as ``/compute`` refuses what it cannot compute. (The handler of a service
    that serves the model, called directly: no GPU needed.) Checked: fails without the
    fix (a ValueError, a 500; nan ran the model and answered NaN, which is no JSON)."""
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    service = _service_module()
    handler = service.Service(None, None, use_torch=False)
    handler.torch_stream = object()  # as if started with --torch
    for x in ("abc", "", "nan", "inf", "-inf", "1e400", "1e30", "-1e30"):
        with pytest.raises(web.HTTPBadRequest):
            await handler.model_forward(make_mocked_request("GET", f"/model?x={x}"))


def _service_module() -> Any:
    sys.path.insert(0, str(SERVICE.parent))
    try:
        import service
    finally:
        sys.path.remove(str(SERVICE.parent))
    return service


@pytest.mark.cuda
@pytest.mark.skipif(not GPUS, reason="no NVIDIA GPU with cuda-bindings on this machine")
@pytest.mark.skipif(not _has_torch(), reason="needs PyTorch")
async def test_the_service_runs_a_torch_model_on_an_adopted_stream(
    anyio_backend: object,
) -> None:
    import torch

    service = _service_module()
    model = service.build_model()
    async for url in _server("--device", "cuda:0", "--torch"):
        xs = [0.5 + i / 8 for i in range(64)]
        results, latencies = await _drive(url, "/model", [{"x": str(x)} for x in xs])
        for x, result in zip(xs, results):
            with torch.no_grad():
                expected = float(model(torch.full((1, service.MODEL_WIDTH), x)).sum())
            assert result["sum"] == pytest.approx(expected, rel=2e-2, abs=2e-2)
        requests = [{"n": "100000", "k": "3"}] * 32
        sums, more = await _drive(url, "/compute", requests)
        assert all(s == {"sum": 3 * 100000 * 99999 // 2 + 100000, "n": 100000} for s in sums)
        _report("cuda service, torch model", latencies + more)
        assert max(latencies + more) < 2.0


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
async def test_an_ipv6_address_is_printed_as_a_url(anyio_backend: object) -> None:
    """Listening on an IPv6 address, the line printed is a URL a client takes (the
    address in brackets). Checked: fails without the fix (``http://::1:PORT``, which
    httpx refuses as an invalid port)."""
    async for url in _server("--device", "cpu", "--host", "::1"):
        assert url.startswith("http://[::1]:"), url
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            response = await client.get("/health")
        assert response.status_code == 200 and response.json()["ok"]


def test_a_port_in_use_is_said_plainly(tmp_path: Path) -> None:
    """The service asked for a port another socket holds says so in a line and exits
    2, as for a device not here. Checked: before, it ended with asyncio's traceback."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, str(SERVICE), "--device", "cpu", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_a_port_no_socket_binds_is_refused_plainly(port: str) -> None:
    """A ``--port`` outside 0..65535 (or no number) is refused as argparse refuses any
    bad argument -- a usage line, exit 2 -- before a device is opened. Checked: fails
    without the fix (70000 and -1 ended with asyncio's OverflowError traceback)."""
    done = subprocess.run(
        [sys.executable, str(SERVICE), "--device", "cpu", "--port", port],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "a TCP port is 0 to 65535" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr

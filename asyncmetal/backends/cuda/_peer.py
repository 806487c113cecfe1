"""Peer access between the GPUs opened in this process."""

from __future__ import annotations

import itertools
import threading
from typing import Any, Protocol

from ._driver import check, cu, driver_error


class PeerDevice(Protocol):
    """What peer access needs of an opened GPU (a ``CUDABackend``)."""

    index: int
    device: Any
    context: Any

    def make_current(self) -> None: ...


_peers_lock = threading.Lock()
_opened: dict[int, tuple[Any, Any]] = {}  # ordinal -> (CUdevice, primary context) opened here
_peers_done: set[tuple[int, int]] = set()  # (device, peer) ordinals with access enabled


def enable_peer_access(backend: PeerDevice) -> None:
    """Let this device and every other GPU opened in this process read each other's
    memory where the hardware can (NVLink or PCIe peer to peer), once per pair: peer
    copies then go device to device instead of through host memory (38 GB/s on the
    two-H200 host without it). Runs where devices open, off the event loop; touches no
    GPU that asyncmetal has not opened. Access stays enabled for the life of the process,
    like the primary contexts it belongs to (which other libraries share)."""
    with _peers_lock:
        _opened[backend.index] = (backend.device, backend.context)
        for (src, (src_device, src_context)), (
            dst,
            (dst_device, dst_context),
        ) in itertools.permutations(_opened.items(), 2):
            if (src, dst) in _peers_done:
                continue
            where = f"cuda:{src}"
            can = cu.cuDeviceCanAccessPeer(src_device, dst_device)
            if check(can, "cuDeviceCanAccessPeer", where):
                check(cu.cuCtxSetCurrent(src_context), "cuCtxSetCurrent", where)
                (err,) = cu.cuCtxEnablePeerAccess(dst_context, 0)
                already = cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                if err not in (cu.CUresult.CUDA_SUCCESS, already):
                    raise driver_error("cuCtxEnablePeerAccess", err, where)
            # Only once it is known: a pair whose enabling failed is tried again at the
            # next open (the open that failed raised).
            _peers_done.add((src, dst))
    backend.make_current()

"""A device's close whose native part raises a KeyboardInterrupt on the teardown's own
thread (a step that raises one: nothing delivers a Ctrl-C there, and the caller's
cancellation or Ctrl-C never reaches that loop) still ends what waits on the device:
the commands it abandoned fail, the host waits on its timelines for values never
reached end, and the close raises the interrupt. On every device of the ``device``
fixture's (cpu, the simulated Metal)."""

from __future__ import annotations

import anyio
import pytest

import asyncmetal as am
from tests.support.kernels import KERNELS, MSL_KERNELS

pytestmark = pytest.mark.anyio


async def test_an_interrupt_from_the_native_close_still_ends_the_device_s_waits(
    anyio_backend: object, device_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queue waits, on the device, for a value nobody signals, a launch behind it; a
    host task waits on that timeline. The backend's close raises a KeyboardInterrupt as
    it returns (once, as a Ctrl-C would: the native close runs that step again): the
    close raises it, and the launch and the host wait fail (ClosedResourceError) at
    once. Checked failing before (the teardown caught only Exception around the native
    close, and skipped what follows it): the abandoned launch was never failed, its
    await hung ('TimeoutError' from fail_after)."""
    dev = await am.open_device(device_name)
    fill = await dev.compile(MSL_KERNELS if device_name == "metal" else KERNELS, "fill")
    buf = await dev.alloc(4)
    never = dev.timeline()
    queue = dev.new_queue()
    queue.wait(never, 1)  # never signalled: the close abandons what follows
    stuck = queue.launch(fill, buf, vals=(7, 1))
    close = dev._backend.close
    interrupted: list[bool] = []

    def close_then_interrupt() -> None:
        close()
        if not interrupted:  # (one interrupt: the step it lands in runs again)
            interrupted.append(True)
            raise KeyboardInterrupt

    monkeypatch.setattr(dev._backend, "close", close_then_interrupt)
    with anyio.fail_after(10):
        with pytest.raises(KeyboardInterrupt):
            await dev.close()
        assert dev.closed
        with pytest.raises(am.ClosedResourceError, match="never ran"):
            await stuck
        with pytest.raises(am.ClosedResourceError):
            await never.wait(1)

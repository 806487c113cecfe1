"""The ``metal`` device (Apple): the Objective-C runtime through ctypes, as tinygrad does.

NOT RUN ON APPLE HARDWARE. No machine available to this project runs macOS: this module
is written against Apple's documented API and tinygrad's ``ops_metal.py`` (0.10.2). It
runs, unchanged, against the tests' simulated Metal (``tests/support/fakes/metal_sim``: the same C
calls, x86-64, MSL run on the CPU), loaded through the ``ASYNCMETAL_*`` library
variables (``_objc.LIBRARIES``); ``devices()`` lists ``metal`` where they load.

* Each command is one command buffer: device-side waits (``encodeWaitForEvent:value:``)
  are encoded at the head of the command buffer that holds the dependent work (and of
  every later one until the value is seen reached) -- never in a separate empty command
  buffer, which raced in tinygrad -- then the work, then ``encodeSignalEvent:value:`` of
  the queue's own ``MTLSharedEvent``.
* Every command buffer gets ``addCompletedHandler:`` before ``commit`` with a global
  block whose invoke function is native (``am_block_completed``): it raises the queue's
  timeline mirror, which wakes the loops through their pipes. Status, error and GPU
  times are read from the retained command buffer afterwards, on the loop.
* A queue's signal of a timeline raises that timeline's mirror from the same completion
  handler, right after the queue's own timeline: a host that sees the value reached may
  rely on the signal command having completed. (An ``MTLSharedEventListener`` would
  report the event's value first -- the GPU signals it before the command buffer
  completes -- which let a host signal overtake the queue's own timeline.)
* ``commandBuffer`` blocks when the queue has 1024 buffers in flight: past 1000 a queue
  hands its submissions to its own thread, in order, so the loop never blocks.
* Buffers are shared storage. A host source is blitted in place through a no-copy
  buffer over its pages (nothing copied on the loop, and -- as ``Queue.copy`` documents
  -- not staged); only one Metal will not wrap is copied into a staging buffer at
  submission. Copies out blit into a shared staging
  buffer that the completion handler's native code moves to the host array; one of 1 MiB
  or more is made, and its copy committed, on the queue's own thread.
* Kernels are Metal Shading Language compiled in the worker pool by the
  ``MTLCodeGenService`` of Apple's MTLCompiler framework, as tinygrad does (its reply
  block is a proper global block; the request and reply formats are tinygrad's), or by
  ``xcrun metal`` / ``xcrun metallib`` with ``MetalCompiler("xcrun")``; the compiler
  pickles as its configuration.
"""

from ._backend import MetalBackend
from ._compiler import (
    CodegenResult,
    MetalCompiler,
    codegen_library,
    codegen_request,
    codegen_warnings,
    metal_bindings,
    metal_params,
)
from ._queue import MetalQueue, MetalTimeline

__all__ = [
    "CodegenResult",
    "MetalBackend",
    "MetalCompiler",
    "MetalQueue",
    "MetalTimeline",
    "codegen_library",
    "codegen_request",
    "codegen_warnings",
    "metal_bindings",
    "metal_params",
]

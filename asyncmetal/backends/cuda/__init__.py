"""The ``cuda:N`` devices, through NVIDIA's cuda-bindings (driver API and NVRTC).

* Queues are non-blocking streams. Each command is submitted in one native call
  (``native/cuda_submit.c``: the launch, an event record) and its event handed to a native
  completion thread per stream, which polls it a moment, then naps or blocks on it
  (napping until shortly before a command's end where it can predict that from its
  recent run times), without the GIL, and raises the queue's timeline once the event
  confirmed the command. Nothing
  runs inside a driver callback. Driver functions on that path are the pointers
  ``cuGetProcAddress`` (through cuda-bindings) returns; everything else calls
  cuda-bindings.
* Timelines are native-runtime timelines (the host-side value that loops read and await,
  raised only for confirmed work) with a 64-bit device word in pinned, device-mapped host
  memory: streams wait on the word with ``cuStreamWaitValue64`` (GEQ), signalled from
  the host, another stream or another GPU. A wait on a queue's own timeline waits on
  that command's event (``cuStreamWaitEvent``). A device wait reaches the driver only
  once what satisfies it did (held on the host until then, ``native/cuda_stream.h``
  says why), except a wait on a timeline only the host has signalled so far.
* Kernels are CUDA C compiled by NVRTC for the device's own architecture into a cubin,
  in the compile pool. ``global_size`` is the number of threads per dimension and
  ``local_size`` the block: the grid is ``ceil(global / local)``.
* Host copies of pageable memory are staged through a queue's own ring of pinned chunks
  (``STAGE_RING`` of ``STAGE_CHUNK``): its native host-copy threads
  (``HOST_COPY_THREADS``, made at its first large copy) fill or empty chunks while the
  DMA engine moves others, and a chunk is reused once its previous use is marked done
  -- a copy of any size runs in the ring's memory. Each chunk's host copy is shared by
  all the threads, which take its parts (``STAGE_PART``) one at a time. Between the DMA
  engine and the host copies there are only device words: the stream writes a mark
  after a chunk's DMA, which the threads poll; the thread that copies a chunk's last
  part raises its ready word, which the stream waits on. No event and no completion
  thread in between.
"""

from ._backend import CUDABackend
from ._compiler import CUDACompiler
from ._driver import check, cu, driver_error, nvrtc
from ._queue import CUDAQueue
from ._timeline import CUDATimeline

__all__ = [
    "CUDABackend",
    "CUDACompiler",
    "CUDAQueue",
    "CUDATimeline",
    "check",
    "cu",
    "driver_error",
    "nvrtc",
]

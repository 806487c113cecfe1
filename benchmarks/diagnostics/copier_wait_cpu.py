"""Diagnostic (any machine): the CPU that host-copy threads burn while their chunk
waits for a stream that is busy elsewhere (a staged copy queued behind a long kernel).

    PYTHONPATH=. python benchmarks/diagnostics/copier_wait_cpu.py  (THREADS=12; OUT=dir)

``THREADS`` native queue threads each get one part of a chunk whose mark (a device word,
written here by nobody) is not reached; the process's CPU time is read over 0.1 s and
over 1 s of waiting, then the word is written and every part must finish.

Ran on the 2-core development machine (three runs each): at dbc8f55, where every waiting
thread polled the word (``AFTER=word``: that commit's ``copy_part`` took the word's
address), 13-15 % of a core over the first 0.1 s and 10.0-10.6 % over the next second;
with one thread polling and the others asleep, naps up to 4 ms (the commit after),
3.2-3.9 % and 0.9-1.0 %.
"""

from __future__ import annotations

import ctypes
import json
import os
import time

from asyncmetal import _native
from asyncmetal.backends.cpu import CPUQueue, CPUTimeline


def main() -> dict[str, object]:
    lib = _native.runtime()
    threads = int(os.environ.get("THREADS", "12"))
    timelines = [CPUTimeline(lib) for _ in range(threads)]
    queues = [CPUQueue(lib, t) for t in timelines]
    marks = CPUTimeline(lib)
    word, count, ready = ctypes.c_uint64(0), ctypes.c_uint64(0), ctypes.c_uint64(0)
    lib.am_timeline_set_word(marks.c_timeline, ctypes.addressof(word))
    after = marks.c_timeline if os.environ.get("AFTER", "timeline") == "timeline" else None
    scratch = (ctypes.c_uint8 * 16)()
    at = ctypes.addressof(scratch)
    time.sleep(0.3)  # the threads started: their start-up is not counted
    for q in queues:
        q.copy_part(
            at,
            at + 8,
            1,
            1,
            None,
            (after or ctypes.addressof(word), 1),
            (ctypes.addressof(count), threads),
            (ctypes.addressof(ready), 1),
        )
    out: dict[str, object] = {"threads": threads, "cpus": os.cpu_count()}
    for seconds in (0.1, 1.0):
        c0, t0 = time.process_time(), time.perf_counter()
        time.sleep(seconds)
        c1, t1 = time.process_time(), time.perf_counter()
        out[f"cpu_percent_of_a_core_over_{seconds}_s"] = 100 * (c1 - c0) / (t1 - t0)
    word.value = 1
    for q in queues:
        q.close()
    out["every_part_done"] = count.value == threads and ready.value == 1
    return out


result = main()
print(json.dumps(result, indent=1))
with open(os.environ.get("OUT", "/tmp") + "/copier_wait_cpu.json", "w") as f:
    json.dump(result, f, indent=1)

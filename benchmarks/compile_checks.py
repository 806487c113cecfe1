"""What the signature checks cost a cpu kernel's compile.

    python benchmarks/compile_checks.py [--repeats N] [--cc gcc,clang] [--json out.json]

A cpu kernel whose parameters the source does not show to be a pointer or a scalar (a
header's type by value, ``pid_t a``; a pointer to a header's type, ``FILE *f``) is
compiled with the checks' lines appended (``signature_checks``): the compiler says what
each is, in the same compile. For a kernel of N such parameters (N = 0: none, no check
lines), each compiler is timed compiling the source with its check lines and without
them, cold (the compiler's process itself: no compile cache), the two interleaved, the
median of --repeats each, each compile of a source of its own (a comment): the
compiler's CPU time (user and system, its children's too), which other work on the
machine sways less than its wall time, and the wall time; and the time
``signature_checks`` takes to write the lines, in this process.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time
from typing import Any

from _common import write_json

from asyncmetal._compile import signature_checks
from asyncmetal.backends.cpu import CCompiler, _cc

# Parameters of a header's types, by value and a pointer to one, in turn: each checked.
HEADER_PARAMS = (
    "pid_t",
    "FILE *",
    "off_t",
    "fpos_t *",
    "uid_t",
    "DIR *",
    "gid_t",
    "FILE *",
    "mode_t",
    "fpos_t *",
    "nlink_t",
    "DIR *",
    "dev_t",
    "FILE *",
    "ino_t",
)


def kernel(n: int, tag: str) -> str:
    params = "".join(f", {HEADER_PARAMS[i]} p{i}" for i in range(n))
    uses = "".join(f" + (long)(p{i} != 0)" for i in range(n))
    return (
        f"/* {tag} */\n#include <stdio.h>\n#include <sys/types.h>\n#include <dirent.h>\n"
        f"void k(long* out{params}) {{ out[0] = 1{uses}; }}\n"
    )


def measure(cc: str, n: int, repeats: int) -> dict[str, Any]:
    command = CCompiler(cc)._command()
    flags = ("-O2",)
    checks_s: list[float] = []
    wall: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    lines = 0
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "kernel.so")
        for r in range(repeats + 1):  # (the first of each pair's warm-up, dropped)
            src = kernel(n, f"{cc} {n} {r} {time.time_ns()}")
            t0 = time.perf_counter()
            checks, checked = signature_checks(src)
            t1 = time.perf_counter()
            assert len(checked) == n, (n, checked)
            lines = checks.count("\n")
            for with_checks in (r % 2 == 0, r % 2 == 1):  # (in turn first)
                c2 = resource.getrusage(resource.RUSAGE_CHILDREN)
                t2 = time.perf_counter()
                proc, log = _cc(command, flags, src + checks if with_checks else src, out)
                t3 = time.perf_counter()
                c3 = resource.getrusage(resource.RUSAGE_CHILDREN)
                assert proc.returncode == 0, log
                if r:
                    wall[with_checks].append(t3 - t2)
                    cpu[with_checks].append(c3.ru_utime - c2.ru_utime + c3.ru_stime - c2.ru_stime)
            if r:
                checks_s.append(t1 - t0)
    with_ms, without_ms = (statistics.median(cpu[each]) * 1e3 for each in (True, False))
    return {
        "cc": cc,
        "params": n,
        "check_lines": lines,
        "with_checks_cpu_ms": with_ms,
        "without_checks_cpu_ms": without_ms,
        "cost_cpu_ms": with_ms - without_ms,
        "cost_cpu_pct": 100 * (with_ms - without_ms) / without_ms,
        "with_checks_cpu_min_ms": min(cpu[True]) * 1e3,
        "without_checks_cpu_min_ms": min(cpu[False]) * 1e3,
        "with_checks_wall_ms": statistics.median(wall[True]) * 1e3,
        "without_checks_wall_ms": statistics.median(wall[False]) * 1e3,
        "signature_checks_ms": statistics.median(checks_s) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cc", default="gcc,clang")
    parser.add_argument("--params", default="0,1,5,15")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for cc in args.cc.split(","):
        if shutil.which(cc) is None:
            print(f"{cc}: not here, skipped")
            continue
        for n in map(int, args.params.split(",")):
            row = measure(cc, n, args.repeats)
            rows.append(row)
            print(
                f"{cc:6} N={n:2}  {row['check_lines']:4} check lines  "
                f"cpu with {row['with_checks_cpu_ms']:6.1f} ms  without "
                f"{row['without_checks_cpu_ms']:6.1f} ms  {row['cost_cpu_ms']:+5.1f} ms "
                f"({row['cost_cpu_pct']:+5.1f} %)  min {row['with_checks_cpu_min_ms']:5.1f} / "
                f"{row['without_checks_cpu_min_ms']:5.1f} ms  "
                f"wall {row['with_checks_wall_ms']:6.1f} / "
                f"{row['without_checks_wall_ms']:6.1f} ms  "
                f"signature_checks {row['signature_checks_ms']:.2f} ms"
            )
    if args.json:
        write_json(args.json, {"repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()

"""The CUDA errors the native runtime takes for process-fatal (``cu_sticky`` in
asyncmetal/native/cuda_stream.h: a queue's fence the driver refused with one of them is
not tried again, and the queue settles at once) are those the backend reports the
process lost for (``LOST`` in asyncmetal/backends/cuda/_driver.py). The two lists are
written twice, in C and in Python: a change to one without the other fails here.
The other refusals of a fence that are not tried again (``cu_fence_final``) name their
CUresults rightly, and neither a refusal for lack of memory nor an invalid value or
handle (the stream's work may still run) is among them.
Runs everywhere: the C lists are read from the header.
"""

from __future__ import annotations

import re
from importlib import resources

import pytest

from asyncmetal.backends.cuda import _driver

# The CUresult value of each error either list may name (CUDA's cuda.h); compared with
# cuda-bindings' where it is installed.
CUDA_H = {
    "CUDA_ERROR_INVALID_VALUE": 1,
    "CUDA_ERROR_OUT_OF_MEMORY": 2,
    "CUDA_ERROR_NOT_INITIALIZED": 3,
    "CUDA_ERROR_DEINITIALIZED": 4,
    "CUDA_ERROR_INVALID_CONTEXT": 201,
    "CUDA_ERROR_INVALID_HANDLE": 400,
    "CUDA_ERROR_CONTEXT_IS_DESTROYED": 709,
    "CUDA_ERROR_ECC_UNCORRECTABLE": 214,
    "CUDA_ERROR_ILLEGAL_ADDRESS": 700,
    "CUDA_ERROR_LAUNCH_TIMEOUT": 702,
    "CUDA_ERROR_ASSERT": 710,
    "CUDA_ERROR_HARDWARE_STACK_ERROR": 714,
    "CUDA_ERROR_ILLEGAL_INSTRUCTION": 715,
    "CUDA_ERROR_MISALIGNED_ADDRESS": 716,
    "CUDA_ERROR_INVALID_ADDRESS_SPACE": 717,
    "CUDA_ERROR_INVALID_PC": 718,
    "CUDA_ERROR_LAUNCH_FAILED": 719,
}


def native_cases(function: str, returns: list[str]) -> dict[str, int]:
    """The cases of ``function`` (cu_sticky, cu_fence_final), by the CUresult name each
    one's comment gives; its ``return`` statements are ``returns``."""
    header = resources.files("asyncmetal").joinpath("native", "cuda_stream.h").read_text()
    found = re.search(rf"static inline int {function}\(int r\) \{{\n(.*?)\n\}}", header, re.S)
    assert found, f"{function} is not in cuda_stream.h"
    named: dict[str, int] = {}
    for code, rest in re.findall(r"^\s*case (\d+):(.*)$", found.group(1), re.M):
        name = re.fullmatch(r"\s*/\* (CUDA_ERROR_\w+) \*/\s*", rest)
        assert name, f"{function}'s case {code} does not name its CUresult in a comment"
        assert name.group(1) not in named, f"{name.group(1)} is named twice"
        named[name.group(1)] = int(code)
    # Every value it returns 1 for is one of those cases (no other condition).
    assert re.findall(r"return (\w+);", found.group(1)) == returns, found.group(1)
    return named


def native_sticky() -> dict[str, int]:
    return native_cases("cu_sticky", ["1", "0"])


def test_the_native_sticky_errors_are_the_ones_python_reports_the_process_lost_for() -> None:
    native = native_sticky()
    assert sorted(native) == sorted(_driver.LOST)
    unknown = sorted(set(_driver.LOST) - set(CUDA_H))
    assert not unknown, f"add the CUresult values of {unknown} (cuda.h) to CUDA_H"
    assert native == {name: CUDA_H[name] for name in _driver.LOST}


@pytest.mark.cuda
def test_the_values_are_the_drivers() -> None:
    if _driver.cu is None:
        pytest.skip("cuda-bindings is not installed: no CUresult to compare CUDA_H with")
    for name, value in CUDA_H.items():
        # (getattr: cuda-bindings 13's CUresult is not subscriptable by name)
        assert int(getattr(_driver.cu.CUresult, name)) == value, name


def test_the_final_refusals_of_a_fence_name_their_cuda_errors() -> None:
    """cu_fence_final: the sticky errors (its first return), then its own cases."""
    header = resources.files("asyncmetal").joinpath("native", "cuda_stream.h").read_text()
    assert "int cu_fence_final(int r) {\n    if (cu_sticky(r)) return 1;\n" in header
    final = native_cases("cu_fence_final", ["1", "1", "0"])
    unknown = sorted(set(final) - set(CUDA_H))
    assert not unknown, f"add the CUresult values of {unknown} (cuda.h) to CUDA_H"
    assert final == {name: CUDA_H[name] for name in final}
    assert not set(final) & set(native_sticky())
    # What a fence is tried again for: out of memory for a new event; a stream whose
    # queued work still runs (its handle or an argument refused: only a fence behind
    # that work says it is done).
    for retried in (
        "CUDA_ERROR_OUT_OF_MEMORY",
        "CUDA_ERROR_INVALID_VALUE",
        "CUDA_ERROR_INVALID_HANDLE",
    ):
        assert retried not in final

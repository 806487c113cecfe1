"""The CUDA errors the native runtime takes for process-fatal (``cu_sticky`` in
asyncmetal/native/cuda_stream.h: a queue's fence the driver refused with one of them is
not tried again, and the queue settles at once) are those the backend reports the
process lost for (``LOST`` in asyncmetal/backends/cuda/_driver.py). The two lists are
written twice, in C and in Python: a change to one without the other fails here.
Runs everywhere: the C list is read from the header.
"""

from __future__ import annotations

import re
from importlib import resources

import pytest

from asyncmetal.backends.cuda import _driver

# The CUresult value of each error either list may name (CUDA's cuda.h); compared with
# cuda-bindings' where it is installed.
CUDA_H = {
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


def native_sticky() -> dict[str, int]:
    """cu_sticky's cases, by the CUresult name each one's comment gives."""
    header = resources.files("asyncmetal").joinpath("native", "cuda_stream.h").read_text()
    found = re.search(r"static inline int cu_sticky\(int r\) \{\n(.*?)\n\}", header, re.S)
    assert found, "cu_sticky is not in cuda_stream.h"
    named: dict[str, int] = {}
    for code, rest in re.findall(r"^\s*case (\d+):(.*)$", found.group(1), re.M):
        name = re.fullmatch(r"\s*/\* (CUDA_ERROR_\w+) \*/\s*", rest)
        assert name, f"cu_sticky's case {code} does not name its CUresult in a comment"
        assert name.group(1) not in named, f"{name.group(1)} is named twice"
        named[name.group(1)] = int(code)
    # Every value it returns 1 for is one of those cases (no other condition).
    assert re.findall(r"return (\w+);", found.group(1)) == ["1", "0"], found.group(1)
    return named


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

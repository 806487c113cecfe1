from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import AsyncIterator

import pytest

# Keep the tests' compile cache out of the user's cache directory, and remove it at exit:
# registered before asyncmetal is imported, so after its own exit hooks (which stop the
# compile pools writing there) have run.
if "ASYNCMETAL_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="asyncmetal-test-cache-")
    os.environ["ASYNCMETAL_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)

from tests.support.fakes import metal_sim

# Off macOS the metal device is the simulated Metal (tests/support/fakes/metal_sim), where
# it builds.
metal_sim.configure()

import asyncmetal as am  # noqa: E402 - after the simulation is configured
from tests.support.kernels import KERNELS, MSL_KERNELS  # noqa: E402

LOOPS = {
    "asyncio": ("asyncio", {"debug": True}),
    "trio": ("trio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
}
# The devices the `device` fixture runs each test on: cpu, and metal where it opens
# (macOS, or the simulation here). On metal the tests run on uvloop too.
DEVICES = ["cpu", *(["metal"] if "metal" in am.devices() else [])]
# Tests written against the cpu device's C source or its name run on cpu only
# (tests/backends/metal/test_metal.py has their Metal counterparts).
CPU_ONLY = {
    "test_device_compile_uses_its_pool",  # compiles the C kernels
    "test_compile_many_reports_failures_in_turn",  # C sources
    "test_compile_many_yields_each",  # C sources
    "test_c_that_does_not_compile_carries_the_log",  # a C compiler's log
    "test_options_that_make_an_object_file_say_so",  # the C compiler's -c
    "test_options_that_make_no_library_say_so_with_the_log",  # the C compiler's options
    "test_buffer_of_another_device_is_refused",  # messages name cpu
    # the native extension's launch path of cpu (and cuda) queues; metal has none
    "test_it_submits_the_common_case",
    "test_random_launches_end_alike_with_and_without_it",
    "test_launch_paths_give_the_same_results",
    # copies between two devices of the cpu kind on the device's own queue
    "test_closing_a_device_keeps_memory_another_device_still_reads",
    "test_closing_a_device_never_frees_memory_a_held_copy_will_read",
    # the compile pool and its cache, with C sources
    "test_value_parameters_must_be_scalars",
    # C kernels: the cpu device's launch paths, calling convention and macros
    "test_every_launch_path_passes_them",
    "test_cpu_arguments_past_the_registers_go_on_the_stack",
    "test_a_python_float_for_a_type_not_known_is_refused",
    "test_cpu_half_floats_pass_in_the_vector_registers",
    "test_a_type_defined_apart_in_if_branches_is_not_known",
    "test_a_value_no_launch_passes_is_refused_behind_its_typedef",
    "test_a_cpu_kernel_returning_through_memory_or_the_x87_stack_is_refused",
    "test_scalar_types_read_past_attributes_and_enums",
    "test_a_macro_naming_a_type_is_read_as_it",
    "test_a_reference_parameter_is_refused",
    "test_unnamed_parameters_take_their_whole_type",
    "test_a_plain_char_takes_the_signedness_its_compiler_gives_it",
    "test_wide_character_parameters_take_their_types",
    "test_a_kernel_without_external_linkage_says_why",
    "test_a_kernel_defined_in_k_and_r_style_is_refused_saying_why",
    "test_a_timeout_too_long_for_a_clock_is_none",
    "test_compile_many_goes_on_after_an_error",
    "test_compile_many_goes_on_after_a_cancelled_step",
    "test_compile_errors_name_their_kernel",
    "test_a_cached_binary_for_another_machine_is_rebuilt",
    "test_an_unusable_cache_keeps_compiles_working",
    # a cpu kernel that holds its queue on a pipe
    "test_a_command_running_as_a_discard_lands_finishes_and_nothing_after_it_runs",
}


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device_name" not in metafunc.fixturenames or "anyio_backend" not in metafunc.fixturenames:
        return
    params = []
    for name in ["cpu"] if metafunc.function.__name__ in CPU_ONLY else DEVICES:
        loops = ["asyncio", "trio"] + (["uvloop"] if name == "metal" and _has_uvloop() else [])
        for loop in loops:
            marks = [pytest.mark.metal] if name == "metal" else []
            test_id = loop if name == "cpu" else f"{name}-{loop}"
            params.append(pytest.param(LOOPS[loop], name, id=test_id, marks=marks))
    metafunc.parametrize(("anyio_backend", "device_name"), params)


@pytest.fixture(
    params=[
        pytest.param(LOOPS["asyncio"], id="asyncio"),
        pytest.param(LOOPS["trio"], id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def device_name() -> str:
    return "cpu"  # parametrized by pytest_generate_tests over DEVICES


@pytest.fixture
async def device(anyio_backend: object, device_name: str) -> AsyncIterator[am.Device]:
    async with am.open_device(device_name) as dev:
        yield dev


@pytest.fixture
async def kernels(device: am.Device) -> dict[str, am.Program]:
    names = ["empty", "add", "fill", "step", "spin", "sleep_ms"]
    source = MSL_KERNELS if device.name == "metal" else KERNELS
    return {name: await device.compile(source, name) for name in names}


@pytest.fixture
def unreaped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Devices' reapers never let go of idle queues during the test (Device._look): a
    queue let go of takes the Python launch path until submitted to again, so a test of
    which path a queue takes would depend on the time between its launches."""
    from asyncmetal import _device

    monkeypatch.setattr(_device, "REAP_S", 1e6)

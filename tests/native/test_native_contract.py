"""The declared contract between the Python classes and the native extension
(asyncmetal/_native_contract.py): the extension reads exactly what it declares, and a
drift -- a renamed attribute or method, a key or tuple layout the two sides disagree
on -- raises NativeContractError naming it, once, at setup."""

from __future__ import annotations

import types

import pytest

from asyncmetal import _native, _native_contract
from asyncmetal._allocator import Allocation
from asyncmetal._backend import Arg
from asyncmetal._buffer import Buffer
from asyncmetal._device_state import DeviceState
from asyncmetal._native_contract import NativeContractError
from asyncmetal._program import Program
from asyncmetal._queue import _ONE3, Completion, Queue
from asyncmetal.backends.cpu import CPUQueue, _Memory

pytestmark = pytest.mark.skipif(not _native.available(), reason="no native runtime here")


@pytest.fixture
def extension() -> types.ModuleType:
    ext = _native.extension()
    if ext is None:
        pytest.skip(f"the extension module is not in use: {_native.extension_error}")
    return ext


@pytest.fixture(autouse=True)
def fresh_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """check_class remembers the classes that passed: none, for these tests."""
    monkeypatch.setattr(_native_contract, "_checked", set())


class _Device:
    def __init__(self) -> None:
        self.closed = False


def _classes(**override: type) -> dict[str, type]:
    classes: dict[str, type] = {
        "Queue": Queue,
        "Device": _Device,
        "DeviceState": DeviceState,
        "Program": Program,
        "Buffer": Buffer,
        "Allocation": Allocation,
        "Completion": Completion,
        "Arg": Arg,
    }
    classes.update(override)
    return classes


def test_the_extension_reads_what_the_contract_declares(extension: types.ModuleType) -> None:
    assert set(extension.CONTRACT_KEYS) == set(_native_contract.NAMES)
    assert extension.LAYOUTS == _native_contract.LAYOUTS
    assert Arg._fields == _native_contract.LAYOUTS["Arg"]
    _native_contract.setup(extension, _classes(), _ONE3)  # the real classes pass


def test_a_renamed_attribute_is_named_at_setup(
    extension: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(_native_contract.NAMES, "Queue.submitted", "_kept_back")
    with pytest.raises(NativeContractError, match=r"Queue has no attribute '_kept_back'"):
        _native_contract.setup(extension, _classes(), _ONE3)


def test_a_class_that_lost_an_attribute_is_named(extension: types.ModuleType) -> None:
    class DeviceState:  # no `closed`
        __slots__ = ("name",)

    with pytest.raises(NativeContractError, match=r"DeviceState has no attribute 'closed'"):
        _native_contract.setup(extension, _classes(DeviceState=DeviceState), _ONE3)


def test_attributes_assigned_in_init_slots_and_fields_count() -> None:
    class Slotted:
        __slots__ = ("freed", "handle", "last_use")

    class Assigned:
        def __init__(self) -> None:
            self.freed = self.handle = None
            self.last_use: dict[object, int] = {}

    _native_contract.check_class("Allocation", Slotted)
    _native_contract.check_class("Allocation", Assigned)

    class Read:  # reads the names, never assigns them
        def __init__(self, other: Slotted) -> None:
            print(other.freed, other.handle, other.last_use)

    with pytest.raises(NativeContractError, match="'freed'"):
        _native_contract.check_class("Allocation", Read)


def test_a_backend_queue_without_its_method_is_named() -> None:
    class NoHook(CPUQueue):
        _submitted = None  # type: ignore[assignment]

    queue = object.__new__(NoHook)
    with pytest.raises(NativeContractError, match=r"NoHook has no method '_submitted'"):
        _native_contract.cpu_launch_target(
            queue,
            1,
            times=None,
            times_address=1,
            times_kept=1,
            keep_items=(),
            memory_type=_Memory,
        )
    target = _native_contract.cpu_launch_target(
        object.__new__(CPUQueue),
        1,
        times="t",
        times_address=2,
        times_kept=3,
        keep_items="k",
        memory_type=_Memory,
    )
    fields = dict(zip(_native_contract.LAYOUTS["cpu_target"], target, strict=True))
    assert fields["times"] == "t" and fields["times_kept"] == 3 and fields["keep_items"] == "k"


def test_keys_or_layouts_that_disagree_with_the_extension_raise() -> None:
    keys = (*_native_contract.NAMES, "Queue.new_thing")
    fake = types.SimpleNamespace(CONTRACT_KEYS=keys, LAYOUTS=dict(_native_contract.LAYOUTS))
    with pytest.raises(NativeContractError, match=r"Queue\.new_thing"):
        _native_contract.install_names(fake)  # type: ignore[arg-type]
    layouts = {**_native_contract.LAYOUTS, "Arg": ("offset", "handle", "value")}
    fake = types.SimpleNamespace(CONTRACT_KEYS=tuple(_native_contract.NAMES), LAYOUTS=layouts)
    with pytest.raises(NativeContractError, match="laid out"):
        _native_contract.install_names(fake)  # type: ignore[arg-type]


def test_the_extension_takes_one_name_per_key(extension: types.ModuleType) -> None:
    with pytest.raises(TypeError, match="tuple of"):
        extension.set_names(("device",))
    with pytest.raises(TypeError, match=r"Queue\.device"):
        extension.set_names((1, *tuple(_native_contract.NAMES.values())[1:]))
    _native_contract.install_names(extension)  # restores the real names

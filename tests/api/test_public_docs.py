"""What ``help()`` shows of the public names: each documented, naming only public things."""

from __future__ import annotations

import builtins
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import asyncmetal as am

ROOT = Path(__file__).resolve().parents[2]


def _documented() -> dict[str, str]:
    """The docstring of every name in ``__all__`` and of every public function and
    property of its classes (those asyncmetal defines: not ``Exception``'s), by name."""
    docs: dict[str, str] = {}
    for name in am.__all__:
        obj = getattr(am, name)
        docs[name] = inspect.getdoc(obj) or ""
        if not inspect.isclass(obj):
            continue
        for klass in obj.__mro__:
            if klass.__module__.partition(".")[0] != "asyncmetal":
                continue
            for member, value in vars(klass).items():
                key = f"{name}.{member}"
                if member.startswith("_") or key in docs:
                    continue
                target: Any = value
                if isinstance(value, (staticmethod, classmethod)):
                    target = value.__func__
                elif isinstance(value, property):
                    target = value.fget
                if inspect.isfunction(target):
                    docs[key] = target.__doc__ or ""
    return docs


def _resolves(owner: str, reference: str) -> bool:
    """Whether ``reference`` (``Name``, ``Name.attr``, ``asyncmetal.name``) is a public
    name, or a member of the class ``owner`` documents."""
    path = reference.removeprefix("asyncmetal.").split(".")
    obj: Any = getattr(am, path[0], None)
    if obj is None or path[0] not in am.__all__:
        cls = getattr(am, owner.partition(".")[0])
        return len(path) == 1 and inspect.isclass(cls) and hasattr(cls, path[0])
    for part in path[1:]:
        if part.startswith("_") or not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def test_every_public_name_and_member_has_a_docstring() -> None:
    undocumented = [key for key, doc in _documented().items() if not doc.strip()]
    assert undocumented == []


@pytest.mark.parametrize("key", sorted(_documented()))
def test_docstrings_name_only_public_things(key: str) -> None:
    """A docstring's references -- ``:meth:`X``` and the like, and ``Class.attr`` in
    double backticks -- are to public names (what a reader can look up with help()),
    and it points at no internal document (DESIGN.md's numbered contracts)."""
    doc = _documented()[key]
    roles = re.findall(r":(?:func|meth|class|attr|exc):`~?([\w.]+)`", doc)
    dotted = re.findall(r"``((?:asyncmetal\.)?[A-Z]\w*(?:\.\w+)+)``", doc)
    unresolved = [ref for ref in roles + dotted if not _resolves(key, ref)]
    assert unresolved == []
    assert not re.search(r"\bcontract \d", doc)


def _members(cls: type) -> dict[str, Any]:
    """What ``help(cls)`` lists as public: each name without a leading underscore that a
    class of asyncmetal in its MRO defines (not ``Exception``'s), with its value."""
    members: dict[str, Any] = {}
    for klass in cls.__mro__:
        if klass.__module__.partition(".")[0] == "asyncmetal":
            for member, value in vars(klass).items():
                if not member.startswith("_"):
                    members.setdefault(member, value)
    return members


def _readme_code() -> list[str]:
    """README's code: its ``inline`` spans and its fenced blocks."""
    readme = (ROOT / "README.md").read_text()
    fence = re.compile(r"^```\w*\n(.*?)^```$", re.S | re.M)
    return fence.findall(readme) + re.findall(r"`([^`]+)`", fence.sub("", readme))


def test_every_public_member_is_one_readme_names() -> None:
    """Every public member of a public class is named in README's code (``buf.busy()``,
    ``max_workers``): what is not documented there takes a leading underscore. Checked:
    fails with a plumbing method made public again (``Timeline.advanced``,
    ``CompilePool.submit``, ``CompileCache.get_disk`` were listed so)."""
    code = _readme_code()
    undocumented = [
        f"{name}.{member}"
        for name in am.__all__
        if inspect.isclass(cls := getattr(am, name))
        for member in _members(cls)
        if not any(re.search(rf"(?<![\w]){member}\b", span) for span in code)
    ]
    assert undocumented == []


def _annotations(function: Any) -> list[str]:
    """The annotations of ``function``'s parameters and return, as written."""
    signature = inspect.signature(function, eval_str=False)
    written = [p.annotation for p in signature.parameters.values()]
    written.append(signature.return_annotation)
    return [
        a if isinstance(a, str) else repr(a) for a in written if a is not inspect.Parameter.empty
    ]


def _public_callables() -> dict[str, Any]:
    """Each public function, and each public method and property of a public class
    (not a constructor: the classes are made by asyncmetal, not by callers), by name."""
    found: dict[str, Any] = {}
    for name in am.__all__:
        obj = getattr(am, name)
        if not inspect.isclass(obj):
            found[name] = obj
            continue
        for member, value in _members(obj).items():
            target = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            target = target.fget if isinstance(target, property) else target
            if inspect.isfunction(target):
                found[f"{name}.{member}"] = target
    return found


@pytest.mark.parametrize("key", sorted(_public_callables()))
def test_signatures_name_only_public_types(key: str) -> None:
    """What ``help()`` and ``inspect.signature`` show of a public callable names no
    class that a reader cannot look up: each annotation's names are public names,
    typing's or numpy's -- no ``_Job`` or ``_DeviceOpener``. Checked: fails with
    ``open_device`` annotated as returning the private opener class."""
    function = _public_callables()[key]
    private = []
    for annotation in _annotations(function):
        for word in re.findall(r"[A-Za-z_][\w.]*", annotation):
            head = word.partition(".")[0]
            obj = function.__globals__.get(head, getattr(builtins, head, None))
            if head.startswith("_") or (
                inspect.isclass(obj)
                and obj.__module__.partition(".")[0] == "asyncmetal"
                and head not in am.__all__
            ):
                private.append(word)
    assert private == []

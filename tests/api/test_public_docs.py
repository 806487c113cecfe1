"""What ``help()`` shows of the public names: each documented, naming only public things."""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest

import asyncmetal as am


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

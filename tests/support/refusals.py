"""Checking that an action is refused before anything is submitted (contract 8)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import asyncmetal as am


def rejects(
    device: am.Device, exc: type[BaseException], match: str, action: Callable[[], Any]
) -> None:
    """``action()`` raises ``exc`` matching ``match``, and no queue of ``device`` got a
    command."""
    before = [q.submitted for q in device._queues]
    with pytest.raises(exc, match=match):
        action()
    assert [q.submitted for q in device._queues] == before, "something was submitted"

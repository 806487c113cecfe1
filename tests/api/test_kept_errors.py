"""What an error kept to be raised to many callers keeps (asyncmetal._errors'
keep_error and fresh_error): its type, message, attributes, cause, context and notes;
never a traceback, nor another caller's frames."""

from __future__ import annotations

import pickle

import pytest

import asyncmetal as am
from asyncmetal._errors import fresh_error, keep_error


def _raised(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as exc:
        return exc


def _depth(error: BaseException) -> int:
    depth, tb = 0, error.__traceback__
    while tb is not None:
        depth, tb = depth + 1, tb.tb_next
    return depth


def test_a_kept_error_has_no_traceback_along_its_chain() -> None:
    cause = _raised(OSError(2, "gone"))
    context = _raised(ValueError("before"))
    error = am.CompileError("failed", "the log", name="k")
    error.__cause__, error.__context__ = cause, context
    _raised(error)
    assert keep_error(error) is error
    assert [e.__traceback__ for e in (error, cause, context)] == [None] * 3


@pytest.mark.parametrize(
    "error",
    [
        am.CompileError("failed", "the log", name="k"),
        am.OutOfMemoryError(1, 2, 3, 4, "why"),
        am.DeviceLostError("lost"),
        OSError(2, "gone"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_each_fresh_copy_is_alike_and_its_own(error: BaseException) -> None:
    cause = keep_error(_raised(am.AsyncMetalError("below")))
    error.__cause__ = cause
    error.__notes__ = ["a note"]  # (add_note, from Python 3.11 on)
    keep_error(error)
    copies = [_raised(fresh_error(error)) for _ in range(3)]
    assert len({id(c) for c in (error, *copies)}) == 4
    for copy in copies:
        assert type(copy) is type(error) and str(copy) == str(error)
        assert copy.__dict__ == error.__dict__ and copy.__cause__ is cause
        assert copy.__notes__ == ["a note"] and copy.__notes__ is not error.__notes__
        assert str(pickle.loads(pickle.dumps(copy))) == str(error)
    assert {_depth(c) for c in copies} == {1}  # (each: its own raise only)
    assert error.__traceback__ is None


class _Uncopyable(Exception):
    def __init__(self, a: int, b: int) -> None:  # (its args are one message)
        super().__init__(f"{a} and {b}")


def test_an_error_that_cannot_be_copied_is_handed_out_itself_without_traceback() -> None:
    error = _raised(_Uncopyable(1, 2))
    assert fresh_error(error) is error and error.__traceback__ is None

"""An `OcrvlError` raised in an engine worker crosses the pipe whole: its class (so whether it
is permanent, and its exit code), its message and its fix (issue 50, item 3)."""

from __future__ import annotations

import pickle

import pytest

from ocrvl_daemon.core.messages import ErrorRecord
from ocrvl_daemon.errors import (
    ExitCode,
    InputFileError,
    InputVanishedError,
    OcrvlError,
    UnsetVariableError,
)


def across_the_pipe(error: OcrvlError) -> OcrvlError:
    """`error` as the daemon gets it back from a worker."""
    record: ErrorRecord = pickle.loads(pickle.dumps(ErrorRecord.of(error)))
    return record.rebuilt()


@pytest.mark.quick
def test_a_permanent_input_error_stays_permanent_with_its_message_and_fix() -> None:
    sent = InputFileError("book.pdf is encrypted with a password.", "save an unprotected copy")
    back = across_the_pipe(sent)
    assert type(back) is InputFileError and back.permanent, (
        f"{type(back).__name__} came back: it would be retried as if the file had gone")
    assert (back.message, back.fix, back.exit_code) == (
        sent.message, sent.fix, ExitCode.INPUT_FILE)
    assert str(back) == str(sent)


@pytest.mark.quick
def test_a_transient_error_stays_transient() -> None:
    back = across_the_pipe(InputVanishedError("book.pdf changed while it was being converted."))
    assert type(back) is InputVanishedError and not back.permanent


@pytest.mark.quick
def test_an_error_whose_own_constructor_differs_still_comes_back_whole() -> None:
    back = across_the_pipe(UnsetVariableError("KEY"))
    assert type(back) is UnsetVariableError and back.permanent
    assert back.message == "$KEY is not set in the environment" and back.fix


@pytest.mark.quick
def test_an_unknown_kind_comes_back_as_an_ocrvl_error_with_its_words() -> None:
    back = ErrorRecord("NoSuchError", "something odd", "try again").rebuilt()
    assert type(back) is OcrvlError and str(back) == "something odd Fix: try again"

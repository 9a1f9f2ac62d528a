"""How an engine worker's failures reach the daemon: an `OcrvlError` crosses the pipe whole,
its class (so whether it is permanent, and its exit code), its message and its fix (issue 50,
item 3); a failed request is told by its HTTP status (refused, failed, or no answer)."""

from __future__ import annotations

import pickle
import subprocess
from concurrent.futures import Future

import httpx
import pytest

from ocrvl_daemon.core.messages import ErrorRecord, Failure, WorkerFailed
from ocrvl_daemon.engine.worker_handle import EngineWorker
from ocrvl_daemon.errors import (
    ExitCode,
    InputFileError,
    InputVanishedError,
    OcrvlError,
    UnsetVariableError,
)
from ocrvl_daemon.worker.page import _request_failure
from ocrvl_daemon.worker.streaming import StatusError


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


@pytest.mark.quick
@pytest.mark.parametrize(("status", "kind"), [
    (400, Failure.REFUSED), (404, Failure.REFUSED), (401, Failure.REFUSED),
    (429, Failure.SERVER_ERROR), (408, Failure.SERVER_ERROR), (503, Failure.SERVER_ERROR)])
def test_a_failed_request_is_told_by_its_http_status(status: int, kind: Failure) -> None:
    # PaddleX re-raises a request's error as a RuntimeError holding its text; the request's
    # own future still has the error with its status.
    request: Future[None] = Future()
    request.set_exception(StatusError(status, "the server's words"))
    failure = _request_failure(RuntimeError("HTTP error"), [request])
    assert failure == (kind, f"HTTP {status}: the server's words"), (
        f"an HTTP {status} answer should be a {kind.value} failure, not {failure}")


@pytest.mark.quick
def test_a_request_without_an_answer_is_the_server_being_gone() -> None:
    failure = _request_failure(RuntimeError("x"), [])
    assert failure is None
    request: Future[None] = Future()
    request.set_exception(httpx.ConnectError("refused"))
    got = _request_failure(RuntimeError("x"), [request])
    assert got is not None and got[0] is Failure.SERVER_DOWN


@pytest.mark.quick
def test_a_worker_that_exits_after_saying_why_is_ended_with_its_reason() -> None:
    # Its last words (WorkerFailed) are read, but not yet collected, when the daemon sees the
    # process gone: the end must carry them, not a bare "engine worker exited".
    worker = EngineWorker(None)  # type: ignore[arg-type]  # never started: no setup needed
    worker._process = subprocess.Popen(["true"])
    worker._process.wait()
    worker._inbox.put(WorkerFailed("ModuleNotFoundError: No module named 'paddlex'"))
    assert not worker.alive()
    assert worker.failure == "ModuleNotFoundError: No module named 'paddlex'", (
        "the worker's own reason for failing was lost")

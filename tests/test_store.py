"""The store and the security rules around it: private state, loopback server, no shell."""

from __future__ import annotations

import ast
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.job import Job, JobState, PageFailure
from ocrvl_daemon.storage.store import Store

PACKAGE = Path(__file__).resolve().parents[1] / "ocrvl_daemon"
MODEL = "PaddleOCR-VL-1.6-0.9B"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.quick
def test_state_directory_and_database_are_private_to_the_user(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)  # an existing, too open folder is tightened too
    Store(state / "jobs.sqlite").close()
    assert mode(state) == 0o700
    assert mode(state / "jobs.sqlite") == 0o600


@pytest.mark.quick
def test_the_server_listens_on_loopback_by_default() -> None:
    config = Config()
    assert config.server.host == "127.0.0.1"
    assert config.server.base_url.startswith("http://127.0.0.1:")


@pytest.mark.quick
def test_no_shell_is_ever_used_to_run_commands() -> None:
    """File names reach child processes only as argv items, never through a shell."""
    offenders = []
    for source in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(source.read_text("utf-8"))):
            shell = isinstance(node, ast.keyword) and node.arg == "shell" and not (
                isinstance(node.value, ast.Constant) and node.value.value is False)
            os_call = (isinstance(node, ast.Attribute) and node.attr in ("system", "popen")
                       and isinstance(node.value, ast.Name) and node.value.id == "os")
            if shell or os_call:
                offenders.append(f"{source.name}:{getattr(node, 'lineno', '?')}")
    assert not offenders, offenders


@pytest.mark.quick
def test_states_counts_and_page_flags(tmp_path: Path) -> None:
    store = Store(tmp_path / "jobs.sqlite")
    try:
        a = store.enqueue(tmp_path / "a.pdf", "sha-a", 1, 1.0, MODEL)
        b = store.enqueue(tmp_path / "b.pdf", "sha-b", 1, 1.0, MODEL)
        store.set_running(a.id, 3)
        store.set_failed(b.id, "broken", permanent=True)
        assert store.count_by_state() == {JobState.QUEUED: 0, JobState.RUNNING: 1,
                                          JobState.DONE: 0, JobState.FAILED: 1,
                                          JobState.GONE: 0}
        # The same content is not retried until it changes (or `ocrvl retry`).
        assert store.enqueue(tmp_path / "b.pdf", "sha-b", 1, 2.0, MODEL).state is JobState.FAILED
        assert store.enqueue(tmp_path / "b.pdf", "sha-b2", 1, 3.0, MODEL).state is JobState.QUEUED
        store.save_page("sha-a", MODEL, 0, "ok", {})
        store.save_page("sha-a", MODEL, 1, "half", {}, note="cut off")
        store.save_page("sha-a", MODEL, 2, "", {}, note="failed", failure=PageFailure.RETRYABLE)
        assert store.flagged_pages("sha-a", MODEL) == [1]
        store.save_page("sha-a", MODEL, 3, "", {}, note="damaged", failure=PageFailure.DAMAGED)
        assert store.failed_pages("sha-a", MODEL) == [2]
        assert store.failed_pages("sha-a", MODEL, PageFailure.DAMAGED) == [3]
        assert store.count_pages("sha-a", MODEL) == 4
        assert store.recover_running() == 1
        assert store.job(a.id).state is JobState.QUEUED  # type: ignore[union-attr]
    finally:
        store.close()


@pytest.mark.quick
def test_a_name_that_is_not_utf8_round_trips_and_its_errors_are_kept_escaped(
        tmp_path: Path) -> None:
    odd = tmp_path / os.fsdecode(b"\xff\xfebook.pdf")
    store = Store(tmp_path / "jobs.sqlite")
    try:
        job = store.enqueue(odd, "sha", 1, 1.0, MODEL)
        assert store.job_for_path(odd) == job and os.fsencode(job.path) == os.fsencode(odd)
        assert store.job_for_path(tmp_path / "\ufffd\ufffdbook.pdf") is None
        store.set_failed(job.id, f"{odd} is encrypted", permanent=True)
        store.save_page("sha", MODEL, 0, "", {}, note=f"redo {odd}", failure=PageFailure.DAMAGED)
        [failed] = store.jobs(JobState.FAILED)
        assert failed.last_error == f"{tmp_path}/\\xff\\xfebook.pdf is encrypted"
        assert next(store.iter_pages("sha", MODEL)).note == f"redo {tmp_path}/\\xff\\xfebook.pdf"
    finally:
        store.close()


@pytest.mark.quick
def test_a_database_of_an_earlier_version_keeps_its_jobs(tmp_path: Path) -> None:
    """Paths were stored as text before names that are not UTF-8 were kept as bytes."""
    db = tmp_path / "jobs.sqlite"
    with sqlite3.connect(db) as old:
        old.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, path TEXT NOT NULL UNIQUE, "
                    "sha256 TEXT NOT NULL, size INTEGER NOT NULL, mtime REAL NOT NULL, "
                    "model TEXT NOT NULL, state TEXT NOT NULL, attempts INTEGER NOT NULL "
                    "DEFAULT 0, last_error TEXT, page_count INTEGER, created REAL NOT NULL, "
                    "updated REAL NOT NULL, started REAL, finished REAL, not_before REAL NOT "
                    "NULL DEFAULT 0)")
        old.execute("INSERT INTO jobs (path, sha256, size, mtime, model, state, created, "
                    "updated) VALUES (?, 'sha', 1, 1.0, ?, 'done', 0, 0)",
                    (str(tmp_path / "Ünï book.pdf"), MODEL))
    store = Store(db)
    try:
        job = store.job_for_path(tmp_path / "Ünï book.pdf")
        assert job is not None and job.state is JobState.DONE, "an old job was lost"
        assert job.redo_tokens == 0
        assert store.enqueue(job.path, "sha", 1, 1.0, MODEL).id == job.id
        assert len(store.jobs()) == 1, "the old job was duplicated"
    finally:
        store.close()


@pytest.mark.quick
def test_a_store_from_before_hooks_opens_and_records_hook_outcomes(tmp_path: Path) -> None:
    import sqlite3

    db = tmp_path / "jobs.sqlite"
    Store(db).close()
    with sqlite3.connect(db) as conn:  # the jobs table as it was before hooks existed
        conn.execute("ALTER TABLE jobs DROP COLUMN hook_error")
        conn.execute("INSERT INTO jobs (path, sha256, size, mtime, model, state, created, "
                     "updated) VALUES ('/x/a.pdf', 'h', 1, 1.0, 'm', 'done', 0, 0)")
    store = Store(db)
    job = store.jobs()[0]
    assert job.hook_error is None
    store.set_hook_error(job.id, "on_done hook 'x' exited with status 1")
    assert store.jobs()[0].hook_error == "on_done hook 'x' exited with status 1"
    store.close()


@pytest.fixture
def converting(tmp_path: Path) -> Iterator[tuple[Store, Job]]:
    """A store with book.pdf's job running (60 pages)."""
    store = Store(tmp_path / "jobs.sqlite")
    job = store.enqueue(tmp_path / "book.pdf", "sha-old", 1, 1.0, MODEL)
    store.set_running(job.id, 60)
    try:
        yield store, job
    finally:
        store.close()


@pytest.mark.quick
def test_a_job_is_marked_done_only_while_it_is_still_the_version_that_was_written(
        tmp_path: Path, converting: tuple[Store, Job]) -> None:
    store, job = converting
    # The rescan arrives while the old version converts: the watcher queues it.
    store.enqueue(tmp_path / "book.pdf", "sha-new", 2, 2.0, MODEL)
    assert not store.set_done(job.id, sha256="sha-old"), (
        "the old version's Markdown marked the new version done")
    assert store.job(job.id).state is JobState.QUEUED  # type: ignore[union-attr]
    assert store.set_done(job.id, sha256="sha-new")


@pytest.mark.quick
def test_a_document_deleted_while_it_converted_is_gone_until_its_file_is_back(
        tmp_path: Path, converting: tuple[Store, Job]) -> None:
    store, job = converting
    store.set_gone(job.id, "book.pdf was deleted while it was being converted")
    gone = store.job(job.id)
    assert gone is not None and gone.state is JobState.GONE
    assert gone.last_error == "book.pdf was deleted while it was being converted"
    assert store.enqueue(tmp_path / "book.pdf", "sha-old", 1, 1.0, MODEL).state is \
        JobState.QUEUED, "the same PDF put back was not queued again"

"""Jobs in the store: where the daemon's and `ocrvl convert`'s stores live, how a file becomes
a job (`enqueue_file`), which queued jobs are due (`due_jobs`), and how a job's failure is
recorded for the user (`record_failure`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Container
from pathlib import Path

from ocrvl_daemon.config.model import Config, Recipe
from ocrvl_daemon.core.backoff import Backoff
from ocrvl_daemon.core.job import Job, JobState
from ocrvl_daemon.errors import InputFileError, InputVanishedError, OcrvlError
from ocrvl_daemon.files import pdf
from ocrvl_daemon.observe.logs import doc_fields
from ocrvl_daemon.output import document_files
from ocrvl_daemon.storage.store import Store

log = logging.getLogger(__name__)

DAEMON_DB = "jobs.sqlite"
# `ocrvl convert` keeps its own record, so it works beside a running daemon.
ONESHOT_DB = "convert.sqlite"


# How a document whose conversion failed for a reason that may pass (the server failing, an
# output folder not writable, the file changing) is tried again: the daemon never gives it
# up; a person waits for `ocrvl convert`, so a few quick tries, then the cause and its exit
# code.
DAEMON_RETRY = Backoff(30.0, 3600.0)
ONESHOT_RETRY = Backoff(2.0, 8.0, attempts=3)


def job_fields(job: Job, page: int | None = None) -> dict[str, object]:
    """Structured journald fields for a log line about `job` (and 0-based `page`)."""
    return doc_fields(job.path, None if page is None else page + 1, job.id)


def open_store(config: Config) -> Store:
    """The daemon's store."""
    return Store(config.state_dir / DAEMON_DB)


def due_jobs(store: Store, limit: int, skip: Container[int], only: set[int] | None) -> list[Job]:
    """Up to `limit` queued jobs whose retry time has come, oldest first, except those in
    `skip` (with `only`: of those jobs alone)."""
    wall = time.time()
    jobs = [
        j
        for j in store.jobs(JobState.QUEUED)
        if j.id not in skip
        and j.not_before <= wall
        and (only is None or j.id in only)
    ]
    return jobs[:limit]


def record_failure(store: Store, job: Job, exc: OcrvlError, again: str,
                   place: document_files.OutputPlace, retry: Backoff = DAEMON_RETRY) -> bool:
    """Record why `job` failed: in the store, the log and a note beside its output; a job
    whose file vanished is dropped. True when it failed for good (its `on_failed` hook is
    due); a transient failure is tried again as `retry` says (`again`: see `enqueue_file`).
    """
    fields = doc_fields(job.path, None, job.id)
    if isinstance(exc, InputVanishedError) and not job.path.exists():
        log.info("%s disappeared; dropping it from the queue", job.path)
        store.forget(job.id)
        return False
    attempts = job.attempts + 1
    if exc.permanent or retry.gives_up(attempts):
        redo = pdf.retry_command(job.path, again=again)
        tries = "" if exc.permanent else f" ({attempts} attempts)"
        log.error("%s failed%s: %s (after fixing it: %s)", job.path, tries, exc, redo,
                  extra=fields)
        document_files.write_error_note(job.path, exc.message, exc.fix, redo=redo, place=place)
        store.set_failed(job.id, str(exc), permanent=True)
        return True
    delay = retry.delay(attempts)
    log.warning(
        "%s: %s (attempt %d; retrying in %.0f s)",
        job.path,
        exc,
        attempts,
        delay,
        extra=fields,
    )
    document_files.write_error_note(job.path, exc.message, exc.fix,
                            redo=pdf.retry_command(job.path, again=again),
                            retry_in=delay, place=place)
    store.set_failed(job.id, str(exc), permanent=False, retry_in=delay)
    return False


def _record_unreadable(store: Store, path: Path, key: str, exc: InputFileError,
                       again: str, place: document_files.OutputPlace) -> None:
    """Give a file that cannot even be hashed a failed job, so status and a note explain it."""
    try:
        st = path.stat()
    except OSError:
        return
    job = store.enqueue(path, "", st.st_size, st.st_mtime, key)
    if job.state is not JobState.FAILED:
        store.set_failed(job.id, str(exc), permanent=True)
        document_files.write_error_note(path, exc.message, exc.fix,
                                redo=pdf.retry_command(path, again=again), place=place)


def enqueue_file(store: Store, path: Path, recipe: Recipe, again: str = "ocrvl retry",
                 place: document_files.OutputPlace = document_files.NEXT_TO_PDF) -> Job:
    """Identify `path` and queue it, unless this content is already handled (`again`: the
    command that redoes a document, for the advice in notes: see `pdf.retry_command`).

    A Markdown file that ocrvl wrote from this very content with this model counts as done,
    even when the store has never seen the file (a new state dir, a moved inbox), and when it
    was made another way (layout detection since switched): a finished book is not redone.
    """
    known = store.job_for_path(path)
    try:
        stat = path.stat()
    except OSError:
        stat = None
    # The start-up scan hands over every PDF again: a version already identified (same size,
    # mtime and recipe) is not hashed again, which would read whole libraries at each start.
    if (known is not None and known.sha256 and known.model == recipe.key and stat is not None
            and (known.size, known.mtime) == (stat.st_size, stat.st_mtime)):
        return known
    try:
        ident = pdf.file_identity(path)
    except InputFileError as exc:
        _record_unreadable(store, path, recipe.key, exc, again, place)
        raise
    job = store.enqueue(path, ident.sha256, ident.size, ident.mtime, recipe.key)
    if (job.state is not JobState.DONE
            and document_files.is_current(path, ident.sha256, recipe.model, place)):
        log.debug("%s: Markdown is already up to date", path,  # the caller sums them up
                  extra=doc_fields(path, None, job.id))
        store.set_done(job.id)
        document_files.remove_error_note(path, place)
        job = store.job(job.id) or job
    return job

"""Where jobs are kept and how a file becomes one: the daemon's and `ocrvl convert`'s stores,
and `enqueue_file`, which identifies a PDF and queues it."""

from __future__ import annotations

import logging
from pathlib import Path

from ocrvl_daemon import output, pdf
from ocrvl_daemon.config import Config
from ocrvl_daemon.errors import InputFileError
from ocrvl_daemon.store import Job, JobState, Store

log = logging.getLogger(__name__)

DAEMON_DB = "jobs.sqlite"
# `ocrvl convert` keeps its own record, so it works beside a running daemon.
ONESHOT_DB = "convert.sqlite"


def open_store(config: Config) -> Store:
    """The daemon's store."""
    return Store(config.state_dir / DAEMON_DB)


def _record_unreadable(store: Store, path: Path, model: str, exc: InputFileError,
                       again: str, place: output.OutputPlace) -> None:
    """Give a file that cannot even be hashed a failed job, so status and a note explain it."""
    try:
        st = path.stat()
    except OSError:
        return
    job = store.enqueue(path, "", st.st_size, st.st_mtime, model)
    if job.state is not JobState.FAILED:
        store.set_failed(job.id, str(exc), permanent=True)
        output.write_error_note(path, exc.message, exc.fix,
                                redo=pdf.retry_command(path, again=again), place=place)


def enqueue_file(store: Store, path: Path, model: str, again: str = "ocrvl retry",
                 place: output.OutputPlace = output.NEXT_TO_PDF) -> Job:
    """Identify `path` and queue it, unless this content is already handled (`again`: the
    command that redoes a document, for the advice in notes: see `pdf.retry_command`).

    A Markdown file that ocrvl wrote from this very content with this model counts as done,
    even when the store has never seen the file (a new state dir, a moved inbox).
    """
    known = store.job_for_path(path)
    try:
        stat = path.stat()
    except OSError:
        stat = None
    # The start-up scan hands over every PDF again: a version already identified (same size,
    # mtime and model) is not hashed again, which would read whole libraries at each start.
    if (known is not None and known.sha256 and known.model == model and stat is not None
            and (known.size, known.mtime) == (stat.st_size, stat.st_mtime)):
        return known
    try:
        ident = pdf.file_identity(path)
    except InputFileError as exc:
        _record_unreadable(store, path, model, exc, again, place)
        raise
    job = store.enqueue(path, ident.sha256, ident.size, ident.mtime, model)
    if job.state is not JobState.DONE and output.is_current(path, ident.sha256, model, place):
        log.debug("%s: Markdown is already up to date", path.name)  # the caller sums them up
        store.set_done(job.id)
        output.remove_error_note(path, place)
        job = store.job(job.id) or job
    return job

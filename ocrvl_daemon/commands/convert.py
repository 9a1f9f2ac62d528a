"""`ocrvl convert`: the daemon's conversion path, run once over the given files.

It uses its own store (`state_dir/convert.sqlite`), so an interrupted run resumes where it
stopped when started again, and it never competes with a running daemon for jobs: the
daemon's queue, `ocrvl status` and `ocrvl retry` do not see its files, so the advice it
leaves in notes is to run `ocrvl convert` again (`--pages` for single pages). It writes
where the daemon would (`output.dir`) and runs the same hooks, waiting for them before it
exits: a configuration behaves the same in both, and one file is how a hook is tried out.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from ocrvl_daemon.cluster import engine_side
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.backoff import Backoff
from ocrvl_daemon.core.job import JobState
from ocrvl_daemon.engine.converter import Converter
from ocrvl_daemon.errors import InputFileError, OcrvlError, ServerError
from ocrvl_daemon.files import pdf
from ocrvl_daemon.files.names import is_pdf_name
from ocrvl_daemon.observe.logs import doc_fields
from ocrvl_daemon.observe.progress import (
    ProgressBars,
    ProgressLog,
    ProgressView,
    RunTally,
    shows_bars,
)
from ocrvl_daemon.output import document_files
from ocrvl_daemon.process.shutdown import StopSignals
from ocrvl_daemon.server.launchers import vllm_serve_command
from ocrvl_daemon.storage.jobs import ONESHOT_DB, ONESHOT_RETRY, enqueue_file
from ocrvl_daemon.storage.store import Store

log = logging.getLogger(__name__)

# An external server that does not answer within this time is reported, not waited for.
EXTERNAL_PROBE_SECONDS = 10.0
TICK_SECONDS = 0.05
# Transient failures (server gone, disk full) are retried this often before giving up.
MAX_ATTEMPTS = 3
# Launches of a managed server that fail in a row before this run gives up on it.
SERVER_ATTEMPTS = 3
# A recognition pipeline that failed to start this often in a row will not start in this
# run; the daemon keeps trying (the network may come back, the install be repaired).
ENGINE_START_ATTEMPTS = 2
STOP_TIMEOUT = 30.0
# After Ctrl-C, pages in flight get only this long: the person asked to stop, and pages
# not checkpointed are simply redone by the next run.
INTERRUPT_DRAIN_SECONDS = 2.0


def convert_files(
    config: Config, pdfs: list[Path], *, pages: str | None = None, again: str = "ocrvl convert"
) -> dict[Path, OcrvlError]:
    """Convert each PDF (with `pages`, redo those pages of each); one line per failure.

    Returns why each file that did not convert failed. `again` is the command line that
    runs this conversion again, for the advice left in notes. A malformed page list, or one
    beyond a document's last page, is a UsageError before anything is converted.
    """
    # A file named twice is converted once, and counted once.
    paths = list(dict.fromkeys(given.expanduser().absolute() for given in pdfs))
    redo: dict[Path, list[int]] = {}
    if pages:  # every page list is checked before anything is queued
        pdf.parse_pages(pages)
        for path in paths:
            try:
                count = pdf.page_count(path)
            except OcrvlError:
                continue  # reported below, as a bad file
            redo[path] = pdf.parse_pages(pages, count, path)
    store = Store(config.state_dir / ONESHOT_DB)
    failures: dict[Path, OcrvlError] = {}
    jobs: dict[int, Path] = {}
    place = document_files.output_place(config)
    claimed: dict[Path, Path] = {}  # output -> the PDF it is for
    try:
        for path in paths:
            md = document_files.outputs_for(path, place)[0]
            if claimed.setdefault(md, path) != path:
                failures[path] = InputFileError(
                    f"{path} would be written to {md}, like {claimed[md]} (output.dir keeps "
                    "only the names of PDFs from outside the inboxes).",
                    "rename one of them, or convert them without output.dir",
                )
                continue
            try:
                _check_input(path)
                job = enqueue_file(store, path, config.recipe, again, place)
            except OcrvlError as exc:
                failures[path] = exc
                continue
            current = document_files.is_current(path, job.sha256, config.model.name, place)
            if path not in redo and job.state is JobState.DONE and current:
                log.info("%s is already converted: %s", path.name,
                         document_files.outputs_for(path, place)[0], extra=doc_fields(path))
                continue
            jobs[job.id] = path
            if path in redo:
                store.drop_pages(job.sha256, job.model, redo[path])
            if job.state is not JobState.QUEUED:
                store.requeue(job.id)
        if jobs:
            failures.update(_run(config, store, jobs, again))
    finally:
        store.close()
    for path, reason in failures.items():
        log.error("%s: %s", path, reason)
    log.info("%d of %d converted", len(paths) - len(failures), len(paths))
    return failures


def _check_input(path: Path) -> None:
    if not path.exists():
        raise InputFileError(f"{path} does not exist.", "check the path")
    if not path.is_file():
        raise InputFileError(f"{path} is not a file.", "pass a PDF file")
    # A file not named .pdf may still be one (a scanner's `scan_001`); one that is not a PDF
    # either is no document of the user's to leave a note beside: it is refused here.
    if not is_pdf_name(path.name):
        pdf.check_header(path)


def _run(
    config: Config, store: Store, jobs: dict[int, Path], again: str
) -> dict[Path, OcrvlError]:
    # Replicas that cannot fit are refused before anything starts; a managed server that
    # keeps failing (its port taken...) is given up on, as this command must end.
    servers, engines = engine_side(config, ENGINE_START_ATTEMPTS, backoff=Backoff(
        config.server.restart_backoff_initial, config.server.restart_backoff_max,
        attempts=SERVER_ATTEMPTS))
    signals = StopSignals()
    stop_requested = signals.stops
    view = _progress_view(config, store, jobs)
    signals.install()
    converter = Converter(config, store, servers.endpoints, set(jobs), again, engines,
                          ONESHOT_RETRY)
    try:
        servers.start()
        if config.server.mode == "external" and not servers.wait_ready(EXTERNAL_PROBE_SECONDS):
            # A server that answers but cannot serve this configuration has its own fix.
            server_port = urlparse(config.server.base_url).port or 80
            reason = servers.error if servers.error is not None else (
                ServerError(
                    f"Cannot reach the model server at {config.server.base_url} "
                    f"({servers.overall().last_error or 'no answer'}).",
                    f"start it (e.g. `{vllm_serve_command(config, port=server_port)}`), or "
                    "run without --server-url so ocrvl starts one itself",
                )
            )
            return dict.fromkeys(jobs.values(), reason)
        while not stop_requested:
            now = time.monotonic()
            converter.tick(now)
            view.update(now, converter.running())
            if servers.error is not None:
                return _unfinished(store, jobs, servers.error)
            if converter.engines.gave_up:
                return _unfinished(store, jobs, converter.engines.start_error
                                   or OcrvlError("The recognition pipeline could not start."))
            # A job being converted is not settled: ask the store only when none is.
            if not converter.documents.active and all(_settled(store, j) for j in jobs):
                break
            converter.wait(TICK_SECONDS)
    finally:
        view.close()
        if stop_requested:
            log.warning("stopping (%s): pages done so far are kept; the same command resumes",
                        signal.Signals(stop_requested[0]).name)
        interrupted = bool(stop_requested)

        def stop() -> None:
            converter.stop(INTERRUPT_DRAIN_SECONDS if interrupted else STOP_TIMEOUT,
                           wait_for_hooks=not interrupted)
            servers.stop()

        def kill() -> None:  # a second Ctrl-C: now
            converter.kill()
            servers.kill()

        signals.stop(stop, kill)
        signals.restore()
    if stop_requested:
        raise KeyboardInterrupt
    documents = converter.documents
    return {
        path: documents.failures.get(job_id) or OcrvlError(_reason(store, job_id, documents.place))
        for job_id, path in jobs.items()
        if not _succeeded(store, job_id)
    }


def _progress_view(config: Config, store: Store, jobs: dict[int, Path]) -> ProgressView:
    """Bars for a person at a terminal, else a line per document now and then."""
    totals, done = {}, {}
    for job_id, path in jobs.items():
        # A file that does not open has its failure reported when it is converted.
        with contextlib.suppress(OcrvlError, OSError):
            totals[job_id] = pdf.page_count(path)
        job = store.job(job_id)
        if job is not None:
            done[job_id] = store.count_pages(job.sha256, job.model)
    tally = RunTally(totals, done, lambda job_id: _succeeded(store, job_id))
    if shows_bars(sys.stderr):
        return ProgressBars(sys.stderr, tally)
    return ProgressLog(config.progress_seconds, tally)


def _unfinished(store: Store, jobs: dict[int, Path], reason: OcrvlError) -> dict[Path, OcrvlError]:
    """`reason` for every file not converted yet."""
    return {path: reason for job_id, path in jobs.items() if not _succeeded(store, job_id)}


def _succeeded(store: Store, job_id: int) -> bool:
    job = store.job(job_id)
    return job is not None and job.state is JobState.DONE


def _settled(store: Store, job_id: int) -> bool:
    job = store.job(job_id)
    if job is None or job.state in (JobState.DONE, JobState.FAILED, JobState.GONE):
        return True
    return job.state is JobState.QUEUED and job.attempts >= MAX_ATTEMPTS


def _reason(store: Store, job_id: int, place: document_files.OutputPlace) -> str:
    job = store.job(job_id)
    if job is None:
        return "the file disappeared while it was being converted"
    if job.state is JobState.DONE and not document_files.outputs_for(job.path, place)[0].exists():
        return "converted, but the Markdown file is missing"
    return job.last_error or "not converted"

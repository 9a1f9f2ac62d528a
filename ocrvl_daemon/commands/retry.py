"""`ocrvl retry`: queue failed or flagged documents and pages again, for the daemon."""

from __future__ import annotations

import logging
from pathlib import Path

from ocrvl_daemon.commands.install_service import start_command
from ocrvl_daemon.commands.status import daemon_alive
from ocrvl_daemon.config.file import advice_command
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.job import Job, JobState
from ocrvl_daemon.errors import ExitCode, InputFileError, UsageError
from ocrvl_daemon.files.names import shell_quote, shown
from ocrvl_daemon.files.pdf import page_count, parse_pages
from ocrvl_daemon.observe.daemon_state import read_runtime_file
from ocrvl_daemon.storage.jobs import open_store
from ocrvl_daemon.storage.store import Store

log = logging.getLogger(__name__)


def _known_job(store: Store, given: Path) -> Job | None:
    """The daemon's job for `given`, a path as the user has it or as `status` shows it
    (bytes that are not UTF-8 escaped as \\xff)."""
    path = given.expanduser().absolute()
    job = store.job_for_path(path)
    if job is None:
        job = next((j for j in store.jobs() if shown(j.path) == str(path)), None)
    return job


def retry(config: Config, pdfs: list[Path], *, failed: bool, pages: str | None,
          flagged: bool = False, config_path: Path | None = None) -> ExitCode:
    """Queue documents again; with `pages`, drop only those checkpoints; with `flagged`,
    only the flagged pages (of `pdfs`, or of every document). `config_path`: the file
    `config` came from, for the command it suggests."""
    if not pdfs and not failed and not flagged:
        raise UsageError("Nothing to retry.", "name PDFs, or use --failed or --flagged")
    if pages:
        parse_pages(pages)  # a malformed list is refused before the store is even opened
    store = open_store(config)
    try:
        targets: list[Job] = []
        if failed:
            targets += store.jobs(JobState.FAILED)
            targets += [
                j
                for j in store.jobs()
                if store.failed_pages(j.sha256, j.model) and j not in targets
            ]
        if flagged and not pdfs:
            targets += [j for j in store.jobs(JobState.DONE)
                        if store.flagged_pages(j.sha256, j.model) and j not in targets]
        for given in pdfs:
            job = _known_job(store, given)
            if job is None:
                raise InputFileError(
                    f"{given} is not known to the daemon.",
                    "put it in an inbox folder; it is picked up by itself (a file converted "
                    f"with `ocrvl convert` is redone with "
                    f"`{advice_command('convert', config_path)} {shell_quote(given)}`)",
                )
            targets.append(job)
        if not targets:
            log.info("nothing to retry: no document or page failed or is flagged (pages "
                     "damaged in the PDF are left out: only a repaired file can help them)")
        # Every page list is checked before anything is queued again.
        chosen: dict[int, list[int]] = {}
        for job in targets:
            if pages:
                count = job.page_count or page_count(job.path)
                chosen[job.id] = parse_pages(pages, count, job.path)
            elif flagged:
                chosen[job.id] = store.flagged_pages(job.sha256, job.model)
            else:
                chosen[job.id] = store.failed_pages(job.sha256, job.model)
        for job in targets:
            redo = chosen[job.id]
            if flagged and not pages and not redo:
                log.info("%s has no flagged pages", job.path)
                continue
            if redo:
                store.drop_pages(job.sha256, job.model, redo)
            elif job.state is JobState.DONE:
                store.drop_pages(job.sha256, job.model)
            store.requeue(job.id)
            what = f"pages {','.join(str(p + 1) for p in redo)} of " if redo else ""
            log.info("queued %s%s again", what, shown(job.path))
    finally:
        store.close()
    if targets and not daemon_alive(read_runtime_file(config.state_dir)):
        log.info("the daemon is not running: they are converted once it starts (start it "
                 "with %s)", start_command(config_path))
    return ExitCode.OK

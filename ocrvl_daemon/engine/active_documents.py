"""The documents being converted: which queued jobs become active, when, and how one starts
(its file checked, its pages still to do); and how one leaves before it is written: failed
(recorded for the user, and tried again as the retry policy says), dropped, or its file
replaced or deleted while it converts."""

from __future__ import annotations

import logging

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.backoff import Backoff
from ocrvl_daemon.core.document import MAX_ACTIVE_DOCUMENTS, Document
from ocrvl_daemon.core.job import Job, JobState
from ocrvl_daemon.engine.hooks import DocumentHooks
from ocrvl_daemon.engine.sources import record_moved
from ocrvl_daemon.errors import InputVanishedError, OcrvlError, StateFullError
from ocrvl_daemon.files import pdf
from ocrvl_daemon.observe.units import counted
from ocrvl_daemon.output import document_files
from ocrvl_daemon.storage import jobs
from ocrvl_daemon.storage.jobs import job_fields
from ocrvl_daemon.storage.store import Store

log = logging.getLogger(__name__)

ACTIVATIONS_PER_TICK = 16
# Queued jobs are looked up this often (and at once after `wake()`): other processes
# (`ocrvl retry`) and backoff timers add work without telling us.
ACTIVATION_INTERVAL = 1.0
# Each active document's file is looked at this often (and before each of its pages counts):
# one replaced or deleted while it converts must not cost the rest of its pages.
SOURCE_CHECK_INTERVAL = 1.0


class ActiveDocuments:
    """The active documents of `store`'s queued jobs (`only` some of them, if set), by job
    id in `active`.

    `again` is the command that redoes a document, for the advice in notes
    (`pdf.retry_command`). `retry` says how a document that failed for a reason that may pass
    is tried again, and when it is given up on; `failures` holds why each job failed last
    (its class decides `ocrvl convert`'s exit code). `hooks` run the user's `on_failed`.
    """

    def __init__(self, config: Config, store: Store, hooks: DocumentHooks,
                 only: set[int] | None, again: str, retry: Backoff) -> None:
        self.config = config
        self.store = store
        self.hooks = hooks
        self.only = only
        self.again = again
        self.retry = retry
        self.place = document_files.output_place(config)
        self.active: dict[int, Document] = {}
        self.failures: dict[int, OcrvlError] = {}
        self._wake = True
        self._next_activation = 0.0
        self._next_source_check = 0.0

    def documents(self) -> list[Document]:
        """The active documents, oldest first."""
        return [self.active[j] for j in sorted(self.active)]

    def wake(self) -> None:
        """A job was queued: look at the queue on the next `keep`, not the next interval."""
        self._wake = True

    def keep(self, now: float) -> None:
        """At `now` (the owner's monotonic clock): drop the documents whose file moved, and
        activate queued jobs, each when due."""
        if now >= self._next_source_check:
            self._next_source_check = now + SOURCE_CHECK_INTERVAL
            for doc in self.documents():
                self.source_moved(doc)
        if self._wake or now >= self._next_activation:
            self._wake = False
            self._next_activation = now + ACTIVATION_INTERVAL
            self._activate(now)

    def _activate(self, now: float) -> None:
        room = min(ACTIVATIONS_PER_TICK, MAX_ACTIVE_DOCUMENTS - len(self.active))
        if room <= 0:
            return
        for job in jobs.due_jobs(self.store, room, self.active, self.only):
            try:
                self._start(job, now)
            except StateFullError:
                raise  # not the document's fault: it stays queued
            except OcrvlError as exc:
                self.fail(job, exc)
            except OSError as exc:
                self.fail(job, pdf.input_error(job.path, exc))
            except Exception as exc:
                # One bad document must never stop the daemon: whatever a strange file
                # provokes becomes that document's (retried) failure.
                log.exception("%s: unexpected error while opening it", job.path)
                self.fail(job, unexpected(exc))

    def _start(self, job: Job, now: float) -> None:
        """Mark queued `job` running, as an active document with the job (identified again
        if its file changed) and its pages still to do; not when its file is gone (it is
        dropped) or this version is not queued. An unusable file or output place raises, as
        OcrvlError or OSError."""
        path, key, formats = job.path, self.config.recipe.key, self.config.output.formats
        try:
            stat = path.stat()
        except OSError:
            log.info("%s is gone; dropping it from the queue", path)
            self.store.forget(job.id)
            return
        source = pdf.FileStamp.from_stat(stat)
        # No hash yet (unreadable when found, or changed while it converted), another version
        # or another recipe (a reload changed it): identify it again.
        if (not job.sha256 or (stat.st_size, stat.st_mtime) != (job.size, job.mtime)
                or job.model != key):
            ident = pdf.file_identity(path)
            job = self.store.enqueue(path, ident.sha256, ident.size, ident.mtime, key)
            if job.state is not JobState.QUEUED:
                return
        document_files.check_writable(path, json_output="json" in formats,
                                      searchable="pdf" in formats, place=self.place)
        count = pdf.page_count(path)
        done = self.store.done_pages(job.sha256, key)
        self.store.set_running(job.id, count)
        pending = [p for p in range(count) if p not in done]
        if done:
            log.info("%s: %s, resuming with %d already done", path.name,
                     counted(count, "page"), len(done), extra=job_fields(job))
        else:
            log.info("%s: %s queued", path.name, counted(count, "page"), extra=job_fields(job))
        if pdf.FileStamp.of(path) != source:  # replaced while it was hashed or counted
            raise InputVanishedError(f"{path} changed while it was being opened.")
        self.active[job.id] = Document(job, count, pending, source=source, started=now)

    def fail(self, job: Job, exc: OcrvlError) -> None:
        """`job` failed with `exc`: recorded for the user, then dropped."""
        # The store first: when the state disk is full (StateFullError) the job stays as it
        # is, to fail again, properly recorded, once there is space.
        self.failures[job.id] = exc
        if jobs.record_failure(self.store, job, exc, self.again, self.place, self.retry):
            self.hooks.run(self.config.hooks, "on_failed", job, error=str(exc))
        self.drop(job.id)

    def drop(self, job_id: int) -> None:
        """Forget an active job's pages, answers in flight included."""
        self.active.pop(job_id, None)

    def source_moved(self, doc: Document, changed: bool = False) -> bool:
        """Whether `doc`'s file is no longer the version it started from (`changed`: its
        content is known to differ); if so the document is dropped: converted again from its
        new content, or, deleted, given up on."""
        stamp = pdf.FileStamp.of(doc.job.path)
        if stamp == doc.source and not changed:
            return False
        self.drop(doc.job_id)
        gone = record_moved(self.store, doc, stamp is None, self.config.inbox.stable_seconds)
        if gone is not None:
            self.failures[doc.job_id] = gone
        return True

    def reconfigure(self, config: Config) -> None:
        """Apply a reloaded configuration. Another model starts the documents being converted
        over with it: a document's pages and its Markdown header must all come from one
        model."""
        recipe, self.config = self.config.recipe, config
        self.place = document_files.output_place(config)
        if config.recipe == recipe:
            return
        for job_id in list(self.active):
            job = self.active[job_id].job
            log.info("%s: pages are now recognised with %s; converting it again that way",
                     job.path.name, config.recipe.key, extra=job_fields(job))
            self.drop(job_id)
            self.store.requeue(job_id)
        self.wake()


def unexpected(exc: Exception) -> OcrvlError:
    """An error nothing foresaw, as a document's (retried) failure."""
    return OcrvlError(
        f"Unexpected error: {type(exc).__name__}: {exc}.",
        "ocrvl retries by itself; if it keeps failing, report it with the log",
    )

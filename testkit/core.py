"""Active documents for tests of the conversion core (`document`, `decide`, `plan`), made
without a store, a PDF or a process."""

from __future__ import annotations

from pathlib import Path

from ocrvl_daemon.config.models import DEFAULT_MODEL
from ocrvl_daemon.core.actions import Checkpoint, Sent
from ocrvl_daemon.core.document import Document
from ocrvl_daemon.core.job import Job, JobState
from ocrvl_daemon.core.messages import PageResult
from ocrvl_daemon.core.quality import assess

URL = "http://127.0.0.1:8118/v1"


def job(job_id: int, pages: int, path: Path | None = None) -> Job:
    """A running job of `pages` pages (its file need not exist)."""
    return Job(job_id, path or Path(f"/inbox/doc{job_id}.pdf"), f"sha{job_id}", 1000, 0.0,
               DEFAULT_MODEL, JobState.RUNNING, 0, None, pages, 0.0, 0.0, 0.0, None,
               0.0, 0)


def document(job_id: int, pages: int, path: Path | None = None) -> Document:
    """An active document of `pages` pages, none sent yet."""
    return Document(job(job_id, pages, path), pages, list(range(pages)))


def send_all(doc: Document, url: str = URL) -> None:
    """Every pending page of `doc` goes to `url`."""
    for page in doc.pending:
        doc.apply(Sent(page, url), 0.0)


def checkpointed(doc: Document, page: int) -> Checkpoint:
    """The action that checkpoints a plain, good answer of `page` of `doc`."""
    return Checkpoint(page, PageResult(doc.job_id, page, markdown="text"),
                      assess("text", "stop", 10, False, True), None)

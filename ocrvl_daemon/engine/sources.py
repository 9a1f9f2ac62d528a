"""Whether an active document's file is still the version it started from: one replaced or
deleted while it converts is dropped, converted again from its new content or, deleted,
given up on, and said once in the log and the store."""

from __future__ import annotations

import logging

from ocrvl_daemon.core.document import Document
from ocrvl_daemon.errors import InputVanishedError, OcrvlError
from ocrvl_daemon.files.pdf import file_identity
from ocrvl_daemon.observe.units import counted
from ocrvl_daemon.storage.jobs import job_fields
from ocrvl_daemon.storage.store import Store

log = logging.getLogger(__name__)


def same_content(doc: Document) -> bool:
    """Whether `doc`'s file still holds the bytes its job was identified by (hashed once more
    before its Markdown is written: a stamp cannot see every rewrite)."""
    try:
        return file_identity(doc.job.path).sha256 == doc.job.sha256
    except OcrvlError:
        return False


def record_moved(store: Store, doc: Document, deleted: bool,
                 stable_seconds: float) -> InputVanishedError | None:
    """Record that `doc`, dropped, no longer has the file it started from: `deleted`, its job
    is gone (the error returned says why); else it is queued again, to be converted from its
    new content once it has been still for `stable_seconds`."""
    job = doc.job
    if deleted:
        why = (f"{job.path.name} was deleted while it was being converted; its "
               f"{counted(doc.pages_left, 'page')} not yet converted were dropped and nothing "
               "was written")
        log.warning("%s", why, extra=job_fields(job))
        store.set_gone(job.id, why)
        return InputVanishedError(why + ".", "put the PDF back to convert it (pages done are "
                                             "kept)")
    log.warning("%s changed while it was being converted (%d of %d pages done): converting it "
                "again from its new content", job.path.name, doc.done, doc.page_count,
                extra=job_fields(job))
    store.set_changed(job.id, stable_seconds)
    return None

"""Where each page's outcome is kept: an answer checkpointed in the store, or a placeholder
for a page given up on, each said in the log; and the counts and rate of pages since the
converter started."""

from __future__ import annotations

import logging

from ocrvl_daemon.core.actions import Checkpoint, Placeholder
from ocrvl_daemon.core.job import Job, PageFailure
from ocrvl_daemon.observe.rate import RateMeter
from ocrvl_daemon.storage.jobs import job_fields
from ocrvl_daemon.storage.store import Store

log = logging.getLogger(__name__)


class PageOutcomes:
    """Saves page outcomes of the jobs of `store`, under the recipe they were recognised
    with (`Config.recipe`'s key), and counts them.

    Each save comes before the document takes the action (`Document.apply`): a full disk
    (StateFullError) leaves the document as it was, to try the page again.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.completed = 0  # pages recognised
        self.failed = 0  # pages given up on (placeholders)
        self.flagged = 0  # pages kept with a warning
        self.recent = RateMeter()  # pages recognised

    def checkpoint(self, job: Job, key: str, action: Checkpoint, page_count: int,
                   now: float) -> None:
        """Save the answer kept for a page, with its quality record (and note if flagged)."""
        answer, quality, note = action.answer, action.quality, action.note
        fields = job_fields(job, action.page)
        self.store.save_page(
            job.sha256, key, action.page, answer.markdown, answer.images, note=note,
            quality=quality.to_json(),
            layout={"size": list(answer.size), "blocks": [b.to_json() for b in answer.blocks]},
        )
        if note is not None:
            self.flagged += 1
            log.warning("%s: %s", job.path.name, note,
                        extra={**fields, "OCRVL_VERDICT": quality.verdict.value,
                               "OCRVL_REASON": quality.reason})
        self.completed += 1
        self.recent.tick(now)
        log.debug("%s p.%d/%d done in %.1f s", job.path.name, action.page + 1, page_count,
                  answer.seconds, extra=fields)

    def placeholder(self, job: Job, key: str, action: Placeholder) -> None:
        """Record a page given up on: a visible placeholder, and the book still completes."""
        self.store.save_page(job.sha256, key, action.page, "", {}, note=action.note,
                             failure=PageFailure.RETRYABLE if action.retryable
                             else PageFailure.DAMAGED)
        log.error("%s: %s", job.path.name, action.note, extra=job_fields(job, action.page))
        self.failed += 1


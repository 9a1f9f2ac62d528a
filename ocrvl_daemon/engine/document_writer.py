"""A document whose pages are all in, written out: its Markdown (and images, JSON, searchable
PDF) from the stored pages with its book-level structure, then its job marked done, said in
the log, and the user's `on_done` hook run."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.document import Document
from ocrvl_daemon.core.job import Job
from ocrvl_daemon.engine.hooks import DocumentHooks
from ocrvl_daemon.files import pdf
from ocrvl_daemon.observe.units import counted
from ocrvl_daemon.output import document_files
from ocrvl_daemon.output.book import Book, BookPage, restructure
from ocrvl_daemon.storage.jobs import job_fields
from ocrvl_daemon.storage.store import Store

log = logging.getLogger(__name__)


class DocumentWriter:
    """Writes the finished documents of `store`; `hooks` run the user's `on_done`; `again`
    is the command that redoes a document, for the advice in the log (`pdf.retry_command`).
    """

    def __init__(self, store: Store, hooks: DocumentHooks, again: str) -> None:
        self.store = store
        self.hooks = hooks
        self.again = again

    def write(self, doc: Document, config: Config, place: document_files.OutputPlace) -> None:
        """Write `doc`'s outputs at `place`, each atomically. Raises OcrvlError (the document
        fails) or StateFullError."""
        job, recipe, formats = doc.job, config.recipe, config.output.formats
        document_files.write_document(
            job.path,
            job.sha256,
            recipe.model,
            doc.page_count,
            self._pages(job, recipe.key),
            size_hint=self.store.pages_size(job.sha256, recipe.key),
            json_output="json" in formats,
            searchable="pdf" in formats,
            place=place,
            page_breaks=config.output.page_breaks,
            book=self._book(job, config),
        )

    def done(self, doc: Document, config: Config, place: document_files.OutputPlace,
             now: float) -> None:
        """`doc`, written, is done: its job, the log (with what its redos cost and the pages
        flagged), its error note gone, its `on_done` hook (`now`: the owner's monotonic
        clock, for how long it took)."""
        job, budget = doc.job, doc.budget
        if not self.store.set_done(job.id, redo_tokens=budget.extra, sha256=job.sha256):
            log.warning("%s changed as it was written; converting its new content",
                        job.path.name, extra=job_fields(job))
            return
        document_files.remove_error_note(job.path, place)
        md, images, _ = document_files.outputs_for(job.path, place)
        redone = ""
        if doc.redone_pages:
            redone = (f"; redoing {doc.redone_pages} cut-off, looping or empty page(s) took "
                      f"{budget.extra} extra tokens (cap {budget.cap}; {budget.first_pass} the "
                      "first time)")
        fields = job_fields(job)
        flagged = ",".join(str(p + 1)
                           for p in self.store.flagged_pages(job.sha256, config.recipe.key))
        if flagged:
            redo = pdf.retry_command(job.path, flagged, self.again)
            redone += f"; flagged pages: {flagged} (redo: {redo})"
            fields.update(OCRVL_FLAGGED=flagged, OCRVL_REDO_TOKENS=budget.extra)
        log.info(
            "%s: done, %s -> %s%s",
            job.path.name,
            counted(doc.page_count, "page"),
            md.name if config.output.dir is None else md,
            redone,
            extra=fields,
        )
        short = document_files.shortened_names(job.path, place)
        if short:
            log.info("%s: %s", job.path.name, short, extra=job_fields(job))
        data = document_files.json_for(job.path, place)
        self.hooks.run(config.hooks, "on_done", job, md=str(md), pages=doc.page_count,
                       images=str(images) if images.is_dir() else "",
                       json=str(data) if "json" in config.output.formats else "")
        log.debug("%s took %.1f s since it started", job.path.name, now - doc.started,
                  extra=job_fields(job))

    def _book(self, job: Job, config: Config) -> Book | None:
        """The document's book-level structure, made from its stored pages' text (None when
        `output.restructure` is off)."""
        out = config.output
        if not out.restructure:
            return None
        try:
            return restructure(
                (BookPage(p.page, p.markdown, (p.layout or {}).get("blocks"),
                          flagged=p.failed or p.note is not None or p.verdict not in (None, "ok"))
                 for p in self.store.iter_pages(job.sha256, config.recipe.key, images=False)),
                join_paragraphs=out.page_breaks == "anchor")
        except Exception:  # the pages as recognised are still the book: never lose it for this
            log.exception("%s: book-level structure failed; its pages are written as "
                          "recognised", job.path.name, extra=job_fields(job))
            return None

    def _pages(self, job: Job, key: str) -> Iterator[document_files.Page]:
        for page in self.store.iter_pages(job.sha256, key):
            yield document_files.Page(page.page, page.markdown, page.images, page.note,
                                      page.quality, page.layout)

"""Drives the pages of active documents through the engine pool, checkpoints each answer,
and writes a document out once all its pages are in.

`Converter.tick()` is called from the owner's loop (the daemon's main loop, or `ocrvl
convert`'s). It activates queued jobs (each one a `document.Document`), carries out the plan
of what to send (`plan.plan`) while the server is ready, and applies the action decided for
each result (`decide.decide`): a checkpoint before the page counts, a page sent again, a
placeholder, or the document failed. A document is assembled once all its pages are in. One
bad document never stops the others: its failure is recorded (`jobs.record_failure`) in the
store, the log and a `<stem>.ocrvl-error.txt` beside its output. The user's hooks
(`hooks.DocumentHooks`) run after each document written or failed for good.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence

from ocrvl_daemon import jobs, output, pdf
from ocrvl_daemon.book import Book, BookPage, restructure
from ocrvl_daemon.config import Config
from ocrvl_daemon.decide import (
    Action,
    Checkpoint,
    FailJob,
    Placeholder,
    Rules,
    SendAgain,
    decide,
    is_awaited,
    page_failed,
    release_held,
)
from ocrvl_daemon.dispatch import Dispatcher, EndpointLoad, ServerHandle
from ocrvl_daemon.document import (
    MAX_ACTIVE_DOCUMENTS,
    Document,
    pages_of_worker,
    pages_per_endpoint,
)
from ocrvl_daemon.errors import InputVanishedError, OcrvlError, StateFullError
from ocrvl_daemon.hooks import DocumentHooks
from ocrvl_daemon.jobs import DAEMON_RETRY, RetryPolicy
from ocrvl_daemon.logs import doc_fields
from ocrvl_daemon.page_quality import Redo
from ocrvl_daemon.plan import EndpointRoom, isolation_bound, plan
from ocrvl_daemon.progress import DocumentProgress, Progress
from ocrvl_daemon.rate import RateMeter
from ocrvl_daemon.server.autotune import layout_choice
from ocrvl_daemon.server.gpu import GpuReading
from ocrvl_daemon.stages import BusyMeter, Stage, StageLoad
from ocrvl_daemon.store import Job, JobState, PageFailure, Store
from ocrvl_daemon.units import counted
from ocrvl_daemon.worker.messages import Failure, PageResult, PageTask
from ocrvl_daemon.worker.pool import EnginePool, StoppedWorker

log = logging.getLogger(__name__)

ACTIVATIONS_PER_TICK = 16
# Queued jobs are looked up this often (and at once after `wake()`): other processes
# (`ocrvl retry`) and backoff timers add work without telling us.
ACTIVATION_INTERVAL = 1.0
# Each active document's file is looked at this often (and before each of its pages counts):
# one replaced or deleted while it converts must not cost the rest of its pages.
SOURCE_CHECK_INTERVAL = 1.0


class Converter:
    """Drives queued jobs of `store` through `engines` to `servers` (the endpoints pages are
    spread over, `dispatch.Dispatcher`); `only` limits it to some jobs.

    Each active document is one `document.Document` in `active`. Each tick the plan
    (`plan.plan`) says what to send, and each result becomes one action (`decide.decide`),
    which the converter applies: to the store, the log and the document.

    `engines` defaults to a pool that starts its worker again forever, as the daemon wants.
    `again` is the command that redoes a document of `store`, for the advice in notes (see
    `pdf.retry_command`). `retry` says how a document that failed for a reason that may pass
    is tried again, and when it is given up on; `failures` holds why each job failed last.

    A full disk under the store (StateFullError) pauses it: results that cannot be
    checkpointed go back to be recognised again, and `tick()` raises StateFullError, so the
    owner can say so and call `tick()` again later.
    """

    def __init__(
        self,
        config: Config,
        store: Store,
        servers: Sequence[ServerHandle],
        only: set[int] | None = None,
        again: str = "ocrvl retry",
        engines: EnginePool | None = None,
        retry: RetryPolicy = DAEMON_RETRY,
    ) -> None:
        self.config = config
        self.again = again
        self.retry = retry
        self.engines = EnginePool(config) if engines is None else engines
        self.store = store
        self.dispatcher = Dispatcher(config, servers)
        self.only = only
        self.recipe = config.recipe
        self.place = output.output_place(config)
        self.hooks = DocumentHooks(store)
        self.rules = Rules.from_config(config, again)
        self.active: dict[int, Document] = {}  # by job id
        # Each job's last failure as raised: its class decides `ocrvl convert`'s exit code.
        self.failures: dict[int, OcrvlError] = {}
        self.completed_pages = 0
        # Pages given up on (placeholders) and kept with a warning, since this started.
        self.failed_pages = 0
        self.flagged_pages = 0
        self._recent = RateMeter()  # pages recognised
        # Each stage's work, from the spans the workers time (`stage_load`).
        self._busy = {stage: BusyMeter() for stage in Stage}
        self._layout: tuple[str, str] | None = None  # read when first shown
        # How many pages suspected of the last worker crash may be in flight together.
        self._suspects_together = 1
        self._wake = True
        self._next_activation = 0.0
        self._next_source_check = 0.0
        self._now = time.monotonic()

    # --- the tick -----------------------------------------------------------------------

    def tick(self, now: float | None = None) -> None:
        """One step: collect results, keep a worker, activate jobs, dispatch pages."""
        now = time.monotonic() if now is None else now
        self._now = now  # the owner's clock, for results taken on this tick
        self._collect()  # first: results already in must not wait for a full disk
        self.hooks.record()
        busy = {sent.worker for doc in self.active.values() for sent in doc.sent.values()}
        for stopped in self.engines.maintain(now, busy):
            self._worker_stopped(stopped)
        if (servers := self.engines.servers()) is not None and servers != self.servers:
            self.set_servers(servers)  # a cluster's engine hosts came or went
        if now >= self._next_source_check:
            self._next_source_check = now + SOURCE_CHECK_INTERVAL
            for doc in self._documents():
                self._source_moved(doc)
        if self._wake or now >= self._next_activation:
            self._wake = False
            self._next_activation = now + ACTIVATION_INTERVAL
            self._activate()
        for doc, page in self.dispatcher.reclaim(now, self._documents()):
            doc.give_back(page)
        for doc in self.active.values():
            doc.wake(now)
        self._dispatch(now)
        self.dispatcher.observe(now, self._backlog(), pages_per_endpoint(self.active.values()))

    def set_servers(self, servers: Sequence[ServerHandle]) -> None:
        """Send pages to these endpoints from now on (a reload replaced the servers)."""
        self.dispatcher.set_servers(servers)

    @property
    def servers(self) -> list[ServerHandle]:
        """The endpoints pages go to, in the order given."""
        return [endpoint.handle for endpoint in self.dispatcher.endpoints]

    def endpoint_load(self) -> list[EndpointLoad]:
        """Each endpoint's pages in flight, pages/s and bound."""
        return self.dispatcher.load(pages_per_endpoint(self.active.values()))

    def wake(self) -> None:
        """A job was queued: look at the queue on the next tick, not the next interval."""
        self._wake = True

    def wait(self, timeout: float) -> None:
        """Block until the engine has results, or `timeout` passes (the loop's pause)."""
        self.engines.wait(timeout)

    @property
    def in_flight(self) -> int:
        """Pages at the engine right now."""
        return sum(len(d.sent) for d in self.active.values())

    def _backlog(self) -> int:
        return sum(len(d.pending) for d in self.active.values())

    def _worker_stopped(self, stopped: StoppedWorker) -> None:
        """The pages a stopped worker had go back. After a crash with one page in flight that
        page is to blame and counts a failed attempt (a page that kills the worker every time
        ends as a placeholder, not a loop); with several, none is: they become suspects,
        sent again a few at a time until a crash names the page."""
        lost = pages_of_worker(self._documents(), stopped.number)
        if stopped.crash is not None and len(lost) == 1:
            ((doc, page),) = lost
            self._apply(doc, page_failed(doc, page, stopped.crash, self.rules))
            return
        if stopped.crash is not None and lost:
            self._suspects_together = isolation_bound(len(lost))
            log.warning("%d pages were in flight when the engine worker crashed; sending them "
                        "again, %d at a time, to find the page that crashes it", len(lost),
                        self._suspects_together)
        for doc, page in lost:
            if stopped.crash is not None:
                doc.suspects.add(page)
            doc.give_back(page)

    def _documents(self) -> list[Document]:
        """The active documents, oldest first."""
        return [self.active[j] for j in sorted(self.active)]

    # --- jobs ---------------------------------------------------------------------------

    def _activate(self) -> None:
        room = min(ACTIVATIONS_PER_TICK, MAX_ACTIVE_DOCUMENTS - len(self.active))
        if room <= 0:
            return
        for job in jobs.due_jobs(self.store, room, self.active, self.only):
            try:
                self._start_job(job)
            except StateFullError:
                raise  # not the document's fault: it stays queued
            except OcrvlError as exc:
                self._fail(job, exc)
            except OSError as exc:
                self._fail(job, pdf.input_error(job.path, exc))
            except Exception as exc:
                # One bad document must never stop the daemon: whatever a strange file
                # provokes becomes that document's (retried) failure.
                log.exception("%s: unexpected error while opening it", job.path)
                self._fail(job, _unexpected(exc))

    def _start_job(self, job: Job) -> None:
        formats = self.config.output.formats
        started = jobs.start_job(self.store, job, self.recipe.key, self.place,
                                 json_output="json" in formats, searchable="pdf" in formats)
        if started is not None:
            self.active[started.job_id] = started

    def _fail(self, job: Job, exc: OcrvlError) -> None:
        # The store first: when the state disk is full (StateFullError) the job stays as it
        # is, to fail again, properly recorded, once there is space.
        self.failures[job.id] = exc
        if jobs.record_failure(self.store, job, exc, self.again, self.place, self.retry):
            self.hooks.run(self.config.hooks, "on_failed", job, error=str(exc))
        self._drop(job.id)

    def _drop(self, job_id: int) -> None:
        """Forget an active job's pages, answers in flight included."""
        self.active.pop(job_id, None)

    def _source_moved(self, doc: Document, changed: bool = False) -> bool:
        """Whether `doc`'s file is no longer the version it started from (`changed`: its
        content is known to differ); if so the document is dropped: converted again from its
        new content, or, deleted, given up on."""
        now = pdf.FileStamp.of(doc.job.path)
        if now == doc.source and not changed:
            return False
        job = doc.job
        self._drop(job.id)
        left = doc.pages_left
        if now is None:
            why = (f"{job.path.name} was deleted while it was being converted; its "
                   f"{counted(left, 'page')} not yet converted were dropped and nothing was "
                   "written")
            log.warning("%s", why, extra=_fields(job))
            self.failures[job.id] = InputVanishedError(why + ".", "put the PDF back to "
                                                       "convert it (pages done are kept)")
            self.store.set_gone(job.id, why)
        else:
            log.warning("%s changed while it was being converted (%d of %d pages done): "
                        "converting it again from its new content", job.path.name, doc.done,
                        doc.page_count, extra=_fields(job))
            self.store.set_changed(job.id, self.config.inbox.stable_seconds)
        return True

    # --- pages --------------------------------------------------------------------------

    def _dispatch(self, now: float) -> None:
        """Carry out the plan: set the gates, send the pages."""
        if not self.engines.ready:
            return
        docs = self._documents()
        in_flight = pages_per_endpoint(docs)
        rooms = [EndpointRoom(e.url, e.concurrency.limit, in_flight[e.url])
                 for e in self.dispatcher.usable(now)]
        step = plan(docs, rooms, self.engines.taking_numbers(), self._suspects_together,
                    self.engines.serves())
        for gate in step.gates:
            self.engines.set_limit(gate)
        for send in step.sends:
            doc, page, job = send.document, send.page, send.document.job
            redo = doc.ledger.redos.get(page, Redo(self.config.model.effective_max_new_tokens))
            doc.send(page, send.url, send.worker)
            self.engines.submit(send.worker, PageTask(
                job.id, str(job.path), page, redo.max_new_tokens, job.size, job.mtime,
                send.priority, redo.repetition_penalty, send.url, doc.ledger.keep.get(page, {}),
                doc.ledger.block_redos.get(page, {})))

    def _collect(self) -> None:
        full: StateFullError | None = None
        results = self.engines.collect()
        for sent in self.engines.requests_sent():
            doc = self.active.get(sent.job_id)
            if doc is not None:
                doc.reached_server(sent.page)
        for result in results:
            self._note_work(result)
            full = self._take_result(result) or full
        if full is not None:
            raise full
        for doc in list(self.active.values()):
            for action in release_held(doc, self.rules):
                self._apply(doc, action)
        for job_id in [j for j, d in self.active.items() if d.finished]:
            self._finish(job_id)

    def _note_work(self, result: PageResult) -> None:
        """Add the work a page took in each stage to that stage's meter (also for a page no
        longer awaited: the work was done)."""
        if result.render_span is not None:
            self._busy[Stage.RENDERING].add(*result.render_span)
        for span in result.layout_spans:
            self._busy[Stage.LAYOUT].add(*span)
        for span in result.request_spans:
            self._busy[Stage.SERVER].add(*span)

    def _take_result(self, result: PageResult) -> StateFullError | None:
        """`_on_result`, except that a result the full store cannot take goes back to be
        recognised again (returning why)."""
        try:
            self._on_result(result)
        except StateFullError as exc:
            doc = self.active.get(result.job_id)
            if doc is not None and result.page in doc.sent:
                doc.give_back(result.page)
            return exc
        return None

    def _on_result(self, result: PageResult) -> None:
        doc = self.active.get(result.job_id)
        if doc is None or not is_awaited(result, doc):
            return  # the job failed or was dropped meanwhile, or the page went elsewhere
        if self._source_moved(doc):
            return  # a page counts only while its file is the version it was read from
        server_down = result.error_kind is Failure.SERVER_DOWN
        server_error = result.error_kind is Failure.SERVER_ERROR
        first = self.dispatcher.answered(
            doc.sent[result.page].endpoint, self._now, result.error is None,
            server_down=result.error or "no answer" if server_down else None,
            server_error=result.error or "no reason given" if server_error else None,
            # a failed page's answers are those that came back: how many it sent is not known
            requests=0 if result.error else sum(not a.reused for a in result.answers))
        # A server failing every request fails every page in flight: the first is named, the
        # others are counted and said when it answers again.
        self._apply(doc, decide(result, doc, self.rules), quiet=server_error and not first)

    def _apply(self, doc: Document, action: Action, quiet: bool = False) -> None:
        """Carry out `action` for a page of `doc`: the store first, so that a full disk
        (StateFullError) leaves the document as it was. `quiet`: its reason is logged at
        DEBUG (one of many alike)."""
        job = doc.job
        if isinstance(action, Checkpoint):
            self._checkpoint(doc, action)
        elif isinstance(action, SendAgain):
            if action.why is not None:
                log.log(logging.DEBUG if quiet else logging.WARNING, "%s %s", job.path.name,
                        action.why, extra=_fields(job, action.page))
            if action.ledger is not None:
                doc.ledger = action.ledger
            if action.counted:
                doc.count_attempt(action.page)
            if action.wait > 0:
                doc.rest(action.page, self._now + action.wait)
            else:
                doc.give_back(action.page)
        elif isinstance(action, Placeholder):
            self._placeholder(doc, action)
        elif isinstance(action, FailJob):
            self._fail(job, action.error)

    def _checkpoint(self, doc: Document, action: Checkpoint) -> None:
        """Save the answer kept for a page, with its quality record (and note if flagged)."""
        job, answer, quality, note = doc.job, action.answer, action.quality, action.note
        fields = _fields(job, action.page)
        self.store.save_page(
            job.sha256, self.recipe.key, action.page, answer.markdown, answer.images, note=note,
            quality=quality.to_json(),
            layout={"size": list(answer.size), "blocks": [b.to_json() for b in answer.blocks]},
        )
        if note is not None:
            self.flagged_pages += 1
            log.warning("%s: %s", job.path.name, note,
                        extra={**fields, "OCRVL_VERDICT": quality.verdict.value,
                               "OCRVL_REASON": quality.reason})
        if action.ledger is not None:
            doc.ledger = action.ledger
        doc.answered(action.page)
        self.completed_pages += 1
        self._recent.tick(time.monotonic())
        log.debug("%s p.%d/%d done in %.1f s", job.path.name, action.page + 1, doc.page_count,
                  answer.seconds, extra=fields)

    def _placeholder(self, doc: Document, action: Placeholder) -> None:
        """Record a page given up on: a visible placeholder, and the book still completes."""
        job = doc.job
        self.store.save_page(job.sha256, self.recipe.key, action.page, "", {}, note=action.note,
                             failure=PageFailure.RETRYABLE if action.retryable
                             else PageFailure.DAMAGED)
        log.error("%s: %s", job.path.name, action.note, extra=_fields(job, action.page))
        self.failed_pages += 1
        doc.answered(action.page)

    def _finish(self, job_id: int) -> None:
        doc = self.active[job_id]
        job = doc.job
        if self._source_moved(doc) or not self._same_content(doc):
            return
        try:
            output.write_document(
                job.path,
                job.sha256,
                self.recipe.model,
                doc.page_count,
                self._pages(job),
                size_hint=self.store.pages_size(job.sha256, self.recipe.key),
                json_output="json" in self.config.output.formats,
                searchable="pdf" in self.config.output.formats,
                place=self.place,
                page_breaks=self.config.output.page_breaks,
                book=self._book(job),
            )
        except StateFullError:
            raise
        except OcrvlError as exc:
            self._fail(job, exc)
            return
        except Exception as exc:  # see _activate: never let one document stop the daemon
            log.exception("%s: unexpected error while writing its Markdown", job.path)
            self._fail(job, _unexpected(exc))
            return
        self.active.pop(job_id)
        ledger = doc.ledger
        if not self.store.set_done(job_id, redo_tokens=ledger.extra, sha256=job.sha256):
            log.warning("%s changed as it was written; converting its new content",
                        job.path.name, extra=_fields(job))
            return
        output.remove_error_note(job.path, self.place)
        md, images, _ = output.outputs_for(job.path, self.place)
        redone = ""
        if redone_pages := ledger.redos.keys() | ledger.block_redos.keys():
            redone = (f"; redoing {len(redone_pages)} cut-off, looping or empty page(s) took "
                      f"{ledger.extra} extra tokens (cap {ledger.cap}; {ledger.first_pass} the "
                      "first time)")
        fields = _fields(job)
        flagged = ",".join(str(p + 1)
                           for p in self.store.flagged_pages(job.sha256, self.recipe.key))
        if flagged:
            redo = pdf.retry_command(job.path, flagged, self.again)
            redone += f"; flagged pages: {flagged} (redo: {redo})"
            fields.update(OCRVL_FLAGGED=flagged, OCRVL_REDO_TOKENS=ledger.extra)
        log.info(
            "%s: done, %s -> %s%s",
            job.path.name,
            counted(doc.page_count, "page"),
            md.name if self.config.output.dir is None else md,
            redone,
            extra=fields,
        )
        short = output.shortened_names(job.path, self.place)
        if short:
            log.info("%s: %s", job.path.name, short, extra=_fields(job))
        data = output.json_for(job.path, self.place)
        self.hooks.run(self.config.hooks, "on_done", job, md=str(md), pages=doc.page_count,
                       images=str(images) if images.is_dir() else "",
                       json=str(data) if "json" in self.config.output.formats else "")
        log.debug("%s took %.1f s since it was queued", job.path.name, time.time() - job.created,
                  extra=_fields(job))

    def _same_content(self, doc: Document) -> bool:
        """Whether `doc`'s file still holds the bytes its job was identified by (hashed once
        more before its Markdown is written: a stamp cannot see every rewrite); if not, it is
        dropped and converted again."""
        try:
            same = pdf.file_identity(doc.job.path).sha256 == doc.job.sha256
        except OcrvlError:
            same = False
        if not same:
            self._source_moved(doc, changed=True)
        return same

    def _book(self, job: Job) -> Book | None:
        """The document's book-level structure, made from its stored pages' text (None when
        `output.restructure` is off)."""
        out = self.config.output
        if not out.restructure:
            return None
        try:
            return restructure(
                (BookPage(p.page, p.markdown, (p.layout or {}).get("blocks"),
                          flagged=p.failed or p.note is not None or p.verdict not in (None, "ok"))
                 for p in self.store.iter_pages(job.sha256, self.recipe.key, images=False)),
                join_paragraphs=out.page_breaks == "anchor")
        except Exception:  # the pages as recognised are still the book: never lose it for this
            log.exception("%s: book-level structure failed; its pages are written as "
                          "recognised", job.path.name, extra=_fields(job))
            return None

    def _pages(self, job: Job) -> Iterator[output.Page]:
        for page in self.store.iter_pages(job.sha256, self.recipe.key):
            yield output.Page(page.page, page.markdown, page.images, page.note,
                              page.quality, page.layout)

    def reconfigure(self, config: Config) -> None:
        """Apply a reloaded configuration; the worker is replaced if its settings changed.

        Another model starts the documents being converted over with it: a document's
        pages and its Markdown header must all come from one model.
        """
        self.config = config
        self.rules = Rules.from_config(config, self.again)
        self.engines.reconfigure(config)
        self.place = output.output_place(config)
        self.dispatcher.reconfigure(config)
        self._layout = None
        if config.recipe != self.recipe:
            self.recipe = config.recipe
            for job_id in list(self.active):
                job = self.active[job_id].job
                log.info("%s: pages are now recognised with %s; converting it again that way",
                         job.path.name, self.recipe.key, extra=_fields(job))
                self._drop(job_id)
                self.store.requeue(job_id)
            self.wake()

    # --- status and stop ----------------------------------------------------------------

    def progress(self) -> Progress:
        """Counts and rate for status lines."""
        rate = self._recent.rate(time.monotonic())
        current = None
        done = total = 0
        if self.active:
            doc = max(self.active.values(), key=lambda d: d.page_count)
            current, done, total = doc.job.path.name, doc.done, doc.page_count
        counts = self.store.count_by_state()
        return Progress(
            current,
            done,
            total,
            rate,
            counts[JobState.QUEUED],
            counts[JobState.DONE],
            counts[JobState.FAILED],
            self.in_flight,
        )

    def stage_load(self, now: float, gpus: Sequence[GpuReading] = ()) -> StageLoad:
        """How busy each stage was over the last minute, each against its capacity: rendering
        and layout run one page at a time in each engine worker (PDFium's lock, the layout
        model's lock); the server's capacity is the endpoints' bounds, in requests (the
        request gates hold each to its bound), so its load is how full the bound was. `gpus`:
        the managed servers' GPUs as last read, whose busy share tells a server held by its
        GPU from one held by its CPU side."""
        busy = [g.busy_pct / 100 for g in gpus if g.busy_pct is not None]
        if self._layout is None:
            self._layout = _layout_place(self.config)
        workers = self.engines.size
        bound = sum(e.concurrency.limit for e in self.dispatcher.endpoints)
        return StageLoad(
            rendering=self._busy[Stage.RENDERING].busy(now, workers),
            layout=self._busy[Stage.LAYOUT].busy(now, workers),
            server=self._busy[Stage.SERVER].busy(now, bound),
            layout_device=self._layout[0],
            layout_why=self._layout[1],
            server_gpu_busy=sum(busy) / len(busy) if busy else None,
        )

    def running(self) -> list[DocumentProgress]:
        """Pages done of each document being converted, oldest first."""
        return [
            DocumentProgress(job_id, doc.job.path, doc.done, doc.page_count)
            for job_id, doc in sorted(self.active.items())
        ]

    def stop(self, timeout: float, wait_for_hooks: bool = False) -> None:
        """Let pages in flight finish (and checkpoint) for up to `timeout`, then stop workers;
        hooks running are stopped, or with `wait_for_hooks` all run to their end first."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline and self.engines.alive():
            for result in self.engines.collect(timeout=0.2):
                self._take_result(result)  # one the full disk cannot take is redone
        if self.in_flight:
            log.info("stopping with %s in flight; redone next time",
                     counted(self.in_flight, "page"))
        self.engines.stop()
        self.hooks.stop(None if wait_for_hooks else 0.0)

    def kill(self) -> None:
        """A forced stop: SIGKILL the engine workers and the hooks running, and reap them;
        pages in flight are redone next time."""
        self.engines.kill()
        self.hooks.kill()


def _fields(job: Job, page: int | None = None) -> dict[str, object]:
    """Structured journald fields for a log line about `job` (and 0-based `page`)."""
    return doc_fields(job.path, None if page is None else page + 1, job.id)


def _layout_place(config: Config) -> tuple[str, str]:
    """Where the workers run the layout model ("cpu", "gpu:0") and why there; ("", "") with
    layout detection off, or when it cannot run (the workers report why). A layout model on
    the CPU that the GPU could take is logged once, with the fix: it is the slow stage of
    every page."""
    if not config.pipeline.use_layout_detection:
        return "", ""
    try:
        choice = layout_choice(config)
    except OcrvlError:
        return "", ""
    if choice.to_the_gpu:
        log.warning("the layout model runs on the CPU (%s), the slow stage of every page: %s",
                    choice.why, choice.to_the_gpu)
    return choice.device, choice.why


def _unexpected(exc: Exception) -> OcrvlError:
    return OcrvlError(
        f"Unexpected error: {type(exc).__name__}: {exc}.",
        "ocrvl retries by itself; if it keeps failing, report it with the log",
    )

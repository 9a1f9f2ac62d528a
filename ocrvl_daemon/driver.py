"""Schedules the pages of active documents through the engine pool, checkpoints each answer,
and writes a document out once all its pages are in.

`Converter.tick()` is called from the owner's loop (the daemon's main loop, or `ocrvl
convert`'s). It activates queued jobs, sends pages to the engine workers (`engine_pool`)
while the server is ready, checkpoints every finished page before counting it, and assembles
a document once all its pages are in. One bad document never stops the others: its failure
is recorded (`jobs.record_failure`) in the store, the log and a `<stem>.ocrvl-error.txt`
beside its output. The user's hooks (`hooks.DocumentHooks`) run after each document written
or failed for good.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Iterator, Sequence

from ocrvl_daemon import jobs, output, pdf
from ocrvl_daemon.config import Config
from ocrvl_daemon.dispatch import Dispatcher, EndpointLoad, ServerHandle
from ocrvl_daemon.errors import (
    InputVanishedError,
    OcrvlError,
    PagesFailedError,
    ServerError,
    StateFullError,
)
from ocrvl_daemon.hooks import DocumentHooks
from ocrvl_daemon.jobs import DAEMON_RETRY, RetryPolicy
from ocrvl_daemon.logs import doc_fields
from ocrvl_daemon.page_quality import (
    KeptBecause,
    Later,
    PageQuality,
    Redo,
    RedoLedger,
    assess,
    flag_note,
)
from ocrvl_daemon.progress import DocumentProgress, Progress
from ocrvl_daemon.rate import RateMeter
from ocrvl_daemon.scheduler import (
    MAX_ACTIVE_DOCUMENTS,
    DocumentPages,
    pick_pages,
    pick_yielding,
    yield_room,
    yielding,
)
from ocrvl_daemon.store import Job, JobState, PageFailure, Store
from ocrvl_daemon.worker.messages import Failure, PageResult, PageTask
from ocrvl_daemon.worker.pool import EnginePool
from ocrvl_daemon.worker.request_gate import SHORT_OF_PAGES, YieldCap, slots_to_fill

log = logging.getLogger(__name__)

ACTIVATIONS_PER_TICK = 16
# Queued jobs are looked up this often (and at once after `wake()`): other processes
# (`ocrvl retry`) and backoff timers add work without telling us.
ACTIVATION_INTERVAL = 1.0
# A page the server failed (HTTP 5xx) waits this long before it is sent again, doubling with
# each failure up to SERVER_ERROR_LONGEST_WAIT: a server failing every request is not
# hammered, and one that failed a moment has time to recover.
SERVER_ERROR_FIRST_WAIT = 1.0
SERVER_ERROR_LONGEST_WAIT = 30.0


class Converter:
    """Drives queued jobs of `store` through `engines` to `servers` (the endpoints pages are
    spread over, `dispatch.Dispatcher`); `only` limits it to some jobs.

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
        self.model = config.model.name
        self.place = output.output_place(config)
        self.hooks = DocumentHooks(store)
        self.active: dict[int, DocumentPages] = {}
        self._jobs: dict[int, Job] = {}
        self._ledgers: dict[int, RedoLedger] = {}  # per active job: tokens redos may take
        # Each job's last failure as raised: its class decides `ocrvl convert`'s exit code.
        self.failures: dict[int, OcrvlError] = {}
        self.completed_pages = 0
        # Pages given up on (placeholders) and kept with a warning, since this started.
        self.failed_pages = 0
        self.flagged_pages = 0
        self._recent = RateMeter()  # pages recognised
        self._wake = True
        self._next_activation = 0.0
        self._now = time.monotonic()

    # --- the tick -----------------------------------------------------------------------

    def tick(self, now: float | None = None) -> None:
        """One step: collect results, keep a worker, activate jobs, dispatch pages."""
        now = time.monotonic() if now is None else now
        self._now = now  # the owner's clock, for results taken on this tick
        self._collect()  # first: results already in must not wait for a full disk
        self.hooks.record()
        for lost in self.engines.maintain(now, self.active):
            doc = self.active[lost.job_id]
            self.dispatcher.release((lost.job_id, lost.page))
            if lost.crash is None:
                doc.give_back(lost.page)
            else:
                self._page_failed(doc, lost.page, lost.crash)
        if self._wake or now >= self._next_activation:
            self._wake = False
            self._next_activation = now + ACTIVATION_INTERVAL
            self._activate()
        for job_id, page in self.dispatcher.reclaim(now):
            self.active[job_id].give_back(page)
        for doc in self.active.values():
            doc.wake(now)
        self._dispatch(now)
        self.dispatcher.observe(now, self._backlog())

    def set_servers(self, servers: Sequence[ServerHandle]) -> None:
        """Send pages to these endpoints from now on (a reload replaced the servers)."""
        self.dispatcher.set_servers(servers)

    @property
    def servers(self) -> list[ServerHandle]:
        """The endpoints pages go to, in the order given."""
        return [endpoint.handle for endpoint in self.dispatcher.endpoints]

    def endpoint_load(self) -> list[EndpointLoad]:
        """Each endpoint's pages in flight, pages/s and bound."""
        return self.dispatcher.load()

    def wake(self) -> None:
        """A job was queued: look at the queue on the next tick, not the next interval."""
        self._wake = True

    def wait(self, timeout: float) -> None:
        """Block until the engine has results, or `timeout` passes (the loop's pause)."""
        self.engines.wait(timeout)

    @property
    def in_flight(self) -> int:
        """Pages at the engine right now."""
        return sum(len(d.in_flight) for d in self.active.values())

    def _backlog(self) -> int:
        return sum(len(d.pending) for d in self.active.values())

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
        started = jobs.start_job(self.store, job, self.model, self.place,
                                 json_output="json" in self.config.output.formats)
        if started is not None:
            job, pages = started
            self._jobs[job.id] = job
            self._ledgers[job.id] = RedoLedger()
            self.active[job.id] = pages

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
        self.dispatcher.release_job(job_id)
        self._jobs.pop(job_id, None)
        self._ledgers.pop(job_id, None)

    # --- pages --------------------------------------------------------------------------

    def _dispatch(self, now: float) -> None:
        usable = self.dispatcher.usable(now)
        if not self.engines.ready or not usable:
            return
        docs = [self.active[j] for j in sorted(self.active)]
        big = frozenset(d.job_id for d in docs if not d.small) if yielding(docs) else None
        for endpoint in usable:
            bound = endpoint.concurrency.limit
            self.engines.set_limit(endpoint.url, bound,
                                   YieldCap(yield_room(bound), big) if big else None)
        # Fair across documents over all endpoints: pages are picked first, then each goes
        # to the endpoint with the most room.
        limit = sum(endpoint.concurrency.limit for endpoint in usable)
        slots, short_room = slots_to_fill(limit, self.in_flight, self.engines.at_server)
        chosen = self.engines.isolating_pages(self.active)
        if chosen is None:
            chosen = pick_yielding(docs, slots, limit)
            chosen += pick_pages(docs, short_room - len(chosen), short_of=SHORT_OF_PAGES)
        later = Counter(doc.job_id for doc, _ in chosen)
        for doc, page in chosen:
            later[doc.job_id] -= 1
            job = self._jobs[doc.job_id]
            endpoint = self.dispatcher.assign((doc.job_id, page), usable)
            redo = self._ledgers[doc.job_id].redos.get(
                page, Redo(self.config.model.effective_max_new_tokens))
            ahead = len(doc.in_flight) - 1 - later[doc.job_id]  # its document's pages before it
            self.engines.submit(PageTask(job.id, str(job.path), page, redo.max_new_tokens,
                                         job.size, job.mtime, ahead, redo.repetition_penalty,
                                         endpoint.url))

    def _collect(self) -> None:
        full: StateFullError | None = None
        for result in self.engines.collect():
            full = self._take_result(result) or full
        if full is not None:
            raise full
        for doc in list(self.active.values()):
            self._release_held(doc)
        for job_id in [j for j, d in self.active.items() if d.finished]:
            self._finish(job_id)

    def _take_result(self, result: PageResult) -> StateFullError | None:
        """`_on_result`, except that a result the full store cannot take goes back to be
        recognised again (returning why)."""
        try:
            self._on_result(result)
        except StateFullError as exc:
            doc = self.active.get(result.job_id)
            if doc is not None and result.page in doc.in_flight:
                doc.give_back(result.page)
            return exc
        return None

    def _on_result(self, result: PageResult) -> None:
        doc = self.active.get(result.job_id)
        job = self._jobs.get(result.job_id)
        if doc is None or job is None or result.page not in doc.in_flight:
            return  # the job failed or was dropped meanwhile
        key = (result.job_id, result.page)
        if not self.dispatcher.owns(key, result.url):
            return  # a late answer from a server the page was taken from: it went elsewhere
        self.dispatcher.answered(
            key, self._now, result.error is None,
            result.error or "no answer" if result.error_kind is Failure.SERVER_DOWN else None)
        if result.error is None:
            ledger = self._ledgers[job.id]
            ledger.count(result.page, result.tokens)
            cut_off = result.truncated_at is not None
            quality = assess(result.markdown, "length" if cut_off else result.finish_reason,
                             result.tokens, result.looping, result.has_ink, result.repetition)
            decision: Redo | KeptBecause | Later | None = None
            if result.truncated_at is not None:
                others_out = bool(doc.pending) or len(doc.in_flight) > 1
                decision = ledger.decide(result.page, result.truncated_at, result.token_ceiling,
                                         result.looping, others_out)
            ledger.best(result.page, quality, result)
            self._redo_or_keep(doc, job, result.page, decision, result.looping)
            return
        kept = self._ledgers[job.id].kept(result.page)
        if kept is not None and result.error_kind in (Failure.PAGE, Failure.DAMAGED):
            # A redo that fails costs the page nothing: its earlier answer stays.
            quality, answer = kept
            note = (f"{self._quality_note(job, answer, quality, None)} (sending it again "
                    f"failed: {(result.error or 'unknown error').rstrip('.')})")
            self._checkpoint(doc, job, answer, quality, note)
            return
        if result.error_kind is Failure.SERVER_DOWN:  # the dispatcher says so, once
            doc.give_back(result.page)
            return
        if result.error_kind is Failure.SERVER_ERROR:
            self._server_failed(doc, result)
            return
        if result.error_kind is Failure.INPUT:
            self._fail(job, InputVanishedError(result.error or "the file changed"))
            return
        if result.error_kind is Failure.DAMAGED:  # the same every time: no retries
            self._give_up_page(doc, result.page, result.error or "the page is damaged", None)
            return
        self._page_failed(doc, result.page, result.error or "unknown error")

    def _redo_or_keep(self, doc: DocumentPages, job: Job, page: int,
                      decision: Redo | KeptBecause | Later | None, looping: bool) -> None:
        """Apply the ledger's decision for `page` (whose last answer was cut off and
        `looping`, if `decision` is set; its answers are in the ledger): send it again, hold
        it until the document's other pages are in, or keep its best answer."""
        kept = self._ledgers[job.id].kept(page)
        assert kept is not None, "the ledger keeps every answer of a page until it settles"
        quality, answer = kept
        if isinstance(decision, Redo):
            how = (f"it loops; sending it again with repetition_penalty "
                   f"{decision.repetition_penalty}" if looping else
                   f"redoing it once with {decision.max_new_tokens}")
            log.warning("%s p.%d: answer cut off; %s", job.path.name, page + 1, how,
                        extra=_fields(job, page))
            doc.give_back(page)
        elif isinstance(decision, Later):
            doc.rest(page, math.inf)  # `_release_held` sends it once the others are in
        else:  # a page that stays bad keeps its best answer
            self._checkpoint(doc, job, answer, quality,
                             self._quality_note(job, answer, quality, decision))

    def _release_held(self, doc: DocumentPages) -> None:
        """Pages held for a second loop-breaking retry go, once every other page is in."""
        ledger = self._ledgers[doc.job_id]
        if not ledger.held or doc.pending or doc.in_flight:
            return
        for page in sorted(ledger.held):
            self._redo_or_keep(doc, self._jobs[doc.job_id], page, ledger.release(page), True)

    def _checkpoint(self, doc: DocumentPages, job: Job, result: PageResult,
                    quality: PageQuality, note: str | None) -> None:
        """Save the answer kept for a page, with its quality record (and `note` if flagged)."""
        fields = _fields(job, result.page)
        self._ledgers[job.id].settle(result.page)
        if note is not None:
            self.flagged_pages += 1
            log.warning("%s: %s", job.path.name, note,
                        extra={**fields, "OCRVL_VERDICT": quality.verdict.value,
                               "OCRVL_REASON": quality.reason})
        self.store.save_page(
            job.sha256, self.model, result.page, result.markdown, result.images, note=note,
            quality=quality.to_json(),
            layout={"size": list(result.size), "blocks": [b.to_json() for b in result.blocks]},
        )
        doc.in_flight.discard(result.page)
        doc.resting.pop(result.page, None)
        doc.done += 1
        self.completed_pages += 1
        self._recent.tick(time.monotonic())
        log.debug("%s p.%d/%d done in %.1f s", job.path.name, result.page + 1, doc.page_count,
                  result.seconds, extra=fields)

    def _quality_note(self, job: Job, result: PageResult, quality: PageQuality,
                      why: Redo | KeptBecause | None) -> str | None:
        """The note of a page kept although it is not ok (None when it is ok)."""
        return flag_note(result.page, quality, why, result.truncated_at,
                         pdf.retry_command(job.path, str(result.page + 1), self.again),
                         external_server=self.config.server.mode == "external")

    def _page_failed(self, doc: DocumentPages, page: int, error: str) -> None:
        """Count a failed attempt at `page`: send it again, or give up on it."""
        job = self._jobs[doc.job_id]
        attempts = doc.attempts.get(page, 0) + 1
        doc.attempts[page] = attempts
        if attempts <= self.config.pipeline.page_retries:
            log.warning(
                "%s p.%d failed (attempt %d): %s",
                job.path.name,
                page + 1,
                attempts,
                error,
                extra=_fields(job, page),
            )
            doc.give_back(page)
            return
        note = (
            f"page {page + 1} could not be recognised after {attempts} attempts: "
            f"{error.rstrip('.')}."
        )
        redo = pdf.retry_command(job.path, str(page + 1), self.again)
        self._give_up_page(doc, page, note, redo)

    def _server_failed(self, doc: DocumentPages, result: PageResult) -> None:
        """The server answered `result`'s page with an error (HTTP 5xx): count the attempt
        and send the page again after a wait, or fail the document with the server's words.

        Not a placeholder: the page is not to blame, and the document is tried again later
        (`retry`) with every page it has.
        """
        job, page = self._jobs[doc.job_id], result.page
        attempts = doc.attempts.get(page, 0) + 1
        doc.attempts[page] = attempts
        url = result.url or self.config.server.base_url
        if attempts <= self.config.pipeline.page_retries:
            wait = min(SERVER_ERROR_LONGEST_WAIT, SERVER_ERROR_FIRST_WAIT * 2 ** (attempts - 1))
            log.warning("%s p.%d: the server at %s failed it (attempt %d): %s; sending it again "
                        "in %.0f s", job.path.name, page + 1, url, attempts, result.error, wait,
                        extra=_fields(job, page))
            doc.rest(page, self._now + wait)
            return
        error = (result.error or "no reason given").rstrip(".")
        self._fail(job, ServerError(
            f"The model server at {url} failed page {page + 1} on all {attempts} attempts: "
            f"{error}.",
            "the server's own log tells why it fails requests (vLLM prints the cause above "
            "the error)"))

    def _give_up_page(self, doc: DocumentPages, page: int, note: str, redo: str | None) -> None:
        """Record `page` as failed: a visible placeholder, and the book still completes.

        Unless `pipeline.fail_on_page_error` asks for the whole document to fail. `redo` is
        the command that tries the page again, when trying again can help.
        """
        job = self._jobs[doc.job_id]
        if self.config.pipeline.fail_on_page_error:
            fix = f"check the page, then run: {redo}" if redo else None
            self._fail(job, PagesFailedError(note, fix))
            return
        if redo:
            note = f"{note} Redo it with: {redo}"
        log.error("%s: %s", job.path.name, note, extra=_fields(job, page))
        failure = PageFailure.RETRYABLE if redo else PageFailure.DAMAGED
        self.store.save_page(job.sha256, self.model, page, "", {}, note=note, failure=failure)
        self.failed_pages += 1
        doc.in_flight.discard(page)
        doc.done += 1

    def _finish(self, job_id: int) -> None:
        job = self._jobs[job_id]
        doc = self.active[job_id]
        try:
            output.write_document(
                job.path,
                job.sha256,
                self.model,
                doc.page_count,
                self._pages(job),
                size_hint=self.store.pages_size(job.sha256, self.model),
                json_output="json" in self.config.output.formats,
                place=self.place,
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
        self._jobs.pop(job_id)
        ledger = self._ledgers.pop(job_id)
        self.store.set_done(job_id, redo_tokens=ledger.extra)
        output.remove_error_note(job.path, self.place)
        md, images, _ = output.outputs_for(job.path, self.place)
        redone = ""
        if ledger.redos:
            redone = (f"; redoing {len(ledger.redos)} cut-off or looping page(s) took "
                      f"{ledger.extra} extra tokens (cap {ledger.cap}; {ledger.first_pass} the "
                      "first time)")
        fields = _fields(job)
        flagged = ",".join(str(p + 1) for p in self.store.flagged_pages(job.sha256, self.model))
        if flagged:
            redo = pdf.retry_command(job.path, flagged, self.again)
            redone += f"; flagged pages: {flagged} (redo: {redo})"
            fields.update(OCRVL_FLAGGED=flagged, OCRVL_REDO_TOKENS=ledger.extra)
        log.info(
            "%s: done, %d pages -> %s%s",
            job.path.name,
            doc.page_count,
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
        log.debug("%s took %.1f s since it was queued", job.path.name, time.time() - job.created)

    def _pages(self, job: Job) -> Iterator[output.Page]:
        for page in self.store.iter_pages(job.sha256, self.model):
            yield output.Page(page.page, page.markdown, page.images, page.note,
                              page.quality, page.layout)

    def reconfigure(self, config: Config) -> None:
        """Apply a reloaded configuration; the worker is replaced if its settings changed.

        Another model starts the documents being converted over with it: a document's
        pages and its Markdown header must all come from one model.
        """
        self.config = config
        self.engines.reconfigure(config)
        self.place = output.output_place(config)
        self.dispatcher.reconfigure(config)
        if config.model.name != self.model:
            self.model = config.model.name
            for job_id in list(self.active):
                log.info("%s: the model is now %s; converting it again with it",
                         self._jobs[job_id].path.name, self.model)
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
            current, done, total = self._jobs[doc.job_id].path.name, doc.done, doc.page_count
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

    def running(self) -> list[DocumentProgress]:
        """Pages done of each document being converted, oldest first."""
        return [
            DocumentProgress(job_id, self._jobs[job_id].path, doc.done, doc.page_count)
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
            log.info("stopping with %d pages in flight; they will be redone", self.in_flight)
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


def _unexpected(exc: Exception) -> OcrvlError:
    return OcrvlError(
        f"Unexpected error: {type(exc).__name__}: {exc}.",
        "ocrvl retries by itself; if it keeps failing, report it with the log",
    )

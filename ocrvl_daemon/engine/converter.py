"""Drives the pages of active documents through the engine pool, and each document, once
all its pages are in, to its writer.

`Converter.tick(now)` is called from the owner's loop (the daemon's main loop, or `ocrvl
convert`'s) with the owner's monotonic clock: the converter never reads the clock itself. It
activates queued jobs (each one a `core.document.Document`), carries out the plan of what to
send (`core.plan.plan`) while the server is ready, and applies the action decided for each
result (`core.decide.decide`): the store first (`PageOutcomes`), then the document
(`Document.apply`). A document is written once all its pages are in (`DocumentWriter`). One
bad document never stops the others: its failure is recorded (`jobs.record_failure`) in the
store, the log and a `<stem>.ocrvl-error.txt` beside its output. The user's hooks
(`hooks.DocumentHooks`) run after each document written or failed for good.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.actions import (
    Action,
    Checkpoint,
    FailJob,
    Placeholder,
    ReachedServer,
    SendAgain,
    Sent,
    TakenBack,
    Wake,
)
from ocrvl_daemon.core.backoff import Backoff
from ocrvl_daemon.core.decide import Rules, decide, is_awaited, page_failed, release_held
from ocrvl_daemon.core.document import (
    Document,
    pages_of_worker,
    pages_per_endpoint,
)
from ocrvl_daemon.core.job import JobState
from ocrvl_daemon.core.messages import Failure, PageResult, PageTask
from ocrvl_daemon.core.plan import EndpointRoom, isolation_bound, plan
from ocrvl_daemon.core.quality import Redo
from ocrvl_daemon.engine.active_documents import ActiveDocuments, unexpected
from ocrvl_daemon.engine.document_writer import DocumentWriter
from ocrvl_daemon.engine.endpoints import EndpointLoad, Endpoints, ServerHandle
from ocrvl_daemon.engine.hooks import DocumentHooks
from ocrvl_daemon.engine.page_outcomes import PageOutcomes
from ocrvl_daemon.engine.pool import EnginePool, StoppedWorker
from ocrvl_daemon.engine.sources import same_content
from ocrvl_daemon.errors import OcrvlError, StateFullError
from ocrvl_daemon.observe.progress import DocumentProgress, Progress
from ocrvl_daemon.observe.stages import BusyMeter, Stage, StageLoad
from ocrvl_daemon.observe.units import counted
from ocrvl_daemon.server.gpu import GpuReading
from ocrvl_daemon.storage.jobs import DAEMON_RETRY, job_fields
from ocrvl_daemon.storage.store import Store

log = logging.getLogger(__name__)

class Converter:
    """Drives queued jobs of `store` through `engines` to `servers` (the endpoints pages are
    spread over, `endpoints.Endpoints`); `only` limits it to some jobs.

    Each active document is one `Document` in `documents` (`ActiveDocuments`, which also
    says why each job failed last). Each tick the plan says what to send, and each result
    becomes one action (`decide`), which the converter applies: to the store, the log and the
    document.

    `engines` defaults to a pool that starts its worker again forever, as the daemon wants.
    `again` is the command that redoes a document of `store`, for the advice in notes (see
    `pdf.retry_command`). `retry` says how a document that failed for a reason that may pass
    is tried again, and when it is given up on.

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
        retry: Backoff = DAEMON_RETRY,
    ) -> None:
        self.config = config
        self.engines = EnginePool(config) if engines is None else engines
        self.store = store
        self.endpoints = Endpoints(config, servers)
        self.hooks = DocumentHooks(store)
        self.documents = ActiveDocuments(config, store, self.hooks, only, again, retry)
        self.outcomes = PageOutcomes(store)
        self.writer = DocumentWriter(store, self.hooks, again)
        self.rules = Rules.from_config(config, again)
        # Each stage's work, from the spans the workers time (`stage_load`).
        self._busy = {stage: BusyMeter() for stage in Stage}
        # How many pages suspected of the last worker crash may be in flight together.
        self._suspects_together = 1
        self._now = 0.0  # the owner's clock at the last tick

    # --- the tick -----------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """One step at `now` (the owner's monotonic clock): collect results, keep the
        workers, activate jobs, send pages."""
        self._now = now
        self._collect()  # first: results already in must not wait for a full disk
        self.hooks.record()
        docs = self.documents.documents()
        busy = {sent.worker for doc in docs for sent in doc.sent.values()}
        for stopped in self.engines.maintain(now, busy):
            self._worker_stopped(stopped)
        if (servers := self.engines.servers()) is not None and servers != self.servers:
            self.set_servers(servers)  # a cluster's engine hosts came or went
        self.documents.keep(now)
        docs = self.documents.documents()
        for doc, page in self.endpoints.reclaim(now, docs):
            doc.apply(TakenBack(page), now)
        for doc in docs:
            doc.apply(Wake(), now)
        self._dispatch(now, docs)
        self.endpoints.observe(now, sum(len(d.pending) for d in docs), pages_per_endpoint(docs))

    def set_servers(self, servers: Sequence[ServerHandle]) -> None:
        """Send pages to these endpoints from now on (a reload replaced the servers)."""
        self.endpoints.set_servers(servers)

    @property
    def servers(self) -> list[ServerHandle]:
        """The endpoints pages go to, in the order given."""
        return [endpoint.handle for endpoint in self.endpoints.endpoints]

    def endpoint_load(self) -> list[EndpointLoad]:
        """Each endpoint's pages in flight, pages/s (as of the last tick) and bound."""
        return self.endpoints.load(self._now, pages_per_endpoint(self.documents.documents()))

    def wake(self) -> None:
        """A job was queued: look at the queue on the next tick, not the next interval."""
        self.documents.wake()

    def wait(self, timeout: float) -> None:
        """Block until the engine has results, or `timeout` passes (the loop's pause)."""
        self.engines.wait(timeout)

    @property
    def in_flight(self) -> int:
        """Pages at the engine right now."""
        return sum(len(d.sent) for d in self.documents.documents())

    def _worker_stopped(self, stopped: StoppedWorker) -> None:
        """The pages a stopped worker had go back. After a crash with one page in flight that
        page is to blame and counts a failed attempt (a page that kills the worker every time
        ends as a placeholder, not a loop); with several, none is: they become suspects,
        sent again a few at a time until a crash names the page."""
        lost = pages_of_worker(self.documents.documents(), stopped.number)
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
            doc.apply(TakenBack(page, suspect=stopped.crash is not None), self._now)

    # --- pages --------------------------------------------------------------------------

    def _dispatch(self, now: float, docs: list[Document]) -> None:
        """Carry out the plan for `docs`: set the gates, send the pages."""
        if not self.engines.ready:
            return
        in_flight = pages_per_endpoint(docs)
        rooms = [EndpointRoom(e.url, e.concurrency.limit, in_flight[e.url])
                 for e in self.endpoints.usable(now)]
        step = plan(docs, rooms, self.engines.taking_numbers(), self._suspects_together,
                    self.engines.serves())
        for gate in step.gates:
            self.engines.set_limit(gate)
        for send in step.sends:
            doc, page, job = send.document, send.page, send.document.job
            redo = doc.page(page).redo
            how = redo.whole or Redo(self.config.model.effective_max_new_tokens)
            doc.apply(Sent(page, send.url, send.worker), now)
            self.engines.submit(send.worker, PageTask(
                job.id, str(job.path), page, how.max_new_tokens, job.size, job.mtime,
                send.priority, how.repetition_penalty, send.url, redo.keep, redo.blocks))

    def _collect(self) -> None:
        full: StateFullError | None = None
        results = self.engines.collect()
        active = self.documents.active
        for sent in self.engines.requests_sent():
            doc = active.get(sent.job_id)
            if doc is not None:
                doc.apply(ReachedServer(sent.page), self._now)
        for result in results:
            self._note_work(result)
            full = self._take_result(result) or full
        if full is not None:
            raise full
        for doc in self.documents.documents():
            for action in release_held(doc, self.rules):
                self._apply(doc, action)
        for doc in self.documents.documents():
            if doc.finished:
                self._finish(doc)

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
            doc = self.documents.active.get(result.job_id)
            if doc is not None:
                doc.apply(TakenBack(result.page), self._now)
            return exc
        return None

    def _on_result(self, result: PageResult) -> None:
        doc = self.documents.active.get(result.job_id)
        if doc is None or not is_awaited(result, doc):
            return  # the job failed or was dropped meanwhile, or the page went elsewhere
        if self.documents.source_moved(doc):
            return  # a page counts only while its file is the version it was read from
        server_down = result.error_kind is Failure.SERVER_DOWN
        server_error = result.error_kind is Failure.SERVER_ERROR
        first = self.endpoints.answered(
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
        (StateFullError) leaves the document as it was, then the document. `quiet`: its
        reason is logged at DEBUG (one of many alike)."""
        job = doc.job
        if isinstance(action, Checkpoint):
            self.outcomes.checkpoint(job, self.config.recipe.key, action, doc.page_count,
                                     self._now)
        elif isinstance(action, Placeholder):
            self.outcomes.placeholder(job, self.config.recipe.key, action)
        elif isinstance(action, SendAgain) and action.why is not None:
            log.log(logging.DEBUG if quiet else logging.WARNING, "%s %s", job.path.name,
                    action.why, extra=job_fields(job, action.page))
        elif isinstance(action, FailJob):
            self.documents.fail(job, action.error)
            return
        doc.apply(action, self._now)

    def _finish(self, doc: Document) -> None:
        """Write out `doc`, whose pages are all in, if its file is still the one its pages
        came from."""
        documents, place = self.documents, self.documents.place
        if documents.source_moved(doc):
            return
        if not same_content(doc):
            documents.source_moved(doc, changed=True)
            return
        try:
            self.writer.write(doc, self.config, place)
        except StateFullError:
            raise
        except OcrvlError as exc:
            documents.fail(doc.job, exc)
            return
        except Exception as exc:  # never let one document stop the daemon
            log.exception("%s: unexpected error while writing its Markdown", doc.job.path)
            documents.fail(doc.job, unexpected(exc))
            return
        documents.drop(doc.job_id)
        self.writer.done(doc, self.config, place, self._now)

    def reconfigure(self, config: Config) -> None:
        """Apply a reloaded configuration; the workers are replaced if their settings
        changed, and the documents started over if the model did."""
        self.config = config
        self.rules = Rules.from_config(config, self.documents.again)
        self.engines.reconfigure(config)
        self.endpoints.reconfigure(config)
        self.documents.reconfigure(config)

    # --- status and stop ----------------------------------------------------------------

    def progress(self) -> Progress:
        """Counts and rate (as of the last tick) for status lines."""
        current = None
        done = total = 0
        if active := self.documents.active:
            doc = max(active.values(), key=lambda d: d.page_count)
            current, done, total = doc.job.path.name, doc.done, doc.page_count
        counts = self.store.count_by_state()
        return Progress(
            current,
            done,
            total,
            self.outcomes.recent.rate(self._now),
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
        workers = self.engines.size
        bound = sum(e.concurrency.limit for e in self.endpoints.endpoints)
        return StageLoad(
            rendering=self._busy[Stage.RENDERING].busy(now, workers),
            layout=self._busy[Stage.LAYOUT].busy(now, workers),
            server=self._busy[Stage.SERVER].busy(now, bound),
            layout_device=self.engines.placement.device,
            layout_why=self.engines.placement.why,
            server_gpu_busy=sum(busy) / len(busy) if busy else None,
        )

    def running(self) -> list[DocumentProgress]:
        """Pages done of each document being converted, oldest first."""
        return [DocumentProgress(doc.job_id, doc.job.path, doc.done, doc.page_count)
                for doc in self.documents.documents()]

    def stop(self, timeout: float, wait_for_hooks: bool = False) -> None:
        """Let pages in flight finish (and checkpoint) for up to `timeout`, then stop workers;
        hooks running are stopped, or with `wait_for_hooks` all run to their end first.

        The owner's loop has ended: this waits on the real clock."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline and self.engines.alive():
            self._now = time.monotonic()
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



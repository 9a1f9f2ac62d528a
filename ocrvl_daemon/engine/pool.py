"""The engine workers pages go to: started, restarted with backoff and recycled.

`EnginePool` keeps the placement's workers taking pages (`submit` hands a page to the one
the plan chose, by its `number`; `collect`) and the retiring ones that finish what they have;
the converter asks it at each tick to `maintain` them and learns which workers stopped: the
pages they had (recorded on the pages, `document.SentPage.worker`) go back to their
documents. Each worker is started, restarted and recycled on its own: one crashing costs
only its own pages.

The placement (where the layout model runs, how many workers) is decided once per
configuration, here (`server.placement`), and every worker is set up with it
(`worker_settings`). The request bound of each endpoint is shared by the workers that may send
there (all of them, but on a cluster only its own host's: `serves`): each gets a part of it
in proportion to the pages it has there (`shares`), re-balanced as pages come and go, so the
pages of a busy worker never wait on an idle worker's part. A worker is anything with
`WorkerHandle`'s methods: a local process (`worker_handle`), or one on a cluster's engine
host (`cluster`), which brings its own endpoints (`servers`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.backoff import Backoff
from ocrvl_daemon.core.messages import (
    ErrorRecord,
    GateLimit,
    PageResult,
    PageTask,
    RequestSent,
    WorkerSetup,
    YieldCap,
)
from ocrvl_daemon.engine.worker_handle import EngineWorker
from ocrvl_daemon.engine.worker_settings import worker_setup
from ocrvl_daemon.errors import DependencyError, ModelDownloadError, OcrvlError
from ocrvl_daemon.observe.units import counted
from ocrvl_daemon.server.placement import Placement, decide_placement

if TYPE_CHECKING:
    from ocrvl_daemon.engine.endpoints import ServerHandle

log = logging.getLogger(__name__)

WORKER_RESTART_SECONDS = 10.0
# A worker that cannot even start (no network for the layout model, a broken install) is
# retried ever less often: the cause rarely goes away by itself within seconds.
WORKER_START_BACKOFF = Backoff(WORKER_RESTART_SECONDS, 300.0)


class WorkerHandle(Protocol):
    """What the pool needs of a worker: a local process (`EngineWorker`), or one on a
    cluster's engine host (`cluster.link.RayWorker`)."""

    number: int  # the pool's name for it, on the pages it has
    arrived: threading.Event  # set when a message arrives; the pool shares one
    ready: bool
    failure: str | None
    pages_done: int

    @property
    def pid(self) -> int | None:
        """Its process id (on its own machine)."""
        ...

    def start(self) -> None:
        """Start it; it reports readiness through `collect`."""
        ...

    def alive(self) -> bool:
        """Whether its process still runs."""
        ...

    def rss_mb(self) -> float:
        """Its resident memory, in MiB."""
        ...

    def submit(self, task: PageTask) -> None:
        """Hand it one page."""
        ...

    def set_limit(self, gate: GateLimit) -> None:
        """Its request gate for `gate.url` (a limit of 0 holds its requests back)."""
        ...

    def pending(self) -> bool:
        """Whether results wait to be collected."""
        ...

    def collect(self, timeout: float = 0.0) -> list[PageResult]:
        """Results that arrived; waits up to `timeout` for the first one."""
        ...

    def requests_sent(self) -> list[RequestSent]:
        """The pages whose first request left for the server, since last asked."""
        ...

    def close_input(self) -> None:
        """No more pages: it finishes what it has and exits."""
        ...

    def stop(self) -> None:
        """Stop it (bounded)."""
        ...

    def kill(self) -> None:
        """Stop it now."""
        ...


@dataclass(frozen=True)
class StoppedWorker:
    """A worker that stopped: the pages it had (`document.pages_of_worker`) go back.

    `crash` is why it failed, when it did (a retired worker that finished is not a crash).
    """

    number: int
    crash: str | None = None


class EnginePool:
    """The engine workers of a converter; `maintain` at each tick keeps them taking pages.

    A worker that fails to start is started again, ever less often, until `starts` starts in
    a row have failed (None: forever, as the daemon does). `new_worker` makes a worker from
    its setup (tests give a stand-in); `placement`: as decided for `config` (None: decided
    here).
    """

    def __init__(
        self,
        config: Config,
        starts: int | None = None,
        new_worker: Callable[[WorkerSetup], WorkerHandle] = EngineWorker,
        placement: Placement | None = None,
    ) -> None:
        self.config = config
        self.placement = decide_placement(config) if placement is None else placement
        self._setup = worker_setup(config, self.placement)
        self.starts = starts
        self._new_worker = new_worker
        # The workers taking pages, one place each (None: to be started at its _retry_at).
        self._slots: list[WorkerHandle | None] = [None] * self.placement.workers
        # Each endpoint's request bound, for all workers together, and the pages in flight:
        # (job id, page) -> (worker number, endpoint, job id).
        self._bounds: dict[str, GateLimit] = {}
        self._held: dict[tuple[int, int], tuple[int, str, int]] = {}
        self._retry_at = [0.0] * len(self._slots)
        self._retiring: list[WorkerHandle] = []
        self._arrived = threading.Event()  # any worker's message
        # Workers that failed before becoming ready, in a row, and why the last one did.
        self.start_failures = 0
        self.start_error: OcrvlError | None = None
        self._numbers = itertools.count(1)

    def _workers(self) -> list[WorkerHandle]:
        return [w for w in (*self._slots, *self._retiring) if w is not None]

    @property
    def size(self) -> int:
        """How many workers it keeps (taking pages or being started)."""
        return len(self._slots)

    def taking(self) -> list[WorkerHandle]:
        """The workers that take pages now."""
        return [w for w in self._slots if w is not None and w.ready]

    def taking_numbers(self) -> list[int]:
        """The numbers of the workers that take pages now."""
        return [w.number for w in self.taking()]

    def servers(self) -> list[ServerHandle] | None:
        """The endpoints its workers bring (a cluster's engine hosts: each its node's server);
        None: its workers use the owner's."""
        return None

    def serves(self) -> Mapping[int, frozenset[str]]:
        """The endpoints each worker may send pages to, by number; one not named: any."""
        return {}

    # --- pages --------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Whether a worker takes pages now."""
        return bool(self.taking())

    def set_limit(self, gate: GateLimit) -> None:
        """How many requests the workers may have at the server at `gate.url`, in all, and how
        many of them big documents may hold (`RequestGate.resize`): shared between the
        workers by the pages each has there (`_share`)."""
        self._bounds[gate.url] = gate
        self._share(gate.url)

    def submit(self, number: int, task: PageTask) -> None:
        """Hand one page to the worker `number` of those taking pages; its part of the bound
        is told first, so the page's requests never wait for a part it has not been given."""
        worker = next(w for w in self.taking() if w.number == number)
        self._held[task.job_id, task.page] = (number, task.url, task.job_id)
        self._share(task.url)
        worker.submit(task)

    def collect(self, timeout: float = 0.0) -> list[PageResult]:
        """Results that arrived from every worker; each waits up to `timeout` for its first."""
        results, freed = [], set()
        for worker in self._workers():
            for result in worker.collect(timeout):
                results.append(result)
                held = self._held.get((result.job_id, result.page))
                if held is not None and held[0] == worker.number:  # not a late answer
                    del self._held[result.job_id, result.page]
                    freed.add(held[1])
        for url in freed:
            self._share(url)
        return results

    def _share(self, url: str) -> None:
        """Give each worker its part of `url`'s bound: in proportion to its pages there (the
        pages of the capped documents for the cap), evenly while none has any. Only the
        workers that may send to `url` share it (`serves`: a cluster host's its own server's)."""
        bound = self._bounds.get(url)
        if bound is None:
            return
        serves = self.serves()
        workers = [w for w in self._workers()
                   if w.ready and (w.number not in serves or url in serves[w.number])]
        held = [(number, job) for number, at, job in self._held.values() if at == url]
        pages = Counter(number for number, _ in held)
        limits = shares(bound.limit, [pages[w.number] for w in workers])
        caps: list[YieldCap | None] = [None] * len(workers)
        if bound.cap is not None:
            big = Counter(number for number, job in held if job in bound.cap.documents)
            caps = [replace(bound.cap, places=n)
                    for n in shares(bound.cap.places, [big[w.number] for w in workers])]
        for worker, limit, cap in zip(workers, limits, caps, strict=True):
            worker.set_limit(GateLimit(url, limit, cap))

    def requests_sent(self) -> list[RequestSent]:
        """The pages whose first request left for the server, collected since last asked."""
        return [sent for worker in self._workers() for sent in worker.requests_sent()]

    def wait(self, timeout: float) -> None:
        """Block until a worker has results, or `timeout` passes (the loop's pause)."""
        workers = self._workers()
        if not workers:
            time.sleep(timeout)
            return
        if not any(w.pending() for w in workers):
            self._arrived.wait(timeout)
        self._arrived.clear()

    def alive(self) -> bool:
        """Whether any worker process still runs."""
        return any(w.alive() for w in self._workers())

    # --- the lifecycle ------------------------------------------------------------------

    @property
    def gave_up(self) -> bool:
        """Whether every worker failed `starts` starts in a row, none ready in between: no
        worker will be started again."""
        return self.starts is not None and self.start_failures >= self.starts * len(self._slots)

    def maintain(self, now: float, busy: Container[int]) -> list[StoppedWorker]:
        """Stop retired workers that are done (not `busy`: have no page in flight), replace a
        failed or worn one, start one when due; returns the workers that stopped."""
        stopped: list[StoppedWorker] = []
        for old in list(self._retiring):
            if old.number not in busy or not old.alive():
                stopped.append(StoppedWorker(old.number))
                self._forget(old.number)
                old.stop()
                self._retiring.remove(old)
        for slot in range(len(self._slots)):
            stopped += self._keep(slot, now)
        return stopped

    def _keep(self, slot: int, now: float) -> list[StoppedWorker]:
        """Replace the worker of `slot` if it failed or is worn, start one when due."""
        stopped: list[StoppedWorker] = []
        worker = self._slots[slot]
        if worker is not None and worker.ready and self.start_failures:
            log.info("engine worker %s started after %d failed start(s)", worker.pid,
                     self.start_failures)
            self.start_failures, self.start_error = 0, None
        if worker is not None and (not worker.alive() or worker.failure):
            failure = worker.failure or f"engine worker exited ({worker.pid})"
            delay = WORKER_RESTART_SECONDS
            if worker.ready:
                log.error("engine worker failed: %s; starting another in %.0f s",
                          failure.rstrip("."), delay)
            else:
                self.start_failures += 1
                # Workers started together fail together: the wait doubles once per round.
                rounds = (self.start_failures - 1) // len(self._slots)
                delay = WORKER_START_BACKOFF.delay(rounds + 1)
                self.start_error = start_failure(failure, self.placement.problem)
                if self.gave_up:
                    delay = float("inf")
                log.error("%s (failed start %d; %s)", self.start_error, self.start_failures,
                          "giving up" if self.gave_up else f"trying again in {delay:.0f} s")
            stopped.append(StoppedWorker(worker.number, failure))
            self._forget(worker.number)
            worker.stop()
            self._slots[slot] = None
            self._retry_at[slot] = now + delay
        worker = self._slots[slot]
        if worker is None:
            if now >= self._retry_at[slot] and not self.gave_up:
                self._start(slot)
        elif worker.ready and self._worn(worker):
            log.info(
                "replacing engine worker %s after %s (%.0f MiB)",
                worker.pid,
                counted(worker.pages_done, "page"),
                worker.rss_mb(),
            )
            self._retire(slot)
            self._start(slot)
        return stopped

    def _forget(self, number: int) -> None:
        """Worker `number` stopped: its pages go back, and its part of the bound with them."""
        urls = {url for n, url, _ in self._held.values() if n == number}
        self._held = {key: held for key, held in self._held.items() if held[0] != number}
        for url in urls:
            self._share(url)

    def _start(self, slot: int) -> None:
        worker = self._new_worker(self._setup)
        worker.arrived = self._arrived
        worker.number = next(self._numbers)
        self._slots[slot] = worker
        worker.start()

    def _retire(self, slot: int) -> None:
        """The worker of `slot` finishes the pages it has; the next one starts when due."""
        worker = self._slots[slot]
        if worker is not None:
            self._retiring.append(worker)
            self._slots[slot] = None

    def reconfigure(self, config: Config) -> None:
        """Apply a reloaded configuration; where the settings the workers run with changed,
        the placement is decided again and the workers are replaced."""
        old, self.config = self.config, config
        if (old.pipeline, old.model, old.server) == (config.pipeline, config.model,
                                                     config.server):
            return
        self.placement = decide_placement(config)
        self._setup = worker_setup(config, self.placement)
        if any(self._slots):
            log.info("pipeline settings changed; replacing the engine workers")
            for slot in range(len(self._slots)):
                self._retire(slot)
        count = self.placement.workers
        self._slots = (self._slots + [None] * count)[:count]
        self._retry_at = (self._retry_at + [0.0] * count)[:count]

    def _worn(self, worker: WorkerHandle) -> bool:
        p = self.config.pipeline
        return worker.pages_done >= p.worker_max_pages or worker.rss_mb() > p.worker_max_rss_mb

    def stop(self) -> None:
        """Stop every worker (pages still in flight are dropped: the converter redoes them).

        Every input is closed before any worker is waited for: each takes most of a second
        to exit (its layout process, torch's teardown), and they do that at the same time.
        """
        workers = self._workers()
        for worker in workers:
            worker.close_input()
        for worker in workers:
            worker.stop()
        self._slots = [None] * len(self._slots)
        self._retiring.clear()
        self._held.clear()

    def kill(self) -> None:
        """A forced stop: SIGKILL every worker's process group now and reap it."""
        for worker in self._workers():
            worker.kill()
        self._slots = [None] * len(self._slots)
        self._retiring.clear()
        self._held.clear()


def start_failure(failure: str, cause: OcrvlError | None = None) -> OcrvlError:
    """Why the recognition pipeline could not start (the worker's `failure`), with the fix
    and exit code of its usual causes: a layout model that cannot be downloaded, a missing
    package; `cause`: the error the daemon itself found (the placement's), of its own kind
    and with its own fix."""
    if cause is not None:
        return ErrorRecord(type(cause).__name__, "The recognition pipeline could not start: "
                           f"{cause.message.rstrip('.')}.", cause.fix).rebuilt()
    message = f"The recognition pipeline could not start: {failure.rstrip('.')}."
    if "model hosting" in failure or "model hoster" in failure:
        return ModelDownloadError(
            message, "the layout model (PP-DocLayout) is downloaded once on first use: let "
            "this machine reach huggingface.co once, or set pipeline.use_layout_detection: "
            "false")
    if "No module named" in failure or "DependencyError" in failure:
        return DependencyError(
            message, "reinstall ocrvl with its extras, e.g. pip install 'ocrvl-daemon[cpu]'")
    return OcrvlError(message, "see the worker's error above; `ocrvl doctor` checks the "
                      "installation")


def shares(total: int, demands: list[int]) -> list[int]:
    """`total` split in proportion to `demands` (largest remainders first), each demand
    above 0 getting at least 1 while there is one to give, and none to a demand of 0; evenly
    where nothing is demanded (each at least 1, as a worker's gate always had)."""
    if not any(demands):
        count = len(demands)
        return [max(1, total // count + (n < total % count)) for n in range(count)]
    weight = sum(demands)
    exact = [total * d / weight for d in demands]
    parts = [int(e) for e in exact]
    for n in sorted(range(len(demands)), key=lambda n: parts[n] - exact[n])[:total - sum(parts)]:
        parts[n] += 1
    for n, demand in enumerate(demands):
        richest = max(range(len(parts)), key=parts.__getitem__)
        if demand and not parts[n] and parts[richest] > 1:
            parts[richest] -= 1
            parts[n] = 1
    return parts

"""The engine workers pages go to: started, restarted with backoff and recycled.

`EnginePool` keeps `pipeline.workers` workers taking pages (`submit` hands a page to the one
the plan chose, by its `number`; `collect`) and the retiring ones that finish what they have;
the converter asks it at each tick to `maintain` them and learns which workers stopped: the
pages they had (recorded on the pages, `document.SentPage.worker`) go back to their
documents. Each worker is started, restarted and recycled on its own: one crashing costs
only its own pages.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from ocrvl_daemon.config import Config
from ocrvl_daemon.errors import DependencyError, ModelDownloadError, OcrvlError
from ocrvl_daemon.server.autotune import engine_workers
from ocrvl_daemon.units import counted
from ocrvl_daemon.worker.client import EngineWorker
from ocrvl_daemon.worker.messages import GateLimit, PageResult, PageTask, RequestSent
from ocrvl_daemon.worker.request_gate import YieldCap

if TYPE_CHECKING:
    from ocrvl_daemon.dispatch import ServerHandle

log = logging.getLogger(__name__)

WORKER_RESTART_SECONDS = 10.0
# A worker that cannot even start (no network for the layout model, a broken install) is
# retried ever less often: the cause rarely goes away by itself within seconds.
WORKER_RESTART_MAX_SECONDS = 300.0


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
        """Its request gate for `gate.url`."""
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
    the configuration and the server's URL (tests give a stand-in).
    """

    def __init__(
        self,
        config: Config,
        starts: int | None = None,
        new_worker: Callable[[Config, str], WorkerHandle] = EngineWorker,
    ) -> None:
        self.config = config
        self.starts = starts
        self._new_worker = new_worker
        # The workers taking pages, one place each (None: to be started at its _retry_at).
        self._slots: list[WorkerHandle | None] = [None] * engine_workers(config)
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
        many of them big documents may hold (`RequestGate.resize`): each worker's request
        gate gets an even share."""
        share_gate(gate, self.taking())

    def submit(self, number: int, task: PageTask) -> None:
        """Hand one page to the worker `number` of those taking pages."""
        next(w for w in self.taking() if w.number == number).submit(task)

    def collect(self, timeout: float = 0.0) -> list[PageResult]:
        """Results that arrived from every worker; each waits up to `timeout` for its first."""
        return [result for worker in self._workers() for result in worker.collect(timeout)]

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
                delay = min(WORKER_RESTART_MAX_SECONDS, delay * 2**rounds)
                self.start_error = start_failure(failure)
                if self.gave_up:
                    delay = float("inf")
                log.error("%s (failed start %d; %s)", self.start_error, self.start_failures,
                          "giving up" if self.gave_up else f"trying again in {delay:.0f} s")
            stopped.append(StoppedWorker(worker.number, failure))
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

    def _start(self, slot: int) -> None:
        worker = self._new_worker(self.config, self.config.server.base_url)
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
        """Apply a reloaded configuration; the workers are replaced if their settings
        changed."""
        old, self.config = self.config, config
        if (old.pipeline, old.model, old.server) != (
            config.pipeline,
            config.model,
            config.server,
        ) and any(self._slots):
            log.info("pipeline settings changed; replacing the engine workers")
            for slot in range(len(self._slots)):
                self._retire(slot)
        count = engine_workers(config)
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

    def kill(self) -> None:
        """A forced stop: SIGKILL every worker's process group now and reap it."""
        for worker in self._workers():
            worker.kill()
        self._slots = [None] * len(self._slots)
        self._retiring.clear()


def share_gate(gate: GateLimit, taking: Sequence[WorkerHandle]) -> None:
    """`gate` split evenly between the workers `taking` pages for its endpoint."""
    caps: list[YieldCap | None] = [None] * len(taking)
    if gate.cap is not None:
        caps = [replace(gate.cap, places=n)
                for n in _even_shares(gate.cap.places, len(taking))]
    for worker, share, cap_share in zip(taking, _even_shares(gate.limit, len(taking)), caps,
                                        strict=True):
        worker.set_limit(GateLimit(gate.url, share, cap_share))


def start_failure(failure: str) -> OcrvlError:
    """Why the recognition pipeline could not start (the worker's `failure`), with the fix
    and exit code of its usual causes: a layout model that cannot be downloaded, a missing
    package."""
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


def _even_shares(total: int, count: int) -> list[int]:
    """`total` split over `count` as evenly as whole numbers allow, each at least 1."""
    return [max(1, total // count + (n < total % count)) for n in range(count)]

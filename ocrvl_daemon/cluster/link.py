"""The daemon's end of one engine host: its workers' handles, its servers' endpoints, and the
thread that brings what happened on the node.

`HostLink` places the host (a Ray actor pinned to its node) and polls it: each `poll` call
waits on the node until a worker has something, so results come as fast as over a local
pipe. `RayWorker` is what the pool sees of a worker on the host: the methods of a local
`EngineWorker`. `HostServer` is what the converter sees of the host's server: the methods of
a local server supervisor (`engine.endpoints.ServerHandle`). A host whose actor dies (its node lost,
its raylet killed) ends every handle of it at once; Ray's own death notice is the signal.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import queue
import threading
import time
from dataclasses import replace
from typing import Any
from urllib.parse import urlparse, urlunparse

from ocrvl_daemon.cluster.host import EngineHost, HostPlace, HostReport, WorkerView
from ocrvl_daemon.cluster.offers import Offer
from ocrvl_daemon.cluster.pdf_copies import PdfShelf
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.messages import GateLimit, PageResult, PageTask, RequestSent
from ocrvl_daemon.server.probe import ServerMetrics
from ocrvl_daemon.server.supervisor import ServerState, ServerStatus

log = logging.getLogger(__name__)

# How long one poll waits on the host for a worker's message: the longest a change of its
# server's state takes to be seen here.
POLL_WAIT = 0.5
# A host that does not answer a poll in this long is stuck; it is polled again (a lost node
# is told by Ray's death notice, not by this).
POLL_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
# Threads of the host actor: a poll waiting must not hold up the pages being handed over.
HOST_THREADS = 8


@functools.cache
def _host_actor() -> Any:
    import ray

    return ray.remote(EngineHost)


class HostLink:
    """One engine host on its node, from its placement to its death or stop.

    `arrived` is set whenever it brings something (the pool's event); `shelf` gives the
    copies of PDFs a node may need.
    """

    def __init__(self, offer: Offer, config: Config, arrived: threading.Event,
                 shelf: PdfShelf) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.offer = offer
        self.arrived = arrived
        self.shelf = shelf
        self.actor = _host_actor().options(
            num_cpus=0, num_gpus=offer.gpus, resources=offer.resources,
            max_concurrency=HOST_THREADS, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(offer.node_id, soft=False),
        ).remote(config.model_dump_json(), offer.slot)
        self.workers: dict[int, RayWorker] = {}
        self.servers: list[HostServer] = []
        self.place: HostPlace | None = None
        self.dead: str | None = None  # why the host is gone (its node lost, stopped...)
        self._local: dict[str, str] = {}  # each server's URL on the node, by its URL here
        self._progress: list[tuple[int, int]] = []
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ocrvl-host-{offer.slot}",
                                        daemon=True)
        self._thread.start()

    @property
    def urls(self) -> frozenset[str]:
        """Its servers' URLs (as the daemon names them)."""
        return frozenset(self._local)

    def new_worker(self, number: int) -> RayWorker:
        """A handle for a new engine worker `number` on this host (`start` starts it)."""
        worker = RayWorker(self, number)
        self.workers[number] = worker
        return worker

    def local_url(self, url: str) -> str:
        """`url` (a server of this host, as named here) as the node reaches it."""
        return self._local.get(url, url)

    def public_url(self, url: str) -> str:
        """A server URL as the node reaches it, as named here."""
        return next((public for public, local in self._local.items() if local == url), url)

    # --- polling ------------------------------------------------------------------------

    def _run(self) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayError

        try:
            self._placed(ray.get(self.actor.place.remote()))
            while not self._closing.is_set():
                try:
                    report = ray.get(self.actor.poll.remote(POLL_WAIT, list(self._progress)),
                                     timeout=POLL_TIMEOUT)
                except GetTimeoutError:
                    log.warning("engine host %s did not answer for %.0f s", self.offer.where,
                                POLL_TIMEOUT)
                    continue
                self._take(report)
        except RayActorError as exc:
            self._died(_death_reason(self.offer, exc))
        except RayError as exc:
            self._died(f"engine host failed: {type(exc).__name__}: {exc}")

    def _placed(self, place: HostPlace) -> None:
        self.place = place
        for index, local in enumerate(place.urls):
            parts = urlparse(local)
            public = urlunparse(parts._replace(
                netloc=f"{self.offer.node_ip or parts.hostname}:{parts.port}"))
            self._local[public] = local
            self.servers.append(HostServer(self, index, public))
        self._progress = [(0, 0)] * len(self.servers)
        gpu = f", GPU {place.gpus}" if place.gpus else ""
        log.info("engine host placed on %s (%s%s), server at %s", self.offer.where,
                 place.hostname, gpu, ", ".join(self._local))

    def _take(self, report: HostReport) -> None:
        # The node's monotonic clock is not ours: its times are moved onto ours (within the
        # poll's round trip, which is all a busy meter needs).
        offset = time.monotonic() - report.clock
        for record in report.records:
            record.relay()
        brought = False
        for number, view in report.workers.items():
            worker = self.workers.get(number)
            if worker is not None:
                brought = worker.take(view, offset) or brought
        for server, status, metrics in zip(self.servers, report.servers, report.metrics,
                                           strict=False):
            server.update(status, metrics, offset)
        if brought:
            self.arrived.set()

    def _died(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason
            if not self._closing.is_set():
                log.warning("engine host on %s is gone (%s); its pages go to the other hosts",
                            self.offer.where, reason)
                # Unreachable is not always dead (a network blip): ended for good, so that
                # it holds no GPU its successor on this slot needs.
                self.kill(reason)
        self.arrived.set()

    def note_progress(self, index: int, in_flight: int, answered: int) -> None:
        """Server `index`'s requests in flight and answered, sent with the next poll."""
        if index < len(self._progress):
            self._progress[index] = (in_flight, answered)

    # --- stopping -----------------------------------------------------------------------

    def closing(self) -> None:
        """It is being stopped: its end is not news."""
        self._closing.set()

    def kill(self, reason: str = "killed") -> None:
        """End the actor now (its node's Ray kills it; its server and workers die with it)."""
        import ray

        self.closing()
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
        self._died(reason)


def stop_hosts(links: list[HostLink]) -> None:
    """Stop these hosts all at once (each its workers, then its server), bounded; then end
    their actors."""
    import ray

    for link in links:
        link.closing()
    stopping = [link.actor.stop.remote() for link in links if link.dead is None]
    with contextlib.suppress(Exception):
        ray.wait(stopping, num_returns=len(stopping), timeout=STOP_TIMEOUT)
    for link in links:
        link.kill("stopped")


def _death_reason(offer: Offer, exc: Exception) -> str:
    """Why a host is gone, in words: its node left the cluster, cannot be reached (its raylet
    killed, the network down: Ray says so before its head declares the node dead), or the
    host itself died."""
    import ray
    from ray.exceptions import ActorUnavailableError

    node = f"node {offer.node_ip} ({offer.node_id[:12]})"
    with contextlib.suppress(Exception):
        if offer.node_id not in {n["NodeID"] for n in ray.nodes() if n.get("Alive")}:
            return f"{node} left the cluster"
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if isinstance(exc, ActorUnavailableError):
        return f"{node} cannot be reached ({text})"
    return f"engine host died: {text}"


class RayWorker:
    """An engine worker on a host, as the pool sees a local one (`EngineWorker`'s methods)."""

    def __init__(self, link: HostLink, number: int) -> None:
        self.link = link
        self.number = number
        self.arrived = link.arrived
        self.gates: dict[str, GateLimit] = {}
        self._gate_order = itertools.count(1)  # numbers its gates for the host (`GateOrder`)
        self.pages_done = 0
        self.ready = False
        self.failure: str | None = None
        self.started_at = time.monotonic()
        self._inbox: queue.Queue[PageResult] = queue.Queue()
        self._sent: list[RequestSent] = []
        self._sent_lock = threading.Lock()
        self._running = True
        self._pid: int | None = None
        self._rss_mb = 0.0

    @property
    def lost(self) -> bool:
        """Whether its host is gone: the pages it had are nobody's fault."""
        return self.link.dead is not None

    @property
    def pid(self) -> int | None:
        """The worker's process id on its node."""
        return self._pid

    def start(self) -> None:
        """Start the worker on its host; it reports readiness through `collect`."""
        self.link.actor.start_worker.remote(self.number)

    def take(self, view: WorkerView, offset: float) -> bool:
        """Take what a poll brought for this worker; True when a page came back."""
        self.ready, self.failure = view.ready, view.failure
        self._running, self._pid, self._rss_mb = view.alive, view.pid, view.rss_mb
        for result in view.results:
            self._inbox.put(_on_our_clock(result, offset, self.link.public_url(result.url)))
        with self._sent_lock:
            self._sent += view.sent
        self.pages_done += len(view.results)
        return bool(view.results or view.sent)

    def alive(self) -> bool:
        """Whether the worker process still runs (and its host)."""
        return self._running and not self.lost

    def rss_mb(self) -> float:
        """Resident memory of the worker on its node, in MiB, as last reported."""
        return self._rss_mb

    def submit(self, task: PageTask) -> None:
        """Hand one page to the worker, with a copy of its PDF if the node may need one."""
        local = replace(task, url=self.link.local_url(task.url))
        self.link.actor.submit.remote(self.number, local, self.link.shelf.copy_for(task))

    def set_limit(self, gate: GateLimit) -> None:
        """The worker's request gate for `gate.url`; sent only when it changes, numbered:
        the host may run two calls the other way round, and applies the later one only."""
        if self.gates.get(gate.url) != gate:
            self.gates[gate.url] = gate
            self.link.actor.set_limit.remote(
                self.number, replace(gate, url=self.link.local_url(gate.url)),
                next(self._gate_order))

    def pending(self) -> bool:
        """Whether results wait to be collected."""
        return not self._inbox.empty()

    def requests_sent(self) -> list[RequestSent]:
        """The pages whose first request left for the server, since last asked."""
        with self._sent_lock:
            sent, self._sent = self._sent, []
        return sent

    def collect(self, timeout: float = 0.0) -> list[PageResult]:
        """Results that arrived; waits up to `timeout` for the first one."""
        out: list[PageResult] = []
        with contextlib.suppress(queue.Empty):
            out.append(self._inbox.get(timeout=timeout) if timeout > 0 else
                       self._inbox.get_nowait())
            while True:
                out.append(self._inbox.get_nowait())
        return out

    def close_input(self) -> None:
        """No more pages: the worker finishes what it has and exits."""
        if not self.lost:
            self.link.actor.close_input.remote(self.number)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the worker on its host (bounded) and forget it."""
        import ray

        self.link.workers.pop(self.number, None)
        if not self.lost:
            with contextlib.suppress(Exception):
                ray.get(self.link.actor.stop_worker.remote(self.number), timeout=timeout)

    def kill(self) -> None:
        """A forced stop of the worker's process group on its node."""
        self.link.workers.pop(self.number, None)
        if not self.lost:
            self.link.actor.stop_worker.remote(self.number, True)


def _on_our_clock(result: PageResult, offset: float, url: str) -> PageResult:
    """`result` with its times moved onto the daemon's clock and its endpoint named as here."""
    def shift(span: tuple[float, float]) -> tuple[float, float]:
        return span[0] + offset, span[1] + offset

    return replace(result, url=url,
                   render_span=shift(result.render_span) if result.render_span else None,
                   layout_spans=[shift(s) for s in result.layout_spans],
                   request_spans=[shift(s) for s in result.request_spans])


class HostServer:
    """A host's server as the converter sees an endpoint (`engine.endpoints.ServerHandle`)."""

    def __init__(self, link: HostLink, index: int, url: str) -> None:
        self.link = link
        self.index = index
        self._url = url
        several = len(link.place.urls) > 1 if link.place else False
        self._name = link.offer.where + (f"/{index + 1}" if several else "")
        self._status: ServerStatus | None = None
        self._metrics: ServerMetrics | None = None
        self._sampled_at: float | None = None  # `_metrics`' time on the node's clock

    @property
    def name(self) -> str:
        """Its node and slot, e.g. "node 10.0.0.5 #1"."""
        return self._name

    @property
    def url(self) -> str:
        """Its OpenAI base URL, named by its node's address."""
        return self._url

    def update(self, status: ServerStatus, metrics: ServerMetrics | None,
               offset: float) -> None:
        """What the last poll said of it."""
        place = self.link.place
        self._status = replace(status, url=self._url, node=self.link.offer.node_ip,
                               gpu=place.gpus if place else None)
        # Every poll brings the host's newest scrape, each moved onto our clock by its own
        # poll's offset: were each taken as a new one, one scrape of a server keeping
        # requests waiting would count as several in a row, and the concurrency search would
        # cap the bound at once (`ConcurrencyController`: WAITING_SAMPLES). A scrape is news
        # once.
        if metrics is None or metrics.taken_at != self._sampled_at:
            self._sampled_at = None if metrics is None else metrics.taken_at
            self._metrics = None if metrics is None else replace(
                metrics, taken_at=metrics.taken_at + offset)

    def status(self) -> ServerStatus:
        """A snapshot for status lines; a host that is gone shows why."""
        dead = self.link.dead
        if dead is not None:
            return ServerStatus(ServerState.FAILED, "host gone", None, 0,
                                self._status.restart_count if self._status else 0, dead, None,
                                self._url, self.link.offer.node_ip, None)
        if self._status is None:
            return ServerStatus(ServerState.STARTING, "placing the engine host", None, 0, 0,
                                None, None, self._url, self.link.offer.node_ip, None)
        return self._status

    def is_ready(self) -> bool:
        """Whether pages may go to it now."""
        return (self.link.dead is None and self._status is not None
                and self._status.state is ServerState.READY)

    def note_progress(self, in_flight: int, completed_total: int) -> None:
        """Client-side progress, for the host's hang detection."""
        self.link.note_progress(self.index, in_flight, completed_total)

    def metrics(self, want: bool = True) -> ServerMetrics | None:
        """The newest `/metrics` sample the host took."""
        return self._metrics

    def note_unreachable(self, reason: str) -> None:
        """A request found no server there: the host's supervisor hears it at once."""
        if self.link.dead is None:
            self.link.actor.note_unreachable.remote(self.index, reason)

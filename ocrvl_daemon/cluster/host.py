"""The engine host: what one engine slot of a Ray node runs for the daemon.

A Ray actor (`link.HostLink` places it) that keeps its node's model server (`ServerSet`,
managed there as on one machine: `auto` settings for the node's card, replicas and MPS,
`launcher: command` with its own `{port}`) and the engine worker processes the daemon
starts on it: the same `EngineWorker` the daemon runs without a cluster, so each page is
rendered, laid out and sent to the server on the node. The daemon calls it and it never
calls back: `poll` hands over what happened since the last call (`HostReport`).

The server outlives the workers (a worn worker is replaced in seconds, a vLLM start takes a
minute); both end with the actor, as the server's and workers' parent-death signals see to
when the node's Ray kills it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ocrvl_daemon.cluster.pdf_copies import NodePdfs, PdfCopy
from ocrvl_daemon.config.cluster_section import ClusterConfig
from ocrvl_daemon.config.layout import AUTO
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.messages import (
    Failure,
    GateLimit,
    LogRecord,
    PageResult,
    PageTask,
    RequestSent,
)
from ocrvl_daemon.engine.worker_handle import EngineWorker
from ocrvl_daemon.engine.worker_settings import worker_setup
from ocrvl_daemon.errors import OcrvlError
from ocrvl_daemon.server.placement import decide_placement
from ocrvl_daemon.server.probe import ServerMetrics
from ocrvl_daemon.server.replicas import ServerSet
from ocrvl_daemon.server.supervisor import ServerStatus

log = logging.getLogger(__name__)

# Log records kept for the daemon between two polls at most (a flood is cut, not queued).
MAX_RECORDS = 500


@dataclass(frozen=True)
class WorkerView:
    """One engine worker on the host, as the daemon's handle of it needs it."""

    ready: bool
    failure: str | None
    alive: bool
    pid: int | None
    rss_mb: float
    results: list[PageResult] = field(default_factory=list)
    sent: list[RequestSent] = field(default_factory=list)


@dataclass(frozen=True)
class HostReport:
    """What happened on the host since the last poll. Times in it (`PageResult`'s spans,
    `ServerMetrics.taken_at`) are the node's `time.monotonic()`, which was `clock` when the
    report was made."""

    workers: dict[int, WorkerView]
    servers: list[ServerStatus]
    metrics: list[ServerMetrics | None]
    records: list[LogRecord]
    clock: float


@dataclass(frozen=True)
class HostPlace:
    """Where the host runs: its node (Ray's id, address and name) and GPU(s), if any."""

    node_id: str
    node_ip: str
    hostname: str
    gpus: str | None  # CUDA_VISIBLE_DEVICES as Ray set it for the host
    urls: tuple[str, ...]  # its servers' OpenAI base URLs, as the node reaches them
    workers: int  # engine workers it runs, as a local pool would on this node (its placement)
    pid: int


class _Records(logging.Handler):
    """Keeps the host's log records (its servers', its workers' relayed ones) for `poll`."""

    def __init__(self, slot: str) -> None:
        super().__init__(logging.INFO)
        self.slot = slot
        self._records: list[LogRecord] = []
        self._lock_records = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock_records:
            if len(self._records) < MAX_RECORDS:
                self._records.append(LogRecord(record.levelno, record.name,
                                               f"[{self.slot}] {record.getMessage()}"))

    def take(self) -> list[LogRecord]:
        with self._lock_records:
            taken, self._records = self._records, []
        return taken


class GateOrder:
    """Hands each worker its request gates in the order the daemon set them.

    The host runs its calls on several threads (a poll waits on one while pages are handed
    over), and Ray keeps no order between the calls of a threaded actor: two `set_limit`s the
    daemon sent back to back may run the other way round. The older gate, applied last,
    would then hold the worker to a share it no longer has until its share changes again,
    which at the end of a book is when its pages come back, seconds later (its pages wait
    at the gate meanwhile). So each gate comes numbered by the daemon's handle
    (`link.RayWorker`), and one older than the last handed on for its worker and endpoint
    is dropped. (A page that overtakes the gate raised for it waits at the gate for as long
    as the two calls are apart.)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a gate is checked and handed on in one step
        self._last: dict[tuple[int, str], int] = {}  # by (worker, endpoint): the last order

    def apply(self, number: int, gate: GateLimit, order: int,
              send: Callable[[GateLimit], None]) -> None:
        """Hand `gate`, the `order`th the daemon set for worker `number`, on with `send`,
        unless a later one was handed on already."""
        with self._lock:
            key = (number, gate.url)
            if order <= self._last.get(key, 0):
                return
            self._last[key] = order
            send(gate)

    def forget(self, number: int) -> None:
        """Worker `number` is gone."""
        with self._lock:
            self._last = {key: order for key, order in self._last.items() if key[0] != number}


def node_config(config: Config, slot: str) -> Config:
    """The daemon's configuration as the host on this node runs it: its own state folder
    (pidfiles: the next host of this slot ends a server a killed one left) and a free port
    for its server(s); the GPUs Ray gave it."""
    port = _free_port(config.server.host)
    server = config.server.model_copy(update={"port": port, "gpus": AUTO})
    state = Path(tempfile.gettempdir()) / "ocrvl-engine-host" / slot
    state.mkdir(parents=True, exist_ok=True)
    return config.model_copy(update={"server": server, "state_dir": state,
                                     "cluster": ClusterConfig()})


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class EngineHost:
    """One engine slot of a node: its server(s) and the daemon's workers on it.

    Made a Ray actor by `link.HostLink` (threaded: `poll` waits while pages come in).
    `config_json`: the daemon's configuration; `slot`: the slot's stable name on its node.
    """

    def __init__(self, config_json: str, slot: str) -> None:
        self.slot = slot
        # Ray sets OMP_NUM_THREADS=1 in an actor that asks for no CPU; the workers and server
        # started here inherit the environment and must see the node as a local daemon's do
        # (the layout model plans its own threads).
        if os.environ.get("OMP_NUM_THREADS") == "1":
            del os.environ["OMP_NUM_THREADS"]
        self._records = _Records(slot)
        root = logging.getLogger()
        root.addHandler(self._records)
        root.setLevel(min(root.level or logging.INFO, logging.INFO))
        self.config = node_config(Config.model_validate_json(config_json), slot)
        self.servers = ServerSet(self.config)
        self.servers.start()
        # Decided once, on this node (its GPU, its cores), as a local daemon does; every
        # worker here is set up with it, sending to this node's server.
        self.placement = decide_placement(self.config)
        self._setup = worker_setup(self.config, self.placement)
        self._workers: dict[int, EngineWorker] = {}
        self._gates = GateOrder()
        self._arrived = threading.Event()
        # Every worker is started from this one thread, which lives as long as the host: a
        # worker dies with the thread that started it (its parent-death signal).
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="ocrvl-host-spawn")
        self._pdfs = NodePdfs(Path(tempfile.gettempdir()) / "ocrvl-engine-host" / "pdfs",
                              self.config.cluster.pdfs)
        self._local: dict[int, list[PageResult]] = {}  # results made here (a PDF not fetched)

    def place(self) -> HostPlace:
        """Where this host runs."""
        import ray

        context = ray.get_runtime_context()
        return HostPlace(context.get_node_id(), ray.util.get_node_ip_address(),
                         socket.gethostname(), os.environ.get("CUDA_VISIBLE_DEVICES") or None,
                         tuple(e.url for e in self.servers.endpoints),
                         self.placement.workers, os.getpid())

    def start_worker(self, number: int) -> None:
        """Start engine worker `number` (the daemon's name for it) on this node."""
        worker = EngineWorker(self._setup)
        worker.arrived = self._arrived
        worker.number = number
        self._workers[number] = worker
        try:
            self._spawner.submit(worker.start).result()
        except OSError as exc:  # reported as a worker that failed to start, as locally
            worker.failure = f"could not start the engine worker: {exc}"

    def submit(self, number: int, task: PageTask, pdf: PdfCopy | None) -> None:
        """Hand a page to worker `number`, its PDF from here or fetched (`pdf`)."""
        worker = self._workers.get(number)
        if worker is None:
            return
        try:
            task = self._pdfs.local(task, pdf)
        except (OSError, OcrvlError, ValueError) as exc:
            # Not the page's fault, nor a file gone from the inbox: it is asked again.
            result = PageResult(task.job_id, task.page, url=task.url, error_kind=Failure.PAGE,
                                error=f"node {self.slot} could not get the PDF: {exc}")
            self._local.setdefault(number, []).append(result)
            self._arrived.set()
            return
        worker.submit(task)

    def set_limit(self, number: int, gate: GateLimit, order: int) -> None:
        """Worker `number`'s request gate for `gate.url`, the `order`th the daemon set for
        that worker (`GateOrder`)."""
        worker = self._workers.get(number)
        if worker is not None:
            self._gates.apply(number, gate, order, worker.set_limit)

    def close_input(self, number: int) -> None:
        """No more pages for worker `number`: it finishes what it has and exits."""
        worker = self._workers.get(number)
        if worker is not None:
            worker.close_input()

    def stop_worker(self, number: int, kill: bool = False) -> None:
        """Stop worker `number` (at once with `kill`) and forget it."""
        worker = self._workers.pop(number, None)
        self._gates.forget(number)
        if worker is not None:
            worker.kill() if kill else worker.stop()

    def note_unreachable(self, index: int, reason: str) -> None:
        """A request to server `index` found no server there."""
        with contextlib.suppress(IndexError):
            self.servers.endpoints[index].note_unreachable(reason)

    def poll(self, timeout: float, progress: list[tuple[int, int]]) -> HostReport:
        """What happened since the last poll, waiting up to `timeout` for a worker's message;
        `progress`: each server's requests in flight and answered, as the daemon counts them
        (its hang detection)."""
        workers = list(self._workers.items())
        if not self._local and not any(w.pending() for _, w in workers):
            self._arrived.wait(timeout)
        self._arrived.clear()
        for server, (in_flight, answered) in zip(self.servers.endpoints, progress, strict=False):
            server.note_progress(in_flight, answered)
        views = {}
        for number, worker in workers:
            results = worker.collect() + self._local.pop(number, [])
            views[number] = WorkerView(worker.ready, worker.failure, worker.alive(), worker.pid,
                                       worker.rss_mb(), results, worker.requests_sent())
        return HostReport(views, self.servers.status(),
                          [e.metrics(want=True) for e in self.servers.endpoints],
                          self._records.take(), time.monotonic())

    def stop(self) -> None:
        """Stop every worker, then the server(s): bounded, as each stop is."""
        workers = list(self._workers.values())
        self._workers.clear()
        for worker in workers:
            worker.close_input()
        for worker in workers:
            worker.stop()
        self.servers.stop()
        self._spawner.shutdown(wait=False)


"""The engine pool on a Ray cluster: one engine host per slot the nodes offer.

`ClusterPool` is the converter's `EnginePool` with slots that come and go with the nodes
(`offers.offers`, looked at every few seconds): each slot has a host (`link.HostLink`) on its
node, and the pool's workers there are `link.RayWorker`s. Starting, restarting with backoff,
recycling worn workers and crash isolation are the local pool's, unchanged; only a host that
is gone differs: the pages its workers had go back to their documents and count against no
page (a lost node is nobody's fault). Each worker serves only its own host's servers
(`serves`), which are the converter's endpoints (`servers`); so each server's request bound
is shared, by the pool's one rule (`EnginePool._share`), between its own host's workers.

`ClusterServers` is what the daemon's server set is without a cluster: the hosts' servers
for status, start and stop.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque
from collections.abc import Container, Mapping

from ocrvl_daemon.cluster.link import HostLink, HostServer, RayWorker, stop_hosts
from ocrvl_daemon.cluster.offers import Offer, offers
from ocrvl_daemon.cluster.pdf_copies import PdfShelf
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.engine.endpoints import ServerHandle
from ocrvl_daemon.engine.pool import WORKER_RESTART_SECONDS, EnginePool, StoppedWorker
from ocrvl_daemon.errors import ClusterError, DependencyError, ServerError
from ocrvl_daemon.server.placement import Placement
from ocrvl_daemon.server.replicas import ServerSet
from ocrvl_daemon.server.supervisor import ServerState, ServerStatus

log = logging.getLogger(__name__)

# How often the nodes are looked at for slots that joined or left.
OFFERS_SECONDS = 2.0
# Hosts that are gone stay in status (as failed, with why) this many at most.
GONE_SHOWN = 8


def connect(config: Config) -> None:
    """Join the Ray cluster at cluster.address as a driver (this process places the hosts)."""
    # Ray's C++ failure handler prints a native stack dump at SIGTERM, which is the daemon's
    # normal stop (systemctl stop): a crash report in the journal at every stop. It is read
    # when Ray is imported; the daemon's own crashes are Python's to report.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    try:
        import ray
    except ImportError as exc:
        raise DependencyError(
            "cluster.address is set but Ray is not installed here.",
            "pip install 'ocrvl-daemon[cluster]' (the same Ray version as the cluster's "
            "nodes), or remove cluster.address") from exc
    cluster = config.cluster
    if ray.is_initialized():
        return
    try:
        ray.init(address=cluster.address, _node_ip_address=cluster.node_ip,
                 log_to_driver=False, logging_level=logging.WARNING,
                 namespace="ocrvl", configure_logging=False)
    except Exception as exc:  # Ray raises ConnectionError, RuntimeError, ValueError...
        raise ClusterError(
            f"Cannot join the Ray cluster at {cluster.address}: {type(exc).__name__}: {exc}",
            "start it (`ray start --head` on the head node), check cluster.address, and "
            "that this machine reaches the head's port; `ocrvl doctor` checks it") from exc
    log.info("joined the Ray cluster at %s (Ray %s, Python %d.%d)", cluster.address,
             ray.__version__, *sys.version_info[:2])


class ClusterPool(EnginePool):
    """The engine workers of a converter, on the hosts of the cluster's engine slots."""

    def __init__(self, config: Config, starts: int | None = None) -> None:
        # No placement is decided here: each host decides its own, on its node (`place`).
        super().__init__(config, starts, placement=Placement(workers=0))
        self._offers: list[Offer] = []  # the slot of each place in _slots
        self._links: dict[str, HostLink] = {}  # each slot's host, by slot name
        self._gone: deque[HostServer] = deque(maxlen=GONE_SHOWN)
        self.shelf = PdfShelf(config.cluster.pdfs)
        self.looked = False  # the nodes were looked at once
        self._next_look = 0.0

    # --- slots and hosts ----------------------------------------------------------------

    def maintain(self, now: float, busy: Container[int]) -> list[StoppedWorker]:
        """Give back the pages of hosts that are gone, follow the nodes that joined or left,
        then keep the workers as the local pool does."""
        stopped = self._hosts_gone(now)
        if now >= self._next_look:
            self._next_look = now + OFFERS_SECONDS
            stopped += self._look()
        self._add_workers()
        return stopped + super().maintain(now, busy)

    def _add_workers(self) -> None:
        """Give each placed host as many worker places as a local pool would have on its
        node (its first place is made when its slot is offered)."""
        for name, link in self._links.items():
            if link.place is None or link.dead is not None:
                continue
            places = [slot for slot, offer in enumerate(self._offers) if offer.slot == name]
            for _ in range(link.place.workers - len(places)):
                self._offers.append(self._offers[places[0]])
                self._slots.append(None)
                self._retry_at.append(0.0)

    def _hosts_gone(self, now: float) -> list[StoppedWorker]:
        stopped = []
        for slot, worker in enumerate(self._slots):
            if isinstance(worker, RayWorker) and worker.lost:
                stopped.append(StoppedWorker(worker.number))
                self._slots[slot] = None
                self._retry_at[slot] = now + WORKER_RESTART_SECONDS
        for old in list(self._retiring):
            if isinstance(old, RayWorker) and old.lost:
                stopped.append(StoppedWorker(old.number))
                self._retiring.remove(old)
        for name, link in list(self._links.items()):
            if link.dead is not None:
                self._gone.extend(link.servers)
                del self._links[name]
        for gone in stopped:
            self._forget(gone.number)
        return stopped

    def _look(self) -> list[StoppedWorker]:
        """Follow the slots the live nodes offer now: new ones are started when due, those
        of nodes that left are dropped with their workers' pages."""
        import ray

        try:
            current = offers(ray.nodes())
        except Exception as exc:  # the head unreachable for a moment: keep what we have
            log.warning("cannot read the cluster's nodes: %s", exc)
            return []
        self.looked = True
        stopped = []
        names = {o.slot for o in current}
        for slot in reversed(range(len(self._offers))):
            offer = self._offers[slot]
            if offer.slot in names:
                continue
            worker = self._slots[slot]
            if worker is not None:
                stopped.append(StoppedWorker(worker.number))
            link = self._links.pop(offer.slot, None)
            if link is not None:
                log.warning("%s left the cluster; its pages go to the other hosts",
                            offer.where)
                link.kill(f"node {offer.node_ip} ({offer.node_id[:12]}) left the cluster")
                self._gone.extend(link.servers)
            del self._slots[slot], self._retry_at[slot], self._offers[slot]
        known = {o.slot for o in self._offers}
        for offer in current:
            if offer.slot not in known:
                log.info("engine slot on %s joins: its host starts", offer.where)
                self._offers.append(offer)
                self._slots.append(None)
                self._retry_at.append(0.0)
        for gone in stopped:
            self._forget(gone.number)
        return stopped

    def _start(self, slot: int) -> None:
        offer = self._offers[slot]
        link = self._links.get(offer.slot)
        if link is None or link.dead is not None:
            link = HostLink(offer, self.config, self._arrived, self.shelf)
            self._links[offer.slot] = link
        worker = link.new_worker(next(self._numbers))
        self._slots[slot] = worker
        worker.start()

    # --- what the converter asks --------------------------------------------------------

    def servers(self) -> list[ServerHandle] | None:
        """The hosts' servers, placed ones first, then those gone (shown, never ready)."""
        live: list[ServerHandle] = [s for link in self._links.values() for s in link.servers]
        return live + list(self._gone)

    def serves(self) -> Mapping[int, frozenset[str]]:
        """Each worker sends pages to its own host's server(s) only (and shares their
        request bounds with its host's other workers only)."""
        return {w.number: w.link.urls for w in self._workers() if isinstance(w, RayWorker)}

    def reconfigure(self, config: Config) -> None:
        """Apply a reloaded configuration: with other engine or server settings every host
        is replaced (its pages go back, nobody's fault)."""
        old, self.config = self.config, config
        if (old.pipeline, old.model, old.server, old.cluster) != (
                config.pipeline, config.model, config.server, config.cluster):
            log.info("engine settings changed; replacing the engine hosts")
            for link in self._links.values():
                link.kill("settings changed")
            self.shelf = PdfShelf(config.cluster.pdfs)

    def stop(self) -> None:
        """Stop every host at once: each stops its workers (pages in flight are redone), then
        its server."""
        stop_hosts(list(self._links.values()))
        self._links.clear()
        self._slots = [None] * len(self._slots)
        self._retiring.clear()
        self._held.clear()

    def kill(self) -> None:
        """End every host now (its workers and server die with it)."""
        for link in self._links.values():
            link.kill()
        self._links.clear()
        self._slots = [None] * len(self._slots)
        self._retiring.clear()
        self._held.clear()

    @property
    def size(self) -> int:
        """How many engine worker places the cluster's hosts have now."""
        return len(self._slots)

    @property
    def gave_up(self) -> bool:
        """As the local pool's, once there are places: a cluster with none (yet, or any
        more) waits for nodes (`ClusterServers.error` says when it has none at all)."""
        return bool(self._slots) and super().gave_up


class ClusterServers(ServerSet):
    """The hosts' servers where the daemon has its server set: started and stopped with the
    pool's hosts (each host keeps its own server)."""

    def __init__(self, pool: ClusterPool) -> None:
        # Not ServerSet's: nothing runs here. The converter takes the endpoints from the pool.
        self.pool = pool
        self.config = pool.config
        self.endpoints = []

    def _servers(self) -> list[ServerHandle]:
        return self.pool.servers() or []

    def start(self) -> None:
        """Nothing to start here: the pool places the hosts as the converter ticks."""

    def stop(self) -> None:
        """Stop every host (its workers, then its server)."""
        self.pool.stop()

    def kill(self) -> None:
        """End every host now."""
        self.pool.kill()

    def is_ready(self) -> bool:
        """Whether any host's server takes pages now."""
        return any(s.is_ready() for s in self._servers())

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Whether a host's server is ready within `timeout` (the pool must be ticking)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_ready() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.1)
        return self.is_ready()

    @property
    def error(self) -> ServerError | None:
        """A cluster that offers no engine slot at all: nothing could ever convert."""
        if self.pool.looked and not self.pool.size:
            return ClusterError(
                f"The Ray cluster at {self.config.cluster.address} offers no engine slot: no "
                "node has a GPU or the ocrvl_engine resource.",
                "start a node with a GPU (`ray start --address HEAD:PORT`), or with "
                "--resources '{\"ocrvl_engine\": 1}'")
        return None

    def status(self) -> list[ServerStatus]:
        """Each host's server."""
        return [s.status() for s in self._servers()]

    def overall(self) -> ServerStatus:
        """The first ready server's status, else the first's, else the cluster's."""
        statuses = self.status()
        ready = next((s for s in statuses if s.state is ServerState.READY), None)
        if ready is not None or statuses:
            return ready or statuses[0]
        return ServerStatus(ServerState.STARTING, "placing engine hosts on the cluster", None,
                            0, 0, None, None, self.config.cluster.address or "", None, None)


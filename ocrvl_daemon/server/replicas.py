"""All the model servers ocrvl uses, one supervisor per endpoint, started and stopped together.

Managed (`server.mode: managed`): `server.replicas` vLLM servers on each GPU of `server.gpus`,
each with its own port (server.port, +1, +2, ...), process group, pidfile and share of the
card's memory. Replicas on one GPU start one after another: vLLM's start-up memory profiling
counts a neighbour that is starting too, and two started at the same moment both fail. GPUs
start in parallel. Once started, each is supervised on its own (one restarting leaves the
others serving). External (`server.mode: external`): one watcher per URL of `server.url` /
`server.urls`. Replicas that cannot fit the card are refused, with the numbers, before
anything starts. Where `server.mps` says so, ocrvl's MPS control daemon (`mps`) starts before
the first replica and stops after the last one is reaped; the replicas are its clients.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
from collections.abc import Callable
from urllib.parse import urlparse

from ocrvl_daemon.config.model import AUTO, Config
from ocrvl_daemon.core.backoff import Backoff
from ocrvl_daemon.errors import ServerConfigError, ServerError, ServerMissingError
from ocrvl_daemon.process.group import kill_leftover
from ocrvl_daemon.server import autotune, launchers, mps
from ocrvl_daemon.server.external import ExternalServer
from ocrvl_daemon.server.gpu import GpuReading, read_gpu, read_gpus, visible_devices
from ocrvl_daemon.server.managed import ManagedServer, pidfile_name
from ocrvl_daemon.server.supervisor import ServerState, ServerStatus, ServerSupervisor

log = logging.getLogger(__name__)

ONE_SERVER = "server"  # the name of the only endpoint, as before there could be several
PIDFILE_GLOB = "server*.pid"


@dataclasses.dataclass(frozen=True)
class GpuSlot:
    """One GPU the managed servers run on: its index in server.gpus' numbering, the
    CUDA_VISIBLE_DEVICES value that pins a server to it (None: not pinned) and its reading."""

    index: int
    device: str | None
    reading: GpuReading | None


class ServerSet:
    """The supervisors of every endpoint (`endpoints`, at least one), in a stable order."""

    def __init__(self, config: Config,
                 on_change: Callable[[ServerStatus], None] | None = None,
                 backoff: Backoff | None = None) -> None:
        """Plan the endpoints; raises ServerConfigError (before anything starts) when the
        replicas cannot fit their GPU or server.gpus names a GPU that is not there, and
        ServerMissingError when no GPU is visible for a managed vLLM."""
        self.config = config
        self._on_change = on_change
        self._stopping = threading.Event()
        self._cond = threading.Condition()  # woken at every change of an endpoint
        self._starters: list[threading.Thread] = []
        # Managed: the replicas of each GPU, in start order.
        self._groups: list[list[ManagedServer]] = []
        self._mps: mps.MpsDaemon | None = None
        if config.server.mode == "external":
            self.endpoints: list[ServerSupervisor] = self._external()
        else:
            self._groups = self._managed(backoff)
            self.endpoints = [server for group in self._groups for server in group]

    # building

    def _external(self) -> list[ServerSupervisor]:
        server = self.config.server
        urls = server.urls or [server.base_url]
        endpoints: list[ServerSupervisor] = []
        for url in urls:
            copied = self.config.model_copy(update={"server": server.model_copy(
                update={"url": url, "urls": None})})
            name = ONE_SERVER if len(urls) == 1 else urlparse(url).netloc
            endpoints.append(ExternalServer(copied, self._changed, name))
        return endpoints

    def _managed(self, backoff: Backoff | None) -> list[list[ManagedServer]]:
        server = self.config.server
        found = mps.probe(self.config) if server.mps != "off" else mps.MpsProbe(None)
        slots = self._slots()
        if server.launcher != "command" and not any(slot.reading for slot in slots):
            # vLLM would die with "Failed to infer device type"; server.command may not need one.
            raise ServerMissingError(
                f"No NVIDIA GPU is visible here, so the managed vLLM server (server.launcher: "
                f"{server.launcher}) cannot run on this machine (`ocrvl doctor` says why none "
                "is found).", launchers.external_server_setup(self.config))
        plan = [(slot, self._replicas(slot, found.available)) for slot in slots]
        mps_plan = mps.plan(self.config, found, any(replicas > 1 for _, replicas in plan))
        self._mps = mps.MpsDaemon(mps_plan, launchers.server_env(self.config),
                                  server.stop_timeout)
        total = sum(replicas for _, replicas in plan)
        last_port = server.port + total - 1
        if last_port > 65535:
            raise ServerConfigError(
                f"server.port = {server.port} leaves no room for {total} servers (ports "
                f"{server.port}-{last_port}).", "set server.port lower")
        groups: list[list[ManagedServer]] = []
        port = server.port
        for slot, replicas in plan:
            group: list[ManagedServer] = []
            turn = threading.Lock()  # one start at a time on this GPU, restarts included
            for replica in range(1, replicas + 1):
                name = ONE_SERVER if total == 1 else f"gpu{slot.index}/{replica}"
                env = {**server.env, **mps_plan.client_env()}
                if slot.device is not None:
                    env["CUDA_VISIBLE_DEVICES"] = slot.device
                copied = self.config.model_copy(update={"server": server.model_copy(
                    update={"port": port, "replicas": replicas, "gpus": AUTO, "env": env})})
                managed = ManagedServer(copied, self._changed,
                                        backoff, name,
                                        self._reading_for(copied, group), turn)
                group.append(managed)
                port += 1
            groups.append(group)
        return groups

    def _slots(self) -> list[GpuSlot]:
        """The GPUs server.gpus asks for, as CUDA numbers them in the servers' environment."""
        gpus = self.config.server.gpus
        env = launchers.server_env(self.config)
        readings = read_gpus(env)
        devices = visible_devices(env)
        if gpus == AUTO:
            if len(readings) <= 1:  # one GPU or none: as ever, the environment decides
                return [GpuSlot(0, None, readings[0] if readings else None)]
            indices = list(range(len(readings)))
        else:
            assert not isinstance(gpus, str)
            indices = list(gpus)
            missing = [i for i in indices if readings and i >= len(readings)]
            if missing:
                seen = ", ".join(f"{i}: {r.name}" for i, r in enumerate(readings))
                raise ServerConfigError(
                    f"server.gpus = {gpus} names GPU {missing[0]}, but the servers can see "
                    f"only {len(readings)} ({seen}).",
                    "list only those GPUs in server.gpus, or use server.gpus: auto")
        return [GpuSlot(i, devices[i] if devices is not None and i < len(devices) else str(i),
                        readings[i] if i < len(readings) else None) for i in indices]

    def _replicas(self, slot: GpuSlot, mps_available: bool) -> int:
        """server.replicas for `slot` (`auto` from its memory and whether ocrvl can run MPS);
        refused if they cannot fit."""
        replicas = self.config.server.replicas
        reading = slot.reading
        if replicas == AUTO:
            return autotune.auto_replicas(reading.total_mib if reading else None, mps_available)
        assert isinstance(replicas, int)
        if reading is not None and replicas > 1:
            problem = autotune.replicas_fit_problem(self.config, reading, replicas)
            if problem is not None:
                raise ServerConfigError(f"{problem}.", "use server.replicas: 1 or auto")
        return replicas

    @staticmethod
    def _reading_for(config: Config, group: list[ManagedServer]
                     ) -> Callable[[], GpuReading | None]:
        """The GPU as the replica about to join `group` should plan for it: the memory its
        running siblings hold counts as free, as the card's utilization is split between all
        of them. (`group` is read at each call: it has grown to the whole group by then.)"""
        env = launchers.server_env(config)
        own = len(group)

        def reading() -> GpuReading | None:
            gpu = read_gpu(env)
            if gpu is None:
                return None
            # A running vLLM holds utilization x total (its KV cache takes what the weights
            # and activations leave of its share).
            held = sum(int(float(s.vllm_args.get(autotune.UTILIZATION) or 0) * gpu.total_mib)
                       for i, s in enumerate(group) if i != own and s.status().pid is not None)
            return dataclasses.replace(gpu, used_mib=max(0, gpu.used_mib - held),
                                       free_mib=min(gpu.total_mib, gpu.free_mib + held))

        return reading

    # running

    def start(self) -> None:
        """Start every endpoint: on each GPU the first replica now, each next one once the one
        before is ready or has failed its start (on a thread per GPU)."""
        self._stopping.clear()
        if self._groups:
            assert self._mps is not None
            # A leftover replica would be a client of the MPS daemon about to be replaced.
            self._kill_stale_leftovers(every=self._mps.plan.use)
            self._mps.start()
            for group in self._groups:
                group[0].start()
                if len(group) > 1:
                    thread = threading.Thread(target=self._start_in_turn, args=(group,),
                                              name="ocrvl-server-starter", daemon=True)
                    self._starters.append(thread)
                    thread.start()
        else:
            for endpoint in self.endpoints:
                endpoint.start()

    def _start_in_turn(self, group: list[ManagedServer]) -> None:
        for before, server in itertools.pairwise(group):
            with self._cond:
                self._cond.wait_for(functools.partial(self._started, before))
            if self._stopping.is_set():
                return
            log.info("%s %s; starting %s", before.name, before.state.value, server.name)
            server.start()

    def _started(self, server: ManagedServer) -> bool:
        """Whether `server`'s start is over (ready or failed), or the set is stopping."""
        return server.state is not ServerState.STARTING or self._stopping.is_set()

    def _kill_stale_leftovers(self, every: bool = False) -> None:
        """End servers a SIGKILLed ocrvl left behind under names this set does not use
        (e.g. a third replica, before server.replicas went down to two); with `every`, those
        under its own names too (each replica would do it as it starts)."""
        ours = {pidfile_name(server.name) for server in self.endpoints}
        for pidfile in sorted(self.config.state_dir.glob(PIDFILE_GLOB)):
            if every or pidfile.name not in ours:
                kill_leftover(pidfile, self.config.server.stop_timeout)

    def stop(self) -> None:
        """Stop every endpoint (managed servers in parallel); bounded and idempotent."""
        self._halt()
        for starter in self._starters:
            starter.join()  # no replica may start behind the stops below
        stoppers = [threading.Thread(target=e.stop, name="ocrvl-server-stop", daemon=True)
                    for e in self.endpoints]
        for thread in stoppers:
            thread.start()
        for thread in stoppers:
            thread.join()  # each stop is bounded (ServerSupervisor.stop)
        if self._mps is not None:
            self._mps.stop()  # its clients, the replicas, are reaped by now

    def kill(self) -> None:
        """A forced stop: every managed server's group is SIGKILLed now."""
        self._halt()
        for endpoint in self.endpoints:
            endpoint.kill()
        if self._mps is not None:
            self._mps.kill()

    def _halt(self) -> None:
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()

    def __enter__(self) -> ServerSet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # what the daemon asks

    def is_ready(self) -> bool:
        """Whether any endpoint takes work now."""
        return any(e.is_ready() for e in self.endpoints)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until an endpoint is READY (True), every one FAILED, or stop() (False), or
        `timeout` (False)."""
        with self._cond:
            self._cond.wait_for(lambda: self.is_ready() or self._stopping.is_set() or all(
                e.state is ServerState.FAILED for e in self.endpoints), timeout)
        return self.is_ready()

    @property
    def error(self) -> ServerError | None:
        """The error of the first endpoint once every endpoint has given up with one (no
        endpoint can serve); None while any might."""
        errors = [e.error for e in self.endpoints]
        return errors[0] if all(errors) else None

    def status(self) -> list[ServerStatus]:
        """Each endpoint's status, in the order of `endpoints`."""
        return [e.status() for e in self.endpoints]

    def overall(self) -> ServerStatus:
        """One status for a one-line summary: the first ready endpoint's, else the first's."""
        statuses = self.status()
        return next((s for s in statuses if s.state is ServerState.READY), statuses[0])

    def _changed(self, status: ServerStatus) -> None:
        with self._cond:
            self._cond.notify_all()
        if self._on_change is not None:
            self._on_change(status)


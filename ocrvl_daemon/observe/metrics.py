"""The daemon's own Prometheus endpoint (`metrics.listen`).

prometheus_client serves it from a thread with a registry of its own. Nothing is counted
twice: each scrape reads the latest `DaemonState`, the value the main loop builds of its
own state about once a second; no lock, since a snapshot is replaced whole and never
changed in place.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ocrvl_daemon.config.model import MetricsConfig
from ocrvl_daemon.errors import ConfigError
from ocrvl_daemon.observe.daemon_state import DaemonState
from ocrvl_daemon.observe.stages import SATURATED
from ocrvl_daemon.server.gpu import MIB

log = logging.getLogger(__name__)


SERVER_STATES = ("stopped", "starting", "unreachable", "ready", "restarting", "failed")


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], DaemonState | None]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        if snap is None:  # the main loop has not taken its first snapshot yet
            return
        for name, value, text in (
            ("ocrvl_pages_done", snap.pages_done, "Pages recognised and checkpointed."),
            ("ocrvl_pages_failed", snap.pages_failed,
             "Pages given up on (placeholders in the output)."),
            ("ocrvl_pages_flagged", snap.pages_flagged,
             "Pages kept with a warning (cut off at the token limit)."),
        ):
            yield CounterMetricFamily(name, text, value=value)
        yield GaugeMetricFamily("ocrvl_pages_in_flight", "Pages at the engine now.",
                                value=snap.in_flight)
        yield GaugeMetricFamily("ocrvl_pages_per_second",
                                "Pages recognised per second over the last minute.",
                                value=snap.pages_per_s)
        documents = GaugeMetricFamily("ocrvl_documents", "Documents by state.",
                                      labels=["state"])
        for state, count in snap.documents().items():
            documents.add_metric([state], count)
        yield documents
        yield GaugeMetricFamily("ocrvl_engine_failed_starts",
                                "Engine workers that failed to start, in a row.",
                                value=snap.engine_failed_starts)
        hooks = CounterMetricFamily("ocrvl_hook_failures", "Hooks that failed or timed out.",
                                    labels=["hook"])
        for hook, count in snap.hook_failures.items():
            hooks.add_metric([hook], count)
        yield hooks
        states = GaugeMetricFamily("ocrvl_server_state",
                                  "1 for the model server's current state.",
                                  labels=["endpoint", "state"])
        restarts = CounterMetricFamily("ocrvl_server_restarts",
                                       "Restarts of the model server.", labels=["endpoint"])
        in_flight = GaugeMetricFamily("ocrvl_server_pages_in_flight",
                                      "Pages ocrvl has at the model server now.",
                                      labels=["endpoint"])
        rate = GaugeMetricFamily("ocrvl_server_pages_per_second",
                                 "Pages the model server recognised per second over the last "
                                 "minute.", labels=["endpoint"])
        hosts = GaugeMetricFamily("ocrvl_engine_host_info",
                                  "1 for each engine host on a cluster node: its server's "
                                  "endpoint, node and GPU(s).", labels=["endpoint", "node", "gpu"])
        for server in snap.endpoints:
            if server.node is not None:
                hosts.add_metric([server.url, server.node, server.gpu or ""], 1.0)
            for name in SERVER_STATES:
                states.add_metric([server.url, name], float(server.state == name))
            restarts.add_metric([server.url], server.restarts)
            in_flight.add_metric([server.url], server.in_flight)
            rate.add_metric([server.url], server.pages_per_s)
        yield states
        yield hosts
        yield restarts
        yield in_flight
        yield rate
        yield from _gpu_metrics(snap)
        stages = GaugeMetricFamily("ocrvl_stage_busy_ratio",
                                   "Share of each stage's capacity in use over the last minute "
                                   f"(the busiest, from {SATURATED}, sets the pace).",
                                   labels=["stage"])
        for stage, load in snap.stages.loads().items():
            stages.add_metric([stage.value], load)
        yield stages


def _gpu_metrics(snap: DaemonState) -> Iterator[Metric]:
    """The managed server's GPUs: how busy, how full, how much power (where reported)."""
    busy = GaugeMetricFamily("ocrvl_gpu_busy_percent",
                             "Share of the last sample period a kernel ran on the GPU.",
                             labels=["gpu"])
    used = GaugeMetricFamily("ocrvl_gpu_memory_used_bytes", "GPU memory in use.",
                             labels=["gpu"])
    total = GaugeMetricFamily("ocrvl_gpu_memory_total_bytes", "GPU memory in all.",
                              labels=["gpu"])
    power = GaugeMetricFamily("ocrvl_gpu_power_watts", "Power the GPU draws.", labels=["gpu"])
    for gpu in snap.gpus:
        label = [str(gpu.index)]
        used.add_metric(label, gpu.used_mib * MIB)
        total.add_metric(label, gpu.total_mib * MIB)
        if gpu.busy_pct is not None:
            busy.add_metric(label, gpu.busy_pct)
        if gpu.power_w is not None:
            power.add_metric(label, gpu.power_w)
    yield from (busy, used, total, power)


class MetricsEndpoint:
    """Serves `snapshot()` at http://`metrics.listen`/metrics; off when listen is null."""

    def __init__(self, config: MetricsConfig,
                 snapshot: Callable[[], DaemonState | None]) -> None:
        self.config = config
        self._snapshot = snapshot
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Listen, or raise a ConfigError naming `metrics.listen` (e.g. the port is taken)."""
        address = self.config.address
        if address is None:
            return
        host, port = address
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_SnapshotCollector(self._snapshot))
        try:
            self._server, self._thread = start_http_server(port, host, registry)
        except OSError as exc:
            raise ConfigError(
                f"Cannot serve metrics at metrics.listen = {self.config.listen!r}: "
                f"{exc.strerror or exc}.",
                "choose a free port in metrics.listen (is another ocrvl running?), or set "
                "it to null",
            ) from exc
        log.info("metrics at http://%s/metrics", self.config.listen)

    def stop(self) -> None:
        """Stop listening (a no-op when off)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

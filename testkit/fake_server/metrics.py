"""What the fake server reports about itself: vLLM's Prometheus ``/metrics`` and the counters
and time-weighted activity of ``/fake/stats``.

``POST /fake/reset`` starts the time-weighted statistics of ``/fake/stats`` (occupancy, mean and
max active) afresh; counters keep counting, so callers take differences.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from testkit.fake_server.server import FakeServer


class Activity:
    """Time-weighted count of active sequences, from the first request (or the last reset) on."""

    def __init__(self) -> None:
        self.first_request: float | None = None
        self._last_change = 0.0
        self._active = 0
        self._area = 0.0
        self._busy = 0.0
        self.max_active = 0

    def start(self) -> None:
        """Start the clock at the first request (later calls change nothing)."""
        if self.first_request is None:
            self.first_request = self._last_change = time.monotonic()

    def set(self, active: int) -> None:
        """Record a change in active sequences for the time-weighted statistics."""
        if self.first_request is not None:
            now = time.monotonic()
            elapsed = now - self._last_change
            self._area += self._active * elapsed
            if self._active > 0:
                self._busy += elapsed
            self._last_change = now
        self._active = active
        self.max_active = max(self.max_active, active)

    def reset(self) -> None:
        """Start the time-weighted statistics afresh (the maximum restarts from now)."""
        now = time.monotonic()
        self.first_request = now if self.first_request is not None else None
        self._last_change = now
        self._area = self._busy = 0.0
        self.max_active = self._active

    def measure(self, now: float) -> tuple[float, float, float]:
        """Active-sequence seconds, busy seconds and seconds since the first request, to ``now``."""
        area, busy = self._area, self._busy
        since_first = 0.0
        if self.first_request is not None:
            tail = now - self._last_change
            area += self._active * tail
            busy += tail if self._active > 0 else 0.0
            since_first = now - self.first_request
        return area, busy, since_first


def fake_stats(s: FakeServer) -> dict[str, Any]:
    """Counters and time-weighted occupancy, for tests and the benchmark (``/fake/stats``)."""
    now = time.monotonic()
    area, busy, since_first = s.activity.measure(now)
    mean_busy = area / busy if busy > 0 else 0.0
    return {
        "requests_received": s.received,
        "requests_completed": s.completed,
        "requests_failed": s.failed,
        "requests_hung": s.hung,
        "requests_aborted": s.aborted,
        "requests_by_digest": dict(s.by_digest),
        "running": s.num_running(),
        "waiting": len(s.batch.waiting),
        "max_active": s.activity.max_active,
        "max_waiting": s.batch.max_waiting,
        "mean_active": area / since_first if since_first > 0 else 0.0,
        "mean_active_busy": mean_busy,
        "occupancy": mean_busy / s.cfg.max_num_seqs,
        "busy_seconds": busy,
        "uptime": now - s.started,
        "preemptions": s.batch.preemptions,
        "prompt_tokens": s.prompt_tokens_total,
        "generation_tokens": s.generation_tokens(),
        "completion_tokens": s.completion_tokens_total,
        "kv_capacity_tokens": s.batch.kv_capacity,
        "engine_dead": s.dead,
        "engine_pid": s.engine.pid if s.engine is not None else None,
    }


class VllmMetrics(Collector):
    """Prometheus collector with vLLM's metric names, read from the server on each scrape."""

    def __init__(self, server: FakeServer) -> None:
        self.server = server

    def collect(self) -> Iterable[Metric]:
        s = self.server
        labels = ["model_name"]
        name = [s.cfg.served_model_names[0]]
        gauges = (
            ("vllm:num_requests_running", "Requests in model execution batches.", s.num_running()),
            ("vllm:num_requests_waiting", "Requests waiting to be processed.",
             len(s.batch.waiting)),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                s.batch.kv_usage(),
            ),
        )
        for metric, doc, value in gauges:
            gauge = GaugeMetricFamily(metric, doc, labels=labels)
            gauge.add_metric(name, value)
            yield gauge
        counters = (
            ("vllm:num_preemptions", "Cumulative number of preemptions.", s.batch.preemptions),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens_total),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                s.generation_tokens(),
            ),
        )
        for metric, doc, value in counters:
            counter = CounterMetricFamily(metric, doc, labels=labels)
            counter.add_metric(name, value)
            yield counter
        success = CounterMetricFamily(
            "vllm:request_success", "Count of successfully processed requests.",
            labels=["model_name", "finished_reason"],
        )  # fmt: skip
        for reason in ("stop", "length", "abort"):
            success.add_metric([*name, reason], s.finished[reason])
        yield success

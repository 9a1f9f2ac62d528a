"""Reading vLLM's Prometheus `/metrics`, in the background, for the concurrency controller.

`parse_metrics` turns the text into a `ServerMetrics`; `MetricsPoller` fetches it at most every
`interval` seconds on a small daemon thread, so the caller (the converter's tick) never waits
for the network. A server without `/metrics` (404, or anything that is not vLLM's text) just
yields no metrics; the poller then asks again only every `MISSING_RETRY_SECONDS`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 2.0
FETCH_TIMEOUT = 1.5
MISSING_RETRY_SECONDS = 60.0

# Sample names (with the counters' `_total`), old vLLM spellings second.
_GAUGES = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
_COUNTERS = {
    "preemptions_total": ("vllm:num_preemptions_total", "vllm:num_preemptions"),
    "generation_tokens_total": ("vllm:generation_tokens_total", "vllm:generation_tokens"),
}


@dataclass(frozen=True)
class ServerMetrics:
    """One scrape of the server's `/metrics` (None: the server does not export it)."""

    taken_at: float  # monotonic seconds
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None  # 0..1
    preemptions_total: float | None = None
    generation_tokens_total: float | None = None


def parse_metrics(text: str, taken_at: float) -> ServerMetrics:
    """vLLM's samples over their labels (one model, maybe several engines): counts add up;
    a KV cache usage is the fullest engine's (a share, and one full cache preempts)."""
    samples: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(float(sample.value))
    values: dict[str, float | None] = {}
    for field, names in (_GAUGES | _COUNTERS).items():
        combine = max if field == "kv_cache_usage" else sum
        values[field] = next((combine(samples[n]) for n in names if n in samples), None)
    return ServerMetrics(taken_at=taken_at, **values)


class MetricsPoller:
    """Fetches `<root>/metrics` in the background, at most every `interval` seconds.

    `target` returns (root URL, API key or None), read at each fetch so a reloaded
    configuration is followed. The thread starts at the first `latest(want=True)` and only
    fetches while someone keeps asking (no traffic while the daemon is idle).
    """

    def __init__(
        self,
        target: Callable[[], tuple[str, str | None]],
        interval: float = DEFAULT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._target = target
        self.interval = interval
        self._clock = clock
        self._latest: ServerMetrics | None = None
        self._asked_at = float("-inf")
        self._missing_until = float("-inf")
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def latest(self, want: bool = True) -> ServerMetrics | None:
        """The newest sample (maybe a few seconds old); asks for a fresh one when due."""
        now = self._clock()
        if want and now - self._asked_at >= self.interval and now >= self._missing_until:
            self._asked_at = now
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ocrvl-metrics", daemon=True)
                self._thread.start()
            self._wake.set()
        with self._lock:
            return self._latest

    def close(self) -> None:
        """Stop the thread (it is a daemon thread: forgetting this is harmless)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(FETCH_TIMEOUT + 1.0)

    def _run(self) -> None:
        with httpx.Client(timeout=FETCH_TIMEOUT) as client:
            while True:
                self._wake.wait()
                self._wake.clear()
                if self._stopping:
                    return
                sample = self._fetch(client)
                with self._lock:
                    self._latest = sample

    def _fetch(self, client: httpx.Client) -> ServerMetrics | None:
        root, key = self._target()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            response = client.get(root.rstrip("/") + "/metrics", headers=headers)
        except httpx.HTTPError as exc:
            log.debug("no metrics from %s: %s", root, exc)
            return None
        if response.status_code != 200:
            if response.status_code in (404, 401, 403):
                first = self._missing_until == float("-inf")
                self._missing_until = self._clock() + MISSING_RETRY_SECONDS
                (log.info if first else log.debug)(
                    "%s/metrics answered %s; adapting concurrency from completions only",
                    root,
                    response.status_code,
                )
            return None
        try:
            return parse_metrics(response.text, self._clock())
        except ValueError as exc:
            log.debug("unreadable metrics from %s: %s", root, exc)
            return None

"""Scraping the server's `/metrics` in the background, at most once per interval.

`MetricsPoller` fetches on a small daemon thread, so its callers (the converter's tick, the
supervisor's stall check) never wait for the network and share one scrape. A server without
`/metrics` (404, or anything that is not vLLM's text) just yields no metrics; the poller
then asks again only every `MISSING_RETRY_SECONDS`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ocrvl_daemon.server.probe import ServerMetrics, ServerProbe

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 2.0
FETCH_TIMEOUT = 1.5
MISSING_RETRY_SECONDS = 60.0


class MetricsPoller:
    """Fetches `/metrics` through `probe` in the background, at most every `interval` s.

    The thread starts at the first `latest(want=True)` and only fetches while someone keeps
    asking (no traffic while the daemon is idle). `probe` is used by this thread only.
    """

    def __init__(
        self,
        probe: ServerProbe,
        interval: float = DEFAULT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._probe = probe
        self.interval = interval
        self._clock = clock
        self._wake = threading.Event()
        self._stopping = False
        # _lock protects the four fields below: callers on several threads (the converter's
        # loop, the supervisor's) ask, and the poller's thread writes the results.
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._asked_at = float("-inf")
        self._missing_until = float("-inf")
        self._latest: ServerMetrics | None = None

    def latest(self, want: bool = True) -> ServerMetrics | None:
        """The newest sample (maybe a few seconds old); asks for a fresh one when due."""
        now = self._clock()
        with self._lock:
            if want and now - self._asked_at >= self.interval and now >= self._missing_until:
                self._asked_at = now
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="ocrvl-metrics",
                                                    daemon=True)
                    self._thread.start()
                self._wake.set()
            return self._latest

    def close(self) -> None:
        """Stop the thread and close the probe (a daemon thread: forgetting this is harmless)."""
        self._stopping = True
        self._wake.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(FETCH_TIMEOUT + 1.0)
        if thread is None or not thread.is_alive():
            self._probe.close()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stopping:
                return
            sample = self._fetch()
            with self._lock:
                self._latest = sample

    def _fetch(self) -> ServerMetrics | None:
        probe = self._probe
        sample = probe.metrics(self._clock())
        if probe.metrics_status in (404, 401, 403):
            with self._lock:
                first = self._missing_until == float("-inf")
                self._missing_until = self._clock() + MISSING_RETRY_SECONDS
            (log.info if first else log.debug)(
                "%s/metrics answered %s; adapting concurrency from completions only",
                probe.root,
                probe.metrics_status,
            )
        return sample

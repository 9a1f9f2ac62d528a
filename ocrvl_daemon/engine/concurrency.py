"""How many requests may be in flight at the server: a search for the most work per second.

The bound counts requests, as the server and the workers' request gates do. Without layout
detection a page is one request; with it, a request per block (often 10-40): the converter
says how many a page makes (`requests_per_page`), and pages in flight and waiting are counted
in requests against the bound.

More is not better: on real vLLM, throughput peaks at some number of requests in flight and
falls beyond it, as image prefill crowds out decoding (figures in bench/RESULTS.md).
`ConcurrencyController` therefore searches for the limit that maximises throughput:

* Throughput is measured over windows, and only while demand exceeds the limit (pages are
  waiting and their requests in flight reach `limit`): with too little work, the limit says
  nothing. After a
  change the controller lets the server settle before it starts a window. With the server's
  `/metrics` the score is generated tokens per second between two scrapes (it reacts at once
  to a change of batch size); without, it is pages completed per second over at least the
  pages of `limit` requests (one turnover of the work in flight).
* The search is a one-dimensional pattern search in log space: from the current best limit
  try `best * f` (then `best / f`); a probe that beats the best by more than `IMPROVEMENT`
  becomes the best and the search goes on in that direction; when neither direction helps,
  `f` shrinks (1.5 -> 1.22) and below `MIN_FACTOR` the limit holds at the best. The search
  starts at the upper bound, `max_concurrency`: a book of a few hundred pages is over before
  a search could climb far, so the bound a user sets is the bound a book gets (64 by
  default, near where real vLLM peaks on a consumer card; bench/RESULTS.md has the curves).
  At the upper bound the search
  cannot look up and the peak is most likely at or above it; the curve is steep below its
  peak, so the first step down is small (`MIN_FACTOR`). If it loses, one full step down
  follows, for a bound set far above the peak; the curve is gentle there, so a bound more
  than a full step above a flat peak may stay where it is. Steps keep their size while
  they win. A
  limit that lost against the current best is not probed again. A probe runs only while
  `PROBE_BACKLOG` times the limit in requests is waiting: on a short queue it would cost more
  than whatever it could find (the search resumes when a bigger queue comes).
* Holding, it keeps measuring; when throughput at the same limit shifts by more than
  `SHIFT` (two windows in a row) the workload changed and the search starts again.
* Safety first, throughput second: any new preemption or a KV cache above `KV_FULL`
  multiplies the limit by `BACKOFF` at once (and the search may not go above it again until
  the next re-search); while the server keeps requests waiting (`num_requests_waiting > 0`
  in consecutive scrapes), its running count is its cap, and the limit may not exceed that
  cap by more than a small feed margin (more would only queue at the server).
* The limit never leaves [minimum, maximum]; with `adaptive` off it is `maximum`, fixed.

The object is pure and deterministic: time and metrics come in through `observe`, so tests
drive it with a synthetic server.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from ocrvl_daemon.server.probe import ServerMetrics

log = logging.getLogger(__name__)

START_FACTOR = 1.5
MIN_FACTOR = 1.15
IMPROVEMENT = 0.05  # a probe must beat the best by this fraction to be taken
SHIFT = 0.25  # throughput at the held limit moving by this much means a new workload
SHIFT_WINDOWS = 2
BACKOFF = 0.75
KV_FULL = 0.95
WAITING_SAMPLES = 2  # consecutive scrapes with requests waiting before the cap counts
SETTLE_SECONDS = 2.0
WINDOW_SECONDS = 4.0
MIN_WINDOW_PAGES = 16  # completions-based windows (no metrics) count at least this many
PROBE_BACKLOG = 3  # probe only with this many limits' worth of pages waiting


def feed_margin(cap: int) -> int:
    """How far above the server's running cap the limit may go (pages ready to be admitted)."""
    return max(2, cap // 8)


@dataclass
class _Window:
    started: float
    completed: int
    token_at: float | None = None
    tokens: float | None = None


class ConcurrencyController:
    """The in-flight bound; see the module docstring for how it moves."""

    def __init__(
        self,
        minimum: int,
        maximum: int,
        adaptive: bool,
        *,
        initial: int | None = None,
        settle_seconds: float = SETTLE_SECONDS,
        window_seconds: float = WINDOW_SECONDS,
    ) -> None:
        self.minimum = minimum
        self.maximum = maximum
        self.adaptive = adaptive
        self.settle_seconds = settle_seconds
        self.window_seconds = window_seconds
        start = maximum if initial is None else initial
        self.limit = self._clamp(start) if adaptive else maximum
        self.phase = "search"  # or "hold"
        self.rate: float | None = None  # last measured pages/s
        self.server_cap: int | None = None
        self._ceiling = maximum  # lowered by back-offs until the next re-search
        self._best_limit = self.limit
        self._best_score: float | None = None
        self._best_rate: float | None = None
        self._factor = START_FACTOR
        self._direction = 1
        self._moved = False
        self._tried_other = False
        self._lost: set[int] = set()  # limits that lost against the current best
        self._changed_at: float | None = None
        self._window: _Window | None = None
        self._saturated = False
        self._sample_at: float | None = None
        self._preemptions: float | None = None
        self._waiting_streak = 0
        self._waiting_running = 0.0
        self._backoff_at = -math.inf
        self._shifts = 0
        self._pages_per_token: float | None = None
        self._server_load: float | None = None  # running + waiting at the last scrape
        self._backlog = 0.0  # requests waiting to be sent
        self._per_page = 1.0  # requests a page makes

    # --- public -------------------------------------------------------------------------

    def observe(
        self,
        now: float,
        completed: int,
        in_flight: int,
        backlog: int,
        metrics: ServerMetrics | None = None,
        requests_per_page: float = 1.0,
    ) -> None:
        """Feed one tick: total pages completed so far, pages in flight, pages waiting to be
        sent, the newest server metrics (the same sample may come many times), and how many
        requests a page makes (its blocks, with layout detection)."""
        if not self.adaptive:
            self.limit = self.maximum
            return
        self.limit = self._clamp(self.limit)
        self._per_page = max(1.0, requests_per_page)
        self._backlog = backlog * self._per_page
        saturated = backlog > 0 and in_flight * self._per_page >= self.limit
        if saturated and not self._saturated:
            self._changed_at = now  # the batch ramps up again: settle first
            self._window = None
        self._saturated = saturated
        fresh = metrics is not None and metrics.taken_at != self._sample_at
        if fresh and metrics is not None:
            self._sample_at = metrics.taken_at
            if self._on_metrics(now, metrics, saturated):
                return
        if not saturated:
            self._window = None
            return
        self._measure(now, completed, metrics if fresh else None)

    def set_bounds(self, minimum: int, maximum: int) -> None:
        """New bounds from a reloaded config. A new maximum is where the search starts again,
        as at start-up; otherwise the limit only moves into the new range."""
        new_maximum = maximum != self.maximum
        self.minimum, self.maximum = minimum, maximum
        if not (self.adaptive and new_maximum):
            self.limit = self._clamp(self.limit)
            return
        old, self._ceiling = self.limit, maximum
        self._restart_search(self._upper(), None, direction=-1, factor=START_FACTOR)
        log.info("concurrency %d -> %d: max_concurrency is now %d", old, self.limit, maximum)

    # --- safety -------------------------------------------------------------------------

    def _on_metrics(self, now: float, m: ServerMetrics, saturated: bool) -> bool:
        """Back off or cap on what the server says; True if the limit moved."""
        preempted = (
            m.preemptions_total is not None
            and self._preemptions is not None
            and m.preemptions_total > self._preemptions
        )
        if m.preemptions_total is not None:
            self._preemptions = m.preemptions_total
        if m.running is not None:
            self._server_load = m.running + (m.waiting or 0.0)
        kv_full = m.kv_cache_usage is not None and m.kv_cache_usage > KV_FULL
        if (preempted or kv_full) and now - self._backoff_at >= self.settle_seconds:
            self._backoff_at = now
            old, new = self.limit, self._clamp(math.floor(self.limit * BACKOFF))
            self._ceiling = new
            if new == old:
                return False  # already at the minimum
            why = "preemptions" if preempted else f"KV cache {m.kv_cache_usage:.0%} full"
            self._restart_search(new, now, direction=-1, factor=math.sqrt(START_FACTOR))
            log.info("concurrency %d -> %d: backing off (%s)", old, new, why)
            return True
        # A request that arrives mid-step waits for the next one: a queue no longer than the
        # feed margin is what a fed batch looks like, not a cap on running requests.
        running = int(m.running or 0)
        if m.waiting is not None and m.waiting > feed_margin(running) and saturated:
            self._waiting_streak += 1
            self._waiting_running = max(self._waiting_running, running)
            if self._waiting_streak >= WAITING_SAMPLES and self._waiting_running >= 1:
                cap = int(self._waiting_running)
                if cap != self.server_cap:
                    self.server_cap = cap
                    log.info("the server runs at most %d requests at once", cap)
                top = self._upper()
                if self.limit > top:
                    old = self.limit
                    self._restart_search(top, now, direction=-1, factor=math.sqrt(START_FACTOR))
                    log.info(
                        "concurrency %d -> %d: the server keeps requests waiting beyond %d running",
                        old,
                        self.limit,
                        cap,
                    )
                    return True
        elif m.waiting is not None:
            self._waiting_streak = 0
            self._waiting_running = 0.0
        return False

    # --- measuring ----------------------------------------------------------------------

    def _measure(self, now: float, completed: int, sample: ServerMetrics | None) -> None:
        if self._changed_at is None:
            self._changed_at = now
        if now - self._changed_at < self.settle_seconds:
            return
        win = self._window
        if win is None and self._server_load is not None and self._server_load < 0.9 * self.limit:
            return  # pages are still being rendered: the server does not have them all yet
        if win is None:
            win = self._window = _Window(now, completed)
            return  # the sample that arrived now may predate the window
        if sample is not None and sample.generation_tokens_total is not None:
            if win.token_at is None:
                win.token_at, win.tokens = sample.taken_at, sample.generation_tokens_total
                win.started, win.completed = now, completed
                return
            span = sample.taken_at - win.token_at
            if span < self.window_seconds:
                return
            pages = completed - win.completed
            tokens = sample.generation_tokens_total - (win.tokens or 0.0)
            if pages > 0 and tokens > 0:
                ppt = pages / tokens
                self._pages_per_token = (
                    ppt
                    if self._pages_per_token is None
                    else 0.7 * self._pages_per_token + 0.3 * ppt
                )
            score = tokens / span
            rate = score * (self._pages_per_token or 0.0)
            if not rate:
                rate = pages / max(now - win.started, 1e-9)
            self._judge(now, score, rate)
            return
        if win.token_at is not None:
            if now - win.started > 4 * self.window_seconds:
                self._window = None  # the scrapes stopped coming: start over
            return  # a token window waits for its closing scrape
        pages = completed - win.completed
        span = now - win.started
        turnover = self.limit / self._per_page  # pages whose requests fill the bound once
        if span >= self.window_seconds and pages >= max(MIN_WINDOW_PAGES, turnover):
            self._judge(now, pages / span, pages / span)

    # --- searching ----------------------------------------------------------------------

    def _judge(self, now: float, score: float, rate: float) -> None:
        self.rate = rate
        self._window = None
        if self.phase == "hold":
            self._hold(now, score, rate)
            return
        if self._best_score is None or self.limit == self._best_limit:
            self._best_limit, self._best_score, self._best_rate = self.limit, score, rate
        elif score > self._best_score * (1 + IMPROVEMENT):
            log.info(
                "concurrency %d -> %d: %.2f -> %.2f pages/s",
                self._best_limit,
                self.limit,
                self._best_rate or 0.0,
                rate,
            )
            self._best_limit, self._best_score, self._best_rate = self.limit, score, rate
            self._moved = True
            self._lost.clear()
        else:
            self._lost.add(self.limit)
            log.debug(
                "concurrency %d: %.2f pages/s, no better than %.2f at %d",
                self.limit,
                rate,
                self._best_rate or 0.0,
                self._best_limit,
            )
            if self.limit == self._small_step_down() and self._factor == START_FACTOR:
                pass  # only the cautious first step lost: a full step down comes next
            elif self._moved or self._tried_other:
                self._shrink()
            else:
                self._direction, self._tried_other = -self._direction, True
        self._propose(now, rate)

    def _propose(self, now: float, rate: float) -> None:
        if self._backlog < PROBE_BACKLOG * self._best_limit:
            if self.limit != self._best_limit:
                self._set(self._best_limit, now)
            return  # not worth a probe: measure again at the best
        upper = self._upper()
        while self._factor >= MIN_FACTOR:
            candidate = min(upper, self._clamp(round(self._best_limit * self._step())))
            if candidate == self._best_limit or candidate in self._lost:
                if self._moved or self._tried_other:
                    self._shrink()
                else:
                    self._direction, self._tried_other = -self._direction, True
                continue
            self._set(candidate, now)
            log.info(
                "concurrency %d -> %d: probing (%.2f pages/s at %d)",
                self._best_limit,
                candidate,
                self._best_rate or rate,
                self._best_limit,
            )
            return
        self.phase = "hold"
        self._shifts = 0
        if self.limit != self._best_limit:
            log.info(
                "concurrency %d -> %d: %.2f -> %.2f pages/s (holding)",
                self.limit,
                self._best_limit,
                rate,
                self._best_rate or 0.0,
            )
            self._set(self._best_limit, now)
        else:
            log.info("concurrency holds at %d (%.2f pages/s)", self.limit, self._best_rate or rate)

    def _step(self) -> float:
        if self._direction > 0:
            return self._factor
        if self._small_step_down() not in (None, *self._lost):
            return 1 / MIN_FACTOR
        return 1 / self._factor

    def _small_step_down(self) -> int | None:
        """From the upper bound, before any win, the first probe down is small: the peak is
        most likely at or above the bound. None when the search is elsewhere."""
        if self._moved or self._best_limit < self._upper():
            return None
        return self._clamp(round(self._best_limit / MIN_FACTOR))

    def _hold(self, now: float, score: float, rate: float) -> None:
        best = self._best_score or score
        if abs(score - best) > SHIFT * best:
            self._shifts += 1
            if self._shifts >= SHIFT_WINDOWS:
                log.info(
                    "throughput at concurrency %d moved %.2f -> %.2f pages/s; searching again",
                    self.limit,
                    self._best_rate or 0.0,
                    rate,
                )
                self._ceiling = self.maximum
                self.server_cap = None
                self._restart_search(self.limit, now, direction=1, factor=START_FACTOR)
                self._best_score, self._best_rate = score, rate
                self._propose(now, rate)
            return
        self._shifts = 0
        self._best_score = 0.8 * best + 0.2 * score
        self._best_rate = 0.8 * (self._best_rate or rate) + 0.2 * rate

    def _restart_search(
        self, limit: int, now: float | None, direction: int, factor: float
    ) -> None:
        self.phase = "search"
        self._best_limit, self._best_score, self._best_rate = limit, None, None
        self._direction, self._factor = direction, factor
        self._moved = self._tried_other = False
        self._lost.clear()
        self._set(limit, now)

    def _shrink(self) -> None:
        self._factor = math.sqrt(self._factor)
        self._direction = 1
        self._moved = self._tried_other = False

    # --- bounds -------------------------------------------------------------------------

    def _set(self, limit: int, now: float | None) -> None:
        self.limit = self._clamp(limit)
        self._changed_at = now  # None: the next tick starts the settling
        self._window = None

    def _clamp(self, value: int) -> int:
        return max(self.minimum, min(self.maximum, int(value)))

    def _upper(self) -> int:
        top = min(self.maximum, self._ceiling)
        if self.server_cap is not None:
            top = min(top, self.server_cap + feed_margin(self.server_cap))
        return max(self.minimum, top)

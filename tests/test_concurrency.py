"""The adaptive concurrency controller against synthetic servers: fast and deterministic."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from ocrvl_daemon.config.file import validate_config
from ocrvl_daemon.engine.concurrency import ConcurrencyController, feed_margin
from ocrvl_daemon.server.metrics_poller import MetricsPoller
from ocrvl_daemon.server.probe import ServerMetrics, ServerProbe, parse_metrics

TOKENS_PER_PAGE = 1000.0


def peaked(peak: int = 64, top: float = 11.2, fall: float = 0.12) -> Callable[[int], float]:
    """Pages/s against concurrency shaped like real vLLM: steep below the peak, gentle above
    (`fall`: the share lost per doubling past the peak)."""

    def curve(n: int) -> float:
        if n <= peak:
            return top * (n / peak) ** 0.6
        return top * (1 - fall * math.log2(n / peak))

    return curve


class SyntheticServer:
    """Drives a controller: time in `dt` steps, a scrape every `scrape` seconds. Each page is
    `blocks` requests (layout detection on): `curve` is then requests/s, and the converter keeps
    only the pages with requests at the server and a ready margin of 4 in flight."""

    def __init__(
        self,
        ctl: ConcurrencyController,
        curve: Callable[[int], float],
        *,
        metrics: bool = True,
        scrape: float = 2.0,
        dt: float = 0.1,
    ) -> None:
        self.ctl, self.curve, self.metrics, self.scrape, self.dt = ctl, curve, metrics, scrape, dt
        self.now = 0.0
        self.completed = 0.0
        self.tokens = 0.0
        self.preemptions = 0
        self.kv = 0.2
        self.waiting_when: Callable[[int], tuple[float, float]] | None = None
        self.backlog = 10_000
        self.sample: ServerMetrics | None = None
        self.next_scrape = 0.0
        self.limits: list[int] = []
        self.blocks = 1

    def run(self, seconds: float) -> None:
        end = self.now + seconds
        while self.now < end:
            self.now += self.dt
            limit = self.ctl.limit
            rate = self.curve(limit)
            self.completed += rate * self.dt / self.blocks
            self.tokens += rate * TOKENS_PER_PAGE * self.dt
            if self.metrics and self.now >= self.next_scrape:
                self.next_scrape = self.now + self.scrape
                running, waiting = float(limit), 0.0
                if self.waiting_when is not None:
                    running, waiting = self.waiting_when(limit)
                self.sample = ServerMetrics(
                    taken_at=self.now,
                    running=running,
                    waiting=waiting,
                    kv_cache_usage=self.kv,
                    preemptions_total=float(self.preemptions),
                    generation_tokens_total=self.tokens,
                )
            in_flight = limit if self.blocks == 1 else math.ceil(limit / self.blocks) + 4
            in_flight = in_flight if self.backlog > 0 else 0
            self.ctl.observe(self.now, int(self.completed), in_flight, self.backlog, self.sample,
                             requests_per_page=self.blocks)
            lo, hi = self.ctl.minimum, self.ctl.maximum
            assert lo <= self.ctl.limit <= hi
            self.limits.append(self.ctl.limit)


@pytest.mark.quick
@pytest.mark.parametrize("metrics", [True, False])
@pytest.mark.parametrize("start", [8, 64, 200])
def test_climbs_to_the_peak_and_settles_near_it(start: int, metrics: bool) -> None:
    ctl = ConcurrencyController(4, 256, True, initial=start)
    srv = SyntheticServer(ctl, peaked(64), metrics=metrics)
    srv.run(400)
    assert ctl.phase == "hold"
    assert 48 <= ctl.limit <= 90, srv.limits[::50]
    assert peaked(64)(ctl.limit) >= 0.93 * peaked(64)(64)
    held = ctl.limit
    srv.run(200)
    assert ctl.limit == held  # a steady workload keeps the limit


@pytest.mark.quick
@pytest.mark.parametrize("metrics", [True, False])
def test_with_30_blocks_a_page_the_bound_is_searched_for_in_requests(metrics: bool) -> None:
    """A page of 30 blocks is 30 requests: the few pages in flight fill the bound, so the
    search measures and climbs to the peak as with pages sent whole."""
    ctl = ConcurrencyController(4, 256, True, initial=8)
    # Short blocks: 60 requests/s at the peak, 2 pages/s.
    srv = SyntheticServer(ctl, peaked(64, 60.0), metrics=metrics)
    srv.blocks = 30
    srv.backlog = 1_000
    srv.run(600)
    assert ctl.rate is not None, "the bound was never measured: pages were counted as requests"
    assert ctl.phase == "hold" and 48 <= ctl.limit <= 90, srv.limits[::100]


@pytest.mark.quick
def test_with_30_blocks_a_page_the_bound_stays_within_the_servers_running_cap() -> None:
    ctl = ConcurrencyController(4, 256, True, initial=128)
    srv = SyntheticServer(ctl, lambda n: 11.2 * min(n, 48) / 48)
    srv.blocks = 30
    srv.waiting_when = lambda n: (float(min(n, 48)), float(max(0, n - 48)))
    srv.run(400)
    assert ctl.server_cap == 48
    assert max(srv.limits[100:]) <= 48 + feed_margin(48)


@pytest.mark.quick
def test_default_start_at_the_maximum_probes_down_and_comes_back() -> None:
    ctl = ConcurrencyController(4, 64, True)
    assert ctl.limit == 64
    srv = SyntheticServer(ctl, peaked(64))
    srv.run(200)
    assert ctl.phase == "hold"
    assert ctl.limit == 64
    # At the bound the peak is most likely at or above it: a small step down first, then
    # a full one (a bound set far above the peak), then one between; no more.
    probes = {round(64 / 1.15), round(64 / 1.5), round(64 / math.sqrt(1.5))}
    assert set(srv.limits) == {64} | probes, sorted(set(srv.limits))


@pytest.mark.quick
def test_from_the_maximum_a_winning_small_step_down_goes_on_to_a_lower_peak() -> None:
    ctl = ConcurrencyController(4, 64, True)
    srv = SyntheticServer(ctl, peaked(24, 6.0, fall=0.3))  # e.g. prefill-bound past 24
    srv.run(400)
    assert ctl.phase == "hold"
    assert 16 <= ctl.limit <= 36, srv.limits[::50]


@pytest.mark.quick
def test_a_short_queue_is_not_worth_a_probe_and_a_long_one_is() -> None:
    ctl = ConcurrencyController(4, 256, True, initial=64)
    srv = SyntheticServer(ctl, peaked(128))
    srv.backlog = 100  # under three limits' worth of pages: a probe would not pay off
    srv.run(120)
    assert set(srv.limits) == {64}
    assert ctl.rate is not None  # it does measure
    srv.backlog = 10_000
    srv.run(300)
    assert ctl.limit > 64, "with a long queue the search climbs towards the peak at 128"


@pytest.mark.quick
def test_finds_a_low_peak_from_a_bound_set_far_above_it() -> None:
    ctl = ConcurrencyController(1, 256, True)
    srv = SyntheticServer(ctl, peaked(16, 4.0))
    srv.run(400)
    assert ctl.phase == "hold"
    assert 11 <= ctl.limit <= 24


@pytest.mark.quick
def test_never_leaves_bounds_and_non_adaptive_is_fixed() -> None:
    ctl = ConcurrencyController(20, 30, True)
    srv = SyntheticServer(ctl, peaked(64))
    srv.run(300)  # the run loop asserts the bounds at every tick
    assert ctl.limit == 30
    fixed = ConcurrencyController(4, 48, False)
    srv = SyntheticServer(fixed, peaked(8))
    srv.preemptions = 0
    srv.run(100)
    srv.preemptions, srv.kv = 5, 0.99
    srv.run(50)
    assert set(srv.limits) == {48}


@pytest.mark.quick
def test_no_measuring_without_demand() -> None:
    ctl = ConcurrencyController(4, 256, True, initial=16)
    srv = SyntheticServer(ctl, peaked(64))
    srv.backlog = 0  # never more work than the limit
    srv.run(300)
    assert set(srv.limits) == {16}
    assert ctl.rate is None


@pytest.mark.quick
def test_backs_off_on_preemptions_and_stays_below() -> None:
    ctl = ConcurrencyController(4, 256, True, initial=64)
    srv = SyntheticServer(ctl, peaked(64))
    srv.run(300)
    before = ctl.limit
    srv.preemptions += 3
    srv.run(2.0)
    assert ctl.limit == math.floor(before * 0.75)
    srv.run(300)
    assert ctl.limit <= math.floor(before * 0.75)


@pytest.mark.quick
def test_backs_off_when_the_kv_cache_is_nearly_full() -> None:
    ctl = ConcurrencyController(4, 256, True, initial=128)
    srv = SyntheticServer(ctl, peaked(256))  # throughput alone would say "more"
    srv.kv = 0.97
    srv.run(1.0)
    assert ctl.limit == 96
    srv.run(10)
    assert ctl.limit <= 72
    srv.kv = 0.5
    srv.run(300)
    assert ctl.limit <= 72  # no growth back above the back-off point in this search


@pytest.mark.quick
def test_backoff_never_goes_below_the_minimum() -> None:
    ctl = ConcurrencyController(10, 64, True, initial=12)
    srv = SyntheticServer(ctl, peaked(64))
    srv.kv = 0.99
    srv.run(60)
    assert min(srv.limits) == 10


@pytest.mark.quick
def test_does_not_grow_past_the_servers_running_cap() -> None:
    ctl = ConcurrencyController(4, 256, True, initial=64)
    srv = SyntheticServer(ctl, lambda n: 11.2 * min(n, 48) / 48)
    srv.waiting_when = lambda n: (float(min(n, 48)), float(max(0, n - 48)))
    srv.run(400)
    assert ctl.server_cap == 48
    assert ctl.limit <= 48 + feed_margin(48)
    assert max(srv.limits[50:]) <= 48 + feed_margin(48)


@pytest.mark.quick
def test_a_request_waiting_for_the_next_step_is_not_a_cap() -> None:
    ctl = ConcurrencyController(4, 256, True, initial=64)
    srv = SyntheticServer(ctl, peaked(128))
    # At every scrape one request has just arrived and waits for the server's next step.
    srv.waiting_when = lambda n: (n - 1.0, 1.0)
    srv.run(400)
    assert ctl.server_cap is None, "a fed batch was taken for a cap on running requests"
    assert max(srv.limits) > 64 + feed_margin(64), "the search never went past the false cap"


@pytest.mark.quick
def test_searches_again_when_the_workload_changes() -> None:
    ctl = ConcurrencyController(4, 256, True, initial=64)
    srv = SyntheticServer(ctl, peaked(64))
    srv.run(300)
    assert ctl.phase == "hold" and 48 <= ctl.limit <= 90
    srv.curve = peaked(160, 30.0)  # e.g. short outputs: the peak moves up, throughput jumps
    srv.run(600)
    assert ctl.phase == "hold"
    assert ctl.limit >= 110, srv.limits[-3000::200]


@pytest.mark.quick
def test_reconfigured_bounds_are_respected() -> None:
    ctl = ConcurrencyController(4, 256, True, initial=64)
    srv = SyntheticServer(ctl, peaked(64))
    srv.run(100)
    ctl.set_bounds(4, 32)
    srv.run(20)
    assert max(srv.limits[-200:]) <= 32


@pytest.mark.quick
def test_the_search_starts_at_max_concurrency() -> None:
    """A book of a few hundred pages is over before a search could climb: the bound a user
    sets is the bound a book gets from its first page."""
    ctl = ConcurrencyController(4, 128, True)
    assert ctl.limit == 128, "a raised max_concurrency was not used from the start"
    srv = SyntheticServer(ctl, peaked(160))
    srv.backlog = 200  # a short book: no probe pays off
    srv.run(120)
    assert set(srv.limits) == {128}


@pytest.mark.quick
def test_a_max_concurrency_raised_on_reload_is_used_at_once() -> None:
    ctl = ConcurrencyController(4, 64, True)
    srv = SyntheticServer(ctl, peaked(160))
    srv.run(100)
    assert ctl.limit == 64
    ctl.set_bounds(4, 128)
    assert ctl.limit == 128, "a reload that raised max_concurrency left the old bound"
    srv.run(200)
    assert ctl.phase == "hold" and ctl.limit == 128
    ctl.set_bounds(8, 128)  # only the minimum moved: the held bound stays
    assert ctl.limit == 128 and ctl.phase == "hold"


@pytest.mark.quick
def test_parse_vllm_metrics() -> None:
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 12.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 3.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="m"} 2.0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25\n'
        "# TYPE vllm:num_preemptions counter\n"
        'vllm:num_preemptions_total{model_name="m"} 7.0\n'
        "# TYPE vllm:generation_tokens counter\n"
        'vllm:generation_tokens_total{model_name="m"} 12345.0\n'
    )
    m = parse_metrics(text, 1.0)
    assert (m.running, m.waiting, m.kv_cache_usage) == (15.0, 2.0, 0.5)
    assert (m.preemptions_total, m.generation_tokens_total) == (7.0, 12345.0)
    assert parse_metrics("", 2.0).running is None


def test_poller_reads_the_fake_servers_metrics_and_survives_404() -> None:
    from testkit.fake_server import FakeServerConfig, InProcessFakeServer
    from testkit.harness import wait_until

    with InProcessFakeServer(FakeServerConfig(port=0, access_log=False)) as srv:
        def probe(root: str) -> ServerProbe:
            server = {"mode": "external", "url": root + "/v1"}
            return ServerProbe(validate_config({"server": server}))

        poller = MetricsPoller(probe(srv.url), interval=0.05)
        try:
            sample = wait_until(lambda: poller.latest(), 5, what="a metrics sample")
            assert sample.running == 0 and sample.generation_tokens_total == 0
        finally:
            poller.close()
        missing = MetricsPoller(probe(srv.url + "/nothing"), interval=0.05)
        try:
            for _ in range(20):
                assert missing.latest() is None
                wait_until(lambda: True, 0.1)
        finally:
            missing.close()


@pytest.mark.quick
def test_no_window_while_the_server_has_not_received_the_work_yet() -> None:
    """At a cold start the client is still rendering pages: the server runs far fewer than the
    limit, and a window measured then would make the limit look bad."""
    ctl = ConcurrencyController(4, 256, True, initial=64)
    srv = SyntheticServer(ctl, peaked(64))
    srv.waiting_when = lambda n: (n / 3, 0.0)
    srv.run(60)
    assert ctl.rate is None and set(srv.limits) == {64}
    srv.waiting_when = None
    srv.run(300)
    assert ctl.phase == "hold" and 48 <= ctl.limit <= 90

"""The server endpoints pages go to: each one's adaptive bound, answers and outages.

The plan (`plan.plan`) picks the pages and gives each to the usable endpoint with the most
room: the fewest pages in flight relative to its own adaptive bound (each endpoint has its
`ConcurrencyController`, fed by its own `/metrics`). Which endpoint has a page is recorded on
the page itself (`core.page.SentPage`). An endpoint that is not ready, or whose page came back
"server down", is left out; the pages it had go back to their documents for the others
(`reclaim`), and an answer it still sends for one of them is ignored
(`decide.is_awaited`): each page is checkpointed once. It rejoins once ready again. An outage
is logged once when it begins and once when the endpoint answers again, with the requests
that failed in between.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.document import Document
from ocrvl_daemon.engine.concurrency import ConcurrencyController
from ocrvl_daemon.observe.rate import RateMeter
from ocrvl_daemon.server.probe import ServerMetrics
from ocrvl_daemon.server.supervisor import ServerStatus

log = logging.getLogger(__name__)

# An endpoint whose request failed as "server down" takes no pages for this long: its own
# probe may take longer to notice it is gone, and its pages would fail again at once.
SUSPEND_SECONDS = 5.0
# How quickly the requests a page makes (its blocks) follow the pages answered: a book's
# pages differ, and a new document may be laid out quite differently.
PER_PAGE_WEIGHT = 0.2


class ServerHandle(Protocol):
    """What the converter needs from a server supervisor (one per endpoint)."""

    @property
    def name(self) -> str:
        """A short name for logs and status."""
        ...

    @property
    def url(self) -> str:
        """Its OpenAI base URL, where pages are sent."""
        ...

    def status(self) -> ServerStatus:
        """A snapshot for status lines."""
        ...

    def is_ready(self) -> bool:
        """Whether requests may be sent now."""
        ...

    def note_progress(self, in_flight: int, completed_total: int) -> None:
        """Client-side progress, for hang detection."""
        ...

    def metrics(self, want: bool = True) -> ServerMetrics | None:
        """The newest `/metrics` sample, for the concurrency search (`want`: fetch when due)."""
        ...

    def note_unreachable(self, reason: str) -> None:
        """A request found no server there (`reason`): it is down now, not once a probe says."""
        ...


@dataclass(frozen=True)
class EndpointLoad:
    """One endpoint's share of the work, for status lines and /metrics."""

    url: str
    name: str
    in_flight: int
    pages_per_s: float
    bound: int


class Endpoint:
    """One server's bookkeeping: its answers, bound and suspension."""

    def __init__(self, handle: ServerHandle, config: Config) -> None:
        self.handle = handle
        self.concurrency = ConcurrencyController(
            config.pipeline.min_concurrency,
            config.pipeline.max_concurrency,
            config.pipeline.adaptive_concurrency,
        )
        self.answered = 0  # requests that came back (for hang detection)
        self.answers = RateMeter()  # pages it recognised
        self.suspended_until = 0.0
        # While its requests find no server or fail (HTTP 5xx): since when (monotonic), and
        # how many failed; said once when it begins and once when it answers again.
        self.down_since: float | None = None
        self.failed_while_down = 0

    @property
    def url(self) -> str:
        """Where its pages are sent."""
        return self.handle.url

    def usable(self, now: float) -> bool:
        """Whether pages may go to it now."""
        return now >= self.suspended_until and self.handle.is_ready()

    def reconfigure(self, config: Config) -> None:
        """Apply new concurrency bounds."""
        p = config.pipeline
        self.concurrency.set_bounds(p.min_concurrency, p.max_concurrency)


class Endpoints:
    """The server endpoints pages go to: each one's bound, answers and outages (none yet: a
    cluster's engine hosts bring theirs)."""

    def __init__(self, config: Config, servers: Sequence[ServerHandle]) -> None:
        self.config = config
        self.endpoints = [Endpoint(server, config) for server in servers]
        # Requests a page makes, over the pages answered lately (1: a page sent whole): the
        # bounds count requests, the converter pages.
        self.requests_per_page = 1.0

    def set_servers(self, servers: Sequence[ServerHandle]) -> None:
        """New handles (a reload); an endpoint at the same URL keeps its bound and counts."""
        old = {e.url: e for e in self.endpoints}
        endpoints = []
        for server in servers:
            endpoint = old.pop(server.url, None) or Endpoint(server, self.config)
            endpoint.handle = server
            endpoints.append(endpoint)
        self.endpoints = endpoints

    def usable(self, now: float) -> list[Endpoint]:
        """The endpoints that take pages now."""
        return [e for e in self.endpoints if e.usable(now)]

    def answered(self, url: str, now: float, recognised: bool,
                 server_down: str | None = None, server_error: str | None = None,
                 requests: int = 0) -> bool:
        """The awaited answer of a page sent to `url` came back, after `requests` requests
        (its blocks sent; 0: not known); `server_down`: why that endpoint is gone;
        `server_error`: the error it answered with (HTTP 5xx). True when that failure is the
        first of its episode (the caller names it; the rest are counted and said when the
        endpoint answers again)."""
        if requests > 0:
            self.requests_per_page += PER_PAGE_WEIGHT * (requests - self.requests_per_page)
        endpoint = next((e for e in self.endpoints if e.url == url), None)
        if endpoint is None:
            return False  # replaced by a reload meanwhile
        if server_down is not None:
            self._went_down(endpoint, now, server_down)
            return False
        if server_error is not None:
            endpoint.failed_while_down += 1
            if endpoint.down_since is not None:
                return False
            endpoint.down_since, endpoint.failed_while_down = now, 1
            return True
        if endpoint.down_since is not None:
            log.info("%s at %s answers again after %.0f s; %d failed request(s) in between",
                     endpoint.handle.name, endpoint.url, now - endpoint.down_since,
                     endpoint.failed_while_down)
            endpoint.down_since = None
        endpoint.answered += 1
        if recognised:
            endpoint.answers.tick(now)
        return False

    def _went_down(self, endpoint: Endpoint, now: float, reason: str) -> None:
        """A request to `endpoint` found no server: its pages wait (or go to the others) for
        SUSPEND_SECONDS, and it is said once per outage."""
        endpoint.suspended_until = now + SUSPEND_SECONDS
        endpoint.failed_while_down += 1
        endpoint.handle.note_unreachable(reason)
        if endpoint.down_since is not None:
            return  # said when the episode began (maybe as a failed request: a dying server)
        endpoint.down_since, endpoint.failed_while_down = now, 1
        others = " go to the others" if len(self.endpoints) > 1 else " wait for it"
        log.warning("%s at %s did not answer (%s); its pages%s", endpoint.handle.name,
                    endpoint.url, reason, others)

    def reclaim(self, now: float, documents: Sequence[Document]) -> list[tuple[Document, int]]:
        """The pages in flight at endpoints that are not usable now, to be taken from them when
        another one is usable (with none usable they wait where they are, as with one
        server)."""
        if not self.usable(now):
            return []
        taken: list[tuple[Document, int]] = []
        for endpoint in self.endpoints:
            if endpoint.usable(now):
                continue
            pages = [(d, p) for d in documents for p, sent in sorted(d.sent.items())
                     if sent.endpoint == endpoint.url]
            if pages:
                log.info("%s at %s is not ready: its %d page(s) in flight go to the others",
                         endpoint.handle.name, endpoint.url, len(pages))
                taken += pages
        return taken

    def observe(self, now: float, backlog: int, in_flight: Mapping[str, int]) -> None:
        """Each endpoint's progress (`in_flight`: pages in flight per URL) for its hang
        detection and its concurrency search."""
        for e in self.endpoints:
            pages = in_flight.get(e.url, 0)
            e.handle.note_progress(pages, e.answered)
            metrics = e.handle.metrics(want=e.concurrency.adaptive and pages > 0)
            e.concurrency.observe(now, e.answered, pages, backlog, metrics,
                                  self.requests_per_page)

    def load(self, now: float, in_flight: Mapping[str, int]) -> list[EndpointLoad]:
        """Each endpoint's pages in flight (`in_flight`: per URL), rate (as of `now`) and
        bound."""
        return [EndpointLoad(e.url, e.handle.name, in_flight.get(e.url, 0), e.answers.rate(now),
                             e.concurrency.limit) for e in self.endpoints]

    def reconfigure(self, config: Config) -> None:
        """Apply a reloaded configuration's bounds."""
        self.config = config
        for endpoint in self.endpoints:
            endpoint.reconfigure(config)

"""What is sent next: which pages, to which endpoint, and each endpoint's gate limit and cap.

`plan(documents, endpoints, workers, suspects_together)` is a pure function of the active
documents, the usable endpoints and the engine workers taking pages; the converter carries
the plan out.

How many: `limit` pages at the server (the sum of the endpoints' adaptive bounds) and a small
`ready_margin` more being prepared in the engine (rendered, laid out, encoded), so a finished
request is replaced at once and every engine worker has its next page; no more, since a
letter's page dropped now is prepared after them. Pages of a document short of pages in
flight (fewer than SHORT_OF_PAGES) go at once, up to SHORT_EXTRA beyond that; the worker's
request gate lets them bump a young request of a document with many.

Which: pages of all documents interleave; the next free slot goes to the document with the
fewest pages in flight, then the fewest pages left, then the oldest. A 2-page letter dropped
behind a 600-page book gets its pages in at the next free slots and is done in about one
page's time, while two books share the server evenly.

While a small document runs beside a big one, the big ones yield: their pages go only while
fewer than `yield_room(bound)` pages are in flight in all, the small documents' included: a
YIELD_SHAREth of the bound, at most YIELD_PAGES. Why: a page decodes in a batch with every
other request at the server, so a letter's page in a book's big batch takes several times
its time alone, and little more in a small one (bench/RESULTS.md). Each endpoint's gate
gets a `YieldCap` on the big documents, and takes their young requests above it back from
the server.

After an engine worker crash with several pages in flight, only those pages (the
documents' `suspects`) are sent, at most `isolation_bound` at a time, until the page that
crashes the worker is found.

Where: each page goes to the endpoint with the fewest pages in flight relative to its bound,
through an engine worker with room to prepare it (fewer than PREPARED_PER_WORKER pages not yet
at the server), the one with the fewest pages in flight for that endpoint.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ocrvl_daemon.core.document import Document
from ocrvl_daemon.core.messages import SHORT_OF_PAGES, GateLimit, YieldCap

# Pages an engine worker has in preparation (rendering, layout, encoding) at most, and what
# the plan keeps each one given: the page being prepared and the next.
PREPARED_PER_WORKER = 2
# Pages of documents short of pages go this many beyond `limit` plus the ready margin.
SHORT_EXTRA = 4
YIELD_SHARE = 4
YIELD_PAGES = 16
# After a worker crash with several pages in flight, which page crashed it is unknown: those
# pages are sent again, only they, with at most 1/ISOLATION_SPLIT as many in flight, until
# a crash with one page in flight names the page (64 pages: 16, 4, then 1 at a time).
ISOLATION_SPLIT = 4


@dataclass(frozen=True)
class EndpointRoom:
    """A usable endpoint as the plan sees it: its URL, bound and pages in flight."""

    url: str
    limit: int
    in_flight: int


@dataclass(frozen=True)
class Send:
    """Send `page` of `document` to `url` through engine worker `worker`; `priority`: its
    document's pages in flight before it (the request gate lets the lowest through first)."""

    document: Document
    page: int
    url: str
    worker: int
    priority: int


@dataclass(frozen=True)
class Plan:
    """The gate limits to set, then the pages to send, in order."""

    gates: tuple[GateLimit, ...]
    sends: tuple[Send, ...]


def ready_margin(limit: int, workers: int = 1) -> int:
    """Pages in flight beyond `limit`: being prepared while `limit` pages are at the server.

    Enough for each of the engine `workers` to have PREPARED_PER_WORKER pages: one being
    prepared and the next waiting. With layout detection on the CPU, preparing is the layout
    model's pass (about a second), and a worker without its next page idles until the next
    tick: six workers sharing a margin of 4 laid out half the pages their model could
    (16 cores, bench/gpu/RESULTS.md 2026-12-06). Otherwise small on purpose: a page of a
    letter dropped now is prepared after these (the renderer and the request gate serve
    first come, first served), so each one delays it.
    """
    return max(2, limit // 16, PREPARED_PER_WORKER * workers)


def isolation_bound(suspects: int) -> int:
    """How many of the `suspects` in flight at a crash may be in flight together."""
    return max(1, suspects // ISOLATION_SPLIT)


def yield_room(limit: int) -> int:
    """Pages in flight in all while small documents run beside a big one, at bound `limit`."""
    return min(limit // YIELD_SHARE, YIELD_PAGES)


def yielding(documents: Sequence[Document]) -> bool:
    """Whether a small document runs beside a big one, which yields to it."""
    return any(d.small for d in documents) and not all(d.small for d in documents)


class _Queue:
    """A document's pages as the plan takes them: what is still pending, what is in flight."""

    def __init__(self, document: Document, order: int) -> None:
        self.document = document
        self.pending = list(document.pending)
        self.in_flight = len(document.sent)
        self.order = order

    def key(self) -> tuple[int, int, int]:
        """Fewest in flight, then fewest pending, then oldest: the next slot goes to it."""
        return self.in_flight, len(self.pending), self.order


def _pick(queues: Sequence[_Queue], slots: int, short_of: int | None = None
          ) -> list[tuple[_Queue, int]]:
    """Up to `slots` pages, fairly across `queues`; with `short_of`, only of documents with
    fewer pages than that in flight."""
    chosen: list[tuple[_Queue, int]] = []
    ready = [q for q in queues if q.pending]
    while slots > 0:
        if short_of is not None:
            ready = [q for q in ready if q.in_flight < short_of]
        if not ready:
            break
        queue = min(ready, key=_Queue.key)
        chosen.append((queue, queue.pending.pop(0)))
        queue.in_flight += 1
        slots -= 1
        if not queue.pending:
            ready.remove(queue)
    return chosen


def _pick_yielding(queues: Sequence[_Queue], slots: int, limit: int
                   ) -> list[tuple[_Queue, int]]:
    """`_pick`, except that while a small document runs beside a big one, the big ones take
    pages only while fewer than `yield_room(limit)` pages are in flight in all."""
    if not yielding([q.document for q in queues]):
        return _pick(queues, slots)
    chosen = _pick([q for q in queues if q.document.small], slots)
    big_room = yield_room(limit) - sum(q.in_flight for q in queues)
    big = [q for q in queues if not q.document.small]
    return chosen + _pick(big, min(slots - len(chosen), big_room))


def _isolating(queues: Sequence[_Queue], bound: int) -> list[tuple[_Queue, int]] | None:
    """The suspects to send while a crash is being narrowed down (None: no crash is)."""
    suspects = sorted((q.document.job_id, page, q) for q in queues for page in q.document.suspects
                      if page in q.pending or page in q.document.sent)
    if not suspects:
        return None
    room = bound - sum(page in q.document.sent for _, page, q in suspects)
    chosen = []
    for _, page, queue in suspects:
        if room <= 0:
            break
        if page in queue.pending:
            queue.pending.remove(page)
            queue.in_flight += 1
            chosen.append((queue, page))
            room -= 1
    return chosen


def plan(documents: Sequence[Document], endpoints: Sequence[EndpointRoom],
         workers: Sequence[int], suspects_together: int = 1,
         serves: Mapping[int, frozenset[str]] | None = None) -> Plan:
    """What to send now to the usable `endpoints` through the engine `workers` taking pages
    (none of either: nothing), from `documents` (oldest first); `suspects_together`: the
    `isolation_bound` while a crash is being narrowed down; `serves`: the only endpoints a
    worker named there may send to (a cluster's engine host: its node's server)."""
    serves = serves or {}

    def serving(url: str) -> list[int]:
        return [w for w in workers if w not in serves or url in serves[w]]

    endpoints = [e for e in endpoints if serving(e.url)]
    if not endpoints or not workers:
        return Plan((), ())
    big = frozenset(d.job_id for d in documents if not d.small) if yielding(documents) else None
    gates = tuple(GateLimit(e.url, e.limit, YieldCap(yield_room(e.limit), big) if big else None)
                  for e in endpoints)
    limit = sum(e.limit for e in endpoints)
    in_flight = sum(len(d.sent) for d in documents)
    preparing_in = Counter(s.worker for d in documents for s in d.sent.values()
                           if not s.at_server)
    margin = ready_margin(limit, len(workers))
    preparing = preparing_in.total()
    slots = min(limit + margin - in_flight, margin - preparing)
    short_room = limit + margin + SHORT_EXTRA - in_flight
    queues = [_Queue(d, n) for n, d in enumerate(documents)]
    chosen = _isolating(queues, suspects_together)
    if chosen is None:
        chosen = _pick_yielding(queues, slots, limit)
        chosen += _pick(queues, short_room - len(chosen), short_of=SHORT_OF_PAGES)
    loads = {e.url: e.in_flight for e in endpoints}
    ahead = {id(q): len(q.document.sent) for q in queues}
    per_worker = Counter(s.worker for d in documents for s in d.sent.values())
    per_worker_url = Counter((s.worker, s.endpoint) for d in documents for s in d.sent.values())
    sends = []
    for queue, page in chosen:
        url = min(endpoints, key=lambda e: loads[e.url] / max(1, e.limit)).url
        worker = min(serving(url), key=lambda w: (preparing_in[w] >= PREPARED_PER_WORKER,
                                             per_worker_url[w, url], per_worker[w]))
        loads[url] += 1
        preparing_in[worker] += 1
        per_worker[worker] += 1
        per_worker_url[worker, url] += 1
        sends.append(Send(queue.document, page, url, worker, ahead[id(queue)]))
        ahead[id(queue)] += 1
    return Plan(gates, tuple(sends))

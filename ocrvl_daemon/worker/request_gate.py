"""Which page requests reach the model server, and in what order: the priority and bump rule.

The converter keeps `limit` pages at the server (`ConcurrencyController.limit`) and a few
more being prepared in the engine (`plan.plan`). Inside the engine worker, `RequestGate`
holds the server to exactly `limit` requests and lets the most urgent waiting one through
first; a request of a document short of pages may bump a young request of a document with
many (`_victim`). While a small document runs beside a big one, the big one's requests are
held to a `cap` and its young ones above it are taken back from the server
(`RequestGate.resize`).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

from ocrvl_daemon.core.messages import SHORT_OF_PAGES, YieldCap

# How long a request short of pages waits for a place before it bumps one (RequestGate).
BUMP_AFTER = 1.0

# While capped (`YieldCap`), a big document keeps at most this many requests waiting in the
# server's own queue (sent, no answer begun): the server still has its next request at hand,
# and a letter's request sent now has at most these ahead of it there, on a server of any size.
QUEUED_WHILE_CAPPED = 2


@dataclass(eq=False)
class GatePlace:
    """One request's place at the server."""

    priority: int
    since: float
    document: int | None = None  # its job id, for the `YieldCap`
    # Cancels the request to free the place for a more urgent one; None until it is sent,
    # and for requests that must not be bumped.
    bump: Callable[[], object] | None = None
    bumped: bool = False
    # Its answer has begun (the server runs it); until then it waits in the server's queue,
    # and taking it back costs nothing decoded, however long it has waited.
    started: bool = False


class RequestGate:
    """At most `limit` chat requests at the server at once; waiting ones go in order of
    priority (lower first), then of arrival.

    PaddleX's own request semaphore is fixed at `max_concurrency` when the pipeline is built;
    this one follows the converter's concurrency search, so a probe or a back-off below the
    maximum is exactly what the server sees.

    A request of a document short of pages in flight (priority below
    SHORT_OF_PAGES) does not wait long for a place when the server is full: after
    `bump_after` seconds it bumps the youngest request of a document with BUMP_GAP more
    pages in flight, if that one started within BUMP_MAX_AGE seconds. The bumped one is
    sent again first, as soon as a place is free. Why: pages that start together end
    together, so after a book's first batch no place frees for several seconds; a letter
    dropped then would wait all that time. A bump costs what the bumped page had decoded
    and its prefill, hence the patience: once pages end at different times, a finishing
    one lets the letter in sooner.

    While a small document runs beside a big one, the converter sets a `YieldCap` on the big
    one's requests (`resize`); see there.
    """

    BUMP_GAP = 8
    BUMP_MAX_AGE = 5.0
    RESEND_PRIORITY = -1  # a bumped request goes before everything waiting

    def __init__(self, limit: int, bump_after: float = BUMP_AFTER) -> None:
        # Guards _limit, _open (and each open place's `bumped`), _waiting and `bumps`.
        # Re-entrant: bumping cancels a request, whose callback gives its place back here.
        self._cond = threading.Condition(threading.RLock())
        self._limit = max(0, limit)
        self._bump_after = bump_after
        self._cap: YieldCap | None = None
        self._open: list[GatePlace] = []
        self._waiting: list[tuple[int, int, int | None]] = []  # (priority, arrival, document)
        self._arrivals = itertools.count()
        self.bumps = 0
        self.taken_back = 0  # young requests of big documents taken back under a cap

    def resize(self, limit: int, cap: YieldCap | None = None) -> None:
        """New bound; requests already sent above it finish, no new one starts until below.
        0 holds every request back: the worker's part of a bound shared by several workers
        while it has no pages at that endpoint (`engine.pool.shares`).

        `cap`: small documents run beside big ones, whose requests may hold at most
        `cap.places` places until a resize without a cap. Their young requests above it
        (sent within BUMP_MAX_AGE seconds) are taken back from the server at once, youngest
        first, and sent again once the cap allows. Why: vLLM prepares images one at a time
        in its API process, so a letter dropped during a book's first batch otherwise queues
        behind the book requests the server has accepted and not started, then decodes in
        their batch. A young request costs little to redo: it has mostly waited.
        """
        with self._cond:
            self._limit = max(0, limit)
            self._cap = cap
            if cap is not None:
                self._take_back_above(cap)
            self._cond.notify_all()

    def _take_back_above(self, cap: YieldCap) -> None:
        """Bump the requests of `cap.documents` still waiting in the server's queue beyond
        QUEUED_WHILE_CAPPED, however old (a server that runs few at once may hold a whole
        batch of them), then the youngest young ones until `cap.places` of theirs stay (the
        lock is held)."""
        yielding = [p for p in self._open if p.document in cap.documents and not p.bumped]
        bumpable = [p for p in yielding if p.bump is not None]
        queued = sorted((p for p in bumpable if not p.started), key=lambda p: p.since,
                        reverse=True)
        back = queued[:max(0, len(queued) - QUEUED_WHILE_CAPPED)]
        oldest = time.monotonic() - self.BUMP_MAX_AGE
        young = sorted((p for p in bumpable if p.since >= oldest and p not in back),
                       key=lambda p: (not p.started, p.since), reverse=True)
        back += young[:max(0, len(yielding) - len(back) - cap.places)]
        for place in back:
            place.bumped = True
            self.taken_back += 1
            assert place.bump is not None
            place.bump()

    def started(self, place: GatePlace) -> None:
        """The answer to `place`'s request has begun: it no longer waits at the server."""
        with self._cond:
            place.started = True
            self._cond.notify_all()  # a capped document may send its next one

    def _next(self) -> tuple[int, int, int | None] | None:
        """The waiting request that goes first: the lowest (priority, arrival), leaving out
        those of capped documents while their cap is full (the lock is held)."""
        held: frozenset[int] = frozenset()
        if self._cap is not None:
            capped = [p for p in self._open if p.document in self._cap.documents]
            if (len(capped) >= self._cap.places
                    or sum(not p.started for p in capped) >= QUEUED_WHILE_CAPPED):
                held = self._cap.documents
        return min((t for t in self._waiting if t[2] not in held), default=None)

    def acquire(self, priority: int = 0, document: int | None = None) -> GatePlace:
        """Wait for a free place and for every request ahead in line, then take the place.

        `document`: the request's job id, which a `YieldCap` may hold back.
        """
        with self._cond:
            ticket = (priority, next(self._arrivals), document)
            self._waiting.append(ticket)
            may_bump_at = time.monotonic() + self._bump_after
            while True:
                first = self._next() == ticket  # `_next` scans the whole line: once a wake-up
                if first and len(self._open) < self._limit:
                    break
                patience = may_bump_at - time.monotonic()
                victim = self._victim(priority) if first and patience <= 0 else None
                if victim is None:
                    self._cond.wait(patience if patience > 0 else None)
                    continue
                victim.bumped = True
                self.bumps += 1
                assert victim.bump is not None
                victim.bump()  # gives the place back (now or once the cancel lands)
            self._waiting.remove(ticket)
            place = GatePlace(priority, time.monotonic(), document)
            self._open.append(place)
            self._cond.notify_all()  # the next in line may fit too
            return place

    def _victim(self, priority: int) -> GatePlace | None:
        """The request to bump for one of `priority`, if any (the lock is held)."""
        if priority >= SHORT_OF_PAGES or priority == self.RESEND_PRIORITY:
            return None
        if any(p.bumped for p in self._open):
            return None  # a place is being freed already
        oldest = time.monotonic() - self.BUMP_MAX_AGE
        candidates = [
            p for p in self._open
            if p.bump is not None and p.priority >= priority + self.BUMP_GAP
            and (p.since >= oldest or not p.started)
        ]  # fmt: skip
        # One still queued at the server costs nothing to take back; else the youngest.
        return max(candidates, key=lambda p: (not p.started, p.since), default=None)

    def release(self, place: GatePlace) -> None:
        """Give a place back."""
        with self._cond:
            self._open.remove(place)
            self._cond.notify_all()

    @property
    def open(self) -> int:
        """Requests at the server now."""
        return len(self._open)

    @property
    def waiting(self) -> int:
        """Requests waiting for a place (each has decided whether to bump, for now)."""
        with self._cond:
            return len(self._waiting)


class GatedRequest:
    """One chat request through the gate, sent again if the gate bumps it.

    `future` is what PaddleX waits on: it ends with the answer of whichever attempt was not
    bumped. Cancelling it cancels the request at the server.
    """

    def __init__(self, gate: RequestGate, start: Callable[[Callable[[], None]], Future[Any]],
                 priority: int, document: int | None = None):
        self.future: Future[Any] = Future()
        self._gate = gate
        self._start = start
        self._priority = priority
        self._document = document
        self._sent: Future[Any] | None = None
        self.future.add_done_callback(self._on_cancel)

    def send(self, priority: int | None = None) -> None:
        """Wait for a place at the server and send the request (raises if it cannot start)."""
        place = self._gate.acquire(self._priority if priority is None else priority,
                                   self._document)
        if self.future.done():  # cancelled while it waited to be sent again
            self._gate.release(place)
            return
        try:
            sent = self._start(lambda: self._gate.started(place))
        except BaseException:
            self._gate.release(place)
            raise
        self._sent = sent
        if priority is None:  # a request sent again is not bumped twice
            place.bump = sent.cancel
        sent.add_done_callback(lambda done: self._on_done(done, place))

    def _on_done(self, sent: Future[Any], place: GatePlace) -> None:
        self._gate.release(place)
        if self.future.done():
            return
        if sent.cancelled():
            if place.bumped:
                threading.Thread(target=self._send_again, name="bumped-request",
                                 daemon=True).start()
            else:
                self.future.cancel()
            return
        with contextlib.suppress(InvalidStateError):  # PaddleX cancelled it meanwhile
            if (exc := sent.exception()) is not None:
                self.future.set_exception(exc)
            else:
                self.future.set_result(sent.result())

    def _send_again(self) -> None:
        try:
            self.send(RequestGate.RESEND_PRIORITY)
        except BaseException as exc:
            with contextlib.suppress(InvalidStateError):
                self.future.set_exception(exc)

    def _on_cancel(self, future: Future[Any]) -> None:
        if future.cancelled() and self._sent is not None:
            self._sent.cancel()



"""Which pages go to the engine next: a fair choice across the active documents.

Pages of all active documents interleave: the next free slot goes to the document with the
fewest pages in flight, then the fewest pages left, then the oldest. A 2-page letter dropped
behind a 600-page book therefore gets its pages in at the next free slots and is done in about
one page's time, while two books share the server evenly. How many slots there are is the
request gate's rule (`request_gate.slots_to_fill`).

While a small document runs beside a big one, the big ones yield: their pages go only while
the server has fewer than `yield_room(bound)` pages in flight in all, the small documents'
pages included (`pick_yielding`): a `YIELD_SHARE`th of the bound, at most `YIELD_PAGES`.
Why: a page decodes in a batch with every other request at the server, and on a real GPU a
letter's page in a book's batch of 64 took 3.7x its time alone; letters dropped 1.5 s apart
under a book held to 16 pages of its own, 28 in all, took 2.04x, held to 16 in all 1.3-1.5x,
and held to 32 in all (a quarter of a bound of 128) 2.09x: what a letter waits for is the
batch it decodes in, whatever the bound. The book slows for as long as small documents run;
its pages already at the server finish, except its young requests above the yield room,
which the request gate takes back (`request_gate.RequestGate.resize`): during a book's first
batch most of them are still queued at the server, ahead of the letter's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Documents converted at once, sharing the server; the queue behind them waits for a slot.
MAX_ACTIVE_DOCUMENTS = 64
# A document with at most this many pages left is small (a letter, an article, a book's last
# pages); documents with more yield to it.
SMALL_DOCUMENT_PAGES = 16
YIELD_SHARE = 4
YIELD_PAGES = 16


@dataclass
class DocumentPages:
    """The page bookkeeping of one active document."""

    job_id: int
    page_count: int
    pending: list[int]  # ascending, not yet sent
    in_flight: set[int] = field(default_factory=set)
    done: int = 0
    attempts: dict[int, int] = field(default_factory=dict)
    # Pages that wait before they are sent again (the server failed them): page -> when.
    resting: dict[int, float] = field(default_factory=dict)

    @property
    def pages_left(self) -> int:
        """Pages not yet checkpointed."""
        return len(self.pending) + len(self.in_flight) + len(self.resting)

    @property
    def small(self) -> bool:
        """Few pages left: documents with more yield to it."""
        return self.pages_left <= SMALL_DOCUMENT_PAGES

    @property
    def finished(self) -> bool:
        """All pages are checkpointed."""
        return not self.pending and not self.in_flight and not self.resting

    def give_back(self, page: int) -> None:
        """A page returns to the queue (server down, worker replaced...)."""
        self.in_flight.discard(page)
        self.resting.pop(page, None)
        if page not in self.pending:
            self.pending.append(page)
            self.pending.sort()

    def rest(self, page: int, until: float) -> None:
        """A page goes back to the queue at `until` (monotonic), not before."""
        self.in_flight.discard(page)
        self.resting[page] = until

    def wake(self, now: float) -> None:
        """Pages whose rest is over return to the queue."""
        for page in [p for p, until in self.resting.items() if until <= now]:
            self.give_back(page)


def pick_pages(
    documents: list[DocumentPages], slots: int, *, short_of: int | None = None
) -> list[tuple[DocumentPages, int]]:
    """Choose up to `slots` pages to send now, fairly across `documents` (oldest first in list).

    Marks the chosen pages in flight. With `short_of`, only documents with fewer pages than
    that in flight take part.
    """
    chosen: list[tuple[DocumentPages, int]] = []
    ready = [d for d in documents if d.pending]
    order = {id(d): n for n, d in enumerate(documents)}
    while slots > 0:
        if short_of is not None:
            ready = [d for d in ready if len(d.in_flight) < short_of]
        if not ready:
            break
        doc = min(ready, key=lambda d: (len(d.in_flight), len(d.pending), order[id(d)]))
        page = doc.pending.pop(0)
        doc.in_flight.add(page)
        chosen.append((doc, page))
        slots -= 1
        if not doc.pending:
            ready.remove(doc)
    return chosen


def yield_room(limit: int) -> int:
    """Pages in flight in all while small documents run beside a big one, at bound `limit`."""
    return min(limit // YIELD_SHARE, YIELD_PAGES)


def yielding(documents: list[DocumentPages]) -> bool:
    """Whether a small document runs beside a big one, which yields to it."""
    return any(d.small for d in documents) and not all(d.small for d in documents)


def pick_yielding(
    documents: list[DocumentPages], slots: int, limit: int
) -> list[tuple[DocumentPages, int]]:
    """`pick_pages`, except that while a small document runs beside a big one, the big ones
    take pages only while fewer than `yield_room(limit)` pages are in flight in all."""
    if not yielding(documents):
        return pick_pages(documents, slots)
    small = [d for d in documents if d.small]
    big = [d for d in documents if not d.small]
    chosen = pick_pages(small, slots)
    big_room = yield_room(limit) - sum(len(d.in_flight) for d in documents)
    return chosen + pick_pages(big, min(slots - len(chosen), big_room))

"""One active document: its job, one record per page (`page.Page`) and its redo budget.

Everything about a page is on its record: its phase (pending, sent, resting, held, done),
its attempts, whether it is a suspect, how it has been redone. No other object keeps its own
copy of that, and nothing changes a document but `Document.apply`, which carries out one
change (`actions.Change`): an action `decide.decide` chose for a result, or a page sent,
reaching the server, taken back, or rested long enough. The converter and the tests apply
the same changes the same way. The plan (`plan.plan`), the endpoints (a page's endpoint),
the converter's handling of a stopped engine worker (its pages) and status read it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TypeVar

from ocrvl_daemon.core.actions import (
    Change,
    Checkpoint,
    Placeholder,
    ReachedServer,
    SendAgain,
    Sent,
    TakenBack,
    Wake,
)
from ocrvl_daemon.core.job import Job
from ocrvl_daemon.core.page import DONE, PENDING, Done, Held, Page, Pending, Resting, SentPage
from ocrvl_daemon.core.redo import Ledger, RedoBudget
from ocrvl_daemon.files.pdf import FileStamp

# Documents converted at once, sharing the server; the queue behind them waits for a slot.
MAX_ACTIVE_DOCUMENTS = 64
# A document with at most this many pages left is small (a letter, an article, a book's last
# pages); documents with more yield to it (`plan`).
SMALL_DOCUMENT_PAGES = 16

_P = TypeVar("_P", Pending, SentPage, Resting, Held, Done)


class Document:
    """The pages of one active document and everything decided about them.

    `pending`: the pages this conversion has to do (the others were done before, and are in
    the store). `source`: the file's version when the document started: every page and the
    Markdown must come from it (the converter compares it before a page counts and before
    writing). `started`: when it became active (the owner's monotonic clock).
    """

    def __init__(self, job: Job, page_count: int, pending: Iterable[int],
                 source: FileStamp | None = None, started: float = 0.0) -> None:
        self.job = job
        self.page_count = page_count
        self.source = source
        self.started = started
        self._budget = RedoBudget()
        self._answered = 0  # pages checkpointed by this conversion
        self._refused: dict[str, set[int]] = {}  # a refusal's words -> the pages it refused
        self._pages: dict[int, Page] = {}
        # The pages in each phase and the suspects: an index of the records, kept by `_put`
        # alone, so that the plan's questions at every tick do not walk a book's pages.
        self._in: dict[type, set[int]] = {kind: set() for kind in
                                          (Pending, SentPage, Resting, Held, Done)}
        self._suspects: set[int] = set()
        for number in pending:
            self._put(Page(number))

    # --- what it is -----------------------------------------------------------------------

    @property
    def job_id(self) -> int:
        """The document's job id."""
        return self.job.id

    def page(self, number: int) -> Page:
        """The record of page `number` (KeyError for a page done before this conversion)."""
        return self._pages[number]

    @property
    def pending(self) -> list[int]:
        """The pages to be sent, ascending."""
        return sorted(self._in[Pending])

    @property
    def sent(self) -> Mapping[int, SentPage]:
        """The pages in flight, with where each went."""
        return {n: self._phase(n, SentPage) for n in sorted(self._in[SentPage])}

    @property
    def resting(self) -> Mapping[int, float]:
        """The pages waiting to be sent again, with when (monotonic)."""
        return {n: self._phase(n, Resting).until for n in sorted(self._in[Resting])}

    @property
    def suspects(self) -> frozenset[int]:
        """Pages in flight at an engine worker crash, one of which may have caused it: while
        there are any, only they are sent, a few at a time (`plan`), until a crash names
        the page."""
        return frozenset(self._suspects)

    @property
    def done(self) -> int:
        """Pages answered: checkpointed, or given up on with a placeholder."""
        return self.page_count - self.pages_left

    @property
    def pages_left(self) -> int:
        """Pages not yet answered."""
        return len(self._pages) - len(self._in[Done])

    @property
    def small(self) -> bool:
        """Few pages left: documents with more yield to it."""
        return self.pages_left <= SMALL_DOCUMENT_PAGES

    @property
    def finished(self) -> bool:
        """All pages are answered."""
        return self.pages_left == 0

    @property
    def others_out(self) -> bool:
        """Whether pages other than one in flight are still to come back."""
        return bool(self._in[Pending]) or len(self._in[SentPage]) > 1

    def held(self) -> list[int]:
        """Pages held until the document's other pages are in, once they are (else none)."""
        if self._in[Pending] or self._in[SentPage]:
            return []
        return sorted(self._in[Held])

    @property
    def budget(self) -> RedoBudget:
        """The tokens its pages generated, the first time and redone."""
        return self._budget

    @property
    def redone_pages(self) -> int:
        """Pages sent again with another setting (more tokens, a penalty, once more)."""
        return sum(page.redo.redone for page in self._pages.values())

    @property
    def answered(self) -> int:
        """Pages this conversion checkpointed (an answer kept, not a placeholder)."""
        return self._answered

    def refused_pages(self, words: str) -> frozenset[int]:
        """The pages the server refused with these exact words (an HTTP 4xx answer)."""
        return frozenset(self._refused.get(words, ()))

    def ledger(self, number: int) -> Ledger:
        """What a redo decision about page `number` reads (`redo.Ledger`)."""
        others = sum(page.redo.expected or 0 for n, page in self._pages.items() if n != number)
        return Ledger(self._budget, self._pages[number].redo, others)

    # --- the one way it changes -----------------------------------------------------------

    def apply(self, change: Change, now: float) -> None:
        """Carry out `change` (`now`: the owner's monotonic clock, for rests)."""
        if isinstance(change, Sent):
            if self._pages[change.page].phase != PENDING:
                raise ValueError(f"page {change.page + 1} is not pending; it cannot be sent")
            self._move(change.page, SentPage(change.endpoint, change.worker))
        elif isinstance(change, ReachedServer):
            if change.page in self._in[SentPage]:
                sent = self._phase(change.page, SentPage)
                self._move(change.page, replace(sent, at_server=True))
        elif isinstance(change, TakenBack):
            if change.page in self._in[SentPage]:
                page = self._pages[change.page]
                self._put(replace(page, phase=PENDING, suspect=page.suspect or change.suspect))
        elif isinstance(change, Wake):
            for number in [n for n in self._in[Resting]
                           if self._phase(n, Resting).until <= now]:
                self._move(number, PENDING)
        elif isinstance(change, SendAgain):
            self._send_again(change, now)
        elif isinstance(change, (Checkpoint, Placeholder)):
            if isinstance(change, Checkpoint):
                self._answered += 1
            if isinstance(change, Checkpoint) and change.ledger is not None:
                self._budget = change.ledger.budget
                self._put(replace(self._pages[change.page], redo=change.ledger.record))
            page = self._pages[change.page]
            self._put(replace(page, phase=DONE, suspect=False, redo=page.redo.settled()))
        # FailJob changes no page: the converter drops the whole document.

    def _send_again(self, action: SendAgain, now: float) -> None:
        page = self._pages[action.page]
        if action.refused is not None:
            self._refused.setdefault(action.refused, set()).add(action.page)
        if action.ledger is not None:
            self._budget = action.ledger.budget
            page = replace(page, redo=action.ledger.record)
        if action.counted:
            page = replace(page, attempts=page.attempts + 1)
        if action.held is not None:
            phase: Pending | Resting | Held = action.held
        elif action.wait > 0:
            phase = Resting(now + action.wait)
        else:
            phase = PENDING
        self._put(replace(page, phase=phase))

    def _phase(self, number: int, kind: type[_P]) -> _P:
        phase = self._pages[number].phase
        assert isinstance(phase, kind)
        return phase

    def _move(self, number: int, phase: Pending | SentPage | Resting | Held | Done) -> None:
        self._put(replace(self._pages[number], phase=phase))

    def _put(self, page: Page) -> None:
        """Store `page`'s new record, and keep the index of phases and suspects with it."""
        old = self._pages.get(page.number)
        if old is not None:
            self._in[type(old.phase)].discard(page.number)
        self._pages[page.number] = page
        self._in[type(page.phase)].add(page.number)
        if page.suspect:
            self._suspects.add(page.number)
        else:
            self._suspects.discard(page.number)


def pages_per_endpoint(documents: Iterable[Document]) -> Counter[str]:
    """Pages in flight at each endpoint, over `documents`."""
    return Counter(sent.endpoint for doc in documents for sent in doc.sent.values())


def pages_of_worker(documents: Iterable[Document], worker: int) -> list[tuple[Document, int]]:
    """The pages engine worker `worker` has, over `documents`, in their order."""
    return [(doc, page) for doc in documents for page, sent in doc.sent.items()
            if sent.worker == worker]

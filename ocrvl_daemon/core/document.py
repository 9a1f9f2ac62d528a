"""One active document: its job, the state of each of its pages, its attempts and its redo
ledger, in one object.

A page is pending (to be sent), sent (to an endpoint through an engine worker, on its nth
attempt), resting (waiting before it is sent again) or answered (checkpointed or given up on,
counted in `done`). No other object keeps its own copy of that. The converter
(`driver.Converter`) changes a document only through these methods, as it applies the
actions `decide.decide` chose; the plan (`plan.plan`), the dispatcher (a page's endpoint),
the converter's handling of a stopped engine worker (its pages) and status read it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from ocrvl_daemon.core.quality import RedoLedger
from ocrvl_daemon.files.pdf import FileStamp
from ocrvl_daemon.storage.store import Job

# Documents converted at once, sharing the server; the queue behind them waits for a slot.
MAX_ACTIVE_DOCUMENTS = 64
# A document with at most this many pages left is small (a letter, an article, a book's last
# pages); documents with more yield to it (`plan`).
SMALL_DOCUMENT_PAGES = 16


@dataclass(frozen=True)
class SentPage:
    """A page in flight: the endpoint (OpenAI base URL) its requests go to, which attempt at
    the page this is (1: the first), the engine worker that has it (`EnginePool` numbers
    them), and whether its first request has left for the server (else it is being
    prepared: rendered, laid out, encoded)."""

    endpoint: str
    attempt: int
    worker: int = 0
    at_server: bool = False


@dataclass
class Document:
    """The pages of one active document and everything decided about them."""

    job: Job
    page_count: int
    pending: list[int]  # ascending, not yet sent
    sent: dict[int, SentPage] = field(default_factory=dict)
    # Pages that wait before they are sent again: page -> when (monotonic; inf: until the
    # document's other pages are in).
    resting: dict[int, float] = field(default_factory=dict)
    done: int = 0  # pages answered: checkpointed, or given up on with a placeholder
    attempts: dict[int, int] = field(default_factory=dict)  # failed attempts counted
    ledger: RedoLedger = field(default_factory=RedoLedger)
    # Pages in flight at an engine worker crash, one of which may have caused it: while there
    # are any, only they are sent, a few at a time (`plan`), until a crash names the page.
    suspects: set[int] = field(default_factory=set)
    # The file's version when the document started: every page and the Markdown must come
    # from it (`driver.Converter` compares it before a page counts and before writing).
    source: FileStamp | None = None

    @property
    def job_id(self) -> int:
        """The document's job id."""
        return self.job.id

    @property
    def pages_left(self) -> int:
        """Pages not yet answered."""
        return len(self.pending) + len(self.sent) + len(self.resting)

    @property
    def small(self) -> bool:
        """Few pages left: documents with more yield to it."""
        return self.pages_left <= SMALL_DOCUMENT_PAGES

    @property
    def finished(self) -> bool:
        """All pages are answered."""
        return not self.pending and not self.sent and not self.resting

    @property
    def others_out(self) -> bool:
        """Whether pages other than one in flight are still to come back."""
        return bool(self.pending) or len(self.sent) > 1

    def send(self, page: int, endpoint: str, worker: int = 0) -> None:
        """Pending `page` goes to `endpoint`, through engine worker `worker`."""
        self.pending.remove(page)
        self.sent[page] = SentPage(endpoint, self.attempts.get(page, 0) + 1, worker)

    def reached_server(self, page: int) -> None:
        """The first request of `page`, if in flight, has left for the server."""
        if page in self.sent:
            self.sent[page] = replace(self.sent[page], at_server=True)

    def count_attempt(self, page: int) -> None:
        """An attempt at `page` failed and counts towards its retries."""
        self.attempts[page] = self.attempts.get(page, 0) + 1

    def give_back(self, page: int) -> None:
        """`page` returns to the queue (server down, worker replaced, a redo...)."""
        self.sent.pop(page, None)
        self.resting.pop(page, None)
        if page not in self.pending:
            self.pending.append(page)
            self.pending.sort()

    def rest(self, page: int, until: float) -> None:
        """`page` goes back to the queue at `until` (monotonic; inf: once `release_held`)."""
        self.sent.pop(page, None)
        self.resting[page] = until

    def wake(self, now: float) -> None:
        """Pages whose rest is over return to the queue."""
        for page in [p for p, until in self.resting.items() if until <= now]:
            self.give_back(page)

    def held(self) -> list[int]:
        """Pages resting until the document's other pages are in, once they are (else none)."""
        if self.pending or self.sent:
            return []
        return sorted(self.ledger.held)

    def answered(self, page: int) -> None:
        """`page` is checkpointed or given up on: it is done, and its redo bookkeeping too."""
        self.sent.pop(page, None)
        self.resting.pop(page, None)
        self.suspects.discard(page)
        self.ledger.settle(page)
        self.done += 1


def pages_per_endpoint(documents: Iterable[Document]) -> Counter[str]:
    """Pages in flight at each endpoint, over `documents`."""
    return Counter(sent.endpoint for doc in documents for sent in doc.sent.values())


def pages_of_worker(documents: Iterable[Document], worker: int) -> list[tuple[Document, int]]:
    """The pages engine worker `worker` has, over `documents`, in their order."""
    return [(doc, page) for doc in documents for page, sent in sorted(doc.sent.items())
            if sent.worker == worker]

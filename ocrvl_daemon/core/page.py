"""One page of an active document, as one immutable record: where it is (its phase), the
failed attempts counted against it, whether it is suspected of crashing an engine worker,
and how it has been redone (`redo.RedoRecord`).

A page is pending (to be sent), sent (to an endpoint through an engine worker), resting
(waiting before it is sent again), held (its next loop-breaking retry waits until the
document's other pages are in) or done (checkpointed, or given up on). The phase carries what
only that phase has: the endpoint and worker of a sent page, the end of a rest, what a held
page is decided again with. Records are changed only by making new ones
(`dataclasses.replace`), in `document.Document.apply`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ocrvl_daemon.core.redo import CutBlock, RedoRecord


@dataclass(frozen=True)
class Pending:
    """To be sent."""


@dataclass(frozen=True)
class SentPage:
    """In flight: the endpoint (OpenAI base URL) its requests go to, the engine worker that
    has it (`EnginePool` numbers them), and whether its first request has left for the
    server (else it is being prepared: rendered, laid out, encoded)."""

    endpoint: str
    worker: int = 0
    at_server: bool = False


@dataclass(frozen=True)
class Resting:
    """Waiting to be sent again, until `until` (the owner's monotonic clock)."""

    until: float


@dataclass(frozen=True)
class Held:
    """Waiting until the document's other pages are in, then decided again
    (`redo.Ledger.release`) from its cut-off answers `cuts` and the server's `ceiling`;
    `per_block`: its blocks are decided one by one, else the page is one answer."""

    cuts: tuple[CutBlock, ...]
    ceiling: int
    per_block: bool = False


@dataclass(frozen=True)
class Done:
    """Answered: checkpointed, or given up on with a placeholder."""


Phase = Pending | SentPage | Resting | Held | Done
PENDING = Pending()
DONE = Done()


@dataclass(frozen=True)
class Page:
    """Everything about one page of an active document."""

    number: int  # 0-based
    phase: Phase = PENDING
    attempts: int = 0  # failed attempts counted towards `Rules.page_retries`
    # In flight at an engine worker crash with others, one of which may have caused it.
    suspect: bool = False
    redo: RedoRecord = field(default_factory=RedoRecord)

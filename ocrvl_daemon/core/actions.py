"""What changes an active document: the action decided for a page's result
(`decide.decide`), and what happens to pages on their way (sent, at the server, taken back,
rested long enough). `document.Document.apply` is the one place that carries them out."""

from __future__ import annotations

from dataclasses import dataclass

from ocrvl_daemon.core.messages import PageResult
from ocrvl_daemon.core.page import Held
from ocrvl_daemon.core.quality import PageQuality
from ocrvl_daemon.core.redo import Ledger
from ocrvl_daemon.errors import OcrvlError


@dataclass(frozen=True)
class Checkpoint:
    """Save `answer` as the page's text, with its quality record (and `note` if flagged);
    `ledger`: the page's redo record and its document's budget from now on (None: as they
    are)."""

    page: int
    answer: PageResult
    quality: PageQuality
    note: str | None
    ledger: Ledger | None = None


@dataclass(frozen=True)
class SendAgain:
    """Send the page again after `wait` seconds (0: now), or, `held`, once the document's
    other pages are in. `counted`: the attempt counts towards `Rules.page_retries`; `why` is
    the warning to log, after the file's name (None: nothing to say here). `refused`: the
    server's words, where it refused the page (`Document.refused_pages`)."""

    page: int
    wait: float = 0.0
    counted: bool = False
    why: str | None = None
    ledger: Ledger | None = None
    held: Held | None = None
    refused: str | None = None


@dataclass(frozen=True)
class Placeholder:
    """Give the page up: an empty page with `note` in the document, which still completes.
    `retryable`: trying again may help (the note says how)."""

    page: int
    note: str
    retryable: bool


@dataclass(frozen=True)
class FailJob:
    """The whole document fails with `error` (tried again later as the retry policy says)."""

    error: OcrvlError


Action = Checkpoint | SendAgain | Placeholder | FailJob


@dataclass(frozen=True)
class Sent:
    """Pending `page` went to `endpoint`, through engine worker `worker`."""

    page: int
    endpoint: str
    worker: int = 0


@dataclass(frozen=True)
class ReachedServer:
    """The first request of `page`, if it is in flight, left for the server."""

    page: int


@dataclass(frozen=True)
class TakenBack:
    """`page`, in flight, returns to the queue uncounted (its endpoint is not ready, its
    worker stopped, the store could not take its answer); `suspect`: it was in flight, with
    others, at an engine worker crash."""

    page: int
    suspect: bool = False


@dataclass(frozen=True)
class Wake:
    """Time passed: resting pages whose wait is over return to the queue."""


Change = Action | Sent | ReachedServer | TakenBack | Wake

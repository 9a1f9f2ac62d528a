"""What the calls PaddleX makes while it recognises a page need to know about that page.

PaddleX's `predict` calls back into ocrvl (each chat request, each layout model call) with
no word of the page it works on. Each page runs on a thread of its own, so the page is set
for the thread's context around the call (`on_page`) and read where PaddleX calls back
(`this_page`); leaving the block restores the context, however the page ends.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from ocrvl_daemon.core.messages import BlockAnswer
from ocrvl_daemon.core.quality import Redo


@dataclass(frozen=True)
class Asked:
    """A chat completion a page asked for: its block's key, its answer (a future), the token
    limit it asked for, and whether the answer was kept from the page's last try."""

    key: str
    future: Future[Any]
    limit: int
    reused: bool = False
    image: str = ""  # the block's image (data URL), read for ink if its answer is empty


class TimedRequests(list[Future[Any]]):
    """A page's chat requests (futures), each added once it has its place at the server;
    notes into `spans` when each got its place and when it ended: the server stage's load in
    the units of the bound (requests). A request bumped and sent again keeps its place's time
    while it waits for another (rare, and short)."""

    def __init__(self, spans: list[tuple[float, float]]) -> None:
        super().__init__()
        self._spans = spans

    def append(self, request: Future[Any]) -> None:
        """Add the request, which has its place at the server now."""
        super().append(request)
        placed = time.monotonic()
        request.add_done_callback(lambda _: self._spans.append((placed, time.monotonic())))


@dataclass
class PageContext:
    """One page being recognised: the endpoint its requests go to, their priority and
    document (`PageTask`), the answers to keep and how each block sent again goes; how to
    tell the converter once its first request leaves (`announce`, called once); and, as they
    happen, the requests sent to the server (`started`), every completion asked for
    (`asked`) and the spans of its layout model calls (`layout_spans`)."""

    url: str
    priority: int = 0
    document: int | None = None
    keep: Mapping[str, BlockAnswer] = field(default_factory=dict)
    blocks: Mapping[str, Redo] = field(default_factory=dict)
    announce: Callable[[], None] | None = None
    started: TimedRequests = field(default_factory=lambda: TimedRequests([]))
    asked: list[Asked] = field(default_factory=list)
    layout_spans: list[tuple[float, float]] = field(default_factory=list)

    def announced(self) -> None:
        """The page's first request left: tell the converter, once."""
        announce, self.announce = self.announce, None
        if announce is not None:
            announce()


_PAGE: ContextVar[PageContext | None] = ContextVar("page", default=None)


@contextlib.contextmanager
def on_page(page: PageContext) -> Iterator[PageContext]:
    """`page` is what calls made in this context work on, until the block ends."""
    token = _PAGE.set(page)
    try:
        yield page
    finally:
        _PAGE.reset(token)


def this_page() -> PageContext | None:
    """The page the calls made in this context work on (None outside a page)."""
    return _PAGE.get()

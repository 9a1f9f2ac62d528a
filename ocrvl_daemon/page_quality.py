"""What to do with a page whose answer was cut off at the token limit.

A cut-off answer is either a page that needs more tokens (a long table) or a model caught in
a loop, repeating itself until the limit. More tokens help only the first, and a redo starts
the page from scratch, so it is bounded: a page is redone at most once, with at most
REDO_GROWTH times its first limit (never above what the server's `max-model-len` allows),
and the redos of a document may take about REDO_SHARE of the tokens its pages took the
first time. An answer that is not redone, or is cut off again, is kept and flagged.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from enum import Enum

REDO_GROWTH = 2
REDO_SHARE = 0.25
# A loop is told from text by how well the end of the answer compresses. zlib over the last
# 2,000 characters measured 1.6-1.7 on English prose, 2.5-3.3 on Markdown tables, numbered
# lists and random words from a 32-word vocabulary (the fake server's filler), 5.0 on an HTML
# table of numbers, and 14-31 on a phrase or a 32-word cycle repeated to the limit. 8 sits
# well clear of both (Whisper's 2.4 is for short segments; longer windows compress better).
# A table that ends in a long run of identical empty cells reads as a loop too: it is kept
# as it is, which costs a flag, not a wrong page.
LOOP_WINDOW_CHARS = 2000
LOOP_COMPRESSION_RATIO = 8.0


def looks_like_a_loop(text: str) -> bool:
    """Whether the end of `text` repeats itself like a model caught in a loop."""
    tail = text[-LOOP_WINDOW_CHARS:].encode("utf-8")
    if not tail:
        return False
    return len(tail) / len(zlib.compress(tail, 9)) >= LOOP_COMPRESSION_RATIO


class KeptBecause(str, Enum):
    """Why a cut-off answer is kept as it is."""

    LOOP = "loop"  # more tokens would not end it
    CEILING = "ceiling"  # the server's max-model-len allows no more tokens
    REDONE = "redone"  # cut off again after its one redo
    BUDGET = "budget"  # the document's redos took their share already


@dataclass
class RedoLedger:
    """The tokens one document's pages took, first time and redone, and which were redone."""

    first_pass: int = 0
    extra: int = 0
    redo_limits: dict[int, int] = field(default_factory=dict)  # page -> its redo's limit
    _out: set[int] = field(default_factory=set)  # redos not answered yet

    def count(self, page: int, tokens: int) -> None:
        """The answer of `page` took `tokens` (its first time, or its redo)."""
        if page in self._out:
            self._out.discard(page)
            self.extra += tokens
        elif page not in self.redo_limits:
            self.first_pass += tokens

    def decide(self, page: int, cut_at: int, ceiling: int, looping: bool) -> int | KeptBecause:
        """The token limit to redo `page` with, or why its answer cut off at `cut_at` stays.

        `ceiling`: the most new tokens the server allows a request (0: it does not say).
        """
        if page in self.redo_limits:
            return KeptBecause.CEILING if cut_at >= ceiling else KeptBecause.REDONE
        if looping:
            # A loop is not redone with more tokens: it would only loop longer.
            return KeptBecause.LOOP
        limit = min(cut_at * REDO_GROWTH, ceiling)
        if limit <= cut_at:
            return KeptBecause.CEILING
        # Redos not answered yet count with the tokens they asked for, so pages cut off
        # together cannot all start one before the first is counted.
        asked = sum(self.redo_limits[p] for p in self._out)
        if self.extra + asked >= REDO_SHARE * self.first_pass:
            return KeptBecause.BUDGET
        self.redo_limits[page] = limit
        self._out.add(page)
        return limit

"""How good a page's answer is, and the settings and reasons of a page sent again.

Vision-language OCR fails in ways plain OCR does not: an answer that repeats a phrase until
the token limit (a loop), an answer cut off at the limit, an empty answer for a page with
ink on it, garbage characters. `assess` turns the signals of one answer into a
`PageQuality` record (kept in the store, shown in the Markdown, `ocrvl status` and the JSON
output) with a verdict: ok, suspect or bad. With layout detection a page is many answers, one
per block: each block is judged, and the page is as good as its worst block (`worst_of`).

What is done with a page that is not ok is decided in `core.redo`: it is sent again with a
`Redo` (more tokens, or the loop-breaking penalty), or kept flagged, `KeptBecause` of a
reason its note (`flag_note`) explains.
"""

from __future__ import annotations

import unicodedata
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from enum import Enum
from typing import Any

REDO_GROWTH = 2
# vLLM's repetition_penalty divides the logits of tokens already in the prompt or the
# answer. 1.05 is what PaddleOCR-VL's own examples suggest against repetition; a second
# try goes further. Above ~1.3 a page of real text (which repeats "the", digits, table
# pipes) starts to lose words, so the penalty is used only on a page that looped.
LOOP_PENALTIES = (1.05, 1.15)
LOOP_RETRIES = len(LOOP_PENALTIES)
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


# Replacement (U+FFFD) and control characters (not newline or tab) in a page's text. Real
# OCR output has none; a few may come from a damaged scan, so 1% makes a page suspect and
# 10% (garbage more than text) bad. Pages under BAD_CHARS_MIN_TEXT characters are not judged.
BAD_CHARS_SUSPECT = 0.01
BAD_CHARS_BAD = 0.10
BAD_CHARS_MIN_TEXT = 20


def repetition(text: str) -> float:
    """How well the end of `text` compresses (zlib ratio over LOOP_WINDOW_CHARS; 0: empty)."""
    tail = text[-LOOP_WINDOW_CHARS:].encode("utf-8")
    if not tail:
        return 0.0
    return len(tail) / len(zlib.compress(tail, 9))


def looks_like_a_loop(text: str) -> bool:
    """Whether the end of `text` repeats itself like a model caught in a loop."""
    return repetition(text) >= LOOP_COMPRESSION_RATIO


def bad_char_share(text: str) -> float:
    """The share of replacement and control characters in `text`."""
    if not text:
        return 0.0
    bad = sum(1 for c in text
              if c == "\ufffd" or (unicodedata.category(c) == "Cc" and c not in "\n\r\t"))
    return bad / len(text)


class Verdict(str, Enum):
    """How much a page's text can be trusted (in order: a higher one is better)."""

    BAD = "bad"
    SUSPECT = "suspect"
    OK = "ok"

    @property
    def rank(self) -> int:
        """0 for bad, 1 for suspect, 2 for ok."""
        return list(Verdict).index(self)


@dataclass(frozen=True)
class PageQuality:
    """The quality record of one page's answer, and its verdict with the reason."""

    finish_reason: str | None  # "length" when an answer was cut off at the token limit
    output_tokens: int
    repetition: float  # zlib ratio of the answer's end (LOOP_COMPRESSION_RATIO: a loop)
    empty_with_ink: bool  # the page image has content, the answer has none
    bad_chars: float  # share of replacement and control characters
    verdict: Verdict = Verdict.OK
    reason: str | None = None  # repetition, cut-off, empty, garbage

    def to_json(self) -> dict[str, Any]:
        """The record as plain JSON values."""
        data = asdict(self)
        data["verdict"] = self.verdict.value
        data["repetition"] = round(self.repetition, 2)
        data["bad_chars"] = round(self.bad_chars, 4)
        return data

    @property
    def merit(self) -> tuple[int, bool]:
        """What makes one answer of a page better than another (higher is better)."""
        return self.verdict.rank, not self.empty_with_ink

    @property
    def flagged(self) -> bool:
        """Whether the page is not ok."""
        return self.verdict is not Verdict.OK


def assess(text: str, finish_reason: str | None, output_tokens: int, looping: bool,
           has_ink: bool, answer_repetition: float = 0.0) -> PageQuality:
    """The quality record of a page's answer `text`.

    `looping`: an answer cut off at the limit repeats itself (the engine checks each answer,
    since one looping block of many need not be at the end of the page). `has_ink`: the page
    image is not blank. `answer_repetition`: the worst repetition of the page's answers.
    """
    rep = max(answer_repetition, repetition(text))
    empty = has_ink and not text.strip()
    share = bad_char_share(text) if len(text) >= BAD_CHARS_MIN_TEXT else 0.0
    verdict, reason = Verdict.OK, None
    if looping:
        verdict, reason = Verdict.BAD, "repetition"
    elif empty:
        verdict, reason = Verdict.BAD, "empty"
    elif share >= BAD_CHARS_BAD:
        verdict, reason = Verdict.BAD, "garbage"
    elif finish_reason == "length":
        verdict, reason = Verdict.SUSPECT, "cut-off"
    elif share >= BAD_CHARS_SUSPECT:
        verdict, reason = Verdict.SUSPECT, "garbage"
    return PageQuality(finish_reason, output_tokens, rep, empty, share, verdict, reason)


def worst_of(page: PageQuality, blocks: Iterable[PageQuality]) -> PageQuality:
    """The page's record (`page`: its signals over the whole answer) with the verdict and
    reason of its worst block where that one is worse, and the worst block's share of bad
    characters: one garbled block among 30 is not diluted by the other 29."""
    worst = page
    for block in blocks:
        if block.verdict.rank < worst.verdict.rank:
            worst = block
    share = max([page.bad_chars, *(b.bad_chars for b in blocks)])
    return replace(page, verdict=worst.verdict, reason=worst.reason, bad_chars=share)


class KeptBecause(str, Enum):
    """Why an answer that is cut off or loops is kept as it is."""

    LOOP = "loop"  # it looped again after LOOP_RETRIES loop-breaking tries
    CEILING = "ceiling"  # the server's max-model-len allows no more tokens
    REDONE = "redone"  # cut off again after its one redo
    BUDGET = "budget"  # the document's redos took their share already


@dataclass(frozen=True)
class Redo:
    """How a page (or one of its blocks) is sent again: its token limit, and the loop-breaking
    penalty if any."""

    max_new_tokens: int
    repetition_penalty: float | None = None


def flag_note(page: int, quality: PageQuality, why: Redo | KeptBecause | None,
              cut_at: int | None, retry: str, external_server: bool,
              where: str = "") -> str | None:
    """The note of page `page` (0-based) kept although it is not ok (None when it is ok).

    `why` is the ledger's decision, `cut_at` the token limit that cut its answer off,
    `retry` the command that redoes it; `external_server`: ocrvl does not run the server;
    `where`: the blocks to blame, if the page has several ("block 7 of 30"; "": the page).
    """
    if not quality.flagged:
        return None
    if isinstance(why, KeptBecause) and cut_at is not None:
        return _cut_off_note(page, cut_at, why, retry, external_server, where)
    what = {"repetition": "the answer repeats itself (the model looped)",
            "empty": "the answer is empty although the page has ink on it",
            "garbage": f"{quality.bad_chars:.0%} of the answer are replacement or control "
                       "characters",
            "cut-off": "the answer was cut off at the token limit"}.get(
                quality.reason or "", str(quality.reason))
    where = f" ({where})" if where else ""
    return f"page {page + 1} is {quality.verdict.value}: {what}{where}. Redo it with: {retry}"


def _cut_off_note(page: int, cut_at: int, why: KeptBecause, retry: str,
                  external_server: bool, where: str) -> str:
    """The note of a page kept although its answer (in the blocks `where`, if named) was cut
    off at `cut_at` tokens."""
    head = f"page {page + 1} was cut off at {cut_at} tokens{f' ({where})' if where else ''}"
    if why is KeptBecause.LOOP:
        return (f"{head}: the answer repeats itself (the model looped), also when sent "
                "again with a repetition penalty; its end may be missing or garbled.")
    if why is KeptBecause.BUDGET:
        return (f"{head} and not redone: redoing this document's bad pages took "
                f"{REDO_SHARE:.0%} of its tokens already; its end may be missing. "
                f"Redo it with: {retry}")
    if why is KeptBecause.REDONE:
        return (f"{head}, also after a redo with more tokens; its end may be missing. "
                f"Raise model.max_new_tokens, then: {retry}")
    # The server's max-model-len allows no more: where to raise it depends on who runs it.
    if external_server:
        fix = "Raise --max-model-len on the server you run"
    else:
        fix = "Raise server.vllm_args.max-model-len"
    return (f"{head} (the server's max-model-len allows no more); its end may be missing. "
            f"{fix}, then: {retry}")

"""How good a page's answer is, and what to do with a page whose answer is not.

Vision-language OCR fails in ways plain OCR does not: an answer that repeats a phrase until
the token limit (a loop), an answer cut off at the limit, an empty answer for a page with
ink on it, garbage characters. `assess` turns the signals of one answer into a
`PageQuality` record (kept in the store, shown in the Markdown, `ocrvl status` and the JSON
output) with a verdict: ok, suspect or bad.

A cut-off answer is either a page that needs more tokens (a long table) or a model caught in
a loop. More tokens help only the first: a cut-off page that does not loop is redone at most
once, with at most REDO_GROWTH times its first limit (never above what the server's
`max-model-len` allows). A loop is sent again, at most LOOP_RETRIES times, with vLLM's
loop-breaking sampling parameter (`repetition_penalty` > 1) and the same limit; every
looping page (or block) gets its first retry before any gets a second. The redos of a
document may generate about REDO_SHARE of the tokens its pages generated the first time. A
page that stays bad keeps its best answer, flagged.

With layout detection a page is many answers, one per block: each block is judged, the page
is as good as its worst block (`worst_of`), and a redo sends again only the blocks that were
cut off or looped (the ledger keeps the others' answers: `keep`), so the budget counts only
what those generate. Each of those is decided as a page of that one answer would be
(`decide_blocks`): in one redo a cut-off block gets more tokens while a looping one gets the
penalty.
"""

from __future__ import annotations

import unicodedata
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
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


class Later(Enum):
    """A page's next loop-breaking retry waits until the document's other pages are in."""

    # Each looping page gets its first retry before any page gets a second.
    AFTER_FIRST_RETRIES = "after-first-retries"
    # A loop stopped as soon as it shows comes back before most of its document's pages, when
    # the budget (a share of what they generate) knows little of them: a retry it refuses
    # then is decided again once they are in.
    AFTER_FIRST_PASS = "after-first-pass"


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


# The key under which the ledger follows a page sent as one answer (layout detection off).
WHOLE_PAGE = ""


@dataclass(frozen=True)
class BlockId:
    """One answer of one page, as the ledger follows it: the page, and the block's key
    (`BlockAnswer.key`; WHOLE_PAGE for a page of one answer)."""

    page: int
    key: str = WHOLE_PAGE


@dataclass(frozen=True)
class CutBlock:
    """One block's answer cut off at the token limit `cut_at`, and whether it loops."""

    key: str
    cut_at: int
    looping: bool


@dataclass(frozen=True)
class BlockRedos:
    """A page sent again for some of its blocks: each one's `Redo` by key (the others'
    answers are kept), and the keys of those sent again because they loop."""

    redos: Mapping[str, Redo]
    looping: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Held:
    """A page whose next loop-breaking retry waits (`Later`): what `release` decides again.
    `per_block`: its blocks are decided one by one (`decide_blocks`), else the page is one
    answer (`decide`)."""

    cuts: tuple[CutBlock, ...]
    ceiling: int
    per_block: bool = False


@dataclass
class RedoLedger:
    """The tokens one document's pages generated, first time and redone, and how each was
    redone.

    Each answer cut off is decided on its own (`BlockId`): a page of one answer as a whole
    (`decide`, its setting in `redos`), a page of many blocks block by block (`decide_blocks`,
    each block's setting in `block_redos`), by the same rules and from the same budget.
    """

    first_pass: int = 0
    extra: int = 0
    redos: dict[int, Redo] = field(default_factory=dict)  # page -> how it is sent now
    # Pages of many blocks: page -> block key -> how that block is sent now (the last setting
    # it was redone with; a block not named goes as the page: `redos`, else its first limit).
    block_redos: dict[int, dict[str, Redo]] = field(default_factory=dict)
    loop_tries: dict[BlockId, int] = field(default_factory=dict)
    # Pages whose next loop-breaking retry waits (`Later`), with what to decide again.
    held: dict[int, Held] = field(default_factory=dict)
    # Pages sent again for some of their blocks: page -> the answers to keep, by key.
    keep: dict[int, Mapping[str, Any]] = field(default_factory=dict)
    # Pages kept without the blocks the server refused on every try: page -> its words.
    refused: dict[int, str] = field(default_factory=dict)
    _answers: int = 0  # first-pass answers counted (a block each)
    _grown: set[BlockId] = field(default_factory=set)  # answers redone with more tokens
    _emptied: set[BlockId] = field(default_factory=set)  # answers sent again for being empty
    _out: dict[int, int] = field(default_factory=dict)  # redos not answered yet: expected tokens
    _best: dict[int, tuple[PageQuality, Any]] = field(default_factory=dict)

    def copy(self) -> RedoLedger:
        """A ledger of its own with the same entries (`decide.decide` changes a copy)."""
        return RedoLedger(self.first_pass, self.extra, dict(self.redos),
                          {page: dict(blocks) for page, blocks in self.block_redos.items()},
                          dict(self.loop_tries), dict(self.held), dict(self.keep),
                          dict(self.refused), self._answers, set(self._grown),
                          set(self._emptied), dict(self._out), dict(self._best))

    @property
    def cap(self) -> int:
        """The extra tokens this document's redos may generate (about; see `decide`)."""
        return int(REDO_SHARE * self.first_pass)

    def count(self, page: int, tokens: int, answers: int = 1, kept_tokens: int = 0) -> None:
        """The `answers` of `page` (a block each) generated `tokens`; `kept_tokens`: those of
        the answers kept from an earlier try. A redo counts only what the server generated;
        a first pass counts the kept answers too (a try that failed, whose good answers were
        kept, is part of it)."""
        if page in self._out:
            del self._out[page]
            self.extra += tokens
        elif page not in self.redos and page not in self.block_redos:
            self.first_pass += tokens + kept_tokens
            self._answers += answers

    def decide(self, page: int, cut_at: int, ceiling: int, looping: bool,
               others_out: bool = False) -> Redo | KeptBecause | Later:
        """How to send `page`, one answer, again, or why its answer, cut off at `cut_at`,
        stays.

        `ceiling`: the most new tokens the server allows a request (0: it does not say).
        `others_out`: other pages of the document are still to come back, which may loop
        and need their first retry: a second one waits for them (`Later`, then `release`), and
        so does a loop's retry that the budget refuses before they are in.
        """
        choice = self._decide(BlockId(page), self.redos.get(page), cut_at, ceiling, looping,
                              others_out)
        if isinstance(choice, Redo):
            self.redos[page] = choice
        elif isinstance(choice, Later):
            self.held[page] = Held((CutBlock(WHOLE_PAGE, cut_at, looping),), ceiling)
        return choice

    def decide_blocks(self, page: int, cuts: Sequence[CutBlock], ceiling: int,
                      others_out: bool = False) -> BlockRedos | KeptBecause | Later:
        """How to send again the blocks of `page` that were cut off (`cuts`, in the page's
        order), each as `decide` would a page of that one answer, or why they all stay.

        Each gets the setting its own answer calls for: one cut off more tokens, one that
        loops the loop-breaking penalty. A block that stays (or whose retry waits) while
        others are sent keeps its answer, and is decided again when the page is back; only
        when no block is sent now does the page wait (`Later`) or stay (the reason of its
        first looping block, else its first block).
        """
        before = self.block_redos.get(page, {})
        choices = {cut.key: self._decide(BlockId(page, cut.key), before.get(cut.key),
                                         cut.cut_at, ceiling, cut.looping, others_out)
                   for cut in cuts}
        redos = {key: c for key, c in choices.items() if isinstance(c, Redo)}
        if redos:
            self.block_redos[page] = {**before, **redos}
            return BlockRedos(redos, frozenset(c.key for c in cuts
                                               if c.looping and c.key in redos))
        waiting = [c for c in choices.values() if isinstance(c, Later)]
        if waiting:
            self.held[page] = Held(tuple(cuts), ceiling, per_block=True)
            return waiting[0]
        worst = next((c for c in cuts if c.looping), cuts[0])
        kept = choices[worst.key]
        assert isinstance(kept, KeptBecause)
        return kept

    def _decide(self, block: BlockId, before: Redo | None, cut_at: int, ceiling: int,
                looping: bool, others_out: bool) -> Redo | KeptBecause | Later:
        """How to send `block`, whose answer was cut off at `cut_at` (and last sent with
        `before`, if redone), again, or why it stays (`decide`)."""
        if looping:
            # More tokens would only loop longer: the same limit, with a penalty.
            tries = self.loop_tries.get(block, 0)
            if tries >= LOOP_RETRIES:
                return KeptBecause.LOOP
            if tries > 0 and others_out:
                return Later.AFTER_FIRST_RETRIES
            redo = Redo(cut_at, LOOP_PENALTIES[tries])
            # A loop broken reads like the document's other answers.
            expected = self.first_pass // max(1, self._answers)
        else:
            if block in self._grown:
                return KeptBecause.CEILING if cut_at >= ceiling else KeptBecause.REDONE
            limit = min(cut_at * REDO_GROWTH, ceiling)
            if limit <= cut_at:
                return KeptBecause.CEILING
            # An answer that stopped looping keeps its penalty.
            redo = Redo(limit, before.repetition_penalty if before else None)
            expected = cut_at  # it needed more than that
        # What redos generated, and what those under way are expected to (not what they ask
        # for: a loop broken stops far below its limit), so answers cut off together cannot
        # all start one before the first is counted.
        if self.extra + sum(self._out.values()) >= self.cap:
            if looping and others_out:
                return Later.AFTER_FIRST_PASS
            return KeptBecause.BUDGET
        if looping:
            self.loop_tries[block] = self.loop_tries.get(block, 0) + 1
        else:
            self._grown.add(block)
        self._out[block.page] = self._out.get(block.page, 0) + expected
        return redo

    def retry_empty(self, page: int, max_new_tokens: int,
                    keys: Sequence[str] = (WHOLE_PAGE,)) -> Redo | BlockRedos | KeptBecause:
        """How to send again once the answers of `page` that came back empty although there is
        ink (`keys`: its blocks; WHOLE_PAGE, a page of one answer), each at its limit and
        penalty as they were, or why they stay: each was sent again already, or the
        document's redos took their share."""
        fresh = [key for key in keys if BlockId(page, key) not in self._emptied]
        if not fresh:
            return KeptBecause.REDONE
        if self.extra + sum(self._out.values()) >= self.cap:
            return KeptBecause.BUDGET
        self._emptied.update(BlockId(page, key) for key in fresh)
        # Each reads like the document's other answers when it comes back.
        self._out[page] = (self._out.get(page, 0)
                           + len(fresh) * self.first_pass // max(1, self._answers))
        as_sent = self.redos.get(page, Redo(max_new_tokens))
        if list(keys) == [WHOLE_PAGE]:
            self.redos[page] = as_sent
            return as_sent
        before = self.block_redos.get(page, {})
        redos = {key: before.get(key, as_sent) for key in fresh}
        self.block_redos[page] = {**before, **redos}
        return BlockRedos(redos)

    def refuse(self, page: int, keys: Sequence[str], error: str) -> None:
        """The server refused the blocks `keys` of `page` on every try (`error`): the page is
        kept without them, left empty and not sent again for being empty."""
        self._emptied.update(BlockId(page, key) for key in keys)
        self.refused[page] = error

    def release(self, page: int) -> Redo | BlockRedos | KeptBecause:
        """The decision for a page held by `Later`, once the document's other pages are in."""
        held = self.held.pop(page)
        decision: Redo | BlockRedos | KeptBecause | Later
        if held.per_block:
            decision = self.decide_blocks(page, held.cuts, held.ceiling)
        else:
            (cut,) = held.cuts
            decision = self.decide(page, cut.cut_at, held.ceiling, cut.looping)
        assert not isinstance(decision, Later)
        return decision

    def best(self, page: int, quality: PageQuality, answer: Any) -> tuple[PageQuality, Any]:
        """The best answer of `page` so far, this one included: the better verdict, then one
        with text over an empty one; a later one wins a tie."""
        kept = self._best.get(page)
        if kept is None or quality.merit >= kept[0].merit:
            kept = (quality, answer)
        self._best[page] = kept
        return kept

    def kept(self, page: int) -> tuple[PageQuality, Any] | None:
        """The best answer of `page` while it is being sent again, if any."""
        return self._best.get(page)

    def settle(self, page: int) -> None:
        """`page` is checkpointed: its earlier answers are no longer needed (and a redo of it
        that failed asks for no tokens any more)."""
        self._best.pop(page, None)
        self._out.pop(page, None)
        self.held.pop(page, None)
        self.keep.pop(page, None)
        self.refused.pop(page, None)


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

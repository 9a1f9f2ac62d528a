"""How a page whose answer is cut off, loops or is empty is sent again, within its document's
redo budget: the decisions, and the values they read and make.

A cut-off answer is either a page that needs more tokens (a long table) or a model caught in
a loop. More tokens help only the first: a cut-off page that does not loop is redone at most
once, with at most REDO_GROWTH times its first limit (never above what the server's
`max-model-len` allows). A loop is sent again, at most LOOP_RETRIES times, with vLLM's
loop-breaking sampling parameter (`repetition_penalty` > 1) and the same limit; every
looping page (or block) gets its first retry before any gets a second. The redos of a
document may generate about REDO_SHARE of the tokens its pages generated the first time.

With layout detection a page is many answers, one per block: a redo sends again only the
blocks that were cut off or looped (the page's record keeps the others' answers: `keep`), so
the budget counts only what those generate. Each is decided as a page of that one answer
would be (`Ledger.decide_blocks`): in one redo a cut-off block gets more tokens while a
looping one gets the penalty.

Everything here is a value: a page's `RedoRecord`, its document's `RedoBudget`, and the
`Ledger` a decision reads (both, and what the redos of the document's other pages under way
are expected to generate). Each decision returns its choice with a new `Ledger`; nothing is
changed in place, so a decision cannot share state with the document it came from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from ocrvl_daemon.core.quality import (
    LOOP_PENALTIES,
    LOOP_RETRIES,
    REDO_GROWTH,
    REDO_SHARE,
    KeptBecause,
    PageQuality,
    Redo,
)

# The key under which a page sent as one answer (layout detection off) is followed.
WHOLE_PAGE = ""


class Later(Enum):
    """A page's next loop-breaking retry waits until the document's other pages are in."""

    # Each looping page gets its first retry before any page gets a second.
    AFTER_FIRST_RETRIES = "after-first-retries"
    # A loop stopped as soon as it shows comes back before most of its document's pages, when
    # the budget (a share of what they generate) knows little of them: a retry it refuses
    # then is decided again once they are in.
    AFTER_FIRST_PASS = "after-first-pass"


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
class RedoRecord:
    """How one page has been redone, and what it keeps while it is sent again.

    The mappings are never changed in place: each decision makes new ones.
    """

    whole: Redo | None = None  # how the page, one answer, is sent now (None: as first sent)
    # A page of many blocks: how each block redone is sent now (a block not named goes as
    # the page: `whole`, else its first limit).
    blocks: Mapping[str, Redo] = field(default_factory=dict)
    loop_tries: Mapping[str, int] = field(default_factory=dict)  # by block key
    grown: frozenset[str] = frozenset()  # blocks redone with more tokens
    emptied: frozenset[str] = frozenset()  # blocks sent again for being empty
    # The answers kept while the others are sent again, by block key.
    keep: Mapping[str, Any] = field(default_factory=dict)
    refused: str | None = None  # the server's words for blocks it refused on every try
    # Tokens the redo under way is expected to generate (None: no redo is under way).
    expected: int | None = None
    best: tuple[PageQuality, Any] | None = None  # the best answer so far, with its record

    @property
    def redone(self) -> bool:
        """Whether the page (or one of its blocks) was sent again with another setting."""
        return self.whole is not None or bool(self.blocks)

    def settled(self) -> RedoRecord:
        """The record once the page is answered: its earlier answers are no longer needed
        (and a redo of it that failed asks for no tokens any more); how it was redone stays,
        for the document's summary."""
        return replace(self, keep={}, refused=None, expected=None, best=None)


@dataclass(frozen=True)
class RedoBudget:
    """The tokens one document's pages generated: the first time (`answers` of them, a block
    each) and redone (`extra`)."""

    first_pass: int = 0
    extra: int = 0
    answers: int = 0

    @property
    def cap(self) -> int:
        """The extra tokens this document's redos may generate (about: see `Ledger`)."""
        return int(REDO_SHARE * self.first_pass)

    @property
    def typical(self) -> int:
        """What one answer of the document generated the first time, on average."""
        return self.first_pass // max(1, self.answers)


@dataclass(frozen=True)
class Ledger:
    """What a redo decision about one page reads: its document's `budget`, the page's own
    `record`, and the tokens the redos of the document's other pages under way are expected
    to generate (`others_expected`)."""

    budget: RedoBudget
    record: RedoRecord
    others_expected: int = 0

    @property
    def spent(self) -> bool:
        """Whether the redos generated, and those under way are expected to generate, the
        document's share: no other starts (not what they ask for: a loop broken stops far
        below its limit, and answers cut off together must not all start before the first
        is counted)."""
        under_way = self.others_expected + (self.record.expected or 0)
        return self.budget.extra + under_way >= self.budget.cap

    def counted(self, tokens: int, answers: int = 1, kept_tokens: int = 0) -> Ledger:
        """The page's `answers` (a block each) generated `tokens`; `kept_tokens`: those of the
        answers kept from an earlier try. A redo counts only what the server generated; a
        first pass counts the kept answers too (a try that failed, whose good answers were
        kept, is part of it)."""
        budget, record = self.budget, self.record
        if record.expected is not None:
            budget = replace(budget, extra=budget.extra + tokens)
            record = replace(record, expected=None)
        elif not record.redone:
            budget = replace(budget, first_pass=budget.first_pass + tokens + kept_tokens,
                             answers=budget.answers + answers)
        return replace(self, budget=budget, record=record)

    def decide(self, cut_at: int, ceiling: int, looping: bool, others_out: bool = False
               ) -> tuple[Redo | KeptBecause | Later, Ledger]:
        """How to send the page, one answer cut off at `cut_at`, again, or why its answer
        stays.

        `ceiling`: the most new tokens the server allows a request (0: it does not say).
        `others_out`: other pages of the document are still to come back, which may loop
        and need their first retry: a second one waits for them (`Later`), and so does a
        loop's retry that the budget refuses before they are in.
        """
        choice, ledger = self._decide(WHOLE_PAGE, self.record.whole, cut_at, ceiling, looping,
                                      others_out)
        if isinstance(choice, Redo):
            ledger = ledger._with(whole=choice)
        return choice, ledger

    def decide_blocks(self, cuts: Sequence[CutBlock], ceiling: int, others_out: bool = False
                      ) -> tuple[BlockRedos | KeptBecause | Later, Ledger]:
        """How to send again the blocks of the page that were cut off (`cuts`, in the page's
        order), each as `decide` would a page of that one answer, or why they all stay.

        Each gets the setting its own answer calls for: one cut off more tokens, one that
        loops the loop-breaking penalty. A block that stays (or whose retry waits) while
        others are sent keeps its answer, and is decided again when the page is back; only
        when no block is sent now does the page wait (`Later`) or stay (the reason of its
        first looping block, else its first block).
        """
        before = self.record.blocks
        ledger = self
        choices: dict[str, Redo | KeptBecause | Later] = {}
        for cut in cuts:
            choices[cut.key], ledger = ledger._decide(cut.key, before.get(cut.key), cut.cut_at,
                                                      ceiling, cut.looping, others_out)
        redos = {key: c for key, c in choices.items() if isinstance(c, Redo)}
        if redos:
            looping = frozenset(c.key for c in cuts if c.looping and c.key in redos)
            return BlockRedos(redos, looping), ledger._with(blocks={**before, **redos})
        waiting = [c for c in choices.values() if isinstance(c, Later)]
        if waiting:
            return waiting[0], ledger
        worst = next((c for c in cuts if c.looping), cuts[0])
        kept = choices[worst.key]
        assert isinstance(kept, KeptBecause)
        return kept, ledger

    def _decide(self, key: str, before: Redo | None, cut_at: int, ceiling: int, looping: bool,
                others_out: bool) -> tuple[Redo | KeptBecause | Later, Ledger]:
        """How to send block `key`, whose answer was cut off at `cut_at` (and last sent with
        `before`, if redone), again, or why it stays (`decide`)."""
        record = self.record
        if looping:
            # More tokens would only loop longer: the same limit, with a penalty.
            tries = record.loop_tries.get(key, 0)
            if tries >= LOOP_RETRIES:
                return KeptBecause.LOOP, self
            if tries > 0 and others_out:
                return Later.AFTER_FIRST_RETRIES, self
            redo = Redo(cut_at, LOOP_PENALTIES[tries])
            expected = self.budget.typical  # a loop broken reads like the document's others
        else:
            if key in record.grown:
                return (KeptBecause.CEILING if cut_at >= ceiling else KeptBecause.REDONE), self
            limit = min(cut_at * REDO_GROWTH, ceiling)
            if limit <= cut_at:
                return KeptBecause.CEILING, self
            # An answer that stopped looping keeps its penalty.
            redo = Redo(limit, before.repetition_penalty if before else None)
            expected = cut_at  # it needed more than that
        if self.spent:
            if looping and others_out:
                return Later.AFTER_FIRST_PASS, self
            return KeptBecause.BUDGET, self
        if looping:
            record = replace(record, loop_tries={**record.loop_tries, key: tries + 1})
        else:
            record = replace(record, grown=record.grown | {key})
        return redo, replace(self, record=record)._expecting(expected)

    def retry_empty(self, max_new_tokens: int, keys: Sequence[str] = (WHOLE_PAGE,)
                    ) -> tuple[Redo | BlockRedos | KeptBecause, Ledger]:
        """How to send again once the answers of the page that came back empty although there
        is ink (`keys`: its blocks; WHOLE_PAGE, a page of one answer), each at its limit and
        penalty as they were, or why they stay: each was sent again already, or the
        document's redos took their share."""
        record = self.record
        fresh = [key for key in keys if key not in record.emptied]
        if not fresh:
            return KeptBecause.REDONE, self
        if self.spent:
            return KeptBecause.BUDGET, self
        # Each reads like the document's other answers when it comes back.
        ledger = self._with(emptied=record.emptied | set(fresh))._expecting(
            len(fresh) * self.budget.typical)
        as_sent = record.whole or Redo(max_new_tokens)
        if list(keys) == [WHOLE_PAGE]:
            return as_sent, ledger._with(whole=as_sent)
        redos = {key: record.blocks.get(key, as_sent) for key in fresh}
        return BlockRedos(redos), ledger._with(blocks={**record.blocks, **redos})

    def refuse(self, keys: Sequence[str], error: str) -> Ledger:
        """The server refused the blocks `keys` of the page on every try (`error`): the page
        is kept without them, left empty and not sent again for being empty."""
        return self._with(emptied=self.record.emptied | set(keys), refused=error)

    def release(self, cuts: Sequence[CutBlock], ceiling: int, per_block: bool
                ) -> tuple[Redo | BlockRedos | KeptBecause, Ledger]:
        """The decision for a page held by `Later` (its `cuts`, as they were), once the
        document's other pages are in."""
        decision: Redo | BlockRedos | KeptBecause | Later
        if per_block:
            decision, ledger = self.decide_blocks(cuts, ceiling)
        else:
            (cut,) = cuts
            decision, ledger = self.decide(cut.cut_at, ceiling, cut.looping)
        assert not isinstance(decision, Later)
        return decision, ledger

    def with_best(self, quality: PageQuality, answer: Any) -> Ledger:
        """The page's best answer so far, this one included: the better verdict, then one with
        text over an empty one; a later one wins a tie."""
        kept = self.record.best
        if kept is None or quality.merit >= kept[0].merit:
            kept = (quality, answer)
        return self._with(best=kept)

    def keeping(self, answers: Mapping[str, Any], only: bool = False) -> Ledger:
        """The page keeps `answers` too while it is sent again (`only`: those alone)."""
        return self._with(keep=dict(answers) if only else {**self.record.keep, **answers})

    def without(self, choice: object) -> Ledger:
        """The answers the page keeps, less the blocks `choice` sends again (if it is a
        `BlockRedos`)."""
        if not isinstance(choice, BlockRedos):
            return self
        return self._with(keep={k: a for k, a in self.record.keep.items()
                                if k not in choice.redos})

    def _expecting(self, tokens: int) -> Ledger:
        """The page's redo under way is expected to generate `tokens` more."""
        return self._with(expected=(self.record.expected or 0) + tokens)

    def _with(self, **changes: Any) -> Ledger:
        return replace(self, record=replace(self.record, **changes))

"""A vLLM (0.26, v1 engine) logits processor for random weights: realistic answer lengths, and
a chosen share of pages that loop as a real model sometimes does.

A looping page repeats a phrase until its token limit (4096 by default), unless ocrvl stops
it early (`pipeline.stop_loops_early`: the answer streams, is scored every 64 tokens and
closed once it loops). The pages that loop are chosen like the answer lengths: by the
request's prompt length (the page image's token count), seeded, so a page loops for every
client, in any order. A request that carries the loop-breaking sampling parameter
(`repetition_penalty` > 1, which ocrvl sends when it sends a looping page again) gets its
ordinary answer instead, as the fake server does with `--loop-widths`. Other pages answer
text that ends at their drawn length: `answer_lengths.LognormalAnswerLengths`, whose
per-request scripts (a token forced at every step, chosen by the prompt length) this reuses;
only a looping page's script differs.

    vllm serve DIR --load-format dummy \
        --logits-processors bench.gpu.loop_pages:LoopingAnswerLengths
    ($OCRVL_BENCH_LOOP_PAGES "SHARE:SEED", default 0.1:23; lengths as answer_lengths says)

The phrase is made of the single-character tokens of `bench.gpu.dummy_model`'s tokenizer, so
2,000 characters (the loop score's window) take 2,000 tokens.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.gpu.answer_lengths import LognormalAnswerLengths, Script
from bench.gpu.dummy_model import char_tokens

ENV = "OCRVL_BENCH_LOOP_PAGES"
DEFAULT = "0.1:23"
PHRASE = "| 0.5 | loop | "  # what a looping page repeats, like a table's row


@dataclass(frozen=True)
class LoopingPages:
    """Which pages loop: a `share` of prompt lengths, drawn with `seed`."""

    share: float
    seed: int

    @classmethod
    def parse(cls, spec: str) -> LoopingPages:
        try:
            share, seed = spec.split(":")
            pages = cls(float(share), int(seed))
        except ValueError:
            raise ValueError(f"looping pages {spec!r}: expected SHARE:SEED, e.g. "
                             f"{DEFAULT}") from None  # fmt: skip
        if not 0 <= pages.share <= 1:
            raise ValueError(f"looping pages {spec!r}: the share is from 0 to 1")
        return pages

    def __str__(self) -> str:
        return f"{self.share:g}:{self.seed}"

    def loops(self, page: int) -> bool:
        """Whether the page whose prompt is `page` tokens long loops."""
        return random.Random(f"{self.seed}:loop:{page}").random() < self.share


def phrase_tokens() -> list[int]:
    """PHRASE as the dummy tokenizer's ids, one per character (the space is its `▁`)."""
    return char_tokens(PHRASE)


def loop_breaking(params: Any) -> bool:
    """Whether the request's sampling parameters ask for a loop to be broken."""
    return (getattr(params, "repetition_penalty", None) or 1.0) > 1.0


class LoopingAnswerLengths(LognormalAnswerLengths):
    """Pages chosen by `LoopingPages` repeat PHRASE to their token limit; the others end at
    their drawn length."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.looping = LoopingPages.parse(os.environ.get(ENV, DEFAULT))
        self.cycle = phrase_tokens()

    def script(self, prompt: Sequence[int], params: Any) -> Script:
        if not self.looping.loops(len(prompt)) or loop_breaking(params):
            return super().script(prompt, params)
        cycle = self.cycle
        return lambda output: cycle[len(output) % len(cycle)]

"""Realistic answer lengths for a model with random weights (no torch, no vLLM here).

Real pages range from blank (tens of tokens) to dense (1-2k tokens), and a page's answer
is as long whoever sends it, in whatever order. So the length is drawn per page: seeded
by the request's prompt length (the page image's token count, which follows the page's
size), from `lognormal(median, sigma)`, clipped. Every client gets the same length for the
same page, and a small document gets the same lengths alone and under a book.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

ENV = "OCRVL_BENCH_ANSWER_LENGTHS"  # "MEDIAN:SIGMA:SEED" in the vLLM server's environment
DEFAULT = "500:0.9:17"
SHORTEST, LONGEST = 16, 3000  # LONGEST stays below ocrvl's 4096-token limit: no cut-off redos


@dataclass(frozen=True)
class AnswerLengths:
    """A lognormal distribution of answer lengths, clipped to [SHORTEST, LONGEST]."""

    median: float
    sigma: float
    seed: int

    @classmethod
    def parse(cls, spec: str) -> AnswerLengths:
        try:
            median, sigma, seed = spec.split(":")
            return cls(float(median), float(sigma), int(seed))
        except ValueError:
            raise ValueError(f"answer lengths {spec!r}: expected MEDIAN:SIGMA:SEED, "
                             f"e.g. {DEFAULT}") from None  # fmt: skip

    def __str__(self) -> str:
        return f"{self.median:g}:{self.sigma:g}:{self.seed}"

    def length(self, page: int) -> int:
        """The answer length for the page whose prompt is `page` tokens long."""
        draw = random.Random(f"{self.seed}:{page}").lognormvariate(math.log(self.median),
                                                                  self.sigma)  # fmt: skip
        return min(LONGEST, max(SHORTEST, round(draw)))

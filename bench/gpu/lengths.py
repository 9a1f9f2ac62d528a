"""Realistic answer lengths for a model with random weights (no torch, no vLLM here).

Real pages range from blank (tens of tokens) to dense (1-2k tokens). The n-th answer of a
run is `lognormal(median, sigma)` tokens, clipped, from one seeded sequence: every client
gets the same lengths in the order it sends its pages, so totals match between contenders.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
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

    def sequence(self) -> Iterator[int]:
        """The lengths of the 1st, 2nd, ... answer (the same every time)."""
        rng = random.Random(self.seed)
        mu = math.log(self.median)
        while True:
            yield min(LONGEST, max(SHORTEST, round(rng.lognormvariate(mu, self.sigma))))

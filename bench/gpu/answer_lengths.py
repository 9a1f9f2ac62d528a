"""A vLLM (0.26, v1 engine) logits processor that ends every answer at a realistic length.

A model with random weights never emits EOS, so every answer would run to its token limit
and every page would cost the same: B2's bursts would look nearly optimal. This processor
forces EOS once a request has `AnswerLengths.length(len(prompt))` tokens: the length is
drawn per page (see bench/gpu/lengths.py), the same for every client and order. Per step it
costs one pass over the running requests in Python and, only when some are due, one small
index write. Subclasses choose other tokens per request (`script`: bench.gpu.loop_pages).

    vllm serve DIR --load-format dummy \
        --logits-processors bench.gpu.answer_lengths:LognormalAnswerLengths
    (the lengths from $OCRVL_BENCH_ANSWER_LENGTHS, "MEDIAN:SIGMA:SEED", default 500:0.9:17)
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from bench.gpu.lengths import DEFAULT, ENV, AnswerLengths

try:
    import torch
    from vllm.v1.sample.logits_processor.interface import (
        BatchUpdate,
        LogitsProcessor,
        MoveDirectionality,
    )
except ImportError:  # the row bookkeeping is tested without vLLM (and torch)
    LogitsProcessor = object  # type: ignore[assignment,misc]

    class MoveDirectionality(enum.Enum):  # type: ignore[no-redef]
        UNIDIRECTIONAL = enum.auto()
        SWAP = enum.auto()

if TYPE_CHECKING:
    from vllm.config import VllmConfig

EOS = 2  # ERNIE-4.5's </s>, where the config does not say

# What a request's row forces, given its output so far: a token id, or None (leave it).
Script = Callable[[Sequence[int]], "int | None"]


class LognormalAnswerLengths(LogitsProcessor):
    """Forces EOS at each request's drawn length (see the module's docstring)."""

    def __init__(self, vllm_config: VllmConfig | None, device: Any = None,
                 is_pin_memory: bool = False) -> None:  # fmt: skip
        self.eos = eos_token(vllm_config)
        self.lengths = AnswerLengths.parse(os.environ.get(ENV, DEFAULT))
        self.rows: dict[int, tuple[Script, list[int]]] = {}  # row -> (script, output ids)
        self.due: list[tuple[int, int]] = []  # (row, token) forced in the next step

    def script(self, prompt: Sequence[int], params: Any) -> Script:
        """What the request with `prompt` and sampling `params` is made to answer: EOS at its
        page's drawn length."""
        n = self.lengths.length(len(prompt))
        return lambda output: self.eos if len(output) + 1 >= n else None

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token wins, greedy sampling too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:  # in the documented order: removed, added, moved
            for row in batch_update.removed:
                self.rows.pop(row, None)
            for row, params, prompt, output in batch_update.added:
                self.rows[row] = (self.script(prompt or (), params), output)
            for a, b, direction in batch_update.moved:
                entry_a, entry_b = self.rows.pop(a, None), self.rows.pop(b, None)
                if entry_a is not None:
                    self.rows[b] = entry_a
                if entry_b is not None and direction == MoveDirectionality.SWAP:
                    self.rows[a] = entry_b
        self.due = [(row, token) for row, (script, output) in self.rows.items()
                    if (token := script(output)) is not None]  # fmt: skip

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.due:
            rows = torch.tensor([row for row, _ in self.due], device=logits.device,
                                dtype=torch.long)  # fmt: skip
            tokens = torch.tensor([token for _, token in self.due], device=logits.device,
                                  dtype=torch.long)  # fmt: skip
            logits[rows] = float("-inf")
            logits[rows, tokens] = 0.0
        return logits


def eos_token(vllm_config: VllmConfig | None) -> int:
    """The model's EOS id, from its config where it says (EOS otherwise)."""
    if vllm_config is None:
        return EOS
    model = vllm_config.model_config
    eos = getattr(model.hf_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.hf_text_config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0]
    return EOS if eos is None else int(eos)

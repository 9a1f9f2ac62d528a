"""A vLLM (0.26, v1 engine) logits processor that ends every answer at a realistic length.

A model with random weights never emits EOS, so every answer would run to its token limit
and every page would cost the same: B2's bursts would look nearly optimal. This processor
forces EOS once a request has `AnswerLengths.length(len(prompt))` tokens: the length is
drawn per page (see bench/gpu/lengths.py), the same for every client and order. Per step it
costs one pass over the running requests in Python and, only when some are due, one small
index write.

    vllm serve DIR --load-format dummy \
        --logits-processors bench.gpu.answer_lengths:LognormalAnswerLengths
    (the lengths from $OCRVL_BENCH_ANSWER_LENGTHS, "MEDIAN:SIGMA:SEED", default 500:0.9:17)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)

from bench.gpu.lengths import DEFAULT, ENV, AnswerLengths

if TYPE_CHECKING:
    from vllm.config import VllmConfig

EOS = 2  # ERNIE-4.5's </s>, where the config does not say


class LognormalAnswerLengths(LogitsProcessor):
    """Forces EOS at each request's drawn length (see the module's docstring)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device,
                 is_pin_memory: bool) -> None:  # fmt: skip
        model = vllm_config.model_config
        eos = getattr(model.hf_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(model.hf_text_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0]
        self.eos = EOS if eos is None else int(eos)
        self.lengths = AnswerLengths.parse(os.environ.get(ENV, DEFAULT))
        self.rows: dict[int, tuple[int, list[int]]] = {}  # batch row -> (length, output ids)
        self.due: list[int] = []

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token wins, greedy sampling too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:  # in the documented order: removed, added, moved
            for row in batch_update.removed:
                self.rows.pop(row, None)
            for row, _params, prompt, output in batch_update.added:
                self.rows[row] = (self.lengths.length(len(prompt or ())), output)
            for a, b, direction in batch_update.moved:
                entry_a, entry_b = self.rows.pop(a, None), self.rows.pop(b, None)
                if entry_a is not None:
                    self.rows[b] = entry_a
                if entry_b is not None and direction == MoveDirectionality.SWAP:
                    self.rows[a] = entry_b
        self.due = [row for row, (n, output) in self.rows.items() if len(output) + 1 >= n]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.due:
            rows = torch.tensor(self.due, device=logits.device, dtype=torch.long)
            logits[rows] = float("-inf")
            logits[rows, self.eos] = 0.0
        return logits

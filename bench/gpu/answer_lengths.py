"""A vLLM (0.26, v1 engine) logits processor that ends every answer at a realistic length.

A model with random weights never emits EOS, so every answer would run to its token limit
and every page would cost the same: B2's bursts would look nearly optimal. This processor
forces EOS once the n-th request since the server was last idle (for IDLE_RESTART_S) has
`AnswerLengths.sequence()[n]` tokens, so each contender, started on an idle server, gets
the same lengths in the order it sends its pages. Per step it costs one pass over the
running requests in Python and, only when some are due, one small index write.

    vllm serve DIR --load-format dummy \
        --logits-processors bench.gpu.answer_lengths:LognormalAnswerLengths
    (the lengths from $OCRVL_BENCH_ANSWER_LENGTHS, "MEDIAN:SIGMA:SEED", default 500:0.9:17)
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
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

IDLE_RESTART_S = 2.0  # an idle gap this long starts the sequence again
EOS = 2  # ERNIE-4.5's </s>, where the config does not say
PAUSED_KEPT = 4096  # preempted or aborted requests remembered (by their output list)


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
        self.device = device
        self.lengths = AnswerLengths.parse(os.environ.get(ENV, DEFAULT))
        self.sequence: Iterator[int] = self.lengths.sequence()
        self.rows: dict[int, tuple[int, list[int]]] = {}  # batch row -> (length, output ids)
        # A preempted request comes back with the same output list: it keeps its length.
        self.paused: dict[int, tuple[int, list[int]]] = {}
        self.due: list[int] = []
        self.last_busy = 0.0

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token wins, greedy sampling too

    def _evict(self, row: int) -> None:
        entry = self.rows.pop(row, None)
        if entry is not None and len(entry[1]) + 1 < entry[0]:
            self.paused[id(entry[1])] = entry
            if len(self.paused) > PAUSED_KEPT:
                del self.paused[next(iter(self.paused))]

    def _length(self, output: list[int], now: float) -> tuple[int, list[int]]:
        entry = self.paused.pop(id(output), None)
        if entry is not None and entry[1] is output:
            return entry
        if not self.rows and now - self.last_busy > IDLE_RESTART_S:
            self.sequence = self.lengths.sequence()
        return next(self.sequence), output

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        now = time.monotonic()
        if batch_update is not None:  # in the documented order: removed, added, moved
            for row in batch_update.removed:
                self._evict(row)
            for row, _params, _prompt, output in batch_update.added:
                self._evict(row)
                self.rows[row] = self._length(output, now)
            for a, b, direction in batch_update.moved:
                entry_a, entry_b = self.rows.pop(a, None), self.rows.pop(b, None)
                if entry_a is not None:
                    self.rows[b] = entry_a
                if entry_b is not None and direction == MoveDirectionality.SWAP:
                    self.rows[a] = entry_b
        if self.rows:
            self.last_busy = now
        self.due = [row for row, (n, output) in self.rows.items() if len(output) + 1 >= n]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.due:
            rows = torch.tensor(self.due, device=logits.device, dtype=torch.long)
            logits[rows] = float("-inf")
            logits[rows, self.eos] = 0.0
        return logits

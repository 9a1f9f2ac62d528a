"""A vLLM (0.26, v1 engine) logits processor that makes a model with random weights answer
text, of a realistic length.

A model with random weights never emits EOS, so every answer would run to its token limit
and every page would cost the same: B2's bursts would look nearly optimal. Nor does it emit
text: its greedy argmax is a degenerate, repetitive token stream, which ocrvl's loop
detector (`pipeline.stop_loops_early`) rightly stops early and redoes with a repetition
penalty, so ocrvl would generate a fifth of the tokens B2 does. This processor chooses the
token of every step of every request (the model's forward still runs on every step):

- the answer is a window of `prose` (words, punctuation, numbers, paragraphs: one token a
  character of the dummy tokenizer, `bench.gpu.dummy_model.char_tokens`), which reads to
  ocrvl's quality checks like a page of text (zlib ratio ~2, a loop is 8);
- it ends with EOS once it has `AnswerLengths.length(len(prompt))` tokens: the length is
  drawn per page (see bench/gpu/lengths.py), the same for every client and order.

The prose is one text of TEXT_TOKENS characters drawn once from the lengths' SEED; a request
reads it from an offset drawn, like its length, from SEED and its prompt length (the page
image's token count). So a page gets the same answer, text and length, from every client in
any order and batch position, and its retry with a repetition penalty gets it again (a text
that does not loop). Subclasses choose other tokens per request (`script`:
bench.gpu.loop_pages, whose looping pages repeat a phrase).

Per step it costs one Python pass over the running requests (a closure call each, ~0.3 us),
one asynchronous copy of their (row, token) pairs from pinned memory and one indexed write
of one logit a request (set to FORCED_LOGIT): no host synchronisation, a few microseconds of
GPU time, against the milliseconds of the forward. FORCED_LOGIT outweighs any logit of the
net (dummy weights give logits near 0), so greedy argmax picks the token, and so does
sampling (the others' probabilities underflow to 0 in float32), before and after vLLM's
repetition penalty (which divides it by 1.05 or 1.15).

    vllm serve DIR --load-format dummy \
        --logits-processors bench.gpu.answer_lengths:ServerAnswerLengths
    (the lengths from $OCRVL_BENCH_ANSWER_LENGTHS, "MEDIAN:SIGMA:SEED", default 500:0.9:17)

vLLM 0.34 removed the V1 model runner and, with it, the V1 logits-processor interface this
class implements; `ServerAnswerLengths` is the class for the vLLM that is installed: this one
where the V1 interface exists, `SlotAnswerLengths` (the V2 interface, the same answers)
where it does not.
"""

from __future__ import annotations

import enum
import os
import random
import string
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from bench.gpu.dummy_model import char_tokens
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

try:  # vLLM >= 0.34: the V2 model runner's interface, the only one left there
    from vllm.v1.worker.gpu.sample.logits_processor.interface import (
        LogitsProcessor as SlotLogitsProcessor,
    )
except ImportError:
    SlotLogitsProcessor = object  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu.sample.logits_processor.interface import (
        LogitsContext,
        LogitsProcRequestState,
    )

EOS = 2  # ERNIE-4.5's </s>, where the config does not say
FORCED_LOGIT = 1.0e4  # the chosen token's logit (the net's are near 0)
TEXT_TOKENS = 1 << 16  # the prose's length: far above an answer's (at most 4096 tokens)

# What a request's row forces, given its output so far: a token id, or None (leave it).
Script = Callable[[Sequence[int]], "int | None"]

# English letter frequencies (per mille), so words look like words to a compressor.
LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
LETTER_WEIGHTS = [127, 91, 82, 75, 70, 67, 63, 61, 60, 43, 40, 28, 28, 24, 24, 22, 20, 20,
                  20, 15, 10, 8, 2, 2, 1, 1]  # fmt: skip
WORD_LENGTHS = range(1, 13)
WORD_LENGTH_WEIGHTS = [3, 17, 20, 16, 12, 10, 8, 6, 4, 2, 1, 1]


def prose(seed: str, size: int = TEXT_TOKENS) -> str:
    """`size` characters of text-like prose drawn with `seed`: words of English letter
    frequencies, capitalised sentences with commas, some numbers, paragraphs, now and then a
    Markdown heading. Printable ASCII, spaces and newlines only."""
    rng = random.Random(f"{seed}:prose")
    parts: list[str] = []
    chars = 0

    def word() -> str:
        if rng.random() < 0.05:  # a number: a year, a figure, a share
            kind = rng.random()
            if kind < 0.4:
                return str(rng.randrange(1800, 2030))
            if kind < 0.7:
                return f"{rng.randrange(100)}.{rng.randrange(10)}"
            return f"{rng.randrange(1, 100)}%"
        n = rng.choices(WORD_LENGTHS, WORD_LENGTH_WEIGHTS)[0]
        return "".join(rng.choices(LETTERS, LETTER_WEIGHTS, k=n))

    def sentence() -> str:
        words = [word() for _ in range(rng.randrange(5, 22))]
        words[0] = words[0].capitalize()
        for i in range(len(words) - 1):
            if rng.random() < 0.07:
                words[i] += rng.choice(",,,;:")
        return " ".join(words) + rng.choice("....?!")

    while chars < size:
        if rng.random() < 0.1:
            head = " ".join(word() for _ in range(rng.randrange(1, 6))).capitalize()
            paragraph = "#" * rng.randrange(1, 4) + " " + head
        else:
            paragraph = " ".join(sentence() for _ in range(rng.randrange(1, 7)))
        parts.append(paragraph + "\n\n")
        chars += len(parts[-1])
    text = "".join(parts)[:size]
    assert set(text) <= set(string.ascii_letters + string.digits + string.punctuation + " \n")
    return text


class LognormalAnswerLengths(LogitsProcessor):
    """Forces every request's answer token by token: prose, then EOS at its drawn length
    (see the module's docstring)."""

    def __init__(self, vllm_config: VllmConfig | None, device: Any = None,
                 is_pin_memory: bool = False) -> None:  # fmt: skip
        self.eos = eos_token(vllm_config)
        self.device = device
        self.pin_memory = is_pin_memory
        self.lengths = AnswerLengths.parse(os.environ.get(ENV, DEFAULT))
        self.text = char_tokens(prose(str(self.lengths.seed)))
        self.rows: dict[int, tuple[Script, list[int]]] = {}  # row -> (script, output ids)
        self.due: list[tuple[int, int]] = []  # (row, token) forced in the next step

    def text_start(self, page: int) -> int:
        """Where the answer of the page whose prompt is `page` tokens long starts in the
        prose (drawn, like its length, with SEED and `page`)."""
        return random.Random(f"{self.lengths.seed}:text:{page}").randrange(len(self.text))

    def script(self, prompt: Sequence[int], params: Any) -> Script:
        """What the request with `prompt` and sampling `params` is made to answer: its page's
        prose, then EOS at its page's drawn length (whatever `params` say)."""
        page = len(prompt)
        n, start = self.lengths.length(page), self.text_start(page)
        text, eos = self.text, self.eos
        size = len(text)
        return lambda output: eos if len(output) + 1 >= n else text[(start + len(output)) % size]

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
            # One copy of the (row, token) pairs, asynchronous from pinned memory (no host
            # synchronisation), and one indexed write of a logit a row.
            pairs = torch.tensor(self.due, dtype=torch.long, pin_memory=self.pin_memory)
            pairs = pairs.to(logits.device, non_blocking=True)
            logits[pairs[:, 0], pairs[:, 1]] = FORCED_LOGIT
        return logits


class SlotAnswerLengths(SlotLogitsProcessor):
    """The same answers as LognormalAnswerLengths, through vLLM's V2 interface: requests are
    persistent slots, and a request's output so far is its sequence length less its prompt
    (the row's script only counts its output: LoopingAnswerLengths, which reads it, stays on
    the V1 interface)."""

    def __init__(self, vllm_config: VllmConfig, req_states: LogitsProcRequestState) -> None:
        self.answers = LognormalAnswerLengths(vllm_config)
        self.prompt_len = req_states.prompt_len.np  # host view, set before add_request
        self.scripts: dict[int, Script] = {}  # slot -> its request's script

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        prompt = range(int(self.prompt_len[req_idx]))  # the script reads only its length
        self.scripts[req_idx] = self.answers.script(prompt, sampling_params)
        return True

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        # Without speculative decoding a request has one row, in batch order; the lengths
        # are padded past the batch (zeros), so zip stops at the batch's end.
        due = []
        slots, lengths = ctx.idx_mapping_np.tolist(), ctx.seq_lens_upper_bound_np.tolist()
        for row, (slot, seen) in enumerate(zip(slots, lengths, strict=False)):
            script = self.scripts.get(slot)
            if script is not None and row < logits.shape[0]:
                token = script(range(max(0, seen - int(self.prompt_len[slot]))))
                if token is not None:
                    due.append((row, token))
        if due:
            pairs = torch.tensor(due, dtype=torch.long).to(logits.device, non_blocking=True)
            logits[pairs[:, 0], pairs[:, 1]] = FORCED_LOGIT
        return logits


# What `vllm serve --logits-processors` is given: the class of the model runner's interface.
# Where vLLM has the V2 runner's (0.33, 0.34; not 0.26), that runner is the default and loads
# only its own; VLLM_USE_V2_MODEL_RUNNER=0 (0.24-0.33, WSL2) asks for the V1 runner instead.
ServerAnswerLengths = (SlotAnswerLengths if SlotLogitsProcessor is not object
                       and os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0"
                       else LognormalAnswerLengths)


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

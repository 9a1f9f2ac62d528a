"""The continuous-batching simulation: one scheduler loop that admits, steps and preempts
sequences within a KV cache budget, like vLLM's.

It is on when any of ``--step-t0-ms``, ``--step-t1-ms``, ``--prefill-ms-per-image`` is > 0
(otherwise requests are answered at once). The loop admits up to ``--max-num-seqs`` sequences
while the rest wait. Each step produces one token per running sequence and takes
t0 + t1*running ms, plus prefill-ms-per-image * image_tokens/1300 for every sequence admitted in
that step. A sequence holds prompt + produced tokens of KV cache and is only admitted if that
fits; when the running sequences outgrow ``--kv-capacity-tokens`` (default max_num_seqs*2048,
or the KV size of the fake VRAM model) the newest is preempted to the head of the queue and,
when readmitted, recomputed: its image and every token it had produced are prefilled again
(vLLM's recompute preemption), so throughput falls once the batch outgrows the KV cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator

from testkit.fake_server.answers import engine_error
from testkit.fake_server.config import FakeServerConfig
from testkit.fake_server.metrics import Activity

log = logging.getLogger(__name__)

PREFILL_UNIT_TOKENS = 1300  # ~ one full 1 MP page


@dataclasses.dataclass(eq=False)
class SimSequence:
    """One request inside the batching simulation."""

    prompt_tokens: int
    image_tokens: int
    target: int
    future: asyncio.Future[None]  # cancelled: the request was aborted
    produced: int = 0
    # Set at each token produced and at the end: what a streamed answer waits on.
    stepped: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @property
    def held(self) -> int:
        """KV cache tokens this sequence holds while running."""
        return self.prompt_tokens + self.produced


class EngineDead(Exception):
    """The simulated engine died while a request was in it."""


class BatchSimulator:
    """vLLM's scheduler in miniature: a waiting queue, a running batch and a KV cache budget."""

    def __init__(self, cfg: FakeServerConfig, kv_capacity: int, activity: Activity) -> None:
        self.cfg = cfg
        self.kv_capacity = kv_capacity
        self.activity = activity  # told each change of the running batch's size
        self.running: list[SimSequence] = []
        self.waiting: deque[SimSequence] = deque()
        self.preemptions = 0
        self.max_waiting = 0
        self.generation_tokens = 0  # counted per decode step, like vLLM
        self._wake = asyncio.Event()

    def submit(self, prompt_tokens: int, img_tokens: int, target: int) -> SimSequence:
        """Queue a sequence that is to produce ``target`` tokens (cancel its future to abort
        it: the scheduler drops it at its next step, like vLLM an aborted request)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        seq = SimSequence(prompt_tokens, img_tokens, target, future)
        self.waiting.append(seq)
        self.max_waiting = max(self.max_waiting, len(self.waiting))
        self._wake.set()
        return seq

    @staticmethod
    async def finish(seq: SimSequence) -> None:
        """Wait until ``seq`` has produced all its tokens (500 if the engine dies first)."""
        try:
            await seq.future
        except EngineDead:
            raise engine_error() from None

    @staticmethod
    async def progress(seq: SimSequence) -> AsyncIterator[int]:
        """The tokens ``seq`` has produced so far, each time a step adds some, until it ends
        (500 if the engine dies first)."""
        while not seq.future.done():
            await seq.stepped.wait()
            seq.stepped.clear()
            yield seq.produced
        await BatchSimulator.finish(seq)

    async def run(self) -> None:
        """The scheduler loop (runs until cancelled)."""
        cfg = self.cfg
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            prefill_ms = self._admit()
            self.activity.set(len(self.running))
            await asyncio.sleep(
                (cfg.step_t0_ms + cfg.step_t1_ms * len(self.running) + prefill_ms) / 1000
            )
            still: list[SimSequence] = []
            for seq in self.running:
                if seq.future.done():  # cancelled by a vanished client
                    continue
                seq.produced += 1
                self.generation_tokens += 1
                seq.stepped.set()
                if seq.produced >= seq.target:
                    seq.future.set_result(None)
                else:
                    still.append(seq)
            self.running = still
            self._preempt()
            self.activity.set(len(self.running))

    def _admit(self) -> float:
        """Move waiting sequences into the batch; return the prefill time they cost (ms)."""
        held = sum(seq.held for seq in self.running)
        prefill_ms = 0.0
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if seq.future.done():
                self.waiting.popleft()
                continue
            if self.running and held + seq.held > self.kv_capacity:
                break
            self.waiting.popleft()
            self.running.append(seq)
            held += seq.held
            # A preempted sequence is recomputed, as vLLM does: its image and everything it
            # had generated are prefilled again. This is what makes too many sequences in
            # flight slower than the right number.
            prefill_ms += (self.cfg.prefill_ms_per_image * (seq.image_tokens + seq.produced)
                           / PREFILL_UNIT_TOKENS)
        return prefill_ms

    def _preempt(self) -> None:
        """Push the newest running sequences back to the queue until the rest fit the cache."""
        held = sum(seq.held for seq in self.running)
        while len(self.running) > 1 and held > self.kv_capacity:
            seq = self.running.pop()
            held -= seq.held
            self.waiting.appendleft(seq)
            self.preemptions += 1
            log.debug("preempted a sequence holding %d tokens", seq.held)
        self.max_waiting = max(self.max_waiting, len(self.waiting))

    def fail_all(self) -> None:
        """Engine death: every sequence in the batch or in the queue fails."""
        for seq in itertools.chain(self.running, self.waiting):
            if not seq.future.done():
                seq.future.set_exception(EngineDead())
                seq.stepped.set()
        self.running.clear()
        self.waiting.clear()

    def kv_usage(self) -> float:
        """Fraction of the notional KV cache held by running sequences."""
        return min(1.0, sum(seq.held for seq in self.running) / self.kv_capacity)

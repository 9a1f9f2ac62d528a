"""Whether a request decodes much faster in a small batch than in a full one: the evidence
for bigger documents yielding to small ones (`scheduler.pick_yielding`).

Where the card's memory bandwidth is the limit (an 8 GB RTX 4060 with a 0.9B model: each
decoding step reads every weight once, whatever the batch), a request in a batch of 16
decodes hardly faster than in one of 64, and yielding would only slow the book. Where compute
is (a large card), a letter's page among 64 others got a third of its speed alone. So each
endpoint keeps what its `/metrics` showed: generated tokens per second per running request,
in small batches and in full ones.
"""

from __future__ import annotations

from ocrvl_daemon.server_probe import ServerMetrics

SMALL_BATCH = 0.4  # running requests, as a share of the bound, that count as a small batch
FULL_BATCH = 0.8  # ... and as a full one
SPEEDUP_WORTH_YIELDING = 1.8  # per-request speed, small batch over full, that pays a yield
FULL_WEIGHT = 0.3  # of each new sample in the full batches' moving average


class BatchSpeed:
    """Generated tokens per second per running request, in small and in full batches."""

    def __init__(self) -> None:
        self._last: ServerMetrics | None = None
        self.small: float | None = None  # the fastest seen: prefill in a sample only ever
        # makes a batch look slower
        self.full: float | None = None

    def observe(self, sample: ServerMetrics | None, limit: int) -> None:
        """Feed a `/metrics` sample (the same one may come many times) and the bound."""
        if sample is None or sample.generation_tokens_total is None or sample.running is None:
            return
        last = self._last
        if last is not None and sample.taken_at == last.taken_at:
            return
        self._last = sample
        if (last is None or last.generation_tokens_total is None or last.running is None
                or sample.taken_at < last.taken_at or (sample.waiting or 0) > 0):
            return
        running = min(last.running, sample.running)
        if running < 1:
            return
        seconds = sample.taken_at - last.taken_at
        tokens = sample.generation_tokens_total - last.generation_tokens_total
        speed = tokens / seconds / ((last.running + sample.running) / 2)
        # A batch growing is new pages being prefilled, which slows every step: a small
        # batch counts while it holds or shrinks (a book yielding, the end of a run).
        if sample.running <= last.running <= SMALL_BATCH * limit:
            self.small = max(self.small or 0.0, speed)
        elif running >= FULL_BATCH * limit:
            self.full = speed if self.full is None else (
                FULL_WEIGHT * speed + (1 - FULL_WEIGHT) * self.full)

    def yielding_helps(self) -> bool | None:
        """Whether a request decodes enough faster in a small batch; None: not seen yet."""
        if self.small is None or self.full is None:
            return None
        return self.small >= SPEEDUP_WORTH_YIELDING * self.full

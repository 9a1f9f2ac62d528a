"""Whether a request decodes much faster in a small batch than in a full one: the evidence
for bigger documents yielding to small ones (`scheduler.pick_yielding`).

Where the card's memory bandwidth is the limit (an 8 GB RTX 4060 with a 0.9B model: each
decoding step reads every weight once, whatever the batch), a request in a batch of 16
decodes hardly faster than in one of 64, and yielding would only slow the book. Where compute
is (a large card), a letter's page among 64 others got a third of its speed alone. So each
endpoint fits, from its `/metrics`, the time of one decoding step against the number of
requests running (step = t0 + t1 * running), and yielding pays where the step at the bound
takes SPEEDUP_WORTH_YIELDING times as long as at the yielded share.
"""

from __future__ import annotations

from collections import deque

from ocrvl_daemon.server_probe import ServerMetrics

SPEEDUP_WORTH_YIELDING = 1.8
SAMPLES = 64  # the newest (running, step seconds) pairs the fit uses
SPREAD = 0.25  # running counts must span this share of the bound for a fit


class BatchSpeed:
    """Step time against batch size, fitted from `/metrics` scrapes."""

    def __init__(self) -> None:
        self._last: ServerMetrics | None = None
        self._samples: deque[tuple[float, float]] = deque(maxlen=SAMPLES)

    def observe(self, sample: ServerMetrics | None) -> None:
        """Feed a `/metrics` scrape (the same one may come many times)."""
        if sample is None or sample.generation_tokens_total is None or sample.running is None:
            return
        last = self._last
        if last is not None and sample.taken_at == last.taken_at:
            return
        self._last = sample
        if (last is None or last.generation_tokens_total is None or last.running is None
                or sample.taken_at < last.taken_at or (sample.waiting or 0) > 0):
            return
        # A batch growing is new pages being prefilled, which slows every step; one that
        # holds or shrinks (a book running on or yielding, the end of a run) shows decoding.
        if sample.running > last.running or min(sample.running, last.running) < 1:
            return
        tokens = sample.generation_tokens_total - last.generation_tokens_total
        if tokens <= 0:
            return
        running = (sample.running + last.running) / 2
        self._samples.append((running, running * (sample.taken_at - last.taken_at) / tokens))

    def speedup(self, limit: int, share: int) -> float | None:
        """How many times faster a request decodes with `limit // share` running than with
        `limit` (None until the samples span enough batch sizes)."""
        xs = [x for x, _ in self._samples]
        if len(xs) < 3 or max(xs) - min(xs) < SPREAD * limit:
            return None
        mean_x = sum(xs) / len(xs)
        mean_y = sum(y for _, y in self._samples) / len(xs)
        t1 = (sum((x - mean_x) * (y - mean_y) for x, y in self._samples)
              / sum((x - mean_x) ** 2 for x in xs))
        t0 = mean_y - t1 * mean_x
        small = t0 + t1 * max(1, limit // share)
        return (t0 + t1 * limit) / small if small > 0 else None

    def yielding_helps(self, limit: int, share: int) -> bool | None:
        """Whether the speed-up pays for a yield; None: not measured yet."""
        speedup = self.speedup(limit, share)
        return None if speedup is None else speedup >= SPEEDUP_WORTH_YIELDING

"""Pages per second, measured one way everywhere: the converter's, each server's, each
document's."""

from __future__ import annotations

from collections import deque

# Rates are measured over this much recent time: long enough to smooth the bursts in which
# pages come back, short enough to follow a server that slowed down.
RATE_WINDOW = 60.0
# ...and over at least this long: pages come back in bursts.
RATE_MIN_SPAN = 3.0


class RateMeter:
    """Pages per second over the last RATE_WINDOW seconds, from a growing count.

    Measured from the first change on: the wait before the first pages (a worker starting,
    a server loading) says nothing about the rate.
    """

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque()
        self._first: int | None = None

    def add(self, now: float, count: int) -> None:
        """Record the count at `now` (only changes are kept)."""
        if self._first is None:
            self._first = count
        if count == self._first:
            return
        if not self._samples or self._samples[-1][1] != count:
            self._samples.append((now, count))
        # The newest sample older than the window stays, as the base of the rate.
        while len(self._samples) > 1 and self._samples[1][0] <= now - RATE_WINDOW:
            self._samples.popleft()

    def tick(self, now: float) -> None:
        """Record one more event (a page recognised) at `now`; the first is the base."""
        if self._first is None:
            self._first = 0
        self.add(now, (self._samples[-1][1] if self._samples else 0) + 1)

    def rate(self, now: float) -> float:
        """Pages per second (0 while not known yet); falls while nothing advances. A burst is
        spread over at least RATE_MIN_SPAN: pages come back in bursts."""
        if len(self._samples) < 2:
            return 0.0  # not known yet
        span = max(now - self._samples[0][0], RATE_MIN_SPAN)
        return (self._samples[-1][1] - self._samples[0][1]) / span

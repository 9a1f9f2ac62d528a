"""The one exponential backoff: how long to wait after the nth failure in a row, and when to
stop trying.

Used for a document that failed for a reason that may pass (`storage.jobs`), a page the
server failed (`core.decide`), an engine worker that cannot start (`engine.pool`) and the
managed server's restarts (`server.managed`). Each keeps its own count of failures in a row;
the policy is a plain value.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Wait `first` seconds after the first failure in a row, `factor` times longer after
    each further one, never more than `longest`; give up after `attempts` failures in a row
    (None: never)."""

    first: float
    longest: float
    attempts: int | None = None
    factor: float = 2.0

    def delay(self, failures: int) -> float:
        """The wait after the `failures`th failure in a row (1: the first)."""
        return min(self.longest, self.first * self.factor ** max(0, failures - 1))

    def gives_up(self, failures: int) -> bool:
        """Whether the `failures`th failure in a row is the last one tried."""
        return self.attempts is not None and failures >= self.attempts

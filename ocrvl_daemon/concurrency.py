"""How many pages may be in flight at the server."""

from __future__ import annotations


class ConcurrencyController:
    """The in-flight bound; fixed at `maximum` until the adaptive search lands."""

    def __init__(self, minimum: int, maximum: int, adaptive: bool) -> None:
        self.minimum = minimum
        self.maximum = maximum
        self.adaptive = adaptive
        self.limit = maximum

    def observe(self, now: float, completed: int, in_flight: int, backlog: int) -> None:
        """Feed one tick's completions; may move `limit`."""

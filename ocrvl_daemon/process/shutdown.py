"""Stop signals for a main loop: the first SIGTERM/SIGINT stops gracefully, a second forces it.

uvicorn's way: the handlers only record; the loop decides. A graceful stop (pages in flight
finish, the server gets SIGTERM and a bounded wait) can take a minute when a server ignores
SIGTERM, so it runs on a thread while the main thread keeps listening: another stop signal
meanwhile runs the forced stop (SIGKILL, reap) instead of waiting any longer.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# How often the main thread looks for a second stop signal while the graceful stop runs.
POLL_SECONDS = 0.1


class StopSignals:
    """Records SIGTERM, SIGINT (and any `extra` signals) for the main loop to act on."""

    def __init__(self, *extra: signal.Signals) -> None:
        # No lock: Python runs the handler on the main thread, the only one reading these
        # (a lock taken in a handler could deadlock the very thread it interrupted).
        self.pending: list[int] = []  # received, not acted on yet; oldest first
        self.stops: list[int] = []  # every stop signal received, in order
        self._watched = (*STOP_SIGNALS, *extra)
        self._previous: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}

    def install(self) -> None:
        """Handle the signals from now on (main thread only)."""
        self._previous = {sig: signal.signal(sig, self._record) for sig in self._watched}

    def restore(self) -> None:
        """Put back the handlers that were there before `install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.pending.append(signum)
        if signum in STOP_SIGNALS:
            self.stops.append(signum)

    def stop(self, graceful: Callable[[], None], forced: Callable[[], None]) -> bool:
        """Run `graceful` on a thread until it returns (True); a second stop signal, before or
        during it, runs `forced()` instead and returns False at once.

        The graceful thread is left to end by itself: `forced` kills what it waits for.
        Raises what `graceful` raised.
        """
        errors: list[BaseException] = []

        def run() -> None:
            try:
                graceful()
            except BaseException as exc:  # handed to the main thread, which re-raises it
                errors.append(exc)

        thread = threading.Thread(target=run, name="ocrvl-stop", daemon=True)
        thread.start()
        while thread.is_alive():
            if len(self.stops) >= 2:
                name = signal.Signals(self.stops[-1]).name
                log.warning("received %s again while stopping: stopping now, without waiting",
                            name)
                forced()
                return False
            thread.join(POLL_SECONDS)
        if errors:
            raise errors[0]
        return True

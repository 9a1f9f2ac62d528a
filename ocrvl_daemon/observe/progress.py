"""Progress of documents being converted: rates, ETAs, log lines and terminal bars.

The daemon logs a line per document being converted every `progress_seconds`, so
`journalctl -f` shows a book advancing. `ocrvl convert` shows live bars (tqdm) on a
terminal, and the same lines as the daemon, plus one for the whole run, when its output goes
to a file or a pipe.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from ocrvl_daemon.files.names import shown
from ocrvl_daemon.observe.logs import doc_fields
from ocrvl_daemon.observe.rate import RateMeter
from ocrvl_daemon.observe.units import format_duration, format_rate

log = logging.getLogger(__name__)

# A terminal shows bars for this many documents at most; the overall bar counts them all.
MAX_BARS = 8
BAR_REFRESH_SECONDS = 0.2


@dataclass
class Progress:
    """A snapshot of the converter for status lines."""

    current: str | None
    page_done: int
    page_total: int
    pages_per_s: float
    queued: int
    done: int
    failed: int
    in_flight: int


@dataclass(frozen=True)
class DocumentProgress:
    """Pages done of one document being converted."""

    job_id: int
    path: Path
    done: int
    total: int


def progress_line(name: str, done: int, total: int, rate: float) -> str:
    """`book.pdf: p. 212/480 (44%) · 1.6 p/s · ETA 2h41m`."""
    parts = [f"{name}: p. {done}/{total} ({100 * done // max(total, 1)}%)"]
    if rate > 0:
        parts += [format_rate(rate), f"ETA {format_duration(max(total - done, 0) / rate)}"]
    return " · ".join(parts)


class RunTally:
    """Pages done of a whole `ocrvl convert` run: a finished document counts whole."""

    def __init__(self, totals: dict[int, int], done: dict[int, int],
                 succeeded: Callable[[int], bool]) -> None:
        self.total = sum(totals.values())
        self.resumed = sum(done.values())  # checkpointed by an earlier run
        self._totals = totals
        self._succeeded = succeeded
        self._done = dict(done)
        self._running: set[int] = set()

    def done(self, docs: list[DocumentProgress]) -> int:
        """Pages done so far, given the documents being converted now."""
        running = {d.job_id for d in docs}
        for job_id in self._running - running:  # just left: converted, or failed
            if self._succeeded(job_id):
                self._done[job_id] = self._totals.get(job_id, self._done[job_id])
        self._running = running
        for doc in docs:
            self._done[doc.job_id] = doc.done
            self._totals.setdefault(doc.job_id, doc.total)
        self.total = sum(self._totals.values())
        return sum(self._done.values())


def shows_bars(stream: IO[str]) -> bool:
    """Whether `stream` is a terminal that bars can be drawn on: one that reports no width
    (0 columns: some serial consoles and containers) would show nothing at all."""
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (OSError, ValueError):  # no file descriptor, or not a terminal after all
        return False


class ProgressLog:
    """One INFO line per document that advanced, every `interval` seconds.

    With a `tally`, a line for the whole run follows (`ocrvl convert`).
    """

    def __init__(self, interval: float, tally: RunTally | None = None) -> None:
        self.interval = interval
        self._tally = tally
        self._next: float | None = None
        self._meters: dict[int, RateMeter] = {}
        self._overall = RateMeter()
        self._logged: dict[int, int] = {}
        self._overall_logged = 0

    def update(self, now: float, docs: list[DocumentProgress]) -> None:
        """Take the current counts; log when a line is due."""
        for doc in docs:
            self._meters.setdefault(doc.job_id, RateMeter()).add(now, doc.done)
            self._logged.setdefault(doc.job_id, doc.done)
        current = {d.job_id for d in docs}
        for gone in set(self._meters) - current:
            del self._meters[gone], self._logged[gone]
        overall = self._tally.done(docs) if self._tally else 0
        self._overall.add(now, overall)
        if self._next is None:
            self._next = now + self.interval
        if now < self._next:
            return
        self._next = now + self.interval
        for doc in docs:
            if self._logged[doc.job_id] == doc.done:
                continue  # stalled: the server's or the engine's own lines say why
            self._logged[doc.job_id] = doc.done
            rate = self._meters[doc.job_id].rate(now)
            log.info("%s", progress_line(shown(doc.path.name), doc.done, doc.total, rate),
                     extra=doc_fields(doc.path, job=doc.job_id))
        if self._tally and overall != self._overall_logged:
            self._overall_logged = overall
            log.info("%s", progress_line("all", overall, self._tally.total,
                                         self._overall.rate(now)))

    def close(self) -> None:
        """Nothing to clear: lines stay."""


class ProgressBars:
    """Live bars on a terminal: one per document being converted, one for the whole run.

    Log records are printed above the bars meanwhile, so they do not tear them.
    """

    def __init__(self, stream: IO[str], tally: RunTally) -> None:
        self._stream = stream
        self._tally = tally
        self._bars: dict[int, tqdm] = {}
        self._next = 0.0
        self._exit = contextlib.ExitStack()
        self._exit.enter_context(logging_redirect_tqdm())
        self._overall = self._bar("all", tally.total, tally.resumed, position=0)

    def _bar(self, name: str, total: int, done: int, position: int | None = None) -> tqdm:
        return tqdm(desc=name, total=total, initial=done, unit="p", file=self._stream,
                    position=position, leave=position == 0, dynamic_ncols=True, smoothing=0.1,
                    mininterval=BAR_REFRESH_SECONDS)

    def update(self, now: float, docs: list[DocumentProgress]) -> None:
        """Move the bars (at most every BAR_REFRESH_SECONDS)."""
        if now < self._next:
            return
        self._next = now + BAR_REFRESH_SECONDS
        self._move(docs)

    def _move(self, docs: list[DocumentProgress]) -> None:
        current = {d.job_id for d in docs}
        for gone in set(self._bars) - current:
            self._bars.pop(gone).close()
        for doc in docs:
            bar = self._bars.get(doc.job_id)
            if bar is None:
                if len(self._bars) >= MAX_BARS:
                    continue
                bar = self._bars[doc.job_id] = self._bar(shown(doc.path.name), doc.total, doc.done)
            bar.update(doc.done - bar.n)
        overall = self._tally.done(docs)
        self._overall.total = self._tally.total
        self._overall.update(overall - self._overall.n)

    def close(self) -> None:
        """Remove the documents' bars, leave the overall one, restore logging."""
        self._move([])
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()
        self._overall.close()
        self._exit.close()


ProgressView = ProgressLog | ProgressBars

"""A child process's log records, handed to the daemon over its channel.

Written to stderr they would reach journald as text of no priority; sent as `LogRecord`s the
daemon logs them at their own level (`LogRecord.relay`).
"""

from __future__ import annotations

import logging
import warnings

from ocrvl_daemon.core.messages import LogRecord
from ocrvl_daemon.observe.logs import PrintableFormatter
from ocrvl_daemon.process.channel import Channel


class _DaemonLog(logging.Handler):
    """Hands the process's log records (ocrvl's from INFO, libraries' from WARNING) to the
    daemon."""

    def __init__(self, channel: Channel) -> None:
        super().__init__(logging.INFO)
        self._channel = channel
        self.setFormatter(PrintableFormatter())  # names on one line, as the daemon's own

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._channel.send(LogRecord(record.levelno, record.name, self.format(record)))
        except Exception:
            self.handleError(record)


def log_to_daemon(channel: Channel, own: int = logging.INFO) -> None:
    """This child process's log records go to the daemon through `channel` (ocrvl's from
    `own`, libraries' from WARNING); set up first thing, before Paddle is imported."""
    logging.getLogger().addHandler(_DaemonLog(channel))
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("ocrvl_daemon").setLevel(own)
    for noisy in ("httpx", "httpx2", "openai"):  # one INFO line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Paddle warns at import, at every start, that ccache is missing: it compiles nothing
    # here, so that line would only be noise in the journal.
    warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)


def library_logs_to_daemon(level: int = logging.WARNING) -> None:
    """PaddleX's and paddleocr's records from `level` go to the daemon like this process's
    own; called once they are imported.

    Both libraries log to stderr through handlers of their own. PaddleX logs "Creating
    model: ..." at every worker start, coloured with escape codes that journald shows as
    garbage.
    """
    for name in ("paddlex", "paddleocr"):
        library_log = logging.getLogger(name)
        for handler in library_log.handlers[:]:
            library_log.removeHandler(handler)
        library_log.propagate = True
        library_log.setLevel(max(level, library_log.getEffectiveLevel()))

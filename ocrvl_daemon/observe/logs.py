"""Logging set-up: journald-friendly under systemd, timestamped lines in a terminal.

Under systemd the journal adds the time, so lines carry none; each carries a `<N>` syslog
priority prefix that journald parses from stdout/stderr, so `journalctl -p warning` works.
Where systemd-python is importable and stderr is the journal stream, records go through
its JournalHandler instead and `extra=` fields such as OCRVL_PDF become journal fields
(`journalctl --user -u ocrvl OCRVL_PDF=/path/book.pdf`). File names whose bytes are not UTF-8
are shown escaped (`\\xff`) in lines and fields alike: journald and terminals want UTF-8. The
file a record names (a path among its arguments, or its OCRVL_PDF field) has its line breaks
and other control characters escaped (`\\n`) wherever the line shows it, so it stays one line.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import IO, Any

from ocrvl_daemon.files.names import one_line, shown

log = logging.getLogger(__name__)

PACKAGE_LOGGER = "ocrvl_daemon"
SYSLOG_IDENTIFIER = "ocrvl"
HUMAN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# sd-daemon(3) priorities.
PRIORITIES = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
              logging.CRITICAL: 2}


def doc_fields(pdf: Path, page: int | None = None, job: int | None = None) -> dict[str, Any]:
    """Journal fields naming a document (and page, job) for a log call's `extra=`."""
    fields: dict[str, Any] = {"OCRVL_PDF": shown(pdf)}
    if page is not None:
        fields["OCRVL_PAGE"] = page
    if job is not None:
        fields["OCRVL_JOB"] = job
    return fields


def syslog_priority(levelno: int) -> int:
    """The syslog priority of a logging level (custom levels round down to the next one)."""
    for level in sorted(PRIORITIES, reverse=True):
        if levelno >= level:
            return PRIORITIES[level]
    return PRIORITIES[logging.DEBUG]


class PrintableFormatter(logging.Formatter):
    """A formatter whose lines show file names that are not UTF-8 escaped (`names.shown`).

    The record's `message` and `exc_text` are escaped too: JournalHandler sends them along
    as fields, and a name's raw surrogates would make it drop the whole record.
    """

    def format(self, record: logging.LogRecord) -> str:
        text = _names_on_one_line(shown(super().format(record)), record)
        record.message = _names_on_one_line(shown(record.message), record)
        if record.exc_text:
            record.exc_text = shown(record.exc_text)
        return text


def _names_on_one_line(text: str, record: logging.LogRecord) -> str:
    """`text` with the files `record` names (path arguments, OCRVL_PDF) shown by `one_line`,
    whole or by their stem (which their companions' names share), wherever they occur (also
    inside an error's message)."""
    args = record.args if isinstance(record.args, tuple) else ()
    named = [shown(a) for a in args if isinstance(a, os.PathLike)]
    field = getattr(record, "OCRVL_PDF", None)
    if isinstance(field, str):
        named.append(field)
    for path in named:
        for raw in (path, os.path.splitext(os.path.basename(path))[0]):
            if raw and not raw.isprintable():
                text = text.replace(raw, one_line(raw))
    return text


class PriorityFormatter(PrintableFormatter):
    """`<N>name: message`, with the prefix on every line so a traceback keeps its priority."""

    def __init__(self) -> None:
        super().__init__("%(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).splitlines())


def is_journal_stream(stream: IO[str]) -> bool:
    """Whether `stream` is the journal connection systemd gave us (JOURNAL_STREAM=dev:ino)."""
    expected = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):  # closed, or not a real file
        return False
    return expected == f"{st.st_dev}:{st.st_ino}"


def under_systemd(stream: IO[str]) -> bool:
    """Whether `stream` ends up in the journal (or another log systemd keeps)."""
    if is_journal_stream(stream):
        return True
    # INVOCATION_ID is also inherited by shells in terminals that a user service started
    # (e.g. a desktop's terminal server): a TTY means a person is reading.
    return bool(os.environ.get("INVOCATION_ID")) and not _isatty(stream)


def setup_logging(level: str | int, *, stream: IO[str] | None = None) -> logging.Handler:
    """Install ocrvl's one log handler on the root logger; returns it.

    `level` applies to ocrvl's own loggers; other libraries log warnings and above.
    Calling it again replaces the handler (no duplicate lines).
    """
    stream = sys.stderr if stream is None else stream
    handler = _journal_handler(stream)
    if handler is None:
        handler = logging.StreamHandler(stream)
        if under_systemd(stream):
            handler.setFormatter(PriorityFormatter())
        else:
            handler.setFormatter(PrintableFormatter(HUMAN_FORMAT, datefmt="%H:%M:%S"))
    handler.set_name(PACKAGE_LOGGER)
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == PACKAGE_LOGGER]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    # Third-party libraries (httpx logs every request at INFO) stay at warnings.
    root.setLevel(logging.WARNING)
    set_level(level)
    log.debug("Logging through %s, formatted by %s", type(handler).__name__,
              type(handler.formatter).__name__)
    return handler


def basic_logging(level: int, fmt: str) -> None:
    """`logging.basicConfig` to stderr with file names escaped, unless logging is set up."""
    handler = logging.StreamHandler()
    handler.setFormatter(PrintableFormatter(fmt))
    logging.basicConfig(level=level, handlers=[handler])


def set_level(level: str | int) -> None:
    """Change ocrvl's log level, e.g. after a config reload."""
    value = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(value, int):
        raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING or ERROR")
    logging.getLogger(PACKAGE_LOGGER).setLevel(value)


def _journal_handler(stream: IO[str]) -> logging.Handler | None:
    """systemd-python's JournalHandler when it is installed and we log into the journal."""
    if not is_journal_stream(stream):
        return None
    try:
        import systemd.journal as journal
    except ImportError:
        return None
    # JournalHandler sends every record attribute along; journald keeps the UPPERCASE ones,
    # so `extra={"OCRVL_PDF": ...}` arrives as a field without a subclass.
    handler: logging.Handler = journal.JournalHandler(SYSLOG_IDENTIFIER=SYSLOG_IDENTIFIER)
    handler.setFormatter(PrintableFormatter("%(name)s: %(message)s"))
    return handler


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (ValueError, AttributeError):
        return False

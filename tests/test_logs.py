"""Log format under systemd (priority prefixes, journal fields) and in a terminal."""

from __future__ import annotations

import io
import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.engine.worker_handle import PageResult, PageTask
from ocrvl_daemon.observe.logs import PriorityFormatter, doc_fields, set_level, setup_logging
from testkit.documents import make_pdf
from testkit.harness import wait_until
from testkit.plain_server import plain_openai_server
from testkit.stand_in_worker import real_worker


@pytest.fixture(autouse=True)
def clean_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts outside systemd and leaves the root logger as it found it."""
    for name in ("JOURNAL_STREAM", "INVOCATION_ID"):
        monkeypatch.delenv(name, raising=False)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    package_level = logging.getLogger("ocrvl_daemon").level
    yield
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)
    logging.getLogger("ocrvl_daemon").setLevel(package_level)


@pytest.fixture
def pipe() -> Iterator[tuple[IO[str], IO[str]]]:
    """A real pipe: (writer handed to setup_logging, reader for the test)."""
    read_fd, write_fd = os.pipe()
    writer, reader = os.fdopen(write_fd, "w"), os.fdopen(read_fd, "r")
    yield writer, reader
    for stream in (writer, reader):
        if not stream.closed:
            stream.close()


def _journal_stream_of(stream: IO[str]) -> str:
    st = os.fstat(stream.fileno())
    return f"{st.st_dev}:{st.st_ino}"


def _lines(writer: IO[str], reader: IO[str]) -> list[str]:
    writer.close()
    return reader.read().splitlines()


def _no_systemd_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "systemd", None)  # `import systemd.journal` fails


@pytest.mark.quick
def test_priority_prefixes_on_the_journal_stream(pipe: tuple[IO[str], IO[str]],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    writer, reader = pipe
    _no_systemd_python(monkeypatch)
    monkeypatch.setenv("JOURNAL_STREAM", _journal_stream_of(writer))
    setup_logging("DEBUG", stream=writer)
    log = logging.getLogger("ocrvl_daemon.test")
    log.debug("d")
    log.info("started %s", "x", extra=doc_fields(Path("/in/book.pdf"), page=2))
    log.warning("w")
    log.error("e")
    log.critical("c")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    lines = _lines(writer, reader)
    # The first line is setup_logging's own debug message.
    assert lines[1:6] == ["<7>ocrvl_daemon.test: d", "<6>ocrvl_daemon.test: started x",
                          "<4>ocrvl_daemon.test: w", "<3>ocrvl_daemon.test: e",
                          "<2>ocrvl_daemon.test: c"]
    traceback = lines[6:]
    assert traceback[0] == "<3>ocrvl_daemon.test: failed"
    assert traceback[-1] == "<3>ValueError: boom"
    assert all(line.startswith("<3>") for line in traceback)  # journald splits lines


@pytest.mark.quick
def test_invocation_id_alone_means_systemd_unless_a_terminal(
        pipe: tuple[IO[str], IO[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    writer, _ = pipe
    _no_systemd_python(monkeypatch)
    monkeypatch.setenv("INVOCATION_ID", "0123456789abcdef")
    handler = setup_logging("INFO", stream=writer)
    assert isinstance(handler.formatter, PriorityFormatter)
    monkeypatch.setattr(writer, "isatty", lambda: True)
    handler = setup_logging("INFO", stream=writer)
    assert not isinstance(handler.formatter, PriorityFormatter)


@pytest.mark.quick
def test_human_format_outside_systemd(pipe: tuple[IO[str], IO[str]],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    writer, reader = pipe
    # A journal stream that is not this stream (e.g. stderr was redirected to a file).
    monkeypatch.setenv("JOURNAL_STREAM", "1:2")
    setup_logging("INFO", stream=writer)
    logging.getLogger("ocrvl_daemon.test").warning("disk %s", "full")
    [line] = _lines(writer, reader)
    assert re.fullmatch(r"\d\d:\d\d:\d\d WARNING ocrvl_daemon\.test: disk full", line), line


@pytest.mark.quick
def test_levels_and_no_duplicate_handlers() -> None:
    stream = io.StringIO()
    setup_logging("INFO", stream=stream)
    setup_logging("warning", stream=stream)  # again: replaces, does not add
    ours = logging.getLogger("ocrvl_daemon.test")
    ours.info("hidden")
    ours.warning("shown")
    logging.getLogger("httpx").info("third-party chatter")
    set_level("DEBUG")
    ours.debug("now shown")
    assert [line.split(" ", 2)[2] for line in stream.getvalue().splitlines()] == [
        "ocrvl_daemon.test: shown", "ocrvl_daemon.test: now shown"]
    with pytest.raises(ValueError, match="unknown log level"):
        set_level("LOUD")


@pytest.mark.quick
def test_doc_fields() -> None:
    assert doc_fields(Path("/in/a.pdf")) == {"OCRVL_PDF": "/in/a.pdf"}
    assert doc_fields(Path("/in/a.pdf"), page=0, job=5) == {
        "OCRVL_PDF": "/in/a.pdf", "OCRVL_PAGE": 0, "OCRVL_JOB": 5}


@pytest.mark.quick
def test_journal_handler_sends_fields(pipe: tuple[IO[str], IO[str]],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    journal = pytest.importorskip("systemd.journal",
                                  reason="systemd-python is not installed (optional extra)")
    writer, _ = pipe
    monkeypatch.setenv("JOURNAL_STREAM", _journal_stream_of(writer))
    handler = setup_logging("INFO", stream=writer)
    assert isinstance(handler, journal.JournalHandler)
    sent: list[tuple[str, dict[str, Any]]] = []
    # Positional: the record's own attributes (`message` among them) arrive as keywords.
    monkeypatch.setattr(handler, "send", lambda *args, **fields: sent.append((args[0], fields)))
    logging.getLogger("ocrvl_daemon.test").warning(
        "page %d failed", 7, extra=doc_fields(Path("/in/book.pdf"), page=7, job=3))
    [(message, fields)] = sent
    assert message == "ocrvl_daemon.test: page 7 failed"
    assert fields["PRIORITY"] == "4"
    assert fields["SYSLOG_IDENTIFIER"] == "ocrvl"
    assert (fields["OCRVL_PDF"], fields["OCRVL_PAGE"], fields["OCRVL_JOB"]) == (
        "/in/book.pdf", 7, 3)


@pytest.mark.quick
def test_a_name_that_is_not_utf8_is_logged_escaped(pipe: tuple[IO[str], IO[str]],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    odd = Path(os.fsdecode(b"/in/\xff\xfebook.pdf"))
    writer, reader = pipe  # strict UTF-8, like a journal stream or a terminal
    _no_systemd_python(monkeypatch)
    monkeypatch.setenv("JOURNAL_STREAM", _journal_stream_of(writer))
    setup_logging("INFO", stream=writer)
    logging.getLogger("ocrvl_daemon.test").info("%s: done", odd, extra=doc_fields(odd))
    assert _lines(writer, reader) == ["<6>ocrvl_daemon.test: /in/\\xff\\xfebook.pdf: done"]
    assert doc_fields(odd) == {"OCRVL_PDF": "/in/\\xff\\xfebook.pdf"}
    # JournalHandler also sends the record's `message`: it must be escaped as well.
    record = logging.makeLogRecord({"msg": "%s failed", "args": (odd,), "levelno": logging.ERROR})
    PriorityFormatter().format(record)
    assert record.message == "/in/\\xff\\xfebook.pdf failed"


@pytest.mark.quick
def test_a_name_holding_a_line_break_stays_on_its_log_line(pipe: tuple[IO[str], IO[str]],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    odd = Path("/in/two\nlines\x1b[31m.pdf")
    writer, reader = pipe
    monkeypatch.setenv("JOURNAL_STREAM", "1:2")  # a terminal-less human format
    setup_logging("INFO", stream=writer)
    log = logging.getLogger("ocrvl_daemon.test")
    log.info("%s: queued", odd)
    log.info("%s: done, 1 page", odd.name, extra=doc_fields(odd))
    log.error("%s: %s", odd.name, ValueError(f"{odd} is not a PDF"), extra=doc_fields(odd))
    log.error("advice on two lines:\n%s", "vllm serve ...")
    lines = [line.split("ocrvl_daemon.test: ", 1)[-1] for line in _lines(writer, reader)]
    escaped = "two\\nlines\\x1b[31m.pdf"
    assert lines == [f"/in/{escaped}: queued", f"{escaped}: done, 1 page",
                     f"{escaped}: /in/{escaped} is not a PDF", "advice on two lines:",
                     "vllm serve ..."], lines


@pytest.mark.slow
def test_a_warning_logged_in_the_engine_worker_reaches_the_journal_as_a_warning(
        pipe: tuple[IO[str], IO[str]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    writer, reader = pipe
    _no_systemd_python(monkeypatch)
    monkeypatch.setenv("JOURNAL_STREAM", _journal_stream_of(writer))
    setup_logging("INFO", stream=writer)
    pdf = make_pdf(tmp_path / "one.pdf", 1)
    stat = pdf.stat()
    config = Config.model_validate({"state_dir": str(tmp_path / "state"),
                                    "pipeline": {"use_layout_detection": False}})
    # An answer cut off at the token limit, from a server without /v1/models: the worker
    # warns that it cannot read the server's max_model_len.
    with plain_openai_server(lists_models=False, finish_reason="length") as url:
        worker = real_worker(config)
        worker.start()
        try:
            wait_until(lambda: worker.collect() == [] and worker.ready, 120,
                       what="the engine worker to start")
            worker.submit(PageTask(1, str(pdf), 0, 1024, stat.st_size, stat.st_mtime, url=url))
            results: list[PageResult] = []
            wait_until(lambda: results.extend(worker.collect()) or results, 120,
                       what="the page back")
        finally:
            worker.stop()
    assert results[0].truncated_at == 1024, f"the answer was not seen as cut off: {results[0]}"
    lines = _lines(writer, reader)
    warnings = [line for line in lines if "cannot read max_model_len" in line]
    assert warnings and all(line.startswith("<4>ocrvl_daemon.worker.page: ")
                            for line in warnings), (
        f"the worker's warning did not reach the daemon's log as a warning: {lines}")

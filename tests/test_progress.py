"""Progress a person can follow: `ocrvl convert` on a terminal and off it, Ctrl-C, and the
daemon's log while a book converts or when it restarts over a converted inbox.

Real `ocrvl` processes, the real pipeline (layout off) and the fake vLLM server.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import termios
import time
from pathlib import Path

import pytest

from ocrvl_daemon.observe.progress import progress_line
from ocrvl_daemon.observe.rate import RATE_MIN_SPAN, RateMeter
from testkit.documents import make_pdf
from testkit.harness import FakeServerProcess, free_port, wait_until
from testkit.runner import (
    DaemonProcess,
    managed_fake_server,
    ocrvl_argv,
    ocrvl_env,
    run_ocrvl,
    write_config,
)

# Two pages at a time, so a short book takes long enough to show progress.
SLOW_PIPELINE = {"use_layout_detection": False, "min_concurrency": 2, "max_concurrency": 2,
                 "adaptive_concurrency": False}
LINE = re.compile(r"(\S+): p\. (\d+)/(\d+) \((\d+)%\)")


def progress_lines(log: str, name: str) -> list[tuple[int, int]]:
    """(done, total) of each progress line about `name`."""
    return [(int(m[2]), int(m[3])) for m in LINE.finditer(log) if m[1] == name]


@pytest.mark.quick
def test_progress_line_reads_like_the_readme_promises():
    assert progress_line("book.pdf", 212, 480, 1.6) == \
        "book.pdf: p. 212/480 (44%) · 1.6 p/s · ETA 2m48s"
    assert progress_line("book.pdf", 3, 480, 0.0) == "book.pdf: p. 3/480 (0%)"


@pytest.mark.quick
def test_rate_ignores_the_wait_before_the_first_pages_and_spreads_a_single_burst():
    meter = RateMeter()
    meter.add(0.0, 0)
    meter.add(20.0, 0)  # the worker starts
    meter.add(21.0, 4)
    meter.add(21.5, 8)
    assert meter.rate(21.5) == pytest.approx(4 / RATE_MIN_SPAN), (
        "one burst of pages must be spread over RATE_MIN_SPAN, not taken as its own rate")
    meter.add(25.0, 12)
    assert meter.rate(25.0) == pytest.approx(2.0)


def test_a_server_answering_a_page_a_second_is_measured_at_one_page_per_second():
    meter = RateMeter()
    for second in range(30):
        meter.tick(float(second))
    assert meter.rate(29.0) == pytest.approx(1.0)
    assert meter.rate(89.0) < 0.5, "a server that stopped answering keeps its old rate"


@pytest.fixture
def slow_server() -> FakeServerProcess:
    from testkit.harness import start_fake_server

    with start_fake_server(free_port(), "--step-t0-ms", "60", "--max-num-seqs", "2") as server:
        yield server


@pytest.mark.slow
def test_convert_not_on_a_terminal_prints_plain_progress_lines_now_and_then(
        tmp_path: Path, slow_server: FakeServerProcess):
    book = make_pdf(tmp_path / "book.pdf", 30, seed=1)
    config = write_config(tmp_path / "config.yaml", progress_seconds=1,
                          pipeline=SLOW_PIPELINE)
    started = time.monotonic()
    result = run_ocrvl("convert", "--config", config, "--server-url", slow_server.api_url, book)
    took = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    lines = progress_lines(result.stderr, "book.pdf")
    overall = progress_lines(result.stderr, "all")
    assert len(lines) >= 2 and overall, f"no progress lines while converting:\n{result.stderr}"
    assert all(total == 30 for _, total in lines + overall)
    assert [done for done, _ in lines] == sorted({done for done, _ in lines}), (
        "progress lines should advance, one per interval")
    assert len(lines) <= took / 1.0 + 1, f"more than one line a second:\n{result.stderr}"
    assert len(lines) < 30, "a line per page would flood the output of a 500-page book"
    assert re.search(r"book\.pdf: p\. \d+/30 \(\d+%\) · [\d.]+ p/s · ETA \d+", result.stderr), (
        f"no rate and ETA in the progress lines:\n{result.stderr}")
    assert "\r" not in result.stderr and "\x1b[" not in result.stderr, (
        "terminal bars were written to a file")


def run_on_terminal(argv: list[str], timeout: float, columns: int = 120) -> tuple[int, str]:
    """Run `argv` with a pseudo-terminal as its stdin, stdout and stderr, as a person would."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, columns, 0, 0))  # rows, cols
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=ocrvl_env(),
                            start_new_session=True)
    os.close(slave)
    output = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every writer has closed the terminal
                    break
                if not chunk:
                    break
                output += chunk
            elif proc.poll() is not None:
                break
        code = proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(master)
    return code, output.decode("utf-8", errors="replace")


@pytest.mark.slow
def test_convert_on_a_terminal_shows_live_bars_per_document_and_overall(
        tmp_path: Path, slow_server: FakeServerProcess):
    book = make_pdf(tmp_path / "book.pdf", 20, seed=1)
    letter = make_pdf(tmp_path / "letter.pdf", 3, seed=2)
    config = write_config(tmp_path / "config.yaml",
                          pipeline=SLOW_PIPELINE)
    code, screen = run_on_terminal(
        ocrvl_argv("convert", "--config", config, "--server-url", slow_server.api_url,
                   book, letter), timeout=180)
    assert code == 0, screen
    assert re.search(r"book\.pdf: +\d+%\|.*\| *\d+/20 \[", screen), (
        f"no live bar for the book:\n{screen}")
    assert re.search(r"letter\.pdf: +\d+%\|.*\| *\d+/3 \[", screen), (
        f"no live bar for the letter:\n{screen}")
    assert re.search(r"all: 100%\|.*\| 23/23 \[[\d:]+<[\d:]+, +[\d.]+p/s\]", screen), (
        f"the overall bar does not end at 23/23 pages with a rate:\n{screen}")
    assert re.search(r"book\.pdf: +\d+%\|.*\| *\d+/20 \[[\d:]+<[\d:?]+", screen), (
        "the book's bar has no ETA")
    assert "2 of 2 converted" in screen and "book.pdf: done" in screen, (
        f"log lines were lost under the bars:\n{screen}")


@pytest.mark.slow
def test_convert_on_a_terminal_of_0_columns_prints_progress_lines(
        tmp_path: Path, slow_server: FakeServerProcess):
    book = make_pdf(tmp_path / "book.pdf", 12, seed=1)
    config = write_config(tmp_path / "config.yaml", progress_seconds=1, pipeline=SLOW_PIPELINE)
    code, screen = run_on_terminal(
        ocrvl_argv("convert", "--config", config, "--server-url", slow_server.api_url, book),
        timeout=180, columns=0)
    assert code == 0, screen
    assert progress_lines(screen, "book.pdf"), f"no progress at all on 0 columns:\n{screen}"


@pytest.mark.slow
def test_ctrl_c_says_it_is_stopping_at_once_and_exits_within_seconds(
        tmp_path: Path, slow_server: FakeServerProcess):
    book = make_pdf(tmp_path / "book.pdf", 200, seed=1)
    config = write_config(tmp_path / "config.yaml", progress_seconds=0.5,
                          pipeline=SLOW_PIPELINE)
    log_path = tmp_path / "convert.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            ocrvl_argv("convert", "--config", config, "--server-url", slow_server.api_url, book),
            stdout=out, stderr=subprocess.STDOUT, env=ocrvl_env(), start_new_session=True)
    try:
        wait_until(lambda: progress_lines(log_path.read_text("utf-8"), "book.pdf"), 120,
                   what="the book to be under way")
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: the whole foreground group
        pressed = time.monotonic()
        wait_until(lambda: "stopping" in log_path.read_text("utf-8"), 2,
                   what="convert to say it is stopping")
        code = proc.wait(15)
        took = time.monotonic() - pressed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = log_path.read_text("utf-8")
    assert code == 130, log
    assert took < 10, f"convert took {took:.1f} s to stop after Ctrl-C"
    assert "Traceback" not in log, log
    assert not (tmp_path / "book.md").exists()


@pytest.mark.slow
def test_daemon_logs_a_progress_line_per_running_document_at_a_steady_cadence(tmp_path: Path):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    config = write_config(
        tmp_path / "config.yaml", progress_seconds=1,
        inbox={"paths": [str(inbox)], "stable_seconds": 0.3, "poll_interval": 0.2},
        pipeline=SLOW_PIPELINE,
        server=managed_fake_server(free_port(), "--step-t0-ms", "60", "--max-num-seqs", "2"))
    with DaemonProcess(config) as daemon:
        daemon.wait_ready()
        book = make_pdf(tmp_path / "src" / "book.pdf", 30, seed=1)
        os.rename(book, inbox / "book.pdf")
        started = time.monotonic()
        wait_until(lambda: (inbox / "book.md").exists(), 180, what="the book to be converted")
        took = time.monotonic() - started
    lines = progress_lines(daemon.log(), "book.pdf")
    assert len(lines) >= 2, f"the log does not show the book advancing:\n{daemon.log()}"
    assert [done for done, _ in lines] == sorted({done for done, _ in lines})
    assert all(total == 30 for _, total in lines)
    assert len(lines) <= took + 1, "more than one progress line a second"
    assert re.search(r"INFO ocrvl_daemon\.observe\.progress: book\.pdf: p\. \d+/30 \(\d+%\) · "
                     r"[\d.]+ p/s · ETA \d+", daemon.log()), daemon.log()


@pytest.mark.slow
def test_daemon_restarted_over_a_converted_inbox_says_so_in_one_line(tmp_path: Path):
    inbox = tmp_path / "inbox"
    config = write_config(
        tmp_path / "config.yaml",
        inbox={"paths": [str(inbox)], "stable_seconds": 0.3, "poll_interval": 0.2},
        server=managed_fake_server(free_port()))
    names = [f"scan-{n:02d}" for n in range(12)]
    for n, name in enumerate(names):
        make_pdf(inbox / f"{name}.pdf", 1, seed=n)
    daemon = DaemonProcess(config)
    try:
        daemon.start().wait_ready()
        wait_until(lambda: all((inbox / f"{n}.md").exists() for n in names), 120,
                   what="the inbox to be converted")
        assert daemon.terminate() == 0
        first_run = len(daemon.log())
        daemon.start().wait_ready()
        wait_until(lambda: "already converted" in daemon.log()[first_run:], 30,
                   what="the restarted daemon to look at the inbox")
    finally:
        daemon.terminate()
    restart = daemon.log()[first_run:]
    about_files = [line for line in restart.splitlines() if "scan-" in line]
    assert not about_files, "a restart logs a line per converted file:\n" + "\n".join(about_files)
    assert "12 document(s) in the inbox already converted" in restart, restart

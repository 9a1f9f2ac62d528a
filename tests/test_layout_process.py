"""The layout model on the CPU runs in a process of its own beside each engine worker (the
GIL stays with the pages' own work), is warmed before its worker takes pages, goes with its
worker, and a crash of it costs no page.

Real daemon, real engine workers, the stand-in PP-DocLayoutV3 of `testkit.layout_model` on
PaddleX's static-graph engine, a managed fake server.
"""

from __future__ import annotations

import signal
from pathlib import Path

import psutil
import pytest

from testkit.documents import make_layout_pdf
from testkit.harness import wait_until
from testkit.runner import DaemonProcess

LAYOUT_PROCESS = "ocrvl_daemon.worker.layout_process"
WORKER = "ocrvl_daemon.worker.main"
PAGES = 12


def processes(part: str, under: int) -> list[psutil.Process]:
    """The live descendants of process `under` whose command line contains `part`."""
    found = []
    for proc in psutil.Process(under).children(recursive=True):
        try:
            if any(part in arg for arg in proc.cmdline()) and proc.status() != "zombie":
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.mark.slow
def test_the_layout_model_has_made_its_first_call_before_its_worker_takes_pages(
        layout_daemon: tuple[Path, Path, DaemonProcess]) -> None:
    _, _, daemon = layout_daemon
    ready = wait_until(lambda: [line for line in daemon.log().splitlines() if " ready in " in line],
                       120, interval=0.2, what="the engine worker ready")
    assert "its layout model warmed on a blank page in" in ready[0], (
        f"the engine worker took pages before its layout model's first (slowest) call: "
        f"{ready[0]}")
    # The layout process builds the same pipeline as its worker: the libraries' messages are
    # said once, by the worker, through ocrvl's log (no colour codes, no ccache warning).
    log = daemon.log()
    assert "\x1b[" not in log, f"colour codes in the log:\n{log[-3000:]}"
    assert "No ccache found" not in log, f"Paddle's ccache warning in the log:\n{log[-3000:]}"
    lines = [line.split(" ", 1)[-1] for line in log.splitlines()]  # without the time
    twice = {line for line in lines if lines.count(line) > 1 and "paddle" in line.lower()}
    assert not twice, f"the libraries' messages were said twice: {twice}\n{log[-3000:]}"


@pytest.mark.slow
def test_a_crash_of_the_layout_process_ends_its_worker_and_costs_no_page(
        layout_daemon: tuple[Path, Path, DaemonProcess]) -> None:
    inbox, _, daemon = layout_daemon
    assert daemon.proc is not None
    pid = daemon.proc.pid
    first = wait_until(lambda: processes(LAYOUT_PROCESS, pid), 120, interval=0.2,
                       what="the layout model's process beside the engine worker")[0]
    worker = first.parent()
    assert worker is not None and any(WORKER in arg for arg in worker.cmdline()), (
        "the layout model's process is not the engine worker's child")
    wait_until(lambda: " ready in " in daemon.log(), 120, interval=0.2,
               what="the engine worker ready")
    make_layout_pdf(inbox / "book.pdf", PAGES)
    wait_until(lambda: f"{PAGES} pages queued" in daemon.log(), 60, interval=0.1,
               what="the book queued")
    first.send_signal(signal.SIGKILL)
    wait_until(lambda: (inbox / "book.md").exists(), 240, interval=0.5,
               what=f"book.md after the layout process was killed:\n{daemon.log()[-3000:]}")
    log = daemon.log()
    assert "this engine worker ends" in log, log[-3000:]
    assert not worker.is_running() or worker.status() == "zombie", (
        "the worker went on without its layout model")
    again = processes(LAYOUT_PROCESS, pid)
    assert again and again[0].pid != first.pid, "no new layout process with the new worker"
    markdown = (inbox / "book.md").read_text(encoding="utf-8")
    assert all(f"<!-- page {n} -->" in markdown for n in range(1, PAGES + 1)), markdown[:2000]
    assert "<!-- ocrvl: page" not in markdown, f"a page was lost or flagged:\n{markdown}"
    daemon.terminate()
    left = [p for p in again if p.is_running() and p.status() != "zombie"]
    assert not left, f"layout processes outlived the daemon: {left}"

"""`ocrvl run`: inbox -> Markdown exactly once, resume after SIGKILL, fairness, status/retry.

Every test runs the real daemon as a child process, which starts the fake vLLM server itself
(`server.launcher: command`), and the real PaddleOCR-VL pipeline (layout detection off).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.documents import make_encrypted_pdf, make_pdf
from testkit.harness import free_port, process_alive, wait_until
from testkit.inbox_daemon import Setup, digests, wait_for_markdown
from testkit.runner import (
    DaemonProcess,
    broken_paddleocr,
    managed_fake_server,
    run_ocrvl,
    write_config,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    yield Setup(tmp_path)


def test_every_way_a_file_arrives_is_converted_exactly_once(setup: Setup):
    early = make_pdf(setup.inbox / "early.pdf", 2, seed=1)
    with setup.daemon() as daemon:
        daemon.wait_ready()
        copied = setup.inbox / "copied.pdf"
        shutil.copyfile(make_pdf(setup.root / "src" / "copied.pdf", 2, seed=2), copied)
        moved = setup.inbox / "moved.pdf"
        os.rename(make_pdf(setup.root / "src" / "moved.pdf", 2, seed=3), moved)
        nested = make_pdf(setup.inbox / "a" / "b" / "nested.pdf", 1, seed=4)
        source = make_pdf(setup.root / "src" / "slow.pdf", 3, seed=5).read_bytes()
        slow = setup.inbox / "slow.pdf"
        with slow.open("wb") as f:  # a slow download: ~1.5 s, much longer than stable_seconds
            for start in range(0, len(source), len(source) // 6 + 1):
                f.write(source[start:start + len(source) // 6 + 1])
                f.flush()
                time.sleep(0.25)  # pacing the writer, not waiting for the daemon
        partial = make_pdf(setup.inbox / "download.pdf.part", 1, seed=6)
        hidden = make_pdf(setup.inbox / ".hidden.pdf", 1, seed=7)
        pdfs = [early, copied, moved, nested, slow]
        wait_for_markdown(*pdfs)
        wait_until(lambda: all(d["state"] == "done" for d in setup.status()["documents"]), 30,
                   what="all documents done")
        assert not partial.with_suffix(".md").exists() and not hidden.with_suffix(".md").exists()
        assert not (setup.inbox / "download.md").exists(), "an ignored .part file was converted"
        counts = setup.requests_by_digest()
        pages = [d for pdf in pdfs for d in digests(pdf.with_suffix(".md").read_text("utf-8"))]
        assert len(pages) == 10
        assert all(counts[d] == 1 for d in pages), f"a page was recognised twice: {counts}"
        assert sum(counts.values()) == 10, "requests were sent for files that must be ignored"
        assert len(setup.status()["documents"]) == 5
    assert daemon.proc is not None and daemon.proc.returncode == 0, daemon.log()


def test_sigkill_mid_book_then_restart_gives_identical_output_and_redoes_only_in_flight(
        tmp_path: Path):
    setup = Setup(tmp_path, "--step-t0-ms", "25", max_concurrency=4)
    pages = 40
    reference_dir = tmp_path / "reference"
    reference = make_pdf(reference_dir / "book.pdf", pages, seed=9)
    book = setup.inbox / "book.pdf"
    daemon = setup.daemon().start()
    try:
        daemon.wait_ready()
        shutil.copyfile(reference, book)
        wait_until(lambda: setup.checkpointed_pages() >= 12, 90, what="12 pages checkpointed")
        server_pid = int(re.findall(r"started server, pid (\d+)", daemon.log())[-1])
        worker_pid = int(re.findall(r"engine worker started \(pid (\d+)", daemon.log())[-1])
        daemon.kill()
        # The worker and the server die with the daemon, a moment later: only then is the
        # request log final for the first run. Not when its port closes: the requests in
        # flight are answered (500) and logged after that.
        wait_until(lambda: not process_alive(server_pid), 30, what="the first run's server to die")
        wait_until(lambda: not process_alive(worker_pid), 30,
                   what="the first run's engine worker (its own process group) to die")
        status = setup.status()
        assert status["daemon"]["running"] is False, (
            "`ocrvl status` shows a killed daemon as running"
        )
        assert status["server"]["state"] == "unknown", (
            f"`ocrvl status` vouches for the server of a killed daemon: {status['server']}"
        )
        done_before_kill = setup.checkpointed_digests()
        requested_before_kill = setup.requests_by_digest()
        assert len(done_before_kill) < pages, "the book finished before the kill; slow the server"
        daemon.start()
        wait_for_markdown(book)
    finally:
        daemon.terminate()
    # The same book converted in one go, with the same pipeline and server behaviour.
    ref = Setup(tmp_path / "ref")
    shutil.copyfile(reference, ref.inbox / "book.pdf")
    with ref.daemon() as ref_daemon:
        ref_daemon.wait_ready()
        wait_for_markdown(ref.inbox / "book.pdf")
    assert book.with_suffix(".md").read_text("utf-8") == \
        (ref.inbox / "book.md").read_text("utf-8"), "resumed output differs from a clean run"
    counts = setup.requests_by_digest()
    assert len(done_before_kill) >= 12
    sent_again = [d for d in done_before_kill if counts[d] != 1]
    assert not sent_again, f"pages checkpointed before the kill were sent again: {sent_again}"
    repeated = [d for d, n in counts.items() if n > 1]
    assert len(counts) == pages
    assert len(repeated) <= 4, f"{len(repeated)} pages redone; only the 4 in flight may be"
    assert all(requested_before_kill[d] >= 1 for d in repeated), \
        "a page never requested before the kill was requested twice"
    assert sum(counts.values()) <= pages + 4


def test_the_engine_worker_is_warm_before_the_first_file_arrives(tmp_path: Path):
    # The server takes a while to start, as vLLM does: the worker starts beside it.
    setup = Setup(tmp_path, "--startup-delay", "3")
    with setup.daemon() as daemon:
        worker_ready = re.compile(r"engine worker (\d+) ready in")
        wait_until(lambda: worker_ready.search(daemon.log()), 90,
                   what="the engine worker to be ready with no file in the inbox")
        daemon.wait_ready()
        log = daemon.log()
        assert log.index("engine worker started") < log.index("server ready at"), (
            "the engine worker waited for the server instead of starting beside it")
        match = worker_ready.search(log)
        assert match is not None
        pid = int(match.group(1))
        letter = make_pdf(setup.inbox / "letter.pdf", 1, seed=21)
        wait_for_markdown(letter)
        log = daemon.log()
        after_drop = log[log.index("letter.pdf: queued"):]
        assert "engine worker started" not in after_drop and worker_ready.search(after_drop) is \
            None, "the dropped file waited for an engine worker to start"
        assert log.count("engine worker started") == 1 and process_alive(pid), (
            "the warm worker was not the one that converted the file")
        assert sum(setup.requests_by_digest().values()) == 1


def test_small_letter_dropped_after_a_big_book_does_not_wait_for_it(tmp_path: Path):
    setup = Setup(tmp_path, "--step-t0-ms", "25", max_concurrency=4)
    book = setup.inbox / "book.pdf"
    letter = setup.inbox / "letter.pdf"
    with setup.daemon() as daemon:
        daemon.wait_ready()
        shutil.copyfile(make_pdf(tmp_path / "src" / "book.pdf", 60, seed=1), book)
        wait_until(lambda: setup.checkpointed_pages() >= 4, 90, what="the book to start")
        shutil.copyfile(make_pdf(tmp_path / "src" / "letter.pdf", 2, seed=2), letter)
        wait_for_markdown(letter)
        assert not book.with_suffix(".md").exists(), "the letter waited for the whole book"
        wait_for_markdown(book, timeout=120)


def test_a_pipeline_that_cannot_start_keeps_documents_queued_until_the_install_is_fixed(
    setup: Setup,
):
    shadow = setup.root / "shadow"
    with DaemonProcess(setup.config, **broken_paddleocr(shadow)) as daemon:
        daemon.wait_ready()
        pdf = make_pdf(setup.inbox / "book.pdf", 2)
        wait_until(lambda: "failed start 1" in daemon.log(), 60,
                   what="the worker's failed start to be logged")
        assert "No module named 'paddlex'. Fix: reinstall ocrvl" in daemon.log()
        status = wait_until(lambda: (s := setup.status())["daemon"].get("engine_error") and s,
                            30, what="`ocrvl status` to show why nothing converts")
        assert "could not start" in status["daemon"]["engine_error"]
        assert [d["state"] for d in status["documents"]] != ["failed"], (
            "the document was failed although only the installation is broken"
        )
        text = run_ocrvl("status", "--config", setup.config, timeout=60).stdout
        assert "engine: The recognition pipeline could not start" in text

        shutil.rmtree(shadow / "paddleocr")  # the user repairs the installation
        wait_for_markdown(pdf)
        assert "started after 1 failed start(s)" in daemon.log()


def test_status_shows_failures_and_retry_requeues_them(setup: Setup):
    with setup.daemon() as daemon:
        daemon.wait_ready()
        locked = make_encrypted_pdf(setup.inbox / "locked.pdf")
        blocked = make_pdf(setup.inbox / "blocked.pdf", 1, seed=3)
        (setup.inbox / "blocked.md").write_text("the user's own notes\n", encoding="utf-8")

        def failed() -> dict[str, dict]:
            docs = setup.status()["documents"]
            return {Path(d["path"]).name: d for d in docs if d["state"] == "failed"}

        failures = wait_until(lambda: len(failed()) == 2 and failed(), 60,
                              what="both documents to fail")
        assert "encrypted with a password" in failures["locked.pdf"]["error"]
        assert "was not written by ocrvl" in failures["blocked.pdf"]["error"]
        note = (setup.inbox / "locked.ocrvl-error.txt").read_text("utf-8")
        assert "encrypted" in note and "What to do" in note
        text = run_ocrvl("status", "--config", setup.config, timeout=60).stdout
        assert "daemon: running" in text and "encrypted with a password" in text

        (setup.inbox / "blocked.md").unlink()
        result = run_ocrvl("retry", "--config", setup.config, blocked, timeout=60)
        assert result.returncode == 0, result.stderr
        wait_for_markdown(blocked)
        make_pdf(locked, 1, seed=4)  # the user replaces it with an unlocked copy
        wait_for_markdown(locked)
        wait_until(lambda: not (setup.inbox / "locked.ocrvl-error.txt").exists(), 30,
                   what="the stale error note to be removed")
        assert not failed()
    text = run_ocrvl("status", "--config", setup.config, timeout=60).stdout
    assert "daemon: not running" in text, "`ocrvl status` shows a stopped daemon as running"


def test_renamed_or_moved_file_is_not_recognised_again(setup: Setup):
    with setup.daemon() as daemon:
        daemon.wait_ready()
        first = make_pdf(setup.inbox / "scan-001.pdf", 3, seed=11)
        wait_for_markdown(first)
        requests_before = sum(setup.requests_by_digest().values())
        renamed = setup.inbox / "archive" / "Annual report.pdf"
        renamed.parent.mkdir()
        os.rename(first, renamed)
        wait_for_markdown(renamed)
        assert sum(setup.requests_by_digest().values()) == requests_before, \
            "a moved file was sent to the model again instead of reusing its checkpoints"
        assert digests(renamed.with_suffix(".md").read_text("utf-8")) == \
            digests(first.with_suffix(".md").read_text("utf-8"))


def test_an_idle_daemon_keeps_its_status_current_without_writing_the_job_store(setup: Setup):
    """Status is derived: it goes to a runtime file each second, not through the job store
    (whose every write is an fsync)."""
    state = setup.root / "state"
    runtime = state / "daemon.json"
    with setup.daemon() as daemon:
        daemon.wait_ready()
        wait_until(runtime.exists, 30, what="the daemon's runtime file")
        store_files = sorted(state.glob("jobs.sqlite*"))
        before = {p: p.stat().st_mtime_ns for p in store_files}
        first = json.loads(runtime.read_text("utf-8"))["updated"]
        wait_until(lambda: json.loads(runtime.read_text("utf-8"))["updated"] >= first + 2.5, 30,
                   what="three more status ticks")
        assert {p: p.stat().st_mtime_ns for p in store_files} == before, (
            "an idle daemon wrote to its job store just to publish its status")
        assert setup.status()["daemon"]["running"] is True
    assert setup.status()["daemon"]["running"] is False, "a stopped daemon still shows running"


def test_an_inbox_that_cannot_be_created_is_not_announced_as_watched(tmp_path: Path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    good = tmp_path / "inbox"
    config = write_config(
        tmp_path / "config.yaml", inbox={"paths": [str(good), str(blocker / "inbox")]},
        pipeline={"use_layout_detection": False},
        server=managed_fake_server(free_port()))
    with DaemonProcess(config) as daemon:
        daemon.wait_ready()
        ready = next(line for line in daemon.log().splitlines() if "ready: server up" in line)
    assert f"watching {good}" in ready and str(blocker) not in ready, ready
    assert f"cannot create inbox {blocker / 'inbox'}" in daemon.log() or \
        str(blocker / "inbox") in daemon.log(), "the daemon said nothing of the inbox it lacks"

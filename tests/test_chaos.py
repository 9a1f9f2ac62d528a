"""Chaos and load: SIGKILL the daemon or the model server at random moments, drop 1,000 files.

The kill moments are drawn from a seeded RNG (printed; set OCRVL_CHAOS_SEED to replay a run)
as amounts of progress to wait for, so a kill can land before the engine worker is up, while
pages are in flight, or while a document is being assembled. After the chaos the daemon is
left to finish, and everything is compared with a clean run: same Markdown, byte for byte,
nothing missing or duplicated, nothing half-written, no process left behind.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from ocrvl_daemon.process.group import GroupRecord
from ocrvl_daemon.server.managed import PIDFILE_NAME
from testkit.documents import make_pdf
from testkit.harness import free_port, start_fake_server, wait_until
from testkit.inbox_daemon import Setup, wait_for_markdown
from testkit.runner import DaemonProcess, run_ocrvl, write_config

pytestmark = pytest.mark.slow

# 25 ms per decode step, 16 tokens a page, 4 pages at a time: ~10 pages/s, so a run of
# 72 pages lasts long enough to be interrupted many times.
SLOW_SERVER = ("--step-t0-ms", "25")
DOCUMENTS = {f"doc{i}.pdf": 12 for i in range(6)}
DAEMON_KILLS = 8
SERVER_KILLS = 4


def chaos_rng() -> random.Random:
    seed = int(os.environ.get("OCRVL_CHAOS_SEED", random.randrange(2**32)))
    print(f"chaos seed: {seed} (replay with OCRVL_CHAOS_SEED={seed})")
    return random.Random(seed)


def chaos_setup(root: Path) -> Setup:
    return Setup(root, *SLOW_SERVER, max_concurrency=4)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The documents, made once: PDFs carry a creation date, so every run gets these bytes."""
    folder = tmp_path_factory.mktemp("sources")
    for n, (name, pages) in enumerate(DOCUMENTS.items()):
        make_pdf(folder / name, pages, seed=100 + n)
    return folder


def drop_documents(setup: Setup, sources: Path) -> list[Path]:
    """Copy the documents beside the inbox, then move them in at once."""
    staged = shutil.copytree(sources, setup.root / "staged")
    return [Path(shutil.move(staged / name, setup.inbox / name)) for name in DOCUMENTS]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, sources: Path) -> dict[str, str]:
    """The Markdown of an uninterrupted run, by file name."""
    setup = chaos_setup(tmp_path_factory.mktemp("reference"))
    with setup.daemon() as daemon:
        daemon.wait_ready()
        pdfs = drop_documents(setup, sources)
        wait_for_markdown(*pdfs, timeout=180)
    return {p.with_suffix(".md").name: p.with_suffix(".md").read_text("utf-8") for p in pdfs}


def session_processes(sessions: set[int], port: int) -> list[str]:
    """Processes left from our daemons' sessions, their engine workers (each in its own
    session, named by its daemon's PID, which is the daemon's session id), or fake servers
    on our port."""
    left = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmdline = proc.info["cmdline"] or []
            ours = os.getsid(proc.pid) in sessions or (
                "testkit.fake_server" in cmdline and str(port) in cmdline) or (
                "from ocrvl_daemon.worker.main import serve; serve()" in cmdline
                and cmdline[-1] in {str(s) for s in sessions})
            if ours and proc.pid != os.getpid():
                left.append(f"{proc.pid}: {' '.join(cmdline)}")
        except (ProcessLookupError, psutil.Error):
            continue
    return left


def assert_like_reference(setup: Setup, pdfs: list[Path], reference: dict[str, str]) -> None:
    files = [p for p in setup.inbox.rglob("*") if p.is_file() or p.is_dir()]
    half_written = [p.name for p in files if ".ocrvl-tmp" in p.name]
    assert not half_written, f"temporary files left: {half_written}"
    markdown = sorted(p.name for p in files if p.suffix == ".md")
    assert markdown == sorted(reference), "Markdown files are missing or duplicated"
    for pdf in pdfs:
        md = pdf.with_suffix(".md").read_text("utf-8")
        assert md.startswith("<!-- ocrvl "), f"{pdf.name}: no ocrvl header"
        assert len(re.findall(r"<!-- page \d+ -->", md)) == DOCUMENTS[pdf.name]
        assert md == reference[pdf.with_suffix(".md").name], f"{pdf.name} differs from a clean run"
    assert all(d["state"] == "done" for d in setup.status()["documents"])


def progress_then(setup: Setup, rng: random.Random, alive: Callable[[], bool]) -> None:
    """Wait for a random amount of further progress (0 pages: kill at once), or the end."""
    target = setup.checkpointed_pages() + rng.choice([0, 0, 1, 3, 6, 10, 16])
    total = sum(DOCUMENTS.values())
    wait_until(lambda: not alive() or setup.checkpointed_pages() >= min(target, total), 120,
               interval=0.02, what=f"{target} pages checkpointed")


def test_daemon_sigkilled_again_and_again_loses_and_duplicates_nothing(
        tmp_path: Path, sources: Path, reference: dict[str, str]):
    rng = chaos_rng()
    setup = chaos_setup(tmp_path)
    daemon = setup.daemon()
    sessions: set[int] = set()
    pdfs: list[Path] = []
    try:
        for kill in range(DAEMON_KILLS):
            daemon.start()
            assert daemon.proc is not None
            sessions.add(daemon.proc.pid)
            daemon.wait_ready()
            if kill == 0:
                pdfs = drop_documents(setup, sources)
            progress_then(setup, rng, lambda: True)
            daemon.kill()
            print(f"kill {kill + 1}: {setup.checkpointed_pages()} pages checkpointed")
        daemon.start()
        assert daemon.proc is not None
        sessions.add(daemon.proc.pid)
        wait_for_markdown(*pdfs, timeout=180)
        wait_until(lambda: all(d["state"] == "done" for d in setup.status()["documents"]), 60,
                   what="every document done")
    finally:
        daemon.terminate()
    assert_like_reference(setup, pdfs, reference)
    wait_until(lambda: not session_processes(sessions, setup.port), 30,
               what="no process left behind")


def test_model_server_killed_at_random_moments_loses_nothing(
        tmp_path: Path, sources: Path, reference: dict[str, str]):
    rng = chaos_rng()
    setup = chaos_setup(tmp_path)
    pidfile = setup.root / "state" / PIDFILE_NAME
    with setup.daemon() as daemon:
        assert daemon.proc is not None
        daemon.wait_ready()
        pdfs = drop_documents(setup, sources)
        killed: set[int] = set()
        for _ in range(SERVER_KILLS):
            record = wait_until(
                lambda: (r := GroupRecord.load(pidfile)) and r.pgid not in killed and r, 120,
                what="a (re)started server")
            progress_then(setup, rng, lambda: True)
            os.killpg(record.pgid, signal.SIGKILL)
            killed.add(record.pgid)
            print(f"server group {record.pgid} killed at {setup.checkpointed_pages()} pages")
        wait_for_markdown(*pdfs, timeout=240)
        assert daemon.proc.poll() is None, "the daemon died with its server"
        sessions = {daemon.proc.pid}
    assert_like_reference(setup, pdfs, reference)
    assert "Traceback" not in daemon.log()
    wait_until(lambda: not session_processes(sessions, setup.port), 30,
               what="no process left behind")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_thousand_small_pdfs_at_once_in_bounded_memory_without_leaking(tmp_path: Path):
    setup = Setup(tmp_path)
    count = 1000
    staging = tmp_path / "staging"
    for i in range(count):
        make_pdf(staging / f"letter{i:04d}.pdf", 1, seed=i)
    with setup.daemon() as daemon:
        assert daemon.proc is not None
        process = psutil.Process(daemon.proc.pid)
        daemon.wait_ready()
        first = make_pdf(setup.inbox / "first.pdf", 1, seed=-1)
        wait_for_markdown(first)  # the engine worker is up: count fds from here
        fds_before = open_fds(process.pid)
        for pdf in sorted(staging.iterdir()):
            os.rename(pdf, setup.inbox / pdf.name)
        peak = [process.memory_info().rss]

        def all_converted() -> bool:
            peak.append(process.memory_info().rss)
            return len(list(setup.inbox.glob("*.md"))) == count + 1

        wait_until(all_converted, 600, interval=0.5, what=f"{count} documents converted")
        wait_until(lambda: not setup.status()["daemon"].get("in_flight"), 30,
                   what="the daemon to become idle")
        fds_after = open_fds(process.pid)
        rss_mb = max(peak) / 2**20
        print(f"{count} PDFs: peak daemon RSS {rss_mb:.0f} MiB, fds {fds_before} -> {fds_after}")
        assert rss_mb < 400, f"daemon RSS peaked at {rss_mb:.0f} MiB"
        assert fds_after <= fds_before + 2, f"file descriptors leaked: {fds_before}->{fds_after}"
        docs = setup.status()["documents"]
        assert len(docs) == count + 1 and all(d["state"] == "done" for d in docs)
    assert isinstance(daemon, DaemonProcess) and daemon.proc.returncode == 0


def test_an_external_server_killed_mid_book_is_reported_once_and_status_says_it_is_down(
        tmp_path: Path):
    port = free_port()
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    config = write_config(
        tmp_path / "config.yaml",
        inbox={"paths": [str(inbox)], "stable_seconds": 0.3, "poll_interval": 0.2},
        pipeline={"adaptive_concurrency": False, "max_concurrency": 4},
        server={"mode": "external", "url": f"http://127.0.0.1:{port}/v1",
                "health_interval": 5})
    server = start_fake_server(port, *SLOW_SERVER)
    try:
        with DaemonProcess(config) as daemon:
            daemon.wait_ready()
            make_pdf(tmp_path / "book.pdf", 40).rename(inbox / "book.pdf")
            wait_until(lambda: "book.pdf: 40 pages queued" in daemon.log(), 60,
                       what="the book to start")
            killed_at = len(daemon.log())  # what it says while the server dies counts too
            server.stop()

            def server_state() -> str:
                done = run_ocrvl("status", "--json", "--config", config, timeout=60)
                return str(json.loads(done.stdout)["server"]["state"])

            # Its probes alone take 3 x health_interval (15 s) to call it down.
            wait_until(lambda: server_state() != "ready", 10,
                       what="`ocrvl status` to stop saying `server: ready` after the kill")
            outage_lines = wait_until(
                lambda: [line for line in daemon.log()[killed_at:].splitlines()
                         if "book.pdf p." in line or "did not answer" in line] or None,
                10, what="a line saying the server went away")
            server = start_fake_server(port, *SLOW_SERVER)
            wait_until(lambda: (inbox / "book.md").exists(), 120, what="the book to finish")
            during = daemon.log()[killed_at:]
        lines = [line for line in during.splitlines()
                 if "book.pdf p." in line or "did not answer" in line or "answers again" in line]
        assert len(lines) <= 2, (
            f"the outage took {len(lines)} log lines, not one when it began and one when it "
            "ended:\n" + "\n".join(lines[:20]))
        assert outage_lines and re.search(r"answers again after .* \d+ failed request", during), (
            f"the end of the outage is not said with a count:\n{during[-3000:]}")
    finally:
        server.stop()

"""`ocrvl status` as a command: what it prints where nobody reads to the end."""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ocrvl_daemon.commands.status import finish_times
from ocrvl_daemon.core.job import PageFailure
from ocrvl_daemon.observe.daemon_state import write_runtime_file
from ocrvl_daemon.observe.stages import StageLoad
from ocrvl_daemon.storage.store import Store
from testkit.documents import make_pdf
from testkit.harness import wait_until
from testkit.runner import (
    DaemonProcess,
    managed_fake_server,
    ocrvl_argv,
    ocrvl_env,
    run_ocrvl,
    write_config,
)

MODEL = "PaddleOCR-VL-1.6-0.9B"


def test_status_piped_into_head_stops_quietly(tmp_path: Path):
    config = write_config(tmp_path / "config.yaml", state_dir=str(tmp_path / "state"))
    (tmp_path / "state").mkdir()
    store = Store(tmp_path / "state" / "jobs.sqlite")
    try:
        # Far more than a pipe holds (64 KiB), so `status` is still writing when head leaves.
        for n in range(2000):
            store.enqueue(tmp_path / f"scans/book-{n:04d}.pdf", f"sha-{n}", 1, float(n), MODEL)
    finally:
        store.close()
    proc = subprocess.Popen(ocrvl_argv("status", "--config", config), env=ocrvl_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b"daemon: not running")
    proc.stdout.close()  # what `| head -1` does once it has its line
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(60) == 141, stderr
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, (
        f"`ocrvl status | head` printed a traceback:\n{stderr}"
    )


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped (like a SIGKILLed daemon)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def daemon_said(store: Store, pid: int, server: dict, rate: float = 0.0,
                servers: list[dict] | None = None, stages: StageLoad | None = None) -> None:
    """Write the runtime file a daemon writes every second, as the daemon `pid`."""
    write_runtime_file(store.path.parent, {
        "pid": pid, "updated": time.time(), "pages_per_s": rate,
        "server": {"url": "http://127.0.0.1:8118/v1", **server}, "servers": servers or [],
        "stages": (stages or StageLoad()).to_json()})


def status_of(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    result = run_ocrvl("status", "--config", config, *args, timeout=60)
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture
def state(tmp_path: Path) -> Iterator[tuple[Path, Store]]:
    config = write_config(tmp_path / "config.yaml", state_dir=str(tmp_path / "state"))
    store = Store(tmp_path / "state" / "jobs.sqlite")
    try:
        yield config, store
    finally:
        store.close()


def test_server_of_a_killed_daemon_is_not_shown_ready(state):
    config, store = state
    # What a daemon SIGKILLed a moment ago leaves: a fresh report, a pid that is gone.
    daemon_said(store, dead_pid(), {"state": "ready", "last_error": "/health answered 503"})
    shown = json.loads(status_of(config, "--json").stdout)
    assert shown["daemon"]["running"] is False
    assert shown["server"]["state"] == "unknown", (
        f"`ocrvl status --json` vouches for the server of a dead daemon: {shown['server']}")
    assert shown["server"]["last_known"]["state"] == "ready", "the last known state was lost"
    text = status_of(config).stdout
    assert "server: ready" not in text, f"a dead daemon's server is shown as ready:\n{text}"
    assert "server: unknown (daemon not running; ready at" in text, text
    assert "last error: /health answered 503" in text, text


def test_text_status_shows_the_servers_last_error(state):
    config, store = state
    daemon_said(store, os.getpid(), {"state": "restarting", "attempt": 2,
                                     "last_error": "the server exited with status 1"})
    text = status_of(config).stdout
    assert "server: restarting" in text, text
    assert "last error: the server exited with status 1" in text, (
        f"the text view hides why the server is restarting:\n{text}")


def test_status_shows_each_server_endpoint_with_its_pages_in_flight_and_rate(state):
    config, store = state
    servers = [
        {"name": "gpu0/0", "url": "http://127.0.0.1:8118/v1", "state": "ready", "phase": "",
         "in_flight": 12, "pages_per_s": 1.6, "bound": 16, "restarts": 0, "last_error": None},
        {"name": "gpu0/1", "url": "http://127.0.0.1:8119/v1", "state": "restarting",
         "phase": "loading weights", "in_flight": 0, "pages_per_s": 0.0, "bound": 8,
         "restarts": 1, "last_error": "the server exited with status 1"},
    ]
    daemon_said(store, os.getpid(), {"state": "ready"}, rate=1.6, servers=servers)
    shown = json.loads(status_of(config, "--json").stdout)
    assert shown["servers"] == servers, "`status --json` does not list each endpoint"
    text = status_of(config).stdout
    assert ("server gpu0/0: ready at http://127.0.0.1:8118/v1, 12 in flight, 1.60 pages/s"
            in text), text
    assert ("server gpu0/1: restarting, loading weights at http://127.0.0.1:8119/v1, 0 in "
            "flight, 0.00 pages/s" in text), text
    assert "last error: the server exited with status 1" in text, text


def test_status_shows_each_stages_load_and_what_would_help_the_one_that_sets_the_pace(state):
    config, store = state
    daemon_said(store, os.getpid(), {"state": "ready"},
                stages=StageLoad(rendering=0.03, layout=0.97, server=0.4, layout_device="cpu"))
    lines = status_of(config).stdout.splitlines()
    at = lines.index("stages: layout 97% (limit) · server 40% · rendering 3%")
    assert "pipeline.layout_device: gpu" in lines[at + 1], lines
    daemon_said(store, os.getpid(), {"state": "ready"})
    assert "stages:" not in status_of(config).stdout, "an idle daemon's stages are noise"


def test_an_external_server_that_is_down_is_said_unreachable_without_stale_stage_loads(
        tmp_path: Path):
    url = "http://127.0.0.1:9/v1"
    config = write_config(tmp_path / "config.yaml", state_dir=str(tmp_path / "state"),
                          server={"mode": "external", "url": url})
    store = Store(tmp_path / "state" / "jobs.sqlite")
    try:
        daemon_said(store, os.getpid(), {"state": "unreachable", "phase": "", "url": url},
                    stages=StageLoad(rendering=0.03, layout=0.2, server=1.0))
    finally:
        store.close()
    text = status_of(config).stdout
    server = next(line for line in text.splitlines() if line.startswith("server:"))
    assert server.startswith(f"server: unreachable at {url} ("), text
    assert server.count(url) == 1 and "starting" not in server, server
    assert "stages:" not in text, f"the stages of a server that is down are shown:\n{text}"


def test_with_one_server_the_status_line_stays_as_it_was(state):
    config, store = state
    daemon_said(store, os.getpid(), {"state": "ready"}, servers=[
        {"name": "server", "url": "http://127.0.0.1:8118/v1", "state": "ready", "phase": "ready",
         "in_flight": 3, "pages_per_s": 1.0, "bound": 16, "restarts": 0, "last_error": None}])
    text = status_of(config).stdout
    assert "server: ready at http://127.0.0.1:8118/v1" in text.splitlines(), text


def test_status_lists_recent_documents_unless_all(state):
    config, store = state
    for n in range(30):
        job = store.enqueue(Path(f"/scans/old-{n:02d}.pdf"), f"sha-{n}", 1, float(n), MODEL)
        store.set_running(job.id, 1)
        store.set_done(job.id)
    failed = store.enqueue(Path("/scans/broken.pdf"), "sha-broken", 1, 0.0, MODEL)
    store.set_failed(failed.id, "not a PDF", permanent=True)
    store.enqueue(Path("/scans/waiting.pdf"), "sha-waiting", 1, 0.0, MODEL)

    recent = json.loads(status_of(config, "--json").stdout)
    names = [Path(d["path"]).name for d in recent["documents"]]
    assert names == [f"old-{n:02d}.pdf" for n in range(20, 30)] + ["broken.pdf", "waiting.pdf"], (
        "by default status should list what is not done and the last 10 converted")
    assert recent["documents_not_shown"] == 20
    assert "20 older converted documents (`ocrvl status --all`" in status_of(config).stdout
    everything = json.loads(status_of(config, "--json", "--all").stdout)
    assert len(everything["documents"]) == 32 and everything["documents_not_shown"] == 0
    assert "old-00.pdf" in status_of(config, "--all").stdout


def test_eta_of_each_document_counts_the_documents_sharing_the_server(state):
    config, store = state
    book = store.enqueue(Path("/scans/book.pdf"), "sha-book", 1, 0.0, MODEL)
    store.set_running(book.id, 100)
    for page in range(20):
        store.save_page("sha-book", MODEL, page, "text", {})
    letter = store.enqueue(Path("/scans/letter.pdf"), "sha-letter", 1, 0.0, MODEL)
    store.set_running(letter.id, 4)
    again = store.enqueue(Path("/scans/again.pdf"), "sha-again", 1, 0.0, MODEL)
    store.set_running(again.id, 10)
    store.requeue(again.id)  # `ocrvl retry`: queued, its page count known
    daemon_said(store, os.getpid(), {"state": "ready"}, rate=2.0)

    etas = {Path(d["path"]).name: d.get("eta_seconds")
            for d in json.loads(status_of(config, "--json").stdout)["documents"]}
    # 2 pages/s shared by three documents: the letter's 4 pages take 6 s, the next 6 pages of
    # `again` 6 s more, and the book's last 70 pages 35 s more.
    assert etas == {"letter.pdf": 6, "again.pdf": 12, "book.pdf": 47}, etas
    assert "ETA 47s" in status_of(config).stdout


def test_eta_of_a_document_waiting_for_a_slot_counts_the_documents_ahead():
    # Two slots: the third document starts once the second is done.
    times = finish_times([(1, 100), (2, 10), (3, 10)], rate=1.0, slots=2)
    assert times == {2: 20.0, 3: 40.0, 1: 120.0}


def test_a_daemon_whose_server_port_is_taken_says_in_status_that_it_keeps_trying(
    tmp_path: Path,
):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        config = write_config(
            tmp_path / "config.yaml", inbox={"paths": [str(tmp_path / "inbox")]},
            server=managed_fake_server(port, restart_backoff_initial=0.2,
                                       restart_backoff_max=0.5))
        with DaemonProcess(config):
            def says_it_keeps_trying() -> str | None:
                text = status_of(config).stdout
                return text if "the daemon keeps trying" in text else None

            text = wait_until(says_it_keeps_trying, 60, what="status saying it keeps trying")
    assert re.search(r"server: restarting, next try in 0\.[0-5]s", text), text
    assert f"port {port} on 127.0.0.1 is taken by another program" in text, text
    assert "set server.port to a free port" in text, text


def test_status_json_has_a_lossless_path_and_retry_takes_the_escaped_name_back(state, tmp_path):
    config, store = state
    path = tmp_path / os.fsdecode(b"caf\xe9.pdf")
    job = store.enqueue(path, "sha", 1, 1.0, MODEL)
    store.set_failed(job.id, "boom", permanent=True)
    doc = json.loads(status_of(config, "--json").stdout)["documents"][0]
    assert doc["path"] == str(tmp_path / "caf\\xe9.pdf"), doc
    assert base64.b64decode(doc["path_b64"]) == os.fsencode(path), doc
    result = run_ocrvl("retry", "--config", config, doc["path"], timeout=60)
    assert result.returncode == 0, result.stderr
    assert store.job(job.id).state.value == "queued", "retry did not take the shown name"


def test_a_dead_daemons_running_document_is_not_shown_running(state):
    config, store = state
    job = store.enqueue(Path("/books/big.pdf"), "sha", 1, 1.0, MODEL)
    store.set_running(job.id, 247)
    daemon_said(store, dead_pid(), {"state": "ready"})
    text = status_of(config).stdout
    line = next(line for line in text.splitlines() if "big.pdf" in line)
    assert "running" not in line and "stopped" in line, text
    assert "resumes when the daemon starts" in line, text
    assert json.loads(status_of(config, "--json").stdout)["documents"][0]["state"] == "stopped"


def test_a_page_count_that_is_known_is_shown_not_a_question_mark(state, tmp_path):
    config, store = state
    queued = make_pdf(tmp_path / "queued.pdf", 3)
    store.enqueue(queued, "sha-q", 1, 1.0, MODEL)
    found_done = make_pdf(tmp_path / "found.pdf", 1)
    found_done.with_suffix(".md").write_text(
        f'<!-- ocrvl source="found.pdf" sha256="sha-d" model="{MODEL}" pages="5" -->\n',
        encoding="utf-8")
    store.set_done(store.enqueue(found_done, "sha-d", 1, 1.0, MODEL).id)
    text = status_of(config).stdout
    assert "0/3 pages" in text and "5/5 pages" in text and "/?" not in text, text


def test_retry_while_the_daemon_is_stopped_says_it_waits_for_the_next_start(state):
    config, store = state
    job = store.enqueue(Path("/books/a.pdf"), "sha", 1, 1.0, MODEL)
    store.set_failed(job.id, "boom", permanent=True)
    result = run_ocrvl("retry", "--config", config, "--failed", timeout=60)
    assert result.returncode == 0, result.stderr
    assert "the daemon is not running: they are converted once it starts" in result.stderr


def test_status_advice_keeps_the_config_file_and_needs_no_user_manager(state, tmp_path):
    config, store = state
    job = store.enqueue(Path("/books/a.pdf"), "sha", 1, 1.0, MODEL)
    store.save_page("sha", MODEL, 1, "", {}, failure=PageFailure.RETRYABLE)
    store.set_done(job.id)
    result = run_ocrvl("status", "--config", config, timeout=60,
                       XDG_RUNTIME_DIR=str(tmp_path / "no-user-manager"))
    text = result.stdout
    assert f"start it with `ocrvl run --config {config}` (no systemd user manager" in text, text
    assert "systemctl" not in text, text
    assert f"redo: ocrvl retry --config {config} --pages 2 /books/a.pdf" in text, text


def test_a_ready_server_is_said_ready_once(state):
    config, store = state
    daemon_said(store, os.getpid(), {"state": "ready", "phase": "ready"})
    text = status_of(config).stdout
    assert "server: ready at http://127.0.0.1:8118/v1" in text.splitlines(), text


def test_status_shows_an_inbox_that_cannot_be_created(tmp_path: Path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    config = write_config(tmp_path / "config.yaml", inbox={"paths": [str(blocker / "inbox")]})
    text = status_of(config).stdout
    assert (f"inbox {blocker / 'inbox'}: cannot be created: {blocker} is not a folder: no PDF "
            "is picked up there") in text, text


def test_a_failed_managed_server_says_it_is_not_started_again(state):
    config, store = state
    daemon_said(store, os.getpid(), {"state": "failed", "last_error": "no vllm"})
    text = status_of(config).stdout
    assert "the daemon does not start it again: fix the cause below" in text, text


def test_retry_of_a_file_the_daemon_does_not_know_suggests_convert_with_the_config(state):
    config, _ = state
    result = run_ocrvl("retry", "--config", config, "/books/unknown.pdf", timeout=60)
    assert result.returncode == 4, result.stderr
    assert f"`ocrvl convert --config {config} /books/unknown.pdf`" in result.stderr, \
        result.stderr

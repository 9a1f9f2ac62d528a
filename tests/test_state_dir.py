"""The state folder and the folders ocrvl writes into: one daemon per state_dir, a full
state disk, read-only inbox folders. Real daemons, real mounts (tmpfs, read-only binds)."""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ocrvl_daemon.errors import ExitCode
from ocrvl_daemon.output.document_files import read_header
from testkit.documents import make_pdf
from testkit.harness import free_port, wait_until
from testkit.runner import (
    DaemonProcess,
    managed_fake_server,
    run_ocrvl,
    write_config,
)

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def mounted(target: Path, *how: str) -> Iterator[None]:
    """Run `mount HOW TARGET`, and unmount it after; skip where mounting is not permitted."""
    target.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", *how, str(target)], capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here ({done.stderr.strip()}); needs root in a container "
                    "that allows mounts")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """`folder` read-only even for root (chmod does not stop root): a read-only bind mount."""
    with mounted(folder, "--bind", str(folder)):
        done = subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"cannot remount read-only here ({done.stderr.strip()})")
        yield


def daemon_config(tmp_path: Path, **extra: object) -> Path:
    inbox = tmp_path / "inbox"
    inbox.mkdir(exist_ok=True)
    return write_config(
        tmp_path / "config.yaml",
        inbox={"paths": [str(inbox)], "stable_seconds": 0.3, "poll_interval": 0.2},
        server=managed_fake_server(free_port()),
        **extra,
    )


def status(config: Path) -> dict:
    result = run_ocrvl("status", "--json", "--config", config, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_second_daemon_on_the_same_state_dir_stops_at_once_naming_the_first(tmp_path: Path):
    config = daemon_config(tmp_path)
    with DaemonProcess(config) as first:
        first.wait_ready(90)
        assert first.proc is not None
        second = run_ocrvl("run", "--config", config, timeout=30)
        assert second.returncode == ExitCode.CONFIG, second.stderr
        assert f"already running (pid {first.proc.pid})" in second.stderr, second.stderr
        assert "systemctl --user stop ocrvl" in second.stderr, "the message names no way out"
        assert "Traceback" not in second.stderr
        assert first.proc.poll() is None, "the second daemon disturbed the first"
        assert status(config)["daemon"]["pid"] == first.proc.pid

        # `ocrvl convert` beside the daemon: works, and stays out of the daemon's queue.
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        pdf = make_pdf(elsewhere / "letter.pdf", 1)
        server_url = f"http://127.0.0.1:{yaml_port(config)}/v1"
        result = run_ocrvl("convert", "--config", config, "--server-url", server_url, pdf)
        assert result.returncode == 0, result.stderr
        assert pdf.with_suffix(".md").exists()
        assert all(d["path"] != str(pdf) for d in status(config)["documents"]), (
            "a file converted with `ocrvl convert` appeared in the daemon's queue"
        )
    assert first.proc.returncode == 0, first.log()[-3000:]
    # Once the first has stopped, a new one starts.
    with DaemonProcess(config) as again:
        again.wait_ready(90)


def yaml_port(config: Path) -> int:
    import yaml

    return int(yaml.safe_load(config.read_text())["server"]["port"])


def test_a_full_state_disk_pauses_the_daemon_and_it_resumes_when_space_returns(tmp_path: Path):
    state = tmp_path / "state"
    with mounted(state, "-t", "tmpfs", "-o", "size=8m", "tmpfs"):
        config = daemon_config(tmp_path)
        inbox = tmp_path / "inbox"
        with DaemonProcess(config) as daemon:
            daemon.wait_ready(90)
            filler = state / "filler"
            with contextlib.suppress(OSError), filler.open("wb") as f:
                while True:  # until the disk is full
                    f.write(b"\0" * 65536)
                    f.flush()
            book = make_pdf(inbox / "book.pdf", 3)

            wait_until(lambda: "paused: The disk holding the state folder" in daemon.log(), 30,
                       what="the daemon to say it is paused")
            assert daemon.proc is not None and daemon.proc.poll() is None, (
                f"the daemon ended on a full state disk:\n{daemon.log()[-3000:]}"
            )
            shown = run_ocrvl("status", "--config", config, timeout=60).stdout
            assert "paused: The disk holding the state folder" in shown, shown
            assert f"df -h {state}" in shown, f"status names no fix:\n{shown}"
            assert not book.with_suffix(".md").exists()

            filler.unlink()
            wait_until(book.with_suffix(".md").exists, 90,
                       what="the book to be converted once there is space again")
            log = daemon.log()
            assert log.count("resumed: there is space again") == 1, log[-5000:]
            assert log.count("paused: The disk holding the state folder") == 1, (
                f"the pause was said more than once while the disk stayed full:\n{log[-5000:]}")
            assert len(re.findall(r"<!-- page \d+ -->",
                                  book.with_suffix(".md").read_text("utf-8"))) == 3
            assert "paused" not in run_ocrvl("status", "--config", config, timeout=60).stdout
        assert daemon.proc.returncode == 0, daemon.log()[-3000:]
        assert "Traceback" not in daemon.log(), daemon.log()[-5000:]


def test_a_read_only_inbox_folder_is_named_as_the_cause(tmp_path: Path):
    config = daemon_config(tmp_path)
    shelf = tmp_path / "inbox" / "shelf"
    shelf.mkdir()
    book = make_pdf(shelf / "book.pdf", 2)
    with read_only(shelf), DaemonProcess(config) as daemon:
        daemon.wait_ready(90)
        cause = f"the folder is not writable: {shelf}"

        def reason() -> str:
            docs = status(config)["documents"]
            return docs[0]["error"] if docs and docs[0]["error"] else ""

        shown = wait_until(reason, 60, what="status to give the reason")
        assert cause in shown, shown
        assert cause in daemon.log()
        note = shelf / "book.ocrvl-error.txt"
        assert f"no error note could be left at {note}" in daemon.log()
        assert "Traceback" not in daemon.log() and "Unexpected error" not in daemon.log(), (
            daemon.log()[-5000:]
        )
    assert not book.with_suffix(".md").exists()


def test_a_daemon_note_advises_a_retry_that_reaches_this_daemon(tmp_path: Path):
    config = daemon_config(tmp_path)
    inbox = tmp_path / "inbox"
    book = make_pdf(inbox / "book.pdf", 1)
    mine = inbox / "book.md"
    mine.write_text("my own notes\n", encoding="utf-8")
    note = inbox / "book.ocrvl-error.txt"
    with DaemonProcess(config) as daemon:
        daemon.wait_ready(90)
        wait_until(note.exists, 60, what="an error note next to the book")
        advice = re.search(r"After fixing it, run: (.+)", note.read_text(encoding="utf-8"))
        assert advice, note.read_text(encoding="utf-8")
        command = shlex.split(advice[1])
        assert command[:2] == ["ocrvl", "retry"] and str(config) in command, (
            f"the advice would not reach this daemon (it runs with --config {config}): "
            f"{advice[1]}"
        )
        mine.rename(inbox / "my-notes.txt")  # the fix the note asks for
        result = run_ocrvl(*command[1:], timeout=60)
        assert result.returncode == 0, result.stderr
        wait_until(lambda: read_header(book.with_suffix(".md")), 60,
                   what="the book to be converted after the advised retry")

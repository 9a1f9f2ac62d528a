"""The one atomic write: readers and crashes see the old content or the new, never a part."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ocrvl_daemon.files import atomic
from ocrvl_daemon.files.atomic import TMP_MARK, write_atomic

SIZE = 4 * 1024 * 1024  # big enough that a write takes a while, so a kill lands inside one
DEADLINE = 60.0
# Writes the target over and over, alternating two contents, until it is killed.
WRITER = """
import sys
from pathlib import Path
from ocrvl_daemon.files.atomic import write_atomic
target, size = Path(sys.argv[1]), int(sys.argv[2])
i = 0
while True:
    write_atomic(target, (b"A" if i % 2 else b"B") * size)
    i += 1
"""


def temporaries(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if TMP_MARK in p.name]


def assert_whole(target: Path) -> None:
    data = target.read_bytes()
    assert len(data) == SIZE and data in (b"A" * SIZE, b"B" * SIZE), (
        f"{target} was seen half-written: {len(data)} bytes, starting {data[:8]!r}")


def kill_while_writing(target: Path) -> bool:
    """Run a writer, reading the target while it writes, then SIGKILL it while a temporary
    exists; True when the kill left that temporary behind (it died mid-write)."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(target), str(SIZE)])
    try:
        deadline = time.monotonic() + DEADLINE
        reads = 0
        while reads < 20 or not temporaries(target.parent):
            assert time.monotonic() < deadline, "the writer never got going"
            assert writer.poll() is None, f"the writer died by itself ({writer.returncode})"
            if target.exists():
                assert_whole(target)
                reads += 1
        writer.send_signal(signal.SIGKILL)
        assert writer.wait(DEADLINE) == -signal.SIGKILL
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert_whole(target)
    return bool(temporaries(target.parent))


def test_a_writer_killed_mid_write_leaves_the_old_or_new_content_never_a_part(
        tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    deadline = time.monotonic() + DEADLINE
    while not kill_while_writing(target):  # the kill may land between two writes: again
        assert time.monotonic() < deadline, "no kill landed inside a write"
    write_atomic(target, "next")
    assert target.read_text() == "next"
    assert temporaries(tmp_path) == [], "the killed writer's temporary was not cleaned up"


@pytest.mark.quick
def test_a_failing_write_keeps_the_old_content_and_leaves_no_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC shows up at fsync on real filesystems."""
    target = tmp_path / "config.yaml"
    write_atomic(target, "old: 1\n")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(target, "new: 2\n")
    monkeypatch.undo()
    assert target.read_text() == "old: 1\n", "a failed write damaged the old content"
    assert temporaries(tmp_path) == [], "a failed write left its temporary behind"


@pytest.mark.quick
def test_a_rename_that_fails_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "book.md"
    target.mkdir()
    (target / "inside").write_text("not ours")
    with pytest.raises(OSError):
        write_atomic(target, b"text")
    assert (target / "inside").read_text() == "not ours"
    assert temporaries(tmp_path) == [], "a failed rename left its temporary behind"


@pytest.mark.quick
def test_text_and_bytes_are_written_and_a_file_keeps_its_permissions(tmp_path: Path) -> None:
    secret = tmp_path / "config.yaml"
    write_atomic(secret, "server:\n  api_key: ü\n")
    assert secret.read_bytes() == "server:\n  api_key: ü\n".encode()
    secret.chmod(0o600)
    write_atomic(secret, b"server: {}\n")
    assert secret.read_bytes() == b"server: {}\n"
    assert secret.stat().st_mode & 0o777 == 0o600, "rewriting a private file made it readable"

"""One daemon per state_dir: an exclusive lock on `state_dir/daemon.lock`, held for life.

The kernel drops the lock when the daemon dies, even by SIGKILL, so a stale file never
blocks a restart. The file holds the daemon's pid and, while the store's disk is full, why
it is paused: the file is written once at its full size and then only rewritten in place,
which needs no free space (the store itself cannot take a word then).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from ocrvl_daemon.errors import AlreadyRunningError

LOCK_NAME = "daemon.lock"
_SIZE = 2048  # room for the pid and a pause note, rewritten in place


class StateLock:
    """The held lock of `state_dir`; `note()` says why the daemon is paused."""

    def __init__(self, state_dir: Path) -> None:
        path = state_dir / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, _SIZE).decode("utf-8", "replace").partition("\n")[0].strip()
            os.close(fd)
            raise AlreadyRunningError(
                f"ocrvl is already running (pid {holder or '?'}) on state_dir {state_dir}; "
                "this one does not start.",
                f"stop it first (`systemctl --user stop ocrvl`, or `kill {holder or 'PID'}` "
                "when it runs in a terminal), or give this one another state_dir",
            ) from None
        self.fd = fd
        self._pid = os.getpid()
        self.note(None)

    def note(self, text: str | None) -> None:
        """Publish why the daemon is paused (None: it is not); never needs free space."""
        body = f"{self._pid}\n{text or ''}".encode()[: _SIZE - 1]
        with contextlib.suppress(OSError):  # best effort: the log says it too
            os.pwrite(self.fd, body.ljust(_SIZE - 1) + b"\n", 0)

    def release(self) -> None:
        """Clear the file and drop the lock."""
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        os.close(self.fd)


def paused_note(state_dir: Path) -> tuple[int, str] | None:
    """(pid, why) when a daemon on `state_dir` said it is paused, else None."""
    try:
        text = (state_dir / LOCK_NAME).read_text("utf-8", "replace")
    except OSError:
        return None
    pid, _, note = text.partition("\n")
    note = note.strip()
    return (int(pid), note) if note and pid.strip().isdigit() else None

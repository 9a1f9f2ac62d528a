"""The daemon's pause while the disk of state_dir is full.

A write to the store that fails for lack of space starts the pause. While paused, the free
space is read every few seconds, and the work is tried again only once there is room for a
checkpoint: a loop turn that happens to write nothing proves nothing, and taking it for
"space again" made the log alternate between resumed and paused while the disk stayed full.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from ocrvl_daemon.errors import StateFullError

# How often the free space is read while paused.
RETRY_SECONDS = 5.0
# Room for a page's checkpoint (its Markdown and images) and SQLite's journal; a disk still
# full has next to nothing (a small state disk may never have much more).
RESUME_FREE_BYTES = 2**20


def free_bytes(folder: Path) -> int:
    """Bytes this user may still write on the disk holding `folder`."""
    return shutil.disk_usage(folder).free


class StatePause:
    """Whether the work is paused for a full state disk, and when it may be tried again."""

    def __init__(self, folder: Path, free: Callable[[Path], int] = free_bytes) -> None:
        self.folder = folder
        self.reason: StateFullError | None = None
        self._free = free
        self._check_at = 0.0

    def full(self, exc: StateFullError, now: float) -> bool:
        """A write failed for lack of space; True when that starts the pause."""
        started = self.reason is None
        self.reason = exc
        self._check_at = now + RETRY_SECONDS
        return started

    def may_work(self, now: float) -> bool:
        """True unless paused with the disk still (or again) too full to write."""
        if self.reason is None:
            return True
        if now < self._check_at:
            return False
        self._check_at = now + RETRY_SECONDS
        try:
            return self._free(self.folder) >= RESUME_FREE_BYTES
        except OSError:
            return True  # the work itself then says what is wrong with the folder

    def worked(self) -> bool:
        """A loop turn ran without a full disk; True when that ends a pause."""
        ended = self.reason is not None
        self.reason = None
        return ended

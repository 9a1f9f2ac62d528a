"""The one atomic write: a file's new content appears under its name whole, or not at all.

The content goes to a hidden temporary name beside the target (same folder, so the rename
never crosses filesystems), is fsynced, renamed over the target with `os.replace`, and the
folder is fsynced so the rename itself survives a power cut. A crash at any moment leaves
the target with its old content or its new one, never a part of either; the temporary that
a killed writer leaves behind is removed by the next write of the same target. The hidden
names (`temporary`, `remove_temporaries`) are shared with output/document_files.py's commit
of a Markdown file together with its image folder.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
from pathlib import Path

from ocrvl_daemon.files.names import fit_name, name_max

TMP_MARK = ".ocrvl-tmp"
# What a temporary name adds to the name it stands for: a dot, "-new-" or "-old-", a pid.
_TMP_EXTRA = 1 + 5 + 10


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace `path`'s content with `data` (text as UTF-8) so that no reader, and no crash,
    ever sees it half-written; an existing file keeps its permissions.

    One writer per target at a time: a second one's temporary would be taken for a leftover.
    """
    tmp = temporary(path)
    try:
        remove_temporaries(path)
        try:
            mode: int | None = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = None
        # Created no more open than the file it replaces (a config holding an API key).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        with contextlib.suppress(OSError):  # never there, or the folder is read-only
            tmp.unlink()


def temporary(path: Path, kind: str = "new") -> Path:
    """A hidden name beside `path` for work in progress (never matched by the inbox)."""
    return path.with_name(f"{_temporary_prefix(path)}-{kind}-{os.getpid()}")


def _temporary_prefix(path: Path) -> str:
    """`.<name>.ocrvl-tmp`, the name shortened where a temporary name would not fit."""
    return "." + fit_name(path.name, TMP_MARK, name_max(path.parent) - _TMP_EXTRA)


def remove_temporaries(path: Path) -> None:
    """Remove what writers of `path` that were killed left under `temporary` names."""
    for stale in path.parent.glob(f"{glob.escape(_temporary_prefix(path))}-*"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    """Make the renames and removals inside folder `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

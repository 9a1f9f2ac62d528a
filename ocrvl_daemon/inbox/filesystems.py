"""Which filesystem a path lives on, and whether inotify can see changes there.

inotify only reports changes made through the local kernel: on network shares, WSL2's
`/mnt/c` (9p/drvfs) and VM shared folders nothing arrives, so those inboxes must be polled.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

MOUNTINFO = Path("/proc/self/mountinfo")
UNKNOWN = "unknown"

# Filesystems where inotify sees nothing (or only local writes). virtiofs is left out: it
# passes inotify through on current kernels.
POLLING_FSTYPES = frozenset({
    "9p",
    "drvfs",
    "cifs",
    "smb3",
    "smbfs",
    "nfs",
    "nfs4",
    "fuse.sshfs",
    "vboxsf",
    "fuse.vmhgfs-fuse",
})

_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in mount points as `\\ooo`."""
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[tuple[str, str]]:
    """(mount point, filesystem type) for each line of a /proc/*/mountinfo text, in order."""
    mounts: list[tuple[str, str]] = []
    for line in text.splitlines():
        fields = line.split()
        # Optional fields end at a lone "-"; the filesystem type follows it.
        if len(fields) < 7 or "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        if sep + 1 >= len(fields):
            continue
        mounts.append((_unescape(fields[4]), fields[sep + 1]))
    return mounts


def filesystem_type(path: str | Path, mountinfo: str | None = None) -> str:
    """The type of the filesystem holding `path` (e.g. "ext4", "9p"), or "unknown".

    `path` need not exist; the mount is the one with the longest mount point that is a
    prefix of the resolved path (the last one wins when mounts are stacked). `mountinfo`
    replaces /proc/self/mountinfo, for tests.
    """
    if mountinfo is None:
        try:
            mountinfo = MOUNTINFO.read_text(encoding="utf-8", errors="surrogateescape")
        except OSError as exc:
            log.debug("cannot read %s: %s", MOUNTINFO, exc)
            return UNKNOWN
    target = os.path.realpath(os.path.abspath(os.fspath(path)))
    best, best_len = UNKNOWN, -1
    for mount_point, fstype in parse_mountinfo(mountinfo):
        if mount_point == "/" or target == mount_point or target.startswith(mount_point + "/"):
            length = 0 if mount_point == "/" else len(mount_point)
            if length >= best_len:
                best, best_len = fstype, length
    return best


def needs_polling(fstype: str) -> bool:
    """True when inotify cannot see changes on a filesystem of this type."""
    return fstype.lower() in POLLING_FSTYPES

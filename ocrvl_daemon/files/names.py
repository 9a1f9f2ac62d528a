"""File names as the filesystem has them: any bytes but `/` and NUL, up to its length limit.

Python hands bytes of a name that are not UTF-8 (old Windows shares, zip files) over as
surrogate escapes (`os.fsdecode`): they reach the OS intact, but anything that encodes them
as UTF-8 (SQLite, journald, a text file, a terminal) fails. So a name is kept as it is for
the filesystem, `shown` (undecodable bytes as `\\xff`) wherever a person reads it, and
`shell_quote`d (as `$'\\xff'`) in a command to type. Companions of a document whose name is
near the filesystem's limit get a shortened but deterministic name (`fit_name`).
"""

from __future__ import annotations

import hashlib
import os
import shlex
from pathlib import Path

# Where the filesystem does not say (a folder that does not exist yet): ext4, btrfs, xfs...
DEFAULT_NAME_MAX = 255
# Hex digits of the full name's SHA-256 that a shortened name ends with.
HASH_CHARS = 8


def is_pdf_name(name: str) -> bool:
    """True for `*.pdf`, in any case."""
    return name.lower().endswith(".pdf")


def shown(text: str | os.PathLike[str]) -> str:
    """`text` (a path, or a message naming one) for people: bytes that are not UTF-8 as `\\xff`."""
    try:
        raw = os.fsencode(text)
    except UnicodeEncodeError:  # a lone surrogate that no file name produced
        raw = os.fspath(text).encode("utf-8", "backslashreplace")
    return raw.decode("utf-8", "backslashreplace")


def one_line(text: str | os.PathLike[str]) -> str:
    """`text` as `shown`, with line breaks and other control characters escaped as Python
    writes them (`\\n`, `\\x1b`): a file name holding them cannot split or colour a log line."""
    text = shown(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def shell_quote(path: str | os.PathLike[str]) -> str:
    """`path` as typed in bash or zsh: shlex quoting, or `$'...'` for bytes that are not
    UTF-8 and for control characters, so the command can be copied from a one-line log."""
    text = os.fspath(path)
    if text.isprintable() and shown(text) == text:
        return shlex.quote(text)
    parts = []
    for char in text:
        if "\udc80" <= char <= "\udcff":  # an undecodable byte, as os.fsdecode gives it
            parts.append(f"\\x{ord(char) - 0xDC00:02x}")
        elif char in "\\'":
            parts.append("\\" + char)
        elif not char.isprintable():
            parts.append("".join(f"\\x{b:02x}" for b in char.encode("utf-8", "surrogatepass")))
        else:
            parts.append(char)
    return "$'" + "".join(parts) + "'"


def name_max(folder: Path) -> int:
    """The longest file name, in bytes, that the filesystem holding `folder` allows."""
    try:
        limit = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):  # missing folder, or no such limit known
        return DEFAULT_NAME_MAX
    return limit if limit > 0 else DEFAULT_NAME_MAX


def fit_name(stem: str, suffix: str, limit: int) -> str:
    """`stem + suffix` if it fits in `limit` bytes; else the stem cut short, then `~` and
    the first 8 hex digits of the whole stem's SHA-256, then `suffix`.

    The same stem always gives the same name, two long stems that only differ near their
    end get different ones, and the start and the suffix stay recognisable.
    """
    raw = os.fsencode(stem)
    room = limit - len(os.fsencode(suffix))
    if len(raw) <= room:
        return stem + suffix
    digest = hashlib.sha256(raw).hexdigest()[:HASH_CHARS]
    keep = max(0, room - 1 - HASH_CHARS)
    while 0 < keep < len(raw) and raw[keep] & 0xC0 == 0x80:  # not inside a UTF-8 character
        keep -= 1
    return os.fsdecode(raw[:keep]) + "~" + digest + suffix


def name_bytes(name: str) -> int:
    """The length of a file name as the filesystem counts it."""
    return len(os.fsencode(name))

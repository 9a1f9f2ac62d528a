"""Which files under an inbox folder are candidates: the ignore rules and one walk of the tree.

A candidate is a `*.pdf` that no `inbox.ignore` pattern and none of ocrvl's own output
patterns hides, in a folder the walk may enter (`inbox.recursive`, ignored folders left
out). The watcher decides when a candidate is stable; this module only lists them.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ocrvl_daemon.config.model import InboxConfig
from ocrvl_daemon.files.atomic import TMP_MARK
from ocrvl_daemon.files.names import is_pdf_name
from ocrvl_daemon.output.document_files import ERROR_SUFFIX, IMAGES_SUFFIX
from ocrvl_daemon.output.searchable_pdf import SEARCHABLE_SUFFIX

log = logging.getLogger(__name__)

# ocrvl's own output must never trigger work: Markdown, searchable PDFs, image folders, error
# notes, temp files.
OWN_FILE_PATTERNS = ("*.md", f"*{SEARCHABLE_SUFFIX}", f"*{ERROR_SUFFIX}", f"*{TMP_MARK}*")
OWN_DIR_PATTERNS = (f"*{IMAGES_SUFFIX}", f"*{TMP_MARK}*")


@dataclass
class Listing:
    """What one scan found."""

    files: set[Path] = field(default_factory=set)
    links_out: set[Path] = field(default_factory=set)  # directory links leading out
    unreadable: list[Path] = field(default_factory=list)


def _ignored(name: str, inbox: InboxConfig, own: Iterable[str]) -> bool:
    return any(fnmatch.fnmatch(name, pat) for pat in (*inbox.ignore, *own))


def ignored_dir(name: str, inbox: InboxConfig) -> bool:
    """True for a folder name the walk must not enter."""
    return _ignored(name, inbox, OWN_DIR_PATTERNS)


def wanted_name(name: str, inbox: InboxConfig) -> bool:
    """True for a file name that is a candidate."""
    return is_pdf_name(name) and not _ignored(name, inbox, OWN_FILE_PATTERNS)


def walk(top: Path, inbox: InboxConfig, inside: Callable[[str], bool]) -> Listing:
    """What lies under `top`; `inside` says whether a real path lies in an inbox.

    Directory links are never followed: one leading inside an inbox is scanned at its
    real place, one leading out is not ours to read.
    """
    listing = Listing()
    stack = [top]
    while stack:
        folder = stack.pop()
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            log.warning("cannot list %s: %s", folder, exc)
            listing.unreadable.append(folder)
            continue
        for entry in entries:
            path = Path(entry.path)
            try:
                if entry.is_dir(follow_symlinks=False):
                    if inbox.recursive and not ignored_dir(entry.name, inbox):
                        stack.append(path)
                elif entry.is_symlink() and entry.is_dir():
                    if not inside(os.path.realpath(path)):
                        listing.links_out.add(path)
                elif wanted_name(entry.name, inbox):
                    listing.files.add(path)
            except OSError as exc:
                log.warning("cannot inspect %s: %s", path, exc)
    return listing


def outermost(dirs: Iterable[Path]) -> list[Path]:
    """Drop directories that lie inside another one in the set: scanning the outer covers them."""
    ordered = sorted(dirs, key=lambda d: len(d.parts))
    kept: list[Path] = []
    for folder in ordered:
        if not any(folder.is_relative_to(k) for k in kept):
            kept.append(folder)
    return kept

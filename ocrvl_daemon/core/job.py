"""A document's job and its checkpointed pages, as values: what the store keeps and the core
reads (the store, storage/store.py, reads and writes them)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, IntEnum
from pathlib import Path
from typing import Any


class JobState(str, Enum):
    """Where a document is in its life."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    GONE = "gone"  # its file was deleted while it was being converted; nothing was written


class PageFailure(IntEnum):
    """How a page ended, as stored in `pages.failed`."""

    NONE = 0
    RETRYABLE = 1  # every attempt failed; another may succeed (`ocrvl retry --pages`)
    DAMAGED = 2  # the page is damaged in the PDF itself: only a repaired file can help


@dataclass(frozen=True)
class Job:
    """A row of the jobs table."""

    id: int
    path: Path
    sha256: str
    size: int
    mtime: float
    model: str
    state: JobState
    attempts: int
    last_error: str | None
    page_count: int | None
    created: float
    updated: float
    started: float | None
    finished: float | None
    not_before: float
    redo_tokens: int  # extra tokens its last conversion took redoing cut-off pages
    hook_error: str | None = None  # why the last hook run for it failed


@dataclass(frozen=True)
class StoredPage:
    """A checkpointed page."""

    page: int
    markdown: str
    note: str | None
    failed: bool
    images: dict[str, bytes]
    quality: dict[str, Any] | None = None  # page_quality.PageQuality.to_json()
    layout: dict[str, Any] | None = None  # {"size": [w, h], "blocks": [...]}

    @property
    def verdict(self) -> str | None:
        """ok, suspect or bad (None: recorded before quality records, or a placeholder)."""
        return self.quality["verdict"] if self.quality else None

"""The durable job queue: SQLite (WAL) with one job per document and per-page checkpoints.

Page checkpoints are keyed by the document's content hash and the model, not by its path: a
renamed or moved file whose content was already converted reuses them, and a resumed run
assembles exactly what an uninterrupted run would have. Every page is committed with
`synchronous=FULL` before it counts as done, so a power cut loses only the pages in flight.
A document's path is kept as the raw bytes of its name (any name the filesystem allows);
texts for people (errors, page notes) are kept `shown`, since SQLite text must be UTF-8.
`ocrvl status` and `ocrvl retry` open the same database while the daemon runs; SQLite's
locking keeps them from corrupting it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ocrvl_daemon.core.job import Job, JobState, PageFailure, StoredPage
from ocrvl_daemon.errors import ConfigError, StateFullError
from ocrvl_daemon.files.names import shown
from ocrvl_daemon.storage.schema import apply_schema

SQLITE_FULL = 13  # "database or disk is full"
# Pages read per query when assembling a document.
PAGE_BATCH = 256


class Store:
    """Jobs and page checkpoints in `state_dir/<name>`; private to the user (0700/0600)."""

    def __init__(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(path.parent, 0o700)
            fresh = not path.exists()
            # No lock: one thread at a time uses a Store (the main loop; at shutdown the
            # thread that stops gracefully, while the main thread only waits for it).
            self._db = sqlite3.connect(
                path, timeout=30.0, isolation_level=None, check_same_thread=False
            )
        except (OSError, sqlite3.Error) as exc:
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError(
                f"state_dir = {path.parent} cannot be used: {detail}.",
                "set state_dir in the config file to a folder this user can create and "
                "write (the default is ~/.local/state/ocrvl)",
            ) from exc
        self.path = path
        if fresh:
            os.chmod(path, 0o600)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA busy_timeout=30000")
        apply_schema(self._db, self._tx)

    def close(self) -> None:
        """Close the connection."""
        self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:  # SQLite may have rolled it back already
                    self._db.execute("ROLLBACK")
                raise
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", None) == SQLITE_FULL or "is full" in str(exc):
                raise StateFullError(
                    f"The disk holding the state folder {self.path.parent} is full ({exc}): "
                    "no page can be checkpointed.",
                    f"free some space on that disk (`df -h {self.path.parent}`), or move "
                    "state_dir to a larger one",
                ) from exc
            raise

    # --- jobs ---------------------------------------------------------------------------

    def job(self, job_id: int) -> Job | None:
        """One job by id."""
        row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _job(row) if row else None

    def job_for_path(self, path: Path) -> Job | None:
        """The job of the document at `path`, if any."""
        row = self._db.execute("SELECT * FROM jobs WHERE path = ?", (os.fsencode(path),)).fetchone()
        return _job(row) if row else None

    def jobs(self, *states: JobState) -> list[Job]:
        """Jobs in any of `states` (all when none given), oldest first."""
        if states:
            marks = ",".join("?" * len(states))
            rows = self._db.execute(
                f"SELECT * FROM jobs WHERE state IN ({marks}) ORDER BY id",
                [s.value for s in states],
            )
        else:
            rows = self._db.execute("SELECT * FROM jobs ORDER BY id")
        return [_job(r) for r in rows]

    def count_by_state(self) -> dict[JobState, int]:
        """How many jobs are in each state (every state present, maybe 0)."""
        counts = dict.fromkeys(JobState, 0)
        for state, n in self._db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state"):
            counts[JobState(state)] = n
        return counts

    def enqueue(self, path: Path, sha256: str, size: int, mtime: float, model: str) -> Job:
        """Queue the document at `path` unless this exact content is already queued or handled.

        A changed file (new hash) or another model starts over; the same content stays as it is
        (done stays done, a permanent failure waits for `ocrvl retry`), except a document whose
        file was deleted while it converted (GONE): its file is back, so it is queued again.
        """
        now = time.time()
        with self._tx() as db:
            row = db.execute("SELECT * FROM jobs WHERE path = ?", (os.fsencode(path),)).fetchone()
            if row is None:
                db.execute(
                    "INSERT INTO jobs (path, sha256, size, mtime, model, state, created, updated)"
                    " VALUES (?, ?, ?, ?, ?, 'queued', ?, ?)",
                    (os.fsencode(path), sha256, size, mtime, model, now, now),
                )
            elif (row["sha256"] != sha256 or row["model"] != model
                  or row["state"] == JobState.GONE.value):
                db.execute(
                    "UPDATE jobs SET sha256=?, size=?, mtime=?, model=?, state='queued', "
                    "attempts=0, last_error=NULL, page_count=NULL, updated=?, started=NULL, "
                    "finished=NULL, not_before=0 WHERE id=?",
                    (sha256, size, mtime, model, now, row["id"]),
                )
            else:
                db.execute("UPDATE jobs SET size=?, mtime=? WHERE id=?", (size, mtime, row["id"]))
            row = db.execute("SELECT * FROM jobs WHERE path = ?", (os.fsencode(path),)).fetchone()
        return _job(row)

    def requeue(self, job_id: int) -> None:
        """Put a job back in the queue with its attempts reset (used by `ocrvl retry`)."""
        with self._tx() as db:
            db.execute(
                "UPDATE jobs SET state='queued', last_error=NULL, not_before=0, "
                "finished=NULL, updated=?, attempts=0 WHERE id=?",
                (time.time(), job_id),
            )

    def set_changed(self, job_id: int, wait: float) -> None:
        """The job's file changed while it was converted: it is queued again in `wait`
        seconds, with its identity forgotten, so that its new content is hashed before any
        page of it counts (the old version's checkpoints stay under the old hash)."""
        now = time.time()
        with self._tx() as db:
            db.execute(
                "UPDATE jobs SET state='queued', sha256='', attempts=0, last_error=NULL, "
                "page_count=NULL, finished=NULL, updated=?, not_before=? WHERE id=?",
                (now, now + wait, job_id),
            )

    def set_gone(self, job_id: int, reason: str) -> None:
        """The job's file was deleted while it was converted: nothing is written; `reason`
        says so in status until the file is back (`enqueue` queues it again)."""
        with self._tx() as db:
            db.execute("UPDATE jobs SET state='gone', last_error=?, updated=? WHERE id=?",
                       (shown(reason), time.time(), job_id))

    def set_running(self, job_id: int, page_count: int) -> None:
        """Mark a job as being converted."""
        now = time.time()
        with self._tx() as db:
            db.execute(
                "UPDATE jobs SET state='running', page_count=?, "
                "started=COALESCE(started, ?), updated=? WHERE id=?",
                (page_count, now, now, job_id),
            )

    def set_done(self, job_id: int, redo_tokens: int = 0, sha256: str | None = None) -> bool:
        """Mark a job as converted; `redo_tokens` it took redoing cut-off pages. With `sha256`,
        only while the job is still that version of its file (False: another version was
        queued meanwhile, and it stays queued)."""
        now = time.time()
        version = "" if sha256 is None else " AND sha256=?"
        with self._tx() as db:
            return db.execute(
                "UPDATE jobs SET state='done', last_error=NULL, finished=?, updated=?, "
                f"redo_tokens=? WHERE id=?{version}",
                (now, now, redo_tokens, job_id, *(() if sha256 is None else (sha256,))),
            ).rowcount > 0

    def set_failed(
        self, job_id: int, error: str, *, permanent: bool, retry_in: float = 0.0
    ) -> None:
        """Record a failure: permanent ones wait for the user, others retry after `retry_in`."""
        now = time.time()
        with self._tx() as db:
            db.execute(
                "UPDATE jobs SET state=?, attempts=attempts+1, last_error=?, updated=?, "
                "not_before=? WHERE id=?",
                ("failed" if permanent else "queued", shown(error), now, now + retry_in, job_id),
            )

    def set_hook_error(self, job_id: int, error: str | None) -> None:
        """Record how the last hook run for a job ended (None: it succeeded)."""
        with self._tx() as db:
            db.execute("UPDATE jobs SET hook_error=? WHERE id=?", (error, job_id))

    def forget(self, job_id: int) -> None:
        """Drop a job whose file is gone (its page checkpoints stay for a renamed copy)."""
        with self._tx() as db:
            db.execute("DELETE FROM jobs WHERE id=?", (job_id,))

    def recover_running(self) -> int:
        """After a crash, jobs left `running` are queued again (their checkpoints remain)."""
        with self._tx() as db:
            return db.execute("UPDATE jobs SET state='queued' WHERE state='running'").rowcount

    # --- pages --------------------------------------------------------------------------

    def save_page(
        self,
        sha256: str,
        model: str,
        page: int,
        markdown: str,
        images: dict[str, bytes],
        *,
        note: str | None = None,
        failure: PageFailure = PageFailure.NONE,
        quality: dict[str, Any] | None = None,
        layout: dict[str, Any] | None = None,
    ) -> None:
        """Checkpoint one page durably (Markdown and images in one transaction)."""
        now = time.time()
        with self._tx() as db:
            db.execute(
                "DELETE FROM page_images WHERE sha256=? AND model=? AND page=?",
                (sha256, model, page),
            )
            db.execute(
                "INSERT OR REPLACE INTO pages (sha256, model, page, markdown, note, failed, "
                "created, quality, layout) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (sha256, model, page, markdown, note and shown(note), int(failure), now,
                 _json_or_null(quality), _json_or_null(layout)),
            )
            db.executemany(
                "INSERT INTO page_images VALUES (?, ?, ?, ?, ?)",
                [(sha256, model, page, n, d) for n, d in images.items()],
            )

    def done_pages(self, sha256: str, model: str) -> set[int]:
        """Pages of this content that are checkpointed."""
        rows = self._db.execute(
            "SELECT page FROM pages WHERE sha256=? AND model=?", (sha256, model)
        )
        return {r[0] for r in rows}

    def failed_pages(
        self, sha256: str, model: str, failure: PageFailure = PageFailure.RETRYABLE
    ) -> list[int]:
        """Pages that ended as placeholders for this reason."""
        rows = self._db.execute(
            "SELECT page FROM pages WHERE sha256=? AND model=? AND failed=? ORDER BY page",
            (sha256, model, int(failure)),
        )
        return [r[0] for r in rows]

    def pages_with_verdict(self, sha256: str, model: str, verdict: str) -> list[int]:
        """Pages whose quality record has this verdict (ok, suspect, bad)."""
        rows = self._db.execute(
            "SELECT page FROM pages WHERE sha256=? AND model=? AND failed=0 "
            "AND json_extract(quality, '$.verdict')=? ORDER BY page",
            (sha256, model, verdict),
        )
        return [r[0] for r in rows]

    def verdict_counts(self, sha256: str, model: str) -> dict[str, int]:
        """How many checkpointed pages have each verdict (ok, suspect, bad; every one, maybe 0)."""
        counts = dict.fromkeys(("ok", "suspect", "bad"), 0)
        for verdict, n in self._db.execute(
            "SELECT json_extract(quality, '$.verdict'), COUNT(*) FROM pages "
            "WHERE sha256=? AND model=? AND failed=0 AND quality IS NOT NULL GROUP BY 1",
            (sha256, model),
        ):
            counts[verdict] = n
        return counts

    def flagged_pages(self, sha256: str, model: str) -> list[int]:
        """Pages kept with a warning (cut off, looping, empty, garbage)."""
        rows = self._db.execute(
            "SELECT page FROM pages WHERE sha256=? AND model=? AND failed=0 "
            "AND note IS NOT NULL ORDER BY page",
            (sha256, model),
        )
        return [r[0] for r in rows]

    def count_pages(self, sha256: str, model: str) -> int:
        """How many pages of this content are checkpointed."""
        row = self._db.execute(
            "SELECT COUNT(*) FROM pages WHERE sha256=? AND model=?", (sha256, model)
        ).fetchone()
        return int(row[0])

    def pages_size(self, sha256: str, model: str) -> int:
        """Bytes of checkpointed Markdown and images: about what the output will take."""
        text = self._db.execute(
            "SELECT COALESCE(SUM(LENGTH(CAST(markdown AS BLOB))), 0) FROM pages "
            "WHERE sha256=? AND model=?",
            (sha256, model),
        ).fetchone()[0]
        images = self._db.execute(
            "SELECT COALESCE(SUM(LENGTH(data)), 0) FROM page_images WHERE sha256=? AND model=?",
            (sha256, model),
        ).fetchone()[0]
        return int(text) + int(images)

    def drop_pages(self, sha256: str, model: str, pages: list[int] | None = None) -> None:
        """Forget checkpoints (all, or the given pages) so they are recognised again."""
        with self._tx() as db:
            for table in ("pages", "page_images"):
                if pages is None:
                    db.execute(f"DELETE FROM {table} WHERE sha256=? AND model=?", (sha256, model))
                else:
                    db.executemany(
                        f"DELETE FROM {table} WHERE sha256=? AND model=? AND page=?",
                        [(sha256, model, p) for p in pages],
                    )

    def iter_pages(self, sha256: str, model: str, *, images: bool = True
                   ) -> Iterator[StoredPage]:
        """Checkpointed pages in order, a batch at a time (a 10,000-page book stays small);
        without their images unless `images`."""
        last = -1
        while True:
            rows = self._db.execute(
                "SELECT page, markdown, note, failed, quality, layout FROM pages "
                "WHERE sha256=? AND model=? AND page>? ORDER BY page LIMIT ?",
                (sha256, model, last, PAGE_BATCH),
            ).fetchall()
            if not rows:
                return
            for row in rows:
                kept = {
                    r[0]: r[1]
                    for r in self._db.execute(
                        "SELECT name, data FROM page_images WHERE sha256=? AND model=? AND page=?",
                        (sha256, model, row["page"]),
                    )
                } if images else {}
                yield StoredPage(
                    row["page"], row["markdown"], row["note"], bool(row["failed"]), kept,
                    _json_or_none(row["quality"]), _json_or_none(row["layout"]),
                )
            last = rows[-1]["page"]


def _json_or_null(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


def _json_or_none(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _job(row: sqlite3.Row) -> Job:
    return Job(
        id=row["id"],
        path=Path(os.fsdecode(row["path"])),
        sha256=row["sha256"],
        size=row["size"],
        mtime=row["mtime"],
        model=row["model"],
        state=JobState(row["state"]),
        attempts=row["attempts"],
        last_error=row["last_error"],
        page_count=row["page_count"],
        created=row["created"],
        updated=row["updated"],
        started=row["started"],
        finished=row["finished"],
        not_before=row["not_before"],
        redo_tokens=row["redo_tokens"],
        hook_error=row["hook_error"],
    )

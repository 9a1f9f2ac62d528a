"""The store's SQLite schema, and bringing a database of an earlier version up to it.

Upgrades happen in place when the store opens and only ever add: a column (empty or with a
default), or paths kept as text turned into bytes.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY,
    path BLOB NOT NULL UNIQUE,  -- os.fsencode(path): names need not be UTF-8
    sha256 TEXT NOT NULL,
    size INTEGER NOT NULL,
    mtime REAL NOT NULL,
    model TEXT NOT NULL,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    page_count INTEGER,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    started REAL,
    finished REAL,
    not_before REAL NOT NULL DEFAULT 0,
    redo_tokens INTEGER NOT NULL DEFAULT 0,
    hook_error TEXT
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
CREATE TABLE IF NOT EXISTS pages (
    sha256 TEXT NOT NULL,
    model TEXT NOT NULL,
    page INTEGER NOT NULL,
    markdown TEXT NOT NULL,
    note TEXT,
    failed INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    quality TEXT,  -- JSON: page_quality.PageQuality.to_json()
    layout TEXT,  -- JSON: {"size": [w, h], "blocks": [{label, bbox, text}]}
    PRIMARY KEY (sha256, model, page)
);
CREATE TABLE IF NOT EXISTS page_images (
    sha256 TEXT NOT NULL,
    model TEXT NOT NULL,
    page INTEGER NOT NULL,
    name TEXT NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (sha256, model, page, name)
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def apply_schema(
    db: sqlite3.Connection, transaction: Callable[[], AbstractContextManager[sqlite3.Connection]]
) -> None:
    """Create the tables, or add what a database of an earlier version lacks."""
    db.executescript(SCHEMA)
    _paths_as_bytes(db, transaction)
    _add_redo_tokens(db)
    _add_page_quality(db)
    columns = {r["name"] for r in db.execute("PRAGMA table_info(jobs)")}
    if "hook_error" not in columns:  # a store from before hooks existed
        db.execute("ALTER TABLE jobs ADD COLUMN hook_error TEXT")
    db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))


def _paths_as_bytes(
    db: sqlite3.Connection, transaction: Callable[[], AbstractContextManager[sqlite3.Connection]]
) -> None:
    """Databases of earlier versions kept paths as text: turn them into bytes, in place."""
    if db.execute("SELECT 1 FROM jobs WHERE typeof(path)='text' LIMIT 1").fetchone():
        with transaction() as tx:
            tx.execute("UPDATE OR REPLACE jobs SET path=CAST(path AS BLOB) "
                       "WHERE typeof(path)='text'")


def _add_redo_tokens(db: sqlite3.Connection) -> None:
    """Databases of earlier versions did not count the tokens of redone cut-off pages."""
    columns = {row["name"] for row in db.execute("PRAGMA table_info(jobs)")}
    if "redo_tokens" not in columns:
        db.execute("ALTER TABLE jobs ADD COLUMN redo_tokens INTEGER NOT NULL DEFAULT 0")


def _add_page_quality(db: sqlite3.Connection) -> None:
    """Databases of earlier versions kept no quality record or layout per page."""
    columns = {row["name"] for row in db.execute("PRAGMA table_info(pages)")}
    for column in ("quality", "layout"):
        if column not in columns:
            db.execute(f"ALTER TABLE pages ADD COLUMN {column} TEXT")

"""One running daemon against the whole bad-input corpus: it must survive every file.

Each bad file ends with a reason in `ocrvl status` and an error note beside it; each odd but
valid one converts completely; files deleted or replaced mid-conversion leave nothing wrong
behind; and afterwards (even with the inbox removed and re-created) a good file converts.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sqlite3
from pathlib import Path

import pytest

from ocrvl_daemon.output.document_files import outputs_for, read_header
from testkit.documents import (
    BadInput,
    make_bad_input_corpus,
    make_many_tiny_pages_pdf,
    make_pdf,
)
from testkit.harness import wait_until
from testkit.inbox_daemon import Setup, wait_for_markdown

pytestmark = pytest.mark.slow


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def pages_done(setup: Setup, digest: str) -> int:
    """Checkpointed pages of this content, read straight from the daemon's database."""
    with sqlite3.connect(setup.root / "state" / "jobs.sqlite", timeout=10) as db:
        return int(db.execute("SELECT COUNT(*) FROM pages WHERE sha256=?", (digest,)).fetchone()[0])


def page_count(md: Path) -> int:
    """Pages marked in `md` (a page that continues a paragraph is marked inside it)."""
    return len(re.findall(r"<!-- page \d+ -->", md.read_text("utf-8")))


def settled(setup: Setup, corpus: list[BadInput]) -> dict[str, dict] | None:
    """Status by path once every corpus file is done or failed, else None."""
    docs = {d["path"]: d for d in setup.status()["documents"]}
    states = [docs.get(str(item.path), {}).get("state") for item in corpus]
    return docs if all(s in ("done", "failed") for s in states) else None


def start_then(setup: Setup, pdf: Path, action) -> None:  # type: ignore[no-untyped-def]
    """Wait until `pdf` is being converted (pages checkpointed), then do `action` to it."""
    digest = sha256(pdf)
    wait_until(lambda: pages_done(setup, digest) >= 5, 120, what=f"{pdf.name} to be under way")
    action()


def test_the_daemon_survives_the_whole_corpus_and_still_converts(tmp_path: Path):
    setup = Setup(tmp_path)
    corpus = make_bad_input_corpus(setup.root / "corpus")
    occupied = make_pdf(setup.root / "corpus" / "occupied.pdf", 1, seed=18)
    (setup.root / "corpus" / "occupied.md").mkdir()  # the output name is taken by a folder
    corpus.append(BadInput(occupied, "was not written by ocrvl"))
    if os.geteuid() != 0:  # root reads anything; tests/test_failure_policy.py covers EACCES
        unreadable = make_pdf(setup.root / "corpus" / "unreadable.pdf", 1, seed=19)
        unreadable.chmod(0)
        corpus.append(BadInput(unreadable, "permission denied"))
    outside = make_pdf(tmp_path / "outside" / "elsewhere.pdf", 1, seed=20)

    with setup.daemon() as daemon:
        daemon.wait_ready()
        shutil.copytree(setup.root / "corpus", setup.inbox, dirs_exist_ok=True, symlinks=True)
        corpus = [BadInput(setup.inbox / c.path.name, c.reason) for c in corpus]
        (setup.inbox / "link.pdf").symlink_to(outside)

        doomed = make_many_tiny_pages_pdf(setup.root / "doomed.pdf", 300)
        shutil.copyfile(doomed, setup.inbox / "doomed.pdf")
        start_then(setup, doomed, (setup.inbox / "doomed.pdf").unlink)
        swapped = make_many_tiny_pages_pdf(setup.root / "swapped.pdf", 301)
        shutil.copyfile(swapped, setup.inbox / "swapped.pdf")
        replacement = make_pdf(setup.root / "replacement.pdf", 2, seed=21)
        start_then(setup, swapped,
                   lambda: os.replace(shutil.copyfile(replacement, setup.root / "r.tmp"),
                                      setup.inbox / "swapped.pdf"))

        docs = wait_until(lambda: settled(setup, corpus), 240, interval=1.0,
                          what="every corpus file to be converted or failed")
        for item in corpus:
            doc, (md, _, note) = docs[str(item.path)], outputs_for(item.path)
            if item.reason is None:
                assert doc["state"] == "done", (item.path.name, doc)
                assert page_count(md) == doc["pages_total"] and not note.exists()
            else:
                assert doc["state"] == "failed" and item.reason in doc["error"], doc
                assert item.reason in note.read_text("utf-8"), item.path.name
                assert not md.is_file() or md.name == "occupied.md"
        assert page_count(setup.inbox / "stamps.md") == 2000

        # Deleted mid-way: forgotten, nothing written. Replaced mid-way: the new content only.
        wait_for_markdown(setup.inbox / "swapped.pdf", timeout=120)
        swapped_md = setup.inbox / "swapped.md"
        assert read_header(swapped_md)["sha256"] == sha256(replacement)  # type: ignore[index]
        assert page_count(swapped_md) == 2
        documents = {d["path"]: d for d in setup.status()["documents"]}
        paths = set(documents)
        # Deleted while it converted: shown as gone, with why, and nothing written.
        assert documents[str(setup.inbox / "doomed.pdf")]["state"] == "gone"
        assert not (setup.inbox / "doomed.md").exists()
        # A link leading out of the inbox is not ours to read.
        assert str(setup.inbox / "link.pdf") not in paths
        assert not (setup.inbox / "link.md").exists() and not outside.with_suffix(".md").exists()
        assert "outside every inbox" in daemon.log()

        shutil.rmtree(setup.inbox)
        setup.inbox.mkdir()
        good = make_pdf(setup.inbox / "good.pdf", 2, seed=22)
        wait_for_markdown(good, timeout=120)
        assert daemon.proc is not None and daemon.proc.poll() is None
        assert "Traceback" not in daemon.log()
    assert daemon.proc.returncode == 0, daemon.log()[-3000:]

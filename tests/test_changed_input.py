"""A PDF replaced or deleted while the daemon converts it: what is written and recorded always
belongs to the bytes it came from, and a deleted book stops costing the server.

Every test runs the real daemon (`ocrvl run`), which starts the fake vLLM server itself, and
the real PaddleOCR-VL pipeline (layout detection off).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import httpx
import pytest

from ocrvl_daemon.output.document_files import read_header
from testkit.documents import make_pdf
from testkit.harness import wait_until
from testkit.inbox_daemon import Setup, wait_for_markdown

pytestmark = pytest.mark.slow


def received(setup: Setup) -> int:
    """Chat requests the fake server has received so far."""
    stats = httpx.get(f"http://127.0.0.1:{setup.port}/fake/stats", timeout=10).json()
    return int(stats["requests_received"])


def document(setup: Setup, pdf: Path) -> dict:
    """`ocrvl status --json`'s record of `pdf`."""
    return next(d for d in setup.status()["documents"] if d["path"] == str(pdf))


def header_sha(md: Path) -> str | None:
    """The source's SHA-256 that ocrvl's header in `md` names."""
    return (read_header(md) or {}).get("sha256")


@pytest.mark.parametrize("how", ["cp", "mv"])
def test_a_pdf_replaced_while_it_converts_is_converted_again_from_its_new_content(
        tmp_path: Path, how: str):
    # Long answers: the old book's 60 pages are all at the server (rendered from the old
    # bytes) when the rescan replaces it, as in a user's trial where the old one then won.
    setup = Setup(tmp_path, "--step-t0-ms", "25", "--output-tokens", "fixed:400",
                  max_concurrency=64)
    book = setup.inbox / "book.pdf"
    old = make_pdf(tmp_path / "src" / "old.pdf", 60, seed=31)
    rescan = make_pdf(tmp_path / "src" / "rescan.pdf", 30, seed=32)
    new_sha = hashlib.sha256(rescan.read_bytes()).hexdigest()
    with setup.daemon() as daemon:
        daemon.wait_ready()
        shutil.copyfile(old, book)
        wait_until(lambda: received(setup) >= 60, 120,
                   what="every page of the old book at the server")
        if how == "cp":
            shutil.copyfile(rescan, book)  # the same file, rewritten in place
        else:
            os.replace(rescan, book)  # another file (inode) under the same name
        wait_until(lambda: book.with_suffix(".md").exists()
                   and header_sha(book.with_suffix(".md")) == new_sha, 120,
                   what="book.md made from the rescan")
        md = book.with_suffix(".md").read_text("utf-8")
        assert md.count("<!-- page ") == 30, (
            f"book.md has {md.count('<!-- page ')} pages; the rescan has 30")
        wait_until(lambda: document(setup, book)["state"] == "done", 30, what="book done")
        record = document(setup, book)
        assert (record["pages_done"], record["pages_total"]) == (30, 30), (
            f"status records the old version: {record}")
        assert "changed while it was being converted" in daemon.log()
    # A restart finds the rescan converted, and the old version's pages are nowhere in it.
    with setup.daemon() as daemon:
        daemon.wait_ready()
        wait_until(lambda: "1 document(s) in the inbox already converted" in daemon.log(), 60,
                   what="the restarted daemon to look at the inbox")
        assert header_sha(book.with_suffix(".md")) == new_sha


def test_a_pdf_deleted_while_it_converts_stops_costing_the_server_and_writes_nothing(
        tmp_path: Path):
    setup = Setup(tmp_path, "--step-t0-ms", "25", "--output-tokens", "fixed:100",
                  max_concurrency=4)
    book = setup.inbox / "book.pdf"
    source = make_pdf(tmp_path / "src" / "book.pdf", 60, seed=33)
    with setup.daemon() as daemon:
        daemon.wait_ready()
        shutil.copyfile(source, book)
        wait_until(lambda: setup.checkpointed_pages() >= 4, 90, what="four pages checkpointed")
        book.unlink()
        wait_until(lambda: document(setup, book)["state"] == "gone", 30,
                   what="status to say the book is gone")
        record = document(setup, book)
        assert "deleted while it was being converted" in (record["error"] or ""), record
        assert "was deleted while it was being converted" in daemon.log()
        sent_at_delete = received(setup)
        # What was in flight then may still come back; nothing more is sent for the book.
        assert sent_at_delete < 30, f"{sent_at_delete} of the deleted book's 60 pages were sent"
        assert not book.with_suffix(".md").exists(), "Markdown was written for a deleted PDF"
        assert not book.with_suffix(".json").exists()
        assert not (setup.inbox / "book.ocrvl-error.txt").exists(), (
            "an error note was left beside a PDF the user deleted")
        # Put back, it is converted, keeping the pages done before it was deleted.
        done_before = setup.checkpointed_pages()
        shutil.copyfile(source, book)
        wait_for_markdown(book)
        assert book.with_suffix(".md").read_text("utf-8").count("<!-- page ") == 60
        assert received(setup) <= sent_at_delete + 60 - done_before + 8, (
            "pages done before the PDF was deleted were sent again once it was back")

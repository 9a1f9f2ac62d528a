"""`<stem>.ocr.pdf`: the original pages, unchanged, with an invisible text layer of each page's
words on that page; the original never touched; never taken in from an inbox.

Read back with pypdf (a reader ocrvl does not use to write it) and pikepdf (the page's own
streams compared byte for byte).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pikepdf
import pypdf
import pytest

from ocrvl_daemon.config import InboxConfig
from ocrvl_daemon.errors import NotOursError
from ocrvl_daemon.inbox.scan import wanted_name
from ocrvl_daemon.output import Page, searchable_for, write_document
from testkit.documents import LAYOUT_PAGE, make_text_pdf

PAGES = [["Alpha bravo charlie delta echo.", "Foxtrot golf hotel india"],
         ["Juliet kilo lima mike november.", "Oscar papa quebec"]]


def recognised(pages: list[list[str]]) -> list[Page]:
    """The pages as the pipeline recorded them with layout detection off: one block each."""
    return [Page(i, "\n\n".join(p), layout={"size": list(LAYOUT_PAGE), "blocks": [
        {"label": "ocr", "bbox": [0, 0, *LAYOUT_PAGE], "text": "\n".join(p)}]})
        for i, p in enumerate(pages)]


def _streams(contents: pikepdf.Object) -> list[pikepdf.Object]:
    """A page's content streams (one, or an array of them)."""
    return list(contents) if isinstance(contents, pikepdf.Array) else [contents]


def page_words(path: Path) -> list[list[str]]:
    return [page.extract_text().split() for page in pypdf.PdfReader(path).pages]


@pytest.fixture
def book(tmp_path: Path) -> Path:
    return make_text_pdf(tmp_path / "book.pdf", PAGES)


@pytest.mark.quick
def test_each_pages_words_are_searchable_on_that_page(book: Path) -> None:
    original = hashlib.sha256(book.read_bytes()).hexdigest()
    write_document(book, "sha", "model", 2, recognised(PAGES), searchable=True)
    assert hashlib.sha256(book.read_bytes()).hexdigest() == original, "the original PDF changed"
    assert page_words(searchable_for(book)) == [" ".join(p).split() for p in PAGES], (
        "a page's words are missing from its text layer, or on another page")


@pytest.mark.quick
def test_the_original_pages_are_kept_as_they_were(book: Path) -> None:
    write_document(book, "sha", "model", 2, recognised(PAGES), searchable=True)
    with pikepdf.open(book) as before, pikepdf.open(searchable_for(book)) as after:
        assert len(after.pages) == len(before.pages)
        for old, new in zip(before.pages, after.pages, strict=True):
            assert list(new.mediabox) == list(old.mediabox)
            drawing = b"".join(s.read_bytes() for s in _streams(new.obj.Contents))
            assert b"".join(s.read_bytes() for s in _streams(old.obj.Contents)) in drawing, (
                "the page's drawing changed")
            (name, image), = old.get_images().items()
            assert new.get_images()[name].read_raw_bytes() == image.read_raw_bytes(), (
                "the scanned image was re-encoded")


@pytest.mark.quick
def test_a_searchable_pdf_ocrvl_did_not_write_is_left_alone(book: Path) -> None:
    foreign = searchable_for(book)
    foreign.write_bytes(book.read_bytes())  # someone's own book.ocr.pdf
    with pytest.raises(NotOursError, match="not written by ocrvl"):
        write_document(book, "sha", "model", 2, recognised(PAGES), searchable=True)
    assert foreign.read_bytes() == book.read_bytes()
    foreign.unlink()
    write_document(book, "sha", "model", 2, recognised(PAGES), searchable=True)
    write_document(book, "sha", "model", 2, recognised(PAGES[::-1]), searchable=True)
    assert page_words(foreign)[0] == " ".join(PAGES[1]).split(), "ocrvl's own was not replaced"


@pytest.mark.quick
def test_an_inbox_never_takes_a_searchable_pdf_in() -> None:
    assert wanted_name("book.pdf", InboxConfig())
    assert not wanted_name("book.ocr.pdf", InboxConfig()), (
        "ocrvl's own searchable PDF would be converted again, forever")

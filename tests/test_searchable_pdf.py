"""`<stem>.ocr.pdf`: the original pages, unchanged, with an invisible text layer of each page's
words on that page; the original never touched; never taken in from an inbox.

Read back with pypdf (a reader ocrvl does not use to write it) and pikepdf (the page's own
streams compared byte for byte).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pikepdf
import pypdf
import pytest
import yaml

from ocrvl_daemon.config.model import InboxConfig
from ocrvl_daemon.errors import NotOursError
from ocrvl_daemon.inbox.scan import wanted_name
from ocrvl_daemon.output.document_files import Page, searchable_for, write_document
from testkit.documents import LAYOUT_PAGE, make_text_pdf
from testkit.inbox_daemon import Setup, wait_for_markdown

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


@pytest.mark.quick
@pytest.mark.parametrize("turn", [90, 180, 270])
def test_on_a_turned_page_the_words_lie_where_the_page_shows_them(tmp_path: Path,
                                                                   turn: int) -> None:
    """A page with /Rotate is rendered (and its blocks found) as shown: a block in the shown
    page's top-left quarter gets its words there, reading left to right."""
    import ctypes

    import pypdfium2
    import pypdfium2.raw as pdfium

    book = make_text_pdf(tmp_path / "book.pdf", [PAGES[0]])
    with pikepdf.open(book, allow_overwriting_input=True) as pdf:
        pdf.pages[0].obj.Rotate = turn
        pdf.save(book)
    width, height = pypdfium2.PdfDocument(book)[0].render(scale=2).to_pil().size
    page = Page(0, "", layout={"size": [width, height], "blocks": [
        {"label": "text", "bbox": [0, 0, width // 2, height // 2], "text": PAGES[0][0]}]})
    write_document(book, "sha", "model", 1, [page], searchable=True)
    shown = pypdfium2.PdfDocument(searchable_for(book))[0]
    text = shown.get_textpage()
    assert text.get_text_range().split() == PAGES[0][0].split()
    centres = []
    for i in range(text.count_chars()):
        left, bottom, right, top = text.get_charbox(i)
        x, y = ctypes.c_int(), ctypes.c_int()
        pdfium.FPDF_PageToDevice(shown.raw, 0, 0, width, height, 0, (left + right) / 2,
                                 (bottom + top) / 2, ctypes.byref(x), ctypes.byref(y))
        centres.append((x.value, y.value))
    assert all(x <= width / 2 and y <= height / 2 for x, y in centres), (
        f"the words are not in the shown page's top-left quarter: {centres[:5]}")
    assert centres[0][0] < centres[4][0], "the first word does not read left to right"


@pytest.mark.slow
def test_the_daemon_writes_it_into_the_inbox_and_never_takes_it_in(tmp_path: Path) -> None:
    setup = Setup(tmp_path, "--read-text")
    config = yaml.safe_load(setup.config.read_text("utf-8"))
    config["output"] = {"formats": ["markdown", "pdf"]}
    setup.config.write_text(yaml.safe_dump(config), "utf-8")
    book, later = (make_text_pdf(tmp_path / name, PAGES) for name in ("book.pdf", "later.pdf"))
    with setup.daemon() as daemon:
        daemon.wait_ready()
        shutil.move(book, setup.inbox / "book.pdf")
        wait_for_markdown(setup.inbox / "book.pdf")
        assert page_words(setup.inbox / "book.ocr.pdf") == [" ".join(p).split() for p in PAGES]
        # Dropped after the searchable PDF was written: by the time it is done, the watcher
        # has long seen book.ocr.pdf (and would have queued it first).
        shutil.move(later, setup.inbox / "later.pdf")
        wait_for_markdown(setup.inbox / "later.pdf")
        taken = sorted(Path(d["path"]).name for d in setup.status()["documents"])
    assert taken == ["book.pdf", "later.pdf"], f"ocrvl took its own output in: {taken}"
    assert not (setup.inbox / "book.ocr.md").exists()

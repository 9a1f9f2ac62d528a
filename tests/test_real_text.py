"""Real words end to end: `ocrvl convert` and the real PaddleOCR-VL pipeline (layout off)
against the stand-in server reading each page with a real OCR model (`--read-text`: PP-OCRv6
from the rapidocr wheel). What a reader gets back is checked word by word against the words
printed on the pages: nothing lost, nothing doubled, the reading order kept, and what a page
break cut made whole again.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pypdf
import pypdfium2
import pytest

from ocrvl_daemon.output.book import page_anchor
from testkit.documents import make_text_pdf
from testkit.harness import FakeServerProcess, chat_payload, free_port, start_fake_server
from testkit.runner import run_ocrvl, write_config

pytestmark = pytest.mark.slow

# Three pages: a paragraph runs from page 1 onto page 2 mid-sentence, a word is hyphenated
# at page 2's end and finished on page 3, and page 3 starts its own paragraph after that.
PAGES = [
    ["The first chapter opens on a quiet morning in the harbour town.",
     "Rain fell over the old roofs while the ferry crossed the grey water toward the"],
    ["northern pier where the fishermen were mending their nets before the market.",
     "Nobody in the town had ever seen such a strange docu-"],
    ["ment before that day, and the clerk kept it locked away.",
     "Years later the ferry stopped running, and the harbour town slowly forgot the strange "
     "paper that had once kept its clerk awake at night for many years."],
]
TEXT = ("The first chapter opens on a quiet morning in the harbour town. Rain fell over the old "
         "roofs while the ferry crossed the grey water toward the northern pier where the "
         "fishermen were mending their nets before the market. Nobody in the town had ever seen "
         "such a strange document before that day, and the clerk kept it locked away. Years "
         "later the ferry stopped running, and the harbour town slowly forgot the strange paper "
         "that had once kept its clerk awake at night for many years.")
TRUTH = TEXT.split()


def words(markdown: str) -> list[str]:
    """The words a reader sees: comments, anchors and rules left out."""
    return re.sub(r"<!--.*?-->|<[^>]+>|^---$", " ", markdown, flags=re.MULTILINE).split()


@pytest.fixture(scope="module")
def reading_server() -> Iterator[FakeServerProcess]:
    with start_fake_server(free_port(), "--read-text") as server:
        yield server


def convert(tmp_path: Path, server: FakeServerProcess, **output: object) -> tuple[str, dict]:
    pdf = make_text_pdf(tmp_path / "book.pdf", PAGES)
    config = write_config(tmp_path / "config.yaml",
                          output={"formats": ["markdown", "json", "pdf"], **output})
    result = run_ocrvl("convert", "--config", config, "--server-url", server.api_url, pdf)
    assert result.returncode == 0, result.stderr
    markdown = (tmp_path / "book.md").read_text("utf-8").split("\n", 1)[1]
    return markdown, json.loads((tmp_path / "book.json").read_text("utf-8"))


def test_the_stand_in_reads_the_words_on_the_image(tmp_path: Path,
                                                  reading_server: FakeServerProcess) -> None:
    make_text_pdf(tmp_path / "one.pdf", [PAGES[0]])
    page = pypdfium2.PdfDocument(tmp_path / "one.pdf")[0].render(scale=1).to_pil()
    jpeg = io.BytesIO()
    page.save(jpeg, format="JPEG", quality=90)
    answer = httpx.post(f"{reading_server.api_url}/chat/completions", timeout=60,
                        json=chat_payload(jpeg.getvalue(), "OCR:")).json()
    text = answer["choices"][0]["message"]["content"]
    assert text.split("\n") == PAGES[0], f"the stand-in did not read the page as printed:\n{text}"
    assert answer["usage"]["completion_tokens"] == len(text.split())


def test_a_book_reads_back_word_for_word_with_its_page_breaks_mended(
        tmp_path: Path, reading_server: FakeServerProcess) -> None:
    markdown, data = convert(tmp_path, reading_server)
    assert words(markdown) == TRUTH, (
        "the book's words were lost, doubled or misordered on the way:\n"
        f"got      {words(markdown)}\nexpected {TRUTH}")
    paragraphs = [p for p in markdown.split("\n\n") if words(p)]
    assert len(paragraphs) == 4, f"a paragraph cut by a page break is still two:\n{markdown}"
    assert f"toward the {page_anchor(2)}northern pier" in markdown
    assert f"strange document{page_anchor(3)} before that day" in markdown, (
        "the word hyphenated at page 2's end is not whole")
    assert [j["kind"] for j in data["joins"]] == ["paragraph", "hyphen"]
    assert [p["blocks"][0]["text"].split("\n") for p in data["pages"]] == PAGES, (
        "the JSON's blocks are not each page's words as recognised")
    searchable = pypdf.PdfReader(tmp_path / "book.ocr.pdf")
    assert [page.extract_text().split() for page in searchable.pages] == [
        " ".join(page).split() for page in PAGES], (
        "book.ocr.pdf does not have each page's words, in order, on that page")


def test_page_by_page_layout_keeps_every_word_where_it_was_printed(
        tmp_path: Path, reading_server: FakeServerProcess) -> None:
    markdown, data = convert(tmp_path, reading_server, page_breaks="rule", restructure=False)
    printed = [w for page in PAGES for paragraph in page for w in paragraph.split()]
    assert words(markdown) == printed
    assert markdown.count("\n---\n") == 2 and "docu-" in markdown and data["joins"] == []


def test_with_layout_detection_page_numbers_stay_out_and_the_text_still_joins(
        tmp_path: Path, reading_server: FakeServerProcess, layout_cache: Path) -> None:
    """Layout on (the stand-in layout model labels each page's foot line `number`): the
    numbers are read but kept out of the text, and the joins look past them."""
    pdf = make_text_pdf(tmp_path / "book.pdf", PAGES, numbered=True)
    config = write_config(tmp_path / "config.yaml", output={"formats": ["markdown", "json"]},
                          pipeline={"use_layout_detection": True, "layout_device": "cpu"})
    result = run_ocrvl("convert", "--config", config, "--server-url", reading_server.api_url,
                       pdf, PADDLE_PDX_CACHE_HOME=str(layout_cache))
    assert result.returncode == 0, result.stderr[-3000:]
    markdown = (tmp_path / "book.md").read_text("utf-8").split("\n", 1)[1]
    data = json.loads((tmp_path / "book.json").read_text("utf-8"))
    labels = [[(b["label"], b["text"]) for b in page["blocks"]] for page in data["pages"]]
    assert all(page[-1][0] == "number" for page in labels), labels
    assert words(markdown) == TRUTH, (
        f"page numbers in the text, or words lost or moved:\n{markdown}\n{labels}")
    assert f"toward the {page_anchor(2)}northern pier" in markdown, markdown
    assert f"strange document{page_anchor(3)} before that day" in markdown, markdown

"""A book, not a stack of pages: `book.restructure` and how `output.write_document` lays it out.

Each page's Markdown is what PaddleX itself writes from the page's blocks (its own
`restructure_pages` with nothing merged or relevelled), so the edits are tested on the text the
pipeline really produces; tables and headings are compared with PaddleX's own book-level result.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from ocrvl_daemon.output.book import BookPage, page_anchor, restructure
from ocrvl_daemon.output.document_files import Page, json_for, outputs_for, write_document

MODEL = "PaddleOCR-VL-1.6-0.9B"
IGNORED = ["number", "footnote", "header", "header_image", "footer", "footer_image", "aside_text"]
Block = tuple[str, list[int], str]


def _res(index: int, blocks: list[Block]) -> dict[str, Any]:
    return {"res": {
        "parsing_res_list": [{"block_label": label, "block_bbox": bbox, "block_content": text}
                             for label, bbox, text in blocks],
        "model_settings": {"use_layout_detection": True, "use_doc_preprocessor": False,
                           "markdown_ignore_labels": IGNORED},
        "input_path": None, "page_index": index, "width": 1000, "height": 1400}}


def paddlex_pages(pages: list[list[Block]], **book_level: bool) -> list[str]:
    """Each page's Markdown as PaddleX writes it (`restructure_pages`; by default neither
    tables merged nor headings relevelled: the pipeline's page by page)."""
    from paddlex.inference.pipelines.paddleocr_vl.pipeline import _PaddleOCRVLPipeline

    settings = {"merge_tables": False, "relevel_titles": False, **book_level}
    results = _PaddleOCRVLPipeline.restructure_pages(
        None, [_res(i, copy.deepcopy(blocks)) for i, blocks in enumerate(pages)], **settings)
    return [r.markdown["markdown_texts"] for r in results]


def book_pages(pages: list[list[Block]]) -> list[BookPage]:
    return [BookPage(i, md, [{"label": label, "bbox": bbox, "text": text}
                             for label, bbox, text in blocks])
            for i, (md, blocks) in enumerate(zip(paddlex_pages(pages), pages, strict=True))]


def whole_pages(*texts: str) -> list[BookPage]:
    """Pages read with layout detection off: each one block, answered whole."""
    return [BookPage(i, text, [{"label": "ocr", "bbox": [0, 0, 1000, 1400], "text": text}])
            for i, text in enumerate(texts)]


def written(tmp_path: Path, pages: list[BookPage], *, page_breaks: str = "anchor",
            join: bool = True) -> tuple[str, dict[str, Any]]:
    """The Markdown body (after its header) and JSON that `write_document` makes of `pages`."""
    pdf = tmp_path / "book.pdf"
    pdf.write_bytes(b"%PDF-1.4 stand-in\n")
    book = restructure(pages, join_paragraphs=join)
    write_document(pdf, "sha", MODEL, len(pages),
                   (Page(p.index, p.markdown, layout={"size": [1000, 1400], "blocks": p.blocks})
                    for p in pages),
                   json_output=True, page_breaks=page_breaks, book=book)  # type: ignore[arg-type]
    markdown = outputs_for(pdf)[0].read_text("utf-8").split("\n", 1)[1]
    data = json.loads(json_for(pdf).read_text("utf-8"))
    schema = json.loads((Path(__file__).parents[1] / "ocrvl_daemon/data/document.schema.json")
                        .read_text("utf-8"))
    jsonschema.validate(data, schema)
    return markdown, data


def words(markdown: str) -> list[str]:
    """The words a reader sees: comments, anchors and Markdown marks left out."""
    text = re.sub(r"<!--.*?-->|<[^>]+>|[#*|]", " ", markdown)
    return re.findall(r"[\w'-]+", text)


@pytest.mark.quick
def test_a_sentence_cut_by_a_page_break_reads_as_one_paragraph(tmp_path: Path) -> None:
    pages = whole_pages("First page opens.\n\nThe river ran on past the",
                        "old mill and into the town.\n\nA new paragraph.")
    markdown, data = written(tmp_path, pages)
    assert f"The river ran on past the {page_anchor(2)}old mill and into the town." in markdown, (
        f"the sentence that runs onto page 2 is still cut by the page break:\n{markdown}")
    assert "---" not in markdown, "a rule still splits the book"
    assert words(markdown) == words(pages[0].markdown + " " + pages[1].markdown), (
        "words were lost, doubled or moved by the join")
    assert data["joins"] == [{"kind": "paragraph", "from": {"page": 1, "block": 0},
                              "to": {"page": 2, "block": 0}}]
    assert [p["markdown"] for p in data["pages"]] == [p.markdown for p in pages], (
        "the JSON no longer keeps each page's own Markdown")


@pytest.mark.quick
def test_a_word_hyphenated_at_the_page_end_is_made_whole(tmp_path: Path) -> None:
    markdown, data = written(tmp_path, whole_pages("It is a docu-", "ment of the past. More."))
    assert f"It is a document{page_anchor(2)} of the past." in markdown, markdown
    assert "docu-" not in markdown and data["joins"][0]["kind"] == "hyphen"


@pytest.mark.quick
def test_a_paragraph_over_three_pages_is_one(tmp_path: Path) -> None:
    markdown, _ = written(tmp_path, whole_pages(
        "Start.\n\nOne long sentence goes", "on and on without any stop across this whole",
        "page and ends here.\n\nNext."))
    assert (f"One long sentence goes {page_anchor(2)}on and on without any stop across this "
            f"whole {page_anchor(3)}page and ends here.") in markdown, markdown


@pytest.mark.quick
@pytest.mark.parametrize(("end", "start"), [
    ("The chapter ends here.", "another one starts lower"),  # a finished sentence
    ("A paragraph without a stop", "# Chapter Two"),  # a heading starts the page
    ("A paragraph without a stop", "<table><tr><td>1</td></tr></table>"),
    ("A paragraph without a stop", "Capitalised New Paragraph starts"),
    ("A finished sentence.\n\n12", "the next page"),  # layout off: its page number, then
])
def test_what_a_page_break_really_ends_stays_apart(tmp_path: Path, end: str, start: str) -> None:
    markdown, data = written(tmp_path, whole_pages(end, start))
    assert data["joins"] == [] and "\n\n" + page_anchor(2) + "\n\n" in markdown, (
        f"pages joined where the first one's text was finished:\n{markdown}")


@pytest.mark.quick
def test_running_headers_footers_and_page_numbers_are_looked_past(tmp_path: Path) -> None:
    pages = book_pages([
        [("text", [100, 100, 900, 300], "The harvest came late that year and the"),
         ("footer", [100, 1300, 900, 1330], "Printed in Nowhere"),
         ("number", [480, 1340, 520, 1370], "17")],
        [("header", [100, 20, 900, 50], "A HISTORY OF FARMS"),
         ("text", [100, 100, 900, 300], "barns stood empty until spring."),
         ("number", [480, 1340, 520, 1370], "18")]])
    markdown, data = written(tmp_path, pages)
    assert f"the {page_anchor(2)}barns stood empty" in markdown, markdown
    for running in ("Printed in Nowhere", "A HISTORY OF FARMS", "17", "18"):
        assert running not in markdown, f"{running!r} (a running header/footer) is in the text"
    assert data["joins"][0]["from"] == {"page": 1, "block": 0}
    assert data["joins"][0]["to"] == {"page": 2, "block": 1}
    assert [b["label"] for b in data["pages"][1]["blocks"]] == ["header", "text", "number"]


TABLE_START = "<table><tr><td>Name</td><td>Qty</td></tr><tr><td>apple</td><td>1</td></tr></table>"
TABLE_MORE = "<table><tr><td>Name</td><td>Qty</td></tr><tr><td>pear</td><td>2</td></tr></table>"
BOOK = [
    [("paragraph_title", [100, 100, 500, 140], "1 Fruit"),
     ("text", [100, 200, 900, 300], "The stock at the end of the year."),
     ("table", [100, 400, 900, 1200], TABLE_START),
     ("number", [480, 1300, 520, 1330], "1")],
    [("header", [100, 20, 900, 50], "STOCK"),
     ("table", [100, 100, 900, 600], TABLE_MORE),
     ("paragraph_title", [100, 700, 500, 730], "1.1 Pears"),
     ("text", [100, 800, 900, 900], "Pears sold well.")],
]


@pytest.mark.quick
def test_a_table_continued_on_the_next_page_is_merged_as_paddleocr_does(tmp_path: Path) -> None:
    markdown, data = written(tmp_path, book_pages(BOOK))
    assert markdown.count("<table") == 1, f"the continued table is still two:\n{markdown}"
    assert re.findall(r">(apple|pear|Name)<", markdown) == ["Name", "apple", "pear"], (
        "rows lost, doubled or the repeated header kept")
    paddle = paddlex_pages(BOOK, merge_tables=True, relevel_titles=True)
    assert paddle[0].strip() in markdown, "the merged table is not PaddleOCR's own"
    assert {"kind": "table", "from": {"page": 1, "block": 2},
            "to": {"page": 2, "block": 1}} in data["joins"]
    assert markdown.index("## 1 Fruit") < markdown.index(page_anchor(2)) < markdown.index(
        "### 1.1 Pears"), "the page anchor moved"


@pytest.mark.quick
def test_heading_levels_are_assigned_across_the_book(tmp_path: Path) -> None:
    pages = [[("paragraph_title", [100, 100, 600, 160], "Chapter One"),
              ("text", [100, 200, 900, 300], "Words.")],
             [("paragraph_title", [100, 100, 400, 120], "A smaller heading"),
              ("text", [100, 200, 900, 300], "More words.")],
             [("paragraph_title", [100, 100, 600, 160], "Chapter Two"),
              ("text", [100, 200, 900, 300], "End.")]]
    markdown, data = written(tmp_path, book_pages(pages))
    paddle = paddlex_pages(pages, relevel_titles=True)
    for page in paddle:
        heading = page.split("\n", 1)[0]
        assert heading in markdown, f"{heading!r}: not PaddleOCR's level for it:\n{markdown}"
    assert "### A smaller heading" in markdown, "the smaller heading is not a level below"
    assert data["pages"][1]["blocks"][0]["level"] == 3


@pytest.mark.quick
def test_rule_without_restructuring_is_todays_layout(tmp_path: Path) -> None:
    pages = whole_pages("A sentence runs on", "across pages.")
    markdown, data = written(tmp_path, pages, page_breaks="rule", join=False)
    assert markdown == ("\n<!-- page 1 -->\n\nA sentence runs on\n"
                        "\n---\n\n<!-- page 2 -->\n\nacross pages.\n")
    assert data["joins"] == []


@pytest.mark.quick
def test_a_table_read_as_plain_text_is_never_merged_away(tmp_path: Path) -> None:
    pages = [[("table", [100, 400, 900, 1200], "Name Qty apple 1")],
             [("table", [100, 100, 900, 600], "Name Qty pear 2")]]
    markdown, data = written(tmp_path, book_pages(pages))
    assert "apple" in markdown and "pear" in markdown and data["joins"] == []


@pytest.mark.quick
def test_a_short_continuation_after_a_hyphen_is_joined(tmp_path: Path) -> None:
    markdown, _ = written(tmp_path, whole_pages("The clerk found the corresp-",
                                                "ondence with.\n\nOver the hills."))
    assert f"the correspondence{page_anchor(2)} with." in markdown, markdown


@pytest.mark.quick
@pytest.mark.parametrize("number", ["xii", "- 17 -", "IV.", "Page 12", "p. 3"])
def test_a_page_number_read_with_the_text_stays_apart(tmp_path: Path, number: str) -> None:
    """With layout detection off the printed page number ends the page's text (pdflatex's
    "1" under the last line): the sentence is joined across it, the number kept apart."""
    markdown, data = written(tmp_path, whole_pages(f"A sentence that runs on\n\n{number}",
                                                   "and on.\n\nThe next one."))
    assert [j["kind"] for j in data["joins"]] == ["paragraph"], markdown
    assert f"A sentence that runs on {page_anchor(2)}and on." in markdown, markdown
    paragraphs = [p.strip() for p in markdown.split("\n\n")]
    assert number in paragraphs, f"the page number {number!r} was glued into a paragraph"
    assert words(markdown)[-3:] == ["The", "next", "one"], "the page's text is out of order"


@pytest.mark.quick
def test_a_table_over_three_pages_is_one_with_every_row_once(tmp_path: Path) -> None:
    rows = ["apple", "pear", "plum"]
    pages = [[("table", [100, 100, 900, 1200],
               f"<table><tr><td>Name</td></tr><tr><td>{fruit}</td></tr></table>")]
             for fruit in rows]
    markdown, data = written(tmp_path, book_pages(pages))
    assert markdown.count("<table") == 1, markdown
    assert re.findall(r">(\w+)<", markdown) == ["Name", *rows], markdown
    assert [(j["from"]["page"], j["to"]["page"]) for j in data["joins"]] == [(1, 2), (2, 3)]
    assert markdown.index(page_anchor(2)) > markdown.index("plum"), "the page anchors moved"


@pytest.mark.quick
def test_a_paragraph_over_numbered_pages_is_one_and_keeps_every_number(tmp_path: Path) -> None:
    """pdflatex's pages with layout detection off: each page's text is one paragraph running
    on, its printed number under it. The paragraph is one across all three pages."""
    markdown, data = written(tmp_path, whole_pages(
        "It runs from the first page\n\n1", "over the whole second page\n\n2",
        "onto the third and ends.\n\n3"))
    assert [j["kind"] for j in data["joins"]] == ["paragraph", "paragraph"], markdown
    assert (f"It runs from the first page {page_anchor(2)}over the whole second page "
            f"{page_anchor(3)}onto the third and ends.") in markdown, markdown
    paragraphs = [p.strip() for p in markdown.split("\n\n")]
    assert all(n in paragraphs for n in "123"), "a page number was lost or glued into the text"

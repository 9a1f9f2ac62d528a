"""`<stem>.ocr.pdf` (`output.formats: [..., pdf]`): the original PDF with an invisible text
layer, so that page N's words are selectable and searchable on page N.

Each original page is kept exactly as it is (its content stream untouched, images not
re-encoded); the text layer is drawn on top as a form XObject. The text is each page's blocks
as recognised (not the book's joins: a word stays on the page it was printed on), placed at
the block's box. OCRmyPDF's own renderer draws it (fpdf2, its glyphless and Noto fonts for any
script, text render mode 3, each word scaled to its box), pikepdf lays it over the page. The
layout gives block boxes, not lines: a block's text is spread over as many lines as fit its
shape (`_lines`), so a search hit lands within the block.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEARCHABLE_SUFFIX = ".ocr.pdf"
# The document-information key that tells ocrvl's searchable PDF from one it did not write.
OURS_KEY = "/OcrvlSource"
# Blocks that carry no words of their own (their picture is already on the page).
_PICTURES = frozenset({"image", "chart", "seal", "header_image", "footer_image"})
_TAG = re.compile(r"<[^>]+>")
# A line of text is about this many characters per line height wide (a Latin body face).
_CHARS_PER_HEIGHT = 2.0


@dataclass(frozen=True)
class PageText:
    """One page's recognised blocks: the image size their boxes are in, and the blocks."""

    index: int
    size: tuple[int, int] | None
    blocks: list[dict[str, Any]]


def is_ours(path: Path) -> bool:
    """Whether `path` is a searchable PDF that ocrvl wrote."""
    import pikepdf

    try:
        with pikepdf.open(path) as pdf:
            return OURS_KEY in pdf.docinfo
    except (OSError, pikepdf.PdfError):
        return False


def write_searchable_pdf(source: Path, target: Path, pages: Iterable[PageText],
                         sha256: str) -> None:
    """Write `target`: `source`'s pages with `pages`' text laid over them (`source` is only
    read), marked as ocrvl's (made from the content `sha256`). Pages without a size or
    blocks (placeholders) are left without text. Raises pikepdf.PdfError for a PDF that
    qpdf cannot read."""
    import pikepdf
    from ocrmypdf.font import MultiFontManager
    from ocrmypdf.fpdf_renderer import Fpdf2MultiPageRenderer

    with pikepdf.open(source) as pdf:
        pdf.docinfo[OURS_KEY] = sha256
        boxes = [pikepdf.Rectangle(page.cropbox) for page in pdf.pages]
        turns = [int(page.obj.get("/Rotate", 0)) % 360 for page in pdf.pages]
        layers = [(page.index, tree) for page in pages
                  if page.index < len(boxes) and (tree := _page_tree(page))]
        if layers:
            text_file = target.with_name(target.name + ".text")
            try:
                Fpdf2MultiPageRenderer(
                    [(index, tree, 72.0 * tree.bbox.width / _shown_width(boxes[index],
                                                                         turns[index]))
                     for index, tree in layers],
                    MultiFontManager(), invisible_text=True).render(text_file)
                with pikepdf.open(text_file) as text:
                    for (index, _), layer in zip(layers, text.pages, strict=True):
                        # The blocks are where the page is shown (its /Rotate applied); qpdf
                        # places a form upright on a rotated page, so the layer turns with it.
                        pdf.pages[index].add_overlay(layer, boxes[index])
                    pdf.save(target)
            finally:
                text_file.unlink(missing_ok=True)
        else:
            pdf.save(target)


def _shown_width(box: Any, turn: int) -> float:
    """The width of a page as shown, its rotation applied (what ocrvl rendered)."""
    return float(box.height if turn in (90, 270) else box.width)


def _page_tree(page: PageText) -> Any:
    """The page's blocks as OCRmyPDF's element tree (page > paragraph > line > word), in the
    page image's pixels; None when there is no text to place."""
    from ocrmypdf.models.ocr_element import BoundingBox, OcrClass, OcrElement

    if page.size is None or not page.blocks:
        return None
    width, height = page.size
    paragraphs = []
    for block in page.blocks:
        text = _words(block)
        x0, y0, x1, y1 = block.get("bbox") or (0, 0, width, height)
        if not text or x1 <= x0 or y1 <= y0:
            continue
        lines = []
        for top, bottom, words in _lines(text, x1 - x0, y1 - y0, y0):
            line_box = BoundingBox(x0, top, x1, bottom)
            lines.append(OcrElement(ocr_class=OcrClass.LINE, bbox=line_box, children=[
                OcrElement(ocr_class=OcrClass.WORD, bbox=BoundingBox(left, top, right, bottom),
                           text=word) for left, right, word in _spread(words, x0, x1)]))
        paragraphs.append(OcrElement(ocr_class=OcrClass.PARAGRAPH,
                                     bbox=BoundingBox(x0, y0, x1, y1), children=lines))
    if not paragraphs:
        return None
    return OcrElement(ocr_class=OcrClass.PAGE, bbox=BoundingBox(0, 0, width, height),
                      children=paragraphs)


def _words(block: dict[str, Any]) -> list[str]:
    """A block's words as a reader searches for them: a table's cells, no HTML or Markdown."""
    if block.get("label") in _PICTURES:
        return []
    text = html.unescape(_TAG.sub(" ", str(block.get("text", ""))))
    return text.split()


def _lines(words: list[str], width: float, height: float, top: float
           ) -> Iterator[tuple[float, float, list[str]]]:
    """The words of a `width` x `height` block wrapped into as many lines as fit its shape:
    n lines of height h = height / n hold about n * width / (h / _CHARS_PER_HEIGHT)
    characters. Yields each line's top, bottom and words."""
    chars = sum(len(w) + 1 for w in words)
    count = max(1, min(len(words), math.ceil(math.sqrt(chars * height / (_CHARS_PER_HEIGHT
                                                                          * width)))))
    per_line = chars / count
    line: list[str] = []
    lines: list[list[str]] = []
    filled = 0
    for word in words:
        if line and filled + len(word) > per_line * (len(lines) + 1) and len(lines) < count - 1:
            lines.append(line)
            line = []
        line.append(word)
        filled += len(word) + 1
    lines.append(line)
    step = height / len(lines)
    for i, words_on_line in enumerate(lines):
        yield top + i * step, top + (i + 1) * step, words_on_line


def _spread(words: list[str], left: float, right: float) -> Iterator[tuple[float, float, str]]:
    """Each word's left and right across the line, by its share of the line's characters."""
    total = sum(len(w) + 1 for w in words)
    x = left
    for word in words:
        step = (right - left) * (len(word) + 1) / total
        yield x, x + step * len(word) / (len(word) + 1), word
        x += step

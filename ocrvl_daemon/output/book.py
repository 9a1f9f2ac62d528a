"""A book, not a stack of pages: book-level structure made when a document is written.

Built from the stored pages (their Markdown and layout blocks), so page-level resume stays as
it is and a re-done page re-runs it. What it does, each from the pages' blocks:

- tables continued on the next page are merged into one, and heading levels are assigned
  across the whole book, with PaddleX's own functions (those `PaddleOCRVL.restructure_pages`
  runs: `merge_tables_across_pages`, `assign_levels_to_parsing_res`), each page's Markdown
  edited where the pipeline wrote that table or heading;
- a paragraph that runs onto the next page is joined into one, and a word hyphenated at the
  page's end (`docu-` / `ment`) made whole again; the next page's anchor goes inside the
  joined paragraph, so a reader can still jump to it;
- running headers, footers and page numbers stay out of the text flow: the pipeline leaves
  the labels PaddleOCR-VL ignores (`IGNORED_LABELS`) out of the Markdown, and a join looks
  past them to the page's first and last block of text.

Only the book's text is held (never its images); `output.write_document` streams the pages.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

log = logging.getLogger(__name__)

PageBreaks = Literal["anchor", "rule"]

# PaddleOCR-VL's `markdown_ignore_labels` (paddlex/configs/pipelines/PaddleOCR-VL*.yaml): the
# pipeline leaves these out of a page's Markdown, so a join looks past them.
IGNORED_LABELS = frozenset({"number", "footnote", "header", "header_image", "footer",
                            "footer_image", "aside_text"})
# Blocks of running text ("ocr": the whole page, with layout detection off).
TEXT_LABELS = frozenset({"text", "ocr"})
# A paragraph that ends so is finished (closing quotes and brackets may follow).
_FINISHED = re.compile(r"[.!?。！？…:：;；]['\"”’)\]）」』]*$")
_HYPHENATED = re.compile(r"[^\W\d_]-$")  # a letter, then a hyphen: a word cut in two
_STARTS_LOWER = re.compile(r"^['\"“‘(\[]?[^\W\d_]")
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]")
# A page number as printed (with layout detection off it is in the page's text): 12, xii,
# Page 12, p. 12.
_PAGE_NUMBER = re.compile(r"^((page|p\.)\s*)?(\d+|(?=[mdclxvi])m*(c[md]|d?c{0,3})(x[cl]|l?x{0,3})"
                          r"(i[xv]|v?i{0,3}))$", re.IGNORECASE)
# What is not running text: Markdown structure, HTML, formulas, list items.
_NOT_PROSE = re.compile(r"^(#|<|\||!\[|\$|>|[-*+] |\d+[.)] )")


def page_anchor(number: int) -> str:
    """Where page `number` (1-based) starts: a comment (as with `rule`) and an anchor a
    reader can jump to (`#page-N`), which breaks no paragraph."""
    return f'<!-- page {number} --><a id="page-{number}"></a>'


@dataclass(frozen=True)
class BookPage:
    """What restructuring reads of a stored page: its text and blocks, not its images."""

    index: int
    markdown: str
    blocks: list[dict[str, Any]] | None  # the layout record's blocks (label, bbox, text)
    flagged: bool = False  # a placeholder, a note or a verdict other than ok: never joined


@dataclass(frozen=True)
class Join:
    """Two blocks made one across a page break: `kind` paragraph, hyphen (a word made
    whole) or table; `page` is the later page (0-based), blocks are indices in each page's
    blocks (None where the page has no layout record)."""

    kind: Literal["paragraph", "hyphen", "table"]
    page: int
    from_block: int | None
    to_block: int | None

    def to_json(self) -> dict[str, Any]:
        """The JSON output's record of it (pages 1-based)."""
        return {"kind": self.kind,
                "from": {"page": self.page, "block": self.from_block},
                "to": {"page": self.page + 1, "block": self.to_block}}


@dataclass
class Book:
    """The restructured book: each changed page's Markdown, which pages start inside a
    paragraph (their anchor is in the text before), the joins made and headings relevelled."""

    texts: dict[int, str] = field(default_factory=dict)
    inline: set[int] = field(default_factory=set)
    joins: list[Join] = field(default_factory=list)
    levels: dict[tuple[int, int], int] = field(default_factory=dict)  # (page, block) -> #s

    def text(self, index: int, markdown: str) -> str:
        """Page `index`'s Markdown in the book (`markdown`, the pipeline's, where unchanged)."""
        return self.texts.get(index, markdown)


def restructure(pages: Iterable[BookPage], *, join_paragraphs: bool) -> Book:
    """Merge tables and relevel headings across `pages` (in order), and with
    `join_paragraphs` join what a page break split."""
    pages = list(pages)
    book = Book()
    blocks = [_paddle_blocks(page) for page in pages]
    _merge_tables(pages, blocks, book)
    _relevel_headings(pages, blocks, book)
    if join_paragraphs:
        holder = pages[0] if pages else None  # the page whose text ends the flow so far
        for before, after in itertools.pairwise(pages):
            if (holder is not None and after.index == before.index + 1
                    and not (before.flagged or after.flagged)
                    and _join(before, holder, after, book)
                    and _page_numbers_only(book.texts[after.index])):
                continue  # all of `after` went into the paragraph: it goes on in `holder`
            holder = after
    return book


# --- PaddleX's own book-level functions ------------------------------------------------------

class _PaddleBlock:
    """A block as PaddleX's book-level functions read it (`PaddleOCRVLBlock`'s fields)."""

    def __init__(self, number: int, block: dict[str, Any]) -> None:
        self.content = str(block.get("text", ""))
        self.label = str(block.get("label", ""))
        if self.label == "table" and "<tr" not in self.content.lower():
            self.label = "table_text"  # no rows to merge: PaddleX would drop its text
        self.bbox = [int(v) for v in block.get("bbox") or (0, 0, 0, 0)]
        self.image = None
        self.global_block_id = self.global_group_id = number


def _paddle_blocks(page: BookPage) -> list[_PaddleBlock]:
    return [_PaddleBlock(i, b) for i, b in enumerate(page.blocks or [])]


def _paddlex(module: str) -> ModuleType:
    """One of PaddleX's pure-Python modules, loaded from its file: importing the `paddlex`
    package would take the daemon 3.7 s and 250 MB (3,000 modules) for three functions."""
    name = f"_ocrvl_paddlex_{module.rpartition('/')[2]}"
    if name not in sys.modules:
        spec = importlib.util.find_spec("paddlex")
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError("paddlex is not installed", name="paddlex")
        path = Path(next(iter(spec.submodule_search_locations))) / f"{module}.py"
        loaded = importlib.util.spec_from_file_location(name, path)
        if loaded is None or loaded.loader is None or not path.is_file():
            raise ModuleNotFoundError(f"paddlex has no {path}", name=name)
        sys.modules[name] = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def _formats() -> ModuleType:
    """PaddleX's Markdown formatters: how the pipeline wrote each block into the page."""
    return _paddlex("inference/common/result/converter/markdown_format_funcs")


def _replace_once(text: str, old: str, new: str) -> str | None:
    """`text` with `old` replaced by `new` once, or None where `old` is not there."""
    at = text.find(old)
    return None if at < 0 else text[:at] + new + text[at + len(old):]


def _merge_tables(pages: list[BookPage], blocks: list[list[_PaddleBlock]], book: Book) -> None:
    """A table continued on the next page becomes one (PaddleX's `merge_tables_across_pages`:
    same width, nothing but footers after it and headers before its continuation, same
    columns; a repeated header row is dropped). A table's pieces are all moved or none."""
    if not any(b.label == "table" for page in blocks for b in page):
        return
    merge = _paddlex("inference/pipelines/layout_parsing/merge_table").merge_tables_across_pages
    numbered = [(p, j, b) for p, page in enumerate(blocks) for j, b in enumerate(page)]
    for i, (_, _, b) in enumerate(numbered):
        b.global_block_id = b.global_group_id = i
    written = {id(b): b.content for _, _, b in numbered}
    merge(blocks)
    groups: dict[int, list[tuple[int, int, _PaddleBlock]]] = {}
    for p, j, b in numbered:
        if b.label == "table" and b.global_group_id != b.global_block_id:
            groups.setdefault(b.global_group_id, [numbered[b.global_group_id]]).append((p, j, b))
    table = _formats().format_table_center
    for members in groups.values():
        (first, _, head), *continued = members
        head_page = pages[first]
        texts = {head_page.index: _replace_once(book.text(head_page.index, head_page.markdown),
                                                table(_Written(written[id(head)])), table(head))}
        for p, _, b in continued:
            page = pages[p]
            texts[page.index] = _cut(texts[page.index] if page.index in texts
                                     else book.text(page.index, page.markdown),
                                     table(_Written(written[id(b)])))
        if any(text is None for text in texts.values()):
            log.debug("page %d: a table is not where the pipeline wrote it", head_page.index + 1)
            continue
        book.texts.update({p: text for p, text in texts.items() if text is not None})
        for (_, before, _), (p, after, _) in itertools.pairwise(members):
            book.joins.append(Join("table", pages[p].index, before, after))


class _Written:
    """A block's text as the pipeline had it when it wrote the page (what a formatter reads)."""

    def __init__(self, content: str) -> None:
        self.content = content


def _cut(text: str | None, part: str) -> str | None:
    """`text` without `part` and the blank lines around it (None where `part` is not there)."""
    at = -1 if text is None else text.find(part)
    if text is None or at < 0:
        return None
    return (text[:at].rstrip("\n") + "\n\n" + text[at + len(part):].lstrip("\n")).strip("\n")


def _relevel_headings(pages: list[BookPage], blocks: list[list[_PaddleBlock]],
                      book: Book) -> None:
    """Heading levels across the whole book (PaddleX's `assign_levels_to_parsing_res`: the
    numbering, its order of appearance and the heading's text height vote)."""
    titles = [b for page in blocks for b in page
              if b.label == "paragraph_title" and b.bbox[3] > b.bbox[1] and b.bbox[2] > b.bbox[0]]
    if not titles:
        return
    keep = {id(b) for b in titles}
    assign = _paddlex("inference/pipelines/layout_parsing/title_level").assign_levels_to_parsing_res
    assign([[b for b in page if id(b) in keep] for page in blocks])
    formats = _formats()
    for p, page in enumerate(blocks):
        for j, block in enumerate(page):
            level = getattr(block, "title_level", None)
            if id(block) not in keep or level is None:
                continue
            old, new = formats.format_title(block), formats.format_para_title(block)
            if old == new:
                continue
            index = pages[p].index
            text = _replace_once(book.text(index, pages[p].markdown), old, new)
            if text is not None:
                book.texts[index] = text
                book.levels[(index, j)] = int(level) + 1


# --- paragraphs and words across a page break -----------------------------------------------

def _flow_ends(page: BookPage) -> tuple[int | None, int | None]:
    """The indices of the page's first and last blocks in the text flow (None: no layout
    record, or a page of no blocks)."""
    flow = [i for i, b in enumerate(page.blocks or []) if b.get("label") not in IGNORED_LABELS]
    return (flow[0], flow[-1]) if flow else (None, None)


def _is_text(page: BookPage, block: int | None) -> bool:
    """Whether the block is running text (a page without layout record: its whole text)."""
    return page.blocks is None or (
        block is not None and page.blocks[block].get("label") in TEXT_LABELS)


def _prose(paragraph: str) -> bool:
    """Running text, not a heading, table, image, formula, list item or page number."""
    return bool(paragraph) and not _NOT_PROSE.match(paragraph) and not is_page_number(paragraph)


def _page_numbers_only(text: str) -> bool:
    """Whether `text` holds nothing but printed page numbers (or nothing at all)."""
    return all(is_page_number(p) for p in text.split("\n\n") if p.strip())


def is_page_number(paragraph: str) -> bool:
    """Whether `paragraph` is a printed page number (12, xii, - 12 -, Page 12, p. 12)."""
    return _PAGE_NUMBER.match(paragraph.strip().strip("-–—. ")) is not None


def _continues(before: str, after: str) -> Literal["paragraph", "hyphen"] | None:
    """How `after` (a page's first paragraph) continues `before` (the last of the page
    before), if it does."""
    if not (_prose(before) and _prose(after)) or _FINISHED.search(before):
        return None
    lower = _STARTS_LOWER.match(after) is not None and after.lstrip("'\"“‘([")[0].islower()
    if _HYPHENATED.search(before) and lower:
        return "hyphen"
    cjk = _CJK.search(before[-1]) is not None and _CJK.search(after[0]) is not None
    if lower or cjk or before.endswith((",", "，", "、", "-", "–", "—")):
        return "paragraph"
    return None


def _join(before: BookPage, holder: BookPage, after: BookPage, book: Book) -> bool:
    """Join `after`'s first paragraph onto the last one of `holder`'s text (`before`, or the
    page before it where `before` was one paragraph joined there) where a page break split
    it; whether it did."""
    last, first = _flow_ends(before)[1], _flow_ends(after)[0]
    if not (_is_text(before, last) and _is_text(after, first)):
        return False
    head = book.text(holder.index, holder.markdown).rstrip()
    tail = book.text(after.index, after.markdown).lstrip()
    start, sep, end = head.rpartition("\n\n")
    number = ""
    if sep and is_page_number(end):
        # The printed page number read with the page's text (layout detection off): it stays
        # a paragraph of its own, after the one it would otherwise cut in two.
        number = end.strip()
        start, sep, end = start.rpartition("\n\n")
    opening, _, rest = tail.partition("\n\n")
    kind = _continues(end.strip(), opening.strip())
    if kind is None:
        return False
    anchor = page_anchor(after.index + 1)
    end, opening = end.strip(), opening.strip()
    if kind == "hyphen":  # the word made whole, then the anchor
        word, space, more = opening.partition(" ")
        joined = f"{end[:-1]}{word}{anchor}{space}{more}"
    elif end.endswith(("-", "–", "—")) or _CJK.search(end[-1]):
        joined = f"{end}{anchor}{opening}"
    else:
        joined = f"{end} {anchor}{opening}"
    book.texts[holder.index] = start + sep + joined
    book.texts[after.index] = f"{number}\n\n{rest}" if number else rest
    book.inline.add(after.index)
    book.joins.append(Join(kind, after.index, last, first))
    return True

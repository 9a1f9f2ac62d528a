"""PDFs for tests and benchmarks, made with Pillow (scanned-book-like: one image per page).

Page `i` is `400 + 20*i` points wide, so the fake server's reply (which names the image size
it received) tells which page's text landed where: `sent_width` is that size.
"""

from __future__ import annotations

import errno
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from ocrvl_daemon.config.model import PipelineConfig
from ocrvl_daemon.files.pdf import render_scale


def page_width(index: int) -> int:
    """Width in points of page `index` (0-based) of a `make_pdf` document."""
    return 400 + 20 * (index % 50)


def sent_width(index: int, height: int = 600) -> int:
    """Width in pixels of page `index` of a `make_pdf` document (of page `height`) as ocrvl
    sends it with layout detection off, the tests' setting: scale 2, within the model's input
    size (as PDFium rounds)."""
    limit = PipelineConfig(use_layout_detection=False).page_pixel_limit
    return math.ceil(page_width(index) * render_scale(page_width(index), height, 2.0, limit))


def make_pdf(path: Path, pages: int, *, height: int = 600, seed: int = 0) -> Path:
    """A raster PDF of `pages` pages with distinct widths and distinct content."""
    images = []
    for i in range(pages):
        img = Image.new("RGB", (page_width(i), height), "white")
        draw = ImageDraw.Draw(img)
        draw.text((20, 20), f"page {i + 1} of {path.name} ({seed})", fill="black")
        draw.rectangle((20, 60, 40 + (seed * 7 + i * 13) % 300, 80), fill=(i * 5 % 255, 0, 0))
        images.append(img)
    path.parent.mkdir(parents=True, exist_ok=True)
    images[0].save(path, "PDF", save_all=True, append_images=images[1:], resolution=72.0)
    return path


LAYOUT_DPI = 144  # `make_layout_pdf` pages are drawn at 2 px a point, as ocrvl renders them
LAYOUT_PAGE = (1224, 1584)  # US Letter at LAYOUT_DPI


def make_layout_pdf(path: Path, pages: int, *, seed: int = 0) -> Path:
    """A raster PDF of book pages with a layout: a title (page 1) or a heading, paragraphs, a
    ruled table, a centred formula, a figure and a page number, each block apart from the next
    by a blank gap (what `testkit.layout_model`'s stand-in splits a page at)."""
    from PIL import ImageFont

    rng = random.Random(seed)
    words = ("ink", "page", "scan", "book", "line", "word", "paper", "margin", "verse", "note")

    def font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
        return ImageFont.load_default(size=size)

    def sentence(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    images = []
    for i in range(pages):
        img = Image.new("RGB", LAYOUT_PAGE, "white")
        draw = ImageDraw.Draw(img)
        y = 110
        if i == 0:
            title = f"The Book of {path.stem} ({seed})"
            draw.text((LAYOUT_PAGE[0] // 2, y), title, fill="black", font=font(44), anchor="mt")
        else:
            draw.text((110, y), f"Chapter {i + 1}", fill="black", font=font(30))
        y += 100
        for block in ("text", "table", "formula", "figure", "heading", "text"):
            if block == "text":
                for _ in range(4):
                    draw.text((110, y), sentence(11), fill="black", font=font(24))
                    y += 30
            elif block == "heading":
                draw.text((110, y), f"{i + 1}.{rng.randint(1, 9)} {sentence(2)}", fill="black",
                          font=font(30))
                y += 34
            elif block == "table":
                rows, top, cell_h = 4, y, 46
                for r in range(rows + 1):
                    draw.line((110, top + r * cell_h, 1110, top + r * cell_h), fill="black",
                              width=4)
                for x in (110, 443, 776, 1110):
                    draw.line((x, top, x, top + rows * cell_h), fill="black", width=4)
                for r in range(rows):
                    for c in range(3):
                        draw.text((130 + 333 * c, top + r * cell_h + 10), sentence(2),
                                  fill="black", font=font(22))
                y += rows * cell_h
            elif block == "formula":
                draw.text((LAYOUT_PAGE[0] // 2, y), f"E = m c^2 + {rng.randint(2, 99)} / x",
                          fill="black", font=font(30), anchor="mt")
                y += 34
            else:
                draw.rectangle((300, y, 924, y + 260), fill=(40 + i * 9 % 60, 40, 60))
                y += 260
            y += 48
        draw.text((LAYOUT_PAGE[0] // 2, 1500), str(i + 1), fill="black", font=font(24),
                  anchor="mt")
        images.append(img)
    path.parent.mkdir(parents=True, exist_ok=True)
    images[0].save(path, "PDF", save_all=True, append_images=images[1:],
                   resolution=float(LAYOUT_DPI))
    return path


TEXT_FONT_PX = 30  # `make_text_pdf`'s body text: 15 pt at LAYOUT_DPI
TEXT_MARGIN = 110


def make_text_pdf(path: Path, pages: Sequence[Sequence[str]], *,
                  numbered: bool = False) -> Path:
    """A scanned-like raster PDF of real words: page i holds the paragraphs `pages[i]`, each
    wrapped to the page's width, a blank line between paragraphs (so a reader can tell them
    apart) and none at a page's end (a paragraph may run on, even mid-word: `docu-`). A
    paragraph starting with `# ` is a heading, drawn larger without the mark. `numbered`:
    "Page N" at each page's foot, where the stand-in layout model labels it `number`."""
    from PIL import ImageFont

    body = ImageFont.load_default(size=TEXT_FONT_PX)
    heading = ImageFont.load_default(size=TEXT_FONT_PX * 3 // 2)
    width = LAYOUT_PAGE[0] - 2 * TEXT_MARGIN
    images: list[Image.Image] = []
    for paragraphs in pages:
        img = Image.new("RGB", LAYOUT_PAGE, "white")
        draw = ImageDraw.Draw(img)
        y = TEXT_MARGIN
        for paragraph in paragraphs:
            font, size = ((heading, TEXT_FONT_PX * 3 // 2) if paragraph.startswith("# ")
                          else (body, TEXT_FONT_PX))
            line_height = round(size * 1.35)
            for line in _wrap(paragraph.removeprefix("# "), draw, font, width):
                if y + line_height > LAYOUT_PAGE[1] - TEXT_MARGIN:
                    raise ValueError(f"page {len(images) + 1} is full at {line!r}")
                draw.text((TEXT_MARGIN, y), line, fill="black", font=font)
                y += line_height
            y += line_height
        if numbered:
            # "Page N": a lone "1" is too thin for the stand-in server's OCR model to read
            draw.text((LAYOUT_PAGE[0] // 2, 1500), f"Page {len(images) + 1}", fill="black",
                      font=body, anchor="mt")
        images.append(img)
    path.parent.mkdir(parents=True, exist_ok=True)
    images[0].save(path, "PDF", save_all=True, append_images=images[1:],
                   resolution=float(LAYOUT_DPI))
    return path


def flow_pages(paragraphs: Sequence[str], *, hyphenate: bool = True) -> list[list[str]]:
    """`paragraphs` (body text, `# ` headings) set on `make_text_pdf` pages as a book sets
    them: a paragraph that does not fit runs on to the next page, and with `hyphenate` a long
    word at the break is cut (`docu-` / `ment`). Returns each page's paragraphs."""
    from PIL import ImageFont

    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    body = ImageFont.load_default(size=TEXT_FONT_PX)
    width = LAYOUT_PAGE[0] - 2 * TEXT_MARGIN
    room = LAYOUT_PAGE[1] - 2 * TEXT_MARGIN
    body_line = round(TEXT_FONT_PX * 1.35)
    heading_line = round(TEXT_FONT_PX * 3 // 2 * 1.35)
    pages: list[list[str]] = [[]]
    used = 0
    for paragraph in paragraphs:
        if paragraph.startswith("# "):
            if used + 2 * heading_line + 2 * body_line > room:  # never a heading at a foot
                pages.append([])
                used = 0
            pages[-1].append(paragraph)
            used += 2 * heading_line
            continue
        lines = _wrap(paragraph, draw, body, width)
        while lines:
            fit = (room - used) // body_line
            if fit >= len(lines):
                pages[-1].append(" ".join(lines))
                used += (len(lines) + 1) * body_line
                break
            if fit >= 1:
                here, lines = lines[:fit], lines[fit:]
                words = lines[0].split()
                cut = len(words[0]) // 2
                piece = f" {words[0][:cut]}-"
                if (hyphenate and len(words[0]) >= 8 and words[0].isalpha()
                        and draw.textlength(here[-1] + piece, font=body) <= width):
                    here[-1] += piece
                    lines[0] = " ".join([words[0][cut:], *words[1:]])
                    lines = _wrap(" ".join(lines), draw, body, width)
                pages[-1].append(" ".join(here))
            pages.append([])
            used = 0
    return [page for page in pages if page]


def _wrap(text: str, draw: ImageDraw.ImageDraw, font: Any, width: int) -> list[str]:
    lines: list[str] = []
    for word in text.split():
        if lines and draw.textlength(f"{lines[-1]} {word}", font=font) <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    return lines


RED_MARK = (110, 0, 0)  # dark enough to be ink for the stand-in layout model, and red
BLOCKS_PAGE_LINES = 30


def make_blocks_pdf(path: Path, pages: int, *, marked: frozenset[tuple[int, int]] = frozenset(),
                    seed: int = 0) -> Path:
    """A raster PDF of pages of BLOCKS_PAGE_LINES lines of text, each line apart from the next
    by a blank gap, so that `testkit.layout_model`'s stand-in finds a block per line: a page
    that is 30 requests. The lines (page, line), 0-based, in `marked` start with a RED_MARK
    square, which the fake server's `--loop-marked` makes loop."""
    from PIL import ImageFont

    rng = random.Random(seed)
    words = ("ink", "page", "scan", "book", "line", "word", "paper", "margin", "verse", "note")
    font = ImageFont.load_default(size=14)
    images = []
    for i in range(pages):
        img = Image.new("RGB", LAYOUT_PAGE, "white")
        draw = ImageDraw.Draw(img)
        for line in range(BLOCKS_PAGE_LINES):
            # 48 px a line: the text is ~16 px tall, the gap two of the stand-in's grid rows.
            y = 56 + 48 * line
            left = 110
            if (i, line) in marked:
                draw.rectangle((left, y, left + 24, y + 12), fill=RED_MARK)
                left += 40
            text = f"{i + 1}.{line + 1} " + " ".join(rng.choice(words)
                                                     for _ in range(rng.randint(4, 12)))
            draw.text((left, y), text, fill="black", font=font)
        images.append(img)
    path.parent.mkdir(parents=True, exist_ok=True)
    images[0].save(path, "PDF", save_all=True, append_images=images[1:],
                   resolution=float(LAYOUT_DPI))
    return path


def make_encrypted_pdf(path: Path, password: str = "secret") -> Path:
    """A one-page PDF that needs a password to open."""
    from pypdf import PdfReader, PdfWriter

    plain = make_pdf(path.with_name(path.stem + ".plain.pdf"), 1)
    writer = PdfWriter()
    for page in PdfReader(plain).pages:
        writer.add_page(page)
    writer.encrypt(user_password=password, owner_password=password + "-owner")
    with path.open("wb") as f:
        writer.write(f)
    plain.unlink()
    return path


def make_empty_pdf(path: Path) -> Path:
    """A well-formed PDF with zero pages."""
    from pypdf import PdfWriter

    with path.open("wb") as f:
        PdfWriter().write(f)
    return path


# --- the bad-input corpus: files a daemon must survive, each with a clear outcome ----------


def make_zero_byte(path: Path) -> Path:
    """An empty file named .pdf (an interrupted copy)."""
    path.write_bytes(b"")
    return path


def make_random_bytes(path: Path, size: int = 4096, seed: int = 0) -> Path:
    """Noise named .pdf."""
    path.write_bytes(random.Random(seed).randbytes(size))
    return path


def make_html_as_pdf(path: Path) -> Path:
    """An HTML page saved under a .pdf name (a download that went to a login page)."""
    path.write_text("<!DOCTYPE html>\n<html><body><h1>Please sign in</h1></body></html>\n")
    return path


def make_truncated_pdf(path: Path, keep: float = 0.5) -> Path:
    """A real PDF cut off after `keep` of its bytes (no cross-reference table, no trailer)."""
    data = make_pdf(path, 4, seed=11).read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def make_damaged_xref_pdf(path: Path) -> Path:
    """A real PDF whose cross-reference offsets all point to the wrong place.

    PDFium rebuilds the table by scanning the objects, so this one is repairable.
    """
    data = make_pdf(path, 3, seed=12).read_bytes()
    start = data.rfind(b"xref")
    broken = re.sub(rb"\d{10} 00000 n", b"0000000001 00000 n", data[start:])
    path.write_bytes(data[:start] + broken)
    return path


def make_damaged_page_pdf(path: Path) -> Path:
    """A 3-page PDF whose second page object is not a page: PDFium counts it, cannot load it."""
    from pypdf import PdfReader, PdfWriter
    from pypdf.generic import TextStringObject

    plain = make_pdf(path.with_name(path.stem + ".plain.pdf"), 3, seed=23)
    writer = PdfWriter()
    for page in PdfReader(plain).pages:
        writer.add_page(page)
    kids = writer.root_object["/Pages"]["/Kids"]  # type: ignore[index]
    kids[1] = writer._add_object(TextStringObject("not a page"))
    with path.open("wb") as f:
        writer.write(f)
    plain.unlink()
    return path


def make_blank_pages_pdf(path: Path, pages: int, width: float, height: float) -> Path:
    """`pages` blank pages of `width` x `height` points (cheap at any size or count)."""
    from pypdf import PdfWriter

    writer = PdfWriter()
    for _ in range(pages):
        writer.add_blank_page(width, height)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        writer.write(f)
    return path


def make_gigantic_page_pdf(path: Path) -> Path:
    """One 200 x 200 inch page, PDF's maximum: 829 megapixels at the default scale."""
    return make_blank_pages_pdf(path, 1, 14400, 14400)


def make_many_tiny_pages_pdf(path: Path, pages: int = 2000) -> Path:
    """Thousands of 50 x 50 pt pages."""
    return make_blank_pages_pdf(path, pages, 50, 50)


@dataclass(frozen=True)
class BadInput:
    """A corpus file and what must become of it: converted, or failed for `reason`."""

    path: Path
    reason: str | None  # a phrase of the failure reason; None: it must convert


def make_bad_input_corpus(folder: Path) -> list[BadInput]:
    """The static part of the corpus, written into `folder` (files the daemon finds there).

    What happens *to* files while they are converted (deleted, replaced) is done by tests.
    """
    folder.mkdir(parents=True, exist_ok=True)
    return [
        BadInput(make_zero_byte(folder / "zero.pdf"), "is empty (0 bytes)"),
        BadInput(make_random_bytes(folder / "noise.pdf"), "is not a PDF"),
        BadInput(make_html_as_pdf(folder / "login.pdf"), "is an HTML page"),
        BadInput(make_truncated_pdf(folder / "truncated.pdf"), "damaged beyond repair"),
        BadInput(make_damaged_xref_pdf(folder / "bad-xref.pdf"), None),
        BadInput(make_damaged_page_pdf(folder / "torn-page.pdf"), None),  # with a placeholder
        BadInput(make_encrypted_pdf(folder / "locked.pdf"), "encrypted with a password"),
        BadInput(make_empty_pdf(folder / "no-pages.pdf"), "damaged beyond repair or has no pages"),
        BadInput(make_gigantic_page_pdf(folder / "poster.pdf"), None),
        BadInput(make_many_tiny_pages_pdf(folder / "stamps.pdf"), None),
        BadInput(make_pdf(folder / "my book.pdf", 1, seed=13), None),
        BadInput(make_pdf(folder / 'it\'s "quoted".pdf', 1, seed=14), None),
        BadInput(make_pdf(folder / "line\nbreak.pdf", 1, seed=15), None),
        BadInput(make_pdf(folder / "Ünïcödé – 日本語.pdf", 1, seed=16), None),
        BadInput(make_pdf(folder / "$(touch pwned) `x`; ..pdf", 1, seed=17), None),
    ]


def deny_reading(monkeypatch: Any, path: Path) -> None:
    """Make opening `path` fail with EACCES (root reads everything, so chmod cannot)."""
    real_open = Path.open

    def guarded(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self == path:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", guarded)

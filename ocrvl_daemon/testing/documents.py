"""PDFs for tests and benchmarks, made with Pillow (scanned-book-like: one image per page).

Page `i` is `400 + 20*i` points wide, so the fake server's reply (which names the image size
it received) tells which page's text landed where.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw


def page_width(index: int) -> int:
    """Width in points of page `index` (0-based) of a `make_pdf` document."""
    return 400 + 20 * (index % 50)


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

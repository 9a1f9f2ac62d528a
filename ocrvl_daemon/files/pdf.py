"""Reading input PDFs: identity, sanity checks and page rendering within a pixel budget."""

from __future__ import annotations

import hashlib
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pypdfium2 as pdfium

from ocrvl_daemon.errors import (
    EncryptedPdfError,
    InputFileError,
    InputVanishedError,
    OcrvlError,
    PageDamagedError,
    UsageError,
)
from ocrvl_daemon.files.names import is_pdf_name, shell_quote

# PDFium is not thread-safe; every call into it goes through this lock.
PDFIUM_LOCK = threading.RLock()


@dataclass(frozen=True)
class FileIdentity:
    """What identifies one version of an input file."""

    sha256: str
    size: int
    mtime: float


def file_identity(path: Path) -> FileIdentity:
    """Hash the file's content (streamed) and record its size and mtime."""
    try:
        before = path.stat()
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        after = path.stat()
    except OSError as exc:
        raise input_error(path, exc) from exc
    if (before.st_size, before.st_mtime) != (after.st_size, after.st_mtime):
        raise InputVanishedError(f"{path} changed while it was being read.")
    return FileIdentity(digest.hexdigest(), after.st_size, after.st_mtime)


@dataclass(frozen=True)
class FileStamp:
    """What a file's metadata says of its version: `cp` over it changes its mtime, `mv`
    over it its inode, so any field that differs means other bytes."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileStamp | None:
        """The stamp of the file at `path` now; None when there is none."""
        try:
            return cls.from_stat(path.stat())
        except OSError:
            return None

    @classmethod
    def from_stat(cls, st: os.stat_result) -> FileStamp:
        """The stamp a stat result gives."""
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def check_unchanged(path: Path, size: int, mtime: float) -> None:
    """Raise InputVanishedError unless `path` is still the version (size, mtime) queued."""
    try:
        st = path.stat()
    except FileNotFoundError as exc:
        raise InputVanishedError(f"{path} disappeared while it was being converted.") from exc
    if (st.st_size, st.st_mtime) != (size, mtime):
        raise InputVanishedError(f"{path} changed while it was being converted.")


def retry_command(path: Path, pages: str | None = None, again: str = "ocrvl retry") -> str:
    """The command that converts `path` (or these pages of it, e.g. "3" or "3,7") again.

    `again` is the command that reaches the record the document is in: `ocrvl retry` for the
    daemon's documents, `ocrvl convert ...` (with the options it ran with) for convert's.
    """
    selection = f"--pages {pages} " if pages else ""
    return f"{again} {selection}{shell_quote(path)}"


def parse_pages(spec: str, page_count: int | None = None, path: Path | None = None) -> list[int]:
    """'3,7-9' -> [2, 6, 7, 8] (0-based); a malformed list, or a page beyond the last of
    `path`'s `page_count` pages, is a UsageError (naming the page count)."""
    pages: set[int] = set()
    try:
        for part in spec.split(","):
            first, _, last = part.strip().partition("-")
            lo, hi = int(first), int(last or first)
            if lo < 1 or hi < lo:
                raise ValueError
            pages.update(range(lo - 1, hi))
    except ValueError:
        raise UsageError(
            f"--pages {spec!r} is not a page list.",
            "write pages like 3 or 3,7-9 (1 is the first page)",
        ) from None
    if page_count is not None and max(pages) >= page_count:
        raise UsageError(
            f"--pages {spec}: {path} has {page_count} page{'s' if page_count != 1 else ''}.",
            f"give pages from 1 to {page_count}",
        )
    return sorted(pages)


def input_error(path: Path, exc: OSError) -> OcrvlError:
    """An OSError met while reading an input, as the failure to record."""
    if isinstance(exc, FileNotFoundError):
        return InputVanishedError(f"{path} disappeared while it was being read.")
    if isinstance(exc, PermissionError):
        return InputFileError(
            f"{path} cannot be read: permission denied.",
            f"make it readable for this user: chmod u+r {shell_quote(path)}",
        )
    if isinstance(exc, IsADirectoryError):
        return InputFileError(f"{path} is a directory, not a PDF.", "pass a PDF file")
    return OcrvlError(f"Cannot read {path}: {exc}.", "check the file; ocrvl retries by itself")


def check_header(path: Path) -> None:
    """Raise InputFileError unless `path` starts like a PDF (`%PDF-` in its first 1 KiB)."""
    if path.is_dir():
        raise InputFileError(f"{path} is a directory, not a PDF.", "pass a PDF file")
    try:
        with path.open("rb") as f:
            head = f.read(1024)
    except OSError as exc:
        raise input_error(path, exc) from exc
    if not head:
        raise InputFileError(
            f"{path} is empty (0 bytes).", "copy the PDF again; the transfer may have failed"
        )
    if b"%PDF-" not in head:
        kind = (
            "an HTML page"
            if b"<html" in head.lower() or b"<!doctype" in head.lower()
            else "not a PDF"
        )
        if not is_pdf_name(path.name):
            raise InputFileError(f"{path} is {kind} (no %PDF header).", "pass a PDF file")
        raise InputFileError(
            f"{path} is {kind} (no %PDF header), though it is named .pdf.",
            "save or download the document again as a real PDF",
        )


def open_pdf(path: Path) -> pdfium.PdfDocument:
    """Open a PDF, turning PDFium's errors into messages a user can act on.

    The caller must hold PDFIUM_LOCK for as long as the document is used.
    """
    if not path.exists():
        raise InputVanishedError(f"{path} does not exist (any more).")
    check_header(path)
    try:
        return pdfium.PdfDocument(str(path))
    except pdfium.PdfiumError as exc:
        # PDFium's error code is process-global and can be stale, so look for the
        # encryption dictionary ourselves.
        if _declares_encryption(path):
            raise EncryptedPdfError(
                f"{path} is encrypted with a password.",
                "save an unprotected copy (e.g. qpdf --decrypt --password=... "
                "in.pdf out.pdf) and convert that copy",
            ) from exc
        raise InputFileError(
            f"{path} is damaged beyond repair or has no pages.",
            "re-download or re-scan it; `qpdf --check` shows what is wrong",
        ) from exc


def _declares_encryption(path: Path) -> bool:
    """Whether the trailer (at the end, or the start of a linearised file) has /Encrypt."""
    with path.open("rb") as f:
        head = f.read(1 << 16)
        f.seek(max(0, path.stat().st_size - (1 << 20)))
        tail = f.read()
    return b"/Encrypt" in head or b"/Encrypt" in tail


def page_count(path: Path) -> int:
    """Number of pages; zero pages is an error, since there is nothing to convert."""
    with PDFIUM_LOCK:
        doc = open_pdf(path)
        try:
            count = len(doc)
        finally:
            doc.close()
    if count == 0:
        raise InputFileError(f"{path} has no pages.", "check the file; there is nothing to convert")
    return count


def render_scale(width_pt: float, height_pt: float, scale: float, max_pixels: int) -> float:
    """The render scale, lowered so the page stays within `max_pixels` as PDFium rounds (up).

    Scale 2.0 gives ~2 MP for an A4 page; a poster-sized page must not take gigabytes of RAM,
    so anything above the budget is rendered smaller instead.
    """
    s = min(scale, scale * math.sqrt(max_pixels / (width_pt * scale * height_pt * scale)))
    while math.ceil(width_pt * s) * math.ceil(height_pt * s) > max_pixels:
        s *= 0.999
    return s


def render_page(path: Path, index: int, scale: float, max_pixels: int) -> np.ndarray:
    """Render one page (0-based) to a BGR array, as PaddleX's own PDF reader does."""
    with PDFIUM_LOCK:
        doc = open_pdf(path)
        try:
            if index >= len(doc):
                raise InputVanishedError(
                    f"{path} no longer has a page {index + 1}; it changed while being converted."
                )
            try:
                page = doc[index]
                try:
                    width, height = page.get_size()
                    bitmap = page.render(scale=render_scale(width, height, scale, max_pixels))
                    image = bitmap.to_numpy()
                    if image.shape[2] == 4:  # BGRx: drop the padding channel
                        image = image[:, :, :3]
                    return np.ascontiguousarray(image)
                finally:
                    page.close()
            except pdfium.PdfiumError as exc:
                raise damaged_page(path, index, exc) from exc
        finally:
            doc.close()


def damaged_page(path: Path, index: int, exc: pdfium.PdfiumError) -> PageDamagedError:
    """A page PDFium counts but cannot load or draw: the file is damaged at that page."""
    return PageDamagedError(
        f"page {index + 1} is damaged in the PDF and cannot be rendered "
        f"(PDFium: {str(exc).rstrip('.')}).",
        repair_fix(path),
    )


def repair_fix(path: Path) -> str:
    """What to do about a page damaged in the PDF: retrying cannot help, repairing can."""
    return (
        f"repair the file (e.g. qpdf {shell_quote(path)} fixed.pdf, or print it to a new PDF) "
        "and convert the repaired copy"
    )

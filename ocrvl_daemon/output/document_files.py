"""Writing results: `<stem>.md`, `<stem>_images/`, `<stem>.ocrvl-error.txt`, and with
`output.formats: [markdown, json]` `<stem>.json` (pages, their quality and layout blocks; its
JSON Schema is `data/document.schema.json`), with `pdf` `<stem>.ocr.pdf` (`searchable_pdf`).

They go next to the PDF, or under `output.dir` mirroring the inbox's sub-folders
(`OutputPlace`); every rule below holds in both places.

Nothing half-written is ever visible under a final name (temporary name + fsync + rename), and
a Markdown file or image folder that ocrvl did not write is never replaced. Names keep the PDF's
raw bytes; where `<stem>_images` or `<stem>.ocrvl-error.txt` would be longer than the
filesystem allows, that one gets a shortened name (`names.fit_name`) and says so.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from ocrvl_daemon.errors import NameTooLongError, NotOursError, OutputError
from ocrvl_daemon.files.atomic import fsync_dir, remove_temporaries, temporary, write_atomic
from ocrvl_daemon.files.names import fit_name, name_bytes, name_max, shown
from ocrvl_daemon.observe.units import format_bytes
from ocrvl_daemon.output.book import Book, PageBreaks, page_anchor
from ocrvl_daemon.output.searchable_pdf import (
    SEARCHABLE_SUFFIX,
    PageText,
    is_ours,
    write_searchable_pdf,
)

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ocrvl_daemon.config.model import Config

IMAGES_MARKER = ".ocrvl-images"
IMAGES_SUFFIX = "_images"
ERROR_SUFFIX = ".ocrvl-error.txt"
JSON_FORMAT = "ocrvl-document"
JSON_VERSION = 1
# How every ocrvl JSON output starts: what tells it from a JSON file ocrvl did not write.
_JSON_START = f'{{"format": "{JSON_FORMAT}", "version": {JSON_VERSION},'
_HEADER = re.compile(r"^<!-- ocrvl (?P<fields>[^\n]*?) -->")
_FIELD = re.compile(r'(\w+)="([^"]*)"')
# Slack over the result's own bytes for what the filesystem adds (blocks, directory entries,
# the image marker): an eighth more, and this much besides.
FREE_SLACK_BYTES = 1024 * 1024


@dataclass
class Page:
    """One page's recognised Markdown and the images it links to (relative names)."""

    index: int
    markdown: str
    images: dict[str, bytes] = field(default_factory=dict)
    note: str | None = None  # why the page is a placeholder or flagged
    quality: dict[str, Any] | None = None  # page_quality.PageQuality.to_json()
    layout: dict[str, Any] | None = None  # {"size": [w, h], "blocks": [...]}


@dataclass(frozen=True)
class OutputPlace:
    """Where a PDF's outputs go: next to it (`dir` None), or under `dir`.

    Under `dir`, a PDF inside one of `inboxes` keeps its sub-folder relative to that inbox
    (prefixed by the inbox's folder name when there are several); any other PDF goes to
    `dir` itself.
    """

    dir: Path | None = None
    inboxes: tuple[Path, ...] = ()

    def base(self, pdf: Path) -> Path:
        """The path the outputs are named after: `pdf` itself, or its place under `dir`."""
        if self.dir is None:
            return pdf
        pdf = pdf.absolute()
        containing = [i for i in map(Path.absolute, self.inboxes) if pdf.is_relative_to(i)]
        if not containing:
            return self.dir / pdf.name
        inbox = max(containing, key=lambda i: len(i.parts))  # the innermost one
        prefix = Path(inbox.name) if len(self.inboxes) > 1 else Path()
        return self.dir / prefix / pdf.relative_to(inbox)


NEXT_TO_PDF = OutputPlace()


def output_place(config: Config) -> OutputPlace:
    """Where this configuration puts every document's outputs."""
    return OutputPlace(config.output.dir, tuple(config.inbox.paths))


def outputs_for(pdf: Path, place: OutputPlace = NEXT_TO_PDF) -> tuple[Path, Path, Path]:
    """The Markdown file, image folder and error note that belong to `pdf`.

    The Markdown always has the PDF's stem (`check_writable` refuses a name too long for
    it); the image folder and error note are shortened where the full name would not fit.
    """
    base = place.base(pdf)
    limit = _name_limit(base)
    return (
        base.with_suffix(".md"),
        base.with_name(fit_name(base.stem, IMAGES_SUFFIX, limit)),
        base.with_name(fit_name(base.stem, ERROR_SUFFIX, limit)),
    )


def json_for(pdf: Path, place: OutputPlace = NEXT_TO_PDF) -> Path:
    """The JSON output that belongs to `pdf` (`output.formats: [markdown, json]`)."""
    return place.base(pdf).with_suffix(".json")


def searchable_for(pdf: Path, place: OutputPlace = NEXT_TO_PDF) -> Path:
    """The searchable PDF that belongs to `pdf` (`output.formats: [..., pdf]`)."""
    return place.base(pdf).with_suffix(SEARCHABLE_SUFFIX)


def _is_our_json(path: Path) -> bool:
    try:
        with path.open("r", encoding="utf-8", errors="replace") as f:
            return f.read(len(_JSON_START)) == _JSON_START
    except OSError:
        return False


def _name_limit(pdf: Path) -> int:
    """The longest name, in bytes, beside `pdf`. At least the PDF's own: a filesystem that
    counts characters rather than bytes (NTFS under WSL2) may report less than it holds."""
    return max(name_max(pdf.parent), name_bytes(pdf.name))


def _shorter_name_fix(limit: int, suffix: str = ".md") -> str:
    """The fix for a name that leaves no room for `suffix` within `limit` bytes."""
    return (f"rename the PDF to a shorter name (at most {limit - name_bytes(suffix)} bytes "
            "before .pdf); in an inbox the renamed file is picked up by itself")


def shortened_names(pdf: Path, place: OutputPlace = NEXT_TO_PDF) -> str | None:
    """What got a shortened name because the full one is too long for the filesystem."""
    _, images, note = outputs_for(pdf, place)
    short = [f"{what} is {path.name}" for what, path, suffix in (
        ("the image folder", images, IMAGES_SUFFIX), ("the error note", note, ERROR_SUFFIX))
        if path.name != pdf.stem + suffix]
    if not short:
        return None
    return (f"the name is too long to add {IMAGES_SUFFIX} or {ERROR_SUFFIX} within this "
            f"filesystem's limit of {_name_limit(place.base(pdf))} bytes, so "
            f"{' and '.join(short)} "
            "(the start of the name, ~ and a hash of it)")


def read_header(md: Path) -> dict[str, str] | None:
    """The fields of ocrvl's header line, or None when the file is not ocrvl's."""
    try:
        with md.open("r", encoding="utf-8", errors="replace") as f:
            first = f.readline(4096)
    except OSError:  # missing, a directory, unreadable: in any case not ocrvl's Markdown
        return None
    match = _HEADER.match(first)
    return dict(_FIELD.findall(match["fields"])) if match else None


def is_current(pdf: Path, sha256: str, model: str, place: OutputPlace = NEXT_TO_PDF) -> bool:
    """Whether `<stem>.md` exists, is ocrvl's, and was made from this content by this model."""
    header = read_header(outputs_for(pdf, place)[0])
    return header is not None and header.get("sha256") == sha256 and header.get("model") == model


def check_writable(pdf: Path, *, json_output: bool = False, searchable: bool = False,
                   place: OutputPlace = NEXT_TO_PDF) -> None:
    """Refuse early when the output cannot be written: a read-only folder, or an output
    ocrvl must not replace in the way."""
    md, images, _ = outputs_for(pdf, place)
    data = json_for(pdf, place)
    layered = searchable_for(pdf, place)
    limit = _name_limit(place.base(pdf))
    # Every output named exactly after the PDF, before anything looks one up (a name too
    # long for the filesystem fails even a lookup).
    for fixed in (md, *[data] * json_output, *[layered] * searchable):
        if name_bytes(fixed.name) > limit:
            raise NameTooLongError(
                f"{fixed.name} would be {name_bytes(fixed.name)} bytes long; this filesystem "
                f"allows {limit} bytes in a file name.",
                _shorter_name_fix(limit, fixed.suffix),
            )
    if md.parent.is_dir() and not os.access(md.parent, os.W_OK):
        raise _not_writable(md, "no write permission")
    if json_output and data.exists() and not _is_our_json(data):
        raise NotOursError(
            f"{data} already exists and was not written by ocrvl; it is left untouched.",
            "move or rename it",
        )
    if searchable and layered.exists() and not is_ours(layered):
        raise NotOursError(
            f"{layered} already exists and was not written by ocrvl; it is left untouched.",
            "move or rename it",
        )
    if md.exists() and read_header(md) is None:
        raise NotOursError(
            f"{md} already exists and was not written by ocrvl; it is left untouched.",
            "move or rename it",
        )
    if images.exists() and not (images / IMAGES_MARKER).exists():
        raise NotOursError(
            f"{images} already exists and was not written by ocrvl; it is left untouched.",
            "move or rename it",
        )


def write_document(
    pdf: Path,
    sha256: str,
    model: str,
    page_count: int,
    pages: Iterable[Page],
    size_hint: int = 0,
    *,
    json_output: bool = False,
    searchable: bool = False,
    place: OutputPlace = NEXT_TO_PDF,
    page_breaks: PageBreaks = "rule",
    book: Book | None = None,
) -> None:
    """Write `<stem>.md` and `<stem>_images/` from `pages` (in order), atomically, and with
    `json_output` `<stem>.json` too, with `searchable` `<stem>.ocr.pdf` (`pdf` with a text
    layer of the pages' blocks; both renamed in just before the Markdown).

    `page_breaks` says how a page's start is marked (`rule`: a rule and a page comment;
    `anchor`: the comment and an anchor, no rule); `book` (`book.restructure`) gives each
    page's restructured Markdown, the pages that start inside a paragraph and the joins.

    Pages are streamed: a 10,000-page book never sits in memory whole. The image folder is
    swapped in first and the Markdown renamed last, so the Markdown never links to images
    that are not there yet. `size_hint` (bytes of text and images) is checked against the
    free space first; a full disk raises a transient OutputError and leaves nothing behind.
    """
    md, images_dir, _ = outputs_for(pdf, place)
    _make_folder(md.parent)
    _check_free_space(md.parent, room_needed(size_hint, json_output=json_output))
    tmp_md = temporary(md)
    tmp_dir = temporary(images_dir)
    data = json_for(pdf, place)
    tmp_json = temporary(data)
    layered = searchable_for(pdf, place)
    tmp_layered = temporary(layered)
    texts: list[PageText] = []  # the pages' blocks for the text layer (no images)
    link_base = quote(os.fsencode(images_dir.name))  # a viewer finds the raw-byte name
    try:
        check_writable(pdf, json_output=json_output, searchable=searchable, place=place)
        # A killed run leaves its temporaries under its own pid; they are useless now.
        remove_temporaries(md)
        remove_temporaries(images_dir)
        if json_output:
            remove_temporaries(data)
        if searchable:
            remove_temporaries(layered)
        with contextlib.ExitStack() as files:
            out = files.enter_context(tmp_md.open("w", encoding="utf-8"))
            js = files.enter_context(tmp_json.open("w", encoding="utf-8")) if json_output else None
            out.write(
                f'<!-- ocrvl source="{_attr(shown(pdf.name))}" sha256="{sha256}" '
                f'model="{model}" pages="{page_count}" -->\n'
            )
            if js is not None:
                js.write(f"{_JSON_START}\n" + json.dumps(
                    {"source": shown(pdf.name), "sha256": sha256, "model": model,
                     "page_count": page_count, "markdown": shown(md.name)})[1:-1]
                    + ',\n"pages": [')
            separator = "\n"
            for page in pages:
                text = page.markdown if book is None else book.text(page.index, page.markdown)
                image_paths = []
                for name, image in sorted(page.images.items()):
                    new_name = f"p{page.index + 1:04d}_{Path(name).name}"
                    _write_image(tmp_dir, new_name, image)
                    text = text.replace(name, f"{link_base}/{quote(new_name)}")
                    image_paths.append(f"{shown(images_dir.name)}/{new_name}")
                if book is not None and page.index in book.inline:
                    out.write(f"\n{text.strip()}\n" if text.strip() else "")
                else:
                    out.write(_page_block(page, text, first=page.index == 0,
                                          page_breaks=page_breaks))
                if js is not None:
                    js.write(separator + json.dumps(_page_json(page, image_paths, book)))
                    separator = ",\n"
                if searchable and page.layout and page.layout.get("size"):
                    texts.append(PageText(page.index, tuple(page.layout["size"]),
                                          page.layout.get("blocks") or []))
            if js is not None:
                joins = [] if book is None else [join.to_json() for join in book.joins]
                js.write(f"\n],\n\"joins\": {json.dumps(joins)}}}\n")
            for written in (out, js):
                if written is not None:
                    written.flush()
                    os.fsync(written.fileno())
        searchable = searchable and _write_layered(pdf, tmp_layered, texts, sha256)
        if tmp_dir.exists():
            fsync_dir(tmp_dir)
        if images_dir.exists():
            old = temporary(images_dir, "old")
            os.replace(images_dir, old)
            shutil.rmtree(old, ignore_errors=True)
        if tmp_dir.exists():
            os.replace(tmp_dir, images_dir)
        if json_output:
            os.replace(tmp_json, data)
        if searchable:
            os.replace(tmp_layered, layered)
        os.replace(tmp_md, md)
        fsync_dir(md.parent)
    except OSError as exc:
        raise _output_error(md, exc) from exc
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        for tmp in (tmp_md, tmp_json, tmp_layered):
            with contextlib.suppress(OSError):  # never there, or the folder is read-only
                tmp.unlink()


def _write_layered(pdf: Path, target: Path, texts: list[PageText], sha256: str) -> bool:
    """Write the searchable PDF to `target` (synced); False, with the reason logged, for a
    PDF whose structure qpdf cannot read (PDFium drew its pages: the Markdown still comes)."""
    import pikepdf

    try:
        write_searchable_pdf(pdf, target, texts, sha256)
    except pikepdf.PdfError as exc:
        log.warning("%s: no searchable PDF: its structure cannot be read (%s)", pdf.name, exc)
        return False
    with target.open("rb") as written:
        os.fsync(written.fileno())
    return True


def _page_json(page: Page, image_paths: list[str], book: Book | None) -> dict[str, Any]:
    """One page of the JSON output (see data/document.schema.json): the pipeline's blocks and
    Markdown, a heading's level across the book added to its block."""
    quality = dict(page.quality or {})
    verdict, reason = quality.pop("verdict", None), quality.pop("reason", None)
    if verdict is None:  # a placeholder, or a page recorded before quality records
        failed = bool(page.note) and not page.markdown.strip()
        verdict, reason = ("bad", "failed") if failed else ("unknown", None)
    layout = page.layout or {}
    blocks = layout.get("blocks")
    if blocks is None:  # recorded before layouts were kept: the page as one block
        blocks = [{"label": "text", "bbox": None, "text": page.markdown}]
    elif book is not None:
        blocks = [{**block, "level": book.levels[(page.index, i)]}
                  if (page.index, i) in book.levels else block for i, block in enumerate(blocks)]
    return {"number": page.index + 1, "verdict": verdict, "reason": reason,
            "signals": quality or None, "note": page.note, "size": layout.get("size"),
            "blocks": blocks, "markdown": page.markdown, "images": image_paths}


def _page_block(page: Page, text: str, *, first: bool, page_breaks: PageBreaks) -> str:
    """A page's Markdown, preceded by a visible boundary: a rule and a page comment, or
    the comment and an anchor (`page_breaks`)."""
    if page_breaks == "anchor":
        lines = [page_anchor(page.index + 1)]
    else:
        lines = [] if first else ["---"]
        lines.append(f"<!-- page {page.index + 1} -->")
    verdict = (page.quality or {}).get("verdict", "ok")
    if verdict != "ok":
        lines.append(f"<!-- ocrvl: page {page.index + 1} {verdict}: "
                     f"{_comment(str(page.quality.get('reason') if page.quality else ''))} -->")
    if page.note:
        lines.append(f"<!-- ocrvl: {_comment(page.note)} -->")
    if text.strip():
        lines.append(text.strip())
    elif page.note:
        lines.append(f"*[ocrvl: {_comment(page.note)}]*")
    return "\n" + "\n\n".join(lines) + "\n"


def _attr(text: str) -> str:
    return text.replace('"', "'").replace("\n", " ").replace("-->", "- ->")


def _comment(text: str) -> str:
    return text.replace("-->", "- ->").replace("\n", " ")


def _write_image(tmp_dir: Path, name: str, data: bytes) -> None:
    if not tmp_dir.exists():
        tmp_dir.mkdir()
        (tmp_dir / IMAGES_MARKER).write_text("written by ocrvl; replaced on every conversion\n")
    with (tmp_dir / name).open("wb") as f:
        f.write(data)
        os.fsync(f.fileno())


def _make_folder(folder: Path) -> None:
    """Create an output sub-folder (under `output.dir`); next to the PDF it already exists."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _output_error(folder / ".", exc) from exc


def room_needed(size_hint: int, *, json_output: bool = False) -> int:
    """Free bytes a result of `size_hint` bytes (text and images) needs: JSON repeats the
    text, and the filesystem takes a little more than the bytes themselves."""
    data = size_hint * 2 if json_output else size_hint
    return data + data // 8 + FREE_SLACK_BYTES


def _check_free_space(folder: Path, needed: int) -> None:
    try:
        free = shutil.disk_usage(folder).free
    except OSError as exc:
        raise _output_error(folder, exc) from exc
    if free < needed:
        raise OutputError(
            f"Only {format_bytes(free)} free in {folder}; the result needs about "
            f"{format_bytes(needed)}. Output is paused and retried later.",
            "free some disk space; nothing is lost meanwhile",
        )


def _output_error(path: Path, exc: OSError) -> OutputError:
    if exc.errno == errno.ENAMETOOLONG:  # the filesystem holds less than it said
        return NameTooLongError(
            f"Cannot write {path}: the name is too long for this filesystem.",
            _shorter_name_fix(name_max(path.parent)),
        )
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return _not_writable(path, exc.strerror or str(exc))
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return OutputError(
            f"Cannot write {path}: the disk is full.",
            "free some disk space; ocrvl retries by itself",
        )
    return OutputError(f"Cannot write {path}: {exc}.", "check the folder; ocrvl retries by itself")


def _not_writable(path: Path, detail: str) -> OutputError:
    return OutputError(
        f"Cannot write {path}: the folder is not writable: {path.parent} ({detail}).",
        f"make {path.parent} writable for this user (a read-only mount or share?); "
        "ocrvl retries by itself",
    )


def write_error_note(
    pdf: Path,
    message: str,
    fix: str | None,
    *,
    redo: str,
    retry_in: float | None = None,
    place: OutputPlace = NEXT_TO_PDF,
) -> None:
    """Leave `<stem>.ocrvl-error.txt` next to a document that failed (best effort: a folder
    that cannot take it gets a log line instead).

    `redo` is the command that converts it again; `retry_in` marks a transient failure that
    ocrvl retries by itself after that many seconds.
    """
    note = outputs_for(pdf, place)[2]
    text = f"ocrvl could not convert {pdf.name}.\n\nWhat went wrong: {message}\n"
    if fix:
        text += f"What to do: {fix}\n"
    if retry_in is None:
        text += f"\nAfter fixing it, run: {redo}\n"
    else:
        text += (
            f"\nocrvl tries again by itself in about {retry_in:.0f} s; this note disappears "
            "once the document is converted.\n"
        )
    short = shortened_names(pdf, place)
    if short:
        text += f"\nNote: {short}.\n"
    try:
        note.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(note, shown(text))
    except OSError as exc:
        log.warning("no error note could be left at %s (%s)", note, exc.strerror or exc)


def remove_error_note(pdf: Path, place: OutputPlace = NEXT_TO_PDF) -> None:
    """Remove a stale error note once the document converted."""
    with contextlib.suppress(OSError):
        outputs_for(pdf, place)[2].unlink()

"""Writing results: atomic under a full or read-only disk, bounded memory, names kept in place.

Unit tests of `output`, `pdf` and `store` together (no pipeline): what a crash, a full disk
or a strange name can do to the files next to a PDF.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote_to_bytes

import pytest

from ocrvl_daemon.errors import InputFileError, NameTooLongError, NotOursError, OutputError
from ocrvl_daemon.files import pdf
from ocrvl_daemon.files.atomic import TMP_MARK
from ocrvl_daemon.files.names import name_max
from ocrvl_daemon.output import document_files
from ocrvl_daemon.output.document_files import Page, outputs_for, read_header, write_document
from ocrvl_daemon.storage.store import Store
from testkit.documents import deny_reading, make_gigantic_page_pdf, make_pdf

MODEL = "PaddleOCR-VL-1.6-0.9B"


def pages(count: int, image_every: int = 0) -> Iterator[Page]:
    for i in range(count):
        images = {f"img_{i}.jpg": b"\xff\xd8jpeg"} if image_every and i % image_every == 0 else {}
        text = f"text of page {i + 1}" + (f" ![](img_{i}.jpg)" if images else "")
        yield Page(i, text, images)


def leftovers(folder: Path) -> list[str]:
    """Temporary files or folders of ocrvl still lying around."""
    return [p.name for p in folder.iterdir() if TMP_MARK in p.name]


@pytest.fixture
def book(tmp_path: Path) -> Path:
    path = tmp_path / "book.pdf"
    path.write_bytes(b"%PDF-1.4 stand-in: output never reads the PDF\n")
    return path


@pytest.mark.quick
def test_a_complete_write_has_header_pages_and_images(book: Path) -> None:
    write_document(book, "ab" * 32, MODEL, 3, pages(3, image_every=2))
    md, images, _ = outputs_for(book)
    text = md.read_text("utf-8")
    assert read_header(md) == {"source": "book.pdf", "sha256": "ab" * 32, "model": MODEL,
                               "pages": "3"}
    assert re.findall(r"<!-- page (\d+) -->", text) == ["1", "2", "3"]
    assert sorted(p.name for p in images.iterdir()) == [
        document_files.IMAGES_MARKER, "p0001_img_0.jpg", "p0003_img_2.jpg"]
    assert "book_images/p0003_img_2.jpg" in text
    assert not leftovers(book.parent)


@pytest.mark.quick
@pytest.mark.parametrize(("where", "code"), [("fsync", errno.ENOSPC), ("replace", errno.EROFS),
                                             ("replace", errno.EACCES)])
def test_a_failing_disk_leaves_no_partial_file_and_is_retried(
        book: Path, monkeypatch: pytest.MonkeyPatch, where: str, code: int) -> None:
    """ENOSPC shows up at fsync on real filesystems; a read-only folder at the rename.

    Root ignores permissions, so the errors are injected where the OS would raise them.
    """
    write_document(book, "old", MODEL, 1, pages(1))
    before = outputs_for(book)[0].read_text("utf-8")

    def fail(*args: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(document_files.os, where, fail)
    with pytest.raises(OutputError) as caught:
        write_document(book, "new", MODEL, 50, pages(50, image_every=5))
    monkeypatch.undo()
    assert not caught.value.permanent, "a full or read-only disk must be retried by itself"
    assert "retries by itself" in str(caught.value)
    assert outputs_for(book)[0].read_text("utf-8") == before, "the old Markdown was damaged"
    assert not leftovers(book.parent), "temporary files were left behind"


@pytest.mark.quick
def test_low_free_space_pauses_output_before_writing_anything(
        book: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    usage = shutil.disk_usage(book.parent)
    monkeypatch.setattr(document_files.shutil, "disk_usage",
                        lambda _: usage._replace(free=document_files.room_needed(10_000) - 1))
    with pytest.raises(OutputError, match="Output is paused") as caught:
        write_document(book, "x", MODEL, 1, pages(1), size_hint=10_000)
    assert not caught.value.permanent
    assert sorted(p.name for p in book.parent.iterdir()) == ["book.pdf"]


@pytest.mark.quick
def test_a_small_result_fits_a_folder_with_a_few_megabytes_free(
        book: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 100 KB result with 2.9 MB free is written, not paused for 16 MiB it does not need."""
    usage = shutil.disk_usage(book.parent)
    monkeypatch.setattr(document_files.shutil, "disk_usage",
                        lambda _: usage._replace(free=2_900_000))
    write_document(book, "x", MODEL, 1, pages(1), size_hint=100_000, json_output=True)
    assert outputs_for(book)[0].exists(), "a 100 KB result did not fit in 2.9 MB free"


@pytest.mark.quick
def test_temporaries_of_a_killed_run_are_cleaned_up_by_the_next_write(book: Path) -> None:
    md, images, _ = outputs_for(book)
    (book.parent / f".{md.name}{TMP_MARK}-new-99999").write_text("half a book")
    stale_dir = book.parent / f".{images.name}{TMP_MARK}-old-99999"
    stale_dir.mkdir()
    (stale_dir / "x.jpg").write_bytes(b"x")
    write_document(book, "x", MODEL, 2, pages(2))
    assert not leftovers(book.parent)


@pytest.mark.quick
def test_a_directory_where_the_markdown_goes_is_not_ours(book: Path) -> None:
    """Stands in for a read-only output folder in daemon tests (root can write anywhere)."""
    outputs_for(book)[0].mkdir()
    with pytest.raises(NotOursError, match="was not written by ocrvl"):
        write_document(book, "x", MODEL, 1, pages(1))
    assert outputs_for(book)[0].is_dir() and not leftovers(book.parent)


def test_ten_thousand_pages_go_through_store_and_assembly_in_bounded_memory(
        tmp_path: Path) -> None:
    store = Store(tmp_path / "state" / "jobs.sqlite")
    count = 10_000
    for page in pages(count, image_every=100):
        store.save_page("sha", MODEL, page.index, page.markdown + " " + "x" * 2000, page.images)
    book = tmp_path / "huge.pdf"
    tracemalloc.start()
    try:
        write_document(book, "sha", MODEL, count, (
            Page(p.page, p.markdown, p.images, p.note) for p in store.iter_pages("sha", MODEL)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        store.close()
    text = outputs_for(book)[0].read_text("utf-8")
    assert len(re.findall(r"<!-- page \d+ -->", text)) == count
    assert len(text) > count * 2000, "pages are missing"
    # 20 MB of Markdown went through; a few batches of pages may be held at once.
    assert peak < 8 * 2**20, f"assembly held {peak / 2**20:.1f} MiB"


@pytest.mark.quick
@pytest.mark.parametrize("name", ["../x.pdf", "a\nb.pdf", "$(rm -rf ~).pdf", "-rf .pdf",
                                  "..pdf", "q'\"`.pdf", "книга.PDF"])
def test_outputs_are_computed_from_the_pdf_path_and_stay_beside_it(
        tmp_path: Path, name: str) -> None:
    """A file name never leads anywhere but its own folder, whatever characters it holds."""
    folder = tmp_path / "inbox"
    pdf_path = folder / name
    for out in outputs_for(pdf_path):
        assert out.parent == pdf_path.parent
        assert out.name.startswith(pdf_path.stem)


@pytest.mark.quick
def test_names_that_look_like_shell_or_paths_are_written_beside_the_pdf(tmp_path: Path) -> None:
    folder = tmp_path / "inbox"
    folder.mkdir()
    book = folder / "$(touch pwned) a\nb; '..'.pdf"
    book.write_bytes(b"%PDF-1.4\n")
    write_document(book, "x", MODEL, 1, pages(1))
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [book.name, book.with_suffix(".md").name])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inbox"]
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()


@pytest.mark.quick
def test_error_notes_say_what_to_do_and_go_away(book: Path) -> None:
    document_files.write_error_note(book, "it is broken.", "fix it", redo=f"ocrvl retry {book}")
    text = outputs_for(book)[2].read_text("utf-8")
    assert "What went wrong: it is broken." in text and "What to do: fix it" in text
    assert f"After fixing it, run: ocrvl retry {book}" in text
    document_files.write_error_note(book, "disk full.", "free space", redo="-", retry_in=60)
    assert "tries again by itself in about 60 s" in outputs_for(book)[2].read_text("utf-8")
    document_files.remove_error_note(book)
    assert not outputs_for(book)[2].exists() and not leftovers(book.parent)


def image_links(md: Path) -> list[bytes]:
    """The raw paths (relative to the Markdown) that its image links point to."""
    return [unquote_to_bytes(link) for link in re.findall(r"!\[\]\(([^)]+)\)",
                                                          md.read_text("utf-8"))]


@pytest.mark.quick
def test_a_name_that_is_not_utf8_keeps_its_raw_stem_and_its_links_resolve(
        tmp_path: Path) -> None:
    book = tmp_path / os.fsdecode(b"\xff\xfebook.pdf")
    book.write_bytes(b"%PDF-1.4\n")
    write_document(book, "x", MODEL, 3, pages(3, image_every=2))
    names = set(os.listdir(os.fsencode(tmp_path)))
    assert {b"\xff\xfebook.md", b"\xff\xfebook_images"} <= names, names
    md = outputs_for(book)[0]
    links = image_links(md)
    assert links == [b"\xff\xfebook_images/p0001_img_0.jpg", b"\xff\xfebook_images/p0003_img_2.jpg"]
    assert all(os.path.exists(os.fsencode(tmp_path) + b"/" + link) for link in links)
    assert read_header(md)["source"] == "\\xff\\xfebook.pdf"
    document_files.write_error_note(book, f"{book} is broken.", None, redo=pdf.retry_command(book))
    assert b"\xff\xfebook.ocrvl-error.txt" in os.listdir(os.fsencode(tmp_path))
    note = outputs_for(book)[2].read_text("utf-8")
    assert "\\xff\\xfebook.pdf is broken" in note
    assert f"ocrvl retry $'{tmp_path}/\\xff\\xfebook.pdf'" in note, note


@pytest.mark.quick
def test_companions_too_long_for_the_filesystem_get_a_short_name_and_still_work(
        tmp_path: Path) -> None:
    limit = name_max(tmp_path)
    book = tmp_path / ("Ä" * ((limit - 4) // 2) + "x" * (limit % 2) + ".pdf")
    assert len(os.fsencode(book.name)) == limit
    book.write_bytes(b"%PDF-1.4\n")
    write_document(book, "x", MODEL, 3, pages(3, image_every=2))
    md, images, note = outputs_for(book)
    assert md.name == book.stem + ".md", "the Markdown itself must keep the PDF's name"
    assert images.is_dir() and images.name.endswith("_images") and "~" in images.name
    assert [tmp_path / os.fsdecode(link) for link in image_links(md)] == [
        images / "p0001_img_0.jpg", images / "p0003_img_2.jpg"]
    assert not leftovers(tmp_path)
    document_files.write_error_note(book, "it is broken.", None, redo=pdf.retry_command(book))
    assert note.exists() and note.name.endswith(".ocrvl-error.txt")
    assert f"limit of {limit} bytes" in note.read_text("utf-8")
    assert images.name in (document_files.shortened_names(book) or "")


@pytest.mark.quick
def test_a_name_with_no_room_for_md_fails_clearly_naming_the_limit(tmp_path: Path) -> None:
    limit = name_max(tmp_path)
    scan = tmp_path / ("n" * limit)  # `ocrvl convert` takes any file; `.md` cannot be added
    scan.write_bytes(b"%PDF-1.4\n")
    with pytest.raises(NameTooLongError, match=f"allows {limit} bytes") as caught:
        write_document(scan, "x", MODEL, 1, pages(1))
    assert caught.value.permanent and "rename the PDF to a shorter name" in str(caught.value)
    assert sorted(os.listdir(tmp_path)) == [scan.name]


@pytest.mark.quick
def test_a_filesystem_that_misreports_its_name_limit_gets_a_clear_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NTFS under WSL2 counts characters, so it may hold more or fewer bytes than it says."""
    book = tmp_path / ("日本語" * 10 + ".pdf")  # 94 bytes
    book.write_bytes(b"%PDF-1.4\n")
    monkeypatch.setattr(document_files, "name_max", lambda folder: 40)
    write_document(book, "x", MODEL, 1, pages(1, image_every=1))
    md, images, _ = outputs_for(book)
    assert md.name == book.stem + ".md" and images.is_dir() and "~" in images.name

    def too_long(*args: object) -> None:
        raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG))

    monkeypatch.setattr(document_files.os, "replace", too_long)
    with pytest.raises(NameTooLongError, match="name is too long") as caught:
        write_document(book, "y", MODEL, 1, pages(1))
    assert caught.value.permanent, "retrying cannot make a name fit"
    assert "rename the PDF to a shorter name" in str(caught.value)


@pytest.mark.quick
def test_a_gigantic_page_is_rendered_within_the_pixel_budget(tmp_path: Path) -> None:
    poster = make_gigantic_page_pdf(tmp_path / "poster.pdf")
    budget = 25_000_000
    assert pdf.render_scale(14400, 14400, 2.0, budget) < 2.0
    image = pdf.render_page(poster, 0, 2.0, budget)
    assert image.shape[0] * image.shape[1] <= budget
    assert image.shape[0] > 4000, "scaled down further than needed"


@pytest.mark.quick
def test_an_unreadable_file_is_a_permanent_input_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EACCES cannot be produced as root, so `open` is made to raise it."""
    locked = make_pdf(tmp_path / "locked.pdf", 1)
    deny_reading(monkeypatch, locked)
    for read in (pdf.file_identity, pdf.page_count):
        with pytest.raises(InputFileError, match="permission denied") as caught:
            read(locked)
        assert caught.value.permanent and "chmod u+r" in str(caught.value)

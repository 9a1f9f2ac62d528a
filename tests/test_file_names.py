"""Any name the filesystem allows: bytes that are not UTF-8, names near the length limit.

Old Windows shares and zip files leave names such as b"\\xff\\xfebook.pdf"; Python hands
them over as surrogate escapes, which SQLite, journald and text files refuse. Such a PDF
must convert like any other, with outputs of the same raw stem, and be shown escaped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from ocrvl_daemon.files.names import fit_name, name_max, shell_quote, shown
from ocrvl_daemon.output.document_files import outputs_for
from testkit.documents import make_encrypted_pdf, make_pdf
from testkit.harness import FakeServerProcess, free_port, wait_until
from testkit.runner import DaemonProcess, managed_fake_server, run_ocrvl, write_config

ODD = b"\xff\xfebook.pdf"


def named(folder: Path, raw: bytes) -> Path:
    """The path of a file named by these raw bytes in `folder`."""
    return folder / os.fsdecode(raw)


def long_stem(size: int, char: str = "Ä") -> str:
    """A stem of exactly `size` bytes, of two-byte characters (so a cut could split one)."""
    return char * (size // 2) + "x" * (size % 2)


def pdf_at(path: Path, pages: int, seed: int) -> Path:
    """A PDF renamed to `path` (Pillow cannot write a name that is not UTF-8 itself)."""
    source = make_pdf(path.parent.parent / "src" / f"{seed}.pdf", pages, seed=seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.rename(source, path)
    return path


def listing(folder: Path) -> set[bytes]:
    """The raw names in `folder`."""
    return set(os.listdir(os.fsencode(folder)))


@pytest.mark.quick
def test_shown_escapes_only_bytes_that_are_not_utf8() -> None:
    assert shown(named(Path("/in"), ODD)) == "/in/\\xff\\xfebook.pdf"
    assert shown("/in/Ünïcödé – 日本語.pdf") == "/in/Ünïcödé – 日本語.pdf"


@pytest.mark.parametrize("raw", [ODD, b"it's \"q\" \\ $x.pdf", b"line\nbreak.pdf",
                                 "日本語 ß.pdf".encode()])
def test_a_quoted_name_is_the_same_bytes_in_bash(raw: bytes) -> None:
    quoted = shell_quote(os.fsdecode(raw))
    assert "\n" not in quoted, "a suggested command must fit on one log line"
    out = subprocess.run(["bash", "-c", f"printf %s {quoted}"], capture_output=True,
                         check=True).stdout
    assert out == raw, f"bash reads {quoted} as {out!r}, not {raw!r}"


@pytest.mark.quick
def test_a_name_too_long_for_a_companion_is_shortened_the_same_way_every_time() -> None:
    stem = long_stem(251)
    name = fit_name(stem, "_images", 255)
    assert name == fit_name(stem, "_images", 255)
    assert len(name.encode()) <= 255 and name.endswith("_images") and "~" in name
    assert stem.startswith(name.split("~")[0]), "the shortened name no longer starts as the PDF"
    assert fit_name(stem[:-2] + "Ö", "_images", 255) != name, "two long names collide"
    assert fit_name("book", "_images", 255) == "book_images"


@pytest.mark.slow
def test_convert_writes_odd_and_long_names_next_to_the_pdf(tmp_path: Path,
                                                           fake_server: FakeServerProcess):
    odd = pdf_at(named(tmp_path / "in", ODD), 2, seed=1)
    limit = name_max(odd.parent)
    long = pdf_at(odd.parent / (long_stem(limit - 4) + ".pdf"), 1, seed=2)
    no_room = pdf_at(odd.parent / ("n" * limit), 1, seed=3)  # `<name>.md` cannot exist
    config = write_config(tmp_path / "config.yaml")
    result = run_ocrvl("convert", "--config", config, "--server-url", fake_server.api_url,
                       odd, long)
    assert result.returncode == 0, result.stderr
    names = listing(odd.parent)
    assert b"\xff\xfebook.md" in names, f"the Markdown lost the PDF's raw name: {names}"
    assert os.fsencode(long.with_suffix(".md").name) in names
    assert "\\xff\\xfebook.pdf: done" in result.stderr, result.stderr
    result = run_ocrvl("convert", "--config", config, "--server-url", fake_server.api_url,
                       no_room)
    assert result.returncode == 1, result.stderr
    assert f"allows {limit} bytes in a file name" in result.stderr, result.stderr
    assert "rename the PDF to a shorter name" in result.stderr, result.stderr
    note = outputs_for(no_room)[2]
    assert note.exists() and "shorter name" in note.read_text("utf-8")


@pytest.mark.slow
def test_the_daemon_converts_odd_and_long_names_and_shows_them_escaped(tmp_path: Path):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    config = write_config(
        tmp_path / "config.yaml",
        inbox={"paths": [str(inbox)], "stable_seconds": 0.3, "poll_interval": 0.2},
        pipeline={"use_layout_detection": False, "adaptive_concurrency": False},
        server=managed_fake_server(free_port()),
    )
    limit = name_max(inbox)
    odd = named(inbox, ODD)
    long = inbox / (long_stem(limit - 4) + ".pdf")
    odd_locked = named(inbox, b"\xfflocked.pdf")
    long_locked = inbox / (long_stem(limit - 4, "Ö") + ".pdf")
    after = inbox / "after.pdf"
    two_lines = inbox / "two\nlines.pdf"

    def status() -> dict[str, dict]:
        result = run_ocrvl("status", "--json", "--config", config, timeout=60)
        assert result.returncode == 0, result.stderr
        return {d["path"]: d for d in json.loads(result.stdout)["documents"]}

    with DaemonProcess(config) as daemon:
        daemon.wait_ready()
        pdf_at(odd, 2, seed=1)
        pdf_at(long, 1, seed=2)
        pdf_at(two_lines, 1, seed=4)
        for locked in (odd_locked, long_locked):
            os.rename(make_encrypted_pdf(tmp_path / "src" / "locked.pdf"), locked)
        wait_until(lambda: {b"\xff\xfebook.md", os.fsencode(long.with_suffix(".md").name)}
                   <= listing(inbox), 120, what="the odd and the long name to be converted")
        pdf_at(after, 1, seed=3)
        wait_until(after.with_suffix(".md").exists, 60,
                   what="the next plain file to be converted after them")
        docs = wait_until(lambda: len(s := status()) == 6 and all(
            d["state"] in ("done", "failed") for d in s.values()) and s, 60,
            what="every document to be settled")
        assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log()

        shown_odd = f"{inbox}/\\xff\\xfebook.pdf"
        assert docs[shown_odd]["state"] == "done", docs
        assert docs[str(long)]["state"] == "done", docs
        assert f"limit of {limit} bytes" in docs[str(long)]["names_shortened"]
        failed = docs[f"{inbox}/\\xfflocked.pdf"]
        assert failed["state"] == "failed" and "encrypted" in failed["error"]
        note = outputs_for(odd_locked)[2]
        assert os.fsencode(note.name) == b"\xfflocked.ocrvl-error.txt"
        text = note.read_text("utf-8")  # escaped: valid UTF-8
        assert "\\xfflocked.pdf" in text and re.search(r"ocrvl retry .*\$'", text), text
        long_note = outputs_for(long_locked)[2]
        assert long_note.name != long_locked.stem + ".ocrvl-error.txt"
        assert "too long" in long_note.read_text("utf-8"), "the note does not say its name is short"

        retried = run_ocrvl("retry", "--config", config, odd_locked, timeout=60)
        assert retried.returncode == 0, retried.stderr
        assert "\\xfflocked.pdf again" in retried.stderr, retried.stderr
        text = run_ocrvl("status", "--config", config, timeout=60).stdout
        assert shown_odd in text and "reason: " in text and "the name is too long" in text, text
        assert "\\xff\\xfebook.pdf: done" in daemon.log(), daemon.log()
        log_lines = daemon.log().splitlines()
        assert "two\\nlines.pdf: 1 page queued" in daemon.log(), daemon.log()
        assert "two\\nlines.pdf: done, 1 page -> two\\nlines.md" in daemon.log(), daemon.log()
        assert not [line for line in log_lines if line.startswith("lines.")], (
            f"a name holding a line break split a log line:\n{daemon.log()}")
        assert "Traceback" not in daemon.log() and "Logging error" not in daemon.log()
    assert daemon.proc.returncode == 0, daemon.log()


def test_a_name_that_fits_the_markdown_but_not_the_json_fails_for_good_naming_the_json(
    tmp_path: Path, fake_server: FakeServerProcess
):
    limit = name_max(tmp_path)
    pdf = make_pdf(tmp_path / (long_stem(limit - 4) + ".pdf"), 1)  # `.md` fits, `.json` not
    config = write_config(tmp_path / "config.yaml", output={"formats": ["markdown", "json"]})
    result = run_ocrvl("convert", "--config", config, "--server-url", fake_server.api_url, pdf,
                       timeout=120)
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert f".json would be {limit + 1} bytes long" in result.stderr, result.stderr
    assert f"at most {limit - 5} bytes before .pdf" in result.stderr, result.stderr
    assert "retrying in" not in result.stderr, result.stderr
    assert not pdf.with_suffix(".md").exists(), "the Markdown was written without its JSON"

"""output.dir: results in a folder of their own, mirroring the inbox's sub-folders, with every
rule of writing next to the PDF (never replace a file ocrvl did not write, error notes,
resume) holding there too."""

from __future__ import annotations

import re
import shutil
import sqlite3
from pathlib import Path

import pytest

from ocrvl_daemon.config.file import validate_config
from ocrvl_daemon.errors import ConfigError
from ocrvl_daemon.output.document_files import OutputPlace, outputs_for, read_header
from testkit.documents import make_html_as_pdf, make_pdf
from testkit.harness import free_port, wait_until
from testkit.runner import (
    DaemonProcess,
    managed_fake_server,
    run_ocrvl,
    write_config,
)


def files_in(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.quick
def test_outputs_mirror_the_sub_folder_below_the_inbox_that_holds_the_pdf(tmp_path):
    inbox, out = tmp_path / "inbox", tmp_path / "out"
    one = OutputPlace(out, (inbox,))
    assert outputs_for(inbox / "a" / "b" / "book.pdf", one) == (
        out / "a" / "b" / "book.md", out / "a" / "b" / "book_images",
        out / "a" / "b" / "book.ocrvl-error.txt")
    assert outputs_for(tmp_path / "elsewhere" / "book.pdf", one)[0] == out / "book.md", \
        "a PDF outside every inbox goes to output.dir itself"
    two = OutputPlace(out, (tmp_path / "scans", tmp_path / "mail"))
    assert outputs_for(tmp_path / "mail" / "x" / "b.pdf", two)[0] == out / "mail" / "x" / "b.md"
    nested = OutputPlace(out, (inbox, inbox / "deep"))
    assert outputs_for(inbox / "deep" / "c.pdf", nested)[0] == out / "deep" / "c.md"
    assert outputs_for(inbox / "d.pdf")[0] == inbox / "d.md", "the default moved"


@pytest.mark.quick
def test_output_dir_that_cannot_be_used_is_refused_at_load_naming_the_key(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError) as err:
        validate_config({"output": {"dir": str(a_file / "sub")}})
    assert "output.dir" in str(err.value) and "is not a folder" in str(err.value)
    assert validate_config({"output": {"dir": str(tmp_path / "new" / "deeper")}}).output.dir \
        == tmp_path / "new" / "deeper", "a folder that can be created is fine"
    with pytest.raises(ConfigError) as err:
        validate_config({"output": {"dir": str(tmp_path / "o")},
                         "inbox": {"paths": [str(tmp_path / "a" / "in"),
                                             str(tmp_path / "b" / "in")]}})
    assert "inbox.paths" in str(err.value) and "rename one" in str(err.value)


@pytest.mark.slow
def test_convert_writes_to_output_dir_and_keeps_its_rules_there(tmp_path, fake_server):
    out = tmp_path / "results"
    source = tmp_path / "source"
    book = make_pdf(source / "book.pdf", 3)
    theirs = make_pdf(source / "theirs.pdf", 1, seed=2)
    broken = make_html_as_pdf(source / "broken.pdf")
    out.mkdir()
    (out / "theirs.md").write_text("my notes\n", encoding="utf-8")
    told = tmp_path / "hook.txt"
    config = write_config(tmp_path / "config.yaml",
                          output={"dir": str(out), "formats": ["markdown", "json"]},
                          hooks={"on_done": ["sh", "-c", f'echo "{{md}}" >> {told}']})
    result = run_ocrvl("convert", "--config", config, "--server-url", fake_server.api_url,
                       book, theirs, broken)
    assert result.returncode == 1, result.stderr
    assert read_header(out / "book.md")["pages"] == "3", "book.md was not written to output.dir"
    assert (out / "book.json").is_file(), "book.json was not written to output.dir"
    assert (out / "theirs.md").read_text("utf-8") == "my notes\n", \
        "a Markdown file ocrvl did not write was replaced"
    assert "not written by ocrvl" in (out / "theirs.ocrvl-error.txt").read_text("utf-8")
    assert "HTML page" in (out / "broken.ocrvl-error.txt").read_text("utf-8")
    assert files_in(source) == {"book.pdf", "theirs.pdf", "broken.pdf"}, \
        "something was written next to the PDFs"
    assert not [n for n in files_in(out) if "ocrvl-tmp" in n], "temporary files left behind"
    assert told.read_text("utf-8") == f"{out / 'book.md'}\n", "{md} is not where it was written"


@pytest.mark.slow
def test_daemon_mirrors_sub_folders_into_output_dir_and_resumes_there_after_a_kill(
        tmp_path: Path):
    inbox, out = tmp_path / "inbox", tmp_path / "out"
    inbox.mkdir()
    requests = tmp_path / "requests.jsonl"
    config = write_config(
        tmp_path / "config.yaml",
        inbox={"paths": [str(inbox)], "stable_seconds": 0.3, "poll_interval": 0.2},
        pipeline={"adaptive_concurrency": False, "max_concurrency": 4},
        server=managed_fake_server(free_port(), "--request-log", str(requests),
                                   "--step-t0-ms", "25"),
        output={"dir": str(out)},
    )
    pages = 24
    reference = make_pdf(tmp_path / "reference" / "book.pdf", pages, seed=9)
    book = inbox / "papers" / "2026" / "book.pdf"
    book.parent.mkdir(parents=True)

    def checkpointed() -> int:
        db = tmp_path / "state" / "jobs.sqlite"
        if not db.exists():
            return 0
        with sqlite3.connect(db, timeout=10) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM pages").fetchone()[0])

    daemon = DaemonProcess(config).start()
    try:
        daemon.wait_ready()
        shutil.copyfile(reference, book)
        wait_until(lambda: checkpointed() >= 8, 90, what="8 pages checkpointed")
        daemon.kill()
        assert not (out / "papers" / "2026" / "book.md").exists(), "finished too early to test"
        daemon.start()
        md = out / "papers" / "2026" / "book.md"
        wait_until(md.exists, 120, what="the book to be finished after the restart")
    finally:
        daemon.terminate()
    assert "resuming with" in daemon.log(), "the restarted daemon started the book over"
    marks = re.findall(r"<!-- page (\d+) -->", md.read_text("utf-8"))
    assert marks == [str(n) for n in range(1, pages + 1)], "pages missing or out of order"
    assert read_header(md)["source"] == "book.pdf"
    assert files_in(inbox) == {"papers", "papers/2026", "papers/2026/book.pdf"}, \
        "something was written into the inbox"
    sent = len(requests.read_text("utf-8").splitlines())
    assert sent < 2 * pages, f"{sent} requests for {pages} pages: the resume redid done pages"


def test_convert_refuses_two_pdfs_that_would_share_one_output(tmp_path):
    out = tmp_path / "out"
    first = make_pdf(tmp_path / "a" / "book.pdf", 1)
    second = make_pdf(tmp_path / "b" / "book.pdf", 1)
    config = write_config(tmp_path / "config.yaml", output={"dir": str(out)})
    # No server answers there: only the refusal of the second PDF matters here.
    result = run_ocrvl("convert", "--config", config, "--server-url",
                       f"http://127.0.0.1:{free_port()}/v1", first, second, timeout=120)
    assert result.returncode == 1
    assert f"{second} would be written to {out / 'book.md'}, like {first}" in result.stderr, \
        result.stderr

"""`ocrvl convert`: the real PaddleOCR-VL pipeline (layout off) against the fake server."""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import time
from pathlib import Path

import pytest

from ocrvl_daemon.config.file import load_config
from ocrvl_daemon.config.model import PipelineConfig
from ocrvl_daemon.config.models import MAX_IMAGE_ASPECT, MAX_IMAGE_PIXELS
from ocrvl_daemon.errors import ExitCode
from ocrvl_daemon.output.document_files import read_header
from ocrvl_daemon.server.launchers import vllm_serve_command
from testkit.documents import (
    make_blank_pages_pdf,
    make_damaged_page_pdf,
    make_empty_pdf,
    make_encrypted_pdf,
    make_pdf,
    page_width,
    sent_width,
)
from testkit.fake_server.answers import ENGINE_ERROR
from testkit.harness import FakeServerProcess, free_port, read_only_folder, start_fake_server
from testkit.plain_server import plain_openai_server
from testkit.runner import (
    broken_paddleocr,
    managed_fake_server,
    run_ocrvl,
    write_config,
)


def page_widths(markdown: str) -> list[int]:
    """The image widths the fake server saw, in the order the pages appear."""
    return [int(w) for w in re.findall(r"fake-ocr OCR (\d+)x\d+", markdown)]


def convert(tmp_path: Path, server: FakeServerProcess, *pdfs: Path):
    config = write_config(tmp_path / "config.yaml")
    return run_ocrvl("convert", "--config", config, "--server-url", server.api_url, *pdfs)


def test_multi_page_book_comes_out_with_every_page_in_order(tmp_path, fake_server):
    book = make_pdf(tmp_path / "book.pdf", 7)
    result = convert(tmp_path, fake_server, book)
    assert result.returncode == 0, result.stderr
    markdown = (tmp_path / "book.md").read_text(encoding="utf-8")
    assert page_widths(markdown) == [sent_width(i) for i in range(7)], (
        "pages are missing or out of order"
    )
    assert [int(n) for n in re.findall(r"<!-- page (\d+) -->", markdown)] == list(range(1, 8))
    assert re.findall(r'<a id="page-(\d+)"></a>', markdown) == [str(n) for n in range(1, 8)], (
        "a page cannot be jumped to")
    assert read_header(tmp_path / "book.md")["model"] == "PaddleOCR-VL-1.6-0.9B"
    leftovers = [p.name for p in tmp_path.iterdir() if "ocrvl-tmp" in p.name]
    assert not leftovers, f"temporary files left behind: {leftovers}"
    assert "\x1b[" not in result.stderr, "colour escape codes would garble the journal"
    assert "ccache" not in result.stderr and "Creating model" not in result.stderr, (
        "library noise from the engine worker reaches the log"
    )


def test_whole_pages_reach_the_server_at_the_models_input_size(tmp_path, fake_server):
    """With layout detection off the server would shrink a scale-2 page to the model's input
    size anyway; ocrvl renders it at that size (a fraction of the pixels to render, encode and
    decode), the page's shape kept."""
    book = make_pdf(tmp_path / "book.pdf", 3, height=792)  # 1.3-1.4 MP at scale 2
    result = convert(tmp_path, fake_server, book)
    assert result.returncode == 0, result.stderr
    markdown = (tmp_path / "book.md").read_text(encoding="utf-8")
    sizes = [(int(w), int(h)) for w, h in re.findall(r"fake-ocr OCR (\d+)x(\d+)", markdown)]
    assert len(sizes) == 3, markdown
    for page, (w, h) in enumerate(sizes):
        assert 0.98 * MAX_IMAGE_PIXELS <= w * h <= MAX_IMAGE_PIXELS, (
            f"page {page + 1} was sent at {w}x{h}, not at the model's input size "
            f"({MAX_IMAGE_PIXELS} pixels)"
        )
        assert abs(w / h - page_width(page) / 792) < 0.01, f"page {page + 1} lost its shape"


def test_with_layout_detection_on_pages_keep_their_full_scale_for_the_blocks():
    assert PipelineConfig(use_layout_detection=True).page_pixel_limit == 25_000_000
    assert PipelineConfig(use_layout_detection=False).page_pixel_limit == MAX_IMAGE_PIXELS
    smaller = PipelineConfig(use_layout_detection=False, max_page_pixels=500_000)
    assert smaller.page_pixel_limit == 500_000, "max_page_pixels stopped being a limit"


def test_a_strip_of_a_page_beyond_the_models_aspect_limit_is_padded_not_lost(tmp_path,
                                                                             fake_server):
    strip = make_blank_pages_pdf(tmp_path / "strip.pdf", 1, 2000, 8)  # 250:1 rendered
    result = convert(tmp_path, fake_server, strip)
    assert result.returncode == 0, result.stderr[-3000:]
    markdown = (tmp_path / "strip.md").read_text(encoding="utf-8")
    sizes = [(int(w), int(h)) for w, h in re.findall(r"fake-ocr OCR (\d+)x(\d+)", markdown)]
    assert len(sizes) == 1, f"the page did not come back:\n{markdown}"
    (w, h), = sizes
    assert w / h <= MAX_IMAGE_ASPECT and w >= 4000, (
        f"the page went as {w}x{h}: beyond the {MAX_IMAGE_ASPECT}:1 the server accepts, or "
        "shrunk instead of padded")


NAMES = ["my book.pdf", "Ünïcödé ßuch – 日本語.pdf", 'it\'s "quoted".pdf']


@pytest.mark.parametrize("name", NAMES)
def test_file_names_with_spaces_quotes_and_non_ascii(tmp_path, fake_server, name):
    pdf = make_pdf(tmp_path / name, 2)
    result = convert(tmp_path, fake_server, pdf)
    assert result.returncode == 0, result.stderr
    assert len(page_widths(pdf.with_suffix(".md").read_text(encoding="utf-8"))) == 2


def test_markdown_not_written_by_ocrvl_is_never_overwritten(tmp_path, fake_server):
    pdf = make_pdf(tmp_path / "notes.pdf", 1)
    mine = tmp_path / "notes.md"
    mine.write_text("my own notes\n", encoding="utf-8")
    result = convert(tmp_path, fake_server, pdf)
    assert result.returncode == 1
    assert mine.read_text(encoding="utf-8") == "my own notes\n", "the user's file was replaced"
    assert "was not written by ocrvl" in result.stderr and "notes.md" in result.stderr


def test_the_command_a_convert_note_advises_works_when_pasted(tmp_path, fake_server):
    pdf = make_pdf(tmp_path / "notes.pdf", 1)
    mine = tmp_path / "notes.md"
    mine.write_text("my own notes\n", encoding="utf-8")
    assert convert(tmp_path, fake_server, pdf).returncode == 1
    note = (tmp_path / "notes.ocrvl-error.txt").read_text(encoding="utf-8")
    advice = re.search(r"After fixing it, run: (.+)", note)
    assert advice, f"the note names no command:\n{note}"
    command = shlex.split(advice[1])
    assert command[:2] == ["ocrvl", "convert"], (
        f"a note written by `ocrvl convert` must not send the user to the daemon:\n{note}"
    )
    refused = run_ocrvl("retry", "--config", tmp_path / "config.yaml", pdf)
    assert "ocrvl convert" in refused.stderr, "retry does not say how to redo a converted file"

    mine.rename(tmp_path / "my-notes.md")  # the fix the note asks for
    result = run_ocrvl(*command[1:])
    assert result.returncode == 0, result.stderr
    assert read_header(pdf.with_suffix(".md")) is not None
    assert not (tmp_path / "notes.ocrvl-error.txt").exists()


def test_convert_pages_redoes_only_those_pages(tmp_path):
    requests = tmp_path / "requests.jsonl"
    pdf = make_pdf(tmp_path / "book.pdf", 3)
    with start_fake_server(free_port(), "--request-log", str(requests)) as server:
        assert convert(tmp_path, server, pdf).returncode == 0
        assert convert(tmp_path, server, pdf).returncode == 0
        assert len(requests.read_text().splitlines()) == 3, "a converted book was redone"
        result = run_ocrvl("convert", "--config", tmp_path / "config.yaml", "--server-url",
                           server.api_url, "--pages", "2", pdf)
        assert result.returncode == 0, result.stderr
    assert len(requests.read_text().splitlines()) == 4, "--pages 2 did not redo exactly page 2"
    markdown = pdf.with_suffix(".md").read_text(encoding="utf-8")
    assert page_widths(markdown) == [sent_width(i) for i in range(3)]


def test_our_own_markdown_is_replaced_when_the_pdf_changes(tmp_path, fake_server):
    pdf = make_pdf(tmp_path / "doc.pdf", 2)
    assert convert(tmp_path, fake_server, pdf).returncode == 0
    make_pdf(pdf, 3, seed=1)
    result = convert(tmp_path, fake_server, pdf)
    assert result.returncode == 0, result.stderr
    assert len(page_widths(pdf.with_suffix(".md").read_text(encoding="utf-8"))) == 3


def test_each_bad_file_gets_one_clear_line_and_the_good_one_still_converts(tmp_path, fake_server):
    good = make_pdf(tmp_path / "good.pdf", 1)
    not_pdf = tmp_path / "junk.pdf"
    not_pdf.write_bytes(b"\x00\x01 random bytes")
    encrypted = make_encrypted_pdf(tmp_path / "locked.pdf")
    empty = make_empty_pdf(tmp_path / "empty.pdf")
    missing = tmp_path / "missing.pdf"
    result = convert(tmp_path, fake_server, good, not_pdf, encrypted, empty, missing)
    assert result.returncode == 4, "every file that failed is a bad input file: exit code 4"
    assert (tmp_path / "good.md").exists(), "one bad file stopped the good one"
    errors = [
        line
        for line in result.stderr.splitlines()
        if " ERROR " in line and "ocrvl_daemon.commands.convert" in line
    ]
    assert len(errors) == 4, result.stderr
    text = "\n".join(errors)
    assert "junk.pdf is not a PDF" in text
    assert "locked.pdf is encrypted with a password" in text
    assert "empty.pdf is damaged beyond repair or has no pages" in text
    assert "missing.pdf does not exist" in text
    for bad in (not_pdf, encrypted, empty):
        assert not bad.with_suffix(".md").exists()


def test_a_damaged_page_becomes_a_placeholder_at_once_and_the_rest_still_converts(
    tmp_path, fake_server
):
    book = make_damaged_page_pdf(tmp_path / "book.pdf")
    result = convert(tmp_path, fake_server, book)
    assert result.returncode == 0, result.stderr
    markdown = (tmp_path / "book.md").read_text(encoding="utf-8")
    assert page_widths(markdown) == [sent_width(0), sent_width(2)], (
        "the pages around the damaged one are missing"
    )
    assert "*[ocrvl: page 2 is damaged in the PDF and cannot be rendered" in markdown
    assert "qpdf" in markdown, "the placeholder does not say how to repair the file"
    assert "failed (attempt" not in result.stderr, "a damaged page was tried again"
    assert "ocrvl retry" not in markdown, "retrying cannot help a damaged page"


def test_unreachable_server_names_the_url_and_how_to_start_it(tmp_path):
    pdf = make_pdf(tmp_path / "book.pdf", 1)
    config = write_config(tmp_path / "config.yaml")
    url = "http://127.0.0.1:9/v1"
    result = run_ocrvl("convert", "--config", config, "--server-url", url, pdf)
    assert result.returncode == 5, "a server problem is exit code 5"
    assert f"Cannot reach the model server at {url}" in result.stderr
    serve = vllm_serve_command(load_config(config)[0], port=9)
    assert serve in result.stderr, "the hint is not the line the managed launcher would run"
    assert not (tmp_path / "book.md").exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_pipeline_that_cannot_start_ends_the_run_with_the_fix_instead_of_waiting(
    tmp_path, fake_server, workers
):
    pdf = make_pdf(tmp_path / "book.pdf", 1)
    config = write_config(tmp_path / "config.yaml", pipeline={"use_layout_detection": False,
                                                              "workers": workers})
    env = broken_paddleocr(tmp_path / "shadow")
    result = run_ocrvl("convert", "--config", config, "--server-url", fake_server.api_url, pdf,
                       timeout=120, **env)
    assert result.returncode == ExitCode.DEPENDENCY, (
        "a pipeline missing a package must exit as a missing dependency (6)")
    reason = ("The recognition pipeline could not start: ModuleNotFoundError: No module named "
              "'paddlex'. Fix: reinstall ocrvl with its extras")
    assert reason in result.stderr, f"the reason or its fix is missing:\n{result.stderr}"
    assert f"failed start {2 * workers}; giving up" in result.stderr, (
        f"`ocrvl convert` with {workers} engine worker(s) should give up after one retry of "
        f"each:\n{result.stderr}"
    )
    assert pdf.exists() and not (tmp_path / "book.md").exists()


def test_server_serving_another_model_is_reported(tmp_path, fake_server):
    pdf = make_pdf(tmp_path / "book.pdf", 1)
    config = write_config(tmp_path / "config.yaml", model={"name": "PaddleOCR-VL-0.9B"})
    result = run_ocrvl("convert", "--config", config, "--server-url", fake_server.api_url, pdf)
    assert result.returncode == 5, "a server problem is exit code 5"
    assert "PaddleOCR-VL-0.9B" in result.stderr
    assert not (tmp_path / "book.md").exists()


def test_without_server_url_a_managed_server_is_started_and_stopped(tmp_path):
    port = free_port()
    log = tmp_path / "requests.jsonl"
    config = write_config(tmp_path / "config.yaml",
                          server=managed_fake_server(port, "--request-log", str(log)))
    pdf = make_pdf(tmp_path / "book.pdf", 3)
    result = run_ocrvl("convert", "--config", config, pdf)
    assert result.returncode == 0, result.stderr
    assert len(page_widths((tmp_path / "book.md").read_text("utf-8"))) == 3
    assert len(log.read_text().splitlines()) == 3, "the managed server did not do the work"
    assert "server process group" in result.stderr and "ended" in result.stderr
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "the managed server outlived convert"


@pytest.mark.parametrize("lists_models", [True, False], ids=["models", "no-models"])
def test_any_openai_compatible_server_without_health_endpoint_works(tmp_path, lists_models):
    """Only chat completions are needed: /health, /metrics and even /v1/models may be missing."""
    pdf = make_pdf(tmp_path / "book.pdf", 2)
    config = write_config(tmp_path / "config.yaml")
    with plain_openai_server(lists_models=lists_models) as url:
        result = run_ocrvl("convert", "--config", config, "--server-url", url, pdf)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "book.md").read_text("utf-8").count("plain server saw OCR:") == 2


def test_a_server_serving_the_model_under_its_hugging_face_name_is_usable(tmp_path):
    """`vllm serve PaddlePaddle/PaddleOCR-VL-1.6` without --served-model-name: the error says
    which key to set, and with it set the book converts."""
    pdf = make_pdf(tmp_path / "book.pdf", 2)
    with plain_openai_server(model="PaddlePaddle/PaddleOCR-VL-1.6") as url:
        refused = run_ocrvl("convert", "--config", write_config(tmp_path / "config.yaml"),
                            "--server-url", url, pdf)
        assert refused.returncode != 0
        assert "set model.served_name: PaddlePaddle/PaddleOCR-VL-1.6" in refused.stderr, (
            "the error does not name the key that fixes it:\n" + refused.stderr[-2000:])
        assert "Cannot reach" not in refused.stderr, "a server that answers was called unreachable"

        config = write_config(tmp_path / "served.yaml",
                              model={"served_name": "PaddlePaddle/PaddleOCR-VL-1.6"})
        result = run_ocrvl("convert", "--config", config, "--server-url", url, pdf)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "book.md").read_text("utf-8").count("plain server saw OCR:") == 2


def test_each_page_is_sent_to_the_server_exactly_once(tmp_path):
    log = tmp_path / "requests.jsonl"
    with start_fake_server(free_port(), "--step-t0-ms", "20", "--request-log", str(log)) as srv:
        book = make_pdf(tmp_path / "book.pdf", 24)
        config = write_config(tmp_path / "config.yaml",
                              pipeline={"max_concurrency": 8, "adaptive_concurrency": False})
        result = run_ocrvl("convert", "--config", config, "--server-url", srv.api_url, book)
    assert result.returncode == 0, result.stderr
    assert "failed (attempt" not in result.stderr, "pages failed while requests started together"
    digests = [json.loads(line)["digest"] for line in log.read_text().splitlines()]
    assert len(digests) == 24 and len(set(digests)) == 24, "some pages were recognised twice"


def test_a_server_answering_every_page_with_http_500_ends_the_run_with_its_message(tmp_path):
    """/health stays 200 while every completion fails: each page is tried a bounded number of
    times with a pause between tries, then the run ends with the server's own words."""
    log = tmp_path / "requests.jsonl"
    with start_fake_server(free_port(), "--error-500-rate", "1",
                           "--request-log", str(log)) as srv:
        book = make_pdf(tmp_path / "book.pdf", 2)
        config = write_config(tmp_path / "config.yaml", pipeline={"page_retries": 2})
        try:
            result = run_ocrvl("convert", "--config", config, "--server-url", srv.api_url,
                               book, timeout=120)
        except subprocess.TimeoutExpired:
            sent = len(log.read_text().splitlines())
            pytest.fail(f"ocrvl convert was still resending pages after 120 s ({sent} requests "
                        "answered with HTTP 500)")
    assert result.returncode == 5, f"a server that fails every request is exit code 5:\n" \
                                   f"{result.stderr[-3000:]}"
    assert ENGINE_ERROR in result.stderr, (
        f"the server's own message is not shown:\n{result.stderr[-3000:]}")
    assert "HTTP 500" in result.stderr, f"the status code is not shown:\n{result.stderr[-3000:]}"
    assert not (tmp_path / "book.md").exists()


def test_a_read_only_output_folder_ends_the_run_after_a_few_tries_with_the_cause(
        tmp_path, fake_server):
    inbox = tmp_path / "inbox"
    book = make_pdf(inbox / "book.pdf", 1)
    config = write_config(tmp_path / "config.yaml")
    with read_only_folder(inbox):
        started = time.monotonic()
        try:
            result = run_ocrvl("convert", "--config", config, "--server-url",
                               fake_server.api_url, book, timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("ocrvl convert was still retrying a read-only output folder after 60 s")
        took = time.monotonic() - started
    assert result.returncode == 1, result.stderr[-3000:]
    assert "no write permission" in result.stderr or "read-only" in result.stderr, (
        f"the cause is not named:\n{result.stderr[-3000:]}")
    assert "failed (3 attempts)" in result.stderr, (
        f"the run does not say it tried more than once:\n{result.stderr[-3000:]}")
    assert took < 45, f"ocrvl convert took {took:.0f} s to give up"


def test_a_file_given_twice_is_converted_and_counted_once(tmp_path: Path,
                                                          fake_server: FakeServerProcess):
    pdf = make_pdf(tmp_path / "book.pdf", 1)
    config = write_config(tmp_path / "config.yaml")
    result = run_ocrvl("convert", "--config", config, "--server-url", fake_server.api_url,
                       pdf, tmp_path / "." / "book.pdf")
    assert result.returncode == 0, result.stderr
    assert "1 of 1 converted" in result.stderr, result.stderr


def test_a_one_page_document_is_one_page_queued(tmp_path: Path, fake_server: FakeServerProcess):
    pdf = make_pdf(tmp_path / "letter.pdf", 1)
    config = write_config(tmp_path / "config.yaml")
    result = run_ocrvl("convert", "--config", config, "--server-url", fake_server.api_url, pdf)
    assert result.returncode == 0, result.stderr
    assert "letter.pdf: 1 page queued" in result.stderr, result.stderr

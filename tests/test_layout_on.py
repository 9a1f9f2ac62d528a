"""`ocrvl convert` with layout detection on, the users' default, end to end and offline.

The layout model is the stand-in of `testkit.layout_model` (PP-DocLayoutV3's architecture
with random weights, reduced with `--small`; its blocks follow the page's ink), loaded by
PaddleX's static-graph engine on the CPU (`pipeline.layout_device: cpu`) from
`$PADDLE_PDX_CACHE_HOME`. The pages of `make_layout_pdf` hold a title or heading, paragraphs,
a ruled table, a centred formula, a figure and a page number: 8 blocks, 7 of them sent to the
server, each with the prompt of its kind.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from ocrvl_daemon.observe.daemon_state import read_runtime_file
from testkit.documents import BLOCKS_PAGE_LINES, LAYOUT_PAGE, make_blocks_pdf, make_layout_pdf
from testkit.harness import free_port, start_fake_server, wait_until
from testkit.runner import DaemonProcess, run_ocrvl, write_config

PAGES = 2
# Pages of the book whose layout keeps one worker busy for long enough to be measured.
LIMIT_PAGES = 40
# Each page's blocks in reading order (page 1 opens with the book's title).
FIRST_PAGE = ["doc_title", "text", "table", "display_formula", "image", "paragraph_title",
              "text", "number"]
LATER_PAGE = ["paragraph_title", *FIRST_PAGE[1:]]
PROMPTS = {"OCR:": 5, "Table Recognition:": 1, "Formula Recognition:": 1}  # a page's requests
FIGURE_LEFT, FIGURE_RIGHT = 300, 924  # where make_layout_pdf draws the figure (page pixels)




@pytest.fixture(scope="module")
def converted(layout_cache: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[Path, list[dict[str, Any]]]:
    """A layout-on conversion of a 2-page book: its folder and the server's request log."""
    folder = tmp_path_factory.mktemp("layout-on")
    book = make_layout_pdf(folder / "book.pdf", PAGES)
    log = folder / "requests.jsonl"
    # The CPU, named: the stand-in is written for the paddle engine, whatever this machine has.
    config = write_config(folder / "config.yaml",
                          pipeline={"use_layout_detection": True, "layout_device": "cpu"},
                          output={"formats": ["markdown", "json"]})
    with start_fake_server(free_port(), "--request-log", str(log)) as server:
        result = run_ocrvl("convert", "--config", config, "--server-url", server.api_url, book,
                           PADDLE_PDX_CACHE_HOME=str(layout_cache))
        assert result.returncode == 0, result.stderr[-3000:]
    assert "layout: PP-DocLayoutV3 on cpu (paddle_static" in result.stderr, (
        "the worker did not say which layout engine and device it chose:\n"
        + result.stderr[-3000:])
    requests = [json.loads(line) for line in log.read_text().splitlines()]
    return folder, requests


def pages_json(folder: Path) -> list[dict[str, Any]]:
    return list(json.loads((folder / "book.json").read_text(encoding="utf-8"))["pages"])


@pytest.mark.slow
def test_every_block_is_one_request_with_its_kinds_prompt(
        converted: tuple[Path, list[dict[str, Any]]]) -> None:
    folder, requests = converted
    assert len(requests) == PAGES * sum(PROMPTS.values()), (
        f"{len(requests)} requests for {PAGES} pages: not one per block (1 per page means "
        "layout detection fell back to whole pages)")
    assert Counter(r["prompt"] for r in requests) == {k: PAGES * n for k, n in PROMPTS.items()}
    width, height = LAYOUT_PAGE
    assert all(r["status"] == 200 and r["w"] * r["h"] < width * height / 4 for r in requests), \
        "a request carried a whole page, not a block"
    markdown = (folder / "book.md").read_text(encoding="utf-8")
    # Page numbers are read, and left out of the Markdown (PaddleX's markdown_ignore_labels).
    assert markdown.count("fake-ocr ") == len(requests) - PAGES, \
        "an answer is missing from the Markdown"


@pytest.mark.slow
def test_blocks_come_out_in_reading_order_with_their_boxes(
        converted: tuple[Path, list[dict[str, Any]]]) -> None:
    folder, _ = converted
    pages = pages_json(folder)
    assert len(pages) == PAGES
    for page in pages:
        labels = [b["label"] for b in page["blocks"]]
        assert labels in (FIRST_PAGE, LATER_PAGE), f"page {page['number']}: {labels}"
        assert page["size"] == list(LAYOUT_PAGE)
        tops = [b["bbox"][1] for b in page["blocks"]]
        assert tops == sorted(tops), "blocks are not in reading order"
        (figure,) = [b for b in page["blocks"] if b["label"] == "image"]
        left, _, right, _ = figure["bbox"]
        assert abs(left - FIGURE_LEFT) <= 16 and abs(right - FIGURE_RIGHT) <= 16, figure
    markdown = (folder / "book.md").read_text(encoding="utf-8")
    first = markdown.split("<!-- page 2 -->")[0]
    order = [first.index(s) for s in ("fake-ocr OCR", "fake-ocr Table", "fake-ocr Formula",
                                      "book_images/")]
    assert order == sorted(order), "the page's Markdown is not in reading order"


@pytest.mark.slow
def test_pages_read_with_layout_detection_are_not_reused_once_it_is_switched_off(
        converted: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    folder = converted[0]
    shutil.copy(folder / "book.pdf", tmp_path / "book.pdf")
    shutil.copy(folder / "book.md", tmp_path / "book.md")
    shutil.copytree(folder / "state", tmp_path / "state")  # the layout-on pages checkpointed
    config = write_config(tmp_path / "config.yaml")  # layout detection off
    log = tmp_path / "requests.jsonl"
    with start_fake_server(free_port(), "--request-log", str(log)) as server:
        kept = run_ocrvl("convert", "--config", config, "--server-url", server.api_url,
                         tmp_path / "book.pdf")
        assert kept.returncode == 0 and "already converted" in kept.stderr, (
            "a finished book was converted again because layout detection was switched:\n"
            + kept.stderr[-2000:])
        (tmp_path / "book.md").unlink()
        redone = run_ocrvl("convert", "--config", config, "--server-url", server.api_url,
                           tmp_path / "book.pdf")
    assert redone.returncode == 0, redone.stderr[-3000:]
    sent = [json.loads(line) for line in log.read_text().splitlines()]
    markdown = (tmp_path / "book.md").read_text(encoding="utf-8")
    assert len(sent) == PAGES and markdown.count("fake-ocr ") == PAGES, (
        f"{len(sent)} requests, {markdown.count('fake-ocr ')} answers in the Markdown for "
        f"{PAGES} pages: the pages read block by block with layout detection on were reused "
        "instead of sending each page whole")


@pytest.mark.slow
def test_figures_are_cut_out_and_linked_relative_to_the_markdown(
        converted: tuple[Path, list[dict[str, Any]]]) -> None:
    folder, _ = converted
    markdown = (folder / "book.md").read_text(encoding="utf-8")
    links = re.findall(r'src="([^"]+)"|\]\(([^)]+)\)', markdown)
    paths = [a or b for a, b in links]
    assert len(paths) == PAGES, markdown
    for path in paths:
        assert path.startswith("book_images/") and (folder / path).is_file(), path
    assert sorted(p["images"] for p in pages_json(folder)) == [[p] for p in sorted(paths)]


@pytest.mark.slow
def test_each_page_is_laid_out_from_its_own_image(
        converted: tuple[Path, list[dict[str, Any]]]) -> None:
    folder, _ = converted
    labels = [[b["label"] for b in page["blocks"]] for page in pages_json(folder)]
    assert labels == [FIRST_PAGE] + [LATER_PAGE] * (PAGES - 1)
    blank = re.findall(r"fake-ocr \w+ \d+x\d+ mean=255 ", (folder / "book.md").read_text())
    assert not blank, "blocks cut from where their page has no ink"


@pytest.mark.slow
def test_a_block_the_server_fails_is_sent_again_alone_the_pages_other_answers_kept(
        layout_cache: Path, tmp_path: Path) -> None:
    """A server failing every 6th request fails a block of each 7-block page; each page's
    next try asks for that block alone. (Were a page sent again whole, every try of 7
    requests would hold a 6th, and the book would fail once its retries ran out.)"""
    book = make_layout_pdf(tmp_path / "book.pdf", PAGES)
    log = tmp_path / "requests.jsonl"
    config = write_config(tmp_path / "config.yaml",
                          pipeline={"use_layout_detection": True, "layout_device": "cpu"})
    with start_fake_server(free_port(), "--request-log", str(log),
                           "--error-500-every", "6") as server:
        result = run_ocrvl("convert", "--config", config, "--server-url", server.api_url, book,
                           PADDLE_PDX_CACHE_HOME=str(layout_cache))
    assert result.returncode == 0, ("a book whose server failed some of its blocks did not "
                                    "convert:\n" + result.stderr[-3000:])
    requests = [json.loads(line) for line in log.read_text().splitlines()]
    failed = [r for r in requests if r["status"] == 500]
    first_pass = PAGES * sum(PROMPTS.values())
    assert len(failed) == first_pass // 6, failed
    assert len(requests) == first_pass + len(failed), (
        f"{len(requests)} requests: a page was sent again whole after one block failed")
    assert {r["digest"] for r in requests[first_pass:]} == {r["digest"] for r in failed}, (
        "the blocks sent again are not the ones that failed")
    assert "answers that came back kept" in result.stderr, result.stderr[-3000:]
    markdown = (tmp_path / "book.md").read_text(encoding="utf-8")
    assert markdown.count("fake-ocr ") == first_pass - PAGES, "an answer is missing"
    assert "could not be recognised" not in markdown


@pytest.mark.slow
def test_a_block_the_server_refuses_on_every_try_leaves_its_page_without_it_flagged(
        layout_cache: Path, tmp_path: Path) -> None:
    """Each page's formula is refused (HTTP 400) on every try: the page keeps its other
    answers, the formula's place is empty, and the page is flagged bad with the block and the
    server's words, not replaced by a placeholder."""
    book = make_layout_pdf(tmp_path / "book.pdf", PAGES)
    log = tmp_path / "requests.jsonl"
    config = write_config(tmp_path / "config.yaml",
                          pipeline={"use_layout_detection": True, "layout_device": "cpu",
                                    "page_retries": 1},
                          output={"formats": ["markdown", "json"]})
    with start_fake_server(free_port(), "--request-log", str(log),
                           "--refused-prompts", "Formula Recognition:") as server:
        result = run_ocrvl("convert", "--config", config, "--server-url", server.api_url, book,
                           PADDLE_PDX_CACHE_HOME=str(layout_cache))
    requests = [json.loads(line) for line in log.read_text().splitlines()]
    formulas = [r for r in requests if r["prompt"].startswith("Formula")]
    assert all(r["status"] == 400 for r in formulas) and len(formulas) == PAGES * 2, (
        f"{len(formulas)} formula requests: each page's should be tried twice "
        "(page_retries 1), then left")
    assert len(requests) - len(formulas) == PAGES * (sum(PROMPTS.values()) - 1), (
        "the blocks the server answered were asked for again")
    markdown = (tmp_path / "book.md").read_text(encoding="utf-8")
    assert "could not be recognised" not in markdown, "a page became a placeholder"
    assert markdown.count("fake-ocr ") == PAGES * (sum(PROMPTS.values()) - 2), (
        "an answer the server gave is missing from the Markdown")
    notes = re.findall(r"page \d is bad: [^\n]*", markdown)
    assert len(notes) == PAGES, markdown
    assert all("the server refused block 4 of 7 on every try (HTTP 400: " in n and
               "--refused-prompts" in n and "kept without it" in n for n in notes), notes
    assert [p["verdict"] for p in pages_json(tmp_path)] == ["bad"] * PAGES
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_status_names_the_layout_model_on_the_cpu_as_the_limit_and_what_would_help(
        layout_daemon: tuple[Path, Path, DaemonProcess], tmp_path: Path) -> None:
    """One worker lays out pages on the CPU while the fake server answers at once: layout
    sets the pace, and `ocrvl status` says so and points at the GPU engine."""
    inbox, config, _ = layout_daemon
    make_layout_pdf(inbox / "book.pdf", LIMIT_PAGES)
    # Polled: on a 2-core machine rendering takes cores from the layout model at times,
    # and a layout call under way counts once its page is back.
    stages = wait_until(lambda: (s := status_stages(config))["limit"] == "layout" and s,
                        180, interval=0.5, what="`status --json` to name layout the limit")
    text = wait_until(
        lambda: "(limit)" in (t := run_ocrvl("status", "--config", config).stdout) and t,
        60, interval=0.5, what="`ocrvl status` to name the limit")
    assert read_runtime_file(tmp_path / "state")["current_doc"] == "book.pdf", (
        "the book was done before status was read: make it longer")
    assert stages["layout_device"] == "cpu", stages
    assert stages["layout"] > stages["server"] and stages["rendering"] < stages["layout"]
    assert "pipeline.layout_device: gpu" in stages["advice"], stages
    line = next(line for line in text.splitlines() if line.startswith("stages: "))
    assert re.match(r"stages: layout \d+% \(limit\) · ", line), text
    assert "pipeline.layout_device: gpu" in text, text


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    best = now = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


@pytest.mark.slow
def test_a_looping_block_of_a_30_block_page_is_sent_again_alone_within_the_bound(
        layout_cache: Path, tmp_path: Path) -> None:
    """Pages of 30 blocks, one block of page 2 looping until it gets a repetition penalty:
    the server sees that one block once more, not the page's 30; the page keeps the other
    29 answers and is not flagged; and the server never holds more requests than the bound."""
    pages, bound = 2, 8
    book = make_blocks_pdf(tmp_path / "book.pdf", pages, marked=frozenset({(1, 6)}))
    log = tmp_path / "requests.jsonl"
    config = write_config(tmp_path / "config.yaml",
                          pipeline={"use_layout_detection": True, "layout_device": "cpu",
                                    "max_concurrency": bound, "min_concurrency": bound},
                          output={"formats": ["markdown", "json"]})
    with start_fake_server(free_port(), "--loop-marked", "--output-tokens", "fixed:40",
                           "--request-log", str(log)) as server:
        result = run_ocrvl("convert", "--config", config, "--server-url", server.api_url, book,
                           PADDLE_PDX_CACHE_HOME=str(layout_cache))
    assert result.returncode == 0, result.stderr[-3000:]
    requests = [json.loads(line) for line in log.read_text().splitlines()]
    blocks = pages * BLOCKS_PAGE_LINES
    asked = Counter(r["digest"] for r in requests)
    assert len(asked) == blocks, f"{len(asked)} blocks asked, not {blocks}: the layout differs"
    (marked,) = {r["digest"] for r in requests if r["marked"]}
    assert len(requests) == blocks + 1 and asked[marked] == 2, (
        f"{len(requests)} requests for {blocks} blocks and one loop: the looping block was "
        "not sent again alone")
    retry = [r for r in requests if r["digest"] == marked][-1]
    assert retry["repetition_penalty"] == 1.05 and retry["max_tokens"] == 4096, retry
    assert "block 7 of 30 cut off; it loops" in result.stderr, result.stderr[-3000:]
    data = json.loads((tmp_path / "book.json").read_text(encoding="utf-8"))
    assert [p["verdict"] for p in data["pages"]] == ["ok"] * pages
    assert [len(p["blocks"]) for p in data["pages"]] == [BLOCKS_PAGE_LINES] * pages
    assert "ocrvl:" not in (tmp_path / "book.md").read_text(encoding="utf-8")
    overlap = max_overlap([(r["t"], r["done"]) for r in requests])
    assert overlap <= bound, f"{overlap} requests at the server at once with a bound of {bound}"


def status_stages(config: Path) -> dict[str, Any]:
    """`ocrvl status --json`'s stages of the running daemon."""
    result = run_ocrvl("status", "--json", "--config", config)
    return dict(json.loads(result.stdout)["daemon"]["stages"])

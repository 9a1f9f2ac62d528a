"""Page quality: every page gets a verdict, bad pages are retried in the way that fits
their failure (within the document's redo cap), and pages that stay bad are flagged in the
Markdown, `ocrvl status`, the journal fields and the JSON output.

The end-to-end test runs the daemon against the fake server, which loops on chosen pages
unless the request carries a loop-breaking parameter, cuts others off and answers some with
nothing (pages are chosen by image width: page i of `make_pdf` is sent_width(i) pixels).
"""

from __future__ import annotations

import collections
import json
import logging
from importlib import resources
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import yaml

from ocrvl_daemon.core.actions import SendAgain
from ocrvl_daemon.core.document import Document
from ocrvl_daemon.core.messages import PageResult
from ocrvl_daemon.core.quality import LOOP_PENALTIES, REDO_SHARE, KeptBecause, Redo, Verdict, assess
from ocrvl_daemon.core.redo import WHOLE_PAGE, CutBlock, Later
from ocrvl_daemon.errors import NotOursError
from ocrvl_daemon.output.document_files import Page, write_document
from ocrvl_daemon.worker.request_images import has_ink
from testkit.core import document
from testkit.documents import make_pdf, sent_width
from testkit.harness import wait_until
from testkit.inbox_daemon import Setup, wait_for_markdown
from testkit.runner import run_ocrvl
from testkit.stand_in_worker import Policy

SCHEMA = json.loads(resources.files("ocrvl_daemon").joinpath("data/document.schema.json")
                    .read_text("utf-8"))
LOOPED = "fake-ocr OCR 800x1200 " + "the value of the row is " * 80


@pytest.mark.quick
def test_each_failure_gets_its_verdict_and_reason():
    text = "A page of ordinary text, with numbers 12 and 1900, as OCR reads it."
    assert assess(text, "stop", 40, False, True).verdict is Verdict.OK
    assert assess(LOOPED, "length", 256, True, True).reason == "repetition"
    assert assess(LOOPED, "length", 256, True, True).verdict is Verdict.BAD
    cut = assess(text, "length", 256, False, True)
    assert (cut.verdict, cut.reason) == (Verdict.SUSPECT, "cut-off")
    empty = assess("", "stop", 0, False, True)
    assert (empty.verdict, empty.reason, empty.empty_with_ink) == (Verdict.BAD, "empty", True)
    assert assess("", "stop", 0, False, False).verdict is Verdict.OK, "a blank page is fine"
    garbage = assess(text + "\ufffd\x07" * 20, "stop", 60, False, True)
    assert (garbage.verdict, garbage.reason) == (Verdict.BAD, "garbage")
    assert assess(text + "\ufffd", "stop", 41, False, True).reason == "garbage"
    assert assess(LOOPED, "length", 256, True, True).repetition >= 8


@pytest.mark.quick
def test_ink_on_a_page_is_any_dark_line_in_any_colour_and_not_scanner_noise():
    """An empty answer counts as a failure only on a page with ink: what has ink is decided
    on the rendered image, from its darkest channel."""
    page = np.full((1584, 1120, 3), 255, np.uint8)  # A4 rendered at 2x
    assert not has_ink(page), "a white page has no ink"
    noise = page.copy()
    noise.reshape(-1, 3)[::4000] = 0  # 1 dark pixel in 4000: dust
    assert not has_ink(noise), "scanner dust is not ink"
    line = page.copy()
    line[800:803, 100:1000] = 40  # one line of small text's worth of dark pixels
    assert has_ink(line), "a line of text is ink"
    blue = page.copy()
    blue[800:803, 100:1000, 2] = 0  # dark in one channel only (BGR red)
    assert has_ink(blue), "a coloured line is ink too"


def counting(doc: Document, page: int, tokens: int) -> None:
    """`page` of `doc` came back having generated `tokens` (the budget counts them)."""
    doc.apply(SendAgain(page, ledger=doc.ledger(page).counted(tokens)), 0.0)


def deciding(doc: Document, page: int, cut_at: int, ceiling: int, looping: bool,
             others_out: bool = False) -> object:
    """The redo decision for `page` of `doc`, cut off at `cut_at`, applied to the document."""
    choice, ledger = doc.ledger(page).decide(cut_at, ceiling, looping, others_out)
    doc.apply(SendAgain(page, ledger=ledger), 0.0)
    return choice


@pytest.mark.quick
def test_a_loop_is_sent_again_twice_with_a_penalty_then_kept():
    doc = document(1, 20)
    for page in range(20):
        counting(doc, page, 4096)
    assert deciding(doc, 0, 4096, 8192, looping=True) == Redo(4096, LOOP_PENALTIES[0])
    counting(doc, 0, 4096)
    assert deciding(doc, 0, 4096, 8192, looping=True) == Redo(4096, LOOP_PENALTIES[1])
    counting(doc, 0, 4096)
    assert deciding(doc, 0, 4096, 8192, looping=True) is KeptBecause.LOOP
    # A page that stopped looping but is cut off gets its one redo with more tokens, and
    # keeps the penalty that ended the loop.
    assert deciding(doc, 1, 4096, 8192, looping=True) == Redo(4096, LOOP_PENALTIES[0])
    counting(doc, 1, 4096)
    assert deciding(doc, 1, 4096, 8192, looping=False) == Redo(8192, LOOP_PENALTIES[0])
    # Redos under way count with what they are expected to generate, not what they ask for:
    # the growing one at least its cut-off 4096, a loop broken a page's usual 4096.
    assert deciding(doc, 2, 4096, 8192, looping=True) == Redo(4096, LOOP_PENALTIES[0])
    # Generated (3 * 4096) and expected (2 * 4096) reach the cap, a quarter of 20 * 4096.
    assert doc.budget.extra + 2 * 4096 == doc.budget.cap == int(REDO_SHARE * 20 * 4096)
    assert deciding(doc, 3, 4096, 8192, looping=True) is KeptBecause.BUDGET, (
        "a redo started although the document's redos took their share")


@pytest.mark.quick
def test_a_loop_stopped_early_is_not_refused_its_retry_before_its_document_is_in():
    """A loop stopped as soon as it shows comes back while its document's other pages are
    still out: a retry the budget refuses then waits, and is decided again once they are in,
    when the budget knows the whole first pass."""
    doc = document(1, 20)
    counting(doc, 0, 400)  # two loops stopped early, the first answers of a 20-page book
    counting(doc, 1, 400)
    assert deciding(doc, 0, 4096, 8192, looping=True, others_out=True) == Redo(
        4096, LOOP_PENALTIES[0])
    assert deciding(doc, 1, 4096, 8192, looping=True, others_out=True) is (
        Later.AFTER_FIRST_PASS), "the budget of two answers refused a loop its first retry"
    for page in range(2, 20):
        counting(doc, page, 700)
    released, ledger = doc.ledger(1).release((CutBlock(WHOLE_PAGE, 4096, True),), 8192, False)
    assert released == Redo(4096, LOOP_PENALTIES[0])
    doc.apply(SendAgain(1, ledger=ledger), 0.0)
    # With the whole document in, what the budget refuses stays refused.
    assert deciding(doc, 2, 4096, 8192, looping=False) == Redo(8192)
    assert deciding(doc, 3, 4096, 8192, looping=False) is KeptBecause.BUDGET


@pytest.mark.quick
def test_a_page_that_stays_bad_keeps_its_best_answer(tmp_path: Path):
    policy = Policy(tmp_path)
    book = make_pdf(policy.folder / "book.pdf", 1)
    job = policy.queue(book)
    policy.send()
    first = PageResult(job.id, 0, markdown="the start of the page, then it loops " + "x y " * 50,
                       truncated_at=4096, looping=True, tokens=4096, has_ink=True)
    policy.deliver(first)
    policy.send()
    # The loop-breaking try comes back empty, which gets its one more try, empty again:
    # worse than the loop, so the loop's text stays.
    policy.deliver(PageResult(job.id, 0, tokens=0, has_ink=True, finish_reason="stop"))
    assert policy.send() == [(job.id, 0)], "the empty answer was not sent again once"
    policy.deliver(PageResult(job.id, 0, tokens=0, has_ink=True, finish_reason="stop"))
    md = book.with_suffix(".md").read_text("utf-8")
    assert "the start of the page" in md, "the better of the two answers was not kept"
    assert "<!-- ocrvl: page 1 bad: repetition -->" in md
    policy.store.close()


@pytest.mark.quick
def test_a_redo_that_fails_keeps_the_first_answer(tmp_path: Path):
    policy = Policy(tmp_path, page_retries=3)
    book = make_pdf(policy.folder / "book.pdf", 1)
    job = policy.queue(book)
    policy.send()
    policy.deliver(PageResult(job.id, 0, markdown="a long table, cut off", truncated_at=256,
                              tokens=256, token_ceiling=4096, has_ink=True))
    assert policy.send() == [(job.id, 0)], "the cut-off page was not redone"
    policy.answer(job, 0, error="BadRequestError: maximum context length is 1792 tokens")
    md = book.with_suffix(".md").read_text("utf-8")
    assert "a long table, cut off" in md, "a failed redo threw the page's first answer away"
    assert "<!-- ocrvl: page 1 suspect: cut-off -->" in md and "sending it again failed" in md
    policy.store.close()


@pytest.mark.quick
def test_a_flagged_page_carries_its_verdict_in_the_journal_fields(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    policy = Policy(tmp_path)
    book = make_pdf(policy.folder / "book.pdf", 1)
    job = policy.queue(book)
    policy.send()
    with caplog.at_level(logging.INFO, logger="ocrvl_daemon.engine"):
        policy.deliver(PageResult(job.id, 0, has_ink=True, finish_reason="stop"))
    fields = [(getattr(r, "OCRVL_PAGE", None), getattr(r, "OCRVL_VERDICT", None),
               getattr(r, "OCRVL_REASON", None)) for r in caplog.records]
    assert (1, "bad", "empty") in fields, f"no journal fields for the bad page: {fields}"
    assert any(getattr(r, "OCRVL_FLAGGED", None) == "1" for r in caplog.records), (
        "the document's done line carries no OCRVL_FLAGGED field")
    policy.store.close()


def requests_by_width(setup: Setup) -> dict[int, list[tuple[int, float | None]]]:
    """(max_tokens, repetition_penalty) of every request, by image width."""
    asked: dict[int, list[tuple[int, float | None]]] = collections.defaultdict(list)
    for line in setup.requests.read_text("utf-8").splitlines():
        r = json.loads(line)
        asked[r["w"]].append((r["max_tokens"], r.get("repetition_penalty")))
    return asked


@pytest.mark.slow
def test_loops_cut_offs_and_empty_pages_are_retried_to_fit_and_flagged_everywhere(
        tmp_path: Path):
    pages = 24
    loop, cut, empty = pages - 3, pages - 2, pages - 1  # the last pages: the cap is known
    width = {p: sent_width(p) for p in range(pages)}
    setup = Setup(tmp_path, "--output-tokens", "fixed:200",
                  "--loop-widths", str(width[loop]), "--cut-widths", str(width[cut]),
                  "--empty-widths", str(width[empty]),
                  # one page at a time: each page's decision sees the tokens before it
                  max_concurrency=1, min_concurrency=1)
    data = yaml.safe_load(setup.config.read_text("utf-8"))
    data["model"] = {"max_new_tokens": 256}
    data["server"]["vllm_args"] = {"max-model-len": 16384}  # room for the redo
    data["output"] = {"formats": ["markdown", "json"]}
    setup.config.write_text(yaml.safe_dump(data), encoding="utf-8")
    book = make_pdf(setup.inbox / "book.pdf", pages)
    with setup.daemon() as daemon:
        daemon.wait_ready()
        wait_for_markdown(book)
        doc = wait_until(lambda: setup.status()["documents"][0], 30, what="status")
        asked = requests_by_width(setup)
        assert asked[width[loop]] == [(256, None), (256, LOOP_PENALTIES[0])], (
            f"the looping page was not sent again once with a repetition penalty: "
            f"{asked[width[loop]]}")
        assert asked[width[cut]] == [(256, None), (512, None)], (
            f"the cut-off page was not redone once with twice the tokens: {asked[width[cut]]}")
        assert asked[width[empty]] == [(256, None), (256, None)], (
            f"the empty page with ink was not sent again once as it was: {asked[width[empty]]}")
        assert all(asked[width[p]] == [(256, None)] for p in range(loop)), "a good page redone"
        md = book.with_suffix(".md").read_text("utf-8")
        blocks = md.split("<!-- page ")
        assert f"fake-ocr OCR {width[loop]}x" in blocks[loop + 1]
        assert "ocrvl:" not in blocks[loop + 1], "the page whose loop was broken is flagged"
        assert f"<!-- ocrvl: page {cut + 1} suspect: cut-off -->" in md
        assert f"<!-- ocrvl: page {empty + 1} bad: empty -->" in md
        first_pass = 200 * loop + 256 * 2 + 0
        assert doc["redo_tokens"] == 200 + 512 <= REDO_SHARE * first_pass, doc
        assert doc["suspect_pages"] == [cut + 1] and doc["bad_pages"] == [empty + 1], doc
        assert doc["flagged_pages"] == [cut + 1, empty + 1]
        assert doc["verdicts"] == {"ok": pages - 2, "suspect": 1, "bad": 1}, doc
        text = run_ocrvl("status", "--config", setup.config, timeout=60).stdout
        assert f"pages flagged: {cut + 1},{empty + 1} (bad: {empty + 1}; suspect: {cut + 1}; " \
               f"redo: ocrvl retry --config {setup.config} --flagged" in text, text

        document = json.loads(book.with_suffix(".json").read_text("utf-8"))
        jsonschema.validate(document, SCHEMA)
        assert [p["verdict"] for p in document["pages"]] == ["ok"] * (pages - 2) + [
            "suspect", "bad"]
        assert document["pages"][empty]["signals"]["empty_with_ink"] is True
        assert all(len(p["blocks"]) == 1 for p in document["pages"]), \
            "layout detection is off: one block per page"
        assert document["pages"][0]["size"][0] == width[0]

        result = run_ocrvl("retry", "--flagged", "--config", setup.config, timeout=60)
        assert result.returncode == 0, result.stderr
        before = sum(len(v) for v in asked.values())
        # Redone alone, the two pages' first pass is small: the cut-off page's redo takes the
        # budget, and the empty page gets no second try this time.
        wait_until(lambda: sum(len(v) for v in requests_by_width(setup).values()) >= before + 3,
                   60, what="the flagged pages to be sent again")
        again = requests_by_width(setup)
        assert [len(again[width[p]]) for p in (cut, empty)] == [4, 3], (
            "ocrvl retry --flagged did not redo exactly the flagged pages")
        assert all(len(again[width[p]]) == 1 for p in range(loop)), "retried a good page"


@pytest.mark.quick
def test_a_page_that_crashes_the_worker_is_found_and_only_it_counts_attempts(tmp_path: Path):
    policy = Policy(tmp_path, page_retries=3)
    pages, culprit = 64, 41
    book = make_pdf(policy.folder / "book.pdf", pages)
    job = policy.queue(book)
    policy.send()
    assert len(policy.worker.in_flight) == pages
    crashes = 0
    while in_flight := set(policy.worker.in_flight):
        if (job.id, culprit) in in_flight:  # the worker dies with every page it had
            crashes += 1
            policy.crash("engine worker exited (-11)")
        else:
            for _, page in sorted(in_flight):
                policy.answer(job, page)
        policy.send()
        assert crashes < 20, "the crashing page was never found"
    policy.tick()
    md = book.with_suffix(".md").read_text("utf-8")
    view = policy.view(book)
    assert view["failed_pages"] == [culprit + 1], (
        f"pages other than the one that crashes the worker became placeholders: {view}")
    assert md.count("text of page") == pages - 1, "an innocent page lost its text"
    # 64 in flight, then 16, 4, 1 at a time: 3 crashes to find it, then its 4 attempts.
    assert crashes == 3 + 4, f"{crashes} worker crashes"
    policy.store.close()


@pytest.mark.quick
def test_a_json_file_ocrvl_did_not_write_is_never_replaced(tmp_path: Path):
    book = make_pdf(tmp_path / "book.pdf", 1)
    book.with_suffix(".json").write_text('{"mine": true}\n')
    with pytest.raises(NotOursError, match="was not written by ocrvl"):
        write_document(book, "sha", "model", 1, [Page(0, "text")], json_output=True)
    assert book.with_suffix(".json").read_text() == '{"mine": true}\n'
    book.with_suffix(".json").unlink()
    write_document(book, "sha", "model", 1, [Page(0, "text")], json_output=True)
    document = json.loads(book.with_suffix(".json").read_text("utf-8"))
    jsonschema.validate(document, SCHEMA)
    assert document["pages"][0]["verdict"] == "unknown", "a page without a quality record"
    write_document(book, "sha", "model", 1, [Page(0, "again")], json_output=True)  # ours: replaced

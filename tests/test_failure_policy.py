"""Failure policy: what is retried by itself, what waits for the user, and what a page can sink.

The converter tests drive a `Converter` through its `tick()`, with a stand-in engine worker
whose pages are answered (or which crashes) by hand: that is the boundary where the engine
reports trouble, so every policy path can be driven exactly. The daemon tests at the end
check the token-limit handling end to end.
"""

from __future__ import annotations

import collections
import json
import logging
import shutil
import time
from pathlib import Path

import pytest
import yaml

from ocrvl_daemon.commands import retry, status
from ocrvl_daemon.core.backoff import Backoff
from ocrvl_daemon.core.job import Job, JobState
from ocrvl_daemon.core.messages import Failure, PageResult
from ocrvl_daemon.core.quality import looks_like_a_loop
from ocrvl_daemon.errors import InputFileError
from ocrvl_daemon.output import document_files
from ocrvl_daemon.storage.jobs import enqueue_file
from testkit.documents import deny_reading, make_pdf, make_random_bytes
from testkit.harness import read_only_folder, wait_until
from testkit.inbox_daemon import Setup, wait_for_markdown
from testkit.stand_in_worker import Policy


@pytest.fixture
def policy(tmp_path: Path):
    p = Policy(tmp_path, page_retries=2)
    yield p
    p.store.close()


def note_of(pdf: Path) -> str:
    return document_files.outputs_for(pdf)[2].read_text("utf-8")


def test_a_one_page_document_is_logged_as_one_page(policy: Policy,
                                                  caplog: pytest.LogCaptureFixture):
    letter = make_pdf(policy.folder / "letter.pdf", 1)
    job = policy.queue(letter)
    policy.send()
    with caplog.at_level(logging.INFO, logger="ocrvl_daemon.engine"):
        policy.answer(job, 0)
    assert "letter.pdf: done, 1 page -> letter.md" in caplog.text, caplog.text


def test_a_page_that_keeps_failing_becomes_a_placeholder_and_can_be_redone(policy: Policy):
    book = make_pdf(policy.folder / "book.pdf", 3)
    job = policy.queue(book)
    policy.send()
    policy.answer(job, 0)
    policy.answer(job, 2)
    for _ in range(3):  # page_retries=2: the third failure gives up
        policy.answer(job, 1, "BadRequestError: garbage")
        policy.send()
    md = book.with_suffix(".md").read_text("utf-8")
    assert "<!-- ocrvl: page 2 could not be recognised after 3 attempts" in md
    assert "*[ocrvl: page 2 could not be recognised" in md, (
        "the placeholder must be visible, not only a comment"
    )
    assert "text of page 3" in md, "the book stopped at the bad page"
    assert policy.view(book)["failed_pages"] == [2]

    retry.retry(policy.config, [book], failed=False, pages="2")
    policy.activate()
    assert policy.send() == [(job.id, 1)], "only the failed page may be redone"
    policy.answer(job, 1)
    md = book.with_suffix(".md").read_text("utf-8")
    assert "text of page 2" in md and "could not be recognised" not in md
    assert policy.view(book)["failed_pages"] == []


def test_fail_on_page_error_fails_the_document_until_retried(tmp_path: Path):
    policy = Policy(tmp_path, page_retries=0, fail_on_page_error=True)
    book = make_pdf(policy.folder / "book.pdf", 2)
    job = policy.queue(book)
    policy.send()
    policy.answer(job, 0)
    policy.answer(job, 1, "BadRequestError: garbage")
    failed = policy.job(job)
    assert failed is not None and failed.state is JobState.FAILED
    assert "page 2 could not be recognised" in (failed.last_error or "")
    assert "ocrvl retry --pages 2" in note_of(book)
    assert not book.with_suffix(".md").exists()
    policy.store.close()


@pytest.mark.parametrize("fail_on_page_error", [False, True])
def test_a_damaged_page_is_given_up_at_once_or_fails_the_document_if_asked(
    tmp_path: Path, fail_on_page_error: bool, caplog: pytest.LogCaptureFixture
):
    damaged = "page 2 is damaged in the PDF and cannot be rendered. Fix: repair the file"
    policy = Policy(tmp_path, page_retries=3, fail_on_page_error=fail_on_page_error)
    book = make_pdf(policy.folder / "book.pdf", 2)
    job = policy.queue(book)
    policy.send()
    policy.answer(job, 0)
    policy.answer(job, 1, damaged, kind=Failure.DAMAGED)
    assert policy.send() == [], "a damaged page was sent again"
    if fail_on_page_error:
        failed = policy.job(job)
        assert failed is not None and failed.state is JobState.FAILED
        assert "repair the file" in note_of(book) and "--pages" not in note_of(book)
    else:
        md = book.with_suffix(".md").read_text("utf-8")
        assert f"*[ocrvl: {damaged}]*" in md and "text of page 1" in md
        view = policy.view(book)
        assert view["damaged_pages"] == [2] and view["failed_pages"] == [], (
            "status must tell a damaged page from one that may succeed if tried again"
        )
        shown = status.render_status(policy.config, as_json=False)
        assert "pages damaged in the PDF: 2 (retrying cannot help: repair the file" in shown
        assert "--pages" not in shown, "status offered `ocrvl retry` for a damaged page"
        with caplog.at_level(logging.INFO, logger="ocrvl_daemon.commands.retry"):
            retry.retry(policy.config, [], failed=True, pages=None)
        assert "nothing to retry" in caplog.text, "`ocrvl retry --failed` said nothing"
        policy.activate()
        assert policy.send() == [], "`ocrvl retry --failed` sent a damaged page again"
    policy.store.close()


def test_a_page_that_kills_the_worker_every_time_does_not_loop_forever(policy: Policy):
    book = make_pdf(policy.folder / "book.pdf", 2)
    job = policy.queue(book)
    policy.send()
    policy.answer(job, 0)
    for _ in range(3):
        assert policy.worker.in_flight == {(job.id, 1)}
        policy.crash("engine worker exited (-11)")
        policy.send()
    policy.tick()
    assert "engine worker exited (-11)" in book.with_suffix(".md").read_text("utf-8")


def test_a_cut_off_page_is_kept_flagged_and_shown(policy: Policy):
    book = make_pdf(policy.folder / "table.pdf", 1)
    job = policy.queue(book)
    policy.send()
    policy.answer(job, 0, truncated_at=4096)
    md = book.with_suffix(".md").read_text("utf-8")
    assert "<!-- ocrvl: page 1 was cut off at 4096 tokens" in md and "text of page 1" in md
    assert "<!-- ocrvl: page 1 suspect: cut-off -->" in md
    view = policy.view(book)
    assert view["flagged_pages"] == view["suspect_pages"] == [1] and view["bad_pages"] == []
    assert "pages flagged: 1 (suspect: 1; redo: ocrvl retry --flagged" in status.render_status(
        policy.config, as_json=False)


@pytest.mark.parametrize("mode", ["managed", "external"])
def test_the_cut_off_note_names_the_max_model_len_the_user_can_change(tmp_path: Path, mode: str):
    server = {"mode": "external", "url": "http://127.0.0.1:9/v1"} if mode == "external" else {}
    policy = Policy(tmp_path, server=server)
    book = make_pdf(policy.folder / "table.pdf", 1)
    job = policy.queue(book)
    policy.send()
    policy.answer(job, 0, truncated_at=4096)  # the server allows no more (ceiling unknown: 0)
    md = book.with_suffix(".md").read_text("utf-8")
    if mode == "external":
        assert "server.vllm_args" not in md, "told to change a key that does nothing for an " \
            "external server"
        assert "Raise --max-model-len on the server you run, then: ocrvl retry" in md
    else:
        assert "Raise server.vllm_args.max-model-len, then: ocrvl retry" in md
    policy.store.close()


def test_a_loop_is_told_from_long_text_and_tables():
    prose = Path(__file__).parent.parent.joinpath("README.md").read_text("utf-8")
    table = "".join(f"| {1900 + i} | {i * 7919 % 10007} | {i * 31 % 97} |\n" for i in range(200))
    looped = "Chapter 3\n" + "the value of the item in the row is shown " * 100
    assert not looks_like_a_loop(prose) and not looks_like_a_loop(table)
    assert looks_like_a_loop(looped)


def test_a_full_disk_pauses_output_and_retries_by_itself(
        policy: Policy, monkeypatch: pytest.MonkeyPatch):
    policy.converter.documents.retry = Backoff(0.0, 0.0)
    usage = shutil.disk_usage(policy.folder)
    monkeypatch.setattr(document_files.shutil, "disk_usage", lambda _: usage._replace(free=1024))
    book = make_pdf(policy.folder / "book.pdf", 2)
    job = policy.queue(book)
    policy.send()
    policy.answer(job, 0)
    policy.answer(job, 1)
    waiting = policy.job(job)
    assert waiting is not None and waiting.state is JobState.QUEUED and waiting.attempts == 1
    assert "Output is paused" in (waiting.last_error or "")
    assert "tries again by itself" in note_of(book)
    assert not book.with_suffix(".md").exists()

    monkeypatch.undo()
    policy.activate()
    assert policy.send() == [], "checkpointed pages were recognised again"
    policy.tick()
    assert policy.job(job).state is JobState.DONE  # type: ignore[union-attr]
    assert book.with_suffix(".md").exists() and not document_files.outputs_for(book)[2].exists()


def test_transient_input_trouble_is_retried_and_vanished_files_are_dropped_or_gone(policy: Policy):
    gone = make_pdf(policy.folder / "gone.pdf", 1)
    enqueue_file(policy.store, gone, policy.config.recipe)
    gone.unlink()  # deleted while queued
    policy.activate()
    assert policy.store.job_for_path(gone) is None

    moving = make_pdf(policy.folder / "moving.pdf", 2)
    job = policy.queue(moving)
    policy.send()
    moving.unlink()  # deleted while converting: the engine reports an input error
    policy.answer(job, 0, "moving.pdf disappeared", kind=Failure.INPUT)
    dropped = policy.store.job_for_path(moving)
    assert dropped is not None and dropped.state is JobState.GONE, (
        "a PDF deleted while it converted is not shown as gone")
    assert "deleted while it was being converted" in (dropped.last_error or "")
    assert not document_files.outputs_for(moving)[2].exists(), "an error note was left beside it"

    touched = make_pdf(policy.folder / "touched.pdf", 1)
    job = policy.queue(touched)
    policy.send()
    policy.answer(job, 0, "touched.pdf changed while it was being converted.", kind=Failure.INPUT)
    again = policy.job(job)
    assert again is not None and again.state is JobState.QUEUED and again.not_before > time.time()


def test_permanent_input_failures_wait_until_the_file_changes(policy: Policy):
    junk = make_random_bytes(policy.folder / "junk.pdf")
    job = policy.queue(junk)
    failed = policy.job(job)
    assert failed is not None and failed.state is JobState.FAILED
    assert "is not a PDF" in note_of(junk) and "ocrvl retry" in note_of(junk)
    assert enqueue_file(policy.store, junk, policy.config.recipe).state is JobState.FAILED
    make_pdf(junk, 1)
    assert enqueue_file(policy.store, junk, policy.config.recipe).state is JobState.QUEUED


def test_an_unreadable_file_gets_a_failed_job_a_note_and_a_status_reason(
        policy: Policy, monkeypatch: pytest.MonkeyPatch):
    """Root reads everything, so `open` raises EACCES for this one file."""
    locked = make_pdf(policy.folder / "locked.pdf", 1)
    deny_reading(monkeypatch, locked)
    with pytest.raises(InputFileError):
        enqueue_file(policy.store, locked, policy.config.recipe)
    monkeypatch.undo()
    assert "permission denied" in policy.view(locked)["error"]
    assert "chmod u+r" in note_of(locked)
    # Once readable, `ocrvl retry` identifies it afresh and converts it.
    retry.retry(policy.config, [locked], failed=False, pages=None)
    policy.activate()
    assert [p for _, p in policy.send()] == [0]


# --- end to end: answers cut off at the token limit ----------------------------------------


def token_setup(tmp_path: Path, max_model_len: int, answer_tokens: int = 100,
                max_new_tokens: int = 64, *fake_args: str) -> Setup:
    """A daemon whose server answers `answer_tokens` tokens while `max_new_tokens` are asked."""
    setup = Setup(tmp_path, "--output-tokens", f"fixed:{answer_tokens}", *fake_args)
    data = yaml.safe_load(setup.config.read_text("utf-8"))
    data["model"] = {"max_new_tokens": max_new_tokens}
    data["server"]["vllm_args"] = {"max-model-len": max_model_len}
    setup.config.write_text(yaml.safe_dump(data), encoding="utf-8")
    return setup


def convert_one(setup: Setup, pages: int = 1) -> str:
    book = make_pdf(setup.inbox / "table.pdf", pages)
    with setup.daemon() as daemon:
        daemon.wait_ready()
        wait_for_markdown(book)
        return book.with_suffix(".md").read_text("utf-8")


def requests(setup: Setup) -> list[dict]:
    lines = setup.requests.read_text("utf-8").splitlines()
    return [json.loads(line) for line in lines if line]


def requested_tokens(setup: Setup) -> list[int]:
    return [r["max_tokens"] for r in requests(setup)]


@pytest.mark.slow
def test_a_cut_off_answer_is_redone_with_more_tokens_when_the_server_allows(tmp_path: Path):
    setup = token_setup(tmp_path, max_model_len=4096)
    md = convert_one(setup)
    assert requested_tokens(setup) == [64, 128]
    assert "cut off" not in md and "fake-ocr OCR" in md


@pytest.mark.slow
def test_a_cut_off_answer_is_kept_and_flagged_when_the_server_allows_no_more(tmp_path: Path):
    # 64 new tokens + the image and prompt budget: no room for more.
    setup = token_setup(tmp_path, max_model_len=1408)
    md = convert_one(setup)
    assert requested_tokens(setup) == [64]
    assert "<!-- ocrvl: page 1 was cut off at 64 tokens" in md and "fake-ocr OCR" in md
    doc = wait_until(lambda: setup.status()["documents"][0], 30, what="status")
    assert doc["flagged_pages"] == [1]


@pytest.mark.slow
def test_a_cut_off_page_is_redone_once_not_doubled_up_to_the_servers_limit(tmp_path: Path):
    setup = token_setup(tmp_path, max_model_len=16384, answer_tokens=5000)
    md = convert_one(setup)
    assert requested_tokens(setup) == [64, 128], "a cut-off page must be redone at most once"
    assert "page 1 was cut off at 128 tokens, also after a redo" in md
    assert "Raise model.max_new_tokens" in md


@pytest.mark.slow
def test_a_looping_answer_is_sent_again_with_a_penalty_not_more_tokens(tmp_path: Path):
    # --looping-answers: a loop that no penalty breaks; the document's cap allows one redo.
    setup = token_setup(tmp_path, 16384, 100, 256, "--looping-answers")
    md = convert_one(setup)
    asked = [(r["max_tokens"], r["repetition_penalty"]) for r in requests(setup)]
    assert asked == [(256, None), (256, 1.05)], (
        f"a looping page must be sent again with the same tokens and a penalty: {asked}")
    assert "<!-- ocrvl: page 1 bad: repetition -->" in md
    assert "page 1 was cut off at 256 tokens and not redone" in md
    doc = wait_until(lambda: setup.status()["documents"][0], 30, what="status")
    assert doc["flagged_pages"] == doc["bad_pages"] == [1] and doc["redo_tokens"] == 256


@pytest.mark.slow
def test_redoing_cut_off_pages_stays_within_a_quarter_of_the_documents_tokens(tmp_path: Path):
    pages = 8
    setup = token_setup(tmp_path, max_model_len=16384, answer_tokens=5000)
    md = convert_one(setup, pages)
    asked = collections.Counter((r["digest"], r["max_tokens"]) for r in requests(setup))
    first = [d for (d, tokens) in asked if tokens == 64]
    redone = [d for (d, tokens) in asked if tokens == 128]
    assert len(first) == pages and set(asked.values()) == {1}, f"a page was asked twice: {asked}"
    assert {tokens for _, tokens in asked} <= {64, 128}, f"more than one redo per page: {asked}"
    first_pass = 64 * pages
    # No redo starts once what redos generated and what those under way are expected to (the
    # 64 tokens each was cut off at) reach 25% of the first pass.
    assert len(redone) >= 1 and 64 * (len(redone) - 1) < first_pass // 4, (
        f"{len(redone)} redos of 128 tokens for a first pass of {first_pass} tokens")
    assert md.count("and not redone: redoing this document's bad pages took 25%") == \
        pages - len(redone)
    doc = wait_until(lambda: setup.status()["documents"][0], 30, what="status")
    assert doc["redo_tokens"] == 128 * len(redone)
    assert doc["flagged_pages"] == list(range(1, pages + 1))


@pytest.mark.parametrize("change", ["model", "layout detection"])
def test_a_reload_that_changes_how_pages_are_read_converts_that_way_from_the_first_page(
        policy: Policy, change: str):
    book = make_pdf(policy.folder / "book.pdf", 2)
    job = policy.queue(book)
    policy.send()
    policy.answer(job, 0)  # page 2 is still at the engine when the change comes
    config = policy.config
    if change == "model":
        reloaded = config.model_copy(
            update={"model": config.model.model_copy(update={"name": "PaddleOCR-VL-0.9B"})})
    else:
        reloaded = config.model_copy(update={
            "pipeline": config.pipeline.model_copy(update={"use_layout_detection": False})})
    policy.converter.reconfigure(reloaded)
    policy.tick()
    assert sorted(policy.send()) == [(job.id, 0), (job.id, 1)], (
        f"the pages read before the {change} changed were kept: a document must be read "
        "one way")
    policy.answer(job, 0)
    policy.answer(job, 1)
    header = document_files.read_header(book.with_suffix(".md"))
    assert header["model"] == reloaded.model.name, (
        f"the Markdown names {header['model']}, not the model the reload set: the next start "
        "would convert the file again")
    assert policy.job(job).model == reloaded.recipe.key  # type: ignore[union-attr]


def test_the_daemon_keeps_retrying_a_read_only_output_folder_and_status_says_so(
        tmp_path: Path):
    policy = Policy(tmp_path)
    book = make_pdf(policy.folder / "book.pdf", 1)
    with read_only_folder(policy.folder):
        job = policy.queue(book)
        waiting = policy.job(job)
        assert waiting is not None and waiting.state is JobState.QUEUED, (
            "the daemon gave up on a folder that may become writable")
        shown = status.render_status(policy.config, as_json=False)
    assert "no write permission" in shown and "retry in" in shown, (
        f"status does not say why the document waits and that it is retried:\n{shown}")
    policy.store.close()


LOOP_LIMIT = 4096
NORMAL_TOKENS = 700


def loops(policy: Policy, job: Job, page: int) -> None:
    """The page's answer repeats itself up to the token limit."""
    policy.deliver(PageResult(job.id, page, markdown="la " * 3000, truncated_at=LOOP_LIMIT,
                              looping=True, tokens=LOOP_LIMIT, finish_reason="length",
                              has_ink=True))


def reads_well(policy: Policy, job: Job, page: int) -> None:
    policy.deliver(PageResult(job.id, page, markdown=f"text of page {page + 1}",
                              tokens=NORMAL_TOKENS, finish_reason="stop", has_ink=True))


def empty(policy: Policy, job: Job, page: int) -> None:
    """Nothing comes back for a page with ink on it."""
    policy.deliver(PageResult(job.id, page, markdown="", tokens=0, finish_reason="stop",
                              has_ink=True))


def test_an_empty_answer_for_a_page_with_ink_is_sent_again_once(policy: Policy):
    book = make_pdf(policy.folder / "book.pdf", 20)
    job = policy.queue(book)
    policy.send()
    blank = [17, 18]  # the last pages: the redo budget (a share of the first pass) is known
    for page in range(20):
        (empty if page in blank else reads_well)(policy, job, page)
    assert sorted(p for _, p in policy.send()) == blank, (
        "an empty answer for a page with ink was kept without the one retry it gets")
    reads_well(policy, job, 17)  # the server's fluke: the retry reads well
    empty(policy, job, 18)  # empty again: kept, flagged, never a third time
    assert policy.send() == [], "an empty page was sent a third time"
    md = book.with_suffix(".md").read_text("utf-8")
    assert "text of page 18" in md and "page 18 bad" not in md, (
        "the retry's answer was not kept")
    assert "<!-- ocrvl: page 19 bad: empty -->" in md, "the page empty twice is not flagged"


def test_every_looping_page_gets_its_first_retry_within_the_redo_budget(policy: Policy):
    """20 pages of ~700 tokens, 3 of them loop to the 4,096-token limit at once: the budget
    (a quarter of what the first pass generated, ~6,000 tokens) counts what redos generate,
    so it has room for all three first retries, not one and a half."""
    book = make_pdf(policy.folder / "book.pdf", 20)
    job = policy.queue(book)
    policy.send()
    looping = [3, 9, 15]
    for page in range(20):
        (loops if page in looping else reads_well)(policy, job, page)
    assert sorted(p for _, p in policy.send()) == looping, (
        "a looping page was kept without the loop-breaking retry the budget has room for")
    for page in looping:
        reads_well(policy, job, page)
    md = book.with_suffix(".md").read_text("utf-8")
    assert "not redone" not in md and md.count("text of page") == 20


def test_no_page_gets_a_second_loop_retry_before_every_looping_page_had_its_first(
        policy: Policy):
    book = make_pdf(policy.folder / "book.pdf", 20)
    job = policy.queue(book)
    policy.send()
    for page in range(20):
        if page != 15:
            (loops if page == 3 else reads_well)(policy, job, page)
    assert [p for _, p in policy.send()] == [3]
    loops(policy, job, 3)  # its first retry loops again, while page 16 is still out
    assert policy.send() == [], "page 4 got a second retry before page 16 had its first"
    loops(policy, job, 15)
    assert [p for _, p in policy.send()] == [15], "page 16 did not get its first retry"
    reads_well(policy, job, 15)
    assert [p for _, p in policy.send()] == [3], (
        "page 4's second retry did not follow once every page had its first")

"""What becomes of each page result (`decide.decide`): one action, from plain values, with
nothing changed until it is applied (`Document.apply`, as the converter does)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ocrvl_daemon.core.actions import (
    Checkpoint,
    FailJob,
    Placeholder,
    SendAgain,
    Sent,
    TakenBack,
    Wake,
)
from ocrvl_daemon.core.decide import (
    REFUSING_PAGES,
    SERVER_ERROR_BACKOFF,
    Rules,
    decide,
    is_awaited,
    page_failed,
    release_held,
)
from ocrvl_daemon.core.document import Document
from ocrvl_daemon.core.messages import Failure, PageResult
from ocrvl_daemon.core.quality import LOOP_PENALTIES, Redo, Verdict
from ocrvl_daemon.errors import ExitCode, InputVanishedError, PagesFailedError
from testkit.core import URL, document, send_all

RULES = Rules(page_retries=2, fail_on_page_error=False, external_server=False, server_url=URL)


def sent_document(pages: int = 3) -> Document:
    doc = document(1, pages)
    send_all(doc)
    return doc


def answer(page: int, text: str = "some text", **fields: object) -> PageResult:
    return PageResult(1, page, markdown=text, url=URL, tokens=100, **fields)  # type: ignore[arg-type]


def failure(page: int, kind: Failure, error: str = "it broke") -> PageResult:
    return PageResult(1, page, error=error, error_kind=kind, url=URL)


@pytest.mark.quick
def test_a_good_answer_is_checkpointed_unflagged() -> None:
    doc = sent_document()
    action = decide(answer(0), doc, RULES)
    assert isinstance(action, Checkpoint) and action.page == 0 and action.note is None
    assert action.quality.verdict is Verdict.OK and action.answer.markdown == "some text"


@pytest.mark.quick
def test_deciding_changes_nothing_in_the_document() -> None:
    doc = sent_document()
    before = ([doc.page(p) for p in range(3)], doc.budget)
    decide(answer(0, truncated_at=4096, looping=True), doc, RULES)
    decide(failure(1, Failure.SERVER_ERROR), doc, RULES)
    assert ([doc.page(p) for p in range(3)], doc.budget) == before
    assert doc.redone_pages == 0


@pytest.mark.quick
def test_a_late_answer_from_an_endpoint_the_page_was_taken_from_is_not_awaited() -> None:
    doc = sent_document()
    assert is_awaited(answer(0), doc)
    doc.apply(TakenBack(0), 0.0)
    doc.apply(Sent(0, "http://other/v1"), 0.0)
    assert not is_awaited(answer(0), doc)
    assert not is_awaited(PageResult(1, 7, url=URL), doc), "a page never sent"


@pytest.mark.quick
def test_a_looping_answer_is_sent_again_with_a_penalty_and_the_ledger_moves_on() -> None:
    doc = sent_document(20)
    for page in range(1, 20):
        doc.apply(decide(answer(page), doc, RULES), 0.0)
    action = decide(answer(0, "la " * 3000, truncated_at=4096, looping=True), doc, RULES)
    assert isinstance(action, SendAgain) and action.wait == 0 and not action.counted
    assert action.why is not None and "repetition_penalty" in action.why
    assert action.ledger is not None
    assert action.ledger.record.whole == Redo(4096, LOOP_PENALTIES[0])


@pytest.mark.quick
def test_a_second_loop_retry_waits_until_the_other_pages_are_in() -> None:
    doc = sent_document(20)
    for page in range(2, 20):
        doc.apply(decide(answer(page), doc, RULES), 0.0)
    for page in (0, 1):
        doc.apply(decide(answer(page, "la " * 3000, truncated_at=4096, looping=True), doc,
                         RULES), 0.0)
    doc.apply(Sent(0, URL), 0.0)
    action = decide(answer(0, "la " * 3000, truncated_at=4096, looping=True), doc, RULES)
    assert isinstance(action, SendAgain) and action.held is not None, (
        "page 1's second retry did not wait for page 2's first")
    doc.apply(action, 0.0)
    assert release_held(doc, RULES) == [], "released while page 2 is still out"
    doc.apply(Sent(1, URL), 0.0)
    doc.apply(decide(answer(1), doc, RULES), 0.0)
    (released,) = release_held(doc, RULES)
    assert isinstance(released, SendAgain) and released.wait == 0
    assert released.ledger is not None
    assert released.ledger.record.whole == Redo(4096, LOOP_PENALTIES[1])


@pytest.mark.quick
def test_a_cut_off_answer_the_server_allows_no_more_for_is_kept_flagged() -> None:
    doc = sent_document()
    action = decide(answer(0, truncated_at=4096, token_ceiling=4096), doc, RULES)
    assert isinstance(action, Checkpoint) and action.note is not None
    assert "max-model-len" in action.note and action.quality.verdict is Verdict.SUSPECT


@pytest.mark.quick
def test_a_failed_page_is_retried_counted_then_given_up_as_a_placeholder() -> None:
    doc = sent_document()
    for attempt in (1, 2):
        action = decide(failure(0, Failure.PAGE), doc, RULES)
        assert isinstance(action, SendAgain) and action.counted and action.wait == 0
        assert action.why == f"p.1 failed (attempt {attempt}): it broke"
        doc.apply(action, 0.0)
        doc.apply(Sent(0, URL), 0.0)
    action = decide(failure(0, Failure.PAGE), doc, RULES)
    assert isinstance(action, Placeholder) and action.retryable
    assert "after 3 attempts" in action.note
    assert "Redo it with: ocrvl retry --pages 1" in action.note


REFUSAL = "HTTP 400: chat template not found"


@pytest.mark.quick
def test_a_server_refusing_every_page_the_same_way_fails_the_document_with_its_words() -> None:
    doc = sent_document(5)
    for page in range(REFUSING_PAGES - 1):
        action = decide(failure(page, Failure.REFUSED, REFUSAL), doc, RULES)
        assert isinstance(action, SendAgain) and action.refused == REFUSAL, action
        doc.apply(action, 0.0)
    action = decide(failure(REFUSING_PAGES - 1, Failure.REFUSED, REFUSAL), doc, RULES)
    assert isinstance(action, FailJob), (
        f"{REFUSING_PAGES} pages refused alike and none answered should fail the document, "
        f"not become placeholders: {action}")
    assert action.error.exit_code is ExitCode.SERVER
    assert REFUSAL in str(action.error) and "none answered" in str(action.error)
    assert "ocrvl doctor" in (action.error.fix or "")


@pytest.mark.quick
@pytest.mark.parametrize(("external", "fix"), [
    (True, "start the server (`vllm serve`) with --trust-request-mm-kwargs"),
    (False, "set server.vllm_args: {trust-request-mm-kwargs: true}")])
def test_a_vllm_that_does_not_trust_image_sizes_names_the_flag_as_the_fix(
        external: bool, fix: str) -> None:
    """vLLM >= 0.31 without --trust-request-mm-kwargs refuses every PaddleOCR-VL request."""
    words = ("HTTP 400: Per-request mm_processor_kwargs are disabled by default because they "
             "can change multimodal preprocessing resource usage. Start the server with "
             "--trust-request-mm-kwargs only when clients are trusted.")
    rules = replace(RULES, external_server=external)
    doc = sent_document(5)
    for page in range(REFUSING_PAGES):
        action = decide(failure(page, Failure.REFUSED, words), doc, rules)
        doc.apply(action, 0.0)
    assert isinstance(action, FailJob), action
    assert (action.error.fix or "").startswith(fix), action.error.fix


@pytest.mark.quick
def test_pages_refused_once_another_was_answered_are_their_own_failures() -> None:
    doc = sent_document(5)
    doc.apply(decide(answer(4), doc, RULES), 0.0)
    for page in range(REFUSING_PAGES):
        action = decide(failure(page, Failure.REFUSED, REFUSAL), doc, RULES)
        assert isinstance(action, SendAgain) and action.counted, (
            f"the server answered a page, so page {page + 1}'s refusal is the page's: {action}")
        doc.apply(action, 0.0)


@pytest.mark.quick
def test_pages_refused_each_with_other_words_are_their_own_failures() -> None:
    doc = sent_document(5)
    for page in range(REFUSING_PAGES):
        action = decide(failure(page, Failure.REFUSED, f"HTTP 400: page {page} is too long"),
                        doc, RULES)
        assert isinstance(action, SendAgain), action
        doc.apply(action, 0.0)


@pytest.mark.quick
def test_a_page_failed_by_a_worker_crash_counts_like_any_failure() -> None:
    doc = sent_document()
    for _ in range(2):
        doc.apply(SendAgain(0, counted=True), 0.0)
        doc.apply(Sent(0, URL), 0.0)
    action = page_failed(doc, 0, "engine worker exited (42)", RULES)
    assert isinstance(action, Placeholder) and "engine worker exited" in action.note


@pytest.mark.quick
def test_a_damaged_page_is_given_up_at_once_or_fails_the_document_if_asked() -> None:
    doc = sent_document()
    action = decide(failure(0, Failure.DAMAGED, "cannot render"), doc, RULES)
    assert action == Placeholder(0, "cannot render", retryable=False)
    strict = Rules(2, fail_on_page_error=True, external_server=False, server_url=URL)
    action = decide(failure(0, Failure.DAMAGED, "cannot render"), doc, strict)
    assert isinstance(action, FailJob) and isinstance(action.error, PagesFailedError)


@pytest.mark.quick
def test_a_page_the_server_never_saw_goes_back_uncounted() -> None:
    doc = sent_document()
    assert decide(failure(0, Failure.SERVER_DOWN), doc, RULES) == SendAgain(0)


@pytest.mark.quick
def test_http_500_on_every_try_backs_off_counted_then_fails_with_the_servers_words() -> None:
    """A server that fails every completion (HTTP 500) while /health says ok: each attempt
    counts and waits longer; after the retries the document fails with exit code 5."""
    doc = sent_document()
    waits = []
    for _ in range(RULES.page_retries):
        action = decide(failure(0, Failure.SERVER_ERROR, "HTTP 500: boom"), doc, RULES)
        assert isinstance(action, SendAgain) and action.counted
        waits.append(action.wait)
        doc.apply(action, 0.0)
        doc.apply(Wake(), action.wait)
        doc.apply(Sent(0, URL), 0.0)
    assert waits == sorted(waits) and waits[0] > 0 and waits[-1] <= SERVER_ERROR_BACKOFF.longest
    action = decide(failure(0, Failure.SERVER_ERROR, "HTTP 500: boom"), doc, RULES)
    assert isinstance(action, FailJob)
    assert "HTTP 500: boom" in str(action.error) and URL in str(action.error)
    assert action.error.exit_code is ExitCode.SERVER and ExitCode.SERVER == 5


@pytest.mark.quick
def test_a_changed_file_fails_the_document() -> None:
    doc = sent_document()
    action = decide(failure(0, Failure.INPUT, "the file changed"), doc, RULES)
    assert isinstance(action, FailJob) and isinstance(action.error, InputVanishedError)


@pytest.mark.quick
def test_a_redo_that_fails_keeps_the_pages_earlier_answer() -> None:
    doc = sent_document(20)
    for page in range(1, 20):
        doc.apply(decide(answer(page), doc, RULES), 0.0)
    doc.apply(decide(answer(0, "la " * 3000, truncated_at=4096, looping=True), doc, RULES),
              0.0)
    doc.apply(Sent(0, URL), 0.0)
    action = decide(failure(0, Failure.PAGE, "HTTP 400: bad"), doc, RULES)
    assert isinstance(action, Checkpoint) and action.answer.truncated_at == 4096
    assert action.note is not None and "sending it again failed: HTTP 400: bad" in action.note

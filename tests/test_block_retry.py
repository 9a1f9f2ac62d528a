"""Per-block judgement and retry: with layout detection a page is one answer per block; each
block is judged, the page is as good as its worst block, and a redo sends again only the
blocks that were cut off or looped, keeping the others' answers."""

from __future__ import annotations

import base64
import io
import json
import math
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from PIL import Image

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.actions import Checkpoint, FailJob, SendAgain, Sent, Wake
from ocrvl_daemon.core.decide import Rules, decide, release_held
from ocrvl_daemon.core.document import Document
from ocrvl_daemon.core.messages import LOOP, BlockAnswer, Failure, PageResult, PageTask
from ocrvl_daemon.core.quality import LOOP_PENALTIES, REDO_GROWTH, Redo, Verdict
from ocrvl_daemon.engine.worker_settings import worker_setup
from ocrvl_daemon.server.placement import Placement
from ocrvl_daemon.worker import completions
from ocrvl_daemon.worker.page_context import Asked, PageContext, on_page
from ocrvl_daemon.worker.pipeline import replace_chat_completion
from ocrvl_daemon.worker.streaming import StreamedAnswer
from testkit.core import URL, document, send_all
from testkit.documents import make_pdf
from testkit.fake_server import FakeServerConfig, InProcessFakeServer
from testkit.harness import chat_payload, make_test_jpeg
from testkit.stand_in_worker import Policy

RULES = Rules(page_retries=2, fail_on_page_error=False, external_server=False, server_url=URL)
BLOCKS = 30
TOKENS = 100  # each good block's answer
LIMIT = 4096
LOOPING = 6  # the block that loops (0-based: block 7 of 30)


def good(page: int, block: int, reused: bool = False) -> BlockAnswer:
    return BlockAnswer(f"p{page}b{block}", f"text of block {block + 1} " * 5, "stop", TOKENS,
                       reused)


def looped(page: int, block: int) -> BlockAnswer:
    return BlockAnswer(f"p{page}b{block}", "la la " * 400, LOOP, 700)


def cut(page: int, block: int) -> BlockAnswer:
    row = " ".join(f"| {n * 7919 % 10007} " for n in range(600))  # a long table, no loop
    return BlockAnswer(f"p{page}b{block}", row, "length", LIMIT)


def page_result(page: int, answers: list[BlockAnswer], max_new_tokens: int = LIMIT,
                ceiling: int = 16384) -> PageResult:
    """What the worker sends back for a page of `answers` (its page-wide fields as
    `worker.page._recognise` sets them)."""
    bad = [a for a in answers if a.cut]
    return PageResult(
        1, page, markdown="\n\n".join(a.text for a in answers), url=URL,
        tokens=sum(a.tokens for a in answers), has_ink=True, answers=answers,
        finish_reason="length" if bad else "stop",
        truncated_at=max_new_tokens if bad else None,
        looping=any(a.looping for a in bad),
        token_ceiling=0 if all(a.looping for a in bad) else ceiling)


def book_with_first_pass_in(pages: int = 20, out: int = 0) -> Document:
    """A book whose pages but the first (and the last `out`, still out) came back good, 30
    blocks each."""
    doc = document(1, pages)
    send_all(doc)
    for page in range(1, pages - out):
        action = decide(page_result(page, [good(page, b) for b in range(BLOCKS)]), doc, RULES)
        assert isinstance(action, Checkpoint) and action.ledger is not None
        doc.apply(action, 0.0)
    return doc


def redo_of(action: SendAgain, doc: Document) -> None:
    """The converter applies the redo: the page goes back, with its ledger, and is sent
    again once any wait is over."""
    assert action.ledger is not None
    doc.apply(action, 0.0)
    doc.apply(Wake(), math.inf)
    doc.apply(Sent(action.page, URL), 0.0)


@pytest.mark.quick
def test_one_looping_block_among_30_is_sent_again_alone_the_other_29_kept() -> None:
    doc = book_with_first_pass_in()
    answers = [looped(0, b) if b == LOOPING else good(0, b) for b in range(BLOCKS)]
    action = decide(page_result(0, answers), doc, RULES)
    assert isinstance(action, SendAgain) and action.ledger is not None
    assert action.ledger.record.blocks == {f"p0b{LOOPING}": Redo(LIMIT, LOOP_PENALTIES[0])}
    keep = action.ledger.record.keep
    assert sorted(keep) == sorted(a.key for a in answers if a.key != f"p0b{LOOPING}"), (
        "the blocks kept are not exactly the 29 good ones")
    assert action.why is not None and "block 7 of 30 cut off; it loops" in action.why, action.why

    # The redo: the 29 kept answers come back as they were, the looping block now ends.
    redo_of(action, doc)
    again = [good(0, b) if b == LOOPING else good(0, b, reused=True) for b in range(BLOCKS)]
    done = decide(page_result(0, again), doc, RULES)
    assert isinstance(done, Checkpoint) and done.note is None
    assert done.quality.verdict is Verdict.OK
    assert done.ledger is not None and done.ledger.budget.extra == TOKENS, (
        f"the budget counted {done.ledger.budget.extra} redo tokens, not the {TOKENS} the one "
        "redone block generated")


@pytest.mark.quick
def test_a_cut_off_block_is_redone_alone_with_more_tokens() -> None:
    doc = book_with_first_pass_in()
    answers = [cut(0, b) if b == 3 else good(0, b) for b in range(BLOCKS)]
    action = decide(page_result(0, answers), doc, RULES)
    assert isinstance(action, SendAgain) and action.ledger is not None
    assert action.ledger.record.blocks == {"p0b3": Redo(LIMIT * REDO_GROWTH)}
    assert len(action.ledger.record.keep) == BLOCKS - 1 and "p0b3" not in action.ledger.record.keep


@pytest.mark.quick
def test_the_redo_budget_counts_only_the_tokens_of_the_blocks_redone() -> None:
    doc = book_with_first_pass_in()
    first_pass = doc.budget.first_pass
    answers = [looped(0, b) if b == LOOPING else good(0, b) for b in range(BLOCKS)]
    action = decide(page_result(0, answers), doc, RULES)
    assert isinstance(action, SendAgain)
    assert action.ledger is not None
    assert action.ledger.budget.first_pass == first_pass + 29 * TOKENS + 700
    redo_of(action, doc)
    # The loop-breaking try loops again: it generated 700 tokens, the 29 kept answers none.
    again = [looped(0, b) if b == LOOPING else good(0, b, reused=True) for b in range(BLOCKS)]
    second = decide(page_result(0, again), doc, RULES)
    assert second.ledger is not None
    assert second.ledger.budget.extra == 700, second.ledger.budget.extra


@pytest.mark.quick
def test_a_pages_verdict_is_its_worst_blocks() -> None:
    doc = book_with_first_pass_in()
    garbled = BlockAnswer("p0b9", "\ufffd" * 40 + "x" * 20, "stop", 60)
    answers = [garbled if b == 9 else good(0, b) for b in range(BLOCKS)]
    action = decide(page_result(0, answers), doc, RULES)
    assert isinstance(action, Checkpoint)
    assert (action.quality.verdict, action.quality.reason) == (Verdict.BAD, "garbage"), (
        "one garbled block of 30 did not make its page bad")
    assert action.quality.bad_chars == pytest.approx(40 / 60)


@pytest.mark.quick
def test_an_empty_block_among_30_is_sent_again_once_alone_then_flags_its_page() -> None:
    doc = book_with_first_pass_in()
    blank = BlockAnswer("p0b4", "", "stop", 1)
    answers = [blank if b == 4 else good(0, b) for b in range(BLOCKS)]
    action = decide(page_result(0, answers), doc, RULES)
    assert isinstance(action, SendAgain) and action.ledger is not None, (
        "a block that came back empty (the layout model found ink there) was not sent again")
    assert action.ledger.record.blocks == {"p0b4": Redo(LIMIT)}, (
        "the empty block is not sent again as it was")
    assert sorted(action.ledger.record.keep) == sorted(a.key for a in answers if a.key != "p0b4"), (
        "the other 29 blocks' answers are not all kept")
    assert action.why is not None and "block 5 of 30 came back empty" in action.why, action.why

    # Empty again: kept, the page flagged bad with the block named, never a third time.
    redo_of(action, doc)
    again = [blank if b == 4 else good(0, b, reused=True) for b in range(BLOCKS)]
    kept = decide(page_result(0, again), doc, RULES)
    assert isinstance(kept, Checkpoint), f"an empty block was sent a third time: {kept}"
    assert (kept.quality.verdict, kept.quality.reason) == (Verdict.BAD, "empty")
    assert kept.note is not None and "(block 5 of 30)" in kept.note, kept.note


@pytest.mark.quick
def test_an_empty_block_whose_retry_reads_well_leaves_its_page_ok() -> None:
    doc = book_with_first_pass_in()
    answers = [BlockAnswer("p0b4", " \n", "stop", 1) if b == 4 else good(0, b)
               for b in range(BLOCKS)]
    action = decide(page_result(0, answers), doc, RULES)
    assert isinstance(action, SendAgain)
    redo_of(action, doc)
    again = [good(0, b, reused=b != 4) for b in range(BLOCKS)]
    done = decide(page_result(0, again), doc, RULES)
    assert isinstance(done, Checkpoint) and done.quality.verdict is Verdict.OK and done.note is None
    assert done.ledger is not None and done.ledger.budget.extra == TOKENS, (
        f"the budget counted {done.ledger.budget.extra} redo tokens, not the {TOKENS} of the one "
        "block")


@pytest.mark.quick
def test_an_empty_answer_for_a_blank_block_is_kept_without_a_retry_or_a_flag() -> None:
    doc = book_with_first_pass_in()
    blank = BlockAnswer("p0b4", "", "stop", 1, has_ink=False)
    action = decide(page_result(0, [blank if b == 4 else good(0, b) for b in range(BLOCKS)]),
                    doc, RULES)
    assert isinstance(action, Checkpoint), "a blank block's empty answer was sent again"
    assert action.quality.verdict is Verdict.OK and action.note is None, action.note


def data_url(pixels: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG")
    return f"data:image/jpeg;base64,{base64.b64encode(buf.getvalue()).decode()}"


@pytest.mark.quick
def test_the_worker_reads_an_empty_answers_block_for_ink() -> None:
    white = np.full((60, 400, 3), 255, np.uint8)
    inked = white.copy()
    inked[20:40, 20:380] = 0  # a line of text
    asked = []
    for n, pixels in enumerate((white, inked)):
        done: Future[Any] = Future()
        done.set_result(completions.Completion(StreamedAnswer("", "stop", 1)))
        asked.append(Asked(f"b{n}", done, LIMIT, image=data_url(pixels)))
    answers = completions.answers(asked)
    assert [a.has_ink for a in answers] == [False, True], (
        "an empty answer's block was not read for ink: a blank block would be sent again and "
        "flag its page, or an inked one would be kept empty")


@pytest.mark.quick
def test_a_block_that_stays_looping_is_named_in_the_pages_note() -> None:
    doc = book_with_first_pass_in()
    for tries in range(len(LOOP_PENALTIES)):
        answers = [looped(0, b) if b == LOOPING else good(0, b, reused=tries > 0)
                   for b in range(BLOCKS)]
        action = decide(page_result(0, answers), doc, RULES)
        assert isinstance(action, SendAgain)
        redo_of(action, doc)
    answers = [looped(0, b) if b == LOOPING else good(0, b, reused=True) for b in range(BLOCKS)]
    kept = decide(page_result(0, answers), doc, RULES)
    assert isinstance(kept, Checkpoint) and kept.quality.verdict is Verdict.BAD
    assert kept.note is not None and kept.note.startswith(
        f"page 1 was cut off at {LIMIT} tokens (block 7 of 30): the answer repeats itself"), (
        kept.note)


@pytest.mark.quick
def test_a_redo_task_carries_the_answers_to_keep_and_the_loop_breaking_settings(
        tmp_path: Path) -> None:
    policy = Policy(tmp_path)
    book = make_pdf(policy.folder / "book.pdf", 1)
    job = policy.queue(book)
    tasks: list[PageTask] = []
    submit = policy.worker.submit
    policy.worker.submit = lambda task: (tasks.append(task), submit(task))  # type: ignore[method-assign]
    policy.send()
    answers = [looped(0, b) if b == LOOPING else good(0, b) for b in range(BLOCKS)]
    result = page_result(0, answers)
    result.job_id = job.id
    policy.deliver(result)
    assert policy.send() == [(job.id, 0)], "the page with a looping block was not sent again"
    redo = tasks[-1]
    assert redo.blocks == {f"p0b{LOOPING}": Redo(LIMIT, LOOP_PENALTIES[0])}
    assert redo.repetition_penalty is None and redo.max_new_tokens == LIMIT  # any other block
    assert set(redo.keep) == {a.key for a in answers} - {f"p0b{LOOPING}"}
    assert all(redo.keep[a.key] == a for a in answers if a.key in redo.keep)
    policy.store.close()


class _Gate:
    """What `tracked_completions` needs of an endpoint's gate and sender: every request sent
    is noted and answered at once."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def gate(self, url: str) -> Any:
        return SimpleNamespace(acquire=lambda priority, document: SimpleNamespace(bump=None),
                               release=lambda place: None, started=lambda place: None)

    def send(self, url: str, messages: Any, kwargs: dict[str, Any],
             started: Any = None) -> Future[Any]:
        self.sent.append(messages)
        future: Future[Any] = Future()
        future.set_result(completions.Completion(StreamedAnswer("fresh answer", "stop", 12)))
        return future


def block_messages(name: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{name}"}},
        {"type": "text", "text": "OCR:"}]}]


@pytest.mark.quick
def test_the_worker_answers_kept_blocks_at_once_and_sends_only_the_others() -> None:
    client = SimpleNamespace(create_chat_completion=None)
    pipeline = SimpleNamespace(paddlex_pipeline=SimpleNamespace(
        vl_rec_model=SimpleNamespace(genai_client=client)))
    endpoints = _Gate()
    replace_chat_completion(pipeline, completions.tracked_completions(endpoints))  # type: ignore[arg-type]
    kept_key = completions.block_key(block_messages("AAAA"))
    kept = BlockAnswer(kept_key, "kept answer", "stop", 80)
    with on_page(PageContext(URL, keep={kept_key: kept})) as page:
        first = client.create_chat_completion(block_messages("AAAA"), return_future=True,
                                              max_completion_tokens=LIMIT)
        second = client.create_chat_completion(block_messages("BBBB"), return_future=True,
                                               max_completion_tokens=LIMIT)
        assert first.result().choices[0].message.content == "kept answer"
        assert second.result().choices[0].message.content == "fresh answer"
        assert endpoints.sent == [block_messages("BBBB")], (
            "a kept block was asked of the server again")
        answers = completions.answers(page.asked)
    assert [(a.text, a.reused, a.tokens) for a in answers] == [
        ("kept answer", True, 80), ("fresh answer", False, 12)]
    result = PageResult(1, 0, tokens=92, answers=answers)
    assert result.generated == 12


# --- a block the server fails: the page's other answers are kept -----------------------------

FAILED = 11  # the block whose request failed (0-based: block 12 of 30)


@pytest.mark.quick
@pytest.mark.parametrize("kind", [Failure.SERVER_ERROR, Failure.SERVER_DOWN, Failure.PAGE,
                                  Failure.REFUSED])
def test_a_page_whose_one_request_failed_is_sent_again_keeping_the_answers_that_came(
        kind: Failure) -> None:
    doc = book_with_first_pass_in()
    answers = [cut(0, b) if b == CUT else good(0, b) for b in range(BLOCKS) if b != FAILED]
    result = replace(page_result(0, []), error="HTTP 500: engine failed", error_kind=kind,
                     answers=answers)
    action = decide(result, doc, RULES)
    assert isinstance(action, SendAgain) and action.ledger is not None, action
    kept = action.ledger.record.keep
    assert set(kept) == {f"p0b{b}" for b in range(BLOCKS) if b not in (FAILED, CUT)}, (
        "the next try would ask again for blocks that came back good, or keep a cut-off one")
    assert not doc.page(0).redo.keep, "decide changed the document's own record of the page"
    if action.why is not None:
        assert "the 28 answers that came back kept" in action.why, action.why
    redo_of(action, doc)
    # The next try's answers: the kept ones reused, the other two fresh and good.
    again = [replace(kept[a.key], reused=True) if a.key in kept else good(0, n)
             for n, a in enumerate(good(0, b) for b in range(BLOCKS))]
    before = doc.budget.first_pass
    done = decide(page_result(0, again), doc, RULES)
    assert isinstance(done, Checkpoint) and done.quality.verdict is Verdict.OK, done
    assert done.ledger is not None and done.ledger.budget.first_pass == before + BLOCKS * TOKENS, (
        "the redo budget left out the first-pass answers kept from the failed try")


@pytest.mark.quick
@pytest.mark.parametrize("fail_on_page_error", [False, True])
def test_a_block_refused_on_every_try_leaves_the_page_without_it_unless_pages_must_not_fail(
        fail_on_page_error: bool) -> None:
    rules = replace(RULES, fail_on_page_error=fail_on_page_error)
    doc = book_with_first_pass_in()
    for _ in range(rules.page_retries):  # this try is its last
        doc.apply(SendAgain(0, counted=True), 0.0)
        doc.apply(Sent(0, URL), 0.0)
    answers = [good(0, b) for b in range(BLOCKS) if b != FAILED]
    result = replace(page_result(0, []), error="HTTP 400: refused", error_kind=Failure.REFUSED,
                     answers=answers, failed=[f"p0b{FAILED}"])
    action = decide(result, doc, rules)
    if fail_on_page_error:
        assert isinstance(action, FailJob), "output.fail_on_page_error was not honoured"
        return
    assert isinstance(action, SendAgain) and action.ledger is not None, action
    keep = action.ledger.record.keep
    assert keep[f"p0b{FAILED}"].text == "" and len(keep) == BLOCKS, (
        "the last try would ask the server again")
    redo_of(action, doc)
    kept = action.ledger.record.keep
    again = [replace(kept[f"p0b{b}"], reused=True) for b in range(BLOCKS)]  # as the page asks
    done = decide(page_result(0, again), doc, rules)
    assert isinstance(done, Checkpoint) and done.quality.verdict is Verdict.BAD, done
    assert done.note is not None and "refused block 12 of 30 on every try (HTTP 400: " \
        "refused)" in done.note, done.note


@pytest.mark.quick
def test_a_failed_request_reaches_paddlex_as_an_empty_answer_so_the_others_run_on() -> None:
    """PaddleX cancels a page's other requests when one raises: the failure is kept back
    (`_recognise` fails the page once all have ended), and a cancel from PaddleX still
    cancels the request."""
    failing: list[Future[Any]] = []

    class Failing(_Gate):
        def send(self, url: str, messages: Any, kwargs: dict[str, Any],
                 started: Any = None) -> Future[Any]:
            if messages != block_messages("FAIL"):
                return super().send(url, messages, kwargs)
            future: Future[Any] = Future()
            failing.append(future)
            return future

    client = SimpleNamespace(create_chat_completion=None)
    pipeline = SimpleNamespace(paddlex_pipeline=SimpleNamespace(
        vl_rec_model=SimpleNamespace(genai_client=client)))
    replace_chat_completion(pipeline, completions.tracked_completions(Failing()))  # type: ignore[arg-type]
    with on_page(PageContext(URL)) as page:
        shown = client.create_chat_completion(block_messages("FAIL"), return_future=True,
                                              max_completion_tokens=LIMIT)
        other = client.create_chat_completion(block_messages("GOOD"), return_future=True,
                                              max_completion_tokens=LIMIT)
        failing[0].set_exception(RuntimeError("HTTP 500"))
        assert shown.result(5).choices[0].message.content == "", "PaddleX saw the failure"
        assert other.result(5).choices[0].message.content == "fresh answer"
        assert isinstance(page.asked[0].future.exception(), RuntimeError), (
            "the failure is lost: the page would be kept with an empty block")
        assert [a.text for a in completions.answers(page.asked)] == ["fresh answer"]
        cancelled = client.create_chat_completion(block_messages("FAIL"), return_future=True,
                                                  max_completion_tokens=LIMIT)
        assert cancelled.cancel() and page.asked[-1].future.cancelled(), (
            "a request PaddleX cancelled still runs at the server")


# --- each redone block with the setting its own verdict calls for ---------------------------

CUT = 3  # the block cut off without looping (0-based: block 4 of 30)


def sent_with(task: PageTask, key: str) -> Redo:
    """How the worker asks the block `key` of `task` (when it is not kept): its own setting,
    else the page's."""
    return task.blocks.get(key, Redo(task.max_new_tokens, task.repetition_penalty))


@pytest.mark.quick
def test_a_cut_off_block_gets_more_tokens_and_a_looping_block_the_penalty_in_one_redo() -> None:
    doc = book_with_first_pass_in()
    answers = [cut(0, b) if b == CUT else looped(0, b) if b == LOOPING else good(0, b)
               for b in range(BLOCKS)]
    action = decide(page_result(0, answers), doc, RULES)
    assert isinstance(action, SendAgain) and action.ledger is not None
    assert action.ledger.record.blocks == {
        f"p0b{CUT}": Redo(LIMIT * REDO_GROWTH),  # more tokens, no penalty
        f"p0b{LOOPING}": Redo(LIMIT, LOOP_PENALTIES[0]),  # the same limit, the penalty
    }
    assert set(action.ledger.record.keep) == {a.key for a in answers} - {f"p0b{CUT}",
                                                                     f"p0b{LOOPING}"}
    assert action.why == (
        f"p.1: blocks 4, 7 of 30 cut off; block 4: redoing it once with {LIMIT * REDO_GROWTH}; "
        f"block 7: it loops; sending it again with repetition_penalty {LOOP_PENALTIES[0]} "
        "(the other 28 answers kept)"), action.why

    # The redo: both come back whole; the budget counts what the two generated.
    redo_of(action, doc)
    again = [good(0, b, reused=b not in (CUT, LOOPING)) for b in range(BLOCKS)]
    done = decide(page_result(0, again), doc, RULES)
    assert isinstance(done, Checkpoint) and done.note is None
    assert done.ledger is not None and done.ledger.budget.extra == 2 * TOKENS


@pytest.mark.quick
def test_a_blocks_second_loop_retry_waits_for_the_other_pages_while_a_cut_block_goes_now(
) -> None:
    doc = book_with_first_pass_in(22, out=2)
    answers = [looped(0, b) if b == LOOPING else good(0, b) for b in range(BLOCKS)]
    first = decide(page_result(0, answers), doc, RULES)
    assert isinstance(first, SendAgain)
    redo_of(first, doc)
    # Its loop-breaking retry loops again, and another block is cut off, while pages 21 and 22
    # are still out: the cut block goes now, the loop's second retry waits for them.
    again = [looped(0, b) if b == LOOPING else cut(0, b) if b == CUT
             else good(0, b, reused=True) for b in range(BLOCKS)]
    second = decide(page_result(0, again), doc, RULES)
    assert isinstance(second, SendAgain) and second.ledger is not None and second.wait == 0
    assert second.ledger.record.blocks[f"p0b{CUT}"] == Redo(LIMIT * REDO_GROWTH)
    assert f"p0b{LOOPING}" in second.ledger.record.keep, "the loop was sent again before its turn"
    redo_of(second, doc)
    # The cut block comes back whole, the loop as it was kept: it waits for pages 21 and 22.
    third = [good(0, b, reused=b != CUT) if b != LOOPING
             else replace(looped(0, b), reused=True) for b in range(BLOCKS)]
    held = decide(page_result(0, third), doc, RULES)
    assert isinstance(held, SendAgain) and held.held is not None and held.ledger is not None
    doc.apply(held, 0.0)
    for page in (20, 21):
        action = decide(page_result(page, [good(page, b) for b in range(BLOCKS)]), doc, RULES)
        assert isinstance(action, Checkpoint) and action.ledger is not None
        doc.apply(action, 0.0)
    (released,) = release_held(doc, RULES)
    assert isinstance(released, SendAgain) and released.ledger is not None
    assert released.ledger.record.blocks[f"p0b{LOOPING}"] == Redo(LIMIT, LOOP_PENALTIES[1])
    assert set(released.ledger.record.keep) == {f"p0b{b}" for b in range(BLOCKS)} - {
        f"p0b{LOOPING}"}


@pytest.mark.quick
def test_a_redo_task_carries_each_redone_blocks_own_settings(tmp_path: Path) -> None:
    policy = Policy(tmp_path)
    pages = 20
    book = make_pdf(policy.folder / "book.pdf", pages)
    job = policy.queue(book)
    tasks: list[PageTask] = []
    submit = policy.worker.submit
    policy.worker.submit = lambda task: (tasks.append(task), submit(task))  # type: ignore[method-assign]
    # The book's other pages come back good first (the redo budget is a share of them).
    waiting = policy.send()
    while [p for p in waiting if p != (job.id, 0)]:
        for _, page in [p for p in waiting if p != (job.id, 0)]:
            result = page_result(page, [good(page, b) for b in range(BLOCKS)])
            result.job_id = job.id
            policy.deliver(result)
        waiting = [p for p in waiting if p == (job.id, 0)] + policy.send()
    answers = [cut(0, b) if b == CUT else looped(0, b) if b == LOOPING else good(0, b)
               for b in range(BLOCKS)]
    result = page_result(0, answers)
    result.job_id = job.id
    policy.deliver(result)
    assert policy.send() == [(job.id, 0)], "the page with bad blocks was not sent again"
    redo = tasks[-1]
    assert sent_with(redo, f"p0b{CUT}") == Redo(LIMIT * REDO_GROWTH), (
        "the cut-off block is not sent with more tokens and no penalty")
    assert sent_with(redo, f"p0b{LOOPING}") == Redo(LIMIT, LOOP_PENALTIES[0]), (
        "the looping block is not sent with the loop-breaking penalty")
    assert set(redo.keep) == {a.key for a in answers} - {f"p0b{CUT}", f"p0b{LOOPING}"}
    policy.store.close()


def test_the_server_sees_each_redone_block_with_its_own_settings(tmp_path: Path) -> None:
    """The worker's requests, through its real endpoints to the fake vLLM: a block named in
    `PageTask.blocks` goes with its own limit and penalty, any other with the page's."""
    cut_width, loop_width, plain_width = 96, 64, 128
    log = tmp_path / "requests.jsonl"
    server = InProcessFakeServer(FakeServerConfig(
        port=0, access_log=False, output_tokens="fixed:40", request_log=str(log),
        cut_widths=frozenset({cut_width}), loop_widths=frozenset({loop_width})))
    config = Config.model_validate({})
    client = SimpleNamespace(create_chat_completion=None)
    pipeline = SimpleNamespace(paddlex_pipeline=SimpleNamespace(
        vl_rec_model=SimpleNamespace(genai_client=client)))
    blocks = {width: chat_payload(make_test_jpeg(width, (width, 64)))["messages"]
              for width in (cut_width, loop_width, plain_width)}
    settings = {completions.block_key(blocks[cut_width]): Redo(LIMIT * REDO_GROWTH),
                completions.block_key(blocks[loop_width]): Redo(LIMIT, LOOP_PENALTIES[0])}
    with server:
        endpoints = completions.Endpoints(worker_setup(config, Placement(1)))
        replace_chat_completion(pipeline, completions.tracked_completions(endpoints))
        with on_page(PageContext(f"{server.url}/v1", blocks=settings)) as page:
            # As PaddleX asks for each block: the page's limit, no penalty.
            futures = [client.create_chat_completion(
                messages, return_future=True, temperature=0, max_completion_tokens=LIMIT,
                timeout=60, extra_body={"skip_special_tokens": True})
                for messages in blocks.values()]
            for future in futures:
                future.result(60)
            answers = completions.answers(page.asked)
    seen = {r["w"]: (r["max_tokens"], r["repetition_penalty"])
            for r in map(json.loads, log.read_text().splitlines())}
    assert seen == {cut_width: (LIMIT * REDO_GROWTH, None),
                    loop_width: (LIMIT, LOOP_PENALTIES[0]),
                    plain_width: (LIMIT, None)}, seen
    assert [(a.finish_reason, a.limit) for a in answers] == [
        ("length", LIMIT * REDO_GROWTH), ("stop", LIMIT), ("stop", LIMIT)], (
        "each answer does not know the limit it was asked with")

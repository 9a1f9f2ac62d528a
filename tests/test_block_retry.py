"""Per-block judgement and retry: with layout detection a page is one answer per block; each
block is judged, the page is as good as its worst block, and a redo sends again only the
blocks that were cut off or looped, keeping the others' answers."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ocrvl_daemon.decide import Checkpoint, Rules, SendAgain, decide
from ocrvl_daemon.document import Document
from ocrvl_daemon.page_quality import LOOP_PENALTIES, REDO_GROWTH, Redo, Verdict
from ocrvl_daemon.worker import main as worker_main
from ocrvl_daemon.worker.messages import BlockAnswer, PageResult, PageTask
from ocrvl_daemon.worker.streaming import LOOP
from testkit.core import URL, document, send_all
from testkit.documents import make_pdf
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
    `worker.main._recognise` sets them)."""
    bad = [a for a in answers if a.cut]
    return PageResult(
        1, page, markdown="\n\n".join(a.text for a in answers), url=URL,
        tokens=sum(a.tokens for a in answers), has_ink=True, answers=answers,
        finish_reason="length" if bad else "stop",
        truncated_at=max_new_tokens if bad else None,
        looping=any(a.looping for a in bad),
        token_ceiling=0 if any(a.looping for a in bad) else ceiling)


def book_with_first_pass_in(pages: int = 20) -> Document:
    """A book whose pages but the first came back good, 30 blocks each."""
    doc = document(1, pages)
    send_all(doc)
    for page in range(1, pages):
        action = decide(page_result(page, [good(page, b) for b in range(BLOCKS)]), doc, RULES)
        assert isinstance(action, Checkpoint) and action.ledger is not None
        doc.ledger = action.ledger
        doc.answered(page)
    return doc


def redo_of(action: SendAgain, doc: Document) -> None:
    """The converter applies the redo: the page goes back to be sent with its ledger."""
    assert action.ledger is not None
    doc.ledger = action.ledger
    doc.give_back(action.page)
    doc.send(action.page, URL)


@pytest.mark.quick
def test_one_looping_block_among_30_is_sent_again_alone_the_other_29_kept() -> None:
    doc = book_with_first_pass_in()
    answers = [looped(0, b) if b == LOOPING else good(0, b) for b in range(BLOCKS)]
    action = decide(page_result(0, answers), doc, RULES)
    assert isinstance(action, SendAgain) and action.ledger is not None
    assert action.ledger.redos[0] == Redo(LIMIT, LOOP_PENALTIES[0])
    keep = action.ledger.keep[0]
    assert sorted(keep) == sorted(a.key for a in answers if a.key != f"p0b{LOOPING}"), (
        "the blocks kept are not exactly the 29 good ones")
    assert action.why is not None and "block 7 of 30 cut off; it loops" in action.why, action.why

    # The redo: the 29 kept answers come back as they were, the looping block now ends.
    redo_of(action, doc)
    again = [good(0, b) if b == LOOPING else good(0, b, reused=True) for b in range(BLOCKS)]
    done = decide(page_result(0, again), doc, RULES)
    assert isinstance(done, Checkpoint) and done.note is None
    assert done.quality.verdict is Verdict.OK
    assert done.ledger is not None and done.ledger.extra == TOKENS, (
        f"the budget counted {done.ledger.extra} redo tokens, not the {TOKENS} the one redone "
        "block generated")


@pytest.mark.quick
def test_a_cut_off_block_is_redone_alone_with_more_tokens() -> None:
    doc = book_with_first_pass_in()
    answers = [cut(0, b) if b == 3 else good(0, b) for b in range(BLOCKS)]
    action = decide(page_result(0, answers), doc, RULES)
    assert isinstance(action, SendAgain) and action.ledger is not None
    assert action.ledger.redos[0] == Redo(LIMIT * REDO_GROWTH)
    assert len(action.ledger.keep[0]) == BLOCKS - 1 and "p0b3" not in action.ledger.keep[0]


@pytest.mark.quick
def test_the_redo_budget_counts_only_the_tokens_of_the_blocks_redone() -> None:
    doc = book_with_first_pass_in()
    first_pass = doc.ledger.first_pass
    answers = [looped(0, b) if b == LOOPING else good(0, b) for b in range(BLOCKS)]
    action = decide(page_result(0, answers), doc, RULES)
    assert isinstance(action, SendAgain)
    assert action.ledger is not None and action.ledger.first_pass == first_pass + 29 * TOKENS + 700
    redo_of(action, doc)
    # The loop-breaking try loops again: it generated 700 tokens, the 29 kept answers none.
    again = [looped(0, b) if b == LOOPING else good(0, b, reused=True) for b in range(BLOCKS)]
    second = decide(page_result(0, again), doc, RULES)
    assert second.ledger is not None and second.ledger.extra == 700, second.ledger.extra


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
    assert redo.repetition_penalty == LOOP_PENALTIES[0] and redo.max_new_tokens == LIMIT
    assert set(redo.keep) == {a.key for a in answers} - {f"p0b{LOOPING}"}
    assert all(redo.keep[a.key] == a for a in answers if a.key in redo.keep)
    policy.store.close()


class _Gate:
    """What `_track_completions` needs of an endpoint's gate and sender: every request sent
    is noted and answered at once."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def gate(self, url: str) -> Any:
        return SimpleNamespace(acquire=lambda priority, document: SimpleNamespace(bump=None),
                               release=lambda place: None)

    def send(self, url: str, messages: Any, kwargs: dict[str, Any]) -> Future[Any]:
        self.sent.append(messages)
        future: Future[Any] = Future()
        future.set_result(worker_main._Completion(
            worker_main.StreamedAnswer("fresh answer", "stop", 12)))
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
    worker_main._track_completions(pipeline, endpoints)  # type: ignore[arg-type]
    kept_key = worker_main.block_key(block_messages("AAAA"))
    kept = BlockAnswer(kept_key, "kept answer", "stop", 80)
    calls = worker_main._COMPLETIONS
    calls.keep, calls.asked, calls.started = {kept_key: kept}, [], []
    try:
        first = client.create_chat_completion(block_messages("AAAA"), return_future=True,
                                              max_completion_tokens=LIMIT)
        second = client.create_chat_completion(block_messages("BBBB"), return_future=True,
                                               max_completion_tokens=LIMIT)
        assert first.result().choices[0].message.content == "kept answer"
        assert second.result().choices[0].message.content == "fresh answer"
        assert endpoints.sent == [block_messages("BBBB")], (
            "a kept block was asked of the server again")
        answers = worker_main._answers(calls.asked)
    finally:
        calls.keep, calls.asked, calls.started = {}, None, None
    assert [(a.text, a.reused, a.tokens) for a in answers] == [
        ("kept answer", True, 80), ("fresh answer", False, 12)]
    result = PageResult(1, 0, tokens=92, answers=answers)
    assert result.generated == 12

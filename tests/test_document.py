"""One active document (`core.document.Document`): one immutable record per page, changed
only by `Document.apply`, the same for the converter and the tests."""

from __future__ import annotations

import dataclasses

import pytest

from ocrvl_daemon.core.actions import (
    FailJob,
    Placeholder,
    ReachedServer,
    SendAgain,
    Sent,
    TakenBack,
    Wake,
)
from ocrvl_daemon.core.document import SMALL_DOCUMENT_PAGES, pages_per_endpoint
from ocrvl_daemon.core.page import DONE, PENDING, Held, Resting, SentPage
from ocrvl_daemon.core.quality import Redo
from ocrvl_daemon.core.redo import WHOLE_PAGE, CutBlock, RedoBudget
from ocrvl_daemon.errors import OcrvlError
from testkit.core import URL, checkpointed, document

HELD = Held((CutBlock(WHOLE_PAGE, 4096, looping=True),), 8192)


@pytest.mark.quick
def test_a_page_goes_pending_sent_answered_and_is_counted_once() -> None:
    doc = document(1, 2)
    doc.apply(Sent(0, URL), 0.0)
    assert doc.pending == [1] and doc.sent == {0: SentPage(URL)}
    doc.apply(checkpointed(doc, 0), 0.0)
    doc.apply(checkpointed(doc, 0), 0.0)
    assert doc.done == 1 and not doc.sent and not doc.finished
    doc.apply(Sent(1, URL), 0.0)
    doc.apply(Placeholder(1, "gave up", retryable=True), 0.0)
    assert doc.finished and doc.done == 2 and doc.pages_left == 0
    assert doc.page(0).phase == DONE and doc.page(1).phase == DONE


@pytest.mark.quick
def test_only_a_pending_page_can_be_sent() -> None:
    doc = document(1, 1)
    doc.apply(Sent(0, URL), 0.0)
    with pytest.raises(ValueError, match="page 1 is not pending"):
        doc.apply(Sent(0, URL), 0.0)


@pytest.mark.quick
def test_a_page_taken_back_returns_to_the_queue_in_order_once() -> None:
    doc = document(1, 5)
    for page in (0, 1, 2):
        doc.apply(Sent(page, URL), 0.0)
    doc.apply(TakenBack(1), 0.0)
    doc.apply(TakenBack(1), 0.0)
    assert doc.pending == [1, 3, 4] and set(doc.sent) == {0, 2}
    assert doc.page(1).attempts == 0, "a page taken back counted a failed attempt"


@pytest.mark.quick
def test_the_record_says_where_a_page_is_and_when_its_request_left() -> None:
    doc = document(1, 1)
    doc.apply(Sent(0, URL, worker=3), 0.0)
    doc.apply(ReachedServer(0), 0.0)
    assert doc.page(0).phase == SentPage(URL, worker=3, at_server=True)


@pytest.mark.quick
def test_a_counted_retry_counts_once_on_the_page_and_sends_it_again() -> None:
    doc = document(1, 1)
    doc.apply(Sent(0, URL), 0.0)
    doc.apply(SendAgain(0, counted=True), 0.0)
    assert doc.page(0).attempts == 1 and doc.pending == [0]
    doc.apply(Sent(0, "http://other/v1"), 0.0)
    doc.apply(SendAgain(0), 0.0)
    assert doc.page(0).attempts == 1, "an uncounted retry counted"


@pytest.mark.quick
def test_a_page_sent_again_after_a_wait_rests_until_now_plus_the_wait() -> None:
    """The wait of `SendAgain` is relative: applied at 100 s, a wait of 5 s ends at 105 s
    (not at 5 s, which is long past on a monotonic clock)."""
    doc = document(1, 1)
    doc.apply(Sent(0, URL), 100.0)
    doc.apply(SendAgain(0, wait=5.0, counted=True), 100.0)
    assert doc.page(0).phase == Resting(105.0)
    assert not doc.finished and doc.pages_left == 1
    doc.apply(Wake(), 104.9)
    assert doc.pending == [], "the page came back before its wait was over"
    doc.apply(Wake(), 105.0)
    assert doc.pending == [0] and not doc.resting


@pytest.mark.quick
def test_a_held_page_is_one_state_released_only_once_the_others_are_in() -> None:
    doc = document(1, 3)
    for page in (0, 1, 2):
        doc.apply(Sent(page, URL), 0.0)
    doc.apply(SendAgain(0, held=HELD), 0.0)
    assert doc.page(0).phase == HELD and not doc.resting, (
        "a held page should be held, and nothing else")
    assert doc.held() == [], "held while other pages are out"
    doc.apply(checkpointed(doc, 1), 0.0)
    doc.apply(checkpointed(doc, 2), 0.0)
    assert doc.held() == [0]
    doc.apply(Wake(), 1e12)
    assert doc.pending == [], "a held page woke by the clock"


@pytest.mark.quick
def test_an_answered_page_is_no_longer_a_suspect_and_keeps_no_earlier_answers() -> None:
    doc = document(1, 2)
    doc.apply(Sent(0, URL), 0.0)
    doc.apply(Sent(1, URL), 0.0)
    doc.apply(TakenBack(0, suspect=True), 0.0)
    assert doc.suspects == {0}
    ledger = doc.ledger(0).keeping({"b1": "an answer"}).counted(100)
    doc.apply(Sent(0, URL), 0.0)
    doc.apply(SendAgain(0, ledger=ledger), 0.0)
    assert doc.page(0).redo.keep == {"b1": "an answer"} and doc.budget.first_pass == 100
    doc.apply(Sent(0, URL), 0.0)
    doc.apply(checkpointed(doc, 0), 0.0)
    assert not doc.suspects and not doc.page(0).suspect
    assert doc.page(0).redo.keep == {} and doc.page(0).redo.best is None
    assert doc.budget.first_pass == 100, "answering a page lost the document's budget"


@pytest.mark.quick
def test_a_decision_shares_no_state_with_the_document_it_came_from() -> None:
    """Records are immutable: a ledger made from a page's record is a new value, and the
    document sees it only once the action carrying it is applied."""
    doc = document(1, 1)
    doc.apply(Sent(0, URL), 0.0)
    before = doc.page(0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.attempts = 3  # type: ignore[misc]
    choice, ledger = doc.ledger(0).counted(4096).decide(4096, 8192, looping=False)
    assert choice == Redo(8192)
    assert doc.page(0) == before and doc.budget == RedoBudget(), "deciding changed the document"
    doc.apply(SendAgain(0, ledger=ledger), 0.0)
    assert doc.page(0).redo.whole == Redo(8192) and doc.page(0).phase == PENDING
    assert doc.redone_pages == 1


@pytest.mark.quick
def test_failing_the_job_changes_no_page() -> None:
    doc = document(1, 2)
    doc.apply(Sent(0, URL), 0.0)
    doc.apply(FailJob(OcrvlError("gone")), 0.0)
    assert doc.sent == {0: SentPage(URL)} and doc.pending == [1]


@pytest.mark.quick
def test_small_means_few_pages_left_whatever_the_size() -> None:
    doc = document(1, SMALL_DOCUMENT_PAGES + 1)
    assert not doc.small
    doc.apply(Sent(0, URL), 0.0)
    doc.apply(checkpointed(doc, 0), 0.0)
    assert doc.small


@pytest.mark.quick
def test_pages_in_flight_are_counted_per_endpoint_over_documents() -> None:
    a, b = document(1, 3), document(2, 3)
    a.apply(Sent(0, URL), 0.0)
    a.apply(Sent(1, "http://b/v1"), 0.0)
    b.apply(Sent(0, URL), 0.0)
    assert pages_per_endpoint([a, b]) == {URL: 2, "http://b/v1": 1}

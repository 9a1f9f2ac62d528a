"""One active document's page states (`document.Document`), as plain values."""

from __future__ import annotations

import math

import pytest

from ocrvl_daemon.core.document import SMALL_DOCUMENT_PAGES, SentPage, pages_per_endpoint
from ocrvl_daemon.core.quality import WHOLE_PAGE, CutBlock, Held
from testkit.core import URL, document


@pytest.mark.quick
def test_a_page_goes_pending_sent_answered_and_is_counted_once() -> None:
    doc = document(1, 2)
    doc.send(0, URL)
    assert doc.pending == [1] and doc.sent == {0: SentPage(URL, 1)}
    doc.answered(0)
    assert doc.done == 1 and not doc.sent and not doc.finished
    doc.send(1, URL)
    doc.answered(1)
    assert doc.finished and doc.done == 2 and doc.pages_left == 0


@pytest.mark.quick
def test_a_page_given_back_returns_to_the_queue_in_order_once() -> None:
    doc = document(1, 5)
    for page in (0, 1, 2):
        doc.send(page, URL)
    doc.give_back(1)
    doc.give_back(1)
    assert doc.pending == [1, 3, 4] and set(doc.sent) == {0, 2}


@pytest.mark.quick
def test_a_counted_failure_shows_in_the_next_attempt_of_the_page() -> None:
    doc = document(1, 1)
    doc.send(0, URL)
    doc.count_attempt(0)
    doc.give_back(0)
    doc.send(0, "http://other/v1")
    assert doc.sent[0] == SentPage("http://other/v1", 2)


@pytest.mark.quick
def test_a_resting_page_returns_when_its_wait_is_over_not_before() -> None:
    doc = document(1, 1)
    doc.send(0, URL)
    doc.rest(0, until=10.0)
    assert not doc.finished and doc.pages_left == 1
    doc.wake(9.9)
    assert doc.pending == []
    doc.wake(10.0)
    assert doc.pending == [0] and not doc.resting


@pytest.mark.quick
def test_pages_held_for_later_are_released_only_once_the_others_are_in() -> None:
    doc = document(1, 3)
    for page in (0, 1, 2):
        doc.send(page, URL)
    doc.ledger.held[0] = Held((CutBlock(WHOLE_PAGE, 4096, looping=True),), 8192)
    doc.rest(0, math.inf)
    assert doc.held() == [], "held while other pages are out"
    doc.answered(1)
    doc.answered(2)
    assert doc.held() == [0]
    doc.wake(1e12)
    assert doc.pending == [], "a held page woke by the clock"


@pytest.mark.quick
def test_an_answered_page_is_no_longer_a_suspect_nor_in_the_ledger() -> None:
    doc = document(1, 2)
    doc.send(0, URL)
    doc.suspects.add(0)
    doc.ledger.held[0] = Held((CutBlock(WHOLE_PAGE, 4096, looping=True),), 8192)
    doc.answered(0)
    assert not doc.suspects and not doc.ledger.held


@pytest.mark.quick
def test_small_means_few_pages_left_whatever_the_size() -> None:
    doc = document(1, SMALL_DOCUMENT_PAGES + 1)
    assert not doc.small
    doc.send(0, URL)
    doc.answered(0)
    assert doc.small


@pytest.mark.quick
def test_pages_in_flight_are_counted_per_endpoint_over_documents() -> None:
    a, b = document(1, 3), document(2, 3)
    a.send(0, URL)
    a.send(1, "http://b/v1")
    b.send(0, URL)
    assert pages_per_endpoint([a, b]) == {URL: 2, "http://b/v1": 1}

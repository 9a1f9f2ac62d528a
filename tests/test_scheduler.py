"""Fair page picking across documents, and how many pages the converter hands the engine
(pure logic and a real store, no processes)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from stand_in_worker import converter_with_stand_in
from test_failure_policy import ReadyServer

from ocrvl_daemon.jobs import enqueue_file
from ocrvl_daemon.scheduler import (
    SMALL_DOCUMENT_PAGES,
    DocumentPages,
    pick_pages,
    pick_yielding,
    yield_room,
)
from ocrvl_daemon.worker.messages import PageResult
from ocrvl_daemon.worker.request_gate import SHORT_EXTRA, YieldCap, ready_margin
from testkit.documents import make_pdf


def doc(job_id: int, pages: int) -> DocumentPages:
    return DocumentPages(job_id, pages, list(range(pages)))


def finish(d: DocumentPages, page: int) -> None:
    d.in_flight.discard(page)
    d.done += 1


@pytest.mark.quick
def test_a_small_document_behind_a_big_book_gets_the_next_free_slots() -> None:
    book, letter = doc(1, 600), doc(2, 2)
    first = pick_pages([book], 64)
    assert len(first) == 64 and all(d is book for d, _ in first)
    # The letter arrives while the book fills every slot; two pages of the book finish.
    docs = [book, letter]
    assert pick_pages(docs, 0) == []
    finish(book, 0)
    finish(book, 1)
    chosen = pick_pages(docs, 2)
    assert [(d.job_id, p) for d, p in chosen] == [(2, 0), (2, 1)]
    assert letter.in_flight == {0, 1} and not letter.pending


@pytest.mark.quick
def test_one_free_slot_goes_to_the_document_with_fewest_pages_in_flight() -> None:
    book, letter = doc(1, 600), doc(2, 2)
    pick_pages([book], 8)
    finish(book, 0)
    (chosen,) = pick_pages([book, letter], 1)
    assert chosen == (letter, 0)
    finish(book, 1)
    (chosen,) = pick_pages([book, letter], 1)
    assert chosen == (letter, 1)


@pytest.mark.quick
def test_two_books_interleave_evenly_pages_in_order() -> None:
    a, b = doc(1, 100), doc(2, 100)
    chosen = pick_pages([a, b], 40)
    per_doc = Counter(d.job_id for d, _ in chosen)
    assert per_doc == {1: 20, 2: 20}
    for d in (a, b):
        pages = [p for x, p in chosen if x is d]
        assert pages == sorted(pages) == list(range(20))


@pytest.mark.quick
def test_many_small_documents_share_slots_shortest_first_then_oldest() -> None:
    docs = [doc(i, 2 + (i % 3)) for i in range(10)]
    chosen = pick_pages(docs, 10)
    assert sorted(d.job_id for d, _ in chosen) == list(range(10))  # one page each first
    # ties on pages in flight: fewest pages left first, then the oldest
    assert [d.job_id for d, _ in chosen[:4]] == [0, 3, 6, 9]


@pytest.mark.quick
def test_bounds_never_more_than_slots_or_pending() -> None:
    docs = [doc(1, 3), doc(2, 1)]
    assert pick_pages(docs, -5) == []
    chosen = pick_pages(docs, 100)
    assert len(chosen) == 4
    assert all(not d.pending for d in docs)
    assert pick_pages(docs, 10) == []
    assert pick_pages([], 10) == []


@pytest.mark.quick
def test_give_back_requeues_in_order_once() -> None:
    d = doc(1, 5)
    pick_pages([d], 3)
    assert d.pending == [3, 4] and d.in_flight == {0, 1, 2}
    d.give_back(1)
    d.give_back(1)
    assert d.pending == [1, 3, 4] and d.in_flight == {0, 2}
    assert not d.finished
    (chosen,) = pick_pages([d], 1)
    assert chosen == (d, 1)
    for p in (0, 1, 2):
        finish(d, p)
    pick_pages([d], 5)
    for p in (3, 4):
        finish(d, p)
    assert d.finished and d.done == 5


@pytest.mark.quick
def test_a_book_yields_to_a_letter_until_the_letter_is_done() -> None:
    limit = 64
    book, letter = doc(1, 600), doc(2, 2)
    pick_pages([book], limit)
    docs = [book, letter]
    chosen = pick_yielding(docs, 6, limit)
    assert [(d.job_id, p) for d, p in chosen] == [(2, 0), (2, 1)], (
        "the letter's pages must go first, and no book page beside them while the book has "
        "more than its yielded share in flight")
    share = yield_room(limit)
    book_share = share - len(letter.in_flight)  # the letter's pages count against the share
    for page in range(limit - book_share):  # the book's pages finish one by one
        finish(book, page)
        assert pick_yielding(docs, 1, limit) == [], (
            f"a book page was sent while the letter runs with {len(book.in_flight)} book and "
            f"{len(letter.in_flight)} letter pages in flight (the share of all: {share})")
    finish(book, limit - book_share)
    assert [d.job_id for d, _ in pick_yielding(docs, 4, limit)] == [1], (
        "below the yielded share the book must go on, one page per free place")
    finish(letter, 0)
    finish(letter, 1)
    assert len(pick_yielding([book], 40, limit)) == 40, (
        "once the letter is done the book must get the whole bound back")


@pytest.mark.quick
@pytest.mark.parametrize(("limit", "room"), [(8, 2), (64, 16), (128, 16), (256, 16)])
def test_beside_a_letter_a_book_keeps_a_quarter_of_the_bound_at_most_16_pages(
    limit: int, room: int
) -> None:
    book, letter = doc(1, 600), doc(2, 2)
    chosen = pick_yielding([book, letter], limit, limit)
    in_flight = len(chosen)
    assert in_flight == room, (
        f"at a bound of {limit} a letter decoded beside {in_flight} pages in all, not {room}: "
        "a bigger batch slows the letter whatever the bound")


@pytest.mark.quick
def test_letters_that_fill_the_yielded_share_hold_the_book_back_entirely() -> None:
    limit = 64
    share = yield_room(limit)
    book = doc(1, 600)
    letters = [doc(2 + n, 2) for n in range(share // 2)]
    pick_pages([book], limit)
    for page in range(limit):  # the whole first batch of the book finishes
        finish(book, page)
    chosen = pick_yielding([book, *letters], limit, limit)
    assert {d.job_id for d, _ in chosen} == {d.job_id for d in letters}, (
        f"with {len(letters)} letters running ({share} pages, the whole yielded share) a book "
        "page was sent beside them: each one adds to the batch the letters decode in")
    finish(letters[0], 0)
    assert [d.job_id for d, _ in pick_yielding([book, *letters], limit, limit)] == [1], (
        "a place freed under the yielded share must go to the book")


@pytest.mark.quick
def test_only_big_documents_yield_and_only_beside_a_small_one() -> None:
    limit = 64
    a, b = doc(1, 300), doc(2, 300)
    assert len(pick_yielding([a, b], 64, limit)) == 64, "two books beside each other yielded"
    a, b, article = doc(1, 300), doc(2, 300), doc(3, SMALL_DOCUMENT_PAGES + 1)
    pick_pages([a, b, article], 30)  # ten pages each in flight: more than the books' share
    chosen = pick_yielding([a, b, article], 6, limit)
    assert Counter(d.job_id for d, _ in chosen) == {1: 2, 2: 2, 3: 2}, (
        f"a document of {SMALL_DOCUMENT_PAGES + 1} pages left counted as small: the books "
        "yielded to it")
    other, tail = doc(4, 300), doc(5, 300)
    tail.pending = tail.pending[-SMALL_DOCUMENT_PAGES:]  # a book at its last pages
    pick_pages([other], 20)
    pick_pages([tail], 10)
    chosen = pick_yielding([other, tail], 8, limit)
    assert {d.job_id for d, _ in chosen} == {5}, (
        "a book at its last pages must finish first: the other book yields to it")


@pytest.mark.quick
def test_fairness_over_a_whole_run() -> None:
    """Simulate a server with 16 slots: the letter dropped mid-book finishes within ~1 round."""
    book = doc(1, 600)
    docs = [book]
    in_flight: list[tuple[DocumentPages, int]] = pick_pages(docs, 16)
    letter_done_at = None
    for step in range(1, 200):
        if step == 10:
            docs.append(doc(2, 2))
        d, p = in_flight.pop(0)  # oldest request finishes
        finish(d, p)
        in_flight += pick_pages([x for x in docs if not x.finished], 16 - len(in_flight))
        letter = docs[1] if len(docs) > 1 else None
        if letter is not None and letter.finished and letter_done_at is None:
            letter_done_at = step
    assert letter_done_at is not None and letter_done_at - 10 <= 16 + 2


def test_the_engine_gets_the_limit_plus_a_small_ready_margin_and_a_letter_goes_at_once(
    tmp_path: Path,
) -> None:
    converter, worker, store, config = converter_with_stand_in(tmp_path, [ReadyServer()])
    limit = converter.endpoint_load()[0].bound
    margin = ready_margin(limit)
    enqueue_file(store, make_pdf(tmp_path / "book.pdf", 200), config.model.name)

    def dispatch() -> None:
        """One tick of the converter (its clock stands still: no queue look-up unless told)."""
        converter.tick(0.0)

    converter.wake()
    dispatch()
    assert worker.limits == {ReadyServer.url: limit}, (
        "the worker's request gate was not told the limit")
    assert len(worker.in_flight) == margin, "pages not yet at the server are capped at the margin"
    while len(worker.in_flight) < limit + margin:
        worker.reach_server()
        before = len(worker.in_flight)
        dispatch()
        assert len(worker.in_flight) > before, "the ramp stalled"
    worker.reach_server()
    dispatch()
    assert len(worker.in_flight) == limit + margin, "never more than limit + margin in flight"

    letter = enqueue_file(store, make_pdf(tmp_path / "letter.pdf", 2), config.model.name)
    converter.wake()
    dispatch()
    assert worker.order[-2:] == [(letter.id, 0), (letter.id, 1)], (
        "a letter's pages must go to the engine at once, not wait until a book page finishes"
    )
    assert len(worker.in_flight) == limit + margin + 2
    book = worker.order[0][0]
    assert worker.priorities[letter.id] == 1 < worker.priorities[book], (
        "the letter's pages must be marked as its first two in flight, so that the worker's "
        "request gate lets them bump or pass the book's"
    )
    memo = enqueue_file(store, make_pdf(tmp_path / "memo.pdf", 5), config.model.name)
    converter.wake()
    dispatch()
    assert sum(job == memo.id for job, _ in worker.order) == SHORT_EXTRA - 2, (
        "documents short of pages may only go a few pages beyond limit + margin"
    )
    worker.results += [PageResult(*key) for key in sorted(worker.sent)[:SHORT_EXTRA]]
    worker.reach_server()
    dispatch()
    assert [job for job, _ in worker.order[-2:]] == [memo.id, memo.id], (
        "the memo's pages must take the next free slots, ahead of the book's"
    )
    store.close()


def test_the_converter_holds_the_book_back_while_a_letter_runs_and_resumes_it_after(
    tmp_path: Path,
) -> None:
    converter, worker, store, config = converter_with_stand_in(tmp_path, [ReadyServer()])
    limit = converter.endpoint_load()[0].bound
    share = yield_room(limit)
    enqueue_file(store, make_pdf(tmp_path / "book.pdf", 200), config.model.name)
    converter.wake()
    while len(worker.in_flight) < limit:  # the book ramps up to the bound
        worker.reach_server()
        converter.tick(0.0)
    book = worker.order[0][0]
    letter = enqueue_file(store, make_pdf(tmp_path / "letter.pdf", 2), config.model.name)
    converter.wake()
    converter.tick(0.0)
    assert worker.order[-2:] == [(letter.id, 0), (letter.id, 1)], "the letter did not go at once"
    assert worker.caps == {ReadyServer.url: YieldCap(share, frozenset({book}))}, (
        f"beside the letter the worker's request gate must hold the book to {share} requests "
        f"(and take its young ones above that back from the server): {worker.caps}")

    def book_in_flight() -> int:
        return sum(job == book for job, _ in worker.in_flight)

    book_share = share - 2  # the letter's two pages count against the share
    while book_in_flight() > book_share:  # book pages finish; the letter is still running
        worker.results.append(PageResult(*min(k for k in worker.in_flight if k[0] == book)))
        worker.reach_server()
        converter.tick(0.0)
    before = len(worker.order)
    worker.results.append(PageResult(*min(k for k in worker.in_flight if k[0] == book)))
    worker.reach_server()
    converter.tick(0.0)
    assert book_in_flight() == book_share and len(worker.order) == before + 1, (
        f"while the letter runs the server must carry {share} pages in all (a quarter of the "
        f"bound {limit}), the letter's 2 and {book_share} of the book, no more and no fewer; "
        f"the book has {book_in_flight()}")
    worker.results += [PageResult(letter.id, 0), PageResult(letter.id, 1)]
    for _ in range(limit):
        worker.reach_server()
        converter.tick(0.0)
    assert book_in_flight() >= limit, (
        f"once the letter is done the book must fill the bound again; it has {book_in_flight()}")
    assert worker.caps == {ReadyServer.url: None}, "the book stayed capped after the letter"
    store.close()

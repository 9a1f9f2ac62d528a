"""What is sent next (`plan.plan`): fair page picking across documents, how many pages the
engine gets, the yield to small documents, crash isolation; as plain functions, then through
a converter with a stand-in worker and a real store."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from ocrvl_daemon.core.actions import ReachedServer, Sent, TakenBack
from ocrvl_daemon.core.document import SMALL_DOCUMENT_PAGES, Document
from ocrvl_daemon.core.messages import SHORT_OF_PAGES, GateLimit, PageResult, YieldCap
from ocrvl_daemon.core.plan import SHORT_EXTRA, EndpointRoom, Plan, plan, ready_margin, yield_room
from ocrvl_daemon.storage.jobs import enqueue_file
from testkit.core import URL, checkpointed, document, job
from testkit.documents import make_pdf
from testkit.stand_in_worker import ReadyServer, converter_with_stand_in


def step(docs: list[Document], limit: int, reach_server: bool = True,
         suspects_together: int = 1) -> Plan:
    """One plan for one endpoint of bound `limit` and one worker, carried out on `docs`;
    every page in flight then reaches the server, unless `reach_server` is off."""
    in_flight = sum(len(d.sent) for d in docs)
    planned = plan(docs, [EndpointRoom(URL, limit, in_flight)], [1], suspects_together)
    for send in planned.sends:
        send.document.apply(Sent(send.page, send.url, send.worker), 0.0)
    for doc in docs:
        for page in doc.sent if reach_server else ():
            doc.apply(ReachedServer(page), 0.0)
    return planned


def sent(planned: Plan) -> list[tuple[int, int]]:
    """(job id, page) of each page the plan sends, in order."""
    return [(s.document.job_id, s.page) for s in planned.sends]


def fill(docs: list[Document], limit: int) -> None:
    """Plan until nothing more goes out (each page reaching the server at once)."""
    while step(docs, limit).sends:
        pass


def finish(doc: Document, page: int) -> None:
    doc.apply(checkpointed(doc, page), 0.0)


@pytest.mark.quick
def test_a_letter_dropped_behind_a_full_book_goes_at_once_ahead_of_the_book() -> None:
    book = document(1, 600)
    fill([book], 64)
    assert len(book.sent) == 64 + ready_margin(64)
    letter = document(2, 2)
    assert sent(step([book, letter], 64)) == [(2, 0), (2, 1)]
    finish(book, 0)
    finish(book, 1)
    assert sent(step([book, letter], 64)) == [], (
        "the book took places beside the letter above its yielded share")


@pytest.mark.quick
def test_one_free_slot_goes_to_the_document_with_fewest_pages_in_flight() -> None:
    a, b = document(1, 600), document(2, 600)
    for doc, count in ((a, 40), (b, 27)):
        for page in range(count):
            doc.apply(Sent(page, URL), 0.0)
            doc.apply(ReachedServer(page), 0.0)
    assert sent(step([a, b], 64)) == [(2, 27)], "64 + a margin of 4, less 67 in flight: one slot"


@pytest.mark.quick
def test_two_books_interleave_evenly_pages_in_order() -> None:
    a, b = document(1, 100), document(2, 100)
    fill([a, b], 40)
    assert len(a.sent) == len(b.sent) == 21
    for d in (a, b):
        assert sorted(d.sent) == list(range(21))


@pytest.mark.quick
def test_many_small_documents_share_slots_shortest_first_then_oldest() -> None:
    docs = [document(i, 2 + (i % 3)) for i in range(10)]
    chosen = sent(step(docs, 8))
    assert sorted(job for job, _ in chosen[:10]) == list(range(10)), "one page each first"
    # ties on pages in flight: fewest pages left first, then the oldest
    assert [job for job, _ in chosen[:4]] == [0, 3, 6, 9]


@pytest.mark.quick
def test_no_page_is_sent_twice_and_nothing_without_an_endpoint() -> None:
    docs = [document(1, 3), document(2, 1)]
    assert plan(docs, [], [1]) == Plan((), ())
    assert plan(docs, [EndpointRoom(URL, 64, 0)], []) == Plan((), ()), "sent with no worker"
    fill(docs, 64)
    assert all(not d.pending for d in docs) and sum(len(d.sent) for d in docs) == 4
    assert plan([], [EndpointRoom(URL, 64, 0)], [1]).sends == ()


@pytest.mark.quick
def test_pages_being_prepared_are_capped_at_the_ready_margin() -> None:
    book = document(1, 600)
    for page in range(SHORT_OF_PAGES):
        book.apply(Sent(page, URL), 0.0)
    assert len(step([book], 64, reach_server=False).sends) == ready_margin(64) - SHORT_OF_PAGES
    assert step([book], 64).sends == (), "more pages queued inside the worker"
    assert len(step([book], 64).sends) == ready_margin(64), "pages at the server free room"


@pytest.mark.quick
def test_a_book_yields_to_a_letter_until_the_letter_is_done() -> None:
    limit = 64
    book, letter = document(1, 600), document(2, 2)
    fill([book], limit)
    docs = [book, letter]
    assert sent(step(docs, limit)) == [(2, 0), (2, 1)]
    share = yield_room(limit)
    book_share = share - len(letter.sent)  # the letter's pages count against the share
    for page in range(len(book.sent) - book_share):  # the book's pages finish one by one
        finish(book, page)
        assert step(docs, limit).sends == (), (
            f"a book page was sent while the letter runs with {len(book.sent)} book and "
            f"{len(letter.sent)} letter pages in flight (the share of all: {share})")
    finish(book, min(book.sent))
    assert [s.document for s in step(docs, limit).sends] == [book], (
        "below the yielded share the book must go on, one page per free place")
    finish(letter, 0)
    finish(letter, 1)
    fill([book], limit)
    assert len(book.sent) == limit + ready_margin(limit), (
        "once the letter is done the book must get the whole bound back")


@pytest.mark.quick
@pytest.mark.parametrize("limit", [64, 128, 256])
def test_beside_a_letter_a_book_keeps_a_quarter_of_the_bound_at_most_16_pages(
    limit: int
) -> None:
    book, letter = document(1, 600), document(2, 2)
    fill([book, letter], limit)
    in_flight = len(book.sent) + len(letter.sent)
    assert in_flight == yield_room(limit) == min(limit // 4, 16), (
        f"at a bound of {limit} a letter decoded beside {in_flight} pages in all: a bigger "
        "batch slows the letter whatever the bound")


@pytest.mark.quick
def test_letters_that_fill_the_yielded_share_hold_the_book_back_entirely() -> None:
    limit = 64
    share = yield_room(limit)
    book = document(1, 600)
    fill([book], limit)
    for page in sorted(book.sent)[SHORT_OF_PAGES:]:  # most of the book's first batch is in
        finish(book, page)
    letters = [document(2 + n, 2) for n in range((share - SHORT_OF_PAGES) // 2)]
    chosen = step([book, *letters], limit)
    assert {s.document.job_id for s in chosen.sends} == {d.job_id for d in letters}, (
        f"with {len(letters)} letters running (the whole yielded share with the book's own) "
        "a book page was sent beside them: each one adds to the batch the letters decode in")
    finish(letters[0], 0)
    assert [s.document for s in step([book, *letters], limit).sends] == [book], (
        "a place freed under the yielded share must go to the book")


@pytest.mark.quick
def test_only_big_documents_yield_and_only_beside_a_small_one() -> None:
    limit = 64
    a, b = document(1, 300), document(2, 300)
    assert step([a, b], limit).gates == (GateLimit(URL, limit),), "two books yielded"
    article = document(3, SMALL_DOCUMENT_PAGES + 1)
    assert step([a, b, article], limit).gates == (GateLimit(URL, limit),), (
        f"a document of {SMALL_DOCUMENT_PAGES + 1} pages left counted as small")
    other = document(4, 300)
    tail = Document(job(5, 300), 300, range(300 - SMALL_DOCUMENT_PAGES, 300))  # at its end
    assert step([other, tail], limit).gates == (
        GateLimit(URL, limit, YieldCap(yield_room(limit), frozenset({4}))),), (
        "a book at its last pages must finish first: the other book yields to it")


@pytest.mark.quick
def test_each_page_goes_to_the_endpoint_with_the_most_room_for_its_bound() -> None:
    book = document(1, 600)
    rooms = [EndpointRoom("http://a/v1", 48, 40), EndpointRoom("http://b/v1", 16, 4)]
    planned = plan([book], rooms, [1])
    urls = Counter(s.url for s in planned.sends)
    assert urls == {"http://b/v1": 4}, f"{urls}: pages went to the fuller endpoint"
    assert [s.priority for s in planned.sends] == [0, 1, 2, 3], (
        "each page's priority is its document's pages in flight before it")


@pytest.mark.quick
def test_each_worker_gets_its_next_page_to_prepare_the_one_with_fewest_at_the_server_first(
        ) -> None:  # fmt: skip
    book = document(1, 600)
    for page in range(8):
        book.apply(Sent(page, URL, worker=1 if page < 6 else 2), 0.0)
        book.apply(ReachedServer(page), 0.0)
    planned = plan([book], [EndpointRoom(URL, 64, 8)], [1, 2])
    order = [s.worker for s in planned.sends]
    assert order == [2, 2, 1, 1], (
        f"{order}: each worker must get a page being prepared and the next, the worker with "
        "fewer pages at the server first")


@pytest.mark.quick
def test_six_engine_workers_each_have_their_next_page_while_the_book_ramps_up() -> None:
    """Six workers laying out pages on the CPU shared 4 pages in preparation: two always
    idle, the book at half the layout model's speed."""
    book = document(1, 600)
    workers = [1, 2, 3, 4, 5, 6]
    planned = plan([book], [EndpointRoom(URL, 64, 0)], workers)
    for s in planned.sends:
        book.apply(Sent(s.page, s.url, s.worker), 0.0)
    assert Counter(s.worker for s in planned.sends) == {w: 2 for w in workers}, (
        "some engine workers were left without pages to prepare")
    book.apply(ReachedServer(0), 0.0)  # worker 1's first page is laid out and its blocks went out
    again = plan([book], [EndpointRoom(URL, 64, 12)], workers)
    assert [(s.worker, s.page) for s in again.sends] == [(1, 12)], (
        "the worker that finished preparing a page did not get the next one")


@pytest.mark.quick
def test_after_a_crash_only_the_suspects_go_a_few_at_a_time() -> None:
    book, letter = document(1, 100), document(2, 2)
    for page in (3, 5, 7):  # in flight together at a crash
        book.apply(Sent(page, URL), 0.0)
        book.apply(TakenBack(page, suspect=True), 0.0)
    chosen = sent(step([book, letter], 64, suspects_together=2))
    assert chosen == [(1, 3), (1, 5)], "pages other than the suspects went during isolation"
    assert step([book, letter], 64, suspects_together=2).sends == ()
    finish(book, 3)
    assert sent(step([book, letter], 64, suspects_together=2)) == [(1, 7)]
    finish(book, 5)
    finish(book, 7)
    assert (2, 0) in sent(step([book, letter], 64)), "the isolation did not end"


@pytest.mark.quick
def test_a_letter_dropped_mid_book_finishes_within_about_one_round() -> None:
    """Simulate a server with 16 places: the letter dropped mid-book is done within ~1 round."""
    book = document(1, 600)
    docs = [book]
    in_flight = [(book, s.page) for s in step(docs, 16).sends]
    letter_done_at = None
    for tick in range(1, 200):
        if tick == 10:
            docs.append(document(2, 2))
        if in_flight:
            d, p = in_flight.pop(0)  # the oldest request finishes
            finish(d, p)
        in_flight += [(s.document, s.page) for s in step([x for x in docs if not x.finished],
                                                         16).sends]
        if len(docs) > 1 and docs[1].finished and letter_done_at is None:
            letter_done_at = tick
    assert letter_done_at is not None and letter_done_at - 10 <= 16 + 2


def test_the_engine_gets_the_limit_plus_a_small_ready_margin_and_a_letter_goes_at_once(
    tmp_path: Path,
) -> None:
    converter, worker, store, config = converter_with_stand_in(tmp_path, [ReadyServer()])
    limit = converter.endpoint_load()[0].bound
    margin = ready_margin(limit)
    enqueue_file(store, make_pdf(tmp_path / "book.pdf", 200), config.recipe)

    def dispatch() -> None:
        """One tick of the converter (its clock stands still: no queue look-up unless told)."""
        converter.tick(0.0)

    converter.wake()
    dispatch()
    assert worker.gates == {ReadyServer.url: GateLimit(ReadyServer.url, limit)}, (
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

    letter = enqueue_file(store, make_pdf(tmp_path / "letter.pdf", 2), config.recipe)
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
    memo = enqueue_file(store, make_pdf(tmp_path / "memo.pdf", 5), config.recipe)
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
    enqueue_file(store, make_pdf(tmp_path / "book.pdf", 200), config.recipe)
    converter.wake()
    while len(worker.in_flight) < limit:  # the book ramps up to the bound
        worker.reach_server()
        converter.tick(0.0)
    book = worker.order[0][0]
    letter = enqueue_file(store, make_pdf(tmp_path / "letter.pdf", 2), config.recipe)
    converter.wake()
    converter.tick(0.0)
    assert worker.order[-2:] == [(letter.id, 0), (letter.id, 1)], "the letter did not go at once"
    assert worker.gates[ReadyServer.url].cap == YieldCap(share, frozenset({book})), (
        f"beside the letter the worker's request gate must hold the book to {share} requests "
        f"(and take its young ones above that back from the server): {worker.gates}")

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
    assert worker.gates[ReadyServer.url].cap is None, "the book stayed capped after the letter"
    store.close()

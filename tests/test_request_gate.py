"""The worker's request gate: the server holds exactly as many requests as the concurrency
search allows, also below `max_concurrency` (a probe or a back-off)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.messages import SHORT_OF_PAGES, GateLimit, PageResult, PageTask, YieldCap
from ocrvl_daemon.engine.worker_handle import EngineWorker
from ocrvl_daemon.worker.request_gate import GatedRequest, RequestGate
from testkit.documents import make_pdf, sent_width
from testkit.harness import free_port, start_fake_server, wait_until
from testkit.stand_in_worker import real_worker


def test_gate_holds_requests_above_the_limit_and_follows_resizes() -> None:
    gate = RequestGate(2)
    done = threading.Event()
    entered: list[int] = []

    def request(n: int) -> None:
        place = gate.acquire()
        entered.append(n)
        done.wait(10)
        gate.release(place)

    threads = [threading.Thread(target=request, args=(n,), daemon=True) for n in range(6)]
    for t in threads:
        t.start()
    wait_until(lambda: len(entered) == 2, 5, what="two requests through a gate of 2")
    assert gate.open == 2, "a third request passed a gate of 2"

    gate.resize(4)
    wait_until(lambda: len(entered) == 4, 5, what="the gate to let two more through once widened")
    gate.resize(1)  # narrowed: those already through go on, nobody new enters
    assert gate.open == 4 and len(entered) == 4

    done.set()
    wait_until(lambda: len(entered) == 6, 5, what="the waiting requests once the others ended")
    for t in threads:
        t.join(5)
    assert gate.open == 0, "a place was not given back"


@pytest.mark.quick
def test_a_letters_request_passes_the_book_pages_already_waiting() -> None:
    """Waiting requests go fewest-pages-of-their-document-in-flight first, then in order."""
    gate = RequestGate(1)
    first = gate.acquire()  # the server is full
    order: list[str] = []

    def request(name: str, priority: int) -> None:
        place = gate.acquire(priority)
        order.append(name)
        gate.release(place)

    threads = []
    for n, (name, priority) in enumerate((("book p.65", 64), ("book p.66", 64), ("letter p.1", 1))):
        threads.append(threading.Thread(target=request, args=(name, priority), daemon=True))
        threads[-1].start()
        wait_until(lambda n=n: gate.waiting == n + 1, 5, what=f"{name} to wait")
    gate.release(first)
    for t in threads:
        t.join(5)
    assert order == ["letter p.1", "book p.65", "book p.66"], (
        f"the letter's request should pass the book's waiting ones: {order}"
    )


class Server:
    """Requests as futures that a test answers by hand, in the order they were sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Future[str]]] = []

    def request(self, gate: RequestGate, name: str, priority: int,
                document: int | None = None, queued: bool = False) -> GatedRequest:
        """Send request `name` through `gate`; the server runs it at once, or with `queued`
        it waits in the server's own queue (no answer begins)."""
        def start(started: Callable[[], None]) -> Future[str]:
            future: Future[str] = Future()
            self.sent.append((name, future))
            if not queued:
                started()
            return future

        request = GatedRequest(gate, start, priority, document)
        threading.Thread(target=request.send, daemon=True).start()
        return request

    def answer_all(self) -> None:
        for name, future in self.sent:
            if not future.done():
                future.set_result(f"answer to {name}")

    def names(self) -> list[str]:
        return [name for name, _ in self.sent]


def test_a_letter_does_not_wait_for_a_full_batch_of_young_book_pages() -> None:
    gate, server = RequestGate(2, bump_after=0.0), Server()
    old = server.request(gate, "book p.1", 64)
    wait_until(lambda: gate.open == 1, 5, what="book p.1 to be sent")
    young = server.request(gate, "book p.2", 64)
    wait_until(lambda: gate.open == 2, 5, what="book p.2 to be sent")
    waiting = server.request(gate, "book p.3", 64)
    wait_until(lambda: gate.waiting == 1, 5, what="book p.3 to wait for a place")

    letter = server.request(gate, "letter p.1", 0)
    wait_until(lambda: "letter p.1" in server.names(), 5,
               what="the letter's request to be sent while the server is full")
    assert gate.open == 2, "the letter went past the limit instead of taking a bumped place"
    assert server.sent[1][1].cancelled(), "the youngest book request was not the one bumped"
    assert not old.future.done() and not young.future.done()

    server.sent[0][1].set_result("answer to book p.1")  # a place frees: the bumped one first
    wait_until(lambda: server.names().count("book p.2") == 2, 5,
               what="the bumped request to be sent again")
    assert "book p.3" not in server.names(), "the bumped request lost its turn"
    server.answer_all()
    wait_until(lambda: "book p.3" in server.names(), 5, what="book p.3 to be sent at last")
    server.answer_all()
    assert young.future.result(5) == "answer to book p.2", "the bumped page lost its answer"
    for request in (old, waiting, letter):
        assert request.future.result(5).startswith("answer to")
    assert gate.bumps == 1 and gate.open == 0


@pytest.mark.parametrize(
    "letter_priority, book_priority, book_age, bump_after, why",
    [
        (SHORT_OF_PAGES, 64, 0.0, 0.0, "a document with several pages in flight bumped"),
        (0, RequestGate.BUMP_GAP - 1, 0.0, 0.0, "a request of a nearly as short document bumped"),
        (0, 64, RequestGate.BUMP_MAX_AGE + 1, 0.0, "a request that had run for long was bumped"),
        (0, 64, 0.0, 60.0, "the letter bumped at once instead of waiting for a place a moment"),
    ],
)
def test_requests_are_bumped_only_for_a_short_document_only_when_young_and_not_at_once(
    letter_priority: int, book_priority: int, book_age: float, bump_after: float, why: str
) -> None:
    gate, server = RequestGate(1, bump_after=bump_after), Server()
    book = server.request(gate, "book p.1", book_priority)
    wait_until(lambda: gate.open == 1 and server.names(), 5, what="the book request to be sent")
    gate._open[0].since -= book_age
    server.request(gate, "letter p.1", letter_priority)
    wait_until(lambda: gate.waiting == 1, 5, what="the letter's request to wait")
    assert not book.future.done() and gate.bumps == 0, why
    server.answer_all()
    wait_until(lambda: "letter p.1" in server.names(), 5, what="the letter's request once free")
    server.answer_all()


def test_beside_a_letter_a_books_young_requests_above_the_cap_wait_until_the_cap_is_lifted(
) -> None:
    """Book (job 1) requests: one that has run long, five young ones; job 3's young request
    is not capped. A cap of 2 for job 1 takes back its four youngest, not the long-running
    one; the letter goes at once; the taken-back ones go again only once the cap is lifted."""
    gate, server = RequestGate(16), Server()
    book = []
    for n in range(6):
        book.append(server.request(gate, f"book p.{n + 1}", 64, document=1))
        wait_until(lambda n=n: gate.open == n + 1, 5, what=f"book p.{n + 1} to be sent")
        if n == 0:
            gate._open[0].since -= RequestGate.BUMP_MAX_AGE + 1  # it has run for long
    other = server.request(gate, "other book p.1", 64, document=3)
    wait_until(lambda: gate.open == 7, 5, what="the other book's request to be sent")

    gate.resize(16, YieldCap(2, frozenset({1})))
    taken_back = [name for name, future in server.sent if future.cancelled()]
    assert taken_back == ["book p.3", "book p.4", "book p.5", "book p.6"], (
        f"taken back from the server: {taken_back}; expected the book's four youngest, "
        "leaving its long-running request and its oldest young one")
    assert gate.taken_back == 4
    letter = server.request(gate, "letter p.1", 0, document=2)
    wait_until(lambda: "letter p.1" in server.names(), 5,
               what="the letter's request to be sent at once beside the capped book")
    assert server.names().count("book p.3") == 1, "a taken-back request went again under the cap"
    wait_until(lambda: gate.waiting == 4, 5, what="the four taken-back requests to wait")

    gate.resize(16)  # the letter is done: no cap
    wait_until(lambda: all(server.names().count(f"book p.{n}") == 2 for n in range(3, 7)), 5,
               what="the taken-back requests to be sent again once the cap was lifted")
    server.answer_all()
    for n, request in enumerate(book):
        assert request.future.result(5) == f"answer to book p.{n + 1}", (
            f"book p.{n + 1} lost its answer after being taken back")
    assert letter.future.result(5) == "answer to letter p.1"
    assert other.future.result(5) == "answer to other book p.1"
    assert gate.open == 0 and gate.waiting == 0


@pytest.mark.quick
def test_beside_a_letter_a_books_requests_still_queued_at_the_server_are_taken_back_at_any_age(
) -> None:
    """A server that runs few requests at once holds the rest of a book's batch in its own
    queue long after they were sent. Capped beside a letter, the book keeps what the server
    runs and QUEUED_WHILE_CAPPED queued ones, however old the others are: the letter's
    request then has at most those ahead of it at the server."""
    gate, server = RequestGate(16), Server()
    for n in range(8):  # two run at the server, six wait in its queue; all sent long ago
        server.request(gate, f"book p.{n + 1}", 64, document=1, queued=n >= 2)
        wait_until(lambda n=n: gate.open == n + 1, 5, what=f"book p.{n + 1} to be sent")
    for place in gate._open:
        place.since -= RequestGate.BUMP_MAX_AGE + 10

    gate.resize(16, YieldCap(8, frozenset({1})))
    taken_back = [name for name, future in server.sent if future.cancelled()]
    assert taken_back == [f"book p.{n}" for n in range(5, 9)], (
        f"taken back: {taken_back}; expected the four youngest of the six still queued at the "
        "server, old as they were, and none that the server runs")
    server.request(gate, "letter p.1", 0, document=2, queued=True)
    wait_until(lambda: "letter p.1" in server.names(), 5, what="the letter's request to be sent")
    assert server.names().index("letter p.1") == 8, "a taken-back book request went first"
    wait_until(lambda: gate.waiting == 4, 5, what="the taken-back requests to wait")
    assert server.names().count("book p.5") == 1, (
        "a taken-back request went to the server's queue again while two of its book waited")
    server.answer_all()


@pytest.mark.quick
def test_a_letter_bumps_a_books_request_still_queued_at_the_server_however_old() -> None:
    gate, server = RequestGate(2, bump_after=0.0), Server()
    server.request(gate, "book p.1", 64, document=1)
    server.request(gate, "book p.2", 64, document=1, queued=True)
    wait_until(lambda: gate.open == 2, 5, what="the book's two requests to be sent")
    for place in gate._open:
        place.since -= RequestGate.BUMP_MAX_AGE + 10
    server.request(gate, "letter p.1", 0, document=2)
    wait_until(lambda: "letter p.1" in server.names(), 5,
               what="the letter's request to pass the old book request queued at the server")
    bumped = [name for name, future in server.sent if future.cancelled()]
    assert bumped == ["book p.2"], f"bumped {bumped}: not the one the server had not started"
    server.answer_all()
    wait_until(lambda: server.names().count("book p.2") == 2, 5, what="book p.2 sent again")
    server.answer_all()


@pytest.mark.quick
def test_a_cancelled_request_gives_its_place_back_and_is_not_sent_again() -> None:
    gate, server = RequestGate(1), Server()
    request = server.request(gate, "book p.1", 64)
    wait_until(lambda: gate.open == 1, 5, what="the request to be sent")
    request.future.cancel()  # PaddleX cancels what is pending when a page fails
    assert server.sent[0][1].cancelled(), "the request at the server was not cancelled"
    wait_until(lambda: gate.open == 0, 5, what="the place to be given back")
    assert server.names() == ["book p.1"]


def test_a_bumped_request_cancelled_before_it_is_sent_again_is_not_sent_again() -> None:
    gate, server = RequestGate(1, bump_after=0.0), Server()
    book = server.request(gate, "book p.1", 64)
    wait_until(lambda: server.names() == ["book p.1"], 5, what="the book request to be sent")
    server.request(gate, "letter p.1", 0)
    wait_until(lambda: "letter p.1" in server.names() and gate.waiting == 1, 5,
               what="the letter to bump the book request, which waits to be sent again")
    book.future.cancel()  # its page failed meanwhile
    server.answer_all()
    wait_until(lambda: gate.open == 0 and gate.waiting == 0, 5,
               what="the cancelled request to leave the line without a place")
    assert server.names() == ["book p.1", "letter p.1"], "a cancelled request was sent again"


@contextmanager
def running_worker(config: Config) -> Iterator[EngineWorker]:
    """A real engine worker, started and ready; stopped afterwards."""
    worker = real_worker(config)
    worker.start()
    try:
        wait_until(lambda: worker.collect() == [] and worker.ready, 120,
                   what="the engine worker to start")
        yield worker
    finally:
        worker.stop()


def submit_pages(worker: EngineWorker, url: str, job: int, pdf: Path, pages: int,
                 priority: int = 0) -> None:
    stat = pdf.stat()
    for page in range(pages):
        worker.submit(PageTask(job, str(pdf), page, 1024, stat.st_size, stat.st_mtime,
                               priority=priority, url=url))


def results_of(worker: EngineWorker, count: int) -> list[PageResult]:
    """Wait for `count` page results; each must have succeeded."""
    results: list[PageResult] = []
    wait_until(lambda: results.extend(worker.collect()) or len(results) == count, 120,
               what=f"all {count} pages back")
    assert all(r.error is None for r in results), [r.error for r in results if r.error]
    return results


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    best = now = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def test_the_server_never_holds_more_requests_than_the_limit_below_the_maximum(
    tmp_path: Path,
) -> None:
    """A real worker (max_concurrency 8) told a limit of 3: at most 3 requests ever overlap."""
    log = tmp_path / "requests.jsonl"
    pdf = make_pdf(tmp_path / "book.pdf", 12)
    config = Config.model_validate({
        "state_dir": str(tmp_path / "state"),
        "pipeline": {"use_layout_detection": False, "max_concurrency": 8},
    })
    with (
        start_fake_server(free_port(), "--step-t0-ms", "5", "--output-tokens", "fixed:40",
                          "--request-log", str(log)) as srv,
        running_worker(config) as worker,
    ):
        worker.set_limit(GateLimit(srv.api_url, 3))
        submit_pages(worker, srv.api_url, 1, pdf, 12)
        results_of(worker, 12)
    records = [json.loads(line) for line in log.read_text("utf-8").splitlines() if line]
    overlap = max_overlap([(r["t"], r["done"]) for r in records])
    assert overlap <= 3, f"{overlap} requests were at the server at once with a limit of 3"
    assert overlap == 3, f"only {overlap} at once: the limit of 3 was not used"


def test_a_letter_dropped_just_after_a_book_started_reaches_the_server_at_once(
    tmp_path: Path,
) -> None:
    """A real worker with a full batch of young book pages: the letter's page bumps one of them
    (aborted at the server, sent again later), and every page still comes back right."""
    log, book, letter, config = book_and_letter(tmp_path, 6, max_concurrency=4)
    with (
        start_fake_server(free_port(), "--step-t0-ms", "20", "--output-tokens", "fixed:150",
                          "--request-log", str(log)) as srv,
        running_worker(config) as worker,
    ):
        submit_pages(worker, srv.api_url, 1, book, 6, priority=64)
        wait_until(lambda: srv.stats()["running"] == 4, 30, what="four book pages at the server")
        submit_pages(worker, srv.api_url, 2, letter, 1)
        results = results_of(worker, 7)
    records = request_records(log)
    first_book_done = min(r["done"] for r in records if r["status"] == 200)
    assert letter_request(results, records)["t"] < first_book_done, (
        "the letter's page waited for a book page to finish instead of starting at once"
    )
    assert [r["status"] for r in records].count(499) == 1, "no book request was bumped"
    assert_each_page_has_its_own_text(results)


def book_and_letter(
    tmp_path: Path, book_pages: int, max_concurrency: int
) -> tuple[Path, Path, Path, Config]:
    """Where the fake server logs requests, a book (job 1), a one-page letter (job 2), and a
    worker configuration sending pages whole."""
    config = Config.model_validate({
        "state_dir": str(tmp_path / "state"),
        "pipeline": {"use_layout_detection": False, "max_concurrency": max_concurrency},
    })
    return (tmp_path / "requests.jsonl", make_pdf(tmp_path / "book.pdf", book_pages),
            make_pdf(tmp_path / "letter.pdf", 1, seed=1), config)


def request_records(log: Path) -> list[dict[str, Any]]:
    """The fake server's request log, one record per chat request."""
    return [json.loads(line) for line in log.read_text("utf-8").splitlines() if line]


def letter_request(results: list[PageResult], records: list[dict[str, Any]]) -> dict[str, Any]:
    """The request of the letter's (job 2's) page, found by its image's digest."""
    letter_md = next(r.markdown for r in results if r.job_id == 2)
    digest = re.search(r"sha=(\w+)", letter_md).group(1)  # type: ignore[union-attr]
    return next(r for r in records if r["digest"] == digest)


def assert_each_page_has_its_own_text(results: list[PageResult]) -> None:
    for res in results:
        assert f"fake-ocr OCR {sent_width(res.page)}x" in res.markdown, (
            f"{'book' if res.job_id == 1 else 'letter'} p.{res.page + 1} came back with "
            "another page's text")


def test_a_letter_dropped_during_a_books_first_batch_is_not_prepared_behind_it_at_the_server(
    tmp_path: Path,
) -> None:
    """vLLM's API process prepares images one at a time, so a book's first batch, sent at
    once, is mostly still queued there when a letter arrives. Capped beside the letter, the
    book's young requests are taken back from that queue: the letter's image is prepared next,
    and the book's pages go again once the cap is lifted, every one coming back right."""
    log, book, letter, config = book_and_letter(tmp_path, 12, max_concurrency=12)
    results: list[PageResult] = []
    with (
        start_fake_server(free_port(), "--prepare-ms-per-image", "300", "--step-t0-ms", "5",
                          "--output-tokens", "fixed:20", "--request-log", str(log)) as srv,
        running_worker(config) as worker,
    ):
        worker.set_limit(GateLimit(srv.api_url, 12))
        submit_pages(worker, srv.api_url, 1, book, 12, priority=64)
        wait_until(lambda: srv.stats()["requests_received"] == 12, 30,
                   what="the book's twelve requests at the server")
        worker.set_limit(GateLimit(srv.api_url, 12, YieldCap(2, frozenset({1}))))
        submit_pages(worker, srv.api_url, 2, letter, 1)
        wait_until(lambda: results.extend(worker.collect()) or any(r.job_id == 2 for r in results),
                   60, what="the letter's page back")
        worker.set_limit(GateLimit(srv.api_url, 12))  # the letter is done: the book goes on
        wait_until(lambda: results.extend(worker.collect()) or len(results) == 13, 60,
                   what="the book's pages back once the cap was lifted")
    assert all(r.error is None for r in results), [r.error for r in results if r.error]
    records = request_records(log)
    mine = letter_request(results, records)
    ahead = [r for r in records if r is not mine and "engine" in r
             and mine["t"] < r["engine"] < mine["engine"]]
    # At most the image being prepared when the letter came and the book's two kept requests.
    assert len(ahead) <= 3, (
        f"the letter's image waited for {len(ahead)} of the book's to be prepared: the book's "
        "queued requests were not taken back")
    assert [r["status"] for r in records].count(499) >= 6, "the book's requests were not taken back"
    assert_each_page_has_its_own_text(results)


def test_a_letter_on_a_server_that_runs_four_at_once_does_not_wait_behind_the_books_queue(
    tmp_path: Path,
) -> None:
    """A user's trial: on a server that runs 4 requests at once, a book's batch waits in the
    server's own queue for many seconds, too old to be taken back as young. A letter dropped
    then must not wait behind that queue: capped beside it, the book keeps what the server
    runs and two queued requests, and the rest are taken back, old as they are."""
    log, book, letter, config = book_and_letter(tmp_path, 28, max_concurrency=28)
    results: list[PageResult] = []
    with (
        start_fake_server(free_port(), "--max-num-seqs", "4", "--step-t0-ms", "25",
                          "--output-tokens", "fixed:80", "--request-log", str(log)) as srv,
        running_worker(config) as worker,
    ):
        worker.set_limit(GateLimit(srv.api_url, 28))
        submit_pages(worker, srv.api_url, 1, book, 28, priority=64)
        # Three rounds of four answered: the book's queued requests are older than young.
        wait_until(lambda: log.exists() and len(request_records(log)) >= 12, 60,
                   what="three rounds of the book's requests answered")
        assert srv.stats()["requests_received"] == 28, "the book's batch is not all at the server"
        worker.set_limit(GateLimit(srv.api_url, 28, YieldCap(8, frozenset({1}))))
        arrived = time.time()
        submit_pages(worker, srv.api_url, 2, letter, 1)
        wait_until(lambda: results.extend(worker.collect()) or any(r.job_id == 2 for r in results),
                   60, what="the letter's page back")
        worker.set_limit(GateLimit(srv.api_url, 28))  # the letter is done: the book goes on
        wait_until(lambda: results.extend(worker.collect()) or len(results) == 29, 90,
                   what="the book's pages back once the cap was lifted")
    assert all(r.error is None for r in results), [r.error for r in results if r.error]
    records = request_records(log)
    mine = letter_request(results, records)
    ahead = [r for r in records if r is not mine and r["status"] == 200
             and arrived < r["done"] <= mine["done"]]
    # The four the server ran when the letter came, and the book's two kept in its queue.
    assert len(ahead) <= 6, (
        f"the letter waited for {len(ahead)} of the book's requests to be answered: the book's "
        "requests queued at the server were not taken back")
    assert_each_page_has_its_own_text(results)

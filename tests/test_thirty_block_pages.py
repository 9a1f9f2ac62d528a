"""With layout detection a page is a request per block (30 here): the request gate's bound,
the letter-beside-a-book rule, the adaptive bound's view of the work and the search for the
page that crashes the engine worker all hold at that size."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest

from ocrvl_daemon.core.messages import BlockAnswer, PageResult, YieldCap
from ocrvl_daemon.worker.request_gate import GatedRequest, RequestGate
from testkit.documents import make_pdf
from testkit.harness import wait_until
from testkit.stand_in_worker import Policy

BLOCKS = 30
BOUND = 8
BOOK, LETTER = 1, 2


class Server:
    """Chat requests as futures a test answers by hand; `sent` in the order they left."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: list[tuple[str, Future[str]]] = []
        self.most_open = 0

    def start(self, name: str, started: Callable[[], None]) -> Future[str]:
        """Send request `name`; the server runs it at once (its answer begins)."""
        future: Future[str] = Future()
        started()
        with self.lock:
            self.sent.append((name, future))
            self.most_open = max(self.most_open, self.open())
        return future

    def open(self) -> int:
        return sum(not f.done() for _, f in self.sent)

    def answer(self, prefix: str) -> int:
        """Answer the open requests whose name starts with `prefix`; how many."""
        with self.lock:
            waiting = [(n, f) for n, f in self.sent if n.startswith(prefix) and not f.done()]
        for name, future in waiting:
            future.set_result(f"answer to {name}")
        return len(waiting)

    def names(self, prefix: str) -> list[str]:
        with self.lock:
            return [n for n, _ in self.sent if n.startswith(prefix)]


def send_page(gate: RequestGate, server: Server, name: str, priority: int, document: int,
              requests: list[GatedRequest]) -> threading.Thread:
    """A page's thread, as PaddleX's: its blocks' requests one after the other, each sent
    once it has its place at the server (`GatedRequest.send` waits for it)."""
    def run() -> None:
        for block in range(BLOCKS):
            request = GatedRequest(
                gate, lambda started, b=block: server.start(f"{name} b.{b + 1}", started),
                priority, document)
            requests.append(request)
            request.send()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.quick
def test_beside_a_letter_a_books_30_block_pages_hold_the_bound_and_let_its_blocks_go_first(
) -> None:
    gate, server = RequestGate(BOUND), Server()
    book: list[GatedRequest] = []
    for page in range(3):
        send_page(gate, server, f"book p.{page + 1}", 64 + page, BOOK, book)
    wait_until(lambda: gate.open == BOUND and gate.waiting == 3, 5,
               what="the book's pages to fill the bound, the rest of their blocks waiting")
    sent_before = len(server.names("book"))

    # The converter caps the book beside the letter: its young requests above 2 go back.
    gate.resize(BOUND, YieldCap(2, frozenset({BOOK})))
    letter: list[GatedRequest] = []
    send_page(gate, server, "letter p.1", 0, LETTER, letter)
    answered = 0
    while answered < BLOCKS:  # the server answers the letter's blocks as they come
        wait_until(lambda done=answered: len(server.names("letter")) > done, 5,
                   what="the letter's next block at the server")
        answered += server.answer("letter")
    assert all(r.future.result(5).startswith("answer to letter") for r in letter)
    assert len(server.names("book")) == sent_before, (
        "a book block was sent under the cap while the letter's blocks waited")

    gate.resize(BOUND)  # the letter is done
    wait_until(lambda: server.answer("book") >= 0 and len(book) == 3 * BLOCKS
               and all(r.future.done() for r in book), 10, interval=0.01,
               what="the book's blocks, answered as they come")
    for n, request in enumerate(book):
        assert request.future.result(5).startswith("answer to book p."), n
    assert server.most_open <= BOUND, f"{server.most_open} requests at once, bound {BOUND}"
    assert gate.taken_back == BOUND - 2


def thirty_blocks(job_id: int, page: int) -> PageResult:
    answers = [BlockAnswer(f"p{page}b{b}", f"block {b + 1} of page {page + 1}", "stop", 20)
               for b in range(BLOCKS)]
    return PageResult(job_id, page, markdown="\n\n".join(a.text for a in answers),
                      tokens=20 * BLOCKS, has_ink=True, finish_reason="stop", answers=answers)


@pytest.mark.quick
def test_the_converter_counts_a_30_block_page_as_30_requests_against_the_bound(
        tmp_path: Path) -> None:
    policy = Policy(tmp_path)
    book = make_pdf(policy.folder / "book.pdf", 40)
    job = policy.queue(book)
    for _ in range(3):
        for _, page in policy.send():
            policy.deliver(thirty_blocks(job.id, page))
    endpoints = policy.converter.endpoints
    assert endpoints.requests_per_page > 0.9 * BLOCKS, endpoints.requests_per_page
    policy.store.close()


@pytest.mark.quick
def test_the_page_that_crashes_the_worker_is_found_among_30_block_pages(tmp_path: Path) -> None:
    policy = Policy(tmp_path, page_retries=3)
    pages, culprit = 64, 41
    book = make_pdf(policy.folder / "book.pdf", pages)
    job = policy.queue(book)
    policy.send()
    crashes = 0
    while in_flight := set(policy.worker.in_flight):
        if (job.id, culprit) in in_flight:
            crashes += 1
            policy.crash("engine worker exited (-11)")
        else:
            for _, page in sorted(in_flight):
                policy.deliver(thirty_blocks(job.id, page))
        policy.send()
        assert crashes < 20, "the crashing page was never found"
    policy.tick()
    assert policy.view(book)["failed_pages"] == [culprit + 1]
    assert crashes == 3 + 4, f"{crashes} worker crashes"
    md = book.with_suffix(".md").read_text("utf-8")
    assert md.count(f"block {BLOCKS} of page") == pages - 1, "an innocent page lost blocks"
    policy.store.close()

"""The worker's request gate: the server holds exactly as many requests as the concurrency
search allows, also below `max_concurrency` (a probe or a back-off)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from ocrvl_daemon.config import Config
from ocrvl_daemon.engine import EngineWorker, PageResult, PageTask, RequestGate
from ocrvl_daemon.testing.documents import make_pdf
from ocrvl_daemon.testing.harness import free_port, start_fake_server, wait_until


def test_gate_holds_requests_above_the_limit_and_follows_resizes() -> None:
    gate = RequestGate(2)
    done = threading.Event()
    entered: list[int] = []

    def request(n: int) -> None:
        gate.acquire()
        entered.append(n)
        done.wait(10)
        gate.release()

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


def test_a_letters_request_passes_the_book_pages_already_waiting() -> None:
    """Waiting requests go fewest-pages-of-their-document-in-flight first, then in order."""
    gate = RequestGate(1)
    gate.acquire()  # the server is full
    order: list[str] = []

    def request(name: str, priority: int) -> None:
        gate.acquire(priority)
        order.append(name)
        gate.release()

    threads = []
    for n, (name, priority) in enumerate((("book p.65", 64), ("book p.66", 64), ("letter p.1", 1))):
        threads.append(threading.Thread(target=request, args=(name, priority), daemon=True))
        threads[-1].start()
        wait_until(lambda n=n: gate.waiting == n + 1, 5, what=f"{name} to wait")
    gate.release()
    for t in threads:
        t.join(5)
    assert order == ["letter p.1", "book p.65", "book p.66"], (
        f"the letter's request should pass the book's waiting ones: {order}"
    )


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
    stat = pdf.stat()
    with start_fake_server(free_port(), "--step-t0-ms", "5", "--output-tokens", "fixed:40",
                           "--request-log", str(log)) as srv:
        worker = EngineWorker(config, srv.api_url)
        worker.start()
        try:
            wait_until(lambda: worker.collect() == [] and worker.ready, 120,
                       what="the engine worker to start")
            worker.set_limit(3)
            for page in range(12):
                worker.submit(PageTask(1, str(pdf), page, 1024, stat.st_size, stat.st_mtime))
            results: list[PageResult] = []
            wait_until(lambda: results.extend(worker.collect()) or len(results) == 12, 120,
                       what="all 12 pages back")
        finally:
            worker.stop()
    assert all(r.error is None for r in results), [r.error for r in results if r.error]
    records = [json.loads(line) for line in log.read_text("utf-8").splitlines() if line]
    overlap = max_overlap([(r["t"], r["done"]) for r in records])
    assert overlap <= 3, f"{overlap} requests were at the server at once with a limit of 3"
    assert overlap == 3, f"only {overlap} at once: the limit of 3 was not used"

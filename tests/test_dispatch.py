"""Several server endpoints behind one converter: pages spread over them, a killed one's pages
finished by the other (none lost, none twice), a restarted one taking pages again, a bound per
endpoint; and several engine worker processes.

The real converter, engine workers (the PaddleOCR-VL pipeline, layout off) and fake vLLM
servers; two `ExternalServer` handles are the endpoints.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.job import JobState
from ocrvl_daemon.core.messages import Failure, PageResult
from ocrvl_daemon.engine.converter import Converter
from ocrvl_daemon.engine.endpoints import SUSPEND_SECONDS
from ocrvl_daemon.engine.pool import EnginePool
from ocrvl_daemon.server.external import ExternalServer
from ocrvl_daemon.server.probe import ServerMetrics
from ocrvl_daemon.storage.jobs import enqueue_file, open_store
from ocrvl_daemon.storage.store import Store
from testkit.documents import make_pdf
from testkit.harness import FakeServerProcess, free_port, start_fake_server, wait_until
from testkit.stand_in_worker import ReadyServer, converter_with_stand_in

# Slow enough that a page is at a server for a while (a kill catches pages in flight).
SLOW = ("--step-t0-ms", "20", "--output-tokens", "fixed:40")


def endpoint_config(tmp_path: Path, url: str, **pipeline: object) -> Config:
    return Config.model_validate({
        "state_dir": str(tmp_path / "state"),
        "server": {"mode": "external", "url": url, "health_interval": 0.5},
        "pipeline": {"use_layout_detection": False, "max_concurrency": 8,
                     "min_concurrency": 2, **pipeline},
    })


class TwoEndpoints:
    """A converter over a real store and real engine workers, sending to two fake servers."""

    def __init__(self, tmp_path: Path, a: FakeServerProcess, b: FakeServerProcess,
                 **pipeline: object) -> None:
        self.tmp_path = tmp_path
        self.config = endpoint_config(tmp_path, a.api_url, **pipeline)
        self.handles = [ExternalServer(self.config),
                        ExternalServer(endpoint_config(tmp_path, b.api_url, **pipeline))]
        self.store: Store = open_store(self.config)
        self.engines = EnginePool(self.config, starts=1)
        self.converter = Converter(self.config, self.store, self.handles, engines=self.engines)

    def start(self) -> None:
        for handle in self.handles:
            handle.start()
        wait_until(lambda: all(h.is_ready() for h in self.handles), 30,
                   what="both servers to be ready")

    def close(self) -> None:
        self.converter.stop(0)
        for handle in self.handles:
            handle.stop()
        self.store.close()

    def queue(self, pdf: Path) -> int:
        job = enqueue_file(self.store, pdf, self.config.recipe)
        self.converter.wake()
        return job.id

    def run_until(self, done: object, timeout: float, what: str) -> None:
        """Tick the converter until `done()` is true."""
        deadline = time.monotonic() + timeout
        while not done():  # type: ignore[operator]
            assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
            self.converter.tick(time.monotonic())
            self.converter.wait(0.05)

    def finished(self, job_id: int) -> bool:
        job = self.store.job(job_id)
        assert job is not None and job.state is not JobState.FAILED, job
        return job.state is JobState.DONE


@contextmanager
def two_endpoints(tmp_path: Path, *fake_args: str, **pipeline: object
                  ) -> Iterator[tuple[TwoEndpoints, FakeServerProcess, FakeServerProcess]]:
    with ExitStack() as stack:
        a = stack.enter_context(start_fake_server(free_port(), *fake_args))
        b = stack.enter_context(start_fake_server(free_port(), *fake_args))
        setup = TwoEndpoints(tmp_path, a, b, **pipeline)
        stack.callback(setup.close)
        setup.start()
        yield setup, a, b


def page_numbers(md: Path) -> list[int]:
    return [int(n) for n in re.findall(r"<!-- page (\d+) -->", md.read_text(encoding="utf-8"))]


def completed(server: FakeServerProcess) -> int:
    return int(server.stats()["requests_completed"])


@pytest.mark.slow
def test_pages_of_one_book_go_to_both_servers(tmp_path: Path) -> None:
    with two_endpoints(tmp_path, *SLOW) as (setup, a, b):
        book = make_pdf(tmp_path / "book.pdf", 16)
        job = setup.queue(book)
        setup.run_until(lambda: setup.finished(job), 120, "the book to be converted")
        assert page_numbers(book.with_suffix(".md")) == list(range(1, 17))
        assert completed(a) > 0 and completed(b) > 0, (
            f"one server did all the work: {completed(a)} and {completed(b)} requests")
        loads = setup.converter.endpoint_load()
        assert [e.url for e in loads] == [a.api_url, b.api_url]
        assert all(e.in_flight == 0 for e in loads), "pages still counted in flight at the end"


@pytest.mark.slow
def test_a_server_killed_mid_book_loses_no_page_and_rejoins_once_restarted(
    tmp_path: Path,
) -> None:
    with two_endpoints(tmp_path, *SLOW) as (setup, _, b):
        book = make_pdf(tmp_path / "book.pdf", 40)
        job = setup.queue(book)
        setup.run_until(lambda: completed(b) >= 3 and setup.converter.endpoint_load()[1].in_flight,
                        120, "the second server to work on the book")
        port = b.port
        b.signal_group(signal.SIGKILL)
        b.stop()
        setup.run_until(lambda: setup.finished(job), 180, "the book to be finished by the other")
        numbers = page_numbers(book.with_suffix(".md"))
        assert sorted(numbers) == list(range(1, 41)), "a page was lost or written twice"
        assert numbers == list(range(1, 41)), "pages out of order"

        with start_fake_server(port, *SLOW) as again:
            # Once it answers again and its time out is over, it is one of two ready servers:
            # a letter bigger than one server's bound must reach it.
            back = time.monotonic()
            setup.run_until(lambda: setup.handles[1].is_ready()
                            and time.monotonic() - back > SUSPEND_SECONDS, 60,
                            "the restarted server to be seen ready")
            letter = make_pdf(tmp_path / "letter.pdf", 12)
            later = setup.queue(letter)
            setup.run_until(lambda: setup.finished(later) and completed(again) > 0, 120,
                            "the restarted server to take pages again")
            assert page_numbers(letter.with_suffix(".md")) == list(range(1, 13))


@pytest.mark.slow
def test_two_engine_workers_both_convert_pages_and_a_crash_of_one_costs_no_page(
    tmp_path: Path,
) -> None:
    with two_endpoints(tmp_path, *SLOW, workers=2) as (setup, _, _):
        wait_until(lambda: (setup.converter.tick(time.monotonic())
                            or len(setup.engines.taking()) == 2), 120,
                   what="two engine workers to start")
        workers = setup.engines.taking()
        book = make_pdf(tmp_path / "book.pdf", 30)
        job = setup.queue(book)
        def busy() -> set[int]:
            return {sent.worker for doc in setup.converter.documents.active.values()
                    for sent in doc.sent.values()}

        setup.run_until(lambda: all(w.pages_done >= 2 for w in workers)
                        and busy() == {w.number for w in workers}, 120,
                        "both workers to have pages")
        workers[0].kill()
        setup.run_until(lambda: setup.finished(job), 180, "the book to be finished")
        assert page_numbers(book.with_suffix(".md")) == list(range(1, 31)), (
            "a page was lost or written twice")
        assert workers[1].alive(), "the other worker went down with the crashed one"
        assert workers[1].pages_done > 2, "the other worker stopped converting"


class ScriptedServer(ReadyServer):
    """An endpoint whose readiness and /metrics sample the test writes."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ready = True
        self.sample: ServerMetrics | None = None

    def is_ready(self) -> bool:
        return self.ready

    def metrics(self, want: bool = True) -> ServerMetrics | None:  # type: ignore[override]
        return self.sample


def sample(now: float, preemptions: float) -> ServerMetrics:
    return ServerMetrics(taken_at=now, running=4.0, waiting=0.0, kv_cache_usage=0.5,
                         preemptions_total=preemptions)


def test_a_server_that_preempts_gets_a_lower_bound_and_the_other_keeps_its_own(
    tmp_path: Path,
) -> None:
    busy, calm = ScriptedServer("http://busy:8118/v1"), ScriptedServer("http://calm:8118/v1")
    converter, worker, store, config = converter_with_stand_in(
        tmp_path, [busy, calm], max_concurrency=32, min_concurrency=2)
    enqueue_file(store, make_pdf(tmp_path / "book.pdf", 200), config.recipe)
    converter.wake()
    bounds = {e.url: e.bound for e in converter.endpoint_load()}
    for step in range(1, 40):
        now = float(step)
        busy.sample = sample(now, preemptions=step)  # preempting more at every scrape
        calm.sample = sample(now, preemptions=0)
        worker.reach_server()
        converter.tick(now)
        for job_id, page in sorted(worker.in_flight)[:2]:  # two pages answered per tick
            worker.results.append(PageResult(job_id, page, markdown="text"))
    after = {e.url: e.bound for e in converter.endpoint_load()}
    assert after[busy.url] < bounds[busy.url], "the preempting server's bound was not lowered"
    assert after[calm.url] >= bounds[calm.url], "the calm server's bound fell with the other's"
    sent = set(worker.urls.values()) | {r.url for r in worker.results}
    assert {busy.url, calm.url} <= set(worker.per_url), f"pages did not go to both: {sent}"
    store.close()


def test_a_late_answer_from_a_server_a_page_was_taken_from_is_not_written(
    tmp_path: Path,
) -> None:
    first, second = ScriptedServer("http://a:8118/v1"), ScriptedServer("http://b:8118/v1")
    converter, worker, store, config = converter_with_stand_in(tmp_path, [first, second])
    job = enqueue_file(store, make_pdf(tmp_path / "letter.pdf", 1), config.recipe)
    converter.wake()
    converter.tick(0.0)
    assert worker.urls == {(job.id, 0): first.url}, "the page did not go to the first server"
    first.ready = False  # it goes down with the page
    converter.tick(1.0)
    assert worker.order == [(job.id, 0), (job.id, 0)], "the page was not sent again"
    assert converter.endpoint_load()[1].in_flight == 1, "the other server did not get the page"
    # The first server's answer comes late, after the page went to the other one.
    worker.results.append(PageResult(job.id, 0, markdown="late answer", url=first.url))
    converter.tick(2.0)
    assert store.count_pages(job.sha256, config.recipe.key) == 0, "the late answer was kept"
    worker.results.append(PageResult(job.id, 0, markdown="answer", url=second.url))
    converter.tick(3.0)
    pages = list(store.iter_pages(job.sha256, config.recipe.key))
    assert [p.markdown for p in pages] == ["answer"], "the page is not the awaited answer, once"
    store.close()


def test_a_server_whose_request_failed_gets_no_pages_for_a_while_then_rejoins(
    tmp_path: Path,
) -> None:
    first, second = ScriptedServer("http://a:8118/v1"), ScriptedServer("http://b:8118/v1")
    converter, worker, store, config = converter_with_stand_in(tmp_path, [first, second])
    job = enqueue_file(store, make_pdf(tmp_path / "book.pdf", 4), config.recipe)
    converter.wake()
    converter.tick(0.0)
    on_first = sorted(k for k, url in worker.urls.items() if url == first.url)
    assert on_first and len(on_first) < 4, f"pages were not spread: {worker.urls}"
    failed = on_first[0]
    worker.results.append(PageResult(*failed, error="APIConnectionError: Connection error.",
                                     error_kind=Failure.SERVER_DOWN, url=first.url))
    converter.tick(1.0)
    converter.tick(1.0)
    loads = converter.endpoint_load()
    assert loads[0].in_flight == 0 and loads[1].in_flight == 4, (
        f"the failed server's pages did not all go to the other: {loads}")
    for job_id, page in sorted(worker.in_flight):
        worker.results.append(PageResult(job_id, page, markdown="text", url=second.url))
    converter.tick(2.0)
    assert store.count_pages(job.sha256, config.recipe.key) == 4, "a page was lost"
    later = enqueue_file(store, make_pdf(tmp_path / "letter.pdf", 4), config.recipe)
    converter.wake()
    converter.tick(60.0)
    assert any(url == first.url for (j, _), url in worker.urls.items() if j == later.id), (
        "the server did not rejoin once its pause was over")
    store.close()


def test_a_reload_that_raises_max_concurrency_lets_a_running_book_use_it_at_once(
    tmp_path: Path,
) -> None:
    server = ScriptedServer("http://one:8118/v1")
    converter, worker, store, config = converter_with_stand_in(
        tmp_path, [server], max_concurrency=16, min_concurrency=2)
    enqueue_file(store, make_pdf(tmp_path / "book.pdf", 200), config.recipe)
    converter.wake()
    assert [e.bound for e in converter.endpoint_load()] == [16]
    raised = config.model_copy(deep=True)
    raised.pipeline.max_concurrency = 48
    converter.reconfigure(raised)
    assert [e.bound for e in converter.endpoint_load()] == [48], (
        "after a reload to max_concurrency 48 the book still ran at the old bound")
    for step in range(1, 40):  # no answers yet: pages pile up to the new bound
        worker.reach_server()
        converter.tick(float(step))
    assert len(worker.in_flight) >= 48, (
        f"{len(worker.in_flight)} pages went out after the bound was raised to 48")
    store.close()

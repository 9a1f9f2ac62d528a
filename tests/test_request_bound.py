"""One request bound per endpoint, shared by all engine workers: each worker's request gate
gets a part of it by the pages it has there, so a busy worker is never held to a fixed share
while another worker's part stands idle (issue 50)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.messages import GateLimit, PageResult, PageTask, WorkerSetup, YieldCap
from ocrvl_daemon.engine.pool import EnginePool, shares
from ocrvl_daemon.server.placement import Placement
from testkit.stand_in_worker import StandInWorker

URL = "http://127.0.0.1:8118/v1"
BOUND = 24


def two_workers(tmp_path: Path) -> tuple[EnginePool, StandInWorker, StandInWorker]:
    """A pool of two stand-in workers, both taking pages."""
    config = Config.model_validate({"state_dir": str(tmp_path / "state"),
                                    "pipeline": {"use_layout_detection": False, "workers": 2}})
    made: list[StandInWorker] = []

    def new_worker(setup: WorkerSetup) -> StandInWorker:
        made.append(StandInWorker(setup))
        return made[-1]

    pool = EnginePool(config, new_worker=new_worker, placement=Placement(2))  # type: ignore[arg-type]
    pool.maintain(0.0, set())
    assert len(made) == 2 and len(pool.taking()) == 2
    return pool, made[0], made[1]


def page(job: int, number: int) -> PageTask:
    return PageTask(job, "/books/book.pdf", number, 1024, 1, 1.0, url=URL)


def limits(*workers: StandInWorker) -> list[int]:
    return [w.gates[URL].limit for w in workers]


@pytest.mark.quick
def test_with_two_workers_and_one_busy_the_busy_one_gets_the_whole_bound(tmp_path: Path) -> None:
    pool, busy, idle = two_workers(tmp_path)
    pool.set_limit(GateLimit(URL, BOUND))
    for number in range(6):
        pool.submit(busy.number, page(1, number))
    assert limits(busy, idle) == [BOUND, 0], (
        f"the busy worker may send {busy.gates[URL].limit} of the {BOUND} requests the server "
        "takes: an idle worker's fixed share holds its pages back")


@pytest.mark.quick
def test_the_bound_follows_the_pages_as_they_move_between_workers(tmp_path: Path) -> None:
    pool, first, second = two_workers(tmp_path)
    pool.set_limit(GateLimit(URL, BOUND))
    for number in range(3):
        pool.submit(first.number, page(1, number))
    pool.submit(second.number, page(2, 0))
    assert limits(first, second) == [18, 6], "the bound is not shared by the pages each has"
    assert sum(limits(first, second)) == BOUND, "the workers together may exceed the bound"
    # The first worker's pages come back: the second, alone with pages, may use it all.
    first.results = [PageResult(1, number, url=URL) for number in range(3)]
    pool.collect()
    assert limits(first, second) == [0, BOUND], (
        "a worker whose pages are done still holds part of the bound")


@pytest.mark.quick
def test_a_worker_that_stops_gives_its_part_of_the_bound_back(tmp_path: Path) -> None:
    pool, first, second = two_workers(tmp_path)
    pool.set_limit(GateLimit(URL, BOUND))
    pool.submit(first.number, page(1, 0))
    pool.submit(second.number, page(2, 0))
    first.die("crashed")
    pool.maintain(1.0, set())
    assert second.gates[URL].limit == BOUND, (
        "the pages of a crashed worker still hold part of the bound")


@pytest.mark.quick
def test_the_cap_on_big_documents_is_shared_by_their_pages(tmp_path: Path) -> None:
    pool, first, second = two_workers(tmp_path)
    for number in range(4):
        pool.submit(first.number, page(1, number))  # the book, capped
    pool.submit(second.number, page(2, 0))  # the letter
    pool.set_limit(GateLimit(URL, BOUND, YieldCap(8, frozenset({1}))))
    caps = [w.gates[URL].cap for w in (first, second)]
    assert [c.places if c else None for c in caps] == [8, 0], (
        "the book's cap is not where the book's pages are")


@pytest.mark.quick
def test_shares_split_a_total_by_demand_and_evenly_without_any() -> None:
    assert shares(24, [3, 1]) == [18, 6]
    assert shares(24, [5, 0]) == [24, 0]
    assert shares(2, [9, 1, 1]) == [1, 1, 0], "a total smaller than the workers with pages"
    assert shares(3, [100, 1]) == [2, 1], "a worker with pages got none of the bound"
    assert shares(7, [0, 0]) == [4, 3]
    assert shares(1, [0, 0]) == [1, 1], "a worker without a part would start held back"

"""The engine worker's local models (the layout detector) run on one thread, the model lane,
whichever page's thread asks: torch and Paddle keep per-thread state (GPU handles and their
workspaces, an OpenMP team), which a call from each of ~50 page threads would multiply."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ocrvl_daemon.worker import main as worker

PAGES = 8


class _Model:
    """A model that notes the thread of every call and how many calls overlap."""

    def __init__(self) -> None:
        self.threads: set[int] = set()
        self.running = self.most = 0
        self._lock = threading.Lock()

    def __call__(self, page: int) -> Any:
        with self._lock:
            self.threads.add(threading.get_ident())
            self.running += 1
            self.most = max(self.most, self.running)
        threading.Event().wait(0.02)
        with self._lock:
            self.running -= 1
        yield {"page": page}


@pytest.mark.quick
def test_every_page_threads_model_call_runs_on_the_one_lane_thread_one_at_a_time() -> None:
    model = _Model()
    lane = ThreadPoolExecutor(max_workers=1)
    on_the_lane = worker._OnTheLane(model, lane)
    found: dict[int, Any] = {}
    spans: dict[int, list[tuple[float, float]]] = {}
    askers: set[int] = set()

    def page(number: int) -> None:
        askers.add(threading.get_ident())
        worker._LANE_SPANS.spans = spans.setdefault(number, [])
        found[number] = on_the_lane(number)
        worker._LANE_SPANS.spans = None

    threads = [threading.Thread(target=page, args=(n,)) for n in range(PAGES)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    lane.shutdown()
    assert len(model.threads) == 1 and not model.threads & askers, (
        f"the model was called on {len(model.threads)} threads: each holds its own GPU "
        "handles and CPU thread team")
    assert model.most == 1, "two calls into a model that is not thread-safe overlapped"
    assert found == {n: [{"page": n}] for n in range(PAGES)}, "a page got another's blocks"
    assert all(len(s) == 1 and s[0][1] > s[0][0] for s in spans.values()), (
        f"each page's layout call is timed for that page (the layout stage's load): {spans}")


@pytest.mark.quick
def test_a_model_error_reaches_the_page_that_asked() -> None:
    def failing(_: int) -> Any:
        raise ValueError("bad page image")

    lane = ThreadPoolExecutor(max_workers=1)
    with pytest.raises(ValueError, match="bad page image"):
        worker._OnTheLane(failing, lane)(1)
    assert worker._OnTheLane(lambda n: iter([n]), lane)(2) == [2], (
        "the lane stopped taking calls after one failed")
    lane.shutdown()

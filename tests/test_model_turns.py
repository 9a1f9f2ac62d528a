"""The engine worker's local models (the layout detector) take turns, one call at a time: on
one thread, the model lane, where torch runs them (it keeps GPU handles and their workspaces
per thread, which a call from each of ~50 page threads would multiply); on each page's own
thread under a lock where Paddle does (it holds the GIL for a whole call, and the page whose
call ended must carry on at once)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest

from ocrvl_daemon.worker import main as worker
from ocrvl_daemon.worker.page_context import PageContext, on_page
from ocrvl_daemon.worker.pipeline import TakingTurns, Turns, model_turns

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


def _pages_call(model: _Model, turns: Turns) -> tuple[set[int], dict[int, Any],
                                                               dict[int, list[Any]]]:
    """PAGES page threads calling `model` at once; their threads, what each got, its spans."""
    taking_turns = TakingTurns(model, turns)
    found: dict[int, Any] = {}
    spans: dict[int, list[tuple[float, float]]] = {}
    askers: set[int] = set()

    def page(number: int) -> None:
        askers.add(threading.get_ident())
        with on_page(PageContext("", layout_spans=spans.setdefault(number, []))):
            found[number] = taking_turns(number)

    threads = [threading.Thread(target=page, args=(n,)) for n in range(PAGES)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert model.most == 1, "two calls into a model that is not thread-safe overlapped"
    assert found == {n: [{"page": n}] for n in range(PAGES)}, "a page got another's blocks"
    assert all(len(s) == 1 and s[0][1] > s[0][0] for s in spans.values()), (
        f"each page's layout call is timed for that page (the layout stage's load): {spans}")
    return askers, found, spans


@pytest.mark.quick
def test_with_torch_every_page_threads_model_call_runs_on_the_one_lane_thread() -> None:
    model = _Model()
    turns = model_turns("transformers")
    assert isinstance(turns, ThreadPoolExecutor), "torch's calls are not on one thread"
    askers, _, _ = _pages_call(model, turns)
    turns.shutdown()
    assert len(model.threads) == 1 and not model.threads & askers, (
        f"the model was called on {len(model.threads)} threads: each holds its own GPU "
        "handles and CPU thread team")


@pytest.mark.quick
def test_with_torch_the_warm_up_call_runs_on_the_lane_too() -> None:
    model = _Model()
    pipeline = SimpleNamespace(paddlex_pipeline=SimpleNamespace(layout_det_model=model))
    turns = model_turns("transformers")
    worker._models_take_turns(pipeline, turns, None)
    warm_s = worker._warmed(pipeline, None)
    assert warm_s is not None and warm_s > 0 and len(model.threads) == 1, (
        "the layout model was not warmed before the worker's first page")
    page = threading.Thread(target=pipeline.paddlex_pipeline.layout_det_model, args=(1,))
    page.start()
    page.join(10)
    turns.shutdown()
    assert len(model.threads) == 1 and threading.get_ident() not in model.threads, (
        "the warm-up call ran off the lane: that thread keeps GPU handles of its own, beyond "
        "the room planned for the layout model")


@pytest.mark.quick
@pytest.mark.parametrize("engine", ["paddle_static", "onnxruntime", None])
def test_with_paddle_each_page_calls_on_its_own_thread_one_at_a_time(engine: str | None
                                                                      ) -> None:
    model = _Model()
    askers, _, _ = _pages_call(model, model_turns(engine))
    assert model.threads == askers, (
        "Paddle's calls left their pages' threads: it holds the GIL for a whole call, and a "
        "lane going straight into the next one holds the finished page's requests off")


@pytest.mark.quick
@pytest.mark.parametrize("engine", ["transformers", "paddle_static"])
def test_a_model_error_reaches_the_page_that_asked(engine: str) -> None:
    def failing(_: int) -> Any:
        raise ValueError("bad page image")

    turns = model_turns(engine)
    with pytest.raises(ValueError, match="bad page image"):
        TakingTurns(failing, turns)(1)
    assert TakingTurns(lambda n: iter([n]), turns)(2) == [2], (
        "the models stopped taking calls after one failed")
    if isinstance(turns, ThreadPoolExecutor):
        turns.shutdown()

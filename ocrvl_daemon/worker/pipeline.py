"""The recognition pipeline of an engine worker (and of its layout process): the local models
taking turns, warmed once, and torch held to its threads.

Where ocrvl reaches into PaddleX's objects it does so here, and only because PaddleX has no
hook for it (paddlex is pinned below 3.8; `tests/test_model_turns.py` and
`tests/test_block_retry.py` fail loudly if these attributes move):
* `replace_model`: the local models take turns (`TakingTurns`), and a layout process stands
  in for the layout model; they are set on the pipeline PaddleX wraps (`inner_pipeline`);
* `replace_chat_completion`: every chat request goes through ocrvl's gates and is streamed
  (`completions.tracked_completions`), since PaddleX keeps only an answer's text;
* `start_request_loop`: PaddleX starts its event loop lazily, without a lock.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeAlias

import numpy as np

from ocrvl_daemon.worker.page_context import this_page

# An A4 page rendered at scale 2 (height, width, BGR).
BLANK_PAGE_SHAPE = (1684, 1190, 3)


# How the local models (neither is thread-safe) take turns (`model_turns`).
Turns: TypeAlias = "ThreadPoolExecutor | threading.Lock"


def model_turns(engine: str | None) -> Turns:
    """How the local models' calls take turns in a worker run by PaddleX `engine`.

    torch (the transformers engine): on one thread, the model lane. torch keeps per-thread
    state (cuBLAS/cuDNN handles and their workspaces on a GPU, an OpenMP team on the CPU),
    which a call from each of ~50 page threads would multiply: GPU memory far beyond the
    room planned beside the server. It lets go of the GIL while it computes.

    Paddle (and the others): on each page's own thread, under a lock. Paddle holds the GIL
    for a whole call (seconds on the CPU); on the page's own thread, the page whose call
    ended carries on at once, where a lane would go straight into the next call and hold
    that page's requests off until it ends.
    """
    if engine == "transformers":
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="models")
    return threading.Lock()


class TakingTurns:
    """A model that is not thread-safe (the layout detector), called one call at a time as
    `turns` says (`model_turns`); the models of one worker share their `turns`.

    Each call is timed for the page on the asking thread: the layout stage's load (the
    document preprocessor's calls count there too).
    """

    def __init__(self, target: Any, turns: Turns) -> None:
        self._target = target
        self._turns = turns

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        def call() -> tuple[list[Any], tuple[float, float]]:
            start = time.monotonic()
            found = list(self._target(*args, **kwargs))
            return found, (start, time.monotonic())

        if isinstance(self._turns, ThreadPoolExecutor):
            found, span = self._turns.submit(call).result()
        else:
            with self._turns:
                found, span = call()
        page = this_page()
        if page is not None:
            page.layout_spans.append(span)
        return found

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


def limit_torch_threads(threads: int | None) -> None:
    """Hold torch to `threads` in this process (None: as it is): PaddleX's transformers engine
    takes no thread count, and torch would otherwise start a thread per core in every worker,
    each worker's threads fighting the others' for the same cores."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def inner_pipeline(pipeline: Any) -> Any:
    """PaddleX's pipeline inside `PaddleOCRVL`, whose models the pipeline calls.

    paddlex wraps its pipeline (AutoParallelSimpleInferencePipeline) and forwards attribute
    reads to it: a model set on the wrapper is never called.
    """
    return getattr(pipeline.paddlex_pipeline, "_pipeline", pipeline.paddlex_pipeline)


def warm_layout_model(model: Any) -> float:
    """Call the layout model once on a blank page, so that the first page of the first book
    does not pay for the engine's set-up (on a GPU, CUDA's and cuDNN's; on the CPU the first
    call measured about as long as any); the seconds it took. Any page size will do: the
    model resizes every page to its own input size."""
    started = time.monotonic()
    list(model([np.full(BLANK_PAGE_SHAPE, 255, dtype=np.uint8)]))
    return time.monotonic() - started


def replace_model(pipeline: Any, name: str, model: Any) -> None:
    """The pipeline's local model `name` ("layout_det_model", "doc_preprocessor_pipeline")
    is `model` from now on."""
    setattr(inner_pipeline(pipeline), name, model)


def replace_chat_completion(pipeline: Any, create: Callable[..., Any]) -> None:
    """Every chat completion the pipeline asks for is made by `create` (called as PaddleX
    calls its client's `create_chat_completion`)."""
    pipeline.paddlex_pipeline.vl_rec_model.genai_client.create_chat_completion = create


def start_request_loop() -> None:
    """Start PaddleX's request event loop now, from one thread.

    PaddleX starts it lazily on the first request without a lock: when the first pages
    arrive together, several threads start loops of their own, and requests fail with
    "... is bound to a different event loop" until one loop wins.
    """
    with contextlib.suppress(ImportError):
        from paddlex.inference.models.common.genai import start_aio_loop

        start_aio_loop()

"""The engine worker process: PaddleOCR-VL working pages for the daemon.

`serve` is its main: it builds the pipeline as the daemon's `WorkerSetup` says (`pipeline`),
then runs each page the daemon sends on a thread of its own (`page.run_page`), so the server
always has requests to work on: while one page waits for the model, the next is rendered and
laid out. Every chat request passes the `RequestGate` of the endpoint its page was sent to
(`completions.Endpoints`), resized as the daemon shares the request bound (`GateLimit`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

from ocrvl_daemon.core.messages import (
    GateLimit,
    PageTask,
    WorkerFailed,
    WorkerReady,
    WorkerSetup,
)
from ocrvl_daemon.process.channel import child_channel
from ocrvl_daemon.worker.child_logs import library_logs_to_daemon, log_to_daemon
from ocrvl_daemon.worker.completions import Endpoints, tracked_completions
from ocrvl_daemon.worker.layout_process import LayoutProcess
from ocrvl_daemon.worker.paddlex_import import import_paddleocr_vl
from ocrvl_daemon.worker.page import run_page
from ocrvl_daemon.worker.pipeline import (
    TakingTurns,
    Turns,
    inner_pipeline,
    limit_torch_threads,
    model_turns,
    replace_chat_completion,
    replace_model,
    start_request_loop,
    warm_layout_model,
)

log = logging.getLogger(__name__)

# How long a thread holding the GIL keeps it while another waits (CPython's default: 5 ms).
# torch (the layout model on the GPU runs in this process) lets go of the GIL for each
# operation and must wait that long to take it back whenever the page threads run Python
# (rendering, cropping, reading streamed answers): on the CPU its forward pass took 4.3x as
# long beside one busy thread at 5 ms, 1.4x at 0.5 ms (bench/gpu/RESULTS.md).
SWITCH_INTERVAL_S = 0.0005


def serve() -> None:
    """The worker process's main (`EngineWorker.start` runs it with `python -c`).

    Messages are pickles of the `messages` dataclasses (`process.channel`): a `WorkerSetup`
    from the parent, then `PageTask`s and `GateLimit`s until end of input; this side answers
    `WorkerReady` or `WorkerFailed`, then `RequestSent` and `PageResult` for each page, and
    `LogRecord`s.
    """
    channel = child_channel()  # a worker must not outlive a SIGKILLed daemon
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    log_to_daemon(channel)
    setup: WorkerSetup | None = channel.receive()
    if setup is None:
        return
    layout: LayoutProcess | None = None
    failure: str | None = setup.failure or None
    try:
        if failure is None:
            PaddleOCRVL = import_paddleocr_vl()
            library_logs_to_daemon()
            limit_torch_threads(setup.torch_threads)
            if setup.layout_process:
                # It loads while this process builds the pipeline it stands in for a model of.
                layout = LayoutProcess.started(setup)
            pipeline = PaddleOCRVL(**setup.pipeline)
            failure = layout.wait_ready() if layout is not None else None
        if failure is None:
            _models_take_turns(pipeline, model_turns(setup.pipeline.get("engine")), layout)
            warm_s = _warmed(pipeline, layout)
    except BaseException as exc:  # report anything, even SystemExit from a dependency check
        failure = f"{type(exc).__name__}: {exc}"
    if failure is not None:
        if layout is not None:
            layout.close()
        channel.send(WorkerFailed(failure))
        return
    # Paddle's C++ runtime installs a SIGTERM handler that prints a crash report; a worker
    # being replaced or stopped is not a crash.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    endpoints = Endpoints(setup)
    replace_chat_completion(pipeline, tracked_completions(endpoints))
    start_request_loop()
    channel.send(WorkerReady(os.getpid(), warm_s))
    # A thread for every page the converter sends (it bounds them: each endpoint's limit, the
    # ready margin and the pages of documents short of pages): a fixed pool would queue pages
    # unseen, behind the gates' back.
    pages: list[threading.Thread] = []
    while (message := channel.receive()) is not None:
        if isinstance(message, PageTask):
            page = threading.Thread(target=run_page, name="page", daemon=True,
                                    args=(pipeline, setup, message, channel))
            page.start()
            pages = [p for p in pages if p.is_alive()] + [page]
        elif isinstance(message, GateLimit):
            endpoints.gate(message.url).resize(message.limit, message.cap)
    for page in pages:
        page.join()
    if layout is not None:
        layout.close()
    # Every result is sent (`send` writes it whole). Paddle's teardown takes about a second
    # and has nothing to save; `ocrvl convert` would only wait for it.
    sys.stderr.flush()
    os._exit(0)


def _models_take_turns(pipeline: Any, turns: Turns, layout: LayoutProcess | None) -> None:
    """The pipeline's local models called as `turns` says from now on; the layout model
    `layout`'s process, where there is one."""
    inner = inner_pipeline(pipeline)
    for name in ("layout_det_model", "doc_preprocessor_pipeline"):
        if hasattr(inner, name):
            target = getattr(inner, name)
            if name == "layout_det_model" and layout is not None:
                layout.batch_sampler = target.batch_sampler
                layout.on_ended = _end_worker
                target = layout  # this process's own copy is no longer called
            replace_model(pipeline, name, TakingTurns(target, turns))


def _warmed(pipeline: Any, layout: LayoutProcess | None) -> float | None:
    """Seconds the layout model's first call took (None with layout detection off)."""
    if layout is not None:
        return layout.warm_s  # its process warmed the model on the thread that serves it
    inner = inner_pipeline(pipeline)
    if not hasattr(inner, "layout_det_model"):
        return None
    # through its turns (`_models_take_turns` first): torch's per-thread state belongs to the
    # lane's thread alone
    return warm_layout_model(inner.layout_det_model)


def _end_worker(what: str) -> None:
    """The layout model's process is gone: end this worker as a crash of the model in it
    would, so that the converter tries its pages again (a page that kills it, alone)."""
    log.error("%s: this engine worker ends", what)
    sys.stderr.flush()
    os._exit(1)

"""The engine worker process: PaddleOCR-VL working one page at a time for the daemon.

`serve` is its main. Each page is rendered here and run through the real
`paddleocr.PaddleOCRVL` pipeline with `vl_rec_backend="vllm-server"`. Pages run concurrently
on threads, so the server always has requests to work on: while one page waits for the
model, the next is rendered and laid out; every chat request passes the `RequestGate` of the
endpoint its page was sent to (`_Endpoints`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeAlias

import httpx
import numpy as np

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.quality import Redo, repetition
from ocrvl_daemon.engine.worker_handle import _Channel, child_channel
from ocrvl_daemon.observe.logs import PrintableFormatter, doc_fields
from ocrvl_daemon.server.autotune import layout_choice
from ocrvl_daemon.server.probe import bearer_header
from ocrvl_daemon.worker.layout_process import LayoutProcess
from ocrvl_daemon.worker.messages import (
    Block,
    BlockAnswer,
    Failure,
    GateLimit,
    LogRecord,
    PageResult,
    PageTask,
    RequestSent,
    WorkerFailed,
    WorkerReady,
    WorkerSetup,
)
from ocrvl_daemon.worker.paddlex_import import import_paddleocr_vl
from ocrvl_daemon.worker.request_gate import GatedRequest, RequestGate
from ocrvl_daemon.worker.request_images import image_url, pixels_of, within_aspect
from ocrvl_daemon.worker.streaming import (
    KEEPALIVE_EXPIRY,
    StatusError,
    StreamedAnswer,
    request_body,
    stream_completion,
)

log = logging.getLogger(__name__)

# A page image with more than this share of dark pixels has ink on it: an empty answer for
# it is a failure, not a blank page. One line of small text on a 2x-rendered A4 page is
# about 0.1%; scanner noise on a blank page stays well below.
INK_SHARE = 0.0005
INK_LEVEL = 128
# How long a thread holding the GIL keeps it while another waits (CPython's default: 5 ms).
# torch (the layout model on the GPU runs in this process) lets go of the GIL for each
# operation and must wait that long to take it back whenever the page threads run Python
# (rendering, cropping, reading streamed answers): on the CPU its forward pass took 4.3x as
# long beside one busy thread at 5 ms, 1.4x at 0.5 ms (bench/gpu/RESULTS.md).
SWITCH_INTERVAL_S = 0.0005
# An A4 page rendered at scale 2 (height, width, BGR).
BLANK_PAGE_SHAPE = (1684, 1190, 3)


def has_ink(image: np.ndarray) -> bool:
    """Whether a rendered page (an H x W x 3 array) has anything dark on it."""
    # The darkest channel of each pixel, channel by channel: numpy's min over the last axis
    # of 3 takes ~10x as long (68 ms for a 2x-rendered A4 page, on every page's way out).
    darkest = np.minimum(np.minimum(image[..., 0], image[..., 1]), image[..., 2])
    return bool(np.count_nonzero(darkest < INK_LEVEL) > INK_SHARE * darkest.size)


def pipeline_kwargs(config: Config, server_url: str) -> dict[str, Any]:
    """Constructor arguments of `PaddleOCRVL` for this configuration; the layout model's
    engine, device and threads are chosen here (`autotune.layout_choice`), logged, and
    torch's threads held to the choice (`LayoutChoice.limit_threads`)."""
    p = config.pipeline
    kwargs: dict[str, Any] = {
        "pipeline_version": config.model.vl_model.pipeline_version,
        "vl_rec_backend": "vllm-server",
        "vl_rec_server_url": server_url,
        # The request's `model` must be exactly what the server serves.
        "vl_rec_api_model_name": config.model.served,
        "vl_rec_max_concurrency": p.max_concurrency,
        "use_layout_detection": p.use_layout_detection,
        "use_doc_orientation_classify": p.use_doc_orientation_classify,
        "use_doc_unwarping": p.use_doc_unwarping,
        "use_chart_recognition": p.use_chart_recognition,
        # Each page gets its own thread here already; without PaddleX's per-call queue threads
        # the chat requests are made on the page's thread, which lets `_track_completions`
        # attribute finish reasons to the page (and saves their 0.5 s batching wait).
        "use_queues": False,
    }
    if config.server.api_key:
        kwargs["vl_rec_api_key"] = config.server.api_key
    if p.use_layout_detection:
        # Every local model follows it; the VL recognition goes to the server whatever the
        # engine (PaddleX drops the engine for a sub-model with a server backend).
        layout = layout_choice(config)
        log.info("layout: %s: %s", layout.describe(), layout.why)
        layout.limit_threads()
        return kwargs | layout.common_args()
    # The page is the one block, which merging leaves as it is, after copying the whole page
    # image twice to measure it (~6.5 ms of CPU a page).
    kwargs["merge_layout_blocks"] = False
    if p.use_doc_orientation_classify or p.use_doc_unwarping:
        if p.wanted_layout_device != "auto":
            kwargs["device"] = p.wanted_layout_device
    else:
        # Nothing runs here but requests to the server: naming a device spares paddlex its
        # probe for one (without PaddlePaddle: importing torch and starting CUDA, ~4 s).
        kwargs["device"] = "cpu"
    return kwargs


class _TurnSpans(threading.local):
    """Where the calls into the models that take turns, made on this thread, are timed: the
    list of the page being recognised (`PageResult.layout_spans`), None outside a page."""

    spans: list[tuple[float, float]] | None = None


_TURN_SPANS = _TurnSpans()
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


class _TakingTurns:
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
        if _TURN_SPANS.spans is not None:
            _TURN_SPANS.spans.append(span)
        return found

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


@dataclass(frozen=True)
class _Asked:
    """A chat completion a page asked for: its block's key, its answer (a future), the token
    limit it asked for, and whether the answer was kept from the page's last try."""

    key: str
    future: Future[Any]
    limit: int
    reused: bool = False
    image: str = ""  # the block's image (data URL), read for ink if its answer is empty


class _Completions(threading.local):
    """The chat completions (futures) requested on this thread during one page: those sent
    to the server (`started`) and every one asked for (`asked`); the answers to keep
    (`PageTask.keep`) and how each block sent again goes (`PageTask.blocks`); how to tell the
    converter once the page's first request leaves for the server, and the endpoint its
    requests go to ("": the pipeline's own)."""

    started: list[Any] | None = None
    asked: list[_Asked] | None = None
    keep: Mapping[str, BlockAnswer] = {}
    blocks: Mapping[str, Redo] = {}
    announce: Callable[[], None] | None = None
    priority = 0
    document: int | None = None
    url = ""


_COMPLETIONS = _Completions()


class _TimedRequests(list[Future[Any]]):
    """A page's chat requests (futures), as `_track_completions` adds each one once it has its
    place at the server; notes into `spans` when each got its place and when it ended: the
    server stage's load in the units of the bound (requests). A request bumped and sent
    again keeps its place's time while it waits for another (rare, and short)."""

    def __init__(self, spans: list[tuple[float, float]]) -> None:
        super().__init__()
        self._spans = spans

    def append(self, request: Future[Any]) -> None:
        """Add the request, which has its place at the server now."""
        super().append(request)
        placed = time.monotonic()
        request.add_done_callback(lambda _: self._spans.append((placed, time.monotonic())))


class _Endpoints:
    """One `RequestGate` per server endpoint, made on first use, and the chat completions
    sent to each: streamed (`streaming.stream_completion`), so that an answer that loops is
    stopped as soon as it shows (`pipeline.stop_loops_early`).

    The pipeline is built with one server URL; a page's requests go to the endpoint the
    converter chose for it (`PageTask.url`).
    """

    def __init__(self, config: Config, server_url: str) -> None:
        self._config = config
        self._first = server_url
        self._lock = threading.Lock()  # guards _gates
        self._gates: dict[str, RequestGate] = {}
        # Used on PaddleX's event-loop thread only. The gates bound the requests in flight.
        self._client = httpx.AsyncClient(limits=httpx.Limits(
            max_connections=None, keepalive_expiry=KEEPALIVE_EXPIRY))
        self._headers = bearer_header(config.server.api_key)

    def gate(self, url: str) -> RequestGate:
        """The request gate of `url` ("": the first endpoint)."""
        url = url or self._first
        with self._lock:
            if url not in self._gates:
                self._gates[url] = RequestGate(self._config.pipeline.max_concurrency)
            return self._gates[url]

    def send(self, url: str, messages: Any, kwargs: dict[str, Any],
             started: Callable[[], None] | None = None) -> Future[_Completion]:
        """Send a chat completion (PaddleX's `create_chat_completion` arguments) to `url`
        ("": the first endpoint) on PaddleX's event loop; cancelling the future aborts it.
        `started` is called once its answer begins."""
        from paddlex.inference.models.common.genai import run_async

        body = request_body(self._config.model.served, messages, kwargs)
        return run_async(self._complete(url or self._first, body, kwargs.get("timeout", 600),
                                        started),
                         return_future=True)

    async def _complete(self, url: str, body: dict[str, Any], timeout: float,
                        started: Callable[[], None] | None) -> _Completion:
        answer = await stream_completion(
            self._client, f"{url.rstrip('/')}/chat/completions", body, self._headers, timeout,
            stop_loops=self._config.pipeline.stop_loops_early, started=started)
        return _Completion(answer)


@dataclass(frozen=True)
class _Completion:
    """A streamed answer, shaped as PaddleX reads a chat completion
    (`choices[0].message.content`)."""

    answer: StreamedAnswer

    @property
    def choices(self) -> list[Any]:
        """The answer's one choice."""
        return [SimpleNamespace(message=SimpleNamespace(content=self.answer.text))]


def _track_completions(pipeline: Any, endpoints: _Endpoints) -> None:
    """Send every chat completion to its page's endpoint through that endpoint's gate,
    streamed, and record it on the thread that asked.

    PaddleX keeps only the answer's text, so whether it was cut off at the token limit or
    stopped as a loop would be lost. The request runs on PaddleX's event-loop thread, where
    the page is unknown; the call that starts it runs on the page's thread, so that is where
    the future is noted, and read again once `predict` returned.
    """
    def tracked(messages: Any, *, return_future: bool = False, **kwargs: Any) -> Any:
        key = block_key(messages)
        kept = _COMPLETIONS.keep.get(key)
        if kept is not None:  # a good answer of the page's last try: no request
            answered: Future[_Completion] = Future()
            answered.set_result(_Completion(StreamedAnswer(kept.text, kept.finish_reason,
                                                           kept.tokens)))
            if _COMPLETIONS.asked is not None:
                _COMPLETIONS.asked.append(_Asked(key, answered, kept.limit, reused=True,
                                                 image=image_url(messages)))
            return answered if return_future else answered.result()
        setting = _COMPLETIONS.blocks.get(key)
        if setting is not None:  # a block sent again with a setting of its own
            kwargs = _with_setting(kwargs, setting)
        url = _COMPLETIONS.url
        sent = within_aspect(messages)
        request = GatedRequest(
            endpoints.gate(url),
            lambda started: endpoints.send(url, sent, kwargs, started),
            _COMPLETIONS.priority,
            _COMPLETIONS.document,
        )
        request.send()
        announce, _COMPLETIONS.announce = _COMPLETIONS.announce, None
        if announce is not None:
            announce()
        if _COMPLETIONS.started is not None:
            _COMPLETIONS.started.append(request.future)
        if _COMPLETIONS.asked is not None:
            _COMPLETIONS.asked.append(_Asked(key, request.future, _limit(kwargs),
                                             image=image_url(messages)))
        shown = _failing_after_the_page(request.future)
        return shown if return_future else shown.result()

    pipeline.paddlex_pipeline.vl_rec_model.genai_client.create_chat_completion = tracked


def _failing_after_the_page(sent: Future[_Completion]) -> Future[_Completion]:
    """What PaddleX gets for the request `sent`: its answer, or an empty one where it failed.

    PaddleX cancels a page's other requests as soon as one fails; answered, it lets them end,
    and `_recognise` fails the page once they have, with their answers kept for its next try
    (a page of 30 blocks would otherwise need all 30 to succeed at once). Cancelling what it
    gets cancels the request.
    """
    shown: Future[_Completion] = Future()

    def settle(done: Future[_Completion]) -> None:
        with contextlib.suppress(InvalidStateError):  # PaddleX cancelled it meanwhile
            if done.cancelled():
                shown.cancel()
            elif done.exception() is not None:
                shown.set_result(_Completion(StreamedAnswer("", None, 0)))
            else:
                shown.set_result(done.result())

    sent.add_done_callback(settle)
    shown.add_done_callback(lambda f: sent.cancel() if f.cancelled() else None)
    return shown


def _with_setting(kwargs: dict[str, Any], setting: Redo) -> dict[str, Any]:
    """PaddleX's arguments of one block's chat completion (`kwargs`: the page's limit and
    penalty) with the block's own limit and penalty instead (none: none)."""
    limit_name = "max_tokens" if "max_tokens" in kwargs else "max_completion_tokens"
    extra = {k: v for k, v in (kwargs.get("extra_body") or {}).items()
             if k != "repetition_penalty"}
    if setting.repetition_penalty is not None:  # PaddleX sends it in the extra_body
        extra["repetition_penalty"] = setting.repetition_penalty
    return {**kwargs, limit_name: setting.max_new_tokens, "extra_body": extra}


def _limit(kwargs: dict[str, Any]) -> int:
    """The token limit a chat completion's arguments ask for (0: none)."""
    return int(kwargs.get("max_completion_tokens") or kwargs.get("max_tokens") or 0)


def block_key(messages: Any) -> str:
    """What a chat request asks, as a short digest of its messages (the block's image and
    prompt): the same block of the same page, laid out again, has the same key."""
    text = json.dumps(messages, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _answers(asked: list[_Asked]) -> list[BlockAnswer]:
    """The page's completions that came back, in the order asked: each one's key, how it
    ended, its text, tokens and limit, and whether it was kept from the last try."""
    answers = []
    for each in asked:
        future = each.future
        if future.done() and not future.cancelled() and future.exception() is None:
            answer = future.result().answer
            answers.append(BlockAnswer(each.key, answer.text, answer.finish_reason,
                                       answer.tokens, each.reused, each.limit,
                                       bool(answer.text.strip()) or _block_has_ink(each.image)))
    return answers


def _block_has_ink(url: str) -> bool:
    """Whether a block's image (a data URL) has ink; True when it cannot be read."""
    pixels = pixels_of(url)
    return True if pixels is None else has_ink(pixels)


def _token_ceiling(config: Config, server_url: str) -> int:
    """The most new tokens a request may ask for within the server's `max_model_len`.

    Asked afresh each time (rarely: only for a cut-off answer), since a restarted server
    may run with another length. 0 when the server does not say.
    """
    headers = bearer_header(config.server.api_key)
    try:
        response = httpx.get(f"{server_url.rstrip('/')}/models", headers=headers, timeout=10.0)
        response.raise_for_status()
        lengths = [
            int(m["max_model_len"]) for m in response.json()["data"] if m.get("max_model_len")
        ]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        log.warning("cannot read max_model_len from %s/models: %s", server_url, exc)
        return 0
    overhead = config.model.vl_model.request_token_budget(0)
    return max(0, min(lengths, default=0) - overhead)


class _DaemonLog(logging.Handler):
    """Hands the worker's log records (ocrvl's from INFO, libraries' from WARNING) to the
    daemon, which logs them at their own level: written to stderr, they would reach journald
    as text of no priority."""

    def __init__(self, channel: _Channel) -> None:
        super().__init__(logging.INFO)
        self._channel = channel
        self.setFormatter(PrintableFormatter())  # names on one line, as the daemon's own

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._channel.send(LogRecord(record.levelno, record.name, self.format(record)))
        except Exception:
            self.handleError(record)


def log_to_daemon(channel: _Channel, own: int = logging.INFO) -> None:
    """This child process's log records go to the daemon through `channel` (ocrvl's from
    `own`, libraries' from WARNING); set up first thing, before Paddle is imported."""
    logging.getLogger().addHandler(_DaemonLog(channel))
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("ocrvl_daemon").setLevel(own)  # e.g. the layout engine chosen
    for noisy in ("httpx", "httpx2", "openai"):  # one INFO line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Paddle warns at import, at every start, that ccache is missing: it compiles nothing
    # here, so that line would only be noise in the journal.
    warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)


def library_logs_to_daemon(level: int = logging.WARNING) -> None:
    """PaddleX's and paddleocr's records from `level` go to the daemon like this process's
    own; called once they are imported.

    Both libraries log to stderr through handlers of their own. PaddleX logs "Creating
    model: ..." at every worker start, coloured with escape codes that journald shows as
    garbage.
    """
    for name in ("paddlex", "paddleocr"):
        library_log = logging.getLogger(name)
        for handler in library_log.handlers[:]:
            library_log.removeHandler(handler)
        library_log.propagate = True
        library_log.setLevel(max(level, library_log.getEffectiveLevel()))


def serve() -> None:
    """The worker process's main (`EngineWorker.start` runs it with `python -c`).

    Messages are length-prefixed pickles of the `messages` dataclasses: a `WorkerSetup`
    from the parent, then `PageTask`s and `GateLimit`s until end of input; this side answers
    `WorkerReady` or `WorkerFailed`, then `RequestSent` and `PageResult` for each page, and
    `LogRecord`s.
    """
    channel = child_channel()  # a worker must not outlive a SIGKILLed daemon
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    log_to_daemon(channel)
    setup: WorkerSetup = channel.receive()
    server_url = setup.server_url
    config = Config.model_validate_json(setup.config_json)
    layout: LayoutProcess | None = None
    try:
        PaddleOCRVL = import_paddleocr_vl()
        library_logs_to_daemon()
        kwargs = pipeline_kwargs(config, server_url)
        if config.pipeline.use_layout_detection and kwargs.get("device") == "cpu":
            # It loads while this process builds its pipeline (whose model it stands in for).
            layout = LayoutProcess.started(setup.config_json, server_url)
        pipeline = PaddleOCRVL(**kwargs)
        failure = layout.wait_ready() if layout is not None else None
        if failure is None:
            _models_take_turns(pipeline, model_turns(kwargs.get("engine")), layout)
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
    endpoints = _Endpoints(config, server_url)
    _track_completions(pipeline, endpoints)
    _start_request_loop()
    channel.send(WorkerReady(os.getpid(), warm_s))
    # A thread for every page the converter sends (it bounds them: each endpoint's limit, the
    # ready margin and the pages of documents short of pages): a fixed pool would queue pages
    # unseen, behind the gates' back.
    pages: list[threading.Thread] = []
    while (message := channel.receive()) is not None:
        if isinstance(message, PageTask):
            page = threading.Thread(target=_run_page, name="page", daemon=True,
                                    args=(pipeline, config, server_url, message, channel))
            page.start()
            pages = [p for p in pages if p.is_alive()] + [page]
        elif isinstance(message, GateLimit):
            endpoints.gate(message.url).resize(message.limit, message.cap)
    for page in pages:
        page.join()
    if layout is not None:
        layout.close()
    # Every result is sent (`send` flushes). Paddle's teardown takes about a second and has
    # nothing to save; `ocrvl convert` would only wait for it.
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
            setattr(inner, name, _TakingTurns(target, turns))


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


def _end_worker(what: str) -> None:
    """The layout model's process is gone: end this worker as a crash of the model in it
    would, so that the converter tries its pages again (a page that kills it, alone)."""
    log.error("%s: this engine worker ends", what)
    sys.stderr.flush()
    os._exit(1)


def _start_request_loop() -> None:
    """Start PaddleX's request event loop now, from one thread.

    PaddleX starts it lazily on the first request without a lock: when the first pages
    arrive together, several threads start loops of their own, and requests fail with
    "... is bound to a different event loop" until one loop wins.
    """
    with contextlib.suppress(ImportError):
        from paddlex.inference.models.common.genai import start_aio_loop

        start_aio_loop()


def _run_page(
    pipeline: Any, config: Config, server_url: str, task: PageTask, channel: _Channel
) -> None:
    from ocrvl_daemon.errors import OcrvlError, PageDamagedError
    from ocrvl_daemon.files.pdf import PDFIUM_LOCK, check_unchanged, render_page

    started = time.monotonic()
    result = PageResult(task.job_id, task.page, url=task.url)
    path = Path(task.pdf)
    _COMPLETIONS.url = task.url
    _COMPLETIONS.announce = lambda: channel.send(RequestSent(task.job_id, task.page))
    _COMPLETIONS.priority = task.priority
    _COMPLETIONS.document = task.job_id
    _COMPLETIONS.keep = task.keep
    _COMPLETIONS.blocks = task.blocks
    _TURN_SPANS.spans = result.layout_spans
    try:
        check_unchanged(path, task.size, task.mtime)
        # Timed with PDFium's lock held (render_page takes it again): rendering is one lane
        # per worker, and the time spent waiting for it is not work.
        with PDFIUM_LOCK:
            rendering = time.monotonic()
            image = render_page(
                path, task.page, config.pipeline.render_scale, config.pipeline.page_pixel_limit
            )
            result.render_span = (rendering, time.monotonic())
        # Checked again: the file may have been replaced while the page was being rendered.
        check_unchanged(path, task.size, task.mtime)
        result.has_ink = has_ink(image)
        result.size = (int(image.shape[1]), int(image.shape[0]))
        res = _recognise(pipeline, config, server_url, image, task, result)
        del image
        result.blocks = _blocks(res)
        md = res.markdown
        result.markdown = md.get("markdown_texts", "") or ""
        for name, img in (md.get("markdown_images") or {}).items():
            buf = io.BytesIO()
            img.convert("RGB").save(buf, format="JPEG", quality=92)
            result.images[name] = buf.getvalue()
    except PageDamagedError as exc:
        result.error, result.error_kind = str(exc), Failure.DAMAGED
    except OcrvlError as exc:
        result.error, result.error_kind = str(exc), Failure.INPUT
    except Exception as exc:
        failure = _request_failure(exc, _COMPLETIONS.started or [])
        if failure is None:  # no request failed: how it happened is all there is to go on
            log.warning("page %d of %s failed", task.page + 1, path.name, exc_info=True,
                        extra=doc_fields(path, task.page + 1))
            failure = Failure.PAGE, f"{type(exc).__name__}: {exc}"
        result.error_kind, result.error = failure
    finally:
        _COMPLETIONS.started = _COMPLETIONS.announce = _COMPLETIONS.asked = None
        _COMPLETIONS.keep = {}
        _COMPLETIONS.blocks = {}
        _COMPLETIONS.priority = 0
        _COMPLETIONS.document = None
        _TURN_SPANS.spans = None
    result.seconds = time.monotonic() - started
    channel.send(result)


def _recognise(
    pipeline: Any, config: Config, server_url: str, image: Any, task: PageTask, result: PageResult
) -> Any:
    """Run the pipeline on one page and note each block's answer, and whether (and how) one
    was cut off: `decide` judges each block, and the page by its worst."""
    _COMPLETIONS.started = _TimedRequests(result.request_spans)
    _COMPLETIONS.asked = []
    sampling: dict[str, Any] = {}
    if task.repetition_penalty is not None:  # PaddleX sends it in the request's extra_body
        sampling["repetition_penalty"] = task.repetition_penalty
    (res,) = pipeline.predict(image, max_new_tokens=task.max_new_tokens, **sampling)
    answers = result.answers = _answers(_COMPLETIONS.asked)
    failed = [a for a in _COMPLETIONS.asked if a.future.done() and not a.future.cancelled()
              and a.future.exception() is not None]
    if failed:  # the page fails (`_request_failure` says how); the answers that came are kept
        result.failed = [a.key for a in failed]
        first = failed[0].future.exception()
        raise RuntimeError(f"{len(failed)} of the page's {len(_COMPLETIONS.asked)} requests "
                           f"failed, the first with {type(first).__name__}: {first}") from first
    result.tokens = sum(a.tokens for a in answers)
    result.repetition = max((repetition(a.text) for a in answers), default=0.0)
    # An answer stopped because it looped is one that would have run to the limit: judged
    # as cut off there and looping, it gets the loop-breaking retry at the same limit. Each
    # answer knows its own limit (a block sent again may have had more tokens than the page).
    cut = [a for a in answers if a.cut]
    result.finish_reason = "length" if cut else (answers[0].finish_reason if answers else None)
    if cut:
        result.truncated_at = max(a.limit for a in cut) or task.max_new_tokens
        result.looping = any(a.looping for a in cut)
        if not all(a.looping for a in cut):  # one needs more tokens: how many may it have
            result.token_ceiling = _token_ceiling(config, task.url or server_url)
    return res


def _blocks(res: Any) -> list[Block]:
    """The pipeline's blocks of one page (label, bbox in pixels, text)."""
    blocks = []
    for block in res.get("parsing_res_list") or []:
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            x0, y0, x1, y1 = (round(float(v), 1) for v in list(block.bbox)[:4])
            blocks.append(Block(str(block.label), (x0, y0, x1, y1), str(block.content or "")))
    return blocks


def _request_failure(exc: Exception, requests: list[Any]) -> tuple[Failure, str] | None:
    """What kind of request failure `exc` (raised by the pipeline for one page) is, and its
    text; None when no request to the server failed.

    Read from the page's own requests (`requests`, their futures) where one failed: PaddleX
    re-raises a request's error as a RuntimeError holding only its text. The HTTP status
    decides, not the error's name: a 5xx answer is the server failing the request, and no
    answer at all is the server being gone.
    """
    failed = [f.exception() for f in requests
              if isinstance(f, Future) and f.done() and not f.cancelled()]
    for error in [e for e in failed if e is not None] + list(_chain(exc)):
        if isinstance(error, StatusError):
            kind = Failure.SERVER_ERROR if error.status_code >= 500 else Failure.PAGE
            return kind, str(error)
        if isinstance(error, (httpx.TransportError, ConnectionError, TimeoutError)):
            return Failure.SERVER_DOWN, f"{type(error).__name__}: {error}"
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and the exceptions it was raised from or while handling."""
    seen: BaseException | None = exc
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__

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
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np

from ocrvl_daemon.core.quality import Redo, repetition
from ocrvl_daemon.errors import OcrvlError, PageDamagedError
from ocrvl_daemon.files.pdf import PDFIUM_LOCK, check_unchanged, render_page
from ocrvl_daemon.observe.logs import doc_fields
from ocrvl_daemon.process.channel import Channel, child_channel
from ocrvl_daemon.worker.child_logs import library_logs_to_daemon, log_to_daemon
from ocrvl_daemon.worker.layout_process import LayoutProcess
from ocrvl_daemon.worker.messages import (
    Block,
    BlockAnswer,
    ErrorRecord,
    Failure,
    GateLimit,
    PageResult,
    PageTask,
    RequestSent,
    WorkerFailed,
    WorkerReady,
    WorkerSetup,
)
from ocrvl_daemon.worker.paddlex_import import import_paddleocr_vl
from ocrvl_daemon.worker.pipeline import (
    _TURN_SPANS,
    Turns,
    _TakingTurns,
    inner_pipeline,
    limit_torch_threads,
    model_turns,
    start_request_loop,
    warm_layout_model,
)
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


def has_ink(image: np.ndarray) -> bool:
    """Whether a rendered page (an H x W x 3 array) has anything dark on it."""
    # The darkest channel of each pixel, channel by channel: numpy's min over the last axis
    # of 3 takes ~10x as long (68 ms for a 2x-rendered A4 page, on every page's way out).
    darkest = np.minimum(np.minimum(image[..., 0], image[..., 1]), image[..., 2])
    return bool(np.count_nonzero(darkest < INK_LEVEL) > INK_SHARE * darkest.size)


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

    A page's requests go to the endpoint the converter chose for it (`PageTask.url`), the
    only way an endpoint reaches the worker.
    """

    def __init__(self, setup: WorkerSetup) -> None:
        self._setup = setup
        self._lock = threading.Lock()  # guards _gates
        self._gates: dict[str, RequestGate] = {}
        # Used on PaddleX's event-loop thread only. The gates bound the requests in flight.
        self._client = httpx.AsyncClient(limits=httpx.Limits(
            max_connections=None, keepalive_expiry=KEEPALIVE_EXPIRY))

    def gate(self, url: str) -> RequestGate:
        """The request gate of `url`."""
        with self._lock:
            if url not in self._gates:
                self._gates[url] = RequestGate(self._setup.max_concurrency)
            return self._gates[url]

    def send(self, url: str, messages: Any, kwargs: dict[str, Any],
             started: Callable[[], None] | None = None) -> Future[_Completion]:
        """Send a chat completion (PaddleX's `create_chat_completion` arguments) to `url` on
        PaddleX's event loop; cancelling the future aborts it.
        `started` is called once its answer begins."""
        from paddlex.inference.models.common.genai import run_async

        body = request_body(self._setup.served_model, messages, kwargs)
        return run_async(self._complete(url, body, kwargs.get("timeout", 600),
                                        started),
                         return_future=True)

    async def _complete(self, url: str, body: dict[str, Any], timeout: float,
                        started: Callable[[], None] | None) -> _Completion:
        answer = await stream_completion(
            self._client, f"{url.rstrip('/')}/chat/completions", body,
            dict(self._setup.headers), timeout, stop_loops=self._setup.stop_loops_early,
            started=started)
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


def _token_ceiling(setup: WorkerSetup, server_url: str) -> int:
    """The most new tokens a request may ask for within the server's `max_model_len`.

    Asked afresh each time (rarely: only for a cut-off answer), since a restarted server
    may run with another length. 0 when the server does not say.
    """
    try:
        response = httpx.get(f"{server_url.rstrip('/')}/models", headers=setup.headers,
                             timeout=10.0)
        response.raise_for_status()
        lengths = [
            int(m["max_model_len"]) for m in response.json()["data"] if m.get("max_model_len")
        ]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        log.warning("cannot read max_model_len from %s/models: %s", server_url, exc)
        return 0
    return max(0, min(lengths, default=0) - setup.request_overhead_tokens)


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
                # It loads while this process builds its pipeline (whose model it stands in
                # for).
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
    endpoints = _Endpoints(setup)
    _track_completions(pipeline, endpoints)
    start_request_loop()
    channel.send(WorkerReady(os.getpid(), warm_s))
    # A thread for every page the converter sends (it bounds them: each endpoint's limit, the
    # ready margin and the pages of documents short of pages): a fixed pool would queue pages
    # unseen, behind the gates' back.
    pages: list[threading.Thread] = []
    while (message := channel.receive()) is not None:
        if isinstance(message, PageTask):
            page = threading.Thread(target=_run_page, name="page", daemon=True,
                                    args=(pipeline, setup, message, channel))
            page.start()
            pages = [p for p in pages if p.is_alive()] + [page]
        elif isinstance(message, GateLimit):
            endpoints.gate(message.url).resize(message.limit, message.cap)
    for page in pages:
        page.join()
    if layout is not None:
        layout.close()
    # Every result is sent (`send` writes it whole). Paddle's teardown takes about a second and has
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


def _end_worker(what: str) -> None:
    """The layout model's process is gone: end this worker as a crash of the model in it
    would, so that the converter tries its pages again (a page that kills it, alone)."""
    log.error("%s: this engine worker ends", what)
    sys.stderr.flush()
    os._exit(1)


def _run_page(pipeline: Any, setup: WorkerSetup, task: PageTask, channel: Channel) -> None:

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
                path, task.page, setup.render_scale, setup.page_pixel_limit
            )
            result.render_span = (rendering, time.monotonic())
        # Checked again: the file may have been replaced while the page was being rendered.
        check_unchanged(path, task.size, task.mtime)
        result.has_ink = has_ink(image)
        result.size = (int(image.shape[1]), int(image.shape[0]))
        res = _recognise(pipeline, setup, image, task, result)
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
    except OcrvlError as exc:  # the file as queued cannot be read: the error, kind and all
        result.error, result.error_kind = str(exc), Failure.INPUT
        result.problem = ErrorRecord.of(exc)
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
    pipeline: Any, setup: WorkerSetup, image: Any, task: PageTask, result: PageResult
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
            result.token_ceiling = _token_ceiling(setup, task.url)
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

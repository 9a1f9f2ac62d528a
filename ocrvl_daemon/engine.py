"""PaddleOCR-VL in a replaceable worker process, working one page at a time.

The parent submits `PageTask`s and collects `PageResult`s; the worker renders each page itself
(so page images never cross the process boundary or pile up in the daemon) and runs the real
`paddleocr.PaddleOCRVL` pipeline on it with `vl_rec_backend="vllm-server"`. Pages run
concurrently on threads, so the server always has requests to work on: while one page waits
for the model, the next is rendered and laid out. paddleocr's host memory grows over many
`predict` calls, hence the worker is replaced after N pages or above an RSS limit.
"""

from __future__ import annotations

import contextlib
import heapq
import importlib
import io
import itertools
import logging
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
import types
import warnings
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import psutil

from ocrvl_daemon.config import Config
from ocrvl_daemon.logs import basic_logging
from ocrvl_daemon.page_quality import looks_like_a_loop, repetition
from ocrvl_daemon.process_group import die_with_parent
from ocrvl_daemon.scheduler import SHORT_EXTRA, SHORT_OF_PAGES, ready_margin
from ocrvl_daemon.systemd import child_env

log = logging.getLogger(__name__)

# Errors from the OpenAI client that mean "the server is not there right now", by class name
# (the parent never imports openai).
SERVER_DOWN_ERRORS = {
    "APIConnectionError",
    "APITimeoutError",
    "InternalServerError",
    "ConnectError",
    "ConnectionError",
    "ReadTimeout",
    "RemoteProtocolError",
    "ServiceUnavailableError",
}


@dataclass(frozen=True)
class PageTask:
    """Recognise page `page` (0-based) of `pdf` for job `job_id`."""

    job_id: int
    pdf: str
    page: int
    max_new_tokens: int
    # The file's (size, mtime) when the job was queued: a page rendered from another version
    # of the file must not be checkpointed under this version's hash.
    size: int
    mtime: float
    # Pages of its document in flight before it: the request gate lets the page with the
    # fewest through first (a letter's pages pass the book pages already waiting), and lets
    # one of a document short of pages bump a young request of a document with many.
    priority: int = 0
    # vLLM's loop-breaking sampling parameter, only when the page is sent again after a loop.
    repetition_penalty: float | None = None


# A page image with more than this share of dark pixels has ink on it: an empty answer for
# it is a failure, not a blank page. One line of small text on a 2x-rendered A4 page is
# about 0.1%; scanner noise on a blank page stays well below.
INK_SHARE = 0.0005
INK_LEVEL = 128


def has_ink(image: Any) -> bool:
    """Whether a rendered page (an H x W x 3 array) has anything dark on it."""
    return bool((image.min(axis=2) < INK_LEVEL).mean() > INK_SHARE)


@dataclass
class PageResult:
    """What came back for one page: Markdown and images, or why it failed."""

    job_id: int
    page: int
    markdown: str = ""
    images: dict[str, bytes] = field(default_factory=dict)
    error: str | None = None
    error_kind: str | None = None  # "server", "input", "damaged" (the page itself), "page"
    seconds: float = 0.0
    # Set when an answer of the page was cut off at the token limit (finish_reason
    # "length"): the limit that cut it off. The converter decides whether to redo the page.
    truncated_at: int | None = None
    looping: bool = False  # a cut-off answer repeats itself (page_quality.looks_like_a_loop)
    token_ceiling: int = 0  # the most new tokens the server allows, read when cut off
    tokens: int = 0  # completion tokens the page's answers took
    finish_reason: str | None = None  # "length" if any answer was cut off, else the first's
    repetition: float = 0.0  # the worst page_quality.repetition of its answers
    has_ink: bool = False  # the page image is not blank
    size: tuple[int, int] = (0, 0)  # the page image's width and height in pixels
    # The pipeline's blocks: label, bbox [x0, y0, x1, y1] in page pixels, text.
    blocks: list[dict[str, Any]] = field(default_factory=list)


def pipeline_kwargs(config: Config, server_url: str) -> dict[str, Any]:
    """Constructor arguments of `PaddleOCRVL` for this configuration."""
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
    if p.device:
        kwargs["device"] = p.device
    elif not (p.use_layout_detection or p.use_doc_orientation_classify or p.use_doc_unwarping):
        # Nothing runs here but requests to the server: naming a device spares paddlex its
        # probe for one (without PaddlePaddle: importing torch and starting CUDA, ~4 s).
        kwargs["device"] = "cpu"
    return kwargs


class _Locked:
    """Serialises calls into a model that is not thread-safe (the layout detector)."""

    def __init__(self, target: Any, lock: threading.Lock) -> None:
        self._target = target
        self._lock = lock

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return list(self._target(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


# How long a request short of pages waits for a place before it bumps one (RequestGate).
BUMP_AFTER = 1.0


@dataclass(eq=False)
class GatePlace:
    """One request's place at the server."""

    priority: int
    since: float
    # Cancels the request to free the place for a more urgent one; None until it is sent,
    # and for requests that must not be bumped.
    bump: Callable[[], object] | None = None
    bumped: bool = False


class RequestGate:
    """At most `limit` chat requests at the server at once; waiting ones go in order of
    priority (lower first), then of arrival.

    PaddleX's own request semaphore is fixed at `max_concurrency` when the pipeline is built;
    this one follows the converter's concurrency search, so a probe or a back-off below the
    maximum is exactly what the server sees.

    A request of a document short of pages in flight (priority below
    scheduler.SHORT_OF_PAGES) does not wait long for a place when the server is full: after
    `bump_after` seconds it bumps the youngest request of a document with BUMP_GAP more
    pages in flight, if that one started within BUMP_MAX_AGE seconds. The bumped one is
    sent again first, as soon as a place is free. Why: pages that start together end
    together, so after a book's first batch no place frees for several seconds; a letter
    dropped then would wait all that time. A bump costs what the bumped page had decoded
    and its prefill, hence the patience: once pages end at different times, a finishing
    one lets the letter in sooner.
    """

    BUMP_GAP = 8
    BUMP_MAX_AGE = 5.0
    RESEND_PRIORITY = -1  # a bumped request goes before everything waiting

    def __init__(self, limit: int, bump_after: float = BUMP_AFTER) -> None:
        # Re-entrant: bumping cancels a request, whose callback gives its place back here.
        self._cond = threading.Condition(threading.RLock())
        self._limit = max(1, limit)
        self._bump_after = bump_after
        self._open: list[GatePlace] = []
        self._waiting: list[tuple[int, int]] = []  # heap of (priority, arrival)
        self._arrivals = itertools.count()
        self.bumps = 0

    def resize(self, limit: int) -> None:
        """New bound; requests already sent above it finish, no new one starts until below."""
        with self._cond:
            self._limit = max(1, limit)
            self._cond.notify_all()

    def acquire(self, priority: int = 0) -> GatePlace:
        """Wait for a free place and for every request ahead in line, then take the place."""
        with self._cond:
            ticket = (priority, next(self._arrivals))
            heapq.heappush(self._waiting, ticket)
            may_bump_at = time.monotonic() + self._bump_after
            while not (len(self._open) < self._limit and self._waiting[0] == ticket):
                patience = may_bump_at - time.monotonic()
                victim = None
                if self._waiting[0] == ticket and patience <= 0:
                    victim = self._victim(priority)
                if victim is None:
                    self._cond.wait(patience if patience > 0 else None)
                    continue
                victim.bumped = True
                self.bumps += 1
                assert victim.bump is not None
                victim.bump()  # gives the place back (now or once the cancel lands)
            heapq.heappop(self._waiting)
            place = GatePlace(priority, time.monotonic())
            self._open.append(place)
            self._cond.notify_all()  # the next in line may fit too
            return place

    def _victim(self, priority: int) -> GatePlace | None:
        """The request to bump for one of `priority`, if any (the lock is held)."""
        if priority >= SHORT_OF_PAGES or priority == self.RESEND_PRIORITY:
            return None
        if any(p.bumped for p in self._open):
            return None  # a place is being freed already
        oldest = time.monotonic() - self.BUMP_MAX_AGE
        candidates = [
            p for p in self._open
            if p.bump is not None and p.priority >= priority + self.BUMP_GAP and p.since >= oldest
        ]  # fmt: skip
        return max(candidates, key=lambda p: p.since, default=None)

    def release(self, place: GatePlace) -> None:
        """Give a place back."""
        with self._cond:
            self._open.remove(place)
            self._cond.notify_all()

    @property
    def open(self) -> int:
        """Requests at the server now."""
        return len(self._open)

    @property
    def waiting(self) -> int:
        """Requests waiting for a place (each has decided whether to bump, for now)."""
        with self._cond:
            return len(self._waiting)


class GatedRequest:
    """One chat request through the gate, sent again if the gate bumps it.

    `future` is what PaddleX waits on: it ends with the answer of whichever attempt was not
    bumped. Cancelling it cancels the request at the server.
    """

    def __init__(self, gate: RequestGate, start: Callable[[], Future[Any]], priority: int):
        self.future: Future[Any] = Future()
        self._gate = gate
        self._start = start
        self._priority = priority
        self._sent: Future[Any] | None = None
        self.future.add_done_callback(self._on_cancel)

    def send(self, priority: int | None = None) -> None:
        """Wait for a place at the server and send the request (raises if it cannot start)."""
        place = self._gate.acquire(self._priority if priority is None else priority)
        if self.future.done():  # cancelled while it waited to be sent again
            self._gate.release(place)
            return
        try:
            sent = self._start()
        except BaseException:
            self._gate.release(place)
            raise
        self._sent = sent
        if priority is None:  # a request sent again is not bumped twice
            place.bump = sent.cancel
        sent.add_done_callback(lambda done: self._on_done(done, place))

    def _on_done(self, sent: Future[Any], place: GatePlace) -> None:
        self._gate.release(place)
        if self.future.done():
            return
        if sent.cancelled():
            if place.bumped:
                threading.Thread(target=self._send_again, name="bumped-request",
                                 daemon=True).start()
            else:
                self.future.cancel()
            return
        with contextlib.suppress(InvalidStateError):  # PaddleX cancelled it meanwhile
            if (exc := sent.exception()) is not None:
                self.future.set_exception(exc)
            else:
                self.future.set_result(sent.result())

    def _send_again(self) -> None:
        try:
            self.send(RequestGate.RESEND_PRIORITY)
        except BaseException as exc:
            with contextlib.suppress(InvalidStateError):
                self.future.set_exception(exc)

    def _on_cancel(self, future: Future[Any]) -> None:
        if future.cancelled() and self._sent is not None:
            self._sent.cancel()


class _Completions(threading.local):
    """The chat completions (futures) requested on this thread during one page, and how to
    tell the converter once the page's first request leaves for the server."""

    started: list[Any] | None = None
    announce: Callable[[], None] | None = None
    priority = 0


_COMPLETIONS = _Completions()


def _track_completions(pipeline: Any, gate: RequestGate) -> None:
    """Pass every chat completion through `gate` and record it on the thread that asked.

    PaddleX keeps only `choices[0].message.content`, so whether an answer was cut off at
    the token limit is lost. The request runs on PaddleX's event-loop thread, where the page
    is unknown; the call that starts it runs on the page's thread, so that is where the
    future is noted, and read again once `predict` returned.
    """
    client = pipeline.paddlex_pipeline.vl_rec_model.genai_client
    create = client.create_chat_completion

    def tracked(messages: Any, *, return_future: bool = False, **kwargs: Any) -> Any:
        request = GatedRequest(
            gate,
            lambda: create(messages, return_future=True, **kwargs),
            _COMPLETIONS.priority,
        )
        request.send()
        announce, _COMPLETIONS.announce = _COMPLETIONS.announce, None
        if announce is not None:
            announce()
        if _COMPLETIONS.started is not None:
            _COMPLETIONS.started.append(request.future)
        return request.future if return_future else request.future.result()

    client.create_chat_completion = tracked


@dataclass(frozen=True)
class _Answer:
    finish_reason: str | None
    text: str
    tokens: int


def _answers(started: list[Any]) -> list[_Answer]:
    """The page's completions that came back: how each ended, its text, its token count."""
    answers = []
    for item in started:
        if isinstance(item, Future):
            if not item.done() or item.cancelled() or item.exception() is not None:
                continue
            item = item.result()
        with contextlib.suppress(AttributeError, IndexError, TypeError):
            usage = getattr(item, "usage", None)
            answers.append(_Answer(item.choices[0].finish_reason,
                                   item.choices[0].message.content or "",
                                   int(getattr(usage, "completion_tokens", 0) or 0)))
    return answers


def _token_ceiling(config: Config, server_url: str) -> int:
    """The most new tokens a request may ask for within the server's `max_model_len`.

    Asked afresh each time (rarely: only for a cut-off answer), since a restarted server
    may run with another length. 0 when the server does not say.
    """
    headers = {"Authorization": f"Bearer {config.server.api_key}"} if config.server.api_key else {}
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


WORKER_LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def _plain_paddlex_log() -> None:
    """Keep PaddleX's warnings, in the worker's plain format, and drop its INFO lines.

    PaddleX logs "Creating model: ..." at every worker start, coloured with escape codes
    that journald shows as garbage.
    """
    paddlex_log = logging.getLogger("paddlex")
    paddlex_log.setLevel(logging.WARNING)
    for handler in paddlex_log.handlers:
        handler.setFormatter(logging.Formatter(WORKER_LOG_FORMAT))


def _lean_paddlex_import() -> None:
    """Keep paddlex's import from loading torch, transformers and peft, which the worker never
    uses: ~10 s of a worker's start where they are installed (a GPU machine's Python).

    modelscope, which paddlex imports, replaces itself with a lazy module after importing
    `modelscope.hub`, so the lazy module lacks the `hub` attribute; paddlex's `import
    modelscope.hub.errors as ...` then asks for it, and modelscope looks for a `hub` in
    transformers and peft in turn, importing them (and torch). Giving it its `hub` first
    avoids that. Its logger also imports `modelscope.utils.torch_utils` (and torch) only to
    ask whether torch.distributed runs: a stand-in answers that; anything else asked of the
    module loads the real one.
    """
    name = "modelscope.utils.torch_utils"
    if name not in sys.modules:
        stand_in = types.ModuleType(name)

        def real(attr: str) -> Any:
            if attr.startswith("__"):  # the import system's own questions (__path__...)
                raise AttributeError(attr)
            if sys.modules.get(name) is stand_in:
                del sys.modules[name]
            return getattr(importlib.import_module(name), attr)

        stand_in.is_dist = lambda: False  # type: ignore[attr-defined]
        stand_in.is_master = lambda group=None: True  # type: ignore[attr-defined]
        stand_in.__getattr__ = real  # type: ignore[method-assign]
        sys.modules[name] = stand_in
    try:
        import modelscope
        import modelscope.hub.errors  # binds `modelscope` only: no lookup on the lazy module
    except ImportError:
        return
    if "hub" not in vars(modelscope):
        modelscope.hub = sys.modules["modelscope.hub"]  # type: ignore[attr-defined]


def serve() -> None:
    """The worker process's main: `python -c "from ocrvl_daemon.engine import serve; serve()"`.

    Messages are length-prefixed pickles: the first one from the parent is the configuration,
    then `PageTask`s and ("limit", n) (the requests allowed at the server) until end of input;
    this side answers "ready"/"failed", "sent" (a page's first request left for the server)
    and "page" results.
    """
    die_with_parent(signal.SIGKILL)  # a worker must not outlive a SIGKILLed daemon
    if os.getppid() != int(sys.argv[1]):  # the daemon died before the line above
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when we stop
    # fd 1 carries the protocol; anything a library prints goes to stderr instead.
    channel = _Channel(sys.stdin.buffer, os.fdopen(os.dup(1), "wb"))
    os.dup2(2, 1)
    basic_logging(logging.WARNING, WORKER_LOG_FORMAT)
    for noisy in ("httpx", "httpx2", "openai"):  # one INFO line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Paddle warns at import, at every worker start, that ccache is missing: it compiles
    # nothing here, so that line would only be noise in the journal.
    warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)
    config_json, server_url = channel.receive()
    config = Config.model_validate_json(config_json)
    try:
        _lean_paddlex_import()
        from paddleocr import PaddleOCRVL

        _plain_paddlex_log()
        pipeline = PaddleOCRVL(**pipeline_kwargs(config, server_url))
    except BaseException as exc:  # report anything, even SystemExit from a dependency check
        channel.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    # Paddle's C++ runtime installs a SIGTERM handler that prints a crash report; a worker
    # being replaced or stopped is not a crash.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    inner = pipeline.paddlex_pipeline
    lock = threading.Lock()
    for name in ("layout_det_model", "doc_preprocessor_pipeline"):
        if hasattr(inner, name):
            setattr(inner, name, _Locked(getattr(inner, name), lock))
    gate = RequestGate(config.pipeline.max_concurrency)
    _track_completions(pipeline, gate)
    _start_request_loop()
    channel.send(("ready", os.getpid()))
    # Enough threads for every page the converter may send: up to `max_concurrency` waiting on
    # the server, the ready margin being rendered meanwhile, and the pages of documents short
    # of pages. A smaller pool would queue pages unseen, behind the gate's back.
    most = config.pipeline.max_concurrency
    threads = most + ready_margin(most) + SHORT_EXTRA
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="page") as pool:
        while (message := channel.receive()) is not None:
            if isinstance(message, PageTask):
                pool.submit(_run_page, pipeline, config, server_url, message, channel)
            else:
                gate.resize(message[1])
    # Every result is sent (`send` flushes). Paddle's teardown takes about a second and has
    # nothing to save; `ocrvl convert` would only wait for it.
    sys.stderr.flush()
    os._exit(0)


def _start_request_loop() -> None:
    """Start PaddleX's request event loop now, from one thread.

    PaddleX starts it lazily on the first request without a lock: when the first pages
    arrive together, several threads start loops of their own, and requests fail with
    "... is bound to a different event loop" until one loop wins.
    """
    with contextlib.suppress(ImportError):
        from paddlex.inference.models.common.genai import start_aio_loop

        start_aio_loop()


class _Channel:
    """Length-prefixed pickles over a pair of pipes; `send` is safe from many threads."""

    _HEADER = struct.Struct(">I")

    def __init__(self, reader: IO[bytes], writer: IO[bytes]) -> None:
        self._reader = reader
        self._writer = writer
        self._lock = threading.Lock()

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self._writer.write(self._HEADER.pack(len(data)) + data)
            self._writer.flush()

    def receive(self) -> Any:
        """The next message; None at end of input."""
        header = self._reader.read(self._HEADER.size)
        if len(header) < self._HEADER.size:
            return None
        (size,) = self._HEADER.unpack(header)
        data = self._reader.read(size)
        if len(data) < size:
            return None
        return pickle.loads(data)


def _run_page(
    pipeline: Any, config: Config, server_url: str, task: PageTask, channel: _Channel
) -> None:
    from ocrvl_daemon.errors import OcrvlError, PageDamagedError
    from ocrvl_daemon.pdf import check_unchanged, render_page

    started = time.monotonic()
    result = PageResult(task.job_id, task.page)
    path = Path(task.pdf)
    _COMPLETIONS.announce = lambda: channel.send(("sent", (task.job_id, task.page)))
    _COMPLETIONS.priority = task.priority
    try:
        check_unchanged(path, task.size, task.mtime)
        image = render_page(
            path, task.page, config.pipeline.render_scale, config.pipeline.max_page_pixels
        )
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
        result.error, result.error_kind = str(exc), "damaged"
    except OcrvlError as exc:
        result.error, result.error_kind = str(exc), "input"
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        result.error_kind = "server" if _is_server_down(exc) else "page"
    finally:
        _COMPLETIONS.started = _COMPLETIONS.announce = None
        _COMPLETIONS.priority = 0
    result.seconds = time.monotonic() - started
    channel.send(("page", result))


def _recognise(
    pipeline: Any, config: Config, server_url: str, image: Any, task: PageTask, result: PageResult
) -> Any:
    """Run the pipeline on one page and note whether (and how) an answer was cut off."""
    _COMPLETIONS.started = []
    sampling: dict[str, Any] = {}
    if task.repetition_penalty is not None:  # PaddleX sends it in the request's extra_body
        sampling["repetition_penalty"] = task.repetition_penalty
    (res,) = pipeline.predict(image, max_new_tokens=task.max_new_tokens, **sampling)
    answers = _answers(_COMPLETIONS.started)
    result.tokens = sum(a.tokens for a in answers)
    result.repetition = max((repetition(a.text) for a in answers), default=0.0)
    cut = [a for a in answers if a.finish_reason == "length"]
    result.finish_reason = "length" if cut else (answers[0].finish_reason if answers else None)
    if cut:
        result.truncated_at = task.max_new_tokens
        result.looping = any(looks_like_a_loop(a.text) for a in cut)
        if not result.looping:
            result.token_ceiling = _token_ceiling(config, server_url)
    return res


def _blocks(res: Any) -> list[dict[str, Any]]:
    """The pipeline's blocks of one page, as plain values (label, bbox in pixels, text)."""
    blocks = []
    for block in res.get("parsing_res_list") or []:
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            blocks.append({"label": str(block.label),
                           "bbox": [round(float(v), 1) for v in list(block.bbox)[:4]],
                           "text": str(block.content or "")})
    return blocks


def _is_server_down(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if type(seen).__name__ in SERVER_DOWN_ERRORS or isinstance(seen, ConnectionError):
            return True
        seen = seen.__cause__ or seen.__context__
    # PaddleX wraps worker exceptions in RuntimeError with the original text.
    return any(name in str(exc) for name in SERVER_DOWN_ERRORS)


class EngineWorker:
    """One worker process; `submit` pages, `collect` results, `stop` when done."""

    def __init__(self, config: Config, server_url: str) -> None:
        self._config_json = config.model_dump_json()
        self._server_url = server_url
        self._process: subprocess.Popen[bytes] | None = None
        self._channel: _Channel | None = None
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._arrived = threading.Event()
        self._reader: threading.Thread | None = None
        self.in_flight: set[tuple[int, int]] = set()
        self.sent: set[tuple[int, int]] = set()  # in flight and asked of the server
        self.pages_done = 0
        self.limit: int | None = None  # the request gate's size, once told
        self.ready = False
        self.failure: str | None = None
        self.started_at = time.monotonic()

    def start(self) -> None:
        """Start the process; it reports readiness through `collect`."""
        argv = [sys.executable, "-c", "from ocrvl_daemon.engine import serve; serve()",
                str(os.getpid())]
        self._process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         env=child_env(os.environ))
        assert self._process.stdin is not None and self._process.stdout is not None
        self._channel = _Channel(self._process.stdout, self._process.stdin)
        self._reader = threading.Thread(target=self._read, name="engine-results", daemon=True)
        self._reader.start()
        self._channel.send((self._config_json, self._server_url))
        log.info("engine worker started (pid %s)", self._process.pid)

    def _read(self) -> None:
        assert self._channel is not None
        try:
            while (message := self._channel.receive()) is not None:
                self._inbox.put(message)
                self._arrived.set()
        except (OSError, ValueError, pickle.UnpicklingError) as exc:
            log.warning("engine worker %s: broken result stream: %s", self.pid, exc)

    @property
    def pid(self) -> int | None:
        """The worker's process id."""
        return self._process.pid if self._process else None

    def alive(self) -> bool:
        """Whether the worker process still runs."""
        return self._process is not None and self._process.poll() is None

    def rss_mb(self) -> float:
        """Resident memory of the worker, in MiB."""
        try:
            return psutil.Process(self.pid).memory_info().rss / 2**20
        except (psutil.Error, TypeError, ValueError):
            return 0.0

    def submit(self, task: PageTask) -> None:
        """Hand one page to the worker."""
        self.in_flight.add((task.job_id, task.page))
        assert self._channel is not None
        # A dead worker is noticed by `alive()`; its pages are given back then.
        with contextlib.suppress(OSError, ValueError):
            self._channel.send(task)

    def set_limit(self, limit: int) -> None:
        """How many requests the worker may have at the server (sent only when it changes)."""
        if limit != self.limit:
            self.limit = limit
            assert self._channel is not None
            with contextlib.suppress(OSError, ValueError):
                self._channel.send(("limit", limit))

    def wait(self, timeout: float) -> None:
        """Block until a message arrives (or `timeout`); `collect` then takes it."""
        if self._inbox.empty():
            self._arrived.wait(timeout)
        self._arrived.clear()

    def collect(self, timeout: float = 0.0) -> list[PageResult]:
        """Results that arrived; waits up to `timeout` for the first one."""
        out: list[PageResult] = []
        block = timeout > 0
        while True:
            try:
                kind, payload = self._inbox.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                break
            block = False
            if kind == "ready":
                self.ready = True
                log.info(
                    "engine worker %s ready in %.1f s", payload, time.monotonic() - self.started_at
                )
            elif kind == "failed":
                self.failure = payload
            elif kind == "sent":
                if payload in self.in_flight:
                    self.sent.add(payload)
            else:
                self.in_flight.discard((payload.job_id, payload.page))
                self.sent.discard((payload.job_id, payload.page))
                self.pages_done += 1
                out.append(payload)
        return out

    def kill(self) -> None:
        """A forced stop: SIGKILL the worker now and reap it."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        log.warning("engine worker %s: SIGKILL (forced stop)", process.pid)
        process.kill()
        process.wait()

    def stop(self, timeout: float = 10.0) -> None:
        """Close the worker's input (it finishes what it has), then TERM/KILL and reap."""
        process = self._process
        if process is None:
            return
        with contextlib.suppress(OSError, ValueError):
            assert process.stdin is not None
            process.stdin.close()
        try:
            process.wait(min(timeout, 2.0))
        except subprocess.TimeoutExpired:
            log.info("engine worker %s: sending SIGTERM", process.pid)
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("engine worker %s did not stop; sending SIGKILL", process.pid)
                process.kill()
                process.wait()
        if self._reader is not None:
            self._reader.join(timeout)
        assert process.stdout is not None
        process.stdout.close()
        log.info("engine worker %s stopped (exit %s)", process.pid, process.returncode)

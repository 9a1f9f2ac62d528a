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
import io
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from ocrvl_daemon.config import Config
from ocrvl_daemon.process_group import die_with_parent
from ocrvl_daemon.systemd import NOTIFY_ENV

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
WORKER_START_TIMEOUT = 300.0


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


@dataclass
class PageResult:
    """What came back for one page: Markdown and images, or why it failed."""

    job_id: int
    page: int
    markdown: str = ""
    images: dict[str, bytes] = field(default_factory=dict)
    error: str | None = None
    error_kind: str | None = None  # "server", "input", "page"
    seconds: float = 0.0
    # Set when the model's answer was still cut off at the token limit (finish_reason
    # "length") after any retry with a larger limit: the limit that cut it off.
    truncated_at: int | None = None


def pipeline_kwargs(config: Config, server_url: str) -> dict[str, Any]:
    """Constructor arguments of `PaddleOCRVL` for this configuration."""
    p = config.pipeline
    kwargs: dict[str, Any] = {
        "pipeline_version": config.model.vl_model.pipeline_version,
        "vl_rec_backend": "vllm-server",
        "vl_rec_server_url": server_url,
        # The request's `model` must be exactly what the server serves.
        "vl_rec_api_model_name": config.model.name,
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


class _Completions(threading.local):
    """The chat completions (futures) requested on this thread during one page."""

    started: list[Any] | None = None


_COMPLETIONS = _Completions()


def _track_completions(pipeline: Any) -> None:
    """Record every chat completion on the thread that asked for it.

    PaddleX keeps only `choices[0].message.content`, so whether an answer was cut off at
    the token limit is lost. The request runs on PaddleX's event-loop thread, where the page
    is unknown; the call that starts it runs on the page's thread, so that is where the
    future is noted, and read again once `predict` returned.
    """
    client = pipeline.paddlex_pipeline.vl_rec_model.genai_client
    create = client.create_chat_completion

    def tracked(messages: Any, *, return_future: bool = False, **kwargs: Any) -> Any:
        started = create(messages, return_future=return_future, **kwargs)
        if _COMPLETIONS.started is not None:
            _COMPLETIONS.started.append(started)
        return started

    client.create_chat_completion = tracked


def _cut_off(started: list[Any]) -> bool:
    """Whether any completion of the page ended at the token limit (finish_reason length)."""
    for item in started:
        if isinstance(item, Future):
            if not item.done() or item.cancelled() or item.exception() is not None:
                continue
            item = item.result()
        with contextlib.suppress(AttributeError, IndexError):
            if item.choices[0].finish_reason == "length":
                return True
    return False


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


def _worker_main(config_json: str, server_url: str, tasks: mp.Queue, results: mp.Queue) -> None:
    die_with_parent(signal.SIGKILL)  # a worker must not outlive a SIGKILLed daemon
    for name in NOTIFY_ENV:  # systemd talks to the daemon alone
        os.environ.pop(name, None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when we stop
    logging.basicConfig(level=logging.WARNING)
    for noisy in ("httpx", "httpx2", "openai"):  # one INFO line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    config = Config.model_validate_json(config_json)
    try:
        from paddleocr import PaddleOCRVL

        pipeline = PaddleOCRVL(**pipeline_kwargs(config, server_url))
    except BaseException as exc:  # report anything, even SystemExit from a dependency check
        results.put(("failed", f"{type(exc).__name__}: {exc}"))
        return
    # Paddle's C++ runtime installs a SIGTERM handler that prints a crash report; a worker
    # being replaced or stopped is not a crash.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    inner = pipeline.paddlex_pipeline
    lock = threading.Lock()
    for name in ("layout_det_model", "doc_preprocessor_pipeline"):
        if hasattr(inner, name):
            setattr(inner, name, _Locked(getattr(inner, name), lock))
    _track_completions(pipeline)
    results.put(("ready", os.getpid()))
    p = config.pipeline
    with ThreadPoolExecutor(max_workers=p.max_concurrency, thread_name_prefix="page") as pool:
        while True:
            task = tasks.get()
            if task is None:
                break
            pool.submit(_run_page, pipeline, config, server_url, task, results)


def _run_page(
    pipeline: Any, config: Config, server_url: str, task: PageTask, results: mp.Queue
) -> None:
    from ocrvl_daemon.errors import OcrvlError
    from ocrvl_daemon.pdf import check_unchanged, render_page

    started = time.monotonic()
    result = PageResult(task.job_id, task.page)
    path = Path(task.pdf)
    try:
        check_unchanged(path, task.size, task.mtime)
        image = render_page(
            path, task.page, config.pipeline.render_scale, config.pipeline.max_page_pixels
        )
        # Checked again: the file may have been replaced while the page was being rendered.
        check_unchanged(path, task.size, task.mtime)
        res = _recognise(pipeline, config, server_url, image, task, result)
        del image
        md = res.markdown
        result.markdown = md.get("markdown_texts", "") or ""
        for name, img in (md.get("markdown_images") or {}).items():
            buf = io.BytesIO()
            img.convert("RGB").save(buf, format="JPEG", quality=92)
            result.images[name] = buf.getvalue()
    except OcrvlError as exc:
        result.error, result.error_kind = str(exc), "input"
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        result.error_kind = "server" if _is_server_down(exc) else "page"
    finally:
        _COMPLETIONS.started = None
    result.seconds = time.monotonic() - started
    results.put(("page", result))


def _recognise(
    pipeline: Any, config: Config, server_url: str, image: Any, task: PageTask, result: PageResult
) -> Any:
    """Run the pipeline on one page; a cut-off answer is redone with a larger token limit.

    Long tables often need more tokens than the configured limit. The limit doubles while
    the server's `max_model_len` allows; an answer still cut off is kept and flagged.
    """
    tokens = task.max_new_tokens
    while True:
        _COMPLETIONS.started = []
        (res,) = pipeline.predict(image, max_new_tokens=tokens)
        if not _cut_off(_COMPLETIONS.started):
            result.truncated_at = None
            return res
        result.truncated_at = tokens
        larger = min(tokens * 2, _token_ceiling(config, server_url))
        if larger <= tokens:
            return res
        log.warning(
            "%s p.%d: answer cut off at %d tokens; redoing it with %d",
            task.pdf,
            task.page + 1,
            tokens,
            larger,
        )
        tokens = larger


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
        ctx = mp.get_context("spawn")
        self._tasks: mp.Queue = ctx.Queue()
        self._results: mp.Queue = ctx.Queue()
        self._process = ctx.Process(
            target=_worker_main,
            args=(config.model_dump_json(), server_url, self._tasks, self._results),
            name="ocrvl-engine",
            daemon=True,
        )
        self.in_flight: set[tuple[int, int]] = set()
        self.pages_done = 0
        self.ready = False
        self.failure: str | None = None
        self.started_at = time.monotonic()

    def start(self) -> None:
        """Start the process; it reports readiness through `collect`."""
        self._process.start()
        log.info("engine worker started (pid %s)", self._process.pid)

    @property
    def pid(self) -> int | None:
        """The worker's process id."""
        return self._process.pid

    def alive(self) -> bool:
        """Whether the worker process still runs."""
        return self._process.is_alive()

    def rss_mb(self) -> float:
        """Resident memory of the worker, in MiB."""
        try:
            return psutil.Process(self._process.pid).memory_info().rss / 2**20
        except (psutil.Error, TypeError):
            return 0.0

    def submit(self, task: PageTask) -> None:
        """Hand one page to the worker."""
        self.in_flight.add((task.job_id, task.page))
        self._tasks.put(task)

    def collect(self, timeout: float = 0.0) -> list[PageResult]:
        """Results that arrived; waits up to `timeout` for the first one."""
        out: list[PageResult] = []
        block = timeout > 0
        while True:
            try:
                kind, payload = self._results.get(block=block, timeout=timeout if block else None)
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
            else:
                self.in_flight.discard((payload.job_id, payload.page))
                self.pages_done += 1
                out.append(payload)
        return out

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the worker to finish, then terminate and reap it within `timeout`."""
        if self._process.pid is None:
            return
        with contextlib.suppress(Exception):
            self._tasks.put(None)
        self._process.join(timeout=min(timeout, 2.0))
        if self._process.is_alive():
            log.info("engine worker %s: sending SIGTERM", self._process.pid)
            self._process.terminate()
            self._process.join(timeout=timeout)
        if self._process.is_alive():
            log.warning("engine worker %s did not stop; sending SIGKILL", self._process.pid)
            self._process.kill()
            self._process.join()
        self._tasks.cancel_join_thread()
        self._results.cancel_join_thread()
        self._tasks.close()
        self._results.close()
        log.info("engine worker %s stopped (exit %s)", self._process.pid, self._process.exitcode)


def stop_resource_tracker() -> None:
    """Stop multiprocessing's resource tracker once every worker is gone.

    It would exit by itself after ocrvl does, but systemd (KillMode=mixed) kills leftovers
    the moment the main process exits and logs a SIGKILL for it on every stop.
    """
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)  # private, 3.10-3.13
    if stop is not None:
        with contextlib.suppress(Exception):
            stop()

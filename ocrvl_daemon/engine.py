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
import ctypes
import io
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from ocrvl_daemon.config import Config

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


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when the daemon dies, however it dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _worker_main(config_json: str, server_url: str, tasks: mp.Queue, results: mp.Queue) -> None:
    _die_with_parent()
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
    results.put(("ready", os.getpid()))
    p = config.pipeline
    with ThreadPoolExecutor(max_workers=p.max_concurrency, thread_name_prefix="page") as pool:
        while True:
            task = tasks.get()
            if task is None:
                break
            pool.submit(_run_page, pipeline, config, task, results)


def _run_page(pipeline: Any, config: Config, task: PageTask, results: mp.Queue) -> None:
    from ocrvl_daemon.errors import OcrvlError
    from ocrvl_daemon.pdf import render_page

    started = time.monotonic()
    result = PageResult(task.job_id, task.page)
    try:
        image = render_page(
            Path(task.pdf), task.page, config.pipeline.render_scale, config.pipeline.max_page_pixels
        )
        (res,) = pipeline.predict(image, max_new_tokens=task.max_new_tokens)
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
    result.seconds = time.monotonic() - started
    results.put(("page", result))


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

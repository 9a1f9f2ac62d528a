"""The daemon's side of the engine worker: page tasks and results, the worker's handle, the pipe.

The parent submits `PageTask`s and collects `PageResult`s; the worker process
(`engine_process`) renders each page itself (so page images never cross the process boundary
or pile up in the daemon) and runs the real `paddleocr.PaddleOCRVL` pipeline on it.
paddleocr's host memory grows over many `predict` calls, hence the worker is replaced after
N pages or above an RSS limit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import IO, Any

import psutil

from ocrvl_daemon.config import Config
from ocrvl_daemon.sd_notify import child_env
from ocrvl_daemon.server.process_group import stop_process_group
from ocrvl_daemon.worker.request_gate import YieldCap

log = logging.getLogger(__name__)


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
    # The server endpoint (OpenAI base URL) its requests go to; "": the worker's first one.
    url: str = ""


class Failure(str, Enum):
    """Why a page came back without an answer; the converter's policy differs for each."""

    # No answer at all (connection refused or reset, timeout): the endpoint is gone for now,
    # and the page waits for it (or another) without counting an attempt.
    SERVER_DOWN = "server-down"
    # The server answered with an HTTP 5xx status: it is there but fails the request. Each
    # one counts an attempt, and the page waits a while before it is sent again.
    SERVER_ERROR = "server-error"
    INPUT = "input"  # the file changed or vanished
    DAMAGED = "damaged"  # the page itself cannot be rendered: the same every time
    PAGE = "page"  # anything else about this page (a 4xx answer, a pipeline error)


@dataclass
class PageResult:
    """What came back for one page: Markdown and images, or why it failed."""

    job_id: int
    page: int
    markdown: str = ""
    images: dict[str, bytes] = field(default_factory=dict)
    error: str | None = None
    error_kind: Failure | None = None
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
    url: str = ""  # the endpoint that answered (the task's)


class _Channel:
    """Length-prefixed pickles over a pair of pipes; `send` is safe from many threads."""

    _HEADER = struct.Struct(">I")

    def __init__(self, reader: IO[bytes], writer: IO[bytes]) -> None:
        self._reader = reader
        self._writer = writer
        self._lock = threading.Lock()  # guards _writer: one message's bytes go together

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


def _log_for_worker(level: int, name: str, text: str) -> None:
    """Log a record the worker sent, at its level and under its logger's name, so the
    daemon's handler (journald's priority among its fields) treats it like its own."""
    logging.getLogger(name).log(level, "%s", text)


class EngineWorker:
    """One worker process; `submit` pages, `collect` results, `stop` when done."""

    def __init__(self, config: Config, server_url: str) -> None:
        self._config_json = config.model_dump_json()
        self._server_url = server_url
        self._process: subprocess.Popen[bytes] | None = None
        self._channel: _Channel | None = None
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        # Set when a message arrives; the pool shares one between its workers.
        self.arrived = threading.Event()
        self._reader: threading.Thread | None = None
        self.in_flight: set[tuple[int, int]] = set()
        self.sent: set[tuple[int, int]] = set()  # in flight and asked of the server
        # Attempts in flight per page: a page taken from a failed endpoint may be sent again
        # before the first attempt's answer is back, and stays in flight until both are.
        self._attempts: Counter[tuple[int, int]] = Counter()
        self.per_url: Counter[str] = Counter()  # pages in flight per endpoint
        self.limits: dict[str, int] = {}  # each endpoint's request gate size, once told
        self.caps: dict[str, YieldCap | None] = {}  # ... and its cap on big documents
        self.pages_done = 0
        self.ready = False
        self.failure: str | None = None
        self.started_at = time.monotonic()

    def start(self) -> None:
        """Start the process; it reports readiness through `collect`."""
        argv = [sys.executable, "-c", "from ocrvl_daemon.worker.main import serve; serve()",
                str(os.getpid())]
        # Its own process group, like the server's, so that a stop ends whatever it started;
        # it dies with the daemon all the same (serve asks for a parent-death SIGKILL).
        self._process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         env=child_env(os.environ), start_new_session=True)
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
                if message[0] == "log":
                    _log_for_worker(*message[1])
                    continue
                self._inbox.put(message)
                self.arrived.set()
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
        self._attempts[task.job_id, task.page] += 1
        self.per_url[task.url] += 1
        assert self._channel is not None
        # A dead worker is noticed by `alive()`; its pages are given back then.
        with contextlib.suppress(OSError, ValueError):
            self._channel.send(task)

    def set_limit(self, url: str, limit: int, cap: YieldCap | None = None) -> None:
        """How many requests the worker may have at the server at `url`, and how many of them
        big documents may hold (`RequestGate.resize`); sent only when either changes."""
        if url not in self.limits or (limit, cap) != (self.limits[url], self.caps[url]):
            self.limits[url], self.caps[url] = limit, cap
            assert self._channel is not None
            with contextlib.suppress(OSError, ValueError):
                self._channel.send(("limit", url, limit, cap))

    def pending(self) -> bool:
        """Whether messages wait to be collected."""
        return not self._inbox.empty()

    def wait(self, timeout: float) -> None:
        """Block until a message arrives (or `timeout`); `collect` then takes it."""
        if self._inbox.empty():
            self.arrived.wait(timeout)
        self.arrived.clear()

    def forget(self) -> list[tuple[int, int]]:
        """The pages in flight, which the caller takes over; the worker keeps none."""
        pages = sorted(self.in_flight)
        self.in_flight.clear()
        self.sent.clear()
        self._attempts.clear()
        self.per_url.clear()
        return pages

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
                key = (payload.job_id, payload.page)
                self._attempts[key] -= 1
                if self._attempts[key] <= 0:
                    del self._attempts[key]
                    self.in_flight.discard(key)
                    self.sent.discard(key)
                self.per_url[payload.url] -= 1
                self.pages_done += 1
                out.append(payload)
        return out

    def kill(self) -> None:
        """A forced stop: SIGKILL the worker's process group now and reap it."""
        process = self._process
        if process is not None:
            stop_process_group(process, 0, "engine worker", now=True)

    def stop(self, timeout: float = 10.0) -> None:
        """Close the worker's input (it finishes what it has), then stop its process group
        (TERM, bounded wait, KILL, reap)."""
        process = self._process
        if process is None:
            return
        with contextlib.suppress(OSError, ValueError):
            assert process.stdin is not None
            process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(min(timeout, 2.0))
        stop_process_group(process, timeout, "engine worker")
        if self._reader is not None:
            self._reader.join(timeout)
        assert process.stdout is not None
        process.stdout.close()

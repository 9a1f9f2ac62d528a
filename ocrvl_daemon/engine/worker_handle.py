"""The daemon's side of an engine worker: its handle, which carries page tasks and results.

The parent submits `PageTask`s and collects `PageResult`s; the worker process
(`worker.main`) renders each page itself (so page images never cross the process boundary
or pile up in the daemon) and runs the real `paddleocr.PaddleOCRVL` pipeline on it.
paddleocr's host memory grows over many `predict` calls, hence the worker is replaced after
N pages or above an RSS limit. The worker is set up once, with plain values
(`WorkerSetup`, from `engine.worker_settings`); the pipe is `process.channel`'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import subprocess
import threading
import time

import psutil

from ocrvl_daemon.core.messages import (
    GateLimit,
    LogRecord,
    PageResult,
    PageTask,
    RequestSent,
    WorkerFailed,
    WorkerMessage,
    WorkerReady,
    WorkerSetup,
)
from ocrvl_daemon.process.channel import Channel, start_child
from ocrvl_daemon.process.group import stop_process_group
from ocrvl_daemon.process.sd_notify import child_env

log = logging.getLogger(__name__)

# How long an ended worker's reader is given to read what it sent last: it ends when the pipe
# closes, which is when the process ends (nothing else holds the pipe's end).
LAST_WORDS_S = 2.0


class EngineWorker:
    """One worker process; `submit` pages, `collect` results, `stop` when done.

    Which pages it has is recorded on the pages (`document.SentPage.worker`, by its `number`),
    not here: the handle only carries messages.
    """

    def __init__(self, setup: WorkerSetup) -> None:
        self._setup = setup
        self._process: subprocess.Popen[bytes] | None = None
        self._channel: Channel | None = None
        self._inbox: queue.Queue[WorkerMessage] = queue.Queue()
        # Set when a message arrives; the pool shares one between its workers.
        self.arrived = threading.Event()
        self._reader: threading.Thread | None = None
        self.number = 0  # the pool's name for it, on the pages it has
        self._requests_sent: list[RequestSent] = []  # collected, not yet taken
        self.gates: dict[str, GateLimit] = {}  # each endpoint's request gate, once told
        self.pages_done = 0
        self.ready = False
        self.failure: str | None = None
        self.started_at = time.monotonic()

    def start(self) -> None:
        """Start the process; it reports readiness through `collect`."""
        # Its own process group, like the server's, so that a stop ends whatever it started;
        # it dies with the daemon all the same (serve asks for a parent-death SIGKILL).
        self._process, self._channel = start_child(
            "ocrvl_daemon.worker.main", env=child_env(os.environ), start_new_session=True)
        self._reader = threading.Thread(target=self._read, name="engine-results", daemon=True)
        self._reader.start()
        self._channel.send(self._setup)
        log.info("engine worker started (pid %s)", self._process.pid)

    def _read(self) -> None:
        assert self._channel is not None
        try:
            while (message := self._channel.receive()) is not None:
                if isinstance(message, LogRecord):
                    message.relay()
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
        """Whether the worker process still runs. One that ended is said so only once all it
        sent is read, and why it failed (`WorkerFailed`, its last words before exiting) is in
        `failure`: its end is then told with its own reason, not as a bare exit."""
        if self._process is None:
            return False
        if self._process.poll() is None:
            return True
        if self._reader is not None:
            self._reader.join(LAST_WORDS_S)
        with self._inbox.mutex:  # the rest of what it sent still waits for `collect`
            self.failure = next((m.reason for m in self._inbox.queue
                                 if isinstance(m, WorkerFailed)), self.failure)
        return False

    def rss_mb(self) -> float:
        """Resident memory of the worker, in MiB."""
        try:
            return psutil.Process(self.pid).memory_info().rss / 2**20
        except (psutil.Error, TypeError, ValueError):
            return 0.0

    def submit(self, task: PageTask) -> None:
        """Hand one page to the worker."""
        assert self._channel is not None
        # A dead worker is noticed by `alive()`; its pages are given back then.
        with contextlib.suppress(OSError, ValueError):
            self._channel.send(task)

    def set_limit(self, gate: GateLimit) -> None:
        """How many requests the worker may have at the server at `gate.url`, and how many of
        them big documents may hold (`RequestGate.resize`); sent only when either changes."""
        if self.gates.get(gate.url) != gate:
            self.gates[gate.url] = gate
            assert self._channel is not None
            with contextlib.suppress(OSError, ValueError):
                self._channel.send(gate)

    def pending(self) -> bool:
        """Whether messages wait to be collected."""
        return not self._inbox.empty()

    def wait(self, timeout: float) -> None:
        """Block until a message arrives (or `timeout`); `collect` then takes it."""
        if self._inbox.empty():
            self.arrived.wait(timeout)
        self.arrived.clear()

    def requests_sent(self) -> list[RequestSent]:
        """The pages whose first request left for the server, collected since last asked."""
        sent, self._requests_sent = self._requests_sent, []
        return sent

    def collect(self, timeout: float = 0.0) -> list[PageResult]:
        """Results that arrived; waits up to `timeout` for the first one (`requests_sent` then
        has the requests that left for the server meanwhile)."""
        out: list[PageResult] = []
        block = timeout > 0
        while True:
            try:
                message = self._inbox.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                break
            block = False
            if isinstance(message, WorkerReady):
                self.ready = True
                warmed = ("" if message.layout_warm_s is None else
                          f" (its layout model warmed on a blank page in "
                          f"{message.layout_warm_s:.1f} s)")
                log.info("engine worker %s ready in %.1f s%s", message.pid,
                         time.monotonic() - self.started_at, warmed)
            elif isinstance(message, WorkerFailed):
                self.failure = message.reason
            elif isinstance(message, RequestSent):
                self._requests_sent.append(message)
            elif isinstance(message, PageResult):
                self.pages_done += 1
                out.append(message)
        return out

    def kill(self) -> None:
        """A forced stop: SIGKILL the worker's process group now and reap it."""
        process = self._process
        if process is not None:
            stop_process_group(process, 0, "engine worker", now=True)

    def close_input(self) -> None:
        """Tell the worker no more pages come: it finishes what it has and exits. (`stop`
        does this too; a pool closes every input first so that its workers end together.)"""
        if self._channel is not None:
            with contextlib.suppress(OSError, ValueError):
                self._channel.close_output()

    def stop(self, timeout: float = 10.0) -> None:
        """Close the worker's input (it finishes what it has), then stop its process group
        (TERM, bounded wait, KILL, reap)."""
        process = self._process
        if process is None:
            return
        self.close_input()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(min(timeout, 2.0))
        stop_process_group(process, timeout, "engine worker")
        if self._reader is not None:
            self._reader.join(timeout)
        if self._channel is not None:
            self._channel.close_input()

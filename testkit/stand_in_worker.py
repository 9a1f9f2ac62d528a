"""A stand-in for the engine worker process: the converter's tests hand out its pages and
give back results (or crash it) by hand, through the converter's public `tick()`; and the
converter set-ups built on it (`ReadyServer`, `Policy`, `converter_with_stand_in`)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ocrvl_daemon.commands import status
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.job import Job
from ocrvl_daemon.core.messages import (
    Failure,
    GateLimit,
    PageResult,
    PageTask,
    RequestSent,
    WorkerSetup,
)
from ocrvl_daemon.engine.converter import Converter, ServerHandle
from ocrvl_daemon.engine.pool import WORKER_RESTART_SECONDS, EnginePool
from ocrvl_daemon.engine.worker_handle import EngineWorker
from ocrvl_daemon.engine.worker_settings import worker_setup
from ocrvl_daemon.server.placement import decide_placement
from ocrvl_daemon.server.supervisor import ServerState, ServerStatus
from ocrvl_daemon.storage.jobs import enqueue_file, open_store
from ocrvl_daemon.storage.store import Store


class StandInWorker:
    """What `EnginePool` sees of a worker: ready at once, alive until `die()`. What it has
    (`in_flight`, `sent`, `urls`) is the tests' to read; the converter keeps its own."""

    def __init__(self, setup: WorkerSetup | None = None) -> None:
        self.number = 0
        self.in_flight: set[tuple[int, int]] = set()
        self.sent: set[tuple[int, int]] = set()  # in flight and asked of the server
        self._requests_sent: list[RequestSent] = []
        self.order: list[tuple[int, int]] = []  # every page submitted, in order
        self.priorities: dict[int, int] = {}  # job -> the priority of its last page submitted
        self.gates: dict[str, GateLimit] = {}  # each endpoint's request gate, as last told
        self.per_url: Counter[str] = Counter()
        self.urls: dict[tuple[int, int], str] = {}  # the endpoint of each page in flight
        self.arrived = threading.Event()
        self.results: list[PageResult] = []  # what `collect` hands over next
        self.pages_done = 0
        self.ready = True
        self.failure: str | None = None
        self.pid = 4242
        self._alive = True

    def start(self) -> None:
        pass

    def stop(self, timeout: float = 10.0) -> None:
        self._alive = False

    def alive(self) -> bool:
        return self._alive

    def die(self, failure: str) -> None:
        """The process ends with every page it had."""
        self._alive, self.failure = False, failure
        self.in_flight.clear()
        self.sent.clear()
        self.per_url.clear()

    def rss_mb(self) -> float:
        return 100.0

    def submit(self, task: PageTask) -> None:
        self.in_flight.add((task.job_id, task.page))
        self.per_url[task.url] += 1
        self.urls[task.job_id, task.page] = task.url
        self.order.append((task.job_id, task.page))
        self.priorities[task.job_id] = task.priority

    def set_limit(self, gate: GateLimit) -> None:
        self.gates[gate.url] = gate

    def pending(self) -> bool:
        return bool(self.results)

    def reach_server(self) -> None:
        """Every page in flight has been sent to the server."""
        self._requests_sent += [RequestSent(*key) for key in sorted(self.in_flight - self.sent)]
        self.sent |= self.in_flight

    def requests_sent(self) -> list[RequestSent]:
        sent, self._requests_sent = self._requests_sent, []
        return sent

    def wait(self, timeout: float) -> None:
        pass

    def collect(self, timeout: float = 0.0) -> list[PageResult]:
        out, self.results = self.results, []
        for result in out:
            result.url = result.url or self.urls.pop((result.job_id, result.page), "")
            self.per_url[result.url] -= 1
            self.in_flight.discard((result.job_id, result.page))
            self.sent.discard((result.job_id, result.page))
            self.pages_done += 1
        return out


def converter_with_stand_in(tmp_path: Path, servers: Sequence[ServerHandle],
                            **pipeline: Any) -> tuple[Converter, StandInWorker, Store, Config]:
    """A real converter and store whose one engine worker is a StandInWorker."""
    config = Config.model_validate({"state_dir": str(tmp_path / "state"),
                                    "pipeline": {"workers": 1, **pipeline}})
    store = open_store(config)
    worker = StandInWorker()
    engines = EnginePool(config, new_worker=lambda setup: worker)  # type: ignore[arg-type,return-value]
    return Converter(config, store, servers, engines=engines), worker, store, config


class ReadyServer:
    """A server handle that is always ready (the converter never talks to it itself)."""

    name = "server"
    url = "http://127.0.0.1:8118/v1"

    def status(self) -> ServerStatus:
        return ServerStatus(ServerState.READY, "ready", None, 1, 0, None, None, self.url)

    def is_ready(self) -> bool:
        return True

    def note_progress(self, in_flight: int, completed_total: int) -> None:
        pass

    def metrics(self, want: bool = True) -> None:
        return None

    def note_unreachable(self, reason: str) -> None:
        pass


class Policy:
    """A converter over a real store and real PDFs, with page results given by hand to its
    stand-in engine worker. Its clock moves only when a test says so."""

    def __init__(self, tmp_path: Path, server: dict | None = None, **pipeline: object) -> None:
        self.folder = tmp_path / "inbox"
        self.folder.mkdir()
        self.config = Config.model_validate(
            {"state_dir": str(tmp_path / "state"), "pipeline": {"workers": 1, **pipeline},
             "server": server or {}})
        self.store = open_store(self.config)
        self.workers: list[StandInWorker] = []
        engines = EnginePool(self.config, new_worker=self._new_worker)  # type: ignore[arg-type]
        self.converter = Converter(self.config, self.store, [ReadyServer()], engines=engines)
        self.now = 0.0
        self._handed = 0  # pages of the worker's `order` that `send()` returned already

    def _new_worker(self, setup: WorkerSetup) -> StandInWorker:
        self.workers.append(StandInWorker(setup))
        self._handed = 0
        return self.workers[-1]

    @property
    def worker(self) -> StandInWorker:
        """The worker started last."""
        return self.workers[-1]

    def tick(self) -> None:
        self.converter.tick(self.now)

    def activate(self) -> None:
        """Look at the queue on this tick (the converter was told of a job)."""
        self.converter.wake()
        self.tick()

    def queue(self, pdf: Path) -> Job:
        job = enqueue_file(self.store, pdf, self.config.recipe)
        self.activate()
        return job

    def send(self) -> list[tuple[int, int]]:
        """Tick until the converter hands the worker no more pages (each page reaches the
        server at once); the pages handed to it since the last call."""
        while True:
            handed = len(self.worker.order)
            self.worker.reach_server()
            self.tick()
            if len(self.worker.order) == handed:
                break
        sent, self._handed = self.worker.order[self._handed:], len(self.worker.order)
        return sent

    def deliver(self, result: PageResult) -> None:
        """The worker reports `result`; the converter takes it on this tick."""
        self.worker.results.append(result)
        self.tick()

    def answer(self, job: Job, page: int, error: str | None = None, kind: Failure = Failure.PAGE,
               truncated_at: int | None = None) -> None:
        result = PageResult(job.id, page, truncated_at=truncated_at)
        if error is None:
            result.markdown = f"text of page {page + 1}"
        else:
            result.error, result.error_kind = error, kind
        self.deliver(result)

    def crash(self, failure: str) -> None:
        """The worker dies with every page it had; time passes until another may start."""
        self.worker.die(failure)
        self.tick()
        self.now += WORKER_RESTART_SECONDS

    def job(self, job: Job) -> Job | None:
        return self.store.job(job.id)

    def view(self, pdf: Path) -> dict:
        docs = json.loads(status.render_status(self.config, as_json=True, everything=True))[
            "documents"]
        return next(d for d in docs if d["path"] == str(pdf))


def real_worker(config: Config) -> EngineWorker:
    """A real engine worker (not started) set up as the daemon sets one up for `config`."""
    return EngineWorker(worker_setup(config, decide_placement(config)))

"""A stand-in for the engine worker process: the converter's tests hand out its pages and
give back results (or crash it) by hand, through the converter's public `tick()`."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ocrvl_daemon.config import Config
from ocrvl_daemon.driver import Converter, ServerHandle
from ocrvl_daemon.jobs import open_store
from ocrvl_daemon.store import Store
from ocrvl_daemon.worker.messages import GateLimit, PageResult, PageTask, RequestSent
from ocrvl_daemon.worker.pool import EnginePool


class StandInWorker:
    """What `EnginePool` sees of a worker: ready at once, alive until `die()`. What it has
    (`in_flight`, `sent`, `urls`) is the tests' to read; the converter keeps its own."""

    def __init__(self, config: Config, server_url: str) -> None:
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
    worker = StandInWorker(config, config.server.base_url)
    engines = EnginePool(config, new_worker=lambda config, url: worker)  # type: ignore[arg-type,return-value]
    return Converter(config, store, servers, engines=engines), worker, store, config

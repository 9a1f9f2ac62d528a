"""What the running daemon is doing, as one typed value built once per status tick.

The main loop builds a `DaemonState` and hands the same value to every place that shows it:
systemd's one-line STATUS= (`format_status`), the Prometheus endpoint (`metrics`), and the
runtime file that `ocrvl status` reads (`write_runtime_file`). That file is derived status,
not a record: it is replaced whole (write, rename) but never fsynced, so showing progress
costs no disk flush; after a crash the next daemon writes a new one, and `ocrvl status`
tells a dead daemon's file by its pid and age.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ocrvl_daemon.observe.stages import StageLoad
from ocrvl_daemon.observe.units import format_duration, format_rate

# The runtime file, in the state_dir beside the job store.
RUNTIME_FILE = "daemon.json"


@dataclass(frozen=True)
class EndpointState:
    """One server endpoint pages go to, and its share of the work."""

    name: str
    url: str
    state: str  # a ServerState value
    phase: str = ""
    in_flight: int = 0
    pages_per_s: float = 0.0
    bound: int = 0
    restarts: int = 0
    last_error: str | None = None
    # Where it runs, for a cluster's engine host: its node's address and GPU(s).
    node: str | None = None
    gpu: str | None = None

    def summary(self) -> str:
        """The endpoint in a few words: "gpu0/1 ready, 12 in flight, 1.6 p/s"."""
        if self.state != "ready":
            return f"{self.name} {self.state}"
        return f"{self.name} ready, {self.in_flight} in flight, {format_rate(self.pages_per_s)}"


@dataclass(frozen=True)
class ServerView:
    """The model server as a whole (all endpoints together)."""

    state: str = "ready"  # "ready", "starting", "unreachable", "restarting", "failed"...
    phase: str | None = None  # e.g. "loading weights", while starting
    url: str = ""
    pid: int | None = None
    attempt: int = 0  # restarts so far, while restarting
    restarts: int = 0
    last_error: str | None = None
    diagnosis: str | None = None  # the whole diagnosis, with its fix
    cause: str | None = None  # its cause in a few words, e.g. "out of memory"


@dataclass(frozen=True)
class GpuView:
    """A GPU a managed server runs on, as its driver last reported it."""

    index: int
    name: str
    used_mib: int
    total_mib: int
    busy_pct: int | None = None  # share of the last sample period a kernel ran
    power_w: float | None = None

    def summary(self) -> str:
        """"gpu 0 (NVIDIA H200): 76% busy, 40.1/139.8 GiB, 353 W"."""
        parts = [f"{self.busy_pct}% busy"] if self.busy_pct is not None else []
        parts.append(f"{self.used_mib / 1024:.1f}/{self.total_mib / 1024:.1f} GiB")
        parts += [f"{self.power_w:.0f} W"] if self.power_w is not None else []
        return f"gpu {self.index} ({self.name}): " + ", ".join(parts)


@dataclass(frozen=True)
class DaemonState:
    """The daemon as of one tick of its main loop."""

    pid: int = 0
    updated: float = 0.0  # wall clock
    server: ServerView = field(default_factory=ServerView)
    endpoints: tuple[EndpointState, ...] = ()
    current_doc: str | None = None  # file name of the document being converted
    page_done: int = 0
    page_total: int | None = None
    pages_per_s: float = 0.0
    in_flight: int = 0
    concurrency: int = 0  # the bound over all endpoints
    queued: int = 0  # documents waiting, not counting current_doc
    converting: int = 0  # documents running (`running` in `ocrvl status` is the daemon)
    done: int = 0
    failed: int = 0
    # Pages since the daemon started: checkpointed, given up on, kept with a warning.
    pages_done: int = 0
    pages_failed: int = 0
    pages_flagged: int = 0
    engine_failed_starts: int = 0  # recognition workers that failed to start, in a row
    engine_error: str | None = None
    hook_failures: Mapping[str, int] = field(default_factory=dict)
    gpus: tuple[GpuView, ...] = ()  # the GPUs of a managed server; () for an external one
    stages: StageLoad = field(default_factory=StageLoad)  # which stage sets the pace

    def documents(self) -> dict[str, int]:
        """Documents by job state."""
        return {"queued": self.queued, "running": self.converting, "done": self.done,
                "failed": self.failed}

    def to_json(self) -> dict[str, Any]:
        """The state as `ocrvl status` reads it from the runtime file."""
        data = asdict(self)
        data["servers"] = data.pop("endpoints")
        data["hook_failures"] = dict(self.hook_failures)
        data["stages"] = self.stages.to_json()
        return data


def format_status(state: DaemonState) -> str:
    """The STATUS= line: what blocks work if anything, else progress, else idle counts; with
    several server endpoints, each of them after it."""
    line = _format_work(state)
    if len(state.endpoints) > 1:
        line += " | " + "; ".join(e.summary() for e in state.endpoints)
    return line


def _format_work(state: DaemonState) -> str:
    server = state.server
    queue = f"{state.queued} queued" if state.queued else ""
    failed = f"{state.failed} failed" if state.failed else ""
    if server.state == "starting":
        line = f"starting server: {server.phase}" if server.phase else "starting server"
        return _join(line, queue, failed)
    if server.state not in ("ready", "external"):
        details = [f"attempt {server.attempt}"] if server.attempt else []
        details += [f"{server.cause}?"] if server.cause else []
        line = f"server {server.state}" + (f" ({', '.join(details)})" if details else "")
        return _join(line, queue, failed)
    if state.engine_failed_starts:
        starts = (f"{state.engine_failed_starts} failed start"
                  + "s" * (state.engine_failed_starts > 1))
        line = f"recognition pipeline cannot start ({starts}; see journalctl --user -u ocrvl)"
        return _join(line, queue, failed)
    if state.current_doc:
        pages = f"p.{state.page_done}" + (f"/{state.page_total}" if state.page_total else "")
        rate = eta = ""
        if state.pages_per_s:
            rate = format_rate(state.pages_per_s)
            if state.page_total:
                left = max(state.page_total - state.page_done, 0) / state.pages_per_s
                eta = f"ETA {format_duration(left)}"
        return _join(f"{state.current_doc} {pages}", rate, eta,
                     state.stages.before_server() or "", queue, failed)
    idle = f"idle, {state.done} done, {state.queued} queued"
    return f"{idle}, {failed}" if failed else idle


def _join(*parts: str) -> str:
    return " · ".join(part for part in parts if part)


def runtime_file(state_dir: Path) -> Path:
    """Where the daemon of `state_dir` keeps its runtime file."""
    return state_dir / RUNTIME_FILE


def write_runtime_file(state_dir: Path, data: Mapping[str, Any]) -> None:
    """Replace the runtime file with `data`: whole or not at all, without an fsync."""
    path = runtime_file(state_dir)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)


def read_runtime_file(state_dir: Path) -> dict[str, Any]:
    """The last runtime file a daemon of `state_dir` wrote; {} if none can be read."""
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(runtime_file(state_dir).read_text(encoding="utf-8"))
        if isinstance(data, dict):
            return data
    return {}

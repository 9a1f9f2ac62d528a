"""Which stage of the conversion limits throughput, and how busy each one is.

A page goes through three stages: rendering (PDF page to image, in the engine worker), layout
(the layout model finds its blocks; one call at a time per worker, on the CPU or a GPU) and
the server (one request per block). Each stage's load is the share of its capacity in use
over the last RATE_WINDOW seconds: a stage near 100% is where pages queue, so it sets the
pace. The server is meant to be that stage; when rendering or layout is, the user is told
what would help.

The worker times each piece of work (`PageResult.render_span`, `layout_spans`,
`request_spans`, in CLOCK_MONOTONIC, which is one clock for every process on Linux) and the
converter adds them to one `BusyMeter` per stage (`driver.Converter.stage_load`).
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from ocrvl_daemon.config.layout import ON_CPU_ASKED, TO_THE_GPU
from ocrvl_daemon.observe.rate import RATE_WINDOW

# A stage at or above this share of its capacity is where pages queue.
SATURATED = 0.85
# A full server whose GPU is busier than this is held by the GPU; below it, by its CPU side.
# With layout detection on, one vLLM server is held by its engine loop's per-request CPU
# cost while its GPU is mostly idle (bench/gpu/RESULTS.md).
GPU_BOUND = 0.6


class Stage(enum.Enum):
    """A stage of a page's conversion, in the order a page goes through them."""

    RENDERING = "rendering"
    LAYOUT = "layout"
    SERVER = "server"


class BusyMeter:
    """Seconds of work done in one stage, over the last RATE_WINDOW seconds.

    `add(start, end)` records one piece of work (a page rendered, a layout call, a request
    at the server) once it ended; any thread may call it. `busy(now, capacity)` is the share
    of `capacity` parallel lanes in use.

    A piece of work counts whole once it ended within the window, also the part of it done
    before the window: work under way is not known yet (it comes with its page's result), and
    in a steady state the one makes up for the other, where clipping at the window's start
    would show a stage that never rests as a few percent idle.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: deque[tuple[float, float]] = deque()
        self._first: float | None = None

    def add(self, start: float, end: float) -> None:
        """Record work from `start` to `end` (monotonic seconds)."""
        with self._lock:
            self._first = start if self._first is None else min(self._first, start)
            self._spans.append((start, end))
            while self._spans and self._spans[0][1] <= end - RATE_WINDOW:
                self._spans.popleft()

    def busy(self, now: float, capacity: float = 1.0) -> float:
        """The share (0-1) of `capacity` lanes busy over the window (0 before any work)."""
        with self._lock:
            if self._first is None:
                return 0.0
            since = max(now - RATE_WINDOW, self._first)
            work = sum(min(end, now) - start for start, end in self._spans if end > since)
        span = now - since
        return min(1.0, work / (span * capacity)) if span > 0 else 0.0


@dataclass(frozen=True)
class StageLoad:
    """How busy each stage is (0-1) and which one sets the pace, if any."""

    rendering: float = 0.0
    layout: float = 0.0
    server: float = 0.0
    layout_device: str = ""  # "cpu", "gpu:0"; "" with layout detection off
    layout_why: str = ""  # why it runs there (`server.layout_engine.LayoutChoice.why`)
    server_gpu_busy: float | None = None  # the managed servers' GPUs (0-1); None: not known

    def loads(self) -> dict[Stage, float]:
        """Each stage's load."""
        return {Stage.RENDERING: self.rendering, Stage.LAYOUT: self.layout,
                Stage.SERVER: self.server}

    def limit(self) -> Stage | None:
        """The busiest stage if it is saturated; None while every stage has room."""
        stage, load = max(self.loads().items(), key=lambda item: item[1])
        return stage if load >= SATURATED else None

    def advice(self) -> str | None:
        """What would help, when a stage before the server sets the pace, or the server is
        full while its GPU idles."""
        limit = self.limit()
        if (limit is Stage.SERVER and self.server_gpu_busy is not None
                and self.server_gpu_busy < GPU_BOUND):
            return (f"the server is full but its GPU is only {self.server_gpu_busy:.0%} busy: "
                    "its CPU side (its engine loop pays a share of one core per request) "
                    "sets the pace; more replicas would help (server.replicas, sharing the "
                    "GPU with server.mps)")
        if limit is Stage.LAYOUT and self.layout_device == "cpu":
            gpu = TO_THE_GPU.get(self.layout_why, TO_THE_GPU[ON_CPU_ASKED])
            return (f"the layout model on the CPU sets the pace: {gpu + '; or ' if gpu else ''}"
                    "raise pipeline.workers if there are idle cores")
        if limit is Stage.LAYOUT:
            return "the layout model sets the pace: raise pipeline.workers"
        if limit is Stage.RENDERING:
            return "rendering pages sets the pace: raise pipeline.workers if there are idle cores"
        return None

    def before_server(self) -> str | None:
        """"layout 97% is the limit" when a stage before the server sets the pace (for
        STATUS=, which has room for no more); None otherwise."""
        limit = self.limit()
        if limit is None or limit is Stage.SERVER:
            return None
        return f"{limit.value} {self.loads()[limit]:.0%} is the limit"

    def summary(self) -> str:
        """"layout 97% (limit) · server 40% · rendering 3%", busiest first."""
        limit = self.limit()
        parts = [f"{stage.value} {load:.0%}" + (" (limit)" if stage is limit else "")
                 for stage, load in sorted(self.loads().items(), key=lambda item: -item[1])]
        return " · ".join(parts)

    def to_json(self) -> dict[str, Any]:
        """The loads, the layout device, the limit and the advice (the runtime file's)."""
        limit = self.limit()
        loads = {stage.value: round(load, 3) for stage, load in self.loads().items()}
        return {**asdict(self), **loads, "limit": limit.value if limit else None,
                "advice": self.advice()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StageLoad:
        """The load `to_json` wrote (what it adds is derived again)."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

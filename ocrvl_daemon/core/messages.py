"""The messages between the daemon and an engine worker process, one dataclass each.

They cross the pipe as pickles (`process.channel.Channel`); the reader dispatches on the class,
so a new kind of message is a new class here, never a tag or a string to match. They hold plain
values only: what the daemon decided (its configuration validated and expanded, the placement)
arrives decided, and a worker may as well run on another machine.

Daemon to worker: `WorkerSetup` (first, once), then `PageTask`s and `GateLimit`s.
Worker to daemon: `WorkerReady` or `WorkerFailed`, then `RequestSent` and `PageResult` for each
page, and `LogRecord`s at any time.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ocrvl_daemon import errors
from ocrvl_daemon.core.quality import Redo, looks_like_a_loop

# A document with fewer pages than this in flight (a letter, a book just dropped) is short of
# pages: the plan sends its next pages at once (`plan.SHORT_EXTRA`), and here they may bump a
# young request of a document with many pages in flight instead of waiting for one to finish.
SHORT_OF_PAGES = 4
LOOP = "loop"  # the finish reason of an answer cut short because it looped (streaming)


@dataclass(frozen=True)
class YieldCap:
    """While small documents run beside big ones: the big `documents` (job ids) may hold at
    most `places` requests at the server (`RequestGate.resize`)."""

    places: int
    documents: frozenset[int]


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker builds its pipeline and sends its requests with, as the daemon decided it
    (`engine.worker_settings`): no worker reads or validates the configuration again.

    `pipeline`: `PaddleOCRVL`'s arguments (the layout model's engine, device and threads
    among them); `layout_process`: the layout model runs in a process of its own
    (`worker.layout_process`); `torch_threads`: torch's threads in this process, where
    PaddleX's transformers engine takes no count. `headers`: those of every request (the API
    key's). `failure`: why no pipeline can be built here (the placement found it): the worker
    fails to start with it at once.
    """

    pipeline: Mapping[str, Any]
    served_model: str
    headers: Mapping[str, str]
    max_concurrency: int
    stop_loops_early: bool
    render_scale: float
    page_pixel_limit: int
    request_overhead_tokens: int  # what the image and prompt take of a request's budget
    layout_process: bool = False
    torch_threads: int | None = None
    failure: str = ""


@dataclass(frozen=True)
class ErrorRecord:
    """An `OcrvlError` raised in a worker, as plain values: its class's name, message and fix.
    `rebuilt` makes the same error again on the daemon's side, so its kind (permanent or
    not, its exit code) is the class's own, never guessed from where it was raised."""

    kind: str
    message: str
    fix: str | None = None

    @classmethod
    def of(cls, error: errors.OcrvlError) -> ErrorRecord:
        """The record of `error`."""
        return cls(type(error).__name__, error.message, error.fix)

    def rebuilt(self) -> errors.OcrvlError:
        """The error again, of its own class (a class `errors` does not have: OcrvlError)."""
        kind = getattr(errors, self.kind, errors.OcrvlError)
        if not (isinstance(kind, type) and issubclass(kind, errors.OcrvlError)):
            kind = errors.OcrvlError
        error = kind.__new__(kind)  # its own __init__ may take other arguments
        errors.OcrvlError.__init__(error, self.message, self.fix)
        return error


@dataclass(frozen=True)
class BlockAnswer:
    """The answer to one chat request of a page: one layout block, or the whole page with
    layout detection off.

    `key` names what was asked (a digest of the request's messages: the block's image and its
    prompt, not the sampling settings), so that a redo of the page knows the block again and
    can keep its answer instead of asking the server again.
    """

    key: str
    text: str
    finish_reason: str | None  # "stop", "length", or LOOP (stopped as a loop)
    tokens: int  # completion tokens the answer took when the server generated it
    reused: bool = False  # kept from an earlier answer: not asked of the server this time
    limit: int = 0  # the token limit its request asked for (0: not known)
    # Its image has ink (read only for an empty answer: a blank block may well answer "").
    has_ink: bool = True

    @property
    def cut(self) -> bool:
        """Cut off at the token limit, or stopped because it looped (it would have run to
        the limit)."""
        return self.finish_reason in ("length", LOOP)

    @property
    def looping(self) -> bool:
        """Cut off and repeating itself: more tokens would only loop longer."""
        return self.finish_reason == LOOP or (self.cut and looks_like_a_loop(self.text))


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
    # The server endpoint (OpenAI base URL) its requests go to: the converter chose it.
    url: str = ""
    # A redo of some of the page's blocks: the answers kept from its last try, by key. A block
    # asked for again with one of these keys gets its answer at once, with no request; the
    # others (the blocks that were cut off or looped, and any the layout found anew) are sent.
    keep: Mapping[str, BlockAnswer] = field(default_factory=dict)
    # How each block sent again goes, by key: its own limit and penalty (a cut-off block more
    # tokens, a looping one the loop-breaking penalty). A block not named here goes with
    # `max_new_tokens` and `repetition_penalty`.
    blocks: Mapping[str, Redo] = field(default_factory=dict)


@dataclass(frozen=True)
class GateLimit:
    """How many requests the worker may have at the server at `url`, and the `YieldCap` on big
    documents' requests, if any (`RequestGate.resize`)."""

    url: str
    limit: int
    cap: YieldCap | None = None


@dataclass(frozen=True)
class WorkerReady:
    """The pipeline is built: pages may come. `layout_warm_s`: how long the layout model's
    first call took (None with layout detection off)."""

    pid: int
    layout_warm_s: float | None = None


@dataclass(frozen=True)
class WorkerFailed:
    """The pipeline could not be built; `reason` is the error, as text."""

    reason: str


@dataclass(frozen=True)
class RequestSent:
    """The first request of a page left for the server (it is no longer being prepared)."""

    job_id: int
    page: int


@dataclass(frozen=True)
class LogRecord:
    """A worker log record, for the daemon to log at `level` under logger `name`."""

    level: int
    name: str
    text: str

    def relay(self) -> None:
        """Log it in this process, at its level and under its logger's name, so that this
        process's handler (journald's priority among its fields) treats it as its own."""
        logging.getLogger(self.name).log(self.level, "%s", self.text)


class Failure(str, Enum):
    """Why a page came back without an answer; the converter's policy differs for each."""

    # No answer at all (connection refused or reset, timeout): the endpoint is gone for now,
    # and the page waits for it (or another) without counting an attempt.
    SERVER_DOWN = "server-down"
    # The server answered with an HTTP 5xx status: it is there but fails the request. Each
    # one counts an attempt, and the page waits a while before it is sent again.
    SERVER_ERROR = "server-error"
    # The server answered with an HTTP 4xx status (not 408 or 429, which say "later"): it
    # will not take the request as sent. The page is retried like any page failure; a
    # server that refuses every page the same way fails the document (`decide`).
    REFUSED = "refused"
    INPUT = "input"  # the file cannot be read as it was queued: `PageResult.problem` says how
    DAMAGED = "damaged"  # the page itself cannot be rendered: the same every time
    PAGE = "page"  # anything else about this page (a pipeline error)


@dataclass(frozen=True)
class Block:
    """One block the pipeline found on a page: its label, its box [x0, y0, x1, y1] in page
    pixels, and its text."""

    label: str
    bbox: tuple[float, float, float, float]
    text: str

    def to_json(self) -> dict[str, object]:
        """The block as plain JSON values (the store's layout record)."""
        return {"label": self.label, "bbox": list(self.bbox), "text": self.text}


@dataclass
class PageResult:
    """What came back for one page: Markdown and images, or why it failed."""

    job_id: int
    page: int
    markdown: str = ""
    images: dict[str, bytes] = field(default_factory=dict)
    error: str | None = None
    error_kind: Failure | None = None
    problem: ErrorRecord | None = None  # with Failure.INPUT: the error, to raise again
    seconds: float = 0.0
    # Set when an answer of the page was cut off at the token limit (finish_reason
    # "length"): the limit that cut it off. The converter decides whether to redo the page.
    truncated_at: int | None = None
    looping: bool = False  # a cut-off answer repeats itself (page_quality.looks_like_a_loop)
    token_ceiling: int = 0  # the most new tokens the server allows, read when cut off
    tokens: int = 0  # completion tokens the page's answers took (kept ones included)
    finish_reason: str | None = None  # "length" if any answer was cut off, else the first's
    repetition: float = 0.0  # the worst page_quality.repetition of its answers
    # Each chat request's answer, in the order asked: a block each (one with layout off).
    answers: list[BlockAnswer] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # the keys of the requests that failed
    has_ink: bool = False  # the page image is not blank
    size: tuple[int, int] = (0, 0)  # the page image's width and height in pixels
    blocks: list[Block] = field(default_factory=list)
    url: str = ""  # the endpoint that answered (the task's)
    # When (time.monotonic(): one clock for all processes on Linux) the page was rendered, each
    # layout model call for it ran, and each of its requests held a place at the server: each
    # stage's load (`stages.BusyMeter`).
    render_span: tuple[float, float] | None = None
    layout_spans: list[tuple[float, float]] = field(default_factory=list)
    request_spans: list[tuple[float, float]] = field(default_factory=list)


    @property
    def generated(self) -> int:
        """The completion tokens the server generated for this try: `tokens` less those of
        the answers kept from an earlier one."""
        return self.tokens - sum(a.tokens for a in self.answers if a.reused)


WorkerMessage = WorkerReady | WorkerFailed | RequestSent | PageResult | LogRecord

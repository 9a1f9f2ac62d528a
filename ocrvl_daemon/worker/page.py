"""One page in an engine worker, on a thread of its own: rendered from the PDF here, recognised
by the pipeline, and sent back as a `PageResult`, with how it failed where it did.

An `OcrvlError` (the file cannot be read as it was queued) goes back whole (`ErrorRecord`):
the daemon raises the same error again, so a permanent one stays permanent.
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx

from ocrvl_daemon.core.messages import (
    Block,
    ErrorRecord,
    Failure,
    PageResult,
    PageTask,
    RequestSent,
    WorkerSetup,
)
from ocrvl_daemon.core.quality import repetition
from ocrvl_daemon.errors import OcrvlError, PageDamagedError
from ocrvl_daemon.files.pdf import PDFIUM_LOCK, check_unchanged, render_page
from ocrvl_daemon.observe.logs import doc_fields
from ocrvl_daemon.process.channel import Channel
from ocrvl_daemon.worker import completions
from ocrvl_daemon.worker.page_context import PageContext, TimedRequests, on_page
from ocrvl_daemon.worker.request_images import has_ink
from ocrvl_daemon.worker.streaming import LATER_STATUSES, StatusError

log = logging.getLogger(__name__)


def run_page(pipeline: Any, setup: WorkerSetup, task: PageTask, channel: Channel) -> None:
    """Recognise one page and send its `PageResult` (the page's thread's whole work)."""
    started = time.monotonic()
    result = PageResult(task.job_id, task.page, url=task.url)
    path = Path(task.pdf)
    page = PageContext(task.url, task.priority, task.job_id, task.keep, task.blocks,
                       announce=lambda: channel.send(RequestSent(task.job_id, task.page)),
                       started=TimedRequests(result.request_spans),
                       layout_spans=result.layout_spans)
    try:
        check_unchanged(path, task.size, task.mtime)
        # Timed with PDFium's lock held (render_page takes it again): rendering is one lane
        # per worker, and the time spent waiting for it is not work.
        with PDFIUM_LOCK:
            rendering = time.monotonic()
            image = render_page(path, task.page, setup.render_scale, setup.page_pixel_limit)
            result.render_span = (rendering, time.monotonic())
        # Checked again: the file may have been replaced while the page was being rendered.
        check_unchanged(path, task.size, task.mtime)
        result.has_ink = has_ink(image)
        result.size = (int(image.shape[1]), int(image.shape[0]))
        with on_page(page):
            res = _recognise(pipeline, setup, image, task, page, result)
        del image
        result.blocks = _blocks(res)
        md = res.markdown
        result.markdown = md.get("markdown_texts", "") or ""
        for name, img in (md.get("markdown_images") or {}).items():
            buf = io.BytesIO()
            img.convert("RGB").save(buf, format="JPEG", quality=92)
            result.images[name] = buf.getvalue()
    except PageDamagedError as exc:
        result.error, result.error_kind = str(exc), Failure.DAMAGED
    except OcrvlError as exc:  # the file as queued cannot be read: the error, kind and all
        result.error, result.error_kind = str(exc), Failure.INPUT
        result.problem = ErrorRecord.of(exc)
    except Exception as exc:
        failure = _request_failure(exc, page.started)
        if failure is None:  # no request failed: how it happened is all there is to go on
            log.warning("page %d of %s failed", task.page + 1, path.name, exc_info=True,
                        extra=doc_fields(path, task.page + 1))
            failure = Failure.PAGE, f"{type(exc).__name__}: {exc}"
        result.error_kind, result.error = failure
    result.seconds = time.monotonic() - started
    channel.send(result)


def _recognise(pipeline: Any, setup: WorkerSetup, image: Any, task: PageTask,
               page: PageContext, result: PageResult) -> Any:
    """Run the pipeline on one page and note each block's answer, and whether (and how) one
    was cut off: `decide` judges each block, and the page by its worst."""
    sampling: dict[str, Any] = {}
    if task.repetition_penalty is not None:  # PaddleX sends it in the request's extra_body
        sampling["repetition_penalty"] = task.repetition_penalty
    (res,) = pipeline.predict(image, max_new_tokens=task.max_new_tokens, **sampling)
    answers = result.answers = completions.answers(page.asked)
    failed = [a for a in page.asked if a.future.done() and not a.future.cancelled()
              and a.future.exception() is not None]
    if failed:  # the page fails (`_request_failure` says how); the answers that came are kept
        result.failed = [a.key for a in failed]
        first = failed[0].future.exception()
        raise RuntimeError(f"{len(failed)} of the page's {len(page.asked)} requests "
                           f"failed, the first with {type(first).__name__}: {first}") from first
    result.tokens = sum(a.tokens for a in answers)
    result.repetition = max((repetition(a.text) for a in answers), default=0.0)
    # An answer stopped because it looped is one that would have run to the limit: judged
    # as cut off there and looping, it gets the loop-breaking retry at the same limit. Each
    # answer knows its own limit (a block sent again may have had more tokens than the page).
    cut = [a for a in answers if a.cut]
    result.finish_reason = "length" if cut else (answers[0].finish_reason if answers else None)
    if cut:
        result.truncated_at = max(a.limit for a in cut) or task.max_new_tokens
        result.looping = any(a.looping for a in cut)
        if not all(a.looping for a in cut):  # one needs more tokens: how many may it have
            result.token_ceiling = _token_ceiling(setup, task.url)
    return res


def _blocks(res: Any) -> list[Block]:
    """The pipeline's blocks of one page (label, bbox in pixels, text)."""
    blocks = []
    for block in res.get("parsing_res_list") or []:
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            x0, y0, x1, y1 = (round(float(v), 1) for v in list(block.bbox)[:4])
            blocks.append(Block(str(block.label), (x0, y0, x1, y1), str(block.content or "")))
    return blocks


def _request_failure(exc: Exception, requests: list[Any]) -> tuple[Failure, str] | None:
    """What kind of request failure `exc` (raised by the pipeline for one page) is, and its
    text; None when no request to the server failed.

    Read from the page's own requests (`requests`, their futures) where one failed: PaddleX
    re-raises a request's error as a RuntimeError holding only its text. The HTTP status
    decides, not the error's name: a 5xx answer is the server failing the request, a 4xx one
    the server refusing it, and no answer at all is the server being gone.
    """
    failed = [f.exception() for f in requests
              if isinstance(f, Future) and f.done() and not f.cancelled()]
    for error in [e for e in failed if e is not None] + list(_chain(exc)):
        if isinstance(error, StatusError):
            kind = (Failure.SERVER_ERROR if error.status_code >= 500
                    or error.status_code in LATER_STATUSES else Failure.REFUSED)
            return kind, str(error)
        if isinstance(error, (httpx.TransportError, ConnectionError, TimeoutError)):
            return Failure.SERVER_DOWN, f"{type(error).__name__}: {error}"
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and the exceptions it was raised from or while handling."""
    seen: BaseException | None = exc
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


def _token_ceiling(setup: WorkerSetup, server_url: str) -> int:
    """The most new tokens a request may ask for within the server's `max_model_len`.

    Asked afresh each time (rarely: only for a cut-off answer), since a restarted server
    may run with another length. 0 when the server does not say.
    """
    try:
        response = httpx.get(f"{server_url.rstrip('/')}/models", headers=setup.headers,
                             timeout=10.0)
        response.raise_for_status()
        lengths = [
            int(m["max_model_len"]) for m in response.json()["data"] if m.get("max_model_len")
        ]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        log.warning("cannot read max_model_len from %s/models: %s", server_url, exc)
        return 0
    return max(0, min(lengths, default=0) - setup.request_overhead_tokens)

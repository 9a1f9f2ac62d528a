"""The chat completions of a worker's pages: each sent to its page's endpoint through that
endpoint's request gate, streamed, and noted on its page (`page_context`), so that how each
answer ended (cut off, stopped as a loop) and what it cost reach the converter.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx

from ocrvl_daemon.core.messages import BlockAnswer, WorkerSetup
from ocrvl_daemon.core.quality import Redo
from ocrvl_daemon.worker.page_context import Asked, this_page
from ocrvl_daemon.worker.request_gate import GatedRequest, RequestGate
from ocrvl_daemon.worker.request_images import has_ink, image_url, pixels_of, within_aspect
from ocrvl_daemon.worker.streaming import (
    KEEPALIVE_EXPIRY,
    StreamedAnswer,
    request_body,
    stream_completion,
)


class Endpoints:
    """One `RequestGate` per server endpoint, made on first use, and the chat completions
    sent to each: streamed (`streaming.stream_completion`), so that an answer that loops is
    stopped as soon as it shows (`pipeline.stop_loops_early`).

    A page's requests go to the endpoint the converter chose for it (`PageTask.url`), the
    only way an endpoint reaches the worker.
    """

    def __init__(self, setup: WorkerSetup) -> None:
        self._setup = setup
        self._lock = threading.Lock()  # guards _gates
        self._gates: dict[str, RequestGate] = {}
        # Used on PaddleX's event-loop thread only. The gates bound the requests in flight.
        self._client = httpx.AsyncClient(limits=httpx.Limits(
            max_connections=None, keepalive_expiry=KEEPALIVE_EXPIRY))

    def gate(self, url: str) -> RequestGate:
        """The request gate of `url`."""
        with self._lock:
            if url not in self._gates:
                self._gates[url] = RequestGate(self._setup.max_concurrency)
            return self._gates[url]

    def send(self, url: str, messages: Any, kwargs: dict[str, Any],
             started: Callable[[], None] | None = None) -> Future[Completion]:
        """Send a chat completion (PaddleX's `create_chat_completion` arguments) to `url` on
        PaddleX's event loop; cancelling the future aborts it.
        `started` is called once its answer begins."""
        from paddlex.inference.models.common.genai import run_async

        body = request_body(self._setup.served_model, messages, kwargs)
        return run_async(self._complete(url, body, kwargs.get("timeout", 600),
                                        started),
                         return_future=True)

    async def _complete(self, url: str, body: dict[str, Any], timeout: float,
                        started: Callable[[], None] | None) -> Completion:
        answer = await stream_completion(
            self._client, f"{url.rstrip('/')}/chat/completions", body,
            dict(self._setup.headers), timeout, stop_loops=self._setup.stop_loops_early,
            started=started)
        return Completion(answer)


@dataclass(frozen=True)
class Completion:
    """A streamed answer, shaped as PaddleX reads a chat completion
    (`choices[0].message.content`)."""

    answer: StreamedAnswer

    @property
    def choices(self) -> list[Any]:
        """The answer's one choice."""
        return [SimpleNamespace(message=SimpleNamespace(content=self.answer.text))]


def tracked_completions(endpoints: Endpoints) -> Callable[..., Any]:
    """PaddleX's `create_chat_completion`, as ocrvl makes it: every chat completion sent to
    its page's endpoint through that endpoint's gate, streamed, and recorded on the page
    (`page_context`).

    PaddleX keeps only the answer's text, so whether it was cut off at the token limit or
    stopped as a loop would be lost. The request runs on PaddleX's event-loop thread, where
    the page is unknown; the call that starts it runs in the page's context, so that is where
    the future is noted, and read again once `predict` returned.
    """
    def tracked(messages: Any, *, return_future: bool = False, **kwargs: Any) -> Any:
        page = this_page()
        if page is None:
            raise RuntimeError("a chat completion was asked for outside a page")
        key = block_key(messages)
        kept = page.keep.get(key)
        if kept is not None:  # a good answer of the page's last try: no request
            answered: Future[Completion] = Future()
            answered.set_result(Completion(StreamedAnswer(kept.text, kept.finish_reason,
                                                           kept.tokens)))
            page.asked.append(Asked(key, answered, kept.limit, reused=True,
                                    image=image_url(messages)))
            return answered if return_future else answered.result()
        setting = page.blocks.get(key)
        if setting is not None:  # a block sent again with a setting of its own
            kwargs = _with_setting(kwargs, setting)
        url, sent = page.url, within_aspect(messages)
        request = GatedRequest(
            endpoints.gate(url),
            lambda started: endpoints.send(url, sent, kwargs, started),
            page.priority,
            page.document,
        )
        request.send()
        page.announced()
        page.started.append(request.future)
        page.asked.append(Asked(key, request.future, _limit(kwargs), image=image_url(messages)))
        shown = _failing_after_the_page(request.future)
        return shown if return_future else shown.result()

    return tracked


def _failing_after_the_page(sent: Future[Completion]) -> Future[Completion]:
    """What PaddleX gets for the request `sent`: its answer, or an empty one where it failed.

    PaddleX cancels a page's other requests as soon as one fails; answered, it lets them end,
    and `page.recognise` fails the page once they have, with their answers kept for its next try
    (a page of 30 blocks would otherwise need all 30 to succeed at once). Cancelling what it
    gets cancels the request.
    """
    shown: Future[Completion] = Future()

    def settle(done: Future[Completion]) -> None:
        with contextlib.suppress(InvalidStateError):  # PaddleX cancelled it meanwhile
            if done.cancelled():
                shown.cancel()
            elif done.exception() is not None:
                shown.set_result(Completion(StreamedAnswer("", None, 0)))
            else:
                shown.set_result(done.result())

    sent.add_done_callback(settle)
    shown.add_done_callback(lambda f: sent.cancel() if f.cancelled() else None)
    return shown


def _with_setting(kwargs: dict[str, Any], setting: Redo) -> dict[str, Any]:
    """PaddleX's arguments of one block's chat completion (`kwargs`: the page's limit and
    penalty) with the block's own limit and penalty instead (none: none)."""
    limit_name = "max_tokens" if "max_tokens" in kwargs else "max_completion_tokens"
    extra = {k: v for k, v in (kwargs.get("extra_body") or {}).items()
             if k != "repetition_penalty"}
    if setting.repetition_penalty is not None:  # PaddleX sends it in the extra_body
        extra["repetition_penalty"] = setting.repetition_penalty
    return {**kwargs, limit_name: setting.max_new_tokens, "extra_body": extra}


def _limit(kwargs: dict[str, Any]) -> int:
    """The token limit a chat completion's arguments ask for (0: none)."""
    return int(kwargs.get("max_completion_tokens") or kwargs.get("max_tokens") or 0)


def block_key(messages: Any) -> str:
    """What a chat request asks, as a short digest of its messages (the block's image and
    prompt): the same block of the same page, laid out again, has the same key."""
    text = json.dumps(messages, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def answers(asked: list[Asked]) -> list[BlockAnswer]:
    """The page's completions that came back, in the order asked: each one's key, how it
    ended, its text, tokens and limit, and whether it was kept from the last try."""
    answers = []
    for each in asked:
        future = each.future
        if future.done() and not future.cancelled() and future.exception() is None:
            answer = future.result().answer
            answers.append(BlockAnswer(each.key, answer.text, answer.finish_reason,
                                       answer.tokens, each.reused, each.limit,
                                       bool(answer.text.strip()) or _block_has_ink(each.image)))
    return answers


def _block_has_ink(url: str) -> bool:
    """Whether a block's image (a data URL) has ink; True when it cannot be read."""
    pixels = pixels_of(url)
    return True if pixels is None else has_ink(pixels)

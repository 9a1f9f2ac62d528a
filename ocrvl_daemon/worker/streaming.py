"""One chat completion, streamed, and stopped as soon as the answer loops.

A model caught in a loop repeats a phrase until its token limit (4096 by default: about six
ordinary pages of decoding), and a whole answer is only judged once it has ended. Streamed,
the answer is judged while it is decoded: every CHECK_EVERY_TOKENS tokens, once it is as long
as the loop score's window, its end is scored (`page_quality.looks_like_a_loop`); a loop
closes the stream, which makes the server abort the request (vLLM does at once), and the
answer ends with the finish reason LOOP.

The request is the one PaddleX's OpenAI client sends (`create_chat_completion`'s keyword
arguments: sampling, token limit, `extra_body`, `timeout`), with `stream` on. A server that
answers it whole anyway is read whole (its loops are judged once they end, as before). A
strict server that refuses the stream's options with an HTTP 400/422 naming them is asked
again with less (`_plainer`), and that server is asked that way from then on.
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from ocrvl_daemon.core.messages import LOOP
from ocrvl_daemon.core.quality import LOOP_WINDOW_CHARS, looks_like_a_loop

log = logging.getLogger(__name__)

# vLLM's finish reasons beyond OpenAI's "stop" and "length": its own loop detection ends an
# answer with "repetition"; "abort" and "error" end one unfinished.
REPEATED = "repetition"
UNFINISHED = ("abort", "error")
# How often a streamed answer is scored. Scoring costs ~50 us (zlib over the window); a loop
# runs on for at most this many tokens after it shows.
CHECK_EVERY_TOKENS = 64
# The answer's usage with every chunk (vLLM's `continuous_usage_stats`), so the tokens of an
# answer cut short are known; servers that do not send it have their chunks counted.
STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}
# A connection lost before any answer: the server closed a kept-alive connection just as it
# was reused, or dropped it unanswered. The request never reached the model, so it is sent
# once more on a new connection before the server counts as gone (a page of 30 blocks would
# otherwise go again whole, and the server's other pages wait for its health check).
DROPPED = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
# Kept-alive connections are closed after this many idle seconds: sooner than servers close
# them (uvicorn's and so vLLM's default is 5 s), which makes that race rare.
KEEPALIVE_EXPIRY = 2.0
# How an event stream's body begins: an event's data, a comment (a keep-alive ping), a field.
SSE_STARTS = (b"data:", b":", b"event:", b"id:", b"retry:")
# How many times each server (its chat completions URL) refused a request's stream options,
# by the client that asked: its requests are made that much plainer at once (`_plainer`), not
# refused first every time.
_PLAINER_FOR: weakref.WeakKeyDictionary[httpx.AsyncClient, dict[str, int]] = (
    weakref.WeakKeyDictionary())


# 4xx statuses that mean "not now" rather than "not this request": a request timeout, and
# a proxy's rate limit in front of the server.
LATER_STATUSES = frozenset({408, 429})


class StatusError(Exception):
    """The server refused or failed the request with an HTTP error status (for a stream that
    fails once started, the status in its error event)."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message


@dataclass(frozen=True)
class StreamedAnswer:
    """A streamed answer: its text, how it ended ("stop", "length" or LOOP) and the tokens
    the server generated for it."""

    text: str
    finish_reason: str | None
    tokens: int


def request_body(model: str, messages: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The streamed request's JSON body: what the OpenAI client sends for
    `create_chat_completion(messages, **kwargs)` (`extra_body` merged in, `timeout` left out)."""
    fields = {k: v for k, v in kwargs.items() if k not in ("extra_body", "timeout")}
    return {"model": model, "messages": messages, **fields, **(kwargs.get("extra_body") or {}),
            "stream": True, "stream_options": STREAM_OPTIONS}


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                            headers: dict[str, str], timeout: float,
                            stop_loops: bool = True,
                            started: Callable[[], None] | None = None) -> StreamedAnswer:
    """Send the chat completion `body` (see `request_body`) to `url` and read its answer as it
    streams; with `stop_loops`, stop it as soon as it loops (finish reason LOOP). `started` is
    called once the answer begins (its first text, token or end): until then the request
    waits in the server's queue (vLLM sends nothing, not even the role, before that).

    `timeout` bounds each wait for the server (a queued request may wait that long for its
    first token). A request whose connection is lost before any answer is sent once more
    (DROPPED). Raises StatusError for an error status, httpx.TransportError when the server
    cannot be reached or goes away.
    """
    parts: list[str] = []
    chars = tokens = judged = 0
    finish: str | None = None
    response = await _answering(client, url, body, headers, timeout)
    try:
        lines: AsyncIterator[str]
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            lines = response.aiter_lines()
        else:  # a server that does not stream, or streams without saying so
            raw = await response.aread()
            if not raw.lstrip().startswith(SSE_STARTS):
                return _whole(raw)
            lines = _each(raw.decode("utf-8", "replace").splitlines())
        async for line in lines:
            data = line.removeprefix("data:").strip()
            if not line.startswith("data:") or not data:
                continue
            if data == "[DONE]":
                break
            event = _event(data)
            # The server failed once streaming: vLLM sends {"error": {...}}, older ones the
            # error's fields alone ({"object": "error", ...}).
            error = event.get("error") if isinstance(event.get("error"), dict) else (
                event if event.get("object") == "error" else None)
            if error is not None:
                raise StatusError(int(error.get("code") or 500), error_message(data.encode()))
            text = ""
            for choice in event.get("choices") or ():
                text += (choice.get("delta") or {}).get("content") or ""
                finish = choice.get("finish_reason") or finish
            parts.append(text)
            chars += len(text)
            generated = (event.get("usage") or {}).get("completion_tokens")
            tokens = int(generated) if generated is not None else tokens + bool(text)
            if started is not None and (text or finish or tokens):
                started()
                started = None
            if (stop_loops and finish is None and chars >= LOOP_WINDOW_CHARS
                    and tokens - judged >= CHECK_EVERY_TOKENS):
                judged = tokens
                answer = "".join(parts)
                if looks_like_a_loop(answer):
                    return StreamedAnswer(answer, LOOP, tokens)
    finally:
        await response.aclose()  # a stream left early: the server aborts the request
    return _ended("".join(parts), finish, tokens)


async def _answering(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                     headers: dict[str, str], timeout: float) -> httpx.Response:
    """The server's response to `body` (its status below 400), its body not read yet: the
    request is sent once more on a new connection where it was dropped unanswered (DROPPED),
    and made plainer where the server refuses its stream options. StatusError otherwise."""
    known = _PLAINER_FOR.setdefault(client, {})
    plainer = 0
    while plainer < known.get(url, 0) and (simpler := _plainer(body)) is not None:
        body, plainer = simpler, plainer + 1
    while True:
        request = client.build_request("POST", url, json=body, headers=headers, timeout=timeout)
        try:
            response = await client.send(request, stream=True)
        except DROPPED:
            response = await client.send(request, stream=True)
        if response.status_code < 400:
            return response
        try:
            await response.aread()
        finally:
            await response.aclose()
        message = error_message(response.content)
        simpler = _plainer(body) if (response.status_code in (400, 422)
                                     and "stream" in message.lower()) else None
        if simpler is None:
            raise StatusError(response.status_code, message)
        plainer += 1
        if plainer > known.get(url, 0):
            known[url] = plainer
            log.info("the server at %s refuses streamed requests as sent (HTTP %d: %s); asking "
                     "it with fewer stream options from now on", url, response.status_code,
                     message[:200])
        body = simpler


def _plainer(body: dict[str, Any]) -> dict[str, Any] | None:
    """`body` with one stream option fewer, for a server that refused it: vLLM's
    `continuous_usage_stats` first (the answer's chunks are then counted), then all of
    `stream_options`, then streaming itself (the answer is read whole, its loops judged once it
    ends); None when there is nothing left to drop."""
    options = body.get("stream_options")
    if isinstance(options, dict) and "continuous_usage_stats" in options:
        return {**body, "stream_options": {k: v for k, v in options.items()
                                           if k != "continuous_usage_stats"}}
    if "stream_options" in body:
        return {k: v for k, v in body.items() if k != "stream_options"}
    if body.get("stream"):
        return {**body, "stream": False}
    return None


async def _each(lines: list[str]) -> AsyncIterator[str]:
    for line in lines:
        yield line


def _event(data: str) -> dict[str, Any]:
    """One streamed event's JSON object; StatusError (502) for one that is not."""
    try:
        event = json.loads(data)
    except ValueError:
        event = None
    if not isinstance(event, dict):
        raise _not_a_completion("chat completion stream", data)
    return event


def _whole(body: bytes) -> StreamedAnswer:
    """A chat completion answered whole (not streamed), as a streamed answer; StatusError
    (502) for an answer that is not a chat completion."""
    try:
        completion = json.loads(body)
        choice = completion["choices"][0]
        text = choice["message"].get("content") or ""
        usage = completion.get("usage") or {}
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise _not_a_completion("chat completion",
                                body[:200].decode("utf-8", "replace").strip()) from None
    return _ended(text, choice.get("finish_reason"), int(usage.get("completion_tokens") or 0))


def _not_a_completion(what: str, answer: str) -> StatusError:
    """The server failing a request with an `answer` that is not a `what` (HTTP 502)."""
    return StatusError(502, f"the server's answer is not a {what} (is server.url an "
                            f"OpenAI-compatible API?): {answer[:200]!r}")


def _ended(text: str, finish_reason: str | None, tokens: int) -> StreamedAnswer:
    """An answer that ended with `finish_reason`, in ocrvl's terms: vLLM's own loop detection
    ("repetition") is a loop; an answer the server ended unfinished ("abort", "error") is the
    server failing the request (StatusError 500), not an answer to keep."""
    if finish_reason in UNFINISHED:
        raise StatusError(500, f"the server ended the answer unfinished (finish_reason "
                          f"{finish_reason!r}) after {tokens} tokens")
    return StreamedAnswer(text, LOOP if finish_reason == REPEATED else finish_reason, tokens)


def error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body (`{"error": {"message": ...}}`, or vLLM's
    older `{"message": ...}`), else the body itself."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()
    if isinstance(data, dict):
        error = data.get("error", data)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
    return body.decode("utf-8", "replace").strip()

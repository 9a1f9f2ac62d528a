"""A streamed chat completion is read as it comes and stopped as soon as it loops
(ocrvl_daemon.worker.streaming), against the fake vLLM over real HTTP; and a book whose pages
loop, converted end to end."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest

from bench.loop_savings import convert
from ocrvl_daemon.core.quality import LOOP_PENALTIES, LOOP_WINDOW_CHARS
from ocrvl_daemon.worker.streaming import (
    CHECK_EVERY_TOKENS,
    LOOP,
    StatusError,
    StreamedAnswer,
    request_body,
    stream_completion,
)
from testkit.documents import make_pdf
from testkit.fake_server import DEFAULT_MODEL, FakeServerConfig, InProcessFakeServer
from testkit.harness import chat_payload, make_test_jpeg, wait_until
from testkit.plain_server import _Handler, plain_openai_server, serving

CHAT = "/v1/chat/completions"
LOOPING = 64  # the width of the page images that loop


def fake(**options: Any) -> InProcessFakeServer:
    """A fake server decoding a token every 2 ms; 300-token answers, pages LOOPING wide loop."""
    defaults: dict[str, Any] = {"step_t0_ms": 2.0, "output_tokens": "fixed:300",
                                "loop_widths": frozenset({LOOPING}), "access_log": False}
    return InProcessFakeServer(FakeServerConfig(port=0, **(defaults | options)))


@pytest.fixture
def server() -> Iterator[InProcessFakeServer]:
    with fake() as srv:
        yield srv


def paddlex_call(seed: int, width: int = 100, max_tokens: int = 4096,
                 **extra_body: Any) -> tuple[Any, dict[str, Any]]:
    """The messages and keyword arguments PaddleX passes to `create_chat_completion`."""
    body = chat_payload(make_test_jpeg(seed, (width, 64)))
    return body["messages"], {"temperature": 0, "max_completion_tokens": max_tokens,
                              "timeout": 600, "extra_body": extra_body}


def stream(srv: InProcessFakeServer, seed: int, width: int = 100, max_tokens: int = 4096,
           stop_loops: bool = True, **extra_body: Any) -> StreamedAnswer:
    messages, kwargs = paddlex_call(seed, width, max_tokens, **extra_body)

    async def run() -> StreamedAnswer:
        async with httpx.AsyncClient() as client:
            return await stream_completion(
                client, srv.url + CHAT, request_body(DEFAULT_MODEL, messages, kwargs), {},
                timeout=30, stop_loops=stop_loops)

    return asyncio.run(run())


def whole(srv: InProcessFakeServer, seed: int, width: int = 100,
          max_tokens: int = 4096) -> dict[str, Any]:
    """The same request answered without streaming."""
    body = chat_payload(make_test_jpeg(seed, (width, 64)), max_completion_tokens=max_tokens)
    return dict(httpx.post(srv.url + CHAT, json=body, timeout=30).json())


def test_the_request_is_the_one_paddlex_sends_with_stream_on() -> None:
    messages, kwargs = paddlex_call(1, repetition_penalty=1.05,
                                    mm_processor_kwargs={"max_pixels": 1000})
    body = request_body("M", messages, kwargs)
    assert body == {"model": "M", "messages": messages, "temperature": 0,
                    "max_completion_tokens": 4096, "repetition_penalty": 1.05,
                    "mm_processor_kwargs": {"max_pixels": 1000}, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def test_an_answer_streams_whole_with_its_finish_reason_and_tokens(
        server: InProcessFakeServer) -> None:
    expected = whole(server, 1)
    answer = stream(server, 1)
    assert answer == StreamedAnswer(expected["choices"][0]["message"]["content"], "stop", 300)
    cut = stream(server, 1, max_tokens=50)
    assert (cut.finish_reason, cut.tokens) == ("length", 50)
    assert answer.text.startswith(cut.text)


def test_a_long_answer_that_does_not_repeat_itself_is_not_stopped() -> None:
    with fake(output_tokens="fixed:1500") as srv:
        answer = stream(srv, 2)
    assert len(answer.text) > 3 * LOOP_WINDOW_CHARS, "too short to be judged many times"
    assert (answer.finish_reason, answer.tokens) == ("stop", 1500)


def test_a_loop_is_stopped_soon_after_it_shows_and_the_server_aborts_it(
        server: InProcessFakeServer) -> None:
    answer = stream(server, 3, width=LOOPING)
    assert answer.finish_reason == LOOP
    # The loop shows once the score's window is full (~6 characters a token here).
    assert answer.tokens <= LOOP_WINDOW_CHARS // 6 + 2 * CHECK_EVERY_TOKENS
    assert answer.text == whole(server, 3, LOOPING, max_tokens=answer.tokens)[
        "choices"][0]["message"]["content"]
    fake_vllm = server.server
    wait_until(lambda: fake_vllm.aborted == 1 and not fake_vllm.num_running(), 10,
               what="the loop's request to be aborted")
    assert fake_vllm.generation_tokens() < 2 * answer.tokens + 300, "the loop went on decoding"


def test_a_loop_runs_to_its_limit_when_loops_are_not_stopped(
        server: InProcessFakeServer) -> None:
    answer = stream(server, 4, width=LOOPING, max_tokens=1000, stop_loops=False)
    assert (answer.finish_reason, answer.tokens) == ("length", 1000)


def test_a_loop_broken_by_a_repetition_penalty_ends_normally(
        server: InProcessFakeServer) -> None:
    answer = stream(server, 5, width=LOOPING, repetition_penalty=1.05)
    assert (answer.finish_reason, answer.tokens) == ("stop", 300)


def test_a_server_that_does_not_stream_is_read_whole() -> None:
    with plain_openai_server(finish_reason="length") as url:
        answer = asyncio.run(_stream_to(url.removesuffix("/v1")))
    assert answer == StreamedAnswer("plain server saw OCR:", "length", 1)


@pytest.mark.parametrize(
    ("options", "status"),
    [({"served_model_names": ("other",)}, 404), ({"error_500_every": 1}, 500)],
)
def test_an_error_status_keeps_its_code(options: dict[str, Any], status: int) -> None:
    with (InProcessFakeServer(FakeServerConfig(port=0, access_log=False, **options)) as srv,
          pytest.raises(StatusError) as caught):
        stream(srv, 6)
    assert caught.value.status_code == status
    assert caught.value.message  # the server's own words, for the page's error


def test_an_engine_death_mid_stream_is_a_500() -> None:
    async def run(srv: InProcessFakeServer) -> None:
        async with httpx.AsyncClient() as client:
            messages, kwargs = paddlex_call(7)
            answer = asyncio.create_task(stream_completion(
                client, srv.url + CHAT, request_body(DEFAULT_MODEL, messages, kwargs), {},
                timeout=30))
            while not srv.server.num_running():
                await asyncio.sleep(0.01)
            await client.post(srv.url + CHAT, json=chat_payload(make_test_jpeg(8)))
            await answer

    with (fake(output_tokens="fixed:2000", crash_after=2, crash_exit_delay=5.0) as srv,
          pytest.raises(StatusError) as caught):
        asyncio.run(run(srv))
    assert caught.value.status_code == 500


def test_a_server_that_is_not_there_is_a_transport_error() -> None:
    with InProcessFakeServer(FakeServerConfig(port=0, access_log=False)) as srv:
        url = srv.url
    with pytest.raises(httpx.TransportError):
        asyncio.run(_stream_to(url))


def _whole_answer() -> bytes:
    answer = json.dumps({"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "answered"}}], "usage": {"completion_tokens": 1}}).encode()
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(answer), answer))


def _event_stream(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
            b"Connection: close\r\n\r\n" + body)


class _RawServer:
    """A server that reads each request and closes the first `drops` connections unanswered
    (as a server closing a kept-alive connection just as it is reused); then it sends
    `response` (raw HTTP, a whole answer by default). `connections`: how many it accepted."""

    def __init__(self, drops: int = 0, response: bytes | None = None) -> None:
        self.drops, self.connections = drops, 0
        self.response = response or _whole_answer()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/v1"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                self.connections += 1
                head = b""
                while b"\r\n\r\n" not in head:
                    head += conn.recv(65536)
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                assert length is not None, head
                size = int(length[1])
                body = head.split(b"\r\n\r\n", 1)[1]
                while len(body) < size:
                    body += conn.recv(65536)
                if self.connections <= self.drops:
                    continue  # closed unanswered
                conn.sendall(self.response)

    def close(self) -> None:
        self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._sock.close()
        self._thread.join(5)


def _answer_of(response: bytes) -> StreamedAnswer:
    server = _RawServer(response=response)
    try:
        return asyncio.run(_stream_to(server.url))
    finally:
        server.close()


@pytest.mark.quick
def test_streams_as_other_openai_compatible_servers_send_them_are_read() -> None:
    """Comments and keep-alive pings, CRLF line ends, `data:` without its space, a role-only
    first chunk with `delta: null` after it, usage without completion tokens, and the usage
    alone in a last chunk with no choices."""
    chunks = [
        b": ping\r\n\r\n",
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\r\n\r\n',
        b'data:{"choices":[{"index":0,"delta":{"content":"Hello "}}],"usage":null}\r\n\r\n',
        b'data: {"choices":[{"index":0,"delta":null}],"usage":{"prompt_tokens":9}}\r\n\r\n',
        b'data: {"choices":[{"index":0,"delta":{"content":"world"},"finish_reason":"stop"}]}'
        b"\r\n\r\n",
        b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3}}\r\n\r\n',
        b"data: [DONE]\r\n\r\n",
    ]
    answer = _answer_of(_event_stream(b"".join(chunks)))
    assert answer == StreamedAnswer("Hello world", "stop", 3), answer


@pytest.mark.quick
@pytest.mark.parametrize("content_type", [b"application/json", b"text/plain", None])
def test_a_stream_sent_without_the_event_stream_content_type_is_still_read(
        content_type: bytes | None) -> None:
    body = (b': ping\n\ndata: {"choices":[{"index":0,"delta":{"content":"Hello"},'
            b'"finish_reason":"stop"}],"usage":{"completion_tokens":2}}\n\ndata: [DONE]\n\n')
    head = b"HTTP/1.1 200 OK\r\n" + (b"Content-Type: %s\r\n" % content_type
                                        if content_type else b"")
    answer = _answer_of(head + b"Connection: close\r\n\r\n" + body)
    assert answer == StreamedAnswer("Hello", "stop", 2), answer


@pytest.mark.quick
@pytest.mark.parametrize("body", [b"<html><body>Welcome to nginx!</body></html>",
                                  b'{"object": "list", "data": []}', b"[]"])
def test_an_answer_that_is_not_a_chat_completion_is_a_server_error_naming_the_url_setting(
        body: bytes) -> None:
    response = (b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nConnection: close\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    with pytest.raises(StatusError) as caught:
        _answer_of(response)
    assert caught.value.status_code == 502, "a server answering nonsense fails the request"
    assert "not a chat completion" in caught.value.message
    assert "server.url" in caught.value.message and body[:20].decode() in caught.value.message


@pytest.mark.quick
@pytest.mark.parametrize("event", [b"{not json", b"[1, 2]", b'"text"'])
def test_a_streamed_event_that_is_not_a_json_object_is_a_server_error(event: bytes) -> None:
    with pytest.raises(StatusError) as caught:
        _answer_of(_event_stream(b"data: %s\n\ndata: [DONE]\n\n" % event))
    assert caught.value.status_code == 502 and "server.url" in caught.value.message
    assert event.decode() in caught.value.message


def _finishing(reason: str) -> bytes:
    """A stream of one chunk of text that ends with `reason`, usage last."""
    return _event_stream(
        b'data: {"choices":[{"index":0,"delta":{"content":"half a page"},"finish_reason":'
        b'"%s"}]}\n\ndata: {"choices":[],"usage":{"completion_tokens":4}}\n\ndata: [DONE]\n\n'
        % reason.encode())


@pytest.mark.quick
def test_an_answer_vllms_own_loop_detection_ended_is_a_loop() -> None:
    answer = _answer_of(_finishing("repetition"))
    assert answer == StreamedAnswer("half a page", LOOP, 4), (
        "an answer vLLM stopped for repeating itself would be kept as a good one")


@pytest.mark.quick
@pytest.mark.parametrize("reason", ["abort", "error"])
def test_an_answer_the_server_ended_unfinished_is_a_server_error(reason: str) -> None:
    with pytest.raises(StatusError) as caught:
        _answer_of(_finishing(reason))
    assert caught.value.status_code == 500, "half an answer would be kept as the block's text"
    assert f"finish_reason '{reason}'" in caught.value.message


@pytest.mark.quick
def test_an_error_event_in_older_vllms_shape_keeps_its_code_and_message() -> None:
    event = {"object": "error", "message": "prompt is too long", "type": "BadRequestError",
             "param": None, "code": 400}
    with pytest.raises(StatusError) as caught:
        _answer_of(_event_stream(b"data: %s\n\n" % json.dumps(event).encode()))
    assert (caught.value.status_code, caught.value.message) == (400, "prompt is too long")


@pytest.mark.quick
def test_a_request_whose_connection_drops_unanswered_is_sent_once_more() -> None:
    """A kept-alive connection that the server closes as it is reused loses nothing: the
    request goes once more on a new connection, and the page is not sent again whole."""
    server = _RawServer(drops=1)
    try:
        answer = asyncio.run(_stream_to(server.url))
    finally:
        server.close()
    assert answer.text == "answered", answer
    assert server.connections == 2, f"{server.connections} connections for one request"


@pytest.mark.quick
def test_a_server_that_drops_every_request_unanswered_is_a_transport_error_after_two_tries(
        ) -> None:  # fmt: skip
    server = _RawServer(drops=10)
    try:
        with pytest.raises(httpx.TransportError):
            asyncio.run(_stream_to(server.url))
    finally:
        server.close()
    assert server.connections == 2, (
        f"{server.connections} tries of a request a server keeps dropping: once more, not more")


class _StrictServer(_Handler):
    """An OpenAI-compatible server stricter than vLLM: it refuses vLLM's stream option
    `continuous_usage_stats` (HTTP 400), `stream_options` at all (400) and streaming (422, as a
    validating server would), and answers whole. `bodies`: every request it was sent."""

    bodies: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        options = body.get("stream_options") or {}
        refusal = (
            (400, "Unrecognized request argument supplied: stream_options.continuous_usage_stats")
            if "continuous_usage_stats" in options else
            (400, "Unrecognized request argument supplied: stream_options")
            if "stream_options" in body else
            (422, "stream: streaming is not supported by this server")
            if body.get("stream") else
            (400, "prompt is too long") if body.get("max_completion_tokens") == 1 else None)
        if refusal is not None:
            self._send(refusal[0], {"error": {"message": refusal[1]}})
        else:
            self._send(200, {"choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"content": "answered"}}],
                             "usage": {"completion_tokens": 1}})


@pytest.mark.quick
def test_a_server_that_refuses_the_stream_options_is_asked_with_fewer_from_then_on() -> None:
    """A strict server refusing vLLM's stream options, then any, then streaming at all: the
    page is still answered, and that server's next requests go plain at once."""
    _StrictServer.bodies = []
    messages, kwargs = paddlex_call(9)

    async def ask_twice(url: str) -> list[StreamedAnswer]:
        async with httpx.AsyncClient() as client:
            return [await stream_completion(client, url + CHAT, request_body(
                DEFAULT_MODEL, messages, kwargs), {}, 5) for _ in range(2)]

    with serving(_StrictServer) as root:
        first, second = asyncio.run(ask_twice(root + "/v1"))
    assert first == second == StreamedAnswer("answered", "stop", 1), (first, second)
    asked = [(b.get("stream"), b.get("stream_options")) for b in _StrictServer.bodies]
    assert asked == [(True, {"include_usage": True, "continuous_usage_stats": True}),
                     (True, {"include_usage": True}), (True, None), (False, None),
                     (False, None)], f"what the strict server was asked, in turn: {asked}"


@pytest.mark.quick
def test_a_refusal_that_is_not_about_streaming_is_not_sent_again() -> None:
    _StrictServer.bodies = []
    messages, kwargs = paddlex_call(9, max_tokens=1)
    plain = {k: v for k, v in request_body(DEFAULT_MODEL, messages, kwargs).items()
             if k != "stream_options"}

    async def ask(url: str) -> StreamedAnswer:
        async with httpx.AsyncClient() as client:
            return await stream_completion(client, url + CHAT,
                                           {**plain, "stream": False}, {}, 5)

    with serving(_StrictServer) as root, pytest.raises(StatusError) as caught:
        asyncio.run(ask(root + "/v1"))
    assert (caught.value.status_code, caught.value.message) == (400, "prompt is too long")
    assert len(_StrictServer.bodies) == 1, "a request the server refused for itself went again"


async def _stream_to(url: str) -> StreamedAnswer:
    messages, kwargs = paddlex_call(9)
    async with httpx.AsyncClient() as client:
        return await stream_completion(client, url + CHAT,
                                       request_body(DEFAULT_MODEL, messages, kwargs), {}, 5)


@pytest.mark.slow
def test_a_book_whose_pages_loop_converts_the_same_with_the_loops_stopped_early(
        tmp_path: Path) -> None:
    """`ocrvl convert` end to end: a loop stopped early gets the same loop-breaking retry, and
    the book the same Markdown, as one that ran to its limit; the server decoded far less."""
    looping = (1, 4)
    book = make_pdf(tmp_path / "book.pdf", 6)
    stopped, to_the_limit = (
        convert(tmp_path / str(stop), book, looping, stop, answer_tokens="fixed:300")
        for stop in (True, False))
    assert stopped.markdown == to_the_limit.markdown
    assert "ocrvl:" not in stopped.markdown, "a page whose loop was broken is flagged"
    for run in (stopped, to_the_limit):
        assert [[r["repetition_penalty"] for r in tries] for tries in run.loop_requests] == [
            [None, LOOP_PENALTIES[0]]] * len(looping), "not the same loop-breaking retries"
        assert all(tries[1]["tokens"] == 300 for tries in run.loop_requests)
    assert to_the_limit.loop_first == [4096] * len(looping)
    assert all(tries[0].get("aborted") for tries in stopped.loop_requests)
    assert max(stopped.loop_first) <= LOOP_WINDOW_CHARS // 6 + 2 * CHECK_EVERY_TOKENS
    assert to_the_limit.generated - stopped.generated >= len(looping) * 3500

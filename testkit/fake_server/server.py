"""The fake vLLM's HTTP server: its life cycle, its routes and its fault switches.

vLLM flags it does not model (``--trust-remote-code``, ``--limit-mm-per-prompt ...``) are
accepted and ignored, so ocrvl can launch it exactly like ``vllm serve``.
``--request-log`` appends one JSON line per chat request, with each answer's length
(``tokens``), the tokens the engine decoded for it (``generated_tokens``) and ``stream``.

``"stream": true`` answers like vLLM: ``text/event-stream`` of ``data: {chat.completion.chunk}``
events (the role, then the text as the batching simulation decodes it, then the finish
reason, then the usage if ``stream_options.include_usage``), then ``data: [DONE]``; an
engine that dies mid-answer ends the stream with ``data: {"error": ...}``. With vLLM's
``stream_options.continuous_usage_stats`` every chunk carries the usage so far.

A client that goes away (closes the connection, or the stream mid-answer) aborts its request,
as vLLM does: it leaves the batch or the queue, is logged with status 499, ``aborted: true``
and the tokens decoded until then, and counted in ``requests_aborted``.

``--prepare-ms-per-image`` models vLLM's API process, which prepares images one at a time in
arrival order before the engine sees them: a request that arrives behind many waits for
theirs. The log's ``engine`` is when a request's image was ready.

Faults (N counts chat requests received, starting at 1): ``--crash-after N`` (the Nth
request kills the engine: in-flight requests get 500, /health 503, the process exits 0
after ``--crash-exit-delay``, like vLLM's API server after engine death), ``--hang-after N``
(from the Nth request on nothing is answered; /health stays 200), ``--error-500-every N``
and ``--error-500-rate P``, ``--health-503-after N`` (after N completions /health is 503
and chat requests get 500), ``--fail-start KIND`` (print vLLM's failure and exit 1 without
binding; see startup.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import http
import json
import os
import random
import re
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any, TextIO

from aiohttp import web
from PIL import UnidentifiedImageError
from prometheus_client import CollectorRegistry, generate_latest

from ocrvl_daemon.config.models import MAX_IMAGE_ASPECT
from testkit.fake_server.answers import (
    ChatRequest,
    ImageInfo,
    OutputLength,
    RequestError,
    analyse_image,
    engine_error,
    image_tokens,
    parse_chat,
    prompt_kind,
    reply_pieces,
)
from testkit.fake_server.batching import PREFILL_UNIT_TOKENS, BatchSimulator, SimSequence
from testkit.fake_server.config import FakeServerConfig
from testkit.fake_server.console import emit, vllm_line
from testkit.fake_server.metrics import Activity, VllmMetrics, fake_stats
from testkit.fake_server.reader import read_text
from testkit.fake_server.startup import (
    plan_startup,
    print_failure,
    spawn_engine_child,
    startup_phases,
    stop_engine_child,
)

CLIENT_GONE = 499  # the status logged for a request whose client went away (nginx's)


# vLLM 0.31-0.33's words (vllm/entrypoints/generate/base/protocol.py) for the request it gates.
UNTRUSTED_MM_KWARGS = (
    "Per-request mm_processor_kwargs are disabled by default because they can change "
    "multimodal preprocessing resource usage. Start the server with --trust-request-mm-kwargs "
    "only when clients are trusted.")


class FakeServer:
    """The fake vLLM: start-up, HTTP app and fault switches, around the batching simulation."""

    def __init__(self, cfg: FakeServerConfig) -> None:
        self.cfg = cfg
        self.plan = plan_startup(cfg)
        self.lengths = OutputLength.parse(cfg.output_tokens)
        self.port: int | None = None
        self.ready = threading.Event()  # set once bound; waited on from other threads
        self.engine: subprocess.Popen[bytes] | None = None
        self._stop = asyncio.Event()
        self._exit_code = 0
        self.dead = False  # the engine died: /health is 503, every request gets 500
        self._dead_event = asyncio.Event()
        self._rng = random.Random(0)
        self._request_log: TextIO | None = None
        self.started = time.monotonic()
        self._created = int(time.time())
        # counters
        self.received = 0
        self.completed = 0
        self.failed = 0
        self.hung = 0
        self.aborted = 0  # requests whose client went away before the answer
        self.by_digest: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()
        self.prompt_tokens_total = 0
        self.answered_generation_tokens = 0  # without batching (with it: counted per step)
        self.completion_tokens_total = 0  # in answers given (aborted requests' tokens are not)
        self.activity = Activity()
        self.batch = BatchSimulator(cfg, max(1, self.plan.kv_tokens), self.activity)
        self._preparing = asyncio.Lock()  # vLLM's API process prepares one image at a time
        self._direct_active = 0  # requests being looked at, without batching

        self.app = web.Application(
            client_max_size=256 * 1024 * 1024, middlewares=[self._middleware]
        )
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_post("/v1/chat/completions", self._chat)
        self.app.router.add_get("/metrics", self._metrics)
        self.app.router.add_get("/fake/stats", self._stats)
        self.app.router.add_post("/fake/reset", self._reset)
        self.registry = CollectorRegistry()
        self.registry.register(VllmMetrics(self))

    # life cycle

    def request_stop(self, code: int = 0) -> None:
        """Ask ``run`` to shut down and return ``code`` (safe from signal handlers)."""
        self._exit_code = code
        self._stop.set()

    async def run(self) -> int:
        """Start up, serve until stopped, shut down; return the exit code."""
        cfg = self.cfg
        if cfg.ignored_args:
            emit(
                vllm_line(
                    "WARNING",
                    "fake_server.py",
                    f"ignoring unmodelled args: {' '.join(cfg.ignored_args)}",
                )
            )
        with contextlib.ExitStack() as stack:
            if cfg.request_log:
                self._request_log = stack.enter_context(
                    open(cfg.request_log, "a", encoding="utf-8")
                )
            try:
                return await self._serve()
            finally:
                stop_engine_child(self.engine, signal.SIGTERM)

    async def _serve(self) -> int:
        cfg = self.cfg
        scheduler: asyncio.Task[None] | None = None
        runner: web.AppRunner | None = None
        try:
            if not await self._boot():
                return self._exit_code
            try:
                sock = _bind(cfg.host, cfg.port)
            except OSError as exc:
                emit(
                    f"ERROR:    [Errno {exc.errno}] error while attempting to bind on address "
                    f"{(cfg.host, cfg.port)!r}: {(exc.strerror or str(exc)).lower()}"
                )
                return 1
            self.port = sock.getsockname()[1]
            runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=0.25,
                                   handler_cancellation=True)
            await runner.setup()
            await web.SockSite(runner, sock, backlog=1024).start()
            if cfg.simulate:
                scheduler = asyncio.create_task(self.batch.run())
            emit(
                f"INFO:     Uvicorn running on http://{cfg.host}:{self.port} (Press CTRL+C to quit)"
            )
            self.ready.set()
            await self._stop.wait()
            emit("INFO:     Shutting down")
            self._kill_requests()
            return self._exit_code
        finally:
            if scheduler is not None:
                scheduler.cancel()
            if runner is not None:
                await runner.cleanup()
                emit("INFO:     Application shutdown complete.")
                emit(f"INFO:     Finished server process [{os.getpid()}]")

    async def _until(self, start: float, fraction: float) -> bool:
        """Sleep until ``fraction`` of the start-up delay has passed; False if stopped."""
        remaining = start + fraction * self.cfg.startup_delay - time.monotonic()
        if remaining > 0:
            try:
                await asyncio.wait_for(self._stop.wait(), remaining)
            except asyncio.TimeoutError:
                return True
        return not self._stop.is_set()

    async def _boot(self) -> bool:
        """Print vLLM's start-up phases over the delay; False on a start-up failure or stop."""
        cfg, plan, start = self.cfg, self.plan, time.monotonic()
        for fraction, fails_here, line in startup_phases(cfg, plan, self.batch.kv_capacity):
            if not await self._until(start, fraction):
                return False
            if fails_here is not None and fails_here == plan.failure:
                print_failure(plan)
                self._exit_code = 1
                return False
            emit(vllm_line("INFO", "fake_server.py", line))
            if line.startswith("Starting to load") and cfg.spawn_engine_child:
                self.engine = spawn_engine_child()
        if not await self._until(start, 1.0):
            return False
        emit(f"INFO:     Started server process [{os.getpid()}]")
        emit("INFO:     Waiting for application startup.")
        emit("INFO:     Application startup complete.")
        return True

    def _crash(self) -> None:
        emit(vllm_line("ERROR", "core.py", "EngineCore encountered a fatal error."))
        emit(vllm_line("ERROR", "async_llm.py", "AsyncLLM output_handler failed."))
        stop_engine_child(self.engine, signal.SIGKILL)
        self._kill_requests()
        asyncio.get_running_loop().call_later(self.cfg.crash_exit_delay, self.request_stop, 0)

    def _kill_requests(self) -> None:
        """Engine death: everything in it fails, hung requests are released (with 500)."""
        self.dead = True
        self._dead_event.set()
        self.batch.fail_all()
        self.activity.set(0)

    # HTTP

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        key = self.cfg.api_key
        try:
            if (
                key
                and request.path.startswith("/v1")
                and (request.headers.get("Authorization") != f"Bearer {key}")
            ):
                response: web.StreamResponse = web.json_response(
                    {"error": "Unauthorized"}, status=401
                )
            else:
                response = await handler(request)
        except web.HTTPException as exc:
            self._access(request, exc.status)
            raise
        self._access(request, response.status)
        return response

    def _access(self, request: web.Request, status: int) -> None:
        if not self.cfg.access_log:
            return
        peer = request.transport.get_extra_info("peername") if request.transport else None
        client = f"{peer[0]}:{peer[1]}" if peer else "-"
        try:
            phrase = http.HTTPStatus(status).phrase
        except ValueError:
            phrase = ""
        version = request.version
        line = f"{request.method} {request.path_qs} HTTP/{version.major}.{version.minor}"
        emit(f'INFO:     {client} - "{line}" {status} {phrase}')

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(status=503 if self.dead else 200)

    async def _models(self, _request: web.Request) -> web.Response:
        data: list[dict[str, Any]] = [
            {
                "id": name,
                "object": "model",
                "created": self._created,
                "owned_by": "vllm",
                "root": name,
                "parent": None,
                "max_model_len": self.cfg.max_model_len,
                "permission": [],
            }
            for name in self.cfg.served_model_names
        ]
        return web.json_response({"object": "list", "data": data})

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), content_type="text/plain", charset="utf-8"
        )

    async def _stats(self, _request: web.Request) -> web.Response:
        return web.json_response(fake_stats(self))

    async def _reset(self, _request: web.Request) -> web.Response:
        self.reset_stats()
        return web.json_response(fake_stats(self))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.received += 1
        number = self.received
        self.activity.start()
        record: dict[str, Any] = {
            "t": time.time(), "model": None, "digest": None, "w": None, "h": None,
            "prompt": None, "max_tokens": None, "status": None,
        }  # fmt: skip
        try:
            response, status = await self._complete(request, number, record)
        except RequestError as exc:
            response = exc.response()
            status = response.status
        except asyncio.CancelledError:  # the client went away: vLLM aborts the request too
            self._aborted(record)
            raise
        if status == CLIENT_GONE:
            self._aborted(record)
            return response
        if status == 200:
            self.completed += 1
            if (
                self.cfg.health_503_after is not None
                and self.completed >= self.cfg.health_503_after
            ):
                self.dead = True
        else:
            self.failed += 1
        record["status"] = status
        record["done"] = time.time()
        self._log_request(record)
        return response

    async def _complete(
        self, request: web.Request, number: int, record: dict[str, Any]
    ) -> tuple[web.StreamResponse, int]:
        """Answer a chat request; return the response and the status it ended with (a stream
        that failed mid-answer went out as 200)."""
        cfg = self.cfg
        try:
            body = await request.json()
        except ValueError as exc:
            raise RequestError(400, f"Invalid JSON: {exc}", "BadRequestError") from exc
        chat = parse_chat(body)
        record.update(model=chat.model, prompt=chat.prompt, max_tokens=chat.max_tokens,
                      repetition_penalty=body.get("repetition_penalty"), stream=chat.stream)
        if chat.model not in cfg.served_model_names:
            raise RequestError(
                404, f"The model `{chat.model}` does not exist.", "NotFoundError", "model"
            )
        info, img_tokens = await self._look(chat)
        record.update(digest=info.digest, w=info.width, h=info.height, marked=info.marked)
        self.by_digest[info.digest] += 1
        prompt_tokens = img_tokens + len(chat.prompt) // 4 + 20
        max_tokens = chat.max_tokens or max(1, cfg.max_model_len - prompt_tokens)
        if prompt_tokens + max_tokens > cfg.max_model_len:
            raise RequestError(
                400,
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, you "
                f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or "
                "completion.",
                "BadRequestError",
            )
        if cfg.crash_after is not None and number >= cfg.crash_after and not self.dead:
            self._crash()
        if self.dead:
            raise engine_error()
        if cfg.hang_after is not None and number >= cfg.hang_after:
            await self._hang(record)
        if (cfg.gate_request_mm_kwargs and not cfg.trust_request_mm_kwargs
                and body.get("mm_processor_kwargs")):
            raise RequestError(400, f"{UNTRUSTED_MM_KWARGS} (parameter=mm_processor_kwargs)",
                               "BadRequestError", "mm_processor_kwargs")
        if cfg.refused_prompts and chat.prompt.startswith(cfg.refused_prompts):
            raise RequestError(400, f"the fake server refuses {chat.prompt!r} requests "
                               "(--refused-prompts)", "BadRequestError")
        if (cfg.error_500_every and number % cfg.error_500_every == 0) or (
            cfg.error_500_rate > 0 and self._rng.random() < cfg.error_500_rate
        ):
            raise engine_error()
        # A loop never ends by itself: it runs to the limit.
        looping = cfg.looping_answers or (
            (info.width in cfg.loop_widths or info.marked) and not chat.breaks_loops)
        words = await self._read(chat)
        drawn = self.lengths.draw(info.digest)
        if words is not None:  # the image's own words: the made-up answers' modes do not apply
            drawn, looping = len(words), False
        elif looping or info.width in cfg.cut_widths:
            drawn = max_tokens + 1
        elif info.width in cfg.empty_widths:
            drawn = 0
        produced = min(drawn, max_tokens)
        if cfg.prepare_ms_per_image > 0:
            async with self._preparing:  # one at a time, first come first served
                await asyncio.sleep(
                    cfg.prepare_ms_per_image * img_tokens / PREFILL_UNIT_TOKENS / 1000)
        record["engine"] = time.time()
        answer = _Answer(
            chat, (reply_pieces(prompt_kind(chat.prompt), info, produced, looping)
                   if words is None else words[:produced]),
            "length" if drawn > max_tokens else "stop",
            {"prompt_tokens": prompt_tokens, "completion_tokens": produced,
             "total_tokens": prompt_tokens + produced},
        )
        seq = self.batch.submit(prompt_tokens, img_tokens, produced) if cfg.simulate else None
        try:
            if chat.stream:
                return await self._stream(request, answer, seq, record)
            if seq is not None:
                await self.batch.finish(seq)
        finally:
            # Tokens the engine decoded for it, answered or not (an aborted request's are
            # what the abort saved from the rest).
            record["generated_tokens"] = produced if seq is None else seq.produced
            if seq is not None:
                seq.future.cancel()  # aborts it if it is still decoding
        self._answered(answer, record)
        message = {"role": "assistant", "content": "".join(answer.pieces)}
        return web.json_response({
            "id": answer.id, "object": "chat.completion", "created": answer.created,
            "model": chat.model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": answer.finish, "stop_reason": None}],
            "usage": answer.usage,
        }), 200

    async def _stream(self, request: web.Request, answer: _Answer, seq: SimSequence | None,
                      record: dict[str, Any]) -> tuple[web.StreamResponse, int]:
        """Answer as vLLM streams: server-sent ``chat.completion.chunk`` events, the role
        first, then the text as it is decoded, then the finish reason (and the usage when
        asked), then ``[DONE]``."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            return response, await self._events(response, answer, seq, record)
        except ConnectionResetError:  # the client closed the stream, and a write saw it first
            return response, CLIENT_GONE

    async def _events(self, response: web.StreamResponse, answer: _Answer,
                      seq: SimSequence | None, record: dict[str, Any]) -> int:
        """Write a stream's events (see `_stream`); return the status it ended with."""
        head = {"id": answer.id, "object": "chat.completion.chunk", "created": answer.created,
                "model": answer.chat.model}

        async def send(event: dict[str, Any]) -> None:
            await response.write(f"data: {json.dumps(event)}\n\n".encode())

        def chunk(delta: dict[str, str], finish: str | None = None) -> dict[str, Any]:
            event = head | {"choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish}]}
            if answer.chat.continuous_usage:
                prompt = answer.usage["prompt_tokens"]
                event["usage"] = {"prompt_tokens": prompt, "completion_tokens": sent,
                                  "total_tokens": prompt + sent}
            return event

        sent = 0  # tokens sent so far
        await send(chunk({"role": "assistant", "content": ""}))
        decoded = self.batch.progress(seq) if seq is not None else _at_once(len(answer.pieces))
        try:
            async for produced in decoded:
                if produced > sent:
                    delta = "".join(answer.pieces[sent:produced])
                    sent = produced
                    await send(chunk({"content": delta}))
        except RequestError as exc:  # the engine died mid-answer: vLLM ends the stream so
            await send(exc.body())
            await response.write(b"data: [DONE]\n\n")
            return exc.status
        await send(chunk({"content": ""}, answer.finish))
        if answer.chat.include_usage:
            await send(head | {"choices": [], "usage": answer.usage})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        self._answered(answer, record)
        return 200

    def _aborted(self, record: dict[str, Any]) -> None:
        """Count and log a request whose client went away before its answer ended."""
        self.aborted += 1
        self.finished["abort"] += 1
        record.update(status=CLIENT_GONE, aborted=True, done=time.time())
        self._log_request(record)

    def _answered(self, answer: _Answer, record: dict[str, Any]) -> None:
        """Count an answer given in full."""
        produced = answer.usage["completion_tokens"]
        record["tokens"] = produced
        self.finished[answer.finish] += 1
        self.prompt_tokens_total += answer.usage["prompt_tokens"]
        self.completion_tokens_total += produced
        if not self.cfg.simulate:  # simulated: counted per decode step, like vLLM
            self.answered_generation_tokens += produced

    async def _look(self, chat: ChatRequest) -> tuple[ImageInfo, int]:
        """Describe the request's image and count its tokens (no image: digest of the prompt)."""
        if chat.image is None:
            return ImageInfo(0, 0, 0, hashlib.sha256(chat.prompt.encode()).hexdigest()[:12]), 0
        if not self.cfg.simulate:
            self._direct_active += 1
            self.activity.set(self._direct_active)
        try:
            # Decoding off the event loop keeps the simulated step timing honest.
            info = await asyncio.to_thread(analyse_image, chat.image, self.cfg.loop_marked)
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise RequestError(400, f"Cannot decode image: {exc}", "BadRequestError") from exc
        finally:
            if not self.cfg.simulate:
                self._direct_active -= 1
                self.activity.set(self._direct_active)
        aspect = max(info.width, info.height) / max(1, min(info.width, info.height))
        if aspect > MAX_IMAGE_ASPECT:  # as vLLM's PaddleOCR-VL image processor refuses it
            raise RequestError(400, "absolute aspect ratio must be smaller than "
                                    f"{MAX_IMAGE_ASPECT}, got {aspect}", "BadRequestError")
        return info, image_tokens(info.width, info.height, chat.max_pixels)

    async def _read(self, chat: ChatRequest) -> list[str] | None:
        """With `--read-text`, the words on the request's image, a piece each (the first
        without, the others with the space or line break before them); None otherwise."""
        if not self.cfg.read_text or chat.image is None:
            return None
        text = await asyncio.to_thread(read_text, chat.image)
        return re.findall(r"\s*\S+", text)

    async def _hang(self, record: dict[str, Any]) -> None:
        """Never answer (until the engine dies or the server stops: then 500)."""
        self.hung += 1
        record["status"] = "hung"
        self._log_request(record)
        # A client that gives up does not unstick the engine: the request stays "running".
        await self._dead_event.wait()
        self.hung -= 1
        raise engine_error()

    def _log_request(self, record: dict[str, Any]) -> None:
        # A hung request is logged once, when it hangs; it must not be logged again.
        if self._request_log is None or record.get("_logged"):
            return
        self._request_log.write(json.dumps(record) + "\n")
        self._request_log.flush()
        record["_logged"] = True

    # observation

    def reset_stats(self) -> None:
        """Start the time-weighted statistics afresh (``POST /fake/reset``; counters stay)."""
        self.activity.reset()
        self.batch.max_waiting = len(self.batch.waiting)

    def num_running(self) -> int:
        """What vLLM would report as running (hung requests stay "running" forever)."""
        return (len(self.batch.running) if self.cfg.simulate else self._direct_active) + self.hung

    def generation_tokens(self) -> int:
        """Tokens generated: per decode step when batching is simulated (like vLLM), else per
        answer."""
        return self.batch.generation_tokens + self.answered_generation_tokens


@dataclasses.dataclass
class _Answer:
    """What one chat request gets: its text token by token, how it ends, its usage."""

    chat: ChatRequest
    pieces: list[str]
    finish: str
    usage: dict[str, int]
    id: str = dataclasses.field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


async def _at_once(tokens: int) -> AsyncIterator[int]:
    """Without batching simulated, a whole answer is decoded at once."""
    yield tokens


def _bind(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


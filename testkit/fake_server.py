"""A fake vLLM: an OpenAI-compatible server that behaves like vLLM where ocrvl cares.

Used by the tests (life cycle, faults, which page landed where) and by the throughput
benchmark (a simulated continuous-batching server). Run it as::

    python -m testkit.fake_server --host 127.0.0.1 --port 8118 \\
        --served-model-name PaddleOCR-VL-1.6-0.9B [options]

vLLM flags it does not model (``--trust-remote-code``, ``--limit-mm-per-prompt ...``) are
accepted and ignored, so ocrvl can launch it exactly like ``vllm serve``.

Replies are derived from the image, so tests can prove which page landed where:
``fake-ocr {kind} {w}x{h} mean={gray} sha={digest}`` (kind = first word of the prompt without
its colon, e.g. ``OCR`` or ``Table``; digest = first 12 hex of the sha256 of the decoded RGB
pixels; gray = mean gray level), then deterministic, non-repeating filler words up to the output
length.

Token model: the base line counts as 16 tokens and each filler word as one (so with a cap
below 16 the base line is still sent whole). Image tokens are ceil(w/28)*ceil(h/28) after
scaling the image down (aspect kept) to ``mm_processor_kwargs.max_pixels`` (default
1003520); the text and chat template add len(prompt)//4 + 20.

Output length (``--output-tokens``): ``fixed:N``, ``uniform:A:B`` or ``lognormal:MEAN:SIGMA``
(MEAN is the distribution's mean), drawn from an RNG seeded with the image digest so the
same image always gets the same length; capped by the request's max tokens
(finish_reason ``length``). ``--request-log`` records each answer's length (``tokens``).
``--looping-answers``: every answer repeats one short phrase up to the request's max tokens
(finish_reason ``length``), like a model caught in a loop, whatever the request asks.
Pages are picked by their image width in pixels (``make_pdf`` page i rendered at scale 2 is
``2 * page_width(i)`` wide): ``--loop-widths W,...`` loop like that unless the request
carries a loop-breaking sampling parameter (``repetition_penalty`` > 1, or a
``frequency_penalty`` / ``presence_penalty`` > 0), as vLLM's would stop; ``--cut-widths``
get non-repeating text up to the limit (cut off, not a loop); ``--empty-widths`` get an
empty answer.

``POST /fake/reset`` starts the time-weighted statistics of ``/fake/stats`` (occupancy,
mean and max active) afresh; counters keep counting, so callers take differences.

Batching simulation (on when any of ``--step-t0-ms``, ``--step-t1-ms``,
``--prefill-ms-per-image`` is > 0; otherwise requests are answered at once): one scheduler
loop admits up to ``--max-num-seqs`` sequences while the rest wait. Each step produces one
token per running sequence and takes t0 + t1*running ms, plus prefill-ms-per-image *
image_tokens/1300 for every sequence admitted in that step. A sequence holds prompt +
produced tokens of KV cache and is only admitted if that fits; when the running sequences
outgrow ``--kv-capacity-tokens`` (default max_num_seqs*2048, or the KV size of the fake
VRAM model) the newest is preempted to the head of the queue and, when readmitted,
recomputed: its image and every token it had produced are prefilled again (vLLM's
recompute preemption), so throughput falls once the batch outgrows the KV cache.

A client that goes away (closes the connection) aborts its request, as vLLM does: it leaves
the batch or the queue, is logged with status 499 and counted in ``requests_aborted``.

Fake VRAM model (``--fake-vram-gib G``, ``--fake-vram-used-gib U``), utilization u:
``free-memory`` failure if u*G > G-U; else kv = u*G - weights (``--fake-weights-gib``,
1.9) - spike (max_num_seqs*0.004 + 0.5 GiB, the profiling peak) and ``oom-kv`` if kv <= 0;
else ``max-len`` (naming the length that would fit) if max_model_len *
``--fake-kv-gib-per-token`` > kv; else it starts with kv/kv-per-token tokens of KV cache.
Lowering max-num-seqs, then max-model-len, then utilization eventually lets it start.

Faults (N counts chat requests received, starting at 1): ``--crash-after N`` (the Nth
request kills the engine: in-flight requests get 500, /health 503, the process exits 0
after ``--crash-exit-delay``, like vLLM's API server after engine death), ``--hang-after N``
(from the Nth request on nothing is answered; /health stays 200), ``--error-500-every N``
and ``--error-500-rate P``, ``--health-503-after N`` (after N completions /health is 503
and chat requests get 500), ``--fail-start KIND`` (``oom-kv``, ``free-memory``,
``max-len``, ``cuda-oom``: print vLLM's failure and exit 1 without binding).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import dataclasses
import hashlib
import http
import io
import itertools
import json
import logging
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any, TextIO

from aiohttp import web
from PIL import Image, ImageStat, UnidentifiedImageError
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

DEFAULT_MODEL = "PaddleOCR-VL-1.6-0.9B"
DEFAULT_MAX_PIXELS = 1003520
PATCH_PIXELS = 28
BASE_LINE_TOKENS = 16
PREFILL_UNIT_TOKENS = 1300  # ~ one full 1 MP page
FAIL_KINDS = ("oom-kv", "free-memory", "max-len", "cuda-oom")
ENGINE_CHILD_MAX_SECONDS = 600
ENGINE_CHILD_MARKER = "VLLM::EngineCore"
FILLER_VOCAB = (
    "lorem", "ipsum", "dolor", "sit", "amet", "page", "text", "line", "word", "book",
    "scan", "table", "cell", "note", "figure", "chapter", "section", "margin", "ink", "paper",
    "column", "row", "title", "index", "verse", "letter", "number", "mark", "quote", "list",
    "item", "end",
)  # fmt: skip
ENGINE_ERROR = "EngineCore encountered an issue. See stack trace (above) for the root cause."
ROOT_CAUSE_TAIL = (
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
)

# prctl(PR_SET_NAME) makes `pgrep VLLM` find it like vLLM's setproctitle'd engine; the
# marker argument makes `pgrep -f VLLM::EngineCore` find it; the sleep bounds a leak.
_ENGINE_CHILD_CODE = (
    "import ctypes, sys, time\n"
    "try:\n"
    "    ctypes.CDLL(None).prctl(15, b'VLLM::EngineCor', 0, 0, 0)\n"
    "except Exception:\n"
    "    pass\n"
    "time.sleep(float(sys.argv[1]))\n"
)


@dataclasses.dataclass(frozen=True)
class OutputLength:
    """An output-length distribution parsed from ``fixed:N|uniform:A:B|lognormal:MEAN:SIGMA``."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> OutputLength:
        """Parse a spec; raise ValueError naming the accepted forms."""
        kind, _, rest = spec.partition(":")
        try:
            nums = [float(x) for x in rest.split(":")] if rest else []
        except ValueError:
            nums = []
        arity = {"fixed": 1, "uniform": 2, "lognormal": 2}.get(kind)
        if (
            arity is None
            or len(nums) != arity
            or min(nums) < 0
            or (kind == "uniform" and nums[0] > nums[1])
            or (kind == "lognormal" and nums[0] <= 0)
        ):
            raise ValueError(
                f"bad output length {spec!r}: use fixed:N, uniform:A:B or lognormal:MEAN:SIGMA"
            )
        return cls(kind, *nums)

    def draw(self, digest: str) -> int:
        """Draw a length (>= 1 token) deterministically from an image digest."""
        rng = random.Random(digest)
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        else:
            # mu chosen so that MEAN is the mean, not the median, of the lognormal.
            value = rng.lognormvariate(math.log(self.a) - self.b**2 / 2, self.b)
        return max(1, round(value))


@dataclasses.dataclass
class FakeServerConfig:
    """Everything the fake server can be told (mirrors the command-line options)."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = (DEFAULT_MODEL,)
    max_model_len: int = 16384
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.9
    api_key: str | None = None
    output_tokens: str = "fixed:16"
    step_t0_ms: float = 0.0
    step_t1_ms: float = 0.0
    prefill_ms_per_image: float = 0.0
    kv_capacity_tokens: int | None = None
    startup_delay: float = 0.0
    crash_after: int | None = None
    crash_exit_delay: float = 0.5
    hang_after: int | None = None
    error_500_every: int | None = None
    error_500_rate: float = 0.0
    health_503_after: int | None = None
    fail_start: str | None = None
    fake_vram_gib: float | None = None
    fake_vram_used_gib: float = 0.0
    fake_weights_gib: float = 1.9
    fake_kv_gib_per_token: float = 0.0000183
    spawn_engine_child: bool = False
    request_log: str | None = None
    looping_answers: bool = False
    loop_widths: frozenset[int] = frozenset()
    cut_widths: frozenset[int] = frozenset()
    empty_widths: frozenset[int] = frozenset()
    access_log: bool = True
    ignored_args: tuple[str, ...] = ()

    @property
    def simulate(self) -> bool:
        """Whether requests go through the continuous-batching scheduler."""
        return self.step_t0_ms > 0 or self.step_t1_ms > 0 or self.prefill_ms_per_image > 0


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (vLLM's names where vLLM has the option)."""
    p = argparse.ArgumentParser(
        prog="python -m testkit.fake_server",
        description="Fake vLLM OpenAI-compatible server for ocrvl tests and benchmarks.",
        allow_abbrev=False,  # an unknown vLLM flag must never match one of ours by prefix
    )
    d = FakeServerConfig()
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--served-model-name", nargs="+", default=list(d.served_model_names))
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"))
    p.add_argument(
        "--output-tokens", default=d.output_tokens, help="fixed:N|uniform:A:B|lognormal:MEAN:SIGMA"
    )
    p.add_argument(
        "--step-t0-ms", type=float, default=d.step_t0_ms, help="fixed cost of a decode step"
    )
    p.add_argument(
        "--step-t1-ms", type=float, default=d.step_t1_ms, help="step cost per running sequence"
    )
    p.add_argument(
        "--prefill-ms-per-image",
        type=float,
        default=d.prefill_ms_per_image,
        help="prefill cost of a 1300-token image, added to the step that admits it",
    )
    p.add_argument("--kv-capacity-tokens", type=int, default=None)
    p.add_argument(
        "--startup-delay", type=float, default=d.startup_delay, help="seconds before binding"
    )
    p.add_argument("--crash-after", type=int, default=None)
    p.add_argument("--crash-exit-delay", type=float, default=d.crash_exit_delay)
    p.add_argument("--hang-after", type=int, default=None)
    p.add_argument("--error-500-every", type=int, default=None)
    p.add_argument("--error-500-rate", type=float, default=d.error_500_rate)
    p.add_argument("--health-503-after", type=int, default=None)
    p.add_argument("--fail-start", choices=FAIL_KINDS, default=None)
    p.add_argument("--fake-vram-gib", type=float, default=None)
    p.add_argument("--fake-vram-used-gib", type=float, default=d.fake_vram_used_gib)
    p.add_argument("--fake-weights-gib", type=float, default=d.fake_weights_gib)
    p.add_argument("--fake-kv-gib-per-token", type=float, default=d.fake_kv_gib_per_token)
    p.add_argument("--spawn-engine-child", action="store_true")
    p.add_argument("--request-log", default=None, help="append one JSON line per chat request")
    p.add_argument("--looping-answers", action="store_true",
                   help="every answer repeats one phrase until the token limit (a model loop)")
    for kind, what in (("loop", "loop unless the request breaks loops"),
                       ("cut", "are cut off at the limit"), ("empty", "get an empty answer")):
        p.add_argument(f"--{kind}-widths", type=_widths, default=frozenset(),
                       help=f"pages whose image is this many pixels wide {what} (W,W,...)")
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    return p


def _widths(spec: str) -> frozenset[int]:
    return frozenset(int(w) for w in spec.split(",") if w.strip())


def parse_args(argv: Sequence[str] | None = None) -> FakeServerConfig:
    """Parse command-line arguments; unknown (vLLM) arguments are kept in ``ignored_args``."""
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    try:
        OutputLength.parse(ns.output_tokens)
    except ValueError as exc:
        parser.error(str(exc))
    return FakeServerConfig(
        host=ns.host,
        port=ns.port,
        served_model_names=tuple(ns.served_model_name),
        max_model_len=ns.max_model_len,
        max_num_seqs=ns.max_num_seqs,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        api_key=ns.api_key,
        output_tokens=ns.output_tokens,
        step_t0_ms=ns.step_t0_ms,
        step_t1_ms=ns.step_t1_ms,
        prefill_ms_per_image=ns.prefill_ms_per_image,
        kv_capacity_tokens=ns.kv_capacity_tokens,
        startup_delay=ns.startup_delay,
        crash_after=ns.crash_after,
        crash_exit_delay=ns.crash_exit_delay,
        hang_after=ns.hang_after,
        error_500_every=ns.error_500_every,
        error_500_rate=ns.error_500_rate,
        health_503_after=ns.health_503_after,
        fail_start=ns.fail_start,
        fake_vram_gib=ns.fake_vram_gib,
        fake_vram_used_gib=ns.fake_vram_used_gib,
        fake_weights_gib=ns.fake_weights_gib,
        fake_kv_gib_per_token=ns.fake_kv_gib_per_token,
        spawn_engine_child=ns.spawn_engine_child,
        request_log=ns.request_log,
        looping_answers=ns.looping_answers,
        loop_widths=ns.loop_widths,
        cut_widths=ns.cut_widths,
        empty_widths=ns.empty_widths,
        access_log=not ns.disable_uvicorn_access_log,
        ignored_args=tuple(unknown),
    )


# --- start-up: the fake VRAM model and vLLM's failure messages -------------------------


def free_memory_message(free: float, total: float, util: float, wanted: float) -> str:
    """vLLM's root cause when free VRAM is below utilization x total."""
    return (
        f"ValueError: Free memory on device ({free:.1f}/{total:.1f} GiB) on startup is less "
        f"than desired GPU memory utilization ({util}, {wanted:.2f} GiB). Decrease GPU memory "
        "utilization or reduce GPU memory used by other processes."
    )


def max_len_message(max_len: int, needed: float, available: float, estimate: int) -> str:
    """vLLM's root cause when one max-model-len sequence does not fit the KV cache."""
    return (
        f"ValueError: To serve at least one request with the model's max seq len ({max_len}), "
        f"({needed:.2f} GiB KV cache is needed, which is larger than the available KV cache "
        f"memory ({available:.2f} GiB). Based on the available memory, the estimated maximum "
        f"model length is {estimate}. Try increasing `gpu_memory_utilization` or decreasing "
        "`max_model_len` when initializing the engine."
    )


OOM_KV_MESSAGE = (
    "ValueError: No available memory for the cache blocks. Try increasing "
    "`gpu_memory_utilization` when initializing the engine."
)
CUDA_OOM_MESSAGE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.20 GiB. GPU 0 has a "
    "total capacity of 7.63 GiB of which 512.00 MiB is free."
)
FIXED_FAILURES = {
    "oom-kv": OOM_KV_MESSAGE,
    "free-memory": free_memory_message(6.5, 7.6, 0.9, 6.84),
    "max-len": max_len_message(131072, 2.25, 0.69, 40336),
    "cuda-oom": CUDA_OOM_MESSAGE,
}


@dataclasses.dataclass(frozen=True)
class StartupPlan:
    """How start-up ends: a failure kind and its root-cause line, or the KV cache size."""

    failure: str | None
    message: str
    kv_gib: float
    kv_tokens: int


def plan_startup(cfg: FakeServerConfig) -> StartupPlan:
    """Apply ``--fail-start`` or the fake VRAM model (see the module docstring)."""
    per_token = cfg.fake_kv_gib_per_token
    if cfg.fail_start:
        return StartupPlan(cfg.fail_start, FIXED_FAILURES[cfg.fail_start], 0.0, 0)
    if cfg.fake_vram_gib is None:
        tokens = cfg.kv_capacity_tokens or cfg.max_num_seqs * 2048
        return StartupPlan(None, "", tokens * per_token, tokens)
    total, util = cfg.fake_vram_gib, cfg.gpu_memory_utilization
    wanted, free = util * total, total - cfg.fake_vram_used_gib
    if wanted > free:
        return StartupPlan("free-memory", free_memory_message(free, total, util, wanted), 0, 0)
    kv = wanted - cfg.fake_weights_gib - (cfg.max_num_seqs * 0.004 + 0.5)
    if kv <= 0:
        return StartupPlan("oom-kv", OOM_KV_MESSAGE, 0.0, 0)
    fits = int(kv / per_token)
    needed = cfg.max_model_len * per_token
    if needed > kv:
        return StartupPlan("max-len", max_len_message(cfg.max_model_len, needed, kv, fits), kv, 0)
    return StartupPlan(None, "", kv, cfg.kv_capacity_tokens or fits)


# --- requests --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ImageInfo:
    """What the fake "model" sees of an image."""

    width: int
    height: int
    mean_gray: int
    digest: str


def analyse_image(data: bytes) -> ImageInfo:
    """Decode an image and describe it (size, mean gray, digest of the RGB pixels)."""
    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")
    digest = hashlib.sha256(rgb.tobytes()).hexdigest()[:12]
    mean = round(ImageStat.Stat(rgb.convert("L")).mean[0])
    return ImageInfo(rgb.width, rgb.height, mean, digest)


def image_tokens(width: int, height: int, max_pixels: int) -> int:
    """Vision tokens for an image scaled down (aspect kept) to fit ``max_pixels``."""
    if width * height > max_pixels:
        scale = math.sqrt(max_pixels / (width * height))
        width, height = max(1, int(width * scale)), max(1, int(height * scale))
    return math.ceil(width / PATCH_PIXELS) * math.ceil(height / PATCH_PIXELS)


LOOP_PHRASE_WORDS = 6


def reply_text(kind: str, info: ImageInfo, tokens: int, looping: bool = False) -> str:
    """The reply: the base line, then digest-derived filler up to ``tokens`` tokens.

    The filler does not repeat itself (a shorter answer is a prefix of a longer one), unless
    `looping`: then one short phrase is repeated, like a model caught in a loop.
    """
    base = f"fake-ocr {kind} {info.width}x{info.height} mean={info.mean_gray} sha={info.digest}"
    extra = tokens - BASE_LINE_TOKENS
    if extra <= 0:
        return base
    words = random.Random(info.digest).choices(FILLER_VOCAB, k=LOOP_PHRASE_WORDS if looping
                                               else extra)
    return base + " " + " ".join(itertools.islice(itertools.cycle(words), extra))


class RequestError(Exception):
    """A request that gets an OpenAI-style error response."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def response(self) -> web.Response:
        """The OpenAI/vLLM error body."""
        error = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.status,
        }
        return web.json_response({"error": error}, status=self.status)


def _engine_error() -> RequestError:
    return RequestError(500, ENGINE_ERROR, "InternalServerError")


@dataclasses.dataclass
class ChatRequest:
    """The parts of a chat completion request the fake server looks at."""

    model: str
    prompt: str
    image: bytes | None
    max_tokens: int | None
    max_pixels: int
    breaks_loops: bool = False  # a loop-breaking sampling parameter is set


def parse_chat(body: Any) -> ChatRequest:
    """Pull model, prompt, image and limits out of a request body (400 when malformed)."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        raise RequestError(
            400, "Request body must be a JSON object with messages", "BadRequestError"
        )
    texts: list[str] = []
    image: bytes | None = None
    for message in body["messages"]:
        content = message.get("content") if isinstance(message, dict) else None
        parts: list[Any] = [{"type": "text", "text": content}] if isinstance(content, str) else []
        if isinstance(content, list):
            parts = content
        for part in parts:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            elif part.get("type") == "image_url":
                ref = part.get("image_url")
                image = _decode_data_url(str(ref.get("url", "")) if isinstance(ref, dict) else "")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise RequestError(
            400, "max_tokens must be a positive integer", "BadRequestError", "max_tokens"
        )
    mm_kwargs = body.get("mm_processor_kwargs")
    max_pixels = mm_kwargs.get("max_pixels") if isinstance(mm_kwargs, dict) else None
    if not isinstance(max_pixels, int) or max_pixels <= 0:
        max_pixels = DEFAULT_MAX_PIXELS
    def above(key: str, floor: float) -> bool:
        value = body.get(key)
        return isinstance(value, (int, float)) and value > floor

    breaks = (above("repetition_penalty", 1.0) or above("frequency_penalty", 0.0)
              or above("presence_penalty", 0.0))
    return ChatRequest(str(body.get("model")), "\n".join(texts), image, max_tokens, max_pixels,
                       breaks)


def _decode_data_url(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:") or not header.endswith(";base64"):
        raise RequestError(400, "The fake server only accepts base64 data URLs", "BadRequestError")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(400, f"Invalid base64 image: {exc}", "BadRequestError") from exc


def prompt_kind(prompt: str) -> str:
    """``OCR:`` -> ``OCR``, ``Table Recognition:`` -> ``Table``."""
    words = prompt.strip().rstrip(":").split()
    return words[0].rstrip(":") if words else "none"


@dataclasses.dataclass(eq=False)
class SimSequence:
    """One request inside the batching simulation."""

    prompt_tokens: int
    image_tokens: int
    target: int
    future: asyncio.Future[None]
    produced: int = 0

    @property
    def held(self) -> int:
        """KV cache tokens this sequence holds while running."""
        return self.prompt_tokens + self.produced


class EngineDead(Exception):
    """The simulated engine died while a request was in it."""


def _vllm_line(level: str, where: str, message: str) -> str:
    return f"{level} {time.strftime('%m-%d %H:%M:%S')} [{where}] {message}"


def emit(line: str) -> None:
    """Print one line of vLLM-like console output (what the supervisor parses)."""
    print(line, file=sys.stderr, flush=True)


# --- the server ------------------------------------------------------------------------


class FakeServer:
    """The fake vLLM: start-up phases, HTTP app, fault switches and batching simulation."""

    def __init__(self, cfg: FakeServerConfig) -> None:
        self.cfg = cfg
        self.plan = plan_startup(cfg)
        self.lengths = OutputLength.parse(cfg.output_tokens)
        self.kv_capacity = max(1, self.plan.kv_tokens)
        self.port: int | None = None
        self.ready = threading.Event()  # set once bound; waited on from other threads
        self.engine: subprocess.Popen[bytes] | None = None
        self._stop = asyncio.Event()
        self._exit_code = 0
        self._dead = False
        self._dead_event = asyncio.Event()
        self._wake = asyncio.Event()
        self._rng = random.Random(0)
        self._request_log: TextIO | None = None
        self._started = time.monotonic()
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
        self.generation_tokens_total = 0
        self.completion_tokens_total = 0  # in answers given (aborted requests' tokens are not)
        self.preemptions = 0
        # scheduler state
        self.running: list[SimSequence] = []
        self.waiting: deque[SimSequence] = deque()
        self._direct_active = 0
        # time-weighted activity
        self._first_request: float | None = None
        self._last_change = 0.0
        self._active = 0
        self._area = 0.0
        self._busy = 0.0
        self.max_active = 0
        self.max_waiting = 0

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
        self.registry.register(_Metrics(self))

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
                _vllm_line(
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
                self._stop_engine(signal.SIGTERM)

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
                scheduler = asyncio.create_task(self._scheduler())
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
        name = cfg.served_model_names[0]
        tokens = self.kv_capacity
        phases: list[tuple[float, str | None, str]] = [
            (0.0, None, "vLLM API server version 0.0.0+fake"),
            (
                0.0,
                None,
                f"non-default args: {{'model': '{name}', 'max_model_len': {cfg.max_model_len}}}",
            ),
            (0.05, "free-memory", f"Starting to load model {name}..."),
            (0.15, None, "Loading weights took 0.50 seconds"),
            (
                0.25,
                None,
                f"Model loading took {cfg.fake_weights_gib:.1f} GiB memory and 2.1 seconds",
            ),
            (0.45, "cuda-oom", "Memory profiling takes 1.2 seconds"),
            (0.50, "oom-kv", f"Available KV cache memory: {plan.kv_gib:.2f} GiB"),
            (0.55, "max-len", f"GPU KV cache size: {tokens:,} tokens"),
            (
                0.55,
                None,
                f"Maximum concurrency for {cfg.max_model_len} tokens per request: "
                f"{tokens / cfg.max_model_len:.2f}x",
            ),
            (0.60, None, "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 0/67"),
            (0.95, None, "Graph capturing finished in 3 secs, took 0.45 GiB"),
        ]  # (when, failure that strikes before this line, line)
        for fraction, fails_here, line in phases:
            if not await self._until(start, fraction):
                return False
            if fails_here is not None and fails_here == plan.failure:
                self._print_failure()
                self._exit_code = 1
                return False
            emit(_vllm_line("INFO", "fake_server.py", line))
            if line.startswith("Starting to load") and cfg.spawn_engine_child:
                self._spawn_engine()
        if not await self._until(start, 1.0):
            return False
        emit(f"INFO:     Started server process [{os.getpid()}]")
        emit("INFO:     Waiting for application startup.")
        emit("INFO:     Application startup complete.")
        return True

    def _print_failure(self) -> None:
        emit(_vllm_line("ERROR", "core.py", "EngineCore failed to start."))
        emit("Traceback (most recent call last):")
        emit('  File "vllm/v1/engine/core.py", line 700, in run_engine_core')
        emit(self.plan.message)
        emit(ROOT_CAUSE_TAIL)

    def _spawn_engine(self) -> None:
        # Same process group, no new session: killing the group must take it down, killing
        # only this process must orphan it (that is what real vLLM does).
        self.engine = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _ENGINE_CHILD_CODE,
                str(ENGINE_CHILD_MAX_SECONDS),
                ENGINE_CHILD_MARKER,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        emit(
            _vllm_line(
                "INFO", "fake_server.py", f"Engine core process started (pid {self.engine.pid})"
            )
        )

    def _stop_engine(self, sig: signal.Signals) -> None:
        if self.engine is None or self.engine.poll() is not None:
            return
        self.engine.send_signal(sig)
        try:
            self.engine.wait(1.0)
        except subprocess.TimeoutExpired:
            self.engine.kill()
            self.engine.wait()

    def _crash(self) -> None:
        emit(_vllm_line("ERROR", "core.py", "EngineCore encountered a fatal error."))
        emit(_vllm_line("ERROR", "async_llm.py", "AsyncLLM output_handler failed."))
        self._stop_engine(signal.SIGKILL)
        self._kill_requests()
        asyncio.get_running_loop().call_later(self.cfg.crash_exit_delay, self.request_stop, 0)

    def _kill_requests(self) -> None:
        """Engine death: everything in it fails, hung requests are released (with 500)."""
        self._dead = True
        self._dead_event.set()
        for seq in itertools.chain(self.running, self.waiting):
            if not seq.future.done():
                seq.future.set_exception(EngineDead())
        self.running.clear()
        self.waiting.clear()
        self._set_active(0)

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
        return web.Response(status=503 if self._dead else 200)

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
        return web.json_response(self.stats())

    async def _reset(self, _request: web.Request) -> web.Response:
        self.reset_stats()
        return web.json_response(self.stats())

    async def _chat(self, request: web.Request) -> web.Response:
        self.received += 1
        number = self.received
        if self._first_request is None:
            self._first_request = self._last_change = time.monotonic()
        record: dict[str, Any] = {
            "t": time.time(), "model": None, "digest": None, "w": None, "h": None,
            "prompt": None, "max_tokens": None, "status": None,
        }  # fmt: skip
        try:
            response = await self._complete(request, number, record)
        except RequestError as exc:
            response = exc.response()
        except asyncio.CancelledError:  # the client went away: vLLM aborts the request too
            self.aborted += 1
            record.update(status=499, done=time.time())
            self._log_request(record)
            raise
        if response.status == 200:
            self.completed += 1
            if (
                self.cfg.health_503_after is not None
                and self.completed >= self.cfg.health_503_after
            ):
                self._dead = True
        else:
            self.failed += 1
        record["status"] = response.status
        record["done"] = time.time()
        self._log_request(record)
        return response

    async def _complete(
        self, request: web.Request, number: int, record: dict[str, Any]
    ) -> web.Response:
        cfg = self.cfg
        try:
            body = await request.json()
        except ValueError as exc:
            raise RequestError(400, f"Invalid JSON: {exc}", "BadRequestError") from exc
        chat = parse_chat(body)
        record.update(model=chat.model, prompt=chat.prompt, max_tokens=chat.max_tokens,
                      repetition_penalty=body.get("repetition_penalty"))
        if chat.model not in cfg.served_model_names:
            raise RequestError(
                404, f"The model `{chat.model}` does not exist.", "NotFoundError", "model"
            )
        info, img_tokens = await self._look(chat)
        record.update(digest=info.digest, w=info.width, h=info.height)
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
        if cfg.crash_after is not None and number >= cfg.crash_after and not self._dead:
            self._crash()
        if self._dead:
            raise _engine_error()
        if cfg.hang_after is not None and number >= cfg.hang_after:
            await self._hang(record)
        if (cfg.error_500_every and number % cfg.error_500_every == 0) or (
            cfg.error_500_rate > 0 and self._rng.random() < cfg.error_500_rate
        ):
            raise _engine_error()
        # A loop never ends by itself: it runs to the limit.
        looping = cfg.looping_answers or (info.width in cfg.loop_widths and not chat.breaks_loops)
        drawn = self.lengths.draw(info.digest)
        if looping or info.width in cfg.cut_widths:
            drawn = max_tokens + 1
        elif info.width in cfg.empty_widths:
            drawn = 0
        produced = min(drawn, max_tokens)
        if cfg.simulate:
            await self._generate(prompt_tokens, img_tokens, produced)
        finish = "length" if drawn > max_tokens else "stop"
        record["tokens"] = produced
        self.finished[finish] += 1
        self.prompt_tokens_total += prompt_tokens
        self.completion_tokens_total += produced
        if not cfg.simulate:  # simulated: counted per decode step, like vLLM
            self.generation_tokens_total += produced
        return web.json_response(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": chat.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": reply_text(prompt_kind(chat.prompt), info, produced,
                                                  looping) if produced else "",
                        },
                        "logprobs": None,
                        "finish_reason": finish,
                        "stop_reason": None,
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": produced,
                    "total_tokens": prompt_tokens + produced,
                },
            }
        )

    async def _look(self, chat: ChatRequest) -> tuple[ImageInfo, int]:
        """Describe the request's image and count its tokens (no image: digest of the prompt)."""
        if chat.image is None:
            return ImageInfo(0, 0, 0, hashlib.sha256(chat.prompt.encode()).hexdigest()[:12]), 0
        if not self.cfg.simulate:
            self._direct_active += 1
            self._set_active(self._direct_active)
        try:
            # Decoding off the event loop keeps the simulated step timing honest.
            info = await asyncio.to_thread(analyse_image, chat.image)
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise RequestError(400, f"Cannot decode image: {exc}", "BadRequestError") from exc
        finally:
            if not self.cfg.simulate:
                self._direct_active -= 1
                self._set_active(self._direct_active)
        return info, image_tokens(info.width, info.height, chat.max_pixels)

    async def _hang(self, record: dict[str, Any]) -> None:
        """Never answer (until the engine dies or the server stops: then 500)."""
        self.hung += 1
        record["status"] = "hung"
        self._log_request(record)
        # A client that gives up does not unstick the engine: the request stays "running".
        await self._dead_event.wait()
        self.hung -= 1
        raise _engine_error()

    def _log_request(self, record: dict[str, Any]) -> None:
        # A hung request is logged once, when it hangs; it must not be logged again.
        if self._request_log is None or record.get("_logged"):
            return
        self._request_log.write(json.dumps(record) + "\n")
        self._request_log.flush()
        record["_logged"] = True

    # continuous-batching simulation

    async def _generate(self, prompt_tokens: int, img_tokens: int, target: int) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append(SimSequence(prompt_tokens, img_tokens, target, future))
        self.max_waiting = max(self.max_waiting, len(self.waiting))
        self._wake.set()
        try:
            await future
        except EngineDead:
            raise _engine_error() from None

    async def _scheduler(self) -> None:
        cfg = self.cfg
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            prefill_ms = self._admit()
            self._set_active(len(self.running))
            await asyncio.sleep(
                (cfg.step_t0_ms + cfg.step_t1_ms * len(self.running) + prefill_ms) / 1000
            )
            still: list[SimSequence] = []
            for seq in self.running:
                if seq.future.done():  # cancelled by a vanished client
                    continue
                seq.produced += 1
                self.generation_tokens_total += 1
                if seq.produced >= seq.target:
                    seq.future.set_result(None)
                else:
                    still.append(seq)
            self.running = still
            self._preempt()
            self._set_active(len(self.running))

    def _admit(self) -> float:
        """Move waiting sequences into the batch; return the prefill time they cost (ms)."""
        held = sum(seq.held for seq in self.running)
        prefill_ms = 0.0
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if seq.future.done():
                self.waiting.popleft()
                continue
            if self.running and held + seq.held > self.kv_capacity:
                break
            self.waiting.popleft()
            self.running.append(seq)
            held += seq.held
            # A preempted sequence is recomputed, as vLLM does: its image and everything it
            # had generated are prefilled again. This is what makes too many sequences in
            # flight slower than the right number.
            prefill_ms += (self.cfg.prefill_ms_per_image * (seq.image_tokens + seq.produced)
                           / PREFILL_UNIT_TOKENS)
        return prefill_ms

    def _preempt(self) -> None:
        held = sum(seq.held for seq in self.running)
        while len(self.running) > 1 and held > self.kv_capacity:
            seq = self.running.pop()
            held -= seq.held
            self.waiting.appendleft(seq)
            self.preemptions += 1
            log.debug("preempted a sequence holding %d tokens", seq.held)
        self.max_waiting = max(self.max_waiting, len(self.waiting))

    def _set_active(self, active: int) -> None:
        """Record a change in active sequences for the time-weighted statistics."""
        if self._first_request is not None:
            now = time.monotonic()
            elapsed = now - self._last_change
            self._area += self._active * elapsed
            if self._active > 0:
                self._busy += elapsed
            self._last_change = now
        self._active = active
        self.max_active = max(self.max_active, active)

    # observation

    def reset_stats(self) -> None:
        """Start the time-weighted statistics afresh (``POST /fake/reset``; counters stay)."""
        now = time.monotonic()
        self._first_request = now if self._first_request is not None else None
        self._last_change = now
        self._area = self._busy = 0.0
        self.max_active = self._active
        self.max_waiting = len(self.waiting)

    def kv_usage(self) -> float:
        """Fraction of the notional KV cache held by running sequences."""
        return min(1.0, sum(seq.held for seq in self.running) / self.kv_capacity)

    def num_running(self) -> int:
        """What vLLM would report as running (hung requests stay "running" forever)."""
        return (len(self.running) if self.cfg.simulate else self._direct_active) + self.hung

    def stats(self) -> dict[str, Any]:
        """Counters and time-weighted occupancy, for tests and the benchmark."""
        now = time.monotonic()
        area, busy = self._area, self._busy
        since_first = 0.0
        if self._first_request is not None:
            tail = now - self._last_change
            area += self._active * tail
            busy += tail if self._active > 0 else 0.0
            since_first = now - self._first_request
        mean_busy = area / busy if busy > 0 else 0.0
        return {
            "requests_received": self.received,
            "requests_completed": self.completed,
            "requests_failed": self.failed,
            "requests_hung": self.hung,
            "requests_aborted": self.aborted,
            "requests_by_digest": dict(self.by_digest),
            "running": self.num_running(),
            "waiting": len(self.waiting),
            "max_active": self.max_active,
            "max_waiting": self.max_waiting,
            "mean_active": area / since_first if since_first > 0 else 0.0,
            "mean_active_busy": mean_busy,
            "occupancy": mean_busy / self.cfg.max_num_seqs,
            "busy_seconds": busy,
            "uptime": now - self._started,
            "preemptions": self.preemptions,
            "prompt_tokens": self.prompt_tokens_total,
            "generation_tokens": self.generation_tokens_total,
            "completion_tokens": self.completion_tokens_total,
            "kv_capacity_tokens": self.kv_capacity,
            "engine_dead": self._dead,
            "engine_pid": self.engine.pid if self.engine is not None else None,
        }


class _Metrics(Collector):
    """Prometheus collector with vLLM's metric names, read from the server on each scrape."""

    def __init__(self, server: FakeServer) -> None:
        self.server = server

    def collect(self) -> Iterable[Metric]:
        s = self.server
        labels = ["model_name"]
        name = [s.cfg.served_model_names[0]]
        gauges = (
            ("vllm:num_requests_running", "Requests in model execution batches.", s.num_running()),
            ("vllm:num_requests_waiting", "Requests waiting to be processed.", len(s.waiting)),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                s.kv_usage(),
            ),
        )
        for metric, doc, value in gauges:
            gauge = GaugeMetricFamily(metric, doc, labels=labels)
            gauge.add_metric(name, value)
            yield gauge
        counters = (
            ("vllm:num_preemptions", "Cumulative number of preemptions.", s.preemptions),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens_total),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                s.generation_tokens_total,
            ),
        )
        for metric, doc, value in counters:
            counter = CounterMetricFamily(metric, doc, labels=labels)
            counter.add_metric(name, value)
            yield counter
        success = CounterMetricFamily(
            "vllm:request_success", "Count of successfully processed requests.",
            labels=["model_name", "finished_reason"],
        )  # fmt: skip
        for reason in ("stop", "length"):
            success.add_metric([*name, reason], s.finished[reason])
        yield success


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


class InProcessFakeServer:
    """Run a fake server on a background thread (unit tests; port 0 picks a free port).

    Fault switches that end the process (``--crash-after``) only stop this server here.
    """

    def __init__(self, cfg: FakeServerConfig, ready_timeout: float = 10.0) -> None:
        self.server = FakeServer(cfg)
        self.ready_timeout = ready_timeout
        self.exit_code: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name="fake-vllm", daemon=True)

    def _main(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self.exit_code = self._loop.run_until_complete(self.server.run())
        finally:
            self._loop.close()

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234`` (append ``/v1`` for OpenAI clients)."""
        return f"http://{self.server.cfg.host}:{self.server.port}"

    def __enter__(self) -> InProcessFakeServer:
        self._thread.start()
        deadline = time.monotonic() + self.ready_timeout
        while not self.server.ready.wait(0.02):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"fake server did not start (exit code {self.exit_code})")
        return self

    def stop(self) -> None:
        """Stop the server and join its thread."""
        loop = self._loop
        if loop is not None and self._thread.is_alive():
            loop.call_soon_threadsafe(self.server.request_stop, 0)
        self._thread.join(5.0)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


async def _serve(cfg: FakeServerConfig) -> int:
    server = FakeServer(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_stop, 0)
    return await server.run()


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code."""
    return asyncio.run(_serve(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())

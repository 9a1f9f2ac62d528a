"""HTTP probes of an OpenAI-compatible server: health, served models, `/metrics`, the API key.

The supervisor, the metrics poller, `ocrvl doctor` and the engine's token-ceiling lookup
all talk to the server through these: one bearer header, one `/metrics` parser.
"""

from __future__ import annotations

import base64
import io
import logging
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.config.models import MAX_IMAGE_PIXELS, MIN_IMAGE_PIXELS, MODELS
from ocrvl_daemon.errors import ServerConfigError
from ocrvl_daemon.worker.streaming import LATER_STATUSES, error_message

log = logging.getLogger(__name__)

# How a server without vLLM's /health or /v1/models answers for them: only chat completions
# are needed from an external OpenAI-compatible server.
ENDPOINT_ABSENT = (404, 405)
PROBE_SECONDS = 5.0
PROBE_TIMEOUT = httpx.Timeout(PROBE_SECONDS, connect=2.0)

# Sample names (with the counters' `_total`), old vLLM spellings second.
_GAUGES = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
_COUNTERS = {
    "preemptions_total": ("vllm:num_preemptions_total", "vllm:num_preemptions"),
    "generation_tokens_total": ("vllm:generation_tokens_total", "vllm:generation_tokens"),
    "finished_total": ("vllm:request_success_total",),
}


def bearer_header(api_key: str | None) -> dict[str, str]:
    """The `Authorization` header that carries `api_key` (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass(frozen=True)
class ServerMetrics:
    """One scrape of the server's `/metrics` (None: the server does not export it)."""

    taken_at: float  # monotonic seconds
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None  # 0..1
    preemptions_total: float | None = None
    generation_tokens_total: float | None = None
    finished_total: float | None = None  # requests finished (any reason)

    @property
    def in_flight(self) -> float | None:
        """Requests running plus waiting; None when the server reports neither."""
        if self.running is None and self.waiting is None:
            return None
        return (self.running or 0.0) + (self.waiting or 0.0)


def parse_metrics(text: str, taken_at: float) -> ServerMetrics:
    """vLLM's samples over their labels (one model, maybe several engines): counts add up;
    a KV cache usage is the fullest engine's (a share, and one full cache preempts)."""
    samples: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(float(sample.value))
    values: dict[str, float | None] = {}
    for field, names in (_GAUGES | _COUNTERS).items():
        combine = max if field == "kv_cache_usage" else sum
        values[field] = next((combine(samples[n]) for n in names if n in samples), None)
    return ServerMetrics(taken_at=taken_at, **values)


def served_model_fix(config: Config, served: list[str]) -> str:
    """What to set when an external server serves the model under another name than the one
    ocrvl asks for: the model it recognises among `served`, or the general way out."""
    for name in served:
        known = next((m for m in MODELS.values() if name in (m.name, m.hf_repo)), None)
        if known is None:
            continue
        if known.name == config.model.name:
            return f"set model.served_name: {name} (the name this server gives {known.name})"
        return (f"this server serves {known.name}: set model.name: {known.name}"
                + ("" if name == known.name else f" and model.served_name: {name}"))
    named = served[0] if len(served) == 1 else "the name it serves the model under"
    return (f"start that server with --served-model-name {config.model.served}, or set "
            f"model.served_name: {named} if that is {config.model.name}")


class ServerProbe:
    """HTTP checks against the server root of `config` (health, served models, metrics).

    One client per probe and per thread: httpx does not promise a client is thread-safe.
    """

    def __init__(self, config: Config, timeout: float | httpx.Timeout = PROBE_TIMEOUT) -> None:
        server = config.server
        # A managed server is local: proxies from the environment must not get in between.
        self._client = httpx.Client(base_url=server.root_url,
                                    headers=bearer_header(server.api_key),
                                    timeout=timeout, trust_env=server.mode == "external")
        self.root = server.root_url
        self.url = server.base_url
        self.config = config
        self.model = config.model.served
        self.external = server.mode == "external"
        self.last_error = ""
        self.metrics_status: int | None = None  # /metrics' last HTTP status (None: no answer)
        self._unlisted = False  # /v1/models is missing: warned once

    def close(self) -> None:
        """Close the connections."""
        self._client.close()

    def health(self) -> int | None:
        """`/health`'s status code; None if nothing answered."""
        try:
            return self._client.get("/health").status_code
        except httpx.HTTPError as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            return None

    def serves_model(self) -> bool:
        """Whether `/v1/models` lists the served name; another name is a ServerConfigError."""
        try:
            response = self._client.get("/v1/models")
        except httpx.HTTPError as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            return False
        if response.status_code == 401:
            raise ServerConfigError(
                f"The server at {self.url} rejected ocrvl's API key (HTTP 401).",
                "set server.api_key to the key the server expects")
        if response.status_code in ENDPOINT_ABSENT and self.external:
            # An OpenAI-compatible server that does not list its models: requests tell.
            if not self._unlisted:
                log.warning("%s/models answered %d: cannot check that it serves %s; "
                            "assuming it does", self.url, response.status_code, self.model)
                self._unlisted = True
            return True
        if response.status_code != 200:
            self.last_error = f"/v1/models answered {response.status_code}"
            return False
        try:
            served = [str(m["id"]) for m in response.json()["data"]]
        except (ValueError, KeyError, TypeError) as exc:
            self.last_error = f"/v1/models answered something unexpected: {exc}"
            return False
        if self.model in served:
            return True
        fix = (served_model_fix(self.config, served) if self.external else
               f"the server must be started with --served-model-name {self.model}: pass "
               "'{model}' in server.command")
        raise ServerConfigError(f"The server at {self.url} serves {', '.join(served) or 'no model'}"
                                f", but ocrvl asks for {self.model}.", fix)

    def metrics(self, taken_at: float) -> ServerMetrics | None:
        """One scrape of `/metrics`, stamped `taken_at`; None when there is none to read
        (`metrics_status` then tells an absent endpoint from a failed request)."""
        self.metrics_status = None
        try:
            response = self._client.get("/metrics")
        except httpx.HTTPError as exc:
            log.debug("no metrics from %s: %s", self.root, exc)
            return None
        self.metrics_status = response.status_code
        if response.status_code != 200:
            return None
        try:
            return parse_metrics(response.text, taken_at)
        except ValueError as exc:
            log.debug("unreadable metrics from %s: %s", self.root, exc)
            return None


PAGE_PROBE_SECONDS = 20.0  # one token from a server that may be busy with a book
# HTTP 4xx statuses that are no refusal of the request itself: a key, a busy server.
NOT_A_REFUSAL = LATER_STATUSES | {401, 403}


def page_probe_body(model: str) -> dict[str, object]:
    """The smallest page request shaped as PaddleX sends one: a white 28x28 image (one vision
    token), the OCR task, one token back, and PaddleX's image-size bounds."""
    from PIL import Image  # only doctor asks (ocrvl's worker images come from PaddleX)

    png = io.BytesIO()
    Image.new("RGB", (28, 28), "white").save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    return {"model": model, "temperature": 0.0, "max_completion_tokens": 1,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "OCR:"}]}],
            "mm_processor_kwargs": {"min_pixels": MIN_IMAGE_PIXELS,
                                    "max_pixels": MAX_IMAGE_PIXELS}}  # fmt: skip


def page_refusal(config: Config) -> str | None:
    """The server's words when it refuses a page request as PaddleX sends one (HTTP 4xx:
    the request itself is what it will not take), else None: answered, or busy, failing or
    out of reach, which the other probes speak of."""
    server = config.server
    try:
        reply = httpx.post(f"{server.base_url}/chat/completions",
                           json=page_probe_body(config.model.served),
                           headers=bearer_header(server.api_key),
                           timeout=httpx.Timeout(PAGE_PROBE_SECONDS, connect=2.0))
    except httpx.HTTPError:
        return None
    if not 400 <= reply.status_code < 500 or reply.status_code in NOT_A_REFUSAL:
        return None
    return f"HTTP {reply.status_code}: {error_message(reply.content)}"

"""The model server: launch, wait out the start-up, health-check, restart with backoff, stop.

`ServerSupervisor` runs on its own thread. In `managed` mode it owns one vLLM (or
compatible) process group at a time; in `external` mode it only watches `server.url`.
Work may be dispatched only while `is_ready()`.

Failure handling, in order of how final it is:
* configuration errors (wrong model name, missing program or package) -> `FAILED`, with a
  `ServerConfigError` naming the fix; retrying could not help;
* out of GPU memory (at start or at run time) -> lower the `auto` vLLM settings one step
  and start again at once; once a lowered start succeeds it is remembered for the next one.
  When nothing ocrvl may change is left, the error names the config lines to change;
* everything else (a crash, 503, failed probes, a hang, a start-up that fails or times
  out) -> stop the whole group, wait out an exponential backoff, start again, forever.

The `auto` settings are planned at every launch, from the GPU as it is then (the old
process group is gone by then, so its memory does not count as other programs').
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import errno
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any, Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ocrvl_daemon import autotune, launchers
from ocrvl_daemon.config import Config
from ocrvl_daemon.errors import ServerConfigError
from ocrvl_daemon.gpu import GpuReading, read_gpu
from ocrvl_daemon.models import MODELS
from ocrvl_daemon.process_group import ProcessGroup, kill_leftover

log = logging.getLogger(__name__)
server_log = log.getChild("vllm")  # the server's own output, line by line

PIDFILE_NAME = "server.pid"
TAIL_LINES = 200  # kept in memory
REPORT_LINES = 30  # shown when a crash loop is reported
CRASH_LOOP_FAILURES = 3
CRASH_LOOP_WINDOW = 600.0
UNHEALTHY_PROBES = 3  # consecutive failed /health probes that mean "down"
# How a server without vLLM's /health or /v1/models answers for them: only chat completions
# are needed from an external OpenAI-compatible server.
ENDPOINT_ABSENT = (404, 405)
STARTUP_POLL = 1.0  # upper bound on the probe interval while starting
PROBE_SECONDS = 5.0
PROBE_TIMEOUT = httpx.Timeout(PROBE_SECONDS, connect=2.0)


class ServerState(enum.Enum):
    """Where the server is in its life."""

    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"


# --- diagnosis ---------------------------------------------------------------------------

DiagnosisKind = Literal["max_len", "no_kv_memory", "free_memory", "cuda_oom", "port_in_use",
                        "missing_package", "model_mismatch"]


@dataclass(frozen=True)
class Diagnosis:
    """The likely cause of a server failure and its fix."""

    kind: DiagnosisKind
    cause: str
    fix: str
    permanent: bool = False  # restarting cannot help; needs the user
    limit: int | None = None  # max_len: the longest max-model-len vLLM says would fit

    def __str__(self) -> str:
        return f"{self.cause}; fix: {self.fix}"


_SETUP = "run `ocrvl setup-server`, or set server.python to a Python that has it"
_MAX_LEN = re.compile(r"estimated maximum model length is (\d+)")
# (pattern, kind, cause, fix, permanent); the first match wins, most specific first.
_RULES: tuple[tuple[re.Pattern[str], DiagnosisKind, str, str, bool], ...] = (
    (re.compile(r"No available memory for the cache blocks"), "no_kv_memory",
     "out of memory (no room left for the KV cache)",
     "the weights and the start-up peak fill gpu-memory-utilization x VRAM: raise "
     "server.vllm_args.gpu-memory-utilization if nothing else uses the GPU, else lower "
     "max-num-seqs or max-num-batched-tokens", False),
    (re.compile(r"Free memory on device .* less than desired", re.S), "free_memory",
     "out of memory (other programs hold GPU memory)",
     "lower server.vllm_args.gpu-memory-utilization, or close the programs using the GPU "
     "(see nvidia-smi)", False),
    (re.compile(r"CUDA out of memory|OutOfMemoryError"), "cuda_oom", "out of memory",
     "lower server.vllm_args.gpu-memory-utilization, max-num-seqs or max-model-len, or free "
     "GPU memory (see nvidia-smi)", False),
    (re.compile(r"address already in use", re.I), "port_in_use", "port already in use",
     "set server.port to a free port, or stop the program using it (ss -ltnp)", False),
    (re.compile(r"No module named '?(flash_attn|xformers)"), "missing_package",
     "flash-attn or xformers is missing from the server environment",
     "run `ocrvl setup-server`, or use server.launcher: vllm", True),
    (re.compile(r"No module named '?vllm\b|vllm: (command )?not found|command not found"),
     "missing_package", "vLLM is not installed in the server environment", _SETUP, True),
    (re.compile(r"The model `[^`]*` does not exist"), "model_mismatch",
     "the server serves another model name",
     "make the server serve model.served_name, or model.name when that is unset (vLLM: "
     "--served-model-name)", True),
)


def diagnose(text: str) -> Diagnosis | None:
    """The likely cause of a failure, from the server's last log lines (pure)."""
    match = _MAX_LEN.search(text)
    if match:
        limit = int(match.group(1))
        return Diagnosis("max_len", "max-model-len is too large for the free GPU memory",
                         f"set server.vllm_args.max-model-len to at most {limit} (or lower "
                         "model.max_new_tokens), or raise gpu-memory-utilization",
                         limit=limit)
    for pattern, kind, cause, fix, permanent in _RULES:
        if pattern.search(text):
            return Diagnosis(kind, cause, fix, permanent)
    return None


# --- start-up phases -----------------------------------------------------------------------

_KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_PHASES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Starting to load model|Loading safetensors checkpoint"),
     "loading weights"),
    (re.compile(r"Model loading took|Loading weights took|Memory profiling takes"),
     "profiling memory"),
    (re.compile(r"torch\.compile|Compiling a graph"), "compiling the model"),
    (re.compile(r"Available KV cache memory"), "allocating KV cache"),
    (re.compile(r"Capturing CUDA graphs|Capturing cudagraphs"), "capturing CUDA graphs"),
    (re.compile(r"Graph capturing finished|init engine .* took|Starting vLLM API server|"
                r"Waiting for application startup"), "starting API server"),
)


def parse_phase(line: str) -> str | None:
    """The start-up phase a vLLM log line announces, if any."""
    match = _KV_TOKENS.search(line)
    if match:
        return f"allocating KV cache ({match.group(1)} tokens)"
    for pattern, phase in _PHASES:
        if pattern.search(line):
            return phase
    return None


# --- policies ------------------------------------------------------------------------------


@dataclass
class BackoffPolicy:
    """Exponential restart delay: `initial`, doubling, capped; reset once stable."""

    initial: float = 2.0
    factor: float = 2.0
    cap: float = 300.0
    reset_after: float = 120.0  # seconds of readiness that count as "stable again"
    failures: int = field(default=0, init=False)

    def next_delay(self) -> float:
        """The delay before the next restart; each call counts one more failure."""
        delay = min(self.cap, self.initial * self.factor**self.failures)
        self.failures += 1
        return delay

    def reset(self) -> None:
        """The server proved stable: start again from `initial`."""
        self.failures = 0


class StallDetector:
    """Requests in flight but none finishing for `timeout` seconds means hung.

    vLLM's `/health` keeps answering 200 while its engine is stuck; only the completion
    count tells.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.in_flight = 0
        self._completed: float | None = None
        self._since = 0.0

    def observe(self, in_flight: float, completed: float, now: float) -> None:
        """Record a reading; progress, idleness or new work after idleness restart the clock."""
        if in_flight <= 0 or self.in_flight <= 0 or completed != self._completed:
            self._since = now
        self.in_flight = int(in_flight)
        self._completed = completed

    def stalled(self, now: float) -> bool:
        """Whether requests have been in flight without a completion for `timeout`."""
        return self.in_flight > 0 and now - self._since >= self.timeout


# --- status --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerStatus:
    """A snapshot for `ocrvl status`, systemd's STATUS= and the logs."""

    state: ServerState
    phase: str
    pid: int | None
    attempt: int  # launches since the server was last stable (1 = first try)
    restart_count: int
    last_error: str | None
    diagnosis: Diagnosis | None
    url: str
    ready_since: float | None  # time.time() when it became ready

    def describe(self) -> str:
        """One line such as `server restarting (attempt 3, out of memory?)`."""
        if self.state is ServerState.READY:
            return f"server ready at {self.url}"
        if self.state is ServerState.STARTING:
            tries = f", attempt {self.attempt}" if self.attempt > 1 else ""
            return f"server starting ({self.phase}{tries})"
        if self.state is ServerState.RESTARTING:
            cause = f", {self.diagnosis.cause}?" if self.diagnosis else ""
            return f"server restarting (attempt {self.attempt + 1}{cause})"
        if self.state is ServerState.FAILED:
            return f"server failed: {self.last_error}"
        return "server stopped"


# --- the server's output -------------------------------------------------------------------

_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING,
           "ERROR": logging.ERROR, "CRITICAL": logging.CRITICAL}
_LEVEL = re.compile(r"^(?:\(\w+ pid=\d+\)\s+)?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
_ACCESS = re.compile(r'"(GET|POST|HEAD) \S+ HTTP/[\d.]+" \d{3}')


class _LogPump(threading.Thread):
    """Reads the server's merged output line by line into the log and a tail buffer.

    Reading continuously means the server never blocks on a full pipe.
    """

    def __init__(self, stream: IO[bytes], on_line: Callable[[str], None]) -> None:
        super().__init__(name="ocrvl-server-log", daemon=True)
        self._stream = stream
        self._on_line = on_line
        self._lines: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._lock = threading.Lock()

    def run(self) -> None:
        try:
            for raw in iter(self._stream.readline, b""):
                # Progress bars redraw with \r: each redraw is a line of its own.
                for part in raw.decode("utf-8", "replace").split("\r"):
                    line = part.rstrip()
                    if line:
                        self._emit(line)
        finally:
            self._stream.close()

    def _emit(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)
        match = _LEVEL.match(line)
        level = _LEVELS[match.group(1)] if match else logging.INFO
        if _ACCESS.search(line):
            level = logging.DEBUG  # one per health probe and per page: noise in the journal
        server_log.log(level, "%s", line)
        self._on_line(line)

    def tail(self, n: int) -> list[str]:
        """The last `n` lines."""
        with self._lock:
            return list(self._lines)[-n:]


# --- probes --------------------------------------------------------------------------------


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


class _Probe:
    """HTTP checks against the server root (health, served models, metrics)."""

    def __init__(self, config: Config) -> None:
        server = config.server
        headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
        # A managed server is local: proxies from the environment must not get in between.
        self._client = httpx.Client(base_url=server.root_url, headers=headers,
                                    timeout=PROBE_TIMEOUT, trust_env=server.mode == "external")
        self.url = server.base_url
        self.config = config
        self.model = config.model.served
        self.external = server.mode == "external"
        self.last_error = ""
        self._unlisted = False  # /v1/models is missing: warned once

    def close(self) -> None:
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

    def metrics(self) -> tuple[float, float] | None:
        """(requests running + waiting, requests finished) from `/metrics`, if it has them."""
        try:
            response = self._client.get("/metrics")
            if response.status_code != 200:
                return None
            families = list(text_string_to_metric_families(response.text))
        except (httpx.HTTPError, ValueError):
            return None
        in_flight = finished = 0.0
        found = False
        for family in families:
            for sample in family.samples:
                if sample.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                    in_flight += sample.value
                    found = True
                elif sample.name == "vllm:request_success_total":
                    finished += sample.value
        return (in_flight, finished) if found else None


def port_in_use(host: str, port: int) -> bool:
    """Whether another program listens on host:port (checked before each launch)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            sock.bind((host, port))
    except OSError as exc:
        return exc.errno == errno.EADDRINUSE
    return False


# --- the supervisor ------------------------------------------------------------------------


class _Stopping(Exception):
    """stop() was called; unwind to the thread's cleanup."""


class ServerSupervisor:
    """Starts the model server and keeps it ready; see the module docstring.

    `on_change(status)` is called (from the supervisor's threads) on every change of state
    or phase, and at least every second while the server starts, so a systemd layer can
    send STATUS= and EXTEND_TIMEOUT_USEC. It must not block.
    """

    def __init__(self, config: Config, on_change: Callable[[ServerStatus], None] | None = None,
                 backoff: BackoffPolicy | None = None) -> None:
        self.config = config
        self._server = config.server
        self._on_change = on_change
        self._backoff = backoff or BackoffPolicy(
            initial=self._server.restart_backoff_initial, cap=self._server.restart_backoff_max)
        self._pidfile = config.state_dir / PIDFILE_NAME
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._group: ProcessGroup | None = None
        self._pump: _LogPump | None = None
        self._failures: collections.deque[float] = collections.deque()
        self._metrics_stall = StallDetector(self._server.stall_timeout)
        self._client_stall = StallDetector(self._server.stall_timeout)
        self._error: ServerConfigError | None = None
        # vLLM flags of the current (or last) launch and the GPU they were planned for
        self._args: dict[str, Any] = {}
        self._gpu: GpuReading | None = None
        # flags an out-of-memory step lowered, until a start with them succeeds
        self._lowered: dict[str, Any] | None = None
        # what status() reports
        self._state = ServerState.STOPPED
        self._phase = ""
        self._attempt = 0
        self._restart_count = 0
        self._last_error: str | None = None
        self._diagnosis: Diagnosis | None = None
        self._ready_at: float | None = None  # monotonic
        self._ready_since: float | None = None  # wall clock

    # public interface

    def start(self) -> None:
        """Start supervising on a background thread (returns at once; no-op if running)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping.clear()
        self._error = None
        self._thread = threading.Thread(target=self._main, name="ocrvl-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the server (whole process group) and the supervisor; bounded and idempotent."""
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        # An in-flight probe, the polite wait and the SIGKILL wait bound the join.
        thread.join(self._server.stop_timeout + 2 * PROBE_SECONDS + 10)
        if thread.is_alive():
            log.error("the server supervisor did not stop in time; the server may still run")

    def kill(self) -> None:
        """A forced stop: SIGKILL the server's whole process group now and reap it."""
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
            group = self._group
        if group is not None:
            group.kill()

    def __enter__(self) -> ServerSupervisor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def state(self) -> ServerState:
        """The current state."""
        return self._state

    @property
    def phase(self) -> str:
        """What the server is doing while it starts, e.g. "capturing CUDA graphs"."""
        return self._phase

    @property
    def diagnosis(self) -> Diagnosis | None:
        """The likely cause of the last failure."""
        return self._diagnosis

    @property
    def attempt(self) -> int:
        """Launches since the server was last stable."""
        return self._attempt

    @property
    def restart_count(self) -> int:
        """Restarts since start()."""
        return self._restart_count

    @property
    def vllm_args(self) -> dict[str, Any]:
        """The vLLM flags of the current (or last) launch, `auto` values resolved."""
        return dict(self._args)

    @property
    def error(self) -> ServerConfigError | None:
        """The configuration error that put the supervisor in FAILED, if any."""
        return self._error

    def is_ready(self) -> bool:
        """Whether work may be sent to the server now."""
        return self._state is ServerState.READY

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until READY (True), FAILED or stopped (False), or `timeout` (False)."""
        with self._cond:
            self._cond.wait_for(lambda: self._state in (ServerState.READY, ServerState.FAILED)
                                or self._stopping.is_set() or self._thread is None, timeout)
            return self._state is ServerState.READY

    def raise_for_failure(self) -> None:
        """Raise the ServerConfigError that made the supervisor give up, if any."""
        if self._error is not None:
            raise self._error

    def status(self) -> ServerStatus:
        """A consistent snapshot."""
        with self._cond:
            return ServerStatus(
                self._state, self._phase, self._group.pid if self._group else None,
                self._attempt, self._restart_count, self._last_error, self._diagnosis,
                self._server.base_url, self._ready_since)

    def log_tail(self, n: int = REPORT_LINES) -> list[str]:
        """The server's last `n` output lines (of the current or last process)."""
        return self._pump.tail(n) if self._pump is not None else []

    def note_progress(self, in_flight: int, completed_total: int) -> None:
        """Client-side progress, for servers without `/metrics`: requests the client has in
        flight and how many it has seen finish so far (any monotonic count)."""
        with self._cond:
            self._client_stall.observe(in_flight, completed_total, time.monotonic())

    # state changes

    def _set(self, state: ServerState | None = None, phase: str | None = None,
             tick: bool = False) -> None:
        """Update state/phase; wake waiters; tell `on_change` about changes (or ticks)."""
        with self._cond:
            changed = (state is not None and state is not self._state) or (
                phase is not None and phase != self._phase)
            if state is not None:
                self._state = state
            if phase is not None:
                self._phase = phase
            self._cond.notify_all()
        if (changed or tick) and self._on_change is not None:
            try:
                self._on_change(self.status())
            except Exception:  # a broken observer must not take the server down
                log.exception("server status callback failed")

    def _wait(self, seconds: float) -> None:
        if self._stopping.wait(seconds):
            raise _Stopping

    # the thread

    def _main(self) -> None:
        probe = _Probe(self.config)
        try:
            if self._server.mode == "external":
                self._watch_external(probe)
            else:
                self._supervise(probe)
        except _Stopping:
            pass
        except ServerConfigError as exc:
            self._error = exc
            with self._cond:
                self._last_error = str(exc)
            log.error("%s", exc)
            self._set(ServerState.FAILED, "")
        except Exception:
            log.exception("the server supervisor crashed")
            with self._cond:
                self._last_error = "the server supervisor crashed (see the log)"
            self._set(ServerState.FAILED, "")
        finally:
            self._stop_group()
            probe.close()
            if self._state is not ServerState.FAILED:
                self._set(ServerState.STOPPED, "")

    def _supervise(self, probe: _Probe) -> None:
        self._set(ServerState.STARTING, "preparing")
        kill_leftover(self._pidfile, self._server.stop_timeout)
        launchers.check_launcher(self.config)
        while True:
            failure = self._run_once(probe)
            self._stop_group()
            self._restart_after(failure)

    def _run_once(self, probe: _Probe) -> str:
        """Launch, wait until ready, watch; return why it failed."""
        host, port = self._server.host, self._server.port
        with self._cond:
            self._attempt += 1
            self._pump = None  # a tail from the previous process would mislead the diagnosis
            self._metrics_stall = StallDetector(self._server.stall_timeout)
            self._client_stall = StallDetector(self._server.stall_timeout)
        if port_in_use(host, port):
            return f"port {port} on {host} is taken by another program: address already in use"
        self._plan_args()
        spec = launchers.prepare_launch(self.config, self._args)
        try:
            group = ProcessGroup.spawn(spec.argv, spec.env, self._pidfile)
        except OSError as exc:
            raise ServerConfigError(f"Cannot start the server {spec.argv[0]!r}: {exc}.",
                                    launchers.SETUP_FIX) from exc
        pump = _LogPump(group.stdout, self._on_line)
        with self._cond:
            self._group, self._pump = group, pump
        pump.start()
        self._set(ServerState.STARTING, "launching")
        failure = self._wait_started(probe, group)
        if failure is not None:
            return failure
        with self._cond:
            self._ready_at, self._ready_since = time.monotonic(), time.time()
        log.info("server ready at %s (pid %d)", self._server.base_url, group.pid)
        self._set(ServerState.READY, "ready")
        if self._lowered is not None:
            self._remember_lowered()
        return self._watch(probe, group)

    def _plan_args(self) -> None:
        """Choose the `auto` flags for this launch from the GPU as it is now."""
        # The server's environment decides which GPU it sees (CUDA_VISIBLE_DEVICES).
        self._gpu = read_gpu(launchers.server_env(self.config))
        remembered = self._lowered or autotune.load_remembered(
            self.config.state_dir, self._gpu, self.config.model.name)
        tuned = launchers.resolve_vllm_args(self.config, self._gpu, remembered)
        self._args = tuned.values
        log.info("vLLM settings: %s", ", ".join(
            f"{k} {tuned.values[k]}" for k in autotune.TUNED_KEYS
            if tuned.values.get(k) is not None))
        for reason in tuned.reasons:
            log.info("  %s", reason)
        for warning in tuned.warnings:
            log.warning("%s", warning)

    def _remember_lowered(self) -> None:
        """The lowered flags got the server going: the next start uses them at once."""
        path = self.config.state_dir / autotune.TUNING_FILE
        try:
            autotune.save_remembered(self.config.state_dir, self._gpu, self.config.model.name,
                                     self._args)
        except OSError as exc:
            log.warning("could not remember the lowered vLLM settings in %s: %s", path, exc)
        else:
            log.info("remembered %s in %s: the next start uses them at once", ", ".join(
                f"{k} {self._args[k]}" for k in autotune.TUNED_KEYS if k in self._args), path)
        self._lowered = None

    def _step_down_after_oom(self, text: str) -> bool:
        """Lower the `auto` flags one step for the next launch; False if nothing is left."""
        lowered = autotune.next_after_oom(self._args, self.config, text)
        if lowered is None:
            return False
        changes = ", ".join(f"{k} {self._args.get(k)} -> {lowered[k]}"
                            for k in autotune.TUNED_KEYS if lowered.get(k) != self._args.get(k))
        log.warning("the server ran out of GPU memory (%s); lowering %s and starting again now",
                    autotune.oom_cause(text), changes)
        self._lowered = lowered
        return True

    def _on_line(self, line: str) -> None:
        phase = parse_phase(line)
        if phase is not None and self._state is ServerState.STARTING and phase != self._phase:
            log.info("server starting: %s", phase)
            self._set(phase=phase)

    def _wait_started(self, probe: _Probe, group: ProcessGroup) -> str | None:
        """None once ready; else why start-up failed."""
        timeout = self._server.startup_timeout
        deadline = time.monotonic() + timeout
        interval = min(STARTUP_POLL, self._server.health_interval)
        while True:
            code = group.poll()
            if code is not None:
                return f"exited with status {code} while starting"
            # The port refuses connections until vLLM is ready: failures here are expected.
            if probe.health() == 200 and probe.serves_model():
                return None
            if time.monotonic() >= deadline:
                return (f"not ready {timeout:g}s after launch (last phase: {self._phase}); "
                        "raise server.startup_timeout if it was still making progress")
            self._set(tick=True)
            self._wait(interval)

    def _watch(self, probe: _Probe, group: ProcessGroup) -> str:
        """Health-check a ready server; return why it is no longer healthy."""
        failed_probes = 0
        while True:
            self._wait(self._server.health_interval)
            code = group.poll()
            if code is not None:
                # Status 0 too: vLLM's API server exits 0 after its engine died.
                return f"exited with status {code}"
            status = probe.health()
            if status == 503:
                return "/health answered 503 (the engine died)"
            if status != 200:
                failed_probes += 1
                detail = probe.last_error if status is None else f"HTTP {status}"
                log.warning("server health probe failed (%d/%d): %s", failed_probes,
                            UNHEALTHY_PROBES, detail)
                if failed_probes >= UNHEALTHY_PROBES:
                    return f"/health failed {failed_probes} times in a row ({detail})"
                continue
            failed_probes = 0
            self._note_stable()
            hung = self._check_stall(probe)
            if hung:
                return hung

    def _note_stable(self) -> None:
        ready_at = self._ready_at
        if (self._attempt and ready_at is not None
                and time.monotonic() - ready_at >= self._backoff.reset_after):
            self._backoff.reset()
            with self._cond:
                self._attempt = 0

    def _check_stall(self, probe: _Probe) -> str | None:
        reading = probe.metrics()
        now = time.monotonic()
        with self._cond:
            if reading is not None:
                self._metrics_stall.observe(*reading, now)
            for source, detector in (("/metrics", self._metrics_stall),
                                     ("ocrvl's requests", self._client_stall)):
                if detector.stalled(now):
                    return (f"hung: {detector.in_flight} request(s) in flight but none finished "
                            f"for {self._server.stall_timeout:g}s (by {source})")
        return None

    def _restart_after(self, failure: str) -> None:
        """Record a failure, report it, wait out the backoff (or raise if permanent)."""
        tail = self.log_tail(REPORT_LINES)
        text = "\n".join([*tail, failure])
        diagnosis = diagnose(text)
        if diagnosis is not None and diagnosis.permanent:
            raise ServerConfigError(f"The server failed: {failure} ({diagnosis.cause}).",
                                    diagnosis.fix)
        oom = autotune.is_oom(text)
        stepped = oom and self._step_down_after_oom(text)
        error = failure
        if oom and not stepped:
            # Nothing ocrvl may lower is left: the user's fix is the exact settings to change.
            advice = autotune.suggestion(self._args, self.config, text)
            error = f"{failure}: {advice}"
            diagnosis = (dataclasses.replace(diagnosis, fix=advice) if diagnosis is not None
                         else Diagnosis("cuda_oom", "out of memory", advice))
        if stepped:
            delay = 0.0  # a new setting deserves an immediate try (and is not a crash loop)
        else:
            now = time.monotonic()
            self._failures.append(now)
            while self._failures and now - self._failures[0] > CRASH_LOOP_WINDOW:
                self._failures.popleft()
            delay = self._backoff.next_delay()
        with self._cond:
            self._last_error, self._diagnosis = error, diagnosis
            self._restart_count += 1
            self._ready_at = self._ready_since = None
        cause = f"; likely cause: {diagnosis}" if diagnosis else ""
        if len(self._failures) >= CRASH_LOOP_FAILURES and not stepped:
            log.error("the server keeps failing (%d times in %.0f minutes): %s%s; retrying in "
                      "%.1fs.\nIts last %d lines:\n%s", len(self._failures), CRASH_LOOP_WINDOW / 60,
                      failure, cause, delay, len(tail), "\n".join(tail))
        elif not stepped:
            log.log(logging.ERROR if oom else logging.WARNING,
                    "server failed: %s%s; restarting in %.1fs", failure, cause, delay)
        self._set(ServerState.RESTARTING, f"restarting in {delay:.1f}s")
        self._wait(delay)

    def _stop_group(self) -> None:
        """Stop the current group and make sure none of it is left before going on."""
        group = self._group
        if group is None:
            return
        if not group.stop(self._server.stop_timeout):
            # Two servers must never compete for VRAM: wait until the kernel lets go.
            while group.alive() and not self._stopping.wait(1.0):
                pass
        if self._pump is not None:
            self._pump.join(2.0)  # drain the last lines for the diagnosis
        with self._cond:
            self._group = None

    def _refused(self, exc: ServerConfigError) -> None:
        """External mode: the server answers but cannot serve this configuration (another
        model name, another API key). FAILED, said once; probing goes on, so fixing the
        server is enough (ocrvl need not be restarted)."""
        with self._cond:
            repeated = self._error is not None and str(self._error) == str(exc)
            self._error = exc
            self._last_error = str(exc)
        if not repeated:
            log.error("%s (checking again every %g s)", exc, self._server.health_interval)
        self._set(ServerState.FAILED, "")

    def _watch_external(self, probe: _Probe) -> None:
        """External mode: no process, readiness and health by probing `server.url`."""
        failed_probes = 0
        stall_reported = False
        self._set(ServerState.STARTING, f"waiting for {self._server.base_url}")
        while True:
            ready = self._state is ServerState.READY
            self._wait(self._server.health_interval if ready or self._error else
                       min(STARTUP_POLL, self._server.health_interval))
            status = probe.health()
            try:
                # Not every OpenAI-compatible server has vLLM's /health: /v1/models decides.
                up = (status == 200 and (ready or probe.serves_model())) or (
                    status in ENDPOINT_ABSENT and probe.serves_model())
            except ServerConfigError as exc:
                self._refused(exc)
                continue
            if up:
                failed_probes = 0
                if not ready:
                    with self._cond:
                        self._ready_since = time.time()
                        self._error = None
                    log.info("external server ready at %s", self._server.base_url)
                    self._set(ServerState.READY, "ready")
                hung = self._check_stall(probe)
                if hung and not stall_reported:
                    log.error("external server at %s is %s; ocrvl cannot restart it: restart "
                              "it yourself", self._server.base_url, hung)
                stall_reported = bool(hung)
                continue
            failed_probes += 1
            if ready and (status == 503 or failed_probes >= UNHEALTHY_PROBES):
                with self._cond:
                    self._last_error = (f"/health answered {status}" if status else
                                        probe.last_error)
                log.warning("external server at %s is down (%s); waiting for it",
                            self._server.base_url, self._last_error)
                self._set(ServerState.STARTING, f"waiting for {self._server.base_url}")


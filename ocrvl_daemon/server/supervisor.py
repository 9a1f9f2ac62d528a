"""The model server as the daemon sees it: its state, a status snapshot, and the supervisor.

Two supervisors build on it: `managed.ManagedServer` launches and restarts a vLLM (or
compatible) process group, `external.ExternalServer` only watches `server.url`
(`replicas.ServerSet` picks them as `server.mode` asks). Both run on their own thread and
share what this module defines: the state machine, `status()`, readiness waits, hang
detection and the one `/metrics` scrape that feeds both hang detection and the converter's
concurrency search. Work may be dispatched only while `is_ready()`.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.errors import ServerError
from ocrvl_daemon.server.metrics_poller import DEFAULT_INTERVAL, FETCH_TIMEOUT, MetricsPoller
from ocrvl_daemon.server.probe import PROBE_SECONDS, ServerMetrics, ServerProbe
from ocrvl_daemon.server.vllm_diagnosis import Diagnosis

log = logging.getLogger(__name__)

UNHEALTHY_PROBES = 3  # consecutive failed /health probes that mean "down"
STARTUP_POLL = 1.0  # upper bound on the probe interval while starting


class ServerState(enum.Enum):
    """Where the server is in its life."""

    STOPPED = "stopped"
    STARTING = "starting"
    UNREACHABLE = "unreachable"  # an external server that does not answer (ocrvl starts none)
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"


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
    # Where it runs, when that is another machine (a cluster's engine host): its node and GPU.
    node: str | None = None
    gpu: str | None = None


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


class _Stopping(Exception):
    """stop() was called; unwind to the supervisor thread's cleanup."""


class ServerSupervisor:
    """Keeps the server ready on a background thread; subclasses say how (`_keep`).

    `on_change(status)` is called (from start() and the supervisor's threads) on every
    change of state or phase, and at least every second while the server starts, so a
    systemd layer can send STATUS= and EXTEND_TIMEOUT_USEC. It must not block.
    """

    def __init__(self, config: Config,
                 on_change: Callable[[ServerStatus], None] | None = None,
                 name: str = "server") -> None:
        self.config = config
        # Short, for logs and status: "server" when it is the only one, else e.g. "gpu0/1"
        # (GPU 0's first replica) or "host:port" (an external endpoint).
        self.name = name
        self._server = config.server
        self._on_change = on_change
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        # The one /metrics scrape for hang detection and the converter's concurrency search;
        # replaced only by start(), before the thread that reads it runs.
        self._metrics: MetricsPoller | None = None
        # _cond protects what status() reports (_state ... _diagnosis), the stall detectors
        # and _error; waiters on it are woken at every change of state.
        self._cond = threading.Condition()
        self._error: ServerError | None = None
        self._metrics_stall = StallDetector(self._server.stall_timeout)
        self._client_stall = StallDetector(self._server.stall_timeout)
        self._state = ServerState.STOPPED
        self._phase = ""
        self._attempt = 0
        self._restart_count = 0
        self._last_error: str | None = None
        self._diagnosis: Diagnosis | None = None
        self._ready_at: float | None = None  # monotonic

    # public interface

    def start(self) -> None:
        """Start supervising on a background thread; STARTING (an external server:
        UNREACHABLE) when this returns (no-op if running)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping.clear()
        with self._cond:
            self._error = None
        self._metrics = MetricsPoller(
            ServerProbe(self.config, FETCH_TIMEOUT),
            interval=min(DEFAULT_INTERVAL, self._server.health_interval))
        self._set(self._waiting_state, self._first_phase())
        self._thread = threading.Thread(target=self._main, name="ocrvl-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the server (if ocrvl runs it) and the supervisor; bounded and idempotent."""
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
        if self._metrics is not None:
            self._metrics.close()

    def kill(self) -> None:
        """A forced stop: supervision ends now (a managed server's group is SIGKILLed)."""
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()

    def __enter__(self) -> ServerSupervisor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The server's OpenAI base URL (ending in /v1)."""
        return self._server.base_url

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
    def error(self) -> ServerError | None:
        """The error that put the supervisor in FAILED, if any: a configuration it cannot
        serve, or (where the backoff gives up) the last of too many failures in a row."""
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

    def status(self) -> ServerStatus:
        """A consistent snapshot."""
        with self._cond:
            return ServerStatus(
                self._state, self._phase, self._pid(), self._attempt, self._restart_count,
                self._last_error, self._diagnosis, self._server.base_url)

    def note_progress(self, in_flight: int, completed_total: int) -> None:
        """Client-side progress, for servers without `/metrics`: requests the client has in
        flight and how many it has seen finish so far (any monotonic count)."""
        with self._cond:
            self._client_stall.observe(in_flight, completed_total, time.monotonic())

    def metrics(self, want: bool = True) -> ServerMetrics | None:
        """The newest `/metrics` sample (maybe a few seconds old); `want` asks for a fresh one
        when due. None before start() and from a server without `/metrics`."""
        poller = self._metrics
        return poller.latest(want) if poller is not None else None

    def note_unreachable(self, reason: str) -> None:
        """A request found no server at the URL (`reason`). A managed server's process is
        watched, which tells more: nothing to do here (`ExternalServer` acts on it)."""

    # what the modes differ in

    # The state from start() until the server is ready, and while it is down.
    _waiting_state = ServerState.STARTING

    def _first_phase(self) -> str:
        """The phase shown from start() until the thread says more."""
        return "preparing"

    def _keep(self, probe: ServerProbe) -> None:
        """Keep the server ready until stop() (raises _Stopping) or a ServerError."""
        raise NotImplementedError

    def _release(self) -> None:
        """Let go of the server as the thread ends (a managed one is stopped)."""

    def _pid(self) -> int | None:
        """The server's process (group) id, when ocrvl runs it; called under _cond."""
        return None

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

    def _check_stall(self) -> str | None:
        """Why the server looks hung (by /metrics or by ocrvl's own requests), if it does."""
        sample = self.metrics(want=True)
        now = time.monotonic()
        with self._cond:
            if sample is not None and sample.in_flight is not None:
                # The same sample may come again: it then shows no progress, which is right.
                self._metrics_stall.observe(sample.in_flight, sample.finished_total or 0.0,
                                            sample.taken_at)
            for source, detector in (("/metrics", self._metrics_stall),
                                     ("ocrvl's requests", self._client_stall)):
                if detector.stalled(now):
                    return (f"hung: {detector.in_flight} request(s) in flight but none finished "
                            f"for {self._server.stall_timeout:g}s (by {source})")
        return None

    # the thread

    def _main(self) -> None:
        probe = ServerProbe(self.config)
        try:
            self._keep(probe)
        except _Stopping:
            pass
        except ServerError as exc:
            with self._cond:
                self._error = exc
                self._last_error = str(exc)
            # Nothing retries it: the user must know that the fix comes first, then a start.
            log.error("%s (the server is not started again until ocrvl itself is)", exc)
            self._set(ServerState.FAILED, "")
        except Exception:
            log.exception("the server supervisor crashed")
            with self._cond:
                self._last_error = "the server supervisor crashed (see the log)"
            self._set(ServerState.FAILED, "")
        finally:
            self._release()
            probe.close()
            if self._state is not ServerState.FAILED:
                self._set(ServerState.STOPPED, "")

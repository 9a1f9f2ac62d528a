"""The managed server: launch vLLM (or a compatible command), wait out its start-up,
health-check it, restart it with backoff, and stop its whole process group.

Failure handling, in order of how final it is:
* configuration errors (wrong model name, missing program or package) -> `FAILED`, with a
  `ServerConfigError` naming the fix; retrying could not help;
* out of GPU memory (at start or at run time) -> lower the `auto` vLLM settings one step
  and start again at once; once a lowered start succeeds it is remembered for the next one.
  When nothing ocrvl may change is left, the error names the config lines to change;
* everything else (a crash, 503, failed probes, a hang, a start-up that fails or times
  out) -> stop the whole group, wait out an exponential backoff, start again: forever for
  the daemon, `Backoff.attempts` times in a row (then `FAILED` with a
  `ServerError`) for `ocrvl convert`.

The `auto` settings are planned at every launch, from the GPU as it is then (the old
process group is gone by then, so its memory does not count as other programs').
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.backoff import Backoff
from ocrvl_daemon.errors import ServerConfigError, ServerError
from ocrvl_daemon.process.group import ProcessGroup, kill_leftover
from ocrvl_daemon.server import autotune, launchers, vllm_diagnosis
from ocrvl_daemon.server.gpu import GpuReading, read_gpu
from ocrvl_daemon.server.probe import ServerProbe
from ocrvl_daemon.server.supervisor import (
    STARTUP_POLL,
    UNHEALTHY_PROBES,
    ServerState,
    ServerStatus,
    ServerSupervisor,
    StallDetector,
)
from ocrvl_daemon.server.vllm_diagnosis import Diagnosis, diagnose, parse_phase

log = logging.getLogger(__name__)
server_log = log.getChild("vllm")  # the server's own output, line by line (a child per replica)

PIDFILE_NAME = "server.pid"
TAIL_LINES = 200  # kept in memory
REPORT_LINES = 30  # shown when a crash loop is reported
CRASH_LOOP_FAILURES = 3
CRASH_LOOP_WINDOW = 600.0


# Seconds of readiness after which a server counts as stable again: its failures in a row
# start over.
STABLE_AFTER = 120.0


# --- the server's output -------------------------------------------------------------------

_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING,
           "ERROR": logging.ERROR, "CRITICAL": logging.CRITICAL}
_LEVEL = re.compile(r"^(?:\(\w+ pid=\d+\)\s+)?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
# vLLM's prefix naming the process a line comes from: "(EngineCore_DP0 pid=123) ".
_PROCESS = re.compile(r"^\(\w+ pid=\d+\) ")  # one space: a frame's indent follows
# The lines that begin a Python traceback, or chain another one to it.
_TRACEBACK_START = ("Traceback (most recent call last):", "During handling of the above exception",
                    "The above exception was the direct cause")
# Terminal colour and cursor codes: garbage in the journal.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_ACCESS = re.compile(r'"(GET|POST|HEAD) \S+ HTTP/[\d.]+" \d{3}')


class _LogPump(threading.Thread):
    """Reads the server's merged output line by line into the log and a tail buffer.

    Reading continuously means the server never blocks on a full pipe.
    """

    def __init__(self, stream: IO[bytes], on_line: Callable[[str], None],
                 logger: logging.Logger) -> None:
        super().__init__(name="ocrvl-server-log", daemon=True)
        self._logger = logger
        self._stream = stream
        self._on_line = on_line
        self._lock = threading.Lock()  # protects _lines (this thread appends, tail() reads)
        self._lines: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._in_traceback = False

    def run(self) -> None:
        try:
            for raw in iter(self._stream.readline, b""):
                # Progress bars redraw with \r: each redraw is a line of its own.
                for part in _ANSI.sub("", raw.decode("utf-8", "replace")).split("\r"):
                    line = part.rstrip()
                    if line:
                        self._emit(line)
        finally:
            self._stream.close()

    def _emit(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)
        level = self._level(line)
        if _ACCESS.search(line):
            level = logging.DEBUG  # one per health probe and per page: noise in the journal
        self._logger.log(level, "%s", line)
        self._on_line(line)

    def _level(self, line: str) -> int:
        """The line's own level; a traceback's lines, which have none, are an error's."""
        match = _LEVEL.match(line)
        if match:
            self._in_traceback = False
            return _LEVELS[match.group(1)]
        text = _PROCESS.sub("", line, count=1)
        if text.startswith(_TRACEBACK_START):
            self._in_traceback = True
        elif not self._in_traceback:
            return logging.INFO
        elif not text[:1].isspace():  # the exception's own line ends it (unless one follows)
            self._in_traceback = False
        return logging.ERROR

    def tail(self, n: int) -> list[str]:
        """The last `n` lines."""
        with self._lock:
            return list(self._lines)[-n:]


def pidfile_name(name: str) -> str:
    """The pidfile of the server called `name`: server.pid, server-gpu0-1.pid, ..."""
    return PIDFILE_NAME if name == "server" else f"server-{name.replace('/', '-')}.pid"


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


class ManagedServer(ServerSupervisor):
    """Starts the model server and keeps it ready; see the module docstring."""

    def __init__(self, config: Config, on_change: Callable[[ServerStatus], None] | None = None,
                 backoff: Backoff | None = None, name: str = "server",
                 gpu_reading: Callable[[], GpuReading | None] | None = None,
                 launch_turn: threading.Lock | None = None) -> None:
        """`gpu_reading` reads the server's GPU for planning `auto` flags (default: the one
        its environment selects, as it is); replicas sharing a GPU count each other's memory
        as free (see replicas). `launch_turn`, shared by the replicas of one GPU, is held
        from planning a launch until its start is over: vLLM's start-up memory profiling
        counts whatever another start on the GPU takes meanwhile, so two starts (a restart
        beside another) must never overlap."""
        super().__init__(config, on_change, name)
        self._launch_turn = launch_turn
        self._backoff = backoff or Backoff(self._server.restart_backoff_initial,
                                           self._server.restart_backoff_max)
        self._failures_in_a_row = 0  # since the server was last stable (`STABLE_AFTER`)
        self._pidfile = config.state_dir / pidfile_name(name)
        self._gpu_reading = gpu_reading or (lambda: read_gpu(launchers.server_env(config)))
        # _group and _pump are written under _cond (status() reads the pid from another
        # thread); the rest below is the supervisor thread's own.
        self._group: ProcessGroup | None = None
        self._pump: _LogPump | None = None
        self._failures: collections.deque[float] = collections.deque()
        # vLLM flags of the current (or last) launch and the GPU they were planned for
        self._args: dict[str, Any] = {}
        self._gpu: GpuReading | None = None
        # flags an out-of-memory step lowered, until a start with them succeeds
        self._lowered: dict[str, Any] | None = None

    @property
    def vllm_args(self) -> dict[str, Any]:
        """The vLLM flags of the current (or last) launch, `auto` values resolved."""
        return dict(self._args)

    def log_tail(self, n: int = REPORT_LINES) -> list[str]:
        """The server's last `n` output lines (of the current or last process)."""
        return self._pump.tail(n) if self._pump is not None else []

    def _pid(self) -> int | None:
        return self._group.pid if self._group else None

    def _keep(self, probe: ServerProbe) -> None:
        kill_leftover(self._pidfile, self._server.stop_timeout)
        launchers.check_launcher(self.config)
        while True:
            failure = self._run_once(probe)
            self._release()
            self._restart_after(failure)

    def _run_once(self, probe: ServerProbe) -> str:
        """Launch, wait until ready, watch; return why it failed."""
        host, port = self._server.host, self._server.port
        with self._cond:
            self._attempt += 1
            self._pump = None  # a tail from the previous process would mislead the diagnosis
            self._metrics_stall = StallDetector(self._server.stall_timeout)
            self._client_stall = StallDetector(self._server.stall_timeout)
        with self._turn():
            failure = self._launch(probe, host, port)
        if failure is not None:
            return failure
        group = self._group
        assert group is not None
        with self._cond:
            self._ready_at = time.monotonic()
        log.info("server ready at %s (pid %d)", self._server.base_url, group.pid)
        self._set(ServerState.READY, "ready")
        if self._lowered is not None:
            self._remember_lowered()
        return self._watch(probe, group)

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        """This GPU's launch turn (see __init__), held while the block runs."""
        turn = self._launch_turn
        if turn is None:
            yield
            return
        while not turn.acquire(timeout=0.5):
            self._set(phase="waiting for another server on this GPU to start")
            self._wait(0)  # raises _Stopping once stop() was called
        try:
            yield
        finally:
            turn.release()

    def _launch(self, probe: ServerProbe, host: str, port: int) -> str | None:
        """Plan, spawn and wait until the server is ready; why it failed, or None."""
        if port_in_use(host, port):
            return f"port {port} on {host} is taken by another program: address already in use"
        self._plan_args()
        spec = launchers.prepare_launch(self.config, self._args)
        try:
            group = ProcessGroup.spawn(spec.argv, spec.env, self._pidfile)
        except OSError as exc:
            raise ServerConfigError(f"Cannot start the server {spec.argv[0]!r}: {exc}.",
                                    launchers.SETUP_FIX) from exc
        output_log = server_log if self.name == "server" else server_log.getChild(self.name)
        pump = _LogPump(group.stdout, self._on_line, output_log)
        with self._cond:
            self._group, self._pump = group, pump
        pump.start()
        self._set(ServerState.STARTING, "launching")
        return self._wait_started(probe, group)

    def _plan_args(self) -> None:
        """Choose the `auto` flags for this launch from the GPU as it is now."""
        # The server's environment decides which GPU it sees (CUDA_VISIBLE_DEVICES).
        self._gpu = self._gpu_reading()
        remembered = self._lowered or autotune.load_remembered(
            self.config.state_dir, self._gpu, self.config.model.name,
            autotune.replicas_of(self.config))
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
                                     self._args, autotune.replicas_of(self.config))
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
                    vllm_diagnosis.oom_cause(text), changes)
        self._lowered = lowered
        return True

    def _on_line(self, line: str) -> None:
        phase = parse_phase(line)
        if phase is not None and self._state is ServerState.STARTING and phase != self._phase:
            log.info("server starting: %s", phase)
            self._set(phase=phase)

    def _wait_started(self, probe: ServerProbe, group: ProcessGroup) -> str | None:
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

    def _watch(self, probe: ServerProbe, group: ProcessGroup) -> str:
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
            hung = self._check_stall()
            if hung:
                return hung

    def _note_stable(self) -> None:
        ready_at = self._ready_at
        if (self._attempt and ready_at is not None
                and time.monotonic() - ready_at >= STABLE_AFTER):
            self._failures_in_a_row = 0
            with self._cond:
                self._attempt = 0

    def _restart_after(self, failure: str) -> None:
        """Record a failure, report it, wait out the backoff (or raise if permanent)."""
        tail = self.log_tail(REPORT_LINES)
        # The whole kept output of this process: vLLM 0.26 prints the cause (e.g. its free
        # memory check) some 60 lines of tracebacks before it exits.
        text = "\n".join([*self.log_tail(TAIL_LINES), failure])
        diagnosis = diagnose(text)
        if diagnosis is not None and diagnosis.permanent:
            raise ServerConfigError(f"The server failed: {failure} ({diagnosis.cause}).",
                                    diagnosis.fix)
        oom = vllm_diagnosis.is_oom(text)
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
            self._failures_in_a_row += 1
            delay = self._backoff.delay(self._failures_in_a_row)
        with self._cond:
            self._last_error, self._diagnosis = error, diagnosis
            self._restart_count += 1
            self._ready_at = None
        cause = f"; likely cause: {diagnosis}" if diagnosis else ""
        if not stepped and self._backoff.gives_up(self._failures_in_a_row):
            raise ServerError(
                f"The server failed {self._failures_in_a_row} times in a row, the last time: "
                f"{error}.", diagnosis.fix if diagnosis else
                "see the server's output above; `ocrvl doctor` checks its set-up")
        if len(self._failures) >= CRASH_LOOP_FAILURES and not stepped:
            output = (f"Its last {len(tail)} lines:\n" + "\n".join(tail) if tail
                      else "It printed nothing.")
            log.error("the server keeps failing (%d times in %.0f minutes): %s%s; retrying in "
                      "%.1fs.\n%s", len(self._failures), CRASH_LOOP_WINDOW / 60,
                      failure, cause, delay, output)
        elif not stepped:
            log.log(logging.ERROR if oom else logging.WARNING,
                    "server failed: %s%s; restarting in %.1fs", failure, cause, delay)
        self._set(ServerState.RESTARTING, f"next try in {delay:.1f}s")
        self._wait(delay)

    def kill(self) -> None:
        """A forced stop: SIGKILL the server's whole process group now and reap it."""
        super().kill()
        with self._cond:
            group = self._group
        if group is not None:
            group.kill()

    def _release(self) -> None:
        """Stop the current group (process_group's one stop) and make sure none of it is left
        before going on."""
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

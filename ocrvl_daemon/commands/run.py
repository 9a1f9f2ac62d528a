"""`ocrvl run`: wires the model servers, inbox watcher and converter into one main loop.

Signal handlers only record what was asked; the loop acts on it. Every iteration polls the
watcher, ticks the converter, builds one `DaemonState` about once a second (shown as
STATUS=, in /metrics and, through the runtime file, by `ocrvl status`) and pings systemd's
watchdog, so a stuck loop stops pinging. Stopping is ordered: stop taking files, let pages
in flight finish and checkpoint (bounded; not after Ctrl-C, which means now), stop the
workers, then stop the server. A second SIGTERM or Ctrl-C while that runs stops at once
(`shutdown`): SIGKILL to the workers and the server's process group. A reload that changes
the server settings stops the old server on a thread, so the loop keeps turning (and pinging
the watchdog), and starts the new one once the old one is gone.

One daemon per state_dir (`state_lock`). When the state_dir's disk fills up, nothing can be
checkpointed: the daemon pauses (says so in the log, STATUS= and `ocrvl status`), reads the
free space every few seconds, and resumes where it was once there is room (`state_pause`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from pathlib import Path

from ocrvl_daemon.cluster import engine_side
from ocrvl_daemon.config.file import advice_command, load_config
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.config.values import folder_problem
from ocrvl_daemon.core.job import JobState
from ocrvl_daemon.engine.converter import Converter
from ocrvl_daemon.errors import (
    ConfigError,
    ExitCode,
    OcrvlError,
    ServerConfigError,
    StateFullError,
)
from ocrvl_daemon.inbox.watcher import InboxWatcher
from ocrvl_daemon.observe.daemon_state import (
    DaemonState,
    EndpointState,
    GpuView,
    ServerView,
    format_status,
    write_runtime_file,
)
from ocrvl_daemon.observe.logs import set_level
from ocrvl_daemon.observe.metrics import MetricsEndpoint
from ocrvl_daemon.observe.progress import ProgressLog
from ocrvl_daemon.process.sd_notify import Notifier
from ocrvl_daemon.process.shutdown import StopSignals
from ocrvl_daemon.server.gpu import GpuMonitor
from ocrvl_daemon.server.replicas import ServerSet
from ocrvl_daemon.server.supervisor import ServerState, ServerStatus
from ocrvl_daemon.storage.disk_pause import StatePause
from ocrvl_daemon.storage.jobs import enqueue_file, open_store
from ocrvl_daemon.storage.lock import StateLock

log = logging.getLogger(__name__)

# The loop wakes when results arrive, else after this long (longer when there is no work).
TICK_SECONDS = 0.1
IDLE_TICK_SECONDS = 0.5
STATUS_SECONDS = 1.0
# A managed server's GPUs are read this often, on their own thread.
GPU_SECONDS = 5.0
# How much more time to ask systemd for, each time, while the model server starts.
EXTEND_SECONDS = 90.0
# Pages in flight get this long to finish and be checkpointed at shutdown.
DRAIN_SECONDS = 20.0


class Daemon:
    """The foreground daemon; `run()` returns when asked to stop."""

    def __init__(self, config: Config, config_path: Path | None) -> None:
        self.config = config
        self.config_path = config_path
        self.notifier = Notifier()
        self.signals = StopSignals(signal.SIGHUP)
        self._ready_sent = False
        self._last_extend = 0.0
        self._last_status = 0.0
        # A managed server's GPUs, read on their own thread (nvidia-smi can take seconds).
        self.gpus = GpuMonitor(GPU_SECONDS)
        # The latest state, for the metrics endpoint's thread (no lock: it is replaced whole,
        # never changed in place).
        self.state: DaemonState | None = None
        self._drain = DRAIN_SECONDS
        self.pause = StatePause(config.state_dir)  # the state_dir's disk is full
        self._untaken: list[Path] = []  # found by the watcher, not queued yet (disk full)
        # After a reload: the servers being stopped on `_old_server_stop`, a thread; the new
        # ones (`servers`) are started by the loop once that thread has ended.
        self._old_server: ServerSet | None = None
        self._old_server_stop: threading.Thread | None = None
        self.again = advice_command("retry", config_path)

    def run(self) -> ExitCode:
        """Run until SIGTERM (exit 0) or SIGINT (130), or a second one while stopping (130,
        at once); returns the exit code."""
        self.signals.install()
        config = self.config
        self.store = open_store(config)  # a state_dir that cannot be used is a ConfigError
        try:
            self.lock = StateLock(config.state_dir)
        except BaseException:
            self.store.close()
            raise
        try:
            # Replicas that cannot fit the GPU, or a managed vLLM without one, are refused
            # here, before anything starts.
            self.servers, engines = engine_side(config)
        except BaseException:
            self.lock.release()
            self.store.close()
            raise
        log.info(
            "ocrvl starting: model %s, inbox %s, server %s (%s)",
            config.model.name,
            ", ".join(map(str, config.inbox.paths)),
            config.server.base_url,
            config.server.mode,
        )
        recovered = self.store.recover_running()
        if recovered:
            log.info("resuming %d document(s) interrupted last time", recovered)
        for job in self.store.jobs():
            if not job.path.exists():  # moved or deleted while ocrvl was down
                self.store.forget(job.id)
        self.watcher = InboxWatcher(config.inbox)
        self.converter = Converter(config, self.store, self.servers.endpoints,
                                   again=self.again, engines=engines)
        self.metrics = MetricsEndpoint(config.metrics, lambda: self.state)
        self.progress_log = ProgressLog(config.progress_seconds)
        try:
            self.metrics.start()
            if config.server.mode == "managed" and config.cluster.address is None:
                self.gpus.start()
            self.servers.start()
            self.watcher.start()
            code = self._loop()
        except BaseException:
            self.signals.stop(self._shutdown, self._kill_children)
            raise
        if not self.signals.stop(self._shutdown, self._kill_children):
            return ExitCode.INTERRUPTED
        return code

    def _loop(self) -> ExitCode:
        while True:
            while self.signals.pending:
                signum = self.signals.pending.pop(0)
                if signum == signal.SIGHUP:
                    self._reload()
                elif signum == signal.SIGINT:  # Ctrl-C: now, pages in flight are redone
                    log.info("received SIGINT; stopping now")
                    self._drain = 0.0
                    return ExitCode.INTERRUPTED
                else:
                    log.info("received %s; stopping", signal.Signals(signum).name)
                    return ExitCode.OK
            now = time.monotonic()
            self.notifier.tick(now)
            if not self.pause.may_work(now):
                time.sleep(IDLE_TICK_SECONDS)
                continue
            self._start_new_server()
            try:
                self._untaken += self.watcher.poll(now)
                # The start-up scan hands over every converted file again: one line says so.
                converted = 0
                while self._untaken:
                    converted += self._take(self._untaken[0])
                    self._untaken.pop(0)
                if converted:
                    log.info("%d document(s) in the inbox already converted", converted)
                self.converter.tick(now)
                self.progress_log.update(now, self.converter.running())
                self._report(now)
            except StateFullError as exc:
                self._pause(exc, now)
                continue
            if self.pause.worked():
                log.info("resumed: there is space again for the state folder %s",
                         self.config.state_dir)
                self.lock.note(None)
            busy = bool(self.converter.documents.active)
            self.converter.wait(TICK_SECONDS if busy else IDLE_TICK_SECONDS)

    def _pause(self, exc: StateFullError, now: float) -> None:
        """Stop dispatching until the state_dir has space; say so where the user looks."""
        if self.pause.full(exc, now):
            pause = f"paused: {exc} (conversion resumes by itself once there is space; "
            pause += "nothing is lost)"
            log.error("%s", pause)
            self.lock.note(pause)
        else:
            log.debug("still no space for the state folder: %s", exc)
        self.notifier.status(
            f"paused: the disk of {self.config.state_dir} is full; free some space", now
        )

    def _take(self, path: Path) -> bool:
        """Queue a file the watcher found; True when it is already converted."""
        try:
            job = enqueue_file(self.store, path, self.config.recipe, self.again,
                               self.converter.documents.place)
        except StateFullError:
            raise
        except OcrvlError as exc:
            log.warning("%s: %s", path, exc)
            return False
        self.converter.wake()
        if job.state is JobState.QUEUED:
            log.info("%s: queued", path)
        else:
            log.debug("%s: already %s", path, job.state.value)
        return job.state is JobState.DONE

    def _report(self, now: float) -> None:
        server = self.servers.overall()
        if not self._ready_sent:
            if server.state is ServerState.READY:
                self._ready_sent = True
                watched = [p for p in self.config.inbox.paths if folder_problem(p) is None]
                log.info("ready: server up at %s, watching %s", server.url,
                         ", ".join(map(str, watched)) or "no inbox (see the warnings above)")
                self.notifier.ready()
            elif now - self._last_extend >= EXTEND_SECONDS / 3:
                self._last_extend = now
                self.notifier.extend_timeout(EXTEND_SECONDS)
        if now - self._last_status < STATUS_SECONDS:
            return  # counting jobs is a query; once a second is plenty for a status line
        self._last_status = now
        state = self._state(server)
        self.state = state
        self.notifier.status(format_status(state), now)
        # A full disk is noticed (and shown) where the store writes; status only goes stale.
        with contextlib.suppress(OSError):
            write_runtime_file(self.config.state_dir, state.to_json())

    def _state(self, server: ServerStatus) -> DaemonState:
        """This tick's `DaemonState`: shown as STATUS=, in /metrics and by `ocrvl status`."""
        progress = self.converter.progress()
        endpoints = tuple(self._endpoints())
        gpus = self.gpus.latest()
        return DaemonState(
            pid=os.getpid(),
            updated=time.time(),
            server=ServerView(
                state=server.state.value,
                phase=server.phase or None,
                url=server.url,
                pid=server.pid,
                attempt=server.attempt if server.state is ServerState.RESTARTING else 0,
                restarts=server.restart_count,
                last_error=server.last_error,
                diagnosis=str(server.diagnosis) if server.diagnosis else None,
                cause=server.diagnosis.cause if server.diagnosis else None,
            ),
            endpoints=endpoints,
            current_doc=progress.current,
            page_done=progress.page_done,
            page_total=progress.page_total or None,
            pages_per_s=round(progress.pages_per_s, 3),
            in_flight=progress.in_flight,
            concurrency=sum(e.bound for e in endpoints),
            queued=max(0, progress.queued),
            converting=len(self.converter.documents.active),
            done=progress.done,
            failed=progress.failed,
            pages_done=self.converter.outcomes.completed,
            pages_failed=self.converter.outcomes.failed,
            pages_flagged=self.converter.outcomes.flagged,
            engine_failed_starts=self.converter.engines.start_failures,
            engine_error=str(error) if (error := self.converter.engines.start_error) else None,
            hook_failures=dict(self.converter.hooks.failures),
            gpus=tuple(GpuView(r.index, r.name, r.used_mib, r.total_mib, r.busy_pct, r.power_w)
                       for r in gpus),
            stages=self.converter.stage_load(time.monotonic(), gpus),
        )

    def _endpoints(self) -> list[EndpointState]:
        """Each server endpoint: its state and its share of the work."""
        views = []
        for handle, load in zip(self.converter.servers, self.converter.endpoint_load(),
                                strict=True):
            status = handle.status()
            state = status.state
            if state is ServerState.STOPPED and self._old_server is not None:
                state = ServerState.STARTING  # it starts once the old one has stopped
            views.append(EndpointState(
                name=load.name, url=load.url, state=state.value, phase=status.phase,
                in_flight=load.in_flight, pages_per_s=round(load.pages_per_s, 3),
                bound=load.bound, restarts=status.restart_count, last_error=status.last_error,
                node=status.node, gpu=status.gpu,
            ))
        return views

    def _reload(self) -> None:
        """SIGHUP: re-read the config; apply what can change live; keep the old one if bad."""
        self.notifier.reloading()
        try:
            new, _ = load_config(self.config_path)
        except ConfigError as exc:
            log.error("reload rejected, the running configuration stays in force: %s", exc)
            self.notifier.ready()
            return
        old = self.config
        for key in ("state_dir", "metrics", "cluster"):
            if getattr(new, key) != getattr(old, key):
                log.warning("%s changed; that takes effect at the next restart", key)
                new = new.model_copy(update={key: getattr(old, key)})
        servers = None
        # A cluster's hosts keep their own servers: the pool replaces them (reconfigure).
        if new.config_for_server != old.config_for_server and new.cluster.address is None:
            try:
                servers = ServerSet(new)  # replicas that cannot fit are refused here
            except ServerConfigError as exc:
                log.error("reload rejected, the running configuration stays in force: %s", exc)
                self.notifier.ready()
                return
        self.config = new
        set_level(new.log_level)
        self.watcher.reconfigure(new.inbox)
        if servers is not None:
            log.info("server settings changed; restarting the server")
            self._replace_server(servers)
        self.converter.reconfigure(new)
        self.progress_log.interval = new.progress_seconds
        log.info("configuration reloaded from %s", self.config_path or "built-in defaults")
        self.notifier.ready()

    def _replace_server(self, servers: ServerSet) -> None:
        """Stop the servers on a thread (that can take longer than the watchdog allows one
        turn of the loop); `_start_new_server` starts `servers` once the old ones are gone,
        as two servers must not compete for the port and the GPU's memory."""
        if self._old_server is None:  # else the servers made by the last reload never started
            self._old_server = self.servers
            self._old_server_stop = threading.Thread(target=self.servers.stop, daemon=True,
                                                     name="ocrvl-server-stop")
            self._old_server_stop.start()
        self.servers = servers
        self.converter.set_servers(self.servers.endpoints)

    def _start_new_server(self) -> None:
        """Start the server a reload made, once the old one has stopped."""
        if self._old_server_stop is not None and not self._old_server_stop.is_alive():
            self._old_server = self._old_server_stop = None
            self.servers.start()

    def _shutdown(self) -> None:
        self.notifier.stopping()
        if self._drain:
            log.info("stopping: finishing pages in flight (up to %.0f s)", self._drain)
        self.watcher.stop()
        self.converter.stop(self._drain)
        if self._old_server_stop is not None:
            self._old_server_stop.join()  # bounded, as ServerSupervisor.stop is
        self.servers.stop()
        self.metrics.stop()
        self.gpus.stop()
        # `ocrvl status` must not go on showing the last published state as running.
        with contextlib.suppress(OSError):
            write_runtime_file(self.config.state_dir, {"pid": os.getpid(), "stopped": time.time()})
        self.store.close()
        self.lock.release()
        log.info("stopped")
        self.notifier.close()

    def _kill_children(self) -> None:
        """A second stop signal: SIGKILL the workers, hooks and servers now, and reap them."""
        self.converter.kill()
        for servers in (self._old_server, self.servers):
            if servers is not None:
                servers.kill()
        log.info("stopped at once; pages in flight are redone next time")

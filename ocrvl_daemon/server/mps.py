"""NVIDIA MPS for the replicas of one GPU: ocrvl's own MPS control daemon, and whether to run it.

Without MPS, processes that share a GPU take turns on it (time-slicing): on an H200 a third
replica added nothing. Under MPS their kernels run side by side. `server.mps` decides:
`on`, `off`, or `auto` = on when two or more replicas share a GPU, `nvidia-cuda-mps-control`
is on the servers' PATH and no MPS control daemon that ocrvl did not start is running (its
clients are then whatever it serves; ocrvl leaves it alone).

ocrvl's daemon has its own pipe and log directories under the state dir
(`CUDA_MPS_PIPE_DIRECTORY`, `CUDA_MPS_LOG_DIRECTORY`): the replicas get both in their
environment, which makes them its clients. It is started with `nvidia-cuda-mps-control -d`
before the first replica and stopped after the last one is reaped: `quit` on the control
program's stdin, a bounded wait, then SIGKILL. Ours is told from others by OWNER_ENV in its
environment (its MPS servers inherit it, the replicas do not get it): a daemon without it is
never stopped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ocrvl_daemon.config.model import AUTO, Config
from ocrvl_daemon.errors import ServerConfigError
from ocrvl_daemon.server import launchers

log = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
OWNER_ENV = "OCRVL_MPS_DAEMON"  # its value: the pipe directory of the ocrvl that started it
DAEMON_FLAGS = ("-d", "-f")  # a control daemon; without them the program is a one-off client
COMMAND_TIMEOUT = 30.0  # `-d` forks and returns; `quit` only writes to the control pipe
START_WAIT = 10.0
KILL_WAIT = 5.0
_POLL = 0.05


def mps_dir(state_dir: Path) -> Path:
    """Where ocrvl's MPS daemon keeps its pipes (`pipe/`) and logs (`log/`)."""
    return state_dir / "mps"


@dataclass(frozen=True)
class MpsProbe:
    """What this machine offers: the control program (None: not on PATH) and the MPS control
    daemons running that ocrvl did not start (their PIDs)."""

    control: str | None
    foreign: list[int] = field(default_factory=list)

    @property
    def available(self) -> bool:
        """Whether ocrvl could run its own MPS daemon here."""
        return self.control is not None and not self.foreign


@dataclass(frozen=True)
class MpsPlan:
    """Whether ocrvl runs MPS for its replicas, why, and where its pipes and logs go."""

    use: bool
    why: str
    mode: str  # server.mps, for messages
    shared: bool  # two or more replicas share a GPU
    control: str | None
    pipe_dir: Path
    log_dir: Path

    def client_env(self) -> dict[str, str]:
        """What a replica's environment needs to be a client of ocrvl's daemon ({}: none)."""
        if not self.use:
            return {}
        return {PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir)}


def probe(config: Config) -> MpsProbe:
    """The control program on the servers' PATH and the foreign MPS daemons running now."""
    env = launchers.server_env(config)
    pipe_dir = mps_dir(config.state_dir) / "pipe"
    foreign = [p.pid for p, ours in control_daemons(pipe_dir) if not ours]
    return MpsProbe(shutil.which(CONTROL, path=env.get("PATH")), foreign)


def plan(config: Config, found: MpsProbe, shared: bool) -> MpsPlan:
    """Decide `server.mps` for managed replicas (`shared`: two or more share a GPU).

    Raises ServerConfigError when `on` cannot be honoured, before anything starts.
    """
    mode = config.server.mps
    base = mps_dir(config.state_dir)

    def decided(use: bool, why: str) -> MpsPlan:
        return MpsPlan(use, why, mode, shared, found.control, base / "pipe", base / "log")

    if mode == "off":
        return decided(False, "server.mps is off")
    if mode == "on" and found.control is None:
        raise ServerConfigError(
            f"server.mps = on, but {CONTROL} is not on the servers' PATH.",
            f"install the NVIDIA driver's MPS tools (the package that has {CONTROL}), put "
            "its folder on PATH (a service's PATH is shorter than a terminal's), or set "
            "server.mps: auto")
    if mode == "on" and found.foreign:
        raise ServerConfigError(
            f"server.mps = on, but an MPS control daemon ocrvl did not start is running (pid "
            f"{', '.join(map(str, found.foreign))}); two would compete for the GPU.",
            "stop it (`echo quit | nvidia-cuda-mps-control` as its user), or set server.mps: "
            "auto, which leaves it alone")
    if mode == "on":
        return decided(True, "server.mps is on")
    assert mode == AUTO
    if not shared:
        return decided(False, "auto: no two replicas share a GPU")
    if found.control is None:
        return decided(False, f"auto: {CONTROL} is not on PATH")
    if found.foreign:
        return decided(False, "auto: an MPS control daemon ocrvl did not start runs (pid "
                              f"{', '.join(map(str, found.foreign))}); it is left alone")
    return decided(True, "auto: replicas share a GPU and MPS is installed")


def control_daemons(pipe_dir: Path) -> list[tuple[psutil.Process, bool]]:
    """Every running MPS control daemon, each with whether it is the one that `pipe_dir`'s
    ocrvl started (one whose environment cannot be read is someone else's)."""
    found = []
    for proc in psutil.process_iter():
        try:
            argv = proc.cmdline()
            # The program itself, or a script run by its interpreter.
            program = next((i for i, a in enumerate(argv[:2])
                            if os.path.basename(a) == CONTROL), None)
            if program is None or not set(argv[program + 1:]) & set(DAEMON_FLAGS):
                continue
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            try:
                ours = proc.environ().get(OWNER_ENV) == str(pipe_dir)
            except psutil.AccessDenied:
                ours = False
        except psutil.Error:
            continue
        found.append((proc, ours))
    return found


class MpsDaemon:
    """ocrvl's MPS control daemon for `plan` (a no-op where `plan.use` is false)."""

    def __init__(self, plan: MpsPlan, env: Mapping[str, str], stop_timeout: float) -> None:
        self.plan = plan
        self._env = {**env, **plan.client_env()}
        self._stop_timeout = stop_timeout
        self._started = False

    def running(self) -> list[psutil.Process]:
        """The processes of ocrvl's daemon (control and MPS servers) alive now."""
        owner = str(self.plan.pipe_dir)
        alive = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if (proc.environ().get(OWNER_ENV) == owner
                        and proc.status() != psutil.STATUS_ZOMBIE):
                    alive.append(proc)
        return alive

    def start(self) -> None:
        """Start the daemon (one a SIGKILLed ocrvl left is stopped first); a daemon that
        does not start is logged, and the replicas then share the GPU without it."""
        if not self.plan.use or self.plan.control is None:
            # Said where it matters: replicas that share a GPU without it.
            log.log(logging.INFO if self.plan.shared else logging.DEBUG, "MPS not used (%s)",
                    self.plan.why)
            return
        if self.running():
            log.warning("a previous ocrvl left its MPS control daemon running: stopping it first")
            self._started = True
            self.stop()
        # None of ours runs now: what a killed daemon left in its pipe folder is stale.
        shutil.rmtree(self.plan.pipe_dir, ignore_errors=True)
        for folder in (self.plan.pipe_dir, self.plan.log_dir):
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        log.info("starting the MPS control daemon (%s): %s -d, pipes in %s, logs in %s",
                 self.plan.why, self.plan.control, self.plan.pipe_dir, self.plan.log_dir)
        self._started = True  # whatever part of it comes up is stopped with the replicas
        problem = self._run("-d", owner=True)
        if problem is None and not self._wait(lambda: bool(self._control()), START_WAIT):
            problem = f"no daemon was running {START_WAIT:g}s later"
        if problem is not None:
            log.error("could not start the MPS control daemon (server.mps = %s): %s; the "
                      "replicas share the GPU without it. Its log is in %s; fix it, or set "
                      "server.mps: off", self.plan.mode, problem,
                      self.plan.log_dir)
            return
        log.info("MPS control daemon running, pid %s", [p.pid for p in self._control()])

    def stop(self) -> None:
        """Stop the daemon this object started: `quit`, a bounded wait, then SIGKILL.
        Call once every replica is reaped (its clients)."""
        if not self._started:
            return
        self._started = False
        if not self.running():
            log.info("no MPS control daemon of ocrvl's left to stop")
            return
        began = time.monotonic()
        log.info("stopping the MPS control daemon: quit")
        problem = self._run(input_text="quit\n")
        if problem is not None:
            log.warning("MPS quit failed: %s", problem)
        if self._wait(lambda: not self.running(), self._stop_timeout):
            log.info("MPS control daemon ended %.1fs after quit", time.monotonic() - began)
            return
        self.kill()

    def kill(self) -> None:
        """SIGKILL every process of ocrvl's daemon now (a forced stop, or a quit that hung)."""
        self._started = False
        if not self.plan.use:
            return
        left = self.running()
        if not left:
            return
        log.warning("MPS control daemon still running: SIGKILL to pids %s",
                    [p.pid for p in left])
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        if self._wait(lambda: not self.running(), KILL_WAIT):
            log.info("MPS control daemon ended after SIGKILL")
        else:
            log.error("MPS processes survived SIGKILL for %.0fs: %s", KILL_WAIT,
                      [p.pid for p in self.running()])

    def _control(self) -> list[psutil.Process]:
        return [p for p, ours in control_daemons(self.plan.pipe_dir) if ours]

    def _run(self, *args: str, input_text: str = "", owner: bool = False) -> str | None:
        """Run the control program (reaped, bounded); what went wrong, or None. `owner`: it
        becomes ocrvl's daemon (OWNER_ENV)."""
        assert self.plan.control is not None
        env = {**self._env, OWNER_ENV: str(self.plan.pipe_dir)} if owner else self._env
        # A file, not a pipe: a daemon that forks with the pipe still open would keep the
        # read waiting for its end.
        out = self.plan.log_dir / "ocrvl-control.out"
        try:
            with out.open("w+", encoding="utf-8") as sink:
                done = subprocess.run([self.plan.control, *args], input=input_text,
                                      stdout=sink, stderr=subprocess.STDOUT, text=True,
                                      env=env, timeout=COMMAND_TIMEOUT, check=False)
                sink.seek(0)
                said = sink.read().strip().splitlines()
        except (OSError, subprocess.TimeoutExpired) as exc:
            return str(exc)
        if done.returncode != 0:
            return f"exit status {done.returncode}" + (f": {said[-1]}" if said else "")
        return None

    @staticmethod
    def _wait(done: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL)
        return True

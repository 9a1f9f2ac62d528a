"""A child process in its own session, and how to end all of it.

vLLM's API server forks an engine-core process that keeps holding VRAM when only the API
server dies, so the unit of life and death here is the process group, never a PID:

* `ProcessGroup.spawn` starts the child as the leader of a new session (its PID is the
  group id), asks the kernel to SIGTERM it when the spawning thread dies (covers a
  SIGKILLed ocrvl), and records the group in a JSON pidfile.
* `ProcessGroup.stop` (`stop_process_group` for a leader started otherwise, like the engine
  worker) sends SIGTERM to the group, waits a bounded time, sends SIGKILL, reaps the leader
  and logs each step.
* `kill_leftover` ends a group recorded by a previous ocrvl that died before it could
  (the kernel's parent-death signal only reaches the leader, not the engine core).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

import psutil

from ocrvl_daemon.files.atomic import write_atomic

log = logging.getLogger(__name__)

# Every process of a group we start carries this in its environment (children inherit it),
# so a leftover can be recognised even after its leader, and with it the PID, is gone.
TOKEN_ENV = "OCRVL_SERVER_GROUP"
# How long to wait for a group to vanish after SIGKILL (only D-state processes linger).
KILL_WAIT = 5.0
_POLL = 0.05
_PR_SET_PDEATHSIG = 1
# Two readings of one process's start time agree far better than this; a recycled PID
# would have to be reused within it to be mistaken for ours.
_CREATE_TIME_SLACK = 0.05

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


@dataclass(frozen=True)
class GroupRecord:
    """What the pidfile says about a group we started."""

    pgid: int
    create_time: float  # the leader's start time (psutil), to tell a recycled PID apart
    token: str  # the value of TOKEN_ENV in the group's environment
    argv: list[str]

    def save(self, path: Path) -> None:
        """Write atomically, so a crash never leaves half a record."""
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> GroupRecord | None:
        """The record in `path`; None if there is none or it is unreadable."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(int(data["pgid"]), float(data["create_time"]), str(data["token"]),
                       [str(a) for a in data["argv"]])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable server pidfile %s: %s", path, exc)
            return None


def die_with_parent(sig: signal.Signals) -> None:
    """Ask Linux to send `sig` to this process when its parent (thread) dies, however."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def _parent_death_signal(parent: int) -> Callable[[], None]:
    """A preexec_fn: SIGTERM the child when the thread that spawned it dies."""

    def preexec() -> None:
        die_with_parent(signal.SIGTERM)
        # The parent may have died between fork and prctl: then nobody would signal us.
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def group_members(pgid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes in group `pgid`."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` still runs.

    Zombies do not count: they hold no memory, and orphans are reaped by whoever adopted
    them, which may be slow or never in a container.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(group_members(pgid))


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _wait_gone(pgid: int, timeout: float, reap: Callable[[], object]) -> bool:
    """Wait up to `timeout` until no process of group `pgid` is left.

    `psutil.wait_procs` waits on the members, except our own children: those are left to
    `reap` (their Popen's own wait), which keeps their exit status for the log, where psutil
    would reap them behind Popen's back. The group is read again each round, since a member
    may start another process while we wait.
    """
    deadline = time.monotonic() + timeout
    while True:
        reap()  # an unreaped leader would stay a zombie member of the group
        members = group_members(pgid)  # one walk of the process table a round
        if not members:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        others = [p for p in members if not _ours(p)]
        if others:
            psutil.wait_procs(others, timeout=min(left, _POLL))
        else:
            time.sleep(min(left, _POLL))


def _ours(proc: psutil.Process) -> bool:
    try:
        return proc.ppid() == os.getpid()
    except psutil.Error:
        return False


def terminate_group(pgid: int, timeout: float, what: str = "server",
                    reap: Callable[[], object] = lambda: None) -> bool:
    """SIGTERM group `pgid`, wait up to `timeout`, then SIGKILL; True once nothing is left."""
    if not group_alive(pgid):
        reap()
        return True
    started = time.monotonic()
    log.info("stopping %s: SIGTERM to process group %d", what, pgid)
    _signal_group(pgid, signal.SIGTERM)
    if _wait_gone(pgid, timeout, reap):
        log.info("%s process group %d ended %.1fs after SIGTERM", what, pgid,
                 time.monotonic() - started)
        return True
    log.warning("%s process group %d still running %.0fs after SIGTERM: sending SIGKILL",
                what, pgid, timeout)
    return kill_group(pgid, what, reap)


def kill_group(pgid: int, what: str = "server",
               reap: Callable[[], object] = lambda: None) -> bool:
    """SIGKILL group `pgid` and wait (bounded) until it is gone; True once nothing is left."""
    _signal_group(pgid, signal.SIGKILL)
    if _wait_gone(pgid, KILL_WAIT, reap):
        log.info("%s process group %d ended after SIGKILL", what, pgid)
        return True
    log.error("%s process group %d survived SIGKILL for %.0fs (processes stuck in the kernel: "
              "%s)", what, pgid, KILL_WAIT, [p.pid for p in group_members(pgid)])
    return False


def stop_process_group(proc: subprocess.Popen[bytes], timeout: float, what: str,
                       *, now: bool = False) -> bool:
    """End the group `proc` leads (TERM, bounded wait, KILL; with `now` KILL at once: a
    forced stop) and reap `proc`.

    True once nothing of the group is left.
    """
    if now:
        log.warning("killing %s: SIGKILL to process group %d", what, proc.pid)
        gone = kill_group(proc.pid, what, proc.poll)
    else:
        gone = terminate_group(proc.pid, timeout, what, proc.poll)
    if proc.returncode is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(KILL_WAIT)
    log.info("reaped %s pid %d, exit status %s", what, proc.pid, proc.returncode)
    return gone


class ProcessGroup:
    """A child running as the leader of its own session, with stdout+stderr on a pipe."""

    def __init__(self, proc: subprocess.Popen[bytes], record: GroupRecord,
                 pidfile: Path | None, what: str) -> None:
        self.proc = proc
        self.record = record
        self.pidfile = pidfile
        self.what = what

    @classmethod
    def spawn(cls, argv: Sequence[str], env: Mapping[str, str], pidfile: Path | None = None,
              what: str = "server") -> ProcessGroup:
        """Start `argv` in a new session; record it in `pidfile`.

        The parent-death signal fires when the *calling thread* ends, so call this from a
        thread that outlives the child (the supervisor's own thread does).
        Raises OSError when the program cannot be executed.
        """
        token = secrets.token_hex(8)
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # one pipe, one reader: nothing can block on the other
            env={**env, TOKEN_ENV: token},
            start_new_session=True,
            # Popen has no parameter for prctl; the hook makes only plain system calls.
            preexec_fn=_parent_death_signal(os.getpid()),
        )
        try:
            create_time = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            create_time = 0.0  # already gone; the record still names its group for cleanup
        record = GroupRecord(proc.pid, create_time, token, list(argv))
        if pidfile is not None:
            record.save(pidfile)
        log.info("started %s, pid %d (own process group): %s", what, proc.pid,
                 subprocess.list2cmdline(list(argv)))
        return cls(proc, record, pidfile, what)

    @property
    def pid(self) -> int:
        """The leader's PID, which is also the process group id."""
        return self.proc.pid

    @property
    def stdout(self) -> IO[bytes]:
        """The child's merged stdout and stderr."""
        assert self.proc.stdout is not None
        return self.proc.stdout

    def poll(self) -> int | None:
        """The leader's exit status, or None while it runs."""
        return self.proc.poll()

    def alive(self) -> bool:
        """Whether any process of the group still runs."""
        return group_alive(self.pid)

    def stop(self, timeout: float) -> bool:
        """End the whole group (TERM, bounded wait, KILL), reap the leader, drop the pidfile.

        True once nothing of the group is left.
        """
        return self._end(stop_process_group(self.proc, timeout, self.what))

    def kill(self) -> bool:
        """A forced stop: SIGKILL the whole group now, reap the leader, drop the pidfile."""
        return self._end(stop_process_group(self.proc, 0, self.what, now=True))

    def _end(self, gone: bool) -> bool:
        """Drop the pidfile once nothing of the group is left (`gone`)."""
        if gone and self.pidfile is not None and GroupRecord.load(self.pidfile) == self.record:
            self.pidfile.unlink(missing_ok=True)
        return gone


def _is_ours(proc: psutil.Process, record: GroupRecord) -> bool:
    try:
        if proc.pid == record.pgid:
            return abs(proc.create_time() - record.create_time) < _CREATE_TIME_SLACK
        return proc.environ().get(TOKEN_ENV) == record.token
    except psutil.Error:
        return False


def kill_leftover(pidfile: Path, timeout: float, what: str = "server") -> bool:
    """End the group recorded in `pidfile` if it still runs and is provably ours.

    A process counts as ours if it is the recorded leader with the recorded start time, or
    carries the recorded token in its environment; a recycled PID is never signalled.
    Returns True if a leftover group was found (and stopped).
    """
    record = GroupRecord.load(pidfile)
    if record is None:
        return False
    ours = [p for p in group_members(record.pgid) if _is_ours(p, record)]
    found = bool(ours)
    if found:
        log.warning("a previous ocrvl left its %s running (process group %d, pids %s): "
                    "stopping it before starting a new one", what, record.pgid,
                    [p.pid for p in ours])
        if not terminate_group(record.pgid, timeout, f"leftover {what}"):
            return True  # keep the record: the next start tries again
    pidfile.unlink(missing_ok=True)
    return found

"""A bench that is stopped (SIGTERM from `timeout` or the lease, SIGINT from a terminal)
stops what it started: vLLM servers, ocrvl daemons and converts, their process groups.

Python's default SIGTERM ends the process at once, no `finally` runs, and a vLLM server
started in a session of its own (as `vllm_server.started` does, so that its engine core goes
with it) outlives the bench holding tens of GB of the card: the next bench's vLLM then fails
with "Engine core initialization failed". `stops_what_it_started` turns SIGTERM and SIGINT
into `Stopped` (a SystemExit) raised in the main thread, so every `finally` and context
manager runs (vLLM's group stopped, daemons stopped, their logs saved); on the way out,
whatever this process started that is still there (its descendants, seen when the signal
came and at the end) gets its process group SIGTERMed, then SIGKILLed. Processes that were
there before (a test's fake server, say) are never touched.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, TypeVar

import psutil

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
KILL_GRACE_S = 10.0  # SIGTERM to SIGKILL for what is left once every `finally` has run

F = TypeVar("F", bound=Callable[..., Any])


class Stopped(SystemExit):
    """The bench got SIGTERM or SIGINT: raised in the main thread, so everything unwinds."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def descendants(pid: int | None = None) -> list[psutil.Process]:
    """Every live process below `pid` (default: this one)."""
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid or os.getpid()).children(recursive=True)
    return []


def end_processes(procs: list[psutil.Process], grace: float = KILL_GRACE_S,
                  what: str = "left over", contained: bool = False) -> list[int]:  # fmt: skip
    """SIGTERM the process groups of `procs` (a group of their own: all of it; this process's
    group: only them), wait up to `grace` s, SIGKILL what is left; returns the pids ended.
    `contained`: a group is signalled whole only if every member of it is in `procs` (never
    someone else's process); otherwise each process alone."""
    own_group = os.getpgrp()
    mine = {p.pid for p in procs}
    alive = [p for p in procs if p.is_running() and p.pid != os.getpid()]
    if not alive:
        return []
    _log(f"stopping {len(alive)} process(es) {what}: "
         + ", ".join(f"{p.pid} {process_name(p)}" for p in alive[:12]))  # fmt: skip
    for sig in (signal.SIGTERM, signal.SIGKILL):
        groups: set[int] = set()
        for p in alive:
            with contextlib.suppress(psutil.Error, OSError):
                pgid = os.getpgid(p.pid)
                whole = pgid != own_group and (not contained or _members(pgid) <= mine)
                if whole and pgid not in groups:
                    groups.add(pgid)
                    os.killpg(pgid, sig)
                else:
                    p.send_signal(sig)
        _, alive = psutil.wait_procs(alive, timeout=grace if sig == signal.SIGTERM else 5)
        if not alive:
            break
    return [p.pid for p in procs]


def _members(pgid: int) -> set[int]:
    """The pids of process group `pgid`."""
    members = set()
    for q in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(q.pid) == pgid:
                members.add(q.pid)
    return members


def process_name(p: psutil.Process) -> str:
    """What `p` runs, shortly: its command line (a title such as vLLM's engine core's), or
    "?" once it is gone."""
    with contextlib.suppress(psutil.Error):
        return " ".join(p.cmdline()[:4])[:120] or p.name()
    return "?"


@contextlib.contextmanager
def stops_what_it_started(grace: float = KILL_GRACE_S) -> Iterator[None]:
    """SIGTERM/SIGINT raise `Stopped` in the main thread (once; a second signal while
    unwinding is ignored so the clean-up is not cut); at the end (after a signal or an
    error) the process groups of whatever this process started and is still there are
    ended. Outside the main thread (no signals there) it only does the latter."""
    before = {p.pid for p in descendants()}
    seen: dict[int, psutil.Process] = {}
    stopping: list[int] = []

    def remember() -> None:
        for p in descendants():
            if p.pid not in before:
                seen.setdefault(p.pid, p)

    def handler(signum: int, frame: FrameType | None) -> None:
        if stopping:
            _log(f"signal {signum} again: still stopping what was started")
            return
        stopping.append(signum)
        remember()  # before the finally blocks run: a daemon's servers are still its children
        _log(f"signal {signum}: stopping what this bench started")
        raise Stopped(signum)

    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS} if main else {}
    ok = False
    try:
        yield
        ok = True
    finally:
        try:
            if not ok or stopping:
                remember()
                end_processes(list(seen.values()), grace)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


def stops_children(func: F) -> F:
    """`func` (a bench's `main`) inside `stops_what_it_started`."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with stops_what_it_started():
            return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]

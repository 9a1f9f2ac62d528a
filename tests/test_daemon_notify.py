"""What the real `ocrvl run` tells systemd, read from a notify socket of our own.

The daemon runs as a child process with NOTIFY_SOCKET pointing at an AF_UNIX datagram socket
in tmp_path (SO_PASSCRED gives each sender's pid) and WATCHDOG_USEC=2 s; it starts the fake
vLLM server itself (`server.launcher: command`). No WATCHDOG_PID: the pid is not known
before the spawn, and the daemon then takes WATCHDOG_USEC as its own.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil
import pytest

from testkit.documents import make_pdf
from testkit.harness import answers_health, free_port, process_alive, wait_until
from testkit.notify_socket import Message, NotifySocket
from testkit.runner import DaemonProcess, managed_fake_server, write_config
from testkit.stubborn import slow_to_stop, stubborn_pids

pytestmark = pytest.mark.slow

WATCHDOG_SECONDS = 2.0  # WATCHDOG_USEC given to the daemon: it must ping every ~1 s
STARTUP_DELAY = 3.0  # the fake server refuses connections this long after launch
# vLLM start-up phases the daemon recognises in the server's log (vllm_diagnosis.parse_phase).
VLLM_PHASES = ("loading weights", "profiling memory", "allocating KV cache",
               "capturing CUDA graphs", "starting API server")


# A process that ignores SIGTERM, like a VLLM::EngineCore slow to let go of the GPU: it
# adds its pid to the file named by its first argument, then waits to be killed.
class NotifiedDaemon:
    """`ocrvl run` with its own inbox, fake server and notify socket."""

    def __init__(self, root: Path, sock: NotifySocket, socket_path: Path, *fake_args: str,
                 stubborn: Path | None = None, **server: Any) -> None:
        self.root = root
        self.sock = sock
        self.inbox = root / "inbox"
        self.inbox.mkdir(parents=True)
        self.port = free_port()
        self.server = managed_fake_server(self.port, *fake_args, **server)
        if stubborn is not None:
            self.server = slow_to_stop(self.server, stubborn)
        self.config = write_config(
            root / "config.yaml",
            inbox={"paths": [str(self.inbox)], "stable_seconds": 0.3, "poll_interval": 0.2},
            server=self.server,
        )
        self.daemon = DaemonProcess(self.config, NOTIFY_SOCKET=str(socket_path),
                                    WATCHDOG_USEC=str(round(WATCHDOG_SECONDS * 1_000_000)))
        self.started_at = 0.0

    @property
    def pid(self) -> int:
        """The daemon's pid."""
        assert self.daemon.proc is not None, "the daemon was not started"
        return self.daemon.proc.pid

    def start(self) -> NotifiedDaemon:
        """Spawn `ocrvl run` (returns at once)."""
        self.started_at = time.monotonic()
        self.daemon.start()
        return self

    def texts(self, start: int = 0, end: int | None = None) -> list[str]:
        """The messages received so far (a slice of them)."""
        return [m.text for m in self.sock.messages[start:end]]

    def expect(self, what: str, match: Callable[[str], bool], after: int = 0,
               timeout: float = 60) -> int:
        """Index of the first message at or after `after` that matches; fails naming `what`."""
        def find() -> tuple[int, Message] | None:
            for index, message in enumerate(self.sock.messages[after:], after):
                if match(message.text):
                    return index, message
            if self.daemon.proc is not None and self.daemon.proc.poll() is not None:
                raise AssertionError(f"ocrvl run exited ({self.daemon.proc.returncode})")
            return None

        try:
            found = wait_until(find, timeout, interval=0.02, what=what, ignore=())
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nsd_notify messages so far: {self.texts()}\n"
                                 f"daemon log (end):\n{self.daemon.log()[-4000:]}") from None
        assert found is not None
        return found[0]

    def pings(self, start: int = 0) -> list[float]:
        """Arrival times of the WATCHDOG=1 messages from index `start` on."""
        return [m.at for m in self.sock.messages[start:] if m.text == "WATCHDOG=1"]

    def stop(self) -> int:
        """SIGTERM; return the exit code once STOPPING=1 came and the process was reaped."""
        assert self.daemon.proc is not None
        before = len(self.sock.messages)
        code = self.daemon.terminate()  # SIGTERM, bounded wait, reap
        stopping = self.expect("STOPPING=1 after SIGTERM", lambda t: t == "STOPPING=1", before,
                               timeout=5)
        later = self.texts(stopping + 1)
        assert not later, f"ocrvl kept talking to systemd after STOPPING=1: {later}"
        return code


@pytest.fixture
def notified(tmp_path: Path) -> Iterator[Callable[..., NotifiedDaemon]]:
    """Factory: `notified(*fake_server_args, stubborn=None, **server_keys)` starts a daemon
    (see NotifiedDaemon); all stopped and reaped after."""
    with ExitStack() as stack:
        def start(*fake_args: str, stubborn: Path | None = None,
                  **server: Any) -> NotifiedDaemon:
            socket_path = tmp_path / "notify"
            sock = NotifySocket(str(socket_path))
            stack.callback(sock.close)
            running = NotifiedDaemon(tmp_path, sock, socket_path, *fake_args,
                                     stubborn=stubborn, **server)
            stack.callback(running.daemon.terminate)  # runs before sock.close
            return running.start()

        yield start


def sighup(running: NotifiedDaemon) -> tuple[int, int]:
    """SIGHUP; returns the indices of RELOADING=1 and of the READY=1 that ends the reload,
    checking MONOTONIC_USEC and that nothing but STATUS/WATCHDOG comes in between."""
    before = len(running.sock.messages)
    sent_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    os.kill(running.pid, signal.SIGHUP)
    reloading = running.expect("RELOADING=1 after SIGHUP",
                               lambda t: t.startswith("RELOADING=1"), before, timeout=10)
    lines = running.texts(reloading, reloading + 1)[0].split("\n")
    assert lines[0] == "RELOADING=1" and lines[1].startswith("MONOTONIC_USEC="), \
        f"RELOADING=1 must carry MONOTONIC_USEC (systemd ≥ 253 requires it): {lines}"
    stamp = int(lines[1].removeprefix("MONOTONIC_USEC="))
    received_usec = round(running.sock.messages[reloading].at * 1_000_000)
    assert sent_usec <= stamp <= received_usec + 1000, \
        "MONOTONIC_USEC is not CLOCK_MONOTONIC at the time of the reload"
    ready = running.expect("READY=1 ending the reload", lambda t: t.startswith("READY=1"),
                           reloading + 1, timeout=10)
    between = [t for t in running.texts(reloading + 1, ready)
               if t != "WATCHDOG=1" and not t.startswith("STATUS=")]
    assert not between, f"unexpected messages during the reload: {between}"
    return reloading, ready


def test_ready_only_once_server_answers_then_status_watchdog_and_stopping(notified) -> None:
    """Start-up, work and stop as systemd sees them, in order."""
    # Pages take ~2 s each, so the book is still converting at the daemon's next status tick
    # (answered at once, it could finish between two ticks and never show progress).
    running = notified("--startup-delay", str(STARTUP_DELAY),
                       "--step-t0-ms", "10", "--output-tokens", "fixed:200")
    ready = running.expect("READY=1", lambda t: t.startswith("READY=1"))
    ready_at = running.sock.messages[ready].at
    assert answers_health(f"http://127.0.0.1:{running.port}"), \
        "ocrvl said READY=1 while the model server's /health did not answer 200"
    assert ready_at - running.started_at >= STARTUP_DELAY, \
        f"READY=1 came {ready_at - running.started_at:.1f}s after start, before the fake " \
        f"server could be up ({STARTUP_DELAY:g}s start-up delay)"

    before_ready = running.texts(0, ready)
    extends = [t for t in before_ready if t.startswith("EXTEND_TIMEOUT_USEC=")]
    assert extends, f"no EXTEND_TIMEOUT_USEC while the server started: {before_ready}"
    assert int(extends[0].split("=")[1]) >= 30_000_000, \
        f"EXTEND_TIMEOUT_USEC asks for too little time: {extends[0]}"
    statuses = [t.removeprefix("STATUS=") for t in before_ready if t.startswith("STATUS=")]
    phases = [s for s in statuses if s.removeprefix("starting server: ") in VLLM_PHASES]
    assert phases, f"`systemctl status` never showed a server start-up phase: {statuses}"
    assert all(s.startswith("starting server") for s in statuses), \
        f"before READY=1 every status should say the server is starting: {statuses}"

    idle = running.expect("STATUS=idle after READY=1",
                          lambda t: t == "STATUS=idle, 0 done, 0 queued", ready, timeout=10)
    book = make_pdf(running.inbox / "book.pdf", 3)
    busy = running.expect("a progress STATUS while book.pdf converts",
                          lambda t: t.startswith("STATUS=book.pdf p."), idle)
    running.expect("STATUS=idle, 1 done after the conversion",
                   lambda t: t == "STATUS=idle, 1 done, 0 queued", busy)
    assert book.with_suffix(".md").exists(), "book.md was not written"
    # The watchdog keeps being pinged through start-up, idling and converting.
    wait_until(lambda: len(running.pings(idle)) >= 4, 10, what="four watchdog pings")

    pings = running.pings()
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    assert max(gaps) < WATCHDOG_SECONDS, \
        f"a watchdog ping came too late: systemd would have killed ocrvl (gaps {gaps})"
    # Pings are sent at most once per half WATCHDOG_USEC (by the daemon's clock), not on every
    # turn of the loop (ten a second): whatever the delays on the way, no more than this came.
    most = (pings[-1] - pings[0]) / (WATCHDOG_SECONDS / 2) + 2
    assert len(pings) <= most, \
        f"{len(pings)} watchdog pings in {pings[-1] - pings[0]:.1f}s: ocrvl floods systemd " \
        f"(one per {WATCHDOG_SECONDS / 2:g}s is asked for)"
    senders = {m.pid for m in running.sock.messages}
    assert senders == {running.pid}, \
        f"a process other than ocrvl ({senders - {running.pid}}) wrote to the notify socket"

    assert running.stop() == 0, f"ocrvl did not exit 0 on SIGTERM:\n{running.daemon.log()}"


def test_sighup_reloads_and_a_bad_config_is_rejected(notified) -> None:
    """SIGHUP: RELOADING=1 then READY=1; a broken config is refused and the old one stays."""
    running = notified()
    running.expect("READY=1", lambda t: t.startswith("READY=1"))
    second = running.root / "second-inbox"
    second.mkdir()
    write_config(running.config, inbox={"paths": [str(running.inbox), str(second)],
                                        "stable_seconds": 0.3, "poll_interval": 0.2},
                 server=managed_fake_server(running.port))
    sighup(running)
    wait_until(lambda: "configuration reloaded" in running.daemon.log(), 10,
               what="the 'configuration reloaded' log line")
    first = make_pdf(second / "first.pdf", 1)
    wait_until(first.with_suffix(".md").exists, 60,
               what="a PDF in the inbox added by the reload to be converted")

    # A broken config: it names another inbox and has an invalid value.
    running.config.write_text(
        f"inbox: {{paths: [{running.root / 'elsewhere'}], stable_seconds: soon}}\n")
    sighup(running)
    wait_until(lambda: "reload rejected" in running.daemon.log(), 10,
               what="a log line saying the reload was rejected")
    rejected = next(line for line in running.daemon.log().splitlines()
                    if "reload rejected" in line)
    assert "ERROR" in rejected and "inbox.stable_seconds" in rejected, \
        f"the rejection should be an error naming the bad key: {rejected}"
    second_pdf = make_pdf(second / "second.pdf", 1, seed=1)
    wait_until(second_pdf.with_suffix(".md").exists, 60,
               what="the running configuration (with its second inbox) to stay in force")
    assert running.daemon.proc is not None and running.daemon.proc.poll() is None, \
        "a bad config on reload stopped ocrvl"
    assert running.stop() == 0, f"ocrvl did not exit 0 on SIGTERM:\n{running.daemon.log()}"


def test_watchdog_pings_stop_while_the_main_loop_is_stuck(notified) -> None:
    """A main loop blocked on a locked database must stop pinging (systemd then restarts
    ocrvl), even though the process and its other threads live on."""
    running = notified()
    running.expect("READY=1", lambda t: t.startswith("READY=1"))
    wait_until(lambda: len(running.pings()) >= 2, 10, what="watchdog pings")
    db = running.root / "state" / "jobs.sqlite"
    lock = sqlite3.connect(db, timeout=10, isolation_level=None)
    try:
        # The loop takes a PDF dropped in the inbox into the store: that write now waits.
        lock.execute("BEGIN EXCLUSIVE")
        locked_at = time.monotonic()
        make_pdf(running.inbox / "blocked.pdf", 1)
        silent = 2.5 * WATCHDOG_SECONDS / 2

        def quiet_long_enough() -> bool:
            last = max(running.pings(), default=locked_at)
            return time.monotonic() - max(last, locked_at) >= silent

        try:
            wait_until(quiet_long_enough, 2.0 + WATCHDOG_SECONDS + silent + 5, interval=0.05,
                       what="the watchdog pings to stop", ignore=())
        except AssertionError:
            raise AssertionError(
                "ocrvl kept pinging the watchdog while its main loop was blocked on the "
                f"locked database (pings at {running.pings()}, locked at {locked_at})") from None
        assert process_alive(running.pid), "ocrvl died instead of being stuck"
        threads = len(os.listdir(f"/proc/{running.pid}/task"))
        assert threads > 1, "ocrvl's other threads should still be alive"
        assert answers_health(f"http://127.0.0.1:{running.port}"), \
            "the model server should still be up"
        released_at = time.monotonic()
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    wait_until(lambda: any(at > released_at for at in running.pings()), 5,
               what="watchdog pings to resume once the main loop is unblocked")
    assert running.stop() == 0, f"ocrvl did not exit 0 on SIGTERM:\n{running.daemon.log()}"


def descendants(pid: int) -> list[psutil.Process]:
    """The processes `pid` started (and theirs)."""
    return psutil.Process(pid).children(recursive=True)


@pytest.fixture
def stubborn(tmp_path: Path) -> Iterator[Path]:
    """The pid file for `notified(stubborn=...)`; the processes are killed after the test
    (before the daemon is stopped: request this fixture after `notified`)."""
    pidfile = tmp_path / "stubborn.pid"
    yield pidfile
    for pid in stubborn_pids(pidfile):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_reload_that_restarts_a_slow_to_stop_server_keeps_pinging_the_watchdog(
        notified, stubborn: Path) -> None:
    """Stopping the old server can take longer than the watchdog allows (vLLM: ~50 s): the
    main loop must go on pinging while it stops, and start the new server after."""
    running = notified(stubborn=stubborn, stop_timeout=8)
    running.expect("READY=1", lambda t: t.startswith("READY=1"))
    old = wait_until(lambda: stubborn_pids(stubborn), 30,
                     what="the server's stubborn process to start")[0]
    write_config(running.config, inbox={"paths": [str(running.inbox)], "stable_seconds": 0.3,
                                        "poll_interval": 0.2},
                 server={**running.server, "health_interval": 0.4})  # needs a new server
    reloading, _ = sighup(running)

    def pinged_twice_or_old_server_gone() -> bool:
        return len(running.pings(reloading)) >= 2 or not process_alive(old)

    wait_until(pinged_twice_or_old_server_gone, 30, what="watchdog pings after the reload")
    assert process_alive(old), \
        "no watchdog ping while the old server was stopping: systemd would kill ocrvl during " \
        f"a reload (messages since RELOADING=1: {running.texts(reloading)})"
    wait_until(lambda: not process_alive(old), 30, what="the old server to be killed")
    wait_until(lambda: len(stubborn_pids(stubborn)) == 2, 30,
               what="the new server to start once the old one is gone")
    wait_until(lambda: answers_health(f"http://127.0.0.1:{running.port}"), 30,
               what="the new server to answer")
    book = make_pdf(running.inbox / "book.pdf", 1)
    wait_until(book.with_suffix(".md").exists, 60, what="a PDF converted by the new server")
    assert running.stop() == 0, f"ocrvl did not exit 0 on SIGTERM:\n{running.daemon.log()}"


def test_a_second_sigterm_while_stopping_kills_everything_and_exits_at_once(
        notified, stubborn: Path) -> None:
    """The first SIGTERM stops gracefully, which waits for a server that ignores SIGTERM;
    a second one (an impatient user) ends ocrvl within seconds and leaves no process."""
    running = notified(stubborn=stubborn, stop_timeout=120)
    running.expect("READY=1", lambda t: t.startswith("READY=1"))
    wait_until(lambda: "engine worker" in running.daemon.log() and
               " ready in " in running.daemon.log(), 60, what="the engine worker to be ready")
    wait_until(lambda: stubborn_pids(stubborn), 30, what="the server's stubborn process to start")
    children = descendants(running.pid)
    assert len(children) >= 3, f"expected the server, its stubborn child and the engine " \
        f"worker: {children}"
    os.kill(running.pid, signal.SIGTERM)
    wait_until(lambda: "SIGTERM to process group" in running.daemon.log(), 30,
               what="the graceful stop to reach the server")
    os.kill(running.pid, signal.SIGTERM)
    forced_at = time.monotonic()
    proc = running.daemon.proc
    assert proc is not None
    code = wait_until(lambda: proc.poll() is not None and (proc.returncode,), 30,
                      what="ocrvl to exit after the second SIGTERM")[0]
    took = time.monotonic() - forced_at
    log = running.daemon.log()
    assert took < 10, f"ocrvl took {took:.1f}s to exit after a second SIGTERM:\n{log[-3000:]}"
    assert code == 130, f"a forced stop should exit 130 (interrupted), not {code}"
    assert "again while stopping" in log, "the forced stop was not logged"
    wait_until(lambda: not any(process_alive(p.pid) for p in children), 10,
               what=f"no process left behind ({children})")

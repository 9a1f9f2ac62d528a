"""Talking to systemd: readiness, status, reload, watchdog; all no-ops outside systemd.

The daemon's main loop owns a `Notifier` and calls `tick()` every iteration: the watchdog
ping comes from the loop itself (no thread), so a stuck loop stops pinging and systemd
restarts the service (`WatchdogSec=` in the unit).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

import sdnotify

from ocrvl_daemon.files.names import shown

log = logging.getLogger(__name__)

# Variables addressed to this process alone: a child that inherited them could tell systemd
# it is ready or alive on our behalf (NotifyAccess=main would reject it, noisily).
NOTIFY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_PID", "LISTEN_FDS",
              "LISTEN_FDNAMES")
# An unchanged STATUS= line is repeated at most this often.
STATUS_REPEAT_SECONDS = 30.0


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without the sd_notify variables, for the processes ocrvl starts."""
    return {key: value for key, value in env.items() if key not in NOTIFY_ENV}


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds, the clock systemd compares RELOADING=1 against."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class Notifier:
    """sd_notify messages to the service manager, if there is one (NOTIFY_SOCKET).

    No lock: one thread at a time uses it (the main loop; at shutdown the thread that stops).
    """

    def __init__(self) -> None:
        self.socket_path = os.environ.get("NOTIFY_SOCKET") or None
        self._interval = _watchdog_interval(os.environ)
        self._last_ping: float | None = None
        self._last_status: str | None = None
        self._last_status_at = 0.0
        self._sd: sdnotify.SystemdNotifier | None = None
        self._warned = False
        if self.socket_path:
            try:
                # sdnotify resolves the address, including abstract sockets ('@name').
                self._sd = sdnotify.SystemdNotifier(debug=True)
            except OSError as exc:
                log.warning("Cannot connect to systemd's NOTIFY_SOCKET %s (%s); systemd will "
                            "not hear that ocrvl is ready", self.socket_path, exc)

    @property
    def enabled(self) -> bool:
        """Whether messages go anywhere."""
        return self._sd is not None

    def ready(self, status: str | None = None) -> None:
        """Startup (or a reload) is complete."""
        self._send("READY=1", None if status is None else _one_line(status))

    def status(self, line: str, now: float | None = None) -> None:
        """Show `line` in `systemctl status`; an unchanged line is resent at most every 30 s."""
        now = time.monotonic() if now is None else now
        line = _one_line(line)
        if line == self._last_status and now - self._last_status_at < STATUS_REPEAT_SECONDS:
            return
        self._send(status=line, now=now)

    def extend_timeout(self, seconds: float) -> None:
        """Ask for `seconds` more before systemd gives up on the start (or stop)."""
        self._send(f"EXTEND_TIMEOUT_USEC={round(seconds * 1_000_000)}")

    def reloading(self) -> None:
        """A reload began; `ready()` ends it."""
        self._send(f"RELOADING=1\nMONOTONIC_USEC={monotonic_usec()}")

    def stopping(self) -> None:
        """A clean shutdown began."""
        self._send("STOPPING=1")

    def close(self) -> None:
        """Close the socket to systemd; later messages go nowhere."""
        if self._sd is not None:
            self._sd.socket.close()
            self._sd = None

    def watchdog_interval(self) -> float | None:
        """Seconds between watchdog pings (half of WATCHDOG_USEC); None when not asked for."""
        return self._interval if self.enabled else None

    def tick(self, now: float | None = None) -> None:
        """Ping the watchdog if an interval has passed since the last ping.

        Call it on every main-loop iteration; the loop must come round more often than
        `watchdog_interval()`.
        """
        interval = self.watchdog_interval()
        if interval is None:
            return
        now = time.monotonic() if now is None else now
        if self._last_ping is None or now - self._last_ping >= interval:
            self._last_ping = now
            self._send("WATCHDOG=1")

    def _send(self, message: str = "", status: str | None = None,
              now: float | None = None) -> None:
        if status is not None:
            message = f"{message}\nSTATUS={status}" if message else f"STATUS={status}"
            self._last_status = status
            self._last_status_at = time.monotonic() if now is None else now
        if self._sd is None:
            return
        try:
            # Not sdnotify's notify(): it encodes as Latin-1, and systemd drops a STATUS=
            # that is not UTF-8 (the status line uses '·', a file name may be any bytes).
            self._sd.socket.sendall(shown(message).encode("utf-8"))
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("Cannot notify systemd via %s: %s", self.socket_path, exc)


def _one_line(text: str) -> str:
    # systemd reads a datagram as newline-separated assignments.
    return " ".join(text.split())


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    # Inherited by a process that is not the one systemd watches: not ours to ping.
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 2 / 1_000_000

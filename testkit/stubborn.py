"""A process in a managed server's group that ignores SIGTERM: a server slow to stop."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

STUBBORN = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "open(sys.argv[1], 'a').write(f'{os.getpid()}\\n'); time.sleep(3600)")


def slow_to_stop(server: dict[str, Any], pidfile: Path) -> dict[str, Any]:
    """`server` (a managed fake server section) with a process in the server's process group
    that ignores SIGTERM: stopping the server then takes its whole `server.stop_timeout`,
    until the SIGKILL. The process adds its pid to `pidfile`."""
    script = '"$0" -c "$1" "$2" & shift 2; exec "$@"'
    return {**server, "command": ["sh", "-c", script, sys.executable, STUBBORN, str(pidfile),
                                  *server["command"]]}


def stubborn_pids(pidfile: Path) -> list[int]:
    """The pids of the stubborn processes started so far, oldest first."""
    return [int(line) for line in pidfile.read_text().split()] if pidfile.exists() else []

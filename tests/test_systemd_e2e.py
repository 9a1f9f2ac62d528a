"""The real `ocrvl run` as the installed user unit under a real `systemd --user`.

testkit/systemd_user.py runs the manager and journald in this container (skipped, with the
reason, where the machine cannot). `ocrvl install-service` writes the unit; the daemon
starts the fake vLLM server itself (with a start-up delay, so "activating" can be seen) and
converts a PDF with the real pipeline (layout detection off). Both ways of logging into the
journal are covered: `<N>` priority prefixes on stderr, and systemd-python's JournalHandler
with OCRVL_* fields.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ocrvl_daemon.commands.install_service import UNIT_NAME, install_service
from testkit.documents import make_pdf
from testkit.harness import answers_health, free_port, process_alive
from testkit.runner import PACKAGE_ROOT, managed_fake_server, write_config
from testkit.systemd_user import (
    UserManager,
    cgroup_pids,
    cgroup_roots,
    unavailable_reason,
    user_manager,
)

pytestmark = pytest.mark.slow

STARTUP_DELAY = 3.0  # the fake server refuses connections this long after launch
WATCHDOG_SEC = 4  # a drop-in shortens the unit's WatchdogSec so systemd really checks pings
UNIT_MATCH = f"_SYSTEMD_USER_UNIT={UNIT_NAME}"
# Runs `python -m ocrvl_daemon` from this checkout; exec keeps the pid systemd watches.
LAUNCHER = """#!/bin/sh
export PYTHONPATH={root}${{PYTHONPATH:+:$PYTHONPATH}}
exec {python} {module} "$@"
"""
# Without systemd-python ocrvl logs `<N>`-prefixed lines on stderr for journald to parse.
WITHOUT_SYSTEMD_PYTHON = ("-c 'import runpy, sys; sys.modules[\"systemd\"] = None; "
                          "runpy.run_module(\"ocrvl_daemon\", run_name=\"__main__\", "
                          "alter_sys=True)'")


@pytest.fixture
def manager() -> Iterator[UserManager]:
    """A running `systemd --user` (skipped, saying why, where this machine cannot run one)."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"cannot run a systemd user manager here: {reason}")
    with user_manager() as running:
        yield running


def have_systemd_python() -> bool:
    """Whether systemd-python (ocrvl's optional journald extra) is importable."""
    try:
        import systemd.journal  # noqa: F401
    except ImportError:
        return False
    return True


def cmdline(pid: int) -> list[str]:
    """A process's argv ([] once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def write_launcher(path: Path, journal_handler: bool) -> Path:
    """An executable that runs this checkout's `ocrvl` (what ExecStart= will point at)."""
    module = "-m ocrvl_daemon" if journal_handler else WITHOUT_SYSTEMD_PYTHON
    path.write_text(LAUNCHER.format(root=shlex.quote(str(PACKAGE_ROOT)),
                                    python=shlex.quote(sys.executable), module=module))
    path.chmod(0o755)
    return path


def wait_until_active(manager: UserManager, port: int) -> None:
    """Wait for ActiveState=active, checking that it is `activating` (showing the server's
    start-up in its status) while the model server does not answer yet, never `active`."""
    samples: list[tuple[str, str, bool]] = []

    def active() -> bool:
        state = manager.show(UNIT_NAME, "ActiveState")
        status = manager.show(UNIT_NAME, "StatusText")
        samples.append((state, status, answers_health(f"http://127.0.0.1:{port}")))
        if state == "failed" or manager.show(UNIT_NAME, "SubState") == "auto-restart":
            raise AssertionError(f"ocrvl.service failed to start:\n"
                                 f"{manager.journal('-o', 'cat', UNIT_MATCH)[-4000:]}")
        return state == "active"

    manager.wait_for("ocrvl.service to become active", active, timeout=90)
    assert all(up for state, _, up in samples if state == "active"), \
        "systemd showed ocrvl active while the model server was not answering yet"
    starting = [status for state, status, up in samples if state == "activating" and not up]
    assert starting, f"ocrvl.service was never seen activating while the server started: " \
                     f"{samples}"
    assert any(status.startswith("starting server") for status in starting), \
        f"`systemctl status` did not say the server is starting: {starting}"


@pytest.mark.parametrize("logging_via", ["prefixes", "journal-handler"])
def test_ocrvl_service_starts_converts_reloads_and_stops_cleanly(manager: UserManager,
                                                                 logging_via: str) -> None:
    """install-service, start (activating until the server is up), convert, reload, stop."""
    via_handler = logging_via == "journal-handler"
    if via_handler and not have_systemd_python():
        pytest.skip("systemd-python is not installed (pip install 'ocrvl-daemon[journald]')")
    root = manager.base
    inbox = root / "inbox"
    inbox.mkdir()
    port = free_port()
    # Spaces, `$` and `%` in the config's path prove ExecStart= quoting (an unset variable:
    # ocrvl itself expands `$VARS` in --config, so `$HOME` would name another file).
    config = write_config(root / "my config $OCRVL_UNSET 100%.yaml",
                          inbox={"paths": [str(inbox)], "stable_seconds": 0.3,
                                 "poll_interval": 0.2},
                          server=managed_fake_server(port, "--startup-delay", str(STARTUP_DELAY)))
    launcher = write_launcher(root / "ocrvl", journal_handler=via_handler)

    install_service(config, dry_run=False, force=False, exec_path=launcher,
                    unit_dir=manager.unit_dir, run=manager.run)
    assert manager.systemctl("is-enabled", UNIT_NAME).stdout.strip() == "enabled", \
        "install-service did not enable the unit"
    manager.drop_in(UNIT_NAME, f"[Service]\nWatchdogSec={WATCHDOG_SEC}\n")

    # Start: activating while the model server starts, active only once it answers.
    manager.systemctl("start", "--no-block", UNIT_NAME)
    wait_until_active(manager, port)
    manager.wait_for("the idle status line", lambda: manager.show(UNIT_NAME, "StatusText")
                     == "idle, 0 done, 0 queued")
    main_pid = int(manager.show(UNIT_NAME, "MainPID"))
    assert cmdline(main_pid)[-3:] == ["run", "--config", str(config)], \
        f"ExecStart= did not pass the config path intact: {cmdline(main_pid)}"

    # Convert a PDF dropped into the inbox.
    book = make_pdf(inbox / "book.pdf", 2)
    manager.wait_for("book.md to be written", book.with_suffix(".md").exists, timeout=90)
    manager.wait_for("the status to count the conversion", lambda: manager.show(
        UNIT_NAME, "StatusText") == "idle, 1 done, 0 queued")
    service_cgroups = [root_ / manager.cgroup / "app.slice" / UNIT_NAME
                       for root_ in cgroup_roots()]
    running = set().union(*(cgroup_pids(path) for path in service_cgroups))
    names = {pid: " ".join(cmdline(pid)) for pid in running}
    servers = [pid for pid in running if "testkit.fake_server" in cmdline(pid)]
    engines = [pid for pid in running if "ocrvl_daemon.worker.main import serve" in names[pid]]
    assert main_pid in running and servers and engines, \
        f"expected ocrvl, the model server and an engine worker in the unit's cgroup: " \
        f"{names}"
    server_env = Path(f"/proc/{servers[0]}/environ").read_bytes().split(b"\0")
    assert not [v for v in server_env if v.startswith((b"NOTIFY_SOCKET=", b"WATCHDOG_"))], \
        "the model server inherited systemd's notify variables (it could speak for ocrvl)"

    # The journal: the conversion is there; `-p warning` shows warnings but no INFO lines.
    done_line = manager.wait_for("the conversion in the journal", lambda: next(
        (line for line in manager.journal("-o", "cat", UNIT_MATCH).splitlines()
         if "book.pdf: done" in line), None))
    assert not done_line.startswith("<"), f"a priority prefix reached the journal: {done_line}"
    warnings = manager.journal("-o", "cat", "-p", "warning", UNIT_MATCH)
    assert "ignoring unmodelled args" in warnings, \
        f"the model server's WARNING line is missing from `journalctl -p warning`: {warnings}"
    assert "book.pdf: done" not in warnings and "ready: server up" not in warnings, \
        f"`journalctl -p warning` shows INFO lines: log priorities are lost:\n{warnings}"
    if via_handler:
        fields = manager.journal("-o", "cat", UNIT_MATCH, f"OCRVL_PDF={book}")
        assert "book.pdf: done" in fields, "the journal has no OCRVL_PDF field for the book"

    # Reload: ExecReload sends SIGHUP; RELOADING=1, then READY=1 brings it back to active.
    manager.systemctl("reload", "--no-block", UNIT_NAME)
    manager.wait_for("the reload in the journal", lambda: "configuration reloaded" in
                     manager.journal("-o", "cat", UNIT_MATCH))
    manager.wait_for("the reload job to end",
                     lambda: "No jobs" in manager.systemctl("list-jobs").stdout)
    assert manager.show(UNIT_NAME, "ActiveState") == "active", "not active after the reload"
    assert int(manager.show(UNIT_NAME, "MainPID")) == main_pid, "the reload restarted ocrvl"

    # Stop: ocrvl stops the server and the worker itself; nothing is left behind.
    manager.systemctl("stop", UNIT_NAME)
    assert manager.show(UNIT_NAME, "ActiveState") == "inactive"
    result = {prop: manager.show(UNIT_NAME, prop)
              for prop in ("Result", "ExecMainStatus", "NRestarts")}
    assert result == {"Result": "success", "ExecMainStatus": "0", "NRestarts": "0"}, \
        f"ocrvl did not run and stop cleanly (a watchdog timeout or a crash?): {result}"
    manager.wait_for(f"every process that ran in the unit to be gone: {names}",
                     lambda: not any(process_alive(pid) for pid in running))
    assert not any(cgroup_pids(path) for path in service_cgroups), \
        "processes are left in ocrvl.service's cgroup after the stop"
    journal = manager.journal("-o", "cat", UNIT_MATCH)
    reaped = [f"reaped server pid {servers[0]}", f"reaped engine worker pid {engines[0]}"]
    assert all(line in journal for line in reaped) and journal.rstrip().endswith("stopped"), \
        f"ocrvl did not stop the model server and the worker itself:\n{journal[-3000:]}"
    said = manager.manager_messages(UNIT_NAME)
    assert "Stopped ocrvl.service" in said, f"the manager's log is missing: {said}"
    assert "Watchdog" not in said, f"systemd's watchdog fired:\n{said}"
    killed = {int(pid): names.get(int(pid), "?")
              for pid in re.findall(r"Killing process (\d+)", said)}
    assert not killed, f"systemd had to kill what ocrvl left behind: {killed}\n{said}"

"""The installed unit under a real `systemd --user` (see tests/systemd_user.py).

The service is a stand-in for `ocrvl run`: a small script that speaks sd_notify through
ocrvl's Notifier and logs through ocrvl's logging set-up, and holds each step until the
test allows it, so the states in between can be seen.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from systemd_user import cgroup_pids, cgroup_roots, unavailable_reason, user_manager

import ocrvl_daemon
from ocrvl_daemon.service import UNIT_NAME, install_service

pytestmark = pytest.mark.slow

STUB = '''#!{python}
"""Stand-in for `ocrvl run`: notify, log, reload on HUP, leave a child to be killed."""
import json, logging, os, signal, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, {package_parent!r})
if {hide_systemd_python!r}:
    sys.modules["systemd"] = None  # log through `<N>` prefixes on stderr instead
from ocrvl_daemon.logs import doc_fields, setup_logging
from ocrvl_daemon.systemd import Notifier, StatusSnapshot, child_env, format_status

state = Path({state!r})
got = []
signal.signal(signal.SIGHUP, lambda *_: got.append("HUP"))
signal.signal(signal.SIGTERM, lambda *_: got.append("TERM"))
setup_logging("INFO")
log = logging.getLogger("ocrvl_daemon.stub")
notifier = Notifier()
# Stands in for the model server: its own session, like vLLM, so only the cgroup holds it.
child = subprocess.Popen(["sleep", "1000"], env=child_env(os.environ), start_new_session=True)
(state / "info.json").write_text(json.dumps({{
    "argv": sys.argv[1:], "child": child.pid, "pid": os.getpid(),
    "notify_socket": os.environ.get("NOTIFY_SOCKET"),
    "watchdog_usec": os.environ.get("WATCHDOG_USEC"),
}}))
log.warning("stub warning", extra=doc_fields(Path("/inbox/book.pdf"), page=3, job=7))
log.info("stub info line")


def wait_for(name):
    while not (state / name).exists():
        notifier.tick()
        time.sleep(0.02)


(state / "waiting").touch()
wait_for("go-ready")
notifier.ready(format_status(StatusSnapshot()))
reloads = 0
while "TERM" not in got:
    notifier.tick()
    if "HUP" in got:
        got.remove("HUP")
        notifier.reloading()
        reloads += 1
        (state / "reloads").write_text(str(reloads))
        wait_for(f"go-reload-{{reloads}}")
        notifier.ready()
    time.sleep(0.02)
notifier.stopping()
log.info("stub stopping")
'''


@pytest.fixture
def manager():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"cannot run a systemd user manager here: {reason}")
    with user_manager() as running:
        yield running


def _have_systemd_python() -> bool:
    try:
        import systemd.journal  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("logging_via", ["prefixes", "journal-handler"])
def test_unit_lifecycle_under_real_user_manager(manager, logging_via: str) -> None:
    via_handler = logging_via == "journal-handler"
    if via_handler and not _have_systemd_python():
        pytest.skip("systemd-python is not installed (pip install 'ocrvl-daemon[journald]')")
    state = manager.base / "stub"
    state.mkdir()
    stub = state / "ocrvl"
    stub.write_text(STUB.format(python=sys.executable, state=str(state),
                                package_parent=str(Path(ocrvl_daemon.__file__).parent.parent),
                                hide_systemd_python=not via_handler))
    stub.chmod(0o755)
    # Spaces, `$` and `%` in an argument prove ExecStart= quoting.
    config = manager.base / "my config $HOME 100%.yaml"

    install_service(config, dry_run=False, force=False, exec_path=stub,
                    unit_dir=manager.unit_dir, run=manager.run)
    assert manager.systemctl("is-enabled", UNIT_NAME).stdout.strip() == "enabled"

    # Active only once READY=1 came.
    manager.systemctl("start", "--no-block", UNIT_NAME)
    manager.wait_for("the stub to start", (state / "waiting").exists)
    assert manager.show(UNIT_NAME, "ActiveState") == "activating"
    (state / "go-ready").touch()
    manager.wait_for("active", lambda: manager.show(UNIT_NAME, "ActiveState") == "active")
    assert manager.show(UNIT_NAME, "StatusText") == "idle, 0 done, 0 queued"

    info = json.loads((state / "info.json").read_text())
    assert info["argv"] == ["run", "--config", str(config)]
    assert info["notify_socket"] and info["watchdog_usec"] == "60000000"
    assert manager.show(UNIT_NAME, "MainPID") == str(info["pid"])
    child_env = Path(f"/proc/{info['child']}/environ").read_bytes().split(b"\0")
    assert not [v for v in child_env if v.startswith((b"NOTIFY_SOCKET=", b"WATCHDOG_"))]

    # Reload: ExecReload sends HUP, the stub says RELOADING=1 and later READY=1. --no-block:
    # when RELOADING=1 beats the end of ExecReload, the reload job lasts until READY=1.
    manager.systemctl("reload", "--no-block", UNIT_NAME)
    manager.wait_for("the stub to get SIGHUP", (state / "reloads").exists)
    manager.wait_for("reloading", lambda: manager.show(UNIT_NAME, "ActiveState") == "reloading")
    (state / "go-reload-1").touch()
    manager.wait_for("active again",
                     lambda: manager.show(UNIT_NAME, "ActiveState") == "active")
    manager.wait_for("the reload job to end",
                     lambda: "No jobs" in manager.systemctl("list-jobs").stdout)
    assert (state / "reloads").read_text() == "1"

    # Priorities reach the journal (prefixes, or journald fields through systemd-python).
    unit_match = f"_SYSTEMD_USER_UNIT={UNIT_NAME}"
    warnings = manager.wait_for(
        "the warning in the journal",
        lambda: "stub warning" in (out := manager.journal("-o", "cat", "-p", "warning",
                                                          unit_match)) and out)
    assert "stub info line" not in warnings
    assert "stub info line" in manager.journal("-o", "cat", unit_match)
    if via_handler:
        fields = manager.journal("-o", "cat", unit_match, "OCRVL_PDF=/inbox/book.pdf",
                                 "OCRVL_PAGE=3", "OCRVL_JOB=7")
        assert "stub warning" in fields

    # Stop: SIGTERM to the stub, SIGKILL for what is left (KillMode=mixed): nothing stays.
    service_cgroups = [root / manager.cgroup / "app.slice" / UNIT_NAME for root in cgroup_roots()]
    manager.systemctl("stop", UNIT_NAME)
    assert manager.show(UNIT_NAME, "ActiveState") == "inactive"
    assert manager.show(UNIT_NAME, "Result") == "success"
    for pid in (info["pid"], info["child"]):
        manager.wait_for(f"process {pid} to be gone",
                         lambda p=pid: not os.path.exists(f"/proc/{p}"))
    assert not any(cgroup_pids(path) for path in service_cgroups)
    assert "stub stopping" in manager.journal("-o", "cat", unit_match)

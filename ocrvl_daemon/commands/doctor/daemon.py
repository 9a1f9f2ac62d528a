"""`ocrvl doctor`'s checks of the daemon's own set-up: the state folder, the inboxes, the
server it would talk to, and systemd."""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import httpx

from ocrvl_daemon.commands.doctor.report import Check
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.config.models import trust_mm_kwargs_fix
from ocrvl_daemon.config.values import folder_problem
from ocrvl_daemon.process.group import GroupRecord, group_members
from ocrvl_daemon.server.managed import port_in_use
from ocrvl_daemon.server.probe import (
    ENDPOINT_ABSENT,
    bearer_header,
    page_refusal,
    served_model_fix,
)
from ocrvl_daemon.server.replicas import PIDFILE_GLOB

SYSTEMD_TIMEOUT = 5.0


HTTP_TIMEOUT = 3.0


def state_dir_check(config: Config) -> Check:
    state = config.state_dir
    problem = folder_problem(state) or _write_problem(state)
    if problem is not None:
        return Check("state_dir", "fail", f"state_dir = {state} cannot be used: {problem}",
                     "set state_dir in the config file to a folder this user can create and "
                     "write (the default is ~/.local/state/ocrvl)")
    return Check("state_dir", "ok", f"{state} is usable")


def _write_problem(folder: Path) -> str | None:
    """Why `folder` cannot be created and written, found by doing so as `ocrvl run` will
    (`access()` says yes to root anywhere, even under /proc); what this made is removed."""
    made = [p for p in (folder, *folder.parents) if not os.path.lexists(p)]  # deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        return f"it cannot be created: {exc.strerror or exc}"
    try:
        fd, probe = tempfile.mkstemp(prefix=".ocrvl-doctor-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"a file cannot be written in it: {exc.strerror or exc}"
    finally:
        for created in made:
            with contextlib.suppress(OSError):
                created.rmdir()
    return None


def inbox_checks(config: Config) -> list[Check]:
    checks = []
    for path in config.inbox.paths:
        problem = folder_problem(path)
        if not path.exists() and problem is not None:
            checks.append(Check("inbox", "fail", f"{path} {problem}: `ocrvl run` would watch "
                                "nothing there", "point inbox.paths at a folder this user can "
                                "create, or fix the path"))
        elif not path.exists():
            checks.append(Check("inbox", "warn", f"{path} does not exist (`ocrvl run` "
                                "creates it)", f"mkdir -p {path}"))
        elif not path.is_dir():
            checks.append(Check("inbox", "fail", f"{path} is not a folder",
                                "point inbox.paths at a folder"))
        elif not os.access(path, os.W_OK | os.X_OK):
            checks.append(Check("inbox", "fail", f"{path} is not writable: the Markdown is "
                                "written next to each PDF", f"chmod u+rwx {path}"))
        else:
            checks.append(Check("inbox", "ok", f"{path} exists and is writable"))
        fs_check = _filesystem_check(config, path)
        if fs_check:
            checks.append(fs_check)
    return checks


def _filesystem_check(config: Config, path: Path) -> Check | None:
    try:
        from ocrvl_daemon.inbox import filesystems  # written alongside; absent in older trees
    except ImportError:
        return None
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    fstype = filesystems.filesystem_type(existing)
    polling = config.inbox.polling
    if not filesystems.needs_polling(fstype):
        return Check("inbox filesystem", "ok", f"{path}: {fstype}, change events work")
    if polling is False:
        return Check("inbox filesystem", "warn", f"{path}: {fstype} sends no change events "
                     "and inbox.polling is false: new PDFs are only seen by the periodic rescan",
                     "set inbox.polling: true (or auto)")
    return Check("inbox filesystem", "info", f"{path}: {fstype} sends no change events; "
                 "polling is used")


def server_check(config: Config) -> Check:
    server = config.server
    root = server.root_url
    external = server.mode == "external"
    headers = bearer_header(server.api_key)
    try:
        health = httpx.get(f"{root}/health", timeout=HTTP_TIMEOUT, headers=headers)
        models = httpx.get(f"{server.base_url}/models", timeout=HTTP_TIMEOUT, headers=headers)
    except httpx.HTTPError as exc:
        if external:
            return Check("server", "fail", f"{root} does not answer ({type(exc).__name__})",
                         "start the server, or correct server.url")
        if port_in_use(server.host, server.port):
            return _port_taken(config, "it does not answer HTTP")
        return Check("server", "info", f"not running at {root} (ocrvl starts it when needed)")
    if not external and not _ocrvl_server_running(config):
        return _port_taken(config, f"it answers /health with {health.status_code}")
    if models.status_code == 401:
        return Check("server", "fail", f"{root} refuses ocrvl's requests (/v1/models: 401 "
                     "Unauthorized)", _api_key_fix(config))
    absent = external and health.status_code in ENDPOINT_ABSENT  # not every server has /health
    if health.status_code != 200 and not absent:
        return Check("server", "fail" if external else "warn",
                     f"{root}/health answers {health.status_code}: the engine is not serving",
                     "restart the server" if external else "ocrvl restarts it; see its log")
    if external and models.status_code in ENDPOINT_ABSENT:
        return Check("server", "warn", f"{root} answers but does not list its models "
                     f"(/v1/models: {models.status_code}), so serving {config.model.served} "
                     "cannot be checked", "nothing, if it serves PaddleOCR-VL under that name")
    try:
        served = [m["id"] for m in models.json()["data"]]
    except (ValueError, KeyError, TypeError):
        served = []
    if config.model.served not in served:
        return Check("server", "fail", f"{root} serves {served or 'no models'}, not "
                     f"{config.model.served}", served_model_fix(config, served))
    refusal = page_refusal(config)
    if refusal is not None:
        return Check("server", "fail", f"{root} serves {config.model.served} but refuses a "
                     f"page request as PaddleX sends one ({refusal})",
                     trust_mm_kwargs_fix(refusal, config.server.mode == "external")
                     or "the server's log says why; check that it serves a PaddleOCR-VL model")
    return Check("server", "ok", f"{root} is up, serves {config.model.served} and takes a "
                 "page request")


def _ocrvl_server_running(config: Config) -> bool:
    """Whether a managed server that ocrvl started (its pidfile's group) is running."""
    for pidfile in config.state_dir.glob(PIDFILE_GLOB):
        record = GroupRecord.load(pidfile)
        if record is not None and group_members(record.pgid):
            return True
    return False


def _port_taken(config: Config, how: str) -> Check:
    server = config.server
    return Check(
        "server", "fail", f"port {server.port} on {server.host} is taken by another program "
        f"({how}); ocrvl's own server is not running: `ocrvl run` could not start its "
        "server there", f"stop that program (`ss -ltnp 'sport = :{server.port}'` names it), "
        f"or set server.port to a free port; to use it as the model server, set "
        f"`server: {{mode: external, url: {server.base_url}}}`")


def _api_key_fix(config: Config) -> str:
    """What to do about a 401: set the key, or set the right one (and where it comes from)."""
    if config.server.api_key is None:
        return ("the server wants an API key: set server.api_key to its key (e.g. "
                "`api_key: $OCRVL_API_KEY`, with that variable set where ocrvl runs)")
    # An unset $VARIABLE in server.api_key is a config error already: this key is a real one.
    return ("the server refuses server.api_key: set it (or the variable it names) to the key "
            "the server was started with (its --api-key or $VLLM_API_KEY)")


def systemd_checks() -> list[Check]:
    if shutil.which("systemctl") is None:
        return [Check("systemd", "info", "no systemctl: run `ocrvl run` yourself")]
    state = _run_quiet(["systemctl", "--user", "is-system-running"])
    if state == "running":
        checks = [Check("systemd", "ok", "user manager running")]
    elif state == "degraded":
        checks = [Check("systemd", "warn", "user manager running, some user units failed",
                        "see systemctl --user --failed")]
    elif state in ("initializing", "starting"):
        checks = [Check("systemd", "info", f"user manager {state}")]
    else:
        said = state or "no answer"
        if not os.environ.get("XDG_RUNTIME_DIR"):
            said += ", XDG_RUNTIME_DIR is not set"
        return [Check("systemd", "warn", f"no systemd user manager reachable ({said}): "
                      "`systemctl --user start ocrvl` will not work",
                      "log in through a systemd session (on WSL2 enable systemd), or run "
                      "`ocrvl run` yourself")]
    user = os.environ.get("USER") or getpass.getuser()
    linger = _run_quiet(["loginctl", "show-user", user, "-p", "Linger"])
    if linger == "Linger=yes":
        checks.append(Check("linger", "ok", f"enabled for {user}: ocrvl runs without a login"))
    elif linger == "Linger=no":
        checks.append(Check("linger", "warn", f"off for {user}: the service stops at logout "
                            "and does not start at boot", f"loginctl enable-linger {user}"))
    else:
        checks.append(Check("linger", "info", "unknown (loginctl gave no answer)"))
    return checks


def _run_quiet(argv: list[str]) -> str:
    """First line of a small command's output, "" when it cannot run."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=SYSTEMD_TIMEOUT,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if lines else ""


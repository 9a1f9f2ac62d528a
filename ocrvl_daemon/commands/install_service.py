"""`ocrvl install-service`: write, reload and enable the systemd user unit.

The unit comes from the packaged template (`ocrvl_daemon/data/ocrvl.service`, which the
repository's `systemd/ocrvl.service` links to) with ExecStart pointing at the ocrvl that is
running. Its first line records a hash of the rest, so a unit the user edited is recognised
and never overwritten without --force.
"""

from __future__ import annotations

import getpass
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ocrvl_daemon.config.file import advice_command
from ocrvl_daemon.errors import OutputError, ServiceManagerError, UnitEditedError
from ocrvl_daemon.files.atomic import write_atomic
from ocrvl_daemon.server.gpu import is_wsl

UNIT_NAME = "ocrvl.service"
MARKER = "# Written by ocrvl install-service; sha256="
# Where logind records `loginctl enable-linger`.
LINGER_DIR = Path("/var/lib/systemd/linger")

Runner = Callable[..., "subprocess.CompletedProcess[Any]"]


@dataclass
class InstallResult:
    """What install-service did (or, with dry_run, would do)."""

    unit_path: Path
    unit_text: str
    commands: list[list[str]]
    dry_run: bool
    changed: bool  # the file's content is (or would be) new
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """The text shown to the user."""
        commands = "\n".join("  " + shlex.join(cmd) for cmd in self.commands)
        if self.dry_run:
            parts = [f"Would write {self.unit_path}:\n\n{self.unit_text.rstrip()}",
                     f"Would run:\n{commands}"]
        else:
            done = "Wrote" if self.changed else "Unchanged:"
            parts = [f"{done} {self.unit_path}", f"Ran:\n{commands}",
                     "Start it with:  systemctl --user start ocrvl\n"
                     "Follow it with: journalctl --user -u ocrvl -f"]
        return "\n\n".join(parts + self.notes)


def unit_template() -> str:
    """The packaged unit, with ExecStart=%h/.local/bin/ocrvl run."""
    return (resources.files("ocrvl_daemon") / "data" / UNIT_NAME).read_text(encoding="utf-8")


def ocrvl_command() -> list[str]:
    """The argv that starts the ocrvl running now."""
    argv0 = Path(sys.argv[0])
    if argv0.name == "ocrvl" and os.access(argv0, os.X_OK):
        return [str(argv0.resolve())]
    found = shutil.which("ocrvl")
    if found:
        return [str(Path(found).resolve())]
    # Not resolved: a virtual environment's python is a symlink out of the environment.
    return [sys.executable, "-m", "ocrvl_daemon"]


def exec_quote(arg: str) -> str:
    """One ExecStart= word: systemd expands `%` specifiers and `$VARS`, splits on spaces."""
    escaped = (arg.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
               .replace("%", "%%").replace("$", "$$"))
    if arg and not any(c.isspace() or c in "'\";" for c in arg):
        return escaped
    return f'"{escaped}"'


def render_unit(command: Sequence[str]) -> str:
    """The unit file for `command`, starting with ocrvl's marker line."""
    exec_start = "ExecStart=" + " ".join(exec_quote(arg) for arg in command)
    body = re.sub(r"^ExecStart=.*$", lambda _: exec_start, unit_template(), count=1,
                  flags=re.MULTILINE)
    return f"{MARKER}{_digest(body)}\n{body}"


def written_by_ocrvl(text: str) -> bool:
    """Whether `text` is a unit ocrvl wrote and nobody changed since."""
    first, _, body = text.partition("\n")
    return first == MARKER + _digest(body)


def start_command(config_path: Path | None) -> str:
    """How to start the daemon here: the service where a user manager runs it, else
    `ocrvl run` (said why, so nobody is sent to a `systemctl --user` that cannot work)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    # systemctl --user talks to the manager through this socket: no socket, no manager.
    manager = (shutil.which("systemctl") is not None and runtime is not None
               and Path(runtime, "systemd", "private").exists())
    run = f"`{advice_command('run', config_path)}`"
    if not manager:
        return f"{run} (no systemd user manager is reachable here for the service)"
    if not (user_unit_dir() / UNIT_NAME).exists():
        return f"{run}, or install the service: `ocrvl install-service`"
    return "`systemctl --user start ocrvl`"


def user_unit_dir() -> Path:
    """~/.config/systemd/user, honouring XDG_CONFIG_HOME as systemd does."""
    config = os.environ.get("XDG_CONFIG_HOME", "")
    base = Path(config) if os.path.isabs(config) else Path.home() / ".config"
    return base / "systemd" / "user"


def install_service(config_path: Path | None, *, dry_run: bool, force: bool,
                    exec_path: Path | None = None, unit_dir: Path | None = None,
                    run: Runner = subprocess.run) -> InstallResult:
    """Write the user unit, reload systemd and enable the unit; prints what it did.

    `exec_path` overrides the ocrvl program, `unit_dir` the unit folder, `run` how the
    systemctl commands are run (tests).
    """
    command = [str(exec_path.expanduser().absolute())] if exec_path else ocrvl_command()
    command.append("run")
    if config_path is not None:
        command += ["--config", str(config_path.expanduser().resolve())]
    text = render_unit(command)
    path = (unit_dir or user_unit_dir()) / UNIT_NAME
    existing = _read(path)
    result = InstallResult(
        unit_path=path, unit_text=text, dry_run=dry_run, changed=existing != text,
        commands=[["systemctl", "--user", "daemon-reload"],
                  ["systemctl", "--user", "enable", UNIT_NAME]],
    )
    if existing is not None and result.changed and not written_by_ocrvl(existing) and not force:
        refusal = UnitEditedError(
            f"{path} exists and was not written by ocrvl, or was edited since.",
            f"keep your changes in a drop-in (`systemctl --user edit ocrvl`) and rerun with "
            f"--force to replace {path}, or remove it",
        )
        if not dry_run:
            raise refusal
        result.notes.append(f"Would refuse: {refusal}")
    if not dry_run:
        if result.changed:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(path, text)
            except OSError as exc:
                raise OutputError(f"Cannot write {path}: {exc}.",
                                  f"make {path.parent} writable for this user") from exc
        for argv in result.commands:
            _systemctl(run, argv, path)
    result.notes += _advice()
    print(result.summary())
    return result


def _systemctl(run: Runner, argv: list[str], unit_path: Path) -> None:
    fix = ("make sure your user's systemd is running (`systemctl --user status` works in a "
           "login session)" + ("; on WSL2 set systemd=true under [boot] in /etc/wsl.conf, then "
                               "`wsl --shutdown` from Windows" if is_wsl() else "")
           + f", then rerun ocrvl install-service ({unit_path} is in place)")
    try:
        done = run(argv, capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise ServiceManagerError(f"`{argv[0]}` is not installed: ocrvl runs as a systemd user "
                                  "service.", fix) from exc
    if done.returncode != 0:
        detail = (done.stderr or done.stdout or "").strip()
        raise ServiceManagerError(
            f"`{shlex.join(argv)}` failed (exit {done.returncode}): {detail}", fix)


def _advice() -> list[str]:
    notes = []
    user = getpass.getuser()
    if not (LINGER_DIR / user).exists():
        notes.append(
            f"Linger is off for {user}: systemd stops ocrvl when you log out and starts it "
            "again at your next login. To keep it running without a login session (and start "
            f"it at boot), run: loginctl enable-linger {user}")
    if is_wsl():
        notes.append(
            "WSL2: user services need systemd: /etc/wsl.conf must contain `[boot]` "
            "`systemd=true` (then run `wsl --shutdown` in Windows and reopen the terminal). "
            "WSL stops its VM a while after the last terminal closes, and ocrvl with it: keep a "
            "terminal open, or set vmIdleTimeout=-1 under [wsl2] in %UserProfile%\\.wslconfig. "
            "If the service cannot find the GPU, uncomment "
            "Environment=LD_LIBRARY_PATH=/usr/lib/wsl/lib (`systemctl --user edit ocrvl`).")
    return notes


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise OutputError(f"Cannot read {path}: {exc}.",
                          f"check {path}'s permissions, or remove it") from exc


def _digest(body: str) -> str:
    return hashlib.sha256(body.encode("utf-8")).hexdigest()

"""The user unit and `ocrvl install-service`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ocrvl_daemon.commands import install_service as service
from ocrvl_daemon.commands.install_service import (
    MARKER,
    UNIT_NAME,
    exec_quote,
    install_service,
    ocrvl_command,
    render_unit,
    unit_template,
    written_by_ocrvl,
)
from ocrvl_daemon.errors import OutputError, ServiceManagerError, UnitEditedError

REPO = Path(__file__).resolve().parent.parent
COMMANDS = [["systemctl", "--user", "daemon-reload"], ["systemctl", "--user", "enable", UNIT_NAME]]


class Recorder:
    """A fake subprocess.run that records argv lists and answers `returncode`."""

    def __init__(self, returncode: int = 0, stderr: str = "") -> None:
        self.calls: list[list[str]] = []
        self.returncode = returncode
        self.stderr = stderr

    def __call__(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert isinstance(argv, list) and not kwargs.get("shell")
        self.calls.append(argv)
        return subprocess.CompletedProcess(argv, self.returncode, "", self.stderr)


@pytest.fixture(autouse=True)
def plain_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not WSL, linger off (an empty linger folder)."""
    linger = tmp_path / "linger"
    linger.mkdir()
    monkeypatch.setattr(service, "LINGER_DIR", linger)
    monkeypatch.setattr(service, "is_wsl", lambda: False)


def _directives(text: str) -> dict[str, dict[str, str]]:
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
        elif line and not line.startswith("#"):
            key, _, value = line.partition("=")
            assert key not in current, f"{key} set twice"
            current[key] = value
    return sections


def _exec(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


@pytest.mark.quick
def test_template_directives() -> None:
    text = unit_template()
    units = _directives(text)
    assert units["Unit"]["StartLimitIntervalSec"] == "600"
    assert units["Unit"]["StartLimitBurst"] == "5"
    assert units["Service"] == {
        "Type": "notify", "NotifyAccess": "main", "ExecStart": "%h/.local/bin/ocrvl run",
        "ExecReload": "/bin/kill -HUP $MAINPID", "SyslogIdentifier": "ocrvl",
        "Restart": "on-failure", "RestartSec": "10", "TimeoutStartSec": "300",
        "TimeoutStopSec": "120", "WatchdogSec": "60", "KillMode": "mixed",
    }
    assert units["Install"] == {"WantedBy": "default.target"}
    for hint in ("#Environment=CUDA_VISIBLE_DEVICES=", "#Environment=HF_HOME=",
                 "#Environment=LD_LIBRARY_PATH=/usr/lib/wsl/lib"):
        assert hint in text


@pytest.mark.quick
def test_the_unit_offers_no_setting_that_its_exec_start_overrides() -> None:
    """ExecStart= passes --config, so an uncommented OCRVL_CONFIG line would do nothing."""
    text = render_unit(["/opt/ocrvl", "run", "--config", "/home/u/c.yaml"])
    assert "#Environment=OCRVL_CONFIG" not in text, "the unit offers a setting with no effect"
    assert "ocrvl install-service --config" in " ".join(
        line.lstrip("# ") for line in text.splitlines() if line.startswith("#")), (
        "the unit does not say how to choose another config file")


@pytest.mark.quick
def test_repository_unit_is_the_packaged_template() -> None:
    link = REPO / "systemd" / "ocrvl.service"
    assert link.is_symlink() and os.readlink(link) == "../ocrvl_daemon/data/ocrvl.service"
    assert link.read_text() == unit_template()


@pytest.mark.quick
def test_install_writes_reloads_and_enables(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    run = Recorder()
    ocrvl = _exec(tmp_path / "venv" / "bin" / "ocrvl")
    config = tmp_path / "config.yaml"
    result = install_service(config, dry_run=False, force=False, exec_path=ocrvl,
                             unit_dir=tmp_path / "units", run=run)
    unit = tmp_path / "units" / UNIT_NAME
    text = unit.read_text()
    assert result.unit_path == unit and result.unit_text == text and result.changed
    assert text.startswith(MARKER) and written_by_ocrvl(text)
    assert f"\nExecStart={ocrvl} run --config {config}\n" in text
    assert text.partition("\n")[2] == unit_template().replace(
        "ExecStart=%h/.local/bin/ocrvl run", f"ExecStart={ocrvl} run --config {config}")
    assert run.calls == COMMANDS
    out = capsys.readouterr().out
    assert f"Wrote {unit}" in out and "systemctl --user start ocrvl" in out
    assert "loginctl enable-linger" in out

    # Again, unchanged: no rewrite needed, systemctl runs again (idempotent).
    again = install_service(config, dry_run=False, force=False, exec_path=ocrvl,
                            unit_dir=tmp_path / "units", run=run)
    assert not again.changed and run.calls == COMMANDS * 2


@pytest.mark.quick
def test_no_config_and_the_running_ocrvl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ocrvl = _exec(tmp_path / "bin" / "ocrvl")
    monkeypatch.setattr(sys, "argv", [str(ocrvl), "install-service"])
    result = install_service(None, dry_run=True, force=False, unit_dir=tmp_path, run=Recorder())
    assert f"\nExecStart={ocrvl} run\n" in result.unit_text


@pytest.mark.quick
def test_ocrvl_command_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = _exec(tmp_path / "venv" / "bin" / "ocrvl")
    link = tmp_path / "local" / "ocrvl"
    link.parent.mkdir()
    link.symlink_to(real)
    monkeypatch.chdir(tmp_path / "local")
    monkeypatch.setattr(sys, "argv", ["./ocrvl"])
    assert ocrvl_command() == [str(real)]
    # Started some other way (python -m ocrvl_daemon): the ocrvl on PATH...
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "x" / "__main__.py")])
    monkeypatch.setenv("PATH", str(tmp_path / "local"))
    assert ocrvl_command() == [str(real)]
    # ...or this interpreter.
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert ocrvl_command() == [sys.executable, "-m", "ocrvl_daemon"]


@pytest.mark.quick
def test_dry_run_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = Recorder()
    result = install_service(Path("c.yaml"), dry_run=True, force=False,
                             exec_path=Path("/opt/ocrvl"), unit_dir=tmp_path / "units", run=run)
    assert not (tmp_path / "units").exists() and run.calls == []
    assert result.commands == COMMANDS
    out = capsys.readouterr().out
    assert result.unit_text in out
    assert "Would run:\n  systemctl --user daemon-reload\n  systemctl --user enable ocrvl.service" \
        in out
    # A relative config path is made absolute: the service does not run in this folder.
    assert f"--config {Path.cwd() / 'c.yaml'}" in result.unit_text


@pytest.mark.quick
def test_refuses_to_overwrite_an_edited_unit(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    ocrvl = _exec(tmp_path / "ocrvl")
    install_service(None, dry_run=False, force=False, exec_path=ocrvl, unit_dir=tmp_path,
                    run=Recorder())
    unit = tmp_path / UNIT_NAME
    edited = unit.read_text().replace("RestartSec=10", "RestartSec=30")
    unit.write_text(edited)
    assert not written_by_ocrvl(edited)

    run = Recorder()
    with pytest.raises(UnitEditedError, match="--force") as caught:
        install_service(tmp_path / "other.yaml", dry_run=False, force=False, exec_path=ocrvl,
                        unit_dir=tmp_path, run=run)
    assert isinstance(caught.value, OutputError) and str(unit) in str(caught.value)
    assert unit.read_text() == edited and run.calls == []

    capsys.readouterr()
    install_service(tmp_path / "other.yaml", dry_run=True, force=False, exec_path=ocrvl,
                    unit_dir=tmp_path, run=run)
    assert "Would refuse" in capsys.readouterr().out and unit.read_text() == edited

    install_service(tmp_path / "other.yaml", dry_run=False, force=True, exec_path=ocrvl,
                    unit_dir=tmp_path, run=run)
    assert written_by_ocrvl(unit.read_text()) and "other.yaml" in unit.read_text()
    assert run.calls == COMMANDS


@pytest.mark.quick
def test_refuses_a_unit_someone_else_wrote(tmp_path: Path) -> None:
    (tmp_path / UNIT_NAME).write_text("[Service]\nExecStart=/usr/bin/true\n")
    with pytest.raises(UnitEditedError, match="--force"):
        install_service(None, dry_run=False, force=False, exec_path=Path("/opt/ocrvl"),
                        unit_dir=tmp_path, run=Recorder())


@pytest.mark.quick
def test_replaces_its_own_unedited_unit(tmp_path: Path) -> None:
    for config in ("a.yaml", "b.yaml"):
        install_service(tmp_path / config, dry_run=False, force=False,
                        exec_path=Path("/opt/ocrvl"), unit_dir=tmp_path, run=Recorder())
    assert "b.yaml" in (tmp_path / UNIT_NAME).read_text()


@pytest.mark.quick
def test_unit_dir_follows_xdg_config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    result = install_service(None, dry_run=True, force=False, exec_path=Path("/opt/ocrvl"),
                             run=Recorder())
    assert result.unit_path == tmp_path / "xdg" / "systemd" / "user" / UNIT_NAME
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative/ignored")  # the XDG spec says ignore it
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    result = install_service(None, dry_run=True, force=False, exec_path=Path("/opt/ocrvl"),
                             run=Recorder())
    assert result.unit_path == tmp_path / "home" / ".config" / "systemd" / "user" / UNIT_NAME


@pytest.mark.quick
def test_advice_for_linger_and_wsl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    user = os.environ.get("USER") or "someone"
    monkeypatch.setenv("USER", user)
    monkeypatch.setenv("LOGNAME", user)
    monkeypatch.setattr(service, "is_wsl", lambda: True)
    notes = install_service(None, dry_run=True, force=False, exec_path=Path("/opt/ocrvl"),
                            unit_dir=tmp_path, run=Recorder()).notes
    assert any(f"loginctl enable-linger {user}" in note for note in notes)
    wsl = next(note for note in notes if note.startswith("WSL2"))
    assert "systemd=true" in wsl and "vmIdleTimeout=-1" in wsl and "/usr/lib/wsl/lib" in wsl
    (service.LINGER_DIR / user).touch()  # what `loginctl enable-linger` leaves
    monkeypatch.setattr(service, "is_wsl", lambda: False)
    assert install_service(None, dry_run=True, force=False, exec_path=Path("/opt/ocrvl"),
                           unit_dir=tmp_path, run=Recorder()).notes == []


@pytest.mark.quick
def test_systemctl_failures_name_the_fix(tmp_path: Path) -> None:
    failing = Recorder(returncode=1, stderr="Failed to connect to bus: No medium found")
    with pytest.raises(ServiceManagerError, match="No medium found") as caught:
        install_service(None, dry_run=False, force=False, exec_path=Path("/opt/ocrvl"),
                        unit_dir=tmp_path, run=failing)
    assert caught.value.fix and "rerun ocrvl install-service" in caught.value.fix
    assert (tmp_path / UNIT_NAME).exists()  # written before systemctl was asked

    def missing(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError(argv[0])

    with pytest.raises(ServiceManagerError, match="not installed"):
        install_service(None, dry_run=False, force=False, exec_path=Path("/opt/ocrvl"),
                        unit_dir=tmp_path, run=missing)


@pytest.mark.parametrize(("arg", "word"), [
    ("/usr/bin/ocrvl", "/usr/bin/ocrvl"),
    ("/a b/ocrvl", '"/a b/ocrvl"'),
    ("/x/100%/$HOME", "/x/100%%/$$HOME"),
    ('say "hi"\\', '"say \\"hi\\"\\\\"'),
    ("it's", '"it\'s"'),
    ("", '""'),
])
@pytest.mark.quick
def test_exec_quote(arg: str, word: str) -> None:
    assert exec_quote(arg) == word


def _verify(unit: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    runtime = tmp_path / "runtime"  # verify needs a runtime dir to set up its manager
    runtime.mkdir(mode=0o700, exist_ok=True)
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime))
    return subprocess.run(["systemd-analyze", "--user", "verify", str(unit)], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (apt-get install systemd); CI has it")
def test_systemd_analyze_verify_is_silent(tmp_path: Path) -> None:
    # ExecStart must name an existing executable for verify: the ocrvl of this environment.
    ocrvl = Path(shutil.which("ocrvl") or sys.executable)
    install_service(tmp_path / "config.yaml", dry_run=False, force=False, exec_path=ocrvl,
                    unit_dir=tmp_path, run=Recorder())
    done = _verify(tmp_path / UNIT_NAME, tmp_path)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")

    # Quoting holds: verify finds an executable whose path has a space and a '%'.
    odd = _exec(tmp_path / "my tools" / "100%" / "ocrvl")
    (tmp_path / "odd").mkdir()
    unit = tmp_path / "odd" / UNIT_NAME
    unit.write_text(render_unit([str(odd), "run", "--config", "/c $x.yaml"]))
    done = _verify(unit, tmp_path)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")

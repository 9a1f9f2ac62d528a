"""Running `ocrvl` itself as a real subprocess in tests and benchmarks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

# The directory holding the ocrvl_daemon package: children run this very checkout.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
_PRIVATE_ENV = ("OCRVL_CONFIG", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def write_config(path: Path, **sections: Any) -> Path:
    """Write a YAML config; layout detection is off (no model weights offline).

    Sections given as dicts are merged into the defaults written here; `state_dir` defaults
    to `state/` beside the file.
    """
    data: dict[str, Any] = {"pipeline": {"use_layout_detection": False}}
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    data.setdefault("state_dir", str(path.parent / "state"))
    path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    return path


def ocrvl_env(**extra: str) -> dict[str, str]:
    """The environment for an `ocrvl` child: this checkout first on the path, no systemd."""
    env = {k: v for k, v in os.environ.items() if k not in _PRIVATE_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def ocrvl_argv(*args: str | Path) -> list[str]:
    """The argv that runs `ocrvl ARGS` with this interpreter."""
    return [sys.executable, "-m", "ocrvl_daemon", *map(str, args)]


def run_ocrvl(*args: str | Path, timeout: float = 180, cwd: Path | None = None,
              **env: str) -> subprocess.CompletedProcess[str]:
    """Run `ocrvl ARGS` to completion, capturing its output."""
    return subprocess.run(ocrvl_argv(*args), capture_output=True, text=True, timeout=timeout,
                          env=ocrvl_env(**env), cwd=cwd, check=False)

"""Running `ocrvl` itself as a real subprocess in tests and benchmarks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

# The checkout's root, holding ocrvl_daemon and testkit: children run this very checkout.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
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


def checkout_first(pythonpath: str | None) -> str:
    """`pythonpath` with this checkout first, so that a child imports ocrvl_daemon and testkit
    from here (testkit is never installed)."""
    return os.pathsep.join(filter(None, [str(PACKAGE_ROOT), pythonpath]))


def ocrvl_env(**extra: str) -> dict[str, str]:
    """The environment for an `ocrvl` child: this checkout first on the path, no systemd."""
    env = {k: v for k, v in os.environ.items() if k not in _PRIVATE_ENV}
    env["PYTHONPATH"] = checkout_first(env.get("PYTHONPATH"))
    env.update(extra)
    return env


def broken_paddleocr(root: Path) -> dict[str, str]:
    """Environment for an `ocrvl` child whose engine worker cannot import paddleocr, like a
    broken install: a `paddleocr` package under `root` that fails on import shadows the real
    one until `root / "paddleocr"` is removed."""
    package = root / "paddleocr"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'paddlex'\", name='paddlex')\n",
        encoding="utf-8",
    )
    return {"PYTHONPATH": os.pathsep.join([str(root), str(PACKAGE_ROOT)])}


def ocrvl_argv(*args: str | Path) -> list[str]:
    """The argv that runs `ocrvl ARGS` with this interpreter."""
    return [sys.executable, "-m", "ocrvl_daemon", *map(str, args)]


def run_ocrvl(*args: str | Path, timeout: float = 180, cwd: Path | None = None,
              **env: str) -> subprocess.CompletedProcess[str]:
    """Run `ocrvl ARGS` to completion, capturing its output."""
    return subprocess.run(ocrvl_argv(*args), capture_output=True, text=True, timeout=timeout,
                          env=ocrvl_env(**env), cwd=cwd, check=False)


def managed_fake_server(port: int, *fake_args: str, **server: Any) -> dict[str, Any]:
    """A `server:` config section that makes ocrvl start the fake vLLM server itself."""
    from testkit.harness import fake_server_command

    command = fake_server_command("--host", "{host}", "--port", "{port}",
                                  "--served-model-name", "{model}", *fake_args, "{vllm_args}")
    return {"launcher": "command", "port": port, "command": command, "health_interval": 0.5,
            **server}


class DaemonProcess:
    """`ocrvl run` as a real child process in its own session; always stopped and reaped.

    Output goes to a file (never a pipe that could fill up); `log()` reads it.
    """

    def __init__(self, config: Path, **env: str) -> None:
        self.config = config
        self.log_path = config.with_name(config.stem + f"-daemon-{os.getpid()}.log")
        self._env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> DaemonProcess:
        """Start the daemon (returns at once)."""
        log_file = self.log_path.open("ab")
        self.proc = subprocess.Popen(ocrvl_argv("run", "--config", self.config),
                                     stdout=log_file, stderr=subprocess.STDOUT,
                                     env=ocrvl_env(**self._env), start_new_session=True)
        log_file.close()
        return self

    def log(self) -> str:
        """Everything the daemon printed so far (all runs of this handle)."""
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def wait_ready(self, timeout: float = 60) -> None:
        """Wait for the daemon's "ready" line; fail with its log if it exits first."""
        from testkit.harness import wait_until

        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"ocrvl run exited ({self.proc.returncode}):\n{self.log()}")
            return "ready: server up" in self.log()

        wait_until(ready, timeout, interval=0.1, what="ocrvl run to become ready", ignore=())

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM, wait (bounded), SIGKILL the session if needed, reap; returns exit code."""
        import signal

        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        code = self.proc.wait()
        return code

    def kill(self) -> None:
        """SIGKILL the daemon process alone (like a crash or the OOM killer) and reap it."""
        import signal

        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.terminate()

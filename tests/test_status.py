"""`ocrvl status` as a command: what it prints where nobody reads to the end."""

from __future__ import annotations

import subprocess
from pathlib import Path

from ocrvl_daemon.store import Store
from ocrvl_daemon.testing.runner import ocrvl_argv, ocrvl_env, write_config

MODEL = "PaddleOCR-VL-1.6-0.9B"


def test_status_piped_into_head_stops_quietly(tmp_path: Path):
    config = write_config(tmp_path / "config.yaml", state_dir=str(tmp_path / "state"))
    (tmp_path / "state").mkdir()
    store = Store(tmp_path / "state" / "jobs.sqlite")
    try:
        # Far more than a pipe holds (64 KiB), so `status` is still writing when head leaves.
        for n in range(2000):
            store.enqueue(tmp_path / f"scans/book-{n:04d}.pdf", f"sha-{n}", 1, float(n), MODEL)
    finally:
        store.close()
    proc = subprocess.Popen(ocrvl_argv("status", "--config", config), env=ocrvl_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b"daemon: not running")
    proc.stdout.close()  # what `| head -1` does once it has its line
    stderr = proc.stderr.read().decode()
    assert proc.wait(60) == 141, stderr
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, (
        f"`ocrvl status | head` printed a traceback:\n{stderr}"
    )

"""Shared fixtures: a fake vLLM server on a free port; children that import this checkout; the
small stand-in layout model."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.harness import FakeServerProcess, free_port, start_fake_server
from testkit.runner import (
    DaemonProcess,
    checkout_first,
    managed_fake_server,
    ocrvl_env,
    write_config,
)


@pytest.fixture(scope="session", autouse=True)
def children_import_this_checkout() -> Iterator[None]:
    """Every process a test starts (e.g. the fake server ocrvl launches from a test's own
    supervisor) imports testkit and ocrvl_daemon from this checkout, whatever its working
    directory: testkit is never installed."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", checkout_first(os.environ.get("PYTHONPATH")))
        yield


@pytest.fixture
def fake_server() -> Iterator[FakeServerProcess]:
    """A fake vLLM server (ready, default model) on a free port; stopped and reaped after."""
    with start_fake_server(free_port()) as server:
        yield server


@pytest.fixture(scope="session")
def layout_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PaddleX cache home (PADDLE_PDX_CACHE_HOME) holding the small stand-in PP-DocLayoutV3
    for the paddle engine on the CPU (`python -m testkit.layout_model CACHE --small`), written
    once for the whole run."""
    cache = tmp_path_factory.mktemp("paddlex-cache")
    done = subprocess.run([sys.executable, "-m", "testkit.layout_model", str(cache), "--small"],
                          env=ocrvl_env(), capture_output=True, text=True, timeout=300,
                          check=False)  # fmt: skip
    assert done.returncode == 0, (
        f"the stand-in layout model was not written:\n{done.stderr[-3000:]}")
    return cache


@pytest.fixture
def layout_daemon(layout_cache: Path, tmp_path: Path) -> Iterator[tuple[Path, Path, DaemonProcess]]:
    """A ready daemon with one engine worker laying out pages on the CPU (the stand-in) and a
    managed fake server, watching `tmp_path/inbox`: (inbox, config, daemon)."""
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    config = write_config(
        tmp_path / "config.yaml",
        inbox={"paths": [str(inbox)], "stable_seconds": 0.3, "poll_interval": 0.2},
        pipeline={"use_layout_detection": True, "layout_device": "cpu", "workers": 1},
        server=managed_fake_server(free_port()))
    with DaemonProcess(config, PADDLE_PDX_CACHE_HOME=str(layout_cache)) as daemon:
        daemon.wait_ready()
        yield inbox, config, daemon

"""Shared fixtures: a fake vLLM server on a free port; children that import this checkout."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from testkit.harness import FakeServerProcess, free_port, start_fake_server
from testkit.runner import checkout_first


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

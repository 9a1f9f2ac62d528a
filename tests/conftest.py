"""Shared fixtures: a fake vLLM server on a free port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testkit.harness import FakeServerProcess, free_port, start_fake_server


@pytest.fixture
def fake_server() -> Iterator[FakeServerProcess]:
    """A fake vLLM server (ready, default model) on a free port; stopped and reaped after."""
    with start_fake_server(free_port()) as server:
        yield server

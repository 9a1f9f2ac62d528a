"""A fake server on a background thread of the test process (unit tests, the redo benchmark)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import TracebackType

from testkit.fake_server.config import FakeServerConfig
from testkit.fake_server.server import FakeServer


class InProcessFakeServer:
    """Run a fake server on a background thread (unit tests; port 0 picks a free port).

    Fault switches that end the process (``--crash-after``) only stop this server here.
    """

    def __init__(self, cfg: FakeServerConfig, ready_timeout: float = 10.0) -> None:
        self.server = FakeServer(cfg)
        self.ready_timeout = ready_timeout
        self.exit_code: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name="fake-vllm", daemon=True)

    def _main(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self.exit_code = self._loop.run_until_complete(self.server.run())
        finally:
            self._loop.close()

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234`` (append ``/v1`` for OpenAI clients)."""
        return f"http://{self.server.cfg.host}:{self.server.port}"

    def __enter__(self) -> InProcessFakeServer:
        self._thread.start()
        deadline = time.monotonic() + self.ready_timeout
        while not self.server.ready.wait(0.02):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"fake server did not start (exit code {self.exit_code})")
        return self

    def stop(self) -> None:
        """Stop the server and join its thread."""
        loop = self._loop
        if loop is not None and self._thread.is_alive():
            loop.call_soon_threadsafe(self.server.request_stop, 0)
        self._thread.join(5.0)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

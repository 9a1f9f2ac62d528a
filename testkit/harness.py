"""Process harness for tests: free ports, polling with deadlines, a fake vLLM subprocess.

Typical use::

    port = free_port()
    with start_fake_server(port, "--max-num-seqs", "8") as srv:
        httpx.post(srv.url + "/v1/chat/completions", json=chat_payload(make_test_jpeg(1)))
        wait_until(lambda: srv.stats()["requests_completed"] == 1, 5, what="one completion")
"""

from __future__ import annotations

import base64
import contextlib
import io
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import httpx
from PIL import Image, ImageDraw
from prometheus_client.parser import text_string_to_metric_families

from testkit.fake_server import DEFAULT_MODEL
from testkit.runner import checkout_first

log = logging.getLogger(__name__)

T = TypeVar("T")

def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it; a race is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    interval: float = 0.05,
    what: str = "condition",
    ignore: tuple[type[BaseException], ...] = (Exception,),
) -> T:
    """Call ``predicate`` until it returns something truthy and return that.

    Exceptions in ``ignore`` count as "not yet" (e.g. connection refused while a server
    starts). On timeout raise AssertionError naming ``what`` and the last exception.
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = predicate()
        except ignore as exc:
            last_error = exc
        else:
            if value:
                return value
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error!r})" if last_error is not None else ""
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}{detail}")
        time.sleep(interval)


@contextlib.contextmanager
def read_only_folder(folder: Path) -> Iterator[None]:
    """`folder` read-only even for root (chmod does not stop root): a read-only bind mount,
    undone after. The calling test is skipped where mounting is not permitted."""
    import pytest

    folder.mkdir(parents=True, exist_ok=True)
    for how in (["--bind", str(folder)], ["-o", "remount,ro,bind"]):
        done = subprocess.run(["mount", *how, str(folder)], capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            if how[0] != "--bind":
                subprocess.run(["umount", "-l", str(folder)], check=False)
            pytest.skip(f"cannot mount here ({done.stderr.strip()}); needs root in a "
                        "container that allows mounts")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is running (a zombie counts as dead: it holds no resources)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    # The state field follows the parenthesised command name, which may contain spaces.
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def answers_health(url: str) -> bool:
    """Whether the server at ``url`` (its root) answers ``/health`` with 200 right now."""
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def fake_server_command(*args: str, python: str | None = None) -> list[str]:
    """The argv that runs the fake server (e.g. for ocrvl's ``server.command``)."""
    return [python or sys.executable, "-m", "testkit.fake_server", *args]


def make_test_jpeg(seed: int, size: tuple[int, int] = (612, 792)) -> bytes:
    """A small JPEG that differs per ``seed`` (distinct digest and mean gray level)."""
    gray = 40 + (seed * 37) % 200
    img = Image.new("RGB", size, (gray, gray, gray))
    draw = ImageDraw.Draw(img)
    draw.text((10, 10), f"page {seed}", fill=(255 - gray, 0, 0))
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=90)
    return out.getvalue()


def chat_payload(
    jpeg: bytes,
    prompt: str = "OCR:",
    model: str = DEFAULT_MODEL,
    max_completion_tokens: int | None = 4096,
    **extra: Any,
) -> dict[str, Any]:
    """A chat completion body shaped like the ones PaddleX sends (``extra`` at top level)."""
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    body: dict[str, Any] = {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": prompt},
                ],
            }
        ],
        "temperature": 0.0,
        **extra,
    }
    if max_completion_tokens is not None:
        body["max_completion_tokens"] = max_completion_tokens
    return body


class FakeServerProcess:
    """A fake server subprocess in its own session (so its whole process group can be killed).

    Combined stdout/stderr go to a temporary file (a pipe could fill up and stall the
    server); read it with ``output()``. Use as a context manager: leaving always stops and
    reaps the group.
    """

    def __init__(self, proc: subprocess.Popen[bytes], host: str, port: int, output_path: Path):
        self.proc = proc
        self.host = host
        self.port = port
        self.output_path = output_path
        self._final_output: str | None = None

    @property
    def pid(self) -> int:
        """PID of the server (also its process group and session id)."""
        return self.proc.pid

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8118``."""
        return f"http://{self.host}:{self.port}"

    @property
    def api_url(self) -> str:
        """OpenAI base URL (``.../v1``), what PaddleOCR-VL's ``vl_rec_server_url`` takes."""
        return self.url + "/v1"

    def output(self) -> str:
        """Everything the server printed so far (kept after ``stop``)."""
        if self._final_output is not None:
            return self._final_output
        try:
            return self.output_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def _tail(self) -> str:
        return "\n".join(self.output().splitlines()[-30:])

    def get(self, path: str, timeout: float = 5.0, **kwargs: Any) -> httpx.Response:
        """GET ``path`` on the server."""
        return httpx.get(self.url + path, timeout=timeout, **kwargs)

    def post(self, path: str, timeout: float = 30.0, **kwargs: Any) -> httpx.Response:
        """POST to ``path`` on the server."""
        return httpx.post(self.url + path, timeout=timeout, **kwargs)

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 right now (False on refused connections)."""
        return answers_health(self.url)

    def stats(self) -> dict[str, Any]:
        """The fake server's ``/fake/stats``."""
        response = self.get("/fake/stats")
        response.raise_for_status()
        return dict(response.json())

    def metric(self, sample: str, **labels: str) -> float:
        """Sum of the ``/metrics`` samples named ``sample`` whose labels include ``labels``."""
        response = self.get("/metrics")
        response.raise_for_status()
        total, found = 0.0, False
        for family in text_string_to_metric_families(response.text):
            for s in family.samples:
                if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
                    found = True
        if not found:
            raise KeyError(f"no metric sample {sample} with {labels}")
        return total

    def wait_ready(self, timeout: float = 15.0) -> None:
        """Poll ``/health`` until 200; fail at once (with its output) if the process exits."""

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}")
            return self.healthy()

        try:
            wait_until(ready, timeout, what=f"fake server on port {self.port}", ignore=())
        except (AssertionError, RuntimeError) as exc:
            raise AssertionError(f"fake server not ready: {exc}\n{self._tail()}") from None

    def wait_exit(self, timeout: float) -> int:
        """Wait for the server process to exit by itself; return its exit code."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"fake server still running after {timeout:g}s\n{self._tail()}"
            ) from None

    def signal_group(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the whole process group (no error if it is gone)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM the group, wait up to ``timeout``, SIGKILL, reap; return the exit code."""
        if self.proc.poll() is None:
            log.info("stopping fake server pid %d (SIGTERM to group)", self.pid)
            self.signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("fake server pid %d ignored SIGTERM; SIGKILL to group", self.pid)
                self.signal_group(signal.SIGKILL)
                self.proc.wait()
        # Members left behind (an orphaned engine child) are ours too: never leak them.
        self.signal_group(signal.SIGKILL)
        if self._final_output is None:
            self._final_output = self.output()
            self.output_path.unlink(missing_ok=True)
        log.info("fake server pid %d reaped, exit code %s", self.pid, self.proc.returncode)
        return self.proc.returncode

    def __enter__(self) -> FakeServerProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_fake_server(
    port: int,
    *args: str,
    env: Mapping[str, str] | None = None,
    host: str = "127.0.0.1",
    model: str = DEFAULT_MODEL,
    wait: bool = True,
    ready_timeout: float = 15.0,
) -> FakeServerProcess:
    """Start ``python -m testkit.fake_server`` on ``host:port``.

    ``args`` are extra command-line options (a later ``--served-model-name`` overrides
    ``model``); ``env`` is added to the current environment. With ``wait`` the call returns
    once ``/health`` is 200 and stops the process if it never gets there.
    """
    fd, name = tempfile.mkstemp(prefix=f"fake-vllm-{port}-", suffix=".log")
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = checkout_first(full_env.get("PYTHONPATH"))
    argv: Sequence[str] = fake_server_command(
        "--host", host, "--port", str(port), "--served-model-name", model, *args
    )
    with os.fdopen(fd, "wb") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )
    log.info("started fake server pid %d on %s:%d", proc.pid, host, port)
    server = FakeServerProcess(proc, host, port, Path(name))
    if wait:
        try:
            server.wait_ready(ready_timeout)
        except BaseException:
            server.stop()
            raise
    return server

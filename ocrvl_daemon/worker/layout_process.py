"""The layout model on the CPU in a process of its own, beside the engine worker that asks.

In the worker's own process the layout model and the page threads fight over the GIL:
Paddle holds it for a whole call (seconds), so no page can render, crop or send a request
meanwhile; torch lets go of it for each operation and must take it back for the next,
waiting behind any page thread running Python. Either way the pages' own work comes out of
the layout model's time, and the layout model is what limits a worker on the CPU
(bench/gpu/RESULTS.md). Here the model runs alone: the worker sends the page images and gets
the boxes back, and its threads run while the model does.

The process builds the same pipeline as the worker (the `WorkerSetup` the daemon sent it) and
serves its layout model; it dies with the worker (its parent death signal) and ends at end of input.
Its log records reach the daemon through the worker: ocrvl's from WARNING, the libraries'
from ERROR, as the worker, building the same pipeline, says the rest once.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import signal
import subprocess
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ocrvl_daemon.core.messages import LogRecord, WorkerSetup
from ocrvl_daemon.process.channel import Channel, child_channel, start_child
from ocrvl_daemon.worker.child_logs import library_logs_to_daemon, log_to_daemon
from ocrvl_daemon.worker.paddlex_import import import_paddleocr_vl
from ocrvl_daemon.worker.pipeline import inner_pipeline, limit_torch_threads, warm_layout_model

log = logging.getLogger(__name__)

# The input image is the caller's: it stays out of the answer (a rendered page is ~10 MB).
_IMAGE_KEY = "input_img"


class LayoutProcessEnded(RuntimeError):
    """The layout model's process is gone (it crashed or was killed)."""


class LayoutProcess:
    """The layout model of the worker's pipeline, run in a child process: called as the
    model is (`process(images, **options)` -> a result per image), one call at a time.

    `started` begins loading at once; `wait_ready` then says whether it loaded (None) or
    why not. `batch_sampler` is the worker's own model's, which the pipeline reads.
    """

    def __init__(self, process: subprocess.Popen[bytes], channel: Channel) -> None:
        self._process = process
        self._channel = channel
        self._lock = threading.Lock()
        self.batch_sampler: Any = None
        self.warm_s: float | None = None
        # Called with what happened when the process is found gone, before the call raises
        # LayoutProcessEnded (the worker ends there, as if the model had crashed in it).
        self.on_ended: Callable[[str], None] | None = None

    @classmethod
    def started(cls, setup: WorkerSetup) -> LayoutProcess:
        """Start the process for the worker's setup (its pipeline's arguments)."""
        # No session of its own: whatever stops the worker's process group stops it too.
        process, channel = start_child(__name__)
        channel.send(setup)
        return cls(process, channel)

    @property
    def pid(self) -> int:
        return self._process.pid

    def wait_ready(self) -> str | None:
        """None once the model has loaded and made its first call (`warm_s` says how long
        that call took); else what went wrong."""
        answer = self._receive()
        if answer is None:
            return f"the layout model's process ended (exit status {self._process.wait()})"
        if isinstance(answer, tuple) and answer[0] == "ready":
            self.warm_s = float(answer[1])
            return None
        return str(answer)

    def __call__(self, images: list[np.ndarray], **options: Any) -> list[Any]:
        with self._lock:
            try:
                self._channel.send((images, options))
                answer = self._receive()
            except OSError:  # the pipe broke: it is gone
                answer = None
            if answer is None:
                self._ended(f"the layout model's process ended (exit status "
                            f"{self._process.wait()})")  # fmt: skip
        kind, payload = answer
        if kind == "error":
            raise RuntimeError(f"layout model: {payload}")
        return [_result(where, data, image) for (where, data), image in
                zip(payload, images, strict=True)]

    def _receive(self) -> Any:
        """The process's next answer; the log records it sent before it are logged here."""
        while isinstance(message := self._channel.receive(), LogRecord):
            message.relay()
        return message

    def _ended(self, what: str) -> None:
        if self.on_ended is not None:
            self.on_ended(what)
        raise LayoutProcessEnded(what)

    def close(self) -> None:
        """End the process (end of input, then a bounded wait, then SIGKILL) and reap it."""
        with contextlib.suppress(OSError):  # already broken: it is gone
            self._channel.close_output()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def _result(where: tuple[str, str], data: dict[str, Any], image: np.ndarray) -> Any:
    """The model's result object again, of its own class, with the caller's image."""
    module, name = where
    cls: Callable[[dict[str, Any]], Any] = getattr(importlib.import_module(module), name)
    return cls({**data, _IMAGE_KEY: image})


def _answer(results: list[Any]) -> list[tuple[tuple[str, str], dict[str, Any]]]:
    return [((type(r).__module__, type(r).__qualname__),
             {k: v for k, v in r.items() if k != _IMAGE_KEY}) for r in results]  # fmt: skip


def serve() -> None:
    """The process's main: build the worker's pipeline, then answer calls until end of input."""
    channel = child_channel()
    log_to_daemon(channel, logging.WARNING)
    setup: WorkerSetup | None = channel.receive()
    if setup is None:
        return
    try:
        pipeline_class = import_paddleocr_vl()
        library_logs_to_daemon(logging.ERROR)
        limit_torch_threads(setup.torch_threads)
        model = inner_pipeline(pipeline_class(**setup.pipeline)).layout_det_model
        warm_s = warm_layout_model(model)
    except BaseException as exc:  # report anything, even SystemExit from a dependency check
        channel.send(f"{type(exc).__name__}: {exc}")
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # Paddle's handler would print a crash report
    channel.send(("ready", warm_s))
    while (call := channel.receive()) is not None:
        images, options = call
        try:
            channel.send(("ok", _answer(list(model(images, **options)))))
        except Exception as exc:  # the caller's page fails with it; the model stays
            channel.send(("error", f"{type(exc).__name__}: {exc}"))

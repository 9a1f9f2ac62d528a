"""A fake vLLM: an OpenAI-compatible server that behaves like vLLM where ocrvl cares.

Used by the tests (life cycle, faults, which page landed where) and by the throughput
benchmark (a simulated continuous-batching server). Run it as::

    python -m testkit.fake_server --host 127.0.0.1 --port 8118 \\
        --served-model-name PaddleOCR-VL-1.6-0.9B [options]

from a source checkout's root (testkit is not installed; testkit.harness starts it with the
checkout on PYTHONPATH), or in-process with ``InProcessFakeServer``. One module per job:

- config: the settings (``FakeServerConfig``); cli: the command line and ``main``;
- server: the HTTP server, its life cycle and fault switches;
- answers: what a chat completion gets (reply text, lengths, tokens, errors);
- batching: the continuous-batching simulation; metrics: ``/metrics`` and ``/fake/stats``;
- startup: the fake VRAM model, start-up lines and failures, the engine child;
- console: vLLM-like log lines; in_process: a server on a thread of the caller.

This package's names below are what tests and benchmarks import.
"""

from __future__ import annotations

from testkit.fake_server.answers import OutputLength, image_tokens
from testkit.fake_server.cli import parse_args
from testkit.fake_server.config import DEFAULT_MODEL, FakeServerConfig
from testkit.fake_server.in_process import InProcessFakeServer
from testkit.fake_server.startup import FAIL_KINDS, FIXED_FAILURES, plan_startup

__all__ = [
    "DEFAULT_MODEL",
    "FAIL_KINDS",
    "FIXED_FAILURES",
    "FakeServerConfig",
    "InProcessFakeServer",
    "OutputLength",
    "image_tokens",
    "parse_args",
    "plan_startup",
]

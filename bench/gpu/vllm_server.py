"""The vLLM server the GPU benchmark measures: started here (or given by URL), and its
`/metrics` sampled for requests-running timelines."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.gpu.lengths import DEFAULT as DEFAULT_LENGTHS
from bench.gpu.lengths import ENV as LENGTHS_ENV
from ocrvl_daemon.config.models import DEFAULT_MODEL
from ocrvl_daemon.process.group import stop_process_group
from ocrvl_daemon.server.launchers import TRUST_MM_KWARGS_FLAG, flags_of, vllm_flags
from ocrvl_daemon.server.probe import parse_metrics
from testkit.harness import answers_health, wait_until

ROOT = Path(__file__).resolve().parents[2]
LOGITS_PROCESSOR = "bench.gpu.answer_lengths:ServerAnswerLengths"
IDLE_SETTLE_S = 1.0  # each contender starts on a quiet server


@dataclass
class ServeOptions:
    """How to start `vllm serve` for the benchmark."""

    model: str  # a model dir (random weights with `dummy`) or a hub name
    dummy: bool  # --load-format dummy: random weights, answer lengths forced
    lengths: str | None  # MEDIAN:SIGMA:SEED for the logits processor, None: the model's own
    port: int
    python: str = sys.executable
    pythonpath: str = ""  # where vLLM lives if not in `python`'s site-packages
    max_model_len: int = 8192
    gpu_memory_utilization: float = 0.5
    extra: list[str] = field(default_factory=list)

    def argv(self) -> list[str]:
        argv = [
            self.python, "-m", "vllm.entrypoints.cli.main", "serve", self.model,
            "--served-model-name", DEFAULT_MODEL, "--host", "127.0.0.1",
            "--port", str(self.port), "--trust-remote-code",
            "--no-enable-prefix-caching", "--mm-processor-cache-gb", "0",
            "--limit-mm-per-prompt", json.dumps({"image": 1}),
            "--max-model-len", str(self.max_model_len),
            "--gpu-memory-utilization", str(self.gpu_memory_utilization),
        ]  # fmt: skip
        if self.dummy:
            argv += ["--load-format", "dummy"]
        if self.lengths:
            argv += ["--logits-processors", LOGITS_PROCESSOR]
        if (TRUST_MM_KWARGS_FLAG.flag not in " ".join(self.extra)
                and TRUST_MM_KWARGS_FLAG in flags_of(self.vllm_version())):
            # else vLLM >= 0.31 refuses every captured request (its image-size bounds)
            argv += vllm_flags({TRUST_MM_KWARGS_FLAG.flag: TRUST_MM_KWARGS_FLAG.value})
        return argv + self.extra

    def vllm_version(self) -> str | None:
        """The vLLM version `python` imports with this PYTHONPATH (its metadata; None: none)."""
        out = subprocess.run(
            [self.python, "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
            env=self.env(), capture_output=True, text=True, timeout=60, check=False)
        return out.stdout.strip() or None if out.returncode == 0 else None

    def env(self) -> dict[str, str]:
        env = dict(os.environ, HF_HUB_OFFLINE="1" if self.dummy else os.environ.get(
            "HF_HUB_OFFLINE", "0"), VLLM_NO_USAGE_STATS="1", PYTHONUNBUFFERED="1",
            VLLM_USE_FLASHINFER_SAMPLER="0")  # fmt: skip
        # the logits processor is imported by vLLM's engine from this checkout
        env["PYTHONPATH"] = os.pathsep.join(p for p in (self.pythonpath, str(ROOT)) if p)
        if self.lengths:
            env[LENGTHS_ENV] = self.lengths
        return env


@contextlib.contextmanager
def started(options: ServeOptions, log: Path, timeout: float = 900) -> Iterator[str]:
    """`vllm serve` in a session of its own until ready; yields its URL; always stopped."""
    url = f"http://127.0.0.1:{options.port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(options.argv(), env=options.env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        wait_until(lambda: answers_health(url) or proc.poll() is not None, timeout, interval=1,
                   what="vLLM ready (see " + str(log) + ")")  # fmt: skip
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{tail}")
        yield url
    finally:
        stop_process_group(proc, 60, "vLLM")


def python_executable(python: str) -> str:
    """`python` (a name on PATH or a path) as the absolute executable that ocrvl's managed
    server requires for `server.python` (a bare `python3` there makes every replica fail);
    ValueError where there is none."""
    found = shutil.which(python)
    if not found:
        raise ValueError(f"{python!r} is not an executable Python (not found on PATH)")
    return os.path.abspath(found)


def vllm_python_arg(value: str) -> str:
    """argparse's `type` for --vllm-python: resolved to an absolute executable."""
    try:
        return python_executable(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def managed_vllm(model_dir: str, python: str, pythonpath: str, port: int,
                 **server: Any) -> dict[str, Any]:  # fmt: skip
    """The `model:` and `server:` config sections of an ocrvl that starts real vLLM itself
    on a random-weight model dir (answer lengths forced) with its own `auto` settings;
    `server` adds keys (e.g. replicas). For `write_config(path, **managed_vllm(...))`."""
    env = {"PYTHONPATH": os.pathsep.join(p for p in (pythonpath, str(ROOT)) if p),
           "HF_HUB_OFFLINE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0",
           "VLLM_NO_USAGE_STATS": "1", LENGTHS_ENV: DEFAULT_LENGTHS}  # fmt: skip
    return {
        "model": {"weights": model_dir},
        "server": {"mode": "managed", "launcher": "vllm", "python": python_executable(python),
                   "port": port,
                   "startup_timeout": 600, "env": env,
                   "vllm_args": {"load-format": "dummy", "logits-processors": LOGITS_PROCESSOR,
                                 "enable-prefix-caching": False, "mm-processor-cache-gb": 0},
                   **server},
    }  # fmt: skip


class Metrics:
    """`/metrics` of one server, or of several summed (replicas), sampled every `interval` s
    in a thread: (time, running, waiting, preemptions)."""

    def __init__(self, *urls: str, interval: float = 0.25) -> None:
        self.urls, self.interval = urls, interval
        self.samples: list[tuple[float, float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(self.interval):
                # a sample only when every server answered: a partial sum would read as idle
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    ms = [parse_metrics(client.get(url + "/metrics").text, time.monotonic())
                          for url in self.urls]  # fmt: skip
                    self.samples.append((ms[-1].taken_at, sum(m.running or 0.0 for m in ms),
                                         sum(m.waiting or 0.0 for m in ms),
                                         sum(m.preemptions_total or 0.0 for m in ms)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def last(self) -> tuple[float, float, float, float] | None:
        return self.samples[-1] if self.samples else None

    def idle(self) -> bool:
        last = self.last()
        return last is not None and last[1] == 0 and last[2] == 0

    def wait_idle(self) -> None:
        """Until nothing runs or waits, then IDLE_SETTLE_S more."""
        start = len(self.samples)
        wait_until(lambda: len(self.samples) > start and self.idle(), 600, interval=0.1,
                   what="an idle vLLM server")  # fmt: skip
        time.sleep(IDLE_SETTLE_S)

    def window(self, t0: float, t1: float) -> list[tuple[float, float, float, float]]:
        return [s for s in self.samples if t0 <= s[0] <= t1]

    def timeline(self, t0: float, t1: float, buckets: int = 24) -> list[int | None]:
        """Mean requests running in each of `buckets` equal slices of [t0, t1] (None: no
        sample fell in that slice)."""
        width = (t1 - t0) / buckets
        out: list[int | None] = []
        for i in range(buckets):
            xs = [s[1] for s in self.window(t0 + i * width, t0 + (i + 1) * width)]
            out.append(round(sum(xs) / len(xs)) if xs else None)
        return out

    def preemptions(self, t0: float, t1: float) -> int:
        xs = self.window(t0, t1 + 2 * self.interval)
        return int(xs[-1][3] - xs[0][3]) if len(xs) > 1 else 0


def version(url: str) -> str:
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        return str(httpx.get(url + "/version", timeout=5).json()["version"])
    return "?"


def model_dir_parser(prog: str, doc: str | None, required: bool = True
                     ) -> argparse.ArgumentParser:  # fmt: skip
    """A benchmark's parser with what starting vLLM on a random-weight model dir needs
    (`required=False`: the benchmark has a dry run without vLLM)."""
    ap = argparse.ArgumentParser(prog=prog, description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model-dir", required=required,
                    help="random-weight model dir (bench.gpu.dummy_model)")
    add_vllm_args(ap)
    return ap


def add_vllm_args(ap: argparse.ArgumentParser | Any) -> None:
    """--vllm-python (resolved to an absolute executable: ocrvl's `server.python` needs one)
    and --vllm-pythonpath."""
    ap.add_argument("--vllm-python", default=sys.executable, type=vllm_python_arg,
                    help="the Python that has vLLM (a name on PATH or a path; passed on as "
                    "its absolute path)")  # fmt: skip
    ap.add_argument("--vllm-pythonpath", default="", help="PYTHONPATH for vLLM (a bundle)")

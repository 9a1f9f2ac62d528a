"""How the fake vLLM starts up: the fake VRAM model, vLLM's start-up lines and failure messages,
and the stand-in for its engine child process.

Fake VRAM model (``--fake-vram-gib G``, ``--fake-vram-used-gib U``), utilization u:
``free-memory`` failure if u*G > G-U; else kv = u*G - weights (``--fake-weights-gib``,
1.9) - spike (max_num_seqs*0.004 + 0.5 GiB, the profiling peak) and ``oom-kv`` if kv <= 0;
else ``max-len`` (naming the length that would fit) if max_model_len *
``--fake-kv-gib-per-token`` > kv; else it starts with kv/kv-per-token tokens of KV cache.
Lowering max-num-seqs, then max-model-len, then utilization eventually lets it start.
With ``--fake-vram-ledger DIR`` servers share one fake card: what the live ones hold (a file
per pid in DIR, written once a start passes the free-memory check) counts as used too.
``--fail-start KIND`` (``oom-kv``, ``free-memory``, ``max-len``, ``cuda-oom``) prints that
failure whatever the model says. The start-up lines are spread over ``--startup-delay``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

from testkit.fake_server.config import FakeServerConfig
from testkit.fake_server.console import emit, vllm_line

FAIL_KINDS = ("oom-kv", "free-memory", "max-len", "cuda-oom")
ENGINE_CHILD_MAX_SECONDS = 600
ENGINE_CHILD_MARKER = "VLLM::EngineCore"
ROOT_CAUSE_TAIL = (
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
)
# What real vLLM 0.26 prints between its root cause and ROOT_CAUSE_TAIL (recorded on a GPU):
# 63 lines of tracebacks, so a reader of the last few lines never sees the cause.
FAILURE_TRACEBACK = (Path(__file__).with_name("vllm_failure_tail.txt")
                     .read_text(encoding="utf-8").splitlines())

# prctl(PR_SET_NAME) makes `pgrep VLLM` find it like vLLM's setproctitle'd engine; the
# marker argument makes `pgrep -f VLLM::EngineCore` find it; the sleep bounds a leak.
_ENGINE_CHILD_CODE = (
    "import ctypes, sys, time\n"
    "try:\n"
    "    ctypes.CDLL(None).prctl(15, b'VLLM::EngineCor', 0, 0, 0)\n"
    "except Exception:\n"
    "    pass\n"
    "time.sleep(float(sys.argv[1]))\n"
)



def free_memory_message(free: float, total: float, util: float, wanted: float) -> str:
    """vLLM's root cause when free VRAM is below utilization x total."""
    return (
        f"ValueError: Free memory on device ({free:.1f}/{total:.1f} GiB) on startup is less "
        f"than desired GPU memory utilization ({util}, {wanted:.2f} GiB). Decrease GPU memory "
        "utilization or reduce GPU memory used by other processes."
    )


def free_memory_info(cfg: FakeServerConfig) -> str:
    """The line every vLLM 0.26 start logs at INFO after profiling: no failure."""
    total = cfg.fake_vram_gib or 8.0
    free, util = total - cfg.fake_vram_used_gib, cfg.gpu_memory_utilization
    return (
        f"Free memory on device ({free:.2f}/{total:.2f} GiB) on startup. Desired GPU memory "
        f"utilization is ({util}, {util * total:.2f} GiB). Actual usage is "
        f"{cfg.fake_weights_gib:.2f} GiB for weight, 0.61 GiB for peak activation, 0.05 GiB "
        "for non-torch memory, and 0.31 GiB for CUDAGraph memory."
    )


def max_len_message(max_len: int, needed: float, available: float, estimate: int) -> str:
    """vLLM's root cause when one max-model-len sequence does not fit the KV cache."""
    return (
        f"ValueError: To serve at least one request with the model's max seq len ({max_len}), "
        f"({needed:.2f} GiB KV cache is needed, which is larger than the available KV cache "
        f"memory ({available:.2f} GiB). Based on the available memory, the estimated maximum "
        f"model length is {estimate}. Try increasing `gpu_memory_utilization` or decreasing "
        "`max_model_len` when initializing the engine."
    )


OOM_KV_MESSAGE = (
    "ValueError: No available memory for the cache blocks. Try increasing "
    "`gpu_memory_utilization` when initializing the engine."
)
CUDA_OOM_MESSAGE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.20 GiB. GPU 0 has a "
    "total capacity of 7.63 GiB of which 512.00 MiB is free."
)
FIXED_FAILURES = {
    "oom-kv": OOM_KV_MESSAGE,
    "free-memory": free_memory_message(6.5, 7.6, 0.9, 6.84),
    "max-len": max_len_message(131072, 2.25, 0.69, 40336),
    "cuda-oom": CUDA_OOM_MESSAGE,
}


@dataclasses.dataclass(frozen=True)
class StartupPlan:
    """How start-up ends: a failure kind and its root-cause line, or the KV cache size."""

    failure: str | None
    message: str
    kv_gib: float
    kv_tokens: int


def ledger_used_gib(ledger: str, own_pid: int) -> float:
    """GiB the other live fake servers on the shared fake card hold."""
    used = 0.0
    for entry in Path(ledger).iterdir():
        pid = int(entry.name)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue  # SIGKILLed: its memory is free again
        except PermissionError:
            pass
        if pid != own_pid:
            used += float(entry.read_text(encoding="utf-8") or 0)
    return used


def plan_startup(cfg: FakeServerConfig) -> StartupPlan:
    """Apply ``--fail-start`` or the fake VRAM model (see the module docstring)."""
    per_token = cfg.fake_kv_gib_per_token
    if cfg.fail_start:
        return StartupPlan(cfg.fail_start, FIXED_FAILURES[cfg.fail_start], 0.0, 0)
    if cfg.fake_vram_gib is None:
        tokens = cfg.kv_capacity_tokens or cfg.max_num_seqs * 2048
        return StartupPlan(None, "", tokens * per_token, tokens)
    total, util = cfg.fake_vram_gib, cfg.gpu_memory_utilization
    used = cfg.fake_vram_used_gib
    if cfg.fake_vram_ledger:
        used += ledger_used_gib(cfg.fake_vram_ledger, os.getpid())
    wanted, free = util * total, total - used
    if wanted > free:
        return StartupPlan("free-memory", free_memory_message(free, total, util, wanted), 0, 0)
    kv = wanted - cfg.fake_weights_gib - (cfg.max_num_seqs * 0.004 + 0.5)
    if kv <= 0:
        return StartupPlan("oom-kv", OOM_KV_MESSAGE, 0.0, 0)
    fits = int(kv / per_token)
    needed = cfg.max_model_len * per_token
    if needed > kv:
        return StartupPlan("max-len", max_len_message(cfg.max_model_len, needed, kv, fits), kv, 0)
    if cfg.fake_vram_ledger:
        (Path(cfg.fake_vram_ledger) / str(os.getpid())).write_text(str(wanted), encoding="utf-8")
    return StartupPlan(None, "", kv, cfg.kv_capacity_tokens or fits)



def startup_phases(
    cfg: FakeServerConfig, plan: StartupPlan, tokens: int
) -> list[tuple[float, str | None, str]]:
    """vLLM's start-up lines: (fraction of the delay, failure that strikes before it, line)."""
    name = cfg.served_model_names[0]
    return [
        (0.0, None, "vLLM API server version 0.0.0+fake"),
        (
            0.0,
            None,
            f"non-default args: {{'model': '{name}', 'max_model_len': {cfg.max_model_len}}}",
        ),
        (0.05, "free-memory", f"Starting to load model {name}..."),
        (0.15, None, "Loading weights took 0.50 seconds"),
        (
            0.25,
            None,
            f"Model loading took {cfg.fake_weights_gib:.1f} GiB memory and 2.1 seconds",
        ),
        (0.45, "cuda-oom", "Memory profiling takes 1.2 seconds"),
        (0.50, "oom-kv", f"Available KV cache memory: {plan.kv_gib:.2f} GiB"),
        (0.55, "max-len", f"GPU KV cache size: {tokens:,} tokens"),
        (
            0.55,
            None,
            f"Maximum concurrency for {cfg.max_model_len} tokens per request: "
            f"{tokens / cfg.max_model_len:.2f}x",
        ),
        (0.58, None, free_memory_info(cfg)),
        (0.60, None, "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 0/67"),
        (0.95, None, "Graph capturing finished in 3 secs, took 0.45 GiB"),
    ]


def print_failure(plan: StartupPlan) -> None:
    """Print vLLM's start-up failure: the traceback's root cause, then the engine's summary."""
    emit(vllm_line("ERROR", "core.py", "EngineCore failed to start."))
    emit("Traceback (most recent call last):")
    emit('  File "vllm/v1/engine/core.py", line 700, in run_engine_core')
    emit(plan.message)
    for line in FAILURE_TRACEBACK:
        emit(line)
    emit(ROOT_CAUSE_TAIL)


def spawn_engine_child() -> subprocess.Popen[bytes]:
    """Start a stand-in for vLLM's EngineCore process (``--spawn-engine-child``)."""
    # Same process group, no new session: killing the group must take it down, killing
    # only this process must orphan it (that is what real vLLM does).
    engine = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _ENGINE_CHILD_CODE,
            str(ENGINE_CHILD_MAX_SECONDS),
            ENGINE_CHILD_MARKER,
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    emit(vllm_line("INFO", "fake_server.py", f"Engine core process started (pid {engine.pid})"))
    return engine


def stop_engine_child(engine: subprocess.Popen[bytes] | None, sig: signal.Signals) -> None:
    """Send ``sig`` to the engine child if it runs, then reap it (SIGKILL after 1 s)."""
    if engine is None or engine.poll() is not None:
        return
    engine.send_signal(sig)
    try:
        engine.wait(1.0)
    except subprocess.TimeoutExpired:
        engine.kill()
        engine.wait()

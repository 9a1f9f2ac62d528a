"""Out-of-memory recovery end to end: the supervisor against the fake server's VRAM model.

nvidia-smi (a fake one) reports an 8 GB card with 1 GiB in use; by the time the server starts
another program holds more (`--fake-vram-used-gib`), so the first planned values fail with
vLLM's own out-of-memory texts.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ocrvl_daemon.config.file import validate_config
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.process.group import group_members
from ocrvl_daemon.server.autotune import (
    BATCHED_TOKENS,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    TUNING_FILE,
    UTILIZATION,
)
from ocrvl_daemon.server.gpu import NO_NVML_ENV, NVIDIA_SMI_ENV
from ocrvl_daemon.server.managed import ManagedServer
from ocrvl_daemon.server.supervisor import ServerState, ServerStatus, ServerSupervisor
from testkit.harness import free_port, wait_until
from testkit.runner import managed_fake_server

GPU_UUID = "GPU-5a1c4060-0000-4000-8000-000000004060"
BUDGET = 4096 + 1280 + 64  # what a page request can need: max_new_tokens + image + prompt
# Another program took 3.5 GiB after nvidia-smi was read; the model's weights and KV cache
# are larger than the real ones so that more than utilization has to give.
TIGHT_CARD = ("--fake-vram-gib", "8", "--fake-vram-used-gib", "3.5", "--fake-weights-gib", "3.2",
              "--fake-kv-gib-per-token", "0.0001", "--disable-uvicorn-access-log")


def fake_nvidia_smi(tmp_path: Path, total_mib: int = 8188, used_mib: int = 1024) -> str:
    """An nvidia-smi that reports one RTX 4060 with `used_mib` in use."""
    script = tmp_path / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        f"echo '0, {GPU_UUID}, NVIDIA GeForce RTX 4060, {total_mib}, {used_mib}, "
        f"{total_mib - used_mib}, 560.94, 8.9'\n")
    script.chmod(0o755)
    return str(script)


def make_config(tmp_path: Path, *fake_args: str, **server: Any) -> Config:
    section = managed_fake_server(
        free_port(), *fake_args, health_interval=0.2, startup_timeout=20, stop_timeout=3,
        restart_backoff_initial=0.1, restart_backoff_max=0.4,
        env={NVIDIA_SMI_ENV: fake_nvidia_smi(tmp_path), NO_NVML_ENV: "1"}, **server)
    return validate_config({"state_dir": str(tmp_path / "state"), "server": section})


@contextmanager
def supervised(config: Config) -> Iterator[tuple[ServerSupervisor, list[ServerStatus]]]:
    """A running supervisor and the statuses it reported; every group it ran checked gone."""
    changes: list[ServerStatus] = []
    with ManagedServer(config, on_change=changes.append) as sup:
        yield sup, changes
    for pgid in {c.pid for c in changes if c.pid is not None}:
        left = group_members(pgid)
        for proc in left:
            proc.kill()
        assert not left, f"server group {pgid} outlived stop(): {left}"


def launches(changes: list[ServerStatus]) -> int:
    return len({c.pid for c in changes if c.pid is not None})


def messages(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "ocrvl_daemon.server.managed" and r.levelno == level
            and text in r.getMessage()]


def test_lowers_step_by_step_then_remembers(tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "ocrvl_daemon")
    config = make_config(tmp_path, *TIGHT_CARD)
    with supervised(config) as (sup, changes):
        assert sup.wait_ready(40), sup.status()
        settled = sup.vllm_args
        steps = messages(caplog, logging.WARNING, "ran out of GPU memory")
        assert launches(changes) == len(steps) + 1
    # The plan for the reading: 8188 MiB, 1024 used, 512 kept free, 1360 for vLLM beyond it.
    plan = messages(caplog, logging.INFO, "gpu-memory-utilization 0.64: NVIDIA GeForce RTX 4060")
    assert plan
    # vLLM's free-memory check names the share that is free: utilization goes there first...
    assert "gpu-memory-utilization 0.64 -> 0.54" in steps[0]
    # ...then the KV cache is too small for a request: the batch is halved, then max-model-len
    # comes down to what a page request can need (model_budget), never below.
    assert len(steps) == 4
    assert all("max-num-seqs" in step for step in steps[1:3])
    assert f"max-model-len 5632 -> {BUDGET}" in steps[3]
    expected = {UTILIZATION: 0.54, MAX_MODEL_LEN: BUDGET, MAX_NUM_SEQS: 16, BATCHED_TOKENS: 5632}
    assert {k: settled[k] for k in expected} == expected
    # Only a start that succeeded is remembered, for this GPU and model.
    saved = json.loads((tmp_path / "state" / TUNING_FILE).read_text())
    assert saved[f"{GPU_UUID}|{config.model.name}"]["values"] == expected
    assert messages(caplog, logging.INFO, "remembered")

    caplog.clear()
    with supervised(config) as (again, changes):
        assert again.wait_ready(20), again.status()
        assert again.vllm_args == settled
        assert launches(changes) == 1 and again.restart_count == 0
    assert not messages(caplog, logging.WARNING, "ran out of GPU memory")


def test_explicit_values_are_kept_and_the_fix_is_named(tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "ocrvl_daemon")
    config = make_config(tmp_path, *TIGHT_CARD, vllm_args={
        "gpu-memory-utilization": 0.81, "max-num-seqs": 64})
    with supervised(config) as (sup, _):
        wait_until(lambda: sup.restart_count >= 2, 30, what="two failed starts")
        status = sup.status()
        assert status.state is not ServerState.READY
        assert sup.vllm_args[UTILIZATION] == 0.81 and sup.vllm_args[MAX_NUM_SEQS] == 64
    line = "`gpu-memory-utilization: 0.54`"
    assert status.last_error is not None and line in status.last_error
    assert "config.yaml" in status.last_error
    assert status.diagnosis is not None and line in status.diagnosis.fix
    assert messages(caplog, logging.ERROR, line)
    assert not messages(caplog, logging.WARNING, "ran out of GPU memory")
    assert not (tmp_path / "state" / TUNING_FILE).exists()


def test_nothing_left_to_lower_keeps_retrying_at_the_capped_delay(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "ocrvl_daemon")
    # 5 GiB taken by others: even the lowest utilization (0.5 of 8 GiB) is more than is free.
    config = make_config(tmp_path, "--fake-vram-gib", "8", "--fake-vram-used-gib", "5",
                         "--disable-uvicorn-access-log")
    with supervised(config) as (sup, changes):
        wait_until(lambda: [c.phase for c in changes].count("next try in 0.4s") >= 2, 30,
                   what="two retries at the capped delay")
        status = sup.status()
        assert sup.vllm_args[UTILIZATION] == 0.5
    assert status.state is not ServerState.READY
    assert status.last_error is not None
    assert "Nothing ocrvl may change is left to lower" in status.last_error
    loud = messages(caplog, logging.ERROR, "Nothing ocrvl may change is left to lower")
    assert len(loud) >= 2
    assert "Free memory on device" in loud[0]
    assert not (tmp_path / "state" / TUNING_FILE).exists()

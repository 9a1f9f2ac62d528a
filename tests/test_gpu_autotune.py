"""GPU reading (fake nvidia-smi), `auto` vLLM settings and out-of-memory recovery."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.server import autotune, gpu
from ocrvl_daemon.server.autotune import (
    BATCHED_TOKENS,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    UTILIZATION,
    load_remembered,
    next_after_oom,
    plan_vllm_args,
    save_remembered,
    suggestion,
)
from ocrvl_daemon.server.gpu import GpuReading
from ocrvl_daemon.server.vllm_diagnosis import is_oom, kv_cache_too_small, oom_cause
from testkit.fake_server import (
    FAIL_KINDS,
    FIXED_FAILURES,
    FakeServerConfig,
    plan_startup,
)

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"
BUDGET = 4096 + 1280 + 64  # default max_new_tokens + image + prompt tokens
BUDGET_ROUNDED = 5632

# vLLM's own start-up failure texts (root cause, then the engine's summary line).
ENGINE_FAILED = "RuntimeError: Engine core initialization failed. See root cause above."
CACHE_BLOCKS = ("ValueError: No available memory for the cache blocks. Try increasing "
                "`gpu_memory_utilization` when initializing the engine.\n" + ENGINE_FAILED)
FREE_MEMORY = ("ValueError: Free memory on device (5.12/7.99 GiB) on startup is less than desired "
               "GPU memory utilization (0.81, 6.47 GiB). Decrease GPU memory utilization or "
               "reduce GPU memory used by other processes.\n" + ENGINE_FAILED)
CUDA_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 594.00 MiB. GPU 0 has "
            "a total capacity of 7.99 GiB of which 120.00 MiB is free.\n" + ENGINE_FAILED)


def estimated(length: int) -> str:
    return ("ValueError: To serve at least one request with the model's max seq len (65536), "
            "(1.13 GiB KV cache is needed, which is larger than the available KV cache memory "
            f"(0.69 GiB). Based on the available memory, the estimated maximum model length is "
            f"{length}. Try increasing `gpu_memory_utilization` or decreasing `max_model_len` "
            "when initializing the engine.\n" + ENGINE_FAILED)


def fake_smi(tmp_path: Path, name: str) -> str:
    """An executable copy of a fixture script (fixtures may lose their mode bits)."""
    target = tmp_path / f"nvidia-smi-{name}"
    shutil.copyfile(FIXTURES / f"{name}.sh", target)
    target.chmod(0o755)
    return str(target)


def smi_env(tmp_path: Path, name: str, **extra: str) -> dict[str, str]:
    return {gpu.NVIDIA_SMI_ENV: fake_smi(tmp_path, name), gpu.NO_NVML_ENV: "1", **extra}


def reading(tmp_path: Path, name: str) -> GpuReading:
    found = gpu.read_gpu(smi_env(tmp_path, name))
    assert found is not None
    return found


def card(total: int, used: int, free: int | None = None, cc: tuple[int, int] = (8, 9)
         ) -> GpuReading:
    return GpuReading(0, "GPU-test", "Test GPU", total, used,
                      total - used if free is None else free, "560.94", cc, "nvidia-smi")


# --- gpu.py ---------------------------------------------------------------------------------

def test_reads_rtx4060_through_nvidia_smi(tmp_path: Path) -> None:
    found = reading(tmp_path, "rtx4060")
    assert found == GpuReading(0, "GPU-5a1c4060-0000-4000-8000-000000004060",
                               "NVIDIA GeForce RTX 4060", 8188, 1024, 7164, "560.94", (8, 9),
                               "nvidia-smi", busy_pct=37, power_w=64.12)


def test_reads_t4_compute_capability(tmp_path: Path) -> None:
    assert reading(tmp_path, "t4").compute_capability == (7, 5)


def test_failing_nvidia_smi_means_no_gpu_with_its_message(tmp_path: Path) -> None:
    probe = gpu.probe_gpu(smi_env(tmp_path, "nogpu"))
    assert probe.reading is None
    assert "status 9" in probe.problems[-1]
    assert "NVIDIA-SMI has failed" in probe.problems[-1]


def test_missing_nvidia_smi_means_no_gpu(tmp_path: Path) -> None:
    env = {gpu.NVIDIA_SMI_ENV: str(tmp_path / "absent"), gpu.NO_NVML_ENV: "1"}
    probe = gpu.probe_gpu(env)
    assert probe.reading is None
    assert probe.problems and "nvidia-smi" in probe.problems[-1]


def _two_gpus(tmp_path: Path) -> str:
    script = tmp_path / "nvidia-smi-two"
    script.write_text(
        "#!/bin/sh\n"
        "echo '0, GPU-aaaa1111, NVIDIA GeForce RTX 3060, 12288, 500, 11788, 550.1, 8.6'\n"
        "echo '1, GPU-bbbb2222, NVIDIA GeForce RTX 4060, 8188, [N/A], 8000, 550.1, 8.9'\n")
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize(("visible", "name"), [
    (None, "NVIDIA GeForce RTX 3060"),
    ("1", "NVIDIA GeForce RTX 4060"),
    ("1,0", "NVIDIA GeForce RTX 4060"),
    ("GPU-bbbb", "NVIDIA GeForce RTX 4060"),  # CUDA accepts a UUID prefix
    ("GPU-aaaa1111", "NVIDIA GeForce RTX 3060"),
])
def test_cuda_visible_devices_selects_the_gpu(tmp_path: Path, visible: str | None, name: str
                                              ) -> None:
    env = {gpu.NVIDIA_SMI_ENV: _two_gpus(tmp_path), gpu.NO_NVML_ENV: "1"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    found = gpu.read_gpu(env)
    assert found is not None and found.name == name


def test_unavailable_used_memory_is_total_minus_free(tmp_path: Path) -> None:
    env = {gpu.NVIDIA_SMI_ENV: _two_gpus(tmp_path), gpu.NO_NVML_ENV: "1",
           "CUDA_VISIBLE_DEVICES": "1"}
    found = gpu.read_gpu(env)
    assert found is not None and found.used_mib == 188


@pytest.mark.parametrize("visible", ["", "-1", "7"])
def test_hidden_or_absent_device_means_no_gpu(tmp_path: Path, visible: str) -> None:
    env = {gpu.NVIDIA_SMI_ENV: _two_gpus(tmp_path), gpu.NO_NVML_ENV: "1",
           "CUDA_VISIBLE_DEVICES": visible}
    assert gpu.read_gpu(env) is None


@pytest.mark.parametrize(("osrelease", "wsl"), [
    ("5.15.167.4-microsoft-standard-WSL2", True),
    ("4.4.0-19041-Microsoft", True),
    ("6.1.0-28-amd64", False),
])
@pytest.mark.quick
def test_detects_wsl(osrelease: str, wsl: bool) -> None:
    assert gpu.is_wsl(osrelease) is wsl


# --- plan_vllm_args -------------------------------------------------------------------------

def test_rtx4060_plan(tmp_path: Path) -> None:
    found = reading(tmp_path, "rtx4060")
    tuned = plan_vllm_args(Config.model_validate({}), found, None)
    values = tuned.values
    # (7164 free - 512 margin - 1360 vLLM's own beyond its budget) / 8188, rounded down
    assert values[UTILIZATION] == 0.64
    assert values[UTILIZATION] <= found.free_mib / found.total_mib
    assert values[MAX_MODEL_LEN] == BUDGET_ROUNDED
    assert values[MAX_NUM_SEQS] >= 8 and values[MAX_NUM_SEQS] % 8 == 0
    assert values[BATCHED_TOKENS] == autotune.PLANNED_BATCHED_TOKENS
    assert not tuned.warnings
    assert any("RTX 4060" in r for r in tuned.reasons)


def test_rtx4090_plan_is_capped(tmp_path: Path) -> None:
    values = plan_vllm_args(Config.model_validate({}), reading(tmp_path, "rtx4090"), None).values
    assert 0.85 <= values[UTILIZATION] <= 0.95
    assert values[MAX_NUM_SEQS] == 256


def test_t4_plan(tmp_path: Path) -> None:
    values = plan_vllm_args(Config.model_validate({}), reading(tmp_path, "t4"), None).values
    # (15357 - 5% margin - 1360 vLLM's own beyond its budget) / 15360, rounded down
    assert values[UTILIZATION] == 0.86
    assert values[MAX_MODEL_LEN] == BUDGET_ROUNDED


@pytest.mark.quick
def test_no_gpu_falls_back_to_safe_values() -> None:
    tuned = plan_vllm_args(Config.model_validate({}), None, None)
    assert tuned.values[UTILIZATION] == 0.64
    assert tuned.values[MAX_MODEL_LEN] == BUDGET_ROUNDED
    assert tuned.values[MAX_NUM_SEQS] == 32
    assert any("no GPU was found" in r for r in tuned.reasons)


@pytest.mark.quick
def test_utilization_never_exceeds_the_free_share() -> None:
    # WSL2 and newer drivers can report less free memory than total - used.
    tight = card(8188, 1024, free=6500)
    value = plan_vllm_args(Config.model_validate({}), tight, None).values[UTILIZATION]
    assert value <= 6500 / 8188


@pytest.mark.quick
def test_busy_gpu_is_warned_about() -> None:
    tuned = plan_vllm_args(Config.model_validate({}), card(8188, 4700), None)
    assert tuned.values[UTILIZATION] == 0.5
    assert any("refuse to start" in w for w in tuned.warnings)


@pytest.mark.quick
def test_max_model_len_follows_max_new_tokens() -> None:
    config = Config.model_validate({"model": {"max_new_tokens": 8192}})
    values = plan_vllm_args(config, card(8188, 1024), None).values
    assert values[MAX_MODEL_LEN] == 9728  # 8192 + 1344 rounded up to 256


@pytest.mark.quick
def test_explicit_values_win() -> None:
    config = Config.model_validate({"server": {"vllm_args": {
        "gpu-memory-utilization": 0.6, "max-num-seqs": 12, "max-num-batched-tokens": 8192}}})
    tuned = plan_vllm_args(config, card(24564, 300), None)
    assert tuned.values[UTILIZATION] == 0.6
    assert tuned.values[MAX_NUM_SEQS] == 12
    assert tuned.values[BATCHED_TOKENS] == 8192
    assert tuned.values[MAX_MODEL_LEN] == BUDGET_ROUNDED
    assert any("set in the config" in r for r in tuned.reasons)


@pytest.mark.quick
def test_explicit_utilization_sizes_the_auto_num_seqs() -> None:
    low = Config.model_validate({"server": {"vllm_args": {"gpu-memory-utilization": 0.5}}})
    small = plan_vllm_args(low, card(8188, 0), None).values[MAX_NUM_SEQS]
    large = plan_vllm_args(Config.model_validate({}), card(8188, 0), None).values[MAX_NUM_SEQS]
    assert 8 <= small < large


@pytest.mark.quick
def test_remembered_values_lower_the_plan_but_not_below_the_budget() -> None:
    remembered = {UTILIZATION: 0.55, MAX_NUM_SEQS: 16, MAX_MODEL_LEN: 1000,
                  BATCHED_TOKENS: 5632}
    tuned = plan_vllm_args(Config.model_validate({}), card(8188, 1024), remembered)
    assert tuned.values[UTILIZATION] == 0.55
    assert tuned.values[MAX_NUM_SEQS] == 16
    assert tuned.values[MAX_MODEL_LEN] == BUDGET
    assert tuned.values[BATCHED_TOKENS] == 5632
    assert any(autotune.TUNING_FILE in r for r in tuned.reasons)


@pytest.mark.quick
def test_remembered_values_do_not_touch_explicit_ones() -> None:
    config = Config.model_validate({"server": {"vllm_args": {"max-num-seqs": 64}}})
    tuned = plan_vllm_args(config, card(8188, 1024), {MAX_NUM_SEQS: 8})
    assert tuned.values[MAX_NUM_SEQS] == 64


@pytest.mark.quick
def test_remembered_round_trip_keyed_by_gpu_and_model(tmp_path: Path) -> None:
    a4060, other = card(8188, 1024), GpuReading(0, "GPU-other", "Other", 8188, 0, 8188, "1",
                                                 (8, 6), "nvml")
    assert load_remembered(tmp_path, a4060, "PaddleOCR-VL-1.6-0.9B") is None
    save_remembered(tmp_path / "state", a4060, "PaddleOCR-VL-1.6-0.9B",
                    {UTILIZATION: 0.76, MAX_NUM_SEQS: 22, "enforce-eager": True})
    state = tmp_path / "state"
    assert load_remembered(state, a4060, "PaddleOCR-VL-1.6-0.9B") == {
        UTILIZATION: 0.76, MAX_NUM_SEQS: 22}
    assert load_remembered(state, other, "PaddleOCR-VL-1.6-0.9B") is None
    assert load_remembered(state, a4060, "PaddleOCR-VL-0.9B") is None
    assert [p.name for p in state.iterdir()] == [autotune.TUNING_FILE]


@pytest.mark.quick
def test_corrupt_tuning_file_is_ignored(tmp_path: Path) -> None:
    (tmp_path / autotune.TUNING_FILE).write_text("{not json")
    assert load_remembered(tmp_path, card(8188, 0), "PaddleOCR-VL-1.6-0.9B") is None
    save_remembered(tmp_path, card(8188, 0), "PaddleOCR-VL-1.6-0.9B", {MAX_NUM_SEQS: 8})
    data = json.loads((tmp_path / autotune.TUNING_FILE).read_text())
    assert list(data) == ["GPU-test|PaddleOCR-VL-1.6-0.9B"]


# --- out-of-memory recovery -----------------------------------------------------------------

@pytest.mark.quick
@pytest.mark.parametrize("text", [CACHE_BLOCKS, FREE_MEMORY, CUDA_OOM, estimated(40336)])
def test_recognises_vllm_oom(text: str) -> None:
    assert is_oom(text)
    assert oom_cause(text) == text.splitlines()[0]


@pytest.mark.quick
def test_other_failures_are_not_oom() -> None:
    assert not is_oom("OSError: PaddlePaddle/PaddleOCR-VL is not a valid model identifier\n"
                      + ENGINE_FAILED)


def _walk(start: dict, config: Config, text: str) -> list[dict]:
    steps = [start]
    while (nxt := next_after_oom(steps[-1], config, text)) is not None:
        steps.append(nxt)
        assert len(steps) < 50, "recovery does not end"
    return steps


@pytest.mark.quick
@pytest.mark.parametrize("text", [CUDA_OOM, CACHE_BLOCKS, FREE_MEMORY, estimated(3000),
                                  estimated(40336)])
def test_recovery_ends_and_stays_within_bounds(text: str) -> None:
    config = Config.model_validate({})
    start = plan_vllm_args(config, card(8188, 1024), None).values
    steps = _walk(start, config, text)
    assert len(steps) > 1
    for before, after in itertools.pairwise(steps):
        assert after != before
        for key in autotune.TUNED_KEYS:
            assert after[key] <= before[key]  # only ever lowered
    for step in steps:
        assert step[MAX_MODEL_LEN] >= BUDGET
        assert step[BATCHED_TOKENS] >= BUDGET
        assert step[UTILIZATION] >= 0.5
        assert step[MAX_NUM_SEQS] >= 8


@pytest.mark.quick
def test_cuda_oom_lowers_batch_then_length_then_utilization() -> None:
    config = Config.model_validate({})
    start = plan_vllm_args(config, card(8188, 1024), None).values
    steps = _walk(start, config, CUDA_OOM)
    assert steps[1][MAX_NUM_SEQS] == start[MAX_NUM_SEQS] // 2
    assert steps[1][BATCHED_TOKENS] == start[BATCHED_TOKENS] // 2
    assert steps[1][UTILIZATION] == start[UTILIZATION]
    first_len = next(i for i, s in enumerate(steps) if s[MAX_MODEL_LEN] < start[MAX_MODEL_LEN])
    first_util = next(i for i, s in enumerate(steps) if s[UTILIZATION] < start[UTILIZATION])
    assert steps[first_len - 1][MAX_NUM_SEQS] == 8
    assert first_len < first_util
    assert steps[first_util][UTILIZATION] == pytest.approx(start[UTILIZATION] - 0.05)
    assert steps[-1][UTILIZATION] == 0.5
    assert steps[-1][MAX_MODEL_LEN] == BUDGET


# vLLM 0.26.0's own output on an H200 when 41.9 GiB were taken after ocrvl read the GPU
# (bench/gpu/oom_step_down.py): the cause, then 63 lines of tracebacks.
REAL_FREE_MEMORY = (Path(__file__).parent / "fixtures"
                    / "vllm-0.26-free-memory-failure.log").read_text(encoding="utf-8")
# ...and the line every successful vLLM 0.26 start logs at INFO.
REAL_START_INFO = ("(EngineCore pid=1708) INFO 12-01 23:09:40 [gpu_worker.py:851] Free memory on "
                   "device (96.83/139.8 GiB) on startup. Desired GPU memory utilization is "
                   "(0.67, 93.67 GiB). Actual usage is 1.63 GiB for weight, 0.61 GiB for peak "
                   "activation, 0.05 GiB for non-torch memory, and 0.31 GiB for CUDAGraph memory.")


@pytest.mark.quick
def test_real_vllm_free_memory_failure_is_read_and_lowers_to_the_free_share() -> None:
    assert is_oom(REAL_FREE_MEMORY), "vLLM 0.26's free-memory refusal was not seen as out of memory"
    current = {UTILIZATION: 0.94, MAX_MODEL_LEN: 5632, MAX_NUM_SEQS: 256, BATCHED_TOKENS: 16384}
    after = next_after_oom(current, Config.model_validate({}), REAL_FREE_MEMORY)
    assert after == {**current, UTILIZATION: 0.67}  # 96.83 / 139.8 - 0.02, rounded down


@pytest.mark.quick
def test_a_successful_starts_free_memory_line_is_not_a_failure() -> None:
    assert not is_oom(REAL_START_INFO + "\n" + ENGINE_FAILED), \
        "the start-up INFO line about free memory was taken for an out-of-memory failure"


@pytest.mark.quick
def test_free_memory_error_jumps_to_the_reported_share() -> None:
    current = {UTILIZATION: 0.81, MAX_MODEL_LEN: 5632, MAX_NUM_SEQS: 88, BATCHED_TOKENS: 16384}
    after = next_after_oom(current, Config.model_validate({}), FREE_MEMORY)
    assert after == {**current, UTILIZATION: 0.62}  # 5.12 / 7.99 - 0.02, rounded down


@pytest.mark.quick
def test_cache_blocks_error_never_lowers_utilization() -> None:
    config = Config.model_validate({})
    start = plan_vllm_args(config, card(8188, 1024), None).values
    steps = _walk(start, config, CACHE_BLOCKS)
    assert steps[-1][UTILIZATION] == start[UTILIZATION]
    assert steps[-1][MAX_NUM_SEQS] == 8


# vLLM 0.33.0 on the 8 GB card emulated on an H100 with the layout model beside it (bench
# small-card, 2026-12-07): ocrvl's plan, made for 0.26.0's start-up peak, left it -0.86 GiB of
# KV cache. The same start at max-num-batched-tokens 8192 had 0.56 GiB (measured there too).
REAL_033_NO_KV = (Path(__file__).parent / "fixtures"
                  / "vllm-0.33-no-kv-cache-8gb-layout.log").read_text(encoding="utf-8")


@pytest.mark.quick
def test_vllm_033_failing_the_8gb_layout_plan_steps_down_to_the_batch_that_started() -> None:
    assert kv_cache_too_small(REAL_033_NO_KV), \
        "vLLM 0.33's 'no memory for the cache blocks' start was not seen as a KV-cache shortage"
    planned = {UTILIZATION: 0.46, MAX_MODEL_LEN: 5632, MAX_NUM_SEQS: 24, BATCHED_TOKENS: 16384}
    after = next_after_oom(planned, Config.model_validate({}), REAL_033_NO_KV)
    # A smaller share of the card would only shrink the KV cache further.
    assert after == {**planned, MAX_NUM_SEQS: 12, BATCHED_TOKENS: 8192}, \
        "after vLLM 0.33 found no room for its KV cache, the next start is not the one that fit"


@pytest.mark.quick
def test_estimated_length_is_taken_when_it_fits_the_budget() -> None:
    current = {UTILIZATION: 0.9, MAX_MODEL_LEN: 65536, MAX_NUM_SEQS: 64, BATCHED_TOKENS: 16384}
    after = next_after_oom(current, Config.model_validate({}), estimated(40336))
    assert after == {**current, MAX_MODEL_LEN: 40192}
    after = next_after_oom(current, Config.model_validate({}), estimated(5500))
    assert after == {**current, MAX_MODEL_LEN: BUDGET}  # rounding down would undercut it


@pytest.mark.quick
def test_explicit_values_are_not_lowered_but_suggested() -> None:
    config = Config.model_validate({"server": {"vllm_args": {
        "gpu-memory-utilization": 0.81, "max-model-len": 5632, "max-num-seqs": 88,
        "max-num-batched-tokens": 16384}}})
    current = plan_vllm_args(config, card(8188, 1024), None).values
    assert next_after_oom(current, config, CUDA_OOM) is None
    text = suggestion(current, config, CUDA_OOM)
    assert "max-num-seqs: 44" in text and "max-num-batched-tokens: 8192" in text
    assert "CUDA out of memory" in text
    assert "utilization" not in text.split("try", 1)[1]
    free = suggestion(current, config, FREE_MEMORY)
    assert "gpu-memory-utilization: 0.62" in free


@pytest.mark.quick
def test_auto_keys_recover_first_then_explicit_ones_are_suggested() -> None:
    config = Config.model_validate({"server": {"vllm_args": {"gpu-memory-utilization": 0.8}}})
    start = plan_vllm_args(config, card(8188, 1024), None).values
    steps = _walk(start, config, CUDA_OOM)
    assert all(s[UTILIZATION] == 0.8 for s in steps)
    assert "gpu-memory-utilization: 0.75" in suggestion(steps[-1], config, CUDA_OOM)


@pytest.mark.quick
def test_recovers_against_the_fake_servers_vram_model() -> None:
    # The reading said 1 GiB was in use; by start-up another program holds 3.5 GiB.
    config = Config.model_validate({})
    args = plan_vllm_args(config, card(8192, 1024), None).values
    for _ in range(20):
        started = plan_startup(FakeServerConfig(
            fake_vram_gib=8.0, fake_vram_used_gib=3.5, gpu_memory_utilization=args[UTILIZATION],
            max_model_len=args[MAX_MODEL_LEN], max_num_seqs=args[MAX_NUM_SEQS]))
        if started.failure is None:
            break
        assert is_oom(started.message)
        nxt = next_after_oom(args, config, started.message)
        assert nxt is not None, f"gave up on {started.message}"
        args = nxt
    assert started.failure is None
    assert args[UTILIZATION] == 0.54  # 4.5/8.0 free - 0.02


@pytest.mark.quick
@pytest.mark.parametrize("kind", FAIL_KINDS)
def test_fake_servers_failures_are_oom(kind: str) -> None:
    assert is_oom(FIXED_FAILURES[kind])


@pytest.mark.quick
def test_suggestion_when_nothing_is_left() -> None:
    current = {UTILIZATION: 0.5, MAX_MODEL_LEN: BUDGET, MAX_NUM_SEQS: 8, BATCHED_TOKENS: BUDGET}
    text = suggestion(current, Config.model_validate({}), CUDA_OOM)
    assert "Nothing ocrvl may change is left to lower" in text


def test_a_reading_says_how_busy_the_gpu_is_and_what_power_it_draws(tmp_path):
    busy = reading(tmp_path, "rtx4060")
    assert (busy.busy_pct, busy.power_w) == (37, 64.12)
    idle = reading(tmp_path, "t4")
    assert idle.busy_pct == 0 and idle.power_w is None, "[N/A] power must read as unknown"

"""vllm_diagnosis: each rule names the cause of a real failure, and none is fooled by a line
that vLLM logs on a start that goes on (or on the way to another failure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ocrvl_daemon.server.vllm_diagnosis import diagnose

FIXTURES = Path(__file__).parent / "fixtures"
# vLLM on a machine without CUDA: a warning it survives, then the failure.
NO_CUDA_LOG = (FIXTURES / "vllm-no-cuda.log").read_text(encoding="utf-8")
UVA_LOG = (FIXTURES / "vllm-wsl2-uva.log").read_text(encoding="utf-8")
DRIVER_LOG = (FIXTURES / "torch-driver-too-old.log").read_text(encoding="utf-8")

# (rule, a failure it must name, a real vLLM line of a start that goes on: no match)
RULES = [
    ("no_kv_memory", "ValueError: No available memory for the cache blocks. Try increasing "
     "`gpu_memory_utilization` when initializing the engine.",
     "(EngineCore_DP0 pid=7) INFO 12-01 10:00:02 [gpu_worker.py:298] Available KV cache "
     "memory: 3.51 GiB"),
    ("free_memory", "ValueError: Free memory on device (6.1/7.6 GiB) on startup is less than "
     "desired GPU memory utilization (0.9, 6.84 GiB). Decrease GPU memory utilization or "
     "reduce GPU memory used by other processes.",
     "(EngineCore_DP0 pid=7) INFO 12-01 10:00:01 [gpu_worker.py:240] Free memory on device "
     "(7.3/8.0 GiB) on startup. Desired GPU memory utilization is (0.46, 3.68 GiB)."),
    ("cuda_oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB.",
     "INFO 12-01 10:00:09 [model_runner.py:1396] If out-of-memory error occurs during cudagraph "
     "capture, consider decreasing `gpu_memory_utilization` or switching to eager mode."),
    ("mps", "RuntimeError: CUDA error: cudaErrorMpsConnectionFailed",
     "INFO 12-01 10:00:00 [__init__.py:216] Automatically detected platform cuda."),
    ("port_in_use", "OSError: [Errno 98] error while attempting to bind on address "
     "('127.0.0.1', 8118): address already in use",
     "INFO 12-01 10:01:40 [api_server.py:1880] Starting vLLM API server 0 on "
     "http://127.0.0.1:8118"),
    ("missing_package", "ModuleNotFoundError: No module named 'flash_attn'",
     "INFO 12-01 10:00:03 [cuda.py:240] Cannot use FlashAttention-2 backend because the "
     "vllm.vllm_flash_attn package is not found."),
    ("missing_package", "/venv/bin/python: No module named vllm",
     "WARNING 12-01 10:00:00 [_custom_ops.py:20] Failed to import from vllm._C with "
     "ModuleNotFoundError(\"No module named 'vllm._C'\")"),
    ("model_mismatch", "The model `PaddleOCR-VL-0.9B` does not exist.",
     "INFO 12-01 10:00:00 [model.py:547] Resolved architecture: "
     "PaddleOCRVLForConditionalGeneration"),
    ("max_len", "ValueError: ... Based on the available memory, the estimated maximum model "
     "length is 40336.", "INFO 12-01 10:00:00 [model.py:1510] Using max model len 5632"),
    ("wsl_uva", "RuntimeError: UVA is not available",
     "WARNING 12-01 10:00:00 [interface.py:232] Using 'pin_memory=False' as WSL is detected. "
     "This may slow down the performance."),
    # vLLM 0.34.0 on the lent H100 (2026-12-07) given the older releases' WSL2 work-around:
    ("v1_runner_removed", "ValueError: VLLM_USE_V2_MODEL_RUNNER=0 is no longer supported: "
     "Model Runner V1 has been removed. Unset this variable.",
     "WARNING 12-07 03:58:07 [interface.py:1487] VLLM_USE_V2_MODEL_RUNNER=1 is redundant and "
     "can be unset: Model Runner V1 has been removed."),
    ("driver_too_old", DRIVER_LOG.splitlines()[-1],
     "INFO 12-01 10:00:00 [__init__.py:216] Automatically detected platform cuda."),
    ("no_device", "RuntimeError: Failed to infer device type",
     "INFO 12-07 03:01:14 [__init__.py:243] No platform detected, vLLM is running on "
     "UnspecifiedPlatform"),
]


@pytest.mark.quick
@pytest.mark.parametrize(("kind", "failure", "harmless"), RULES,
                         ids=[f"{kind}-{i}" for i, (kind, _, _) in enumerate(RULES)])
def test_each_rule_names_its_failure_and_passes_over_a_line_vllm_survives(
        kind: str, failure: str, harmless: str) -> None:
    found = diagnose(failure)
    assert found is not None and found.kind == kind, \
        f"the failure {failure!r} was not diagnosed as {kind} (got {found})"
    assert diagnose(harmless) is None, \
        f"a line vLLM logs and survives was taken for a failure: {harmless!r}"


@pytest.mark.quick
def test_vllm_without_cuda_is_no_gpu_not_a_missing_vllm() -> None:
    found = diagnose(NO_CUDA_LOG)
    assert found is not None and found.kind == "no_device", \
        f"vLLM without a GPU was diagnosed as {found}: setup-server cannot help there"
    assert "setup-server" not in found.fix and "server.mode: external" in found.fix
    assert found.permanent


@pytest.mark.quick
def test_uva_under_wsl2_names_the_v1_runner() -> None:
    found = diagnose(UVA_LOG)
    assert found is not None and found.kind == "wsl_uva", found
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in found.fix and found.permanent


@pytest.mark.quick
def test_a_driver_too_old_names_its_cuda_version_and_the_fix() -> None:
    found = diagnose(DRIVER_LOG)
    assert found is not None and found.kind == "driver_too_old", found
    assert "CUDA 12.7" in found.cause, found.cause
    assert "Windows driver" in found.fix and "--vllm 0.19.1" in found.fix
    assert found.permanent

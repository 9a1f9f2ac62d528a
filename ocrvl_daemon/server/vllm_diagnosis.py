"""Reading vLLM's output: the likely cause of a failure, out-of-memory text, start-up phases.

Every reading of vLLM's failure text goes through here: the supervisor's diagnosis and
autotune's out-of-memory step-down read the same patterns (pure functions). A rule matches a
failure's whole message, never a warning vLLM logs and survives (vLLM without CUDA warns
"No module named 'vllm._C'" before it fails with "Failed to infer device type").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from ocrvl_daemon.server import driver_check, vllm_release

DiagnosisKind = Literal["max_len", "no_kv_memory", "free_memory", "cuda_oom", "port_in_use",
                        "missing_package", "model_mismatch", "mps", "wsl_uva", "v1_runner_removed",
                        "driver_too_old", "no_device"]
# The kinds that mean "out of GPU memory": lowering vLLM's settings may help.
OOM_KINDS: frozenset[DiagnosisKind] = frozenset(
    {"max_len", "no_kv_memory", "free_memory", "cuda_oom"})
# The kinds that mean the KV cache is what is too small (a smaller GPU share only shrinks it).
KV_CACHE_KINDS: frozenset[DiagnosisKind] = frozenset({"max_len", "no_kv_memory"})


@dataclass(frozen=True)
class Diagnosis:
    """The likely cause of a server failure and its fix."""

    kind: DiagnosisKind
    cause: str
    fix: str
    permanent: bool = False  # restarting cannot help; needs the user
    limit: int | None = None  # max_len: the longest max-model-len vLLM says would fit

    def __str__(self) -> str:
        return f"{self.cause}; fix: {self.fix}"


_SETUP = "run `ocrvl setup-server`, or set server.python to a Python that has it"
# torch's words for a driver older than its CUDA build: "The NVIDIA driver on your system is
# too old (found version 12070)" (the driver's CUDA version, 12.7 there).
_DRIVER_TOO_OLD = re.compile(r"The NVIDIA driver on your system is too old \(found version "
                             r"(\d+)\)")
_MAX_LEN = re.compile(r"estimated maximum model length is (\d+)")
# vLLM's refusal to start. Every start also logs "Free memory on device (F/T GiB) on startup.
# Desired GPU memory utilization is ..." at INFO: that line is no failure.
_FREE_MEMORY = re.compile(r"Free memory on device[^(]*\(\s*([\d.]+)\s*/\s*([\d.]+)\s*GiB\) "
                          r"on startup is less than desired")
# (pattern, kind, cause, fix, permanent); the first match wins, most specific first.
_RULES: tuple[tuple[re.Pattern[str], DiagnosisKind, str, str, bool], ...] = (
    (re.compile(r"No available memory for the cache blocks"), "no_kv_memory",
     "out of memory (no room left for the KV cache)",
     "the weights and the start-up peak fill gpu-memory-utilization x VRAM: raise "
     "server.vllm_args.gpu-memory-utilization if nothing else uses the GPU, else lower "
     "max-num-seqs or max-num-batched-tokens", False),
    (_FREE_MEMORY, "free_memory",
     "out of memory (other programs hold GPU memory)",
     "lower server.vllm_args.gpu-memory-utilization, or close the programs using the GPU "
     "(see nvidia-smi)", False),
    (re.compile(r"CUDA out of memory|OutOfMemoryError"), "cuda_oom", "out of memory",
     "lower server.vllm_args.gpu-memory-utilization, max-num-seqs or max-model-len, or free "
     "GPU memory (see nvidia-smi)", False),
    # CUDA's MPS errors (cudaErrorMps..., CUDA_ERROR_MPS_...): the client could not use the
    # MPS server that server.mps runs (a container or GPU mode that does not allow it).
    (re.compile(r"cudaErrorMps\w*|CUDA_ERROR_MPS_\w*|MPS client failed", re.I), "mps",
     "the NVIDIA MPS server refused or lost this server (server.mps)",
     "see the MPS logs in <state_dir>/mps/log/, or set server.mps: off", False),
    (re.compile(r"address already in use", re.I), "port_in_use", "port already in use",
     "set server.port to a free port, or stop the program using it (ss -ltnp)", False),
    # A module name ends at its closing quote or the line's end: "No module named 'vllm._C'"
    # is vLLM's own warning without CUDA, not a missing vLLM.
    (re.compile(r"No module named '?(flash_attn|xformers)'?(?![\w.])"), "missing_package",
     "flash-attn or xformers is missing from the server environment",
     "run `ocrvl setup-server`, or use server.launcher: vllm", True),
    (re.compile(r"No module named '?vllm'?(?![\w.])|\bvllm: (command )?not found"),
     "missing_package", "vLLM is not installed in the server environment", _SETUP, True),
    # vLLM >= 0.24's default model runner (V2) needs UVA, which vLLM turns off under WSL2
    # (pinned memory); the V1 runner does without (vLLM issues 47387, 50239, 54652).
    (re.compile(r"RuntimeError: UVA is not available"), "wsl_uva",
     "vLLM's V2 model runner needs UVA, which it does not get under WSL2",
     "give the server VLLM_USE_V2_MODEL_RUNNER=0 in its environment (vLLM >= 0.34: "
     "VLLM_WSL2_ENABLE_PIN_MEMORY=1; a managed server under WSL2 gets the one its vLLM takes "
     "unless server.env or ocrvl's environment sets either); for a server you start, put it "
     "before `vllm serve`", True),
    # vLLM 0.34.0 removed the V1 runner: the WSL2 work-around of older releases stops it.
    (re.compile(r"VLLM_USE_V2_MODEL_RUNNER=0 is no longer supported"), "v1_runner_removed",
     "this vLLM has no V1 model runner any more, and VLLM_USE_V2_MODEL_RUNNER=0 asks for it",
     "remove VLLM_USE_V2_MODEL_RUNNER from server.env and the server's environment; under WSL2 "
     "set VLLM_WSL2_ENABLE_PIN_MEMORY=1 instead (or `ocrvl setup-server` the pinned vLLM)",
     True),
    (re.compile(r"RuntimeError: Failed to infer device type"), "no_device",
     "vLLM found no GPU it can use (no NVIDIA driver or device visible to it)",
     "check that `nvidia-smi` lists the GPU in the server's environment (CUDA_VISIBLE_DEVICES, "
     "`ocrvl doctor`); on a machine without an NVIDIA GPU run the server elsewhere and set "
     "server.mode: external", True),
    (re.compile(r"The model `[^`]*` does not exist"), "model_mismatch",
     "the server serves another model name",
     "make the server serve model.served_name, or model.name when that is unset (vLLM: "
     "--served-model-name)", True),
)


def diagnose(text: str) -> Diagnosis | None:
    """The likely cause of a failure, from the server's last log lines."""
    too_old = _DRIVER_TOO_OLD.search(text)
    if too_old is not None:
        found = driver_check.text(driver_check.from_driver_api(int(too_old.group(1))))
        return Diagnosis(
            "driver_too_old", f"the NVIDIA driver is too old for the server's PyTorch (the "
            f"driver supports CUDA {found})",
            "install a newer NVIDIA driver (`ocrvl doctor` names the one the server environment "
            "needs; on WSL2 update the Windows driver, in Windows), or install a vLLM built for "
            f"an older CUDA: `ocrvl setup-server --vllm {vllm_release.CUDA12_RELEASE}` (CUDA 12)",
            permanent=True)
    limit = estimated_max_len(text)
    if limit is not None:
        return Diagnosis("max_len", "max-model-len is too large for the free GPU memory",
                         f"set server.vllm_args.max-model-len to at most {limit} (or lower "
                         "model.max_new_tokens), or raise gpu-memory-utilization",
                         limit=limit)
    for pattern, kind, cause, fix, permanent in _RULES:
        if pattern.search(text):
            return Diagnosis(kind, cause, fix, permanent)
    return None


def _kinds(text: str) -> set[DiagnosisKind]:
    """Every kind of failure `text` shows signs of (not only the first)."""
    kinds: set[DiagnosisKind] = {"max_len"} if _MAX_LEN.search(text) else set()
    return kinds | {kind for pattern, kind, *_ in _RULES if pattern.search(text)}


def is_oom(text: str) -> bool:
    """Whether a server's output shows it failed for lack of GPU memory."""
    return bool(_kinds(text) & OOM_KINDS)


def kv_cache_too_small(text: str) -> bool:
    """Whether the output says the KV cache is what did not fit."""
    return bool(_kinds(text) & KV_CACHE_KINDS)


def oom_cause(text: str) -> str | None:
    """The output line that names the out-of-memory cause, for logs and messages."""
    for line in text.splitlines():
        if is_oom(line):
            return line.strip()[:1000]
    return None


def estimated_max_len(text: str) -> int | None:
    """The longest max-model-len vLLM says would fit in the memory it found, if it says."""
    match = _MAX_LEN.search(text)
    return int(match.group(1)) if match else None


def free_share(text: str) -> float | None:
    """The share of the GPU's memory vLLM found free at start-up (free / total), if it says."""
    match = _FREE_MEMORY.search(text)
    return float(match.group(1)) / float(match.group(2)) if match else None


# --- start-up phases -----------------------------------------------------------------------

_KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_PHASES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Starting to load model|Loading safetensors checkpoint"),
     "loading weights"),
    (re.compile(r"Model loading took|Loading weights took|Memory profiling takes"),
     "profiling memory"),
    (re.compile(r"torch\.compile|Compiling a graph"), "compiling the model"),
    (re.compile(r"Available KV cache memory"), "allocating KV cache"),
    (re.compile(r"Capturing CUDA graphs|Capturing cudagraphs"), "capturing CUDA graphs"),
    (re.compile(r"Graph capturing finished|init engine .* took|Starting vLLM API server|"
                r"Waiting for application startup"), "starting API server"),
)


def parse_phase(line: str) -> str | None:
    """The start-up phase a vLLM log line announces, if any."""
    match = _KV_TOKENS.search(line)
    if match:
        return f"allocating KV cache ({match.group(1)} tokens)"
    for pattern, phase in _PHASES:
        if pattern.search(line):
            return phase
    return None

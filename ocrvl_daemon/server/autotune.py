"""`auto` vLLM settings from the GPU's memory, and stepping them down after an out-of-memory start.

Pure functions apart from the small JSON file that remembers what an out-of-memory recovery
settled on. The memory model is `gpu_memory`'s.

vLLM refuses to start when free memory < utilization × total, so utilization is planned from
what other programs leave free, minus a safety margin, minus what each server holds beyond
its budget, minus the layout model's room when it runs on the same GPU
(`placement.layout_room_mib`).
vLLM's failure text is read by `vllm_diagnosis`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ocrvl_daemon.config.model import AUTO, Config
from ocrvl_daemon.config.models import IMAGE_TOKEN_BUDGET, PROMPT_TOKEN_BUDGET
from ocrvl_daemon.files.atomic import write_atomic
from ocrvl_daemon.server import vllm_diagnosis
from ocrvl_daemon.server.gpu import GpuReading
from ocrvl_daemon.server.gpu_memory import (
    KV_BYTES_PER_TOKEN,
    LENGTH_STEP,
    MAX_MODEL_LEN,
    MIN_UTILIZATION_BESIDE_LAYOUT,
    PLANNED_BATCHED_TOKENS,
    STARTUP_SPIKE_MIB,
    UTILIZATION,
    VLLM_BEYOND_BUDGET_MIB,
    WEIGHTS_MIB,
    available_mib,
    floor2,
    kept_mib,
    margin_mib,
    model_budget,
    replicas_of,
    round_up,
)
from ocrvl_daemon.server.layout_engine import Installed
from ocrvl_daemon.server.placement import layout_room_mib

log = logging.getLogger(__name__)

MAX_NUM_SEQS = "max-num-seqs"
BATCHED_TOKENS = "max-num-batched-tokens"
# What ocrvl may choose and lower. max-num-batched-tokens is not an `auto` config key: it is
# ocrvl's to set whenever the config does not mention it.
TUNED_KEYS = (UTILIZATION, MAX_MODEL_LEN, MAX_NUM_SEQS, BATCHED_TOKENS)

# A typical page request: a full-size image, the prompt and ~1000 generated tokens.
TYPICAL_OUTPUT_TOKENS = 1000
TYPICAL_SEQUENCE_TOKENS = IMAGE_TOKEN_BUDGET + PROMPT_TOKEN_BUDGET + TYPICAL_OUTPUT_TOKENS
MIN_UTILIZATION, MAX_UTILIZATION = 0.5, 0.95
MIN_NUM_SEQS, MAX_NUM_SEQS_CAP, NUM_SEQS_STEP = 8, 256, 8
UTILIZATION_STEP = 0.05
FREE_MEMORY_HEADROOM = 0.02  # below the free share vLLM reported, for the next attempt
# Without a GPU reading: values that start on an 8 GB card with a desktop running.
FALLBACK_UTILIZATION, FALLBACK_NUM_SEQS = 0.64, 32
TUNING_FILE = "server-tuning.json"


@dataclass(frozen=True)
class ReplicaRule:
    """`server.replicas: auto` for cards from `from_mib` of memory: servers per GPU without
    MPS (`plain`) and with it (`mps`)."""

    from_mib: int
    plain: int
    mps: int


# `server.replicas: auto`, by card size (the largest `from_mib` a card reaches wins). On a
# large card one server leaves the GPU partly idle (its per-request CPU work is the limit),
# so a second server helps; without MPS a third hardly does (the processes take turns on
# the card), under MPS their kernels run side by side and up to four keep a 141 GiB card
# busy. On 8-24 GB cards the GPU itself is the limit and a replica adds nothing. So: two
# from a card with room for two servers with a large KV cache each (40 GiB: A100 40 GB,
# L40S, A6000), four under MPS from 100 GiB (H200 and larger; measured on the H200 only),
# else one. Figures: bench/gpu/RESULTS.md; bench/gpu/big_gpu.py prints the row its
# figures make for the card it ran on.
REPLICA_RULES = (ReplicaRule(0, 1, 1), ReplicaRule(40 * 1024, 2, 2), ReplicaRule(100 * 1024, 2, 4))


@dataclass
class TunedArgs:
    """vLLM flags to launch with (every configured flag, `auto` ones resolved) and why."""

    values: dict[str, Any]
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # the server will probably not start



def auto_replicas(total_mib: int | None, mps: bool = False) -> int:
    """`server.replicas: auto` for a card with `total_mib` of memory (None: no reading: one),
    `mps` where ocrvl can run MPS for them (REPLICA_RULES)."""
    if total_mib is None:
        return 1
    rule = max((r for r in REPLICA_RULES if total_mib >= r.from_mib), key=lambda r: r.from_mib)
    return rule.mps if mps else rule.plain



def replicas_fit_problem(config: Config, gpu: GpuReading, replicas: int) -> str | None:
    """Why `replicas` servers cannot share `gpu`, with the numbers; None when they fit.

    Each gets its share of gpu-memory-utilization x the card, which must hold the weights,
    the start-up spike and the KV cache of one max-model-len request. The card counts as
    empty: what other programs (or ocrvl's servers being replaced) hold now may be gone by
    the start, and a start that runs short of memory steps its settings down.
    """
    shared = config.model_copy(update={"server": config.server.model_copy(
        update={"replicas": replicas})})
    empty = replace(gpu, used_mib=0, free_mib=gpu.total_mib)
    values = plan_vllm_args(shared, empty).values
    share_mib = float(values[UTILIZATION]) * gpu.total_mib
    tokens = int(values[MAX_MODEL_LEN])
    kv_mib = tokens * KV_BYTES_PER_TOKEN / (1024 * 1024)
    need_mib = WEIGHTS_MIB + STARTUP_SPIKE_MIB + kv_mib
    if share_mib >= need_mib:
        return None
    return (f"server.replicas = {replicas} does not fit {gpu.name} ({_gib(gpu.total_mib)}): "
            f"each replica would get {_gib(share_mib)}, one needs at least {_gib(need_mib)} "
            f"({WEIGHTS_MIB / 1024:.1f} weights + {STARTUP_SPIKE_MIB / 1024:.1f} start-up + "
            f"{kv_mib / 1024:.1f} KV for {tokens} tokens)")


def tunable_keys(config: Config) -> tuple[str, ...]:
    """The flags ocrvl may choose: `auto` in the config, or (batched tokens) not set at all."""
    args = config.server.vllm_args
    return tuple(k for k in TUNED_KEYS if args.get(k, AUTO) == AUTO)





def plan_vllm_args(config: Config, gpu: GpuReading | None,
                   remembered: dict[str, Any] | None = None,
                   installed: Installed | None = None) -> TunedArgs:
    """Resolve the `auto` flags for `gpu`; explicit numbers are kept as they are.

    `installed`: the layout engines (None: from package metadata), which decide whether the
    layout model shares `gpu`.
    """
    tunable = tunable_keys(config)
    budget = model_budget(config)
    tuned = TunedArgs(values=dict(config.server.vllm_args))
    values, reasons = tuned.values, tuned.reasons
    for key in TUNED_KEYS:
        if key not in tunable and values.get(key) is not None:
            reasons.append(f"{key} {values[key]}: set in the config")
    if MAX_MODEL_LEN in tunable:
        values[MAX_MODEL_LEN] = round_up(budget, LENGTH_STEP)
        reasons.append(
            f"{MAX_MODEL_LEN} {values[MAX_MODEL_LEN]}: a page request can need {budget} tokens "
            f"({config.model.effective_max_new_tokens} new + image and prompt), rounded up "
            f"to {LENGTH_STEP}")
    if BATCHED_TOKENS in tunable:
        values[BATCHED_TOKENS] = PLANNED_BATCHED_TOKENS
        reasons.append(f"{BATCHED_TOKENS} {PLANNED_BATCHED_TOKENS}: several page images "
                       "per step; the start-up memory estimate assumes it")
    if gpu is None:
        _plan_without_gpu(tuned, tunable)
        _share(tuned, replicas_of(config))
    else:
        _plan_for_gpu(tuned, tunable, gpu, replicas_of(config),
                      layout_room_mib(config, gpu, installed))
    if remembered:
        _apply_remembered(tuned, tunable, remembered, budget)
    return tuned


def _plan_without_gpu(tuned: TunedArgs, tunable: tuple[str, ...]) -> None:
    if UTILIZATION in tunable:
        tuned.values[UTILIZATION] = FALLBACK_UTILIZATION
    if MAX_NUM_SEQS in tunable:
        tuned.values[MAX_NUM_SEQS] = FALLBACK_NUM_SEQS
    if {UTILIZATION, MAX_NUM_SEQS} & set(tunable):
        tuned.reasons.append(
            f"no GPU was found (NVML and nvidia-smi gave nothing): safe fixed values "
            f"{UTILIZATION} {tuned.values[UTILIZATION]}, {MAX_NUM_SEQS} "
            f"{tuned.values[MAX_NUM_SEQS]}")


def _plan_for_gpu(tuned: TunedArgs, tunable: tuple[str, ...], gpu: GpuReading,
                  replicas: int, layout_mib: float) -> None:
    """Plan for `gpu` as if none of ocrvl's servers ran; with `replicas`, utilization is for
    the whole card and each server gets an equal share of it; `layout_mib` is kept for the
    layout model."""
    values, reasons, warnings = tuned.values, tuned.reasons, tuned.warnings
    total = gpu.total_mib
    free_share = floor2(gpu.free_mib / total)
    if UTILIZATION in tunable:
        margin = margin_mib(gpu)
        available = available_mib(gpu)
        share = floor2((available - kept_mib(gpu, replicas) - layout_mib) / total)
        floor = MIN_UTILIZATION_BESIDE_LAYOUT if layout_mib else MIN_UTILIZATION
        values[UTILIZATION] = min(MAX_UTILIZATION, max(floor, share))
        if layout_mib and share < floor:
            warnings.append(
                f"other programs leave too little of {gpu.name} for the server and the "
                f"layout model ({_gib(layout_mib)}) together: the layout model may run out of "
                "memory; close programs using the GPU (see nvidia-smi) or set "
                "pipeline.layout_device: cpu")
        layout = f", {_gib(layout_mib)} for the layout model" if layout_mib else ""
        reasons.append(
            f"{UTILIZATION} {values[UTILIZATION]:.2f}: {gpu.name} has {_gib(total)}, "
            f"{_gib(total - available)} in use by other programs, {_gib(margin)} kept "
            f"free, {_gib(replicas * VLLM_BEYOND_BUDGET_MIB)} for vLLM's own memory "
            f"beyond it{layout}")
    utilization = float(values[UTILIZATION])
    if utilization > free_share:
        warnings.append(
            f"{UTILIZATION} {utilization:.2f} is more than the free share of {gpu.name} "
            f"({_gib(gpu.free_mib)} of {_gib(total)} = {free_share:.2f}): vLLM will refuse to "
            "start; close the programs using the GPU (see nvidia-smi)")
    _share(tuned, replicas)
    utilization = float(values[UTILIZATION])
    kv_mib = utilization * total - WEIGHTS_MIB - STARTUP_SPIKE_MIB
    kv_tokens = max(0, int(kv_mib * 1024 * 1024 // KV_BYTES_PER_TOKEN))
    if kv_tokens < int(values[MAX_MODEL_LEN]):
        warnings.append(
            f"the KV cache (~{_gib(kv_mib)}, {kv_tokens} tokens) cannot hold one request of "
            f"{values[MAX_MODEL_LEN]} tokens: vLLM will refuse to start; free GPU memory or "
            "lower model.max_new_tokens")
    if MAX_NUM_SEQS in tunable:
        fits = kv_tokens // TYPICAL_SEQUENCE_TOKENS // NUM_SEQS_STEP * NUM_SEQS_STEP
        values[MAX_NUM_SEQS] = min(MAX_NUM_SEQS_CAP, max(MIN_NUM_SEQS, fits))
        reasons.append(
            f"{MAX_NUM_SEQS} {values[MAX_NUM_SEQS]}: ~{_gib(max(kv_mib, 0))} KV cache holds "
            f"~{kv_tokens} tokens, ~{kv_tokens // TYPICAL_SEQUENCE_TOKENS} pages of "
            f"~{TYPICAL_SEQUENCE_TOKENS} tokens at once")


def _share(tuned: TunedArgs, replicas: int) -> None:
    """Split the card's utilization equally between the `replicas` servers on it."""
    # vLLM checks free >= utilization x total per server: with each server at its share, one
    # that restarts passes the check while the others keep theirs.
    if replicas > 1 and tuned.values.get(UTILIZATION) is not None:
        share = tuned.values[UTILIZATION] = floor2(float(tuned.values[UTILIZATION]) / replicas)
        tuned.reasons.append(f"{UTILIZATION} {share:.2f} each: the card's share split between "
                             f"{replicas} servers (server.replicas)")


def _apply_remembered(tuned: TunedArgs, tunable: tuple[str, ...], remembered: dict[str, Any],
                      budget: int) -> None:
    # An earlier start ran out of memory above these values. If memory is tighter now than
    # then, the fresh plan is lower still, so the lower of the two stands.
    for key in tunable:
        old = remembered.get(key)
        if not isinstance(old, (int, float)) or isinstance(old, bool) or old <= 0:
            continue
        if key in (MAX_MODEL_LEN, BATCHED_TOKENS):
            old = max(int(old), budget)
        if old < tuned.values[key]:
            tuned.values[key] = old
            tuned.reasons.append(f"{key} {old}: lowered after an out-of-memory failure "
                                 f"(kept in {TUNING_FILE} once the server starts with it)")


def next_after_oom(current: dict[str, Any], config: Config, failure_text: str
                   ) -> dict[str, Any] | None:
    """The next, smaller `auto` flags to try after an out-of-memory start; None when spent."""
    return _lower(current, tunable_keys(config), model_budget(config), failure_text,
                  MIN_UTILIZATION / replicas_of(config))


def suggestion(current: dict[str, Any], config: Config, failure_text: str) -> str:
    """What the user should change when the flags that would help are explicit numbers."""
    tunable = tunable_keys(config)
    # `null` (leave it to vLLM) is not a number to lower.
    explicit = [k for k in TUNED_KEYS
                if k not in tunable and config.server.vllm_args.get(k) is not None]
    cause = vllm_diagnosis.oom_cause(failure_text) or "out of GPU memory"
    replicas = replicas_of(config)
    lowered = _lower(current, explicit, model_budget(config), failure_text,
                     MIN_UTILIZATION / replicas)
    head = f"The model server ran out of GPU memory ({cause})."
    if lowered is None:
        return (f"{head} Nothing ocrvl may change is left to lower: close other programs "
                "using the GPU (see nvidia-smi), lower model.max_new_tokens, or use a GPU "
                "with more memory.")
    changed = [k for k in explicit if lowered[k] != current.get(k)]
    them = "them" if len(changed) > 1 else "it"
    # The config's utilization is for the whole card: each of the replicas has its share.
    lines = ", ".join(f"`{k}: {floor2(lowered[k] * replicas) if k == UTILIZATION else lowered[k]}`"
                      for k in changed)
    return (f"{head} The config sets {', '.join(changed)} explicitly, so ocrvl leaves {them} "
            f"alone; try these lines under `server: vllm_args:` in config.yaml: {lines} (or "
            f"`auto`, to let ocrvl choose).")


def _lower(current: dict[str, Any], lowerable: list[str] | tuple[str, ...], budget: int,
           text: str, floor_utilization: float) -> dict[str, Any] | None:
    new = dict(current)
    utilization = float(_get(current, UTILIZATION, FALLBACK_UTILIZATION))
    free = vllm_diagnosis.free_share(text)
    if free is not None:
        # Only a lower utilization passes vLLM's free-memory check at start-up.
        if UTILIZATION not in lowerable or utilization <= floor_utilization:
            return None
        target = floor2(free - FREE_MEMORY_HEADROOM)
        if target >= utilization:
            target = floor2(utilization - UTILIZATION_STEP)
        new[UTILIZATION] = max(floor_utilization, target)
        return new
    length = int(_get(current, MAX_MODEL_LEN, round_up(budget, LENGTH_STEP)))
    estimated = vllm_diagnosis.estimated_max_len(text)
    if estimated is not None and MAX_MODEL_LEN in lowerable and estimated >= budget:
        fits = max(budget, estimated // LENGTH_STEP * LENGTH_STEP)
        if fits < length:
            new[MAX_MODEL_LEN] = fits
            return new
    changed = False
    seqs = int(_get(current, MAX_NUM_SEQS, FALLBACK_NUM_SEQS))
    if MAX_NUM_SEQS in lowerable and seqs > MIN_NUM_SEQS:
        new[MAX_NUM_SEQS] = max(MIN_NUM_SEQS, seqs // 2)
        changed = True
    batched = int(_get(current, BATCHED_TOKENS, PLANNED_BATCHED_TOKENS))
    # vLLM must fit a whole image (and, to be safe, a whole request) in one step.
    floor = max(budget, length)
    if BATCHED_TOKENS in lowerable and batched > floor:
        new[BATCHED_TOKENS] = max(floor, batched // 2)
        changed = True
    if changed:
        return new
    if MAX_MODEL_LEN in lowerable and length > budget:
        new[MAX_MODEL_LEN] = budget
        return new
    # When the KV cache is what is too small, a smaller share of the GPU only shrinks it.
    if (UTILIZATION in lowerable and utilization > floor_utilization
            and not vllm_diagnosis.kv_cache_too_small(text)):
        new[UTILIZATION] = max(floor_utilization, floor2(utilization - UTILIZATION_STEP))
        return new
    return None


def _get(values: dict[str, Any], key: str, default: float) -> float:
    # Missing or `null` means vLLM's own default; ocrvl's planned value stands in for it.
    value = values.get(key)
    return default if value is None else float(value)


def _remember_key(gpu: GpuReading | None, model_name: str, replicas: int) -> str:
    # Per replica count: a share lowered for three servers would starve one.
    key = f"{gpu.uuid if gpu else 'unknown-gpu'}|{model_name}"
    return key if replicas == 1 else f"{key}|{replicas} replicas"


def load_remembered(state_dir: Path, gpu: GpuReading | None, model_name: str,
                    replicas: int = 1) -> dict[str, Any] | None:
    """The flags an earlier out-of-memory recovery settled on for this GPU, model and number
    of servers sharing the GPU."""
    path = state_dir / TUNING_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        entry = data[_remember_key(gpu, model_name, replicas)]["values"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if not isinstance(exc, KeyError):
            log.warning("ignoring %s: %s", path, exc)
        return None
    return entry if isinstance(entry, dict) else None


def save_remembered(state_dir: Path, gpu: GpuReading | None, model_name: str,
                    values: dict[str, Any], replicas: int = 1) -> None:
    """Remember the flags that got past an out-of-memory start (written atomically)."""
    path = state_dir / TUNING_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data[_remember_key(gpu, model_name, replicas)] = {
        "values": {k: values[k] for k in TUNED_KEYS if k in values},
        "gpu": gpu.name if gpu else None,
        "saved": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    state_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")



def _gib(mib: float) -> str:
    return f"{mib / 1024:.1f} GiB"

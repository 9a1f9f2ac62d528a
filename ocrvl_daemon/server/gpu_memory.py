"""The memory model of a GPU that vLLM servers and layout models share (sizes in MiB).

    budget (utilization x total) = weights + start-up spike + KV cache
    each server's process = budget + VLLM_BEYOND_BUDGET_MIB
    each layout model beside it = LAYOUT_GPU_MIB

`server.autotune` plans the servers' flags with it and `server.placement` asks it whether the
layout model has room beside them (`layout_fits`): one model, so both reach the same answer.
"""

from __future__ import annotations

import math

from ocrvl_daemon.config.model import AUTO, Config
from ocrvl_daemon.server.gpu import GpuReading
from ocrvl_daemon.server.layout_engine import LAYOUT_GPU_MIB

UTILIZATION = "gpu-memory-utilization"
MAX_MODEL_LEN = "max-model-len"

# vLLM's own account of its budget for the 0.9B model (vLLM 0.26, the 8 GB emulation of
# 2026-12-06): bf16 weights (NaViT vision encoder + ERNIE-4.5-0.3B) 1.63 GiB; the activations
# profiled at max-num-batched-tokens (16384 here) 0.56 GiB, non-torch memory 0.23 and CUDA
# graphs 0.10 (the start-up spike). The rest of the budget is the KV cache.
WEIGHTS_MIB = 1.63 * 1024
STARTUP_SPIKE_MIB = 0.89 * 1024
PLANNED_BATCHED_TOKENS = 16384
# KV cache per token of ERNIE-4.5-0.3B: 2 (K and V) x 18 layers x 2 KV heads x 128 head dim
# x 2 bytes (bf16) = 18 KiB.
KV_BYTES_PER_TOKEN = 2 * 18 * 2 * 128 * 2
# The floor where the layout model shares the card: 0.4 of an 8 GB card still holds a KV
# cache of ~0.7 GiB, ~16 pages at once (a second layout worker there would leave too little).
MIN_UTILIZATION_BESIDE_LAYOUT = 0.4
# What vLLM's engine process holds beyond utilization x total: its CUDA context (~0.5 GiB;
# vLLM measures free memory after creating it) and what its allocator adds while serving
# (~0.85 GiB). Measured: 6,514 MiB at its peak against 0.63 x 8,188 = 5,158 on the 8 GB card
# emulated on an H100 (bench/gpu/small_card_layout_h100_2026-12-06b.json).
VLLM_BEYOND_BUDGET_MIB = 1360
# Kept free besides other programs' memory and the servers' own: covers their growth.
MIN_MARGIN_MIB, MARGIN_FRACTION = 512, 0.05
LENGTH_STEP = 256
# What a desktop session typically holds of the card (Xorg or Wayland, a browser): assumed
# by `layout_fits`, which cannot tell other programs' memory from ocrvl's own.
DESKTOP_MIB = 1024


def model_budget(config: Config) -> int:
    """Tokens one page request can need: max-model-len may never be below this."""
    return config.model.vl_model.request_token_budget(config.model.effective_max_new_tokens)



def replicas_of(config: Config) -> int:
    """Servers sharing each GPU (`auto` is resolved by the server set before planning)."""
    replicas = config.server.replicas
    return replicas if isinstance(replicas, int) else 1



def server_plans(config: Config, gpu: GpuReading) -> bool:
    """Whether a managed vLLM server plans its memory on `gpu` (indices as CUDA numbers them;
    the same as nvidia-smi's on the one-GPU machines ocrvl is for)."""
    server = config.server
    if server.mode != "managed" or server.launcher == "command":
        return False
    return server.gpus == AUTO or gpu.index in server.gpus


def available_mib(gpu: GpuReading) -> float:
    """What other programs leave of `gpu`."""
    # Other programs' memory as the driver counts it, or as free memory shows it, whichever
    # is worse (WSL2 can report less free than total - used).
    return min(gpu.total_mib - gpu.used_mib, gpu.free_mib)


def margin_mib(gpu: GpuReading) -> float:
    """Memory of `gpu` kept free beside everything planned."""
    return max(MIN_MARGIN_MIB, MARGIN_FRACTION * gpu.total_mib)


def kept_mib(gpu: GpuReading, replicas: int) -> float:
    """Memory of `gpu` outside the servers' budgets: the margin and what `replicas` servers
    hold beyond theirs."""
    return margin_mib(gpu) + replicas * VLLM_BEYOND_BUDGET_MIB


def layout_fits(config: Config, gpu: GpuReading, workers: int = 1) -> bool:
    """Whether `gpu` has LAYOUT_GPU_MIB for each of `workers` layout models beside what the
    server takes.

    Beside a managed server the card counts as holding DESKTOP_MIB of other programs' memory,
    whatever it holds now: ocrvl's own server and layout workers may hold some of it, and the
    server (planning at its start) and each worker (at its own start) must reach the same
    answer; what other programs really hold is taken off when the server plans (with a
    warning where the room then squeezes the server). With `auto`, the utilization left once
    the room is taken off must still reach MIN_UTILIZATION_BESIDE_LAYOUT and a KV cache for
    one request of max-model-len; with an explicit one, what it leaves must hold the room,
    the margin and each server's memory beyond its budget (VLLM_BEYOND_BUDGET_MIB). No
    server of ocrvl's here: the room and the margin must be free now.
    """
    room, replicas = workers * LAYOUT_GPU_MIB, replicas_of(config)
    if not server_plans(config, gpu):
        return available_mib(gpu) - room >= margin_mib(gpu)
    kept = kept_mib(gpu, replicas)
    utilization = config.server.vllm_args[UTILIZATION]
    if utilization != AUTO:
        return gpu.total_mib * (1 - float(utilization)) - DESKTOP_MIB - kept >= room
    card_share = floor2((gpu.total_mib - DESKTOP_MIB - kept - room) / gpu.total_mib)
    kv_mib = card_share / replicas * gpu.total_mib - WEIGHTS_MIB - STARTUP_SPIKE_MIB
    length = config.server.vllm_args[MAX_MODEL_LEN]
    tokens = round_up(model_budget(config), LENGTH_STEP) if length == AUTO else int(length)
    return (card_share >= MIN_UTILIZATION_BESIDE_LAYOUT
            and kv_mib * 1024 * 1024 >= tokens * KV_BYTES_PER_TOKEN)



def floor2(value: float) -> float:
    """`value` rounded down to hundredths."""
    # The epsilon keeps 0.81 from flooring to 0.80 through binary rounding.
    return math.floor(value * 100 + 1e-9) / 100


def round_up(value: int, step: int) -> int:
    """`value` rounded up to a multiple of `step`."""
    return -(-value // step) * step


"""Which engine, device and threads run the layout model (PP-DocLayoutV2/V3) on this machine.

`choose` is a plain function of what is installed, the GPU the layout model may use (one
whose VRAM plan leaves it room: `server.placement` decides that) and the cores,
so the worker, `ocrvl doctor` and the tests reach the same answer. Only the layout model (and
the optional page preprocessing models) follow this choice: the VL recognition goes to the
server whatever the engine, since PaddleX's VLRecognition sub-config has a server
`genai_config`, which drops the engine it would inherit.

What is installed is read from package metadata, never by importing paddle or torch
(seconds, and a CUDA context).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from ocrvl_daemon.config.layout import (
    AUTO,
    ENGINES,
    INSTALL,
    ON_CPU_ASKED,
    ON_CPU_NO_GPU,
    ON_CPU_NO_GPU_ENGINE,
    ON_CPU_NO_ROOM,
    ON_GPU_ASKED,
    ON_GPU_AUTO,
    TO_THE_GPU,
    parse_device,
)
from ocrvl_daemon.errors import DependencyError
from ocrvl_daemon.server import layout_model
from ocrvl_daemon.server.gpu import GpuReading

# PaddleX's engine for each choice: `paddle` is the static graph, faster than the dynamic one
# on the CPU (bench/RESULTS.md).
PADDLEX_ENGINE = {"paddle": "paddle_static", "onnxruntime": "onnxruntime",
                  "transformers": "transformers"}
# The folder each engine loads under official_models/ (paddlex's `_format_download_model_name`
# for the format it reads: paddle, onnx, safetensors).
MODEL_SUFFIX = {"paddle": "", "onnxruntime": "_onnx", "transformers": "_safetensors"}
# A file each engine's model folder must hold (any one of them) for PaddleX to load it.
MODEL_FILES = {"paddle": ("inference.json", "inference.pdmodel"),
               "onnxruntime": ("inference.onnx",), "transformers": ("model.safetensors",)}
# Preference among installed engines. CPU: torch eager (transformers) measured about twice as
# fast as paddle static on the stand-in at 1 and 2 threads (bench/RESULTS.md, "Layout model
# on the CPU"); ONNX Runtime could not be measured (paddle2onnx cannot convert the graph).
# GPU: PaddlePaddle's own GPU build runs the official graph; torch + transformers is what a
# PyPI-only install gets (`[gpu-layout]`); onnxruntime-gpu needs matching cuDNN.
CPU_ORDER = ("transformers", "paddle", "onnxruntime")
GPU_ORDER = ("paddle", "transformers", "onnxruntime")
# The first transformers with PP-DocLayoutV2 and V3 (the [gpu-layout] extra's floor).
MIN_TRANSFORMERS = Version("5.13")
# GPU memory the layout model takes beside the server, per worker process (each loads its
# own), in MiB: fp32 at batch 1, the process's CUDA context, 33.2 M parameters x 4 bytes
# = 127 MiB of weights and the peak of one 800x800 page's activations; 1703 measured for the
# whole process (bench/RESULTS.md, "Layout model on the GPU"), rounded up.
LAYOUT_GPU_MIB = 1792
# The layout model on the CPU runs one page at a time per worker (its calls are serialised),
# so throughput grows with workers. A quarter of the cores is kept for everything else (the
# daemon, rendering and encoding, vLLM's API process); the rest go to workers of
# CPU_THREADS_PER_WORKER threads each. A second worker gains more than a second thread
# (bench/RESULTS.md, "Layout model on the CPU"), but each worker holds PaddleX and the model
# in RAM, and where the quarter rounds to nothing (2 or 3 cores) a worker per core would leave
# no core for the rest: two threads a worker keeps one worker there.
CPU_THREADS_PER_WORKER = 2
MAX_CPU_LAYOUT_WORKERS = 8  # each worker holds PaddleX and the model (~1.5 GiB of RAM)
# Without layout on the CPU: a quarter of the cores, 1 to 4 (see `default_workers`).
MAX_WORKERS_WITHOUT_CPU_LAYOUT = 4


def _at_least(version: str | None, minimum: Version) -> bool:
    try:
        return version is not None and Version(version) >= minimum
    except InvalidVersion:
        return False


@dataclass(frozen=True)
class Installed:
    """The engines that can run here, per device (`cpu`, `gpu`)."""

    cpu: frozenset[str]
    gpu: frozenset[str]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _torch_has_cuda() -> bool:
    # PyPI's Linux torch wheels are CUDA builds that require the nvidia-* runtime packages;
    # the pytorch.org index marks its builds +cuXXX, a CPU build +cpu.
    version = _version("torch") or ""
    requires = (metadata.requires("torch") or []) if version else []
    return "+cu" in version or any(r.startswith("nvidia-") for r in requires)


def installed_engines(version: Callable[[str], str | None] = _version,
                      torch_has_cuda: Callable[[], bool] = _torch_has_cuda) -> Installed:
    """What package metadata says is installed (PaddleX's own dependency checks agree)."""
    cpu, gpu = set(), set()
    if version("paddlepaddle") or version("paddlepaddle-gpu"):
        cpu.add("paddle")
    if version("paddlepaddle-gpu"):
        gpu.add("paddle")
    if version("onnxruntime") or version("onnxruntime-gpu"):
        cpu.add("onnxruntime")
    if version("onnxruntime-gpu"):
        gpu.add("onnxruntime")
    # PaddleX's transformers engine needs torchvision for the detector's image processor, and
    # a transformers with PP-DocLayoutV2/V3 (the server environment's, lent by setup-server,
    # is whatever vLLM's resolve chose).
    if (_at_least(version("transformers"), MIN_TRANSFORMERS) and version("torch")
            and version("torchvision")):
        cpu.add("transformers")
        if torch_has_cuda():
            gpu.add("transformers")
    return Installed(frozenset(cpu), frozenset(gpu))


@dataclass(frozen=True)
class LayoutChoice:
    """The layout model's engine, device and threads, and how many workers run it."""

    model: str
    engine: str  # one of ENGINES
    device: str  # "cpu" or "gpu:N"
    threads: int | None  # CPU threads per worker; None on the GPU
    workers: int
    why: str

    @property
    def paddlex_engine(self) -> str:
        return PADDLEX_ENGINE[self.engine]

    @property
    def on_gpu(self) -> bool:
        return self.device != "cpu"

    @property
    def model_folder(self) -> str:
        """The name of the folder under official_models/ this engine loads."""
        return self.model + MODEL_SUFFIX[self.engine]

    def model_dir(self, env: Mapping[str, str] | None = None) -> Path:
        return layout_model.model_dir(self.model_folder, env)

    def has_model_files(self, env: Mapping[str, str] | None = None) -> bool:
        """Whether the model folder holds what this engine loads."""
        folder = self.model_dir(env)
        return any((folder / name).is_file() for name in MODEL_FILES[self.engine])

    def common_args(self) -> dict[str, Any]:
        """The arguments of paddleocr's models and pipelines (`engine`, `device`, threads)
        that run the layout model this way."""
        args: dict[str, Any] = {"engine": self.paddlex_engine, "device": self.device}
        if self.threads is not None and self.engine != "transformers":
            args["cpu_threads"] = self.threads  # paddle_static's engine config is built from it
            if self.engine == "onnxruntime":
                args["engine_config"] = {"intra_op_num_threads": self.threads}
        return args

    @property
    def to_the_gpu(self) -> str:
        """What would put it on the GPU, when it runs on the CPU although the GPU could take
        it and the configuration does not ask for the CPU ("" otherwise)."""
        return "" if self.why == ON_CPU_ASKED else TO_THE_GPU.get(self.why, "")

    def describe(self) -> str:
        """E.g. "PP-DocLayoutV3 on cpu (paddle_static, 2 threads)"."""
        how = self.paddlex_engine
        if self.threads is not None:
            how += f", {self.threads} thread{'s' if self.threads != 1 else ''}"
        return f"{self.model} on {self.device} ({how})"


def default_workers(cores: int) -> int:
    """Workers when the layout model is not on the CPU: a quarter of the cores, 1 to 4 (the
    daemon, the server's own preprocessing and the system need the rest; beyond 4 the server,
    not the client, is the limit)."""
    return max(1, min(MAX_WORKERS_WITHOUT_CPU_LAYOUT, cores // 4))


def cpu_layout_plan(cores: int, workers: int | None) -> tuple[int, int]:
    """(workers, threads per worker) with the layout model on the CPU; `workers` None: auto.

    Three quarters of the cores (at least one) run layout; auto gives a worker per
    CPU_THREADS_PER_WORKER of them (1 to MAX_CPU_LAYOUT_WORKERS, never fewer than
    `default_workers`), and the cores are shared out between the workers.
    """
    layout_cores = max(1, cores - cores // 4)
    if workers is None:
        workers = min(MAX_CPU_LAYOUT_WORKERS, layout_cores // CPU_THREADS_PER_WORKER)
        workers = max(default_workers(cores), workers, 1)
    return workers, max(1, layout_cores // workers)


def choose(*, model: str, engine: str, device: str, installed: Installed,
           gpu: GpuReading | None, gpu_room: Callable[[GpuReading, int], bool], cores: int,
           workers: int | None) -> LayoutChoice:
    """The layout model's engine, device, threads and workers.

    `engine`/`device` are the config's values (`auto` or a choice); `gpu` the GPU that
    `device` names (auto: CUDA's first), None where it is not visible; `gpu_room(gpu, n)`
    whether that GPU's memory plan leaves room for `n` worker processes' layout models;
    `workers` the config's number, or None for auto. Raises DependencyError when an explicit
    choice cannot run here.
    """
    kind, index = parse_device(device)
    if engine != AUTO and engine not in ENGINES:
        raise ValueError(f"unknown layout engine {engine!r}")
    where = f"gpu:{index or 0}"
    if kind == "gpu":
        if gpu is None:
            raise DependencyError(
                f"pipeline.layout_device = {device!r}: no such GPU is visible here",
                "set pipeline.layout_device: auto or cpu, or make that GPU visible (driver, "
                "CUDA_VISIBLE_DEVICES)")
        return _on_gpu(model, engine, installed, gpu, gpu_room, where, cores, workers,
                       ON_GPU_ASKED)
    if kind == AUTO and gpu is not None:
        usable = _usable(GPU_ORDER, installed.gpu, engine)
        if usable and gpu_room(gpu, 1):
            return _on_gpu(model, usable[0], installed, gpu, gpu_room, where, cores, workers,
                           ON_GPU_AUTO)
        why = ON_CPU_NO_ROOM if usable else ON_CPU_NO_GPU_ENGINE
    else:
        why = ON_CPU_NO_GPU if kind == AUTO else ON_CPU_ASKED
    return _on_cpu(model, engine, installed, cores, workers, why)


def _usable(order: tuple[str, ...], installed: frozenset[str], engine: str) -> list[str]:
    """The installed engines `engine` (auto: any) allows, fastest first."""
    return [e for e in order if e in installed and engine in (AUTO, e)]


def _on_gpu(model: str, engine: str, installed: Installed, gpu: GpuReading,
            gpu_room: Callable[[GpuReading, int], bool], where: str, cores: int,
            workers: int | None, why: str) -> LayoutChoice:
    usable = _usable(GPU_ORDER, installed.gpu, engine)
    if not usable:
        wanted = "an engine that can use the GPU" if engine == AUTO else f"{engine} for the GPU"
        raise DependencyError(
            f"pipeline.layout_device = {where!r}: {wanted} is not installed",
            f"{INSTALL['transformers']}, or paddlepaddle-gpu from PaddlePaddle's index; or "
            "set pipeline.layout_device: cpu")
    if workers is None:
        # Each worker loads its own copy (and CUDA context): as many as the card has room
        # for, and one does the layout of many pages a second there.
        workers = default_workers(cores)
        while workers > 1 and not gpu_room(gpu, workers):
            workers -= 1
    return LayoutChoice(model, usable[0], where, None, workers, why)


def _on_cpu(model: str, engine: str, installed: Installed, cores: int, workers: int | None,
            why: str) -> LayoutChoice:
    usable = _usable(CPU_ORDER, installed.cpu, engine)
    if not usable:
        wanted = "no layout engine is" if engine == AUTO else f"{engine} is not"
        raise DependencyError(
            f"pipeline.layout_engine = {engine!r}: {wanted} installed for the CPU",
            f"{INSTALL['paddle' if engine == AUTO else engine]}, or set "
            "pipeline.use_layout_detection: false to send pages whole")
    count, threads = cpu_layout_plan(cores, workers)
    return LayoutChoice(model, usable[0], "cpu", threads, count, why)


def cpu_count() -> int:
    """The cores this process may run on (a cgroup or taskset limit counts)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1

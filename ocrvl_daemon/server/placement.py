"""Where the layout model runs, on which engine, and how many engine workers there are:
decided once per configuration, here, from the configuration, the GPUs, the installed engines
and the cores.

The daemon decides it when it starts its engine pool (`decide_placement`) and sends the workers
the outcome as plain values (`engine.worker_settings`); the managed server's memory plan asks
the same rule for the layout model's room on its GPU (`layout_room_mib`), and the room rule
is the memory model's (`gpu_memory.layout_fits`), so the two cannot disagree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ocrvl_daemon.config.layout import parse_device
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.errors import DependencyError
from ocrvl_daemon.server import gpu as gpus
from ocrvl_daemon.server import layout_engine
from ocrvl_daemon.server.gpu import GpuReading
from ocrvl_daemon.server.gpu_memory import layout_fits
from ocrvl_daemon.server.layout_engine import LAYOUT_GPU_MIB, Installed, LayoutChoice

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """Where the engine workers run the layout model and how many of them there are.

    `layout` is None with layout detection off, or where it cannot run here (`problem` says
    why, with the fix: every worker fails to start with it).
    """

    workers: int
    layout: LayoutChoice | None = None
    problem: DependencyError | None = None

    @property
    def device(self) -> str:
        """Where the layout model runs ("cpu", "gpu:0"; "": nowhere)."""
        return self.layout.device if self.layout is not None else ""

    @property
    def why(self) -> str:
        """Why it runs there ("": it does not run)."""
        return self.layout.why if self.layout is not None else ""


def decide_placement(config: Config, visible: list[GpuReading] | None = None,
                     installed: Installed | None = None, cores: int | None = None
                     ) -> Placement:
    """The placement for `config` on this machine: `visible` the GPUs CUDA sees (None: read
    them), `installed` the engines (None: from package metadata), `cores` the usable cores
    (None: this process's).

    Workers: `pipeline.workers`, or for `auto` as the layout model's place decides
    (`layout_engine.choose`). Layout on the CPU: a worker runs its layout model one page at a
    time, so workers are added (up to 8) until each has 2 of three quarters of the cores.
    Otherwise a quarter of the cores, 1 to 4 (on the GPU, no more than its memory has room
    for): each worker's pages take a core between them (rendering, encoding) and the daemon,
    the server's own preprocessing and the system need the rest; beyond 4 the server, not the
    client, is the limit.
    """
    cores = cores or layout_engine.cpu_count()
    fixed = config.pipeline.workers if isinstance(config.pipeline.workers, int) else None
    fallback = fixed or layout_engine.default_workers(cores)
    if not config.pipeline.use_layout_detection:
        return Placement(fallback)
    try:
        choice = layout_choice(config, visible, installed, cores)
    except DependencyError as exc:  # every worker fails to start with it, with the fix
        return Placement(fallback, problem=exc)
    log.info("layout: %s: %s", choice.describe(), choice.why)
    if choice.to_the_gpu:
        log.warning("the layout model runs on the CPU (%s), the slow stage of every page: %s",
                    choice.why, choice.to_the_gpu)
    return Placement(choice.workers, choice)


def layout_choice(config: Config, visible: list[GpuReading] | None = None,
                  installed: Installed | None = None, cores: int | None = None
                  ) -> LayoutChoice:
    """Where the layout model runs with `config` on this machine (`layout_engine.choose`;
    arguments as `decide_placement`'s); raises DependencyError where it cannot run."""
    visible = gpus.read_gpus() if visible is None else visible
    _, index = parse_device(config.pipeline.wanted_layout_device)
    gpu = visible[index or 0] if (index or 0) < len(visible) else None
    return _choose(config, gpu, installed, cores)


def layout_room_mib(config: Config, gpu: GpuReading, installed: Installed | None = None
                    ) -> float:
    """The memory of `gpu` kept for the layout models: LAYOUT_GPU_MIB per worker where they
    run there (asked for with pipeline.layout_device: gpu, or chosen by auto), else 0."""
    if not config.pipeline.use_layout_detection:
        return 0
    _, index = parse_device(config.pipeline.wanted_layout_device)
    if gpu.index != (index or 0):
        return 0
    try:
        choice = _choose(config, gpu, installed)
    except DependencyError:  # the worker reports it; nothing of this GPU is its
        return 0
    return choice.workers * LAYOUT_GPU_MIB if choice.on_gpu else 0



def _choose(config: Config, gpu: GpuReading | None, installed: Installed | None,
            cores: int | None = None) -> LayoutChoice:
    """`layout_choice` with `gpu` the GPU the layout's device names."""
    p = config.pipeline
    return layout_engine.choose(
        model=config.model.vl_model.layout_model, engine=p.layout_engine,
        device=p.wanted_layout_device,
        installed=layout_engine.installed_engines() if installed is None else installed,
        gpu=gpu, gpu_room=lambda card, workers: layout_fits(config, card, workers),
        cores=cores or layout_engine.cpu_count(),
        workers=p.workers if isinstance(p.workers, int) else None)

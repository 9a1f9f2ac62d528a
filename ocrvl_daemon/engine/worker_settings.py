"""What the daemon tells an engine worker to build its pipeline with (`WorkerSetup`), made from
the configuration as the daemon validated and expanded it and the placement it decided.

A worker gets plain values only: it never reads, validates or expands the configuration
again (an API key holding a `$` is the key, not a variable to expand a second time), and
never decides where its layout model runs.
"""

from __future__ import annotations

from typing import Any

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.messages import WorkerSetup
from ocrvl_daemon.server.placement import Placement, decide_placement
from ocrvl_daemon.server.probe import bearer_header


def worker_setup(config: Config, placement: Placement) -> WorkerSetup:
    """The setup of every worker of `config` placed as `placement`."""
    p, layout = config.pipeline, placement.layout
    kwargs = pipeline_kwargs(config, config.server.base_url, placement)
    return WorkerSetup(
        pipeline=kwargs,
        served_model=config.model.served,
        headers=bearer_header(config.server.api_key),
        max_concurrency=p.max_concurrency,
        stop_loops_early=p.stop_loops_early,
        render_scale=p.render_scale,
        page_pixel_limit=p.page_pixel_limit,
        request_overhead_tokens=config.model.vl_model.request_token_budget(0),
        # The layout model on the CPU runs beside the worker, in a process of its own, so that
        # the GIL the page threads hold does not slow it (`worker.layout_process`).
        layout_process=layout is not None and not layout.on_gpu,
        torch_threads=layout.threads if layout is not None and layout.engine == "transformers"
        else None,
        failure="" if placement.problem is None else
        f"{type(placement.problem).__name__}: {placement.problem}",
    )


def pipeline_kwargs(config: Config, server_url: str, placement: Placement | None = None
                    ) -> dict[str, Any]:
    """Constructor arguments of `PaddleOCRVL` for this configuration and placement (None:
    decided now, as for a pipeline of one's own: the benchmarks'); the worker sends each
    page's requests to its own endpoint (`PageTask.url`), `server_url` is the one the
    pipeline is built with."""
    p = config.pipeline
    placement = decide_placement(config) if placement is None else placement
    kwargs: dict[str, Any] = {
        "pipeline_version": config.model.vl_model.pipeline_version,
        "vl_rec_backend": "vllm-server",
        "vl_rec_server_url": server_url,
        # The request's `model` must be exactly what the server serves.
        "vl_rec_api_model_name": config.model.served,
        "vl_rec_max_concurrency": p.max_concurrency,
        "use_layout_detection": p.use_layout_detection,
        "use_doc_orientation_classify": p.use_doc_orientation_classify,
        "use_doc_unwarping": p.use_doc_unwarping,
        "use_chart_recognition": p.use_chart_recognition,
        # Each page gets its own thread here already; without PaddleX's per-call queue threads
        # the chat requests are made on the page's thread, which lets the worker attribute
        # finish reasons to the page (and saves their 0.5 s batching wait).
        "use_queues": False,
    }
    if config.server.api_key:
        kwargs["vl_rec_api_key"] = config.server.api_key
    if p.use_layout_detection:
        # Every local model follows it; the VL recognition goes to the server whatever the
        # engine (PaddleX drops the engine for a sub-model with a server backend).
        return kwargs | (placement.layout.common_args() if placement.layout else {})
    # The page is the one block, which merging leaves as it is, after copying the whole page
    # image twice to measure it (~6.5 ms of CPU a page).
    kwargs["merge_layout_blocks"] = False
    if p.use_doc_orientation_classify or p.use_doc_unwarping:
        if p.wanted_layout_device != "auto":
            kwargs["device"] = p.wanted_layout_device
    else:
        # Nothing runs here but requests to the server: naming a device spares paddlex its
        # probe for one (without PaddlePaddle: importing torch and starting CUDA, ~4 s).
        kwargs["device"] = "cpu"
    return kwargs

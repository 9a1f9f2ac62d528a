"""The layout model's keys (`pipeline.layout_engine`, `pipeline.layout_device`): the values
they may take, and the advice given about where the model ended up (`ocrvl status`, `doctor`).

The choice itself is `server.layout_engine.choose`, made once per configuration by
`server.placement`; this module is what the configuration and the status pages share with it.
"""

from __future__ import annotations

AUTO = "auto"
ENGINES = ("paddle", "onnxruntime", "transformers")
# How to install each engine (README, "Layout detection: which engine").
INSTALL = {"paddle": "pip install 'ocrvl-daemon[cpu]' (PaddlePaddle's CPU build)",
           "onnxruntime": "pip install onnxruntime",
           "transformers": "`ocrvl setup-server` (it lends ocrvl the server environment's "
                           "torch, transformers and torchvision), or pip install "
                           "'ocrvl-daemon[gpu-layout]' (a copy of its own)"}
# Why the layout model runs where it does (`LayoutChoice.why`; `ocrvl status` and `doctor`
# advise from these).
ON_GPU_ASKED = ON_CPU_ASKED = "pipeline.layout_device asks for it"
ON_GPU_AUTO = "auto: the fastest place here, with room beside the server"
ON_CPU_NO_GPU = "auto: no GPU here"
ON_CPU_NO_ROOM = "auto: the GPU's memory plan leaves it no room"
ON_CPU_NO_GPU_ENGINE = "auto: no engine that can use the GPU is installed"
# What would put the layout model on the GPU, by why it runs on the CPU ("": nothing would).
TO_THE_GPU = {
    ON_CPU_ASKED: "set pipeline.layout_device: gpu (or auto) to put it on the GPU",
    ON_CPU_NO_GPU_ENGINE: "no engine that can use the GPU is installed; with "
                          f"{INSTALL['transformers']} it moves there by itself",
    ON_CPU_NO_ROOM: "the GPU's memory plan leaves it no room beside the server; a lower "
                    "server.vllm_args.gpu-memory-utilization leaves it some",
    ON_CPU_NO_GPU: "",
}


def parse_device(value: str) -> tuple[str, int | None]:
    """("auto" | "cpu" | "gpu", index or None) of a layout_device value; ValueError says what
    it must be."""
    text = value.strip().lower()
    if text in (AUTO, "cpu", "gpu"):
        return text, None
    kind, _, index = text.partition(":")
    if kind == "gpu" and index.isdigit():
        return "gpu", int(index)
    raise ValueError("must be auto, cpu, gpu or gpu:N (N a CUDA device number, e.g. gpu:0)")

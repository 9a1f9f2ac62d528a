"""The PaddleOCR-VL models ocrvl knows, and the token budget of one page request."""

from __future__ import annotations

import math
from dataclasses import dataclass

# What PaddleX sends as `mm_processor_kwargs.max_pixels` (and `min_pixels`) by default; the
# model's vision encoder turns every 28x28 patch into one token.
MAX_IMAGE_PIXELS = 1_003_520
MIN_IMAGE_PIXELS = 112_896
# PaddleX sends those bounds with every request (they differ by block kind), and vLLM 0.31.0
# and newer refuse them with HTTP 400 unless the server was started with this flag (vLLM PR
# #58830, a security fix: a request could reach the processor loader with them).
TRUST_MM_KWARGS = "trust-request-mm-kwargs"
TRUST_MM_KWARGS_SINCE = "0.31.0"


def trust_mm_kwargs_fix(refusal: str, external: bool) -> str | None:
    """What to do about a server whose `refusal` (its words) is of PaddleX's image-size
    bounds; None for any other refusal."""
    if f"--{TRUST_MM_KWARGS}" not in refusal:  # vLLM's words name the flag
        return None
    if external:
        return (f"start the server (`vllm serve`) with --{TRUST_MM_KWARGS}: vLLM "
                f"{TRUST_MM_KWARGS_SINCE} and newer refuse the image sizes PaddleOCR-VL's "
                "requests carry without it")
    return (f"set server.vllm_args: {{{TRUST_MM_KWARGS}: true}}; ocrvl adds it by itself where "
            f"it reads a vLLM >= {TRUST_MM_KWARGS_SINCE} in the server environment "
            "(`ocrvl doctor` shows which version it reads)")
PATCH_SIZE = 28
IMAGE_TOKEN_BUDGET = math.ceil(MAX_IMAGE_PIXELS / PATCH_SIZE**2)
# The model's image processor in vLLM (`smart_resize`) refuses an image whose long side is
# more than this many times its short side (HTTP 400).
MAX_IMAGE_ASPECT = 200
# Chat template, the task prompt ("OCR:", "Table Recognition:", ...) and special tokens.
PROMPT_TOKEN_BUDGET = 64
# PaddleX's pipeline asks for this many new tokens when none are configured.
DEFAULT_MAX_NEW_TOKENS = 4096


@dataclass(frozen=True)
class VLModel:
    """A PaddleOCR-VL model the pipeline can request from the server."""

    name: str
    pipeline_version: str
    hf_repo: str  # what `vllm serve` downloads unless `model.weights` says otherwise
    min_vllm: str
    layout_model: str  # what the pipeline detects layout blocks with (a PaddleX model)

    def request_token_budget(self, max_new_tokens: int) -> int:
        """The context length one page request can need (vLLM's `max-model-len` floor)."""
        return max_new_tokens + IMAGE_TOKEN_BUDGET + PROMPT_TOKEN_BUDGET


MODELS: dict[str, VLModel] = {
    m.name: m
    for m in (
        VLModel("PaddleOCR-VL-0.9B", "v1", "PaddlePaddle/PaddleOCR-VL", "0.11.1",
                "PP-DocLayoutV2"),
        VLModel("PaddleOCR-VL-1.5-0.9B", "v1.5", "PaddlePaddle/PaddleOCR-VL-1.5", "0.11.1",
                "PP-DocLayoutV3"),
        VLModel("PaddleOCR-VL-1.6-0.9B", "v1.6", "PaddlePaddle/PaddleOCR-VL-1.6", "0.11.1",
                "PP-DocLayoutV3"),
    )
}
DEFAULT_MODEL = "PaddleOCR-VL-1.6-0.9B"

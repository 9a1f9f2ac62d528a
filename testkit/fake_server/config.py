"""Everything the fake server can be told, as one settings object (its command line sets it)."""

from __future__ import annotations

import dataclasses

DEFAULT_MODEL = "PaddleOCR-VL-1.6-0.9B"


@dataclasses.dataclass
class FakeServerConfig:
    """Everything the fake server can be told (mirrors the command-line options)."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = (DEFAULT_MODEL,)
    max_model_len: int = 16384
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.9
    api_key: str | None = None
    output_tokens: str = "fixed:16"
    step_t0_ms: float = 0.0
    step_t1_ms: float = 0.0
    prefill_ms_per_image: float = 0.0
    prepare_ms_per_image: float = 0.0
    kv_capacity_tokens: int | None = None
    startup_delay: float = 0.0
    crash_after: int | None = None
    crash_exit_delay: float = 0.5
    hang_after: int | None = None
    error_500_every: int | None = None
    error_500_rate: float = 0.0
    health_503_after: int | None = None
    fail_start: str | None = None
    fake_vram_gib: float | None = None
    fake_vram_used_gib: float = 0.0
    fake_vram_ledger: str | None = None
    fake_weights_gib: float = 1.9
    fake_kv_gib_per_token: float = 0.0000183
    spawn_engine_child: bool = False
    request_log: str | None = None
    looping_answers: bool = False
    loop_widths: frozenset[int] = frozenset()
    cut_widths: frozenset[int] = frozenset()
    empty_widths: frozenset[int] = frozenset()
    refused_prompts: tuple[str, ...] = ()  # requests whose prompt starts so get an HTTP 400
    # As vLLM >= 0.31: a request with mm_processor_kwargs gets HTTP 400 unless the server was
    # started with --trust-request-mm-kwargs (`trust_request_mm_kwargs`).
    gate_request_mm_kwargs: bool = False
    trust_request_mm_kwargs: bool = False
    loop_marked: bool = False  # images with a red mark loop, like loop_widths
    read_text: bool = False  # answer with the image's real words (reader.py)
    access_log: bool = True
    ignored_args: tuple[str, ...] = ()

    @property
    def simulate(self) -> bool:
        """Whether requests go through the continuous-batching scheduler."""
        return self.step_t0_ms > 0 or self.step_t1_ms > 0 or self.prefill_ms_per_image > 0

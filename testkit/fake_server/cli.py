"""The fake server's command line (vLLM's flag names where vLLM has the option) and its process
entry point, ``python -m testkit.fake_server [options]``."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import Sequence

from testkit.fake_server.answers import OutputLength
from testkit.fake_server.config import FakeServerConfig
from testkit.fake_server.server import FakeServer
from testkit.fake_server.startup import FAIL_KINDS


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (vLLM's names where vLLM has the option)."""
    p = argparse.ArgumentParser(
        prog="python -m testkit.fake_server",
        description="Fake vLLM OpenAI-compatible server for ocrvl tests and benchmarks.",
        allow_abbrev=False,  # an unknown vLLM flag must never match one of ours by prefix
    )
    d = FakeServerConfig()
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--served-model-name", nargs="+", default=list(d.served_model_names))
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"))
    p.add_argument(
        "--output-tokens", default=d.output_tokens, help="fixed:N|uniform:A:B|lognormal:MEAN:SIGMA"
    )
    p.add_argument(
        "--step-t0-ms", type=float, default=d.step_t0_ms, help="fixed cost of a decode step"
    )
    p.add_argument(
        "--step-t1-ms", type=float, default=d.step_t1_ms, help="step cost per running sequence"
    )
    p.add_argument(
        "--prefill-ms-per-image",
        type=float,
        default=d.prefill_ms_per_image,
        help="prefill cost of a 1300-token image, added to the step that admits it",
    )
    p.add_argument(
        "--prepare-ms-per-image",
        type=float,
        default=d.prepare_ms_per_image,
        help="API-process time to prepare a 1300-token image, one image at a time in arrival "
        "order, before the engine sees the request (vLLM's API process, ~40 ms)",
    )
    p.add_argument("--kv-capacity-tokens", type=int, default=None)
    p.add_argument(
        "--startup-delay", type=float, default=d.startup_delay, help="seconds before binding"
    )
    p.add_argument("--crash-after", type=int, default=None)
    p.add_argument("--crash-exit-delay", type=float, default=d.crash_exit_delay)
    p.add_argument("--hang-after", type=int, default=None)
    p.add_argument("--error-500-every", type=int, default=None)
    p.add_argument("--error-500-rate", type=float, default=d.error_500_rate)
    p.add_argument("--health-503-after", type=int, default=None)
    p.add_argument("--fail-start", choices=FAIL_KINDS, default=None)
    p.add_argument("--fake-vram-gib", type=float, default=None)
    p.add_argument("--fake-vram-used-gib", type=float, default=d.fake_vram_used_gib)
    p.add_argument("--fake-vram-ledger", default=None,
                   help="a folder shared by fake servers on one fake card: each one that "
                   "starts holds utilization x total there, and counts the others' as used")
    p.add_argument("--fake-weights-gib", type=float, default=d.fake_weights_gib)
    p.add_argument("--fake-kv-gib-per-token", type=float, default=d.fake_kv_gib_per_token)
    p.add_argument("--spawn-engine-child", action="store_true")
    p.add_argument("--request-log", default=None, help="append one JSON line per chat request")
    p.add_argument("--looping-answers", action="store_true",
                   help="every answer repeats one phrase until the token limit (a model loop)")
    for kind, what in (("loop", "loop unless the request breaks loops"),
                       ("cut", "are cut off at the limit"), ("empty", "get an empty answer")):
        p.add_argument(f"--{kind}-widths", type=_widths, default=frozenset(),
                       help=f"pages whose image is this many pixels wide {what} (W,W,...)")
    p.add_argument("--refused-prompts", default="",
                   help="requests whose prompt starts with one of these (P,P,...) are refused "
                   "with HTTP 400, as vLLM refuses a request it cannot take")
    p.add_argument("--gate-request-mm-kwargs", action="store_true",
                   help="refuse requests with mm_processor_kwargs (HTTP 400, vLLM's words) unless "
                   "--trust-request-mm-kwargs is given, as vLLM >= 0.31 does")
    p.add_argument("--trust-request-mm-kwargs", action="store_true")
    p.add_argument("--loop-marked", action="store_true",
                   help="images with a red mark on them (a block of a laid-out page) loop "
                   "unless the request breaks loops")
    p.add_argument("--read-text", action="store_true",
                   help="answer with the words on the image, read by a real OCR model (rapidocr's "
                   "PP-OCRv6 on onnxruntime, CPU; the test extra): one paragraph a line, a "
                   "word a token")
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    return p


def _widths(spec: str) -> frozenset[int]:
    return frozenset(int(w) for w in spec.split(",") if w.strip())


def parse_args(argv: Sequence[str] | None = None) -> FakeServerConfig:
    """Parse command-line arguments; unknown (vLLM) arguments are kept in ``ignored_args``."""
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    try:
        OutputLength.parse(ns.output_tokens)
    except ValueError as exc:
        parser.error(str(exc))
    return FakeServerConfig(
        host=ns.host,
        port=ns.port,
        served_model_names=tuple(ns.served_model_name),
        max_model_len=ns.max_model_len,
        max_num_seqs=ns.max_num_seqs,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        api_key=ns.api_key,
        output_tokens=ns.output_tokens,
        step_t0_ms=ns.step_t0_ms,
        step_t1_ms=ns.step_t1_ms,
        prefill_ms_per_image=ns.prefill_ms_per_image,
        prepare_ms_per_image=ns.prepare_ms_per_image,
        kv_capacity_tokens=ns.kv_capacity_tokens,
        startup_delay=ns.startup_delay,
        crash_after=ns.crash_after,
        crash_exit_delay=ns.crash_exit_delay,
        hang_after=ns.hang_after,
        error_500_every=ns.error_500_every,
        error_500_rate=ns.error_500_rate,
        health_503_after=ns.health_503_after,
        fail_start=ns.fail_start,
        fake_vram_gib=ns.fake_vram_gib,
        fake_vram_used_gib=ns.fake_vram_used_gib,
        fake_vram_ledger=ns.fake_vram_ledger,
        fake_weights_gib=ns.fake_weights_gib,
        fake_kv_gib_per_token=ns.fake_kv_gib_per_token,
        spawn_engine_child=ns.spawn_engine_child,
        request_log=ns.request_log,
        looping_answers=ns.looping_answers,
        loop_widths=ns.loop_widths,
        cut_widths=ns.cut_widths,
        empty_widths=ns.empty_widths,
        refused_prompts=tuple(p for p in ns.refused_prompts.split(",") if p),
        gate_request_mm_kwargs=ns.gate_request_mm_kwargs,
        trust_request_mm_kwargs=ns.trust_request_mm_kwargs,
        loop_marked=ns.loop_marked,
        read_text=ns.read_text,
        access_log=not ns.disable_uvicorn_access_log,
        ignored_args=tuple(unknown),
    )


async def _serve(cfg: FakeServerConfig) -> int:
    server = FakeServer(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_stop, 0)
    return await server.run()


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code."""
    return asyncio.run(_serve(parse_args(argv)))

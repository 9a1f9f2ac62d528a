"""Loop savings on a real GPU: what stopping looping answers early saves in decode tokens and
GPU time (the GPU counterpart of bench/loop_savings.py, which runs against the fake server).

    python -m bench.gpu.loop_savings --model-dir DIR [--vllm-pythonpath SITE] [--pages 128]
        [--loop-pages 0.1:23] [--results bench/gpu/loop_savings.json]
    python -m bench.gpu.loop_savings --fake --pages 12      # the dry run (no GPU)

One vLLM server with random weights whose answers end at realistic lengths, except a share
of pages that loop to their token limit (bench.gpu.loop_pages' logits processor; a request
with the loop-breaking `repetition_penalty` gets its ordinary answer). The same book is
converted twice by `ocrvl convert` on the warm server, `pipeline.stop_loops_early: false`,
then `true`. For each: the decode tokens the server generated (its
`vllm:generation_tokens_total`, aborted requests included), the seconds from the engine
worker's ready line, the GPU's busy share and power (sampled), and GPU seconds = seconds x
busy share. Writes `--results` after each run. The dry run uses the fake server in this
process, whose pages loop by width (`--loop-widths`), chosen with the same draw by page index.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.gpu.loop_pages import DEFAULT as DEFAULT_LOOPS
from bench.gpu.loop_pages import ENV as LOOPS_ENV
from bench.gpu.loop_pages import LoopingPages
from bench.gpu.run import PAGE_HEIGHT, Bench, gpu_name, log, warm_up
from bench.gpu.teardown import stops_children
from bench.gpu.vllm_server import ServeOptions, model_dir_parser, started, version
from ocrvl_daemon.server.probe import parse_metrics
from testkit.documents import make_pdf, sent_width
from testkit.fake_server import InProcessFakeServer, parse_args
from testkit.harness import free_port

HERE = Path(__file__).resolve().parent
PROCESSOR = "bench.gpu.loop_pages:LoopingAnswerLengths"
CONCURRENCY = 128


def generation_tokens(url: str) -> float:
    """The server's decode tokens so far (its /metrics counter)."""
    sample = parse_metrics(httpx.get(url + "/metrics", timeout=10).text, time.monotonic())
    if sample.generation_tokens_total is None:
        raise RuntimeError(f"{url}/metrics has no generation tokens counter")
    return sample.generation_tokens_total


def run_entry(tokens: float, seconds: float, pages: int, extra: dict[str, Any]) -> dict[str, Any]:
    """One conversion's figures; GPU seconds where the GPU's busy share was sampled."""
    busy = extra.get("gpu_busy_pct")
    return {"decode_tokens": int(tokens), "seconds": round(seconds, 2),
            "pages_per_s": round(pages / seconds, 3), "gpu_busy_pct": busy,
            "watts": extra.get("gpu_watts"),
            "gpu_seconds": None if busy is None else round(seconds * busy / 100, 2)}  # fmt: skip


def savings(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What `stop_loops_early: true` saved against false ({} until both ran)."""
    if set(runs) != {"false", "true"}:
        return {}
    before, after = runs["false"], runs["true"]
    saved = before["decode_tokens"] - after["decode_tokens"]
    out: dict[str, Any] = {"decode_tokens_saved": saved,
                           "decode_share_saved": round(saved / before["decode_tokens"], 3),
                           "seconds_saved": round(before["seconds"] - after["seconds"], 2)}
    if before["gpu_seconds"] is not None and after["gpu_seconds"] is not None:
        out["gpu_seconds_saved"] = round(before["gpu_seconds"] - after["gpu_seconds"], 2)
    return out


@contextlib.contextmanager
def server(args: Any, work: Path, looping: LoopingPages) -> Iterator[str]:
    """The server's root URL: vLLM with the looping processor, or (`--fake`) the fake server
    with the same share of pages looping by width."""
    if args.fake:
        widths = [sent_width(i, PAGE_HEIGHT) for i in range(args.pages) if looping.loops(i)]
        # Simulated batching: an aborted request stops decoding, as in vLLM.
        cfg = parse_args(["--host", "127.0.0.1", "--port", "0", "--output-tokens",
                          "uniform:300:600", "--step-t0-ms", "1", "--step-t1-ms", "0.05",
                          "--loop-widths", ",".join(map(str, widths)),
                          "--disable-uvicorn-access-log"])  # fmt: skip
        with InProcessFakeServer(cfg) as fake:
            yield fake.url
        return
    os.environ[LOOPS_ENV] = str(looping)  # ServeOptions passes this process's environment on
    options = ServeOptions(model=args.model_dir, dummy=True, lengths=None, port=free_port(),
                           python=args.vllm_python, pythonpath=args.vllm_pythonpath,
                           extra=["--logits-processors", PROCESSOR])  # fmt: skip
    log("starting: " + " ".join(options.argv()))
    with started(options, (args.log_dir or work) / "vllm.log") as url:
        yield url


@stops_children
def main(argv: list[str] | None = None) -> int:
    ap = model_dir_parser("python -m bench.gpu.loop_savings", __doc__, required=False)
    ap.add_argument("--fake", action="store_true", help="the fake server: a dry run, no GPU")
    ap.add_argument("--pages", type=int, default=128, help="pages of the book (default 128)")
    ap.add_argument("--loop-pages", default=DEFAULT_LOOPS,
                    help=f"SHARE:SEED of the pages that loop (default {DEFAULT_LOOPS})")
    ap.add_argument("--results", type=Path, default=HERE / "loop_savings.json")
    ap.add_argument("--log-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    if not args.fake and not args.model_dir:
        ap.error("--model-dir is required (or --fake for a dry run)")
    looping = LoopingPages.parse(args.loop_pages)
    work = Path(tempfile.mkdtemp(prefix="ocrvl-loop-savings-"))
    book = make_pdf(work / "book.pdf", args.pages, height=PAGE_HEIGHT, seed=1)
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "gpu": gpu_name(),
                           "pages": args.pages, "loop_pages": str(looping),
                           "server": "fake (testkit)" if args.fake else args.model_dir,
                           "runs": {}}  # fmt: skip
    try:
        with server(args, work, looping) as url:
            res["vllm"] = version(url)
            warm_up([url], work)
            bench = Bench(url, work, book, args.pages, CONCURRENCY, log_dir=args.log_dir)
            try:
                for stop in (False, True):
                    before = generation_tokens(url)
                    r = bench.convert(f"stop_loops_early {str(stop).lower()}",
                                      pipeline={"stop_loops_early": stop})  # fmt: skip
                    bench.metrics.wait_idle()  # aborted requests counted to their last token
                    entry = run_entry(generation_tokens(url) - before, r.seconds, r.pages,
                                      r.extra)  # fmt: skip
                    res["runs"][str(stop).lower()] = entry
                    res["saved"] = savings(res["runs"])
                    args.results.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
                    log(f"stop_loops_early {stop}: {entry}")
            finally:
                bench.metrics.stop()
        print(json.dumps({"runs": res["runs"], "saved": res["saved"]}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

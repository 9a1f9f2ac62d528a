"""An 8 GB card on a big one: ocrvl's `auto` plans from an 8 GB reading, vLLM gets the memory
that card would give it, and ocrvl's adaptive bound is compared with a sweep of static bounds.

    python -m bench.gpu.small_card --model-dir DIR [--vllm-pythonpath SITE]

The plan is ocrvl's own (`autotune.plan_vllm_args` on a reading of `--card-mib` total,
`--card-used-mib` used by the desktop). vLLM is then started with that plan, its
`--gpu-memory-utilization` scaled by card / real total, so its KV cache budget in bytes
(utilization x total - weights - activations) is the small card's. Compute stays the big
card's: this checks memory planning and the bound's safety, not a 4060's speed.
Each contender is `ocrvl convert` of the same book (fresh state) against that server, after
a short warm-up: adaptive (the default config), adaptive with `pipeline.max_concurrency` at
the planned max-num-seqs, and `pipeline.adaptive_concurrency: false` at each `--static`
bound. Prints the table and writes `small_card.json` beside this file.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.gpu.lengths import DEFAULT as DEFAULT_LENGTHS
from bench.gpu.run import PAGE_HEIGHT, Bench, gpu_name, log, warm_up
from bench.gpu.vllm_server import ServeOptions, model_dir_parser, started, version
from ocrvl_daemon.config import Config
from ocrvl_daemon.server import autotune
from ocrvl_daemon.server.gpu import GpuReading, read_gpu
from testkit.documents import make_pdf
from testkit.harness import free_port

HERE = Path(__file__).resolve().parent
OUT_OF_MEMORY = re.compile(r"OutOfMemoryError|CUDA out of memory|No available memory")
RTX_4060_MIB = 8188  # what nvidia-smi reports for an 8 GB RTX 4060
DESKTOP_MIB = 700  # a Windows desktop under WSL2 holds about this much of it
# vLLM's start-up lines with its own memory accounting
KV_LINES = re.compile(r"GPU KV cache size|Maximum concurrency for|Available KV cache memory|"
                      r"Model loading took|memory profiling", re.IGNORECASE)


def card_reading(real: GpuReading, total_mib: int, used_mib: int) -> GpuReading:
    """The small card as ocrvl would read it (the real card's driver and compute capability)."""
    return GpuReading(index=real.index, uuid="GPU-emulated-small-card",
                      name=f"emulated {total_mib} MiB card (on {real.name})", total_mib=total_mib,
                      used_mib=used_mib, free_mib=total_mib - used_mib, driver=real.driver,
                      compute_capability=real.compute_capability, source="nvidia-smi")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = model_dir_parser("python -m bench.gpu.small_card", __doc__)
    ap.add_argument("--card-mib", type=int, default=RTX_4060_MIB)
    ap.add_argument("--card-used-mib", type=int, default=DESKTOP_MIB)
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--static", default="16,32,48,64,96",
                    help="static bounds to sweep (default 16,32,48,64,96)")  # fmt: skip
    ap.add_argument("--results", type=Path, default=HERE / "small_card.json")
    args = ap.parse_args(argv)

    real = read_gpu()
    if real is None:
        raise SystemExit("no GPU reading (nvidia-smi): this benchmark needs an NVIDIA GPU")
    card = card_reading(real, args.card_mib, args.card_used_mib)
    config = Config()
    plan = autotune.plan_vllm_args(config, card)
    values = plan.values
    scale = args.card_mib / real.total_mib
    utilization = float(values[autotune.UTILIZATION])
    seqs = int(values[autotune.MAX_NUM_SEQS])  # the pages the planned KV cache holds at once
    log(f"ocrvl's plan for {card.name}: " + "; ".join(plan.reasons))
    for warning in plan.warnings:
        log(f"plan warning: {warning}")
    work = Path(tempfile.mkdtemp(prefix="ocrvl-smallcard-"))
    book = make_pdf(work / "book.pdf", args.pages, height=PAGE_HEIGHT, seed=1)
    options = ServeOptions(
        model=args.model_dir, dummy=True, lengths=DEFAULT_LENGTHS, port=free_port(),
        python=args.vllm_python, pythonpath=args.vllm_pythonpath,
        max_model_len=int(values[autotune.MAX_MODEL_LEN]),
        gpu_memory_utilization=round(utilization * scale, 4),
        extra=["--max-num-seqs", str(values[autotune.MAX_NUM_SEQS]),
               "--max-num-batched-tokens", str(values[autotune.BATCHED_TOKENS])],
    )  # fmt: skip
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "gpu": gpu_name(), "pages": args.pages,
        "card": asdict(card), "plan": {k: values[k] for k in autotune.TUNED_KEYS},
        "plan_reasons": plan.reasons, "served_utilization": options.gpu_memory_utilization,
        "answer_lengths": DEFAULT_LENGTHS,
    }  # fmt: skip
    vllm_log = work / "vllm.log"
    log("starting: " + " ".join(options.argv()))
    try:
        with started(options, vllm_log) as url:
            res["vllm"] = version(url)
            res["vllm_memory"] = [ln.split("] ", 1)[-1] for ln in
                                  vllm_log.read_text(errors="replace").splitlines()
                                  if KV_LINES.search(ln)]  # fmt: skip
            warm_up([url], work)
            bench = Bench(url, work, book, args.pages, config.pipeline.max_concurrency)
            try:
                bench.convert("adaptive")
                bench.convert(f"adaptive, max_concurrency {seqs}",
                              pipeline={"max_concurrency": seqs})  # fmt: skip
                for bound in (int(b) for b in args.static.split(",")):
                    bench.convert(f"static {bound}", pipeline={
                        "adaptive_concurrency": False, "max_concurrency": bound,
                        "min_concurrency": min(bound, config.pipeline.min_concurrency)})
            finally:
                bench.metrics.stop()
            text = vllm_log.read_text(errors="replace")
            res["server_out_of_memory"] = bool(OUT_OF_MEMORY.search(text))
            res["results"] = {n: {"pages_per_s": round(r.pages_per_s, 3),
                                  "preemptions": r.preemptions, "timeline": r.timeline,
                                  "concurrency": r.extra.get("concurrency", [])}
                              for n, r in bench.results.items()}  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    statics = {n: r["pages_per_s"] for n, r in res["results"].items() if n.startswith("static")}
    best = max(statics, key=lambda n: statics[n])
    res["best_static"] = best
    res["adaptive_vs_best_static"] = round(res["results"]["adaptive"]["pages_per_s"]
                                           / statics[best], 3)  # fmt: skip
    args.results.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    print(report(res))
    return 0


def report(res: dict[str, Any]) -> str:
    """The table of record for RESULTS.md."""
    lines = [
        f"{res['card']['name']}, vLLM {res.get('vllm')}, {res['pages']} pages, "
        f"{res['date']}",
        "ocrvl's plan: " + ", ".join(f"{k} {v}" for k, v in res["plan"].items())
        + f" (served at utilization {res['served_utilization']} of the real card)",
        *(f"  vLLM: {line}" for line in res.get("vllm_memory", [])),
        "",
        "| run | pages/s | vs best static | preemptions |",
        "|---|---:|---:|---:|",
    ]
    best = res["results"][res["best_static"]]["pages_per_s"]
    for name, r in res["results"].items():
        lines.append(f"| {name} | {r['pages_per_s']:.2f} | {r['pages_per_s'] / best:.0%} | "
                     f"{r['preemptions']} |")  # fmt: skip
    lines += ["", f"adaptive / best static ({res['best_static']}): "
              f"{res['adaptive_vs_best_static']:.0%} (target >= 95%); server out of memory: "
              f"{res['server_out_of_memory']}",
              "adaptive bound: " + " | ".join(res["results"]["adaptive"]["concurrency"])]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

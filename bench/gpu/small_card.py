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

With `--layout` (issue 35) the layout model runs on the same card beside vLLM: the plan is
ocrvl's for layout detection on with `pipeline.layout_device: gpu:0` (its server leaves the
layout workers their LAYOUT_GPU_MIB each, on the small card's reading), the workers as many as
that card has room for, and each contender converts a `make_layout_pdf` book with the layout
model on the GPU (`--layout-engine`, the model from `--layout-cache`). The card's memory is
read every half second from before vLLM starts to the end (nvidia-smi: the whole card, and
per process where it names them): the peak against the small card's budget, and whether vLLM
or any ocrvl process ran out of memory, go under `layout_on` in the results file.

A start that runs out of memory is followed, as ocrvl's managed server follows it, by the
next smaller plan `autotune.next_after_oom` makes from vLLM's own failure text, until one
starts or nothing is left to lower: `starts` in the results file lists each plan and why it
failed, and the contenders run against the plan that started (vLLM 0.33.0 on the 8 GB card
beside the layout model needs that second start).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

from bench.gpu.layout_on import (
    PAGE_TOKENS,
    block_lengths,
    caught_blocks,
    use_stand_in_hook,
)
from bench.gpu.lengths import DEFAULT as DEFAULT_LENGTHS
from bench.gpu.run import (
    PAGE_HEIGHT,
    Bench,
    gpu_name,
    log,
    merged,
    server_process,
    warm_up,
    write_json,
)
from bench.gpu.teardown import process_name, stops_children
from bench.gpu.vllm_server import ServeOptions, model_dir_parser, started, version
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.server import autotune, placement, vllm_diagnosis
from ocrvl_daemon.server.gpu import GpuReading, read_gpu
from testkit.documents import make_layout_pdf, make_pdf
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


class CardMemory:
    """The card's used memory (nvidia-smi, every `interval` s) and each compute process's
    where the driver names them, from `start` to `stop`: the peaks."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.samples: list[tuple[int, dict[int, int]]] = []  # (card used, {pid: MiB})
        self.names: dict[int, str] = {}  # each process seen on the card: what it runs
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> CardMemory:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            reading = read_gpu()
            if reading is not None:
                apps = compute_apps()
                self.samples.append((reading.used_mib, apps))
                for pid in apps.keys() - self.names.keys():
                    with contextlib.suppress(psutil.Error):
                        self.names[pid] = process_name(psutil.Process(pid))
            self._stop.wait(self.interval)

    def peaks(self, baseline_mib: int, server_pids: set[int]) -> dict[str, Any]:
        """Peak MiB the benchmark's processes held on the card: the card's reading above
        `baseline_mib` (what was there before vLLM), and from the per-process list, all
        processes, vLLM's (`server_pids`, and an engine core of a start that failed before
        them, by the name vLLM gives it) and the rest (the layout workers)."""
        if not self.samples:
            return {}
        apps = [a for _, a in self.samples]
        server_pids = server_pids | {p for p, n in self.names.items() if n.startswith("VLLM::")}
        return {
            "peak_card_used_mib": max(u for u, _ in self.samples) - baseline_mib,
            "peak_processes_mib": max(sum(a.values()) for a in apps),
            "peak_server_mib": max(sum(m for p, m in a.items() if p in server_pids)
                                   for a in apps),
            "peak_layout_mib": max(sum(m for p, m in a.items() if p not in server_pids)
                                   for a in apps),
            "samples": len(self.samples),
            # which process holds what: vLLM's API process beside its engine core, say
            "peak_by_process_mib": {f"{pid} {self.names.get(pid, '?')}": max(
                a.get(pid, 0) for a in apps) for pid in sorted({p for a in apps for p in a})},
        }  # fmt: skip


def ocrvl_out_of_memory(log_dir: Path) -> list[str]:
    """The logs of ocrvl's processes under `log_dir` that say out of memory: not vLLM's
    (`vllm.log`, and `vllm-start-N.log` of each start that failed, which `starts` reports)."""
    return sorted(p.name for p in log_dir.glob("*.log") if not p.name.startswith("vllm")
                  and OUT_OF_MEMORY.search(p.read_text(errors="replace")))


def compute_apps() -> dict[int, int]:
    """{pid: MiB} of the processes on the GPU, as nvidia-smi names them ({} where it cannot:
    in a container it may give the host's pids, which is why the card's total is kept too)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10, check=False).stdout  # fmt: skip
        return {int(pid): int(mib) for pid, mib in
                (line.split(",") for line in out.strip().splitlines() if "," in line)}
    return {}


def family(url: str) -> set[int]:
    """The pids of the server listening at `url` and of its children (the engine core)."""
    proc = server_process(url)
    if proc is None:
        return set()
    with contextlib.suppress(Exception):
        return {proc.pid, *(c.pid for c in proc.children(recursive=True))}
    return {proc.pid}


def served_options(serve: Callable[..., ServeOptions], values: dict[str, Any], scale: float
                   ) -> ServeOptions:
    """vLLM's options for ocrvl's plan `values` of the small card: its utilization scaled to
    the real card (the same bytes), the rest as planned."""
    return serve(max_model_len=int(values[autotune.MAX_MODEL_LEN]),
                 gpu_memory_utilization=round(float(values[autotune.UTILIZATION]) * scale, 4),
                 extra=["--max-num-seqs", str(values[autotune.MAX_NUM_SEQS]),
                        "--max-num-batched-tokens", str(values[autotune.BATCHED_TOKENS])])


@contextlib.contextmanager
def started_stepping_down(serve: Callable[..., ServeOptions], values: dict[str, Any],
                          config: Config, scale: float, vllm_log: Path, res: dict[str, Any]
                          ) -> Iterator[str]:
    """vLLM started on ocrvl's plan `values`, or on the next smaller plan ocrvl's managed
    server would try after each out-of-memory start (`autotune.next_after_oom` on vLLM's own
    text); yields its URL. Each try goes under res["starts"], the plan that started under
    res["started_plan"] and its utilization of the real card under res["served_utilization"];
    RuntimeError when a start fails otherwise or nothing is left to lower."""
    starts: list[dict[str, Any]] = res.setdefault("starts", [])
    current: dict[str, Any] | None = values
    while current is not None:
        options = served_options(serve, current, scale)
        tried = {"plan": {k: current[k] for k in autotune.TUNED_KEYS},
                 "served_utilization": options.gpu_memory_utilization}
        starts.append(tried)
        log("starting: " + " ".join(options.argv()))
        try:
            with started(options, vllm_log) as url:
                tried["started"] = True
                res["started_plan"] = tried["plan"]
                res["served_utilization"] = options.gpu_memory_utilization
                yield url
                return
        except RuntimeError as exc:
            if tried.get("started"):
                raise
            text = vllm_log.read_text(errors="replace")
            tried.update(started=False, failure=vllm_diagnosis.oom_cause(text)
                         or str(exc)[-600:])
            (vllm_log.parent / f"vllm-start-{len(starts)}.log").write_text(text)
            if not vllm_diagnosis.is_oom(text):
                raise
            current = autotune.next_after_oom(current, config, text)
            log("vLLM ran out of memory at start; ocrvl's next plan: "
                + (", ".join(f"{k} {current[k]}" for k in autotune.TUNED_KEYS)
                   if current else "none (nothing left to lower)"))  # fmt: skip
    raise RuntimeError("vLLM did not start on any plan ocrvl would try: " + "; ".join(
        f"{s['plan']}: {s.get('failure', '')[-200:]}" for s in starts))


@stops_children
def main(argv: list[str] | None = None) -> int:
    ap = model_dir_parser("python -m bench.gpu.small_card", __doc__)
    ap.add_argument("--card-mib", type=int, default=RTX_4060_MIB)
    ap.add_argument("--card-used-mib", type=int, default=DESKTOP_MIB)
    ap.add_argument("--pages", type=int, default=None,
                    help="pages of the book (default 256; with --layout 64)")  # fmt: skip
    ap.add_argument("--static", default=None,
                    help="static bounds to sweep (default 16,32,48,64,96; with --layout "
                    "none)")  # fmt: skip
    ap.add_argument("--results", type=Path, default=HERE / "small_card.json")
    ap.add_argument("--layout", action="store_true",
                    help="layout detection on, the layout model on the same card (see above)")
    ap.add_argument("--layout-engine", default="auto",
                    choices=("auto", "paddle", "transformers", "onnxruntime"))
    ap.add_argument("--layout-cache", type=Path, default=None,
                    help="PADDLE_PDX_CACHE_HOME holding the layout model")  # fmt: skip
    ap.add_argument("--log-dir", type=Path, default=None,
                    help="vllm.log and each ocrvl process's log (default: the work directory, "
                    "removed at the end)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.pages is None:
        args.pages = 64 if args.layout else 256
    if args.static is None:
        args.static = "" if args.layout else "16,32,48,64,96"
    if args.layout_cache:
        os.environ["PADDLE_PDX_CACHE_HOME"] = str(args.layout_cache.resolve())
    if args.layout:
        use_stand_in_hook()

    real = read_gpu()
    if real is None:
        raise SystemExit("no GPU reading (nvidia-smi): this benchmark needs an NVIDIA GPU")
    card = card_reading(real, args.card_mib, args.card_used_mib)
    layout: dict[str, Any] = {}
    if args.layout:
        layout = {"use_layout_detection": True, "layout_engine": args.layout_engine,
                  "layout_device": f"gpu:{real.index}"}  # fmt: skip
        # as many workers as the small card has room for (ocrvl's worker would read the big
        # card and take more): ocrvl's own choice on the small card's reading, made explicit
        choice = placement.layout_choice(Config.model_validate({"pipeline": layout}), [card])
        layout["workers"] = choice.workers
        log(f"layout on the card: {choice.describe()}, {choice.workers} worker(s) "
            f"({choice.why})")  # fmt: skip
    config = Config.model_validate({"pipeline": layout})
    plan = autotune.plan_vllm_args(config, card)
    lengths = DEFAULT_LENGTHS
    values = plan.values
    scale = args.card_mib / real.total_mib
    log(f"ocrvl's plan for {card.name}: " + "; ".join(plan.reasons))
    for warning in plan.warnings:
        log(f"plan warning: {warning}")
    work = Path(tempfile.mkdtemp(prefix="ocrvl-smallcard-"))
    log_dir = args.log_dir or work
    log_dir.mkdir(parents=True, exist_ok=True)
    book = (make_layout_pdf(work / "book.pdf", args.pages, seed=1) if args.layout else
            make_pdf(work / "book.pdf", args.pages, height=PAGE_HEIGHT, seed=1))  # fmt: skip
    if args.layout:  # a block's answer: a page's shared by its blocks (bench.gpu.layout_on)
        settings = {k: v for k, v in layout.items() if k != "use_layout_detection"}
        sample = min(4, args.pages)
        blocks = caught_blocks(settings, book, sample, work / "blocks.jsonl", log_dir, 900)
        lengths = block_lengths(blocks["requests_per_page"], PAGE_TOKENS)
        log(f"blocks: {blocks['requests_per_page']:.1f} sent a page: answers {lengths}")
    serve = functools.partial(
        ServeOptions, model=args.model_dir, dummy=True, lengths=lengths, port=free_port(),
        python=args.vllm_python, pythonpath=args.vllm_pythonpath)  # fmt: skip
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "gpu": gpu_name(), "pages": args.pages,
        "card": asdict(card), "plan": {k: values[k] for k in autotune.TUNED_KEYS},
        "plan_reasons": plan.reasons, "answer_lengths": lengths,
    }  # fmt: skip
    if args.layout:
        res["layout"] = {k: v for k, v in layout.items() if k != "use_layout_detection"}
        res["card_budget_mib"] = args.card_mib - args.card_used_mib
    vllm_log = log_dir / "vllm.log"
    memory = CardMemory()
    baseline = real.used_mib
    try:
        memory.start()
        with started_stepping_down(serve, values, config, scale, vllm_log, res) as url:
            # the pages the KV cache of the plan that started holds at once
            seqs = int(res["started_plan"][autotune.MAX_NUM_SEQS])
            server_pids = family(url)
            res["vllm"] = version(url)
            res["vllm_memory"] = [ln.split("] ", 1)[-1] for ln in
                                  vllm_log.read_text(errors="replace").splitlines()
                                  if KV_LINES.search(ln)]  # fmt: skip
            warm_up([url], work)
            bench = Bench(url, work, book, args.pages, config.pipeline.max_concurrency,
                          log_dir=log_dir)  # fmt: skip
            bench.layout = layout
            failed: dict[str, str] = {}
            try:
                for name, more in (("adaptive", {}), (f"adaptive, max_concurrency {seqs}",
                                                      {"max_concurrency": seqs})):
                    try:
                        bench.convert(name, pipeline=more)
                    except RuntimeError as exc:  # an ocrvl process ran out of memory, say
                        if not args.layout:
                            raise
                        failed[name] = str(exc)[-2000:]
                        log(f"{name} failed: {failed[name][-500:]}")
                for bound in (int(b) for b in args.static.split(",") if b.strip()):
                    bench.convert(f"static {bound}", pipeline={
                        "adaptive_concurrency": False, "max_concurrency": bound,
                        "min_concurrency": min(bound, config.pipeline.min_concurrency)})
            finally:
                bench.metrics.stop()
                memory.stop()
            text = vllm_log.read_text(errors="replace")
            res["server_out_of_memory"] = bool(OUT_OF_MEMORY.search(text))
            if args.layout:
                res["memory"] = memory.peaks(baseline, server_pids)
                res["ocrvl_out_of_memory"] = ocrvl_out_of_memory(log_dir)
                res["failed"] = failed
            res["results"] = {n: {"pages_per_s": round(r.pages_per_s, 3),
                                  "preemptions": r.preemptions, "timeline": r.timeline,
                                  "concurrency": r.extra.get("concurrency", [])}
                              for n, r in bench.results.items()}  # fmt: skip
    finally:
        memory.stop()
        shutil.rmtree(work, ignore_errors=True)
    if args.layout:
        peak = res["memory"].get("peak_card_used_mib")
        res["fits"] = (peak is not None and peak <= res["card_budget_mib"]
                       and not res["server_out_of_memory"] and not res["ocrvl_out_of_memory"]
                       and not res["failed"])  # fmt: skip
        write_json(args.results, merged(args.results, {"layout_on": res}))
        print(layout_report(res))
        return 0
    statics = {n: r["pages_per_s"] for n, r in res["results"].items() if n.startswith("static")}
    best = max(statics, key=lambda n: statics[n])
    res["best_static"] = best
    res["adaptive_vs_best_static"] = round(res["results"]["adaptive"]["pages_per_s"]
                                           / statics[best], 3)  # fmt: skip
    # the layout-on figures of an earlier `--layout` run in the same file are kept
    write_json(args.results, merged(args.results, res))
    print(report(res))
    return 0


def plan_lines(res: dict[str, Any]) -> list[str]:
    """ocrvl's plan, and each smaller one its step-down tried after an out-of-memory start."""
    lines = []
    for n, start in enumerate(res["starts"]):
        head = "ocrvl's plan" if n == 0 else "then, stepped down"
        outcome = ("started" if start["started"] else
                   f"did not start: {start['failure'][-300:]}")
        lines.append(f"{head}: " + ", ".join(f"{k} {v}" for k, v in start["plan"].items())
                     + f" (served at utilization {start['served_utilization']} of the real "
                     f"card): {outcome}")  # fmt: skip
    return lines


def layout_report(res: dict[str, Any]) -> str:
    """The layout-on table of record: speed, the card's peak memory, out of memory or not."""
    m = res.get("memory", {})
    lines = [
        f"{res['card']['name']}, vLLM {res.get('vllm')}, {res['pages']} layout pages, "
        f"{res['date']}; layout {res['layout']}",
        *plan_lines(res),
        f"peak on the card: {m.get('peak_card_used_mib')} MiB above what was there before "
        f"vLLM, of a budget of {res['card_budget_mib']} MiB (per process: all "
        f"{m.get('peak_processes_mib')}, vLLM {m.get('peak_server_mib')}, layout workers "
        f"{m.get('peak_layout_mib')})",
        *(f"- {mib} MiB at its peak: {name}"
          for name, mib in m.get("peak_by_process_mib", {}).items()),
        f"out of memory: vLLM {res['server_out_of_memory']}, ocrvl {res['ocrvl_out_of_memory']}"
        f"; failed runs: {list(res['failed'])}; fits: {res['fits']}", "",
        "| run | pages/s | preemptions |", "|---|---:|---:|",
        *(f"| {n} | {r['pages_per_s']:.2f} | {r['preemptions']} |"
          for n, r in res["results"].items()),
    ]  # fmt: skip
    return "\n".join(lines)


def report(res: dict[str, Any]) -> str:
    """The table of record for RESULTS.md."""
    lines = [
        f"{res['card']['name']}, vLLM {res.get('vllm')}, {res['pages']} pages, "
        f"{res['date']}",
        *plan_lines(res),
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

"""The benchmark of record with layout detection on (issue 35, "Measure"): `bench.gpu --layout`.

    python -m bench.gpu --model-dir DIR --layout --layout-engine transformers \\
        --layout-device gpu:0 --layout-cache CACHE [--pages 64] [--only ...] [--merge]

One vLLM server, one `make_layout_pdf` book, and in one run:

  blocks    (untimed, before the server starts) ocrvl's own PaddleOCR-VL pipeline, built as
            its engine worker builds it, on every page of the book as ocrvl renders it, its
            chat requests caught instead of sent: each block cut out, encoded and asked for
            exactly as PaddleX sends it for ocrvl (prompt per label, pixel limits, JPEG).
            Gives the blocks per page, and with random weights each block's answer median
            (--page-tokens / requests per page: a page's blocks add up to a page's answer).
  capacity  those block requests, `--concurrency` always in flight (bench.loadgen.send_all)
  B2        one warm `PaddleOCRVL(vl_rec_backend="vllm-server", use_layout_detection=True,
            <LayoutChoice.common_args()>)`.predict([book]), PaddleX's own queues
  convert   `ocrvl convert` with pipeline.use_layout_detection/layout_engine/layout_device
  run       `ocrvl run`, the same settings, the book dropped into a warm daemon
  small     two-page layout documents alone, then under a book
  alone     the layout model alone: as many processes as ocrvl runs workers, each built as
            the pipeline builds it and called as the pipeline calls it, pages rendered ahead
            (before vLLM starts; at most ALONE_MAX_PAGES pages and ALONE_MAX_S s)
  cpu       the layout model on the CPU with ocrvl held to 4, 8 and all cores
            (sched_setaffinity on ocrvl, inherited by its workers, whose own plan follows
            the cores they see): layout alone, then `ocrvl convert` of --cpu-pages pages

Results go under `layout_on` in --results (the layout-off figures in the same file are
kept), written after every contender. `--budget-s N`: the parts in the order alone,
capacity, B2, convert, run, small, cpu, each skipped ("skipped: budget", under `skipped`)
where its estimate (the H100's figures below) would end after N seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.gpu.lengths import SHORTEST
from bench.gpu.run import (
    Bench,
    Result,
    gpu_name,
    log,
    merged,
    round_order,
    server,
    version,
    warm_up,
    write_json,
)
from bench.loadgen import send_all
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.server.layout_engine import cpu_layout_plan
from testkit.documents import make_layout_pdf
from testkit.runner import ocrvl_env

PAGE_TOKENS = 500  # a page's answer, median (bench.gpu.lengths.DEFAULT)
BLOCK_SIGMA = 0.9  # the spread of a block's answer length, as a page's (bench.gpu.lengths)
LENGTH_SEED = 17
# Where nothing listens: the pipeline is built with a server URL, but the block capture and
# the layout model alone never send a request.
NO_SERVER = "http://127.0.0.1:9/v1"
CONTENDERS = ("capacity", "b2", "convert", "run")
# testkit's opt-in hook that gives PaddleX's transformers engine the stand-in's ink rows (inert
# for any other model): on every child's PYTHONPATH where the checkout has it.
STANDIN_SITE = Path(__file__).resolve().parents[2] / "testkit" / "layout_standin_site"
LAYOUT_SPEED = Path(__file__).resolve().parents[1] / "layout_speed.py"
# Each layout-alone measurement is bounded: at most this many pages (of the book's, dealt to
# the processes) and, in each process, this many seconds of detection (its set-up apart).
ALONE_MAX_PAGES = 64
ALONE_MAX_S = 20.0
CPU_PAGES_PER_WORKER = 16
# --budget-s estimates, from the H100 run of 2026-12-05 (64-page book, transformers on
# gpu:0): vLLM start 133 s, blocks capture 29 s, capacity 22 s, B2 40 s, run 44 s, convert
# 46 s, 10 small documents 2 min; the layout model alone, one process, measured by hand:
# GPU 13.3 pages/s (batch 1), CPU at 16 threads 0.90 pages/s (batch 1).
START_S = 145.0  # vLLM's start and the warm-up
CAPTURE_S_PER_PAGE = 29.0 / 64
CONTENDER_S_PER_PAGE = {"capacity": 22.0 / 64, "b2": 40.0 / 64, "convert": 46.0 / 64,
                        "run": 44.0 / 64}  # fmt: skip
CONTENDER_OVERHEAD_S = 5.0  # the idle wait, the samplers
SMALL_S_PER_DOC = 12.0  # two-page documents alone, then under a book (2 min for 10)
ALONE_SETUP_S = 30.0  # processes started, the pipeline built, the model warmed on a page
LAYOUT_GPU_PAGES_PER_S = 13.3
# ocrvl convert with the layout model on 16 cores (1.17 measured on the H100 machine on a
# 12-page book, which filling and draining the pipeline dominated; a longer book does better);
# fewer cores: in proportion
LAYOUT_CPU_PAGES_PER_S_16 = 2.4
CONVERT_SETUP_S = 20.0  # ocrvl convert's start and its engine worker's
LAYOUT_SPEED_S = 40.0  # the bench.layout_speed cross-check
SKIPPED = "skipped: budget"
# Each figure of record under `layout_on`: the contender whose median run it is.
FIGURES = {"capacity_pages_per_s": "capacity", "b2_pages_per_s": "B2",
           "ocrvl_convert_pages_per_s": "ocrvl convert", "ocrvl_run_pages_per_s": "ocrvl run"}


# --- what runs in the subprocesses (the pipeline, the layout model) ----------------------


def layout_config(settings: dict[str, Any]) -> Config:
    """ocrvl's configuration with these `pipeline` settings (layout detection on)."""
    return Config.model_validate({"pipeline": {"use_layout_detection": True, **settings}})


def build_pipeline(config: Config, url: str) -> Any:
    """ocrvl's PaddleOCR-VL pipeline for `config`, built as its engine worker builds it."""
    from ocrvl_daemon.engine.worker_settings import pipeline_kwargs
    from ocrvl_daemon.worker.paddlex_import import import_paddleocr_vl

    return import_paddleocr_vl()(**pipeline_kwargs(config, url))


def render(config: Config, pdf: Path, pages: list[int]) -> list[Any]:
    """`pages` of `pdf` as ocrvl's worker renders them (BGR arrays)."""
    from ocrvl_daemon.files.pdf import render_page

    p = config.pipeline
    return [render_page(pdf, i, p.render_scale, p.page_pixel_limit) for i in pages]


def capture_blocks(config: Config, pdf: Path, pages: int, out: Path) -> dict[str, Any]:
    """Every chat request ocrvl's pipeline makes for the first `pages` pages of `pdf`, caught
    instead of sent, one JSON line each ({"page", "body"}) into `out`: the blocks cut,
    encoded and asked for by PaddleX itself, each body as ocrvl's worker streams it."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from ocrvl_daemon.worker.streaming import request_body

    pipeline = build_pipeline(config, NO_SERVER)
    caught: list[dict[str, Any]] = []
    answer = SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content="x"))])

    def catch(messages: Any, *, return_future: bool = False, **kwargs: Any) -> Any:
        caught.append(request_body(config.model.served, messages, kwargs))
        done: Future[Any] = Future()
        done.set_result(answer)
        return done if return_future else answer

    pipeline.paddlex_pipeline.vl_rec_model.genai_client.create_chat_completion = catch
    labels: Counter[str] = Counter()
    started = time.perf_counter()
    with out.open("w", encoding="utf-8") as f:
        for page in range(pages):
            (image,) = render(config, pdf, [page])
            (res,) = pipeline.predict(image, max_new_tokens=config.model.effective_max_new_tokens)
            labels.update(str(b["label"]) for b in res["layout_det_res"]["boxes"])
            for body in caught:
                f.write(json.dumps({"page": page, "body": body}) + "\n")
            caught.clear()
    requests = sum(1 for _ in out.open(encoding="utf-8"))
    return {"pages": pages, "requests": requests, "requests_per_page": requests / pages,
            "blocks_per_page": sum(labels.values()) / pages, "labels": dict(labels),
            "seconds": round(time.perf_counter() - started, 2)}  # fmt: skip


def detect_within(detect: Any, images: list[Any], seconds: float) -> tuple[float, float, int, int]:
    """`detect` on each image in turn until they are done or `seconds` have passed (the page
    under way is finished): (start, end, pages, blocks)."""
    start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
    done = blocks = 0
    for image in images:
        blocks += detect(image)
        done += 1
        if time.monotonic() - start >= seconds:
            break
    return start, time.monotonic(), done, blocks


def layout_alone_process(config: Config, pdf: Path, pages: list[int], ready: Path,
                         go: Path, seconds: float = ALONE_MAX_S) -> dict[str, Any]:
    """One process of the layout model alone: built as the pipeline builds it, warmed on one
    page, then (once `go` exists) called on each page as the pipeline calls it, for at most
    `seconds`."""
    from ocrvl_daemon.worker.pipeline import inner_pipeline

    model = inner_pipeline(build_pipeline(config, NO_SERVER)).layout_det_model
    images = render(config, pdf, pages)

    def detect(image: Any) -> int:
        # the arguments of PaddleX's own call (PaddleOCRVL.predict's _process_cv), defaults
        (found,) = model([image], threshold=None, layout_nms=None, layout_unclip_ratio=None,
                         layout_merge_bboxes_mode=None, layout_shape_mode="auto",
                         filter_overlap_boxes=False)  # fmt: skip
        return len(found["boxes"])

    detect(images[0])  # the engine's first call pays for its set-up
    ready.touch()
    deadline = time.monotonic() + 900
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    start, end, done, blocks = detect_within(detect, images, seconds)
    return {"start": start, "end": end, "pages": done, "blocks": blocks}


def _child_main(argv: list[str]) -> int:
    """`python -m bench.gpu.layout_on capture|alone SETTINGS_JSON PDF ...` (the subprocesses)."""
    what, settings, pdf = argv[0], json.loads(argv[1]), Path(argv[2])
    config = layout_config(settings)
    if what == "capture":
        out = capture_blocks(config, pdf, int(argv[3]), Path(argv[4]))
    else:
        pages = [int(p) for p in argv[3].split(",")]
        seconds = float(argv[6]) if len(argv) > 6 else ALONE_MAX_S
        out = layout_alone_process(config, pdf, pages, Path(argv[4]), Path(argv[5]), seconds)
    print(json.dumps(out), flush=True)
    return 0


# --- run from the benchmark ---------------------------------------------------------------


def child(args: list[str], log_path: Path, cpus: set[int] | None = None) -> subprocess.Popen[str]:
    """`python -m bench.gpu.layout_on ARGS` with this checkout first on the path, its stderr
    into `log_path`, held to `cpus` if given."""
    from bench.run import pinned

    log_path.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "bench.gpu.layout_on", *args],
                            env=ocrvl_env(), stdout=subprocess.PIPE,
                            stderr=log_path.open("w", encoding="utf-8"), text=True,
                            preexec_fn=pinned(cpus))  # fmt: skip


def last_json(proc: subprocess.Popen[str], log_path: Path, timeout: float) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0 or not out.strip():
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise RuntimeError(f"{log_path.stem} failed ({proc.returncode}):\n{tail}")
    return dict(json.loads(out.strip().splitlines()[-1]))


def block_lengths(requests_per_page: float, page_tokens: int) -> str:
    """MEDIAN:SIGMA:SEED of a block's answer: a page's median answer shared by its blocks."""
    median = max(SHORTEST, round(page_tokens / max(requests_per_page, 1.0)))
    return f"{median}:{BLOCK_SIGMA:g}:{LENGTH_SEED}"


def shares(pages: int, workers: int) -> list[list[int]]:
    """Pages 0..pages-1 dealt round-robin to `workers` (none left empty)."""
    return [list(range(k, pages, workers)) for k in range(min(workers, pages))]


def cores_for(spec: str, available: list[int]) -> list[tuple[str, list[int]]]:
    """(label, cores) per entry of --layout-cores ("4,8,all"): the machine's last N cores (the
    first ones are where the kernel and most else start), counts above the machine's left
    out."""
    out: list[tuple[str, list[int]]] = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        n = len(available) if item == "all" else int(item)
        if n > len(available):
            log(f"cpu: {n} cores asked for, the machine has {len(available)}: skipped")
            continue
        label = "all" if item == "all" else str(n)
        if all(n != len(c) for _, c in out):
            out.append((label, available[-n:]))
    return out


def layout_alone(settings: dict[str, Any], workers: int, pdf: Path, pages: int, work: Path,
                 log_dir: Path, name: str, cpus: set[int] | None = None,
                 seconds: float = ALONE_MAX_S) -> dict[str, Any]:  # fmt: skip
    """The layout model alone in `workers` processes at once (as ocrvl runs it), each on its
    share of the pages (at most ALONE_MAX_PAGES in all) for at most `seconds`: pages/s from
    the first one's start to the last one's end."""
    pages = min(pages, ALONE_MAX_PAGES)
    folder = work / f"alone-{name}"
    folder.mkdir(parents=True)
    go = folder / "go"
    procs = []
    for k, share in enumerate(shares(pages, workers)):
        procs.append((child(["alone", json.dumps(settings), str(pdf), ",".join(map(str, share)),
                             str(folder / f"ready{k}"), str(go), str(seconds)],
                            log_dir / f"alone-{name}.{k}.log", cpus), k))  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while sum((folder / f"ready{k}").exists() for _, k in procs) < len(procs):
            if any(p.poll() is not None for p, _ in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        go.touch()
        # a page that takes long is finished after `seconds`: room for a few more
        end = time.monotonic() + seconds + 120
        each = [last_json(p, log_dir / f"alone-{name}.{k}.log", max(1.0, end - time.monotonic()))
                for p, k in procs]  # fmt: skip
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bound = seconds
    seconds = max(e["end"] for e in each) - min(e["start"] for e in each)
    done = sum(e["pages"] for e in each)
    return {"workers": len(each), "pages": done, "seconds": round(seconds, 2),
            "bound_s": bound, "pages_given": pages,
            "pages_per_s": round(done / seconds, 3),
            "blocks_per_page": round(sum(e["blocks"] for e in each) / done, 2),
            "each_pages_per_s": [round(e["pages"] / (e["end"] - e["start"]), 3)
                                 for e in each]}  # fmt: skip


def use_layout_cache(cache: Path | None) -> Path | None:
    """`cache` (resolved) as PADDLE_PDX_CACHE_HOME for this process and every child, and the
    stand-in hook on their path: where ocrvl's workers, B2 and the block capture find the
    layout model. Returns the resolved cache."""
    if cache is not None:
        cache = cache.resolve()
        os.environ["PADDLE_PDX_CACHE_HOME"] = str(cache)
    use_stand_in_hook()
    return cache


def layout_fields(settings: dict[str, Any]) -> dict[str, Any]:
    """What a layout-on result records of `settings` (layout_engine, layout_device): ocrvl's
    choice for them (engine, device, workers) and B2's constructor arguments for the same."""
    from ocrvl_daemon.server.placement import layout_choice

    choice = layout_choice(layout_config(settings))
    return {"layout_engine": choice.engine, "layout_device": choice.device,
            "layout_choice": choice.describe(), "layout_workers": choice.workers,
            "b2_kwargs": {"use_layout_detection": True, **choice.common_args()}}  # fmt: skip


def caught_blocks(settings: dict[str, Any], book: Path, pages: int, bodies: Path,
                  log_dir: Path, timeout: float = 1800) -> dict[str, Any]:  # fmt: skip
    """`capture_blocks` in a child (`python -m bench.gpu.layout_on capture`, its log
    LOG_DIR/blocks.log): the first `pages` pages' block requests into `bodies`; returns its
    summary (requests_per_page, blocks_per_page, labels, seconds)."""
    log_path = log_dir / "blocks.log"
    return last_json(child(["capture", json.dumps(settings), str(book), str(pages),
                            str(bodies)], log_path), log_path, timeout)  # fmt: skip


def use_stand_in_hook() -> None:
    """Put STANDIN_SITE on the PYTHONPATH every child of this process inherits (ocrvl, its
    workers, B2, the layout model alone), where the checkout has it."""
    if STANDIN_SITE.is_dir():
        rest = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(STANDIN_SITE), rest]))


def layout_speed(cache: Path | None, engine: str, device: str, threads: int | None,
                 pages: int, timeout: float = 600) -> list[dict[str, Any]]:
    """bench.layout_speed's one-process figure for the same engine and device (a cross-check
    of `layout_alone`), where its command line has --devices; [] where it cannot tell."""
    source = LAYOUT_SPEED.read_text(encoding="utf-8") if LAYOUT_SPEED.exists() else ""
    if cache is None or '"--devices"' not in source:
        return []
    done = subprocess.run(
        [sys.executable, "-m", "bench.layout_speed", "--cache", str(cache), "--engines", engine,
         "--devices", device, "--threads", str(threads or 1), "--batches", "1",
         "--pages", str(pages), "--book-pages", "0"], env=ocrvl_env(), capture_output=True,
        text=True, timeout=timeout, check=False)  # fmt: skip
    rows = []
    for line in done.stdout.splitlines():
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line))
    if done.returncode != 0 and not rows:
        rows.append({"error": done.stderr.strip()[-300:]})
    return rows


def capacity(bench: Bench, bodies: list[dict[str, Any]]) -> Result:
    """The block requests, `bench.concurrency` always in flight, nothing else to do."""
    def run() -> tuple[float, float, int]:
        t0 = time.monotonic()
        seconds = asyncio.run(send_all(bench.url, bodies, bench.concurrency))
        return t0, t0 + seconds, bench.pages

    return bench.measure("capacity", f"{len(bodies)} blocks, {bench.concurrency} always in "
                         "flight", run)  # fmt: skip


# --- results --------------------------------------------------------------------------------


def contender_detail(bench: Bench) -> dict[str, Any]:
    return {n: {"pages_per_s": round(r.pages_per_s, 3), "seconds": round(r.seconds, 2),
                "what": r.what, "timeline": r.timeline, "preemptions": r.preemptions,
                "rounds_pages_per_s": [round(x.pages_per_s, 3) for x in bench.rounds[n]],
                "extra": r.extra}
            for n, r in bench.results.items()}  # fmt: skip


def summarise(res: dict[str, Any]) -> dict[str, Any]:
    """The figures of record and the targets' ratios from what `res` holds so far."""
    r = res.get("results", {})

    def pps(name: str) -> float | None:
        return r[name]["pages_per_s"] if name in r else None

    out: dict[str, Any] = {key: pps(name) for key, name in FIGURES.items()}
    alone = (res.get("alone") or {}).get("pages_per_s")
    out["layout_alone_pages_per_s"] = alone
    small = res.get("small") or {}
    out["small_doc_median_x"] = round(small["median_x"], 3) if small else None
    out["small_doc_worst_x"] = round(small["worst_x"], 3) if small else None
    conv, b2, cap = (out["ocrvl_convert_pages_per_s"], out["b2_pages_per_s"],
                     out["capacity_pages_per_s"])  # fmt: skip
    ceiling = min((x for x in (alone, cap) if x), default=None)
    out["convert_vs_b2"] = round(conv / b2, 3) if conv and b2 else None
    out["convert_vs_ceiling"] = round(conv / ceiling, 3) if conv and ceiling else None
    out["ceiling"] = ("layout alone" if ceiling == alone else "capacity") if ceiling else None
    return out


def targets(s: dict[str, Any]) -> list[tuple[str, bool | None, str]]:
    def row(name: str, value: float | None, ok: bool, fmt: str) -> tuple[str, bool | None, str]:
        return (name, None if value is None else ok,
                "not run" if value is None else format(value, fmt))  # fmt: skip

    vs_b2, vs_ceiling, small = s.get("convert_vs_b2"), s.get("convert_vs_ceiling"), \
        s.get("small_doc_median_x")  # fmt: skip
    return [
        row("ocrvl convert >= 1.3x B2", vs_b2, (vs_b2 or 0) >= 1.3, ".2f"),
        row(f"ocrvl convert >= 90% of min(layout alone, capacity) ({s.get('ceiling')})",
            vs_ceiling, (vs_ceiling or 0) >= 0.9, ".0%"),
        row("small documents under a book <= 2x solo (median)", small, (small or 99) <= 2,
            ".2f"),
    ]  # fmt: skip


def write(res: dict[str, Any], bench: Bench | None, path: Path, kept: dict[str, Any]) -> None:
    """Fold what was measured into `res` and write it under `layout_on` in `path` (the rest
    of the file kept); `kept`: the earlier `layout_on` entries that --merge keeps."""
    if bench is not None:
        res["results"] = {**kept.get("results", {}), **contender_detail(bench)}
    for key in ("alone", "small", "cpu"):
        if key not in res and key in kept:
            res[key] = kept[key]
    res.update(summarise(res))
    res["targets"] = [[n, ok, d] for n, ok, d in targets(res)]
    write_json(path, merged(path, {"layout_on": res}))


def report(res: dict[str, Any]) -> str:
    lines = [
        f"- date: {res['date']}; GPU: {res['gpu']}; vLLM: {res.get('vllm')}",
        f"- layout: {res['layout_choice']} (engine {res['layout_engine']}, device "
        f"{res['layout_device']}); B2 gets {res['b2_kwargs']}",
        f"- book: {res['pages']} make_layout_pdf pages; {res.get('blocks_per_page')} layout "
        f"blocks a page, {res.get('requests_per_page')} sent ({res.get('prompts')})",
        f"- answers: {res.get('answer_lengths_note')}", "",
        "| contender | pages/s | s | GPU busy | preemptions | requests running |",
        "|---|---:|---:|---:|---:|---|",
    ]  # fmt: skip
    for name, r in res.get("results", {}).items():
        busy = r["extra"].get("gpu_busy_pct")
        running = " ".join("." if x is None else str(x) for x in r["timeline"])
        lines.append(f"| {name} ({r['what']}) | {r['pages_per_s']:.2f} | {r['seconds']:.1f} "
                     f"| {'-' if busy is None else f'{busy:.0f}%'} | {r['preemptions']} "
                     f"| {running} |")  # fmt: skip
    if res.get("alone"):
        a = res["alone"]
        lines.append(f"| layout alone ({a['workers']} processes, {res['layout_device']}) "
                     f"| {a['pages_per_s']:.2f} | {a['seconds']:.1f} | - | - | "
                     f"each {a['each_pages_per_s']} |")  # fmt: skip
    lines.append("")
    for label, c in (res.get("cpu") or {}).items():
        lines.append(f"- layout on the CPU, {label} cores ({c.get('layout')}): alone "
                     f"{c['alone']['pages_per_s']:.2f} pages/s ({c['alone']['workers']} "
                     f"processes); ocrvl convert {c.get('ocrvl_convert_pages_per_s', 0):.2f} "
                     f"pages/s ({c.get('convert_vs_alone', 0):.0%} of alone)"
                     + (f", steady {c['steady_pages_per_s']:.2f} ({c['steady_vs_alone']:.0%})"
                        if "steady_pages_per_s" in c else ""))  # fmt: skip
    if res.get("small"):
        sm = res["small"]
        lines.append(f"- {sm['count']} two-page documents under the book: median "
                     f"{sm['median_x']:.2f}x their solo time, worst {sm['worst_x']:.2f}x")
    for part, why in (res.get("skipped") or {}).items():
        lines.append(f"- {part}: {why}")
    lines += ["", "Targets:", ""]
    for name, ok, detail in res["targets"]:
        mark = "x" if ok else " "
        lines.append(f"- [{mark}] {name}: {detail}" + (" (not met)" if ok is False else ""))
    return "\n".join(lines) + "\n"


# --- the budget ------------------------------------------------------------------------------

# The parts in the order they run under --budget-s, most important first: the layout model
# alone needs no server (it runs before vLLM starts), then the contenders, the small
# documents, and the CPU sweep last.
ORDER = ("alone", "capacity", "b2", "convert", "run", "small", "cpu")
SERVER_PARTS = ORDER[1:]


class Budget:
    """Seconds from its start; `fits(cost)`: something estimated at `cost` s ends within
    them (always, without a budget)."""

    def __init__(self, seconds: float | None, clock: Any = time.monotonic) -> None:
        self.seconds, self.clock = seconds, clock
        self.t0 = clock()

    def elapsed(self) -> float:
        return float(self.clock() - self.t0)

    def fits(self, cost_s: float) -> bool:
        return self.seconds is None or self.elapsed() + cost_s <= self.seconds


def layout_pages_per_s(device: str, cores: int) -> float:
    """One process of the layout model, batch 1 (the H100 figures; the CPU's in proportion
    to its cores, up to the 16 measured)."""
    if device.startswith("gpu"):
        return LAYOUT_GPU_PAGES_PER_S
    return LAYOUT_CPU_PAGES_PER_S_16 * max(1, min(cores, 16)) / 16


def alone_s(device: str, pages: int, cores: int, seconds: float = ALONE_MAX_S) -> float:
    """The estimate of one layout-alone measurement (bounded in pages and seconds)."""
    pages = min(pages, ALONE_MAX_PAGES)
    return ALONE_SETUP_S + min(seconds, pages / layout_pages_per_s(device, cores)) + 5


def contender_s(name: str, pages: int) -> float:
    return CONTENDER_OVERHEAD_S + pages * CONTENDER_S_PER_PAGE[name]


def cpu_book_pages(pages: int, workers: int) -> int:
    """The CPU sweep's book: `pages` (--cpu-pages), and CPU_PAGES_PER_WORKER for each worker
    at least: a book of 8 pages a worker was over before the pipeline was full (48 pages on
    16 cores: convert 40% of alone, 2026-12-06)."""
    return max(pages, CPU_PAGES_PER_WORKER * workers)


def cpu_s(cores: int, pages: int) -> float:
    """One core count of the CPU sweep: the layout model alone, then ocrvl convert."""
    return (alone_s("cpu", pages, cores) + CONVERT_SETUP_S
            + pages / layout_pages_per_s("cpu", cores))  # fmt: skip


def server_s(pages: int) -> float:
    """The blocks caught, then vLLM started and warmed up."""
    return CAPTURE_S_PER_PAGE * pages + START_S


def estimates(parts: set[str], device: str, pages: int, rounds: int, small: int, cpu_pages: int,
              cpu_cores: list[int], cores: int) -> list[tuple[str, float]]:  # fmt: skip
    """(part, estimated seconds) of each part asked for, in the order they run; the CPU
    sweep as `cpu N` per core count."""
    out: list[tuple[str, float]] = []
    for part in ORDER:
        if part not in parts:
            continue
        if part == "alone":
            out.append((part, alone_s(device, pages, cores)))
        elif part in CONTENDER_S_PER_PAGE:
            out.append((part, rounds * contender_s(part, pages)))
        elif part == "small":
            out.append((part, SMALL_S_PER_DOC * small))
        else:
            out += [(f"cpu {n}", cpu_s(n, cpu_book_pages(cpu_pages, cpu_layout_plan(n, None)[0])))
                    for n in cpu_cores]  # fmt: skip
    return out


# --- the run ----------------------------------------------------------------------------------


class LayoutRun:
    """One `bench.gpu --layout` run: its results, the budget, what was skipped."""

    def __init__(self, args: argparse.Namespace, res: dict[str, Any], kept: dict[str, Any],
                 budget: Budget) -> None:  # fmt: skip
        self.args, self.res, self.kept, self.budget = args, res, kept, budget
        self.bench: Bench | None = None
        res["budget_s"] = args.budget_s
        res.setdefault("skipped", {})

    def fits(self, part: str, cost_s: float) -> bool:
        """Whether `part` (estimated at `cost_s`) fits what is left; if not, it is recorded
        as skipped."""
        if self.budget.fits(cost_s):
            return True
        self.skip(part, cost_s)
        return False

    def skip(self, part: str, cost_s: float) -> None:
        seconds = self.budget.seconds
        left = "-" if seconds is None else f"{seconds - self.budget.elapsed():.0f}"
        log(f"{part}: {SKIPPED} (estimate {cost_s:.0f} s, {left} s left)")
        self.res["skipped"][part] = SKIPPED
        self.write()

    def write(self) -> None:
        write(self.res, self.bench, self.args.results, self.kept)


def run_layout_on(args: argparse.Namespace) -> int:
    """`python -m bench.gpu --layout ...` (see the module's docstring)."""
    from ocrvl_daemon.server.placement import layout_choice

    parts = set(args.only.split(","))
    args.layout_cache = use_layout_cache(args.layout_cache)
    budget = Budget(getattr(args, "budget_s", None))
    args.budget_s = budget.seconds
    work = Path(tempfile.mkdtemp(prefix="ocrvl-gpubench-layout-"))
    args.log_dir = args.log_dir or work
    args.log_dir.mkdir(parents=True, exist_ok=True)
    log(f"work directory {work}")
    settings = {"layout_engine": args.layout_engine, "layout_device": args.layout_device}
    choice = layout_choice(layout_config(settings))
    log(f"layout: {choice.describe()}, {choice.workers} worker(s) ({choice.why})")
    kept: dict[str, Any] = {}
    if args.merge:
        with contextlib.suppress(OSError, ValueError):
            kept = json.loads(args.results.read_text(encoding="utf-8")).get("layout_on") or {}
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "gpu": gpu_name(), "pages": args.pages,
        "concurrency": args.concurrency, "python": platform.python_version(),
        **layout_fields(settings), "cpus": len(os.sched_getaffinity(0)),
    }  # fmt: skip
    run = LayoutRun(args, res, kept, budget)
    cores = len(os.sched_getaffinity(0))
    sweep = cores_for(args.layout_cores, sorted(os.sched_getaffinity(0))) if "cpu" in parts \
        else []  # fmt: skip
    plan = estimates(parts, choice.device, args.pages, args.rounds, args.small, args.cpu_pages,
                     [len(c) for _, c in sweep], cores)  # fmt: skip
    res["estimates_s"] = {part: round(cost) for part, cost in plan}
    if budget.seconds is not None:
        log(f"budget {budget.seconds:.0f} s; estimates: "
            + ", ".join(f"{p} {c:.0f} s" for p, c in plan) + f"; vLLM {server_s(args.pages):.0f} s")
    try:
        book = make_layout_pdf(work / "book.pdf", args.pages, seed=1)
        if "alone" in parts and run.fits("alone", dict(plan)["alone"]):
            # before vLLM starts (it needs no server): the workers ocrvl would run now
            log(f"layout alone: {choice.workers} process(es), {choice.describe()}")
            res["alone"] = layout_alone(settings, choice.workers, book, args.pages, work,
                                        args.log_dir, "main")  # fmt: skip
            if budget.fits(LAYOUT_SPEED_S):
                with contextlib.suppress(subprocess.SubprocessError, OSError):
                    res["alone"]["layout_speed"] = layout_speed(
                        args.layout_cache, choice.engine, choice.device, choice.threads,
                        min(args.pages, 16), timeout=2 * LAYOUT_SPEED_S)  # fmt: skip
            log(f"layout alone: {res['alone']}")
            run.write()
        served = [(p, c) for p, c in plan if p.split()[0] in SERVER_PARTS]
        if served and not budget.fits(server_s(args.pages) + served[0][1]):
            for part, cost in served:
                run.skip(part, server_s(args.pages) + cost)
        elif served:
            with_server(run, book, work, settings, plan, sweep)
        print(report(res))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def with_server(run: LayoutRun, book: Path, work: Path, settings: dict[str, Any],
                plan: list[tuple[str, float]], sweep: list[tuple[str, list[int]]]) -> None:
    """The blocks caught, then vLLM and every part that needs it, in order, within budget."""
    args, res, parts = run.args, run.res, {p.split()[0] for p, _ in plan}
    log("blocks: ocrvl's pipeline on every page, its requests caught (untimed)")
    bodies_path = work / "blocks.jsonl"
    blocks = caught_blocks(settings, book, args.pages, bodies_path, args.log_dir)
    bodies = [json.loads(line)["body"] for line in bodies_path.open(encoding="utf-8")]
    prompts = Counter(b["messages"][0]["content"][1]["text"] for b in bodies)
    res.update(blocks_per_page=round(blocks["blocks_per_page"], 2),
               requests_per_page=round(blocks["requests_per_page"], 2),
               labels=blocks["labels"], prompts=dict(prompts),
               capture_s=blocks["seconds"])  # fmt: skip
    log(f"blocks: {blocks['blocks_per_page']:.1f} a page, {blocks['requests_per_page']:.1f} "
        f"sent ({dict(prompts)}) in {blocks['seconds']:.0f} s")  # fmt: skip
    if args.answer_lengths is None:  # random weights: a page's answer shared by its blocks
        args.answer_lengths = block_lengths(blocks["requests_per_page"], args.page_tokens)
    res["answer_lengths"] = args.answer_lengths
    res["answer_lengths_note"] = (
        "the server's own" if args.answer_lengths == "model" else
        f"random weights; each block's answer ends at lognormal {args.answer_lengths} "
        f"(median:sigma:seed) tokens, the median {args.page_tokens} tokens a page / "
        f"{blocks['requests_per_page']:.1f} blocks sent a page")  # fmt: skip
    with server(args, work) as url:
        res["vllm"] = version(url)
        res["server"] = args.server_url or (args.model_dir or args.model)
        warm_up([url], work)
        bench = Bench(url, work, book, args.pages, args.concurrency, log_dir=args.log_dir)
        run.bench = bench
        bench.layout = {"use_layout_detection": True, **settings}
        bench.b2_kwargs = res["b2_kwargs"]
        bench.small_doc = lambda path, seed: make_layout_pdf(path, 2, seed=seed)
        # A page's blocks go out together once its layout is done: with the layout model
        # on the CPU a book may never have 16 running, yet be well under way.
        bench.under_way = 0
        try:
            run_contenders(run, parts, bench, bodies)
            if "small" in parts and run.fits("small", dict(plan)["small"]):
                res["small"] = bench.small_documents(args.small, args.gap)
                run.write()
            if "cpu" in parts:
                cpu_sweep(run, bench, book, work, sweep)
        finally:
            bench.metrics.stop()
            run.write()


def run_contenders(run: LayoutRun, parts: set[str], bench: Bench,
                   bodies: list[dict[str, Any]]) -> None:  # fmt: skip
    """capacity, B2, convert, run in that order (later rounds: round_order's), each only
    where its estimate fits the budget."""
    args, res = run.args, run.res
    contenders = {"capacity": lambda: capacity(bench, bodies), "b2": bench.b2,
                  "convert": bench.convert, "run": bench.run_daemon}  # fmt: skip
    chosen = [c for c in CONTENDERS if c in parts]
    res["rounds"], res["round_orders"] = 0, []
    for done in range(1, args.rounds + 1):
        order = chosen if done == 1 else round_order(chosen, done)
        res["round_orders"].append(order)
        for contender in order:
            if run.fits(contender, contender_s(contender, args.pages)):
                contenders[contender]()
                run.write()
        res["rounds"] = done


def cpu_sweep(run: LayoutRun, bench: Bench, book: Path, work: Path,
              sweep: list[tuple[str, list[int]]]) -> None:  # fmt: skip
    """The layout model on the CPU, ocrvl held to each core count: alone, then convert."""
    from ocrvl_daemon.server.placement import layout_choice

    args, res = run.args, run.res
    settings = {"layout_engine": args.layout_engine, "layout_device": "cpu"}
    res["cpu"] = {}
    for label, cores in sweep:
        cpus = set(cores)
        choice = layout_choice(layout_config(settings), cores=len(cpus))
        pages = cpu_book_pages(args.cpu_pages, choice.workers)
        if not run.fits(f"cpu {len(cpus)}", cpu_s(len(cpus), pages)):
            continue
        short = make_layout_pdf(work / f"cpu-book-{pages}.pdf", pages, seed=1)
        log(f"cpu {label}: {choice.describe()}, {choice.workers} worker(s)")
        entry: dict[str, Any] = {"cores": len(cpus), "layout": choice.describe(),
                                 "workers": choice.workers, "pages": pages}  # fmt: skip
        res["cpu"][label] = entry
        entry["alone"] = layout_alone(settings, choice.workers, short, pages, work,
                                      args.log_dir, f"cpu{label}", cpus)  # fmt: skip
        log(f"cpu {label}: layout alone {entry['alone']}")
        run.write()
        r = bench.convert(f"ocrvl convert, layout on {len(cpus)} cores", cpus=cpus, book=short,
                          pipeline={"use_layout_detection": True, **settings})  # fmt: skip
        entry["ocrvl_convert_pages_per_s"] = round(r.pages_per_s, 3)
        entry["convert_vs_alone"] = round(r.pages_per_s / entry["alone"]["pages_per_s"], 3)
        steady = r.extra.get("steady_pages_per_s")
        if steady is not None:
            entry["steady_pages_per_s"] = round(steady, 3)
            entry["steady_vs_alone"] = round(steady / entry["alone"]["pages_per_s"], 3)
        entry["convert_layout_line"] = r.extra.get("layout")
        run.write()


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))

"""The whole GPU (issue 37): which settings make one large GPU serve the most pages.

    python -m bench.gpu.big_gpu --model-dir DIR [--vllm-python P --vllm-pythonpath SITE]
        [--settings mps-x4,x2,x2-sync] [--pages 128] [--budget-s 540] [--merge]
    python -m bench.gpu.big_gpu --model-dir DIR --layout --layout-engine transformers \
        --layout-device gpu:0 --layout-cache CACHE --settings mps-x4,mps-x2 --pages 64
    python -m bench.gpu.big_gpu --fake --settings x1,x2 --pages 8      # the dry run (no GPU)
    python -m bench.gpu.big_gpu --list                                 # the settings known

One setting at a time, on the same book, layout detection off: `ocrvl convert` with
`server: {mode: external, urls: [...]}` over replicas that an `ocrvl run` daemon manages
(bench.gpu.replicas' ReplicaDaemon, ocrvl's own `auto` plan), timed from the engine worker's
ready line, the GPU's busy share and power sampled meanwhile (bench.gpu.run's Bench). A vLLM
start takes 60-125 s on an H200, so settings that differ only in how many replicas they use
share one start: the settings with the same server options (MPS or not, vLLM flags) run
on one daemon that starts as many replicas as the largest of them needs, each using the first
N (an idle vLLM costs the others nothing; each has a 1/M share of the memory instead of
1/N, which on a large card still leaves a KV cache far beyond 64 pages in flight). B2 (one
warm PaddleX `predict`) runs once, on the first replica of the first daemon, as the baseline.

Settings (`--list`): replicas 1-4 without and with MPS (`server.mps: off` / `on`); vLLM
flags per replica (`--no-async-scheduling`, as vLLM 0.26 schedules asynchronously by
default; `--max-num-batched-tokens 8192`, fewer CUDA graph sizes, `--api-server-count 2`);
the image ocrvl sends (`pipeline.max_page_pixels`: a smaller image is fewer image tokens,
but the model sees less and, with random weights, the answer lengths drawn from the prompt
length change: such rows carry `changes_input`). JPEG quality is not a setting (the worker's
92). Writes `--results` (default bench/gpu/big_gpu.json) after every setting; `--budget-s`
starts no daemon or setting that its estimate says would not end in time. Prints a table and
the `autotune.REPLICA_RULES` row the winners make for this card. `--layout` (issue 35): the
same grid with layout detection on for B2 and every ocrvl convert, as bench.gpu.layout_on
measures it on one server (its helpers, not copies): a `make_layout_pdf` book; before any
daemon starts, ocrvl's own pipeline runs every page with its requests caught
(`caught_blocks`), and each block's answer length is a page's `--page-tokens` shared by the
blocks sent a page (`block_lengths`), set in the environment of every vLLM replica the
daemon starts (bench.gpu.lengths.ENV, read by their logits processor); B2 gets
`use_layout_detection=True` and the layout engine and device ocrvl's worker would pass
(`layout_fields`' b2_kwargs), and ocrvl convert `pipeline.use_layout_detection: true` with
`--layout-engine`/`--layout-device` (the model from `--layout-cache`, PADDLE_PDX_CACHE_HOME,
with testkit's stand-in hook on every child's path). With the layout model on the GPU, the
daemon's `gpu-memory-utilization` is ocrvl's own plan for one server with these pipeline
settings on the card as it reads then (the layout workers' memory kept; the daemon splits it
between its replicas): the daemon's own workers run layout off, the layout workers are ocrvl
convert's. Rows and the top level say `layout: true` with the engine and device, and every
row counts the requests the replicas finished (`requests_per_page`: blocks sent, with B2's
as `b2_requests_per_page`); results default to bench/gpu/big_gpu_layout.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.gpu.layout_on import (
    PAGE_TOKENS,
    block_lengths,
    caught_blocks,
    layout_fields,
    use_layout_cache,
)
from bench.gpu.lengths import ENV as LENGTHS_ENV
from bench.gpu.replicas import ReplicaDaemon, ServersFailed, gpu_memory_used_mib
from bench.gpu.run import PAGE_HEIGHT, Bench, add_layout_model_args, gpu_name, log, warm_up
from bench.gpu.teardown import stops_children
from bench.gpu.vllm_server import Metrics, model_dir_parser, version
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.server import autotune, placement
from ocrvl_daemon.server.autotune import ReplicaRule
from ocrvl_daemon.server.gpu import GpuReading, read_gpus
from ocrvl_daemon.server.layout_engine import Installed
from testkit.documents import make_layout_pdf, make_pdf

HERE = Path(__file__).resolve().parent
DEFAULT_SETTINGS = "mps-x4,x2"
DEFAULT_BUDGET_S = 540.0  # a 10-minute call, less a margin
# `ocrvl run` with N replicas on an H200 was ready in 70 s (N = 1), 88 s (2), 132 s (3)
# (bench/gpu/replicas_gpu.json): the first start, then about 35-45 s per replica more.
START_FIRST_S, START_NEXT_S = 75.0, 40.0
WARM_UP_S_PER_REPLICA = 8.0
STOP_S = 20.0  # the daemon's stop and the GPU's memory coming back
SETTING_OVERHEAD_S = 15.0  # ocrvl convert's start, the idle wait, the GPU sampler
MIN_PAGES_PER_S = 8.0  # for the estimate: B2 on that card
# Layout on, one server (bench/gpu/results.json layout_on, 64 pages): B2 2.85 pages/s on an
# H100, 2.98 on an H200, ocrvl convert 2.28 and 3.14; the blocks caught in 6-8 s.
LAYOUT_MIN_PAGES_PER_S = 2.0
CONCURRENCY = 128  # the bound of record on a data-centre card (README: "Which bound")
MPS_RUNNING = "MPS control daemon running"


@dataclass(frozen=True)
class Setting:
    """One configuration tried: how many replicas serve, under MPS or not, with which extra
    vLLM flags per replica and which `pipeline` keys for ocrvl."""

    name: str
    replicas: int
    mps: bool = False
    vllm_args: dict[str, Any] = field(default_factory=dict)
    pipeline: dict[str, Any] = field(default_factory=dict)
    changes_input: bool = False  # the model sees other images (other answer lengths too)

    @property
    def server_key(self) -> str:
        """Settings with the same key can share one started set of replicas."""
        return json.dumps({"mps": self.mps, "vllm_args": self.vllm_args}, sort_keys=True)


def _grid() -> dict[str, Setting]:
    """Every setting known, most promising first."""
    settings = [Setting(f"mps-x{n}", n, mps=True) for n in (3, 4, 2)]
    settings += [
        # vLLM 0.26 schedules asynchronously by default: these measure what that is worth.
        Setting("x2-sync", 2, vllm_args={"async-scheduling": False}),
        Setting("mps-x4-sync", 4, mps=True, vllm_args={"async-scheduling": False}),
        Setting("x2-batched-8k", 2, vllm_args={"max-num-batched-tokens": 8192}),
        Setting("x2-graphs-256", 2, vllm_args={"compilation-config": {
            "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 192, 256]}}),
        Setting("x2-api2", 2, vllm_args={"api-server-count": 2}),
        Setting("x2-pixels-600k", 2, pipeline={"max_page_pixels": 600_000},
                changes_input=True),
    ]
    settings += [Setting(f"x{n}", n) for n in (2, 3, 1, 4)]
    settings += [Setting("mps-x1", 1, mps=True)]
    return {s.name: s for s in settings}


SETTINGS = _grid()


def chosen(names: str) -> list[Setting]:
    """The settings `names` (comma-separated) lists, in its order; ValueError for unknown."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in SETTINGS]
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(unknown)}; known: "
                         f"{', '.join(SETTINGS)}")  # fmt: skip
    if not wanted:
        raise ValueError("no setting given")
    return [SETTINGS[n] for n in dict.fromkeys(wanted)]


def server_groups(settings: list[Setting]) -> list[tuple[int, list[Setting]]]:
    """The settings grouped by `server_key`, in order of first appearance, each group with the
    replicas to start (its largest count)."""
    groups: dict[str, list[Setting]] = {}
    for s in settings:
        groups.setdefault(s.server_key, []).append(s)
    return [(max(s.replicas for s in group), group) for group in groups.values()]


def start_cost_s(replicas: int) -> float:
    """The estimated seconds to start `replicas` vLLM servers one after another, warm them up
    and, at the end, stop them."""
    return (START_FIRST_S + (replicas - 1) * START_NEXT_S + replicas * WARM_UP_S_PER_REPLICA
            + STOP_S)


def setting_cost_s(pages: int, pages_per_s: float = MIN_PAGES_PER_S) -> float:
    """The estimated seconds of one setting's `ocrvl convert` of the book (or of B2's run)."""
    return SETTING_OVERHEAD_S + pages / pages_per_s


@dataclass(frozen=True)
class LayoutOn:
    """Layout detection on (`--layout`): for B2, every ocrvl convert and the replicas' answers."""

    settings: dict[str, Any]  # pipeline.layout_engine and layout_device
    b2_kwargs: dict[str, Any]  # B2's constructor arguments for the same (layout_fields)
    answer_lengths: str  # a block's answer, MEDIAN:SIGMA:SEED (block_lengths)

    @property
    def pipeline(self) -> dict[str, Any]:
        return {"use_layout_detection": True, **self.settings}


def layout_room(pipeline: dict[str, Any], gpu: GpuReading | None,
                installed: Installed | None = None) -> dict[str, Any]:  # fmt: skip
    """The vLLM flags that keep the layout workers' memory free on `gpu`: the utilization of
    ocrvl's own plan for one server with these `pipeline` settings, for the whole card (the
    daemon splits it between its replicas). {} without a reading (the dry run) or where the
    layout model does not run on that GPU."""
    if gpu is None:
        return {}
    config = Config.model_validate({"pipeline": pipeline})
    if not placement.layout_room_mib(config, gpu, installed):
        return {}
    plan = autotune.plan_vllm_args(config, gpu, installed=installed)
    return {autotune.UTILIZATION: plan.values[autotune.UTILIZATION]}


def requests_done(urls: list[str]) -> int | None:
    """The requests the servers at `urls` have finished so far (vLLM's
    `vllm:request_success`, summed); None where one does not answer or say."""
    total = 0.0
    with httpx.Client(timeout=10) as client:
        for url in urls:
            try:
                text = client.get(url + "/metrics").text
            except httpx.HTTPError:
                return None
            found = [sample.value for family in text_string_to_metric_families(text)
                     for sample in family.samples
                     if sample.name == "vllm:request_success_total"]  # fmt: skip
            if not found:
                return None
            total += sum(found)
    return round(total)


def per_page(count: int | None, pages: int) -> float | None:
    return None if count is None else round(count / pages, 2)


def fits(elapsed_s: float, budget_s: float, cost_s: float) -> bool:
    """Whether something estimated at `cost_s` ends within the budget."""
    return elapsed_s + cost_s <= budget_s


def best(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest row measured (None: none was)."""
    measured = [r for r in rows if r.get("pages_per_s")]
    return max(measured, key=lambda r: r["pages_per_s"]) if measured else None


def rule_row(rows: list[dict[str, Any]], card_mib: int | None) -> str | None:
    """The `autotune.REPLICA_RULES` row the winners make for this card: the fastest plain
    replica count and the fastest under MPS (rows with other flags or images left out)."""
    plain = [r for r in rows if r.get("pages_per_s") and not r["vllm_args"]
             and not r["pipeline"]]  # fmt: skip
    by_mps = {m: best([r for r in plain if r["mps_used"] is m]) for m in (False, True)}
    plain_best = by_mps[False]
    if card_mib is None or plain_best is None:
        return None
    mps = by_mps[True] or plain_best
    return repr(ReplicaRule(card_mib, plain_best["replicas"], mps["replicas"]))


def summary(res: dict[str, Any]) -> dict[str, Any]:
    """The top level of big_gpu.json: the figures of record, from the rows so far."""
    top = best(res["rows"])
    layout = {k: res.get(k) for k in ("layout_engine", "layout_device")} if res.get("layout") \
        else {}  # fmt: skip
    return {
        "date": res["date"], "gpu": res["gpu"], "vllm": res.get("vllm"), "pages": res["pages"],
        "layout": bool(res.get("layout")), **layout,
        "b2_pages_per_s": res.get("b2_pages_per_s"),
        "best_pages_per_s": top["pages_per_s"] if top else None,
        "best_setting": top["setting"] if top else None,
        "best_vs_b2": (round(top["pages_per_s"] / res["b2_pages_per_s"], 3)
                       if top and res.get("b2_pages_per_s") else None),
        "gpu_busy_pct": top.get("gpu_busy_pct") if top else None,
        "watts": top.get("watts") if top else None,
        "rule_row": rule_row(res["rows"], res.get("card_mib")),
    }  # fmt: skip


def write(res: dict[str, Any], path: Path) -> None:
    """big_gpu.json, whole or not at all (written after every setting)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps({**summary(res), **res}, indent=1) + "\n", encoding="utf-8")
    part.replace(path)


def report(res: dict[str, Any]) -> str:
    s = summary(res)
    lines = [f"- date: {s['date']}", f"- GPU: {s['gpu']}", f"- vLLM: {s['vllm']}",
             f"- pages: {s['pages']} (one book), bound {CONCURRENCY} in flight",
             f"- B2: {s['b2_pages_per_s'] or '-'} pages/s ({res.get('b2_on', 'not run')})"]
    if res.get("layout"):
        lines += [f"- layout detection on: {res['layout_choice']} (engine "
                  f"{res['layout_engine']}, device {res['layout_device']}); B2 gets "
                  f"{res['b2_kwargs']}",
                  f"- blocks: {res['requests_per_page']} sent a page (caught), B2 "
                  f"{_or_dash(res.get('b2_requests_per_page'))} a page at the server; "
                  f"answers {res['answer_lengths_note']}"]  # fmt: skip
    lines += ["", "| setting | replicas used / started | MPS | pages/s | vs B2 | GPU busy | W "
              "| preemptions | requests a page |",
              "|---|---:|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    b2 = s["b2_pages_per_s"]
    for r in res["rows"]:
        if not r.get("pages_per_s"):
            lines.append(f"| {r['setting']} | - | - | {r.get('skipped', 'failed')} | | | | | |")
            continue
        vs_b2 = f"{r['pages_per_s'] / b2:.2f}x" if b2 else "-"
        lines.append(
            f"| {r['setting']} | {r['replicas']} / {r['replicas_started']} "
            f"| {'yes' if r['mps_used'] else 'no'} | {r['pages_per_s']:.2f} | {vs_b2} "
            f"| {_or_dash(r.get('gpu_busy_pct'))} | {_or_dash(r.get('watts'))} "
            f"| {r['preemptions']} | {_or_dash(r.get('requests_per_page'))} |")
    lines += ["", f"- best: {s['best_setting']} at {s['best_pages_per_s']} pages/s",
              f"- REPLICA_RULES row for this card: {s['rule_row'] or '-'}"]
    return "\n".join(lines) + "\n"


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _done_since(before: int | None, urls: list[str]) -> int | None:
    after = requests_done(urls)
    return None if before is None or after is None else after - before


class Runner:
    """Runs the settings group by group, one daemon at a time, within the budget."""

    def __init__(self, args: argparse.Namespace, work: Path, book: Path,
                 res: dict[str, Any], layout: LayoutOn | None = None,
                 t0: float | None = None) -> None:  # fmt: skip
        """`layout`: layout detection on (--layout); `t0`: when the budget began (the
        blocks caught before count)."""
        self.args, self.work, self.book, self.res = args, work, book, res
        self.layout = layout
        self.pages_per_s = LAYOUT_MIN_PAGES_PER_S if layout else MIN_PAGES_PER_S
        self.t0 = time.monotonic() if t0 is None else t0
        self.gpu_baseline = None if args.fake else gpu_memory_used_mib()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def run(self, settings: list[Setting]) -> None:
        for started, group in server_groups(settings):
            first = self.cost_s() * (2 if "b2_pages_per_s" not in self.res else 1)
            if not fits(self.elapsed(), self.args.budget_s, start_cost_s(started) + first):
                self.skip(group, f"budget: {started} replica start(s) would not fit")
                continue
            done: set[str] = set()
            try:
                with self.daemon(started, group[0]) as daemon:
                    for setting in group:
                        if not fits(self.elapsed(), self.args.budget_s, self.cost_s()):
                            self.skip([setting], "budget")
                        else:
                            self.measure(setting, daemon, started)
                        done.add(setting.name)
            except ServersFailed as exc:  # ocrvl gave up on every server: on to the next
                log(f"failed: every server: {exc.last_error}")
                self.skip([s for s in group if s.name not in done],
                          f"failed: {exc.last_error[:300]}")  # fmt: skip
            except (RuntimeError, AssertionError) as exc:  # a start or a convert that failed
                log(f"failed: {exc}")
                said = [line for line in str(exc).splitlines() if line.strip()] or ["?"]
                # A log's tail ends with the error itself.
                self.skip([s for s in group if s.name not in done], f"failed: {said[-1][:300]}")

    def cost_s(self) -> float:
        """One setting's convert (or B2) of the book, by the estimate."""
        return setting_cost_s(self.args.pages, self.pages_per_s)

    def server_options(self, setting: Setting) -> dict[str, Any]:
        """The keys the daemon's `server:` section gets for `setting`: MPS, its vLLM flags;
        layout on, the block answer lengths in every replica's environment and (on a GPU)
        the utilization that keeps the layout workers' memory free."""
        # The dry run has no MPS; off where a setting has none, whatever `auto` would do.
        mps = "on" if setting.mps and not self.args.fake else "off"
        options: dict[str, Any] = {"mps": mps, "vllm_args": dict(setting.vllm_args)}
        if self.layout is not None:
            options["env"] = {LENGTHS_ENV: self.layout.answer_lengths}
            gpus = [] if self.args.fake else read_gpus()
            room = layout_room(self.layout.pipeline, gpus[0] if gpus else None)
            options["vllm_args"] = {**room, **setting.vllm_args}
        return options

    def skip(self, group: list[Setting], why: str) -> None:
        for setting in group:
            log(f"{setting.name}: skipped ({why})")
            self.res["rows"].append({"setting": setting.name, "skipped": why})
        write(self.res, self.args.results)

    @contextlib.contextmanager
    def daemon(self, replicas: int, setting: Setting) -> Iterator[ReplicaDaemon]:
        """An `ocrvl run` managing `replicas` servers with `setting`'s server options, started,
        warmed up and, however the block ends, stopped with its log kept."""
        options = self.server_options(setting)
        daemon = ReplicaDaemon(replicas, self.work / f"{setting.name}-daemon", self.args,
                               options)  # fmt: skip
        log(f"{setting.name}: starting {replicas} replica(s), server.mps {options['mps']}, "
            f"vLLM {options['vllm_args']}, env {options.get('env', {})}")
        try:
            start_s = daemon.start()
            log(f"{replicas} replica(s) ready in {start_s:.0f} s")
            self.res.setdefault("vllm", version(daemon.urls[0]))
            warm_up(daemon.urls, daemon.work)
            yield daemon
        finally:
            daemon.stop(self.gpu_baseline)
            if daemon.proc is not None:
                daemon.proc.save((self.args.log_dir or daemon.work) /
                                 f"ocrvl-run-{setting.name}-daemon.log")  # fmt: skip

    def measure(self, setting: Setting, daemon: ReplicaDaemon, started: int) -> None:
        urls = daemon.urls[:setting.replicas]
        metrics = Metrics(*urls)
        bench = Bench(urls[0], daemon.work, self.book, self.args.pages, CONCURRENCY, metrics,
                      self.args.log_dir or daemon.work)  # fmt: skip
        if self.layout is not None:  # as bench.gpu.layout_on sets its Bench
            bench.layout, bench.b2_kwargs = self.layout.pipeline, self.layout.b2_kwargs
        try:
            if "b2_pages_per_s" not in self.res:  # on urls[0], the others idle
                before = requests_done(daemon.urls)
                self.res["b2_pages_per_s"] = round(bench.b2().pages_per_s, 3)
                self.res["b2_on"] = f"replica 1 of {started} ({setting.name}'s servers)"
                self.res["b2_requests"] = _done_since(before, daemon.urls)
                self.res["b2_requests_per_page"] = per_page(self.res["b2_requests"],
                                                            self.args.pages)  # fmt: skip
            before = requests_done(urls)
            conv = bench.convert(setting.name, server={"mode": "external", "urls": urls},
                                 pipeline=setting.pipeline)  # fmt: skip
            requests = _done_since(before, urls)
        finally:
            metrics.stop()
        layout: dict[str, Any] = {"layout": self.layout is not None}
        if self.layout is not None:
            layout.update(self.layout.settings, layout_line=conv.extra.get("layout"))
        row = {
            **asdict(setting), "setting": setting.name, "replicas_started": started,
            "mps_used": bool(daemon.proc and daemon.proc.grep(MPS_RUNNING)),
            "pages_per_s": round(conv.pages_per_s, 3), "seconds": round(conv.seconds, 1),
            "gpu_busy_pct": conv.extra.get("gpu_busy_pct"), "watts": conv.extra.get("gpu_watts"),
            "preemptions": conv.preemptions, "timeline": conv.timeline,
            "vllm_settings": daemon.settings(), "elapsed_s": round(self.elapsed(), 1),
            "requests": requests, "requests_per_page": per_page(requests, self.args.pages),
            **layout,
        }  # fmt: skip
        del row["name"]
        self.res["rows"].append(row)
        write(self.res, self.args.results)
        log(f"{setting.name}: {row['pages_per_s']} pages/s, GPU {row['gpu_busy_pct']}% busy, "
            f"{row['watts']} W; written to {self.args.results}")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = model_dir_parser("python -m bench.gpu.big_gpu", __doc__, required=False)
    ap.add_argument("--fake", action="store_true",
                    help="the fake server (testkit) instead of vLLM: a dry run without a GPU")
    ap.add_argument("--list", action="store_true", help="print the settings known and exit")
    ap.add_argument("--settings", default=DEFAULT_SETTINGS,
                    help=f"comma-separated, tried in this order (default {DEFAULT_SETTINGS})")
    ap.add_argument("--pages", type=int, default=128, help="pages of the book (default 128)")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                    help="start nothing estimated to end after this many seconds "
                    f"(default {DEFAULT_BUDGET_S:g})")  # fmt: skip
    ap.add_argument("--results", type=Path, default=None,
                    help="results file (default bench/gpu/big_gpu.json; with --layout "
                    "bench/gpu/big_gpu_layout.json)")  # fmt: skip
    ap.add_argument("--merge", action="store_true",
                    help="keep the results file's rows (and B2) of settings not run now")
    ap.add_argument("--log-dir", type=Path, default=None,
                    help="each ocrvl process's log (default: the work directory)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    lay = ap.add_argument_group("layout detection on (as bench.gpu.layout_on)")
    lay.add_argument("--layout", action="store_true",
                     help="layout detection on for B2 and every ocrvl convert: a "
                     "make_layout_pdf book, blocks as requests")  # fmt: skip
    add_layout_model_args(lay)
    lay.add_argument("--page-tokens", type=int, default=PAGE_TOKENS,
                     help="random weights: a page's answer tokens (median) that its blocks "
                     f"share (default {PAGE_TOKENS})")  # fmt: skip
    args = ap.parse_args(argv)
    if args.results is None:
        args.results = HERE / ("big_gpu_layout.json" if args.layout else "big_gpu.json")
    if args.list:
        return args
    try:
        args.chosen = chosen(args.settings)
    except ValueError as exc:
        ap.error(f"--settings: {exc}")
    if not args.fake and not args.model_dir:
        ap.error("--model-dir is required (or --fake for a dry run)")
    return args


def layout_on(args: argparse.Namespace, work: Path, book: Path,
              res: dict[str, Any]) -> LayoutOn:  # fmt: skip
    """Layout detection on: the layout model's cache for every child, the blocks ocrvl's own
    pipeline sends for the book caught (untimed, before any daemon starts) and the answer
    length a block gets from them, all recorded in `res`."""
    args.layout_cache = use_layout_cache(args.layout_cache)
    settings = {"layout_engine": args.layout_engine, "layout_device": args.layout_device}
    res.update(layout_fields(settings))
    log(f"layout: {res['layout_choice']}; blocks: ocrvl's pipeline on every page, its "
        "requests caught (untimed)")  # fmt: skip
    blocks = caught_blocks(settings, book, args.pages, work / "blocks.jsonl",
                           args.log_dir or work)  # fmt: skip
    lengths = block_lengths(blocks["requests_per_page"], args.page_tokens)
    res.update(blocks_per_page=round(blocks["blocks_per_page"], 2),
               requests_per_page=round(blocks["requests_per_page"], 2),
               labels=blocks["labels"], capture_s=blocks["seconds"], answer_lengths=lengths,
               answer_lengths_note=(
                   "the fake server's own" if args.fake else
                   f"random weights; each block's answer ends at lognormal {lengths} "
                   f"(median:sigma:seed) tokens, the median {args.page_tokens} tokens a page / "
                   f"{blocks['requests_per_page']:.1f} blocks sent a page"))  # fmt: skip
    log(f"blocks: {blocks['blocks_per_page']:.1f} a page, {blocks['requests_per_page']:.1f} "
        f"sent, in {blocks['seconds']:.0f} s: answers {lengths}")  # fmt: skip
    return LayoutOn(settings, res["b2_kwargs"], lengths)


@stops_children
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for s in SETTINGS.values():
            print(f"{s.name}: {s.replicas} replica(s){', MPS' if s.mps else ''}"
                  f"{f', vLLM {s.vllm_args}' if s.vllm_args else ''}"
                  f"{f', pipeline {s.pipeline}' if s.pipeline else ''}")
        return 0
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="ocrvl-big-gpu-"))
    log(f"work directory {work}")
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    old = json.loads(args.results.read_text()) if args.merge and args.results.exists() else {}
    names = {s.name for s in args.chosen}
    gpus = [] if args.fake else read_gpus()
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "gpu": gpu_name(), "pages": args.pages,
        "card_mib": gpus[0].total_mib if gpus else None, "concurrency": CONCURRENCY,
        "server": "fake (testkit)" if args.fake else args.model_dir, "layout": args.layout,
        "rows": [r for r in old.get("rows", []) if r["setting"] not in names],
    }  # fmt: skip
    if old.get("b2_pages_per_s"):
        for key in ("b2_pages_per_s", "b2_on", "b2_requests", "b2_requests_per_page"):
            res[key] = old.get(key)
    try:
        if args.layout:
            book = make_layout_pdf(work / "book.pdf", args.pages, seed=1)
            layout = layout_on(args, work, book, res)
        else:
            book = make_pdf(work / "book.pdf", args.pages, height=PAGE_HEIGHT, seed=1)
            layout = None
        Runner(args, work, book, res, layout, t0).run(args.chosen)
        write(res, args.results)
        print(report(res))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The whole GPU (issue 37): which settings make one large GPU serve the most pages.

    python -m bench.gpu.big_gpu --model-dir DIR [--vllm-python P --vllm-pythonpath SITE]
        [--settings mps-x3,mps-x4,x2-async] [--pages 128] [--budget-s 540] [--merge]
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

Settings (`--list`): replicas 1-4 without and with MPS (`server.mps: off` / `on`); vLLM flags
per replica (`--async-scheduling`, `--max-num-batched-tokens 8192`, fewer CUDA graph sizes,
`--api-server-count 2`); the image ocrvl sends (`pipeline.max_page_pixels`: a smaller image
is fewer image tokens, but the model sees less and, with random weights, the answer lengths
drawn from the prompt length change: such rows carry `changes_input`). JPEG quality is not a
setting (the worker's 92). Writes `--results` (default bench/gpu/big_gpu.json) after every
setting; `--budget-s` starts no daemon or setting that its estimate says would not end in
time. Prints a table and the `autotune.REPLICA_RULES` row the winners make for this card.
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

from bench.gpu.replicas import ReplicaDaemon, ServersFailed, gpu_memory_used_mib
from bench.gpu.run import PAGE_HEIGHT, Bench, gpu_name, log, warm_up
from bench.gpu.teardown import stops_children
from bench.gpu.vllm_server import Metrics, model_dir_parser, version
from ocrvl_daemon.server.autotune import ReplicaRule
from ocrvl_daemon.server.gpu import read_gpus
from testkit.documents import make_pdf

HERE = Path(__file__).resolve().parent
DEFAULT_SETTINGS = "mps-x3,mps-x4,x2-async"
DEFAULT_BUDGET_S = 540.0  # a 10-minute call, less a margin
# `ocrvl run` with N replicas on an H200 was ready in 70 s (N = 1), 88 s (2), 132 s (3)
# (bench/gpu/replicas_gpu.json): the first start, then about 35-45 s per replica more.
START_FIRST_S, START_NEXT_S = 75.0, 40.0
WARM_UP_S_PER_REPLICA = 8.0
STOP_S = 20.0  # the daemon's stop and the GPU's memory coming back
SETTING_OVERHEAD_S = 15.0  # ocrvl convert's start, the idle wait, the GPU sampler
MIN_PAGES_PER_S = 8.0  # for the estimate: B2 on that card
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
        Setting("x2-async", 2, vllm_args={"async-scheduling": True}),
        Setting("mps-x3-async", 3, mps=True, vllm_args={"async-scheduling": True}),
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


def setting_cost_s(pages: int) -> float:
    """The estimated seconds of one setting's `ocrvl convert` of the book."""
    return SETTING_OVERHEAD_S + pages / MIN_PAGES_PER_S


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
    return {
        "date": res["date"], "gpu": res["gpu"], "vllm": res.get("vllm"), "pages": res["pages"],
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
             f"- B2: {s['b2_pages_per_s'] or '-'} pages/s ({res.get('b2_on', 'not run')})", "",
             "| setting | replicas used / started | MPS | pages/s | vs B2 | GPU busy | W "
             "| preemptions |", "|---|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    b2 = s["b2_pages_per_s"]
    for r in res["rows"]:
        if not r.get("pages_per_s"):
            lines.append(f"| {r['setting']} | - | - | {r.get('skipped', 'failed')} | | | | |")
            continue
        vs_b2 = f"{r['pages_per_s'] / b2:.2f}x" if b2 else "-"
        lines.append(
            f"| {r['setting']} | {r['replicas']} / {r['replicas_started']} "
            f"| {'yes' if r['mps_used'] else 'no'} | {r['pages_per_s']:.2f} | {vs_b2} "
            f"| {_or_dash(r.get('gpu_busy_pct'))} | {_or_dash(r.get('watts'))} "
            f"| {r['preemptions']} |")
    lines += ["", f"- best: {s['best_setting']} at {s['best_pages_per_s']} pages/s",
              f"- REPLICA_RULES row for this card: {s['rule_row'] or '-'}"]
    return "\n".join(lines) + "\n"


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


class Runner:
    """Runs the settings group by group, one daemon at a time, within the budget."""

    def __init__(self, args: argparse.Namespace, work: Path, book: Path,
                 res: dict[str, Any]) -> None:  # fmt: skip
        self.args, self.work, self.book, self.res = args, work, book, res
        self.t0 = time.monotonic()
        self.gpu_baseline = None if args.fake else gpu_memory_used_mib()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def run(self, settings: list[Setting]) -> None:
        for started, group in server_groups(settings):
            first = setting_cost_s(self.args.pages) * (2 if "b2_pages_per_s" not in self.res
                                                         else 1)  # fmt: skip
            if not fits(self.elapsed(), self.args.budget_s, start_cost_s(started) + first):
                self.skip(group, f"budget: {started} replica start(s) would not fit")
                continue
            done: set[str] = set()
            try:
                with self.daemon(started, group[0]) as daemon:
                    for setting in group:
                        if not fits(self.elapsed(), self.args.budget_s,
                                    setting_cost_s(self.args.pages)):
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

    def skip(self, group: list[Setting], why: str) -> None:
        for setting in group:
            log(f"{setting.name}: skipped ({why})")
            self.res["rows"].append({"setting": setting.name, "skipped": why})
        write(self.res, self.args.results)

    @contextlib.contextmanager
    def daemon(self, replicas: int, setting: Setting) -> Iterator[ReplicaDaemon]:
        """An `ocrvl run` managing `replicas` servers with `setting`'s server options, started,
        warmed up and, however the block ends, stopped with its log kept."""
        # The dry run has no MPS; off where a setting has none, whatever `auto` would do.
        mps = "on" if setting.mps and not self.args.fake else "off"
        daemon = ReplicaDaemon(replicas, self.work / f"{setting.name}-daemon", self.args,
                               {"mps": mps, "vllm_args": setting.vllm_args})  # fmt: skip
        log(f"{setting.name}: starting {replicas} replica(s), server.mps {mps}")
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
        try:
            if "b2_pages_per_s" not in self.res:  # on urls[0], the others idle
                self.res["b2_pages_per_s"] = round(bench.b2().pages_per_s, 3)
                self.res["b2_on"] = f"replica 1 of {started} ({setting.name}'s servers)"
            conv = bench.convert(setting.name, server={"mode": "external", "urls": urls},
                                 pipeline=setting.pipeline)  # fmt: skip
        finally:
            metrics.stop()
        row = {
            **asdict(setting), "setting": setting.name, "replicas_started": started,
            "mps_used": bool(daemon.proc and daemon.proc.grep(MPS_RUNNING)),
            "pages_per_s": round(conv.pages_per_s, 3), "seconds": round(conv.seconds, 1),
            "gpu_busy_pct": conv.extra.get("gpu_busy_pct"), "watts": conv.extra.get("gpu_watts"),
            "preemptions": conv.preemptions, "timeline": conv.timeline,
            "vllm_settings": daemon.settings(), "elapsed_s": round(self.elapsed(), 1),
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
    ap.add_argument("--results", type=Path, default=HERE / "big_gpu.json",
                    help="results file (default bench/gpu/big_gpu.json)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the results file's rows (and B2) of settings not run now")
    ap.add_argument("--log-dir", type=Path, default=None,
                    help="each ocrvl process's log (default: the work directory)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)
    if args.list:
        return args
    try:
        args.chosen = chosen(args.settings)
    except ValueError as exc:
        ap.error(f"--settings: {exc}")
    if not args.fake and not args.model_dir:
        ap.error("--model-dir is required (or --fake for a dry run)")
    return args


@stops_children
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for s in SETTINGS.values():
            print(f"{s.name}: {s.replicas} replica(s){', MPS' if s.mps else ''}"
                  f"{f', vLLM {s.vllm_args}' if s.vllm_args else ''}"
                  f"{f', pipeline {s.pipeline}' if s.pipeline else ''}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="ocrvl-big-gpu-"))
    log(f"work directory {work}")
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    book = make_pdf(work / "book.pdf", args.pages, height=PAGE_HEIGHT, seed=1)
    old = json.loads(args.results.read_text()) if args.merge and args.results.exists() else {}
    names = {s.name for s in args.chosen}
    gpus = [] if args.fake else read_gpus()
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "gpu": gpu_name(), "pages": args.pages,
        "card_mib": gpus[0].total_mib if gpus else None, "concurrency": CONCURRENCY,
        "server": "fake (testkit)" if args.fake else args.model_dir,
        "rows": [r for r in old.get("rows", []) if r["setting"] not in names],
    }  # fmt: skip
    if old.get("b2_pages_per_s"):
        res["b2_pages_per_s"], res["b2_on"] = old["b2_pages_per_s"], old.get("b2_on")
    try:
        Runner(args, work, book, res).run(args.chosen)
        write(res, args.results)
        print(report(res))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

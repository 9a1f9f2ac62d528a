"""ocrvl's benchmark of record on a real GPU: one vLLM server, the same pages for everyone.

    python -m bench.gpu --model-dir DIR          # random weights (make DIR: bench.gpu.dummy_model)
    python -m bench.gpu --model PaddlePaddle/PaddleOCR-VL   # real weights from the hub
    python -m bench.gpu --server-url URL         # a server already running (lengths its own)

Contenders, one after another on an idle server, each on the same `--pages`-page book:
  capacity  the direct feeder: the book's pages pre-rendered as clients render them,
            exactly `--concurrency` requests always in flight (default: ocrvl's default
            bound, 64; every ocrvl contender gets it as `pipeline.max_concurrency`)
  B2        one warm `PaddleOCRVL(...).predict([book])` (bench/run.py's; predict timed)
  convert   `ocrvl convert BOOK --server-url URL` (timed from the worker's ready line to
            the book's "done" line, like B2, and from the command's start to its exit)
  run       `ocrvl run` with an inbox: a daemon whose engine worker is ready, then the book
            dropped; first drop -> last `.md` (and worker ready -> last `.md` if later)
  small     `--small` two-page documents, each alone in an idle daemon, then dropped
            `--gap` s apart while a book runs: each one's time against its own solo time
Prints a table (ratios, requests-running timelines from /metrics) and writes results.json.
With random weights the server's answers end at lengths from `bench.gpu.answer_lengths`.
`--layout`: the same with layout detection on, blocks as requests (bench/gpu/layout_on.py);
its figures go under `layout_on` in the same results file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
from PIL import Image  # noqa: E402

from bench.gpu.gpu_sampler import GpuSampler  # noqa: E402
from bench.gpu.lengths import DEFAULT as DEFAULT_LENGTHS  # noqa: E402
from bench.gpu.lengths import AnswerLengths  # noqa: E402
from bench.gpu.teardown import stops_children  # noqa: E402
from bench.gpu.vllm_server import (  # noqa: E402
    Metrics,
    ServeOptions,
    add_vllm_args,
    started,
    version,
)
from bench.loadgen import send_all  # noqa: E402
from bench.run import (  # noqa: E402
    B2_SCRIPT,
    Ocrvl,
    drop,
    drop_under_book,
    md_done,
    process_cpu,
    solo_times,
    start_daemon,
)
from ocrvl_daemon.config.model import PipelineConfig  # noqa: E402
from ocrvl_daemon.config.models import (  # noqa: E402
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MODEL,
    MAX_IMAGE_PIXELS,
)
from ocrvl_daemon.files.pdf import page_count, render_page  # noqa: E402
from ocrvl_daemon.worker.streaming import STREAM_OPTIONS  # noqa: E402
from testkit.documents import make_pdf  # noqa: E402
from testkit.harness import chat_payload, free_port, wait_until  # noqa: E402
from testkit.runner import write_config  # noqa: E402

PAGE_HEIGHT = 792  # points: 400..1380 x 792 pt pages, as bench/run.py's
PIPELINE = PipelineConfig(use_layout_detection=False)  # as every contender runs: whole pages
WARM_UP_PAGES = 32
# What PaddleX adds to every page's request. vLLM builds an image processor for each set of
# `mm_processor_kwargs` on its first request (seconds, nothing running): a feeder and warm-up
# without them would leave that to the first ocrvl contender.
PADDLEX_REQUEST_EXTRA: dict[str, Any] = {
    "skip_special_tokens": True,
    "mm_processor_kwargs": {"min_pixels": 112_896, "max_pixels": MAX_IMAGE_PIXELS},
}
WORKER_READY = re.compile(r"engine worker \S+ ready in ([0-9.]+) s")
# ocrvl convert logs the book's progress every second: its pace between STEADY_FROM and
# STEADY_TO of its pages, once its first pages are through and before its last are in flight.
PROGRESS_SECONDS = 1.0
PROGRESS = re.compile(r": p\. (\d+)/\d+ ")
STEADY_FROM, STEADY_TO = 0.1, 0.9


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Result:
    """One contender's run on the book."""

    name: str
    pages: int
    seconds: float
    what: str  # what the seconds span
    timeline: list[int | None] = field(default_factory=list)  # mean requests running per slice
    preemptions: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pages_per_s(self) -> float:
        return self.pages / self.seconds


class Bench:
    """The contenders against one server, its /metrics sampled throughout."""

    def __init__(self, url: str, work: Path, book: Path, pages: int, concurrency: int,
                 metrics: Metrics | None = None, log_dir: Path | None = None) -> None:  # fmt: skip
        self.url, self.work, self.book, self.pages = url, work, book, pages
        self.log_dir = log_dir or work  # each ocrvl process's log, named for its contender
        self.concurrency = concurrency  # the feeder's, and ocrvl's pipeline.max_concurrency
        self.metrics = metrics or Metrics(url)  # several servers' summed: bench.gpu.replicas
        self.servers = [server_process(u) for u in self.metrics.urls]
        self.rounds: dict[str, list[Result]] = {}  # each contender's runs, in order
        self.results: dict[str, Result] = {}  # each contender's median run (the slower middle)
        # Layout on (bench.gpu.layout_on): the `pipeline` settings that turn it on for every
        # ocrvl contender, B2's constructor arguments for the same, and the small documents'
        # kind of page.
        self.layout: dict[str, Any] = {}
        # requests running that show the book under way (0: the daemon has queued its pages)
        self.under_way = 16
        self.b2_kwargs: dict[str, Any] = {}
        self.small_doc: Callable[[Path, int], Path] = lambda path, seed: make_pdf(
            path, 2, height=PAGE_HEIGHT, seed=seed)

    # `solo_times` in bench/run.py waits for an idle server through this
    def idle(self) -> bool:
        return self.metrics.idle()

    def measure(self, name: str, what: str, run: Callable[[], tuple[float, float, int]],
                **extra: Any) -> Result:  # fmt: skip
        """`run` returns (start, end, pages) in time.monotonic(); the timeline spans them."""
        self.metrics.wait_idle()
        log(f"{name} ...")
        cpu0, machine0, wall0 = self.server_cpu(), psutil.cpu_times(), time.monotonic()
        with GpuSampler() as gpu:
            t0, t1, pages = run()
        cpu1, machine1, wall1 = self.server_cpu(), psutil.cpu_times(), time.monotonic()
        extra = {**extra, **machine_cpu(machine0, machine1, wall1 - wall0), **gpu.over(t0, t1)}
        if cpu0 is not None and cpu1 is not None:
            server = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
            extra = {**extra, "server_api_cpu_s_per_page": server[0] / pages,
                     "server_engine_cpu_s_per_page": server[1] / pages,
                     "others_cpu_s_per_page": (extra["machine_busy_cores"] * (wall1 - wall0)
                                               - sum(server)) / pages}  # fmt: skip
        r = Result(name, pages, t1 - t0, what, self.metrics.timeline(t0, t1),
                   self.metrics.preemptions(t0, t1), extra)  # fmt: skip
        log(f"{name}: {r.pages_per_s:.2f} pages/s ({r.seconds:.1f} s, {what}); "
            f"running {r.timeline}; preemptions {r.preemptions}")  # fmt: skip
        runs = self.rounds.setdefault(name, [])
        runs.append(r)
        self.results[name] = sorted(runs, key=lambda x: x.pages_per_s)[(len(runs) - 1) // 2]
        return r

    def server_cpu(self) -> tuple[float, float] | None:
        """CPU seconds so far of the servers' API processes and of their children (the engine
        cores), summed; None unless every server is a process on this machine."""
        procs = [p for p in self.servers if p is not None]
        if not procs or len(procs) < len(self.servers):
            return None
        with contextlib.suppress(psutil.Error):
            each = [process_cpu(p) for p in procs]
            return sum(api for api, _ in each), sum(core for _, core in each)
        return None

    def slug(self, contender: str) -> str:
        """`contender`'s name and its run now, for file names (NAME.ROUND)."""
        name = re.sub(r"\W+", "-", contender).strip("-")
        return f"{name}.{len(self.rounds.get(contender, [])) + 1}"

    def pipeline(self) -> dict[str, Any]:
        """The `pipeline` settings of every ocrvl contender: the same bound as the feeder."""
        return {"max_concurrency": self.concurrency,
                "min_concurrency": min(PIPELINE.min_concurrency, self.concurrency),
                **self.layout}

    def log_path(self, contender: str) -> Path:
        return self.log_dir / f"{self.slug(contender)}.log"

    def capacity(self) -> Result:
        bodies = page_requests(self.book, self.pages)

        def run() -> tuple[float, float, int]:
            t0 = time.monotonic()
            seconds = asyncio.run(send_all(self.url, bodies, self.concurrency))
            return t0, t0 + seconds, len(bodies)

        return self.measure("capacity", f"{self.concurrency} always in flight", run)

    def b2(self) -> Result:
        env = {**os.environ, "OCRVL_B2_KWARGS": json.dumps(self.b2_kwargs)}

        def run() -> tuple[float, float, int]:
            proc = subprocess.run([sys.executable, "-c", B2_SCRIPT, self.url + "/v1",
                                   str(self.book)], capture_output=True, text=True,
                                  check=False, env=env)  # fmt: skip
            self.log_path("B2").write_text(proc.stderr, encoding="utf-8")
            if proc.returncode != 0:
                raise RuntimeError(f"B2 failed: {proc.stderr[-2000:]}")
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            end = time.monotonic()
            return end - out["seconds"], end, out["pages"]

        return self.measure("B2", "predict() only", run)

    def convert(self, name: str = "ocrvl convert", *, cpus: set[int] | None = None,
                book: Path | None = None, **settings: Any) -> Result:
        """`ocrvl convert` of a fresh copy of the book (or of `book`); `settings` go into its
        config (with a `server` section, that names the servers instead of `--server-url`);
        `cpus`: the only cores ocrvl and its workers may use."""
        where = self.work / self.slug(name)
        where.mkdir(parents=True)
        source = book or self.book
        pages = page_count(source)
        book = Path(shutil.copy(source, where / source.name))
        settings["pipeline"] = {**self.pipeline(), **settings.get("pipeline", {})}
        cfg = write_config(where / "convert.yaml", state_dir=str(where / "state"),
                           progress_seconds=PROGRESS_SECONDS, **settings)  # fmt: skip
        info: dict[str, Any] = {}

        def run() -> tuple[float, float, int]:
            t0 = time.monotonic()
            server = [] if "server" in settings else ["--server-url", self.url]
            proc = Ocrvl("convert", "--config", cfg, *server, book, cpus=cpus)
            code = proc.wait(3600)
            t1 = time.monotonic()
            proc.save(self.log_path(name))
            if code != 0:
                raise RuntimeError("ocrvl convert failed:\n" + "\n".join(proc.grep("")[-30:]))
            ready = proc.first("ready in")
            # The book is done when its .md is written; the workers' exit after it is not
            # conversion (B2's predict() is timed without its teardown too).
            done = proc.first(": done, ") or t1
            info["from_start_s"] = t1 - t0
            info["exit_after_done_s"] = round(t1 - done, 2)
            info["worker_ready_s"] = worker_ready_s(proc)
            info["steady_pages_per_s"] = steady_pages_per_s(progress(proc, book.name), pages)
            info["concurrency"] = [line.split("] ")[-1] for line in proc.grep("concurrency")]
            info["layout"] = [line.split("layout: ", 1)[-1] for line in proc.grep("layout: ")]
            return (ready or t0), done, pages

        r = self.measure(name, "from the worker's ready line to the book's done line", run)
        r.extra.update(info)
        r.extra["pages_per_s_from_start"] = pages / info["from_start_s"]
        if cpus:
            r.extra["cpus"] = len(cpus)
        return r

    def run_daemon(self) -> Result:
        info: dict[str, Any] = {}

        def run() -> tuple[float, float, int]:
            daemon, inbox, _ = start_daemon(self.url, self.work, self.slug("ocrvl run"),
                                         pipeline=self.pipeline())  # fmt: skip
            try:
                t_ready = daemon.first("ready in") or time.monotonic()
                info["worker_ready_s"] = worker_ready_s(daemon)
                t0 = drop(self.book, inbox)
                wait_until(lambda: md_done(inbox, self.book.name), 3600, interval=0.02,
                           what="the book's .md")  # fmt: skip
                t1 = time.monotonic()
                if t_ready > t0:  # the worker was not warm when the book came
                    info["from_worker_ready_pages_per_s"] = self.pages / (t1 - t_ready)
                info["concurrency"] = [line.split("] ")[-1] for line in daemon.grep("concurrency")]
                return t0, t1, self.pages
            finally:
                daemon.stop()
                daemon.save(self.log_path("ocrvl run"))

        r = self.measure("ocrvl run", "first drop -> last .md, worker warm", run)
        r.extra.update(info)
        return r

    def small_documents(self, count: int, gap: float) -> dict[str, Any]:
        smalls = [self.small_doc(self.work / "small" / f"small{i:02d}.pdf", 300 + i)
                  for i in range(count)]  # fmt: skip
        self.metrics.wait_idle()
        log(f"small documents: {count} alone")
        alone = solo_times(self, smalls, self.work,  # type: ignore[arg-type]
                           pipeline=self.pipeline())  # fmt: skip
        dropped: dict[str, float] = {}
        done: dict[str, float] = {}

        def run() -> tuple[float, float, int]:
            daemon, inbox, _ = start_daemon(self.url, self.work, "busy", pipeline=self.pipeline())
            try:
                t0 = drop(self.book, inbox)
                under_way = min(self.under_way, self.pages)
                queued = f"{self.book.name}: {self.pages} pages queued"

                def started() -> bool:
                    if not under_way:  # the daemon has taken the book in
                        return bool(daemon.grep(queued))
                    return (self.metrics.last() or (0, 0))[1] >= under_way

                wait_until(lambda: started() or md_done(inbox, self.book.name), 300,
                           what="the book under way")  # fmt: skip
                if md_done(inbox, self.book.name):
                    raise SystemExit(f"the book finished before {under_way} of its pages ran at "
                                     "once, so there is no book to drop small documents under: "
                                     "give --pages more pages")  # fmt: skip
                times = drop_under_book(self.book, smalls, inbox, gap=gap, t0=t0)
                dropped.update(times[0])
                done.update(times[1])
                return t0, time.monotonic(), self.pages + 2 * len(smalls)
            finally:
                daemon.stop()
                daemon.save(self.log_path("book + small documents"))

        r = self.measure("book + small documents", "book's drop -> last .md", run)
        ratios = sorted((done[n] - dropped[n]) / alone[n] for n in dropped)
        return {
            "count": count, "gap_s": gap,
            "solo_median_s": statistics.median(alone.values()),
            "busy_median_s": statistics.median(done[n] - dropped[n] for n in dropped),
            "median_x": statistics.median(ratios), "worst_x": ratios[-1],
            "ratios": [round(x, 2) for x in ratios], "book_timeline": r.timeline,
        }  # fmt: skip


def server_process(url: str) -> psutil.Process | None:
    """The process on this machine listening on `url`'s port (a vLLM API server; its children
    are the engine core), or None for a server elsewhere or out of sight."""
    port = urlsplit(url).port
    with contextlib.suppress(psutil.Error):
        for conn in psutil.net_connections(kind="tcp"):
            port_of = getattr(conn.laddr, "port", None)
            if conn.status == psutil.CONN_LISTEN and port_of == port and conn.pid:
                return psutil.Process(conn.pid)
    return None


def machine_cpu(before: Any, after: Any, seconds: float) -> dict[str, float]:
    """The machine's CPUs over a contender's run, from two `psutil.cpu_times()`: busy cores
    (everything but idle, iowait and steal) and cores stolen by the hypervisor. On a shared
    host these tell a slow round of the machine from a slow contender."""
    def total(t: Any) -> float:  # Linux counts guest time in user and nice already
        return sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

    def quiet(t: Any) -> float:
        return t.idle + getattr(t, "iowait", 0.0) + getattr(t, "steal", 0.0)

    busy = (total(after) - quiet(after)) - (total(before) - quiet(before))
    steal = getattr(after, "steal", 0.0) - getattr(before, "steal", 0.0)
    return {"machine_cpus": psutil.cpu_count() or 1, "machine_busy_cores": busy / seconds,
            "machine_steal_cores": steal / seconds}  # fmt: skip


def progress(proc: Ocrvl, name: str) -> list[tuple[float, int]]:
    """(time, pages done) of each progress line `proc` logged for the document `name`."""
    return [(t, int(m.group(1))) for t, line in list(proc.lines)
            if f"{name}: p. " in line and (m := PROGRESS.search(line))]  # fmt: skip


def steady_pages_per_s(readings: list[tuple[float, int]], pages: int) -> float | None:
    """Pages a second between the first progress reading at STEADY_FROM of the book and the
    last at STEADY_TO or below: the book's pace without its first page's latency (laid
    out, then answered, before any page is done) and its last one's. None without two such
    readings apart in time."""
    inside = [(t, n) for t, n in readings if STEADY_FROM * pages <= n <= STEADY_TO * pages]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    (t0, n0), (t1, n1) = inside[0], inside[-1]
    return (n1 - n0) / (t1 - t0)


def worker_ready_s(proc: Ocrvl) -> float | None:
    for line in proc.grep("ready in"):
        if m := WORKER_READY.search(line):
            return float(m.group(1))
    return None


def warm_up(urls: list[str], work: Path) -> None:
    """Send each fresh server WARM_UP_PAGES pages (not the book's) before anything is measured:
    a fresh vLLM's first requests wait seconds for its lazy start-up work, with no request
    running, and the first contender would pay for it."""
    pdf = make_pdf(work / "warm-up" / "warm.pdf", WARM_UP_PAGES, height=PAGE_HEIGHT, seed=2)
    bodies = page_requests(pdf, WARM_UP_PAGES)
    for url in urls:
        seconds = asyncio.run(send_all(url, bodies, WARM_UP_PAGES))
        log(f"warmed up {url}: {WARM_UP_PAGES} pages in {seconds:.1f} s")


def page_requests(pdf: Path, pages: int) -> list[dict[str, Any]]:
    """The chat requests of `pdf`'s first `pages` pages, as ocrvl sends them (the same image,
    token limit and processor settings per page as PaddleX, streamed)."""
    return [chat_payload(j, model=DEFAULT_MODEL, max_completion_tokens=DEFAULT_MAX_NEW_TOKENS,
                         **PADDLEX_REQUEST_EXTRA, stream=True, stream_options=STREAM_OPTIONS)
            for j in page_jpegs(pdf, pages)]  # fmt: skip


def page_jpegs(pdf: Path, pages: int) -> list[bytes]:
    """The book's pages rendered as ocrvl renders them (scale 2 within the model's input size,
    layout detection being off; JPEG)."""
    out = []
    for i in range(pages):
        bgr = render_page(pdf, i, PIPELINE.render_scale, PIPELINE.page_pixel_limit)
        buf = io.BytesIO()
        Image.fromarray(bgr[:, :, ::-1]).save(buf, format="JPEG", quality=95)
        out.append(buf.getvalue())
    return out


def gpu_name() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20, check=False).stdout.strip()  # fmt: skip
        if out:
            return out.splitlines()[0]
    return "none (no nvidia-smi)"


# --- report -----------------------------------------------------------------------------


def summary(res: dict[str, Any]) -> dict[str, Any]:
    """The figures of record (results.json's top level)."""
    r = res["results"]

    def pps(name: str) -> float | None:
        return round(r[name]["pages_per_s"], 3) if name in r else None

    small = res.get("small") or {}
    return {
        "date": res["date"], "gpu": res["gpu"], "vllm": res["vllm"], "pages": res["pages"],
        "concurrency": res["concurrency"], "answer_lengths": res["answer_lengths"],
        "capacity_pages_per_s": pps("capacity"), "b2_pages_per_s": pps("B2"),
        "ocrvl_convert_pages_per_s": pps("ocrvl convert"),
        "ocrvl_run_pages_per_s": pps("ocrvl run"),
        "small_doc_median_x": round(small["median_x"], 3) if small else None,
        "small_doc_worst_x": round(small["worst_x"], 3) if small else None,
        "worker_ready_s": res.get("worker_ready_s"),
    }  # fmt: skip


def targets(s: dict[str, Any]) -> list[tuple[str, bool | None, str]]:
    def ratio(a: str, b: str) -> float | None:
        return s[a] / s[b] if s.get(a) and s.get(b) else None

    def row(name: str, value: float | None, ok: Callable[[float], bool],
            fmt: str) -> tuple[str, bool | None, str]:  # fmt: skip
        return (name, None if value is None else ok(value),
                "not run" if value is None else format(value, fmt))  # fmt: skip

    return [
        row("ocrvl convert >= 1.3x B2", ratio("ocrvl_convert_pages_per_s", "b2_pages_per_s"),
            lambda x: x >= 1.3, ".2f"),
        row("ocrvl convert >= 95% of capacity",
            ratio("ocrvl_convert_pages_per_s", "capacity_pages_per_s"), lambda x: x >= 0.95,
            ".0%"),
        row("ocrvl run >= 90% of capacity",
            ratio("ocrvl_run_pages_per_s", "capacity_pages_per_s"), lambda x: x >= 0.9, ".0%"),
        row("small documents under a book <= 2x solo (median)", s.get("small_doc_median_x"),
            lambda x: x <= 2, ".2f"),
        row("small documents under a book <= 2.5x solo (worst)", s.get("small_doc_worst_x"),
            lambda x: x <= 2.5, ".2f"),
        row("engine worker ready <= 5 s", s.get("worker_ready_s"), lambda x: x <= 5, ".1f"),
    ]  # fmt: skip


ROUND_RATIOS = (("ocrvl convert", "B2"), ("ocrvl convert", "capacity"), ("ocrvl run", "capacity"))


def round_ratios(res: dict[str, Any]) -> dict[str, list[float]]:
    """Each ratio the targets name, round by round: a round runs its contenders back to back,
    so each of its ratios compares runs minutes apart, not a whole run apart."""
    r = res["results"]
    return {f"{a} / {b}": [x / y for x, y in zip(r[a]["rounds_pages_per_s"],
                                                 r[b]["rounds_pages_per_s"], strict=False)]
            for a, b in ROUND_RATIOS if a in r and b in r}  # fmt: skip


def report(res: dict[str, Any]) -> str:
    s = res["summary"]
    cap = s.get("capacity_pages_per_s")
    b2 = s.get("b2_pages_per_s")
    lines = [
        f"- date: {s['date']}", f"- GPU: {s['gpu']}", f"- vLLM: {s['vllm']}",
        f"- server: {res['server']}", f"- answers: {res['answer_lengths_note']}",
        f"- pages: {s['pages']} (one book), bound {s['concurrency']} in flight",
        f"- rounds: {res.get('rounds', 1)}, each in its own order "
        f"({'; '.join(', '.join(o) for o in res.get('round_orders', []))}); each figure is a "
        "contender's median run (of an even count, the slower middle one), whose time and "
        "timeline are shown", "",
        "| contender | pages/s | each round | s | vs capacity | vs B2 | GPU busy | GPU W "
        "| preemptions | requests running (mean per 1/24 of the run) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]  # fmt: skip
    for r in res["results"].values():
        vs_cap = f"{r['pages_per_s'] / cap:.0%}" if cap else "-"
        vs_b2 = f"{r['pages_per_s'] / b2:.2f}x" if b2 else "-"
        each = " ".join(f"{x:.2f}" for x in r.get("rounds_pages_per_s", [r["pages_per_s"]]))
        running = " ".join("." if x is None else str(x) for x in r["timeline"])
        busy = r["extra"].get("gpu_busy_pct")
        watts = r["extra"].get("gpu_watts")
        lines.append(f"| {r['name']} ({r['what']}) | {r['pages_per_s']:.2f} | {each} "
                     f"| {r['seconds']:.1f} | {vs_cap} | {vs_b2} "
                     f"| {'-' if busy is None else f'{busy:.0f}%'} "
                     f"| {'-' if watts is None else f'{watts:.0f}'} | {r['preemptions']} "
                     f"| {running} |")  # fmt: skip
    lines.append("")
    for name, ratios in round_ratios(res).items():
        if len(ratios) > 1:
            lines.append(f"- {name}, round by round: {' '.join(f'{x:.2f}' for x in ratios)} "
                         f"(median {statistics.median(ratios):.2f})")  # fmt: skip
    cpu = [f"{r['name']} {r['extra']['server_api_cpu_s_per_page']:.3f} + "
           f"{r['extra']['server_engine_cpu_s_per_page']:.3f} "
           f"(+ {r['extra']['others_cpu_s_per_page']:.3f})"
           for r in res["results"].values() if "server_api_cpu_s_per_page" in r["extra"]]
    if cpu:
        lines.append("- server CPU s per page, API process + engine core (+ everything else "
                     "on the machine): " + "; ".join(cpu))  # fmt: skip
    busy = [f"{r['name']} {r['extra']['machine_busy_cores']:.1f} "
            f"({r['extra']['machine_steal_cores']:.2f})"
            for r in res["results"].values() if "machine_busy_cores" in r["extra"]]
    if busy:
        cpus = next(iter(res["results"].values()))["extra"]["machine_cpus"]
        lines.append(f"- machine CPU while each ran, busy cores of {cpus} (stolen by the "
                     "hypervisor): " + "; ".join(busy))  # fmt: skip
    conv = res["results"].get("ocrvl convert")
    if conv:
        lines.append(f"- ocrvl convert from the command's start: "
                     f"{conv['extra']['pages_per_s_from_start']:.2f} pages/s")  # fmt: skip
    if res.get("worker_ready_s") is not None:
        lines.append(f"- engine worker ready in {res['worker_ready_s']:.1f} s "
                     "(the worker's own log line, largest seen)")  # fmt: skip
    if res.get("small"):
        sm = res["small"]
        lines.append(f"- {sm['count']} two-page documents dropped {sm['gap_s']} s apart under "
                     f"the book: alone median {sm['solo_median_s']:.2f} s, under the book "
                     f"{sm['busy_median_s']:.2f} s; each against its own solo time: median "
                     f"{sm['median_x']:.2f}x, worst {sm['worst_x']:.2f}x "
                     f"({sm['ratios']})")  # fmt: skip
    lines += ["", "Targets:", ""]
    for name, ok, detail in targets(s):
        mark = " " if ok is None else ("x" if ok else " ")
        lines.append(f"- [{mark}] {name}: {detail}" + (" (not met)" if ok is False else ""))
    return "\n".join(lines) + "\n"


def round_order(contenders: list[str], round_no: int) -> list[str]:
    """The order of round `round_no` (from 1): a Williams design, so over len(contenders)
    rounds each contender runs first once and (for an even count) follows each other one
    once: none always runs right after B2's bursts of up to 190 requests, say, and a slow
    stretch of a shared machine falls on each in turn."""
    if not contenders:
        return []
    n = len(contenders)
    base, low, high = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...
    while len(base) < n:
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    shift = (round_no - 1) % n
    return [contenders[(i + shift) % n] for i in base]


def write_results(res: dict[str, Any], bench: Bench, path: Path) -> None:
    """Fold the runs so far into `res` and write results.json: after every round, so a run
    cut short (a lease ending) still leaves its figures."""
    res["results"] = {
        n: {**asdict(r), "pages_per_s": r.pages_per_s,
            "rounds_pages_per_s": [x.pages_per_s for x in bench.rounds[n]]}
        for n, r in bench.results.items()}  # fmt: skip
    seen = [r.extra["worker_ready_s"] for runs in bench.rounds.values() for r in runs
            if r.extra.get("worker_ready_s") is not None]  # fmt: skip
    res["worker_ready_s"] = max(seen) if seen else None
    res["round_ratios"] = round_ratios(res)
    res["summary"] = summary(res)
    write_json(path, merged(path, {**res["summary"], "detail": res}))


def merged(path: Path, update: dict[str, Any]) -> dict[str, Any]:
    """The results file at `path` with `update`'s keys replaced and every other key kept: the
    layout-off run of record and the layout-on one (its `layout_on` key) share one file, and
    neither run's write loses the other's figures."""
    old: Any = {}
    with contextlib.suppress(OSError, ValueError):
        old = json.loads(path.read_text(encoding="utf-8"))
    return {**(old if isinstance(old, dict) else {}), **update}


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")  # whole or not at all, for whoever reads it
    part.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    part.replace(path)



# --- main -------------------------------------------------------------------------------


@contextlib.contextmanager
def server(args: argparse.Namespace, work: Path) -> Iterator[str]:
    if args.server_url:
        yield args.server_url.rstrip("/").removesuffix("/v1")
        return
    options = ServeOptions(
        model=args.model_dir or args.model, dummy=bool(args.model_dir),
        lengths=None if args.answer_lengths == "model" else args.answer_lengths,
        port=free_port(), python=args.vllm_python, pythonpath=args.vllm_pythonpath,
        max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
        extra=args.vllm_arg,
    )  # fmt: skip
    log("starting: " + " ".join(options.argv()))
    t0 = time.monotonic()
    with started(options, args.log_dir / "vllm.log") as url:
        log(f"vLLM ready in {time.monotonic() - t0:.0f} s")
        yield url


def add_layout_model_args(group: argparse._ArgumentGroup) -> None:
    """--layout-engine, --layout-device and --layout-cache: the layout model every contender
    runs (bench.gpu and bench.gpu.big_gpu with --layout)."""
    group.add_argument("--layout-engine", default="auto",
                       choices=("auto", "paddle", "transformers", "onnxruntime"),
                       help="pipeline.layout_engine for everyone (default auto)")  # fmt: skip
    group.add_argument("--layout-device", default="gpu:0",
                       help="pipeline.layout_device for everyone: gpu:N or cpu (default gpu:0)")
    group.add_argument("--layout-cache", type=Path, default=None,
                       help="PADDLE_PDX_CACHE_HOME holding the layout model (e.g. the stand-in "
                       "of python -m testkit.layout_model DIR)")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-dir", help="a model dir served with random weights "
                     "(make one: python -m bench.gpu.dummy_model DIR)")  # fmt: skip
    src.add_argument("--model", help="a model with real weights, e.g. PaddlePaddle/PaddleOCR-VL")
    src.add_argument("--server-url", help="use this running server (http://HOST:PORT[/v1])")
    ap.add_argument("--pages", type=int, default=None,
                    help="pages of the book (default 256; with --layout 64)")  # fmt: skip
    ap.add_argument("--concurrency", type=int, default=PIPELINE.max_concurrency,
                    help="pages in flight: the feeder's bound and every ocrvl contender's "
                    f"pipeline.max_concurrency (default {PIPELINE.max_concurrency}, ocrvl's)")
    ap.add_argument("--small", type=int, default=10, help="small documents (default 10)")
    ap.add_argument("--gap", type=float, default=1.5, help="seconds between small documents")
    ap.add_argument("--rounds", type=int, default=None,
                    help="runs of capacity, B2, convert and run, in turn; each figure is its "
                    "median run (of an even count, the slower middle one) (default 2; with "
                    "--layout 1)")  # fmt: skip
    ap.add_argument("--only", default=None,
                    help="comma-separated contenders (default: all: capacity,b2,convert,run,"
                    "small; with --layout also alone,cpu)")  # fmt: skip
    lay = ap.add_argument_group("layout detection on (bench.gpu.layout_on; README)")
    lay.add_argument("--layout", action="store_true",
                     help="measure with layout detection on: a make_layout_pdf book, blocks as "
                     "requests; results go under `layout_on` in --results")  # fmt: skip
    add_layout_model_args(lay)
    lay.add_argument("--layout-cores", default="4,8,all",
                     help="`cpu`: the layout model on the CPU with ocrvl held to this many "
                     "cores each (default 4,8,all; counts above the machine's are skipped)")
    lay.add_argument("--cpu-pages", type=int, default=48,
                     help="pages of the book `cpu` converts at each core count (default 48: "
                     "8 a worker on 16 cores, so that filling and draining the pipeline do "
                     "not make most of the time, as they did at 12)")
    lay.add_argument("--page-tokens", type=int, default=500,
                     help="random weights: a page's answer tokens (median) that its blocks "
                     "share: each block's median is this / blocks per page (default 500)")
    lay.add_argument("--budget-s", type=float, default=None,
                     help="run the parts in order of importance (the layout model alone, "
                     "before vLLM starts; capacity, B2, convert, run; small documents; the CPU "
                     "sweep) and skip each one its estimate says would end after this many "
                     "seconds (recorded as 'skipped: budget'); default: no budget")
    lay.add_argument("--merge", action="store_true",
                     help="keep the `layout_on` figures of contenders not run now")  # fmt: skip
    ap.add_argument("--answer-lengths", default=None,
                    help=f"MEDIAN:SIGMA:SEED of the forced answer lengths (random weights; "
                    f"default {DEFAULT_LENGTHS}), or 'model': the model's own EOS")  # fmt: skip
    add_vllm_args(ap)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--vllm-arg", action="append", default=[],
                    help="one more `vllm serve` argument (repeat)")  # fmt: skip
    ap.add_argument("--results", type=Path, default=HERE / "results.json",
                    help="where results.json goes (default bench/gpu/results.json)")  # fmt: skip
    ap.add_argument("--log-dir", type=Path, default=None,
                    help="vllm.log and each ocrvl process's log (default: the work directory)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)
    if args.pages is None:
        args.pages = 64 if args.layout else 256
    if args.rounds is None:
        args.rounds = 1 if args.layout else 2
    if args.only is None:
        args.only = "capacity,b2,convert,run,small" + (",alone,cpu" if args.layout else "")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: at least 1")
    if args.concurrency < 1:
        ap.error(f"--concurrency {args.concurrency}: at least 1")
    if args.answer_lengths is None and (args.server_url or not args.model_dir):
        args.answer_lengths = "model"  # with --server-url: what that server was started with
    if args.answer_lengths is None and not args.layout:
        args.answer_lengths = DEFAULT_LENGTHS  # with --layout: from the blocks per page
    if args.answer_lengths not in (None, "model"):
        AnswerLengths.parse(args.answer_lengths)
    return args


@stops_children
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.layout:
        from bench.gpu.layout_on import run_layout_on

        return run_layout_on(args)
    parts = set(args.only.split(","))
    work = Path(tempfile.mkdtemp(prefix="ocrvl-gpubench-"))
    args.log_dir = args.log_dir or work
    args.log_dir.mkdir(parents=True, exist_ok=True)
    log(f"work directory {work}")
    book = make_pdf(work / "book.pdf", args.pages, height=PAGE_HEIGHT, seed=1)
    concurrency = args.concurrency
    if args.server_url and args.answer_lengths == "model":
        lengths_note = "the server's own"
    elif args.answer_lengths == "model":
        lengths_note = "the model's own (real weights)"
    else:
        lengths_note = (f"random weights; each answer ends at lognormal "
                        f"{args.answer_lengths} (median:sigma:seed) tokens, clipped to "
                        "16..3000, drawn per page (seeded by its prompt length)")  # fmt: skip
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "gpu": gpu_name(), "pages": args.pages,
        "concurrency": concurrency, "answer_lengths": args.answer_lengths,
        "answer_lengths_note": lengths_note, "python": platform.python_version(),
    }  # fmt: skip
    try:
        with server(args, work) as url:
            res["vllm"] = version(url)
            res["server"] = args.server_url or (args.model_dir or args.model)
            warm_up([url], work)
            bench = Bench(url, work, book, args.pages, concurrency, log_dir=args.log_dir)
            try:
                contenders = {"capacity": bench.capacity, "b2": bench.b2,
                              "convert": bench.convert, "run": bench.run_daemon}  # fmt: skip
                chosen = [c for c in contenders if c in parts]
                res["rounds"], res["round_orders"] = 0, []  # rounds done, each one's order
                for done in range(1, args.rounds + 1):
                    order = round_order(chosen, done)
                    res["round_orders"].append(order)
                    for contender in order:
                        contenders[contender]()
                    res["rounds"] = done
                    write_results(res, bench, args.results)
                if "small" in parts:
                    res["small"] = bench.small_documents(args.small, args.gap)
            finally:
                bench.metrics.stop()
                write_results(res, bench, args.results)
        print(report(res))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0

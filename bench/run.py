"""ocrvl's throughput benchmark: one command, one table.

    .venv/bin/python bench/run.py            # everything (~40 min on 2 cores)
    .venv/bin/python bench/run.py --quick    # smaller documents, for a smoke test
    .venv/bin/python -m bench --only a,b     # some scenarios

A simulated continuous-batching vLLM (testkit.fake_server, parameters in
SIM_ARGS, explained in bench/README.md) serves every contender in turn:
  B1  `paddleocr doc_parser --input FILE ...` once per file (PaddleOCR's documented CLI)
  B2  one warm `PaddleOCRVL(...).predict([all files])` in one process (only predict timed)
  ocrvl  `ocrvl convert FILES --server-url URL` (a, b) and `ocrvl run` + inbox (c)
  ideal  (a, b) ocrvl's pages replayed from the server's request log by a client with
         exactly max_concurrency requests always in flight and no PDF work: the ceiling
Layout detection is off for everyone (no model weights offline). (a) and (b) run on
--draws sets of documents (other seeds, so other output lengths): one set's ratio depends
on which long pages happen to come last, so the targets are judged on the median. The
table goes to stdout and, with --write, into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psutil  # noqa: E402

from bench.loadgen import images, measure, replay  # noqa: E402
from ocrvl_daemon.config.model import PipelineConfig  # noqa: E402
from testkit.documents import make_pdf  # noqa: E402
from testkit.harness import free_port, start_fake_server, wait_until  # noqa: E402
from testkit.runner import ocrvl_argv, ocrvl_env, write_config  # noqa: E402

MODEL = "PaddleOCR-VL-1.6-0.9B"
PAGE_HEIGHT = 792  # points: a 400..1380 x 792 pt page, 800..2760 x 1584 px at 2x
# The simulated server: a data-centre GPU's shape (peak near 64 in flight, lower beyond)
# at ~0.37x its speed, i.e. an RTX-4060-class card sped up ~1.7x (see bench/README.md).
SIM_ARGS = (
    "--step-t0-ms", "7.92",
    "--step-t1-ms", "0.0554",
    "--prefill-ms-per-image", "30",
    "--output-tokens", "lognormal:1000:0.4",
    "--max-num-seqs", "256",
    "--kv-capacity-tokens", "150000",
    "--max-model-len", "16384",
    "--disable-uvicorn-access-log",
)  # fmt: skip
CURVE = (1, 8, 16, 32, 64, 96, 128, 256)
# Real vLLM 0.26.0 serving PaddleOCR-VL on a data-centre GPU (shared/DESIGN.md): pages/s with
# N whole-page requests (1,000 output tokens) always in flight, and 150-token requests at best.
REAL_PAGES_PER_S = {1: 0.24, 16: 4.6, 64: 11.2, 256: 9.5}
REAL_SHORT_PAGES_PER_S = 17.0
SHORT_TOKENS = 150
MIN_QUEUED_SECONDS = 10.0  # a shorter span with work queued is not judged against the maximum
MAX_CONCURRENCY = PipelineConfig().max_concurrency  # ocrvl's default bound on pages in flight
IDEAL_SHARE = 0.97  # ocrvl's pages/s against the ideal client's, at least (the guard)


class RequestLog:
    """The simulator's `--request-log`: the answers given since a mark, in arrival order."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def mark(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def answered_since(self, mark: int) -> list[dict[str, Any]]:
        with self.path.open("rb") as f:
            f.seek(mark)
            records = [json.loads(line) for line in f.read().decode().splitlines()]
        return sorted((r for r in records if r["status"] == 200), key=lambda r: r["t"])


def seed(base: int, draw: int) -> int:
    """The seed of a document in draw `draw` (draw 0 keeps the seeds of earlier results)."""
    return base + 10_000 * draw


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- set-up checks ----------------------------------------------------------------------


def check_setup() -> str:
    """The paddleocr CLI, or exit telling what to install."""
    try:
        import docx  # noqa: F401
    except ImportError:
        sys.exit(
            "python-docx is missing: paddleocr 3.7.0's CLI crashes while saving without it.\n"
            f"Install the benchmark's extras: {sys.executable} -m pip install -r "
            f"{HERE / 'requirements.txt'}"
        )
    cli = shutil.which("paddleocr", path=str(Path(sys.executable).parent))
    if cli is None:
        sys.exit("the `paddleocr` command is not next to this Python; install ocrvl first")
    return cli


def machine() -> dict[str, str]:
    model = "?"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    return {
        "cpu": model,
        "cores": str(psutil.cpu_count(logical=True)),
        "ram": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        "python": platform.python_version(),
        "os": platform.platform(),
    }


# --- measuring a run against the server -------------------------------------------------


@dataclass
class Run:
    system: str
    scenario: str
    pages: int
    seconds: float
    draw: int = 0  # which set of documents (see --draws)
    warm_seconds: float | None = None
    occupancy: float = 0.0  # time-weighted mean active sequences while busy / max-num-seqs
    mean_active: float = 0.0
    server_tokens_per_s: float = 0.0
    queued_tokens_per_s: float | None = None  # while the client still had pages to send
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pages_per_s(self) -> float:
        return self.pages / (self.warm_seconds or self.seconds)


class Server:
    """A running simulator: its URL, statistics and request log."""

    def __init__(self, srv: Any, requests: RequestLog) -> None:
        self.srv = srv
        self.url = srv.url
        self.requests = requests

    def stats(self) -> dict[str, Any]:
        return httpx.get(self.url + "/fake/stats", timeout=10).json()

    def reset(self) -> dict[str, Any]:
        return httpx.post(self.url + "/fake/reset", timeout=10).json()

    def idle(self) -> bool:
        s = self.stats()
        return s["running"] == 0 and s["waiting"] == 0


@contextlib.contextmanager
def simulator(work: Path, name: str, output_tokens: str | None = None) -> Iterator[Server]:
    """The simulated server with SIM_ARGS (another output length if given), its request log
    in `work`."""
    args = list(SIM_ARGS)
    if output_tokens:
        args[args.index("--output-tokens") + 1] = output_tokens
    requests = RequestLog(work / f"requests-{name}.jsonl")
    with start_fake_server(free_port(), *args, "--request-log", str(requests.path),
                           ready_timeout=30) as srv:  # fmt: skip
        yield Server(srv, requests)


class Timeline:
    """The server's counters sampled every `interval` seconds while a contender runs."""

    def __init__(self, server: Server, received_before: int, interval: float = 0.25) -> None:
        self.server, self.received_before, self.interval = server, received_before, interval
        self.samples: list[tuple[float, int, float]] = []  # (time, received, tokens)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while True:
            s = self.server.stats()
            self.samples.append((time.monotonic(), s["requests_received"], s["generation_tokens"]))
            if self._stop.wait(self.interval):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def queued_tokens_per_s(self) -> float | None:
        """Generated tokens/s from the first request to the last one: the span in which the
        client still had work it had not sent, i.e. "enough work queued" (the drain of the
        last batch afterwards is the same for every client)."""
        if len(self.samples) < 2:
            return None
        last = self.samples[-1][1]
        start = next((i for i, x in enumerate(self.samples) if x[1] > self.received_before), None)
        end = next((i for i, x in enumerate(self.samples) if x[1] >= last), None)
        if start is None or end is None or end <= start:
            return None
        (t0, _, k0), (t1, _, k1) = self.samples[max(0, start - 1)], self.samples[end]
        if t1 - t0 < MIN_QUEUED_SECONDS:
            return None  # the work was all sent at once: never "enough queued" to judge
        return (k1 - k0) / (t1 - t0)


def measured(server: Server, run: Run, before: dict[str, Any], t0: float,
             timeline: Timeline) -> Run:  # fmt: skip
    timeline.stop()
    after = server.stats()
    run.occupancy = after["occupancy"]
    span = max(1e-9, time.monotonic() - t0)
    run.server_tokens_per_s = (after["generation_tokens"] - before["generation_tokens"]) / span
    run.queued_tokens_per_s = timeline.queued_tokens_per_s()
    # mean active over the whole run (idle gaps count as zero), from reset to now
    run.mean_active = after["mean_active"]
    return run


# --- contenders -------------------------------------------------------------------------


def run_b1(cli: str, server: Server, files: list[Path], out: Path, scenario: str,
           draw: int) -> Run:  # fmt: skip
    wait_until(server.idle, 300, what="an idle server")
    before = server.reset()
    timeline = Timeline(server, before["requests_received"])
    t0 = time.monotonic()
    for f in files:
        subprocess.run(
            [
                cli, "doc_parser", "--input", str(f),
                "--vl_rec_backend", "vllm-server",
                "--vl_rec_server_url", server.url + "/v1",
                "--use_layout_detection", "False",
                "--save_path", str(out),
            ],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
    seconds = time.monotonic() - t0
    pages = sum(_pages(f) for f in files)
    run = Run("B1 paddleocr CLI", scenario, pages, seconds, draw)
    return measured(server, run, before, t0, timeline)


B2_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from paddleocr import PaddleOCRVL
    url, files = sys.argv[1], sys.argv[2:]
    # More constructor arguments as JSON (bench.gpu's layout-on B2: layout detection on, the
    # layout engine and device ocrvl's worker would pass); PaddleX's defaults otherwise.
    more = json.loads(os.environ.get("OCRVL_B2_KWARGS") or "{}")
    p = PaddleOCRVL(vl_rec_backend="vllm-server", vl_rec_server_url=url,
                    **{"use_layout_detection": False, **more})
    t0 = time.monotonic()
    n = 0
    for res in p.predict(files):
        n += len(res.markdown.get("markdown_texts") or "") >= 0
    print(json.dumps({"pages": n, "seconds": time.monotonic() - t0}))
    """
)


def run_b2(server: Server, files: list[Path], scenario: str, draw: int) -> Run:
    wait_until(server.idle, 300, what="an idle server")
    proc = subprocess.Popen(
        [sys.executable, "-c", B2_SCRIPT, server.url + "/v1", *map(str, files)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    # Reset the server statistics when the first request arrives (construction excluded).
    start_count = server.stats()["requests_received"]
    mark = server.requests.mark()
    wait_until(
        lambda: server.stats()["requests_received"] > start_count or proc.poll() is not None,
        300, interval=0.02, what="B2's first request",
    )  # fmt: skip
    before = server.reset()
    timeline = Timeline(server, start_count)
    t0 = time.monotonic()
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"B2 failed: {stderr[-2000:]}")
    result = json.loads(stdout.strip().splitlines()[-1])
    run = Run("B2 warm predict()", scenario, result["pages"], result["seconds"], draw)
    run.extra["answers"] = server.requests.answered_since(mark)
    return measured(server, run, before, t0, timeline)


class Ocrvl:
    """`ocrvl ARGS` with stderr read line by line, each line's arrival time kept."""

    def __init__(self, *args: str | Path, env: dict[str, str] | None = None,
                 cpus: set[int] | None = None) -> None:  # fmt: skip
        """`cpus`: the cores it (and every process it starts) may run on."""
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            ocrvl_argv(*args), env=ocrvl_env(**(env or {})), stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True, preexec_fn=pinned(cpus),
        )  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line.rstrip()))

    def first(self, text: str) -> float | None:
        return next((t for t, line in list(self.lines) if text in line), None)

    def grep(self, text: str) -> list[str]:
        return [line for _, line in list(self.lines) if text in line]

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._done_reading()
        return code

    def _done_reading(self) -> None:
        """Let the reader take the last lines, then close the pipe (left open it is a file
        the garbage collector closes, with a ResourceWarning)."""
        self._reader.join(5)
        if self.proc.stderr is not None and not self._reader.is_alive():
            self.proc.stderr.close()

    def save(self, path: Path) -> None:
        """Write what it said to `path`, each line with its seconds since the start."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"+{t - self.t0:8.3f} {line}\n" for t, line in list(self.lines)),
                        encoding="utf-8")  # fmt: skip

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._done_reading()


def pinned(cpus: set[int] | None) -> Callable[[], None] | None:
    """A `preexec_fn` that keeps a child (and its children) on `cpus`; None for no limit."""
    if not cpus:
        return None
    chosen = set(cpus)
    return lambda: os.sched_setaffinity(0, chosen)


def run_ocrvl_convert(server: Server, files: list[Path], work: Path, scenario: str,
                      draw: int) -> Run:  # fmt: skip
    wait_until(server.idle, 300, what="an idle server")
    name = f"{scenario}{draw}"
    cfg = write_config(work / f"ocrvl-{name}.yaml", state_dir=str(work / f"state-{name}"))
    mark = server.requests.mark()
    before = server.reset()
    timeline = Timeline(server, before["requests_received"])
    t0 = time.monotonic()
    proc = Ocrvl("convert", "--config", cfg, "--server-url", server.url, *files)
    code = proc.wait(3600)
    seconds = time.monotonic() - t0
    if code != 0:
        raise RuntimeError("ocrvl convert failed:\n" + "\n".join(proc.grep("")[-30:]))
    ready = proc.first("ready in")
    run = Run("ocrvl convert", scenario, sum(_pages(f) for f in files), seconds, draw)
    run.warm_seconds = seconds - (ready - t0) if ready else None
    run.extra["concurrency"] = [line.split("] ")[-1] for line in proc.grep("concurrency")]
    run.extra["answers"] = server.requests.answered_since(mark)
    return measured(server, run, before, t0, timeline)


def run_ideal(ocrvl: Run, b2_answers: list[dict[str, Any]], work: Path) -> Run:
    """ocrvl's pages (their answers' lengths, in the order ocrvl sent them) replayed with
    exactly MAX_CONCURRENCY always in flight, on a simulator of its own that answers each
    request with the tokens asked for: the best any client held to that bound could do."""
    answers = ocrvl.extra["answers"]
    if sorted(a["digest"] for a in answers) != sorted(a["digest"] for a in b2_answers):
        log(f"({ocrvl.scenario}) draw {ocrvl.draw + 1}: ocrvl and B2 sent different pages; "
            "the ideal client replays ocrvl's")  # fmt: skip
    lengths = [a["tokens"] for a in answers]
    with simulator(work, f"ideal-{ocrvl.scenario}{ocrvl.draw}", "fixed:8192") as server:
        before = server.reset()
        timeline = Timeline(server, before["requests_received"])
        t0 = time.monotonic()
        seconds = replay(server.url, MODEL, lengths, MAX_CONCURRENCY)
        run = Run(f"ideal client, {MAX_CONCURRENCY} in flight", ocrvl.scenario, len(lengths),
                  seconds, ocrvl.draw)  # fmt: skip
        return measured(server, run, before, t0, timeline)


# --- scenario (c): the daemon with an inbox ---------------------------------------------


def drop(src: Path, inbox: Path) -> float:
    """Copy under a temporary name, then rename into the inbox; returns the drop time."""
    tmp = inbox / f".{src.name}.part"
    shutil.copyfile(src, tmp)
    t = time.monotonic()
    os.rename(tmp, inbox / src.name)
    return t


def drop_under_book(
    book: Path, smalls: list[Path], inbox: Path, *, gap: float, t0: float
) -> tuple[dict[str, float], dict[str, float]]:
    """Drop `smalls` into `inbox` `gap` s apart while `book` converts; wait for every
    Markdown. Returns when each small document was dropped and when its Markdown appeared."""
    dropped: dict[str, float] = {}
    done: dict[str, float] = {}

    def collect() -> None:
        for name in dropped:
            if name not in done and md_done(inbox, name):
                done[name] = time.monotonic()

    for doc in smalls:
        dropped[doc.name] = drop(doc, inbox)
        t_end = time.monotonic() + gap
        while time.monotonic() < t_end:
            collect()
            time.sleep(0.02)
    while len(done) < len(smalls) or not md_done(inbox, book.name):
        collect()
        if time.monotonic() - t0 > 3600:
            raise RuntimeError("the small documents under the book did not finish in an hour")
        time.sleep(0.02)
    return dropped, done


def md_done(inbox: Path, name: str) -> bool:
    return (inbox / (Path(name).stem + ".md")).exists()


def process_cpu(proc: psutil.Process) -> tuple[float, float]:
    """(a process's own CPU seconds, its children's: the daemon and its engine worker, a vLLM
    API server and its engine core)."""
    mine = proc.cpu_times()
    kids = 0.0
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            t = child.cpu_times()
            kids += t.user + t.system
    return mine.user + mine.system, kids


def start_daemon(server_url: str, work: Path, name: str, *,
                 pipeline: dict[str, Any] | None = None) -> tuple[Ocrvl, Path, psutil.Process]:
    """`ocrvl run` with an inbox of its own against `server_url`; `pipeline` settings go
    into its config."""
    inbox = work / f"inbox-{name}"
    inbox.mkdir()
    cfg = write_config(
        work / f"ocrvl-{name}.yaml",
        state_dir=str(work / f"state-{name}"),
        inbox={"paths": [str(inbox)], "stable_seconds": 0.5, "polling": False},
        server={"mode": "external", "url": server_url},
        pipeline=pipeline or {},
    )
    daemon = Ocrvl("run", "--config", cfg)
    wait_until(lambda: daemon.first("ready") is not None, 120, what="the daemon's ready line")
    wait_until(lambda: daemon.first("engine worker") and daemon.first("ready in"), 120,
               what="the engine worker")  # fmt: skip
    return daemon, inbox, psutil.Process(daemon.proc.pid)


def solo_times(server: Server, docs: list[Path], work: Path, *,
               pipeline: dict[str, Any] | None = None) -> dict[str, float]:
    """Each document converted alone (drop -> `.md`) in an idle daemon of its own."""
    wait_until(server.idle, 300, what="an idle server")
    daemon, inbox, _ = start_daemon(server.url, work, "c-solo", pipeline=pipeline)
    try:
        times = {}
        for doc in docs:
            t = drop(doc, inbox)
            wait_until(
                functools.partial(md_done, inbox, doc.name), 300, interval=0.02, what=doc.name
            )
            times[doc.name] = time.monotonic() - t
        return times
    finally:
        daemon.stop()


def run_scenario_c(server: Server, book: Path, smalls: list[Path],
                   work: Path) -> tuple[Run, dict[str, Any]]:  # fmt: skip
    """The book, then the small documents dropped `gap` seconds apart while it runs; each small
    document's drop -> `.md` time is compared with its own time alone (another daemon, so
    nothing comes from the page cache)."""
    alone = solo_times(server, smalls, work)
    wait_until(server.idle, 300, what="an idle server")
    daemon, inbox, proc = start_daemon(server.url, work, "c")
    try:
        cpu0, _ = process_cpu(proc)
        before = server.reset()
        timeline = Timeline(server, before["requests_received"])
        t0 = drop(book, inbox)
        wait_until(lambda: server.stats()["running"] >= 16, 120, what="the book under way")
        dropped, done = drop_under_book(book, smalls, inbox, gap=1.5, t0=t0)
        seconds = time.monotonic() - t0
        pages = _pages(book) + sum(_pages(s) for s in smalls)
        cpu1, _ = process_cpu(proc)
        run = Run("ocrvl run (daemon)", "c", pages, seconds)
        measured(server, run, before, t0, timeline)
        busy = {n: done[n] - dropped[n] for n in dropped}
        ratios = sorted(busy[n] / alone[n] for n in busy)
        worst = sorted(busy, key=lambda n: busy[n] / alone[n])[-3:]
        info = {
            "solo_median_s": statistics.median(alone.values()),
            "busy_median_s": statistics.median(busy.values()),
            "busy_max_s": max(busy.values()),
            "ratio_median": statistics.median(ratios),
            "ratio_p90": ratios[int(0.9 * (len(ratios) - 1))],
            "ratio_max": ratios[-1],
            "worst": [
                f"{n}: dropped {dropped[n] - t0:.1f} s after the book, {busy[n]:.1f} s "
                f"(alone {alone[n]:.1f} s)"
                for n in reversed(worst)
            ],
            "daemon_cpu_ms_per_page": (cpu1 - cpu0) * 1000 / pages,
            "concurrency": [line.split("] ")[-1] for line in daemon.grep("concurrency")],
        }
        return run, info
    finally:
        daemon.stop()


def run_memory_idle(pages: int, work: Path, idle_seconds: float) -> dict[str, Any]:
    """A daemon converts one `pages`-page PDF of small pages on an instant server; RSS sampled;
    then it idles for `idle_seconds` and its CPU (with the worker's) is measured."""
    pdf = make_pdf(work / "mem" / f"many{pages}.pdf", pages, height=200, seed=7)
    port = free_port()
    with start_fake_server(port, "--disable-uvicorn-access-log", "--output-tokens", "fixed:64"):
        daemon, inbox, proc = start_daemon(f"http://127.0.0.1:{port}", work, "mem")
        try:
            samples: list[tuple[float, float, float]] = []
            cpu0, _ = process_cpu(proc)
            t0 = drop(pdf, inbox)
            while not md_done(inbox, pdf.name):
                kids = proc.children(recursive=True)
                worker = max((k.memory_info().rss for k in kids), default=0)
                samples.append((time.monotonic() - t0, proc.memory_info().rss, worker))
                if time.monotonic() - t0 > 1800:
                    raise RuntimeError("memory scenario did not finish")
                time.sleep(1.0)
            seconds = time.monotonic() - t0
            cpu1, _ = process_cpu(proc)
            time.sleep(3)  # let the last page settle
            rss_d = proc.memory_info().rss
            rss_w = max((k.memory_info().rss for k in proc.children(recursive=True)), default=0)
            c0 = process_cpu(proc)
            i0 = time.monotonic()
            time.sleep(idle_seconds)
            c1 = process_cpu(proc)
            idle_wall = time.monotonic() - i0
            third = max(1, len(samples) // 3)
            return {
                "pages": pages,
                "seconds": seconds,
                "daemon_cpu_ms_per_page": (cpu1 - cpu0) * 1000 / pages,
                "daemon_rss_mib_end": rss_d / 2**20,
                "worker_rss_mib_end": rss_w / 2**20,
                "daemon_rss_mib_first_third_max": max(s[1] for s in samples[:third]) / 2**20,
                "daemon_rss_mib_last_third_max": max(s[1] for s in samples[-third:]) / 2**20,
                "worker_rss_mib_first_third_max": max(s[2] for s in samples[:third]) / 2**20,
                "worker_rss_mib_last_third_max": max(s[2] for s in samples[-third:]) / 2**20,
                "idle_daemon_pct_core": (c1[0] - c0[0]) / idle_wall * 100,
                "idle_worker_pct_core": (c1[1] - c0[1]) / idle_wall * 100,
            }
        finally:
            daemon.stop()


# --- helpers ----------------------------------------------------------------------------

_PAGES: dict[Path, int] = {}


def _pages(path: Path) -> int:
    if path not in _PAGES:
        import pypdfium2

        doc = pypdfium2.PdfDocument(str(path))
        _PAGES[path] = len(doc)
        doc.close()
    return _PAGES[path]


def warmup_seconds(concurrency: int) -> float:
    return min(30.0, 4.0 + concurrency * 0.12)


def curve(server: Server, points: tuple[int, ...], seconds: float) -> list[Any]:
    jpegs = images(200)
    out = []
    for c in points:
        wait_until(server.idle, 300, what="an idle server")
        p = measure(server.url, MODEL, c, warmup_seconds(c), seconds, jpegs)
        log(f"curve: {c} in flight: {p.tokens_per_s:.0f} tokens/s, occupancy {p.occupancy:.3f}")
        out.append(p)
    return out


def short_pages_per_s(seconds: float, work: Path) -> float:
    """Pages/s with SHORT_TOKENS-token answers, 64 in flight, on a simulator of its own (its
    short pages must not count in the main one's tokens per page)."""
    with simulator(work, "short") as server:
        p = measure(server.url, MODEL, 64, warmup_seconds(64), seconds, images(200), SHORT_TOKENS)
    log(f"curve: 64 in flight, {SHORT_TOKENS}-token answers: {p.pages_per_s:.2f} pages/s")
    return p.tokens_per_s / SHORT_TOKENS


def calibration(res: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(shape, real vLLM, simulator) for each shape of DESIGN.md the curve can be held to."""
    sim = {p.concurrency: p.tokens_per_s / res["tokens_per_page"] for p in res["curve"]}
    real = REAL_PAGES_PER_S
    rows = []
    if 16 in sim and 64 in sim:
        rows.append(("pages/s at 64 in flight / at 16", real[64] / real[16], sim[64] / sim[16]))
    if 256 in sim and 64 in sim:
        rows.append(("pages/s at 256 in flight / at 64", real[256] / real[64], sim[256] / sim[64]))
    if 1 in sim and 64 in sim:
        rows.append(("pages/s at 64 in flight / at 1", real[64] / real[1], sim[64] / sim[1]))
        rows.append(("a page's time at 64 in flight / alone", 64 * real[1] / real[64],
                     64 * sim[1] / sim[64]))  # fmt: skip
    if res.get("short_pages_per_s") and 64 in sim:
        short = res["short_pages_per_s"] / sim[64]
        rows.append((f"pages/s of {SHORT_TOKENS}-token pages / whole pages, 64 in flight",
                     REAL_SHORT_PAGES_PER_S / real[64], short))  # fmt: skip
    return rows


# --- the report -------------------------------------------------------------------------


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def report(res: dict[str, Any]) -> str:
    tpp = res["tokens_per_page"]
    lines = ["## Machine", ""]
    for k, v in res["machine"].items():
        lines.append(f"- {k}: {v}")
    lines += ["", "## The simulated server", "", "`" + " ".join(SIM_ARGS) + "`", ""]
    if res.get("curve"):
        best = max(res["curve"], key=lambda p: p.tokens_per_s)
        lines += [
            "Direct load generator (N requests always in flight, no PDF pipeline):",
            "",
            "| in flight | pages/s | tokens/s | occupancy (mean active / max-num-seqs) "
            "| preemptions |",
            "|---:|---:|---:|---:|---:|",
        ]
        for p in res["curve"]:
            mark = " **peak**" if p is best else ""
            lines.append(
                f"| {p.concurrency}{mark} | {p.tokens_per_s / tpp:.2f} | {p.tokens_per_s:.0f} "
                f"| {p.occupancy:.3f} | {p.preemptions} |"
            )
        lines += ["", f"Mean output: {tpp:.0f} tokens per page.", ""]
        rows = calibration(res)
        if rows:
            lines += [
                "Calibration: the simulator's shapes against real vLLM 0.26.0 (DESIGN.md; "
                "ratios, so the speed of the GPU cancels out):",
                "",
                "| shape | real vLLM | simulator |",
                "|---|---:|---:|",
                *(f"| {what} | {real:.2f} | {sim:.2f} |" for what, real, sim in rows),
                "",
            ]
    peak = res.get("peak_pages_per_s")
    lines += [
        "## Scenarios",
        "",
        "| scenario | draw | system | pages | wall s | pages/s | vs B1 | vs B2 "
        "| % of server max: run | while work queued | occupancy | mean in flight |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for sc, runs in res["scenarios"].items():
        draws = contenders(runs)
        for r in runs:
            b1, b2 = draws[0].get("B1"), draws[r.draw].get("B2")
            vs1 = r.pages_per_s / b1.pages_per_s if b1 else None
            vs2 = r.pages_per_s / b2.pages_per_s if b2 else None
            of_max = r.pages_per_s / peak * 100 if peak else None
            queued = queued_share(r, res)
            wall = f"{r.seconds:.1f}"
            if r.warm_seconds:
                wall += f" ({r.warm_seconds:.1f} warm)"
            lines.append(
                f"| {sc} | {r.draw + 1} | {r.system} | {r.pages} | {wall} | {r.pages_per_s:.2f} "
                f"| {fmt(vs1)} "
                f"| {fmt(vs2)} | {fmt(of_max, '.0f')} "
                f"| {fmt(None if queued is None else queued * 100, '.0f')} | {r.occupancy:.3f} "
                f"| {r.mean_active:.1f} |"
            )
    lines += [""]
    if res.get("c"):
        c = res["c"]
        lines += [
            "## Scenario (c): small documents dropped while a 300-page book runs",
            "",
            f"- each alone (drop -> `.md`, idle daemon): median {c['solo_median_s']:.2f} s",
            f"- while the book runs: median {c['busy_median_s']:.2f} s, "
            f"max {c['busy_max_s']:.2f} s",
            f"- each against its own time alone: median {c['ratio_median']:.2f}x, "
            f"p90 {c['ratio_p90']:.2f}x, worst {c['ratio_max']:.2f}x "
            f"({'; '.join(c['worst'])})",
            f"- daemon CPU outside the worker: {c['daemon_cpu_ms_per_page']:.1f} ms per page",
            "",
        ]
    if res.get("mem"):
        m = res["mem"]
        lines += [
            f"## Daemon cost ({m['pages']} small pages, instant server, `ocrvl run`)",
            "",
            f"- {m['pages']} pages in {m['seconds']:.0f} s; daemon CPU outside the worker: "
            f"{m['daemon_cpu_ms_per_page']:.1f} ms per page",
            f"- RSS daemon: max {m['daemon_rss_mib_first_third_max']:.0f} MiB in the first "
            f"third, {m['daemon_rss_mib_last_third_max']:.0f} MiB in the last third, "
            f"{m['daemon_rss_mib_end']:.0f} MiB at the end",
            f"- RSS worker: max {m['worker_rss_mib_first_third_max']:.0f} MiB in the first "
            f"third, {m['worker_rss_mib_last_third_max']:.0f} MiB in the last third, "
            f"{m['worker_rss_mib_end']:.0f} MiB at the end",
            f"- idle {res['idle_seconds']:.0f} s: daemon {m['idle_daemon_pct_core']:.2f}% "
            f"of a core, worker {m['idle_worker_pct_core']:.2f}%",
            "",
        ]
    lines += ["## Targets", ""]
    for name, ok, detail in res["targets"]:
        lines.append(f"- [{'x' if ok else ' '}] {name}: {detail}")
    return "\n".join(lines) + "\n"


def queued_share(run: Run, res: dict[str, Any]) -> float | None:
    """The server's throughput while the client still had work to send, as a share of the
    server's maximum (both in generated tokens/s)."""
    peak = res.get("peak_tokens_per_s")
    if not peak or run.queued_tokens_per_s is None:
        return None
    return run.queued_tokens_per_s / peak


def contenders(runs: list[Run]) -> dict[int, dict[str, Run]]:
    """Runs by draw, then by contender ("ocrvl", "B1", "B2"). B1 runs in draw 0 only."""
    out: dict[int, dict[str, Run]] = {}
    for r in runs:
        out.setdefault(r.draw, {})[r.system.split()[0]] = r
    return out


def targets(res: dict[str, Any]) -> list[tuple[str, bool, str]]:
    out = []
    sc = res["scenarios"]
    for name in ("a", "b"):
        if name not in sc:
            continue
        draws = contenders(sc[name])
        pairs = [(d["ocrvl"], d["B2"]) for d in draws.values() if "ocrvl" in d and "B2" in d]
        if pairs:
            ratios = [o.pages_per_s / b2.pages_per_s for o, b2 in pairs]
            median = statistics.median(ratios)
            detail = f"{median:.2f}x; each draw: " + ", ".join(f"{x:.2f}x" for x in ratios)
            ceilings = [d["ideal"].pages_per_s / d["B2"].pages_per_s
                        for d in draws.values() if "ideal" in d and "B2" in d]  # fmt: skip
            if ceilings:
                detail += (f"; an ideal client with {MAX_CONCURRENCY} in flight on the same "
                           "pages: " + ", ".join(f"{x:.2f}x" for x in ceilings))  # fmt: skip
            out.append((f"({name}) ocrvl >= 1.2x B2 (median of the draws)", median >= 1.2,
                        detail))  # fmt: skip
        of_ideal = [d["ocrvl"].pages_per_s / d["ideal"].pages_per_s
                    for d in draws.values() if "ocrvl" in d and "ideal" in d]  # fmt: skip
        if of_ideal:
            # The simulator's own target (DESIGN.md decisions): throughput is judged on the
            # real GPU, and here ocrvl must stay this close to a client that does nothing else.
            share = statistics.median(of_ideal)
            each = ", ".join(f"{x:.1%}" for x in of_ideal)
            out.append((f"({name}) ocrvl >= {IDEAL_SHARE:.0%} of the ideal client (median of "
                        "the draws; the regression guard)", share >= IDEAL_SHARE,
                        f"{share:.1%}; each draw: {each}"))  # fmt: skip
        b1 = draws.get(0, {}).get("B1")
        if name == "b" and b1 and pairs:
            ratio = statistics.median(o.pages_per_s for o, _ in pairs) / b1.pages_per_s
            out.append(("(b) ocrvl >= 5x B1", ratio >= 5, f"{ratio:.2f}x"))
    for name, runs in sc.items():
        shares = [(queued_share(r, res), r) for r in runs if r.system.startswith("ocrvl")]
        judged = [(share, r) for share, r in shares if share is not None]
        if judged:
            share, r = min(judged, key=lambda x: x[0])
            lowest = f"lowest of {len(judged)} runs: " if len(judged) > 1 else ""
            out.append(
                (f"({name}) ocrvl at >= 90% of the server's maximum while work is queued",
                 share >= 0.9,
                 f"{lowest}{share:.0%} ({r.queued_tokens_per_s:.0f} of "
                 f"{res['peak_tokens_per_s']:.0f} tokens/s; whole run incl. the last "
                 f"batch's drain {r.pages_per_s / res['peak_pages_per_s']:.0%})")
            )  # fmt: skip
    if res.get("c"):
        c = res["c"]
        out.append(
            ("(c) small documents within 2x their solo time", c["ratio_max"] <= 2,
             f"worst {c['ratio_max']:.2f}x, median {c['ratio_median']:.2f}x")
        )  # fmt: skip
    if res.get("mem"):
        m = res["mem"]
        idle = m["idle_daemon_pct_core"] + m["idle_worker_pct_core"]
        out.append(("idle CPU < 1% of a core", idle < 1, f"{idle:.2f}%"))
        grow = m["worker_rss_mib_last_third_max"] / max(1.0, m["worker_rss_mib_first_third_max"])
        out.append(("worker memory bounded", grow < 1.5, f"last/first third {grow:.2f}x"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", default="curve,a,b,c,mem", help="comma-separated parts")
    ap.add_argument("--quick", action="store_true", help="small documents (smoke test)")
    ap.add_argument(
        "--b1-files",
        type=int,
        default=10,
        help="(b) B1 runs on this many of the 100 files (its rate is per page)",
    )
    ap.add_argument(
        "--draws", type=int, default=3, help="sets of documents (seeds) for (a) and (b)"
    )
    ap.add_argument("--pages", type=int, default=1000, help="pages of the memory scenario")
    ap.add_argument("--idle-seconds", type=float, default=30.0)
    ap.add_argument("--write", action="store_true", help="write bench/RESULTS.md")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)  # fmt: skip
    parts = set(args.only.split(","))
    cli = check_setup()
    q = args.quick
    work = Path(tempfile.mkdtemp(prefix="ocrvl-bench-"))
    log(f"work directory {work}")
    res: dict[str, Any] = {"machine": machine(), "scenarios": {}, "idle_seconds": args.idle_seconds}
    try:

        def documents(name: str, draw: int) -> list[Path]:
            folder = work / name / f"draw{draw}"
            if name == "a":
                return [make_pdf(folder / "book.pdf", 20 if q else 200, height=PAGE_HEIGHT,
                                 seed=seed(1, draw))]  # fmt: skip
            return [
                make_pdf(
                    folder / f"letter{i:03d}.pdf", 2, height=PAGE_HEIGHT, seed=seed(100 + i, draw)
                )
                for i in range(10 if q else 100)
            ]

        with simulator(work, "main") as server:
            if "curve" in parts:
                res["curve"] = curve(server, (16, 64, 128) if q else CURVE, 6 if q else 12)
                res["short_pages_per_s"] = short_pages_per_s(6 if q else 12, work)
                best = max(res["curve"], key=lambda p: p.tokens_per_s)
                res["peak_tokens_per_s"] = best.tokens_per_s
            for name in ("a", "b"):
                if name not in parts:
                    continue
                runs = []
                for draw in range(args.draws):
                    files = documents(name, draw)
                    log(f"({name}) draw {draw + 1}/{args.draws}: ocrvl convert")
                    ocrvl = run_ocrvl_convert(server, files, work, name, draw)
                    log(f"({name}) draw {draw + 1}: B2")
                    b2 = run_b2(server, files, name, draw)
                    log(f"({name}) draw {draw + 1}: ocrvl's pages replayed by an ideal client")
                    runs += [ocrvl, b2, run_ideal(ocrvl, b2.extra["answers"], work)]
                    if draw == 0:  # B1's rate is per file and does not depend on the draw
                        b1_files = files if name == "a" else files[: args.b1_files]
                        log(f"({name}) B1 on {len(b1_files)} file(s)")
                        runs.append(run_b1(cli, server, b1_files, work / f"b1-{name}", name, 0))
                    for r in (r for r in runs if r.draw == draw):
                        log(f"({name}) draw {r.draw + 1} {r.system}: {r.pages_per_s:.2f} "
                            f"pages/s {r.extra.get('concurrency', '')}")  # fmt: skip
                res["scenarios"][name] = runs
            if "c" in parts:
                big = make_pdf(work / "c" / "big.pdf", 30 if q else 300, height=PAGE_HEIGHT,
                               seed=2)  # fmt: skip
                smalls = [
                    make_pdf(work / "c" / f"small{i:02d}.pdf", 2, height=PAGE_HEIGHT, seed=300 + i)
                    for i in range(5 if q else 30)
                ]
                log("(c) ocrvl run with an inbox")
                run, info = run_scenario_c(server, big, smalls, work)
                res["scenarios"]["c"] = [run]
                res["c"] = info
                log(f"(c) {info}")
            final = server.stats()
            res["tokens_per_page"] = (
                final["completion_tokens"] / final["requests_completed"]
                if final["requests_completed"] else 1000.0
            )  # fmt: skip
        if res.get("peak_tokens_per_s"):
            res["peak_pages_per_s"] = res["peak_tokens_per_s"] / res["tokens_per_page"]
        if "mem" in parts:
            log(f"memory and idle: {args.pages} pages")
            res["mem"] = run_memory_idle(100 if q else args.pages, work, args.idle_seconds)
            log(f"memory: {res['mem']}")
        res["targets"] = targets(res)
        text = report(res)
        print(text)
        if args.write:
            (HERE / "RESULTS.md").write_text(
                "# Benchmark results\n\nMeasured with `python bench/run.py --write` "
                f"on {time.strftime('%Y-%m-%d')}. See bench/README.md for what is simulated.\n\n"
                + text,
                encoding="utf-8",
            )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

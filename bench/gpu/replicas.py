"""Several vLLM servers on one GPU (`server.replicas`) against one, on a real GPU (issue 19).

    python -m bench.gpu.replicas --model-dir DIR [--vllm-pythonpath SITE] [--replicas 1,2,3]
    python -m bench.gpu.replicas --fake --replicas 1,2 --pages 8     # the dry run (no GPU)

For each N in `--replicas`, one after another, on the same `--pages`-page book:
  1. `ocrvl run` (a daemon with an inbox) whose managed server has `server.replicas: N` and
     ocrvl's own `auto` plan (the product divides the card between the replicas: that is
     what is measured); waited for until `ocrvl status --json` shows N ready endpoints and
     the log every engine worker ready (start_s: daemon start -> all ready); then each
     replica gets 32 warm-up pages (a fresh vLLM's first requests wait for its lazy
     start-up work: in the 2026-12-02 run, without this, the first contender lost ~4 s)
  2. N = 1 only: B2, one warm `PaddleOCRVL(...).predict([book])`, on that one server
  3. `ocrvl convert` with `server: {mode: external, urls: [the N replicas]}`: ocrvl's
     dispatcher over the replicas (timed from the worker's ready line and from the start)
  4. the book dropped into the daemon's inbox: drop -> `.md`, the managed replicas end to end
  5. the daemon stopped (it stops its servers); then the ports closed and, on a GPU, its
     memory back near the reading before the first start, so the next N plans on an idle card
Each contender starts with every replica idle; the replicas' requests running are summed
into one timeline. Writes `--results` (default bench/gpu/replicas_gpu.json) after each N,
so a timeout keeps what finished; `--merge` keeps the entries of N not run now. Targets:
N >= 2 converts >= 1.5x N = 1 and >= 2x B2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gpu.run import (
    PAGE_HEIGHT,
    PIPELINE,
    WORKER_READY,
    Bench,
    Result,
    gpu_name,
    log,
    warm_up,
)
from bench.gpu.teardown import stops_children
from bench.gpu.vllm_server import Metrics, managed_vllm, model_dir_parser, version
from bench.run import Ocrvl, drop, md_done
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.server.placement import decide_placement
from testkit.documents import make_pdf
from testkit.harness import free_port, wait_until
from testkit.runner import managed_fake_server, run_ocrvl, write_config

HERE = Path(__file__).resolve().parent
FAKE_ANSWERS = ("--output-tokens", "lognormal:100:0.5", "--disable-uvicorn-access-log")
START_TIMEOUT_S = 900  # N vLLM starts, one after another (a launch turn per GPU)
GPU_FREE_TIMEOUT_S = 120
GPU_FREE_MARGIN_MIB = 1024  # memory used above the first reading that still counts as free
SETTINGS = re.compile(r"vLLM settings: (.*)$")
TARGET_VS_ONE, TARGET_VS_B2 = 1.5, 2.0


def consecutive_free_ports(count: int) -> int:
    """The first of `count` ports in a row that nothing listens on (replicas take port..)."""
    for _ in range(50):
        first = free_port()
        if all(not port_open(p) for p in range(first, first + count)):
            return first
    raise RuntimeError(f"no {count} free ports in a row")


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def gpu_memory_used_mib() -> int | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20, check=True).stdout  # fmt: skip
        return int(out.split()[0])
    return None


def planned_settings(line: str) -> dict[str, str]:
    """ocrvl's "vLLM settings: gpu-memory-utilization 0.45, max-num-seqs 128" as a dict."""
    m = SETTINGS.search(line)
    pairs = (item.strip().split(" ", 1) for item in m.group(1).split(",")) if m else ()
    return {p[0]: p[1] for p in pairs if len(p) == 2}


class ServersFailed(RuntimeError):
    """Every server of the daemon is in state "failed" (ocrvl gave up on them)."""

    def __init__(self, last_error: str, tail: str = "") -> None:
        # the last line is the error itself: what a caller that keeps one line shows
        super().__init__(f"every server failed; ocrvl run's log ends:\n{tail}\n{last_error}")
        self.last_error = last_error


def all_failed(status: dict[str, Any]) -> str | None:
    """The last error where `ocrvl status --json` shows every server failed (None while any
    is starting, ready or restarting, or none is listed yet)."""
    servers = status.get("servers") or []
    overall = status.get("server") or {}
    if servers and all(s.get("state") == "failed" for s in servers):
        errors = [s.get("last_error") for s in servers if s.get("last_error")]
        return str(errors[0] if errors else overall.get("last_error") or "no error given")
    if not servers and overall.get("state") == "failed":
        return str(overall.get("last_error") or "no error given")
    return None


class ReplicaDaemon:
    """`ocrvl run` in a work dir of its own, its managed server with `server.replicas: N`;
    `server` adds keys to its `server:` section (`vllm_args` and `env` merged into the
    launcher's)."""

    def __init__(self, n: int, work: Path, args: argparse.Namespace,
                 server: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.n, self.work, self.fake = n, work, args.fake
        self.port = consecutive_free_ports(n)
        self.inbox = work / "inbox"
        self.inbox.mkdir(parents=True)
        if args.fake:
            sections: dict[str, Any] = {"server": managed_fake_server(self.port, *FAKE_ANSWERS,
                                                                      replicas=n)}  # fmt: skip
        else:
            sections = managed_vllm(args.model_dir, args.vllm_python, args.vllm_pythonpath,
                                    self.port, replicas=n)  # fmt: skip
        extra = dict(server or {})
        launcher = sections["server"]
        launcher["vllm_args"] = {**launcher.get("vllm_args", {}), **extra.pop("vllm_args", {})}
        if "env" in extra:
            launcher["env"] = {**launcher.get("env", {}), **extra.pop("env")}
        launcher.update(extra)
        self.config = write_config(work / "ocrvl.yaml", state_dir=str(work / "state"),
                                   inbox={"paths": [str(self.inbox)], "stable_seconds": 0.5,
                                          "polling": False}, **sections)  # fmt: skip
        self.urls: list[str] = []
        self.proc: Ocrvl | None = None

    def start(self) -> float:
        """Start; wait until N endpoints and every engine worker are ready; returns seconds."""
        t0 = time.monotonic()
        self.proc = Ocrvl("run", "--config", self.config)
        try:
            wait_until(self._ready, START_TIMEOUT_S, interval=1,
                       ignore=(ValueError, subprocess.TimeoutExpired),
                       what=f"{self.n} replicas and the engine workers ready")  # fmt: skip
        except AssertionError as exc:  # the work dir goes: what ocrvl said must come along
            raise RuntimeError(f"{exc}; ocrvl run's log ends:\n{self.tail()}") from exc
        return time.monotonic() - t0

    def tail(self) -> str:
        assert self.proc is not None
        return "\n".join(self.proc.grep("")[-60:])

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.proc.poll() is not None:
            raise RuntimeError(f"ocrvl run exited; its log ends:\n{self.tail()}")
        out = run_ocrvl("status", "--config", self.config, "--json", timeout=60)
        status = json.loads(out.stdout) if out.returncode == 0 else {}
        failed = all_failed(status)
        if failed is not None:  # ocrvl has given up: waiting on would only spend the budget
            raise ServersFailed(failed, self.tail())
        servers = status.get("servers") or []
        if len(servers) != self.n or any(s["state"] != "ready" for s in servers):
            return False
        workers = sum(bool(WORKER_READY.search(line)) for line in self.proc.grep("ready in"))
        if workers < decide_placement(Config(pipeline=PIPELINE)).workers:
            return False
        self.urls = [s["url"].rstrip("/").removesuffix("/v1") for s in servers]
        return True

    def settings(self) -> list[dict[str, str]]:
        """Each launch's vLLM settings as ocrvl planned them, in launch order."""
        assert self.proc is not None
        return [planned_settings(line) for line in self.proc.grep("vLLM settings:")]

    def stop(self, gpu_baseline_mib: int | None) -> None:
        """Stop the daemon (it stops its servers), then wait for the ports and the GPU."""
        if self.proc is None:
            return
        self.proc.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.proc.wait(180)  # vLLM's own shutdown, N of them
        self.proc.stop()  # SIGKILL if it is still there; reaped
        ports = range(self.port, self.port + self.n)
        wait_until(lambda: not any(port_open(p) for p in ports), 60, interval=0.5,
                   what=f"ports {ports.start}-{ports.stop - 1} closed")  # fmt: skip
        if self.fake or gpu_baseline_mib is None:
            return
        limit = gpu_baseline_mib + GPU_FREE_MARGIN_MIB
        with contextlib.suppress(AssertionError):  # wait_until's timeout: warned below
            wait_until(lambda: (gpu_memory_used_mib() or 0) <= limit, GPU_FREE_TIMEOUT_S,
                       interval=1, what="the GPU's memory freed")  # fmt: skip
        used = gpu_memory_used_mib()
        if used is not None and used > limit:
            log(f"warning: {used} MiB of the GPU still used (before: {gpu_baseline_mib} MiB)")


def drop_to_md(bench: Bench, daemon: ReplicaDaemon) -> Result:
    def run() -> tuple[float, float, int]:
        t0 = drop(bench.book, daemon.inbox)
        wait_until(lambda: md_done(daemon.inbox, bench.book.name), 3600, interval=0.02,
                   what="the book's .md")  # fmt: skip
        return t0, time.monotonic(), bench.pages

    return bench.measure(f"ocrvl run, {daemon.n} replicas", "drop -> .md, managed replicas",
                         run)  # fmt: skip


def one_count(n: int, args: argparse.Namespace, work: Path, book: Path, res: dict[str, Any],
              gpu_baseline: int | None) -> dict[str, Any]:  # fmt: skip
    """Steps 1-5 for `server.replicas: n`; returns its entry (B2 goes into `res`)."""
    daemon = ReplicaDaemon(n, work / f"replicas-{n}", args)
    log_dir = args.log_dir or daemon.work
    log(f"{n} replica(s): starting ocrvl run (ports from {daemon.port})")
    try:
        start_s = daemon.start()
        log(f"{n} replica(s) ready in {start_s:.1f} s at {', '.join(daemon.urls)}")
        res.setdefault("vllm", version(daemon.urls[0]))
        warm_up(daemon.urls, daemon.work)
        metrics = Metrics(*daemon.urls)
        bench = Bench(daemon.urls[0], daemon.work, book, args.pages, PIPELINE.max_concurrency,
                      metrics, log_dir)  # fmt: skip
        try:
            if n == 1:
                res["b2_pages_per_s"] = bench.b2().pages_per_s
            conv = bench.convert(f"ocrvl convert, {n} replicas",
                                 server={"mode": "external", "urls": daemon.urls})
            run = drop_to_md(bench, daemon)
        finally:
            metrics.stop()
        return {
            "replicas": n, "start_s": round(start_s, 1), "urls": daemon.urls,
            "vllm_settings": daemon.settings(),
            "convert_pages_per_s": round(conv.pages_per_s, 3),
            "convert_from_start_pages_per_s": round(conv.extra["pages_per_s_from_start"], 3),
            "run_pages_per_s": round(run.pages_per_s, 3),
            "convert_s": round(conv.seconds, 1), "run_s": round(run.seconds, 1),
            "timeline": conv.timeline, "run_timeline": run.timeline,
            "preemptions": conv.preemptions + run.preemptions,
            "concurrency": conv.extra.get("concurrency"),
        }  # fmt: skip
    finally:
        daemon.stop(gpu_baseline)
        if daemon.proc is not None:
            daemon.proc.save(log_dir / f"ocrvl-run-{n}-replicas.log")


def ratios(res: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Each N's convert against N = 1's and against B2."""
    entries = res["replicas"]
    one = (entries.get("1") or {}).get("convert_pages_per_s")
    b2 = res.get("b2_pages_per_s")
    return {k: {"vs_one": round(e["convert_pages_per_s"] / one, 3) if one else None,
                "vs_b2": round(e["convert_pages_per_s"] / b2, 3) if b2 else None}
            for k, e in entries.items()}  # fmt: skip


def report(res: dict[str, Any]) -> str:
    lines = [
        f"- date: {res['date']}", f"- GPU: {res['gpu']}", f"- vLLM: {res.get('vllm', '?')}",
        f"- server: {res['server']}", f"- pages: {res['pages']} (one book); {res['cores']} "
        f"cores, pipeline.workers {res['workers']}",
        f"- B2 (one server): {res['b2_pages_per_s']:.2f} pages/s"
        if res.get("b2_pages_per_s") else "- B2: not run", "",
        "| replicas | start s | convert pages/s | from start | run pages/s | vs 1 | vs B2 "
        "| preemptions | vLLM settings per replica | requests running (convert) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]  # fmt: skip
    for key, e in sorted(res["replicas"].items(), key=lambda kv: int(kv[0])):
        r = res["ratios"][key]
        settings = "; ".join(", ".join(f"{k} {v}" for k, v in s.items())
                             for s in e["vllm_settings"])  # fmt: skip
        running = " ".join("." if x is None else str(x) for x in e["timeline"])
        lines.append(
            f"| {e['replicas']} | {e['start_s']:.0f} | {e['convert_pages_per_s']:.2f} "
            f"| {e['convert_from_start_pages_per_s']:.2f} | {e['run_pages_per_s']:.2f} "
            f"| {fmt_x(r['vs_one'])} | {fmt_x(r['vs_b2'])} | {e['preemptions']} | {settings} "
            f"| {running} |")  # fmt: skip
    lines += ["", "Targets:", ""]
    for key, r in sorted(res["ratios"].items(), key=lambda kv: int(kv[0])):
        if int(key) < 2:
            continue
        for what, x, target in (("1 replica", r["vs_one"], TARGET_VS_ONE),
                                ("B2", r["vs_b2"], TARGET_VS_B2)):  # fmt: skip
            mark = "x" if x is not None and x >= target else " "
            miss = " (not met)" if x is not None and x < target else ""
            lines.append(f"- [{mark}] {key} replicas convert >= {target}x {what}: "
                         f"{fmt_x(x)}{miss}")  # fmt: skip
    return "\n".join(lines) + "\n"


def fmt_x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = model_dir_parser("python -m bench.gpu.replicas", __doc__, required=False)
    ap.add_argument("--fake", action="store_true",
                    help="the fake server (testkit) instead of vLLM: a dry run without a GPU")
    ap.add_argument("--replicas", default="1,2,3", help="counts to run (default 1,2,3)")
    ap.add_argument("--pages", type=int, default=256, help="pages of the book (default 256)")
    ap.add_argument("--results", type=Path, default=HERE / "replicas_gpu.json",
                    help="results file (default bench/gpu/replicas_gpu.json)")  # fmt: skip
    ap.add_argument("--merge", action="store_true",
                    help="keep the results file's entries of the counts not run now")
    ap.add_argument("--log-dir", type=Path, default=None,
                    help="each ocrvl process's log (default: the work directory)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)
    if not args.fake and not args.model_dir:
        ap.error("--model-dir is required (or --fake for a dry run)")
    args.counts = [int(n) for n in args.replicas.split(",")]
    if any(n < 1 for n in args.counts):
        ap.error(f"--replicas {args.replicas}: counts are 1 or more")
    return args


@stops_children
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ocrvl-replicas-"))
    log(f"work directory {work}")
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    book = make_pdf(work / "book.pdf", args.pages, height=PAGE_HEIGHT, seed=1)
    old = json.loads(args.results.read_text()) if args.merge and args.results.exists() else {}
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "gpu": gpu_name(), "pages": args.pages,
        "cores": os.cpu_count(), "workers": decide_placement(Config(pipeline=PIPELINE)).workers,
        "server": "fake (testkit)" if args.fake else args.model_dir,
        "replicas": {k: v for k, v in (old.get("replicas") or {}).items()
                     if int(k) not in args.counts},
        "b2_pages_per_s": None if 1 in args.counts else old.get("b2_pages_per_s"),
    }  # fmt: skip
    gpu_baseline = None if args.fake else gpu_memory_used_mib()
    try:
        for n in args.counts:
            res["replicas"][str(n)] = one_count(n, args, work, book, res, gpu_baseline)
            res["ratios"] = ratios(res)
            args.results.parent.mkdir(parents=True, exist_ok=True)
            args.results.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
            log(f"{n} replica(s) written to {args.results}")
        print(report(res))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

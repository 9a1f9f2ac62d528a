"""ocrvl through Ray against ocrvl's local workers, on the same card (issue 52, item 6).

    PYTHONPATH=$PWD:/tmp/cli:/tmp/site-ray python3 -m bench.gpu.ray_vs_local \
        --model-dir /tmp/model --vllm-pythonpath /tmp/site --layout-cache /tmp/lm \
        --results $OUT/ray_vs_local.json [--modes off,on] [--rounds 2]

Two contenders, each an `ocrvl run` daemon with its own managed vLLM (`auto` settings, random
weights, answer lengths forced as bench.gpu's): `local` (today's engine workers on this
machine) and `ray` (cluster.address: a one-node Ray cluster on this machine's loopback whose
head offers the GPU; the engine host runs the workers and the vLLM server there, the daemon
talks to it through Ray). For each layout mode (`off`: whole pages, a `--pages-off` book;
`on`: the transformers layout stand-in on gpu:0, a `--pages-on` book of `make_layout_pdf`
pages), the contenders run one after the other (`--order`, default local then ray; the GPU
to itself): each starts, waits for its server and every engine worker, converts a warm-up
book (not timed), then `--rounds` books; a book's time is from its rename into the inbox to
its Markdown. Each contender's figure is its median round (of an even count, the slower
middle one); the ratio is ray / local.
`--fake` runs the stand-in server instead (layout off only); `--fake-args`, `--max-num-seqs`,
`--workers` and `--replicas` shape it, e.g. fast enough that ocrvl, not the server, sets the
pace (bench/cluster_RESULTS.md).
Target: >= 0.95 in both modes. Writes `--results` after every contender (a run cut short
keeps what it measured); the daemons' logs go to `--log-dir` (default beside --results).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gpu.big_gpu import layout_room
from bench.gpu.layout_on import use_layout_cache
from bench.gpu.lengths import ENV as LENGTHS_ENV
from bench.gpu.run import gpu_name, log
from bench.gpu.teardown import stops_children
from bench.gpu.vllm_server import managed_vllm, model_dir_parser
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.server.gpu import read_gpus
from ocrvl_daemon.server.placement import decide_placement
from testkit import layout_model
from testkit.documents import make_layout_pdf, make_pdf
from testkit.harness import free_port, wait_until
from testkit.ray_cluster import LOOPBACK_ENV
from testkit.runner import DaemonProcess, managed_fake_server, run_ocrvl, write_config

WORKER_READY = re.compile(r"engine worker \d+ ready in")
# Each block's answer length with layout on: bench.gpu's median of 500 tokens a page over the
# ~7 blocks a stand-in page sends (bench/gpu/README.md, "Layout detection on").
LAYOUT_LENGTHS = "71:0.9:17"
LAYOUT_PIPELINE = {"use_layout_detection": True, "layout_engine": "transformers",
                   "layout_device": "gpu:0"}
START_TIMEOUT_S = 600
BOOK_TIMEOUT_S = 600
TARGET = 0.95
FAKE_ANSWERS = "--output-tokens fixed:20 --step-t0-ms 50 --max-num-seqs 16"


def pipeline_for(mode: str) -> dict[str, Any]:
    return dict(LAYOUT_PIPELINE) if mode == "on" else {"use_layout_detection": False}


def book_for(mode: str, folder: Path, pages: int, seed: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if mode == "on":
        return make_layout_pdf(folder / f"book-{seed}.pdf", pages, seed=seed)
    return make_pdf(folder / f"book-{seed}.pdf", pages, height=792, seed=seed)


def daemon_config(args: argparse.Namespace, work: Path, mode: str,
                  address: str | None) -> Path:
    """`ocrvl run`'s config: managed vLLM on the card, the mode's pipeline, and with
    `address` the cluster."""
    sections = ({"server": managed_fake_server(free_port(), *args.fake_args.split())}
                if args.fake else
                managed_vllm(args.model_dir, args.vllm_python, args.vllm_pythonpath,
                             free_port()))
    if args.replicas:
        sections["server"]["replicas"] = args.replicas
    if args.max_num_seqs:
        sections["server"].setdefault("vllm_args", {})["max-num-seqs"] = args.max_num_seqs
    pipeline = pipeline_for(mode) | ({"workers": args.workers} if args.workers else {})
    if mode == "on":
        sections["server"]["env"][LENGTHS_ENV] = LAYOUT_LENGTHS
        gpus = read_gpus()
        sections["server"]["vllm_args"].update(layout_room(pipeline, gpus[0] if gpus else None))
    if address is not None:
        sections["cluster"] = {"address": address}
    inbox = work / "inbox"
    inbox.mkdir(parents=True)
    return write_config(work / "ocrvl.yaml", state_dir=str(work / "state"), pipeline=pipeline,
                        inbox={"paths": [str(inbox)], "stable_seconds": 0.5, "polling": False},
                        **sections)


def ready(daemon: DaemonProcess, config: Path, workers: int) -> bool:
    """The daemon's server ready and `workers` engine workers ready (its own or relayed from
    the engine host)."""
    assert daemon.proc is not None
    if daemon.proc.poll() is not None:
        raise RuntimeError(f"ocrvl run exited; its log ends:\n{daemon.log()[-4000:]}")
    out = run_ocrvl("status", "--config", config, "--json", timeout=60)
    status = json.loads(out.stdout) if out.returncode == 0 else {}
    servers = status.get("servers") or [status.get("server") or {}]
    if not all(s.get("state") == "ready" for s in servers):
        return False
    return len(WORKER_READY.findall(daemon.log())) >= workers


def convert_book(inbox: Path, book: Path) -> float:
    """Seconds from `book`'s rename into the inbox to its Markdown."""
    target = inbox / book.name
    start = time.monotonic()
    os.replace(book, target)
    wait_until(lambda: target.with_suffix(".md").exists(), BOOK_TIMEOUT_S, interval=0.05,
               what=f"{target.with_suffix('.md').name}", ignore=())
    return time.monotonic() - start


def contender(args: argparse.Namespace, work: Path, mode: str, name: str,
              address: str | None) -> dict[str, Any]:
    """One daemon: started, warmed up, `--rounds` books timed, stopped (its log kept)."""
    folder = work / f"{mode}-{name}-{time.monotonic_ns()}"
    config = daemon_config(args, folder, mode, address)
    pages = args.pages_on if mode == "on" else args.pages_off
    workers = args.workers or decide_placement(
        Config.model_validate({"pipeline": pipeline_for(mode)})).workers
    daemon = DaemonProcess(config, **LOOPBACK_ENV)
    t0 = time.monotonic()
    daemon.start()
    try:
        wait_until(lambda: ready(daemon, config, workers), START_TIMEOUT_S, interval=1,
                   what=f"{name}'s server and {workers} engine workers", ignore=(ValueError,))
        start_s = time.monotonic() - t0
        log(f"{mode}/{name}: ready in {start_s:.0f} s; warming up")
        convert_book(folder / "inbox", book_for(mode, folder / "books", 32, seed=99))
        seconds = []
        for n in range(args.rounds):
            seconds.append(convert_book(folder / "inbox",
                                        book_for(mode, folder / "books", pages, seed=n)))
            log(f"{mode}/{name} round {n + 1}: {pages / seconds[-1]:.2f} pages/s")
    finally:
        daemon.terminate(180)
        shutil.copy(daemon.log_path, args.log_dir / f"{mode}-{name}.log")
    rates = [pages / s for s in seconds]
    return {"contender": name, "mode": mode, "pages": pages, "workers": workers,
            "start_s": round(start_s, 1), "rounds_pages_per_s": [round(r, 3) for r in rates],
            "pages_per_s": round(sorted(rates)[(len(rates) - 1) // 2], 3)}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("off", "on"):
        got = {name: statistics.median(r["pages_per_s"] for r in rows
                                       if r["mode"] == mode and r["contender"] == name)
               for name in ("local", "ray")
               if any(r["mode"] == mode and r["contender"] == name for r in rows)}
        if len(got) == 2:
            ratio = got["ray"] / got["local"]
            out[f"layout_{mode}"] = {"local_pages_per_s": round(got["local"], 3),
                                     "ray_pages_per_s": round(got["ray"], 3),
                                     "ray_vs_local": round(ratio, 3), "target": TARGET,
                                     "met": ratio >= TARGET}
    return out


def start_cluster(fake: bool) -> Any:
    """A one-node Ray cluster on the loopback whose head offers this machine's GPU (`fake`:
    one ocrvl_engine unit instead)."""
    from ray.cluster_utils import Cluster

    os.environ.update(LOOPBACK_ENV)
    # As README's "More than one machine" starts a node: the host's server and workers at
    # the niceness of the local contender's (Ray's own default is 15).
    os.environ.setdefault("RAY_worker_niceness", "0")
    offer: dict[str, Any] = ({"resources": {"ocrvl_engine": 1}} if fake else {"num_gpus": 1})
    return Cluster(initialize_head=True, connect=False, head_node_args={
        "num_cpus": os.cpu_count(), "node_ip_address": "127.0.0.1",
        "include_dashboard": False, "object_store_memory": 2 * 2**30, **offer})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = model_dir_parser("python -m bench.gpu.ray_vs_local", __doc__, required=False)
    ap.add_argument("--fake", action="store_true",
                    help="a dry run without a GPU: the stand-in server, layout off only")
    ap.add_argument("--layout-cache", type=Path, default=Path("/tmp/lm"),
                    help="the layout stand-in (python -m testkit.layout_model DIR --format "
                    "transformers; made there if missing)")
    ap.add_argument("--fake-args", default=FAKE_ANSWERS,
                    help="the stand-in server's options (python -m testkit.fake_server --help); "
                    "the managed server's own vLLM flags (max-num-seqs...) follow them")
    ap.add_argument("--workers", type=int, default=None,
                    help="pipeline.workers (default: auto, as the daemon decides)")
    ap.add_argument("--replicas", type=int, default=None,
                    help="server.replicas (default: auto)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the server's max-num-seqs (default: auto, as the daemon plans it)")
    ap.add_argument("--modes", default="off,on")
    ap.add_argument("--rounds", type=int, default=3, help="books timed per daemon")
    ap.add_argument("--order", default="local,ray",
                    help="the daemons of each mode, in turn (local,ray,ray,local: each twice)")
    ap.add_argument("--pages-off", type=int, default=96)
    ap.add_argument("--pages-on", type=int, default=32)
    ap.add_argument("--results", type=Path, default=Path("bench/gpu/ray_vs_local.json"))
    ap.add_argument("--log-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    if not args.fake and not args.model_dir:
        ap.error("--model-dir is required (or --fake)")
    args.log_dir = args.log_dir or args.results.parent / "ray_vs_local-logs"
    args.log_dir.mkdir(parents=True, exist_ok=True)
    return args


@stops_children
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    modes = ["off"] if args.fake else args.modes.split(",")
    if "on" in modes and not layout_model.written(args.layout_cache):
        subprocess.run(["python3", "-m", "testkit.layout_model", str(args.layout_cache),
                        "--format", "transformers"], check=True)
    use_layout_cache(args.layout_cache)  # before the cluster starts: its nodes inherit it
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "gpu": gpu_name(),
                           "rows": []}
    # `--order local` (the lease's auto-replicas step) needs no Ray: nor its idle cluster
    # beside the timed daemon
    cluster: Any = start_cluster(args.fake) if "ray" in args.order.split(",") else None
    if cluster is not None:
        import ray

        res["ray"] = ray.__version__
    try:
        with tempfile.TemporaryDirectory(prefix="ocrvl-ray-vs-local-") as tmp:
            for mode in modes:
                for name in args.order.split(","):
                    address = cluster.address if name == "ray" else None
                    res["rows"].append(contender(args, Path(tmp), mode, name, address))
                    res["summary"] = summary(res["rows"])
                    args.results.write_text(json.dumps(res, indent=2) + "\n")
    finally:
        if cluster is not None:
            cluster.shutdown()
    for mode, s in res.get("summary", {}).items():
        log(f"{mode}: local {s['local_pages_per_s']} pages/s, ray {s['ray_pages_per_s']} "
            f"pages/s, ray/local {s['ray_vs_local']} (target {TARGET}: "
            f"{'met' if s['met'] else 'NOT met'})")
    print(json.dumps(res.get("summary", {}), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

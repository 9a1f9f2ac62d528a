"""ocrvl through a Ray cluster on the CPU: pages/s with 1, 2, 3 simulated nodes, against the
local engine, and the daemon's own CPU per page; and the two ways a node gets its PDF.

    .venv/bin/python -m bench.cluster [--pages-per-node 80] [--write]

Every node (`testkit.ray_cluster`, Ray nodes on this machine's loopback) runs its own
stand-in server, each a fixed capacity (`SERVER`: 8 requests at a time, 2 s each: 4
pages/s), so that a perfect cluster of N nodes does 4N pages/s while the machine has CPU to
spare; layout detection is off (no model weights offline). Each run is one `ocrvl convert`
of a book of `pages-per-node x N` pages. Pages/s is counted from the first request's arrival
at any server to the last answer (the servers' request logs), so the start of the hosts
(seconds, once per daemon) is left out; the daemon's CPU is its process's user + system
time over that same span (sampled every 0.2 s), divided by the pages.

`--write` puts the table in bench/cluster_RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from testkit.documents import make_pdf
from testkit.ray_cluster import LOOPBACK_ENV, LocalCluster, local_cluster
from testkit.runner import managed_fake_server, ocrvl_argv, ocrvl_env, write_config

# Few tokens, long steps: the same 2 s a request as a real server's page, at little of this
# machine's CPU (each token is a streamed chunk the worker reads).
SERVER = ("--output-tokens", "fixed:20", "--step-t0-ms", "100", "--max-num-seqs", "8")
PIPELINE = {"max_concurrency": 8, "min_concurrency": 8, "adaptive_concurrency": False}
SERVER_PAGES_PER_S = 4.0  # 8 at a time, 20 tokens at 100 ms
RESULTS = Path(__file__).with_name("cluster_RESULTS.md")


@dataclass(frozen=True)
class Run:
    """One convert: what ran, its pages/s over the served span, the daemon's CPU."""

    name: str
    nodes: int
    pages: int
    seconds: float
    daemon_cpu_s: float
    machine_busy: float  # share of all this machine's cores busy over the span

    @property
    def pages_per_s(self) -> float:
        return self.pages / self.seconds

    @property
    def cpu_ms_per_page(self) -> float:
        return 1000 * self.daemon_cpu_s / self.pages


def convert(work: Path, name: str, nodes: int, pages: int, cluster: LocalCluster | None,
            pdfs: str = "auto") -> Run:
    """`ocrvl convert` of one book of `pages` pages, on `cluster` (None: this machine)."""
    folder = work / name
    folder.mkdir()
    log = str(folder / "requests-{port}.jsonl")
    sections: dict[str, Any] = {"pipeline": PIPELINE,
                                "server": managed_fake_server(18118, "--request-log", log,
                                                              *SERVER)}
    if cluster is not None:
        sections["cluster"] = {"address": cluster.address, "pdfs": pdfs}
    config = write_config(folder / "config.yaml", **sections)
    book = make_pdf(folder / "book.pdf", pages)
    proc = subprocess.Popen(ocrvl_argv("convert", "--config", config, book),
                            stdout=subprocess.DEVNULL, stderr=(folder / "convert.log").open("w"),
                            env=ocrvl_env(**LOOPBACK_ENV))
    samples = _cpu_samples(proc)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: ocrvl convert failed; see {folder / 'convert.log'}")
    requests = [json.loads(line) for f in folder.glob("requests-*.jsonl")
                for line in f.read_text().splitlines()]
    first, last = min(r["t"] for r in requests), max(r["done"] for r in requests)
    inside = [s for s in samples if first <= s[0] <= last]
    if len(inside) < 2:
        raise SystemExit(f"{name}: the book went too fast to sample; give more pages")
    (t0, own0, busy0), (t1, own1, busy1) = inside[0], inside[-1]
    return Run(name, nodes, pages, last - first, own1 - own0,
               (busy1 - busy0) / ((t1 - t0) * (psutil.cpu_count() or 1)))


def _cpu_samples(proc: subprocess.Popen[bytes]) -> list[tuple[float, float, float]]:
    """(wall-clock time, `proc`'s CPU seconds so far, the machine's busy CPU seconds so far)
    every 0.2 s until `proc` ends."""
    process = psutil.Process(proc.pid)
    samples = []
    while proc.poll() is None:
        try:
            own = process.cpu_times()
        except psutil.Error:
            break
        machine = psutil.cpu_times()
        samples.append((time.time(), own.user + own.system,
                        sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)))
        time.sleep(0.2)
    return samples


def table(runs: list[Run]) -> str:
    base = next((r for r in runs if r.name == "1 node"), None)
    lines = ["| run | nodes | pages | pages/s | per node vs ideal (4/s) | scaling vs 1 node "
             "| daemon CPU ms/page | machine CPU busy |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        per_node = r.pages_per_s / max(1, r.nodes) / SERVER_PAGES_PER_S
        scaling = (f"{r.pages_per_s / (base.pages_per_s * r.nodes):.2f}"
                   if base is not None and r.nodes else "")
        lines.append(f"| {r.name} | {r.nodes} | {r.pages} | {r.pages_per_s:.2f} | "
                     f"{per_node:.2f} | {scaling} | {r.cpu_ms_per_page:.1f} | "
                     f"{r.machine_busy:.0%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages-per-node", type=int, default=80)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    per = args.pages_per_node
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="ocrvl-bench-cluster-") as tmp:
        work = Path(tmp)
        runs.append(convert(work, "local engine", 0, per, None))
        print(table(runs), flush=True)
        with local_cluster(1) as cluster:
            runs.append(convert(work, "1 node", 1, per, cluster))
            for n in (2, 3):
                cluster.add_node()
                runs.append(convert(work, f"{n} nodes", n, per * n, cluster))
                print(table(runs), flush=True)
            for pdfs in ("shared_path", "object_store"):
                runs.append(convert(work, f"3 nodes, pdfs: {pdfs}", 3, per * 3, cluster, pdfs))
                print(table(runs), flush=True)
    print(table(runs))
    if args.write:
        RESULTS.write_text(RESULTS.read_text().split("<!-- table -->")[0] + "<!-- table -->\n\n"
                           + table(runs) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

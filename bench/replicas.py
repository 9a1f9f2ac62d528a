"""Several simulated servers: does ocrvl scale with them, and does it lose or repeat a page
when one of them dies?

    .venv/bin/python -m bench.replicas [--pages 192] [--servers 1,2,4]

Each server is bench/run.py's simulator (SIM_ARGS: a 4060-class card, ~1.7x sped up). For
each N of `--servers`, on the same book:
  feeder  the book's pages pre-rendered, `max_concurrency` always in flight at each of the N
          servers: what the servers can do (capacity)
  ocrvl   `ocrvl convert BOOK` with `server.urls` = the N servers (external mode)
Scaling efficiency = ocrvl's pages/s with N servers / (N x its pages/s with one). The
client's CPU per page (ocrvl and its engine workers, user + system) shows when the client,
not the servers, is the limit. Then three servers, one SIGKILLed once a third of the pages
were sent: every page must be in book.md exactly once, none a placeholder.
Prints the table and writes bench/replicas.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.gpu.run import page_jpegs  # noqa: E402
from bench.loadgen import send_all  # noqa: E402
from bench.run import MAX_CONCURRENCY, MODEL, PAGE_HEIGHT, SIM_ARGS, machine  # noqa: E402
from testkit.documents import make_pdf  # noqa: E402
from testkit.harness import (  # noqa: E402
    FakeServerProcess,
    chat_payload,
    free_port,
    start_fake_server,
    wait_until,
)
from testkit.runner import ocrvl_argv, ocrvl_env, write_config  # noqa: E402

PAGE_MARK = re.compile(r"^<!-- page (\d+) -->$", re.M)
PAGE_NOTE = re.compile(r"^<!-- ocrvl: (?!page \d+ )", re.M)  # a page given up (its note)
TOKENS = 4096  # what ocrvl asks for per page; the simulator's lognormal ends answers sooner


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def servers(count: int) -> Iterator[list[FakeServerProcess]]:
    """`count` simulated servers, always stopped."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(start_fake_server(free_port(), *SIM_ARGS, ready_timeout=30))
               for _ in range(count)]  # fmt: skip


def sent(fleet: list[FakeServerProcess]) -> int:
    total = 0
    for srv in fleet:
        with contextlib.suppress(httpx.HTTPError):
            total += httpx.get(srv.url + "/fake/stats", timeout=5).json()["requests_received"]
    return total


def feeder(fleet: list[FakeServerProcess], jpegs: list[bytes]) -> float:
    """Pages/s with `max_concurrency` always in flight at each server, pages dealt in turn."""
    bodies = [chat_payload(j, model=MODEL, max_completion_tokens=TOKENS) for j in jpegs]

    async def run() -> float:
        shares = [bodies[i:: len(fleet)] for i in range(len(fleet))]
        seconds = await asyncio.gather(*(send_all(srv.url, share, MAX_CONCURRENCY)
                                         for srv, share in zip(fleet, shares, strict=True)))
        return max(seconds)

    return len(bodies) / asyncio.run(run())


def convert(fleet: list[FakeServerProcess], book: Path, work: Path,
            kill_after: int | None = None) -> dict[str, Any]:
    """`ocrvl convert` of a fresh copy of `book` against `fleet`; with `kill_after`, the second
    server is SIGKILLed once that many pages were sent."""
    where = Path(tempfile.mkdtemp(dir=work, prefix=f"{len(fleet)}-"))
    pdf = where / book.name
    pdf.write_bytes(book.read_bytes())
    cfg = write_config(where / "config.yaml", state_dir=str(where / "state"),
                       server={"mode": "external", "urls": [s.api_url for s in fleet]})
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    with (where / "ocrvl.log").open("wb") as out:
        proc = subprocess.Popen(ocrvl_argv("convert", "--config", cfg, pdf), env=ocrvl_env(),
                                stdout=out, stderr=subprocess.STDOUT)
    killed = None
    if kill_after is not None:
        wait_until(lambda: sent(fleet) >= kill_after or proc.poll() is not None, 600,
                   interval=0.05, what=f"{kill_after} pages sent")
        victim = fleet[1]
        os.kill(victim.pid, signal.SIGKILL)
        killed = {"server": victim.url, "after_pages_sent": sent(fleet)}
        log(f"killed {victim.url} after {killed['after_pages_sent']} pages were sent")
    code = proc.wait(3600)
    seconds = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    md = pdf.with_suffix(".md").read_text(encoding="utf-8") if code == 0 else ""
    pages = Counter(int(n) for n in PAGE_MARK.findall(md))
    return {"exit_code": code, "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2),
            "pages_in_output": len(pages), "repeated": sorted(p for p, n in pages.items() if n > 1),
            "placeholders": len(PAGE_NOTE.findall(md)), "killed": killed}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--pages", type=int, default=192)
    ap.add_argument("--servers", default="1,2,4", help="server counts (default 1,2,4)")
    ap.add_argument("--results", type=Path, default=HERE / "replicas.json")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ocrvl-replicas-"))
    book = make_pdf(work / "book.pdf", args.pages, height=PAGE_HEIGHT, seed=11)
    jpegs = page_jpegs(book, args.pages)
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine(),
                           "pages": args.pages, "runs": {}}  # fmt: skip
    for n in (int(x) for x in args.servers.split(",")):
        with servers(n) as fleet:
            capacity = feeder(fleet, jpegs)
            log(f"{n} server(s): feeder {capacity:.2f} pages/s")
            run = convert(fleet, book, work)
            run["pages_per_s"] = round(args.pages / run["seconds"], 3)
            run["capacity_pages_per_s"] = round(capacity, 3)
            run["cpu_seconds_per_page"] = round(run["cpu_seconds"] / args.pages, 3)
            log(f"{n} server(s): ocrvl {run['pages_per_s']:.2f} pages/s, "
                f"{run['cpu_seconds_per_page']:.3f} CPU s/page")
            res["runs"][str(n)] = run
    one = res["runs"].get("1", {}).get("pages_per_s")
    for n, run in res["runs"].items():
        run["scaling_efficiency"] = round(run["pages_per_s"] / (int(n) * one), 3) if one else None
    with servers(3) as fleet:
        res["one_of_three_killed"] = convert(fleet, book, work, kill_after=args.pages // 3)
    args.results.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    print(report(res))
    return 0


def report(res: dict[str, Any]) -> str:
    """The table of record."""
    cores = res["machine"].get("cores", "?")
    lines = [f"{res['pages']} pages, {res['date']}, {cores} cores",
             "| servers | feeder pages/s | ocrvl pages/s | vs feeder | scaling efficiency "
             "| client CPU s/page |", "|---:|---:|---:|---:|---:|---:|"]
    for n, r in res["runs"].items():
        lines.append(f"| {n} | {r['capacity_pages_per_s']:.2f} | {r['pages_per_s']:.2f} | "
                     f"{r['pages_per_s'] / r['capacity_pages_per_s']:.0%} | "
                     f"{r['scaling_efficiency']} | {r['cpu_seconds_per_page']:.3f} |")
    k = res["one_of_three_killed"]
    lines.append(f"\none of three servers SIGKILLed ({k['killed']}): exit {k['exit_code']}, "
                 f"{k['pages_in_output']}/{res['pages']} pages in the output, repeated "
                 f"{k['repeated'] or 'none'}, placeholders {k['placeholders']}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

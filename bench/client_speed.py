"""How fast ocrvl's client side goes when the server costs nothing: `ocrvl convert` of one
book against an OpenAI-compatible server that answers every page at once, for each
`pipeline.workers` count.

    python -m bench.client_speed [--pages 256] [--workers 1,2,4,8]

The figure is the most pages per second ocrvl can hand a server (rendering, encoding and
posting pages, writing the Markdown), measured from the engine workers' ready line to the
end; also the client's CPU seconds per page (ocrvl and its workers, start-up included; the
instant server runs in this process and is not counted). On a machine with many cores it
shows whether the client keeps up with several servers (issue 19: 20+ pages/s).
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

from bench.gpu.run import PAGE_HEIGHT, worker_ready_s
from bench.run import Ocrvl
from testkit.documents import make_pdf
from testkit.plain_server import plain_openai_server
from testkit.runner import write_config


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def convert_once(book: Path, pages: int, workers: int, url: str, work: Path) -> dict[str, float]:
    """One `ocrvl convert` of a fresh copy of `book` with `workers` engine workers."""
    where = Path(tempfile.mkdtemp(prefix=f"workers-{workers}-", dir=work))  # a count may repeat
    copy = where / book.name
    copy.write_bytes(book.read_bytes())
    cfg = write_config(where / "convert.yaml", pipeline={"workers": workers})
    cpu0 = children_cpu_s()
    proc = Ocrvl("convert", "--config", cfg, "--server-url", url, copy)
    code = proc.wait(3600)
    end = time.monotonic()
    proc.save(where / "ocrvl.log")
    if code != 0:
        raise SystemExit(f"ocrvl convert with {workers} workers failed (exit {code}):\n"
                         + "\n".join(proc.grep("")[-20:]))  # fmt: skip
    ready = proc.first("ready in") or proc.t0
    return {"workers": workers, "pages_per_s": pages / (end - ready),
            "pages_per_s_from_start": pages / (end - proc.t0),
            "worker_ready_s": worker_ready_s(proc) or 0.0,
            "cpu_s_per_page": (children_cpu_s() - cpu0) / pages}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=256, help="pages of the book (default 256)")
    parser.add_argument("--workers", default="1,2,4,8",
                        help="comma-separated pipeline.workers counts (default 1,2,4,8)")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.workers.split(",")]
    with tempfile.TemporaryDirectory(prefix="ocrvl-client-speed-") as tmp:
        work = Path(tmp)
        book = make_pdf(work / "book.pdf", args.pages, height=PAGE_HEIGHT, seed=1)
        print(f"{args.pages} pages, {os.cpu_count()} cores, an instant server", flush=True)
        print("| pipeline.workers | pages/s | from the command's start | CPU s per page |"
              " workers ready after |\n|---:|---:|---:|---:|---:|", flush=True)  # fmt: skip
        with plain_openai_server() as url:
            for n in counts:
                r = convert_once(book, args.pages, n, url, work)
                print(f"| {n} | {r['pages_per_s']:.1f} | {r['pages_per_s_from_start']:.1f} | "
                      f"{r['cpu_s_per_page']:.3f} | {r['worker_ready_s']:.1f} s |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

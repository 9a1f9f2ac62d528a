"""Redo cost: the tokens a document's bad pages take beyond its first pass.

A 40-page book, answers drawn from lognormal:500:0.9 tokens (a few pages need more than
the 1024 tokens asked), and 4 pages that loop (the fake server's --loop-widths: they repeat
a phrase to the limit unless the request carries a loop-breaking parameter), converted by
`ocrvl convert` against the fake server with max-model-len 16384. Prints, for the pages that
were cut off: tokens asked and produced on the first pass and on redos, and how many pages
end flagged.

    python -m bench.redo_cost                      # this checkout
    python -m bench.redo_cost --code OLD/          # another ocrvl source tree, e.g. main
                                                   # before dfce062 (the doubling chain):
    mkdir /tmp/old && git archive 2da3f65 ocrvl_daemon | tar -x -C /tmp/old
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from testkit.documents import make_pdf, sent_width
from testkit.fake_server import InProcessFakeServer, parse_args

PAGES = 40
LOOPING = (5, 14, 23, 31)
MAX_NEW_TOKENS = 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", type=Path, help="run this ocrvl source tree instead")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        log = tmp / "requests.jsonl"
        book = make_pdf(tmp / "book.pdf", PAGES, seed=7)
        config = tmp / "config.yaml"
        config.write_text(yaml.safe_dump({
            "state_dir": str(tmp / "state"),
            "model": {"max_new_tokens": MAX_NEW_TOKENS},
            "pipeline": {"use_layout_detection": False},
        }))
        widths = ",".join(str(sent_width(p)) for p in LOOPING)
        cfg = parse_args(["--host", "127.0.0.1", "--port", "0", "--max-model-len", "16384",
                          "--output-tokens", "lognormal:500:0.9", "--request-log", str(log),
                          "--loop-widths", widths, "--disable-uvicorn-access-log"])
        env = dict(os.environ)
        if args.code:
            env["PYTHONPATH"] = str(args.code.absolute())
        with InProcessFakeServer(cfg) as server:
            started = time.monotonic()
            done = subprocess.run(
                [sys.executable, "-m", "ocrvl_daemon", "convert", "--config", str(config),
                 "--server-url", f"{server.url}/v1", str(book)],
                env=env, cwd=tmp, capture_output=True, text=True, timeout=900, check=False)
            seconds = time.monotonic() - started
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        report(log, book.with_suffix(".md").read_text("utf-8"), seconds)
    return 0


def report(log: Path, markdown: str, seconds: float) -> None:
    records = [json.loads(line) for line in log.read_text("utf-8").splitlines() if line]
    by_page: dict[int, list[dict]] = collections.defaultdict(list)
    for r in records:
        by_page[r["w"]].append(r)
    first_asked = first_made = redo_asked = redo_made = 0
    cut_pages = 0
    for tries in by_page.values():
        first, redos = tries[0], tries[1:]
        first_asked += first["max_tokens"]
        first_made += first.get("tokens", 0)
        redo_asked += sum(r["max_tokens"] for r in redos)
        redo_made += sum(r.get("tokens", 0) for r in redos)
        cut_pages += first.get("tokens", 0) >= first["max_tokens"]
    looping = {sent_width(p) for p in LOOPING}
    loop_redo = sum(r.get("tokens", 0) for w in looping for r in by_page[w][1:])
    # A flagged page's comment (this version), or a cut-off note (versions before it).
    flagged = {int(m) for m in re.findall(r"<!-- ocrvl: page (\d+) (?:suspect|bad|was cut)",
                                          markdown)}
    print(f"pages {len(by_page)}, cut off on the first pass {cut_pages} "
          f"(of which looping {len(looping)})")
    print(f"first pass: {first_made} tokens produced")
    print(f"redos: {sum(len(t) - 1 for t in by_page.values())} requests, {redo_asked} tokens "
          f"asked, {redo_made} produced = {redo_made / max(1, first_made):.0%} of the first "
          f"pass ({loop_redo} of them on looping pages)")
    refused = sum(1 for r in records if r["status"] != 200)
    if refused:
        print(f"requests the server refused (over max-model-len): {refused}")
    print(f"requests per looping page: {[len(by_page[w]) for w in sorted(looping)]}; "
          f"pages flagged in the Markdown: {len(flagged)}")
    print(f"convert took {seconds:.1f} s")


if __name__ == "__main__":
    sys.exit(main())

"""Loop savings: the decode tokens a book costs when its looping answers are stopped as soon as
they loop, and when they run to their limit.

A 20-page book, answers of 600-800 tokens, and 3 pages that loop (the fake server's
--loop-widths: they repeat a phrase to the 4096-token limit unless the request carries a
loop-breaking parameter), converted twice by `ocrvl convert` against a fresh simulated fake
server (continuous batching, so an aborted request stops decoding): with
`pipeline.stop_loops_early: true` (the default) and with false. Prints, for each run, the
decode tokens the server generated (its per-step counter, aborted requests included), those
of the looping pages' first answers, the requests per looping page and the time taken; then
the tokens saved and whether both runs wrote the same Markdown.

    python -m bench.loop_savings
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testkit.documents import make_pdf, sent_width
from testkit.fake_server import InProcessFakeServer, parse_args
from testkit.runner import run_ocrvl, write_config

PAGES = 20
LOOPING = (4, 11, 17)
ANSWER_TOKENS = "uniform:600:800"


@dataclass(frozen=True)
class Run:
    """One conversion of a book: what the server decoded and what was written."""

    generated: int  # decode tokens, all requests (the server's per-step counter)
    loop_requests: list[list[dict[str, Any]]]  # each looping page's request records, in order
    seconds: float
    markdown: str

    @property
    def loop_first(self) -> list[int]:
        """The decode tokens of each looping page's first answer."""
        return [tries[0]["generated_tokens"] for tries in self.loop_requests]


def convert(folder: Path, pdf: Path, looping: tuple[int, ...], stop_loops_early: bool,
            answer_tokens: str = ANSWER_TOKENS) -> Run:
    """Convert a copy of `pdf` (a `make_pdf` book whose pages `looping` loop) in `folder` with
    `ocrvl convert` against a fresh simulated fake server; what it cost."""
    folder.mkdir(parents=True)
    book = folder / pdf.name
    book.write_bytes(pdf.read_bytes())
    log = folder / "requests.jsonl"
    config = write_config(folder / "config.yaml",
                          pipeline={"stop_loops_early": stop_loops_early})
    widths = [sent_width(p) for p in looping]
    cfg = parse_args(["--host", "127.0.0.1", "--port", "0", "--output-tokens", answer_tokens,
                      "--step-t0-ms", "1", "--step-t1-ms", "0.05", "--request-log", str(log),
                      "--loop-widths", ",".join(map(str, widths)),
                      "--disable-uvicorn-access-log"])
    with InProcessFakeServer(cfg) as server:
        started = time.monotonic()
        done = run_ocrvl("convert", "--config", config, "--server-url", f"{server.url}/v1",
                         book, timeout=900, cwd=folder)
        seconds = time.monotonic() - started
        generated = server.server.generation_tokens()
    if done.returncode != 0:
        raise RuntimeError(f"ocrvl convert failed ({done.returncode}):\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in log.read_text("utf-8").splitlines() if line]
    return Run(generated, [[r for r in records if r["w"] == w] for w in widths], seconds,
               book.with_suffix(".md").read_text("utf-8"))


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        book = make_pdf(Path(tmp) / "book.pdf", PAGES)
        runs = {stop: convert(Path(tmp) / str(stop), book, LOOPING, stop)
                for stop in (False, True)}
    print(f"{PAGES} pages, {len(LOOPING)} looping (pages {', '.join(str(p + 1) for p in LOOPING)})"
          ", answers 600-800 tokens, loops to 4096")
    print("| pipeline.stop_loops_early | decode tokens | looping pages' first answers "
          "| requests per looping page | convert s |")
    print("|---|---:|---|---|---:|")
    for stop, run in runs.items():
        print(f"| {str(stop).lower()} | {run.generated} | {run.loop_first} "
              f"| {[len(tries) for tries in run.loop_requests]} | {run.seconds:.1f} |")
    before, after = runs[False].generated, runs[True].generated
    print(f"saved: {before - after} decode tokens ({(before - after) / before:.0%} of the book's "
          f"decoding); same Markdown: {runs[False].markdown == runs[True].markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

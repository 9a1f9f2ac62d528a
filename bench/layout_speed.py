"""The layout model's speed on this machine, and where a layout-on `ocrvl convert` spends it.

    python -m bench.layout_speed [--cache DIR] [--pages 3] [--threads 1,2]
        [--engines paddle_static,paddle_dynamic] [--book-pages 8]

Uses the stand-in of `testkit.layout_model` at the real shapes (written into `--cache` unless
there already), on `make_layout_pdf` pages rendered as ocrvl renders them (scale 2). Each
engine and thread count runs in its own process (one warm-up page, then `--pages` timed).
Then one `ocrvl convert` of a `--book-pages` book with layout on against the fake server
(`--book-pages 0` skips it). Prints the figures; nothing is written elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testkit.documents import make_layout_pdf
from testkit.harness import free_port, start_fake_server
from testkit.runner import ocrvl_env, run_ocrvl, write_config

MODEL = "PP-DocLayoutV3"
# One engine at one thread count, in a fresh process: the figures printed as one JSON line.
_ONE = """
import json, sys, time
import pypdfium2
from paddlex import create_model
pdf, engine, threads, pages = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
doc = pypdfium2.PdfDocument(pdf)
images = [doc[i % len(doc)].render(scale=2).to_numpy()[..., :3][..., ::-1].copy()
          for i in range(pages + 1)]
config = {"cpu_threads": threads} if engine == "paddle_static" else None
started = time.perf_counter()
model = create_model("PP-DocLayoutV3", engine=engine, engine_config=config, device="cpu")
loaded = time.perf_counter() - started
list(model.predict(images[0], threshold=0.3, layout_nms=True))
started, blocks = time.perf_counter(), 0
for image in images[1:]:
    blocks += len(list(model.predict(image, threshold=0.3, layout_nms=True))[0]["boxes"])
seconds = time.perf_counter() - started
print(json.dumps({"engine": engine, "threads": threads, "load_s": round(loaded, 1),
                  "s_per_page": round(seconds / pages, 2),
                  "pages_per_s": round(pages / seconds, 3), "blocks_per_page": blocks / pages}))
"""


def ensure_stand_in(cache: Path) -> None:
    """Write the real-shape stand-in into `cache` unless it is there."""
    if not (cache / "official_models" / MODEL).is_dir():
        subprocess.run([sys.executable, "-m", "testkit.layout_model", str(cache), "--model",
                        MODEL], env=ocrvl_env(), check=True, capture_output=True)


def layout_alone(cache: Path, pdf: Path, engine: str, threads: int, pages: int) -> dict:
    """One engine's figures at `threads` threads (OMP/MKL limited to the same)."""
    env = ocrvl_env(PADDLE_PDX_CACHE_HOME=str(cache), OMP_NUM_THREADS=str(threads),
                    MKL_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, "-c", _ONE, str(pdf), engine, str(threads),
                           str(pages)], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"engine": engine, "threads": threads, "error": done.stderr.strip()[-300:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def render_seconds(pdf: Path) -> float:
    """Seconds to render every page as ocrvl does with layout on (its page pixel limit)."""
    from ocrvl_daemon.config import PipelineConfig
    from ocrvl_daemon.pdf import page_count, render_page

    config = PipelineConfig(use_layout_detection=True)
    started = time.perf_counter()
    for page in range(page_count(pdf)):
        render_page(pdf, page, config.render_scale, config.page_pixel_limit)
    return time.perf_counter() - started


def convert(cache: Path, folder: Path, pages: int) -> dict:
    """One layout-on `ocrvl convert` of a `pages`-page book against the fake server."""
    book = make_layout_pdf(folder / "book.pdf", pages)
    log = folder / "requests.jsonl"
    config = write_config(folder / "config.yaml", pipeline={"use_layout_detection": True})
    with start_fake_server(free_port(), "--request-log", str(log)) as server:
        started = time.perf_counter()
        result = run_ocrvl("convert", "--config", config, "--server-url", server.api_url, book,
                           timeout=3600, PADDLE_PDX_CACHE_HOME=str(cache))
        wall = time.perf_counter() - started
        busy = server.stats()["busy_seconds"]
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])
    ready = [float(w) for w in
             (line.rsplit(" in ", 1)[-1].split()[0] for line in result.stderr.splitlines()
              if "engine worker" in line and " ready in " in line)]
    requests = log.read_text().count("\n")
    return {"pages": pages, "wall_s": round(wall, 1), "worker_ready_s": ready[:1],
            "pages_per_s_from_ready": round(pages / (wall - sum(ready[:1])), 3),
            "requests": requests, "blocks_per_page": requests / pages,
            "server_busy_s": round(busy, 2), "render_s": round(render_seconds(book), 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.layout_speed",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir(),
                                                           "ocrvl-layout-stand-in"))
    parser.add_argument("--pages", type=int, default=3)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--engines", default="paddle_static,paddle_dynamic")
    parser.add_argument("--book-pages", type=int, default=8)
    args = parser.parse_args(argv)
    ensure_stand_in(args.cache)
    with tempfile.TemporaryDirectory() as tmp:
        pdf = make_layout_pdf(Path(tmp) / "pages.pdf", 2)
        for engine in args.engines.split(","):
            for threads in map(int, args.threads.split(",")):
                print(json.dumps(layout_alone(args.cache, pdf, engine, threads, args.pages)),
                      flush=True)
        if args.book_pages:
            print(json.dumps({"convert": convert(args.cache, Path(tmp), args.book_pages),
                              "cpus": os.cpu_count()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

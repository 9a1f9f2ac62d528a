"""The layout model's speed on this machine, and where a layout-on `ocrvl convert` spends it.

    python -m bench.layout_speed [--cache DIR] [--pages 3] [--threads 1,2] [--batches 1]
        [--engines paddle_static,paddle_dynamic] [--book-pages 8]

Uses the stand-in of `testkit.layout_model` at the real shapes (written into `--cache` unless
there already), on `make_layout_pdf` pages rendered as ocrvl renders them (scale 2). Each
engine, thread count and layout batch size runs in its own process (one warm-up batch, then
`--pages` timed, rounded up to whole batches, each batch one `predict` call as PaddleX's own
pipeline makes them).
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
from typing import Any

MODEL = "PP-DocLayoutV3"
# One engine at one thread count and batch size, in a fresh process: the figures printed as
# one JSON line.
_ONE = """
import json, sys, time
import pypdfium2
from paddlex import create_model
pdf, engine = sys.argv[1], sys.argv[2]
threads, pages, batch = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
calls = -(-pages // batch)
pages = calls * batch
doc = pypdfium2.PdfDocument(pdf)
images = [doc[i % len(doc)].render(scale=2).to_numpy()[..., :3][..., ::-1].copy()
          for i in range(pages + batch)]
config = {"cpu_threads": threads} if engine == "paddle_static" else None
started = time.perf_counter()
model = create_model("PP-DocLayoutV3", engine=engine, engine_config=config, device="cpu",
                     batch_size=batch)
loaded = time.perf_counter() - started
list(model.predict(images[:batch], threshold=0.3, layout_nms=True))
started, blocks = time.perf_counter(), 0
for call in range(1, calls + 1):
    found = model.predict(images[call * batch:(call + 1) * batch], threshold=0.3,
                          layout_nms=True)
    blocks += sum(len(result["boxes"]) for result in found)
seconds = time.perf_counter() - started
print(json.dumps({"engine": engine, "threads": threads, "batch": batch,
                  "load_s": round(loaded, 1), "s_per_page": round(seconds / pages, 2),
                  "pages_per_s": round(pages / seconds, 3), "blocks_per_page": blocks / pages}))
"""


def ensure_stand_in(cache: Path) -> None:
    """Write the real-shape stand-in into `cache` unless it is there."""
    from testkit.runner import ocrvl_env

    if not (cache / "official_models" / MODEL).is_dir():
        subprocess.run([sys.executable, "-m", "testkit.layout_model", str(cache), "--model",
                        MODEL], env=ocrvl_env(), check=True, capture_output=True)


def layout_alone(cache: Path, pdf: Path, engine: str, threads: int, pages: int,
                 batch: int = 1) -> dict:
    """One engine's figures at `threads` threads (OMP/MKL limited to the same), `batch` pages
    per call."""
    from testkit.runner import ocrvl_env

    env = ocrvl_env(PADDLE_PDX_CACHE_HOME=str(cache), OMP_NUM_THREADS=str(threads),
                    MKL_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, "-c", _ONE, str(pdf), engine, str(threads),
                           str(pages), str(batch)], env=env, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        return {"engine": engine, "threads": threads, "batch": batch,
                "error": done.stderr.strip()[-300:]}
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
    from testkit.documents import make_layout_pdf
    from testkit.harness import free_port, start_fake_server
    from testkit.runner import run_ocrvl, write_config

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


def gpu_footprint(batches: list[int], calls: int = 5) -> dict[str, Any]:
    """GPU memory and speed of PP-DocLayoutV3 (Hugging Face's class, random fp32 weights, what
    the transformers engine runs) at 800x800 per batch size: the CUDA context, the weights,
    the allocator's peak per batch, and the whole process as the driver counts it.

    Needs only torch and transformers (runs in a plain CUDA environment, no paddle).
    """
    import torch
    from transformers import PPDocLayoutV3Config, PPDocLayoutV3ForObjectDetection

    def used_mib() -> float:
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**20

    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the context, and the baseline the driver counts after it
    with_context = used_mib()
    model = PPDocLayoutV3ForObjectDetection(PPDocLayoutV3Config()).eval().cuda()
    params = sum(p.numel() for p in model.parameters())
    torch.cuda.synchronize()
    figures: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "params_m": params / 1e6,
                               "weights_mib": round(torch.cuda.memory_allocated() / 2**20, 1),
                               "context_and_weights_mib": round(used_mib(), 1),
                               "before_weights_mib": round(with_context, 1), "batches": []}
    for batch in batches:
        pixels = torch.rand(batch, 3, 800, 800, device="cuda")
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            model(pixel_values=pixels)  # warm-up
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(calls):
                model(pixel_values=pixels)
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        figures["batches"].append({
            "batch": batch,
            "peak_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20),
            "peak_reserved_mib": round(torch.cuda.max_memory_reserved() / 2**20),
            "process_used_mib": round(used_mib()),
            "pages_per_s": round(batch * calls / seconds, 1)})
        del pixels
        torch.cuda.empty_cache()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.layout_speed",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir(),
                                                           "ocrvl-layout-stand-in"))
    parser.add_argument("--pages", type=int, default=3)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--batches", default="1", help="layout batch sizes, e.g. 1,2,4,8")
    parser.add_argument("--engines", default="paddle_static,paddle_dynamic")
    parser.add_argument("--book-pages", type=int, default=8)
    parser.add_argument("--gpu-footprint", action="store_true",
                        help="only the GPU memory and speed per batch (torch + transformers)")
    args = parser.parse_args(argv)
    if args.gpu_footprint:
        print(json.dumps(gpu_footprint(list(map(int, args.batches.split(","))))), flush=True)
        return 0
    ensure_stand_in(args.cache)
    from testkit.documents import make_layout_pdf

    with tempfile.TemporaryDirectory() as tmp:
        pdf = make_layout_pdf(Path(tmp) / "pages.pdf", 2)
        for engine in args.engines.split(","):
            for threads in map(int, args.threads.split(",")):
                for batch in map(int, args.batches.split(",")):
                    print(json.dumps(layout_alone(args.cache, pdf, engine, threads,
                                                  args.pages, batch)), flush=True)
        if args.book_pages:
            print(json.dumps({"convert": convert(args.cache, Path(tmp), args.book_pages),
                              "cpus": os.cpu_count()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

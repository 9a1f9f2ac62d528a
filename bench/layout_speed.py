"""The layout model's speed on this machine, and where a layout-on `ocrvl convert` spends it.

    python -m bench.layout_speed [--cache DIR] [--pages 3] [--engines paddle,transformers]
        [--devices cpu,gpu:0] [--threads 1,2] [--batches 1,8] [--book-pages 8]
        [--book-engine auto] [--book-device auto]

Uses the stand-in of `testkit.layout_model` at the real shapes (written into `--cache` unless
there already: `<name>/` for paddle static, made with paddle; `<name>_safetensors/` for the
transformers and paddle dynamic engines, made with torch where transformers is installed, else
with paddle), on `make_layout_pdf` pages rendered as ocrvl renders them (scale 2). Engines:
`paddle` (= `paddle_static`), `paddle_dynamic`, `transformers` (PaddleX's torch engine, with
the stand-in's hook, `testkit/layout_standin_site`, on the path so that its blocks follow the
ink). Each engine, device, thread count and layout batch size runs in its own process (one
warm-up batch, then `--pages` timed, rounded up to whole batches, each batch one `predict`
call as PaddleX's own pipeline makes them) and prints one JSON line (pages/s, s/page, blocks
per page, or the error). Threads: paddle static's `cpu_threads`, torch's
`torch.set_num_threads`, and OMP/MKL for both.
Then one `ocrvl convert` of a `--book-pages` book with layout on against the fake server
(`--book-pages 0` skips it), its layout engine and device `--book-engine`/`--book-device`
(the config's values). Prints the figures; nothing is written elsewhere.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODEL = "PP-DocLayoutV3"
ENGINES = {"paddle": "paddle_static", "paddle_static": "paddle_static",
           "paddle_dynamic": "paddle_dynamic", "transformers": "transformers"}
# The opt-in hook that gives the transformers engine the stand-in's ink rows.
STANDIN_SITE = Path(__file__).resolve().parents[1] / "testkit" / "layout_standin_site"
# One engine on one device at one thread count and batch size, in a fresh process: the
# figures printed as one JSON line.
_ONE = """
import json, sys, time
import pypdfium2
pdf, engine, device = sys.argv[1], sys.argv[2], sys.argv[3]
threads, pages, batch = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
if engine == "transformers":
    import torch
    torch.set_num_threads(threads)
from paddlex import create_model
calls = -(-pages // batch)
pages = calls * batch
doc = pypdfium2.PdfDocument(pdf)
images = [doc[i % len(doc)].render(scale=2).to_numpy()[..., :3][..., ::-1].copy()
          for i in range(pages + batch)]
config = {"cpu_threads": threads} if engine == "paddle_static" else None
started = time.perf_counter()
model = create_model("PP-DocLayoutV3", engine=engine, engine_config=config, device=device,
                     batch_size=batch)
loaded = time.perf_counter() - started
list(model.predict(images[:batch], threshold=0.3, layout_nms=True))
started, blocks = time.perf_counter(), 0
for call in range(1, calls + 1):
    found = model.predict(images[call * batch:(call + 1) * batch], threshold=0.3,
                          layout_nms=True)
    blocks += sum(len(result["boxes"]) for result in found)
seconds = time.perf_counter() - started
print(json.dumps({"engine": engine, "device": device, "threads": threads, "batch": batch,
                  "load_s": round(loaded, 1), "s_per_page": round(seconds / pages, 3),
                  "pages_per_s": round(pages / seconds, 3), "blocks_per_page": blocks / pages}))
"""


def _importable(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def stand_in_format(cache: Path, engines: list[str]) -> str | None:
    """The `testkit.layout_model --format` that gives `engines` (PaddleX names) what they
    load (what this environment can write), None when `cache` has it all already."""
    models = cache / "official_models"
    # Without paddle (a torch-only GPU machine) the paddle static runs say so themselves.
    need_static = ("paddle_static" in engines and _importable("paddle")
                   and not (models / MODEL / "inference.json").is_file())
    hf = models / f"{MODEL}_safetensors"
    need_hf = (bool({"transformers", "paddle_dynamic"} & set(engines))
               and not (hf / "preprocessor_config.json").is_file())
    torch_here = _importable("torch", "transformers")
    if need_static:
        return "all" if need_hf and torch_here else "paddle"
    if need_hf:
        return "transformers" if torch_here else "paddle"
    return None


def ensure_stand_in(cache: Path, engines: list[str] | None = None) -> None:
    """Write the real-shape stand-in into `cache` unless it is there, in the formats that
    `engines` load (default: paddle static)."""
    from testkit.runner import ocrvl_env

    fmt = stand_in_format(cache, engines or ["paddle_static"])
    if fmt is not None:
        done = subprocess.run([sys.executable, "-m", "testkit.layout_model", str(cache),
                               "--model", MODEL, "--format", fmt], env=ocrvl_env(),
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"writing the stand-in (--format {fmt}) failed:\n"
                             + done.stderr[-3000:])


def _env(cache: Path, **extra: str) -> dict[str, str]:
    """An ocrvl child's environment with the stand-in's cache and its transformers hook."""
    from testkit.runner import checkout_first, ocrvl_env

    env = ocrvl_env(PADDLE_PDX_CACHE_HOME=str(cache), **extra)
    env["PYTHONPATH"] = checkout_first(os.pathsep.join(
        filter(None, [str(STANDIN_SITE), os.environ.get("PYTHONPATH")])))
    return env


def layout_alone(cache: Path, pdf: Path, engine: str, threads: int, pages: int,
                 batch: int = 1, device: str = "cpu") -> dict:
    """One engine's figures on `device` at `threads` threads (OMP/MKL limited to the same),
    `batch` pages per call."""
    if engine.startswith("paddle") and not _importable("paddle"):
        return {"engine": engine, "device": device, "threads": threads, "batch": batch,
                "error": "paddle is not installed here"}
    env = _env(cache, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, "-c", _ONE, str(pdf), engine, device, str(threads),
                           str(pages), str(batch)], env=env, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        return {"engine": engine, "device": device, "threads": threads, "batch": batch,
                "error": done.stderr.strip()[-300:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def render_seconds(pdf: Path) -> float:
    """Seconds to render every page as ocrvl does with layout on (its page pixel limit)."""
    from ocrvl_daemon.config.model import PipelineConfig
    from ocrvl_daemon.files.pdf import page_count, render_page

    config = PipelineConfig(use_layout_detection=True)
    started = time.perf_counter()
    for page in range(page_count(pdf)):
        render_page(pdf, page, config.render_scale, config.page_pixel_limit)
    return time.perf_counter() - started


def convert(cache: Path, folder: Path, pages: int, engine: str = "auto",
            device: str = "auto") -> dict:
    """One layout-on `ocrvl convert` of a `pages`-page book against the fake server, the
    layout model on `engine` and `device` (pipeline.layout_engine / layout_device)."""
    from testkit.documents import make_layout_pdf
    from testkit.harness import free_port, start_fake_server
    from testkit.runner import run_ocrvl, write_config

    book = make_layout_pdf(folder / "book.pdf", pages)
    log = folder / "requests.jsonl"
    config = write_config(folder / "config.yaml", pipeline={
        "use_layout_detection": True, "layout_engine": engine, "layout_device": device})
    with start_fake_server(free_port(), "--request-log", str(log)) as server:
        started = time.perf_counter()
        env = _env(cache)
        result = run_ocrvl("convert", "--config", config, "--server-url", server.api_url, book,
                           timeout=3600, PADDLE_PDX_CACHE_HOME=env["PADDLE_PDX_CACHE_HOME"],
                           PYTHONPATH=env["PYTHONPATH"])
        wall = time.perf_counter() - started
        busy = server.stats()["busy_seconds"]
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])
    ready = [float(w) for w in
             (line.rsplit(" in ", 1)[-1].split()[0] for line in result.stderr.splitlines()
              if "engine worker" in line and " ready in " in line)]
    requests = log.read_text().count("\n")
    chosen = [line.split("layout: ", 1)[1] for line in result.stderr.splitlines()
              if "layout: " in line][:1]
    return {"pages": pages, "layout": chosen, "wall_s": round(wall, 1), "worker_ready_s": ready[:1],
            "pages_per_s_from_ready": round(pages / (wall - sum(ready[:1])), 3),
            "requests": requests, "blocks_per_page": requests / pages,
            "server_busy_s": round(busy, 2), "render_s": round(render_seconds(book), 2)}


def gpu_footprint(batches: list[int], calls: int = 5, callers: int = 0) -> dict[str, Any]:
    """GPU memory and speed of PP-DocLayoutV3 (Hugging Face's class, random fp32 weights, what
    the transformers engine runs) at 800x800 per batch size: the CUDA context, the weights,
    the allocator's peak per batch, and the whole process as the driver counts it. With
    `callers`, then the process's memory once that many threads have each made one call at
    batch 1, one at a time (a worker's page threads taking turns at the model), against as
    many calls from one thread (the worker's model lane).

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
    if callers:
        figures["callers"] = _callers_footprint(model, callers, used_mib)
    return figures


def _callers_footprint(model: Any, callers: int, used_mib: Callable[[], float]
                       ) -> dict[str, Any]:
    """The process's GPU memory after `callers` batch-1 calls from one thread, then after as
    many from as many threads in turn: what per-thread state (cuBLAS/cuDNN handles and their
    workspaces) adds."""
    import threading

    import torch

    pixels = torch.rand(1, 3, 800, 800, device="cuda")

    def call() -> None:
        with torch.inference_mode():
            model(pixel_values=pixels)
        torch.cuda.synchronize()

    for _ in range(callers):
        call()
    one_thread = used_mib()
    # The threads stay alive until all have called, as a worker's page threads do: torch
    # hands a thread's handles back to its pool only when the thread ends.
    turn, done = threading.Lock(), threading.Event()
    called = threading.Barrier(callers + 1)

    def page() -> None:
        with turn:
            call()
        called.wait()
        done.wait()

    threads = [threading.Thread(target=page) for _ in range(callers)]
    for thread in threads:
        thread.start()
    called.wait(timeout=600)
    many_threads = used_mib()
    done.set()
    for thread in threads:
        thread.join()
    return {"callers": callers, "one_thread_mib": round(one_thread),
            "after_threads_mib": round(many_threads),
            "per_thread_mib": round((many_threads - one_thread) / callers, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.layout_speed",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir(),
                                                           "ocrvl-layout-stand-in"))
    parser.add_argument("--pages", type=int, default=3)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--batches", default="1", help="layout batch sizes, e.g. 1,2,4,8")
    parser.add_argument("--engines", default="paddle_static,paddle_dynamic",
                        help=f"any of {', '.join(ENGINES)}")
    parser.add_argument("--devices", default="cpu", help="e.g. cpu,gpu:0")
    parser.add_argument("--book-pages", type=int, default=8)
    parser.add_argument("--book-engine", default="auto", help="pipeline.layout_engine")
    parser.add_argument("--book-device", default="auto", help="pipeline.layout_device")
    parser.add_argument("--gpu-footprint", action="store_true",
                        help="only the GPU memory and speed per batch (torch + transformers)")
    parser.add_argument("--callers", type=int, default=48,
                        help="with --gpu-footprint: then as many calls from as many threads")
    args = parser.parse_args(argv)
    if args.gpu_footprint:
        print(json.dumps(gpu_footprint(list(map(int, args.batches.split(","))),
                                       callers=args.callers)), flush=True)
        return 0
    try:
        engines = [ENGINES[e] for e in args.engines.split(",")]
    except KeyError as e:
        parser.error(f"unknown engine {e}: one of {', '.join(ENGINES)}")
    book = {"paddle": "paddle_static", "auto": None}.get(args.book_engine, args.book_engine)
    ensure_stand_in(args.cache, engines + ([book] if args.book_pages and book else []))
    from testkit.documents import make_layout_pdf

    with tempfile.TemporaryDirectory() as tmp:
        pdf = make_layout_pdf(Path(tmp) / "pages.pdf", 2)
        for engine in engines:
            for device in args.devices.split(","):
                for threads in map(int, args.threads.split(",")):
                    for batch in map(int, args.batches.split(",")):
                        print(json.dumps(layout_alone(args.cache, pdf, engine, threads,
                                                      args.pages, batch, device)), flush=True)
        if args.book_pages:
            figures = convert(args.cache, Path(tmp), args.book_pages, args.book_engine,
                              args.book_device)
            print(json.dumps({"convert": figures, "cpus": os.cpu_count()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

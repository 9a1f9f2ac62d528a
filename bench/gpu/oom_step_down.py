"""The out-of-memory step-down against real vLLM: memory taken after ocrvl read the GPU.

    python -m bench.gpu.oom_step_down --model-dir DIR [--vllm-pythonpath SITE]

What a user sees when a game or a second model takes GPU memory between ocrvl's reading and
vLLM's start: ocrvl reads the idle card (that reading is replayed by a stand-in nvidia-smi),
then `--hog-share` of the card is taken by another process, then `ocrvl convert` starts its
managed server with `auto` settings planned for the idle card, as one server
(`server.replicas: 1`: on a big card `auto` splits it between two, and each half still fits).
vLLM refuses (its own "Free memory on device ... is less than desired GPU memory
utilization" text); ocrvl must
lower the utilization from the free memory vLLM reported, start again, convert every page,
and remember the setting. Prints what happened and writes `oom_step_down.json` here.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gpu.run import PAGE_HEIGHT, gpu_name, log
from bench.gpu.teardown import stops_children
from bench.gpu.vllm_server import managed_vllm, model_dir_parser
from ocrvl_daemon.server import autotune
from ocrvl_daemon.server.gpu import NO_NVML_ENV, NVIDIA_SMI_ENV, NVIDIA_SMI_FIELDS
from testkit.documents import make_pdf
from testkit.harness import free_port
from testkit.runner import ocrvl_argv, ocrvl_env, write_config

HERE = Path(__file__).resolve().parent
HOG = """
import sys, torch
free, total = torch.cuda.mem_get_info()
held = torch.empty(int(total * float(sys.argv[1])), dtype=torch.uint8, device="cuda")
print(f"holding {held.numel() / 2**30:.1f} GiB of {total / 2**30:.1f} GiB", flush=True)
sys.stdin.read()
"""
INTERESTING = ("out of GPU memory", "Free memory on device", "lowering", "lowered", "ready in",
               "vLLM settings", "converted", "gpu-memory-utilization")


def stale_nvidia_smi(where: Path) -> Path:
    """A stand-in nvidia-smi that keeps answering what the real one says now (the idle card)."""
    now = subprocess.run(["nvidia-smi", f"--query-gpu={NVIDIA_SMI_FIELDS}",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    script = where / "nvidia-smi"
    script.write_text(f"#!/bin/sh\ncat <<'EOF'\n{now.strip()}\nEOF\n", encoding="utf-8")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


@stops_children
def main(argv: list[str] | None = None) -> int:
    ap = model_dir_parser("python -m bench.gpu.oom_step_down", __doc__)
    ap.add_argument("--hog-share", type=float, default=0.3,
                    help="share of the card taken after the reading (default 0.3)")  # fmt: skip
    ap.add_argument("--pages", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=480, help="seconds for ocrvl convert")
    ap.add_argument("--log", type=Path, default=None, help="ocrvl's log (default: work dir)")
    ap.add_argument("--results", type=Path, default=HERE / "oom_step_down.json")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="ocrvl-oom-"))
    smi = stale_nvidia_smi(work)
    book = make_pdf(work / "book.pdf", args.pages, height=PAGE_HEIGHT, seed=5)
    cfg = write_config(work / "config.yaml", state_dir=str(work / "state"),
                       **managed_vllm(args.model_dir, args.vllm_python, args.vllm_pythonpath,
                                      free_port(), replicas=1))  # fmt: skip
    hog = subprocess.Popen([args.vllm_python, "-c", HOG, str(args.hog_share)],
                           env=dict(os.environ, PYTHONPATH=args.vllm_pythonpath),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "gpu": gpu_name(),
                           "hog_share": args.hog_share, "pages": args.pages}  # fmt: skip
    try:
        assert hog.stdout is not None
        res["hog"] = hog.stdout.readline().strip()
        log(res["hog"])
        t0 = time.monotonic()
        log_path = args.log or work / "ocrvl.log"
        with log_path.open("wb") as out:  # a file: what happened survives a timeout
            proc = subprocess.Popen(ocrvl_argv("convert", "--config", cfg, book),
                                    env=ocrvl_env(**{NVIDIA_SMI_ENV: str(smi), NO_NVML_ENV: "1"}),
                                    stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            res["exit_code"] = proc.wait(args.timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # ocrvl stops its server; what it did so far is in the log
            res["exit_code"] = f"timed out after {args.timeout:g} s ({proc.wait()})"
        res["seconds"] = round(time.monotonic() - t0, 1)
        lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        res["log"] = [line for line in lines if any(w in line for w in INTERESTING)]
        md = book.with_suffix(".md")
        res["markdown_pages"] = (md.read_text(encoding="utf-8").count("<!-- page")
                                 if md.exists() else 0)  # fmt: skip
        tuning = work / "state" / autotune.TUNING_FILE
        res["remembered"] = json.loads(tuning.read_text()) if tuning.exists() else None
    finally:
        hog.kill()
        hog.wait()
    res["stepped_down"] = any("lower" in line for line in res["log"])
    args.results.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(res, indent=1))
    return 0 if res.get("exit_code") == 0 and res["stepped_down"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

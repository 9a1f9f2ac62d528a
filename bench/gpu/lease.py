"""A GPU lease's benches, one after another, within its budget: `python -m bench.gpu.lease`.

    python3 -m bench.gpu.lease --budget-s 1500 --out DIR [--plan layout-mps,layout,mps,rerun,...]
        [--model-dir /tmp/model] [--vllm-python python3] [--vllm-pythonpath /tmp/site]
        [--layout-cache /tmp/lm] [--rerun-rounds 2] [--auto-modes off,on]

Steps, in the order `--plan` gives them (its order is their priority):

  layout      bench.gpu --layout (transformers on gpu:0; the stand-in written first with
              `python -m testkit.layout_model CACHE --format transformers` where CACHE has none),
              its own --budget-s from the step's share
  layout-api2 the same with vLLM's `--api-server-count 2`, capacity, B2 and convert only: does
              a second API process lift one server's block-request ceiling? (The H200 run
              put the engine core at ~1.3 cores and the API process at half of one: likely
              not; bench/gpu/RESULTS.md.)
  layout-cpu  bench.gpu --layout --only cpu: the layout model on the CPU (transformers), ocrvl
              held to 4, 8 and all cores (`--layout-cores`), against one server
  layout-mps  bench.gpu.big_gpu --layout (transformers on gpu:0, the same stand-in) --settings
              mps-x4,mps-x2 (--layout-mps-settings) --pages 64, --budget-s likewise: ocrvl
              convert with layout on over 4 and 2 replicas under MPS against B2 on one (one
              server with layout on is bound by its engine loop's per-request CPU: ~21-23
              block requests/s on an H200, the GPU 22-37% busy); results bench.gpu.big_gpu's
              rows, `layout: true`
  mps         bench.gpu.big_gpu --settings x2,x2-sync,x2-api2,x2-batched-8k (--mps-settings:
              vLLM's options beside plain x2; replica counts: mps-x2,mps-x3,mps-x4,x2)
              --pages 256, --budget-s likewise
  rerun       bench.gpu, layout off: the run of record's --concurrency 128, --rounds N
  loops       bench.gpu.loop_savings
  small-card  bench.gpu.small_card --layout (transformers, the same stand-in)
  auto-replicas
              bench.gpu.ray_vs_local --order local: an `ocrvl run` daemon with its managed
              vLLM on `auto` settings (an 80 GiB card: 2 replicas under MPS), layout off then
              on (the same stand-in; --auto-modes), 3 timed books each: the `auto` figure of
              a vLLM release
  layout-threads
              bench.layout_speed --gpu-footprint --callers 48: the layout model's GPU memory
              from one thread against from 48 threads in turn (torch's per-thread handles)

Each step gets a share: its estimate, or what is left less the grace if that is less; a step
whose minimum does not fit what is left is skipped. It runs as a subprocess in a process
group (a session) of its own, every process it starts marked by OCRVL_BENCH_LEASE in its
environment (vLLM, ocrvl and MPS inherit it). At the share's end the group gets SIGTERM (the
benches stop their servers then), GRACE_S later SIGKILL; then every process still carrying
the step's mark is ended (an MPS control daemon first asked to `quit`): whatever a bench
started in a session of its own too, and nothing this lease did not start. Each step writes
its results (`DIR/STEP.json`), its output (`DIR/STEP.log`) and its processes' logs
(`DIR/STEP-logs/`) under DIR as it goes, so a poll that copies DIR keeps everything; and
`DIR/progress.txt` gets a line "HH:MM:SS step: state" at each change. Run it in a session of
its own (setsid) and poll DIR: a device command's processes end with the command.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from bench.gpu.teardown import end_processes
from testkit import layout_model

ROOT = Path(__file__).resolve().parents[2]
MARKER_ENV = "OCRVL_BENCH_LEASE"
GRACE_S = 45.0  # SIGTERM to SIGKILL: a bench stops its vLLM servers and daemons meanwhile
SWEEP_GRACE_S = 10.0
BENCH_MARGIN_S = 30.0  # a bench with --budget-s gets its share less this (its own wind-down)
DEFAULT_PLAN = "small-card,layout-cpu,mps"
STUB_ENV = "OCRVL_LEASE_STUB_COMMAND"  # tests: the `stub` step's command (shlex)


@dataclass(frozen=True)
class Step:
    """A bench in the lease: the seconds it is expected to take, and the least worth starting
    (vLLM's start alone is ~135 s on an H100)."""

    name: str
    estimate_s: float
    minimum_s: float


# Estimates from the H100 lease of 2026-12-05 (vLLM start 133 s; layout on: capture 29 s,
# capacity 22, B2 40, convert 46, run 44, small documents 120, layout alone and the CPU sweep).
STEPS = {
    "layout": Step("layout", 720, 330),  # all but the CPU sweep at 4 cores
    "layout-api2": Step("layout-api2", 420, 300),
    # vLLM's start (~110-175 s), then 12 pages at 4, 8 and all cores (~80-130 s each)
    "layout-cpu": Step("layout-cpu", 540, 330),
    # 4 replicas under MPS start in ~270 s on an H200, then B2 and two converts of 64 layout
    # pages (~30 s each) and the stop
    "layout-mps": Step("layout-mps", 480, 330),
    "mps": Step("mps", 560, 330),
    "rerun": Step("rerun", 700, 400),  # 2 rounds; more rounds: rerun_estimate_s
    "loops": Step("loops", 330, 240),
    "small-card": Step("small-card", 360, 240),
    # two daemon starts of ~140-205 s (2 replicas), each with a warm-up and 3 timed books
    "auto-replicas": Step("auto-replicas", 600, 330),
    "layout-threads": Step("layout-threads", 60, 30),  # torch's start and 100 calls
    "stub": Step("stub", 30, 1),  # tests only: STUB_ENV's command
}


def rerun_estimate_s(rounds: int) -> float:
    """vLLM's start and warm-up, 4 contenders a round on 256 pages, the small documents."""
    return 150 + rounds * 4 * 45 + 150


def chosen(plan: str) -> list[Step]:
    """The steps `plan` names, in its order (ValueError for an unknown one)."""
    names = [n.strip() for n in plan.split(",") if n.strip()]
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        raise ValueError(f"unknown step(s) {', '.join(unknown)}; known: "
                         f"{', '.join(n for n in STEPS if n != 'stub')}")  # fmt: skip
    if not names:
        raise ValueError("no step given")
    return [STEPS[n] for n in dict.fromkeys(names)]


def share_s(step: Step, left_s: float, grace_s: float = GRACE_S) -> float | None:
    """The seconds `step` may run before its SIGTERM, with `left_s` left of the budget (its
    SIGKILL, `grace_s` later, still within); None: its minimum does not fit."""
    room = left_s - grace_s
    if room < step.minimum_s:
        return None
    return min(step.estimate_s, room)


def split(steps: list[Step], budget_s: float, grace_s: float = GRACE_S
          ) -> list[tuple[str, float | None]]:  # fmt: skip
    """Each step's share where every step before it uses all of its own (the worst case;
    a step that ends early leaves its rest to the next)."""
    left, out = budget_s, []
    for step in steps:
        share = share_s(step, left, grace_s)
        out.append((step.name, share))
        if share is not None:
            left -= share + grace_s
    return out


def progress_line(step: str, state: str, now: float | None = None) -> str:
    """"HH:MM:SS step: state" (local time)."""
    return f"{time.strftime('%H:%M:%S', time.localtime(now))} {step}: {state}"


class Progress:
    """DIR/progress.txt, a line per change, flushed at once; echoed to stderr."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, step: str, state: str) -> None:
        line = progress_line(step, state)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
        print(line, file=sys.stderr, flush=True)


# --- finding and ending what a step started ---------------------------------------------------


def marked(token: str) -> list[psutil.Process]:
    """Every process whose environment carries MARKER_ENV = `token` (others' environments
    cannot be read: never ours)."""
    out = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error, OSError):
            if proc.environ().get(MARKER_ENV) == token:
                out.append(proc)
    return out


def quit_mps(proc: psutil.Process) -> None:
    """Ask an MPS control daemon to `quit` through its own pipe directory (as ocrvl does)."""
    with contextlib.suppress(psutil.Error, OSError, subprocess.SubprocessError):
        env = proc.environ()
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, timeout=15,
                       check=False, capture_output=True,
                       env={**os.environ, **{k: v for k, v in env.items()
                                             if k.startswith("CUDA_MPS_")}})  # fmt: skip


def sweep(token: str, grace_s: float = SWEEP_GRACE_S) -> list[str]:
    """End every process marked with `token`: MPS control daemons asked to quit first, then
    SIGTERM to their process groups (only groups whose every member is marked: never
    someone else's process), `grace_s`, SIGKILL. Returns what was found ("PID NAME")."""
    found = marked(token)
    if not found:
        return []
    said = []
    for p in found:
        with contextlib.suppress(psutil.Error):
            said.append(f"{p.pid} {' '.join(p.cmdline()[:3])[:80] or p.name()}")
    for p in found:
        with contextlib.suppress(psutil.Error):
            if p.name().startswith("nvidia-cuda-mps-control"):
                quit_mps(p)
    end_processes(found, grace_s, "of this lease", contained=True)
    return said


def kill_group(proc: subprocess.Popen[Any], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


# --- a step ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    state: str  # "done", "failed", "cut"
    returncode: int | None
    seconds: float
    leftovers: list[str]


def run_step(name: str, commands: list[list[str]], share: float, out: Path, token: str,
             progress: Callable[[str, str], None], grace_s: float = GRACE_S,
             env: dict[str, str] | None = None) -> Outcome:  # fmt: skip
    """`commands` one after another (each in a session of its own, marked with `token`),
    all within `share` seconds; at the deadline SIGTERM, `grace_s` later SIGKILL to the
    group; then every process still marked `token` ended. Output to OUT/NAME.log."""
    t0 = time.monotonic()
    deadline = t0 + share
    base = {**os.environ, **(env or {}), MARKER_ENV: token, "PYTHONUNBUFFERED": "1"}
    base["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(
        p for p in (str(ROOT), *base.get("PYTHONPATH", "").split(os.pathsep)) if p))
    state = "done"
    code: int | None = 0
    leftovers: list[str] = []
    with (out / f"{name}.log").open("ab") as log:
        for argv in commands:
            log.write(f"$ {shlex.join(argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(argv, cwd=ROOT, env=base, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)  # fmt: skip
            try:
                code = wait_or_cut(proc, deadline, grace_s, name, progress)
            finally:
                if proc.poll() is None:  # the lease itself was stopped: so is the step
                    kill_group(proc, signal.SIGKILL)
                    proc.wait()
                kill_group(proc, signal.SIGKILL)  # whatever of its group the leader left
                leftovers += sweep(token)
            if code is None:
                state = "cut"
                break
            if code != 0:
                state = "failed"
                break
    if leftovers:
        progress(name, f"ended {len(leftovers)} leftover process(es): {'; '.join(leftovers)}")
    return Outcome(state, code, time.monotonic() - t0, leftovers)


def wait_or_cut(proc: subprocess.Popen[Any], deadline: float, grace_s: float, name: str,
                progress: Callable[[str, str], None]) -> int | None:  # fmt: skip
    """The command's exit status, or None where it was cut at `deadline`."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        return proc.wait(max(0.0, deadline - time.monotonic()))
    progress(name, "deadline: SIGTERM to its process group")
    kill_group(proc, signal.SIGTERM)
    cut = time.monotonic()
    try:
        proc.wait(grace_s)
        progress(name, f"stopped {time.monotonic() - cut:.0f} s after SIGTERM")
    except subprocess.TimeoutExpired:
        progress(name, f"still there {grace_s:.0f} s after SIGTERM: SIGKILL")
        kill_group(proc, signal.SIGKILL)
        proc.wait()
    return None


# --- the steps' commands -------------------------------------------------------------------------


def commands(name: str, args: argparse.Namespace, share: float) -> list[list[str]]:
    """The commands of step `name` with `share` seconds (results and logs under args.out)."""
    py, out = args.python, args.out
    vllm = ["--model-dir", str(args.model_dir), "--vllm-python", args.vllm_python,
            "--vllm-pythonpath", args.vllm_pythonpath]  # fmt: skip
    logs = out / f"{name}-logs"
    logs.mkdir(parents=True, exist_ok=True)  # not every bench makes its --log-dir itself
    files = ["--results", str(out / f"{name}.json"), "--log-dir", str(logs)]
    budget = ["--budget-s", f"{max(60.0, share - BENCH_MARGIN_S):.0f}"]
    prepare: list[list[str]] = []
    if not (args.model_dir / "config.json").exists() and name != "stub":
        prepare.append([py, "-m", "bench.gpu.dummy_model", str(args.model_dir)])
    stand_in = [py, "-m", "testkit.layout_model", str(args.layout_cache), "--format",
                "transformers"]  # fmt: skip
    has_stand_in = layout_model.written(args.layout_cache)
    layout = ["--layout-engine", "transformers", "--layout-cache", str(args.layout_cache)]
    needs_stand_in = ("layout", "layout-api2", "layout-cpu", "layout-mps", "small-card",
                      "auto-replicas")
    if name in needs_stand_in and not has_stand_in:
        prepare.append(stand_in)
    if name == "layout":
        main = [py, "-m", "bench.gpu", *vllm, "--layout", *layout, "--layout-device", "gpu:0",
                *budget, *files]  # fmt: skip
    elif name == "layout-api2":
        main = [py, "-m", "bench.gpu", *vllm, "--layout", *layout, "--layout-device", "gpu:0",
                "--vllm-arg=--api-server-count=2", "--only", "capacity,b2,convert", *budget,
                *files]  # fmt: skip
    elif name == "layout-cpu":
        main = [py, "-m", "bench.gpu", *vllm, "--layout", *layout, "--layout-device", "gpu:0",
                "--only", "cpu", *budget, *files]  # fmt: skip
    elif name == "layout-mps":
        main = [py, "-m", "bench.gpu.big_gpu", *vllm, "--layout", *layout, "--layout-device",
                "gpu:0", "--settings", args.layout_mps_settings, "--pages", "64", *budget,
                *files]  # fmt: skip
    elif name == "mps":
        main = [py, "-m", "bench.gpu.big_gpu", *vllm, "--settings", args.mps_settings,
                "--pages", "256", *budget, *files]  # fmt: skip
    elif name == "rerun":
        main = [py, "-m", "bench.gpu", *vllm, "--rounds", str(args.rerun_rounds),
                "--concurrency", "128", *files]  # fmt: skip
    elif name == "loops":
        main = [py, "-m", "bench.gpu.loop_savings", *vllm, *files]
    elif name == "small-card":
        main = [py, "-m", "bench.gpu.small_card", *vllm, "--layout", *layout, *files]
    elif name == "auto-replicas":
        main = [py, "-m", "bench.gpu.ray_vs_local", *vllm, "--order", "local", "--modes",
                args.auto_modes, "--rounds", "3", "--layout-cache", str(args.layout_cache),
                *files]  # fmt: skip
    elif name == "layout-threads":
        main = [py, "-m", "bench.layout_speed", "--gpu-footprint", "--batches", "1",
                "--callers", "48"]
    elif name == "stub":
        main = shlex.split(os.environ[STUB_ENV])
    else:
        raise ValueError(name)
    return [*prepare, main]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from bench.gpu.vllm_server import vllm_python_arg

    ap = argparse.ArgumentParser(prog="python -m bench.gpu.lease", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--budget-s", type=float, required=True,
                    help="seconds for every step together, their clean-up included")
    ap.add_argument("--out", type=Path, required=True,
                    help="results, logs and progress.txt (copy it out while polling)")
    ap.add_argument("--plan", default=DEFAULT_PLAN,
                    help=f"steps in priority order (default {DEFAULT_PLAN})")
    ap.add_argument("--python", default=sys.executable, type=vllm_python_arg,
                    help="the Python the benches run in (default this one)")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/model"),
                    help="random-weight model dir (made with bench.gpu.dummy_model if missing)")
    ap.add_argument("--vllm-python", default=sys.executable, type=vllm_python_arg,
                    help="the Python that has vLLM (default this one)")
    ap.add_argument("--vllm-pythonpath", default="", help="PYTHONPATH for vLLM (a bundle)")
    ap.add_argument("--layout-cache", type=Path, default=Path("/tmp/lm"),
                    help="PADDLE_PDX_CACHE_HOME with the layout stand-in (written if missing)")
    ap.add_argument("--rerun-rounds", type=int, default=2,
                    help="rounds of the layout-off rerun (the run of record had 5)")
    ap.add_argument("--layout-mps-settings", default="mps-x4,mps-x2",
                    help="big_gpu settings of the layout-mps step, in order (an 80 GiB card's "
                         "`replicas: auto` is mps-x2: put it first there)")
    ap.add_argument("--mps-settings", default="x2,x2-sync,x2-api2,x2-batched-8k",
                    help="big_gpu settings of the mps step, in order (vLLM's options: x2-sync, "
                         "x2-api2, x2-batched-8k, x2-graphs-256; bench.gpu.big_gpu lists all)")
    ap.add_argument("--auto-modes", default="off,on",
                    help="layout modes of the auto-replicas step, in order (one lease per mode "
                         "lets two vLLM releases alternate on one machine: off, off, on, on)")
    ap.add_argument("--share", action="append", default=[], metavar="STEP=SECONDS",
                    help="a step's estimate (its share at most) instead of the built-in one")
    ap.add_argument("--grace-s", type=float, default=GRACE_S,
                    help=f"SIGTERM to SIGKILL at a step's deadline (default {GRACE_S:g})")
    args = ap.parse_args(argv)
    try:
        args.steps = chosen(args.plan)
    except ValueError as exc:
        ap.error(f"--plan: {exc}")
    overrides = {}
    for item in args.share:
        name, _, seconds = item.partition("=")
        if name not in STEPS or not seconds:
            ap.error(f"--share {item}: STEP=SECONDS with a known step")
        overrides[name] = float(seconds)
    if args.rerun_rounds != 2:
        overrides.setdefault("rerun", rerun_estimate_s(args.rerun_rounds))
    args.steps = [Step(s.name, overrides.get(s.name, s.estimate_s),
                       min(s.minimum_s, overrides.get(s.name, s.minimum_s)))
                  for s in args.steps]  # fmt: skip
    args.out = args.out.resolve()
    args.model_dir = args.model_dir.resolve()
    args.layout_cache = args.layout_cache.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    from bench.gpu.teardown import stops_what_it_started

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    progress = Progress(args.out / "progress.txt")
    token = f"lease-{os.getpid()}-{secrets.token_hex(4)}"
    t0 = time.monotonic()
    progress("lease", f"start: budget {args.budget_s:.0f} s, plan "
             + ", ".join(f"{n} {'skip' if s is None else f'{s:.0f} s'}"
                         for n, s in split(args.steps, args.budget_s, args.grace_s)))
    failed = 0
    with stops_what_it_started():
        try:
            for step in args.steps:
                left = args.budget_s - (time.monotonic() - t0)
                share = share_s(step, left, args.grace_s)
                if share is None:
                    progress(step.name, f"skipped: budget ({left:.0f} s left, needs "
                             f"{step.minimum_s + args.grace_s:.0f})")  # fmt: skip
                    continue
                progress(step.name, f"start (share {share:.0f} s of {left:.0f} s left)")
                outcome = run_step(step.name, commands(step.name, args, share), share, args.out,
                                   f"{token}-{step.name}", progress, args.grace_s)  # fmt: skip
                failed += outcome.state != "done"
                progress(step.name, f"{outcome.state} (exit {outcome.returncode}) in "
                         f"{outcome.seconds:.0f} s")  # fmt: skip
        finally:
            left_behind = [p for p in psutil.process_iter() if _carries(p, token)]
            progress("lease", f"end after {time.monotonic() - t0:.0f} s; processes of ours "
                     f"left: {len(left_behind)}")  # fmt: skip
    return 1 if failed else 0


def _carries(proc: psutil.Process, token: str) -> bool:
    with contextlib.suppress(psutil.Error, OSError):
        return proc.environ().get(MARKER_ENV, "").startswith(token)
    return False


if __name__ == "__main__":
    raise SystemExit(main())

"""`ocrvl setup-server`: create the separate vLLM environment and point `server.python` at it.

PaddlePaddle and vLLM's PyTorch pin different CUDA libraries, so the model server gets its own
virtual environment. The plan is a list of argv steps (no shell) that `--dry-run` prints
exactly as they would run, environment variables included.
"""

from __future__ import annotations

import io
import logging
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap
from ruamel.yaml.error import YAMLError

from ocrvl_daemon.atomic_file import write_atomic
from ocrvl_daemon.config import Config, expand_path
from ocrvl_daemon.config_file import DEFAULT_CONFIG_PATH
from ocrvl_daemon.errors import ConfigError, DependencyError, ExitCode
from ocrvl_daemon.server.gpu import GpuReading, read_gpu
from ocrvl_daemon.server.launchers import VLLM_REQUIREMENT, external_server_setup

log = logging.getLogger(__name__)

# What PaddleX's vLLM genai server checks for, minus its vllm==0.10.2 pin.
GENAI_SERVER_EXTRAS = ("xformers", "einops", "uvloop", "transformers<5")
FLASH_ATTN_VERSION = "2.8.3"
FLASH_ATTN_URL = (
    "https://github.com/Dao-AILab/flash-attention/releases/download/v{ver}/"
    "flash_attn-{ver}+cu{cuda_major}torch{torch_mm}cxx11abiTRUE-cp{py}-cp{py}-linux_x86_64.whl"
)
# (PyTorch major.minor, CUDA major) pairs flash-attn 2.8.3 publishes Linux x86-64 wheels for,
# limited to PyTorch >= 2.7, whose PyPI wheels use the C++11 ABI those wheels are built for.
FLASH_ATTN_WHEELS = frozenset({("2.7", "12"), ("2.8", "12"), ("2.9", "12")})
FLASH_ATTN_PYTHONS = frozenset({(3, 9), (3, 10), (3, 11), (3, 12), (3, 13)})
FLASH_ATTN_BUILD_DEPS = ("ninja", "packaging", "wheel", "setuptools", "psutil")
MIN_FLASH_ATTN_CAPABILITY = (8, 0)
# One nvcc job of flash-attn's build can take ~4 GiB of RAM; more jobs than that swap or die.
GIB_PER_BUILD_JOB = 4
GIB = 1024**3
TORCH_PROBE_TIMEOUT = 120.0


@dataclass(frozen=True)
class Step:
    """One thing setup does: run `argv` with `env` added, or write `server.python`."""

    title: str
    argv: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    set_python: tuple[Path, Path] | None = None  # (config file, interpreter)
    fix: str = "see the output above, fix the cause and run `ocrvl setup-server` again"


def plan_setup(venv: Path, config: Config, *, python_version: tuple[int, int],
               torch_cuda: str | None, gpu: GpuReading | None, config_path: Path,
               base_python: str = sys.executable, uv: str | None = None,
               mem_available: int | None = None, cpus: int | None = None) -> list[Step]:
    """The steps for this machine.

    `torch_cuda` is the server environment's `torch.__version__` (e.g. "2.8.0+cu128") when it
    exists already; `uv` is the uv executable, or None for venv + pip; `mem_available` (bytes)
    and `cpus` default to this machine's.
    """
    python = venv / "bin" / "python"
    install = _installer(python, uv)
    steps: list[Step] = []
    if not python.exists():
        argv = ((uv, "venv", "--python", base_python, str(venv)) if uv
                else (base_python, "-m", "venv", str(venv)))
        steps.append(Step(f"create the server environment {venv}", argv))
        if not uv:
            steps.append(Step("upgrade pip", (*install, "--upgrade", "pip")))
    packages = [VLLM_REQUIREMENT]
    if config.server.launcher == "genai_server":
        # One resolve, so xformers (which pins an exact torch) matches vLLM's torch.
        packages += [*GENAI_SERVER_EXTRAS, _paddleocr_requirement()]
    steps.append(Step(f"install {', '.join(packages)}", (*install, *packages)))
    if config.server.launcher == "genai_server":
        steps += _flash_attn_steps(install, python_version=python_version, torch_cuda=torch_cuda,
                                   gpu=gpu, mem_available=mem_available, cpus=cpus)
    steps.append(Step(f"set server.python: {python} in {config_path}",
                      set_python=(config_path, python),
                      fix=f"set server.python: {python} in {config_path} yourself"))
    return steps


def _installer(python: Path, uv: str | None) -> tuple[str, ...]:
    if uv:
        return (uv, "pip", "install", "--python", str(python))
    return (str(python), "-m", "pip", "install")


def _paddleocr_requirement() -> str:
    # `paddleocr genai_server` runs from the server environment: same version as the client.
    try:
        return f"paddleocr=={metadata.version('paddleocr')}"
    except metadata.PackageNotFoundError:
        return "paddleocr>=3.7.0,<3.8"


def flash_attn_wheel(python_version: tuple[int, int], torch_cuda: str | None) -> str | None:
    """The URL of the prebuilt flash-attn wheel for this Python and PyTorch build, if one exists."""
    if torch_cuda is None:
        return None
    torch, _, local = torch_cuda.partition("+")
    parts = torch.split(".")
    if not local.startswith("cu") or len(local) < 5 or len(parts) < 2:
        return None
    torch_mm, cuda_major = ".".join(parts[:2]), local[2:-1]
    if (torch_mm, cuda_major) not in FLASH_ATTN_WHEELS or python_version not in FLASH_ATTN_PYTHONS:
        return None
    py = f"{python_version[0]}{python_version[1]}"
    return FLASH_ATTN_URL.format(ver=FLASH_ATTN_VERSION, cuda_major=cuda_major,
                                 torch_mm=torch_mm, py=py)


def build_jobs(mem_available: int, cpus: int) -> int:
    """Parallel compile jobs that fit in `mem_available` bytes of RAM: 1 to `cpus`."""
    return max(1, min(cpus, mem_available // (GIB_PER_BUILD_JOB * GIB)))


def _flash_attn_steps(install: tuple[str, ...], *, python_version: tuple[int, int],
                      torch_cuda: str | None, gpu: GpuReading | None,
                      mem_available: int | None, cpus: int | None) -> list[Step]:
    if gpu is not None and gpu.compute_capability < MIN_FLASH_ATTN_CAPABILITY:
        cc = ".".join(map(str, gpu.compute_capability))
        raise DependencyError(
            f"{gpu.name} has compute capability {cc}; flash-attn, which the genai_server "
            "launcher requires, needs 8.0 or newer.", "set server.launcher: vllm")
    url = flash_attn_wheel(python_version, torch_cuda)
    if url:
        # --no-deps: torch is already the one vLLM needs; do not let pip re-resolve it.
        return [Step(f"install the prebuilt flash-attn {FLASH_ATTN_VERSION} wheel",
                     (*install, "--no-deps", url))]
    jobs = build_jobs(psutil.virtual_memory().available if mem_available is None
                      else mem_available, cpus or os.cpu_count() or 1)
    env = {"MAX_JOBS": str(jobs)}
    if gpu is not None:
        major, minor = gpu.compute_capability
        env["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
        # flash-attn picks its kernels' targets from this, not TORCH_CUDA_ARCH_LIST; sm_X0
        # code runs on every X.y GPU (an 8.9 RTX 4060 runs the 80 build).
        env["FLASH_ATTN_CUDA_ARCHS"] = f"{major}0"
    where = (f"for compute capability {env['TORCH_CUDA_ARCH_LIST']}" if gpu
             else "for every GPU generation (no GPU found: slower)")
    return [
        Step("install flash-attn's build tools", (*install, *FLASH_ATTN_BUILD_DEPS)),
        Step(f"build flash-attn {FLASH_ATTN_VERSION} from source {where}, {jobs} job(s) "
             "(its setup still downloads a matching prebuilt wheel if one exists; a build "
             "needs the CUDA toolkit's nvcc and can take an hour)",
             (*install, "--no-build-isolation", "--no-deps", f"flash-attn=={FLASH_ATTN_VERSION}"),
             env, fix="install the CUDA toolkit matching PyTorch's CUDA version (nvcc on PATH "
             "or CUDA_HOME set); if the build ran out of memory, free RAM and run again"),
    ]


def render_plan(plan: list[Step]) -> str:
    """Every step as it would run: `VAR=value ... argv` for commands."""
    lines = []
    for number, step in enumerate(plan, 1):
        lines.append(f"{number}. {step.title}")
        if step.argv:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in step.env.items())
            lines.append(f"   {env + ' ' if env else ''}{shlex.join(step.argv)}")
    return "\n".join(lines)


def run_setup(plan: list[Step], dry_run: bool, echo: Callable[[str], Any] = print) -> None:
    """Run each step in order (or only print the plan); a failed step raises DependencyError."""
    if dry_run:
        echo(render_plan(plan))
        return
    for step in plan:
        echo(f"==> {step.title}")
        if step.set_python:
            config_path, python = step.set_python
            set_config_key(config_path, ("server", "python"), str(python))
            continue
        echo("    " + " ".join([*(f"{k}={v}" for k, v in step.env.items()),
                                shlex.join(step.argv)]))
        try:
            done = subprocess.run(step.argv, env={**os.environ, **step.env}, check=False)
        except OSError as exc:
            raise DependencyError(f"Setup step '{step.title}' could not start: {exc}.",
                                  step.fix) from exc
        if done.returncode != 0:
            raise DependencyError(f"Setup step '{step.title}' failed (exit status "
                                  f"{done.returncode}).", step.fix)


def set_config_key(path: Path, key: tuple[str, ...], value: Any) -> None:
    """Set one key in a YAML config, keeping the other keys and comments; atomic; creates it."""
    yaml = YAML()  # round-trip mode: comments and key order survive
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = ""
    except OSError as exc:
        raise ConfigError(f"Cannot read config file {path}: {exc}.",
                          "check the file's permissions") from exc
    try:
        data = yaml.load(text) if text.strip() else CommentedMap()
    except YAMLError as exc:
        raise ConfigError(f"Config file {path} is not valid YAML: {exc}",
                          "fix the YAML syntax at the line shown") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {path} must hold a mapping of keys.",
                          "start from config.example.yaml")
    node = data
    for part in key[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = CommentedMap()
        node = node[part]
    node[key[-1]] = value
    out = io.StringIO()
    yaml.dump(data, out)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, out.getvalue())


def torch_version(python: Path) -> str | None:
    """`torch.__version__` in the environment of `python`; None if it has no torch (yet)."""
    if not python.exists():
        return None
    try:
        done = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                              capture_output=True, text=True, timeout=TORCH_PROBE_TIMEOUT,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[-1].strip() if done.returncode == 0 and lines else None


def setup_server(config: Config, config_path: Path | None, venv: Path, *, dry_run: bool
                 ) -> ExitCode:
    """Plan for this machine and run (or print) it; the CLI's `setup-server`."""
    venv = expand_path(venv).absolute()
    target = config_path or expand_path(DEFAULT_CONFIG_PATH)
    gpu = read_gpu()
    if gpu is None:
        _warn_no_gpu(config)
    plan = plan_setup(
        venv, config, python_version=(sys.version_info.major, sys.version_info.minor),
        torch_cuda=torch_version(venv / "bin" / "python"), gpu=gpu, config_path=target,
        uv=shutil.which("uv"))
    run_setup(plan, dry_run)
    return ExitCode.OK


def _warn_no_gpu(config: Config) -> None:
    # The environment can still be made (e.g. to copy it), so this is a warning, not a stop.
    log.warning("No NVIDIA GPU found on this machine (`ocrvl doctor` says why): the server "
                "environment can be created, but the model server will not run here. To use "
                "ocrvl on this machine, %s.", external_server_setup(config))

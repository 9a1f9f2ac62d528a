"""`ocrvl setup-server`: create the separate vLLM environment and point `server.python` at it.

PaddlePaddle and vLLM's PyTorch pin different CUDA libraries, so the model server gets its own
virtual environment, with exactly the vLLM release the project measured
(`vllm_release.PINNED`) unless `--vllm` asks for another. The plan is a list of steps (argv
without a shell, or an action of ocrvl's own) that `--dry-run` prints exactly as they would
run, environment variables included.

An environment is never changed in place: each one is built in a folder of its own beside
the `--venv` path, proven to import the vLLM asked for (with a torch this driver can run),
and only then does the `--venv` path, a symbolic link, switch to it in one rename. A failed
step leaves the environment in use as it was. Nothing is installed on a machine without an
NVIDIA GPU, nor for a driver too old for the build, unless `--force`. With a GPU, ocrvl's own
environment then sees the server environment's packages after its own (SHARED_PTH), so the
layout model runs on the GPU with the server's torch.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap
from ruamel.yaml.error import YAMLError

from ocrvl_daemon.config.file import DEFAULT_CONFIG_PATH
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.config.values import expand_path
from ocrvl_daemon.errors import ConfigError, DependencyError, ExitCode
from ocrvl_daemon.files.atomic import write_atomic
from ocrvl_daemon.server import driver_check, vllm_release
from ocrvl_daemon.server.gpu import GpuReading, driver_cuda, is_wsl, read_gpu
from ocrvl_daemon.server.launchers import external_server_setup

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
PROVE_TIMEOUT = 300.0  # importing vLLM imports torch and its CUDA libraries: a cold disk is slow
ENVS_SUFFIX = ".envs"  # <venv>.envs/ holds the environments the <venv> link points at
# In ocrvl's own site-packages: the server environment's site-packages, after ocrvl's own
# (a .pth line is appended to sys.path), so the layout model's GPU engine (PaddleX's
# transformers engine: torch, torchvision, transformers) needs no second multi-GB torch.
SHARED_PTH = "ocrvl-server-packages.pth"
OWN_SITE_ENV = "OCRVL_SITE_PACKAGES"  # ocrvl's own site-packages, where tests want another
# Run by the new environment's python: what it imports, as one JSON line.
_PROVE_SCRIPT = ("import json, torch, vllm; print(json.dumps({'vllm': vllm.__version__, "
                 "'torch': torch.__version__, 'cuda': torch.version.cuda}))")


@dataclass(frozen=True)
class Step:
    """One thing setup does: run `argv` with `env` added, or call `run` (ocrvl's own)."""

    title: str
    argv: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    run: Callable[[], None] | None = None
    fix: str = "see the output above, fix the cause and run `ocrvl setup-server` again"


@dataclass(frozen=True)
class Target:
    """Where the environment goes: `link` (the --venv path, what server.python names) will
    point at `folder`, a new folder of its own."""

    link: Path
    folder: Path

    @classmethod
    def new(cls, link: Path, version: str) -> Target:
        stamp = time.strftime("%Y%m%dT%H%M%S")
        return cls(link, link.with_name(link.name + ENVS_SUFFIX) / f"vllm-{version}-{stamp}")

    @property
    def python(self) -> Path:
        """The server's python as the config names it: through the link."""
        return self.link / "bin" / "python"

    def in_use(self) -> bool:
        """Whether the link points at this folder (the switch was made)."""
        return (self.link.is_symlink() and self.folder.exists()
                and self.link.resolve() == self.folder.resolve())

    @property
    def site_packages(self) -> Path:
        """Its packages, through the link (made by this Python: the same version)."""
        return self.link / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" \
            / "site-packages"


def plan_setup(target: Target, config: Config, *, vllm: str, python_version: tuple[int, int],
               torch_cuda: str | None, gpu: GpuReading | None, config_path: Path,
               base_python: str = sys.executable, uv: str | None = None,
               mem_available: int | None = None, cpus: int | None = None,
               check_driver: bool = True, wsl: bool = False) -> list[Step]:
    """The steps for this machine: build the environment in `target.folder`, prove it, switch
    `target.link` to it, set server.python.

    `vllm` is the release to install; `torch_cuda` the torch build it brings (e.g.
    "2.11.0+cu130") where known, for flash-attn's wheel; `uv` is the uv executable, or None
    for venv + pip; `mem_available` (bytes) and `cpus` default to this machine's.
    `check_driver`: refuse a torch this GPU's driver cannot run (`wsl` for the advice).
    """
    folder = target.folder
    python = folder / "bin" / "python"
    install = _installer(python, uv)
    argv = ((uv, "venv", "--python", base_python, str(folder)) if uv
            else (base_python, "-m", "venv", str(folder)))
    steps = [Step(f"create a new server environment {folder}", argv)]
    if not uv:
        steps.append(Step("upgrade pip", (*install, "--upgrade", "pip")))
    packages = [vllm_release.requirement(vllm)]
    if config.server.launcher == "genai_server":
        # One resolve, so xformers (which pins an exact torch) matches vLLM's torch.
        packages += [*GENAI_SERVER_EXTRAS, _paddleocr_requirement()]
    steps.append(Step(f"install {', '.join(packages)}", (*install, *packages)))
    if config.server.launcher == "genai_server":
        steps += _flash_attn_steps(install, python_version=python_version, torch_cuda=torch_cuda,
                                   gpu=gpu, mem_available=mem_available, cpus=cpus)
    steps += [
        Step(f"prove that {python} imports vLLM {vllm}"
             + (" with a torch this driver can run" if check_driver and gpu else ""),
             run=lambda: prove(python, vllm, config, gpu if check_driver else None, wsl)),
        Step(f"switch {target.link} to {folder} (the environment it replaces is removed)",
             run=lambda: switch(target)),
        Step(f"set server.python: {target.python} in {config_path}",
             run=lambda: set_config_key(config_path, ("server", "python"), str(target.python)),
             fix=f"set server.python: {target.python} in {config_path} yourself"),
    ]
    if gpu is not None:
        own = own_site_packages()
        steps.append(Step(
            f"let ocrvl's own environment use the server environment's torch, torchvision and "
            f"transformers for the layout model on the GPU ({own / SHARED_PTH}; its own "
            "packages come first)", run=lambda: share_packages(own, target.site_packages)))
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
        if step.run is not None:
            step.run()
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


def prove(python: Path, vllm: str, config: Config, gpu: GpuReading | None, wsl: bool) -> None:
    """Raise DependencyError unless `python` imports vLLM `vllm` and, with a `gpu`, a torch
    its driver can run."""
    try:
        done = subprocess.run([str(python), "-c", _PROVE_SCRIPT], capture_output=True,
                              text=True, timeout=PROVE_TIMEOUT, check=False,
                              env={**os.environ, **config.server.env})
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DependencyError(f"The new server environment's {python} did not run: {exc}.",
                              _RETRY) from exc
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        said = done.stderr.strip().splitlines()
        raise DependencyError(
            f"The new server environment cannot import vLLM ({python}: "
            f"{said[-1] if said else f'exit status {done.returncode}'}); the environment in "
            "use is left as it was.", _RETRY)
    try:
        found = json.loads(lines[-1])
    except ValueError as exc:
        raise DependencyError(f"The new server environment's {python} answered "
                              f"{lines[-1][:200]!r} instead of its versions; the environment in "
                              "use is left as it was.", _RETRY) from exc
    if found["vllm"] != vllm:
        raise DependencyError(f"The new server environment holds vLLM {found['vllm']}, not "
                              f"{vllm}; the environment in use is left as it was.", _RETRY)
    log.info("the new environment imports vLLM %s with torch %s (CUDA %s)", found["vllm"],
             found["torch"], found["cuda"])
    if gpu is not None:
        _refuse_old_driver(gpu, found["cuda"], f"the torch {found['torch']} that vLLM {vllm} "
                           "installed", wsl, "; the environment in use is left as it was")


_RETRY = ("see the error above; run `ocrvl setup-server` again (`--vllm VERSION` for another "
          "release)")


def _refuse_old_driver(gpu: GpuReading, cuda: str | None, what: str, wsl: bool,
                       aftermath: str) -> None:
    """Raise DependencyError when the driver is too old for `what`, built for CUDA `cuda`."""
    build = driver_check.parse_cuda(cuda)
    found = driver_cuda()
    if build is None or found is None:
        log.warning("not comparing the driver's CUDA version with %s (%s)", what,
                    "not a CUDA build" if build is None else "the driver's cannot be read")
        return
    too_old = driver_check.check(found, gpu.driver, build, what, wsl=wsl)
    if too_old is not None:
        raise DependencyError(f"{too_old.message[0].upper()}{too_old.message[1:]}{aftermath}.",
                              f"{too_old.fix} (`--force` installs it anyway)")


def own_site_packages() -> Path:
    """Where ocrvl's own environment keeps its packages."""
    return Path(os.environ.get(OWN_SITE_ENV) or sysconfig.get_path("purelib"))


def share_packages(own: Path, server_site: Path) -> None:
    """Make `server_site` importable in ocrvl's environment (site-packages `own`), after its
    own packages."""
    try:
        write_atomic(own / SHARED_PTH, f"{server_site}\n")
    except OSError as exc:
        # The server environment is ready and in use: only the layout model's place is lost.
        log.warning("cannot write %s (%s): the layout model stays on the CPU. Install ocrvl "
                    "into a virtual environment of its own (set-up command 1 in README), or "
                    "pip install 'ocrvl-daemon[gpu-layout]'", own / SHARED_PTH, exc)


def switch(target: Target) -> None:
    """Point `target.link` at `target.folder` in one rename; remove what it pointed at."""
    link, folder = target.link, target.folder
    staged = link.with_name(link.name + ".switching")
    staged.unlink(missing_ok=True)
    staged.symlink_to(folder)
    replaced: Path | None = None
    if link.is_symlink():
        replaced = link.resolve()
    elif link.exists():
        # A folder an older ocrvl made: moved aside, since a rename cannot replace a folder.
        # Its scripts name their own path, so the moved copy is not used again.
        replaced = folder.with_name(f"replaced-{folder.name}")
        link.rename(replaced)
    os.replace(staged, link)
    if replaced is not None and replaced != folder.resolve():
        shutil.rmtree(replaced, ignore_errors=True)


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


def setup_server(config: Config, config_path: Path | None, venv: Path, *, dry_run: bool,
                 vllm: str = vllm_release.PINNED, force: bool = False) -> ExitCode:
    """Plan for this machine and run (or print) it; the CLI's `setup-server`.

    Without an NVIDIA GPU, or with a driver too old for what would be installed, nothing is
    installed (DependencyError), unless `force`."""
    link = expand_path(venv).absolute()
    target_config = config_path or expand_path(DEFAULT_CONFIG_PATH)
    gpu = read_gpu()
    wsl = is_wsl()
    release = vllm_release.release(vllm)
    if gpu is None:
        _no_gpu(config, force)
    elif release is not None and not force:
        _refuse_old_driver(gpu, release.cuda, f"vLLM {vllm} (torch {release.torch_build})", wsl,
                           "; nothing was installed")
    target = Target.new(link, vllm)
    plan = plan_setup(
        target, config, vllm=vllm,
        python_version=(sys.version_info.major, sys.version_info.minor),
        torch_cuda=release.torch_build if release else None, gpu=gpu,
        config_path=target_config, uv=shutil.which("uv"), check_driver=not force, wsl=wsl)
    try:
        run_setup(plan, dry_run)
    except BaseException:
        if not target.in_use():
            shutil.rmtree(target.folder, ignore_errors=True)  # the one in use stays as it was
        raise
    if not dry_run:
        print(f"vLLM {vllm} is ready in {link}; restart ocrvl to use it (`systemctl --user "
              "restart ocrvl` for the service)")
    return ExitCode.OK


def _no_gpu(config: Config, force: bool) -> None:
    """Refuse (or with `force` warn) on a machine where the model server cannot run."""
    if not force:
        raise DependencyError(
            "No NVIDIA GPU found on this machine (`ocrvl doctor` says why): the model server "
            "cannot run here, so nothing was installed.",
            f"{external_server_setup(config)}; or, to install the server environment here "
            "anyway (e.g. to copy it), `ocrvl setup-server --force`")
    log.warning("No NVIDIA GPU found on this machine: installing the server environment "
                "anyway (--force), but the model server will not run here. To use ocrvl on "
                "this machine, %s.", external_server_setup(config))

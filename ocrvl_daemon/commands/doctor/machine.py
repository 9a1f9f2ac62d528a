"""`ocrvl doctor`'s checks of the machine: the GPU and its driver, WSL2, the client packages,
the layout model and the server environment."""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from ocrvl_daemon.commands.doctor.report import Check, Status
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.errors import DependencyError, ServerConfigError
from ocrvl_daemon.server import (
    autotune,
    driver_check,
    gpu,
    launchers,
    layout_engine,
    layout_model,
    mps,
    placement,
    vllm_release,
)
from ocrvl_daemon.server.launchers import flags_of, server_env
from ocrvl_daemon.server.layout_engine import LayoutChoice

WSL_CONF = Path("/etc/wsl.conf")


SERVER_PROBE_TIMEOUT = 120.0  # importing vllm (torch, CUDA libraries) is slow on a cold disk


MIN_COMPUTE_CAPABILITY = (8, 0)


SETUP_FIX = "run `ocrvl setup-server` (creates the server environment and sets server.python)"


# The layout model timed on a page of this size (height, width: A4 rendered at scale 2), in a
# child process: importing PaddleX and the engine takes seconds and must not stay here.
LAYOUT_SPEED_PAGE = (1684, 1190)


LAYOUT_SPEED_TIMEOUT = 180.0


_LAYOUT_SPEED_SCRIPT = f"""\
import json, sys, time
import numpy as np
from paddleocr import LayoutDetection
page = np.full(({LAYOUT_SPEED_PAGE[0]}, {LAYOUT_SPEED_PAGE[1]}, 3), 255, dtype=np.uint8)
for top in range(160, 1500, 48):  # lines of text
    page[top:top + 20, 120:1070] = 0
model = LayoutDetection(**json.loads(sys.argv[1]))
list(model.predict(page))  # the first page pays for the engine's setup
started = time.perf_counter()
list(model.predict(page))
print(json.dumps({{"pages_per_s": 1 / (time.perf_counter() - started)}}))
"""


# Run by server.python: import each module, print one JSON line of versions or errors.
_PROBE_SCRIPT = """\
import importlib, json, sys
found = {}
for name in sys.argv[1:]:
    try:
        found[name] = getattr(importlib.import_module(name), "__version__", "unknown")
    except Exception as exc:
        found[name] = "!" + type(exc).__name__ + ": " + str(exc)[:300]
torch = sys.modules.get("torch")
if torch is not None:
    found["torch.version.cuda"] = torch.version.cuda
print(json.dumps(found))
"""


def managed_model_server(config: Config) -> bool:
    return config.server.mode == "managed" and config.server.launcher != "command"


def gpu_found(probe: gpu.GpuProbe) -> Check:
    """The GPU as found, whatever the config wants of it."""
    reading = probe.reading
    if reading is None:
        return Check("GPU", "info", _no_gpu_found(probe))
    return Check("GPU", "ok", f"{reading.name} (#{reading.index}, {reading.uuid}), driver "
                 f"{reading.driver}, read by {reading.source}")


def _no_gpu_found(probe: gpu.GpuProbe) -> str:
    return f"no NVIDIA GPU found ({'; '.join(probe.problems) or 'nothing found'})"


def gpu_checks(config: Config, probe: gpu.GpuProbe) -> list[Check]:
    reading = probe.reading
    if reading is None:
        return [_no_gpu_check(config, probe)]
    cc = reading.compute_capability
    checks = [
        gpu_found(probe),
        Check("GPU memory", "ok", f"{gib(reading.total_mib)} total, "
              f"{gib(reading.used_mib)} used, {gib(reading.free_mib)} free"),
    ]
    if cc >= MIN_COMPUTE_CAPABILITY:
        checks.append(Check("compute capability", "ok", f"{cc[0]}.{cc[1]}"))
    elif config.server.launcher == "genai_server" and config.server.mode == "managed":
        checks.append(Check("compute capability", "fail",
                            f"{cc[0]}.{cc[1]}: flash-attn, which genai_server requires, needs 8.0",
                            "set server.launcher: vllm"))
    else:
        checks.append(Check(
            "compute capability", "warn",
            f"{cc[0]}.{cc[1]} is below 8.0 (T4 7.5, V100 7.0): vLLM is known to time out and "
            "run out of memory while starting on such GPUs",
            "expect slow starts; if it fails, set server.startup_timeout higher and "
            "server.vllm_args.max-num-seqs lower"))
    if managed_model_server(config):
        found = mps.probe(config) if config.server.mps != "off" else mps.MpsProbe(None)
        checks.append(_settings_check(config, reading, found.available))
        checks.append(_replicas_check(config, reading, found.available))
        checks.append(mps_check(config, reading, found))
    return checks


def _no_gpu_check(config: Config, probe: gpu.GpuProbe) -> Check:
    found = _no_gpu_found(probe)
    if config.server.mode == "external":
        return Check("GPU", "info", f"{found}; none needed here: the model server runs "
                     "elsewhere (server.mode: external)")
    driver_fix = ("install the NVIDIA driver (on WSL2: the Windows driver) until `nvidia-smi` "
                  "lists the GPU; CUDA_VISIBLE_DEVICES must name it")
    if not managed_model_server(config):  # server.command may well run without a GPU
        return Check("GPU", "warn", found, driver_fix)
    return Check("GPU", "fail", f"{found}: the managed vLLM server cannot run here",
                 f"{driver_fix}; or, with no NVIDIA GPU here, "
                 f"{launchers.external_server_setup(config)}")


def _settings_check(config: Config, reading: gpu.GpuReading, mps_available: bool) -> Check:
    # As each of the replicas on this GPU would start (`auto`: the count it decides).
    replicas = config.server.replicas
    if not isinstance(replicas, int):
        replicas = autotune.auto_replicas(reading.total_mib, mps_available)
    config = config.model_copy(update={"server": config.server.model_copy(
        update={"replicas": replicas})})
    remembered = autotune.load_remembered(config.state_dir, reading, config.model.name,
                                          replicas)
    tuned = autotune.plan_vllm_args(config, reading, remembered)
    shown = ", ".join(f"{k} {tuned.values[k]}" for k in autotune.TUNED_KEYS
                      if k in tuned.values)
    if tuned.warnings:
        return Check("server settings", "warn", shown, "; ".join(tuned.warnings))
    return Check("server settings", "info", f"{shown} (auto: computed from this GPU)")


def _replicas_check(config: Config, reading: gpu.GpuReading, mps_available: bool) -> Check:
    replicas = config.server.replicas
    if replicas == "auto":
        count = autotune.auto_replicas(reading.total_mib, mps_available)
        return Check("server replicas", "info", f"{count} per GPU (auto, from "
                     f"{gib(reading.total_mib)} on {reading.name})")
    assert isinstance(replicas, int)
    problem = autotune.replicas_fit_problem(config, reading, replicas)
    if problem is not None:
        return Check("server replicas", "fail", problem, "use server.replicas: 1 or auto")
    return Check("server replicas", "ok", f"{replicas} per GPU")


def mps_check(config: Config, reading: gpu.GpuReading, found: mps.MpsProbe) -> Check:
    """Whether the replicas would run under ocrvl's NVIDIA MPS daemon (server.mps), and why."""
    replicas = config.server.replicas
    if not isinstance(replicas, int):
        replicas = autotune.auto_replicas(reading.total_mib, found.available)
    try:
        plan = mps.plan(config, found, replicas > 1)
    except ServerConfigError as exc:
        return Check("MPS", "fail", exc.message, exc.fix)
    where = f"; {mps.CONTROL}: {found.control or 'not on PATH'}"
    return Check("MPS", "ok" if plan.use else "info",
                 f"{'used' if plan.use else 'not used'} ({plan.why}){where}")


def wsl_checks(osrelease: str | None) -> list[Check]:
    if not gpu.is_wsl(osrelease):
        return []
    checks = [Check(
        "WSL2", "warn", "running under WSL2: Windows shuts idle WSL VMs down, and inboxes on "
        "/mnt/c get no file change events",
        r"add vmIdleTimeout=-1 to the [wsl2] section of %UserProfile%\.wslconfig; keep inboxes "
        "in the Linux filesystem or set inbox.polling: true")]
    parser = configparser.ConfigParser()
    try:
        parser.read(WSL_CONF, encoding="utf-8")
        enabled = parser.getboolean("boot", "systemd", fallback=False)
    except (configparser.Error, ValueError, OSError):
        enabled = False
    if enabled:
        checks.append(Check("WSL2 systemd", "ok", f"enabled in {WSL_CONF}"))
    else:
        checks.append(Check("WSL2 systemd", "warn", f"not enabled in {WSL_CONF}: the ocrvl "
                            "service cannot run", f"add `[boot]` and `systemd=true` to {WSL_CONF}, "
                            "then run `wsl --shutdown` in Windows and reopen the terminal"))
    return checks


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def client_checks(config: Config) -> list[Check]:
    checks = []
    found = {d: _version(d) for d in ("paddleocr", "paddlex")}
    missing = [d for d, v in found.items() if v is None]
    if missing:
        checks.append(Check("paddleocr", "fail", f"{', '.join(missing)} not installed",
                            "reinstall ocrvl: pip install ocrvl-daemon"))
    else:
        checks.append(Check("paddleocr", "ok", ", ".join(f"{d} {v}" for d, v in found.items())))
    cpu, gpu_build = _version("paddlepaddle"), _version("paddlepaddle-gpu")
    layout = config.pipeline.use_layout_detection
    wants_gpu = config.pipeline.wanted_layout_device.startswith("gpu")
    if cpu and gpu_build:
        checks.append(Check("PaddlePaddle", "warn", f"both paddlepaddle {cpu} and "
                            f"paddlepaddle-gpu {gpu_build} are installed; they overwrite each "
                            "other", "pip uninstall the one you do not want"))
    elif gpu_build:
        checks.append(Check("PaddlePaddle", "ok", f"paddlepaddle-gpu {gpu_build} (GPU build)"))
    elif cpu:
        status: Status = "warn" if wants_gpu and layout else "ok"
        checks.append(Check(
            "PaddlePaddle", status, f"paddlepaddle {cpu} (CPU build: the layout model runs on "
            "the CPU)", "install paddlepaddle-gpu from PaddlePaddle's index, or "
            "'ocrvl-daemon[gpu-layout]', for pipeline.layout_device: gpu"
            if status == "warn" else None))
    elif layout and layout_engine.installed_engines().cpu:
        checks.append(Check("PaddlePaddle", "info", "not installed; the layout model runs on "
                            "another engine (see layout engine)"))
    elif layout:
        checks.append(Check("PaddlePaddle", "fail", "not installed; the layout model "
                            "(pipeline.use_layout_detection: true) needs it",
                            "pip install 'ocrvl-daemon[cpu]' (or 'ocrvl-daemon[gpu-layout]', "
                            "or paddlepaddle-gpu from PaddlePaddle's index)"))
    else:
        checks.append(Check("PaddlePaddle", "info", "not installed; not needed with "
                            "pipeline.use_layout_detection: false"))
    return checks


def layout_model_checks(config: Config) -> list[Check]:
    if not config.pipeline.use_layout_detection:
        return []
    try:
        choice = placement.layout_choice(config)
    except DependencyError as exc:
        return [Check("layout engine", "fail", exc.message, exc.fix)]
    workers = f"{choice.workers} worker{'s' if choice.workers != 1 else ''}"
    # On the CPU although the GPU could take it: the slow stage of every page, worth a warning.
    to_gpu = choice.to_the_gpu
    checks = [Check("layout engine", "warn" if to_gpu else "info",
                    f"{choice.describe()}, {workers}: {choice.why}", to_gpu or None,
                    data={"model": choice.model, "engine": choice.paddlex_engine,
                          "device": choice.device, "threads": choice.threads,
                          "workers": choice.workers})]
    checks.append(_layout_model_check(choice.model_folder))
    checks.append(_layout_speed_check(choice))
    return checks


def _layout_model_check(name: str) -> Check:
    """Whether PaddleX finds the layout model folder `name` or can download it."""
    folder = layout_model.model_dir(name)
    if folder.is_dir() and any(folder.iterdir()):
        return Check("layout model", "ok", f"{name} in {folder}")
    if folder.exists():
        return Check("layout model", "fail", f"{folder} is empty or not a folder: PaddleX "
                     f"takes it for {name} and cannot load it", f"delete {folder} (it is "
                     "downloaded again on first use)")
    hosts = layout_model.download_hosts()
    host = layout_model.answering_host(hosts)
    if host is not None:
        return Check("layout model", "ok", f"{name} is not downloaded yet: it will be, into "
                     f"{folder}, on first use (from {host[0]}, {host[1]} answers)")
    repo = layout_model.hugging_face_repo(name)
    return Check(
        "layout model", "fail", f"{name} is not in {folder} and cannot be downloaded: no "
        f"model host answers ({', '.join(url for _, url in hosts)})",
        f"on a machine with internet access run `pip install huggingface_hub && hf download "
        f"{repo} --local-dir {name}`, then copy that {name} folder into {folder.parent}/ "
        f"here (${layout_model.CACHE_HOME_ENV}, if set, changes where); or set "
        "pipeline.use_layout_detection: false (each page is then read whole, without layout "
        "blocks)")


def _layout_speed_check(choice: LayoutChoice) -> Check:
    """The layout model's own pages/s per worker here, timed on one page after a warm-up."""
    if not choice.has_model_files():
        return Check("layout speed", "info", "not measured: model not downloaded",
                     data={"pages_per_s": None})
    done = _run_quiet_json([sys.executable, "-c", _LAYOUT_SPEED_SCRIPT,
                            json.dumps({"model_name": choice.model, **choice.common_args()})],
                           LAYOUT_SPEED_TIMEOUT)
    if isinstance(done, str):
        return Check("layout speed", "warn", f"not measured: {done}",
                     "run a conversion with pipeline.use_layout_detection: true to see the "
                     "layout model's error", data={"pages_per_s": None})
    rate = float(done["pages_per_s"])
    return Check("layout speed", "info", f"{rate:.2f} pages/s per worker on {choice.device} "
                 f"(one {LAYOUT_SPEED_PAGE[1]}x{LAYOUT_SPEED_PAGE[0]} page after a warm-up)",
                 data={"pages_per_s": round(rate, 3)})


def _run_quiet_json(argv: list[str], timeout: float) -> dict[str, Any] | str:
    """The last stdout line of `argv` as JSON, or why there is none."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              check=False, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        return f"it took more than {timeout:.0f} s"
    except OSError as exc:
        return str(exc)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        said = done.stderr.strip().splitlines()
        return f"exit status {done.returncode}: {said[-1] if said else 'no output'}"
    try:
        found = json.loads(lines[-1])
    except ValueError:
        return f"unexpected output {lines[-1][:200]!r}"
    return found if isinstance(found, dict) else f"unexpected output {lines[-1][:200]!r}"


def server_env_checks(config: Config, probe: gpu.GpuProbe, wsl: bool) -> list[Check]:
    server = config.server
    if server.mode == "external":
        return []
    if probe.reading is None and managed_model_server(config):
        # `ocrvl setup-server` cannot help a machine where vLLM has no GPU to run on.
        return [Check("server environment", "info", "not checked: without an NVIDIA GPU "
                      "the managed server cannot run here (see GPU above for "
                      "server.mode: external)")]
    # What the launcher gives the server (server.env: PYTHONPATH, LD_LIBRARY_PATH...), so
    # doctor finds what the server will find.
    env = server_env(config)
    if server.launcher == "command":
        assert server.command  # the config guarantees it in this mode
        program = server.command[0]
        if shutil.which(program, path=env.get("PATH")) or Path(program).is_file():
            return [Check("server command", "ok", program)]
        return [Check("server command", "fail", f"{program} (server.command[0]) not found",
                      "install it or correct server.command")]
    assert probe.reading is not None  # no GPU returned above
    if server.python is None and server.launcher == "vllm":
        found = _vllm_on_path(config, env)
        if found.status != "fail":
            return [found]
        return [found, _setup_driver_check(probe.reading, wsl)]
    python = server.python or Path(sys.executable)
    if not python.is_file():
        return [Check("server python", "fail", f"{python} (server.python) does not exist",
                      SETUP_FIX), _setup_driver_check(probe.reading, wsl)]
    modules = ["vllm"]
    if server.launcher == "genai_server":
        modules += ["flash_attn", "xformers", "paddleocr"]
    try:
        # torch too: what its build needs of the driver is checked below.
        done = subprocess.run([str(python), "-c", _PROBE_SCRIPT, *modules, "torch"],
                              capture_output=True,
                              text=True, timeout=SERVER_PROBE_TIMEOUT, check=False, env=env)
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return [Check("server python", "fail", f"{python} took over {SERVER_PROBE_TIMEOUT:.0f} s "
                      "to import vllm", SETUP_FIX)]
    except (OSError, ValueError, IndexError) as exc:
        return [Check("server python", "fail", f"{python} did not run: {exc}", SETUP_FIX)]
    checks = [Check("server python", "ok", str(python))]
    for module in modules:
        version = str(found.get(module, "!not reported"))
        if version.startswith("!"):
            checks.append(Check(module, "fail", f"cannot be imported by {python}: {version[1:]}",
                                SETUP_FIX))
        elif module == "vllm":
            checks.append(_vllm_version_check(config, version, str(python)))
        else:
            checks.append(Check(module, "ok", version))
    torch = str(found.get("torch", "!not reported"))
    if not torch.startswith("!"):
        checks.append(_driver_check(probe.reading, found.get("torch.version.cuda"),
                                    f"the server environment's PyTorch {torch}", wsl))
    return checks


def _setup_driver_check(reading: gpu.GpuReading, wsl: bool) -> Check:
    """Whether the driver can run what `ocrvl setup-server` would install."""
    pinned = vllm_release.KNOWN[vllm_release.PINNED]
    return _driver_check(reading, pinned.cuda, f"the vLLM {vllm_release.PINNED} that `ocrvl "
                         f"setup-server` installs (torch {pinned.torch_build})", wsl)


def _driver_check(reading: gpu.GpuReading, build: str | None, what: str, wsl: bool) -> Check:
    """Whether the driver can run `what`, a build for CUDA `build` (None: a CPU build)."""
    needs = driver_check.parse_cuda(build)
    if needs is None:
        return Check("driver", "fail", f"{what} is not a CUDA build: vLLM cannot use the GPU",
                     SETUP_FIX)
    found = gpu.driver_cuda()
    if found is None:
        return Check("driver", "info", f"{reading.driver}: its CUDA version could not be read "
                     f"(NVML, nvidia-smi), so it is not compared with {what} (CUDA {build})")
    too_old = driver_check.check(found, reading.driver, needs, what, wsl=wsl)
    if too_old is not None:
        return Check("driver", "fail", too_old.message, too_old.fix)
    return Check("driver", "ok", f"{reading.driver} (CUDA {driver_check.text(found)}) runs "
                 f"{what} (CUDA {build})")


def _vllm_on_path(config: Config, env: dict[str, str]) -> Check:
    vllm = shutil.which("vllm", path=env.get("PATH"))
    if vllm is None:
        return Check("vllm", "fail", "server.python is not set and no `vllm` is on PATH",
                     SETUP_FIX)
    try:
        done = subprocess.run([vllm, "--version"], capture_output=True, text=True,
                              timeout=SERVER_PROBE_TIMEOUT, check=False, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check("vllm", "fail", f"{vllm} --version failed: {exc}", SETUP_FIX)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return Check("vllm", "fail", f"{vllm} --version exited with status {done.returncode}",
                     SETUP_FIX)
    return _vllm_version_check(config, lines[-1].strip(), vllm)


def _vllm_version_check(config: Config, version: str, where: str) -> Check:
    need = config.model.vl_model.min_vllm
    try:
        new_enough = Version(version) >= Version(need)
    except InvalidVersion:
        return Check("vllm", "warn", f"{version} in {where}: cannot tell whether it is >= {need}")
    if not new_enough:
        return Check("vllm", "fail", f"{version} in {where}; {config.model.name} needs "
                     f">= {need}", SETUP_FIX)
    pinned = vllm_release.PINNED
    if version != pinned:
        # What the managed server gets for this release beyond the pin's flags (launchers).
        extra = [f"--{f.flag}" for f in flags_of(version) if f not in flags_of(pinned)]
        gets = f"; ocrvl starts it with {' '.join(extra)}" if extra else ""
        return Check("vllm", "warn", f"{version} ({where}), not {pinned}, the release ocrvl pins "
                     f"and the project measured{gets}", f"`ocrvl setup-server` installs "
                     f"{pinned} in its place (leave it if you chose this one with --vllm)")
    return Check("vllm", "ok", f"{version} ({where}), the release ocrvl pins")


def gib(mib: float) -> str:
    return f"{mib / 1024:.1f} GiB"


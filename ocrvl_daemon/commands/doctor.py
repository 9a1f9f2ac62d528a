"""`ocrvl doctor`: check the GPU, both Python environments, the config, the inboxes, the server
and systemd, and say how to fix each problem.

Nothing here raises for a problem in the environment: every finding becomes a `Check`, and
`DoctorReport.blocking` tells the CLI whether conversion can work at all.
"""

from __future__ import annotations

import configparser
import contextlib
import getpass
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import httpx
from packaging.version import InvalidVersion, Version

from ocrvl_daemon.config import Config, folder_problem
from ocrvl_daemon.config_file import CONFIG_ENV, load_config, resolve_config_path
from ocrvl_daemon.errors import ConfigError, DependencyError, ServerConfigError
from ocrvl_daemon.server import autotune, driver_check, gpu, launchers, mps, vllm_release
from ocrvl_daemon.server.launchers import server_env
from ocrvl_daemon.server.managed import port_in_use
from ocrvl_daemon.server.probe import ENDPOINT_ABSENT, bearer_header, served_model_fix
from ocrvl_daemon.server.process_group import GroupRecord, group_members
from ocrvl_daemon.server.replicas import PIDFILE_GLOB
from ocrvl_daemon.worker import layout_engine, layout_model
from ocrvl_daemon.worker.layout_engine import LayoutChoice

Status = Literal["ok", "warn", "fail", "info"]
MARKS: dict[str, str] = {"ok": "✓", "warn": "!", "fail": "✗", "info": "·"}
WSL_CONF = Path("/etc/wsl.conf")
SERVER_PROBE_TIMEOUT = 120.0  # importing vllm (torch, CUDA libraries) is slow on a cold disk
SYSTEMD_TIMEOUT = 5.0
HTTP_TIMEOUT = 3.0
MIN_COMPUTE_CAPABILITY = (8, 0)
# What `run_doctor` skips while the config is invalid.
CONFIG_SECTIONS = ("GPU settings", "client packages", "layout model", "server environment",
                   "state_dir", "inbox", "server")
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


@dataclass(frozen=True)
class Check:
    """One finding; `fix` says what to do when it is not ok."""

    name: str
    status: Status
    detail: str
    fix: str | None = None
    # Figures for `--json` readers (the layout engine and its speed).
    data: dict[str, Any] | None = None


@dataclass
class DoctorReport:
    """Every check, in the order they ran."""

    checks: list[Check] = field(default_factory=list)
    config_path: str | None = None

    @property
    def blocking(self) -> bool:
        """True when a check failed: conversion cannot work until it is fixed."""
        return any(c.status == "fail" for c in self.checks)


def run_doctor(config_path: str | None, *, osrelease: str | None = None) -> DoctorReport:
    """Run every check; `osrelease` stands in for /proc/sys/kernel/osrelease (tests)."""
    report = DoctorReport()
    config, path, config_checks = _config(config_path)
    report.config_path = str(path) if path else None
    report.checks += config_checks
    sections: list[tuple[str, Callable[[], list[Check]]]]
    if config is None:
        # Built-in defaults would report problems of a configuration nobody asked for:
        # only what does not depend on it is checked.
        sections = [("GPU", lambda: [_gpu_found(gpu.probe_gpu())])]
        report.checks.append(Check("skipped", "info", f"{', '.join(CONFIG_SECTIONS)}: they "
                                   "depend on the config, checked once it is valid"))
    else:
        given = config
        gpu_probe = gpu.probe_gpu()
        sections = [
            ("GPU", lambda: _gpu_checks(given, gpu_probe)),
            ("client packages", lambda: _client_checks(given)),
            ("layout model", lambda: _layout_model_checks(given)),
            ("server environment",
             lambda: _server_env_checks(given, gpu_probe, gpu.is_wsl(osrelease))),
            ("state_dir", lambda: [_state_dir_check(given)]),
            ("inbox", lambda: _inbox_checks(given)),
            ("server", lambda: [_server_check(given)]),
        ]
        if config.cluster.address is not None:
            # The GPU and the server are each node's: the cluster's check asks the nodes.
            sections = [(name, run) for name, run in sections
                        if name not in ("GPU", "server environment", "server")]
            sections.append(("cluster", lambda: _cluster_checks(given)))
    sections += [("WSL2", lambda: _wsl_checks(osrelease)), ("systemd", _systemd_checks)]
    for name, run in sections:
        try:
            report.checks.extend(run())
        except Exception as exc:  # a bug or an odd system must not hide the other checks
            report.checks.append(Check(name, "warn", f"could not be checked: {exc!r}"))
    return report


def _cluster_checks(config: Config) -> list[Check]:
    """The Ray cluster of cluster.address (`cluster.doctor`)."""
    from ocrvl_daemon.cluster.doctor import cluster_findings

    return [Check("cluster", f.status, f.detail, f.fix) for f in cluster_findings(config)]


def render_text(report: DoctorReport) -> str:
    """One screen: a mark, the check and its detail, then `→ fix` under each problem."""
    width = max((len(c.name) for c in report.checks), default=0)
    lines = [f"ocrvl doctor (config: {report.config_path or 'built-in defaults'})"]
    for check in report.checks:
        lines.append(f"{MARKS[check.status]} {check.name:<{width}}  {check.detail}")
        if check.fix:
            indent = f"  {'':<{width}}  "
            lines.append(f"{indent}→ " + check.fix.replace("\n", f"\n{indent}  "))
    failed = sum(c.status == "fail" for c in report.checks)
    warned = sum(c.status == "warn" for c in report.checks)
    if failed:
        lines.append(f"{failed} problem(s) block conversion, {warned} warning(s).")
    else:
        lines.append(f"Nothing blocks conversion; {warned} warning(s).")
    return "\n".join(lines)


def render_json(report: DoctorReport) -> str:
    """The report for scripts: config path, blocking verdict and every check."""
    return json.dumps(
        {"config": report.config_path, "blocking": report.blocking,
         "checks": [asdict(c) for c in report.checks]},
        indent=2, ensure_ascii=False,
    )


def _config(config_path: str | None) -> tuple[Config | None, Path | None, list[Check]]:
    """The config, the file it came from, and a check per problem (all of them at once)."""
    # The file read (or named) heads the report even when it is invalid or missing.
    named = config_path or os.environ.get(CONFIG_ENV)
    path = Path(named).expanduser() if named else None
    try:
        path = resolve_config_path(config_path)
        config, _ = load_config(path)
    except ConfigError as exc:
        return None, path, [Check("config", "fail", p.message, p.fix) for p in exc.problems]
    where = str(path) if path else "no config file, built-in defaults"
    return config, path, [Check("config", "ok", f"valid ({where})")]


def _managed_model_server(config: Config) -> bool:
    return config.server.mode == "managed" and config.server.launcher != "command"


def _gpu_found(probe: gpu.GpuProbe) -> Check:
    """The GPU as found, whatever the config wants of it."""
    reading = probe.reading
    if reading is None:
        return Check("GPU", "info", _no_gpu_found(probe))
    return Check("GPU", "ok", f"{reading.name} (#{reading.index}, {reading.uuid}), driver "
                 f"{reading.driver}, read by {reading.source}")


def _no_gpu_found(probe: gpu.GpuProbe) -> str:
    return f"no NVIDIA GPU found ({'; '.join(probe.problems) or 'nothing found'})"


def _gpu_checks(config: Config, probe: gpu.GpuProbe) -> list[Check]:
    reading = probe.reading
    if reading is None:
        return [_no_gpu_check(config, probe)]
    cc = reading.compute_capability
    checks = [
        _gpu_found(probe),
        Check("GPU memory", "ok", f"{_gib(reading.total_mib)} total, "
              f"{_gib(reading.used_mib)} used, {_gib(reading.free_mib)} free"),
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
    if _managed_model_server(config):
        found = mps.probe(config) if config.server.mps != "off" else mps.MpsProbe(None)
        checks.append(_settings_check(config, reading, found.available))
        checks.append(_replicas_check(config, reading, found.available))
        checks.append(_mps_check(config, reading, found))
    return checks


def _no_gpu_check(config: Config, probe: gpu.GpuProbe) -> Check:
    found = _no_gpu_found(probe)
    if config.server.mode == "external":
        return Check("GPU", "info", f"{found}; none needed here: the model server runs "
                     "elsewhere (server.mode: external)")
    driver_fix = ("install the NVIDIA driver (on WSL2: the Windows driver) until `nvidia-smi` "
                  "lists the GPU; CUDA_VISIBLE_DEVICES must name it")
    if not _managed_model_server(config):  # server.command may well run without a GPU
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
                     f"{_gib(reading.total_mib)} on {reading.name})")
    assert isinstance(replicas, int)
    problem = autotune.replicas_fit_problem(config, reading, replicas)
    if problem is not None:
        return Check("server replicas", "fail", problem, "use server.replicas: 1 or auto")
    return Check("server replicas", "ok", f"{replicas} per GPU")


def _mps_check(config: Config, reading: gpu.GpuReading, found: mps.MpsProbe) -> Check:
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


def _wsl_checks(osrelease: str | None) -> list[Check]:
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


def _client_checks(config: Config) -> list[Check]:
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


def _layout_model_checks(config: Config) -> list[Check]:
    if not config.pipeline.use_layout_detection:
        return []
    try:
        choice = autotune.layout_choice(config)
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


def _server_env_checks(config: Config, probe: gpu.GpuProbe, wsl: bool) -> list[Check]:
    server = config.server
    if server.mode == "external":
        return []
    if probe.reading is None and _managed_model_server(config):
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
        return Check("vllm", "warn", f"{version} ({where}), not {pinned}, the release ocrvl pins "
                     "and the project measured", f"`ocrvl setup-server` installs {pinned} in its "
                     "place (leave it if you chose this one with --vllm)")
    return Check("vllm", "ok", f"{version} ({where}), the release ocrvl pins")


def _state_dir_check(config: Config) -> Check:
    state = config.state_dir
    problem = folder_problem(state) or _write_problem(state)
    if problem is not None:
        return Check("state_dir", "fail", f"state_dir = {state} cannot be used: {problem}",
                     "set state_dir in the config file to a folder this user can create and "
                     "write (the default is ~/.local/state/ocrvl)")
    return Check("state_dir", "ok", f"{state} is usable")


def _write_problem(folder: Path) -> str | None:
    """Why `folder` cannot be created and written, found by doing so as `ocrvl run` will
    (`access()` says yes to root anywhere, even under /proc); what this made is removed."""
    made = [p for p in (folder, *folder.parents) if not os.path.lexists(p)]  # deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        return f"it cannot be created: {exc.strerror or exc}"
    try:
        fd, probe = tempfile.mkstemp(prefix=".ocrvl-doctor-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"a file cannot be written in it: {exc.strerror or exc}"
    finally:
        for created in made:
            with contextlib.suppress(OSError):
                created.rmdir()
    return None


def _inbox_checks(config: Config) -> list[Check]:
    checks = []
    for path in config.inbox.paths:
        problem = folder_problem(path)
        if not path.exists() and problem is not None:
            checks.append(Check("inbox", "fail", f"{path} {problem}: `ocrvl run` would watch "
                                "nothing there", "point inbox.paths at a folder this user can "
                                "create, or fix the path"))
        elif not path.exists():
            checks.append(Check("inbox", "warn", f"{path} does not exist (`ocrvl run` "
                                "creates it)", f"mkdir -p {path}"))
        elif not path.is_dir():
            checks.append(Check("inbox", "fail", f"{path} is not a folder",
                                "point inbox.paths at a folder"))
        elif not os.access(path, os.W_OK | os.X_OK):
            checks.append(Check("inbox", "fail", f"{path} is not writable: the Markdown is "
                                "written next to each PDF", f"chmod u+rwx {path}"))
        else:
            checks.append(Check("inbox", "ok", f"{path} exists and is writable"))
        fs_check = _filesystem_check(config, path)
        if fs_check:
            checks.append(fs_check)
    return checks


def _filesystem_check(config: Config, path: Path) -> Check | None:
    try:
        from ocrvl_daemon.inbox import filesystems  # written alongside; absent in older trees
    except ImportError:
        return None
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    fstype = filesystems.filesystem_type(existing)
    polling = config.inbox.polling
    if not filesystems.needs_polling(fstype):
        return Check("inbox filesystem", "ok", f"{path}: {fstype}, change events work")
    if polling is False:
        return Check("inbox filesystem", "warn", f"{path}: {fstype} sends no change events "
                     "and inbox.polling is false: new PDFs are only seen by the periodic rescan",
                     "set inbox.polling: true (or auto)")
    return Check("inbox filesystem", "info", f"{path}: {fstype} sends no change events; "
                 "polling is used")


def _server_check(config: Config) -> Check:
    server = config.server
    root = server.root_url
    external = server.mode == "external"
    headers = bearer_header(server.api_key)
    try:
        health = httpx.get(f"{root}/health", timeout=HTTP_TIMEOUT, headers=headers)
        models = httpx.get(f"{server.base_url}/models", timeout=HTTP_TIMEOUT, headers=headers)
    except httpx.HTTPError as exc:
        if external:
            return Check("server", "fail", f"{root} does not answer ({type(exc).__name__})",
                         "start the server, or correct server.url")
        if port_in_use(server.host, server.port):
            return _port_taken(config, "it does not answer HTTP")
        return Check("server", "info", f"not running at {root} (ocrvl starts it when needed)")
    if not external and not _ocrvl_server_running(config):
        return _port_taken(config, f"it answers /health with {health.status_code}")
    if models.status_code == 401:
        return Check("server", "fail", f"{root} refuses ocrvl's requests (/v1/models: 401 "
                     "Unauthorized)", _api_key_fix(config))
    absent = external and health.status_code in ENDPOINT_ABSENT  # not every server has /health
    if health.status_code != 200 and not absent:
        return Check("server", "fail" if external else "warn",
                     f"{root}/health answers {health.status_code}: the engine is not serving",
                     "restart the server" if external else "ocrvl restarts it; see its log")
    if external and models.status_code in ENDPOINT_ABSENT:
        return Check("server", "warn", f"{root} answers but does not list its models "
                     f"(/v1/models: {models.status_code}), so serving {config.model.served} "
                     "cannot be checked", "nothing, if it serves PaddleOCR-VL under that name")
    try:
        served = [m["id"] for m in models.json()["data"]]
    except (ValueError, KeyError, TypeError):
        served = []
    if config.model.served not in served:
        return Check("server", "fail", f"{root} serves {served or 'no models'}, not "
                     f"{config.model.served}", served_model_fix(config, served))
    return Check("server", "ok", f"{root} is up and serves {config.model.served}")


def _ocrvl_server_running(config: Config) -> bool:
    """Whether a managed server that ocrvl started (its pidfile's group) is running."""
    for pidfile in config.state_dir.glob(PIDFILE_GLOB):
        record = GroupRecord.load(pidfile)
        if record is not None and group_members(record.pgid):
            return True
    return False


def _port_taken(config: Config, how: str) -> Check:
    server = config.server
    return Check(
        "server", "fail", f"port {server.port} on {server.host} is taken by another program "
        f"({how}); ocrvl's own server is not running: `ocrvl run` could not start its "
        "server there", f"stop that program (`ss -ltnp 'sport = :{server.port}'` names it), "
        f"or set server.port to a free port; to use it as the model server, set "
        f"`server: {{mode: external, url: {server.base_url}}}`")


def _api_key_fix(config: Config) -> str:
    """What to do about a 401: set the key, or set the right one (and where it comes from)."""
    if config.server.api_key is None:
        return ("the server wants an API key: set server.api_key to its key (e.g. "
                "`api_key: $OCRVL_API_KEY`, with that variable set where ocrvl runs)")
    # An unset $VARIABLE in server.api_key is a config error already: this key is a real one.
    return ("the server refuses server.api_key: set it (or the variable it names) to the key "
            "the server was started with (its --api-key or $VLLM_API_KEY)")


def _systemd_checks() -> list[Check]:
    if shutil.which("systemctl") is None:
        return [Check("systemd", "info", "no systemctl: run `ocrvl run` yourself")]
    state = _run_quiet(["systemctl", "--user", "is-system-running"])
    if state == "running":
        checks = [Check("systemd", "ok", "user manager running")]
    elif state == "degraded":
        checks = [Check("systemd", "warn", "user manager running, some user units failed",
                        "see systemctl --user --failed")]
    elif state in ("initializing", "starting"):
        checks = [Check("systemd", "info", f"user manager {state}")]
    else:
        said = state or "no answer"
        if not os.environ.get("XDG_RUNTIME_DIR"):
            said += ", XDG_RUNTIME_DIR is not set"
        return [Check("systemd", "warn", f"no systemd user manager reachable ({said}): "
                      "`systemctl --user start ocrvl` will not work",
                      "log in through a systemd session (on WSL2 enable systemd), or run "
                      "`ocrvl run` yourself")]
    user = os.environ.get("USER") or getpass.getuser()
    linger = _run_quiet(["loginctl", "show-user", user, "-p", "Linger"])
    if linger == "Linger=yes":
        checks.append(Check("linger", "ok", f"enabled for {user}: ocrvl runs without a login"))
    elif linger == "Linger=no":
        checks.append(Check("linger", "warn", f"off for {user}: the service stops at logout "
                            "and does not start at boot", f"loginctl enable-linger {user}"))
    else:
        checks.append(Check("linger", "info", "unknown (loginctl gave no answer)"))
    return checks


def _run_quiet(argv: list[str]) -> str:
    """First line of a small command's output, "" when it cannot run."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=SYSTEMD_TIMEOUT,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if lines else ""


def _gib(mib: float) -> str:
    return f"{mib / 1024:.1f} GiB"

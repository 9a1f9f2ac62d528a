"""How to start the model server: argv and environment per `server.launcher`.

* `vllm`: `vllm serve <weights> --served-model-name <model.served> ...` (the default).
* `genai_server`: `paddleocr genai_server ... --backend_config <yaml>`; needs flash-attn
  and xformers in the server environment.
* `command`: the user's `server.command` with `{host}`, `{port}`, `{model}` (the served
  name), `{weights}` filled in and a `{vllm_args}` element expanded to the vLLM flags.

`server.python` selects a separate virtual environment: its `vllm`/`paddleocr` script runs.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml
from packaging.version import InvalidVersion, Version

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.config.models import TRUST_MM_KWARGS, TRUST_MM_KWARGS_SINCE
from ocrvl_daemon.errors import ServerConfigError, ServerMissingError
from ocrvl_daemon.process.sd_notify import child_env
from ocrvl_daemon.server import vllm_release
from ocrvl_daemon.server.autotune import TunedArgs, plan_vllm_args
from ocrvl_daemon.server.gpu import GpuReading, is_wsl

log = logging.getLogger(__name__)

# PaddleOCR-VL's vLLM recipe, for a small card: one image per prompt, no prefix or
# multimodal-processor caches (every page is new), and a modest profiling batch (the size
# of the VRAM spike at start-up). `server.vllm_args` overrides any of them; `null` drops one.
RECIPE_DEFAULTS: dict[str, Any] = {
    "limit-mm-per-prompt": {"image": 1},
    "enable-prefix-caching": False,
    "mm-processor-cache-gb": 0,
    "max-num-batched-tokens": 16384,
}
# vLLM boolean flags whose `false` must be spelled `--no-<flag>` (their default is on, or
# decided by vLLM: 0.26 turns async scheduling on unless a feature rules it out).
NEGATABLE_FLAGS = frozenset({"enable-prefix-caching", "enable-chunked-prefill",
                             "async-scheduling"})
BACKEND_CONFIG_NAME = "genai_server_backend.yaml"
SETUP_FIX = "run `ocrvl setup-server` to create the server environment"
ANY_HOST = "0.0.0.0"  # a server meant for other machines listens on every address


@dataclass(frozen=True)
class VersionedFlag:
    """A vLLM flag the managed server gets where the server environment's vLLM has it (an
    unknown flag makes `vllm serve` exit at once)."""

    flag: str
    value: Any
    since: Version  # the first vLLM release with the flag
    why: str


# ocrvl streams every answer only to stop one as soon as it loops. vLLM sends an SSE chunk per
# generated token by default, each costing CPU in its API process, which bound a layout-on
# server on an H100 (bench/gpu/RESULTS.md). A chunk per 16 tokens delays a loop stop by at most
# 16 tokens, a fraction of any loop ocrvl stops, against ~16x fewer chunks.
STREAM_INTERVAL = 16
STREAM_INTERVAL_FLAG = VersionedFlag(
    "stream-interval", STREAM_INTERVAL, Version("0.12.0"),  # vLLM PR #27869 (2025-11-12)
    f"a streamed chunk per {STREAM_INTERVAL} tokens instead of one per token")
# vLLM >= 0.31 refuses PaddleX's image-size bounds without it (config.models): every page
# would be refused. The managed server listens on 127.0.0.1 unless `server.host` says
# otherwise; vLLM before 0.31 takes those fields from anyone.
TRUST_MM_KWARGS_FLAG = VersionedFlag(
    TRUST_MM_KWARGS, True, Version(TRUST_MM_KWARGS_SINCE),
    "PaddleOCR-VL's requests carry each block's image size, which vLLM refuses without it")
VERSIONED_FLAGS = (STREAM_INTERVAL_FLAG, TRUST_MM_KWARGS_FLAG)


def flags_of(version: str | None) -> tuple[VersionedFlag, ...]:
    """The VERSIONED_FLAGS that vLLM `version` has (none where it is unknown or unreadable)."""
    parsed = _parse_version(version) if version is not None else None
    return tuple(f for f in VERSIONED_FLAGS if parsed is not None and parsed >= f.since)


# vLLM >= 0.24's default model runner (V2) needs UVA, and vLLM turns pinned memory off under
# WSL2, so every default start there dies with "UVA is not available" (vLLM issues 47387,
# 50239, 54652). The V1 runner does without. vLLM 0.34.0 removed the V1 runner and refuses
# VLLM_USE_V2_MODEL_RUNNER=0 (seen on the lent H100, 2026-12-07); there pinned memory is turned
# back on instead, which gives the V2 runner its UVA. A user who set either variable chose.
WSL_V1_RUNNER = ("VLLM_USE_V2_MODEL_RUNNER", "0")
WSL_PIN_MEMORY = ("VLLM_WSL2_ENABLE_PIN_MEMORY", "1")
V1_RUNNER_REMOVED = Version("0.34.0")
WSL_USER_CHOICES = (WSL_V1_RUNNER[0], WSL_PIN_MEMORY[0])
_DEPENDENCY_CHECK_TIMEOUT = 120.0  # importing flash_attn imports torch: seconds, not ms


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to start the server process."""

    argv: list[str]
    env: dict[str, str]


def resolve_vllm_args(config: Config, gpu: GpuReading | None = None,
                      remembered: dict[str, Any] | None = None) -> TunedArgs:
    """The vLLM flags to launch with: recipe defaults, `server_defaults`, then the user's,
    `auto` planned.

    `gpu` is the card as it is now (None: safe fixed values); `remembered` holds values an
    out-of-memory recovery lowered, which the plan never exceeds.
    """
    tuned = plan_vllm_args(config, gpu, remembered)
    tuned.values = {**RECIPE_DEFAULTS, **server_defaults(config), **tuned.values}
    return tuned


def server_defaults(config: Config) -> dict[str, Any]:
    """Flags that depend on the server environment's vLLM (`VERSIONED_FLAGS`): each where that
    vLLM has it. Never for `server.launcher: command` (the user's own program, maybe a
    container), nor a flag the user set (their value, or `null`, wins anyway)."""
    if config.server.launcher == "command":
        return {}
    version, where = server_vllm_version(config)
    has = flags_of(version)
    added: dict[str, Any] = {}
    for flag in VERSIONED_FLAGS:
        if flag.flag in config.server.vllm_args:
            continue
        if flag in has:
            spelled = " ".join(vllm_flags({flag.flag: flag.value}))
            _say_once(f"{where}:{flag.flag}", f"adding {spelled} to the vLLM flags: vLLM "
                      f"{version} in {where} has it ({flag.why})")
            added[flag.flag] = flag.value
            continue
        if version is None:
            why = f"no vLLM version found in {where}"
        elif _parse_version(version) is None:
            why = f"cannot compare vLLM version {version!r} in {where}"
        else:
            why = f"vLLM {version} in {where} predates {flag.since}, which added it"
        _say_once(f"{where}:{flag.flag}", f"not adding --{flag.flag} to the vLLM flags: {why}")
    return added


_said: dict[str, str] = {}  # the last decision logged per server environment


def _say_once(where: str, message: str) -> None:
    if _said.get(where) != message:
        _said[where] = message
        log.info("%s", message)


def _parse_version(version: str) -> Version | None:
    try:
        return Version(version)
    except InvalidVersion:
        return None


def _server_prefix(config: Config) -> Path | None:
    """The environment (its prefix: bin/, lib/) whose vLLM the managed server runs; None when
    that is ocrvl's own interpreter's."""
    server = config.server
    if server.python is not None:
        # Not resolved: a venv's bin/python links to the base interpreter, outside the venv.
        return server.python.parent.parent
    script = _find_script(config, "paddleocr" if server.launcher == "genai_server" else "vllm")
    return script.parent.parent if script is not None else None


# What each server environment holds (version, where), by the folders it was read from.
_versions: dict[tuple[Any, ...], tuple[str | None, str]] = {}


def server_vllm_version(config: Config) -> tuple[str | None, str]:
    """The vLLM version installed in the server environment (None: none found), and where
    that environment is.

    Read from the `vllm-<version>.dist-info` folder where the server's Python imports vLLM
    from: a `PYTHONPATH` folder in `server.env` first, as Python searches them, then its
    lib/python3*/site-packages (or dist-packages); without importing vLLM or starting its
    Python. For ocrvl's own environment from importlib.metadata. Remembered per environment
    until one of those folders changes (an install or upgrade there). Several versions in one
    folder (a broken upgrade's leftover): the oldest.
    """
    prefix = _server_prefix(config)
    extra = [Path(d) for d in config.server.env.get("PYTHONPATH", "").split(os.pathsep) if d]
    if prefix is None and not extra:
        key: tuple[Any, ...] = (sys.prefix,)
        if key not in _versions:
            try:
                version: str | None = metadata.version("vllm")
            except metadata.PackageNotFoundError:
                version = None
            _versions[key] = version, f"ocrvl's own environment ({sys.prefix})"
        return _versions[key]
    prefix = prefix or Path(sys.prefix)  # PYTHONPATH before ocrvl's own interpreter's
    sites = [d for d in extra if d.is_dir()]
    sites += sorted(d for pattern in ("lib/python3*/site-packages", "lib/python3*/dist-packages")
                    for d in prefix.glob(pattern) if d.is_dir())
    key = (str(prefix), *((str(d), d.stat().st_mtime_ns) for d in sites))
    if key not in _versions:
        _versions[key] = None, str(prefix)
        for site in sites:
            found = [v for info in site.glob("vllm-*.dist-info")
                     if (v := _parse_version(info.name[len("vllm-"):-len(".dist-info")]))]
            if found:
                _versions[key] = str(min(found)), str(prefix if site not in extra else site)
                break
    return _versions[key]


def _flag_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def vllm_flags(args: Mapping[str, Any]) -> list[str]:
    """`{"max-num-seqs": 8, "enforce-eager": True}` -> `["--max-num-seqs", "8", "--enforce-eager"]`.

    `true` is a bare flag, `false` is omitted (or `--no-<flag>` for flags that default on),
    `null` is omitted, mappings and lists are JSON.
    """
    flags: list[str] = []
    for key, value in args.items():
        if value is None:
            continue
        if isinstance(value, bool):
            if value:
                flags.append(f"--{key}")
            elif key in NEGATABLE_FLAGS:
                flags.append(f"--no-{key}")
            continue
        flags += [f"--{key}", _flag_value(value)]
    return flags


def backend_config(args: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM flags as a PaddleX `--backend_config` mapping.

    PaddleX turns every boolean key into a bare flag (even `false`) and other values into
    `str(value)`, so `false` becomes `no-<flag>: true` or is left out, and mappings are
    written as JSON text rather than Python's repr.
    """
    out: dict[str, Any] = {}
    for key, value in args.items():
        if value is None:
            continue
        if isinstance(value, bool):
            if value:
                out[key] = True
            elif key in NEGATABLE_FLAGS:
                out[f"no-{key}"] = True
            continue
        out[key] = _flag_value(value) if isinstance(value, (dict, list)) else value
    return out


def model_source(config: Config) -> str:
    """What the server loads: `model.weights`, else the model's Hugging Face repo."""
    return config.model.weights or config.model.vl_model.hf_repo


def server_env(config: Config) -> dict[str, str]:
    """ocrvl's environment without systemd's protocol variables, plus `server.env`; under
    WSL2 the managed vLLM also gets what lets it start there (`wsl_uva_setting`)."""
    env = child_env(os.environ)
    python = config.server.python
    if python is not None:
        # As if the server's virtual environment were activated: its tools (ninja for
        # torch.compile, nvcc wrappers) come first.
        env["PATH"] = os.pathsep.join(p for p in (str(python.parent), env.get("PATH")) if p)
        env["VIRTUAL_ENV"] = str(python.parent.parent)
    if config.server.api_key:
        # vLLM reads VLLM_API_KEY like --api-key, and the environment keeps the key out of
        # the process list (`ps` shows argv to every user).
        env["VLLM_API_KEY"] = config.server.api_key
    env.update(config.server.env)
    if (config.server.launcher != "command" and is_wsl()
            and not any(name in env for name in WSL_USER_CHOICES)):
        name, value = wsl_uva_setting(config)
        env[name] = value
        _say_once("WSL2", f"under WSL2: {name}={value} in the server's environment (vLLM's "
                  "default V2 model runner needs UVA, which WSL2 does not give it by default)")
    return env


def wsl_uva_setting(config: Config) -> tuple[str, str]:
    """The variable that lets the server environment's vLLM start under WSL2: its V1 model
    runner where it has one (the pinned release and any before 0.34.0, or a version that
    cannot be read), else pinned memory turned back on."""
    version = server_vllm_version(config)[0]
    parsed = _parse_version(version) if version is not None else None
    return WSL_PIN_MEMORY if parsed is not None and parsed >= V1_RUNNER_REMOVED else WSL_V1_RUNNER


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _find_script(config: Config, name: str) -> Path | None:
    """`name` next to `server.python`; else on PATH or next to ocrvl's own Python."""
    if config.server.python is not None:
        script = config.server.python.parent / name
        return script if _executable(script) else None
    found = shutil.which(name)
    if found:
        return Path(found)
    sibling = Path(sys.executable).parent / name
    return sibling if _executable(sibling) else None


def _require_python(config: Config) -> Path:
    python = config.server.python
    assert python is not None
    if not _executable(python):
        raise ServerMissingError(f"server.python = {python} is not an executable Python.",
                                f"point server.python at the server environment's python, or "
                                f"{SETUP_FIX}")
    return python


def _vllm_argv(config: Config, args: Mapping[str, Any]) -> list[str]:
    server = config.server
    script = _find_script(config, "vllm")
    if script is not None:
        prefix = [str(script), "serve"]
    elif server.python is not None:
        # An environment with vLLM but without its console script (e.g. installed --no-deps).
        prefix = [str(_require_python(config)), "-m", "vllm.entrypoints.cli.main", "serve"]
    else:
        raise ServerMissingError("The `vllm` command was not found (vLLM is not installed).",
                                f"{SETUP_FIX}, or set server.python to the python of a virtual "
                                "environment that has vLLM")
    return [*prefix, *_serve_args(config, args, server.host, server.port)]


def _serve_args(config: Config, args: Mapping[str, Any], host: str, port: int) -> list[str]:
    """What follows `vllm serve`: the model, the name it is served under, and the flags."""
    return [model_source(config), "--served-model-name", config.model.served,
            "--trust-remote-code", "--host", host, "--port", str(port), *vllm_flags(args)]


def vllm_serve_command(config: Config, host: str = ANY_HOST, port: int | None = None) -> str:
    """The `vllm serve` line that serves `config`'s model as the managed launcher would.

    For a server started by hand, typically on another machine with a GPU (listening on every
    address by default; `port` defaults to server.port). `auto` flags take the values ocrvl
    uses when it cannot read the GPU, which start on an 8 GB card. Defaults that depend on
    the local server environment's vLLM (`server_defaults`: --stream-interval) are left out:
    the line must run on any vLLM >= 0.11.1 (the first with PaddleOCR-VL built in).
    """
    # One server there, whatever server.replicas says of the servers ocrvl starts here.
    alone = config.model_copy(update={"server": config.server.model_copy(update={"replicas": 1})})
    args = {**RECIPE_DEFAULTS, **plan_vllm_args(alone, None).values}
    port = port or config.server.port
    return shlex.join(["vllm", "serve", *_serve_args(config, args, host, port)])


def external_server_setup(config: Config) -> str:
    """How to use ocrvl without a GPU: the server on another machine, `server.mode: external`."""
    return (f"run the model server on a machine with an NVIDIA GPU (pip install "
            f"'{vllm_release.requirement(vllm_release.PINNED)}' there; under WSL2 start it "
            "with VLLM_USE_V2_MODEL_RUNNER=0), with:\n"
            f"    {vllm_serve_command(config)}\n"
            f"and set `server: {{mode: external, url: http://GPUHOST:{config.server.port}/v1}}` in "
            "this machine's config (GPUHOST: that machine's name or address); on a network "
            "others can reach, also give that server VLLM_API_KEY=<a secret> in its environment "
            "and set server.api_key to the same secret")


def _genai_argv(config: Config, args: Mapping[str, Any]) -> list[str]:
    server = config.server
    script = _find_script(config, "paddleocr")
    if script is None:
        where = f"next to server.python ({server.python})" if server.python else "on PATH"
        raise ServerMissingError(f"The `paddleocr` command was not found {where}.",
                                f"{SETUP_FIX}, or use server.launcher: vllm")
    path = config.state_dir / BACKEND_CONFIG_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(backend_config(args), sort_keys=False), encoding="utf-8")
    argv = [str(script), "genai_server", "--model_name", config.model.name, "--backend", "vllm",
            "--host", server.host, "--port", str(server.port), "--backend_config", str(path)]
    if config.model.weights:
        argv += ["--model_dir", config.model.weights]
    return argv


def _command_argv(config: Config, args: Mapping[str, Any]) -> list[str]:
    server = config.server
    assert server.command is not None  # config validation guarantees it
    values = {"{host}": server.host, "{port}": str(server.port), "{model}": config.model.served,
              "{weights}": model_source(config)}
    argv: list[str] = []
    for element in server.command:
        if element == "{vllm_args}":
            argv += vllm_flags(args)
            continue
        for placeholder, value in values.items():
            element = element.replace(placeholder, value)
        argv.append(element)
    program = argv[0]
    found = _executable(Path(program)) if os.sep in program else shutil.which(program)
    if not found:
        raise ServerMissingError(f"server.command's program {program!r} was not found or is not "
                                "executable.", "give its full path or fix PATH in the service")
    return argv


def prepare_launch(config: Config, args: Mapping[str, Any] | None = None) -> LaunchSpec:
    """argv and environment for `server.launcher` (writes genai_server's backend config).

    `args` are the vLLM flags (default: `resolve_vllm_args` without a GPU reading). Raises
    ServerConfigError when the launcher's program is missing. (Flags ocrvl sets from other
    keys are refused by the config's validation.)
    """
    if args is None:
        args = resolve_vllm_args(config).values
    build = {"vllm": _vllm_argv, "genai_server": _genai_argv, "command": _command_argv}
    return LaunchSpec(build[config.server.launcher](config, args), server_env(config))


def server_python(config: Config) -> Path:
    """The interpreter of the server environment."""
    if config.server.python is not None:
        return _require_python(config)
    script = _find_script(config, "paddleocr")
    sibling = script.parent / "python" if script is not None else None
    return sibling if sibling is not None and _executable(sibling) else Path(sys.executable)


def check_launcher(config: Config) -> None:
    """Fail early, with the fix, on what would make every start fail.

    genai_server refuses to start without flash-attn and xformers; say so before launching.
    """
    if config.server.launcher != "genai_server":
        return
    python = server_python(config)
    log.info("checking flash-attn and xformers in %s (paddleocr genai_server needs them)", python)
    try:
        result = subprocess.run([str(python), "-c", "import flash_attn, xformers"],
                                capture_output=True, text=True, env=server_env(config),
                                timeout=_DEPENDENCY_CHECK_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ServerConfigError(f"Could not run the server's Python {python}: {exc}.",
                                SETUP_FIX) from exc
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        detail = lines[-1] if lines else f"exit status {result.returncode}"
        raise ServerMissingError(
            f"server.launcher is genai_server, which needs flash-attn and xformers, but "
            f"{python} cannot import them ({detail}).",
            f"{SETUP_FIX} (it builds flash-attn), or use server.launcher: vllm, which needs "
            "neither")

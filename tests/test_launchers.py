"""argv, environment and backend config for each `server.launcher`."""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from packaging.version import Version

from ocrvl_daemon.config.file import validate_config
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.errors import ConfigError, ServerConfigError
from ocrvl_daemon.server import gpu as gpu_module
from ocrvl_daemon.server.launchers import (
    BACKEND_CONFIG_NAME,
    STREAM_INTERVAL,
    TRUST_MM_KWARGS_FLAG,
    check_launcher,
    prepare_launch,
    resolve_vllm_args,
    server_env,
    server_vllm_version,
    vllm_flags,
    vllm_serve_command,
)
from ocrvl_daemon.server.vllm_release import PINNED
from testkit.fake_server.cli import parse_args
from testkit.harness import FakeServerProcess, chat_payload, free_port, make_test_jpeg
from testkit.runner import checkout_first


def make_config(tmp_path: Path, **server: Any) -> Config:
    return validate_config({"state_dir": str(tmp_path / "state"), "server": server})


def fake_venv(tmp_path: Path, *scripts: str, vllm: str | None = None,
              name: str = "venv") -> Path:
    """A directory shaped like a virtual environment's bin/ with executable stubs, and with
    vLLM `vllm`'s dist-info in its site-packages when given (what pip leaves there)."""
    bin_dir = tmp_path / name / "bin"
    bin_dir.mkdir(parents=True)
    for script in ("python", *scripts):
        path = bin_dir / script
        path.write_text("#!/bin/sh\nexit 0\n")
        path.chmod(0o755)
    site = tmp_path / name / "lib" / "python3.12" / "site-packages"
    site.mkdir(parents=True)
    (site / "vllm_flash_attn-9.9.9.dist-info").mkdir()  # another package, not vLLM's version
    if vllm is not None:
        install_vllm(bin_dir / "python", vllm)
    return bin_dir / "python"


def install_vllm(python: Path, version: str) -> None:
    """Leave vLLM `version`'s dist-info in `python`'s venv, as pip does (and remove others)."""
    site = python.parent.parent / "lib" / "python3.12" / "site-packages"
    for old in site.glob("vllm-*.dist-info"):
        (old / "METADATA").unlink()
        old.rmdir()
    info = site / f"vllm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.quick
def test_vllm_argv_from_server_python_with_recipe_defaults(tmp_path: Path) -> None:
    python = fake_venv(tmp_path, "vllm")
    spec = prepare_launch(make_config(tmp_path, python=str(python), port=9001))
    argv = spec.argv
    assert argv[:3] == [str(python.parent / "vllm"), "serve", "PaddlePaddle/PaddleOCR-VL-1.6"]
    assert flag_value(argv, "--served-model-name") == "PaddleOCR-VL-1.6-0.9B"
    assert flag_value(argv, "--host") == "127.0.0.1"
    assert flag_value(argv, "--port") == "9001"
    assert "--trust-remote-code" in argv
    assert json.loads(flag_value(argv, "--limit-mm-per-prompt")) == {"image": 1}
    assert "--no-enable-prefix-caching" in argv
    assert flag_value(argv, "--mm-processor-cache-gb") == "0"
    assert flag_value(argv, "--max-num-batched-tokens") == "16384"
    # No GPU reading: `auto` is the safe fallback (4096 new tokens + image + prompt -> 5632).
    assert flag_value(argv, "--gpu-memory-utilization") == "0.64"
    assert flag_value(argv, "--max-model-len") == "5632"
    assert flag_value(argv, "--max-num-seqs") == "32"
    assert not any("flash" in a for a in argv)
    assert spec.env["PATH"].split(os.pathsep)[0] == str(python.parent)


@pytest.mark.quick
def test_vllm_serve_line_for_another_machine_is_what_the_managed_launcher_runs(
        tmp_path: Path) -> None:
    python = fake_venv(tmp_path, "vllm")
    config = make_config(tmp_path, python=str(python), port=9001,
                         vllm_args={"enforce-eager": True, "max-num-seqs": 16})
    managed = prepare_launch(config).argv
    by_hand = shlex.split(vllm_serve_command(config))
    assert by_hand[:2] == ["vllm", "serve"]
    assert flag_value(by_hand, "--host") == "0.0.0.0", "other machines cannot reach the server"
    assert by_hand[2:] == [a if a != "127.0.0.1" else "0.0.0.0" for a in managed[2:]], \
        "the documented `vllm serve` line differs from what ocrvl itself would run"
    assert flag_value(by_hand, "--port") == "9001"
    assert flag_value(by_hand, "--max-num-seqs") == "16" and "--enforce-eager" in by_hand
    on_port = shlex.split(vllm_serve_command(config, host="127.0.0.1", port=8000))
    assert flag_value(on_port, "--host") == "127.0.0.1" and flag_value(on_port, "--port") == "8000"


@pytest.mark.quick
def test_user_vllm_args_override_recipe_defaults(tmp_path: Path) -> None:
    python = fake_venv(tmp_path, "vllm")
    config = make_config(tmp_path, python=str(python), vllm_args={
        "max_num_batched_tokens": 8192,  # underscores mean the same flag
        "enable-prefix-caching": True,
        "limit-mm-per-prompt": None,  # null drops a recipe default
        "enforce-eager": True,
        "disable-log-stats": False,
        "max-model-len": 8192,
        "gpu-memory-utilization": 0.6,
        "compilation-config": {"level": 0},
    })
    argv = prepare_launch(config).argv
    assert flag_value(argv, "--max-num-batched-tokens") == "8192"
    assert "--enable-prefix-caching" in argv and "--no-enable-prefix-caching" not in argv
    assert "--limit-mm-per-prompt" not in argv
    assert "--enforce-eager" in argv
    assert "--disable-log-stats" not in argv
    assert flag_value(argv, "--max-model-len") == "8192"
    assert flag_value(argv, "--gpu-memory-utilization") == "0.6"
    assert flag_value(argv, "--max-num-seqs") == "32"  # still auto
    assert json.loads(flag_value(argv, "--compilation-config")) == {"level": 0}


@pytest.mark.quick
def test_vllm_without_script_runs_the_module(tmp_path: Path) -> None:
    python = fake_venv(tmp_path)
    config = validate_config({"state_dir": str(tmp_path), "server": {"python": str(python)},
                              "model": {"weights": "/models/vl"}})
    argv = prepare_launch(config).argv
    assert argv[:5] == [str(python), "-m", "vllm.entrypoints.cli.main", "serve", "/models/vl"]


@pytest.mark.quick
def test_missing_vllm_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(ServerConfigError, match="vllm") as err:
        prepare_launch(make_config(tmp_path))
    assert "ocrvl setup-server" in str(err.value)
    with pytest.raises(ServerConfigError, match="not an executable Python"):
        prepare_launch(make_config(tmp_path, python=str(tmp_path / "nope" / "python")))


@pytest.mark.quick
def test_genai_server_argv_and_backend_config(tmp_path: Path) -> None:
    python = fake_venv(tmp_path, "paddleocr")
    config = validate_config({
        "state_dir": str(tmp_path / "state"),
        "model": {"name": "PaddleOCR-VL-0.9B", "weights": "/models/v1"},
        "server": {"launcher": "genai_server", "python": str(python), "port": 9002,
                   "vllm_args": {"max-num-seqs": 16}},
    })
    argv = prepare_launch(config).argv
    backend = tmp_path / "state" / BACKEND_CONFIG_NAME
    assert argv == [str(python.parent / "paddleocr"), "genai_server", "--model_name",
                    "PaddleOCR-VL-0.9B", "--backend", "vllm", "--host", "127.0.0.1", "--port",
                    "9002", "--backend_config", str(backend), "--model_dir", "/models/v1"]
    written = yaml.safe_load(backend.read_text())
    # PaddleX would turn `false` into a bare flag and a dict into Python's repr.
    assert written["no-enable-prefix-caching"] is True
    assert "enable-prefix-caching" not in written
    assert json.loads(written["limit-mm-per-prompt"]) == {"image": 1}
    assert written["max-num-seqs"] == 16
    assert written["gpu-memory-utilization"] == 0.64


def test_genai_server_without_flash_attn_names_the_fix(tmp_path: Path) -> None:
    # ocrvl's own environment has neither flash-attn nor xformers.
    config = make_config(tmp_path, launcher="genai_server", python=sys.executable)
    with pytest.raises(ServerConfigError, match="flash-attn and xformers") as err:
        check_launcher(config)
    assert "No module named" in str(err.value)
    assert "ocrvl setup-server" in str(err.value)


@pytest.mark.quick
def test_command_placeholders_and_vllm_args(tmp_path: Path) -> None:
    config = make_config(
        tmp_path, launcher="command", host="127.0.0.2", port=9003,
        command=[sys.executable, "-m", "srv", "--bind={host}:{port}", "--name", "{model}",
                 "--weights", "{weights}", "{vllm_args}", "--tail"],
        vllm_args={"max-num-seqs": 4},
    )
    argv = prepare_launch(config).argv
    assert argv[:8] == [sys.executable, "-m", "srv", "--bind=127.0.0.2:9003", "--name",
                        "PaddleOCR-VL-1.6-0.9B", "--weights", "PaddlePaddle/PaddleOCR-VL-1.6"]
    assert argv[8:] == [*vllm_flags(resolve_vllm_args(config).values), "--tail"]
    assert flag_value(argv, "--max-num-seqs") == "4"


@pytest.mark.quick
def test_a_served_name_is_what_the_managed_server_serves(tmp_path: Path) -> None:
    python = fake_venv(tmp_path, "vllm")
    served = {"model": {"served_name": "books-ocr"}, "state_dir": str(tmp_path / "state")}
    vllm = validate_config({**served, "server": {"python": str(python)}})
    assert flag_value(prepare_launch(vllm).argv, "--served-model-name") == "books-ocr"
    command = validate_config({**served, "server": {"launcher": "command",
                                                    "command": ["true", "{model}"]}})
    assert prepare_launch(command).argv == ["true", "books-ocr"]


@pytest.mark.quick
def test_command_without_vllm_args_placeholder_gets_no_flags(tmp_path: Path) -> None:
    config = make_config(tmp_path, launcher="command", command=["true", "{port}"])
    assert prepare_launch(config).argv == ["true", "8118"]


@pytest.mark.quick
def test_missing_command_program_is_a_config_error(tmp_path: Path) -> None:
    config = make_config(tmp_path, launcher="command", command=["no-such-server-program"])
    with pytest.raises(ServerConfigError, match="no-such-server-program"):
        prepare_launch(config)


@pytest.mark.quick
def test_reserved_flag_in_vllm_args_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"server\.vllm_args\.port.*server\.port"):
        make_config(tmp_path, launcher="command", command=["true"], vllm_args={"port": 1234})


@pytest.mark.quick
def test_env_strips_systemd_variables_and_adds_server_env(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("KEEP_ME", "yes")
    config = make_config(tmp_path, launcher="command", command=["true"], api_key="s3cret",
                         env={"CUDA_VISIBLE_DEVICES": "1"})
    spec = prepare_launch(config)
    assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"} & spec.env.keys()
    assert spec.env["KEEP_ME"] == "yes"
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "1"
    # The key goes through the environment (vLLM reads VLLM_API_KEY), not the process list.
    assert spec.env["VLLM_API_KEY"] == "s3cret"
    assert "s3cret" not in spec.argv


@pytest.mark.quick
def test_vllm_flags_spelling() -> None:
    assert vllm_flags({"a": True, "b": False, "enable-prefix-caching": False, "c": None,
                       "d": [1, 2], "e": 0.5}) == [
        "--a", "--no-enable-prefix-caching", "--d", "[1, 2]", "--e", "0.5"]


@pytest.mark.quick
def test_async_scheduling_false_turns_it_off_where_vllm_turns_it_on_by_default() -> None:
    assert vllm_flags({"async-scheduling": False}) == ["--no-async-scheduling"], (
        "server.vllm_args {async-scheduling: false} must reach vLLM, whose default is on")
    assert vllm_flags({"async-scheduling": True}) == ["--async-scheduling"]


# --- --stream-interval where the server's vLLM has it -------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize(("installed", "added"), [
    ("0.26.0", True), ("0.12.0", True), ("0.12.0+cu129", True),
    ("0.11.1", False), ("0.11.2", False), ("0.12.0rc1", False), (None, False)])
def test_stream_interval_only_where_the_server_vllm_has_it(
        tmp_path: Path, installed: str | None, added: bool) -> None:
    python = fake_venv(tmp_path, "vllm", vllm=installed)
    argv = prepare_launch(make_config(tmp_path, python=str(python))).argv
    if added:
        assert flag_value(argv, "--stream-interval") == str(STREAM_INTERVAL) == "16"
    else:
        assert "--stream-interval" not in argv, f"vLLM {installed} would exit on the flag"
    assert server_vllm_version(make_config(tmp_path, python=str(python)))[0] == installed


@pytest.mark.quick
def test_stream_interval_read_from_the_vllm_script_on_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No server.python: the env of the `vllm` found on PATH decides, not ocrvl's own."""
    new = fake_venv(tmp_path, "vllm", vllm="0.26.0", name="new")
    old = fake_venv(tmp_path, "vllm", vllm="0.11.1", name="old")
    for python, added in ((new, True), (old, False)):
        monkeypatch.setenv("PATH", str(python.parent))
        argv = prepare_launch(make_config(tmp_path)).argv
        assert argv[0] == str(python.parent / "vllm")
        assert ("--stream-interval" in argv) is added


@pytest.mark.quick
def test_stream_interval_for_genai_server_from_its_env(tmp_path: Path) -> None:
    for installed, added in (("0.26.0", True), ("0.11.1", False)):
        python = fake_venv(tmp_path, "paddleocr", vllm=installed, name=f"v{installed}")
        config = make_config(tmp_path, launcher="genai_server", python=str(python))
        prepare_launch(config)
        written = yaml.safe_load((tmp_path / "state" / BACKEND_CONFIG_NAME).read_text())
        assert written.get("stream-interval") == (STREAM_INTERVAL if added else None)


@pytest.mark.quick
def test_command_launcher_never_gets_stream_interval(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's own command (maybe a container) runs a vLLM ocrvl cannot see."""
    python = fake_venv(tmp_path, "vllm", vllm="0.26.0")
    monkeypatch.setenv("PATH", f"{python.parent}{os.pathsep}{os.environ['PATH']}")
    for server in ({"python": str(python)}, {}):
        config = make_config(tmp_path, launcher="command", command=["true", "{vllm_args}"],
                             **server)
        argv = prepare_launch(config).argv
        assert "--stream-interval" not in argv and "--max-num-seqs" in argv
    # Unless the user asks for it.
    config = make_config(tmp_path, launcher="command", command=["true", "{vllm_args}"],
                         vllm_args={"stream-interval": 8})
    assert flag_value(prepare_launch(config).argv, "--stream-interval") == "8"


@pytest.mark.quick
def test_user_stream_interval_wins_and_null_drops_it(tmp_path: Path) -> None:
    python = fake_venv(tmp_path, "vllm", vllm="0.26.0")
    dropped = make_config(tmp_path, python=str(python), vllm_args={"stream-interval": None})
    assert "--stream-interval" not in prepare_launch(dropped).argv
    mine = make_config(tmp_path, python=str(python), vllm_args={"stream_interval": 4})
    assert flag_value(prepare_launch(mine).argv, "--stream-interval") == "4"
    # The user's value even on a vLLM that ocrvl would not give it to.
    install_vllm(python, "0.11.1")
    assert flag_value(prepare_launch(mine).argv, "--stream-interval") == "4"


@pytest.mark.quick
def test_serve_line_for_another_machine_leaves_stream_interval_out(tmp_path: Path) -> None:
    """The printed line must run on any vLLM the printed requirement admits (>= 0.11.1)."""
    python = fake_venv(tmp_path, "vllm", vllm="0.26.0")
    config = make_config(tmp_path, python=str(python), port=9001)
    managed = prepare_launch(config).argv
    by_hand = shlex.split(vllm_serve_command(config))
    assert flag_value(managed, "--stream-interval") == "16"
    assert "--stream-interval" not in by_hand
    at = managed.index("--stream-interval")
    without = managed[:at] + managed[at + 2:]
    assert by_hand[2:] == [a if a != "127.0.0.1" else "0.0.0.0" for a in without[2:]]


@pytest.mark.quick
def test_version_is_read_again_after_an_upgrade_and_the_choice_logged_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    python = fake_venv(tmp_path, "vllm", vllm="0.11.1")
    config = make_config(tmp_path, python=str(python))
    caplog.set_level(logging.INFO, logger="ocrvl_daemon.server.launchers")
    for _ in range(3):
        assert "stream-interval" not in resolve_vllm_args(config).values
    said = [r.getMessage() for r in caplog.records if "stream-interval" in r.getMessage()]
    assert len(said) == 1 and "0.11.1" in said[0] and "predates 0.12.0" in said[0], said
    install_vllm(python, "0.26.0")
    caplog.clear()
    for _ in range(3):
        assert resolve_vllm_args(config).values["stream-interval"] == STREAM_INTERVAL
    said = [r.getMessage() for r in caplog.records if "stream-interval" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("adding --stream-interval 16"), said


@pytest.mark.parametrize(("installed", "answered"), [("0.33.0", True), ("0.30.0", False)])
def test_a_real_launch_gets_the_flags_its_vllm_has_and_its_server_takes_pages(
        tmp_path: Path, installed: str, answered: bool) -> None:
    """A real launch through the vllm launcher: the flags ocrvl adds for the server
    environment's vLLM reach the server (the fake one behind a `vllm` script, gating image
    sizes as vLLM >= 0.31 does), which answers a PaddleOCR-VL request only when it was told
    to trust them."""
    assert parse_args(["--stream-interval", "16"]).ignored_args == ("--stream-interval", "16")
    python = fake_venv(tmp_path, vllm=installed)
    vllm = python.parent / "vllm"
    # `vllm serve MODEL FLAGS...` -> the fake server with FLAGS.
    vllm.write_text(f"#!/bin/sh\nshift 2\nexec {shlex.quote(sys.executable)} "
                    "-m testkit.fake_server --gate-request-mm-kwargs \"$@\"\n")
    vllm.chmod(0o755)
    port = free_port()
    spec = prepare_launch(make_config(tmp_path, python=str(python), port=port))
    assert flag_value(spec.argv, "--stream-interval") == "16"
    assert ("--trust-request-mm-kwargs" in spec.argv) is answered
    env = {**spec.env, "PYTHONPATH": checkout_first(spec.env.get("PYTHONPATH"))}
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(spec.argv, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    with FakeServerProcess(proc, "127.0.0.1", port, log_path) as server:
        server.wait_ready(15)
        assert "--stream-interval 16" in server.output()
        body = chat_payload(make_test_jpeg(1), model="PaddleOCR-VL-1.6-0.9B",
                            max_completion_tokens=64,
                            mm_processor_kwargs={"min_pixels": 112896, "max_pixels": 1003520})
        reply = httpx.post(f"{server.api_url}/chat/completions", json=body, timeout=30)
    if answered:
        assert reply.status_code == 200, f"vLLM {installed} refused a page: {reply.text}"
    else:
        assert reply.status_code == 400 and "--trust-request-mm-kwargs" in reply.text, reply.text


@pytest.mark.quick
@pytest.mark.parametrize(("installed", "added"), [
    ("0.33.0", True), ("0.31.0", True), ("0.31.0+cu130", True),
    ("0.30.0", False), ("0.31.0rc1", False),
    (PINNED, Version(PINNED) >= TRUST_MM_KWARGS_FLAG.since), (None, False)])
def test_trust_request_mm_kwargs_only_where_the_server_vllm_gates_them(
        tmp_path: Path, installed: str | None, added: bool) -> None:
    """vLLM >= 0.31 refuses PaddleOCR-VL's per-block image sizes unless the server trusts its
    clients; older vLLM exits on the unknown flag."""
    python = fake_venv(tmp_path, "vllm", vllm=installed)
    argv = prepare_launch(make_config(tmp_path, python=str(python))).argv
    assert ("--trust-request-mm-kwargs" in argv) is added, (installed, argv)
    # The user's choice wins: null drops it, true gives it to any version.
    dropped = make_config(tmp_path, python=str(python),
                          vllm_args={"trust-request-mm-kwargs": None})
    assert "--trust-request-mm-kwargs" not in prepare_launch(dropped).argv
    given = make_config(tmp_path, python=str(python),
                        vllm_args={"trust-request-mm-kwargs": True})
    assert "--trust-request-mm-kwargs" in prepare_launch(given).argv


@pytest.mark.quick
def test_the_vllm_version_is_read_where_server_env_pythonpath_puts_it_first(
        tmp_path: Path) -> None:
    """`server.env: {PYTHONPATH: ...}` makes the server's Python import vLLM from there, before
    its own site-packages: that vLLM's version decides the flags."""
    python = fake_venv(tmp_path, "vllm", vllm="0.26.0")
    bundle = tmp_path / "bundle"
    site = bundle / "lib" / "python3.12" / "site-packages"
    site.mkdir(parents=True)
    install_vllm(bundle / "bin" / "python", "0.33.0")  # into that site-packages
    config = make_config(tmp_path, python=str(python),
                         env={"PYTHONPATH": f"{tmp_path / 'absent'}{os.pathsep}{site}"})
    assert server_vllm_version(config) == ("0.33.0", str(site))
    assert "--trust-request-mm-kwargs" in prepare_launch(config).argv
    elsewhere = make_config(tmp_path, python=str(python), env={"PYTHONPATH": str(tmp_path)})
    assert server_vllm_version(elsewhere) == ("0.26.0", str(python.parent.parent)), \
        "a PYTHONPATH without vLLM leaves the environment's own"


WSL_KERNEL = "5.15.167.4-microsoft-standard-WSL2\n"


@pytest.fixture
def under_wsl2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine's kernel release, as ocrvl reads it, is WSL2's."""
    release = tmp_path / "osrelease"
    release.write_text(WSL_KERNEL)
    monkeypatch.setattr(gpu_module, "OSRELEASE", release)
    for name in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_WSL2_ENABLE_PIN_MEMORY"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.quick
@pytest.mark.usefixtures("under_wsl2")
@pytest.mark.parametrize("launcher", ["vllm", "genai_server"])
def test_under_wsl2_the_managed_server_runs_vllms_v1_model_runner(tmp_path: Path,
                                                                  launcher: str) -> None:
    python = fake_venv(tmp_path, "vllm", "paddleocr", vllm=PINNED)
    env = server_env(make_config(tmp_path, python=str(python), launcher=launcher))
    assert env.get("VLLM_USE_V2_MODEL_RUNNER") == "0", \
        "under WSL2 vLLM >= 0.24 dies with 'UVA is not available' unless its V1 runner is chosen"


@pytest.mark.quick
@pytest.mark.usefixtures("under_wsl2")
def test_under_wsl2_a_vllm_without_the_v1_runner_gets_pinned_memory_back(tmp_path: Path) -> None:
    python = fake_venv(tmp_path, "vllm", vllm="0.34.0")
    env = server_env(make_config(tmp_path, python=str(python)))
    assert "VLLM_USE_V2_MODEL_RUNNER" not in env, (
        "vLLM 0.34.0 refuses to start with VLLM_USE_V2_MODEL_RUNNER=0: it has no V1 runner")
    assert env.get("VLLM_WSL2_ENABLE_PIN_MEMORY") == "1", \
        "under WSL2 vLLM 0.34.0's V2 runner needs pinned memory for its UVA"


@pytest.mark.quick
@pytest.mark.usefixtures("under_wsl2")
@pytest.mark.parametrize(("where", "name", "value"), [
    ("server.env", "VLLM_WSL2_ENABLE_PIN_MEMORY", "1"),
    ("server.env", "VLLM_USE_V2_MODEL_RUNNER", "1"),
    ("environment", "VLLM_USE_V2_MODEL_RUNNER", "1"),
    ("environment", "VLLM_WSL2_ENABLE_PIN_MEMORY", "1"),
])
def test_under_wsl2_the_users_own_choice_stands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                where: str, name: str, value: str) -> None:
    python = fake_venv(tmp_path, "vllm")
    settings: dict[str, Any] = {"python": str(python)}
    if where == "server.env":
        settings["env"] = {name: value}
    else:
        monkeypatch.setenv(name, value)
    env = server_env(make_config(tmp_path, **settings))
    assert env[name] == value
    other = ({"VLLM_USE_V2_MODEL_RUNNER", "VLLM_WSL2_ENABLE_PIN_MEMORY"} - {name}).pop()
    assert other not in env, f"ocrvl overrode the user's {name}={value} with {other}"


@pytest.mark.quick
def test_outside_wsl2_and_for_the_users_own_command_nothing_is_added(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    release = tmp_path / "osrelease"
    release.write_text("6.1.0-28-amd64\n")
    monkeypatch.setattr(gpu_module, "OSRELEASE", release)
    python = fake_venv(tmp_path, "vllm")
    assert "VLLM_USE_V2_MODEL_RUNNER" not in server_env(make_config(tmp_path, python=str(python)))
    release.write_text(WSL_KERNEL)
    command = make_config(tmp_path, launcher="command", command=["my-server", "{port}"])
    assert "VLLM_USE_V2_MODEL_RUNNER" not in server_env(command), \
        "server.launcher: command is the user's own program: ocrvl must not change its runner"

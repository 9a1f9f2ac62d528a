"""argv, environment and backend config for each `server.launcher`."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ocrvl_daemon.config import Config
from ocrvl_daemon.config_file import validate_config
from ocrvl_daemon.errors import ConfigError, ServerConfigError
from ocrvl_daemon.server.launchers import (
    BACKEND_CONFIG_NAME,
    check_launcher,
    prepare_launch,
    resolve_vllm_args,
    vllm_flags,
    vllm_serve_command,
)


def make_config(tmp_path: Path, **server: Any) -> Config:
    return validate_config({"state_dir": str(tmp_path / "state"), "server": server})


def fake_venv(tmp_path: Path, *scripts: str) -> Path:
    """A directory shaped like a virtual environment's bin/ with executable stubs."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", *scripts):
        path = bin_dir / name
        path.write_text("#!/bin/sh\nexit 0\n")
        path.chmod(0o755)
    return bin_dir / "python"


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
    assert flag_value(argv, "--gpu-memory-utilization") == "0.8"
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
    assert written["gpu-memory-utilization"] == 0.8


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

"""`ocrvl doctor` against fake GPUs, fake server environments and a fake vLLM server."""

from __future__ import annotations

import json
import re
import shutil
import socket
import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
import yaml

from ocrvl_daemon.commands.doctor import (
    Check,
    DoctorReport,
    machine,
    render_json,
    render_text,
    run,
    run_doctor,
)
from ocrvl_daemon.config.file import load_config
from ocrvl_daemon.server import gpu, layout_engine, layout_model, vllm_release
from ocrvl_daemon.server.launchers import vllm_serve_command
from testkit import fake_server_env
from testkit.fake_server import FakeServerConfig, InProcessFakeServer
from testkit.fake_server_env import FakeVllm
from testkit.plain_server import plain_openai_server, serving

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"
MODEL = "PaddleOCR-VL-1.6-0.9B"
NOT_WSL = "6.1.0-28-amd64"


@pytest.fixture
def gpu_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Point ocrvl at a fake nvidia-smi (no NVML); returns a function taking the fixture name."""
    monkeypatch.setenv(gpu.NO_NVML_ENV, "1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("OCRVL_CONFIG", raising=False)

    def use(name: str) -> None:
        target = tmp_path / f"nvidia-smi-{name}"
        shutil.copyfile(FIXTURES / f"{name}.sh", target)
        target.chmod(0o755)
        monkeypatch.setenv(gpu.NVIDIA_SMI_ENV, str(target))

    return use


@pytest.fixture(autouse=True)
def paddlex_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PaddleX cache holding both layout models, so no test asks the internet for them."""
    home = tmp_path / "paddlex"
    monkeypatch.setenv(layout_model.CACHE_HOME_ENV, str(home))
    for name in ("PP-DocLayoutV2", "PP-DocLayoutV3"):
        folder = home / "official_models" / name
        folder.mkdir(parents=True)
        (folder / "inference.yml").write_text(f"Global:\n  model_name: {name}\n")
    return home


PADDLE_CPU = layout_engine.Installed(frozenset({"paddle"}), frozenset())
TORCH_CUDA = layout_engine.Installed(frozenset({"paddle", "transformers"}),
                                     frozenset({"transformers"}))


@pytest.fixture(autouse=True)
def layout_engines(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The layout engines "installed" (PaddlePaddle's CPU build unless a test says otherwise)
    and 2 cores, whatever this machine has; returns a function to change the engines."""
    monkeypatch.setattr(layout_engine, "cpu_count", lambda: 2)

    def use(installed: layout_engine.Installed) -> None:
        monkeypatch.setattr(layout_engine, "installed_engines", lambda: installed)

    use(PADDLE_CPU)
    return use


def fake_python(tmp_path: Path, versions: dict[str, str]) -> Path:
    """A stand-in for server.python that prints what doctor's import probe prints."""
    script = tmp_path / "server-venv" / "bin" / "python"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text("#!/bin/sh\necho 'INFO vllm logs to stdout'\n"
                      f"echo '{json.dumps(versions)}'\n")
    script.chmod(0o755)
    return script


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(tmp_path: Path, **sections: Any) -> str:
    inbox = tmp_path / "inbox"
    inbox.mkdir(exist_ok=True)
    data: dict[str, Any] = {"inbox": {"paths": [str(inbox)]}, "state_dir": str(tmp_path / "state"),
                            "server": {"port": free_port()}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def managed(tmp_path: Path, **server: Any) -> str:
    python = fake_python(tmp_path, {"vllm": vllm_release.PINNED})
    return write_config(tmp_path, server={"python": str(python), **server})


def by_name(report: DoctorReport, name: str) -> Check:
    return next(c for c in report.checks if c.name == name)


@pytest.fixture
def fake_vllm() -> Iterator[InProcessFakeServer]:
    with InProcessFakeServer(FakeServerConfig(port=0, served_model_names=(MODEL,))) as server:
        yield server


def test_rtx4060_managed_is_ready(tmp_path: Path, gpu_env: Any) -> None:
    gpu_env("rtx4060")
    report = run_doctor(managed(tmp_path), osrelease=NOT_WSL)
    assert not report.blocking, render_text(report)
    assert by_name(report, "GPU").status == "ok"
    assert "RTX 4060" in by_name(report, "GPU").detail
    assert by_name(report, "compute capability").detail == "8.9"
    assert "8.0 GiB total, 1.0 GiB used, 7.0 GiB free" in by_name(report, "GPU memory").detail
    settings = by_name(report, "server settings")
    assert settings.status == "info"
    assert "gpu-memory-utilization 0.64" in settings.detail
    assert "max-model-len 5632" in settings.detail
    assert by_name(report, "vllm").status == "ok"
    assert by_name(report, "server").status == "info"  # not running yet: ocrvl starts it
    assert not any(c.name.startswith("WSL2") for c in report.checks)


def test_t4_warns_about_compute_capability(tmp_path: Path, gpu_env: Any) -> None:
    gpu_env("t4")
    report = run_doctor(managed(tmp_path), osrelease=NOT_WSL)
    check = by_name(report, "compute capability")
    assert check.status == "warn"
    assert "7.5" in check.detail and "time out" in check.detail
    assert not report.blocking


def test_t4_cannot_use_genai_server(tmp_path: Path, gpu_env: Any) -> None:
    gpu_env("t4")
    python = fake_python(tmp_path, {"vllm": "0.11.2", "flash_attn": "2.8.3",
                                    "xformers": "0.0.32", "paddleocr": "3.7.0"})
    config = write_config(tmp_path, server={"python": str(python), "launcher": "genai_server"})
    report = run_doctor(config, osrelease=NOT_WSL)
    assert by_name(report, "compute capability").status == "fail"
    assert report.blocking


@pytest.mark.parametrize("fixture", ["nogpu", "missing"])
def test_no_gpu_blocks_managed_mode(tmp_path: Path, gpu_env: Any, fixture: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if fixture == "missing":
        monkeypatch.setenv(gpu.NVIDIA_SMI_ENV, str(tmp_path / "no-such-nvidia-smi"))
    else:
        gpu_env(fixture)
    report = run_doctor(managed(tmp_path), osrelease=NOT_WSL)
    check = by_name(report, "GPU")
    assert check.status == "fail" and check.fix
    assert report.blocking
    if fixture == "nogpu":
        assert "NVIDIA-SMI has failed" in check.detail


def test_no_gpu_with_a_managed_server_names_the_external_server_set_up(
        tmp_path: Path, gpu_env: Any) -> None:
    gpu_env("nogpu")
    config = managed(tmp_path)
    report = run_doctor(config, osrelease=NOT_WSL)
    check = by_name(report, "GPU")
    assert check.status == "fail" and report.blocking
    assert check.fix, "no fix for a missing GPU"
    port = load_config(config)[0].server.port
    serve = vllm_serve_command(load_config(config)[0])
    assert serve.startswith("vllm serve PaddlePaddle/PaddleOCR-VL-1.6 --served-model-name "
                            "PaddleOCR-VL-1.6-0.9B --trust-remote-code --host 0.0.0.0 "
                            f"--port {port}")
    assert f"\n    {serve}\n" in check.fix, "the `vllm serve` line is not on a line of its own"
    assert f"server: {{mode: external, url: http://GPUHOST:{port}/v1}}" in check.fix
    assert "VLLM_API_KEY" in check.fix and "server.api_key" in check.fix
    text = render_text(report)
    assert any(line.strip() == serve for line in text.splitlines()), \
        "the `vllm serve` line cannot be copied from doctor's output"


def test_no_gpu_is_info_for_an_external_server(tmp_path: Path, gpu_env: Any,
                                               fake_vllm: InProcessFakeServer) -> None:
    gpu_env("nogpu")
    config = write_config(tmp_path, server={"mode": "external", "url": fake_vllm.url + "/v1"})
    report = run_doctor(config, osrelease=NOT_WSL)
    gpu_check = by_name(report, "GPU")
    assert gpu_check.status == "info" and gpu_check.fix is None, \
        "an external server needs no GPU here, yet doctor asks to install a driver"
    server = by_name(report, "server")
    assert server.status == "ok" and MODEL in server.detail
    assert not report.blocking, render_text(report)


@pytest.mark.parametrize("lists_models", [True, False], ids=["models", "no-models"])
def test_external_server_without_vllms_endpoints_does_not_block(
    tmp_path: Path, gpu_env: Any, lists_models: bool
) -> None:
    """No /health (and maybe no /v1/models): `ocrvl convert` works with such a server, so
    doctor must not call it broken."""
    gpu_env("nogpu")
    with plain_openai_server(lists_models=lists_models) as url:
        config = write_config(tmp_path, server={"mode": "external", "url": url})
        report = run_doctor(config, osrelease=NOT_WSL)
    server = by_name(report, "server")
    assert server.status == ("ok" if lists_models else "warn"), server
    assert not report.blocking, render_text(report)


def test_unreachable_external_server_blocks(tmp_path: Path, gpu_env: Any) -> None:
    gpu_env("rtx4060")
    url = f"http://127.0.0.1:{free_port()}/v1"
    report = run_doctor(write_config(tmp_path, server={"mode": "external", "url": url}),
                        osrelease=NOT_WSL)
    assert by_name(report, "server").status == "fail"
    assert report.blocking


def test_server_serving_another_model_blocks(tmp_path: Path, gpu_env: Any) -> None:
    gpu_env("rtx4060")
    other = FakeServerConfig(port=0, served_model_names=("other-model",))
    with InProcessFakeServer(other) as srv:
        config = write_config(tmp_path, server={"mode": "external", "url": srv.url})
        report = run_doctor(config, osrelease=NOT_WSL)
    check = by_name(report, "server")
    assert check.status == "fail" and "other-model" in check.detail
    assert check.fix and "--served-model-name" in check.fix


def test_server_serving_another_version_under_its_hugging_face_name_names_both_keys(
        tmp_path: Path, gpu_env: Any) -> None:
    gpu_env("rtx4060")
    with plain_openai_server(model="PaddlePaddle/PaddleOCR-VL") as url:
        config = write_config(tmp_path, server={"mode": "external", "url": url})
        check = by_name(run_doctor(config, osrelease=NOT_WSL), "server")
        assert check.status == "fail"
        assert check.fix == ("this server serves PaddleOCR-VL-0.9B: set model.name: "
                             "PaddleOCR-VL-0.9B and model.served_name: PaddlePaddle/PaddleOCR-VL")
        fixed = write_config(tmp_path, server={"mode": "external", "url": url},
                             model={"name": "PaddleOCR-VL-0.9B",
                                    "served_name": "PaddlePaddle/PaddleOCR-VL"})
        assert by_name(run_doctor(fixed, osrelease=NOT_WSL), "server").status == "ok"


def test_invalid_config_fails_but_the_rest_still_runs(tmp_path: Path, gpu_env: Any) -> None:
    gpu_env("rtx4060")
    path = tmp_path / "config.yaml"
    path.write_text("server:\n  vllm_args:\n    max-model-len: 1024\n")
    report = run_doctor(str(path), osrelease=NOT_WSL)
    check = by_name(report, "config")
    assert check.status == "fail" and "max-model-len" in check.detail
    assert report.blocking
    assert by_name(report, "GPU").status == "ok"


def test_an_invalid_config_is_named_and_every_problem_in_it_reported_at_once(
    tmp_path: Path, gpu_env: Any
) -> None:
    gpu_env("nogpu")
    path = tmp_path / "config.yaml"
    path.write_text("inbox:\n  stabel_seconds: 1\nserver:\n  port: 70000\n  hots: x\n"
                    "pipeline:\n  max_concurrency: 0\n")
    report = run_doctor(str(path), osrelease=NOT_WSL)
    details = [c.detail for c in report.checks if c.name == "config"]
    for key in ("inbox.stabel_seconds", "server.port", "server.hots", "pipeline.max_concurrency"):
        assert sum(key in d for d in details) == 1, f"{key} not reported once in {details}"
    assert render_text(report).startswith(f"ocrvl doctor (config: {path})"), (
        "doctor said it used the built-in defaults though it read the file")


def test_an_invalid_config_skips_the_checks_that_depend_on_it_and_says_so(
    tmp_path: Path, gpu_env: Any
) -> None:
    gpu_env("nogpu")
    path = tmp_path / "config.yaml"
    # External, but invalid: the built-in defaults (managed, ~/ocr-inbox) must not be checked.
    path.write_text("server:\n  mode: external\n  url: notaurl\n")
    report = run_doctor(str(path), osrelease=NOT_WSL)
    names = [c.name for c in report.checks]
    assert "server" not in names and "inbox" not in names and "vllm" not in names, names
    assert by_name(report, "GPU").status == "info", "a managed server's GPU need was checked"
    skipped = by_name(report, "skipped")
    assert "inbox" in skipped.detail and "server" in skipped.detail, skipped
    assert "checked once it is valid" in render_text(report)


def test_a_state_dir_that_cannot_be_created_blocks(tmp_path: Path, gpu_env: Any) -> None:
    gpu_env("rtx4060")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    config = managed(tmp_path)
    data = yaml.safe_load(Path(config).read_text())
    data["state_dir"] = str(blocker / "state")
    Path(config).write_text(yaml.safe_dump(data))
    report = run_doctor(config, osrelease=NOT_WSL)
    check = by_name(report, "state_dir")
    assert check.status == "fail" and report.blocking, render_text(report)
    assert f"state_dir = {blocker / 'state'} cannot be used" in check.detail, check
    assert f"{blocker} is not a folder" in check.detail, check
    assert check.fix and "set state_dir" in check.fix


def test_a_state_dir_is_tried_by_writing_a_file_as_run_will_not_by_access(
    tmp_path: Path, gpu_env: Any
) -> None:
    """access() says yes to root anywhere, even under /proc, where nothing can be created."""
    gpu_env("rtx4060")
    config = managed(tmp_path)
    data = yaml.safe_load(Path(config).read_text())
    data["state_dir"] = "/proc/nope"
    Path(config).write_text(yaml.safe_dump(data))
    check = by_name(run_doctor(config, osrelease=NOT_WSL), "state_dir")
    assert check.status == "fail", f"doctor calls a state_dir that run cannot use {check}"
    assert "/proc/nope cannot be used" in check.detail and "cannot be created" in check.detail

    data["state_dir"] = str(tmp_path / "new" / "state")
    Path(config).write_text(yaml.safe_dump(data))
    check = by_name(run_doctor(config, osrelease=NOT_WSL), "state_dir")
    assert check.status == "ok", check
    assert not (tmp_path / "new").exists(), "doctor left the folders it tried behind"


def test_an_inbox_that_cannot_be_created_blocks(tmp_path: Path, gpu_env: Any) -> None:
    gpu_env("rtx4060")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    config = managed(tmp_path)
    data = yaml.safe_load(Path(config).read_text())
    data["inbox"]["paths"] = [str(blocker / "inbox")]
    Path(config).write_text(yaml.safe_dump(data))
    report = run_doctor(config, osrelease=NOT_WSL)
    check = by_name(report, "inbox")
    assert check.status == "fail" and report.blocking, render_text(report)
    assert f"cannot be created: {blocker} is not a folder" in check.detail, check
    assert "mkdir" not in (check.fix or ""), check


def test_a_port_another_program_holds_in_managed_mode_blocks(
    tmp_path: Path, gpu_env: Any, fake_vllm: InProcessFakeServer
) -> None:
    gpu_env("rtx4060")
    port = int(fake_vllm.url.rsplit(":", 1)[1])
    report = run_doctor(managed(tmp_path, port=port), osrelease=NOT_WSL)
    check = by_name(report, "server")
    assert check.status == "fail" and report.blocking, render_text(report)
    assert f"port {port} on 127.0.0.1 is taken by another program" in check.detail, check
    assert check.fix and "set server.port to a free port" in check.fix, check


def test_a_port_held_by_a_program_that_speaks_no_http_blocks(
    tmp_path: Path, gpu_env: Any
) -> None:
    gpu_env("rtx4060")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        check = by_name(run_doctor(managed(tmp_path, port=port), osrelease=NOT_WSL), "server")
    assert check.status == "fail" and "taken by another program" in check.detail, check


@pytest.mark.parametrize("trusted", [False, True], ids=["gated", "trusted"])
def test_a_vllm_that_refuses_paddlex_image_sizes_blocks_with_the_flag_to_start_it_with(
        tmp_path: Path, gpu_env: Any, trusted: bool) -> None:
    """vLLM >= 0.31 lists the model and answers /health, then refuses every page request
    PaddleX sends (its image-size bounds) unless started with --trust-request-mm-kwargs."""
    gpu_env("rtx4060")
    gated = FakeServerConfig(port=0, served_model_names=(MODEL,), gate_request_mm_kwargs=True,
                             trust_request_mm_kwargs=trusted)
    with InProcessFakeServer(gated) as srv:
        config = write_config(tmp_path, server={"mode": "external", "url": srv.url + "/v1"})
        report = run_doctor(config, osrelease=NOT_WSL)
    check = by_name(report, "server")
    if trusted:
        assert check.status == "ok" and "takes a page request" in check.detail, check
        return
    assert check.status == "fail" and "Per-request mm_processor_kwargs" in check.detail, check
    assert check.fix is not None and check.fix.startswith(
        "start the server (`vllm serve`) with --trust-request-mm-kwargs"), check.fix
    assert report.blocking


@pytest.mark.parametrize("key", [None, "wrong"], ids=["no-key", "wrong-key"])
def test_a_401_from_the_server_points_at_the_api_key(
    tmp_path: Path, gpu_env: Any, key: str | None
) -> None:
    gpu_env("rtx4060")
    secret = FakeServerConfig(port=0, served_model_names=(MODEL,), api_key="right")
    with InProcessFakeServer(secret) as srv:
        server: dict[str, Any] = {"mode": "external", "url": srv.url + "/v1"}
        if key:
            server["api_key"] = key
        check = by_name(run_doctor(write_config(tmp_path, server=server), osrelease=NOT_WSL),
                        "server")
    assert check.status == "fail" and "401" in check.detail, check
    assert check.fix and "server.api_key" in check.fix, check
    assert "serves no models" not in check.detail, check


def test_no_gpu_does_not_offer_setup_server_for_a_managed_server(
    tmp_path: Path, gpu_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu_env("nogpu")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no vllm either
    report = run_doctor(write_config(tmp_path), osrelease=NOT_WSL)
    text = render_text(report)
    assert "setup-server" not in text, text
    assert "mode: external" in (by_name(report, "GPU").fix or ""), text


def test_missing_server_python_points_at_setup_server(tmp_path: Path, gpu_env: Any) -> None:
    gpu_env("rtx4060")
    config = write_config(tmp_path, server={"python": str(tmp_path / "nope" / "python")})
    report = run_doctor(config, osrelease=NOT_WSL)
    check = by_name(report, "server python")
    assert check.status == "fail" and check.fix and "ocrvl setup-server" in check.fix


def test_no_server_python_and_no_vllm_on_path(tmp_path: Path, gpu_env: Any,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    gpu_env("rtx4060")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    report = run_doctor(write_config(tmp_path), osrelease=NOT_WSL)
    check = by_name(report, "vllm")
    assert check.status == "fail" and "PATH" in check.detail


@pytest.mark.parametrize("with_env", [True, False])
def test_server_python_is_probed_with_server_env(tmp_path: Path, gpu_env: Any,
                                                 with_env: bool) -> None:
    """A server whose vllm is only importable with server.env's PYTHONPATH is fine, as it is
    for the launcher; without server.env the same interpreter cannot import it."""
    gpu_env("rtx4060")
    site = tmp_path / "server-site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(f'__version__ = "{vllm_release.PINNED}"\n')
    server: dict[str, Any] = {"python": sys.executable}
    if with_env:
        server["env"] = {"PYTHONPATH": str(site)}
    report = run_doctor(write_config(tmp_path, server=server), osrelease=NOT_WSL)
    check = by_name(report, "vllm")
    if with_env:
        assert check.status == "ok", f"server.env was not used to probe the server: {check}"
    else:
        assert check.status == "fail" and "No module named 'vllm'" in check.detail, check


def test_old_vllm_blocks(tmp_path: Path, gpu_env: Any) -> None:
    gpu_env("rtx4060")
    python = fake_python(tmp_path, {"vllm": "0.10.2"})
    report = run_doctor(write_config(tmp_path, server={"python": str(python)}),
                        osrelease=NOT_WSL)
    check = by_name(report, "vllm")
    assert check.status == "fail" and ">= 0.11.1" in check.detail


def test_genai_server_needs_flash_attn(tmp_path: Path, gpu_env: Any) -> None:
    gpu_env("rtx4060")
    python = fake_python(tmp_path, {"vllm": "0.11.2", "xformers": "0.0.32",
                                    "flash_attn": "!ModuleNotFoundError: No module named "
                                                  "'flash_attn'", "paddleocr": "3.7.0"})
    config = write_config(tmp_path, server={"python": str(python), "launcher": "genai_server"})
    report = run_doctor(config, osrelease=NOT_WSL)
    assert by_name(report, "flash_attn").status == "fail"
    assert by_name(report, "xformers").status == "ok"
    assert report.blocking


def test_wsl2_warnings(tmp_path: Path, gpu_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu_env("rtx4060")
    wsl_conf = tmp_path / "wsl.conf"
    monkeypatch.setattr(machine, "WSL_CONF", wsl_conf)
    report = run_doctor(managed(tmp_path), osrelease="5.15.167.4-microsoft-standard-WSL2")
    wsl = by_name(report, "WSL2")
    assert wsl.status == "warn"
    assert wsl.fix and "vmIdleTimeout=-1" in wsl.fix and "inbox.polling: true" in wsl.fix
    assert by_name(report, "WSL2 systemd").status == "warn"
    wsl_conf.write_text("[boot]\nsystemd=true\n")
    report = run_doctor(managed(tmp_path), osrelease="5.15.167.4-microsoft-standard-WSL2")
    assert by_name(report, "WSL2 systemd").status == "ok"
    assert not report.blocking


def test_missing_inbox_is_a_warning_with_mkdir(tmp_path: Path, gpu_env: Any) -> None:
    gpu_env("rtx4060")
    config = managed(tmp_path)
    data = yaml.safe_load(Path(config).read_text())
    data["inbox"]["paths"] = [str(tmp_path / "later")]
    Path(config).write_text(yaml.safe_dump(data))
    check = by_name(run_doctor(config, osrelease=NOT_WSL), "inbox")
    assert check.status == "warn" and check.fix == f"mkdir -p {tmp_path / 'later'}"


def test_a_crashing_check_does_not_stop_the_others(tmp_path: Path, gpu_env: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    gpu_env("rtx4060")

    def broken(_: Any) -> list[Check]:
        raise RuntimeError("odd system")

    monkeypatch.setattr(run, "client_checks", broken)
    report = run_doctor(managed(tmp_path), osrelease=NOT_WSL)
    check = by_name(report, "client packages")
    assert check.status == "warn" and "odd system" in check.detail
    assert by_name(report, "server").status == "info"


def test_renderers(tmp_path: Path, gpu_env: Any) -> None:
    gpu_env("nogpu")
    report = run_doctor(managed(tmp_path), osrelease=NOT_WSL)
    text = render_text(report)
    lines = text.splitlines()
    gpu_line = next(i for i, line in enumerate(lines) if line.startswith("✗ GPU"))
    assert lines[gpu_line + 1].lstrip().startswith("→ ")
    assert lines[-1].startswith("1 problem(s) block conversion")
    assert any(line.startswith("✓ config") for line in lines)
    # Details start in one column.
    check_lines = [line for line in lines[1:-1] if line[:1] in "✓!✗·"]
    assert len(check_lines) == len(report.checks)
    pairs = zip(check_lines, report.checks, strict=True)
    assert len({line.index(check.detail) for line, check in pairs}) == 1
    data = json.loads(render_json(report))
    assert data["blocking"] is True
    assert {"name", "status", "detail", "fix"} <= set(data["checks"][0])


class _Host(BaseHTTPRequestHandler):
    def do_HEAD(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def model_host() -> Iterator[str]:
    """A local stand-in for a model host: answers PaddleX's HEAD health check."""
    with serving(_Host) as url:
        yield url


@pytest.fixture
def no_model_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every model host PaddleX knows is a closed local port (as with no internet)."""
    monkeypatch.delenv(layout_model.HUGGING_FACE_ENDPOINT_ENV, raising=False)
    monkeypatch.delenv(layout_model.MODEL_SOURCE_ENV, raising=False)
    monkeypatch.setattr(layout_model, "MODEL_HOSTS", {
        source: f"http://127.0.0.1:{free_port()}" for source in layout_model.MODEL_HOSTS})


def external(tmp_path: Path, url: str, **pipeline: Any) -> str:
    return write_config(tmp_path, server={"mode": "external", "url": url}, pipeline=pipeline)


@pytest.mark.parametrize(("model", "layout"), [("PaddleOCR-VL-0.9B", "PP-DocLayoutV2"),
                                               ("PaddleOCR-VL-1.6-0.9B", "PP-DocLayoutV3")])
def test_cached_layout_model_is_ok(tmp_path: Path, gpu_env: Any, paddlex_cache: Path,
                                   no_model_host: None, model: str, layout: str) -> None:
    gpu_env("nogpu")
    config = write_config(tmp_path, server={"mode": "external", "url": "http://127.0.0.1:9/v1"},
                          model={"name": model})
    check = by_name(run_doctor(config, osrelease=NOT_WSL), "layout model")
    assert check.status == "ok", check
    assert str(paddlex_cache / "official_models" / layout) in check.detail


def test_layout_model_not_cached_but_downloadable_is_ok_with_a_note(
        tmp_path: Path, gpu_env: Any, paddlex_cache: Path, no_model_host: None,
        model_host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu_env("nogpu")
    shutil.rmtree(paddlex_cache / "official_models" / "PP-DocLayoutV3")
    # The preferred source is asked first; PaddleX lets the Hugging Face endpoint be moved.
    monkeypatch.setenv(layout_model.HUGGING_FACE_ENDPOINT_ENV, model_host)
    check = by_name(run_doctor(external(tmp_path, "http://127.0.0.1:9/v1"), osrelease=NOT_WSL),
                    "layout model")
    assert check.status == "ok", check
    assert "not downloaded yet" in check.detail and model_host in check.detail


def test_layout_model_neither_cached_nor_downloadable_blocks_with_the_fix(
        tmp_path: Path, gpu_env: Any, paddlex_cache: Path, no_model_host: None,
        fake_vllm: InProcessFakeServer) -> None:
    gpu_env("nogpu")
    shutil.rmtree(paddlex_cache / "official_models" / "PP-DocLayoutV3")
    report = run_doctor(external(tmp_path, fake_vllm.url + "/v1"), osrelease=NOT_WSL)
    check = by_name(report, "layout model")
    assert check.status == "fail" and report.blocking, render_text(report)
    assert check.fix, "no fix for a layout model that cannot be downloaded"
    assert "hf download PaddlePaddle/PP-DocLayoutV3" in check.fix
    assert str(paddlex_cache / "official_models") in check.fix, "the fix does not say where"
    assert "pipeline.use_layout_detection: false" in check.fix
    # ...which is a way out: without layout detection nothing blocks.
    fixed = run_doctor(external(tmp_path, fake_vllm.url + "/v1", use_layout_detection=False),
                       osrelease=NOT_WSL)
    assert not any(c.name == "layout model" for c in fixed.checks)
    assert not fixed.blocking, render_text(fixed)


def test_an_empty_layout_model_folder_blocks(tmp_path: Path, gpu_env: Any,
                                             paddlex_cache: Path) -> None:
    gpu_env("nogpu")
    folder = paddlex_cache / "official_models" / "PP-DocLayoutV3"
    shutil.rmtree(folder)
    folder.mkdir()
    check = by_name(run_doctor(external(tmp_path, "http://127.0.0.1:9/v1"), osrelease=NOT_WSL),
                    "layout model")
    assert check.status == "fail" and check.fix == f"delete {folder} (it is downloaded again " \
        "on first use)"


def test_the_layout_engine_and_device_are_reported(tmp_path: Path, gpu_env: Any) -> None:
    gpu_env("nogpu")
    report = run_doctor(external(tmp_path, "http://127.0.0.1:9/v1"), osrelease=NOT_WSL)
    engine = by_name(report, "layout engine")
    assert engine.status == "info"
    assert engine.detail.startswith("PP-DocLayoutV3 on cpu (paddle_static, 2 threads), 1 "
                                    "worker: auto: no GPU here"), engine.detail
    assert engine.data == {"model": "PP-DocLayoutV3", "engine": "paddle_static",
                           "device": "cpu", "threads": 2, "workers": 1}
    # The cache holds only the model's inference.yml: nothing to time.
    speed = by_name(report, "layout speed")
    assert speed.detail == "not measured: model not downloaded"
    assert speed.data == {"pages_per_s": None}
    data = json.loads(render_json(report))
    assert next(c for c in data["checks"] if c["name"] == "layout engine")["data"] == engine.data


def test_a_gpu_with_no_engine_for_it_warns_that_the_layout_model_runs_on_the_cpu(
        tmp_path: Path, gpu_env: Any, no_model_host: None) -> None:
    gpu_env("rtx4060")  # PaddlePaddle's CPU build only, as set-up command 1 installs
    report = run_doctor(managed(tmp_path), osrelease=NOT_WSL)
    engine = by_name(report, "layout engine")
    assert engine.status == "warn", f"{engine.status}: {engine.detail}"
    assert "no engine that can use the GPU is installed" in engine.detail, engine.detail
    assert engine.fix and "[gpu-layout]" in engine.fix, engine.fix


def test_a_gpu_engine_puts_the_layout_model_beside_the_server_with_its_room(
        tmp_path: Path, gpu_env: Any, layout_engines: Any, no_model_host: None) -> None:
    gpu_env("rtx4060")
    layout_engines(TORCH_CUDA)
    report = run_doctor(managed(tmp_path), osrelease=NOT_WSL)
    engine = by_name(report, "layout engine")
    assert engine.detail.startswith("PP-DocLayoutV3 on gpu:0 (transformers), 1 worker: auto: "
                                    "the fastest place here"), engine.detail
    # The transformers engine loads the safetensors package, which is not cached here.
    model = by_name(report, "layout model")
    assert "PP-DocLayoutV3_safetensors" in model.detail and model.status == "fail"
    assert "hf download PaddlePaddle/PP-DocLayoutV3_safetensors" in (model.fix or "")
    settings = by_name(report, "server settings")
    assert "gpu-memory-utilization 0.42" in settings.detail, settings.detail


def test_a_layout_engine_that_is_not_installed_blocks_with_the_fix(tmp_path: Path,
                                                                   gpu_env: Any) -> None:
    gpu_env("nogpu")
    config = external(tmp_path, "http://127.0.0.1:9/v1", layout_engine="transformers")
    report = run_doctor(config, osrelease=NOT_WSL)
    check = by_name(report, "layout engine")
    assert check.status == "fail" and report.blocking
    assert "pipeline.layout_engine = 'transformers'" in check.detail
    assert check.fix and "[gpu-layout]" in check.fix


@pytest.mark.slow
def test_the_layout_models_own_speed_is_measured_on_the_stand_in(
        tmp_path: Path, gpu_env: Any, monkeypatch: pytest.MonkeyPatch,
        layout_cache: Path) -> None:  # fmt: skip
    gpu_env("nogpu")
    monkeypatch.setenv(layout_model.CACHE_HOME_ENV, str(layout_cache))
    report = run_doctor(external(tmp_path, "http://127.0.0.1:9/v1"), osrelease=NOT_WSL)
    speed = by_name(report, "layout speed")
    assert speed.status == "info", speed
    assert speed.data and speed.data["pages_per_s"] > 0
    assert re.fullmatch(r"\d+\.\d\d pages/s per worker on cpu \(one 1190x1684 page after a "
                        r"warm-up\)", speed.detail), speed.detail


WSL = "5.15.167.4-microsoft-standard-WSL2"


def with_server_env(tmp_path: Path, fake: FakeVllm | None = None) -> str:
    """A config whose server.python is a fake server environment (real imports)."""
    python = fake_server_env.make(tmp_path / "server-venv", fake)
    return write_config(tmp_path, server={"python": str(python)})


@pytest.mark.parametrize("osrelease", [NOT_WSL, WSL])
def test_a_driver_too_old_for_the_server_environments_torch_blocks_with_the_fix(
        tmp_path: Path, gpu_env: Any, osrelease: str) -> None:
    gpu_env("rtx4060-driver566")
    report = run_doctor(with_server_env(tmp_path), osrelease=osrelease)
    check = by_name(report, "driver")
    assert check.status == "fail" and report.blocking, \
        f"a driver that cannot run the server's CUDA 13 build passed: {render_text(report)}"
    assert "566.36" in check.detail and "CUDA 12.7" in check.detail, check.detail
    assert "CUDA 13.0" in check.detail and "R580 or newer" in check.detail, check.detail
    assert check.fix is not None and "--vllm 0.19.1" in check.fix, check.fix
    assert ("Windows driver" in check.fix) == (osrelease == WSL), check.fix


def test_a_driver_new_enough_for_the_server_environments_torch_is_ok(tmp_path: Path,
                                                                      gpu_env: Any) -> None:
    gpu_env("rtx4060-driver581")
    report = run_doctor(with_server_env(tmp_path), osrelease=NOT_WSL)
    check = by_name(report, "driver")
    assert check.status == "ok", render_text(report)
    assert "581.57 (CUDA 13.0)" in check.detail and "2.11.0+cu130" in check.detail
    assert by_name(report, "vllm").status == "ok", by_name(report, "vllm")


def test_before_setup_server_the_driver_is_compared_with_what_it_would_install(
        tmp_path: Path, gpu_env: Any) -> None:
    gpu_env("rtx4060-driver566")
    config = write_config(tmp_path, server={"python": str(tmp_path / "none" / "bin" / "python")})
    check = by_name(run_doctor(config, osrelease=NOT_WSL), "driver")
    assert check.status == "fail", check
    assert f"vLLM {vllm_release.PINNED}" in check.detail and "R580" in check.detail, check


def test_a_vllm_other_than_the_pinned_one_is_named(tmp_path: Path, gpu_env: Any) -> None:
    gpu_env("rtx4060-driver581")
    report = run_doctor(with_server_env(tmp_path, FakeVllm("0.33.0", torch="2.14.0")),
                        osrelease=NOT_WSL)
    check = by_name(report, "vllm")
    assert check.status == "warn", check
    assert "0.33.0" in check.detail and vllm_release.PINNED in check.detail, check.detail
    assert "ocrvl starts it with --trust-request-mm-kwargs" in check.detail, (
        "a vLLM >= 0.31 gets a flag the pinned one does not: doctor should say so")
    assert check.fix is not None and "ocrvl setup-server" in check.fix


def test_a_new_users_default_config_is_compared_with_what_setup_server_installs(
        tmp_path: Path, gpu_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu_env("rtx4060-driver566")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no vllm anywhere yet
    report = run_doctor(write_config(tmp_path), osrelease=WSL)
    check = by_name(report, "driver")
    assert check.status == "fail", render_text(report)
    assert "566.36" in check.detail and "R580" in check.detail
    assert check.fix is not None and "Windows driver" in check.fix

"""`ocrvl setup-server`: plans for several machines, dry runs, running steps, the config edit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ocrvl_daemon.commands.setup_server import (
    FLASH_ATTN_VERSION,
    Step,
    build_jobs,
    flash_attn_wheel,
    plan_setup,
    render_plan,
    run_setup,
    set_config_key,
    setup_server,
)
from ocrvl_daemon.config import Config
from ocrvl_daemon.config_file import load_config
from ocrvl_daemon.errors import DependencyError, ExitCode
from ocrvl_daemon.server import gpu
from ocrvl_daemon.server.gpu import GpuReading
from ocrvl_daemon.server.launchers import vllm_serve_command

GIB = 1024**3
RTX4060 = GpuReading(0, "GPU-4060", "NVIDIA GeForce RTX 4060", 8188, 1024, 7164, "560.94",
                     (8, 9), "nvidia-smi")
RTX5090 = GpuReading(0, "GPU-5090", "NVIDIA GeForce RTX 5090", 32607, 500, 32107, "575.51",
                     (12, 0), "nvidia-smi")
T4 = GpuReading(0, "GPU-t4", "Tesla T4", 15360, 3, 15357, "535.104.05", (7, 5), "nvidia-smi")
GENAI = Config.model_validate({"server": {"launcher": "genai_server"}})
WHEEL_BASE = f"https://github.com/Dao-AILab/flash-attention/releases/download/v{FLASH_ATTN_VERSION}/"


def plan(tmp_path: Path, config: Config = GENAI, **kw: object) -> list[Step]:
    args: dict[str, object] = {
        "python_version": (3, 12), "torch_cuda": None, "gpu": RTX4060,
        "config_path": tmp_path / "config.yaml", "base_python": "/usr/bin/python3",
        "uv": None, "mem_available": 14 * GIB, "cpus": 16, **kw}
    return plan_setup(tmp_path / "venv", config, **args)  # type: ignore[arg-type]


def commands(steps: list[Step]) -> list[tuple[str, ...]]:
    return [s.argv for s in steps if s.argv]


@pytest.mark.parametrize(("python", "torch", "expected"), [
    ((3, 12), "2.8.0+cu128",
     "flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"),
    ((3, 11), "2.9.1+cu126",
     "flash_attn-2.8.3+cu12torch2.9cxx11abiTRUE-cp311-cp311-linux_x86_64.whl"),
    ((3, 10), "2.7.1+cu118", None),  # no CUDA 11 wheels for 2.8.3
    ((3, 12), "2.10.0+cu128", None),  # newer PyTorch than the release
    ((3, 12), "2.8.0+cu130", None),
    ((3, 14), "2.8.0+cu128", None),
    ((3, 12), "2.8.0+cpu", None),
    ((3, 12), "2.8.0", None),
    ((3, 12), None, None),
])
@pytest.mark.quick
def test_flash_attn_wheel_table(python: tuple[int, int], torch: str | None,
                                expected: str | None) -> None:
    url = flash_attn_wheel(python, torch)
    assert url == (WHEEL_BASE + expected if expected else None)


@pytest.mark.quick
@pytest.mark.parametrize(("mem_gib", "cpus", "jobs"), [(14, 16, 3), (2, 16, 1), (64, 4, 4),
                                                      (0, 8, 1)])
def test_build_jobs_fit_ram(mem_gib: int, cpus: int, jobs: int) -> None:
    assert build_jobs(mem_gib * GIB, cpus) == jobs


@pytest.mark.quick
def test_vllm_launcher_with_venv_and_pip(tmp_path: Path) -> None:
    steps = plan(tmp_path, Config.model_validate({}))
    venv = tmp_path / "venv"
    pip = (str(venv / "bin" / "python"), "-m", "pip", "install")
    assert commands(steps) == [
        ("/usr/bin/python3", "-m", "venv", str(venv)),
        (*pip, "--upgrade", "pip"),
        (*pip, "vllm>=0.11.1,<1.0"),
    ]
    assert steps[-1].set_python == (tmp_path / "config.yaml", venv / "bin" / "python")


@pytest.mark.quick
def test_vllm_launcher_with_uv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    assert commands(plan(tmp_path, Config.model_validate({}), uv="/opt/uv")) == [
        ("/opt/uv", "venv", "--python", "/usr/bin/python3", str(venv)),
        ("/opt/uv", "pip", "install", "--python", str(venv / "bin" / "python"),
         "vllm>=0.11.1,<1.0"),
    ]


@pytest.mark.quick
def test_existing_environment_is_reused(tmp_path: Path) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    steps = plan(tmp_path, Config.model_validate({}))
    assert [s.argv[-1] for s in steps if s.argv] == ["vllm>=0.11.1,<1.0"]


@pytest.mark.quick
def test_genai_server_with_a_prebuilt_wheel(tmp_path: Path) -> None:
    steps = plan(tmp_path, torch_cuda="2.8.0+cu128", uv="/opt/uv")
    install = commands(steps)[1]
    assert {"vllm>=0.11.1,<1.0", "xformers", "einops", "uvloop"} <= set(install)
    assert any(a.startswith("paddleocr") for a in install)
    wheel = commands(steps)[2]
    assert wheel[-2:] == ("--no-deps", WHEEL_BASE + "flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-"
                          "cp312-cp312-linux_x86_64.whl")
    assert not any(s.env for s in steps)


@pytest.mark.quick
def test_genai_server_builds_from_source_for_the_local_gpu(tmp_path: Path) -> None:
    steps = plan(tmp_path, torch_cuda="2.10.0+cu128")
    build = next(s for s in steps if "flash-attn==2.8.3" in s.argv)
    assert dict(build.env) == {"MAX_JOBS": "3", "TORCH_CUDA_ARCH_LIST": "8.9",
                               "FLASH_ATTN_CUDA_ARCHS": "80"}
    assert "--no-build-isolation" in build.argv
    tools = steps[steps.index(build) - 1]
    assert "ninja" in tools.argv


@pytest.mark.quick
def test_fresh_environment_builds_with_flash_attns_own_wheel_lookup(tmp_path: Path) -> None:
    # PyTorch is not installed yet, so the version is unknown: the source route, whose setup
    # fetches a matching wheel itself when one exists.
    steps = plan(tmp_path, gpu=RTX5090, mem_available=64 * GIB, cpus=8)
    build = next(s for s in steps if "flash-attn==2.8.3" in s.argv)
    assert dict(build.env) == {"MAX_JOBS": "8", "TORCH_CUDA_ARCH_LIST": "12.0",
                               "FLASH_ATTN_CUDA_ARCHS": "120"}


@pytest.mark.quick
def test_genai_server_without_a_gpu_builds_for_all(tmp_path: Path) -> None:
    build = next(s for s in plan(tmp_path, gpu=None) if "flash-attn==2.8.3" in s.argv)
    assert dict(build.env) == {"MAX_JOBS": "3"}


@pytest.mark.quick
def test_genai_server_refused_below_compute_8(tmp_path: Path) -> None:
    with pytest.raises(DependencyError, match=r"7\.5") as caught:
        plan(tmp_path, gpu=T4)
    assert caught.value.fix == "set server.launcher: vllm"


@pytest.mark.quick
def test_render_plan_shows_commands_and_env(tmp_path: Path) -> None:
    text = render_plan(plan(tmp_path, torch_cuda="2.10.0+cu128"))
    assert ("MAX_JOBS=3 TORCH_CUDA_ARCH_LIST=8.9 FLASH_ATTN_CUDA_ARCHS=80 "
            f"{tmp_path}/venv/bin/python -m pip install --no-build-isolation --no-deps "
            "flash-attn==2.8.3") in text
    assert "'vllm>=0.11.1,<1.0'" in text  # quoted as a shell user would type it
    assert text.splitlines()[-1].startswith("6. set server.python: ")


@pytest.mark.quick
def test_dry_run_changes_nothing(tmp_path: Path) -> None:
    printed: list[str] = []
    run_setup(plan(tmp_path), dry_run=True, echo=printed.append)
    assert "python3 -m venv" in printed[0]
    assert not (tmp_path / "venv").exists()
    assert not (tmp_path / "config.yaml").exists()


def test_run_setup_runs_steps_with_env_then_sets_python(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    config = tmp_path / "conf" / "config.yaml"
    python = tmp_path / "venv" / "bin" / "python"
    steps = [
        Step("write the marker", (sys.executable, "-c",
                                  "import os, sys; open(sys.argv[1], 'w').write(os.environ['X'])",
                                  str(marker)), {"X": "from env"}),
        Step("set python", set_python=(config, python)),
    ]
    run_setup(steps, dry_run=False, echo=lambda _: None)
    assert marker.read_text() == "from env"
    loaded, _ = load_config(config)
    assert loaded.server.python == python


def test_failed_step_raises_with_its_fix(tmp_path: Path) -> None:
    steps = [Step("fail", (sys.executable, "-c", "raise SystemExit(3)"), fix="do X"),
             Step("never", set_python=(tmp_path / "c.yaml", tmp_path / "p"))]
    with pytest.raises(DependencyError, match="exit status 3") as caught:
        run_setup(steps, dry_run=False, echo=lambda _: None)
    assert caught.value.fix == "do X"
    assert not (tmp_path / "c.yaml").exists()


@pytest.mark.quick
def test_set_config_key_keeps_comments_and_other_keys(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("# my settings\nmodel:\n  name: PaddleOCR-VL-0.9B  # the old one\n"
                    "server:\n  port: 9000\n  python: /old/python\n")
    path.chmod(0o600)
    set_config_key(path, ("server", "python"), "/new/bin/python")
    text = path.read_text()
    assert "# my settings" in text and "# the old one" in text
    assert "port: 9000" in text and "python: /new/bin/python" in text
    assert "/old/python" not in text
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]  # no temporary left


@pytest.mark.quick
def test_set_config_key_creates_the_file(tmp_path: Path) -> None:
    path = tmp_path / "new" / "config.yaml"
    set_config_key(path, ("server", "python"), "/venv/bin/python")
    loaded, _ = load_config(path)
    assert loaded.server.python == Path("/venv/bin/python")


def test_setup_server_dry_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    smi = tmp_path / "nvidia-smi"
    shutil.copyfile(Path(__file__).parent / "fixtures" / "gpu" / "rtx4060.sh", smi)
    smi.chmod(0o755)
    monkeypatch.setenv(gpu.NVIDIA_SMI_ENV, str(smi))
    monkeypatch.setenv(gpu.NO_NVML_ENV, "1")
    config_path = tmp_path / "config.yaml"
    config_path.write_text("server:\n  launcher: genai_server\n")
    config, _ = load_config(config_path)
    assert setup_server(config, config_path, tmp_path / "venv", dry_run=True) == ExitCode.OK
    out = capsys.readouterr().out
    assert "TORCH_CUDA_ARCH_LIST=8.9" in out
    assert f"set server.python: {tmp_path / 'venv' / 'bin' / 'python'} in {config_path}" in out
    assert config_path.read_text() == "server:\n  launcher: genai_server\n"
    assert not (tmp_path / "venv").exists()



def dry_run_with_gpu(tmp_path: Path, fixture: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """`ocrvl setup-server --dry-run` as a user runs it, on a fake nvidia-smi; and its config."""
    config = tmp_path / "config.yaml"
    config.write_text(f"state_dir: {tmp_path / 'state'}\n")
    nvidia_smi = Path(__file__).parent / "fixtures" / "gpu" / f"{fixture}.sh"
    env = {**os.environ, gpu.NO_NVML_ENV: "1", gpu.NVIDIA_SMI_ENV: str(nvidia_smi)}
    done = subprocess.run([sys.executable, "-m", "ocrvl_daemon", "setup-server", "--dry-run",
                           "--config", str(config), "--venv", str(tmp_path / "venv")],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    return done, str(config)


def test_no_gpu_warns_that_the_server_will_not_run_here_but_plans_anyway(tmp_path: Path
                                                                         ) -> None:
    done, config = dry_run_with_gpu(tmp_path, "nogpu")
    assert done.returncode == 0, f"the dry run failed without a GPU: {done.stderr}"
    assert "vllm>=0.11.1,<1.0" in done.stdout, "the plan was not printed"
    assert "No NVIDIA GPU found on this machine" in done.stderr
    assert "will not run here" in done.stderr
    assert vllm_serve_command(load_config(config)[0]) in done.stderr, \
        "the warning does not give the `vllm serve` line to run on a GPU machine"
    assert "server: {mode: external, url: http://GPUHOST:8118/v1}" in done.stderr


def test_a_gpu_gives_no_such_warning(tmp_path: Path) -> None:
    done, _ = dry_run_with_gpu(tmp_path, "rtx4060")
    assert done.returncode == 0, done.stderr
    assert "No NVIDIA GPU" not in done.stderr

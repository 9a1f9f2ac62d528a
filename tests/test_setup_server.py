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
    OWN_SITE_ENV,
    SHARED_PTH,
    Step,
    Target,
    build_jobs,
    flash_attn_wheel,
    plan_setup,
    render_plan,
    run_setup,
    set_config_key,
    setup_server,
)
from ocrvl_daemon.config.file import load_config
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.errors import DependencyError, ExitCode
from ocrvl_daemon.server import gpu, vllm_release
from ocrvl_daemon.server.gpu import GpuReading
from ocrvl_daemon.server.launchers import vllm_serve_command
from testkit import fake_server_env
from testkit.fake_server_env import FakeVllm

GIB = 1024**3
RTX4060 = GpuReading(0, "GPU-4060", "NVIDIA GeForce RTX 4060", 8188, 1024, 7164, "560.94",
                     (8, 9), "nvidia-smi")
RTX5090 = GpuReading(0, "GPU-5090", "NVIDIA GeForce RTX 5090", 32607, 500, 32107, "575.51",
                     (12, 0), "nvidia-smi")
T4 = GpuReading(0, "GPU-t4", "Tesla T4", 15360, 3, 15357, "535.104.05", (7, 5), "nvidia-smi")
GENAI = Config.model_validate({"server": {"launcher": "genai_server"}})
PINNED = vllm_release.requirement(vllm_release.PINNED)
WHEEL_BASE = f"https://github.com/Dao-AILab/flash-attention/releases/download/v{FLASH_ATTN_VERSION}/"


def target(tmp_path: Path) -> Target:
    return Target(tmp_path / "venv", tmp_path / "venv.envs" / "vllm-0.26.0-1")


def plan(tmp_path: Path, config: Config = GENAI, **kw: object) -> list[Step]:
    args: dict[str, object] = {
        "vllm": vllm_release.PINNED, "python_version": (3, 12), "torch_cuda": None,
        "gpu": RTX4060, "config_path": tmp_path / "config.yaml",
        "base_python": "/usr/bin/python3", "uv": None, "mem_available": 14 * GIB, "cpus": 16,
        **kw}
    return plan_setup(target(tmp_path), config, **args)  # type: ignore[arg-type]


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
    folder = target(tmp_path).folder
    pip = (str(folder / "bin" / "python"), "-m", "pip", "install")
    assert commands(steps) == [
        ("/usr/bin/python3", "-m", "venv", str(folder)),
        (*pip, "--upgrade", "pip"),
        (*pip, "vllm==0.26.0"),
    ]
    assert [s.title.split(" ")[0] for s in steps if s.run] == ["prove", "switch", "set", "let"]
    assert steps[-2].title == (f"set server.python: {tmp_path / 'venv' / 'bin' / 'python'} in "
                               f"{tmp_path / 'config.yaml'}")


@pytest.mark.quick
def test_vllm_launcher_with_uv(tmp_path: Path) -> None:
    folder = target(tmp_path).folder
    assert commands(plan(tmp_path, Config.model_validate({}), uv="/opt/uv")) == [
        ("/opt/uv", "venv", "--python", "/usr/bin/python3", str(folder)),
        ("/opt/uv", "pip", "install", "--python", str(folder / "bin" / "python"),
         "vllm==0.26.0"),
    ]


@pytest.mark.quick
def test_another_vllm_release_on_request(tmp_path: Path) -> None:
    steps = plan(tmp_path, Config.model_validate({}), vllm="0.19.1")
    assert commands(steps)[-1][-1] == "vllm==0.19.1"


@pytest.mark.quick
def test_an_existing_environment_is_never_installed_into(tmp_path: Path) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    steps = plan(tmp_path, Config.model_validate({}))
    assert all(str(tmp_path / "venv" / "bin") not in " ".join(argv)
               for argv in commands(steps)), "the environment in use would be changed in place"


@pytest.mark.quick
def test_genai_server_with_a_prebuilt_wheel(tmp_path: Path) -> None:
    steps = plan(tmp_path, torch_cuda="2.8.0+cu128", uv="/opt/uv")
    install = commands(steps)[1]
    assert {PINNED, "xformers", "einops", "uvloop"} <= set(install)
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
            f"{target(tmp_path).folder}/bin/python -m pip install --no-build-isolation "
            "--no-deps flash-attn==2.8.3") in text
    assert " vllm==0.26.0 " in text
    assert text.splitlines()[-2].startswith("8. set server.python: ")


@pytest.mark.quick
def test_dry_run_changes_nothing(tmp_path: Path) -> None:
    printed: list[str] = []
    run_setup(plan(tmp_path), dry_run=True, echo=printed.append)
    assert "python3 -m venv" in printed[0]
    assert not (tmp_path / "venv").exists() and not (tmp_path / "venv.envs").exists()
    assert not (tmp_path / "config.yaml").exists()


def test_run_setup_runs_steps_with_env_then_sets_python(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    config = tmp_path / "conf" / "config.yaml"
    python = tmp_path / "venv" / "bin" / "python"
    steps = [
        Step("write the marker", (sys.executable, "-c",
                                  "import os, sys; open(sys.argv[1], 'w').write(os.environ['X'])",
                                  str(marker)), {"X": "from env"}),
        Step("set python", run=lambda: set_config_key(config, ("server", "python"),
                                                      str(python))),
    ]
    run_setup(steps, dry_run=False, echo=lambda _: None)
    assert marker.read_text() == "from env"
    loaded, _ = load_config(config)
    assert loaded.server.python == python


def test_failed_step_raises_with_its_fix(tmp_path: Path) -> None:
    steps = [Step("fail", (sys.executable, "-c", "raise SystemExit(3)"), fix="do X"),
             Step("never", run=lambda: (tmp_path / "c.yaml").touch())]
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


def test_no_gpu_installs_nothing_and_says_how_to_run_the_server_elsewhere(tmp_path: Path
                                                                         ) -> None:
    done, config = dry_run_with_gpu(tmp_path, "nogpu")
    assert done.returncode == ExitCode.DEPENDENCY, \
        f"without a GPU setup-server must stop a `... && ocrvl run` chain: {done.returncode}"
    assert "No NVIDIA GPU found on this machine" in done.stderr
    assert "nothing was installed" in done.stderr
    assert "vllm==" not in done.stdout, "a plan was printed although nothing can run here"
    assert vllm_serve_command(load_config(config)[0]) in done.stderr, \
        "the error does not give the `vllm serve` line to run on a GPU machine"
    assert "server: {mode: external, url: http://GPUHOST:8118/v1}" in done.stderr
    assert "--force" in done.stderr


def test_a_gpu_gives_no_such_warning(tmp_path: Path) -> None:
    done, _ = dry_run_with_gpu(tmp_path, "rtx4060")
    assert done.returncode == 0, done.stderr
    assert "No NVIDIA GPU" not in done.stderr


def set_up(tmp_path: Path, fixture: str, *args: str, **env: str
           ) -> subprocess.CompletedProcess[str]:
    """`ocrvl setup-server` as a user runs it, with a fake uv (real environments holding
    stand-in packages) and a fake nvidia-smi."""
    uv = fake_server_env.write_fake_uv(tmp_path / "bin")
    (tmp_path / "ocrvl-site").mkdir(exist_ok=True)  # ocrvl's own site-packages, for this test
    config = tmp_path / "config.yaml"
    if not config.exists():
        config.write_text(f"state_dir: {tmp_path / 'state'}\n")
    full_env = {**os.environ, "PATH": f"{uv.parent}{os.pathsep}{os.environ['PATH']}",
                gpu.NO_NVML_ENV: "1", OWN_SITE_ENV: str(tmp_path / "ocrvl-site"),
                gpu.NVIDIA_SMI_ENV: str(Path(__file__).parent / "fixtures" / "gpu" /
                                        f"{fixture}.sh"), **env}
    return subprocess.run([sys.executable, "-m", "ocrvl_daemon", "setup-server", "--config",
                           str(config), "--venv", str(tmp_path / "server-venv"), *args],
                          env=full_env, capture_output=True, text=True, timeout=120, check=False)


def server_vllm(tmp_path: Path) -> str:
    """The vLLM version server.python imports, as the config names it now."""
    config, _ = load_config(tmp_path / "config.yaml")
    assert config.server.python is not None, "server.python is not set"
    done = subprocess.run([str(config.server.python), "-c", "import vllm; print(vllm.__version__)"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"the server environment cannot import vLLM: {done.stderr}"
    return done.stdout.strip()


def an_environment_from_before(tmp_path: Path) -> None:
    """What an older ocrvl left: a real folder at the --venv path with vLLM 0.19.1, in use."""
    python = fake_server_env.make(tmp_path / "server-venv",
                                  FakeVllm("0.19.1", torch="2.10.0", cuda="12.8"))
    (tmp_path / "config.yaml").write_text(f"state_dir: {tmp_path / 'state'}\n"
                                          f"server:\n  python: {python}\n")


def test_setup_installs_the_pinned_vllm_and_points_server_python_at_it(tmp_path: Path) -> None:
    done = set_up(tmp_path, "rtx4060-driver581")
    assert done.returncode == 0, done.stderr
    assert server_vllm(tmp_path) == vllm_release.PINNED
    assert (tmp_path / "server-venv").is_symlink()
    assert "restart ocrvl" in done.stdout


def test_an_upgrade_replaces_the_environment_only_once_the_new_one_imports(
        tmp_path: Path) -> None:
    an_environment_from_before(tmp_path)
    broken = set_up(tmp_path, "rtx4060-driver581", **{fake_server_env.BROKEN_ENV: "1"})
    assert broken.returncode == ExitCode.DEPENDENCY, broken.stderr
    assert "cannot import vLLM" in broken.stderr and "left as it was" in broken.stderr
    assert server_vllm(tmp_path) == "0.19.1", "a failed upgrade broke the environment in use"
    envs = tmp_path / "server-venv.envs"
    assert not envs.exists() or not any(envs.iterdir()), "the failed environment was left behind"

    done = set_up(tmp_path, "rtx4060-driver581")
    assert done.returncode == 0, done.stderr
    assert server_vllm(tmp_path) == vllm_release.PINNED
    assert [p.name for p in (tmp_path / "server-venv.envs").iterdir()] == \
        [(tmp_path / "server-venv").resolve().name], "the replaced environment was kept"

    again = set_up(tmp_path, "rtx4060-driver581", "--vllm", "0.19.1")
    assert again.returncode == 0, again.stderr
    assert server_vllm(tmp_path) == "0.19.1"
    assert len(list((tmp_path / "server-venv.envs").iterdir())) == 1


def test_a_driver_too_old_for_the_pinned_build_installs_nothing_and_names_the_ways_out(
        tmp_path: Path) -> None:
    done = set_up(tmp_path, "rtx4060-driver566")
    assert done.returncode == ExitCode.DEPENDENCY, done.stderr
    for words in ("566.36", "CUDA 12.7", "CUDA 13.0", "R580 or newer", "nothing was installed",
                  "--vllm 0.19.1"):
        assert words in done.stderr, f"{words!r} missing from: {done.stderr}"
    assert not (tmp_path / "server-venv").exists() and not (tmp_path / "server-venv.envs").exists()
    assert "python" not in (tmp_path / "config.yaml").read_text()

    older = set_up(tmp_path, "rtx4060-driver566", "--vllm", "0.19.1")
    assert older.returncode == 0, f"the CUDA 12 build was refused on its driver: {older.stderr}"
    assert server_vllm(tmp_path) == "0.19.1"


def test_a_release_whose_torch_the_driver_cannot_run_is_refused_after_install(
        tmp_path: Path) -> None:
    an_environment_from_before(tmp_path)
    # 0.32.0 is no release the project knows: its torch (CUDA 13) is read once installed.
    done = set_up(tmp_path, "rtx4060-driver566", "--vllm", "0.32.0")
    assert done.returncode == ExitCode.DEPENDENCY, done.stderr
    assert "CUDA 13.0" in done.stderr and "left as it was" in done.stderr, done.stderr
    assert server_vllm(tmp_path) == "0.19.1"


def test_without_a_gpu_force_installs_anyway(tmp_path: Path) -> None:
    done = set_up(tmp_path, "nogpu", "--force")
    assert done.returncode == 0, done.stderr
    assert "will not run here" in done.stderr
    assert server_vllm(tmp_path) == vllm_release.PINNED
    assert not (tmp_path / "ocrvl-site" / SHARED_PTH).exists(), "no GPU: nothing to share"


def test_with_a_gpu_the_layout_model_gets_the_servers_torch_and_no_second_copy(
        tmp_path: Path) -> None:
    done = set_up(tmp_path, "rtx4060-driver581")
    assert done.returncode == 0, done.stderr
    own = tmp_path / "ocrvl-site"
    assert (own / SHARED_PTH).is_file(), "ocrvl's environment was not given the server's torch"
    # ocrvl's own python with that site-packages: its layout model's GPU engine is there now.
    probe = ("import site, sys; site.addsitedir(sys.argv[1]); import torch; "
             "from ocrvl_daemon.server.layout_engine import installed_engines; "
             "print(torch.version.cuda, sorted(installed_engines().gpu))")
    seen = subprocess.run([sys.executable, "-c", probe, str(own)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.split() == ["13.0", "['transformers']"], \
        f"the layout model cannot use the GPU through the server's torch: {seen.stdout}"

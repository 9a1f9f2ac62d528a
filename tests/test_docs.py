"""What users read matches the code: config.example.yaml, README's commands, `--help`."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ocrvl_daemon.cli import COMMANDS, build_parser
from ocrvl_daemon.commands.run import DRAIN_SECONDS
from ocrvl_daemon.config.file import validate_config
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.config.models import MAX_IMAGE_PIXELS
from ocrvl_daemon.process.group import terminate_group
from ocrvl_daemon.server import gpu
from ocrvl_daemon.server.launchers import vllm_serve_command
from testkit.documents import make_pdf
from testkit.harness import free_port
from testkit.runner import ocrvl_env

REPO = Path(__file__).resolve().parents[1]
NO_GPU = REPO / "tests" / "fixtures" / "gpu" / "nogpu.sh"


def readme() -> str:
    return (REPO / "README.md").read_text(encoding="utf-8")


def shell_block(text: str, needle: str) -> str:
    """The fenced shell block of `text` that contains `needle`."""
    blocks = re.findall(r"^```sh\n(.*?)^```", text, re.M | re.S)
    found = [b for b in blocks if needle in b]
    assert len(found) == 1, f"README has {len(found)} shell blocks with {needle!r}"
    return found[0]


def _keys(data: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in data.items():
        keys.add(prefix + key)
        if isinstance(value, dict) and key != "vllm_args" and key != "env":
            keys |= _keys(value, f"{prefix}{key}.")
    return keys


@pytest.mark.quick
def test_config_example_lists_every_key_with_its_default():
    example = yaml.safe_load((REPO / "config.example.yaml").read_text(encoding="utf-8"))
    defaults = Config().model_dump(mode="json")
    assert _keys(example) == _keys(defaults), "config.example.yaml and the config model differ"
    assert validate_config(example).model_dump() == Config().model_dump(), \
        "a default in config.example.yaml is not the real default"


@pytest.mark.quick
def test_readme_commands_exist_and_take_config():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `ocrvl ([a-z-]+)", readme, re.M))
    assert documented == set(COMMANDS), "README's command table and the CLI differ"
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    for name, sub in subparsers.choices.items():  # type: ignore[attr-defined]
        assert "--config" in sub.format_help(), f"`ocrvl {name}` does not take --config"


@pytest.mark.quick
def test_readme_test_command_is_what_ci_runs():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    command = next(line.strip() for line in readme.splitlines()
                   if "pip install -e '.[test]'" in line)
    assert command in ci, ".ci/run does not run the README's test command"


@pytest.mark.quick
def test_readme_vllm_serve_line_is_the_generated_one():
    """The line users run on a GPU machine is what ocrvl's managed launcher runs (and what
    `ocrvl doctor` prints) for the default config, flag for flag."""
    block = shell_block(readme(), "vllm serve")
    documented = shlex.split(block.replace("\\\n", " "), comments=True)
    serve = shlex.split(vllm_serve_command(Config()))
    start = documented.index("vllm")
    assert documented[start:] == serve, "README's `vllm serve` line differs from ocrvl's"
    assert "server: {mode: external, url: http://GPUHOST:8118/v1}" in readme()


@pytest.mark.quick
def test_no_gpu_set_up_is_in_help_and_config_example():
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    doctor = subparsers.choices["doctor"]  # type: ignore[attr-defined]
    text = " ".join(doctor.format_help().split())
    assert "layout model" in text and "vllm serve" in text, "`ocrvl doctor --help` is out of date"
    example = (REPO / "config.example.yaml").read_text(encoding="utf-8")
    assert "No GPU on this machine" in example and "official_models" in example, \
        "config.example.yaml does not point a user without a GPU at the external set-up"


@pytest.mark.slow
def test_trying_ocrvl_without_a_gpu_works_as_documented(tmp_path):
    """Run README's "Try it end to end without any GPU" commands, on a machine without a GPU.

    Only the places are swapped: the PDF, the scratch folder, the port (8118 may be taken)
    and `.venv/bin/` (this interpreter's)."""
    block = shell_block(readme(), "testkit.fake_server") + shell_block(readme(),
                                                                      "testkit.layout_model")
    port = free_port()
    requests = tmp_path / "requests.jsonl"  # the image sizes the server was sent
    script = (block.replace("/tmp/ocrvl-try", str(tmp_path / "try"))
              .replace("8118", str(port))
              .replace(".venv/bin/", f"{Path(sys.executable).parent}/")
              .replace("--read-text", f"--read-text --request-log {requests}"))
    make_pdf(tmp_path / "your.pdf", 2)
    env = ocrvl_env(HOME=str(tmp_path / "home"), **{gpu.NO_NVML_ENV: "1",
                                                     gpu.NVIDIA_SMI_ENV: str(NO_GPU)})
    env.pop("OCRVL_CONFIG", None)
    shell = subprocess.Popen(["bash", "-eu", "-c", script], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        output, _ = shell.communicate(timeout=240)
    finally:
        terminate_group(shell.pid, 10, "README commands", reap=shell.poll)
    assert shell.returncode == 0, f"README's commands failed:\n{output}"
    markdown = (tmp_path / "try" / "book.md").read_text(encoding="utf-8")
    assert "<!-- page 2 -->" in markdown and "page 2 of your.pdf" in markdown, (
        f"the PDF's own words are not in book.md:\n{markdown}")
    # The second block: layout detection on, through the stand-in layout model.
    sent = [json.loads(line) for line in requests.read_text("utf-8").splitlines()]
    pages = sum(r["w"] * r["h"] > MAX_IMAGE_PIXELS / 4 for r in sent)
    assert pages == 2 and len(sent) > pages, (
        f"with layout detection on, whole pages were sent, not their blocks: {sent}")
    assert "Nothing blocks conversion" in output, "doctor finds a problem in the documented set-up"
    assert "none needed here" in output, "doctor did not run without a GPU"


def test_readme_sample_answer_is_an_image_ocrvl_can_send():
    width, height = map(int, re.search(r"fake-ocr OCR (\d+)x(\d+)", readme()).groups())
    assert width * height <= MAX_IMAGE_PIXELS, "the sample is beyond the model's pixel limit"
    assert width / height == pytest.approx(612 / 792, rel=0.01), "not a US Letter page"


def test_readme_states_what_the_program_does():
    text = " ".join(readme().split())
    assert f"for up to {DRAIN_SECONDS:g} s" in text, "SIGTERM's wait for pages is not given"
    reload_line = next(line for line in readme().splitlines() if "reload ocrvl" in line)
    assert "hooks" in reload_line, "reload re-reads the hooks too"
    assert "outside every inbox" in text, "what happens to symlinks is not said"
    assert "`ocrvl retry [PDF...] [--failed] [--flagged] [--pages 3,7-9]`" in text, \
        "retry's options combine"
    assert "(the install part of set-up command 2;" in text
    setup = shell_block(readme(), "ocrvl run")
    assert "ocrvl setup-server && .venv/bin/ocrvl run" in setup, \
        "set-up command 1 cannot convert on a first run"

"""The vLLM release setup-server pins is the one the GPU benchmark of record ran."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ocrvl_daemon.server import vllm_release

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.quick
def test_the_pin_is_the_version_of_record() -> None:
    record = json.loads((ROOT / "bench" / "gpu" / "results.json").read_text(encoding="utf-8"))
    assert record["vllm"] == vllm_release.PINNED, (
        f"setup-server installs vLLM {vllm_release.PINNED}, but the benchmark of record "
        f"(bench/gpu/results.json) ran {record['vllm']}: pin only what was measured")
    assert record["layout_on"]["vllm"] == vllm_release.PINNED


@pytest.mark.quick
def test_everything_that_installs_vllm_names_the_pin() -> None:
    assert vllm_release.release(vllm_release.PINNED) is not None, \
        "the pinned release's torch build is unknown: the driver cannot be checked before install"
    extra = re.search(r"^server = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(
        encoding="utf-8"), re.M)
    assert extra is not None and extra.group(1) == \
        f'"{vllm_release.requirement(vllm_release.PINNED)}"', \
        "the [server] extra installs another vLLM than setup-server"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"vLLM {vllm_release.PINNED}" in readme and \
        vllm_release.requirement(vllm_release.PINNED) in readme, \
        "README does not say which vLLM setup-server installs"

"""The engine worker starts without loading what it never uses (torch, transformers, peft):
on a GPU machine's Python, where they are installed, that took ~15 s of every start."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ocrvl_daemon.config import Config
from ocrvl_daemon.engine_process import pipeline_kwargs
from testkit.documents import make_pdf
from testkit.runner import PACKAGE_ROOT, run_ocrvl, write_config

MARKING_PACKAGE = 'import os\nopen(os.environ["IMPORT_MARKS"], "a").write(__name__ + "\\n")\n'


def test_a_worker_with_no_local_model_names_the_cpu_so_paddlex_does_not_probe_for_a_gpu() -> None:
    remote_only = Config.model_validate({"pipeline": {"use_layout_detection": False}})
    assert pipeline_kwargs(remote_only, "http://x/v1")["device"] == "cpu"
    local_layout = Config.model_validate({"pipeline": {"use_layout_detection": True}})
    assert "device" not in pipeline_kwargs(local_layout, "http://x/v1"), (
        "with a local model, paddlex must still choose the device"
    )
    chosen = Config.model_validate({"pipeline": {"device": "gpu:1"}})
    assert pipeline_kwargs(chosen, "http://x/v1")["device"] == "gpu:1"


@pytest.mark.slow
def test_engine_worker_does_not_import_peft_transformers_or_torch(tmp_path: Path,
                                                                  fake_server) -> None:  # fmt: skip
    # Stand-ins that only record that they were imported, where paddlex's dependencies
    # (modelscope's lazy module) would find them.
    site = tmp_path / "site"
    for name in ("peft", "transformers", "torch"):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(MARKING_PACKAGE, encoding="utf-8")
    marks = tmp_path / "imported.txt"
    marks.touch()
    pdf = make_pdf(tmp_path / "one.pdf", 1)
    config = write_config(tmp_path / "config.yaml")
    result = run_ocrvl("convert", "--config", config, "--server-url", fake_server.api_url, pdf,
                       IMPORT_MARKS=str(marks),
                       PYTHONPATH=os.pathsep.join([str(site), str(PACKAGE_ROOT)]))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    imported = marks.read_text().split()
    assert imported == [], f"the engine worker imported {imported}, which it never uses"

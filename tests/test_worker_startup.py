"""The engine worker starts without loading what it never uses: torch, transformers and peft
(on a GPU machine's Python, where they are installed, ~15 s of every start) and scikit-learn
(~1.7 s of a 3.6 s import on 2 cores), which still works when paddlex does call it."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.engine.worker_settings import pipeline_kwargs
from ocrvl_daemon.server import gpu, layout_engine
from testkit.documents import make_pdf
from testkit.runner import PACKAGE_ROOT, run_ocrvl, write_config

MARKING_PACKAGE = 'import os\nopen(os.environ["IMPORT_MARKS"], "a").write(__name__ + "\\n")\n'


def test_a_worker_with_no_local_model_names_the_cpu_so_paddlex_does_not_probe_for_a_gpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    remote_only = Config.model_validate({"pipeline": {"use_layout_detection": False}})
    assert pipeline_kwargs(remote_only, "http://x/v1")["device"] == "cpu"
    # With the layout model, ocrvl names its engine and device (`layout_engine`).
    card = gpu.GpuReading(0, "GPU-0", "Test GPU", 8188, 1024, 7164, "560.94", (8, 9), "nvml")
    monkeypatch.setattr(gpu, "read_gpus", lambda: [card, replace(card, index=1, uuid="GPU-1")])
    monkeypatch.setattr(layout_engine, "installed_engines", lambda: layout_engine.Installed(
        frozenset({"paddle"}), frozenset()))
    local_layout = pipeline_kwargs(Config.model_validate({}), "http://x/v1")
    assert (local_layout["engine"], local_layout["device"]) == ("paddle_static", "cpu")
    monkeypatch.setattr(layout_engine, "installed_engines", lambda: layout_engine.Installed(
        frozenset({"paddle"}), frozenset({"paddle"})))
    chosen = Config.model_validate({"pipeline": {"device": "gpu:1"}})
    assert pipeline_kwargs(chosen, "http://x/v1")["device"] == "gpu:1"


@pytest.mark.slow
def test_engine_worker_does_not_import_peft_transformers_torch_or_scikit_learn(
        tmp_path: Path, fake_server) -> None:  # fmt: skip
    # Stand-ins that only record that they were imported, where paddlex's dependencies
    # (modelscope's lazy module) would find them.
    site = tmp_path / "site"
    for name in ("peft", "transformers", "torch", "sklearn"):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(MARKING_PACKAGE, encoding="utf-8")
    for module, names in (("preprocessing", "StandardScaler"), ("cluster", "KMeans")):
        (site / "sklearn" / f"{module}.py").write_text(f"{names} = None\n", encoding="utf-8")
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


DEFERRED_SKLEARN = """
import sys
from ocrvl_daemon.worker.paddlex_import import import_paddleocr_vl
PaddleOCRVL = import_paddleocr_vl()
PaddleOCRVL(use_layout_detection=False, vl_rec_backend="vllm-server",
            vl_rec_server_url="http://127.0.0.1:9/v1", device="cpu")
assert "sklearn" not in sys.modules, "building the pipeline imported scikit-learn"
from paddlex.inference.pipelines.table_recognition import pipeline_v2
labels = pipeline_v2.KMeans(n_clusters=2, n_init=1).fit([[0], [1], [10], [11]]).labels_
assert labels[0] == labels[1] != labels[2] == labels[3], labels
import sklearn.cluster
assert type(sklearn.cluster.KMeans).__name__ == "ABCMeta", "a stand-in outlived the import"
print("ok")
"""


@pytest.mark.slow
def test_scikit_learn_is_loaded_only_when_paddlex_calls_it() -> None:
    result = subprocess.run([sys.executable, "-c", DEFERRED_SKLEARN], capture_output=True,
                            text=True, cwd=PACKAGE_ROOT, timeout=300, check=False)  # fmt: skip
    assert result.stdout.strip().endswith("ok"), (
        "paddlex's KMeans (table recognition) did not work after scikit-learn was deferred at "
        f"the worker's import:\n{result.stderr[-3000:]}"
    )

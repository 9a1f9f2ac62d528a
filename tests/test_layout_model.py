"""ocrvl's copy of PaddleX's rules for the layout model (where it is cached, which hosts it is
downloaded from, which model each pipeline version uses) matches the installed paddlex.

`ocrvl doctor` cannot import paddlex (seconds), so these facts are written down in
`layout_model.py` and `models.py`; this test fails when a paddlex upgrade changes them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ocrvl_daemon.config.models import MODELS
from ocrvl_daemon.server import layout_model

# Run in a fresh interpreter: paddlex reads its environment variables when imported.
PADDLEX_FACTS = """\
import inspect, json
from paddlex.inference.utils import official_models as om
from paddlex.inference.pipelines import load_pipeline_config
from paddlex.inference.models import _get_inference_engine, _resolve_default_paddle_engine
from paddleocr import PaddleOCRVL

manager = om.official_models
layout = {}
for version in ("v1", "v1.5", "v1.6"):
    class Named:
        pipeline_version = version
    pipeline = PaddleOCRVL._paddlex_pipeline_name.fget(Named())
    name = load_pipeline_config(pipeline)["SubModules"]["LayoutDetection"]["model_name"]
    engine = _resolve_default_paddle_engine(name)
    layout[version] = {
        "name": name,
        "formats": _get_inference_engine(engine).get_supported_model_formats(),
        "hosted_by": [c.alias for c in manager.hoster_candidates
                      if c(manager._save_dir).supports_model(name)],
    }
print(json.dumps({
    "save_dir": str(manager._save_dir),
    "hosts": [[c.alias, c.healthcheck_url] for c in manager.hoster_candidates],
    "timeouts": [c._healthcheck_timeout for c in manager.hoster_candidates],
    "source": om.MODEL_SOURCE,
    "ordered": [h.alias for h in manager._build_hosters()],
    "hf_download": inspect.getsource(om._HuggingFaceModelHoster._download),
    "layout": layout,
}))
"""


@pytest.fixture(scope="module")
def paddlex_facts(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict[str, str]]:
    cache = tmp_path_factory.mktemp("paddlex-cache")
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(cache),
        layout_model.CACHE_HOME_ENV: str(cache / "home"),
        layout_model.MODEL_SOURCE_ENV: "BOS",
        layout_model.HUGGING_FACE_ENDPOINT_ENV: "http://hf.invalid",
        # Only so that paddlex prints the order it would try, without asking any host.
        "PADDLE_PDX_DISABLE_MODEL_SOURCE_CHECK": "1",
    }
    done = subprocess.run([sys.executable, "-c", PADDLEX_FACTS], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), env


def test_cache_folder_is_paddlexs(paddlex_facts: tuple[dict, dict[str, str]]) -> None:
    facts, env = paddlex_facts
    assert layout_model.model_dir("PP-DocLayoutV3", env) == \
        Path(facts["save_dir"]) / "PP-DocLayoutV3", "PaddleX caches models somewhere else now"
    default = layout_model.model_dir("PP-DocLayoutV3", {})
    assert default == Path.home() / ".paddlex" / "official_models" / "PP-DocLayoutV3"


def test_download_hosts_and_their_order_are_paddlexs(
        paddlex_facts: tuple[dict, dict[str, str]]) -> None:
    facts, env = paddlex_facts
    assert facts["source"] == "bos", "PaddleX no longer reads PADDLE_PDX_MODEL_SOURCE"
    hosts = layout_model.download_hosts(env)
    assert [source for source, _ in hosts] == facts["ordered"]
    assert sorted(map(tuple, facts["hosts"])) == sorted(hosts), \
        "PaddleX asks other hosts (or the Hugging Face endpoint is no longer configurable)"
    assert set(facts["timeouts"]) == {layout_model.HOST_TIMEOUT}
    assert 'repo_id=f"PaddlePaddle/{model_name}"' in facts["hf_download"], \
        "the Hugging Face repository in doctor's fix is no longer where PaddleX downloads from"


@pytest.mark.parametrize("model", sorted(MODELS))
def test_layout_model_of_each_pipeline_version(
        paddlex_facts: tuple[dict, dict[str, str]], model: str) -> None:
    facts, _ = paddlex_facts
    known = MODELS[model]
    layout = facts["layout"][known.pipeline_version]
    assert layout["name"] == known.layout_model
    # No model formats: PaddleX loads the plain `<name>` folder (not `<name>_safetensors`).
    assert layout["formats"] is None
    assert sorted(layout["hosted_by"]) == sorted(layout_model.MODEL_HOSTS)

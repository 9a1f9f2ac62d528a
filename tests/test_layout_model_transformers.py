"""The stand-in layout model in Hugging Face's format (`python -m testkit.layout_model CACHE
--format transformers`), loaded by PaddleX's transformers engine exactly as the official
`PP-DocLayoutV3_safetensors` is: written without paddle, its blocks follow the page's ink
through PaddleX's own postprocess when the process opts in to the hook, and nothing changes
without it. Runs only where torch, torchvision and transformers are installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchvision")
pytest.importorskip("transformers")

from testkit.documents import make_layout_pdf  # noqa: E402
from testkit.layout_ink import ink_blocks, ops_for  # noqa: E402
from testkit.runner import ocrvl_env  # noqa: E402

SITE = Path(__file__).resolve().parents[1] / "testkit" / "layout_standin_site"
FIRST_PAGE = ["doc_title", "text", "table", "display_formula", "image", "paragraph_title",
              "text", "number"]
LATER_PAGE = ["paragraph_title", *FIRST_PAGE[1:]]
# PaddleX's layout model through its transformers engine, as ocrvl's worker asks for it
# (engine, device), on a book's pages rendered as ocrvl renders them: each page's labels.
DETECT = """
import json, sys
import numpy as np
from paddleocr import LayoutDetection
from ocrvl_daemon.config.model import PipelineConfig
from ocrvl_daemon.files.pdf import page_count, render_page
from pathlib import Path
pdf = Path(sys.argv[1])
config = PipelineConfig(use_layout_detection=True)
model = LayoutDetection(model_name="PP-DocLayoutV3", engine="transformers", device="cpu")
pages = []
for page in range(page_count(pdf)):
    image = render_page(pdf, page, config.render_scale, config.page_pixel_limit)
    (result,) = model.predict(np.asarray(image), threshold=0.3, layout_nms=True)
    pages.append([box["label"] for box in result["boxes"]])
print(json.dumps(pages))
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PaddleX cache home holding the small stand-in in Hugging Face's format, written in a
    process where paddle cannot be imported."""
    root = tmp_path_factory.mktemp("paddlex-cache")
    no_paddle = root / "no-paddle" / "paddle"
    no_paddle.mkdir(parents=True)
    (no_paddle / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'paddle'\", name='paddle')\n")
    env = ocrvl_env()
    env["PYTHONPATH"] = f"{no_paddle.parent}:{env['PYTHONPATH']}"
    done = subprocess.run([sys.executable, "-m", "testkit.layout_model", str(root), "--small",
                           "--format", "transformers"], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return root


def detect(cache: Path, pdf: Path, hook: bool) -> list[list[str]]:
    env = ocrvl_env(PADDLE_PDX_CACHE_HOME=str(cache))
    if hook:
        env["PYTHONPATH"] = f"{SITE}:{env['PYTHONPATH']}"
    done = subprocess.run([sys.executable, "-c", DETECT, str(pdf)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_folder_is_where_and_what_paddlexs_transformers_engine_loads(cache: Path) -> None:
    folder = cache / "official_models" / "PP-DocLayoutV3_safetensors"
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "inference.yml", "model.safetensors", "preprocessor_config.json"]
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["PPDocLayoutV3ForObjectDetection"]
    assert config["ocrvl_stand_in"] is True and len(config["id2label"]) == 25
    processor = json.loads((folder / "preprocessor_config.json").read_text())
    assert processor["size"] == {"height": 800, "width": 800}
    assert not (cache / "official_models" / "PP-DocLayoutV3").exists(), "no paddle folder"


def test_blocks_follow_the_ink_through_paddlexs_postprocess(cache: Path,
                                                            tmp_path: Path) -> None:
    pdf = make_layout_pdf(tmp_path / "book.pdf", 2)
    assert detect(cache, pdf, hook=True) == [FIRST_PAGE, LATER_PAGE]


def test_without_the_hook_the_model_runs_and_finds_nothing(cache: Path, tmp_path: Path) -> None:
    pdf = make_layout_pdf(tmp_path / "book.pdf", 1)
    assert detect(cache, pdf, hook=False) == [[]], \
        "the silenced class heads let the random network's own queries through"


def test_torch_computes_the_same_rows_as_numpy() -> None:
    rng = np.random.default_rng(0)
    image = np.ones((2, 3, 800, 800), np.float32)
    for top in range(40, 760, 60):  # bands of random ink
        image[:, :, top:top + 20, 100:100 + int(rng.integers(50, 600))] = 0
    image[1, :, 300:420, 200:600] = rng.random((3, 120, 400), dtype=np.float32)
    scale = np.asarray([[0.5, 0.6], [1.0, 1.0]], np.float32)
    expected = ink_blocks(image, scale, ops_for("numpy"))
    got = ink_blocks(torch.from_numpy(image), torch.from_numpy(scale), ops_for("torch"))
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-3)
    assert (expected[..., 1] > 0).sum() >= 20


def test_the_hook_leaves_a_model_without_the_marker_alone() -> None:
    from testkit.layout_model import MARKER, transformers_model
    from testkit.layout_standin import PIXELS, install

    install()
    from transformers import PPDocLayoutV3ImageProcessor

    model = transformers_model("PP-DocLayoutV3", small=True)
    pixels = torch.ones(1, 3, 800, 800)
    pixels[:, :, 100:120, 100:700:6] = 0  # one line of "text": strokes, no rule
    processor = PPDocLayoutV3ImageProcessor()
    with torch.inference_mode():
        marked = model(pixel_values=pixels)
        setattr(model.config, MARKER, False)
        plain = model(pixel_values=pixels)
    assert PIXELS in marked.__dict__ and PIXELS not in plain.__dict__
    sizes = torch.tensor([[1600, 1200]])
    (found,) = processor.post_process_object_detection(marked, threshold=0.5,
                                                        target_sizes=sizes)
    (none,) = processor.post_process_object_detection(plain, threshold=0.5, target_sizes=sizes)
    assert found["labels"].tolist() == [22] and len(found["polygon_points"]) == 1
    assert found["boxes"].tolist() == [[144.0, 192.0, 1044.0, 240.0]]
    assert len(none["labels"]) == 0

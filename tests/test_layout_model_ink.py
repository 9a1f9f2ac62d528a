"""The stand-in layout model's detections (`testkit.layout_ink`), which need neither paddle nor
torch to check: blocks from the page's ink, one implementation whatever the framework, and the
transformers hook that carries them only where a process opts in.

With torch and transformers: tests/test_layout_model_transformers.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ocrvl_daemon.config.model import PipelineConfig
from ocrvl_daemon.files.pdf import render_page
from testkit.documents import make_layout_pdf
from testkit.layout_ink import COLUMNS, INPUT_SIZE, LABELS, ink_blocks, ops_for
from testkit.runner import ocrvl_env

SITE = Path(__file__).resolve().parents[1] / "testkit" / "layout_standin_site"
# Each page's blocks in reading order (make_layout_pdf; page 1 opens with the book's title).
FIRST_PAGE = ["doc_title", "text", "table", "display_formula", "image", "paragraph_title",
              "text", "number"]
LATER_PAGE = ["paragraph_title", *FIRST_PAGE[1:]]
FIGURE_LEFT, FIGURE_RIGHT = 300, 924  # where make_layout_pdf draws the figure (page pixels)
NAMES = {index: name for name, index in LABELS.items()}


def model_input(tmp_path: Path, pages: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """The pages of a layout book as ocrvl renders them and PaddleX feeds the model: [B, 3,
    800, 800] in [0, 1] (bicubic resize), and the [B, 2] scale factors."""
    import cv2

    pdf = make_layout_pdf(tmp_path / "book.pdf", pages)
    config = PipelineConfig(use_layout_detection=True)
    images, scales = [], []
    for page in range(pages):
        image = render_page(pdf, page, config.render_scale, config.page_pixel_limit)
        height, width = image.shape[:2]
        resized = cv2.resize(image, (INPUT_SIZE, INPUT_SIZE), interpolation=cv2.INTER_CUBIC)
        images.append(resized.transpose(2, 0, 1).astype(np.float32) / 255)
        scales.append([INPUT_SIZE / height, INPUT_SIZE / width])
    return np.stack(images), np.asarray(scales, dtype=np.float32)


def blocks(rows: Any) -> list[list[tuple[str, list[float]]]]:
    """Each page's (label, box) of the rows that score, in their order."""
    pages = []
    for page in np.asarray(rows):
        found = sorted((r for r in page if r[COLUMNS.index("score")] > 0),
                       key=lambda r: r[COLUMNS.index("order")])
        pages.append([(NAMES[int(r[0])], [float(v) for v in r[2:6]]) for r in found])
    return pages


@pytest.mark.quick
def test_blocks_follow_the_pages_ink(tmp_path: Path) -> None:
    image, scale = model_input(tmp_path)
    rows = ink_blocks(image, scale, ops_for("numpy"))
    assert rows.shape == (2, 48, len(COLUMNS))
    pages = blocks(rows)
    assert [[label for label, _ in page] for page in pages] == [FIRST_PAGE, LATER_PAGE]
    for page in pages:
        tops = [box[1] for _, box in page]
        assert tops == sorted(tops)
        (figure,) = [box for label, box in page if label == "image"]
        assert abs(figure[0] - FIGURE_LEFT) <= 16 and abs(figure[2] - FIGURE_RIGHT) <= 16


@pytest.mark.quick
def test_a_blank_page_has_no_blocks() -> None:
    rows = ink_blocks(np.ones((1, 3, INPUT_SIZE, INPUT_SIZE), np.float32),
                      np.ones((1, 2), np.float32), ops_for("numpy"))
    assert not rows[..., COLUMNS.index("score")].any()


def test_paddle_computes_the_same_rows(tmp_path: Path) -> None:
    """The static graph's copy of the analysis is this one, run on paddle tensors."""
    paddle = pytest.importorskip("paddle")
    image, scale = model_input(tmp_path)
    expected = ink_blocks(image, scale, ops_for("numpy"))
    got = ink_blocks(paddle.to_tensor(image), paddle.to_tensor(scale), ops_for("paddle"))
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-3)


def test_the_transformers_hook_is_opt_in_and_imports_nothing() -> None:
    """With `testkit/layout_standin_site` on PYTHONPATH a process gets the hook (a finder,
    nothing imported); without it, nothing."""
    probe = ("import json, sys; print(json.dumps([type(f).__name__ for f in sys.meta_path] + "
             "sorted(m for m in ('torch', 'transformers', 'paddle') if m in sys.modules)))")

    def finders(pythonpath: str | None) -> list[str]:
        env = ocrvl_env()
        if pythonpath:
            env["PYTHONPATH"] = pythonpath + ":" + env["PYTHONPATH"]
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                              text=True, timeout=60, check=True)
        return list(json.loads(done.stdout))

    opted_in = finders(str(SITE))
    assert opted_in[0] == "_Finder", opted_in
    assert not {"torch", "transformers", "paddle"} & set(opted_in)
    assert "_Finder" not in finders(None)

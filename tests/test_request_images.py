"""Images beyond the model's aspect limit are padded before they are sent; others go as they
are. (End to end: tests/test_convert.py, a 250:1 page against the fake server, which refuses
such images as vLLM does.)"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest
from PIL import Image

from ocrvl_daemon.config.models import MAX_IMAGE_ASPECT
from ocrvl_daemon.worker.request_images import PADDED_ASPECT, within_aspect

pytestmark = pytest.mark.quick


def chat(pixels: np.ndarray, fmt: str) -> list[dict[str, Any]]:
    """PaddleX's chat messages for one block image and its prompt."""
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    url = f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "OCR:"}]}]


def image_of(messages: list[dict[str, Any]]) -> Image.Image:
    url = messages[0]["content"][0]["image_url"]["url"]
    return Image.open(io.BytesIO(base64.b64decode(url.split(";base64,")[1])))


def test_an_image_within_the_limit_goes_untouched() -> None:
    messages = chat(np.full((40, 40 * MAX_IMAGE_ASPECT, 3), 200, np.uint8), "PNG")
    assert within_aspect(messages) is messages, "an image the server accepts was re-encoded"


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_thin_tall_block_is_padded_centred_with_its_edge_colour(fmt: str) -> None:
    pixels = np.full((3000, 10, 3), 230, np.uint8)  # a light grey column, 300:1
    pixels[:, 4:6] = 0  # a black rule down its middle
    messages = chat(pixels, fmt)
    sent = within_aspect(messages)
    assert messages[0]["content"][0]["image_url"]["url"] != sent[0]["content"][0]["image_url"][
        "url"], "the image beyond the limit was sent as it was"
    assert sent[0]["content"][1] == {"type": "text", "text": "OCR:"}, "the prompt changed"
    with image_of(sent) as img:
        assert img.format == fmt, f"sent as {img.format}, not as PaddleX encoded it ({fmt})"
        width, height = img.size
        out = np.asarray(img.convert("RGB")).astype(int)
    assert (width, height) == (3000 // PADDED_ASPECT, 3000), (width, height)
    left = (width - 10) // 2
    assert abs(out[:, left + 4:left + 6].mean()) < 40, "the block's content is not centred"
    assert abs(out[:, :left].mean() - 230) < 8, "the padding is not the block's edge colour"

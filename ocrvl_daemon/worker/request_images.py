"""The images of a chat request, kept within what the model's image processor accepts.

vLLM's PaddleOCR-VL image processor refuses an image whose long side is more than
MAX_IMAGE_ASPECT times its short side (HTTP 400, the same on every try): a strip of a page,
or a thin block the layout model cut (a rule, a running header). Such an image is padded on
its short side with its own edge colour to PADDED_ASPECT, so its page is read instead of
failing after its retries. Every other image goes as PaddleX encoded it.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from ocrvl_daemon.config.models import MAX_IMAGE_ASPECT

# Well inside the limit once the server rounds each side to its 28-pixel patches.
PADDED_ASPECT = 100
# Enough of the base64 text for an image's header (its size) without decoding all of it.
HEADER_CHARS = 8192


def within_aspect(messages: Any) -> Any:
    """`messages` (OpenAI chat messages) with every data-URL image beyond MAX_IMAGE_ASPECT
    padded to PADDED_ASPECT; `messages` itself when none is."""
    padded = {(m, n): {**image, "url": url} for m, n, image in _image_parts(messages)
              if (url := _padded(image["url"])) is not None}
    if not padded:
        return messages
    return [{**message, "content": [{**part, "image_url": padded[(m, n)]}
                                    if (m, n) in padded else part
                                    for n, part in enumerate(message["content"])]}
            if any(key[0] == m for key in padded) else message
            for m, message in enumerate(messages)]


def image_url(messages: Any) -> str:
    """The first data-URL image of `messages` ("" when there is none)."""
    return next((str(image["url"]) for _, _, image in _image_parts(messages)), "")


def _image_parts(messages: Any) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(message index, part index, its `image_url`) of each image of `messages` with a URL."""
    for m, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for n, part in enumerate(content if isinstance(content, list) else ()):
            image = part.get("image_url") if isinstance(part, dict) else None
            if isinstance(image, dict) and isinstance(image.get("url"), str):
                yield m, n, image


def pixels_of(url: str) -> np.ndarray | None:
    """The RGB pixels (height x width x 3) of a base64 data-URL image; None when `url` is not
    one that decodes."""
    parts = _data_url(url)
    if parts is None:
        return None
    try:
        with Image.open(io.BytesIO(base64.b64decode(parts[1]))) as img:
            return np.asarray(img.convert("RGB"))
    except (binascii.Error, ValueError, OSError, UnidentifiedImageError):
        return None


def _padded(url: str) -> str | None:
    """The data URL `url` with its image padded to PADDED_ASPECT, or None when it is within
    MAX_IMAGE_ASPECT (or not a base64 image: the server judges it as it is)."""
    parts = _data_url(url)
    if parts is None:
        return None
    head, data = parts
    size = _size(data)
    if size is None or max(size) <= MAX_IMAGE_ASPECT * min(size):
        return None
    pixels = pixels_of(url)
    if pixels is None:
        return None
    fmt = "JPEG" if head.lower() in ("data:image/jpeg", "data:image/jpg") else "PNG"
    buf = io.BytesIO()
    Image.fromarray(_pad(pixels)).save(buf, format=fmt, **({"quality": 95} if fmt == "JPEG"
                                                              else {}))
    return f"{head};base64,{base64.b64encode(buf.getvalue()).decode('ascii')}"


def _data_url(url: str) -> tuple[str, str] | None:
    """("data:image/png", its base64 text) of a base64 data-URL image; None for any other
    URL."""
    head, sep, data = url.partition(";base64,")
    return (head, data) if sep and head.startswith("data:image/") else None


def _size(data: str) -> tuple[int, int] | None:
    """An image's (width, height) from its base64 text, read from its header alone where
    that holds it."""
    for text in (data[:HEADER_CHARS], data):
        try:
            with Image.open(io.BytesIO(base64.b64decode(text[: len(text) // 4 * 4]))) as img:
                return img.size
        except (binascii.Error, ValueError, OSError, UnidentifiedImageError):
            continue
    return None


def _pad(pixels: np.ndarray) -> np.ndarray:
    """`pixels` (height x width x 3) centred on a canvas PADDED_ASPECT times shorter than
    its long side, filled with the median colour of its two long edges."""
    height, width = pixels.shape[:2]
    wide = width >= height
    edges = (np.concatenate([pixels[0], pixels[-1]]) if wide
             else np.concatenate([pixels[:, 0], pixels[:, -1]]))
    colour = np.median(edges, axis=0).astype(np.uint8)
    short = max(math.ceil(max(height, width) / PADDED_ASPECT), min(height, width))
    shape = (short, width, 3) if wide else (height, short, 3)
    canvas = np.empty(shape, dtype=np.uint8)
    canvas[:] = colour
    top, left = (short - height) // 2 if wide else 0, 0 if wide else (short - width) // 2
    canvas[top:top + height, left:left + width] = pixels
    return canvas


# A page image with more than this share of dark pixels has ink on it: an empty answer for
# it is a failure, not a blank page. One line of small text on a 2x-rendered A4 page is
# about 0.1%; scanner noise on a blank page stays well below.
INK_SHARE = 0.0005
INK_LEVEL = 128


def has_ink(image: np.ndarray) -> bool:
    """Whether a rendered page (an H x W x 3 array) has anything dark on it."""
    # The darkest channel of each pixel, channel by channel: numpy's min over the last axis
    # of 3 takes ~10x as long (68 ms for a 2x-rendered A4 page, on every page's way out).
    darkest = np.minimum(np.minimum(image[..., 0], image[..., 1]), image[..., 2])
    return bool(np.count_nonzero(darkest < INK_LEVEL) > INK_SHARE * darkest.size)

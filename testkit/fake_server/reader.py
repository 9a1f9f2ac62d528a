"""Real words for the stand-in server (`--read-text`): each image it is sent is read with a
real OCR model, PP-OCRv6 detection and recognition from the rapidocr wheel on onnxruntime (CPU,
offline, ~1 s a page on two cores), so tests can assert on the words that come back.

The answer is shaped like PaddleOCR-VL's to the `OCR:` prompt: one line per paragraph, a
paragraph being lines set close together (a gap of more than half a line starts the next),
joined with spaces. Nothing is dehyphenated: a word cut at a line's end stays `docu- ment`,
as printed.
"""

from __future__ import annotations

import io
import threading
from typing import Any

import numpy as np
from PIL import Image

# A gap between two lines wider than this share of a line's height starts a paragraph.
PARAGRAPH_GAP = 0.5
_LOCK = threading.Lock()  # one model, one page at a time (the server reads pages in threads)
_ENGINE: list[Any] = []


def _engine() -> Any:
    if not _ENGINE:
        from rapidocr import RapidOCR

        _ENGINE.append(RapidOCR(params={"Global.log_level": "warning", "Global.use_cls": False}))
    return _ENGINE[0]


def read_text(image: bytes) -> str:
    """The words on `image` (any format Pillow reads), one paragraph a line."""
    with Image.open(io.BytesIO(image)) as img:
        pixels = np.asarray(img.convert("RGB"))
    with _LOCK:
        result = _engine()(pixels)
    if result.boxes is None or not result.txts:
        return ""
    # The model finds pieces of lines: a piece whose middle lies within the line above's
    # height is on that line.
    pieces = sorted((float(box[:, 1].min()), float(box[:, 1].max()), float(box[:, 0].min()),
                     text.strip())
                    for box, text in zip(np.asarray(result.boxes), result.txts, strict=True))
    lines: list[list[Any]] = []  # [top, bottom, [(left, text), ...]]
    for top, bottom, left, text in pieces:
        if lines and lines[-1][0] <= (top + bottom) / 2 <= lines[-1][1]:
            lines[-1][1] = max(lines[-1][1], bottom)
            lines[-1][2].append((left, text))
        else:
            lines.append([top, bottom, [(left, text)]])
    paragraphs: list[list[str]] = []
    below = None
    for top, bottom, texts in lines:
        if below is None or top - below > PARAGRAPH_GAP * (bottom - top):
            paragraphs.append([])
        paragraphs[-1].append(" ".join(text for _, text in sorted(texts)))
        below = bottom
    return "\n".join(" ".join(p) for p in paragraphs)

"""The stand-in layout model's detections: blocks found from a page's ink (one implementation).

`ink_blocks(image, scale_factor, ops)` runs the same array code on paddle tensors (inside the
stand-in's exported static graph, `testkit.layout_model`), on torch tensors (the transformers
engine's hook, `testkit.layout_standin`) and on numpy arrays (tests without either
framework): `ops` holds the few calls whose spelling differs between them (`PADDLE`, `TORCH`,
`NUMPY`); everything else is operators the three share. Importing this module imports none of
the frameworks.

The analysis: dark cells of an 8x8-pixel grid of the 800x800 input, bands of inked cell rows
separated by an empty one, each band a block; its label from its geometry: a dense band is an
image, one crossed by 3+ long horizontal rules a table, a centred single line a formula or
(first on the page) the title, a short single line a heading, a narrow line at the very bottom
a page number, else text. A few pooling and matrix ops on a 100x100 grid: deterministic, and a
few ms a page.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

INPUT_SIZE = 800  # the official inference.yml resizes every page to 800x800
CELL = 8  # pixels of the 800x800 input per grid cell
GRID = INPUT_SIZE // CELL
MAX_BLOCKS = 48  # ink bands kept per page (the top ones; real pages have 5-40 blocks)
DARK = 0.5  # input is scaled to [0, 1]: darker than this in every channel is ink
OCCUPIED = 1.0 / 64  # a cell with at least one dark pixel holds ink
RULE = 41  # a horizontal dark run this long (input pixels) is a ruling line, never a glyph
SCORE = 0.9
# Label indices in the official label list (PaddleX's `_LABEL_DOC_LAYOUT_V2V3`).
LABELS = {"display_formula": 5, "doc_title": 6, "image": 14, "number": 16,
          "paragraph_title": 17, "table": 21, "text": 22}
# Columns of a row of `ink_blocks`: PaddleX's ordered detection rows.
COLUMNS = ("label", "score", "x1", "y1", "x2", "y2", "order", "votes")


@dataclass(frozen=True)
class Ops:
    """The calls `ink_blocks` needs whose spelling differs between array libraries."""

    to_float: Callable[[Any], Any]  # bool or number array -> float32
    amin: Callable[[Any, int, bool], Any]  # (x, axis, keepdim)
    amax: Callable[[Any, int, bool], Any]
    sum: Callable[[Any, int], Any]
    cumsum: Callable[[Any, int], Any]
    arange: Callable[[int, int, Any], Any]  # float32 [start, stop), on `like`'s device
    concat: Callable[[list[Any], int], Any]
    stack: Callable[[list[Any], int], Any]
    unsqueeze: Callable[[Any, int], Any]
    where: Callable[[Any, Any, Any], Any]
    full_like: Callable[[Any, float], Any]
    zeros_like: Callable[[Any], Any]
    clip_min: Callable[[Any, float], Any]
    bmm: Callable[[Any, Any], Any]
    avg_pool: Callable[[Any, int], Any]  # [B, 1, H, W] -> [B, 1, H/k, W/k]


def ink_blocks(image: Any, scale_factor: Any, ops: Ops) -> Any:
    """[B, MAX_BLOCKS, 8] detection rows (`COLUMNS`) in the page's own pixels, found from the
    ink of `image` ([B, 3, 800, 800] scaled to [0, 1]); empty slots score 0. `scale_factor`
    is [B, 2]: (800 / page height, 800 / page width)."""
    dark = ops.to_float(ops.amin(image, 1, True) < DARK)  # [B, 1, 800, 800]
    cells = ops.avg_pool(dark, CELL)[:, 0]  # [B, G, G]: share of dark pixels per cell
    occupied = ops.to_float(cells >= OCCUPIED)
    rows = ops.amax(occupied, 2, False)  # [B, G]
    above = ops.concat([ops.zeros_like(rows[:, :1]), rows[:, :-1]], 1)
    band = ops.cumsum(rows * (1 - above), 1) * rows  # 1, 2, ... per inked run; 0 gap
    numbers = ops.arange(1, MAX_BLOCKS + 1, image).reshape([1, MAX_BLOCKS, 1])
    member = ops.to_float(ops.unsqueeze(band, 1) == numbers)  # [B, K, G]: row in band k
    present = ops.amax(member, 2, False)  # [B, K]
    index = ops.arange(0, GRID, image)
    y1 = ops.amin(member * index + (1 - member) * GRID, 2, False)
    y2 = ops.amax(member * index, 2, False) + 1
    columns = ops.to_float(ops.bmm(member, occupied) > 0)  # [B, K, G]
    x1 = ops.amin(columns * index + (1 - columns) * GRID, 2, False)
    x2 = ops.amax(columns * index, 2, False) + 1
    inside = ops.to_float((index >= ops.unsqueeze(x1, 2)) & (index < ops.unsqueeze(x2, 2)))
    area = ops.sum(member, 2) * (x2 - x1)
    ink = ops.sum(ops.bmm(member, cells) * inside, 2)
    density = ink / ops.clip_min(area, 1.0)
    # Long horizontal dark runs (RULE dark pixels in a row, from a running count along x):
    # table rules, never text strokes.
    count = ops.cumsum(dark, 3)
    count = ops.concat([ops.zeros_like(count[:, :, :, :1]), count], 3)  # [B, 1, 800, 801]
    runs = ops.to_float(count[:, :, :, RULE:] - count[:, :, :, :-RULE] > RULE - 0.5)
    rule_rows = ops.amax(ops.amax(runs, 3, False).reshape([-1, GRID, CELL]), 2, False)
    rules = ops.sum(member * ops.unsqueeze(rule_rows, 1), 2)

    height, width, middle = y2 - y1, x2 - x1, (x1 + x2) / 2
    line = height <= 5
    centred = (abs(middle - GRID / 2) <= 4) & (x1 >= 0.15 * GRID)
    first = numbers[:, :, 0] == 1

    def label(name: str) -> Any:
        return ops.full_like(y1, LABELS[name])

    kind = label("text")
    for name, where in (  # the last that applies wins
        ("paragraph_title", line & (width <= GRID / 2) & ~centred),
        ("display_formula", line & centred & ~first),
        ("doc_title", line & centred & first),
        ("number", (y1 >= 0.92 * GRID) & (width <= 8) & line),
        ("table", rules >= 3),
        ("image", (density >= 0.3) & (height >= 4)),
    ):
        kind = ops.where(where, label(name), kind)
    sh = present * CELL / scale_factor[:, 0:1]
    sw = present * CELL / scale_factor[:, 1:2]
    order = numbers[:, :, 0] + ops.zeros_like(y1)
    return ops.stack([kind, present * SCORE, x1 * sw, y1 * sh, x2 * sw, y2 * sh, order,
                      ops.zeros_like(y1)], 2)


def _paddle_ops() -> Ops:
    import paddle
    import paddle.nn.functional as F

    return Ops(
        to_float=lambda x: x.astype("float32"),
        amin=lambda x, axis, keep: x.min(axis=axis, keepdim=keep),
        amax=lambda x, axis, keep: x.max(axis=axis, keepdim=keep),
        sum=lambda x, axis: x.sum(axis=axis),
        cumsum=lambda x, axis: paddle.cumsum(x, axis=axis),
        arange=lambda start, stop, like: paddle.arange(start, stop, dtype="float32"),
        concat=lambda xs, axis: paddle.concat(xs, axis=axis),
        stack=lambda xs, axis: paddle.stack(xs, axis=axis),
        unsqueeze=lambda x, axis: x.unsqueeze(axis),
        where=paddle.where,
        full_like=paddle.full_like,
        zeros_like=paddle.zeros_like,
        clip_min=lambda x, low: paddle.clip(x, min=low),
        bmm=paddle.bmm,
        avg_pool=lambda x, k: F.avg_pool2d(x, k),
    )


def _torch_ops() -> Ops:
    import torch
    import torch.nn.functional as F

    return Ops(
        to_float=lambda x: x.float(),
        amin=lambda x, axis, keep: x.amin(dim=axis, keepdim=keep),
        amax=lambda x, axis, keep: x.amax(dim=axis, keepdim=keep),
        sum=lambda x, axis: x.sum(dim=axis),
        cumsum=lambda x, axis: torch.cumsum(x, dim=axis),
        arange=lambda start, stop, like: torch.arange(start, stop, dtype=torch.float32,
                                                      device=like.device),
        concat=lambda xs, axis: torch.cat(xs, dim=axis),
        stack=lambda xs, axis: torch.stack(xs, dim=axis),
        unsqueeze=lambda x, axis: x.unsqueeze(axis),
        where=torch.where,
        full_like=torch.full_like,
        zeros_like=torch.zeros_like,
        clip_min=lambda x, low: torch.clamp(x, min=low),
        bmm=torch.bmm,
        avg_pool=lambda x, k: F.avg_pool2d(x, k),
    )


def _numpy_ops() -> Ops:
    import numpy as np

    def avg_pool(x: Any, k: int) -> Any:
        b, c, h, w = x.shape
        return x.reshape(b, c, h // k, k, w // k, k).mean(axis=(3, 5), dtype=np.float32)

    return Ops(
        to_float=lambda x: np.asarray(x, dtype=np.float32),
        amin=lambda x, axis, keep: x.min(axis=axis, keepdims=keep),
        amax=lambda x, axis, keep: x.max(axis=axis, keepdims=keep),
        sum=lambda x, axis: x.sum(axis=axis, dtype=np.float32),
        cumsum=lambda x, axis: np.cumsum(x, axis=axis, dtype=np.float32),
        arange=lambda start, stop, like: np.arange(start, stop, dtype=np.float32),
        concat=lambda xs, axis: np.concatenate(xs, axis=axis),
        stack=lambda xs, axis: np.stack(xs, axis=axis),
        unsqueeze=np.expand_dims,
        where=np.where,
        full_like=lambda x, v: np.full_like(x, v, dtype=np.float32),
        zeros_like=lambda x: np.zeros_like(x, dtype=np.float32),
        clip_min=lambda x, low: np.maximum(x, np.float32(low)),
        bmm=np.matmul,
        avg_pool=avg_pool,
    )


_BUILDERS = {"paddle": _paddle_ops, "torch": _torch_ops, "numpy": _numpy_ops}
_BUILT: dict[str, Ops] = {}


def ops_for(library: str) -> Ops:
    """The `Ops` of "paddle", "torch" or "numpy" (imports that library on first use)."""
    if library not in _BUILT:
        _BUILT[library] = _BUILDERS[library]()
    return _BUILT[library]

"""A stand-in PP-DocLayoutV3/V2: the real architecture with random weights, made offline.

`python -m testkit.layout_model CACHE_HOME [--model PP-DocLayoutV3|PP-DocLayoutV2] [--small]`
writes it where PaddleX looks for the official model once
`PADDLE_PDX_CACHE_HOME=CACHE_HOME` (`CACHE_HOME/official_models/...`), in the formats its
engines load:

- `<name>/`: `inference.json` + `inference.pdiparams` (paddle static, the engine the
  pipeline picks by default);
- `<name>_safetensors/`: `model.safetensors` + `config.json` (paddle dynamic, where PaddleX
  builds the model from its own code).

No ONNX: paddle2onnx 2.1.0 aborts on this graph ("unsupported operators", none named) with
paddle 3.3.1, so PaddleX's onnxruntime engine cannot be fed here.

Each folder has the official `inference.yml` (PaddleX's own metadata: 800x800 input, the 25
labels), so PaddleX's own pre- and postprocessing run unchanged.

Why the detections follow the page and still cost what the real model costs: the network is
`PPDocLayoutV3(PPDocLayoutV3Config())` from PaddleX's modeling code (33.2 M parameters at
the default shapes), and its whole forward pass, reading-order head and postprocess run on
every page. Random weights would find no layout, so two things are changed, neither of which
touches the work the network does:

- the class heads' biases are set to -20, so the network's own 300 queries all score below
  any threshold (the topk over them is unchanged: a constant shift keeps the order);
- the exported static graph appends up to `MAX_BLOCKS` rows found from the page's ink
  (`ink_blocks`: dark cells of an 8x8-pixel grid of the 800x800 input, bands of inked cell
  rows separated by an empty one, each band a block; its label from its geometry: a dense
  band is an image, one crossed by 3+ long horizontal rules a table, a centred single line a
  formula or (first on the page) the title, a short single line a heading, a narrow line at
  the very bottom a page number, else text). These rows go through PaddleX's postprocess
  (threshold, NMS, reading order) like the network's would. That analysis is a few pooling
  and matrix ops on a 100x100 grid: ~20 ms a page on a 2-core VM, under 1% of the real
  forward pass there (4-6 s), the same for every contender, and deterministic: the same page
  gives the same blocks on every run.

The dynamic engine runs PaddleX's own class, which cannot carry the ink rows: there it finds
no blocks (same forward cost, an empty postprocess). Use it only to time the model.

`--small` writes a reduced network (narrow backbone, one encoder/decoder layer, 100 queries)
for tests that exercise the layout path, not the model's cost; the detections are the same.
The stand-in is test-kit only and never ships in the wheel.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

MODELS = ("PP-DocLayoutV3", "PP-DocLayoutV2")
INPUT_SIZE = 800  # the official inference.yml resizes every page to 800x800
CELL = 8  # pixels of the 800x800 input per grid cell
GRID = INPUT_SIZE // CELL
MAX_BLOCKS = 48  # ink bands kept per page (the top ones; real pages have 5-40 blocks)
DARK = 0.5  # input is scaled to [0, 1]: darker than this in every channel is ink
OCCUPIED = 1.0 / 64  # a cell with at least one dark pixel holds ink
RULE = 41  # a horizontal dark run this long (input pixels) is a ruling line, never a glyph
HEAD_BIAS = -20.0  # sigmoid(-20) ~ 2e-9: the random network's own queries never pass
SCORE = 0.9
# Label indices in the official label list (PaddleX's `_LABEL_DOC_LAYOUT_V2V3`).
LABELS = {"display_formula": 5, "doc_title": 6, "image": 14, "number": 16,
          "paragraph_title": 17, "table": 21, "text": 22}

SMALL_BACKBONE = {
    "model_type": "hgnet_v2", "num_channels": 3, "embedding_size": 16,
    "hidden_sizes": [32, 64, 128, 256], "hidden_act": "relu", "num_labels": 0,
    "stem_channels": [3, 16, 16], "stem_strides": [2, 1, 1, 2, 1],
    "stage_in_channels": [16, 32, 64, 128], "stage_mid_channels": [16, 16, 32, 64],
    "stage_out_channels": [32, 64, 128, 256], "stage_num_blocks": [1, 1, 1, 1],
    "stage_downsample": [False, True, True, True], "stage_downsample_strides": [2, 2, 2, 2],
    "stage_light_block": [False, False, True, True], "stage_kernel_size": [3, 3, 5, 5],
    "stage_numb_of_layers": [1, 1, 1, 1], "use_learnable_affine_block": False,
}  # fmt: skip
SMALL = {
    "backbone_config": SMALL_BACKBONE, "encoder_in_channels": [64, 128, 256],
    "encoder_hidden_dim": 64, "encoder_ffn_dim": 128, "encoder_attention_heads": 2,
    "d_model": 64, "decoder_in_channels": [64, 64, 64], "decoder_ffn_dim": 128,
    "decoder_layers": 1, "decoder_attention_heads": 2, "num_queries": 100,
    "mask_feature_channels": [16, 16], "x4_feat_dim": 32, "num_prototypes": 8,
    "global_pointer_head_size": 16,
}  # fmt: skip


def _paddlex_model(name: str, small: bool) -> tuple[Any, dict[str, Any]]:
    """PaddleX's own model class built with random weights, and its config as a dict."""
    from paddlex.modules.base.utils.pdparams2safetensors.model_config import MODEL_CONFIGS

    config = dict(MODEL_CONFIGS[name])
    if name == "PP-DocLayoutV3":
        from paddlex.inference.models.object_detection.modeling import PPDocLayoutV3 as cls
        from paddlex.inference.models.object_detection.modeling._config_pp_doclayout_v3 import (
            PPDocLayoutV3Config as config_cls,
        )
    else:
        from paddlex.inference.models.object_detection.modeling import PPDocLayoutV2 as cls
        from paddlex.inference.models.object_detection.modeling._config_pp_doclayout_v2 import (
            PPDocLayoutV2Config as config_cls,
        )
    if small:
        config.update(SMALL)
        if name == "PP-DocLayoutV2":
            config["reading_order_config"] = {
                **config.get("reading_order_config", {}), "hidden_size": 64,
                "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 128}
    model = cls(config_cls(**config))
    model.eval()
    _silence_class_heads(model)
    return model, config


def _silence_class_heads(model: Any) -> None:
    """Push every class head's bias to HEAD_BIAS (see the module docstring)."""
    import paddle

    for key, param in model.named_parameters():
        if key.endswith(".bias") and ("enc_score_head" in key or "class_embed" in key):
            param.set_value(paddle.full(param.shape, HEAD_BIAS, dtype=param.dtype))


def ink_blocks(image: Any, scale_factor: Any) -> Any:
    """[B, MAX_BLOCKS, 8] detection rows (label, score, x1, y1, x2, y2, order, votes) in the
    page's own pixels, found from the ink of `image` ([B, 3, 800, 800] scaled to [0, 1]);
    empty slots score 0. `scale_factor` is [B, 2]: (800 / page height, 800 / page width)."""
    import paddle
    import paddle.nn.functional as F

    dark = (image.min(axis=1, keepdim=True) < DARK).astype("float32")  # [B, 1, 800, 800]
    cells = F.avg_pool2d(dark, CELL)[:, 0]  # [B, G, G]: share of dark pixels per cell
    occupied = (cells >= OCCUPIED).astype("float32")
    rows = occupied.max(axis=2)  # [B, G]
    above = paddle.concat([paddle.zeros_like(rows[:, :1]), rows[:, :-1]], axis=1)
    band = paddle.cumsum(rows * (1 - above), axis=1) * rows  # 1, 2, ... per inked run; 0 gap
    numbers = paddle.arange(1, MAX_BLOCKS + 1, dtype="float32").reshape([1, MAX_BLOCKS, 1])
    member = (band.unsqueeze(1) == numbers).astype("float32")  # [B, K, G]: row in band k
    present = member.max(axis=2)  # [B, K]
    index = paddle.arange(GRID, dtype="float32")
    y1 = (member * index + (1 - member) * GRID).min(axis=2)
    y2 = (member * index).max(axis=2) + 1
    columns = (paddle.bmm(member, occupied) > 0).astype("float32")  # [B, K, G]
    x1 = (columns * index + (1 - columns) * GRID).min(axis=2)
    x2 = (columns * index).max(axis=2) + 1
    inside = ((index >= x1.unsqueeze(2)) & (index < x2.unsqueeze(2))).astype("float32")
    area = member.sum(axis=2) * (x2 - x1)
    ink = (paddle.bmm(member, cells) * inside).sum(axis=2)
    density = ink / paddle.clip(area, min=1.0)
    # Long horizontal dark runs (min-pool along x): table rules, never text strokes.
    runs = -F.max_pool2d(-dark, kernel_size=[1, RULE], stride=1, padding=[0, RULE // 2])
    rule_rows = F.max_pool2d(runs.max(axis=3, keepdim=True), kernel_size=[CELL, 1])[:, 0, :, 0]
    rules = (member * rule_rows.unsqueeze(1)).sum(axis=2)

    height, width, middle = y2 - y1, x2 - x1, (x1 + x2) / 2
    line = height <= 5
    centred = ((middle - GRID / 2).abs() <= 4) & (x1 >= 0.15 * GRID)
    first = numbers[:, :, 0] == 1

    def label(name: str) -> Any:
        return paddle.full_like(y1, LABELS[name])

    kind = label("text")
    for name, where in (  # the last that applies wins
        ("paragraph_title", line & (width <= GRID / 2) & ~centred),
        ("display_formula", line & centred & ~first),
        ("doc_title", line & centred & first),
        ("number", (y1 >= 0.92 * GRID) & (width <= 8) & line),
        ("table", rules >= 3),
        ("image", (density >= 0.3) & (height >= 4)),
    ):
        kind = paddle.where(where, label(name), kind)
    sh, sw = present * CELL / scale_factor[:, 0:1], present * CELL / scale_factor[:, 1:2]
    order = numbers[:, :, 0].expand_as(y1)
    return paddle.stack([kind, present * SCORE, x1 * sw, y1 * sh, x2 * sw, y2 * sh, order,
                         paddle.zeros_like(y1)], axis=2)


def _detect(network: Any, im_shape: Any, image: Any, scale_factor: Any) -> Any:
    """`network.forward` (PaddleX's PPDocLayoutV3/V2), line for line, except for the padded
    shape, which those forwards build from the batch size as a Python list (not traceable with
    a variable batch) and their postprocess ignores ("origin" box decoding)."""
    import paddle
    import paddle.nn.functional as F

    outputs = network.model(image)
    boxes = outputs["intermediate_reference_points"][:, -1]
    logits = outputs["intermediate_logits"][:, -1]
    if "out_order_logits" in outputs:  # V3: the order comes from the decoder
        rows, _ = network.post_process((boxes, logits), outputs["out_order_logits"][:, -1],
                                       im_shape, scale_factor, im_shape)
        return rows
    # V2: a reading-order model over the queries that pass their class's threshold
    centres, sizes = boxes.split(2, axis=-1)
    corners = paddle.concat([centres - 0.5 * sizes, centres + 0.5 * sizes], axis=-1) * 1000
    corners = corners.clip(0.0, 1000.0)
    class_ids = logits.argmax(axis=-1)
    thresholds = paddle.index_select(
        paddle.to_tensor(network.config.class_thresholds, dtype="float32"),
        class_ids.flatten(), axis=0).reshape(class_ids.shape)
    mask = F.sigmoid(logits.max(axis=-1)) >= thresholds
    indices = paddle.argsort(mask.astype("int32"), axis=1, descending=True)

    def take(x: Any) -> Any:
        return paddle.take_along_axis(x, indices.unsqueeze(-1).expand([-1, -1, x.shape[-1]]),
                                      axis=1)

    sorted_mask = paddle.take_along_axis(mask.astype("int32"), indices, axis=1).astype("bool")
    sorted_ids = paddle.take_along_axis(class_ids, indices, axis=1)
    pad_boxes = paddle.where(sorted_mask.unsqueeze(-1), take(corners),
                             paddle.zeros_like(take(corners)))
    pad_ids = paddle.where(sorted_mask, sorted_ids, paddle.zeros_like(sorted_ids))
    pad_ids = paddle.index_select(paddle.to_tensor(network.config.class_order, dtype="int32"),
                                  pad_ids.flatten(), axis=0).reshape(pad_ids.shape)
    order_logits = network.reading_order(boxes=pad_boxes, labels=pad_ids, mask=sorted_mask)
    order_logits = order_logits[:, :, :network.num_queries]
    rows, _, _ = network.post_process((take(boxes), take(logits), None), order_logits,
                                      im_shape, scale_factor, im_shape)
    return rows


def _traceable_attention(network: Any) -> None:
    """Give the decoder's deformable attention a forward that traces to a static graph.

    PaddleX's `MultiScaleDeformableAttention.forward` transposes a 5-D tensor with a 4-axis
    permutation and reshapes to batch x heads, which eager Paddle tolerates and a static graph
    with a variable batch rejects; this is the same computation, op for op, with the
    permutation spelt out and the batch left to the reshape (-1).
    """
    import paddle
    import paddle.nn.functional as F

    def forward(value: Any, value_spatial_shapes: Any, value_spatial_shapes_list: Any,
                level_start_index: Any, sampling_locations: Any, attention_weights: Any,
                im2col_step: Any) -> Any:
        _, _, num_heads, hidden_dim = value.shape
        _, num_queries, num_heads, num_levels, num_points, _ = sampling_locations.shape
        value_list = paddle.split(value, [h * w for h, w in value_spatial_shapes_list], axis=1)
        sampling_grids = 2 * sampling_locations - 1
        sampled = []
        for level, (height, width) in enumerate(value_spatial_shapes_list):
            value_l = value_list[level].flatten(2).transpose([0, 2, 1]).reshape(
                [-1, hidden_dim, height, width])
            grid_l = sampling_grids[:, :, :, level].transpose([0, 2, 1, 3, 4]).reshape(
                [-1, num_queries, num_points, 2])
            sampled.append(F.grid_sample(value_l, grid_l, mode="bilinear",
                                         padding_mode="zeros", align_corners=False))
        weights = attention_weights.transpose([0, 2, 1, 3, 4]).reshape(
            [-1, 1, num_queries, num_levels * num_points])
        output = (paddle.stack(sampled, axis=-2).flatten(-2) * weights).sum(-1).reshape(
            [-1, num_heads * hidden_dim, num_queries])
        return output.transpose([0, 2, 1])

    for layer in network.model.decoder.layers:
        layer.encoder_attn.attn.forward = forward


def _graph(name: str, small: bool) -> Any:
    """The network as one layer taking (im_shape, image, scale_factor), the official static
    model's inputs, and answering [rows, rows per image] with the ink rows appended."""
    import paddle

    network, _ = _paddlex_model(name, small)
    _traceable_attention(network)

    class StandIn(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.network = network

        def forward(self, im_shape: Any, image: Any, scale_factor: Any) -> list[Any]:
            rows = _detect(self.network, im_shape, image, scale_factor)
            batch = image.shape[0]
            rows = rows.reshape([batch, -1, rows.shape[-1]])
            rows = paddle.concat([ink_blocks(image, scale_factor), rows], axis=1)
            count = paddle.full([batch], rows.shape[1], dtype="int32")
            return [rows.reshape([-1, rows.shape[-1]]), count]

    layer = StandIn()
    layer.eval()
    return layer


def _metadata(name: str) -> dict[str, Any]:
    """The official inference.yml contents (PaddleX's own)."""
    from paddlex.modules.base.utils.pdparams2safetensors.inference_meta import (
        build_inference_meta,
    )

    return {"Global": {"model_name": name}, **build_inference_meta(name)}


def _write_yaml(folder: Path, name: str) -> None:
    import yaml

    text = yaml.safe_dump(_metadata(name), default_flow_style=False, allow_unicode=True)
    (folder / "inference.yml").write_text(text, encoding="utf-8")


def _input_spec() -> list[Any]:
    from paddle.static import InputSpec

    return [InputSpec([None, 2], "float32", "im_shape"),
            InputSpec([None, 3, INPUT_SIZE, INPUT_SIZE], "float32", "image"),
            InputSpec([None, 2], "float32", "scale_factor")]


def write_static(folder: Path, name: str, small: bool) -> None:
    """`inference.json` + `inference.pdiparams` + `inference.yml` (paddle static)."""
    import paddle

    folder.mkdir(parents=True, exist_ok=True)
    layer = paddle.jit.to_static(_graph(name, small), input_spec=_input_spec(), full_graph=True)
    paddle.jit.save(layer, str(folder / "inference"))
    _write_yaml(folder, name)


def write_safetensors(folder: Path, name: str, small: bool) -> None:
    """`model.safetensors` + `config.json` + `inference.yml` (paddle dynamic)."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    network, config = _paddlex_model(name, small)
    state = {k: v.numpy() for k, v in network.get_hf_state_dict().items()}
    transposed = set(network.get_transpose_weight_keys())
    state = {k: (v.T.copy() if k in transposed else v) for k, v in state.items()}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    _write_yaml(folder, name)


def write(cache_home: Path, name: str = "PP-DocLayoutV3", *, small: bool = False) -> Path:
    """Write the stand-in under `cache_home/official_models`; returns the static folder."""
    import paddle

    paddle.seed(0)  # the same weights on every run
    models = cache_home / "official_models"
    static = models / name
    write_static(static, name, small)
    write_safetensors(models / f"{name}_safetensors", name, small)
    return static


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testkit.layout_model",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("cache_home", type=Path, help="what PADDLE_PDX_CACHE_HOME will be")
    parser.add_argument("--model", choices=MODELS, default=MODELS[0])
    parser.add_argument("--small", action="store_true",
                        help="a reduced network for tests (same detections, far cheaper)")
    args = parser.parse_args(argv)
    folder = write(args.cache_home, args.model, small=args.small)
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())

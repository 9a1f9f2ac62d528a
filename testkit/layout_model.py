"""A stand-in PP-DocLayoutV3/V2: the real architecture with random weights, made offline.

`python -m testkit.layout_model CACHE_HOME [--model PP-DocLayoutV3|PP-DocLayoutV2] [--small]
[--format paddle|transformers|all]` writes it where PaddleX looks for the official model once
`PADDLE_PDX_CACHE_HOME=CACHE_HOME` (`CACHE_HOME/official_models/...`), in the formats its
engines load:

- `<name>/`: `inference.json` + `inference.pdiparams` (paddle static, the engine the
  pipeline picks by default). Written by `--format paddle` (the default) and `all`; needs
  paddle.
- `<name>_safetensors/`: Hugging Face's layout, as the official `PaddlePaddle/<name>_safetensors`
  repository has it: `config.json` (the official config, `PPDocLayoutV3ForObjectDetection`,
  model_type `pp_doclayout_v3`, the 25-label id2label), `model.safetensors` (Hugging Face's
  key names), `preprocessor_config.json` (the official 800x800 bicubic resize, scaled to
  [0, 1], no mean/std) and PaddleX's `inference.yml`. Two engines load this one folder:
  PaddleX's `transformers` engine (`AutoImageProcessor` + `AutoModelForObjectDetection`
  .from_pretrained of the folder: transformers' own `PPDocLayoutV3ForObjectDetection`) and
  its `paddle_dynamic` engine (PaddleX's own class, `convert_from_hf=True`). `--format
  transformers` (and `all`) builds it with transformers' class (needs torch + transformers,
  no paddle: the GPU machine's case); `--format paddle` with PaddleX's class (needs paddle).
  The two writers give the same keys and shapes.

No ONNX: paddle2onnx 2.1.0 aborts on this graph ("unsupported operators", none named) with
paddle 3.3.1, so PaddleX's onnxruntime engine cannot be fed here.

Every folder has the official `inference.yml` (PaddleX's own metadata: 800x800 input, the 25
labels), so PaddleX's own pre- and postprocessing run unchanged.

Why the detections follow the page and still cost what the real model costs: the network is
the real one at the official shapes (33.2 M parameters for V3), and its whole forward pass,
reading-order head and postprocess run on every page. Random weights would find no layout, so
two things are changed, neither of which touches the work the network does:

- the class heads' biases are set to -20, so the network's own queries all score below any
  threshold (the topk over them is unchanged: a constant shift keeps the order);
- up to `MAX_BLOCKS` rows found from the page's ink (`testkit.layout_ink.ink_blocks`, one
  implementation for paddle and torch: bands of inked rows of an 8x8-pixel grid of the
  800x800 input, each band a block, labelled from its geometry) are added to the network's
  own detections before PaddleX's postprocess (threshold, NMS, reading order), which treats
  them like the network's. A few ms a page (7 ms on one core of a 2-core VM in torch, about
  0.3% of the forward pass there), the same for every contender, and deterministic: the
  same page gives the same blocks.

  Paddle static: the exported graph appends them itself. Transformers: the folder's
  `config.json` carries `"ocrvl_stand_in": true`, and the opt-in hook of
  `testkit.layout_standin` (active only where `testkit/layout_standin_site` is on
  PYTHONPATH: its `sitecustomize`) adds them in the image processor's
  `post_process_object_detection`, from the `pixel_values` the model saw; the model's forward
  runs unchanged. Without the hook (or for any model without the marker) nothing changes:
  the transformers engine then finds no blocks, like paddle dynamic, which runs PaddleX's own
  class and cannot carry the rows (same forward cost, an empty postprocess: use those only
  to time the model).

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

from testkit.layout_ink import INPUT_SIZE, ink_blocks, ops_for
from testkit.layout_standin import MARKER

MODELS = ("PP-DocLayoutV3", "PP-DocLayoutV2")
FORMATS = ("paddle", "transformers", "all")
HEAD_BIAS = -20.0  # sigmoid(-20) ~ 2e-9: the random network's own queries never pass
# The official preprocessor_config.json of the `_safetensors` repositories (transformers'
# PPDocLayoutV3/V2ImageProcessor defaults): 800x800 bicubic, x 1/255, mean 0, std 1.
PREPROCESSOR = {
    "do_resize": True, "size": {"height": INPUT_SIZE, "width": INPUT_SIZE}, "resample": 3,
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0],
}  # fmt: skip

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


def official_config(name: str, small: bool) -> dict[str, Any]:
    """The official config.json of `<name>_safetensors` (PaddleX's copy), reduced by `--small`.
    Importing it needs paddlex, not paddle."""
    from paddlex.modules.base.utils.pdparams2safetensors.model_config import MODEL_CONFIGS

    config = dict(MODEL_CONFIGS[name])
    if small:
        # The official backbone's other keys stay: which stages it returns (transformers
        # reads them; PaddleX's class takes them as its default).
        config.update(SMALL, backbone_config={**config["backbone_config"], **SMALL_BACKBONE})
        if name == "PP-DocLayoutV2":
            config["reading_order_config"] = {
                **config.get("reading_order_config", {}), "hidden_size": 64,
                "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 128}
    return config


def _paddlex_model(name: str, small: bool) -> tuple[Any, dict[str, Any]]:
    """PaddleX's own model class built with random weights, and its config as a dict."""
    config = official_config(name, small)
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
    model = cls(config_cls(**config))
    model.eval()
    _silence_class_heads(model)
    return model, config


def _is_class_head_bias(key: str) -> bool:
    return key.endswith(".bias") and ("enc_score_head" in key or "class_embed" in key)


def _silence_class_heads(model: Any) -> None:
    """Push every class head's bias to HEAD_BIAS (see the module docstring)."""
    import paddle

    for key, param in model.named_parameters():
        if _is_class_head_bias(key):
            param.set_value(paddle.full(param.shape, HEAD_BIAS, dtype=param.dtype))


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
    ops = ops_for("paddle")  # outside the traced code

    class StandIn(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.network = network

        def forward(self, im_shape: Any, image: Any, scale_factor: Any) -> list[Any]:
            rows = _detect(self.network, im_shape, image, scale_factor)
            batch = image.shape[0]
            rows = rows.reshape([batch, -1, rows.shape[-1]])
            ink = ink_blocks(image, scale_factor, ops)
            rows = paddle.concat([ink, rows], axis=1)
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


def _write_hf_extras(folder: Path, name: str) -> None:
    """What the `_safetensors` folder holds besides the weights and config: the image
    processor's config and PaddleX's inference.yml."""
    processor = {"image_processor_type": f"{_hf_prefix(name)}ImageProcessor", **PREPROCESSOR}
    (folder / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n",
                                                     encoding="utf-8")
    _write_yaml(folder, name)


def _hf_prefix(name: str) -> str:
    """transformers' class prefix: "PPDocLayoutV3" for "PP-DocLayoutV3"."""
    return name.replace("-", "")


def write_safetensors(folder: Path, name: str, small: bool) -> None:
    """The `_safetensors` folder built with PaddleX's class (needs paddle)."""
    import paddle
    from safetensors.numpy import save_file

    paddle.seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    network, config = _paddlex_model(name, small)
    state = {k: v.numpy() for k, v in network.get_hf_state_dict().items()}
    transposed = set(network.get_transpose_weight_keys())
    state = {k: (v.T.copy() if k in transposed else v) for k, v in state.items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {**config, MARKER: True}
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    _write_hf_extras(folder, name)


def transformers_model(name: str, small: bool) -> Any:
    """transformers' own `PPDocLayoutV3ForObjectDetection` (or V2) from the official config,
    random weights, class heads silenced, marked as the stand-in (needs torch +
    transformers, not paddle)."""
    import torch
    import transformers

    prefix = _hf_prefix(name)
    config_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix}ForObjectDetection")
    torch.manual_seed(0)  # the same weights on every run
    config = config_cls(**official_config(name, small))
    setattr(config, MARKER, True)
    model = model_cls(config).eval()
    with torch.no_grad():
        for key, param in model.named_parameters():
            if _is_class_head_bias(key):
                param.fill_(HEAD_BIAS)
    return model


def write_transformers(folder: Path, name: str, small: bool) -> None:
    """The `_safetensors` folder built with transformers' class (torch, no paddle)."""
    folder.mkdir(parents=True, exist_ok=True)
    transformers_model(name, small).save_pretrained(str(folder))
    _write_hf_extras(folder, name)


def written(cache_home: Path) -> bool:
    """Whether `cache_home` holds a layout model's weights: its folder alone does not say, as
    PaddleX makes it (and `official_models/`) as its cache whenever it is pointed there."""
    return any(cache_home.glob("official_models/*_safetensors/model.safetensors"))


def write(cache_home: Path, name: str = "PP-DocLayoutV3", *, small: bool = False,
          fmt: str = "paddle") -> Path:
    """Write the stand-in under `cache_home/official_models` in format `fmt` (`FORMATS`);
    returns the folder written last (paddle: the static one)."""
    models = cache_home / "official_models"
    static, hf = models / name, models / f"{name}_safetensors"
    if fmt in ("transformers", "all"):
        write_transformers(hf, name, small)
    if fmt in ("paddle", "all"):
        import paddle

        paddle.seed(0)  # the same weights on every run
        write_static(static, name, small)
        if fmt == "paddle":
            write_safetensors(hf, name, small)
        return static
    return hf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testkit.layout_model",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("cache_home", type=Path, help="what PADDLE_PDX_CACHE_HOME will be")
    parser.add_argument("--model", choices=MODELS, default=MODELS[0])
    parser.add_argument("--small", action="store_true",
                        help="a reduced network for tests (same detections, far cheaper)")
    parser.add_argument("--format", choices=FORMATS, default=FORMATS[0],
                        help="paddle: <name>/ (static) and <name>_safetensors/ made with "
                             "paddle; transformers: <name>_safetensors/ made with torch, no "
                             "paddle needed; all: both folders, the latter made with torch")
    args = parser.parse_args(argv)
    folder = write(args.cache_home, args.model, small=args.small, fmt=args.format)
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A PaddleOCR-VL-0.9B-shaped model dir without weights, for `vllm serve --load-format dummy`.

For machines that cannot reach the model hub: the published config's shapes (so vLLM's
memory use and speed are the real model's), a synthetic byte-fallback BPE tokenizer whose
special tokens sit at the real ERNIE-4.5 ids, paddlex's chat template and an image-processor
shim (`model_files/`). Random weights emit no text and never EOS by themselves: serve with
the `bench.gpu.answer_lengths` logits processor, which makes every answer read like text
(`char_tokens`: one token a character) and end at a realistic length.

    python -m bench.gpu.dummy_model DIR
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

FILES = Path(__file__).resolve().parent / "model_files"
VOCAB = 103424
SPECIAL = {  # the real PaddleOCR-VL / ERNIE-4.5 ids
    "<unk>": 0, "<s>": 1, "</s>": 2,
    "<|end_of_sentence|>": 100272, "<|begin_of_sentence|>": 100273,
    "<|IMAGE_PLACEHOLDER|>": 100295, "<|video_pad|>": 100296,
    "<|IMAGE_START|>": 101305, "<|IMAGE_END|>": 101306,
}  # fmt: skip
MAX_PIXELS = 1003520
MIN_PIXELS = 112896


def vocabulary() -> dict[str, int]:
    """Special tokens at their ids, then byte-fallback and printable ASCII, then fillers."""
    vocab = dict(SPECIAL)
    taken = set(SPECIAL.values())
    free = (i for i in range(VOCAB) if i not in taken)
    pool = [f"<0x{b:02X}>" for b in range(256)] + [chr(c) for c in range(33, 127)] + ["\u2581"]
    for token in pool:
        vocab[token] = next(free)
    for k, i in enumerate(free):
        vocab[f"<unused_{k}>"] = i
    return vocab


def char_tokens(text: str, vocab: dict[str, int] | None = None) -> list[int]:
    """`text` as this tokenizer's ids, one per character: printable ASCII as itself, the space
    as `\u2581` (decoded as a space), other characters (the newline) as their UTF-8 bytes'
    byte-fallback tokens (`<0x0A>`)."""
    vocab = vocabulary() if vocab is None else vocab
    ids: list[int] = []
    for c in text:
        if c == " ":
            ids.append(vocab["\u2581"])
        elif 33 <= ord(c) < 127:
            ids.append(vocab[c])
        else:
            ids.extend(vocab[f"<0x{b:02X}>"] for b in c.encode("utf-8"))
    return ids


def tokenizer_json() -> dict[str, Any]:
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}
             for t, i in sorted(SPECIAL.items(), key=lambda x: x[1])]  # fmt: skip
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581",
                          "prepend_scheme": "first", "split": False},
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocabulary(), "merges": []},
    }  # fmt: skip


TOKENIZER_CONFIG: dict[str, Any] = {
    "tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
    "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>",
    "cls_token": "<|begin_of_sentence|>", "sep_token": "<|end_of_sentence|>",
    "extra_special_tokens": {"image_token": "<|IMAGE_PLACEHOLDER|>"},
    "clean_up_tokenization_spaces": False, "model_max_length": 131072,
    "processor_class": "PaddleOCRVLProcessor",
}  # fmt: skip

CONFIG: dict[str, Any] = {  # hub-style flat text fields + vision_config: the 0.9B's shapes
    "architectures": ["PaddleOCRVLForConditionalGeneration"], "model_type": "paddleocr_vl",
    "vocab_size": VOCAB, "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 18, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05, "use_bias": False, "rope_theta": 500000,
    "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    "image_token_id": 100295, "video_token_id": 100296,
    "vision_start_token_id": 101305, "vision_end_token_id": 101306, "torch_dtype": "bfloat16",
    "vision_config": {"model_type": "paddleocr_vl_vision", "hidden_size": 1152,
                      "intermediate_size": 4304, "num_hidden_layers": 27,
                      "num_attention_heads": 16, "num_channels": 3, "image_size": 384,
                      "patch_size": 14, "hidden_act": "gelu_pytorch_tanh",
                      "layer_norm_eps": 1e-06, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "tokens_per_second": 2},
}  # fmt: skip

PREPROCESSOR: dict[str, Any] = {
    "image_processor_type": "PaddleOCRVLImageProcessor",
    "processor_class": "PaddleOCRVLProcessor",
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255,
    "resample": 3, "patch_size": 14, "merge_size": 2, "temporal_patch_size": 1,
    "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
    # vLLM's trust_remote_code branch expects .min_pixels/.max_pixels (the hub's layout)
    "auto_map": {
        "AutoImageProcessor": "image_processing_paddleocr_vl.PaddleOCRVLImageProcessorCompat"
    },
}  # fmt: skip


def write_model_dir(out: Path) -> Path:
    """Write the model dir (no weights) into `out`; returns `out`."""
    out.mkdir(parents=True, exist_ok=True)

    def dump(name: str, data: Any) -> None:
        (out / name).write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")

    dump("tokenizer.json", tokenizer_json())
    dump("tokenizer_config.json", TOKENIZER_CONFIG)
    dump("special_tokens_map.json", {k: TOKENIZER_CONFIG[k] for k in (
        "bos_token", "eos_token", "unk_token", "pad_token", "cls_token", "sep_token")})  # fmt: skip
    dump("config.json", CONFIG)
    dump("generation_config.json", {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    dump("preprocessor_config.json", PREPROCESSOR)
    for name in ("chat_template.jinja", "image_processing_paddleocr_vl.py"):
        shutil.copy(FILES / name, out / name)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m bench.gpu.dummy_model OUT_DIR")
    print("wrote", write_model_dir(Path(sys.argv[1])))

"""The stand-in layout model's detections in PaddleX's transformers engine: an opt-in hook.

PaddleX's transformers engine loads the `_safetensors` folder with transformers' stock
classes (`AutoModelForObjectDetection`, `AutoImageProcessor`; no remote code: PaddleX passes
`trust_remote_code` only where an engine_config asks, and ocrvl never does), so the stand-in's
ink rows (`testkit.layout_ink.ink_blocks`) cannot live in the folder. This hook adds them,
only in processes that opt in, only for a model whose config carries `"ocrvl_stand_in":
true` (`testkit.layout_model.MARKER`):

- `PPDocLayoutV3ForObjectDetection.forward` (and V2's) runs unchanged; for a marked model its
  output keeps a reference to the `pixel_values` it was given (no copy, no extra work);
- the image processor's `post_process_object_detection` runs unchanged, then, for an output
  that carries those pixels, appends the ink rows of each page (label, score, box in the
  page's pixels, a rectangle as its polygon) ahead of the network's own detections, with
  reading-order positions before theirs, and drops those under the call's threshold as it
  does (and the empty slots). PaddleX's own layout postprocess (per-class threshold, NMS,
  reading order, merging) then runs on them as on any detection.

Opting in: put `testkit/layout_standin_site` on PYTHONPATH (its `sitecustomize` calls
`install()`), or call `install()` before transformers loads these modules. `install()` only
adds a finder to `sys.meta_path` that patches the two transformers modules when (and if)
they are imported: it imports neither transformers nor torch, so a process that never loads
the layout model pays nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

MARKER = "ocrvl_stand_in"  # the config.json key of the stand-in (testkit.layout_model)
PIXELS = "ocrvl_pixel_values"  # where a marked model's output keeps its input
_PACKAGE = "transformers.models.pp_doclayout_{version}"


def _patch_model(module: ModuleType, version: str) -> None:
    cls = getattr(module, f"PPDocLayout{version.upper()}ForObjectDetection", None)
    if cls is None or getattr(cls.forward, "_ocrvl_stand_in", False):
        return
    original = cls.forward

    def forward(self: Any, pixel_values: Any = None, *args: Any, **kwargs: Any) -> Any:
        outputs = original(self, pixel_values, *args, **kwargs)
        if getattr(self.config, MARKER, False) and pixel_values is not None:
            object.__setattr__(outputs, PIXELS, pixel_values)
        return outputs

    forward.__doc__, forward.__wrapped__ = original.__doc__, original  # type: ignore[attr-defined]
    forward._ocrvl_stand_in = True  # type: ignore[attr-defined]
    cls.forward = forward


def _patch_processor(module: ModuleType, version: str) -> None:
    cls = getattr(module, f"PPDocLayout{version.upper()}ImageProcessor", None)
    if cls is None or getattr(cls.post_process_object_detection, "_ocrvl_stand_in", False):
        return
    original = cls.post_process_object_detection

    def post_process_object_detection(self: Any, outputs: Any, threshold: float = 0.5,
                                      target_sizes: Any = None) -> Any:
        results = original(self, outputs, threshold=threshold, target_sizes=target_sizes)
        pixels = outputs.__dict__.get(PIXELS)
        if pixels is None:
            return results
        return with_ink(results, pixels, threshold, target_sizes)

    post_process_object_detection.__wrapped__ = original  # type: ignore[attr-defined]
    post_process_object_detection._ocrvl_stand_in = True  # type: ignore[attr-defined]
    cls.post_process_object_detection = post_process_object_detection


def with_ink(results: list[dict[str, Any]], pixels: Any, threshold: float,
             target_sizes: Any) -> list[dict[str, Any]]:
    """`results` (post_process_object_detection's, one dict a page) with each page's ink rows
    ahead of the network's detections."""
    import numpy as np
    import torch

    from testkit.layout_ink import INPUT_SIZE, ink_blocks, ops_for

    batch = pixels.shape[0]
    if target_sizes is None:
        sizes = torch.full((batch, 2), float(INPUT_SIZE))
    else:
        sizes = torch.as_tensor(target_sizes, dtype=torch.float32)  # (height, width)
    with torch.inference_mode():
        scale = (INPUT_SIZE / sizes).to(pixels.device)
        rows = ink_blocks(pixels.float(), scale, ops_for("torch")).cpu()
    merged = []
    for page, result in zip(rows, results, strict=True):
        page = page[(page[:, 1] > 0) & (page[:, 1] >= threshold)]  # slots with a block
        extra = {"scores": page[:, 1], "labels": page[:, 0].long(), "boxes": page[:, 2:6],
                 "order_seq": page[:, 6].long() - 1}
        out = dict(result)
        for key, value in extra.items():
            if key in result:
                mine = value.to(device=result[key].device, dtype=result[key].dtype)
                if key == "order_seq":
                    out[key] = torch.cat([mine, result[key] + len(page)])
                else:
                    out[key] = torch.cat([mine, result[key]])
        if "polygon_points" in result:
            corners = [np.array([[x1, y1], [x2, y1], [x2, y2], [x1, y2]], dtype=np.float32)
                       for x1, y1, x2, y2 in page[:, 2:6].tolist()]
            out["polygon_points"] = corners + list(result["polygon_points"])
        merged.append(out)
    return merged


_PATCHES = {
    **{f"{_PACKAGE.format(version=v)}.modeling_pp_doclayout_{v}": (_patch_model, v)
       for v in ("v2", "v3")},
    **{f"{_PACKAGE.format(version=v)}.image_processing_pp_doclayout_{v}": (_patch_processor, v)
       for v in ("v2", "v3")},
}


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the patch."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader, self._name = loader, name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        patch, version = _PATCHES[self._name]
        patch(module, version)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the patched modules through the other finders and wraps their loader."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


def install() -> None:
    """Patch the layout classes when transformers loads them (now, if it already has)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    for name, (patch, version) in _PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name], version)

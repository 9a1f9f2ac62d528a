"""Remote-code shim so that `--trust-remote-code` works with transformers>=5's native
PaddleOCR-VL classes: vLLM's paddleocr_vl.py reads `image_processor.max_pixels` and
`size["min_pixels"/"max_pixels"]` when trust_remote_code is on (the hub's remote-code layout)."""

from transformers.models.paddleocr_vl.image_processing_paddleocr_vl import (
    PaddleOCRVLImageProcessor,
)


class PaddleOCRVLImageProcessorCompat(PaddleOCRVLImageProcessor):
    def __init__(self, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.min_pixels = self.size.shortest_edge
        self.max_pixels = self.size.longest_edge
        self.size.min_pixels = self.size.shortest_edge
        self.size.max_pixels = self.size.longest_edge

"""ocrvl: turn a folder of scanned PDFs into Markdown with PaddleOCR-VL behind a vLLM server."""

__version__ = "0.1.0"

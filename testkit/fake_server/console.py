"""The fake server's vLLM-like console lines on stderr (what ocrvl's supervisor reads)."""

from __future__ import annotations

import sys
import time


def vllm_line(level: str, where: str, message: str) -> str:
    """A line in vLLM's log format, e.g. ``INFO 12-01 22:38:55 [core.py] message``."""
    return f"{level} {time.strftime('%m-%d %H:%M:%S')} [{where}] {message}"


def emit(line: str) -> None:
    """Print one line of vLLM-like console output (what the supervisor parses)."""
    print(line, file=sys.stderr, flush=True)

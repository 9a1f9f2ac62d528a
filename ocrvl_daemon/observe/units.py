"""Rates and durations as people read them, for status lines and logs."""

from __future__ import annotations


def format_rate(pages_per_s: float) -> str:
    """1.6 p/s, 0.24 p/s."""
    return f"{pages_per_s:.1f} p/s" if pages_per_s >= 0.95 else f"{pages_per_s:.2f} p/s"


def format_duration(seconds: float) -> str:
    """45s, 12m05s, 2h41m."""
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def format_bytes(size: int) -> str:
    """512 KiB, 2.9 MiB, 14 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if size >= scale:
            value = size / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{-(-size // 1024)} KiB"


def counted(count: int, noun: str) -> str:
    """1 page, 3 pages."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"

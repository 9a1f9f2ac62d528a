"""The GPU's own counters while a contender runs: utilization and power, once a second."""

from __future__ import annotations

import statistics
from contextlib import AbstractContextManager

from ocrvl_daemon.server.gpu import GpuMonitor, GpuReading

SAMPLE_SECONDS = 1.0


class GpuSampler(AbstractContextManager["GpuSampler"]):
    """Every visible GPU's busy share and power, once a second while in its `with` block."""

    def __init__(self) -> None:
        self._samples: list[tuple[float, float, float]] = []  # (time, busy %, watts), summed
        self._monitor = GpuMonitor(SAMPLE_SECONDS, self._note)

    def __enter__(self) -> GpuSampler:
        self._monitor.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._monitor.stop()

    def _note(self, at: float, readings: list[GpuReading]) -> None:
        if readings and all(r.busy_pct is not None for r in readings):
            # Several GPUs: their mean busy share and their summed power.
            busy = statistics.fmean(r.busy_pct or 0 for r in readings)
            watts = sum(r.power_w or 0.0 for r in readings)
            self._samples.append((at, busy, watts))

    def over(self, start: float, end: float) -> dict[str, float]:
        """Mean GPU busy % and watts between `start` and `end` ({} without a reading)."""
        inside = [(busy, watts) for t, busy, watts in self._samples if start <= t <= end]
        if not inside:
            return {}
        return {"gpu_busy_pct": round(statistics.fmean(b for b, _ in inside), 1),
                "gpu_watts": round(statistics.fmean(w for _, w in inside), 1)}

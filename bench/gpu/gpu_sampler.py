"""The GPU's own counters while a contender runs: utilization and power, once a second."""

from __future__ import annotations

import statistics
import threading
import time

from ocrvl_daemon.server.gpu import read_gpus

SAMPLE_SECONDS = 1.0


class GpuSampler:
    """Samples every visible GPU (NVML, else nvidia-smi) on a thread until `stop()`."""

    def __init__(self) -> None:
        self._samples: list[tuple[float, float, float]] = []  # (time, busy %, watts), summed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            readings = read_gpus()
            if readings and all(r.busy_pct is not None for r in readings):
                # Several GPUs: their mean busy share and their summed power.
                busy = statistics.fmean(r.busy_pct or 0 for r in readings)
                watts = sum(r.power_w or 0.0 for r in readings)
                self._samples.append((time.monotonic(), busy, watts))
            self._stop.wait(SAMPLE_SECONDS)

    def over(self, start: float, end: float) -> dict[str, float]:
        """Mean GPU busy % and watts between `start` and `end` ({} without a reading)."""
        inside = [(busy, watts) for t, busy, watts in self._samples if start <= t <= end]
        if not inside:
            return {}
        return {"gpu_busy_pct": round(statistics.fmean(b for b, _ in inside), 1),
                "gpu_watts": round(statistics.fmean(w for _, w in inside), 1)}

"""What the GPU ocrvl will use looks like right now: name, memory, driver, compute capability,
and how busy it is (utilization, power).

NVML (nvidia-ml-py) is asked first; when it is missing or fails (normal on machines without a
driver, in containers and often under WSL2) `nvidia-smi` is run instead. No GPU is not an
error here: the reading is None and `GpuProbe.problems` says why.
"""

from __future__ import annotations

import csv
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ocrvl_daemon.server import driver_check

log = logging.getLogger(__name__)

NVIDIA_SMI_ENV = "OCRVL_NVIDIA_SMI"  # path of the nvidia-smi to run (tests use a fake one)
NO_NVML_ENV = "OCRVL_NO_NVML"  # "1" skips NVML (tests, or a broken NVML)
NVIDIA_SMI_TIMEOUT = 10.0
# WSL2 ships nvidia-smi here and does not always put it on PATH.
WSL_NVIDIA_SMI = Path("/usr/lib/wsl/lib/nvidia-smi")
OSRELEASE = Path("/proc/sys/kernel/osrelease")
NVIDIA_SMI_FIELDS = (
    "index,uuid,name,memory.total,memory.used,memory.free,driver_version,compute_cap,"
    "utilization.gpu,power.draw"
)
MIB = 1024 * 1024
# nvidia-smi's header: "| NVIDIA-SMI 565.72  Driver Version: 566.36  CUDA Version: 12.7 |".
_SMI_CUDA = re.compile(r"CUDA Version\s*:?\s*(\d+)\.(\d+)")


@dataclass(frozen=True)
class GpuReading:
    """One GPU's identity and memory at the moment it was read (sizes in MiB)."""

    index: int
    uuid: str
    name: str
    total_mib: int
    used_mib: int
    free_mib: int
    driver: str
    compute_capability: tuple[int, int]
    source: Literal["nvml", "nvidia-smi"]
    # How busy it is: the share of the last sample period a kernel ran, and the power drawn
    # (None where the driver does not say).
    busy_pct: int | None = None
    power_w: float | None = None


@dataclass
class GpuProbe:
    """The reading, or None, with the reasons each source gave up (for `ocrvl doctor`)."""

    reading: GpuReading | None
    device: str
    problems: list[str] = field(default_factory=list)


def visible_devices(env: Mapping[str, str] | None = None) -> list[str] | None:
    """The devices CUDA_VISIBLE_DEVICES names, in CUDA's order (indices or UUIDs); None when
    it is unset (every GPU). As CUDA does, the list ends at the first invalid entry."""
    env = os.environ if env is None else env
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    devices: list[str] = []
    for entry in (part.strip() for part in value.split(",")):
        if not entry or entry.startswith("-"):
            break
        devices.append(entry)
    return devices


def selected_device(env: Mapping[str, str] | None = None) -> str | None:
    """The first device CUDA_VISIBLE_DEVICES names (index or UUID); "0" when unset.

    None when the variable hides every GPU (empty, or a negative index), as CUDA treats it.
    """
    devices = visible_devices(env)
    if devices is None:
        return "0"
    return devices[0] if devices else None


def probe_gpu(env: Mapping[str, str] | None = None) -> GpuProbe:
    """Read the selected GPU through NVML, else nvidia-smi."""
    device = selected_device(env)
    if device is None:
        return GpuProbe(None, "", ["CUDA_VISIBLE_DEVICES hides every GPU"])
    probe = GpuProbe(None, device)
    readings = _read_all(env, probe.problems)
    probe.reading = next((r for r in readings if _matches(device, r.index, r.uuid)), None)
    return probe


def read_gpu(env: Mapping[str, str] | None = None) -> GpuReading | None:
    """The selected GPU, or None when there is none (or it cannot be read)."""
    probe = probe_gpu(env)
    if probe.reading is None:
        log.debug("no GPU reading: %s", "; ".join(probe.problems))
    return probe.reading


def read_gpus(env: Mapping[str, str] | None = None) -> list[GpuReading]:
    """Every GPU CUDA_VISIBLE_DEVICES lets a server see, in CUDA's order; [] when none can be
    read."""
    problems: list[str] = []
    devices = visible_devices(env)
    readings = _read_all(env, problems) if devices != [] else []
    if problems and not readings:
        log.debug("no GPU reading: %s", "; ".join(problems))
    if devices is None:
        return readings
    return [next(r for r in readings if _matches(d, r.index, r.uuid)) for d in devices
            if any(_matches(d, r.index, r.uuid) for r in readings)]


def _read_all(env: Mapping[str, str] | None, problems: list[str]) -> list[GpuReading]:
    """Every GPU of the machine through NVML, else nvidia-smi; why each gave up goes to
    `problems`."""
    env = os.environ if env is None else env
    if env.get(NO_NVML_ENV) != "1":
        try:
            readings = _read_nvml()
        except Exception as exc:  # NVML raises its own error types, or is not installed
            problems.append(f"NVML: {exc or type(exc).__name__}")
        else:
            if readings:
                return readings
    smi = _nvidia_smi_path(env)
    if smi is None:
        problems.append("nvidia-smi: not found on PATH")
        return []
    try:
        done = subprocess.run(
            [smi, f"--query-gpu={NVIDIA_SMI_FIELDS}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        problems.append(f"nvidia-smi: {exc}")
        return []
    if done.returncode != 0:
        said = (done.stdout + done.stderr).strip().splitlines()
        problems.append(
            f"nvidia-smi exited with status {done.returncode}: {said[0] if said else 'no output'}"
        )
        return []
    try:
        return parse_nvidia_smi_all(done.stdout)
    except ValueError as exc:
        problems.append(f"nvidia-smi: {exc}")
        return []


def parse_nvidia_smi_all(text: str) -> list[GpuReading]:
    """Every GPU in nvidia-smi's CSV."""
    readings = []
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        if not row:
            continue
        if len(row) not in (8, 10):  # an older nvidia-smi may leave the last two out
            raise ValueError(f"unexpected output line {','.join(row)!r}")
        index, uuid, name, total, used, free, driver, cap = (c.strip() for c in row[:8])
        busy, power = (c.strip() for c in (row[8:] or ["", ""]))
        total_mib, free_mib = _mib(total), _mib(free)
        # WSL2 and some drivers report "[N/A]" for used memory; total - free is the same thing.
        used_mib = _mib(used) if _number(used) else total_mib - free_mib
        major, _, minor = cap.partition(".")
        readings.append(GpuReading(
            index=int(index), uuid=uuid, name=name, total_mib=total_mib, used_mib=used_mib,
            free_mib=free_mib, driver=driver, compute_capability=(int(major), int(minor or 0)),
            source="nvidia-smi", busy_pct=round(float(busy)) if _number(busy) else None,
            power_w=float(power) if _number(power) else None,
        ))
    return readings


def driver_cuda(env: Mapping[str, str] | None = None) -> driver_check.CudaVersion | None:
    """The CUDA version the NVIDIA driver supports, through NVML, else nvidia-smi's header;
    None when neither says."""
    env = os.environ if env is None else env
    if env.get(NO_NVML_ENV) != "1":
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                return driver_check.from_driver_api(pynvml.nvmlSystemGetCudaDriverVersion())
            finally:
                pynvml.nvmlShutdown()
        except Exception as exc:  # NVML raises its own error types, or is not installed
            log.debug("NVML gave no CUDA version: %s", exc or type(exc).__name__)
    smi = _nvidia_smi_path(env)
    if smi is None:
        return None
    try:
        done = subprocess.run([smi], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.debug("nvidia-smi gave no CUDA version: %s", exc)
        return None
    match = _SMI_CUDA.search(done.stdout) if done.returncode == 0 else None
    return (int(match.group(1)), int(match.group(2))) if match else None


def is_wsl(osrelease: str | None = None) -> bool:
    """True under WSL (its kernel release names Microsoft/WSL); `osrelease` is for tests."""
    if osrelease is None:
        try:
            osrelease = OSRELEASE.read_text(encoding="utf-8")
        except OSError:
            return False
    lowered = osrelease.lower()
    return "microsoft" in lowered or "wsl" in lowered


def _read_nvml() -> list[GpuReading]:
    import pynvml

    pynvml.nvmlInit()
    try:
        readings = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            readings.append(GpuReading(
                index=i, uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                name=_text(pynvml.nvmlDeviceGetName(handle)),
                total_mib=int(memory.total) // MIB, used_mib=int(memory.used) // MIB,
                free_mib=int(memory.free) // MIB,
                driver=_text(pynvml.nvmlSystemGetDriverVersion()),
                compute_capability=(int(major), int(minor)), source="nvml",
                busy_pct=_nvml_or_none(lambda h: pynvml.nvmlDeviceGetUtilizationRates(h).gpu,
                                       handle),
                power_w=_nvml_or_none(lambda h: pynvml.nvmlDeviceGetPowerUsage(h) / 1000,
                                      handle),
            ))
        return readings
    finally:
        pynvml.nvmlShutdown()


def _nvml_or_none(read: Callable[[Any], Any], handle: Any) -> Any:
    """A counter the device may not support (NVML raises NotSupported): None then."""
    try:
        return read(handle)
    except Exception:  # pynvml.NVMLError and its many subclasses
        return None


def _matches(device: str, index: int, uuid: str) -> bool:
    # CUDA accepts a unique UUID prefix ("GPU-8932f937") as well as the whole UUID. Indices
    # are compared as nvidia-smi numbers them (PCI bus order): the same as CUDA's on the
    # one-GPU machines ocrvl is for.
    if device.isdigit():
        return int(device) == index
    return uuid.startswith(device)


def _nvidia_smi_path(env: Mapping[str, str]) -> str | None:
    explicit = env.get(NVIDIA_SMI_ENV)
    if explicit:
        return explicit
    found = shutil.which("nvidia-smi")
    if found:
        return found
    return str(WSL_NVIDIA_SMI) if WSL_NVIDIA_SMI.is_file() else None


def _number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def _mib(value: str) -> int:
    if not _number(value):
        raise ValueError(f"memory value {value!r} is not a number")
    return int(float(value))


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py releases return bytes.
    return value.decode() if isinstance(value, bytes) else value


class GpuMonitor:
    """Reads every visible GPU on its own thread every `period` seconds until `stop()`, so
    that nobody waits for a slow nvidia-smi (seconds under WSL2): `latest()` is the last
    reading; `on_reading(time, readings)`, if given, sees each one."""

    def __init__(self, period: float,
                 on_reading: Callable[[float, list[GpuReading]], None] | None = None) -> None:
        self._period = period
        self._on_reading = on_reading
        self._latest: list[GpuReading] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> GpuMonitor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def latest(self) -> list[GpuReading]:
        """The last reading ([] before the first, or without a GPU)."""
        return self._latest  # replaced whole by the thread, never changed in place

    def _run(self) -> None:
        while not self._stop.is_set():
            readings = read_gpus()
            self._latest = readings
            if self._on_reading is not None:
                self._on_reading(time.monotonic(), readings)
            self._stop.wait(self._period)

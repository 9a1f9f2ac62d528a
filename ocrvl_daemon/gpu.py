"""What the GPU ocrvl will use looks like right now: name, memory, driver, compute capability.

NVML (nvidia-ml-py) is asked first; when it is missing or fails (normal on machines without a
driver, in containers and often under WSL2) `nvidia-smi` is run instead. No GPU is not an
error here: the reading is None and `GpuProbe.problems` says why.
"""

from __future__ import annotations

import csv
import logging
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

NVIDIA_SMI_ENV = "OCRVL_NVIDIA_SMI"  # path of the nvidia-smi to run (tests use a fake one)
NO_NVML_ENV = "OCRVL_NO_NVML"  # "1" skips NVML (tests, or a broken NVML)
NVIDIA_SMI_TIMEOUT = 10.0
# WSL2 ships nvidia-smi here and does not always put it on PATH.
WSL_NVIDIA_SMI = Path("/usr/lib/wsl/lib/nvidia-smi")
OSRELEASE = Path("/proc/sys/kernel/osrelease")
NVIDIA_SMI_FIELDS = (
    "index,uuid,name,memory.total,memory.used,memory.free,driver_version,compute_cap"
)
MIB = 1024 * 1024


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


@dataclass
class GpuProbe:
    """The reading, or None, with the reasons each source gave up (for `ocrvl doctor`)."""

    reading: GpuReading | None
    device: str
    problems: list[str] = field(default_factory=list)


def selected_device(env: Mapping[str, str] | None = None) -> str | None:
    """The first device CUDA_VISIBLE_DEVICES names (index or UUID); "0" when unset.

    None when the variable hides every GPU (empty, or a negative index), as CUDA treats it.
    """
    env = os.environ if env is None else env
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return "0"
    first = value.split(",")[0].strip()
    if not first or first.startswith("-"):
        return None
    return first


def probe_gpu(env: Mapping[str, str] | None = None) -> GpuProbe:
    """Read the selected GPU through NVML, else nvidia-smi."""
    env = os.environ if env is None else env
    device = selected_device(env)
    if device is None:
        return GpuProbe(None, "", ["CUDA_VISIBLE_DEVICES hides every GPU"])
    probe = GpuProbe(None, device)
    if env.get(NO_NVML_ENV) != "1":
        try:
            probe.reading = _read_nvml(device)
        except Exception as exc:  # NVML raises its own error types, or is not installed
            probe.problems.append(f"NVML: {exc or type(exc).__name__}")
        if probe.reading is not None:
            return probe
    smi = _nvidia_smi_path(env)
    if smi is None:
        probe.problems.append("nvidia-smi: not found on PATH")
        return probe
    try:
        done = subprocess.run(
            [smi, f"--query-gpu={NVIDIA_SMI_FIELDS}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        probe.problems.append(f"nvidia-smi: {exc}")
        return probe
    if done.returncode != 0:
        said = (done.stdout + done.stderr).strip().splitlines()
        probe.problems.append(
            f"nvidia-smi exited with status {done.returncode}: {said[0] if said else 'no output'}"
        )
        return probe
    try:
        probe.reading = parse_nvidia_smi(done.stdout, device)
    except ValueError as exc:
        probe.problems.append(f"nvidia-smi: {exc}")
    return probe


def read_gpu(env: Mapping[str, str] | None = None) -> GpuReading | None:
    """The selected GPU, or None when there is none (or it cannot be read)."""
    probe = probe_gpu(env)
    if probe.reading is None:
        log.debug("no GPU reading: %s", "; ".join(probe.problems))
    return probe.reading


def parse_nvidia_smi(text: str, device: str) -> GpuReading | None:
    """Pick `device` (index or UUID prefix) out of nvidia-smi's CSV; None if it is not listed."""
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        if not row:
            continue
        if len(row) != 8:
            raise ValueError(f"unexpected output line {','.join(row)!r}")
        index, uuid, name, total, used, free, driver, cap = (c.strip() for c in row)
        if not _matches(device, int(index), uuid):
            continue
        total_mib, free_mib = _mib(total), _mib(free)
        # WSL2 and some drivers report "[N/A]" for used memory; total - free is the same thing.
        used_mib = _mib(used) if _number(used) else total_mib - free_mib
        major, _, minor = cap.partition(".")
        return GpuReading(
            index=int(index), uuid=uuid, name=name, total_mib=total_mib, used_mib=used_mib,
            free_mib=free_mib, driver=driver, compute_capability=(int(major), int(minor or 0)),
            source="nvidia-smi",
        )
    return None


def is_wsl(osrelease: str | None = None) -> bool:
    """True under WSL (its kernel release names Microsoft/WSL); `osrelease` is for tests."""
    if osrelease is None:
        try:
            osrelease = OSRELEASE.read_text(encoding="utf-8")
        except OSError:
            return False
    lowered = osrelease.lower()
    return "microsoft" in lowered or "wsl" in lowered


def _read_nvml(device: str) -> GpuReading | None:
    import pynvml

    pynvml.nvmlInit()
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            if not _matches(device, i, uuid):
                continue
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            return GpuReading(
                index=i, uuid=uuid, name=_text(pynvml.nvmlDeviceGetName(handle)),
                total_mib=int(memory.total) // MIB, used_mib=int(memory.used) // MIB,
                free_mib=int(memory.free) // MIB,
                driver=_text(pynvml.nvmlSystemGetDriverVersion()),
                compute_capability=(int(major), int(minor)), source="nvml",
            )
        return None
    finally:
        pynvml.nvmlShutdown()


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

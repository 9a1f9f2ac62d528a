"""Whether this machine's NVIDIA driver can run a CUDA build of PyTorch, and what to do if not.

A CUDA build runs on any driver whose own CUDA version has the same or a newer major version
(CUDA's minor version compatibility): a CUDA 12.8 build runs on an R525 driver (CUDA 12.0), a
CUDA 13.0 build needs R580. Under WSL2 the driver is the Windows one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ocrvl_daemon.server import vllm_release

# The first Linux driver branch of each CUDA major version (NVIDIA's CUDA release notes).
MIN_DRIVER = {11: "R450", 12: "R525", 13: "R580"}
DRIVER_DOWNLOAD = "https://www.nvidia.com/Download/index.aspx"
_CUDA = re.compile(r"^(\d+)\.(\d+)")

CudaVersion = tuple[int, int]


def parse_cuda(text: str | None) -> CudaVersion | None:
    """(major, minor) of "13.0", "12.8" (torch.version.cuda); None for a CPU build."""
    match = _CUDA.match(text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def from_driver_api(number: int) -> CudaVersion:
    """(major, minor) of the CUDA driver API's number: 12070 -> (12, 7)."""
    return number // 1000, number % 1000 // 10


def text(version: CudaVersion) -> str:
    return f"{version[0]}.{version[1]}"


def needed_driver(build: CudaVersion) -> str:
    """The driver branch a CUDA build needs, e.g. "R580 or newer"."""
    branch = MIN_DRIVER.get(build[0])
    return f"{branch} or newer" if branch else f"one for CUDA {build[0]}.x"


@dataclass(frozen=True)
class DriverTooOld:
    """The driver cannot run the build: what was found, what is needed, and the fix."""

    message: str
    fix: str


def check(driver_cuda: CudaVersion, driver: str, build: CudaVersion, what: str, *,
          wsl: bool) -> DriverTooOld | None:
    """None when driver `driver` (CUDA `driver_cuda`) runs `what`, built for CUDA `build`."""
    if driver_cuda[0] >= build[0]:
        return None
    message = (f"the NVIDIA driver {driver} supports CUDA {text(driver_cuda)}, but {what} is "
               f"built for CUDA {text(build)}, which needs driver {needed_driver(build)}")
    where = ("on WSL2 that is the Windows driver: install it in Windows (from "
             f"{DRIVER_DOWNLOAD} or the GeForce app), not inside Linux" if wsl
             else f"from {DRIVER_DOWNLOAD} or your distribution's packages")
    fix = f"install NVIDIA driver {needed_driver(build)} ({where})"
    older = vllm_release.release(vllm_release.CUDA12_RELEASE)
    if older is not None and driver_cuda[0] >= 12 and build[0] > 12:
        fix += (f"; or keep this driver and install the older build that runs on it: `ocrvl "
                f"setup-server --vllm {vllm_release.CUDA12_RELEASE}` (torch {older.torch} for "
                f"CUDA {older.cuda}; not the vLLM release the project measured)")
    return DriverTooOld(message, fix)

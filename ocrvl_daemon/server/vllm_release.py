"""The vLLM release ocrvl installs in the server environment, and what known releases bring.

`PINNED` is the release the project's GPU benchmark of record ran (`bench/gpu/results.json`,
its `vllm` field; a test holds the two together). A newer release is pinned only after it
is measured there against the current pin; changing the pin is this one line and the record.
"""

from __future__ import annotations

from dataclasses import dataclass

PINNED = "0.26.0"


@dataclass(frozen=True)
class Release:
    """What `pip install vllm==X` brings from PyPI on Linux x86-64."""

    torch: str
    cuda: str  # the CUDA version that torch build is for (its `torch.version.cuda`)

    @property
    def torch_build(self) -> str:
        """`torch.__version__` as the build reports it, e.g. "2.11.0+cu130"."""
        return f"{self.torch}+cu{self.cuda.replace('.', '')}"


# Read from each release's and its torch's package metadata on PyPI (Requires-Dist).
KNOWN: dict[str, Release] = {
    "0.33.0": Release("2.14.0", "13.0"),  # the newest pip installs (0.34.0 asks for a
    # flashinfer-python==0.7.3 that PyPI does not have); torch 2.14.0 requires
    # nvidia-cuda-runtime 13.0.96. On an H100 it serves only with --trust-request-mm-kwargs
    # (launchers.TRUST_MM_KWARGS_FLAG), 16-29% faster than 0.26.0 on one server (12% and 27%
    # with `auto` replicas, layout off and on), but its start-up peak is 2 GiB above 0.26.0's:
    # on an 8 GB card beside the layout model, ocrvl's plan (gpu_memory's, 0.26.0's) leaves
    # it no KV cache until the step-down, and then it is a third slower (RESULTS.md).
    "0.26.0": Release("2.11.0", "13.0"),  # torch 2.11.0 requires cuda-toolkit 13.0.2
    "0.19.1": Release("2.10.0", "12.8"),  # torch 2.10.0 requires nvidia-cuda-runtime-cu12 12.8
}
# The newest vLLM on PyPI whose torch is a CUDA 12 build (0.20 to 0.34 bring CUDA 13): what a
# driver older than R580 can still run. Not measured by the project's benchmark.
CUDA12_RELEASE = "0.19.1"


def requirement(version: str) -> str:
    """The pip requirement that installs exactly `version`."""
    return f"vllm=={version}"


def release(version: str) -> Release | None:
    """What `version` brings, where the project knows it."""
    return KNOWN.get(version)

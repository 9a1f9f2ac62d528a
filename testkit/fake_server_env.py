"""A fake vLLM server environment: a real virtual environment whose `vllm`, `torch`,
`torchvision` and `transformers` are stand-ins that fail where the real ones do.

`vllm serve` here runs the fake vLLM server (`testkit.fake_server`), unless the real vLLM
would die first:
* vLLM >= 0.24 under WSL2 (`wsl=True`) without `VLLM_USE_V2_MODEL_RUNNER=0` or
  `VLLM_WSL2_ENABLE_PIN_MEMORY=1`: "RuntimeError: UVA is not available";
* a driver whose CUDA version (`driver_cuda`) is older than torch's build: torch's "The NVIDIA
  driver on your system is too old (found version N)";
* no GPU (`gpu=False`): vLLM's warning "No module named 'vllm._C'", then "RuntimeError: Failed
  to infer device type".
`broken=True` makes `import vllm` itself fail, as a half-finished install does. The log
lines are those in tests/fixtures/.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
FIXTURES = CHECKOUT / "tests" / "fixtures"
V2_RUNNER_SINCE = (0, 24)


@dataclass(frozen=True)
class FakeVllm:
    """What the fake environment holds and how its `vllm serve` behaves."""

    version: str = "0.26.0"
    torch: str = "2.11.0"
    cuda: str = "13.0"  # what its torch is built for
    wsl: bool = False
    gpu: bool = True
    driver_cuda: str | None = None  # the driver's CUDA version; None: new enough
    broken: bool = False


def site_packages(root: Path) -> Path:
    return root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
        "site-packages"


def make(root: Path, fake: FakeVllm | None = None) -> Path:
    """Create the environment at `root` (a real venv, no pip); its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    install(root / "bin" / "python", fake or FakeVllm())
    return root / "bin" / "python"


def install(python: Path, fake: FakeVllm) -> None:
    """Put the stand-ins into the environment of `python` (what `pip install vllm==X` does)."""
    root = python.parent.parent
    site = site_packages(root)
    site.mkdir(parents=True, exist_ok=True)
    cuda_tag = "cu" + fake.cuda.replace(".", "")
    cuda_major = fake.cuda.split(".")[0]
    packages = {
        "vllm": (fake.version, "import sys\nraise ImportError('libcudart.so.13: cannot open "
                 "shared object file: No such file or directory')\n" if fake.broken else
                 f"__version__ = {fake.version!r}\n", ["torch"]),
        "torch": (fake.torch, f"from torch import version\n__version__ = "
                  f"'{fake.torch}+{cuda_tag}'\n", [f"nvidia-cudnn-cu{cuda_major}"]),
        "torchvision": ("0.26.0", "__version__ = '0.26.0'\n", ["torch"]),
        "transformers": ("5.14.0", "__version__ = '5.14.0'\n", []),
    }
    for name, (version, init, requires) in packages.items():
        (site / name).mkdir(exist_ok=True)
        (site / name / "__init__.py").write_text(init, encoding="utf-8")
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
            + "".join(f"Requires-Dist: {r}\n" for r in requires), encoding="utf-8")
    (site / "torch" / "version.py").write_text(f"cuda = {fake.cuda!r}\n", encoding="utf-8")
    script = root / "bin" / "vllm"
    script.write_text(_SCRIPT.format(python=python, checkout=str(CHECKOUT),
                                     fixtures=str(FIXTURES),
                                     fake=json.dumps(asdict(fake)), fake_python=sys.executable,
                                     since=V2_RUNNER_SINCE), encoding="utf-8")
    script.chmod(0o755)


_SCRIPT = textwrap.dedent('''\
    #!{python}
    """A stand-in for vLLM's `vllm` command (testkit.fake_server_env)."""
    import json, os, pathlib, sys
    fake = json.loads({fake!r})
    fixtures = pathlib.Path({fixtures!r})

    def die(log):
        sys.stderr.write((fixtures / log).read_text())
        sys.exit(1)

    if sys.argv[1:] == ["--version"]:
        print(fake["version"])
        sys.exit(0)
    if not fake["gpu"]:
        die("vllm-no-cuda.log")
    build, driver = fake["cuda"].split("."), (fake["driver_cuda"] or "99.0").split(".")
    if int(driver[0]) < int(build[0]):
        found = int(driver[0]) * 1000 + int(driver[1]) * 10
        text = (fixtures / "torch-driver-too-old.log").read_text()
        sys.stderr.write(text.replace("found version 12070", f"found version {{found}}"))
        sys.exit(1)
    version = tuple(int(p) for p in fake["version"].split(".")[:2])
    chose_v1 = (os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0"
                or os.environ.get("VLLM_WSL2_ENABLE_PIN_MEMORY") == "1")
    if fake["wsl"] and version >= {since!r} and not chose_v1:
        die("vllm-wsl2-uva.log")
    argv = [{fake_python!r}, "-m", "testkit.fake_server", *sys.argv[3:]]
    env = dict(os.environ, PYTHONPATH={checkout!r})
    os.execve(argv[0], argv, env)
''')


# --- a fake `uv`, for `ocrvl setup-server` ----------------------------------------------------

BROKEN_ENV = "FAKE_VLLM_BROKEN"  # "1": the vLLM the fake uv installs fails to import


def write_fake_uv(folder: Path) -> Path:
    """An executable `uv` in `folder` that makes real virtual environments (without pip) and
    "installs" `vllm==X` as these stand-ins: torch as PyPI's vllm==X brings it."""
    folder.mkdir(parents=True, exist_ok=True)
    uv = folder / "uv"
    uv.write_text(f"#!/bin/sh\nPYTHONPATH={CHECKOUT} exec {sys.executable} -m "
                  "testkit.fake_server_env \"$@\"\n", encoding="utf-8")
    uv.chmod(0o755)
    return uv


def _uv(argv: list[str]) -> int:
    import os

    from ocrvl_daemon.server import vllm_release

    if argv[:2] == ["venv", "--python"]:
        return subprocess.run([argv[2], "-m", "venv", "--without-pip", argv[3]]).returncode
    if argv[:3] == ["pip", "install", "--python"]:
        python, packages = Path(argv[3]), argv[4:]
        version = next(p.split("==")[1] for p in packages if p.startswith("vllm=="))
        release = vllm_release.release(version) or vllm_release.Release("2.14.0", "13.0")
        install(python, FakeVllm(version, release.torch, release.cuda,
                                 broken=os.environ.get(BROKEN_ENV) == "1"))
        return 0
    sys.stderr.write(f"fake uv: unexpected arguments {argv}\n")
    return 2


if __name__ == "__main__":
    sys.exit(_uv(sys.argv[1:]))

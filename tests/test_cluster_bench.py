"""The GPU comparison of ocrvl through Ray against its local workers (bench/gpu/ray_vs_local.py)
runs end to end as a dry run: a one-node Ray cluster, the stand-in server, both contenders."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.ray_cluster import LOOPBACK_ENV
from testkit.runner import ocrvl_env

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_ray_vs_local_dry_run_times_both_contenders_and_writes_the_ratio(tmp_path: Path):
    results = tmp_path / "ray_vs_local.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu.ray_vs_local", "--fake", "--pages-off", "16",
         "--rounds", "1", "--results", str(results), "--log-dir", str(tmp_path / "logs")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=ocrvl_env(**LOOPBACK_ENV),
        check=False)
    assert proc.returncode == 0, f"bench.gpu.ray_vs_local failed:\n{proc.stderr[-4000:]}"
    data = json.loads(results.read_text())
    assert [(r["contender"], r["mode"]) for r in data["rows"]] == [("local", "off"),
                                                                   ("ray", "off")]
    off = data["summary"]["layout_off"]
    assert off["local_pages_per_s"] > 0 and off["ray_pages_per_s"] > 0, off
    assert off["ray_vs_local"] == pytest.approx(off["ray_pages_per_s"] / off["local_pages_per_s"],
                                                abs=0.01)
    assert (tmp_path / "logs" / "off-ray.log").exists(), "the ray daemon's log was not kept"


def test_ray_vs_local_with_local_alone_times_it_without_a_ray_cluster(tmp_path: Path):
    results = tmp_path / "ray_vs_local.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu.ray_vs_local", "--fake", "--order", "local",
         "--pages-off", "8", "--rounds", "1", "--results", str(results), "--log-dir",
         str(tmp_path / "logs")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=ocrvl_env(), check=False)
    assert proc.returncode == 0, f"bench.gpu.ray_vs_local --order local failed:\n" \
                                 f"{proc.stderr[-4000:]}"
    data = json.loads(results.read_text())
    assert [(r["contender"], r["mode"]) for r in data["rows"]] == [("local", "off")]
    assert data["rows"][0]["pages_per_s"] > 0, data["rows"]
    assert "ray" not in data, "the local contender alone (the lease's auto-replicas step) " \
                              "started a Ray cluster it does not use"

"""The client-speed benchmark (bench/client_speed.py) keeps working: a real `ocrvl convert`
per worker count against an instant server, one table row each."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) s \|$")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_client_speed_bench_converts_the_book_once_per_worker_count_even_repeated() -> None:
    proc = subprocess.run(  # a count repeated alternately: how start-up figures are compared
        [sys.executable, "-m", "bench.client_speed", "--pages", "6", "--workers", "1,2,1"],
        cwd=ROOT, capture_output=True, text=True, timeout=280, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"bench.client_speed failed:\n{proc.stderr[-3000:]}"
    rows = [m.groups() for line in proc.stdout.splitlines() if (m := ROW.match(line))]
    assert [r[0] for r in rows] == ["1", "2", "1"], (
        f"expected rows for 1, 2 and again 1 workers, got:\n{proc.stdout}")
    assert all(float(pages_per_s) > 0 and float(cpu) > 0 for _, pages_per_s, _, cpu, _ in rows), (
        f"a row without pages/s or CPU per page:\n{proc.stdout}")

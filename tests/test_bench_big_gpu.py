"""bench.gpu.big_gpu: the settings grid, the budget, the rows and the best pick; and a dry run
against the fake server (the real run needs a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.gpu import big_gpu
from bench.gpu.big_gpu import Setting
from testkit.runner import PACKAGE_ROOT


def row(name: str, pages_per_s: float | None, replicas: int, mps: bool = False,
        **extra: Any) -> dict[str, Any]:
    return {"setting": name, "pages_per_s": pages_per_s, "replicas": replicas, "mps_used": mps,
            "vllm_args": {}, "pipeline": {}, **extra}


@pytest.mark.quick
def test_the_grid_has_replicas_one_to_four_with_and_without_mps() -> None:
    for n in (1, 2, 3, 4):
        assert big_gpu.SETTINGS[f"x{n}"] == Setting(f"x{n}", n)
        assert big_gpu.SETTINGS[f"mps-x{n}"] == Setting(f"mps-x{n}", n, mps=True)
    flags = [s.vllm_args for s in big_gpu.SETTINGS.values()]
    for flag in ("async-scheduling", "max-num-batched-tokens", "compilation-config",
                 "api-server-count"):
        assert any(flag in f for f in flags), flag
    assert [s.name for s in big_gpu.chosen(big_gpu.DEFAULT_SETTINGS)] == [
        "mps-x4", "x2"], "the best of record first, then its plain reference"
    assert all(s.changes_input == bool(s.pipeline) for s in big_gpu.SETTINGS.values())


@pytest.mark.quick
def test_settings_are_chosen_in_order_and_unknown_ones_refused() -> None:
    assert [s.name for s in big_gpu.chosen("x2, mps-x3,x2")] == ["x2", "mps-x3"]
    with pytest.raises(ValueError, match=r"unknown setting.*x9"):
        big_gpu.chosen("x2,x9")
    with pytest.raises(ValueError, match="no setting"):
        big_gpu.chosen(" , ")


@pytest.mark.quick
def test_settings_that_differ_only_in_replicas_share_one_start() -> None:
    groups = big_gpu.server_groups(big_gpu.chosen("mps-x3,x2-sync,mps-x4,x2,x1,mps-x2"))
    assert [(started, [s.name for s in group]) for started, group in groups] == [
        (4, ["mps-x3", "mps-x4", "mps-x2"]), (2, ["x2-sync"]), (2, ["x2", "x1"])]


@pytest.mark.quick
def test_the_budget_starts_only_what_fits() -> None:
    assert 0 < big_gpu.start_cost_s(1) < big_gpu.start_cost_s(2) < big_gpu.start_cost_s(4)
    assert big_gpu.setting_cost_s(256) > big_gpu.setting_cost_s(128)
    assert big_gpu.fits(0, 540, big_gpu.start_cost_s(3) + big_gpu.setting_cost_s(128))
    assert not big_gpu.fits(400, 540, big_gpu.start_cost_s(3))
    assert big_gpu.fits(500, 540, 40) and not big_gpu.fits(500.1, 540, 40)
    # The default settings fit the default budget by the estimate: the MPS start for x4 with
    # B2 and its convert, then two plain replicas.
    pages = 128
    mps = big_gpu.start_cost_s(4) + 2 * big_gpu.setting_cost_s(pages)
    plain_x2 = big_gpu.start_cost_s(2) + big_gpu.setting_cost_s(pages)
    assert mps + plain_x2 <= big_gpu.DEFAULT_BUDGET_S, (mps, plain_x2)


@pytest.mark.quick
def test_the_best_row_and_the_rule_row_it_makes() -> None:
    rows = [row("x1", 9.0, 1), row("x2", 13.4, 2), row("x3", 13.2, 3),
            row("mps-x3", 17.5, 3, mps=True), row("mps-x4", None, 4, mps=True, skipped="budget"),
            row("x2-sync", 18.0, 2, vllm_args={"async-scheduling": False})]
    assert big_gpu.best(rows)["setting"] == "x2-sync"
    assert big_gpu.best([row("a", None, 1)]) is None
    assert big_gpu.rule_row(rows, 143771) == "ReplicaRule(from_mib=143771, plain=2, mps=3)", \
        "replica counts are judged without other flags"
    assert big_gpu.rule_row(rows, None) is None
    assert big_gpu.rule_row(rows[:2], 143771) == "ReplicaRule(from_mib=143771, plain=2, mps=2)"


@pytest.mark.quick
def test_the_summary_has_the_figures_of_record(tmp_path: Path) -> None:
    res = {"date": "d", "gpu": "g", "pages": 128, "card_mib": 143771, "b2_pages_per_s": 8.0,
           "rows": [row("x2", 13.4, 2, gpu_busy_pct=72.0, watts=330.0)]}
    path = tmp_path / "big_gpu.json"
    big_gpu.write(res, path)
    data = json.loads(path.read_text())
    assert {k: data[k] for k in ("date", "gpu", "b2_pages_per_s", "best_pages_per_s",
                                 "best_setting", "gpu_busy_pct", "watts", "best_vs_b2")} == {
        "date": "d", "gpu": "g", "b2_pages_per_s": 8.0, "best_pages_per_s": 13.4,
        "best_setting": "x2", "gpu_busy_pct": 72.0, "watts": 330.0, "best_vs_b2": 1.675}
    assert data["rows"] == res["rows"] and not list(tmp_path.glob("*.part"))


def bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    return bench_run(tmp_path, *args)[0]


def bench_run(tmp_path: Path, *args: str) -> tuple[dict[str, Any], str]:
    """The dry run's results file and its stderr (8 pages unless `args` say otherwise)."""
    results = tmp_path / "big_gpu.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu.big_gpu", "--fake", "--pages", "8",
                           "--results", str(results), "--log-dir", str(tmp_path / "logs"),
                           *args], cwd=PACKAGE_ROOT, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, f"bench.gpu.big_gpu failed:\n{proc.stderr[-3000:]}"
    return json.loads(results.read_text()), proc.stderr


@pytest.mark.slow
def test_dry_run_tries_each_setting_on_one_start_and_writes_rows(tmp_path: Path) -> None:
    data = bench(tmp_path, "--settings", "x2,x1,x2-sync")
    assert [r["setting"] for r in data["rows"]] == ["x2", "x1", "x2-sync"]
    for r in data["rows"]:
        assert r["pages_per_s"] > 0 and r["mps_used"] is False
        assert len(r["vllm_settings"]) == r["replicas_started"] == 2
    assert data["b2_pages_per_s"] > 0 and data["best_setting"] in {"x2", "x1", "x2-sync"}
    logs = {p.name for p in (tmp_path / "logs").iterdir()}
    assert {"ocrvl-run-x2-daemon.log", "ocrvl-run-x2-sync-daemon.log"} <= logs, logs
    assert "--no-async-scheduling" in (tmp_path / "logs" / "ocrvl-run-x2-sync-daemon.log"
                                    ).read_text()


@pytest.mark.slow
def test_a_budget_too_small_starts_nothing_and_says_so(tmp_path: Path) -> None:
    data = bench(tmp_path, "--settings", "x1,mps-x2", "--budget-s", "5")
    assert [(r["setting"], r["skipped"]) for r in data["rows"]] == [
        ("x1", "budget: 1 replica start(s) would not fit"),
        ("mps-x2", "budget: 2 replica start(s) would not fit")]
    assert data["best_setting"] is None and data["b2_pages_per_s"] is None


@pytest.mark.quick
def test_every_server_failed_is_read_from_ocrvl_status() -> None:
    from bench.gpu.replicas import all_failed

    error = "server.python = python3 is not an executable Python"
    failed = {"state": "failed", "last_error": error}
    assert all_failed({"servers": [failed, {**failed, "last_error": None}]}) == error
    assert all_failed({"servers": [failed, {"state": "starting"}]}) is None, "one may come up"
    assert all_failed({"servers": [], "server": {"state": "starting"}}) is None
    assert all_failed({"server": {"state": "failed", "last_error": "boom"}}) == "boom"
    assert all_failed({}) is None


def _fake_args(tmp_path: Path, **more: Any) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(fake=True, model_dir=None, vllm_python=sys.executable,
                           vllm_pythonpath="", pages=8, budget_s=540.0,
                           results=tmp_path / "big_gpu.json", log_dir=tmp_path / "logs", **more)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_daemon_whose_servers_all_failed_is_not_waited_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """On the H100 every replica went to "failed" (server.python = python3) and big_gpu
    waited for "ready" until its budget ran out: the row is now `failed: <last_error>` as
    soon as `ocrvl status --json` shows every server failed, and the next setting runs."""
    import time

    from bench.gpu.replicas import ReplicaDaemon
    from testkit.documents import make_pdf

    missing = str(tmp_path / "no-such-vllm")

    class Broken(ReplicaDaemon):
        def __init__(self, n: int, work: Path, args: Any, server: Any = None) -> None:
            if "x1" in work.name:  # x1's servers cannot start; x2's can
                server = {**(server or {}), "command": [missing, "--port", "{port}"]}
            super().__init__(n, work, args, server)

    monkeypatch.setattr(big_gpu, "ReplicaDaemon", Broken)
    (tmp_path / "logs").mkdir()
    res: dict[str, Any] = {"date": "d", "gpu": "g", "pages": 8, "rows": []}
    book = make_pdf(tmp_path / "book.pdf", 8, height=792, seed=1)
    t0 = time.monotonic()
    big_gpu.Runner(_fake_args(tmp_path), tmp_path, book, res).run(big_gpu.chosen("x1,mps-x2"))
    rows = {r["setting"]: r for r in res["rows"]}
    assert rows["x1"].get("skipped", "").startswith("failed: "), rows["x1"]
    assert "no-such-vllm" in rows["x1"]["skipped"] or "not" in rows["x1"]["skipped"], rows
    assert rows["mps-x2"].get("pages_per_s"), f"the next setting should still run: {rows}"
    assert time.monotonic() - t0 < 200, "the failed daemon was waited for"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stopped_dry_run_stops_its_daemon_and_the_servers_it_manages(tmp_path: Path) -> None:
    """SIGTERM to big_gpu while its `ocrvl run` daemon serves: the daemon and its (fake)
    servers are gone afterwards, not only the bench."""
    import signal

    import psutil

    from testkit.harness import wait_until

    err = tmp_path / "err"
    with err.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "bench.gpu.big_gpu", "--fake", "--pages",
                                 "8", "--settings", "x2", "--results", str(tmp_path / "r.json"),
                                 "--log-dir", str(tmp_path / "logs")], cwd=PACKAGE_ROOT,
                                stdout=subprocess.DEVNULL, stderr=out)  # fmt: skip
    seen: list[psutil.Process] = []
    try:
        def servers_up() -> bool:
            kids = psutil.Process(proc.pid).children(recursive=True)
            servers = [p for p in kids if "testkit.fake_server" in " ".join(p.cmdline())]
            if len(servers) >= 2:
                seen[:] = kids
                return True
            return False

        wait_until(servers_up, 200, interval=0.2, what="the daemon's two fake servers",
                   ignore=(psutil.Error,))  # fmt: skip
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        wait_until(lambda: not [p for p in seen if p.is_running()
                                and p.status() != psutil.STATUS_ZOMBIE], 60, interval=0.2,
                   what="every process the bench started gone", ignore=(psutil.Error,))
    finally:
        proc.kill()
        proc.wait()
        for p in seen:
            with __import__("contextlib").suppress(psutil.Error):
                p.kill()


# --- layout detection on (--layout) ------------------------------------------------------------

LAYOUT_GPU = {"use_layout_detection": True, "layout_engine": "transformers",
              "layout_device": "gpu:0"}  # fmt: skip


def _reading(total_mib: int) -> Any:
    from ocrvl_daemon.server.gpu import GpuReading

    return GpuReading(0, "GPU-0", "H", total_mib, 500, total_mib - 500, "580", (9, 0), "nvml")


@pytest.mark.quick
def test_layout_on_the_gpu_keeps_the_layout_workers_memory_from_the_replicas() -> None:
    """The daemon's own workers run layout off, so its own plan would give the replicas the
    memory ocrvl convert's layout workers need: layout on the GPU, the daemon gets the
    utilization of ocrvl's plan with layout on (the whole card's; it splits it itself)."""
    from ocrvl_daemon.config.model import Config
    from ocrvl_daemon.server import autotune
    from ocrvl_daemon.server.autotune import UTILIZATION
    from ocrvl_daemon.server.layout_engine import Installed

    installed = Installed(cpu=frozenset({"paddle", "transformers"}),
                          gpu=frozenset({"transformers"}))  # fmt: skip
    for total in (143771, 81559):
        gpu = _reading(total)
        room = big_gpu.layout_room(LAYOUT_GPU, gpu, installed)
        plain = autotune.plan_vllm_args(Config(), gpu).values[UTILIZATION]
        assert set(room) == {UTILIZATION} and room[UTILIZATION] < plain, (room, plain)
    cpu = {**LAYOUT_GPU, "layout_device": "cpu"}
    assert big_gpu.layout_room(cpu, _reading(143771), installed) == {}, "nothing on the GPU"
    assert big_gpu.layout_room(LAYOUT_GPU, None, installed) == {}, "the dry run: no reading"


@pytest.mark.quick
def test_layout_on_every_replica_gets_the_block_answer_lengths(tmp_path: Path) -> None:
    from bench.gpu.lengths import ENV

    layout = big_gpu.LayoutOn({"layout_engine": "paddle", "layout_device": "cpu"},
                              {"use_layout_detection": True}, "71:0.9:17")  # fmt: skip
    setting = big_gpu.SETTINGS["x2-sync"]
    on = big_gpu.Runner(_fake_args(tmp_path), tmp_path, tmp_path / "b.pdf", {}, layout)
    assert on.server_options(setting) == {
        "mps": "off", "vllm_args": {"async-scheduling": False}, "env": {ENV: "71:0.9:17"}}
    off = big_gpu.Runner(_fake_args(tmp_path), tmp_path, tmp_path / "b.pdf", {})
    assert off.server_options(setting) == {"mps": "off", "vllm_args": {"async-scheduling": False}}
    assert layout.pipeline == {"use_layout_detection": True, "layout_engine": "paddle",
                               "layout_device": "cpu"}  # fmt: skip
    assert on.cost_s() > off.cost_s(), "layout on, a page takes longer"
    assert big_gpu.parse_args(["--fake", "--layout"]).results.name == "big_gpu_layout.json"
    assert big_gpu.parse_args(["--fake"]).results.name == "big_gpu.json"




@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dry_run_with_layout_on_sends_blocks_from_b2_and_every_convert(
        tmp_path: Path, layout_cache: Path) -> None:  # fmt: skip
    """`--layout` on a 2-page layout book (the small stand-in on the CPU): B2 and ocrvl
    convert send the blocks (7 a page reach the replicas, not 1), the convert's markdown has
    them, the replicas' config carries the block answer lengths, the rows say layout on."""
    import re
    import shutil

    import yaml

    from bench.gpu.layout_on import block_lengths
    from bench.gpu.lengths import ENV

    data, err = bench_run(tmp_path, "--settings", "x2,x1", "--pages", "2", "--layout",
                          "--layout-engine", "paddle", "--layout-device", "cpu",
                          "--layout-cache", str(layout_cache), "--keep")  # fmt: skip
    work = Path(re.findall(r"work directory (\S+)", err)[0])
    try:
        config = yaml.safe_load((work / "x2-daemon" / "ocrvl.yaml").read_text())
        markdown = [p.read_text() for p in sorted(work.glob("x*-daemon/x*/book.md"))]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert data["layout"] is True, data
    assert (data["layout_engine"], data["layout_device"]) == ("paddle", "cpu")
    assert data["b2_kwargs"]["use_layout_detection"] is True
    assert data["requests_per_page"] == 7 and data["blocks_per_page"] == 8, (
        "the blocks ocrvl's pipeline sends for the layout book")
    lengths = block_lengths(7, 500)
    assert data["answer_lengths"] == lengths
    assert config["server"]["env"][ENV] == lengths, "the replicas' logits processor"
    assert data["b2_requests"] == 14 and data["b2_requests_per_page"] == 7.0, (
        f"B2 sent {data['b2_requests']} requests for 2 pages: not one per block")
    assert [r["setting"] for r in data["rows"]] == ["x2", "x1"]
    for r in data["rows"]:
        assert r["layout"] is True and r["layout_engine"] == "paddle", r
        assert r["pages_per_s"] > 0 and r["requests"] == 14, (
            f"{r['setting']}: {r['requests']} requests for 2 pages: not one per block")
        assert any("cpu (paddle_static" in line for line in r["layout_line"]), r["layout_line"]
    assert len(markdown) == 2, "one book.md per convert"
    for md in markdown:
        # blocks, not pages (PaddleX leaves the page numbers out of the markdown)
        assert md.count("fake-ocr ") > 2 * 2 and "fake-ocr Table" in md, md[:500]

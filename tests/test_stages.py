"""Which stage sets the pace: each stage's load from the work it did, and the advice shown."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ocrvl_daemon.observe.rate import RATE_WINDOW
from ocrvl_daemon.observe.stages import BusyMeter, Stage, StageLoad
from ocrvl_daemon.server import layout_engine, placement
from testkit.stand_in_worker import Policy

pytestmark = pytest.mark.quick


def test_a_layout_model_working_every_second_of_the_window_is_fully_busy():
    meter = BusyMeter()
    for second in range(120):
        meter.add(second, second + 1.0)
    assert meter.busy(120.0) == pytest.approx(1.0)


def test_two_workers_each_half_busy_make_the_stage_half_busy():
    meter = BusyMeter()
    for second in range(0, 100, 2):
        meter.add(second, second + 1.0)  # worker 1
        meter.add(second + 1.0, second + 2.0)  # worker 2
    assert meter.busy(100.0, capacity=2) == pytest.approx(0.5)


def test_load_is_measured_since_the_first_work_and_forgets_old_work():
    meter = BusyMeter()
    assert meter.busy(5.0) == 0.0
    meter.add(10.0, 12.0)
    assert meter.busy(14.0) == pytest.approx(0.5), "the idle time before the first page counts"
    assert meter.busy(12.0 + RATE_WINDOW + 1) == 0.0, "work a minute old still counts"


def test_a_saturated_layout_on_the_cpu_is_named_with_what_would_help():
    load = StageLoad(rendering=0.03, layout=0.97, server=0.40, layout_device="cpu",
                     layout_why=layout_engine.ON_CPU_ASKED)
    assert load.limit() is Stage.LAYOUT
    assert load.summary() == "layout 97% (limit) · server 40% · rendering 3%"
    assert "pipeline.layout_device: gpu" in (load.advice() or "")


@pytest.mark.parametrize(("why", "fix"), [
    (layout_engine.ON_CPU_NO_GPU_ENGINE, "pip install 'ocrvl-daemon[gpu-layout]'"),
    (layout_engine.ON_CPU_NO_ROOM, "gpu-memory-utilization"),
    (layout_engine.ON_CPU_ASKED, "pipeline.layout_device: gpu"),
])
def test_the_advice_for_a_layout_on_the_cpu_follows_why_it_is_there(why: str, fix: str):
    advice = StageLoad(layout=0.97, layout_device="cpu", layout_why=why).advice() or ""
    assert fix in advice, f"on the CPU because {why!r}, but the advice is: {advice}"
    assert "pipeline.workers" in advice


def test_with_no_gpu_the_advice_for_a_layout_on_the_cpu_is_more_workers_only():
    advice = StageLoad(layout=0.97, layout_device="cpu",
                       layout_why=layout_engine.ON_CPU_NO_GPU).advice() or ""
    assert "GPU" not in advice and "gpu" not in advice, (
        f"a machine without a GPU is told to use one: {advice}")
    assert "pipeline.workers" in advice, advice


def test_a_busy_server_is_the_limit_and_needs_no_advice():
    load = StageLoad(rendering=0.05, layout=0.3, server=0.95, layout_device="gpu:0")
    assert load.limit() is Stage.SERVER and load.advice() is None
    assert load.before_server() is None, "STATUS= names only a stage holding the server back"


def test_slow_rendering_asks_for_more_workers():
    load = StageLoad(rendering=0.9, server=0.5)
    assert load.before_server() == "rendering 90% is the limit"
    assert "pipeline.workers" in (load.advice() or "")


def test_a_long_piece_of_work_that_ended_in_the_window_counts_whole():
    meter = BusyMeter()
    meter.add(0.0, 30.0)
    meter.add(30.0, 100.0)  # began before the window [40, 100]: work still under way is unknown
    assert meter.busy(100.0) == pytest.approx(1.0)


def test_no_stage_is_the_limit_while_all_have_room():
    assert StageLoad(rendering=0.1, layout=0.5, server=0.6).limit() is None


def test_a_full_server_on_an_idle_gpu_is_told_to_add_replicas():
    load = StageLoad(layout=0.2, server=0.95, layout_device="gpu:0", server_gpu_busy=0.3)
    advice = load.advice() or ""
    assert "GPU is only 30% busy" in advice, "a server held by its CPU side must be named"
    assert "server.replicas" in advice and "server.mps" in advice, (
        "the cure for a server's CPU-bound engine loop is another server on the same GPU")
    busy_gpu = StageLoad(server=0.95, layout_device="gpu:0", server_gpu_busy=0.9)
    assert busy_gpu.advice() is None, "a server held by its GPU needs no advice"
    assert StageLoad.from_json(load.to_json()) == load


@pytest.mark.parametrize(("why", "warned"), [(layout_engine.ON_CPU_NO_GPU_ENGINE, True),
                                             (layout_engine.ON_CPU_ASKED, False),
                                             (layout_engine.ON_CPU_NO_GPU, False)])
def test_a_layout_model_on_the_cpu_that_the_gpu_could_take_is_logged_once_with_the_fix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        why: str, warned: bool):
    choice = layout_engine.LayoutChoice("PP-DocLayoutV3", "paddle", "cpu", 2, 1, why)
    monkeypatch.setattr(placement, "layout_choice", lambda *args: choice)
    with caplog.at_level(logging.WARNING, logger="ocrvl_daemon.server.placement"):
        policy = Policy(tmp_path)  # the placement is decided here, once
        for now in (1.0, 2.0):
            load = policy.converter.stage_load(now)
    assert (load.layout_device, load.layout_why) == ("cpu", why)
    lines = [r.getMessage() for r in caplog.records if "layout model runs on the CPU" in r.message]
    if warned:
        assert len(lines) == 1 and "[gpu-layout]" in lines[0], lines
    else:
        assert lines == [], f"warned although nothing would put it on the GPU: {lines}"

"""The daemon's state as one value: the STATUS= line it becomes and the runtime file that
`ocrvl status` reads."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ocrvl_daemon.observe.daemon_state import (
    DaemonState,
    EndpointState,
    ServerView,
    format_status,
    read_runtime_file,
    write_runtime_file,
)
from ocrvl_daemon.observe.stages import StageLoad
from ocrvl_daemon.observe.units import format_duration

pytestmark = pytest.mark.quick

URL = "http://127.0.0.1:8118/v1"


@pytest.mark.parametrize(("snap", "line"), [
    (DaemonState(done=12), "idle, 12 done, 0 queued"),
    (DaemonState(done=12, queued=2, failed=1), "idle, 12 done, 2 queued, 1 failed"),
    (DaemonState(current_doc="book.pdf", page_done=212, page_total=480, pages_per_s=1.6,
                    queued=3),
     "book.pdf p.212/480 · 1.6 p/s · ETA 2m48s · 3 queued"),
    (DaemonState(current_doc="book.pdf", page_done=12, page_total=480, pages_per_s=0.05),
     "book.pdf p.12/480 · 0.05 p/s · ETA 2h36m"),
    (DaemonState(current_doc="book.pdf", page_done=3, page_total=10, pages_per_s=0.24),
     "book.pdf p.3/10 · 0.24 p/s · ETA 29s"),
    (DaemonState(current_doc="scan.pdf", page_done=0), "scan.pdf p.0"),
    (DaemonState(current_doc="book.pdf", page_done=3, page_total=10, pages_per_s=0.24, queued=1,
                 stages=StageLoad(rendering=0.03, layout=0.97, server=0.4, layout_device="cpu")),
     "book.pdf p.3/10 · 0.24 p/s · ETA 29s · layout 97% is the limit · 1 queued"),
    (DaemonState(current_doc="book.pdf", page_done=3, page_total=10, pages_per_s=0.24,
                 stages=StageLoad(rendering=0.03, layout=0.3, server=0.97)),
     "book.pdf p.3/10 · 0.24 p/s · ETA 29s"),
    (DaemonState(current_doc="a.pdf", page_done=5, page_total=9, failed=2),
     "a.pdf p.5/9 · 2 failed"),
    (DaemonState(server=ServerView("restarting", attempt=3, cause="out of memory"),
                 current_doc="book.pdf"),
     "server restarting (attempt 3, out of memory?)"),
    (DaemonState(server=ServerView("restarting", attempt=1), queued=4),
     "server restarting (attempt 1) · 4 queued"),
    (DaemonState(server=ServerView("starting", phase="loading weights")),
     "starting server: loading weights"),
    (DaemonState(server=ServerView("starting")), "starting server"),
    (DaemonState(server=ServerView("unreachable"), queued=2), "server unreachable · 2 queued"),
    (DaemonState(server=ServerView("failed", cause="CUDA driver missing")),
     "server failed (CUDA driver missing?)"),
    (DaemonState(server=ServerView("external"), done=1), "idle, 1 done, 0 queued"),
    (DaemonState(engine_failed_starts=2, current_doc="book.pdf", queued=3),
     "recognition pipeline cannot start (2 failed starts; see journalctl --user -u ocrvl) · "
     "3 queued"),
    (DaemonState(current_doc="book.pdf", page_done=3, page_total=10, pages_per_s=0.24,
                    endpoints=(EndpointState("server", URL, "ready", in_flight=4,
                                               pages_per_s=0.24),)),
     "book.pdf p.3/10 · 0.24 p/s · ETA 29s"),
    (DaemonState(current_doc="book.pdf", page_done=3, page_total=10, pages_per_s=2.4,
                    endpoints=(EndpointState("gpu0/0", URL, "ready", in_flight=12, pages_per_s=1.6),
                            EndpointState("gpu0/1", URL, "restarting"))),
     "book.pdf p.3/10 · 2.4 p/s · ETA 3s | gpu0/0 ready, 12 in flight, 1.6 p/s; "
     "gpu0/1 restarting"),
])
def test_the_status_line_says_what_blocks_work_else_progress_else_idle_counts(
        snap: DaemonState, line: str) -> None:
    assert format_status(snap) == line


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (45.4, "45s"), (725, "12m05s"), (3600, "1h00m"), (9660, "2h41m"),
])
def test_durations_read_as_people_write_them(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_the_runtime_file_holds_the_whole_state_and_leaves_no_temporary(tmp_path: Path):
    state = DaemonState(pid=os.getpid(), updated=time.time(), server=ServerView("ready", url=URL),
                        endpoints=(EndpointState("server", URL, "ready", in_flight=3),),
                        current_doc="book.pdf", page_done=4, page_total=9, queued=1,
                        hook_failures={"on_done": 1},
                        stages=StageLoad(rendering=0.031, layout=0.9712, server=0.4,
                                         layout_device="cpu"))
    write_runtime_file(tmp_path, state.to_json())
    read = read_runtime_file(tmp_path)
    assert read["stages"]["layout"] == 0.971 and read["stages"]["limit"] == "layout"
    assert "pipeline.layout_device: gpu" in read["stages"]["advice"]
    assert StageLoad.from_json(read["stages"]).limit() is state.stages.limit()
    assert read["servers"][0]["in_flight"] == 3 and read["server"]["url"] == URL
    assert read["current_doc"] == "book.pdf" and read["hook_failures"] == {"on_done": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["daemon.json"]


def test_a_missing_or_torn_runtime_file_reads_as_no_daemon(tmp_path: Path):
    assert read_runtime_file(tmp_path) == {}
    (tmp_path / "daemon.json").write_text('{"pid": 1', encoding="utf-8")
    assert read_runtime_file(tmp_path) == {}

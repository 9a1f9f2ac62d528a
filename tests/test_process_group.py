"""Process groups: nothing a stop or a dead parent leaves behind, nothing foreign killed."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.messages import WorkerSetup
from ocrvl_daemon.engine.pool import EnginePool
from ocrvl_daemon.engine.worker_handle import EngineWorker
from ocrvl_daemon.process.group import (
    TOKEN_ENV,
    GroupRecord,
    ProcessGroup,
    group_alive,
    group_members,
    kill_leftover,
)
from testkit.harness import wait_until
from testkit.stand_in_worker import real_worker

# A leader that starts a grandchild in its own group, prints both PIDs, then waits.
LEADER = textwrap.dedent("""
    import signal, subprocess, sys, time
    if sys.argv[1] == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(child.pid, flush=True)
    time.sleep(120)
""")


def leader_argv(mode: str = "normal") -> list[str]:
    return [sys.executable, "-c", LEADER, mode]


@pytest.fixture
def groups() -> Iterator[list[int]]:
    """Process group ids a test started; whatever is left of them is killed afterwards."""
    started: list[int] = []
    yield started
    for pgid in started:
        for proc in group_members(pgid):
            proc.kill()


def spawn(groups: list[int], mode: str = "normal", pidfile: Path | None = None
          ) -> tuple[ProcessGroup, int]:
    group = ProcessGroup.spawn(leader_argv(mode), dict(os.environ), pidfile, what="test server")
    groups.append(group.pid)
    grandchild = int(group.stdout.readline())
    group.stdout.close()  # the leader prints nothing more
    return group, grandchild


def test_spawn_records_group_and_stop_ends_all_of_it(
        tmp_path: Path, groups: list[int], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "ocrvl_daemon.process.group")
    pidfile = tmp_path / "server.pid"
    group, grandchild = spawn(groups, pidfile=pidfile)
    assert os.getpgid(group.pid) == group.pid == os.getsid(group.pid)
    assert os.getpgid(grandchild) == group.pid
    record = GroupRecord.load(pidfile)
    assert record is not None and record.pgid == group.pid
    # Read once exec is complete (its environment appears a moment after Popen returns).
    wait_until(lambda: psutil.Process(grandchild).environ().get(TOKEN_ENV) == record.token, 5,
               what="the grandchild to carry the group token")

    assert group.stop(timeout=5)
    assert not group_alive(group.pid)
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == "zombie"
    assert group.poll() is not None  # reaped
    assert not pidfile.exists()
    messages = [r.getMessage() for r in caplog.records]
    assert any("SIGTERM to process group" in m for m in messages)
    assert any("reaped test server" in m for m in messages)


def test_stop_escalates_to_sigkill(groups: list[int], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "ocrvl_daemon.process.group")
    group, _ = spawn(groups, mode="ignore-term")
    assert group.stop(timeout=0.3)
    assert not group_alive(group.pid)
    assert group.poll() == -signal.SIGKILL
    assert any("sending SIGKILL" in r.getMessage() for r in caplog.records)


def test_leftover_of_a_dead_leader_is_killed_via_the_pidfile(tmp_path: Path,
                                                             groups: list[int]) -> None:
    pidfile = tmp_path / "server.pid"
    group, grandchild = spawn(groups, pidfile=pidfile)
    # Like a SIGKILLed vLLM API server: the engine core lives on in the group.
    os.kill(group.pid, signal.SIGKILL)
    group.proc.wait()
    assert group_alive(group.pid)

    assert kill_leftover(pidfile, timeout=5)
    assert not group_alive(group.pid)
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == "zombie"
    assert not pidfile.exists()
    assert not kill_leftover(pidfile, timeout=5)  # nothing recorded any more


def test_leftover_check_never_kills_a_foreign_group(tmp_path: Path, groups: list[int]) -> None:
    foreign = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                               start_new_session=True)
    groups.append(foreign.pid)
    try:
        pidfile = tmp_path / "server.pid"
        # As if the PID had been recycled: same number, other start time, no token.
        GroupRecord(foreign.pid, psutil.Process(foreign.pid).create_time() - 100, "0" * 16,
                    ["vllm"]).save(pidfile)
        assert not kill_leftover(pidfile, timeout=1)
        assert foreign.poll() is None
        assert not pidfile.exists()
    finally:
        foreign.kill()
        foreign.wait()


@pytest.mark.quick
def test_unreadable_pidfile_is_ignored(tmp_path: Path) -> None:
    pidfile = tmp_path / "server.pid"
    pidfile.write_text("{not json")
    assert not kill_leftover(pidfile, timeout=1)


def test_group_ends_when_the_spawning_process_is_sigkilled(groups: list[int]) -> None:
    # The parent-death signal reaches the leader, which (like vLLM) ends its children.
    script = textwrap.dedent(f"""
        import os, sys, time
        from ocrvl_daemon.process.group import ProcessGroup
        group = ProcessGroup.spawn({leader_argv()!r}, dict(os.environ))
        print(group.pid, flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        pgid = int(parent.stdout.readline())
        groups.append(pgid)
        leader = psutil.Process(pgid)
        parent.kill()
        parent.wait()
        wait_until(lambda: not leader.is_running() or leader.status() == "zombie", 10,
                   what="the leader to get its parent-death signal")
    finally:
        parent.kill()
        parent.wait()
        assert parent.stdout is not None
        parent.stdout.close()


def test_the_engine_worker_leads_its_own_group_and_a_stuck_one_is_killed(
        tmp_path: Path, groups: list[int], caplog: pytest.LogCaptureFixture) -> None:
    """A worker that does not end when its input closes (stopped with SIGSTOP here, like one
    stuck in a library call) is ended like the server: its whole group, TERM, then KILL."""
    caplog.set_level(logging.INFO, "ocrvl_daemon.process.group")
    config = Config.model_validate({"state_dir": str(tmp_path / "state"),
                                    "pipeline": {"use_layout_detection": False}})
    worker = real_worker(config)
    worker.start()
    assert worker.pid is not None
    groups.append(worker.pid)
    try:
        assert os.getpgid(worker.pid) == worker.pid, (
            "the engine worker is not the leader of a process group of its own")
        os.kill(worker.pid, signal.SIGSTOP)
    finally:
        worker.stop(timeout=0.5)
    assert not group_alive(worker.pid), "something of the engine worker's group outlived the stop"
    assert not worker.alive()
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("engine worker process group") and "SIGKILL" in m
               for m in messages), f"the escalation to SIGKILL was not logged: {messages}"
    assert any(m.startswith(f"reaped engine worker pid {worker.pid}") for m in messages), (
        f"the reaping was not logged: {messages}")


def test_a_pool_tells_every_worker_to_end_before_it_waits_for_any(
        tmp_path: Path, groups: list[int]) -> None:
    """Each worker takes most of a second to exit (its layout process, torch's teardown): a
    pool that waited for one before telling the next made a stop of 6 workers take 5 s."""
    config = Config.model_validate({"state_dir": str(tmp_path / "state"),
                                    "pipeline": {"use_layout_detection": False, "workers": 3}})
    made: list[EngineWorker] = []
    inputs_open_at_first_wait: list[int] = []

    class Observed(EngineWorker):
        def stop(self, timeout: float = 10.0) -> None:
            if not inputs_open_at_first_wait:
                inputs_open_at_first_wait.append(sum(
                    1 for w in made if w._channel is not None and not w._channel.output_closed))
            super().stop(timeout)

    def new_worker(setup: WorkerSetup) -> EngineWorker:
        made.append(Observed(setup))
        return made[-1]

    pool = EnginePool(config, new_worker=new_worker)
    pool.maintain(0.0, set())
    groups.extend(w.pid for w in made if w.pid is not None)
    assert len(made) == 3, f"the pool started {len(made)} workers, not the 3 configured"
    pool.stop()
    assert inputs_open_at_first_wait == [0], (
        f"{inputs_open_at_first_wait[0]} worker(s) had not been told to end when the pool "
        "began waiting for the first: the workers end one after another")
    assert not any(group_alive(w.pid) for w in made if w.pid is not None), (
        "a worker's process group outlived the pool's stop")

"""NVIDIA MPS for the replicas of one GPU (`server.mps`).

The control program is a fake `nvidia-cuda-mps-control` on a temporary PATH: `-d` forks a
daemon that writes its pid file and a control FIFO into $CUDA_MPS_PIPE_DIRECTORY and logs
what it sees into $CUDA_MPS_LOG_DIRECTORY; without flags it is the client that passes stdin's
commands to the daemon. The replicas are real fake-vLLM process groups.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from ocrvl_daemon.commands.doctor import machine as doctor_machine
from ocrvl_daemon.config.file import validate_config
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.backoff import Backoff
from ocrvl_daemon.errors import ConfigError, ServerConfigError
from ocrvl_daemon.process.group import group_members
from ocrvl_daemon.server import autotune, mps
from ocrvl_daemon.server.gpu import NO_NVML_ENV, NVIDIA_SMI_ENV, GpuReading
from ocrvl_daemon.server.replicas import ServerSet
from ocrvl_daemon.server.vllm_diagnosis import diagnose
from testkit.harness import free_port, wait_until
from testkit.runner import DaemonProcess, managed_fake_server, write_config

GIB = 1024
H200 = ("NVIDIA H200", 143771)

FAKE_CONTROL = r'''#!{python}
"""A stand-in for nvidia-cuda-mps-control: `-d` daemonizes, no flag sends stdin to it."""
import os, sys, time

pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
logs = os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/tmp/nvidia-log")
fifo = os.path.join(pipe, "control")


def note(line):
    with open(os.path.join(logs, "control.log"), "a") as f:
        f.write(f"{{time.time():.6f}} {{line}}\n")


def clients():
    """Live processes, other than the control program, whose environment names this pipe
    directory: the daemon's clients."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{{pid}}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{{pid}}/cmdline", "rb") as f:
                argv = f.read()
            with open(f"/proc/{{pid}}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if (b"CUDA_MPS_PIPE_DIRECTORY=" + pipe.encode() in env and state != "Z"
                and b"nvidia-cuda-mps-control" not in argv):
            found.append(int(pid))
    return found


if sys.argv[1:] == ["-d"]:
    if os.environ.get("FAKE_MPS_FAIL"):
        print("MPS control daemon: permission denied", file=sys.stderr)
        sys.exit(1)
    if os.path.exists(fifo):
        print("An instance of this daemon is already running", file=sys.stderr)
        sys.exit(1)
    os.makedirs(pipe, exist_ok=True)
    os.makedirs(logs, exist_ok=True)
    os.mkfifo(fifo)
    # This process's start time, in psutil's clock (boot time + ticks, not time.time()):
    # what a caller starts once this command returns was born at or after it.
    import psutil
    note(f"started born={{psutil.Process().create_time()}}")
    if os.fork():
        sys.exit(0)
    os.setsid()
    if os.fork():
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    with open(os.path.join(pipe, "nvidia-cuda-mps-control.pid"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        with open(fifo) as commands:
            for command in commands:
                note(f"{{command.strip()}} clients={{clients()}}")
                if command.strip() == "quit" and not os.environ.get("FAKE_MPS_IGNORE_QUIT"):
                    os.unlink(fifo)
                    os.unlink(os.path.join(pipe, "nvidia-cuda-mps-control.pid"))
                    note("ended")
                    sys.exit(0)
else:
    if not os.path.exists(fifo):
        print("Cannot find MPS control daemon process", file=sys.stderr)
        sys.exit(1)
    with open(fifo, "w") as daemon:
        daemon.write(sys.stdin.read())
'''


@pytest.fixture
def fake_bin(tmp_path: Path) -> Iterator[Path]:
    """A folder with the fake control program; every daemon it started is killed after."""
    folder = tmp_path / "bin"
    folder.mkdir()
    program = folder / mps.CONTROL
    program.write_text(FAKE_CONTROL.format(python=sys.executable))
    program.chmod(0o755)
    yield folder
    left = []
    for proc in psutil.process_iter():
        try:
            if str(program) in proc.cmdline():
                proc.kill()
                left.append(proc)
        except psutil.Error:
            continue
    # Gone before the next test looks for MPS daemons (a zombie no longer counts).
    wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                               for p in left), 10, ignore=(psutil.Error,),
               what="the fake MPS daemons gone")


def fake_nvidia_smi(tmp_path: Path, total_mib: int) -> str:
    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!/bin/sh\necho '0, GPU-00000000-0000-4000-8000-000000000000, NVIDIA H200, "
                      f"{total_mib}, 1024, {total_mib - 1024}, 560.94, 9.0'\n")
    script.chmod(0o755)
    return str(script)


def two_free_ports() -> int:
    for _ in range(50):
        port = free_port()
        if all(_free(p) for p in (port, port + 1)):
            return port
    raise AssertionError("no two free ports in a row")


def _free(port: int) -> bool:
    import socket
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def section(tmp_path: Path, fake_bin: Path | None, **server: Any) -> dict[str, Any]:
    """A managed fake-vLLM `server:` section on a fake H200, the fake MPS on its PATH."""
    env = {NVIDIA_SMI_ENV: fake_nvidia_smi(tmp_path, H200[1]), NO_NVML_ENV: "1",
           "PATH": os.pathsep.join(filter(None, [str(fake_bin or ""), os.environ["PATH"]]))}
    settings = {"health_interval": 0.2, "startup_timeout": 20, "stop_timeout": 3, **server,
                "env": {**env, **server.get("env", {})}}
    return managed_fake_server(two_free_ports(), "--disable-uvicorn-access-log", **settings)


def managed(tmp_path: Path, fake_bin: Path | None, **server: Any) -> Config:
    return validate_config({"state_dir": str(tmp_path / "state"),
                            "server": section(tmp_path, fake_bin, **server)})


def control_log(folder: Path) -> list[tuple[float, str]]:
    path = folder / "control.log"
    if not path.exists():
        return []
    return [(float(t), rest) for t, rest in (line.split(" ", 1)
                                              for line in path.read_text().splitlines())]


def foreign_daemon(tmp_path: Path, fake_bin: Path) -> tuple[Path, int]:
    """An MPS daemon someone else started (its own pipe dir, no ocrvl mark); its pipe dir
    and pid."""
    pipe, logs = tmp_path / "foreign" / "pipe", tmp_path / "foreign" / "log"
    env = {k: v for k, v in os.environ.items() if k != mps.OWNER_ENV}
    env.update({mps.PIPE_ENV: str(pipe), mps.LOG_ENV: str(logs)})
    subprocess.run([str(fake_bin / mps.CONTROL), "-d"], env=env, check=True, timeout=30)
    pidfile = pipe / "nvidia-cuda-mps-control.pid"
    wait_until(pidfile.exists, 10, what="the foreign daemon's pid file")
    return pipe, int(pidfile.read_text())


# --- configuration and the rule ------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize(("given", "read"), [("auto", "auto"), ("on", "on"), (True, "on"),
                                             ("off", "off"), (False, "off")])
def test_mps_key_reads_yaml_on_and_off(given: Any, read: str) -> None:
    assert validate_config({"server": {"mps": given}}).server.mps == read


@pytest.mark.quick
def test_bad_mps_values_are_refused_naming_key_value_and_fix() -> None:
    with pytest.raises(ConfigError) as caught:
        validate_config({"server": {"mps": "yes"}})
    assert "server.mps = 'yes'" in str(caught.value) and "auto" in str(caught.value)
    with pytest.raises(ConfigError, match=r"server.mps = 'on'.*server.mode: managed"):
        validate_config({"server": {"mps": "on", "mode": "external", "url": "http://gpu:8118"}})


@pytest.mark.quick
def test_auto_replicas_rule_by_card_size_and_mps() -> None:
    for mps_available in (False, True):
        assert autotune.auto_replicas(None, mps_available) == 1
        assert autotune.auto_replicas(24 * GIB, mps_available) == 1
        assert autotune.auto_replicas(40 * GIB, mps_available) == 2
        assert autotune.auto_replicas(80 * GIB, mps_available) == 2
    assert autotune.auto_replicas(H200[1], False) == 2, (
        "an H200 without MPS: a third server only takes turns on the card")
    assert autotune.auto_replicas(H200[1], True) == 4, (
        "an H200 under MPS: four servers measured best (bench/gpu/big_gpu.json)")
    assert [r.from_mib for r in autotune.REPLICA_RULES] == sorted(
        r.from_mib for r in autotune.REPLICA_RULES), "the rule reads from small to large"
    assert autotune.REPLICA_RULES[0].from_mib == 0, "every card has a row"


@pytest.mark.quick
@pytest.mark.parametrize(("mode", "found", "shared", "use"), [
    ("auto", mps.MpsProbe("/bin/x"), True, True),
    ("auto", mps.MpsProbe("/bin/x"), False, False),
    ("auto", mps.MpsProbe(None), True, False),
    ("auto", mps.MpsProbe("/bin/x", [4242]), True, False),
    ("on", mps.MpsProbe("/bin/x"), False, True),
    ("off", mps.MpsProbe("/bin/x"), True, False),
])
def test_mps_plan(tmp_path: Path, mode: str, found: mps.MpsProbe, shared: bool,
                  use: bool) -> None:
    config = validate_config({"state_dir": str(tmp_path), "server": {"mps": mode}})
    plan = mps.plan(config, found, shared)
    assert plan.use is use, plan.why
    assert plan.pipe_dir == tmp_path / "mps" / "pipe" and plan.log_dir == tmp_path / "mps" / "log"
    assert plan.client_env() == ({mps.PIPE_ENV: str(plan.pipe_dir),
                                  mps.LOG_ENV: str(plan.log_dir)} if use else {})


@pytest.mark.quick
def test_mps_on_that_cannot_be_honoured_is_refused_with_the_fix(tmp_path: Path) -> None:
    config = validate_config({"state_dir": str(tmp_path), "server": {"mps": "on"}})
    with pytest.raises(ServerConfigError) as caught:
        mps.plan(config, mps.MpsProbe(None), True)
    assert "server.mps = on" in caught.value.message and mps.CONTROL in caught.value.message
    assert "server.mps: auto" in (caught.value.fix or "")
    with pytest.raises(ServerConfigError) as caught:
        mps.plan(config, mps.MpsProbe("/bin/x", [4242]), True)
    assert "4242" in caught.value.message and "echo quit" in (caught.value.fix or "")


# --- real processes --------------------------------------------------------------------------


@pytest.mark.slow
def test_mps_starts_before_the_replicas_and_stops_after_they_are_reaped(
        tmp_path: Path, fake_bin: Path) -> None:
    config = managed(tmp_path, fake_bin, replicas=2)
    state = tmp_path / "state"
    pipe, logs = state / "mps" / "pipe", state / "mps" / "log"
    servers = ServerSet(config, backoff=Backoff(0.1, 0.5))
    assert all(e.config.server.env[mps.PIPE_ENV] == str(pipe) for e in servers.endpoints)
    groups: list[int] = []
    try:
        servers.start()
        wait_until(lambda: all(e.is_ready() for e in servers.endpoints), 30,
                   what="both replicas ready")
        started = control_log(logs)[0][1]
        assert started.startswith("started born="), started
        daemon_born = float(started.split("=")[1])
        daemon = int((pipe / "nvidia-cuda-mps-control.pid").read_text())
        for endpoint in servers.endpoints:
            pid = endpoint.status().pid
            assert pid is not None
            groups.append(pid)
            replica = psutil.Process(pid)
            assert replica.create_time() >= daemon_born, "a replica started before MPS"
            env = replica.environ()
            assert (env.get(mps.PIPE_ENV), env.get(mps.LOG_ENV)) == (str(pipe), str(logs))
            assert mps.OWNER_ENV not in env, "a replica must not look like the MPS daemon"
        assert psutil.pid_exists(daemon)
    finally:
        servers.stop()
    assert not any(group_members(g) for g in groups)
    said = [line for _, line in control_log(logs)]
    assert said[-2:] == ["quit clients=[]", "ended"], said
    assert not psutil.pid_exists(daemon) or psutil.Process(daemon).status() == "zombie"


@pytest.mark.slow
def test_a_quit_that_hangs_ends_in_sigkill(tmp_path: Path, fake_bin: Path) -> None:
    config = managed(tmp_path, fake_bin, replicas=2, mps="on", stop_timeout=1,
                     env={"FAKE_MPS_IGNORE_QUIT": "1"})
    servers = ServerSet(config)
    servers.start()
    try:
        assert servers.wait_ready(30)
        assert servers._mps is not None and servers._mps.running()
    finally:
        servers.stop()
    assert servers._mps is not None and not servers._mps.running(), "SIGKILL after the wait"
    assert [line for _, line in control_log(tmp_path / "state" / "mps" / "log")][-1] == \
        "quit clients=[]"
    again = ServerSet(config)
    again.start()  # past what the killed daemon left in its pipe folder
    try:
        assert again._mps is not None and again._mps.running()
    finally:
        again.kill()
    assert not again._mps.running()


@pytest.mark.slow
def test_a_daemon_that_does_not_start_is_said_and_the_replicas_serve_without_it(
        tmp_path: Path, fake_bin: Path, caplog: pytest.LogCaptureFixture) -> None:
    servers = ServerSet(managed(tmp_path, fake_bin, replicas=2, env={"FAKE_MPS_FAIL": "1"}))
    servers.start()
    try:
        wait_until(lambda: all(e.is_ready() for e in servers.endpoints), 30,
                   what="both replicas ready")
    finally:
        servers.stop()
    said = [r.getMessage() for r in caplog.records if r.name == mps.__name__]
    assert any("could not start the MPS control daemon (server.mps = auto): exit status 1: "
               "MPS control daemon: permission denied" in m and "server.mps: off" in m
               for m in said), said


@pytest.mark.slow
def test_a_foreign_mps_daemon_is_left_alone(tmp_path: Path, fake_bin: Path) -> None:
    foreign_pipe, foreign = foreign_daemon(tmp_path, fake_bin)
    try:
        with pytest.raises(ServerConfigError, match=f"pid {foreign}"):
            ServerSet(managed(tmp_path, fake_bin, replicas=2, mps="on"))
        servers = ServerSet(managed(tmp_path, fake_bin, replicas=2))
        assert servers._mps is not None and not servers._mps.plan.use
        assert "did not start" in servers._mps.plan.why
        assert all(mps.PIPE_ENV not in e.config.server.env for e in servers.endpoints)
        servers.start()
        try:
            assert servers.wait_ready(30)
        finally:
            servers.stop()
        assert psutil.Process(foreign).status() != "zombie", "ocrvl stopped a foreign daemon"
        assert (foreign_pipe / "control").exists()
    finally:
        psutil.Process(foreign).kill()


@pytest.mark.slow
def test_a_leftover_of_a_killed_ocrvl_is_replaced(tmp_path: Path, fake_bin: Path) -> None:
    config = managed(tmp_path, fake_bin, replicas=1, mps="on")
    found = mps.probe(config)
    plan = mps.plan(config, found, False)
    left = mps.MpsDaemon(plan, {**os.environ, **config.server.env}, 3)
    left.start()  # and never stopped, as by an ocrvl that was SIGKILLed
    old = [p.pid for p in left.running()]
    assert old
    servers = ServerSet(config)
    servers.start()
    try:
        assert servers.wait_ready(30)
        assert servers._mps is not None
        new = [p.pid for p in servers._mps.running()]
        assert new and not set(new) & set(old)
    finally:
        servers.stop()
    assert not left.running()


@pytest.mark.slow
def test_the_daemon_stops_mps_after_its_replicas_on_sigterm(tmp_path: Path,
                                                             fake_bin: Path) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    config = write_config(tmp_path / "config.yaml",
                          server=section(tmp_path, fake_bin, replicas=2, mps="on"),
                          inbox={"paths": [str(inbox)], "stable_seconds": 0.2})
    state = tmp_path / "state"
    pidfiles = [state / "server-gpu0-1.pid", state / "server-gpu0-2.pid"]
    with DaemonProcess(config) as daemon:
        daemon.wait_ready(60)
        wait_until(lambda: all(p.is_file() for p in pidfiles), 30, what="both replicas")
        groups = [json.loads(p.read_text())["pgid"] for p in pidfiles]
        mps_pid = int((state / "mps" / "pipe" / "nvidia-cuda-mps-control.pid").read_text())
        assert daemon.terminate() == 0, daemon.log()
        log = daemon.log()
    assert not any(group_members(g) for g in groups)
    said = [line for _, line in control_log(state / "mps" / "log")]
    assert said[-2:] == ["quit clients=[]", "ended"], said
    wait_until(lambda: not psutil.pid_exists(mps_pid)
               or psutil.Process(mps_pid).status() == "zombie", 10, what="MPS gone")
    assert log.index("starting the MPS control daemon") < log.index("started server")
    assert log.rindex("reaped server") < log.index("stopping the MPS control daemon: quit")
    assert "MPS control daemon ended" in log


@pytest.mark.quick
def test_an_mps_failure_in_the_servers_output_names_the_key() -> None:
    diagnosis = diagnose("RuntimeError: CUDA error: cudaErrorMpsConnectionFailed")
    assert diagnosis is not None and diagnosis.kind == "mps"
    assert "server.mps: off" in diagnosis.fix


@pytest.mark.quick
def test_doctor_says_whether_mps_is_used(tmp_path: Path) -> None:
    card = GpuReading(0, "GPU-x", *H200, 1024, H200[1] - 1024, "560", (9, 0), "nvml")
    auto = validate_config({"state_dir": str(tmp_path), "server": {"mps": "auto"}})
    check = doctor_machine.mps_check(auto, card, mps.MpsProbe("/usr/bin/nvidia-cuda-mps-control"))
    assert (check.status, check.detail) == ("ok", "used (auto: replicas share a GPU and MPS is "
                                            "installed); nvidia-cuda-mps-control: "
                                            "/usr/bin/nvidia-cuda-mps-control")
    check = doctor_machine.mps_check(auto, card, mps.MpsProbe(None))
    assert check.status == "info" and check.detail.startswith("not used (auto:")
    on = validate_config({"state_dir": str(tmp_path), "server": {"mps": "on"}})
    check = doctor_machine.mps_check(on, card, mps.MpsProbe(None))
    assert check.status == "fail" and "server.mps: auto" in (check.fix or "")

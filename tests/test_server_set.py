"""Several model servers: replicas per GPU, a set per GPU, several external URLs.

The replicas are real fake-vLLM process groups started by ManagedServer; the GPUs are a fake
nvidia-smi's.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from ocrvl_daemon.config.file import validate_config
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.backoff import Backoff
from ocrvl_daemon.errors import ConfigError, ServerConfigError
from ocrvl_daemon.process.group import group_members
from ocrvl_daemon.server import autotune
from ocrvl_daemon.server.gpu import NO_NVML_ENV, NVIDIA_SMI_ENV, GpuReading, read_gpus
from ocrvl_daemon.server.replicas import ServerSet
from ocrvl_daemon.server.supervisor import ServerState, ServerStatus
from testkit.documents import make_pdf
from testkit.harness import free_port, start_fake_server, wait_until
from testkit.runner import (
    PACKAGE_ROOT,
    DaemonProcess,
    managed_fake_server,
    run_ocrvl,
    write_config,
)

GIB = 1024
H200 = ("NVIDIA H200", 143771)
RTX_4060 = ("NVIDIA GeForce RTX 4060", 8188)


def fake_nvidia_smi(tmp_path: Path, *cards: tuple[str, int], used_mib: int = 1024) -> str:
    """An nvidia-smi that lists `cards` (name, MiB), each with `used_mib` in use."""
    lines = "".join(
        f"echo '{i}, GPU-0000000{i}-0000-4000-8000-000000000000, {name}, {total}, {used_mib}, "
        f"{total - used_mib}, 560.94, 9.0'\n" for i, (name, total) in enumerate(cards))
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + lines)
    script.chmod(0o755)
    return str(script)


def two_free_ports() -> int:
    """A port whose next one is free too (replicas take server.port, +1, ...)."""
    for _ in range(50):
        port = free_port()
        if port < 65535 and _free(port + 1):
            return port
    raise AssertionError("no two free ports in a row")


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def managed(tmp_path: Path, *cards: tuple[str, int], fake_args: tuple[str, ...] = (),
            **server: Any) -> Config:
    """A managed fake-vLLM config on the fake GPUs `cards`."""
    section = managed_fake_server(
        two_free_ports(), "--disable-uvicorn-access-log", *fake_args, health_interval=0.2,
        startup_timeout=20, stop_timeout=3,
        env={NVIDIA_SMI_ENV: fake_nvidia_smi(tmp_path, *cards), NO_NVML_ENV: "1"}, **server)
    return validate_config({"state_dir": str(tmp_path / "state"), "server": section})


def config_error(server: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as caught:
        validate_config({"server": server})
    return str(caught.value)


@pytest.fixture
def running() -> Iterator[Callable[..., tuple[ServerSet, list[tuple[float, str, ServerStatus]]]]]:
    """Start server sets, recording (time, endpoint, status) of every change; each set is
    stopped and every process group it ran checked gone afterwards."""
    started: list[tuple[ServerSet, list[tuple[float, str, ServerStatus]]]] = []

    def start(config: Config) -> tuple[ServerSet, list[tuple[float, str, ServerStatus]]]:
        changes: list[tuple[float, str, ServerStatus]] = []
        lock = threading.Lock()

        def remember(status: ServerStatus) -> None:
            name = next(e.name for e in servers.endpoints if e.url == status.url)
            with lock:
                changes.append((time.monotonic(), name, status))

        servers = ServerSet(config, on_change=remember,
                            backoff=Backoff(0.1, 0.5))
        started.append((servers, changes))
        servers.start()
        return servers, changes

    yield start
    for servers, changes in started:
        servers.stop()
        for pgid in {status.pid for _, _, status in changes if status.pid is not None}:
            left = group_members(pgid)
            for proc in left:
                proc.kill()
            assert not left, f"server group {pgid} outlived stop(): {left}"


def first(changes: list[tuple[float, str, ServerStatus]], name: str,
          state: ServerState) -> float:
    return next(t for t, n, s in changes if n == name and s.state is state)


# --- configuration ---------------------------------------------------------------------------


@pytest.mark.quick
def test_a_url_listed_twice_is_refused_naming_it() -> None:
    message = config_error({"mode": "external",
                            "urls": ["http://gpu-a:8118", "http://gpu-b:8118/v1",
                                     "http://gpu-a:8118/v1/"]})
    assert "server.urls" in message and "http://gpu-a:8118/v1 twice" in message, message


@pytest.mark.quick
def test_url_and_urls_together_are_refused() -> None:
    message = config_error({"mode": "external", "url": "http://gpu-a:8118/v1",
                            "urls": ["http://gpu-b:8118/v1"]})
    assert "server.urls" in message and "not both" in message, message


@pytest.mark.parametrize(("server", "key"), [
    ({"mode": "external", "url": "http://gpu-a:8118/v1", "replicas": 2}, "server.replicas"),
    ({"mode": "external", "url": "http://gpu-a:8118/v1", "gpus": [0]}, "server.gpus"),
    ({"mode": "managed", "urls": ["http://gpu-a:8118/v1"]}, "server.urls"),
])
@pytest.mark.quick
def test_keys_of_the_other_mode_are_refused(server: dict[str, Any], key: str) -> None:
    message = config_error(server)
    assert key in message and "mode" in message, message


@pytest.mark.parametrize(("server", "key"), [
    ({"replicas": 0}, "server.replicas"), ({"replicas": "two"}, "server.replicas"),
    ({"gpus": [0, 0]}, "server.gpus"), ({"gpus": []}, "server.gpus"),
    ({"gpus": ["first"]}, "server.gpus"),
])
@pytest.mark.quick
def test_bad_replicas_and_gpus_are_refused_naming_the_key(server: dict[str, Any],
                                                         key: str) -> None:
    message = config_error(server)
    assert f"Config key {key} =" in message, message


@pytest.mark.quick
def test_several_urls_are_normalised_and_the_first_is_the_base_url() -> None:
    server = validate_config({"server": {"mode": "external", "urls": [
        "http://gpu-a:8118", "https://gpu-b/v1/"]}}).server
    assert server.urls == ["http://gpu-a:8118/v1", "https://gpu-b/v1"]
    assert server.base_url == "http://gpu-a:8118/v1"


@pytest.mark.quick
def test_replicas_auto_rule() -> None:
    assert autotune.auto_replicas(None) == 1, "without a GPU reading: one server"
    for small in (8 * GIB, 12 * GIB, 24 * GIB, 32 * GIB):
        assert autotune.auto_replicas(small) == 1, f"{small} MiB: the GPU is the limit"
    for large in (40 * GIB, 48 * GIB, 80 * GIB, 141 * GIB):
        assert autotune.auto_replicas(large) == 2, f"{large} MiB: room for two servers"


def test_replicas_that_cannot_fit_are_refused_with_the_numbers(tmp_path: Path) -> None:
    config = managed(tmp_path, RTX_4060, replicas=4)
    with pytest.raises(ServerConfigError) as caught:
        ServerSet(config)
    message = str(caught.value)
    assert "server.replicas = 4 does not fit NVIDIA GeForce RTX 4060 (8.0 GiB)" in message
    assert "each replica would get 1.0 GiB, one needs at least 2.6 GiB" in message, message
    assert "1.6 weights + 0.9 start-up + 0.1 KV for 5632 tokens" in message, message
    assert "server.replicas: 1 or auto" in message, message
    assert not list((tmp_path / "state").glob("server*.pid")), "nothing may have started"


def test_auto_replicas_and_gpus_follow_the_cards(tmp_path: Path) -> None:
    small = ServerSet(managed(tmp_path, RTX_4060))
    assert [e.name for e in small.endpoints] == ["server"]
    assert "CUDA_VISIBLE_DEVICES" not in small.endpoints[0].config.server.env, \
        "one GPU: the environment decides, as before"
    big = ServerSet(managed(tmp_path, H200, H200))
    base = big.config.server.port
    assert [(e.name, e.config.server.port, e.config.server.env["CUDA_VISIBLE_DEVICES"])
            for e in big.endpoints] == [("gpu0/1", base, "0"), ("gpu0/2", base + 1, "0"),
                                        ("gpu1/1", base + 2, "1"), ("gpu1/2", base + 3, "1")]
    assert len({e.url for e in big.endpoints}) == 4


def test_gpus_follow_cuda_visible_devices(tmp_path: Path) -> None:
    config = managed(tmp_path, RTX_4060, RTX_4060, RTX_4060, gpus=[1], replicas=1)
    env = {**config.server.env, "CUDA_VISIBLE_DEVICES": "2,0"}
    assert [r.index for r in read_gpus(env)] == [2, 0]
    config.server.env = env
    servers = ServerSet(config)
    assert [e.config.server.env["CUDA_VISIBLE_DEVICES"] for e in servers.endpoints] == ["0"], \
        "server.gpus counts the GPUs as CUDA numbers the visible ones"


def test_a_gpu_that_is_not_there_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ServerConfigError, match=r"server.gpus = \[0, 3\] names GPU 3"):
        ServerSet(managed(tmp_path, H200, H200, gpus=[0, 3]))


@pytest.mark.quick
def test_each_replica_gets_its_share_of_the_card() -> None:
    config = validate_config({"server": {"replicas": 2}})
    card = GpuReading(0, "GPU-x", H200[0], H200[1], 1024, H200[1] - 1024, "560", (9, 0), "nvml")
    whole = autotune.plan_vllm_args(validate_config({"server": {"replicas": 1}}), card)
    shared = autotune.plan_vllm_args(config, card)
    assert shared.values[autotune.UTILIZATION] == autotune.floor2(
        whole.values[autotune.UTILIZATION] / 2)
    explicit = validate_config({"server": {"replicas": 3, "vllm_args": {
        "gpu-memory-utilization": 0.9}}})
    assert autotune.plan_vllm_args(explicit, card).values[autotune.UTILIZATION] == 0.3


@pytest.mark.quick
def test_remembered_settings_are_kept_per_replica_count(tmp_path: Path) -> None:
    card = GpuReading(0, "GPU-x", H200[0], H200[1], 1024, H200[1] - 1024, "560", (9, 0), "nvml")
    model = "PaddleOCR-VL-1.6-0.9B"
    autotune.save_remembered(tmp_path, card, model, {autotune.UTILIZATION: 0.2}, replicas=3)
    assert autotune.load_remembered(tmp_path, card, model, 3) == {autotune.UTILIZATION: 0.2}
    assert autotune.load_remembered(tmp_path, card, model) is None, \
        "a share lowered for three servers must not starve one"
    assert set(json.loads((tmp_path / autotune.TUNING_FILE).read_text())) == {
        f"GPU-x|{model}|3 replicas"}


@pytest.mark.quick
def test_oom_step_down_of_a_replica_stays_below_its_share(tmp_path: Path) -> None:
    config = validate_config({"server": {"replicas": 2}})
    text = ("ValueError: Free memory on device (30.0/140.0 GiB) on startup is less than desired "
            "GPU memory utilization (0.45, 63.00 GiB).")
    lowered = autotune.next_after_oom({autotune.UTILIZATION: 0.45}, config, text)
    assert lowered is not None and lowered[autotune.UTILIZATION] == 0.25, lowered


# --- real processes --------------------------------------------------------------------------


@pytest.mark.slow
def test_replicas_start_one_after_another_on_their_own_ports(tmp_path: Path,
                                                            running: Any) -> None:
    config = managed(tmp_path, H200, fake_args=("--startup-delay", "1.0"), replicas=2,
                     gpus=[0])
    servers, changes = running(config)
    assert servers.wait_ready(20), servers.status()
    wait_until(lambda: all(e.is_ready() for e in servers.endpoints), 30,
               what="both replicas ready")
    one, two = servers.endpoints
    assert (one.name, two.name) == ("gpu0/1", "gpu0/2")
    assert first(changes, "gpu0/2", ServerState.STARTING) >= first(
        changes, "gpu0/1", ServerState.READY), "the second replica started before the first"
    assert one.url != two.url and two.config.server.port == one.config.server.port + 1
    for endpoint, pidfile in ((one, "server-gpu0-1.pid"), (two, "server-gpu0-2.pid")):
        assert (tmp_path / "state" / pidfile).is_file(), f"{pidfile} missing"
        pid = endpoint.status().pid
        assert pid is not None
        assert psutil.Process(pid).environ().get("CUDA_VISIBLE_DEVICES") == "0"
    shares = [e.vllm_args[autotune.UTILIZATION] for e in servers.endpoints]
    assert shares[0] == shares[1] <= 0.475, f"each replica gets half the card: {shares}"


@pytest.mark.slow
def test_a_killed_replica_restarts_alone(tmp_path: Path, running: Any) -> None:
    servers, changes = running(managed(tmp_path, H200, replicas=2))
    wait_until(lambda: all(e.is_ready() for e in servers.endpoints), 30,
               what="both replicas ready")
    one, two = servers.endpoints
    victim, survivor = one.status().pid, two.status().pid
    assert victim is not None and survivor is not None
    since = time.monotonic()
    os.killpg(victim, signal.SIGKILL)
    wait_until(lambda: one.is_ready() and one.status().pid not in (None, victim), 30,
               what="the killed replica restarted")
    assert one.restart_count == 1
    assert two.status().pid == survivor and two.restart_count == 0
    assert [s.state for t, n, s in changes if n == two.name and t >= since] == [], \
        "the other replica must stay ready while one restarts"
    assert servers.is_ready()


@pytest.mark.slow
def test_replicas_killed_together_restart_one_at_a_time(tmp_path: Path, running: Any) -> None:
    config = managed(tmp_path, H200, fake_args=("--startup-delay", "1.0"), replicas=2,
                     gpus=[0])
    servers, changes = running(config)
    wait_until(lambda: all(e.is_ready() for e in servers.endpoints), 30,
               what="both replicas ready")
    pids = [e.status().pid for e in servers.endpoints]
    since = time.monotonic()
    for pid in pids:
        assert pid is not None
        os.killpg(pid, signal.SIGKILL)
    wait_until(lambda: all(e.is_ready() and e.status().pid not in pids
                           for e in servers.endpoints), 40, what="both replicas restarted")

    def launch_to_ready(name: str) -> tuple[float, float]:
        mine = [(t, s) for t, n, s in changes if n == name and t >= since]
        launched = next(t for t, s in mine if s.phase == "launching")
        return launched, next(t for t, s in mine if t >= launched
                              and s.state is ServerState.READY)

    spans = sorted(launch_to_ready(e.name) for e in servers.endpoints)
    (_, first_ready), (second_launch, _) = spans
    assert second_launch >= first_ready, (
        "two replicas of one GPU started at the same time after a crash: vLLM's memory "
        "profiling would count each other's memory")
    assert any(s.phase.startswith("waiting for another server") for t, _, s in changes
               if t >= since), "the second restart did not wait for the first"


@pytest.mark.slow
def test_two_external_urls_are_two_endpoints(tmp_path: Path, running: Any) -> None:
    with start_fake_server(free_port()) as a, start_fake_server(free_port()) as b:
        config = validate_config({"state_dir": str(tmp_path / "state"), "server": {
            "mode": "external", "urls": [a.url, b.url], "health_interval": 0.2}})
        servers, _ = running(config)
        wait_until(lambda: all(e.is_ready() for e in servers.endpoints), 20,
                   what="both external servers ready")
        assert [e.url for e in servers.endpoints] == [a.api_url, b.api_url]
        assert [e.name for e in servers.endpoints] == [
            f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]
        b.stop()
        wait_until(lambda: not servers.endpoints[1].is_ready(), 20, what="b seen down")
        assert servers.endpoints[0].is_ready() and servers.is_ready()


def shared_card_nvidia_smi(tmp_path: Path, ledger: Path, total_mib: int,
                           used_mib: int) -> str:
    """An nvidia-smi for one card that also counts what the live fake servers on it hold."""
    script = tmp_path / "nvidia-smi-shared"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"sys.path.insert(0, {str(PACKAGE_ROOT)!r})\n"
        "from testkit.fake_server.startup import ledger_used_gib\n"
        f"used = {used_mib} + int(ledger_used_gib({str(ledger)!r}, 0) * 1024)\n"
        f"print(f'0, GPU-00000000-0000-4000-8000-000000000048, NVIDIA L40S, {total_mib}, "
        f"{{used}}, {{{total_mib} - used}}, 560.94, 8.9')\n")
    script.chmod(0o755)
    return str(script)


@pytest.mark.slow
def test_a_restarting_replica_passes_the_free_memory_check_beside_the_running_one(
        tmp_path: Path, running: Any, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM starts only if free >= utilization x total: with the card's share split, a
    replica that restarts fits beside the one that keeps running, and both plan the same
    share though the other's memory is in use when they do."""
    caplog.set_level(logging.INFO, "ocrvl_daemon")
    ledger = tmp_path / "card"
    ledger.mkdir()
    section = managed_fake_server(
        two_free_ports(), "--disable-uvicorn-access-log", "--fake-vram-gib", "48",
        "--fake-vram-used-gib", "1", "--fake-vram-ledger", str(ledger), health_interval=0.2,
        startup_timeout=20, stop_timeout=3, replicas=2,
        env={NVIDIA_SMI_ENV: shared_card_nvidia_smi(tmp_path, ledger, 48 * GIB, GIB),
             NO_NVML_ENV: "1"})
    config = validate_config({"state_dir": str(tmp_path / "state"), "server": section})
    servers, _ = running(config)
    wait_until(lambda: all(e.is_ready() for e in servers.endpoints), 30,
               what="both replicas ready")
    one, two = servers.endpoints
    shares = [e.vllm_args[autotune.UTILIZATION] for e in (one, two)]
    assert shares[0] == shares[1], f"the second planned with the first's memory in use: {shares}"
    victim = one.status().pid
    assert victim is not None
    os.killpg(victim, signal.SIGKILL)
    wait_until(lambda: one.is_ready() and one.status().pid not in (None, victim), 30,
               what="the killed replica restarted")
    assert one.restart_count == 1 and two.restart_count == 0
    assert one.vllm_args[autotune.UTILIZATION] == shares[0]
    oom = [r.getMessage() for r in caplog.records if "ran out of GPU memory" in r.getMessage()]
    assert not oom, f"a replica did not fit beside the other: {oom}"


@pytest.mark.slow
def test_convert_server_url_is_the_one_endpoint_whatever_the_config_lists(
        tmp_path: Path) -> None:
    dead = [f"http://127.0.0.1:{free_port()}/v1" for _ in range(2)]
    config = write_config(tmp_path / "config.yaml",
                          server={"mode": "external", "urls": dead})
    pdf = make_pdf(tmp_path / "letter.pdf", 1)
    with start_fake_server(free_port()) as server:
        result = run_ocrvl("convert", "--config", config, "--server-url", server.api_url, pdf)
    assert result.returncode == 0, result.stderr
    assert pdf.with_suffix(".md").is_file()


@pytest.mark.slow
def test_the_daemon_runs_both_replicas_converts_and_stops_them(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    section = managed_fake_server(
        two_free_ports(), "--disable-uvicorn-access-log", replicas=2, health_interval=0.2,
        stop_timeout=3, env={NVIDIA_SMI_ENV: fake_nvidia_smi(tmp_path, H200),
                             NO_NVML_ENV: "1"})
    config = write_config(tmp_path / "config.yaml", server=section,
                          inbox={"paths": [str(inbox)], "stable_seconds": 0.2})
    state = tmp_path / "state"
    with DaemonProcess(config) as daemon:
        daemon.wait_ready(60)
        pidfiles = [state / "server-gpu0-1.pid", state / "server-gpu0-2.pid"]
        wait_until(lambda: all(p.is_file() for p in pidfiles), 30,
                   what="both replicas running")
        groups = [json.loads(p.read_text())["pgid"] for p in pidfiles]
        pdf = make_pdf(inbox / "letter.pdf", 1)
        wait_until(lambda: pdf.with_suffix(".md").is_file(), 120, what="letter.md written")
        assert daemon.terminate() == 0, daemon.log()
    assert not any(group_members(g) for g in groups), "a replica outlived the daemon"
    assert not any(p.exists() for p in pidfiles)

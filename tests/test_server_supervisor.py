"""The server supervisor against real fake-vLLM processes: start-up, faults, restarts, stops."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from ocrvl_daemon.config.file import validate_config
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.backoff import Backoff
from ocrvl_daemon.errors import ServerConfigError
from ocrvl_daemon.process.group import group_members
from ocrvl_daemon.server import gpu as gpu_module
from ocrvl_daemon.server.external import ExternalServer
from ocrvl_daemon.server.gpu import NO_NVML_ENV, NVIDIA_SMI_ENV
from ocrvl_daemon.server.managed import ManagedServer
from ocrvl_daemon.server.supervisor import (
    ServerState,
    ServerStatus,
    ServerSupervisor,
    StallDetector,
)
from ocrvl_daemon.server.vllm_diagnosis import diagnose, parse_phase
from testkit import fake_server_env
from testkit.fake_server import FIXED_FAILURES
from testkit.fake_server_env import FakeVllm
from testkit.harness import (
    fake_server_command,
    free_port,
    start_fake_server,
    wait_until,
)

MODEL = "PaddleOCR-VL-1.6-0.9B"
FAST_BACKOFF = Backoff(0.1, 0.5)


def make_config(tmp_path: Path, *fake_args: str, served_name: str = "{model}",
                **server: Any) -> Config:
    """A managed `command` server running the fake vLLM with small timeouts."""
    command = fake_server_command("--host", "{host}", "--port", "{port}", "--served-model-name",
                                  served_name, "{vllm_args}", "--disable-uvicorn-access-log",
                                  *fake_args)
    settings: dict[str, Any] = {
        "launcher": "command", "command": command, "port": free_port(),
        "health_interval": 0.2, "startup_timeout": 20, "stall_timeout": 1.0,
        "stop_timeout": 3, "restart_backoff_max": 0.5,
        # No GPU reading, whatever the machine has: `auto` is the fixed fallback.
        "env": {NO_NVML_ENV: "1", NVIDIA_SMI_ENV: str(tmp_path / "no-nvidia-smi")}, **server,
    }
    return validate_config({"state_dir": str(tmp_path / "state"), "server": settings})


@pytest.fixture
def supervise() -> Iterator[Callable[..., ServerSupervisor]]:
    """Start supervisors; each is stopped, and every group it ran checked gone, afterwards."""
    started: list[tuple[ServerSupervisor, set[int]]] = []

    def start(config: Config, **kwargs: Any) -> ServerSupervisor:
        pids: set[int] = set()

        def remember(status: ServerStatus) -> None:
            if status.pid is not None:
                pids.add(status.pid)
            if "on_change" in kwargs:
                kwargs["on_change"](status)

        sup: ServerSupervisor = (
            ExternalServer(config, remember) if config.server.mode == "external" else
            ManagedServer(config, remember, kwargs.get("backoff", FAST_BACKOFF)))
        started.append((sup, pids))
        sup.start()
        return sup

    yield start
    for sup, pids in started:
        sup.stop()
        for pgid in pids:
            left = group_members(pgid)
            for proc in left:
                proc.kill()
            assert not left, f"server group {pgid} outlived stop(): {left}"


def chat(sup: ServerSupervisor, timeout: float = 10.0) -> int:
    """One text-only chat request; its HTTP status (0 if the connection broke)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "OCR:"}],
            "max_completion_tokens": 16}
    try:
        response = httpx.post(sup.config.server.base_url + "/chat/completions", json=body,
                              timeout=timeout)
    except httpx.HTTPError:
        return 0
    return response.status_code


def restarted(sup: ServerSupervisor, old_pid: int | None) -> bool:
    status = sup.status()
    return status.state is ServerState.READY and status.pid not in (None, old_pid)


# --- policies and parsers (no processes) ---------------------------------------------------


def test_stall_detector() -> None:
    detector = StallDetector(timeout=10)
    detector.observe(0, 5, now=0)
    assert not detector.stalled(100)  # idle is not hung
    detector.observe(3, 5, now=100)
    assert not detector.stalled(109)
    detector.observe(3, 6, now=105)  # progress restarts the clock
    assert not detector.stalled(114)
    assert detector.stalled(115)


@pytest.mark.parametrize(("kind", "expected"), [
    ("oom-kv", "no_kv_memory"), ("free-memory", "free_memory"), ("max-len", "max_len"),
    ("cuda-oom", "cuda_oom")])
def test_diagnose_vllm_startup_failures(kind: str, expected: str) -> None:
    text = f"EngineCore failed to start.\n{FIXED_FAILURES[kind]}\nRuntimeError: Engine core"
    diagnosis = diagnose(text)
    assert diagnosis is not None and diagnosis.kind == expected
    assert not diagnosis.permanent
    assert "gpu-memory-utilization" in diagnosis.fix or "max-model-len" in diagnosis.fix


def test_diagnose_names_the_length_that_fits_and_other_causes() -> None:
    max_len = diagnose(FIXED_FAILURES["max-len"])
    assert max_len is not None and max_len.limit == 40336 and "40336" in max_len.fix
    port = diagnose("ERROR: [Errno 98] error while attempting to bind: address already in use")
    assert port is not None and port.kind == "port_in_use" and "server.port" in port.fix
    missing = diagnose("/usr/bin/python: No module named vllm")
    assert missing is not None and missing.permanent and "ocrvl setup-server" in missing.fix
    assert diagnose("sh: 1: vllm: not found") == missing
    assert diagnose("all is well") is None


def test_parse_phase_from_vllm_lines() -> None:
    lines = {
        "(EngineCore_DP0 pid=7) INFO 01-02 10:00:00 [gpu_model_runner.py:1] Starting to load "
        "model PaddlePaddle/PaddleOCR-VL...": "loading weights",
        "INFO 01-02 10:00:05 [default_loader.py:1] Loading weights took 0.43 seconds":
            "profiling memory",
        "INFO 01-02 10:00:09 [kv_cache_utils.py:1] GPU KV cache size: 135,472 tokens":
            "allocating KV cache (135,472 tokens)",
        "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 40%|####":
            "capturing CUDA graphs",
        "INFO 01-02 10:00:30 [api_server.py:1] Starting vLLM API server 0 on http://127.0.0.1:8118":
            "starting API server",
        "INFO:     127.0.0.1:5000 - \"GET /health HTTP/1.1\" 200 OK": None,
    }
    for line, phase in lines.items():
        assert parse_phase(line) == phase, line


# --- managed server life cycle -------------------------------------------------------------


def test_slow_start_within_grace_is_not_a_crash(tmp_path: Path, supervise: Any) -> None:
    changes: list[ServerStatus] = []
    config = make_config(tmp_path, "--startup-delay", "2", api_key="s3cret")
    sup = supervise(config, on_change=changes.append)
    assert not sup.is_ready()
    assert sup.wait_ready(15), sup.status()
    phases = [c.phase for c in changes if c.state is ServerState.STARTING]
    for phase in ("loading weights", "profiling memory", "allocating KV cache (65,536 tokens)",
                  "capturing CUDA graphs", "starting API server"):
        assert phase in phases
    assert sup.restart_count == 0 and sup.status().last_error is None
    assert sup.status().url == config.server.base_url
    # The API key went to the server (it rejects requests without it) and to the probes.
    assert chat(sup) == 401


def test_state_is_starting_as_soon_as_start_returns(tmp_path: Path, supervise: Any) -> None:
    # `ocrvl status` and systemd's STATUS= must not say "stopped" for a server being started.
    managed = supervise(make_config(tmp_path))
    assert managed.state is ServerState.STARTING, "a managed server just started shows stopped"
    _, external = watch_external(tmp_path, supervise)
    assert external.state is ServerState.UNREACHABLE, (
        "an external server not answering yet shows stopped, or starting (ocrvl starts none)")
    assert external.phase == "", "the phase repeats what the state and URL say"


@pytest.mark.slow
def test_crash_after_requests_is_restarted(tmp_path: Path, supervise: Any) -> None:
    sup = supervise(make_config(tmp_path, "--crash-after", "2"))
    assert sup.wait_ready(15)
    first = sup.status().pid
    assert chat(sup) == 200
    assert chat(sup) == 500  # the engine dies; the API server exits 0 a moment later
    wait_until(lambda: restarted(sup, first), 20, what="a restarted server")
    status = sup.status()
    assert status.restart_count == 1
    # Whichever the supervisor saw first: the 503 or the exit.
    assert status.last_error is not None
    assert "503" in status.last_error or "exited with status 0" in status.last_error
    assert first is not None and not group_members(first)
    assert chat(sup) == 200


@pytest.mark.slow
def test_clean_exit_of_the_server_is_a_failure(tmp_path: Path, supervise: Any) -> None:
    sup = supervise(make_config(tmp_path))
    assert sup.wait_ready(15)
    first = sup.status().pid
    os.kill(first, signal.SIGTERM)  # the fake shuts down and exits 0
    wait_until(lambda: restarted(sup, first), 20, what="a restarted server")
    assert "exited with status 0" in (sup.status().last_error or "")


@pytest.mark.slow
def test_hung_server_is_detected_by_metrics_and_restarted(tmp_path: Path,
                                                          supervise: Any) -> None:
    sup = supervise(make_config(tmp_path, "--hang-after", "1", stall_timeout=1.0))
    assert sup.wait_ready(15)
    first = sup.status().pid
    hung = threading.Thread(target=chat, args=(sup, 30.0), daemon=True)
    hung.start()
    wait_until(lambda: restarted(sup, first), 20, what="a restarted server")
    last_error = sup.status().last_error
    assert last_error is not None and "hung" in last_error and "/metrics" in last_error
    hung.join(10)
    assert not hung.is_alive()  # the stop released the hung request


def test_one_metrics_scrape_serves_hang_detection_and_the_converter(tmp_path: Path,
                                                                    supervise: Any) -> None:
    sup = supervise(make_config(tmp_path))
    assert sup.wait_ready(15)
    assert chat(sup) == 200
    # want=False: the converter asks for no scrape of its own; what it gets is the sample the
    # supervisor's hang check fetched, finished requests included.
    sample = wait_until(lambda: (m := sup.metrics(want=False)) and m.finished_total and m, 10,
                        what="the hang check's /metrics sample to reach the converter")
    assert sample.finished_total == 1 and sample.in_flight == 0


@pytest.mark.slow
def test_client_reported_stall_restarts_the_server(tmp_path: Path, supervise: Any) -> None:
    sup = supervise(make_config(tmp_path, stall_timeout=0.5))
    assert sup.wait_ready(15)
    first = sup.status().pid
    sup.note_progress(in_flight=2, completed_total=7)  # and never any further
    wait_until(lambda: restarted(sup, first), 20, what="a restarted server")
    last_error = sup.status().last_error
    assert last_error is not None and "ocrvl's requests" in last_error


@pytest.mark.slow
def test_health_503_is_restarted(tmp_path: Path, supervise: Any) -> None:
    sup = supervise(make_config(tmp_path, "--health-503-after", "1"))
    assert sup.wait_ready(15)
    first = sup.status().pid
    assert chat(sup) == 200
    wait_until(lambda: restarted(sup, first), 20, what="a restarted server")
    last_error = sup.status().last_error
    assert last_error is not None and "503" in last_error


def test_wrong_model_name_fails_without_retry(tmp_path: Path, supervise: Any) -> None:
    sup = supervise(make_config(tmp_path, served_name="SomeOtherModel"))
    assert not sup.wait_ready(15)
    status = sup.status()
    assert status.state is ServerState.FAILED
    assert isinstance(sup.error, ServerConfigError)
    message = str(sup.error)
    assert "SomeOtherModel" in message and MODEL in message and "--served-model-name" in message
    assert status.restart_count == 0
    with pytest.raises(ServerConfigError):
        raise sup.error  # type: ignore[misc]


def test_port_taken_is_diagnosed_and_retried(tmp_path: Path, supervise: Any) -> None:
    config = make_config(tmp_path)
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", config.server.port))
    blocker.listen()
    try:
        sup = supervise(config)
        wait_until(lambda: sup.restart_count >= 2, 10, what="retries")
        status = sup.status()
        assert status.state is not ServerState.READY and status.pid is None
        assert status.diagnosis is not None and status.diagnosis.kind == "port_in_use"
        assert "address already in use" in (status.last_error or "")
    finally:
        blocker.close()
    assert sup.wait_ready(15)  # the port is free again: it recovers on its own


@pytest.mark.slow
def test_crash_loop_is_reported_loudly_and_retried(tmp_path: Path, supervise: Any,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "ocrvl_daemon")
    sup = supervise(make_config(tmp_path, "--fail-start", "oom-kv"))

    def loud() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.levelno == logging.ERROR
                and "keeps failing" in r.getMessage()]

    # The out-of-memory steps come first (tests/test_oom_recovery.py), then the crash loop.
    wait_until(loud, 30, what="a crash loop report")
    assert not sup.is_ready()
    assert sup.diagnosis is not None and sup.diagnosis.kind == "no_kv_memory"
    assert "out of memory" in sup.diagnosis.cause
    assert "No available memory for the cache blocks" in loud()[0].getMessage()
    assert "Nothing ocrvl may change is left to lower" in loud()[0].getMessage()
    # The server's own lines went to the child logger, line by line.
    assert any(r.name == "ocrvl_daemon.server.managed.vllm"
               and "EngineCore failed" in r.getMessage() for r in caplog.records)


def test_stop_leaves_no_process_of_the_group(tmp_path: Path, supervise: Any) -> None:
    config = make_config(tmp_path, "--spawn-engine-child")
    sup = supervise(config)
    assert sup.wait_ready(15)
    pgid = sup.status().pid
    assert pgid is not None
    assert len(group_members(pgid)) == 2  # the API server and its engine core
    sup.stop()
    sup.stop()  # idempotent
    assert sup.state is ServerState.STOPPED
    assert not group_members(pgid)
    assert not (config.state_dir / "server.pid").exists()


# --- the supervising process dies ----------------------------------------------------------

SUPERVISOR_SCRIPT = textwrap.dedent("""
    import sys, time
    from ocrvl_daemon.config.file import load_config
    from ocrvl_daemon.server.managed import ManagedServer
    sup = ManagedServer(load_config(sys.argv[1])[0])
    sup.start()
    if not sup.wait_ready(30):
        sys.exit(3)
    print(sup.status().pid, flush=True)
    time.sleep(120)
""")


@pytest.fixture
def supervisor_process(tmp_path: Path) -> Iterator[Callable[[Config], tuple[Any, int]]]:
    """Run a supervisor in a child process; returns (process, server pgid)."""
    procs: list[subprocess.Popen[bytes]] = []

    def run(config: Config) -> tuple[subprocess.Popen[bytes], int]:
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
        proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR_SCRIPT, str(path)],
                                stdout=subprocess.PIPE)
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"supervisor process exited with {proc.wait()}"
        return proc, int(line)

    yield run
    for proc in procs:
        proc.send_signal(signal.SIGCONT)  # no-op once reaped
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


@pytest.mark.slow
def test_sigkilled_supervisor_takes_its_server_along(tmp_path: Path, supervisor_process: Any,
                                                     supervise: Any) -> None:
    config = make_config(tmp_path, "--spawn-engine-child")
    proc, pgid = supervisor_process(config)
    assert len(group_members(pgid)) == 2
    proc.kill()
    proc.wait()
    # The parent-death signal makes the API server stop its engine and exit.
    wait_until(lambda: not group_members(pgid), 10, what="the server group to end")
    sup = supervise(config)
    assert sup.wait_ready(15)


@pytest.mark.slow
def test_leftover_engine_is_killed_before_the_next_start(tmp_path: Path,
                                                         supervisor_process: Any,
                                                         supervise: Any) -> None:
    config = make_config(tmp_path, "--spawn-engine-child")
    proc, pgid = supervisor_process(config)
    # Freeze the supervisor, SIGKILL the API server (the engine core is orphaned, still in
    # the group, as with real vLLM), then SIGKILL the supervisor: only the pidfile is left.
    os.kill(proc.pid, signal.SIGSTOP)
    os.kill(pgid, signal.SIGKILL)
    wait_until(lambda: len(group_members(pgid)) == 1, 10, what="the orphaned engine core")
    engine = group_members(pgid)[0]
    proc.kill()
    proc.wait()
    assert engine.is_running()

    sup = supervise(config)
    assert sup.wait_ready(15)
    assert not group_members(pgid)
    assert not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE


# --- external mode -------------------------------------------------------------------------


def watch_external(tmp_path: Path, supervise: Any) -> tuple[int, ServerSupervisor]:
    """A supervisor of an external server on a free port (nothing listens there yet)."""
    port = free_port()
    config = validate_config({
        "state_dir": str(tmp_path / "state"),
        "server": {"mode": "external", "url": f"http://127.0.0.1:{port}/v1",
                   "health_interval": 0.2}})
    return port, supervise(config)


def test_external_server_serving_another_name_fails_until_it_is_fixed(
        tmp_path: Path, supervise: Any) -> None:
    port, sup = watch_external(tmp_path, supervise)
    with start_fake_server(port, "--served-model-name", "PaddlePaddle/PaddleOCR-VL-1.6"):
        assert not sup.wait_ready(10)
        assert sup.state is ServerState.FAILED
        assert sup.error is not None and "model.served_name" in str(sup.error)
    # The user restarts their server with the name ocrvl asks for; ocrvl is not restarted.
    with start_fake_server(port):
        # wait_ready returns at once while FAILED: poll for the state instead.
        wait_until(lambda: sup.state is ServerState.READY, 10,
                   what="the supervisor to take up the fixed server (it gave up on it)")
        assert sup.error is None


def test_external_server_readiness_follows_the_server(tmp_path: Path, supervise: Any) -> None:
    port, sup = watch_external(tmp_path, supervise)
    assert not sup.wait_ready(0.5)
    assert sup.state is ServerState.UNREACHABLE
    with start_fake_server(port):
        assert sup.wait_ready(10)
        assert sup.status().pid is None
    wait_until(lambda: sup.state is ServerState.UNREACHABLE, 10, what="the supervisor to notice")


def test_an_external_server_already_up_is_ready_at_the_first_probe(
        tmp_path: Path, supervise: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A start-up poll this long would leave `ocrvl convert --server-url` waiting for it.
    monkeypatch.setattr("ocrvl_daemon.server.external.STARTUP_POLL", 600.0)
    port = free_port()
    with start_fake_server(port):
        config = validate_config({
            "state_dir": str(tmp_path / "state"),
            "server": {"mode": "external", "url": f"http://127.0.0.1:{port}/v1",
                       "health_interval": 600}})
        sup = supervise(config)
        assert sup.wait_ready(60), (
            "a server that was already running was not taken up at once: the supervisor "
            "waited a poll interval before its first look")


def test_a_crash_loop_of_a_server_that_prints_nothing_says_so(
    tmp_path: Path, supervise: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "ocrvl_daemon")
    supervise(make_config(tmp_path, command=["false"]))

    def loud() -> list[str]:
        return [r.getMessage() for r in caplog.records if "keeps failing" in r.getMessage()]

    report = wait_until(loud, 30, what="a crash loop report")[0]
    assert "It printed nothing." in report, report
    assert "last 0 lines" not in report, report


def managed_vllm_config(tmp_path: Path, python: Path, **server: Any) -> Config:
    """A managed `vllm` launcher on a fake server environment, no GPU reading."""
    settings: dict[str, Any] = {
        "launcher": "vllm", "python": str(python), "port": free_port(),
        "health_interval": 0.2, "startup_timeout": 20, "stop_timeout": 3,
        "restart_backoff_max": 0.5, **server,
        "env": {NO_NVML_ENV: "1", NVIDIA_SMI_ENV: str(tmp_path / "no-nvidia-smi"),
                **server.get("env", {})}}
    return validate_config({"state_dir": str(tmp_path / "state"), "server": settings})


@pytest.fixture
def wsl2_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = tmp_path / "osrelease"
    release.write_text("5.15.167.4-microsoft-standard-WSL2\n")
    monkeypatch.setattr(gpu_module, "OSRELEASE", release)
    for name in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_WSL2_ENABLE_PIN_MEMORY"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("wsl2_kernel")
def test_the_pinned_vllm_starts_under_wsl2(tmp_path: Path, supervise: Any) -> None:
    python = fake_server_env.make(tmp_path / "server-venv", FakeVllm("0.26.0", wsl=True))
    sup = supervise(managed_vllm_config(tmp_path, python))
    assert sup.wait_ready(30), (
        f"the managed vLLM did not start under WSL2: {sup.status().last_error} "
        f"({sup.diagnosis})")


@pytest.mark.usefixtures("wsl2_kernel")
def test_uva_under_wsl2_is_named_with_its_fix_and_not_retried(tmp_path: Path,
                                                              supervise: Any) -> None:
    python = fake_server_env.make(tmp_path / "server-venv", FakeVllm("0.26.0", wsl=True))
    # The user chose the V2 runner themselves: ocrvl leaves it, and says what to do.
    sup = supervise(managed_vllm_config(tmp_path, python,
                                        env={"VLLM_USE_V2_MODEL_RUNNER": "1"}))
    wait_until(lambda: sup.status().state is ServerState.FAILED, 20, what="a failed server")
    assert isinstance(sup.error, ServerConfigError)
    assert "needs UVA" in str(sup.error) and "VLLM_USE_V2_MODEL_RUNNER=0" in str(sup.error), \
        str(sup.error)
    assert sup.status().restart_count == 0

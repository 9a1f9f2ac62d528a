"""metrics.listen: the daemon's own Prometheus endpoint, scraped from a real daemon."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ocrvl_daemon.config.file import validate_config
from ocrvl_daemon.errors import ConfigError, ExitCode
from ocrvl_daemon.observe.daemon_state import read_runtime_file
from ocrvl_daemon.observe.stages import SATURATED
from testkit.documents import make_pdf
from testkit.harness import free_port, wait_until
from testkit.runner import (
    DaemonProcess,
    managed_fake_server,
    run_ocrvl,
    write_config,
)

SERVER_BUSY = ("ocrvl_stage_busy_ratio", (("stage", "server"),))


def scrape(listen: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample at http://listen/metrics, by name and labels, parsed by prometheus_client."""
    text = httpx.get(f"http://{listen}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.parametrize(
    ("listen", "allow_remote", "needle"),
    [
        ("9118", False, "must be HOST:PORT"),
        ("127.0.0.1:", False, "must be HOST:PORT"),
        ("127.0.0.1:70000", False, "must be HOST:PORT"),
        ("0.0.0.0:9118", False, "metrics.allow_remote: true"),
        ("192.168.1.5:9118", False, "not a loopback address"),
        ("metrics.example.org:9118", False, "not a loopback address"),
    ],
)
@pytest.mark.quick
def test_a_bad_or_public_metrics_address_is_refused_naming_the_key_and_the_fix(
        listen, allow_remote, needle):
    with pytest.raises(ConfigError) as err:
        validate_config({"metrics": {"listen": listen, "allow_remote": allow_remote}})
    assert "metrics.listen" in str(err.value) and needle in str(err.value), str(err.value)


@pytest.mark.quick
@pytest.mark.parametrize("listen", ["127.0.0.1:9118", "localhost:9118", "[::1]:9118"])
def test_loopback_addresses_are_accepted(listen):
    assert validate_config({"metrics": {"listen": listen}}).metrics.listen == listen


@pytest.mark.quick
def test_a_public_address_is_accepted_when_allowed():
    config = validate_config({"metrics": {"listen": "0.0.0.0:9118", "allow_remote": True}})
    assert config.metrics.address == ("0.0.0.0", 9118)


def daemon_config(tmp_path: Path, listen: str, *fake_args: str) -> tuple[Path, Path]:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    config = write_config(
        tmp_path / "config.yaml",
        inbox={"paths": [str(inbox)], "stable_seconds": 0.3, "poll_interval": 0.2},
        pipeline={"adaptive_concurrency": False, "max_concurrency": 4},
        server=managed_fake_server(free_port(), *fake_args),
        metrics={"listen": listen},
    )
    return config, inbox


def test_a_metrics_port_already_taken_stops_the_daemon_at_start_naming_the_key(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        config, _ = daemon_config(tmp_path, listen)
        result = run_ocrvl("run", "--config", config, timeout=120)
    assert result.returncode == ExitCode.CONFIG, result.stderr
    assert f"metrics.listen = '{listen}'" in result.stderr and "free port" in result.stderr, \
        result.stderr
    assert "started server" not in result.stderr, "the model server started anyway"


@pytest.mark.slow
def test_metrics_scraped_while_a_book_converts_show_pages_documents_and_server(tmp_path):
    listen = f"127.0.0.1:{free_port()}"
    config, inbox = daemon_config(tmp_path, listen, "--step-t0-ms", "25")
    pages = 48
    with DaemonProcess(config) as daemon:
        daemon.wait_ready()
        make_pdf(inbox / "book.pdf", pages)
        during = wait_until(
            lambda: (m := scrape(listen))[("ocrvl_pages_done_total", ())] > 0 and m, 90,
            what="the pages-done counter to rise while the book converts",
        )
        assert during[("ocrvl_documents", (("state", "running"),))] == 1, during
        assert during[("ocrvl_pages_done_total", ())] < pages, "the book was already done"
        url = daemon.log().split("ready: server up at ")[1].split(",")[0]
        endpoint = (("endpoint", url),)
        assert during[("ocrvl_server_state", (*endpoint, ("state", "ready")))] == 1
        assert during[("ocrvl_server_state", (*endpoint, ("state", "restarting")))] == 0
        assert during[("ocrvl_server_restarts_total", endpoint)] == 0
        # Held to 4 requests (max_concurrency), the server sets the pace: nothing before it.
        def server_busy() -> tuple[dict, dict] | None:
            metrics = scrape(listen)
            stages = read_runtime_file(tmp_path / "state")["stages"]  # `status --json`'s
            return ((metrics, stages) if metrics[SERVER_BUSY] >= SATURATED
                    and stages["limit"] == "server" else None)

        busy, stages = wait_until(server_busy, 60, what="the server to be named the limit")
        assert stages["advice"] is None, stages
        assert busy[("ocrvl_stage_busy_ratio", (("stage", "layout"),))] == 0
        assert busy[("ocrvl_stage_busy_ratio", (("stage", "rendering"),))] < SATURATED
        # The rate is known once pages came back over a few seconds (rate.RATE_MIN_SPAN).
        after = wait_until(
            lambda: (m := scrape(listen))[("ocrvl_documents", (("state", "done"),))] == 1
            and m[("ocrvl_pages_per_second", ())] > 0 and m,
            90, what="the book to be done and its rate known")
        assert after[("ocrvl_pages_done_total", ())] == pages
        assert after[("ocrvl_pages_failed_total", ())] == 0
        assert after[("ocrvl_pages_flagged_total", ())] == 0
        assert after[("ocrvl_documents", (("state", "queued"),))] == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://{listen}/metrics", timeout=2)


def test_a_managed_servers_gpu_is_shown_in_status_and_metrics(tmp_path):
    """So that a user sees an idle card: utilization, memory and power of the server's GPU."""
    listen = f"127.0.0.1:{free_port()}"
    config, _ = daemon_config(tmp_path, listen)
    smi = tmp_path / "nvidia-smi"
    shutil.copyfile(Path(__file__).parent / "fixtures" / "gpu" / "rtx4060.sh", smi)
    smi.chmod(0o755)
    with DaemonProcess(config, OCRVL_NVIDIA_SMI=str(smi), OCRVL_NO_NVML="1") as daemon:
        daemon.wait_ready()
        metrics = wait_until(
            lambda: (m := scrape(listen)).get(("ocrvl_gpu_busy_percent", (("gpu", "0"),)))
            is not None and m, 30, what="the GPU's figures in /metrics")
        status = run_ocrvl("status", "--config", config, timeout=60)
        as_json = json.loads(run_ocrvl("status", "--json", "--config", config, timeout=60).stdout)
    gpu = (("gpu", "0"),)
    assert metrics[("ocrvl_gpu_busy_percent", gpu)] == 37
    assert metrics[("ocrvl_gpu_power_watts", gpu)] == pytest.approx(64.12)
    assert metrics[("ocrvl_gpu_memory_used_bytes", gpu)] == 1024 * 1024 * 1024
    assert metrics[("ocrvl_gpu_memory_total_bytes", gpu)] == 8188 * 1024 * 1024
    assert "gpu 0 (NVIDIA GeForce RTX 4060): 37% busy, 1.0/8.0 GiB, 64 W" in status.stdout, \
        status.stdout
    assert as_json["daemon"]["gpus"][0]["busy_pct"] == 37, as_json["daemon"]

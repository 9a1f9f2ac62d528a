"""Engine hosts on a Ray cluster of several nodes on this machine's loopback, each node with
its own stand-in server: a book shared by every node, a node lost mid-book, a node that joins
mid-book, a node whose server fails. One cluster serves the module (starting one takes
seconds); a test that removes or adds a node puts the cluster back as it found it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from testkit.documents import make_pdf
from testkit.harness import wait_until
from testkit.ray_cluster import LOOPBACK_ENV, LocalCluster, local_cluster
from testkit.runner import (
    DaemonProcess,
    managed_fake_server,
    ocrvl_argv,
    ocrvl_env,
    run_ocrvl,
    write_config,
)

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

NODES = 3
# Each page's answer takes about 0.4 s at the stand-in server, two pages at a time per node:
# a 36-page book is mid-way for several seconds, long enough to lose or add a node.
SLOW_ANSWERS = ("--output-tokens", "fixed:20", "--step-t0-ms", "20")
SLOW_PIPELINE = {"max_concurrency": 2, "min_concurrency": 1, "adaptive_concurrency": False}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with local_cluster(NODES) as made:
        yield made


def cluster_config(tmp_path: Path, cluster: LocalCluster, *fake_args: str,
                   **sections: Any) -> Path:
    """A config whose hosts each start a stand-in server logging its requests to
    requests-PORT.jsonl (one log per node's server)."""
    log = str(tmp_path / "requests-{port}.jsonl")
    return write_config(tmp_path / "config.yaml", cluster={"address": cluster.address},
                        server=managed_fake_server(8118, "--request-log", log, *fake_args),
                        **sections)


def requests_per_server(tmp_path: Path) -> dict[str, int]:
    """Requests each node's server answered or began, by its port."""
    return {p.stem.removeprefix("requests-"): len(p.read_text().splitlines())
            for p in tmp_path.glob("requests-*.jsonl")}


def assert_every_page_once_in_order(markdown: Path, pages: int) -> None:
    text = markdown.read_text("utf-8")
    marks = [int(n) for n in re.findall(r"<!-- page (\d+) -->", text)]
    assert marks == list(range(1, pages + 1)), (
        f"{markdown.name} should hold pages 1-{pages} once each, in order; it has {marks}")
    assert text.count("fake-ocr OCR") == pages, f"{markdown.name} has pages twice or none"


def converting(config: Path, pdf: Path) -> subprocess.Popen[str]:
    """`ocrvl convert` started in the background (the test acts while it runs)."""
    return subprocess.Popen(ocrvl_argv("convert", "--config", config, pdf),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=ocrvl_env(**LOOPBACK_ENV), start_new_session=True)


def finished(proc: subprocess.Popen[str], timeout: float = 120) -> str:
    """Its output once it ended well; a failure shows the output."""
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        raise AssertionError(f"ocrvl convert did not finish in {timeout} s:\n{output}") from None
    assert proc.returncode == 0, output[-6000:]
    return output


def test_a_book_across_three_nodes_gets_a_share_from_every_node(tmp_path: Path,
                                                                  cluster: LocalCluster):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    config = cluster_config(tmp_path, cluster, *SLOW_ANSWERS, pipeline=SLOW_PIPELINE,
                            inbox={"paths": [str(inbox)], "stable_seconds": 0.2})
    with DaemonProcess(config, **LOOPBACK_ENV) as daemon:
        every_host_ready(daemon)
        make_pdf(inbox / "book.pdf", 24)
        wait_until(lambda: (inbox / "book.md").exists(), 120, what="book.md", ignore=())
        lines = status_lines(config)
    assert_every_page_once_in_order(inbox / "book.md", 24)
    shares = requests_per_server(tmp_path)
    assert len(shares) == NODES and all(shares.values()), (
        f"every node's server should have recognised pages; requests per server: {shares}")
    assert sum(shares.values()) == 24, f"some pages were recognised twice: {shares}"
    assert lines.count("server node 127.0.0.1 #0: ready") == NODES, (
        f"`ocrvl status` should show each engine host's node:\n{lines}")
    assert "SIGTERM received" not in daemon.log(), (
        "stopping the daemon (systemctl stop) printed Ray's crash stack dump to its log")


def every_host_ready(daemon: DaemonProcess, hosts: int = NODES) -> None:
    """Wait until the daemon is up and an engine worker is ready on each of `hosts` hosts."""
    daemon.wait_ready(90)
    wait_until(lambda: len(re.findall(r"\] engine worker \d+ ready", daemon.log())) >= hosts,
               90, what=f"an engine worker ready on each of {hosts} nodes", ignore=())


def test_a_node_lost_mid_book_costs_no_page_and_status_says_so(tmp_path: Path,
                                                               cluster: LocalCluster):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    config = cluster_config(tmp_path, cluster, *SLOW_ANSWERS, pipeline=SLOW_PIPELINE,
                            inbox={"paths": [str(inbox)], "stable_seconds": 0.2})
    victim = cluster.nodes[-1]
    with DaemonProcess(config, **LOOPBACK_ENV) as daemon:
        every_host_ready(daemon)
        make_pdf(inbox / "book.pdf", 36)
        wait_until(lambda: sum(requests_per_server(tmp_path).values()) >= 8, 60,
                   what="the book to be well under way")
        try:
            cluster.remove_node(victim)
            gone = wait_until(lambda: [s for s in status(config)["servers"]
                                       if s["state"] == "failed"], 15,
                              what="status to show the lost node's host as failed")
            assert (gone[0]["last_error"] or "").startswith("node 127.0.0.1 ("), (
                f"status should say the host's node is gone: {gone}")
            wait_until(lambda: (inbox / "book.md").exists(), 120, what="book.md",
                       ignore=())
        finally:
            cluster.add_node()
        assert_every_page_once_in_order(inbox / "book.md", 36)
        assert "its pages go to the other hosts" in daemon.log()
        log = daemon.log()
    assert "when the engine worker crashed" not in log and "failed (attempt" not in log, (
        "a lost node was blamed on its pages:\n" + log[-4000:])


def test_a_node_that_joins_mid_book_gets_work(tmp_path: Path, cluster: LocalCluster):
    # 2 s a page, 3 pages/s on the first nodes: the book lasts about 20 s, and a node that
    # joins is placed, starts its server and worker, and takes pages within about 12 s.
    pdf = make_pdf(tmp_path / "book.pdf", 60)
    config = cluster_config(tmp_path, cluster, "--output-tokens", "fixed:100", "--step-t0-ms",
                            "20", pipeline=SLOW_PIPELINE)
    proc = converting(config, pdf)
    try:
        wait_until(lambda: sum(requests_per_server(tmp_path).values()) >= 6, 90,
                   what="the book to be under way on the first nodes")
        before = set(requests_per_server(tmp_path))
        joined = cluster.add_node()
        try:
            finished(proc)
        finally:
            cluster.remove_node(joined)
    finally:
        proc.kill()
        proc.wait()
    assert_every_page_once_in_order(tmp_path / "book.md", 60)
    shares = requests_per_server(tmp_path)
    new = {port: n for port, n in shares.items() if port not in before}
    assert new and all(new.values()), (
        f"the node that joined mid-book got no page; requests per server: {shares}")


def test_a_node_whose_server_fails_leaves_its_pages_to_the_others(tmp_path: Path,
                                                                 cluster: LocalCluster):
    pdf = make_pdf(tmp_path / "book.pdf", 36)
    config = cluster_config(tmp_path, cluster, *SLOW_ANSWERS, pipeline=SLOW_PIPELINE)
    proc = converting(config, pdf)
    try:
        wait_until(lambda: len(requests_per_server(tmp_path)) == NODES
                   and min(requests_per_server(tmp_path).values()) >= 2, 90,
                   what="every node's server to have pages")
        port = min(requests_per_server(tmp_path))
        kill_server_on(int(port))
        output = finished(proc)
    finally:
        proc.kill()
        proc.wait()
    assert_every_page_once_in_order(tmp_path / "book.md", 36)
    assert f":{port}/v1 did not answer" in output, output[-4000:]


def test_a_daemon_killed_leaves_no_engine_host_or_server_on_the_nodes(tmp_path: Path,
                                                                      cluster: LocalCluster):
    config = cluster_config(tmp_path, cluster)
    daemon = DaemonProcess(config, **LOOPBACK_ENV).start()
    try:
        every_host_ready(daemon)
        ports = [int(s["url"].rsplit(":", 1)[1].split("/")[0])
                 for s in status(config)["servers"]]
        assert len(ports) == NODES and all(map(listening, ports)), ports
    finally:
        daemon.kill()
    wait_until(lambda: not any(map(listening, ports)), 30, ignore=(),
               what="the nodes' servers to end with the daemon (its Ray actors die with it)")


def test_doctor_checks_the_cluster_and_its_engine_slots(tmp_path: Path, cluster: LocalCluster):
    result = run_ocrvl("doctor", "--json", "--config", cluster_config(tmp_path, cluster),
                       timeout=120, **LOOPBACK_ENV)
    checks = [c for c in json.loads(result.stdout)["checks"] if c["name"] == "cluster"]
    assert checks and all(c["status"] == "ok" for c in checks), (
        f"doctor should find the cluster reachable, alike everywhere, with engine slots: "
        f"{checks}")
    assert f"{NODES} engine slot(s)" in checks[-1]["detail"], checks[-1]


def status(config: Path) -> dict[str, Any]:
    result = run_ocrvl("status", "--json", "--config", config, timeout=30)
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def status_lines(config: Path) -> str:
    result = run_ocrvl("status", "--config", config, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout


def listening(port: int) -> bool:
    return any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
               for c in psutil.net_connections("tcp"))


def kill_server_on(port: int) -> None:
    """SIGKILL the process group of the server listening on `port` (as a crash would)."""
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            assert conn.pid is not None
            os.killpg(os.getpgid(conn.pid), signal.SIGKILL)
            return
    raise AssertionError(f"no server listens on port {port}")

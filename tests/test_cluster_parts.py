"""The parts of the Ray cluster support that need no Ray: which engine hosts the nodes offer,
that a cluster's worker sends pages only to its own node's server, how a node gets a PDF,
what the daemon takes from a host's polls, the config's rules, and /metrics naming each
host's node."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ocrvl_daemon.cluster.host import GateOrder
from ocrvl_daemon.cluster.link import HostServer, RayWorker
from ocrvl_daemon.cluster.offers import offers
from ocrvl_daemon.cluster.pdf_copies import NodePdfs, PdfCopy, copy_key
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.messages import GateLimit, PageTask, WorkerSetup
from ocrvl_daemon.core.plan import EndpointRoom, plan
from ocrvl_daemon.engine.concurrency import ConcurrencyController
from ocrvl_daemon.engine.pool import EnginePool
from ocrvl_daemon.observe.daemon_state import DaemonState, EndpointState
from ocrvl_daemon.observe.metrics import _SnapshotCollector
from ocrvl_daemon.server.placement import Placement
from ocrvl_daemon.server.probe import ServerMetrics
from ocrvl_daemon.server.supervisor import ServerState, ServerStatus
from testkit.core import document
from testkit.documents import make_pdf
from testkit.stand_in_worker import StandInWorker

pytestmark = pytest.mark.quick


def node(node_id: str, alive: bool = True, **resources: float) -> dict[str, object]:
    return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": f"10.0.0.{node_id}",
            "NodeManagerHostname": f"host{node_id}", "Resources": {"CPU": 16.0, **resources}}


def test_a_node_offers_one_host_per_gpu_and_a_cpu_only_node_none():
    slots = offers([node("1", GPU=2.0), node("2")])
    assert [(s.node_ip, s.unit, s.gpus) for s in slots] == [("10.0.0.1", 0, 1.0),
                                                          ("10.0.0.1", 1, 1.0)]
    assert [s.where for s in slots] == ["node 10.0.0.1 #0", "node 10.0.0.1 #1"]


def test_the_ocrvl_engine_resource_decides_over_the_gpus_and_shares_them():
    (one, two) = offers([node("1", GPU=1.0, ocrvl_engine=2.0)])
    assert (one.gpus, two.gpus) == (0.5, 0.5), "two hosts on one GPU each ask for half of it"
    assert one.resources == {"ocrvl_engine": 1.0}
    assert offers([node("3", ocrvl_engine=1.0)])[0].gpus == 0.0, "a CPU node asks for no GPU"


def test_a_dead_node_offers_nothing():
    assert offers([node("1", alive=False, GPU=8.0)]) == []


def test_a_cluster_worker_takes_pages_only_for_its_own_nodes_server():
    docs = [document(1, 8)]
    rooms = [EndpointRoom("http://10.0.0.1:9000/v1", 4, 0),
             EndpointRoom("http://10.0.0.2:9000/v1", 4, 0)]
    serves = {1: frozenset({"http://10.0.0.1:9000/v1"}),
              2: frozenset({"http://10.0.0.2:9000/v1"})}
    step = plan(docs, rooms, [1, 2], serves=serves)
    assert step.sends, "nothing was sent"
    for send in step.sends:
        assert send.url in serves[send.worker], (
            f"page {send.page} went to {send.url} through worker {send.worker}, whose host "
            "cannot reach that server")


class _TwoHosts(EnginePool):
    """A pool whose worker 1 is on node 1's host and worker 2 on node 2's (as
    `ClusterPool.serves` says), without Ray."""

    def serves(self):
        return {1: frozenset({NODE1}), 2: frozenset({NODE2})}


NODE1, NODE2 = "http://10.0.0.1:9000/v1", "http://10.0.0.2:9000/v1"


def test_a_servers_bound_is_shared_only_by_its_own_hosts_workers(tmp_path: Path):
    config = Config.model_validate({"state_dir": str(tmp_path / "state"),
                                    "pipeline": {"use_layout_detection": False}})
    made: list[StandInWorker] = []

    def new_worker(setup: WorkerSetup) -> StandInWorker:
        made.append(StandInWorker(setup))
        return made[-1]

    pool = _TwoHosts(config, new_worker=new_worker, placement=Placement(2))  # type: ignore[arg-type]
    pool.maintain(0.0, set())
    first, second = made
    assert (first.number, second.number) == (1, 2)
    pool.set_limit(GateLimit(NODE1, 8))
    pool.set_limit(GateLimit(NODE2, 6))
    assert first.gates[NODE1].limit == 8 and NODE1 not in second.gates, (
        "node 1's server's bound went to a worker on node 2, which never sends there")
    assert second.gates[NODE2].limit == 6 and NODE2 not in first.gates
    pool.submit(1, PageTask(1, "/books/book.pdf", 0, 1024, 1, 1.0, url=NODE1))
    assert first.gates[NODE1].limit == 8, "its host's one worker keeps the whole bound"


def test_an_endpoint_whose_host_takes_no_pages_gets_none():
    docs = [document(1, 8)]
    rooms = [EndpointRoom("http://10.0.0.1:9000/v1", 4, 0),
             EndpointRoom("http://10.0.0.2:9000/v1", 4, 0)]
    step = plan(docs, rooms, [1], serves={1: frozenset({"http://10.0.0.1:9000/v1"})})
    assert {s.url for s in step.sends} == {"http://10.0.0.1:9000/v1"}


def test_a_node_that_sees_the_same_file_renders_it_in_place_else_from_its_copy(tmp_path: Path):
    pdf = make_pdf(tmp_path / "book.pdf", 1)
    stat = pdf.stat()
    task = PageTask(1, str(pdf), 0, 100, stat.st_size, stat.st_mtime)
    cache = tmp_path / "cache"

    fetched: list[PdfCopy] = []

    def fetch(copy: PdfCopy) -> bytes:  # what the node would fetch from the object store
        fetched.append(copy)
        return pdf.read_bytes()

    pdfs = NodePdfs(cache, "auto", fetch)
    copy = PdfCopy(ref=None)
    assert pdfs.local(task, copy) == task, "a node that sees the file fetched a copy"
    elsewhere = PageTask(1, "/not/on/this/node.pdf", 0, 100, stat.st_size, stat.st_mtime)
    local = pdfs.local(elsewhere, copy)
    assert Path(local.pdf).read_bytes() == pdf.read_bytes()
    assert Path(local.pdf).name == copy_key(elsewhere.pdf, stat.st_size, stat.st_mtime) + ".pdf"
    pdfs.local(elsewhere, copy)
    assert len(fetched) == 1, "a node fetched the same document twice"


def test_a_worker_on_a_host_keeps_the_last_gate_the_daemon_set_whatever_order_calls_run():
    calls: list[tuple[int, GateLimit, int]] = []
    actor = SimpleNamespace(set_limit=SimpleNamespace(remote=lambda *call: calls.append(call)))
    link = SimpleNamespace(actor=actor, arrived=None, dead=None, local_url=lambda url: url)
    handle = RayWorker(link, 3)  # type: ignore[arg-type]
    # The pool shares the bound as pages come: the worker's part of it goes 0, 1, 2, 1.
    for limit in (0, 1, 2, 1):
        handle.set_limit(GateLimit(NODE1, limit))
    # The host's threads may run the calls in any order; the worst: backwards.
    applied: list[int] = []
    gates = GateOrder()
    for number, gate, order in reversed(calls):
        assert number == 3
        gates.apply(number, gate, order, lambda g: applied.append(g.limit))
    assert applied[-1:] == [1], (
        f"the worker was left with a gate of {applied[-1:]} requests, an older one than the "
        "daemon's last (1): its pages wait at the gate until its share changes again")
    gates.forget(3)
    gates.apply(3, GateLimit(NODE1, 5), 1, lambda g: applied.append(g.limit))
    assert applied[-1] == 5, "a stopped worker's gates are forgotten with it"


def test_one_scrape_of_a_hosts_server_counts_once_however_many_polls_bring_it():
    link = SimpleNamespace(place=None, dead=None,
                           offer=SimpleNamespace(where="node 10.0.0.1 #0", node_ip="10.0.0.1"))
    server = HostServer(link, 0, NODE1)  # type: ignore[arg-type]
    status = ServerStatus(ServerState.READY, "ready", None, 1, 0, None, None, NODE1)
    controller = ConcurrencyController(4, 64, adaptive=True)
    # A book's first burst: the server keeps requests waiting for one scrape, on the node's
    # clock at 100.0; polls bring it again and again, each over its own round trip.
    burst = ServerMetrics(taken_at=100.0, running=14, waiting=40)
    for poll, offset in enumerate([0.0011, 0.0017, 0.0009, 0.0013]):
        server.update(status, burst, offset)
        controller.observe(1.0 + poll / 100, completed=0, in_flight=64, backlog=32,
                           metrics=server.metrics())
    assert controller.server_cap is None and controller.limit == 64, (
        "one scrape brought by several polls was taken for scrapes in a row of a server "
        f"that keeps requests waiting: the bound fell to {controller.limit}")
    server.update(status, ServerMetrics(taken_at=100.5, running=14, waiting=40), 0.0012)
    sample = server.metrics()
    assert sample is not None and sample.taken_at == pytest.approx(100.5012), (
        "the next scrape is news again, on the daemon's clock")


def test_a_cluster_needs_managed_servers():
    with pytest.raises(ValueError) as info:
        Config.model_validate({"cluster": {"address": "10.0.0.1:6379"},
                               "server": {"mode": "external", "url": "http://h:1/v1"}})
    assert "server.mode: managed" in str(info.value)


def test_cluster_address_must_be_one_ray_understands():
    with pytest.raises(ValueError, match=r"cluster\.address") as info:
        Config.model_validate({"cluster": {"address": "http://head"}})
    assert "ray start --head" in str(info.value)


def test_metrics_name_each_engine_hosts_node_and_gpu():
    state = DaemonState(endpoints=(EndpointState(
        "node 10.0.0.5 #1", "http://10.0.0.5:41234/v1", "ready", node="10.0.0.5", gpu="3"),))
    registry = CollectorRegistry()
    registry.register(_SnapshotCollector(lambda: state))
    text = generate_latest(registry).decode()
    assert ('ocrvl_engine_host_info{endpoint="http://10.0.0.5:41234/v1",gpu="3",'
            'node="10.0.0.5"} 1.0') in text, text

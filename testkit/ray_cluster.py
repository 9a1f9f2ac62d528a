"""A Ray cluster of several nodes on this machine's loopback, for the cluster tests and bench.

`ray.cluster_utils.Cluster` starts a head and more nodes as separate raylets on 127.0.0.1;
each engine node offers one `ocrvl_engine` unit (there are no GPUs here), the head none
(as where the daemon runs). Nodes and their workers inherit this process's environment
when they start: `PYTHONPATH` gets this checkout first, so a node's stand-in server
(`python -m testkit.fake_server`) imports testkit as the tests do.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from testkit.runner import checkout_first

# Ray turns a loopback address given to ray.init into this machine's outward address
# (`resolve_ip_for_localhost`), where a loopback-only cluster does not listen; with this
# set it keeps 127.0.0.1. Only a cluster on the loopback needs it.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# The head's failure detector, quickened (Ray's default: 5 missed checks 3 s apart), so a
# removed node is declared dead within about 2 s, as a test can wait for.
FAST_DETECTION = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                  "health_check_failure_threshold": 4}
NODE_ARGS: dict[str, Any] = {"num_cpus": 1, "node_ip_address": "127.0.0.1",
                             "resources": {"ocrvl_engine": 1}}


class LocalCluster:
    """The cluster: `address` for cluster.address; `add_node`, `remove_node`."""

    def __init__(self, engine_nodes: int) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, connect=False, head_node_args={
            "num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False,
            "_system_config": FAST_DETECTION})
        self.nodes: list[Any] = []
        for _ in range(engine_nodes):
            self.add_node()

    @property
    def address(self) -> str:
        """The head's address, for cluster.address."""
        return str(self.cluster.address)

    def add_node(self) -> Any:
        """Start one more engine node (returns its `ray._private.node.Node`)."""
        node = self.cluster.add_node(**NODE_ARGS)
        self.nodes.append(node)
        return node

    def remove_node(self, node: Any) -> None:
        """Kill a node's raylet and everything on it, as a machine that is lost."""
        self.nodes.remove(node)
        self.cluster.remove_node(node, allow_graceful=False)

    def shutdown(self) -> None:
        """Stop every node and the head."""
        self.cluster.shutdown()


@contextmanager
def local_cluster(engine_nodes: int) -> Iterator[LocalCluster]:
    """A `LocalCluster` with `engine_nodes` engine nodes, shut down at the end."""
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", *LOOPBACK_ENV)}
    os.environ["PYTHONPATH"] = checkout_first(os.environ.get("PYTHONPATH"))
    os.environ.update(LOOPBACK_ENV)
    cluster = LocalCluster(engine_nodes)
    try:
        yield cluster
    finally:
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

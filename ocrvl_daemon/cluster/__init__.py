"""Engine hosts on a Ray cluster: the daemon stays where it is, the engine runs on the nodes.

With `cluster.address` set, each node of the cluster runs one engine host (a Ray actor) per
GPU, or per unit of the custom resource `ocrvl_engine` it offers: its node's own model
server (managed there as on one machine) and the engine worker processes the daemon starts
on it (`host.EngineHost`). The daemon keeps its watcher, store, plan, decisions, output and
status; it sees each host as a worker of its pool and each host's server as one endpoint
(`pool.ClusterPool`, `link.HostLink`), so plan, decide and store do not know where a worker
runs. Ray places the hosts, notices a lost node (its actors die) and moves the bytes; no
queue, heartbeat or node registry is kept here.

`engine_side(config)` gives the servers and the pool the converter works with: the local
ones without a cluster.
"""

from __future__ import annotations

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.core.backoff import Backoff
from ocrvl_daemon.engine.pool import EnginePool
from ocrvl_daemon.server.replicas import ServerSet


def engine_side(config: Config, starts: int | None = None,
                backoff: Backoff | None = None
                ) -> tuple[ServerSet, EnginePool]:
    """The model servers and the engine pool for `config`: on this machine, or, with
    `cluster.address`, on the Ray cluster's nodes (connecting to it first; ClusterError when
    it cannot be reached). `starts`, `backoff`: as `EnginePool` and `ServerSet` take them."""
    if config.cluster.address is None:
        return ServerSet(config, backoff=backoff), EnginePool(config, starts)
    from ocrvl_daemon.cluster.pool import ClusterPool, ClusterServers, connect

    connect(config)
    pool = ClusterPool(config, starts)
    return ClusterServers(pool), pool

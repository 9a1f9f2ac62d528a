"""`ocrvl doctor`'s look at the Ray cluster (cluster.address): reachable, the same Ray, Python
and ocrvl on every node as here, and nodes that offer engine slots."""

from __future__ import annotations

import contextlib
import sys
from importlib import metadata

from ocrvl_daemon.cluster.offers import offers
from ocrvl_daemon.commands.doctor.report import Check
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.errors import OcrvlError

# How long each node has to say what it runs.
NODE_ANSWER_S = 60.0


def _versions() -> tuple[str, str, str]:
    """Ray's, Python's and ocrvl's versions in this process (run on each node too)."""
    import ray

    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    return ray.__version__, python, metadata.version("ocrvl-daemon")


def cluster_checks(config: Config) -> list[Check]:
    """Join the cluster as the daemon would, ask every live node what it runs, count the
    engine slots; leaves the cluster again."""
    from ocrvl_daemon.cluster.pool import connect

    try:
        connect(config)
    except OcrvlError as exc:
        return [Check("cluster", "fail", exc.message, exc.fix)]
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        here = _versions()
        checks = [Check("cluster", "ok", f"joined {config.cluster.address} (Ray {here[0]}, "
                                         f"Python {here[1]}, ocrvl {here[2]} here)")]
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        ask = ray.remote(num_cpus=0)(_versions)
        answers = {n["NodeID"]: ask.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            n["NodeID"], soft=False)).remote() for n in nodes}
        for node in nodes:
            name = f"node {node.get('NodeManagerAddress')} ({node.get('NodeManagerHostname')})"
            try:
                theirs = ray.get(answers[node["NodeID"]], timeout=NODE_ANSWER_S)
            except Exception as exc:  # a node that cannot run a task: say why, go on
                checks.append(Check("cluster", "warn", f"{name} did not answer: {exc}",
                                    "check that node's Ray and ocrvl installation"))
                continue
            if tuple(theirs) != here:
                checks.append(Check(
                    "cluster", "fail", f"{name} runs Ray {theirs[0]}, Python {theirs[1]}, "
                    f"ocrvl {theirs[2]}; here: Ray {here[0]}, Python {here[1]}, ocrvl {here[2]}",
                    "install the same versions on every node (pip install "
                    "'ocrvl-daemon[cluster]' in the same Python)"))
        slots = offers(nodes)
        if not slots:
            checks.append(Check(
                "cluster", "fail", f"none of the {len(nodes)} node(s) offers an engine slot "
                "(no GPU, no ocrvl_engine resource)", "start a GPU node with `ray start "
                "--address HEAD:PORT`, or give one --resources '{\"ocrvl_engine\": 1}'"))
        else:
            where = sorted({s.node_ip for s in slots})
            checks.append(Check("cluster", "ok", f"{len(slots)} engine slot(s) on "
                                                 f"{len(where)} node(s): {', '.join(where)}"))
        return checks
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()

"""Which engine hosts the cluster's nodes offer: one per unit of the custom resource
`ocrvl_engine` a node declares (`ray start --resources '{"ocrvl_engine": 2}'`), else one per
GPU it has. A node with neither (a CPU-only head where the daemon runs) runs none.

A pure function of `ray.nodes()`, read again every few seconds: a node that joins offers
its slots at the next look, and one that died is no longer among them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

ENGINE_RESOURCE = "ocrvl_engine"


@dataclass(frozen=True)
class Offer:
    """One engine slot: the node (Ray's id, address, name) and what its host asks Ray for."""

    node_id: str
    node_ip: str
    hostname: str
    unit: int  # 0, 1, ... on its node
    gpus: float  # the share of the node's GPUs its host asks for (Ray sets CUDA_VISIBLE_DEVICES)
    engine_units: int  # 1 when the node offers ocrvl_engine, else 0

    @property
    def slot(self) -> str:
        """The slot's stable name: its node's id (short) and its unit."""
        return f"{self.node_id[:12]}-{self.unit}"

    @property
    def resources(self) -> dict[str, float]:
        """The custom resources its host asks for."""
        return {ENGINE_RESOURCE: 1.0} if self.engine_units else {}

    @property
    def where(self) -> str:
        """The slot in words, for logs and status: "node 10.0.0.5 #1" (its second slot; which
        GPU Ray gives its host is known once it is placed)."""
        return f"node {self.node_ip} #{self.unit}"


def offers(nodes: Iterable[Mapping[str, Any]]) -> list[Offer]:
    """The engine slots of the live `nodes` (as `ray.nodes()` gives them), node by node."""
    slots: list[Offer] = []
    for node in nodes:
        if not node.get("Alive"):
            continue
        resources = node.get("Resources") or {}
        units = int(resources.get(ENGINE_RESOURCE, 0))
        gpus = int(resources.get("GPU", 0))
        count = units or gpus
        share = (gpus / units if units else 1.0) if gpus else 0.0
        slots += [Offer(node["NodeID"], node.get("NodeManagerAddress", ""),
                        node.get("NodeManagerHostname", ""), unit, share, int(bool(units)))
                  for unit in range(count)]
    return slots

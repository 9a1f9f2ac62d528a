"""The `cluster` section: engine hosts on a Ray cluster (`ocrvl_daemon.cluster`)."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from ocrvl_daemon.config.errors import KeyProblem
from ocrvl_daemon.config.section import Section


class ClusterConfig(Section):
    """Engine hosts on a Ray cluster (`ocrvl_daemon.cluster`); unset address: local workers."""

    # Ray's own address forms: "HOST:PORT" of the head's GCS, "auto" (the cluster `ray start`
    # made on this machine), "ray://HOST:10001" (Ray Client).
    address: str | None = None
    # The address this machine is known by in the cluster (Ray's `_node_ip_address`); null:
    # Ray's own guess.
    node_ip: str | None = None
    # How each node gets a document's PDF: auto (its own copy at the same path when it sees
    # the same file there, else one fetched once through Ray's object store), shared_path
    # (always the same path: the inbox is mounted alike everywhere), object_store (always
    # fetched).
    pdfs: Literal["auto", "shared_path", "object_store"] = "auto"

    @field_validator("address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is None or value == "auto" or value.startswith("ray://"):
            return value
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise KeyProblem("cluster.address", value, "must be Ray's address: HOST:PORT of "
                            "the head (the one `ray start --head` prints), auto, or "
                            "ray://HOST:10001; or null to run the engine here")
        return value

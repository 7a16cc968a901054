"""Cluster membership records: what a daemon writes to etcd and what clients read (DESIGN §7).

A daemon of cluster `C` registers under the leased key `/strata/C/members/<node_id>` with a JSON
value (a `Member`). The lease ends when the daemon stops cleanly (revoked) or dies (runs out), so
the key set under `/strata/C/members/` is the set of live members. Pure: no I/O here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from client.contract.errors import InvalidArgument

ROOT = "/strata"


def members_prefix(cluster: str) -> bytes:
    """`/strata/<cluster>/members/` as bytes; InvalidArgument for an empty or slashed name."""
    if not cluster or "/" in cluster:
        raise InvalidArgument(f"bad cluster name {cluster!r} (non-empty, no '/')")
    return f"{ROOT}/{cluster}/members/".encode()


def member_key(cluster: str, node_id: str) -> bytes:
    if not node_id or "/" in node_id:
        raise InvalidArgument(f"bad node id {node_id!r} (non-empty, no '/')")
    return members_prefix(cluster) + node_id.encode()


@dataclass(frozen=True, slots=True)
class TierCapacity:
    tier: str  # "gpu" | "dram" | "ssd"
    capacity_bytes: int


@dataclass(frozen=True, slots=True)
class Member:
    """One live daemon: its id (the placement identity), gRPC address and capacities."""

    node_id: str
    address: str
    host_id: str
    tiers: tuple[TierCapacity, ...] = ()

    def encode(self) -> bytes:
        return json.dumps(
            {
                "node_id": self.node_id,
                "address": self.address,
                "host_id": self.host_id,
                "tiers": [{"tier": t.tier, "capacity_bytes": t.capacity_bytes} for t in self.tiers],
            },
            sort_keys=True,
        ).encode()

    @staticmethod
    def decode(data: bytes) -> Member:
        """Parse a registration value; InvalidArgument when it is not one."""
        try:
            raw = json.loads(data)
            tiers = tuple(
                TierCapacity(str(t["tier"]), int(t["capacity_bytes"])) for t in raw.get("tiers", [])
            )
            member = Member(
                node_id=str(raw["node_id"]),
                address=str(raw["address"]),
                host_id=str(raw.get("host_id", "")),
                tiers=tiers,
            )
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise InvalidArgument(f"not a member record: {data[:200]!r} ({exc})") from None
        if not member.node_id or not member.address:
            raise InvalidArgument(f"member record without node_id or address: {data[:200]!r}")
        return member

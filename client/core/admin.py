"""The plans of the small calls: node info, stats, and delete (by keys or by scope).

Pure: yields `Call`s (client/core/steps.py); each is retried (all are idempotent).
"""

from __future__ import annotations

from collections.abc import Sequence

from client.contract.errors import InvalidArgument
from client.contract.scope import KEY_BYTES, Scope
from client.contract.types import Limits, NodeInfo, StoreStats
from client.core.replies import node_info_from_proto, stats_from_proto
from client.core.requests import batch_ranges, packed_keys, scope_bytes
from client.core.retry import call
from client.core.route import Settings
from client.core.steps import Plan
from kvstore_pb import store_pb2 as pb


def node_info(settings: Settings, timeout_s: float | None = None) -> Plan[NodeInfo]:
    """The node's identity, capacities and limits (within `timeout_s`, else the client's)."""
    reply = yield from call(
        "NodeInfo",
        pb.NodeInfoRequest(),
        pb.NodeInfoResponse,
        settings.policy,
        settings.timeout_s if timeout_s is None else timeout_s,
    )
    return node_info_from_proto(reply)


def stats(settings: Settings) -> Plan[StoreStats]:
    reply = yield from call(
        "Stats", pb.StatsRequest(), pb.StatsResponse, settings.policy, settings.timeout_s
    )
    return stats_from_proto(reply)


def checked_delete(scope: Scope | None, keys: Sequence[bytes] | None) -> bytes:
    """The packed keys of a delete by keys (b"" for one by scope); InvalidArgument unless
    exactly one of `scope` and `keys` is given, or for a malformed key (before any I/O)."""
    if (scope is None) == (keys is None):
        raise InvalidArgument("delete takes exactly one of scope or keys")
    return packed_keys(keys) if keys is not None else b""


def delete(
    scope: Scope | None, keys: Sequence[bytes], packed: bytes, limits: Limits, settings: Settings
) -> Plan[int]:
    """Delete every page of `scope` (when given), else the pages `keys`; the count deleted."""
    if scope is not None:
        request = pb.DeleteRequest(scope_digest=scope.digest, scope=scope_bytes(scope))
        reply = yield from call(
            "Delete", request, pb.DeleteResponse, settings.policy, settings.timeout_s
        )
        return reply.deleted
    deleted = 0
    for r in batch_ranges(len(keys), limits.max_keys_per_call):
        request = pb.DeleteRequest(keys=packed[r.start * KEY_BYTES : r.stop * KEY_BYTES])
        reply = yield from call(
            "Delete", request, pb.DeleteResponse, settings.policy, settings.timeout_s
        )
        deleted += reply.deleted
    return deleted

"""The plans of the small calls: node info, stats, and delete (by keys or by scope).

Pure: yields `Connect` and `Call`s (client/core/steps.py); each call is retried (all are
idempotent).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from client.contract.errors import InvalidArgument
from client.contract.scope import KEY_BYTES, Scope
from client.contract.types import NodeInfo, StoreStats
from client.core.replies import node_info_from_proto, stats_from_proto
from client.core.requests import batch_ranges, packed_keys, scope_bytes
from client.core.retry import call
from client.core.route import Route, Settings
from client.core.steps import Connect, Plan
from kvstore_pb import store_pb2 as pb


def node_info(settings: Settings, *, connect: bool = True) -> Plan[NodeInfo]:
    """The node's identity, capacities and limits. `connect` False: the call that opens the
    connection itself (the shell takes it on the channel it is opening)."""
    if connect:
        yield Connect()
    reply = yield from call(
        "NodeInfo",
        pb.NodeInfoRequest(),
        pb.NodeInfoResponse,
        settings.policy,
        settings.timeout_s,
    )
    return node_info_from_proto(reply)


def stats(settings: Settings) -> Plan[StoreStats]:
    yield Connect()
    reply = yield from call(
        "Stats", pb.StatsRequest(), pb.StatsResponse, settings.policy, settings.timeout_s
    )
    return stats_from_proto(reply)


def delete(scope: Scope | None, keys: Sequence[bytes] | None, settings: Settings) -> Plan[int]:
    """Delete every page of `scope`, or the pages `keys`; the count deleted. InvalidArgument
    (before any I/O) unless exactly one of the two is given, or for a malformed key."""
    if (scope is None) == (keys is None):
        raise InvalidArgument("delete takes exactly one of scope or keys")
    if scope is not None:
        yield Connect()
        request = pb.DeleteRequest(scope_digest=scope.digest, scope=scope_bytes(scope))
        reply = yield from call(
            "Delete", request, pb.DeleteResponse, settings.policy, settings.timeout_s
        )
        return reply.deleted
    assert keys is not None
    packed = packed_keys(keys)
    if not keys:
        return 0
    route = cast(Route, (yield Connect()))
    deleted = 0
    for r in batch_ranges(len(keys), route.limits.max_keys_per_call):
        request = pb.DeleteRequest(keys=packed[r.start * KEY_BYTES : r.stop * KEY_BYTES])
        reply = yield from call(
            "Delete", request, pb.DeleteResponse, settings.policy, settings.timeout_s
        )
        deleted += reply.deleted
    return deleted

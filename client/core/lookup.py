"""The plan of a lookup: the longest present prefix of a key chain, batched by the node's limit.

Pure: yields `Call`s (client/core/steps.py). A batch that is not all hits ends the chain, so
later batches are never asked.
"""

from __future__ import annotations

from collections.abc import Sequence

from client.contract.scope import KEY_BYTES, Scope
from client.contract.types import LookupResult, Tier
from client.core.replies import lookup_from_proto
from client.core.requests import batch_ranges, packed_keys, scope_bytes
from client.core.retry import call
from client.core.route import Route, Settings
from client.core.steps import Plan
from kvstore_pb import store_pb2 as pb


def checked_lookup(keys: Sequence[bytes]) -> bytes:
    """The packed keys of a lookup; InvalidArgument for a malformed key (before any I/O)."""
    return packed_keys(keys)


def lookup(
    scope: Scope, keys: Sequence[bytes], packed: bytes, route: Route, settings: Settings
) -> Plan[LookupResult]:
    hits = 0
    tiers: list[Tier] = []
    for r in batch_ranges(len(keys), route.limits.max_keys_per_call):
        request = pb.LookupRequest(
            scope_digest=scope.digest,
            keys=packed[r.start * KEY_BYTES : r.stop * KEY_BYTES],
            scope=scope_bytes(scope),
        )
        reply = yield from call(
            "Lookup", request, pb.LookupResponse, settings.policy, settings.timeout_s
        )
        part = lookup_from_proto(reply, len(r))
        hits += part.hit_count
        tiers.extend(part.tiers)
        if part.hit_count < len(r):
            break
    return LookupResult(hit_count=hits, tiers=tuple(tiers))

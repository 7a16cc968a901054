"""The plan of a lookup: the longest present prefix of a key chain, batched by the node's limit.

Pure: yields steps (client/core/steps.py). Over the TCP data path when one is open (should the
path itself fail, this batch and the rest go over the control channel), else a `Lookup` call on
the control channel. A batch that is not all hits ends the chain: later batches are not asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from client.contract.scope import KEY_BYTES, Scope
from client.contract.types import LookupResult, Tier
from client.core.replies import lookup_from_proto
from client.core.requests import batch_ranges, malformed, packed_keys, scope_bytes
from client.core.retry import call
from client.core.route import Route, Settings, lookup_path
from client.core.steps import BULK_FAILED, BulkLookup, Connect, Plan
from kvstore_pb import store_pb2 as pb


def lookup(scope: Scope, keys: Sequence[bytes], settings: Settings) -> Plan[LookupResult]:
    """InvalidArgument for a malformed key (before any I/O)."""
    packed = packed_keys(keys)
    if not keys:
        return LookupResult(hit_count=0, tiers=())
    route = cast(Route, (yield Connect(data=True)))
    path = lookup_path(route)
    tiers: list[Tier] = []
    for r in batch_ranges(len(keys), route.limits.max_keys_per_call):
        request = pb.LookupRequest(
            scope_digest=scope.digest,
            keys=packed[r.start * KEY_BYTES : r.stop * KEY_BYTES],
            scope=scope_bytes(scope),
        )
        part: tuple[Tier, ...] | None = None
        if path == "bulk":
            part = yield from _lookup_bulk(request, len(r), settings)
            if part is None:
                path = "grpc"
        if part is None:
            reply = yield from call(
                "Lookup", request, pb.LookupResponse, settings.policy, settings.timeout_s
            )
            part = lookup_from_proto(reply, len(r)).tiers
        tiers.extend(part)
        if len(part) < len(r):
            break
    return LookupResult(hit_count=len(tiers), tiers=tuple(tiers))


def _lookup_bulk(
    request: pb.LookupRequest, asked: int, settings: Settings
) -> Plan[tuple[Tier, ...] | None]:
    got = yield BulkLookup(request.SerializeToString(), asked, settings.timeout_s)
    if got is BULK_FAILED:
        return None
    if not isinstance(got, tuple) or len(got) > asked:
        raise malformed(f"a lookup of {asked} keys answered {got!r:.80}")
    return cast(tuple[Tier, ...], got)

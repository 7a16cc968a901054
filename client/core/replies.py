"""Replies of the store daemon as `client.contract.types` values.

Pure: no I/O. A reply that breaks the wire contract (an unknown tier, status or event kind; a
count that does not match the request) raises the malformed-reply StrataError.
"""

from __future__ import annotations

from client.contract.types import (
    Event,
    EventKind,
    Limits,
    LookupResult,
    NodeInfo,
    PutStatus,
    Segment,
    StoreStats,
    Tier,
    TierInfo,
    TierStats,
)
from client.core.requests import malformed
from kvstore_pb import store_pb2 as pb

_TIER_BY_VALUE = {int(t): t for t in Tier}


def tier_of(value: int) -> Tier:
    """A tier a reply must name; malformed-reply error for 0 or an unknown value."""
    try:
        return Tier(value)
    except ValueError:
        raise malformed(f"unknown tier {value}") from None


def optional_tier(value: int) -> Tier | None:
    """A tier that may be unspecified (0 -> None)."""
    return None if value == 0 else tier_of(value)


def node_info_from_proto(msg: pb.NodeInfoResponse) -> NodeInfo:
    lim = msg.limits
    return NodeInfo(
        node_id=msg.node_id,
        host_id=msg.host_id,
        api_version=msg.api_version,
        server_version=msg.server_version,
        tiers=tuple(
            TierInfo(tier_of(t.tier), t.capacity_bytes, t.used_bytes, t.pages, t.device)
            for t in msg.tiers
        ),
        limits=Limits(
            max_keys_per_call=lim.max_keys_per_call,
            max_page_bytes=lim.max_page_bytes,
            max_message_bytes=lim.max_message_bytes,
            chunk_bytes=lim.chunk_bytes,
            lease_ttl_ms=lim.lease_ttl_ms,
        ),
        segments=tuple(
            Segment(
                tier_of(s.tier),
                s.name,
                s.size_bytes,
                s.generations_offset,
                s.generation_granule_bytes,
            )
            for s in msg.segments
        ),
        local_address=msg.local_address,
        ucx_address=msg.ucx_address,
        tcp_address=msg.tcp_address,
    )


def lookup_from_proto(msg: pb.LookupResponse, asked: int) -> LookupResult:
    if msg.hit_count > asked or len(msg.tiers) != msg.hit_count:
        raise malformed(
            f"lookup of {asked} keys answered {msg.hit_count} hits with {len(msg.tiers)} tiers"
        )
    codes = msg.tiers[:]  # one copy out of the message: its own iteration is slower
    try:
        if codes and codes.count(codes[0]) == len(codes):  # a chain in one tier: no step a page
            tiers = (_TIER_BY_VALUE[codes[0]],) * len(codes)
        else:
            tiers = tuple(map(_TIER_BY_VALUE.__getitem__, codes))
    except KeyError as exc:
        raise malformed(f"unknown tier {exc.args[0]}") from None
    return LookupResult(hit_count=msg.hit_count, tiers=tiers)


def put_statuses_from_proto(msg: pb.PutResponse, asked: int) -> tuple[PutStatus, ...]:
    if len(msg.statuses) != asked:
        raise malformed(f"put of {asked} pages answered {len(msg.statuses)} statuses")
    try:
        return tuple(PutStatus(s) for s in msg.statuses)
    except ValueError:
        raise malformed(f"unknown put status in {list(msg.statuses)}") from None


def stats_from_proto(msg: pb.StatsResponse) -> StoreStats:
    return StoreStats(
        tiers=tuple(
            TierStats(
                tier=tier_of(t.tier),
                capacity_bytes=t.capacity_bytes,
                used_bytes=t.used_bytes,
                pages=t.pages,
                hits=t.hits,
                misses=t.misses,
                evictions=t.evictions,
            )
            for t in msg.tiers
        ),
        pages=msg.pages,
        demotions=msg.demotions,
        promotions=msg.promotions,
        corrupt_dropped=msg.corrupt_dropped,
        lease_expiries=msg.lease_expiries,
        active_leases=msg.active_leases,
        lookups=msg.lookups,
        lookup_hit_pages=msg.lookup_hit_pages,
    )


def event_from_proto(msg: pb.Event) -> Event:
    try:
        kind = EventKind(msg.kind)
    except ValueError:
        raise malformed(f"unknown event kind {msg.kind}") from None
    return Event(
        seq=msg.seq,
        kind=kind,
        key=msg.key,
        scope_digest=msg.scope_digest,
        from_tier=optional_tier(msg.from_tier),
        to_tier=optional_tier(msg.to_tier),
        size_bytes=msg.size_bytes,
    )

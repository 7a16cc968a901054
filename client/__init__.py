"""Strata client SDK: scopes and page keys, the page codec, and the store clients.

Engines import only what this module exports (DESIGN §2).
"""

from __future__ import annotations

from client.async_client import AsyncStoreClient
from client.cluster.cluster_client import ClusterClient, ClusterStats, NodeStats
from client.cluster.etcd import EtcdClient, EtcdUnavailable
from client.cluster.placement import rank
from client.contract.errors import (
    CapacityExhausted,
    Corrupt,
    DeadlineExceeded,
    InvalidArgument,
    LeaseExpired,
    PermissionDenied,
    StrataError,
    Unauthenticated,
    Unavailable,
)
from client.contract.page import PageHeader, decode_page, encode_page, make_header
from client.contract.scope import KEY_BYTES, KVLayout, Scope, Shard, chain_key, page_keys
from client.contract.types import (
    Event,
    EventKind,
    GetResult,
    IoClass,
    Limits,
    LookupResult,
    NodeInfo,
    Page,
    PutResult,
    PutStatus,
    Segment,
    StoreStats,
    Tier,
    TierInfo,
    TierStats,
    WritableBuffer,
    build_pages,
    page_tokens,
)
from client.store_client import StoreClient
from client.transports.hostid import host_id

__all__ = [
    "KEY_BYTES",
    "AsyncStoreClient",
    "CapacityExhausted",
    "ClusterClient",
    "ClusterStats",
    "Corrupt",
    "DeadlineExceeded",
    "EtcdClient",
    "EtcdUnavailable",
    "Event",
    "EventKind",
    "GetResult",
    "InvalidArgument",
    "IoClass",
    "KVLayout",
    "LeaseExpired",
    "Limits",
    "LookupResult",
    "NodeInfo",
    "NodeStats",
    "Page",
    "PageHeader",
    "PermissionDenied",
    "PutResult",
    "PutStatus",
    "Scope",
    "Segment",
    "Shard",
    "StoreClient",
    "StoreStats",
    "StrataError",
    "Tier",
    "TierInfo",
    "TierStats",
    "Unauthenticated",
    "Unavailable",
    "WritableBuffer",
    "build_pages",
    "chain_key",
    "decode_page",
    "encode_page",
    "host_id",
    "make_header",
    "page_keys",
    "page_tokens",
    "rank",
]

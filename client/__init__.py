"""Strata client SDK: scopes and page keys, the page codec, and the store clients.

Engines import only what this module exports (DESIGN §2).
"""

from __future__ import annotations

from client.errors import (
    CapacityExhausted,
    Corrupt,
    DeadlineExceeded,
    InvalidArgument,
    LeaseExpired,
    StrataError,
    Unavailable,
)
from client.page import PageHeader, decode_page, encode_page, make_header
from client.scope import KEY_BYTES, KVLayout, Scope, Shard, chain_key, page_keys

__all__ = [
    "KEY_BYTES",
    "CapacityExhausted",
    "Corrupt",
    "DeadlineExceeded",
    "InvalidArgument",
    "KVLayout",
    "LeaseExpired",
    "PageHeader",
    "Scope",
    "Shard",
    "StrataError",
    "Unavailable",
    "chain_key",
    "decode_page",
    "encode_page",
    "make_header",
    "page_keys",
]

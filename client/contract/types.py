"""Result and value types of the store clients (DESIGN §6).

Every call of `StoreClient` / `AsyncStoreClient` returns one of these frozen, slotted dataclasses,
never a protobuf message, so callers need neither grpc nor kvstore_pb. The enums carry the same
integer values as their counterparts in proto/kvstore_pb/store.proto; `0` (unspecified) has no
member here — the client sends it for "none" and rejects it in replies where a value is required.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from client.contract.errors import InvalidArgument
from client.contract.page import HEADER_FIXED_BYTES, Buffer, PageHeader, make_headers
from client.contract.scope import Scope, chain_key, pack_tokens

WritableBuffer = bytearray | memoryview
"""A buffer a get may copy a payload into. Any writable, C-contiguous buffer works at run time
(wrap numpy arrays or CPU tensors in `memoryview(...)`)."""


class Tier(IntEnum):
    """Where a page lives. Same values as `strata.store.v1.Tier`."""

    GPU = 1
    DRAM = 2
    SSD = 3


class IoClass(IntEnum):
    """Priority of a call; the daemon serves them in this order. Same values as the proto."""

    CRITICAL = 1  # a decode waiting to start
    NORMAL = 2  # prefill pulls
    BACKGROUND = 3  # publishing, prefetch, demotion


class PutStatus(IntEnum):
    """Outcome of one page of a put. Same values as `strata.store.v1.PutStatus`."""

    STORED = 1
    ALREADY_PRESENT = 2
    # Not stored: another client's reservation is writing this key right now. Retry later: the
    # key is free again when that write commits (then ALREADY_PRESENT) or its lease ends.
    PENDING = 3


class EventKind(IntEnum):
    """What happened to a page. Same values as `strata.store.v1.EventKind`."""

    STORED = 1
    REMOVED = 2
    MOVED = 3


@dataclass(frozen=True, slots=True)
class TierInfo:
    """One tier of a node, as NodeInfo reports it."""

    tier: Tier
    capacity_bytes: int
    used_bytes: int
    pages: int
    device: str  # the gpu tier's torch device string; "" otherwise


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-call limits the node enforces. A zero means "no limit announced"."""

    max_keys_per_call: int
    max_page_bytes: int
    max_message_bytes: int
    chunk_bytes: int
    lease_ttl_ms: int


@dataclass(frozen=True, slots=True)
class Segment:
    """A shared-memory segment of a node: a file `/dev/shm/<name>` of `size_bytes`."""

    tier: Tier
    name: str
    size_bytes: int
    generations_offset: int = 0  # where the slot generation table starts (0: none)
    generation_granule_bytes: int = 0


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """Identity, capacities and limits of one store daemon."""

    node_id: str
    host_id: str
    api_version: int
    server_version: str
    tiers: tuple[TierInfo, ...]
    limits: Limits
    segments: tuple[Segment, ...]
    local_address: str  # "unix:/path" for same-host control traffic, or ""
    # "ucx://host:port" of the UCX data path, "" for none; None: not decoded from the reply
    ucx_address: str | None = None
    # "tcp://host:port" of the TCP bulk data path, "" for none; None: not decoded from the reply
    tcp_address: str | None = None


@dataclass(frozen=True, slots=True)
class LookupResult:
    """`hit_count` = length of the longest present prefix; `tiers[i]` = fastest tier of hit i."""

    hit_count: int
    tiers: tuple[Tier, ...]


@dataclass(frozen=True, slots=True)
class Page:
    """One page to publish: its header and its payload (any contiguous buffer of
    `header.payload_bytes` bytes; it is read, never kept, by `put`)."""

    header: PageHeader
    payload: Buffer


@dataclass(frozen=True, slots=True)
class PutResult:
    """One status per page of the put, in order."""

    statuses: tuple[PutStatus, ...]

    @property
    def stored(self) -> int:
        """Pages this call stored."""
        return sum(1 for s in self.statuses if s is PutStatus.STORED)

    @property
    def already_present(self) -> int:
        """Pages the store already held (nothing was written for them)."""
        return sum(1 for s in self.statuses if s is PutStatus.ALREADY_PRESENT)


class GetResult:
    """One entry per requested key: the verified header of a page now in the caller's buffer,
    or None for a miss (absent, or dropped by verification).

    Built from `PageHeader`s or from header bytes the client has already checked byte for byte
    (header checksum, key, scope, size, and the caller's token ids): those are decoded on the
    first read of `headers`, so a caller that needs only the hit counts never pays for building
    header objects. `rejected` counts pages the store served that were not the ones asked for
    (their token ids differ from the caller's: a key collision, crafted or not): misses here.
    """

    __slots__ = ("_decoded", "_items", "rejected")

    def __init__(self, headers: Sequence[PageHeader | bytes | None], rejected: int = 0) -> None:
        self._items = tuple(headers)
        self._decoded: tuple[PageHeader | None, ...] | None = None
        self.rejected = rejected

    @property
    def headers(self) -> tuple[PageHeader | None, ...]:
        if self._decoded is None:
            self._decoded = tuple(
                PageHeader.decode(h) if isinstance(h, bytes) else h for h in self._items
            )
        return self._decoded

    @property
    def entries(self) -> tuple[PageHeader | bytes | None, ...]:
        """Each key's header as built (a PageHeader, or checked header bytes not decoded yet),
        or None: for merging results without decoding them."""
        return self._items

    @property
    def hit_count(self) -> int:
        """Number of pages delivered."""
        return sum(1 for h in self._items if h is not None)

    @property
    def prefix_hits(self) -> int:
        """Length of the leading run of delivered pages: what a prefill can use."""
        n = 0
        for h in self._items:
            if h is None:
                break
            n += 1
        return n

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GetResult):
            return NotImplemented
        return self.headers == other.headers

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"GetResult(hits={self.hit_count} of {len(self._items)})"


@dataclass(frozen=True, slots=True)
class TierStats:
    """Counters of one tier since the daemon started."""

    tier: Tier
    capacity_bytes: int
    used_bytes: int
    pages: int
    hits: int
    misses: int
    evictions: int


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Daemon-wide counters (mirrors `StatsResponse`)."""

    tiers: tuple[TierStats, ...]
    pages: int
    demotions: int
    promotions: int
    corrupt_dropped: int
    lease_expiries: int
    active_leases: int
    lookups: int
    lookup_hit_pages: int


@dataclass(frozen=True, slots=True)
class Event:
    """A change to one page. `from_tier` is set for MOVED/REMOVED, `to_tier` for STORED/MOVED."""

    seq: int
    kind: EventKind
    key: bytes
    scope_digest: bytes
    from_tier: Tier | None
    to_tier: Tier | None
    size_bytes: int


def build_pages(
    scope: Scope,
    token_ids: Sequence[int],
    payloads: Sequence[Buffer],
    *,
    first_page: int = 0,
) -> list[Page]:
    """Pages `first_page .. first_page + len(payloads) - 1` of `token_ids` under `scope`.

    Keys are chained from the scope digest through every earlier full page, so a prefill that
    publishes only its newly computed pages passes `first_page` = the number of cached ones.
    Pure; raises InvalidArgument when the payloads need more full pages than `token_ids` has, or
    a payload does not fit the scope's layout (see `make_header`). Each header's payload
    checksum is computed on first use (client/contract/page.py): a same-host put never computes
    it, a remote put does inside the put.
    """
    page = scope.layout.page_tokens
    full = len(token_ids) // page
    if first_page < 0 or first_page + len(payloads) > full:
        raise InvalidArgument(
            f"pages {first_page}..{first_page + len(payloads) - 1} requested, but "
            f"{len(token_ids)} tokens hold only {full} full pages of {page}"
        )
    parent = scope.digest
    for i in range(first_page):
        parent = chain_key(parent, token_ids[i * page : (i + 1) * page])
    token_pages = [
        token_ids[i * page : (i + 1) * page] for i in range(first_page, first_page + len(payloads))
    ]
    headers = make_headers(scope, parent, token_pages, payloads)
    return [Page(header=h, payload=p) for h, p in zip(headers, payloads, strict=True)]


def tokens_le(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 (a put's chain prefix on the wire). Raises
    InvalidArgument for an id that is not a uint32."""
    return pack_tokens(tokens) if tokens else b""


def chain_prefixes_for(
    scope: Scope,
    pages: Sequence[Page],
    subset: Sequence[int],
    prefix_tokens: Sequence[int] = (),
) -> list[list[int]]:
    """The chain prefixes (kvstore/chain.py) a node needs to verify `pages[i] for i in subset`
    when it may hold no other page of the call: for each run of `pages` that chain one to the
    next and in which some page of `subset` follows a page outside it, the token ids from the
    run's root (the scope digest; for a run starting at `pages[0]`, `prefix_tokens` — the
    prompt before it — when given) through that run's last page in `subset`. A run whose root
    is unknown here gets none. Pure."""
    mine = set(subset)
    out: list[list[int]] = []
    start = 0
    n = len(pages)
    while start < n:
        end = start + 1
        while end < n and pages[end].header.parent == pages[end - 1].header.key:
            end += 1
        rooted = pages[start].header.parent == scope.digest
        base: Sequence[int] | None = (
            () if rooted else (prefix_tokens if start == 0 and prefix_tokens else None)
        )
        inside = [j for j in range(start, end) if j in mine]
        orphan = any(j - 1 not in mine if j > start else not rooted for j in inside)
        if base is not None and inside and orphan:
            prefix = list(base)
            for j in range(start, max(inside)):
                prefix.extend(pages[j].header.tokens)
            if prefix:
                out.append(prefix)
        start = end
    return out


def page_tokens(scope: Scope, token_ids: Sequence[int], first_page: int = 0) -> list[Sequence[int]]:
    """The token ids of each full page of `token_ids` from `first_page` on: what a get takes as
    `tokens` for the keys `page_keys(scope, token_ids)[first_page:]`. Pure."""
    page = scope.layout.page_tokens
    full = len(token_ids) // page
    return [token_ids[i * page : (i + 1) * page] for i in range(first_page, full)]


def checked_tokens(
    scope: Scope, keys: Sequence[bytes], tokens: Sequence[Sequence[int]] | None
) -> list[bytes] | None:
    """Each key's expected token ids as little-endian uint32 (what page headers hold), checked
    before any RPC: InvalidArgument unless `tokens` has one full page of ids per key. None (the
    caller's explicit opt-out) stays None."""
    if tokens is None:
        return None
    if len(tokens) != len(keys):
        raise InvalidArgument(
            f"a get of {len(keys)} keys needs {len(keys)} token lists, got {len(tokens)}"
        )
    page = scope.layout.page_tokens
    out = []
    for i, ids in enumerate(tokens):
        if len(ids) != page:
            raise InvalidArgument(
                f"tokens[{i}] has {len(ids)} ids; a page of this scope has {page}"
            )
        out.append(pack_tokens(ids))
    return out


def match_tokens(
    scope: Scope, headers: Sequence[PageHeader | bytes | None], expected: Sequence[bytes] | None
) -> tuple[Sequence[PageHeader | bytes | None], int]:
    """`headers` with every page whose token ids are not `expected[i]` (see `checked_tokens`)
    turned into a miss, and how many were. The check every SDK read makes (DESIGN §3: a hash is
    not proof): a page served for a key is used only if it holds exactly the caller's tokens
    (and, for a header the client decoded in full, the scope's dtype, layout and page size;
    header bytes passed `quick_check`, which covers those). Header bytes are compared in place:
    their token ids sit at a fixed offset. `expected` None: `headers` as they are. Pure."""
    if expected is None:
        return headers, 0
    out: list[PageHeader | bytes | None] = []
    rejected = 0
    for header, want in zip(headers, expected, strict=True):
        if header is None:
            out.append(None)
            continue
        if isinstance(header, PageHeader):
            ok = (
                len(header.tokens) * 4 == len(want)
                and header.encode()[HEADER_FIXED_BYTES : HEADER_FIXED_BYTES + len(want)] == want
                and header.dtype == scope.kv_dtype
                and header.layout == scope.layout
                and header.payload_bytes == scope.page_payload_bytes
            )
        else:
            ok = header[HEADER_FIXED_BYTES : HEADER_FIXED_BYTES + len(want)] == want
        if ok:
            out.append(header)
        else:
            out.append(None)
            rejected += 1
    return out, rejected

"""`StoreClient`: the blocking client of one store daemon (DESIGN §6).

It picks its data path when it connects: the same-host path (the daemon's shared-memory segment
mapped here; only control messages over gRPC, on the daemon's unix socket when it has one) when
the daemon runs on this host, else chunked gRPC streams. Both give the same results.

Every call has a deadline (`timeout_s`, shared by all attempts of the call); only idempotent calls
are retried (NodeInfo, Lookup, Get, Acquire, Release, Delete, Stats), with jittered backoff. A miss
is a result; a page that fails verification is a miss too, counted in `corrupt_pages`. Errors are
the typed ones of `client.contract.errors`.

Thread-safe: one client may serve many threads. gevent (locust): in a monkey-patched process call
`client.transports.gevent_support.init()` (which runs `grpc.experimental.gevent.init_gevent()` once) after
patching and before creating any client; gRPC then cooperates with the gevent hub.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar, cast

import grpc

from client.contract.errors import InvalidArgument, StrataError, Unavailable
from client.contract.page import PageHeader
from client.contract.scope import KEY_BYTES, Scope
from client.contract.types import (
    Event,
    GetResult,
    IoClass,
    LookupResult,
    NodeInfo,
    Page,
    PutResult,
    PutStatus,
    StoreStats,
    Tier,
    WritableBuffer,
    checked_tokens,
    match_tokens,
    tokens_le,
)
from client.transports._wire import (
    DEFAULT_MAX_MESSAGE_BYTES,
    GET_METHOD,
    PUT_METHOD,
    WATCH_TIMEOUT_S,
    Deadline,
    GetAssembler,
    RetryPolicy,
    auth_metadata,
    batch_ranges,
    channel_options,
    check_node,
    chunk_bytes_for,
    destination_views,
    event_from_proto,
    io_class_value,
    lookup_from_proto,
    malformed,
    map_rpc_error,
    node_info_from_proto,
    packed_keys,
    payload_views,
    put_messages,
    put_statuses_from_proto,
    raw_bytes,
    resolve_token,
    scope_bytes,
    stats_from_proto,
    tune_malloc,
    with_token,
)
from client.transports.hostid import host_id
from client.transports.lane import Lane, LaneCall, LaneError, LaneStub
from client.transports.lane_protocol import SCHEME as LANE_SCHEME
from client.transports.shm import (
    SegmentMap,
    map_handed_segments,
    map_node_segments,
    read_acquired,
    segments_current,
    write_reserved,
)
from client.transports.tls import TlsOptions, open_channel, resolve_tls
from client.transports.ucx_protocol import TCP_SCHEME
from client.transports.ucx_transport import TransportFailed, UcxLink, UcxTransport
from kvstore_pb import store_pb2 as pb
from kvstore_pb.store_pb2_grpc import StoreStub

log = logging.getLogger(__name__)

R = TypeVar("R")
Transport = Literal["shm", "grpc", "ucx", "tcp"]
_LOCAL_PROBE_S = 2.0
# Same-host puts of at least this many pages go as two halves in flight at once: the daemon
# reserves (then commits) one half while this client copies the other.
_PIPELINE_MIN_PAGES = 16
_PIPELINE_PARTS = 2  # four measured no better


class _EventStream(Protocol):
    def __iter__(self) -> Iterator[pb.Event]: ...
    def cancel(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class _Connection:
    channel: grpc.Channel
    stub: StoreStub  # or a LaneStub, which has the same call surface
    node: NodeInfo
    maps: tuple[SegmentMap, ...]

    @property
    def transport(self) -> Transport:
        return "shm" if self.maps else "grpc"

    def close(self) -> None:
        if isinstance(self.stub, LaneStub):
            self.stub.lane.close()
        self.channel.close()
        for m in self.maps:
            m.close()


class StoreClient:
    """Blocking client of one store daemon at `address` ("host:port" or "unix:/path").

    `shared_memory`: True forces the same-host path (Unavailable if impossible), False forbids
    it, None picks it when the daemon is on this host and its segments map. Connects lazily on
    the first call, or explicitly with `connect()`; `close()` (or leaving a `with` block) ends it.

    `ucx` and `tcp` (remote path only) choose the bulk data path for put and get: True requires
    the UCX (or TCP) data path (Unavailable if it cannot be used: ucxx missing, no listener),
    False never uses it, None uses it when both ends can. On auto, UCX is preferred where the
    environment configures a fabric for it (UCX_TLS naming RDMA or GPU transports), else the TCP
    data path, else UCX, else gRPC streams (the choice is said once in the log, as is a fall back
    to gRPC after a transport failure).

    `tls` (client/transports/tls.py): TlsOptions (CA file, client certificate and key), True (system CAs),
    False (plaintext), None (the STRATA_STORE_TLS_* environment; plaintext when unset). With TLS
    gRPC and the TCP data path are encrypted and UCX is never used; nothing falls back to
    plaintext.

    `token`: the bearer token of this client's principal on a daemon with auth on (None: the
    STRATA_STORE_TOKEN environment variable, none sent when unset; "": none, whatever the
    environment says), sent on every call. A call the principal may not make raises
    PermissionDenied, a missing or unknown token Unauthenticated. Every read carries its
    scope's canonical encoding, which such a daemon checks against the token.
    """

    def __init__(
        self,
        address: str,
        *,
        shared_memory: bool | None = None,
        timeout_s: float = 10.0,
        retries: int = 2,
        io_class: IoClass = IoClass.NORMAL,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        ucx: bool | None = None,
        tcp: bool | None = None,
        tls: TlsOptions | bool | None = None,
        token: str | None = None,
    ) -> None:
        if timeout_s <= 0 or retries < 0 or max_message_bytes <= 0:
            raise InvalidArgument("timeout_s and max_message_bytes must be > 0, retries >= 0")
        self.address = address
        self._shared_memory = shared_memory
        self._timeout_s = timeout_s
        self._policy = RetryPolicy(retries)
        self._io_class = IoClass(io_class)
        self._max_message_bytes = max_message_bytes
        self._tls = resolve_tls(tls)
        self._token = resolve_token(token)
        self._metadata = auth_metadata(self._token)  # for the raw Put and Get calls
        self._ucx = UcxLink(ucx, address, tcp, self._tls, self._token)
        self._lock = threading.Lock()
        self._conn: _Connection | None = None
        self._closed = False
        self._lane_refused = False  # said once in the log
        self._releases: list[grpc.Future[pb.ReleaseResponse]] = []
        self._counter_lock = threading.Lock()
        self.corrupt_pages = 0
        """Pages dropped by verification since the client was made (each also a miss)."""

    # ---- lifecycle -------------------------------------------------------------------------

    def connect(self) -> NodeInfo:
        """Connect (if not yet connected) and choose the data path; returns the node's info.

        Raises Unavailable when the daemon cannot be reached, speaks another API version, or
        shared memory was forced but cannot be used.
        """
        with self._lock:
            if self._closed:
                raise Unavailable("the client is closed")
            if self._conn is None:
                self._conn = self._open()
            return self._conn.node

    @property
    def transport(self) -> Transport:
        """The data path: "shm", "ucx", "tcp" or "grpc" (the bulk path is settled on first ask).
        StrataError before connecting."""
        conn = self._conn
        if conn is None:
            raise StrataError("not connected yet: call connect() first")
        if conn.transport == "grpc" and (bulk := self._ucx_for(conn)) is not None:
            return "tcp" if bulk.address.startswith(TCP_SCHEME) else "ucx"
        return conn.transport

    def close(self) -> None:
        """Send outstanding lease releases (briefly), close the channel and unmap. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conn, self._conn = self._conn, None
        with self._counter_lock:
            pending, self._releases = self._releases, []
        deadline = Deadline(min(self._timeout_s, _LOCAL_PROBE_S))
        for fut in pending:
            with contextlib.suppress(Exception):
                fut.result(timeout=deadline.remaining_s())
        self._ucx.close()
        if conn is not None:
            conn.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- calls -----------------------------------------------------------------------------

    def node_info(self) -> NodeInfo:
        """Fresh identity, capacities and limits of the node. Read-only; retried."""
        conn = self._ready()
        reply = self._call(conn.stub, "NodeInfo", pb.NodeInfoRequest(), pb.NodeInfoResponse)
        return node_info_from_proto(reply)

    def lookup(self, scope: Scope, keys: Sequence[bytes]) -> LookupResult:
        """Longest present prefix of the key chain `keys`, with the tier of each hit.

        Read-only; retried. InvalidArgument for a malformed key (before any RPC).
        """
        packed = packed_keys(keys)
        if not keys:
            return LookupResult(hit_count=0, tiers=())
        conn = self._ready()
        hits = 0
        tiers: list[Tier] = []
        for r in batch_ranges(len(keys), conn.node.limits.max_keys_per_call):
            request = pb.LookupRequest(
                scope_digest=scope.digest,
                keys=packed[r.start * KEY_BYTES : r.stop * KEY_BYTES],
                scope=scope_bytes(scope),
            )
            reply = self._call(conn.stub, "Lookup", request, pb.LookupResponse)
            part = lookup_from_proto(reply, len(r))
            hits += part.hit_count
            tiers.extend(part.tiers)
            if part.hit_count < len(r):
                break
        return LookupResult(hit_count=hits, tiers=tuple(tiers))

    def put(
        self,
        scope: Scope,
        pages: Sequence[Page],
        *,
        io_class: IoClass | None = None,
        tier: Tier | None = None,
        chain_prefixes: Sequence[Sequence[int]] = (),
        prefix_tokens: Sequence[int] = (),
    ) -> PutResult:
        """Publish `pages` (full pages of `scope`); one status per page. Mutates; never retried.

        The daemon verifies each page's key chain (kvstore/chain.py): a page must follow the
        scope digest, an earlier page of the put, or a key the node holds or remembers. When it
        may hold none of the pages' ancestors, `chain_prefixes` vouch for them: each the token
        ids of a prompt from its first full page on (every key they chain to counts as known);
        `prefix_tokens`, the ids of the prompt's pages before `pages[0]`, is one more (as
        `ClusterClient.put` takes it). Without them such a put raises InvalidArgument "chain
        does not verify".

        `tier` None places pages where the node chooses; on the same-host path pages go into the
        DRAM segment, so a put asking for another tier takes the gRPC path. InvalidArgument (before
        any RPC) for a page of another scope or layout, or a payload of the wrong size;
        CapacityExhausted when the store is full (see `retry_after_s`).
        """
        views = payload_views(scope, pages)
        if not pages:
            return PutResult(statuses=())
        conn = self._ready()
        io = self._io(io_class)
        same_host = bool(conn.maps) and tier in (None, Tier.DRAM)
        prefix = [tokens_le(p) for p in (*chain_prefixes, prefix_tokens) if p]
        statuses: list[PutStatus] = []
        for r in batch_ranges(len(pages), conn.node.limits.max_keys_per_call):
            part_pages, part_views = pages[r.start : r.stop], views[r.start : r.stop]
            if same_host:
                statuses.extend(self._put_shm(conn, scope, part_pages, part_views, io, prefix))
            elif (ucx := self._ucx_for(conn)) is not None:
                statuses.extend(
                    self._put_ucx(ucx, conn, scope, part_pages, part_views, io, tier, prefix)
                )
            else:
                statuses.extend(
                    self._put_grpc(conn, scope, part_pages, part_views, io, tier, prefix)
                )
        return PutResult(statuses=tuple(statuses))

    def get(
        self,
        scope: Scope,
        keys: Sequence[bytes],
        into: Sequence[WritableBuffer],
        *,
        tokens: Sequence[Sequence[int]] | None,
        io_class: IoClass | None = None,
        verify: bool | None = None,
    ) -> GetResult:
        """Copy each present page's payload into `into[i]`; headers of the pages delivered.

        `tokens[i]` are the token ids of page `keys[i]` (`page_tokens` splits a prompt): a page
        is delivered only if its header holds exactly these ids, so a key collision, crafted or
        not, is a miss (counted in `GetResult.rejected`), never another prompt's KV. `tokens`
        must be passed; None is the explicit opt-out of a caller that checks what it is served
        itself (a tool that reads pages by key, knowing no tokens) — never use it to serve KV.

        Read-only (leases are taken and released within the call); retried. `verify` None checks
        payload checksums on the gRPC path only (the daemon verifies what it reads from SSD).
        InvalidArgument (before any RPC) unless `into` has one writable, C-contiguous buffer of at
        least a page per key and `tokens` one full page of ids per key. A miss leaves its
        buffer's contents unspecified.
        """
        packed = packed_keys(keys)
        views = destination_views(scope, keys, into)
        expected = checked_tokens(scope, keys, tokens)
        if not keys:
            return GetResult(headers=())
        conn = self._ready()
        io = self._io(io_class)
        check = verify if verify is not None else not conn.maps
        headers: list[PageHeader | bytes | None] = []
        for r in batch_ranges(len(keys), conn.node.limits.max_keys_per_call):
            part = (
                conn,
                scope,
                keys[r.start : r.stop],
                packed[r.start * KEY_BYTES : r.stop * KEY_BYTES],
                views[r.start : r.stop],
                io,
                check,
            )
            if conn.maps:
                headers.extend(self._get_shm(*part))
            elif (ucx := self._ucx_for(conn)) is not None:
                headers.extend(self._get_ucx(ucx, *part))
            else:
                headers.extend(self._get_grpc(*part))
        matched, rejected = match_tokens(scope, headers, expected)
        return GetResult(matched, rejected)

    def delete(self, scope: Scope | None = None, keys: Sequence[bytes] | None = None) -> int:
        """Delete the pages `keys`, or every page of `scope` (exactly one of the two); returns
        how many were deleted. Mutates; retried (deleting twice deletes nothing more)."""
        if (scope is None) == (keys is None):
            raise InvalidArgument("delete takes exactly one of scope or keys")
        if scope is not None:
            conn = self._ready()
            request = pb.DeleteRequest(scope_digest=scope.digest, scope=scope_bytes(scope))
            return self._call(conn.stub, "Delete", request, pb.DeleteResponse).deleted
        assert keys is not None
        packed = packed_keys(keys)
        if not keys:
            return 0
        conn = self._ready()
        deleted = 0
        for r in batch_ranges(len(keys), conn.node.limits.max_keys_per_call):
            request = pb.DeleteRequest(keys=packed[r.start * KEY_BYTES : r.stop * KEY_BYTES])
            deleted += self._call(conn.stub, "Delete", request, pb.DeleteResponse).deleted
        return deleted

    def stats(self) -> StoreStats:
        """Daemon-wide counters. Read-only; retried."""
        conn = self._ready()
        return stats_from_proto(self._call(conn.stub, "Stats", pb.StatsRequest(), pb.StatsResponse))

    def watch(
        self, scope: Scope | None = None, *, timeout_s: float | None = WATCH_TIMEOUT_S
    ) -> Iterator[Event]:
        """Events of `scope` (every scope when None) as they happen, until the iterator is
        closed, the client is closed, or `timeout_s` passes (an hour by default; None: no
        deadline). The channel's keep-alive pings notice a daemon that went away meanwhile.
        A daemon serves a bounded number of streams at once: beyond it a watch is refused
        with CapacityExhausted (retry later). Never retried: a gap shows as a jump in
        `Event.seq`."""
        conn = self._ready()
        request = (
            pb.WatchRequest(scope_digest=scope.digest, scope=scope_bytes(scope))
            if scope is not None
            else pb.WatchRequest()
        )
        return self._events(conn.stub.Watch(request, timeout=timeout_s))

    # ---- data paths ------------------------------------------------------------------------

    def _put_grpc(
        self,
        conn: _Connection,
        scope: Scope,
        pages: Sequence[Page],
        views: Sequence[memoryview],
        io: IoClass,
        tier: Tier | None,
        chain_prefix: list[bytes],
    ) -> tuple[PutStatus, ...]:
        tune_malloc()
        chunk = chunk_bytes_for(conn.node.limits, self._max_message_bytes)
        # Messages are built by hand (one copy of each payload), so the call sends them as is.
        put = conn.channel.stream_unary(
            PUT_METHOD,
            request_serializer=raw_bytes,
            response_deserializer=pb.PutResponse.FromString,
        )

        def attempt(timeout: float) -> pb.PutResponse:
            requests = put_messages(
                scope,
                pages,
                views,
                io_class=io,
                tier=tier,
                chunk_bytes=chunk,
                chain_prefix=chain_prefix,
            )
            reply = put(requests, timeout=timeout, metadata=self._metadata)
            if not isinstance(reply, pb.PutResponse):
                raise malformed(f"Put answered {type(reply).__name__}")
            return reply

        return put_statuses_from_proto(self._retry("Put", attempt), len(pages))

    def _put_shm(
        self,
        conn: _Connection,
        scope: Scope,
        pages: Sequence[Page],
        views: Sequence[memoryview],
        io: IoClass,
        chain_prefix: list[bytes],
    ) -> tuple[PutStatus, ...]:
        if len(pages) >= _PIPELINE_MIN_PAGES and isinstance(conn.stub, LaneStub):
            return self._put_shm_pipelined(conn, conn.stub, scope, pages, views, io, chain_prefix)
        request = pb.ReserveRequest(
            scope=scope.encode(),
            headers=[p.header.encode() for p in pages],
            io_class=io_class_value(io),
            client_pid=os.getpid(),
            chain_prefix=chain_prefix,
        )
        reply = self._call(conn.stub, "Reserve", request, pb.ReserveResponse)
        self._check_segments(conn, reply.lease_id)
        try:
            statuses = write_reserved(reply, conn.maps, views)
            if reply.lease_id:
                commit = pb.CommitRequest(lease_id=reply.lease_id)
                self._call(conn.stub, "Commit", commit, pb.CommitResponse)
        except BaseException:
            if reply.lease_id:
                self._release_later(conn, reply.lease_id)
            raise
        return statuses

    def _put_shm_pipelined(
        self,
        conn: _Connection,
        lane: LaneStub,
        scope: Scope,
        pages: Sequence[Page],
        views: Sequence[memoryview],
        io: IoClass,
        chain_prefix: list[bytes],
    ) -> tuple[PutStatus, ...]:
        """`_put_shm` as two halves in flight: the second half's reservation is asked for as
        soon as the first's is granted (the daemon verifies a half's key chain from pages it
        has reserved or stored, kvstore/chain.py); each half is copied as soon as its slots
        arrive and its commit sent at once, so the daemon's work on one half overlaps the copy
        of the other. All pages are visible when this returns; on any failure, whatever was
        reserved and not committed is released."""
        count = min(_PIPELINE_PARTS, len(pages) // (_PIPELINE_MIN_PAGES // 2))
        bounds = [len(pages) * k // count for k in range(count + 1)]
        parts = [(pages[a:b], views[a:b]) for a, b in itertools.pairwise(bounds)]
        timeout = self._timeout_s

        def start_reserve(part: Sequence[Page]) -> LaneCall:
            request = pb.ReserveRequest(
                scope=scope.encode(),
                headers=[p.header.encode() for p in part],
                io_class=io_class_value(io),
                client_pid=os.getpid(),
                chain_prefix=chain_prefix,
            )
            return lane.Reserve.start(request, timeout)

        reserving = [start_reserve(parts[0][0])]
        committing: list[LaneCall] = []
        leases: list[int] = []  # reserved, not yet known to be committed
        statuses: list[PutStatus] = []
        try:
            for k, (_, part_views) in enumerate(parts):
                reply = cast(pb.ReserveResponse, reserving[k].result())
                if reply.lease_id:
                    leases.append(reply.lease_id)
                if k + 1 < len(parts):
                    reserving.append(start_reserve(parts[k + 1][0]))
                self._check_segments(conn, reply.lease_id)
                statuses.extend(write_reserved(reply, conn.maps, part_views))
                if reply.lease_id:
                    commit = pb.CommitRequest(lease_id=reply.lease_id)
                    committing.append(lane.Commit.start(commit, timeout))
            for call in committing:
                call.result()
            leases.clear()
        except BaseException as exc:
            for call in reserving:  # a reservation whose reply was not read: read and release
                with contextlib.suppress(Exception):
                    pending = cast(pb.ReserveResponse, call.result())
                    if pending.lease_id:
                        leases.append(pending.lease_id)
            for call in committing:
                call.cancel()
            for lease_id in leases:  # a committed lease is unknown by now: releasing it is a no-op
                self._release_later(conn, lease_id)
            if isinstance(exc, grpc.RpcError):
                raise map_rpc_error(exc) from exc
            raise
        return tuple(statuses)

    def _get_grpc(
        self,
        conn: _Connection,
        scope: Scope,
        keys: Sequence[bytes],
        packed: bytes,
        views: Sequence[memoryview],
        io: IoClass,
        verify: bool,
    ) -> tuple[PageHeader | None, ...]:
        tune_malloc()
        request = pb.GetRequest(
            scope_digest=scope.digest,
            keys=packed,
            io_class=io_class_value(io),
            scope=scope_bytes(scope),
        )
        # Replies are decoded by hand, straight from the received bytes into `views`.
        get = conn.channel.unary_stream(
            GET_METHOD,
            request_serializer=pb.GetRequest.SerializeToString,
            response_deserializer=raw_bytes,
        )

        def attempt(timeout: float) -> GetAssembler:
            assembler = GetAssembler(scope, keys, views, verify=verify)
            call = get(request, timeout=timeout, metadata=self._metadata)
            try:
                for raw in call:
                    assembler.feed_message(raw)
            except BaseException:
                call.cancel()
                raise
            return assembler

        assembler = self._retry("Get", attempt)
        headers = assembler.finish()
        self._count_corrupt(assembler.corrupt)
        return headers

    def _get_shm(
        self,
        conn: _Connection,
        scope: Scope,
        keys: Sequence[bytes],
        packed: bytes,
        views: Sequence[memoryview],
        io: IoClass,
        verify: bool,
    ) -> tuple[PageHeader | bytes | None, ...]:
        request = pb.AcquireRequest(
            scope_digest=scope.digest,
            keys=packed,
            io_class=io_class_value(io),
            scope=scope_bytes(scope),
        )
        reply = self._call(conn.stub, "Acquire", request, pb.AcquireResponse)
        self._check_segments(conn, reply.lease_id)
        try:
            headers, corrupt = read_acquired(reply, conn.maps, scope, keys, views, verify=verify)
        finally:
            if reply.lease_id:
                self._release_later(conn, reply.lease_id)
        self._count_corrupt(corrupt)
        return headers

    def _put_ucx(
        self,
        ucx: UcxTransport,
        conn: _Connection,
        scope: Scope,
        pages: Sequence[Page],
        views: Sequence[memoryview],
        io: IoClass,
        tier: Tier | None,
        chain_prefix: list[bytes],
    ) -> tuple[PutStatus, ...]:
        begin = pb.PutBegin(
            scope=scope.encode(),
            io_class=io_class_value(io),
            page_count=len(pages),
            tier=pb.Tier.ValueType(int(tier) if tier is not None else 0),
            chain_prefix=chain_prefix,
        ).SerializeToString()
        try:
            return ucx.put(
                begin, [p.header.encode() for p in pages], views, timeout_s=self._timeout_s
            )
        except TransportFailed as exc:
            self._ucx.give_up(exc)
        return self._put_grpc(conn, scope, pages, views, io, tier, chain_prefix)

    def _get_ucx(
        self,
        ucx: UcxTransport,
        conn: _Connection,
        scope: Scope,
        keys: Sequence[bytes],
        packed: bytes,
        views: Sequence[memoryview],
        io: IoClass,
        verify: bool,
    ) -> tuple[PageHeader | None, ...]:
        request = pb.GetRequest(
            scope_digest=scope.digest,
            keys=packed,
            io_class=io_class_value(io),
            scope=scope_bytes(scope),
        )
        try:
            outcome = ucx.get(
                request.SerializeToString(),
                scope.digest,
                keys,
                views,
                verify=verify,
                timeout_s=self._timeout_s,
            )
        except TransportFailed as exc:
            self._ucx.give_up(exc)
            return self._get_grpc(conn, scope, keys, packed, views, io, verify)
        self._count_corrupt(outcome.corrupt)
        return outcome.headers

    # ---- plumbing --------------------------------------------------------------------------

    def _ucx_for(self, conn: _Connection) -> UcxTransport | None:
        """The UCX transport of the remote path of `conn`, or None (use gRPC)."""
        if conn.maps or self._ucx.off:
            return None
        return self._ucx.transport(
            conn,
            conn.node.ucx_address or "",
            tcp_address=conn.node.tcp_address or "",
            timeout_s=self._timeout_s,
            max_page_bytes=conn.node.limits.max_page_bytes,
        )

    def _ready(self) -> _Connection:
        conn = self._conn
        if conn is not None:
            return conn
        self.connect()
        conn = self._conn
        if conn is None:  # closed concurrently
            raise Unavailable("the client is closed")
        return conn

    def _open(self) -> _Connection:
        channel = open_channel(self.address, channel_options(self._max_message_bytes), self._tls)
        try:
            stub = with_token(StoreStub(channel), self._token)
            node = node_info_from_proto(
                self._call(stub, "NodeInfo", pb.NodeInfoRequest(), pb.NodeInfoResponse)
            )
            check_node(node)
            # a daemon of another user may hand its segment over the lane (auth.local_uids)
            handable = (
                self._shared_memory is not False
                and bool(node.segments)
                and node.local_address.startswith(LANE_SCHEME)
                and node.host_id == host_id()
            )
            unmapped: Unavailable | None = None
            try:
                maps = map_node_segments(node, self._shared_memory)
            except Unavailable as exc:
                if not handable:
                    raise
                maps, unmapped = (), exc
        except BaseException:
            channel.close()
            raise
        if node.local_address and (maps or handable):
            try:
                lane_stub = self._open_local(node, stub)
            except LaneError as refused:  # not trusted with the same-host path: remote path
                for m in maps:
                    m.close()
                maps = ()
                if self._shared_memory:
                    channel.close()
                    raise Unavailable(
                        f"the store refuses this client shared memory: {refused}"
                    ) from None
                if not self._lane_refused:
                    self._lane_refused = True
                    log.warning("same-host path refused (%s); using the remote path", refused)
            else:
                if lane_stub is not None and not maps:
                    maps = map_handed_segments(node, lane_stub.lane.take_segment_fds())
                if lane_stub is not None and maps:
                    stub = cast(StoreStub, lane_stub)
                elif lane_stub is not None:
                    lane_stub.lane.close()
        if unmapped is not None and not maps:
            channel.close()
            raise unmapped
        conn = _Connection(channel=channel, stub=stub, node=node, maps=maps)
        log.info(
            "connected to store %s (%s) at %s: %s data path",
            node.node_id,
            node.server_version,
            self.address,
            conn.transport,
        )
        return conn

    def _open_local(self, node: NodeInfo, grpc_stub: StoreStub) -> LaneStub | None:
        """Unary control calls over the daemon's same-host lane, if it answers as the same node.
        Raises LaneError when the daemon refuses this client the same-host path."""
        if not node.local_address.startswith(LANE_SCHEME):
            return None
        lane = Lane(node.local_address, self._token)
        stub = LaneStub(lane, grpc_stub)
        try:
            reply = stub.NodeInfo(
                pb.NodeInfoRequest(), timeout=min(self._timeout_s, _LOCAL_PROBE_S)
            )
            if not isinstance(reply, pb.NodeInfoResponse) or reply.node_id != node.node_id:
                raise Unavailable(f"{node.local_address} is another node")
        except (grpc.RpcError, StrataError) as exc:
            if isinstance(exc, LaneError) and exc.refused:
                lane.close()
                raise
            log.info(
                "control traffic stays on %s: %s unusable (%s)",
                self.address,
                node.local_address,
                exc,
            )
            lane.close()
            return None
        return stub

    def _check_segments(self, conn: _Connection, lease_id: int) -> None:
        """Unless the daemon's segments are still the ones mapped here (it restarted): release
        `lease_id`, drop the connection so the next call connects afresh, raise Unavailable."""
        if segments_current(conn.maps):
            return
        with self._lock:
            if self._conn is conn:
                self._conn = None
        if lease_id:
            with contextlib.suppress(Exception):
                release = pb.ReleaseRequest(lease_id=lease_id)
                conn.stub.Release(release, timeout=min(self._timeout_s, _LOCAL_PROBE_S))
        conn.close()
        raise Unavailable("the store's shared-memory segment changed (daemon restarted?)")

    def _call(self, stub: StoreStub, method: str, request: object, reply_type: type[R]) -> R:
        function = getattr(stub, method)

        def attempt(timeout: float) -> R:
            reply = function(request, timeout=timeout)
            if not isinstance(reply, reply_type):
                raise malformed(f"{method} answered {type(reply).__name__}")
            return reply

        return self._retry(method, attempt)

    def _retry(self, method: str, attempt: Callable[[float], R]) -> R:
        deadline = Deadline(self._timeout_s)
        attempts = self._policy.attempts_for(method)
        for n in range(attempts):
            try:
                return attempt(max(deadline.remaining_s(), 0.001))
            except grpc.RpcError as exc:
                error, cause = map_rpc_error(exc), exc
            except StrataError as exc:
                error, cause = exc, None
            delay = self._policy.delay_s(n, error, deadline) if n + 1 < attempts else None
            if delay is None:
                raise error from cause
            log.debug("%s failed (%s); retrying in %.3f s", method, error, delay)
            time.sleep(delay)
        raise AssertionError("unreachable")

    def _release_later(self, conn: _Connection, lease_id: int) -> None:
        """Send Release without waiting for the reply; reaped later or at close."""
        try:
            fut = conn.stub.Release.future(
                pb.ReleaseRequest(lease_id=lease_id), timeout=self._timeout_s
            )
        except Exception as exc:  # e.g. the channel was closed under us; the lease runs out
            log.debug("release of lease %d not sent: %s", lease_id, exc)
            return
        with self._counter_lock:
            self._releases = [f for f in self._releases if not f.done()]
            self._releases.append(fut)

    def _count_corrupt(self, count: int) -> None:
        if count:
            with self._counter_lock:
                self.corrupt_pages += count

    def _io(self, io_class: IoClass | None) -> IoClass:
        return IoClass(io_class) if io_class is not None else self._io_class

    def _events(self, call: _EventStream) -> Iterator[Event]:
        try:
            for msg in call:
                yield event_from_proto(msg)
        except grpc.RpcError as exc:
            if self._closed:
                return
            raise map_rpc_error(exc) from exc
        finally:
            call.cancel()

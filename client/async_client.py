"""`AsyncStoreClient`: the asyncio (grpc.aio) twin of `StoreClient` (DESIGN §6).

Same methods, same arguments, same typed results and errors, awaited. See client/store_client.py
for the data paths, deadlines and retries; the logic both share lives in client/transports/_wire.py and
client/transports/shm.py. Lease releases after a same-host get are background tasks, so a get costs one
round trip; `close()` waits briefly for the outstanding ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar, cast

import grpc
import grpc.aio

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
)
from client.transports.shm import (
    SegmentMap,
    map_node_segments,
    read_acquired,
    segments_current,
    write_reserved,
)
from client.transports.tls import TlsOptions, open_aio_channel, open_channel, resolve_tls
from kvstore_pb import store_pb2 as pb
from kvstore_pb.store_pb2_grpc import StoreStub

if TYPE_CHECKING:
    from kvstore_pb.store_pb2_grpc import StoreAsyncStub

log = logging.getLogger(__name__)

R = TypeVar("R")
Transport = Literal["shm", "grpc"]
_LOCAL_PROBE_S = 2.0


def _async_stub(channel: grpc.aio.Channel) -> StoreAsyncStub:
    """The generated stub over an aio channel (typed as the async stub it is at run time)."""
    stub: object = StoreStub(channel)
    return cast("StoreAsyncStub", stub)


@dataclass(frozen=True, slots=True)
class _Connection:
    channel: grpc.aio.Channel
    stub: StoreAsyncStub
    node: NodeInfo
    maps: tuple[SegmentMap, ...]

    @property
    def transport(self) -> Transport:
        return "shm" if self.maps else "grpc"

    async def close(self) -> None:
        await self.channel.close()
        for m in self.maps:
            m.close()


class AsyncStoreClient:
    """asyncio client of one store daemon at `address`; see `StoreClient` for the arguments.

    Use it from one event loop: the channel is made, lazily, in the loop of the first call.
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
        tls: TlsOptions | bool | None = None,
        token: str | None = None,
    ) -> None:
        if timeout_s <= 0 or retries < 0 or max_message_bytes <= 0:
            raise InvalidArgument("timeout_s and max_message_bytes must be > 0, retries >= 0")
        self.address = address
        self._tls = resolve_tls(tls)
        self._token = resolve_token(token)
        self._metadata = auth_metadata(self._token)  # on every call
        self._shared_memory = shared_memory
        self._timeout_s = timeout_s
        self._policy = RetryPolicy(retries)
        self._io_class = IoClass(io_class)
        self._max_message_bytes = max_message_bytes
        self._lock = asyncio.Lock()
        self._conn: _Connection | None = None
        self._closed = False
        self._put_channel: grpc.Channel | None = None  # blocking channel for put streams
        self._releases: set[asyncio.Task[None]] = set()
        self.corrupt_pages = 0
        """Pages dropped by verification since the client was made (each also a miss)."""

    # ---- lifecycle -------------------------------------------------------------------------

    async def connect(self) -> NodeInfo:
        """Connect (if not yet connected) and choose the data path; returns the node's info."""
        async with self._lock:
            if self._closed:
                raise Unavailable("the client is closed")
            if self._conn is None:
                self._conn = await self._open()
            return self._conn.node

    @property
    def transport(self) -> Transport:
        """The data path chosen at connect: "shm" or "grpc". StrataError before connecting."""
        conn = self._conn
        if conn is None:
            raise StrataError("not connected yet: call connect() first")
        return conn.transport

    async def close(self) -> None:
        """Wait briefly for outstanding lease releases, close the channel and unmap. Idempotent."""
        async with self._lock:
            if self._closed:
                return
            self._closed = True
            conn, self._conn = self._conn, None
        pending, self._releases = self._releases, set()
        if pending:
            await asyncio.wait(pending, timeout=min(self._timeout_s, _LOCAL_PROBE_S))
            for task in pending:
                task.cancel()
        if conn is not None:
            await conn.close()
        if self._put_channel is not None:
            self._put_channel.close()
            self._put_channel = None

    async def __aenter__(self) -> AsyncStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- calls -----------------------------------------------------------------------------

    async def node_info(self) -> NodeInfo:
        """Fresh identity, capacities and limits of the node. Read-only; retried."""
        conn = await self._ready()
        reply = await self._call(conn.stub, "NodeInfo", pb.NodeInfoRequest(), pb.NodeInfoResponse)
        return node_info_from_proto(reply)

    async def lookup(self, scope: Scope, keys: Sequence[bytes]) -> LookupResult:
        """Longest present prefix of the key chain `keys`; see `StoreClient.lookup`."""
        packed = packed_keys(keys)
        if not keys:
            return LookupResult(hit_count=0, tiers=())
        conn = await self._ready()
        hits = 0
        tiers: list[Tier] = []
        for r in batch_ranges(len(keys), conn.node.limits.max_keys_per_call):
            request = pb.LookupRequest(
                scope_digest=scope.digest,
                keys=packed[r.start * KEY_BYTES : r.stop * KEY_BYTES],
                scope=scope_bytes(scope),
            )
            reply = await self._call(conn.stub, "Lookup", request, pb.LookupResponse)
            part = lookup_from_proto(reply, len(r))
            hits += part.hit_count
            tiers.extend(part.tiers)
            if part.hit_count < len(r):
                break
        return LookupResult(hit_count=hits, tiers=tuple(tiers))

    async def put(
        self,
        scope: Scope,
        pages: Sequence[Page],
        *,
        io_class: IoClass | None = None,
        tier: Tier | None = None,
        chain_prefixes: Sequence[Sequence[int]] = (),
        prefix_tokens: Sequence[int] = (),
    ) -> PutResult:
        """Publish `pages`; one status per page. See `StoreClient.put` (and its
        `chain_prefixes`)."""
        views = payload_views(scope, pages)
        if not pages:
            return PutResult(statuses=())
        conn = await self._ready()
        io = self._io(io_class)
        same_host = bool(conn.maps) and tier in (None, Tier.DRAM)
        prefix = [tokens_le(p) for p in (*chain_prefixes, prefix_tokens) if p]
        statuses: list[PutStatus] = []
        for r in batch_ranges(len(pages), conn.node.limits.max_keys_per_call):
            part_pages, part_views = pages[r.start : r.stop], views[r.start : r.stop]
            if same_host:
                statuses.extend(
                    await self._put_shm(conn, scope, part_pages, part_views, io, prefix)
                )
            else:
                statuses.extend(
                    await self._put_grpc(conn, scope, part_pages, part_views, io, tier, prefix)
                )
        return PutResult(statuses=tuple(statuses))

    async def get(
        self,
        scope: Scope,
        keys: Sequence[bytes],
        into: Sequence[WritableBuffer],
        *,
        tokens: Sequence[Sequence[int]] | None,
        io_class: IoClass | None = None,
        verify: bool | None = None,
    ) -> GetResult:
        """Copy each present page's payload into `into[i]`. See `StoreClient.get`."""
        packed = packed_keys(keys)
        views = destination_views(scope, keys, into)
        expected = checked_tokens(scope, keys, tokens)
        if not keys:
            return GetResult(headers=())
        conn = await self._ready()
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
                headers.extend(await self._get_shm(*part))
            else:
                headers.extend(await self._get_grpc(*part))
        matched, rejected = match_tokens(scope, headers, expected)
        return GetResult(matched, rejected)

    async def delete(self, scope: Scope | None = None, keys: Sequence[bytes] | None = None) -> int:
        """Delete the pages `keys`, or every page of `scope` (exactly one); the count deleted."""
        if (scope is None) == (keys is None):
            raise InvalidArgument("delete takes exactly one of scope or keys")
        if scope is not None:
            conn = await self._ready()
            request = pb.DeleteRequest(scope_digest=scope.digest, scope=scope_bytes(scope))
            return (await self._call(conn.stub, "Delete", request, pb.DeleteResponse)).deleted
        assert keys is not None
        packed = packed_keys(keys)
        if not keys:
            return 0
        conn = await self._ready()
        deleted = 0
        for r in batch_ranges(len(keys), conn.node.limits.max_keys_per_call):
            request = pb.DeleteRequest(keys=packed[r.start * KEY_BYTES : r.stop * KEY_BYTES])
            deleted += (await self._call(conn.stub, "Delete", request, pb.DeleteResponse)).deleted
        return deleted

    async def stats(self) -> StoreStats:
        """Daemon-wide counters. Read-only; retried."""
        conn = await self._ready()
        reply = await self._call(conn.stub, "Stats", pb.StatsRequest(), pb.StatsResponse)
        return stats_from_proto(reply)

    def watch(
        self, scope: Scope | None = None, *, timeout_s: float | None = WATCH_TIMEOUT_S
    ) -> AsyncIterator[Event]:
        """Events of `scope` (every scope when None); see `StoreClient.watch`."""
        return self._events(scope, timeout_s)

    # ---- data paths ------------------------------------------------------------------------

    async def _put_grpc(
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
        # The stream runs on a blocking channel in a worker thread: grpc.aio reports a write that
        # races the daemon's early answer (say RESOURCE_EXHAUSTED) as INTERNAL and loses the real
        # status, while the blocking stub returns the daemon's status. Messages are built by hand
        # (one copy of each payload), so the call sends them as is.
        if self._put_channel is None:
            self._put_channel = open_channel(
                self.address, channel_options(self._max_message_bytes), self._tls
            )
        put = self._put_channel.stream_unary(
            PUT_METHOD,
            request_serializer=raw_bytes,
            response_deserializer=pb.PutResponse.FromString,
        )

        async def attempt(timeout: float) -> pb.PutResponse:
            requests = put_messages(
                scope,
                pages,
                views,
                io_class=io,
                tier=tier,
                chunk_bytes=chunk,
                chain_prefix=chain_prefix,
            )
            reply = await asyncio.to_thread(put, requests, timeout=timeout, metadata=self._metadata)
            if not isinstance(reply, pb.PutResponse):
                raise malformed(f"Put answered {type(reply).__name__}")
            return reply

        return put_statuses_from_proto(await self._retry("Put", attempt), len(pages))

    async def _put_shm(
        self,
        conn: _Connection,
        scope: Scope,
        pages: Sequence[Page],
        views: Sequence[memoryview],
        io: IoClass,
        chain_prefix: list[bytes],
    ) -> tuple[PutStatus, ...]:
        request = pb.ReserveRequest(
            scope=scope.encode(),
            headers=[p.header.encode() for p in pages],
            io_class=io_class_value(io),
            client_pid=os.getpid(),
            chain_prefix=chain_prefix,
        )
        reply = await self._call(conn.stub, "Reserve", request, pb.ReserveResponse)
        await self._check_segments(conn, reply.lease_id)
        try:
            statuses = write_reserved(reply, conn.maps, views)
            if reply.lease_id:
                commit = pb.CommitRequest(lease_id=reply.lease_id)
                await self._call(conn.stub, "Commit", commit, pb.CommitResponse)
        except BaseException:
            if reply.lease_id:
                self._release_later(conn, reply.lease_id)
            raise
        return statuses

    async def _get_grpc(
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

        async def attempt(timeout: float) -> GetAssembler:
            assembler = GetAssembler(scope, keys, views, verify=verify)
            call = get(request, timeout=timeout, metadata=self._metadata)
            try:
                async for raw in call:
                    assembler.feed_message(raw)
            except BaseException:
                call.cancel()
                raise
            return assembler

        assembler = await self._retry("Get", attempt)
        headers = assembler.finish()
        self.corrupt_pages += assembler.corrupt
        return headers

    async def _get_shm(
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
        reply = await self._call(conn.stub, "Acquire", request, pb.AcquireResponse)
        await self._check_segments(conn, reply.lease_id)
        try:
            headers, corrupt = read_acquired(reply, conn.maps, scope, keys, views, verify=verify)
        finally:
            if reply.lease_id:
                self._release_later(conn, reply.lease_id)
        self.corrupt_pages += corrupt
        return headers

    # ---- plumbing --------------------------------------------------------------------------

    async def _ready(self) -> _Connection:
        conn = self._conn
        if conn is not None:
            return conn
        await self.connect()
        conn = self._conn
        if conn is None:  # closed concurrently
            raise Unavailable("the client is closed")
        return conn

    async def _open(self) -> _Connection:
        options = channel_options(self._max_message_bytes)
        channel = open_aio_channel(self.address, options, self._tls)
        try:
            stub = _async_stub(channel)
            reply = await self._call(stub, "NodeInfo", pb.NodeInfoRequest(), pb.NodeInfoResponse)
            node = node_info_from_proto(reply)
            check_node(node)
            maps = map_node_segments(node, self._shared_memory)
        except BaseException:
            await channel.close()
            raise
        if maps and node.local_address.startswith("unix:"):
            local = await self._open_local(node)
            if local is not None:
                await channel.close()
                channel, stub = local
        conn = _Connection(channel=channel, stub=stub, node=node, maps=maps)
        log.info(
            "connected to store %s (%s) at %s: %s data path",
            node.node_id,
            node.server_version,
            self.address,
            conn.transport,
        )
        return conn

    async def _open_local(self, node: NodeInfo) -> tuple[grpc.aio.Channel, StoreAsyncStub] | None:
        """A control channel on the daemon's unix socket, if it answers as the same node."""
        options = channel_options(self._max_message_bytes)
        channel = grpc.aio.insecure_channel(node.local_address, options=options)
        stub = _async_stub(channel)
        try:
            probe_s = min(self._timeout_s, _LOCAL_PROBE_S)
            reply = await stub.NodeInfo(
                pb.NodeInfoRequest(), timeout=probe_s, metadata=self._metadata
            )
            if reply.node_id != node.node_id:
                raise Unavailable(f"{node.local_address} is node {reply.node_id!r}")
        except (grpc.RpcError, StrataError) as exc:
            log.info(
                "control traffic stays on %s: %s unusable (%s)",
                self.address,
                node.local_address,
                exc,
            )
            await channel.close()
            return None
        return channel, stub

    async def _check_segments(self, conn: _Connection, lease_id: int) -> None:
        """Unless the daemon's segments are still the ones mapped here (it restarted): release
        `lease_id`, drop the connection so the next call connects afresh, raise Unavailable."""
        if segments_current(conn.maps):
            return
        if self._conn is conn:
            self._conn = None
        if lease_id:
            with contextlib.suppress(Exception):
                release = pb.ReleaseRequest(lease_id=lease_id)
                await conn.stub.Release(
                    release,
                    timeout=min(self._timeout_s, _LOCAL_PROBE_S),
                    metadata=self._metadata,
                )
        await conn.close()
        raise Unavailable("the store's shared-memory segment changed (daemon restarted?)")

    async def _call(
        self, stub: StoreAsyncStub, method: str, request: object, reply_type: type[R]
    ) -> R:
        function = getattr(stub, method)

        async def attempt(timeout: float) -> R:
            reply = await function(request, timeout=timeout, metadata=self._metadata)
            if not isinstance(reply, reply_type):
                raise malformed(f"{method} answered {type(reply).__name__}")
            return reply

        return await self._retry(method, attempt)

    async def _retry(self, method: str, attempt: Callable[[float], Awaitable[R]]) -> R:
        deadline = Deadline(self._timeout_s)
        attempts = self._policy.attempts_for(method)
        for n in range(attempts):
            try:
                return await attempt(max(deadline.remaining_s(), 0.001))
            except grpc.RpcError as exc:
                error, cause = map_rpc_error(exc), exc
            except StrataError as exc:
                error, cause = exc, None
            delay = self._policy.delay_s(n, error, deadline) if n + 1 < attempts else None
            if delay is None:
                raise error from cause
            log.debug("%s failed (%s); retrying in %.3f s", method, error, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def _release_later(self, conn: _Connection, lease_id: int) -> None:
        """Send Release in a background task; the get does not wait for the reply."""
        task = asyncio.get_running_loop().create_task(self._release(conn, lease_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, conn: _Connection, lease_id: int) -> None:
        try:
            await conn.stub.Release(
                pb.ReleaseRequest(lease_id=lease_id),
                timeout=self._timeout_s,
                metadata=self._metadata,
            )
        except Exception as exc:  # the lease runs out on its own
            log.debug("release of lease %d failed: %s", lease_id, exc)

    def _io(self, io_class: IoClass | None) -> IoClass:
        return IoClass(io_class) if io_class is not None else self._io_class

    async def _events(self, scope: Scope | None, timeout_s: float | None) -> AsyncIterator[Event]:
        conn = await self._ready()
        request = (
            pb.WatchRequest(scope_digest=scope.digest, scope=scope_bytes(scope))
            if scope is not None
            else pb.WatchRequest()
        )
        call = conn.stub.Watch(request, timeout=timeout_s, metadata=self._metadata)
        try:
            async for msg in call:
                yield event_from_proto(msg)
        except grpc.RpcError as exc:
            if self._closed:
                return
            raise map_rpc_error(exc) from exc
        finally:
            call.cancel()

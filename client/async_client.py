"""`AsyncStoreClient`: the asyncio (grpc.aio) twin of `StoreClient` (DESIGN §6).

Same methods, same arguments, same data paths (same-host shared memory, UCX, TCP, gRPC streams),
same typed results and errors, awaited. A thin asyncio shell over the client core (client/core/):
the core builds the requests, picks the path, splits batches, decides retries and assembles the
results, exactly as for `StoreClient`; this file connects and takes the core's I/O steps with
awaits (`_drive`, `_take`). See client/store_client.py for the data paths, deadlines and
retries. Control calls on the same host go over gRPC on the daemon's unix socket. Lease releases
after a same-host get are background tasks, so a get costs one round trip; `close()` waits
briefly for the outstanding ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, cast

import grpc
import grpc.aio

from client.contract.errors import StrataError, Unavailable
from client.contract.scope import Scope
from client.contract.types import (
    Event,
    GetResult,
    IoClass,
    LookupResult,
    NodeInfo,
    Page,
    PutResult,
    StoreStats,
    Tier,
    WritableBuffer,
)
from client.core import admin
from client.core import get as get_op
from client.core import lookup as lookup_op
from client.core import put as put_op
from client.core.frames import GET_METHOD, PUT_METHOD
from client.core.requests import check_node, scope_bytes
from client.core.route import Route
from client.core.run import Run
from client.core.steps import (
    BULK_FAILED,
    BulkGet,
    BulkLookup,
    BulkPut,
    Call,
    Cancel,
    CheckSegments,
    Connect,
    CopyIn,
    CopyOut,
    Dropped,
    Join,
    Pause,
    Plan,
    Release,
    Start,
    Step,
    StreamGet,
    StreamPut,
    Together,
)
from client.shell import ClientShell, Transport
from client.transports._wire import (
    WATCH_TIMEOUT_S,
    channel_options,
    event_from_proto,
    map_rpc_error,
    raw_bytes,
    tune_malloc,
    typed_error,
)
from client.transports.shm import (
    SegmentMap,
    map_node_segments,
    read_acquired,
    segments_current,
    write_reserved,
)
from client.transports.tls import open_aio_channel, open_channel
from client.transports.ucx_transport import TransportFailed, UcxTransport
from kvstore_pb import store_pb2 as pb
from kvstore_pb.store_pb2_grpc import StoreStub

if TYPE_CHECKING:
    from kvstore_pb.store_pb2_grpc import StoreAsyncStub

log = logging.getLogger(__name__)

R = TypeVar("R")
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


class AsyncStoreClient(ClientShell):
    """asyncio client of one store daemon at `address`; see `StoreClient` for the arguments
    (`shared_memory`, `ucx`, `tcp`, `tls`, `token`, `tcp_stripes`, `tcp_stripe_min_bytes`:
    the same modes, the same errors). A striped batch's parts are concurrent tasks on this
    loop, each on a TCP connection of its own.

    Use it from one event loop: the channel is made, lazily, in the loop of the first call.
    """

    def _init_io_state(self) -> None:
        self._bulk_conn: _Connection | None = None  # the connection the bulk path was opened for
        self._lock = asyncio.Lock()
        self._conn: _Connection | None = None
        self._closed = False
        self._put_channel: grpc.Channel | None = None  # blocking channel for put streams
        self._releases: set[asyncio.Task[None]] = set()

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
        """The data path: "shm", "ucx", "tcp" or "grpc" (the bulk path is settled by the first
        put or get; until then "grpc"). StrataError before connecting."""
        conn = self._conn
        if conn is None:
            raise StrataError("not connected yet: call connect() first")
        return self._transport_of(conn, self._bulk_for(conn) if self._bulk_conn is conn else None)

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
        await asyncio.to_thread(self._ucx.close)
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
        return await self._drive(admin.node_info(self._settings))

    async def lookup(self, scope: Scope, keys: Sequence[bytes]) -> LookupResult:
        """Longest present prefix of the key chain `keys`; see `StoreClient.lookup`."""
        return await self._drive(lookup_op.lookup(scope, keys, self._settings))

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
        plan = put_op.put(
            scope,
            pages,
            io_class=io_class,
            tier=tier,
            chain_prefixes=chain_prefixes,
            prefix_tokens=prefix_tokens,
            settings=self._settings,
            client_pid=os.getpid(),
        )
        return await self._drive(plan)

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
        plan = get_op.get(
            scope,
            keys,
            into,
            tokens=tokens,
            io_class=io_class,
            verify=verify,
            settings=self._settings,
        )
        return await self._drive(plan)

    async def delete(self, scope: Scope | None = None, keys: Sequence[bytes] | None = None) -> int:
        """Delete the pages `keys`, or every page of `scope` (exactly one); the count deleted."""
        return await self._drive(admin.delete(scope, keys, self._settings))

    async def stats(self) -> StoreStats:
        """Daemon-wide counters. Read-only; retried."""
        return await self._drive(admin.stats(self._settings))

    def watch(
        self, scope: Scope | None = None, *, timeout_s: float | None = WATCH_TIMEOUT_S
    ) -> AsyncIterator[Event]:
        """Events of `scope` (every scope when None); see `StoreClient.watch`."""
        return self._events(scope, timeout_s)

    # ---- the driver: the core's steps, taken with awaits -----------------------------------

    async def _drive(self, plan: Plan[R], stub: StoreAsyncStub | None = None) -> R:
        """Run `plan` to its result: take each step it yields, hand back what the step gave or
        throw in its failure as a typed error. `stub`: the control calls of a connection being
        opened (the plan then yields no `Connect`)."""
        run = Run(plan)
        conn: _Connection | None = None
        outcome: object
        step = run.advance()
        while step is not None:
            try:
                if isinstance(step, Connect):
                    conn = await self._ready()
                    stub = conn.stub
                    outcome = await self._route(conn, step.data)
                elif stub is None:
                    raise StrataError(f"{step!r} before Connect")
                else:
                    outcome = await self._take(stub, conn, step)
            except BaseException as exc:
                step = run.advance(error=typed_error(exc))
            else:
                step = run.advance(outcome)
        return run.result

    async def _take(self, stub: StoreAsyncStub, conn: _Connection | None, step: Step) -> object:
        if isinstance(step, Call):
            function = getattr(stub, step.method)
            return await function(step.request, timeout=step.timeout_s, metadata=self._metadata)
        if isinstance(step, Pause):
            await asyncio.sleep(step.seconds)
            return None
        if conn is None:
            raise StrataError(f"{type(step).__name__} needs a connection")
        match step:
            case CheckSegments(lease_id=lease_id):
                await self._check_segments(conn, lease_id)
                return None
            case CopyOut():
                return read_acquired(
                    step.reply, conn.maps, step.scope, step.keys, step.into, verify=step.verify
                )
            case CopyIn():
                return write_reserved(step.reply, conn.maps, step.payloads)
            case Release(lease_id=lease_id):
                self._release_later(conn, lease_id)
                return None
            case Dropped(count=count):
                self.corrupt_pages += count
                return None
            case Start():
                function = getattr(stub, step.method)
                started = function(step.request, timeout=step.timeout_s, metadata=self._metadata)
                handle = asyncio.ensure_future(started)
                # grpc.aio sends from the call's own task: one loop turn, so the call is in
                # flight when Start returns (steps.py), not only at the next await that waits;
                # a pipelined put's next Reserve is otherwise sent after the copy it was to
                # overlap, with that part's Commit
                await asyncio.sleep(0)
                return handle
            case Join(handle=handle):
                return await cast("asyncio.Future[object]", handle)
            case Cancel(handle=handle):
                cast("asyncio.Future[object]", handle).cancel()
                return None
            case StreamGet():
                await self._stream_get(conn, step)
                return None
            case StreamPut():
                return await self._stream_put(conn, step)
            case BulkGet():
                return await self._bulk_get(conn, step)
            case BulkPut():
                return await self._bulk_put(conn, step)
            case BulkLookup():
                return await self._bulk_lookup(conn, step)
            case Together(steps=steps):
                return await self._together(stub, conn, steps)
        raise AssertionError(f"unknown step {step!r}")

    async def _together(
        self, stub: StoreAsyncStub, conn: _Connection, steps: Sequence[Step]
    ) -> object:
        """Take `steps` at once, as tasks on this loop (each takes a connection of its own):
        each one's outcome or typed error, in order. The loop copies one stripe's bytes at a
        time, the daemon serves the stripes in parallel."""

        async def one(step: Step) -> object:
            try:
                return await self._take(stub, conn, step)
            except Exception as exc:
                return typed_error(exc)

        return tuple(await asyncio.gather(*(one(s) for s in steps)))

    async def _stream_get(self, conn: _Connection, step: StreamGet) -> None:
        tune_malloc()
        # Replies are decoded by hand, straight from the received bytes into the buffers.
        get = conn.channel.unary_stream(
            GET_METHOD,
            request_serializer=pb.GetRequest.SerializeToString,
            response_deserializer=raw_bytes,
        )
        call = get(step.request, timeout=step.timeout_s, metadata=self._metadata)
        try:
            async for raw in call:
                step.assembler.feed_message(raw)
        except BaseException:
            call.cancel()
            raise

    async def _stream_put(self, conn: _Connection, step: StreamPut) -> object:
        tune_malloc()
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
        return await asyncio.to_thread(
            put, step.messages, timeout=step.timeout_s, metadata=self._metadata
        )

    async def _bulk_get(self, conn: _Connection, step: BulkGet) -> object:
        ucx = await self._bulk(conn)
        if ucx is None:
            return BULK_FAILED
        try:
            outcome = await ucx.get_async(
                step.request,
                step.scope_digest,
                step.keys,
                step.into,
                verify=step.verify,
                timeout_s=step.timeout_s,
            )
        except TransportFailed as exc:
            await asyncio.to_thread(self._ucx.give_up, exc)
            return BULK_FAILED
        return outcome.headers, outcome.corrupt

    async def _bulk_lookup(self, conn: _Connection, step: BulkLookup) -> object:
        ucx = await self._bulk(conn)
        if ucx is None:
            return BULK_FAILED
        try:
            hits = await ucx.lookup_async(step.request, step.asked, timeout_s=step.timeout_s)
        except TransportFailed as exc:
            await asyncio.to_thread(self._ucx.give_up, exc)
            return BULK_FAILED
        return hits.tiers

    async def _bulk_put(self, conn: _Connection, step: BulkPut) -> object:
        ucx = await self._bulk(conn)
        if ucx is None:
            return BULK_FAILED
        try:
            return await ucx.put_async(
                step.begin, step.headers, step.payloads, timeout_s=step.timeout_s
            )
        except TransportFailed as exc:
            await asyncio.to_thread(self._ucx.give_up, exc)
            return BULK_FAILED

    # ---- plumbing --------------------------------------------------------------------------

    async def _route(self, conn: _Connection, data: bool) -> Route:
        """What `conn` offers a call (`data`: one that may take the bulk path, settled here on
        first ask)."""
        bulk = await self._bulk(conn) if data else None
        return self._route_of(conn, bulk, pipelined=True)

    async def _bulk(self, conn: _Connection) -> UcxTransport | None:
        """The UCX or TCP transport of the remote path of `conn`, or None (use gRPC); opened
        (a connect, in a worker thread) on first ask."""
        if conn.maps or self._ucx.off:
            return None
        if self._bulk_conn is conn:
            return self._bulk_for(conn)  # opened already: no I/O
        transport = await asyncio.to_thread(self._bulk_for, conn)
        self._bulk_conn = conn
        return transport

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
            node = await self._drive(admin.node_info(self._settings, connect=False), stub)
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

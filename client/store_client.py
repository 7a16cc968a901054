"""`StoreClient`: the blocking client of one store daemon (DESIGN §6).

A thin blocking shell over the client core (client/core/): the core builds every request, picks
the data path, splits batches, decides retries and assembles results; this file connects, takes
the core's I/O steps with blocking calls (`_drive`, `_take`) and keeps the connection's state
(the lane, the mapped segments, the bulk path, lease releases in flight).

It picks its data path when it connects: the same-host path (the daemon's shared-memory segment
mapped here; control messages over the daemon's same-host lane) when the daemon runs on this
host, else the UCX or TCP bulk data path where both ends can, else chunked gRPC streams. All
give the same results.

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
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

import grpc

from client.contract.errors import DeadlineExceeded, StrataError, Unavailable
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
from client.core.retry import Deadline
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
    with_token,
)
from client.transports.hostid import host_id
from client.transports.lane import Lane, LaneError, LaneStub
from client.transports.lane_protocol import SCHEME as LANE_SCHEME
from client.transports.shm import (
    SegmentMap,
    map_handed_segments,
    map_node_segments,
    read_acquired,
    segments_current,
    write_reserved,
)
from client.transports.stripe_workers import StripeWorkers
from client.transports.tls import open_channel
from client.transports.ucx_transport import TransportFailed
from kvstore_pb import store_pb2 as pb
from kvstore_pb.store_pb2_grpc import StoreStub

log = logging.getLogger(__name__)

R = TypeVar("R")
_LOCAL_PROBE_S = 2.0
_STRIPE_GRACE_S = 5.0  # how long past its deadline a stripe is waited for (it ends by then)
_STRIPED_CALLS_AT_ONCE = 4  # stripe threads for this many striped calls in flight together


class _Pending(Protocol):
    """A control call in flight (a lane call or a gRPC future)."""

    def result(self) -> object: ...
    def cancel(self) -> object: ...


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


class StoreClient(ClientShell):
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

    `tcp_stripes`, `tcp_stripe_min_bytes` (TCP data path only): a put or get batch whose
    payloads reach `tcp_stripe_min_bytes` goes as `tcp_stripes` contiguous parts at once, each
    on a connection of its own (client/core/stripes.py); the caller's thread sends one, a few
    daemon threads of this client the others. 1 = never. None: $STRATA_STORE_TCP_STRIPES and
    $STRATA_STORE_TCP_STRIPE_BYTES, else 2 from 8 MiB (docs/configuration.md).
    """

    def _init_io_state(self) -> None:
        self._lock = threading.Lock()
        self._conn: _Connection | None = None
        self._closed = False
        self._lane_refused = False  # said once in the log
        self._releases: list[grpc.Future[pb.ReleaseResponse]] = []
        self._counter_lock = threading.Lock()
        self._workers: StripeWorkers | None = None  # started by the first striped call

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
        return self._transport_of(conn, self._bulk_for(conn))

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
        with self._counter_lock:
            workers, self._workers = self._workers, None
        if workers is not None:
            workers.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- calls -----------------------------------------------------------------------------

    def node_info(self) -> NodeInfo:
        """Fresh identity, capacities and limits of the node. Read-only; retried."""
        return self._drive(admin.node_info(self._settings))

    def lookup(self, scope: Scope, keys: Sequence[bytes]) -> LookupResult:
        """Longest present prefix of the key chain `keys`, with the tier of each hit.

        Read-only; retried. InvalidArgument for a malformed key (before any RPC).
        """
        return self._drive(lookup_op.lookup(scope, keys, self._settings))

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
        return self._drive(plan)

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
        payload checksums off the same-host path only (the daemon verifies what it reads from
        SSD). InvalidArgument (before any RPC) unless `into` has one writable, C-contiguous
        buffer of at least a page per key and `tokens` one full page of ids per key. A miss
        leaves its buffer's contents unspecified.
        """
        plan = get_op.get(
            scope,
            keys,
            into,
            tokens=tokens,
            io_class=io_class,
            verify=verify,
            settings=self._settings,
        )
        return self._drive(plan)

    def delete(self, scope: Scope | None = None, keys: Sequence[bytes] | None = None) -> int:
        """Delete the pages `keys`, or every page of `scope` (exactly one of the two); returns
        how many were deleted. Mutates; retried (deleting twice deletes nothing more)."""
        return self._drive(admin.delete(scope, keys, self._settings))

    def stats(self) -> StoreStats:
        """Daemon-wide counters. Read-only; retried."""
        return self._drive(admin.stats(self._settings))

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

    # ---- the driver: the core's steps, taken with blocking calls ----------------------------

    def _drive(self, plan: Plan[R], stub: StoreStub | None = None) -> R:
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
                    conn = self._ready()
                    stub = conn.stub
                    outcome = self._route(conn, step.data)
                elif stub is None:
                    raise StrataError(f"{step!r} before Connect")
                else:
                    outcome = self._take(stub, conn, step)
            except BaseException as exc:
                step = run.advance(error=typed_error(exc))
            else:
                step = run.advance(outcome)
        return run.result

    def _take(self, stub: StoreStub, conn: _Connection | None, step: Step) -> object:
        if isinstance(step, Call):
            return getattr(stub, step.method)(step.request, timeout=step.timeout_s)
        if isinstance(step, Pause):
            time.sleep(step.seconds)
            return None
        if conn is None:
            raise StrataError(f"{type(step).__name__} needs a connection")
        match step:
            case CheckSegments(lease_id=lease_id):
                self._check_segments(conn, lease_id)
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
                self._count_corrupt(count)
                return None
            case Start():
                method = getattr(stub, step.method)
                if isinstance(stub, LaneStub):
                    return method.start(step.request, step.timeout_s)
                return method.future(step.request, timeout=step.timeout_s)
            case Join(handle=handle):
                return cast("_Pending", handle).result()
            case Cancel(handle=handle):
                cast("_Pending", handle).cancel()
                return None
            case StreamGet():
                self._stream_get(conn, step)
                return None
            case StreamPut():
                return self._stream_put(conn, step)
            case BulkGet():
                return self._bulk_get(conn, step)
            case BulkPut():
                return self._bulk_put(conn, step)
            case BulkLookup():
                return self._bulk_lookup(conn, step)
            case Together(steps=steps):
                return self._together(stub, conn, steps)
        raise AssertionError(f"unknown step {step!r}")

    def _together(self, stub: StoreStub, conn: _Connection, steps: Sequence[Step]) -> object:
        """Take `steps` at once (this thread one, the stripe workers the others); each one's
        outcome or typed error, in order."""

        def one(step: Step) -> Callable[[], object]:
            def take() -> object:
                try:
                    return self._take(stub, conn, step)
                except Exception as exc:
                    return typed_error(exc)

            return take

        wait_s = max(getattr(s, "timeout_s", 0.0) for s in steps) + _STRIPE_GRACE_S
        try:
            return tuple(self._stripe_workers().run_all([one(s) for s in steps], wait_s))
        except TimeoutError:
            raise DeadlineExceeded("a TCP stripe did not end within its deadline") from None

    def _stripe_workers(self) -> StripeWorkers:
        with self._counter_lock:
            if self._workers is None:
                size = (self._settings.striping.stripes - 1) * _STRIPED_CALLS_AT_ONCE
                workers = StripeWorkers("strata-tcp-stripe", size)
                if self._closed:  # a call that raced close(): its stripes run in this thread
                    workers.close()
                    return workers
                self._workers = workers
            return self._workers

    def _stream_get(self, conn: _Connection, step: StreamGet) -> None:
        tune_malloc()
        # Replies are decoded by hand, straight from the received bytes into the buffers.
        get = conn.channel.unary_stream(
            GET_METHOD,
            request_serializer=pb.GetRequest.SerializeToString,
            response_deserializer=raw_bytes,
        )
        call = get(step.request, timeout=step.timeout_s, metadata=self._metadata)
        try:
            for raw in call:
                step.assembler.feed_message(raw)
        except BaseException:
            call.cancel()
            raise

    def _stream_put(self, conn: _Connection, step: StreamPut) -> object:
        tune_malloc()
        # Messages are built by hand (one copy of each payload), so the call sends them as is.
        put = conn.channel.stream_unary(
            PUT_METHOD,
            request_serializer=raw_bytes,
            response_deserializer=pb.PutResponse.FromString,
        )
        return put(step.messages, timeout=step.timeout_s, metadata=self._metadata)

    def _bulk_get(self, conn: _Connection, step: BulkGet) -> object:
        ucx = self._bulk_for(conn)
        if ucx is None:
            return BULK_FAILED
        try:
            outcome = ucx.get(
                step.request,
                step.scope_digest,
                step.keys,
                step.into,
                verify=step.verify,
                timeout_s=step.timeout_s,
            )
        except TransportFailed as exc:
            self._ucx.give_up(exc)
            return BULK_FAILED
        return outcome.headers, outcome.corrupt

    def _bulk_lookup(self, conn: _Connection, step: BulkLookup) -> object:
        ucx = self._bulk_for(conn)
        if ucx is None:
            return BULK_FAILED
        try:
            return ucx.lookup(step.request, step.asked, timeout_s=step.timeout_s).tiers
        except TransportFailed as exc:
            self._ucx.give_up(exc)
            return BULK_FAILED

    def _bulk_put(self, conn: _Connection, step: BulkPut) -> object:
        ucx = self._bulk_for(conn)
        if ucx is None:
            return BULK_FAILED
        try:
            return ucx.put(step.begin, step.headers, step.payloads, timeout_s=step.timeout_s)
        except TransportFailed as exc:
            self._ucx.give_up(exc)
            return BULK_FAILED

    # ---- plumbing --------------------------------------------------------------------------

    def _route(self, conn: _Connection, data: bool) -> Route:
        """What `conn` offers a call (`data`: one that may take the bulk path, settled here on
        first ask)."""
        bulk = self._bulk_for(conn) if data else None
        return self._route_of(conn, bulk, pipelined=isinstance(conn.stub, LaneStub))

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
            node = self._drive(admin.node_info(self._settings, connect=False), stub)
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

"""The gRPC servicer: converts messages, calls the store, maps typed errors to status codes.

Nothing here decides anything about pages; it is the thin edge of the daemon (STYLE: thin edges).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

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
from client.contract.page import PageHeader
from client.contract.scope import KEY_BYTES, Scope, unpack_keys
from client.core.frames import varint
from client.transports._wire import (
    TAG_GET_CHUNK,
    TAG_PUT_CHUNK,
    ChunkView,
    chunk_message,
    decode_chunk_message,
    raw_bytes,
    tune_malloc,
)
from kvstore.auth import ALL, OPEN, Authenticator, Principal, bearer_token
from kvstore.chain import ChainRejected
from kvstore.fence import probe_holder
from kvstore.keys import IoClass, Tier, io_class_from_wire, tier_from_wire
from kvstore.store import Store
from kvstore.streams import StreamGate
from kvstore_pb import API_VERSION, store_pb2, store_pb2_grpc

log = logging.getLogger(__name__)

SERVER_VERSION = "0.1.0"
_CODES: list[tuple[type[StrataError], grpc.StatusCode]] = [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (CapacityExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (LeaseExpired, grpc.StatusCode.FAILED_PRECONDITION),
    (Corrupt, grpc.StatusCode.DATA_LOSS),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
]
# Lease ids handed out under auth, remembered with their principal; swept of ended leases when
# more than this many (and twice the live leases) are held.
_LEASE_OWNERS_SWEEP = 4096

Req = TypeVar("Req")
Resp = TypeVar("Resp")


# Where a same-host call may come from: the lane, the unix socket, loopback (grpc's peer strings)
_SAME_HOST_PEERS = ("lane", "unix:", "ipv4:127.", "ipv6:[::1]", "ipv6:[::ffff:127.")


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    node_id: str
    host_id: str
    local_address: str  # "lane:/path" (the same-host lane) or ""
    ucx_address: str = ""  # "ucx://host:port" (the UCX data path) or ""
    tcp_address: str = ""  # "tcp://host:port" (the TCP data path) or ""


def _abort(context: grpc.ServicerContext, exc: StrataError) -> None:
    code = next((c for cls, c in _CODES if isinstance(exc, cls)), grpc.StatusCode.INTERNAL)
    if isinstance(exc, CapacityExhausted):
        context.set_trailing_metadata(
            (
                ("retry-after-ms", str(int(exc.retry_after_s * 1000))),
                ("x-strata-retry-after", f"{exc.retry_after_s:.3f}"),  # seconds
            )
        )
    context.abort(code, str(exc))


def unary(
    fn: Callable[[StoreService, Req, grpc.ServicerContext], Resp],
) -> Callable[[StoreService, Req, grpc.ServicerContext], Resp]:
    """Map StrataError raised by a unary handler to its status code."""

    @functools.wraps(fn)
    def wrapper(self: StoreService, request: Req, context: grpc.ServicerContext) -> Resp:
        try:
            return fn(self, request, context)
        except StrataError as exc:
            _abort(context, exc)
            raise AssertionError("unreachable") from exc

    return wrapper


def streaming(
    fn: Callable[[StoreService, Req, grpc.ServicerContext], Iterator[Resp]],
) -> Callable[[StoreService, Req, grpc.ServicerContext], Iterator[Resp]]:
    """Map StrataError raised by a server-streaming handler to its status code."""

    @functools.wraps(fn)
    def wrapper(self: StoreService, request: Req, context: grpc.ServicerContext) -> Iterator[Resp]:
        try:
            yield from fn(self, request, context)
        except StrataError as exc:
            _abort(context, exc)

    return wrapper


def _pb_tier(tier: Tier | None) -> store_pb2.Tier.ValueType:
    return store_pb2.Tier.ValueType(int(tier) if tier is not None else 0)


def _digest(value: bytes) -> bytes:
    if len(value) != KEY_BYTES:
        raise InvalidArgument(f"scope digest must be {KEY_BYTES} bytes, got {len(value)}")
    return value


_M = TypeVar("_M")


def _pb_chunk(index: int, header: bytes, offset: int, data: memoryview) -> store_pb2.GetResponse:
    return store_pb2.GetResponse(
        chunk=store_pb2.PageChunk(index=index, header=header, offset=offset, data=data.tobytes())
    )


def _pb_missing(index: int) -> store_pb2.GetResponse:
    return store_pb2.GetResponse(missing=index)


def _raw_chunk(index: int, header: bytes, offset: int, data: memoryview) -> bytes:
    return chunk_message(TAG_GET_CHUNK, index, header, offset, data)


def _raw_missing(index: int) -> bytes:
    return store_pb2.GetResponse(missing=index).SerializeToString()


def _put_request(raw: bytes) -> store_pb2.PutRequest | ChunkView:
    """A PutRequest's chunk decoded in place (its data a view of `raw`), else the message."""
    chunk = decode_chunk_message(raw, TAG_PUT_CHUNK)
    return chunk if chunk is not None else store_pb2.PutRequest.FromString(raw)


class StoreService(store_pb2_grpc.StoreServicer):
    """gRPC face of one Store.

    Every handler first learns its caller's principal (`principal`): the one a transport bound
    to its connection (`context.principal`, the same-host lane), else the bearer token of the
    call's `authorization` metadata; OPEN on an open daemon. Reads and writes then check the
    namespace of the request's scope, deletes the namespaces of what they delete, lease calls
    the lease's holder, and Watch shows only the namespaces the caller may read. A refusal
    (Unauthenticated, PermissionDenied, a scope that does not match its digest) is counted and
    changes nothing.
    """

    def __init__(self, store: Store, node: NodeIdentity, auth: Authenticator | None = None) -> None:
        self.store = store
        self.node = node
        self.auth = auth if auth is not None else Authenticator(None)
        cfg = store.config
        self.streams = StreamGate(cfg.stream_slots, cfg.streams_per_client)
        self._lease_owners: dict[int, str] = {}
        self._owners_lock = threading.Lock()

    # ---- who calls, and may they ----------------------------------------------------------

    def principal(self, context: object) -> Principal:
        """The caller's principal. Unauthenticated (counted) without a valid token."""
        if self.auth.open:
            return OPEN
        bound = getattr(context, "principal", None)
        if isinstance(bound, Principal):
            return bound
        metadata = getattr(context, "invocation_metadata", None)
        token = bearer_token(metadata()) if callable(metadata) else None
        try:
            return self.auth.authenticate(token)
        except Unauthenticated:
            self.auth.denied(None, "unauthenticated")
            raise

    def _check_local(self, principal: Principal, context: grpc.ServicerContext) -> None:
        """Reserve and Acquire hand out slots of the shared-memory segment: PermissionDenied
        (counted) for a principal not trusted with the same-host path, or for a call that did
        not come over the lane, the daemon's unix socket or loopback (a `trusted_local` token used from
        another host would commit slots it never wrote and read their old bytes
        back). (On the lane the daemon has also checked the caller's user, kvstore/lane.py.)"""
        if not principal.trusted_local:
            self.auth.denied(principal, "local_untrusted")
            raise PermissionDenied(
                f"principal {principal.name!r} may not use the same-host path (trusted_local)"
            )
        peer = context.peer()
        if not peer.startswith(_SAME_HOST_PEERS):
            self.auth.denied(principal, "local_untrusted")
            raise PermissionDenied(
                "the same-host path (Reserve, Acquire) is served only on the lane, the unix "
                f"socket and loopback, not to {peer}"
            )

    def _allow(self, principal: Principal, check: Callable[[str], None], namespace: str) -> None:
        try:
            check(namespace)
        except PermissionDenied:
            self.auth.denied(principal, check.__name__.removeprefix("check_"))
            raise

    def _read_digest(self, principal: Principal, digest: bytes, scope: bytes) -> bytes:
        """The scope digest a read is for, after checking that `principal` may read it: with
        auth on, the request must carry its scope, whose digest must be the one sent (if any)."""
        if scope:
            derived, namespace = self._scope_namespace(principal, digest, scope)
            if not self.auth.open:
                self._allow(principal, principal.check_read, namespace)
            return derived
        if not self.auth.open:
            raise InvalidArgument("this daemon checks namespaces: the request must carry scope")
        return _digest(digest)

    def _scope_namespace(
        self, principal: Principal, digest: bytes, scope: bytes
    ) -> tuple[bytes, str]:
        derived, namespace = self.auth.scope_namespace(scope)
        if digest and digest != derived:
            self.auth.denied(principal, "scope_mismatch")
            raise InvalidArgument("scope_digest is not the digest of scope")
        return derived, namespace

    def _write_scope(self, principal: Principal, encoded: bytes) -> Scope:
        scope = self.store.scope_of(encoded)
        if not self.auth.open:
            self._allow(principal, principal.check_write, scope.namespace)
            self.auth.remember(scope.digest, scope.namespace)
        return scope

    def _namespace_of(self, digest: bytes) -> str | None:
        """The namespace of a scope digest: as the index names the scopes of stored pages (put
        since the start), else as the scopes of calls since the start have shown it."""
        named = self.store.index.namespace_of(digest)
        return named if named is not None else self.auth.namespace_of(digest)

    def _own(self, principal: Principal, lease_id: int) -> None:
        """Record the holder of a lease handed out under auth."""
        if self.auth.open or not lease_id:
            return
        with self._owners_lock:
            self._lease_owners[lease_id] = principal.name
            owners = self._lease_owners
            if len(owners) > _LEASE_OWNERS_SWEEP and len(owners) > 2 * len(self.store.leases):
                leases = self.store.leases
                self._lease_owners = {k: v for k, v in owners.items() if k in leases}

    def _check_holder(self, principal: Principal, lease_id: int) -> None:
        """PermissionDenied when another principal holds `lease_id`, or when it is a live lease
        no caller holds (one the daemon took for itself: a streamed put's, a data path's);
        operators may act on any."""
        if self.auth.open:
            return
        with self._owners_lock:
            holder = self._lease_owners.get(lease_id)
            foreign = lease_id in self.store.leases if holder is None else holder != principal.name
            if foreign and not principal.operator:
                self.auth.denied(principal, "lease")
                raise PermissionDenied(
                    f"principal {principal.name!r} does not hold lease {lease_id}"
                )

    def _forget_if_ended(self, lease_id: int) -> None:
        """After a Commit or Release: forget the holder of a lease that is over."""
        if not self.auth.open and lease_id not in self.store.leases:
            with self._owners_lock:
                self._lease_owners.pop(lease_id, None)

    def _keys(self, packed: bytes) -> list[bytes]:
        """Unpack a packed key field, refusing too many keys before splitting any."""
        limit = self.store.config.limits.max_keys_per_call
        if len(packed) > limit * KEY_BYTES:
            raise InvalidArgument(
                f"{len(packed) // KEY_BYTES} keys in one call; the limit is {limit}"
            )
        return unpack_keys(packed)

    @unary
    def NodeInfo(
        self, request: store_pb2.NodeInfoRequest, context: grpc.ServicerContext
    ) -> store_pb2.NodeInfoResponse:
        # the same-host path (segment, lane) is shown only to principals trusted with it
        local = self.principal(context).trusted_local
        cfg = self.store.config
        stats = self.store.stats()
        dram = self.store.tiers.dram
        gpu = self.store.tiers.gpu
        return store_pb2.NodeInfoResponse(
            node_id=self.node.node_id,
            host_id=self.node.host_id,
            api_version=API_VERSION,
            server_version=SERVER_VERSION,
            tiers=[
                store_pb2.TierInfo(
                    tier=_pb_tier(g.tier),
                    capacity_bytes=g.capacity_bytes,
                    used_bytes=g.used_bytes,
                    pages=g.pages,
                    device=gpu.device if g.tier is Tier.GPU and gpu else "",
                )
                for g in stats.tiers
            ],
            limits=store_pb2.Limits(
                max_keys_per_call=cfg.limits.max_keys_per_call,
                max_page_bytes=cfg.limits.max_page_bytes,
                max_message_bytes=cfg.limits.max_message_bytes,
                chunk_bytes=cfg.limits.chunk_bytes,
                lease_ttl_ms=cfg.limits.lease_ttl_ms,
            ),
            segments=[
                store_pb2.SharedSegment(
                    tier=store_pb2.TIER_DRAM,
                    name=dram.segment_name,
                    size_bytes=dram.size_bytes,
                    generations_offset=dram.generations_offset,
                    generation_granule_bytes=dram.generation_granule_bytes,
                )
            ]
            if local
            else [],
            local_address=self.node.local_address if local else "",
            ucx_address=self.node.ucx_address,
            tcp_address=self.node.tcp_address,
        )

    @unary
    def Lookup(
        self, request: store_pb2.LookupRequest, context: grpc.ServicerContext
    ) -> store_pb2.LookupResponse:
        principal = self.principal(context)
        digest = self._read_digest(principal, request.scope_digest, request.scope)
        # packed keys in, one byte a hit out (Store.lookup checks the field and the key limit)
        codes = self.store.lookup(digest, request.keys).codes
        # The codes are the proto's Tier values (kvstore/keys.py), each under 0x80: one byte of
        # a packed repeated field each. The reply is parsed from that wire form (in C), which
        # costs a tenth of setting 512 enum values one by one.
        n = varint(len(codes))
        return store_pb2.LookupResponse.FromString(b"\x08" + n + b"\x12" + n + codes)

    # ---- remote data path -------------------------------------------------------------------

    @unary
    def Put(
        self,
        request_iterator: Iterator[store_pb2.PutRequest | ChunkView],
        context: grpc.ServicerContext,
    ) -> store_pb2.PutResponse:
        """Messages are generated PutRequests, or, registered by `add_to_server`, ChunkViews
        for the chunks (decoded in place) and PutRequests for anything else."""
        principal = self.principal(context)
        client = context.peer()
        with self.streams.enter(client):
            return self._put(request_iterator, client, principal)

    def _put(
        self,
        request_iterator: Iterator[store_pb2.PutRequest | ChunkView],
        client: str,
        principal: Principal = OPEN,
    ) -> store_pb2.PutResponse:
        tune_malloc()
        first = next(request_iterator, None)
        if not isinstance(first, store_pb2.PutRequest) or first.WhichOneof("part") != "begin":
            raise InvalidArgument("a put stream must start with PutBegin")
        begin = first.begin
        scope = self._write_scope(principal, begin.scope)
        io_class = io_class_from_wire(begin.io_class)
        tier = tier_from_wire(begin.tier)
        limits = self.store.config.limits
        if begin.page_count > limits.max_keys_per_call:
            raise InvalidArgument(
                f"{begin.page_count} pages in one put; the limit is {limits.max_keys_per_call}"
            )
        self.store.refuse_oversized_put(scope, begin.page_count)
        writer = _PutWriter(self.store, scope.encode(), io_class, tier, client, begin.page_count)
        writer.chain_prefix = begin.chain_prefix
        try:
            for message in request_iterator:
                if isinstance(message, ChunkView):
                    writer.chunk(message)
                elif message.WhichOneof("part") == "chunk":
                    writer.chunk(message.chunk)
                else:
                    raise InvalidArgument("PutBegin may only be the first message")
            statuses = writer.finish(begin.page_count)
        except BaseException:
            writer.abort()
            raise
        return store_pb2.PutResponse(statuses=statuses)

    @streaming
    def Get(
        self, request: store_pb2.GetRequest, context: grpc.ServicerContext
    ) -> Iterator[store_pb2.GetResponse]:
        digest = self._read_digest(self.principal(context), request.scope_digest, request.scope)
        with self.streams.enter(context.peer(), io_class_from_wire(request.io_class)):
            yield from self._get_stream(request, digest, _pb_chunk, _pb_missing)

    @streaming
    def _get_messages(
        self, request: store_pb2.GetRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        """Get as serialized GetResponses (what `add_to_server` registers): each chunk's data is
        copied once, from the DRAM tier into the message."""
        digest = self._read_digest(self.principal(context), request.scope_digest, request.scope)
        with self.streams.enter(context.peer(), io_class_from_wire(request.io_class)):
            yield from self._get_stream(request, digest, _raw_chunk, _raw_missing)

    def _get_stream(
        self,
        request: store_pb2.GetRequest,
        digest: bytes,
        chunk: Callable[[int, bytes, int, memoryview], _M],
        missing: Callable[[int], _M],
    ) -> Iterator[_M]:
        tune_malloc()
        keys = self._keys(request.keys)
        io_class = io_class_from_wire(request.io_class)
        chunk_bytes = self.store.config.limits.chunk_bytes
        acq = self.store.acquire(digest, keys, io_class)
        try:
            dram = self.store.tiers.dram
            admit = self.store.scheduler.admit
            sent = 0
            for i, page in enumerate(acq.pages):
                if page is None:
                    yield missing(i)
                    continue
                view = dram.view(page.offset, page.length)
                for off in range(0, max(page.length, 1), chunk_bytes):
                    part = view[off : off + chunk_bytes]
                    with admit(io_class, part.nbytes):
                        message = chunk(i, page.header if off == 0 else b"", off, part)
                    if dram.generation(page.offset) != page.generation:
                        # the lease ran out while this stream waited on its reader and the slot
                        # went to another page: these bytes are not the page's own
                        with self.store.counters.lock:
                            self.store.counters.stale_fenced += 1
                        raise Unavailable(
                            f"page {i} left its slot while being sent (the reader was slower "
                            "than its lease); retry"
                        )
                    yield message
                sent += page.length
            self.store.counters.add_bytes("grpc", "out", io_class, sent)
        finally:
            if acq.lease_id:
                self.store.release(acq.lease_id)

    # ---- same-host data path ------------------------------------------------------------------

    @unary
    def Reserve(
        self, request: store_pb2.ReserveRequest, context: grpc.ServicerContext
    ) -> store_pb2.ReserveResponse:
        principal = self.principal(context)
        self._check_local(principal, context)
        scope = self._write_scope(principal, request.scope)
        if len(request.headers) > self.store.config.limits.max_keys_per_call:
            raise InvalidArgument(
                f"{len(request.headers)} pages in one reserve; the limit is "
                f"{self.store.config.limits.max_keys_per_call}"
            )
        peer_pid = getattr(context, "peer_pid", 0)  # the lane knows it for sure
        pid = peer_pid or request.client_pid
        res = self.store.reserve(
            scope,
            list(request.headers),
            request.lease_ms,
            io_class_from_wire(request.io_class),
            holder=probe_holder(pid, None if peer_pid else str(self.store.tiers.dram.path)),
            # the share of DRAM is per process where the kernel says which, else per
            # connection: a pid a client only claims would let it take share after share
            client=f"pid:{peer_pid}" if peer_pid else context.peer(),
            chain_prefix=request.chain_prefix,
            same_host=True,  # the writer copies into DRAM itself: it may leave the checksum to us
        )
        # the client copies these bytes itself: they pass the scheduler here, in their class
        # (a background put keeps to the background cap on the same-host path too)
        reserved = sum(s.length for s in res.slots if s.reserved)
        try:
            with self.store.scheduler.admit(io_class_from_wire(request.io_class), reserved):
                pass
            if not context.is_active():
                # The caller gave up while this waited (its deadline passed): it never learns
                # the lease, so it can neither copy nor make the late call that would free a
                # quarantined slot. Nothing was handed out yet: give the slots back now.
                raise DeadlineExceeded("the caller gave up before its reservation was granted")
        except BaseException:
            if res.lease_id:
                self.store.abort(res.lease_id)
            raise
        self._own(principal, res.lease_id)
        reply = store_pb2.ReserveResponse(
            lease_id=res.lease_id, lease_expires_unix_ms=res.expires_unix_ms
        )
        add = reply.slots.add  # (about twice as fast as building each Slot and copying it in)
        for s in res.slots:
            if s.reserved:
                add(reserved=True, offset=s.offset, length=s.length)
            elif s.pending:
                add(pending=True)
            else:
                add()
        return reply

    @unary
    def Commit(
        self, request: store_pb2.CommitRequest, context: grpc.ServicerContext
    ) -> store_pb2.CommitResponse:
        self._check_holder(self.principal(context), request.lease_id)
        try:
            return store_pb2.CommitResponse(stored=self.store.commit(request.lease_id))
        finally:
            self._forget_if_ended(request.lease_id)

    @unary
    def Acquire(
        self, request: store_pb2.AcquireRequest, context: grpc.ServicerContext
    ) -> store_pb2.AcquireResponse:
        principal = self.principal(context)
        self._check_local(principal, context)
        digest = self._read_digest(principal, request.scope_digest, request.scope)
        io_class = io_class_from_wire(request.io_class)
        acq = self.store.acquire(
            digest, self._keys(request.keys), io_class, request.lease_ms, same_host=True
        )
        self._own(principal, acq.lease_id)
        reply = store_pb2.AcquireResponse(
            lease_id=acq.lease_id, lease_expires_unix_ms=acq.expires_unix_ms
        )
        add = reply.pages.add
        served = 0
        for page in acq.pages:
            if page is None:
                add()
                continue
            served += page.length
            add(
                present=True,
                tier=_pb_tier(page.tier),
                offset=page.offset,
                length=page.length,
                header=page.header,
                generation=page.generation,
            )
        if served:  # the client's copy, in its class (a miss copies nothing: no wait)
            with self.store.scheduler.admit(io_class, served):
                pass
            self.store.counters.add_bytes("shm", "out", io_class, served)
        return reply

    @unary
    def Release(
        self, request: store_pb2.ReleaseRequest, context: grpc.ServicerContext
    ) -> store_pb2.ReleaseResponse:
        self._check_holder(self.principal(context), request.lease_id)
        try:
            return store_pb2.ReleaseResponse(released=self.store.release(request.lease_id))
        finally:
            self._forget_if_ended(request.lease_id)

    @unary
    def Renew(
        self, request: store_pb2.RenewRequest, context: grpc.ServicerContext
    ) -> store_pb2.RenewResponse:
        self._check_holder(self.principal(context), request.lease_id)
        return store_pb2.RenewResponse(
            lease_expires_unix_ms=self.store.renew(request.lease_id, request.lease_ms)
        )

    # ---- delete, stats, events -----------------------------------------------------------------

    @unary
    def Delete(
        self, request: store_pb2.DeleteRequest, context: grpc.ServicerContext
    ) -> store_pb2.DeleteResponse:
        principal = self.principal(context)
        which = request.WhichOneof("target")
        if which == "keys":
            keys = self._keys(request.keys)
            self._check_delete_keys(principal, keys)
            deleted = self.store.delete(keys=keys)
        elif which == "scope_digest":
            digest = _digest(request.scope_digest)
            if request.scope:
                digest, namespace = self._scope_namespace(principal, digest, request.scope)
                self._allow(principal, principal.check_delete, namespace)
            elif not self.auth.open:
                raise InvalidArgument(
                    "this daemon checks namespaces: a delete by scope needs scope"
                )
            deleted = self.store.delete(scope_digest=digest)
        else:
            raise InvalidArgument("delete needs keys or a scope digest")
        return store_pb2.DeleteResponse(deleted=deleted)

    def _check_delete_keys(self, principal: Principal, keys: list[bytes]) -> None:
        """PermissionDenied unless `principal` may delete every stored page of `keys` (checked
        before any is deleted). A page whose scope's namespace this daemon has not seen since it
        started (rebuilt from SSD, not put or read since) only an operator may delete by key."""
        if self.auth.open:
            return
        index = self.store.index
        digests = {entry.scope_digest for key in keys if (entry := index.get(key)) is not None}
        for digest in digests:
            namespace = self._namespace_of(digest)
            if namespace is None:
                if not principal.operator:
                    self.auth.denied(principal, "delete")
                    raise PermissionDenied(
                        f"principal {principal.name!r} may not delete by key a page of a scope "
                        "not seen since the daemon started: delete by scope"
                    )
                continue
            self._allow(principal, principal.check_delete, namespace)

    @unary
    def Stats(
        self, request: store_pb2.StatsRequest, context: grpc.ServicerContext
    ) -> store_pb2.StatsResponse:
        self.principal(context)
        stats = self.store.stats()
        c = self.store.counters
        with c.lock:
            tiers = [
                store_pb2.TierStats(
                    tier=_pb_tier(g.tier),
                    capacity_bytes=g.capacity_bytes,
                    used_bytes=g.used_bytes,
                    pages=g.pages,
                    hits=c.hits.get(g.tier, 0),
                    misses=c.misses.get(g.tier, 0),
                    evictions=c.evictions.get(g.tier, 0),
                )
                for g in stats.tiers
            ]
            return store_pb2.StatsResponse(
                tiers=tiers,
                pages=stats.pages,
                demotions=sum(c.demotions.values()),
                promotions=sum(c.promotions.values()),
                corrupt_dropped=c.corrupt_dropped,
                lease_expiries=c.lease_expiries,
                active_leases=stats.active_leases,
                lookups=c.lookups,
                lookup_hit_pages=c.lookup_hit_pages,
            )

    @streaming
    def Watch(
        self, request: store_pb2.WatchRequest, context: grpc.ServicerContext
    ) -> Iterator[store_pb2.Event]:
        principal = self.principal(context)
        scope = b""
        if request.scope_digest or request.scope:
            scope = self._read_digest(principal, request.scope_digest, request.scope)
        with self.streams.enter(context.peer(), IoClass.BACKGROUND):
            yield from self._watch(scope, principal, context)

    def _watch(
        self, scope: bytes, principal: Principal, context: grpc.ServicerContext
    ) -> Iterator[store_pb2.Event]:
        """Events of scope digest `scope` (every scope when empty; with auth on, of every
        namespace the principal may read, as far as the daemon knows each digest's namespace:
        events of a digest it has not seen in a put or read are shown to operators only)."""
        everything = self.auth.open or principal.operator or ALL in principal.read
        namespace_of = self._namespace_of
        events = self.store.events
        cursor = events.last_seq
        while context.is_active() and not events.closed:
            for ev in events.read(cursor, timeout_s=0.5):
                cursor = ev.seq
                if scope:
                    if ev.scope_digest != scope:
                        continue
                elif not everything:
                    namespace = namespace_of(ev.scope_digest)
                    if namespace is None or not principal.may_read(namespace):
                        continue
                yield store_pb2.Event(
                    seq=ev.seq,
                    kind=store_pb2.EventKind.ValueType(int(ev.kind)),
                    key=ev.key,
                    scope_digest=ev.scope_digest,
                    from_tier=_pb_tier(ev.from_tier),
                    to_tier=_pb_tier(ev.to_tier),
                    size_bytes=ev.size_bytes,
                )


class _PutWriter:
    """Receives one put stream page by page into DRAM reservations; verifies each page."""

    def __init__(
        self,
        store: Store,
        scope: bytes,
        io_class: IoClass,
        tier: Tier | None,
        client: str,
        page_count: int,
    ) -> None:
        self._store = store
        self._page_count = page_count  # PutBegin's: binding (the quota check trusted it)
        self._client = client
        self._scope = store.scope_of(scope)
        self._io_class = io_class
        self._tier = tier
        self._statuses: list[store_pb2.PutStatus.ValueType] = []
        self._index = -1
        self._lease = 0
        self._header: PageHeader | None = None
        self._view: memoryview | None = None
        self._received = 0
        self._pending = False
        # PutBegin.chain_prefix: vouches for ancestors (kvstore/chain.py)
        self.chain_prefix: Sequence[bytes] = ()

    def chunk(self, chunk: store_pb2.PageChunk | ChunkView) -> None:
        if chunk.index != self._index:
            self._end_page()
            if chunk.index != self._index + 1:
                raise InvalidArgument(f"page {chunk.index} arrived out of order")
            if chunk.index >= self._page_count:
                raise InvalidArgument(
                    f"page {chunk.index} is past the {self._page_count} pages PutBegin announced"
                )
            self._begin_page(chunk)
        elif chunk.header:
            raise InvalidArgument(f"page {chunk.index}: header repeated")
        header = self._header
        assert header is not None
        data = chunk.data
        if chunk.offset != self._received or chunk.offset + len(data) > header.payload_bytes:
            raise InvalidArgument(
                f"page {chunk.index}: chunk at {chunk.offset}+{len(data)} does not continue the "
                f"{self._received} of {header.payload_bytes} bytes received"
            )
        if self._view is not None and data:
            with self._store.scheduler.admit(self._io_class, len(data)):
                self._view[chunk.offset : chunk.offset + len(data)] = data
        self._received += len(data)

    def _begin_page(self, chunk: store_pb2.PageChunk | ChunkView) -> None:
        if not chunk.header:
            raise InvalidArgument(f"page {chunk.index}: the first chunk must carry the header")
        try:
            res = self._store.reserve(
                self._scope,
                [chunk.header],
                self._store.config.limits.max_reserve_lease_ms,
                self._io_class,
                client=self._client,
                chain_prefix=self.chain_prefix,
            )
        except ChainRejected as exc:  # reserved alone: name the page by its index in the stream
            raise ChainRejected(chunk.index, exc.key, exc.parent) from None
        self._index = chunk.index
        self._header = PageHeader.decode(chunk.header)
        self._received = 0
        slot = res.slots[0]
        self._pending = slot.pending
        if slot.reserved:
            self._lease = res.lease_id
            self._view = self._store.tiers.dram.view(slot.offset, slot.length)
        else:
            self._store.release(res.lease_id)
            self._lease = 0
            self._view = None

    def _end_page(self) -> None:
        if self._header is None:
            return
        header = self._header
        if self._received != header.payload_bytes:
            raise InvalidArgument(
                f"page {self._index}: got {self._received} of {header.payload_bytes} payload bytes"
            )
        if self._view is None:
            self._statuses.append(
                store_pb2.PUT_STATUS_PENDING
                if self._pending
                else store_pb2.PUT_STATUS_ALREADY_PRESENT
            )
        else:
            try:
                header.verify_payload(self._view)
            except Corrupt:
                with self._store.counters.lock:
                    self._store.counters.corrupt_dropped += 1
                raise
            lease, self._lease, self._view = self._lease, 0, None
            stored = self._store.commit(lease, self._tier, self._io_class, path="grpc")
            self._statuses.append(
                store_pb2.PUT_STATUS_STORED if stored else store_pb2.PUT_STATUS_ALREADY_PRESENT
            )
        self._header = None

    def finish(self, page_count: int) -> list[store_pb2.PutStatus.ValueType]:
        self._end_page()
        if len(self._statuses) != page_count:
            raise InvalidArgument(
                f"put announced {page_count} pages but sent {len(self._statuses)}"
            )
        return self._statuses

    def abort(self) -> None:
        self._view = None
        if self._lease:
            self._store.abort(self._lease)
            self._lease = 0


@dataclass(frozen=True, slots=True)
class _Malformed:
    """A request message protobuf could not parse. Its handler answers INVALID_ARGUMENT: gRPC's
    own answer to a deserializer that raises is INTERNAL, as if the daemon had failed."""

    error: str


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """`parse`, returning a _Malformed instead of raising for bytes that do not parse."""

    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except DecodeError as exc:
            return _Malformed(str(exc) or "not a valid message")

    return deserialize


def _malformed(error: str) -> InvalidArgument:
    return InvalidArgument(f"malformed request message: {error}")


def _checked(messages: Iterator[Any]) -> Iterator[Any]:
    for message in messages:
        if isinstance(message, _Malformed):
            raise _malformed(message.error)  # mapped by the handler's `unary` wrapper
        yield message


def _refusing_malformed(handler: Callable[..., Any], client_streaming: bool) -> Callable[..., Any]:
    """`handler`, answering INVALID_ARGUMENT to a request (or streamed message) that did not
    parse."""
    if client_streaming:
        return lambda messages, context: handler(_checked(messages), context)

    def serve(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(_malformed(request.error)))
        return handler(request, context)

    return serve


_HANDLER_KINDS: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler[Any, Any]]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_to_server(service: StoreService, server: grpc.Server) -> None:
    """Register `service` on `server` like `store_pb2_grpc.add_StoreServicer_to_server`, except
    that the bulk messages of Put and Get bypass the generated classes: PutRequest chunks are
    decoded in place and GetResponses are encoded by hand (client/transports/_wire.py), each payload copied
    once. The bytes on the wire are the same protobuf."""
    descriptor = store_pb2.DESCRIPTOR.services_by_name["Store"]
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in descriptor.methods:
        request = getattr(store_pb2, method.input_type.name)
        response = getattr(store_pb2, method.output_type.name)
        kind = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(
            _refusing_malformed(getattr(service, method.name), method.client_streaming),
            request_deserializer=_lenient(request.FromString),
            response_serializer=response.SerializeToString,
        )
    handlers["Put"] = grpc.stream_unary_rpc_method_handler(
        _refusing_malformed(service.Put, True),
        request_deserializer=_lenient(_put_request),
        response_serializer=store_pb2.PutResponse.SerializeToString,
    )
    handlers["Get"] = grpc.unary_stream_rpc_method_handler(
        _refusing_malformed(service._get_messages, False),
        request_deserializer=_lenient(store_pb2.GetRequest.FromString),
        response_serializer=raw_bytes,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(descriptor.full_name, handlers),)
    )
    server.add_registered_method_handlers(descriptor.full_name, handlers)

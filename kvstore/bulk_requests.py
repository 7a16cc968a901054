"""What both bulk servers (kvstore/tcp_server.py, kvstore/ucx_server.py) check of a request before
it touches the store, as the gRPC calls check it (kvstore/service.py): the scope digest a get or
lookup may read, a get's request decoded and its reader checked, and a put's PutBegin decoded
and its writer checked. Pure over the store's
scope cache and the authenticator: no I/O here. Each raises the typed error the server answers
with an ERROR frame (the connection stays in step)."""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from client.contract.errors import InvalidArgument, PermissionDenied
from client.contract.scope import KEY_BYTES, Scope, unpack_keys
from client.transports.ucx_protocol import decode_put
from kvstore.auth import Authenticator, Principal
from kvstore.keys import IoClass, Tier, io_class_from_wire, tier_from_wire
from kvstore.store import Store
from kvstore_pb import store_pb2


@dataclass(frozen=True, slots=True)
class BulkGet:
    """A get's request, decoded and allowed: what `Store.acquire` takes."""

    digest: bytes
    keys: list[bytes]
    io: IoClass


@dataclass(frozen=True, slots=True)
class BulkPut:
    """A put's request, decoded and allowed: what `Store.reserve` and `Store.commit` take."""

    scope: Scope
    headers: tuple[bytes, ...]
    io: IoClass
    tier: Tier | None  # None: the node's default
    chain_prefix: tuple[bytes, ...]


def read_digest(
    auth: Authenticator, principal: Principal, scope: bytes, scope_digest: bytes
) -> bytes:
    """The scope digest a get or lookup of `principal` reads: that of the canonical encoding
    `scope` (which `scope_digest`, when sent, must match), after the principal's read check; an
    open daemon also takes a bare 16-byte digest. InvalidArgument, PermissionDenied."""
    if not scope:
        if not auth.open:
            raise InvalidArgument("this daemon checks namespaces: the request must carry scope")
        if len(scope_digest) != KEY_BYTES:
            raise InvalidArgument(f"scope digest must be {KEY_BYTES} bytes")
        return scope_digest
    digest, namespace = auth.scope_namespace(scope)
    if scope_digest and scope_digest != digest:
        auth.denied(principal, "scope_mismatch")
        raise InvalidArgument("scope_digest is not the digest of scope")
    if not auth.open:
        try:
            principal.check_read(namespace)
        except PermissionDenied:
            auth.denied(principal, "read")
            raise
    return digest


def decode_bulk_get(
    store: Store, auth: Authenticator, principal: Principal, meta: bytes | bytearray
) -> BulkGet:
    """The get of the serialized GetRequest `meta`, once `principal` may read its scope.
    InvalidArgument for a malformed request, more keys than the limit (refused before the
    field is split) or a field that is not whole keys; PermissionDenied."""
    try:
        request = store_pb2.GetRequest.FromString(bytes(meta))
    except DecodeError:
        raise InvalidArgument("malformed GetRequest") from None
    limit = store.config.limits.max_keys_per_call
    if len(request.keys) > limit * KEY_BYTES:
        raise InvalidArgument(
            f"{len(request.keys) // KEY_BYTES} keys in one get; the limit is {limit}"
        )
    keys = unpack_keys(request.keys)
    digest = read_digest(auth, principal, request.scope, request.scope_digest)
    return BulkGet(digest, keys, io_class_from_wire(request.io_class))


def decode_bulk_put(
    store: Store,
    auth: Authenticator,
    principal: Principal,
    head: bytes | bytearray | memoryview,
    page_count: int,
) -> BulkPut:
    """The put whose `encode_put` part (PutBegin and page headers) is `head`, announced as
    `page_count` pages, once `principal` may write its scope's namespace (the digest is then
    remembered as that namespace's). InvalidArgument for a malformed part, a PutBegin that
    announces another page count or a scope that does not decode; PermissionDenied."""
    raw_begin, headers = decode_put(head, page_count)
    try:
        begin = store_pb2.PutBegin.FromString(raw_begin)
    except DecodeError:
        raise InvalidArgument("malformed PutBegin") from None
    if begin.page_count != page_count:
        raise InvalidArgument(f"PutBegin announces {begin.page_count} pages, sent {page_count}")
    scope = store.scope_of(begin.scope)
    if not auth.open:
        try:
            principal.check_write(scope.namespace)
        except PermissionDenied:
            auth.denied(principal, "write")
            raise
        auth.remember(scope.digest, scope.namespace)
    return BulkPut(
        scope,
        tuple(headers),
        io_class_from_wire(begin.io_class),
        tier_from_wire(begin.tier),
        tuple(begin.chain_prefix),
    )

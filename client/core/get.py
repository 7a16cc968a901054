"""The plan of a get: pages copied into the caller's buffers over the path the route offers,
batched by the node's limit, each checked against the key, scope and token ids asked for.

Pure: yields steps (client/core/steps.py). Same host: Acquire, then the copy out of the leased
slots, then the lease released in the background (the get pays one round trip). Bulk (UCX or
TCP): one transfer straight into the buffers; should the path itself fail, this batch and the
rest go over gRPC. gRPC: one Get stream per batch, reassembled and verified as it arrives.
A page dropped by verification is a miss, counted in `Fetched.corrupt`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from client.contract.page import PageHeader
from client.contract.scope import KEY_BYTES, Scope
from client.contract.types import (
    GetResult,
    IoClass,
    WritableBuffer,
    checked_tokens,
    match_tokens,
)
from client.core.assembler import GetAssembler
from client.core.requests import (
    batch_ranges,
    destination_views,
    io_class_value,
    packed_keys,
    scope_bytes,
)
from client.core.retry import call, retried
from client.core.route import Route, Settings, get_path
from client.core.steps import (
    BULK_FAILED,
    BulkGet,
    CheckSegments,
    CopyOut,
    Plan,
    Release,
    StreamGet,
)
from kvstore_pb import store_pb2 as pb

Headers = tuple[PageHeader | bytes | None, ...]


@dataclass(frozen=True, slots=True)
class GetArgs:
    """A get's arguments, checked before any I/O."""

    keys: Sequence[bytes]
    packed: bytes
    into: list[memoryview]
    expected: list[bytes] | None


@dataclass(frozen=True, slots=True)
class Fetched:
    """A get's result and how many pages verification dropped (each also a miss)."""

    result: GetResult
    corrupt: int


def checked_get(
    scope: Scope,
    keys: Sequence[bytes],
    into: Sequence[WritableBuffer],
    tokens: Sequence[Sequence[int]] | None,
) -> GetArgs:
    """InvalidArgument unless every key is well formed, `into` has one writable, C-contiguous
    buffer of at least a page per key and `tokens` one full page of ids per key (or is None)."""
    packed = packed_keys(keys)
    views = destination_views(scope, keys, into)
    return GetArgs(keys, packed, views, checked_tokens(scope, keys, tokens))


def get(
    scope: Scope, args: GetArgs, route: Route, settings: Settings, *, io: IoClass, verify: bool
) -> Plan[Fetched]:
    path = get_path(route)
    headers: list[PageHeader | bytes | None] = []
    corrupt = 0
    for r in batch_ranges(len(args.keys), route.limits.max_keys_per_call):
        keys = args.keys[r.start : r.stop]
        packed = args.packed[r.start * KEY_BYTES : r.stop * KEY_BYTES]
        into = args.into[r.start : r.stop]
        part: tuple[Headers, int] | None = None
        if path == "shm":
            part = yield from _get_shm(scope, keys, packed, into, io, verify, settings)
        elif path == "bulk":
            part = yield from _get_bulk(scope, keys, packed, into, io, verify, settings)
            if part is None:
                path = "grpc"
        if part is None:
            part = yield from _get_grpc(scope, keys, packed, into, io, verify, settings)
        headers.extend(part[0])
        corrupt += part[1]
    matched, rejected = match_tokens(scope, headers, args.expected)
    return Fetched(GetResult(matched, rejected), corrupt)


def _request(scope: Scope, packed: bytes, io: IoClass) -> pb.GetRequest:
    return pb.GetRequest(
        scope_digest=scope.digest,
        keys=packed,
        io_class=io_class_value(io),
        scope=scope_bytes(scope),
    )


def _get_shm(
    scope: Scope,
    keys: Sequence[bytes],
    packed: bytes,
    into: Sequence[memoryview],
    io: IoClass,
    verify: bool,
    settings: Settings,
) -> Plan[tuple[Headers, int]]:
    request = pb.AcquireRequest(
        scope_digest=scope.digest,
        keys=packed,
        io_class=io_class_value(io),
        scope=scope_bytes(scope),
    )
    reply = yield from call(
        "Acquire", request, pb.AcquireResponse, settings.policy, settings.timeout_s
    )
    yield CheckSegments(reply.lease_id)
    try:
        copied = cast(tuple[Headers, int], (yield CopyOut(reply, scope, keys, into, verify)))
    finally:
        if reply.lease_id:
            yield Release(reply.lease_id)
    return copied


def _get_bulk(
    scope: Scope,
    keys: Sequence[bytes],
    packed: bytes,
    into: Sequence[memoryview],
    io: IoClass,
    verify: bool,
    settings: Settings,
) -> Plan[tuple[Headers, int] | None]:
    request = _request(scope, packed, io).SerializeToString()
    got = yield BulkGet(request, scope.digest, keys, into, verify, settings.timeout_s)
    if got is BULK_FAILED:
        return None
    return cast(tuple[Headers, int], got)


def _get_grpc(
    scope: Scope,
    keys: Sequence[bytes],
    packed: bytes,
    into: Sequence[memoryview],
    io: IoClass,
    verify: bool,
    settings: Settings,
) -> Plan[tuple[Headers, int]]:
    request = _request(scope, packed, io)

    def attempt(left_s: float) -> Plan[GetAssembler]:
        assembler = GetAssembler(scope, keys, into, verify=verify)
        yield StreamGet(request, assembler, left_s)
        return assembler

    assembler = yield from retried("Get", settings.policy, settings.timeout_s, attempt)
    return assembler.finish(), assembler.corrupt

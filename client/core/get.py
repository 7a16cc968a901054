"""The plan of a get: pages copied into the caller's buffers over the path the route offers,
batched by the node's limit, each checked against the key, scope and token ids asked for.

Pure: yields steps (client/core/steps.py). Same host: Acquire, then the copy out of the leased
slots, then the lease released in the background (the get pays one round trip); a get of at
least `PIPELINE_MIN_PAGES` and `PIPELINE_MIN_BYTES` (`pipelines`) sends the Acquires of its
parts at once, a small one first, and copies each part while the daemon leases the next (still
one round trip waited for). Bulk (UCX or TCP): one transfer straight into the buffers; should
the path itself fail, this batch and the rest go over gRPC. A large batch on the TCP path goes as stripes (client/core/stripes.py): one
Get of each contiguous part, all at once on connections of their own (`Together`); a stripe
whose transfer failed is fetched over gRPC, the others are kept. gRPC: one Get stream per
batch, reassembled and verified as it arrives.
A page dropped by verification is a miss, reported in one `Dropped` step.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import cast

from client.contract.errors import StrataError
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
    malformed,
    packed_keys,
    pipeline_bounds,
    pipelines,
    scope_bytes,
)
from client.core.retry import Deadline, call, retried
from client.core.route import Route, Settings, get_path, verifies
from client.core.steps import (
    BULK_FAILED,
    BulkGet,
    CheckSegments,
    Connect,
    CopyOut,
    Dropped,
    Join,
    Pause,
    Plan,
    Release,
    Start,
    StreamGet,
    Together,
)
from client.core.stripes import first_failure, stripe_ranges
from kvstore_pb import store_pb2 as pb

Headers = tuple[PageHeader | bytes | None, ...]


def get(
    scope: Scope,
    keys: Sequence[bytes],
    into: Sequence[WritableBuffer],
    *,
    tokens: Sequence[Sequence[int]] | None,
    io_class: IoClass | None,
    verify: bool | None,
    settings: Settings,
) -> Plan[GetResult]:
    """InvalidArgument (before any I/O) unless every key is well formed, `into` has one
    writable, C-contiguous buffer of at least a page per key and `tokens` one full page of ids
    per key (or is None, the caller's explicit opt-out of the token check)."""
    packed_all = packed_keys(keys)
    views = destination_views(scope, keys, into)
    expected = checked_tokens(scope, keys, tokens)
    if not keys:
        return GetResult(headers=())
    route = cast(Route, (yield Connect(data=True)))
    io = settings.io(io_class)
    check = verifies(route, verify)
    path = get_path(route)
    page_bytes = scope.page_payload_bytes
    headers: list[PageHeader | bytes | None] = []
    corrupt = 0
    for r in batch_ranges(len(keys), route.limits.max_keys_per_call):
        part_keys = keys[r.start : r.stop]
        packed = packed_all[r.start * KEY_BYTES : r.stop * KEY_BYTES]
        part_views = views[r.start : r.stop]
        batch = (scope, part_keys, packed, part_views, io, check, settings)
        part: tuple[Headers, int] | None = None
        if path == "shm":
            if route.pipelined and pipelines(len(part_keys), page_bytes):
                part = yield from _get_shm_pipelined(*batch)
            else:
                part = yield from _get_shm(*batch)
        elif path == "bulk":
            stripes = (
                stripe_ranges([page_bytes] * len(r), settings.striping)
                if route.bulk_stripes
                else None
            )
            if stripes is not None:
                part, failed = yield from _get_striped(*batch, stripes, r.start)
                if failed:
                    path = "grpc"
            else:
                part = yield from _get_bulk(*batch)
                if part is None:
                    path = "grpc"
        if part is None:
            part = yield from _get_grpc(*batch)
        headers.extend(part[0])
        corrupt += part[1]
    if corrupt:
        yield Dropped(corrupt)
    matched, rejected = match_tokens(scope, headers, expected)
    return GetResult(matched, rejected)


def _request(scope: Scope, packed: bytes, io: IoClass) -> pb.GetRequest:
    return pb.GetRequest(
        scope_digest=scope.digest,
        keys=packed,
        io_class=io_class_value(io),
        scope=scope_bytes(scope),
    )


def _acquire_request(scope: Scope, packed: bytes, io: IoClass) -> pb.AcquireRequest:
    return pb.AcquireRequest(
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
    request = _acquire_request(scope, packed, io)
    reply = yield from call(
        "Acquire", request, pb.AcquireResponse, settings.policy, settings.timeout_s
    )
    missed = _all_missed(reply, len(keys))
    if missed is not None:  # nothing leased, nothing to copy: no segment check, no release
        return missed
    yield CheckSegments(reply.lease_id)
    try:
        copied = cast(tuple[Headers, int], (yield CopyOut(reply, scope, keys, into, verify)))
    finally:
        if reply.lease_id:
            yield Release(reply.lease_id)
    return copied


def _get_shm_pipelined(
    scope: Scope,
    keys: Sequence[bytes],
    packed: bytes,
    into: Sequence[memoryview],
    io: IoClass,
    verify: bool,
    settings: Settings,
) -> Plan[tuple[Headers, int]]:
    """`_get_shm` as parts in flight at once: every part's Acquire is sent before the first
    reply is read, the first part small (`pipeline_bounds`), so each part is copied while the
    daemon leases the next; each lease is released once its part is copied. Should an Acquire
    fail (or not go out), every lease granted is released; a retryable failure sends the batch
    again as one `_get_shm`, as the retry policy would retry an Acquire (a get is idempotent):
    after its pause, within what is left of the call's deadline, never after the deadline ran
    out, as one of its retries. Any other is raised. Whatever else ends it early (a copy or
    segment check failing, a reply that does not parse, KeyboardInterrupt, a cancel) is raised
    once the replies still due are read and their leases released."""
    deadline = Deadline(settings.timeout_s)  # the call's, shared by a retry of the batch
    bounds = pipeline_bounds(len(keys), small_last=False)
    parts = list(itertools.pairwise(bounds))
    handles: list[object] = []
    failed: StrataError | None = None
    joined = 0  # handles[:joined] are read (or given up); the rest may hold leases still
    headers: list[PageHeader | bytes | None] = []
    corrupt = 0
    checked = False
    try:
        for a, b in parts:
            request = _acquire_request(scope, packed[a * KEY_BYTES : b * KEY_BYTES], io)
            try:
                handles.append((yield Start("Acquire", request, settings.timeout_s)))
            except StrataError as exc:  # not sent: the parts sent are read, their leases go back
                failed = exc
                break
        for k, handle in enumerate(handles):
            a, b = parts[k]
            joined = k + 1
            try:
                reply = yield Join(handle)
                if not isinstance(reply, pb.AcquireResponse):
                    raise malformed(f"Acquire answered {type(reply).__name__}")
            except StrataError as exc:  # the others are still read, so their leases go back
                failed = failed or exc
                continue
            if failed is not None:
                if reply.lease_id:
                    yield Release(reply.lease_id)
                continue
            missed = _all_missed(reply, b - a)
            if missed is not None:  # nothing leased here, nothing to copy
                headers.extend(missed[0])
                continue
            if not checked:  # once a call: every Acquire was sent before this check
                yield CheckSegments(reply.lease_id)  # on failure the shell releases this lease
                checked = True
            try:
                got, dropped = cast(
                    tuple[Headers, int], (yield CopyOut(reply, scope, keys[a:b], into[a:b], verify))
                )
            finally:
                if reply.lease_id:
                    yield Release(reply.lease_id)
            headers.extend(got)
            corrupt += dropped
    except BaseException:  # whatever it is (an interrupt, a cancel, a reply that did not parse)
        for handle in handles[joined:]:  # read the leases still coming, and release them
            try:
                pending = yield Join(handle)
            except Exception:  # its lease runs out on its own
                continue
            if isinstance(pending, pb.AcquireResponse) and pending.lease_id:
                yield Release(pending.lease_id)
        raise
    if failed is not None:
        # a retry of this attempt, as `call` would make one: within the call's one deadline,
        # after the policy's pause, never after a deadline ran out, with one retry fewer left
        policy = settings.policy
        delay = policy.delay_s(0, failed, deadline) if policy.retries else None
        if delay is None:
            raise failed
        yield Pause(delay)
        rest = replace(
            settings,
            timeout_s=max(deadline.remaining_s(), 0.001),
            policy=replace(policy, retries=policy.retries - 1),
        )
        return (yield from _get_shm(scope, keys, packed, into, io, verify, rest))
    return tuple(headers), corrupt


def _all_missed(reply: pb.AcquireResponse, count: int) -> tuple[Headers, int] | None:
    """Every one of `count` pages a miss (no lease, none present), or None: the reply has
    pages to copy, or is malformed (then `CopyOut` says how)."""
    if reply.lease_id or len(reply.pages) != count:
        return None
    if any(p.present for p in reply.pages):
        return None
    return (None,) * count, 0


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


def _get_striped(
    scope: Scope,
    keys: Sequence[bytes],
    packed: bytes,
    into: Sequence[memoryview],
    io: IoClass,
    verify: bool,
    settings: Settings,
    stripes: Sequence[range],
    offset: int,
) -> Plan[tuple[tuple[Headers, int], bool]]:
    """One batch as `stripes` (ranges of it) fetched at once; the merged part, and whether the
    bulk path failed under a stripe (that stripe then came over gRPC). The first typed error
    of a stripe is raised once all have ended. `offset`: the batch's first page in the call."""
    steps = tuple(
        BulkGet(
            _request(
                scope, packed[r.start * KEY_BYTES : r.stop * KEY_BYTES], io
            ).SerializeToString(),
            scope.digest,
            keys[r.start : r.stop],
            into[r.start : r.stop],
            verify,
            settings.timeout_s,
        )
        for r in stripes
    )
    outcomes = cast(tuple[object, ...], (yield Together(steps)))
    error = first_failure(outcomes, [range(offset + r.start, offset + r.stop) for r in stripes])
    if error is not None:
        raise error
    headers: list[PageHeader | bytes | None] = []
    corrupt, failed = 0, False
    for r, got in zip(stripes, outcomes, strict=True):
        if got is BULK_FAILED:
            failed = True
            span = slice(r.start, r.stop)
            got = yield from _get_grpc(
                scope,
                keys[span],
                packed[r.start * KEY_BYTES : r.stop * KEY_BYTES],
                into[span],
                io,
                verify,
                settings,
            )
        part = cast(tuple[Headers, int], got)
        headers.extend(part[0])
        corrupt += part[1]
    return (tuple(headers), corrupt), failed


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

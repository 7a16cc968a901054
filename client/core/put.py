"""The plan of a put: pages published over the path the route offers, batched by the node's
limit; one status per page.

Pure: yields steps (client/core/steps.py). Same host: Reserve, the copy into the reserved
slots, Commit; a reservation not committed is released. A put of at least `PIPELINE_MIN_PAGES`
and `PIPELINE_MIN_BYTES` (`pipelines`) goes, where the shell can keep two calls in flight, as
parts overlapped (the daemon reserves, then commits, one part while another is copied;
`pipeline_bounds`). Bulk (UCX or TCP): one transfer; should the path itself fail, this batch
and the rest go over gRPC. A large batch on the TCP path goes as stripes (client/core/stripes.py): one put of each contiguous part, all at once on
connections of their own (`Together`), each carrying the chain prefix that vouches for its
first page's parents should it reach the daemon before the stripes ahead of it; a stripe whose
transfer failed is sent over gRPC, the others' pages are stored. gRPC: one Put stream per
batch. A put is never retried (it is not idempotent).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import cast, overload

from client.contract.scope import Scope
from client.contract.types import (
    IoClass,
    Page,
    PutResult,
    PutStatus,
    Tier,
    tokens_le,
)
from client.core.frames import chunk_bytes_for, put_messages
from client.core.replies import put_statuses_from_proto
from client.core.requests import (
    batch_ranges,
    io_class_value,
    malformed,
    payload_views,
    pipeline_bounds,
    pipelines,
    tier_value,
)
from client.core.retry import call, retried
from client.core.route import Route, Settings, put_path
from client.core.steps import (
    BULK_FAILED,
    BulkPut,
    Cancel,
    CheckSegments,
    Connect,
    CopyIn,
    Join,
    Plan,
    Release,
    Start,
    StreamPut,
    Together,
)
from client.core.stripes import first_failure, stripe_chain_prefixes, stripe_ranges
from kvstore_pb import store_pb2 as pb

Statuses = tuple[PutStatus, ...]


def put(
    scope: Scope,
    pages: Sequence[Page],
    *,
    io_class: IoClass | None,
    tier: Tier | None,
    chain_prefixes: Sequence[Sequence[int]],
    prefix_tokens: Sequence[int],
    settings: Settings,
    client_pid: int,
) -> Plan[PutResult]:
    """InvalidArgument (before any I/O) for a page of another scope or layout, a payload of the
    wrong size, or a token id that is not a uint32. `client_pid`: this process's id, which the
    daemon records with a same-host reservation."""
    all_views = payload_views(scope, pages)
    prefix = [tokens_le(p) for p in (*chain_prefixes, prefix_tokens) if p]
    if not pages:
        return PutResult(statuses=())
    route = cast(Route, (yield Connect(data=True)))
    io = settings.io(io_class)
    path = put_path(route, tier)
    statuses: list[PutStatus] = []
    for r in batch_ranges(len(pages), route.limits.max_keys_per_call):
        part_pages = pages[r.start : r.stop]
        views = all_views[r.start : r.stop]
        part: Statuses | None = None
        if path == "shm":
            shm = (scope, part_pages, views, io, prefix, client_pid, settings)
            if route.pipelined and pipelines(len(part_pages), scope.page_payload_bytes):
                part = yield from _put_shm_pipelined(*shm)
            else:
                part = yield from _put_shm(*shm)
        elif path == "bulk":
            striped = _stripes(scope, pages, r, route, settings, prefix_tokens)
            if striped is not None:
                stripes, extra = striped
                part, failed = yield from _put_striped(
                    scope,
                    pages,
                    all_views,
                    r,
                    stripes,
                    io,
                    tier,
                    [prefix + mine for mine in extra],
                    route,
                    settings,
                )
                if failed:
                    path = "grpc"
            else:
                part = yield from _put_bulk(scope, part_pages, views, io, tier, prefix, settings)
                if part is None:
                    path = "grpc"
        if part is None:
            part = yield from _put_grpc(scope, part_pages, views, io, tier, prefix, route, settings)
        statuses.extend(part)
    return PutResult(statuses=tuple(statuses))


def _reserve_request(
    scope: Scope, pages: Sequence[Page], io: IoClass, chain_prefix: list[bytes], client_pid: int
) -> pb.ReserveRequest:
    return pb.ReserveRequest(
        scope=scope.encode(),
        # a page whose payload checksum is still pending leaves it to the daemon (page.py)
        headers=[p.header.encode_for_same_host() for p in pages],
        io_class=io_class_value(io),
        client_pid=client_pid,
        chain_prefix=chain_prefix,
    )


def _put_shm(
    scope: Scope,
    pages: Sequence[Page],
    views: Sequence[memoryview],
    io: IoClass,
    chain_prefix: list[bytes],
    client_pid: int,
    settings: Settings,
) -> Plan[Statuses]:
    request = _reserve_request(scope, pages, io, chain_prefix, client_pid)
    reply = yield from call(
        "Reserve", request, pb.ReserveResponse, settings.policy, settings.timeout_s
    )
    yield CheckSegments(reply.lease_id)
    try:
        statuses = cast(Statuses, (yield CopyIn(reply, views)))
        if reply.lease_id:
            commit = pb.CommitRequest(lease_id=reply.lease_id)
            yield from call(
                "Commit", commit, pb.CommitResponse, settings.policy, settings.timeout_s
            )
    except BaseException:
        if reply.lease_id:
            yield Release(reply.lease_id)
        raise
    return statuses


def _put_shm_pipelined(
    scope: Scope,
    pages: Sequence[Page],
    views: Sequence[memoryview],
    io: IoClass,
    chain_prefix: list[bytes],
    client_pid: int,
    settings: Settings,
) -> Plan[Statuses]:
    """`_put_shm` as parts in flight (`pipeline_bounds`: a small first and last part, two
    halves of the rest between): the next part's reservation is asked for as soon as one is
    granted (the daemon verifies a part's key chain from pages it has reserved or stored,
    kvstore/chain.py); each part is copied as soon as its slots arrive and its commit sent at
    once. All pages are visible when this returns; on any failure, whatever was reserved and
    not committed is released."""
    bounds = pipeline_bounds(len(pages), small_last=True)
    parts = [(pages[a:b], views[a:b]) for a, b in itertools.pairwise(bounds)]
    timeout = settings.timeout_s

    def reserve(part: Sequence[Page]) -> Start:
        return Start(
            "Reserve", _reserve_request(scope, part, io, chain_prefix, client_pid), timeout
        )

    unread = [(yield reserve(parts[0][0]))]  # reservations whose reply was not read yet
    committing: list[object] = []
    leases: list[int] = []  # reserved, not yet known to be committed
    statuses: list[PutStatus] = []
    try:
        for k, (_, part_views) in enumerate(parts):
            reply = yield Join(unread.pop(0))
            if not isinstance(reply, pb.ReserveResponse):
                raise malformed(f"Reserve answered {type(reply).__name__}")
            if reply.lease_id:
                leases.append(reply.lease_id)
            if k + 1 < len(parts):
                unread.append((yield reserve(parts[k + 1][0])))
            if reply.lease_id:
                # Every part's: its Reserve went out after the check of the part before, maybe
                # on a new connection, to a daemon restarted since (whose slots are in another
                # segment than the one mapped here).
                yield CheckSegments(reply.lease_id)
            statuses.extend(cast(Statuses, (yield CopyIn(reply, part_views))))
            if reply.lease_id:
                commit = pb.CommitRequest(lease_id=reply.lease_id)
                committing.append((yield Start("Commit", commit, timeout)))
        for handle in committing:
            yield Join(handle)
        leases.clear()
    except BaseException:
        for handle in unread:  # read and release it
            try:
                pending = yield Join(handle)
            except Exception:  # its lease runs out on its own
                continue
            if isinstance(pending, pb.ReserveResponse) and pending.lease_id:
                leases.append(pending.lease_id)
        for handle in committing:
            yield Cancel(handle)
        for lease_id in leases:  # a committed lease is unknown by now: releasing it is a no-op
            yield Release(lease_id)
        raise
    return tuple(statuses)


def _put_bulk(
    scope: Scope,
    pages: Sequence[Page],
    views: Sequence[memoryview],
    io: IoClass,
    tier: Tier | None,
    chain_prefix: list[bytes],
    settings: Settings,
) -> Plan[Statuses | None]:
    begin = _begin(scope, io, tier, len(pages), chain_prefix)
    headers = [p.header.encode() for p in pages]
    done = yield BulkPut(begin, headers, views, settings.timeout_s)
    if done is BULK_FAILED:
        return None
    return cast(Statuses, done)


def _stripes(
    scope: Scope,
    pages: Sequence[Page],
    batch: range,
    route: Route,
    settings: Settings,
    prefix_tokens: Sequence[int],
) -> tuple[list[range], list[list[bytes]]] | None:
    """The stripes of the batch `batch` of `pages`, as ranges of the call's pages, with the
    chain prefixes each needs besides the call's (`stripe_chain_prefixes`, encoded); None: it
    goes whole (striping off or not worth it, or a stripe no prefix can vouch for)."""
    if not route.bulk_stripes:
        return None
    sizes = [p.header.payload_bytes for p in pages[batch.start : batch.stop]]
    parts = stripe_ranges(sizes, settings.striping)
    if parts is None:
        return None
    stripes = [range(batch.start + r.start, batch.start + r.stop) for r in parts]
    extra = stripe_chain_prefixes(scope, pages, stripes, prefix_tokens)
    if extra is None:
        return None
    return stripes, [[tokens_le(t) for t in mine] for mine in extra]


def _put_striped(
    scope: Scope,
    pages: Sequence[Page],
    views: Sequence[memoryview],
    batch: range,
    stripes: Sequence[range],
    io: IoClass,
    tier: Tier | None,
    prefixes: Sequence[list[bytes]],
    route: Route,
    settings: Settings,
) -> Plan[tuple[Statuses, bool]]:
    """The batch `batch` of `pages` (with `views` their payloads) as `stripes` (ranges of the
    call's pages) sent at once, each with its chain prefixes (`prefixes`: the call's and those
    of `stripe_chain_prefixes`, so the daemon verifies it whichever stripe it reserves first);
    the merged statuses, and whether the bulk path failed under a stripe (that stripe then went
    over gRPC). The first typed error of a stripe is raised once all have ended."""
    steps = tuple(
        BulkPut(
            _begin(scope, io, tier, len(r), prefix),
            _HeaderBytes(pages[r.start : r.stop]),
            views[r.start : r.stop],
            settings.timeout_s,
        )
        for r, prefix in zip(stripes, prefixes, strict=True)
    )
    outcomes = cast(tuple[object, ...], (yield Together(steps)))
    error = first_failure(outcomes, stripes)
    if error is not None:
        raise error
    statuses: list[PutStatus] = []
    failed = False
    for r, prefix, done in zip(stripes, prefixes, outcomes, strict=True):
        if done is BULK_FAILED:
            failed = True
            span = slice(r.start, r.stop)
            done = yield from _put_grpc(
                scope, pages[span], views[span], io, tier, prefix, route, settings
            )
        statuses.extend(cast(Statuses, done))
    if len(statuses) != len(batch):
        raise malformed(f"{len(statuses)} put statuses for {len(batch)} pages")
    return tuple(statuses), failed


class _HeaderBytes(Sequence[bytes]):
    """The encoded headers of `pages`, each encoded (its payload hashed, when still pending) on
    first read: a stripe's headers are then hashed in the thread that sends that stripe, beside
    the others (xxhash releases the GIL), not one after another before any is sent."""

    __slots__ = ("_pages",)

    def __init__(self, pages: Sequence[Page]) -> None:
        self._pages = pages

    def __len__(self) -> int:
        return len(self._pages)

    @overload
    def __getitem__(self, index: int) -> bytes: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[bytes]: ...
    def __getitem__(self, index: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(index, slice):
            return [p.header.encode() for p in self._pages[index]]
        return self._pages[index].header.encode()

    def __iter__(self) -> Iterator[bytes]:
        return (p.header.encode() for p in self._pages)


def _begin(
    scope: Scope, io: IoClass, tier: Tier | None, count: int, chain_prefix: list[bytes]
) -> bytes:
    """A serialized PutBegin of `count` pages."""
    return pb.PutBegin(
        scope=scope.encode(),
        io_class=io_class_value(io),
        page_count=count,
        tier=tier_value(tier),
        chain_prefix=chain_prefix,
    ).SerializeToString()


def _put_grpc(
    scope: Scope,
    pages: Sequence[Page],
    views: Sequence[memoryview],
    io: IoClass,
    tier: Tier | None,
    chain_prefix: list[bytes],
    route: Route,
    settings: Settings,
) -> Plan[Statuses]:
    chunk = chunk_bytes_for(route.limits, settings.max_message_bytes)

    def attempt(left_s: float) -> Plan[pb.PutResponse]:
        messages = put_messages(
            scope,
            pages,
            views,
            io_class=io,
            tier=tier,
            chunk_bytes=chunk,
            chain_prefix=chain_prefix,
        )
        reply = yield StreamPut(messages, left_s)
        if not isinstance(reply, pb.PutResponse):
            raise malformed(f"Put answered {type(reply).__name__}")
        return reply

    reply = yield from retried("Put", settings.policy, settings.timeout_s, attempt)
    return put_statuses_from_proto(reply, len(pages))

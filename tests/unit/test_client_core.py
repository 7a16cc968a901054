"""The client core (client/core/) driven by a scripted shell: no server, no socket, no loop.

Each test runs one operation's plan against fake replies and checks the steps it asks for and
the result it builds: arguments refused before any step, batches split by the node's limit, the
path chosen from the route (and the fall back to gRPC when a bulk path fails), retries only of
idempotent calls within the deadline (with the daemon's retry hint), leases released on every
failure, pages dropped by verification counted, token mismatches rejected.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest
from conftest import buffers, chain, keys_of, make_scope, singles, tokens_of
from google.protobuf.message import DecodeError

from client import GetResult, LookupResult, PutResult, PutStatus, Tier
from client.contract.errors import (
    CapacityExhausted,
    DeadlineExceeded,
    InvalidArgument,
    PermissionDenied,
    StrataError,
    Unavailable,
)
from client.contract.types import IoClass, Limits
from client.core import admin, get, lookup, put, requests
from client.core.frames import TAG_GET_CHUNK, chunk_message
from client.core.retry import RetryPolicy
from client.core.route import Route, Settings, get_path, put_path, verifies
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
)
from kvstore_pb import store_pb2 as pb

pytestmark = pytest.mark.unit

SCOPE = make_scope("core")
LIMITS = Limits(
    max_keys_per_call=0, max_page_bytes=0, max_message_bytes=0, chunk_bytes=0, lease_ttl_ms=0
)
SETTINGS = Settings(
    timeout_s=5.0, policy=RetryPolicy(2), io_class=IoClass.NORMAL, max_message_bytes=8 << 20
)
Answer = Callable[[Step], object]


def run(
    plan: Plan[object],
    route: Route,
    answer: Answer,
    thrown: type[BaseException] = StrataError,
) -> tuple[object, list[Step]]:
    """Drive `plan` as a shell would: `answer` gives each step's outcome or raises its error;
    an error of `thrown` is handed to the plan (BaseException: whatever it is, KeyboardInterrupt,
    a cancel or a parse error, as the shells' drivers do)."""
    steps: list[Step] = []
    driver = Run(plan)
    step = driver.advance()
    while step is not None:
        steps.append(step)
        if isinstance(step, Connect):
            step = driver.advance(route)
            continue
        try:
            outcome = answer(step)
        except thrown as exc:
            step = driver.advance(error=exc)
        else:
            step = driver.advance(outcome)
    return driver.result, steps


def kinds(steps: Sequence[Step]) -> list[str]:
    return [
        f"{type(s).__name__}:{s.method}" if isinstance(s, Call | Start) else type(s).__name__
        for s in steps
    ]


def no_io(step: Step) -> object:
    raise AssertionError(f"no I/O expected, got {step!r}")


def lookup_reply(hits: int) -> pb.LookupResponse:
    return pb.LookupResponse(hit_count=hits, tiers=[int(Tier.DRAM)] * hits)


# ---- arguments, routes --------------------------------------------------------------------


def test_bad_arguments_are_refused_before_any_step() -> None:
    pages = chain(SCOPE, 2)
    cases: list[Callable[[], Plan[object]]] = [
        lambda: lookup.lookup(SCOPE, [b"short"], SETTINGS),
        lambda: get.get(
            SCOPE,
            keys_of(pages),
            buffers(SCOPE, 1),
            tokens=None,
            io_class=None,
            verify=None,
            settings=SETTINGS,
        ),
        lambda: get.get(
            SCOPE,
            keys_of(pages),
            buffers(SCOPE, 2),
            tokens=[(1, 2)] * 2,
            io_class=None,
            verify=None,
            settings=SETTINGS,
        ),
        lambda: put.put(
            make_scope("another"),
            pages,
            io_class=None,
            tier=None,
            chain_prefixes=(),
            prefix_tokens=(),
            settings=SETTINGS,
            client_pid=1,
        ),
        lambda: admin.delete(SCOPE, keys_of(pages), SETTINGS),
        lambda: admin.delete(None, None, SETTINGS),
    ]
    for make in cases:
        with pytest.raises(InvalidArgument):
            run(make(), Route(LIMITS), no_io)


def test_empty_calls_take_no_step() -> None:
    assert run(lookup.lookup(SCOPE, [], SETTINGS), Route(LIMITS), no_io) == (
        LookupResult(0, ()),
        [],
    )
    empty_get = get.get(SCOPE, [], [], tokens=[], io_class=None, verify=None, settings=SETTINGS)
    result, steps = run(empty_get, Route(LIMITS), no_io)
    assert isinstance(result, GetResult) and result.headers == () and steps == []
    assert run(admin.delete(None, [], SETTINGS), Route(LIMITS), no_io) == (0, [])


def test_the_path_follows_the_route() -> None:
    same_host, bulk = Route(LIMITS, same_host=True), Route(LIMITS, bulk=True)
    assert [put_path(same_host, t) for t in (None, Tier.DRAM, Tier.SSD)] == ["shm", "shm", "grpc"]
    assert (put_path(bulk, Tier.SSD), put_path(Route(LIMITS), None)) == ("bulk", "grpc")
    assert (get_path(same_host), get_path(bulk), get_path(Route(LIMITS))) == (
        "shm",
        "bulk",
        "grpc",
    )
    # checksums are checked off the same-host path unless the caller says otherwise
    assert (verifies(same_host, None), verifies(bulk, None), verifies(same_host, True)) == (
        False,
        True,
        True,
    )


# ---- lookup: batches, the TCP path, retries ---------------------------------------------


def test_lookup_batches_stop_at_the_first_batch_with_a_miss() -> None:
    keys = keys_of(chain(SCOPE, 5))
    route = Route(replace(LIMITS, max_keys_per_call=2))
    replies = iter([lookup_reply(2), lookup_reply(1)])
    result, steps = run(lookup.lookup(SCOPE, keys, SETTINGS), route, lambda s: next(replies))
    assert result == LookupResult(3, (Tier.DRAM,) * 3)
    assert kinds(steps) == ["Connect", "Call:Lookup", "Call:Lookup"]
    asked = [s.request.keys for s in steps if isinstance(s, Call)]
    assert asked == [b"".join(keys[0:2]), b"".join(keys[2:4])]


def test_lookup_over_tcp_falls_back_to_the_control_channel_for_good() -> None:
    keys = keys_of(chain(SCOPE, 6))
    route = Route(replace(LIMITS, max_keys_per_call=2), bulk=True, bulk_lookups=True)
    answers = iter([(Tier.DRAM, Tier.SSD), BULK_FAILED, lookup_reply(2), lookup_reply(2)])
    result, steps = run(lookup.lookup(SCOPE, keys, SETTINGS), route, lambda s: next(answers))
    assert result == LookupResult(6, (Tier.DRAM, Tier.SSD, *(Tier.DRAM,) * 4))
    assert kinds(steps) == ["Connect", "BulkLookup", "BulkLookup", "Call:Lookup", "Call:Lookup"]
    first = steps[1]
    assert isinstance(first, BulkLookup) and first.asked == 2
    assert pb.LookupRequest.FromString(first.request).scope == SCOPE.encode()


def test_idempotent_calls_are_retried_within_the_deadline() -> None:
    keys = keys_of(chain(SCOPE, 2))
    failures = iter([Unavailable("down"), Unavailable("down")])

    def flaky(step: Step) -> object:
        if isinstance(step, Pause):
            return None
        error = next(failures, None)
        if error is not None:
            raise error
        return lookup_reply(2)

    result, steps = run(lookup.lookup(SCOPE, keys, SETTINGS), Route(LIMITS), flaky)
    assert result == LookupResult(2, (Tier.DRAM,) * 2)
    assert kinds(steps) == [
        "Connect",
        "Call:Lookup",
        "Pause",
        "Call:Lookup",
        "Pause",
        "Call:Lookup",
    ]
    calls = [s for s in steps if isinstance(s, Call)]
    assert all(0 < c.timeout_s <= SETTINGS.timeout_s for c in calls)
    # one retry fewer than failures: the error comes out
    once = replace(SETTINGS, policy=RetryPolicy(1))
    failures = iter([Unavailable("down"), Unavailable("down")])
    with pytest.raises(Unavailable):
        run(lookup.lookup(SCOPE, keys, once), Route(LIMITS), flaky)


def test_errors_that_cannot_change_are_not_retried_and_hints_are_kept() -> None:
    keys = keys_of(chain(SCOPE, 2))

    def denied(step: Step) -> object:
        raise PermissionDenied("not yours")

    with pytest.raises(PermissionDenied):
        run(lookup.lookup(SCOPE, keys, SETTINGS), Route(LIMITS), denied)
    pauses: list[float] = []

    def full_once(step: Step) -> object:
        if isinstance(step, Pause):
            pauses.append(step.seconds)
            return None
        if not pauses:
            raise CapacityExhausted("full", retry_after_s=0.4)
        return pb.DeleteResponse(deleted=2)

    result, _ = run(admin.delete(None, keys, SETTINGS), Route(LIMITS), full_once)
    assert result == 2 and len(pauses) == 1 and pauses[0] >= 0.4
    # a hint past the deadline gives up at once
    short = replace(SETTINGS, timeout_s=0.2)
    pauses.clear()
    with pytest.raises(CapacityExhausted):
        run(admin.delete(None, keys, short), Route(LIMITS), full_once)
    assert pauses == []


def test_a_malformed_reply_is_an_error_not_a_retry() -> None:
    keys = keys_of(chain(SCOPE, 2))
    result: list[Step] = []

    def wrong(step: Step) -> object:
        result.append(step)
        return pb.StatsResponse()

    with pytest.raises(StrataError, match="malformed reply"):
        run(lookup.lookup(SCOPE, keys, SETTINGS), Route(LIMITS), wrong)
    assert len(result) == 1
    with pytest.raises(StrataError, match="malformed reply"):
        run(lookup.lookup(SCOPE, keys, SETTINGS), Route(LIMITS), lambda s: lookup_reply(3))


# ---- get ----------------------------------------------------------------------------------


def get_plan(pages: Sequence[object], *, tokens: object = "right", verify: bool | None = None):  # type: ignore[no-untyped-def]
    ps = list(pages)
    toks = tokens_of(ps) if tokens == "right" else tokens
    return get.get(
        SCOPE,
        keys_of(ps),
        buffers(SCOPE, len(ps)),
        tokens=toks,  # type: ignore[arg-type]
        io_class=IoClass.CRITICAL,
        verify=verify,
        settings=SETTINGS,
    )


def test_a_same_host_get_releases_its_lease_even_when_the_copy_fails() -> None:
    pages = singles(SCOPE, 2, seed=3)
    acquired = pb.AcquireResponse(lease_id=77)

    def answer(step: Step) -> object:
        if isinstance(step, Call):
            assert isinstance(step.request, pb.AcquireRequest)
            assert step.request.io_class == int(IoClass.CRITICAL)
            return acquired
        if isinstance(step, CopyOut):
            assert step.reply is acquired and step.verify is False
            return (pages[0].header, None), 1
        return None

    result, steps = run(get_plan(pages), Route(LIMITS, same_host=True), answer)
    assert kinds(steps) == [
        "Connect",
        "Call:Acquire",
        "CheckSegments",
        "CopyOut",
        "Release",
        "Dropped",
    ]
    assert steps[4] == Release(77) and steps[5] == Dropped(1)
    assert isinstance(result, GetResult) and result.headers == (pages[0].header, None)

    def broken(step: Step) -> object:
        if isinstance(step, CopyOut):
            raise Unavailable("segment gone")
        return answer(step)

    with pytest.raises(Unavailable):
        run(get_plan(pages), Route(LIMITS, same_host=True), broken)


def test_a_large_same_host_get_asks_for_every_part_at_once_and_copies_each_as_it_comes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pages = singles(SCOPE, requests.PIPELINE_MIN_PAGES * 2, seed=4)  # parts of 1, 3 and 28 pages
    sizes = [1, 3, 28]
    fail: dict[int, StrataError] = {}

    def answer(step: Step) -> object:
        if isinstance(step, Start):
            assert step.method == "Acquire" and isinstance(step.request, pb.AcquireRequest)
            k = len(started)
            started.append(len(step.request.keys) // 16)
            return ("handle", k)
        if isinstance(step, Join):
            _, k = step.handle  # type: ignore[misc]
            if k in fail:
                raise fail[k]
            if k == 1:  # a part of misses only: nothing leased, nothing copied
                return pb.AcquireResponse(pages=[pb.AcquiredPage()] * sizes[k])
            return pb.AcquireResponse(lease_id=100 + k, pages=[pb.AcquiredPage(present=True)])
        if isinstance(step, CopyOut):
            assert isinstance(step.reply, pb.AcquireResponse)
            if step.reply.lease_id == 200:  # the whole batch in one
                return tuple(p.header for p in pages), 0
            k = step.reply.lease_id - 100
            start = sum(sizes[:k])
            assert list(step.keys) == keys_of(pages)[start : start + sizes[k]]
            return tuple(p.header for p in pages[start : start + sizes[k]]), 0
        if isinstance(step, Call):  # the whole batch again, after a retryable failure
            return pb.AcquireResponse(lease_id=200, pages=[pb.AcquiredPage(present=True)])
        return None

    route = Route(LIMITS, same_host=True, pipelined=True)
    started: list[int] = []
    # at the default size these small pages go whole: the copy would overlap too little
    assert SCOPE.page_payload_bytes * len(pages) < requests.PIPELINE_MIN_BYTES
    _, steps = run(get_plan(pages), route, answer)
    assert kinds(steps)[:2] == ["Connect", "Call:Acquire"] and started == []
    monkeypatch.setattr(requests, "PIPELINE_MIN_BYTES", 0)
    result, steps = run(get_plan(pages), route, answer)
    assert started == sizes
    assert kinds(steps) == [
        "Connect",
        "Start:Acquire",
        "Start:Acquire",
        "Start:Acquire",
        "Join",
        "CheckSegments",
        "CopyOut",
        "Release",
        "Join",
        "Join",
        "CopyOut",
        "Release",
    ]  # fmt: skip  (every Acquire sent before the first reply is read)
    assert [s for s in steps if isinstance(s, Release)] == [Release(100), Release(102)]
    assert isinstance(result, GetResult)
    assert result.headers == (
        *(p.header for p in pages[:1]), *(None,) * 3, *(p.header for p in pages[4:])
    )  # fmt: skip

    # the same get not pipelined (a lane that cannot keep two calls in flight): one Acquire
    started = []
    _, steps = run(get_plan(pages), Route(LIMITS, same_host=True), answer)
    assert kinds(steps)[:2] == ["Connect", "Call:Acquire"] and started == []

    # the middle Acquire fails, retryably: the leases granted go back, the batch goes again whole
    started, fail = [], {1: Unavailable("lane hiccup")}
    _, steps = run(get_plan(pages), route, answer)
    assert [s for s in steps if isinstance(s, Release)] == [
        Release(100),
        Release(102),
        Release(200),
    ]
    assert kinds(steps)[-5:] == ["Pause", "Call:Acquire", "CheckSegments", "CopyOut", "Release"]
    # ... as a retry of the call: within its deadline, never after the deadline ran out, and
    # not at all by a client that retries nothing
    again = next(s for s in steps if isinstance(s, Call))
    assert 0 < again.timeout_s <= SETTINGS.timeout_s
    calls: list[Step] = []

    def counting(step: Step) -> object:
        if isinstance(step, Call):
            calls.append(step)
        return answer(step)

    for error, settings in (
        (DeadlineExceeded("lane call timed out"), SETTINGS),
        (Unavailable("lane hiccup"), replace(SETTINGS, policy=RetryPolicy(0))),
    ):
        started, fail = [], {1: error}
        calls.clear()
        plan = get.get(
            SCOPE,
            keys_of(pages),
            buffers(SCOPE, len(pages)),
            tokens=tokens_of(pages),
            io_class=IoClass.CRITICAL,
            verify=None,
            settings=settings,
        )
        with pytest.raises(type(error)):
            run(plan, route, counting)
        assert calls == []
    # ... not retryably: raised, with every lease granted released and nothing asked again
    started, fail = [], {0: InvalidArgument("bad scope")}
    recorded: list[Step] = []

    def recording(step: Step) -> object:
        recorded.append(step)
        return answer(step)

    with pytest.raises(InvalidArgument):
        run(get_plan(pages), route, recording)
    assert [s for s in recorded if isinstance(s, Release)] == [Release(102)]
    assert not any(isinstance(s, Call | CopyOut) for s in recorded)

    # a copy fails: its lease and the ones still coming are released, the error raised
    started, fail = [], {}
    recorded = []

    def copy_breaks(step: Step) -> object:
        recorded.append(step)
        if isinstance(step, CopyOut):
            raise Unavailable("segment gone")
        return answer(step)

    with pytest.raises(Unavailable):
        run(get_plan(pages), route, copy_breaks)
    assert [s for s in recorded if isinstance(s, Release)] == [Release(100), Release(102)]


@pytest.mark.usefixtures("pipelined_small_batches")
@pytest.mark.parametrize(
    ("where", "error"),
    [
        ("join 0", KeyboardInterrupt()),
        ("join 1", DecodeError("Error parsing message")),  # a lane reply that does not parse
        ("join 0", asyncio.CancelledError()),
        ("start 2", KeyboardInterrupt()),
        ("check", KeyboardInterrupt()),
    ],
)
def test_a_large_same_host_get_interrupted_releases_every_lease_granted(
    where: str, error: BaseException
) -> None:
    pages = singles(SCOPE, requests.PIPELINE_MIN_PAGES * 2, seed=6)  # parts of 1, 3 and 28
    sizes = [1, 3, 28]
    starts = 0

    def answer(step: Step) -> object:
        nonlocal starts
        if isinstance(step, Start):
            if where == f"start {starts}":
                raise error
            starts += 1
            return ("handle", starts - 1)
        if isinstance(step, Join):
            _, k = step.handle  # type: ignore[misc]
            if where == f"join {k}":
                raise error
            return pb.AcquireResponse(
                lease_id=100 + k, pages=[pb.AcquiredPage(present=True)] * sizes[k]
            )
        if isinstance(step, CheckSegments) and where == "check":
            raise error
        if isinstance(step, CopyOut):
            return (None,) * len(step.keys), 0
        return None

    recorded: list[Step] = []

    def recording(step: Step) -> object:
        recorded.append(step)
        return answer(step)

    with pytest.raises(type(error)):
        run(
            get_plan(pages),
            Route(LIMITS, same_host=True, pipelined=True),
            recording,
            thrown=BaseException,
        )
    # every lease granted, but one whose reply was never read, or whose segment check failed
    # (the shell releases that one itself)
    released = sorted(s.lease_id for s in recorded if isinstance(s, Release))
    assert (
        released
        == {
            "join 0": [101, 102],
            "join 1": [100, 102],
            "start 2": [100, 101],
            "check": [101, 102],
        }[where]
    )


def test_a_page_served_for_other_tokens_is_rejected() -> None:
    pages = singles(SCOPE, 2, seed=5)
    wrong = [tokens_of(pages)[1], tokens_of(pages)[1]]

    def answer(step: Step) -> object:
        if isinstance(step, BulkGet):
            return (pages[0].header, pages[1].header), 0
        raise AssertionError(step)

    result, steps = run(get_plan(pages, tokens=wrong), Route(LIMITS, bulk=True), answer)
    assert isinstance(result, GetResult)
    assert (result.hit_count, result.rejected) == (1, 1) and result.headers[0] is None
    bulk = steps[1]
    assert isinstance(bulk, BulkGet) and bulk.verify is True  # off the same host: checked


def test_a_grpc_get_reassembles_and_verifies_each_page() -> None:
    pages = singles(SCOPE, 3, seed=7)

    def answer(step: Step) -> object:
        if isinstance(step, Dropped):
            return None
        assert isinstance(step, StreamGet)
        for i, page in enumerate(pages):
            data = bytearray(page.payload)
            if i == 1:
                data[0] ^= 1  # damaged on the way
            step.assembler.feed_message(
                chunk_message(TAG_GET_CHUNK, i, page.header.encode(), 0, bytes(data))
            )
        return None

    result, steps = run(get_plan(pages), Route(LIMITS), answer)
    assert kinds(steps) == ["Connect", "StreamGet", "Dropped"] and steps[2] == Dropped(1)
    assert isinstance(result, GetResult)
    assert [h is not None for h in result.headers] == [True, False, True]


def test_a_failed_bulk_get_goes_on_over_grpc() -> None:
    pages = singles(SCOPE, 4, seed=9)
    route = Route(replace(LIMITS, max_keys_per_call=2), bulk=True)

    def answer(step: Step) -> object:
        if isinstance(step, BulkGet):
            return BULK_FAILED
        assert isinstance(step, StreamGet)
        first = len(step.assembler.finish())  # nothing fed: all missing
        assert first == 2
        return None

    result, steps = run(get_plan(pages), route, answer)
    assert kinds(steps) == ["Connect", "BulkGet", "StreamGet", "StreamGet"]
    assert isinstance(result, GetResult) and result.hit_count == 0


# ---- put ----------------------------------------------------------------------------------


def put_plan(pages: Sequence[object], tier: Tier | None = None):  # type: ignore[no-untyped-def]
    return put.put(
        SCOPE,
        list(pages),  # type: ignore[arg-type]
        io_class=IoClass.BACKGROUND,
        tier=tier,
        chain_prefixes=[[5, 6, 7]],
        prefix_tokens=(),
        settings=SETTINGS,
        client_pid=4242,
    )


def test_a_same_host_put_reserves_copies_commits_and_releases_on_failure() -> None:
    pages = chain(SCOPE, 3, seed=11)
    reserved = pb.ReserveResponse(lease_id=5)
    stored = (PutStatus.STORED,) * 3

    def answer(step: Step) -> object:
        if isinstance(step, Call) and step.method == "Reserve":
            request = step.request
            assert isinstance(request, pb.ReserveRequest)
            assert (request.client_pid, len(request.headers)) == (4242, 3)
            assert list(request.chain_prefix) == [
                b"\x05\x00\x00\x00\x06\x00\x00\x00\x07\x00\x00\x00"
            ]
            return reserved
        if isinstance(step, CopyIn):
            return stored
        if isinstance(step, Call) and step.method == "Commit":
            return pb.CommitResponse()
        return None

    result, steps = run(put_plan(pages), Route(LIMITS, same_host=True), answer)
    assert kinds(steps) == ["Connect", "Call:Reserve", "CheckSegments", "CopyIn", "Call:Commit"]
    assert result == PutResult(stored)

    def commit_fails(step: Step) -> object:
        if isinstance(step, Call) and step.method == "Commit":
            raise Unavailable("gone")
        return answer(step)

    # Commit is not retried (not idempotent); the lease is released
    recorded: list[Step] = []

    def recording(step: Step) -> object:
        recorded.append(step)
        return commit_fails(step)

    with pytest.raises(Unavailable):
        run(put_plan(pages), Route(LIMITS, same_host=True), recording)
    assert kinds(recorded) == ["Call:Reserve", "CheckSegments", "CopyIn", "Call:Commit", "Release"]
    assert recorded[-1] == Release(5)


def test_pipeline_bounds_start_small_and_cover_every_page() -> None:
    for count in (16, 17, 40, 64, 100, 512):
        for small_last in (True, False):
            bounds = requests.pipeline_bounds(count, small_last=small_last)
            sizes = [b - a for a, b in itertools.pairwise(bounds)]
            assert bounds[0] == 0 and bounds[-1] == count and min(sizes) >= 1
            assert sizes[0] == max(1, count // 32)  # the first reply comes back soonest
            if small_last:
                assert len(sizes) == 4 and sizes[-1] == sizes[0]  # so is the last commit
            else:
                assert len(sizes) == 3 and sizes[1] == 3 * sizes[0]  # each leased in time
    assert requests.pipeline_bounds(64, small_last=True) == [0, 2, 32, 62, 64]
    assert requests.pipeline_bounds(64, small_last=False) == [0, 2, 8, 64]
    assert requests.pipeline_bounds(16, small_last=True) == [0, 1, 8, 15, 16]
    with pytest.raises(ValueError, match="at least 16"):
        requests.pipeline_bounds(15, small_last=True)
    mib = 1 << 20
    assert requests.pipelines(16, mib) and requests.pipelines(64, 4 * mib)
    assert not requests.pipelines(64, 64 << 10)  # 4 MiB: the daemon's work outweighs the copy
    assert not requests.pipelines(15, 4 * mib)


def test_a_large_same_host_put_overlaps_its_parts_and_releases_all_on_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(requests, "PIPELINE_MIN_BYTES", 0)  # these pages are small
    pages = chain(SCOPE, 2 * requests.PIPELINE_MIN_PAGES, seed=13)
    sizes = [1, 15, 15, 1]  # pipeline_bounds(32, small_last=True)
    leases = iter([21, 22, 23, 24])
    copied: list[int] = []
    reserved: list[Step] = []
    fail_at = 0

    def answer(step: Step) -> object:
        if isinstance(step, Start):
            if step.method == "Reserve":
                assert isinstance(step.request, pb.ReserveRequest)
                assert len(step.request.headers) == sizes[len(reserved)]  # asked in order
                reserved.append(step)
                return ("handle", step.method, next(leases))
            return ("handle", step.method, 0)
        if isinstance(step, Join):
            _, method, lease = step.handle  # type: ignore[misc]
            return (
                pb.ReserveResponse(lease_id=lease) if method == "Reserve" else pb.CommitResponse()
            )
        if isinstance(step, CopyIn):
            copied.append(len(step.payloads))
            if len(copied) == fail_at:
                raise Unavailable("segment gone")
            return (PutStatus.STORED,) * len(step.payloads)
        return None

    result, steps = run(put_plan(pages), Route(LIMITS, same_host=True, pipelined=True), answer)
    assert result == PutResult((PutStatus.STORED,) * len(pages))
    assert copied == sizes
    assert kinds(steps) == [
        "Connect",
        "Start:Reserve",
        "Join",
        "Start:Reserve",
        "CheckSegments",
        "CopyIn",
        "Start:Commit",
        "Join",
        "Start:Reserve",
        "CheckSegments",
        "CopyIn",
        "Start:Commit",
        "Join",
        "Start:Reserve",
        "CheckSegments",
        "CopyIn",
        "Start:Commit",
        "Join",
        "CheckSegments",
        "CopyIn",
        "Start:Commit",
        "Join",
        "Join",
        "Join",
        "Join",
    ]  # fmt: skip  (each part's slots checked to be in the segments mapped, before its copy)

    # the same without pipelining: one reservation for all
    def whole(step: Step) -> object:
        if isinstance(step, CopyIn):
            return (PutStatus.STORED,) * len(pages)
        if isinstance(step, Call):
            return (
                pb.ReserveResponse(lease_id=9) if step.method == "Reserve" else pb.CommitResponse()
            )
        return None

    result, steps = run(put_plan(pages), Route(LIMITS, same_host=True), whole)
    assert kinds(steps) == ["Connect", "Call:Reserve", "CheckSegments", "CopyIn", "Call:Commit"]
    # the third copy fails: the two commits sent are cancelled, every lease released
    fail_at, copied, reserved, leases = 3, [], [], iter([31, 32, 33, 34])
    recorded: list[Step] = []

    def recording(step: Step) -> object:
        recorded.append(step)
        return answer(step)

    with pytest.raises(Unavailable):
        run(put_plan(pages), Route(LIMITS, same_host=True, pipelined=True), recording)
    assert sum(isinstance(s, Cancel) for s in recorded) == 2
    assert [s for s in recorded if isinstance(s, Release)] == [
        Release(31),
        Release(32),
        Release(33),
        Release(34),
    ]  # fmt: skip  (the fourth was asked for before the third copy: read, then released)


def test_a_large_same_host_put_copies_no_part_granted_by_a_restarted_daemon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A part's Reserve goes out only once the part before it is granted, maybe on a new lane
    connection, to a daemon restarted in between: its slots are then in a segment this process
    has not mapped, so copying into the map and committing would publish whatever the new
    slots hold (a same-host put leaves the checksum to the daemon)."""
    monkeypatch.setattr(requests, "PIPELINE_MIN_BYTES", 0)  # these pages are small
    pages = chain(SCOPE, 2 * requests.PIPELINE_MIN_PAGES, seed=17)
    leases = iter([41, 42, 43, 44])
    restarted = False
    recorded: list[Step] = []

    def answer(step: Step) -> object:
        nonlocal restarted
        recorded.append(step)
        if isinstance(step, Start):
            if step.method == "Commit" and step.request.lease_id == 42:  # type: ignore[attr-defined]
                restarted = True  # the third part's Reserve, sent before, waits on a new daemon
            lease = next(leases) if step.method == "Reserve" else 0
            return ("handle", step.method, lease)
        if isinstance(step, Join):
            _, method, lease = step.handle  # type: ignore[misc]
            return (
                pb.ReserveResponse(lease_id=lease) if method == "Reserve" else pb.CommitResponse()
            )
        if isinstance(step, CheckSegments) and restarted:
            raise Unavailable("the store's shared-memory segment changed")
        if isinstance(step, CopyIn):
            return (PutStatus.STORED,) * len(step.payloads)
        return None

    with pytest.raises(Unavailable, match="segment changed"):
        run(put_plan(pages), Route(LIMITS, same_host=True, pipelined=True), answer)
    copies = [s for s in recorded if isinstance(s, CopyIn)]
    assert [c.reply.lease_id for c in copies] == [41, 42]  # granted before the restart
    commits = [s for s in recorded if isinstance(s, Start) and s.method == "Commit"]
    assert [c.request.lease_id for c in commits] == [41, 42]  # type: ignore[attr-defined]


def test_a_put_is_never_retried_and_a_failed_bulk_path_goes_on_over_grpc() -> None:
    pages = chain(SCOPE, 4, seed=15)
    route = Route(replace(LIMITS, max_keys_per_call=2), bulk=True)
    streamed: list[int] = []

    def answer(step: Step) -> object:
        if isinstance(step, BulkPut):
            assert len(step.headers) == 2
            assert pb.PutBegin.FromString(step.begin).io_class == int(IoClass.BACKGROUND)
            return BULK_FAILED
        assert isinstance(step, StreamPut)
        messages = list(step.messages)
        streamed.append(len(messages))
        return pb.PutResponse(statuses=[int(PutStatus.STORED)] * 2)

    result, steps = run(put_plan(pages), route, answer)
    assert kinds(steps) == ["Connect", "BulkPut", "StreamPut", "StreamPut"]
    assert result == PutResult((PutStatus.STORED,) * 4)
    assert streamed == [3, 3]  # a begin and one chunk per page

    recorded: list[Step] = []

    def recording(step: Step) -> object:
        recorded.append(step)
        raise Unavailable("down")

    with pytest.raises(Unavailable):
        run(put_plan(pages), Route(LIMITS), recording)
    assert kinds(recorded) == ["StreamPut"]  # no Pause, no second attempt


def test_a_same_host_put_for_another_tier_takes_grpc() -> None:
    pages = chain(SCOPE, 1, seed=17)

    def answer(step: Step) -> object:
        assert isinstance(step, StreamPut)
        return pb.PutResponse(statuses=[int(PutStatus.STORED)])

    _, steps = run(put_plan(pages, Tier.SSD), Route(LIMITS, same_host=True), answer)
    assert kinds(steps) == ["Connect", "StreamPut"]


def test_node_info_and_stats_plans() -> None:
    reply = pb.NodeInfoResponse(node_id="n1", api_version=1)
    info, steps = run(admin.node_info(SETTINGS, connect=False), Route(LIMITS), lambda s: reply)
    assert kinds(steps) == ["Call:NodeInfo"] and info.node_id == "n1"  # type: ignore[attr-defined]
    stats, steps = run(admin.stats(SETTINGS), Route(LIMITS), lambda s: pb.StatsResponse(pages=4))
    assert kinds(steps) == ["Connect", "Call:Stats"] and stats.pages == 4  # type: ignore[attr-defined]

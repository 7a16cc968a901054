"""The pure half of striping (client/core/stripes.py): where a batch is cut, when it goes whole,
which puts can be striped without a chain check refusing a stripe, the options' resolution, and
the plans' `Together` step (the stripes' requests, the merge in order, a failed stripe over gRPC,
the first typed error raised with the stripe's pages noted)."""

from __future__ import annotations

from typing import cast

import pytest
from conftest import make_scope

from client.contract.errors import CapacityExhausted, InvalidArgument
from client.contract.scope import page_keys
from client.contract.types import (
    IoClass,
    Limits,
    PutResult,
    PutStatus,
    build_pages,
    page_tokens,
    tokens_le,
)
from client.core import get as get_op
from client.core import put as put_op
from client.core.retry import RetryPolicy
from client.core.route import Route, Settings
from client.core.run import Run
from client.core.steps import BULK_FAILED, BulkGet, BulkPut, StreamGet, StreamPut, Together
from client.core.stripes import (
    DEFAULT_STRIPE_MIN_BYTES,
    DEFAULT_STRIPES,
    MAX_STRIPE_PARENTS,
    STRIPE_BYTES_ENV,
    STRIPES_ENV,
    Striping,
    parse_bytes,
    resolve_striping,
    stripe_chain_prefixes,
    stripe_ranges,
)
from kvstore_pb import store_pb2 as pb

pytestmark = pytest.mark.unit

SCOPE = make_scope()
PAGE = SCOPE.page_payload_bytes
TOKENS = list(range(SCOPE.layout.page_tokens * 6))
PAGES = build_pages(SCOPE, TOKENS, [bytes([i]) * PAGE for i in range(6)])
STRIPED = Settings(10.0, RetryPolicy(0), IoClass.NORMAL, 8 << 20, Striping(2, 1))
LIMITS = Limits(
    max_keys_per_call=0, max_page_bytes=0, max_message_bytes=0, chunk_bytes=0, lease_ttl_ms=0
)
ROUTE = Route(limits=LIMITS, bulk=True, bulk_lookups=True, bulk_stripes=True)


def test_a_batch_is_cut_where_the_bytes_pass_each_share() -> None:
    assert stripe_ranges([1] * 64, Striping(2, 1)) == [range(0, 32), range(32, 64)]
    assert stripe_ranges([5] * 5, Striping(2, 1)) == [range(0, 3), range(3, 5)]
    assert stripe_ranges([5] * 7, Striping(3, 1)) == [range(0, 3), range(3, 5), range(5, 7)]
    # by bytes, pages whole; and a page left for each later stripe
    assert stripe_ranges([10, 1, 1, 1], Striping(2, 1)) == [range(0, 1), range(1, 4)]
    assert stripe_ranges([1, 1, 10], Striping(3, 1)) == [range(0, 1), range(1, 2), range(2, 3)]
    assert stripe_ranges([1, 1], Striping(4, 1)) == [range(0, 1), range(1, 2)]


def test_a_batch_goes_whole_when_striping_is_off_small_or_one_page() -> None:
    assert stripe_ranges([1] * 8, Striping(1, 1)) is None
    assert stripe_ranges([1] * 8, Striping(2, 9)) is None
    assert stripe_ranges([1] * 8, Striping(2, 8)) is not None
    assert stripe_ranges([100], Striping(2, 1)) is None
    assert stripe_ranges([], Striping(2, 1)) is None


def test_options_resolve_from_arguments_then_environment_then_defaults() -> None:
    assert resolve_striping(None, None, {}) == Striping(DEFAULT_STRIPES, DEFAULT_STRIPE_MIN_BYTES)
    env = {STRIPES_ENV: "3", STRIPE_BYTES_ENV: "2MiB"}
    assert resolve_striping(None, None, env) == Striping(3, 2 << 20)
    assert resolve_striping(1, 4096, env) == Striping(1, 4096)
    assert parse_bytes("512KiB") == 512 << 10
    assert parse_bytes("8388608") == 8 << 20
    for bad in ({STRIPES_ENV: "two"}, {STRIPE_BYTES_ENV: "8 MB"}, {STRIPES_ENV: "0"}):
        with pytest.raises(InvalidArgument):
            resolve_striping(None, None, bad)
    with pytest.raises(InvalidArgument):
        Striping(17, 1)


def test_each_stripe_carries_the_paths_to_the_earlier_pages_it_follows() -> None:
    n = SCOPE.layout.page_tokens
    cut = [range(0, 3), range(3, 6)]
    # one chain from the scope digest: the second stripe follows page 2
    assert stripe_chain_prefixes(SCOPE, PAGES, cut, ()) == [[], [TOKENS[: 3 * n]]]
    tail = PAGES[2:]  # follows a page only the node knows: nothing can vouch for it
    assert stripe_chain_prefixes(SCOPE, tail, [range(0, 2), range(2, 4)], ()) is None
    assert stripe_chain_prefixes(SCOPE, tail, [range(0, 2), range(2, 4)], TOKENS[: 2 * n]) == [
        [],
        [TOKENS[: 4 * n]],
    ]
    other = build_pages(SCOPE, [7] * 2 * n, [b"\0" * PAGE] * 2)  # a second prompt: nothing needed
    assert stripe_chain_prefixes(SCOPE, [*tail[:2], *other], [range(0, 2), range(2, 4)], ()) == [
        [],
        [],
    ]
    # a branch: page B1 continues page 0, as page 1 does; the deepest path is enough
    b1 = build_pages(SCOPE, [*TOKENS[:n], *[9] * n], [b"\0" * PAGE], first_page=1)[0]
    pages = [PAGES[0], PAGES[1], b1, PAGES[2]]
    assert stripe_chain_prefixes(SCOPE, pages, [range(0, 2), range(2, 4)], ()) == [
        [],
        [TOKENS[: 2 * n]],
    ]
    # a stripe following more earlier pages than MAX_STRIPE_PARENTS: the put goes whole
    many = [build_pages(SCOPE, [i] * n, [b"\0" * PAGE])[0] for i in range(MAX_STRIPE_PARENTS + 1)]
    children = [
        build_pages(SCOPE, [*[i] * n, *[5] * n], [b"\0" * PAGE] * 2)[1] for i in range(len(many))
    ]
    cut = [range(0, len(many)), range(len(many), 2 * len(many))]
    assert stripe_chain_prefixes(SCOPE, [*many, *children], cut, ()) is None
    assert (
        stripe_chain_prefixes(
            SCOPE,
            [*many[1:], *children[1:]],
            [range(0, len(many) - 1), range(len(many) - 1, 2 * len(many) - 2)],
            (),
        )
        is not None
    )
    # pages of an earlier batch count as stored: only this batch's stripes need paths
    assert stripe_chain_prefixes(SCOPE, PAGES, [range(3, 4), range(4, 6)], ()) == [
        [],
        [TOKENS[: 4 * n]],
    ]


def _drive_to_together(plan: object) -> tuple[Run[object], Together]:
    run = Run(plan)  # type: ignore[arg-type]
    step = run.advance()
    assert step is not None
    step = run.advance(ROUTE)  # the Connect
    assert isinstance(step, Together)
    return run, step


def test_a_striped_put_sends_each_part_with_its_chain_prefix_and_merges_in_order() -> None:
    plan = put_op.put(
        SCOPE,
        PAGES,
        io_class=None,
        tier=None,
        chain_prefixes=(),
        prefix_tokens=(),
        settings=STRIPED,
        client_pid=1,
    )
    run, together = _drive_to_together(plan)
    first, second = cast(tuple[BulkPut, BulkPut], together.steps)
    begins = [pb.PutBegin.FromString(s.begin) for s in (first, second)]
    assert [b.page_count for b in begins] == [3, 3]
    assert list(begins[0].chain_prefix) == []
    # the second carries the tokens from the scope digest on: its parents verify before they land
    assert begins[1].chain_prefix[0].startswith(tokens_le(PAGES[0].header.tokens))
    assert [bytes(v) for v in second.payloads] == [bytes(p.payload) for p in PAGES[3:]]
    done = (PutStatus.STORED,) * 3
    assert run.advance((done, (PutStatus.ALREADY_PRESENT,) * 3)) is None
    assert cast(PutResult, run.result).statuses == done + (PutStatus.ALREADY_PRESENT,) * 3


def test_a_stripe_whose_transfer_failed_goes_over_grpc_and_an_error_names_its_pages() -> None:
    def plan() -> object:
        return put_op.put(
            SCOPE,
            PAGES,
            io_class=None,
            tier=None,
            chain_prefixes=(),
            prefix_tokens=(),
            settings=STRIPED,
            client_pid=1,
        )

    run, _ = _drive_to_together(plan())
    step = run.advance(((PutStatus.STORED,) * 3, BULK_FAILED))
    assert isinstance(step, StreamPut)  # only the failed stripe, over gRPC
    reply = pb.PutResponse(statuses=[pb.PUT_STATUS_STORED] * 3)
    assert run.advance(reply) is None

    run, _ = _drive_to_together(plan())
    with pytest.raises(CapacityExhausted) as full:
        run.advance(((PutStatus.STORED,) * 3, CapacityExhausted("full")))
    assert "stripe 2 of 2 (pages 3..5 of the call)" in full.value.__notes__[0]


def test_a_striped_get_asks_each_part_and_fetches_a_failed_one_over_grpc() -> None:
    keys = page_keys(SCOPE, TOKENS)
    into = [bytearray(PAGE) for _ in keys]
    plan = get_op.get(
        SCOPE,
        keys,
        into,
        tokens=page_tokens(SCOPE, TOKENS),
        io_class=None,
        verify=None,
        settings=STRIPED,
    )
    run, together = _drive_to_together(plan)
    parts = cast(tuple[BulkGet, BulkGet], together.steps)
    assert [pb.GetRequest.FromString(s.request).keys for s in parts] == [
        b"".join(keys[:3]),
        b"".join(keys[3:]),
    ]
    step = run.advance((((None,) * 3, 0), BULK_FAILED))
    assert isinstance(step, StreamGet)
    assert step.request.keys == b"".join(keys[3:])

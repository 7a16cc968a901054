"""A striped put (client/core/put.py, client/core/stripes.py) must be accepted by the daemon's
key-chain check (kvstore/chain.py) whichever stripe the daemon reserves first: each stripe,
checked by itself on a node that holds no other page of the call, verifies with the chain
prefixes it carries, or the put goes whole.

The check here is the daemon's own (`first_unverified`, `prefix_keys`), run on each stripe's
PutBegin and headers as the plan sends them: a put of pages that branch (two continuations of
one prefix, the later one's parent in an earlier stripe but not the page just before it) was
cut into stripes the daemon refuses with ChainRejected when the later stripe lands first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import pytest
from conftest import make_scope
from hypothesis import given, settings
from hypothesis import strategies as st

from client.contract.page import PageHeader
from client.contract.types import IoClass, Limits, Page, PutStatus, build_pages
from client.core import put as put_op
from client.core.retry import RetryPolicy
from client.core.route import Route, Settings
from client.core.run import Run
from client.core.steps import BulkPut, Together
from client.core.stripes import Striping
from kvstore.chain import first_unverified, prefix_keys
from kvstore_pb import store_pb2 as pb

pytestmark = pytest.mark.unit

SCOPE = make_scope()
PAGE = SCOPE.page_payload_bytes
PT = SCOPE.layout.page_tokens
LIMITS = Limits(
    max_keys_per_call=0, max_page_bytes=0, max_message_bytes=0, chunk_bytes=0, lease_ttl_ms=0
)
ROUTE = Route(limits=LIMITS, bulk=True, bulk_lookups=True, bulk_stripes=True)


def _settings(stripes: int) -> Settings:
    return Settings(10.0, RetryPolicy(0), IoClass.NORMAL, 8 << 20, Striping(stripes, 1))


def _stripe_steps(
    pages: Sequence[Page], stripes: int, prefix_tokens: Sequence[int] = ()
) -> tuple[BulkPut, ...] | None:
    """The stripes the put plan sends for `pages`, or None when it sends the batch whole."""
    plan = put_op.put(
        SCOPE,
        pages,
        io_class=None,
        tier=None,
        chain_prefixes=(),
        prefix_tokens=prefix_tokens,
        settings=_settings(stripes),
        client_pid=1,
    )
    run = Run(plan)
    run.advance()
    step = run.advance(ROUTE)  # the Connect answered
    if isinstance(step, Together):
        return tuple(s for s in step.steps if isinstance(s, BulkPut))
    assert isinstance(step, BulkPut), step  # whole
    return None


def _refused_alone(
    step: BulkPut, stored: frozenset[bytes] | set[bytes] = frozenset()
) -> int | None:
    """The daemon's chain check of one stripe on a node holding no other page of the call
    (but `stored`): the index of the first page it refuses, or None."""
    begin = pb.PutBegin.FromString(step.begin)
    headers = [PageHeader.decode(bytes(h)) for h in step.headers]
    vouched = prefix_keys(SCOPE.digest, tuple(begin.chain_prefix), PT)
    links = [(h.key, h.parent) for h in headers]
    return first_unverified(
        SCOPE.digest, links, lambda k: SCOPE.digest if k in vouched or k in stored else None
    )


def _branch(tokens: Sequence[int], at: int, extra: Sequence[int]) -> Page:
    """The page after the first `at` full pages of `tokens` with token ids `extra`: a second
    continuation of that prefix."""
    return build_pages(SCOPE, [*tokens[: at * PT], *extra], [b"\x05" * PAGE], first_page=at)[0]


TOKENS = list(range(PT * 4))
CHAIN = build_pages(SCOPE, TOKENS, [bytes([i]) * PAGE for i in range(4)])


def test_a_branch_whose_parent_is_in_an_earlier_stripe_is_not_cut_where_it_is_refused() -> None:
    # A0 A1 B1: B1 continues A0, as A1 does; two stripes cut it [A0 A1] [B1]
    pages = [CHAIN[0], CHAIN[1], _branch(TOKENS, 1, [9] * PT)]
    steps = _stripe_steps(pages, 2)
    if steps is not None:
        for k, step in enumerate(steps):
            assert _refused_alone(step) is None, f"stripe {k + 1} is refused when it lands first"


def test_a_plain_chain_is_still_cut_and_each_stripe_verifies_alone() -> None:
    steps = _stripe_steps(CHAIN, 2)
    assert steps is not None and len(steps) == 2
    assert all(_refused_alone(s) is None for s in steps)


@settings(max_examples=60, deadline=None)
@given(
    parents=st.lists(st.integers(min_value=-1, max_value=6), min_size=2, max_size=7),
    stripes=st.integers(min_value=2, max_value=4),
)
def test_any_forest_of_pages_is_cut_only_into_stripes_that_verify_alone(
    parents: list[int], stripes: int
) -> None:
    """Page i continues the root (-1, or a parent index not before it) or page parents[i]."""
    pages: list[Page] = []
    paths: list[list[int]] = []  # each page's token ids from the scope digest on
    for i, p in enumerate(parents):
        base = paths[p] if 0 <= p < i else []
        path = [*base, *([100 + i] * PT)]
        paths.append(path)
        pages.append(build_pages(SCOPE, path, [bytes([i]) * PAGE], first_page=len(base) // PT)[0])
    steps = _stripe_steps(pages, stripes)
    if steps is None:
        return
    assert sum(len(s.headers) for s in steps) == len(pages)
    for k, step in enumerate(steps):
        assert _refused_alone(step) is None, f"stripe {k + 1} of {len(steps)}: {parents}"


def _checked_put(pages: Sequence[Page], stripes: int, per_call: int, prompt: Sequence[int]) -> int:
    """Drive a put plan of `pages` (after the prompt `prompt`, sent as its prefix tokens) over
    batches of `per_call` pages; check every stripe (and every whole batch) as the daemon
    checks it on a node that holds only the pages of earlier batches. The number of batches
    that went as stripes."""
    limits = Limits(
        max_keys_per_call=per_call,
        max_page_bytes=0,
        max_message_bytes=0,
        chunk_bytes=0,
        lease_ttl_ms=0,
    )
    plan = put_op.put(
        SCOPE,
        pages,
        io_class=None,
        tier=None,
        chain_prefixes=(),
        prefix_tokens=prompt,
        settings=_settings(stripes),
        client_pid=1,
    )
    run = Run(plan)
    run.advance()
    step = run.advance(Route(limits=limits, bulk=True, bulk_lookups=True, bulk_stripes=True))
    stored: set[bytes] = set()
    striped = 0
    for _ in range(len(pages) + 1):  # one step a batch
        if step is None:
            return striped
        sent = step.steps if isinstance(step, Together) else (step,)
        assert all(isinstance(s, BulkPut) for s in sent), step
        parts = cast(tuple[BulkPut, ...], sent)
        striped += isinstance(step, Together)
        for k, part in enumerate(parts):
            assert _refused_alone(part, stored) is None, f"part {k + 1} of {len(parts)}"
        outcomes = tuple((PutStatus.STORED,) * len(s.headers) for s in parts)
        for part in parts:
            stored.update(PageHeader.decode(bytes(h)).key for h in part.headers)
        step = run.advance(outcomes if isinstance(step, Together) else outcomes[0])
    raise AssertionError("the plan did not end")


@settings(max_examples=150, deadline=None)
@given(
    parents=st.lists(st.integers(min_value=-2, max_value=9), min_size=2, max_size=10),
    stripes=st.integers(min_value=2, max_value=4),
    per_call=st.integers(min_value=2, max_value=10),
)
def test_any_forest_after_a_prompt_over_batches_verifies_stripe_by_stripe(
    parents: list[int], stripes: int, per_call: int
) -> None:
    """Page i continues the scope digest (-1), the prompt before the call (-2, or an index
    not before it), or page parents[i]."""
    prompt = [50_000 + t for t in range(2 * PT)]
    pages: list[Page] = []
    paths: list[list[int]] = []
    for i, p in enumerate(parents):
        base = paths[p] if 0 <= p < i else [] if p == -1 else prompt
        path = [*base, *([200 + i] * PT)]
        paths.append(path)
        pages.append(build_pages(SCOPE, path, [bytes([i]) * PAGE], first_page=len(base) // PT)[0])
    # a page continuing the prompt verifies through the call's prefix tokens (whole, too)
    after_prompt = any(p == -2 or p >= i for i, p in enumerate(parents))
    _checked_put(pages, stripes, per_call, prompt if after_prompt else ())


def test_a_chain_after_a_prompt_over_batches_is_still_striped() -> None:
    prompt = [50_000 + t for t in range(2 * PT)]
    tokens = [*prompt, *range(PT * 8)]
    pages = build_pages(SCOPE, tokens, [bytes([i]) * PAGE for i in range(8)], first_page=2)
    assert _checked_put(pages, 2, 4, prompt) == 2  # both batches cut, every part verifies

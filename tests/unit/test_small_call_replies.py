"""The small calls' request and reply steps on the client (client/core/requests.py
`packed_keys`, client/core/replies.py `lookup_from_proto`): the shortcuts they take for the
common case (keys all well formed, a chain all in one tier) answer what the general path does,
and refuse what it refuses."""

from __future__ import annotations

import pytest

from client.contract.errors import InvalidArgument, StrataError
from client.contract.types import Tier
from client.core.replies import lookup_from_proto
from client.core.requests import packed_keys
from kvstore_pb import store_pb2 as pb

pytestmark = pytest.mark.unit


def test_packed_keys_joins_well_formed_keys_and_refuses_any_other() -> None:
    keys = [bytes([i]) * 16 for i in range(5)]
    assert packed_keys(keys) == b"".join(keys)
    assert packed_keys([]) == b""
    # a 15- and a 17-byte key add up to two whole keys: still refused, naming the first
    for bad in ([keys[0], b"a" * 15, b"b" * 17], [keys[0], bytearray(16)], [keys[0], "x" * 16]):
        with pytest.raises(InvalidArgument, match="16-byte bytes"):
            packed_keys(bad)  # type: ignore[arg-type]


def test_a_lookup_reply_in_one_tier_or_many_gives_each_hits_tier() -> None:
    one = lookup_from_proto(pb.LookupResponse(hit_count=4, tiers=[pb.TIER_SSD] * 4), asked=5)
    assert (one.hit_count, one.tiers) == (4, (Tier.SSD,) * 4)
    mixed = [pb.TIER_DRAM, pb.TIER_SSD, pb.TIER_GPU, pb.TIER_DRAM]
    many = lookup_from_proto(pb.LookupResponse(hit_count=4, tiers=mixed), asked=4)
    assert many.tiers == (Tier.DRAM, Tier.SSD, Tier.GPU, Tier.DRAM)
    assert lookup_from_proto(pb.LookupResponse(), asked=3).tiers == ()


@pytest.mark.parametrize("tiers", [[7, 7, 7], [pb.TIER_DRAM, 7, pb.TIER_DRAM]])
def test_a_lookup_reply_with_an_unknown_tier_is_malformed(tiers: list[int]) -> None:
    with pytest.raises(StrataError, match="unknown tier 7"):
        lookup_from_proto(pb.LookupResponse(hit_count=3, tiers=tiers), asked=3)  # type: ignore[arg-type]

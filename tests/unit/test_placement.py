"""Rendezvous placement, hot-page detection and member records (client/cluster/placement.py,
client/cluster/membership.py, client/cluster/etcd.py's pure helpers)."""

from __future__ import annotations

from collections import Counter

import pytest
import xxhash

from client.cluster.etcd import parse_endpoints, prefix_end
from client.cluster.membership import Member, TierCapacity, member_key, members_prefix
from client.cluster.placement import HotPages, plan, rank, replicas_of, score
from client.contract.errors import InvalidArgument

pytestmark = pytest.mark.unit

KEYS = [xxhash.xxh3_128_digest(i.to_bytes(4, "little")) for i in range(6000)]
NODES = [f"node-{i}" for i in range(5)]


def test_score_is_xxh3_of_node_id_and_key_and_stable() -> None:
    key = KEYS[0]
    assert score("a", key) == xxhash.xxh3_64_intdigest(b"a" + key)
    assert rank(key, ["b", "a", "c"]) == rank(key, ["c", "b", "a"])  # order-independent


def test_primary_placement_is_balanced() -> None:
    counts = Counter(replicas_of(k, NODES, 1)[0] for k in KEYS)
    expected = len(KEYS) / len(NODES)
    assert set(counts) == set(NODES)
    assert all(abs(c - expected) < 0.1 * expected for c in counts.values()), counts


def test_replicas_are_distinct_and_balanced() -> None:
    counts: Counter[str] = Counter()
    for k in KEYS:
        reps = replicas_of(k, NODES, 2)
        assert len(set(reps)) == 2
        counts.update(reps)
    expected = 2 * len(KEYS) / len(NODES)
    assert all(abs(c - expected) < 0.1 * expected for c in counts.values()), counts
    assert replicas_of(KEYS[0], ["only"], 3) == ("only",)
    with pytest.raises(InvalidArgument):
        replicas_of(KEYS[0], NODES, 0)


def test_a_joining_node_takes_only_its_share() -> None:
    before = {k: replicas_of(k, NODES, 1)[0] for k in KEYS}
    after = {k: replicas_of(k, [*NODES, "node-new"], 1)[0] for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "node-new" for k in moved)  # nothing moves between old nodes
    share = len(KEYS) / (len(NODES) + 1)
    assert abs(len(moved) - share) < 0.15 * share


def test_a_leaving_node_moves_only_its_own_pages() -> None:
    before = {k: replicas_of(k, NODES, 2) for k in KEYS}
    rest = [n for n in NODES if n != "node-2"]
    for k in KEYS:
        after = replicas_of(k, rest, 2)
        if "node-2" not in before[k]:
            assert after == before[k]
        else:  # the surviving replica stays, the next node in rank order joins
            survivor = next(n for n in before[k] if n != "node-2")
            assert survivor in after


def test_plan_groups_pages_per_node_with_hot_extras() -> None:
    keys = KEYS[:10]
    p = plan(keys, NODES, 2, extra=[1 if i == 3 else 0 for i in range(10)])
    assert [len(r) for r in p.replicas] == [3 if i == 3 else 2 for i in range(10)]
    for node, ix in p.by_node.items():
        assert list(ix) == sorted(ix)
        assert all(node in p.replicas[i] for i in ix)
    assert sum(len(ix) for ix in p.by_node.values()) == 21
    assert plan(keys, [], 2).by_node == {}


def test_hot_pages_window_and_threshold() -> None:
    hot = HotPages(threshold=3, window_s=10.0, max_keys=2)
    key = KEYS[0]
    for t in (0.0, 1.0, 2.0):
        hot.record(key, t)
    assert not hot.is_hot(key, 2.0)  # 3 reads: not more than the threshold
    hot.record(key, 3.0)
    assert hot.is_hot(key, 3.0)
    assert not hot.is_hot(key, 10.5)  # the oldest of the last 4 reads left the window
    hot.record(KEYS[1], 4.0)
    hot.record(KEYS[2], 4.0)  # bounded memory: the least recently read key goes
    assert len(hot) == 2 and not hot.is_hot(key, 4.0)


def test_member_record_round_trip_and_keys() -> None:
    m = Member("n1", "127.0.0.1:7700", "h", (TierCapacity("dram", 1 << 30),))
    assert Member.decode(m.encode()) == m
    assert member_key("c", "n1") == b"/strata/c/members/n1"
    assert members_prefix("c") == b"/strata/c/members/"
    for bad in (b"", b"{}", b"[1]", b'{"node_id": "", "address": "x"}'):
        with pytest.raises(InvalidArgument):
            Member.decode(bad)
    with pytest.raises(InvalidArgument):
        member_key("c/d", "n1")


def test_etcd_helpers() -> None:
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert parse_endpoints("127.0.0.1:2379, http://h:1/") == ("http://127.0.0.1:2379", "http://h:1")

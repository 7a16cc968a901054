"""Lease table: grant, get, renew, release and expiry on a fake clock."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvstore.errors import InvalidArgument, LeaseExpired
from kvstore.leases import NO_LEASE, Lease, LeaseKind, LeaseTable

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def table(clock: FakeClock) -> LeaseTable:
    return LeaseTable(clock)


def test_grant_and_get(table: LeaseTable, clock: FakeClock) -> None:
    lease = table.grant(LeaseKind.READ, [b"a" * 16, b"b" * 16], ttl_s=5.0)
    assert lease == Lease(1, LeaseKind.READ, (b"a" * 16, b"b" * 16), 105.0)
    assert lease.lease_id != NO_LEASE
    assert table.get(1) is lease
    assert lease.remaining_s(clock.now) == 5.0
    assert len(table) == 1
    assert table.next_expiry() == 105.0


def test_ids_start_at_one_and_are_never_reused(table: LeaseTable) -> None:
    ids = []
    for _ in range(5):
        lease = table.grant(LeaseKind.RESERVE, [], ttl_s=1.0)
        ids.append(lease.lease_id)
        table.release(lease.lease_id)
    assert ids == [1, 2, 3, 4, 5]
    assert len(table) == 0


def test_expired_lease_raises_but_stays_for_expire_due(table: LeaseTable, clock: FakeClock) -> None:
    lease = table.grant(LeaseKind.READ, [b"k" * 16], ttl_s=2.0)
    clock.now += 2.0  # expiry is inclusive
    calls: list[Callable[[], Lease]] = [
        lambda: table.get(lease.lease_id),
        lambda: table.renew(lease.lease_id, 10.0),
        lambda: table.release(lease.lease_id),
    ]
    for call in calls:
        with pytest.raises(LeaseExpired):
            call()
    assert len(table) == 1  # still there: expire_due hands it to the store exactly once
    assert table.expire_due() == [lease]
    assert table.expire_due() == []
    assert len(table) == 0
    with pytest.raises(LeaseExpired):
        table.get(lease.lease_id)


def test_unknown_lease_raises(table: LeaseTable) -> None:
    with pytest.raises(LeaseExpired):
        table.get(NO_LEASE)
    with pytest.raises(LeaseExpired):
        table.release(42)


def test_renew_extends_and_old_expiry_is_ignored(table: LeaseTable, clock: FakeClock) -> None:
    lease = table.grant(LeaseKind.READ, [b"k" * 16], ttl_s=1.0)
    clock.now += 0.5
    renewed = table.renew(lease.lease_id, 3.0)
    assert renewed.expires_at == 103.5 and renewed.keys == lease.keys
    assert table.get(lease.lease_id) == renewed
    clock.now = 102.0  # past the original expiry
    assert table.expire_due() == []
    assert table.next_expiry() == 103.5
    clock.now = 103.5
    assert table.expire_due() == [renewed]
    assert table.next_expiry() is None


def test_release_removes(table: LeaseTable, clock: FakeClock) -> None:
    a = table.grant(LeaseKind.READ, [], ttl_s=1.0)
    b = table.grant(LeaseKind.READ, [], ttl_s=2.0)
    assert table.release(a.lease_id) == a
    assert table.next_expiry() == b.expires_at
    clock.now += 10
    assert table.expire_due() == [b]


def test_expire_due_in_expiry_order(table: LeaseTable, clock: FakeClock) -> None:
    c = table.grant(LeaseKind.READ, [], ttl_s=3.0)
    a = table.grant(LeaseKind.RESERVE, [], ttl_s=1.0)
    b = table.grant(LeaseKind.READ, [], ttl_s=2.0)
    d = table.grant(LeaseKind.READ, [], ttl_s=9.0)
    clock.now += 3.0
    assert table.expire_due() == [a, b, c]
    assert len(table) == 1 and table.get(d.lease_id) == d


@pytest.mark.parametrize("ttl", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_ttl(table: LeaseTable, ttl: float) -> None:
    with pytest.raises(InvalidArgument):
        table.grant(LeaseKind.READ, [], ttl_s=ttl)
    lease = table.grant(LeaseKind.READ, [], ttl_s=1.0)
    with pytest.raises(InvalidArgument):
        table.renew(lease.lease_id, ttl)


def test_many_renewals_keep_the_heap_small(table: LeaseTable, clock: FakeClock) -> None:
    lease = table.grant(LeaseKind.READ, [], ttl_s=1.0)
    for _ in range(1000):
        clock.now += 0.5
        lease = table.renew(lease.lease_id, 1.0)
    assert len(table._heap) <= 2 * len(table) + 65
    clock.now += 1.0
    assert table.expire_due() == [lease]

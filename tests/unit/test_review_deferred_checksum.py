"""A same-host put leaves its payload checksum to the daemon (FLAG_CHECKSUM_DEFERRED): whatever
tier the page is in when a remote reader asks for it, the header that reader gets carries the
checksum of the page's bytes (kvstore/store.py `acquire`, `same_host=False`)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import chain, make_scope

from client.contract.page import PageHeader, checksum_deferred
from client.transports.shm import reserve_headers
from kvstore.config import load_config
from kvstore.keys import Tier
from kvstore.store import Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    page = make_scope("ns").page_payload_bytes
    config = load_config(
        env={},
        overrides={
            "data_dir": str(tmp_path),
            "dram.capacity_bytes": "8MiB",
            "dram.segment_name": f"strata-test-{uuid.uuid4().hex[:12]}",
            "ssd.enabled": "false",
            "gpu.enabled": "true",
            "gpu.device": "cpu",
            "gpu.capacity_bytes": str(8 * page),
        },
    )
    s = Store(config)
    try:
        yield s
    finally:
        s.close()


def _same_host_put(store: Store, tier: Tier | None) -> list:  # type: ignore[type-arg]
    scope = make_scope("ns")
    pages = chain(scope, 3)
    raw = reserve_headers(pages)
    assert all(checksum_deferred(h) for h in raw)  # nothing hashed by the writer
    res = store.reserve(scope, raw, same_host=True)
    for slot, page in zip(res.slots, pages, strict=True):
        assert slot.reserved
        store.tiers.dram.view(slot.offset, slot.length)[:] = page.payload
    store.commit(res.lease_id, tier)
    return pages


@pytest.mark.parametrize("tier", [None, Tier.GPU], ids=["dram", "gpu"])
def test_a_remote_reader_of_a_deferred_page_gets_its_checksum_in_any_tier(
    store: Store, tier: Tier | None
) -> None:
    pages = _same_host_put(store, tier)
    scope = make_scope("ns")
    keys = [p.header.key for p in pages]
    if tier is Tier.GPU:
        assert all(store.index.get(k).gpu is not None for k in keys)  # type: ignore[union-attr]
    acq = store.acquire(scope.digest, keys)  # a remote reader (gRPC, TCP, UCX)
    try:
        for held, page in zip(acq.pages, pages, strict=True):
            assert held is not None
            assert not checksum_deferred(held.header), "a remote reader got a deferred header"
            header = PageHeader.decode(held.header)
            header.verify_payload(store.tiers.dram.view(held.offset, held.length))
            assert header == page.header
    finally:
        store.release(acq.lease_id)
    # a same-host reader copies out of DRAM itself: any of the two forms is right for it
    acq = store.acquire(scope.digest, keys, same_host=True)
    store.release(acq.lease_id)
    assert all(h is not None for h in acq.pages)


@pytest.mark.parametrize("background_pass", [False, True], ids=["at-once", "after-the-pass"])
def test_a_same_host_put_with_a_bad_checksum_placed_in_the_gpu_tier_is_never_served(
    store: Store, background_pass: bool
) -> None:
    """A writer that sends its checksum has it checked before any reader gets the page, whatever
    tier its writer placed it in (the mover's pass must not forget a page it could not check)."""
    scope = make_scope("ns")
    pages = chain(scope, 2, seed=5)
    sent = [p.header.encode() for p in pages]  # checksums sent: the daemon checks them
    res = store.reserve(scope, sent, same_host=True)
    for slot, page in zip(res.slots, pages, strict=True):
        store.tiers.dram.view(slot.offset, slot.length)[:] = page.payload
    store.tiers.dram.view(res.slots[1].offset, 1)[:] = bytes([page_byte_flipped(pages[1])])
    store.commit(res.lease_id, Tier.GPU)
    keys = [p.header.key for p in pages]
    assert store.index.get(keys[0]).gpu is not None  # type: ignore[union-attr]
    if background_pass:
        store.verify_same_host_puts()
    for same_host in (True, False):
        acq = store.acquire(scope.digest, keys, same_host=same_host)
        store.release(acq.lease_id)
        assert acq.pages[0] is not None
        assert acq.pages[1] is None, f"a damaged page was served (same_host={same_host})"
    assert store.stats().active_leases == 0


def page_byte_flipped(page: object) -> int:
    return page.payload[0] ^ 0xFF  # type: ignore[attr-defined, no-any-return]
